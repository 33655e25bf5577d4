"""Ledger-first provisioning with failover down a plan's ranked options, and cost-so-far helpers.

:func:`provision` turns ranked :class:`~broker.core.model.PlanOption` s into a running :class:`~broker.core.model.Cluster`:

1. ``provider.bootstrap`` (network / security prerequisites) through a :class:`LedgerRecorder`, so every object it
   creates is written to the ledger before its create call and gets its provider id right after;
2. per instance: ``ledger.record_intent`` (state ``intent``, USD/hour, the run's hard deadline) **before**
   ``provider.create_instance`` (whose idempotency ``client_token`` is the ledger row id), ``ledger.mark_created``
   right after;
3. ``describe_instance`` until ``running``; ``failed`` / ``stopped`` / ``terminated`` or the ready timeout count
   as "never ready".

Failover rules (docs/design.md):

* ``OfferGone`` or never ready -> the next option;
* ``CapacityError`` -> skip the remaining options for the same instance type in the same zone / availability
  domain and region (they would hit the same empty pool), so the next option tried is another zone, then region;
* ``QuotaError`` -> skip only the limit's scope: the remaining options of that provider + region that the same
  limit covers (:func:`broker.plan.quota.limit_for`: the OCI GPU limit, the AWS family bucket; a G-family limit never
  drops P-family options) and, for AD-scoped limits (OCI), only in that availability domain (``QuotaError.scope``,
  else the offer's zone).  Without a known limit: the whole provider + region.  The quota to raise is reported
  with the new limit = current limit + (what the option needs there - what is available there);
* ``TransientError`` on bootstrap -> retried with bounded exponential backoff (tenacity) before failing over;
* ``AuthError`` / ``NotSupported`` -> skip that provider.

Create errors are sorted (:func:`_ambiguous`): definite answers (validation, not found, auth, quota / limit,
capacity, an adapter's refusal before any create call) fail the option at once; a 429 / throttling answer
(:func:`_throttled`) is retried in place (same row, same zone) after the provider's ``Retry-After``, never a
reason to move to the next zone.  Ambiguous creates: a ``create_instance`` that raised an AmbiguousCreate, a
TransientError without status, a 5xx / 408 / 409 or an untranslated exception may have created the instance
anyway.  It is never
retried blindly: the provider's ``list_tagged`` is asked (polling until ``create_settle_s`` of the adapter, default
20 s, has passed since the call) whether the instance (run tag + node name) exists.  Found -> adopted (its id goes
to the intent row).  Proven absent -> the create is retried with the same row and client token (bounded attempts).
The list cannot be read (ProviderError) -> the row becomes ``unknown`` (live, counted at its worst case, shown as
possibly billing by ``status`` / ``reconcile`` / ``watchdog``), **no further create is made on that provider in
this run**, and failover goes on with other providers.  A later list resolves the row (found -> terminated; absent
-> terminated as never created).  So at most one instance exists per intent row whatever the API answers.

Before moving on, every instance the failed attempt created is terminated (``broker.money.teardown``); if that
terminate fails, failover **stops** with a :class:`ProviderError` naming the live resource.  Network objects made
by ``bootstrap`` are kept for later options in the same provider + region and deleted when no longer needed (or
left to ``teardown_run``, which deletes them after the instances).

One clock per run (:func:`run_clock`, :func:`check_clock`): before each option, before each create and on every
poll of a pending instance the run's deadline and budget (spent + live $/hour from the ledger) are checked; when
either has run out, or the watchdog ended the run, :class:`ClockOut` stops provisioning (status ``deadline`` /
``interrupted``): nothing is rented after the deadline, and an instance the watchdog killed is never taken for a
failed offer.  The rate the provider reports for an instance (describe's ``usd_per_hour``) replaces the planned one
in the ledger (:func:`record_reported_rate`); more than 10 % above the plan and past the budget it raises
:class:`broker.money.cost.RateAboveBudget`.

Costs: :func:`spent_usd` bills each resource per second from its ledger ``created_at`` (the moment the intent
was recorded, i.e. just before the create call) until ``terminated_at`` (or now).  That is conservative on
purpose: Vast.ai bills storage from creation, AWS / OCI bill from ``running``; starting at the intent can only
over-state the spend by the seconds a create call takes, never under-state it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable

from broker.money.ledger import Ledger
from broker.core.model import Offer, Plan, PlanOption, Requirements, TopologyKind
from broker.core.records import Cluster, ClusterNode, Resource, Run
from broker.core.nodescripts import deadman_grace_s, node_workroot
from broker.core.prose import usd
from broker.core.provider import (
    INSTALL_TAG, RUN_TAG, AuthError, BadInput, BrokerError, CapacityError, NotSupported, NoValidPlan, OfferGone,
    Provider,
    ProviderError, QuotaError, TransientError)
from broker.core.records import Ingress, InstanceInfo, NodeRequest
from broker.money.cost import HOURS_PER_MONTH, Progress, check_clock, record_reported_rate, record_unknown_rate
# one create that may or may not have happened (its errors sorted, verified by a list, retried): tests and the
# adapters' own tests reach these names here
from broker.money.creates import (  # noqa: F401
    _ambiguous, _backoff_s, _create_verified, _listed, _NeverReady, _retrying, _throttled, _Unverified)


#: instance states that will never become ``running`` (give up at once)
DEAD_STATES = ("failed", "stopped", "terminated", "terminating")


# --------------------------------------------------------------------------------------------------- recorder
class LedgerRecorder:
    """:class:`broker.core.provider.Recorder` backed by the ledger: adapters call it around each create.

    ``created_ids`` lists the ledger resource ids recorded through this recorder (for cleanup on failure).
    """

    def __init__(self, ledger: Ledger, run_id: str, provider: str, deadline: datetime | None, actor: str = "cli",
                 progress: Progress | None = None):
        self.ledger = ledger
        self.run_id = run_id
        self.provider = provider
        self.deadline = deadline
        self.actor = actor
        self.progress = progress
        self.created_ids: list[str] = []

    @property
    def installation_id(self) -> str:
        return self.ledger.installation_id

    def intent(self, kind: str, name: str, *, region: str | None = None, zone: str | None = None,
               usd_per_hour: float = 0.0, attrs: dict[str, Any] | None = None) -> str:
        res = self.ledger.record_intent(self.run_id, self.provider, kind, name, region=region, zone=zone,
                                        usd_per_hour=usd_per_hour, deadline=self.deadline, attrs=attrs,
                                        actor=self.actor)
        self.created_ids.append(res.id)
        return res.id

    def created(self, resource_id: str, provider_id: str, **attrs: Any) -> None:
        self.ledger.mark_created(resource_id, provider_id, state="running", actor=self.actor, **attrs)

    def failed(self, resource_id: str, error: str) -> None:
        self.ledger.update_resource(resource_id, state="terminated", error=error, terminated_by=self.actor,
                                    actor=self.actor, message=f"create failed, nothing exists: {error}")

    def event(self, message: str) -> None:
        self.ledger.event(self.run_id, self.actor, "progress", message)
        if self.progress:
            self.progress(message)


# --------------------------------------------------------------------------------------------------- attempts
@dataclass
class Attempt:
    """One option tried: what, the outcome (``ok`` | ``skipped`` | ``failed``) and why."""

    option: str
    provider: str
    outcome: str
    reason: str = ""


@dataclass
class _Failover:
    attempts: list[Attempt] = field(default_factory=list)
    quota_hints: list[str] = field(default_factory=list)
    skip_providers: dict[str, str] = field(default_factory=dict)  # provider -> why
    skip_regions: dict[tuple[str, str | None], str] = field(default_factory=dict)  # (provider, region) -> why
    #: (provider, region, limit name or None = any, zone/AD or None = the whole region) -> why
    quota_blocked: dict[tuple[str, str | None, str | None, str | None], str] = field(default_factory=dict)
    no_capacity: dict[tuple, str] = field(default_factory=dict)  # (provider, region, zone, type) -> why
    plan_failures: int = 0  # failures that mean "this option cannot be had now" (quota, capacity, gone, not ready)
    last_error: ProviderError | None = None

    def skip_reason(self, opt: PlanOption) -> str | None:
        if opt.provider in self.skip_providers:
            return self.skip_providers[opt.provider]
        for o in opt.offers:
            if (opt.provider, o.region) in self.skip_regions:
                return self.skip_regions[(opt.provider, o.region)]
            for (prov, region, limit, zone), why in self.quota_blocked.items():
                if prov != opt.provider or region != o.region or (zone is not None and o.zone != zone):
                    continue
                if limit is None or limit in _limits_counted(opt.provider, o):
                    return why
            if _cap_key(opt.provider, o) in self.no_capacity:
                return self.no_capacity[_cap_key(opt.provider, o)]
        return None


def _cap_key(provider: str, o: Offer) -> tuple:
    return (provider, o.region, o.zone, o.instance_type)


def _limits_counted(provider: str, o: Offer) -> tuple[str, ...]:
    """Every limit an instance of ``o`` counts (its GPU limit and, where the adapter says so, a CPU limit)."""
    from broker.plan.quota import limits_counted, spot_offer

    return limits_counted(provider, o.instance_type, spot=spot_offer(o))


def _quota_scope(opt: PlanOption, e: QuotaError) -> tuple[tuple[str, str | None, str | None, str | None], str]:
    """The scope a QuotaError blocks (key of ``_Failover.quota_blocked``) and its words."""
    from broker.plan.quota import limit_for, spot_offer

    o = opt.offers[0]
    ref = limit_for(opt.provider, o.instance_type, spot=spot_offer(o))
    limit = getattr(e, "limit_name", None) or (ref.name if ref else None)
    zone = getattr(e, "scope", None)
    if zone == o.region:
        zone = None  # a region-wide limit (the adapter names the region as its scope)
    if zone is None and ref is not None and ref.scope_kind == "AD" and limit == ref.name:
        zone = o.zone  # OCI GPU limits are per availability domain: the offer's AD
    where = " ".join(x for x in (o.region, zone) if x) or opt.provider
    what = f"limit {limit}" if limit else "quota"
    if limit is not None and limit not in _limits_counted(opt.provider, o):
        # not a limit the instance counts (a VCN / subnet count): every option of the region needs it,
        # whatever its shape or AD, so none of them is tried (each would build the network again to hit it)
        return (opt.provider, o.region, None, zone), f"{what} exhausted in {opt.provider} {where}"
    return (opt.provider, o.region, limit, zone), f"{what} exhausted in {opt.provider} {where}"


def _quota_advice(opt: PlanOption, e: QuotaError, p: Provider, requirements: Any, say: Progress) -> str:
    """The sentence + ready command for the quota to raise: the new limit is the current limit plus what this
    option needs in the scope minus what is available there (:func:`broker.plan.quota.suggest_limit`).  Limit and use
    come from the error when the adapter read them, else from one ``quotas()`` call; the adapter's hint otherwise."""
    from broker.plan.quota import InstanceSpec, limit_for, request_command, spot_offer, suggest_limit, units_needed

    o = opt.offers[0]
    ref = limit_for(opt.provider, o.instance_type, spot=spot_offer(o))
    limit_name = getattr(e, "limit_name", None) or (ref.name if ref else None)
    zone = getattr(e, "scope", None) or (o.zone if ref is not None and ref.scope_kind == "AD" else None)
    where = zone or o.region or "-"
    base = f"{opt.provider} {where}: {e.message}"
    fallback = base + (f"; {e.hint}" if e.hint else (f"; {opt.next_step}" if opt.next_step else ""))
    if ref is None or limit_name is None or limit_name != ref.name:
        return fallback  # a limit the quota helper does not file (e.g. subnet-count): the adapter's console hint
    simulated = opt.topology in (TopologyKind.simulated, TopologyKind.local)
    hybrid = opt.topology == TopologyKind.hybrid
    n_inst = 1 if simulated else (max(1, opt.nodes - 1) if hybrid else opt.nodes)
    spec = InstanceSpec(opt.provider, o.instance_type, o.gpu_name, o.gpu_count, o.gpu_mem_gib, int(o.vcpus or 0),
                        o.ram_gib, o.usd_per_hour, o.region or "any")
    if ref.unit == "vcpus" and spec.vcpus <= 0:
        return fallback
    need = units_needed(opt.provider, spec, n_inst)
    limit, used = getattr(e, "limit", None), getattr(e, "used", None)
    if limit is None or used is None:
        try:
            reqs = requirements_of(requirements)
            qs = [q for q in p.quotas(reqs, list(opt.offers)) if q.name == limit_name
                  and (zone is None or q.scope in (zone, None)) and (q.region in (o.region, None))]
        except Exception as err:  # noqa: BLE001 - advice only: keep the adapter's hint
            say(f"quota: could not read {limit_name} ({getattr(err, 'message', err)})")
            qs = []
        if not qs:
            return fallback
        limit, used = qs[0].limit, qs[0].used
    unit = "GPUs" if ref.unit == "gpus" else "vCPUs"
    avail = max(0.0, float(limit) - float(used))
    value = suggest_limit(limit, used, need)
    cmd = request_command(opt.provider, limit_name, value, scope=zone, region=o.region)
    return (f"{base}; {opt.summary} needs {need:g} {unit} of {limit_name} in {where}, {avail:g} available "
            f"(limit {float(limit):g}, used {float(used):g}): request {value - float(limit):+g} -> `{cmd}`")


class _StopFailover(Exception):
    def __init__(self, err: ProviderError):
        self.err = err


def _interruptible_attrs(offer: Offer) -> dict[str, Any]:
    """The ledger attrs of an interruptible node (``interruptible``, ``bid_usd_per_hour``,
    ``on_demand_usd_per_hour``: :func:`broker.plan.interruptible.ledger_attrs`); {} for on-demand."""
    if offer.attrs.get("interruptible") is not True:
        return {}
    from broker.plan.interruptible import ledger_attrs

    return ledger_attrs(offer)


def _options(plan: Plan | PlanOption | Iterable[PlanOption]) -> list[PlanOption]:
    if isinstance(plan, Plan):
        return [o for o in plan.options if o.valid]
    if isinstance(plan, PlanOption):
        return [plan]
    return list(plan)


@dataclass
class _Provisioning:
    """One call of :func:`provision`: the run, its ledger, how to speak (``say`` also writes the ledger's event log;
    ``render`` only shows), the node settings every create uses, the adapters asked so far and the networks made
    (``(provider, region, topology) -> (network, ledger ids of its objects)``)."""

    run: Run
    ledger: Ledger
    requirements: Any
    render: Progress
    actor: str
    ready_timeout_s: float
    poll_s: float
    ssh_public_key: str | None
    ssh_key_path: str | None
    image: str | None
    onstart: str | None
    transient_attempts: int
    retry_wait_s: float
    terminate_timeout_s: float
    idle_minutes: float | None
    node_onstart: Callable[[int], str | None] | None
    ingress: list[Ingress] | None
    cache: dict[str, Provider]
    disk_gib: float = 40.0
    #: called once, when the first machine has been created and broker starts waiting for it to run
    while_waiting: Callable[[], None] | None = None
    networks: dict[tuple[str, str | None, str], tuple[dict[str, Any], list[str]]] = field(default_factory=dict)

    def say(self, msg: str) -> None:
        self.ledger.event(self.run.id, self.actor, "provision", msg)
        self.render(msg)

    def prov(self, name: str) -> Provider:
        """The adapter ``name`` (given, or from the registry); raises NotSupported when it or its SDK is missing."""
        from broker.providers import get_provider

        if name not in self.cache:
            try:
                self.cache[name] = get_provider(name)
            except (ImportError, BadInput) as e:  # adapter or its SDK missing: that provider is unusable
                from broker.core.install import install_hint

                raise NotSupported(name, "load adapter", str(e),
                                   hint=f"install broker's '{name}' extra: {install_hint(name)}") from None
        return self.cache[name]

    def ensure_key(self) -> None:
        """A fresh ed25519 key in ``<run_dir>/ssh`` unless the caller gave one."""
        if self.ssh_public_key is not None:
            return
        from broker.core import sshkeys
        from broker.core.config import runs_dir

        run = self.run
        kp = sshkeys.generate(Path(run.run_dir) if run.run_dir else runs_dir() / run.id, comment=f"broker-{run.id}")
        self.ssh_public_key, self.ssh_key_path = kp.public_key, str(kp.private_key_path)
        self.say(f"ssh key {kp.fingerprint} in {kp.private_key_path}")

    def drop_networks(self, keep: tuple | None) -> None:
        """Delete the networks of the options that were not kept (``keep``: the one the cluster uses), newest
        object first; one an instance of unknown fate may still sit in is left to ``broker down``."""
        run, ledger = self.run, self.ledger
        for key, (_net, ids) in list(self.networks.items()):
            if key == keep:
                continue
            busy = [r for r in ledger.resources(run.id, live_only=True) if r.provider == key[0]
                    and r.kind == "instance" and not r.provider_id and r.region == key[1]]
            if busy:  # e.g. an `unknown` create may sit in the subnet: teardown_run deletes them in order later
                self.say(f"keeping the {key[0]} network of this run while {busy[0].name} ({busy[0].state}) may "
                         f"live; `broker down {run.id}` deletes it after the instance")
                self.networks.pop(key)
                continue
            for rid in reversed(ids):
                res = ledger.resource(rid)
                if res is not None and res.live:
                    from broker.money.teardown import terminate_resource

                    if not terminate_resource(ledger, res, self.actor, provider=self.prov(res.provider),
                                              confirm_timeout_s=self.terminate_timeout_s, poll_s=self.poll_s,
                                              say=self.say):
                        self.say(f"could not delete {res.kind} {res.provider_id or res.name} yet; `broker down "
                                 f"{run.id}` retries it")
            self.networks.pop(key)


def provision(plan: Plan | PlanOption | Iterable[PlanOption], run: Run, requirements: Any, ledger: Ledger, *,
              providers: dict[str, Provider] | None = None, progress: Progress | None = None,
              ready_timeout_s: float = 900.0, poll_s: float = 5.0, ssh_public_key: str | None = None,
              ssh_key_path: str | None = None, image: str | None = None, onstart: str | None = None,
              transient_attempts: int = 4, retry_wait_s: float = 2.0, terminate_timeout_s: float = 600.0,
              actor: str = "cli", idle_minutes: float | None = None,
              node_onstart: Callable[[int], str | None] | None = None,
              ingress: list[Ingress] | None = None,
              while_waiting: Callable[[], None] | None = None) -> Cluster:
    """Create the machines of the first option that works; returns the ready cluster.

    ``plan``: a Plan (its valid ``options`` in rank order), one PlanOption or a ranked list.  ``run``: the ledger
    run (id, hard ``deadline``, ``run_dir`` where the SSH key goes).  ``requirements``: a Recipe or Requirements
    (``disk_gib``, ``image``, ``idle_minutes`` are read when present; ``idle_minutes`` given here wins: it goes to
    every NodeRequest so the adapter arms the node-side idle stop).  ``providers``: adapters by name (default: the registry).
    ``node_onstart(node_rank)``: extra boot lines for one node, after ``onstart`` (a hybrid run's WireGuard
    config of that VM); ``ingress``: inbound rules opened on the run's network right after bootstrap
    (:meth:`Provider.open_ingress`, e.g. the WireGuard UDP port from the caller's address).  A ``hybrid`` option
    rents ``nodes - 1`` instances (node 0 is this machine): their ranks, tags and ``node_index`` are 1..N-1.
    ``progress(step)`` receives one line per step.  ``ready_timeout_s``/``poll_s``: seconds (``poll_s``: the
    longest gap between readiness polls; the gaps are a fifth of the time waited, from 0.25 s: :func:`poll_delay_s`).  A fresh ed25519 key
    is generated in ``<run_dir>/ssh`` unless ``ssh_public_key`` is given.  ``while_waiting()`` is called once, after
    the first create and before the first readiness poll (the caller's own preparation, such as importing what it
    needs next, while the machine boots); what it raises is not caught.

    Raises NoValidPlan (exit 3) when every option failed or was skipped (the message lists each attempt and the
    quotas to raise); ProviderError (exit 4) when a half-created resource could not be terminated (failover stops;
    the message names the resource and says to run ``broker down <run>``).
    """
    options = _options(plan)
    if not options:
        raise NoValidPlan("no plan option to provision", hint="`broker plan RECIPE` shows why every option was rejected")
    job = _Provisioning(
        run=run, ledger=ledger, requirements=requirements, render=progress or (lambda _s: None), actor=actor,
        ready_timeout_s=ready_timeout_s, poll_s=poll_s, ssh_public_key=ssh_public_key, ssh_key_path=ssh_key_path,
        image=image or getattr(requirements, "image", None), onstart=onstart, transient_attempts=transient_attempts,
        retry_wait_s=retry_wait_s, terminate_timeout_s=terminate_timeout_s,
        idle_minutes=getattr(requirements, "idle_minutes", None) if idle_minutes is None else idle_minutes,
        node_onstart=node_onstart, ingress=ingress, cache=dict(providers or {}),
        disk_gib=float(getattr(requirements, "disk_gib", 40.0) or 40.0), while_waiting=while_waiting)
    job.ensure_key()
    fo = _Failover()
    for n, opt in enumerate(options, 1):
        label = f"option {n}/{len(options)}: {opt.topology.value} {opt.summary} on {opt.provider} " \
                f"({usd(opt.usd_per_hour, up_to=4)}/h)"
        why = fo.skip_reason(opt)
        if why:
            fo.attempts.append(Attempt(label, opt.provider, "skipped", why))
            job.say(f"skip {label}: {why}")
            continue
        check_clock(ledger, run, f"trying {label}")
        job.say(f"try {label}")
        p: Provider | None = None
        try:
            p = job.prov(opt.provider)
            cluster = _attempt(opt, p, job)
        except _Unverified as e:
            fo.attempts.append(Attempt(label, opt.provider, "failed", e.message))
            fo.last_error = e
            fo.skip_providers[opt.provider] = (f"an ambiguous create on {opt.provider} could not be verified: no "
                                               f"further create on {opt.provider} in this run")
            job.say(f"{e.message}; skipping {opt.provider} for this run")
            continue
        except _StopFailover as stop:
            fo.attempts.append(Attempt(label, opt.provider, "failed", stop.err.message))
            ledger.event(run.id, actor, "failover-stopped", stop.err.message)
            raise stop.err from None
        except ProviderError as e:
            _learn_from_failure(fo, job, opt, label, e, p)
            continue
        fo.attempts.append(Attempt(label, opt.provider, "ok"))
        job.drop_networks(keep=(opt.provider, opt.offers[0].region if opt.offers else None, opt.topology.value))
        cluster.ssh_key_path = job.ssh_key_path
        if run.run_dir:
            cluster.known_hosts_path = str(Path(run.run_dir) / "ssh" / "known_hosts")
        job.say(f"ready: {len(cluster.nodes)} node(s), master {cluster.master_addr}")
        return cluster
    job.drop_networks(keep=None)
    raise _nothing_provisioned(fo)


def _learn_from_failure(fo: _Failover, job: _Provisioning, opt: PlanOption, label: str, e: ProviderError,
                        p: Provider | None) -> None:
    """Record a failed option and what it rules out for the options after it: a quota exhausted for its limit
    and scope, no capacity in its zones, a provider that is unusable (auth, SDK) or keeps throttling."""
    reason = e.message + (f" ({e.hint})" if e.hint else "")
    fo.attempts.append(Attempt(label, opt.provider, "failed", reason))
    fo.last_error = e
    if isinstance(e, (QuotaError, CapacityError, OfferGone, _NeverReady)):
        fo.plan_failures += 1
    if isinstance(e, QuotaError):
        qkey, qwhy = _quota_scope(opt, e)
        fo.quota_blocked[qkey] = qwhy
        advice = _quota_advice(opt, e, p, job.requirements, job.say)  # type: ignore[arg-type]
        if not (e.hint or opt.next_step or "`" in advice):
            advice += f"; raise the {opt.provider} service limit for {opt.summary}"
        fo.quota_hints.append(advice)
        job.say(f"quota: {e.message}; skipping the options {qwhy.split(' exhausted')[0]} covers there")
    elif isinstance(e, CapacityError):
        for o in opt.offers:
            fo.no_capacity[_cap_key(opt.provider, o)] = f"no capacity for {o.instance_type} in {o.zone or o.region}"
        job.say(f"capacity: {e.message}; trying the next zone / region")
    elif isinstance(e, (AuthError, NotSupported)):
        fo.skip_providers[opt.provider] = f"{opt.provider} unusable: {e.message}"
        job.say(f"{opt.provider} unusable ({e.message}); skipping it" + (f" -> {e.hint}" if e.hint else ""))
    elif isinstance(e, (OfferGone, _NeverReady)):
        job.say(f"{e.message}; trying the next offer")
    elif _throttled(e):  # the API's rate limit is the account's, not the zone's: another AD would be too
        fo.skip_providers[opt.provider] = f"{opt.provider} keeps throttling creates (429): retry later"
        job.say(f"{e.message}; {opt.provider} still throttles after the retries: no more creates there now")
    else:
        job.say(f"failed: {e.message}; trying the next option")


def _nothing_provisioned(fo: _Failover) -> BrokerError:
    """The error once every option failed or was skipped: each attempt in a line, and the quotas to raise.
    ProviderError (exit 4) when only the providers failed (auth, outage), else NoValidPlan (exit 3)."""
    lines = _attempt_lines(fo.attempts)
    hints = list(dict.fromkeys(fo.quota_hints))  # one sentence per limit, not one per option it blocked
    hint = "; ".join(hints) if hints else "try later, widen the GPU list or raise the budget"
    if hints:
        fileable = any("`broker quota request" in h for h in hints)
        hint = ("raise these quotas (`broker quota request ...`): " if fileable else "raise these limits: ") + hint
    msg = "could not provision any option of the plan:\n" + "\n".join(lines)
    if fo.plan_failures == 0 and fo.last_error is not None:  # only provider failures (auth, outage): exit 4
        e = fo.last_error
        return ProviderError(e.provider, "provision", msg, hint=e.hint or "check `broker status` and retry later")
    return NoValidPlan(msg, hint=hint)


def _attempt_lines(attempts: list[Attempt]) -> list[str]:
    """One line per option tried; a reason already given for an earlier option is not repeated (the same
    rejection for every option of a provider reads once, then "same as option N")."""
    first: dict[tuple[str, str], int] = {}
    out = []
    for n, a in enumerate(attempts, 1):
        key = (a.outcome, a.reason)
        if a.reason and key in first:
            out.append(f"  - {a.option}: {a.outcome}: same as {attempts[first[key] - 1].option.split(':')[0]}")
            continue
        first.setdefault(key, n)
        out.append(f"  - {a.option}: {a.outcome}" + (f": {a.reason}" if a.reason else ""))
    return out


def _attempt(opt: PlanOption, p: Provider, job: _Provisioning) -> Cluster:
    """One option: bootstrap, create every instance ledger-first, wait until running.  On a ProviderError every
    instance created here (and the network objects of a failed bootstrap) is terminated before it propagates."""
    if not opt.offers:
        raise ProviderError(opt.provider, "provision", "the plan option has no offer")
    simulated = opt.topology in (TopologyKind.simulated, TopologyKind.local)
    hybrid = opt.topology == TopologyKind.hybrid
    n_inst = 1 if simulated else (max(1, opt.nodes - 1) if hybrid else opt.nodes)
    first_rank = 1 if hybrid else 0  # hybrid: node 0 is this machine, the instances are ranks 1..N-1
    offers = [opt.offers[i] if i < len(opt.offers) else opt.offers[-1] for i in range(n_inst)]
    key = (opt.provider, offers[0].region, opt.topology.value)
    mine: list[str] = []  # ledger ids this attempt must clean up on failure
    run, ledger = job.run, job.ledger
    try:
        _network(opt, p, job, offers, key, mine)
        inst_ids = [_create_node(opt, p, job, offer, k + first_rank, key, mine) for k, offer in enumerate(offers)]
        infos: list[InstanceInfo] = []
        if job.while_waiting is not None:
            hook, job.while_waiting = job.while_waiting, None
            hook()
        for rid in inst_ids:
            infos.append(_wait_ready(p, ledger, ledger.resource(rid), run, say=job.say, actor=job.actor,
                                     timeout_s=job.ready_timeout_s, poll_s=job.poll_s))
            # the run's key through the provider's key API too (Vast: POST /instances/{id}/ssh/), not only from
            # the boot script: a container whose onstart ran late or not at all still accepts it
            pid_ready = ledger.resource(rid).provider_id
            _retrying(p.prepare_access, pid_ready, job.ssh_public_key, attempts=job.transient_attempts,
                      wait_s=job.retry_wait_s, say=job.say, what=f"{p.name} prepare_access")
        return _cluster(opt, p, run, inst_ids, infos, simulated)
    except ProviderError as e:
        _clean_up_attempt(p, job, mine, e)
        raise
    except Exception as e:  # a bug or an unexpected error: still leave nothing behind
        _clean_up_attempt(p, job, mine, e)
        raise


def _network(opt: PlanOption, p: Provider, job: _Provisioning, offers: list[Offer], key: tuple,
             mine: list[str]) -> None:
    """The option's network prerequisites (``bootstrap``, once per provider, region and topology in a run; the
    objects of a failed one join ``mine`` for the clean-up) and the caller's ingress rules."""
    if key in job.networks:
        return
    rec = LedgerRecorder(job.ledger, job.run.id, p.name, job.run.deadline, job.actor, progress=job.render)
    job.say(f"{p.name}: bootstrap ({opt.topology.value}, {key[1]})")
    try:
        net = _retrying(p.bootstrap, job.run.id, offers, opt.topology.value, rec, attempts=job.transient_attempts,
                        wait_s=job.retry_wait_s, say=job.say, what=f"{p.name} bootstrap")
    except BaseException:
        mine.extend(rec.created_ids)
        raise
    job.networks[key] = (net or {}, list(rec.created_ids))
    if job.ingress:
        _retrying(p.open_ingress, job.networks[key][0], list(job.ingress), rec, attempts=job.transient_attempts,
                  wait_s=job.retry_wait_s, say=job.say, what=f"{p.name} open_ingress")


def _create_node(opt: PlanOption, p: Provider, job: _Provisioning, offer: Offer, i: int, key: tuple,
                 mine: list[str]) -> str:
    """Node ``i`` on ``offer``: the ledger intent (rates, storage, the dead-man grace), then the verified create;
    returns the ledger id (also appended to ``mine``).  A create that failed with nothing created ends its row."""
    run, ledger, actor = job.run, job.ledger, job.actor
    name = f"broker-{run.id}-n{i}"
    grace = deadman_grace_s(_max_hours(run))
    check_clock(ledger, run, f"renting {offer.instance_type} for node {i}")
    # storage bills while the instance exists (Vast storage_cost is USD per GiB-month; 730 h a month)
    storage = job.disk_gib * offer.storage_usd_per_gib_month / HOURS_PER_MONTH
    res = ledger.record_intent(
        run.id, p.name, "instance", name, region=offer.region, zone=offer.zone,
        usd_per_hour=offer.usd_per_hour + storage, deadline=run.deadline, actor=actor,
        attrs={"offer_key": offer.key, "offer_id": offer.offer_id, "instance_type": offer.instance_type,
               "zone": offer.zone, "node_index": i, "topology": opt.topology.value,
               "gpu_count": offer.gpu_count, "compute_usd_per_hour": offer.usd_per_hour,
               "storage_usd_per_hour": round(storage, 6), "disk_gib": job.disk_gib,
               "min_billed_seconds": offer.min_billed_seconds, "deadman_grace_s": grace,
               **_interruptible_attrs(offer),
               # per-GB bandwidth rates, billed when the run has moved its bytes (cost.charge_transfer)
               **{k: v for k, v in offer.attrs.items() if k in ("transfer_in_usd_per_gb",
                                                                "transfer_out_usd_per_gb")}})
    mine.append(res.id)
    job.say(f"{p.name}: create {offer.instance_type} in {offer.zone or offer.region or '-'} as {name} "
            f"({usd(offer.usd_per_hour, up_to=4)}/h)")
    req = NodeRequest(run_id=run.id, node_index=i, name=name, offer=offer, ssh_public_key=job.ssh_public_key,
                      grace_seconds=grace,
                      client_token=res.id, disk_gib=job.disk_gib, image=job.image, deadline=run.deadline,
                      network=dict(job.networks[key][0]), tags={RUN_TAG: run.id, INSTALL_TAG: ledger.installation_id},
                      installation_id=ledger.installation_id,
                      onstart=_join_boot(job.onstart, job.node_onstart(i) if job.node_onstart else None),
                      idle_minutes=job.idle_minutes)
    try:
        pid = _create_verified(p, req, res, ledger, attempts=job.transient_attempts, wait_s=job.retry_wait_s,
                               say=job.say, actor=actor,
                               clock=lambda: check_clock(ledger, run, f"creating {name} again"))
    except _Unverified:
        raise
    except ProviderError as e:
        # the create failed and nothing exists (proven by a list, or a definite error such as capacity):
        # the row ends here, no list is needed to prove it
        ledger.update_resource(res.id, state="terminated", error=e.message, terminated_by=actor,
                               actor=actor, attrs={"never_created": True},
                               message=f"create failed, nothing exists: {e.message}")
        raise
    if ledger.resource(res.id).provider_id != pid:  # adopted rows already carry their id
        ledger.mark_created(res.id, pid, actor=actor)
    job.say(f"{p.name}: created {pid}")
    return res.id


def _clean_up_attempt(p: Provider, job: _Provisioning, mine: list[str], err: BaseException) -> None:
    """Terminate what a failed attempt created (``mine``, newest first).  Raises _StopFailover when one of them
    could not be terminated: no second machine is rented while this one may still bill."""
    from broker.money.teardown import terminate_resource

    ledger, run = job.ledger, job.run
    for rid in reversed(mine):
        res = ledger.resource(rid)
        if res is None or not res.live:
            continue
        ok = terminate_resource(ledger, res, job.actor, provider=p, confirm_timeout_s=job.terminate_timeout_s,
                                poll_s=job.poll_s, say=job.say)
        if not ok:
            res = ledger.resource(rid) or res
            if res.state == "unknown" and not res.provider_id:
                continue  # an unverified create: no more creates on this provider; a later list resolves it
            what = f"{res.provider} {res.kind} {res.provider_id or res.name} (ledger {res.id})"
            raise _StopFailover(ProviderError(
                res.provider, "terminate",
                f"after a failed attempt ({getattr(err, 'message', err)}) {what} could not be terminated and "
                f"is still live: {(res.error or 'not confirmed gone').splitlines()[0]}; stopped failing over "
                "so no second machine is rented while this one may still bill",
                hint=f"run `broker down {run.id}` (retries the terminate); if it keeps failing, delete "
                     f"{res.provider_id or res.name} in the {res.provider} console"))


def _max_hours(run: Run) -> float | None:
    """The run's length in hours: its deadline minus its start (the recipe's ``max_hours``), None without one."""
    start = run.started_at or run.created_at
    if run.deadline is None or start is None:
        return None
    return max(0.0, (run.deadline - start).total_seconds() / 3600.0)


def _join_boot(*parts: str | None) -> str | None:
    """Boot lines joined (None when there are none)."""
    text = "\n".join(p.rstrip() for p in parts if p and p.strip())
    return text + "\n" if text else None


#: the shortest gap between two readiness polls, seconds
POLL_MIN_S = 0.25
#: the gap between readiness polls as a fraction of the time already waited
POLL_FRACTION = 0.2


def poll_delay_s(waited_s: float, poll_s: float) -> float:
    """Seconds until the next readiness poll after ``waited_s`` seconds of waiting: a fifth of the time waited,
    at least :data:`POLL_MIN_S`, at most ``poll_s``.

    A machine bills from the moment it runs, and the job starts only once broker sees it running, so the time
    lost after the boot is what matters: here it is at most a fifth of the wait (0.25 s of a 2 s container start,
    1 s of a 5 s one) instead of a fixed gap, while a slow boot still backs off to one poll per ``poll_s`` and the
    provider's API sees about 25 polls in the first minute."""
    return min(poll_s, max(POLL_MIN_S, POLL_FRACTION * max(0.0, waited_s)))


def _wait_ready(p: Provider, ledger: Ledger, res: Resource | None, run: Run, *, say: Progress, actor: str,
                timeout_s: float, poll_s: float) -> InstanceInfo:
    """Describe ``res`` until ``running``; bounded by ``timeout_s`` and by the run's clock (:func:`check_clock`:
    the deadline, the budget, the watchdog ending the run raise :class:`ClockOut`, never "try the next offer")."""
    import time

    assert res is not None and res.provider_id
    t0 = time.monotonic()
    last = None
    while True:
        left = check_clock(ledger, run, f"{res.provider_id} became running")
        cur = ledger.resource(res.id)
        if cur is not None and cur.state in ("terminating", "terminated") and cur.terminated_by not in (None, actor):
            check_clock(ledger, run, f"{res.provider_id} became running")  # the watchdog ended the run: ClockOut
            raise _NeverReady(p.name, "describe_instance", f"{res.provider_id} was terminated by "
                              f"{cur.terminated_by} while broker waited for it ({cur.error or 'no reason given'})")
        try:
            info = p.describe_instance(res.provider_id, region=res.region)
        except TransientError as e:
            info = None
            say(f"{p.name}: describe {res.provider_id}: {e.message}; polling again")
        if info is not None:
            if info.state != last:
                say(f"{p.name}: {res.provider_id} is {info.raw_state or info.state}")
                last = info.state
            if info.usd_per_hour is not None and info.state not in DEAD_STATES:
                res = record_reported_rate(p, ledger, res, run, info.usd_per_hour, say=say, actor=actor)
            elif info.rate_unreadable and info.state not in DEAD_STATES:  # unknown, never the planned price
                res = record_unknown_rate(p, ledger, res, run, info.rate_unreadable, say=say, actor=actor)
            if info.state == "running":
                from broker.core.answers import instance_answer_problem

                bad = instance_answer_problem(info, res.provider_id)
                if bad is not None:  # never recorded: the machine is released and the next offer tried
                    raise _NeverReady(p.name, "describe_instance", f"{res.provider_id} is running, but the "
                                      f"provider {bad}; broker does not record or connect to it")
                ledger.update_resource(res.id, state="running", actor=actor, attrs={
                    k: v for k, v in (("public_ip", info.public_ip), ("private_ip", info.private_ip),
                                      ("ssh_host", info.ssh_host), ("ssh_port", info.ssh_port)) if v is not None},
                    message=f"{res.provider_id} running")
                return info
            if info.state in DEAD_STATES:
                check_clock(ledger, run, f"{res.provider_id} became running")  # gone because the run ended?
                raise _NeverReady(p.name, "describe_instance",
                                  f"{res.provider_id} became {info.raw_state or info.state} instead of running"
                                  + (f" ({info.message})" if info.message else ""))
        if time.monotonic() - t0 > timeout_s:
            raise _NeverReady(p.name, "describe_instance",
                              f"{res.provider_id} not running after {timeout_s:.0f} s (still {last or 'unknown'})")
        time.sleep(max(0.0, min(poll_delay_s(time.monotonic() - t0, poll_s), left)))


def _cluster(opt: PlanOption, p: Provider, run: Run, inst_ids: list[str], infos: list[InstanceInfo],
             simulated: bool) -> Cluster:
    nodes: list[ClusterNode] = []
    g = opt.gpus_per_node
    if simulated:
        info = infos[0]
        for i in range(opt.nodes):
            nodes.append(ClusterNode(node_rank=i, host=info.ssh_host or info.public_ip or "127.0.0.1",
                                     port=info.ssh_port, user=info.ssh_user, private_ip="127.0.0.1",
                                     gpu_indices=[str(j) for j in range(i * g, (i + 1) * g)],
                                     resource_id=inst_ids[0]))
    else:
        for i, info in enumerate(infos):
            ip = info.private_ip or info.public_ip
            if not ip:
                raise ProviderError(p.name, "describe_instance", f"{info.provider_id} reports no private IP",
                                    hint=f"`broker down {run.id}` and report this provider response")
            nodes.append(ClusterNode(node_rank=i, host=info.ssh_host or info.public_ip or ip, port=info.ssh_port,
                                     user=info.ssh_user, private_ip=ip, resource_id=inst_ids[i]))
    workroot = node_workroot(nodes[0].user, p.node_workroot)
    return Cluster(run_id=run.id, provider=p.name, topology=opt.topology, nodes=nodes, workroot=workroot,
                   local_exec=bool(p.local_exec))


def requirements_of(recipe_or_req: Any) -> Requirements:
    """Requirements from a Recipe (``.requirements()``) or Requirements itself."""
    return recipe_or_req if isinstance(recipe_or_req, Requirements) else recipe_or_req.requirements()
