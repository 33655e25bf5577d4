"""The ``broker`` command line (Typer).  Thin: parse, call the core, render with rich.

Each feature lives in ``broker/commands/<feature>.py`` with a ``register(app)`` function; command bodies import
what they need lazily so ``broker --help`` starts fast.  Exit codes (DESIGN.md): 0 success, 1 job failed, 2 bad
input, 3 no valid plan, 4 provider error, 130 interrupted.
"""

from __future__ import annotations

import importlib
import sys

import typer

from broker.provider import BrokerError

app = typer.Typer(name="broker", help="Cost-aware cloud GPU broker: plan, run and tear down multi-node DDP jobs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})

#: modules that add commands (each has ``register(app)``)
COMMAND_MODULES = [
    "broker.commands.plan",  # plan, offers, check, catalog
    "broker.commands.run",
    "broker.commands.status",
    "broker.commands.lifecycle",  # down, reconcile
    "broker.commands.watchdog",
    "broker.commands.quota",
    "broker.commands.lint",
    "broker.commands.cluster",  # netns up|down|status
    "broker.commands.slurm",
    "broker.commands.day2",  # logs, ssh, exec, cost, clean
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    """Console-script entry point: runs the app and turns BrokerError into a message and an exit code."""
    try:
        app()
    except BrokerError as e:
        from rich.markup import escape

        from broker.ui import err

        err.print(f"[bold red]error:[/] {escape(e.message)}", markup=True, highlight=False)
        if e.hint:
            err.print(f"  [yellow]->[/] {escape(e.hint)}", markup=True, highlight=False)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
