"""The ``broker`` command line (Typer).  Thin: parse, call the core, render with rich.

Each command group lives in ``broker/cli/<group>.py`` as module-level command functions, added from one table
(:data:`COMMAND_TABLE`); command bodies import what they need lazily so ``broker --help`` starts fast.

One error boundary (:func:`main`): every failure ends in one message (what failed, what to do) and one exit code
(:mod:`broker.core.errors`): 0 success, 1 the job failed, 2 bad input, 3 no valid plan, 4 provider error, 130
interrupted, 141 stdout closed early (``broker offers | head -1``: no message, as ``git log | head -1``).  An unexpected error (a bug) says so, writes its traceback to a log file (``<BROKER_HOME>/logs``, or
the temp folder when that cannot be written) and prints the file's path; exit code 1.  With ``--json`` anywhere on
the command line, an error is also printed on stdout as one JSON object ``{"schema_version": 1, "error": {...}}``
(the one-line message stays on stderr).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from broker import __version__
from broker.cli.report import _closed_std_streams, _quiet_broken_pipe, _report  # noqa: F401 - the boundary's
from broker.core.errors import Terminated  # SIGTERM / SIGHUP as an interrupt
from broker.core.errors import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_JOB_FAILED, BrokerError,
                           OutputClosed)

if TYPE_CHECKING:
    import typer

# typer (~45 ms of imports) is imported where it is used: `broker plan`'s parser-free start (broker.cli.fastplan)
# never needs it

def _new_app() -> typer.Typer:
    import typer

    return typer.Typer(name="broker", help="Cost-aware cloud GPU broker: plan, run and tear down multi-node DDP jobs.",
                       no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                       rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]})


def _version(value: bool) -> None:
    if value:
        import typer

        typer.echo(f"broker {__version__}")
        raise typer.Exit()


class _Scrubbed:
    """A logging filter that passes every record with its message scrubbed of secrets (:func:`scrub`)."""

    def filter(self, record: Any) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: logging reports it itself
            return True
        clean = scrub(text)
        if clean != text or record.args:
            record.msg, record.args = clean, ()
        return True


_log_handler: Any = None


def setup_logging(verbosity: int) -> None:
    """``-v``: broker's own logging (``broker.*`` loggers) at INFO to stderr; ``-vv``: DEBUG.  Other libraries
    (httpx, botocore, oci, asyncssh) are left alone (only their warnings show): their debug output carries request
    headers.  Every record is scrubbed of secret values (:func:`scrub`) on its way out.  The handler is broker's
    own, on the ``broker`` logger, and :func:`reset_logging` removes it when the command ends (an in-process
    ``main()`` leaves no logging state behind)."""
    import logging

    global _log_handler
    reset_logging()
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    h.addFilter(_Scrubbed())
    logger = logging.getLogger("broker")
    logger.addHandler(h)
    logger.setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)
    logger.propagate = False
    _log_handler = h


def reset_logging() -> None:
    """Undo :func:`setup_logging` (idempotent)."""
    global _log_handler
    if _log_handler is None:
        return
    import logging

    logger = logging.getLogger("broker")
    logger.removeHandler(_log_handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    _log_handler = None
    if "broker.core.ui" in sys.modules:  # -v also showed node output's control characters as text
        sys.modules["broker.core.ui"].show_controls(False)


def root_verbose(verbose: int) -> None:
    """What the root option ``-v`` (``verbose``: how many) does before any command: :func:`setup_logging`, and node
    output's control characters shown as text."""
    if verbose:
        setup_logging(verbose)
        from broker.core.ui import show_controls

        show_controls(True)  # node output shows its control characters as text (ESC as \x1b), never raw


def _root_callback() -> Any:
    """The root options (``--version``, ``-v``) as a Typer callback."""
    import typer

    def _root(
        version: bool = typer.Option(None, "--version", callback=_version, is_eager=True,
                                     help="print broker's version and exit"),
        verbose: int = typer.Option(0, "--verbose", "-v", count=True, show_default=False,
                                    help="log what broker does to stderr (-v info, -vv debug)"),
    ) -> None:
        root_verbose(verbose)

    return _root


#: Every command of ``broker``, in the order ``broker --help`` lists them: (name, "module:attribute", the
#: keywords Typer's ``app.command`` / ``app.add_typer`` takes).  The attribute is a module-level command function,
#: or a Typer app (``*_app``) for a group whose subcommands are module-level functions of the same module
#: (registered there, with their help).  Only the invoked command's module is imported (``broker plan`` builds no other command:
#: Typer inspects every registered command's signature on each start); tests/cli/test_commands_table.py reaches
#: every command by this name.
COMMAND_TABLE: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("plan", "broker.cli.planning:plan_cmd",
     dict(short_help="The cheapest valid way to run a job, and why not the others")),
    ("offers", "broker.cli.planning:offers_cmd",
     dict(short_help="Raw offers, cheapest first (like `vastai search offers`)")),
    ("check", "broker.cli.planning:check_cmd", dict(short_help="Whether each provider's credentials are present")),
    ("catalog", "broker.cli.catalog:catalog_app",
     dict(short_help="Price snapshots: show them, refresh from live APIs")),
    ("run", "broker.cli.run:run_cmd", dict(short_help="Run a recipe: one torchrun per node, torn down at the end")),
    ("status", "broker.cli.status:status_cmd",
     dict(short_help="Recent runs (spent, worst case, time left), live resources")),
    ("down", "broker.cli.lifecycle:down_cmd", dict(short_help="Terminate every live resource of a run (idempotent)")),
    ("reconcile", "broker.cli.lifecycle:reconcile_cmd",
     dict(short_help="Resources with broker's tag that the ledger does not know")),
    ("stop", "broker.cli.stopstart:stop_cmd",
     dict(short_help="Stop a run's machines keeping their disks (the disks still bill)")),
    ("start", "broker.cli.stopstart:start_cmd",
     dict(short_help="Start a stopped run's machines again (new addresses, SSH checked)")),
    ("watchdog", "broker.cli.watchdog:watchdog_cmd",
     dict(short_help="Terminate what is past its deadline or budget, or orphaned")),
    ("quota", "broker.cli.quota:quota_app", {}),  # its help names the quota providers (the registry's list)
    ("lint", "broker.cli.lint:lint_cmd",
     dict(short_help="Check training scripts and sbatch files for multi-node bugs")),
    ("netns", "broker.cli.cluster:netns_app", dict(short_help="A local cluster in network namespaces (Linux, root)")),
    ("slurm", "broker.cli.slurm:slurm_app", dict(short_help="Slurm clusters: up, submit your sbatch file, status, down, render")),
    ("logs", "broker.cli.day2:logs_cmd", dict(short_help="Print a run's node log; -f follows a live run")),
    ("ssh", "broker.cli.day2:ssh_cmd", dict(short_help="A shell (or one command) on a node of a live or kept run",
                                            context_settings={"allow_extra_args": True,
                                                              "ignore_unknown_options": True})),
    ("exec", "broker.cli.day2:exec_cmd", dict(short_help="Run a recipe on the kept nodes of a run (no provisioning)",
                                              context_settings={"allow_extra_args": True,
                                                                "ignore_unknown_options": True})),
    ("cost", "broker.cli.day2:cost_cmd", dict(short_help="What runs cost, per run and per provider (USD)")),
    ("clean", "broker.cli.day2:clean_cmd",
     dict(short_help="Remove the folders of ended runs (logs, work copies); lists and asks first")),
    ("init", "broker.cli.init:init_cmd", dict(short_help="Write the example recipes into a folder")),
)

#: command name -> the module that defines it
COMMANDS = {name: target.partition(":")[0] for name, target, _ in COMMAND_TABLE}

#: the command modules, in the table's order
COMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))


def add_command(a: typer.Typer, name: str, target: str, options: dict[str, Any]) -> None:
    """Add one row of :data:`COMMAND_TABLE` to ``a``: a function as a command, a Typer app as a group."""
    module, _, attr = target.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    if callable(obj) and not hasattr(obj, "registered_commands"):
        a.command(name, **options)(obj)
    else:
        a.add_typer(obj, name=name, **options)


def make_app(modules: list[str]) -> typer.Typer:
    """A ``broker`` Typer app with the root options and the commands of :data:`COMMAND_TABLE` defined in
    ``modules`` (module names), in the table's order."""
    a = _new_app()
    a.callback()(_root_callback())
    for name, target, options in COMMAND_TABLE:
        if target.partition(":")[0] in modules:
            add_command(a, name, target, options)
    return a


_full_app: typer.Typer | None = None


def __getattr__(name: str) -> Any:
    """``broker.cli.app.app``: the app with every command, built on first use (PEP 562)."""
    if name == "app":
        global _full_app
        if _full_app is None:
            _full_app = make_app(COMMAND_MODULES)
        return _full_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _app_for(args: list[str]) -> typer.Typer:
    """The full app, unless ``args`` name one known command (after root options) and the full app was never
    built (tests add commands to it): then an app with that command's module only."""
    import os

    if _full_app is not None or any(k.endswith("_COMPLETE") for k in os.environ):
        return __getattr__("app")
    first = next((a for a in args if not a.startswith("-")), None)
    roots = [a for a in args[: args.index(first)]] if first is not None else args
    if first in COMMANDS and all(a in ("-v", "-vv", "-vvv", "--verbose") for a in roots):
        return make_app([COMMANDS[first]])
    return __getattr__("app")


# ------------------------------------------------------------------------------------------------ error boundary
def scrub(text: str) -> str:
    """``text`` without secrets: values of environment variables whose names say key / secret / token / password
    (8 characters or more) and ``api_key=...``-style query values become ``***``."""
    import os
    import re

    for name, value in os.environ.items():
        if len(value) >= 8 and re.search(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL", name, re.I) and value in text:
            text = text.replace(value, "***")
    from broker.core.private import known_secrets

    for value in known_secrets():  # the recipe's secrets: values, whatever their names
        if value in text:
            text = text.replace(value, "***")
    return re.sub(r"(?i)((?:api[_-]?key|token|secret|password)=)[^&\s'\"]+", r"\1***", text)


def crash_log(exc: BaseException) -> Path | None:
    """Write ``exc``'s traceback to ``<BROKER_HOME>/logs/crash-<time>-<pid>.log``, or, when the home cannot be
    written, to this user's own 0700 folder ``/tmp/broker-<uid>/logs`` (never a shared folder: another user could
    plant a symlink there); returns the file, None when nothing could be written.  Each folder must be a real
    folder this user owns, mode 0700 (:func:`broker.core.private.check_private_dir`); the file is created 0600 with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a name planted there is never followed nor overwritten)."""
    import os
    import time
    import traceback

    text = scrub(f"broker {__version__} on Python {sys.version.split()[0]}\ncommand: broker {' '.join(sys.argv[1:])}\n\n"
                 + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    stem = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    candidates: list[Any] = []  # callables giving a folder
    try:
        from broker.core.config import home_path

        home_logs = home_path() / "logs"
        candidates.append(lambda: home_logs)
    except Exception:  # noqa: BLE001 - the fallback below is the point
        pass

    def own_tmp() -> Path:
        from broker.core import private
        base = private.SHORT_BASE / f"broker-{os.geteuid()}"
        private.private_dir(base)
        private.check_private_dir(base, what="crash-log folder")
        return base / "logs"

    candidates.append(own_tmp)
    for where in candidates:
        try:
            from broker.core.private import check_private_dir, private_dir, tighten_dir

            d = where()
            private_dir(d)
            tighten_dir(d)
            check_private_dir(d, what="crash-log folder")
            for n in range(10):
                p = d / (stem + (f"-{n}" if n else "") + ".log")
                try:
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                except FileExistsError:
                    continue
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                return p
        except Exception:  # noqa: BLE001 - OSError, or BadInput for a folder another user planted: next place
            continue
    return None


def _home_hint() -> str:
    try:
        from broker.core.config import home_path

        home = str(home_path())
    except Exception:  # noqa: BLE001
        home = "?"
    return (f"the broker home is {home}: set BROKER_HOME to a folder you can write (it holds the ledger and run "
            "logs)")


#: OS errors that are about the user's files or machine, not a bug: errno names
_USER_OS_ERRORS = ("EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "ENOENT", "ENOTDIR", "EISDIR", "EEXIST",
                   "ENAMETOOLONG", "ELOOP", "EMFILE", "ENFILE")


def _usage_errors() -> tuple[type, ...]:
    """Usage-error base classes: Typer's own (Typer >= 0.20 vendors click) and click's (older Typer)."""
    import typer

    out: list[type] = []
    base = getattr(typer, "TyperException", None)
    if base is not None:
        out.append(base)
    click = sys.modules.get("click")  # an older Typer imported click itself; never import it for nothing (~10 ms)
    if click is not None:
        out.append(click.exceptions.ClickException)
    return tuple(out)


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(name path, command) of ``cmd`` and every command below it."""
    yield path, cmd
    for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
        yield from _commands(sub, path + (name,))


def _opts(cmd: Any) -> set[str]:
    return {o for p in getattr(cmd, "params", []) for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}


def _option_home(exc: Any, args: list[str]) -> str | None:
    """For click's "No such option": drop suggestions that are not close (click offers ``--version`` for
    ``--json``, ``--quiet`` for ``--budget``) and say where the option belongs: ``--json is an option of the
    command: broker status --json`` when it was put before the command that has it, else which commands have it.
    None when no command has it."""
    import difflib

    name = exc.option_name
    exc.possibilities = [p for p in (exc.possibilities or [])  # a typo's real option (--budgt: --budget) stays
                         if difflib.SequenceMatcher(None, name, p).ratio() >= 0.8]
    root = command()  # the whole tree (a run may have built only its own command)
    here = tuple(exc.ctx.command_path.split()[1:]) if exc.ctx is not None else ()
    # the command the user named: the words of args that walk down the command tree from where the error was
    path, cmd = here, dict(_commands(root)).get(here, root)
    after = args[args.index(name) + 1:] if name in args else args
    value = ""  # `broker --budget 5 plan`: the word after the option is its value, not a command
    if after and not after[0].startswith("-") and after[0] not in (getattr(cmd, "commands", None) or {}):
        value, after = after[0], after[1:]
    for a in after:
        sub = (getattr(cmd, "commands", None) or {}).get(a)
        if sub is None:
            if a.startswith("-"):
                continue
            break
        path, cmd = path + (a,), sub
    if path != here and name in _opts(cmd):
        shown = f"{name} {value}" if value else name
        return f"{name} goes after the command: broker {' '.join(path)} {shown}"
    if here and name in _opts(root):
        return f"{name} is an option of broker itself: broker {name} {' '.join(here)} ..."
    here_cmd = dict(_commands(root)).get(here)
    word = name.lstrip("-").replace("-", "_")
    # a metavar may offer alternatives (RECIPE|SCRIPT.py): the one the option named is shown
    arg, shown = next(((p, m) for p in getattr(here_cmd, "params", [])
                       if getattr(p, "param_type_name", "") == "argument"
                       for m in [p.name.upper(), *(p.metavar or "").strip("[].").split("|")]
                       if word == m.lower()), (None, ""))
    if arg is not None:
        if shown == arg.name.upper() and arg.metavar:  # named by its parameter name: shown as its metavar
            shown = arg.metavar.strip("[]")
        return f"{' '.join(('broker',) + here)} takes {shown} as an argument: broker {' '.join(here)} {shown}"
    homes = [" ".join(("broker",) + p) for p, c in _commands(root) if p and name in _opts(c)]
    if not homes:
        return None
    if len(homes) > 4:
        homes = homes[:4] + ["..."]
    field = _RECIPE_FIELD.get(name) if here == ("run",) else None
    also = f"; for a run it is the recipe's `{field}:` field" if field else ""
    return f"{name} is an option of {', '.join(homes)}, not of {' '.join(('broker',) + here)}{also}"


#: plan options whose value a run takes from its recipe (broker/core/recipe.py's fields)
_RECIPE_FIELD = {"--budget": "budget_usd", "-b": "budget_usd", "--hours": "max_hours", "--nodes": "nodes",
                 "-n": "nodes", "--gpus-per-node": "gpus_per_node"}


#: words users of other tools type for a command, and broker's command for them (click's own suggestion is by
#: spelling: `launch` -> `plan`)
#: (never `stop` -> `down`: a user who wants the disk kept must not be pointed at what deletes it)
COMMAND_ALIASES = {"launch": "run", "apply": "run", "submit": "run", "up": "run",
                   "ls": "status", "ps": "status", "queue": "status", "list": "status", "show": "status",
                   "log": "logs", "tail": "logs", "destroy": "down", "terminate": "down", "delete": "down",
                   "teardown": "down", "kill": "down", "cancel": "down", "shell": "ssh",
                   "price": "offers", "prices": "offers", "gpus": "offers", "show-gpus": "offers", "costs": "cost",
                   "config": "check", "doctor": "check", "cost-report": "cost", "attach": "logs"}


def _usage_message(exc: Any, args: list[str]) -> tuple[str, str]:
    """(message, hint) for a parser usage error: the parser's one-line message (click's "Did you mean" for a
    command replaced by :data:`COMMAND_ALIASES`' word where there is one), and as hint where a misplaced option
    belongs (:func:`_option_home`), else the command's usage line and where its help is."""
    import re

    message = exc.format_message().strip().split("\n")[0]
    ctx = getattr(exc, "ctx", None)
    # click gives no context for an option left without its value: the command is then the first word the
    # user typed that names one (`broker plan --interruptible` -> `broker plan --help`, not `broker --help`)
    word = next((a for a in args if not a.startswith("-")), None)
    path = ctx.command_path if ctx is not None else ("broker " + word if word in COMMANDS else "broker")
    hint = f"`{path} --help` lists its arguments and options"
    if ctx is not None:
        try:
            usage = ctx.get_usage().strip()
            hint = f"usage: {usage[len('Usage: '):] if usage.startswith('Usage: ') else usage} (`{path} --help`)"
        except Exception:  # noqa: BLE001 - the plain hint stands
            pass
    m = re.match(r"No such command '(.+?)'\.", message)
    if m:
        known = getattr(getattr(ctx, "command", None), "commands", None) or {}
        alias = COMMAND_ALIASES.get(m[1].lower())
        if alias and alias in known:
            return f"no command '{m[1]}' in {path}", f"did you mean `{path} {alias}`? (`{path} --help` lists them)"
        return message[0].lower() + message[1:], f"`{path} --help` lists the commands"
    m = re.match(r"Got unexpected extra argument(?:s|\(s\))? \((\S+\.ya?ml)\)", message)
    if m and ctx is not None and "--recipe" in _opts(ctx.command):  # `broker plan r.yaml`
        return message, f"the recipe goes after --recipe: {path} --recipe {m[1]}"
    if hasattr(exc, "option_name") and hasattr(exc, "possibilities"):  # NoSuchOption
        where = _option_home(exc, args)
        message = exc.format_message().strip().split("\n")[0]
        if where:
            hint = where
    return message, hint


#: commands whose run pipeline tears down what it rented when a signal ends it
_TEARS_DOWN = ("run", "exec")


def handle(exc: BaseException, *, as_json: bool, args: list[str] | None = None) -> int:
    """The exit code for ``exc`` after printing its one message (the boundary's whole policy, testable);
    ``args``: the command line (to say where a misplaced option belongs)."""
    args = list(sys.argv[1:] if args is None else args)
    import errno
    import sqlite3

    import typer

    if isinstance(exc, BrokerError):
        return _report(exc.exit_code, exc.message, exc.hint, kind=type(exc).__name__, as_json=as_json)
    if isinstance(exc, typer.Exit):
        return exc.exit_code
    if isinstance(exc, _usage_errors()):  # usage errors: the parser's message in broker's own style, exit 2
        message, hint = _usage_message(exc, args)
        return _report(exc.exit_code, message, hint, kind="UsageError", as_json=as_json)
    term = exc if isinstance(exc, Terminated) else (exc.__cause__ or exc.__context__) \
        if isinstance(exc, typer.Abort) else None
    if isinstance(term, Terminated):
        # only a job's pipeline tears down on the way out; another command (`broker start`) says what it left
        word = next((a for a in (args or []) if not a.startswith("-")), "")
        tore = ": broker tore down what the run had rented before exiting" if word in _TEARS_DOWN else ""
        return _report(term.exit_code, f"terminated by {term.signame}"
                       + (" (the terminal closed)" if term.signame == "SIGHUP" else "") + tore, None,
                       kind="Terminated", as_json=as_json)
    if isinstance(exc, typer.Abort):
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, EOFError):
            return _report(EXIT_BAD_INPUT, "a question needed an answer but input ended (stdin closed)",
                           "answer on a terminal, or pass the option that skips the question (e.g. --yes)",
                           kind="EOFError", as_json=as_json)
        return _report(EXIT_INTERRUPTED, "interrupted", None, kind="KeyboardInterrupt", as_json=as_json)
    if isinstance(exc, KeyboardInterrupt):
        return _report(EXIT_INTERRUPTED, "interrupted", None, kind="KeyboardInterrupt", as_json=as_json)
    if isinstance(exc, sqlite3.OperationalError):
        try:
            from broker.core.config import home_path

            where = f" ({home_path() / 'ledger.sqlite'})"
        except Exception:  # noqa: BLE001
            where = ""
        text = str(exc)
        if "locked" in text or "busy" in text:  # not the folder: another process holds the ledger's write lock
            hint = (f"another process holds the ledger's lock (`fuser {where.strip(' ()')}` names it): a command "
                    "stops here before it creates anything; what it had deleted is named above and kept in the "
                    "journal beside the ledger; run it again once the lock is released")
        elif "full" in text:
            hint = ("the filesystem holding the broker home is full: free space there (e.g. `broker clean`), then "
                    "run the command again")
        else:
            hint = _home_hint()
        return _report(EXIT_BAD_INPUT, f"the ledger{where} cannot be used: {exc}", hint,
                       kind="LedgerError", as_json=as_json)
    if isinstance(exc, OSError) and exc.errno is not None and errno.errorcode.get(exc.errno) in _USER_OS_ERRORS:
        where = exc.filename if exc.filename is not None else ""
        msg = f"{where}: {exc.strerror}" if where else str(exc.strerror or exc)
        try:
            from broker.core.config import home_path

            in_home = where and Path(str(where)).resolve().is_relative_to(home_path().resolve())
        except Exception:  # noqa: BLE001
            in_home = False
        if in_home:
            hint = _home_hint()
        elif exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            hint = "free some disk space and try again"
        else:
            hint = "check the path and its permissions"
        return _report(EXIT_BAD_INPUT, msg, hint, kind=type(exc).__name__, as_json=as_json)
    if isinstance(exc, MemoryError):
        return _report(EXIT_JOB_FAILED, "out of memory", "close other programs or use a machine with more memory",
                       kind="MemoryError", as_json=as_json)
    log = crash_log(exc)
    detail = scrub(f"{type(exc).__name__}: {exc}")
    if len(detail) > 300:
        detail = detail[:300] + "..."
    hint = (f"this is a bug in broker; the traceback is in {log}: please report it with that file" if log else
            "this is a bug in broker; please report it with the command you ran")
    return _report(EXIT_JOB_FAILED, f"unexpected {detail}", hint, kind="internal", as_json=as_json,
                   extra={"log": str(log) if log else None})


def _broken_pipe(exc: BaseException) -> BrokenPipeError | None:
    """The BrokenPipeError behind ``exc`` (itself, or what it was raised while handling: click turns EPIPE into
    ``sys.exit(1)``), or None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, BrokenPipeError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _plain_usage(cmd: Any) -> None:
    """Usage lines read ``broker run [OPTIONS] RECIPE``: newer Typer writes a required argument as ``{RECIPE}``
    there (the Arguments list and the docs say ``RECIPE``), ``{PATH...}...`` for ``PATH...``; applied to ``cmd`` and every subcommand."""
    import re

    original = cmd.collect_usage_pieces

    def plain(piece: str) -> str:
        m = re.fullmatch(r"\{(.+)\}((?:\.\.\.)?)", piece)  # {RECIPE}, {PATH...}...
        if m is None:
            return piece
        return m[1] if m[1].endswith("...") else m[1] + m[2]

    def pieces(ctx: Any) -> list[str]:
        return [plain(p) for p in original(ctx)]

    cmd.collect_usage_pieces = pieces
    for sub in (getattr(cmd, "commands", None) or {}).values():
        _plain_usage(sub)


def _help_keeps_hyphenated_words() -> None:
    """Help text wraps between words only: click's wrapper (textwrap) also breaks after a hyphen, which splits
    values such as ``direct-blocked`` into "direct-" / "blocked", and between the words of a `backticked command`
    (Typer's vendored click and click itself); both are kept whole."""
    import importlib

    for mod in ("typer._click._textwrap", "click._textwrap"):
        if mod.startswith("click") and "click" not in sys.modules:  # only an older Typer's own click
            continue
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        base = getattr(m, "TextWrapper", None)
        if base is None or getattr(base, "_broker_no_hyphen_break", False):
            continue

        class _Wrapper(base):  # type: ignore[misc, valid-type]
            _broker_no_hyphen_break = True

            def __init__(self, *a: Any, **kw: Any) -> None:
                kw["break_on_hyphens"] = False
                super().__init__(*a, **kw)

            def _split(self, text: str) -> list[str]:
                """textwrap's chunks, a `backticked command` (spaces and all) one chunk: never split."""
                chunks = super()._split(text)
                if text.count("`") % 2:  # an unpaired backtick: plain words
                    return chunks
                out: list[str] = []
                inside = False
                for ch in chunks:
                    if inside:
                        out[-1] += ch
                    else:
                        out.append(ch)
                    if ch.count("`") % 2:
                        inside = not inside
                return out

        m.TextWrapper = _Wrapper  # type: ignore[attr-defined]


def command(a: typer.Typer | None = None) -> Any:
    """The click command behind ``a`` (default: the full app; as ``app()`` builds it), with plain usage lines
    (:func:`_plain_usage`) and help that never breaks a hyphenated word (:func:`_help_keeps_hyphenated_words`)."""
    import typer.main

    _help_keeps_hyphenated_words()
    cmd = typer.main.get_command(a if a is not None else __getattr__("app"))
    _plain_usage(cmd)
    return cmd


_interrupted = False


def _on_sigint(signum: int, frame: Any) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


_terminated: Terminated | None = None


def _on_terminate(signum: int, frame: Any) -> None:
    global _terminated
    _terminated = Terminated(signum)
    raise _terminated


def quiet_third_party_warnings() -> None:
    """Keep the libraries' own deprecation notices off the user's terminal: asyncssh imports DSA and other
    algorithms that newer cryptography releases deprecate, and each SSH command printed five 224-column
    ``CryptographyDeprecationWarning`` blocks about code that is not broker's.  Matched by the module the warning
    is attributed to (no import of cryptography at start-up); broker's own warnings still show."""
    import warnings

    warnings.filterwarnings("ignore", module=r"asyncssh(\.|$)")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the app behind one error boundary (:func:`handle`) and exits."""
    import signal

    quiet_third_party_warnings()
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args[: args.index("--")] if "--" in args else "--json" in args
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)  # Typer turns Ctrl-C into exit 130 silently: note it
        for sig in (signal.SIGTERM, signal.SIGHUP):  # `kill`, `timeout`, a closed terminal: the same teardown
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_terminate)
    except ValueError:  # not the main thread
        pass
    try:
        from broker.core.choices import normalize_args

        args = normalize_args(args)  # --provider LOCAL -> local; --provider vasti: did you mean vast? (exit 2)
        from broker.cli import fastplan

        fast = fastplan.parse(args)  # `broker plan ...` in its common forms: no Typer app to build (start-up time)
        if fast is not None:
            rv = fastplan.run(*fast, root=root_verbose)
        elif args[:1] == ["status"] and importlib.import_module("broker.cli.faststatus").main(args):
            rv = 0  # `broker status` in a pipe over ended runs: printed without Typer, rich or pydantic
        else:
            rv = command(_app_for(args))(args=args, prog_name="broker", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
        if code == EXIT_INTERRUPTED and _terminated is not None:  # Typer's silent 130 for SIGTERM / SIGHUP
            code = _boundary(_terminated, as_json, args)
        elif code == EXIT_INTERRUPTED and _interrupted and not as_json:
            _report(EXIT_INTERRUPTED, "interrupted", None, kind="KeyboardInterrupt", as_json=False)
    except BaseException as e:  # noqa: BLE001 - the one boundary
        pipe = _broken_pipe(e)
        if isinstance(e, OutputClosed) or (pipe is not None and _closed_std_streams()):  # `broker offers | head -1`
            code = _quiet_broken_pipe()
        elif pipe is not None and (e is pipe or (isinstance(e, SystemExit) and e.__context__ is pipe)):
            # another pipe (a child's stdin): a failure (click would exit 1 silently)
            code = _boundary(pipe, as_json, args)
        elif isinstance(e, SystemExit):  # sys.exit() somewhere below: keep its code
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        else:
            code = _boundary(e, as_json, args)
        if _terminated is not None and code != _terminated.exit_code:
            # the terminal closed (SIGHUP): writing the report failed with EIO; the signal's code still says why
            code = _terminated.exit_code
    finally:
        reset_logging()
    code = _unrecorded(code)
    # the interpreter's last garbage collection walks every object of the modules loaded (about 0.1 s of a
    # 0.45 s command) only to free memory the exit frees anyway; atexit handlers, thread joins and the
    # closing of files still run
    import gc

    gc.freeze()
    sys.exit(code)


def _unrecorded(code: int) -> int:
    """``code``, or ``code`` + 10 (broker.money.journal.exit_code) after naming on stderr every write this process
    could not record in the ledger (it was locked or its disk full: the teardown went on without it)."""
    if "broker.money.journal" not in sys.modules:  # nothing was written through it
        return code
    from broker.money import journal

    try:
        lines = journal.unrecorded_lines()
    except Exception:  # noqa: BLE001 - the journal holds them; the code still says so
        return journal.exit_code(code, journal.pending_anywhere())
    if not lines:
        return code
    try:
        sys.stderr.write("error: the ledger could not record everything (teardown went on without it):\n"
                         + "".join(f"  {line}\n" for line in lines))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return journal.exit_code(code, True)


def _boundary(e: BaseException, as_json: bool, args: list[str] | None = None) -> int:
    """:func:`handle`, guarded: a second Ctrl-C (or a failure) while reporting still ends in an exit code; a closed
    stderr while reporting keeps the error's own exit code."""
    try:
        return handle(e, as_json=as_json, args=args)
    except BaseException as failure:  # noqa: BLE001 - a second Ctrl-C (or a failure) while reporting
        if isinstance(e, KeyboardInterrupt):
            return e.exit_code if isinstance(e, Terminated) else EXIT_INTERRUPTED
        code = getattr(e, "exit_code", None)
        if isinstance(failure, (OSError, ValueError, OutputClosed)) and _closed_std_streams() and \
                isinstance(code, int) and code:  # stderr closed while reporting: the error's own code stands
            _quiet_broken_pipe()
            return code
        return EXIT_JOB_FAILED


if __name__ == "__main__":
    main()
