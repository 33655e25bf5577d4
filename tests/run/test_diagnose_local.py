"""The torch-missing fix depends on where the run ran: on this machine (--provider local) it points to the
README's install (`scripts/install`: the pinned torch, the CPU build without a GPU) and does not claim a preflight
check that local runs do not run; a rented node keeps the recipe-setup pip hint and the preflight check."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from broker.run.diagnose import explain

CASE = Path(__file__).resolve().parents[1] / "diagnose_logs" / "cpu" / "no_torch"
README = Path(__file__).resolve().parents[2] / "README.md"


def _result():
    r = json.loads((CASE / "result.json").read_text())
    return SimpleNamespace(status=r["status"], exit_codes={int(k): v for k, v in r["exit_codes"].items()},
                           log_paths={int(p.stem[4:]): p for p in CASE.glob("node*.log")})


def _fix_and_catch(lines: list[str]) -> tuple[str, str]:
    i = next(i for i, ln in enumerate(lines) if ln.startswith("cause [torch-missing]"))
    return lines[i + 1], lines[i + 2]


def test_a_local_run_without_torch_points_to_the_readme_install():
    fix, catch = _fix_and_catch(explain(CASE, _result(), 2, local=True).lines())
    assert "scripts/install" in fix and "pip install torch" not in fix
    assert "scripts/install" in README.read_text()  # the command the fix names is the README's
    assert "preflight check torch" not in catch.replace("the preflight check torch runs on rented nodes", "")
    assert catch.startswith("  would have been caught by: none before launch on this machine")


def test_a_rented_run_without_torch_keeps_the_pip_hint_and_the_preflight_check():
    fix, catch = _fix_and_catch(explain(CASE, _result(), 2).lines())
    assert "python -m pip install torch" in fix
    assert catch == "  would have been caught by: preflight check torch (each node's interpreter imports torch)"


def test_the_pipeline_step_passes_where_the_run_ran(tmp_path):
    import shutil

    from broker.run.pipeline import diagnose

    folder = tmp_path / "run"
    shutil.copytree(CASE, folder)
    res = _result()
    res.ok, res.error_lines, res.diagnosis = False, [], []
    res.log_paths = {k: folder / p.name for k, p in res.log_paths.items()}
    diagnose(res, SimpleNamespace(nodes=2), folder, local=True)
    assert "scripts/install" in (folder / "diagnosis.txt").read_text()
