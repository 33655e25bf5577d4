"""``broker down`` and ``broker reconcile`` (plus the progress printer and kept-nodes message of ``broker run``).

* ``broker down RUN|--all`` terminates every live resource of a run (idempotent, confirmed); exit 4 while
  something stays live.
* ``broker reconcile`` lists what providers hold with broker's run tag that the ledger does not know (orphans);
  ``--terminate`` records them in the ledger and terminates them.
"""

from __future__ import annotations

import sys
import contextlib
import threading
import time
from typing import Any

import typer

from broker.core.prose import usd


class ProgressPrinter:
    """Renders the steps of a run: ``[ 12.3s  $0.0041  $1.80/h] step`` (elapsed since start, the run's cost so far
    per the ledger, what its live resources bill per hour), one plain line per step.  On a terminal a rich status
    line below them keeps elapsed time and cost moving during long steps (search, create, waiting for SSH,
    staging, teardown); it pauses while node logs stream.  Call it with each step; ``bind(run)`` once the run row
    exists; ``close()`` before printing the summary."""

    #: steps after which node logs stream (the live line pauses)
    STREAMING = ("launching one torchrun per node",)

    def __init__(self, ledger: Any, console: Any | None = None):
        from broker.core.ui import err

        self.ledger = ledger
        self.console = console or err
        self.t0 = time.monotonic()
        self.run_id: str | None = None
        self.step = ""
        self._status: Any = None
        self._stop = None
        self._lock = threading.Lock()

    def bind(self, run: Any) -> None:
        self.run_id = run.id

    def prefix(self) -> str:
        from broker.money.cost import live_usd_per_hour, run_spent_usd

        try:
            cost, rate = (run_spent_usd(self.ledger, self.run_id), live_usd_per_hour(self.ledger, self.run_id)) \
                if self.run_id else (0.0, 0.0)
        except Exception:  # noqa: BLE001 - a busy or full ledger must not stop the progress line
            cost, rate = 0.0, 0.0
        return f"[{time.monotonic() - self.t0:6.1f}s {usd(cost):>8} {usd(rate)}/h]"

    def __call__(self, step: str) -> None:
        from rich.markup import escape

        with self._lock:
            self.step = step
            self.console.print(f"[dim]{self.prefix()}[/] {escape(step)}", highlight=False)
        if not self.console.is_terminal:
            return
        if any(step.startswith(s) for s in self.STREAMING):
            self.close()
        else:
            self._live()

    def _text(self) -> Any:
        """The live line: one terminal line at most (a status line that wraps is redrawn below itself in tmux,
        "network checks[preflight] check nod"), cut with an ellipsis; the plain step lines above it stay whole."""
        from rich.markup import escape
        from rich.text import Text

        text = Text.from_markup(f"[dim]{self.prefix()}[/] {escape(self.step)}")
        text.no_wrap = True
        text.truncate(max(10, self.console.width - 3), overflow="ellipsis")  # the spinner and its space
        return text

    @contextlib.contextmanager
    def paused(self) -> Any:
        """Stop the live line while other output goes to the terminal (the run's header on stdout was drawn over
        the spinner, which stayed behind as a stale line), then bring it back."""
        live = self._status is not None
        self.close()
        try:
            yield
        finally:
            if live and self.console.is_terminal:
                self._live()

    def _live(self) -> None:
        if self._status is not None:
            self._status.update(self._text())
            return
        self._status = self.console.status(self._text(), spinner="dots")
        self._status.start()
        stop = self._stop = threading.Event()

        def tick() -> None:
            while not stop.wait(1.0):
                with self._lock:
                    if self._status is not None:
                        self._status.update(self._text())

        threading.Thread(target=tick, daemon=True).start()

    def close(self) -> None:
        """Stop the live status line (if any)."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
                self._stop = None
            if self._status is not None:
                self._status.stop()
                self._status = None


def kept_message(out: Any, idle_minutes: float, idle_words: str | None = None) -> list[str]:
    """What ``broker run`` prints when the nodes were kept (recipe ``idle_minutes`` or ``--idle-minutes``, as
    ``idle_words`` says: :meth:`Recipe.idle_words`; default the recipe's): how to ssh into node 0, when they go
    away, and how to stop them now."""
    run_id = out.run.id
    lines = [f"nodes kept for inspection ({idle_words or f'recipe idle_minutes={idle_minutes:g}'}): "
             + ", ".join(f"{r.provider} {r.provider_id or r.name}" for r in out.kept)]
    c = out.cluster
    if c is not None and c.nodes and not c.local_exec:
        n0 = c.nodes[0]
        import shlex

        key = f"-i {shlex.quote(str(c.ssh_key_path))} " if c.ssh_key_path else ""
        # the run's pinned host key: without it a BatchMode ssh (or a strict ~/.ssh/config) refuses the node
        known = getattr(c, "known_hosts_path", None)
        hosts = f"-o UserKnownHostsFile={shlex.quote(str(known))} " if known else ""
        if known and getattr(n0, "resource_id", None):  # pinned per machine (its resource id), not per address
            from broker.core.sshkeys import host_key_name

            hosts += f"-o HostKeyAlias={host_key_name(n0.host, n0.port, n0.resource_id)} "
        port = f"-p {n0.port} " if n0.port and n0.port != 22 else ""
        # the command alone on its line (printed unwrapped): a paste runs it as it is
        lines.append(f"  ssh into node 0: broker ssh {run_id}   or: "
                     f"ssh {key}{hosts}{port}{shlex.quote(f'{n0.user}@{n0.host}')}")
        lines.append(f"  run files on node 0: {shlex.quote(f'{c.workroot}/{run_id}')}")
    if c is not None and c.local_exec:  # this machine (fake provider): no node-side watch, only the watchdog
        lines.append(f"  the watchdog terminates them {idle_minutes:g} min after the job ended (or at the deadline / "
                     "budget)")
    else:
        lines.append(f"  they are terminated {idle_minutes:g} min after the last SSH session closes once the job "
                     "ended (node-side idle watch, where the provider supports it), and by the watchdog "
                     f"{idle_minutes:g} min after the job ended at the latest (or at the deadline / budget)")
    lines.append(f"  stop them now: broker down {run_id}")
    return lines


def commands_in(line: str) -> list[str]:
    """The commands a line of :func:`kept_message` holds (after its ``: `` and ``or: ``), to print each whole
    (``console.print(..., keep=...)``): a command is never split across lines."""
    if ": " not in line:
        return []
    rest = line.split(": ", 1)[1]
    return [c.strip() for c in rest.split("   or: ") if c.strip().startswith(("ssh ", "broker "))]


def _settle_run(ledger: Any, run_id: str, left: list) -> None:
    """After ``broker down``: a run still marked active whose CLI process is dead (e.g. SIGKILLed while
    provisioning) ends as ``interrupted``, so ``broker status`` stops showing it as provisioning with time left."""
    from broker.money.accounting import ACTIVE_STATUSES, cli_alive
    from broker.core.model import utcnow

    run = ledger.get_run(run_id)
    if run is None or run.id != run_id or run.status not in ACTIVE_STATUSES or cli_alive(run.pid, run.pid_start):
        return
    why = f"the CLI (pid {run.pid}) is gone" if run.pid else "no CLI drives it"
    msg = (f"{why}; `broker down` terminated its resources" if not left else
           f"{why}; `broker down` left {len(left)} resource(s) live: run it again")
    ledger.update_run(run_id, status="interrupted", ended_at=utcnow(), message=msg)
    ledger.event(run_id, "down", "end", f"interrupted: {msg}")


def _res_dict(r: Any) -> dict:
    return {"resource_id": r.id, "run_id": r.run_id, "provider": r.provider, "kind": r.kind, "id": r.provider_id,
            "name": r.name, "state": r.state, "error": r.error}


def down_cmd(
    run_id: str = typer.Argument(None, metavar="[RUN]", help="the run to tear down (a unique prefix is enough)"),
    all_runs: bool = typer.Option(False, "--all", "-a", help="every run with live resources"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask before terminating (--all)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Terminate every live resource of RUN (or --all): idempotent, confirmed gone; exit 4 if any stays."""
    from rich.markup import escape

    from broker.money.ledger import Ledger
    from broker.core.provider import BadInput
    from broker.money.teardown import teardown_run
    from broker.core.ui import console, err, print_json

    from broker.money.journal import failsafe

    ledger = failsafe(Ledger())  # a ledger it cannot write never stops the deletes (broker.money.journal)
    if all_runs == bool(run_id):
        raise BadInput("give either a RUN id or --all", hint="`broker status` lists runs and live resources")
    if all_runs:
        run_ids = list(dict.fromkeys(r.run_id for r in ledger.resources(live_only=True)))
        if run_ids and not yes and not as_json and sys.stdin.isatty():
            if not typer.confirm(f"terminate every live resource of {len(run_ids)} run(s)?", default=True):
                raise typer.Exit(1)
    else:
        if ledger.get_run(run_id) is None and ledger.resources(run_id):
            run_ids = [run_id]  # resources of a run the runs table lacks (e.g. orphans)
        else:
            run_ids = [ledger.find_run(run_id).id]
    say = None if as_json else (lambda m: console.print(f"  {escape(m)}"))
    report: list[dict] = []
    still: list[Any] = []
    for rid in run_ids:
        from broker.cli.detached import stop_detached

        run_row = ledger.get_run(rid)
        if run_row is not None and stop_detached(run_row) and not as_json:  # `broker run -d`: its own teardown
            console.print(f"[bold]{rid}[/]: the background run was interrupted (it tears down its nodes)")
        before = ledger.resources(rid, live_only=True)
        if not as_json:
            console.print(f"[bold]{rid}[/]: {len(before)} live resource(s)")
        left = teardown_run(ledger, rid, "down", say=say)
        _settle_run(ledger, rid, left)
        if not left:  # the machines are gone: their addresses may be someone else's from now on
            from broker.core.sshconfig import forget_run_hosts

            forget_run_hosts(rid)
        for r in before:
            now = ledger.resource(r.id) or r
            report.append(_res_dict(now))
            if not as_json:
                ok = now.state == "terminated"
                console.print(f"  {'[green]terminated[/]' if ok else '[red]STILL LIVE[/]'} {now.provider} "
                              f"{now.kind} {now.provider_id or now.name}"
                              + ("" if ok else f": {escape(now.error or 'not confirmed gone')}"))
        still.extend(left)
    if as_json:
        print_json({"runs": run_ids, "resources": report, "still_live": [_res_dict(r) for r in still]})
    elif not run_ids:
        console.print("nothing live in the ledger.")
    refused = [r for r in still if (r.error or "").startswith("refused:")]
    if refused and not as_json:  # a ledger row is data: what the provider does not show as ours is not killed
        err.print(f"[bold red]{len(refused)} ledger row(s) refused[/]: the provider does not show "
                  f"{', '.join(escape(r.provider_id or r.name) for r in refused)} as this installation's (or the "
                  "id is not the provider's form); nothing was terminated for them. Check the provider's console "
                  "and whether the ledger file was edited", highlight=False)
    if still:
        if not as_json and len(still) > len(refused):
            err.print(f"[bold red]{len(still) - len(refused)} resource(s) still live[/]: run `broker down "
                      f"{' '.join(dict.fromkeys(r.run_id for r in still if r not in refused))}` again; if it "
                      "keeps failing, delete them in the provider's console "
                      f"({', '.join(r.provider_id or r.name for r in still if r not in refused)})")
        raise typer.Exit(4)


def reconcile_cmd(
    provider: str = typer.Option(None, "--provider", "-p", help="only this provider"),
    terminate: bool = typer.Option(False, "--terminate", help="terminate the orphans found"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask before terminating"),
    include_foreign: bool = typer.Option(False, "--include-foreign", help="also treat resources of other "
                                         "installations (another BROKER_HOME, or an older broker without "
                                         "installation tag) as orphans, but only those older than 169 h (the "
                                         "longest deadline, 168 h, plus 1 h)"),
    min_age: float = typer.Option(600.0, "--min-age", help="seconds a resource of this installation must "
                                  "exist before it counts as an orphan (a create in flight is never one)",
                                  min=0),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """List resources providers hold with broker's run tag that the ledger does not know (orphans of this
    installation), other installations' resources (left alone) and possibly billing 'unknown' creates;
    --terminate records the orphans in the ledger and terminates them in dependency order."""
    from rich.markup import escape

    from broker.money.ledger import Ledger
    from broker.core.provider import BadInput
    from broker.money.reconcile import FOREIGN_MIN_AGE_S, reconcile, reconcile_providers
    from broker.core.ui import console, err, print_json

    ledger = Ledger()
    provs, skipped = reconcile_providers(ledger, provider)
    opts = dict(include_foreign=include_foreign, min_age_s=min_age)
    rep = reconcile(ledger, provs, terminate=False, **opts)
    todo = len(rep.orphans) + len(rep.unknown)
    if todo and not terminate and not yes and not as_json and sys.stdin.isatty():
        for t in rep.orphans:
            console.print(f"orphan: {t.provider} {t.kind} {t.provider_id} (run {t.run_id}, {t.state})")
        terminate = typer.confirm(f"terminate these {len(rep.orphans)} orphan(s)?", default=False)
    elif todo and terminate and not yes:
        if not sys.stdin.isatty():
            raise BadInput(f"{len(rep.orphans)} orphan(s) found; refusing to terminate without confirmation",
                           hint="add --yes to terminate them non-interactively")
        terminate = typer.confirm(f"terminate these {len(rep.orphans)} orphan(s)?", default=False)
    if terminate and todo:
        say = None if as_json else (lambda m: console.print(f"  {escape(m)}"))
        done = reconcile(ledger, provs, terminate=True, say=say, **opts)
        rep.terminated, rep.failed, rep.unknown = done.terminated, done.failed, done.unknown
        rep.adopted += [t for t in done.adopted if t not in rep.adopted]
    if as_json:
        print_json({"checked": rep.checked, "skipped": skipped, "errors": rep.errors, "known": rep.known,
                    "installation_id": ledger.installation_id, "adopted": rep.adopted, "orphans": rep.orphans,
                    "foreign": rep.foreign, "young": rep.young,
                    "unknown": [_res_dict(r) for r in rep.unknown], "terminated": rep.terminated,
                    "still_live": [_res_dict(r) for r in rep.failed]})
    else:
        console.print(f"checked: {', '.join(rep.checked) or 'no provider'}; {rep.known} tagged resource(s) "
                      f"known to the ledger (installation {ledger.installation_id})")
        for n, why in {**skipped, **rep.errors}.items():
            console.print(f"  [yellow]{n}[/]: {escape(why)}")
        for n in rep.errors:
            console.print(f"  [bold red]{n} could not be listed: its orphans and unknown creates are NOT "
                          "known[/] (retry later)")
        for t in rep.adopted:
            console.print(f"  {t.provider} {t.kind} {t.provider_id} belongs to an intent row of run {t.run_id} "
                          f"(created just before a crash); `broker down {t.run_id}` terminates it")
        for r in rep.unknown:
            console.print(f"  [bold red]possibly billing[/]: {r.provider} {r.kind} {r.name} of run {r.run_id}: "
                          f"an ambiguous create not resolved yet ({escape(r.error or 'unknown')}); "
                          f"worst case {usd(r.usd_per_hour, up_to=4)}/h until its deadline")
        for t in rep.foreign:
            console.print(f"  other installation: {t.provider} {t.kind} {t.provider_id} run {t.run_id} "
                          f"(installation {t.installation_id or 'none'}): left alone")
        if rep.foreign and not include_foreign:
            h = FOREIGN_MIN_AGE_S / 3600
            console.print(f"  (--include-foreign treats those older than {h:g} h as orphans)")
        for t in rep.young:
            console.print(f"  {t.provider} {t.kind} {t.provider_id} run {t.run_id} is younger than "
                          f"{min_age:g} s: left alone (a create may be in flight)")
        if not rep.orphans and not rep.errors:
            console.print("no orphans.")
        elif not rep.orphans:  # exit 4 below: never a plain "no orphans" over a provider it could not ask
            listed = [n for n in rep.checked if n not in rep.errors]
            console.print(f"no orphans found{' at ' + ', '.join(listed) if listed else ''}; "
                          f"[bold red]unknown at {', '.join(rep.errors)}[/] (not listed)")
        for t in rep.orphans:
            console.print(f"  orphan {t.provider} {t.kind} {t.provider_id} run {t.run_id} state {t.state} "
                          f"{usd(t.usd_per_hour or 0, up_to=4)}/h")
        if rep.terminated:
            console.print(f"[green]terminated {len(rep.terminated)} resource(s)[/]")
        if (rep.orphans or rep.unknown) and not terminate:
            console.print("run `broker reconcile --terminate --yes` to terminate them")
    if rep.failed:
        err.print(f"[bold red]{len(rep.failed)} orphan(s) still live[/]: " + ", ".join(
            f"{r.provider} {r.provider_id}: {r.error}" for r in rep.failed) + "; they stay listed in `broker "
            "status`; retry `broker reconcile --terminate --yes` or `broker down <run>`")
        raise typer.Exit(4)
    if rep.errors:
        if not as_json:
            err.print(f"[bold red]error:[/] {', '.join(rep.errors)} could not be listed: orphans there are not "
                      "known (exit 4)", highlight=False)
        raise typer.Exit(4)
