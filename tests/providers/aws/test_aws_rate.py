"""The AWS adapter reports what the instance EC2 actually launched bills (moto in server mode): its type's list price
on-demand, the zone's spot price for a spot instance (never the on-demand list price), plus the root volume really
created, so the core records the provider's rate, not the plan's (broker.money.cost.record_reported_rate), and the
watchdog adopts the same figure from ``list_tagged``."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("moto")

from tests.providers.aws.test_aws_moto import Rec, ec2, env, moto_url, node_req, offer, prov  # noqa: E402,F401

#: the root volume's $/h in these tests: the recipe's 40 GiB (moto's images have 15 GiB snapshots) at gp3's price
DISK_40 = 40 * 0.08 / 730.0


def test_describe_reports_the_launched_types_list_price(prov, ec2):
    from broker.providers.aws.offers import list_price

    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer()], "simulated", Rec())
    iid = prov.create_instance(node_req(ec2, run, net))
    info = prov.describe_instance(iid)
    assert list_price("g5.xlarge") and info.usd_per_hour == pytest.approx(list_price("g5.xlarge") + DISK_40, abs=1e-6)
    assert prov.reported_rate_includes_storage  # the core must not add the recipe's disk again
    prov.terminate("instance", iid)


def test_spot_instance_is_priced_at_the_spot_price_in_describe_and_list_tagged(prov, ec2):
    from dataclasses import replace

    from broker.providers.aws.offers import list_price

    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer()], "simulated", Rec())
    req = node_req(ec2, run, net)
    req = req.model_copy(update={"offer": replace(req.offer, attrs={"market": "spot", "interruptible": True,
                                                                    "bid_usd_per_hour": 0.5})})
    iid = prov.create_instance(req)
    zone = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["Placement"][
        "AvailabilityZone"]
    spot = float(ec2.describe_spot_price_history(InstanceTypes=["g5.xlarge"], AvailabilityZone=zone,
                                                 ProductDescriptions=["Linux/UNIX (Amazon VPC)"])[
        "SpotPriceHistory"][0]["SpotPrice"])
    assert spot < list_price("g5.xlarge")
    info = prov.describe_instance(iid)
    assert info.usd_per_hour == pytest.approx(spot + DISK_40, abs=1e-6)
    listed = [t for t in prov.list_tagged(run) if t.kind == "instance"]
    assert [t.usd_per_hour for t in listed] == [pytest.approx(spot + DISK_40, abs=1e-6)]
    prov.terminate("instance", iid)


def test_the_watchdog_adopts_the_spot_price_not_the_on_demand_list_price(prov, ec2, tmp_path):
    """The CLI died before it recorded the rate: the watchdog's scan of ``list_tagged`` records what the spot
    instance bills (the zone's spot price and its disk), never the type's on-demand list price."""
    from dataclasses import replace

    from broker.core.model import utcnow
    from broker.core.records import Run
    from broker.money.ledger import Ledger
    from broker.money.watchdog import Watchdog
    from broker.providers.aws.offers import list_price

    ledger = Ledger()
    run_id = "20261201-120000-" + uuid.uuid4().hex[:6]
    now = utcnow()
    run = ledger.create_run(Run(id=run_id, name="t", provider="aws", topology="simulated", status="running",
                                created_at=now, deadline=now + __import__("datetime").timedelta(hours=1),
                                run_dir=str(tmp_path / "runs" / run_id), budget_usd=5.0))
    net = prov.bootstrap(run.id, [offer()], "simulated", Rec())
    req = node_req(ec2, run.id, net)
    res = ledger.record_intent(run.id, "aws", "instance", req.name, usd_per_hour=0.0045, deadline=run.deadline,
                               attrs={"storage_usd_per_hour": DISK_40})
    req = req.model_copy(update={"client_token": res.id, "installation_id": ledger.installation_id,
                                 "offer": replace(req.offer, attrs={"market": "spot", "interruptible": True,
                                                                    "bid_usd_per_hour": 0.5})})
    iid = prov.create_instance(req)
    ledger.mark_created(res.id, iid, state="running")
    w = Watchdog(ledger, providers={"aws": prov}, orphan_scan_s=0, confirm_timeout_s=5, home=tmp_path / "wd")
    w.run_once()
    row = ledger.resource(res.id)
    assert row.usd_per_hour < 0.5 < list_price("g5.xlarge")  # the spot price + disk, below the bid cap
    assert row.usd_per_hour == pytest.approx(prov.describe_instance(iid).usd_per_hour, abs=1e-6)
    prov.terminate("instance", iid)
