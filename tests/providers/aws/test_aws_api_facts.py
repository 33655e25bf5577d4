"""AWS facts the adapter must get right against the real API (docs/reference/cloud-apis.md C1-C3): Service Quotas
codes per generation, the usage metric's spelling, the image's root snapshot, the DLAMI choice and spot prices.
Every call goes through a real boto3 client (Stubber validates each request and answer against the botocore model).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from broker.core.model import utcnow
from broker.core.provider import QuotaError
from tests.providers.aws.test_aws_stub import Stubs, node, offer, prime_launch


@pytest.fixture(autouse=True)
def env(monkeypatch, tmp_path):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.delenv("AWS_AMI_ID", raising=False)


@pytest.fixture
def stubs():
    return Stubs()


@pytest.fixture
def prov(stubs):
    from broker.providers.aws import AWSProvider

    return AWSProvider(client_factory=stubs, region="us-east-1")


# ------------------------------------------------------------------------------------------- quota codes
#: Service Quotas' own names for the EC2 vCPU quotas broker uses (ServiceCode ec2)
SERVICE_QUOTAS = {
    "L-DB2E81BA": "Running On-Demand G and VT instances",
    "L-417A185B": "Running On-Demand P instances",
    "L-3819A6DF": "All G and VT Spot Instance Requests",
    "L-7212CCBC": "All P4, P3 and P2 Spot Instance Requests",
    "L-C4BD4855": "All P5 Spot Instance Requests",
    "L-1216C47A": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
}


def test_quota_table_names_are_service_quotas_names():
    from broker.providers.aws.limits import AWS_QUOTA_CODES

    assert {c: q.name for c, q in AWS_QUOTA_CODES.items()} == SERVICE_QUOTAS


@pytest.mark.parametrize("it,spot,code", [
    ("p5.48xlarge", True, "L-C4BD4855"), ("p5.4xlarge", True, "L-C4BD4855"), ("p5en.48xlarge", True, "L-C4BD4855"),
    ("p4d.24xlarge", True, "L-7212CCBC"), ("p3.2xlarge", True, "L-7212CCBC"), ("g5.xlarge", True, "L-3819A6DF"),
    ("p5.48xlarge", False, "L-417A185B"), ("g6e.xlarge", False, "L-DB2E81BA")])
def test_quota_code_per_generation(it, spot, code):
    from broker.providers.aws.limits import aws_quota_code

    assert aws_quota_code(it, spot=spot).code == code


def test_unknown_p_generation_spot_names_no_wrong_quota():
    from broker.providers.aws.limits import aws_quota_code

    assert aws_quota_code("p6-b200.48xlarge", spot=True) is None
    assert aws_quota_code("p6-b200.48xlarge").code == "L-417A185B"


def test_p5_spot_count_exceeded_asks_for_the_p5_spot_quota(prov, stubs):
    ec2 = prime_launch(stubs)
    ec2.add_client_error("run_instances", service_error_code="MaxSpotInstanceCountExceeded", http_status_code=400,
                         service_message="Max spot instance count exceeded")
    with pytest.raises(QuotaError) as ei:
        prov.create_instance(node(offer("p5.48xlarge", 192, market="spot")))
    e = ei.value
    assert "L-C4BD4855" in e.message and "All P5 Spot Instance Requests" in e.message
    assert e.hint == "broker quota request --provider aws --limit L-C4BD4855 --value 192 --region us-east-1"
    assert getattr(e, "quota_code") == "L-C4BD4855"


@pytest.mark.parametrize("code,cls", [("L-1216C47A", "Standard/OnDemand"), ("L-DB2E81BA", "G/OnDemand"),
                                      ("L-417A185B", "P/OnDemand"), ("L-3819A6DF", "G/Spot"),
                                      ("L-7212CCBC", "P/Spot")])
def test_usage_metric_class_spelling(prov, stubs, code, cls):
    from botocore.stub import ANY

    from broker.providers.aws.offers import usage

    stubs.stub("cloudwatch").add_response("get_metric_statistics", {"Datapoints": [
        {"Timestamp": utcnow() - timedelta(minutes=1), "Maximum": 8.0}]}, {
        "Namespace": "AWS/Usage", "MetricName": "ResourceCount",
        "Dimensions": [{"Name": "Service", "Value": "EC2"}, {"Name": "Type", "Value": "Resource"},
                       {"Name": "Resource", "Value": "vCPU"}, {"Name": "Class", "Value": cls}],
        "StartTime": ANY, "EndTime": ANY, "Period": 300, "Statistics": ["Maximum"]})
    assert usage(prov.api, code, "us-east-1") == (8.0, "")
    stubs.assert_done()


def test_quota_usage_follows_the_quotas_own_usage_metric(prov, stubs):
    """Service Quotas names the CloudWatch metric of each quota (``UsageMetric``); that one is read."""
    from botocore.stub import ANY

    from broker.core.model import Requirements

    stubs.stub("service-quotas").add_response("get_service_quota", {"Quota": {
        "ServiceCode": "ec2", "QuotaCode": "L-C4BD4855", "QuotaName": "All P5 Spot Instance Requests", "Value": 192.0,
        "UsageMetric": {"MetricNamespace": "AWS/Usage", "MetricName": "ResourceCount",
                        "MetricDimensions": {"Service": "EC2", "Type": "Resource", "Resource": "vCPU",
                                             "Class": "P5/Spot"},
                        "MetricStatisticRecommendation": "Maximum"}}},
        {"ServiceCode": "ec2", "QuotaCode": "L-C4BD4855"})
    stubs.stub("cloudwatch").add_response("get_metric_statistics", {"Datapoints": []}, {
        "Namespace": "AWS/Usage", "MetricName": "ResourceCount",
        "Dimensions": [{"Name": "Service", "Value": "EC2"}, {"Name": "Type", "Value": "Resource"},
                       {"Name": "Resource", "Value": "vCPU"}, {"Name": "Class", "Value": "P5/Spot"}],
        "StartTime": ANY, "EndTime": ANY, "Period": 300, "Statistics": ["Maximum"]})
    qs = prov.quotas(Requirements(), [offer("p5.48xlarge", 192, market="spot")])
    assert [(q.name, q.limit, q.used) for q in qs] == [("L-C4BD4855", 192.0, 0.0)]
    stubs.assert_done()


# ------------------------------------------------------------------------------------------- image and root disk
def dlami(image_id: str, name: str, created: str, snapshot_gib: int = 75, **extra) -> dict:
    """A DescribeImages item as EC2 lists a Deep Learning AMI (root snapshot size in GiB)."""
    return {"ImageId": image_id, "Name": name, "CreationDate": created, "State": "available",
            "Architecture": extra.pop("arch", "x86_64"), "RootDeviceName": "/dev/sda1",
            "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {
                "SnapshotId": "snap-0123456789abcdef0", "VolumeSize": snapshot_gib, "VolumeType": "gp3",
                "DeleteOnTermination": True}}, {"DeviceName": "/dev/sdb", "VirtualName": "ephemeral0"}], **extra}


U24 = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.8 (Ubuntu 24.04) 20251101"
U22 = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.7 (Ubuntu 22.04) 20251201"


def prime_dlami(stubs, images: list[dict], arch: str = "x86_64"):
    """The calls before run_instances when no image is named: token lookup, then the DLAMI search."""
    from botocore.stub import ANY

    from broker.providers.aws.lifecycle import DLAMI_NAMES

    ec2 = stubs.stub("ec2")
    ec2.add_response("describe_instances", {"Reservations": []},
                     {"Filters": [{"Name": "tag:broker-client-token", "Values": ["res-123"]},
                                  {"Name": "instance-state-name", "Values": ANY}]})
    ec2.add_response("describe_images", {"Images": images}, {"Owners": ["amazon"], "Filters": [
        {"Name": "name", "Values": list(DLAMI_NAMES)}, {"Name": "state", "Values": ["available"]},
        {"Name": "architecture", "Values": [arch]}]})
    return ec2


def launch_params(image: str, volume_gib: int) -> dict:
    from botocore.stub import ANY

    return {"ImageId": image, "InstanceType": ANY, "MinCount": 1, "MaxCount": 1,
            "InstanceInitiatedShutdownBehavior": "terminate", "ClientToken": "res-123", "UserData": ANY,
            "TagSpecifications": ANY, "SecurityGroupIds": ANY, "Placement": ANY,
            "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {
                "VolumeSize": volume_gib, "VolumeType": "gp3", "DeleteOnTermination": True}}]}


def unnamed(n):
    """``node()`` without an image: the adapter chooses the DLAMI."""
    return n.model_copy(update={"image": None})


def test_root_volume_is_at_least_the_images_snapshot(prov, stubs):
    ec2 = prime_dlami(stubs, [dlami("ami-0newer", U24, "2025-11-01T00:00:00.000Z", snapshot_gib=75)])
    ec2.add_response("run_instances", {"Instances": [{"InstanceId": "i-0abc"}]}, launch_params("ami-0newer", 75))
    assert prov.create_instance(unnamed(node(offer()))) == "i-0abc"  # the recipe asks 40 GiB
    stubs.assert_done()


def test_a_larger_recipe_disk_stays(prov, stubs):
    ec2 = prime_dlami(stubs, [dlami("ami-0newer", U24, "2025-11-01T00:00:00.000Z", snapshot_gib=75)])
    ec2.add_response("run_instances", {"Instances": [{"InstanceId": "i-0abc"}]}, launch_params("ami-0newer", 200))
    assert prov.create_instance(unnamed(node(offer())).model_copy(update={"disk_gib": 199.5})) == "i-0abc"
    stubs.assert_done()


def test_invalid_block_device_mapping_names_the_snapshot_and_the_fix(prov, stubs):
    ec2 = prime_dlami(stubs, [dlami("ami-0newer", U24, "2025-11-01T00:00:00.000Z", snapshot_gib=75)])
    ec2.add_client_error("run_instances", service_error_code="InvalidBlockDeviceMapping", http_status_code=400,
                         service_message="Volume of size 40GB is smaller than snapshot 'snap-0123456789abcdef0', "
                                         "expect size >= 75GB")
    from broker.core.provider import ProviderError

    with pytest.raises(ProviderError) as ei:
        prov.create_instance(unnamed(node(offer())))
    e = ei.value
    assert e.code == "InvalidBlockDeviceMapping" and "ami-0newer" in e.message and U24 in e.message
    assert "75 GiB" in e.hint and "disk_gib" in e.hint and "AWS_AMI_ID" in e.hint


def test_newest_supported_pytorch_dlami_is_chosen_and_named(prov, stubs, caplog):
    import logging

    images = [dlami("ami-0old22", U22.replace("20251201", "20240101"), "2024-01-01T00:00:00.000Z"),
              dlami("ami-0new24", U24, "2025-11-01T00:00:00.000Z"),
              dlami("ami-0new22", U22, "2025-12-01T00:00:00.000Z"),
              # newest, but deprecated already: EC2 still lists it to some callers
              dlami("ami-0gone", U24.replace("20251101", "20251205"), "2025-12-05T00:00:00.000Z",
                    DeprecationTime="2025-12-06T00:00:00.000Z")]
    ec2 = prime_dlami(stubs, images)
    ec2.add_response("run_instances", {"Instances": [{"InstanceId": "i-0abc"}]}, launch_params("ami-0new22", 75))
    with caplog.at_level(logging.INFO, logger="broker.providers.aws.lifecycle"):
        prov.create_instance(unnamed(node(offer())))
    assert "ami-0new22" in caplog.text and U22 in caplog.text
    stubs.assert_done()


def test_graviton_type_looks_for_arm64_images(prov, stubs):
    arm = "Deep Learning ARM64 OSS Nvidia Driver AMI GPU PyTorch 2.8 (Ubuntu 24.04) 20251101"
    ec2 = prime_dlami(stubs, [dlami("ami-0arm", arm, "2025-11-01T00:00:00.000Z", arch="arm64")], arch="arm64")
    ec2.add_response("run_instances", {"Instances": [{"InstanceId": "i-0arm"}]}, launch_params("ami-0arm", 75))
    assert prov.create_instance(unnamed(node(offer("g5g.xlarge")))) == "i-0arm"
    stubs.assert_done()


def test_no_dlami_found_is_a_clear_error(prov, stubs):
    from broker.core.provider import ProviderError

    prime_dlami(stubs, [])
    with pytest.raises(ProviderError) as ei:
        prov.create_instance(unnamed(node(offer())))
    e = ei.value
    assert "no available PyTorch Deep Learning AMI for x86_64 in us-east-1" in e.message
    assert "AWS_AMI_ID" in e.hint
    stubs.assert_done()
