"""Recipe schema and loader: every field, good and bad; errors name file, line, field and the fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from broker.core.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, body: str, script: bool = True) -> Path:
    if script:
        (tmp_path / "train.py").write_text("print('hi')\n")
    p = tmp_path / "r.yaml"
    p.write_text(textwrap.dedent(body))
    return p


GOOD = """\
name: job-1
script: train.py
args: ["--epochs", 3, 0.5]
env: {A: 1, B: true, C: x}
setup: ["echo hi"]
nodes: 3
gpus_per_node: 2
gpu: {models: [A10, "RTX 4090"], min_mem_gib: 20}
topology: multi-node
cpu_ok: true
budget_usd: 7.5
max_hours: 0.25
expect: ["DDP_OK", "acc=0\\\\.9"]
artifacts: [checkpoint.pt]
disk_gib: 60
image: pytorch/pytorch:latest
idle_minutes: 10
strict_lint: true
"""


def test_shipped_recipe_loads():
    r = load_recipe(REPO / "recipes" / "ddp_2node.yaml")
    assert r.name == "ddp-2node" and r.nodes == 2 and r.gpus_per_node == 1 and r.cpu_ok
    assert r.script == (REPO / "recipes" / "ddp_train.py").resolve()
    assert r.workdir == (REPO / "recipes").resolve()
    assert r.world_size == 2
    assert "DDP_OK" in r.expect


def test_every_field_good(tmp_path):
    r = load_recipe(write(tmp_path, GOOD))
    assert r.args == ["--epochs", "3", "0.5"]
    assert r.env == {"A": "1", "B": "true", "C": "x"}
    assert r.setup == ["echo hi"]
    assert (r.nodes, r.gpus_per_node, r.world_size) == (3, 2, 6)
    assert r.gpu.models == ["A10", "RTX 4090"] and r.gpu.min_mem_gib == 20
    assert r.topology == "multi-node" and r.cpu_ok is True
    assert r.budget_usd == 7.5 and r.max_hours == 0.25
    assert r.expect == ["DDP_OK", "acc=0\\.9"]
    assert r.artifacts == ["checkpoint.pt"] and r.disk_gib == 60 and r.idle_minutes == 10 and r.strict_lint
    req = r.requirements()
    assert (req.nodes, req.gpus_per_node, req.min_gpu_mem_gib, req.hours, req.budget_usd) == (3, 2, 20, 0.25, 7.5)
    assert req.gpu_names == ["A10", "RTX 4090"] and req.topology == "multi-node" and req.cpu_ok


def test_defaults(tmp_path):
    r = load_recipe(write(tmp_path, "name: j\nscript: train.py\n"))
    assert (r.nodes, r.gpus_per_node, r.topology, r.cpu_ok, r.max_hours, r.budget_usd) == (2, 1, "any", False, 1.0, 5.0)
    assert r.workdir == tmp_path.resolve()


@pytest.mark.parametrize("body, line, needles", [
    ("name: j\nscript: train.py\nnodse: 2\n", 3, ["unknown field 'nodse'", "did you mean 'nodes'"]),
    ("name: j\nscript: train.py\ngpu:\n  min_mem: 3\n", 4, ["unknown field 'gpu.min_mem'", "did you mean 'min_mem_gib'"]),
    ("name: j\nscript: train.py\nzzz: 1\n", 3, ["unknown field 'zzz'", "allowed fields:"]),
    ("name: j\nscript: train.py\ntopology: ring\n", 3, ["field 'topology'", "simulated, multi-node, any", "'ring'"]),
    ("name: j\nscript: train.py\nnodes: 0\n", 3, ["field 'nodes'", "from 1 to 64"]),
    ("name: j\nscript: train.py\nnodes: two\n", 3, ["field 'nodes'", "whole number"]),
    ("name: j\nscript: train.py\ngpus_per_node: 17\n", 3, ["field 'gpus_per_node'"]),
    ("name: j\nscript: train.py\nbudget_usd: -1\n", 3, ["field 'budget_usd'", "US dollars"]),
    ("name: j\nscript: train.py\nmax_hours: 0\n", 3, ["field 'max_hours'", "hours"]),
    ("name: j\nscript: train.py\ncpu_ok: maybe\n", 3, ["field 'cpu_ok'", "true or false"]),
    ("name: j\nscript: train.py\nexpect: ['(']\n", 3, ["field 'expect'", "not a valid regular expression"]),
    ("name: j\nscript: train.py\nenv: {'BAD NAME': 1}\n", 3, ["field 'env'", "not a valid environment variable"]),
    ("name: j\nscript: train.py\nsetup: 5\n", 3, ["field 'setup'", "shell command"]),
    ("name: 'bad name!'\nscript: train.py\n", 1, ["field 'name'", "letters, digits"]),
    ("name: j\nscript: train.py\ngpu: {min_mem_gib: -2}\n", 3, ["field 'gpu.min_mem_gib'"]),
])
def test_bad_field_names_file_line_field_and_fix(tmp_path, body, line, needles):
    p = write(tmp_path, body)
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    msg = str(ei.value)
    assert f"{p}:{line}:" in msg, msg
    for n in needles:
        assert n in msg, msg
    assert ei.value.exit_code == 2


def test_missing_required(tmp_path):
    with pytest.raises(RecipeError, match=r"missing required field 'script'"):
        load_recipe(write(tmp_path, "name: j\n"))


def test_missing_script_file(tmp_path):
    p = write(tmp_path, "name: j\nscript: nope.py\n", script=False)
    with pytest.raises(RecipeError, match=r"r.yaml:2: field 'script': nope.py does not exist"):
        load_recipe(p)


def test_script_outside_workdir(tmp_path):
    (tmp_path / "sub").mkdir()
    p = write(tmp_path, "name: j\nscript: train.py\nworkdir: sub\n")
    with pytest.raises(RecipeError, match="outside workdir"):
        load_recipe(p)


def test_not_yaml_and_not_mapping(tmp_path):
    p = write(tmp_path, "name: j\nscript: [unclosed\n")
    with pytest.raises(RecipeError, match=r"r.yaml:\d+: not valid YAML"):
        load_recipe(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        load_recipe(p)


def test_no_such_file(tmp_path):
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "missing.yaml")
