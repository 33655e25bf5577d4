"""The run layer's own targets (:class:`broker.core.target.Target`): this machine (:class:`LocalTarget`, handed over
by the local adapter's ``run_target``) and what every target shares (keeping nodes until idle).  Paid clouds:
:mod:`broker.run.cloudtarget`; kept nodes: :mod:`broker.run.kept`; emulated hosts (network namespaces):
:mod:`broker.run.targets_emulated`, handed over by the netns adapter; a Slurm partition: :mod:`broker.slurm.target`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.core.records import Cluster, Resource, Run
from broker.core.provider import NoValidPlan
from broker.core.recipe import Recipe
# the contract lives in the core beside Provider.run_target; re-exported for the run layer's users
from broker.core.target import Target  # noqa: F401
from broker.run.runrecord import Context

if TYPE_CHECKING:
    from broker.run.executor import Executor
    from broker.run.launch import LocalLaunchSpec
    from broker.money.ledger import Ledger


def local_spec(recipe: Recipe, local: Any = None) -> "tuple[LocalLaunchSpec, str]":
    """The launch spec for the ``local`` topology and a one-line description of the devices used.

    Raises NoValidPlan when this machine cannot serve the recipe (no GPU and not cpu_ok, too few GPUs...).
    """
    from broker.run.launch import LocalLaunchSpec
    from broker.providers import get_provider

    local = local or get_provider("local")  # through the registry: the run layer imports no adapter
    req = recipe.requirements()
    why = local.why_not(req)
    if why:
        raise NoValidPlan(f"this machine cannot run {recipe.name}: {why}",
                          hint="use --provider with a cloud provider, or allow a CPU logic check (cpu_ok: true)")
    node_envs = [local.node_env(req, i) for i in range(recipe.nodes)]
    if local.uses_gpus(req):
        devices = "; ".join(f"node {i}: CUDA_VISIBLE_DEVICES={e['CUDA_VISIBLE_DEVICES']}" for i, e in enumerate(node_envs))
    else:
        devices = "no GPU used: gloo on CPU (cpu_ok)"
    assert recipe.workdir is not None
    spec = LocalLaunchSpec(script_rel=str(recipe.script.relative_to(recipe.workdir)), args=list(recipe.args),
                           workdir=recipe.workdir, nnodes=recipe.nodes, nproc_per_node=recipe.gpus_per_node,
                           env=dict(recipe.env), node_envs=node_envs, setup=list(recipe.setup),
                           expect=list(recipe.expect), deadline_s=recipe.max_hours * 3600,
                           artifacts=list(recipe.artifacts), stall_s=recipe.stall_s, on_stall=recipe.on_stall,
                           checkpoint_dir=recipe.checkpoint_dir, resume_checkpoint=recipe.resume_checkpoint)
    return spec, devices


class LocalTarget(Target):
    """This machine, free: ``nodes`` simulated nodes as local processes (topology ``local``)."""

    provider, topology = "local", "local"
    runs_here = True

    def __init__(self, recipe: Recipe, local: Any = None):
        self.recipe = recipe
        self.spec, self.devices = local_spec(recipe, local)

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices}

    def prepare(self, ctx: Context) -> None:
        """Say that ``idle_minutes`` keeps nothing here (it was ignored without a word)."""
        if self.recipe.idle_minutes:
            ctx.say(f"note: {self.recipe.idle_words()} is ignored: the nodes of a local run are processes on this "
                    "machine and end with the job (nothing bills while idle); `broker run` again starts them anew")

    def describe(self) -> str:
        return f"topology local (this machine, free); {self.devices}"

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.run.launch import LocalExecutor

        return LocalExecutor(self.spec, Path(run.run_dir or "."), echo=ctx.hooks.echo, say=ctx.hooks.say)


def cloud_nodes(nodes: int) -> str:
    """The cloud side of a hybrid run of ``nodes`` nodes (node 0 is this machine): "node 1" or "nodes 1-3"."""
    return "node 1" if nodes == 2 else f"nodes 1-{nodes - 1}"


#: Job statuses after which recipe ``idle_minutes`` keeps the nodes (the job ran to an end on its own).
KEEP_STATUSES = ("succeeded", "failed")
#: ledger resource kinds that are nodes (kept until idle, reached by `broker ssh` / `broker exec`)
NODE_KINDS = ("instance", "netns_node")


def _keep_until_idle(ledger: "Ledger", run: Run, idle_minutes: float, actor: str) -> list[Resource]:
    """Record ``attrs["idle_minutes"]`` on every live instance of ``run`` (the watchdog's idle rule reads it) and
    log why nothing was torn down; returns the kept instances."""
    kept = [r for r in ledger.resources(run.id, live_only=True) if r.kind in NODE_KINDS]
    for r in kept:
        ledger.update_resource(r.id, attrs={"idle_minutes": idle_minutes}, actor=actor,
                               message=f"kept for inspection: idle stop after {idle_minutes:g} min")
    ledger.event(run.id, actor, "keep-idle",
                 f"recipe idle_minutes={idle_minutes:g}: kept {len(kept)} node(s) instead of tearing down; the "
                 f"watchdog terminates them {idle_minutes:g} min after the job ended (or at the deadline / budget), "
                 f"`broker down {run.id}` at once")
    return kept
