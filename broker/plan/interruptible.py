"""Interruptible capacity in the plan: Vast.ai bid instances, EC2 spot, OCI preemptible VMs, GCP Spot VMs.

Pure, like the planner: no clock, no files, no network.

**Prices.**  An adapter puts the provider's interruptible price of an on-demand offer into its attrs
(:data:`PRICE_ATTR`, USD per hour for the whole unit, and :data:`SOURCE_ATTR`, where it came from):

* Vast.ai: the offer's ``min_bid`` ("current minimum bid price in $/hr for interruptible", reference
  interruptible.md 1.1) plus the offer's other charges (``dph_total - dph_base``: storage, which a bid does not
  change).  broker bids :data:`BID_MARGIN` over ``min_bid`` (a bid at exactly ``min_bid`` is outbid by the next
  renter), and the plan prices that bid.
* AWS: the current spot price (``DescribeSpotPriceHistory``, or the dated snapshot).  broker launches with
  ``MaxPrice`` = :data:`BID_MARGIN` over it, so the spot price can never bill more than the plan's worst case
  (AWS interrupts the instance instead, ``instance-terminated-by-price``).
* OCI: a fixed 50 % of the on-demand price in every region (OCI preemptible documentation, updated
  2025-02-11, interruptible.md section 5), on the shapes that have preemptible capacity.  No bid, no margin.
* GCP: the Spot VM price of the type (the dated snapshot; Google changes it up to once a day, gcp.md section 7).
  No bid, no margin.

:func:`variants` turns every offer carrying :data:`PRICE_ATTR` into its interruptible twin (same offer id,
``usd_per_hour`` = what broker pays at most, attrs :data:`FLAG_ATTR` True, :data:`BID_ATTR` and
:data:`ON_DEMAND_ATTR`).

**Worst case.**  Every attempt bills its own setup allowance (the provider's ``setup_allowance_s``), so with
``max_restarts`` R the worst case of an interruptible option is every unit billed for the job hours plus R + 1
allowances: ``units x rate x (hours x 3600 + (R + 1) x allowance) / 3600``.  The budget must cover it; the job
time a budget affords shrinks by R allowances.  The hard deadline is the same clock as on-demand: restarts do
not extend it, so a run preempted often may reach its deadline unfinished, but never costs more.

**Expected cost** (the model, :func:`expected`): the run is preempted when any of its ``units`` is, at
``units x p`` per hour, where ``p`` is the provider's preemption rate per unit-hour (:data:`PREEMPTIONS_PER_HOUR`,
or an offer's own :data:`RATE_ATTR`).  Each preemption costs a new setup allowance plus the work since the last
checkpoint copy, half of ``checkpoint_every_s`` on average.  Over ``hours`` of work a renewal argument gives
``k = units x p x hours / (1 - units x p x lost_h)`` preemptions (``lost_h`` the hours one preemption costs), at
most R (a run preempted more often stops at R restarts; at a rate where every restart loses more than it gains,
k = R).  Expected billed hours = ``hours + allowance + k x lost_h``; expected USD = ``units x rate x`` that.  The
on-demand option's expected cost is its worst case (the job may need every hour of the deadline).

**Preemption rates** are broker's assumptions, stated as such (each adapter's ``preemptions_per_hour``
capability; ``interruptible_bid`` says whether its price is a market price): no provider publishes a per-hour
rate for GPUs.  AWS's Spot Instance Advisor buckets monthly interruption frequency (``<5 %`` ... ``>20 %`` of instances a month,
interruptible.md section 5); the worst bucket is about 0.0003 per hour, broker assumes 0.02 (GPU spot capacity
is scarcer than the advisor's average and a training run is the instance's whole life).  Vast.ai publishes no
statistic; a bid loses to any higher bid or on-demand renter on the same host: broker assumes 0.1 per hour.
OCI publishes none either; reclaimed when capacity is needed: 0.05 per hour.  Google publishes none for Spot VMs
(reclaimed when Compute Engine needs the capacity): 0.05 per hour, as OCI.

An offer's interruptible capacity is planned only when its provider declares the ``interruptible`` capability
(it can rent it and tell a preemption from a crash).

``interruptible: auto`` picks an interruptible option only when its expected cost is lower than the best
on-demand option's (per hour of job time when the budget sets the deadline); ``true`` plans interruptible
options only; ``false`` plans on-demand only and names what the interruptible option would have saved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from broker.core.prose import usd
from broker.core.model import Offer, Plan, PlanOption, Rejection, Requirements, gc_paused
from broker.plan import pricing
from broker.plan.rejections import REASON_KINDS, merge_rejected as _merge_rejected, with_counts as _with_counts

#: Offer.attrs key: the provider's interruptible price of the offer, USD per hour for the whole unit
PRICE_ATTR = "interruptible_usd_per_hour"
#: Offer.attrs key: where that price came from (``"live Vast.ai min_bid ..."``, ``"snapshot 2026-11-29 ..."``)
SOURCE_ATTR = "interruptible_price_source"
#: Offer.attrs key of an interruptible variant: True
FLAG_ATTR = "interruptible"
#: Offer.attrs key of a variant: the bid (Vast ``price``) or cap (AWS ``MaxPrice``), USD per hour; None for OCI
BID_ATTR = "bid_usd_per_hour"
#: Offer.attrs key of a variant: the on-demand price of the same offer, USD per hour
ON_DEMAND_ATTR = "on_demand_usd_per_hour"
#: Offer.attrs key: the preemption rate per unit-hour to assume for this offer (overrides the provider's)
RATE_ATTR = "preemptions_per_hour"
#: Offer.attrs key (Vast): the offer's ``min_bid``, USD per hour
MIN_BID_ATTR = "min_bid"

#: Fraction over the market price broker bids (Vast ``price``) or caps (AWS ``MaxPrice``): 10 %
BID_MARGIN = 0.10
#: Preemptions per unit-hour assumed for a provider that declares none (``preemptions_per_hour`` 0.0)
DEFAULT_PREEMPTIONS_PER_HOUR = 0.10


def attempts_words(n: int) -> str:
    """``1 attempt`` / ``4 attempts``: what the worst case of an interruptible option covers."""
    return f"{n} attempt" + ("" if n == 1 else "s")


def _capability(provider: str, attr: str) -> Any:
    from broker.providers import capability

    return capability(provider, attr)


def bid(market_price_usd_per_hour: float) -> float:
    """What broker bids (Vast) or caps (AWS ``MaxPrice``) for a market price: :data:`BID_MARGIN` over it, rounded
    up to 1/10000 $ (never below the price)."""
    import math

    return math.ceil(market_price_usd_per_hour * (1 + BID_MARGIN) * 10000 - 1e-6) / 10000


def preemptions_per_hour(o: Offer) -> float:
    """Assumed preemptions per hour of one unit of ``o``: its :data:`RATE_ATTR`, else its provider's
    ``preemptions_per_hour`` capability, else :data:`DEFAULT_PREEMPTIONS_PER_HOUR`."""
    r = o.attrs.get(RATE_ATTR)
    if isinstance(r, (int, float)) and not isinstance(r, bool) and r >= 0:
        return float(r)
    return float(_capability(o.provider, "preemptions_per_hour") or DEFAULT_PREEMPTIONS_PER_HOUR)


def is_variant(o: Offer) -> bool:
    """``o`` is an interruptible offer (made by :func:`variants`)."""
    return o.attrs.get(FLAG_ATTR) is True


def variant(o: Offer, _caps: dict[str, tuple[bool, bool]] | None = None) -> Offer | None:
    """The interruptible twin of on-demand offer ``o`` (None when ``o`` carries no :data:`PRICE_ATTR`, its provider
    lacks the ``interruptible`` capability, or the price is not below its on-demand price: then interruptible
    capacity saves nothing and is not offered).  ``_caps``: a per-call cache of (interruptible, interruptible_bid)
    by provider."""
    price = o.attrs.get(PRICE_ATTR)
    if not isinstance(price, (int, float)) or isinstance(price, bool) or not 0 < price:
        return None
    caps = None if _caps is None else _caps.get(o.provider)
    if caps is None:
        caps = (bool(_capability(o.provider, "interruptible")), bool(_capability(o.provider, "interruptible_bid")))
        if _caps is not None:
            _caps[o.provider] = caps
    able, market = caps
    if not able:
        return None
    pay = bid(price) if market else float(price)
    if pay >= o.usd_per_hour:
        return None
    attrs: dict[str, Any] = {**o.attrs, FLAG_ATTR: True, ON_DEMAND_ATTR: o.usd_per_hour,
                             BID_ATTR: pay if market else None}
    mb = o.attrs.get(MIN_BID_ATTR)
    if market and isinstance(mb, (int, float)):
        attrs[BID_ATTR] = bid(float(mb))  # Vast's create body carries the bid alone (storage is billed apart)
    src = o.attrs.get(SOURCE_ATTR) or o.price_source
    how = f"bid {int(BID_MARGIN * 100)}% over " if market else ""
    # built directly (not dataclasses.replace): a live market has ~100k offers (bench/plan_scale.py)
    return Offer(provider=o.provider, offer_id=o.offer_id, instance_type=o.instance_type, region=o.region,
                 zone=o.zone, gpu_name=o.gpu_name, gpu_count=o.gpu_count, gpu_mem_gib=o.gpu_mem_gib, vcpus=o.vcpus,
                 ram_gib=o.ram_gib, usd_per_hour=pay, storage_usd_per_gib_month=o.storage_usd_per_gib_month,
                 min_billed_seconds=o.min_billed_seconds, private_network=o.private_network,
                 price_source=f"interruptible: {how}{src}", price_time=o.price_time, attrs=attrs)


def variants(offers: Iterable[Offer]) -> list[Offer]:
    """The interruptible twins of every on-demand offer in ``offers`` that has an interruptible price."""
    out = []
    caps: dict[str, tuple[bool, bool]] = {}
    with gc_paused():  # a twin per offer of a live market (they form no reference cycles)
        for o in offers:
            a = o.attrs
            if PRICE_ATTR in a and a.get(FLAG_ATTR) is not True:
                v = variant(o, caps)
                if v is not None:
                    out.append(v)
    return out


def lost_hours_per_preemption(allowance_s: float, checkpoint_every_s: float) -> float:
    """Hours one preemption costs: a new setup allowance plus half a checkpoint interval of lost work."""
    return (allowance_s + checkpoint_every_s / 2.0) / 3600.0


def expected(units: int, rate_usd_per_hour: float, hours: float, allowance_s: float, per_unit_hour: float,
             max_restarts: int, checkpoint_every_s: float) -> tuple[float, float]:
    """(expected USD, expected preemptions) of an interruptible option under the module's restart model.

    ``units`` rented units at ``rate_usd_per_hour`` each (storage included), ``hours`` of job work,
    ``allowance_s`` setup seconds per attempt, ``per_unit_hour`` preemptions per unit-hour, at most
    ``max_restarts`` restarts, a checkpoint copy every ``checkpoint_every_s`` seconds."""
    lam = units * per_unit_hour
    lost = lost_hours_per_preemption(allowance_s, checkpoint_every_s)
    if lam <= 0:
        k = 0.0
    elif lam * lost >= 1:
        k = float(max_restarts)
    else:
        k = min(float(max_restarts), lam * hours / (1 - lam * lost))
    billed_h = hours + allowance_s / 3600.0 + k * lost
    return units * rate_usd_per_hour * billed_h, k


def deadline_seconds(opt: PlanOption) -> float:
    """Seconds of billed time the option's worst case covers: job hours plus one setup allowance per attempt."""
    allow = pricing.setup_allowance_seconds(opt.provider)
    return opt.hours * 3600.0 + (opt.max_restarts + 1 if opt.interruptible else 1) * allow


# ------------------------------------------------------------------------------------------------ planning
PlanFn = Callable[..., Plan]


def _per_job_hour(o: PlanOption) -> float:
    cost = o.expected_usd if o.expected_usd is not None else o.worst_case_usd
    return cost / o.hours if o.hours > 0 else float("inf")


def _annotate(opt: PlanOption, req: Requirements, extra_h: float) -> PlanOption:
    """A spot planning pass's option with its job hours, restart count and expected cost."""
    job_h = max(0.0, opt.hours - extra_h)
    max_h = opt.max_hours_within_budget
    if max_h is not None:
        max_h = max(0.0, max_h - extra_h)
    units = len(opt.offers) or 1
    o = opt.offers[0] if opt.offers else None
    per = preemptions_per_hour(o) if o is not None else DEFAULT_PREEMPTIONS_PER_HOUR
    allow = pricing.setup_allowance_seconds(opt.provider)
    rate = opt.usd_per_hour / units if units else 0.0
    exp, _ = expected(units, rate, job_h, allow, per, req.max_restarts, req.checkpoint_every_s)
    rejected = list(opt.rejected)
    if not rejected and job_h * 3600.0 < 60:
        rejected.append(Rejection("budget", f"interruptible: the budget covers {req.max_restarts + 1} setups but "
                                            "leaves no job time"))
    rejected = [r if r.startswith("interruptible") else r.reworded(f"interruptible: {r}") for r in rejected]
    # the same offers on demand: each variant's own on-demand price in place of what broker pays (storage stays)
    od_rate = opt.usd_per_hour + sum(float(x.attrs.get(ON_DEMAND_ATTR) or x.usd_per_hour) - x.usd_per_hour
                                     for x in opt.offers)
    return replace(opt, hours=job_h, max_hours_within_budget=max_h, interruptible=True,
                   on_demand_usd_per_hour=od_rate if opt.offers else None,
                   max_restarts=req.max_restarts, expected_usd=exp, preemptions_per_hour=units * per,
                   rejected=rejected,
                   price_source=opt.offers[0].price_source if opt.offers else opt.price_source)


def _spot_pass(base: PlanFn, req: Requirements, spot: list[Offer], args: tuple, kw: dict[str, Any]) -> Plan:
    """Plan the interruptible variants, one pass per provider (each has its own setup allowance): the hours the
    planner prices are the job hours plus ``max_restarts`` extra allowances, so its worst case and budget check
    cover every attempt."""
    by_prov: dict[str, list[Offer]] = {}
    for o in spot:
        by_prov.setdefault(o.provider, []).append(o)
    options: list[PlanOption] = []
    rejected: list[PlanOption] = []
    counts: dict[str, int] = {}
    valid = 0
    quotas = list(kw.get("quotas") or ())
    for prov, offers in sorted(by_prov.items()):
        extra_h = req.max_restarts * pricing.setup_allowance_seconds(prov) / 3600.0
        r = replace(req, hours=req.hours + extra_h) if req.hours is not None else req
        # a provider with limits of its own for interruptible capacity (AWS spot vCPUs) is judged by those only
        own = [q for q in quotas if q.provider == prov and getattr(q, "interruptible", False)]
        qs = own + [q for q in quotas if q.provider != prov] if own else [
            q for q in quotas if not getattr(q, "interruptible", False)]
        p = base(r, offers, *args, **{**kw, "unavailable": None, "notes": (), "quotas": qs})
        options += [_annotate(o, req, extra_h) for o in p.options]
        rejected += [_annotate(o, req, extra_h) for o in p.rejected]
        for k, v in p.rejected_counts.items():
            counts[k] = counts.get(k, 0) + v
        valid += p.valid_count or 0
    still = [replace(o, reason_kind="budget") for o in options if o.rejected]  # no job time after the setups
    options = [o for o in options if not o.rejected]
    rejected = still + rejected
    if still:
        counts["budget"] = counts.get("budget", 0) + len(still)
    hours_given = req.hours is not None or req.budget_usd is None
    options.sort(key=lambda o: (o.expected_usd if hours_given else _per_job_hour(o), o.worst_case_usd,
                                o.provider, o.summary))
    return Plan(requirements=req, options=options, rejected=rejected, rejected_counts=counts,
                valid_count=valid - len(still))


def comparison(spot: PlanOption, od: PlanOption | None) -> str:
    """One line: the interruptible option's expected and worst case beside the on-demand one, and what it saves."""
    o = spot.offers[0]
    bid_s = f", bid {usd(o.attrs[BID_ATTR])}/h" if o.attrs.get(BID_ATTR) else ""
    head = (f"interruptible {spot.provider} {spot.summary}: {usd(spot.usd_per_hour)}/h{bid_s}, expected "
            f"{usd(spot.expected_usd or 0)} (~{spot.preemptions_per_hour or 0:.2g} preemptions/h), worst case "
            f"{usd(spot.worst_case_usd)} ({attempts_words(spot.max_restarts + 1)}) for {spot.hours:.2f} h of job")
    if od is None:
        return head + "; no valid on-demand option to compare"
    save = od.worst_case_usd - (spot.expected_usd or 0)
    pct = f" ({save / od.worst_case_usd:.0%})" if od.worst_case_usd > 0 else ""
    tail = (f" | on-demand {od.provider} {od.summary}: {usd(od.usd_per_hour)}/h, worst case "
            f"{usd(od.worst_case_usd)} for {od.hours:.2f} h")
    if save > 0:
        return head + tail + f": interruptible saves {usd(save)}{pct} expected"
    return head + tail + f": interruptible costs {usd(-save)} more expected"


#: why an on-demand machine is not an option when the recipe asks for interruptible capacity only
NO_PRICE = Rejection("provider", "interruptible: true, but no interruptible price is known for this offer")


def _key(o: Offer) -> tuple:
    """What an on-demand offer and its interruptible twin share (:func:`variant` keeps every one of these)."""
    return (o.provider, o.offer_id, o.instance_type, o.region, o.zone)


def plan(base: PlanFn, requirements: Requirements, offers: Sequence[Offer], *args: Any, **kw: Any) -> Plan:
    """:func:`broker.plan.planner.plan` (``base``) with interruptible options, per ``requirements.interruptible``.

    ``false``: the on-demand plan, plus a note with what the best interruptible option would save.  ``true``: the
    interruptible options only (on-demand named in a note for comparison).  ``auto``: both, ranked by expected
    cost (per hour of job time when the budget sets the deadline); on-demand first at equal cost.
    """
    req = requirements
    od_offers = [o for o in offers if not is_variant(o)]
    spot = variants(od_offers) + [o for o in offers if is_variant(o)]
    od_kw = {**kw, "quotas": [q for q in kw.get("quotas") or () if not getattr(q, "interruptible", False)]}
    od = base(req, od_offers, *args, **od_kw)
    if not spot:
        if req.interruptible == "true":
            provs = sorted({o.provider for o in od_offers if not req.providers or o.provider in req.providers})
            od.rejected = [replace(o, rejected=[*o.rejected, NO_PRICE]) for o in od.options] + od.rejected
            od.options = []
            od.notes.append("interruptible: true, but no offer has interruptible capacity with a known price "
                            f"(providers asked: {', '.join(provs) or 'none'}); set interruptible: auto or false")
        return od
    sp = _spot_pass(base, req, spot, args, kw)
    best_od, best_sp = od.chosen, sp.chosen
    od_opts = [replace(o, expected_usd=o.worst_case_usd) for o in od.options]
    notes = list(od.notes)
    if best_sp is not None:
        notes.append(comparison(best_sp, od_opts[0] if od_opts else None))
    if best_sp is not None or req.interruptible != "false":  # the model is named where its numbers are shown
        notes.append(f"interruptible model: {req.max_restarts} restarts at most, checkpoint every "
                     f"{req.checkpoint_every_s} s; each preemption costs a setup plus half a checkpoint interval; "
                     "preemption rates are broker's assumptions (broker.plan.interruptible)")
    counts = dict(od.rejected_counts)
    if req.interruptible == "false":
        if best_sp is not None and best_od is not None and (best_sp.expected_usd or 0) < best_od.worst_case_usd:
            notes.append("set interruptible: auto in the recipe (or --interruptible auto) to rent it when it is "
                         "cheaper; set checkpoint_dir: so a restart resumes")
        return replace(od, options=od_opts, notes=notes)
    for k, v in sp.rejected_counts.items():
        counts[k] = counts.get(k, 0) + v
    per_reason = int(kw.get("rejected_per_reason", 5))
    if req.interruptible == "true":
        # on demand is only the comparison here: a machine with an interruptible twin is judged as the twin (its
        # on-demand row would repeat it at another price); one without is shown with its own reason, or, when it
        # would have been valid, as having no interruptible price
        twins = {_key(o) for o in spot}
        alone = [o for o in od_offers if _key(o) not in twins]
        base_rows = base(req, alone, *args, **od_kw) if alone else None
        counts = dict(sp.rejected_counts)
        own: list[PlanOption] = []
        if base_rows is not None:
            for k, v in base_rows.rejected_counts.items():
                counts[k] = counts.get(k, 0) + v
            priceless = [replace(o, rejected=[*o.rejected, NO_PRICE], reason_kind="provider")
                         for o in base_rows.options]
            counts["provider"] = counts.get("provider", 0) + len(priceless)
            own = base_rows.rejected + priceless
        kinds = [*REASON_KINDS, *sorted(k for k in counts if k not in REASON_KINDS)]
        counts = {k: counts[k] for k in kinds if counts.get(k)}  # the note's order, in --json too
        rejected = _merge_rejected([sp.rejected, own], per_reason)
        notes = _with_counts(notes, od.rejected_counts, len(od.rejected), counts, len(rejected), per_reason)
        return replace(od, options=sp.options, rejected=rejected, notes=notes,
                       rejected_counts=counts, valid_count=sp.valid_count)
    hours_given = req.hours is not None or req.budget_usd is None
    key = (lambda o: ((o.expected_usd if hours_given else _per_job_hour(o)), o.interruptible))
    merged = sorted(od_opts + sp.options, key=key)  # stable: each side keeps the planner's order at equal cost
    if merged and best_od is not None and merged[0].interruptible:
        notes.append("interruptible: auto chose the interruptible option (lower expected cost)")
    elif best_sp is not None:
        notes.append("interruptible: auto kept on-demand (the interruptible option costs no less expected)")
    rejected = _merge_rejected([od.rejected, sp.rejected], per_reason)
    notes = _with_counts(notes, od.rejected_counts, len(od.rejected), counts, len(rejected), per_reason)
    return replace(od, options=merged, rejected=rejected, notes=notes, rejected_counts=counts,
                   valid_count=(od.valid_count or 0) + (sp.valid_count or 0))


def ledger_attrs(o: Offer) -> dict[str, Any]:
    """What the ledger row of a node rented from ``o`` records about interruptible capacity: ``interruptible``
    True, ``bid_usd_per_hour`` (the Vast bid / AWS ``MaxPrice``; None for a fixed price), ``on_demand_usd_per_hour``
    and ``interruptible_usd_per_hour`` (what the plan priced); {} for an on-demand offer."""
    if not is_variant(o):
        return {}
    return {"interruptible": True, BID_ATTR: o.attrs.get(BID_ATTR), ON_DEMAND_ATTR: o.attrs.get(ON_DEMAND_ATTR),
            PRICE_ATTR: o.usd_per_hour}
