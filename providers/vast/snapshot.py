"""The shipped Vast.ai price snapshot (``providers/snapshots/vast.csv``): built from the SkyPilot catalog's market
medians in ``docs/reference/prices/vast-market-medians.csv`` (``python -m broker.plan.catalog build``), with the
assumptions it states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Vast.ai ``storage_cost`` varies per host; typical on-demand hosts ask 0.10-0.20 $/GB/month.
VAST_STORAGE_USD_PER_GIB_MONTH = 0.15

META: dict[str, Any] = {
    "label": "SkyPilot catalog medians",
    "source": "SkyPilot public catalog catalogs/v8/vast/vms.csv at commit 01b8cdda (2025-2026), per (GPU model, "
              "GPU count) bucket the median live on-demand offer price; compiled for broker on 2026-11-29",
    "notes": [
        "medians, not the cheapest offers: a live /api/v0/bundles/ search (VAST_API_KEY) usually finds lower prices",
        f"storage_usd_per_gib_month {VAST_STORAGE_USD_PER_GIB_MONTH} is an ASSUMPTION: Vast hosts set storage_cost "
        "per offer, typically 0.10-0.20 $/GB/month; a live search gives each offer's own value",
        "billing: per second, no minimum stated; storage billed from creation until destroy (Vast pricing guide)",
        "gpu_mem_gib = gpu_ram MiB / 1024; region = where one such offer was listed; offer_id is a bucket, not an "
        "ask id (provisioning searches live offers)",
        "private_network false: Vast hosts sit behind separate NATs (multi-node across Vast hosts is not valid)",
    ],
}


def snapshot_rows(reference_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows in :data:`broker.plan.catalog.COLUMNS`, :data:`META`) from ``vast-market-medians.csv``
    (gpu_mem_mib_each, usd_per_hour per bucket).  Raises OSError / KeyError for a missing file or column."""
    from broker.plan.catalog import fmt_number, read_reference

    rows = []
    for r in read_reference(Path(reference_dir) / "vast-market-medians.csv"):
        rows.append({
            "offer_id": f"snapshot:{r['instance_type']}", "instance_type": f"{r['gpu_count']}x {r['gpu_name']}",
            "gpu_name": r["gpu_name"], "gpu_count": r["gpu_count"],
            # the source lists 32 vCPU / 64 GiB for every bucket: a placeholder, not a fact about the offers, so
            # the snapshot leaves them unknown (empty; Offer.vcpus / ram_gib 0 = unknown)
            "gpu_mem_gib": fmt_number(round(float(r["gpu_mem_mib_each"]) / 1024.0, 2)), "vcpus": "",
            "ram_gib": "", "usd_per_hour": r["usd_per_hour"], "region": r["region"], "zone": "",
            "storage_usd_per_gib_month": fmt_number(VAST_STORAGE_USD_PER_GIB_MONTH), "min_billed_seconds": "0",
            "private_network": "false", "notes": "bucket median"})
    return rows, META
