"""The DDP lint rules (broker/lint/ddp.py): the CPU-run rule on its own corpus (tests/lint_corpus/cpu_run/, same
labels as tests/lint_corpus), its place in lint_recipe (CPU-only recipes only), and the rules on the real fault
scripts whose run-time failures the catalogue explains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker.lint.script import lint_source
from broker.lint.ddp import CPU_FIXES
from broker.lint.rules import cpu_run_findings

CORPUS = Path(__file__).resolve().parents[1] / "lint_corpus" / "cpu_run"
MARK = re.compile(r"#\s*(expect|ok):\s*([\w\-]+)")


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.py")), ids=lambda p: p.name)
def test_cpu_run_corpus(path):
    expect, ok = set(), set()
    for i, line in enumerate(path.read_text().splitlines(), 1):
        for m in MARK.finditer(line):
            assert m.group(2) in CPU_FIXES
            (expect if m.group(1) == "expect" else ok).add((i, m.group(2)))
    got = {(f.line, f.kind) for f in cpu_run_findings(path.read_text(), str(path))}
    assert got == expect and not got & ok


def _recipe(tmp_path, gpus: int):
    from broker.core.recipe import load_recipe

    (tmp_path / "train.py").write_text((CORPUS / "cuda_unchecked.py").read_text())
    (tmp_path / "r.yaml").write_text(f"name: t\nscript: train.py\nnodes: 2\ncpu_ok: true\ngpus_per_node: {gpus}\n")
    return load_recipe(tmp_path / "r.yaml")


def test_lint_recipe_flags_unchecked_cuda_only_on_a_cpu_only_run(tmp_path, monkeypatch):
    from broker.lint.rules import lint_recipe

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    cpu, _ = lint_recipe(_recipe(tmp_path, 0))
    assert [f.kind for f in cpu].count("cuda-without-check") == 3
    gpu, _ = lint_recipe(_recipe(tmp_path, 1))
    assert not any(f.kind == "cuda-without-check" for f in gpu)


FAULT = Path(__file__).resolve().parents[1] / "diagnose_logs" / "scripts" / "fault.py"


def test_the_rules_see_the_real_fault_scripts():
    """The scripts behind the captured logs: what lint would have said before launch."""
    kinds = {f.kind for f in lint_source(FAULT.read_text(), "fault.py")}
    assert {"hard-coded-world-size", "init-method-localhost", "master-env-in-script", "dataloader-no-sampler",
            "save-every-rank", "set-epoch-missing"} <= kinds, kinds
    lines = FAULT.read_text().splitlines()
    at = next(i for i, ln in enumerate(lines, 1) if ln.strip() == "torch.cuda.set_device(local_rank)")
    cpu = cpu_run_findings(FAULT.read_text(), "fault.py")
    assert at in {f.line for f in cpu}, [(f.line, f.message) for f in cpu]
