"""Where a run's nodes come from: the :class:`Target` base and the free targets (this machine, network
namespaces, the hybrid of both, a Slurm partition).  Paid clouds: :mod:`broker.run.cloudtarget`; kept nodes:
:mod:`broker.run.kept`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.core.records import Cluster, Resource, Run
from broker.core.provider import BadInput, NoValidPlan, ProviderError
from broker.core.recipe import Recipe
# adapters by name through the registry (imported when asked): the run layer imports none
from broker.providers import adapter_module
from broker.run.runrecord import Context, Quote

if TYPE_CHECKING:
    from broker.run.executor import Executor
    from broker.run.launch import LocalLaunchSpec
    from broker.money.ledger import Ledger
    from broker.slurm.executor import SlurmOptions


# --------------------------------------------------------------------------------------------------- targets
class Target(ABC):
    """Where a run's nodes come from: the provider side of the pipeline (acquire / release) and the executor that
    runs the job on them.  A new provider plugs in with a Target (or through :class:`CloudTarget` by implementing
    the :class:`broker.core.provider.Provider` lifecycle verbs)."""

    provider: str = "?"
    topology: str = "?"
    #: a lost node can be replaced by acquiring again (:mod:`broker.run.attempts`); False: the job runs once
    restarts: bool = True

    def check(self) -> None:
        """Preconditions that must hold before anything is recorded (raise BadInput / NoValidPlan / ProviderError)."""

    def quote(self) -> Quote | None:
        """A paid target's price, shown for confirmation; None = free."""
        return None

    def prepare(self, ctx: Context) -> None:
        """After confirmation, before the run row: arm what must outlive the CLI (the watchdog)."""

    def plan_record(self) -> dict[str, Any]:
        """What goes into the run's ``plan.json`` and ledger row."""
        return {"provider": self.provider, "topology": self.topology, "usd_per_hour": 0.0}

    @abstractmethod
    def describe(self) -> str:
        """One line for the run header: devices, nodes, prices."""

    def acquire(self, run: Run, ctx: Context) -> Cluster | None:
        """Make the nodes exist (ledger-first); returns the cluster (None: this machine's processes)."""
        return None

    @abstractmethod
    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        """The executor for the acquired nodes."""

    def keep(self, recipe: Recipe, status: str) -> bool:
        """Whether the nodes of a job that ended with ``status`` are kept (recipe ``idle_minutes``)."""
        return False

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        """Tear down what acquire made, or keep it (``keep``); returns (still live after teardown, kept)."""
        return [], []

    def watching(self, run: Run, ctx: Context) -> "contextlib.AbstractContextManager[None]":
        """A context held while the job runs (cloud targets watch their nodes there); nothing by default."""
        return contextlib.nullcontext()

    @property
    def releases(self) -> bool:
        """Whether release has anything to do (a Ctrl-C during it is shielded)."""
        return False


def local_spec(recipe: Recipe) -> "tuple[LocalLaunchSpec, str]":
    """The launch spec for the ``local`` topology and a one-line description of the devices used.

    Raises NoValidPlan when this machine cannot serve the recipe (no GPU and not cpu_ok, too few GPUs...).
    """
    from broker.run.launch import LocalLaunchSpec
    from broker.providers import get_provider

    local = get_provider("local")  # through the registry: the run layer imports no adapter
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

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.spec, self.devices = local_spec(recipe)

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices}

    def describe(self) -> str:
        return f"topology local (this machine, free); {self.devices}"

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.run.launch import LocalExecutor

        return LocalExecutor(self.spec, Path(run.run_dir or "."), echo=ctx.hooks.echo, say=ctx.hooks.say)


def cloud_nodes(nodes: int) -> str:
    """The cloud side of a hybrid run of ``nodes`` nodes (node 0 is this machine): "node 1" or "nodes 1-3"."""
    return "node 1" if nodes == 2 else f"nodes 1-{nodes - 1}"


def inject_error(inject: str, *, hybrid: bool) -> BadInput:
    """The error for a ``--inject`` fault the chosen netns topology cannot inject: a fault of the other topology
    says which ``--topology`` it needs; an unknown one lists both sets."""
    netns = adapter_module("netns")
    plain = ", ".join(netns.INJECTS)
    tunnel = ", ".join(netns.HYBRID_INJECTS)
    both = f"without --topology hybrid: {plain}; with --topology hybrid: {tunnel}"
    if not hybrid and inject in netns.HYBRID_INJECTS:
        return BadInput(f"fault {inject!r} needs --topology hybrid (it breaks the tunnel between the two sites)",
                        hint=f"add --topology hybrid; the faults are {both}")
    if hybrid and inject in netns.INJECTS:
        return BadInput(f"fault {inject!r} is not one of the hybrid topology's (it needs the plain netns topology)",
                        hint=f"drop --topology hybrid; the faults are {both}")
    from broker.core.choices import closest

    near = closest(inject, (*netns.INJECTS, *netns.HYBRID_INJECTS))
    return BadInput(f"unknown fault {inject!r}",
                    hint=(f"did you mean --inject {near}? " if near else "") + f"choose one of: {both}")


class NetnsTarget(Target):
    """N network namespaces on this machine, each with its own sshd (``broker.providers.netns``), free; the job
    runs over SSH exactly as on rented VMs.  Nodes are ledger rows of kind ``netns_node`` ($0/hour), recorded
    before the namespaces exist and released through :func:`broker.money.teardown.teardown_run`."""

    provider, topology = "netns", "multi-node"

    def __init__(self, recipe: Recipe, *, inject: str | None = None, port: int | None = None):
        netns = adapter_module("netns")
        self.recipe, self.inject, self.port = recipe, inject, port
        self.netns = netns
        self.cluster_state: Any = None
        self.use_gpus = False
        self.devices = ""

    def check(self) -> None:
        netns = self.netns
        if self.inject is not None and self.inject not in netns.INJECTS:
            raise inject_error(self.inject, hybrid=False)
        why = netns.missing_requirements()
        if why:
            raise ProviderError("netns", "up", why, hint="run as root on Linux with openssh-server and iproute2")
        r = self.recipe
        self.use_gpus = netns.gpu_count() >= r.nodes * r.gpus_per_node
        self.devices = ("one GPU set per node (CUDA_VISIBLE_DEVICES, distinct NCCL_HOSTID)" if self.use_gpus
                        else "no GPU used: gloo on CPU")

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices, "inject": self.inject}

    def describe(self) -> str:
        return (f"topology multi-node over SSH (netns, free); {self.devices}"
                + (f"; fault injected: {self.inject}" if self.inject else ""))

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        netns, r = self.netns, self.recipe
        cid = netns.new_cid()
        rows = [ctx.ledger.record_intent(run.id, "netns", "netns_node", f"node{i}", attrs={"cid": cid})
                for i in range(r.nodes)]
        ctx.say(f"creating {r.nodes} network namespace(s) with sshd (cluster {cid})")
        self.cluster_state = c = netns.up(r.nodes, Path(run.run_dir or "."), inject=self.inject,
                                          gpus_per_node=r.gpus_per_node, use_gpus=self.use_gpus, cid=cid)
        for i, row in enumerate(rows):
            ctx.ledger.mark_created(row.id, f"{cid}:{i}", state="running")
        ctx.say(f"cluster {cid}: " + ", ".join(f"node{i}={c.ip(i)}" for i in range(c.n)))
        return c.cluster(run.id)

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.run.remote import SSHExecutor

        assert cluster is not None
        return SSHExecutor(cluster, recipe, Path(run.run_dir or "."), echo=ctx.hooks.echo, port=self.port,
                           say=ctx.hooks.say)

    def keep(self, recipe: Recipe, status: str) -> bool:
        """Recipe ``idle_minutes``: keep the (free) namespaces for `broker ssh` / `broker exec`; a running watchdog
        removes them ``idle_minutes`` after the job, `broker down RUN` at once."""
        return bool(recipe.idle_minutes) and status in KEEP_STATUSES

    @property
    def releases(self) -> bool:
        return True

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        from broker.money.teardown import teardown_run

        if keep:
            return [], _keep_until_idle(ctx.ledger, run, float(self.recipe.idle_minutes or 0), ctx.actor)
        if self.cluster_state is not None:
            self.cluster_state.down()
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers={"netns": self.netns.NetnsProvider()},
                            confirm_timeout_s=30)
        return left, []


class HybridTarget(Target):
    """The ``hybrid`` topology emulated on this machine (``--provider netns --topology hybrid``): node 0 in a "home"
    namespace behind one NAT, nodes 1.. in a "cloud" site behind another, only the WireGuard UDP port between them
    (:func:`broker.providers.netns.up_hybrid`), a per-run WireGuard tunnel (:func:`broker.run.hybrid.tunnel_up`), the
    job over SSH with every rank on the tunnel interface.  Free; ledger rows of kind ``netns_node`` as for
    :class:`NetnsTarget` (``broker down`` removes namespaces, interfaces and keys)."""

    provider, topology = "netns", "hybrid"

    def __init__(self, recipe: Recipe, *, inject: str | None = None, port: int | None = None):
        netns = adapter_module("netns")
        self.recipe, self.inject, self.port = recipe, inject, port
        self.netns = netns
        self.cluster_state: Any = None
        self.sites: Any = None
        self.tunnel: Any = None
        self.use_gpus = False
        self.devices = "no GPU used: gloo on CPU over the tunnel"

    def check(self) -> None:
        from broker.run.wireguard import missing_tools

        netns = self.netns
        if self.inject is not None and self.inject not in netns.HYBRID_INJECTS:
            raise inject_error(self.inject, hybrid=True)
        if self.recipe.nodes < 2:
            raise BadInput("the hybrid topology needs at least 2 nodes (this machine + one VM)")
        why = netns.missing_requirements() or missing_tools()
        if why:
            raise ProviderError("netns", "up hybrid", why, hint="run as root on Linux with openssh-server, iproute2, "
                                "iptables and wireguard-tools (+ wireguard-go without the kernel module)")
        r = self.recipe
        self.use_gpus = netns.gpu_count() >= r.nodes * r.gpus_per_node > 0
        self.devices = ("one GPU set per node (CUDA_VISIBLE_DEVICES, distinct NCCL_HOSTID), NCCL sockets over the "
                        "tunnel" if self.use_gpus else "no GPU used: gloo on CPU over the tunnel")

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices, "inject": self.inject}

    def describe(self) -> str:
        return ("topology hybrid emulated (netns: home + cloud behind two NATs, WireGuard between them, free); "
                + self.devices + (f"; fault injected: {self.inject}" if self.inject else ""))

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        from broker.run.hybrid import emulated_cluster, tunnel_up

        netns, r = self.netns, self.recipe
        cid = netns.new_cid()
        rows = [ctx.ledger.record_intent(run.id, "netns", "netns_node", f"node{i}", attrs={"cid": cid, "hybrid": True})
                for i in range(r.nodes)]
        ctx.say(f"creating the two sites (home: node 0; cloud: {cloud_nodes(r.nodes)}) behind two NATs (cluster {cid})")
        self.cluster_state, self.sites = netns.up_hybrid(r.nodes, Path(run.run_dir or "."), cid=cid, inject=self.inject,
                                                         gpus_per_node=r.gpus_per_node if self.use_gpus else 0)
        for i, row in enumerate(rows):
            ctx.ledger.mark_created(row.id, f"{cid}:{i}", state="running")
        self.tunnel = t = tunnel_up(self.cluster_state, self.sites)
        ctx.say(f"WireGuard tunnel up ({t.how}, MTU {t.mtu}): " + ", ".join(
            f"node{i}={a} on {t.ifaces[i]}" for i, a in enumerate(t.addresses)) + "; keys in the run folder (0600), "
            "deleted at teardown")
        return emulated_cluster(self.cluster_state, t, run.id)

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.run.hybrid import make_executor

        assert cluster is not None and self.sites is not None
        ports = {i: self.sites.vm_port(i) for i in range(1, len(cluster.nodes))}
        return make_executor(cluster, recipe, Path(run.run_dir or "."), ports=ports, mtu=self.tunnel.mtu,
                             echo=ctx.hooks.echo, port=self.port, say=ctx.hooks.say)

    @property
    def releases(self) -> bool:
        return True

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        from broker.run.hybrid import tunnel_down
        from broker.money.teardown import teardown_run

        if self.cluster_state is not None:
            try:
                tunnel_down(self.cluster_state, self.tunnel)
            finally:
                self.cluster_state.down()
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers={"netns": self.netns.NetnsProvider()},
                            confirm_timeout_s=30)
        return left, []


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
