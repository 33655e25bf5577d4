"""`broker run --interruptible true|false|auto` overrides the recipe's field with the field's own words and errors:
a bad value is refused as the recipe field is (exit 2), the "without checkpoint_dir" warning follows the new value
and names the recipe file to fix, and the value reaches the plan and the rented node (the fake cloud's bid)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import REPO, broker_cmd


def _recipe(tmp_path: Path, extra: str = "") -> Path:
    d = tmp_path / "r"
    d.mkdir(exist_ok=True)
    (d / "job.py").write_text("print('ok', flush=True)\n")
    p = d / "r.yaml"
    p.write_text("name: t\nscript: job.py\nnodes: 1\ncpu_ok: true\ntopology: simulated\nbudget_usd: 5\n"
                 "max_hours: 0.2\n" + extra)
    return p


class _Done:
    def __init__(self, cp: subprocess.CompletedProcess):
        self.exit_code, self.text = cp.returncode, " ".join((cp.stdout + cp.stderr).split())


def _broker(env: dict, *args: str) -> _Done:
    return _Done(subprocess.run(broker_cmd(*args), cwd=REPO, env={**env, "COLUMNS": "200"},
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180))


def _text(r: _Done) -> str:
    return r.text


def test_a_bad_value_is_refused_with_the_recipe_fields_words(tmp_path, cli_env):
    from broker.core.recipe import RecipeError, load_recipe

    cli_env["BROKER_HOME"] = str(tmp_path / "home")
    r = _broker(cli_env, "run", str(_recipe(tmp_path)), "--provider", "local", "--interruptible", "sometimes")
    assert r.exit_code == 2, r.text
    out = _text(r)
    allowed = "true, false or auto (auto: only when the expected cost with restarts is lower)"
    assert "--interruptible 'sometimes' is not one of the allowed values" in out and allowed in out, out
    bad = _recipe(tmp_path, "interruptible: sometimes\n")
    try:
        load_recipe(bad)
    except RecipeError as e:
        assert allowed in " ".join(e.message.split())  # the same words as the recipe field's error
    else:  # pragma: no cover
        raise AssertionError("the recipe field accepted 'sometimes'")
    assert not (tmp_path / "home" / "runs").exists() or not list((tmp_path / "home" / "runs").iterdir())
    p = _broker(cli_env, "plan", "--offline", "--interruptible", "sometimes")
    assert p.exit_code == 2 and allowed in _text(p)  # broker plan says the same
    assert "-> e.g. --interruptible auto" in _text(p)
    # the recipe reads `interruptible: yes` (a YAML boolean) as true: the flag takes the same word
    y = _broker(cli_env, "plan", "--offline", "--budget", "5", "--interruptible", "yes")
    assert y.exit_code == 0, y.text


def test_true_without_checkpoint_dir_warns_naming_the_flag_and_the_file_to_fix(tmp_path, cli_env):
    cli_env["BROKER_HOME"] = str(tmp_path / "home")
    path = _recipe(tmp_path)
    r = _broker(cli_env, "run", str(path), "--provider", "local", "--interruptible", "True", "-q")
    out = _text(r)
    assert r.exit_code == 0, out
    assert (f"--interruptible true without 'checkpoint_dir:': after a preemption the job restarts from the "
            f"beginning; set checkpoint_dir: in {path.resolve()}") in out, out
    (run_dir,) = (tmp_path / "home" / "runs").iterdir()
    assert json.loads((run_dir / "recipe.json").read_text())["interruptible"] == "true"


def test_false_overrides_a_recipes_true_and_drops_its_warning(tmp_path, cli_env):
    from broker.core.recipe import load_recipe

    path = _recipe(tmp_path, "interruptible: true\n")
    rec = load_recipe(path)
    assert any("without 'checkpoint_dir:'" in w for w in rec.warnings)
    off = rec.with_interruptible("false")
    assert off.interruptible == "false" and not any("checkpoint_dir" in w for w in off.warnings)
    assert rec.interruptible == "true" and rec.warnings  # the loaded recipe is unchanged
    assert rec.with_interruptible(None) is rec
    cli_env["BROKER_HOME"] = str(tmp_path / "home")
    r = _broker(cli_env, "run", str(path), "--provider", "local", "--interruptible", "false", "-q")
    assert r.exit_code == 0 and "checkpoint_dir" not in _text(r) and "does not apply" not in _text(r), _text(r)


def test_the_flag_reaches_the_plan_and_the_rented_node(tmp_path, fake_cloud, cli_env):
    """On-demand in the recipe, --interruptible true on the command line: the fake cloud's node is rented with a
    bid (the ledger's interruptible attrs), and recipe.json records the value the run used."""
    from broker.money.ledger import Ledger

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    env = {**cli_env, "BROKER_HOME": os.environ["BROKER_HOME"], "BROKER_FAKE_STATE": os.environ["BROKER_FAKE_STATE"]}
    path = _recipe(tmp_path, "checkpoint_dir: ck\n")
    r = _broker(env, "run", str(path), "--provider", "fake", "--yes", "--no-watchdog", "-q", "--interruptible", "true")
    assert r.exit_code == 0, _text(r)
    with Ledger(tmp_path / "home" / "ledger.sqlite") as led:
        (run,) = led.list_runs()
        inst = [x for x in led.resources(run.id) if x.kind == "instance"]
    assert inst and all(x.attrs.get("interruptible") is True for x in inst), [x.attrs for x in inst]
    assert json.loads(Path(run.run_dir, "recipe.json").read_text())["interruptible"] == "true"
    r = _broker(env, "run", str(path), "--provider", "fake", "--yes", "--no-watchdog", "-q")
    assert r.exit_code == 0, _text(r)
    with Ledger(tmp_path / "home" / "ledger.sqlite") as led:
        last = max(led.list_runs(), key=lambda x: x.started_at)
        inst = [x for x in led.resources(last.id) if x.kind == "instance"]
    assert inst and not any(x.attrs.get("interruptible") for x in inst)  # the recipe's false without the flag


def test_a_detached_run_gets_the_flags_value(tmp_path, monkeypatch):
    """`broker run -d --interruptible Auto`: the background process is started with the checked value."""
    from typer.testing import CliRunner

    import broker.cli.run as run_mod
    from broker.cli.app import app

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    seen: list[list[str]] = []
    values: list[str] = []

    def fake_detached(argv, recipe, **_kw) -> int:
        seen.append(list(argv))
        values.append(recipe.interruptible)
        return 0

    monkeypatch.setattr(run_mod, "run_detached", fake_detached)
    path = _recipe(tmp_path, "checkpoint_dir: ck\n")
    r = CliRunner().invoke(app, ["run", str(path), "-d", "--provider", "local", "--interruptible", "Auto"])
    assert r.exit_code == 0, r.output
    (argv,) = seen
    assert argv[argv.index("--interruptible") + 1] == "auto"
    r = CliRunner().invoke(app, ["run", str(path), "-d", "--provider", "local"])
    assert r.exit_code == 0, r.output
    assert "--interruptible" not in seen[-1]  # the recipe's own value: nothing to pass on
    assert values == ["auto", "false"]
