"""broker lint against the labelled corpus in tests/lint_corpus/.

Each snippet marks the lines that must be reported (``# expect: KIND[, KIND]``) and lines that must not be
reported with a kind (``# ok: KIND``); ``# ok@N: KIND`` labels line N (where a comment cannot stand, such as
inside a quoted shell command).  A snippet's findings must be exactly its ``expect`` lines: true negatives
fail on any finding at all.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker.lint.kinds import KINDS
from broker.lint.rules import lint_script

CORPUS = Path(__file__).resolve().parents[1] / "lint_corpus"
SNIPPETS = sorted(p for p in CORPUS.iterdir() if p.suffix in (".py", ".sbatch"))
MARK = re.compile(r"#\s*(expect|ok)(?:@(\d+))?:\s*([\w\-]+(?:\s*,\s*[\w\-]+)*)")


def labels(path: Path) -> tuple[set[tuple[int, str]], set[tuple[int, str]]]:
    expect: set[tuple[int, str]] = set()
    ok: set[tuple[int, str]] = set()
    for i, line in enumerate(path.read_text().splitlines(), 1):
        for m in MARK.finditer(line):
            for kind in (k.strip() for k in m.group(3).split(",")):
                assert kind in KINDS, f"{path.name}:{i}: unknown kind {kind}"
                (expect if m.group(1) == "expect" else ok).add((int(m.group(2) or i), kind))
    return expect, ok


def test_corpus_is_large_and_balanced():
    assert len(SNIPPETS) >= 40
    pos = [p for p in SNIPPETS if labels(p)[0]]
    neg = [p for p in SNIPPETS if labels(p)[1] and not labels(p)[0]]
    assert len(pos) >= 15 and len(neg) >= 15
    kinds_hit = {k for p in SNIPPETS for _, k in labels(p)[0]}
    assert kinds_hit == set(KINDS) - {"syntax-error"}


@pytest.mark.parametrize("path", SNIPPETS, ids=[p.name for p in SNIPPETS])
def test_snippet(path: Path):
    expect, ok = labels(path)
    assert expect or ok, f"{path.name} has no label"
    got = {(f.line, f.kind) for f in lint_script(path)}
    assert not (got & ok), f"reported on an ok line: {sorted(got & ok)}"
    assert got == expect, f"missed {sorted(expect - got)}, extra {sorted(got - expect)}"
