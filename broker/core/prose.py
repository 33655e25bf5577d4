"""Plain-text helpers shared by every output path, without rich: money and hour formats, JSON output, and prose
wrapping at word boundaries (never inside a command, URL or path).

:mod:`broker.core.ui` (rich's consoles) re-exports all of them; this module exists so that a command printing into a
pipe (``broker plan``'s plain renderer, :mod:`broker.core.plaintable`) can wrap and format without importing rich
(~60 ms of a start).
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any


def cell_len(text: str) -> int:
    """Terminal cells ``text`` takes, as :func:`rich.cells.cell_len` counts them: printable ASCII is one cell a
    character (counted here); anything else is counted by rich (imported then)."""
    if text.isascii() and text.isprintable():
        return len(text)
    from rich.cells import cell_len as rich_cell_len

    return rich_cell_len(text)


#: the prose width under ``BROKER_NO_WRAP`` (no line is that long)
NO_WRAP_WIDTH = 1_000_000

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


def _fixed(x: float, places: int) -> str:
    """``x`` in dollars with exactly ``places`` decimals and thousands commas, the sign before the ``$``;
    an amount that rounds to zero shows no sign (``$0.00``, never ``-$0.00``)."""
    text = f"{abs(x):,.{places}f}"
    return f"-${text}" if x < 0 and text.strip("0.,") else f"${text}"


def usd(x: float | None, versus: float | None = None, *, places: int | None = None,
        up_to: int | None = None) -> str:
    """Money as broker shows it everywhere (the one formatter; :func:`usd_parts` splits a total with it).

    Rules, in order:

    * None (or NaN / infinity) is unknown: ``-``, never ``$0.00``.
    * ``places``: exactly that many decimals (``usd(0.0029, places=4)`` = ``$0.0029``).
    * Zero is ``$0.00``; a negative amount has its sign first (``-$1.50``); thousands take commas (``$1,234.50``).
    * To the cent (``$1.23``), except below a cent, where 4 decimals keep a tiny rate readable (``$0.0044``; an
      amount under 1/100 cent reads ``$0.0000``: every money column is 2 or 4 decimals wide).
    * ``versus`` (a budget beside it): 4 decimals when ``x`` differs from ``versus`` but both would show the same
      cents (``$5.0029`` beside ``$5.00``, never ``$5.00 > $5.00``).
    * ``up_to`` (a price per hour as the provider states it): up to that many decimals where the amount has them,
      at least the cent (``usd(1.006, up_to=4)`` = ``$1.006``, ``usd(0.6, up_to=4)`` = ``$0.60``).
    """
    import math

    if x is None or not math.isfinite(x):
        return "-"
    if places is not None:
        return _fixed(x, places)
    if 0 < abs(x) < 0.01 or (versus is not None and x != versus and _fixed(x, 2) == _fixed(versus, 2)):
        return _fixed(x, 4)
    if up_to is not None and up_to > 2:
        text = _fixed(x, up_to).rstrip("0")
        return text + "0" * (2 - len(text.rsplit(".", 1)[1]))
    return _fixed(x, 2)


def cents_up(x: float) -> float:
    """The smallest whole-cent amount at or above ``x`` USD (what a hint may ask a budget to be raised to: a
    budget "of at least $7.20" must cover $7.2001); float noise (7.2 x 100 = 720.0000000000001) does not round
    a whole cent up."""
    return math.ceil(round(x * 100, 6)) / 100


def usd_parts(total: float, parts: "list[float]") -> tuple[str, list[str]]:
    """``total`` and its ``parts`` (what each attempt or resource of a run cost) as :func:`usd` strings that add up
    as printed: :func:`usd`'s own where the printed parts sum to the printed total, else 4 decimals for all of
    them, the parts rounded so that they sum to the rounded total (largest remainder: $0.0083 + $0.0083 beside
    $0.0167 becomes $0.0084 + $0.0083).  $0.01 + $0.01 beside a $0.03 total reads as an error.  Parts that do not
    sum to ``total`` (beyond float rounding) are shown each to 4 decimals: no rounding can make them add up."""
    from decimal import Decimal

    shown = [usd(x) for x in parts]
    if not parts:
        return usd(total), shown

    def value(text: str) -> Decimal:
        return Decimal(text.replace("$", "").replace(",", ""))

    if sum(value(x) for x in shown) == value(usd(total)):
        return usd(total), shown
    q = 10_000
    units = [x * q for x in parts]
    whole, floors = round(total * q), [math.floor(u) for u in units]
    rest = whole - sum(floors)
    if abs(sum(units) - total * q) < 1 and 0 <= rest <= len(floors):
        for i in sorted(range(len(units)), key=lambda k: units[k] - floors[k], reverse=True)[:rest]:
            floors[i] += 1
        return _fixed(whole / q, 4), [_fixed(v / q, 4) for v in floors]
    return _fixed(total, 4), [_fixed(x, 4) for x in parts]


def hours(h: float | None) -> str:
    if h is None:
        return "-"
    if h == float("inf"):
        return "unlimited"
    return f"{h:.2f} h" if h < 100 else f"{h:,.0f} h"


#: prefixes of broker's own lines among the streamed ones (wrapped as prose); every other line is a node's log
PROSE_TAGS = ("[broker] ", "[preflight] ", "[slurm] ")

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


def wrap_plain(text: str, width: int, keep: "tuple[str, ...] | list[str]" = ()) -> list[str]:
    """Plain ``text`` wrapped as :func:`wrap_text` does (for messages not printed through a console)."""
    out: list[str] = []
    for line in text.split("\n"):
        hang = _hang(line, width)
        spans = wrap_line_spans(line, width, keep, hang)
        out += [line[a:b] if n == 0 else " " * hang + line[a:b] for n, (a, b) in enumerate(spans)]
    return out
