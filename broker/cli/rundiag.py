"""What ``broker status RUN`` says about why a finished run failed: the diagnosis the diagnose step wrote to
``<run>/diagnosis.txt`` (cause and fix), and for a background run (``broker run -d``) the file its output went to.

Without this the only place that named the cause was the detached run's output file, which no command mentioned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the most diagnosis lines ``broker status RUN`` prints (a long traceback stays in diagnosis.txt)
MAX_LINES = 16


def diagnosis_lines(run: Any) -> list[str]:
    """The lines of ``run``'s ``diagnosis.txt`` (raw text: the caller strips control characters and escapes
    markup), at most :data:`MAX_LINES` plus one line naming the file when cut; ``[]`` when there is none or the
    row's folder is not the run's own (nothing outside ``<home>/runs/<id>`` is read)."""
    folder = _folder(run)
    if folder is None:
        return []
    path = folder / "diagnosis.txt"
    try:
        lines = [ln.rstrip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines()
                 if ln.strip()]
    except OSError:
        return []
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES] + [f"... ({len(lines) - MAX_LINES} more lines in {path})"]
    return lines


def latest_failure_line(row: dict) -> str:
    """For the newest run of ``broker status``'s list (``row``: its ``--json`` dict) when it failed and was
    diagnosed: one line with its catalogue cause and where the fix is (``broker status RUN``); ``""`` otherwise."""
    if row.get("status") != "failed":
        return ""
    from types import SimpleNamespace

    lines = diagnosis_lines(SimpleNamespace(id=row.get("id"), run_dir=row.get("run_dir")))
    cause = next((ln for ln in lines if ln.startswith("cause [")), "") or (lines[0] if lines else "")
    if not cause:
        return ""
    return f"{row['id']} failed: {cause} (`broker status {row['id']}` has the fix)"


def detached_output(run: Any) -> Path | None:
    """``<home>/logs/run-<id>.out`` of a run started with ``broker run -d`` when that file exists, else None."""
    from broker.core.config import home_path

    p = home_path() / "logs" / f"run-{run.id}.out"
    try:
        return p if p.is_file() else None
    except OSError:
        return None


def _folder(run: Any) -> Path | None:
    if not getattr(run, "run_dir", None):
        return None
    from broker.core.provider import BadInput
    from broker.core.runfolder import confined_run_dir

    try:
        return confined_run_dir(run)
    except (BadInput, OSError):
        return None
