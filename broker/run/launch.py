"""Launching and supervising one ``torchrun`` per node.

Pieces:

* :func:`torchrun_argv` -- the exact ``torchrun --nnodes --nproc_per_node --node_rank --master_addr --master_port``
  command line of one node (static rendezvous: node 0 = rank 0).
* :func:`free_port` -- a free TCP port (29500 may be taken).
* :class:`NodeHandle` -- a running node (local subprocess here; the SSH runner implements the same protocol).
* :class:`Supervisor` -- streams every node's output prefixed ``[node i]`` to the console and to a per-node log
  file; stops every node as soon as one fails (a lone torchrun otherwise waits for its peer until the rendezvous
  timeout, and torchelastic's exit barrier ignores SIGTERM, hence SIGKILL after a short grace); enforces a
  wall-clock deadline; Ctrl-C stops every node cleanly.
* :class:`LocalExecutor` -- the ``local`` topology end to end: fresh per-node working directories, ``setup`` once
  per node, N torchrun processes on this machine with per-node ``CUDA_VISIBLE_DEVICES``.

The training script decides its backend (nccl where CUDA exists, gloo otherwise); nothing here imports torch.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from broker.run.executor import Executor
from broker.run.supervisor import (LocalNode, NodeHandle, RunResult, Supervisor, _private_opener, describe_exit,
                                   finish_result, log_tail)
from broker.run.artifacts import ArtifactBudget, collect_local, record_artifacts

if TYPE_CHECKING:
    from broker.run.staging import StagePlan


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_argv(script: str, args: Iterable[str], *, nnodes: int, nproc_per_node: int, node_rank: int,
                  master_addr: str, master_port: int, python: str | None = None,
                  extra: Iterable[str] = (), shim: str | None = None, facts_dir: str | None = None) -> list[str]:
    """argv of one node's torchrun (``python -m torch.distributed.run`` so the venv's torch is used).

    ``shim``: the path of :mod:`broker.run.rankshim` on the node; torchrun then runs ``shim --facts FACTS_DIR --
    script args`` (the script unchanged, each rank's facts written to ``facts_dir``), and is itself started by the
    shim (``shim --torchrun``) so that node 0's rendezvous store listens on ``master_addr`` only, not on every
    interface (:func:`broker.run.rankshim._torchrun`)."""
    start = [shim, "--torchrun"] if shim else ["-m", "torch.distributed.run"]
    head = [python or sys.executable, *start,
            f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}", f"--node_rank={node_rank}",
            f"--master_addr={master_addr}", f"--master_port={master_port}", *extra]
    if shim:
        return [*head, shim, *(["--facts", facts_dir] if facts_dir else []), "--", script, *args]
    return [*head, script, *args]


#: the rank-facts shim (stdlib only) that torchrun runs in front of the user's script
RANKSHIM = Path(__file__).with_name("rankshim.py")


# --------------------------------------------------------------------------------------------------- local runs
def prepare_node_dirs(workdir: Path, run_dir: Path, nnodes: int, plan: "StagePlan | None" = None,
                      say: "Callable[[str], None] | None" = None) -> list[Path]:
    """A fresh copy of the staged ``workdir`` (:mod:`broker.run.staging`) per node: ``run_dir/node<i>/work``.
    Returns the work dirs.  A slow copy (:data:`broker.run.staging.SLOW_COPY_S`) is explained to ``say``
    (:func:`broker.run.staging.copy_hint`); ``-v`` logs how each file was copied."""
    import logging

    from broker.run.staging import copy_hint, copy_staged, stage_plan

    plan = plan or stage_plan(workdir)
    out = []
    total: dict[str, int] = {}
    t0 = time.monotonic()
    for i in range(nnodes):
        dst = run_dir / f"node{i}" / "work"
        for way, n in copy_staged(plan, dst).items():
            total[way] = n if way == "reflink_refused" else total.get(way, 0) + n
        out.append(dst)
    took = time.monotonic() - t0
    logging.getLogger("broker.run.launch").info("copied the work folder to %d node folder(s) in %.2f s: %s", nnodes,
                                                took, ", ".join(f"{k} {v}" for k, v in total.items()))
    hint = copy_hint(total, took, nnodes, Path(workdir), out[0]) if out else ""
    if hint and say:
        say(hint)
    return out


#: inherited variables that steer rendezvous, ranks and sockets: a value left in the user's shell (an old
#: ``GLOO_SOCKET_IFNAME``, an ``salloc``'s ``SLURM_PROCID``) silently breaks a local run, so the nodes only get them
#: when the recipe (or the provider's per-node layer) sets them
INHERITED_DROP_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "TORCHELASTIC_", "PMI_", "OMPI_COMM_WORLD_")
INHERITED_DROP_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK",
                                  "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"})
#: kept although they match: host safety settings (NVLink multicast off on shared hosts), debug output, and
#: ``NCCL_VERSION``, which NVIDIA's container images set as a label (it configures nothing: dropping it only made
#: every run in such an image say so)
INHERITED_KEEP = frozenset({"NCCL_NVLS_ENABLE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_VERSION"})


def _steers_rendezvous(name: str) -> bool:
    return name not in INHERITED_KEEP and (name in INHERITED_DROP_NAMES or name.startswith(INHERITED_DROP_PREFIXES))


def dropped_inherited(base: dict[str, str], *layers: dict[str, str]) -> list[str]:
    """Names in ``base`` that :func:`node_environment` does not pass on (no layer sets them), sorted."""
    set_by_layers = {k for layer in layers for k in layer}
    return sorted(k for k in base if _steers_rendezvous(k) and k not in set_by_layers)


def dropped_line(names: list[str]) -> str:
    """The line that says which inherited variables a local run did not pass to its nodes ('' for none)."""
    if not names:
        return ""
    return ("not passed to the nodes (inherited from this shell, not set by the recipe): " + ", ".join(names)
            + "; set them in the recipe's env to use them")


def node_environment(base: dict[str, str], *layers: dict[str, str]) -> dict[str, str]:
    """``base`` (usually os.environ) without its rendezvous/rank/socket variables (:func:`dropped_inherited`) and
    without the cloud credentials broker itself reads (:func:`broker.core.private.credential_names`: a local job is
    not given the user's VAST_API_KEY / AWS_* / OCI_* / TS_AUTHKEY; the recipe's ``secrets:`` pass one on),
    overlaid with ``layers``; unbuffered Python for live logs."""
    from broker.core.private import credential_names

    drop = set(dropped_inherited(base, *layers)) | set(credential_names(base))
    env = {k: v for k, v in base.items() if k not in drop}
    for layer in layers:
        env.update(layer)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


#: ``<run>/launch.txt``: each node's exact torchrun command line (broker's internal launch through the rank shim).
#: It is kept out of the node logs ``broker logs`` shows: the user's log is the user's output, not broker's plumbing.
LAUNCH_FILE = "launch.txt"


def record_launch(run_dir: Path, node: int, argv: list[str]) -> None:
    """Append node ``node``'s launch command ``argv`` to ``run_dir/launch.txt`` (owner-only) and to the debug log
    (``-v``); never into the node's log.  Never raises (the launch must not fail for its record)."""
    import logging

    cmd = " ".join(shlex.quote(a) for a in argv)
    logging.getLogger("broker.run.launch").debug("node %d: $ %s", node, cmd)
    try:
        with open(Path(run_dir) / LAUNCH_FILE, "a", encoding="utf-8", opener=_private_opener) as f:
            f.write(f"node {node}: $ {cmd}\n")
    except OSError:
        pass


def python_first_path(python: str | None, path: str | None) -> str:
    """``PATH`` with the training interpreter's ``bin/`` first, so ``setup`` commands' ``python``/``pip`` are the
    ones torchrun uses (the venv's, not whatever comes first on the user's PATH)."""
    bindir = str(Path(python or sys.executable).parent)
    rest = [p for p in (path or os.defpath).split(os.pathsep) if p and p != bindir]
    return os.pathsep.join([bindir, *rest])


def run_setup(commands: list[str], cwd: Path, env: dict[str, str], log_path: Path, node_rank: int,
              echo: Callable[[str], None] | None, timeout_s: float) -> tuple[int, str]:
    """Run each setup command with bash in ``cwd``; returns (exit code, failing command or '')."""
    for cmd in commands:
        with open(log_path, "a", encoding="utf-8", opener=_private_opener) as f:
            f.write(f"$ {cmd}\n")
        if echo:
            echo(f"[node {node_rank}] $ {cmd}")
        node = LocalNode(node_rank, ["bash", "-c", cmd], env, cwd)
        res = Supervisor({node_rank: log_path}, echo=echo).run([node], deadline_s=timeout_s)
        if not res.ok:
            return (res.exit_codes.get(node_rank) or 1), cmd
    return 0, ""


@dataclass
class LocalLaunchSpec:
    """Everything :class:`LocalExecutor` needs; built by the pipeline from a recipe and the target."""

    script_rel: str  # script path relative to workdir
    args: list[str]
    workdir: Path
    nnodes: int
    nproc_per_node: int
    env: dict[str, str]
    node_envs: list[dict[str, str]]
    setup: list[str]
    expect: list[str]
    deadline_s: float | None
    master_port: int | None = None
    python: str | None = None
    artifacts: list[str] = field(default_factory=list)
    stall_s: float | None = None  # seconds without output before the ranks' stacks are sampled (None: no watch)
    on_stall: str = "stop"
    #: the recipe's checkpoint_dir (left out of the staged files unless ``resume_checkpoint``)
    checkpoint_dir: str | None = None
    resume_checkpoint: bool = False


def local_argvs(spec: LocalLaunchSpec, port: int, node_dirs: list[Path]) -> list[list[str]]:
    """The per-node torchrun argv for a local run (master 127.0.0.1); each rank's facts go to
    ``<run>/node<i>/facts`` (:mod:`broker.run.rankshim`)."""
    return [torchrun_argv(spec.script_rel, spec.args, nnodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
                          node_rank=i, master_addr="127.0.0.1", master_port=port, python=spec.python,
                          extra=[f"--log-dir={node_dirs[i].parent / 'torchrun'}"], shim=str(RANKSHIM),
                          facts_dir=str(node_dirs[i].parent / "facts"))
            for i in range(spec.nnodes)]


class LocalExecutor(Executor):
    """The job as ``spec.nnodes`` nodes that are processes on this machine (topology ``local``, and the ``fake``
    cloud whose instances are this machine): fresh per-node work folders under ``run_dir/node<i>/work``,
    ``setup`` once per node, one torchrun per node with its own ``CUDA_VISIBLE_DEVICES``, master ``127.0.0.1``."""

    def __init__(self, spec: LocalLaunchSpec, run_dir: Path, *, echo: Callable[[str], None] | None = print,
                 say: Callable[[str], None] | None = None):
        self.spec = spec
        self.run_dir = Path(run_dir)
        self.echo = echo
        self.say = say
        self.t0 = time.monotonic()
        self.logs = {i: self.run_dir / f"node{i}.log" for i in range(spec.nnodes)}
        self.dirs: list[Path] = []
        self.envs: list[dict[str, str]] = []

    def stage(self) -> RunResult | None:
        from broker.core.private import private_dirs, write_private

        spec = self.spec
        private_dirs(self.run_dir)
        dropped = dropped_line(dropped_inherited(dict(os.environ), spec.env, *spec.node_envs))
        for p in self.logs.values():
            write_private(p, f"broker: {dropped}\n" if dropped else "")
        if dropped and self.echo:
            self.echo(f"[broker] {dropped}")
        from broker.run.staging import recipe_stage_plan

        plan = recipe_stage_plan(spec.workdir, spec.script_rel, spec.args, checkpoint_dir=spec.checkpoint_dir,
                                 resume_checkpoint=spec.resume_checkpoint)
        from broker.run.executor import staging_line

        line = staging_line(plan, self.run_dir)
        hints: list[str] = []
        self.dirs = prepare_node_dirs(spec.workdir, self.run_dir, spec.nnodes, plan, say=hints.append)
        if self.say:  # "staged" once the copies exist (a slow copy's why after it), not before the copying
            for text in [line, *hints]:
                self.say(text)
        path = python_first_path(spec.python, os.environ.get("PATH"))
        self.envs = [node_environment(dict(os.environ), spec.env,
                                      spec.node_envs[i] if i < len(spec.node_envs) else {},
                                      {"BROKER_NODE_RANK": str(i), "PATH": path})
                     for i in range(spec.nnodes)]
        return None

    def launch(self) -> RunResult:
        spec = self.spec
        if spec.setup:
            for i in range(spec.nnodes):
                code, cmd = run_setup(spec.setup, self.dirs[i], self.envs[i], self.logs[i], i, self.echo,
                                      timeout_s=spec.deadline_s or 3600)
                if code != 0:
                    return RunResult(status="failed", exit_codes={i: code}, wall_s=time.monotonic() - self.t0,
                                     log_paths=self.logs, failed_node=i, tail=log_tail(self.logs[i]),
                                     reason=f"setup command failed on node {i} (exit {describe_exit(code)}): {cmd}")
        port = spec.master_port or free_port()
        argvs = local_argvs(spec, port, self.dirs)
        for i, argv in enumerate(argvs):
            record_launch(self.run_dir, i, argv)
        nodes: list[NodeHandle] = []
        sup = Supervisor(self.logs, echo=self.echo)
        if spec.stall_s:
            from broker.run.stall import StallWatch, local_sampler
            sup.stall = StallWatch(spec.stall_s, local_sampler(d.parent / "facts" for d in self.dirs),
                                   on_stall=spec.on_stall, run_dir=self.run_dir, echo=self.echo,
                                   world_size=spec.nnodes * spec.nproc_per_node)
        try:
            for i, argv in enumerate(argvs):
                nodes.append(LocalNode(i, argv, self.envs[i], self.dirs[i]))
        except BaseException:
            sup.stop_all(nodes)
            raise
        remaining = None if spec.deadline_s is None else max(1.0, spec.deadline_s - (time.monotonic() - self.t0))
        return sup.run(nodes, deadline_s=remaining)

    def checkpoint_source(self, rel_dir: str):
        """``rel_dir`` in the node work folders here (made by :meth:`stage`): node 0's copied back, every node's
        restored (:class:`broker.run.checkpoint.NodeFoldersSource`)."""
        from broker.run.checkpoint import NodeFoldersSource

        return NodeFoldersSource(lambda: self.dirs, rel_dir)

    def collects(self) -> bool:
        return bool(self.spec.artifacts)

    def collect(self, result: RunResult) -> None:
        if not self.spec.artifacts:
            return
        found: dict[int, list[str]] = {}
        refused: dict[int, list[str]] = {}
        budget = ArtifactBudget()
        for i, d in enumerate(self.dirs):
            found[i], refused[i] = collect_local(d, self.spec.artifacts, self.run_dir / "artifacts" / f"node{i}",
                                                 budget, node=i)
        record_artifacts(result, self.spec.artifacts, found, self.run_dir, self.echo, refused)

    def finish(self, result: RunResult) -> RunResult:
        result.wall_s = time.monotonic() - self.t0
        return finish_result(result, self.spec.expect, nnodes=self.spec.nnodes,
                             nproc_per_node=self.spec.nproc_per_node)
