"""Money safety, AWS side, at the real boundary: moto in server mode (real HTTP, botocore
serialization), botocore's Stubber for answers moto cannot give, and a local HTTP server for a launch that times out.

Items: 1 installation tags, 2 fail closed / ambiguous creates, 3 readiness defaults and the boot-done marker, 4 quota
scope (region + family bucket), 6 teardown that finishes (transient mapping, dependency order).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import replace
from typing import Any

import pytest
from werkzeug import Request, Response

from broker.core.provider import (INSTALL_TAG, RUN_TAG, AmbiguousCreate, ProviderError, QuotaError,
                             TransientError)
from tests.providers.aws.test_aws_moto import ENV, Rec, ec2, env, image_id, moto_url, node_req, offer, prov  # noqa: F401
from tests.providers.aws.test_aws_stub import Stubs, node, prime_launch  # noqa: F401
from tests.providers.aws.test_aws_stub import offer as stub_offer

INST = "inst-A"


class InstallRec(Rec):
    installation_id = INST


@pytest.fixture
def stubs():
    return Stubs()


@pytest.fixture
def sprov(stubs, env):
    from broker.providers.aws import AWSProvider

    return AWSProvider(client_factory=stubs, region="us-east-1")


# ------------------------------------------------------------------------------------------------ item 1
def test_instances_and_groups_carry_the_installation_tag(prov, ec2):
    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer()], "simulated", InstallRec())
    iid = prov.create_instance(node_req(ec2, run, net).model_copy(update={"installation_id": INST}))
    inst = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]
    assert {t["Key"]: t["Value"] for t in inst["Tags"]}[INSTALL_TAG] == INST
    g = ec2.describe_security_groups(GroupIds=[net["security_group_id"]])["SecurityGroups"][0]
    assert {t["Key"]: t["Value"] for t in g["Tags"]}[INSTALL_TAG] == INST
    got = {(t.kind, t.provider_id): t.installation_id for t in prov.list_tagged(run)}
    assert got == {("instance", iid): INST, ("security_group", net["security_group_id"]): INST}
    prov.terminate("instance", iid)
    prov.terminate("security_group", net["security_group_id"])


def test_placement_group_carries_the_installation_tag(sprov, stubs):
    from broker.providers.aws import network

    stubs.stub("ec2").add_response("create_placement_group", {}, {
        "GroupName": "broker-run1", "Strategy": "cluster", "TagSpecifications": [
            {"ResourceType": "placement-group", "Tags": [{"Key": RUN_TAG, "Value": "run1"},
                                                         {"Key": INSTALL_TAG, "Value": INST},
                                                         {"Key": "Name", "Value": "broker-run1"}]}]})
    assert network.placement_group(sprov.api, stubs.clients[("ec2", "us-east-1")], "run1", "us-east-1",
                                   InstallRec()) == "broker-run1"
    stubs.assert_done()


# ------------------------------------------------------------------------------------------------ item 2
@pytest.mark.parametrize("answer,what", [
    ({}, "'Reservations'"),                                             # the list is missing altogether
    ({"Reservations": [{"Instances": [{"ImageId": "ami-1"}]}]}, "'InstanceId'"),  # an instance without its id
    ({"Reservations": [{"ReservationId": "r-1"}]}, "'Instances'"),     # a reservation without instances
])
def test_unreadable_describe_instances_is_an_error_never_empty(sprov, stubs, answer, what):
    stubs.stub("ec2").add_response("describe_instances", answer)
    with pytest.raises(ProviderError) as ei:
        sprov.list_tagged("run1")
    assert ei.value.call == "describe_instances" and "unreadable answer" in ei.value.message
    assert what in ei.value.message and not isinstance(ei.value, TransientError)


def test_unreadable_group_listing_is_an_error(sprov, stubs):
    ec2 = stubs.stub("ec2")
    ec2.add_response("describe_instances", {"Reservations": []})
    ec2.add_response("describe_security_groups", {})
    with pytest.raises(ProviderError) as ei:
        sprov.list_tagged("run1")
    assert ei.value.call == "describe_security_groups"


def test_unreadable_describe_is_not_terminated(sprov, stubs):
    stubs.stub("ec2").add_response("describe_instances", {})
    with pytest.raises(ProviderError) as ei:
        sprov.describe_instance("i-1")
    assert ei.value.call == "describe_instances"


def test_unreadable_offerings_is_an_error(sprov, stubs):
    from broker.core.model import Requirements

    stubs.stub("ec2").add_response("describe_instance_type_offerings", {})
    with pytest.raises(ProviderError) as ei:
        sprov.offers(Requirements(gpu_names=["A10G"]))
    assert ei.value.call == "describe_instance_type_offerings"


@pytest.mark.parametrize("code,status", [("InternalError", 500), ("ServiceUnavailable", 503),
                                         ("Unavailable", 503)])
def test_run_instances_5xx_is_ambiguous(sprov, stubs, code, status):
    ec2 = prime_launch(stubs)
    ec2.add_client_error("run_instances", service_error_code=code, http_status_code=status)
    with pytest.raises(AmbiguousCreate) as ei:
        sprov.create_instance(node(stub_offer()))
    assert ei.value.call == "run_instances"


def test_ambiguous_launch_found_by_token_then_not_relaunched(prov, ec2):
    """What the core does after an AmbiguousCreate: find_by_token; a second create with the token returns it."""
    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer()], "simulated", Rec())
    req = node_req(ec2, run, net, token="tok-" + run)
    iid = prov.create_instance(req)
    assert prov.find_by_token(req.client_token) == iid
    assert prov.create_instance(req) == iid
    assert [t.provider_id for t in prov.list_tagged(run) if t.kind == "instance"] == [iid]
    prov.terminate("instance", iid)
    prov.terminate("security_group", net["security_group_id"])


EC2_NS = 'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"'


def test_run_instances_read_timeout_is_ambiguous(own_httpserver, env):
    """A launch whose answer never comes (read timeout) may have happened: AmbiguousCreate, sent once."""
    import boto3
    from botocore.config import Config

    from broker.providers.aws import AWSProvider

    sent: list[str] = []

    def handler(request: Request) -> Response:
        action = request.form.get("Action")
        sent.append(action)
        if action == "RunInstances":
            time.sleep(1.5)
            return Response(status=500)
        if action == "DescribeInstances":
            body = f"<DescribeInstancesResponse {EC2_NS}><requestId>1</requestId><reservationSet/>" \
                   "</DescribeInstancesResponse>"
        else:  # DescribeImages
            body = f"<DescribeImagesResponse {EC2_NS}><requestId>1</requestId><imagesSet><item><imageId>" \
                   "ami-12345678</imageId><rootDeviceName>/dev/sda1</rootDeviceName></item></imagesSet>" \
                   "</DescribeImagesResponse>"
        return Response(body, status=200, content_type="text/xml")

    own_httpserver.expect_request("/").respond_with_handler(handler)

    def factory(service: str, region: str, cfg: Any):
        fast = Config(read_timeout=0.5, connect_timeout=2)
        return boto3.client(service, region_name=region, endpoint_url=own_httpserver.url_for("/"),
                            aws_access_key_id="testing", aws_secret_access_key="testing",
                            config=cfg.merge(fast) if cfg is not None else fast)

    p = AWSProvider(client_factory=factory, region="us-east-1")
    with pytest.raises(AmbiguousCreate) as ei:
        p.create_instance(node(stub_offer()))
    assert ei.value.call == "run_instances" and "may have happened" in ei.value.message
    assert sent.count("RunInstances") == 1


def test_security_group_5xx_keeps_the_intent_row(sprov, stubs):
    ec2 = stubs.stub("ec2")
    ec2.add_response("describe_vpcs", {"Vpcs": [{"VpcId": "vpc-1", "IsDefault": True}]})
    ec2.add_client_error("create_security_group", service_error_code="InternalError", http_status_code=500)
    rec = InstallRec()
    with pytest.raises(AmbiguousCreate):
        sprov.bootstrap("run1", [stub_offer()], "simulated", rec)
    assert [c[0] for c in rec.calls if c[0] in ("intent", "failed", "created")] == ["intent"]


# ------------------------------------------------------------------------------------------------ item 3
def test_ready_timeout_default_and_boot_marker_last(tmp_path):
    from broker.providers.aws import AWSProvider, user_data_script

    from broker.providers.aws import BOOT_DONE

    assert AWSProvider.ssh_ready_timeout_s >= 120 and BOOT_DONE == "boot.done"
    script = user_data_script(None, 300, "ssh-ed25519 AAAA k", onstart=f"echo x > {tmp_path}/onstart.txt")
    path = tmp_path / "ud.sh"
    path.write_text(script)
    work = tmp_path / "work"
    r = subprocess.run(["bash", str(path)], env={"PATH": os.environ["PATH"], "BROKER_WORKROOT": str(work),
                                                 "BROKER_SSH_HOME": str(tmp_path / "home")},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (work / "boot.done").exists()
    assert script.index("onstart.txt") < script.index("boot.done")
    assert "/home/ubuntu/broker" in script  # the default workroot of the DLAMI's user


# ------------------------------------------------------------------------------------------------ item 4
@pytest.mark.parametrize("it,vcpus,scope", [("g5.xlarge", 4, "us-east-1:G/VT"), ("p4d.24xlarge", 96, "us-east-1:P")])
def test_vcpu_limit_scope_is_region_and_family_bucket(sprov, stubs, it, vcpus, scope):
    ec2 = prime_launch(stubs)
    ec2.add_client_error("run_instances", service_error_code="VcpuLimitExceeded", http_status_code=400,
                         service_message="You have requested more vCPU capacity than your current vCPU limit")
    with pytest.raises(QuotaError) as ei:
        sprov.create_instance(node(stub_offer(it, vcpus)))
    assert ei.value.scope == scope and ei.value.region == "us-east-1"
    assert ei.value.quota_code == ("L-DB2E81BA" if it.startswith("g") else "L-417A185B")
    # the scope names one family bucket in one region: the same bucket's types share it, the other family's not
    from broker.providers.aws.api import quota_scope

    def scope_of(o):
        return quota_scope(o.region or sprov.region, o.instance_type)

    same = {o: scope_of(stub_offer(o)) == ei.value.scope for o in ("g5.xlarge", "g6.xlarge",
                                                                   "p4d.24xlarge", "p5.48xlarge")}
    assert same == ({"g5.xlarge": True, "g6.xlarge": True, "p4d.24xlarge": False, "p5.48xlarge": False}
                    if it.startswith("g") else
                    {"g5.xlarge": False, "g6.xlarge": False, "p4d.24xlarge": True, "p5.48xlarge": True})
    other_region = replace(stub_offer(it), region="us-west-2")
    assert scope_of(other_region) != ei.value.scope


# ------------------------------------------------------------------------------------------------ item 6
@pytest.mark.parametrize("code,status", [("InternalError", 500), ("RequestLimitExceeded", 503),
                                         ("Throttling", 429)])
def test_terminate_5xx_429_is_transient(sprov, stubs, code, status):
    ec2 = stubs.stub("ec2")
    ec2.add_client_error("terminate_instances", service_error_code=code, http_status_code=status)
    ec2.add_client_error("delete_security_group", service_error_code=code, http_status_code=status)
    ec2.add_client_error("delete_placement_group", service_error_code=code, http_status_code=status)
    for kind, pid in (("instance", "i-1"), ("security_group", "sg-1"), ("placement_group", "broker-run1")):
        with pytest.raises(TransientError):
            sprov.terminate(kind, pid)


def test_terminate_gone_is_true(sprov, stubs):
    ec2 = stubs.stub("ec2")
    ec2.add_client_error("terminate_instances", service_error_code="InvalidInstanceID.NotFound",
                         http_status_code=400)
    ec2.add_client_error("delete_security_group", service_error_code="InvalidGroup.NotFound", http_status_code=400)
    ec2.add_client_error("delete_placement_group", service_error_code="InvalidPlacementGroup.Unknown",
                         http_status_code=400)
    assert sprov.terminate("instance", "i-1") and sprov.terminate("security_group", "sg-1")
    assert sprov.terminate("placement_group", "broker-run1")


def test_run_cleanup_in_dependency_order(prov, ec2):
    """instances -> security groups: the group is deleted only once the instance is gone."""
    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer()], "simulated", InstallRec())
    iid = prov.create_instance(node_req(ec2, run, net))
    assert prov.delete_run_network(run) == []  # moto terminates at once
    assert prov.describe_instance(iid).state == "terminated"
    assert prov.list_tagged(run) == []
    from broker.providers.aws import DELETE_ORDER

    assert DELETE_ORDER == ("instance", "security_group", "placement_group")


def test_boot_wait_command_matches_the_user_data_marker(tmp_path):
    from broker.providers.aws import AWSProvider, boot_wait_command, user_data_script

    work = tmp_path / "work"
    cmd = boot_wait_command(str(work))
    env = {"PATH": os.environ["PATH"], "BROKER_SSH_HOME": str(tmp_path / "home")}
    assert subprocess.run(["bash", "-c", cmd], env=env, timeout=60).returncode != 0
    script = user_data_script(None, 300, "", done_file=f"{work}/job.done")
    assert subprocess.run(["bash", "-c", script], env=env, capture_output=True, timeout=30).returncode == 0
    assert subprocess.run(["bash", "-c", cmd], env=env, timeout=60).returncode == 0
    assert AWSProvider().boot_wait_command("ubuntu").endswith("test -e /home/ubuntu/broker/boot.done")
