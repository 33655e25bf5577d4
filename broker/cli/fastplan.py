"""``broker plan`` without Typer: the command line's common forms parsed here, everything else left to Typer.

Building the Typer app costs more than planning (typer and its vendored click: ~45 ms of imports, then the signature
inspection of every parameter), so :func:`broker.cli.app.main` first offers the arguments to :func:`parse`.  It
accepts only what Typer would accept and turns it into the very values Typer would pass to the command
(:data:`OPTIONS` mirrors the options of ``broker.cli.plan``'s ``plan_cmd``; tests/test_fastplan.py checks the two
against each other option by option); anything else (``--help``, an unknown or misspelt option, a value that does
not convert, a missing value, a value that starts with ``-``, ``--opt=value`` of a flag, ``-b5``, ``--``, an extra
argument, an unreadable ``--recipe``, shell completion) returns None, and Typer parses the line as before: its
errors, help and did-you-mean stay the only ones.  Both paths run the same body, :func:`broker.cli.plan.plan_command`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

#: option -> (parameter of plan_command, kind): ``float``/``int``/``str``/``path`` take one value, ``list`` one
#: value per use (repeatable), ``True``/``False`` are flags giving that value
OPTIONS: dict[str, tuple[str, Any]] = {
    "--budget": ("budget", "float"), "-b": ("budget", "float"),
    "--nodes": ("nodes", "int"), "-n": ("nodes", "int"),
    "--gpus-per-node": ("gpus_per_node", "int"),
    "--gpu": ("gpu", "list"),
    "--min-gpu-mem": ("min_gpu_mem", "float"),
    "--hours": ("hours", "float"),
    "--max-run": ("max_run", True),
    "--topology": ("topology", "str"),
    "--provider": ("provider", "list"), "-p": ("provider", "list"),
    "--recipe": ("recipe", "path"), "-r": ("recipe", "path"),
    "--cpu-ok": ("cpu_ok", True), "--no-cpu-ok": ("cpu_ok", False),
    "--cpu-only": ("cpu_only", True),
    "--disk": ("disk", "float"),
    "--top": ("top", "int"),
    "--vast-query": ("vast_query", "str"),
    "--offline": ("offline", True),
    "--wide": ("wide", True), "--narrow": ("wide", False),
    "--json": ("as_json", True),
    "--interruptible": ("interruptible", "str"),
}

#: what Typer passes for an option not given (None for a repeatable one, not [])
DEFAULTS: dict[str, Any] = {"budget": None, "nodes": None, "gpus_per_node": None, "gpu": None, "min_gpu_mem": None,
                            "hours": None, "max_run": False, "topology": None, "provider": None, "recipe": None,
                            "cpu_ok": None, "cpu_only": False, "disk": None, "top": 8, "vast_query": None,
                            "offline": False, "wide": None, "as_json": False,
                            "interruptible": None}

#: smallest value of an int option (``--top``'s ``min=1``)
MINIMUM = {"top": 1}


class _NotMine(Exception):
    """The line is not one :func:`parse` takes: Typer parses it."""


def _convert(param: str, kind: str, value: str) -> Any:
    """``value`` as Typer's vendored click converts it (``float(value)``, ``int(value)``, the string, a Path);
    :class:`_NotMine` where click would fail (click's own message then says so)."""
    if value.startswith("-"):  # click may take it as the value or as the next option: Typer decides
        raise _NotMine
    try:
        if kind == "float":
            return float(value)
        if kind == "int":
            n = int(value)
            if n < MINIMUM.get(param, n):
                raise _NotMine
            return n
    except ValueError:
        raise _NotMine from None
    if kind == "path":
        try:
            os.stat(value)
        except OSError:
            return Path(value)  # a missing recipe: plan_command says so in broker's words, as after Typer
        if not os.access(value, os.R_OK):  # click's "is not readable"
            raise _NotMine
        return Path(value)
    return value


def parse(args: list[str]) -> tuple[int, dict[str, Any]] | None:
    """``(verbosity, keyword arguments of plan_command)`` for ``broker [-v...] plan OPTIONS`` (``args`` after the
    program name), or None when Typer must parse the line (see the module docstring)."""
    if any(k.endswith("_COMPLETE") for k in os.environ):  # shell completion is Typer's
        return None
    try:
        i = args.index("plan")
    except ValueError:
        return None
    verbose = 0
    for a in args[:i]:  # root options: -v, -vv, --verbose only
        if a == "--verbose":
            verbose += 1
        elif len(a) > 1 and a[0] == "-" and set(a[1:]) == {"v"}:
            verbose += len(a) - 1
        else:
            return None
    out = dict(DEFAULTS)
    rest = args[i + 1:]
    j = 0
    try:
        while j < len(rest):
            word = rest[j]
            explicit = None
            if word.startswith("--") and "=" in word:
                word, explicit = word.split("=", 1)
            spec = OPTIONS.get(word)
            if spec is None:  # --help, -h, --, an unknown option, an argument, -b5
                raise _NotMine
            param, kind = spec
            if isinstance(kind, bool):
                if explicit is not None:  # --json=yes: click's "does not take a value"
                    raise _NotMine
                out[param] = kind
                j += 1
                continue
            if explicit is None:
                if j + 1 >= len(rest):  # click's "requires an argument"
                    raise _NotMine
                explicit = rest[j + 1]
                j += 2
            else:
                j += 1
            value = _convert(param, "str" if kind == "list" else kind, explicit)
            if kind == "list":
                out[param] = [*(out[param] or []), value]
            else:
                out[param] = value  # given twice: the last one, as click
    except _NotMine:
        return None
    return verbose, out


def run(verbose: int, kwargs: dict[str, Any], root: Callable[[int], None] | None = None) -> int:
    """Run ``broker plan`` with parsed options the way Typer's ``main`` runs a command in non-standalone mode:
    returns the exit code; Ctrl-C (and SIGTERM / SIGHUP, :class:`broker.core.errors.Terminated`) returns 130 for
    :func:`broker.cli.app.main` to report, end of input is Typer's ``Abort``, a closed pipe exits 1 (the error
    boundary then finds the broken pipe behind it); ``root(verbose)`` runs first."""
    from broker.cli.plan import plan_command

    # ``root``: what the root option -v does (broker.cli.app.root_verbose), passed in: this module sits below the app
    return _like_typer(lambda: ((root or (lambda _v: None))(verbose), plan_command(**kwargs))[1])


def _like_typer(fn: Callable[[], int]) -> int:
    import errno

    try:
        return fn()
    except EOFError as e:
        import typer

        sys.stderr.write("\n")
        raise typer.Abort() from e
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        from typer._click.utils import PacifyFlushWrapper

        sys.stdout = PacifyFlushWrapper(sys.stdout)  # type: ignore[assignment]
        sys.stderr = PacifyFlushWrapper(sys.stderr)  # type: ignore[assignment]
        sys.exit(1)
