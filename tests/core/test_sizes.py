"""Size limits of the source: no function over 100 lines, no module over 800 lines.

Long functions hid whole commands from grep and tests; long modules mixed several concerns. Nested functions count
on their own (a command body inside a registering closure is still a long function). Lines are physical lines
(`wc -l`), docstrings and comments included: they are read too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 800


def _sources() -> list[Path]:
    return sorted([*ROOT.joinpath("broker").rglob("*.py"), *ROOT.joinpath("providers").rglob("*.py")])


def long_functions(src: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `src` longer than `limit` lines, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append((node.name, n))
    return out


def test_the_rule_sees_a_long_nested_function():
    body = "\n".join(f"        x{i} = {i}" for i in range(120))
    src = f"def register(app):\n    def cmd():\n{body}\n    return cmd\n"
    names = [name for name, _ in long_functions(src)]
    assert names == ["register", "cmd"]


def test_no_function_is_over_100_lines():
    found = [f"{p.relative_to(ROOT)}: {name} ({n} lines)" for p in _sources()
             for name, n in long_functions(p.read_text(encoding="utf-8"))]
    assert not found, "split these by meaning:\n" + "\n".join(found)


def test_no_module_is_over_800_lines():
    found = [f"{p.relative_to(ROOT)}: {n} lines" for p in _sources()
             if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not found, "split these modules:\n" + "\n".join(found)
