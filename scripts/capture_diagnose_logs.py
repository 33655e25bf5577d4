"""Capture the real CPU/gloo logs behind tests/diagnose_logs/cpu/<case>/ (run as root: one case mounts a tmpfs).

    .venv/bin/python scripts/capture_diagnose_logs.py [CASE...]

Each case runs tests/diagnose_logs/scripts/fault.py MODE through broker's own local launcher (two torchrun nodes
on this machine, the rank-facts shim in front of the script) and keeps what the run left: nodeN.log, the rank
facts (nodeN/facts/rank*.json) and result.json (status, exit codes, failed node).  The GPU-only cases were
captured on a 2x H200 host (bench/results/h200x2_diagnose_capture.txt).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from broker.run.launch import RANKSHIM, LocalLaunchSpec, free_port, run_local, torchrun_argv  # noqa: E402
from broker.run.supervisor import LocalNode, Supervisor, finish_result  # noqa: E402

SCRIPTS = REPO / "tests" / "diagnose_logs" / "scripts"
OUT = REPO / "tests" / "diagnose_logs" / "cpu"
BASE_ENV = {"PYTHONWARNINGS": "ignore", "FAULT_TIMEOUT_S": "5", "CUDA_VISIBLE_DEVICES": ""}


def spec(mode: str, env: dict[str, str] | None = None, port: int | None = None) -> LocalLaunchSpec:
    return LocalLaunchSpec(script_rel="fault.py", args=[mode], workdir=SCRIPTS, nnodes=2, nproc_per_node=1,
                           env={**BASE_ENV, **(env or {})}, node_envs=[{}, {}], setup=[], expect=[],
                           deadline_s=90, master_port=port)


def keep(case: str, run_dir: Path, res) -> None:
    dst = OUT / case
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for log in sorted(run_dir.glob("node*.log")):
        shutil.copy(log, dst / log.name)
    for f in sorted(run_dir.glob("node*/facts/rank*.json")):
        (dst / f.parent.parent.name / "facts").mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dst / f.parent.parent.name / "facts" / f.name)
    (dst / "result.json").write_text(json.dumps({"status": res.status, "reason": res.reason,
                                                 "exit_codes": {str(k): v for k, v in res.exit_codes.items()},
                                                 "failed_node": res.failed_node}, indent=1) + "\n")
    print(f"{case}: {res.status} {res.exit_codes} {res.reason}", flush=True)


def case_eaddrinuse(tmp: Path):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        return run_local(spec("ok", port=port), tmp, echo=None)


def case_loopback_refused(tmp: Path):
    """Two nodes in two network namespaces (the netns provider's network), each with its host name mapped to
    127.0.1.1 in its /etc/hosts as Debian/Ubuntu do, no *_SOCKET_IFNAME: gloo on each node binds and advertises
    127.0.1.1, and the peer, connecting to 127.0.1.1 in its own namespace, is refused."""
    from broker.providers import netns

    tmp.mkdir(parents=True, exist_ok=True)
    c = netns.up(2, tmp, use_gpus=False)
    try:
        port = 29577
        logs = {i: tmp / f"node{i}.log" for i in range(2)}
        nodes = []
        for i in range(2):
            work = tmp / f"node{i}" / "work"
            shutil.copytree(SCRIPTS, work)
            hosts = tmp / f"hosts{i}"
            hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 node{i}\n" +
                             "".join(f"{c.ip(j)} node{j}x\n" for j in range(2)))
            logs[i].write_text("")
            argv = torchrun_argv("fault.py", ["ok"], nnodes=2, nproc_per_node=1, node_rank=i, master_addr=c.ip(0),
                                 master_port=port, shim=str(RANKSHIM), facts_dir=str(tmp / f"node{i}" / "facts"))
            inner = f"mount --bind {hosts} /etc/hosts && hostname node{i} && exec " + " ".join(argv)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_", "MASTER_"))}
            env.update(BASE_ENV, BROKER_NODE_RANK=str(i), PYTHONUNBUFFERED="1")
            nodes.append(LocalNode(i, ["ip", "netns", "exec", c.ns(i), "unshare", "--mount", "--uts", "sh", "-c",
                                       inner], env, work))
        res = Supervisor(logs, echo=None).run(nodes, deadline_s=40)
        return finish_result(res, [], nnodes=2, nproc_per_node=1)
    finally:
        c.down()


def case_disk_full(tmp: Path):
    mnt = Path(tempfile.mkdtemp(prefix="broker-enospc-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        return run_local(spec("disk_full", {"FAULT_DIR": str(mnt)}), tmp, echo=None)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def case_netns(mode: str):
    """``mode`` on two netns hosts (own host name and /etc/hosts each, no *_SOCKET_IFNAME), master = node 0's IP:
    what a script that names localhost as its rendezvous does on two real machines."""
    def run(tmp: Path):
        from broker.providers import netns

        tmp.mkdir(parents=True, exist_ok=True)
        c = netns.up(2, tmp, use_gpus=False)
        try:
            logs = {i: tmp / f"node{i}.log" for i in range(2)}
            nodes = []
            for i in range(2):
                work = tmp / f"node{i}" / "work"
                shutil.copytree(SCRIPTS, work)
                hosts = tmp / f"hosts{i}"
                hosts.write_text(f"127.0.0.1 localhost\n{c.ip(i)} node{i}\n")
                logs[i].write_text("")
                argv = torchrun_argv("fault.py", [mode], nnodes=2, nproc_per_node=1, node_rank=i,
                                     master_addr=c.ip(0), master_port=29577, shim=str(RANKSHIM),
                                     facts_dir=str(tmp / f"node{i}" / "facts"))
                inner = f"mount --bind {hosts} /etc/hosts && hostname node{i} && exec " + " ".join(argv)
                env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_", "MASTER_"))}
                env.update(BASE_ENV, BROKER_NODE_RANK=str(i), PYTHONUNBUFFERED="1")
                nodes.append(LocalNode(i, ["ip", "netns", "exec", c.ns(i), "unshare", "--mount", "--uts", "sh",
                                           "-c", inner], env, work))
            res = Supervisor(logs, echo=None).run(nodes, deadline_s=60)
            return finish_result(res, [], nnodes=2, nproc_per_node=1)
        finally:
            c.down()
    return run


def case_no_torch(tmp: Path):
    """The nodes' Python has no torch (a venv that was never set up): torchrun itself cannot start."""
    sp = spec("ok")
    sp.python = "/usr/bin/python3"
    return run_local(sp, tmp, echo=None)


def case_deadline(tmp: Path):
    """A hang that reaches the run's deadline (no stall watch): broker stops both nodes."""
    sp = spec("hang", {"FAULT_TIMEOUT_S": "300"})
    sp.deadline_s = 12
    return run_local(sp, tmp, echo=None)


def case_interrupted(tmp: Path):
    """Ctrl-C during a hang: SIGINT reaches broker (the nodes run in their own sessions), which stops them."""
    import signal
    import threading

    sp = spec("hang", {"FAULT_TIMEOUT_S": "300"})
    threading.Timer(12, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    return run_local(sp, tmp, echo=None)


CASES = {
    "ok": lambda t: run_local(spec("ok"), t, echo=None),
    "eaddrinuse": case_eaddrinuse,
    "loopback_refused": case_loopback_refused,
    "iface_not_found": lambda t: run_local(spec("iface", {"GLOO_SOCKET_IFNAME": "bogus0"}), t, echo=None),
    "gloo_unsupported": lambda t: run_local(spec("gloo_unsupported"), t, echo=None),
    "succeeded_with_errors": lambda t: run_local(spec("gloo_unsupported_caught"), t, echo=None),
    "nccl_no_gpu": lambda t: run_local(spec("nccl_no_gpu"), t, echo=None),
    "gloo_timeout": lambda t: run_local(spec("timeout"), t, echo=None),
    "early_exit": lambda t: run_local(spec("early_exit"), t, echo=None),
    "slurm_procid": lambda t: run_local(spec("slurm_procid", {"SLURM_PROCID": "0"}), t, echo=None),
    "disk_full": case_disk_full,
    "sigkill": lambda t: run_local(spec("sigkill"), t, echo=None),
    "world_size4": lambda t: run_local(spec("world_size4"), t, echo=None),
    "shapes": lambda t: run_local(spec("shapes"), t, echo=None),
    "slow_rank": lambda t: run_local(spec("slow", {"FAULT_SLOW_S": "9"}), t, echo=None),
    "cuda_on_cpu": lambda t: run_local(spec("cuda_on_cpu"), t, echo=None),
    "ddp_unused": lambda t: run_local(spec("ddp_unused"), t, echo=None),
    "ddp_models": lambda t: run_local(spec("ddp_models"), t, echo=None),
    "comment_text": lambda t: run_local(spec("comment_text"), t, echo=None),
    "no_torch": case_no_torch,
    "deadline": case_deadline,
    "interrupted": case_interrupted,
    "silent_wrong": lambda t: run_local(spec("silent_wrong"), t, echo=None),
    "no_set_epoch": lambda t: run_local(spec("no_set_epoch"), t, echo=None),
    "tcp_localhost": case_netns("tcp_localhost"),
    "master_env": case_netns("master_env"),
}


def main(argv: list[str]) -> int:
    names = argv[1:] or list(CASES)
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"diag-{name}-") as d:
            res = CASES[name](Path(d) / "run")
            keep(name, Path(d) / "run", res)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
