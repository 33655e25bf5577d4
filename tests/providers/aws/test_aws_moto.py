"""AWS adapter against moto in server mode (real HTTP, real botocore serialization): EC2 happy paths.

moto 5.2.5 does not implement placement groups (answered as an HTML 500) nor ClientToken idempotency (same token
gives a second instance); the adapter's own token lookup (tag ``broker-client-token``) is what keeps a repeated
create from double-launching, and that is what the idempotency test exercises here.
"""

from __future__ import annotations

import base64
import uuid
from datetime import timedelta
from typing import Any

import pytest

from broker.core.model import Offer, Requirements, utcnow
from broker.core.provider import RUN_TAG
from broker.core.records import NodeRequest

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
       "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def moto_url():
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def env(monkeypatch, tmp_path):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def prov(moto_url, env):
    import boto3

    from broker.providers.aws import AWSProvider

    session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                    region_name="us-east-1")
    return AWSProvider(session=session, endpoint_url=moto_url, region="us-east-1")


@pytest.fixture
def ec2(moto_url, env):
    import boto3

    return boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_url)


class Rec:
    """A Recorder that keeps every call in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.n = 0

    def intent(self, kind: str, name: str, **kw: Any) -> str:
        self.n += 1
        rid = f"r{self.n}"
        self.calls.append(("intent", kind, name, rid))
        return rid

    def created(self, resource_id: str, provider_id: str, **attrs: Any) -> None:
        self.calls.append(("created", resource_id, provider_id))

    def failed(self, resource_id: str, error: str) -> None:
        self.calls.append(("failed", resource_id, error))

    def event(self, message: str) -> None:
        self.calls.append(("event", message))


def offer(it: str = "g5.xlarge", zone: str = "us-east-1a") -> Offer:
    return Offer(provider="aws", offer_id=it, instance_type=it, region="us-east-1", zone=zone, gpu_name="A10G",
                 gpu_count=1, gpu_mem_gib=24, vcpus=4, ram_gib=16, usd_per_hour=1.006, private_network=True,
                 price_source="test", price_time=utcnow())


_IMAGE: list[str] = []


def image_id(ec2) -> str:
    if not _IMAGE:  # moto lists ~1300 AMIs: look one up once
        _IMAGE.append(ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"])
    return _IMAGE[0]


def node_req(ec2, run_id: str, network: dict, token: str | None = None, i: int = 0) -> NodeRequest:
    return NodeRequest(run_id=run_id, node_index=i, name=f"broker-{run_id}-n{i}", offer=offer(),
                       ssh_public_key="ssh-ed25519 AAAATEST broker", client_token=token or uuid.uuid4().hex,
                       image=image_id(ec2), deadline=utcnow() + timedelta(hours=1), network=network)


def test_bootstrap_security_group_self_referencing_and_ledger_order(prov, ec2):
    run = "run-" + uuid.uuid4().hex[:8]
    rec = Rec()
    net = prov.bootstrap(run, [offer()], "simulated", rec)
    sg = net["security_group_id"]
    assert net["placement_group"] is None and net["vpc_id"].startswith("vpc-")
    assert rec.calls[0][:3] == ("intent", "security_group", f"broker-{run}")
    assert rec.calls[1] == ("created", rec.calls[0][3], sg)
    g = ec2.describe_security_groups(GroupIds=[sg])["SecurityGroups"][0]
    assert {t["Key"]: t["Value"] for t in g["Tags"]}[RUN_TAG] == run
    perms = g["IpPermissions"]
    allp = [p for p in perms if p["IpProtocol"] == "-1"]
    assert allp and allp[0]["UserIdGroupPairs"][0]["GroupId"] == sg
    assert not allp[0].get("IpRanges")  # all protocols only between members, never from the world
    ssh = [p for p in perms if p["IpProtocol"] == "tcp"]
    assert ssh[0]["FromPort"] == 22 and ssh[0]["ToPort"] == 22
    assert ssh[0]["IpRanges"][0]["CidrIp"] == "0.0.0.0/0"


def test_bootstrap_multi_node_placement_group_unimplemented_is_recorded(prov):
    run = "run-" + uuid.uuid4().hex[:8]
    rec = Rec()
    net = prov.bootstrap(run, [offer(), offer()], "multi-node", rec)
    assert net["placement_group"] is None and net["nodes"] == 2
    kinds = [(c[0], c[1]) for c in rec.calls if c[0] == "intent"]
    assert kinds == [("intent", "security_group"), ("intent", "placement_group")]
    pg_rid = [c for c in rec.calls if c[0] == "intent" and c[1] == "placement_group"][0][3]
    failed = [c for c in rec.calls if c[0] == "failed"]
    assert failed and failed[0][1] == pg_rid and "create_placement_group" in failed[0][2]


def test_create_describe_terminate_list_tagged(prov, ec2):
    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer()], "simulated", Rec())
    req = node_req(ec2, run, net)
    iid = prov.create_instance(req)
    attr = ec2.describe_instance_attribute(InstanceId=iid, Attribute="instanceInitiatedShutdownBehavior")
    assert attr["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    ud = ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")["UserData"]["Value"]
    script = base64.b64decode(ud).decode()
    assert "shutdown -h" in script and "ssh-ed25519 AAAATEST broker" in script
    inst = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags[RUN_TAG] == run and tags["Name"] == req.name
    assert inst["InstanceType"] == "g5.xlarge" and inst["Placement"]["AvailabilityZone"] == "us-east-1a"
    assert [g["GroupId"] for g in inst["SecurityGroups"]] == [net["security_group_id"]]

    info = prov.describe_instance(iid)
    assert info.state == "running" and info.ssh_user == "ubuntu" and info.private_ip

    tagged = prov.list_tagged(run)
    assert {(t.kind, t.provider_id) for t in tagged} == {("instance", iid),
                                                         ("security_group", net["security_group_id"])}
    assert all(t.run_id == run for t in tagged)
    everything = {(t.kind, t.provider_id) for t in prov.list_tagged(None)}  # tag-key filter: all runs
    assert {("instance", iid), ("security_group", net["security_group_id"])} <= everything

    assert prov.terminate("instance", iid) is True
    assert prov.describe_instance(iid).state == "terminated"
    assert prov.terminate("instance", iid) is True  # idempotent
    assert {t.kind for t in prov.list_tagged(run)} == {"security_group"}  # terminated instances excluded
    assert prov.terminate("security_group", net["security_group_id"]) is True
    assert prov.terminate("security_group", net["security_group_id"]) is True  # already gone
    assert prov.list_tagged(run) == []


def test_client_token_idempotent(prov, ec2):
    run = "run-" + uuid.uuid4().hex[:8]
    net = prov.bootstrap(run, [offer()], "simulated", Rec())
    a = prov.create_instance(node_req(ec2, run, net, token="tok-" + run))
    b = prov.create_instance(node_req(ec2, run, net, token="tok-" + run))
    c = prov.create_instance(node_req(ec2, run, net, token="other-" + run, i=1))
    assert a == b and c != a
    assert len([t for t in prov.list_tagged(run) if t.kind == "instance"]) == 2
    for iid in (a, c):
        prov.terminate("instance", iid)


def test_describe_unknown_instance_is_terminated(prov):
    assert prov.describe_instance("i-0123456789abcdef0").state == "terminated"
    assert prov.terminate("instance", "i-0123456789abcdef0") is True


def test_offers_per_zone_and_capacity(prov):
    offers = prov.offers(Requirements(nodes=2, gpus_per_node=1, gpu_names=["A10G"], min_gpu_mem_gib=16))
    assert offers and {o.instance_type for o in offers} <= {"g5.xlarge", "g5.8xlarge", "g5.12xlarge"}
    zones = {o.zone for o in offers if o.instance_type == "g5.xlarge"}
    assert len(zones) >= 2 and all(z.startswith("us-east-1") for z in zones)
    assert all(o.private_network and o.region == "us-east-1" for o in offers)
    g5 = next(o for o in offers if o.instance_type == "g5.xlarge")
    assert g5.attrs["api_gpu_mem_mib"] == 22888 and g5.attrs["api_vcpus"] == 4  # describe_instance_types
    caps = prov.capacity(offers)
    assert caps and all(c.status == "UNKNOWN" for c in caps if c.zone in zones and c.instance_type == "g5.xlarge")


class LedgerRec:
    """Recorder over the real ledger (what provisioning hands to bootstrap)."""

    def __init__(self, ledger, run_id: str) -> None:
        self.ledger, self.run_id = ledger, run_id

    def intent(self, kind, name, *, region=None, zone=None, usd_per_hour=0.0, attrs=None):
        return self.ledger.record_intent(self.run_id, "aws", kind, name, region=region, zone=zone,
                                         usd_per_hour=usd_per_hour, attrs=attrs).id

    def created(self, resource_id, provider_id, **attrs):
        self.ledger.mark_created(resource_id, provider_id, **attrs)

    def failed(self, resource_id, error):
        self.ledger.update_resource(resource_id, state="failed", error=error)

    def event(self, message):
        self.ledger.event(self.run_id, "test", "event", message)


def test_crash_after_create_is_found_by_tag_and_torn_down(prov, ec2):
    """Ledger-first: a crash between run_instances and mark_created leaves an intent row; teardown finds the
    instance by the run tag and removes it, then the security group."""
    from broker.money.ledger import Ledger
    from broker.money.teardown import teardown_run

    run = "run-" + uuid.uuid4().hex[:8]
    led = Ledger()
    net = prov.bootstrap(run, [offer()], "simulated", LedgerRec(led, run))
    req = node_req(ec2, run, net)
    res = led.record_intent(run, "aws", "instance", req.name, region="us-east-1", zone="us-east-1a",
                            usd_per_hour=1.006)
    iid = prov.create_instance(req.model_copy(update={"client_token": res.id}))
    # ... the CLI dies here: no mark_created
    assert led.resource(res.id).provider_id is None
    left = teardown_run(led, run, "test", providers={"aws": prov}, confirm_timeout_s=30, poll_s=0.2)
    assert left == []
    assert led.resource(res.id).provider_id == iid
    assert prov.describe_instance(iid).state == "terminated"
    assert ec2.describe_security_groups(Filters=[{"Name": f"tag:{RUN_TAG}", "Values": [run]}])["SecurityGroups"] == []


def test_ssh_user_of_another_image_is_the_login_and_the_key_home(prov, ec2, tmp_path):
    """An image whose login is not the Deep Learning AMI's ``ubuntu`` (AWS_AMI_ID: Amazon Linux's ec2-user, a
    root-only image): the user data puts the key into that user's home and the boot-done marker into the workroot,
    and describe says to log in as that user."""
    from broker.providers.aws import AWSProvider

    p = AWSProvider(session=prov.api.session, endpoint_url=prov.endpoint_url, region="us-east-1", ssh_user="root")
    p.node_workroot = str(tmp_path / "work")
    run = "run-" + uuid.uuid4().hex[:8]
    iid = p.create_instance(node_req(ec2, run, {}))
    script = base64.b64decode(ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")[
        "UserData"]["Value"]).decode()
    assert 'BROKER_SSH_HOME="${BROKER_SSH_HOME:-/root}"' in script and "/home/ubuntu" not in script
    assert f"{tmp_path / 'work'}" in script  # boot.done beside the workroot's job.done
    assert p.describe_instance(iid).ssh_user == "root" and prov.describe_instance(iid).ssh_user == "ubuntu"
    p.terminate("instance", iid)
