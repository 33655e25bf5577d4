"""Interruptible options in the plan: prices from the offers' interruptible price, a worst case that covers every
attempt, the expected cost with restarts, and the choice that ``interruptible: false|true|auto`` makes."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest

from broker.core.model import Offer, Requirements
from broker.plan import interruptible as spot
from broker.plan import pricing
from broker.plan.planner import plan

NOW = datetime(2026, 11, 29, tzinfo=timezone.utc)


def offer(provider="aws", it="g5.xlarge", usd=1.0, price=None, gpus=2, vcpus=0, **attrs):
    a = dict(attrs)
    if price is not None:
        a.update({spot.PRICE_ATTR: price, spot.SOURCE_ATTR: "test price"})
    return Offer(provider=provider, offer_id=it, instance_type=it, region="us-east-1", gpu_name="A10G",
                 gpu_count=gpus, gpu_mem_gib=24, vcpus=vcpus, usd_per_hour=usd, min_billed_seconds=0,
                 price_source="snap",
                 price_time=NOW, attrs=a)


def req(mode="auto", hours=2.0, budget=10.0, restarts=3, every=60, nodes=2):
    return Requirements(nodes=nodes, gpus_per_node=1, hours=hours, budget_usd=budget, topology="simulated",
                        interruptible=mode, max_restarts=restarts, checkpoint_every_s=every)


def test_worst_case_covers_every_attempt():
    p = plan(req("true", restarts=3), [offer(price=0.40)])
    o = p.chosen
    allow = pricing.setup_allowance_seconds("aws")
    rate = spot.bid(0.40)
    assert o.interruptible and o.max_restarts == 3 and o.hours == 2.0
    assert o.worst_case_usd == pytest.approx(rate * (2 * 3600 + 4 * allow) / 3600)
    assert o.offers[0].attrs[spot.BID_ATTR] == rate and o.offers[0].attrs[spot.ON_DEMAND_ATTR] == 1.0
    # more restarts, more setups to pay for
    assert plan(req("true", restarts=5), [offer(price=0.40)]).chosen.worst_case_usd > o.worst_case_usd


def test_budget_must_cover_every_attempt():
    # on-demand alone fits (1.0 x (2 h + 10 min) = 2.17) but four attempts of the spot option at 0.9 do not:
    # 0.99 x (2 h + 40 min) = 2.64 > 2.5
    p = plan(req("true", budget=2.5), [offer(price=0.9)])
    assert p.chosen is None
    why = [r for o in p.rejected for r in o.rejected]
    assert any("interruptible" in r and "budget" in r for r in why), why
    assert plan(req("auto", budget=2.5), [offer(price=0.9)]).chosen.interruptible is False


def test_expected_cost_model():
    allow, every = 600, 60
    exp, k = spot.expected(1, 1.0, 10.0, allow, 0.1, 3, every)
    lost = (allow + every / 2) / 3600
    assert k == pytest.approx(0.1 * 10 / (1 - 0.1 * lost))
    assert exp == pytest.approx(10 + allow / 3600 + k * lost)
    # capped at max_restarts
    assert spot.expected(4, 1.0, 100.0, allow, 0.5, 3, every)[1] == 3
    # a rate so high that every restart loses more than it gains: every restart is used
    assert spot.expected(1, 1.0, 1.0, 7200, 1.0, 2, every)[1] == 2
    # no preemption: exactly the on-demand arithmetic
    assert spot.expected(2, 1.5, 3.0, allow, 0.0, 3, every) == (2 * 1.5 * (3 + allow / 3600), 0.0)
    # longer checkpoint intervals lose more work per preemption
    assert spot.expected(1, 1.0, 10, allow, 0.1, 3, 3600)[0] > exp


def test_auto_picks_interruptible_only_when_expected_cost_is_lower():
    cheap = plan(req("auto"), [offer(price=0.40)])
    assert cheap.chosen.interruptible and cheap.chosen.expected_usd < cheap.options[1].worst_case_usd
    assert any("auto chose the interruptible" in n for n in cheap.notes)
    # a spot price near on-demand with a high preemption rate: restarts make it dearer, on-demand stays chosen
    dear = plan(req("auto", hours=8, restarts=10), [offer(price=0.88, preemptions_per_hour=2.0)])
    assert not dear.chosen.interruptible
    assert any(o.interruptible for o in dear.options)  # still listed, ranked below
    assert any("auto kept on-demand" in n for n in dear.notes)


def test_false_plans_on_demand_and_says_what_interruptible_saves():
    p = plan(req("false"), [offer(price=0.40)])
    assert p.options and not any(o.interruptible for o in p.options)
    line = next(n for n in p.notes if n.startswith("interruptible aws"))
    assert "saves $" in line and "on-demand" in line and "worst case" in line and "4 attempts" in line
    assert any("interruptible: auto" in n for n in p.notes)
    assert p.chosen.expected_usd == p.chosen.worst_case_usd


def test_true_without_any_interruptible_price_is_no_valid_plan():
    p = plan(req("true"), [offer(price=None)])
    assert p.chosen is None
    assert any("no offer has interruptible capacity" in n for n in p.notes)
    assert any("interruptible: true" in r for o in p.rejected for r in o.rejected)


def test_fixed_discount_has_no_bid_and_market_price_gets_the_margin():
    oci = spot.variant(offer("oci", "VM.GPU3.1", 2.95, price=1.475))
    assert oci.usd_per_hour == 1.475 and oci.attrs[spot.BID_ATTR] is None
    aws = spot.variant(offer(price=0.40))
    assert aws.usd_per_hour == aws.attrs[spot.BID_ATTR] == pytest.approx(0.44)
    # an interruptible price at or above on-demand saves nothing: no variant
    assert spot.variant(offer(usd=0.5, price=0.48)) is None


def test_vast_bid_is_on_min_bid_while_the_price_includes_other_charges():
    o = offer("vast", "1x RTX 4090", 0.30, price=0.14, min_bid=0.12)
    v = spot.variant(o)
    assert v.attrs[spot.BID_ATTR] == spot.bid(0.12) and v.usd_per_hour == spot.bid(0.14)


def test_budget_sets_the_deadline_minus_the_extra_setups():
    p = plan(req("true", hours=None, budget=3.0), [offer(price=0.40)])
    o = p.chosen
    allow = pricing.setup_allowance_seconds("aws")
    rate = spot.bid(0.40)
    assert o.hours == pytest.approx((3.0 / rate * 3600 - 4 * allow) / 3600, abs=1e-3)
    assert o.worst_case_usd <= 3.0


def test_plan_is_unchanged_without_interruptible_prices():
    a = plan(req("false"), [offer()])
    assert [o.worst_case_usd for o in a.options] and not any("interruptible" in n for n in a.notes)
    assert a.chosen.expected_usd is None and not a.chosen.interruptible


def test_a_provider_without_the_capability_gets_no_interruptible_option():
    assert spot.variant(offer("netns", price=0.1)) is None
    assert spot.variant(offer("local", price=0.1)) is None


def test_interruptible_options_are_judged_by_their_own_limits():
    from broker.core.model import Quota

    od_q = Quota(provider="aws", name="L-DB2E81BA", region="us-east-1", scope="us-east-1", limit=64, used=0,
                 unit="vcpus", instance_types=["g5.xlarge"])
    spot_q = Quota(provider="aws", name="L-3819A6DF", region="us-east-1", scope="us-east-1", limit=0, used=0,
                   unit="vcpus", instance_types=["g5.xlarge"], interruptible=True)
    o = offer(price=0.40, vcpus=4)
    p = plan(req("auto"), [o], [od_q, spot_q])
    assert p.chosen and not p.chosen.interruptible  # spot vCPU limit 0: only on-demand is valid
    why = [r for x in p.rejected for r in x.rejected if "L-3819A6DF" in r]
    assert why and all("interruptible" in r for r in why)
    assert plan(req("auto"), [o], [od_q]).chosen.interruptible  # no spot limit known: the provider's others apply
    # a spot limit never blocks on-demand
    assert plan(req("false"), [o], [spot_q, replace_limit(od_q, 64)]).chosen is not None


def replace_limit(q, limit):
    from dataclasses import replace

    return replace(q, limit=limit)


def test_attempts_words_say_one_attempt():
    from broker.plan.interruptible import attempts_words

    assert (attempts_words(1), attempts_words(4)) == ("1 attempt", "4 attempts")


def test_true_shows_each_machine_once_in_the_rejected_rows():
    """With interruptible: true on-demand is only the comparison: a machine with a twin is judged as the twin (no
    second row at its on-demand price); a machine without one shows its own reason, or "no interruptible price"
    when it would have been valid; the counts add up to the rows behind them."""
    twin_too_small = offer(it="g5.xlarge", usd=1.0, price=0.4, gpus=1)  # rejected as simulated: 1 GPU
    twin_ok = offer(it="g5.12xlarge", usd=5.0, price=2.0, gpus=2)
    no_twin_ok = offer(it="g4dn.12xlarge", usd=0.5, gpus=2)  # cheaper on demand, no interruptible price
    no_twin_small = offer(it="g4dn.xlarge", usd=0.3, gpus=1)
    p = plan(req("true", budget=100), [twin_too_small, twin_ok, no_twin_ok, no_twin_small])
    assert p.chosen.interruptible and p.chosen.offers[0].instance_type == "g5.12xlarge"
    rows = [(o.offers[0].instance_type, o.interruptible, o.rejected[-1]) for o in p.rejected]
    assert sorted((it, i) for it, i, _ in rows) == [("g4dn.12xlarge", False), ("g4dn.xlarge", False),
                                                      ("g5.xlarge", True)], rows
    why = {it: r for it, _, r in rows}
    assert why["g4dn.12xlarge"] == spot.NO_PRICE
    assert "2 GPUs" in why["g4dn.xlarge"] and "2 GPUs" in why["g5.xlarge"]
    assert sum(p.rejected_counts.values()) == len(rows) == 3
    assert list(p.rejected_counts) == [k for k in ("provider", "topology") if k in p.rejected_counts]
