"""Stall detection: ranks that are alive but make no progress, named with the place each rank is in.

A run is *stalled* when no node printed a line for ``stall_s`` seconds (recipe ``stall_s``, default 60) **and** two
samples of every rank's Python stack, ``gap_s`` seconds apart, put every rank at the same place.  Then each rank's
place is named -- the collective it waits in (``all_reduce``, ``barrier``, DDP's forward ...) from the frames in
``torch/distributed``, or the line of the user's script where it is elsewhere -- with the cause and the fix::

    rank 0 waits in all_reduce at train.py:40; rank 1 never called all_reduce: it is at train.py:33 (time.sleep(600))

``on_stall: stop`` (the default: a paid hang burns money) stops every node; ``report`` only says so and lets the run
go on to its end or its deadline.  What was found is kept in ``<run>/stall.json`` (read by :mod:`broker.run.diagnose`)
and the raw stacks in ``<run>/stacks.txt``.

The stacks come from the node: ``rankshim.py --dump-stacks FACTS_DIR`` (:func:`broker.run.rankshim.dump_stacks`) asks
``py-spy dump`` where it is installed, else sends ``SIGUSR1`` to each rank, on which the shim armed
:mod:`faulthandler`.  Executors give :class:`StallWatch` a *sampler* (``() -> {rank: entry}``, :func:`local_sampler`,
:func:`remote_sampler`) and call :meth:`StallWatch.check` from their supervision loop; every node's output lines
pass through :meth:`StallWatch.wrap`, which keeps the last output time.

The flight recorder (``TORCH_FR_BUFFER_SIZE`` or, before torch 2.11, ``TORCH_NCCL_TRACE_BUFFER_SIZE``, set by the shim) dumps each rank's last collectives on a
collective timeout into the facts folder (``fr_trace_rank<R>``); :func:`flight_recorder_lines` names the ranks that
are behind from those dumps.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

# where each rank is (stack parsing), the ranks' sequences and the flight recorder live in their own modules; the
# names are kept here for the executors and tests that import them from the stall watch
from broker.run.flight_recorder import (FLIGHT_RECORDER_MAX_BYTES, flight_recorder_from_run,  # noqa: F401
                                        flight_recorder_lines, read_flight_recorder)
from broker.run.places import (COLLECTIVES, Frame, Place, parse_stacks, place_of,  # noqa: F401
                               places_from_sample)
from broker.run.sequences import _sig_text, sequence_divergence  # noqa: F401

#: seconds between the two stack samples that must agree before a run is called stalled
SAMPLE_GAP_S = 3.0


# ------------------------------------------------------------------------------------------------ the verdict
@dataclass
class Verdict:
    """What the places say: ``lines`` (one per rank, then the summary line), ``cause`` and ``fix``."""

    lines: list[str]
    cause: str
    fix: str
    places: list[Place] = field(default_factory=list)

    @property
    def headline(self) -> str:
        return self.lines[0] if self.lines else ""


#: share of one core a rank must use (or be waiting for, runnable) between the samples to count as computing
BUSY_SHARE = 0.2
#: CPU seconds between the samples that make a rank busy whatever the gap: a rank blocked in a collective or a
#: sleep used 0-0.01 s in 3.5 s here (the stack dump itself); one computing at nice 19 beside two spinning
#: processes on this 2-core machine still got ~0.05 s
BUSY_MIN_S = 0.04


def busy_ranks(first: list[Place], second: list[Place]) -> set[int]:
    """Ranks computing between the two samples (a long step at one line that prints nothing), not blocked: CPU
    time rose by :data:`BUSY_MIN_S`, or CPU used plus time spent runnable but waiting for a CPU is at least
    :data:`BUSY_SHARE` of the gap (on a loaded machine a computing rank gets little CPU, but it waits for it; a
    blocked one does neither)."""
    a = {p.rank: p for p in first}
    out = set()
    for p in second:
        q = a.get(p.rank)
        if q is None or None in (p.cpu_s, q.cpu_s, p.t, q.t) or p.t <= q.t:
            continue
        used = p.cpu_s - q.cpu_s
        waited = (p.wait_s - q.wait_s) if None not in (p.wait_s, q.wait_s) else 0.0
        if used >= BUSY_MIN_S or used + max(waited, 0.0) >= BUSY_SHARE * (p.t - q.t):
            out.add(p.rank)
    return out


_SAME_ORDER = ("every rank must call the same collectives in the same order: look for a collective that only some "
               "ranks reach (under `if rank == 0`, after an early `break`/`return`, a loop whose length differs per "
               "rank such as uneven batches), or a rank that is only slow (then raise stall_s)")


#: the names :func:`_op_name` gives the collectives of a DDP training step (forward's buffer broadcast, backward's
#: gradient all-reduce)
_IN_STEP = ("backward()", "the DDP model's forward")


def _hostport(url: str) -> str:
    m = re.match(r"^\w+://([^/?]+)", url)
    return m.group(1) if m else url


def _rendezvous_moved(waiting: list[Place]) -> tuple[str, str] | None:
    """``(cause, fix)`` when every rank waits in init_process_group at an address the script chose itself (an
    ``init_method`` or MASTER_ADDR/PORT it set) instead of torchrun's rendezvous; None otherwise."""
    rz = [p.rendezvous for p in waiting if p.rendezvous]
    if len(rz) != len(waiting):
        return None
    first = waiting[0]
    at = first.at()
    ours = next((r.get("master") for r in rz if r.get("master")), None)
    method = next((r["init_method"] for r in rz if r.get("init_method") and not
                   str(r["init_method"]).startswith(("env://", "file://"))), None)
    if method:
        target = _hostport(str(method))
        if target == ours:
            return None
        hosts = sorted({str(r.get("host")) for r in rz})
        cause = (f"every rank waits in init_process_group at {at} for {target} (init_method={method!r}), but "
                 f"torchrun's rendezvous is at {ours}"
                 + (f"; the ranks run on {len(hosts)} hosts, and each looks for rank 0 at its own address"
                    if len(hosts) > 1 and re.match(r"^(localhost|127\.|\[?::1)", target) else ""))
        fix = (f"drop init_method from the call at {at} (the default env:// uses torchrun's MASTER_ADDR/"
               "MASTER_PORT)")
        return cause, fix
    moved = next((r for r in rz if r.get("init_master") and r.get("init_master") != r.get("master")), None)
    if moved is None:
        return None
    lines = sorted({int(n) for r in rz for n, _ in (r.get("sets_master") or [])})
    where = ""
    if lines:
        span = f"{lines[0]}-{lines[-1]}" if lines[-1] - lines[0] == len(lines) - 1 and len(lines) > 1 else \
            ", ".join(map(str, lines))
        where = f"; line{'s' if len(lines) > 1 else ''} {span} of {os.path.basename(first.user.file) if first.user else 'the script'} set MASTER_ADDR/PORT"
    cause = (f"every rank waits in init_process_group at {at} for {moved['init_master']}, but torchrun's "
             f"rendezvous is at {moved['master']}{where}")
    fix = ((f"delete {'them' if len(lines) > 1 else 'it'}" if lines else "delete the assignments to MASTER_ADDR/"
            "MASTER_PORT") + " (torchrun and broker set MASTER_ADDR/MASTER_PORT for every rank)")
    return cause, fix


def verdict(places: list[Place], world_size: int | None = None) -> Verdict:
    """Name the stall from every rank's place (:func:`places_from_sample`)."""
    live = [p for p in places if not p.ended]
    ended = [p for p in places if p.ended]
    waiting = [p for p in live if p.collective]
    elsewhere = [p for p in live if not p.collective]
    missing = sorted(set(range(world_size)) - {p.rank for p in places}) if world_size else []
    lines: list[str] = []
    if waiting and (elsewhere or ended):
        ops = [p.collective for p in waiting]
        op = max(set(ops), key=ops.count)
        short = op.split(" (")[0]
        w = "; ".join(p.describe() for p in waiting)
        others = "; ".join((f"rank {p.rank} never called {short}: it is {p.elsewhere()}" if not p.ended else p.describe())
                           for p in elsewhere + ended)
        lines.append(f"{w}; {others}")
        behind = ", ".join(str(p.rank) for p in elsewhere + ended)
        if ended and not elsewhere:
            cause = (f"rank(s) {behind} ended while the others wait for them in {short}: the others can only time "
                     "out")
            fix = ("make every rank run the same number of steps and collectives before it ends (uneven data per "
                   "rank, an early exit or an exception caught on one rank cause this)")
        elif any(p.worker is not None for p in elsewhere):
            p = next(p for p in elsewhere if p.worker is not None)
            w = p.worker
            cause = (f"rank(s) {behind} wait for a batch their DataLoader never delivers: rank {p.rank}'s worker "
                     f"(pid {w.rank}) is stuck {w.elsewhere()}"
                     + (f" in {w.user.function}" if w.user and w.user.function != "<module>" else "")
                     + f", so the others wait forever in {short}")
            fix = (f"look at {w.at()}: the dataset's code runs in the DataLoader's worker processes, where a wait "
                   "or an error is not seen by the rank (num_workers=0 runs it in the rank itself)")
        else:
            cause = f"rank(s) {behind} never reached the {short} the others wait in, so they wait forever"
            fix = _SAME_ORDER
    elif waiting:
        where = {(p.collective, p.user) for p in waiting}
        lines.append("; ".join(p.describe() for p in waiting))
        in_step = [p for p in waiting if p.collective.startswith(_IN_STEP)]
        past = [p for p in waiting if not p.collective.startswith(_IN_STEP)]
        if len(where) > 1 and in_step and past:
            # a training step's DDP collective on some ranks, a later collective on the others: the others left the
            # loop first (the classic "hangs at the last step" of uneven data per rank)
            a = ", ".join(str(p.rank) for p in past)
            b = ", ".join(str(p.rank) for p in in_step)
            cause = (f"rank(s) {a} left the training loop (waiting in {past[0].collective.split(' (')[0]} at "
                     f"{past[0].at()}) while rank(s) {b} still run a step ({in_step[0].collective.split(' (')[0]} "
                     f"at {in_step[0].at()}): the ranks got different numbers of batches (uneven data per rank)")
            fix = ("give every rank the same number of batches: a DistributedSampler over the whole dataset "
                   "(drop_last=True where the length does not divide), or wrap the loop in `with model.join():` "
                   "(DDP's support for uneven inputs)")
        elif len(where) > 1:
            cause = "the ranks wait in different collectives (or at different lines): they call them in a different order"
            fix = _SAME_ORDER
        elif waiting[0].collective == "init_process_group" and _rendezvous_moved(waiting):
            cause, fix = _rendezvous_moved(waiting)
            lines[-1] = f"{cause}: {fix.split(' (')[0]}"  # the mismatch itself is the headline
        elif waiting[0].collective == "init_process_group":
            cause = ("every rank waits in init_process_group: not all of the ranks it expects have joined (a "
                     "world_size or rank given to init_process_group that differs from torchrun's, or a node that "
                     "never started)")
            fix = ("call init_process_group() without rank=/world_size= (torchrun sets RANK and WORLD_SIZE), and "
                   "check that every node started")
        else:
            cause = (f"every rank waits in {waiting[0].collective.split(' (')[0]} at the same line: a rank of another "
                     "node is missing, the tensors differ between ranks (shape or dtype), or the network between the "
                     "nodes is blocked")
            fix = ("print the tensor's shape and dtype on every rank before the call; check that every node's ranks "
                   "are alive (`broker logs`); a blocked port is found by preflight")
    else:
        lines.append("; ".join(p.describe() for p in live) or "no rank answered")
        cause = ("no rank is inside a collective: the job is stuck or very slow in its own code (a step that takes "
                 "longer than stall_s without printing, a DataLoader, an input() or a lock)")
        fix = ("look at the lines above; print progress more often, or raise the recipe's stall_s if a step "
               "legitimately takes that long")
    div = sequence_divergence({p.rank: p.seq for p in places if p.seq})
    if div is not None and waiting:
        lines.append(div["line"])
        odd = div["left"] or (div["reached"] if div["short"] else [])
        sig = div["by_rank"][odd[0]] if odd and len({div["by_rank"][r] for r in odd}) == 1 else None
        cond = sig[4] if sig is not None and len(sig) > 4 else None
        if isinstance(cond, str):
            cond = json.loads(cond)
        # replaced only where the call is under a test of the rank: a rank that ran out of batches also takes
        # a step no rank took before (into the collective after its loop), and "uneven data" is the cause there
        if sig is not None and cond:
            others = [p for p in places if p.rank not in odd]
            cause = (f"{_sig_text(sig)} (collective #{div['index']}), under `{cond[1]}` (line {cond[0]}), was "
                     f"reached only by rank(s) {', '.join(map(str, odd))}; "
                     + "; ".join(p.describe() if p.collective or p.ended else f"rank {p.rank} is {p.elsewhere()}"
                                 for p in others))
            fix = (f"every rank must make the same collectives in the same order: the call at "
                   f"{_sig_text(sig).split(' at ', 1)[-1]} runs on some ranks only (under `if rank == ...`, after an "
                   "early return, on a rank that skipped a step): move it where every rank reaches it")
    if missing:
        lines.append("no stack from rank(s) " + ", ".join(map(str, missing)) + " (not started, or gone)")
    return Verdict(lines=lines, cause=cause, fix=fix, places=places)


# ------------------------------------------------------------------------------------------------ watching a run
Sampler = Callable[[], dict[str, dict[str, Any]]]


#: a retry torch logs when a signal interrupted a system call (its TCPStore connect): the watch's own stack
#: signal can cause it, so it is never progress; nor is the C++ trace printed under it
_EINTR = "Interrupted system call"
_CPP_TRACE = re.compile(r"^\s*(Exception raised from |frame #\d+: |<omitting python frames>|$)")


class _Timed:
    """A node handle whose output lines stamp the watch's last-output time (everything else passes through).
    Lines a signal made a rank print (:data:`_EINTR` and the C++ trace under it) do not stamp it."""

    def __init__(self, node: Any, watch: "StallWatch"):
        self._node, self._watch = node, watch
        self._eintr = False

    def _progress(self, line: str) -> bool:
        if _EINTR in line:
            self._eintr = True
            return False
        if self._eintr and _CPP_TRACE.match(line):
            return False
        self._eintr = False
        return True

    def lines(self) -> Iterable[str]:
        for line in self._node.lines():
            if self._progress(line):
                self._watch.last_output = self._watch.clock()
            yield line

    def chunks(self) -> Iterable[bytes]:
        """The node's raw output blocks (its own ``chunks()`` where its class has one, else its lines encoded),
        each stamping the last-output time: the streaming path reads blocks, not lines."""
        node = self._node
        if getattr(type(node), "chunks", None) is not None:
            blocks: Iterable[bytes] = node.chunks()
        else:
            blocks = (line.encode("utf-8", "surrogateescape") for line in node.lines())
        for data in blocks:
            text = data.decode("utf-8", "replace").splitlines() or [""]
            if [self._progress(ln) for ln in text].count(True):
                self._watch.last_output = self._watch.clock()
            yield data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)


class StallWatch:
    """Decides, from the last output time and two stack samples, whether the run is stalled.

    ``stall_s``: seconds without any node's output before the stacks are sampled; ``sample``: returns every rank's
    stacks (:func:`broker.run.rankshim.dump_stacks`'s shape); ``on_stall``: ``stop`` or ``report``; ``run_dir``: where
    ``stall.json`` and ``stacks.txt`` go; ``echo``: receives ``[broker] ...`` lines.  ``world_size``: names ranks
    that gave no stack.  ``report_hint``: how the user asks for ``report`` instead (``broker slurm submit`` has
    no recipe: ``--on-stall report``).
    """

    def __init__(self, stall_s: float, sample: Sampler, *, on_stall: str = "stop", run_dir: Path | None = None,
                 echo: Callable[[str], None] | None = None, gap_s: float = SAMPLE_GAP_S,
                 world_size: int | None = None, clock: Callable[[], float] = time.monotonic,
                 report_hint: str = "recipe on_stall: report"):
        self.stall_s = float(stall_s)
        self.sample = sample
        self.on_stall = on_stall
        self.run_dir = Path(run_dir) if run_dir else None
        self.echo = echo
        self.gap_s = gap_s
        self.world_size = world_size
        self.clock = clock
        self.report_hint = report_hint
        self.last_output = clock()
        self.found: Verdict | None = None
        self.reason = ""
        self._reported: tuple | None = None
        self._busy_at = float("-inf")  # when the ranks were last judged busy (computing)

    def wrap(self, nodes: list[Any]) -> list[Any]:
        """The nodes with their output lines timed (pass the result to the supervisor's pumps)."""
        self.last_output = self.clock()
        return [_Timed(n, self) for n in nodes]

    def _say(self, line: str) -> None:
        if self.echo is not None:
            self.echo(f"[broker] {line}")

    def _sample(self) -> tuple[dict[str, dict[str, Any]], list[Place]]:
        try:
            raw = self.sample() or {}
        except Exception as e:  # noqa: BLE001 - a failed sample is no evidence of a stall
            self._say(f"could not read the ranks' stacks: {type(e).__name__}: {e}")
            raw = {}
        return raw, places_from_sample(raw)

    def check(self) -> bool:
        """Sample when the output has been silent for ``stall_s``; True when the run is stalled and ``on_stall``
        is ``stop`` (the caller then stops every node, with :attr:`reason`).  Blocks for about ``gap_s`` while
        sampling."""
        silent = self.clock() - self.last_output
        if silent < self.stall_s or self.clock() - self._busy_at < self.stall_s:
            return False  # silent too briefly, or judged busy less than stall_s ago: judge again after stall_s
        raw1, first = self._sample()
        if not any(not p.ended for p in first) or any(p.importing for p in first):
            self.last_output = self.clock()  # nothing to judge (no rank started yet?): look again after stall_s
            return False
        time.sleep(self.gap_s)
        if self.clock() - self.last_output < self.stall_s:
            return False  # output came while sampling: progress
        quiet_since = self.last_output  # the silence is measured before the second sample: what it causes is not
        raw2, second = self._sample()
        if [p.key() for p in first] != [p.key() for p in second]:
            self.last_output = self.clock()  # the stacks moved: silent progress, not a stall
            return False
        live = [p for p in second if not p.ended]
        # a rank in a known wait is waiting however much CPU it uses (NCCL spins a core while it waits)
        busy = busy_ranks(first, second) - {p.rank for p in second if p.waits}
        outside = [p for p in live if not p.collective]
        # computing at one line is progress: every rank busy, or a rank busy outside the collective the others
        # wait in (a slow rank: the collective completes when it arrives)
        if busy and (busy >= {p.rank for p in live} or any(p.rank in busy for p in outside)):
            slow = [p for p in outside if p.rank in busy]
            if slow:
                # said at each judgement (every stall_s of silence), with the silence so far: a busy run is
                # re-judged, never passed once for ever
                self._reported = ("slow", tuple(p.key() for p in second))
                self._say(f"no output for {self.clock() - self.last_output:.0f} s: "
                          + "; ".join(f"rank {p.rank} is busy {p.elsewhere()}" for p in slow)
                          + (" while " + "; ".join(p.describe() for p in live if p.collective)
                             if any(p.collective for p in live) else "")
                          + " (computing, not stuck: not stopped)")
            self._busy_at = self.clock()  # the silence keeps counting; the next judgement comes after stall_s
            return False
        v = verdict(second, self.world_size)
        silent = self.clock() - min(quiet_since, self.last_output)
        key = tuple(p.key() for p in second)
        stop = self.on_stall == "stop"
        if key != self._reported:
            self._reported = key
            self.found = v
            self._say(f"stalled: no output for {silent:.0f} s and every rank at the same place in two stack samples "
                      f"{self.gap_s:.0f} s apart")
            for ln in v.lines:
                self._say(ln)
            self._say(f"cause: {v.cause}")
            self._say(f"fix: {v.fix}")
            self._say(f"on_stall: stop -> stopping every node ({self.report_hint} keeps a stalled run going)"
                      if stop else "on_stall: report -> the run goes on")
            self._write(v, raw2, silent, stop)
        self.reason = (f"stalled: no output for {silent:.0f} s; {v.headline}; stopped every node" if stop else "")
        if not stop:
            self.last_output = self.clock()
        return stop

    def at_deadline(self) -> None:
        """One stack sample when the deadline stops a run that had not been found stalled: where every rank was
        (``stall.json`` with ``when: deadline``), so a deadline report is never empty."""
        if self.found is not None:
            return
        raw, places = self._sample()
        if not any(not p.ended for p in places):
            return
        v = verdict(places, self.world_size)
        self._say("at the deadline: " + "; ".join(v.lines))
        self._write(v, raw, self.clock() - self.last_output, False, when="deadline")

    def _write(self, v: Verdict, raw: dict[str, dict[str, Any]], silent: float, stopped: bool,
               when: str = "stall") -> None:
        if self.run_dir is None:
            return
        data = {"when": when, "silent_s": round(silent, 1), "gap_s": self.gap_s, "stopped": stopped,
                "lines": v.lines, "cause": v.cause, "fix": v.fix, "ranks": [p.as_dict() for p in v.places],
                "flight_recorder": []}
        try:
            from broker.core.private import private_dirs, private_opener, write_private

            private_dirs(self.run_dir)
            write_private(self.run_dir / "stall.json", json.dumps(data, indent=1) + "\n")
            with open(self.run_dir / "stacks.txt", "w", encoding="utf-8", opener=private_opener) as f:
                for r, e in sorted(raw.items(), key=lambda kv: kv[0]):
                    if isinstance(e, dict) and isinstance(e.get("text"), str):
                        f.write(f"=== rank {r} (node {e.get('node')}, pid {e.get('pid')}, {e.get('tool')})\n")
                        f.write(e["text"].rstrip() + "\n\n")
                        for w in e.get("workers") or []:  # its forked DataLoader workers
                            if isinstance(w, dict) and isinstance(w.get("text"), str):
                                f.write(f"=== rank {r}'s DataLoader worker (pid {w.get('pid')})\n")
                                f.write(w["text"].rstrip() + "\n\n")
        except OSError:
            pass


def read_stall(run_dir: Path) -> dict[str, Any] | None:
    """``<run>/stall.json`` as :meth:`StallWatch.check` wrote it (None when the run never stalled)."""
    try:
        d = json.loads((Path(run_dir) / "stall.json").read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("lines"), list) else None


# ------------------------------------------------------------------------------------------------ samplers
def local_sampler(facts_dirs: Iterable[Path], wait_s: float = 3.0) -> Sampler:
    """Stacks of the ranks whose facts are in ``facts_dirs`` (this machine's nodes), merged."""
    from broker.run import rankshim
    dirs = [Path(d) for d in facts_dirs]

    def sample() -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for d in dirs:
            out.update(rankshim.dump_stacks(str(d), wait_s=wait_s))
        return out

    return sample


def stack_answers(text: str) -> dict[str, dict[str, Any]]:
    """Every complete ``--dump-stacks`` answer in ``text`` (:func:`broker.run.rankshim.frame_answer`'s tagged lines,
    in any order and mixed with other output, e.g. several ``srun`` tasks' at once) merged into ``{rank: entry}``.
    An answer with a missing or damaged line (its CRC-32 in the ID) is left out: a node whose answer did not arrive
    whole gives no stacks."""
    from broker.run.rankshim import ANSWER_TAG

    parts: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        tag, _, rest = line.lstrip().partition(" ")  # never strip the end: a chunk may end in a space of the JSON
        if tag != ANSWER_TAG:
            continue
        ident, _, rest = rest.partition(" ")
        pos, _, chunk = rest.partition(" ")
        i, _, n = pos.partition("/")
        if not (i.isdigit() and n.isdigit()) or not 1 <= int(i) <= int(n):
            continue
        if counts.setdefault(ident, int(n)) != int(n):
            continue
        parts.setdefault(ident, {})[int(i)] = chunk
    out: dict[str, dict[str, Any]] = {}
    for ident, got in sorted(parts.items()):
        if len(got) != counts[ident]:
            continue
        whole = "".join(got[i] for i in range(1, counts[ident] + 1))
        if f"{zlib.crc32(whole.encode()):08x}" != ident.rpartition("-")[2]:
            continue
        try:
            d = json.loads(whole)
        except ValueError:
            continue
        if isinstance(d, dict):
            out.update({str(k): v for k, v in d.items() if isinstance(v, dict)})
    return out


def remote_stack_command(python: str, base: str, shim_name: str = "rankshim.py") -> str:
    """The shell line that prints the stacks of the ranks of a node whose folder is ``base`` (the shim and its
    ``facts/`` live there)."""
    import shlex

    q = shlex.quote
    return f"{q(python)} {q(base + '/' + shim_name)} --dump-stacks {q(base + '/facts')}"


def remote_sampler(run: Callable[[int, str], tuple[int | None, str]], commands: dict[int, str]) -> Sampler:
    """Stacks of remote nodes: ``run(i, command)`` runs ``commands[i]`` (``python rankshim.py --dump-stacks DIR``)
    on node ``i`` and returns (exit code, output); the answers (:func:`stack_answers`) are merged (a node that does
    not answer is left out)."""

    def sample() -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for i, cmd in sorted(commands.items()):
            try:
                code, text = run(i, cmd)
            except Exception:  # noqa: BLE001 - a node that does not answer gives no stacks
                continue
            if code != 0:
                continue
            out.update(stack_answers(text))
        return out

    return sample
