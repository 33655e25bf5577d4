"""Idempotent, confirmed termination of ledger resources (used by the CLI, ``broker down``, the watchdog and
``broker reconcile``).

Rules (docs/design.md "Money and safety invariants"):

* a resource is claimed (``terminating``) in the ledger before the provider call, so two processes do not race
  blindly; a second claim of a ``terminating`` row is allowed (the first process may have died) and harmless
  because provider terminates are idempotent;
* an ``intent`` row without a provider id is resolved through the run tag (``list_tagged``): the create may have
  happened just before a crash.  An ``unknown`` row (a create answered ambiguously, see :mod:`broker.money.provision`)
  is only proven absent by a list made at least the provider's ``create_settle_s`` after that create; a list
  that cannot be read (ProviderError) never counts as "nothing there";
* a terminate / delete answered with a TransientError (5xx, 429, 409 Conflict as the adapters map them) is
  retried with exponential backoff (tenacity) for at most ``retry_s`` seconds;
* dependency order (:func:`teardown_order`): instances -> volumes -> subnets -> security lists / route tables /
  gateways -> security groups -> placement groups -> VCN / VPC; nothing of a later rank is tried while something
  of an earlier rank of the same run and provider is still live (a subnet cannot go while an instance sits in
  it: trying only burns 409s);
* a delete is done when the provider shows the resource gone, not when it answers "success": an instance still
  described after its delete gets the delete re-sent with exponential backoff until it is gone or
  ``confirm_timeout_s`` ends, with a progress line every :data:`PROGRESS_EVERY_S` seconds;
* a failed terminate leaves the row live with its error (id, $/hour and the command that retries,
  :func:`stuck_message`), loud in ``broker status``, for the next try;
* the ledger is never a precondition of a delete: the claim and the states after it go through
  :class:`broker.money.journal.FailSafeLedger` (a locked ledger or a full disk: kept, journalled, replayed later);
* a ledger row is data, not a command (:func:`refusal`): its provider id must have the provider's form
  (``Provider.valid_id``), and where the provider keeps broker's tags (``Provider.owner_tags``) the object must be
  shown by the provider with this installation's and this run's tags; otherwise nothing is sent and the row stays
  live with an error naming it ("refused").
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any, Callable, Sequence, TypeVar

from broker.money.journal import failsafe
from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.core.prose import usd
from broker.core.records import Resource
from broker.core.provider import INSTALL_TAG, RUN_TAG, Provider, ProviderError, TransientError

#: seconds a terminate / delete answered with a TransientError is retried (backoff 1 s, x2, at most 15 s)
TERMINATE_RETRY_S = 120.0
#: default for providers that do not say how long their list lags behind a create (``create_settle_s``)
DEFAULT_CREATE_SETTLE_S = 20.0

#: actors that act on rows they did not just write (the ledger is input to them): they terminate only what the
#: provider shows with this installation's and run's tags (:func:`refusal`).  A run's own CLI tears down the
#: objects it created itself in this process, even while the provider's list cannot be read.
TAG_CHECKED_ACTORS = ("down", "reconcile", "watchdog")

#: teardown rank by resource kind (lower first); kinds not listed rank with the gateways
KIND_RANK: dict[str, int] = {
    "instance": 0, "netns_node": 0, "slurm_job": 0,
    "volume": 1, "boot_volume": 1,
    "subnet": 2,
    "security_list": 3, "route_table": 3, "internet_gateway": 3, "nat_gateway": 3, "service_gateway": 3,
    "network_security_group": 3,
    "security_group": 4,
    "placement_group": 5,
    "vcn": 6, "vpc": 6,
}
_OTHER_RANK = 3

T = TypeVar("T")

#: seconds between the progress lines of a teardown that waits for the provider to show a resource gone
PROGRESS_EVERY_S = 10.0
#: the first re-send of a delete comes this many polls after the last one, then doubles (at most RESEND_MAX_S)
RESEND_POLLS = 5
RESEND_MAX_S = 30.0


def kind_rank(kind: str) -> int:
    """Where ``kind`` goes in :func:`teardown_order` (0 = first)."""
    return KIND_RANK.get(kind, _OTHER_RANK)


def create_settle_s(p: Provider | None) -> float:
    """Seconds after a create call before the provider's list can prove the object absent."""
    return DEFAULT_CREATE_SETTLE_S if p is None else float(p.create_settle_s)


def _retry_terminate(p: Provider, res: Resource, retry_s: float, say: Callable[[str], None] | None) -> bool:
    """``p.terminate`` retried on TransientError with exponential backoff for at most ``retry_s`` seconds."""
    from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

    def before_sleep(rs: Any) -> None:
        if say:
            say(f"terminate {res.provider_id}: {rs.outcome.exception().message}; retry in {rs.next_action.sleep:.1f} s")

    from broker.core.errors import retry_after_wait

    for attempt in Retrying(retry=retry_if_exception_type(TransientError), stop=stop_after_delay(retry_s),
                            wait=retry_after_wait(wait_exponential(multiplier=min(1.0, max(retry_s / 8, 0.01)),
                                                                   max=15), cap_s=max(retry_s, 0.0)),
                            reraise=True, before_sleep=before_sleep):
        with attempt:
            return p.terminate(res.kind, res.provider_id or "", region=res.region, attrs=res.attrs)
    return False  # pragma: no cover - tenacity either returns or raises


def retry_command(res: Resource) -> str:
    """The command that retries the teardown of ``res`` (its run's ``broker down``)."""
    return f"broker down {res.run_id}" if res.run_id and res.run_id != "unknown" else "broker reconcile --terminate"


def stuck_message(res: Resource, waited_s: float) -> str:
    """The sentence for a resource the provider still shows after its delete: id, $/hour, the retry command."""
    return (f"{res.provider} {res.kind} {res.provider_id} still not gone {waited_s:.0f} s after broker asked to "
            f"delete it (the provider accepted the delete but still shows it) and may bill "
            f"{usd(float(res.usd_per_hour or 0.0), up_to=4)}/h: retry with `{retry_command(res)}`, or delete "
            f"{res.provider_id} in the {res.provider} console")


def _confirm_gone(p: Provider, res: Resource, *, confirm_timeout_s: float, poll_s: float,
                  say: Callable[[str], None] | None) -> bool:
    """Describe ``res`` until the provider shows it gone, re-sending the delete with exponential backoff (a delete
    answered "success" is a request, not the provider's word that it is gone), for at most ``confirm_timeout_s``
    seconds; a progress line at once and every :data:`PROGRESS_EVERY_S` seconds.  True = gone."""
    assert res.provider_id is not None
    t0 = time.monotonic()
    end = t0 + confirm_timeout_s
    last_send, sends, k = t0, 1, 0
    next_progress = t0
    state = "listed"
    while True:
        try:
            info = p.describe_instance(res.provider_id, region=res.region)
        except TransientError as e:  # a throttled / failed describe proves nothing: look again
            if say:
                say(f"describe {res.provider_id}: {e.message}; polling again")
            info = None
        if info is not None:
            if info.state == "terminated":
                return True
            state = info.raw_state or info.state
        now = time.monotonic()
        if now >= end:
            return False
        if say and now >= next_progress:
            say(f"{res.provider} {res.kind} {res.provider_id}: still {state} {now - t0:.0f} s after the delete "
                f"(sent {sends}x); re-sending until the provider shows it gone (up to {confirm_timeout_s:.0f} s)")
            next_progress = now + PROGRESS_EVERY_S
        if now - last_send >= min(RESEND_MAX_S, RESEND_POLLS * max(poll_s, 0.001) * 2 ** k):
            sends, k, last_send = sends + 1, k + 1, now
            try:
                if p.terminate(res.kind, res.provider_id, region=res.region, attrs=res.attrs):
                    return True
            except TransientError as e:
                if say:
                    say(f"re-sent delete of {res.provider_id}: {e.message}; trying again")
        time.sleep(max(0.0, min(poll_s, end - time.monotonic())))


def _provider(name: str, cache: dict[str, Provider]) -> Provider:
    if name not in cache:
        from broker.providers import get_provider

        cache[name] = get_provider(name)
    return cache[name]


def _ambiguous_at(res: Resource) -> datetime | None:
    at = (res.attrs or {}).get("ambiguous_create_at")
    return datetime.fromisoformat(at) if at else None


def refusal(ledger: Ledger, res: Resource, p: Provider, tagged: Any = None, *, check_tags: bool = True,
            foreign_ok: bool = False) -> tuple[str, str]:
    """Whether ``res`` (with a provider id) may be terminated, by what the provider says, not the ledger:
    ``("ok", "")``; ``("gone", why)`` when the provider no longer holds it (nothing to send); ``("refuse", why)``
    when the id is not of the provider's form or the provider shows the object without this installation's and
    run's tags (a crafted or damaged row: never terminated); ``("wait", why)`` when a just-created object is not
    listed yet.  ``tagged``: the provider-side view the caller has just read (reconcile), else it is read here
    (``Provider.tagged_resource``); ``check_tags`` False: the id's form only; ``foreign_ok``: another
    installation's tag is accepted (``reconcile --include-foreign`` decided on the provider's list).  Raises
    ProviderError when the provider cannot be read (never taken for "ours")."""
    pid = res.provider_id or ""
    what = f"{res.provider} {res.kind} {pid!r}"
    if not p.valid_id(res.kind, pid):
        return "refuse", (f"refused: {what} is not a {res.provider} {res.kind} id ({p.id_form(res.kind)}); nothing "
                          "was sent. The ledger row was damaged or edited: check the provider's console")
    if not check_tags or not getattr(p, "owner_tags", False):
        return "ok", ""
    mine = ledger.installation_id
    t = tagged if tagged is not None else p.tagged_resource(
        res.kind, pid, region=res.region, run_id=res.run_id,
        **({"attrs": res.attrs} if getattr(p, "tags_need_attrs", False) else {}))
    if t is not None:
        cut = getattr(p, "cut_run_tags", True)  # a provider that may shorten the tag (a cut Vast label)
        if t.run_id != res.run_id and not (cut and t.run_id and res.run_id.startswith(t.run_id)):
            return "refuse", (f"refused: {what} carries {RUN_TAG}={t.run_id}, not this row's run {res.run_id}: not "
                              "terminated (a ledger row cannot name another run's object)")
        # a provider whose tag names the run only (Slurm's job comment) is checked on the installation when the
        # object carries one
        no_install_tag = not getattr(p, "install_tags", True) and t.installation_id is None
        if t.installation_id != mine and not foreign_ok and not no_install_tag:
            return "refuse", (f"refused: {what} carries {INSTALL_TAG}={t.installation_id or '(none)'}, not this "
                              f"installation's {mine}: not terminated (another BROKER_HOME's; `broker reconcile "
                              "--include-foreign` handles old ones)")
        return "ok", ""
    if res.kind != "instance":
        return "gone", f"{what} is not held with this run's tag: gone (or never ours); nothing was sent"
    info = p.describe_instance(pid, region=res.region)
    if info.state == "terminated":
        return "gone", f"{what} no longer exists at the provider"
    age = (utcnow() - res.created_at).total_seconds() if res.created_at else None
    if age is not None and age < create_settle_s(p):
        return "wait", f"{what} is not listed with this run's tag yet ({age:.0f} s after its create); tried again later"
    return "refuse", (f"refused: {res.provider} shows instance {pid} ({info.raw_state or info.state}) without "
                      f"{RUN_TAG}={res.run_id} / {INSTALL_TAG}={mine}: broker did not create it, so it is not "
                      "terminated. If it is yours, delete it in the provider's console")


def terminate_resource(ledger: Ledger, res: Resource, actor: str, *, provider: Provider | None = None,
                       confirm_timeout_s: float = 900.0, poll_s: float = 2.0,
                       say: Callable[[str], None] | None = None, retry_s: float = TERMINATE_RETRY_S,
                       tagged: Any = None, foreign_ok: bool = False) -> bool:
    """Terminate one resource and confirm it is gone; True when the ledger now says ``terminated``.

    For the actors of :data:`TAG_CHECKED_ACTORS`, only what the provider shows as this installation's and run's
    (:func:`refusal`; ``tagged``: the provider's view just read by the caller; ``foreign_ok``: see there) is
    terminated; every actor checks the id's form; a refused row stays live with the reason as its error.  A
    TransientError from the terminate call is retried for ``retry_s`` seconds.  Never raises for provider (or
    adapter) failures: the error is recorded on the row (state stays live) and False returned.
    """
    if res.state == "terminated":
        return True
    # the delete never waits for the ledger: what it cannot record is kept, journalled and replayed
    ledger = failsafe(ledger, say)
    try:
        p = provider or _provider(res.provider, {})
    except Exception as e:  # noqa: BLE001 - an adapter that cannot load: the row stays live and says why
        ledger.update_resource(res.id, error=f"adapter {res.provider} not available: {e}", actor=actor,
                               message=f"terminate failed: {e}")
        return False
    unknown = _ambiguous_at(res) if not res.provider_id else None
    prev_state = res.state
    if not ledger.claim_termination(res.id, actor):
        return True
    try:
        if not res.provider_id:
            # a ProviderError here (an unreadable list) propagates to the handler below: never "nothing there"
            match = [t for t in p.list_tagged(res.run_id) if t.kind == res.kind and t.name in (res.name, None)]
            if not match:
                if unknown is not None:
                    waited = (utcnow() - unknown).total_seconds()
                    settle = create_settle_s(p)
                    if waited < settle:
                        ledger.update_resource(res.id, state="unknown", actor=actor, error=(
                            f"ambiguous create {waited:.0f} s ago: a list cannot prove it absent before "
                            f"{settle:.0f} s; counted as possibly billing until then"),
                            message="not listed yet; too early to prove absent")
                        return False
                    why = (f"a list {waited:.0f} s after the ambiguous create shows nothing with this run's tag: "
                           "it never existed")
                else:
                    why = "no provider object carries this run's tag: the create never happened"
                ledger.update_resource(res.id, state="terminated", terminated_by=actor, error=None, actor=actor,
                                       message=why, attrs={"never_created": True})
                return True
            ledger.update_resource(res.id, provider_id=match[0].provider_id, actor=actor,
                                   message=f"found by run tag: {match[0].provider_id}")
            res = res.model_copy(update={"provider_id": match[0].provider_id})
            tagged = tagged if tagged is not None else match[0]
        assert res.provider_id is not None
        verdict, why = refusal(ledger, res, p, tagged, check_tags=actor in TAG_CHECKED_ACTORS,
                               foreign_ok=foreign_ok)
        if verdict == "gone":
            ledger.update_resource(res.id, state="terminated", terminated_by=actor, error=None, actor=actor,
                                   message=why)
            return True
        if verdict != "ok":
            ledger.update_resource(res.id, state=prev_state, terminated_by=res.terminated_by, error=why, actor=actor,
                                   message=why)
            if say:
                say(why)
            return False
        if say:
            say(f"terminating {res.provider} {res.kind} {res.provider_id}")
        gone = _retry_terminate(p, res, retry_s, say)
        if not gone and res.kind == "instance":
            gone = _confirm_gone(p, res, confirm_timeout_s=confirm_timeout_s, poll_s=poll_s, say=say)
        if not gone and res.kind != "instance":
            gone = True  # non-instance deletes are synchronous where the adapter returns
        if not gone:
            msg = stuck_message(res, confirm_timeout_s)
            ledger.update_resource(res.id, error=msg, actor=actor, message="not confirmed gone")
            if say:
                say(msg)
            return False
        ledger.update_resource(res.id, state="terminated", terminated_by=actor, error=None, actor=actor,
                               message=f"{res.kind} {res.provider_id} terminated")
        return True
    except ProviderError as e:
        if unknown is not None and not res.provider_id:  # still cannot tell: stays unknown, possibly billing
            ledger.update_resource(res.id, state="unknown", actor=actor, message=f"still unknown: {e.message}",
                                   error=f"an ambiguous create not resolved: the list could not be read ({e})")
        else:
            ledger.update_resource(res.id, error=str(e), actor=actor, message=f"terminate failed: {e.message}")
        return False
    except Exception as e:  # noqa: BLE001 - an adapter bug must not leave the row unexplained or stop a teardown
        msg = f"{type(e).__name__}: {e}"
        ledger.update_resource(res.id, error=f"{res.provider}: unexpected error: {msg}", actor=actor,
                               message=f"terminate failed: {msg}",
                               **({"state": "unknown"} if unknown is not None and not res.provider_id else {}))
        return False


def teardown_order(resources: Sequence[T]) -> list[T]:
    """Dependency order (:data:`KIND_RANK`): instances first, then volumes, subnets, security lists / route tables
    / gateways, security groups, placement groups, VCN / VPC; within a rank newest first.  Works on ledger
    :class:`~broker.core.model.Resource` s and on :class:`~broker.core.provider.TaggedResource` s (``created_at`` may be
    None there: oldest)."""
    def key(r: Any) -> tuple:
        t = getattr(r, "created_at", None)
        return (kind_rank(r.kind), -(t.timestamp() if t else 0.0))

    return sorted(resources, key=key)


def blocked_by(res: Any, failed: Sequence[Any]) -> Any | None:
    """The first of ``failed`` (still live after a try) that ``res`` must wait for: same provider and run, lower
    rank.  None = ``res`` may be tried."""
    for f in failed:
        if (f.provider == res.provider and getattr(f, "run_id", None) == getattr(res, "run_id", None)
                and kind_rank(f.kind) < kind_rank(res.kind)):
            return f
    return None


def teardown_run(ledger: Ledger, run_id: str, actor: str, *, providers: dict[str, Provider] | None = None,
                 say: Callable[[str], None] | None = None, confirm_timeout_s: float = 900.0,
                 poll_s: float = 2.0, retry_s: float = TERMINATE_RETRY_S) -> list[Resource]:
    """Terminate every live resource of ``run_id`` in dependency order; returns those still live afterwards
    (empty = all gone).  A resource waits while one of a lower rank (e.g. an instance in its subnet) is still
    live: it is not tried (that would only collect 409s) and stays live for the next ``broker down``."""
    cache: dict[str, Provider] = dict(providers or {})
    ledger = failsafe(ledger, say)
    live = teardown_order(ledger.resources(run_id, live_only=True))
    failed: list[Resource] = []
    for res in live:
        blocker = blocked_by(res, failed)
        if blocker is not None:
            if say:
                say(f"{res.kind} {res.provider_id or res.name} waits: {blocker.kind} "
                    f"{blocker.provider_id or blocker.name} is still live")
            failed.append(res)
            continue
        try:
            p: Provider | None = _provider(res.provider, cache)
        except Exception:  # noqa: BLE001 - terminate_resource records why on the row
            p = None
        ok = terminate_resource(ledger, res, actor, provider=p, say=say, confirm_timeout_s=confirm_timeout_s,
                                poll_s=poll_s, retry_s=retry_s)
        if not ok:
            failed.append(res)
    return ledger.resources(run_id, live_only=True)
