"""Free tiers as offers: the shipped free-tier snapshot (``providers/snapshots/free_tier.csv``) read into $0.00 CPU
offers that carry their limits, for CPU-only jobs.  Pure (the caller reads the file); the planner judges the
limits (:func:`broker.plan.planner._free_tier_reasons`) and re-exports these names."""

from __future__ import annotations

from datetime import datetime, timezone

from broker.core.model import Offer, Requirements, utcnow

#: ``Offer.attrs`` key of a free-tier offer: {"max_units", "unit", "max_instance_hours", "note"}
FREE_TIER_ATTR = "free_tier"


def cpu_only(req: Requirements) -> bool:
    """A CPU-only job: ``gpus_per_node`` 0 with ``cpu_ok`` (gloo on CPU; ``broker plan --cpu-only``)."""
    return req.gpus_per_node == 0 and req.cpu_ok


def parse_free_tier(text: str, *, now: datetime | None = None) -> tuple[dict[str, str], list[Offer]]:
    """The free-tier snapshot (``providers/snapshots/free_tier.csv``: ``# key: value`` header lines, then CSV) ->
    (header, $0.00 CPU offers).  Each offer carries its limit in ``attrs["free_tier"]``: ``max_units`` (nodes or
    OCPUs at once, per tenancy) and/or ``max_instance_hours`` (a month, all instances together)."""
    import csv
    import io

    meta: dict[str, str] = {}
    body = []
    for line in text.splitlines():
        if line.startswith("#"):
            k, _, v = line[1:].partition(":")
            if k.strip() and v.strip() and k.strip() != "notes":
                meta[k.strip()] = v.strip()
        elif line.strip():
            body.append(line)
    date = meta.get("date", "")
    try:
        when = datetime.fromisoformat(date).replace(tzinfo=timezone.utc) if date else (now or utcnow())
    except ValueError:
        when = now or utcnow()
    offers = []
    for row in csv.DictReader(io.StringIO("\n".join(body))):
        limit = {"max_units": int(row["max_units"]) if row.get("max_units") else None,
                 "max_instance_hours": float(row["max_instance_hours"]) if row.get("max_instance_hours") else None,
                 "unit": row.get("unit") or "", "note": row.get("notes") or ""}
        offers.append(Offer(provider=row["provider"], offer_id=row["offer_id"], instance_type=row["instance_type"],
                            region=row.get("region") or None, gpu_name="CPU", gpu_count=0, gpu_mem_gib=0.0,
                            vcpus=float(row["vcpus"]), ram_gib=float(row["ram_gib"]), usd_per_hour=0.0,
                            storage_usd_per_gib_month=0.0, min_billed_seconds=0, private_network=True,
                            price_source=f"free tier {date} ({limit['note']})", price_time=when,
                            attrs={FREE_TIER_ATTR: limit, "cpu": True, "arch": row.get("arch") or "x86_64"}))
    return meta, offers


def free_tier_offers(req: Requirements, text: str) -> list[Offer]:
    """The free-tier offers that apply to ``req``: CPU-only jobs only (see :func:`cpu_only`), on the providers
    ``req`` allows."""
    if not cpu_only(req):
        return []
    _, offers = parse_free_tier(text)
    return [o for o in offers if not req.providers or o.provider in req.providers]
