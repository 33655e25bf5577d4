"""The shipped OCI price snapshot (``providers/snapshots/oci.csv``): built from the list prices in
``docs/reference/prices/oci-aws-list-prices.csv`` (``python -m broker.plan.catalog build``), with the assumptions it
states; and the shapes repriced from Oracle's public price list (``broker catalog refresh``: :mod:`.prices`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: OCI boot volume, Balanced performance: 0.0255 $/GB/month storage + 10 VPU x 0.0017 (Oracle price list as
#: commonly quoted; not in docs/reference/prices, unconfirmed).
OCI_STORAGE_USD_PER_GIB_MONTH = 0.0425

META: dict[str, Any] = {
    "label": "third-party list prices",
    "source": "OCI pay-as-you-go list prices per whole shape from public third-party catalogs (SkyPilot OCI "
              "catalog v6; a migration that read Oracle's price-list API on 2026-09-09); compiled "
              "for broker on 2026-11-29; unconfirmed against oracle.com",
    "notes": [
        "region empty = the shape is priced the same in every region; availability domains unknown until "
        "capacity reports are read (OCI credentials)",
        "billing: per second with a one-minute minimum (Oracle compute pricing FAQ; unconfirmed here)",
        f"storage_usd_per_gib_month {OCI_STORAGE_USD_PER_GIB_MONTH} is an ASSUMPTION for the boot volume "
        "(Balanced: 0.0255 storage + 10 VPU x 0.0017 $/GB/month)",
        "VM.GPU3.1: another source implies 3.05 $/h; only VM.GPU.A10.x stop pauses billing",
    ],
}


def snapshot_rows(reference_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows in :data:`broker.plan.catalog.COLUMNS`, :data:`META`) from ``oci-aws-list-prices.csv``."""
    from broker.plan.catalog import list_price_rows

    return list_price_rows(Path(reference_dir) / "oci-aws-list-prices.csv", "oci", OCI_STORAGE_USD_PER_GIB_MONTH,
                           60), META
