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

from broker.core.provider import BadInput
from broker.core.recipe import Recipe, shown_path
from broker.core.target import RunRequest, Target
from broker.providers import get_provider
from broker.providers.netns import cluster as netns_cluster
from broker.providers.netns import sites as netns_sites
from broker.run.targets_emulated import NamespaceHybridTarget, NamespaceTarget

if TYPE_CHECKING:
    from broker.core.records import Cluster, Run


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


class _Netns:
    """The netns machinery as the run layer's :class:`broker.run.targets_emulated.Emulation`."""

    name = "netns"
    node_kind = "netns_node"
    INJECTS = netns_cluster.INJECTS
    HYBRID_INJECTS = netns_sites.HYBRID_INJECTS

    def inject_error(self, inject: str, *, hybrid: bool) -> BadInput:
        return inject_error(inject, hybrid=hybrid)

    def missing_requirements(self) -> str | None:
        return netns_cluster.missing_requirements()

    def gpu_count(self) -> int:
        return netns_cluster.gpu_count()

    def new_cid(self) -> str:
        return netns_cluster.new_cid()

    def up(self, n: int, run_dir: Path, **kw: Any) -> Any:
        return netns_cluster.up(n, run_dir, **kw)

    def up_hybrid(self, n: int, run_dir: Path, **kw: Any) -> Any:
        return netns_sites.up_hybrid(n, run_dir, **kw)

    def load_cluster(self, run_dir: Path, cid: str) -> Any:
        return netns_cluster.NetnsCluster.load(run_dir / "netns" / cid)

    def provider(self) -> Any:
        return get_provider(self.name)


NETNS = _Netns()


class NetnsTarget(NamespaceTarget):
    """N network namespaces on this machine, each with its own sshd (``broker.providers.netns``), free; the job
    runs over SSH exactly as on rented VMs (:class:`broker.run.targets_emulated.NamespaceTarget`)."""

    def __init__(self, recipe: Recipe, *, inject: str | None = None, port: int | None = None):
        super().__init__(recipe, NETNS, inject=inject, port=port)


class HybridTarget(NamespaceHybridTarget):
    """The ``hybrid`` topology emulated on this machine (``--provider netns --topology hybrid``): node 0 at "home",
    nodes 1.. in a "cloud" site, two NATs, a per-run WireGuard tunnel
    (:class:`broker.run.targets_emulated.NamespaceHybridTarget`)."""

    def __init__(self, recipe: Recipe, *, inject: str | None = None, port: int | None = None):
        super().__init__(recipe, NETNS, inject=inject, port=port)


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
