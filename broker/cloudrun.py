"""``broker run`` on rented machines: new run row -> provision (ledger-first, failover) -> job -> teardown.

:func:`run_on_cloud` tears the run down in a ``finally`` (actor ``cli``), also after a failed job, a
provisioning error or Ctrl-C; only a hard kill (SIGKILL, power loss) skips it, and then the ledger rows and the
run tag on every created resource let ``broker down`` / ``broker reconcile`` / the watchdog finish the job.

Idle stop (recipe ``idle_minutes``, issue 6 item 4): when the job ran to an end (succeeded or failed; not Ctrl-C,
not the hard deadline, not a provisioning failure) and ``keep_when_idle`` (the caller has a watchdog), the nodes
are *kept* for inspection instead: every live instance gets ``attrs["idle_minutes"]``, the run is marked ended
with the job's status, and :class:`CloudRunOutcome` says ``kept_until_idle``.  The watchdog terminates them
``idle_minutes`` after the job ended (or at the deadline / budget, whichever comes first), the node-side idle watch
(armed by the adapter from ``NodeRequest.idle_minutes``) once the job has ended and no SSH session was seen for
``idle_minutes``; ``broker down RUN`` ends them at once.

Jobs on ``local_exec`` clusters (the ``fake`` provider, whose "instances" are this machine) run as local processes;
every other cluster runs over SSH with a network preflight first (:func:`broker.remote.run_remote`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from broker.launch import LocalLaunchSpec, RunResult, run_local
from broker.ledger import Ledger
from broker.model import Cluster, Plan, PlanOption, Requirements, Resource, Run, utcnow
from broker.provider import NoValidPlan, Provider
from broker.recipe import Recipe


@dataclass
class CloudRunOutcome:
    """What :func:`run_on_cloud` ended with.  ``left``: resources still live after teardown (empty = none);
    ``cost_usd``: the run's spend per the ledger (see :func:`broker.provision.spent_usd`).
    ``kept_until_idle``: the nodes were kept (recipe ``idle_minutes``), not torn down; ``kept`` lists them."""

    run: Run
    result: RunResult | None
    cluster: Cluster | None
    left: list[Resource] = field(default_factory=list)
    cost_usd: float = 0.0
    kept_until_idle: bool = False
    kept: list[Resource] = field(default_factory=list)


def rank_options(provider: Provider, req: Requirements) -> list[PlanOption]:
    """The valid plan options on one provider, ranked by the planner (:func:`broker.planner.plan`) from the
    provider's offers, quotas and capacity."""
    from broker.planner import plan

    offers = provider.offers(req)
    p = plan(req, offers, provider.quotas(req, offers), provider.capacity(offers), now=utcnow())
    return [o for o in p.options if o.valid]


def cluster_spec(recipe: Recipe, cluster: Cluster, run: Run) -> LocalLaunchSpec:
    """The launch spec for a ``local_exec`` cluster: each node's CUDA_VISIBLE_DEVICES from its gpu_indices."""
    assert recipe.workdir is not None
    node_envs = []
    for n in cluster.nodes:
        env = {"BROKER_RUN_ID": run.id, "BROKER_MASTER_ADDR": cluster.master_addr}
        if n.gpu_indices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(n.gpu_indices)
        env.update(n.env)
        node_envs.append(env)
    deadline_s = recipe.max_hours * 3600
    if run.deadline:
        deadline_s = max(1.0, (run.deadline - utcnow()).total_seconds())
    return LocalLaunchSpec(script_rel=str(recipe.script.relative_to(recipe.workdir)), args=list(recipe.args),
                           workdir=recipe.workdir, nnodes=len(cluster.nodes), nproc_per_node=recipe.gpus_per_node,
                           env=dict(recipe.env), node_envs=node_envs, setup=list(recipe.setup),
                           expect=list(recipe.expect), deadline_s=deadline_s)


def run_on_cloud(recipe: Recipe, plan_options: Plan | PlanOption | Iterable[PlanOption], ledger: Ledger,
                 echo: Callable[[str], None] | None, *, progress: Callable[[str], None] | None = None,
                 on_start: Callable[[Run], None] | None = None, providers: dict[str, Provider] | None = None,
                 ready_timeout_s: float = 900.0, poll_s: float = 5.0, actor: str = "cli",
                 keep_when_idle: bool = True, **provision_kw: Any) -> CloudRunOutcome:
    """Run ``recipe`` on the first option of ``plan_options`` that provisions; tears down, except that with
    recipe ``idle_minutes`` and ``keep_when_idle`` (False: e.g. no watchdog would end them) the nodes of a job that
    ran to an end are kept until idle (see the module docstring).

    Raises what :func:`broker.provision.provision` raises (NoValidPlan, ProviderError), *after* the teardown ran.
    """
    from broker.orchestrate import end_run, new_run
    from broker.provision import _options, provision, run_cost
    from broker.teardown import teardown_run

    options = _options(plan_options)
    if not options:
        raise NoValidPlan(f"no plan option for {recipe.name}", hint="`broker plan` shows why each was rejected")
    first = options[0]
    run = new_run(ledger, recipe, provider=first.provider, topology=first.topology.value,
                  plan={"options": [o.model_dump(mode="json") for o in options]})
    ledger.update_run(run.id, status="provisioning")
    ledger.event(run.id, actor, "start", f"{len(options)} ranked option(s); first {first.summary} on {first.provider}")
    if on_start:
        on_start(run)
    result: RunResult | None = None
    cluster: Cluster | None = None
    status, message = "failed", None
    left: list[Resource] = []
    kept: list[Resource] = []
    keep = False
    try:
        cluster = provision(options, run, recipe, ledger, providers=providers, progress=progress,
                            ready_timeout_s=ready_timeout_s, poll_s=poll_s, actor=actor, **provision_kw)
        ledger.update_run(run.id, status="running", provider=cluster.provider, topology=cluster.topology.value)
        if progress:
            progress(f"launching {len(cluster.nodes)} node(s) on {cluster.provider}")
        if cluster.local_exec:
            result = run_local(cluster_spec(recipe, cluster, run), Path(run.run_dir or "."), echo=echo)
        else:  # over SSH, preflight first (broker.remote)
            from broker.remote import run_remote

            result = run_remote(cluster, recipe, Path(run.run_dir or "."), echo=echo)
        status, message = result.status, result.reason
        keep = bool(recipe.idle_minutes) and keep_when_idle and status in KEEP_STATUSES
    except KeyboardInterrupt:
        status, message = "interrupted", "interrupted (Ctrl-C) before the job finished"
        raise
    except Exception as e:  # noqa: BLE001 - recorded, then re-raised after teardown
        message = str(e)
        raise
    finally:
        if keep:
            kept = _keep_until_idle(ledger, run, float(recipe.idle_minutes or 0), status, actor)
            message = ((message + "; ") if message else "") + (
                f"{len(kept)} node(s) kept for inspection: idle stop after {recipe.idle_minutes:g} min")
            if progress:
                progress(f"keeping {len(kept)} node(s) for inspection: idle stop after {recipe.idle_minutes:g} min")
        else:
            ledger.update_run(run.id, status="tearing_down")
            if progress:
                progress("tearing down")
            left = teardown_run(ledger, run.id, actor, providers=providers, say=progress, poll_s=min(poll_s, 2.0))
        if left:
            message = ((message + "; ") if message else "") + "still live after teardown: " + ", ".join(
                f"{r.provider} {r.kind} {r.provider_id or r.name}" for r in left) + f" (run `broker down {run.id}`)"
        updated = end_run(ledger, run.id, result, status=status, message=message, actor=actor, pid=os.getpid())
    return CloudRunOutcome(updated, result, cluster, left, run_cost(ledger, run.id), kept_until_idle=keep,
                           kept=kept)


#: Job statuses after which recipe ``idle_minutes`` keeps the nodes (the job ran to an end on its own).
KEEP_STATUSES = ("succeeded", "failed")


def _keep_until_idle(ledger: Ledger, run: Run, idle_minutes: float, status: str, actor: str) -> list[Resource]:
    """Record ``attrs["idle_minutes"]`` on every live instance of ``run`` (the watchdog's idle rule reads it) and
    log why nothing was torn down; returns the kept instances."""
    kept = [r for r in ledger.resources(run.id, live_only=True) if r.kind == "instance"]
    for r in kept:
        ledger.update_resource(r.id, attrs={"idle_minutes": idle_minutes}, actor=actor,
                               message=f"kept for inspection: idle stop after {idle_minutes:g} min")
    ledger.event(run.id, actor, "keep-idle",
                 f"job {status}; recipe idle_minutes={idle_minutes:g}: kept {len(kept)} node(s) instead of tearing "
                 f"down; the watchdog terminates them {idle_minutes:g} min after the job ended (or at the deadline "
                 f"/ budget), `broker down {run.id}` at once")
    return kept
