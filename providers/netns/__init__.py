"""A free local cluster: N "hosts" on this machine, each a Linux network namespace with its own sshd.

Linux only, root only (``ip netns``, ``unshare``, ``mount --bind``).  Measured recipe:
docs/reference/local-cluster.md sections 3-4.

Layout of one cluster (``cid`` = ``bkn`` + 6 hex digits, unique per cluster so parallel clusters never collide)::

    bridge  <cid>br   198.18.<X>.1/24         (root namespace; X picked free in 198.18.1-254)
    node i  netns <cid>n<i>, eth0 198.18.<X>.<10+i>/24, veth <cid>v<i> (host side) <-> eth0 (node side)
            sshd -D in a private mount + UTS namespace: hostname node<i>, the cluster's /etc/hosts and a per-node
            /run (Debian's sshd needs /run/sshd) bind-mounted, key-only root login on <node ip>:22 (or, with
            ``login_user``, a cloud image's: that user with passwordless sudo and its own /home, root refused)

Interface names stay within Linux's 15 characters (``bkn1a2b3cv12`` = 12).  The namespaces have no default route
and ``ip_forward`` is untouched, so nothing leaves the machine.  All keys, configs, pid files and logs live under
``<run_dir>/netns/<cid>``; :meth:`NetnsCluster.down` kills every process inside the namespaces by PID, then deletes the
namespaces (which removes their veth pairs) and the bridge.  :func:`down_all` removes leftovers by prefix.

Fault switch (``inject``), to watch preflight catch the classic faults:

* ``firewall`` -- iptables in node 0's namespace: a stateful "SSH only" host firewall (loopback, established and
  port 22 accepted, every other inbound TCP dropped);
* ``wrong-iface`` -- every node's env forces ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = ``lo``, which does not
  hold the node's private address;
* ``mtu`` -- node 1's eth0 gets MTU 1400 while the others keep 1500.

Where this machine has at least N x gpus_per_node GPUs, node i gets its own GPUs (``gpu_indices``) and its own
``NCCL_HOSTID`` so NCCL treats the nodes as separate hosts and uses its network transport (NET/Socket), not
NVLink/shared memory.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from broker.core.model import Offer, Requirements, TopologyKind, utcnow
from broker.core.provider import BadInput, Provider, ProviderCheck, ProviderError  # noqa: F401 - re-exported
from broker.providers.declared import NETNS
# the machinery and the hybrid sites, re-exported: `from broker.providers import netns; netns.up(...)`
from broker.providers.netns.cluster import (  # noqa: F401
    CID_RE, INJECTS, LOCK_NAME, PREFIX, SSHD, SUBNET_BASE, NetnsCluster, _kill_pids, _start_sshds, _subnet_lock,
    check_cid, cid_of, down_all, forget_hybrid_secrets, gpu_count, hybrid_secrets, leftovers, lock_path,
    missing_requirements, new_cid, remove_cid, sshd_path, sshd_processes, up)
from broker.providers.netns.sites import (  # noqa: F401
    CLOUD_ROUTER, HOME_ROUTER, HYBRID_INJECTS, HybridSites, block_direct, block_wireguard, up_hybrid)

if TYPE_CHECKING:
    from broker.core.records import Cluster, TaggedResource


class NetnsProvider(Provider):
    """The ``netns`` provider: a free ``multi-node`` cluster of namespaces on this machine (see module doc)."""

    name: ClassVar[str] = "netns"
    #: what it can do, and why not (providers/declared.py; the registry reads the same object)
    caps = NETNS

    #: the emulation's own `broker run` flags, checked by its targets (providers/netns/target.py)
    run_options: ClassVar[dict[str, str]] = {
        "--inject": "faults are injected into the emulated network",
        "--cluster": "a `broker netns up` cluster",
    }

    @classmethod
    def run_target(cls, recipe: Any, request: Any, *, say: Any = None) -> Any:
        """:class:`~broker.providers.netns.target.NetnsTarget` (or the emulated hybrid, or a kept ``broker netns
        up`` cluster with ``--cluster``): :func:`broker.providers.netns.target.target_for`."""
        from broker.providers.netns.target import target_for

        return target_for(recipe, request, say=say)

    @classmethod
    def misplaced_option(cls, recipe: Any, request: Any, flag: str) -> BadInput:
        from broker.providers.netns.target import misplaced_option

        return misplaced_option(recipe, request, flag)

    @classmethod
    def standing_cluster(cls, run: Any) -> Any:
        from broker.providers.netns.target import stood_up_cluster

        return stood_up_cluster(run)

    def check(self) -> ProviderCheck:
        why = missing_requirements()
        return ProviderCheck(provider=self.name, configured=why is None, usable=why is None,
                             detail=why or f"root + iproute2 + sshd present; {gpu_count()} GPU(s)")

    def offers(self, req: Requirements) -> list[Offer]:
        if missing_requirements():
            return []
        g = gpu_count()
        use_gpu = g >= req.nodes * req.gpus_per_node
        if not use_gpu and not req.cpu_ok:
            return []
        return [Offer(provider=self.name, offer_id="netns-node", instance_type="network namespace on this machine",
                      gpu_name="GPU (this machine)" if use_gpu else "CPU (gloo)",
                      gpu_count=req.gpus_per_node if use_gpu else 0, gpu_mem_gib=0.0,
                      vcpus=os.cpu_count() or 1, usd_per_hour=0.0, min_billed_seconds=0, private_network=True,
                      price_source="free (this machine)", price_time=utcnow(),
                      attrs={"topology": TopologyKind.multi_node.value, "cpu": not use_gpu, "this_machine": True})]

    def up(self, n: int, run_dir: Path, *, inject: str | None = None, gpus_per_node: int = 1,
           run_id: str | None = None) -> tuple[NetnsCluster, Cluster]:
        """Bring up ``n`` nodes (see :func:`up`); returns the handle (for ``down``) and the runner's Cluster."""
        c = up(n, run_dir, inject=inject, gpus_per_node=gpus_per_node)
        return c, c.cluster(run_id or c.cid)

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Nodes of clusters whose state lives in a run's folder (``<runs>/<run_id>/netns/<cid>/state.json``)
        and whose namespaces still exist."""
        from broker.core.records import TaggedResource
        from broker.core.config import runs_dir

        out = []
        live = {x.split()[1] for x in leftovers()}
        for st in runs_dir().glob(f"{run_id or '*'}/netns/*/state.json"):
            try:
                c = NetnsCluster.load(st.parent)
            except (OSError, ValueError, TypeError):
                continue
            for i in range(c.n):
                if c.ns(i) in live:
                    out.append(TaggedResource(provider=self.name, kind="netns_node", provider_id=f"{c.cid}:{i}",
                                              run_id=st.parents[2].name, state="running", usd_per_hour=0.0,
                                              name=f"node{i}"))
        return out

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """``netns_node`` resources (provider id ``<cid>:<i>``): remove the whole cluster ``cid``.  Idempotent."""
        cid = provider_id.split(":")[0]
        if not CID_RE.fullmatch(cid):
            raise BadInput(f"not a netns cluster id: {provider_id!r}")
        for pid in sshd_processes(cid):
            _kill_pids([pid], signal.SIGKILL)
        remove_cid(cid)
        return not leftovers(cid)
