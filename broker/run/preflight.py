"""Preflight: checks run ON the nodes before the job starts, reported as one table of checks.

Rows (check, node(s), result PASS/WARN/FAIL, detail, fix):

* ``ssh`` -- every node answered;
* ``torch`` -- present on every node, one version everywhere; a CPU build is read from its installed files (the
  job imports torch right after: a broken CPU build shows in the job's own start), a GPU build is imported (the
  devices it sees, its NCCL) -- :mod:`broker.run.probe_script`;
* ``cuda`` -- GPUs visible per node >= processes per node; none visible: FAIL (``nccl`` needs CUDA) unless the
  recipe allows a CPU logic check (``cpu_ok``: WARN, gloo on CPU);
* ``interface`` -- which interface holds the node's private address (``ip -o -4 addr``); FAIL when none does, or
  when ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` is forced (recipe env or node env) to another interface;
* ``python`` / ``nccl`` -- one Python (minor) version and one NCCL version on every node;
* ``disk`` -- free space on the work root's filesystem: FAIL under 1 GiB or a disk smaller than ``disk_gib``, WARN
  under a quarter of ``disk_gib``;
* ``mtu`` -- the private interfaces' MTUs are equal (a mismatch drops large frames: a hang mid-training);
* ``tcp i->j`` -- for every ordered pair of nodes, real listeners on node j (node 0: the master port and a random
  ephemeral port; others: a random ephemeral port; NCCL and gloo open extra ephemeral ports, so a firewall that
  only opens the master port still hangs the job), connects from node i with a 2 s timeout:
  OPEN / FILTERED (no answer: packets dropped) / REFUSED (RST or ICMP unreachable) / UNREACHABLE (no route).
  A failed probe names the likely cause, host rules first: the probe reads them as root (``sudo -n`` on a non-root
  login) from iptables, nftables and firewalld; when the rule that decides a new TCP connection on that port
  (in order; else the chain's policy) is DROP/REJECT on node j's input or node i's output -> host firewall, with
  the exact command that opens the private network's CIDR (a REJECT ``icmp-host-prohibited`` looks UNREACHABLE,
  so this comes before the route verdict); otherwise UNREACHABLE -> not one private network; FILTERED -> a cloud
  security rule (security list / network security group / security group) or network ACL.  The network probes
  run concurrently with the torch check, so a FAIL comes within about the 2 s timeout plus SSH and Python start-up
  (measured: PASS 0.8 s, FAIL 2.8-4.8 s, docs/reference/local-cluster.md sec. 3).

:func:`run_preflight` needs an open :class:`broker.run.sshcluster.SSHCluster` with ``probe.py`` uploaded to every node.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.core.recipe import Recipe
    from broker.run.sshcluster import SSHCluster

PROBE_TIMEOUT_S = 2.0  # per TCP connect
LISTEN_S = 8.0  # how long a listener waits for all its peers
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass
class Check:
    """One row of the preflight table."""

    check: str
    nodes: str
    result: str  # PASS | WARN | FAIL
    detail: str
    fix: str = ""


@dataclass
class PreflightReport:
    """All checks, the interface holding each node's private address, and how long it took (seconds)."""

    checks: list[Check] = field(default_factory=list)
    ifaces: dict[int, str] = field(default_factory=dict)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(c.result == "FAIL" for c in self.checks)

    def only_master_port_busy(self, port: int) -> bool:
        """True when the only failure is that node 0 could not listen on ``port`` (another one may work)."""
        fails = [c for c in self.checks if c.result == "FAIL"]
        return bool(fails) and all(c.check == "tcp listen" and f"cannot listen on port {port}" in c.detail
                                   for c in fails)

    def failures(self) -> list[str]:
        return [f"{c.check} ({c.nodes}): {c.detail}" for c in self.checks if c.result == "FAIL"]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "wall_s": round(self.wall_s, 3), "checks": [asdict(c) for c in self.checks],
                "ifaces": {str(k): v for k, v in self.ifaces.items()},
                "info": {str(k): {kk: vv for kk, vv in v.items() if kk not in ("iptables", "firewall")}
                         for k, v in self.info.items()}}


def render_text(report: PreflightReport) -> list[str]:
    """The table as plain text lines (for logs and the console)."""
    rows = [("check", "node(s)", "result", "detail (-> fix)", "")] + \
           [(c.check, c.nodes, c.result, c.detail, c.fix) for c in report.checks]
    w = [max(len(r[k]) for r in rows) for k in range(3)]
    out = [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" + (f"  -> fix: {r[4]}" if r[4] else "")
           for r in rows]
    out.append(f"preflight {'PASSED' if report.ok else 'FAILED'} in {report.wall_s:.1f} s")
    return out


# ------------------------------------------------------------------------------------------------ remote steps
async def _info(ssh: "SSHCluster", i: int) -> dict[str, Any]:
    node = ssh.cluster.nodes[i]
    pre = ""
    if node.gpu_indices is not None:
        pre = f"CUDA_VISIBLE_DEVICES={shlex.quote(','.join(node.gpu_indices))} "
    cmd = f"{pre}{ssh.py(i)} {shlex.quote(ssh.probe(i))} info {shlex.quote(node.private_ip)} " \
          f"{shlex.quote(ssh.root(i))}"
    code, out = await ssh.arun(i, cmd, timeout=120)
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"probe info failed on node {i} (exit {code}): {out.strip()[-300:]}")


async def _listen(ssh: "SSHCluster", j: int, ports: list[int], hits: int) -> tuple[Any, list[int] | str]:
    """Start a listener on node j; returns (process, actual ports) or (process, error text)."""
    conn = await ssh.aconn(j)
    cmd = f"{ssh.py(j)} {shlex.quote(ssh.probe(j))} listen {LISTEN_S:g} {hits} " + " ".join(map(str, ports))
    proc = await conn.create_process(cmd, encoding="utf-8", errors="replace")
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
    except asyncio.TimeoutError:
        proc.close()
        return proc, "listener did not start within 30 s"
    try:
        d = json.loads(line)
    except ValueError:
        err = await proc.stderr.read()
        return proc, f"listener failed: {(line + err).strip()[-300:]}"
    if "error" in d:
        return proc, d["error"]
    return proc, list(d["ports"])


async def _connect(ssh: "SSHCluster", i: int, host: str, ports: list[int]) -> list[dict[str, Any]]:
    cmd = f"{ssh.py(i)} {shlex.quote(ssh.probe(i))} connect {PROBE_TIMEOUT_S:g} {shlex.quote(host)} " + \
          " ".join(map(str, ports))
    code, out = await ssh.arun(i, cmd, timeout=30 + PROBE_TIMEOUT_S * len(ports))
    res = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    if len(res) != len(ports):
        raise RuntimeError(f"probe connect failed on node {i} (exit {code}): {out.strip()[-300:]}")
    return res


async def _network(ssh: "SSHCluster", master_port: int) -> tuple[dict[tuple[int, int], Any], dict[int, Any]]:
    """Listeners on every node, connects for every ordered pair.  Returns ({(i, j): results | error},
    {j: listener error})."""
    n = len(ssh.cluster.nodes)
    listeners = await asyncio.gather(*(_listen(ssh, j, [master_port, 0] if j == 0 else [0], n - 1)
                                       for j in range(n)), return_exceptions=True)
    ports: dict[int, list[int]] = {}
    lerr: dict[int, Any] = {}
    procs = []
    for j, r in enumerate(listeners):
        if isinstance(r, BaseException):
            lerr[j] = str(r)
            continue
        procs.append(r[0])
        if isinstance(r[1], str):
            lerr[j] = r[1]
        else:
            ports[j] = r[1]
    pairs = [(i, j) for j in ports for i in range(n) if i != j]
    results = await asyncio.gather(*(_connect(ssh, i, ssh.cluster.nodes[j].private_ip, ports[j]) for i, j in pairs),
                                   return_exceptions=True)
    out: dict[tuple[int, int], Any] = dict(zip(pairs, results))
    all_open = all(not isinstance(r, BaseException) and all(x["state"] == "OPEN" for x in r) for r in results)
    for p in procs:  # every peer connected: the listeners exit by themselves (the master port is then free)
        try:
            if all_open:
                await asyncio.wait_for(p.wait(), LISTEN_S + 5)
            else:
                p.close()
        except Exception:
            p.close()
    return out, lerr


# ------------------------------------------------------------------------------------------------ judging
def _firewall_rules(ipt: str | None, chain: str) -> list[str]:
    """Every DROP/REJECT rule and DROP policy of ``chain`` in ``iptables -S`` output (whatever port)."""
    if not ipt:
        return []
    rules = []
    for line in ipt.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "-P" and parts[1] == chain and parts[2] in ("DROP", "REJECT"):
            rules.append(line.strip())
        elif len(parts) >= 2 and parts[0] == "-A" and parts[1] == chain and \
                ("-j DROP" in line or "-j REJECT" in line):
            rules.append(line.strip())
    return rules


def _ports_cover(spec: str, port: int) -> bool:
    """``22``, ``1000:2000`` (iptables) or ``1000-2000`` / ``{ 22, 80 }`` (nft) covers ``port``?"""
    for part in re.split(r"[,\s{}]+", spec.strip()):
        if not part:
            continue
        lo, sep, hi = part.replace("-", ":").partition(":")
        try:
            if (int(lo) <= port <= int(hi)) if sep else int(lo) == port:
                return True
        except ValueError:
            continue
    return False


def _addr_in(cidr: str, ip: str | None) -> bool:
    if ip is None:
        return True
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr.lstrip("!"), strict=False)
    except ValueError:
        return False


_SKIP_IPT = ("-i lo", "--state ESTABLISHED", "--ctstate ESTABLISHED", "--state RELATED", "--ctstate RELATED")


def _iface_matches(line: str, chain: str, iface: str | None) -> bool:
    """Whether a rule's ``-i`` (INPUT) / ``-o`` (OUTPUT) interface match, if any, holds for a packet on ``iface``
    (``+`` ends a prefix; ``!`` negates).  An unknown ``iface`` matches no rule that names one."""
    m = re.search(r"(!\s+)?-%s (\S+)" % ("i" if chain == "INPUT" else "o"), line)
    if not m:
        return True
    if iface is None:
        return False
    name = m.group(2)
    hit = iface.startswith(name[:-1]) if name.endswith("+") else iface == name
    return hit != bool(m.group(1))


def iptables_verdict(ipt: str | None, chain: str, port: int, peer: str | None,
                     iface: str | None = None) -> tuple[str, str] | None:
    """Walk ``chain`` of ``iptables -S`` in order for a new TCP connection to/from ``peer`` on ``port`` arriving on
    (INPUT) / leaving by (OUTPUT) interface ``iface``: ("ACCEPT" | "DROP" | "REJECT", the deciding rule or
    policy), or None when there are no rules.  Jumps to other chains and rules with matches this does not model
    are skipped; so is a rule for another interface (``-i wg0 -j ACCEPT`` opens the tunnel, not eth0)."""
    if not ipt:
        return None
    policy = None
    for line in ipt.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "-P" and parts[1] == chain:
            policy = (parts[2], line.strip())
            continue
        if len(parts) < 4 or parts[0] != "-A" or parts[1] != chain or any(k in line for k in _SKIP_IPT):
            continue
        m = re.search(r"-j (\w+)", line)
        if not m or m.group(1) not in ("ACCEPT", "DROP", "REJECT"):
            continue
        proto = re.search(r"-p (\w+)", line)
        if proto and proto.group(1) not in ("tcp", "all"):
            continue
        dport = re.search(r"--dports? (\S+)", line)
        if dport and not _ports_cover(dport.group(1), port):
            continue
        src = re.search(r"-s (\S+)" if chain == "INPUT" else r"-d (\S+)", line)
        if src and not _addr_in(src.group(1), peer):
            continue
        if not _iface_matches(line, chain, iface):
            continue
        return m.group(1), line.strip()
    if policy is not None:
        return policy
    return None


def nft_verdict(ruleset: str | None, hook: str, port: int, peer: str | None) -> tuple[str, str, str] | None:
    """The same for ``nft list ruleset``: the base chains on ``hook`` (input/output), in order; returns (verdict,
    deciding rule or policy, "table FAMILY NAME chain NAME") or None."""
    if not ruleset:
        return None
    table = chain = ""
    in_base = False
    policy: tuple[str, str, str] | None = None
    for raw in ruleset.splitlines():
        line = raw.strip()
        m = re.match(r"table (\w+) (\S+) \{", line)
        if m:
            table, in_base = f"{m.group(1)} {m.group(2)}", False
            continue
        m = re.match(r"chain (\S+) \{", line)
        if m:
            chain, in_base = m.group(1), False
            continue
        if line.startswith("type filter hook"):
            in_base = f"hook {hook}" in line
            pm = re.search(r"policy (\w+)", line)
            if in_base and pm and pm.group(1) in ("drop", "reject") and policy is None:
                policy = (pm.group(1).upper(), line, f"table {table} chain {chain}")
            continue
        if not in_base or line == "}":
            continue
        verdict = next((v for v in ("accept", "drop", "reject") if re.search(rf"\b{v}\b", line)), None)
        if verdict is None or re.search(r"\b(iif|iifname|oif|oifname) \"?lo\"?", line) or "ct state" in line \
                and "new" not in line:
            continue
        if re.search(r"\b(udp|icmp|icmpv6)\b", line) and "tcp" not in line:
            continue
        dport = re.search(r"tcp dport (\{[^}]*\}|\S+)", line)
        if dport and not _ports_cover(dport.group(1), port):
            continue
        addr = re.search(r"ip (saddr|daddr) (\S+)", line)
        if addr and not _addr_in(addr.group(2), peer):
            continue
        return verdict.upper(), line, f"table {table} chain {chain}"
    return policy


def _firewalld_blocks(fw: dict[str, Any] | None, port: int, peer: str | None) -> tuple[str, str] | None:
    """(zone, why) when firewalld runs and its default zone does not open ``port`` to ``peer``."""
    if not fw or fw.get("state") != "running":
        return None
    text = fw.get("list") or ""
    zone = fw.get("zone") or "public"

    def field_(name: str) -> str:
        m = re.search(rf"^\s*{name}:\s*(.*)$", text, re.MULTILINE)
        return m.group(1).strip() if m else ""

    if field_("target") in ("ACCEPT", "trusted") or zone == "trusted":
        return None
    for item in field_("ports").split():
        p, _, proto = item.partition("/")
        if proto == "tcp" and _ports_cover(p, port):
            return None
    if any(_addr_in(src, peer) for src in field_("sources").split()):
        return None
    return zone, f"firewalld zone {zone} opens only: services {field_('services') or '-'}, ports " \
                 f"{field_('ports') or '-'}"


def host_firewall(info: dict[str, Any], direction: str, port: int, peer: str | None,
                  iface: str | None = None) -> dict[str, str] | None:
    """The host firewall rule that blocks a new TCP connection on ``port`` from/to ``peer`` on this node
    (``direction`` "in" or "out") through interface ``iface``, as {"kind": firewalld|nftables|iptables, "rule":
    ..., "where": ...}; None when the readable rules allow it."""
    fw = info.get("firewall") or {}
    if direction == "in":
        z = _firewalld_blocks(fw.get("firewalld"), port, peer)
        if z:
            return {"kind": "firewalld", "rule": z[1], "where": z[0]}
    nv = nft_verdict(fw.get("nft"), "input" if direction == "in" else "output", port, peer)
    if nv and nv[0] in ("DROP", "REJECT"):
        return {"kind": "nftables", "rule": nv[1], "where": nv[2]}
    ipt = fw.get("iptables") if fw else None
    if ipt is None:
        ipt = info.get("iptables")
    iv = iptables_verdict(ipt, "INPUT" if direction == "in" else "OUTPUT", port, peer, iface)
    if iv and iv[0] in ("DROP", "REJECT"):
        return {"kind": "iptables", "rule": iv[1], "where": "INPUT" if direction == "in" else "OUTPUT"}
    return None


def _rules_readable(info: dict[str, Any]) -> tuple[bool, str]:
    """(were any host rules read, why not)."""
    fw = info.get("firewall")
    if fw is None:
        return info.get("iptables") is not None, info.get("iptables_error") or "iptables not readable"
    if fw.get("iptables") is not None or fw.get("nft") is not None or (fw.get("firewalld") or {}).get("list"):
        return True, ""
    errs = [e for e in (fw.get("iptables_error"), fw.get("nft_error")) if e]
    if not errs and fw.get("iptables") is None and fw.get("nft") is None:
        return False, "no iptables or nft on the node"
    why = "; ".join(errs)
    if not fw.get("as_root") and ("password" in why or "sudo" in why):
        why = f"`sudo -n` refused ({why}): give the login user passwordless sudo to read the rules"
    return False, why


def _private_cidr(info: dict[str, Any], ip: str | None) -> str:
    """The CIDR of the network holding ``ip`` from the probe's ``cidrs``, or ``<private CIDR>``."""
    for addrs in (info.get("cidrs") or {}).values():
        for a in addrs:
            try:
                iface = ipaddress.ip_interface(a)
            except ValueError:
                continue
            if ip and str(iface.ip) == ip:
                return str(iface.network)
    return "<private CIDR>"


def open_command(kind: str, where: str, cidr: str, direction: str = "in") -> str:
    """The exact command that opens all TCP from the private network's ``cidr`` in this host firewall."""
    if kind == "firewalld":
        return (f"sudo firewall-cmd --permanent --zone=trusted --add-source={cidr} && sudo firewall-cmd --reload")
    if kind == "nftables":
        m = re.match(r"table (\w+) (\S+) chain (\S+)", where)
        fam, table, chain = (m.group(1), m.group(2), m.group(3)) if m else ("inet", "filter", "input")
        key = "saddr" if direction == "in" else "daddr"
        return f"sudo nft insert rule {fam} {table} {chain} ip {key} {cidr} meta l4proto tcp accept"
    chain = "INPUT" if direction == "in" else "OUTPUT"
    key = "-s" if direction == "in" else "-d"
    return f"sudo iptables -I {chain} {key} {cidr} -p tcp -j ACCEPT"


def _cause(state: str, src: int, dst: int, info: dict[int, dict[str, Any]], port: int | None = None,
           ips: dict[int, str] | None = None, ifaces: dict[int, str] | None = None,
           tunnel: bool = False) -> tuple[str, str]:
    """(likely cause, fix) of a failed probe from node src to node dst on ``port``.  Host firewall rules are
    looked at first (a REJECT with icmp-host-prohibited looks UNREACHABLE to the prober; ``ifaces``: each node's
    interface of the private addresses, for rules bound to one); the cloud security rule is named only when the
    host rules that could be read allow the connection and the traffic is not inside a ``tunnel`` (a hybrid run's
    WireGuard: security rules see only its UDP, which a handshake proved open)."""
    dinfo, sinfo = info.get(dst, {}), info.get(src, {})
    ips, ifaces = ips or {}, ifaces or {}
    allow = "allow all TCP between the nodes' private addresses"
    if port is not None:
        hit = host_firewall(dinfo, "in", port, ips.get(src), ifaces.get(dst))
        node, direction = dst, "in"
        if hit is None:
            hit = host_firewall(sinfo, "out", port, ips.get(dst), ifaces.get(src))
            node, direction = src, "out"
    else:  # legacy: any DROP/REJECT rule
        d, o = _firewall_rules(dinfo.get("iptables"), "INPUT"), _firewall_rules(sinfo.get("iptables"), "OUTPUT")
        hit = {"kind": "iptables", "rule": " | ".join((d or o)[:3]), "where": "INPUT" if d else "OUTPUT"} \
            if d or o else None
        node, direction = (dst, "in") if d else (src, "out")
    if hit is not None:
        cidr = _private_cidr(info.get(node, {}), ips.get(node))
        what = {"iptables": f"iptables node {node} {hit['where']}: {hit['rule']}",
                "nftables": f"nftables node {node} {hit['where']}: {hit['rule']}",
                "firewalld": f"firewalld node {node}: {hit['rule']}"}[hit["kind"]]
        return (f"host firewall ({what})",
                f"{allow} in node {node}'s host firewall: `{open_command(hit['kind'], hit['where'], cidr, direction)}`")
    readable, why = _rules_readable(dinfo)
    if state == "UNREACHABLE":
        note = "" if readable else f" (node {dst}'s host firewall could not be read: {why}; a REJECT rule with " \
                                   "icmp-host-prohibited also looks like this)"
        return (f"no route from node {src} to node {dst}'s private address: the nodes are not in one private "
                "network" + note, "put the nodes in the same subnet / VPC / VCN (or fix the routes)")
    if state == "REFUSED":
        return ("refused while a listener was running: a REJECT rule (host firewall not readable here, or a "
                "network appliance)" + ("" if readable else f" ({why})"),
                f"{allow}; check `sudo iptables -S` / `sudo nft list ruleset` on node {dst}")
    if tunnel:
        iface = ifaces.get(dst, "the tunnel interface")
        return (f"packets dropped inside the tunnel: node {dst}'s host firewall on {iface} (cloud security rules see "
                "only the tunnel's UDP, and the handshake got through)"
                + (f"; its rules could not be read: {why}" if not readable else
                   " (no rule read there drops it: check nftables / firewalld on the node)"),
                f"accept everything on {iface} in node {dst}'s host firewall: `sudo iptables -I INPUT -i {iface} -j "
                f"ACCEPT` (or `sudo firewall-cmd --zone=trusted --add-interface={iface}`)")
    note = f" (node {dst}'s host firewall not readable: {why}; also check it)" if not readable else \
        f" (node {dst} has no DROP/REJECT iptables rule for this port)"
    return ("packets dropped on the way: a cloud security rule (security list / network security group / AWS "
            "security group) or a network ACL" + note,
            f"{allow}: an ingress rule for all TCP from the subnet CIDR (or the security group itself)")


def _judge(ssh: "SSHCluster", recipe: "Recipe", master_port: int, infos: list[Any],
           net: tuple[dict[tuple[int, int], Any], dict[int, Any]] | BaseException) -> PreflightReport:
    """The preflight table from what the nodes answered: ``infos`` (each node's probe facts, or the exception its
    probe raised) and ``net`` (the TCP probes' results, or the exception that ended them)."""
    cluster = ssh.cluster
    n = len(cluster.nodes)
    rep = PreflightReport()
    info: dict[int, dict[str, Any]] = {i: d for i, d in enumerate(infos) if isinstance(d, dict)}
    rep.info = info
    all_nodes = ",".join(map(str, range(n)))
    checks = rep.checks
    checks += _ssh_checks(cluster, infos, all_nodes)
    checks += _torch_checks(cluster, info, all_nodes)
    checks += _version_checks(info, all_nodes)
    checks += _disk_checks(info, float(getattr(recipe, "disk_gib", 0) or 0))
    checks += _cuda_checks(info, recipe)
    checks += _interface_checks(cluster, recipe, info, rep.ifaces)
    checks += _mtu_checks(info, rep.ifaces, all_nodes)
    if isinstance(net, BaseException):
        checks.append(Check("tcp", all_nodes, "FAIL", f"network probe failed: {net}", "see the node logs"))
        return rep
    checks += _tcp_checks(cluster, master_port, info, net, rep.ifaces)
    return rep


def _ssh_checks(cluster: Any, infos: list[Any], all_nodes: str) -> list[Check]:
    """``ssh``: every node's probe ran (a node whose probe raised: FAIL naming the error)."""
    bad = [(i, d) for i, d in enumerate(infos) if not isinstance(d, dict)]
    if not bad:
        return [Check("ssh", all_nodes, "PASS", f"{len(infos)} node(s) answered over ssh")]
    return [Check("ssh", str(i), "FAIL", f"probe could not run: {e}", f"check that {cluster.python} exists on node {i}")
            for i, e in bad]


def _torch_checks(cluster: Any, info: dict[int, dict[str, Any]], all_nodes: str) -> list[Check]:
    """``torch``: importable on every node (FAIL per node naming the import error), one version everywhere."""
    checks = []
    missing = [i for i, d in info.items() if not d.get("torch")]
    for i in missing:
        checks.append(Check("torch", str(i), "FAIL", f"import torch failed with {cluster.python}: "
                            f"{info[i].get('torch_error', '?')}",
                            "install torch in that python (same version on every node), or set the cluster's "
                            "python"))
    versions = {i: d["torch"] for i, d in info.items() if d.get("torch")}
    if versions and not missing:
        if len(set(versions.values())) == 1:
            checks.append(Check("torch", all_nodes, "PASS", f"torch {next(iter(versions.values()))} on every node"))
        else:
            checks.append(Check("torch", all_nodes, "FAIL",
                                "different torch versions: " + ", ".join(f"node {i}: {v}" for i, v in versions.items()),
                                "install the same torch version on every node"))
    return checks


def _version_checks(info: dict[int, dict[str, Any]], all_nodes: str) -> list[Check]:
    """``python`` and ``nccl``: one version everywhere (torch is compared by :func:`_torch_checks`)."""
    checks = []
    pys = {i: d["pyversion"] for i, d in info.items() if d.get("pyversion")}
    if len(pys) > 1:
        minors = {".".join(v.split(".")[:2]) for v in pys.values()}
        listing = ", ".join(f"node {i}: {v}" for i, v in sorted(pys.items()))
        if len(minors) > 1:
            checks.append(Check("python", all_nodes, "FAIL", f"different Python versions: {listing} (pickled "
                                "objects and compiled packages differ between them)",
                                "use one Python version (the same image or venv) on every node"))
        elif len(set(pys.values())) > 1:
            checks.append(Check("python", all_nodes, "WARN", f"different Python patch versions: {listing}",
                                "prefer one image on every node"))
        else:
            checks.append(Check("python", all_nodes, "PASS", f"Python {next(iter(pys.values()))} on every node"))
    nccls = {i: d["nccl_version"] for i, d in info.items() if d.get("nccl_version") and int(d.get("gpus") or 0)}
    if len(nccls) > 1:
        if len(set(nccls.values())) == 1:
            checks.append(Check("nccl", all_nodes, "PASS", f"NCCL {next(iter(nccls.values()))} on every node"))
        else:
            checks.append(Check("nccl", all_nodes, "FAIL", "different NCCL versions: " + ", ".join(
                f"node {i}: {v}" for i, v in sorted(nccls.items())) + " (ranks with different NCCL versions can "
                "hang or fail in their first collective)", "install the same torch build (it bundles NCCL) on "
                "every node, and unset NCCL library overrides (LD_LIBRARY_PATH, NCCL_* plugins)"))
    return checks


def _disk_checks(info: dict[int, dict[str, Any]], want: float) -> list[Check]:
    """``disk``: free space on each node's work root filesystem against the recipe's ``disk_gib`` (``want``)."""
    checks = []
    for i, d in sorted(info.items()):
        dk = d.get("disk") or {}
        if "free_bytes" not in dk:
            continue
        free, total = dk["free_bytes"] / 2**30, dk["total_bytes"] / 2**30
        where = f"{free:.1f} GiB free of {total:.1f} GiB at {dk.get('path')}"
        if free < 1.0:
            checks.append(Check("disk", str(i), "FAIL", f"{where}: not enough for a checkpoint or the job's "
                                "temporary files", f"free space on node {i} or use a larger disk (disk_gib)"))
        elif want and total < 0.9 * want:
            checks.append(Check("disk", str(i), "FAIL", f"{where}, but the recipe asks for disk_gib {want:g}",
                                "use an offer/shape with the disk you asked for, or lower disk_gib"))
        elif want and free < 0.25 * want:
            checks.append(Check("disk", str(i), "WARN", f"{where}: under a quarter of disk_gib {want:g}",
                                "free space, or raise disk_gib if checkpoints are large"))
        else:
            checks.append(Check("disk", str(i), "PASS", where + (f" (disk_gib {want:g})" if want else "")))
    return checks


def _cuda_checks(info: dict[int, dict[str, Any]], recipe: "Recipe") -> list[Check]:
    """``cuda``: GPUs visible per node >= processes per node; none: WARN with ``cpu_ok`` (gloo on CPU), else FAIL."""
    checks = []
    need = recipe.gpus_per_node
    for i, d in info.items():
        if "gpus" not in d:
            continue
        g = int(d.get("gpus") or 0)
        names = ", ".join(sorted(set(d.get("gpu_names") or [])))
        if g >= need:
            checks.append(Check("cuda", str(i), "PASS", f"{g} GPU(s) visible ({names}), {need} process(es)"))
        elif g == 0 and recipe.cpu_ok:
            checks.append(Check("cuda", str(i), "WARN", "no CUDA device visible: the job runs with gloo on CPU "
                                "(cpu_ok); nccl would fail", "use GPU nodes for real training"))
        elif g == 0:
            checks.append(Check("cuda", str(i), "FAIL", f"no CUDA device visible (torch {d.get('torch')}, CUDA "
                                f"build {d.get('cuda_version')}); backend nccl needs CUDA",
                                "use GPU nodes with the NVIDIA driver and a CUDA build of torch, or set cpu_ok: "
                                "true to run with gloo on CPU"))
        else:
            checks.append(Check("cuda", str(i), "FAIL", f"{g} GPU(s) visible but {need} process(es) per node",
                                "lower gpus_per_node or use nodes with more GPUs (check CUDA_VISIBLE_DEVICES)"))
    return checks


def _interface_checks(cluster: Any, recipe: "Recipe", info: dict[int, dict[str, Any]],
                      ifaces: dict[int, str]) -> list[Check]:
    """``interface``: which interface holds each node's private address (recorded in ``ifaces``); FAIL when none
    does (IPv6-only named as such) or when a forced GLOO/NCCL_SOCKET_IFNAME names another one."""
    checks = []
    for i, d in info.items():
        node = cluster.nodes[i]
        iface = d.get("private_iface")
        ifs = d.get("ifaces") or {}
        have = ", ".join(f"{k}={'/'.join(v['addrs']) or '-'}" for k, v in ifs.items())
        if not iface:
            checks.append(_no_interface(i, node.private_ip, d, have))
            continue
        ifaces[i] = iface
        forced = {v: (recipe.env | node.env).get(v) for v in IFNAME_VARS}
        wrong = {v: x for v, x in forced.items() if x and x != iface}
        if wrong:
            for var, val in wrong.items():
                exists = val.lstrip("^").split(",")[0] in ifs
                why = "does not exist" if not exists else \
                    f"holds {'/'.join(ifs[val]['addrs']) or 'no IPv4 address'}"
                if val.startswith("^") and var == "GLOO_SOCKET_IFNAME":
                    why = "is an exclusion list, which gloo rejects"
                checks.append(Check("interface", str(i), "FAIL",
                                    f"{var}={val} is forced but node {i}'s private address {node.private_ip} is on "
                                    f"{iface} ({val} {why}): the job would bind the wrong interface and hang",
                                    f"unset {var} or set {var}={iface}"))
        else:
            checks.append(Check("interface", str(i), "PASS", f"{node.private_ip} on {iface} (mtu "
                                f"{ifs.get(iface, {}).get('mtu')}); NCCL/GLOO_SOCKET_IFNAME={iface}"))
    return checks


def _no_interface(i: int, ip: str, d: dict[str, Any], have: str) -> Check:
    """The FAIL row of node ``i`` whose private address ``ip`` is on no IPv4 interface (``have``: what it has)."""
    v6 = d.get("private_iface6") or next((k for k, a in (d.get("ifaces6") or {}).items() if ip in a), None)
    if v6 or ":" in ip:
        return Check("interface", str(i), "FAIL", f"private address {ip} is IPv6-only (on {v6 or 'no interface'} "
                     f"of node {i}; IPv4: {have}): torchrun's master address, gloo/NCCL's socket interface and "
                     "these probes need an IPv4 private address", "give the nodes IPv4 private addresses (a "
                     "dual-stack subnet / VPC / VCN) and use those")
    return Check("interface", str(i), "FAIL", f"private address {ip} is on no interface of node {i} (has {have})",
                 "use the node's private IP from `ip -o -4 addr`")


def _mtu_checks(info: dict[int, dict[str, Any]], ifaces: dict[int, str], all_nodes: str) -> list[Check]:
    """``mtu``: the private interfaces' MTUs are equal (a mismatch drops large frames: a hang mid-training)."""
    mtus = {i: (info[i].get("ifaces") or {}).get(ifaces[i], {}).get("mtu") for i in ifaces}
    if len(mtus) <= 1:
        return []
    if len(set(mtus.values())) == 1:
        return [Check("mtu", all_nodes, "PASS", f"MTU {next(iter(mtus.values()))} on every node")]
    return [Check("mtu", all_nodes, "FAIL",
                  "MTU differs: " + ", ".join(f"node {i} {ifaces[i]}={m}" for i, m in mtus.items())
                  + " (large frames are dropped: the job hangs mid-training)",
                  "set one MTU on every node's private interface (`ip link set dev IF mtu N`), e.g. the smallest")]


def _tcp_checks(cluster: Any, master_port: int, info: dict[int, dict[str, Any]],
                net: tuple[dict[tuple[int, int], Any], dict[int, Any]], ifaces: dict[int, str]) -> list[Check]:
    """``tcp listen`` (a node that could not listen) and ``tcp i->j`` for every ordered pair, a failed one with its
    likely cause and fix (:func:`_cause`)."""
    checks = []
    pairs, lerr = net
    for j, e in lerr.items():
        fix = f"choose another --port (this one is in use on node {j})" if "listen on port" in str(e) else \
            f"check {cluster.python} on node {j}"
        checks.append(Check("tcp listen", str(j), "FAIL", str(e), fix))
    for (i, j), r in sorted(pairs.items()):
        label, nodes = f"tcp {i}->{j}", f"{i}->{j}"
        if isinstance(r, BaseException):
            checks.append(Check(label, nodes, "FAIL", f"probe failed: {r}", f"check {cluster.python} on node {i}"))
            continue
        parts, failed = [], []
        for x in r:
            kind = "master port " if (j == 0 and x["port"] == master_port) else "ephemeral port "
            parts.append(f"{kind}{x['port']} {x['state']} ({x['seconds']:.1f} s)")
            if x["state"] != "OPEN":
                failed.append(x)
        dst = cluster.nodes[j].private_ip
        if not failed:
            checks.append(Check(label, nodes, "PASS", f"{dst}: " + ", ".join(parts)))
        else:
            ips = {k: nd.private_ip for k, nd in enumerate(cluster.nodes)}
            cause, fix = _cause(failed[0]["state"], i, j, info, failed[0]["port"], ips, dict(ifaces),
                                tunnel=cluster.topology.value == "hybrid")
            checks.append(Check(label, nodes, "FAIL", f"{dst}: " + ", ".join(parts) + f"; likely cause: {cause}",
                                fix))
    return checks


def run_preflight(ssh: "SSHCluster", recipe: "Recipe", master_port: int) -> PreflightReport:
    """Run every check on the cluster behind ``ssh`` (connected, probe uploaded); never raises for a failing
    check (those are FAIL rows)."""
    t0 = time.monotonic()
    n = len(ssh.cluster.nodes)

    async def _all() -> tuple[list[Any], Any]:
        infos = asyncio.gather(*(_info(ssh, i) for i in range(n)), return_exceptions=True)
        net = asyncio.ensure_future(_network(ssh, master_port))
        got = await infos
        try:
            netres: Any = await net
        except Exception as e:
            netres = e
        return list(got), netres

    infos, net = ssh.loop.call(_all(), timeout=300)
    rep = _judge(ssh, recipe, master_port, infos, net)
    rep.wall_s = time.monotonic() - t0
    return rep


def detect_ifaces(ssh: "SSHCluster") -> dict[int, str]:
    """{node: interface holding its private address} via ``ip -o -4 addr`` (used when preflight is skipped)."""
    out: dict[int, str] = {}
    res = ssh.gather([ssh.arun(i, "ip -o -4 addr show", timeout=30) for i in range(len(ssh.cluster.nodes))], 60)
    for i, r in enumerate(res):
        if isinstance(r, BaseException):
            continue
        for line in r[1].splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[3].split("/")[0] == ssh.cluster.nodes[i].private_ip:
                out[i] = parts[1].split("@")[0]
    return out
