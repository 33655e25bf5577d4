"""The targets the netns emulation hands the run pipeline (:meth:`broker.providers.netns.NetnsProvider.run_target`):
:class:`NetnsTarget` (N namespaces with sshd, the job over SSH), :class:`HybridTarget` (the ``hybrid`` topology
emulated: two NAT'd sites and a WireGuard tunnel), and the kept nodes of a ``broker netns up`` cluster
(``--cluster``); with the checks of the emulation's own ``broker run`` options (``--inject``, ``--cluster``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from broker.core.provider import BadInput, ProviderError
from broker.core.recipe import Recipe, shown_path
from broker.core.target import RunRequest, Target
from broker.providers import get_provider
from broker.providers.netns import cluster as netns_cluster
from broker.providers.netns import sites as netns_sites
from broker.run.targets import KEEP_STATUSES, _keep_until_idle, cloud_nodes

if TYPE_CHECKING:
    from broker.core.records import Cluster, Resource, Run
    from broker.run.executor import Executor
    from broker.run.runrecord import Context


def inject_error(inject: str, *, hybrid: bool) -> BadInput:
    """The error for a ``--inject`` fault the chosen netns topology cannot inject: a fault of the other topology
    says which ``--topology`` it needs; an unknown one lists both sets."""
    plain = ", ".join(netns_cluster.INJECTS)
    tunnel = ", ".join(netns_sites.HYBRID_INJECTS)
    both = f"without --topology hybrid: {plain}; with --topology hybrid: {tunnel}"
    if not hybrid and inject in netns_sites.HYBRID_INJECTS:
        return BadInput(f"fault {inject!r} needs --topology hybrid (it breaks the tunnel between the two sites)",
                        hint=f"add --topology hybrid; the faults are {both}")
    if hybrid and inject in netns_cluster.INJECTS:
        return BadInput(f"fault {inject!r} is not one of the hybrid topology's (it needs the plain netns topology)",
                        hint=f"drop --topology hybrid; the faults are {both}")
    from broker.core.choices import closest

    near = closest(inject, (*netns_cluster.INJECTS, *netns_sites.HYBRID_INJECTS))
    return BadInput(f"unknown fault {inject!r}",
                    hint=(f"did you mean --inject {near}? " if near else "") + f"choose one of: {both}")


class NetnsTarget(Target):
    """N network namespaces on this machine, each with its own sshd (``broker.providers.netns``), free; the job
    runs over SSH exactly as on rented VMs.  Nodes are ledger rows of kind ``netns_node`` ($0/hour), recorded
    before the namespaces exist and released through :func:`broker.money.teardown.teardown_run`."""

    provider, topology = "netns", "multi-node"

    def __init__(self, recipe: Recipe, *, inject: str | None = None, port: int | None = None):
        self.recipe, self.inject, self.port = recipe, inject, port
        self.cluster_state: Any = None
        self.use_gpus = False
        self.devices = ""

    def reattach(self, run_dir: Path, cid: str) -> None:
        """Point this target at the namespaces of cluster ``cid`` that a run made (their state under
        ``<run_dir>/netns/<cid>``), so that release removes them; an unreadable state leaves release to the
        ledger rows."""
        try:
            self.cluster_state = netns_cluster.NetnsCluster.load(run_dir / "netns" / cid)
        except (OSError, ValueError, TypeError):
            self.cluster_state = None

    def check(self) -> None:
        if self.inject is not None and self.inject not in netns_cluster.INJECTS:
            raise inject_error(self.inject, hybrid=False)
        why = netns_cluster.missing_requirements()
        if why:
            raise ProviderError("netns", "up", why, hint="run as root on Linux with openssh-server and iproute2")
        r = self.recipe
        self.use_gpus = netns_cluster.gpu_count() >= r.nodes * r.gpus_per_node
        self.devices = ("one GPU set per node (CUDA_VISIBLE_DEVICES, distinct NCCL_HOSTID)" if self.use_gpus
                        else "no GPU used: gloo on CPU")

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices, "inject": self.inject}

    def describe(self) -> str:
        return (f"topology multi-node over SSH (netns, free); {self.devices}"
                + (f"; fault injected: {self.inject}" if self.inject else ""))

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        r = self.recipe
        cid = netns_cluster.new_cid()
        rows = [ctx.ledger.record_intent(run.id, "netns", "netns_node", f"node{i}", attrs={"cid": cid})
                for i in range(r.nodes)]
        ctx.say(f"creating {r.nodes} network namespace(s) with sshd (cluster {cid})")
        self.cluster_state = c = netns_cluster.up(r.nodes, Path(run.run_dir or "."), inject=self.inject,
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
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers={"netns": get_provider("netns")},
                            confirm_timeout_s=30)
        return left, []


class HybridTarget(Target):
    """The ``hybrid`` topology emulated on this machine (``--provider netns --topology hybrid``): node 0 in a "home"
    namespace behind one NAT, nodes 1.. in a "cloud" site behind another, only the WireGuard UDP port between them
    (:func:`broker.providers.netns_sites.up_hybrid`), a per-run WireGuard tunnel (:func:`broker.run.hybrid.tunnel_up`), the
    job over SSH with every rank on the tunnel interface.  Free; ledger rows of kind ``netns_node`` as for
    :class:`NetnsTarget` (``broker down`` removes namespaces, interfaces and keys)."""

    provider, topology = "netns", "hybrid"

    def __init__(self, recipe: Recipe, *, inject: str | None = None, port: int | None = None):
        self.recipe, self.inject, self.port = recipe, inject, port
        self.cluster_state: Any = None
        self.sites: Any = None
        self.tunnel: Any = None
        self.use_gpus = False
        self.devices = "no GPU used: gloo on CPU over the tunnel"

    def check(self) -> None:
        from broker.run.wireguard import missing_tools

        if self.inject is not None and self.inject not in netns_sites.HYBRID_INJECTS:
            raise inject_error(self.inject, hybrid=True)
        if self.recipe.nodes < 2:
            raise BadInput("the hybrid topology needs at least 2 nodes (this machine + one VM)")
        why = netns_cluster.missing_requirements() or missing_tools()
        if why:
            raise ProviderError("netns", "up hybrid", why, hint="run as root on Linux with openssh-server, iproute2, "
                                "iptables and wireguard-tools (+ wireguard-go without the kernel module)")
        r = self.recipe
        self.use_gpus = netns_cluster.gpu_count() >= r.nodes * r.gpus_per_node > 0
        self.devices = ("one GPU set per node (CUDA_VISIBLE_DEVICES, distinct NCCL_HOSTID), NCCL sockets over the "
                        "tunnel" if self.use_gpus else "no GPU used: gloo on CPU over the tunnel")

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices, "inject": self.inject}

    def describe(self) -> str:
        return ("topology hybrid emulated (netns: home + cloud behind two NATs, WireGuard between them, free); "
                + self.devices + (f"; fault injected: {self.inject}" if self.inject else ""))

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        from broker.run.hybrid import emulated_cluster, tunnel_up

        r = self.recipe
        cid = netns_cluster.new_cid()
        rows = [ctx.ledger.record_intent(run.id, "netns", "netns_node", f"node{i}", attrs={"cid": cid, "hybrid": True})
                for i in range(r.nodes)]
        ctx.say(f"creating the two sites (home: node 0; cloud: {cloud_nodes(r.nodes)}) behind two NATs (cluster {cid})")
        self.cluster_state, self.sites = netns_sites.up_hybrid(r.nodes, Path(run.run_dir or "."), cid=cid, inject=self.inject,
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
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers={"netns": get_provider("netns")},
                            confirm_timeout_s=30)
        return left, []




# --------------------------------------------------------------------------------------------------- run_target
def target_for(recipe: Recipe, request: RunRequest, *, say: "Callable[[str], None] | None" = None) -> Target:
    """The target of ``broker run --provider netns``: the kept nodes of a ``broker netns up`` cluster
    (``--cluster``), the emulated hybrid topology (``--topology hybrid``, WireGuard only), else N namespaces with
    sshd; ``--inject`` is checked by the target before anything is created.  Raises BadInput for another mesh or
    an unknown ``--cluster``."""
    cluster = request.option("--cluster")
    if cluster:  # a cluster from `broker netns up`: its nodes are kept, as for `broker exec`
        from broker.money.ledger import Ledger
        from broker.run.kept import KeptTarget, kept_cluster

        ledger = Ledger()
        try:
            return KeptTarget(*kept_cluster(ledger, cluster_run(ledger, cluster)))
        finally:
            ledger.close()
    inject = request.option("--inject")
    if (request.topology or recipe.topology) == "hybrid":
        if request.mesh != "wireguard":
            raise BadInput("the emulated hybrid run (--provider netns) uses its own WireGuard tunnel",
                           hint="leave out --mesh (or --mesh wireguard)")
        return HybridTarget(recipe, inject=inject)
    from broker.run.planstep import local_interruptible_note

    note = local_interruptible_note(recipe, "the emulated hosts (netns) on this machine")
    if note and say:
        say(note)
    return NetnsTarget(recipe, inject=inject)


def misplaced_option(recipe: Recipe, request: RunRequest, flag: str) -> BadInput:
    """The error for ``--inject`` given to a run on another provider (or none): an unknown fault is named as such;
    a known one gets the command that injects that same fault (with ``--topology hybrid`` for a tunnel fault)."""
    if flag != "--inject":
        return BadInput(f"{flag} works with --provider netns only", hint=f"add --provider netns, or drop {flag}")
    inject = request.option(flag) or ""
    topo = request.topology or recipe.topology
    if inject not in (*netns_cluster.INJECTS, *netns_sites.HYBRID_INJECTS):
        return inject_error(inject, hybrid=topo == "hybrid")
    hybrid = topo == "hybrid" or inject in netns_sites.HYBRID_INJECTS
    return BadInput("--inject works with --provider netns only (faults are injected into the emulated network)",
                    hint=f"broker run {shlex.quote(shown_path(recipe.path or recipe.script))} --provider netns"
                    + (" --topology hybrid" if hybrid else "") + f" --inject {inject}")


def cluster_run(ledger: Any, cluster: str) -> str:
    """The run id of the ``broker netns up`` cluster ``cluster`` (its cluster id ``bkn`` + 6 hex digits as printed,
    or its run id / a unique prefix).  Raises BadInput when no such cluster is in the ledger."""
    if not re.fullmatch(r"bkn[0-9a-f]{6}", cluster):
        try:
            return ledger.find_run(cluster).id  # a run id (or prefix): kept_cluster checks its nodes
        except BadInput:
            raise BadInput(f"--cluster {cluster}: no netns cluster (bkn + 6 hex digits) or run of that id",
                           hint="`broker netns status` lists the clusters; `broker netns up 2` stands one up") \
                from None
    row = ledger.find_by_provider_id("netns", f"{cluster}:0")
    if row is None:
        raise BadInput(f"no netns cluster {cluster} in the ledger",
                       hint="`broker netns status` lists the clusters; `broker netns up 2` stands one up")
    return row.run_id


def stood_up_cluster(run: "Run") -> "Cluster | None":
    """The cluster of a ``broker netns up`` run (its state in ``<run dir>/netns/<cid>/state.json``), as the
    Cluster ssh and exec reach; None when the run's folder holds none."""
    if not run.run_dir:
        return None
    states = sorted(Path(run.run_dir, "netns").glob("*/state.json"))
    if not states:
        return None
    return netns_cluster.NetnsCluster.load(states[0].parent).cluster(run.id)
