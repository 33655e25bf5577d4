"""Nodes kept after a run (recipe ``idle_minutes``, ``--keep``): :class:`KeptTarget` runs again on them, and the
helpers that rebuild a cluster, its launch spec and its executor from the ledger.
"""

from __future__ import annotations

from dataclasses import replace as _dc_replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.core.model import utcnow
from broker.core.records import Cluster, Resource, Run
from broker.core.provider import BadInput
from broker.core.recipe import Recipe
from broker.run.runrecord import Context
from broker.core.target import Target
from broker.run.targets import NODE_KINDS

if TYPE_CHECKING:
    from broker.run.executor import Executor
    from broker.run.launch import LocalLaunchSpec
    from broker.money.ledger import Ledger


class KeptTarget(Target):
    """The kept nodes of an earlier run (recipe ``idle_minutes``): ``broker exec RUN RECIPE`` runs another recipe on
    them without provisioning (acquire = the stored cluster; release = nothing, the nodes stay with their run).
    The origin run's idle timer restarts when the job ends."""

    def __init__(self, origin: Run, cluster: Cluster):
        self.origin, self.cluster = origin, cluster
        self.provider, self.topology = cluster.provider, cluster.topology.value

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "kept_from": self.origin.id}

    def kept_from(self) -> str | None:
        return self.origin.id

    def describe(self) -> str:
        return (f"topology {self.topology} on the kept nodes of run {self.origin.id} ({self.provider}), no "
                "provisioning")

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        return self.cluster.model_copy(update={"run_id": run.id})

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        assert cluster is not None
        if len(cluster.nodes) != recipe.nodes:
            raise BadInput(f"run {self.origin.id} kept {len(cluster.nodes)} node(s) but recipe {recipe.name} asks for "
                           f"{recipe.nodes}", hint=f"set nodes: {len(cluster.nodes)} in the recipe")
        return cluster_executor(recipe, run, cluster, ctx)

    @property
    def releases(self) -> bool:
        return True

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        ctx.ledger.update_run(self.origin.id, ended_at=utcnow())  # the watchdog's idle rule counts from here
        ctx.ledger.event(self.origin.id, ctx.actor, "exec", f"run {run.id} used the kept nodes; idle timer restarted")
        return [], []  # the nodes stay with (and are ended through) the origin run


def standing_cluster(run: Run) -> Cluster | None:
    """The cluster a run stood up without a job (``broker netns up``), as its provider reads it from the run's
    folder (:meth:`broker.core.provider.Provider.standing_cluster`); None when the run holds none."""
    from broker.providers import REGISTRY, provider_class

    if not run.run_dir or run.provider not in REGISTRY:
        return None
    return provider_class(run.provider).standing_cluster(run)


def kept_cluster(ledger: "Ledger", run_id: str) -> tuple[Run, Cluster]:
    """The run (id or unique prefix) and its stored cluster, when its nodes are still live (a running run, or a
    kept one).  Raises BadInput saying why not."""
    from broker.core.runfolder import check_cluster, confined_run_dir

    run = ledger.find_run(run_id)
    off = [r for r in ledger.resources(run.id, live_only=True)
           if r.kind in NODE_KINDS and r.state in ("stopping", "stopped", "starting")]
    if off:  # a job "run" on machines that are off would wait for them, then blame the network
        raise BadInput(f"the machines of run {run.id} are stopped ({', '.join(r.provider_id or r.name for r in off)}"
                       f": {', '.join(sorted({r.state for r in off}))})",
                       hint=f"`broker start {run.id}` starts them again (a new address, SSH checked)")
    folder = confined_run_dir(run)  # a ledger row is input: its folder must be <home>/runs/<run id>
    path = folder / "cluster.json"
    stood_up = None if path.exists() else standing_cluster(run)  # `broker netns up`: a cluster with no job
    if stood_up is not None:
        if not [r for r in ledger.resources(run.id, live_only=True) if r.kind in NODE_KINDS]:
            raise BadInput(f"the nodes of netns cluster {run.id} are gone (status {run.status})",
                           hint="`broker netns up 2` stands up a new one")
        return run, check_cluster(stood_up, run, folder)
    if not path.exists() and any(e.get("action") == "clean" for e in ledger.events(run.id, limit=1_000_000)):
        raise BadInput(f"the folder of run {run.id} ({run.run_dir}) was removed by `broker clean`: its cluster "
                       "record and keys are gone, so there are no nodes to reach",
                       hint=f"`broker status {run.id}` still shows what the run did and cost")
    if not path.exists():
        from broker.providers import capability

        here = capability(run.provider, "local_exec")  # its nodes were processes on this machine
        raise BadInput(f"run {run.id} has no nodes to reach ({run.provider}: "
                       f"{'processes on this machine' if here else 'no cluster recorded'})",
                       hint=f"`broker status {run.id}` shows what it did; `broker ssh` and `broker exec` reach "
                            "the nodes of a live or kept run (rented machines, `broker netns up`)")
    live = [r for r in ledger.resources(run.id, live_only=True) if r.kind in NODE_KINDS]
    if not live:
        raise BadInput(f"the nodes of run {run.id} are gone (status {run.status})",
                       hint="set idle_minutes in the recipe to keep the nodes after the job, then `broker run` again")
    try:
        cluster = Cluster.model_validate_json(path.read_text())
    except ValueError as e:
        raise BadInput(f"the cluster record {path} of run {run.id} cannot be read: {str(e).splitlines()[0]}",
                       hint=f"the run's folder was damaged or edited; `broker down {run.id}` still ends its nodes") \
            from None
    return run, check_cluster(cluster, run, folder)


def cluster_spec(recipe: Recipe, cluster: Cluster, run: Run) -> "LocalLaunchSpec":
    """The launch spec for a ``local_exec`` cluster: each node's CUDA_VISIBLE_DEVICES from its gpu_indices."""
    from broker.run.launch import LocalLaunchSpec

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
                           expect=list(recipe.expect), deadline_s=deadline_s, artifacts=list(recipe.artifacts),
                           stall_s=recipe.stall_s, on_stall=recipe.on_stall,
                           checkpoint_dir=recipe.checkpoint_dir, resume_checkpoint=recipe.resume_checkpoint)


def cluster_executor(recipe: Recipe, run: Run, cluster: Cluster, ctx: Context, **ssh: Any) -> "Executor":
    """The executor for an acquired cluster: local processes when its nodes are this machine (``local_exec``: the
    fake cloud), else SSH (``ssh``: SSHExecutor options such as ``ready_timeout_s``)."""
    from broker.money.cost import run_clock

    if cluster.local_exec:
        from broker.run.launch import LocalExecutor

        spec = cluster_spec(recipe, cluster, run)
        left = run_clock(ctx.ledger, run)[0]  # the run's one clock, as below
        if spec.deadline_s is None or left < spec.deadline_s:
            spec = _dc_replace(spec, deadline_s=max(1.0, left))
        return LocalExecutor(spec, Path(run.run_dir or "."), echo=ctx.hooks.echo, say=ctx.hooks.say)
    from broker.run.remote import SSHExecutor

    ex = SSHExecutor(cluster, recipe, Path(run.run_dir or "."), echo=ctx.hooks.echo, say=ctx.hooks.say, **ssh)
    # the job ends on the run's one clock (its deadline or its budget at the rates the ledger holds), not
    # max_hours counted again from now: provisioning already spent part of it
    left = run_clock(ctx.ledger, run)[0]
    if left < ex.deadline_s:
        ex.deadline_s = max(1.0, left)
    return ex
