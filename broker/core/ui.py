"""Console helpers (rich): one stdout console, one stderr console, JSON output."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from rich.console import Console


#: the prose width under ``BROKER_NO_WRAP`` (no line is that long)
NO_WRAP_WIDTH = 1_000_000


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


#: The version of every ``--json`` output's shape (the top-level ``schema_version`` key of each object printed);
#: raised when a key is removed or changes meaning (adding keys does not raise it).
JSON_SCHEMA_VERSION = 1


def json_payload(data: Any) -> Any:
    """``data`` with ``schema_version`` first when it is a dict (kept when the dict already has one); else as is."""
    if isinstance(data, dict):
        return {"schema_version": data.get("schema_version", JSON_SCHEMA_VERSION),
                **{k: v for k, v in data.items() if k != "schema_version"}}
    return data


def print_json(data: Any, *, indent: int | None = 2) -> None:
    """Print ``data`` as JSON on stdout: pydantic models dumped, broker's dataclass values as dicts with datetimes
    in ISO 8601 as pydantic writes them (:func:`broker.core.model.to_json`: UTC as ``Z``), other datetimes
    ``isoformat()``, anything else as ``str``; a dict gets ``schema_version`` (:data:`JSON_SCHEMA_VERSION`) as its
    first key.  ``indent`` None: one line (streams)."""
    import dataclasses

    def default(o: Any) -> Any:
        if hasattr(o, "model_dump"):
            return o.model_dump(mode="json")
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            from broker.core.model import to_json

            return to_json(o)
        if isinstance(o, datetime):
            return o.isoformat()
        return str(o)

    print(json.dumps(json_payload(data), default=default, indent=indent), flush=indent is None)


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


#: prefixes of broker's own lines among the streamed ones (wrapped as prose); every other line is a node's log
PROSE_TAGS = ("[broker] ", "[preflight] ", "[slurm] ")


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


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` wrapped to ``width`` cells at spaces (never inside the pieces :func:`_tokens` keeps whole), each
    ``\\n`` kept as a line break, and no paragraph ending in one lone word (a widow like ``h`` of ``0.99 h``): the
    line before gives its last word when it has three or more and the pair fits.  A word wider than ``width`` keeps
    a line of its own (the table folds it).  :func:`wrap_line_spans` without a hanging indent, on each paragraph
    with its whitespace collapsed."""
    out: list[str] = []
    for para in text.split("\n"):
        para = " ".join(para.split())
        out += [para[a:b] for a, b in wrap_line_spans(para, width, hang=0)]
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

        words = [p[a:b] for p in (" ".join(q.split()) for q in self.text.split("\n")) for a, b in _tokens(p)] or [""]
        return Measurement(max(cell_len(w) for w in words),
                           max(cell_len(" ".join(p.split())) for p in self.text.split("\n")))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        yield Text("\n".join(wrap_words(self.text, options.max_width)), style=self.style)


#: units kept on the line of their number ("1.00 h", "358 B", "16 GiB")
_UNITS = r"(?:h|s|ms|min|B|kB|MB|GB|GiB|TB|G|%)[,;.)]?"


def _tokens(plain: str, keep: "tuple[str, ...] | list[str]" = ()) -> list[tuple[int, int]]:
    """(start, end) of the unbreakable pieces of one line: runs of non-spaces, where a `backticked` command and each
    substring in ``keep`` (a command, a path with spaces) count as one piece."""
    import re

    spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", plain)]
    whole: list[tuple[int, int]] = []
    for m in re.finditer(r"`[^`\n]+`", plain):
        whole.append((m.start(), m.end()))
    for k in keep:
        if k and " " in k.strip():
            at = plain.find(k)
            while at >= 0:
                whole.append((at, at + len(k)))
                at = plain.find(k, at + len(k))
    whole += _commands_in(plain, spans)
    whole += _list_items(plain)
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out:
            pa, pb = out[-1]
            if any(w0 < b and a < w1 and w0 < pb and pa < w1 for w0, w1 in whole):  # both touch one whole span
                out[-1] = (pa, b)
                continue
            if re.fullmatch(r"[$~]?[\d.,]+", plain[pa:pb]) and re.fullmatch(_UNITS, plain[a:b]):  # "1.00 h"
                out[-1] = (pa, b)
                continue
        out.append((a, b))
    return out


#: the longest list item (cells) kept on one line, and its most words: ``A100 PCIE``, ``RTX 3090``
LIST_ITEM_CELLS = 24
LIST_ITEM_WORDS = 3


def _list_items(plain: str) -> list[tuple[int, int]]:
    """(start, end) of the short items of comma-separated lists (``models: A100 PCIE, RTX 3090, H100 SXM``): an
    item of two or three words, at most :data:`LIST_ITEM_CELLS` long, between ``, `` (or a list's ``: ``/``(``
    start) and ``,``/``;``/``)``/the end, is one unbreakable piece, so a model name never splits."""
    import re

    out: list[tuple[int, int]] = []
    for m in re.finditer(r"(?:(?<=, )|(?<=: )|(?<=\())([^,;:()\s][^,;:()]*?)(?=,|;|\)|$)", plain):
        item = m.group(1)
        words = item.split()
        if not 2 <= len(words) <= LIST_ITEM_WORDS or len(item) > LIST_ITEM_CELLS:
            continue
        after, before = plain[m.end():m.end() + 1], plain[max(0, m.start() - 2):m.start()]
        if after == "," or before == ", ":  # part of a list, not a clause after a colon
            out.append((m.start(), m.end()))
    return out


def _commands_in(plain: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) of unquoted ``broker ...`` commands in ``plain`` (``then broker run RECIPE.yaml --provider
    vast``): ``broker``, up to two subcommand words, then the tokens that look like arguments (options, the value
    after an option, paths, files, ``KEY=value``, placeholders in capitals, numbers); a token ending in ``,;)`` ends
    the command."""
    import re

    out: list[tuple[int, int]] = []
    words = [plain[a:b] for a, b in spans]
    i = 0
    while i < len(spans):
        if words[i] != "broker" or i + 1 >= len(spans):
            i += 1
            continue
        j, subs = i + 1, 0
        while j < len(spans) and subs < 2 and re.fullmatch(r"[a-z][a-z0-9-]*", words[j]):
            j, subs = j + 1, subs + 1
        if subs == 0:
            i += 1
            continue
        prev_opt = False
        while j < len(spans) and not words[j - 1].endswith((",", ";", ")")):
            w = words[j]
            if w.startswith("-") or prev_opt or re.search(r"[/.=~$*]", w) or re.fullmatch(r"[A-Z0-9_.]+", w) \
                    or re.fullmatch(r"[\d.]+[,;)]?", w):
                prev_opt = w.startswith("--") and "=" not in w
                j += 1
            else:
                break
        if j - i > 1:
            out.append((spans[i][0], spans[j - 1][1]))
        i = j
    return out


def hanging_indent(plain: str) -> int:
    """The indent of a wrapped line's continuation: under the text after a leading ``->`` / ``-`` / ``*`` marker,
    else two more than the line's own indent (after a :data:`PROSE_TAGS` tag such as ``[preflight]``)."""
    import re

    tag = next((len(t) for t in PROSE_TAGS if plain.startswith(t)), 0)
    m = re.match(r"( *)(?:(->|-|\*|•) )?", plain[tag:])
    assert m is not None
    return tag + (m.end() if m.group(2) else len(m.group(1)) + 2)


def _hang(plain: str, width: int) -> int:
    """:func:`hanging_indent`, or none when it would take half the width or more."""
    hang = hanging_indent(plain)
    return 0 if hang * 2 > width else hang


def wrap_line_spans(plain: str, width: int, keep: "tuple[str, ...] | list[str]" = (),
                    hang: int | None = None) -> list[tuple[int, int]]:
    """Where one line (no ``\n``) breaks: (start, end) of each output line in ``plain`` (the first starts at 0 to
    keep the indent; continuation lines get ``hang`` cells of indent, default :func:`hanging_indent`).  Greedy on
    :func:`_tokens`, then no lone last piece when the line before has three or more and the pair fits; a piece
    wider than the width keeps a line of its own."""
    from rich.cells import cell_len

    if cell_len(plain) <= width:
        return [(0, len(plain))]
    toks = _tokens(plain, keep)
    if not toks:
        return [(0, len(plain))]
    if hang is None:
        hang = _hang(plain, width)
    lines: list[list[int]] = []

    def width_of(idx: list[int], first: bool) -> int:
        a = 0 if first else toks[idx[0]][0]
        return (0 if first else hang) + cell_len(plain[a:toks[idx[-1]][1]])

    for i in range(len(toks)):
        if lines and width_of(lines[-1] + [i], len(lines) == 1) <= width:
            lines[-1].append(i)
        else:
            lines.append([i])
    # the pair goes on a continuation line (hanging indent), whichever line it came from
    lone = len(lines) >= 2 and len(lines[-1]) == 1 and " " not in plain[slice(*toks[lines[-1][0]])]
    if lone and len(lines[-2]) >= 3 and width_of([lines[-2][-1], lines[-1][0]], False) <= width:
        lines[-1].insert(0, lines[-2].pop())
    return [(0 if n == 0 else toks[ln[0]][0], toks[ln[-1]][1]) for n, ln in enumerate(lines)]


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


def wrap_plain(text: str, width: int, keep: "tuple[str, ...] | list[str]" = ()) -> list[str]:
    """Plain ``text`` wrapped as :func:`wrap_text` does (for messages not printed through a console)."""
    out: list[str] = []
    for line in text.split("\n"):
        hang = _hang(line, width)
        spans = wrap_line_spans(line, width, keep, hang)
        out += [line[a:b] if n == 0 else " " * hang + line[a:b] for n, (a, b) in enumerate(spans)]
    return out


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
