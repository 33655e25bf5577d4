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
    from broker.core.provider import BadInput, ProviderError

    from broker.providers import get_provider

    facts = Facts()
    local_seen: object = None
    _log.info("asking providers %s for %d node(s) x %d GPU(s)%s", ", ".join(names), req.nodes, req.gpus_per_node,
              " (offline: snapshots only)" if offline else "")
    for name in names:
        if offline and name in CLOUD:
            offers = _snapshot_fallback(name, req, facts, "--offline")
            if vast_query and _registry.capability(name, "native_query"):
                # honoured against the snapshot, or refused: never ignored
                offers = _registry.provider_class(name).query_snapshot(offers, vast_query)
            facts.offers += offers
            continue
        try:
            p = get_provider(name)
        except ImportError as e:
            why = f"adapter broker.providers.{name} not available: {_short(e)}"
            if name in CLOUD:
                facts.offers += _snapshot_fallback(name, req, facts, why)
            else:
                facts.notes.append(f"{name}: {why}")
            continue
        except Exception as e:  # unknown name (BadInput) or a broken constructor
            if name in CLOUD:
                facts.offers += _snapshot_fallback(name, req, facts, f"adapter failed to start: {_short(e)}")
            else:
                facts.notes.append(f"{name}: {_short(e)}")
            continue
        if name == "local":
            local_seen = p
        try:
            why_not = p.why_not(req)  # this machine's own limits (the local adapter); None for the rest
        except Exception as e:
            why_not = f"{name} check failed: {_short(e)}"
        if why_not:
            _log.info("%s: not a candidate: %s", name, why_not)
            facts.unavailable[name] = why_not
            continue
        configured = _configured(p) if name in CLOUD else True
        _log.info("%s: asking for offers (%s)", name, "live API" if name in CLOUD and configured else
                  "price snapshot: not configured" if name in CLOUD else "this machine" if name == "local" else
                  "adapter")
        try:
            if vast_query and _registry.capability(name, "native_query"):
                offers = list(p.offers(req, vast_query=vast_query))  # type: ignore[call-arg]
            else:
                offers = list(p.offers(req))
        except BadInput:
            raise
        except ProviderError as e:
            if name in CLOUD and configured:
                if len(names) == 1:  # the user asked for this provider alone: its failure is the answer
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
                continue
            why = f"offers failed: {_short(e)}"
            offers = _snapshot_fallback(name, req, facts, why) if name in CLOUD else []
            if name not in CLOUD:
                facts.notes.append(f"{name}: {why}")
        except Exception as e:
            why = f"offers failed: {_short(e)}"
            offers = _snapshot_fallback(name, req, facts, why) if name in CLOUD else []
            if name not in CLOUD:
                facts.notes.append(f"{name}: {why}")
        else:
            _log.info("%s: %d offer(s)%s", name, len(offers), _source(offers))
            try:
                note = p.price_note()
            except Exception:
                note = None
            if note:
                _log.debug("%s", note if note.startswith(name) else f"{name}: {note}")
            if note:
                facts.notes.append(note if note.startswith(name) else f"{name}: {note}")
        facts.offers += offers
        if not facts_too or not offers:
            continue
        try:
            quotas = list(p.quotas(req, offers))
            facts.quotas += quotas
            _log.info("%s: %d quota(s)", name, len(quotas))
        except Exception as e:
            _log.info("%s: quotas unknown: %s", name, _short(e))
            facts.notes.append(f"{name}: quotas unknown ({_short(e)}); planned as if not limiting")
        try:
            caps = list(p.capacity(offers))
            facts.capacities += caps
            _log.info("%s: %d capacity answer(s)", name, len(caps))
        except Exception as e:
            _log.info("%s: capacity unknown: %s", name, _short(e))
            facts.notes.append(f"{name}: capacity unknown ({_short(e)})")
    if req.nodes > 1 and req.topology in ("hybrid", "any"):
        facts.here = _here(local_seen)
    if req.gpu_names and not [o for o in facts.offers if o.provider != "local"]:
        import difflib

        from broker.plan.explain import NO_OFFER_FOR_MODEL

        known = sorted({o.gpu_name for name in names if name in CLOUD for o in _snapshot_quiet(name)})
        by_lower = {k.lower(): k for k in known}
        close = [by_lower[m] for g in req.gpu_names
                 for m in difflib.get_close_matches(g.lower(), list(by_lower), n=2, cutoff=0.75)]
        facts.notes.append(f"{NO_OFFER_FOR_MODEL} {', '.join(req.gpu_names)}"
                           + (f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else "")
                           + (f"; models in the price snapshots: {', '.join(known)}" if known else ""))
    return facts


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
