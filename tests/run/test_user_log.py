"""A node's log (what `broker logs` shows) is the job's own output: broker's internal launch command line
(the rank shim's `--torchrun ...`) goes to <run>/launch.txt and the debug log, and a run that failed before any
node wrote a listed artifact is not told, file by file, that no node produced it."""

from __future__ import annotations

from pathlib import Path

from broker.core.recipe import load_recipe
from broker.money.ledger import Ledger
from broker.run.pipeline import run_pipeline
from broker.run.runrecord import Hooks
from broker.run.targets import LocalTarget


def _recipe(tmp_path: Path, script: str) -> Path:
    d = tmp_path / "job"
    d.mkdir()
    (d / "train.py").write_text(script)
    (d / "r.yaml").write_text("name: logs\nscript: train.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n"
                              "artifacts: ['checkpoint.pt']\n")
    return d / "r.yaml"


def _logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted(run_dir.glob("node*.log")))


def test_a_failed_run_logs_no_launch_command_and_no_missing_artifact(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, "import sys\nprint('training starts')\nsys.exit(1)\n"))
    echoed: list[str] = []
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=Ledger(), hooks=Hooks(echo=echoed.append))
    assert out.result.status == "failed"
    run_dir = Path(out.run.run_dir)
    logs = _logs(run_dir)
    assert "training starts" in logs
    assert "--torchrun" not in logs and "--nnodes" not in logs
    assert not any(ln.startswith("$ ") for ln in logs.splitlines())
    assert "produced by no node" not in logs
    assert not any("produced by no node" in ln for ln in echoed)
    launch = (run_dir / "launch.txt").read_text()
    assert launch.count("--torchrun") == 2 and "node 0: $ " in launch and "node 1: $ " in launch
    assert (run_dir / "launch.txt").stat().st_mode & 0o077 == 0


def test_a_succeeded_run_that_skipped_its_artifact_still_says_so(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, "print('done')\n"))
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=Ledger(), hooks=Hooks())
    assert out.result.status == "failed" and "checkpoint.pt" in out.result.reason
    assert "artifact checkpoint.pt was produced by no node" in _logs(Path(out.run.run_dir))
