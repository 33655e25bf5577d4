"""The gcp adapter's facts held against Google's published ones, through the REAL google-cloud clients against
tests/support/gcp_emulator.py: machine types and their GPU counts, which metric a quota error blocks, one
QuotaPreference per quota and dimensions, zones and accelerator availability from the API, operation waits bounded
by the run's clock, and the parity of broker's requests and metric names with the clients' own."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("google.cloud.compute_v1")
pytest.importorskip("google.cloud.cloudquotas_v1")

from broker.core.model import utcnow  # noqa: E402
from tests.providers.gcp.test_gcp import COLLS, PROJECT, Rec, make, node_request, req  # noqa: E402
from tests.support.gcp_emulator import GCPEmulator  # noqa: E402


@pytest.fixture
def emu():
    with GCPEmulator(project=PROJECT) as e:
        yield e


#: Google's accelerator-optimized machine types (cloud.google.com/compute/docs/accelerator-optimized-machines):
#: type -> (GPUs, vCPUs)
PUBLISHED = {
    "g2-standard-4": (1, 4), "g2-standard-8": (1, 8), "g2-standard-12": (1, 12), "g2-standard-16": (1, 16),
    "g2-standard-24": (2, 24), "g2-standard-32": (1, 32), "g2-standard-48": (4, 48), "g2-standard-96": (8, 96),
    "a2-highgpu-1g": (1, 12), "a2-highgpu-2g": (2, 24), "a2-highgpu-4g": (4, 48), "a2-highgpu-8g": (8, 96),
    "a2-megagpu-16g": (16, 96), "a2-ultragpu-1g": (1, 12), "a2-ultragpu-2g": (2, 24), "a2-ultragpu-4g": (4, 48),
    "a2-ultragpu-8g": (8, 96), "a3-highgpu-1g": (1, 26), "a3-highgpu-2g": (2, 52), "a3-highgpu-4g": (4, 104),
    "a3-highgpu-8g": (8, 208),
}


def _run(tmp_ledger, tmp_path, run_id: str, hours: float = 1.0):
    from broker.core.records import Run

    now = utcnow()
    run = tmp_ledger.create_run(Run(id=run_id, name="t", provider="gcp", topology="multi-node",
                                    status="provisioning", created_at=now, deadline=now + timedelta(hours=hours),
                                    run_dir=str(tmp_path / "runs" / run_id)))
    Path(run.run_dir).mkdir(parents=True)
    return run


# ------------------------------------------------------------------------------------------------ machine types
def test_every_accelerator_optimized_type_has_googles_gpu_count():
    from broker.providers.gcp.offers import BUILT_IN, parse_type

    for it, (gpus, vcpus) in PUBLISHED.items():
        t = parse_type(it)
        assert t is not None and t.gpus == gpus and not t.attached, (it, t)
        assert BUILT_IN[it][2] == vcpus, it
    assert parse_type("g2-standard-24").gpus == 2 and parse_type("g2-standard-96").gpus == 8
    assert parse_type("a2-ultragpu-1g").gpu_metric() == "NVIDIA_A100_80GB_GPUS"
    assert parse_type("g2-standard-5") is None  # not a published type: not rented


def test_the_snapshot_agrees_with_the_published_types():
    from broker.providers.gcp import snapshot_offers
    from broker.providers.gcp.offers import parse_type

    for o in snapshot_offers(None):
        t = parse_type(o.instance_type)
        if not t.attached:
            assert (o.gpu_count, o.vcpus) == PUBLISHED[t.machine_type], o.instance_type


def test_a_g2_standard_48_counts_four_l4_gpus_of_quota(emu):
    """Inserted through the real client, the VM counts 4 NVIDIA_L4_GPUS (Google's table), and the adapter's
    quota read reports them."""
    from dataclasses import replace

    emu.region_quotas["us-central1"]["NVIDIA_L4_GPUS"] = 8
    p = make(emu)
    g2 = next(o for o in p.offers(req()) if o.instance_type == "g2-standard-4" and o.zone == "us-central1-a")
    big = replace(g2, instance_type="g2-standard-48", gpu_count=4, vcpus=48)
    net = p.bootstrap("r-g2", [big], "multi-node", Rec())
    p.create_instance(node_request(big, net, run_id="r-g2"))
    q = next(q for q in p.quotas(req(), [big]) if q.name == "NVIDIA_L4_GPUS")
    assert q.used == 4 and q.available == 4


# ------------------------------------------------------------------------------------------------ quota scope
def test_a_cpus_quota_error_skips_the_n1_options_only_and_a_g2_option_serves(emu, tmp_ledger, tmp_path):
    """``CPUS`` exhausted: the N1 + T4 options (which count CPUS) are skipped after one refusal, the G2 option
    (which counts G2_CPUS and NVIDIA_L4_GPUS) is tried and serves."""
    from broker.money.provision import provision
    from broker.money.teardown import teardown_run
    from broker.plan.planner import plan

    p = make(emu)
    emu.quota_exceeded["CPUS"] = "us-central1"
    r = req(2)
    offs = [o for o in p.offers(r) if o.instance_type in ("n1-standard-4+t4", "g2-standard-4")]
    opts = [o for o in plan(r, offs, now=utcnow()).options if o.valid and o.topology.value == "multi-node"]
    assert opts[0].offers[0].instance_type == "n1-standard-4+t4"
    run = _run(tmp_ledger, tmp_path, "r-gcpcpus")
    said: list[str] = []
    cluster = provision(opts, run, r, tmp_ledger, providers={"gcp": p}, poll_s=0.01, retry_wait_s=0.01,
                        terminate_timeout_s=5, progress=said.append)
    assert len(cluster.nodes) == 2
    assert {i["machineType"].rsplit("/", 1)[-1] for i in emu.live("instances")} == {"g2-standard-4"}
    refused = [pth for m, pth, st in emu.journal if m == "POST" and pth.endswith("/instances") and st == 403]
    assert len(refused) == 1, refused
    assert teardown_run(tmp_ledger, run.id, "test", providers={"gcp": p}, poll_s=0.01) == []
    assert {c: emu.live(c) for c in COLLS} == {c: [] for c in COLLS}


# ------------------------------------------------------------------------------------------------ quota check notes
def test_quota_check_notes_divide_a_vcpu_limit_by_the_types_vcpus(emu, tmp_path, monkeypatch):
    """`broker quota check` against the emulator: A2_CPUS 24 fits 2 a2-highgpu-1g (12 vCPUs each), not 24."""
    from broker.cli.quota import check_provider

    emu.region_quotas["us-central1"].update(A2_CPUS=24, NVIDIA_A100_GPUS=4)
    adc = tmp_path / "gcloud"
    adc.mkdir()
    (adc / "application_default_credentials.json").write_text(
        '{"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "t"}')
    for k, v in {"GOOGLE_CLOUD_PROJECT": PROJECT, "GCP_COMPUTE_ENDPOINT": emu.url, "GCP_QUOTAS_ENDPOINT": emu.url,
                 "CLOUDSDK_CONFIG": str(adc)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    out = check_provider("gcp", 2, 1, "a2-highgpu-1g", "multi-node", None)
    notes = [e for e in out["explanations"] if e.startswith("0 of 24 vCPUs")]
    assert notes and "(= 2× a2-highgpu-1g)" in notes[0], out["explanations"]


# ------------------------------------------------------------------------------------------------ quota preferences
def _q(name: str = "NVIDIA_T4_GPUS"):
    from broker.core.model import Quota

    return Quota(provider="gcp", name=name, region="us-central1", scope="us-central1", limit=0, used=0,
                 unit="gpus", instance_types=["n1-standard-4+t4"], source="test")


def test_a_second_quota_request_updates_the_one_preference_by_patch(emu, monkeypatch):
    """Google keeps one QuotaPreference per quota and dimensions (a second create is refused): after a decided
    request, a larger one patches that preference (update mask), an equal open one is reported, never re-filed."""
    monkeypatch.setenv("GCP_QUOTA_CONTACT_EMAIL", "ops@example.com")
    p = make(emu)
    first = p.request_quota(_q(), 2, "two T4 nodes")
    assert first.state == "PENDING" and len(emu.objs["quotaPreferences"]) == 1
    emu.decide(first.request_id, 2)
    second = p.request_quota(_q(), 4, "four T4 nodes")
    assert second.request_id == first.request_id and second.state == "PENDING", second
    assert "updated the existing request" in second.message and "2 -> 4" in second.message
    [pref] = emu.objs["quotaPreferences"].values()
    assert pref["quotaConfig"]["preferredValue"] == "4" and pref["justification"] == "four T4 nodes"
    method, pid, query, body = emu.quota_requests[-1]
    assert method == "PATCH" and pid == first.request_id.rsplit("/", 1)[-1]
    assert set(query["updateMask"].split(",")) == {"quotaConfig.preferredValue", "justification", "contactEmail"}
    assert body["quotaId"] == "NVIDIA-T4-GPUS-per-project-region" and body["dimensions"] == {"region": "us-central1"}
    third = p.request_quota(_q(), 4, "again")
    assert third.request_id == first.request_id and "not filed again" in third.message
    assert [m for m, *_ in emu.quota_requests].count("POST") == 1
    # another region is another preference
    other = p.request_quota(replace(_q(), region="europe-west4", scope="europe-west4"), 1, "eu")
    assert other.request_id != first.request_id and len(emu.objs["quotaPreferences"]) == 2


# ------------------------------------------------------------------------------------------------ operation waits
def test_a_stuck_insert_operation_ends_at_the_runs_deadline_with_progress_lines(emu):
    """An insert whose operation stays PENDING: the wait says so on the progress line and ends at the run's
    deadline (1.5 s away), not after the fixed operation timeout (600 s), as an ambiguous create."""
    import threading
    import time

    from broker.core.provider import AmbiguousCreate

    p = make(emu)
    p.api.poll_s, p.api.progress_every_s = 0.05, 0.3
    said: list[str] = []
    p.progress = said.append
    o = next(o for o in p.offers(req()) if o.instance_type == "n1-standard-4+t4")
    net = p.bootstrap("r-stuck", [o], "multi-node", Rec())
    emu.hold_ops.add("insert")
    nr = node_request(o, net, run_id="r-stuck").model_copy(update={"deadline": utcnow() + timedelta(seconds=1.5)})
    out: list[BaseException] = []

    def create() -> None:
        try:
            p.create_instance(nr)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out.append(e)

    t0 = time.monotonic()
    th = threading.Thread(target=create, daemon=True)
    th.start()
    th.join(timeout=30)
    assert not th.is_alive(), "the wait ignored the run's deadline"
    assert time.monotonic() - t0 < 10
    [e] = out
    assert isinstance(e, AmbiguousCreate) and "still PENDING at the run's deadline" in e.message, e
    assert said and all("PENDING" in s and "instances.insert in us-central1-" in s for s in said), said
    assert "the run's deadline" in said[0]


# ------------------------------------------------------------------------------------------------ zones
def test_zones_come_from_accelerator_types_with_the_snapshot_as_fallback(emu):
    """Configured offers are placed in the zones acceleratorTypes.aggregatedList lists now (L4 moved to c and d
    only); an unreadable answer falls back to the snapshot's zones and the price note says so."""
    emu.regions["us-central1"].append("us-central1-d")
    for z in ("us-central1-a", "us-central1-b"):
        emu.accelerators[z].remove("nvidia-l4")
    emu.accelerators["us-central1-d"] = ["nvidia-l4"]
    emu.accelerators["europe-west4-a"] = ["nvidia-l4"]  # another region's zone: not this offer's
    p = make(emu)
    g2 = [o for o in p.offers(req()) if o.instance_type == "g2-standard-4"]
    assert sorted(o.zone for o in g2) == ["us-central1-c", "us-central1-d"]
    assert g2[0].attrs["zones_source"] == "acceleratorTypes.aggregatedList"
    assert ("GET", "/compute/v1/projects/broker-test/aggregated/acceleratorTypes", 200) in emu.journal
    p.offers(req())
    assert sum(1 for j in emu.journal if j[1].endswith("/aggregated/acceleratorTypes")) == 1  # read once

    emu.fail[("GET", "aggregated")] = [503] * 10
    p2 = make(emu)
    g2 = [o for o in p2.offers(req()) if o.instance_type == "g2-standard-4"]
    assert sorted(o.zone for o in g2) == ["us-central1-a", "us-central1-b", "us-central1-c"]  # the snapshot's
    assert "zones from the snapshot" in p2.price_note()


@pytest.mark.parametrize("itype,acc", [("n1-standard-4+p4", "nvidia-tesla-p4"), ("g2-standard-4", "nvidia-l4")])
def test_a_gpu_the_zone_does_not_offer_is_a_capacity_skip_of_that_zone(emu, itype, acc):
    """Compute Engine refuses an accelerator (or a G2 machine type) the zone lacks; broker reads that as "no
    capacity in this zone" (the next zone, then the next option), not a generic failure."""
    from broker.core.provider import CapacityError

    p = make(emu)
    o = next(o for o in p.offers(req()) if o.instance_type == itype and o.zone == "us-central1-a")
    emu.accelerators["us-central1-a"].remove(acc)  # gone from the zone after the offers were read
    net = p.bootstrap("r-nz", [o], "multi-node", Rec())
    with pytest.raises(CapacityError) as ei:
        p.create_instance(node_request(o, net, run_id="r-nz"))
    e = ei.value
    assert "is not offered in zone us-central1-a" in e.message and e.status is None, e.message
    assert "accelerator-types list" in e.hint
    assert emu.live("instances") == []


# ------------------------------------------------------------------------------------------------ parity
#: metric names broker uses that the installed client's Quota.Metric enum does not list (docs/reference/
#: gcp-fixtures.md marks them UNCONFIRMED; a region that does not report one does not enforce it)
UNCONFIRMED_METRICS = {"G2_CPUS", "A3_CPUS", "NVIDIA_H100_GPUS"}


def test_every_quota_metric_broker_names_is_in_the_clients_enum_or_marked_unconfirmed():
    from google.cloud import compute_v1

    from broker.providers.gcp.offers import ACCELERATORS, FAMILIES, GLOBAL_GPU_METRIC, BUILT_IN, parse_type

    enum = {m.name for m in compute_v1.Quota.Metric}
    used = {GLOBAL_GPU_METRIC, "PREEMPTIBLE_CPUS"} | {cpu for _, cpu in FAMILIES.values()}
    used |= set(ACCELERATORS.values()) | {"PREEMPTIBLE_" + m for m in ACCELERATORS.values()}
    for it in [*BUILT_IN, "n1-standard-4+t4", "n1-standard-8+v100"]:
        t = parse_type(it)
        used |= {t.gpu_metric(), t.gpu_metric(spot=True), t.cpu_metric(), t.cpu_metric(spot=True)}
    assert used - enum == UNCONFIRMED_METRICS, used - enum  # a new name must be checked, or marked here
    assert not UNCONFIRMED_METRICS & enum  # the client now lists it: drop it from the unconfirmed set
    doc = (Path(__file__).resolve().parents[3] / "docs" / "reference" / "gcp-fixtures.md").read_text()
    assert all(f"`{m}` UNCONFIRMED" in doc for m in UNCONFIRMED_METRICS)


def _parses(type_: Any, doc: Any) -> None:
    import json

    type_.from_json(json.dumps(doc), ignore_unknown_fields=False)  # raises ParseError on a field the API lacks


def test_broker_requests_and_the_emulators_answers_are_the_clients_messages(emu, monkeypatch):
    """Every body broker sends (instance, network, subnetwork, firewall, quota preference create and patch)
    and every answer it reads is a message of google-cloud-compute / cloudquotas with no field they lack; the
    paths broker builds by hand for the plan-time reads are the official client's paths for the same verbs."""
    import re as _re

    from google.cloud import cloudquotas_v1 as cq
    from google.cloud import compute_v1 as c

    monkeypatch.setenv("GCP_QUOTA_CONTACT_EMAIL", "ops@example.com")
    p = make(emu)
    o = next(o for o in p.offers(req()) if o.instance_type == "n1-standard-4+t4")
    p.quotas(req(), [o])
    net = p.bootstrap("r-par", [o], "multi-node", Rec())
    spot = replace(o, attrs={**o.attrs, "interruptible": True})
    p.create_instance(node_request(spot, net, run_id="r-par"))
    p.describe_instance(f"{o.zone}:broker-r-par-n0")
    p.list_tagged("r-par")
    first = p.request_quota(_q(), 2, "two")
    emu.decide(first.request_id, 2)
    p.request_quota(_q(), 4, "four")
    requests = {(r"POST", r".*/zones/[^/]+/instances"): c.Instance, (r"POST", r".*/global/networks"): c.Network,
                (r"POST", r".*/global/firewalls"): c.Firewall, (r"POST", r".*/subnetworks"): c.Subnetwork,
                (r"POST", r"/v1/.*/quotaPreferences"): cq.QuotaPreference,
                (r"PATCH", r"/v1/.*/quotaPreferences/[^/]+"): cq.QuotaPreference}
    answers = {(r"GET", r".*/zones/[^/]+/instances/[^/]+"): c.Instance,
               (r"GET", r".*/aggregated/instances"): c.InstanceAggregatedList,
               (r"GET", r".*/aggregated/acceleratorTypes"): c.AcceleratorTypeAggregatedList,
               (r"GET", r".*/regions/[^/]+"): c.Region, (r"GET", r"/compute/v1/projects/[^/]+"): c.Project,
               (r"GET", r".*/operations/[^/]+"): c.Operation, (r"POST", r".*/zones/[^/]+/instances"): c.Operation,
               (r"GET", r"/v1/.*/quotaPreferences"): cq.ListQuotaPreferencesResponse,
               (r"PATCH", r"/v1/.*/quotaPreferences/[^/]+"): cq.QuotaPreference}
    checked = set()
    for method, path, body, status, answer in emu.exchanges:
        for table, doc in ((requests, body), (answers, answer)):
            for (m, pat), type_ in table.items():
                if m == method and _re.fullmatch(pat, path) and status < 400 and doc:
                    _parses(type_, doc)
                    checked.add((m, pat, table is requests))
    assert len(checked) >= 13, sorted(checked)

    # the hand-built REST reads of `broker plan` go where the official clients go
    plan_reads = rf"/compute/v1/projects/{PROJECT}(/regions/[^/]+|/aggregated/acceleratorTypes)?"
    ours = [pth for m, pth, _ in emu.journal if m == "GET" and _re.fullmatch(plan_reads, pth)]
    before = len(emu.journal)
    kw = {"credentials": p.api.credentials(), "transport": "rest", "client_options": {"api_endpoint": emu.url}}
    c.RegionsClient(**kw).get(project=PROJECT, region="us-central1")
    c.ProjectsClient(**kw).get(project=PROJECT)
    list(c.AcceleratorTypesClient(**kw).aggregated_list(project=PROJECT))
    theirs = [pth for m, pth, _ in emu.journal[before:]]
    assert set(theirs) == set(ours), (theirs, ours)


def test_a_stuck_network_insert_ends_at_the_runs_deadline_with_progress_events(emu):
    """The run's network: a VPC insert whose operation stays PENDING reports through the recorder and ends at the
    deadline the ledger recorder carries (not after 600 s)."""
    import threading
    import time

    from broker.core.provider import ProviderError

    p = make(emu)
    p.api.poll_s, p.api.progress_every_s = 0.05, 0.3
    rec = Rec()
    rec.deadline = utcnow() + timedelta(seconds=1.5)
    o = next(o for o in p.offers(req()) if o.instance_type == "n1-standard-4+t4")
    emu.hold_ops.add("insert")
    out: list[BaseException] = []

    def boot() -> None:
        try:
            p.bootstrap("r-stuck2", [o], "multi-node", rec)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out.append(e)

    t0 = time.monotonic()
    th = threading.Thread(target=boot, daemon=True)
    th.start()
    th.join(timeout=30)
    assert not th.is_alive() and time.monotonic() - t0 < 10, "the wait ignored the run's deadline"
    [e] = out
    assert isinstance(e, ProviderError) and "at the run's deadline" in e.message, e
    events = [m for kind, _, m in rec.log if kind == "event"]
    assert events and "networks.insert" in events[0] and "PENDING" in events[0], rec.log
