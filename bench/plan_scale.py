"""Planner scale and CLI start-up benchmark.

Prints, for 1k, 10k and 100k synthetic offers (a Vast-like market plus OCI/AWS shapes, with quotas and capacity
facts, one capacity fact per Vast host as the live adapter reports), the median time of one ``broker.plan.planner.plan`` call and the growth ratio to the previous size (10x more
offers -> ~10x time means linear).  Offer objects are built before timing: the planner's own work is measured.
Then the start-up time of ``python -m broker --help`` and of ``python -m broker plan --budget 5`` (offline, no
credentials) beside ``python -c pass``, each the median of several runs, as a ratio.

Run: ``python bench/plan_scale.py [--repeat 3] [--starts 5]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.core.model import Capacity, Offer, Quota, Requirements  # noqa: E402
from broker.plan.planner import plan  # noqa: E402

T0 = datetime(2026, 11, 29, tzinfo=timezone.utc)
GPUS = [("RTX 3090", 24.0, 0.16), ("RTX 4090", 23.99, 0.38), ("RTX 4070S Ti", 15.99, 0.17), ("A100 SXM4", 40.0, 0.75),
        ("H100 SXM", 79.65, 1.9), ("RTX 3060", 12.0, 0.1), ("L40S", 44.99, 0.6)]
SHAPES = [("oci", "VM.GPU.A10.1", "A10", 1, 24, 2.0, 30), ("oci", "VM.GPU.A10.2", "A10", 2, 24, 4.0, 60),
          ("aws", "g5.xlarge", "A10G", 1, 24, 1.006, 4), ("aws", "g4dn.xlarge", "T4", 1, 16, 0.526, 4),
          ("aws", "g5.12xlarge", "A10G", 4, 24, 5.672, 48)]


def synthetic(n: int, seed: int = 0) -> list[Offer]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 10 == 0:  # one in ten: an OCI / AWS shape in some zone
            p, it, g, c, mem, usd, vcpus = SHAPES[rng.randrange(len(SHAPES))]
            region = "us-ashburn-1" if p == "oci" else "us-east-1"
            out.append(Offer(provider=p, offer_id=f"{it}-{i}", instance_type=it, region=region,
                             zone=rng.choice([None, "AD-1", "AD-2"]) if p == "oci" else None, gpu_name=g,
                             gpu_count=c, gpu_mem_gib=mem, vcpus=vcpus, usd_per_hour=usd * rng.uniform(0.95, 1.05),
                             storage_usd_per_gib_month=0.08, min_billed_seconds=60, private_network=True,
                             price_source="bench", price_time=T0))
            continue
        g, mem, base = GPUS[rng.randrange(len(GPUS))]
        c = rng.choice([1, 1, 2, 2, 4, 8])
        out.append(Offer(provider="vast", offer_id=str(1000000 + i), instance_type=f"{c}x {g}", region="Somewhere, US",
                         gpu_name=g, gpu_count=c, gpu_mem_gib=mem, vcpus=8 * c, usd_per_hour=round(base * c * rng.uniform(0.7, 1.6), 4),
                         storage_usd_per_gib_month=rng.uniform(0.05, 0.3), min_billed_seconds=0,
                         private_network=False, price_source="bench", price_time=T0))
    return out


QUOTAS = [Quota(provider="oci", name="gpu-a10-count", region="us-ashburn-1", scope="AD-1", limit=1, unit="gpus",
                instance_types=["VM.GPU.A10.1", "VM.GPU.A10.2"]),
          Quota(provider="oci", name="gpu-a10-count", region="us-ashburn-1", scope="AD-2", limit=8, unit="gpus",
                instance_types=["VM.GPU.A10.1", "VM.GPU.A10.2"]),
          Quota(provider="aws", name="L-DB2E81BA", region="us-east-1", scope="us-east-1", limit=8, unit="vcpus",
                instance_types=["g5.xlarge", "g4dn.xlarge", "g5.12xlarge"])]
CAPS = [Capacity(provider="oci", region="us-ashburn-1", zone="AD-2", instance_type="VM.GPU.A10.2",
                 status="OUT_OF_HOST_CAPACITY")]


def time_build(n: int) -> float:
    """CPU seconds to build ``n`` ``Offer`` objects (stdlib dataclasses) from keyword rows."""
    rows = [asdict(o) for o in synthetic(n)]
    c = time.process_time()
    for r in rows:
        Offer(**r)
    return time.process_time() - c


def time_plan(n: int, repeat: int) -> tuple[float, float, object]:
    """(median wall seconds, median CPU seconds of this process, the plan) of one plan() call over n offers."""
    offers = synthetic(n)
    # like the Vast adapter for live offers: one AVAILABLE fact (count 1) per host
    caps = CAPS + [Capacity(provider="vast", region=o.region, instance_type=o.instance_type, status="AVAILABLE",
                            available_count=1) for o in offers if o.provider == "vast"]
    req = Requirements(budget_usd=5, hours=1)
    walls, cpus, p = [], [], None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        p = plan(req, offers, QUOTAS, caps, now=T0)
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), p


def median_start(argv: list[str], runs: int, env: dict[str, str]) -> float:
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--starts", type=int, default=5)
    a = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"planner scale (median of {a.repeat}; 2 nodes x 1 GPU >= 16 GiB, 1 h, budget $5; {os.cpu_count()} cores, "
          f"load average {load:.1f}: CPU time is the fair number on a shared machine)")
    prev = None
    for n in (1_000, 10_000, 100_000):
        wall, cpu, p = time_plan(n, a.repeat)
        growth = f"x{cpu / prev:.1f} CPU for 10x offers" if prev else ""
        c = p.chosen
        print(f"  {n:>7,} offers: wall {wall * 1000:7.1f} ms, CPU {cpu * 1000:7.1f} ms/call "
              f"({cpu / n * 1e6:5.2f} us/offer)  {growth:<24} valid {p.valid_count:,}, rejected "
              f"{sum(p.rejected_counts.values()):,}; chosen {c.provider} {c.topology.value} "
              f"{c.offers[0].instance_type} ${c.worst_case_usd:.3f}")
        prev = cpu
    built = time_build(100_000)
    _, cpu100k, _ = time_plan(100_000, 1)
    print(f"  building 100,000 Offer objects (before planning): {built * 1000:.0f} ms CPU "
          f"({built / cpu100k:.1f}x one plan call)")
    with tempfile.TemporaryDirectory() as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_"))}
        env.update(BROKER_HOME=home, HOME=home, OCI_CONFIG_FILE=os.path.join(home, "none"),
                   AWS_EC2_METADATA_DISABLED="true")
        base = median_start([sys.executable, "-c", "pass"], a.starts, env)
        helpt = median_start([sys.executable, "-m", "broker", "--help"], a.starts, env)
        plant = median_start([sys.executable, "-m", "broker", "plan", "--budget", "5"], a.starts, env)
    print(f"start-up (median of {a.starts}): python -c pass {base * 1000:.0f} ms; broker --help {helpt * 1000:.0f} ms "
          f"(x{helpt / base:.1f}); broker plan --budget 5 {plant * 1000:.0f} ms (x{plant / base:.1f})")


if __name__ == "__main__":
    main()
