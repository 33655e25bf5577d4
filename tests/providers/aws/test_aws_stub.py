"""AWS adapter at the botocore boundary with Stubber: errors moto cannot produce, Service Quotas, Pricing API,
placement groups, quota requests.  Request bodies are asserted (expected_params), responses follow the botocore
models (Stubber validates them)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from broker.core.model import Offer, Quota, Requirements, utcnow
from broker.core.provider import (
    RUN_TAG, AmbiguousCreate, AuthError, CapacityError, ProviderError, QuotaError, TransientError)
from broker.core.records import NodeRequest, QuotaRequest


@pytest.fixture(autouse=True)
def env(monkeypatch, tmp_path):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))


class Stubs:
    """client_factory: one real boto3 client per (service, region) with an active Stubber; records configs."""

    def __init__(self) -> None:
        self.clients: dict[tuple[str, str], Any] = {}
        self.stubbers: dict[str, Any] = {}
        self.configs: list[tuple[str, Any]] = []

    def stub(self, service: str, region: str = "us-east-1"):
        self(service, region, None)
        return self.stubbers[(service, region)]

    def __call__(self, service: str, region: str, cfg: Any) -> Any:
        import boto3
        from botocore.stub import Stubber

        self.configs.append((service, cfg))
        key = (service, region)
        if key not in self.clients:
            c = boto3.client(service, region_name=region, aws_access_key_id="testing",
                             aws_secret_access_key="testing")
            s = Stubber(c)
            s.activate()
            self.clients[key], self.stubbers[key] = c, s
        return self.clients[key]

    def assert_done(self) -> None:
        for s in self.stubbers.values():
            s.assert_no_pending_responses()


@pytest.fixture
def stubs():
    return Stubs()


@pytest.fixture
def prov(stubs):
    from broker.providers.aws import AWSProvider

    return AWSProvider(client_factory=stubs, region="us-east-1")


def offer(it: str = "g5.xlarge", vcpus: int = 4, zone: str = "us-east-1a", **attrs: Any) -> Offer:
    return Offer(provider="aws", offer_id=it, instance_type=it, region="us-east-1", zone=zone, gpu_name="A10G",
                 gpu_count=1, gpu_mem_gib=24, vcpus=vcpus, ram_gib=16, usd_per_hour=1.0, private_network=True,
                 price_source="test", price_time=utcnow(), attrs=attrs)


def node(o: Offer, nodes: int = 1) -> NodeRequest:
    return NodeRequest(run_id="run1", node_index=0, name="broker-run1-n0", offer=o, ssh_public_key="ssh-ed25519 AAA",
                       client_token="res-123", image="ami-12345678", deadline=utcnow() + timedelta(hours=1),
                       network={"security_group_id": "sg-1", "placement_group": "broker-run1", "nodes": nodes})


def prime_launch(stubs: Stubs) -> Any:
    """The calls create_instance makes before run_instances: token lookup (none) and image root device."""
    from botocore.stub import ANY

    ec2 = stubs.stub("ec2")
    ec2.add_response("describe_instances", {"Reservations": []},
                     {"Filters": [{"Name": "tag:broker-client-token", "Values": ["res-123"]},
                                  {"Name": "instance-state-name", "Values": ANY}]})
    ec2.add_response("describe_images", {"Images": [{"ImageId": "ami-12345678", "RootDeviceName": "/dev/sda1"}]},
                     {"ImageIds": ["ami-12345678"]})
    return ec2


def test_insufficient_capacity_500_is_capacity_error_one_attempt(prov, stubs):
    from botocore.stub import ANY

    ec2 = prime_launch(stubs)
    ec2.add_client_error("run_instances", service_error_code="InsufficientInstanceCapacity",
                         service_message="We currently do not have sufficient g5.xlarge capacity in us-east-1a.",
                         http_status_code=500, expected_params={
                             "ImageId": "ami-12345678", "InstanceType": "g5.xlarge", "MinCount": 1, "MaxCount": 1,
                             "InstanceInitiatedShutdownBehavior": "terminate", "ClientToken": "res-123",
                             "UserData": ANY, "TagSpecifications": ANY, "SecurityGroupIds": ["sg-1"],
                             "Placement": {"AvailabilityZone": "us-east-1a", "GroupName": "broker-run1"},
                             "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {
                                 "VolumeSize": 40, "VolumeType": "gp3", "DeleteOnTermination": True}}]})
    with pytest.raises(CapacityError) as ei:
        prov.create_instance(node(offer()))
    assert "InsufficientInstanceCapacity" in str(ei.value) and "next zone" in ei.value.hint
    assert ei.value.status == 500
    launch_cfgs = [c for s, c in stubs.configs if s == "ec2" and c is not None
                   and c.retries.get("total_max_attempts") == 1]
    assert launch_cfgs, "run_instances must go through a client with total_max_attempts=1"
    stubs.assert_done()


@pytest.mark.parametrize("it,vcpus,code", [("g5.xlarge", 4, "L-DB2E81BA"), ("p4d.24xlarge", 96, "L-417A185B")])
def test_vcpu_limit_is_quota_error_with_ready_command(prov, stubs, it, vcpus, code):
    ec2 = prime_launch(stubs)
    ec2.add_client_error("run_instances", service_error_code="VcpuLimitExceeded", http_status_code=400,
                         service_message="You have requested more vCPU capacity than your current vCPU limit of 0 "
                                         "allows for the instance bucket that the specified instance type belongs to.")
    with pytest.raises(QuotaError) as ei:
        prov.create_instance(node(offer(it, vcpus), nodes=2))
    e = ei.value
    assert code in e.message and f"{2 * vcpus} vCPUs for 2 node(s)" in e.message
    assert e.hint == f"broker quota request --provider aws --limit {code} --value {2 * vcpus} --region us-east-1"
    assert e.exit_code == 4


@pytest.mark.parametrize("code,status,exc", [
    ("Unsupported", 400, CapacityError), ("AuthFailure", 401, AuthError), ("UnauthorizedOperation", 403, AuthError),
    ("RequestLimitExceeded", 503, TransientError), ("InternalError", 500, AmbiguousCreate),
    ("InstanceLimitExceeded", 400, QuotaError), ("InvalidParameterCombination", 400, ProviderError)])
def test_launch_error_mapping(prov, stubs, code, status, exc):
    ec2 = prime_launch(stubs)
    ec2.add_client_error("run_instances", service_error_code=code, http_status_code=status, service_message="x")
    with pytest.raises(exc) as ei:
        prov.create_instance(node(offer()))
    assert type(ei.value) is exc and ei.value.code == code
    if code == "Unsupported":
        assert "NOT_OFFERED" in ei.value.message


def test_existing_token_returns_instance_without_launch(prov, stubs):
    ec2 = stubs.stub("ec2")
    ec2.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-0abc"}]}]})
    assert prov.create_instance(node(offer())) == "i-0abc"
    stubs.assert_done()


def test_spot_market_options_and_spot_quota(prov, stubs):
    from botocore.stub import ANY

    ec2 = prime_launch(stubs)
    ec2.add_response("run_instances", {"Instances": [{"InstanceId": "i-0spot"}]}, {
        "ImageId": ANY, "InstanceType": "g5.xlarge", "MinCount": 1, "MaxCount": 1,
        "InstanceInitiatedShutdownBehavior": "terminate", "ClientToken": "res-123", "UserData": ANY,
        "TagSpecifications": ANY, "SecurityGroupIds": ANY, "Placement": ANY, "BlockDeviceMappings": ANY,
        "InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": {
            "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}})
    assert prov.create_instance(node(offer(market="spot"))) == "i-0spot"
    sq = stubs.stub("service-quotas")
    sq.add_response("get_service_quota", {"Quota": {"ServiceCode": "ec2", "QuotaCode": "L-3819A6DF", "Value": 4.0,
                                                    "QuotaName": "All G and VT Spot Instance Requests"}},
                    {"ServiceCode": "ec2", "QuotaCode": "L-3819A6DF"})
    stubs.stub("cloudwatch").add_response("get_metric_statistics", {"Datapoints": []})
    qs = prov.quotas(Requirements(), [offer(market="spot")])
    assert [q.name for q in qs] == ["L-3819A6DF"]


def test_quotas_values_in_vcpus_and_default_fallback(prov, stubs):
    from botocore.stub import ANY

    sq = stubs.stub("service-quotas")
    cw = stubs.stub("cloudwatch")
    sq.add_response("get_service_quota", {"Quota": {
        "ServiceCode": "ec2", "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)", "QuotaCode": "L-DB2E81BA",
        "QuotaName": "Running On-Demand G and VT instances", "Value": 8.0, "Unit": "None", "Adjustable": True,
        "GlobalQuota": False, "QuotaAppliedAtLevel": "ACCOUNT"}}, {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
    cw.add_response("get_metric_statistics", {"Label": "ResourceCount", "Datapoints": [
        {"Timestamp": utcnow() - timedelta(minutes=5), "Maximum": 4.0, "Unit": "None"}]}, {
        "Namespace": "AWS/Usage", "MetricName": "ResourceCount",
        "Dimensions": [{"Name": "Service", "Value": "EC2"}, {"Name": "Type", "Value": "Resource"},
                       {"Name": "Resource", "Value": "vCPU"}, {"Name": "Class", "Value": "G/OnDemand"}],
        "StartTime": ANY, "EndTime": ANY, "Period": 300, "Statistics": ["Maximum"]})
    sq.add_client_error("get_service_quota", service_error_code="NoSuchResourceException", http_status_code=400,
                        expected_params={"ServiceCode": "ec2", "QuotaCode": "L-417A185B"})
    sq.add_response("get_aws_default_service_quota", {"Quota": {
        "ServiceCode": "ec2", "QuotaCode": "L-417A185B", "QuotaName": "Running On-Demand P instances", "Value": 0.0,
        "Unit": "None"}}, {"ServiceCode": "ec2", "QuotaCode": "L-417A185B"})
    cw.add_client_error("get_metric_statistics", service_error_code="AccessDenied", http_status_code=403)
    offers = [offer("g5.xlarge"), offer("g6.xlarge"), offer("g5.xlarge", zone="us-east-1b"), offer("p5.48xlarge", 192)]
    qs = {q.name: q for q in prov.quotas(Requirements(), offers)}
    g, p = qs["L-DB2E81BA"], qs["L-417A185B"]
    assert (g.limit, g.used, g.available, g.unit) == (8.0, 4.0, 4.0, "vcpus")
    assert g.instance_types == ["g5.xlarge", "g6.xlarge"] and g.scope == "us-east-1"
    assert (p.limit, p.used, p.instance_types) == (0.0, 0.0, ["p5.48xlarge"])
    assert "default" in p.source and "usage unknown" in p.description
    stubs.assert_done()


def test_bootstrap_placement_group_call_shape(prov, stubs):
    ec2 = stubs.stub("ec2")
    ec2.add_response("describe_vpcs", {"Vpcs": [{"VpcId": "vpc-1", "IsDefault": True}]},
                     {"Filters": [{"Name": "isDefault", "Values": ["true"]}]})
    ec2.add_response("create_security_group", {"GroupId": "sg-1"}, {
        "GroupName": "broker-run1", "VpcId": "vpc-1", "Description": "broker run run1: members talk freely, SSH in",
        "TagSpecifications": [{"ResourceType": "security-group", "Tags": [
            {"Key": RUN_TAG, "Value": "run1"}, {"Key": "Name", "Value": "broker-run1"}]}]})
    ec2.add_response("authorize_security_group_ingress", {"Return": True}, {"GroupId": "sg-1", "IpPermissions": [
        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": "sg-1", "Description": "broker nodes of this run"}]},
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
         "IpRanges": [{"CidrIp": "0.0.0.0/0", "Description": "SSH (key only) from the broker CLI"}]}]})
    ec2.add_response("create_placement_group", {"PlacementGroup": {"GroupName": "broker-run1", "Strategy": "cluster",
                                                                   "State": "available"}}, {
        "GroupName": "broker-run1", "Strategy": "cluster", "TagSpecifications": [
            {"ResourceType": "placement-group",
             "Tags": [{"Key": RUN_TAG, "Value": "run1"}, {"Key": "Name", "Value": "broker-run1"}]}]})
    calls: list[tuple] = []

    class Rec:
        def intent(self, kind, name, **kw):
            calls.append(("intent", kind))
            return kind

        def created(self, rid, pid, **kw):
            calls.append(("created", rid, pid))

        def failed(self, rid, err):
            calls.append(("failed", rid))

        def event(self, msg):
            pass

    net = prov.bootstrap("run1", [offer(), offer()], "multi-node", Rec())
    assert net["placement_group"] == "broker-run1" and net["security_group_id"] == "sg-1"
    assert calls == [("intent", "security_group"), ("created", "security_group", "sg-1"),
                     ("intent", "placement_group"), ("created", "placement_group", "broker-run1")]
    stubs.assert_done()


@pytest.mark.parametrize("code,status,exc,recorded", [
    ("InternalError", 500, AmbiguousCreate, []),  # may exist: the intent row stays for reconcile
    ("InvalidParameterValue", 400, ProviderError, ["r1"])])  # refused for sure: recorded as failed
def test_placement_group_error_without_custom_endpoint_is_raised_and_recorded(prov, stubs, code, status, exc,
                                                                              recorded):
    from broker.providers.aws import network

    ec2 = stubs.stub("ec2")
    ec2.add_client_error("create_placement_group", service_error_code=code, http_status_code=status)
    failed, events = [], []

    class Rec:
        def intent(self, kind, name, **kw):
            return "r1"

        def created(self, *a, **kw):
            raise AssertionError("not created")

        def failed(self, rid, err):
            failed.append(rid)

        def event(self, msg):
            events.append(msg)

    with pytest.raises(exc) as ei:
        network.placement_group(prov.api, stubs.clients[("ec2", "us-east-1")], "run1", "us-east-1", Rec())
    assert type(ei.value) is exc and failed == recorded
    if not recorded:
        assert any("may exist" in e for e in events)


def test_capacity_not_offered_and_unknown(prov, stubs):
    ec2 = stubs.stub("ec2")
    ec2.add_response("describe_instance_type_offerings", {"InstanceTypeOfferings": [
        {"InstanceType": "g5.xlarge", "LocationType": "availability-zone", "Location": "us-east-1a"},
        {"InstanceType": "g5.xlarge", "LocationType": "availability-zone", "Location": "us-east-1b"},
        {"InstanceType": "p5.48xlarge", "LocationType": "availability-zone", "Location": "us-east-1a"}]},
        {"LocationType": "availability-zone",
         "Filters": [{"Name": "instance-type", "Values": ["g5.xlarge", "p5.48xlarge"]}]})
    caps = prov.capacity([offer("g5.xlarge", zone="us-east-1a"), offer("p5.48xlarge", 192, zone="us-east-1a")])
    got = {(c.instance_type, c.zone): c.status for c in caps}
    assert got == {("g5.xlarge", "us-east-1a"): "UNKNOWN", ("g5.xlarge", "us-east-1b"): "UNKNOWN",
                   ("p5.48xlarge", "us-east-1a"): "UNKNOWN", ("p5.48xlarge", "us-east-1b"): "NOT_OFFERED"}


def _price_item(it: str, usd: str, sku: str) -> str:
    return json.dumps({
        "product": {"productFamily": "Compute Instance", "sku": sku, "attributes": {
            "instanceType": it, "location": "US East (N. Virginia)", "locationType": "AWS Region",
            "regionCode": "us-east-1", "operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA",
            "capacitystatus": "Used", "licenseModel": "No License required", "vcpu": "4", "gpu": "1",
            "servicecode": "AmazonEC2", "usagetype": f"BoxUsage:{it}"}},
        "serviceCode": "AmazonEC2",
        "terms": {
            "OnDemand": {f"{sku}.JRTCKXETXF": {
                "priceDimensions": {f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                    "unit": "Hrs", "endRange": "Inf", "beginRange": "0", "appliesTo": [],
                    "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7",
                    "description": f"${usd} per On Demand Linux {it} Instance Hour",
                    "pricePerUnit": {"USD": usd}}},
                "sku": sku, "effectiveDate": "2025-06-01T00:00:00Z", "offerTermCode": "JRTCKXETXF",
                "termAttributes": {}}},
            "Reserved": {f"{sku}.4NA7Y494T4": {
                "priceDimensions": {f"{sku}.4NA7Y494T4.6YS6EN2CT7": {
                    "unit": "Hrs", "pricePerUnit": {"USD": "0.6330000000"}, "description": "reserved"}},
                "sku": sku, "offerTermCode": "4NA7Y494T4",
                "termAttributes": {"LeaseContractLength": "1yr", "PurchaseOption": "No Upfront"}}}},
        "version": "20260101000000", "publicationDate": "2026-01-01T00:00:00Z"})


def test_live_prices_parses_price_list_json_strings(prov, stubs):
    pr = stubs.stub("pricing", "us-east-1")

    def params(it):
        return {"ServiceCode": "AmazonEC2", "FormatVersion": "aws_v1", "MaxResults": 100, "Filters": [
            {"Type": "TERM_MATCH", "Field": "instanceType", "Value": it},
            {"Type": "TERM_MATCH", "Field": "location", "Value": "US East (N. Virginia)"},
            {"Type": "TERM_MATCH", "Field": "operatingSystem", "Value": "Linux"},
            {"Type": "TERM_MATCH", "Field": "tenancy", "Value": "Shared"},
            {"Type": "TERM_MATCH", "Field": "preInstalledSw", "Value": "NA"},
            {"Type": "TERM_MATCH", "Field": "capacitystatus", "Value": "Used"}]}

    pr.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [_price_item("g5.xlarge", "1.0060000000",
                                                                                           "AAA")],
                                     "NextToken": "page2"}, params("g5.xlarge"))
    pr.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [_price_item("g5.xlarge", "0.0000000000",
                                                                                           "BBB")]},
                    {**params("g5.xlarge"), "NextToken": "page2"})
    pr.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": []}, params("x9.nothing"))
    assert prov.live_prices(["g5.xlarge", "x9.nothing"]) == {"g5.xlarge": 1.006}
    stubs.assert_done()


# ------------------------------------------------------------------------------------------- quota requests
def gq(limit: float = 0.0, used: float = 0.0) -> Quota:
    return Quota(provider="aws", name="L-DB2E81BA", region="us-east-1", scope="us-east-1", limit=limit, used=used,
                 unit="vcpus")


def test_request_quota_files_vcpu_value_on_demand_code(prov, stubs):
    sq = stubs.stub("service-quotas")
    sq.add_response("request_service_quota_increase", {"RequestedQuota": {
        "Id": "req-abc", "ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA", "DesiredValue": 8.0, "Status": "PENDING",
        "Created": datetime(2026, 11, 30, tzinfo=timezone.utc), "Unit": "None"}},
        {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA", "DesiredValue": 8.0})
    r = prov.request_quota(gq(), 8, "PyTorch distributed training validation: 2 nodes x 1 GPU")
    assert (r.request_id, r.state, r.value, r.unit, r.limit_name) == ("req-abc", "PENDING", 8.0, "vcpus", "L-DB2E81BA")
    stubs.assert_done()


def test_request_quota_open_request_is_reported_not_duplicated(prov, stubs):
    sq = stubs.stub("service-quotas")
    sq.add_client_error("request_service_quota_increase", service_error_code="ResourceAlreadyExistsException",
                        service_message="Only one open service quota increase request is allowed per quota.",
                        http_status_code=400)
    sq.add_response("list_requested_service_quota_change_history_by_quota", {"RequestedQuotas": [
        {"Id": "old", "QuotaCode": "L-DB2E81BA", "DesiredValue": 4.0, "Status": "APPROVED",
         "Created": datetime(2026, 1, 1, tzinfo=timezone.utc)},
        {"Id": "req-open", "QuotaCode": "L-DB2E81BA", "DesiredValue": 8.0, "Status": "CASE_OPENED",
         "CaseId": "case-42", "Created": datetime(2026, 11, 29, tzinfo=timezone.utc)}]},
        {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
    r = prov.request_quota(gq(), 8, "why")
    assert r.request_id == "req-open" and r.state == "CASE_OPENED"
    assert "already open" in r.message and "case-42" in r.message
    stubs.assert_done()


def test_request_quota_access_denied_names_permission(prov, stubs):
    stubs.stub("service-quotas").add_client_error(
        "request_service_quota_increase", service_error_code="AccessDeniedException", http_status_code=400,
        service_message="User: arn:aws:iam::123456789012:user/x is not authorized")
    with pytest.raises(AuthError) as ei:
        prov.request_quota(gq(), 8, "why")
    assert "servicequotas:RequestServiceQuotaIncrease" in ei.value.hint


def test_request_quota_draft_files_nothing(prov, stubs):
    r = prov.request_quota(gq(limit=4), 8, "PyTorch distributed training validation: 2 nodes x 1 GPU", draft=True)
    assert r.state == "DRAFT" and r.request_id is None
    assert r.form["quota_code"] == "L-DB2E81BA" and r.form["desired_value"] == 8.0
    assert r.form["quota_name"] == "Running On-Demand G and VT instances" and "vCPUs" in r.form["unit"]
    assert stubs.clients == {}  # no client, no call


def test_quota_request_status_denied(prov, stubs):
    stubs.stub("service-quotas").add_response("get_requested_service_quota_change", {"RequestedQuota": {
        "Id": "req-abc", "QuotaCode": "L-DB2E81BA", "DesiredValue": 8.0, "Status": "DENIED"}},
        {"RequestId": "req-abc"})
    r = prov.quota_request_status(QuotaRequest(provider="aws", limit_name="L-DB2E81BA", region="us-east-1",
                                               value=8, unit="vcpus", request_id="req-abc", state="PENDING"))
    assert r.state == "DENIED" and "denied" in r.message


def test_terminate_sg_dependency_violation_is_transient(prov, stubs):
    stubs.stub("ec2").add_client_error("delete_security_group", service_error_code="DependencyViolation",
                                       http_status_code=400)
    with pytest.raises(TransientError):
        prov.terminate("security_group", "sg-1")


def test_terminate_instance_still_shutting_down_is_false(prov, stubs):
    ec2 = stubs.stub("ec2")
    ec2.add_response("terminate_instances", {"TerminatingInstances": [{"InstanceId": "i-1", "CurrentState": {
        "Code": 32, "Name": "shutting-down"}}]}, {"InstanceIds": ["i-1"]})
    ec2.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-1", "State": {
        "Code": 32, "Name": "shutting-down"}}]}]}, {"InstanceIds": ["i-1"]})
    assert prov.terminate("instance", "i-1") is False


# ------------------------------------------------------------------------------------------- offline rule
def test_check_and_offers_offline_without_credentials(monkeypatch, tmp_path):
    import boto3

    from broker.providers.aws import AWSProvider, credentials_present

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "nope"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "nope2"))

    def boom(*a, **k):
        raise AssertionError("a boto3 session/client was created while not configured")

    monkeypatch.setattr(boto3.session, "Session", boom)
    p = AWSProvider(region="us-east-1")
    c = p.check()
    assert c.configured is False and c.hint
    offers = p.offers(Requirements(gpu_names=["A10G"]))
    assert offers and all(o.zone is None and o.private_network for o in offers)
    assert "snapshot" in offers[0].price_source
    assert p.quotas(Requirements(), offers) == [] and p.capacity(offers) == [] and p.list_tagged() == []
    with pytest.raises(AuthError):
        p.describe_instance("i-1")

    creds = tmp_path / "creds"
    creds.write_text("[default]\naws_access_key_id = AKIAFAKE\naws_secret_access_key = x\n")
    assert credentials_present({"AWS_SHARED_CREDENTIALS_FILE": str(creds)}, tmp_path)[0] is True
    ok, why = credentials_present({"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_PROFILE": "work"}, tmp_path)
    assert ok is False and "work" in why
    conf = tmp_path / "conf"
    conf.write_text("[profile work]\nsso_session = corp\n")
    assert credentials_present({"AWS_CONFIG_FILE": str(conf), "AWS_PROFILE": "work"}, tmp_path)[0] is True


def test_missing_boto3_is_an_actionable_error_not_a_traceback(monkeypatch):
    """With credentials but without the `aws` extra: check() says to install it, and a client call is an
    AuthError (provider unusable) naming the install command, never a ModuleNotFoundError."""
    import builtins
    import importlib.util

    import broker.providers.aws as aws
    from broker.core.provider import AuthError

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake")
    real_find, real_import = importlib.util.find_spec, builtins.__import__
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "boto3" else real_find(n, *a))

    def no_botocore(name, *a, **k):
        if name.startswith(("boto3", "botocore")):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_botocore)
    p = aws.AWSProvider()
    chk = p.check()
    assert not chk.configured and "boto3 is not installed" in chk.detail and "'.[aws]'" in chk.hint
    with pytest.raises(AuthError, match="boto3 is not installed") as ei:
        p.api.client("ec2")
    assert "pip install" in str(ei.value)


def test_debug_log_names_each_call_and_outcome_never_the_boot_script(prov, stubs, caplog):
    """`broker -vv`: each EC2 call is logged with its name and outcome (ok, or the mapped error); its parameters
    at DEBUG without the UserData boot script (it can carry keys)."""
    import logging

    from botocore.stub import ANY

    ec2 = prime_launch(stubs)
    ec2.add_client_error("run_instances", service_error_code="InsufficientInstanceCapacity",
                         service_message="no g5.xlarge capacity", http_status_code=500,
                         expected_params={"ImageId": ANY, "InstanceType": ANY, "MinCount": 1, "MaxCount": 1,
                                          "InstanceInitiatedShutdownBehavior": ANY, "ClientToken": ANY,
                                          "UserData": ANY, "TagSpecifications": ANY, "SecurityGroupIds": ANY,
                                          "Placement": ANY, "BlockDeviceMappings": ANY})
    with caplog.at_level(logging.DEBUG, logger="broker"), pytest.raises(CapacityError):
        prov.create_instance(node(offer()))
    text = caplog.text
    assert "aws describe_instances: ok" in text
    assert "aws run_instances: failed" in text and "InsufficientInstanceCapacity" in text
    assert '"UserData": "<' in text and '"InstanceType": "g5.xlarge"' in text
    assert "#!/" not in text and "ssh-ed25519 AAA" not in text
