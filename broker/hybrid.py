"""The ``hybrid`` topology: node 0 = this machine, nodes 1..N-1 = rented VMs, joined by a per-run WireGuard tunnel
(:mod:`broker.wireguard`) or an existing tailnet (``--mesh tailscale``).

* which providers can be the cloud side (:data:`TUN_PROVIDERS`: full VMs with ``/dev/net/tun``; Vast.ai containers
  have none, so neither WireGuard nor Tailscale runs there: :data:`NO_TUN_REASON`);
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

from broker.model import Cluster, ClusterNode, TopologyKind
from broker.provider import BadInput, ProviderError

if TYPE_CHECKING:
    from broker.providers.netns import HybridSites, NetnsCluster

#: providers whose machines are full VMs with /dev/net/tun (WireGuard / Tailscale run there)
TUN_PROVIDERS = ("oci", "aws")
NO_TUN_REASON = ("hybrid needs a VM with /dev/net/tun for WireGuard/Tailscale; {provider} containers have none "
                 "(use oci or aws for the cloud side)")
HANDSHAKE_WAIT_S = 6.0
MESHES = ("wireguard", "tailscale")


def why_not_hybrid(provider: str) -> str | None:
    """None when ``provider`` can host the cloud side of a hybrid run; else the reason."""
    if provider in TUN_PROVIDERS:
        return None
    return NO_TUN_REASON.format(provider=provider)


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
    from broker import wireguard as wg

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
    from broker import wireguard as wg

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
    base = c.cluster(run_id)
    nodes = [ClusterNode(node_rank=i, host=n.host, port=n.port, user=n.user, private_ip=t.addresses[i],
                         resource_id=n.resource_id, gpu_indices=n.gpu_indices, env={**n.env, **tunnel_env(t.ifaces[i])})
             for i, n in enumerate(base.nodes)]
    return base.model_copy(update={"nodes": nodes, "topology": TopologyKind.hybrid})


# --------------------------------------------------------------------------------------------------- preflight
_WG_KEY = re.compile(r"[A-Za-z0-9+/]{43}=")  # a WireGuard public key: 32 bytes in base64


def handshake_check(run: Any, cluster: Cluster, port_of: dict[int, int], mtu: int, *,
                    wait_s: float = HANDSHAKE_WAIT_S) -> list[Any]:
    """The tunnel rows of preflight, over the executor's ``run(i, cmd, timeout)``: node 0 sends a packet to every
    peer through the tunnel, then ``wg show IF latest-handshakes`` must show a handshake with each within
    ``wait_s``; every node's tunnel interface must carry ``mtu``.  Returns preflight ``Check`` rows."""
    from broker.preflight import Check
    from broker.wireguard import parse_handshakes

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
        code, out = run(j, f"wg show {shlex.quote(iface)} public-key", timeout=20)
        last = out.strip().splitlines()[-1].strip() if out.strip() else ""
        if code == 0 and _WG_KEY.fullmatch(last):
            keys[j] = last
        else:
            keys[j] = ""
            unreadable[j] = f"`wg show {iface} public-key` on node {j}: exit {code}: {last or 'no output'}"
    t0 = time.monotonic()
    seen: dict[str, int] = {}
    while keys and len(unreadable) < len(peers):
        run(0, f"{shlex.quote(cluster.python)} -c {shlex.quote(poke)}", timeout=20)
        code, out = run(0, f"wg show {shlex.quote(iface0)} latest-handshakes", timeout=20)
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


def make_executor(cluster: Cluster, recipe: Any, run_dir: Path, *, ports: dict[int, int], mtu: int, **kw: Any):
    """An SSH executor whose preflight starts with :func:`handshake_check` (a FAIL ends the run at once)."""
    from broker.remote import SSHExecutor

    class HybridExecutor(SSHExecutor):
        def preflight(self) -> Any:
            from broker import preflight as pf

            if not self.do_preflight:
                return super().preflight()
            t0 = time.monotonic()
            rows = handshake_check(self.ssh.run, self.cluster, ports, mtu)
            bad = [r for r in rows if r.result == "FAIL"]
            if bad:
                rep = pf.PreflightReport(checks=rows, wall_s=time.monotonic() - t0)
                self.report = rep
                (self.run_dir / "preflight.json").write_text(json.dumps(rep.to_dict(), indent=2))
                text = pf.render_text(rep)
                (self.run_dir / "preflight.txt").write_text("\n".join(text) + "\n")
                for line in text:
                    self._say(f"[preflight] {line}")
                return self._fail("preflight failed: " + "; ".join(rep.failures()))
            for r in rows:
                self._say(f"[preflight] {r.result} {r.check} {r.nodes}: {r.detail}")
            out = super().preflight()
            if self.report is not None:
                self.report.checks[:0] = rows
                (self.run_dir / "preflight.json").write_text(json.dumps(self.report.to_dict(), indent=2))
                (self.run_dir / "preflight.txt").write_text("\n".join(pf.render_text(self.report)) + "\n")
            return out

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
    return TailnetSelf(address=addr[0].strip())


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
