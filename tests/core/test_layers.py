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
        # the registry (providers/__init__.py), its declarations and the snapshot data package import no adapter: core
        return "core" if len(parts) == 2 or parts[2] in ("snapshots", "declared") else "adapters"
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


# --------------------------------------------------------------------------------------------------- provider names
# A provider's difference is data on its adapter or the target it hands over (Provider.run_target), never a branch
# on its name: outside providers/ (the adapters and the registry) no code compares a value that holds a provider
# with a registered provider's name, and none reaches an adapter module through broker.providers.adapter_module.

#: words that name a value holding a provider (``opt.provider``, ``run.provider``, ``prov``, ``p``, ``name``...)
_PROVIDER_WORDS = ("provider", "prov", "p", "n", "name", "chosen")

#: file -> comparisons the check finds that are not about providers (it reads words, not types); a file may only
#: go down, and a new comparison anywhere fails.
NAME_COMPARISONS_LEFT: dict[str, int] = {
    "broker/lint/script.py": 1,  # not a provider: a value's provenance ("local" rank); the words can't tell
}
#: file -> adapter_module calls still there (the same rule): none
ADAPTER_MODULE_LEFT: dict[str, int] = {}


def _provider_names() -> set[str]:
    import broker.providers as registry

    return set(registry.REGISTRY)


def _holds_provider(node: ast.AST) -> bool:
    word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return word is not None and (word in _PROVIDER_WORDS or "provider" in word.lower())


def _names_in(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in names for e in node.elts)
    return False


def name_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` that compare a provider-holding value with one of ``names`` (==, !=, in, not in, either
    side)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for a, b in zip(sides, sides[1:]):
            if (_holds_provider(a) and _names_in(b, names)) or (_holds_provider(b) and _names_in(a, names)):
                out.append(node.lineno)
                break
    return out


def adapter_module_calls(source: str) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id == "adapter_module")
        or (isinstance(n.func, ast.Attribute) and n.func.attr == "adapter_module"))]


def _core_sources() -> dict[str, str]:
    """broker/ (everything but the adapters and the registry, which live in providers/), by repository path."""
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in sorted((REPO / "broker").rglob("*.py"))}


def _over(found: dict[str, list[int]], left: dict[str, int]) -> list[str]:
    return [f"{f}: lines {lines}" for f, lines in sorted(found.items()) if len(lines) > left.get(f, 0)]


def test_no_provider_name_is_compared_outside_the_adapters():
    names = _provider_names()
    found = {f: lines for f, src in _core_sources().items() if (lines := name_comparisons(src, names))}
    over = _over(found, NAME_COMPARISONS_LEFT)
    assert not over, ("a provider's name compared outside providers/ (docs/architecture.md, 'Adding a provider': "
                      "declare a capability, or let the provider's run_target / adapter decide): " + "; ".join(over))


def test_no_adapter_module_reach_ins_outside_the_adapters():
    found = {f: lines for f, src in _core_sources().items() if (lines := adapter_module_calls(src))}
    over = _over(found, ADAPTER_MODULE_LEFT)
    assert not over, ("broker.providers.adapter_module called outside providers/: ask the provider through its "
                      "contract (provider_class(name).run_target / a Provider verb) instead: " + "; ".join(over))


def test_the_provider_name_checks_catch_a_planted_violation():
    """The two checks themselves, on planted code: the comparisons the pipeline used to make are found, words that
    are not providers (a topology, a rank) are not."""
    names = {"local", "netns", "slurm", "vast"}
    planted = ('if req.provider == "netns":\n    pass\n'
               'x = p in ("local", "slurm")\n'
               'y = options[0].provider != "local"\n'
               'z = "local" in provider\n'
               'ok = topo == "local" or who == "local"\n')
    assert name_comparisons(planted, names) == [1, 3, 4, 5]
    assert adapter_module_calls('from broker.providers import adapter_module\nnetns = adapter_module("netns")\n'
                                'm = registry.adapter_module("netns")\n') == [2, 3]
    # and the whole-tree check fails on a planted file
    found = {"broker/run/x.py": name_comparisons('if run.provider == "slurm": pass\n', names)}
    assert _over(found, NAME_COMPARISONS_LEFT) == ["broker/run/x.py: lines [1]"]
