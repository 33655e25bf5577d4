"""Reading a recipe file as YAML, strictly and within limits: the size cap, a loader that refuses duplicate keys,
tags and alias bombs, text that is not YAML, UTF-16/32 files, a folder given for a file; errors with the file, the
line and a caret (:class:`RecipeError`, exit code 2).  :mod:`broker.core.recipe` validates what this returns."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from broker.core import limits
from broker.core.errors import BadInput


class RecipeError(BadInput):
    """A recipe is wrong; the message names file, line, field and the fix."""


MAX_RECIPE_BYTES = 1 << 20


class _YamlLimit(Exception):
    """A recipe's YAML breaks one of broker's structural rules (duplicate key, alias bound, nesting depth)."""

    def __init__(self, line: int | None, message: str, hint: str):
        super().__init__(message)
        self.line, self.message, self.hint = line, message, hint


def _strict_loader() -> type:
    """A SafeLoader that rejects duplicate keys, bounds aliases and nesting depth (built lazily: yaml is imported
    only when a recipe is read)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def __init__(self, stream: str):
            super().__init__(stream)
            self._aliases = 0
            self._depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self._aliases += 1
                if self._aliases > limits.MAX_YAML_ALIASES:
                    mark = self.peek_event().start_mark
                    raise _YamlLimit(mark.line + 1, f"more than {limits.MAX_YAML_ALIASES} YAML aliases (*name)",
                                     "write the values out; a recipe needs few or no aliases")
            self._depth += 1
            try:
                if self._depth > limits.MAX_YAML_DEPTH:
                    mark = self.peek_event().start_mark
                    raise _YamlLimit(mark.line + 1, f"lists/mappings nested more than {limits.MAX_YAML_DEPTH} "
                                     "levels deep", "a recipe's values are flat lists and mappings")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for k, _ in node.value:
                    if k.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = k.value if isinstance(k, yaml.ScalarNode) else id(k)
                    if key in seen:
                        raise _YamlLimit(k.start_mark.line + 1, f"key {k.value!r} appears twice (first on line "
                                         f"{seen[key]})", "keep one of them: YAML would silently use the last")
                    seen[key] = k.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _expanded_size(node: Any, memo: dict[int, int]) -> int:
    """Number of nodes of the tree once aliases are expanded (memoized: an alias bomb is counted, not built)."""
    import yaml

    got = memo.get(id(node))
    if got is not None:
        return got
    memo[id(node)] = 1  # a cycle (recursive alias) counts once
    n = 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            n += _expanded_size(k, memo) + _expanded_size(v, memo)
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            n += _expanded_size(v, memo)
    n = min(n, limits.MAX_YAML_NODES + 1)
    memo[id(node)] = n
    return n


#: a character YAML does not allow in a document (its ``printable`` set, YAML 1.1 section 5.1): control characters
#: such as NUL; PyYAML's reader would otherwise fail with an exception that names no line
_NOT_YAML_TEXT = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _caret(code: int) -> str:
    """How ``cat -A`` shows the control character ``code``: ^@ .. ^_ for 0x00-0x1f (0x1b is ^[), ^? for 0x7f; "" for
    others (a C1 control is two UTF-8 bytes, which cat -A shows as M- sequences)."""
    if code < 0x20:
        return "^" + chr(code + 0x40)
    if code == 0x7f:
        return "^?"
    return ""


def parse_yaml(text: str, where: str) -> tuple[Any, Any]:
    """(node tree, data) of one YAML document under broker's rules; raises RecipeError naming ``where:line``."""
    import yaml

    bad = _NOT_YAML_TEXT.search(text)
    if bad is not None:
        at = bad.start()
        line = text.count("\n", 0, at) + 1
        col = at - (text.rfind("\n", 0, at) + 1) + 1
        code = ord(bad.group())
        what = "a NUL byte (0x00)" if code == 0 else f"the control character 0x{code:02x}"
        binary = " (all zero bytes: is it a binary or truncated file?)" if not text.strip("\0") else ""
        raise RecipeError(f"{where}:{line}:{col}: {what} at line {line}, column {col}{binary}; a recipe is a YAML "
                          "text file and YAML does not allow control characters",
                          hint="is this the right file? delete that character in a text editor" +
                               (f" (`cat -A` shows it as {_caret(code)})" if _caret(code) else "") +
                               " and re-save the file as UTF-8 text")
    loader = _strict_loader()(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > limits.MAX_YAML_NODES:
            raise _YamlLimit(None, f"the YAML expands to more than {limits.MAX_YAML_NODES} values "
                             "(aliases repeating aliases)", "write the values out; a recipe is small")
        data = loader.construct_document(node) if node is not None else None
    except _YamlLimit as e:
        raise RecipeError(f"{where}" + (f":{e.line}" if e.line else "") + f": {e.message}", hint=e.hint) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise RecipeError(f"{where}{line}: not valid YAML: {getattr(e, 'problem', None) or e}",
                          hint="check indentation and quoting on that line") from None
    except RecursionError:
        raise RecipeError(f"{where}: the YAML is nested too deeply to read",
                          hint="a recipe's values are flat lists and mappings") from None
    finally:
        loader.dispose()
    return node, data


def _line_map(node: Any, path: tuple = (), out: dict | None = None, seen: set | None = None) -> dict[tuple, int]:
    """Map field paths (tuples of keys/indices) to 1-based line numbers from a yaml node tree (aliases once)."""
    import yaml

    out = {} if out is None else out
    seen = set() if seen is None else seen
    if id(node) in seen:
        return out
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            out[path + (key,)] = k.start_mark.line + 1
            _line_map(v, path + (key,), out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out[path + (i,)] = v.start_mark.line + 1
            _line_map(v, path + (i,), out, seen)
    return out


def _fields_of(model: type[BaseModel]) -> list[str]:
    return [n for n in model.model_fields if n != "path"]


def _folder_error(p: Path) -> RecipeError:
    """The error for a folder given as the recipe: the recipes (``*.yaml`` / ``*.yml``) it holds, or that it holds
    none and how to get examples."""
    try:
        found = sorted(f.name for f in p.iterdir() if f.suffix in (".yaml", ".yml") and f.is_file())
    except OSError:
        found = []
    if not found:
        return RecipeError(f"{p}: is a folder and holds no recipe (*.yaml / *.yml)",
                           hint="give the path of a recipe file; `broker init` writes example recipes "
                                "(into ./broker-recipes)")
    if len(found) == 1:
        return RecipeError(f"{p}: is a folder, not a recipe file",
                           hint=f"give the recipe file itself: {p / found[0]}")
    shown = ", ".join(found[:8]) + (f" (and {len(found) - 8} more)" if len(found) > 8 else "")
    return RecipeError(f"{p}: is a folder, not a recipe file; it holds {len(found)} YAML files: {shown}",
                       hint=f"name one of them, e.g. {p / found[0]}")


def _read_text(p: Path) -> str:
    """The recipe file's text; RecipeError for a folder, a missing / unreadable / huge / non-UTF-8 file."""
    if p.is_dir():
        raise _folder_error(p)
    if not p.exists():
        raise RecipeError(f"{p}: no such recipe file",
                          hint="give the path of a .yaml recipe, e.g. recipes/ddp_2node.yaml (`broker init` writes "
                               "the examples)")
    try:
        if p.stat().st_size > MAX_RECIPE_BYTES:
            raise RecipeError(f"{p}: {p.stat().st_size} bytes is too large for a recipe (at most "
                              f"{MAX_RECIPE_BYTES} bytes)", hint="is this the right file? a recipe is a short YAML file")
        raw = p.read_bytes()
    except OSError as e:
        raise RecipeError(f"{p}: cannot read the recipe: {e.strerror or e}",
                          hint="check the path and its permissions") from None
    wide = _utf16_or_32(raw)
    if wide:
        raise RecipeError(f"{p}: {wide} text, not UTF-8; a recipe is a UTF-8 YAML file",
                          hint=f"re-save it as UTF-8 in the editor, or convert it: iconv -f {wide.split()[0]} "
                               f"-t UTF-8 {p} > fixed.yaml")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise RecipeError(f"{p}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); a recipe "
                          "is a UTF-8 YAML file",
                          hint="is this the right file? re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


#: byte-order marks, longest first (the UTF-32 LE mark begins with the UTF-16 LE one)
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def _utf16_or_32(raw: bytes) -> str:
    """"UTF-16 ..." / "UTF-32 ..." when ``raw`` is text in that encoding (a byte-order mark, or, without one, a NUL
    as every other byte of mostly-ASCII text); "" otherwise."""
    for bom, name in _BOMS:
        if raw.startswith(bom):
            return f"{name} (byte-order mark 0x{bom.hex()})"
    head = raw[:512]
    if len(head) >= 4 and b"\0" in head and head.strip(b"\0"):
        for start, name in ((1, "UTF-16LE"), (0, "UTF-16BE")):
            zeros = head[start::2]
            others = head[1 - start::2]
            if zeros.count(0) == len(zeros) and others.count(0) == 0:
                return f"{name} (a NUL byte every other byte, no byte-order mark)"
    return ""
