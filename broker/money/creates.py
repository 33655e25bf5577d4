"""One create that may or may not have happened, for :mod:`broker.money.provision`: create errors sorted
(:func:`_ambiguous`: a definite answer, or one that may have created the instance), an ambiguous create verified by
listing what the provider holds with the run's tags (:func:`_create_verified`, :func:`_listed`), TransientError
retried with backoff (:func:`_retrying`, the provider's ``Retry-After`` first).
"""

from __future__ import annotations

from typing import Any, Callable

from broker.core.model import utcnow
from broker.core.provider import (
    AuthError, BadInput, CapacityError, NotSupported, OfferGone, Provider, ProviderError, QuotaError, TransientError)
from broker.core.records import NodeRequest, Resource, TaggedResource
from broker.money.cost import Progress
from broker.money.ledger import Ledger


class _NeverReady(ProviderError):
    pass


class _Unverified(ProviderError):
    """An ambiguous create whose outcome no list could establish: the row is ``unknown``; stop creating on this
    provider for the run."""


def _ambiguous(e: BaseException) -> bool:
    """Whether a failed create may still have created the instance: only when the request may have reached the
    provider and no definite answer came back (an :class:`AmbiguousCreate`, a 5xx, a 408 / 409, a timeout or an
    unreadable answer).  Definite answers are never ambiguous: validation / not found (a 4xx, or a ProviderError
    without status: the adapter's own refusal before any create call, e.g. no image found), auth, quota / limit,
    capacity, and a 429 (the request was refused, nothing was made)."""
    from broker.core.errors import AmbiguousCreate

    if isinstance(e, AmbiguousCreate):
        return True
    if isinstance(e, (CapacityError, QuotaError, OfferGone, AuthError, NotSupported, BadInput)):
        return False
    if _throttled(e):
        return False
    if isinstance(e, TransientError):
        return e.status is None or e.status >= 500 or e.status in (408, 409)
    if isinstance(e, ProviderError):
        return e.status is not None and (e.status >= 500 or e.status in (408, 409))
    return isinstance(e, Exception)  # not translated (a timeout, a parsing error after the request went out)


def _throttled(e: BaseException) -> bool:
    """A 429 / throttling answer: the provider refused the request (nothing created); retry in place after its
    backoff, never a reason to leave the zone / availability domain."""
    return isinstance(e, TransientError) and (e.status == 429 or bool(getattr(e, "throttled", False)))


def _backoff_s(e: BaseException, n: int, wait_s: float) -> float:
    """Seconds to wait before attempt ``n + 1``: the provider's ``Retry-After`` (``e.retry_after_s``, set by the
    adapter) when it gave one, else ``wait_s`` doubling, at most 30 s."""
    ra = getattr(e, "retry_after_s", None)
    if isinstance(ra, (int, float)) and ra >= 0:
        return min(float(ra), 120.0)
    return min(30.0, wait_s * 2 ** (n - 1))


def _listed(p: Provider, res: Resource, ledger: Ledger) -> TaggedResource | None:
    """The provider object that is ``res`` (run tag, kind and name) and no other ledger row's; raises what
    ``list_tagged`` raises."""
    for t in p.list_tagged(res.run_id):
        if t.kind != res.kind or t.name not in (res.name, None) or t.state == "terminated":
            continue
        other = ledger.find_by_provider_id(p.name, t.provider_id)
        if other is not None and other.id != res.id:
            continue  # an earlier option's node of the same name
        return t
    return None


def _create_verified(p: Provider, req: NodeRequest, res: Resource, ledger: Ledger, *, attempts: int,
                     wait_s: float, say: Progress, actor: str, clock: Callable[[], Any] | None = None) -> str:
    """``create_instance`` such that at most one instance exists for the intent row ``res``, whatever the API
    answers (see the module docstring).  Returns the provider id; raises the create's error when it is proven
    that nothing exists, :class:`_Unverified` when that cannot be established."""
    import time

    from broker.money.teardown import create_settle_s

    settle = create_settle_s(p)
    throttled = 0
    n = 0
    while n < max(1, attempts):
        n += 1
        t_call = utcnow()
        t0 = time.monotonic()
        p.progress = say  # a create that waits long says so on the run's progress line
        try:
            return p.create_instance(req)
        except BaseException as e:  # noqa: BLE001 - sorted below; KeyboardInterrupt is re-raised
            if isinstance(e, KeyboardInterrupt):
                raise
            if _throttled(e) and throttled < max(1, attempts) * 2:
                throttled += 1
                n -= 1  # a refused request is not an attempt: retried in place, same row, same zone
                pause = _backoff_s(e, throttled, wait_s)
                say(f"{p.name}: create {req.name} throttled ({getattr(e, 'message', e)}): nothing was created; "
                    f"trying again in the same zone in {pause:.1f} s")
                time.sleep(pause)
                if clock is not None:
                    clock()  # the run's clock: raises ClockOut after the deadline / budget
                continue
            if not _ambiguous(e):
                raise
            err = e
        what = getattr(err, "message", None) or f"{type(err).__name__}: {err}"
        say(f"{p.name}: create {req.name} answered ambiguously ({what}); checking by run tag whether it exists")
        while True:
            try:
                found = _listed(p, res, ledger)
            except Exception as le:  # noqa: BLE001 - an unreadable list proves nothing
                why = getattr(le, "message", None) or f"{type(le).__name__}: {le}"
                msg = (f"create of {req.name} answered ambiguously ({what}) and the instance list could not be read "
                       f"({why}): it may exist and bill")
                ledger.update_resource(res.id, state="unknown", error=msg, actor=actor, message=msg,
                                       attrs={"ambiguous_create_at": t_call.isoformat()})
                raise _Unverified(p.name, "create_instance", msg + f"; no further create on {p.name} in this run",
                                  hint=f"`broker status` counts it as possibly billing; `broker down {res.run_id}` or "
                                       "`broker reconcile` resolves it once the provider's list answers") from None
            if found is not None:
                ledger.mark_created(res.id, found.provider_id, actor=actor)
                ledger.event(res.run_id, actor, "adopted", f"create answered {what!r} but {found.provider_id} "
                             "exists (found by run tag): adopted, not created again", resource_id=res.id)
                say(f"{p.name}: {found.provider_id} exists despite the error: adopted")
                return found.provider_id
            left = settle - (time.monotonic() - t0)
            if left <= 0:
                break
            time.sleep(min(left, max(0.5, settle / 5)))
        if n >= attempts or not isinstance(err, (TransientError, ProviderError)):
            raise err
        pause = _backoff_s(err, n, wait_s)
        say(f"{p.name} create_instance: {what}; proven absent by a list {settle:g} s later; retry {n + 1}/{attempts} "
            f"in {pause:.1f} s")
        time.sleep(pause)
        if clock is not None:
            clock()
    raise AssertionError("unreachable")  # pragma: no cover


def _retrying(fn: Callable[..., Any], *args: Any, attempts: int, wait_s: float, say: Progress, what: str,
              **kwargs: Any) -> Any:
    """Call ``fn`` retrying TransientError with exponential backoff (``wait_s``, x2, at most 30 s; the error's
    ``retry_after_s`` when the provider named a wait) ``attempts`` times in all; the last TransientError
    propagates."""
    from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

    def before_sleep(rs: Any) -> None:
        say(f"{what}: {rs.outcome.exception().message}; retry {rs.attempt_number + 1}/{attempts} "
            f"in {rs.next_action.sleep:.1f} s")

    from broker.core.errors import retry_after_wait

    for attempt in Retrying(retry=retry_if_exception_type(TransientError), stop=stop_after_attempt(attempts),
                            wait=retry_after_wait(wait_exponential(multiplier=wait_s, max=30)), reraise=True,
                            before_sleep=before_sleep):
        with attempt:
            return fn(*args, **kwargs)
