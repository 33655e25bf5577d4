"""Background runs: ``broker run -d`` starts ``broker run`` as its own process and returns, the background process
marks its run folder (:data:`DETACHED_MARKER`), and ``broker down`` interrupts such a process first (the same
shielded teardown as Ctrl-C) before it tears down what is left.  The id is chosen here, before the background
process starts, so ``broker run -d`` returns at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


#: environment variable set for a background ``broker run`` (``-d``): its run folder gets :data:`DETACHED_MARKER`
DETACHED_ENV = "BROKER_DETACHED_RUN"
#: marker in a run's folder: the run is driven by a background process (``broker down`` interrupts it first)
DETACHED_MARKER = "detached.json"


def _tell_detached_parent(run: Any) -> None:
    """In a background run (``-d``): mark the run folder as driven by this process (for ``broker down``)."""
    import json
    import os

    if os.environ.pop(DETACHED_ENV, None) != "1" or not run.run_dir:
        return
    from broker.cli import starting

    starting.clear(run.id)  # the row exists now: status and logs read the ledger
    import signal

    try:  # `broker down` stops this process with SIGINT, which a background job of a script inherits as ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: the disposition stays as it is
        pass
    try:
        from broker.core.private import write_private

        write_private(Path(run.run_dir) / DETACHED_MARKER, json.dumps({"pid": os.getpid()}))
    except OSError:
        pass


def run_detached(args: list[str], recipe: Any, *, as_json: bool = False, provider: str | None = None,
                 yes: bool = False) -> int:
    """``broker run -d``: choose the run id here, start ``broker run ARGS -q`` with it as a background process (its
    own session, stdin closed, output to ``<home>/logs/run-<run id>.out``) and print the id and how to follow it
    at once; returns 0.  This process never opens the ledger (it returns even while another process holds its
    write lock): ``<home>/starting/<run id>.json`` (:mod:`broker.cli.starting`) tells ``broker status`` / ``logs``
    about the run until its row exists, and why it did not start if its process ends first.  Raises BadInput
    when ``provider`` rents paid machines and ``yes`` is not given (the background process could not ask)."""
    import os
    import subprocess
    import sys

    from broker.cli import starting
    from broker.core.config import home_path
    from broker.core.private import private_dir
    from broker.core.runfolder import RUN_ID_ENV, make_run_id
    from broker.core.ui import console, print_json

    if provider and not yes:
        from broker.providers import capability

        if capability(provider, "rents"):
            from broker.core.provider import BadInput

            raise BadInput(f"--provider {provider} rents paid machines and a background run has no terminal to "
                           "confirm the cost: nothing was created", hint="pass --yes (`broker plan` shows the cost)")
    run_id = make_run_id()
    logs = private_dir(home_path() / "logs")
    out_path = logs / f"run-{run_id}.out"
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    env = dict(os.environ, **{DETACHED_ENV: "1", RUN_ID_ENV: run_id})
    try:
        # -q before a `--` (what follows it is the script's own arguments: `broker run SCRIPT.py -- ARGS`)
        cut = args.index("--") if "--" in args else len(args)
        proc = subprocess.Popen([sys.executable, "-m", "broker", "run", *args[:cut], "-q", *args[cut:]],
                                stdin=subprocess.DEVNULL,
                                stdout=fd, stderr=fd, env=env, start_new_session=True, close_fds=True)
    finally:
        os.close(fd)
    starting.record(run_id, proc.pid, out_path, recipe.name)
    if as_json:
        print_json({"run_id": run_id, "pid": proc.pid, "output": str(out_path), "detached": True})
        return 0
    console.print(f"[bold]run {run_id}[/]: {recipe.name}, starting in the background (pid {proc.pid})",
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
