"""WireGuard for the ``hybrid`` topology: per-run keys, per-node configs, bringing an interface up and down (kernel
module where it exists, else ``wireguard-go`` in userspace), and the cloud side rendered as text (cloud-init user
data and security rules) for the OCI / AWS adapters to embed.

Keys: X25519 pairs made per run with the ``cryptography`` package (never stored in the ledger); the private keys
live only in the per-node config files, written 0600 under the run folder (``<run>/.../wg/``) and deleted at
teardown (:func:`forget`).

Layout of one tunnel (:class:`Tunnel`): node 0 is "home" (behind NAT: no endpoint of its own, it dials out to every
VM with ``PersistentKeepalive``), nodes 1..N are the VMs (each listens on ``listen_port + i - 1`` at its public
endpoint; the VMs reach each other at their own endpoints).  Every node gets ``<prefix>.<1+i>/24`` on the tunnel
interface, whose MTU is :data:`DEFAULT_MTU` (1500 minus 80 bytes of WireGuard over IPv6; also safe over IPv4).
"""

from __future__ import annotations

import base64
import ipaddress
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from broker.core.provider import ProviderError

DEFAULT_PORT = 51820
DEFAULT_MTU = 1420  # 1500 - 80 (IPv6 40 + UDP 8 + WireGuard 32): what wg-quick picks on a 1500 path
KEEPALIVE_S = 25
#: the tunnel interface on a rented VM (one run per VM); on this machine each run gets its own name
VM_IFACE = "wg0"
WG_SOCKET_DIR = Path("/var/run/wireguard")


# --------------------------------------------------------------------------------------------------- keys
def genkey() -> tuple[str, str]:
    """A fresh X25519 pair as WireGuard writes them: (private, public), base64 of the raw 32 bytes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    k = X25519PrivateKey.generate()
    raw = k.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                          serialization.NoEncryption())
    pub = k.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode(), base64.b64encode(pub).decode()


def pubkey(private: str) -> str:
    """The public key of a base64 private key (``wg pubkey``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    k = X25519PrivateKey.from_private_bytes(base64.b64decode(private))
    return base64.b64encode(k.public_key().public_bytes(serialization.Encoding.Raw,
                                                        serialization.PublicFormat.Raw)).decode()


# --------------------------------------------------------------------------------------------------- the tunnel
@dataclass
class Peer:
    """One node of the tunnel: its tunnel address, keys, and where the others reach it (``endpoint`` host:port;
    None = behind NAT, it dials out)."""

    rank: int
    address: str
    private_key: str = field(repr=False)
    public_key: str
    listen_port: int | None
    endpoint: str | None


@dataclass
class Tunnel:
    """A per-run WireGuard network: ``peers[0]`` is home (this machine), the rest the VMs."""

    subnet: str  # e.g. 198.18.7.0/24
    peers: list[Peer]
    mtu: int = DEFAULT_MTU
    keepalive_s: int = KEEPALIVE_S

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def endpoint_for(self, src: int, dst: int) -> str | None:
        """Where node ``src`` sends to node ``dst``: home never has an endpoint (it is behind NAT)."""
        return self.peers[dst].endpoint if dst != 0 else None

    def conf(self, i: int, *, inner_endpoints: dict[int, str] | None = None) -> str:
        """``wg setconf`` text for node ``i`` (no wg-quick keys: Address / MTU are set with ``ip``).

        ``inner_endpoints``: endpoints the VMs use for each other (their private addresses), by rank."""
        me = self.peers[i]
        lines = ["[Interface]", f"PrivateKey = {me.private_key}"]
        if me.listen_port:
            lines.append(f"ListenPort = {me.listen_port}")
        for j, p in enumerate(self.peers):
            if j == i:
                continue
            lines += ["", "[Peer]", f"PublicKey = {p.public_key}", f"AllowedIPs = {p.address}/32"]
            ep = self.endpoint_for(i, j)
            if i != 0 and inner_endpoints and j in inner_endpoints:
                ep = inner_endpoints[j]
            if ep:
                lines.append(f"Endpoint = {ep}")
            if i == 0:  # home sits behind NAT: keep the mapping open from inside
                lines.append(f"PersistentKeepalive = {self.keepalive_s}")
        return "\n".join(lines) + "\n"

    def wg_quick_conf(self, i: int) -> str:
        """The same with wg-quick's ``Address``/``MTU`` keys (what a VM's cloud-init writes to
        /etc/wireguard/wg0.conf)."""
        base = self.conf(i).split("\n", 1)
        return (base[0] + f"\nAddress = {self.peers[i].address}/{self.prefixlen}\nMTU = {self.mtu}\n" + base[1])


def make_tunnel(n: int, subnet: str, endpoints: dict[int, str], *, port: int = DEFAULT_PORT,
                mtu: int = DEFAULT_MTU) -> Tunnel:
    """Keys and addresses for ``n`` nodes on ``subnet``: node i gets host ``1 + i``; VM i listens on
    ``port + i - 1`` and is reached at ``endpoints[i]`` (``host:port``)."""
    net = ipaddress.ip_network(subnet)
    hosts = list(net.hosts())
    if n < 2 or n > len(hosts):
        raise ValueError(f"a tunnel has 2..{len(hosts)} nodes, not {n}")
    peers = []
    for i in range(n):
        priv, pub = genkey()
        peers.append(Peer(rank=i, address=str(hosts[i]), private_key=priv, public_key=pub,
                          listen_port=None if i == 0 else port + i - 1, endpoint=endpoints.get(i)))
    return Tunnel(subnet=str(net), peers=peers, mtu=mtu)


def write_confs(tunnel: Tunnel, folder: Path, *, inner_endpoints: dict[int, str] | None = None) -> list[Path]:
    """Write ``node<i>.conf`` for every node into ``folder`` (0700), each file 0600; returns the paths."""
    from broker.core.private import private_dir, tighten_dir, write_private

    private_dir(folder)
    tighten_dir(folder)
    out = []
    for i in range(len(tunnel.peers)):
        p = folder / f"node{i}.conf"
        write_private(p, tunnel.conf(i, inner_endpoints=inner_endpoints))  # 0600 from its creation
        out.append(p)
    return out


def forget(folder: Path) -> bool:
    """Delete the key folder (configs hold the private keys); True when something was removed."""
    folder = Path(folder)
    if not folder.exists():
        return False
    for p in folder.glob("*"):
        try:
            p.write_bytes(b"\0" * max(1, p.stat().st_size))  # overwrite before unlinking (best effort)
        except OSError:
            pass
    shutil.rmtree(folder, ignore_errors=True)
    return True


# --------------------------------------------------------------------------------------------------- interfaces
def _ns(ns: str | None, run_bind: Path | None = None) -> list[str]:
    """argv prefix: inside namespace ``ns``; with ``run_bind``, also in a private mount namespace whose /run is
    that folder (an emulated node's own /run, where its sshd sessions look for wireguard-go's socket)."""
    pre = ["ip", "netns", "exec", ns] if ns else []
    if run_bind is not None:
        pre += ["unshare", "--mount", "sh", "-c", f'mount --bind {shlex.quote(str(run_bind))} /run && exec "$@"', "sh"]
    return pre


def _run(argv: list[str], *, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise ProviderError("wireguard", " ".join(argv[:6]), f"exit {p.returncode}: {(p.stderr or p.stdout).strip()}",
                            hint="install wireguard-tools (and wireguard-go where the kernel has no wireguard "
                                 "module): apt-get install wireguard-tools wireguard-go")
    return p


def kernel_module(ns: str | None = None) -> bool:
    """Whether this kernel creates WireGuard links (``ip link add type wireguard``); probed with a throw-away
    link inside ``ns`` (or the root namespace)."""
    name = f"bkwgp{os.getpid() % 100000}"
    p = _run([*_ns(ns), "ip", "link", "add", name, "type", "wireguard"], check=False)
    if p.returncode == 0:
        _run([*_ns(ns), "ip", "link", "del", name], check=False)
        return True
    return False


def missing_tools() -> str | None:
    """None when a tunnel can be made here; else what is missing."""
    if not shutil.which("wg"):
        return "wg is not installed (apt-get install wireguard-tools)"
    if not kernel_module() and not shutil.which("wireguard-go"):
        return ("this kernel has no wireguard module and wireguard-go is not installed "
                "(apt-get install wireguard-go)")
    if not os.path.exists("/dev/net/tun") and not kernel_module():
        return "/dev/net/tun is missing: wireguard-go cannot create its interface"
    return None


def iface_up(iface: str, conf: Path, address: str, prefixlen: int, mtu: int, *, ns: str | None = None,
             run_bind: Path | None = None, log: Path | None = None, wait_s: float = 10.0) -> str:
    """Create WireGuard interface ``iface`` (in namespace ``ns``), load ``conf`` with ``wg setconf``, set the
    address and MTU, bring it up.  Kernel module first, else ``wireguard-go -f`` (its pid goes to
    ``<conf>.pid``; its socket under ``run_bind`` when given, see :func:`_ns`).  Returns ``"kernel"`` or
    ``"wireguard-go"``."""
    how = "kernel"
    if _run([*_ns(ns), "ip", "link", "add", iface, "type", "wireguard"], check=False).returncode != 0:
        exe = shutil.which("wireguard-go")
        if not exe:
            raise ProviderError("wireguard", "ip link add type wireguard", "no wireguard kernel module and no "
                                "wireguard-go", hint="apt-get install wireguard-go")
        how = "wireguard-go"
        out = open(log, "ab") if log else subprocess.DEVNULL
        p = subprocess.Popen([*_ns(ns, run_bind), exe, "-f", iface], stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "LOG_LEVEL": os.environ.get("BROKER_WG_LOG_LEVEL", "error")})
        if log:
            out.close()  # type: ignore[union-attr]
        # the pid file holds the identity (pid, start time, name), never a bare pid: it may outlive the process
        from broker.core import procid

        born = procid.record(p.pid, comm=False)
        if born is not None:
            Path(f"{conf}.pid").write_text(procid.ProcessId(p.pid, born.start, "wireguard-go").to_text())
        sock = (Path(run_bind) / "wireguard" if run_bind else WG_SOCKET_DIR) / f"{iface}.sock"
        end = time.monotonic() + wait_s
        while not sock.exists():
            if p.poll() is not None or time.monotonic() > end:
                raise ProviderError("wireguard", f"wireguard-go {iface}", f"did not start (exit {p.poll()})"
                                    + (f"; log: {log.read_text(errors='replace')[-300:]}" if log else ""))
            time.sleep(0.05)
    _run([*_ns(ns, run_bind if how == "wireguard-go" else None), "wg", "setconf", iface, str(conf)])
    _run([*_ns(ns), "ip", "addr", "add", f"{address}/{prefixlen}", "dev", iface])
    _run([*_ns(ns), "ip", "link", "set", iface, "mtu", str(mtu), "up"])
    return how


def stop_process(pidfile: Path, *, wait_s: float = 3.0) -> bool:
    """SIGTERM the process whose identity ``pidfile`` records (:mod:`broker.core.procid`: pid, start time, name),
    wait up to ``wait_s`` seconds, then SIGKILL; only while it is still that process (a pid file can outlive its
    process and the pid be reused; a bare pid from an older broker is never signalled).  Reaps it when it is this
    process's child.  Returns whether a process was signalled."""
    from broker.core import procid

    try:
        ident = procid.ProcessId.from_text(pidfile.read_text())
    except OSError:
        return False
    return procid.stop(ident, grace_s=wait_s)


def iface_down(iface: str, *, ns: str | None = None, pidfile: Path | None = None,
               run_bind: Path | None = None) -> None:
    """Delete ``iface`` and stop its wireguard-go (by the pid in ``pidfile``); idempotent."""
    _run([*_ns(ns), "ip", "link", "del", iface], check=False)
    if pidfile and pidfile.exists():
        stop_process(pidfile)
    sock = (Path(run_bind) / "wireguard" if run_bind else WG_SOCKET_DIR) / f"{iface}.sock"
    if sock.exists():
        sock.unlink(missing_ok=True)


def open_iface_script(iface: str) -> str:
    """Shell, run as root on a VM once the tunnel is up, that accepts everything arriving on ``iface`` in its
    host firewall: firewalld's ``trusted`` zone where firewalld runs, and an iptables ``-i IFACE -j ACCEPT`` first
    in INPUT (once: checked with ``-C``).  Only the tunnel's peers reach that interface (WireGuard drops any
    packet not from a peer's key)."""
    i = shlex.quote(iface)
    return (f"if command -v firewall-cmd >/dev/null 2>&1 && firewall-cmd --state >/dev/null 2>&1; then "
            f"firewall-cmd --zone=trusted --add-interface={i} >/dev/null; fi; "
            f"if command -v iptables >/dev/null 2>&1; then iptables -C INPUT -i {i} -j ACCEPT 2>/dev/null || "
            f"iptables -I INPUT 1 -i {i} -j ACCEPT; fi")


def parse_handshakes(out: str) -> dict[str, int]:
    """{peer public key: unix time of the last handshake (0 = never)} from ``wg show IF latest-handshakes``."""
    res = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            res[parts[0]] = int(parts[1])
    return res


# --------------------------------------------------------------------------------------------------- cloud side
def cloud_init(tunnel: Tunnel, i: int, *, iface: str = VM_IFACE) -> str:
    """cloud-init user data (``#cloud-config``) for VM ``i`` (OCI ``user_data`` / AWS ``UserData``): install
    wireguard-tools, write ``/etc/wireguard/<iface>.conf`` (0600, this VM's private key: the user data is only
    readable by root on the VM and by the account owner), bring it up with ``wg-quick`` and open the UDP port in the
    host firewall (OCI images ship an iptables REJECT rule)."""
    if i == 0:
        raise ValueError("node 0 is this machine, not a VM")
    port = tunnel.peers[i].listen_port
    conf = tunnel.wg_quick_conf(i)
    indented = "".join(f"      {line}\n" for line in conf.splitlines())
    return ("#cloud-config\n"
            "package_update: true\n"
            "packages:\n  - wireguard-tools\n"
            "write_files:\n"
            f"  - path: /etc/wireguard/{iface}.conf\n"
            "    permissions: '0600'\n"
            "    owner: root:root\n"
            "    content: |\n" + indented +
            "runcmd:\n"
            f"  - [sh, -c, 'iptables -I INPUT -p udp --dport {port} -j ACCEPT || true']\n"
            f"  - [sh, -c, 'iptables -I INPUT -i {iface} -j ACCEPT || true']\n"
            f"  - [systemctl, enable, --now, wg-quick@{iface}]\n")


def user_data_script(tunnel: Tunnel, i: int, *, iface: str = VM_IFACE) -> str:
    """The same as a shell fragment, for adapters whose user data is already a script (AWS's boot script)."""
    port = tunnel.peers[i].listen_port
    conf = tunnel.wg_quick_conf(i)
    return ("# broker hybrid: WireGuard\n"
            "(command -v wg >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
            "wireguard-tools) || dnf install -y wireguard-tools || yum install -y wireguard-tools)\n"
            "install -d -m 700 /etc/wireguard\n"
            f"umask 077; cat > /etc/wireguard/{iface}.conf <<'BROKER_WG'\n{conf}BROKER_WG\n"
            f"iptables -I INPUT -p udp --dport {port} -j ACCEPT || true\n"
            f"iptables -I INPUT -i {iface} -j ACCEPT || true\n"
            f"systemctl enable --now wg-quick@{iface} || wg-quick up {iface}\n")


def _caller_cidr(caller_ip: str | None) -> tuple[str, bool]:
    """(source CIDR, scoped?) for an ingress rule: the caller's address as /32 (/128) where known, else any."""
    if not caller_ip:
        return "0.0.0.0/0", False
    ip = ipaddress.ip_address(caller_ip)
    return (f"{ip}/32" if ip.version == 4 else f"{ip}/128"), True


def aws_ingress(port: int, caller_ip: str | None) -> dict:
    """One ``IpPermissions`` entry for ``ec2.authorize_security_group_ingress``: UDP ``port`` only, from the caller's
    public address where known."""
    cidr, scoped = _caller_cidr(caller_ip)
    ranges = {"CidrIp": cidr, "Description": "broker hybrid: WireGuard from this machine" if scoped
              else "broker hybrid: WireGuard (caller address unknown)"}
    key = "IpRanges"
    if ":" in cidr:
        key, ranges = "Ipv6Ranges", {"CidrIpv6": cidr, "Description": ranges["Description"]}
    return {"IpProtocol": "udp", "FromPort": port, "ToPort": port, key: [ranges]}


def oci_ingress(port: int, caller_ip: str | None) -> dict:
    """One OCI security-list ingress rule (``IngressSecurityRule`` fields; protocol 17 = UDP): UDP ``port`` only,
    from the caller's public address where known."""
    cidr, scoped = _caller_cidr(caller_ip)
    return {"protocol": "17", "source": cidr, "source_type": "CIDR_BLOCK", "is_stateless": False,
            "udp_options": {"destination_port_range": {"min": port, "max": port}},
            "description": "broker hybrid: WireGuard from this machine" if scoped
            else "broker hybrid: WireGuard (caller address unknown)"}


#: ingress rule builders by the adapters' ``ingress_rule_format`` capability
INGRESS_RULE_FORMATS = {"IpPermissions": aws_ingress, "IngressSecurityRule": oci_ingress}


def security_rules(tunnel: Tunnel, caller_ip: str | None) -> dict[str, list[dict]]:
    """The ingress rules a hybrid run needs on the VMs' side, per provider (each registered provider with an
    ``ingress_rule_format``, in that format): one UDP port per VM, nothing else."""
    from broker.providers import REGISTRY, capability

    ports = sorted({p.listen_port for p in tunnel.peers[1:] if p.listen_port})
    out: dict[str, list[dict]] = {}
    for name in REGISTRY:
        fmt = capability(name, "ingress_rule_format")
        if fmt is not None:
            out[name] = [INGRESS_RULE_FORMATS[fmt](p, caller_ip) for p in ports]
    return out

