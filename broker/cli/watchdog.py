"""``broker watchdog``: enforce deadlines and budgets from the ledger (long-running, or one pass with ``--once``)."""

from __future__ import annotations

import typer


def watchdog_cmd(
    once: bool = typer.Option(False, "--once", help="one pass, then exit (for cron / systemd timers)"),
    interval: float = typer.Option(None, "--interval", help="seconds between passes (default "
                                   "BROKER_WATCHDOG_INTERVAL_S, 5)", min=0.05),
    orphan_grace: float = typer.Option(600.0, "--orphan-grace", help="seconds a tagged resource unknown to "
                                       "the ledger is kept before it is terminated", min=0),
    ended_grace: float = typer.Option(120.0, "--ended-grace", help="seconds after a run ended (or its CLI "
                                      "died) before its still-live resources are terminated", min=0),
    exit_when_idle: float = typer.Option(None, "--exit-when-idle", help="exit after this many seconds with "
                                         "no live resource and no active run (default: run until stopped)"),
    as_json: bool = typer.Option(False, "--json", help="print actions as JSON (one object per line; with "
                                 "--once one object whose \"actions\" lists them)"),
    scope: str = typer.Option(None, "--scope", hidden=True, help="act only for the runs made with this "
                              "process's provider environment (its fingerprint); started by a CLI whose "
                              "credentials the running watchdog does not have"),
) -> None:
    """Terminate what is past its deadline or budget, left over by a dead CLI, or orphaned.

    One instance at a time: a second one prints which pid holds the lock and exits with code 0.
    """
    import sys

    from broker.core.config import settings
    from broker.money.ledger import Ledger
    from broker.core.ui import console, err, print_json
    from broker.money.watchdog import Watchdog, WatchdogBusy, WatchdogLock

    interval_s = interval if interval is not None else settings().broker_watchdog_interval_s
    if scope is not None:
        from broker.core import provider_env
        from broker.core.provider import BadInput

        mine = provider_env.fingerprint(provider_env.capture())
        if scope != mine:
            raise BadInput(f"--scope {scope} is not this environment's provider settings ({mine})",
                           hint="a scoped watchdog is started by `broker run` with the run's own environment")
    lock = WatchdogLock(scope=scope)
    try:
        lock.acquire()
    except WatchdogBusy as e:
        if as_json:  # a script reads stdout: an empty one said nothing about why nothing was done
            print_json({"actions": [] if once else None, "busy": True, "holder_pid": e.pid,
                        "lock": str(e.path), "message": str(e)}, indent=None if not once else 2)
        else:
            err.print(f"broker watchdog: {e}", markup=False, highlight=False)
        raise typer.Exit(0) from None

    def say(line: str) -> None:
        if not as_json:
            from datetime import datetime, timezone

            console.out(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S}Z {line}", highlight=False)
            sys.stdout.flush()

    def emit(actions) -> None:
        if as_json:
            for a in actions:
                print_json(a.to_dict(), indent=None)

    try:
        wd = Watchdog(Ledger(), interval_s=interval_s, orphan_grace_s=orphan_grace, ended_grace_s=ended_grace,
                      say=say, scope=scope)
        if once:
            actions = wd.run_once()
            if as_json:
                print_json({"actions": [a.to_dict() for a in actions]})
            elif not actions:
                console.print("watchdog: nothing to do (every live resource is within its deadline and budget)")
            return
        say(f"watchdog started (pid {__import__('os').getpid()}, every {interval_s:g} s, lock {lock.path})")
        wd.run_forever(exit_when_idle_s=exit_when_idle, on_actions=emit)
        say("watchdog stopped")
    finally:
        lock.release()
