"""Quota (service limit) logic, pure: which limit covers an instance type, unit conversions, plain-word verdicts.

Two clouds count GPU quota differently (reference: docs/reference/cloud-apis.md B2 and C1):

* **OCI** limits in service ``compute`` are per **availability domain** and counted in **GPUs**
  (``gpu-a10-count`` covers VM.GPU.A10.1/.2 and BM.GPU.A10.4).  Two VM.GPU.A10.1 nodes of one multi-node job need
  ``gpu-a10-count >= 2`` in **one** AD (the subnet and the cluster live in one AD).
* **AWS** Service Quotas for EC2 are per **region** and counted in **vCPUs** of a family and market:
  ``L-DB2E81BA`` running on-demand G and VT, ``L-417A185B`` running on-demand P, ``L-3819A6DF`` / ``L-7212CCBC`` (P5: ``L-C4BD4855``)
  for spot.  Two g5.xlarge (4 vCPUs each) need 8 vCPUs of ``L-DB2E81BA``.

Hardware and list price per instance type come from the price snapshot in effect (:mod:`broker.plan.catalog`: the
shipped ``providers/snapshots/<provider>.csv`` or a refreshed one; docs/reference/cloud-apis.md C4/B7).

Nothing here does I/O except :func:`instance_specs` reading the catalog snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Literal

from broker.core.model import Quota
from broker.providers import capability

if TYPE_CHECKING:
    from datetime import datetime

    from broker.core.model import Offer


@dataclass(frozen=True)
class InstanceSpec:
    """Hardware and list price of one AWS instance type or OCI shape.

    ``gpu_mem_gib`` is per GPU; ``usd_per_hour`` is the whole unit's on-demand list price (``region`` names where
    the price applies; ``"any"`` for OCI, whose list prices are the same in every commercial region).
    """

    provider: str
    instance_type: str
    gpu_name: str
    gpus: int
    gpu_mem_gib: float
    vcpus: int
    ram_gib: float
    usd_per_hour: float
    region: str = "us-east-1"
    notes: str = ""
    source: str = ""  # the snapshot's price_source
    price_time: "datetime | None" = None  # the snapshot's price_time


def instance_specs(provider: str) -> dict[str, InstanceSpec]:
    """Every GPU instance type / shape of ``provider`` in the price snapshot in effect (:mod:`broker.plan.catalog`).

    Types without GPUs or without a vCPU count are left out.  {} when ``provider`` has no snapshot; a snapshot
    that cannot be parsed raises (ValueError/KeyError from :func:`broker.plan.catalog.snapshot_offers`).
    """
    from broker.plan.catalog import snapshot_offers

    try:
        offers = snapshot_offers(provider)
    except FileNotFoundError:
        return {}
    specs: dict[str, InstanceSpec] = {}
    for o in offers:
        if o.gpu_count <= 0 or not o.vcpus or o.instance_type in specs:
            continue
        specs[o.instance_type] = InstanceSpec(provider, o.instance_type, o.gpu_name, o.gpu_count, o.gpu_mem_gib,
                                              int(o.vcpus), o.ram_gib, o.usd_per_hour, o.region or "any",
                                              str(o.attrs.get("notes", "")), o.price_source, o.price_time)
    return specs


def spec_for(provider: str, instance_type: str) -> InstanceSpec:
    """The spec of one type; raises KeyError naming the known types when it is unknown."""
    specs = instance_specs(provider)
    try:
        return specs[instance_type]
    except KeyError:
        raise KeyError(f"unknown {provider} instance type {instance_type!r}; known: {', '.join(sorted(specs))}") \
            from None


@dataclass(frozen=True)
class LimitRef:
    """Which limit covers an instance type, in which unit and scope (``"AD"`` for OCI, ``"region"`` for AWS,
    ``"account"`` for a limit over every region such as the provider's :meth:`quota_account_limits`)."""

    provider: str
    name: str
    description: str
    unit: Literal["gpus", "vcpus"]
    scope_kind: Literal["AD", "region", "account"]
    service: str


def spot_offer(o: "Offer") -> bool:
    """Whether ``o`` is rented on the provider's interruptible market, whose limits differ from on-demand (AWS spot
    vCPU codes, GCP ``PREEMPTIBLE_*`` metrics): an interruptible variant (attrs ``interruptible`` True,
    :mod:`broker.plan.interruptible`) or an offer marked ``market: spot``."""
    return o.attrs.get("interruptible") is True or o.attrs.get("market") == "spot"


def limit_for(provider: str, instance_type: str, *, spot: bool = False) -> LimitRef | None:
    """The limit that must allow ``instance_type`` (None when the type is not a GPU type of that provider, or the
    provider has no :attr:`~broker.core.provider.Provider.quota`): the adapter's own table
    (:meth:`~broker.core.provider.Provider.quota_limit`), in the unit and scope its capabilities declare."""
    if not capability(provider, "quota"):
        return None
    from broker.providers import provider_class

    found = provider_class(provider).quota_limit(instance_type, spot=spot)
    if found is None:
        return None
    name, description, service = found
    return LimitRef(provider, name, description, capability(provider, "quota_unit"),
                    capability(provider, "quota_scope"), service)


def limits_counted(provider: str, instance_type: str, *, spot: bool = False) -> tuple[str, ...]:
    """The names of every limit one ``instance_type`` instance of ``provider`` counts against (the adapter's
    :meth:`~broker.core.provider.Provider.quota_counts`); () without :attr:`quota`."""
    if not capability(provider, "quota"):
        return ()
    from broker.providers import provider_class

    return tuple(provider_class(provider).quota_counts(instance_type, spot=spot))


def account_limits(provider: str) -> list[LimitRef]:
    """The limits of ``provider`` over every GPU type and region at once (the adapter's
    :meth:`~broker.core.provider.Provider.quota_account_limits`), scope ``"account"``; [] without :attr:`quota`."""
    if not capability(provider, "quota"):
        return []
    from broker.providers import provider_class

    return [LimitRef(provider, name, description, capability(provider, "quota_unit"), "account", service)
            for name, description, service in provider_class(provider).quota_account_limits()]


def known_limits(provider: str) -> list[str]:
    """Every limit name ``provider`` knows for the GPU types of its snapshot (on-demand and spot) and its account
    limits, sorted: what a mistyped ``--limit`` is told to pick from."""
    names = {a.name for a in account_limits(provider)}
    for it in instance_specs(provider):
        for spot in (False, True):
            ref = limit_for(provider, it, spot=spot)
            if ref is not None:
                names.add(ref.name)
    return sorted(names)


# ------------------------------------------------------------------------------------------------ conversions
def instances_to_gpus(spec: InstanceSpec, instances: int) -> int:
    """GPUs held by ``instances`` of ``spec``."""
    return spec.gpus * instances


def instances_to_vcpus(spec: InstanceSpec, instances: int) -> int:
    """vCPUs held by ``instances`` of ``spec`` (what AWS quotas count)."""
    return spec.vcpus * instances


def gpus_to_instances(spec: InstanceSpec, gpus: float) -> int:
    """Whole instances that ``gpus`` GPUs of quota allow (floor)."""
    return int(math.floor(gpus / spec.gpus + 1e-9)) if spec.gpus else 0


def vcpus_to_instances(spec: InstanceSpec, vcpus: float) -> int:
    """Whole instances that ``vcpus`` vCPUs of quota allow (floor)."""
    return int(math.floor(vcpus / spec.vcpus + 1e-9)) if spec.vcpus else 0


def _counts_vcpus(provider: str) -> bool:
    """Whether ``provider``'s GPU limits count vCPUs (its ``quota_unit`` capability; else GPUs)."""
    return capability(provider, "quota_unit") == "vcpus"


def units_needed(provider: str, spec: InstanceSpec, instances: int) -> int:
    """The amount of the covering limit ``instances`` of ``spec`` need, in the provider's ``quota_unit``: GPUs for
    OCI, vCPUs for AWS."""
    return instances_to_vcpus(spec, instances) if _counts_vcpus(provider) else instances_to_gpus(spec, instances)


def instances_allowed(provider: str, spec: InstanceSpec, units: float) -> int:
    """How many instances of ``spec`` ``units`` of the covering limit allow."""
    return vcpus_to_instances(spec, units) if _counts_vcpus(provider) else gpus_to_instances(spec, units)


# ------------------------------------------------------------------------------------------------ topologies
@dataclass(frozen=True)
class Need:
    """What one topology needs from one limit: ``instances`` × ``spec`` = ``units`` of ``limit`` in one scope."""

    topology: str  # "multi-node" | "simulated"
    spec: InstanceSpec
    instances: int
    limit: LimitRef
    units: int


def needs_for(provider: str, nodes: int, gpus_per_node: int, *, instance_type: str | None = None,
              topology: str = "any", spot: bool = False,
              specs: dict[str, InstanceSpec] | None = None) -> list[Need]:
    """What each topology of a job needs, per covering limit.

    ``multi-node``: ``nodes`` instances with ``gpus >= gpus_per_node``; ``simulated``: one instance with
    ``gpus >= nodes * gpus_per_node``.  With ``instance_type`` only that type is used (for the topology it fits);
    otherwise the cheapest fitting type under each limit.  Raises KeyError for an unknown ``instance_type``.
    """
    specs = specs if specs is not None else instance_specs(provider)
    if instance_type is not None:
        spec = specs.get(instance_type) or spec_for(provider, instance_type)
        candidates = [spec]
    else:
        candidates = sorted(specs.values(), key=lambda s: (s.usd_per_hour, s.instance_type))
    topologies: list[tuple[str, int, int]] = []  # (name, instances, gpus per instance at least)
    if topology in ("any", "multi-node") and (nodes > 1 or topology == "multi-node"):
        topologies.append(("multi-node", nodes, gpus_per_node))
    if topology in ("any", "simulated"):
        topologies.append(("simulated", 1, nodes * gpus_per_node))
    out: list[Need] = []
    for topo, count, min_gpus in topologies:
        seen: set[str] = set()
        for spec in candidates:
            if spec.gpus < min_gpus:
                continue
            ref = limit_for(provider, spec.instance_type, spot=spot)
            if ref is None or ref.name in seen:
                continue
            seen.add(ref.name)
            out.append(Need(topo, spec, count, ref, units_needed(provider, spec, count)))
        first = next((n for n in out if n.topology == topo), None)
        if first is not None:  # the account-wide limits count the same GPUs (the cheapest fitting type's)
            for ref in account_limits(provider):
                out.append(Need(topo, first.spec, count, ref, units_needed(provider, first.spec, count)))
    return out


# ------------------------------------------------------------------------------------------------ verdicts
def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _unit_word(unit: str, n: float) -> str:
    word = {"gpus": "GPU", "vcpus": "vCPU", "instances": "instance"}.get(unit, unit)
    return word if n == 1 else word + "s"


@dataclass
class Verdict:
    """A topology's quota verdict: ``ok`` True when some scope (AD/region) has enough available, False when none
    has, None when the limit could not be read (unknown)."""

    need: Need
    ok: bool | None
    sentence: str
    scope: str | None = None  # the scope that fits (or the best one)
    request_value: float | None = None  # new limit to request in the best scope when not ok
    quotas: list[Quota] = field(default_factory=list)


def verdict(need: Need, quotas: Iterable[Quota]) -> Verdict:
    """Plain-word verdict for one topology need against the limits read (``quotas`` of the need's limit name).

    OCI: "2× VM.GPU.A10.1 needs gpu-a10-count ≥ 2 in one AD; you have 1 available in AD-1".
    AWS: "2× g5.xlarge needs 8 vCPUs of L-DB2E81BA (Running On-Demand G and VT instances) in us-east-1; you have
    4 available (= 1× g5.xlarge)".
    """
    qs = [q for q in quotas if q.name == need.limit.name]
    it, n, u = need.spec.instance_type, need.instances, need.units
    if need.limit.scope_kind == "AD":
        head = f"{n}× {it} needs {need.limit.name} ≥ {u} in one AD"
    else:
        head = (f"{n}× {it} needs {u} {_unit_word(need.limit.unit, u)} of {need.limit.name} "
                f"({need.limit.description})"
                + (f" in {qs[0].region or qs[0].scope}" if qs and (qs[0].region or qs[0].scope) else ""))
    if not qs:
        return Verdict(need, None, f"{head}; the limit could not be read (unknown)", request_value=float(u))
    fits = [q for q in qs if q.available >= u]
    best = max(qs, key=lambda q: q.available)
    if fits:
        q = max(fits, key=lambda q: q.available)
        where = q.scope or q.region or "-"
        allowed = instances_allowed(need.limit.provider, need.spec, q.available)
        return Verdict(need, True, f"{head}; you have {_n(q.available)} available in {where} "
                                   f"(= {allowed}× {it}): OK", scope=where, quotas=qs)
    parts = [f"{_n(q.available)} available in {q.scope or q.region or '-'}" for q in
             sorted(qs, key=lambda q: -q.available)]
    where = best.scope or best.region or "-"
    want = suggest_limit(best.limit, best.used, u)  # limit + (need - available) in the best scope
    allowed = instances_allowed(need.limit.provider, need.spec, best.available)
    return Verdict(need, False, f"{head}; you have {', '.join(parts)} (= {allowed}× {it}): request "
                                f"{need.limit.name} = {_n(want)} in {where}",
                   scope=where, request_value=float(want), quotas=qs)


def explain_usage(q: Quota, spec: InstanceSpec | None = None) -> str:
    """What "used X of Y" means, against the console's "critical" marker.

    E.g. "0 of 1 GPUs used means 1 GPU may be launched (the console marks small limits near use as
    'critical'; that is not an error)".
    """
    avail = q.available
    s = (f"{_n(q.used)} of {_n(q.limit)} {_unit_word(q.unit, q.limit)} used means "
         f"{_n(avail)} {_unit_word(q.unit, avail)} may be launched")
    if spec is not None:
        # the quota's own unit: a vCPU limit (GCP's CPUS beside its GPU metrics) fits avail / vCPUs per VM
        if q.unit == "vcpus":
            k = vcpus_to_instances(spec, avail)
        elif q.unit == "gpus":
            k = gpus_to_instances(spec, avail)
        else:
            k = instances_allowed(q.provider, spec, avail)
        s += f" (= {k}× {spec.instance_type})"
    if q.limit == 0:
        s += "; a limit of 0 blocks every launch: request an increase"
    else:
        s += "; the console's 'critical' marker only says usage is near the limit, it is not an error"
    return s


def suggest_limit(limit: float, used: float, need: float) -> float:
    """The new limit to request so that a job needing ``need`` units fits in the limit's scope: the current limit
    plus what the job needs there minus what is available there (never below the current limit).

    E.g. limit 2, used 2, need 2 -> 4 (2 more); limit 4, used 1, need 2 -> 4 (it already fits).
    """
    available = max(0.0, float(limit) - float(used))
    return float(limit) + max(0.0, float(need) - available)


def desired_value(q: Quota | None, units_needed_: float) -> float:
    """The new limit that lets ``units_needed_`` run in ``q``'s scope (:func:`suggest_limit`); the need itself when
    the limit is unknown."""
    if q is None:
        return float(units_needed_)
    return suggest_limit(q.limit, q.used, units_needed_)


#: the largest new limit broker files, per unit (GPUs for OCI, vCPUs for AWS): more is a typo, never a DDP job
MAX_REQUEST_VALUE: dict[str, float] = {"gpus": 1024.0, "vcpus": 20000.0}


def check_request_value(value: float, *, limit_name: str, unit: str, current: float | None = None) -> None:
    """Refuse a quota request value that no provider form would take or that cannot help: not a whole number, not
    above 0, not above the ``current`` limit (when read), or above :data:`MAX_REQUEST_VALUE` for its ``unit``.
    Raises :class:`broker.core.errors.BadInput` (exit 2) naming the value, the bound and what to pass instead."""
    from broker.core.errors import BadInput

    word = "GPUs" if unit == "gpus" else ("vCPUs" if unit == "vcpus" else unit)
    cap = MAX_REQUEST_VALUE.get(unit)
    hint = (f"pass --value as the new limit, a whole number of {word} above the current limit"
            + (f" ({current:g})" if current is not None else "") + (f" and at most {cap:g}" if cap else "")
            + ", or leave it out to request what the job needs")
    if not math.isfinite(value) or value <= 0 or value != math.floor(value):
        raise BadInput(f"--value {value:g} is not a new limit for {limit_name}: it must be a whole number of {word} "
                       "above 0", hint=hint)
    if current is not None and value <= current:
        raise BadInput(f"--value {value:g} does not raise {limit_name}: its current limit is already {current:g} "
                       f"{word}; a request must exceed it", hint=hint)
    if cap is not None and value > cap:
        raise BadInput(f"--value {value:g} {word} for {limit_name} is above the {cap:g} broker files (a typo?)",
                       hint=hint)


def request_command(provider: str, limit: str, value: float, *, scope: str | None = None,
                    region: str | None = None) -> str:
    """The ready ``broker quota request ...`` command that would unblock a plan option (scope only for OCI ADs).

    E.g. ``broker quota request --provider aws --limit L-DB2E81BA --value 8 --region us-east-1``.
    """
    v = int(value) if float(value).is_integer() else value
    cmd = f"broker quota request --provider {provider} --limit {limit} --value {v}"
    if scope and capability(provider, "quota_scope") == "AD":
        cmd += f" --scope {scope}"
    if region:
        cmd += f" --region {region}"
    return cmd


def default_reason(nodes: int, gpus_per_node: int, instance_type: str | None = None) -> str:
    """The justification text used when ``--reason`` is not given."""
    what = f" on {nodes} x {instance_type}" if instance_type else ""
    return (f"PyTorch distributed training validation: {nodes} nodes x {gpus_per_node} GPU"
            f"{'s' if gpus_per_node != 1 else ''}{what}; short runs with a hard deadline and automatic teardown.")


def option_quota_block(offers: list["Offer"], quotas: Iterable[Quota], *, spot: bool = False) -> tuple[str, str] | None:
    """For a plan option (its offers: one for ``simulated``, N for ``multi-node``), whether a limit read blocks it.

    Returns None when no read limit blocks it (including when the covering limit was not read: unknown is not a
    rejection), else ``(reason, next_step)``: a plain sentence with the number needed vs available and the ready
    ``broker quota request ...`` command that would unblock it.  OCI limits are matched on the offer's AD
    (``Quota.scope == Offer.zone``), AWS limits on the region.
    """
    quotas = list(quotas)
    groups: dict[tuple[str, str, str | None], list["Offer"]] = {}
    for o in offers:
        scope = o.zone if capability(o.provider, "quota_scope") == "AD" else o.region
        groups.setdefault((o.provider, o.instance_type, scope), []).append(o)
    for (provider, it, scope), grp in groups.items():
        ref = limit_for(provider, it, spot=spot or any(spot_offer(o) for o in grp))
        if ref is None:
            continue
        o = grp[0]
        spec = InstanceSpec(provider, it, o.gpu_name, o.gpu_count, o.gpu_mem_gib, int(o.vcpus), o.ram_gib,
                            o.usd_per_hour, o.region or "any")
        if _counts_vcpus(provider) and spec.vcpus <= 0:
            spec = instance_specs(provider).get(it, spec)
        units = units_needed(provider, spec, len(grp))
        match = [q for q in quotas if q.provider == provider and q.name == ref.name
                 and (scope is None or (q.scope or q.region) in (scope, None))]
        if not match:
            continue
        q = max(match, key=lambda x: x.available)
        if q.available >= units:
            continue
        where = q.scope or q.region or scope or "-"
        unit = "GPUs" if ref.unit == "gpus" else "vCPUs"
        reason = (f"quota: {len(grp)}× {it} needs {units} {unit} of {ref.name} in {where}; "
                  f"{_n(q.available)} available (limit {_n(q.limit)}, used {_n(q.used)})")
        return reason, request_command(provider, ref.name, desired_value(q, units), scope=where,
                                       region=q.region or o.region)
    return None
