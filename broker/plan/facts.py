"""Gathering planning facts from the adapters: offers, quotas, capacity and price notes.

Used by ``broker plan`` and ``broker run``.  A provider whose adapter is missing or raises is reported in the
notes and never stops the plan; a cloud's offers then come from the shipped (or refreshed) price snapshot
(:mod:`broker.plan.catalog`).  No SDK client is created for an unconfigured provider, so a machine without credentials
plans offline (no network call at all).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from broker import providers as _registry

if TYPE_CHECKING:
    from broker.core.model import Capacity, Offer, Quota, Requirements

_log = logging.getLogger(__name__)

#: Providers planned over by default (``--provider`` narrows): capability ``planned_by_default``.
DEFAULT_PROVIDERS = _registry.DEFAULT
#: Providers that rent machines (capability ``rents``, not ``pretend``): planned from their price snapshot when
#: not configured or offline.
CLOUD = _registry.CLOUD

#: What each cloud needs for live prices, quotas and capacity (shown when it falls back to the snapshot):
#: capability ``credentials_hint``.
CREDENTIALS_HINT = {n: h for n in _registry.REGISTRY if (h := _registry.capability(n, "credentials_hint"))}


class Facts:
    """What the providers said: offers, quotas, capacity, notes, and providers that offer nothing (with why)."""

    def __init__(self) -> None:
        self.offers: list[Offer] = []
        self.quotas: list[Quota] = []
        self.capacities: list[Capacity] = []
        self.notes: list[str] = []
        self.unavailable: dict[str, str] = {}
        #: this machine's (GPU count, smallest GPU memory GiB; 0 = unknown), node 0 of a hybrid option; None when
        #: the plan has no hybrid candidate
        self.here: tuple[int, float] | None = None


def check_names(names: list[str]) -> list[str]:
    """``names`` when every one is a known provider; else BadInput listing the known ones."""
    from broker.core.provider import BadInput
    from broker.providers import REGISTRY

    bad = [n for n in names if n not in REGISTRY]
    if bad:
        raise BadInput(f"unknown provider {bad[0]!r}", hint=f"choose from: {', '.join(REGISTRY)}")
    return list(names)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]


def _snapshot_fallback(name: str, req: "Requirements | None", facts: Facts, why: str) -> list["Offer"]:
    from broker.plan import catalog
    try:
        offers = catalog.snapshot_offers(name, req)
        date, _ = catalog.snapshot_info(name)
    except FileNotFoundError:
        _log.info("%s: not planned: %s, and no price snapshot", name, why)
        facts.notes.append(f"{name}: {why}; no price snapshot either: not planned")
        return []
    _log.info("%s: %d offer(s) from the price snapshot of %s (%s)", name, len(offers), date, why)
    label = catalog.snapshot_meta(name).get("label", "")
    facts.notes.append(f"{name}: prices: snapshot {date} ({label}); live quote needs "
                       f"{CREDENTIALS_HINT.get(name, 'credentials')} ({why})")
    return offers


def gather(req: "Requirements", names: list[str], *, facts_too: bool = True, vast_query: str | None = None,
           offline: bool = False) -> Facts:
    """Ask each provider in ``names`` for offers (and, with ``facts_too``, quotas and capacity).

    ``vast_query``: Vast's native query string (``'reliability>0.98 inet_up>=200'``), passed to the Vast adapter.
    ``offline``: no provider is asked; clouds are planned from their price snapshots (no network call).
    A provider that is not configured (or whose adapter cannot load) is planned from its snapshot, with a note.
    A *configured* cloud whose live answer fails (rate limit, 5xx, credentials rejected, an unreadable answer)
    is left out of the plan with the reason (``unavailable``), never replaced by its snapshot, whose offer ids
    cannot be rented; when it is the only provider asked, that ProviderError is raised (exit 4) and says to retry
    or to pass ``--offline``.  A malformed ``vast_query`` raises BadInput."""
    facts = Facts()
    local_seen: object = None
    _log.info("asking providers %s for %d node(s) x %d GPU(s)%s", ", ".join(names), req.nodes, req.gpus_per_node,
              " (offline: snapshots only)" if offline else "")
    for name in names:
        if offline and name in CLOUD:
            facts.offers += _offline_offers(name, req, facts, vast_query)
            continue
        p = _start_adapter(name, req, facts)
        if p is None:
            continue
        if name in _registry.THIS_MACHINE:
            local_seen = p
        if _not_a_candidate(p, name, req, facts):
            continue
        offers = _ask_offers(p, name, req, facts, vast_query, alone=len(names) == 1)
        if offers is None:  # left out of this plan (facts.unavailable says why)
            continue
        facts.offers += offers
        if facts_too and offers:
            _ask_limits(p, name, req, offers, facts)
    if req.nodes > 1 and req.topology in ("hybrid", "any"):
        facts.here = _here(local_seen)
    if req.gpu_names and not [o for o in facts.offers if o.provider not in _registry.THIS_MACHINE]:
        facts.notes.append(_no_offer_for_model_note(req, names))
    return facts


def _offline_offers(name: str, req: "Requirements", facts: Facts, vast_query: str | None) -> list["Offer"]:
    """A cloud's offers from its price snapshot (``--offline``), its native query honoured there or refused."""
    offers = _snapshot_fallback(name, req, facts, "--offline")
    if vast_query and _registry.capability(name, "native_query"):
        # honoured against the snapshot, or refused: never ignored
        offers = _registry.provider_class(name).query_snapshot(offers, vast_query)
    return offers


def _start_adapter(name: str, req: "Requirements", facts: Facts) -> object | None:
    """The adapter of ``name``; None when it cannot load or start (a cloud then planned from its snapshot, another
    provider named in a note)."""
    from broker.providers import get_provider

    try:
        return get_provider(name)
    except ImportError as e:
        why = f"adapter broker.providers.{name} not available: {_short(e)}"
    except Exception as e:  # unknown name (BadInput) or a broken constructor
        why = f"adapter failed to start: {_short(e)}" if name in CLOUD else _short(e)
    if name in CLOUD:
        facts.offers += _snapshot_fallback(name, req, facts, why)
    else:
        facts.notes.append(f"{name}: {why}")
    return None


def _not_a_candidate(p: object, name: str, req: "Requirements", facts: Facts) -> bool:
    """Whether the provider's own limits rule it out (this machine without the GPUs asked for): then it is
    unavailable, with why."""
    try:
        why_not = p.why_not(req)  # type: ignore[attr-defined]  # this machine's own limits; None for the rest
    except Exception as e:
        why_not = f"{name} check failed: {_short(e)}"
    if why_not:
        _log.info("%s: not a candidate: %s", name, why_not)
        facts.unavailable[name] = why_not
    return bool(why_not)


def _ask_offers(p: object, name: str, req: "Requirements", facts: Facts, vast_query: str | None, *,
                alone: bool) -> list["Offer"] | None:
    """The provider's offers (with its price note), its snapshot's when a cloud that is not configured fails, or
    None when a configured cloud's live answer fails (left out of this plan, in ``facts.unavailable``); that
    failure is raised when the provider was asked ``alone``.  A malformed ``vast_query`` raises BadInput."""
    from broker.core.provider import BadInput, ProviderError

    configured = _configured(p) if name in CLOUD else True
    _log.info("%s: asking for offers (%s)", name, "live API" if name in CLOUD and configured else
              "price snapshot: not configured" if name in CLOUD else "this machine" if name in _registry.THIS_MACHINE else
              "adapter")
    try:
        if vast_query and _registry.capability(name, "native_query"):
            offers = list(p.offers(req, vast_query=vast_query))  # type: ignore[attr-defined]
        else:
            offers = list(p.offers(req))  # type: ignore[attr-defined]
    except BadInput:
        raise
    except ProviderError as e:
        if name in CLOUD and configured:
            if alone:  # the user asked for this provider alone: its failure is the answer
                if "--offline" not in (e.hint or ""):
                    e.hint = ((e.hint + "; ") if e.hint else "") + (
                        "`broker plan --offline` plans from the price snapshot meanwhile (nothing can be "
                        "rented from it)")
                raise
            # one unreachable cloud must not block the others (nor a free run here): left out of this plan,
            # never replaced by its snapshot, whose offer ids cannot be rented
            why = f"live offers failed, left out of this plan: {_short(e)}"
            _log.info("%s: %s", name, why)
            facts.unavailable[name] = why + (f" ({e.hint})" if e.hint else "")
            return None
        return _failed_offers(name, req, facts, e)
    except Exception as e:
        return _failed_offers(name, req, facts, e)
    _log.info("%s: %d offer(s)%s", name, len(offers), _source(offers))
    try:
        note = p.price_note()  # type: ignore[attr-defined]
    except Exception:
        note = None
    if note:
        _log.debug("%s", note if note.startswith(name) else f"{name}: {note}")
        facts.notes.append(note if note.startswith(name) else f"{name}: {note}")
    return offers


def _failed_offers(name: str, req: "Requirements", facts: Facts, e: BaseException) -> list["Offer"]:
    """What stands in for offers that failed: a cloud's snapshot (with a note), nothing (and a note) for others."""
    why = f"offers failed: {_short(e)}"
    if name in CLOUD:
        return _snapshot_fallback(name, req, facts, why)
    facts.notes.append(f"{name}: {why}")
    return []


def _ask_limits(p: object, name: str, req: "Requirements", offers: list["Offer"], facts: Facts) -> None:
    """The provider's quotas and capacity for ``offers``; one it cannot tell is noted and planned as not
    limiting."""
    try:
        quotas = list(p.quotas(req, offers))  # type: ignore[attr-defined]
        facts.quotas += quotas
        _log.info("%s: %d quota(s)", name, len(quotas))
    except Exception as e:
        _log.info("%s: quotas unknown: %s", name, _short(e))
        facts.notes.append(f"{name}: quotas unknown ({_short(e)}); planned as if not limiting")
    try:
        caps = list(p.capacity(offers))  # type: ignore[attr-defined]
        facts.capacities += caps
        _log.info("%s: %d capacity answer(s)", name, len(caps))
    except Exception as e:
        _log.info("%s: capacity unknown: %s", name, _short(e))
        facts.notes.append(f"{name}: capacity unknown ({_short(e)})")


def _no_offer_for_model_note(req: "Requirements", names: list[str]) -> str:
    """The note when no provider offers the GPU models asked for: the closest names and the models known."""
    import difflib

    from broker.plan.explain import NO_OFFER_FOR_MODEL

    known = sorted({o.gpu_name for name in names if name in CLOUD for o in _snapshot_quiet(name)})
    by_lower = {k.lower(): k for k in known}
    close = [by_lower[m] for g in req.gpu_names
             for m in difflib.get_close_matches(g.lower(), list(by_lower), n=2, cutoff=0.75)]
    return (f"{NO_OFFER_FOR_MODEL} {', '.join(req.gpu_names)}"
            + (f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else "")
            + (f"; models in the price snapshots: {', '.join(known)}" if known else ""))


def _source(offers: list["Offer"]) -> str:
    """`` from the live API`` / `` from the price snapshot`` / both, by the offers' price sources ('' if none)."""
    live = sum(1 for o in offers if str(o.price_source).startswith("live"))
    snap = sum(1 for o in offers if "snapshot" in str(o.price_source) and not str(o.price_source).startswith("live"))
    if live and snap:
        return f" ({live} from the live API, {snap} from the price snapshot)"
    return " from the live API" if live else " from the price snapshot" if snap else ""


def log_plan(plan: object) -> None:
    """Log what the planner chose and why (``-vv``): the chosen option against the next valid ones, and why the
    cheapest rejected ones were rejected.  Never raises (a log line must not stop a plan)."""
    if not _log.isEnabledFor(logging.DEBUG):
        return
    try:
        options = list(getattr(plan, "options", []) or [])
        rejected = list(getattr(plan, "rejected", []) or [])
        c = getattr(plan, "chosen", None)
        _log.debug("plan: %d valid option(s), %d rejected", len(options), len(rejected))
        if c is not None:
            _log.debug("chosen: %s on %s (%s): the cheapest valid worst case, $%.4f ($%.4f/h for %.2f h; %s)",
                       c.topology.value, c.provider, c.summary, c.worst_case_usd, c.usd_per_hour, c.hours,
                       c.price_source)
        for o in options[1:4]:
            _log.debug("next valid: %s on %s (%s), worst case $%.4f", o.topology.value, o.provider, o.summary,
                       o.worst_case_usd)
        for o in rejected[:8]:
            _log.debug("rejected: %s on %s (%s): %s", o.topology.value, o.provider, o.summary, "; ".join(o.rejected))
    except Exception as e:  # noqa: BLE001
        _log.debug("plan: cannot describe it (%s)", e)


def _here(local: object = None) -> tuple[int, float] | None:
    """(GPU count, smallest GPU memory GiB) of this machine, from the local adapter's detection (nvidia-smi, else
    the driver's /proc listing, whose memory is unknown: 0); None when detection fails."""
    try:
        gpus = getattr(local, "gpus", None)
        if gpus is None:  # the adapter through the registry (imported now): the plan layer imports no adapter
            gpus = _registry.get_provider("local").gpus
        return len(gpus), min((g.mem_gib for g in gpus), default=0.0)
    except Exception:  # noqa: BLE001 - unknown: the planner does not check node 0
        return None


def _configured(p: object) -> bool:
    try:
        return bool(p.check().configured)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an adapter whose check fails is not usable for live offers
        return False


def _snapshot_quiet(name: str) -> list["Offer"]:
    from broker.plan import catalog
    try:
        return catalog.snapshot_offers(name)
    except (FileNotFoundError, ValueError):
        return []
