"""Checkpoint copies with files broker will not take (a symlink out of the folder, a FIFO, a name holding an escape
sequence) in a real local run's ``checkpoint_dir``: those files are skipped and named, the rest is copied, the run
says so while it runs and in its record; and every copy of a run shares one size cap counted on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.money.ledger import Ledger

# writes a good checkpoint plus the three files broker must refuse, then keeps saving for a few steps
JOB = r"""
import json, os, pathlib, time
ck = pathlib.Path("ckpt"); ck.mkdir(exist_ok=True)
if not (ck / "leak.pt").is_symlink():
    (ck / "leak.pt").symlink_to({secret!r})
if not (ck / "pipe").exists():
    os.mkfifo(ck / "pipe")
(ck / "red\x1b[31m.pt").write_text("x")
for step in range(3):
    tmp = ck / "state.json.tmp"
    tmp.write_text(json.dumps({{"step": step + 1}}))
    os.replace(tmp, ck / "state.json")
    time.sleep(0.3)
print("DONE", flush=True)
"""


def test_refused_checkpoint_files_are_skipped_named_and_the_rest_copied_in_a_local_run(tmp_path, monkeypatch):
    from broker.core.recipe import load_recipe
    from broker.run.checkpoint import latest_generation
    from broker.run.pipeline import Hooks, LocalTarget, run_pipeline

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    d = tmp_path / "r"
    d.mkdir()
    (d / "job.py").write_text(JOB.format(secret=str(secret)))
    (d / "r.yaml").write_text("name: t\nscript: job.py\nnodes: 1\ncpu_ok: true\ntopology: simulated\n"
                              "budget_usd: 5\nmax_hours: 1\ncheckpoint_dir: ckpt\ncheckpoint_every_s: 1\n"
                              "expect: [DONE]\n")
    recipe = load_recipe(d / "r.yaml")
    said: list[str] = []
    ledger = Ledger()
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=ledger, hooks=Hooks(say=said.append))
    gen = latest_generation(Path(out.run.run_dir))
    assert gen is not None, said  # the good file was copied: a preemption would resume from it
    assert sorted(p.name for p in gen.iterdir()) == ["state.json"]
    assert '"step": 3' in (gen / "state.json").read_text()
    # each refusal said once on the terminal, like refused artifacts, with the name escaped (no raw ESC)
    lines = [s for s in said if s.startswith("checkpoint file refused")]
    assert len(lines) == 3, said
    assert any("'leak.pt'" in s and "outside the checkpoint folder" in s for s in lines), lines
    assert any("'pipe'" in s and "not a regular file" in s for s in lines), lines
    assert any(r"'red\x1b[31m.pt'" in s and "control characters" in s for s in lines), lines
    assert not any("\x1b" in s for s in said)
    # ... and in the result and the run's record
    assert out.result.status == "succeeded" and out.exit_code == 0
    assert out.result.shown_status == "succeeded, with 1 warning"
    assert "checkpoint file(s) refused" in out.result.reason and "'pipe'" in out.result.reason
    rec = ledger.get_run(out.run.id) if hasattr(ledger, "get_run") else out.run
    assert "checkpoint file(s) refused" in (rec.message or ""), rec
    assert not list((tmp_path / "home").rglob("secret.txt"))


def test_a_copy_that_fails_is_said_while_the_run_runs_and_recorded(tmp_path, monkeypatch):
    from broker.run.checkpoint import CheckpointingExecutor, Source
    from broker.run.supervisor import RunResult

    class Gone(Source):
        def list(self):
            raise ConnectionResetError("connection lost")

    class Inner:
        def launch(self):
            return RunResult(status="succeeded", exit_codes={0: 0}, wall_s=1.0, log_paths={})

        def finish(self, res):
            return res

    said: list[str] = []
    ex = CheckpointingExecutor(Inner(), "ckpt", tmp_path / "run", every_s=3600, say=said.append)
    ex.source = lambda: Gone()  # type: ignore[method-assign]
    res = ex.finish(ex.launch())
    assert [s for s in said if "checkpoint copy failed" in s] == [
        "checkpoint copy failed, no copy stays the one a new attempt resumes from: "
        "listing the checkpoint folder failed: connection lost"]
    assert res.warnings and "no checkpoint was copied" in res.reason


def test_every_copy_of_a_run_shares_one_size_cap_counted_on_disk(tmp_path):
    from broker.run.artifacts import ArtifactBudget
    from broker.run.checkpoint import CopyFailed, LocalSource, copy_back, disk_bytes, latest_generation

    node = tmp_path / "ckpt"
    node.mkdir()
    run = tmp_path / "run"
    cap = 10_000
    peak = [0]

    class Measured(LocalSource):  # what lies under checkpoints/ while a copy is being built
        def fetch(self, rel, dst, budget):
            got = super().fetch(rel, dst, budget)
            peak[0] = max(peak[0], disk_bytes(run / "checkpoints"))
            return got

    for k in range(4):  # every copy changes the whole checkpoint (4 KB): two kept plus the one being built is 12 KB
        (node / "m.pt").write_bytes(bytes([k]) * 4000)
        os.utime(node / "m.pt", ns=(k * 10**9, k * 10**9))
        copy_back(Measured(node), run, budget=ArtifactBudget(per_file=cap, total=cap))
        assert disk_bytes(run / "checkpoints") <= cap
    assert 0 < peak[0] <= cap
    assert (latest_generation(run) / "m.pt").read_bytes() == bytes([3]) * 4000
    # a copy that with the kept one would pass the run's cap is refused whole; the kept one stays LATEST
    (node / "m.pt").write_bytes(b"z" * 7000)
    with pytest.raises(CopyFailed, match="cap"):
        copy_back(Measured(node), run, budget=ArtifactBudget(per_file=cap, total=cap))
    assert disk_bytes(run / "checkpoints") <= cap
    assert (latest_generation(run) / "m.pt").read_bytes() == bytes([3]) * 4000


@pytest.mark.netns
def test_refused_checkpoint_files_over_ssh_in_a_netns_run(tmp_path, monkeypatch):
    """The same files in node 0's checkpoint_dir on a netns host, fetched over SSH/SFTP: each refused file is
    named once, the good one copied."""
    from tests.conftest import netns_missing

    why = netns_missing()
    if why:
        pytest.skip(why)
    from broker.core.recipe import load_recipe
    from broker.run.checkpoint import latest_generation
    from broker.run.pipeline import Hooks, run_pipeline
    from broker.providers.netns.target import NetnsTarget

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    d = tmp_path / "r"
    d.mkdir()
    (d / "job.py").write_text(JOB.format(secret="/etc/hostname"))
    (d / "r.yaml").write_text("name: t\nscript: job.py\nnodes: 2\ncpu_ok: true\ntopology: multi-node\n"
                              "budget_usd: 5\nmax_hours: 1\ncheckpoint_dir: ckpt\ncheckpoint_every_s: 1\n"
                              "expect: [DONE]\n")
    recipe = load_recipe(d / "r.yaml")
    target = NetnsTarget(recipe)
    said: list[str] = []
    try:
        out = run_pipeline(recipe, target, ledger=Ledger(), hooks=Hooks(say=said.append))
    finally:
        if target.cluster_state is not None:
            target.cluster_state.down()
    assert out.exit_code == 0, (out.result.reason, said)
    gen = latest_generation(Path(out.run.run_dir))
    assert gen is not None and sorted(p.name for p in gen.iterdir()) == ["state.json"], said
    lines = [s for s in said if s.startswith("checkpoint file refused")]
    assert len(lines) == 3, said
    assert any("'leak.pt'" in s and "outside" in s for s in lines), lines
    assert any("'pipe'" in s and "not a regular file" in s for s in lines), lines
    assert any(r"'red\x1b[31m.pt'" in s for s in lines), lines
    assert not any("\x1b" in s for s in said)
    assert "checkpoint file(s) refused" in out.result.reason
