"""``broker slurm submit`` copies the job's own ``--output``/``--error`` files under ``<run>/outputs/``: a job whose
``#SBATCH --output=recipe.json`` / ``--error=node0.log`` never overwrites broker's files, and a name with control
characters or ``..`` is copied under a fixed name.  Driven through the real follow loop with a scripted Slurm
shell (the files are real files)."""

from __future__ import annotations

import subprocess as sp
from pathlib import Path
from types import SimpleNamespace


def _follow_with(tmp_path: Path, stdout: str, stderr: str):
    from broker.providers.slurm import JobInfo
    from broker.slurm.submit import Outcome, _follow

    cluster = tmp_path / "cluster"
    cluster.mkdir(exist_ok=True)
    for p in {stdout, stderr}:
        Path(p).write_text("0: epoch 0 loss 1.0\n")

    class Sh:
        def run(self, argv, **kw):
            return sp.CompletedProcess(argv, 0, stdout=f"JobId=7 JobName=j StdOut={stdout} StdErr={stderr} "
                                                       "BatchHost=node0 UserId=root(0)".encode(), stderr=b"")

        def read_from(self, path, offset):
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read()

    class Prov:
        def job(self, job_id, attrs=None):
            return JobInfo(job_id, "COMPLETED", exit_code=0)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.json").write_text("BROKER'S RECIPE")
    said: list[str] = []
    out = Outcome("r1", "7", "RUNNING", None, None, "failed")
    status, _reason, _info, out = _follow(Prov(), Sh(), {}, "7", SimpleNamespace(id="r1"), None, {}, "j", 1, 1,
                                          run_dir, out, echo=None, say=said.append, poll_s=0.01,
                                          ledger=SimpleNamespace(event=lambda *a, **k: None), res_id=None)
    return status, out, run_dir, said


def test_the_jobs_output_names_never_overwrite_brokers_files(tmp_path):
    c = tmp_path / "cluster"
    status, out, run_dir, _said = _follow_with(tmp_path, str(c / "recipe.json"), str(c / "node0.log"))
    assert status == "succeeded"
    assert (run_dir / "recipe.json").read_text() == "BROKER'S RECIPE"
    assert out.files == [run_dir / "outputs" / "recipe.json", run_dir / "outputs" / "node0.log"]
    assert (run_dir / "outputs" / "recipe.json").read_text() == "0: epoch 0 loss 1.0\n"
    assert (run_dir / "outputs" / "node0.log").read_text() == "0: epoch 0 loss 1.0\n"
    assert "epoch 0 loss 1.0" in (run_dir / "node0.log").read_text()  # broker's own per-node log
    assert (run_dir / "outputs" / "recipe.json").stat().st_mode & 0o777 == 0o600


def test_an_output_name_with_control_characters_or_dots_gets_a_fixed_name(tmp_path):
    from broker.slurm.submit import output_copy

    c = tmp_path / "cluster"
    status, out, run_dir, said = _follow_with(tmp_path, str(c / "log\x1b[31m.txt"), str(c / "err.txt"))
    assert out.files == [run_dir / "outputs" / "slurm-7.out", run_dir / "outputs" / "err.txt"]
    assert any(r"'log\x1b[31m.txt'" in s and "control characters" in s for s in said), said
    assert not any("\x1b" in s for s in said)
    assert output_copy(run_dir, "/shared/..", "slurm-7.err") == (run_dir / "outputs" / "slurm-7.err",
                                                                 "'..' (the name climbs out of the work folder "
                                                                 "with '..')")
    assert output_copy(run_dir, "/", "slurm-7.out")[0] == run_dir / "outputs" / "slurm-7.out"
