"""The AWS adapter reports the list price of the type EC2 actually launched (moto in server mode), so the core
records the provider's rate, not the plan's (broker.money.cost.record_reported_rate)."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("moto")

from tests.providers.aws.test_aws_moto import Rec, ec2, env, moto_url, node_req, offer, prov  # noqa: E402,F401


def test_describe_reports_the_launched_types_list_price(prov, ec2):
    from broker.providers.aws.offers import list_price

    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer()], "simulated", Rec())
    iid = prov.create_instance(node_req(ec2, run, net))
    info = prov.describe_instance(iid)
    assert list_price("g5.xlarge") and info.usd_per_hour == pytest.approx(list_price("g5.xlarge"))
    prov.terminate("instance", iid)
