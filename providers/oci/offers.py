"""OCI read side: GPU shapes and their limits, offers per availability domain, quotas, capacity reports.

Prices always come from the price snapshot in effect (OCI has no per-account price API); limits are ``compute``
service limits, AD-scoped and counted in GPUs (:mod:`broker.providers.oci.limits` is the one shape -> limit table).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable

from broker.core.model import Capacity, Offer, Quota, Requirements
from broker.core.provider import AuthError, ProviderError
from broker.providers.oci.limits import limit_for_shape, shape_gpus  # noqa: F401 - re-exported
from broker.providers.oci.sdk import PROVIDER, expect_fields, expect_list, unreadable

if TYPE_CHECKING:
    from broker.providers.oci.sdk import OCIApi

#: Limit names whose existence was seen only in third-party code (docs/reference/cloud-apis.md B2): flagged in Quota/Offer attrs.
UNCONFIRMED_LIMITS = {"gpu-h100-count"}


def snapshot_offers(req: Requirements) -> list[Offer]:
    """Offers of the price snapshot in effect for OCI (:func:`broker.plan.catalog.snapshot_offers`; no region/AD).

    Every offer gets ``private_network=True`` and ``attrs["limit_name"]``."""
    from broker.plan import catalog
    out = []
    for o in catalog.snapshot_offers(PROVIDER, req):
        lim = limit_for_shape(o.instance_type)
        attrs = {**o.attrs, "limit_name": lim, "limit_unit": "gpus", "limit_scope": "AD"}
        if lim in UNCONFIRMED_LIMITS:
            attrs["limit_unconfirmed"] = True
        out.append(replace(o, private_network=True, attrs=attrs))
    return [o for o in out if _matches(o, req)]


def list_price(shape: str | None) -> float | None:
    """$/hour of ``shape`` in the price snapshot in effect; None when it is not there."""
    from broker.plan.catalog import snapshot_price

    return snapshot_price(PROVIDER, shape)


def _matches(o: Offer, req: Requirements) -> bool:
    if o.gpu_count < req.gpus_per_node or o.gpu_mem_gib < req.gpu_mem_floor_gib:
        return False
    if req.gpu_names:
        # "A100" matches A100-40GB and A100-80GB; "A10" matches only A10 (not a substring test)
        g = o.gpu_name.lower().removeprefix("nvidia ").strip()
        names = {n.lower().removeprefix("nvidia ").strip() for n in req.gpu_names}
        if not names & {g, g.split("-")[0]}:
            return False
    return True


def availability_domains(api: "OCIApi") -> list[str]:
    """AD names of the region (``IdentityClient.list_availability_domains(tenancy)``)."""
    idc = api.client("identity")
    call = "list_availability_domains"
    ads = expect_list(call, api.call(call, idc.list_availability_domains, api.tenancy).data)
    return [expect_fields(call, a, "name").name for a in ads]


def offers_per_ad(base: list[Offer], region: str | None, ads: list[str]) -> list[Offer]:
    """``base`` (snapshot offers) expanded to one offer per availability domain, with the region."""
    return [replace(o, region=region, zone=ad, offer_id=o.instance_type)
            for ad in ads for o in base]


def _number(call: str, v: Any, what: str) -> float:
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise unreadable(call, f"{what} is {type(v).__name__}, not a number")
    return float(v)


def quotas(api: "OCIApi", offers: list[Offer], ads_default: Iterable[str]) -> list[Quota]:
    """``compute`` GPU limits per AD for the shapes in ``offers`` (``limit = used + available``, unit GPUs).

    Limits a tenancy does not know (404) are skipped; when every read is refused that is an AuthError."""
    by_limit: dict[str, set[str]] = {}
    zones: set[str] = set()
    for o in offers:
        if o.provider != PROVIDER:
            continue
        lim = limit_for_shape(o.instance_type)
        if lim:
            by_limit.setdefault(lim, set()).add(o.instance_type)
        if o.zone:
            zones.add(o.zone)
    ads = sorted(zones) or list(ads_default)
    lc = api.client("limits")
    call = "get_resource_availability"
    out = []
    not_found: list[ProviderError] = []
    for lim, shapes in sorted(by_limit.items()):
        for ad in ads:
            try:
                ra = api.call(call, lc.get_resource_availability, "compute", lim, api.tenancy,
                              availability_domain=ad, _scope=ad).data
            except ProviderError as e:
                if e.status == 404:  # limit unknown to this tenancy/AD (or not authorized: see below)
                    not_found.append(e)
                    continue
                raise
            if not hasattr(ra, "attribute_map"):
                raise unreadable(call, f"expected an object, got {type(ra).__name__}")
            used, avail = _number(call, ra.used, "used"), _number(call, ra.available, "available")
            desc = f"compute / {lim} (GPUs per availability domain)"
            if lim in UNCONFIRMED_LIMITS:
                desc += "; limit name unconfirmed"
            out.append(Quota(provider=PROVIDER, name=lim, description=desc, region=api.region, scope=ad,
                             limit=used + avail, used=used, unit="gpus", instance_types=sorted(shapes),
                             source="LimitsClient.get_resource_availability"))
    if not_found and not out:  # every read refused: most likely a missing IAM policy, not unknown limits
        raise AuthError(PROVIDER, call, not_found[-1].message.split(": ", 2)[-1],
                        hint="your group needs an IAM policy such as `Allow group <g> to inspect "
                             "resource-availability in tenancy`, or the limit names do not exist in this realm",
                        code=not_found[-1].code, status=404)
    return out


def limit_values(api: "OCIApi", names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Service-limit values of ``compute`` (``list_limit_values``, all pages), for ``broker quota check``.

    Returns dicts ``{name, scope_type, availability_domain, value}``; only GPU limits (``gpu*``) unless
    ``names`` is given."""
    lc = api.client("limits")
    call = "list_limit_values"
    rows = api.all_pages(call, lc.list_limit_values, api.tenancy, "compute", sort_by="name")
    wanted = set(names) if names else None
    out = []
    for r in rows:
        expect_fields(call, r, "name")
        if (wanted is not None and r.name not in wanted) or (wanted is None and not r.name.startswith("gpu")):
            continue
        out.append({"name": r.name, "scope_type": r.scope_type, "availability_domain": r.availability_domain,
                    "value": r.value})
    return out


def capacity(api: "OCIApi", offers: list[Offer], ads_default: list[str]) -> list[Capacity]:
    """One ``create_compute_capacity_report`` per AD for the shapes offered there."""
    import oci

    by_ad: dict[str, list[str]] = {}
    for o in offers:
        if o.provider != PROVIDER:
            continue
        for ad in ([o.zone] if o.zone else ads_default):
            if o.instance_type not in by_ad.setdefault(ad, []):
                by_ad[ad].append(o.instance_type)
    cc = api.client("compute")
    m = oci.core.models
    call = "create_compute_capacity_report"
    out = []
    for ad, shapes in sorted(by_ad.items()):
        details = m.CreateComputeCapacityReportDetails(
            compartment_id=api.tenancy, availability_domain=ad,
            shape_availabilities=[m.CreateCapacityReportShapeAvailabilityDetails(instance_shape=s)
                                  for s in shapes])
        rep = api.call(call, cc.create_compute_capacity_report, details, _scope=ad).data
        if not hasattr(rep, "attribute_map"):
            raise unreadable(call, f"expected a report object, got {type(rep).__name__}")
        for sa in expect_list(call, rep.shape_availabilities or []):
            expect_fields(call, sa, "instance_shape")
            st = sa.availability_status
            status = st if st in ("AVAILABLE", "OUT_OF_HOST_CAPACITY") else \
                "NOT_OFFERED" if st == "HARDWARE_NOT_SUPPORTED" else "UNKNOWN"
            out.append(Capacity(provider=PROVIDER, region=api.region, zone=ad, instance_type=sa.instance_shape,
                                status=status, available_count=sa.available_count,
                                source="ComputeClient.create_compute_capacity_report"))
    return out


#: Shape prefixes with preemptible GPU capacity: VM.GPU2 (P100) and VM.GPU3 (V100) only; no bare metal, no A10 /
#: A100 / H100 VMs (OCI preemptible doc, updated 2025-02-11; interruptible.md 3.2)
PREEMPTIBLE_GPU_SHAPES = ("VM.GPU2.", "VM.GPU3.")
#: Preemptible capacity costs this fraction of on-demand, in all regions (OCI preemptible doc, 2025-02-11)
PREEMPTIBLE_FRACTION = 0.5


def with_preemptible_price(offers: list[Offer]) -> list[Offer]:
    """``offers`` with the preemptible price (:data:`PREEMPTIBLE_FRACTION` of the on-demand price in effect) of the
    shapes that have preemptible capacity as their interruptible price (:mod:`broker.plan.interruptible` attrs);
    other shapes lose any interruptible price (OCI would refuse to launch them preemptible)."""
    from dataclasses import replace

    out = []
    for o in offers:
        attrs = {k: v for k, v in o.attrs.items()
                 if k not in ("interruptible_usd_per_hour", "interruptible_price_source")}
        if o.instance_type.startswith(PREEMPTIBLE_GPU_SHAPES) and o.usd_per_hour > 0:
            attrs["interruptible_usd_per_hour"] = round(o.usd_per_hour * PREEMPTIBLE_FRACTION, 6)
            attrs["interruptible_price_source"] = (f"OCI preemptible: {PREEMPTIBLE_FRACTION:.0%} of {o.price_source} "
                                                   "(OCI preemptible doc 2025-02-11)")
        out.append(replace(o, attrs=attrs) if attrs != o.attrs else o)
    return out
