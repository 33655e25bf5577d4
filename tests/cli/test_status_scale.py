"""`broker status` reads a bounded, indexed amount of the ledger: the same queries for 10 runs as for 10,000."""

from __future__ import annotations

from datetime import timedelta

from broker.cli.status import status_data
from broker.core.model import utcnow
from broker.money.ledger import Ledger


def _fill(led: Ledger, n: int) -> None:
    """``n`` ended runs of two terminated instances each, newest last."""
    t0 = utcnow() - timedelta(days=30)
    runs, res = [], []
    for i in range(n):
        c, e = (t0 + timedelta(seconds=60 * i)).isoformat(), (t0 + timedelta(seconds=60 * i + 600)).isoformat()
        runs.append((f"run-{i:05d}", "bench", "vast", "succeeded", c))
        res += [(f"r-{i:05d}-{k}", f"run-{i:05d}", "vast", f"n{k}", f"i-{i}-{k}", 0.5, c, e) for k in range(2)]
    with led._tx():
        led._db.executemany("INSERT INTO runs (id, name, provider, status, created_at, recipe, topology, exit_codes, "
                            "log_paths) VALUES (?, ?, ?, ?, ?, '{}', 'multi-node', '{}', '{}')", runs)
        led._db.executemany("INSERT INTO resources (id, run_id, provider, kind, name, provider_id, state, "
                            "usd_per_hour, created_at, terminated_at, attrs) "
                            "VALUES (?, ?, ?, 'instance', ?, ?, 'terminated', ?, ?, ?, '{}')", res)


def _queries(led: Ledger, n_runs: int) -> list[str]:
    seen: list[str] = []
    led._db.set_trace_callback(seen.append)
    try:
        data = status_data(led, limit=20)
    finally:
        led._db.set_trace_callback(None)
    assert len(data["runs"]) == min(20, n_runs)
    assert all(len(r["cost"]) and r["cost"]["spent_usd"] > 0 for r in data["runs"])  # each run's resources read
    return seen


def test_status_asks_the_same_few_queries_for_10_and_500_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    counts = {}
    for n in (10, 500):
        led = Ledger(tmp_path / f"ledger-{n}.sqlite")
        _fill(led, n)
        counts[n] = len(_queries(led, n))
        led.close()
    # one query for the runs and one for all their resources, not one (or two) per row shown
    assert counts[10] == counts[500] <= 8, counts


def test_status_queries_use_an_index_not_a_scan_of_every_run(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    led = Ledger(tmp_path / "ledger.sqlite")
    _fill(led, 50)
    for q in _queries(led, 50):
        if q.lstrip().upper().startswith("SELECT") and ("FROM runs" in q or "FROM resources" in q):
            plan = " | ".join(r[3] for r in led._db.execute("EXPLAIN QUERY PLAN " + q).fetchall())
            assert not any(step.strip() in ("SCAN runs", "SCAN resources") for step in plan.split("|")), (q, plan)
    led.close()
