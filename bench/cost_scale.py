"""`broker cost` on a large ledger against `broker cost` on an empty one, in the same run.

Fills a ledger (in a temporary BROKER_HOME) with N ended runs of one resource each, then alternates
`broker cost` on the empty home and on the full one; prints the CPU seconds and peak RSS of each (medians), the
ratio of the full one to the empty one, and the load average.  Goal: <= 1 s and flat memory at 110k runs
(peak RSS about the empty ledger's).

    python bench/cost_scale.py [--runs 110000] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def fill(home: Path, n: int) -> None:
    os.environ["BROKER_HOME"] = str(home)
    from broker.money.ledger import Ledger

    led = Ledger(home / "ledger.sqlite")
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    runs, res = [], []
    for i in range(n):
        c = t0 + timedelta(seconds=i * 7, microseconds=i % 1_000_000)
        e = c + timedelta(seconds=600 + i % 3600)
        prov = ("vast", "oci", "aws", "local")[i % 4]
        runs.append((f"run-{i:07d}", "bench", prov, "succeeded", c.isoformat()))
        res.append((f"r-{i:07d}", f"run-{i:07d}", prov, f"i-{i}", "terminated", 0.5 + i % 7, c.isoformat(),
                    e.isoformat(), '{"min_billed_seconds": 60}'))
    with led._tx():
        led._db.executemany("INSERT INTO runs (id, name, provider, status, created_at, recipe, topology, exit_codes, "
                            "log_paths) VALUES (?, ?, ?, ?, ?, '{}', 'local', '{}', '{}')", runs)
        led._db.executemany("INSERT INTO resources (id, run_id, provider, kind, name, provider_id, state, "
                            "usd_per_hour, created_at, terminated_at, attrs) "
                            "VALUES (?, ?, ?, 'instance', 'n0', ?, ?, ?, ?, ?, ?)", res)
    led.close()


def one(home: Path, extra: list[str]) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, peak RSS MiB) of one `broker cost` subprocess."""
    import time

    env = dict(os.environ, BROKER_HOME=str(home), PYTHONPATH=str(REPO))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "broker", "cost", *extra], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=600)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"broker cost failed: {err.decode()[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, after.ru_maxrss / 1024  # ru_maxrss of children: the largest so far (KiB)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=110_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="time `broker cost --json` (lists every run)")
    a = ap.parse_args()
    extra = ["--json"] if a.json else []
    with tempfile.TemporaryDirectory() as d:
        empty, full = Path(d) / "empty", Path(d) / "full"
        empty.mkdir(mode=0o700)
        full.mkdir(mode=0o700)
        fill(full, a.runs)
        one(empty, extra)  # creates the empty ledger; warms the page cache for both
        one(full, extra)
        e_cpu, f_cpu, ratios, f_wall = [], [], [], []
        for _ in range(a.rounds):
            ec, _ew, _ = one(empty, extra)
            fc, fw, _ = one(full, extra)
            e_cpu.append(ec)
            f_cpu.append(fc)
            f_wall.append(fw)
            ratios.append(fc / ec)
        # peak RSS apart (ru_maxrss of children is the largest child so far): empty first, then full
        rss_empty = subprocess.run([sys.executable, "-c", RSS, str(empty), *extra], capture_output=True, text=True,
                                   env=dict(os.environ, PYTHONPATH=str(REPO))).stdout.strip()
        rss_full = subprocess.run([sys.executable, "-c", RSS, str(full), *extra], capture_output=True, text=True,
                                  env=dict(os.environ, PYTHONPATH=str(REPO))).stdout.strip()
    la = os.getloadavg()
    print(f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    print(f"broker cost{' --json' if a.json else ''}: {a.runs} runs vs an empty ledger, {a.rounds} alternated pairs")
    print(f"  empty ledger: CPU median {statistics.median(e_cpu):.3f} s; peak RSS {rss_empty} MiB")
    print(f"  {a.runs} runs: CPU median {statistics.median(f_cpu):.3f} s (wall {statistics.median(f_wall):.3f} s); "
          f"peak RSS {rss_full} MiB")
    print(f"  ratio full/empty (median of paired ratios): {statistics.median(ratios):.2f}x  "
          f"pairs {' '.join(f'{r:.2f}' for r in ratios)}")
    print(f"goal <= 1 s CPU at {a.runs} runs: {'met' if statistics.median(f_cpu) <= 1.0 else 'NOT met'}")


RSS = """import os, resource, subprocess, sys
p = subprocess.run([sys.executable, "-m", "broker", "cost", *sys.argv[2:]],
                   env=dict(os.environ, BROKER_HOME=sys.argv[1]), stdout=subprocess.DEVNULL)
print(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}")"""


if __name__ == "__main__":
    main()
