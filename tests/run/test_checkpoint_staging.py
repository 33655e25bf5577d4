"""A checkpoint left in the work folder (an earlier local run, a copy-back) is not staged into a new run: the
recipe's ``checkpoint_dir`` is left out of every staging path (local copies, the SSH tar, the Slurm job folder,
tests/slurm) and the staging line says so; ``resume_checkpoint: true`` stages it; later attempts still get
broker's own copied-back checkpoint."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from tests.run.test_preempt import _fake_run, _recipe

STALE = 20  # the step an earlier run left in ckpt/state.json


def _stale(recipe) -> None:
    ck = Path(recipe.workdir) / "ckpt"
    ck.mkdir()
    (ck / "state.json").write_text(json.dumps({"step": STALE}))


def _resumed(log: str) -> int:
    return int(log.split("resumed from step ")[1].split()[0])


def test_the_checkpoint_dir_is_left_out_of_the_staged_files_and_the_line_says_so(tmp_path):
    from broker.run.staging import recipe_stage_plan, staged_tar

    w = tmp_path / "w"
    (w / "ckpt" / "sub").mkdir(parents=True)
    (w / "train.py").write_text("print(1)\n")
    (w / "ckpt" / "state.json").write_text("{}")
    (w / "ckpt" / "sub" / "m.pt").write_text("x")
    (w / "ckpt_notes.txt").write_text("not the folder")  # a name that only starts like it is staged
    (w / "alias").symlink_to("ckpt")  # a link to it is the same folder
    (w / ".gitignore").write_text("ckpt/\n")
    plan = recipe_stage_plan(w, "train.py", ["--resume", "ckpt/state.json"], checkpoint_dir="ckpt")
    names = sorted(p.as_posix() for p in plan.files)
    assert names == [".gitignore", "ckpt_notes.txt", "train.py"]  # named in args and ignored: still left out
    line = plan.summary()
    assert "checkpoint_dir alias/, ckpt/ not staged" in line and "resume_checkpoint: true" in line
    assert plan.excluded["alias/"] == "checkpoint_dir"
    with staged_tar(plan, tmp_path / "run") as t, tarfile.open(t.path, "r:*") as tar:  # the SSH / Slurm tar
        assert not [m.name for m in tar.getmembers() if m.name.startswith(("ckpt/", "alias"))]
    (w / ".gitignore").unlink()
    nested = recipe_stage_plan(w, "train.py", checkpoint_dir="ckpt/sub")
    assert sorted(p.as_posix() for p in nested.files) == ["alias/state.json", "ckpt/state.json", "ckpt_notes.txt",
                                                          "train.py"]
    assert nested.excluded["ckpt/sub/"] == nested.excluded["alias/sub/"] == "checkpoint_dir"
    kept = recipe_stage_plan(w, "train.py", checkpoint_dir="ckpt", resume_checkpoint=True)
    assert "ckpt/sub/m.pt" in {p.as_posix() for p in kept.files} and "not staged" not in kept.summary()
    assert ("(checkpoint_dir ckpt/ staged, 2 files: resume_checkpoint: true, the job starts from it)"
            in kept.summary()), kept.summary()
    empty = recipe_stage_plan(w, "train.py", checkpoint_dir="nothing", resume_checkpoint=True)
    assert "checkpoint_dir nothing/ is empty or missing" in empty.summary() and "from scratch" in empty.summary()


def test_a_local_run_does_not_resume_from_a_stale_checkpoint_in_the_work_folder(tmp_path, monkeypatch):
    from broker.run.pipeline import Hooks, LocalTarget, run_pipeline

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    recipe, _ = _recipe(tmp_path, steps=3, sleep=0.01, interruptible="false")
    _stale(recipe)
    said: list[str] = []
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=Ledger(), hooks=Hooks(say=said.append))
    assert out.exit_code == 0, out.result.reason
    assert _resumed(Path(out.run.run_dir, "node0.log").read_text()) == 0
    assert any("checkpoint_dir ckpt/ not staged" in s for s in said), said
    assert json.loads((Path(recipe.workdir) / "ckpt" / "state.json").read_text())["step"] == STALE  # untouched


def test_resume_checkpoint_true_starts_the_first_attempt_from_it(tmp_path, monkeypatch):
    from broker.run.pipeline import Hooks, LocalTarget, run_pipeline

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    recipe, _ = _recipe(tmp_path, steps=STALE + 2, sleep=0.01, interruptible="false", extra="resume_checkpoint: true\n")
    assert recipe.resume_checkpoint is True
    _stale(recipe)
    said: list[str] = []
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=Ledger(), hooks=Hooks(say=said.append))
    assert out.exit_code == 0, out.result.reason
    assert _resumed(Path(out.run.run_dir, "node0.log").read_text()) == STALE
    assert any("checkpoint_dir ckpt/ staged" in s and "the job starts from it" in s for s in said), said


def test_resume_checkpoint_without_checkpoint_dir_names_the_field_and_the_fix(tmp_path):
    from broker.core.recipe import RecipeError, load_recipe

    (tmp_path / "job.py").write_text("print(1)\n")
    (tmp_path / "r.yaml").write_text("name: t\nscript: job.py\ncpu_ok: true\nresume_checkpoint: true\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(tmp_path / "r.yaml")
    assert "r.yaml:4: field 'resume_checkpoint'" in e.value.message and "checkpoint_dir" in e.value.hint


def test_a_preempted_run_resumes_from_brokers_copy_not_from_the_stale_one(tmp_path, fake_cloud):
    """Attempt 1 starts from step 0 (the stale checkpoint is not staged); attempt 2 from the generation broker
    copied back during attempt 1, restored after staging."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "ckpt").mkdir()
    (d / "ckpt" / "state.json").write_text(json.dumps({"step": STALE}))
    out, err, ledger, p, said, done = _fake_run(tmp_path, fake_cloud, [8])
    assert err is None, (err, said)
    assert out.exit_code == 0, (out.result.reason, said)
    first = _resumed(Path(out.run.run_dir, "attempt1", "node0.log").read_text())
    second = _resumed(Path(out.run.run_dir, "node0.log").read_text())
    assert first == 0
    assert 0 < second < STALE, second
    assert any("restored checkpoint gen-" in s for s in said)


@pytest.mark.netns
def test_an_ssh_run_does_not_resume_from_a_stale_checkpoint(tmp_path, monkeypatch):
    """netns hosts over SSH: the tar streamed to the node holds no ckpt/, the job starts at step 0."""
    from tests.conftest import netns_missing

    why = netns_missing()
    if why:
        pytest.skip(why)
    from broker.run.pipeline import Hooks, run_pipeline
    from broker.providers.netns.target import NetnsTarget

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    recipe, _ = _recipe(tmp_path, steps=2, sleep=0.01, interruptible="false")
    _stale(recipe)
    target = NetnsTarget(recipe)
    said: list[str] = []
    try:
        out = run_pipeline(recipe, target, ledger=Ledger(), hooks=Hooks(say=said.append))
    finally:
        if target.cluster_state is not None:
            target.cluster_state.down()
    assert out.exit_code == 0, (out.result.reason, said)
    assert _resumed(Path(out.run.run_dir, "node0.log").read_text()) == 0
    assert any("checkpoint_dir ckpt/ not staged" in s for s in said), said


def test_the_staging_line_names_how_many_files_the_checkpoint_dir_left_out(tmp_path):
    """The line said "checkpoint_dir data/ not staged" and nothing of what that dropped (the trial's input data)."""
    from broker.run.staging import recipe_stage_plan

    w = tmp_path / "w"
    (w / "data" / "sub").mkdir(parents=True)
    (w / "train.py").write_text("print(1)\n")
    (w / "data" / "digits.csv.gz").write_text("x")
    (w / "data" / "sub" / "b.bin").write_text("y")
    (w / "data" / "sub" / "c.bin").write_text("z")
    (w / "alias").symlink_to("data")  # the same files: not counted twice
    assert "checkpoint_dir alias/, data/ not staged, 3 files left out:" in \
        recipe_stage_plan(w, "train.py", checkpoint_dir="data").summary()
    assert "checkpoint_dir alias/sub/, data/sub/ not staged, 2 files left out:" in \
        recipe_stage_plan(w, "train.py", checkpoint_dir="data/sub").summary()
    (w / "data" / "sub" / "c.bin").unlink()
    (w / "data" / "digits.csv.gz").unlink()
    assert "not staged, 1 file left out:" in recipe_stage_plan(w, "train.py", checkpoint_dir="data/sub").summary()


@pytest.mark.parametrize("args, script_in_ck", [(["--data", "data/digits.csv.gz"], False),
                                                (["--data=data/digits.csv.gz"], False), ([], True)])
def test_a_checkpoint_dir_holding_a_file_the_recipe_names_is_refused_before_anything_runs(tmp_path, args,
                                                                                          script_in_ck):
    """`checkpoint_dir: data` (the folder of the job's input) left the input unstaged: the job crashed on the node
    with FileNotFoundError.  A file the script or args name inside it is refused when the recipe is read."""
    from broker.core.recipe import RecipeError, load_recipe

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits.csv.gz").write_text("x")
    script = "data/train.py" if script_in_ck else "train.py"
    (tmp_path / script).write_text("print(1)\n")
    body = (f"name: j\nscript: {script}\nworkdir: .\nargs: {json.dumps(args)}\ncheckpoint_dir: data\n")
    (tmp_path / "r.yaml").write_text(body)
    with pytest.raises(RecipeError) as e:
        load_recipe(tmp_path / "r.yaml")
    named = "data/train.py" if script_in_ck else "data/digits.csv.gz"
    assert f"r.yaml:5: field 'checkpoint_dir': data holds {named}, which " in e.value.message, e.value.message
    assert ("'script'" if script_in_ck else "'args'") in e.value.message
    assert "another folder as checkpoint_dir" in e.value.hint and "resume_checkpoint: true" in e.value.hint
    (tmp_path / "r.yaml").write_text(body + "resume_checkpoint: true\n")  # staged then: nothing to refuse
    assert load_recipe(tmp_path / "r.yaml").resume_checkpoint
    (tmp_path / "r.yaml").write_text(body.replace("checkpoint_dir: data", "checkpoint_dir: checkpoints"))
    assert load_recipe(tmp_path / "r.yaml").checkpoint_dir == "checkpoints"


def test_the_readme_example_stages_what_recipes_ddp_2node_really_stages():
    """README's first-command example said "staged 7 file(s), 69.6 kB" after recipes/ gained an eighth file."""
    import re

    from broker.core.recipe import load_recipe
    from broker.run.staging import recipe_stage_plan
    from tests.conftest import REPO

    r = load_recipe(Path(REPO) / "recipes" / "ddp_2node.yaml")
    plan = recipe_stage_plan(r.workdir, r.script, r.args, checkpoint_dir=r.checkpoint_dir,
                             resume_checkpoint=r.resume_checkpoint)
    said = re.search(r"staged (\d+) file\(s\), ([\d.]+ [kM]?B) per node", (Path(REPO) / "README.md").read_text())
    assert said and (int(said[1]), said[2]) == (len(plan.files), plan.size_text()), (said, len(plan.files))
