"""Vast.ai facts the adapter must get right against the real API (docs/reference/cloud-apis.md A, interruptible.md 1),
held against the project's Vast emulator: interruptible offers from a ``type: "bid"`` search (search and re-quote),
``cancel_unavail`` as the SDK sends it for a bid, a taken offer answered 400 / 404 / 410, bids up to $128/h, and
rate limits (no ``Retry-After``: the documented intervals, one ``retry_after_s`` the core honours)."""

from __future__ import annotations

import pytest

from broker.core.errors import OfferGone, TransientError
from broker.core.model import Requirements
from broker.plan import interruptible as spot
from broker.plan.planner import plan
from tests.money.test_money_truth import _vast, vast_env  # noqa: F401 - the fixture
from tests.providers.vast.test_interruptible_vast import _node, _spot_option
from tests.support.vast_emulator import offer_row


def _req(mode="auto", budget_usd=5.0):
    return Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16, hours=1.0, budget_usd=budget_usd,
                        topology="simulated", interruptible=mode, disk_gib=40)


def _searches(emu):
    return [body for m, p, body in emu.calls if m == "POST" and p == "/api/v0/bundles/"]


def test_interruptible_prices_come_from_a_bid_search(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15),
                           offer_row(5102, machine_id=12, dph_total=0.41, min_bid=0.10, bids=False)])
    offers = {o.offer_id: o for o in _vast().offers(_req("auto"))}
    types = [q["type"] for q in _searches(emu)]
    assert types == ["on-demand", "bid"]
    assert offers["5101"].attrs[spot.PRICE_ATTR] == pytest.approx(0.15 + 0.40 - 0.36)
    assert spot.PRICE_ATTR not in offers["5102"].attrs  # its host takes no bids: no interruptible twin
    assert [o.offers[0].offer_id for o in plan(_req("true"), list(offers.values())).options if o.interruptible] \
        == ["5101"]


def test_on_demand_plans_search_once(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11)])
    _vast().offers(_req("false"))
    assert [q["type"] for q in _searches(emu)] == ["on-demand"]


def test_bid_requote_is_a_bid_search_and_the_bid_body_matches_the_sdk(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15)])
    v = _vast()
    sp = _spot_option(plan(_req("true"), v.offers(_req("true"))))
    emu.calls.clear()
    v.create_instance(_node(sp.offers[0]))
    [requote] = _searches(emu)
    assert requote["type"] == "bid" and requote["id"] == {"eq": 5101}
    [body] = [b for m, _, b in emu.calls if m == "PUT"]
    assert body["cancel_unavail"] is False and body["price"] == spot.bid(0.15)


def test_on_demand_create_keeps_cancel_unavail(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11)])
    v = _vast()
    o = next(x for x in plan(_req("false"), v.offers(_req("false"))).options if not x.interruptible)
    v.create_instance(_node(o.offers[0]))
    [body] = [b for m, _, b in emu.calls if m == "PUT"]
    assert body["cancel_unavail"] is True and "price" not in body


@pytest.mark.parametrize("status", [400, 404, 410])
def test_a_taken_offer_is_gone_whatever_its_status(vast_env, status):
    emu = vast_env(offers=[offer_row(5101, machine_id=11)], taken_status=status)
    v = _vast()
    [o] = v.offers(_req("false"))
    emu.offers[0]["rented"] = True  # taken between the re-quote's search and the rent
    v.requote = lambda offer, disk: {}  # type: ignore[method-assign]
    with pytest.raises(OfferGone) as ei:
        v.create_instance(_node(o))
    assert ei.value.status == status and "taken" in ei.value.message


def test_a_bid_up_to_128_is_accepted(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, num_gpus=8, gpu_name="H100 SXM", dph_total=150.0,
                                     min_bid=100.0)])
    v = _vast()
    [o] = v.offers(_req("true"))
    [twin] = spot.variants([o])
    iid = v.create_instance(_node(twin))
    assert emu.instances[int(iid)].bid == spot.bid(100.0) and 100 < spot.bid(100.0) <= 128


# ------------------------------------------------------------------------------------------- rate limits
def test_search_429_waits_the_documented_interval_and_says_so(vast_env):
    from broker.providers.vast.client import SEARCH_INTERVAL_S

    vast_env(offers=[offer_row(5101, machine_id=11)], throttle={"search": 10})
    slept: list[float] = []
    v = _vast(sleep=slept.append)
    with pytest.raises(TransientError) as ei:
        v.offers(_req("false"))
    assert slept == [SEARCH_INTERVAL_S, 2 * SEARCH_INTERVAL_S, 2 * SEARCH_INTERVAL_S]  # ~10 searches a minute
    e = ei.value
    assert e.status == 429 and e.retry_after_s == SEARCH_INTERVAL_S and not hasattr(e, "retry_after")
    assert f"retry in {SEARCH_INTERVAL_S:.0f} s" in e.hint


def test_create_429_waits_the_create_penalty_then_hands_the_core_its_wait(vast_env):
    from broker.money.provision import _backoff_s
    from broker.providers.vast.client import CREATE_PENALTY_S

    emu = vast_env(offers=[offer_row(5101, machine_id=11)], throttle={"rent": 2})
    slept: list[float] = []
    v = _vast(sleep=slept.append)
    o = next(x for x in plan(_req("false"), v.offers(_req("false"))).options if not x.interruptible)
    with pytest.raises(TransientError) as ei:
        v.create_instance(_node(o.offers[0]))
    assert slept == [CREATE_PENALTY_S]
    assert ei.value.retry_after_s == CREATE_PENALTY_S
    assert _backoff_s(ei.value, 1, 0.5) == CREATE_PENALTY_S  # the core waits what the adapter says
    assert not emu.instances  # a 429 rents nothing
    iid = v.create_instance(_node(o.offers[0]))  # the penalty served: the rent goes through
    assert int(iid) in emu.instances


def test_core_retries_wait_the_providers_retry_after_s():
    import time

    from broker.money.provision import _retrying

    calls: list[float] = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) == 1:
            e = TransientError("vast", "search", "rate-limited", status=429)
            e.retry_after_s = 0.3
            raise e
        return "ok"

    assert _retrying(flaky, attempts=3, wait_s=0.001, say=lambda s: None, what="t") == "ok"
    assert calls[1] - calls[0] >= 0.3


# ------------------------------------------------------------------------------------------- bandwidth
def test_bandwidth_is_priced_into_the_plan_at_the_offers_per_gb_rates(vast_env):
    row = offer_row(5101, machine_id=11, dph_total=0.40)
    row.update(inet_down_cost=0.02, inet_up_cost=0.05)  # $/GB: into the host / out of it
    vast_env(offers=[row])
    [o] = _vast().offers(_req("false"))
    assert (o.attrs["transfer_in_usd_per_gb"], o.attrs["transfer_out_usd_per_gb"]) == (0.02, 0.05)
    none = next(x for x in plan(_req("false"), [o]).options if not x.rejected)
    moved = Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16, hours=1.0, budget_usd=5.0,
                         topology="simulated", disk_gib=40, transfer_in_gb=50, transfer_out_gb=10)
    opt = next(x for x in plan(moved, [o]).options if not x.rejected)
    assert opt.worst_case_usd == pytest.approx(none.worst_case_usd + 50 * 0.02 + 10 * 0.05)
    assert "$1.50 transfer (50 GB in, 10 GB out per node)" in opt.price_source
    tight = Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16, hours=None, budget_usd=2.0,
                         topology="simulated", disk_gib=40, transfer_in_gb=50, transfer_out_gb=10)
    loose = Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16, hours=None, budget_usd=2.0,
                         topology="simulated", disk_gib=40)
    t = next(x for x in plan(tight, [o]).options if not x.rejected)
    lo = next(x for x in plan(loose, [o]).options if not x.rejected)
    assert t.max_hours_within_budget < lo.max_hours_within_budget  # the transfer is paid out of the budget
    assert t.worst_case_usd <= 2.0
