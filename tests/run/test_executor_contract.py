"""What an executor declares on the contract (broker.run.executor): the optional steps it runs and its checkpoint
source.  A new executor that does not say where its checkpoints are is refused when its class is defined; one that
says it has none is said at run time; one that gives a source gets its checkpoints copied back and restored
through that source only."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.run.checkpoint import CheckpointingExecutor, NodeFoldersSource, latest_generation, with_checkpoints
from broker.run.executor import Executor, NoCheckpoints, run_steps
from broker.run.supervisor import RunResult


class _Recipe:
    checkpoint_dir, checkpoint_every_s = "ckpt", 3600


def test_an_executor_that_does_not_declare_its_checkpoint_source_is_refused_when_defined():
    with pytest.raises(TypeError, match=r"Forgetful does not declare checkpoint_source\(rel_dir\).*NoCheckpoints"):
        class Forgetful(Executor):  # noqa: F841 - defining it is the test
            def stage(self):
                return None

            def launch(self):
                return RunResult(status="succeeded", exit_codes={0: 0}, wall_s=0.0, log_paths={})

            def finish(self, result):
                return result

    class Partial(Executor):  # an abstract base for executors (no launch yet): may leave it to its subclasses
        def stage(self):
            return None

    assert Partial.checkpoint_source.__isabstractmethod__


def test_the_executors_broker_ships_declare_a_source():
    from broker.run.launch import LocalExecutor
    from broker.run.remote import SSHExecutor
    from broker.slurm.executor import SlurmExecutor

    for cls in (LocalExecutor, SSHExecutor, SlurmExecutor):
        assert not getattr(cls.checkpoint_source, "__isabstractmethod__", False), cls


class _Nodes(Executor):
    """Two "nodes" that are folders here; launch writes a checkpoint on node 0 (what a training script does)."""

    def __init__(self, root: Path, declares):
        self.root, self.declares, self.dirs, self.seen = root, declares, [], []

    def preflight(self):
        return None

    def stage(self):
        self.dirs = [self.root / f"node{i}" for i in range(2)]
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        return None

    def launch(self):
        self.seen = [(d / "ckpt" / "step.pt").read_bytes() if (d / "ckpt" / "step.pt").exists() else None
                     for d in self.dirs]
        (self.dirs[0] / "ckpt").mkdir(exist_ok=True)
        (self.dirs[0] / "ckpt" / "step.pt").write_bytes(b"weights after this attempt")
        return RunResult(status="succeeded", exit_codes={0: 0, 1: 0}, wall_s=0.1, log_paths={})

    def finish(self, result):
        return result

    def checkpoint_source(self, rel_dir):
        return self.declares(self, rel_dir)


def test_a_declared_source_is_copied_back_and_restored_on_every_node_of_the_next_attempt(tmp_path):
    run_dir = tmp_path / "run"
    said: list[str] = []
    first = _Nodes(tmp_path / "a1" / "nodes", lambda ex, rel: NodeFoldersSource(lambda: ex.dirs, rel))
    ex = with_checkpoints(first, _Recipe(), run_dir, said.append)
    assert isinstance(ex, CheckpointingExecutor) and ex.steps() == ("preflight",)
    steps: list[str] = []
    assert run_steps(ex, steps.append).status == "succeeded"
    assert steps == ["preflight", "stage", "launch"]  # the wrapper announces what the inner executor declares
    gen = latest_generation(run_dir)
    assert gen is not None and (gen / "step.pt").is_file()
    again = _Nodes(tmp_path / "a2" / "nodes", lambda ex, rel: NodeFoldersSource(lambda: ex.dirs, rel))
    run_steps(with_checkpoints(again, _Recipe(), run_dir, said.append))
    assert again.seen == [(gen / "step.pt").read_bytes()] * 2  # restored on both nodes before launch
    assert any("restored checkpoint gen-000001" in s for s in said)


def test_an_executor_without_checkpoints_says_why_and_runs_unwrapped(tmp_path):
    said: list[str] = []
    ex = _Nodes(tmp_path / "nodes", lambda ex, rel: NoCheckpoints("its nodes keep no files between attempts"))
    assert with_checkpoints(ex, _Recipe(), tmp_path / "run", said.append) is ex
    assert said == ["checkpoint_dir ckpt is not copied back: its nodes keep no files between attempts"]
