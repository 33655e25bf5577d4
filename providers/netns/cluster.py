"""The netns emulation's machinery: network namespaces with their own sshd on this machine, their ids, their
addresses (:mod:`broker.run.subnets`), fault injection and removal.  The layout and the faults are described in
the package's docstring (:mod:`broker.providers.netns`); the two-site layout of the emulated ``hybrid`` topology is
:mod:`broker.providers.netns.sites`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from broker.core.model import TopologyKind
from broker.core.provider import BadInput, ProviderError
from broker.core.sshkeys import host_key_name
from broker.run.subnets import LOCK_NAME, SUBNET_BASE, lock_path  # noqa: F401 - the address plan, shared with hybrid
from broker.run.subnets import subnet_lock as _subnet_lock
from broker.run.subnets import used_subnets as _used_subnets

if TYPE_CHECKING:
    from broker.core.records import Cluster, ClusterNode

#: every object this provider creates starts with this (namespaces, bridge, veths)
PREFIX = "bkn"
_CID = re.compile(rf"^({PREFIX}[0-9a-f]{{6}})(?:br|n\d+|v\d+)$")
#: a whole cluster id, nothing else
CID_RE = re.compile(rf"{PREFIX}[0-9a-f]{{6}}")


def check_cid(cid: str) -> str:
    """``cid`` when it is a whole cluster id (``bkn`` + 6 hex digits); BadInput otherwise (never a prefix match)."""
    if not isinstance(cid, str) or not CID_RE.fullmatch(cid):
        raise BadInput(f"not a netns cluster id: {cid!r} (an id is 'bkn' and 6 hex digits, e.g. bkn1a2b3c)",
                       hint="`broker netns status` lists the clusters on this machine; `broker netns down --all` "
                            "removes every one")
    return cid


def cid_of(name: str) -> str | None:
    """The cluster id a namespace / link name belongs to (None when it is not one of this provider's)."""
    m = _CID.match(name)
    return m.group(1) if m else None
INJECTS = ("firewall", "wrong-iface", "mtu")
SSHD = "/usr/sbin/sshd"


def sshd_path() -> str | None:
    """The sshd binary: ``$BROKER_SSHD`` (absolute), else /usr/sbin/sshd, else ``sshd`` on PATH."""
    for cand in (os.environ.get("BROKER_SSHD"), SSHD, shutil.which("sshd")):
        if cand and os.path.isabs(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _run(argv: list[str], *, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise ProviderError("netns", " ".join(argv[:4]), f"exit {p.returncode}: {(p.stderr or p.stdout).strip()}",
                            hint="run as root on Linux with iproute2 installed")
    return p


def missing_requirements() -> str | None:
    """None when this machine can host a netns cluster; else what is missing (for skips and `check`)."""
    if sys.platform != "linux":
        return "the netns provider needs Linux"
    if os.geteuid() != 0:
        return "the netns provider needs root (ip netns, unshare, mount)"
    for tool in ("ip", "unshare", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install iproute2 util-linux openssh-client)"
    if sshd_path() is None:
        return "sshd is not installed (apt-get install openssh-server)"
    return None


def _ns_list() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def gpu_count() -> int:
    """GPUs on this machine (nvidia-smi, else the driver's /proc listing; see providers.local), 0 without."""
    from broker.providers.local import detect_gpus

    return len(detect_gpus())


@dataclass
class NetnsCluster:
    """A running netns cluster; ``state.json`` in ``root`` holds the same fields (for ``broker netns down``)."""

    cid: str
    root: Path
    subnet: int
    n: int
    inject: str | None = None
    sshd_pids: list[int] = field(default_factory=list)
    gpus_per_node: int = 0  # 0 = no GPUs handed out
    #: the account SSH logs into: root (this provider's own clusters), or an image's login user with passwordless
    #: sudo (emulated cloud VMs, where root cannot log in)
    login_user: str = "root"

    @property
    def bridge(self) -> str:
        return f"{self.cid}br"

    def ns(self, i: int) -> str:
        return f"{self.cid}n{i}"

    def veth(self, i: int) -> str:
        return f"{self.cid}v{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.{10 + i}"

    @property
    def gateway(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.1"

    @property
    def key_path(self) -> Path:
        return self.root / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.root / "ssh" / "known_hosts"

    def save(self) -> None:
        d = asdict(self)
        d["root"] = str(self.root)
        (self.root / "state.json").write_text(json.dumps(d, indent=2))

    @classmethod
    def load(cls, root: Path) -> "NetnsCluster":
        d = json.loads((Path(root) / "state.json").read_text())
        d["root"] = Path(d["root"])
        return cls(**d)

    # ---------------------------------------------------------------- the Cluster the runner uses
    def cluster(self, run_id: str) -> Cluster:
        from broker.core.records import Cluster, ClusterNode

        nodes = []
        for i in range(self.n):
            env: dict[str, str] = {}
            gpus = None
            if self.gpus_per_node:
                gpus = [str(i * self.gpus_per_node + k) for k in range(self.gpus_per_node)]
                env["NCCL_HOSTID"] = f"{self.cid}-node{i}"  # distinct host hash -> NCCL's NET transport
            if self.inject == "wrong-iface":
                env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = "lo"
            nodes.append(ClusterNode(node_rank=i, host=self.ip(i), port=22, user=self.login_user, private_ip=self.ip(i),
                                     gpu_indices=gpus, resource_id=f"{self.cid}:{i}", env=env))
        return Cluster(run_id=run_id, provider="netns", topology=TopologyKind.multi_node, nodes=nodes,
                       ssh_key_path=str(self.key_path), known_hosts_path=str(self.known_hosts),
                       python=sys.executable, workroot=str(self.root / "work"), local_exec=False)

    # ---------------------------------------------------------------- lifecycle
    def down(self) -> list[str]:
        """Kill the sshd's and everything else inside the namespaces, delete namespaces and bridge.

        Idempotent; returns what was removed.  Never raises for things already gone.
        """
        removed = remove_cid(self.cid, sshd_pids=self.sshd_pids)
        return removed


def _kill_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if sig == signal.SIGKILL:
        _reap(pids)


def _reap(pids: list[int]) -> None:
    """Collect the exit status of those of ``pids`` that are this process's children (wireguard-go and sshd started
    in-process), so none stays a zombie while this process lives; others are left to their parent."""
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except (ChildProcessError, OSError):
            pass


def _ns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def remove_cid(cid: str, *, sshd_pids: list[int] | None = None) -> list[str]:
    """Remove every namespace, veth and bridge of cluster ``cid`` and kill the processes inside.  Idempotent."""
    check_cid(cid)
    removed: list[str] = []
    # a recorded pid (state.json) is signalled only while it is still this cluster's sshd (its command line names
    # the cluster's own folder): the pid of an sshd that ended may belong to someone else by now
    ours = set(sshd_processes(cid)) if sshd_pids else set()
    sshd_pids = [p for p in sshd_pids or [] if p in ours]
    _kill_pids(list(sshd_pids or []), signal.SIGTERM)
    namespaces = [ns for ns in _ns_list() if cid_of(ns) == cid]
    for ns in namespaces:  # sshd session children and remote jobs outlive the sshd master: kill by PID
        _kill_pids(_ns_pids(ns), signal.SIGKILL)
    _kill_pids(list(sshd_pids or []), signal.SIGKILL)
    for ns in namespaces:
        for _ in range(20):
            p = _run(["ip", "netns", "del", ns], check=False)
            if p.returncode == 0 or ns not in _ns_list():
                removed.append(f"netns {ns}")
                break
            time.sleep(0.1)
    for link in _links():
        if cid_of(link) == cid:
            if _run(["ip", "link", "del", link], check=False).returncode == 0:
                removed.append(f"link {link}")
    removed += forget_hybrid_secrets(cid)  # a hybrid cluster's WireGuard keys (none for a plain cluster)
    return removed


def leftovers(cid: str | None = None) -> list[str]:
    """Namespaces and links with this provider's prefix (of one cluster when ``cid`` is given)."""
    out = [f"netns {ns}" for ns in _ns_list() if _CID.match(ns)]
    out += [f"link {ln}" for ln in _links() if _CID.match(ln)]
    if cid is not None:
        check_cid(cid)
        out = [x for x in out if cid_of(x.split()[1]) == cid]
    return out


def sshd_processes(cid: str | None = None) -> list[int]:
    """PIDs of sshd processes started by this provider (their command line names a ``bkn...`` config); of one
    cluster when ``cid`` is given (whole-id match: its state folder ``/netns/<cid>/`` is in the command line)."""
    if cid is not None:
        check_cid(cid)
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "sshd" in cmd and "/netns/" in cmd and re.search(rf"/netns/{PREFIX}[0-9a-f]{{6}}/", cmd):
            if cid is None or f"/netns/{cid}/" in cmd:
                pids.append(int(d.name))
    return pids


def down_all() -> list[str]:
    """Remove every leftover netns cluster on this machine (by prefix), also ones whose state file is lost."""
    cids = sorted({c for x in leftovers() if (c := cid_of(x.split()[1]))})
    removed: list[str] = []
    for pid in sshd_processes():
        _kill_pids([pid], signal.SIGKILL)
        removed.append(f"sshd pid {pid}")
    for cid in cids:
        removed += remove_cid(cid)
    return removed


def new_cid() -> str:
    """A fresh cluster id: ``bkn`` + 6 hex digits."""
    return PREFIX + secrets.token_hex(3)


def up(n: int, run_dir: Path, *, inject: str | None = None, gpus_per_node: int = 1,
       use_gpus: bool | None = None, ssh_wait_s: float = 15.0, cid: str | None = None,
       login_user: str = "root") -> NetnsCluster:
    """Bring up an ``n``-node cluster with state under ``run_dir/netns/<cid>``; returns it once every sshd
    accepts connections (about 0.3 s for 2 nodes).

    ``use_gpus``: None = hand out GPUs when this machine has n * gpus_per_node of them.  ``cid``: a
    :func:`new_cid` chosen beforehand (so the ledger can record it before creation).  ``login_user``: another
    account than root makes the nodes behave like a cloud image (:func:`_login_user_setup`): that user with
    passwordless sudo and its own home, root login refused.  On any failure the partial cluster is removed and
    ProviderError is raised.
    """
    why = missing_requirements()
    if why:
        raise ProviderError("netns", "up", why, hint="run as root on Linux with openssh-server and iproute2")
    if inject is not None and inject not in INJECTS:
        raise BadInput(f"unknown fault {inject!r}", hint=f"choose one of: {', '.join(INJECTS)}")
    if not 1 <= n <= 200:
        raise BadInput(f"a netns cluster has 1..200 nodes, not {n}")
    if use_gpus is None:
        use_gpus = gpu_count() >= n * gpus_per_node
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", login_user):
        raise BadInput(f"login user {login_user!r}: a lower-case user name")
    if login_user != "root" and not shutil.which("sudo"):
        raise ProviderError("netns", "up", f"sudo is not installed: login user {login_user} needs passwordless sudo",
                            hint="apt-get install sudo")
    cid = cid or new_cid()
    check_cid(cid)
    root = Path(run_dir).resolve() / "netns" / cid  # the cid in every path: sshd_processes() finds them
    root.mkdir(parents=True, exist_ok=True)
    with _subnet_lock() as lock:  # subnet choice and creation are atomic among parallel callers
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = _used_subnets()
        free = [x for x in range(1, 255) if x not in used]
        if not free:
            raise ProviderError("netns", "up", "no free /24 left in 198.18.0.0/16",
                                hint="remove leftovers with `broker netns down --all`")
        subnet = free[secrets.randbelow(len(free))]
        c = NetnsCluster(cid=cid, root=root, subnet=subnet, n=n, inject=inject,
                         gpus_per_node=gpus_per_node if use_gpus else 0, login_user=login_user)
        c.save()
        try:
            _create_network(c)
        except BaseException:
            c.down()
            raise
    try:
        _start_sshds(c, ssh_wait_s)
        _inject(c)
    except BaseException:
        c.down()
        raise
    c.save()
    return c


def _create_network(c: NetnsCluster) -> None:
    _run(["ip", "link", "add", c.bridge, "type", "bridge"])
    _run(["ip", "addr", "add", f"{c.gateway}/24", "dev", c.bridge])
    _run(["ip", "link", "set", c.bridge, "up"])
    for i in range(c.n):
        ns, veth, peer = c.ns(i), c.veth(i), f"{c.cid}p{i}"
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", peer, "netns", ns])
        _run(["ip", "link", "set", veth, "master", c.bridge])
        _run(["ip", "link", "set", veth, "up"])
        _run(["ip", "-n", ns, "link", "set", peer, "name", "eth0"])
        _run(["ip", "-n", ns, "addr", "add", f"{c.ip(i)}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])


def _sshd_config(c: NetnsCluster, i: int, d: Path, path_env: str) -> str:
    root = c.login_user == "root"
    keys = c.root / "ssh" / "authorized_keys" if root else ".ssh/authorized_keys"  # the user's: it reads them
    return "\n".join([
        "Port 22", f"ListenAddress {c.ip(i)}", f"HostKey {d / 'ssh_host_ed25519_key'}", f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {keys}", f"PermitRootLogin {'prohibit-password' if root else 'no'}",
        "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        "StrictModes no", "UseDNS no", "PrintMotd no", "PrintLastLog no", "MaxSessions 64", "MaxStartups 64:30:128",
        "Subsystem sftp internal-sftp", f"SetEnv PATH={path_env}", ""])


def _python_dirs() -> str:
    """This interpreter's folder, then the one holding ``torchrun`` of the environment torch is installed in (a venv
    that borrows another's packages has no ``torchrun`` of its own): what a node's PATH starts with."""
    import importlib.util

    dirs = [str(Path(sys.executable).parent)]
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        for parent in Path(spec.origin).parents:
            if (parent / "bin" / "torchrun").exists():
                dirs.append(str(parent / "bin"))
                break
    return ":".join(dict.fromkeys(dirs))


def _start_sshds(c: NetnsCluster, wait_s: float, *, only: int | None = None) -> None:
    """Start every node's sshd (``only``: node ``only``'s alone, a host whose sshd is gone) and wait until each
    answers; a node without a host key gets a new one."""
    ssh_dir = c.root / "ssh"
    ssh_dir.mkdir(parents=True, exist_ok=True)
    if not c.key_path.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"broker-{c.cid}", "-f", str(c.key_path)])
    shutil.copy(f"{c.key_path}.pub", ssh_dir / "authorized_keys")
    hosts = ["127.0.0.1 localhost", f"{c.gateway} gw"] + [f"{c.ip(i)} node{i}" for i in range(c.n)]
    (c.root / "hosts").write_text("\n".join(hosts) + "\n")
    path_env = f"{_python_dirs()}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    # root's ~/.bashrc may put another python first (pyenv): each node gets its own
    (c.root / "node_bashrc").write_text(f"export PATH={path_env}\n")
    known = []
    for i in range(c.n):
        d = c.root / f"node{i}"
        (d / "run" / "sshd").mkdir(parents=True, exist_ok=True)
        os.chmod(d / "run", 0o755)
        os.chmod(d / "run" / "sshd", 0o755)
        key = d / "ssh_host_ed25519_key"
        if not key.exists():
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"node{i}", "-f", str(key)])
        pub = Path(f"{key}.pub").read_text().split()
        # by address for `ssh -F <root>/ssh/config`, by resource id for broker (host keys are pinned per machine)
        known.append(f"{c.ip(i)},{host_key_name(c.ip(i), 22, f'{c.cid}:{i}')} {pub[0]} {pub[1]}")
        (d / "sshd_config").write_text(_sshd_config(c, i, d, path_env))
    c.known_hosts.write_text("\n".join(known) + "\n")
    # `ssh -F <root>/ssh/config node1` from the root namespace (node names resolve only inside the nodes)
    (ssh_dir / "config").write_text("".join(
        f"Host node{i} {c.ip(i)}\n  HostName {c.ip(i)}\n  User {c.login_user}\n  IdentityFile {c.key_path}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {c.known_hosts}\n  StrictHostKeyChecking yes\n"
        f"  BatchMode yes\n  ConnectTimeout 5\n  LogLevel ERROR\n" for i in range(c.n)))
    bashrc = Path.home() / ".bashrc"
    sshd = sshd_path()
    account_files = _account_files(c.root, c.login_user)
    started = range(c.n) if only is None else [only]
    for i in started:
        d = c.root / f"node{i}"
        mounts = [f"mount --bind {d / 'run'} /run", f"mount --bind {c.root / 'hosts'} /etc/hosts"]
        if c.login_user != "root":
            mounts += _login_user_setup(c, i)
        elif bashrc.exists():
            mounts.append(f"mount --bind {c.root / 'node_bashrc'} {bashrc}")
        mounts += [f"mount --bind {src} {dst}" for src, dst in account_files]
        if c.login_user != "root":  # its home is its own once this node's passwd names it
            mounts.append(f"chown {c.login_user}: /home/{c.login_user} /home/{c.login_user}/.ssh")
        script = " && ".join(mounts + [f"hostname node{i}", f"exec {sshd} -D -e -f {d / 'sshd_config'}"])
        log = open(d / "sshd.log", "ab")
        # ip -> unshare -> sh -> sshd is one exec chain, so the Popen pid is sshd's pid
        p = subprocess.Popen(["ip", "netns", "exec", c.ns(i), "unshare", "--mount", "--uts", "sh", "-c", script],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        c.sshd_pids.append(p.pid)
    c.save()
    deadline = time.monotonic() + wait_s
    for i in started:
        while True:
            try:
                with socket.create_connection((c.ip(i), 22), timeout=1) as s:
                    s.settimeout(1)
                    if s.recv(4).startswith(b"SSH"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                log = (c.root / f"node{i}" / "sshd.log").read_text(errors="replace")[-500:]
                raise ProviderError("netns", "sshd", f"sshd on node{i} ({c.ip(i)}) did not accept within "
                                    f"{wait_s:.0f} s; its log: {log.strip() or '(empty)'}")
            time.sleep(0.05)


def _free_id(text: str, field: int, start: int = 2000) -> int:
    used = {int(f[field]) for f in (ln.split(":") for ln in text.splitlines()) if len(f) > field and f[field].isdigit()}
    return next(x for x in range(start, 60000) if x not in used)


def _account_files(root: Path, login_user: str = "root") -> list[tuple[Path, str]]:
    """Node-private copies of /etc/passwd and /etc/shadow when sshd needs what the host lacks: the ``sshd``
    privilege-separation user (hosts without openssh-server installed), an unlocked root entry (with
    ``UsePAM no`` sshd refuses a ``!``-locked account even for key login) and a ``login_user`` other than root
    (with its own group, home ``/home/<user>``, an unlocked ``*`` password: key login only).  Bind-mounted only
    inside the nodes' mount namespaces; the host's files are never changed."""
    out: list[tuple[Path, str]] = []
    try:
        passwd = Path("/etc/passwd").read_text()
    except OSError:
        return out
    extra = ""
    if not any(line.startswith("sshd:") for line in passwd.splitlines()):
        extra += "sshd:x:65533:65534:sshd:/run/sshd:/usr/sbin/nologin\n"
    user_line = shadow_line = ""
    if login_user != "root" and not any(ln.startswith(f"{login_user}:") for ln in passwd.splitlines()):
        group = Path("/etc/group").read_text()
        uid, gid = _free_id(passwd, 2), _free_id(group, 2)
        extra += f"{login_user}:x:{uid}:{gid}:{login_user}:/home/{login_user}:/bin/bash\n"
        (root / "group").write_text(group.rstrip("\n") + f"\n{login_user}:x:{gid}:\n")
        out.append((root / "group", "/etc/group"))
        shadow_line = f"{login_user}:*:19000:0:99999:7:::"
        user_line = login_user
    if extra:
        (root / "passwd").write_text(passwd.rstrip("\n") + "\n" + extra)
        out.append((root / "passwd", "/etc/passwd"))
    try:
        shadow = Path("/etc/shadow").read_text()
    except OSError:
        return out
    lines = shadow.splitlines()
    fixed = [("root:*:" + ln.split(":", 2)[2]) if ln.startswith("root:!") and ln.count(":") >= 2 else ln
             for ln in lines] + ([shadow_line] if user_line else [])
    if fixed != lines:
        (root / "shadow").write_text("\n".join(fixed) + "\n")
        os.chmod(root / "shadow", 0o600)
        out.append((root / "shadow", "/etc/shadow"))
    return out


def _login_user_setup(c: NetnsCluster, i: int) -> list[str]:
    """Shell (run as root inside node ``i``'s new mount namespace, before sshd) that makes it look like a cloud
    image whose login user is ``c.login_user``: its home ``/home/<user>`` (this node's own folder
    ``<root>/node<i>/home``, with ``.ssh/authorized_keys`` = the cluster's), ``/etc/sudoers.d`` granting it
    passwordless sudo, and this machine's Python reachable by it (a folder under a 0700 home such as
    ``/root/.pyenv`` is shown through a 0755 tmpfs on that home, in this namespace only)."""
    import stat

    u = c.login_user
    d = c.root / f"node{i}"
    home = d / "home"
    (home / u / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / u / ".ssh" / "authorized_keys").touch()
    sudoers = c.root / "sudoers.d"
    sudoers.mkdir(exist_ok=True)
    os.chmod(sudoers, 0o755)
    rule = sudoers / "90-broker-login"
    rule.write_text(f"{u} ALL=(ALL) NOPASSWD:ALL\n")
    os.chmod(rule, 0o440)
    lines = [f"mount --bind {home} /home", f"mount --bind {c.root / 'ssh' / 'authorized_keys'} "
             f"/home/{u}/.ssh/authorized_keys", f"mount --bind {sudoers} /etc/sudoers.d"]
    blocked: dict[str, set[str]] = {}
    for p in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}:
        parts = Path(p).parts
        for k in range(1, len(parts) - 1):
            a = Path(*parts[:k + 1])
            if not os.stat(a).st_mode & stat.S_IXOTH:
                blocked.setdefault(str(a), set()).add(str(a / parts[k + 1]))
                break
    for k, (a, children) in enumerate(sorted(blocked.items())):
        for j, child in enumerate(sorted(children)):
            keep = d / f"expose{k}-{j}"
            keep.mkdir(exist_ok=True)
            lines.append(f"mount --bind {child} {keep}")
        lines.append(f"mount -t tmpfs -o mode=755 tmpfs {a}")
        for j, child in enumerate(sorted(children)):
            lines.append(f"mkdir -p {child} && mount --bind {d / f'expose{k}-{j}'} {child}")
    return lines


def _inject(c: NetnsCluster) -> None:
    if c.inject == "firewall":
        if not shutil.which("iptables"):
            raise ProviderError("netns", "inject firewall", "iptables is not installed",
                                hint="apt-get install iptables")
        ns = c.ns(0)
        for rule in (["-i", "lo", "-j", "ACCEPT"],
                     ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                     ["-p", "tcp", "--dport", "22", "-j", "ACCEPT"],
                     ["-p", "tcp", "-j", "DROP"]):
            _run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", *rule])
    elif c.inject == "mtu" and c.n > 1:
        _run(["ip", "-n", c.ns(1), "link", "set", "eth0", "mtu", "1400"])


def hybrid_secrets(cid: str) -> list[Path]:
    """The WireGuard key folders of cluster ``cid`` under any run folder (``<runs>/*/netns/<cid>/wg``)."""
    from broker.core.config import runs_dir

    if not re.fullmatch(rf"{PREFIX}[0-9a-f]{{6}}", cid):
        return []
    return [p for p in runs_dir().glob(f"*/netns/{cid}/wg") if p.is_dir()]


def forget_hybrid_secrets(cid: str) -> list[str]:
    """Delete the WireGuard keys of cluster ``cid`` and wireguard-go's leftover sockets; returns what went."""
    from broker.run.wireguard import forget

    gone = []
    for p in hybrid_secrets(cid):
        for sock in p.parent.glob("node*/run/wireguard/*.sock"):  # wireguard-go's, left by a SIGKILL
            sock.unlink(missing_ok=True)
            gone.append(f"socket {sock}")
        if forget(p):
            gone.append(f"keys {p}")
    return gone
