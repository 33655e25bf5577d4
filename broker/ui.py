"""Console helpers (rich): one stdout console, one stderr console, JSON output."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from rich.console import Console



class _Console(Console):
    """rich's console, except that a closed pipe (``broker offers | head -1``) ends the command with
    :class:`broker.errors.OutputClosed` (quiet, exit 141) where rich's default is a plain exit 1."""

    def on_broken_pipe(self) -> None:
        import os
        import sys

        from broker.errors import OutputClosed

        self.quiet = True
        try:  # what is still written (teardown messages, Python's flush at exit) goes nowhere, as in rich
            fd = self.file.fileno()
        except (OSError, ValueError, AttributeError):
            fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        raise OutputClosed()


console = _Console(highlight=False, soft_wrap=True, emoji=False)  # names like "a:rocket:b" print as written
err = _Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


def print_json(data: Any) -> None:
    """Print ``data`` as JSON on stdout: pydantic models dumped, broker's dataclass values as dicts with datetimes
    in ISO 8601 as pydantic writes them (:func:`broker.model.to_json`: UTC as ``Z``), other datetimes
    ``isoformat()``, anything else as ``str``."""
    import dataclasses

    def default(o: Any) -> Any:
        if hasattr(o, "model_dump"):
            return o.model_dump(mode="json")
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            from broker.model import to_json

            return to_json(o)
        if isinstance(o, datetime):
            return o.isoformat()
        return str(o)

    print(json.dumps(data, default=default, indent=2))


def usd(x: float | None) -> str:
    """'$1.23' (or '-' for None); amounts under a cent keep 4 decimals."""
    if x is None:
        return "-"
    return f"${x:,.4f}" if 0 < abs(x) < 0.01 else f"${x:,.2f}"


def hours(h: float | None) -> str:
    if h is None:
        return "-"
    if h == float("inf"):
        return "unlimited"
    return f"{h:.2f} h" if h < 100 else f"{h:,.0f} h"


def echo_line(line: str) -> None:
    """Print a streamed log line verbatim (no markup interpretation)."""
    console.out(line, highlight=False)


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` wrapped to ``width`` cells at spaces, each ``\\n`` kept as a line break, and no paragraph ending in
    one lone word (a widow like ``h`` of ``0.99 h``): the line before gives its last word when it has three or more
    and the pair fits.  A word wider than ``width`` keeps a line of its own (the table folds it)."""
    from rich.cells import cell_len

    out: list[str] = []
    for para in text.split("\n"):
        lines: list[list[str]] = []
        for word in para.split():
            if lines and cell_len(" ".join(lines[-1] + [word])) <= width:
                lines[-1].append(word)
            else:
                lines.append([word])
        if len(lines) >= 2 and len(lines[-1]) == 1 and len(lines[-2]) >= 3 and \
                cell_len(" ".join(lines[-2][-1:] + lines[-1])) <= width:
            lines[-1].insert(0, lines[-2].pop())
        out.extend(" ".join(ln) for ln in lines or [[]])
    return out


class Wrapped:
    """A table cell of plain text wrapped by :func:`wrap_words` at the width the table gives it (rich's own wrap
    can leave one word alone on the last line of a cell)."""

    def __init__(self, text: str, style: str = "") -> None:
        self.text = text
        self.style = style

    def __rich_measure__(self, console: Any, options: Any) -> Any:
        from rich.cells import cell_len
        from rich.measure import Measurement

        words = self.text.split() or [""]
        return Measurement(max(cell_len(w) for w in words),
                           max(cell_len(" ".join(p.split())) for p in self.text.split("\n")))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        yield Text("\n".join(wrap_words(self.text, options.max_width)), style=self.style)
