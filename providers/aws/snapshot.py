"""The shipped AWS price snapshot (``providers/snapshots/aws.csv``): built from the list prices in
``docs/reference/prices/oci-aws-list-prices.csv`` (``python -m broker.plan.catalog build``), with the assumptions it
states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: AWS EBS gp3 in us-east-1: 0.08 $/GB/month (AWS EBS pricing page as commonly quoted; unconfirmed).
AWS_STORAGE_USD_PER_GIB_MONTH = 0.08

META: dict[str, Any] = {
    "label": "third-party list prices",
    "source": "AWS EC2 on-demand Linux prices for us-east-1 after the June-2025 cut, as quoted consistently by "
              "several public repositories; compiled for broker on 2026-11-29; unconfirmed against "
              "the AWS Pricing API",
    "notes": [
        "billing: per second with a 60 s minimum for Linux on-demand (AWS EC2 pricing page; unconfirmed here)",
        f"storage_usd_per_gib_month {AWS_STORAGE_USD_PER_GIB_MONTH} is an ASSUMPTION (EBS gp3 us-east-1)",
        "region us-east-1 only; zones offering each type come from describe_instance_type_offerings (AWS credentials)",
    ],
}


def snapshot_rows(reference_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows in :data:`broker.plan.catalog.COLUMNS`, :data:`META`) from ``oci-aws-list-prices.csv``."""
    from broker.plan.catalog import list_price_rows

    return list_price_rows(Path(reference_dir) / "oci-aws-list-prices.csv", "aws", AWS_STORAGE_USD_PER_GIB_MONTH,
                           60), META
