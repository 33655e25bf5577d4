"""The planner: the cheapest valid way to run a job within a budget, and why every other option was rejected.

Pure and deterministic: :func:`plan` reads only its arguments (no clock unless ``now`` is omitted, no files, no
network) and returns a :class:`broker.core.model.Plan`.  Costs come from :mod:`broker.plan.pricing` only.

Options (topologies, docs/design.md):

* ``simulated`` -- one host with at least ``nodes x gpus_per_node`` GPUs (any provider, Vast.ai included).
* ``multi-node`` -- ``nodes`` hosts of one offer, each with at least ``gpus_per_node`` GPUs, in one private network
  and one availability domain / zone; only offers with ``private_network`` (OCI, AWS), never across Vast.ai hosts.
* ``local`` -- the local provider's free offer (this machine), when it is given.

Rejection reasons, checked in this order (an option keeps all that apply): GPU model not accepted, GPU memory
too small, topology rules, capacity (``OUT_OF_HOST_CAPACITY`` / ``NOT_OFFERED`` / too few available in that zone),
quota (units needed vs available in ONE scope; a ready ``broker quota request`` command as ``next_step``),
budget (worst case above the budget; says what would fit).

Budget and hours: with ``req.hours`` set the hard deadline is ``hours`` (plus the provider's setup allowance) and
options whose worst case exceeds ``req.budget_usd`` are rejected; valid options are ranked by worst-case cost.
With ``req.hours`` None each option's deadline is the longest run its budget affords
(:func:`broker.plan.pricing.max_hours_within`), options affording less than :data:`MIN_RUN_SECONDS` are rejected, and
valid options are ranked by that longest run (longest first), then by worst-case cost.  Ties are broken by
provider, instance type, region, zone, offer id and topology, so the result never depends on input order.

Zones: an offer without a zone (OCI shapes priced for "any" region, AWS types priced per region) is placed in each
zone named by a capacity fact or a zone-scoped quota for its instance type, so quota and capacity are judged
per availability domain / zone; with no such facts it stays unplaced (zone chosen at provisioning).

Scale: offers are screened with plain attribute reads and float arithmetic; PlanOption / Offer objects are built
only for the ``top_k`` best valid options and ``rejected_per_reason`` representatives per reason kind (the
cheapest of each), so 100k offers plan in a fraction of a second.  All rejections are counted in
``Plan.rejected_counts``.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from functools import lru_cache

from broker.core.prose import usd
from broker.plan import pricing
from broker.plan.freetier import FREE_TIER_ATTR, cpu_only, free_tier_offers, parse_free_tier  # noqa: F401
from broker.plan.rejections import REASON_KINDS, rejected_note
from broker.core.model import (Capacity, Offer, Plan, PlanOption, Quota, Rejection, Requirements, TopologyKind,
                                utcnow)
from broker.providers import HYBRID_CLOUD, THIS_MACHINE, unsupported_reason

#: providers whose machines are full VMs with /dev/net/tun (WireGuard / Tailscale run there): rented, with
#: ``hybrid`` among the adapter's ``topologies``
TUN_PROVIDERS = HYBRID_CLOUD
NO_TUN_REASON = ("hybrid needs a VM with /dev/net/tun for WireGuard/Tailscale; {provider} containers have none "
                 "(use " + " or ".join(TUN_PROVIDERS) + " for the cloud side)")


def why_not_hybrid(provider: str) -> str | None:
    """None when ``provider`` can host the cloud side of a hybrid run; else the reason: the one its declaration
    gives (``providers/declared.py``), else :data:`NO_TUN_REASON`, and which providers can."""
    if provider in TUN_PROVIDERS:
        return None
    declared = unsupported_reason(provider, "hybrid")
    if declared is None:
        return NO_TUN_REASON.format(provider=provider)
    return f"{declared} (use {' or '.join(TUN_PROVIDERS)} for the cloud side)"


#: With ``hours`` None: options whose budget affords less job time than this are rejected.
MIN_RUN_SECONDS = 60
#: With ``hours`` None and no budget: the deadline used (a run always has a hard deadline).
DEFAULT_HOURS = 1.0
#: With ``hours`` None: the deadline of free options (local), which the budget does not bound.
FREE_DEADLINE_HOURS = 24.0


_BLOCKING = {"OUT_OF_HOST_CAPACITY", "NOT_OFFERED"}
_TOKEN = re.compile(r"[a-z0-9]+")


@lru_cache(maxsize=4096)
def _tokens(s: str) -> tuple[str, ...]:
    return tuple(_TOKEN.findall(s.lower()))


@lru_cache(maxsize=65536)
def gpu_name_matches(wanted: str, name: str) -> bool:
    """True when GPU model ``wanted`` (user's words) names ``name`` (provider's words).

    Case, spaces, ``-`` and ``_`` are ignored and ``wanted`` must match whole consecutive words of ``name``:
    ``A100`` matches ``A100 SXM4`` and ``A100-80GB``; ``4090`` and ``RTX_4090`` match ``RTX 4090``; ``A10`` matches
    ``A10`` but not ``A100`` nor ``A10G``.
    """
    w = "".join(_tokens(wanted))
    n = _tokens(name)
    if not w:
        return False
    for i in range(len(n)):
        acc = ""
        for j in range(i, len(n)):
            acc += n[j]
            if acc == w:
                return True
            if len(acc) >= len(w):
                break
    return False


def fmt_num(x: float) -> str:
    """A number as people write it: ``24``, ``23.99``, ``0.5``."""
    r = round(x, 2)
    return f"{int(r)}" if r == int(r) else f"{r:g}"


def digits_note(x: float, versus: float) -> str:
    """`` (over it by $0.0029)`` (or ``under``) when :func:`~broker.core.prose.usd` shows ``x`` beside ``versus``
    with more digits than the cent, so a reader sees the difference itself rather than two amounts that look
    alike; else ``""``."""
    if x != versus and usd(x, places=2) == usd(versus, places=2) and not 0 < x < 0.01:
        return f" ({'over' if x > versus else 'under'} it by {usd(abs(x - versus), places=4)})"
    return ""


def _h(x: float) -> str:
    """Hours rounded down (what a budget affords never reads longer than it is)."""
    return f"{math.floor(x * 100) / 100:.2f} h"


# ------------------------------------------------------------------------------------------------ facts
class _Facts:
    """Quota and capacity facts indexed by (provider, instance_type), plus the zones each type is known in.

    Capacity facts are compressed without changing what they decide: facts that can never block (AVAILABLE /
    UNKNOWN without a count) only name zones; the others are kept once per (region, zone, status) with the
    smallest count, indexed by region, so a market of 100k live offers (one fact each) costs O(1) per offer.
    """

    def __init__(self, quotas: Iterable[Quota], capacities: Iterable[Capacity]):
        self.quotas: dict[tuple[str, str], list[Quota]] = {}
        self.caps: dict[tuple[str, str], dict[str | None, list[tuple[str | None, str, int | None]]]] = {}
        self.zones: dict[tuple[str, str], dict[str, str | None]] = {}  # zone -> region
        for q in quotas:
            zoned = bool(q.scope) and q.scope != q.region
            for it in q.instance_types:
                k = (q.provider, it)
                self.quotas.setdefault(k, []).append(q)
                if zoned:
                    self.zones.setdefault(k, {}).setdefault(q.scope, q.region)
        groups: dict[tuple, int | None] = {}
        for c in capacities:
            k = (c.provider, c.instance_type)
            if c.zone:
                z = self.zones.setdefault(k, {})
                if z.get(c.zone) is None:
                    z[c.zone] = c.region
            if c.status not in _BLOCKING and c.available_count is None:
                continue  # never blocks
            g = (k, c.region, c.zone, c.status)
            if g not in groups or groups[g] is None:
                groups[g] = c.available_count
            elif c.available_count is not None:
                groups[g] = min(groups[g], c.available_count)  # type: ignore[type-var]
        for (k, region, zone, status), count in sorted(groups.items(), key=lambda kv: repr(kv[0])):
            self.caps.setdefault(k, {}).setdefault(region, []).append((zone, status, count))

    def capacity_facts(self, key: tuple[str, str], region: str | None) -> list[tuple[str | None, str, int | None]]:
        """(zone, status, count) facts of ``key`` that apply in ``region`` (all regions when it is None)."""
        by_region = self.caps.get(key)
        if not by_region:
            return []
        if region is None:
            return [f for lst in by_region.values() for f in lst]
        return by_region.get(region, []) + (by_region.get(None, []) if region is not None else [])

    def placements(self, o: Offer) -> list[tuple[str | None, str | None]]:
        """(region, zone) pairs where ``o`` is judged."""
        if o.zone is not None:
            return [(o.region, o.zone)]
        zones = self.zones.get((o.provider, o.instance_type))
        if not zones:
            return [(o.region, None)]
        out = []
        for z in sorted(zones):
            r = zones[z]
            if o.region is not None and r is not None and r != o.region:
                continue
            out.append((o.region or r, z))
        return out or [(o.region, None)]


def _region_ok(a: str | None, b: str | None) -> bool:
    return a is None or b is None or a == b


def _quota_need(q: Quota, o: Offer, units: int) -> float:
    if q.unit == "gpus":
        return units * o.gpu_count
    if q.unit == "vcpus":
        return units * o.vcpus
    return float(units)


def _quota_command(q: Quota, value: float) -> str:
    cmd = f"broker quota request --provider {q.provider} --limit {q.name} --value {fmt_num(value)}"
    if q.scope and q.scope != q.region:
        cmd += f" --scope {q.scope}"
    if q.region:
        cmd += f" --region {q.region}"
    return cmd


# ------------------------------------------------------------------------------------------------ free tiers
def _free_tier_reasons(o: Offer, units: int, ctx: "_Ctx") -> list[Rejection]:
    """A free-tier offer beyond its limit: N nodes at once (OCI: 2 E2.1.Micro; 4 A1 OCPUs, one per node here) or
    N nodes x deadline hours beyond the monthly instance-hours (AWS 750)."""
    lim = o.attrs.get(FREE_TIER_ATTR)
    if not lim:
        return []
    out = []
    if lim.get("max_units") is not None and units > lim["max_units"]:
        out.append(Rejection("quota", f"free tier: {units} node(s) > {lim['max_units']} "
                                      f"{lim.get('unit') or 'units'} ({o.instance_type}); beyond that it is not free"))
    hours = ctx.hours
    if lim.get("max_instance_hours") is not None and hours is not None and units * hours > lim["max_instance_hours"]:
        out.append(Rejection("quota", f"free tier: {units} node(s) x {fmt_num(hours)} h > "
                                      f"{fmt_num(lim['max_instance_hours'])} {lim.get('unit') or 'instance-hours'}"))
    return out


# ------------------------------------------------------------------------------------------------ evaluation
class _Ctx:
    def __init__(self, req: Requirements, facts: _Facts):
        self.req = req
        self.facts = facts
        self.n_total = req.nodes * req.gpus_per_node
        self.disk = req.disk_gib
        self.budget = req.budget_usd
        self.hours = req.hours
        if self.hours is None and self.budget is None:
            self.hours = DEFAULT_HOURS
        self.wanted = tuple(req.gpu_names)
        self.here: tuple[int, float] | None = None  # this machine: (GPU count, smallest GPU memory GiB)


def _cpu_here(o: Offer, req: Requirements) -> bool:
    """An offer of this machine's CPU as hosts (``attrs`` ``cpu`` and ``this_machine``: the emulated netns nodes)
    for a job that accepts gloo on CPU (``cpu_ok``): GPU model, memory and count do not apply, as for ``local``."""
    return bool(req.cpu_ok and o.attrs.get("cpu") and o.attrs.get("this_machine"))


def _offer_reasons(o: Offer, ctx: _Ctx, full: bool) -> list[Rejection]:
    """Offer-level reasons (model, memory) as (kind, text); stops at the first unless ``full``."""
    out: list[Rejection] = []
    req = ctx.req
    if o.provider in THIS_MACHINE and (o.attrs.get("cpu") or o.gpu_count == 0):
        return out  # CPU only: model and memory do not apply (the local topology rule says if cpu_ok allows it)
    if _cpu_here(o, req):
        return out  # this machine's CPU in emulated hosts (netns), gloo: model and memory do not apply
    if cpu_only(req) and o.gpu_count == 0:
        return out  # a CPU-only job on a CPU machine: GPU model and memory do not apply
    if ctx.wanted and not any(gpu_name_matches(w, o.gpu_name) for w in ctx.wanted):
        out.append(Rejection("gpu-model", f"GPU model {o.gpu_name} not accepted (wanted: "
                                          f"{', '.join(ctx.wanted)})"))
        if not full:
            return out
    if o.gpu_mem_gib < req.gpu_mem_floor_gib:
        out.append(Rejection("gpu-memory", f"GPU memory {fmt_num(o.gpu_mem_gib)} GiB < "
                                           f"{fmt_num(req.min_gpu_mem_gib)} GiB"))
    return out


def _topology_reasons(o: Offer, topo: str, ctx: _Ctx) -> list[Rejection]:
    req = ctx.req
    if topo == "local":
        if o.attrs.get("cpu") or o.gpu_count == 0:
            if not req.cpu_ok:
                return [Rejection("topology", "no GPU; cpu_ok not set (set cpu_ok: true or --cpu-ok for a "
                                              "gloo-on-CPU logic check)", lifted_by="cpu_ok")]
            return []
        if o.gpu_count < ctx.n_total and not req.cpu_ok:
            return [Rejection("topology", f"this machine has {o.gpu_count} GPU(s) < {ctx.n_total} needed "
                                          f"({req.nodes} nodes x {req.gpus_per_node})")]
        return []
    if topo == "hybrid":
        out = []
        why = why_not_hybrid(o.provider)
        if why:
            out.append(Rejection("topology", why))
        node0 = _why_not_node0(ctx)
        if node0:
            out.append(node0)
        if o.gpu_count < req.gpus_per_node:
            out.append(Rejection("topology", f"hybrid needs {req.gpus_per_node} GPUs per VM; this one has "
                                             f"{o.gpu_count}"))
        return out
    if topo == "simulated":
        if o.gpu_count < ctx.n_total:
            return [Rejection("topology", f"simulated needs one host with {ctx.n_total} GPUs ({req.nodes} nodes "
                                          f"x {req.gpus_per_node}); this one has {o.gpu_count}")]
        return []
    out = []
    if not o.private_network:
        alt = (f"use simulated on one host with {ctx.n_total} GPUs" if ctx.n_total else
               "use simulated: every node on one host, CPU only (gloo)")
        out.append(Rejection("topology", f"multi-node across {o.provider} hosts is not valid: they share no private "
                                         f"network (separate NATs); {alt}"))
    if o.gpu_count < req.gpus_per_node and not _cpu_here(o, req):
        out.append(Rejection("topology", f"multi-node needs {req.gpus_per_node} GPUs per host; this one has "
                                         f"{o.gpu_count}"))
    return out


def _why_not_node0(ctx: "_Ctx") -> Rejection | None:
    """Why this machine cannot be node 0 of a hybrid run (None when it can, or when its GPUs are unknown)."""
    req, here = ctx.req, ctx.here
    if here is None or req.cpu_ok:
        return None
    count, mem = here
    if count == 0:
        return Rejection("topology", "hybrid: node 0 is this machine, which has no GPU; set cpu_ok: true (or "
                                     "--cpu-ok) for gloo on CPU on every node", lifted_by="cpu_ok")
    if count < req.gpus_per_node:
        return Rejection("topology", f"hybrid: node 0 is this machine, which has {count} GPU(s) < "
                                     f"{req.gpus_per_node} per node")
    if 0 < mem < req.gpu_mem_floor_gib:  # 0: memory unknown (the driver's /proc listing gives the model only)
        return Rejection("topology", f"hybrid: node 0 is this machine, whose GPU memory {fmt_num(mem)} GiB < "
                                     f"{fmt_num(req.min_gpu_mem_gib)} GiB")
    return None


def _capacity_reasons(o: Offer, region: str | None, zone: str | None, units: int,
                      ctx: _Ctx) -> list[Rejection]:
    out = []
    where = zone or region or "any region"
    for c_zone, status, count in ctx.facts.capacity_facts((o.provider, o.instance_type), region):
        if c_zone is not None and c_zone != zone:
            continue
        if status == "OUT_OF_HOST_CAPACITY":
            out.append(Rejection("capacity", f"capacity: OUT_OF_HOST_CAPACITY for {o.instance_type} in {where}"))
        elif status == "NOT_OFFERED":
            out.append(Rejection("capacity", f"capacity: {o.instance_type} is NOT_OFFERED in {where}"))
        elif count is not None and count < units:
            out.append(Rejection("capacity", f"capacity: {count} {o.instance_type} available in {where}; "
                                             f"needs {units}"))
    return out


def _capacity_blocked(facts: _Facts, key: tuple[str, str], region: str | None, zone: str | None,
                      units: int) -> bool:
    """Screening twin of :func:`_capacity_reasons` (same rules, no text)."""
    for c_zone, status, count in facts.capacity_facts(key, region):
        if c_zone is not None and c_zone != zone:
            continue
        if status in _BLOCKING or (count is not None and count < units):
            return True
    return False


def _quota_blocked(qs: list[Quota], o: Offer, region: str | None, zone: str | None, units: int) -> bool:
    """Screening twin of :func:`_quota_reasons` (same rules, no text)."""
    for q in qs:
        if not _region_ok(q.region, region):
            continue
        if q.scope and q.scope != q.region and q.scope != zone:
            continue
        if _quota_need(q, o, units) > q.available:
            return True
    return False


def _quota_reasons(o: Offer, region: str | None, zone: str | None, units: int,
                   ctx: _Ctx) -> tuple[list[Rejection], str | None]:
    qs = ctx.facts.quotas.get((o.provider, o.instance_type))
    if not qs:
        return [], None
    out: list[Rejection] = []
    step = None
    for q in qs:
        if not _region_ok(q.region, region):
            continue
        zoned = bool(q.scope) and q.scope != q.region
        if zoned and q.scope != zone:
            continue
        need = _quota_need(q, o, units)
        avail = q.available
        if need > avail:
            scope = q.scope or q.region or "the account"
            cmd = _quota_command(q, q.used + need)
            out.append(Rejection("quota", f"quota {q.name} {fmt_num(avail)} of {fmt_num(q.limit)} {q.unit} "
                                          f"available in {scope}; needs {fmt_num(need)}", next_step=cmd))
            if step is None:
                step = cmd
    return out, step


def _costs(o: Offer, units: int, ctx: _Ctx) -> tuple[float, float, float, float | None, str | None]:
    """(rate $/h of the option incl. storage, deadline hours, worst case $, max job hours in budget, budget
    reason or None)."""
    rate = pricing.unit_rate_usd_per_hour(o.usd_per_hour, o.storage_usd_per_gib_month, ctx.disk)
    allow = pricing.setup_allowance_seconds(o.provider)
    mbs = o.min_billed_seconds
    budget = ctx.budget
    # bandwidth billed per GB (staged in, collected out): a fixed part of the worst case, off the time a budget buys
    xfer = units * pricing.transfer_usd(o.attrs, ctx.req.transfer_in_gb, ctx.req.transfer_out_gb)
    max_h: float | None = None
    free = rate <= 0
    if budget is not None and not free:
        s = pricing.max_billed_seconds(max(0.0, budget - xfer), units, rate, mbs)
        max_h = max(0.0, (s - allow) / 3600.0) if s >= 0 else 0.0
    hours = ctx.hours
    reason = None
    if hours is None:  # budget set: run as long as it affords
        if free:
            hours = FREE_DEADLINE_HOURS
        else:
            hours = max_h or 0.0
            if hours * 3600.0 < MIN_RUN_SECONDS:
                min_cost = pricing.cost_usd(units, rate, pricing.billed_seconds(allow + MIN_RUN_SECONDS, mbs))
                reason = (f"budget {usd(budget)} affords no run: setup allowance {allow // 60} min plus 1 min of "
                          f"job costs {usd(min_cost, budget)} at {usd(units * rate)}/h"
                          f"{digits_note(min_cost, budget)}")
    wc = pricing.cost_usd(units, rate, pricing.billed_seconds(pricing.deadline_seconds(hours, allow), mbs)) + xfer
    if reason is None and budget is not None and wc > budget:
        fit = f"affords {_h(max_h)}" if max_h and max_h * 3600.0 >= MIN_RUN_SECONDS else "affords no run"
        # one sentence shape for every budget rejection, with the difference ("$5.0029 > $5.00" read like two
        # equal amounts, so the difference gets four places where cents would hide it)
        over = usd(wc - budget, places=4) if digits_note(wc, budget) else usd(wc - budget)
        reason = (f"worst case {usd(wc, budget)} at {fmt_num(hours)} h is over the {usd(budget)} budget by {over}; "
                  f"{fit}")
    return units * rate, hours, wc, (None if free else max_h), reason


def _units(topo: str, req: Requirements) -> int:
    """Rented units of one option: every node for multi-node, the VMs only for hybrid (node 0 is this machine)."""
    return req.nodes if topo == "multi-node" else (max(1, req.nodes - 1) if topo == "hybrid" else 1)


def _evaluate(o: Offer, region: str | None, zone: str | None, topo: str, ctx: _Ctx, full: bool,
              offer_reasons: list[Rejection]) -> tuple[list[Rejection], str | None, tuple]:
    """Reasons (kind, text), quota next step, and (rate, hours, wc, max_h) of one candidate.

    ``full`` False stops after the first reason kind that rejects (screening); True collects every reason."""
    units = _units(topo, ctx.req)
    reasons = list(offer_reasons)
    step = None
    if reasons and not full:
        return reasons, None, ()
    reasons += _topology_reasons(o, topo, ctx)
    if reasons and not full:
        return reasons, None, ()
    if topo != "local":
        reasons += _capacity_reasons(o, region, zone, units, ctx)
        if reasons and not full:
            return reasons, None, ()
        qr, step = _quota_reasons(o, region, zone, units, ctx)
        reasons += qr + _free_tier_reasons(o, units, ctx)
        if reasons and not full:
            return reasons, step, ()
    rate, hours, wc, max_h, budget_reason = _costs(o, units, ctx)
    if budget_reason:
        reasons.append(Rejection("budget", budget_reason))
    return reasons, step, (rate, hours, wc, max_h)


def _option(o: Offer, region: str | None, zone: str | None, topo: str, ctx: _Ctx, reasons: list[Rejection],
            step: str | None, costs: tuple) -> PlanOption:
    units = _units(topo, ctx.req)
    if (region, zone) != (o.region, o.zone):
        o = replace(o, region=region, zone=zone)
    rate, hours, wc, max_h = costs
    xfer = units * pricing.transfer_usd(o.attrs, ctx.req.transfer_in_gb, ctx.req.transfer_out_gb) if costs else 0.0
    source = o.price_source + (f" + {usd(xfer, up_to=4)} transfer ({fmt_num(ctx.req.transfer_in_gb)} GB in, "
                               f"{fmt_num(ctx.req.transfer_out_gb)} GB out per node)" if xfer >= 0.005 else "")
    return PlanOption(provider=o.provider, topology=TopologyKind(topo), offers=[o] * units, nodes=ctx.req.nodes,
                      gpus_per_node=ctx.req.gpus_per_node, usd_per_hour=rate, worst_case_usd=wc, hours=hours,
                      max_hours_within_budget=max_h, price_source=source,
                      rejected=reasons, next_step=step)


# ------------------------------------------------------------------------------------------------ plan
#: Offer.attrs key of an offer's interruptible price (broker.plan.interruptible.PRICE_ATTR; repeated here so the
#: on-demand-only path does not import that module)
_SPOT_PRICE, _SPOT_FLAG = "interruptible_usd_per_hour", "interruptible"


def plan(requirements: Requirements, offers: Sequence[Offer], quotas: Iterable[Quota] = (),
         capacities: Iterable[Capacity] = (), now: datetime | None = None, notes: Iterable[str] = (), *,
         unavailable: Mapping[str, str] | None = None, top_k: int = 10, rejected_per_reason: int = 5,
         here: tuple[int, float] | None = None) -> Plan:
    """The cheapest valid options for ``requirements`` over ``offers`` (see :func:`plan_on_demand`), with
    interruptible (bid / spot / preemptible) options as ``requirements.interruptible`` asks when any offer has an
    interruptible price (:func:`broker.plan.interruptible.plan`): ``false`` plans on-demand and names what
    interruptible would save, ``true`` plans interruptible only, ``auto`` both, ranked by expected cost."""
    kw = dict(quotas=list(quotas), capacities=list(capacities), now=now, notes=list(notes), unavailable=unavailable,
              top_k=top_k, rejected_per_reason=rejected_per_reason, here=here)
    if requirements.interruptible != "false" or any(_SPOT_PRICE in o.attrs or _SPOT_FLAG in o.attrs for o in offers):
        from broker.plan import interruptible

        return interruptible.plan(plan_on_demand, requirements, offers, **kw)
    return plan_on_demand(requirements, offers, **kw)


def plan_on_demand(requirements: Requirements, offers: Sequence[Offer], quotas: Iterable[Quota] = (),
                   capacities: Iterable[Capacity] = (), now: datetime | None = None, notes: Iterable[str] = (), *,
                   unavailable: Mapping[str, str] | None = None, top_k: int = 10, rejected_per_reason: int = 5,
                   here: tuple[int, float] | None = None) -> Plan:
    """The cheapest valid options for ``requirements`` over ``offers`` and the rejected ones with reasons.

    ``quotas`` / ``capacities``: facts from the adapters (matched to offers by provider and instance type;
    zone-scoped quotas and capacity per zone).  ``unavailable``: provider -> why it offers nothing (e.g. the
    local machine's ``why_not``; a :class:`Rejection` keeps its data, plain text is of kind ``provider``), listed
    as rejected options.  ``now``: the plan's timestamp (default: now).
    ``notes``: passed through to ``Plan.notes`` (price sources, missing credentials).
    ``here``: this machine's (GPU count, smallest GPU memory in GiB), node 0 of a ``hybrid`` option; None =
    unknown (not checked).  ``hybrid`` is opt-in (``topology: hybrid``); under ``any`` its cheapest valid option is
    only named in the notes, never chosen.

    Returns a Plan whose ``options`` are the ``top_k`` best valid options (``options[0]`` is chosen: the cheapest
    valid one) and whose ``rejected`` holds up to ``rejected_per_reason`` representatives (the cheapest) per
    reason kind; ``rejected_counts`` counts every rejected candidate by its first reason kind.
    """
    req = requirements
    ctx = _Ctx(req, _Facts(quotas, capacities))
    ctx.here = here
    allowed = _Allowed(req)
    out_notes = list(notes)
    if ctx.hours is not None and req.hours is None:
        out_notes.append(f"no hours and no budget given: deadline {fmt_num(ctx.hours)} h")
    found = _screen(offers, ctx, allowed)
    hybrid_seen = found.drop_hybrid() if allowed.hybrid and req.topology != "hybrid" else []
    rank = _Ranking(offers, ctx)
    options = [rank.build(e) for e in rank.best(found.valid, top_k)]
    rejected, counts = _rejected_options(found, rank, unavailable, ctx, rejected_per_reason)
    out_notes += _topology_notes(req, allowed, rank, hybrid_seen)
    note = rejected_note(counts, len(rejected), rejected_per_reason)
    if note:
        out_notes.append(note)
    return Plan(requirements=req, options=options, rejected=rejected, notes=out_notes,
                created_at=now or utcnow(), rejected_counts=counts, valid_count=len(found.valid))


class _Allowed:
    """Which topologies a job's ``topology`` lets the plan consider (``hybrid`` is opt-in: under ``any`` it is only
    named in the notes)."""

    def __init__(self, req: Requirements):
        t = req.topology
        self.local = t in ("any", "simulated", "local")
        self.simulated = t in ("any", "simulated")
        self.multi = t == "multi-node" or (t == "any" and req.nodes > 1)
        self.hybrid = t in ("hybrid", "any") and req.nodes > 1
        self.cloud = tuple(name for name, ok in (("simulated", self.simulated), ("multi-node", self.multi),
                                                 ("hybrid", self.hybrid)) if ok)


class _Found:
    """What screening found.  Entries are (value, worst case, offer index, region, zone, topology); ``value``
    orders them (worst case, or minus the affordable hours when the budget sets the deadline).  Strings are
    built only for the options that end up in the Plan."""

    def __init__(self) -> None:
        self.valid: list[tuple] = []
        self.rej: dict[str, list[tuple]] = {k: [] for k in REASON_KINDS}
        self.counts: dict[str, int] = dict.fromkeys(REASON_KINDS, 0)

    def drop_hybrid(self) -> list[tuple]:
        """Take the hybrid entries out (under ``any``, hybrid is only named in a note); the valid ones taken."""
        seen = [e for e in self.valid if e[5] == "hybrid"]
        self.valid = [e for e in self.valid if e[5] != "hybrid"]
        for kind, lst in self.rej.items():
            drop = sum(1 for e in lst if e[5] == "hybrid")
            if drop:
                self.counts[kind] -= drop
                self.rej[kind] = [e for e in lst if e[5] != "hybrid"]
        return seen


def _screen_local(o: Offer, oi: int, ctx: _Ctx, found: _Found) -> None:
    """This machine's offer, judged by the general (text-building) path: it is one offer."""
    reasons, _, costs = _evaluate(o, o.region, o.zone, "local", ctx, False, _offer_reasons(o, ctx, False))
    if reasons:
        kind = reasons[0].kind.value
        found.counts[kind] += 1
        found.rej[kind].append((0.0, 0.0, oi, o.region, o.zone, "local"))
        return
    wc, max_h = costs[2], costs[3]
    hours_given = ctx.req.hours is not None or ctx.req.budget_usd is None
    found.valid.append((wc if hours_given else -(math.inf if max_h is None else max_h), wc, oi, o.region, o.zone,
                        "local"))


def _screen(offers: Sequence[Offer], ctx: _Ctx, allowed: _Allowed) -> _Found:
    """Every candidate (offer x topology x place) judged with plain attribute reads and float arithmetic, in the
    planner's check order (model, memory, topology, capacity, quota, budget); counted under its first reason."""
    req, facts, found = ctx.req, ctx.facts, _Found()
    valid, rej, counts = found.valid, found.rej, found.counts
    topo_req, cloud_topos, providers = req.topology, allowed.cloud, set(req.providers)
    hours_given = req.hours is not None or req.budget_usd is None
    node0_ok = _why_not_node0(ctx) is None
    n_counted = sum(1 for t in cloud_topos if t != "hybrid" or topo_req == "hybrid")  # rejections per offer
    wanted, min_mem = ctx.wanted, req.gpu_mem_floor_gib
    n_total, per_node, nodes = ctx.n_total, req.gpus_per_node, req.nodes
    budget, fixed_hours, disk = ctx.budget, ctx.hours, req.disk_gib
    cost, billed_s, max_billed = pricing.cost_usd, pricing.billed_seconds, pricing.max_billed_seconds
    billed_cache: dict[tuple[str, float], int] = {}
    zoned, caps_ix, quota_ix = facts.zones, facts.caps, facts.quotas
    hpm = pricing.HOURS_PER_MONTH
    for oi, o in enumerate(offers):
        prov = o.provider
        if providers and prov not in providers:
            continue
        if prov in THIS_MACHINE:  # rare: the general path
            if allowed.local:
                _screen_local(o, oi, ctx, found)
            continue
        if not cloud_topos:
            continue
        price = o.usd_per_hour
        cpu_offer = (cpu_only(req) or _cpu_here(o, req)) and o.gpu_count == 0
        if not cpu_offer and wanted and not any(gpu_name_matches(w, o.gpu_name) for w in wanted):
            counts["gpu-model"] += n_counted
            rej["gpu-model"].append((price, price, oi, o.region, o.zone, cloud_topos[0]))
            continue
        if not cpu_offer and o.gpu_mem_gib < min_mem:
            counts["gpu-memory"] += n_counted
            rej["gpu-memory"].append((price, price, oi, o.region, o.zone, cloud_topos[0]))
            continue
        tkey = (prov, o.instance_type)
        places = facts.placements(o) if (o.zone is None and tkey in zoned) else ((o.region, o.zone),)
        caps_l, quotas_l = caps_ix.get(tkey), quota_ix.get(tkey)
        rate = price + o.storage_usd_per_gib_month * disk / hpm  # == pricing.unit_rate_usd_per_hour, inlined
        gc = o.gpu_count
        for topo in cloud_topos:
            if topo == "simulated":
                units, ok = 1, gc >= n_total
            elif topo == "hybrid":
                units, ok = nodes - 1, gc >= per_node and prov in TUN_PROVIDERS and node0_ok
                if topo_req != "hybrid" and not ok:
                    continue  # under "any" hybrid is only a note: its rejections would crowd the table
            else:
                units, ok = nodes, o.private_network and (gc >= per_node or cpu_offer)
            for region, zone in places:
                if not ok:
                    kind = "topology"
                elif caps_l and _capacity_blocked(facts, tkey, region, zone, units):
                    kind = "capacity"
                elif (quotas_l and _quota_blocked(quotas_l, o, region, zone, units)) or (
                        FREE_TIER_ATTR in o.attrs and _free_tier_reasons(o, units, ctx)):
                    kind = "quota"
                else:
                    kind = None
                if kind is not None:
                    if topo == "hybrid" and topo_req != "hybrid":
                        continue
                    counts[kind] += 1
                    rej[kind].append((units * price, units * price, oi, region, zone, topo))
                    continue
                if rate <= 0:  # free
                    valid.append((0.0 if hours_given else -math.inf, 0.0, oi, region, zone, topo))
                    continue
                allow = pricing.setup_allowance_seconds(prov)
                if fixed_hours is not None:
                    b = billed_cache.get((prov, o.min_billed_seconds))
                    if b is None:
                        b = billed_cache[(prov, o.min_billed_seconds)] = billed_s(
                            pricing.deadline_seconds(fixed_hours, allow), o.min_billed_seconds)
                    wc = cost(units, rate, b)
                    if budget is not None and wc > budget:
                        counts["budget"] += 1
                        rej["budget"].append((wc, wc, oi, region, zone, topo))
                    else:
                        valid.append((wc, wc, oi, region, zone, topo))
                    continue
                s_max = max_billed(budget, units, rate, o.min_billed_seconds)
                max_h = max(0.0, (s_max - allow) / 3600.0) if s_max >= 0 else 0.0
                if max_h * 3600.0 < MIN_RUN_SECONDS:
                    wc = cost(units, rate, billed_s(allow + MIN_RUN_SECONDS, o.min_billed_seconds))
                    counts["budget"] += 1
                    rej["budget"].append((wc, wc, oi, region, zone, topo))
                    continue
                wc = cost(units, rate, billed_s(pricing.deadline_seconds(max_h, allow), o.min_billed_seconds))
                valid.append((-max_h, wc, oi, region, zone, topo))
    return found


class _Ranking:
    """The best entries of a list, deterministic under input order, and the PlanOption of an entry (reasons and
    costs built by the text-building path)."""

    def __init__(self, offers: Sequence[Offer], ctx: _Ctx):
        self.offers, self.ctx = offers, ctx

    def key(self, e: tuple) -> tuple:
        value, wc, oi, region, zone, topo = e
        o = self.offers[oi]
        # at equal cost this machine comes first (nothing to rent, no account), then by name
        return (value, wc, o.provider not in THIS_MACHINE, o.provider, o.instance_type, region or "", zone or "", o.offer_id,
                topo)

    def best(self, entries: list[tuple], k: int) -> list[tuple]:
        """The k smallest entries by :meth:`key` (ties on value pooled, so input order never decides)."""
        if k <= 0 or not entries:
            return []
        firsts = heapq.nsmallest(k, entries)  # (value, wc, unique offer index, ...): never compares further
        threshold = firsts[-1][0]
        pool = [e for e in entries if e[0] <= threshold] if len(firsts) == k else list(entries)
        pool.sort(key=self.key)
        return pool[:k]

    def build(self, entry: tuple) -> PlanOption:
        _, _, oi, region, zone, topo = entry
        o = self.offers[oi]
        reasons, step, costs = _evaluate(o, region, zone, topo, self.ctx, True, _offer_reasons(o, self.ctx, True))
        return _option(o, region, zone, topo, self.ctx, reasons, step, costs)


def _rejected_options(found: _Found, rank: _Ranking, unavailable: Mapping[str, str] | None, ctx: _Ctx,
                      per_reason: int) -> tuple[list[PlanOption], dict[str, int]]:
    """The rejected options a Plan shows (each provider that offers nothing, then the ``per_reason`` cheapest of
    each reason kind, in order of the worst case the table prints) and the counts of every rejection by kind."""
    req = ctx.req
    counts = {k: v for k, v in found.counts.items() if v}
    rejected: list[PlanOption] = []
    for prov, why in sorted((unavailable or {}).items()):
        if req.providers and prov not in req.providers:
            continue
        topo = TopologyKind.local if prov in THIS_MACHINE else TopologyKind.simulated
        rejected.append(PlanOption(provider=prov, topology=topo, nodes=req.nodes, gpus_per_node=req.gpus_per_node,
                                   usd_per_hour=0.0, worst_case_usd=0.0, hours=ctx.hours or 0.0,
                                   rejected=[why if isinstance(why, Rejection) else Rejection("provider", why)],
                                   reason_kind="provider"))
        counts["provider"] = counts.get("provider", 0) + 1
    counts = {k: counts[k] for k in REASON_KINDS if counts.get(k)}
    for kind in REASON_KINDS:
        rejected += sorted((replace(rank.build(e), reason_kind=kind) for e in rank.best(found.rej[kind], per_reason)),
                           key=lambda o: o.worst_case_usd)
    return rejected, counts


def _topology_notes(req: Requirements, allowed: _Allowed, rank: _Ranking, hybrid_seen: list[tuple]) -> list[str]:
    """What the topology asked for means for the plan: hybrid's layout, the hybrid option under ``any`` (named,
    never chosen), and the topologies not considered."""
    out: list[str] = []
    topo_req = req.topology
    if topo_req == "hybrid":
        vms = "node 1 is a VM" if req.nodes == 2 else f"nodes 1-{req.nodes - 1} are VMs"
        out.append(f"topology hybrid: node 0 is this machine (free: its GPU, or gloo on CPU with cpu_ok), "
                   f"{vms} with /dev/net/tun ({', '.join(TUN_PROVIDERS)}) over a "
                   "per-run WireGuard tunnel; priced as the VMs only")
    if hybrid_seen:
        h = rank.build(rank.best(hybrid_seen, 1)[0])
        o = h.offers[0]
        out.append(f"also possible: hybrid = this machine as node 0 + {len(h.offers)} x {o.instance_type} on "
                   f"{h.provider} over a WireGuard tunnel, {usd(h.usd_per_hour)}/h, worst case "
                   f"{usd(h.worst_case_usd)}: opt in with --topology hybrid (docs/hybrid.md)")
    if not allowed.simulated and topo_req != "local":
        out.append(f"topology {topo_req} requested: simulated options not considered")
    if not allowed.multi and req.nodes > 1 and topo_req != "multi-node":
        out.append(f"topology {topo_req} requested: multi-node options not considered")
    return out
