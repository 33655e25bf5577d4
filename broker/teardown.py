"""Idempotent, confirmed termination of ledger resources (used by the CLI, ``broker down`` and the watchdog).

Rules (DESIGN.md "Money and safety invariants"):

* a resource is claimed (``terminating``) in the ledger before the provider call, so two processes do not race
  blindly; a second claim of a ``terminating`` row is allowed (the first process may have died) and harmless
  because provider terminates are idempotent;
* an ``intent`` row without a provider id is resolved through the run tag (``list_tagged``): the create may have
  happened just before a crash;
* instances are terminated before the network objects they sit in; those go in reverse creation order;
* a failed terminate leaves the row live with its error, loud in ``broker status``, for the next try.
"""

from __future__ import annotations

import time
from typing import Callable

from broker.ledger import Ledger
from broker.model import Resource
from broker.provider import Provider, ProviderError


def _provider(name: str, cache: dict[str, Provider]) -> Provider:
    if name not in cache:
        from broker.providers import get_provider

        cache[name] = get_provider(name)
    return cache[name]


def terminate_resource(ledger: Ledger, res: Resource, actor: str, *, provider: Provider | None = None,
                       confirm_timeout_s: float = 900.0, poll_s: float = 2.0,
                       say: Callable[[str], None] | None = None) -> bool:
    """Terminate one resource and confirm it is gone; True when the ledger now says ``terminated``.

    Never raises for provider failures: the error is recorded on the row (state stays live) and False returned.
    """
    if res.state == "terminated":
        return True
    p = provider or _provider(res.provider, {})
    if not ledger.claim_termination(res.id, actor):
        return True
    try:
        if not res.provider_id:
            match = [t for t in p.list_tagged(res.run_id) if t.kind == res.kind and t.name in (res.name, None)]
            if not match:
                ledger.update_resource(res.id, state="terminated", terminated_by=actor, actor=actor,
                                       message="no provider object carries this run's tag: the create never happened")
                return True
            ledger.update_resource(res.id, provider_id=match[0].provider_id, actor=actor,
                                   message=f"found by run tag: {match[0].provider_id}")
            res = res.model_copy(update={"provider_id": match[0].provider_id})
        assert res.provider_id is not None
        if say:
            say(f"terminating {res.provider} {res.kind} {res.provider_id}")
        gone = p.terminate(res.kind, res.provider_id, region=res.region, attrs=res.attrs)
        deadline = time.monotonic() + confirm_timeout_s
        while not gone and res.kind == "instance":
            info = p.describe_instance(res.provider_id, region=res.region)
            if info.state == "terminated":
                gone = True
                break
            if time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        if not gone and res.kind != "instance":
            gone = True  # non-instance deletes are synchronous where the adapter returns
        if not gone:
            ledger.update_resource(res.id, error=f"terminate requested but still not gone after "
                                                 f"{confirm_timeout_s:.0f} s", actor=actor, message="not confirmed")
            return False
        ledger.update_resource(res.id, state="terminated", terminated_by=actor, error=None, actor=actor,
                               message=f"{res.kind} {res.provider_id} terminated")
        return True
    except ProviderError as e:
        ledger.update_resource(res.id, error=str(e), actor=actor, message=f"terminate failed: {e.message}")
        return False


def teardown_order(resources: list[Resource]) -> list[Resource]:
    """Instances first (newest first), then everything else in reverse creation order."""
    inst = [r for r in resources if r.kind == "instance"]
    rest = [r for r in resources if r.kind != "instance"]
    return sorted(inst, key=lambda r: r.created_at, reverse=True) + sorted(rest, key=lambda r: r.created_at,
                                                                            reverse=True)


def teardown_run(ledger: Ledger, run_id: str, actor: str, *, providers: dict[str, Provider] | None = None,
                 say: Callable[[str], None] | None = None, confirm_timeout_s: float = 900.0,
                 poll_s: float = 2.0) -> list[Resource]:
    """Terminate every live resource of ``run_id``; returns those still live afterwards (empty = all gone).

    Network objects are only deleted once every instance of the run is confirmed gone.
    """
    cache: dict[str, Provider] = dict(providers or {})
    live = teardown_order(ledger.resources(run_id, live_only=True))
    failed_instance = False
    for res in live:
        if res.kind != "instance" and failed_instance:
            continue  # a subnet cannot be deleted while an instance still sits in it
        ok = terminate_resource(ledger, res, actor, provider=_provider(res.provider, cache), say=say,
                                confirm_timeout_s=confirm_timeout_s, poll_s=poll_s)
        if not ok and res.kind == "instance":
            failed_instance = True
    return ledger.resources(run_id, live_only=True)
