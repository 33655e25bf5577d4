"""broker lint on broker recipes (.yaml): the fields and the named script are linted, as `broker run` lints them;
a YAML (or other non-script file) that is not a recipe is bad input, never parsed as Python."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.cli.app import app
from broker.core.provider import BadInput
from broker.lint.recipes import RECIPE_ADVICE

ROOT = Path(__file__).resolve().parents[2]

BAD_SCRIPT = "import os, torch.distributed as d\nr = int(os.environ['SLURM_PROCID'])\nd.init_process_group('nccl')\n"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))


def recipe(d: Path, name: str = "job.yaml", script: str = "train.py", extra: str = "") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text(textwrap.dedent(f"""\
        name: job
        script: {script}
        nodes: 2
        gpus_per_node: 1
        budget_usd: 5
        max_hours: 0.5
        """) + extra)
    return p


def lint(*args: str):
    return CliRunner().invoke(app, ["lint", *args])


def test_shipped_recipes_lint_clean_not_as_python():
    for name in ("ddp_spot.yaml", "ddp_preempt_demo.yaml", "ddp_2node.yaml", "allreduce_bench.yaml"):
        r = lint(str(ROOT / "recipes" / name))
        assert r.exit_code == 0, r.output
        assert "syntax-error" not in r.output and "no findings" in r.output


def test_recipe_lints_the_script_it_names_as_run_does(tmp_path):
    """The script runs under torchrun: SLURM_PROCID is a finding there (it is not in a plain script)."""
    rec = recipe(tmp_path / "p")
    (tmp_path / "p" / "train.py").write_text(BAD_SCRIPT)
    r = lint(str(rec), "--json")
    assert r.exit_code == 1, r.output
    got = sorted((Path(f["path"]).name, f["line"], f["kind"]) for f in json.loads(r.output)["findings"])
    assert got == [("train.py", 2, "slurm-env-under-torchrun"), ("train.py", 3, "nccl-no-fallback")]


def test_recipe_field_error_is_a_finding_with_its_line(tmp_path):
    rec = recipe(tmp_path / "p", extra="nodez: 3\n")
    (tmp_path / "p" / "train.py").write_text("print('hi')\n")
    r = lint(str(rec))
    assert r.exit_code == 1, r.output
    assert f"{rec}:7:" in r.output and "recipe-field" in r.output and "nodez" in r.output
    missing = recipe(tmp_path / "q", script="nothere.py")
    r = lint(str(missing))
    assert r.exit_code == 1 and "recipe-field" in r.output and "nothere.py" in r.output, r.output


@pytest.mark.parametrize("text,what", [("a: 1\n", "without a 'script:' field"), ("- 1\n- 2\n", "YAML list"),
                                       ("a: [1\n", "not valid YAML")])
def test_yaml_that_is_not_a_recipe_is_bad_input_in_one_line(tmp_path, text, what):
    f = tmp_path / "config.yml"
    f.write_text(text)
    r = lint(str(f))
    assert isinstance(r.exception, BadInput) and r.exception.exit_code == 2
    msg = str(r.exception.message)
    assert msg.startswith(f"{f}: not a broker recipe") and what in msg and RECIPE_ADVICE in msg
    assert "\n" not in msg and r.exception.hint is None


def test_other_non_script_file_is_bad_input_not_a_syntax_error(tmp_path):
    f = tmp_path / "pyproject.toml"
    f.write_text("[project]\nname = 'x'\n")
    r = lint(str(f))
    assert isinstance(r.exception, BadInput) and r.exception.exit_code == 2 and ".toml" in r.exception.message
    run = tmp_path / "run"  # no suffix, a shebang: still linted
    run.write_text("#!/usr/bin/env python\nprint('hi')\n")
    assert lint(str(run)).exit_code == 0


def test_folder_lints_its_recipes_counts_them_and_skips_other_yaml(tmp_path):
    d = tmp_path / "proj"
    recipe(d, "a.yaml")
    recipe(d / "sub", "b.yml", script="../train.py", extra="workdir: ..\n")
    (d / "train.py").write_text("print('hi')\n")
    (d / "config.yaml").write_text("lr: 0.1\n")  # not a recipe: left alone in a folder
    r = lint(str(d))
    assert r.exit_code == 0 and "3 files (2 recipes): no findings" in r.output, r.output
    (d / "train.py").write_text(BAD_SCRIPT)
    r = lint(str(d), "--json")
    out = json.loads(r.output)
    assert sorted(Path(f).name for f in out["files"]) == ["a.yaml", "b.yml", "train.py"]
    got = sorted((Path(f["path"]).name, f["line"], f["kind"]) for f in out["findings"])
    # the script's findings once each, although it is linted directly and through both recipes
    assert got == [("train.py", 2, "slurm-env-under-torchrun"), ("train.py", 3, "nccl-no-fallback")]
