"""Reconcile the ledger with what the providers really hold: resources broker tagged but the ledger lost, ledger
rows whose resource is gone, and (with ``terminate``) the teardown of what is left over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.core.records import Resource
from broker.core.provider import Provider
from broker.core.records import TaggedResource
from broker.money.cost import Progress


# --------------------------------------------------------------------------------------------------- reconcile
#: seconds a tagged resource of this installation must exist before reconcile treats it as an orphan: a create
#: of a live run whose ledger row is still in flight must never be killed
RECONCILE_MIN_AGE_S = 600.0
#: another installation's resources are touched (only with ``--include-foreign``) when older than the longest
#: deadline a recipe allows (``max_hours`` <= 168) plus one hour of grace: no live run of theirs can own them
FOREIGN_MIN_AGE_S = (168 + 1) * 3600.0


@dataclass
class ReconcileReport:
    """What :func:`reconcile` found.

    ``orphans``: tagged provider objects of *this* installation (INSTALL_TAG = the ledger's installation id, or a
    row of this ledger) that the ledger does not know, has as terminated or already holds as ``orphan``, older
    than the age grace (with ``include_foreign`` also other installations' objects past
    :data:`FOREIGN_MIN_AGE_S`).  ``foreign``: objects of another installation (another id, or none: an older
    broker) - listed, never touched unless ``include_foreign``.  ``young``: this installation's unknown objects
    younger than the age grace (a create in flight) - left alone.  ``adopted``: tagged objects matching a live
    ``intent`` row without provider id (a crash between create and mark_created): ``broker down`` resolves them
    by tag; with ``terminate`` the row is given the id.  ``unknown``: ledger rows left ``unknown`` by an ambiguous
    create (possibly billing); with ``terminate`` they are resolved when the list allows.  ``known``: count of
    tagged objects the ledger tracks as live.  ``errors``: provider -> why it could not be listed (never read as
    "nothing there").  ``terminated`` / ``failed``: ledger ids after ``terminate``.
    """

    orphans: list[Any] = field(default_factory=list)
    foreign: list[Any] = field(default_factory=list)
    young: list[Any] = field(default_factory=list)
    adopted: list[Any] = field(default_factory=list)
    unknown: list[Resource] = field(default_factory=list)
    known: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    terminated: list[str] = field(default_factory=list)
    failed: list[Resource] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)


def is_mine(t: TaggedResource, ledger: Ledger) -> bool:
    """Whether a tagged object belongs to this installation (its INSTALL_TAG is this ledger's id)."""
    return bool(t.installation_id) and t.installation_id == ledger.installation_id


def _age_s(t: TaggedResource, now: datetime) -> float | None:
    if t.created_at is None:
        return None
    c = t.created_at if t.created_at.tzinfo else t.created_at.replace(tzinfo=now.tzinfo)
    return (now - c).total_seconds()


def reconcile_providers(ledger: Ledger, only: str | None = None) -> tuple[dict[str, Provider], dict[str, str]]:
    """The providers to ask: ``only``, else every cloud adapter whose ``check()`` says configured plus any provider
    the ledger has rows for, plus every pretend provider whose emulation is in use here (``pretend_active``: the
    fake cloud's ``BROKER_FAKE_STATE``).  Returns (adapters, skipped: why)."""
    from broker.providers import CLOUD, PRETEND, THIS_MACHINE, capability, get_provider, provider_class

    active = [n for n in PRETEND if provider_class(n).pretend_active()]
    names = [only] if only else list(dict.fromkeys([*CLOUD, *sorted({r.provider for r in ledger.resources()}),
                                                    *active]))
    out: dict[str, Provider] = {}
    skipped: dict[str, str] = {}
    in_ledger = {r.provider for r in ledger.resources()}
    for n in names:
        if n in THIS_MACHINE:  # nothing rented, nothing tagged
            continue
        try:
            p = get_provider(n)
        except ImportError as e:
            skipped[n] = f"adapter not available ({e})"
            continue
        except Exception as e:  # noqa: BLE001 - BadInput for an unknown --provider propagates below
            if only:
                raise
            skipped[n] = str(e)
            continue
        if not only and n not in in_ledger and not capability(n, "pretend"):
            try:
                chk = p.check()
            except Exception as e:  # noqa: BLE001
                skipped[n] = f"check failed: {e}"
                continue
            if not chk.configured:
                skipped[n] = f"not configured{': ' + chk.hint if chk.hint else ''}"
                continue
        out[n] = p
    return out, skipped


def reconcile(ledger: Ledger, providers: dict[str, Provider], *, terminate: bool = False, actor: str = "reconcile",
              say: Progress | None = None, confirm_timeout_s: float = 900.0, poll_s: float = 2.0,
              include_foreign: bool = False, min_age_s: float = RECONCILE_MIN_AGE_S,
              foreign_min_age_s: float = FOREIGN_MIN_AGE_S, now: datetime | None = None,
              retry_s: float | None = None) -> ReconcileReport:
    """Compare what ``providers`` hold with broker's run tag (``list_tagged``) against the ledger.

    Only this installation's objects become orphans, and only past ``min_age_s``; another installation's only with
    ``include_foreign`` and past ``foreign_min_age_s`` (objects without a creation time never).  With
    ``terminate``, each orphan is first written to the ledger (a new ``orphan`` row, or its old row reopened as
    ``orphan``) and then terminated in dependency order (:func:`broker.money.teardown.teardown_order`: instances,
    subnets, security lists / gateways, VCN; nothing whose dependency is still live) through
    :func:`broker.money.teardown.terminate_resource` (TransientErrors retried), so the termination itself is
    ledger-visible and a failure stays live in ``broker status``.  Never raises for provider errors.
    """
    from broker.money.teardown import TERMINATE_RETRY_S

    now = now or utcnow()
    rep = ReconcileReport()
    for name, p in providers.items():
        try:
            tagged = p.list_tagged(None)
        except Exception as e:  # noqa: BLE001 - one provider's failure must not hide another's orphans
            rep.errors[name] = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            rep.unknown += [r for r in ledger.resources(live_only=True)
                            if r.provider == p.name and r.state == "unknown"]
            continue
        rep.checked.append(name)
        _sort_tagged(ledger, p, tagged, rep, terminate=terminate, actor=actor, include_foreign=include_foreign,
                     min_age_s=min_age_s, foreign_min_age_s=foreign_min_age_s, now=now)
    if not terminate:
        return rep
    by_name = {p.name: p for p in providers.values()}
    kw = dict(confirm_timeout_s=confirm_timeout_s, poll_s=poll_s, say=say,
              retry_s=TERMINATE_RETRY_S if retry_s is None else retry_s)
    _terminate_orphans(ledger, rep, by_name, actor=actor, include_foreign=include_foreign, **kw)
    rep.unknown = _terminate_unknown(ledger, rep, by_name, actor=actor, **kw)
    return rep


def _sort_tagged(ledger: Ledger, p: Provider, tagged: list[Any], rep: ReconcileReport, *, terminate: bool,
                 actor: str, include_foreign: bool, min_age_s: float, foreign_min_age_s: float,
                 now: datetime) -> None:
    """Sort what provider ``p`` holds with broker's tag (``tagged``) into ``rep``: known to the ledger, adopted (a
    create the ledger wrote without its id; with ``terminate`` the row learns it), an ambiguous create that did
    happen (unknown), another installation's (foreign, or an orphan with ``include_foreign`` past
    ``foreign_min_age_s``), too young to judge (``min_age_s``), or an orphan; then the ledger's ``unknown`` rows of
    ``p`` that the provider does not list."""
    for t in tagged:
        if t.state == "terminated":
            continue
        row = ledger.find_by_provider_id(p.name, t.provider_id)
        if row is not None and row.live and row.state != "orphan":
            rep.known += 1
            continue
        if row is None:
            pending = [r for r in ledger.resources(t.run_id, live_only=True) if t.run_id
                       and r.provider == p.name and r.kind == t.kind and not r.provider_id
                       and t.name in (r.name, None)]
            if pending:
                if terminate:  # listing never writes; with --terminate the intent row learns its id
                    ledger.update_resource(pending[0].id, provider_id=t.provider_id, actor=actor,
                                           message=f"found by run tag: {t.provider_id}")
                if pending[0].state == "unknown":  # an ambiguous create that did happen: never used, so it goes
                    rep.unknown.append(ledger.resource(pending[0].id) or pending[0])
                else:
                    rep.adopted.append(t)
                continue
        age = _age_s(t, now)
        # the provider's tag decides, not a ledger row: a (crafted or stale) terminated row naming another
        # installation's object does not make it ours; untagged (older broker) objects need a row of ours
        if (row is None or t.installation_id) and not is_mine(t, ledger):
            if include_foreign and age is not None and age >= foreign_min_age_s:
                rep.orphans.append(t)
            else:
                rep.foreign.append(t)
            continue
        if row is None and age is not None and age < min_age_s:
            rep.young.append(t)
            continue
        rep.orphans.append(t)
    listed = {t.provider_id for t in tagged}
    seen = {r.id for r in rep.unknown}
    rep.unknown += [r for r in ledger.resources(live_only=True) if r.provider == p.name
                    and r.state == "unknown" and r.id not in seen and r.provider_id not in listed]


def _orphan_row(ledger: Ledger, t: Any, actor: str) -> Resource:
    """The ledger row of orphan ``t`` in state ``orphan`` before anything is deleted: its old row reopened (the
    ledger had it terminated), else a new row with its id, creation time and rate."""
    row = ledger.find_by_provider_id(t.provider, t.provider_id)
    if row is not None and row.state != "orphan":  # known but marked terminated: reopen
        ledger.update_resource(row.id, state="orphan", terminated_at=None, terminated_by=None, actor=actor,
                               message=f"{t.provider_id} still exists although the ledger had it terminated")
    elif row is None:
        row = ledger.record_intent(t.run_id or "unknown", t.provider, t.kind, t.name or t.provider_id,
                                   region=t.region, usd_per_hour=t.usd_per_hour or 0.0, actor=actor,
                                   attrs={"found_by": "reconcile", "installation_id": t.installation_id,
                                          **({"rate_unknown": t.rate_unreadable} if t.rate_unreadable else {})})
        ledger.update_resource(row.id, provider_id=t.provider_id, state="orphan",
                               created_at=t.created_at or row.created_at, actor=actor,
                               message=f"orphan {t.kind} {t.provider_id} found by run tag")
    res = ledger.resource(row.id)
    assert res is not None
    return res


def _terminate_orphans(ledger: Ledger, rep: ReconcileReport, by_name: dict[str, Provider], *, actor: str,
                       include_foreign: bool, **kw: Any) -> None:
    """Terminate ``rep.orphans`` in dependency order, each written to the ledger first; one whose dependency is
    still live is not tried (its row says which).  Fills ``rep.terminated`` and ``rep.failed``."""
    from broker.money.teardown import blocked_by, teardown_order, terminate_resource

    failed_tags: list[Any] = []
    for t in teardown_order(rep.orphans):
        blocker = blocked_by(t, failed_tags)
        res = _orphan_row(ledger, t, actor)
        if blocker is not None:
            ledger.update_resource(res.id, error=f"waits for {blocker.kind} {blocker.provider_id} (still live) to "
                                   "go first", actor=actor, message="not tried: a dependency is still live")
            failed_tags.append(t)
            rep.failed.append(ledger.resource(res.id) or res)
            continue
        if terminate_resource(ledger, res, actor, provider=by_name.get(t.provider), tagged=t,
                              foreign_ok=include_foreign, **kw):
            rep.terminated.append(res.id)
        else:
            failed_tags.append(t)
            rep.failed.append(ledger.resource(res.id) or res)


def _terminate_unknown(ledger: Ledger, rep: ReconcileReport, by_name: dict[str, Provider], *, actor: str,
                       **kw: Any) -> list[Resource]:
    """Terminate the live ``unknown`` rows (ambiguous creates) of the providers that answered; returns those still
    live (their provider did not answer, or the terminate failed).  Adds what went to ``rep.terminated``."""
    from broker.money.teardown import teardown_order, terminate_resource

    still_unknown: list[Resource] = []
    for r in teardown_order(rep.unknown):
        cur = ledger.resource(r.id) or r
        if cur.live and by_name.get(cur.provider) is not None and cur.provider in rep.checked:
            if terminate_resource(ledger, cur, actor, provider=by_name[cur.provider], **kw):
                rep.terminated.append(cur.id)
                continue
            cur = ledger.resource(r.id) or cur
        if cur.live:
            still_unknown.append(cur)
    return still_unknown
