"""`broker plan` output that a new-user trial found wrong: what an interruptible choice still needs, the rejected
counts and rows under --interruptible, and what interruptible saves per row (offline, the shipped snapshots)."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap

import pytest

from tests.conftest import REPO, broker_cmd


def _plan(cli_env, *args, columns="100"):
    env = dict(cli_env, COLUMNS=columns, AWS_EC2_METADATA_DISABLED="true")
    for k in ("VAST_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "OCI_CONFIG_FILE"):
        env.pop(k, None)
    return subprocess.run(broker_cmd("plan", "--offline", *args), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_interruptible_needs_names_only_what_the_recipe_lacks():
    from broker.cli.plan import interruptible_needs

    assert interruptible_needs("true", ("true", "checkpoints")) == ""
    assert interruptible_needs("auto", ("auto", "ck")) == ""
    assert interruptible_needs("true", ("true", None)) == "; the run needs a `checkpoint_dir:` in the recipe to resume from"
    assert interruptible_needs("auto", ("false", "ck")) == (
        "; the run needs `interruptible: auto` in the recipe (or `broker run --interruptible auto`)")
    both = interruptible_needs("true", None)  # no recipe: both
    assert "`interruptible: true`" in both and "checkpoint_dir" in both


def test_ddp_spot_plan_does_not_ask_for_what_the_recipe_has(cli_env):
    p = _plan(cli_env, "--recipe", "recipes/ddp_spot.yaml")
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "interruptible: expected $" in out, out
    assert "the run needs" not in out, out


def test_a_recipe_without_checkpoint_dir_is_told_to_set_one(cli_env, tmp_path):
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
        """))
    p = _plan(cli_env, "--recipe", str(r), "-p", "vast", "--interruptible", "true")
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert ("the run needs `interruptible: true` in the recipe (or `broker run --interruptible true`) and a "
            "`checkpoint_dir:` in the recipe to resume from") in out, out


def _groups(plan: dict) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for o in plan["rejected"]:
        out.setdefault(o["reason_kind"], []).append(o["worst_case_usd"])
    return out


@pytest.mark.parametrize("mode", ["auto", "true"])
def test_interruptible_rejected_counts_text_equals_json_capped_and_in_cost_order(cli_env, mode):
    args = ("--budget", "5", "--interruptible", mode)
    doc = json.loads(_plan(cli_env, *args, "--json").stdout)["plan"]
    counts = doc["rejected_counts"]
    n = sum(counts.values())
    by = ", ".join(f"{k} {v:,}" for k, v in counts.items())
    text = " ".join(_plan(cli_env, *args).stdout.split())
    assert f"note: {n:,} options rejected ({by}); showing the cheapest 5 per reason" in text, text
    assert text.count("options rejected (") == 1, text  # no stale on-demand-only count beside it
    groups = _groups(doc)
    assert sum(len(v) for v in groups.values()) == len(doc["rejected"])
    for kind, costs in groups.items():
        assert len(costs) <= 5, (kind, costs)
        assert costs == sorted(costs), (kind, costs)
    assert set(groups) <= set(counts)
    if mode == "auto":  # the interruptible rejections are counted and can be shown
        od = json.loads(_plan(cli_env, "--budget", "5", "--json").stdout)["plan"]["rejected_counts"]
        assert n > sum(od.values()), (counts, od)


def test_on_demand_rejected_rows_are_in_cost_order(cli_env):
    doc = json.loads(_plan(cli_env, "--budget", "5", "--json").stdout)["plan"]
    for kind, costs in _groups(doc).items():
        assert costs == sorted(costs), (kind, costs)


def test_each_interruptible_row_shows_what_it_saves_on_the_same_machine(cli_env):
    from broker.cli.plan import saves_text
    from broker.core.model import PlanOption

    doc = json.loads(_plan(cli_env, "--budget", "5", "--interruptible", "auto", "--json").stdout)["plan"]
    spot = [o for o in doc["options"] if o["interruptible"]]
    assert spot and all(o["on_demand_usd_per_hour"] is None for o in doc["options"] if not o["interruptible"])
    for o in spot:  # the same offers' on-demand prices, not the cheapest on-demand row's
        od_minus_pay = sum(x["attrs"]["on_demand_usd_per_hour"] - x["usd_per_hour"] for x in o["offers"])
        assert abs(o["on_demand_usd_per_hour"] - (o["usd_per_hour"] + od_minus_pay)) < 1e-9, o
        assert o["on_demand_usd_per_hour"] > o["usd_per_hour"]
    lines = _plan(cli_env, "--budget", "5", "--interruptible", "auto", columns="80").stdout.splitlines()
    assert max(len(x) for x in lines if x.startswith(" ")) <= 80  # the tables (BROKER_NO_WRAP: prose unwrapped)
    # within 80 columns each interruptible row says so under its topology and its saving under its $/h
    assert " off " not in next(x for x in lines if "provider" in x and "max h" in x)
    under = [x.split() for x in lines if x.startswith(" ") and x.strip().startswith("int.")]
    assert under and all(len(u) == 2 and re.fullmatch(r"-\d+%", u[1]) for u in under), under
    assert any("-N% under a $/h = that much below the same machine on demand" in x for x in lines)
    wide = _plan(cli_env, "--budget", "5", "--interruptible", "auto", columns="200").stdout.splitlines()
    assert " off " in next(x for x in wide if "provider" in x and "max h" in x)
    rows = [x for x in wide if " int. " in x]
    assert rows and all(re.search(r"\$[\d.]+\s+\$[\d.]+\s+\$[\d.]+\s+\d+%\s", x) for x in rows), rows  # $/h worst exp off
    assert any("off = its $/h below the same machine on demand" in x for x in wide)
    g = spot[0]
    opt = PlanOption(provider="x", topology="simulated", nodes=1, gpus_per_node=1, usd_per_hour=0.4,
                     worst_case_usd=1, hours=1, interruptible=True, on_demand_usd_per_hour=1.0)
    assert saves_text(opt) == "60%" and g
    assert saves_text(PlanOption(provider="x", topology="simulated", nodes=1, gpus_per_node=1, usd_per_hour=0.4,
                                 worst_case_usd=1, hours=1)) == ""


def test_an_interruptible_plan_fits_80_columns_with_every_name_whole(cli_env):
    """--interruptible true at 80 columns printed an 83-column table (84 on a terminal) and cut GCP's machine names
    (``n1-standard-4+`` / ``t4``): the interruptible mark and the saving now sit under the topology and the $/h."""
    lines = _plan(cli_env, "--budget", "5", "--interruptible", "true", columns="80").stdout.splitlines()
    top = lines.index(next(x for x in lines if "provider" in x and "max h" in x))
    table = lines[top:lines.index("", top)]
    assert max(len(x) for x in table) <= 80, table
    named = [x for x in table if "n1-standard-4+t4" in x]
    assert named and not any(x.rstrip().endswith(("n1-standard-4+", "n1-standard")) for x in table), table


def test_a_machine_refused_alike_in_two_zones_is_one_row_naming_both(cli_env, tmp_path):
    env = dict(cli_env, BROKER_FAKE_STATE=str(tmp_path / "fake.json"))
    p = _plan(env, "--budget", "0.01", "--provider", "fake", columns="200")
    assert p.returncode != 0
    rows = [ln for ln in p.stdout.splitlines() if ln.lstrip().startswith("fake ")]
    assert rows and len(rows) == len(set(rows)), p.stdout  # no two rows alike
    assert "(same in 2 zones: fake-zone-1, fake-zone-2)" in p.stdout, p.stdout
    doc = json.loads(_plan(env, "--budget", "0.01", "--provider", "fake", "--json").stdout)["plan"]
    zones = [o["offers"][0]["zone"] for o in doc["rejected"] if o["offers"]]
    assert {"fake-zone-1", "fake-zone-2"} <= set(zones)  # --json keeps every option


def test_the_interruptible_model_is_named_only_beside_its_numbers(cli_env, tmp_path):
    env = dict(cli_env, BROKER_FAKE_STATE=str(tmp_path / "fake.json"))
    none = _plan(env, "--budget", "0.01", "--provider", "fake")  # nothing valid, nothing interruptible compared
    both = none.stdout + none.stderr
    assert "no valid plan" in both and "interruptible model" not in both, both
    some = _plan(env, "--budget", "5", "--provider", "fake")
    assert "interruptible model" in " ".join(some.stdout.split()), some.stdout


def test_a_wide_terminal_gets_every_column_only_where_they_fit_whole(cli_env):
    """At 120 columns (every column by default) an interruptible plan printed a 175-column table: its price
    sources were not shortened and the GPU/prices/where columns cannot fit beside exp and off.  A wide terminal now
    gets every column where they fit whole, else the narrow layout; --wide still asks for every column."""
    from broker.cli.plan import source_short

    assert source_short("interruptible: bid 10% over snapshot 2026-11-29 (vast.ai)") == "bid+10% snap 11-29"
    assert source_short("interruptible: snapshot 2026-12-01 (third-party list prices)") == "snap 12-01"
    assert source_short("interruptible: live Vast.ai search") == "live"
    for mode in ("true", "auto", "false"):
        lines = _plan(cli_env, "--budget", "5", "--interruptible", mode, columns="120").stdout.splitlines()
        top = lines.index(next(x for x in lines if "provider" in x and "max h" in x))
        table = lines[top:lines.index("", top)]
        assert max(len(x) for x in table) <= 120, (mode, table)
        assert not any(x.rstrip().endswith(("n1-standar", "n1-standard-4+", "2 x")) for x in table), (mode, table)
    wide = _plan(cli_env, "--budget", "5", "--interruptible", "true", "--wide", columns="120").stdout
    assert " prices " in wide and "bid+10% snap " in wide and "interruptible: bid" not in wide.split("note:")[0]
