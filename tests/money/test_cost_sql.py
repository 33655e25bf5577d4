"""`broker cost` and the settling of dead CLIs see every run: costs are summed in SQL with the rule of
broker.money.accounting.resource_cost (checked row by row against it), with no cap on the number of runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from fractions import Fraction

import pytest

from broker.money.accounting import ACTIVE_STATUSES, resource_cost
from broker.cli.day2 import cost_data
from broker.money.ledger import Ledger
from broker.core.records import Resource, Run

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)


def _bulk(led: Ledger, runs: list[tuple], resources: list[tuple]) -> None:
    """Insert rows as the ledger stores them (ISO text times), fast: 100,000s of Run objects would take minutes."""
    db = led._db
    with led._tx():
        db.executemany("INSERT INTO runs (id, name, provider, status, created_at, pid, recipe, topology, exit_codes, "
                       "log_paths) VALUES (?, ?, ?, ?, ?, ?, '{}', 'local', '{}', '{}')", runs)
        db.executemany("INSERT INTO resources (id, run_id, provider, kind, name, provider_id, state, usd_per_hour, "
                       "created_at, terminated_at, attrs) VALUES (?, ?, ?, 'instance', 'n0', ?, ?, ?, ?, ?, ?)",
                       resources)


def test_cost_over_110k_runs_is_exact_and_lists_every_run(broker_home):
    n = 110_003
    led = Ledger()
    runs, resources = [], []
    want = 0  # in $ x 4 x 1000 x 3600: integers keep the expected total exact
    for i in range(n):
        created = T0 + timedelta(seconds=i, microseconds=(i * 7919) % 1_000_000)
        ms = (3600 + i % 97) * 1000 + (i * 31) % 1000  # ms-resolution ages
        ended = created + timedelta(milliseconds=ms)
        quarters = i % 5 + 2  # $0.50 .. $1.50 per hour
        prov = ("aws", "vast", "oci")[i % 3]  # real money only: the fake cloud's is kept out of the total
        runs.append((f"run-{i:06d}", "t", prov, "succeeded", created.isoformat(), None))
        resources.append((f"r-{i:06d}", f"run-{i:06d}", prov, f"i-{i}", "terminated", quarters / 4,
                          created.isoformat(), ended.isoformat(), "{}"))
        want += quarters * ms
    want = Fraction(want, 4 * 1000 * 3600)
    _bulk(led, runs, resources)
    data = cost_data(led)
    assert len(data["runs"]) == n == data["run_count"]  # the old list_runs(limit=100000) dropped 10,003 of them
    assert data["total_usd"] == pytest.approx(float(want), abs=2e-6)
    assert sum(data["by_provider"].values()) == pytest.approx(float(want), abs=5e-6)
    newest = cost_data(led, rows=50)
    assert [r["run"] for r in newest["runs"]] == [f"run-{i:06d}" for i in range(n - 1, n - 51, -1)]
    assert newest["total_usd"] == data["total_usd"] and newest["run_count"] == n
    only = cost_data(led, provider="vast", since=T0 + timedelta(seconds=100_000))
    assert {r["provider"] for r in only["runs"]} == {"vast"} and set(only["by_provider"]) == {"vast"}
    assert only["run_count"] == len([i for i in range(100_000, n) if i % 3 == 1])


def _python_spent(led: Ledger, run_id: str, now: datetime) -> float:
    return sum(resource_cost(r, None, now).spent_usd for r in led.resources(run_id))


@pytest.mark.parametrize("case", [
    dict(state="running", provider_id="i-1"),  # live: until now
    dict(state="terminated", provider_id="i-1", end=timedelta(seconds=90, microseconds=123457)),
    dict(state="terminated", provider_id=None, end=timedelta(hours=3)),  # never created: $0
    dict(state="terminated", provider_id="", end=timedelta(hours=3)),
    dict(state="terminated", provider_id="i-1", end=timedelta(seconds=5), attrs={"min_billed_seconds": 60}),
    dict(state="terminated", provider_id="i-1", end=timedelta(seconds=5), attrs={"min_billed_seconds": "60"}),
    dict(state="running", provider_id=None),  # a create in flight bills
    dict(state="unknown", provider_id=None, attrs={"min_billed_seconds": 60}),  # no minimum before an id
    dict(state="terminated", provider_id="i-1", end=None),  # terminated without a time: until now
    dict(state="terminated", provider_id="i-1", end=-timedelta(seconds=30)),  # clock skew: never negative
    dict(state="running", provider_id="i-1", created=T0.replace(microsecond=999_999)),
    dict(state="running", provider_id="i-1", created=datetime(2026, 3, 1, 14, 0, 0, 250_000,
                                                              tzinfo=timezone(timedelta(hours=2)))),
])
def test_sql_sum_matches_resource_cost_row_by_row(broker_home, case):
    led = Ledger()
    created = case.get("created", T0.replace(microsecond=654_321))
    now = T0 + timedelta(hours=1, microseconds=777_777)
    led.create_run(Run(id="run-a", name="a", provider="fake", status="running", created_at=created))
    r = led.record_intent("run-a", "fake", "instance", "n0", usd_per_hour=3.7, attrs=case.get("attrs"))
    end = case.get("end")
    fields = {"created_at": created, "state": case["state"], "provider_id": case["provider_id"]}
    led.update_resource(r.id, **fields)
    led._db.execute("UPDATE resources SET terminated_at = ? WHERE id = ?",
                    ((created + end).isoformat() if end is not None else None, r.id))
    got = led.run_costs(now)
    assert len(got) == 1
    assert got[0]["usd"] == pytest.approx(_python_spent(led, "run-a", now), rel=1e-12, abs=1e-12)


def test_several_resources_and_a_run_without_any(broker_home):
    led = Ledger()
    now = T0 + timedelta(hours=2)
    for rid in ("run-a", "run-b"):
        led.create_run(Run(id=rid, name=rid, provider="fake", status="succeeded", created_at=T0))
    for rate in (1.0, 2.5, 0.125):
        r = led.record_intent("run-a", "fake", "volume" if rate < 1 else "instance", "x", usd_per_hour=rate)
        led.update_resource(r.id, created_at=T0, provider_id="p", state="terminated",
                            terminated_at=T0 + timedelta(minutes=30))
    rows = {r["run"]: r["usd"] for r in led.run_costs(now)}
    assert rows == {"run-a": pytest.approx(_python_spent(led, "run-a", now)), "run-b": 0.0}
    assert rows["run-a"] == pytest.approx(3.625 / 2)
    assert led.cost_totals(now) == {"fake": (2, pytest.approx(3.625 / 2))}


def test_settle_runs_sees_the_oldest_of_more_than_100000_active_runs(broker_home):
    """One dead CLI behind 100,000 newer active runs: the old limit=100000 never looked at it."""
    from broker.cli.status import settle_runs

    led = Ledger()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    runs = [(f"run-{i:06d}", "t", "local", ACTIVE_STATUSES[i % len(ACTIVE_STATUSES)],
             (T0 + timedelta(seconds=i)).isoformat(), os.getpid() if i % 1000 == 0 else None)
            for i in range(1, 100_001)]  # a few live CLIs (this process); the rest never recorded a pid
    runs.append(("run-oldest", "t", "local", "running", T0.isoformat(), dead.pid))
    _bulk(led, runs, [])
    assert settle_runs(led, T0 + timedelta(days=1)) == ["run-oldest"]
    assert led.get_run("run-oldest").status == "interrupted"


def test_cost_cli_counts_every_run_in_the_table(cli_env, broker_home):
    led = Ledger()
    runs = [(f"run-{i:03d}", "t", "vast", "succeeded", (T0 + timedelta(seconds=i)).isoformat(), None)
            for i in range(60)]
    res = [(f"r-{i:03d}", f"run-{i:03d}", "vast", str(1000 + i), "terminated", 1.0, (T0 + timedelta(seconds=i)).isoformat(),
            (T0 + timedelta(seconds=i, hours=1)).isoformat(), None) for i in range(60)]
    _bulk(led, runs, res)
    p = subprocess.run([sys.executable, "-m", "broker", "cost"], env=cli_env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "10 older run(s)" in p.stdout and "total: $60.00 over 60 run(s)" in p.stdout
    j = json.loads(subprocess.run([sys.executable, "-m", "broker", "cost", "--json"], env=cli_env,
                                  capture_output=True, text=True, timeout=120).stdout)
    assert len(j["runs"]) == 60 and j["total_usd"] == pytest.approx(60.0)
