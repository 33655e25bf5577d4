"""Dated price snapshots: the shipped ones (package data in ``providers/snapshots/``) and the user's refreshed ones.

A snapshot is a CSV file with ``# key: value`` header lines naming the provider, the ``date``, the ``source`` and a
short ``label`` (shown in every price: ``"snapshot 2026-11-29 (SkyPilot catalog medians)"``), plus ``notes``
lines stating the assumptions (storage prices, minimum billed time).  Columns (units in the names)::

    offer_id,instance_type,gpu_name,gpu_count,gpu_mem_gib,vcpus,ram_gib,usd_per_hour,region,zone,
    storage_usd_per_gib_month,min_billed_seconds,private_network,notes

Lookup order: ``<broker home>/catalog/<provider>.csv`` (written by :func:`refresh`, i.e. ``broker catalog
refresh``) takes precedence over the shipped ``providers/snapshots/<provider>.csv``.  Live sources for a refresh:
Vast.ai offers (the adapter's live search), AWS list prices (the adapter's Pricing API reader,
:func:`aws_live_offers`), OCI list prices (Oracle's public price list, :func:`oci_live_offers`, no credentials).

The shipped snapshots are built from ``docs/reference/prices/*.csv`` by :func:`build_shipped` (``python -m
broker.plan.catalog build <docs/reference/prices> [out_dir]``).  Sources: Vast.ai bucket medians from the public SkyPilot
catalog (``catalogs/v8/vast/vms.csv`` at commit 01b8cdda); OCI and AWS on-demand list prices from public
third-party catalogs (SkyPilot catalog files; a migration that read Oracle's price-list API on 2026-09-09; public
repositories quoting AWS us-east-1 after the June-2025 cut): unconfirmed against vendor pages, hence the date.
"""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.providers import SNAPSHOT

if TYPE_CHECKING:
    from broker.core.model import Offer, Requirements

#: Providers with a shipped snapshot (the adapters' ``snapshot`` capability, read from the registry).
PROVIDERS = SNAPSHOT

COLUMNS = ["offer_id", "instance_type", "gpu_name", "gpu_count", "gpu_mem_gib", "vcpus", "ram_gib", "usd_per_hour",
           "region", "zone", "storage_usd_per_gib_month", "min_billed_seconds", "private_network", "notes",
           "interruptible_usd_per_hour"]

#: Interruptible (bid / spot / preemptible) $/hour of the whole unit, by instance type, where
#: docs/reference (interruptible.md, prices/) gives one, with its source: written into the shipped snapshots'
#: ``interruptible_usd_per_hour`` column (empty = no figure: such offers get no interruptible option offline).
INTERRUPTIBLE_PRICES: dict[str, tuple[float, str]] = {
    # AWS g5.xlarge: "spot seen 0.42-0.45" (prices/oci-aws-list-prices.csv); the upper end, a plan never
    # promises less than was seen
    "g5.xlarge": (0.45, "EC2 spot price seen 0.42-0.45 $/h in us-east-1 (reference price list); upper end"),
    # OCI preemptible: 50 % of on-demand, fixed, in all regions; GPU preemptible only on VM.GPU2 / VM.GPU3
    # (OCI preemptible doc updated 2025-02-11; interruptible.md section 5)
    "VM.GPU2.1": (0.6375, "OCI preemptible: 50 % of on-demand (OCI doc 2025-02-11)"),
    "VM.GPU3.1": (1.475, "OCI preemptible: 50 % of on-demand (OCI doc 2025-02-11)"),
    # Vast RTX 4090: min_bid ~0.12 $/h against ~0.24 on-demand (dstack issue #4026, 2026-07-13): half the
    # bucket median
    "1x RTX 4090": (0.20, "Vast min_bid about 50 % of on-demand for RTX 4090 (dstack #4026, 2026-07-13)"),
    "2x RTX 4090": (0.395, "Vast min_bid about 50 % of on-demand for RTX 4090 (dstack #4026, 2026-07-13)"),
    "4x RTX 4090": (0.695, "Vast min_bid about 50 % of on-demand for RTX 4090 (dstack #4026, 2026-07-13)"),
    "5x RTX 4090": (1.00, "Vast min_bid about 50 % of on-demand for RTX 4090 (dstack #4026, 2026-07-13)"),
    "8x RTX 4090": (1.385, "Vast min_bid about 50 % of on-demand for RTX 4090 (dstack #4026, 2026-07-13)"),
}

def _shipped_dir() -> Path:
    """The installed ``broker.providers.snapshots`` package folder (the repository's ``providers/snapshots/``)."""
    import importlib.util

    spec = importlib.util.find_spec("broker.providers.snapshots")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - broken install
        return Path(__file__).resolve().parent.parent.parent / "providers" / "snapshots"
    return Path(list(spec.submodule_search_locations)[0])


SHIPPED_DIR = _shipped_dir()

#: Date the shipped snapshots were built from docs/reference/prices (the figures were checked on that day).
SHIPPED_DATE = "2026-11-29"

# ---- assumptions written into the shipped snapshots (and stated there) -------------------------------------
#: Vast.ai ``storage_cost`` varies per host; typical on-demand hosts ask 0.10-0.20 $/GB/month.
VAST_STORAGE_USD_PER_GIB_MONTH = 0.15
#: OCI boot volume, Balanced performance: 0.0255 $/GB/month storage + 10 VPU x 0.0017 (Oracle price list as
#: commonly quoted; not in docs/reference/prices, unconfirmed).
OCI_STORAGE_USD_PER_GIB_MONTH = 0.0425
#: AWS EBS gp3 in us-east-1: 0.08 $/GB/month (AWS EBS pricing page as commonly quoted; unconfirmed).
AWS_STORAGE_USD_PER_GIB_MONTH = 0.08

_META: dict[str, dict[str, Any]] = {
    "vast": {
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
        "storage": VAST_STORAGE_USD_PER_GIB_MONTH, "min_billed": 0, "private_network": False,
    },
    "oci": {
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
        "storage": OCI_STORAGE_USD_PER_GIB_MONTH, "min_billed": 60, "private_network": True,
    },
    "aws": {
        "label": "third-party list prices",
        "source": "AWS EC2 on-demand Linux prices for us-east-1 after the June-2025 cut, as quoted consistently by "
                  "several public repositories; compiled for broker on 2026-11-29; unconfirmed against "
                  "the AWS Pricing API",
        "notes": [
            "billing: per second with a 60 s minimum for Linux on-demand (AWS EC2 pricing page; unconfirmed here)",
            f"storage_usd_per_gib_month {AWS_STORAGE_USD_PER_GIB_MONTH} is an ASSUMPTION (EBS gp3 us-east-1)",
            "region us-east-1 only; zones offering each type come from describe_instance_type_offerings (AWS credentials)",
        ],
        "storage": AWS_STORAGE_USD_PER_GIB_MONTH, "min_billed": 60, "private_network": True,
    },
}


# ------------------------------------------------------------------------------------------------ paths / reading
def overlay_dir() -> Path:
    """``<broker home>/catalog``: where :func:`refresh` writes refreshed snapshots."""
    from broker.core.config import broker_home

    return broker_home() / "catalog"


def snapshot_file(provider: str) -> str:
    """File name of ``provider``'s snapshot (its adapter's ``snapshot`` capability; ``<provider>.csv`` for a
    provider that ships none, where a refresh may still write one)."""
    from broker.providers import capability

    return capability(provider, "snapshot") or f"{provider}.csv"


def shipped_path(provider: str) -> Path:
    return SHIPPED_DIR / snapshot_file(provider)


def snapshot_path(provider: str) -> Path | None:
    """The snapshot in effect for ``provider``: the refreshed overlay if present, else the shipped one, else None."""
    over = overlay_dir() / snapshot_file(provider)
    if over.is_file():
        return over
    p = shipped_path(provider)
    return p if p.is_file() else None


def _parse(text: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """Header (``# key: value`` lines; ``notes`` collected as a list) and rows of a snapshot CSV."""
    meta: dict[str, Any] = {"notes": []}
    body: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            key, sep, value = line[1:].strip().partition(":")
            if sep:
                key, value = key.strip(), value.strip()
                if key == "notes":
                    meta["notes"].append(value)
                else:
                    meta[key] = value
        elif line.strip():
            body.append(line)
    rows = list(csv.DictReader(io.StringIO("\n".join(body))))
    return meta, rows


_CACHE: dict[tuple[str, int], tuple[dict[str, Any], list["Offer"]]] = {}


def _interruptible_attrs(cell: str | None, source: str) -> dict[str, Any]:
    """The ``interruptible_usd_per_hour`` cell of a snapshot row as offer attrs (:mod:`broker.plan.interruptible`);
    {} when empty or not a positive number."""
    try:
        v = float(cell) if cell not in (None, "") else None
    except ValueError:
        v = None
    if v is None or not v > 0:
        return {}
    return {"interruptible_usd_per_hour": v, "interruptible_price_source": source}


def _load(provider: str) -> tuple[dict[str, Any], list["Offer"]]:
    """(meta, offers) of the snapshot in effect; cached per file and mtime.  Raises FileNotFoundError."""
    path = snapshot_path(provider)
    if path is None:
        raise FileNotFoundError(f"no price snapshot for provider {provider!r} (looked in {overlay_dir()} and "
                                f"{SHIPPED_DIR})")
    key = (str(path), path.stat().st_mtime_ns)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    from broker.core.model import Offer

    meta, rows = _parse(path.read_text(encoding="utf-8"))
    date = meta.get("date", "unknown")
    label = meta.get("label") or meta.get("source", "")
    source = f"snapshot {date}" + (f" ({label})" if label else "")
    try:
        when = datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=timezone.utc)
    except ValueError:
        when = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    offers = []
    for r in rows:
        offers.append(Offer(
            provider=meta.get("provider", provider), offer_id=r["offer_id"], instance_type=r["instance_type"],
            region=r.get("region") or None, zone=r.get("zone") or None, gpu_name=r["gpu_name"],
            gpu_count=int(r["gpu_count"]), gpu_mem_gib=float(r["gpu_mem_gib"]), vcpus=float(r.get("vcpus") or 0),
            ram_gib=float(r.get("ram_gib") or 0), usd_per_hour=float(r["usd_per_hour"]),
            storage_usd_per_gib_month=float(r.get("storage_usd_per_gib_month") or 0),
            min_billed_seconds=float(r.get("min_billed_seconds") or 0),
            private_network=(r.get("private_network", "").strip().lower() in ("true", "1", "yes")),
            price_source=source, price_time=when,
            attrs={"snapshot": str(path.name), **({"notes": r["notes"]} if r.get("notes") else {}),
                   **_interruptible_attrs(r.get("interruptible_usd_per_hour"), source)}))
    meta["path"] = str(path)
    meta["price_source"] = source
    _CACHE[key] = (meta, offers)
    return meta, offers


def _compatible(o: "Offer", req: "Requirements") -> bool:
    """True when ``o`` may serve ``req`` in some topology (model, memory, GPU count)."""
    from broker.plan.planner import gpu_name_matches

    if req.gpu_names and not any(gpu_name_matches(w, o.gpu_name) for w in req.gpu_names):
        return False
    if o.gpu_mem_gib < req.gpu_mem_floor_gib:
        return False
    if o.gpu_count >= req.nodes * req.gpus_per_node:
        return True
    return o.private_network and req.nodes > 1 and o.gpu_count >= req.gpus_per_node


def snapshot_offers(provider: str, req: "Requirements | None" = None) -> list["Offer"]:
    """Offers from the snapshot in effect for ``provider``, filtered by ``req`` when given.

    Filter: accepted GPU model (``req.gpu_names``), ``gpu_mem_gib >= req.min_gpu_mem_gib``, and a GPU count that
    fits one topology (one host with nodes x gpus_per_node GPUs, or, where ``private_network``, hosts with
    gpus_per_node GPUs).  ``price_source`` reads ``"snapshot <date> (<label>)"``; ``price_time`` is the date.
    Raises FileNotFoundError when the provider has no snapshot.
    """
    _, offers = _load(provider)
    if req is None:
        return list(offers)
    return [o for o in offers if _compatible(o, req)]


def snapshot_offer(provider: str, instance_type: str | None) -> "Offer | None":
    """The first offer of ``instance_type`` in the snapshot in effect for ``provider``; None when it is not there
    (or the provider has no snapshot)."""
    try:
        _, offers = _load(provider)
    except FileNotFoundError:
        return None
    return next((o for o in offers if o.instance_type == instance_type), None)


def snapshot_price(provider: str, instance_type: str | None) -> float | None:
    """$/hour of ``instance_type`` in the snapshot in effect for ``provider``; None when it is not there."""
    o = snapshot_offer(provider, instance_type)
    return o.usd_per_hour if o is not None else None


def snapshot_info(provider: str) -> tuple[str, str]:
    """(date ``YYYY-MM-DD``, source text) of the snapshot in effect for ``provider``."""
    meta, _ = _load(provider)
    return meta.get("date", "unknown"), meta.get("source", "")


def snapshot_meta(provider: str) -> dict[str, Any]:
    """Everything in the snapshot header (provider, date, source, label, notes list) plus ``path``."""
    meta, offers = _load(provider)
    return {**meta, "offers": len(offers), "overlay": not meta["path"].startswith(str(SHIPPED_DIR))}


# ------------------------------------------------------------------------------------------------ writing
def _fmt(x: float) -> str:
    return f"{x:.10g}"


def write_snapshot(path: Path, provider: str, date: str, source: str, label: str, notes: list[str],
                   rows: list[dict[str, Any]]) -> Path:
    """Write a snapshot CSV (header lines + ``COLUMNS``) atomically; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    buf.write(f"# broker price snapshot\n# provider: {provider}\n# date: {date}\n# label: {label}\n"
              f"# source: {source}\n")
    for n in notes:
        buf.write(f"# notes: {n}\n")
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in COLUMNS})
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(buf.getvalue(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def refresh(provider: str, offers: list["Offer"], path: Path | None = None, *, now: datetime | None = None,
            source: str | None = None) -> Path:
    """Write a new dated snapshot of ``provider`` from live ``offers`` (the overlay that takes precedence).

    ``path`` defaults to ``<broker home>/catalog/<provider>.csv``.  Raises ValueError when ``offers`` is empty or
    holds offers of another provider (a refresh never replaces a snapshot with nothing).
    """
    if not offers:
        raise ValueError(f"{provider}: no live offers to write; keeping the snapshot in effect")
    bad = {o.provider for o in offers if o.provider != provider}
    if bad:
        raise ValueError(f"refresh({provider!r}) got offers of {sorted(bad)}")
    when = now or datetime.now(timezone.utc)
    date = when.strftime("%Y-%m-%d")
    rows = [{
        "offer_id": o.offer_id, "instance_type": o.instance_type, "gpu_name": o.gpu_name, "gpu_count": o.gpu_count,
        "gpu_mem_gib": _fmt(o.gpu_mem_gib), "vcpus": _fmt(o.vcpus), "ram_gib": _fmt(o.ram_gib),
        "usd_per_hour": _fmt(o.usd_per_hour), "region": o.region or "", "zone": o.zone or "",
        "storage_usd_per_gib_month": _fmt(o.storage_usd_per_gib_month),
        "min_billed_seconds": _fmt(o.min_billed_seconds), "private_network": str(bool(o.private_network)).lower(),
        "notes": str(o.attrs.get("notes", "")),
        "interruptible_usd_per_hour": (_fmt(o.attrs["interruptible_usd_per_hour"])
                                       if isinstance(o.attrs.get("interruptible_usd_per_hour"), (int, float)) else ""),
    } for o in sorted(offers, key=lambda o: (o.usd_per_hour, o.key))]
    sources = sorted({o.price_source for o in offers})
    src = source or f"live {provider} API read by `broker catalog refresh` at {when:%Y-%m-%dT%H:%M:%SZ}"
    notes = [f"{len(rows)} offers; adapter price sources: {'; '.join(sources)[:300]}"]
    out = path or overlay_dir() / snapshot_file(provider)
    return write_snapshot(out, provider, date, src, "live refresh", notes, rows)


# ------------------------------------------------------------------------------------------------ building
def _read_reference(path: Path) -> list[dict[str, str]]:
    return _parse(path.read_text(encoding="utf-8"))[1]


def _with_interruptible(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with the :data:`INTERRUPTIBLE_PRICES` figure of their instance type (empty cell where none)."""
    return [{**r, "interruptible_usd_per_hour": _fmt(INTERRUPTIBLE_PRICES[r["instance_type"]][0])
             if r["instance_type"] in INTERRUPTIBLE_PRICES else ""} for r in rows]


def _interruptible_notes(rows: list[dict[str, Any]]) -> list[str]:
    """The header note naming the source of each interruptible price in ``rows``."""
    srcs: dict[str, list[str]] = {}
    for r in rows:
        hit = INTERRUPTIBLE_PRICES.get(r["instance_type"])
        if hit:
            srcs.setdefault(hit[1], []).append(r["instance_type"])
    return [f"interruptible_usd_per_hour ({', '.join(types)}): {src}" for src, types in srcs.items()]


def build_shipped(reference_dir: Path, out_dir: Path = SHIPPED_DIR, date: str = SHIPPED_DATE) -> list[Path]:
    """Build ``vast.csv``, ``oci.csv``, ``aws.csv`` in ``out_dir`` from ``docs/reference/prices`` CSV files.

    Inputs: ``vast-market-medians.csv`` (gpu_mem_mib_each, usd_per_hour per bucket) and
    ``oci-aws-list-prices.csv`` (per shape / instance type).  Returns the written paths.
    """
    reference_dir = Path(reference_dir)
    out: list[Path] = []
    vast_rows = []
    for r in _read_reference(reference_dir / "vast-market-medians.csv"):
        vast_rows.append({
            "offer_id": f"snapshot:{r['instance_type']}", "instance_type": f"{r['gpu_count']}x {r['gpu_name']}",
            "gpu_name": r["gpu_name"], "gpu_count": r["gpu_count"],
            # the source lists 32 vCPU / 64 GiB for every bucket: a placeholder, not a fact about the offers, so
            # the snapshot leaves them unknown (empty; Offer.vcpus / ram_gib 0 = unknown)
            "gpu_mem_gib": _fmt(round(float(r["gpu_mem_mib_each"]) / 1024.0, 2)), "vcpus": "",
            "ram_gib": "", "usd_per_hour": r["usd_per_hour"], "region": r["region"], "zone": "",
            "storage_usd_per_gib_month": _fmt(VAST_STORAGE_USD_PER_GIB_MONTH), "min_billed_seconds": "0",
            "private_network": "false", "notes": "bucket median"})
    m = _META["vast"]
    out.append(write_snapshot(Path(out_dir) / "vast.csv", "vast", date, m["source"], m["label"],
                              m["notes"] + _interruptible_notes(vast_rows), _with_interruptible(vast_rows)))
    by_provider: dict[str, list[dict[str, Any]]] = {"oci": [], "aws": []}
    for r in _read_reference(reference_dir / "oci-aws-list-prices.csv"):
        p = r["provider"]
        if p not in by_provider:
            continue
        m = _META[p]
        region = "" if r["region"] in ("any", "") else r["region"]
        by_provider[p].append({
            "offer_id": r["instance_type"], "instance_type": r["instance_type"], "gpu_name": r["gpu_name"],
            "gpu_count": r["gpu_count"], "gpu_mem_gib": r["gpu_mem_gib_each"], "vcpus": r["vcpus"],
            "ram_gib": r["ram_gib"], "usd_per_hour": r["usd_per_hour"], "region": region, "zone": "",
            "storage_usd_per_gib_month": _fmt(m["storage"]), "min_billed_seconds": str(m["min_billed"]),
            "private_network": "true", "notes": r.get("notes", "")})
    for p, rows in by_provider.items():
        m = _META[p]
        out.append(write_snapshot(Path(out_dir) / f"{p}.csv", p, date, m["source"], m["label"],
                                  m["notes"] + _interruptible_notes(rows), _with_interruptible(rows)))
    _CACHE.clear()
    return out


if __name__ == "__main__":  # python -m broker.plan.catalog build <docs/reference/prices> [out_dir]
    import sys

    if len(sys.argv) >= 3 and sys.argv[1] == "build":
        for p in build_shipped(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else SHIPPED_DIR):
            print(p)
    else:
        print("usage: python -m broker.plan.catalog build <docs/reference/prices dir> [out_dir]", file=sys.stderr)
        sys.exit(2)


# ------------------------------------------------------------------------------------------------ live sources
#: Oracle's public cost-estimator price list (no credentials).  [3rd-party] shape of the answer, as read by several
#: public price collectors: ``{"items": [{"partNumber", "displayName": "Compute - GPU - A10", "metricName",
#: "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "PAY_AS_YOU_GO", "value": 2}]}]}]}``,
#: GPU SKUs priced per GPU-hour.  Not confirmed against Oracle documentation: unmatched shapes keep their price.
OCI_PRICE_LIST_URL = "https://apexapps.oracle.com/pls/apex/cetools/api/v1/products/"
_OCI_GPU_SKU = re.compile(r"^(?:OCI - )?Compute - GPU(?: Standard)? - (?P<model>.+)$")


def _model_key(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


def parse_oci_price_list(data: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """GPU SKU model (normalized: ``a10``, ``h100``...) -> (USD per GPU-hour pay-as-you-go, ``partNumber
    displayName``) from an answer of :data:`OCI_PRICE_LIST_URL`."""
    out: dict[str, tuple[float, str]] = {}
    for item in data.get("items") or []:
        name = str(item.get("displayName") or "")
        m = _OCI_GPU_SKU.match(name.strip())
        if not m:
            continue
        price = None
        for loc in item.get("currencyCodeLocalizations") or []:
            if loc.get("currencyCode") not in (None, "USD"):
                continue
            for pr in loc.get("prices") or []:
                if pr.get("model") == "PAY_AS_YOU_GO" and isinstance(pr.get("value"), (int, float)):
                    price = float(pr["value"])
        if price is not None and price > 0:
            out[_model_key(m.group("model"))] = (price, f"{item.get('partNumber', '?')} {name}")
    return out


def _oci_sku_for(gpu_name: str, skus: dict[str, tuple[float, str]]) -> tuple[float, str] | None:
    """The price-list SKU of a snapshot GPU name (``A10``, ``H100``, ``A100-80GB``); None when unsure."""
    key = _model_key(gpu_name)
    if key in skus:
        return skus[key]
    if key == "h100" and "h100t" in skus:  # the H100 SKU is listed as "H100T" by some readers
        return skus["h100t"]
    if key.startswith("a100"):  # A100 40 GB vs 80 GB: only an SKU naming the memory counts
        mem = key[4:6]
        hits = [v for k, v in skus.items() if k.startswith("a100") and mem and mem in k[4:]]
        return hits[0] if len(hits) == 1 else None
    return None


def oci_live_offers(get: Any = None, *, now: datetime | None = None) -> list["Offer"]:
    """OCI snapshot shapes repriced from Oracle's public price list (per GPU-hour x GPUs per shape).

    ``get``: an ``httpx``-style ``get(url, params=..., timeout=...)`` (default ``httpx.get``).  Shapes whose GPU
    has no unambiguous SKU keep their snapshot price (their ``notes`` say so).  Raises httpx errors when the list
    cannot be fetched and ValueError when it holds no GPU SKU at all.
    """
    if get is None:
        import httpx

        get = httpx.get
    r = get(OCI_PRICE_LIST_URL, params={"currencyCode": "USD"}, timeout=30.0)
    r.raise_for_status()
    skus = parse_oci_price_list(r.json())
    if not skus:
        raise ValueError("Oracle's price list answered without any 'Compute - GPU - ...' SKU")
    when = now or datetime.now(timezone.utc)
    base = snapshot_offers("oci")
    out = []
    for o in base:
        hit = _oci_sku_for(o.gpu_name, skus)
        if hit is None:
            out.append(replace(o, attrs={**o.attrs, "notes": f"price carried over from {o.price_source}"}))
            continue
        per_gpu, sku = hit
        out.append(replace(o, usd_per_hour=round(per_gpu * o.gpu_count, 6), price_time=when,
                           price_source="live OCI price list",
                           attrs={**o.attrs, "notes": f"{per_gpu:g} $/GPU-h x {o.gpu_count}: {sku}"}))
    return out


def repriced_offers(provider: str, live_prices: Any, *, source: str, now: datetime | None = None) -> list["Offer"]:
    """``provider``'s snapshot instance types repriced with ``live_prices(instance_types) -> {type: USD/hour}`` (the
    adapter's list-price reader: capability ``live_price_list`` ``"api"``), each repriced offer's ``price_source``
    ``"live <source>"``.  Types without a live price keep their snapshot price (notes say so)."""
    base = snapshot_offers(provider)
    prices = live_prices(sorted({o.instance_type for o in base}))
    when = now or datetime.now(timezone.utc)
    out = []
    for o in base:
        if o.instance_type in prices:
            out.append(replace(o, usd_per_hour=float(prices[o.instance_type]), price_time=when,
                               price_source=f"live {source}", attrs={**o.attrs, "notes": source}))
        else:
            out.append(replace(o, attrs={**o.attrs, "notes": f"price carried over from {o.price_source}"}))
    return out
