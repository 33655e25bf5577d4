"""The lint's call index (calls grouped once per callee) answers exactly what walking every call per parameter
answered: same findings on every corpus snippet and on a generated many-helper script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from broker.lint import script as lint
from broker.lint.kinds import SPAWN_CALLS, _attr_or_name
from broker.lint.script import _Linter, _parse, _suppressed

CORPUS = Path(__file__).resolve().parents[1] / "lint_corpus"
SNIPPETS = sorted(p for p in CORPUS.iterdir() if p.suffix == ".py")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


class _WalkEveryCall(_Linter):
    """The definition the index must match: every call of the file looked at for each question."""

    def _call_index(self):
        sites: dict = {}
        spawns: dict = {}
        for c in self.calls:
            fn = self.local_function(c)
            if fn is not None:
                sites.setdefault(id(fn), []).append(c)
        for c in self.calls:
            if _attr_or_name(c.func) in SPAWN_CALLS and c.args and isinstance(c.args[0], self.n.Name):
                spawns.setdefault(c.args[0].name, []).append(c)
        return sites, spawns

    def call_sites(self, fn):
        return [c for c in self.calls if self.local_function(c) is fn]


def _findings(cls, source: str, path: str):
    return [(f.line, f.kind, f.message) for f in _suppressed(cls(_parse(source, path), path).check(), source)]


@pytest.mark.parametrize("path", SNIPPETS, ids=[p.name for p in SNIPPETS])
def test_index_matches_walking_every_call(path: Path):
    src = path.read_text()
    assert _findings(_Linter, src, str(path)) == _findings(_WalkEveryCall, src, str(path))


def test_generated_script_same_findings_and_found_by_parameter_flow():
    from lint_scale import script

    src = script(600)
    got = _findings(_Linter, src, "train.py")
    assert got == _findings(_WalkEveryCall, src, "train.py")
    assert got, "the generated script's helpers receive the rank through parameters: the lint must see them"


def test_call_sites_are_grouped_per_callee_in_file_order():
    src = ("def f(a):\n    return a\n\ndef g(b):\n    return f(b)\n\n"
           "f(1)\ng(2)\nf(3)\nimport torch.multiprocessing as mp\nmp.spawn(g, args=())\n")
    linter = _Linter(_parse(src, "x.py"), "x.py")
    fns = {fn.name: fn for fn in linter.module.body if fn.__class__.__name__ == "FunctionDef"}
    assert [c.lineno for c in linter.call_sites(fns["f"])] == [5, 7, 9]
    assert [c.lineno for c in linter.call_sites(fns["g"])] == [8]
    assert [c.lineno for c in linter._call_index()[1]["g"]] == [11]
    assert lint.lint_source(src, "x.py") == lint.lint_source(src, "x.py")
