"""The layers of broker (docs/architecture.md, "Layers"): no module imports one of a higher layer, and no two modules
import each other, directly or through others.

Read from the source (AST) of every module of ``broker/`` and ``providers/`` (installed as ``broker.providers``),
counting imports at module level and inside functions alike (a function-level import is a dependency that is only
paid later); ``from broker.x import y`` counts as an import of ``broker.x.y`` when ``y`` is a module.  Imports under
``if TYPE_CHECKING:`` never run and are not counted.  Reaching an adapter by name through the registry
(``broker.providers.provider_class(name)``) is not an import of it: that is how the core stays free of clouds.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: low -> high; a module may import its own layer and the ones before it
LAYERS = ("core", "plan", "money", "lint", "run", "slurm", "adapters", "cli")

#: (importer, imported) edges that still go up a layer or close a cycle, to be removed; the test fails when an edge
#: listed here no longer exists, so the list can only shrink.
ALLOWED: set[tuple[str, str]] = set()


def layer(mod: str) -> str:
    """The layer of dotted module name ``mod``."""
    parts = mod.split(".")
    if mod == "broker":
        return "core"  # the package: a docstring and the version
    if mod == "broker.__main__":
        return "cli"
    if parts[1] == "providers":
        # the registry (providers/__init__.py) and the snapshot data package import no adapter: core
        return "core" if len(parts) == 2 or parts[2] == "snapshots" else "adapters"
    assert parts[1] in LAYERS, f"{mod}: a module outside the layer packages ({', '.join(LAYERS)})"
    return parts[1]


def _modules() -> dict[str, Path]:
    out = {}
    for root in ("broker", "providers"):
        for path in (REPO / root).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[0] == "providers":
                parts.insert(0, "broker")
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
                    isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
                for stmt in node.body:
                    skip.update(id(x) for x in ast.walk(stmt))
    return skip


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        return {m for a in node.names if (m := owner(a.name))}
    base = node.module or ""
    if node.level:
        pkg = mod if is_pkg else mod.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    out = set()
    for a in node.names:
        full = f"{base}.{a.name}"
        m = full if full in known else owner(base)
        if m:
            out.add(m)
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the broker modules it imports (at any depth of the file, TYPE_CHECKING blocks aside)."""
    mods = _modules()
    known = set(mods)
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_only(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                edges |= _targets(mod, path.name == "__init__.py", node, known)
        edges.discard(mod)
        graph[mod] = edges
    return graph


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, es in graph.items() for b in es if LAYERS.index(layer(b)) > LAYERS.index(layer(a)))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _without_allowed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {a: {b for b in es if (a, b) not in ALLOWED} for a, es in graph.items()}


def test_every_module_is_in_a_layer():
    for mod in _modules():
        layer(mod)


def test_no_import_goes_up_a_layer():
    up = upward(_without_allowed(import_graph()))
    assert not up, ("imports from a lower layer to a higher one (docs/architecture.md, 'Layers': move the shared piece "
                    "down, pass a callable in, or reach an adapter through broker.providers.provider_class): "
                    + "; ".join(f"{a} ({layer(a)}) -> {b} ({layer(b)})" for a, b in up))


def test_no_import_cycle():
    found = cycles(_without_allowed(import_graph()))
    assert not found, f"import cycles (each group imports itself through the others): {found}"


def test_the_allow_list_only_shrinks():
    graph = import_graph()
    stale = sorted((a, b) for a, b in ALLOWED if b not in graph.get(a, ()))
    assert not stale, f"edges in ALLOWED that no longer exist (drop them): {stale}"
    assert len(ALLOWED) == 0  # none left: keep it so


def test_the_checker_sees_function_level_imports_cycles_and_upward_edges():
    """The checker itself: a cycle through a function-level import and an upward edge are found."""
    g = {"broker.core.a": {"broker.core.b"}, "broker.core.b": {"broker.core.a"}, "broker.run.x": {"broker.cli.y"},
         "broker.cli.y": set()}
    assert cycles(g) == [["broker.core.a", "broker.core.b"]]
    assert upward(g) == [("broker.run.x", "broker.cli.y")]
    tree = ast.parse("def f():\n    from broker.core import records\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets("broker.core.model", False, node, {"broker.core.records", "broker.core"}) == {"broker.core.records"}
    rel = ast.parse("from .api import x\n").body[0]
    assert _targets("broker.providers.aws", True, rel, {"broker.providers.aws.api"}) == {"broker.providers.aws.api"}
