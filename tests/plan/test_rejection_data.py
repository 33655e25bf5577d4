"""Rejections are data: the planner stores each reason's kind (and the command or setting that lifts it) beside
its text, and the no-plan explanation, the hints and ``--json`` read that data, never the reason's first words."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from broker.core.model import Plan, PlanOption, Quota, Rejection, RejectionKind, Requirements, to_json
from broker.plan.explain import no_plan_error, no_plan_hints
from broker.plan.planner import plan
from broker.providers.fake import FakeProvider
from broker.providers.local import LocalProvider
from tests.plan.test_planner import mk


def _reworded(p: Plan) -> Plan:
    """``p`` with every reason's words replaced by words no reader could recognise (kind, next step and the
    setting that lifts it kept), as a later rewording of the planner's sentences would do."""
    n = iter(range(10**6))

    def opt(o: PlanOption) -> PlanOption:
        return replace(o, rejected=[r.reworded(f"raison {next(n)}: pas possible") for r in o.rejected])

    return replace(p, options=[opt(o) for o in p.options], rejected=[opt(o) for o in p.rejected])


def _recipe(**kw):
    base = dict(name="tiny", nodes=2, gpus_per_node=1, budget_usd=0.05, max_hours=0.5, cpu_ok=True, path="t.yaml")
    return SimpleNamespace(**{**base, **kw})


def _req(r, **kw) -> Requirements:
    return Requirements(nodes=r.nodes, gpus_per_node=r.gpus_per_node, cpu_ok=r.cpu_ok, budget_usd=r.budget_usd,
                        hours=r.max_hours, **kw)


def _budget_case():
    r = _recipe()
    req = _req(r)
    return r, plan(req, FakeProvider().offers(req))


def _no_gpu_here_case():
    r = _recipe(cpu_ok=False, budget_usd=100, max_hours=1)
    req = _req(r, providers=["local"])
    return r, plan(req, [], unavailable={"local": LocalProvider(gpus=[]).why_not(req)})


def _gpu_model_case():
    r = _recipe(budget_usd=100, max_hours=1)
    req = _req(r, gpu_names=["H300"])
    return r, plan(req, FakeProvider().offers(req))


def _quota_case():
    r = _recipe(budget_usd=10, max_hours=1, nodes=2)
    g5 = mk("aws", "g5.xlarge", 1, 24, 1.006, region="us-east-1", name="A10G", vcpus=4)
    q = Quota(provider="aws", name="L-DB2E81BA", region="us-east-1", scope="us-east-1", limit=4, unit="vcpus",
              instance_types=["g5.xlarge"])
    return r, plan(_req(r, topology="multi-node"), [g5], [q])


def _mixed_cpu_ok_case():
    """Budget rejections beside this machine's "no GPU": the cpu_ok hint rides along with the others."""
    r = _recipe(cpu_ok=False, budget_usd=0.05, max_hours=0.5)
    req = _req(r)
    return r, plan(req, FakeProvider().offers(req),
                   unavailable={"local": LocalProvider(gpus=[]).why_not(Requirements(nodes=2, gpus_per_node=1))})


CASES = {"budget": _budget_case, "no-gpu-here": _no_gpu_here_case, "gpu-model": _gpu_model_case,
         "quota": _quota_case, "mixed": _mixed_cpu_ok_case}


@pytest.mark.parametrize("case", CASES)
def test_rewording_a_reason_changes_no_hint(case):
    r, p = CASES[case]()
    assert p.chosen is None and p.rejected
    q = _reworded(p)
    assert all(r.startswith("raison ") for o in q.rejected for r in o.rejected)  # the words really changed
    for cpu_ok in (False, True):
        kw = dict(cpu_ok=cpu_ok, budget_given=True)
        assert no_plan_hints(q, **kw) == no_plan_hints(p, **kw)
    before, after = no_plan_error(r, p), no_plan_error(r, q)
    assert after.hint == before.hint
    # the message quotes reasons (reworded there, as it should be) but says the same about the budget
    assert ("the budget is the limit" in after.message) == ("the budget is the limit" in before.message)


def test_hints_follow_the_kinds_each_case_produces():
    assert "raise budget_usd to at least $0.90" in no_plan_error(*_budget_case()).hint
    assert no_plan_hints(_no_gpu_here_case()[1], cpu_ok=False, budget_given=True)[0].startswith(
        "this machine has no GPU: add --cpu-ok")
    assert "no offer has GPU model H300" in no_plan_hints(_gpu_model_case()[1], cpu_ok=True, budget_given=True)[0]
    assert any("raise the quota" in h for h in no_plan_hints(_quota_case()[1], cpu_ok=True, budget_given=True))
    mixed = no_plan_hints(_mixed_cpu_ok_case()[1], cpu_ok=False, budget_given=True)
    assert any("set cpu_ok: true in the recipe" in h for h in mixed), mixed


def test_the_planner_stores_each_reason_s_kind_and_next_step():
    _, p = _quota_case()
    [multi] = [o for o in p.rejected if o.topology.value == "multi-node"]
    [why] = multi.rejected
    assert isinstance(why, Rejection) and why.kind is RejectionKind.quota
    assert why.next_step == multi.next_step == ("broker quota request --provider aws --limit L-DB2E81BA --value 8 "
                                                "--region us-east-1")
    for o in _budget_case()[1].rejected:  # each text of its own kind, the first one the option's count kind
        assert o.rejected[0].kind.value == o.reason_kind
        assert all((r.kind is RejectionKind.budget) == r.startswith(("worst case", "budget")) for r in o.rejected)
    for o in _gpu_model_case()[1].rejected:
        assert o.rejected[0].kind.value == o.reason_kind == "gpu-model"
    [local] = _no_gpu_here_case()[1].rejected
    assert local.rejected[0].kind is RejectionKind.provider and local.rejected[0].lifted_by == "cpu_ok"


def test_json_keeps_the_texts_and_adds_the_data_and_reads_back():
    _, p = _quota_case()
    doc = json.loads(json.dumps(to_json(p)))
    row = next(o for o in doc["rejected"] if o["topology"] == "multi-node")
    assert row["rejected"] == ["quota L-DB2E81BA 4 of 4 vcpus available in us-east-1; needs 8"]  # the old field
    assert row["rejections"] == [{"kind": "quota", "text": row["rejected"][0], "next_step": row["next_step"],
                                  "lifted_by": None}]
    assert "rejections" not in doc  # the plan itself has no reasons of its own
    back = PlanOption.from_dict(row)
    assert back.rejected == row["rejected"] and back.rejected[0].kind is RejectionKind.quota
    assert back.rejected[0].next_step == row["next_step"]
    # a plan written before reasons carried their kind: the text, of the option's count kind
    old = {k: v for k, v in row.items() if k != "rejections"}
    assert PlanOption.from_dict(old).rejected[0].kind is RejectionKind.quota
    assert PlanOption.from_dict({**old, "reason_kind": None}).rejected[0].kind is RejectionKind.other
    valid = to_json(plan(_req(_recipe(budget_usd=100)), FakeProvider().offers(_req(_recipe(budget_usd=100)))).chosen)
    assert valid["rejected"] == [] and valid["rejections"] == []


def test_a_rejection_is_its_text_and_keeps_its_data_through_copies():
    import copy
    import pickle

    r = Rejection("capacity", "capacity: OUT_OF_HOST_CAPACITY for X in AD-1", next_step=None)
    assert r == "capacity: OUT_OF_HOST_CAPACITY for X in AD-1" and r.text == str(r) and type(r.text) is str
    for c in (copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert c == r and c.kind is RejectionKind.capacity
    assert r.reworded("full").kind is RejectionKind.capacity
    with pytest.raises(ValueError):
        Rejection("cheap", "no")


def test_the_plan_table_tells_a_budget_only_option_by_its_kind():
    """`broker plan`'s "cheapest option blocked only by the budget" line read the reasons' first words."""
    import io

    from broker.cli.plan import PlainOut, render_plan

    def table(p: Plan) -> str:
        buf = io.StringIO()
        render_plan(p, None, out=PlainOut(buf, width=200))
        return " ".join(buf.getvalue().split())

    _, p = _budget_case()
    before, after = table(p), table(_reworded(p))
    assert "cheapest option blocked only by the budget:" in before
    assert "cheapest option blocked only by the budget:" in after and "raison " in after
