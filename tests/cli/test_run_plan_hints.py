"""What `broker run` says around its plan step: a suggested `broker plan` / `broker run` command carries the
--interruptible flag that produced the situation, and `interruptible: auto` without a checkpoint_dir warns only
when the plan chose an interruptible option (this machine and on-demand capacity are never preempted)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from broker.core.model import Offer, Plan, PlanOption, Requirements
from broker.core.recipe import load_recipe


def _recipe(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "job.py").write_text("print('ok', flush=True)\n")
    p = tmp_path / "r.yaml"
    p.write_text("name: t\nscript: job.py\nnodes: 2\ncpu_ok: true\nbudget_usd: 5\nmax_hours: 0.2\n" + extra)
    return p


def test_plan_hints_carry_the_interruptible_flag(tmp_path):
    from broker.run.planstep import free_try_hint, local_choice_text

    r = load_recipe(_recipe(tmp_path)).with_interruptible("true")
    hint = free_try_hint(r)
    assert "--recipe" in hint and "r.yaml --interruptible true` shows the interruptible option" in hint, hint
    assert "--provider local --interruptible true`" in hint, hint
    plan = Plan(requirements=Requirements(budget_usd=5), options=[], valid_count=55)
    auto = load_recipe(_recipe(tmp_path)).with_interruptible("auto")
    assert "r.yaml --interruptible auto` lists them" in local_choice_text(plan, auto)
    plain = load_recipe(_recipe(tmp_path))  # the recipe's own value: nothing to add
    assert "--interruptible" not in free_try_hint(plain) and "--interruptible" not in local_choice_text(plan, plain)


def test_auto_without_checkpoint_dir_waits_for_the_plan(tmp_path):
    r = load_recipe(_recipe(tmp_path, "interruptible: auto\n"))
    assert not any("checkpoint_dir" in w for w in r.warnings)  # auto may choose on-demand or this machine
    w = r.chosen_interruptible_warning()
    assert w and "interruptible: auto without 'checkpoint_dir:'" in w and "r.yaml:7" in w, w
    f = load_recipe(_recipe(tmp_path)).with_interruptible("auto")
    assert not any("checkpoint_dir" in w for w in f.warnings)
    assert "--interruptible auto without 'checkpoint_dir:'" in (f.chosen_interruptible_warning() or "")
    assert load_recipe(_recipe(tmp_path, "interruptible: auto\ncheckpoint_dir: ck\n")).chosen_interruptible_warning() is None
    t = load_recipe(_recipe(tmp_path)).with_interruptible("true")  # true rents interruptible capacity only: at once
    assert any("without 'checkpoint_dir:'" in w for w in t.warnings) and t.chosen_interruptible_warning() is None


def _option(provider: str, interruptible: bool) -> PlanOption:
    o = Offer(provider=provider, offer_id="1", instance_type="x", region="r", zone=None, gpu_name="T4", gpu_count=1,
              gpu_mem_gib=16, vcpus=4, ram_gib=16, usd_per_hour=0.1, price_source="test",
              price_time=datetime(2026, 12, 1, tzinfo=timezone.utc))
    return PlanOption(provider=provider, topology="local" if provider == "local" else "simulated", offers=[o],
                      nodes=2, gpus_per_node=1, usd_per_hour=0.1, worst_case_usd=0.1, hours=0.2,
                      interruptible=interruptible)


@pytest.mark.parametrize("chosen,warns", [("local", False), ("od", False), ("spot", True)])
def test_choose_target_warns_only_for_an_interruptible_choice(tmp_path, monkeypatch, chosen, warns):
    from broker.run import pipeline

    opt = {"local": _option("local", False), "od": _option("fake", False), "spot": _option("fake", True)}[chosen]
    plan = Plan(requirements=Requirements(budget_usd=5), options=[opt], valid_count=3)
    monkeypatch.setattr(pipeline, "plan_for_run", lambda recipe, p: (plan, [opt]))
    r = load_recipe(_recipe(tmp_path)).with_interruptible("auto")
    said: list[str] = []
    pipeline.choose_target(r, pipeline.RunRequest(), say=said.append)
    text = " ".join(said)
    assert ("after a preemption the job restarts from the beginning" in text) is warns, said
