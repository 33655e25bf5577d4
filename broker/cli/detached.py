"""Background runs: ``broker run -d`` starts ``broker run`` as its own process and returns, the background process
marks its run folder (:data:`DETACHED_MARKER`), and ``broker down`` interrupts such a process first (the same
shielded teardown as Ctrl-C) before it tears down what is left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


#: environment variable set for a background ``broker run`` (``-d``): its run folder gets :data:`DETACHED_MARKER`
DETACHED_ENV = "BROKER_DETACHED_RUN"
#: marker in a run's folder: the run is driven by a background process (``broker down`` interrupts it first)
DETACHED_MARKER = "detached.json"
#: how long ``broker run -d`` waits for the background process to create its run, seconds
DETACH_START_TIMEOUT_S = 300.0


def _tell_detached_parent(run: Any) -> None:
    """In a background run (``-d``): mark the run folder as driven by this process (for ``broker down``)."""
    import json
    import os

    if os.environ.pop(DETACHED_ENV, None) != "1" or not run.run_dir:
        return
    try:
        (Path(run.run_dir) / DETACHED_MARKER).write_text(json.dumps({"pid": os.getpid()}))
    except OSError:
        pass


def run_detached(args: list[str], recipe: Any, *, as_json: bool = False,
                 timeout_s: float = DETACH_START_TIMEOUT_S) -> int:
    """``broker run -d``: start ``broker run ARGS -q`` as a background process (its own session, stdin closed,
    output to ``<home>/logs/run-<time>-<pid>.out``), wait until it has created its run (the ledger's row with its
    pid) or ended, print the run id and how to follow it; returns 0, or the background process's exit code when
    it ended before the run started (its output is shown then: e.g. a paid run without --yes)."""
    import os
    import subprocess
    import sys
    import time

    from broker.core.config import home_path
    from broker.money.ledger import Ledger
    from broker.core.ui import console, print_json

    logs = home_path() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out_path = logs / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.out"
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    env = dict(os.environ, **{DETACHED_ENV: "1"})
    try:
        proc = subprocess.Popen([sys.executable, "-m", "broker", "run", *args, "-q"], stdin=subprocess.DEVNULL,
                                stdout=fd, stderr=fd, env=env, start_new_session=True, close_fds=True)
    finally:
        os.close(fd)
    ledger = Ledger()
    t0 = time.monotonic()
    run_id = None
    while time.monotonic() - t0 < timeout_s:
        # the run row carries its CLI's pid (broker.run.runrecord.new_run): the background process's
        run_id = next((r.id for r in ledger.list_runs(limit=20) if r.pid == proc.pid), None)
        if run_id is not None or proc.poll() is not None:
            break
        time.sleep(0.1)
    if run_id is None:
        run_id = next((r.id for r in ledger.list_runs(limit=20) if r.pid == proc.pid), None)
    if run_id is None:
        code = proc.poll()
        text = out_path.read_text(encoding="utf-8", errors="replace")
        if code is None:
            from broker.core.provider import ProviderError

            raise ProviderError(f"the background run did not start within {timeout_s:.0f} s (pid {proc.pid} is "
                                f"still working)", hint=f"its output so far is in {out_path}; `broker status` "
                                                          "shows the run once it starts")
        sys.stderr.write(text)
        return code or 1
    if as_json:
        print_json({"run_id": run_id, "pid": proc.pid, "output": str(out_path), "detached": True})
        return 0
    console.print(f"[bold]run {run_id}[/]: {recipe.name}, running in the background (pid {proc.pid})",
                  highlight=False)
    for what, cmd in (("follow its log", f"broker logs -f {run_id}"), ("its state", f"broker status {run_id}"),
                      ("stop it", f"broker down {run_id}")):
        console.print(f"  {what + ':':<15} {cmd}", highlight=False, soft_wrap=True)
    # on stdout with the rest: `broker run -d > file` and `X=$(broker run -d ...)` get every line, in order
    console.print(f"  {'output:':<15} {quote_path(out_path)}", markup=False, highlight=False, soft_wrap=True)
    sys.stdout.flush()
    return 0


def quote_path(p: Any) -> str:
    """``p`` as a shell word a user can paste (quoted when it holds spaces or shell characters)."""
    import shlex

    return shlex.quote(str(p))


def stop_detached(run: Any, *, grace_s: float = 120.0) -> bool:
    """When ``run`` is driven by a live background process (``broker run -d``): interrupt it (SIGINT, the same
    shielded teardown as Ctrl-C) and wait up to ``grace_s`` seconds for it to end.  Returns True when one was
    interrupted.  A pid whose folder has no detached marker naming it is never signalled."""
    import json
    import os
    import signal
    import time

    from broker.money.accounting import pid_alive

    if not run.run_dir or not run.pid or not pid_alive(run.pid):
        return False
    from broker.core.provider import BadInput
    from broker.core.runfolder import confined_run_dir

    try:  # the marker is trusted only in the run's own folder (a crafted row must not pick the pid signalled)
        folder = confined_run_dir(run)
    except BadInput:
        return False
    try:
        marker = json.loads((folder / DETACHED_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("pid") != run.pid:
        return False
    try:
        os.kill(run.pid, signal.SIGINT)
    except OSError:
        return False
    t0 = time.monotonic()
    while pid_alive(run.pid) and time.monotonic() - t0 < grace_s:
        time.sleep(0.2)
    if not pid_alive(run.pid):
        _say_who_interrupted(run.id)
    return True


def _say_who_interrupted(run_id: str) -> None:
    """The background run took ``broker down``'s SIGINT for a Ctrl-C: its ledger row says who stopped it."""
    import re

    from broker.money.ledger import Ledger

    ledger = Ledger()
    ended = ledger.get_run(run_id)
    if ended is None or ended.status != "interrupted" or not ended.message:
        return
    said = re.sub(r"interrupted \((?:Ctrl-C|SIGINT)\)", "interrupted by `broker down`", ended.message)
    if said != ended.message:
        ledger.update_run(run_id, message=said)
