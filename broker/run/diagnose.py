"""What went wrong in a run, in words a learner can act on: the rank that failed first, its own error, and the
cause and fix from a catalogue of classic failures.

Inputs, all left in the run folder by the launchers:

* the rank facts of :mod:`broker.run.rankshim` (``<run>/node<i>/facts/rank<r>.json``: host, RANK, device, backend,
  versions, the exception with the frame in the user's script, the end time or the clean-exit time);
* every node's log (``<run>/node<i>.log``), for torchrun's own lines (exit codes, signals, its "Root Cause"
  block) and the libraries' messages the catalogue knows;
* the :class:`broker.run.supervisor.RunResult` (status, exit codes).

The catalogue is data (``broker/diagnoses.yaml``): log pattern -> cause -> fix -> the lint rule or preflight check
that would have caught it.  :func:`explain` is the one entry point; :meth:`Diagnosis.lines` renders it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from broker.run.sanity import sanity_warnings, skipped_backward  # noqa: F401 (names kept for callers)

CATALOGUE_PATH = Path(__file__).with_name("diagnoses.yaml")

#: torchrun's "Root Cause (first observed failure)" block
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: (\d+)\)")
_ROOT_TIME = re.compile(r"^\s*time\s*:\s*(\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
#: NCCL's flight-recorder line: how far each rank got
_NCCL_ENQUEUED = re.compile(r"\[rank(\d+)\]:.*[Ll]ast enqueued NCCL work: (\d+), last completed NCCL work: (\d+)")
_NCCL_SEQ = re.compile(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+)")
#: a C++ exception that ended the process: ``terminate called after throwing an instance of 'T'`` + ``what():``
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'\n\s*what\(\):\s*(.*)")
#: ``python -m torch.distributed.run`` with a Python that lacks torch: runpy's one-line error
_NO_MODULE = re.compile(r"Error while finding module specification for '[\w.]+' \((?P<type>\w+Error): "
                        r"(?P<msg>[^)\n]*)\)")
#: lines that count as errors in a run whose ranks all exited 0
_ERROR_LINE = re.compile(r"^(\[rank\d+\]:\s?)?(Traceback \(most recent call last\):|.*\bERROR\b)")
#: torch's excepthook prefixes a rank's traceback with ``[rankN]: ``
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
#: torchelastic's end-of-job barrier noise on a node whose peer (the store host) exited first: harmless
_BENIGN = ("Error waiting on exit barrier", "exit barrier")


@dataclass(frozen=True)
class Entry:
    """One catalogue entry (see diagnoses.yaml for the fields)."""

    id: str
    patterns: tuple[str, ...]
    cause: str
    fix: str
    caught_by: str
    verified: str = ""
    facts: str | None = None
    waiting: bool = False
    #: for a run on this machine (``--provider local``), when it differs: the fix and what would have caught it
    fix_local: str = ""
    caught_by_local: str = ""

    def search(self, text: str) -> re.Match | None:
        for p in self.patterns:
            m = re.search(p, text)
            if m:
                return m
        return None


@lru_cache(maxsize=1)
def catalogue() -> tuple[Entry, ...]:
    """The entries of diagnoses.yaml, in order."""
    raw = yaml.safe_load(CATALOGUE_PATH.read_text())
    return tuple(Entry(id=e["id"], patterns=tuple(e.get("patterns") or ()), cause=" ".join(e["cause"].split()),
                       fix=" ".join(e["fix"].split()), caught_by=e["caught_by"],
                       verified=" ".join(str(e.get("verified", "")).split()), facts=e.get("facts"),
                       waiting=bool(e.get("waiting")), fix_local=" ".join(str(e.get("fix_local", "")).split()),
                       caught_by_local=" ".join(str(e.get("caught_by_local", "")).split())) for e in raw)


@dataclass
class Finding:
    """A catalogue entry that matched: where, and the line that matched."""

    entry: Entry
    node: int | None
    line: str
    what: str = ""

    @property
    def cause(self) -> str:
        if not self.what:
            return re.sub(r"\s*\(\{what\}\)", "", self.entry.cause).replace("{what}", "?")
        return self.entry.cause.replace("{what}", self.what)


@dataclass
class Failure:
    """A rank's end that was not a clean exit."""

    node: int | None
    rank: int | None
    at: float | None  # epoch seconds
    exc_type: str = ""
    message: str = ""
    frame: dict[str, Any] | None = None
    exit_code: int | None = None
    source: str = "facts"  # facts | torchrun

    def where(self) -> str:
        who = f"node {self.node}" if self.node is not None else "a node"
        return f"{who}, rank {self.rank}" if self.rank is not None else who

    def error(self) -> str:
        if self.exc_type:
            first = self.message.strip().splitlines()[0] if self.message.strip() else ""
            return f"{self.exc_type}: {first}" if first else self.exc_type
        if self.exit_code is not None:
            from broker.run.executor import describe_exit
            return f"exit code {describe_exit(self.exit_code)}"
        return "failed"


@dataclass
class Diagnosis:
    """What :func:`explain` found.  ``first``: the rank that failed first; ``early_exits``: ranks that exited 0
    while others later failed waiting for them (named as the cause); ``findings``: catalogue matches, the most
    relevant first; ``error_lines``: error output of a run whose ranks all exited 0."""

    first: Failure | None = None
    early_exits: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    error_lines: list[str] = field(default_factory=list)
    behind: list[int] = field(default_factory=list)  # ranks that never reached the collective the others wait in
    notes: list[str] = field(default_factory=list)
    #: ``<run>/stall.json`` (:mod:`broker.run.stall`): every rank's place when the run stalled, cause and fix
    stall: dict[str, Any] | None = None
    #: a succeeded run that may have trained wrong (:func:`sanity_warnings`)
    warnings: list[str] = field(default_factory=list)
    #: the run ran on this machine (``--provider local``): the catalogue's local fix and catch are shown
    local: bool = False
    #: where the ranks' sequences of collectives first part (:func:`broker.run.stall.sequence_divergence`), when
    #: one rank left the common path
    divergence: dict[str, Any] | None = None
    #: the lint rules that fire on the run's script (None: not known): a "would have been caught by" line names
    #: only those of its rules
    lint_found: set[str] | None = None
    #: the run's preflight checks by name (``tcp 0->1``, ``interface``, ...) and their results (PASS | WARN |
    #: FAIL), from ``<run>/preflight.json`` (None: no preflight ran): a check that passed here caught nothing
    preflight: dict[str, str] | None = None

    def _preflight_passed(self, part: str) -> bool:
        """Whether ``part`` (``preflight check tcp listen (...)``, ``preflight tcp probes ...``) names checks that
        ran in this run and all passed."""
        if self.preflight is None:
            return False
        m = re.match(r"preflight (?:check )?([a-z]+(?: listen)?)", part)
        if not m:
            return False
        name = m.group(1)
        ran = [r for c, r in self.preflight.items() if c == name or (name == "tcp" and c.startswith("tcp "))]
        return bool(ran) and all(r == "PASS" for r in ran)

    def caught(self, entry: "Entry") -> str:
        """What would have caught ``entry``'s cause, true for this script and run: a lint rule that finds nothing
        in it, or a preflight check that ran and passed, is not named."""
        text = (self.local and entry.caught_by_local) or entry.caught_by
        parts = []
        for part in text.split("; "):
            if part.startswith("preflight") and self._preflight_passed(part):
                continue
            m = re.match(r"lint rules? ([\w-]+(?:(?:,| and) [\w-]+)*)(.*)$", part)
            if not m or self.lint_found is None:
                parts.append(part)
                continue
            rules = re.split(r", | and ", m.group(1))
            hit = [r for r in rules if r in self.lint_found]
            if hit:
                parts.append(f"lint rule{'s' if len(hit) > 1 else ''} {' and '.join(hit)}{m.group(2)}")
        return "; ".join(parts) if parts else ("none before launch (no lint rule finds it in this script, and "
                                               "preflight's checks passed)")

    @property
    def headline(self) -> str:
        if self.stall:
            head = "at the deadline" if self.stall.get("when") == "deadline" else "stalled"
            return f"{head}: " + str(self.stall["lines"][0])
        if self.divergence:
            return self._divergence_text()
        if self.early_exits:
            e = self.early_exits[0]
            who = f"node {e['node']}, rank {e['rank']}" if e.get("rank") is not None else \
                f"node {e['node']} (its torchrun and ranks)"
            return (f"{who} exited 0 before a collective the other ranks were waiting in: it is the cause, the "
                    "others timed out or lost their peer")
        if self.first is not None:
            return f"{self.first.where()} failed first: {self.first.error()}"
        if self.findings:
            return self.findings[0].cause
        return ""

    def _divergence_text(self) -> str:
        from broker.run.sequences import _sig_text

        d = self.divergence or {}
        if d.get("skipped") is not None:
            return d["line"] + "; the other ranks' ends follow from it"
        left = d["left"]
        sig = d["by_rank"][left[0]]
        cond = sig[4] if len(sig) > 4 else None
        if isinstance(cond, str):
            cond = json.loads(cond)
        under = f", under `{cond[1]}` (line {cond[0]})," if cond else ""
        others = sorted((r for r in d["by_rank"] if r not in left), key=str)
        then = "; ".join(f"rank {r} made {_sig_text(d['by_rank'][r])}" for r in others)
        return (f"rank(s) {', '.join(map(str, left))} left the ranks' common path at collective #{d['index']}: "
                f"{_sig_text(sig)}{under} where {then or 'the others made none'}; the other ranks' ends follow "
                "from it")

    def lines(self) -> list[str]:
        """Plain text lines for the summary (empty when there is nothing to say)."""
        out: list[str] = []
        if self.headline:
            out.append(self.headline)
        if self.stall:
            st = self.stall
            out.extend(str(ln) for ln in st["lines"][1:])
            seen = (f"no output for {st.get('silent_s', '?')} s, the same stacks {st.get('gap_s', '?')} s apart"
                    if st.get("when") != "deadline" else "one stack sample at the deadline")
            out.append(f"cause [stall]: {st.get('cause', '')} ({seen}; stacks in stacks.txt)")
            out.append(f"  fix: {st.get('fix', '')}")
            out.extend(str(ln) for ln in st.get("flight_recorder") or [])
        if self.divergence and self.divergence.get("skipped") is not None:
            out.append("  fix: call backward() on every rank for every forward of the DDP model (it all-reduces the "
                       "gradients there); to skip a bad batch, decide it on all ranks together (all_reduce the flag) "
                       "or scale its loss by 0 instead of skipping backward()")
        elif self.divergence:
            op = str(self.divergence["by_rank"][self.divergence["left"][0]][0])
            out.append("  fix: " + ("evaluate through model.module (the DDP model's forward broadcasts buffers: a "
                                    "collective every rank must make), or run it on every rank"
                                    if op.startswith("DDP forward") else
                                    "every rank must make the same collectives in the same order: move the call "
                                    "where every rank reaches it"))
        f = self.first
        if f is not None and (f.exc_type or f.frame):
            if self.early_exits or self.divergence:
                out.append(f"then {f.where()} failed: {f.error()}")
            out.extend(f"  {ln}" for ln in message_rest(f.message))
            if f.frame and not _is_broker_frame(str(f.frame.get("file", ""))):  # broker's shim is not the user's
                fr = f.frame
                out.append(f"  at {fr.get('file')}:{fr.get('line')} in {fr.get('function')}: {fr.get('code', '')}")
        if self.behind:
            out.append("never arrived at the collective the others waited in: rank(s) "
                       + ", ".join(map(str, self.behind)))
        seen: set[str] = set()
        for fd in self.findings:
            if fd.entry.id in seen:
                continue
            seen.add(fd.entry.id)
            where = f" (node {fd.node})" if fd.node is not None else ""
            out.append(f"cause [{fd.entry.id}]{where}: {fd.cause}")
            out.append(f"  fix: {(self.local and fd.entry.fix_local) or fd.entry.fix}")
            out.append(f"  would have been caught by: {self.caught(fd.entry)}")
        if self.error_lines:
            out.append("every node exited 0, but the ranks printed errors:")
            out.extend(f"  {ln}" for ln in self.error_lines)
        for w in self.warnings:
            out.append(f"warning: {w}")
        out.extend(self.notes)
        return out


def message_rest(message: str, limit: int = 12) -> list[str]:
    """The lines of an exception message after its first (torch's text stays whole and in order), up to the C++
    ``Exception raised from`` trace that follows it, at most ``limit`` lines."""
    out = []
    for ln in message.strip().splitlines()[1:]:
        if ln.startswith(("Exception raised from", "frame #")):
            break
        if ln.strip():
            out.append(ln.rstrip())
        if len(out) >= limit:
            break
    return out


# ------------------------------------------------------------------------------------------------ inputs
def _preflight_results(run_dir: Path) -> dict[str, str] | None:
    """``{check name: result}`` of the run's ``preflight.json`` (a name's worst result when it has several rows),
    or None when there is none or it cannot be read."""
    try:
        data = json.loads((Path(run_dir) / "preflight.json").read_text())
        rows = data.get("checks") if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
    if not isinstance(rows, list):
        return None
    rank = {"PASS": 0, "WARN": 1, "FAIL": 2}
    out: dict[str, str] = {}
    for r in rows:
        if isinstance(r, dict) and isinstance(r.get("check"), str) and r.get("result") in rank:
            prev = out.get(r["check"])
            if prev is None or rank[r["result"]] > rank[prev]:
                out[r["check"]] = r["result"]
    return out


def load_facts(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's facts under ``run_dir/node*/facts/``, sorted by rank (unreadable files skipped)."""
    out = []
    for p in sorted(Path(run_dir).glob("node*/facts/rank*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if d.get("node") is None:
            m = re.match(r"node(\d+)$", p.parent.parent.name)
            d["node"] = int(m.group(1)) if m else None
        out.append(d)
    return sorted(out, key=lambda d: (d.get("rank") is None, d.get("rank") or 0))


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _torchrun_failures(node: int, text: str) -> list[Failure]:
    """Failures from torchrun's "Root Cause" blocks (one per failed rank; time to the second, local time)."""
    out: list[Failure] = []
    cur: dict[str, Any] = {}
    for line in text.splitlines():
        m = _ROOT_TIME.match(line)
        if m:
            cur = {"at": time.mktime(time.strptime(m.group(1), "%Y-%m-%d_%H:%M:%S"))}
            continue
        m = _ROOT_RANK.match(line)
        if m and cur:
            cur["rank"] = int(m.group(1))
            continue
        m = _ROOT_EXIT.match(line)
        if m and "rank" in cur:
            out.append(Failure(node=node, rank=cur["rank"], at=cur["at"], exit_code=int(m.group(1)),
                               source="torchrun"))
            cur = {}
    return out


#: files of broker's own code that run on the nodes: their frames are never the user's line
_BROKER_NODE_FILES = ("rankshim.py", "rankshim_record.py", "rankshim_stacks.py")


def _is_broker_frame(path: str) -> bool:
    """Whether a traceback's file is broker's (the rank shim, wherever it was staged), not the user's script."""
    p = path.replace("\\", "/")
    return Path(p).name in _BROKER_NODE_FILES


def _log_exception(text: str, *, agent: bool = False) -> tuple[str, str, dict[str, Any] | None]:
    """(type, message, user frame) of the first Python traceback in a log that is not torchrun's own (with
    ``agent``: torchrun's own too, for a launcher that failed before any rank ran, e.g. its store's port taken)."""
    lines = [_RANK_PREFIX.sub("", ln) for ln in text.splitlines()]
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last):"):
            continue
        frame = None
        j = i + 1
        while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
            m = re.match(r'\s+File "([^"]+)", line (\d+), in (\S+)', lines[j])
            if m and "site-packages" not in m.group(1) and not m.group(1).startswith("<frozen") \
                    and not _is_broker_frame(m.group(1)):
                code = lines[j + 1].strip() if j + 1 < len(lines) else ""
                frame = {"file": Path(m.group(1)).name, "line": int(m.group(2)), "function": m.group(3),
                         "code": code}
            j += 1
        if j >= len(lines):
            break
        exc = lines[j]
        if "ChildFailedError" in exc or "SignalException" in exc or \
                (not agent and "torch/distributed/run.py" in "\n".join(lines[i:j])):
            continue  # torchrun's own traceback, not the rank's
        typ, _, msg = exc.partition(": ")
        more = []
        for ln in lines[j + 1:j + 4]:
            if not ln.strip() or ln.startswith(("Traceback", "[", " ")) or re.match(r"^[EWI]\d{4} ", ln):
                break
            more.append(ln)
        return typ.strip(), "\n".join([msg] + more), frame
    return "", "", None


def error_lines(log_paths: dict[int, Path], limit: int = 12) -> list[str]:
    """``node i: <line>`` for the Traceback headers, their exception lines and ``ERROR`` lines in the logs
    (torchelastic's harmless exit-barrier noise left out)."""
    out: list[str] = []
    for node, path in sorted(log_paths.items()):
        text = _read(path)
        if "ERROR" not in text and "Traceback (most recent call last):" not in text:
            continue  # a clean log: one scan (substrings, the fastest), not a Python loop over its every line
        lines = [_RANK_PREFIX.sub("", ln) for ln in text.splitlines()]
        for k, line in enumerate(lines):
            if line.startswith("broker:") or any(b in line for b in _BENIGN):
                continue
            if not _ERROR_LINE.match(line):
                continue
            if line.startswith("Traceback"):
                j = k + 1
                while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                    j += 1
                exc = lines[j] if j < len(lines) else ""
                if any(b in "\n".join(lines[max(0, k - 3):j + 1]) for b in _BENIGN):
                    continue
                out.append(f"node {node}: {line} ... {exc}".rstrip())
            else:
                out.append(f"node {node}: {line}")
            if len(out) >= limit:
                return out
    return out


# ------------------------------------------------------------------------------------------------ judging
def _facts_findings(facts: list[dict[str, Any]]) -> list[Finding]:
    out: list[Finding] = []
    by_id = {e.id: e for e in catalogue()}
    torch_versions = {d.get("torch") for d in facts if d.get("torch")}
    if len(torch_versions) > 1 and "torch-version-skew" in by_id:
        what = ", ".join(f"node {d.get('node')}: {d.get('torch')}" for d in facts if d.get("torch"))
        out.append(Finding(by_id["torch-version-skew"], None, "rank facts", what))
    ranks = [d.get("init_rank") for d in facts if d.get("init_rank") is not None]
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup and "duplicate-rank" in by_id:
        who = ", ".join(f"node {d.get('node')} (RANK={d.get('rank')})" for d in facts if d.get("init_rank") in dup)
        out.append(Finding(by_id["duplicate-rank"], None, "rank facts",
                           f"rank {', '.join(map(str, dup))} given to init_process_group by {who}"))
    out += _init_findings(facts, by_id) + _collective_findings(facts, by_id)
    return out


_LOCALHOST = re.compile(r"(localhost|127\.\d+\.\d+\.\d+|\[?::1\]?)")


def _init_findings(facts: list[dict[str, Any]], by_id: dict[str, Entry]) -> list[Finding]:
    """What init_process_group was given: a world size other than torchrun's, a localhost init_method on a
    multi-host run, MASTER_ADDR/PORT changed by the script."""
    out: list[Finding] = []
    bad = [d for d in facts if d.get("init_world_size") is not None and d.get("world_size") is not None
           and d["init_world_size"] != d["world_size"]]
    if bad and "world-size-mismatch" in by_id:
        d = bad[0]
        out.append(Finding(by_id["world-size-mismatch"], d.get("node"), "rank facts",
                           f"{d['init_world_size']} but torchrun started {d['world_size']} rank(s)"))
    hosts = {d.get("host") for d in facts if d.get("host")}
    multi = len(hosts) > 1
    loc = [d for d in facts if d.get("init_method") and _LOCALHOST.search(str(d["init_method"]))]
    if loc and multi and "init-method-localhost" in by_id:
        out.append(Finding(by_id["init-method-localhost"], loc[0].get("node"), "rank facts",
                           repr(loc[0]["init_method"])))
    moved = [d for d in facts if d.get("init_master") and d.get("master") and d["init_master"] != d["master"]]
    if moved and "master-env-overwritten" in by_id:
        d = moved[0]
        out.append(Finding(by_id["master-env-overwritten"], d.get("node"), "rank facts",
                           f"{d['init_master']} where torchrun gave {d['master']}"))
    return out


#: the least lag (seconds) between the first and a late rank at the same collective that counts as "slow"
SLOW_RANK_MIN_GAP_S = 3.0
_TIMEOUT_TEXT = re.compile(r"[Tt]imed? ?out|[Tt]imeout|DistStoreError|Watchdog caught")


def _collective_findings(facts: list[dict[str, Any]], by_id: dict[str, Entry]) -> list[Finding]:
    """From each rank's last collective call (the shim counts them): different shapes in the same call, or a
    rank that entered it after another rank had already given up (slow, not missing)."""
    last = {d.get("rank"): d["last_collective"] for d in facts
            if isinstance(d.get("last_collective"), dict) and d.get("rank") is not None}
    if len(last) < 2:
        return []
    out: list[Finding] = []
    top = max(c.get("n", 0) for c in last.values())
    at_top = {r: c for r, c in last.items() if c.get("n") == top}
    ops = {c.get("op") for c in at_top.values()}
    if len(at_top) > 1 and len(ops) == 1:
        shapes = {r: c.get("shape") for r, c in at_top.items()}
        if len({json.dumps(v) for v in shapes.values()}) > 1 and "collective-shapes-differ" in by_id:
            op = ops.pop()
            what = f"{op} call #{top}: " + ", ".join(
                f"rank {r} {_shape_text(v)}" for r, v in sorted(shapes.items()))
            out.append(Finding(by_id["collective-shapes-differ"], None, "rank facts", what))
            return out
    ends = [d.get("ended") for d in facts if d.get("exception") and d.get("ended")]
    # a slow rank is only inferred when some rank gave up on a timeout: ranks that all raised a definite error
    # at the same call (NCCL's "Duplicate GPU detected") were not waiting for a late peer
    timed_out = any(_TIMEOUT_TEXT.search(str(d["exception"].get("message", "")) + str(d["exception"].get("type", "")))
                    for d in facts if isinstance(d.get("exception"), dict))
    if len(at_top) == len(last) and ends and timed_out and "slow-rank" in by_id:
        gave_up = min(ends)
        late = sorted((c["at"], r) for r, c in at_top.items() if isinstance(c.get("at"), (int, float))
                      and c["at"] > gave_up - 0.5)
        early = [c["at"] for c in at_top.values() if isinstance(c.get("at"), (int, float))]
        if late and early and len(late) < len(at_top) and late[0][0] - min(early) >= SLOW_RANK_MIN_GAP_S:
            at, r = late[0]
            op = at_top[r].get("op")
            out.append(Finding(by_id["slow-rank"], None, "rank facts",
                               f"rank {r} reached {op} call #{top} {at - min(early):.1f} s after the first rank"))
    return out


def _shape_text(v: Any) -> str:
    if isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and isinstance(v[1], str):
        return f"{tuple(v[0])} {v[1]}"
    return str(v)


#: findings that are only the symptom of a cause found in the rank facts (dropped when such a cause is there)
_SYMPTOMS = ("collective-timeout", "peer-gone")
_CAUSES_FROM_FACTS = ("world-size-mismatch", "collective-shapes-differ", "slow-rank", "init-method-localhost",
                      "master-env-overwritten", "duplicate-rank")


def searchable_lines(text: str) -> list[str]:
    """The lines of a log the catalogue may match: everything except what a Python traceback quotes from the
    source (the ``File "...", line N`` lines, the source line under each and its ``^^^`` marks): a comment that says
    "invalid device ordinal" is not that error."""
    out: list[str] = []
    in_tb = False
    for raw in text.splitlines():
        line = _RANK_PREFIX.sub("", raw)
        if line.startswith("Traceback (most recent call last):"):
            in_tb = True
            continue
        if in_tb:
            if line.startswith((" ", "\t")) or not line.strip():
                continue  # a frame, its source line, or a caret line
            in_tb = False  # the exception line ends the traceback
        out.append(line)
    return out


def _match_catalogue(texts: list[tuple[int | None, str]]) -> list[Finding]:
    out: list[Finding] = []
    for entry in catalogue():
        for node, text in texts:
            for line in searchable_lines(text):
                m = entry.search(line)
                if m:
                    what = (m.groupdict().get("what") or "").strip()
                    out.append(Finding(entry, node, line.strip()[:300], what))
                    break
            else:
                continue
            break
    return out


#: statuses of runs whose nodes broker stopped itself: their ends (SIGTERM, torchrun's exit 1) blame nobody
STOPPED_BY_BROKER = ("deadline", "interrupted")
#: exceptions a rank raises because broker stopped it
_STOP_EXCEPTIONS = ("KeyboardInterrupt", "SignalException", "SystemExit")
#: what a rank's collective raises when broker stopped its peer first: a consequence of the stop, not a failure
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ECONNRESET", "EPIPE")


def _stopped_run(diag: Diagnosis, status: str, facts: list[dict[str, Any]]) -> Diagnosis:
    """A deadline or interrupted run: only a rank's own exception from before the stop is a failure; the rest is
    a note that broker stopped the nodes (never "node 0 failed first: exit code 1" for a node broker stopped)."""
    own = [d for d in facts if d.get("exception")
           and not any(x in str(d["exception"].get("type", "")) for x in _STOP_EXCEPTIONS)
           and not any(x in str(d["exception"].get("message", "")) for x in _PEER_GONE)]
    if own:
        d = min(own, key=lambda d: d.get("ended") or 0.0)
        exc = d["exception"]
        diag.first = Failure(node=d.get("node"), rank=d.get("rank"), at=d.get("ended"),
                             exc_type=exc.get("type", ""), message=exc.get("message", ""), frame=exc.get("frame"))
    why = "the deadline passed" if status == "deadline" else "the run was interrupted (Ctrl-C or a signal)"
    running = [d.get("rank") for d in facts if d.get("ended") is None]
    note = f"{why}: broker stopped every node (their exit codes are broker's signals, not failures)"
    if running:
        note += "; rank(s) " + ", ".join(map(str, running)) + " were still running"
    diag.notes.append(note)
    if status == "deadline" and diag.stall is None:
        diag.notes.append("if the ranks were waiting for each other, a lower stall_s in the recipe names where each "
                          "one was long before the deadline")
    diag.findings = _facts_findings(facts)
    return diag


def lint_rules_found(script: Path | None) -> set[str] | None:
    """The ids of the lint rules that fire on ``script`` (run under torchrun); None when it cannot be read."""
    if script is None:
        return None
    try:
        source = Path(script).read_text(encoding="utf-8", errors="replace")
        from broker.lint.script import lint_source

        return {f.kind for f in lint_source(source, str(script), launched_by_torchrun=True)}
    except Exception:  # noqa: BLE001 - no lint, no claim either way
        return None


def _failures(facts: list[dict[str, Any]], texts: dict[int, str], codes: dict[int, int | None]) -> list[Failure]:
    """Every failed rank, earliest first: the shim's exceptions and non-zero exits, torchrun's root-cause blocks for
    the ranks without facts, else the first node that exited non-zero with its log's exception."""
    fails: list[Failure] = []
    for d in facts:
        exc = d.get("exception")
        if exc:
            fails.append(Failure(node=d.get("node"), rank=d.get("rank"), at=d.get("ended"),
                                 exc_type=exc.get("type", ""), message=exc.get("message", ""),
                                 frame=exc.get("frame")))
        elif d.get("exit_code") not in (None, 0):
            fails.append(Failure(node=d.get("node"), rank=d.get("rank"), at=d.get("ended"),
                                 exit_code=d.get("exit_code")))
    known = {f.rank for f in fails}
    for node, text in texts.items():
        for f in _torchrun_failures(node, text):
            if f.rank not in known:
                typ, msg, frame = _log_exception(text)
                if typ and f.exit_code not in (None,) and (f.exit_code or 0) > 0:
                    f.exc_type, f.message, f.frame = typ, msg, frame
                elif (f.exit_code or 0) < 0:  # a C++ abort (NCCL's watchdog): std::terminate's what() line
                    m = _TERMINATE.search(text)
                    if m:
                        f.exc_type, f.message = m.group(1), m.group(2).strip()
                fails.append(f)
                known.add(f.rank)
    if not fails:  # no facts and no root-cause block: the first node that exited non-zero, its log's exception
        for node, code in sorted(codes.items()):
            if code not in (None, 0) and code != -15:
                typ, msg, frame = _log_exception(texts.get(node, ""))
                if not typ:
                    typ, msg, frame = _log_exception(texts.get(node, ""), agent=True)
                    typ = f"torchrun on node {node}: {typ}" if typ else ""
                if not typ:  # python -m torch.distributed.run could not even start (no torch in that Python)
                    m = _NO_MODULE.search(texts.get(node, ""))
                    if m:
                        typ, msg = f"{m.group('type')} (torchrun on node {node} did not start)", m.group("msg")
                fails.append(Failure(node=node, rank=None, at=None, exc_type=typ, message=msg, frame=frame,
                                     exit_code=code, source="log"))
                break
    fails.sort(key=lambda f: (f.at is None, f.at or 0.0))
    return fails


def _frame_from_record(first: Failure | None, facts: list[dict[str, Any]]) -> None:
    """A rank killed without a Python frame (a C++ abort, a signal) gets the last user line its collective record
    names."""
    if first is not None and not first.frame and first.rank is not None:
        last = next((d.get("seq") for d in facts if d.get("rank") == first.rank), None)
        try:
            sig = last["sigs"][last["seq"][-1]] if last and last.get("seq") else None
        except (KeyError, IndexError, TypeError):
            sig = None
        if sig and len(sig) > 3 and sig[2]:
            first.frame = {"file": sig[2], "line": sig[3], "function": str(sig[0]),
                          "code": "(no Python frame: the last collective its record holds)"}


def _blame(diag: Diagnosis, facts: list[dict[str, Any]], codes: dict[int, int | None],
           order: list[tuple[int | None, str]]) -> bool:
    """Name the cause among the ranks: a rank that exited 0 before the first failure while the others then failed
    waiting (``diag.early_exits``), or the rank that left the ranks' common path of collectives (``diag.divergence``;
    then a rank that exited 0 after that path is not the cause).  Returns whether the first failing rank failed
    waiting for a peer."""
    own = order[:2] if diag.first is not None else order
    waiting = any(fd.entry.waiting for fd in _match_catalogue(own))

    # a rank that ended cleanly before the first failure, while the others then failed waiting: the cause
    first_at = diag.first.at if diag.first else None
    for d in facts:
        if d.get("exit_code") == 0 and d.get("ended") and (first_at is None or d["ended"] < first_at):
            if waiting:
                diag.early_exits.append({"node": d.get("node"), "rank": d.get("rank"), "at": d["ended"]})
    if not facts and waiting:  # no facts: a node whose torchrun exited 0 while another waited and failed
        for node, code in sorted(codes.items()):
            if code == 0:
                diag.early_exits.append({"node": node, "rank": None, "at": None})
    # the ranks' sequences of collectives: a rank that left the common path is the cause, not a rank that
    # exited 0 after making every collective of that path
    from broker.run.stall import sequence_divergence

    div = sequence_divergence({d["rank"]: d.get("seq") for d in facts if d.get("rank") is not None and d.get("seq")})
    if div is None or not div["left"]:
        # a rank that skipped backward(): its sequence is the others' minus one all-reduce (no novel step to see)
        div = skipped_backward(facts) or div
    if div is not None and div["left"] and (waiting or diag.early_exits):
        innocent = [e for e in diag.early_exits if e.get("rank") not in div["left"]]
        diag.early_exits = [e for e in diag.early_exits if e.get("rank") in div["left"]]
        diag.divergence = div
        diag.notes += [f"rank {e['rank']} exited 0 after the collectives of the common path: not the cause"
                       for e in innocent]
    if diag.early_exits:
        diag.findings.sort(key=lambda fd: not fd.entry.waiting)
    return waiting


def _behind(diag: Diagnosis, facts: list[dict[str, Any]], texts: dict[int, str], nnodes: int | None,
            waiting: bool) -> list[int]:
    """The ranks that never reached the collective the others wait in: from NCCL's "last enqueued work" lines, else
    (gloo) from the shim's count of each rank's collective calls."""
    # NCCL's flight recorder: the ranks that enqueued fewer collectives never reached the one the others wait in
    enq: dict[int, int] = {}
    for text in texts.values():
        for m in _NCCL_ENQUEUED.finditer(text):
            enq[int(m.group(1))] = int(m.group(2))
        for line in text.splitlines():
            m = _NCCL_SEQ.search(line)
            if m and "timeout" in line:
                r = re.search(r"\[Rank (\d+)\]", line)
                if r:
                    enq.setdefault(int(r.group(1)), int(m.group(1)))
    if len(enq) > 1 and len(set(enq.values())) > 1:
        top = max(enq.values())
        return sorted(r for r, v in enq.items() if v < top)
    gone = [e["rank"] for e in diag.early_exits if e.get("rank") is not None] if enq and nnodes else []
    if gone:
        return gone
    if waiting:  # the shim's count of each rank's collective calls says the same on gloo
        counts = {d.get("rank"): d["last_collective"].get("n") for d in facts
                  if isinstance(d.get("last_collective"), dict) and d.get("rank") is not None}
        if len(counts) > 1 and len(set(counts.values())) > 1:
            top = max(v for v in counts.values() if isinstance(v, int))
            return sorted(r for r, v in counts.items() if isinstance(v, int) and v < top)
    return []


def explain(run_dir: Path, result: Any, nnodes: int | None = None, *, local: bool = False,
            script: Path | None = None) -> Diagnosis:
    """Diagnose a finished run from its folder and its :class:`~broker.run.supervisor.RunResult` (never raises for odd
    inputs: a diagnosis is best effort).  ``local``: the run ran on this machine (``--provider local``), so fixes
    name this machine's way (the README's install) rather than a rented node's."""
    run_dir = Path(run_dir)
    log_paths: dict[int, Path] = {int(k): Path(v) for k, v in (getattr(result, "log_paths", None) or {}).items()}
    if not log_paths:
        for p in run_dir.glob("node*.log"):
            m = re.match(r"node(\d+)\.log$", p.name)
            if m:
                log_paths[int(m.group(1))] = p
    texts = {n: _read(p) for n, p in sorted(log_paths.items())}
    facts = load_facts(run_dir)
    status = getattr(result, "status", "failed")
    codes: dict[int, int | None] = {int(k): v for k, v in (getattr(result, "exit_codes", None) or {}).items()}
    diag = Diagnosis(local=local, lint_found=lint_rules_found(script), preflight=_preflight_results(run_dir))
    from broker.run.stall import flight_recorder_from_run, read_stall

    diag.stall = read_stall(run_dir)
    if diag.stall is not None:
        diag.stall["flight_recorder"] = flight_recorder_from_run(run_dir)

    if status == "succeeded":
        diag.error_lines = error_lines(log_paths)
        diag.findings = _facts_findings(facts)
        diag.warnings = sanity_warnings(facts)
        return diag
    if diag.stall is not None and diag.stall.get("stopped"):
        diag.findings = _facts_findings(facts)  # broker stopped every node: no rank is blamed for its end
        return diag
    if status in STOPPED_BY_BROKER:
        return _stopped_run(diag, status, facts)
    if diag.stall is None:  # a collective timeout's flight-recorder dumps (nccl): how far each rank got
        diag.notes.extend(flight_recorder_from_run(run_dir))

    fails = _failures(facts, texts, codes)
    diag.first = fails[0] if fails else None
    _frame_from_record(diag.first, facts)

    # catalogue: the first failing node's log first, then the exception text, then the other logs
    order: list[tuple[int | None, str]] = []
    if diag.first is not None:
        if diag.first.message:
            order.append((diag.first.node, f"{diag.first.exc_type}: {diag.first.message}"))
        if diag.first.node in texts:
            order.append((diag.first.node, texts[diag.first.node]))
    order += [(n, t) for n, t in texts.items() if diag.first is None or n != diag.first.node]
    # a definite error the ranks raised (an exception line naming its cause) comes before an inference from the
    # rank facts; symptoms (a timeout, a peer gone) and waiting causes come after the facts
    matched = _match_catalogue(order)
    definite = [fd for fd in matched if fd.entry.id not in _SYMPTOMS and not fd.entry.waiting]
    diag.findings = definite + _facts_findings(facts) + [fd for fd in matched if fd not in definite]
    if any(fd.entry.id in _CAUSES_FROM_FACTS for fd in diag.findings):
        diag.findings = [fd for fd in diag.findings if fd.entry.id not in _SYMPTOMS]
    # did the first failing rank fail waiting for a peer (a timeout, a peer gone)?  Only then is a rank that had
    # exited 0 before it the cause; a rank failing on its own after its peers finished is not
    waiting = _blame(diag, facts, codes, order)
    diag.behind = _behind(diag, facts, texts, nnodes, waiting)
    return diag
