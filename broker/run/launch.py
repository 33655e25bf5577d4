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
* :func:`run_local` -- the ``local`` topology end to end: fresh per-node working directories, ``setup`` once per
  node, N torchrun processes on this machine with per-node ``CUDA_VISIBLE_DEVICES``.

The training script decides its backend (nccl where CUDA exists, gloo otherwise); nothing here imports torch.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from broker.run.executor import Executor, describe_exit, run_steps  # noqa: F401 - describe_exit re-exported

if TYPE_CHECKING:
    from broker.run.staging import StagePlan
    from broker.run.stall import StallWatch

#: how long a node gets between SIGTERM and SIGKILL when it is stopped, seconds
STOP_GRACE_S = 3.0

_RANK_LINE = re.compile(r"RANK=(\d+) LOCAL_RANK=(\d+) WORLD_SIZE=(\d+) device=(\S+) backend=(\S+)")


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


# --------------------------------------------------------------------------------------------------- nodes
class NodeHandle(Protocol):
    """A running node's launcher process, local or remote."""

    node_rank: int

    def lines(self) -> Iterable[str]:
        """Output lines (stdout and stderr merged) until the process ends."""

    def poll(self) -> int | None:
        """Exit code, or None while running."""

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Terminate the node's processes: SIGTERM, then SIGKILL after ``grace_s``.  Idempotent."""


#: bytes read from a node's output at a time, and the pipe size asked for (Linux ``F_SETPIPE_SZ``; 1 MiB is the
#: default most an unprivileged process may set): a rank printing fast fills a 64 KiB pipe in about a millisecond
READ_CHUNK = 1 << 20
#: after a read shorter than this, the reader waits :data:`BATCH_S` so that a rank printing line by line is read
#: in blocks of many lines (one wake-up, one log write and one console write per block, not per line)
SMALL_READ = 1 << 16
#: the wait of :data:`SMALL_READ`, seconds: the 1 MiB pipe holds far more than a rank prints in that time
BATCH_S = 0.01


def _enlarge_pipe(fd: int) -> bool:
    """Ask for a :data:`READ_CHUNK` pipe buffer on ``fd``; False where the system refuses (then no batching wait)."""
    import fcntl

    op = getattr(fcntl, "F_SETPIPE_SZ", 1031 if sys.platform.startswith("linux") else None)
    if op is None:
        return False
    try:
        return fcntl.fcntl(fd, op, READ_CHUNK) >= READ_CHUNK
    except OSError:
        return False


class LocalNode:
    """A subprocess on this machine (a node's torchrun, or a setup command), in its own process group so the
    whole tree can be killed; stdout and stderr merged into one pipe, read as raw bytes (:meth:`chunks`)."""

    def __init__(self, node_rank: int, argv: list[str], env: dict[str, str], cwd: Path):
        self.node_rank = node_rank
        self.argv = argv
        # umask 077: what the node writes (its work folder, torchrun's logs, the rank facts) lies in the run folder,
        # which is the user's alone (files 0600, folders 0700 under any umask of the shell)
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, bufsize=0, umask=0o077)
        assert self.proc.stdout is not None
        self._batch_s = BATCH_S if _enlarge_pipe(self.proc.stdout.fileno()) else 0.0

    def chunks(self) -> Iterable[bytes]:
        """The node's output as it comes (stdout and stderr merged), in blocks of whole or partial lines, until the
        process and everything holding its pipe end."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            data = os.read(fd, READ_CHUNK)
            if not data:
                return
            yield data
            if self._batch_s and len(data) < SMALL_READ:
                time.sleep(self._batch_s)

    def lines(self) -> Iterable[str]:
        yield from chunk_lines(self.chunks())

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        kill_group(self.proc, grace_s)


def chunk_lines(chunks: Iterable[bytes]) -> Iterable[str]:
    """Text lines (each ending in a newline but maybe the last) of a stream of byte blocks, decoded as UTF-8 with
    replacement characters for bytes that are not."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")("replace")
    rest = ""
    for data in chunks:
        text = rest + dec.decode(data)
        *whole, rest = text.split("\n")
        for line in whole:
            yield line + "\n"
    rest += dec.decode(b"", final=True)
    if rest:
        yield rest


def kill_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it after ``grace_s`` if anything is left."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if pgid is not None:
        try:  # torchelastic's agent and stray workers may survive their parent: kill the whole group
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
        pass


# --------------------------------------------------------------------------------------------------- supervision
@dataclass
class RankRow:
    node: int
    rank: int
    local_rank: int
    world_size: int
    device: str = "?"
    backend: str = "?"
    host: str = "?"
    cuda_visible_devices: str = "?"
    gpus: str = "?"
    python: str = "?"
    torch: str = "?"
    cuda: str = "?"
    nccl: str = "?"


@dataclass
class RunResult:
    """What a supervised run ended with.  ``status``: succeeded | failed | deadline | interrupted."""

    status: str
    exit_codes: dict[int, int | None]
    wall_s: float
    log_paths: dict[int, Path]
    reason: str = ""
    failed_node: int | None = None
    missing_expect: list[str] = field(default_factory=list)
    ranks: list[RankRow] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)  # last lines of the failing node's log
    #: error output (Traceback / ERROR lines) of a run whose ranks all exited 0: shown as "succeeded with errors"
    error_lines: list[str] = field(default_factory=list)
    #: the pipeline's diagnose step (:func:`broker.run.diagnose.explain`): the failing rank's own error, cause and fix
    diagnosis: list[str] = field(default_factory=list)
    #: a succeeded run that may have trained wrong (:func:`broker.run.diagnose.sanity_warnings`): "succeeded, with N warnings"
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every node exited 0 and the expected output is there (error lines do not change the exit code)."""
        return self.status == "succeeded"

    @property
    def shown_status(self) -> str:
        """The status for people: ``succeeded with errors`` when the ranks exited 0 but printed errors."""
        if self.status == "succeeded" and self.error_lines:
            return "succeeded with errors"
        if self.status == "succeeded" and self.warnings:
            return f"succeeded, with {len(self.warnings)} warning{'s' if len(self.warnings) > 1 else ''}"
        return self.status


#: the longest line kept back waiting for its newline (characters): a rank that never ends a line (a progress bar
#: drawn with carriage returns) is shown in pieces of this size instead of held in memory
MAX_PARTIAL = 1 << 16
#: node output waiting for a slow (or paused) terminal, bytes: past this, blocks are dropped from the display (the
#: node log keeps them) so that a node never waits on broker's console
MAX_BACKLOG = 32 << 20


class _Display:
    """Node output on its way to the console, written by one thread of its own: the readers of the nodes' pipes
    never wait on the terminal.  A backlog over :data:`MAX_BACKLOG` bytes is dropped from the display and said in
    one line once the terminal caught up.  ``echo()`` gives the console callable at the time of each block: one
    with a ``block(prefix, text)`` method (:data:`broker.core.ui.echo_line`) gets whole blocks of lines; any other gets
    one ``[node i] line`` call per line; None shows nothing."""

    def __init__(self, echo: "Callable[[], Callable[[str], None] | None]"):
        import collections

        self._echo = echo  # looked up for each block: the supervisor may swap its echo while nodes are stopped
        self._q: "collections.deque[tuple[str, str]]" = collections.deque()
        self._size = 0
        self._dropped: dict[str, int] = {}
        self._cv = threading.Condition()
        self._closed = False
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="broker-display", daemon=True)
        self._thread.start()

    def put(self, prefix: str, text: str) -> None:
        """Queue ``text`` (whole lines, each ending in a newline) to be shown under ``prefix``; ``prefix`` '' = a
        line of broker's own."""
        with self._cv:
            if self.failed is not None:
                return
            if self._size + len(text) > MAX_BACKLOG and prefix:
                self._dropped[prefix] = self._dropped.get(prefix, 0) + text.count("\n")
                return
            self._q.append((prefix, text))
            self._size += len(text)
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                item = self._q.popleft() if self._q else None
                if item is not None:
                    self._size -= len(item[1])
                dropped = {} if self._q else self._dropped  # said once the terminal has caught up
                if dropped:
                    self._dropped = {}
            try:
                if item is not None:
                    self._show(*item)
                for p, n in dropped.items():
                    self._show("", f"[broker] {n} line(s) of {p.strip()[1:-1]} not shown: the terminal did not keep "
                               "up (every line is in that node's log)")
            except BaseException as e:  # noqa: BLE001 - a closed terminal: stop showing, keep draining the nodes
                with self._cv:
                    self.failed = e
                    self._q.clear()
                return
            if item is None:
                return

    def _show(self, prefix: str, text: str) -> None:
        echo = self._echo()
        if echo is None:
            return
        block = getattr(echo, "block", None)
        if not prefix:
            echo(text.rstrip("\n"))
        elif block is not None:
            block(prefix, text)
        else:
            for line in text[:-1].split("\n"):
                echo(prefix + line)

    def close(self, timeout_s: float = 30.0) -> None:
        """Show what is queued (waits at most ``timeout_s`` for the terminal) and end the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout_s)


def _node_chunks(node: NodeHandle) -> Iterable[bytes]:
    """The node's raw output blocks: its own ``chunks()`` where its class has one, else its ``lines()`` encoded
    (a wrapper that forwards other attributes but times ``lines()`` keeps working)."""
    if getattr(type(node), "chunks", None) is not None:
        return node.chunks()  # type: ignore[attr-defined]
    return (line.encode("utf-8", "surrogateescape") for line in node.lines())


class Supervisor:
    """Streams, logs and supervises a set of nodes until all end, one fails, the deadline passes or Ctrl-C.

    ``echo`` receives each prefixed line for the console (``None`` = quiet); one with a ``block(prefix, text)``
    method (:data:`broker.core.ui.echo_line`) receives whole blocks of lines instead.  The node logs get the nodes'
    raw bytes; the console gets them from a thread of its own (:class:`_Display`).
    """

    def __init__(self, log_paths: dict[int, Path], *, echo: Callable[[str], None] | None = print,
                 grace_s: float = STOP_GRACE_S, poll_s: float = 0.05):
        self.log_paths = log_paths
        self.echo = echo
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self.log_errors: list[str] = []
        self._display: _Display | None = None
        self.stall: "StallWatch | None" = None  # set by the executor: stop (or report) a run that hangs

    def _pump(self, node: NodeHandle, path: Path) -> None:
        """Copy the node's output, as raw bytes, to its log file (one write per block read, no buffering: ``broker
        logs -f`` sees it at once) and, decoded, in whole lines, to the display.  The values of the recipe's
        secrets (registered with :func:`broker.core.private.register_secret`) are masked in both, also when a value is
        split across two blocks (:class:`broker.core.private.StreamScrubber`; no work when none is registered).  A log
        write that fails (a full disk) never stops the draining: a node whose output is not read blocks in its
        next print."""
        import codecs

        from broker.core.private import StreamScrubber, private_opener

        f = None
        try:
            f = open(path, "ab", buffering=0, opener=private_opener)
        except OSError as e:
            self._log_error(node, path, e)
        display = self._display
        prefix = f"[node {node.node_rank}] "
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        partial, last = "", b"\n"
        scrub = StreamScrubber()
        chunks = _node_chunks(node)
        if scrub:
            chunks = _scrubbed(chunks, scrub)
        for data in chunks:
            if not data:
                continue
            last = data
            if f is not None:
                try:
                    f.write(data)
                except OSError as e:
                    self._log_error(node, path, e)
                    try:
                        f.close()
                    except OSError:
                        pass
                    f = None
            if display is None:
                continue
            text = partial + dec.decode(data)
            cut = text.rfind("\n") + 1
            if cut:
                display.put(prefix, text[:cut])
                partial = text[cut:]
            else:
                partial = text
            if len(partial) > MAX_PARTIAL:
                display.put(prefix, partial + "\n")
                partial = ""
        if display is not None:
            partial += dec.decode(b"", final=True)
            if partial:
                display.put(prefix, partial + "\n")
        if f is not None:
            try:
                if not last.endswith(b"\n"):  # later lines (broker's own, the next command's) start on their own
                    f.write(b"\n")
                f.close()
            except OSError:
                pass

    def _log_error(self, node: NodeHandle, path: Path, e: OSError) -> None:
        msg = f"cannot write node {node.node_rank}'s log {path}: {e.strerror or e} (filesystem full?); still streaming"
        self.log_errors.append(msg)
        if self._display is not None:
            self._display.put("", f"[broker] {msg}\n")
        elif self.echo is not None:
            with self._lock:
                self.echo(f"[broker] {msg}")

    def run(self, nodes: list[NodeHandle], *, deadline_s: float | None = None) -> RunResult:
        """Supervise ``nodes``; ``deadline_s`` is the wall-clock limit in seconds from now."""
        t0 = time.monotonic()
        self._display = _Display(lambda: self.echo) if self.echo is not None else None
        handles = self.stall.wrap(nodes) if self.stall is not None else nodes
        pumps = [threading.Thread(target=self._pump, args=(n, self.log_paths[n.node_rank]), daemon=True)
                 for n in handles]
        for t in pumps:
            t.start()
        status, reason, failed = "succeeded", "", None
        try:
            while True:
                codes = {n.node_rank: n.poll() for n in nodes}
                bad = [r for r, c in codes.items() if c not in (None, 0)]
                if bad:
                    failed = bad[0]
                    status = "failed"
                    reason = f"node {failed} exited with code {describe_exit(codes[failed])}; stopped the other nodes"
                    break
                if all(c == 0 for c in codes.values()):
                    break
                if deadline_s is not None and time.monotonic() - t0 > deadline_s:
                    status = "deadline"
                    reason = f"deadline of {deadline_s:.0f} s reached; stopped every node"
                    if self.stall is not None:
                        self.stall.at_deadline()
                    break
                if self.stall is not None and self.stall.check():
                    status, reason = "failed", self.stall.reason
                    break
                time.sleep(self.poll_s)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (broker.core.errors.Terminated names it)
            status, reason = "interrupted", f"interrupted ({getattr(e, 'signame', None) or 'Ctrl-C'}); stopped every node"
        finally:
            echo = self.echo
            self.echo = quiet_after_stop(echo, [n.node_rank for n in nodes if n.poll() is None])
            self.stop_all(nodes)
            for t in pumps:
                t.join(timeout=5)
            if self._display is not None:  # shown under the quiet echo: stopped nodes' last lines stay off
                self._display.close()
                self._display = None
            self.echo = echo
        codes = {n.node_rank: n.poll() for n in nodes}
        return RunResult(status=status, exit_codes=codes, wall_s=time.monotonic() - t0, log_paths=self.log_paths,
                         reason=reason, failed_node=failed)

    def stop_all(self, nodes: list[NodeHandle]) -> None:
        """Stop every node still running, in parallel (each gets the grace period, not the sum)."""
        threads = [threading.Thread(target=n.stop, args=(self.grace_s,)) for n in nodes if n.poll() is None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def quiet_after_stop(echo: Callable[[str], None] | None, stopped: list[int]) -> Callable[[str], None] | None:
    """The console echo while broker stops ``stopped`` nodes: one line says so, and what those nodes print from
    then on (torchelastic's ``SignalException`` tracebacks for the SIGTERM broker sent, ~30 lines a node) goes to
    their logs only."""
    if echo is None or not stopped:
        return echo
    echo(f"[broker] stopping node(s) {', '.join(map(str, stopped))} (SIGTERM, SIGKILL after {STOP_GRACE_S:g} s); "
         "what they print from now on is only in their logs")
    prefixes = tuple(f"[node {i}] " for i in stopped)

    def quiet(line: str) -> None:
        if not line.startswith(prefixes):
            echo(line)

    return quiet


def _private_opener(path: str, flags: int) -> int:
    from broker.core.private import private_opener

    return private_opener(path, flags)


def _scrubbed(chunks, scrub):
    """``chunks`` (a node's output blocks) with the secrets ``scrub`` knows masked; what it holds back at the end
    (the possible start of a value) comes last."""
    for data in chunks:
        yield scrub.feed(data) if data else data
    tail = scrub.flush()
    if tail:
        yield tail


def check_expect(log_path: Path, patterns: list[str]) -> list[str]:
    """The patterns that do not match anywhere in the log (rank 0's)."""
    text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    return [p for p in patterns if not re.search(p, text, re.MULTILINE)]


#: the most characters kept of one value of a node's rank facts (a node writes that file: any size, any bytes)
MAX_FACT_CHARS = 256


def _facts_row(d: dict, node: int, rank: int, local_rank: int, ws: int) -> RankRow:
    from broker.core.ui import strip_controls

    def txt(v: object) -> str:  # a node's value: no control/bidi characters, bounded (also in --json)
        return "?" if v is None else strip_controls(str(v))[:MAX_FACT_CHARS]

    cvd = d.get("cuda_visible_devices")
    return RankRow(node=node, rank=rank, local_rank=local_rank, world_size=ws,
                   device=txt(d.get("device")), backend=txt(d.get("backend")), host=txt(d.get("host")),
                   cuda_visible_devices="(unset)" if cvd is None else (txt(cvd) or "''"),
                   gpus=txt(d.get("gpus_visible")), python=txt(d.get("python")), torch=txt(d.get("torch")),
                   cuda=txt(d.get("cuda_version") or "none (CPU build)") if d.get("torch") else "?",
                   nccl=txt(d.get("nccl_version") or "none") if d.get("torch") else "?")


def rank_table(log_paths: dict[int, Path], *, nnodes: int, nproc_per_node: int) -> list[RankRow]:
    """Per-rank rows from the rank facts that :mod:`broker.run.rankshim` wrote for any script
    (``<run>/node<i>/facts/rank<r>.json`` beside the logs); for ranks without facts, the logs' own ``RANK=..
    LOCAL_RANK=.. WORLD_SIZE=.. device=.. backend=..`` lines; ranks that left neither get the values torchrun
    assigns (node_rank * nproc_per_node + local_rank)."""
    import json

    ws = nnodes * nproc_per_node
    seen: dict[int, RankRow] = {}
    for node, path in log_paths.items():
        for fp in sorted(Path(path).parent.glob(f"node{node}/facts/rank*.json")):
            try:
                d = json.loads(fp.read_text())
                r = int(d["rank"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            lr = d.get("local_rank")
            seen.setdefault(r, _facts_row(d, node, r, int(lr) if lr is not None else r % max(1, nproc_per_node),
                                          int(d.get("world_size") or ws)))
    for node, path in log_paths.items():
        if not path.exists():
            continue
        for m in _RANK_LINE.finditer(path.read_text(encoding="utf-8", errors="replace")):
            r = int(m.group(1))
            seen.setdefault(r, RankRow(node, r, int(m.group(2)), int(m.group(3)), m.group(4), m.group(5)))
    rows = []
    for node in range(nnodes):
        for lr in range(nproc_per_node):
            r = node * nproc_per_node + lr
            rows.append(seen.get(r, RankRow(node, r, lr, ws)))
    return rows


def log_tail(path: Path, n: int = 15) -> list[str]:
    if not path.exists():
        return []
    return path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:]


# --------------------------------------------------------------------------------------------------- local runs
def prepare_node_dirs(workdir: Path, run_dir: Path, nnodes: int, plan: "StagePlan | None" = None) -> list[Path]:
    """A fresh copy of the staged ``workdir`` (:mod:`broker.run.staging`) per node: ``run_dir/node<i>/work``.
    Returns the work dirs."""
    from broker.run.staging import copy_staged, stage_plan

    plan = plan or stage_plan(workdir)
    out = []
    for i in range(nnodes):
        dst = run_dir / f"node{i}" / "work"
        copy_staged(plan, dst)
        out.append(dst)
    return out


#: inherited variables that steer rendezvous, ranks and sockets: a value left in the user's shell (an old
#: ``GLOO_SOCKET_IFNAME``, an ``salloc``'s ``SLURM_PROCID``) silently breaks a local run, so the nodes only get them
#: when the recipe (or the provider's per-node layer) sets them
INHERITED_DROP_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "TORCHELASTIC_", "PMI_", "OMPI_COMM_WORLD_")
INHERITED_DROP_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK",
                                  "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"})
#: kept although they match: host safety settings (NVLink multicast off on shared hosts) and debug output
INHERITED_KEEP = frozenset({"NCCL_NVLS_ENABLE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"})


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


def python_first_path(python: str | None, path: str | None) -> str:
    """``PATH`` with the training interpreter's ``bin/`` first, so ``setup`` commands' ``python``/``pip`` are the
    ones torchrun uses (issue 15: the venv's, not whatever comes first on the user's PATH)."""
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
        from broker.run.staging import stage_plan

        from broker.core.private import private_dirs, write_private

        spec = self.spec
        private_dirs(self.run_dir)
        dropped = dropped_line(dropped_inherited(dict(os.environ), spec.env, *spec.node_envs))
        for p in self.logs.values():
            write_private(p, f"broker: {dropped}\n" if dropped else "")
        if dropped and self.echo:
            self.echo(f"[broker] {dropped}")
        from broker.run.staging import recipe_files

        plan = stage_plan(spec.workdir, keep=recipe_files(spec.workdir, spec.script_rel, spec.args))
        from broker.run.executor import staging_line

        line = staging_line(plan, self.run_dir)
        if self.say:
            self.say(line)
        self.dirs = prepare_node_dirs(spec.workdir, self.run_dir, spec.nnodes, plan)
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
            with open(self.logs[i], "a", encoding="utf-8") as f:
                f.write("$ " + " ".join(shlex.quote(a) for a in argv) + "\n")
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


def run_local(spec: LocalLaunchSpec, run_dir: Path, *, echo: Callable[[str], None] | None = print) -> RunResult:
    """Run the job as ``spec.nnodes`` simulated nodes on this machine (:class:`LocalExecutor` through
    :func:`broker.run.executor.run_steps`); returns the result (never raises for a failing job)."""
    return run_steps(LocalExecutor(spec, run_dir, echo=echo))


# --------------------------------------------------------------------------------------------------- artifacts
# A node is input, not authority: the names it sends back and the files behind them are checked before anything is
# written here.  Names must be relative, without ``..``, and land inside ``<run>/artifacts/node<i>/``; a file must
# be a regular file inside the node's work folder (a symlink out of it is refused); sizes are bounded.

#: the most one artifact may hold (GiB), all the artifacts of a run together (GiB), and how many files one node
#: may send back; the environment (never a folder's ``.env``) may raise the first two
ARTIFACT_MAX_GIB = 20.0
ARTIFACTS_MAX_GIB = 100.0
ARTIFACT_MAX_FILES = 10_000
GIB = 1 << 30


class RefusedArtifact(ValueError):
    """An artifact broker will not collect; the message says why (the name is the caller's to add)."""


def _gib_setting(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        v = float(raw) if raw else default
    except ValueError:
        return default
    return v if v > 0 else default


@dataclass
class ArtifactBudget:
    """The size bounds of one run's artifact collection (bytes), and what was collected so far."""

    per_file: int = field(default_factory=lambda: int(_gib_setting("BROKER_ARTIFACT_MAX_GIB", ARTIFACT_MAX_GIB) * GIB))
    total: int = field(default_factory=lambda: int(_gib_setting("BROKER_ARTIFACTS_MAX_GIB", ARTIFACTS_MAX_GIB) * GIB))
    max_files: int = ARTIFACT_MAX_FILES
    used: int = 0

    def check(self, size: int) -> None:
        """Raises RefusedArtifact when a file of ``size`` bytes is over a cap (given what was collected)."""
        if size > self.per_file:
            raise RefusedArtifact(f"{_size(size)} is over the {_size(self.per_file)} cap for one artifact "
                                  "(BROKER_ARTIFACT_MAX_GIB raises it)")
        if self.used + size > self.total:
            raise RefusedArtifact(f"{_size(size)} would bring the run's artifacts over the {_size(self.total)} cap "
                                  "for all of them (BROKER_ARTIFACTS_MAX_GIB raises it)")


def _size(n: int) -> str:
    for unit, div in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def artifact_destination(root: Path, name: object) -> Path:
    """Where the artifact ``name`` (a path relative to a node's work folder, as the node sent it back) goes under
    ``root`` (``<run>/artifacts/node<i>``).  Raises RefusedArtifact for a name that is not a string, is empty, holds
    control characters, is absolute, climbs out with ``..``, or resolves outside ``root`` (a symlink there)."""
    if not isinstance(name, str) or not name.strip():
        raise RefusedArtifact("not a file name")
    if any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in name):
        raise RefusedArtifact("the name holds control characters")
    if name.startswith("/") or Path(name).is_absolute():
        raise RefusedArtifact("an absolute path: artifacts are paths relative to the node's work folder")
    parts = Path(name).parts
    if ".." in parts:
        raise RefusedArtifact("the name climbs out of the work folder with '..'")
    parts = tuple(p for p in parts if p != ".")
    if not parts:
        raise RefusedArtifact("not a file name")
    dst = root.joinpath(*parts)
    base = os.path.realpath(root)
    if not os.path.realpath(dst).startswith(base.rstrip("/") + "/"):
        raise RefusedArtifact(f"it would be written outside {root}")
    return dst


def open_artifact(dst: Path) -> "Any":
    """A new file at ``dst`` for writing (binary, mode 0600), never through a symlink; its folders are created
    0700."""
    from broker.core.private import private_dirs

    private_dirs(dst.parent)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    return os.fdopen(fd, "wb")


def write_capped(dst: Path, chunks: "Iterable[bytes]", budget: ArtifactBudget) -> int:
    """Write ``chunks`` to the new file ``dst`` (:func:`open_artifact`) within ``budget`` (counted as it comes: a
    file may grow, or its size be misreported); returns the bytes written.  Over a cap the partial file is removed
    and RefusedArtifact raised."""
    got = 0
    try:
        with open_artifact(dst) as out:
            for data in chunks:
                got += len(data)
                budget.check(got)
                out.write(data)
    except BaseException:
        try:
            os.unlink(dst)
        except OSError:
            pass
        raise
    budget.used += got
    return got


def match_artifacts(workdir: Path, patterns: list[str]) -> list[str]:
    """Files under ``workdir`` matching the recipe's ``artifacts`` globs (``**`` allowed), relative paths, sorted.
    Patterns that are absolute or climb out with ``..`` match nothing."""
    out: set[str] = set()
    for pat in patterns:
        if Path(pat).is_absolute() or ".." in Path(pat).parts:
            continue
        for p in workdir.glob(pat):
            if p.is_file() or p.is_symlink():
                out.add(p.relative_to(workdir).as_posix())
    return sorted(out)


def collect_local(workdir: Path, patterns: list[str], root: Path, budget: ArtifactBudget,
                  node: int = 0) -> tuple[list[str], list[str]]:
    """Copy the files of ``workdir`` that match ``patterns`` (on this machine) into ``root`` within ``budget``;
    returns (names collected, ``'name' (why)`` for each one refused: a symlink out of ``workdir``, not a regular
    file, over a size cap)."""
    got, refused = [], []
    base = os.path.realpath(workdir).rstrip("/") + "/"
    for rel in match_artifacts(workdir, patterns):
        try:
            dst = artifact_destination(root, rel)
            real = os.path.realpath(workdir / rel)
            if not real.startswith(base):
                raise RefusedArtifact(f"a symlink to {real}, outside node {node}'s work folder")
            if not os.path.isfile(real):
                raise RefusedArtifact("not a regular file")
            if len(got) >= budget.max_files:
                raise RefusedArtifact(f"more than {budget.max_files} files")
            budget.check(os.stat(real).st_size)

            def _read(path: str = real) -> Iterable[bytes]:
                with open(path, "rb") as f:
                    while data := f.read(READ_CHUNK):
                        yield data

            write_capped(dst, _read(), budget)
            got.append(rel)
        except RefusedArtifact as e:
            refused.append(f"{rel!r} ({e})")
    return got, refused


def record_artifacts(result: RunResult, patterns: list[str], found: dict[int, list[str]], run_dir: Path,
                     echo: Callable[[str], None] | None, refused: dict[int, list[str]] | None = None) -> None:
    """Log what was collected from each node into ``run_dir/artifacts/node<i>/`` (in rank 0's log and on the
    console); a pattern that no node produced fails a succeeded run with that name (issue 13 item 5); an artifact
    broker refused (``refused``: node -> ``'name' (why)``) fails the run and is named in its reason."""
    lines = []
    for i, names in sorted(found.items()):
        if names:
            lines.append(f"artifacts from node {i}: {', '.join(names)} -> {run_dir / 'artifacts' / f'node{i}'}")
    bad = [f"node {i}: {r}" for i, rs in sorted((refused or {}).items()) for r in rs]
    for b in bad:
        lines.append(f"artifact refused, nothing written for it: {b}")
    missing = []
    for pat in patterns:
        if Path(pat).is_absolute() or ".." in Path(pat).parts:
            lines.append(f"artifact {pat!r} skipped: give a path relative to the work folder")
            missing.append(pat)
            continue
        hit = any(fnmatch.fnmatch(n, pat) or Path(n).match(pat) for names in found.values() for n in names)
        if not hit:
            missing.append(pat)
            lines.append(f"artifact {pat} was produced by no node")
    if result.log_paths.get(0) is not None and result.log_paths[0].exists():
        with open(result.log_paths[0], "a", encoding="utf-8") as f:
            f.writelines(f"broker: {ln}\n" for ln in lines)
    if echo:
        for ln in lines:
            echo(f"[broker] {ln}")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more (see node 0's log)" if len(bad) > 5 else "")
        why = f"artifact(s) refused: {shown}"
        if result.status == "succeeded":
            result.status, result.reason = "failed", why
        else:
            result.reason = f"{result.reason}; {why}" if result.reason else why
    if missing and result.status == "succeeded":
        result.status = "failed"
        result.reason = "listed artifact(s) produced by no node: " + ", ".join(missing)


def finish_result(res: RunResult, expect: list[str], *, nnodes: int, nproc_per_node: int) -> RunResult:
    """Add the rank table, the ``expect`` check on node 0's log and the failing node's log tail."""
    res.ranks = rank_table(res.log_paths, nnodes=nnodes, nproc_per_node=nproc_per_node)
    if res.status == "succeeded":
        res.missing_expect = check_expect(res.log_paths[0], expect)
        if res.missing_expect:
            res.status = "failed"
            res.reason = ("every node exited 0 but rank 0's log lacks the expected output: "
                          + ", ".join(repr(p) for p in res.missing_expect))
    if res.status == "succeeded":
        from broker.run.diagnose import error_lines

        res.error_lines = error_lines(res.log_paths)
        if res.log_paths:
            from broker.run.diagnose import load_facts, sanity_warnings

            res.warnings = sanity_warnings(load_facts(next(iter(res.log_paths.values())).parent))
        if res.error_lines and not res.reason:
            res.reason = (f"every node exited 0, but the logs hold {len(res.error_lines)} error line(s) "
                          "(Traceback / ERROR)")
    if res.failed_node is not None:
        res.tail = log_tail(res.log_paths[res.failed_node])
    return res
