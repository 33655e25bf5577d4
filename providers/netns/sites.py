"""Two "sites" on this machine for the emulated ``hybrid`` topology (:mod:`broker.run.hybrid`): node 0 at "home",
nodes 1.. in the "cloud", each site behind its own NAT router, only the WireGuard UDP port between them.
"""

from __future__ import annotations

import fcntl
import json
import re
import secrets
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from broker.core.provider import BadInput, ProviderError
from broker.providers.netns.cluster import (
    PREFIX, SUBNET_BASE, NetnsCluster, _create_network, _run, _start_sshds, _subnet_lock, _used_subnets,
    missing_requirements)

# =================================================================================================== hybrid sites
# Two "sites" on this machine for the emulated ``hybrid`` topology (broker.run.hybrid): node 0 at "home", nodes 1..N-1
# in the "cloud", each site behind its own NAT router; only the WireGuard UDP port crosses between them.
#
#   node i      netns <cid>n<i>: eth0 = management (the bridge above, SSH only: the node can answer, never start,
#               a connection on it), lan0 = 198.18.<H|C>.<10+i>/24, default route via its site's router
#   home router netns <cid>n200: lanbr 198.18.<H>.1/24, wan 198.18.<W>.1/24, MASQUERADE, forwards LAN->WAN and
#               replies only
#   cloud router netns <cid>n201: lanbr 198.18.<C>.1/24, wan 198.18.<W>.2/24, MASQUERADE, DNAT of UDP port
#               <port + i - 1> to VM i (the VM's "public address"), forwards nothing else from the WAN
#
# The router namespaces follow the node naming (``n<digits>``) so remove_cid / down_all / `broker down` remove them
# with the nodes.  The WireGuard interfaces live inside the node namespaces and go with them.
HOME_ROUTER, CLOUD_ROUTER = 200, 201
HYBRID_INJECTS = ("udp-blocked", "direct-blocked")


@dataclass
class HybridSites:
    """The two-site layout of one emulated hybrid cluster (``sites.json`` next to ``state.json``)."""

    cid: str
    n: int
    home: int  # third octet of the home LAN
    cloud: int  # ... the cloud LAN
    wan: int  # ... the "internet" between the routers
    tunnel: int  # ... the WireGuard network
    port: int  # WireGuard UDP port of VM 1 (VM i: port + i - 1)

    def router(self, site: str) -> str:
        return f"{self.cid}n{HOME_ROUTER if site == 'home' else CLOUD_ROUTER}"

    def lan_ip(self, i: int) -> str:
        return f"{SUBNET_BASE}.{self.home if i == 0 else self.cloud}.{10 + i}"

    def wan_ip(self, site: str) -> str:
        return f"{SUBNET_BASE}.{self.wan}.{1 if site == 'home' else 2}"

    def vm_port(self, i: int) -> int:
        return self.port + i - 1

    @property
    def tunnel_subnet(self) -> str:
        return f"{SUBNET_BASE}.{self.tunnel}.0/24"

    def save(self, root: Path) -> None:
        (Path(root) / "sites.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, root: Path) -> "HybridSites":
        return cls(**json.loads((Path(root) / "sites.json").read_text()))


def up_hybrid(n: int, run_dir: Path, *, cid: str, port: int = 51820, inject: str | None = None,
              ssh_wait_s: float = 15.0, gpus_per_node: int = 0) -> tuple[NetnsCluster, HybridSites]:
    """Bring up the two sites for ``n`` nodes (module section above) with sshd on every node's management address;
    returns the cluster handle (for ``down``) and the sites.  ``gpus_per_node`` > 0: node i gets GPUs
    ``i*g .. i*g+g-1`` and its own ``NCCL_HOSTID`` (as :func:`up`; the caller checks this machine has them).  The tunnel itself is :mod:`broker.run.hybrid`'s.  On any
    failure everything made so far is removed and ProviderError is raised."""
    why = missing_requirements() or (None if shutil.which("iptables") else "iptables is not installed")
    if why:
        raise ProviderError("netns", "up hybrid", why, hint="run as root on Linux with iproute2, iptables, sshd")
    if inject is not None and inject not in HYBRID_INJECTS:
        raise BadInput(f"unknown hybrid fault {inject!r}", hint=f"choose one of: {', '.join(HYBRID_INJECTS)}")
    if not 2 <= n <= 100:
        raise BadInput(f"an emulated hybrid cluster has 2..100 nodes, not {n}")
    if not re.fullmatch(rf"{PREFIX}[0-9a-f]{{6}}", cid):
        raise BadInput(f"not a netns cluster id: {cid!r}")
    root = Path(run_dir).resolve() / "netns" / cid
    root.mkdir(parents=True, exist_ok=True)
    with _subnet_lock() as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = _used_subnets()
        free = [x for x in range(1, 255) if x not in used]
        if len(free) < 5:
            raise ProviderError("netns", "up hybrid", "fewer than 5 free /24s left in 198.18.0.0/16",
                                hint="remove leftovers with `broker netns down --all`")
        pick = [free.pop(secrets.randbelow(len(free))) for _ in range(5)]
        c = NetnsCluster(cid=cid, root=root, subnet=pick[0], n=n, gpus_per_node=gpus_per_node)
        sites = HybridSites(cid=cid, n=n, home=pick[1], cloud=pick[2], wan=pick[3], tunnel=pick[4], port=port)
        c.save()
        sites.save(root)
        try:
            _create_network(c)  # the management bridge: the only thing in the root namespace
            _create_sites(c, sites)
        except BaseException:
            c.down()
            raise
    try:
        _start_sshds(c, ssh_wait_s)
        if inject == "udp-blocked":
            block_wireguard(sites)
        elif inject == "direct-blocked":  # not a fault: proves the job needs nothing but the tunnel
            block_direct(sites)
    except BaseException:
        c.down()
        raise
    c.save()
    return c, sites


def _ipt(ns: str, *rule: str) -> None:
    _run(["ip", "netns", "exec", ns, "iptables", *rule])


def _create_sites(c: NetnsCluster, s: HybridSites) -> None:
    rh, rc = s.router("home"), s.router("cloud")
    for site, r, lan in (("home", rh, s.home), ("cloud", rc, s.cloud)):
        _run(["ip", "netns", "add", r])
        _run(["ip", "-n", r, "link", "set", "lo", "up"])
        _run(["ip", "-n", r, "link", "add", "lanbr", "type", "bridge"])
        _run(["ip", "-n", r, "addr", "add", f"{SUBNET_BASE}.{lan}.1/24", "dev", "lanbr"])
        _run(["ip", "-n", r, "link", "set", "lanbr", "up"])
        _run(["ip", "netns", "exec", r, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])  # this netns only
    _run(["ip", "-n", rh, "link", "add", "wan", "type", "veth", "peer", "name", "wan", "netns", rc])
    for site, r in (("home", rh), ("cloud", rc)):
        _run(["ip", "-n", r, "addr", "add", f"{s.wan_ip(site)}/24", "dev", "wan"])
        _run(["ip", "-n", r, "link", "set", "wan", "up"])
        # NAT out; from the WAN only replies (and, in the cloud, the VMs' WireGuard ports)
        _ipt(r, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        _ipt(r, "-P", "FORWARD", "DROP")
        _ipt(r, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _ipt(r, "-A", "FORWARD", "-i", "lanbr", "-o", "wan", "-j", "ACCEPT")
        _ipt(r, "-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _ipt(r, "-A", "INPUT", "-i", "wan", "-j", "DROP")
    for i in range(1, c.n):
        port = str(s.vm_port(i))
        _ipt(rc, "-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "udp", "--dport", port, "-j", "DNAT",
             "--to-destination", f"{s.lan_ip(i)}:{port}")
        _ipt(rc, "-A", "FORWARD", "-i", "wan", "-p", "udp", "-d", s.lan_ip(i), "--dport", port, "-j", "ACCEPT")
    for i in range(c.n):
        ns, r = c.ns(i), (rh if i == 0 else rc)
        _run(["ip", "-n", ns, "link", "add", "lan0", "type", "veth", "peer", "name", f"lan{i}", "netns", r])
        _run(["ip", "-n", r, "link", "set", f"lan{i}", "master", "lanbr"])
        _run(["ip", "-n", r, "link", "set", f"lan{i}", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{s.lan_ip(i)}/24", "dev", "lan0"])
        _run(["ip", "-n", ns, "link", "set", "lan0", "up"])
        gw = f"{SUBNET_BASE}.{s.home if i == 0 else s.cloud}.1"
        _run(["ip", "-n", ns, "route", "add", "default", "via", gw])
        # management (eth0): SSH in and its replies only; a node never opens a connection on it, so the sites
        # cannot talk to each other over the management bridge
        _ipt(ns, "-A", "INPUT", "-i", "eth0", "-p", "tcp", "--dport", "22", "-j", "ACCEPT")
        _ipt(ns, "-A", "INPUT", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _ipt(ns, "-A", "INPUT", "-i", "eth0", "-j", "DROP")
        _ipt(ns, "-A", "OUTPUT", "-o", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _ipt(ns, "-A", "OUTPUT", "-o", "eth0", "-j", "DROP")


def block_wireguard(s: HybridSites) -> None:
    """The ``udp-blocked`` fault: the cloud router drops the WireGuard UDP port (a missing security rule)."""
    for i in range(1, s.n):
        _ipt(s.router("cloud"), "-I", "FORWARD", "1", "-p", "udp", "--dport", str(s.vm_port(i)), "-j", "DROP")


def block_direct(s: HybridSites) -> None:
    """Drop every TCP packet the routers would forward between the sites: the job's traffic must be inside the
    tunnel (UDP) to get through."""
    for site in ("home", "cloud"):
        _ipt(s.router(site), "-I", "FORWARD", "1", "-p", "tcp", "-j", "DROP")
