"""Targets for an emulation of hosts on this machine (network namespaces with sshd, each a "host"), handed over by
the emulating adapter's ``run_target`` with its machinery as an :class:`Emulation`: :class:`NamespaceTarget` (N
hosts in one private network, the job over SSH exactly as on rented VMs) and :class:`NamespaceHybridTarget` (the
``hybrid`` topology: two NAT'd sites and a per-run WireGuard tunnel).  Nodes are ledger rows of the emulation's
``node_kind`` ($0/hour), recorded before the namespaces exist and released through
:func:`broker.money.teardown.teardown_run`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from broker.core.provider import BadInput, ProviderError
from broker.core.recipe import Recipe
from broker.core.target import Target
from broker.run.targets import KEEP_STATUSES, _keep_until_idle, cloud_nodes

if TYPE_CHECKING:
    from broker.core.records import Cluster, Resource, Run
    from broker.run.executor import Executor
    from broker.run.runrecord import Context


class Emulation(Protocol):
    """What an emulating adapter hands its targets (``broker.providers.netns.target.NETNS``): its ``name``, the
    ledger ``node_kind`` of its nodes, the faults it injects (``INJECTS`` plain, ``HYBRID_INJECTS`` on the tunnel)
    and the error for a fault that does not fit, and its machinery: why it cannot run here, GPUs here, a new
    cluster id, ``up`` / ``up_hybrid`` (namespaces, sshd, the two sites), a saved cluster loaded again, the
    adapter instance (for the teardown)."""

    name: str
    node_kind: str
    INJECTS: tuple[str, ...]
    HYBRID_INJECTS: tuple[str, ...]

    def inject_error(self, inject: str, *, hybrid: bool) -> BadInput: ...
    def missing_requirements(self) -> str | None: ...
    def gpu_count(self) -> int: ...
    def new_cid(self) -> str: ...
    def up(self, n: int, run_dir: Path, **kw: Any) -> Any: ...
    def up_hybrid(self, n: int, run_dir: Path, **kw: Any) -> Any: ...
    def load_cluster(self, run_dir: Path, cid: str) -> Any: ...
    def provider(self) -> Any: ...


class NamespaceTarget(Target):
    """N emulated hosts on this machine (network namespaces), each with its own sshd, free; the job runs over SSH
    exactly as on rented VMs.  Nodes are ledger rows of the emulation's ``node_kind`` ($0/hour), recorded
    before the namespaces exist and released through :func:`broker.money.teardown.teardown_run`."""

    topology = "multi-node"

    def __init__(self, recipe: Recipe, emulation: "Emulation", *, inject: str | None = None,
                 port: int | None = None):
        self.em, self.provider = emulation, emulation.name
        self.recipe, self.inject, self.port = recipe, inject, port
        self.cluster_state: Any = None
        self.use_gpus = False
        self.devices = ""

    def reattach(self, run_dir: Path, cid: str) -> None:
        """Point this target at the namespaces of cluster ``cid`` that a run made (their state under
        ``<run_dir>/netns/<cid>``), so that release removes them; an unreadable state leaves release to the
        ledger rows."""
        try:
            self.cluster_state = self.em.load_cluster(run_dir, cid)
        except (OSError, ValueError, TypeError):
            self.cluster_state = None

    def check(self) -> None:
        if self.inject is not None and self.inject not in self.em.INJECTS:
            raise self.em.inject_error(self.inject, hybrid=False)
        why = self.em.missing_requirements()
        if why:
            raise ProviderError(self.provider, "up", why, hint="run as root on Linux with openssh-server and iproute2")
        r = self.recipe
        self.use_gpus = self.em.gpu_count() >= r.nodes * r.gpus_per_node
        self.devices = ("one GPU set per node (CUDA_VISIBLE_DEVICES, distinct NCCL_HOSTID)" if self.use_gpus
                        else "no GPU used: gloo on CPU")

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices, "inject": self.inject}

    def describe(self) -> str:
        return (f"topology multi-node over SSH ({self.provider}, free); {self.devices}"
                + (f"; fault injected: {self.inject}" if self.inject else ""))

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        r = self.recipe
        cid = self.em.new_cid()
        rows = [ctx.ledger.record_intent(run.id, self.provider, self.em.node_kind, f"node{i}", attrs={"cid": cid})
                for i in range(r.nodes)]
        ctx.say(f"creating {r.nodes} network namespace(s) with sshd (cluster {cid})")
        self.cluster_state = c = self.em.up(r.nodes, Path(run.run_dir or "."), inject=self.inject,
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
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers={self.provider: self.em.provider()},
                            confirm_timeout_s=30)
        return left, []


class NamespaceHybridTarget(Target):
    """The ``hybrid`` topology emulated on this machine (``--topology hybrid`` on an emulation): node 0 in a "home"
    namespace behind one NAT, nodes 1.. in a "cloud" site behind another, only the WireGuard UDP port between them
    (the emulation's ``up_hybrid``), a per-run WireGuard tunnel (:func:`broker.run.hybrid.tunnel_up`), the
    job over SSH with every rank on the tunnel interface.  Free; ledger rows of the emulation's ``node_kind`` as for
    :class:`NamespaceTarget` (``broker down`` removes namespaces, interfaces and keys)."""

    topology = "hybrid"

    def __init__(self, recipe: Recipe, emulation: "Emulation", *, inject: str | None = None,
                 port: int | None = None):
        self.em, self.provider = emulation, emulation.name
        self.recipe, self.inject, self.port = recipe, inject, port
        self.cluster_state: Any = None
        self.sites: Any = None
        self.tunnel: Any = None
        self.use_gpus = False
        self.devices = "no GPU used: gloo on CPU over the tunnel"

    def check(self) -> None:
        from broker.run.wireguard import missing_tools

        if self.inject is not None and self.inject not in self.em.HYBRID_INJECTS:
            raise self.em.inject_error(self.inject, hybrid=True)
        if self.recipe.nodes < 2:
            raise BadInput("the hybrid topology needs at least 2 nodes (this machine + one VM)")
        why = self.em.missing_requirements() or missing_tools()
        if why:
            raise ProviderError(self.provider, "up hybrid", why,
                                hint="run as root on Linux with openssh-server, iproute2, iptables and "
                                "wireguard-tools (+ wireguard-go without the kernel module)")
        r = self.recipe
        self.use_gpus = self.em.gpu_count() >= r.nodes * r.gpus_per_node > 0
        self.devices = ("one GPU set per node (CUDA_VISIBLE_DEVICES, distinct NCCL_HOSTID), NCCL sockets over the "
                        "tunnel" if self.use_gpus else "no GPU used: gloo on CPU over the tunnel")

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices, "inject": self.inject}

    def describe(self) -> str:
        return (f"topology hybrid emulated ({self.provider}: home + cloud behind two NATs, WireGuard between them, "
                "free); " + self.devices + (f"; fault injected: {self.inject}" if self.inject else ""))

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        from broker.run.hybrid import emulated_cluster, tunnel_up

        r = self.recipe
        cid = self.em.new_cid()
        rows = [ctx.ledger.record_intent(run.id, self.provider, self.em.node_kind, f"node{i}",
                                         attrs={"cid": cid, "hybrid": True}) for i in range(r.nodes)]
        ctx.say(f"creating the two sites (home: node 0; cloud: {cloud_nodes(r.nodes)}) behind two NATs (cluster {cid})")
        self.cluster_state, self.sites = self.em.up_hybrid(r.nodes, Path(run.run_dir or "."), cid=cid,
                                                           inject=self.inject,
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
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers={self.provider: self.em.provider()},
                            confirm_timeout_s=30)
        return left, []
