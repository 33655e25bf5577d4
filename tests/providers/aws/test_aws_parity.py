"""Parity with AWS's own models: every AWS call broker's adapter makes goes through a real boto3 client (moto in
server mode behind it) and its parameters are validated against the botocore service model of that operation
(``botocore.validate.ParamValidator``, what boto3 itself runs before sending).  The adapter's source is scanned for
every operation it names; each must be a real operation of its service and must have been exercised here, so a
new call or a renamed parameter that drifts from the API fails in CI (docs/reference/cloud-apis.md C2-C3)."""

from __future__ import annotations

import re
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto")

from broker.core.model import Quota, Requirements  # noqa: E402
from broker.core.provider import ProviderError  # noqa: E402
from tests.providers.aws.test_aws_moto import ENV, Rec, moto_url, node_req, offer  # noqa: E402,F401

SERVICES = ("ec2", "service-quotas", "cloudwatch", "pricing")
AWS_SRC = Path(__file__).resolve().parents[3] / "providers" / "aws"


class Recorder:
    """client_factory: real boto3 clients on the moto server, each call's parameters validated against the
    operation's input shape before it is sent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.calls: list[tuple[str, str]] = []  # (service, snake_case operation)
        self.invalid: list[str] = []

    def __call__(self, service: str, region: str, cfg: Any) -> Any:
        import boto3
        from botocore import xform_name
        from botocore.validate import ParamValidator

        c = boto3.client(service, region_name=region, endpoint_url=self.url, config=cfg,
                         aws_access_key_id="testing", aws_secret_access_key="testing")
        assert c.meta.config.parameter_validation is not False

        def check(params: dict, model: Any, **_: Any) -> None:
            self.calls.append((service, xform_name(model.name)))
            report = ParamValidator().validate(params, model.input_shape)
            if report.has_errors():
                self.invalid.append(f"{service}.{model.name}: {report.generate_report()}")

        c.meta.events.register("before-parameter-build", check)
        return c


def _operations() -> dict[str, set[str]]:
    import boto3

    out = {}
    for s in SERVICES:
        c = boto3.client(s, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
        out[s] = set(c.meta.method_to_api_mapping)
    return out


def _named_in_source(ops: dict[str, set[str]]) -> set[str]:
    """Every snake_case identifier or string in providers/aws/*.py that is an operation of a service broker uses."""
    every = set().union(*ops.values())
    words: set[str] = set()
    for f in AWS_SRC.glob("*.py"):
        words |= set(re.findall(r"\b[a-z]+(?:_[a-z0-9]+)+\b", f.read_text()))
    # a parameter dict key or a local name can look like an operation only if it is one
    return words & every


@pytest.fixture
def env(monkeypatch, tmp_path):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.delenv("AWS_AMI_ID", raising=False)


def test_every_aws_call_validates_against_the_botocore_model(moto_url, env):
    import boto3

    from broker.providers.aws import AWSProvider

    rec = Recorder(moto_url)
    prov = AWSProvider(client_factory=rec, region="us-east-1", endpoint_url=moto_url)
    prov.api._endpoint_url = moto_url  # emulator answers to "not implemented" are told apart by the endpoint
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_url)

    def tolerant(fn, *a, **kw):  # moto lacks some actions (placement groups, Service Quotas for ec2, Pricing)
        try:
            return fn(*a, **kw)
        except ProviderError as e:
            assert "ParamValidation" not in e.message, e.message
            return None

    req = Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16, hours=1.0, interruptible="auto")
    base = [offer("g5.xlarge")]
    tolerant(prov.offers, req)
    from broker.providers.aws import offers as _offers

    tolerant(_offers.offers, prov.api, base, prov._cache)
    tolerant(prov.capacity, base)
    tolerant(prov.quotas, req, base)
    tolerant(prov.live_prices, ["g5.xlarge"])
    q = Quota(provider="aws", name="L-DB2E81BA", region="us-east-1", limit=0, used=0, unit="vcpus")
    tolerant(prov.request_quota, q, 8, "parity")
    from broker.core.records import QuotaRequest

    tolerant(prov.quota_request_status, QuotaRequest(provider="aws", limit_name="L-DB2E81BA", region="us-east-1",
                                                     value=8, unit="vcpus", request_id="req-1", state="PENDING"))

    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer(), offer()], "multi-node", Rec())
    from broker.core.records import Ingress

    tolerant(prov.open_ingress, net, [Ingress(protocol="udp", port=51820, cidr="198.51.100.7/32")],
             Rec())
    on_demand = node_req(ec2, run, net).model_copy(update={"image": None})
    tolerant(prov.create_instance, on_demand)  # the DLAMI search (moto holds none: a clear error)
    iid = prov.create_instance(node_req(ec2, run, net))
    spot_req = node_req(ec2, run, net, i=1)
    spot_req = spot_req.model_copy(update={"offer": replace(spot_req.offer, attrs={
        "market": "spot", "interruptible": True, "bid_usd_per_hour": 0.5})})
    sid = prov.create_instance(spot_req)
    prov.describe_instance(iid)
    prov.describe_instance(sid)
    prov.preemption(sid)
    prov.list_tagged(run)
    for kind, pid in (("instance", iid), ("security_group", net["security_group_id"]),
                      ("placement_group", "broker-" + run)):
        tolerant(prov.tagged_resource, kind, pid)
    prov.stop(iid)
    prov.stopped_rate(iid)
    tolerant(prov.start, iid)
    prov.terminate("instance", sid)
    tolerant(prov.delete_run_network, run)
    tolerant(prov.terminate, "placement_group", "broker-" + run)

    # the paths moto cannot reach by itself (it answers none of them the way that leads there): sent directly
    from broker.providers.aws import lifecycle, network, quota_requests

    subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
    tolerant(network.bootstrap, prov.api, "run-" + uuid.uuid4().hex[:8], "us-east-1", None, "simulated", 1, Rec(),
             subnet)
    _offers.usage(prov.api, "L-DB2E81BA", "us-east-1")  # after a quota read (moto has no ec2 quotas)
    tolerant(quota_requests.open_request, prov.api.client("service-quotas"), "L-DB2E81BA")
    lifecycle.spot_rate(prov.api, prov.api.client("ec2"), {"InstanceType": "g5.xlarge",
                                                          "SpotInstanceRequestId": "sir-0123abcd"}, "us-east-1")

    assert rec.invalid == []
    ops = _operations()
    for service, op in rec.calls:
        assert op in ops[service], (service, op)
    named = _named_in_source(ops)
    exercised = {op for _, op in rec.calls}
    assert named - exercised == set(), f"operations the adapter names but this test never sent: {named - exercised}"
    assert {"run_instances", "describe_images", "describe_spot_price_history", "get_service_quota",
            "request_service_quota_increase", "get_metric_statistics", "get_products"} <= exercised
