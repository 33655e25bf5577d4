"""`broker run SCRIPT.py`: a bare training script runs with the recipe defaults, the equivalent recipe printed and
saved on request; a recipe run refuses the script-only options with the field to edit instead."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from broker.core.recipe import load_recipe
from broker.core.scriptrecipe import _name, load_script, recipe_data

TINY_DDP = textwrap.dedent("""\
    import os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    print(f"RANK={dist.get_rank()} sum={t.item():g} args={' '.join(sys.argv[1:])}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
    """)


def _broker(cli_env, cwd: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(cli_env, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "broker", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def job(tmp_path) -> Path:
    d = tmp_path / "book"
    d.mkdir()
    (d / "tiny_ddp.py").write_text(TINY_DDP)
    return d


@pytest.mark.slow
def test_a_script_runs_on_two_local_nodes_with_its_arguments_and_the_recipe_printed(cli_env, job):
    cp = _broker(cli_env, job, "run", "tiny_ddp.py", "--cpu-ok", "--provider", "local", "--hours", "0.2",
                 "--", "--epochs", "2")
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    assert "running tiny_ddp.py as this recipe" in cp.stderr
    assert "script: tiny_ddp.py" in cp.stderr and "cpu_ok: true" in cp.stderr  # run from the script's folder
    assert "[node 0] RANK=0 sum=3 args=--epochs 2\n" in cp.stdout
    assert "[node 1] RANK=1 sum=3 args=--epochs 2\n" in cp.stdout
    assert "status: succeeded" in cp.stdout


def test_save_writes_a_recipe_that_loads_to_the_same_job_and_never_overwrites(cli_env, job):
    data = recipe_data(job / "tiny_ddp.py", args=["--epochs", "2"], nodes=3, gpu=["RTX 4090"], budget_usd=2.5,
                       max_hours=0.5, cpu_ok=True, setup=["pip install -r requirements.txt"])
    from broker.core.scriptrecipe import recipe_text, save

    saved = save(job / "job.yaml", data, job / "tiny_ddp.py")
    from_file = load_recipe(saved)
    from_script = load_script(job / "tiny_ddp.py", data)
    for field in ("name", "script", "workdir", "args", "nodes", "gpu", "budget_usd", "max_hours", "cpu_ok",
                  "setup"):
        assert getattr(from_file, field) == getattr(from_script, field), field
    assert from_script.path is None and from_file.nodes == 3 and from_file.args == ["--epochs", "2"]
    from broker.core.errors import BadInput

    with pytest.raises(BadInput, match="the file exists"):
        save(job / "job.yaml", data, job / "tiny_ddp.py")


def test_a_recipe_saved_in_a_parent_folder_names_the_work_folder(job):
    from broker.core.scriptrecipe import recipe_text, save

    data = recipe_data(job / "tiny_ddp.py", args=[])
    saved = save(job.parent / "outer.yaml", data, job / "tiny_ddp.py")
    r = load_recipe(saved)
    assert r.script == (job / "tiny_ddp.py") and r.workdir == job


def test_the_script_only_options_on_a_recipe_name_its_field(cli_env, tmp_path):
    cp = _broker(cli_env, tmp_path, "run", "r.yaml", "--budget", "5")
    assert cp.returncode == 2 and "recipe's `budget_usd:` field" in " ".join(cp.stderr.split()), cp.stderr
    cp = _broker(cli_env, tmp_path, "run", "r.yaml", "--", "--epochs", "3")
    assert cp.returncode == 2 and "extra arguments after the recipe" in cp.stderr
    assert "`args:` field" in " ".join(cp.stderr.split())


def test_a_bad_flag_names_the_flag_and_a_missing_script_says_so(cli_env, job):
    cp = _broker(cli_env, job, "run", "tiny_ddp.py", "--nodes", "0")
    assert cp.returncode == 2 and "--nodes 0 is out of range" in cp.stderr
    cp = _broker(cli_env, job, "run", "missing.py")
    assert cp.returncode == 2 and "missing.py: no such script" in cp.stderr


def test_a_requirements_file_next_to_the_script_is_offered(cli_env, job):
    from broker.core.scriptrecipe import requirements_note

    assert requirements_note(job / "tiny_ddp.py", None) is None
    (job / "requirements.txt").write_text("numpy\n")
    note = requirements_note(job / "tiny_ddp.py", None)
    assert note and "--setup 'pip install -r requirements.txt'" in note
    assert requirements_note(job / "tiny_ddp.py", ["pip install -r requirements.txt"]) is None


@pytest.mark.parametrize("stem, name", [("profile_ddp", "profile_ddp"), ("my train", "my-train"),
                                        ("_private", "private"), ("ünïcode", "n-code"), ("__", "job")])
def test_the_recipe_name_comes_from_the_file_name(stem, name):
    import re

    got = _name(Path(f"{stem}.py"))
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", got), got
    assert got == name


@pytest.mark.slow
def test_a_background_script_run_keeps_the_script_s_arguments_last(cli_env, job):
    """`broker run SCRIPT.py -d -- ARGS`: the background process's own flags go before the `--` (its -q had
    landed among the script's arguments)."""
    cp = _broker(cli_env, job, "run", "tiny_ddp.py", "--cpu-ok", "--provider", "local", "--hours", "0.2", "-d",
                 "--", "--epochs", "2")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    import re

    run_id = re.search(r"broker logs -f (\S+)", cp.stdout)[1]
    logs = _broker(cli_env, job, "logs", "-f", run_id)  # returns when the run has ended
    assert re.search(r"RANK=0 sum=3 args=--epochs 2$", logs.stdout, re.M), logs.stdout + logs.stderr


def test_the_printed_recipe_pasted_into_a_file_here_runs_the_same_job(job, tmp_path):
    """The printed recipe named the script relative to its own folder: pasted into a file in the current folder it
    failed ("profile_ddp.py does not exist"); it is now what --save writes here."""
    from broker.core.scriptrecipe import placed, recipe_data, recipe_text

    data = recipe_data(job / "tiny_ddp.py", args=["--epochs", "2"], nodes=3, budget_usd=2.0, cpu_ok=True)
    text = recipe_text(placed(data, job / "tiny_ddp.py", tmp_path))
    assert "workdir: book" in text and "script: book/tiny_ddp.py" in text and "{" not in text, text
    assert "args: [--epochs, '2']" in text, text
    (tmp_path / "pasted.yaml").write_text(text)
    r = load_recipe(tmp_path / "pasted.yaml")
    assert r.script == job / "tiny_ddp.py" and r.workdir == job and r.nodes == 3 and r.args == ["--epochs", "2"]


def test_script_flags_get_script_words(cli_env, job, tmp_path):
    cp = _broker(cli_env, job, "run", "tiny_ddp.py", "--gpus-per-node", "0")
    assert cp.returncode == 2 and "needs --cpu-ok" in cp.stderr and "-> add --cpu-ok" in cp.stderr, cp.stderr
    cp = _broker(cli_env, job, "run", "tiny_ddp.py", "--cpu-ok", "--save", "/nonexistent/d/job.yaml")
    assert cp.returncode == 2 and "/nonexistent/d does not exist" in cp.stderr, cp.stderr


def test_a_script_run_s_hints_name_its_flags_not_recipe_fields(cli_env, job):
    """`broker run SCRIPT.py --budget 0.01` said "raise budget_usd to at least $0.40"; without --cpu-ok it said
    "set cpu_ok: true in the recipe": the user has no recipe, only flags."""
    cp = _broker(cli_env, job, "run", "tiny_ddp.py", "--budget", "0.01")
    text = " ".join(cp.stderr.split())
    assert cp.returncode == 3, text
    import re

    assert re.search(r"-> add --budget \d+\.\d\d", text) and "raise budget_usd" not in text, text
    cp = _broker(cli_env, job, "run", "tiny_ddp.py")
    text = " ".join(cp.stderr.split())
    assert cp.returncode == 4, text
    assert "or add --cpu-ok" in text and "cpu_ok: true in the recipe" not in text, text
