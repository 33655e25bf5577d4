"""Create errors sorted into definite (fail the option at once) and ambiguous (settle, then check by tag), and a
429 retried in place with the provider's backoff, at the real boundaries: the real ``oci`` SDK against a local HTTP
server, moto in server mode for AWS, the file-backed fake cloud for the core's failover."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.core.model import Requirements, utcnow
from broker.core.records import Run
from broker.core.provider import TransientError
from broker.providers.fake import FakeProvider


def _run(ledger: Ledger, tmp: Path, provider: str) -> Run:
    now = utcnow()
    rid = "20261201-120000-" + uuid.uuid4().hex[:6]
    run = Run(id=rid, name="t", provider=provider, topology="simulated", status="provisioning", created_at=now,
              deadline=now + timedelta(hours=1), run_dir=str(tmp / "runs" / rid), budget_usd=100)
    Path(run.run_dir).mkdir(parents=True)
    return ledger.create_run(run)


class Throttling(FakeProvider):
    """The fake cloud whose first ``n`` creates answer 429 with a Retry-After (as OCI's LaunchInstance does)."""

    def __init__(self, n: int, *a, **kw):
        super().__init__(*a, **kw)
        self.n, self.creates, self.lists, self.zones = n, 0, 0, []
        self.create_settle_s = 5.0  # a settle-and-check would show as list_tagged calls

    def create_instance(self, req):
        self.creates += 1
        self.zones.append(req.offer.zone)
        if self.creates <= self.n:
            e = TransientError(self.name, "create_instance", "429 TooManyRequests: slow down", status=429)
            e.retry_after_s = 0.05
            raise e
        return super().create_instance(req)

    def list_tagged(self, run_id=None):
        self.lists += 1
        return super().list_tagged(run_id)


def test_a_429_on_create_is_retried_in_place_not_checked_by_tag_nor_moved_to_the_next_zone(tmp_path, fake_cloud):
    from tests.support.plans import rank_options
    from broker.money.provision import provision

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    p = Throttling(3)
    req = Requirements(nodes=1, gpus_per_node=1, cpu_ok=True, topology="simulated", budget_usd=100, hours=1)
    opts = [o for o in rank_options(p, req) if o.topology.value == "simulated"]
    assert len({o.offers[0].zone for o in opts}) > 1  # another zone was there to move to
    ledger = Ledger()
    said: list[str] = []
    cluster = provision(opts, _run(ledger, tmp_path, "fake"), Requirements(), ledger, providers={"fake": p},
                        poll_s=0.02, retry_wait_s=0.01, terminate_timeout_s=5, progress=said.append)
    assert cluster.nodes and p.creates == 4
    assert set(p.zones) == {opts[0].offers[0].zone}  # the same zone every time
    assert p.lists == 0 and not any("ambiguous" in s for s in said)
    assert sum("throttled" in s and "same zone" in s for s in said) == 3
    assert len([r for r in ledger.resources() if r.kind == "instance"]) == 1  # one row, one instance


# --------------------------------------------------------------------------------------------------- OCI
def test_oci_launch_429_is_definite_and_keeps_oci_s_retry_after(own_httpserver, key_pem, tmp_path, monkeypatch):
    pytest.importorskip("oci")
    import tests.providers.oci.test_oci as test_oci

    from broker.money.provision import _ambiguous, _throttled

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OCI_CONFIG_FILE", str(tmp_path / "no-such-oci-config"))
    conf = {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": test_oci.TENANCY,
            "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff", "key_content": key_pem,
            "region": test_oci.REGION}
    own_httpserver.expect_request("/20160918/instances", method="POST").respond_with_response(
        test_oci.jresp({"code": "TooManyRequests", "message": "Too many requests for the tenancy"}, status=429,
                       headers={"Retry-After": "7"}))
    p = test_oci.make(conf, own_httpserver)
    with pytest.raises(TransientError) as ei:
        p.create_instance(test_oci.node_request(image="ocid1.image.oc1..mine"))
    e = ei.value
    assert e.status == 429 and getattr(e, "retry_after_s", None) == 7.0
    assert _throttled(e) and not _ambiguous(e)  # refused: no settle-and-check, no other AD
    assert len([r for r, _ in own_httpserver.log if r.method == "POST"]) == 1


# --------------------------------------------------------------------------------------------------- AWS
def test_aws_no_image_found_before_run_instances_is_definite_not_settled_and_checked(tmp_path, monkeypatch):
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer

    import boto3

    from broker.core.provider import NoValidPlan, ProviderError
    from broker.providers.aws import AWSProvider
    from broker.money.provision import provision

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AWS_AMI_ID", raising=False)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                        region_name="us-east-1")
        p = AWSProvider(session=session, endpoint_url=f"http://{host}:{port}", region="us-east-1")
        lists = []
        real_list = p.list_tagged
        p.list_tagged = lambda run_id=None: lists.append(run_id) or real_list(run_id)  # type: ignore[method-assign]
        from broker.core.model import PlanOption
        from tests.providers.aws.test_aws_moto import offer

        opts = [PlanOption(provider="aws", topology="simulated", offers=[offer(zone=z)], nodes=1, gpus_per_node=1,
                           usd_per_hour=1.006, worst_case_usd=1.006, hours=1)
                for z in ("us-east-1a", "us-east-1b", "us-east-1c")]
        ledger = Ledger()
        said: list[str] = []
        with pytest.raises((NoValidPlan, ProviderError)) as ei:
            provision(opts, _run(ledger, tmp_path, "aws"), Requirements(), ledger, providers={"aws": p},
                      poll_s=0.02, retry_wait_s=0.01, terminate_timeout_s=10, progress=said.append)
        assert str(ei.value).count("no available PyTorch Deep Learning AMI") == 1, str(ei.value)  # once, not once per option
        assert "same as option 1/3" in str(ei.value)
        assert not any("ambiguous" in s for s in said), said
        assert lists == []  # no settle-and-check by tag: nothing could have been created
        rows = [r for r in ledger.resources() if r.kind == "instance"]
        assert rows and all(r.state == "terminated" and not r.provider_id for r in rows)
        assert not any(r.attrs.get("ambiguous_create_at") for r in rows)
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------- region limits
class SubnetLimited(FakeProvider):
    """The fake cloud whose network bootstrap hits a region-wide subnet limit, as OCI answers it (400
    LimitExceeded for ``subnet-count``, scope = the region)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.bootstraps = 0

    def bootstrap(self, run_id, offers, topology, rec):
        from broker.core.provider import QuotaError

        self.bootstraps += 1
        e = QuotaError(self.name, "create_subnet", "service limit subnet-count exceeded: The following service "
                       "limits were exceeded: subnet-count", hint="raise subnet-count (Console: Governance & "
                       "Administration > Limits, Quotas and Usage) or delete unused resources that count against it")
        e.scope, e.limit_name = offers[0].region, "subnet-count"
        raise e


def test_a_region_wide_network_limit_is_hit_once_and_suggests_no_unfileable_request(tmp_path, fake_cloud):
    from tests.support.plans import rank_options
    from broker.core.provider import NoValidPlan
    from broker.money.provision import provision

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    p = SubnetLimited()
    req = Requirements(nodes=2, gpus_per_node=1, cpu_ok=True, topology="multi-node", budget_usd=100, hours=1)
    opts = [o for o in rank_options(p, req) if o.topology.value == "multi-node"]
    regions = {o.offers[0].region for o in opts}
    zones = {(o.offers[0].region, o.offers[0].zone) for o in opts}
    assert len(zones) > len(regions)  # more than one zone per region to rebuild the network in
    ledger = Ledger()
    with pytest.raises(NoValidPlan) as ei:
        provision(opts, _run(ledger, tmp_path, "fake"), Requirements(), ledger, providers={"fake": p},
                  poll_s=0.02, retry_wait_s=0.01, terminate_timeout_s=5)
    assert p.bootstraps == len(regions)  # once per region, not once per zone
    text = str(ei.value)
    assert "broker quota request" not in text and "Limits, Quotas and Usage" in text
    assert ei.value.message.count("subnet-count exceeded") == len(regions)
