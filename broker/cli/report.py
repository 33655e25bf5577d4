"""How the CLI prints one error (stderr line + hint, and with ``--json`` an error object) and how it goes quiet when
its reader has gone (``broker offers | head -1``): shared by the error boundary (:mod:`broker.cli.app`) and the
commands that print their own errors (``broker plan``'s no valid plan).  Standard library and :mod:`broker.core`
only, so any command module can import it without importing the app."""

from __future__ import annotations

import sys
from typing import Any

from broker.core.errors import EXIT_BROKEN_PIPE, OutputClosed


def _report(code: int, message: str, hint: str | None, *, kind: str, as_json: bool,
            extra: dict[str, Any] | None = None, json_object: bool = True) -> int:
    """Print one error: the one-line message (and its hint) on stderr, and with ``--json`` also a JSON object
    ``{"schema_version": 1, "error": {...}}`` on stdout (what a script reads) unless ``json_object`` is False (the
    command printed its own object with the error in it); returns ``code``.  With ``--json`` the stderr lines are
    never wrapped; a closed stderr leaves ``code`` as it is."""
    import typer

    if as_json and json_object:
        import json

        from broker.core.ui import json_payload

        err: dict[str, Any] = {"type": kind, "message": message, "hint": hint, "exit_code": code}
        err.update(extra or {})
        try:
            sys.stdout.write(json.dumps(json_payload({"error": err}), indent=2) + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):  # stdout gone: the stderr line below still says it
            pass
    from broker.core.ui import NO_WRAP_WIDTH, wrap_plain
    from broker.core.ui import err as err_console

    label = "internal error" if kind == "internal" else "error"
    # the terminal's, else COLUMNS, else 80 (pipes, CI logs); with --json one line each (a script greps it)
    width = NO_WRAP_WIDTH if as_json else err_console.prose_width
    try:
        first, *more = wrap_plain(f"{label}: {message}", width)
        typer.echo(typer.style(f"{label}:", fg="red", bold=True) + first[len(label) + 1:], err=True)
        for line in more:
            typer.echo(line, err=True)
        if hint:
            first, *more = wrap_plain(f"  -> {hint}", width)
            typer.echo(typer.style("  ->", fg="yellow") + first[4:], err=True)
            for line in more:
                typer.echo(line, err=True)
    except (BrokenPipeError, OutputClosed, OSError, ValueError):  # stderr closed (`2>&1 | head -0`): the code stands
        _quiet_broken_pipe()
    return code


def _closed_std_streams() -> list[int]:
    """File descriptors among stdout (1) and stderr (2) that are pipes whose reader has gone (POLLERR)."""
    import select

    out: list[int] = []
    for fd in (1, 2):
        try:
            p = select.poll()
            p.register(fd, select.POLLOUT)
            if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0)):
                out.append(fd)
        except (OSError, ValueError, AttributeError):  # closed descriptor, no poll() on this platform
            continue
    return out


def _quiet_broken_pipe() -> int:
    """stdout's (or stderr's) reader went away (``broker offers | head -1``): no message, no traceback, exit 141
    like ``git log | head -1``.  The closed streams point at /dev/null from here on, so that Python's own flush at
    exit does not print "Exception ignored ... BrokenPipeError" (the note on SIGPIPE in Python's ``signal``
    documentation)."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in _closed_std_streams():
        os.dup2(devnull, fd)
    os.close(devnull)
    return EXIT_BROKEN_PIPE
