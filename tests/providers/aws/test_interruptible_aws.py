"""AWS spot: offers priced from DescribeSpotPriceHistory (moto), RunInstances with InstanceMarketOptions spot
(moto shows the instance's lifecycle and the request body is asserted), and interruption detection from EC2's own
answers (a pytest-httpserver fault server speaking the EC2 query protocol with real DescribeInstances /
DescribeSpotInstanceRequests XML)."""

from __future__ import annotations

from urllib.parse import parse_qs

import pytest

from broker.core.errors import AuthError, ProviderError
from broker.core.model import Requirements
from broker.plan import interruptible as spot
from broker.plan.planner import plan
from tests.providers.aws.test_aws_moto import ENV, env, ec2, image_id, moto_url, node_req, offer, prov  # noqa: F401


def _req(mode="true"):
    return Requirements(nodes=1, gpus_per_node=1, gpu_names=["A10G"], min_gpu_mem_gib=20, hours=1.0,
                        budget_usd=20.0, topology="simulated", interruptible=mode, disk_gib=40)


def test_offers_carry_the_live_spot_price_per_zone(prov):
    offers = [o for o in prov.offers(_req()) if o.instance_type == "g5.xlarge"]
    assert offers and all(o.zone for o in offers)
    for o in offers:
        assert isinstance(o.attrs[spot.PRICE_ATTR], float) and o.attrs[spot.PRICE_ATTR] < o.usd_per_hour
        assert o.attrs[spot.SOURCE_ATTR].startswith("live EC2 spot price " + o.zone)
    c = plan(_req("true"), offers).chosen
    assert c.interruptible and c.offers[0].attrs[spot.BID_ATTR] == spot.bid(offers[0].attrs[spot.PRICE_ATTR])


def test_snapshot_spot_price_without_credentials(monkeypatch, tmp_path):
    from broker.providers.aws import AWSProvider

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    [g5] = [o for o in AWSProvider().offers(_req()) if o.instance_type == "g5.xlarge"]
    assert g5.attrs[spot.PRICE_ATTR] == 0.45 and "snapshot 2026-11-29" in g5.attrs[spot.SOURCE_ATTR]


def test_run_instances_asks_for_one_time_spot_with_the_cap(prov, ec2, monkeypatch):
    from broker.providers.aws import lifecycle

    sent = {}
    real_call = prov.api.call

    def spy(client, op, ctx=None, **params):
        if op == "run_instances":
            sent.update(params)
        return real_call(client, op, ctx, **params)

    monkeypatch.setattr(prov.api, "call", spy)
    v = spot.variant(_with_price(offer(), 0.40))
    req = node_req(ec2, "20261201-000000-spot01", {}).model_copy(update={"offer": v})
    iid = prov.create_instance(req)
    assert sent["InstanceMarketOptions"] == {"MarketType": "spot", "SpotOptions": {
        "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate", "MaxPrice": "0.4400"}}
    d = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]
    assert d["InstanceLifecycle"] == "spot"
    # tagged exactly like on-demand
    tags = {t["Key"]: t["Value"] for t in d["Tags"]}
    assert tags["broker-run"] == "20261201-000000-spot01" and "broker-client-token" in tags
    assert prov.preemption(iid) is None  # running: not interrupted
    # a spot instance does not bill the on-demand list price: it bills the zone's spot price (below the cap)
    rate = prov.describe_instance(iid).usd_per_hour
    assert rate is not None and rate < 0.44
    prov.terminate("instance", iid)
    assert prov.preemption(iid) is None  # terminated by broker (Client.UserInitiatedShutdown): not a preemption
    assert lifecycle.SPOT_STATE_REASONS[0] == "Server.SpotInstanceTermination"


def test_on_demand_launch_has_no_market_options(prov, ec2, monkeypatch):
    sent = {}
    real_call = prov.api.call

    def spy(client, op, ctx=None, **params):
        if op == "run_instances":
            sent.update(params)
        return real_call(client, op, ctx, **params)

    monkeypatch.setattr(prov.api, "call", spy)
    iid = prov.create_instance(node_req(ec2, "20261201-000000-odem01", {}))
    assert "InstanceMarketOptions" not in sent
    assert prov.describe_instance(iid).usd_per_hour == pytest.approx(1.006 + 40 * 0.08 / 730, abs=1e-6)
    assert prov.preemption(iid) is None


def _with_price(o, price):
    from dataclasses import replace

    return replace(o, attrs={**o.attrs, spot.PRICE_ATTR: price, spot.SOURCE_ATTR: "test"})


# ------------------------------------------------------------------------------------------ fault server
NS = "http://ec2.amazonaws.com/doc/2016-11-15/"
IID = "i-0abc1234def567890"


def _instances_xml(state: str, code: str | None, lifecycle: str | None = "spot", request: str | None = "sir-7x8y9z0a"):
    reason = (f"<stateReason><code>{code}</code><message>{code}: Spot instance termination</message></stateReason>"
              if code else "")
    life = f"<instanceLifecycle>{lifecycle}</instanceLifecycle>" if lifecycle else ""
    req = f"<spotInstanceRequestId>{request}</spotInstanceRequestId>" if request else ""
    codes = {"running": 16, "shutting-down": 32, "terminated": 48, "stopped": 80}
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<DescribeInstancesResponse xmlns="{NS}">'
            "<requestId>8f7724cf-496f-496e-8fe3-example</requestId><reservationSet><item>"
            "<reservationId>r-1234567890abcdef0</reservationId><ownerId>123456789012</ownerId><groupSet/>"
            f"<instancesSet><item><instanceId>{IID}</instanceId><imageId>ami-0abcdef1234567890</imageId>"
            f"<instanceState><code>{codes[state]}</code><name>{state}</name></instanceState>"
            "<instanceType>g5.xlarge</instanceType><launchTime>2026-12-01T00:00:00.000Z</launchTime>"
            f"<placement><availabilityZone>us-east-1a</availabilityZone></placement>{life}{req}{reason}"
            "</item></instancesSet></item></reservationSet></DescribeInstancesResponse>")


def _requests_xml(code: str, state: str = "closed"):
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<DescribeSpotInstanceRequestsResponse xmlns="{NS}">'
            "<requestId>59dbff89-35bd-4eac-99ed-example</requestId><spotInstanceRequestSet><item>"
            f"<spotInstanceRequestId>sir-7x8y9z0a</spotInstanceRequestId><state>{state}</state>"
            f"<status><code>{code}</code><updateTime>2026-12-01T00:10:00.000Z</updateTime>"
            f"<message>Spot request {code}</message></status><instanceId>{IID}</instanceId>"
            "<type>one-time</type></item></spotInstanceRequestSet></DescribeSpotInstanceRequestsResponse>")


_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{code}</Code><Message>{msg}'
          "</Message></Error></Errors><RequestID>ea966190-f9aa-478e-9ede-example</RequestID></Response>")


@pytest.fixture
def ec2_fault(httpserver, monkeypatch, tmp_path):
    """An EC2 endpoint whose answers the test sets: ``answers[Action] = (status, xml)``."""
    from werkzeug import Response

    from broker.providers.aws import AWSProvider

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    answers: dict[str, tuple[int, str]] = {}
    seen: list[dict] = []

    def handler(request):
        form = {k: v[0] for k, v in parse_qs(request.get_data(as_text=True)).items()}
        seen.append(form)
        status, body = answers.get(form.get("Action", ""), (400, _ERROR.format(code="InvalidAction",
                                                                                msg="not in this test")))
        return Response(body, status=status, content_type="text/xml")

    httpserver.expect_request("/").respond_with_handler(handler)
    import boto3

    session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                    region_name="us-east-1")
    p = AWSProvider(session=session, endpoint_url=httpserver.url_for("").rstrip("/"), region="us-east-1")
    return p, answers, seen


@pytest.mark.parametrize("state,code", [("terminated", "Server.SpotInstanceTermination"),
                                        ("shutting-down", "Server.SpotInstanceTermination"),
                                        ("stopped", "Server.SpotInstanceShutdown")])
def test_state_reason_of_a_spot_interruption(ec2_fault, state, code):
    p, answers, seen = ec2_fault
    answers["DescribeInstances"] = (200, _instances_xml(state, code))
    why = p.preemption(IID)
    assert why.startswith("spot interruption: " + code) and f"state {state}" in why
    assert seen[0]["InstanceId.1"] == IID


@pytest.mark.parametrize("code", ["instance-terminated-by-price", "instance-terminated-no-capacity",
                                  "marked-for-termination"])
def test_spot_request_status_of_an_interruption(ec2_fault, code):
    p, answers, _ = ec2_fault
    answers["DescribeInstances"] = (200, _instances_xml("running" if code.startswith("marked") else "terminated",
                                                        None))
    answers["DescribeSpotInstanceRequests"] = (200, _requests_xml(code))
    why = p.preemption(IID)
    assert why and code in why and "sir-7x8y9z0a" in why


@pytest.mark.parametrize("xml", [
    _instances_xml("terminated", "Client.UserInitiatedShutdown"),  # broker (or the user) terminated it
    _instances_xml("terminated", "Client.InstanceInitiatedShutdown"),  # the dead-man switch's shutdown
    _instances_xml("terminated", "Server.SpotInstanceTermination", lifecycle=None),  # not spot at all
])
def test_other_ends_are_not_preemptions(ec2_fault, xml):
    p, answers, _ = ec2_fault
    answers["DescribeInstances"] = (200, xml)
    answers["DescribeSpotInstanceRequests"] = (200, _requests_xml("instance-terminated-by-user"))
    assert p.preemption(IID) is None


def test_unknown_instance_is_not_a_preemption_and_failures_raise(ec2_fault):
    p, answers, _ = ec2_fault
    answers["DescribeInstances"] = (400, _ERROR.format(code="InvalidInstanceID.NotFound",
                                                       msg=f"The instance ID '{IID}' does not exist"))
    assert p.preemption(IID) is None
    answers["DescribeInstances"] = (403, _ERROR.format(code="UnauthorizedOperation", msg="not authorized"))
    with pytest.raises(ProviderError):
        p.preemption(IID)
    answers["DescribeInstances"] = (401, _ERROR.format(code="AuthFailure", msg="AWS was not able to validate"))
    with pytest.raises((AuthError, ProviderError)):
        p.preemption(IID)
    with pytest.raises(ProviderError):
        p.preemption("i-../../x")


def test_interruptible_plans_read_the_spot_vcpu_limit_beside_on_demand(monkeypatch, tmp_path):
    """Service Quotas through botocore's Stubber (request bodies asserted): with interruptible asked for, the
    spot limit (L-3819A6DF) is read too and marked as counting interruptible capacity only."""
    from broker.providers.aws import AWSProvider
    from tests.providers.aws.test_aws_stub import Stubs
    from tests.providers.aws.test_aws_stub import offer as stub_offer

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    stubs = Stubs()
    prov = AWSProvider(client_factory=stubs, region="us-east-1")
    sq = stubs.stub("service-quotas")
    cw = stubs.stub("cloudwatch")
    for code, name, value in (("L-DB2E81BA", "Running On-Demand G and VT instances", 64.0),
                              ("L-3819A6DF", "All G and VT Spot Instance Requests", 0.0)):
        sq.add_response("get_service_quota", {"Quota": {"ServiceCode": "ec2", "QuotaCode": code, "Value": value,
                                                        "QuotaName": name}},
                        {"ServiceCode": "ec2", "QuotaCode": code})
        cw.add_response("get_metric_statistics", {"Datapoints": []})
    qs = prov.quotas(Requirements(interruptible="auto"), [stub_offer()])
    assert sorted((q.name, q.interruptible, q.limit) for q in qs) == [("L-3819A6DF", True, 0.0),
                                                                      ("L-DB2E81BA", False, 64.0)]
    stubs.assert_done()
    o = _with_price(stub_offer(), 0.40)
    p = plan(Requirements(nodes=1, gpus_per_node=1, hours=1, budget_usd=20, topology="simulated",
                          interruptible="auto"), [o], qs)
    assert p.chosen is not None and not p.chosen.interruptible  # no spot vCPUs: on-demand
    assert any("L-3819A6DF" in r for x in p.rejected for r in x.rejected)
