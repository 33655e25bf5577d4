"""GCP read side: instance types (machine type + GPUs), offers per zone, quotas from the Compute API, live prices
from the Cloud Billing Catalog.

An instance type is ``<machine type>[+[<N>x]<GPU>]``: ``n1-standard-4+t4`` (N1 with an attached
``nvidia-tesla-t4``; the full accelerator type is accepted too), ``n1-standard-16+4xt4``, or an accelerator-optimized type with its GPUs built in
(``g2-standard-4``: 1 L4; ``a2-highgpu-1g``: 1 A100 40GB).  The snapshot's ``interruptible_usd_per_hour`` column
carries the Spot VM total of each type (older snapshots: ``spot 0.182`` in ``notes``) and ``notes`` the zones
(``zones us-central1-a us-central1-b``).

Spot prices (``docs/reference/gcp-fixtures.md`` "Spot VMs"; shared reference gcp.md sections 7 and 9: the
SkyPilot GCP catalog built from the Cloud Billing Catalog, and https://cloud.google.com/spot-vms/pricing): a fixed
price per type and region, no bid, that Google changes up to once a day, 60-91 % under on-demand.  The planner
prices them as the interruptible twin of each on-demand offer (:mod:`broker.plan.interruptible`, attrs
``interruptible_usd_per_hour`` / ``interruptible_price_source``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable

from broker.core.model import Offer, Quota, Requirements
from broker.providers.gcp.api import PROVIDER

if TYPE_CHECKING:
    from broker.providers.gcp.api import GCPApi

#: accelerator type -> (regional quota metric, built-in machine family or None)
ACCELERATORS: dict[str, str] = {
    "nvidia-tesla-t4": "NVIDIA_T4_GPUS", "nvidia-tesla-v100": "NVIDIA_V100_GPUS",
    "nvidia-tesla-p100": "NVIDIA_P100_GPUS", "nvidia-tesla-p4": "NVIDIA_P4_GPUS", "nvidia-l4": "NVIDIA_L4_GPUS",
    "nvidia-tesla-a100": "NVIDIA_A100_GPUS", "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
    # NVIDIA_H100_GPUS: the enum read has only PREEMPTIBLE_ / COMMITTED_NVIDIA_H100_GPUS (UNCONFIRMED)
    "nvidia-h100-80gb": "NVIDIA_H100_GPUS",
}
#: machine family -> (built-in accelerator or None, CPU quota metric).  G2_CPUS is UNCONFIRMED (not in the enum
#: read); a metric a region does not report is not enforced.
FAMILIES: dict[str, tuple[str | None, str]] = {
    "n1": (None, "CPUS"), "g2": ("nvidia-l4", "G2_CPUS"), "a2": ("nvidia-tesla-a100", "A2_CPUS"),
    "a3": ("nvidia-h100-80gb", "A3_CPUS"),  # A3_CPUS UNCONFIRMED (not in the enum read)
}
#: accelerator-optimized machine types -> (built-in accelerator, GPUs, vCPUs), as Google publishes them
#: (https://cloud.google.com/compute/docs/accelerator-optimized-machines, G2 / A2 / A3 tables): the GPU count is
#: not in every name (g2-standard-24 has 2 L4s, -48 has 4, -96 has 8; the other G2 sizes 1), so it is read here,
#: never guessed from the name.  A type not listed is not a type broker rents.
BUILT_IN: dict[str, tuple[str, int, int]] = {
    **{f"g2-standard-{v}": ("nvidia-l4", {24: 2, 48: 4, 96: 8}.get(v, 1), v) for v in (4, 8, 12, 16, 24, 32, 48, 96)},
    **{f"a2-highgpu-{g}g": ("nvidia-tesla-a100", g, 12 * g) for g in (1, 2, 4, 8)},
    "a2-megagpu-16g": ("nvidia-tesla-a100", 16, 96),
    **{f"a2-ultragpu-{g}g": ("nvidia-a100-80gb", g, 12 * g) for g in (1, 2, 4, 8)},
    **{f"a3-highgpu-{g}g": ("nvidia-h100-80gb", g, 26 * g) for g in (1, 2, 4, 8)},
}
#: description words of each accelerator's GPU SKU in the Cloud Billing Catalog
SKU_WORDS: dict[str, str] = {
    "nvidia-tesla-t4": "Nvidia Tesla T4 GPU", "nvidia-tesla-v100": "Nvidia Tesla V100 GPU",
    "nvidia-tesla-p100": "Nvidia Tesla P100 GPU", "nvidia-tesla-p4": "Nvidia Tesla P4 GPU",
    "nvidia-l4": "Nvidia L4 GPU", "nvidia-tesla-a100": "Nvidia Tesla A100 GPU",
}
GLOBAL_GPU_METRIC = "GPUS_ALL_REGIONS"
#: the short GPU names instance types use (``n1-standard-4+t4``) -> accelerator type (short enough for 80 columns)
ALIASES: dict[str, str] = {"t4": "nvidia-tesla-t4", "v100": "nvidia-tesla-v100", "p100": "nvidia-tesla-p100",
                           "p4": "nvidia-tesla-p4", "l4": "nvidia-l4", "a100": "nvidia-tesla-a100",
                           "a100-80gb": "nvidia-a100-80gb"}


@dataclass(frozen=True)
class GpuType:
    """One instance type taken apart: machine type, accelerator type, GPU count, whether the GPUs are attached
    (``guestAccelerators``, N1) or built in (G2, A2)."""

    instance_type: str
    machine_type: str
    accelerator: str | None
    gpus: int
    attached: bool

    @property
    def family(self) -> str:
        return self.machine_type.split("-", 1)[0]

    def gpu_metric(self, *, spot: bool = False) -> str | None:
        m = ACCELERATORS.get(self.accelerator or "")
        return None if m is None else ("PREEMPTIBLE_" + m if spot else m)

    def cpu_metric(self, *, spot: bool = False) -> str:
        m = FAMILIES.get(self.family, (None, "CPUS"))[1]
        return "PREEMPTIBLE_CPUS" if spot and m == "CPUS" else m


_TYPE = re.compile(r"^([a-z][a-z0-9]*-[a-z0-9-]+?)(?:\+(?:(\d+)x)?([a-z0-9-]+))?$")


def parse_type(instance_type: str) -> GpuType | None:
    """:class:`GpuType` of ``instance_type``; None when it names no GPU type broker knows."""
    m = _TYPE.match(instance_type or "")
    if not m:
        return None
    machine, count, acc = m.group(1), m.group(2), m.group(3)
    if acc:
        acc = ALIASES.get(acc, acc)
        if acc not in ACCELERATORS:
            return None
        return GpuType(instance_type, machine, acc, int(count or 1), True)
    built = BUILT_IN.get(machine)
    if built is None:
        return None
    return GpuType(instance_type, machine, built[0], built[1], False)


def note_field(notes: str, key: str) -> str | None:
    """The value after ``key`` in a snapshot ``notes`` cell (``spot 0.18; zones a b``)."""
    for part in (notes or "").split(";"):
        part = part.strip()
        if part.startswith(key + " "):
            return part[len(key) + 1:].strip()
    return None


#: zones of us-central1 offering each accelerator (skypilot catalog, derived from acceleratorTypes.list;
#: docs/reference/gcp-fixtures.md): used when a snapshot's notes carry no zones (a refreshed snapshot)
DEFAULT_ZONES: dict[str, list[str]] = {
    "nvidia-tesla-t4": ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"],
    "nvidia-tesla-v100": ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"],
    "nvidia-tesla-p100": ["us-central1-c", "us-central1-f"],
    "nvidia-tesla-p4": ["us-central1-a", "us-central1-c"],
    "nvidia-l4": ["us-central1-a", "us-central1-b", "us-central1-c"],
    "nvidia-tesla-a100": ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"],
}


def zones_of(o: Offer) -> list[str]:
    z = note_field(str(o.attrs.get("notes", "")), "zones")
    if z:
        return z.split()
    t = parse_type(o.instance_type)
    zs = DEFAULT_ZONES.get(t.accelerator or "", []) if t else []
    return [x for x in zs if not o.region or x.startswith(o.region + "-")]


def spot_price(o: Offer) -> float | None:
    """The Spot VM total of ``o``, $/hour: the snapshot's ``interruptible_usd_per_hour`` cell, else ``spot X`` in its
    notes (a snapshot written before that column); None when neither is there."""
    v = o.attrs.get("interruptible_usd_per_hour")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    v = note_field(str(o.attrs.get("notes", "")), "spot")
    try:
        return float(v) if v else None
    except ValueError:
        return None


def snapshot_offers(req: Requirements | None = None) -> list[Offer]:
    """The snapshot's offers (:func:`broker.plan.catalog.snapshot_offers`) with ``private_network=True`` and attrs
    ``machine_type``, ``accelerator``, ``zones``, ``limit_name``, and, where the snapshot has a Spot total,
    ``spot_usd_per_hour`` and the interruptible price the planner reads (``interruptible_usd_per_hour``, $/hour for
    the whole VM, with ``interruptible_price_source`` naming the snapshot's date)."""
    from broker.plan import catalog

    out = []
    for o in catalog.snapshot_offers(PROVIDER, req):
        t = parse_type(o.instance_type)
        if t is None:
            continue
        attrs = {**o.attrs, "machine_type": t.machine_type, "accelerator": t.accelerator, "zones": zones_of(o),
                 "limit_name": t.gpu_metric(), "limit_unit": "gpus", "limit_scope": "region"}
        sp = spot_price(o)
        if sp is not None:
            attrs["spot_usd_per_hour"] = sp
            attrs["interruptible_usd_per_hour"] = sp
            where = f" in {o.region}" if o.region else ""
            attrs["interruptible_price_source"] = (f"{o.price_source}: Compute Engine Spot VM price{where} (Google "
                                                   "changes Spot prices up to once a day)")
        out.append(replace(o, private_network=True, attrs=attrs))
    return out


def accelerator_zones(api: "GCPApi") -> dict[str, list[str]]:
    """accelerator type -> the zones that offer it now, from ``acceleratorTypes.aggregatedList`` (every page;
    deprecated types left out), sorted.  Raises ProviderError (AuthError, TransientError) when it cannot be read,
    and for an answer that is not the documented shape."""
    from broker.core.provider import ProviderError

    project = api.require_project("acceleratorTypes.aggregatedList")
    out: dict[str, set[str]] = {}
    token = ""
    for _ in range(100):  # pages
        data = api.get_json("acceleratorTypes.aggregatedList", f"projects/{project}/aggregated/acceleratorTypes"
                            + (f"?pageToken={token}" if token else ""))
        items = data.get("items") or {}
        if not isinstance(items, dict):
            raise ProviderError(PROVIDER, "acceleratorTypes.aggregatedList", "the answer's items is not an object",
                                hint="retry; report it if it persists")
        for scope, lst in items.items():
            zone = str(scope).rsplit("/", 1)[-1]
            for a in (lst or {}).get("acceleratorTypes") or [] if isinstance(lst, dict) else []:
                if not isinstance(a, dict) or not a.get("name"):
                    continue
                if (a.get("deprecated") or {}).get("state") in ("DEPRECATED", "OBSOLETE", "DELETED"):
                    continue
                out.setdefault(str(a["name"]), set()).add(zone)
        token = str(data.get("nextPageToken") or "")
        if not token:
            break
    return {k: sorted(v) for k, v in out.items()}


def with_api_zones(base: list[Offer], by_accelerator: dict[str, list[str]]) -> list[Offer]:
    """``base`` with ``attrs["zones"]`` replaced by the zones of its region that offer its accelerator now (from
    :func:`accelerator_zones`), ``attrs["zones_source"]`` saying so; a type whose accelerator the API lists in no
    zone of its region gets no zones (it cannot be rented there)."""
    out = []
    for o in base:
        t = parse_type(o.instance_type)
        acc = t.accelerator if t else None
        zs = [z for z in by_accelerator.get(acc or "", []) if not o.region or z.startswith(o.region + "-")]
        out.append(replace(o, attrs={**o.attrs, "zones": zs, "zones_source": "acceleratorTypes.aggregatedList"}))
    return out


def offers_per_zone(base: list[Offer], zones: list[str] | None = None) -> list[Offer]:
    """``base`` expanded to one offer per zone that offers its GPU (the API's or the snapshot's zones, or ``zones``
    when given: those of them in the offer's region that offer the GPU)."""
    out = []
    for o in base:
        zs = list(o.attrs.get("zones") or [])
        if zones is not None:
            zs = [z for z in zones if (not o.region or z.startswith(o.region + "-"))
                  and (not zs or z in zs)]
        for z in zs:
            out.append(replace(o, zone=z, offer_id=f"{o.instance_type}@{z}"))
    return out


def list_price(instance_type: str | None) -> float | None:
    from broker.plan.catalog import snapshot_price

    return snapshot_price(PROVIDER, instance_type)


def spot_list_price(instance_type: str | None) -> float | None:
    """The Spot VM $/hour of ``instance_type`` in the snapshot in effect (:func:`spot_price`); None when absent."""
    from broker.plan.catalog import snapshot_offer

    o = snapshot_offer(PROVIDER, instance_type)
    return spot_price(o) if o is not None else None


# ------------------------------------------------------------------------------------------------ quotas
class _Limit:
    """One ``Quota`` object of a REST answer (``metric``, ``limit``, ``usage``; a missing number is 0, as the
    client's message reads it).  Raises ProviderError for a number that is not one."""

    def __init__(self, q: dict[str, Any]):
        from broker.core.provider import ProviderError

        self.metric = q.get("metric")
        try:
            self.limit, self.usage = float(q.get("limit") or 0), float(q.get("usage") or 0)
        except (TypeError, ValueError):
            raise ProviderError(PROVIDER, "regions.get", f"quota {self.metric!r} has a limit or usage that is not "
                                "a number", hint="retry; report it if it persists") from None


def quotas(api: "GCPApi", offers: Iterable[Offer], *, interruptible: bool = False) -> list[Quota]:
    """The limits each GCP offer needs, read through the Compute API: per region (``regions.get``) the GPU metric
    (``NVIDIA_<MODEL>_GPUS``, ``PREEMPTIBLE_`` for spot offers) and the CPU metric of the machine family (``CPUS``,
    ``A2_CPUS`` ...), and project-wide (``projects.get``) ``GPUS_ALL_REGIONS``.  A metric the answer does not carry
    is not enforced (older projects lack GPUS_ALL_REGIONS) and is left out.

    ``interruptible`` (the recipe may rent Spot VMs): also the limits a Spot VM of each type draws on, as Quotas with
    ``interruptible=True`` (the planner judges interruptible options by those only): the ``PREEMPTIBLE_*`` metric
    when the project has been granted it (limit above 0), else the standard metric, because Spot VMs draw on the
    standard quota when no preemptible quota is granted (docs/reference/gcp-fixtures.md "Spot VMs"; shared
    reference gcp.md section 3, https://docs.cloud.google.com/compute/docs/instances/create-use-spot); and
    ``GPUS_ALL_REGIONS``, which counts every GPU.  Raises ProviderError (AuthError, TransientError)."""
    project = api.require_project("regions.get")
    # spot_pairs: region -> (standard metric, preemptible metric) -> instance types
    by_region: dict[str, dict[str, set[str]]] = {}
    spot_pairs: dict[str, dict[tuple[str, str], set[str]]] = {}
    all_gpu_types: set[str] = set()
    for o in offers:
        if o.provider != PROVIDER or not o.region:
            continue
        t = parse_type(o.instance_type)
        if t is None:
            continue
        spot = o.attrs.get("market") == "spot"
        want = by_region.setdefault(o.region, {})
        gm = t.gpu_metric(spot=spot)
        if gm:
            want.setdefault(gm, set()).add(o.instance_type)
        want.setdefault(t.cpu_metric(spot=spot), set()).add(o.instance_type)
        all_gpu_types.add(o.instance_type)
        if interruptible and not spot:
            pairs = spot_pairs.setdefault(o.region, {})
            if gm:
                pairs.setdefault((gm, t.gpu_metric(spot=True) or gm), set()).add(o.instance_type)
            pairs.setdefault((t.cpu_metric(), t.cpu_metric(spot=True)), set()).add(o.instance_type)
    out: list[Quota] = []
    # the REST answers through google-auth (GCPApi.get_json), not the compute client: planning reads two
    # objects and must not pay seconds of client imports for them
    for region, want in sorted(by_region.items()):
        reg = api.get_json("regions.get", f"projects/{project}/regions/{region}")
        have = {q.get("metric"): _Limit(q) for q in reg.get("quotas") or [] if isinstance(q, dict)}

        def quota(metric: str, types: set[str], spot_side: bool = False, why: str = "") -> Quota:
            q = have[metric]
            unit = "vcpus" if metric.endswith("CPUS") else "gpus"
            return Quota(provider=PROVIDER, name=metric, description=f"Compute Engine {metric} in {region}{why}",
                         region=region, scope=region, limit=float(q.limit), used=float(q.usage), unit=unit,
                         instance_types=sorted(types), source="compute regions.get", interruptible=spot_side)

        for metric, types in sorted(want.items()):
            if metric in have:
                out.append(quota(metric, types))
        for (std, pre), types in sorted(spot_pairs.get(region, {}).items()):
            if pre != std and pre in have and float(have[pre].limit) > 0:
                out.append(quota(pre, types, True, " (Spot VMs)"))
            elif std in have:
                out.append(quota(std, types, True, " (Spot VMs: no preemptible quota granted, the standard "
                                                   "quota counts them)"))
    if all_gpu_types:
        proj = api.get_json("projects.get", f"projects/{project}")
        g = next((_Limit(q) for q in proj.get("quotas") or [] if isinstance(q, dict)
                  and q.get("metric") == GLOBAL_GPU_METRIC), None)
        if g is not None:
            for spot_side in ((False, True) if interruptible else (False,)):
                out.append(Quota(provider=PROVIDER, name=GLOBAL_GPU_METRIC,
                                 description="Compute Engine GPUs in all regions (project-wide)", region=None,
                                 scope=None, limit=float(g.limit), used=float(g.usage), unit="gpus",
                                 instance_types=sorted(all_gpu_types), source="compute projects.get",
                                 interruptible=spot_side))
    return out


# ------------------------------------------------------------------------------------------------ live prices
COMPUTE_SERVICE = "services/6F81-5844-456A"


def _unit_price(sku: Any) -> float | None:
    try:
        rate = sku.pricing_info[0].pricing_expression.tiered_rates[-1].unit_price
    except (IndexError, AttributeError):
        return None
    return float(rate.units or 0) + float(rate.nanos or 0) / 1e9


def live_gpu_prices(api: "GCPApi", region: str = "us-central1") -> dict[tuple[str, str], float]:
    """(accelerator type, ``"OnDemand"`` | ``"Preemptible"``) -> $/hour per GPU in ``region`` from the Cloud
    Billing Catalog (``list_skus`` of Compute Engine, every page; GPU SKUs matched on description words,
    ``serviceRegions`` and ``usageType``)."""
    bc = api.client("billing")
    out: dict[tuple[str, str], float] = {}
    with api.errors("cloudbilling list_skus"):
        for sku in bc.list_skus(parent=COMPUTE_SERVICE):
            cat = sku.category
            if cat.resource_group != "GPU" or region not in list(sku.service_regions):
                continue
            desc = sku.description or ""
            usage = cat.usage_type
            if usage not in ("OnDemand", "Preemptible"):
                continue
            for acc, words in SKU_WORDS.items():
                if desc.startswith(words) or (words + " running") in desc:
                    p = _unit_price(sku)
                    if p is not None:
                        out[(acc, usage)] = p
    return out


#: the per-GPU part of each attached-GPU snapshot total (on-demand, spot), $/hour: what a live GPU price replaces
SNAPSHOT_GPU_PART: dict[str, tuple[float, float]] = {
    "nvidia-tesla-t4": (0.35, 0.14), "nvidia-tesla-v100": (2.48, 0.992), "nvidia-tesla-p100": (1.46, 0.584),
    "nvidia-tesla-p4": (0.60, 0.24)}


def live_prices(api: "GCPApi", types: Iterable[str]) -> dict[str, float]:
    """instance type -> on-demand $/hour with the GPU part from the Cloud Billing Catalog (:func:`live_gpu_prices`)
    for attached-GPU (N1) types: snapshot total - snapshot GPU part + live GPU part (the host part stays the
    snapshot's).  Types whose GPU SKU was not found are left out (they keep their snapshot price)."""
    base = {o.instance_type: o for o in snapshot_offers(None)}
    region = next((o.region for o in base.values() if o.region), "us-central1")
    live = live_gpu_prices(api, region)
    out: dict[str, float] = {}
    for it in types:
        o, t = base.get(it), parse_type(it)
        if o is None or t is None or not t.attached or t.accelerator not in SNAPSHOT_GPU_PART:
            continue
        if (t.accelerator, "OnDemand") not in live:
            continue
        od = SNAPSHOT_GPU_PART[t.accelerator][0]
        out[it] = round(o.usd_per_hour - t.gpus * od + t.gpus * live[(t.accelerator, "OnDemand")], 6)
    return out
