"""Tables and prose as rich prints them into a pipe or file, without rich (its import costs ~60 ms of a start).

Only the layout broker's plan tables use is built here: ``box.SIMPLE_HEAD``, ``pad_edge=False``,
``collapse_padding=True``, a left-justified title (already wrapped as prose), columns with ``justify`` (left /
right), ``no_wrap``, ``overflow`` (fold / ellipsis / crop) and ``max_width``, cells of markup text or of
:class:`broker.core.ui.Wrapped`-style word-wrapped text.  Each step follows rich 15's code of the same name
(``Table._calculate_column_widths``, ``_collapse_widths``, ``ratio_reduce``, ``Measurement``, ``Text.wrap``,
``divide_line``, ``Lines.justify``, ``Text.truncate``) and :class:`broker.core.ui._RStripped` (no trailing
blanks); ``tests/cli/test_plain_plan.py`` renders the same tables both ways and compares them byte for byte.

What is laid out must be printable ASCII (and newlines): :func:`plain_text_ok` says so, and callers hand anything
else (wide characters, tabs, control characters) to rich.  :func:`stream_is_plain` says whether rich would treat a
stream as a plain file (no terminal, no forced colour, a UTF-8 encoding) and :func:`console_width` gives the width
rich would use there.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TextIO

#: rich's tag pattern (rich.markup.RE_TAGS): optional backslashes, then ``[tag]``
_RE_TAGS = re.compile(r"((\\*)\[([a-z#/@][^[]*?)])")
#: printable ASCII and newlines: what this module lays out exactly as rich does
_PLAIN = re.compile(r"[\x20-\x7e\n]*\Z")


def markup_plain(markup: str) -> str:
    """The text rich shows for console markup ``markup`` (rich.markup.render's plain text): tags dropped,
    ``\\[`` escapes and doubled backslashes before a tag resolved as rich resolves them."""
    if "[" not in markup:
        return markup
    out: list[str] = []
    position = 0
    for m in _RE_TAGS.finditer(markup):
        full, escapes, _tag = m.groups()
        start, end = m.span()
        if start > position:
            out.append(markup[position:start].replace("\\[", "["))
        if escapes:
            backslashes, escaped = divmod(len(escapes), 2)
            if backslashes:
                out.append("\\" * backslashes)
            if escaped:
                out.append(full[len(escapes):].replace("\\[", "["))
                position = end
                continue
        position = end
    if position < len(markup):
        out.append(markup[position:].replace("\\[", "["))
    return "".join(out)


_RE_ESCAPE = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def escape(text: str) -> str:
    """``text`` with what looks like markup escaped: rich.markup.escape, without importing rich."""
    out = _RE_ESCAPE.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", text)
    if out.endswith("\\") and not out.endswith("\\\\"):
        return out + "\\"
    return out


def plain_text_ok(text: str) -> bool:
    """Whether ``text`` is printable ASCII and newlines only (laid out here exactly as rich does)."""
    return _PLAIN.match(text) is not None


def stream_is_plain(stream: Any, environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Whether rich's console would write ``stream`` as a plain file: not a terminal (``isatty`` false, and neither
    ``TTY_COMPATIBLE`` nor ``FORCE_COLOR`` set), not Jupyter, not legacy Windows, a UTF-8 encoding (rich draws the
    table rules with ``─`` there)."""
    env = os.environ if environ is None else environ
    if "TTY_COMPATIBLE" in env and env["TTY_COMPATIBLE"] in ("0", "1") or env.get("FORCE_COLOR") is not None:
        return False  # rich's own decision then; leave it to rich
    import builtins

    if sys.platform == "win32" or hasattr(builtins, "get_ipython") or \
            str(getattr(sys.stdin, "__module__", "") or "").startswith("idlelib"):
        return False
    if stream is None:
        return False
    try:
        if stream.isatty():
            return False
    except (ValueError, AttributeError):
        return False
    enc = (getattr(stream, "encoding", None) or "utf-8").lower()
    return enc.startswith("utf")


def console_width(environ: "os._Environ[str] | dict[str, str] | None" = None) -> int:
    """The width rich gives a console that writes no terminal: ``COLUMNS`` when it is digits, else the size of the
    first of stdin / stdout / stderr that is a terminal, else 80."""
    env = os.environ if environ is None else environ
    columns = env.get("COLUMNS")
    if columns is not None and columns.isdigit():
        return int(columns)
    width = None
    for fd in (0, 1, 2):
        try:
            width = os.get_terminal_size(fd)[0]
        except (AttributeError, ValueError, OSError):
            continue
        break
    return width or 80


# ------------------------------------------------------------------------------------------------ tables
@dataclass
class Column:
    """One column, with rich's ``add_column`` arguments of the same names."""

    header: str = ""
    justify: str = "left"
    no_wrap: bool = False
    overflow: str = "ellipsis"
    max_width: int | None = None
    #: each cell: (markup text, False) or (plain text that is word-wrapped first, True)
    cells: list[tuple[str, bool]] = field(default_factory=list)


@dataclass
class Table:
    """A ``SIMPLE_HEAD`` table with ``pad_edge=False, collapse_padding=True``; ``title`` is plain text (each of
    its lines printed as it is, as rich prints a pre-wrapped title)."""

    title: str | None
    columns: list[Column]

    def add_row(self, *cells: "str | tuple[str, bool]") -> None:
        for c, v in zip(self.columns, cells):
            c.cells.append(v if isinstance(v, tuple) else (v, False))


def _norm(lo: int, hi: int) -> tuple[int, int]:
    lo = min(max(0, lo), hi)
    return max(0, lo), max(0, max(lo, hi))


@lru_cache(maxsize=4096)
def _natural(text: str, wrapped: bool) -> tuple[int, int]:
    """(longest unbreakable piece, longest line) of one cell's content, before any width limit: a table measures
    each cell at several widths while it fits its columns, and the pieces never change."""
    if wrapped:
        from broker.core.prose import _tokens

        paras = [" ".join(q.split()) for q in text.split("\n")]
        words = [p[a:b] for p in paras for a, b in _tokens(p)] or [""]
        return max(len(w) for w in words), max(len(p) for p in paras)
    lines = text.splitlines()
    hi = max((len(x) for x in lines), default=0)
    words = text.split()
    return max((len(w) for w in words), default=hi), hi


def _measure_text(text: str, wrapped: bool, max_width: int) -> tuple[int, int]:
    """rich's ``Measurement.get`` of one cell's content (a Text, or a Wrapped cell)."""
    if max_width < 1:
        return 0, 0
    lo, hi = _norm(*_natural(text, wrapped))
    lo, hi = min(lo, max_width), min(hi, max_width)
    if hi < 1:
        return 0, 0
    return _norm(lo, hi)


def _pads(table: Table, index: int) -> tuple[int, int]:
    """(left, right) padding of column ``index``'s cells: collapsed padding, no edge padding."""
    return 0, (0 if index == len(table.columns) - 1 else 1)


def _measure_column(table: Table, index: int, max_width: int) -> tuple[int, int]:
    if max_width < 1:
        return 0, 0
    col = table.columns[index]
    left, right = _pads(table, index)
    pad = left + right
    mins, maxs = [], []
    for text, wrapped in [(markup_plain(col.header), False)] + [
            (t if w else markup_plain(t), w) for t, w in col.cells]:
        if max_width - pad < 1:
            lo, hi = max_width, max_width
        else:
            lo, hi = _measure_text(text, wrapped, max_width)
            lo, hi = min(lo + pad, max_width), min(hi + pad, max_width)
        lo, hi = _norm(lo, hi)  # Measurement.get's normalize of the padded cell
        if hi < 1:
            lo, hi = 0, 0
        mins.append(lo)
        maxs.append(hi)
    lo, hi = (max(mins) if mins else 1), (max(maxs) if maxs else max_width)
    lo, hi = min(lo, max_width), min(hi, max_width)
    if col.max_width is not None:
        lo, hi = min(lo, col.max_width + pad), min(hi, col.max_width + pad)
    return lo, hi


def _ratio_reduce(total: int, ratios: list[int], maximums: list[int], values: list[int]) -> list[int]:
    ratios = [r if m else 0 for r, m in zip(ratios, maximums)]
    total_ratio = sum(ratios)
    if not total_ratio:
        return values[:]
    remaining = total
    out = []
    for ratio, maximum, value in zip(ratios, maximums, values):
        if ratio and total_ratio > 0:
            d = min(maximum, round(ratio * remaining / total_ratio))
            out.append(value - d)
            remaining -= d
            total_ratio -= ratio
        else:
            out.append(value)
    return out


def _collapse(widths: list[int], wrapable: list[bool], max_width: int) -> list[int]:
    total = sum(widths)
    excess = total - max_width
    if any(wrapable):
        while total and excess > 0:
            top = max(w for w, ok in zip(widths, wrapable) if ok)
            second = max(w if ok and w != top else 0 for w, ok in zip(widths, wrapable))
            diff = top - second
            ratios = [1 if (w == top and ok) else 0 for w, ok in zip(widths, wrapable)]
            if not any(ratios) or not diff:
                break
            widths = _ratio_reduce(excess, ratios, [min(excess, diff)] * len(widths), widths)
            total = sum(widths)
            excess = total - max_width
    return widths


def _extra(table: Table) -> int:
    return 2 + len(table.columns) - 1


def column_widths(table: Table, max_width: int) -> list[int]:
    """Each column's width (padding included, borders not) for a table ``max_width`` cells wide at most."""
    inner = max_width - _extra(table)
    ranges = [_measure_column(table, i, inner) for i in range(len(table.columns))]
    widths = [hi or 1 for _, hi in ranges]
    if sum(widths) > inner:
        widths = _collapse(widths, [not c.no_wrap for c in table.columns], inner)
        if sum(widths) > inner:
            widths = _ratio_reduce(sum(widths) - inner, [1] * len(widths), widths, widths)
        widths = [_measure_column(table, i, w)[1] or 0 for i, w in enumerate(widths)]
    return widths


def measure(table: Table, max_width: int) -> tuple[int, int]:
    """rich's ``Measurement.get`` of the whole table at ``max_width``: (narrowest, natural) width."""
    if max_width < 1:
        return 0, 0
    inner_total = sum(column_widths(table, max_width))
    ms = [_measure_column(table, i, inner_total) for i in range(len(table.columns))]
    lo, hi = sum(m[0] for m in ms) + _extra(table), sum(m[1] for m in ms) + _extra(table)
    lo, hi = _norm(lo, hi)
    lo, hi = min(lo, max_width), min(hi, max_width)
    if hi < 1:
        return 0, 0
    return _norm(lo, hi)


def _set_cell_size(text: str, width: int) -> str:
    return text[:width] if len(text) >= width else text + " " * (width - len(text))


def _truncate(line: str, width: int, overflow: str, pad: bool = False) -> str:
    length = len(line)
    if length > width:
        line = _set_cell_size(line, width - 1) + "…" if overflow == "ellipsis" else _set_cell_size(line, width)
    if pad and length < width:
        line = line + " " * (width - length)
    return line


def _divide_line(text: str, width: int, fold: bool) -> list[int]:
    """rich._wrap.divide_line for printable ASCII."""
    breaks: list[int] = []
    offset = 0
    for m in re.finditer(r"\s*\S+\s*", text):
        start, word = m.start(), m.group(0)
        word_len = len(word.rstrip())
        if width - offset >= word_len:
            offset += len(word)
        elif word_len > width:
            if fold:
                pieces = [word[i:i + width] for i in range(0, len(word), width)] or [word]
                for k, piece in enumerate(pieces):
                    if start:
                        breaks.append(start)
                    if k == len(pieces) - 1:
                        offset = len(piece)
                    else:
                        start += len(piece)
            else:
                if start:
                    breaks.append(start)
                offset = len(word)
        elif offset and start:
            breaks.append(start)
            offset = len(word)
    return breaks


def _wrap(text: str, width: int, justify: str, overflow: str, no_wrap: bool) -> list[str]:
    """rich's ``Text.wrap`` (then ``render_lines``' crop and pad) of plain text: lines exactly ``width`` long."""
    out: list[str] = []
    for line in text.split("\n"):
        if no_wrap:
            lines = [line]
        else:
            cuts = [0, *_divide_line(line, width, overflow == "fold"), len(line)]
            lines = [line[a:b] for a, b in zip(cuts, cuts[1:])] if len(cuts) > 2 else [line]
            lines = [_rstrip_end(x, width) for x in lines]
        for x in lines:
            if justify == "right":
                x = x.rstrip()
                x = _truncate(x, width, overflow)
                x = " " * (width - len(x)) + x
            else:
                x = _truncate(x, width, overflow, pad=True)
            x = _truncate(x, width, overflow)
            out.append(_set_cell_size(x, width))
    return out


def _rstrip_end(line: str, size: int) -> str:
    if len(line) > size:
        ws = len(line) - len(line.rstrip())
        if ws:
            return line[:len(line) - min(ws, len(line) - size)]
    return line


def render(table: Table, width: int) -> list[str]:
    """The table's lines as rich prints it ``width`` cells wide into a file (each line without trailing blanks)."""
    from broker.core.prose import wrap_words

    widths = column_widths(table, width)
    lines: list[str] = []
    if table.title:
        lines += [x.rstrip() for x in table.title.split("\n")]
    lines.append("")  # the box's top edge: blanks only
    rows: list[list[tuple[str, bool]]] = [[(c.header, False) for c in table.columns]]
    rows += [list(r) for r in zip(*(c.cells for c in table.columns))]
    for n, row in enumerate(rows):
        cells = []
        for i, ((text, wrapped), w, col) in enumerate(zip(row, widths, table.columns)):
            _, right = _pads(table, i)
            inner = w - right
            if inner < 1:  # rich renders no line into a column this narrow
                body = []
            else:
                plain = "\n".join(wrap_words(text, inner)) if wrapped else markup_plain(text)
                body = _wrap(plain, inner, col.justify, col.overflow, col.no_wrap)
            cells.append([x + " " * right for x in body])
        height = max([1] + [len(c) for c in cells])
        for c, w in zip(cells, widths):
            blank = [" " * w] * (height - len(c))
            c[:] = blank + c if n == 0 else c + blank  # the header sits at the bottom, cells at the top
            c[:] = [_set_cell_size(x, w) for x in c]  # rich's Segment.set_shape
        for k in range(height):
            lines.append((" " + " ".join(c[k] for c in cells) + " ").rstrip())
        if n == 0:
            lines.append((" " + "─".join("─" * w for w in widths)).rstrip())
    lines.append("")  # the bottom edge
    return lines


def drop_empty_columns(table: Table) -> Table:
    """:func:`broker.core.ui.drop_empty_columns` of a plain table: the columns whose every cell is blank go."""
    table.columns[:] = [c for c in table.columns if not all(not w and not t.strip() for t, w in c.cells)]
    return table


def table_text(table: Table, console_w: int, prose_w: int, *, wide: bool = False) -> str:
    """:func:`broker.core.ui.print_table` into a file: the table at the console's width, or wider (its narrowest
    layout, or with ``wide`` its natural one) when it does not fit; the title wrapped as prose at the width the
    table is printed at (``prose_w``, or that wider width)."""
    from broker.core.prose import NO_WRAP_WIDTH, wrap_plain

    lo, hi = measure(table, NO_WRAP_WIDTH)
    need = hi if wide else lo
    w = console_w if need <= console_w else need
    if prose_w != NO_WRAP_WIDTH and need > console_w:
        prose_w = w
    t = Table(title="\n".join(wrap_plain(markup_plain(table.title), prose_w)) if table.title else table.title,
              columns=table.columns)
    return "\n".join(render(t, w)) + "\n"


def write(stream: TextIO, text: str) -> None:
    """Write ``text`` as rich's console does into a file; a closed pipe ends the command as
    :meth:`broker.core.ui._Console.on_broken_pipe` does (quiet, exit 141)."""
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        from broker.core.errors import OutputClosed

        try:
            fd = stream.fileno()
        except (OSError, ValueError, AttributeError):
            fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        raise OutputClosed() from None
