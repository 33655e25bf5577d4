"""broker.plan.quota: which limit covers each type, unit conversions for every type in the snapshot, verdict sentences."""

from __future__ import annotations

import pytest
from dataclasses import replace

from broker.core.model import Quota
from broker.plan.quota import (default_reason, desired_value, explain_usage, gpus_to_instances,
                          instance_specs, instances_allowed, instances_to_gpus, instances_to_vcpus, limit_for, needs_for,
                          units_needed, vcpus_to_instances, verdict)
from broker.providers.aws.limits import AWS_QUOTA_CODES, aws_family, aws_quota_code
from broker.providers.oci.limits import oci_limit_name

AWS_TYPES = sorted(instance_specs("aws"))
OCI_TYPES = sorted(instance_specs("oci"))

#: Independent expectations (docs/reference/cloud-apis.md C1/C4 and B2/B7): type -> (limit, GPUs, vCPUs).
EXPECTED = {
    "g4dn.xlarge": ("L-DB2E81BA", 1, 4), "g4dn.12xlarge": ("L-DB2E81BA", 4, 48), "g5.xlarge": ("L-DB2E81BA", 1, 4),
    "g5.8xlarge": ("L-DB2E81BA", 1, 32), "g5.12xlarge": ("L-DB2E81BA", 4, 48), "g6.xlarge": ("L-DB2E81BA", 1, 4),
    "p4d.24xlarge": ("L-417A185B", 8, 96), "p5.4xlarge": ("L-417A185B", 1, 16), "p5.48xlarge": ("L-417A185B", 8, 192),
    "VM.GPU.A10.1": ("gpu-a10-count", 1, 30), "VM.GPU.A10.2": ("gpu-a10-count", 2, 60),
    "BM.GPU.A10.4": ("gpu-a10-count", 4, 128), "VM.GPU2.1": ("gpu2-count", 1, 24), "VM.GPU3.1": ("gpu3-count", 1, 12),
    "BM.GPU4.8": ("gpu4-count", 8, 128), "BM.GPU.A100-v2.8": ("gpu-a100-v2-count", 8, 256),
    "BM.GPU.H100.8": ("gpu-h100-count", 8, 224),
}


def test_snapshot_types_all_have_expectations():
    assert set(EXPECTED) >= set(instance_specs("aws")) | set(instance_specs("oci"))
    assert AWS_TYPES and OCI_TYPES


@pytest.mark.parametrize("provider", ["oci", "aws"])
def test_every_snapshot_offer_has_a_covering_limit(provider):
    from broker.plan.catalog import snapshot_offers

    offers = snapshot_offers(provider)
    assert offers
    for o in offers:
        assert limit_for(provider, o.instance_type) is not None, o.instance_type
        if provider == "aws":
            assert limit_for(provider, o.instance_type, spot=True) is not None, o.instance_type


@pytest.mark.parametrize("it", AWS_TYPES)
def test_aws_conversions_every_type(it):
    s = instance_specs("aws")[it]
    limit, gpus, vcpus = EXPECTED.get(it, (aws_quota_code(it).code, s.gpus, s.vcpus))
    assert (s.gpus, s.vcpus) == (gpus, vcpus)
    ref = limit_for("aws", it)
    assert ref.name == limit and ref.unit == "vcpus" and ref.scope_kind == "region"
    assert AWS_QUOTA_CODES[limit].market == "on-demand"
    spot_p = "L-C4BD4855" if it.startswith("p5") else "L-7212CCBC"  # P spot is split by generation
    assert limit_for("aws", it, spot=True).name == ("L-3819A6DF" if limit == "L-DB2E81BA" else spot_p)
    for k in (1, 2, 3):
        assert instances_to_vcpus(s, k) == k * vcpus == units_needed("aws", s, k)
        assert instances_to_gpus(s, k) == k * gpus
        assert vcpus_to_instances(s, k * vcpus) == k
        assert vcpus_to_instances(s, k * vcpus - 1) == k - 1  # one vCPU short = one instance fewer
        assert gpus_to_instances(s, k * gpus) == k
        assert instances_allowed("aws", s, k * vcpus) == k


@pytest.mark.parametrize("it", OCI_TYPES)
def test_oci_conversions_every_shape(it):
    s = instance_specs("oci")[it]
    limit, gpus, vcpus = EXPECTED[it]
    assert (s.gpus, s.vcpus) == (gpus, vcpus)
    ref = limit_for("oci", it)
    assert (ref.name, ref.unit, ref.scope_kind, ref.service) == (limit, "gpus", "AD", "compute")
    for k in (1, 2, 3):
        assert units_needed("oci", s, k) == k * gpus
        assert instances_allowed("oci", s, k * gpus) == k
        assert instances_allowed("oci", s, k * gpus - 1) == k - 1


def test_family_prefixes():
    for it in ("g4dn.xlarge", "g5.xlarge", "g6.xlarge", "g6e.2xlarge", "g5g.xlarge", "vt1.3xlarge"):
        assert aws_family(it) == "G", it
    for it in ("p3.2xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge"):
        assert aws_family(it) == "P", it
    for it in ("m5.large", "c7i.xlarge", "t3.micro"):
        assert aws_family(it) is None and limit_for("aws", it) is None
    assert oci_limit_name("VM.Standard.E4.Flex") is None


def test_two_g5_xlarge_need_8_vcpus_of_on_demand_g():
    needs = needs_for("aws", 2, 1, instance_type="g5.xlarge")
    mn = [n for n in needs if n.topology == "multi-node"][0]
    assert (mn.instances, mn.limit.name, mn.units) == (2, "L-DB2E81BA", 8)
    assert not [n for n in needs if n.topology == "simulated"]  # a 1-GPU type cannot hold 2 simulated nodes


def test_needs_default_picks_cheapest_per_limit_and_topology():
    needs = needs_for("oci", 2, 1)
    mn = {n.limit.name: n for n in needs if n.topology == "multi-node"}
    sim = {n.limit.name: n for n in needs if n.topology == "simulated"}
    assert mn["gpu-a10-count"].spec.instance_type == "VM.GPU.A10.1" and mn["gpu-a10-count"].units == 2
    assert mn["gpu2-count"].spec.instance_type == "VM.GPU2.1"
    assert sim["gpu-a10-count"].spec.instance_type == "VM.GPU.A10.2" and sim["gpu-a10-count"].units == 2
    with pytest.raises(KeyError, match="known"):
        needs_for("aws", 2, 1, instance_type="g9.nothing")


def q_oci(ad: str, limit: float, used: float) -> Quota:
    return Quota(provider="oci", name="gpu-a10-count", region="us-ashburn-1", scope=ad, limit=limit, used=used,
                 unit="gpus")


def test_oci_verdict_one_ad_short():
    need = [n for n in needs_for("oci", 2, 1, instance_type="VM.GPU.A10.1") if n.topology == "multi-node"][0]
    v = verdict(need, [q_oci("AD-1", 1, 0), q_oci("AD-2", 0, 0)])
    assert not v.ok
    assert v.sentence.startswith("2× VM.GPU.A10.1 needs gpu-a10-count ≥ 2 in one AD; you have 1 available in AD-1")
    assert v.scope == "AD-1" and v.request_value == 2


def test_oci_verdict_split_across_ads_is_not_enough_but_one_ad_is():
    need = [n for n in needs_for("oci", 2, 1, instance_type="VM.GPU.A10.1") if n.topology == "multi-node"][0]
    assert not verdict(need, [q_oci("AD-1", 1, 0), q_oci("AD-2", 1, 0)]).ok  # 1 + 1 in two ADs does not count
    v = verdict(need, [q_oci("AD-1", 1, 0), q_oci("AD-3", 4, 1)])
    assert v.ok and v.scope == "AD-3" and "3 available in AD-3" in v.sentence and "OK" in v.sentence


def test_aws_verdict_vcpus_to_instances():
    need = needs_for("aws", 2, 1, instance_type="g5.xlarge")[0]
    q = Quota(provider="aws", name="L-DB2E81BA", region="us-east-1", scope="us-east-1", limit=4, used=0, unit="vcpus")
    v = verdict(need, [q])
    assert not v.ok and v.request_value == 8
    assert v.sentence.startswith("2× g5.xlarge needs 8 vCPUs of L-DB2E81BA (Running On-Demand G and VT instances) in "
                                 "us-east-1; you have 4 available in us-east-1 (= 1× g5.xlarge)")
    q2 = replace(q, limit=16, used=8)
    assert verdict(need, [q2]).ok
    v3 = verdict(need, [replace(q, limit=8, used=4)])
    assert not v3.ok and v3.request_value == 12  # used 4 + needed 8


def test_unknown_limit_verdict():
    need = needs_for("aws", 2, 1, instance_type="g5.xlarge")[0]
    v = verdict(need, [])
    assert not v.ok and "could not be read" in v.sentence and v.request_value == 8


def test_explain_critical_misreading():
    s = explain_usage(q_oci("AD-1", 1, 0), instance_specs("oci")["VM.GPU.A10.1"])
    assert s.startswith("0 of 1 GPU used means 1 GPU may be launched (= 1× VM.GPU.A10.1)")
    assert "critical" in s and "not an error" in s
    z = explain_usage(q_oci("AD-1", 0, 0))
    assert "blocks every launch" in z
    a = explain_usage(Quota(provider="aws", name="L-DB2E81BA", limit=8, used=4, unit="vcpus"),
                      instance_specs("aws")["g5.xlarge"])
    assert a.startswith("4 of 8 vCPUs used means 4 vCPUs may be launched (= 1× g5.xlarge)")


def test_request_command():
    from broker.plan.quota import request_command

    assert request_command("oci", "gpu-a10-count", 2.0, scope="AD-1", region="us-ashburn-1") == \
        "broker quota request --provider oci --limit gpu-a10-count --value 2 --scope AD-1 --region us-ashburn-1"
    assert request_command("aws", "L-DB2E81BA", 8, scope="us-east-1") == \
        "broker quota request --provider aws --limit L-DB2E81BA --value 8"


def test_desired_value_and_reason():
    assert desired_value(None, 8) == 8
    q = Quota(provider="aws", name="L-DB2E81BA", limit=4, used=4, unit="vcpus")
    assert desired_value(q, 8) == 12
    assert desired_value(replace(q, limit=32), 8) == 32
    assert default_reason(2, 1, "g5.xlarge").startswith("PyTorch distributed training validation: 2 nodes x 1 GPU on "
                                                        "2 x g5.xlarge;")


def _offer(provider, it, zone, region, gpus=1, vcpus=4):
    from broker.core.model import Offer, utcnow

    return Offer(provider=provider, offer_id=it, instance_type=it, region=region, zone=zone, gpu_name="A10",
                 gpu_count=gpus, gpu_mem_gib=24, vcpus=vcpus, usd_per_hour=1.0, price_source="t", price_time=utcnow())


def test_option_quota_block_oci_per_ad():
    from broker.plan.quota import option_quota_block

    offers = [_offer("oci", "VM.GPU.A10.1", "AD-1", "us-ashburn-1", vcpus=30)] * 2
    block = option_quota_block(offers, [q_oci("AD-1", 1, 0), q_oci("AD-2", 8, 0)])
    assert block is not None
    reason, cmd = block
    assert reason == ("quota: 2× VM.GPU.A10.1 needs 2 GPUs of gpu-a10-count in AD-1; 1 available (limit 1, used 0)")
    assert cmd == "broker quota request --provider oci --limit gpu-a10-count --value 2 --scope AD-1 --region us-ashburn-1"
    ok = [_offer("oci", "VM.GPU.A10.1", "AD-2", "us-ashburn-1", vcpus=30)] * 2
    assert option_quota_block(ok, [q_oci("AD-1", 1, 0), q_oci("AD-2", 8, 0)]) is None
    assert option_quota_block(offers, []) is None  # unknown is not a rejection


def test_option_quota_block_aws_vcpus():
    from broker.plan.quota import option_quota_block

    offers = [_offer("aws", "g5.xlarge", "us-east-1a", "us-east-1")] * 2
    q = Quota(provider="aws", name="L-DB2E81BA", region="us-east-1", scope="us-east-1", limit=4, used=0, unit="vcpus")
    reason, cmd = option_quota_block(offers, [q])
    assert "needs 8 vCPUs of L-DB2E81BA in us-east-1; 4 available" in reason
    assert cmd == "broker quota request --provider aws --limit L-DB2E81BA --value 8 --region us-east-1"
    assert option_quota_block(offers, [replace(q, limit=8)]) is None
    spot_q = replace(q, name="L-3819A6DF")
    assert option_quota_block(offers, [spot_q]) is None  # a spot limit does not block on-demand
