"""What a ``broker slurm up`` cluster's nodes are given, as pure text: the cluster's state (:class:`ClusterState`,
:class:`NodeFacts`), ``slurm.conf`` and ``gres.conf``, the daemons' start and stop scripts, the cloud boot script
and the NFS share, and the parsers of what the nodes answer (facts, ``sinfo``).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from broker.core.provider import BadInput, ProviderError


Say = Callable[[str], None]
#: the cluster's state beside the run (no secrets in it)
STATE_FILE = "slurmcluster.json"
CTLD_PORT = 6817
SLURMD_PORT = 6818
PARTITION = "broker"
#: the shared directory on cloud VMs (NFS from node 0)
CLOUD_SHARED_DIR = "/srv/broker-shared"
CLOUD_BASE = "/var/lib/broker-slurm"
SLURM_BINARIES = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue",
                  "scontrol", "scancel")


# --------------------------------------------------------------------------------------------------- values
@dataclass
class NodeFacts:
    """One node as Slurm sees it: ``name`` (``node<i>``, the Slurm NodeName), SSH endpoint, private address,
    ``hostname`` (``hostname -s``), ``cpus`` (nproc), ``memory_mb`` (MemTotal in MiB), ``gpus`` (count) and the
    GPU device indices (``/dev/nvidia<i>``) it owns."""

    name: str
    host: str
    private_ip: str
    port: int = 22
    user: str = "root"
    hostname: str = ""
    cpus: int = 1
    memory_mb: int = 1
    gpus: int = 0
    gpu_devices: list[int] = field(default_factory=list)
    gpu_name: str = ""
    #: the name its host key is pinned under (by resource id); "" = by address (a state file from before)
    host_key_alias: str = ""


@dataclass
class ClusterState:
    """What ``slurm status|down`` and ``run --cluster`` need (``<run dir>/slurmcluster.json``; no secrets)."""

    cluster_id: str
    name: str
    provider: str
    base: str
    shared_dir: str
    shared_note: str
    python: str
    ssh_key_path: str | None
    known_hosts_path: str | None
    nodes: list[NodeFacts]
    munge_socket: str
    netns_cid: str | None = None
    #: the account munged runs as and that owns its key (0400) and folder: ``munge`` (the package's) on cloud
    #: VMs, root on netns nodes (their folders live under this machine's run folder, which only root may enter)
    munge_user: str = "root"
    ctld_port: int = CTLD_PORT
    slurmd_port: int = SLURMD_PORT

    @property
    def conf(self) -> str:
        return f"{self.base}/etc/slurm.conf"

    def node_dir(self, i: int) -> str:
        return f"{self.base}/nodes/node{i}"

    @property
    def spool_dir(self) -> str:
        """slurmd's spool on each node's own ``/run`` (short: slurmstepd's socket paths must fit in 108 bytes)."""
        return f"/run/broker-slurmd-{self.cluster_id[-6:]}"

    @property
    def ctld_dir(self) -> str:
        return f"{self.base}/ctld"

    def save(self, run_dir: Path) -> None:
        (Path(run_dir) / STATE_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> "ClusterState":
        p = Path(run_dir) / STATE_FILE
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise BadInput(f"no Slurm cluster state in {run_dir} ({e})",
                           hint="is this a cluster id from `broker slurm up`? `broker status` lists runs") from None
        d["nodes"] = [NodeFacts(**n) for n in d["nodes"]]
        return cls(**d)

    def to_json(self) -> dict[str, Any]:
        return {"cluster_id": self.cluster_id, "name": self.name, "provider": self.provider,
                "shared_dir": self.shared_dir,
                "nodes": [{"name": n.name, "host": n.host, "private_ip": n.private_ip, "cpus": n.cpus,
                           "memory_mb": n.memory_mb, "gpus": n.gpus} for n in self.nodes]}


# --------------------------------------------------------------------------------------------------- rendering
def render_slurm_conf(*, cluster_name: str, controller: str, controller_addr: str, nodes: list[NodeFacts],
                      base: str, munge_socket: str, spool_dir: str, ctld_port: int = CTLD_PORT,
                      slurmd_port: int = SLURMD_PORT, max_minutes: int | None = None) -> str:
    """The cluster's ``slurm.conf``: slurmctld on node 0 (``controller`` = node 0's ``hostname -s``, which
    slurmctld compares with its own), every node a slurmd with its real CPUs, memory (MiB) and GPUs (``Gres``),
    state, pid and log files under ``base``, MUNGE through ``munge_socket``, one default partition ``broker``.

    ``spool_dir``: slurmd's spool (``/run/broker-slurmd-<tag>``, each node's own ``/run``): slurmstepd creates
    Unix sockets there and a socket path may not exceed 108 bytes, which a spool under a deep run folder does
    (measured: "Unix socket path ... is too long. (119 > 108)", the job requeued and held)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", cluster_name):
        raise BadInput(f"cluster name {cluster_name!r}: letters, digits, '-' and '_' only (at most 40)")
    lines = [
        f"ClusterName={cluster_name.lower()}",
        f"SlurmctldHost={controller}({controller_addr})",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={base}/ctld/state",
        f"SlurmctldPidFile={base}/ctld/slurmctld.pid",
        f"SlurmctldLogFile={base}/ctld/slurmctld.log",
        f"SlurmdSpoolDir={spool_dir}/%n",
        f"SlurmdPidFile={base}/nodes/%n/slurmd.pid",
        f"SlurmdLogFile={base}/nodes/%n/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "MinJobAge=300",
        "KillWait=5",
    ]
    if any(n.gpus for n in nodes):
        lines.append("GresTypes=gpu")
    for n in nodes:
        gres = f" Gres=gpu:{n.gpus}" if n.gpus else ""
        lines.append(f"NodeName={n.name} NodeAddr={n.private_ip} CPUs={n.cpus} RealMemory={n.memory_mb}{gres} "
                     "State=UNKNOWN")
    limit = str(max_minutes) if max_minutes else "INFINITE"
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(n.name for n in nodes)} Default=YES MaxTime={limit} "
                 "State=UP")
    return "\n".join(lines) + "\n"


def render_gres_conf(nodes: list[NodeFacts]) -> str:
    """``gres.conf``: one line per GPU node naming its device files (``/dev/nvidia<i>``); empty without GPUs."""
    out = []
    for n in nodes:
        if not n.gpus:
            continue
        devs = n.gpu_devices or list(range(n.gpus))
        files = (f"/dev/nvidia{devs[0]}" if len(devs) == 1 else
                 "/dev/nvidia[" + ",".join(str(d) for d in devs) + "]")
        out.append(f"NodeName={n.name} Name=gpu File={files}")
    return "\n".join(out) + ("\n" if out else "")


FACTS_CMD = ("echo NPROC=$(nproc); grep '^MemTotal:' /proc/meminfo; echo HOST=$(hostname -s); "
             "(nvidia-smi --query-gpu=index,name --format=csv,noheader 2>/dev/null | sed 's/^/GPU=/') || true; "
             "for b in " + " ".join(SLURM_BINARIES) + "; do command -v $b >/dev/null 2>&1 || "
             "[ -x /usr/sbin/$b ] || echo MISSING=$b; done")


def parse_facts(out: str) -> dict[str, Any]:
    """The output of :data:`FACTS_CMD` -> ``cpus``, ``memory_mb``, ``hostname``, ``gpus`` [(index, name)],
    ``missing`` [binary names].  Raises ProviderError when a count cannot be read."""
    cpus = mem_kb = None
    host = ""
    gpus: list[tuple[int, str]] = []
    missing: list[str] = []
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("NPROC=") and line[6:].isdigit():
            cpus = int(line[6:])
        elif line.startswith("MemTotal:"):
            m = re.search(r"(\d+)\s*kB", line)
            mem_kb = int(m.group(1)) if m else None
        elif line.startswith("HOST="):
            host = line[5:]
        elif line.startswith("GPU="):
            idx, _, name = line[4:].partition(",")
            if idx.strip().isdigit():
                gpus.append((int(idx), name.strip()))
        elif line.startswith("MISSING="):
            missing.append(line[8:])
    if cpus is None or mem_kb is None:
        raise ProviderError("slurm", "node facts", f"cannot read nproc / MemTotal from the node: {out.strip()[-300:]}")
    return {"cpus": cpus, "memory_mb": mem_kb // 1024, "hostname": host, "gpus": gpus, "missing": missing}


def cgroup_mount_script(mounts_text: str | None = None) -> str:
    """Shell that mounts this machine's cgroup layout again on ``/sys/fs/cgroup`` (run inside a netns node's
    mount namespace, where ``ip netns exec`` left ``/sys/fs/cgroup`` empty and slurmd would fail with "No
    filesystem mounted on /sys/fs/cgroup").  ``mounts_text``: ``/proc/self/mounts`` of this machine."""
    text = mounts_text if mounts_text is not None else Path("/proc/self/mounts").read_text()
    mounts = [line.split() for line in text.splitlines() if len(line.split()) >= 4]
    v1 = [(m[1], m[3]) for m in mounts if m[2] == "cgroup" and m[1].startswith("/sys/fs/cgroup/")]
    v2 = [m[1] for m in mounts if m[2] == "cgroup2" and m[1].startswith("/sys/fs/cgroup")]
    if "/sys/fs/cgroup" in v2:
        return "mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup"
    cmds = ["mountpoint -q /sys/fs/cgroup || mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup"]
    for path, opts in v1:
        keep = [o for o in opts.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev", "noexec")]
        if all(o.startswith("name=") for o in keep):
            keep = ["none", *keep]
        cmds.append(f"mkdir -p {path} && (mountpoint -q {path} || mount -t cgroup -o {','.join(keep)} cgroup {path})")
    for path in v2:
        cmds.append(f"mkdir -p {path} && (mountpoint -q {path} || mount -t cgroup2 none {path})")
    return " && ".join(cmds)


def munged_argv(state: ClusterState, i: int) -> list[str]:
    d = state.node_dir(i)
    return ["munged", f"--key-file={d}/munge/munge.key", f"--socket={state.munge_socket}",
            f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge/munged.log",
            f"--seed-file={d}/munge/munged.seed"]


def start_script(state: ClusterState, i: int, *, cgroups: str | None) -> str:
    """The shell run as root over SSH on node ``i`` to start its daemons (the key and the configs are already
    there): munged as ``state.munge_user`` (and a ``munge | unmunge`` round trip), slurmctld on node 0, then slurmd
    ``-N node<i>``.  Every daemon daemonizes itself; stdio goes to ``<node dir>/*.console``; pid files under
    ``<base>``."""
    q = shlex.quote
    d = state.node_dir(i)
    sock = state.munge_socket
    sockdir = sock.rsplit("/", 1)[0]
    mu = state.munge_user
    as_mu = "" if mu == "root" else f"runuser -u {q(mu)} -- "  # munged checks its key is its own user's
    lines = ["set -e", f"mkdir -p {q(sockdir)} {q(state.spool_dir)}/node{i}", f"chmod 755 {q(sockdir)}"]
    if mu != "root":
        lines.append(f"chown {q(mu)}: {q(sockdir)}")
    lines += [as_mu + " ".join(q(a) for a in munged_argv(state, i)) + f" </dev/null >>{q(d)}/munged.console 2>&1",
             f"for k in $(seq 100); do [ -S {q(sock)} ] && break; sleep 0.1; done",
             f"munge -n -S {q(sock)} | unmunge -S {q(sock)} >/dev/null"]
    if i == 0:
        lines += [f"mkdir -p {q(state.ctld_dir)}/state",
                  f"slurmctld -i -f {q(state.conf)} </dev/null >>{q(state.ctld_dir)}/slurmctld.console 2>&1"]
    if cgroups:
        lines.append(cgroups)
    lines.append(f"slurmd -f {q(state.conf)} -N node{i} </dev/null >>{q(d)}/slurmd.console 2>&1")
    return "\n".join(lines) + "\n"


#: pid files of a node's daemons, in stop order (slurmd first: it may still run job steps)
def pid_files(state: ClusterState, i: int) -> list[str]:
    d = state.node_dir(i)
    files = [f"{d}/slurmd.pid"]
    if i == 0:
        files.append(f"{state.ctld_dir}/slurmctld.pid")
    files.append(f"{d}/munge/munged.pid")
    return files


def stop_script(state: ClusterState, i: int, grace_s: float = 10.0) -> str:
    """Shell that stops node ``i``'s daemons by PID (SIGTERM, SIGKILL after ``grace_s``) and prints
    ``STILL=<pid>`` for any that needed SIGKILL.  A zombie counts as stopped (``kill -0`` still succeeds on one
    until its parent reaps it, which a container's PID 1 may do late).  A pid file's PID is signalled only while
    that process is the daemon the file is named after (``/proc/PID/comm``): a pid file outlives its daemon and
    the PID may be someone else's by then (on an emulated node, a process of this machine)."""
    q = shlex.quote
    files = " ".join(q(f) for f in pid_files(state, i))
    steps = max(1, int(grace_s * 10))
    return ("alive() { [ -r /proc/$1/stat ] && ! grep -q ') Z ' /proc/$1/stat 2>/dev/null; }; "
            f"pids=''; for f in {files}; do [ -s \"$f\" ] && p=$(cat \"$f\") && alive \"$p\" && "
            "[ \"$(cat /proc/$p/comm 2>/dev/null)\" = \"$(basename \"$f\" .pid)\" ] && "
            f"kill -TERM \"$p\" && pids=\"$pids $p\"; done; "
            f"for k in $(seq {steps}); do left=''; for p in $pids; do alive $p && left=\"$left $p\"; "
            f"done; [ -z \"$left\" ] && break; sleep 0.1; done; "
            f"for p in $pids; do alive $p && kill -KILL $p && echo STILL=$p; done; "
            "echo STOPPED=$(echo $pids | wc -w)")


# --------------------------------------------------------------------------------------------------- cloud boot
def cloud_onstart(shared_dir: str = CLOUD_SHARED_DIR) -> str:
    """The boot script every cloud node runs (``NodeRequest.onstart``, which the OCI and AWS adapters embed in
    their cloud-init user data after the dead-man switch): install Slurm, MUNGE and the NFS server and client
    without starting the distribution's own slurmd/slurmctld (broker starts its own with its own config), and
    create the shared directory.  Node 0's private address is known only after boot, so the export and the mounts
    are done over SSH (:func:`nfs_server_script`, :func:`nfs_client_script`)."""
    q = shlex.quote
    return "\n".join([
        "export DEBIAN_FRONTEND=noninteractive",
        "for k in 1 2 3 4 5; do apt-get update -q && apt-get install -y -q slurm-wlm munge nfs-kernel-server "
        "nfs-common && break; sleep 10; done",
        "systemctl disable --now slurmd slurmctld 2>/dev/null || true",
        f"mkdir -p {q(shared_dir)}",
        "touch /var/lib/broker-slurm-packages.done",
    ]) + "\n"


def export_line(shared_dir: str, cidr: str) -> str:
    """``/etc/exports`` line: the private network only, read-write, root kept (jobs run as root)."""
    return f"{shared_dir} {cidr}(rw,sync,no_subtree_check,no_root_squash)"


def mount_loop(server_ip: str, shared_dir: str, tries: int = 60) -> str:
    q = shlex.quote
    return (f"for k in $(seq {tries}); do mountpoint -q {q(shared_dir)} && break; mount -t nfs -o vers=4,hard "
            f"{q(server_ip)}:{q(shared_dir)} {q(shared_dir)} && break; sleep 5; done; mountpoint -q {q(shared_dir)}")


def nfs_server_script(shared_dir: str, cidr: str) -> str:
    """Shell run on node 0 over SSH: export ``shared_dir`` to ``cidr`` (the private network) and reload."""
    q = shlex.quote
    return (f"set -e; mkdir -p {q(shared_dir)} /etc/exports.d; chmod 1777 {q(shared_dir)}; "
            f"echo {q(export_line(shared_dir, cidr))} > /etc/exports.d/broker.exports; "
            "systemctl enable --now nfs-server >/dev/null 2>&1 || systemctl restart nfs-kernel-server; exportfs -ra")


def nfs_client_script(server_ip: str, shared_dir: str) -> str:
    """Shell run on nodes 1.. over SSH: mount node 0's ``shared_dir`` at the same path."""
    return f"set -e; mkdir -p {shlex.quote(shared_dir)}; " + mount_loop(server_ip, shared_dir)


def private_cidr(ips: list[str]) -> str:
    """The /24 that holds every private address (our clusters live in one subnet); wider when they differ."""
    import ipaddress

    nets = {ipaddress.ip_network(f"{ip}/24", strict=False) for ip in ips}
    if len(nets) == 1:
        return str(nets.pop())
    return str(ipaddress.ip_network(f"{ips[0]}/16", strict=False))


#: cloud nodes: slurmd needs a cgroup file system; a VM has one (systemd), a container-like node may not
CLOUD_CGROUPS = "mountpoint -q /sys/fs/cgroup || [ -n \"$(ls -A /sys/fs/cgroup 2>/dev/null)\" ] || {{ {script}; }}"


def sinfo_cmd(state: ClusterState) -> str:
    return f"SLURM_CONF={shlex.quote(state.conf)} sinfo -h -N -o '%N|%T|%c|%G'"


def parse_sinfo_nodes(out: str) -> list[dict[str, Any]]:
    """``sinfo -h -N -o '%N|%T|%c|%G'`` -> [{"name", "state", "cpus", "gpus"}] (one row per node)."""
    rows: dict[str, dict[str, Any]] = {}
    for line in out.strip().splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4:
            continue
        name, state, cpus, gres = parts[:4]
        gpus = 0
        for g in gres.split(","):
            m = re.match(r"gpu(?::[^:(]+)?:(\d+)", g.strip())
            if m:
                gpus += int(m.group(1))
        rows[name] = {"name": name, "state": state.rstrip("*~#!%$@^-"), "cpus": int(cpus) if cpus.isdigit() else None,
                      "gpus": gpus}
    return list(rows.values())
