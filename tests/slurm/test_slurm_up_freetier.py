"""Free-tier machines as $0.00 options for CPU-only jobs (issue 17 item 5): OCI Always Free (2 E2.1.Micro per
tenancy; A1 within 4 OCPUs) and AWS free-tier types (750 instance-hours a month), from the dated snapshot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from broker.plan.catalog import SHIPPED_DIR
from broker.core.model import Requirements
from broker.plan.planner import free_tier_offers, parse_free_tier, plan

REPO = Path(__file__).resolve().parents[2]
TEXT = (SHIPPED_DIR / "free_tier.csv").read_text()


def req(nodes: int = 2, hours: float = 1.0, gpus: int = 0, providers=("oci", "aws")) -> Requirements:
    return Requirements(nodes=nodes, gpus_per_node=gpus, cpu_ok=True, hours=hours, budget_usd=1.0,
                        topology="multi-node", providers=list(providers))


def chosen(r: Requirements):
    p = plan(r, free_tier_offers(r, TEXT))
    return p, {o.offers[0].instance_type for o in p.options}


def test_snapshot_is_dated_and_marks_its_assumptions():
    meta, offers = parse_free_tier(TEXT)
    assert meta["date"] == "2026-11-30" and "unconfirmed" in meta["source"]
    assert "ASSUMPTION (2026-11-30)" in TEXT and "A1" in TEXT
    assert {o.instance_type for o in offers} == {"VM.Standard.E2.1.Micro", "VM.Standard.A1.Flex", "t3.micro",
                                                 "t2.micro"}
    assert all(o.usd_per_hour == 0 and o.gpu_count == 0 for o in offers)


def test_free_tier_only_for_cpu_only_jobs():
    assert free_tier_offers(req(gpus=1), TEXT) == []
    assert free_tier_offers(Requirements(nodes=2, gpus_per_node=0, cpu_ok=False), TEXT) == []
    assert {o.provider for o in free_tier_offers(req(providers=("oci",)), TEXT)} == {"oci"}


def test_two_nodes_are_free_on_every_free_type():
    p, types = chosen(req(2))
    assert p.chosen is not None and p.chosen.worst_case_usd == 0.0 and p.chosen.usd_per_hour == 0.0
    assert {"VM.Standard.E2.1.Micro", "VM.Standard.A1.Flex", "t3.micro", "t2.micro"} <= types


def test_limits_two_micro_per_tenancy_four_a1_ocpus_750_aws_hours():
    p, types = chosen(req(3))
    assert "VM.Standard.E2.1.Micro" not in types and "VM.Standard.A1.Flex" in types
    why = [r for o in p.rejected for r in o.rejected if "E2.1.Micro" in r]
    assert why and "3 node(s) > 2 instances per tenancy" in why[0]
    _, types = chosen(req(5, hours=1))
    assert not types & {"VM.Standard.E2.1.Micro", "VM.Standard.A1.Flex"} and "t3.micro" in types
    p, types = chosen(req(2, hours=400))  # 800 instance-hours > 750 a month
    assert not types & {"t3.micro", "t2.micro"}
    assert any("2 node(s) x 400 h > 750 instance-hours a month" in r for o in p.rejected for r in o.rejected)


def test_broker_plan_cpu_only_answers_free(cli_env):
    cp = subprocess.run([sys.executable, "-m", "broker", "plan", "--recipe", "recipes/ddp_2node.yaml", "--cpu-only",
                         "--provider", "oci", "--json"], cwd=REPO, env=cli_env, capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 0, cp.stderr
    out = json.loads(cp.stdout)
    c = out["chosen"]
    assert c["usd_per_hour"] == 0 and c["worst_case_usd"] == 0 and c["gpus_per_node"] == 0
    assert c["offers"][0]["instance_type"] in ("VM.Standard.E2.1.Micro", "VM.Standard.A1.Flex")
    assert any("free tier (2026-11-30)" in n for n in out["plan"]["notes"])
    # without --cpu-only the same recipe gets no free cloud option
    cp = subprocess.run([sys.executable, "-m", "broker", "plan", "--recipe", "recipes/ddp_2node.yaml",
                         "--provider", "oci", "--json"], cwd=REPO, env=cli_env, capture_output=True, text=True,
                        timeout=120)
    assert json.loads(cp.stdout)["chosen"]["usd_per_hour"] > 0


def write_recipe(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "train.py").write_text("print('ok')\n")
    p = tmp_path / "cpu.yaml"
    p.write_text(f"name: cpu\nscript: train.py\nnodes: 2\nmax_hours: 0.5\n{extra}")
    return p


def test_recipe_gpus_per_node_0_is_a_cpu_only_job(tmp_path):
    from broker.core.recipe import RecipeError, load_recipe

    r = load_recipe(write_recipe(tmp_path, "gpus_per_node: 0\ncpu_ok: true\n"))
    assert r.cpu_only and r.gpus_per_node == 1  # one gloo process per node for the launchers
    assert r.requirements().gpus_per_node == 0 and r.requirements().cpu_ok
    with pytest.raises(RecipeError, match="cpu_ok"):
        load_recipe(write_recipe(tmp_path, "gpus_per_node: 0\n"))
    assert not load_recipe(write_recipe(tmp_path, "gpus_per_node: 1\ncpu_ok: true\n")).cpu_only


def test_broker_plan_of_a_cpu_only_recipe_is_free(tmp_path, cli_env):
    p = write_recipe(tmp_path, "gpus_per_node: 0\ncpu_ok: true\n")
    cp = subprocess.run([sys.executable, "-m", "broker", "plan", "--recipe", str(p), "--provider", "aws", "--json"],
                        cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    c = json.loads(cp.stdout)["chosen"]
    assert c["worst_case_usd"] == 0 and c["offers"][0]["instance_type"] in ("t2.micro", "t3.micro")
