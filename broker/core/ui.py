"""Console helpers (rich): one stdout console, one stderr console, JSON output."""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console

from broker.core.prose import (JSON_SCHEMA_VERSION, LIST_ITEM_CELLS, LIST_ITEM_WORDS, NO_WRAP_WIDTH,  # noqa: F401
                               PROSE_TAGS, _UNITS, _commands_in, _hang, _list_items, _tokens, cell_len,
                               hanging_indent, hours, json_payload, print_json, usd, wrap_line_spans,
                               wrap_plain, wrap_words)



class _Console(Console):
    """rich's console, except that a closed pipe (``broker offers | head -1``) ends the command with
    :class:`broker.core.errors.OutputClosed` (quiet, exit 141) where rich's default is a plain exit 1, and that text is
    prose wrapped at the console's width (the terminal's; in a pipe ``COLUMNS``, else 80) between words, never
    inside a command, URL or path (:meth:`print`, :meth:`out`), while node log lines stay verbatim
    (:meth:`verbatim`)."""

    def on_broken_pipe(self) -> None:
        import os
        import sys

        from broker.core.errors import OutputClosed

        self.quiet = True
        try:  # what is still written (teardown messages, Python's flush at exit) goes nowhere, as in rich
            fd = self.file.fileno()
        except (OSError, ValueError, AttributeError):
            fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        raise OutputClosed()

    @property
    def prose_width(self) -> int:
        """The width prose wraps at: the console's (the terminal's; in a pipe ``COLUMNS``, else 80); no wrapping
        (a very large width) when ``BROKER_NO_WRAP`` is set to anything but ``""``/``0`` (logs meant for grep)."""
        import os

        if os.environ.get("BROKER_NO_WRAP", "").strip() not in ("", "0"):
            return NO_WRAP_WIDTH
        return self.width

    def print(self, *objects: Any, keep: "tuple[str, ...] | list[str]" = (),  # type: ignore[override]
              **kw: Any) -> None:
        """rich's ``print``; plain strings (markup allowed) are prose: wrapped at the console's width on word
        boundaries with a hanging indent (:func:`wrap_text`), never inside a `backticked` command, a URL, a path or
        a substring in ``keep``.  Renderables (tables) are rich's own; :func:`echo_line` (node logs) is never
        wrapped."""
        if objects and all(isinstance(o, str) for o in objects) and not kw.get("no_wrap") \
                and kw.get("width") is None and kw.get("justify") is None and kw.get("overflow") is None:
            text = self.render_str(kw.pop("sep", " ").join(objects), markup=kw.pop("markup", None),
                                   emoji=kw.pop("emoji", None), highlight=kw.pop("highlight", None),
                                   style=kw.pop("style", None) or "")
            kw["soft_wrap"] = True
            objects = (wrap_text(text, self.prose_width, keep=keep),)
        else:  # a table's title is prose too (the console's soft wrap would keep it on one line)
            for o in objects:
                title = getattr(o, "title", None)
                if isinstance(title, str) and hasattr(o, "add_row"):
                    o.title = wrap_text(self.render_str(title), self.prose_width)
            if not self.is_terminal:  # in a pipe or file a table's padding is only trailing blanks to trip diffs
                objects = tuple(_RStripped(o) if hasattr(o, "add_row") else o for o in objects)
        super().print(*objects, **kw)

    def out(self, *objects: Any, sep: str = " ", end: str = "\n", style: Any = None,
            highlight: bool | None = None) -> None:
        """rich's ``out`` (no markup), its text wrapped as prose like :meth:`print`; :func:`echo_line` (node log
        lines) writes verbatim instead."""
        text = sep.join(str(o) for o in objects)
        super().out("\n".join(wrap_plain(text, self.prose_width)), end=end, style=style, highlight=highlight)

    def verbatim(self, line: str) -> None:
        """``line`` as written: never wrapped, no markup (streamed node logs)."""
        super().out(line, highlight=False)


class _RStripped:
    """A renderable (a rich ``Table``) drawn line by line without the blanks that end its lines (rich pads every
    cell to its column's width, so a row ends in spaces and an empty row is all spaces)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __rich_console__(self, console: Console, options: Any) -> Any:
        from rich.segment import Segment

        for line in Segment.split_lines(console.render(self.inner, options)):
            while line and not line[-1].control and not line[-1].text.rstrip():
                line.pop()
            if line and not line[-1].control:
                last = line[-1]
                line[-1] = Segment(last.text.rstrip(), last.style, last.control)
            yield from line
            yield Segment.line()


console = _Console(highlight=False, soft_wrap=True, emoji=False)  # names like "a:rocket:b" print as written
err = _Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)



# --------------------------------------------------------------------------------------------- node output
# A node is a stranger's machine: what it prints must not drive this terminal (set its title, erase lines, move
# the cursor, answer back through OSC 52 ...).  Everything a node printed reaches the terminal through
# :func:`node_text`; the node's log file keeps the raw bytes.

#: ECMA-48 control functions in text: CSI (``ESC [`` or U+009B, parameters, intermediates, final byte), the
#: string commands OSC/DCS/SOS/PM/APC up to BEL or ST (or the end of the line), any other escape sequence, and
#: single C0 controls (but tab and newline), DEL and C1 controls
_CONTROLS = re.compile(  # every branch starts with one character, so re skips plain text quickly
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]?|[\]PX^_][^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?|[ -/]*[0-~]?)"
    r"|\x9b[0-?]*[ -/]*[@-~]?"
    r"|[\x90\x98\x9d\x9e\x9f][^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"
    r"|[\x00-\x08\x0b-\x1a\x1c-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
#: any control character but tab and newline, and the Unicode bidi embeddings/overrides/isolates (U+202A-202E,
#: U+2066-2069: they reorder what the terminal shows, e.g. make a path or a command read backwards)
_ANY_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
#: the bidi controls alone (their UTF-8 forms all start E2 80 or E2 81: the fast path's byte check)
_BIDI = re.compile(r"[\u202a-\u202e\u2066-\u2069]")
#: what a carriage return makes a terminal overwrite: the text before the last CR of a line that goes on after it
_OVERWRITTEN = re.compile(r"[^\r\n]*\r+(?=[^\r\n])")

_show_controls = False


def show_controls(on: bool) -> None:
    """``-v``: :func:`node_text` shows control characters as visible text (ESC as ``\\x1b``) instead of removing
    the sequences they start."""
    global _show_controls
    _show_controls = bool(on)


#: what may follow an ESC, anchored (the ESC branch of ``_CONTROLS``, for text split at each ESC)
_ESC_TAIL = re.compile(r"\[[0-?]*[ -/]*[@-~]?|[\]PX^_][^\x07\x1b\x9c\n]*(?:\x07|\x9c)?|[ -/]*[0-~]?")
#: UTF-8 bytes that are never a C0 control or DEL (the fast check's table)
_NOT_C0 = bytes(range(0x20, 0x7F)) + b"\t\n" + bytes(range(0x80, 0x100))
_C1 = re.compile(r"[\x80-\x9f]")


def strip_controls(text: str) -> str:
    """``text`` without control sequences, control characters and Unicode bidi controls (see ``_CONTROLS``),
    newlines and tabs kept, every printable character (any script, emoji) kept; of a line with carriage returns
    (progress bars) what the terminal would end up showing: the text after the last one.

    The same as ``_CONTROLS.sub("", text)`` (after the carriage returns), done with byte-level scans: a block of
    thousands of lines with an escape sequence now and then costs about 0.1 us a line instead of 1."""
    data = text.encode("utf-8", "surrogatepass")
    c0 = data.translate(None, _NOT_C0)
    if (b"\xc2" in data and _C1.search(text) is not None) or \
            ((b"\xe2\x80" in data or b"\xe2\x81" in data) and _BIDI.search(text) is not None):
        # C1 controls (U+0080..U+009F) or bidi controls (both rare): the plain way
        if "\r" in text:
            text = _OVERWRITTEN.sub("", text)
        return _CONTROLS.sub("", text)
    if not c0:
        return text
    if b"\r" in c0:
        text = _OVERWRITTEN.sub("", text)
    if b"\x1b" in c0:
        head, *parts = text.split("\x1b")
        text = head + "".join(p[_ESC_TAIL.match(p).end():] for p in parts)  # type: ignore[union-attr]
    for c in set(c0.decode("ascii")) - {"\x1b"}:
        if c in text:
            text = text.replace(c, "")
    return text


def visible_controls(text: str) -> str:
    """``text`` with every control character but tab and newline written as visible text: ESC as ``\\x1b``."""
    if _ANY_CONTROL.search(text) is None:
        return text
    return _ANY_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if m.group() < "\u0100"
                            else f"\\u{ord(m.group()):04x}", text)


def node_text(text: str) -> str:
    """Text a node printed (one line or many), made safe for the terminal: :func:`strip_controls`, or with ``-v``
    (:func:`show_controls`) :func:`visible_controls`.  The one function every display of node output goes
    through: the streamed ``[node i]`` lines, ``broker logs``, the summary's log tail and diagnosis."""
    return visible_controls(text) if _show_controls else strip_controls(text)


class _StreamEcho:
    """:func:`echo_line`: a streamed line (``echo_line(line)``) or a block of one node's lines (``.block``)."""

    def __call__(self, line: str) -> None:
        """Print a streamed line, cleaned by :func:`node_text`: a node's log line (``[node i] ...``) verbatim (no
        markup, never wrapped); broker's own (``[broker]``, ``[preflight]``, ``[slurm]``) wrapped as prose under
        their tag."""
        line = node_text(line)
        if line.startswith(PROSE_TAGS):
            console.out(line)
        else:
            console.verbatim(line)

    def block(self, prefix: str, text: str) -> None:
        """Print ``text`` (whole lines of one node's output, each ending in a newline) with ``prefix``
        (``[node i] ``) in front of each line, cleaned by :func:`node_text`: one plain write and one flush for the
        whole block, no per-line rendering (a rank that prints 200,000 lines costs broker well under 2 us each)."""
        text = node_text(text)
        if not text:
            return
        if not text.endswith("\n"):
            text += "\n"
        body = prefix + text[:-1].replace("\n", "\n" + prefix) + "\n"
        if console.quiet:
            return
        if console.record or getattr(console, "_buffer_index", 0):  # a capture: rich keeps the text itself
            for line in body[:-1].split("\n"):
                console.verbatim(line)
            return
        f = console.file
        try:
            try:
                f.write(body)
            except UnicodeEncodeError:  # a terminal that cannot show every character: show what it can
                enc = getattr(f, "encoding", None) or "ascii"
                f.write(body.encode(enc, "replace").decode(enc))
            f.flush()
        except BrokenPipeError:
            console.on_broken_pipe()


echo_line = _StreamEcho()


#: node output that is known noise on the terminal (kept in the node logs): torch's c10d warning when a reverse
#: lookup of the peer fails at once (network namespaces have no resolver), harmless
TERMINAL_NOISE = ("The hostname of the client socket cannot be retrieved",)


def is_terminal_noise(line: str) -> bool:
    """Whether a streamed ``[node i] ...`` line is noise on the terminal: empty after its tag, or known harmless
    (:data:`TERMINAL_NOISE`).  Node logs keep every line; only the terminal leaves these out."""
    m = re.match(r"\[node \d+\]\s?(.*)\Z", line.rstrip("\r\n"), re.S)
    if m is None:
        return False
    rest = m.group(1)
    return not rest.strip() or any(n in rest for n in TERMINAL_NOISE)


class _NodeStreamEcho(_StreamEcho):
    """:data:`echo_line` for a run's stream, minus terminal noise (:func:`is_terminal_noise`), line by line or in
    blocks (the block path checks for noise with substring scans first, so clean blocks cost nothing extra)."""

    def __call__(self, line: str) -> None:
        if not is_terminal_noise(line):
            super().__call__(line)

    def block(self, prefix: str, text: str) -> None:
        if "\n\n" in text or text.startswith("\n") or any(n in text for n in TERMINAL_NOISE) \
                or re.search(r"^[ \t\r]*$", text.rstrip("\n"), re.M):
            kept = [ln for ln in text.split("\n")[: -1 if text.endswith("\n") else None]
                    if ln.strip() and not any(n in ln for n in TERMINAL_NOISE)]
            if not kept:
                return
            text = "\n".join(kept) + "\n"
        super().block(prefix, text)


echo_node_line = _NodeStreamEcho()


class Wrapped:
    """A table cell of plain text wrapped by :func:`wrap_words` at the width the table gives it (rich's own wrap
    can leave one word alone on the last line of a cell)."""

    def __init__(self, text: str, style: str = "") -> None:
        self.text = text
        self.style = style

    def __rich_measure__(self, console: Any, options: Any) -> Any:
        from rich.cells import cell_len
        from rich.measure import Measurement

        words = [p[a:b] for p in (" ".join(q.split()) for q in self.text.split("\n")) for a, b in _tokens(p)] or [""]
        return Measurement(max(cell_len(w) for w in words),
                           max(cell_len(" ".join(p.split())) for p in self.text.split("\n")))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        yield Text("\n".join(wrap_words(self.text, options.max_width)), style=self.style)


def wrap_text(text: Any, width: int, keep: "tuple[str, ...] | list[str]" = ()) -> Any:
    """``text`` (a rich ``Text``) wrapped by :func:`wrap_line_spans` line by line, styles kept; a ``Text``."""
    from rich.text import Text

    plain = text.plain
    out: list[Any] = []
    at = 0
    for line in plain.split("\n"):
        seg = text[at:at + len(line)]
        at += len(line) + 1
        hang = _hang(line, width)
        spans = wrap_line_spans(line, width, keep, hang)
        if len(spans) == 1 and spans[0] == (0, len(line)):
            out.append(seg)
            continue
        for n, (a, b) in enumerate(spans):
            piece = seg[a:b]
            out.append(piece if n == 0 else Text(" " * hang) + piece)
    result = Text("\n").join(out)
    result.end = text.end
    return result


def drop_empty_columns(table: Any) -> Any:
    """``table`` (a rich ``Table``) without the columns whose every cell is empty (``mem`` for a CPU-only job);
    returns it."""
    def empty(cell: Any) -> bool:
        return isinstance(cell, str) and not cell.strip()

    table.columns[:] = [c for c in table.columns if not all(empty(x) for x in c._cells)]
    for i, c in enumerate(table.columns):  # rich pads the first/last column by this index
        c._index = i
    return table


def print_table(table: Any, *, wide: bool = False, out: "Console | None" = None) -> None:
    """Print ``table`` on ``out`` (default: stdout's console) with no cell ever cut: when even its narrowest
    layout (each column at its longest word) is wider than the terminal, or ``wide`` is set (the user asked for
    every column: nothing squeezed, each column at its natural width), the table is printed wider than the
    terminal rather than cropping values (the terminal may then wrap the lines)."""
    from rich.measure import Measurement

    c = out or console
    m = Measurement.get(c, c.options.update_width(NO_WRAP_WIDTH), table)
    need = m.maximum if wide else m.minimum
    if need <= c.width:
        c.print(table)
        return
    saved = c._width
    c.width = need
    try:
        c.print(table)
    finally:
        c._width = saved
