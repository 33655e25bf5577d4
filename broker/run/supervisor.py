"""Watching the nodes of a running job: :class:`NodeHandle` / :class:`LocalNode` (a node's process and its output
pipe), :class:`Supervisor` (streams every node's lines, stops the others when one fails, Ctrl-C), and the
:class:`RunResult` it ends with (exit codes, logs, the per-rank table, the ``expect`` check).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

# the exit code in words is the executor contract's (diagnose names a failing rank's code with it too)
from broker.run.executor import describe_exit  # noqa: F401 - under diagnose too; re-exported

if TYPE_CHECKING:
    from broker.run.stall import StallWatch


#: how long a node gets between SIGTERM and SIGKILL when it is stopped, seconds
STOP_GRACE_S = 3.0

_RANK_LINE = re.compile(r"RANK=(\d+) LOCAL_RANK=(\d+) WORLD_SIZE=(\d+) device=(\S+) backend=(\S+)")


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
        from broker.run.guard import check_node_lost

        try:
            while True:
                check_node_lost()  # the one point where a node the provider lost ends the job (NodeLost)
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
