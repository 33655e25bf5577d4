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


def _adapter(emu, key_pem, subnet_id):
    """A real OCIProvider pointed at ``emu`` (each call: a new adapter object, as another process has)."""
    from broker.providers.oci import OCIProvider

    cfg = {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": TENANCY, "key_content": key_pem,
           "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff", "region": REGION}
    return OCIProvider(config=cfg, service_endpoint=emu.url, compartment_id=COMP, availability_domains=[AD],
                       subnet_id=subnet_id, retry_strategy=oci.retry.NoneRetryStrategy(),
                       circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy(), conflict_wait_s=2.0)


@pytest.fixture
def oci_env(key_pem, tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    with OCIEmulator(compartment=COMP, ads=(AD,), region=REGION, boot_s=0.0, terminate_s=0.2) as emu:
        sid = emu.new_id("subnet")
        emu.objs["subnets"][sid] = {"id": sid, "compartmentId": COMP, "lifecycleState": "AVAILABLE",
                                    "freeformTags": {}, "timeCreated": "2026-12-01T00:00:00.000Z"}
        yield emu, _adapter(emu, key_pem, sid)


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


def test_a_terminate_by_another_process_is_told_from_a_reclaim_by_the_ledger(oci_env, key_pem):
    """The watchdog's own adapter object (as in its own process) terminates one preemptible instance, OCI
    reclaims the other: both read TERMINATED at OCI with no reason, and the run's adapter alone calls both
    preemptions.  The ledger (the watchdog's claim is written before its terminate call) tells them apart."""
    from broker.money.ledger import Ledger
    from broker.money.teardown import terminate_resource
    from broker.core.records import Run
    from broker.run.attempts import broker_ended, provider_preemption
    from broker.run.runrecord import Context, Hooks

    emu, prov = oci_env
    theirs = _adapter(emu, key_pem, None)  # the watchdog's
    ledger = Ledger()
    run = ledger.create_run(Run(id="20261201-000000-ocisp1", name="t", provider="oci", topology="simulated",
                                status="running", created_at=utcnow()))
    c = plan(_req("true"), prov.offers(_req())).chosen
    rows = []
    for token in ("res-1", "res-2"):
        res = ledger.record_intent(run.id, "oci", "instance", f"n-{token}", resource_id=token)
        node = _node(c.offers[0], token).model_copy(update={"installation_id": ledger.installation_id})
        ledger.mark_created(res.id, prov.create_instance(node), state="running")
        rows.append(ledger.resource(res.id))
    ctx = Context(ledger=ledger, hooks=Hooks(), actor="cli")
    start = ledger.start_attempt(run.id)

    assert terminate_resource(ledger, rows[0], "watchdog", provider=theirs, confirm_timeout_s=5, poll_s=0.1)
    assert prov.preemption(rows[0].provider_id).startswith("preempted")  # the adapter's blind spot
    assert broker_ended(ctx, run) == f"oci instance {rows[0].provider_id} was terminated by broker's watchdog"
    assert provider_preemption(ctx, run, {"oci": prov}) is None  # nothing OCI reclaimed yet

    ledger.end_attempt(run.id, start, cause="deadline")  # rows[0..1] belong to attempt 1 now
    ledger.start_attempt(run.id)
    emu.preempt(rows[1].provider_id)
    assert broker_ended(ctx, run) is None  # the watchdog's terminate belongs to the earlier attempt
    assert "OCI reclaimed" in provider_preemption(ctx, run, {"oci": prov})
    ledger.claim_termination(rows[1].id, "down")  # `broker down` elsewhere: in flight, so not asked
    assert provider_preemption(ctx, run, {"oci": prov}) is None
