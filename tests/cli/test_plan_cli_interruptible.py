"""`broker plan` with interruptible capacity: --interruptible, the side-by-side comparison with on-demand and what
the interruptible option saves, from the shipped snapshots (offline, no network)."""

from __future__ import annotations

import json
import subprocess
import textwrap

from tests.conftest import REPO, broker_cmd


def _plan(cli_env, *args, columns="100"):
    env = dict(cli_env, COLUMNS=columns, AWS_EC2_METADATA_DISABLED="true")
    for k in ("VAST_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "OCI_CONFIG_FILE"):
        env.pop(k, None)
    return subprocess.run(broker_cmd("plan", "--offline", *args), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


BASE = ("--gpu", "RTX 4090", "--nodes", "1", "--budget", "5", "--hours", "2", "-p", "vast")


def test_auto_chooses_interruptible_and_shows_both(cli_env):
    p = _plan(cli_env, *BASE, "--interruptible", "auto")
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "simulated int." in out and "exp" in out
    assert "interruptible saves $" in out and "on-demand vast 1x RTX 4090" in out
    assert "auto chose the interruptible option" in out
    assert "worst case covers 4 attempts" in out


def test_default_false_plans_on_demand_and_says_what_it_would_save(cli_env):
    p = _plan(cli_env, *BASE, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["chosen"]["interruptible"] is False
    assert not any(o["interruptible"] for o in doc["plan"]["options"])
    assert any("interruptible saves" in n for n in doc["plan"]["notes"])
    assert any("interruptible: auto" in n for n in doc["plan"]["notes"])


def test_true_json_chosen_carries_bid_and_restart_model(cli_env):
    p = _plan(cli_env, *BASE, "--interruptible", "true", "--json")
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)["chosen"]
    assert c["interruptible"] is True and c["max_restarts"] == 3
    assert c["expected_usd"] < c["worst_case_usd"] and c["preemptions_per_hour"] > 0
    o = c["offers"][0]["attrs"]
    assert o["interruptible"] is True and o["bid_usd_per_hour"] and o["on_demand_usd_per_hour"] > o["bid_usd_per_hour"]


def test_recipe_fields_reach_the_plan(cli_env, tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    r = tmp_path / "r.yaml"
    r.write_text(textwrap.dedent("""\
        name: spot
        script: train.py
        nodes: 1
        gpus_per_node: 1
        gpu: {models: [RTX 4090]}
        budget_usd: 5
        max_hours: 2
        interruptible: true
        checkpoint_dir: ck
        max_restarts: 1
        """))
    p = _plan(cli_env, "--recipe", str(r), "-p", "vast", "--json")
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)["chosen"]
    assert c["interruptible"] is True and c["max_restarts"] == 1


def test_bad_flag_value_is_bad_input(cli_env):
    p = _plan(cli_env, *BASE, "--interruptible", "sometimes")
    assert p.returncode == 2
    assert "--interruptible" in p.stderr and "true, false or auto" in " ".join(p.stderr.split())
