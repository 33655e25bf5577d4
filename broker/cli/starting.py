"""Background runs that have not written their ledger row yet (``broker run -d``).

The parent of a detached run chooses the run id, starts the background process with it
(:data:`broker.core.runfolder.RUN_ID_ENV`) and returns at once; it never opens the ledger, so it returns even while
another process holds the ledger's write lock.  What it leaves is one small file, ``<home>/starting/<run id>.json``
(pid, recipe name, output file, time), which the background process removes once its run row exists.  Until then
``broker status`` and ``broker logs`` read it: a live pid is a run *starting*; a dead one without a row is a run
that *did not start*, shown with the last lines of its output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: how many lines of a failed start's output ``status`` / ``logs`` show
TAIL_LINES = 6


def starting_dir() -> Path:
    from broker.core.config import home_path

    return home_path() / "starting"


def record(run_id: str, pid: int, output: Path, name: str) -> None:
    """Write ``<home>/starting/<run_id>.json`` (0600) for a background run just started."""
    from broker.core.model import utcnow
    from broker.core.private import private_dir, write_private

    private_dir(starting_dir())
    write_private(starting_dir() / f"{run_id}.json", json.dumps(
        {"run_id": run_id, "pid": pid, "start": _start_of(pid), "output": str(output), "name": name,
         "created_at": utcnow().isoformat()}))


def _start_of(pid: int) -> int | None:
    """The start time of process ``pid`` (:mod:`broker.core.procid`): with the pid, its identity."""
    from broker.core.procid import record as identity

    me = identity(pid, comm=False)
    return me.start if me else None


def _alive(d: dict[str, Any]) -> bool:
    from broker.money.accounting import cli_alive

    start = d.get("start")
    return cli_alive(int(d.get("pid") or 0), start if isinstance(start, int) else None)


def clear(run_id: str) -> None:
    """The background run wrote its row: its starting file goes."""
    try:
        (starting_dir() / f"{run_id}.json").unlink()
    except OSError:
        pass


def entries() -> list[dict[str, Any]]:
    """Every starting file, newest first, each with ``alive`` (its pid runs) and, when dead, ``tail`` (the last
    lines of its output)."""
    try:
        files = list(starting_dir().glob("*.json"))
    except OSError:
        return []
    if not files:
        return []

    out = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict) or not isinstance(d.get("run_id"), str):
            continue
        d["alive"] = _alive(d)
        if not d["alive"]:
            d["tail"] = _tail(d.get("output"))
        out.append(d)
    return sorted(out, key=lambda d: str(d.get("created_at")), reverse=True)


def _tail(path: Any) -> list[str]:
    try:
        text = Path(str(path)).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()][-TAIL_LINES:]


def pending(ledger: Any) -> list[dict[str, Any]]:
    """Starting files whose run has no ledger row (those with a row are removed: a stale file of a run whose
    process wrote its row but died before clearing it)."""
    out = []
    for d in entries():
        if ledger.get_run(d["run_id"]) is not None:
            clear(d["run_id"])
            continue
        out.append(d)
    return out


def describe(d: dict[str, Any]) -> str:
    """One line: ``run ID (name): starting in the background (pid N)`` or ``... did not start: LAST LINE``."""
    head = f"run {d['run_id']} ({d.get('name') or '?'})"
    if d["alive"]:
        return f"{head}: starting in the background (pid {d['pid']}); `broker logs -f {d['run_id']}` follows it"
    last = (d.get("tail") or ["no output"])[-1]
    return f"{head}: did not start: {last} (its output: {d.get('output')})"


def find(ledger: Any, run_id: str | None) -> dict[str, Any] | None:
    """The pending start ``run_id`` names (id or unique prefix; ``latest`` / None: the newest, when it is newer
    than the ledger's newest run), or None."""
    rows = pending(ledger)
    if run_id in (None, "", "latest"):
        if not rows:
            return None
        newest = ledger.list_runs(limit=1)
        if newest and newest[0].created_at.isoformat() > str(rows[0].get("created_at")):
            return None
        return rows[0]
    hits = [d for d in rows if d["run_id"].startswith(run_id)]
    return hits[0] if len(hits) == 1 else None


def wait_for_row(ledger: Any, d: dict[str, Any], *, timeout_s: float = 300.0, poll_s: float = 0.2) -> Any:
    """Wait until the background run of ``d`` wrote its row (returns the Run) or died (raises the error of
    :func:`not_started`, exit 1, naming why: the last lines of its output).  Raises ProviderError after ``timeout_s`` seconds."""
    import time

    from broker.core.provider import ProviderError

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        run = ledger.get_run(d["run_id"])
        if run is not None:
            return run
        if not _alive(d):
            run = ledger.get_run(d["run_id"])
            if run is not None:
                return run
            raise not_started(d)
        time.sleep(poll_s)
    raise ProviderError(f"the background run {d['run_id']} has not started within {timeout_s:.0f} s (pid "
                        f"{d['pid']} is still working)", hint=f"its output so far: {d.get('output')}")


def not_started(d: dict[str, Any]) -> Exception:
    """The error for a background run that ended before it wrote its row: its output's last lines, exit 1."""
    from broker.core.errors import BrokerError

    tail = d.get("tail") or _tail(d.get("output"))
    err = BrokerError(f"the background run {d['run_id']} ({d.get('name') or '?'}) ended before it started:\n  "
                      + "\n  ".join(tail or ["(no output)"]),
                      hint=f"its whole output: {d.get('output')}; fix what it says and `broker run -d` again")
    err.exit_code = 1
    return err
