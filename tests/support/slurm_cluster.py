"""A real two-node Slurm 22.05 cluster on this machine, for tests (see docs/reference/local-cluster.md section 5).

Layout (everything under one temporary directory, nothing in /etc, no systemd):

* a bridge ``sl<hex>br`` with 198.19.X.1/24 in the root namespace and two network namespaces ``sl<hex>n0`` /
  ``sl<hex>n1`` (198.19.X.10 / .20) with no default route; X is random and unused, so concurrent clusters and the
  198.18.0.0/16 namespaces of other tests never meet;
* ``munged`` (foreground, socket in a 0755 directory) and ``slurmctld`` in the root namespace, on a free port;
  ``SlurmctldHost`` is generated from ``hostname -s`` of the root namespace (slurmctld refuses to start when it
  does not match);
* one ``slurmd`` inside each namespace, in its own mount + UTS namespace (``unshare --mount --uts``) where it has
  the hostname ``node0``/``node1``, a cluster ``/etc/hosts`` bind-mounted, and ``/sys/fs/cgroup`` mounted again
  (``ip netns exec`` remounts ``/sys``, which leaves it empty and slurmd fails with "No filesystem mounted on
  /sys/fs/cgroup").  Those mounts live and die with the node's mount namespace.

Every daemon runs in the foreground as a child of the test process (``ip netns exec`` and ``unshare`` exec, so the
child's PID is the daemon's); :meth:`SlurmCluster.stop` stops them by PID (SIGTERM, SIGKILL after a grace),
deletes the namespaces and the bridge, and reports anything left over.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)),
                                      None)


def why_not_available() -> str | None:
    """None when a cluster can be started here; else why not (a pytest skip reason)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, munged and slurmd as root)"
    missing = [b for b in SLURM_BINARIES + ("ip", "unshare") if not _which(b)]
    if missing:
        return (f"missing {', '.join(missing)}: install Debian's slurm-wlm and munge "
                "(apt-get install -y slurm-wlm munge; scripts/test does it when run as root)")
    if not Path("/var/run/netns").exists() and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        return "ip netns does not work here"
    return None


def _used_third_octets() -> set[int]:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    used = set()
    for tok in out.split():
        if tok.startswith("198.19."):
            used.add(int(tok.split(".")[2]))
    return used


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _cgroup_mount_script() -> str:
    """Shell that mounts this host's cgroup layout again on ``/sys/fs/cgroup`` (inside a node's mount ns)."""
    cmds = []
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    v1 = [(m[1], m[3]) for m in mounts if m[2] == "cgroup" and m[1].startswith("/sys/fs/cgroup/")]
    v2 = [m[1] for m in mounts if m[2] == "cgroup2" and m[1].startswith("/sys/fs/cgroup")]
    if "/sys/fs/cgroup" in v2:  # pure cgroup v2 host
        return "mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup"
    cmds.append("mountpoint -q /sys/fs/cgroup || mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup")
    for path, opts in v1:
        keep = [o for o in opts.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev", "noexec")]
        if all(o.startswith("name=") for o in keep):  # a named hierarchy without controllers (systemd)
            keep = ["none", *keep]
        cmds.append(f"mkdir -p {path} && (mountpoint -q {path} || mount -t cgroup -o {','.join(keep)} cgroup {path})")
    for path in v2:
        cmds.append(f"mkdir -p {path} && (mountpoint -q {path} || mount -t cgroup2 none {path})")
    return " && ".join(cmds)


class SlurmCluster:
    """munged + slurmctld + two slurmd (node0, node1) in network namespaces; see the module docstring.

    Use :meth:`start` / :meth:`stop` (``stop`` is idempotent and safe after a failed ``start``); ``env`` holds
    ``SLURM_CONF`` for the client commands (sbatch, squeue, ...).
    """

    NODES = ("node0", "node1")

    def __init__(self, root: Path, *, cpus_per_node: int = 2):
        self.root = Path(root)
        self.tag = secrets.token_hex(2)
        self.prefix = f"sl{self.tag}"
        used = _used_third_octets()
        self.octet = random.choice([x for x in range(1, 255) if x not in used])
        self.net = f"198.19.{self.octet}"
        self.bridge = f"{self.prefix}br"
        self.namespaces = [f"{self.prefix}n{i}" for i in range(len(self.NODES))]
        self.addrs = {n: f"{self.net}.{(i + 1) * 10}" for i, n in enumerate(self.NODES)}
        self.gateway = f"{self.net}.1"
        self.controller = socket.gethostname().split(".")[0]
        self.cpus = cpus_per_node
        self.ctld_port = _free_port()
        self.slurmd_port = 16818
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "etc" / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._net_up = False

    # ------------------------------------------------------------------------------------------- setup
    def _sh(self, *argv: str) -> None:
        subprocess.run(list(argv), check=True, capture_output=True, text=True)

    def _network_up(self) -> None:
        self._net_up = True
        self._sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        self._sh("ip", "link", "set", self.bridge, "up")
        for i, (node, ns) in enumerate(zip(self.NODES, self.namespaces)):
            veth, peer = f"{self.prefix}v{i}", f"{self.prefix}p{i}"
            self._sh("ip", "netns", "add", ns)
            self._sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            self._sh("ip", "link", "set", peer, "netns", ns)
            self._sh("ip", "link", "set", veth, "master", self.bridge)
            self._sh("ip", "link", "set", veth, "up")
            self._sh("ip", "-n", ns, "link", "set", peer, "name", "eth0")
            self._sh("ip", "-n", ns, "addr", "add", f"{self.addrs[node]}/24", "dev", "eth0")
            self._sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._sh("ip", "-n", ns, "link", "set", "eth0", "up")

    def _write_files(self) -> None:
        r = self.root
        # munged refuses a socket unless every directory above it is world-executable (pytest's tmp dirs are 0700:
        # callers pass a directory made with mode 0755, see new_root())
        os.chmod(r, 0o755)
        for d in ("etc", "munge", "state", "log", "run", "spool"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge-run").mkdir(exist_ok=True)
        os.chmod(r / "munge", 0o700)
        os.chmod(r / "munge-run", 0o755)
        key = r / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        hosts = ["127.0.0.1 localhost", f"{self.gateway} {self.controller}"]
        hosts += [f"{a} {n}" for n, a in self.addrs.items()]
        (r / "etc" / "hosts").write_text("\n".join(hosts) + "\n")
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
                          for n, a in self.addrs.items())
        self.conf.write_text(f"""\
ClusterName=brk{self.tag}
SlurmctldHost={self.controller}({self.gateway})
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge-run/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
{nodes}
PartitionName=debug Nodes={','.join(self.NODES)} Default=YES MaxTime=30 State=UP
""")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.console", "wb")
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()

    def client(self, *argv: str, timeout: float = 20) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        """Bring everything up and wait until ``sinfo`` shows both nodes idle; raises RuntimeError with the
        daemons' logs otherwise (call :meth:`stop` in any case)."""
        self._write_files()
        self._network_up()
        r = self.root
        self._spawn("munged", [_which("munged"), "--foreground", f"--key-file={r}/munge/munge.key",
                               f"--socket={r}/munge-run/munge.socket", f"--pid-file={r}/munge/munged.pid",
                               f"--log-file={r}/munge/munged.log", f"--seed-file={r}/munge/munged.seed"])
        sock = r / "munge-run" / "munge.socket"
        self._wait(lambda: sock.exists(), 10, "munged socket")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        cgroups = _cgroup_mount_script()
        for node, ns in zip(self.NODES, self.namespaces):
            inner = (f"hostname {node} && mount --bind {r}/etc/hosts /etc/hosts && {cgroups} && "
                     f"exec {_which('slurmd')} -D -N {node} -f {self.conf}")
            self._spawn(f"slurmd-{node}", ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts",
                                           "sh", "-c", inner])
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start-up:\n{self.logs()}")
            out = self.client("sinfo", "-h", "-o", "%T %D")
            if out.returncode == 0 and out.stdout.split() == ["idle", "2"]:
                return self
            time.sleep(0.3)
        raise RuntimeError(f"nodes not idle after {timeout_s:.0f} s (sinfo: {out.stdout.strip()!r} "
                           f"{out.stderr.strip()!r}):\n{self.logs()}")

    @staticmethod
    def _wait(pred, timeout_s: float, what: str) -> None:
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def logs(self, n: int = 20) -> str:
        """The last ``n`` lines of every daemon log (for failure messages)."""
        out = []
        for p in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if p.is_file():
                out.append(f"--- {p.name}")
                out += p.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(out)

    # ------------------------------------------------------------------------------------------- teardown
    def stop(self, grace_s: float = 5.0) -> list[str]:
        """Stop every daemon by PID, delete namespaces and bridge; returns what was left over (should be [])."""
        # slurmd first (they may still run job steps), then the controller, then munged
        order = [n for n in self.procs if n.startswith("slurmd")] + [n for n in ("slurmctld", "munged")
                                                                      if n in self.procs]
        for name in order:
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for name in order:
            p = self.procs[name]
            try:
                p.wait(timeout=max(0.1, grace_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        leftovers: list[str] = []
        # job steps (slurmstepd and its children) run inside the namespaces: kill whatever is still there
        for ns in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    leftovers.append(f"process {pid} in {ns} (killed)")
                except ProcessLookupError:
                    pass
        if self._net_up:
            for ns in self.namespaces:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self._net_up = False
        for ns in self.namespaces:
            if Path(f"/var/run/netns/{ns}").exists():
                leftovers.append(f"namespace {ns}")
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            leftovers.append(f"bridge {self.bridge}")
        for name, p in self.procs.items():
            if p.poll() is None:
                leftovers.append(f"{name} pid {p.pid} still running")
        return leftovers


def new_root() -> Path:
    """A fresh 0755 directory under /tmp for one cluster (munged needs world-executable parents)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="broker-slurm-"))
    os.chmod(root, 0o755)
    return root


def leftover_processes(root: Path) -> list[str]:
    """Live (non-zombie) processes whose command line mentions ``root`` (the cluster's config and state)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(root) in cmd and state != "Z":
            found.append(f"{d.name}: {cmd.strip()}")
    return found


def cluster_fixture():
    """Generator for a pytest fixture: skip when Slurm cannot run here, else a started cluster, always stopped
    (daemons by PID, namespaces and bridge deleted) and checked for leftovers afterwards."""
    import pytest

    why = why_not_available()
    if why:
        pytest.skip(f"real Slurm tests: {why}")
    root = new_root()
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        left += leftover_processes(root)
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"left over after stopping the Slurm cluster: {left}"
