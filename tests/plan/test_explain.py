"""Budget refusals say budget: worst case vs budget, what would fit, no hint for a setting the
recipe already has."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from broker.plan.explain import no_plan_error
from broker.core.model import Requirements
from broker.plan.planner import plan
from broker.providers.fake import FakeProvider
from broker.providers.local import LocalProvider


def _recipe(**kw):
    base = dict(name="tiny", nodes=2, gpus_per_node=1, budget_usd=0.05, max_hours=0.5, cpu_ok=True, path="t.yaml")
    return SimpleNamespace(**{**base, **kw})


def _plan(r, unavailable=None):
    req = Requirements(nodes=r.nodes, gpus_per_node=r.gpus_per_node, cpu_ok=r.cpu_ok, budget_usd=r.budget_usd,
                       hours=r.max_hours)
    return plan(req, FakeProvider().offers(req), unavailable=unavailable)


def test_budget_refusal_names_worst_case_budget_and_what_fits():
    r = _recipe()
    p = _plan(r, {"local": "simulated needs one host with 2 GPUs; this machine has 0 GPU(s)"})
    assert p.chosen is None
    e = no_plan_error(r, p)
    msg, hint = e.message, e.hint
    assert "the budget is the limit" in msg and "worst case of $0.90" in msg and "> budget $0.05" in msg
    assert "fake.gpu2" in msg and "$1.80/h" in msg and "affords 0.02 h" in msg
    assert "raise budget_usd to at least $0.90" in hint and "max_hours: 0.02" in hint
    assert "cpu_ok" not in hint  # already set in the recipe
    assert e.exit_code == 3


def test_budget_that_affords_no_run_says_so():
    r = _recipe(budget_usd=0.001, max_hours=1)
    e = no_plan_error(r, _plan(r))
    assert "affords no run" in e.message and "max_hours" not in e.hint
    assert "raise budget_usd to at least $" in e.hint


def test_cpu_ok_hint_only_when_it_is_not_set():
    r = _recipe(cpu_ok=False, budget_usd=100, nodes=4)
    p = _plan(r, {"local": LocalProvider(gpus=[]).why_not(Requirements(nodes=4, gpus_per_node=1))})
    p = replace(p, options=[])  # pretend nothing is valid
    e = no_plan_error(r, p)
    assert "set cpu_ok: true" in e.hint
    r2 = _recipe(cpu_ok=True, budget_usd=100, nodes=4)
    e2 = no_plan_error(r2, p)
    assert "cpu_ok" not in e2.hint


def test_only_unknown_gpu_model_names_the_models_offered():
    """"relax the job, raise the budget or request quota" when the only cause was a GPU model no one offers: name
    the models that exist instead."""
    r = _recipe(budget_usd=100, max_hours=1)
    req = Requirements(nodes=2, gpus_per_node=1, gpu_names=["H300"], budget_usd=100, hours=1)
    p = plan(req, FakeProvider().offers(req),
             unavailable={"local": "simulated needs one host with 2 GPUs; this machine has 0 GPU(s)"})
    assert p.chosen is None
    e = no_plan_error(r, p)
    assert "no offer has GPU model H300" in e.hint and "FakeGPU" in e.hint, e.hint
    assert "budget" not in e.hint and "quota" not in e.hint, e.hint


def test_only_no_gpu_here_says_cpu_ok():
    r = _recipe(cpu_ok=False, budget_usd=100, max_hours=1)
    req = Requirements(nodes=2, gpus_per_node=1, budget_usd=100, hours=1, providers=["local"])
    p = plan(req, [], unavailable={"local": LocalProvider(gpus=[]).why_not(req)})
    e = no_plan_error(r, p)
    assert "this machine has no GPU: add --cpu-ok" in e.hint, e.hint
    assert "budget" not in e.hint and "quota" not in e.hint and "GPU models" not in e.hint, e.hint


def test_cpu_only_job_is_not_called_0_gpu():
    r = _recipe(gpus_per_node=0, cpu_ok=True, budget_usd=100, max_hours=1)
    p = replace(_plan(_recipe(budget_usd=100, max_hours=1)), options=[])
    e = no_plan_error(r, p)
    assert "(2 node(s), CPU only (gloo), budget $100.00" in e.message and "0 GPU" not in e.message, e.message
    e1 = no_plan_error(_recipe(), p)
    assert "(2 node(s) x 1 GPU, budget" in e1.message, e1.message


def test_worst_case_a_fraction_of_a_cent_over_the_budget_shows_the_digits_and_says_why():
    """To the cent both read the same ("worst case of $0.90 > budget $0.90"): 1/100 cent, and the sentence says so."""
    from broker.plan.explain import budget_only

    wc = budget_only(_plan(_recipe()))[0].worst_case_usd
    r = _recipe(budget_usd=wc - 0.0003)
    e = no_plan_error(r, _plan(r, {"local": "simulated needs one host with 2 GPUs; this machine has 0 GPU(s)"}))
    assert f"worst case of ${wc:,.4f}" in e.message, e.message
    assert f"(over it by ${0.0003:,.4f})" in e.message, e.message
