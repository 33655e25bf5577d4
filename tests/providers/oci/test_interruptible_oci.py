"""OCI preemptible instances with the real oci SDK against tests/support/oci_emulator.py: the 50 % price on the shapes
that have preemptible capacity, preemptibleInstanceConfig in LaunchInstance, and a reclaim by OCI told apart from
broker's own terminate."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

oci = pytest.importorskip("oci")

from broker.core.errors import ProviderError  # noqa: E402
from broker.core.model import Requirements, utcnow  # noqa: E402
from broker.plan import interruptible as spot  # noqa: E402
from broker.plan.planner import plan  # noqa: E402
from tests.support.oci_emulator import OCIEmulator  # noqa: E402

TENANCY = "ocid1.tenancy.oc1..aaaaaaaatenancy"
COMP = "ocid1.compartment.oc1..aaaaaaaaspot"
AD = "Uocm:US-ASHBURN-AD-1"
REGION = "us-ashburn-1"


@pytest.fixture
def oci_env(key_pem, tmp_path, monkeypatch):
    from broker.providers.oci import OCIProvider

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    with OCIEmulator(compartment=COMP, ads=(AD,), region=REGION, boot_s=0.0, terminate_s=0.2) as emu:
        sid = emu.new_id("subnet")
        emu.objs["subnets"][sid] = {"id": sid, "compartmentId": COMP, "lifecycleState": "AVAILABLE",
                                    "freeformTags": {}, "timeCreated": "2026-12-01T00:00:00.000Z"}
        cfg = {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": TENANCY, "key_content": key_pem,
               "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff", "region": REGION}
        prov = OCIProvider(config=cfg, service_endpoint=emu.url, compartment_id=COMP, availability_domains=[AD],
                           subnet_id=sid, retry_strategy=oci.retry.NoneRetryStrategy(),
                           circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy(),
                           conflict_wait_s=2.0)
        yield emu, prov


def _req(mode="true", gpu="V100"):
    return Requirements(nodes=1, gpus_per_node=1, gpu_names=[gpu], min_gpu_mem_gib=16, hours=1.0,
                        budget_usd=20.0, topology="simulated", interruptible=mode, disk_gib=50)


def _node(offer, token="res-1"):
    from broker.core.records import NodeRequest

    return NodeRequest(run_id="20261201-000000-ocisp1", node_index=0, name="broker-20261201-000000-ocisp1-n0",
                       offer=offer, ssh_public_key="ssh-ed25519 AAAATEST broker", client_token=token,
                       installation_id="bi0123456789", image="ocid1.image.oc1..aaaaaaaaimage",
                       deadline=utcnow() + timedelta(hours=1), disk_gib=50)


def _launches(emu):
    return [inst for inst in emu.objs["instances"].values()]


def test_preemptible_price_is_half_on_demand_on_gpu3_and_none_on_a10(oci_env):
    _, prov = oci_env
    v100 = [o for o in prov.offers(_req()) if o.instance_type == "VM.GPU3.1"]
    assert v100 and all(o.attrs[spot.PRICE_ATTR] == pytest.approx(o.usd_per_hour / 2) for o in v100)
    a10 = [o for o in prov.offers(_req(gpu="A10")) if o.instance_type.startswith("VM.GPU.A10")]
    assert a10 and not any(spot.PRICE_ATTR in o.attrs for o in a10)  # OCI refuses A10 preemptible
    c = plan(_req("true"), v100).chosen
    assert c.interruptible and c.usd_per_hour == pytest.approx(v100[0].usd_per_hour / 2 +
                                                                50 * v100[0].storage_usd_per_gib_month / 730)
    assert c.offers[0].attrs[spot.BID_ATTR] is None  # a fixed price: nothing to bid
    assert plan(_req("true", gpu="A10"), a10).chosen is None


def test_launch_carries_preemptible_config_and_tags(oci_env):
    emu, prov = oci_env
    c = plan(_req("true"), prov.offers(_req())).chosen
    iid = prov.create_instance(_node(c.offers[0]))
    inst = emu.objs["instances"][iid]
    assert inst["preemptibleInstanceConfig"] == {"preemptionAction": {"type": "TERMINATE",
                                                                      "preserveBootVolume": False}}
    assert inst["freeformTags"]["broker-run"] == "20261201-000000-ocisp1"
    assert inst["freeformTags"]["broker-install"] == "bi0123456789"
    assert prov.preemption(iid) is None  # running
    # the rate OCI bills it is the preemptible one (half the list price), not on-demand
    assert prov.describe_instance(iid).usd_per_hour == pytest.approx(c.offers[0].attrs[spot.ON_DEMAND_ATTR] / 2)


def test_on_demand_launch_has_no_preemptible_config(oci_env):
    emu, prov = oci_env
    od = next(o for o in plan(_req("auto"), prov.offers(_req())).options if not o.interruptible)
    iid = prov.create_instance(_node(od.offers[0]))
    assert "preemptibleInstanceConfig" not in emu.objs["instances"][iid]
    assert prov.describe_instance(iid).usd_per_hour == pytest.approx(od.offers[0].usd_per_hour)
    emu.objs["instances"][iid]["lifecycleState"] = "TERMINATED"  # ended without broker: still no preemption
    assert prov.preemption(iid) is None


def test_reclaimed_by_oci_is_a_preemption_broker_terminate_is_not(oci_env):
    emu, prov = oci_env
    c = plan(_req("true"), prov.offers(_req())).chosen
    a = prov.create_instance(_node(c.offers[0], "res-1"))
    b = prov.create_instance(_node(c.offers[0], "res-2"))
    emu.preempt(a)
    assert emu.events[-1]["eventType"] == "com.oraclecloud.computeapi.instancepreemptionaction"
    why = prov.preemption(a)  # TERMINATING
    assert why.startswith("preempted") and "TERMINATING" in why and "preemptionAction TERMINATE" in why
    time.sleep(0.3)
    assert "TERMINATED" in prov.preemption(a)
    prov.terminate("instance", b)
    assert prov.preemption(b) is None  # broker's own terminate


def test_unknown_instance_is_none_and_a_failed_call_raises(oci_env):
    emu, prov = oci_env
    assert prov.preemption("ocid1.instance.oc1..e9999") is None
    emu.fail[("GET", "instances")] = [500, 500, 500, 500]
    c = plan(_req("true"), prov.offers(_req())).chosen
    iid = prov.create_instance(_node(c.offers[0]))
    with pytest.raises(ProviderError):
        prov.preemption(iid)
