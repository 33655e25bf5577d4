"""`broker status` on a ledger of 10,000 runs against 10 runs and against `python -c pass`, in the same run.

Fills two real ledgers (temporary BROKER_HOMEs, the product's schema) with ended runs of two resources each: a small
one (``--small``, 10 runs) and a large one (``--runs``, 10,000).  Then alternates, round by round (the order
reversed every other round), `python -c pass`, `broker status --no-refresh` on the small home and on the large one;
each child's CPU (user + system) and peak RSS come from ``os.wait4`` (its own rusage, not the largest child so far).
Prints the medians, the median of the per-round ratios to `python -c pass` (paired: a load change between rounds
cancels out), large/small (flat in the number of runs: about 1.0) and the load average.  Goal: <= 4x `python -c
pass` CPU at 10,000 runs, flat.

    .venv/bin/python bench/status_scale.py [--runs 10000] [--small 10] [--rounds 11] [--full]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def fill(home: Path, n: int) -> None:
    """``n`` ended runs (one of every 50 failed, with a message), two terminated instances each, written with the
    product's own Ledger (its schema and indexes) in one transaction."""
    sys.path.insert(0, str(REPO))
    from broker.money.ledger import Ledger

    led = Ledger(home / "ledger.sqlite")
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    runs, res = [], []
    for i in range(n):
        c = t0 + timedelta(seconds=i * 97)
        s, e = c + timedelta(seconds=30), c + timedelta(seconds=600 + i % 3600)
        prov = ("vast", "oci", "aws", "local")[i % 4]
        failed = i % 50 == 7
        runs.append((f"run-{i:07d}", f"ddp-{i % 13}", prov, "failed" if failed else "succeeded", c.isoformat(),
                     s.isoformat(), e.isoformat(), (c + timedelta(hours=2)).isoformat(), 5.0,
                     '{"0": 1, "1": 0}' if failed else '{"0": 0, "1": 0}',
                     "node 0 exited 1: ValueError: bad batch" if failed else None,
                     str(home / "runs" / f"run-{i:07d}")))
        for k in range(2):
            res.append((f"r-{i:07d}-{k}", f"run-{i:07d}", prov, f"n{k}", f"i-{i}-{k}", 0.5 + i % 7, c.isoformat(),
                        s.isoformat(), e.isoformat(), (c + timedelta(hours=2)).isoformat(), "cli",
                        '{"min_billed_seconds": 60}'))
    with led._tx():
        led._db.executemany(
            "INSERT INTO runs (id, name, provider, status, created_at, started_at, ended_at, deadline, budget_usd, "
            "exit_codes, message, run_dir, recipe, topology, log_paths) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '{}', 'multi-node', '{}')", runs)
        led._db.executemany(
            "INSERT INTO resources (id, run_id, provider, kind, name, provider_id, state, usd_per_hour, created_at, "
            "running_since, terminated_at, deadline, terminated_by, attrs) "
            "VALUES (?, ?, ?, 'instance', ?, ?, 'terminated', ?, ?, ?, ?, ?, ?, ?)", res)
    led.close()


def one(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, peak RSS MiB) of one child, from its own rusage (``os.wait4``)."""
    t = time.perf_counter()
    p = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"`{' '.join(argv)}` exited {p.returncode}: {err.decode()[-2000:]}")
    return ru.ru_utime + ru.ru_stime, wall, ru.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--small", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--full", action="store_true",
                    help="also time the full command on the large home (Typer, rich, the pydantic records: the "
                         "parser-free start of broker.cli.faststatus switched off), paired in the same rounds")
    ap.add_argument("--fill", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.fill:
        fill(Path(a.fill), a.runs)
        return
    script = Path(sys.executable).parent / "broker"
    broker = [str(script)] if script.exists() else [sys.executable, "-m", "broker"]
    with tempfile.TemporaryDirectory() as d:
        homes = {"small": Path(d) / "small", "large": Path(d) / "large"}
        for h in homes.values():
            h.mkdir(mode=0o700)
        # filled in a child: a child's peak RSS starts from its parent's at the fork, so this process stays small
        for k, n in (("small", a.small), ("large", a.runs)):
            subprocess.run([sys.executable, __file__, "--fill", str(homes[k]), "--runs", str(n)], check=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_", "BROKER_"))}
        base.update(COLUMNS="100", PYTHONPATH=str(REPO))
        cmds = {"python -c pass": ([sys.executable, "-c", "pass"], base)}
        for k, h in homes.items():
            cmds[f"status {k}"] = ([*broker, "status", "--no-refresh"], {**base, "BROKER_HOME": str(h),
                                                                          "HOME": str(h)})
        if a.full:
            full = ("import sys\nfrom broker.cli import faststatus\nfaststatus.run = lambda limit: False\n"
                    "from broker.cli.app import main\nmain(sys.argv[1:])")
            cmds["full large"] = ([sys.executable, "-c", full, "status", "--no-refresh"],
                                  cmds["status large"][1])
        for argv, env in cmds.values():  # warm the page cache; each must run
            one(argv, env)
        got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cmds}
        order = list(cmds)
        for r in range(a.rounds):
            for k in (order if r % 2 == 0 else order[::-1]):
                got[k].append(one(*cmds[k]))
    la = os.getloadavg()
    print(f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} CPUs (other engineers' work)")
    print(f"broker status --no-refresh, {a.small} vs {a.runs} runs (2 resources each), {a.rounds} alternated rounds")
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
               statistics.median(x[2] for x in v)) for k, v in got.items()}
    for k, (cpu, wall, rss) in med.items():
        print(f"  {k:<16}: CPU {cpu * 1000:7.1f} ms  wall {wall * 1000:7.1f} ms  peak RSS {rss:5.1f} MiB")
    base_cpu = [x[0] for x in got["python -c pass"]]
    for k in ("status small", "status large", *(["full large"] if a.full else [])):
        ratios = [x[0] / b for x, b in zip(got[k], base_cpu)]
        print(f"  {k} / python -c pass (CPU, median of paired ratios): {statistics.median(ratios):.2f}x")
    flat = [l[0] / s[0] for l, s in zip(got["status large"], got["status small"])]
    print(f"  large / small (CPU, median of paired ratios): {statistics.median(flat):.2f}x; "
          f"peak RSS {med['status large'][2] - med['status small'][2]:+.1f} MiB")
    big = statistics.median(x[0] / b for x, b in zip(got["status large"], base_cpu))
    print(f"goal <= 4x python -c pass at {a.runs} runs: {'met' if big <= 4.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
