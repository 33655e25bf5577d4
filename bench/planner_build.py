"""Building a million offers against planning over them, in the same run.

Rows are made first as an adapter reads them (dicts of fresh strings and floats: a JSON market answer, a CSV
catalog), then timed: building ``--offers`` ``broker.core.model.Offer`` objects from them (``Offer(**row)``, as the
adapters and the catalog build them) (CPU seconds, and the memory
they hold: resident set growth with the rows already resident), and one ``broker.plan.planner.plan`` call over them
(2 nodes x 1 GPU >= 16 GiB, 1 h, budget $5, as bench/plan_scale.py).  Rounds alternate build and plan; the
median of the per-round ratios build / plan is printed with the load average.  Goal: building <= planning,
<= 500 MiB.

    python bench/planner_build.py [--offers 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from plan_scale import CAPS, GPUS, QUOTAS, SHAPES, T0  # noqa: E402

from broker.core.model import Capacity, Offer, Requirements, gc_paused  # noqa: E402
from broker.plan.planner import plan  # noqa: E402


def build_offers(rows: list[dict]) -> list[Offer]:
    """What the adapters and the catalog do with the rows they read: an offer per row, with the cyclic garbage
    collector paused meanwhile (``broker.core.model.gc_paused``, as Vast's live search and the snapshot loader do)."""
    with gc_paused():
        return [Offer(**r) for r in rows]


def rows(n: int, seed: int = 0) -> list[dict]:
    """The offers of bench/plan_scale.synthetic as keyword rows, every text a fresh string (as parsed JSON)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 10 == 0:
            p, it, g, c, mem, usd, vcpus = SHAPES[rng.randrange(len(SHAPES))]
            region = "us-ashburn-1" if p == "oci" else "us-east-1"
            out.append(dict(provider="".join(p), offer_id=f"{it}-{i}", instance_type="".join([it, ""]),
                            region="".join([region, ""]),
                            zone=rng.choice([None, "AD-1", "AD-2"]) if p == "oci" else None, gpu_name="".join([g, ""]),
                            gpu_count=c, gpu_mem_gib=float(mem), vcpus=float(vcpus),
                            usd_per_hour=usd * rng.uniform(0.95, 1.05), storage_usd_per_gib_month=0.08,
                            min_billed_seconds=60.0, private_network=True, price_source="".join(["bench", ""]),
                            price_time=T0))
            continue
        g, mem, base = GPUS[rng.randrange(len(GPUS))]
        c = rng.choice([1, 1, 2, 2, 4, 8])
        out.append(dict(provider="".join(["vast", ""]), offer_id=str(1000000 + i), instance_type=f"{c}x {g}",
                        region="".join(["Somewhere, US", ""]), gpu_name="".join([g, ""]), gpu_count=c,
                        gpu_mem_gib=float(mem), vcpus=float(8 * c),
                        usd_per_hour=round(base * c * rng.uniform(0.7, 1.6), 4),
                        storage_usd_per_gib_month=rng.uniform(0.05, 0.3), min_billed_seconds=0.0,
                        private_network=False, price_source="".join(["bench", ""]), price_time=T0))
    return out


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offers", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    data = rows(a.offers)
    req = Requirements(budget_usd=5, hours=1)
    builds, plans, mems, ratios = [], [], [], []
    offers = None
    for _ in range(a.rounds):
        offers = None
        gc.collect()
        r0 = rss_mib()
        c = time.process_time()
        offers = build_offers(data)
        b = time.process_time() - c
        mems.append(rss_mib() - r0)
        caps = CAPS + [Capacity(provider="vast", region=o.region, instance_type=o.instance_type, status="AVAILABLE",
                                available_count=1) for o in offers[:: max(1, a.offers // 1000)]
                       if o.provider == "vast"]
        c = time.process_time()
        p = plan(req, offers, QUOTAS, caps, now=T0)
        pl = time.process_time() - c
        builds.append(b)
        plans.append(pl)
        ratios.append(b / pl)
    la = os.getloadavg()
    print(f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}; {os.cpu_count()} cores; {a.offers:,} offers, "
          f"{a.rounds} rounds (CPU seconds)")
    print(f"  build  : median {statistics.median(builds):.2f} s ({statistics.median(builds) / a.offers * 1e6:.2f} "
          f"us/offer), memory held {statistics.median(mems):.0f} MiB ({statistics.median(mems) * 2**20 / a.offers:.0f}"
          f" B/offer)  runs {' '.join(f'{x:.2f}' for x in builds)}")
    print(f"  plan   : median {statistics.median(plans):.2f} s  runs {' '.join(f'{x:.2f}' for x in plans)}; chosen "
          f"{p.chosen.provider} {p.chosen.offers[0].instance_type} ${p.chosen.worst_case_usd:.3f}")
    r = statistics.median(ratios)
    print(f"  ratio build / plan: {r:.2f} (median of per-round ratios)")
    print(f"goal build <= plan and <= 500 MiB: "
          f"{'met' if r <= 1 and statistics.median(mems) <= 500 else 'NOT met'}")


if __name__ == "__main__":
    main()
