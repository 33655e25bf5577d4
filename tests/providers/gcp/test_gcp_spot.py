"""GCP Spot VMs at the boundary: the gcp adapter through the REAL google-cloud-compute client against
tests/support/gcp_emulator.py.  The snapshot's Spot price as the planner's interruptible option beside on-demand,
the insert body Compute Engine takes for a Spot VM (checked by the emulator), the Spot rate the adapter reports,
Google's preemption (``compute.instances.preempted``) told apart from a delete broker sent, and the
``PREEMPTIBLE_*`` quota a Spot option is judged by."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("google.cloud.compute_v1")

from broker.core.model import Requirements  # noqa: E402
from broker.core.provider import AuthError, INSTALL_TAG, ProviderError, RUN_TAG  # noqa: E402
from tests.providers.gcp.test_gcp import PROJECT, Rec, make, node_request  # noqa: E402
from tests.support.gcp_emulator import GCPEmulator  # noqa: E402


@pytest.fixture
def emu():
    with GCPEmulator(project=PROJECT) as e:
        yield e


def _req(nodes: int = 1, interruptible: str = "auto", **kw: Any) -> Requirements:
    base = dict(nodes=nodes, gpus_per_node=1, min_gpu_mem_gib=0, hours=2, budget_usd=50, providers=["gcp"],
                gpu_names=["T4"])
    base.update(kw)
    return Requirements(interruptible=interruptible, **base)


def _spot_t4(p, zone: str | None = None):
    from broker.plan.interruptible import variant

    o = next(o for o in p.offers(_req()) if o.instance_type == "n1-standard-4+t4"
             and (zone is None or o.zone == zone))
    v = variant(o)
    assert v is not None
    return v


def _run(p, emu: GCPEmulator, run_id: str = "r-spot01", offer=None, i: int = 0):
    net = p.bootstrap(run_id, [offer], "multi-node", Rec(emu))
    pid = p.create_instance(node_request(offer, net, i=i, run_id=run_id))
    for _ in range(3):
        p.describe_instance(pid)
    return pid, net


# ------------------------------------------------------------------------------------------------ pricing
def test_the_snapshot_spot_price_is_the_interruptible_price_with_its_source_and_date():
    from broker.providers.gcp import snapshot_offers

    t4 = next(o for o in snapshot_offers(None) if o.instance_type == "n1-standard-4+t4")
    # T4 Spot 0.14 + n1-standard-4 Spot host 4 x 0.0105 (the snapshot's sources)
    assert t4.attrs["interruptible_usd_per_hour"] == pytest.approx(0.18199)
    assert t4.attrs["spot_usd_per_hour"] == pytest.approx(0.18199)
    src = t4.attrs["interruptible_price_source"]
    assert "snapshot 2026-12-01" in src and "Spot" in src and "us-central1" in src


def test_a_snapshot_without_the_column_still_reads_spot_from_its_notes():
    from broker.providers.gcp import snapshot_offers
    from broker.providers.gcp.offers import spot_price

    o = next(o for o in snapshot_offers(None) if o.instance_type == "n1-standard-4+t4")
    o = replace(o, attrs={"notes": "spot 0.182; zones us-central1-a"})
    assert spot_price(o) == pytest.approx(0.182)
    assert spot_price(replace(o, attrs={"notes": "zones us-central1-a"})) is None


def test_plan_prices_a_gcp_spot_option_beside_on_demand_and_names_the_saving():
    from broker.plan.planner import plan
    from broker.providers.gcp import GCPProvider

    offers = GCPProvider(project=None).offers(_req())
    p = plan(_req(), offers)
    spot = [o for o in p.options if o.interruptible and o.provider == "gcp"]
    od = [o for o in p.options if not o.interruptible and o.provider == "gcp"]
    assert spot and od
    best = spot[0]
    assert best.offers[0].instance_type == "n1-standard-4+t4"
    assert best.usd_per_hour == pytest.approx(0.18199 + best.offers[0].storage_usd_per_gib_month * 0, abs=0.01)
    # no bid on GCP: the Spot price is what is paid (no margin)
    assert best.offers[0].attrs["bid_usd_per_hour"] is None
    assert best.offers[0].attrs["on_demand_usd_per_hour"] == pytest.approx(0.539999)
    assert best.expected_usd < od[0].worst_case_usd
    line = next(n for n in p.notes if n.startswith("interruptible gcp"))
    assert "on-demand gcp" in line and "interruptible saves" in line
    assert p.options[0].interruptible  # auto: the cheaper expected cost wins


def test_interruptible_false_names_what_gcp_spot_would_save():
    from broker.plan.planner import plan
    from broker.providers.gcp import GCPProvider

    p = plan(_req(interruptible="false"), GCPProvider(project=None).offers(_req()))
    assert p.options and not any(o.interruptible for o in p.options)
    assert any(n.startswith("interruptible gcp") and "saves" in n for n in p.notes)


# ------------------------------------------------------------------------------------------------ renting
def test_a_spot_node_is_inserted_with_provisioning_model_spot_and_delete_labelled_like_on_demand(emu):
    p = make(emu)
    o = _spot_t4(p)
    pid, _ = _run(p, emu, offer=o)
    inst = emu.live("instances")[0]
    assert inst["scheduling"] == {"onHostMaintenance": "TERMINATE", "automaticRestart": False,
                                  "provisioningModel": "SPOT", "instanceTerminationAction": "DELETE"}
    assert inst["labels"][RUN_TAG] == "r-spot01" and inst["labels"][INSTALL_TAG] == "bi0123456789"
    assert inst["guestAccelerators"][0]["acceleratorType"].endswith("/nvidia-tesla-t4")
    # the rate the adapter reports is the Spot price, not the on-demand list price
    info = p.describe_instance(pid)
    assert info.state == "running" and info.usd_per_hour == pytest.approx(0.18199)
    tagged = next(t for t in p.list_tagged("r-spot01") if t.kind == "instance")
    assert tagged.usd_per_hour == pytest.approx(0.18199)


def test_an_on_demand_node_stays_standard_without_a_termination_action(emu):
    p = make(emu)
    o = next(o for o in p.offers(_req()) if o.instance_type == "n1-standard-4+t4")
    pid, _ = _run(p, emu, offer=o)
    sched = emu.live("instances")[0]["scheduling"]
    assert sched["provisioningModel"] == "STANDARD" and "instanceTerminationAction" not in sched
    assert p.describe_instance(pid).usd_per_hour == pytest.approx(0.539999)


@pytest.mark.parametrize("change, field", [
    (dict(automatic_restart=True), "automaticRestart"),
    (dict(on_host_maintenance="MIGRATE"), "onHostMaintenance"),
])
def test_the_emulator_refuses_a_spot_body_compute_engine_refuses(emu, change, field):
    from google.api_core import exceptions as gexc
    from google.cloud import compute_v1 as c

    from broker.providers.gcp.lifecycle import instance_body

    p = make(emu)
    o = _spot_t4(p, "us-central1-a")
    net = p.bootstrap("r-spot01", [o], "multi-node", Rec(emu))
    body = instance_body(node_request(o, net, run_id="r-spot01"), project=PROJECT, zone="us-central1-a", net=net,
                         image="projects/x/global/images/family/y", ssh_user="broker", workroot=None)
    for k, v in change.items():
        setattr(body.scheduling, k, v)
    with pytest.raises(gexc.BadRequest, match=f"{field}|live migration"):
        p.api.client("instances").insert_unary(project=PROJECT, zone="us-central1-a", instance_resource=body)
    body = instance_body(node_request(o, net, run_id="r-spot01"), project=PROJECT, zone="us-central1-a", net=net,
                         image="projects/x/global/images/family/y", ssh_user="broker", workroot=None)
    body.scheduling.provisioning_model = "STANDARD"  # a termination action on a standard VM
    with pytest.raises(gexc.BadRequest, match="instanceTerminationAction"):
        p.api.client("instances").insert_unary(project=PROJECT, zone="us-central1-a", instance_resource=body)
    assert emu.live("instances") == []


# ------------------------------------------------------------------------------------------------ preemption
def test_google_preempting_a_spot_vm_is_a_preemption_in_googles_words(emu):
    p = make(emu)
    pid, _ = _run(p, emu, offer=_spot_t4(p))
    assert p.preemption(pid) is None  # running
    zone, name = pid.split(":")
    op = emu.preempt(zone, name)
    assert emu.live("instances") == []  # DELETE: nothing left billing
    assert p.describe_instance(pid).state == "terminated"
    why = p.preemption(pid)
    assert why is not None and "compute.instances.preempted" in why and op["name"] in why and name in why
    # another broker process (the watchdog, a later CLI) reads the same word
    assert make(emu).preemption(pid) == why


def test_a_spot_vm_broker_deleted_is_not_a_preemption_here_nor_in_another_process(emu):
    p = make(emu)
    pid, _ = _run(p, emu, offer=_spot_t4(p))
    assert p.terminate("instance", pid) is False
    assert p.describe_instance(pid).state == "terminated"
    assert p.preemption(pid) is None
    # a process that did not send the delete: Google recorded a delete, not a preemption
    assert make(emu).preemption(pid) is None


def test_a_later_attempt_of_the_same_name_is_not_taken_for_the_earlier_preemption(emu):
    p = make(emu)
    o = _spot_t4(p, "us-central1-a")
    pid, net = _run(p, emu, offer=o)
    emu.preempt(*pid.split(":"))
    assert p.preemption(pid)
    # attempt 2 rents the node again under the same name in the same zone (its own ledger row)
    again = node_request(o, net, run_id="r-spot01").model_copy(update={"client_token": "res0attempt2"})
    pid2 = p.create_instance(again)
    assert pid2 == pid
    for _ in range(3):
        p.describe_instance(pid2)
    assert p.preemption(pid2) is None
    emu.preempt(*pid2.split(":"))
    assert p.preemption(pid2)


def test_a_spot_vm_stopped_by_google_with_action_stop_is_a_preemption(emu):
    p = make(emu)
    pid, _ = _run(p, emu, offer=_spot_t4(p))
    inst = emu.live("instances")[0]
    inst["scheduling"]["instanceTerminationAction"] = "STOP"  # a VM made with the console's default
    emu.preempt(*pid.split(":"))
    assert emu.live("instances")[0]["status"] == "TERMINATED"
    assert "compute.instances.preempted" in (p.preemption(pid) or "")


def test_an_on_demand_vm_is_never_a_preemption(emu):
    p = make(emu)
    o = next(o for o in p.offers(_req()) if o.instance_type == "n1-standard-4+t4")
    pid, _ = _run(p, emu, offer=o)
    with pytest.raises(AssertionError):
        emu.preempt(*pid.split(":"))
    assert p.preemption(pid) is None


def test_operations_google_will_not_show_are_an_error_not_no_preemption(emu):
    p = make(emu)
    pid, _ = _run(p, emu, offer=_spot_t4(p))
    emu.preempt(*pid.split(":"))
    emu.fail[("GET", "operations")] = [403]
    with pytest.raises(AuthError):
        p.preemption(pid)
    with pytest.raises(ProviderError):
        p.preemption("not-an-id")


# ------------------------------------------------------------------------------------------------ quota
def test_spot_options_are_judged_by_preemptible_quota_when_granted_else_by_the_standard_one():
    quotas = {"NVIDIA_T4_GPUS": 4, "PREEMPTIBLE_NVIDIA_T4_GPUS": 1, "CPUS": 24, "PREEMPTIBLE_CPUS": 0}
    with GCPEmulator(project=PROJECT, region_quotas={"us-central1": quotas}) as emu:
        p = make(emu)
        offs = [o for o in p.offers(_req()) if o.instance_type == "n1-standard-4+t4"]
        qs = p.quotas(_req(), offs)
        spot = {q.name: q for q in qs if q.interruptible}
        od = {q.name for q in qs if not q.interruptible}
        assert od == {"NVIDIA_T4_GPUS", "CPUS", "GPUS_ALL_REGIONS"}
        # PREEMPTIBLE_NVIDIA_T4_GPUS granted (1): it counts Spot T4s; PREEMPTIBLE_CPUS 0: the standard CPUS does
        assert set(spot) == {"PREEMPTIBLE_NVIDIA_T4_GPUS", "CPUS", "GPUS_ALL_REGIONS"}
        assert spot["PREEMPTIBLE_NVIDIA_T4_GPUS"].limit == 1
        # an on-demand-only recipe reads no Spot limits
        assert not any(q.interruptible for q in p.quotas(_req(interruptible="false"), offs))


def test_plan_rejects_two_spot_t4_nodes_on_one_granted_preemptible_gpu_but_keeps_on_demand():
    from broker.plan.planner import plan

    quotas = {"NVIDIA_T4_GPUS": 4, "PREEMPTIBLE_NVIDIA_T4_GPUS": 1, "CPUS": 24}
    with GCPEmulator(project=PROJECT, region_quotas={"us-central1": quotas}) as emu:
        p = make(emu)
        r = _req(nodes=2, interruptible="auto")
        offers = p.offers(r)
        pl = plan(r, offers, quotas=p.quotas(r, offers))
    t4 = [o for o in pl.options if o.offers[0].instance_type == "n1-standard-4+t4" and o.nodes == 2
          and o.topology.value == "multi-node"]
    assert t4 and not any(o.interruptible for o in t4)
    rej = [o for o in pl.rejected if o.interruptible and o.offers and o.offers[0].instance_type == "n1-standard-4+t4"
           and o.topology.value == "multi-node"]
    assert rej and any("PREEMPTIBLE_NVIDIA_T4_GPUS" in r for o in rej for r in o.rejected)


def test_limit_for_an_interruptible_variant_is_the_preemptible_metric():
    from broker.plan.quota import limit_for, spot_offer
    from broker.providers.gcp import snapshot_offers
    from broker.plan.interruptible import variant

    o = next(o for o in snapshot_offers(None) if o.instance_type == "g2-standard-4")
    v = variant(o)
    assert v is not None and spot_offer(v) and not spot_offer(o)
    assert limit_for("gcp", v.instance_type, spot=spot_offer(v)).name == "PREEMPTIBLE_NVIDIA_L4_GPUS"
    assert limit_for("gcp", o.instance_type, spot=spot_offer(o)).name == "NVIDIA_L4_GPUS"


def test_provision_skips_only_the_spot_gpu_whose_preemptible_quota_is_exhausted(tmp_ledger, tmp_path):
    """QUOTA_EXCEEDED on PREEMPTIBLE_NVIDIA_T4_GPUS blocks the Spot T4 options of the region, not the Spot L4 one:
    the limit a Spot VM's refusal names is that option's own (PREEMPTIBLE_*), not a region-wide one."""
    from datetime import timedelta

    from broker.core.model import utcnow
    from broker.core.records import Run
    from broker.money.provision import provision
    from broker.money.teardown import teardown_run
    from broker.plan.planner import plan

    quotas = {"NVIDIA_T4_GPUS": 4, "PREEMPTIBLE_NVIDIA_T4_GPUS": 4, "NVIDIA_L4_GPUS": 4,
              "PREEMPTIBLE_NVIDIA_L4_GPUS": 4, "CPUS": 24, "G2_CPUS": 24}
    with GCPEmulator(project=PROJECT, region_quotas={"us-central1": quotas}) as emu:
        p = make(emu)
        emu.quota_exceeded["PREEMPTIBLE_NVIDIA_T4_GPUS"] = "us-central1"
        r = _req(nodes=2, interruptible="true", gpu_names=["T4", "L4"])
        offs = [o for o in p.offers(r) if o.instance_type in ("n1-standard-4+t4", "g2-standard-4")]
        opts = [o for o in plan(r, offs, p.quotas(r, offs), now=utcnow()).options
                if o.valid and o.topology.value == "multi-node"]
        assert opts and all(o.interruptible for o in opts)
        assert opts[0].offers[0].instance_type == "n1-standard-4+t4"
        now = utcnow()
        run = tmp_ledger.create_run(Run(id="r-gcpsq", name="t", provider="gcp", topology="multi-node",
                                        status="provisioning", created_at=now, deadline=now + timedelta(hours=1),
                                        run_dir=str(tmp_path / "runs" / "r-gcpsq")))
        Path(run.run_dir).mkdir(parents=True)
        said: list[str] = []
        cluster = provision(opts, run, r, tmp_ledger, providers={"gcp": p}, poll_s=0.01, retry_wait_s=0.01,
                            terminate_timeout_s=5, progress=said.append)
        live = emu.live("instances")
        assert {i["machineType"].rsplit("/", 1)[-1] for i in live} == {"g2-standard-4"} and len(cluster.nodes) == 2
        assert all(i["scheduling"]["provisioningModel"] == "SPOT" for i in live)
        refused = [pth for m, pth, st in emu.journal if m == "POST" and pth.endswith("/instances") and st == 403]
        assert len(refused) == 1, refused  # one refusal, then the other T4 zones are skipped
        assert "PREEMPTIBLE_NVIDIA_T4_GPUS" in "\n".join(str(s) for s in said)
        assert teardown_run(tmp_ledger, run.id, "test", providers={"gcp": p}, poll_s=0.01) == []
        assert emu.live("instances") == [] and emu.live("networks") == []
