"""The suite's markers say what each test needs: a test that builds network namespaces is marked ``netns``, so
``-m "not netns"`` really leaves them out (a machine without root or sshd, a quick local pass)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# what builds or needs a namespace cluster: the netns adapter's up(), the shared fixtures, the requirement check
NEEDS_NETNS = re.compile(r"netns\.up\(|netns_hosts|netns_missing\(|missing_requirements\(")


def _marks(src: str, node: ast.AST) -> str:
    return " ".join(ast.get_source_segment(src, d) or "" for d in getattr(node, "decorator_list", []))


def test_every_test_that_builds_network_namespaces_is_marked_netns():
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        src = path.read_text()
        if not NEEDS_NETNS.search(src):
            continue
        tree = ast.parse(src)
        module_marks = " ".join(
            ast.get_source_segment(src, n) or "" for n in tree.body
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.name.startswith("test_"):
                continue
            body = ast.get_source_segment(src, node) or ""
            if NEEDS_NETNS.search(body) and "netns" not in _marks(src, node) and "netns" not in module_marks:
                unmarked.append(f"{path.relative_to(TESTS.parent)}::{node.name}")
    assert unmarked == [], "mark these @pytest.mark.netns:\n" + "\n".join(unmarked)
