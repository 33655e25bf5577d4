"""Strict recipes: strict types, no duplicate keys, bounded aliases and nesting, one set of limits, and env values
that reference ${VAR} without the value ever reaching the ledger or --json."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from broker.core import limits
from broker.core.recipe import RecipeError, load_recipe


def write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    p = tmp_path / "r.yaml"
    head = "".join(f"{k}: {v}\n" for k, v in (("name", "j"), ("script", "train.py")) if not body.startswith(f"{k}:"))
    p.write_text(head + textwrap.dedent(body))
    return p


def fails(p: Path, *needles: str) -> str:
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    assert ei.value.exit_code == 2
    return msg


@pytest.mark.parametrize("body, needles", [
    ("nodes: true\n", ["field 'nodes'", "must be a whole number", "True", "whole number from 1 to 64"]),
    ("nodes: '2'\n", ["field 'nodes'", "'2'"]),
    ("nodes: 2.5\n", ["field 'nodes'"]),
    ("gpus_per_node: false\n", ["field 'gpus_per_node'"]),
    ("budget_usd: true\n", ["field 'budget_usd'"]),
    ("budget_usd: '5'\n", ["field 'budget_usd'"]),
    ("max_hours: .inf\n", ["field 'max_hours'"]),
    ("max_hours: 1e9\n", ["field 'max_hours'", "168"]),
    ("cpu_ok: 1\n", ["field 'cpu_ok'", "true or false"]),
    ("strict_lint: 'yes'\n", ["field 'strict_lint'"]),
    ("env: {A: {b: 1}}\n", ["field 'env'", "env A", "not a mapping"]),
    ("env: {A: [1, 2]}\n", ["field 'env'", "not a list"]),
    ("setup: [[echo]]\n", ["field 'setup.0'"]),
    ("args: [[--x]]\n", ["field 'args.0'"]),
    ("expect: [1]\n", ["field 'expect.0'"]),
    ("name: 12\n", ["field 'name'"]),
    ("script: 12\n", ["field 'script'"]),
    ("gpu: {min_mem_gib: .inf}\n", ["field 'gpu.min_mem_gib'", "GiB per GPU"]),
    ("gpu: {models: [4090]}\n", ["field 'gpu.models.0'"]),
    ("disk_gib: 1e308\n", ["field 'disk_gib'"]),
])
def test_strict_types(tmp_path, body, needles):
    p = write(tmp_path, body)
    msg = fails(p, *needles)
    assert f"{p}:3:" in msg or f"{p}:1:" in msg or f"{p}:2:" in msg, msg


def test_numbers_still_accepted_where_they_make_sense(tmp_path):
    r = load_recipe(write(tmp_path, "budget_usd: 5\nmax_hours: 1\nargs: [--epochs, 3, 0.5]\nenv: {A: 1, B: true}\n"
                                    "gpu: {min_mem_gib: 24}\n"))
    assert r.budget_usd == 5.0 and r.max_hours == 1.0 and r.args == ["--epochs", "3", "0.5"]
    assert r.env == {"A": "1", "B": "true"} and r.gpu.min_mem_gib == 24


def test_duplicate_key_names_both_lines(tmp_path):
    p = write(tmp_path, "nodes: 2\ncpu_ok: true\nnodes: 4\n")
    fails(p, f"{p}:5:", "'nodes' appears twice", "first on line 3", "keep one")


def test_duplicate_nested_key(tmp_path):
    p = write(tmp_path, "gpu:\n  min_mem_gib: 8\n  min_mem_gib: 16\n")
    fails(p, f"{p}:5:", "'min_mem_gib' appears twice")


def test_merge_keys_are_not_duplicates(tmp_path):
    p = write(tmp_path, "x_base: &b {min_mem_gib: 8}\n")
    # merge keys (<<) may be overridden by explicit keys; that is YAML, not a duplicate (x_base is still unknown)
    (tmp_path / "r2.yaml").write_text("name: j\nscript: train.py\ngpu:\n  <<: {min_mem_gib: 8}\n  min_mem_gib: 16\n")
    r = load_recipe(tmp_path / "r2.yaml")
    assert r.gpu.min_mem_gib == 16
    fails(p, "unknown field 'x_base'")


BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
args: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_alias_bomb_fails_fast(tmp_path):
    p = write(tmp_path, BOMB)
    t = time.perf_counter()
    fails(p, "aliases")
    assert time.perf_counter() - t < 1.0


def test_few_aliases_but_huge_expansion_fails_fast(tmp_path):
    # 2 aliases per level, 30 levels: 60 aliases (under the bound) but 2**30 values once expanded
    lines = ["l0: &l0 [x, x]"] + [f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, 31)]
    p = write(tmp_path, "\n".join(lines) + "\n")
    t = time.perf_counter()
    fails(p, "expands to more than")
    assert time.perf_counter() - t < 1.0


def test_a_few_aliases_are_fine(tmp_path):
    p = write(tmp_path, "setup: &s [echo hi]\nx-unused: 1\n")
    fails(p, "unknown field 'x-unused'")  # aliases themselves are no error
    (tmp_path / "r3.yaml").write_text("name: j\nscript: train.py\nexpect: &e [DDP_OK]\nartifacts: *e\n")
    assert load_recipe(tmp_path / "r3.yaml").artifacts == ["DDP_OK"]


def test_deep_nesting_is_an_error_not_a_recursion_error(tmp_path):
    p = write(tmp_path, "args: " + "[" * 5000 + "]" * 5000 + "\n")
    fails(p, "nested")


def test_limits_are_one_table(tmp_path):
    """The recipe's bounds come from broker.core.limits: raising a limit there raises it for recipes and flags."""
    lo, hi, *_ = limits.LIMITS["nodes"]
    assert load_recipe(write(tmp_path, f"nodes: {int(hi)}\n")).nodes == hi
    fails(write(tmp_path, f"nodes: {int(hi) + 1}\n"), "field 'nodes'")
    with pytest.raises(Exception, match="--nodes"):
        limits.check_number("--nodes", "nodes", int(hi) + 1)
    limits.check_number("--nodes", "nodes", int(hi))
    _, hmax, *_ = limits.LIMITS["max_hours"]
    assert load_recipe(write(tmp_path, f"max_hours: {hmax:g}\n")).max_hours == hmax
    with pytest.raises(Exception, match="--hours"):
        limits.check_number("--hours", "max_hours", hmax * 2)


# ------------------------------------------------------------------------------------------------ env ${VAR}
def test_env_reference_resolved_but_never_serialized(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "s3cr3t-value")
    p = write(tmp_path, "env: {HF_TOKEN: '${MY_TOKEN}', AUTH: 'Bearer ${MY_TOKEN}', PLAIN: x}\n")
    r = load_recipe(p)
    assert r.env == {"HF_TOKEN": "s3cr3t-value", "AUTH": "Bearer s3cr3t-value", "PLAIN": "x"}
    dumped = r.model_dump(mode="json")
    assert dumped["env"] == {"HF_TOKEN": "${MY_TOKEN}", "AUTH": "Bearer ${MY_TOKEN}", "PLAIN": "x"}
    assert "s3cr3t" not in r.model_dump_json() and "s3cr3t" not in json.dumps(r.model_dump(), default=str)
    assert r.env_references() == ["MY_TOKEN"]
    # copies keep the template (the loader and callers copy recipes)
    assert "s3cr3t" not in r.model_copy(update={"nodes": 3}).model_dump_json()


def test_env_reference_from_dotenv(tmp_path, monkeypatch):
    monkeypatch.delenv("FROM_DOTENV", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("FROM_DOTENV=dotenv-secret\n")
    r = load_recipe(write(tmp_path, "env: {K: '${FROM_DOTENV}'}\n"))
    assert r.env == {"K": "dotenv-secret"}
    assert r.model_dump()["env"] == {"K": "${FROM_DOTENV}"}


def test_env_reference_missing_names_variable_and_line(tmp_path, monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    monkeypatch.chdir(tmp_path)
    p = write(tmp_path, "nodes: 2\nenv:\n  K: '${NOT_SET_ANYWHERE}'\n")
    fails(p, f"{p}:5:", "env.K", "${NOT_SET_ANYWHERE} is not set", "export NOT_SET_ANYWHERE")
    # planning reads the recipe without resolving
    assert load_recipe(p, resolve=False).env == {"K": "${NOT_SET_ANYWHERE}"}


def test_ledger_run_row_keeps_the_reference_not_the_value(tmp_path, monkeypatch, broker_home):
    """The run row's recipe copy and the run folder's recipe.json (pipeline.new_run) hold ${VAR}, never the
    value; the recipe the executors get still has it."""
    from broker.money.ledger import Ledger
    from broker.run.runrecord import new_run

    monkeypatch.setenv("MY_TOKEN", "s3cr3t-value")
    r = load_recipe(write(tmp_path, "env: {HF_TOKEN: '${MY_TOKEN}'}\n"))
    led = Ledger()
    run = new_run(led, r, provider="local", topology="local")
    assert led.get_run(run.id).recipe["env"] == {"HF_TOKEN": "${MY_TOKEN}"}
    assert "s3cr3t" not in (Path(run.run_dir) / "recipe.json").read_text()
    for f in broker_home.rglob("*"):
        if f.is_file():
            assert b"s3cr3t" not in f.read_bytes(), f
    assert r.env["HF_TOKEN"] == "s3cr3t-value"


@pytest.mark.parametrize("body, needles", [
    ("topology: multinode\n", ["field 'topology'", "'multinode'", "did you mean 'multi-node'?", "allowed values:",
                               "simulated"]),
    ("nodes: two\n", ["field 'nodes' must be a whole number, not 'two'", "from 1 to 64"]),
    ("cpu_ok: maybe\n", ["field 'cpu_ok' must be true or false, not 'maybe'"]),
])
def test_type_and_choice_errors_are_sentences_with_the_closest_value(tmp_path, body, needles):
    """The validator's own wording ("Input should be a valid integer", "Input should be 'simulated', ...") with
    no did-you-mean reached the user; the `--topology` flag already named the closest value."""
    msg = fails(write(tmp_path, body), *needles)
    assert "Input should" not in msg, msg
