"""Vast.ai interruptible (bid) rentals against the Vast emulator: offers priced from min_bid, the bid in the create
body, an unscheduled bid cleaned up, and outbid detection from the instance row."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from broker.core.errors import AuthError, CapacityError, OfferGone, ProviderError
from broker.core.model import Requirements
from broker.plan import interruptible as spot
from broker.plan.planner import plan
from tests.money.test_money_truth import _vast, vast_env  # noqa: F401 - the fixture
from tests.support.vast_emulator import offer_row


def _req(mode="auto"):
    return Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16, hours=1.0, budget_usd=5.0,
                        topology="simulated", interruptible=mode, disk_gib=40)


def _node(offer, token="res-1"):
    from broker.core.records import NodeRequest

    return NodeRequest(run_id="r1a2b3", node_index=0, name="broker-r1a2b3-n0", offer=offer,
                       ssh_public_key="ssh-ed25519 AAAAC3NzaTESTKEY broker-r1a2b3", client_token=token,
                       disk_gib=40.0, installation_id="bi0123456789",
                       deadline=datetime(2030, 11, 30, 3, 0, tzinfo=timezone.utc), grace_seconds=300.0)


def _spot_option(p):
    return next(o for o in p.options if o.interruptible)


def test_offers_carry_min_bid_and_plan_prices_the_bid(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15)])
    offers = _vast().offers(_req())
    [o] = offers
    assert o.attrs["min_bid"] == 0.15
    assert o.attrs[spot.PRICE_ATTR] == pytest.approx(0.15 + 0.40 - 0.36)  # min_bid + storage (dph_total - dph_base)
    p = plan(_req("auto"), offers)
    c = p.chosen
    assert c.interruptible and c.offers[0].attrs[spot.BID_ATTR] == spot.bid(0.15)
    assert c.usd_per_hour == pytest.approx(spot.bid(0.19))
    assert any("saves" in n for n in p.notes)
    assert emu.calls  # a live search, not the snapshot


def test_create_sends_the_bid_as_price_and_rents_interruptible(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15)])
    v = _vast()
    sp = _spot_option(plan(_req("true"), v.offers(_req())))
    iid = v.create_instance(_node(sp.offers[0]))
    [(_, _, body)] = [c for c in emu.calls if c[0] == "PUT"]
    assert body["price"] == spot.bid(0.15) and body["price"] >= 0.15
    assert emu.instances[int(iid)].bid == body["price"]
    assert v.preemption(iid) is None  # rented, not preempted


def test_on_demand_create_sends_no_price(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15)])
    v = _vast()
    od = next(o for o in plan(_req("auto"), v.offers(_req())).options if not o.interruptible)
    v.create_instance(_node(od.offers[0]))
    [(_, _, body)] = [c for c in emu.calls if c[0] == "PUT"]
    assert "price" not in body  # Vast rents on-demand without a price


def test_min_bid_above_the_planned_bid_is_refused_before_renting(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15)])
    v = _vast()
    sp = _spot_option(plan(_req("true"), v.offers(_req())))
    emu.offers[0]["min_bid"] = 0.30  # the market moved between plan and rent
    with pytest.raises(OfferGone, match="minimum bid rose"):
        v.create_instance(_node(sp.offers[0]))
    assert not [c for c in emu.calls if c[0] == "PUT"]


def test_an_unscheduled_bid_instance_is_destroyed_and_reported_as_capacity(vast_env):
    """Vast may create the instance stopped and answer failure with its id (interruptible.md 1.3): nothing may be
    left billing storage."""
    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15)])
    v = _vast()
    sp = _spot_option(plan(_req("true"), v.offers(_req())))
    # the min_bid rises between the re-quote and the create: the emulator creates a stopped instance
    real_requote = v.requote

    def requote_then_rise(offer, disk):
        row = real_requote(offer, disk)
        emu.offers[0]["min_bid"] = 0.50
        return row

    v.requote = requote_then_rise
    body_create = v.create_body

    def no_cancel(req):  # the answer dstack saw comes without cancel_unavail
        b = body_create(req)
        b.pop("cancel_unavail")
        return b

    v.create_body = no_cancel
    with pytest.raises(CapacityError, match="destroyed"):
        v.create_instance(_node(sp.offers[0]))
    assert emu.destroyed and not emu.instances


@pytest.mark.parametrize("intended", ["running", "stopped"])
def test_outbid_is_a_preemption_with_vast_fields(vast_env, intended):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15)], boot_s=0.0)
    v = _vast()
    iid = v.create_instance(_node(_spot_option(plan(_req("true"), v.offers(_req()))).offers[0]))
    assert v.preemption(iid) is None
    emu.outbid(int(iid), intended=intended)
    why = v.preemption(iid)
    assert why.startswith("outbid") and "actual_status stopped" in why and f"intended_status {intended}" in why


def test_exited_bid_container_is_a_preemption_but_an_on_demand_one_is_not(vast_env):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, min_bid=0.15), offer_row(5102, machine_id=12, min_bid=0.15)],
                   boot_s=0.0)
    v = _vast()
    opts = plan(_req("auto"), v.offers(_req())).options
    bid = v.create_instance(_node(next(o for o in opts if o.interruptible).offers[0], "res-1"))
    taken = str(emu.instances[int(bid)].ask_id)
    od_offer = next(o for o in opts if not o.interruptible and o.offers[0].offer_id != taken).offers[0]
    od = v.create_instance(_node(od_offer, "res-2"))
    emu.exit_container(int(bid))
    emu.exit_container(int(od))
    assert "actual_status exited" in v.preemption(bid)
    assert v.preemption(od) is None  # an on-demand container that exited is a crash, not a preemption
    emu.outbid(int(od))
    assert v.preemption(od) is None


def test_a_destroyed_instance_is_not_a_preemption_and_a_failed_call_raises(vast_env, monkeypatch):
    emu = vast_env(offers=[offer_row(5101, machine_id=11, min_bid=0.15)], boot_s=0.0)
    v = _vast()
    iid = v.create_instance(_node(_spot_option(plan(_req("true"), v.offers(_req()))).offers[0]))
    assert v.terminate("instance", iid) in (True, False)
    assert v.preemption(iid) is None
    monkeypatch.setenv("VAST_API_KEY", "wrong-key")
    from broker.core.config import settings

    settings.cache_clear()
    with pytest.raises((AuthError, ProviderError)):
        _vast().preemption("31001")
    with pytest.raises(ProviderError):
        v.preemption("../1")  # an id is checked before it names a URL


def test_provision_is_ledger_first_tagged_like_on_demand_and_records_the_bid(vast_env, tmp_path):
    """Through broker.money.provision: the intent row exists before the PUT, carries interruptible / bid /
    on-demand price, and the instance's label (broker's tag on Vast) is the on-demand one."""
    from broker.money.ledger import Ledger
    from broker.money.provision import provision
    from broker.providers.vast.lifecycle import read_label
    from tests.money.test_money_truth import _req as money_req
    from tests.money.test_money_truth import _run

    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.40, min_bid=0.15)], boot_s=0.2)
    ledger = Ledger()
    p = _vast()
    run = _run(ledger, tmp_path)
    req = money_req()
    req.interruptible = "true"
    opt = plan(req, p.offers(req)).chosen
    assert opt.interruptible
    seen_rows_at_put: list[int] = []
    real = emu._rent

    def rent(request):
        seen_rows_at_put.append(len(ledger.resources(run.id)))
        return real(request)

    emu._rent = rent
    emu.server.clear()  # re-register the handlers with the spy in place
    import re as _re

    s = emu.server
    s.expect_request("/api/v0/bundles/", method="POST").respond_with_handler(emu._search)
    s.expect_request(_re.compile(r"^/api/v0/asks/\d+/$"), method="PUT").respond_with_handler(rent)
    s.expect_request(_re.compile(r"^/api/v0/instances/\d+/ssh/$"), method="POST").respond_with_handler(emu._key)
    s.expect_request(_re.compile(r"^/api/v0/instances/\d+/$"), method="GET").respond_with_handler(emu._show)
    s.expect_request(_re.compile(r"^/api/v0/instances/\d+/$"), method="DELETE").respond_with_handler(emu._delete)
    s.expect_request(_re.compile(r"^/api/v[01]/instances/$"), method="GET").respond_with_handler(emu._list)
    cluster = provision([opt], run, req, ledger, providers={"vast": p}, poll_s=0.05, retry_wait_s=0.01,
                        terminate_timeout_s=10)
    assert cluster.nodes and seen_rows_at_put == [1]  # the intent was written before the create call
    (row,) = ledger.resources(run.id, live_only=True)
    assert row.attrs["interruptible"] is True
    assert row.attrs["bid_usd_per_hour"] == spot.bid(0.15)
    assert row.attrs["on_demand_usd_per_hour"] == 0.40
    (inst,) = emu.instances.values()
    lab = read_label(inst.label)
    assert lab is not None and lab.run_id == run.id and inst.body["price"] == spot.bid(0.15)
