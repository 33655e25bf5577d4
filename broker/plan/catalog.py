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
    from broker.core.model import Offer, gc_paused

    meta, rows = _parse(path.read_text(encoding="utf-8"))
    date = meta.get("date", "unknown")
    label = meta.get("label") or meta.get("source", "")
    source = f"snapshot {date}" + (f" ({label})" if label else "")
    try:  # YYYY-MM-DD only; fromisoformat spares the _strptime import (start-up time of broker plan)
        if len(date) != 10 or date[4] != "-" or date[7] != "-":
            raise ValueError(date)
        when = datetime.fromisoformat(date).replace(tzinfo=timezone.utc)
    except ValueError:
        when = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    offers = []
    with gc_paused():  # a snapshot may list many offers (they form no reference cycles)
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
def fmt_number(x: float) -> str:
    """A number as a snapshot cell (up to 10 significant digits, no trailing zeros)."""
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
        "gpu_mem_gib": fmt_number(o.gpu_mem_gib), "vcpus": fmt_number(o.vcpus), "ram_gib": fmt_number(o.ram_gib),
        "usd_per_hour": fmt_number(o.usd_per_hour), "region": o.region or "", "zone": o.zone or "",
        "storage_usd_per_gib_month": fmt_number(o.storage_usd_per_gib_month),
        "min_billed_seconds": fmt_number(o.min_billed_seconds), "private_network": str(bool(o.private_network)).lower(),
        "notes": str(o.attrs.get("notes", "")),
        "interruptible_usd_per_hour": (fmt_number(o.attrs["interruptible_usd_per_hour"])
                                       if isinstance(o.attrs.get("interruptible_usd_per_hour"), (int, float)) else ""),
    } for o in sorted(offers, key=lambda o: (o.usd_per_hour, o.key))]
    sources = sorted({o.price_source for o in offers})
    src = source or f"live {provider} API read by `broker catalog refresh` at {when:%Y-%m-%dT%H:%M:%SZ}"
    notes = [f"{len(rows)} offers; adapter price sources: {'; '.join(sources)[:300]}"]
    out = path or overlay_dir() / snapshot_file(provider)
    return write_snapshot(out, provider, date, src, "live refresh", notes, rows)


# ------------------------------------------------------------------------------------------------ building
def read_reference(path: Path) -> list[dict[str, str]]:
    """The rows of one ``docs/reference/prices`` CSV file (a snapshot builder's input; ``#`` header lines skipped)."""
    return _parse(path.read_text(encoding="utf-8"))[1]


def _with_interruptible(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with the :data:`INTERRUPTIBLE_PRICES` figure of their instance type (empty cell where none)."""
    return [{**r, "interruptible_usd_per_hour": fmt_number(INTERRUPTIBLE_PRICES[r["instance_type"]][0])
             if r["instance_type"] in INTERRUPTIBLE_PRICES else ""} for r in rows]


def _interruptible_notes(rows: list[dict[str, Any]]) -> list[str]:
    """The header note naming the source of each interruptible price in ``rows``."""
    srcs: dict[str, list[str]] = {}
    for r in rows:
        hit = INTERRUPTIBLE_PRICES.get(r["instance_type"])
        if hit:
            srcs.setdefault(hit[1], []).append(r["instance_type"])
    return [f"interruptible_usd_per_hour ({', '.join(types)}): {src}" for src, types in srcs.items()]


def list_price_rows(path: Path, provider: str, storage_usd_per_gib_month: float,
                    min_billed_seconds: int) -> list[dict[str, Any]]:
    """The rows of ``provider`` in a list-price reference file (``docs/reference/prices/oci-aws-list-prices.csv``:
    one row per shape / instance type, a ``provider`` column) in the snapshot's :data:`COLUMNS`, with the storage
    price ($/GiB/month) and the minimum billed seconds the adapter assumes.  Raises OSError / KeyError for a
    missing file or column."""
    rows = []
    for r in read_reference(path):
        if r["provider"] != provider:
            continue
        region = "" if r["region"] in ("any", "") else r["region"]
        rows.append({
            "offer_id": r["instance_type"], "instance_type": r["instance_type"], "gpu_name": r["gpu_name"],
            "gpu_count": r["gpu_count"], "gpu_mem_gib": r["gpu_mem_gib_each"], "vcpus": r["vcpus"],
            "ram_gib": r["ram_gib"], "usd_per_hour": r["usd_per_hour"], "region": region, "zone": "",
            "storage_usd_per_gib_month": fmt_number(storage_usd_per_gib_month),
            "min_billed_seconds": str(min_billed_seconds), "private_network": "true", "notes": r.get("notes", "")})
    return rows


def build_shipped(reference_dir: Path, out_dir: Path = SHIPPED_DIR, date: str = SHIPPED_DATE) -> list[Path]:
    """Build the shipped snapshot of every provider with one (its ``snapshot`` capability: ``vast.csv``,
    ``oci.csv``, ``aws.csv``) in ``out_dir`` from the ``docs/reference/prices`` CSV files, each adapter reading its
    own inputs and stating its source (:meth:`broker.core.provider.Provider.snapshot_rows`).  Returns the written
    paths.  A provider whose snapshot is kept by hand (its adapter has no ``snapshot_rows``: GCP's is written
    from Google's price pages, dated in the file) is left as it is.  Raises OSError / KeyError for a missing input
    file or column."""
    from broker.core.errors import NotSupported
    from broker.providers import capability, provider_class

    reference_dir = Path(reference_dir)
    out: list[Path] = []
    for name in SNAPSHOT:
        try:
            rows, m = provider_class(name).snapshot_rows(reference_dir)
        except NotSupported:
            continue
        out.append(write_snapshot(Path(out_dir) / capability(name, "snapshot"), name, date, m["source"], m["label"],
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
