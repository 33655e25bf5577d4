"""Where each rank is, from its Python stacks: the stack parsers (``faulthandler`` dumps, ``py-spy dump`` output),
the collective or known wait a rank's main thread is in, the user's line and the call on it, and a rank waiting for
its DataLoader with the worker that holds it (:func:`places_from_sample` turns one
:func:`broker.run.rankshim_stacks.dump_stacks` answer into a :class:`Place` per rank).  Judged by
:mod:`broker.run.stall`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

#: public torch.distributed calls a rank can wait in (the outermost one under the user's frame is named)
COLLECTIVES = frozenset("""
all_reduce all_reduce_coalesced all_reduce_multigpu reduce broadcast broadcast_object_list all_gather
all_gather_into_tensor all_gather_object all_gather_coalesced gather gather_object scatter scatter_object_list
reduce_scatter reduce_scatter_tensor all_to_all all_to_all_single barrier monitored_barrier send recv isend irecv
batch_isend_irecv send_object_list recv_object_list new_group init_process_group destroy_process_group
""".split())

_FAULTHANDLER_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_PYSPY_THREAD = re.compile(r'^Thread (\S+) \((?P<state>[^)]*)\)(?:: "(?P<name>[^"]*)")?')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]+):(?P<line>\d+)\)\s*$")


@dataclass(frozen=True)
class Frame:
    """One Python frame: file as the rank saw it, line number, function name."""

    file: str
    line: int
    function: str

    @property
    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass
class Place:
    """Where one rank is: the collective it waits in (None: not in one), the innermost frame of the user's code,
    the innermost frame of all (a library's, when the rank is inside one), the source line of the user's frame."""

    rank: int
    node: int | None
    collective: str | None = None
    user: Frame | None = None
    inner: Frame | None = None
    code: str = ""
    ended: bool = False
    exit_code: int | None = None
    exception: str | None = None
    waits: bool = False  # in a known wait (a collective, Work.wait, torch.cuda.synchronize): waiting even if it spins
    importing: bool = False  # inside an import (torch takes seconds to load on a busy host): starting, not stuck
    cpu_s: float | None = None  # CPU seconds of the rank and its workers at the sample
    wait_s: float | None = None  # seconds its threads were runnable but waited for a CPU (a loaded machine)
    t: float | None = None  # when it was sampled (epoch seconds)
    rendezvous: dict[str, Any] | None = None  # in init_process_group: the addresses it was given (rank facts)
    seq: dict[str, Any] | None = None  # its sequence of sync points (rank facts' "seq", the shim's record)
    loader_wait: bool = False  # waiting for a batch from a DataLoader (in its __next__)
    worker: "Place | None" = None  # its DataLoader worker inside the user's code (the dataset): pid in ``rank``

    def key(self) -> tuple:
        return (self.rank, self.ended, self.collective, self.user, self.inner)

    def at(self) -> str:
        """``train.py:33``, or the library frame when there is no user frame."""
        if self.user is None:
            return f"{self.inner.function} ({self.inner.short})" if self.inner else "an unknown place"
        s = self.user.short
        if self.inner is not None and self.inner != self.user and self.collective is None:
            s += f", inside {self.inner.function} ({self.inner.short})"
        return s

    def call(self) -> str:
        """The call on the user's line (``time.sleep``), '' when the line is not a call."""
        m = re.match(r"^\s*(?:[\w.\[\], ]+\s*=\s*)?(?:await\s+|return\s+)?([A-Za-z_][\w.]*)\s*\(", self.code)
        return m.group(1) if m else ""

    def elsewhere(self) -> str:
        """``in time.sleep at train.py:33`` / ``at train.py:33 (x = y)``; a rank waiting for its DataLoader names
        the worker's line: ``waiting for a batch from its DataLoader at train.py:36 (for x in loader:); its worker
        (pid 4711) is in time.sleep at train.py:25 in __getitem__``."""
        if self.loader_wait and self.worker is not None and self.user is not None:
            w = self.worker
            where = w.elsewhere() + (f" in {w.user.function}" if w.user and w.user.function != "<module>" else "")
            return (f"waiting for a batch from its DataLoader at {self.user.short}"
                    + (f" ({self.code})" if self.code else "") + f"; its worker (pid {w.rank}) is {where}")
        c = self.call()
        if c:
            return f"in {c} at {self.at()}"
        return f"at {self.at()}" + (f" ({self.code})" if self.code else "")

    def describe(self) -> str:
        if self.ended:
            how = f"raised {self.exception}" if self.exception else f"exited with code {self.exit_code}"
            return f"rank {self.rank} has already ended ({how})"
        if self.collective:
            return f"rank {self.rank} waits in {self.collective} at {self.at()}"
        return f"rank {self.rank} is {self.elsewhere()}"

    def as_dict(self) -> dict[str, Any]:
        fr = (lambda f: None if f is None else {"file": f.file, "line": f.line, "function": f.function})
        return {"rank": self.rank, "node": self.node, "collective": self.collective, "user": fr(self.user),
                "inner": fr(self.inner), "code": self.code, "ended": self.ended, "exit_code": self.exit_code,
                "exception": self.exception, "text": self.describe()}


def parse_stacks(text: str) -> list[tuple[str, list[Frame]]]:
    """Threads of a ``faulthandler`` dump or of ``py-spy dump`` output: ``[(thread header, frames innermost
    first)]``.  Only the last dump in ``text`` counts (a stack file grows by one dump per signal)."""
    lines = text.splitlines()
    # a faulthandler dump starts with its first thread header after the previous dump's last frame: keep the last
    # dump (headers following a frame line start a new dump only when the thread id repeats)
    threads: list[tuple[str, list[Frame]]] = []
    seen: set[str] = set()
    cur: list[Frame] | None = None
    for ln in lines:
        m = _FAULTHANDLER_THREAD.match(ln) or (_PYSPY_THREAD.match(ln) if not ln.startswith(" ") else None)
        if m:
            tid = m.group(2) if m.re is _FAULTHANDLER_THREAD else m.group(1)
            if tid in seen:  # the same thread again: a newer dump begins
                threads, seen = [], set()
            seen.add(tid)
            cur = []
            threads.append((ln.strip(), cur))
            continue
        if cur is None:
            continue
        m = _FAULTHANDLER_FRAME.match(ln) or _PYSPY_FRAME.match(ln)
        if m:
            cur.append(Frame(m.group("file"), int(m.group("line")), m.group("func").strip()))
    return threads


#: top-level packages py-spy shows without their site-packages folder (when it shortens file names)
_SHORT_LIBS = frozenset({"torch", "torchvision", "numpy", "transformers", "accelerate", "lightning",
                         "pytorch_lightning", "threading.py", "multiprocessing", "queue.py", "selectors.py",
                         "socket.py", "subprocess.py", "concurrent", "asyncio"})


#: the rank shim's own files (rankshim.py and the parts beside it): its frames are never the user's
_SHIM_FILE = re.compile(r"(^|/)rankshim(_record|_stacks)?\.py$")


def _is_user(f: Frame) -> bool:
    p = f.file.replace("\\", "/")
    if p.startswith("<") or "/site-packages/" in p or "/dist-packages/" in p or _SHIM_FILE.search(p):
        return False
    if not p.startswith("/") and p.split("/")[0] in _SHORT_LIBS:  # py-spy's shortened library names
        return False
    return not re.search(r"/lib/python3\.\d+/", p)


def _main_thread(threads: list[tuple[str, list[Frame]]]) -> list[Frame]:
    """The thread that runs the script: the shim's (rankshim.py at its bottom), else one with user frames."""
    for _, frames in threads:
        # the shim's main() at the bottom (its facts-saver thread runs rankshim.py code too, but not main())
        if any(f.file.endswith("rankshim.py") and f.function in ("main", "<module>") for f in frames) \
                or any(f.function == "<module>" and _is_user(f)
                                                                       for f in frames):
            return frames
    for header, frames in threads:
        if "MainThread" in header:
            return frames
    for _, frames in threads:
        if any(_is_user(f) for f in frames):
            return frames
    return threads[0][1] if threads else []


#: names for frames that are only waits: a rank there waits for its peers or the GPU, whatever CPU it uses
#: (NCCL's waits spin a core: torch.cuda.synchronize after a collective that never completes is 100 % busy)
_SYNC = "torch.cuda.synchronize (it waits for the GPU's queued work: an NCCL collective enqueued before it)"
_WORK_WAIT = "Work.wait() (a collective started with async_op=True)"
_WAIT_FUNCS = frozenset({"wait", "_wait", "wait_all", "wait_stream", "_wait_for_pending_works", "_watchdog",
                         "_nccl_watchdog", "monitored_barrier", "barrier"})
#: the user's own line when it is itself a wait that has no Python frame below it (a C++ method: work.wait())
_WAIT_CALL = re.compile(r"(?:\.wait|\.synchronize|\bsynchronize|\.wait_stream|\bbarrier)\s*\(")


def _wait_name(f: Frame) -> str | None:
    """The name of a known wait for frame ``f``, None when it is not one."""
    p = f.file.replace("\\", "/")
    if "torch/cuda/" in p and f.function == "synchronize":
        return _SYNC
    if "torch/distributed/" in p and f.function in _WAIT_FUNCS:
        return f.function if f.function in COLLECTIVES else _WORK_WAIT
    return None


def _op_name(f: Frame) -> str | None:
    p = f.file.replace("\\", "/")
    if "torch/distributed/" in p and f.function in COLLECTIVES:
        return f.function
    w = _wait_name(f)
    if w:
        return w
    if p.endswith("torch/nn/parallel/distributed.py"):
        if f.function == "__init__":
            return "DistributedDataParallel(...) (it checks that every rank has the same model, then broadcasts " \
                   "rank 0's)"
        if f.function in ("forward", "_pre_forward", "_sync_buffers", "_sync_module_buffers", "_check_sync_bufs_pre_fwd",
                          "_distributed_broadcast_coalesced"):
            return "the DDP model's forward (it broadcasts buffers such as BatchNorm's from rank 0)"
    if "torch/autograd/" in p and f.function in ("backward", "_engine_run_backward"):
        return "backward() (under DDP it all-reduces the gradients)"
    return None


def place_of(rank: int, node: int | None, text: str, code: dict[str, str] | None = None) -> Place:
    """The :class:`Place` of one rank from its stack dump ``text``; ``code``: ``{"file:line": source}``."""
    frames = _main_thread(parse_stacks(text))
    pl = Place(rank=rank, node=node, inner=frames[0] if frames else None,
               importing=any(f.file.startswith("<frozen importlib") for f in frames))
    k = next((i for i, f in enumerate(frames) if _is_user(f)), len(frames))
    pl.user = frames[k] if k < len(frames) else None
    for f in frames[:k]:  # innermost first: the last match is the call the user's line made
        name = _op_name(f)
        if name:
            pl.collective = name
            # a public collective or a wait is a wait; DDP's forward/backward compute too (busy there is progress)
            pl.waits = pl.waits or _wait_name(f) is not None or (
                "torch/distributed/" in f.file.replace("\\", "/") and f.function in COLLECTIVES)
    if pl.user is not None and code:
        pl.code = code.get(f"{pl.user.file}:{pl.user.line}", "")
    if pl.collective is None and pl.code and pl.inner == pl.user and _WAIT_CALL.search(pl.code):
        # the user's line calls a C++ wait directly (work.wait(), stream.synchronize()): no library frame below it
        pl.collective, pl.waits = ("torch.cuda.synchronize" if "synchronize" in pl.code else _WORK_WAIT), True
    return pl


def _stuck_worker(workers: Any) -> Place | None:
    """The first DataLoader worker (of a rank's ``workers`` stacks) that is inside the user's code under the
    worker loop (a dataset's ``__getitem__``, a collate function), as a :class:`Place` whose ``rank`` is its pid;
    an idle worker (waiting for its next index) has no such frame."""
    for w in workers if isinstance(workers, list) else []:
        if not isinstance(w, dict) or not isinstance(w.get("text"), str) or not isinstance(w.get("pid"), int):
            continue
        frames = _main_thread(parse_stacks(w["text"]))
        loop = next((i for i, f in enumerate(frames) if f.function == "_worker_loop"), None)
        if loop is None or not any(_is_user(f) for f in frames[:loop]):
            continue
        code = w.get("code") if isinstance(w.get("code"), dict) else {}
        return place_of(w["pid"], None, w["text"], {str(k): str(v) for k, v in code.items()})
    return None


def places_from_sample(sample: dict[str, dict[str, Any]]) -> list[Place]:
    """:class:`Place` per rank of one :func:`broker.run.rankshim.dump_stacks` answer, sorted by rank."""
    out = []
    for r, e in sample.items():
        try:
            rank = int(r)
        except ValueError:
            continue
        if not isinstance(e, dict):
            continue
        node = e.get("node") if isinstance(e.get("node"), int) else None
        if e.get("ended"):
            fr = e.get("frame") if isinstance(e.get("frame"), dict) else None
            pl = Place(rank=rank, node=node, ended=True, exit_code=e.get("exit_code"),
                       exception=str(e["exception"])[:200] if e.get("exception") else None)
            if fr:
                pl.user = Frame(str(fr.get("file")), int(fr.get("line") or 0), str(fr.get("function")))
            out.append(pl)
            continue
        init = e.get("init")
        if isinstance(init, dict):  # in the rendezvous: the place comes from the rank's facts, not a signal
            at = init.get("at") if isinstance(init.get("at"), dict) else {}
            user = (Frame(str(at.get("file")), int(at.get("line") or 0), str(at.get("function")))
                    if at.get("file") else None)
            code = e.get("code") if isinstance(e.get("code"), dict) else {}
            pl = Place(rank=rank, node=node, collective="init_process_group", user=user, inner=user, waits=True,
                       code=str(code.get(f"{user.file}:{user.line}", "")) if user else "", rendezvous=init)
            pl.cpu_s = e["cpu_s"] if isinstance(e.get("cpu_s"), (int, float)) else None
            pl.wait_s = e["wait_s"] if isinstance(e.get("wait_s"), (int, float)) else None
            pl.t = e["t"] if isinstance(e.get("t"), (int, float)) else None
            out.append(pl)
            continue
        text = e.get("text")
        if isinstance(text, str) and text.strip():
            code = e.get("code") if isinstance(e.get("code"), dict) else {}
            pl = place_of(rank, node, text, {str(k): str(v) for k, v in code.items()})
            if pl.collective is None and pl.user is not None:
                frames = _main_thread(parse_stacks(text))
                k = frames.index(pl.user) if pl.user in frames else 0
                pl.loader_wait = any(f.file.replace("\\", "/").endswith("torch/utils/data/dataloader.py")
                                     for f in frames[:k])
                pl.worker = _stuck_worker(e.get("workers")) if pl.loader_wait else None
            pl.cpu_s = e["cpu_s"] if isinstance(e.get("cpu_s"), (int, float)) else None
            pl.wait_s = e["wait_s"] if isinstance(e.get("wait_s"), (int, float)) else None
            pl.t = e["t"] if isinstance(e.get("t"), (int, float)) else None
            out.append(pl)
    for pl in out:
        e = sample.get(str(pl.rank))
        if isinstance(e, dict) and isinstance(e.get("seq"), dict):
            pl.seq = e["seq"]
    return sorted(out, key=lambda p: p.rank)
