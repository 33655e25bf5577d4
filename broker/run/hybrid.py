"""The ``hybrid`` topology: node 0 = this machine, nodes 1..N-1 = rented VMs, joined by a per-run WireGuard tunnel
(:mod:`broker.run.wireguard`) or an existing tailnet (``--mesh tailscale``).

* which providers can be the cloud side (:data:`TUN_PROVIDERS`: rented full VMs with ``/dev/net/tun``, the
  adapters with ``hybrid`` among their ``topologies``; containers have none, so neither WireGuard nor Tailscale
  runs there: :data:`NO_TUN_REASON`);
* the emulation on one machine (``broker run RECIPE --provider netns --topology hybrid``): two sites behind two NATs
  (:func:`broker.providers.netns.up_hybrid`), the tunnel between them (:func:`tunnel_up`), the job over it;
* the tunnel check preflight runs first (:class:`HybridExecutor`): every VM must have completed a WireGuard
  handshake with node 0 within :data:`HANDSHAKE_WAIT_S` and the tunnel interfaces must carry the tunnel MTU; a
  blocked UDP port is named as such in seconds instead of surfacing as a TCP timeout;
* ``--mesh tailscale``: ``tailscale up --authkey`` lines for the VMs, this machine's ``tailscale0`` address.

Every node's environment names the tunnel: ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = the tunnel interface,
``NCCL_IB_DISABLE=1`` (sockets over the tunnel), and node 0's tunnel address is ``MASTER_ADDR`` (the cluster's
``private_ip``), so preflight's interface, MTU and TCP probes all run across the tunnel.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.core.model import TopologyKind
from broker.core.provider import BadInput, ProviderError
# who can host the cloud side is the planner's rule (it offers hybrid options); re-exported for the run step
from broker.plan.planner import NO_TUN_REASON, TUN_PROVIDERS, why_not_hybrid  # noqa: F401

if TYPE_CHECKING:  # pydantic records: imported where used (the planner imports this module: no pydantic there)
    from broker.core.records import Cluster
    from broker.providers.netns import HybridSites, NetnsCluster

HANDSHAKE_WAIT_S = 6.0
MESHES = ("wireguard", "tailscale")


def iface_name(cid: str, i: int) -> str:
    """The tunnel interface of emulated node ``i``: ``wg`` + the cluster's 6 hex digits + i (unique per run, so
    wireguard-go's sockets never collide; at most 15 characters)."""
    return f"wg{cid[-6:]}{i}"


def tunnel_env(iface: str) -> dict[str, str]:
    """The environment a node's job needs to use the tunnel."""
    return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface, "NCCL_IB_DISABLE": "1"}


# --------------------------------------------------------------------------------------------------- emulation
@dataclass
class EmulatedTunnel:
    """The tunnel of one emulated hybrid cluster: ``keys`` is the 0700 folder with the per-node configs."""

    cid: str
    keys: Path
    ifaces: list[str]
    addresses: list[str]
    mtu: int
    how: str  # kernel | wireguard-go
    endpoints: dict[int, str]


def tunnel_up(c: "NetnsCluster", s: "HybridSites", *, mtu: int | None = None) -> EmulatedTunnel:
    """Keys, configs and one WireGuard interface per node namespace.  Home (node 0) reaches VM i at the cloud
    router's WAN address, UDP ``s.vm_port(i)`` (DNAT to the VM); the VMs reach each other on the cloud LAN."""
    from broker.run import wireguard as wg
    endpoints = {i: f"{s.wan_ip('cloud')}:{s.vm_port(i)}" for i in range(1, c.n)}
    tun = wg.make_tunnel(c.n, s.tunnel_subnet, endpoints, port=s.port, mtu=mtu or wg.DEFAULT_MTU)
    keys = c.root / "wg"
    inner = {i: f"{s.lan_ip(i)}:{s.vm_port(i)}" for i in range(1, c.n)}
    confs = wg.write_confs(tun, keys, inner_endpoints=inner)
    ifaces = [iface_name(c.cid, i) for i in range(c.n)]
    how = ""
    for i in [*range(1, c.n), 0]:  # the VMs listen first: home's first initiation (at once) then gets an answer
        how = wg.iface_up(ifaces[i], confs[i], tun.peers[i].address, tun.prefixlen, tun.mtu, ns=c.ns(i),
                          run_bind=c.root / f"node{i}" / "run", log=c.root / f"node{i}" / "wireguard.log")
    t = EmulatedTunnel(cid=c.cid, keys=keys, ifaces=ifaces, addresses=[p.address for p in tun.peers], mtu=tun.mtu,
                       how=how, endpoints=endpoints)
    (c.root / "tunnel.json").write_text(json.dumps({**t.__dict__, "keys": str(keys)}, indent=2))
    return t


def tunnel_down(c: "NetnsCluster", t: EmulatedTunnel | None) -> None:
    """Remove the interfaces (the namespaces' removal would too) and delete the keys."""
    from broker.run import wireguard as wg
    if t is not None:
        for i, iface in enumerate(t.ifaces):
            wg.iface_down(iface, ns=c.ns(i), pidfile=t.keys / f"node{i}.conf.pid",
                          run_bind=c.root / f"node{i}" / "run")
        wg.forget(t.keys)
    wg.forget(c.root / "wg")


def emulated_cluster(c: "NetnsCluster", t: EmulatedTunnel, run_id: str) -> Cluster:
    """The runner's view: SSH over the management addresses, ``private_ip`` = the tunnel address (node 0's is
    ``MASTER_ADDR``), the tunnel interface in every node's env (plus its GPUs and ``NCCL_HOSTID`` where the
    namespaces were given GPUs)."""
    from broker.core.records import ClusterNode

    base = c.cluster(run_id)
    nodes = [ClusterNode(node_rank=i, host=n.host, port=n.port, user=n.user, private_ip=t.addresses[i],
                         resource_id=n.resource_id, gpu_indices=n.gpu_indices, env={**n.env, **tunnel_env(t.ifaces[i])})
             for i, n in enumerate(base.nodes)]
    return base.model_copy(update={"nodes": nodes, "topology": TopologyKind.hybrid})


# --------------------------------------------------------------------------------------------------- preflight
_WG_KEY = re.compile(r"[A-Za-z0-9+/]{43}=")  # a WireGuard public key: 32 bytes in base64


def _root(cluster: Cluster, i: int) -> str:
    """``sudo -n `` for a node whose login is not root (``wg show`` needs root), else nothing."""
    from broker.run.sshcluster import root_prefix

    return root_prefix(cluster.nodes[i])


def handshake_check(run: Any, cluster: Cluster, port_of: dict[int, int], mtu: int, *,
                    wait_s: float = HANDSHAKE_WAIT_S) -> list[Any]:
    """The tunnel rows of preflight, over the executor's ``run(i, cmd, timeout)``: node 0 sends a packet to every
    peer through the tunnel, then ``wg show IF latest-handshakes`` must show a handshake with each within
    ``wait_s``; every node's tunnel interface must carry ``mtu``.  Returns preflight ``Check`` rows."""
    from broker.run.preflight import Check
    from broker.run.wireguard import parse_handshakes

    iface0 = cluster.nodes[0].env.get("GLOO_SOCKET_IFNAME", "wg0")
    rows = []
    peers = {j: cluster.nodes[j].private_ip for j in range(1, len(cluster.nodes))}
    poke = ("import socket\n"
            f"for a in {list(peers.values())!r}:\n"
            "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b'x', (a, 9)); s.close()\n")
    keys: dict[int, str] = {}
    unreadable: dict[int, str] = {}  # node -> why `wg show` gave no answer there (not a network verdict)
    for j in peers:
        iface = cluster.nodes[j].env.get('GLOO_SOCKET_IFNAME', 'wg0')
        code, out = run(j, f"{_root(cluster, j)}wg show {shlex.quote(iface)} public-key", timeout=20)
        last = out.strip().splitlines()[-1].strip() if out.strip() else ""
        if code == 0 and _WG_KEY.fullmatch(last):
            keys[j] = last
        else:
            keys[j] = ""
            unreadable[j] = f"`wg show {iface} public-key` on node {j}: exit {code}: {last or 'no output'}"
    t0 = time.monotonic()
    seen: dict[str, int] = {}
    while keys and len(unreadable) < len(peers):
        run(0, f"{shlex.quote(cluster.nodes[0].python or cluster.python)} -c {shlex.quote(poke)}", timeout=20)
        code, out = run(0, f"{_root(cluster, 0)}wg show {shlex.quote(iface0)} latest-handshakes", timeout=20)
        if code != 0:
            last = out.strip().splitlines()[-1].strip() if out.strip() else "no output"
            unreadable = {j: f"`wg show {iface0} latest-handshakes` on node 0: exit {code}: {last}" for j in peers}
            break
        seen = parse_handshakes(out)
        missing = [j for j in peers if j not in unreadable and seen.get(keys[j], 0) == 0]
        if not missing or time.monotonic() - t0 > wait_s:
            break
        time.sleep(0.3)
    took = time.monotonic() - t0
    for j in peers:
        if j in unreadable:
            rows.append(Check("tunnel", f"0<->{j}", "FAIL",
                              f"cannot read the WireGuard interface ({unreadable[j]}), so the tunnel cannot be "
                              f"checked", "make `wg` (wireguard-tools) available on every node's default PATH "
                              "(apt-get install wireguard-tools) and check that the interface is up (`ip link`)"))
        elif seen.get(keys[j], 0) > 0:
            rows.append(Check("tunnel", f"0<->{j}", "PASS", f"WireGuard handshake between node 0 and node {j} "
                              f"({peers[j]}) after {took:.1f} s"))
        else:
            port = port_of.get(j)
            rows.append(Check("tunnel", f"0<->{j}", "FAIL",
                              f"no WireGuard handshake between node 0 (this machine, behind NAT) and node {j} "
                              f"within {wait_s:g} s: UDP port {port} is blocked between the sites (a cloud security "
                              f"rule / network ACL / firewall drops it) or node {j}'s endpoint is wrong",
                              f"open UDP {port} inbound on node {j} (security list / security group, from this "
                              f"machine's public address) and in its host firewall; check `wg show` on both ends"))
    for i, n in enumerate(cluster.nodes):
        iface = n.env.get("GLOO_SOCKET_IFNAME", "wg0")
        _, out = run(i, f"cat /sys/class/net/{shlex.quote(iface)}/mtu", timeout=20)
        got = out.strip().splitlines()[-1] if out.strip() else "?"
        if got == str(mtu):
            rows.append(Check("tunnel mtu", str(i), "PASS", f"{iface} MTU {got} (the tunnel's)"))
        else:
            rows.append(Check("tunnel mtu", str(i), "FAIL", f"{iface} MTU {got}, the tunnel needs {mtu} (larger "
                              "frames are fragmented or dropped inside the tunnel: a hang mid-training)",
                              f"ip link set dev {iface} mtu {mtu}"))
    return rows


def make_executor(cluster: Cluster, recipe: Any, run_dir: Path, *, ports: dict[int, int], mtu: int | None,
                  inner: dict[int, tuple[str, str]] | None = None, tailnet: bool = False, **kw: Any):
    """An SSH executor whose preflight starts with :func:`handshake_check` (a FAIL ends the run at once).

    ``mtu`` None: no tunnel check (``--mesh tailscale``: the tailnet is Tailscale's).  ``inner``: {VM rank:
    (private address, WireGuard public key)}: with more than one VM, reach tells every VM where the others listen
    (``wg set IF peer KEY endpoint PRIVATE:PORT``; their private addresses are known only once they run).  Nodes
    with ``local=True`` (this machine) run as local processes (:mod:`broker.run.localconn`).  ``tailnet``: after
    reach, every VM's ``private_ip`` and interface become its tailnet address and interface
    (:data:`TAILNET_ADDR_CMD`)."""
    from broker.run.remote import SSHExecutor

    class HybridExecutor(SSHExecutor):
        def open_tunnel(self) -> Any:
            """Accept everything arriving on the tunnel interface in every VM's host firewall, as root (an
            image's own rules, e.g. OCI's REJECT at the end of INPUT, would refuse the job's TCP inside the
            tunnel although the handshake passed); None, or the failed result."""
            from broker.run.sshcluster import arequire_root, as_root
            from broker.run.wireguard import open_iface_script

            for i, node in enumerate(self.cluster.nodes):
                if node.local:
                    continue
                iface = node.env.get("GLOO_SOCKET_IFNAME", "wg0")
                try:
                    self.ssh.loop.call(arequire_root(self.ssh, i, "hybrid"), timeout=60)
                except ProviderError as e:
                    return self._fail(f"{e.message} (the tunnel interface {iface} must be opened in its host "
                                      "firewall)", node=i)
                code, out = self.ssh.run(i, as_root(open_iface_script(iface), node), timeout=30)
                if code != 0:
                    return self._fail(f"opening {iface} in node {i}'s host firewall failed: exit {code}: "
                                      f"{out.strip()[-300:]}", node=i)
                self._say(f"[hybrid] node {i}: {iface} accepted in its host firewall"
                          + (f" (sudo -n as {node.user})" if node.user != "root" else ""))
            return None

        def reach(self) -> Any:
            res = super().reach()
            if res is None and mtu is not None:  # a WireGuard tunnel of the run's own (a tailnet is Tailscale's)
                res = self.open_tunnel()
            if res is None and tailnet:  # the VMs' tailnet addresses are known once they joined
                for i, node in enumerate(self.cluster.nodes):
                    if node.local:
                        continue
                    code, out = self.ssh.run(i, TAILNET_ADDR_CMD, timeout=30)
                    parts = out.strip().splitlines()[-1].split() if out.strip() else []
                    if code != 0 or len(parts) != 2:
                        return self._fail(f"node {i} is not on the tailnet (`tailscale ip -4`: {out.strip()[-200:]})",
                                          node=i)
                    node.private_ip = parts[0]
                    node.env.update(tunnel_env(parts[1]))
                self._say("[hybrid] tailnet: " + ", ".join(f"node{i}={n.private_ip} on "
                                                            f"{n.env.get('GLOO_SOCKET_IFNAME')}"
                                                            for i, n in enumerate(self.cluster.nodes)))
            if res is not None or not inner or len(inner) < 2:
                return res
            for i in inner:
                iface = self.cluster.nodes[i].env.get("GLOO_SOCKET_IFNAME", "wg0")
                for j, (addr, key) in inner.items():
                    if j == i:
                        continue
                    code, out = self.ssh.run(i, f"{_root(self.cluster, i)}wg set {shlex.quote(iface)} peer "
                                                f"{shlex.quote(key)} endpoint {shlex.quote(f'{addr}:{ports[j]}')}",
                                             timeout=20)
                    if code != 0:
                        return self._fail(f"setting node {j}'s endpoint on node {i} failed: {out.strip()[-300:]}",
                                          node=i)
            return None

        def preflight(self) -> Any:
            from broker.run import preflight as pf
            if not self.do_preflight or mtu is None:
                return super().preflight()
            t0 = time.monotonic()
            rows = handshake_check(self.ssh.run, self.cluster, ports, mtu)
            bad = [r for r in rows if r.result == "FAIL"]
            if bad:
                rep = pf.PreflightReport(checks=rows, wall_s=time.monotonic() - t0)
                self.report = rep
                from broker.core.private import write_private

                write_private(self.run_dir / "preflight.json", json.dumps(rep.to_dict(), indent=2))
                text = pf.render_text(rep)
                write_private(self.run_dir / "preflight.txt", "\n".join(text) + "\n")
                for line in text:
                    self._say(f"[preflight] {line}")
                return self._fail("preflight failed: " + "; ".join(rep.failures()))
            self.lead_checks = rows  # the tunnel rows lead the one preflight table (not lines above it)
            return super().preflight()

    return HybridExecutor(cluster, recipe, run_dir, **kw)


# --------------------------------------------------------------------------------------------------- tailscale
def tailscale_authkey(env_file: Path | None = None) -> str | None:
    """``TS_AUTHKEY`` from the environment, else from ``.env`` (the working folder's, or ``env_file``)."""
    key = os.environ.get("TS_AUTHKEY")
    if key:
        return key.strip()
    path = env_file or Path(".env")
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("export "):
            line = line[7:].strip()
        if line.startswith("TS_AUTHKEY="):
            val = line.split("=", 1)[1].strip().strip("'\"")
            return val or None
    return None


def tailscale_up_argv(authkey: str, hostname: str, *, exe: str = "tailscale") -> list[str]:
    """What a VM runs to join the tailnet (the key is passed on the command line only on the VM, via user data)."""
    return [exe, "up", f"--authkey={authkey}", f"--hostname={hostname}", "--accept-dns=false"]


def tailscale_cloud_init(authkey: str, hostname: str) -> str:
    """Boot script lines for a VM joining the tailnet (Tailscale's install script, then ``tailscale up``)."""
    up = " ".join(shlex.quote(a) for a in tailscale_up_argv(authkey, hostname))
    return ("# broker hybrid: Tailscale\n"
            "command -v tailscale >/dev/null || curl -fsSL https://tailscale.com/install.sh | sh\n"
            f"{up}\n")


@dataclass
class TailnetSelf:
    """This machine on the tailnet: its address and interface."""

    address: str
    iface: str = "tailscale0"


def tailscale_self(*, exe: str | None = None, timeout: float = 10.0) -> TailnetSelf:
    """This machine's tailnet IPv4 (``tailscale ip -4``) after checking ``tailscale status --json`` says it is
    running; ProviderError with the fix otherwise."""
    exe = exe or shutil.which("tailscale")
    if not exe:
        raise ProviderError("tailscale", "tailscale ip", "tailscale is not installed on this machine",
                            hint="install Tailscale and run `tailscale up`, or use the default --mesh wireguard")
    st = subprocess.run([exe, "status", "--json"], capture_output=True, text=True, timeout=timeout)
    state = None
    try:
        state = json.loads(st.stdout or "{}").get("BackendState")
    except ValueError:
        pass
    if st.returncode != 0 or state != "Running":
        raise ProviderError("tailscale", "tailscale status", f"this machine is not on a tailnet (state {state or '?'}"
                            f", exit {st.returncode})", hint="run `tailscale up` here first")
    ip = subprocess.run([exe, "ip", "-4"], capture_output=True, text=True, timeout=timeout)
    addr = (ip.stdout or "").strip().splitlines()
    if ip.returncode != 0 or not addr:
        raise ProviderError("tailscale", "tailscale ip -4", f"no tailnet IPv4 address (exit {ip.returncode})")
    return TailnetSelf(address=addr[0].strip(), iface=iface_of(addr[0].strip()) or "tailscale0")


def iface_of(address: str) -> str | None:
    """The interface of this machine holding IPv4 ``address`` (``ip -o -4 addr``), None when none does."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == address:
            return parts[1]
    return None


#: shell run on a VM of a ``--mesh tailscale`` run: its tailnet IPv4 and the interface holding it
TAILNET_ADDR_CMD = ("a=$(tailscale ip -4 | head -1); i=$(ip -o -4 addr show | awk -v a=\"$a\" "
                    "'{split($4, x, \"/\"); if (x[1] == a) print $2}' | head -1); echo \"$a ${i:-tailscale0}\"")


def tailscale_plan(n: int, run_id: str, *, env_file: Path | None = None, exe: str | None = None) -> dict[str, Any]:
    """What ``--mesh tailscale`` needs before any VM is rented: the auth key (never written to the ledger or run
    folder), this machine's tailnet address and interface, and each VM's boot lines.  Raises BadInput without a key."""
    key = tailscale_authkey(env_file)
    if not key:
        raise BadInput("--mesh tailscale needs TS_AUTHKEY", hint="export TS_AUTHKEY=tskey-auth-... (or put it in .env); "
                       "make one at https://login.tailscale.com/admin/settings/keys (ephemeral, pre-approved)")
    me = tailscale_self(exe=exe)
    return {"master_addr": me.address, "iface": me.iface, "env": tunnel_env(me.iface),
            "vm_boot": {i: tailscale_cloud_init(key, f"broker-{run_id}-node{i}") for i in range(1, n)}}


# --------------------------------------------------------------------------------------------------- cloud side
#: the interface WireGuard gets on the VMs (their boot script's wg-quick config)
VM_IFACE = "wg0"


def local_iface(run_id: str) -> str:
    """This machine's tunnel interface for run ``run_id``: ``bkwg`` + the run id's last 6 characters (unique per
    run, at most 15 characters)."""
    from broker.core.rowattrs import tunnel_iface

    return tunnel_iface(run_id)  # the ledger check of a local_node row knows the same name


def free_tunnel_subnet() -> str:
    """A /24 of 198.18.0.0/16 that no address on this machine uses (the tunnel's: node i = host 1 + i); picked
    under the lock the netns provider takes for its own /24s (:mod:`broker.run.subnets`)."""
    import fcntl
    import secrets

    from broker.run import subnets

    with subnets.subnet_lock() as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = subnets.used_subnets(routes=True)
        free = [x for x in range(1, 255) if x not in used]
        if not free:
            raise ProviderError("wireguard", "tunnel subnet", "no free /24 left in 198.18.0.0/16 for the tunnel")
        return f"{subnets.SUBNET_BASE}.{free[secrets.randbelow(len(free))]}.0/24"


def caller_public_ip(timeout_s: float = 3.0) -> str | None:
    """This machine's public IPv4 as the VMs see it, to scope the WireGuard ingress rule: ``BROKER_PUBLIC_IP``
    when set (``none`` = unknown; anything else that is not an IP address raises BadInput), else one HTTPS lookup
    (``https://checkip.amazonaws.com``, which answers the caller's address as text; ``timeout_s`` seconds); None
    when unknown (the rule then allows any source: the port only answers WireGuard's key handshake)."""
    import ipaddress

    import httpx

    val = os.environ.get("BROKER_PUBLIC_IP")
    if val is not None:
        val = val.strip()
        if val.lower() in ("", "none", "unknown"):
            return None
        try:
            return str(ipaddress.ip_address(val))
        except ValueError:
            raise BadInput(f"BROKER_PUBLIC_IP={val!r} is not an IP address",
                           hint="set it to this machine's public IPv4 (what the VMs see), or to none") from None
    try:
        r = httpx.get("https://checkip.amazonaws.com", timeout=timeout_s)
        r.raise_for_status()
        return str(ipaddress.ip_address(r.text.strip()))
    except (httpx.HTTPError, ValueError):
        return None


def ingress_rules(tunnel: Any, caller_ip: str | None) -> list[Any]:
    """The provider-neutral inbound rules a WireGuard hybrid run needs (:class:`broker.core.provider.Ingress`): one UDP
    port per VM, from the caller's address as /32 where known."""
    from broker.core.records import Ingress
    from broker.run.wireguard import _caller_cidr

    cidr, scoped = _caller_cidr(caller_ip)
    ports = sorted({p.listen_port for p in tunnel.peers[1:] if p.listen_port})
    desc = "broker hybrid: WireGuard from this machine" if scoped else "broker hybrid: WireGuard (caller unknown)"
    return [Ingress(protocol="udp", port=p, cidr=cidr, description=desc) for p in ports]


@dataclass
class CloudMesh:
    """How a hybrid run on rented VMs joins this machine (node 0) and the VMs (nodes 1..N-1).

    ``mesh``: ``wireguard`` (a tunnel made for the run: ``tunnel``, this machine's interface ``iface`` and key
    folder ``keys``) or ``tailscale`` (an existing tailnet: ``iface`` = ``tailscale0``, no tunnel, no keys).
    ``master_addr``: node 0's address on the mesh; ``vm_iface``: the mesh interface on the VMs; ``mtu``: checked by
    preflight (None for tailscale); ``ports``: {VM rank: its UDP port}."""

    mesh: str
    iface: str
    vm_iface: str
    master_addr: str
    vm_boot: dict[int, str]
    tunnel: Any = None
    keys: Path | None = None
    mtu: int | None = None
    ports: dict[int, int] | None = None
    how: str = ""


def wireguard_mesh(n: int, run_id: str, run_dir: Path, *, subnet: str | None = None,
                   port: int | None = None) -> CloudMesh:
    """Keys and configs for a WireGuard hybrid run of ``n`` nodes: node 0 = this machine on ``local_iface``,
    VM i listening on UDP ``port + i - 1``; each VM's boot lines (:func:`broker.run.wireguard.user_data_script`).  The
    key folder ``<run_dir>/wg`` (0700) is made now and holds node 0's config once :func:`wireguard_up` writes it;
    the VMs' private keys exist only in their boot lines (the provider's user data)."""
    from broker.run import wireguard as wg
    tun = wg.make_tunnel(n, subnet or free_tunnel_subnet(), {}, port=port or wg.DEFAULT_PORT)
    from broker.core.private import private_dir

    keys = private_dir(Path(run_dir) / "wg")  # 0700 from its creation
    return CloudMesh(mesh="wireguard", iface=local_iface(run_id), vm_iface=VM_IFACE, master_addr=tun.peers[0].address,
                     vm_boot={i: wg.user_data_script(tun, i, iface=VM_IFACE) for i in range(1, n)}, tunnel=tun,
                     keys=keys, mtu=tun.mtu, ports={i: tun.peers[i].listen_port for i in range(1, n)})


def tailscale_mesh(n: int, run_id: str, *, env_file: Path | None = None, exe: str | None = None) -> CloudMesh:
    """``--mesh tailscale``: this machine's tailnet address and ``tailscale0``, each VM's ``tailscale up`` boot
    lines (:func:`tailscale_plan`); nothing is created on this machine."""
    plan = tailscale_plan(n, run_id, env_file=env_file, exe=exe)
    return CloudMesh(mesh="tailscale", iface=plan["iface"], vm_iface="tailscale0", master_addr=plan["master_addr"],
                     vm_boot=plan["vm_boot"])


def wireguard_up(m: CloudMesh, endpoints: dict[int, str], log: Path | None = None) -> str:
    """Node 0's side of the tunnel: every VM's ``Endpoint`` (``public_ip:port``), node 0's config written 0600
    into the 0700 key folder, the interface up on this machine (kernel module, else ``wireguard-go``, pid in
    ``<keys>/node0.conf.pid``).  Returns ``kernel`` or ``wireguard-go``."""
    from broker.run import wireguard as wg
    assert m.tunnel is not None and m.keys is not None
    for i, ep in endpoints.items():
        m.tunnel.peers[i].endpoint = ep
    from broker.core.private import write_private

    conf = write_private(m.keys / "node0.conf", m.tunnel.conf(0))  # 0600 from its creation
    m.how = wg.iface_up(m.iface, conf, m.master_addr, m.tunnel.prefixlen, m.tunnel.mtu, log=log)
    return m.how


def local_node_attrs(m: CloudMesh, *, run_id: str, node0_base: str, python: str) -> dict[str, Any]:
    """What the ledger row of this machine's part of a cloud hybrid run keeps (provider ``local``, kind
    ``local_node``): where the tunnel interface, its pid file and key folder are (no key) and node 0's job (its
    torchrun pid file and probe), so :func:`local_node_down` can remove them after the CLI died."""
    out: dict[str, Any] = {"run_id": run_id, "mesh": m.mesh, "job_pidfile": f"{node0_base}/torchrun.pid",
                           "probe": f"{node0_base}/probe.py", "python": python}
    if m.mesh == "wireguard":
        assert m.keys is not None and m.tunnel is not None
        out.update(iface=m.iface, pidfile=str(m.keys / "node0.conf.pid"), keys=str(m.keys), subnet=m.tunnel.subnet)
    return out


def local_node_down(attrs: dict[str, Any]) -> None:
    """Remove this machine's part of a cloud hybrid run: node 0's job (the probe's kill by pid file and
    environment marker), the tunnel interface, its ``wireguard-go`` (its recorded identity, never a bare pid) and
    the key folder (configs overwritten, then deleted).  Idempotent; what ``broker down`` / the watchdog run for the
    ledger row (provider ``local``, kind ``local_node``) after the CLI died, and what release runs.

    ``attrs`` is checked first (:mod:`broker.core.rowattrs`: paths inside the run's folder, the run's own interface
    name); raises BadInput naming the field when it names anything else, and nothing is run, signalled or deleted.
    The probe runs with this interpreter, whatever the row says."""
    import sys

    from broker.core.provider import BadInput
    from broker.core.rowattrs import AttrsRefused, check_attrs, local_node_run
    from broker.run import wireguard as wg

    try:
        run_id = local_node_run(attrs)
        check_attrs("local_node", run_id, attrs)
    except AttrsRefused as e:
        raise BadInput(f"refused: this machine's part of a hybrid run names {e}; nothing was run, signalled or "
                       "deleted", hint="the ledger row was damaged or edited by someone else: check `broker status` "
                                       "and the ledger's owner") from None
    probe, job = attrs.get("probe"), attrs.get("job_pidfile")
    if probe and job and Path(probe).exists() and Path(job).exists():
        subprocess.run([sys.executable, probe, "kill", job, "2", f"BROKER_RUN_ID={run_id}", "BROKER_NODE_RANK=0"],
                       capture_output=True, timeout=60)
    iface = attrs.get("iface")
    if iface:
        wg.iface_down(iface, pidfile=Path(attrs["pidfile"]) if attrs.get("pidfile") else None)
    if attrs.get("keys"):
        wg.forget(Path(attrs["keys"]))


def cloud_cluster(vms: Cluster, m: CloudMesh, *, run_id: str, workroot: str, python: str) -> Cluster:
    """The hybrid cluster: node 0 = this machine (``local``: commands run here, ``workroot``/``python`` its own),
    nodes 1.. = ``vms`` (provisioned in rank order); every node's ``private_ip`` is its mesh address (node 0's is
    ``MASTER_ADDR``) and its env names the mesh interface (:func:`tunnel_env`)."""
    from broker.core.records import ClusterNode

    if m.tunnel is not None:
        addrs = [p.address for p in m.tunnel.peers]
    else:
        addrs = [m.master_addr] + [""] * len(vms.nodes)
    nodes = [ClusterNode(node_rank=0, host="localhost", port=0, user=os.environ.get("USER", "root"),
                         private_ip=m.master_addr, env=tunnel_env(m.iface), local=True, workroot=workroot,
                         python=python)]
    for k, n in enumerate(vms.nodes):
        addr = addrs[k + 1] or n.private_ip
        nodes.append(n.model_copy(update={"node_rank": k + 1, "private_ip": addr,
                                          "env": {**n.env, **tunnel_env(m.vm_iface)}}))
    return vms.model_copy(update={"nodes": nodes, "topology": TopologyKind.hybrid})
