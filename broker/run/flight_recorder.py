"""PyTorch's flight recorder dumps (``fr_trace_rank<R>`` in a rank's facts folder, written by NCCL's watchdog on a
collective timeout): read with a data-only unpickler (a node's pickle is input, never code) and turned into lines
that name the ranks behind."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any


class _DataOnly(pickle.Unpickler):
    """A node's pickle is input, never code: only plain data (dicts, lists, text, numbers) may be loaded."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"flight-recorder dump refers to {module}.{name}: not plain data")


#: the largest flight-recorder dump read (bytes); a larger one is refused with a line, never loaded
FLIGHT_RECORDER_MAX_BYTES = 64 << 20


def read_flight_recorder(path: Path, max_bytes: int = FLIGHT_RECORDER_MAX_BYTES,
                         notes: list[str] | None = None) -> dict[str, Any] | None:
    """One flight-recorder dump (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` + rank; pickle of ``{"version",
    "pg_config", "entries": [...]}``, or its JSON form): the dict, or None when unreadable.  At most
    ``max_bytes`` + 1 bytes are ever read (a node's file may be any size, or not a regular file at all): a larger
    file is refused and ``notes`` (when given) gets a line naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, size = [], 0
        while size <= max_bytes and (chunk := os.read(fd, min(1 << 20, max_bytes + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    if size > max_bytes:
        if notes is not None:
            notes.append(f"flight recorder: {str(path)!r} is larger than {max_bytes >> 20} MiB: not read "
                         f"(the dumps of a hang are far smaller; this one is not a dump broker reads)")
        return None
    data = b"".join(chunks)
    try:
        d = json.loads(data) if data[:1] == b"{" else _DataOnly(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - a torn or foreign file is no dump
        return None
    return d if isinstance(d, dict) and isinstance(d.get("entries"), list) else None


def flight_recorder_lines(dumps: dict[int, dict[str, Any]]) -> list[str]:
    """What the dumps of several ranks say: per rank its last collective (sequence number, name, sizes, state);
    the ranks behind the furthest one are named: ``rank 1 is behind: its last collective is #3 all_reduce
    (completed), rank 0 is at #4 all_reduce (started)``."""
    last: dict[int, dict[str, Any]] = {}
    for r, d in dumps.items():
        ents = [e for e in d.get("entries", []) if isinstance(e, dict) and not e.get("is_p2p")
                and isinstance(e.get("collective_seq_id"), int)]
        if ents:
            last[r] = max(ents, key=lambda e: e["collective_seq_id"])
    if not last:
        return []

    def desc(e: dict[str, Any]) -> str:
        name = str(e.get("profiling_name", "?")).split(":")[-1]
        return f"#{e['collective_seq_id']} {name} {e.get('input_sizes')} ({e.get('state')})"

    out = [f"flight recorder: rank {r}'s last collective is {desc(e)}" for r, e in sorted(last.items())]
    top = max(e["collective_seq_id"] for e in last.values())
    ahead = [r for r, e in last.items() if e["collective_seq_id"] == top]
    behind = sorted(r for r, e in last.items() if e["collective_seq_id"] < top)
    if behind:
        out.append(f"flight recorder: rank(s) {', '.join(map(str, behind))} never enqueued collective #{top} "
                   f"({str(last[ahead[0]].get('profiling_name', '?')).split(':')[-1]}) that rank(s) "
                   f"{', '.join(map(str, sorted(ahead)))} wait in")
    sizes = {r: e.get("input_sizes") for r, e in last.items() if e["collective_seq_id"] == top}
    if len({json.dumps(v) for v in sizes.values()}) > 1:
        out.append("flight recorder: the ranks gave collective #%d different tensor sizes: %s"
                   % (top, ", ".join(f"rank {r}: {v}" for r, v in sorted(sizes.items()))))
    return out


def flight_recorder_from_run(run_dir: Path) -> list[str]:
    """:func:`flight_recorder_lines` of the dumps under ``<run>/node*/facts/fr_trace_rank*``."""
    dumps: dict[int, dict[str, Any]] = {}
    notes: list[str] = []
    for p in sorted(Path(run_dir).glob("node*/facts/fr_trace_rank*")):
        m = re.search(r"(\d+)$", p.name)
        d = read_flight_recorder(p, notes=notes) if m else None
        if d is not None:
            dumps[int(m.group(1))] = d
    return notes + flight_recorder_lines(dumps)
