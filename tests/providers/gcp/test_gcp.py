"""The gcp adapter against tests/support/gcp_emulator.py through the REAL Google clients (google-cloud-compute REST
transport, google-cloud-quotas, google-cloud-billing) with AnonymousCredentials: offers, quotas and the plan's
rejection, credentials, the error mapping, network + instances ledger-first, deletes in dependency order, quota
requests, live prices."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("google.cloud.compute_v1")
pytest.importorskip("google.cloud.cloudquotas_v1")

from google.auth.credentials import AnonymousCredentials  # noqa: E402

from broker.core.model import Quota, Requirements, utcnow  # noqa: E402
from broker.core.provider import (AmbiguousCreate, CapacityError, INSTALL_TAG, QuotaError, RUN_TAG,  # noqa: E402
                                  TransientError)
from tests.support.gcp_emulator import GCPEmulator  # noqa: E402

PROJECT = "broker-test"


@pytest.fixture
def emu():
    with GCPEmulator(project=PROJECT) as e:
        yield e


def make(emu: GCPEmulator, **kw: Any):
    from broker.providers.gcp import GCPProvider

    return GCPProvider(project=PROJECT, credentials=AnonymousCredentials(), compute_endpoint=emu.url,
                       quotas_endpoint=emu.url, billing_endpoint=emu.url, poll_s=0.0, **kw)


class Rec:
    """A Recorder that keeps the order of intents and creates (ledger-first check)."""

    installation_id = "bi0123456789"

    def __init__(self, emu: GCPEmulator | None = None):
        self.log: list[tuple[str, str, Any]] = []
        self.emu = emu

    def intent(self, kind: str, name: str, **kw: Any) -> str:
        # ledger-first: at intent time the object must not exist yet
        if self.emu is not None:
            coll = {"vpc": "networks", "firewall": "firewalls", "subnet": "subnetworks"}[kind]
            assert not any(o["name"] == name for o in self.emu.live(coll)), (kind, name)
        self.log.append(("intent", kind, name))
        return f"r{len(self.log)}"

    def created(self, rid: str, pid: str, **kw: Any) -> None:
        self.log.append(("created", rid, pid))

    def failed(self, rid: str, error: str) -> None:
        self.log.append(("failed", rid, error))

    def event(self, message: str) -> None:
        self.log.append(("event", "", message))


def req(nodes: int = 2, **kw: Any) -> Requirements:
    return Requirements(nodes=nodes, gpus_per_node=1, min_gpu_mem_gib=0, hours=1, budget_usd=5, providers=["gcp"],
                        **kw)


def node_request(offer: Any, net: dict, i: int = 0, run_id: str = "r-abc123", **kw: Any):
    from broker.core.records import NodeRequest

    return NodeRequest(run_id=run_id, node_index=i, name=f"broker-{run_id}-n{i}", offer=offer,
                       ssh_public_key="ssh-ed25519 AAAAC3Nza test@x", client_token=f"res{i}abcdef",
                       installation_id="bi0123456789", deadline=utcnow() + timedelta(hours=1), network=net, **kw)


# ------------------------------------------------------------------------------------------------ offers, quotas
def test_snapshot_offers_every_family_with_spot_and_zones():
    from broker.providers.gcp import snapshot_offers

    offers = {o.instance_type: o for o in snapshot_offers(None)}
    assert {"n1-standard-4+t4", "n1-standard-4+p4", "n1-standard-8+p100",
            "n1-standard-8+v100", "g2-standard-4", "a2-highgpu-1g"} <= set(offers)
    t4 = offers["n1-standard-4+t4"]
    assert t4.usd_per_hour == pytest.approx(0.539999) and t4.attrs["spot_usd_per_hour"] < t4.usd_per_hour
    assert t4.attrs["zones"] == ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"]
    assert offers["n1-standard-8+p100"].attrs["zones"] == ["us-central1-c", "us-central1-f"]
    assert all(o.private_network and o.region == "us-central1" for o in offers.values())


def test_unconfigured_offers_come_from_the_snapshot_without_zones(monkeypatch, tmp_path):
    from broker.providers.gcp import GCPProvider

    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    p = GCPProvider()
    assert not p.api.configured()
    offs = p.offers(req())
    assert offs and all(o.zone is None for o in offs)
    assert p.quotas(req(), offs) == []
    chk = p.check()
    assert not chk.configured and "no ADC file" in chk.detail


def test_configured_offers_one_per_zone(emu):
    p = make(emu)
    offs = [o for o in p.offers(req()) if o.instance_type == "g2-standard-4"]
    assert sorted(o.zone for o in offs) == ["us-central1-a", "us-central1-b", "us-central1-c"]
    p2 = make(emu, zones=["us-central1-b"])
    assert {o.zone for o in p2.offers(req())} == {"us-central1-b"}


def test_plan_shows_one_row_per_type_with_its_zones_not_one_per_zone(emu):
    from broker.cli.plan import group_zones, rented
    from broker.plan.planner import plan

    p = make(emu)
    offs = [o for o in p.offers(req()) if o.instance_type == "g2-standard-4"]
    result = plan(req(), offs, p.quotas(req(), offs), now=utcnow())
    assert len(result.options) == 3, result.options
    [(opt, zones)] = group_zones(result.options)
    assert rented(opt, zones) == "2 x g2-standard-4 (us-central1/us-central1-a,us-central1-b,us-central1-c)"


def test_quotas_read_regional_gpu_cpu_and_gpus_all_regions(emu):
    p = make(emu)
    offs = [o for o in p.offers(req()) if o.instance_type in ("n1-standard-4+t4", "a2-highgpu-1g")]
    qs = {q.name: q for q in p.quotas(req(), offs)}
    assert qs["NVIDIA_T4_GPUS"].limit == 4 and qs["NVIDIA_T4_GPUS"].region == "us-central1"
    assert qs["CPUS"].unit == "vcpus" and qs["CPUS"].limit == 24
    assert qs["A2_CPUS"].limit == 0
    g = qs["GPUS_ALL_REGIONS"]
    assert g.region is None and g.scope is None and g.unit == "gpus"
    assert set(g.instance_types) == {"n1-standard-4+t4", "a2-highgpu-1g"}
    # spot offers are judged on the PREEMPTIBLE_ metric
    from dataclasses import replace
    spot = [replace(o, attrs={**o.attrs, "market": "spot"}) for o in offs[:1]]
    assert {q.name for q in p.quotas(req(), spot)} >= {"PREEMPTIBLE_NVIDIA_T4_GPUS", "PREEMPTIBLE_CPUS"} - {
        "PREEMPTIBLE_CPUS"}


def test_plan_rejects_with_gpus_all_regions_0_of_0(emu):
    from broker.plan.planner import plan

    emu.project_quotas = {"GPUS_ALL_REGIONS": 0}
    p = make(emu)
    offs = p.offers(req())
    result = plan(req(), offs, p.quotas(req(), offs), now=utcnow())
    assert not result.options
    reasons = " ".join(r for o in result.rejected for r in o.rejected)
    assert "quota GPUS_ALL_REGIONS 0 of 0 gpus available in the account; needs 2" in reasons, reasons[:2000]


def test_a_project_without_gpus_all_regions_is_not_blocked(emu):
    from broker.plan.planner import plan

    emu.project_quotas = {}
    p = make(emu)
    offs = [o for o in p.offers(req()) if o.instance_type == "n1-standard-4+t4"]
    result = plan(req(), offs, p.quotas(req(), offs), now=utcnow())
    assert [o for o in result.options if o.valid]


# ------------------------------------------------------------------------------------------------ credentials
def test_check_names_google_application_credentials_and_never_prints_the_key(monkeypatch, tmp_path):
    from broker.providers.gcp import GCPProvider

    key = tmp_path / "sa.json"
    secret = "-----BEGIN PRIVATE KEY-----\nSECRETSECRET\n-----END PRIVATE KEY-----\n"
    key.write_text(json.dumps({"type": "authorized_user", "client_id": "cid", "client_secret": "SECRETSECRET",
                               "refresh_token": "SECRETSECRET", "quota_project_id": "from-file"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    monkeypatch.delenv("GCLOUD_PROJECT", raising=False)
    chk = GCPProvider().check()
    assert chk.configured, chk
    assert "GOOGLE_APPLICATION_CREDENTIALS" in chk.detail and "project from-file" in chk.detail
    assert "SECRET" not in chk.detail + (chk.hint or "") and secret not in chk.detail


def test_check_says_the_service_account_private_key_is_invalid_and_never_prints_it(monkeypatch, tmp_path):
    from broker.providers.gcp import GCPProvider

    key = tmp_path / "sa.json"
    key.write_text(json.dumps({
        "type": "service_account", "project_id": "p1", "private_key_id": "abc",
        "private_key": "-----BEGIN PRIVATE KEY-----\nGARBAGESECRET\n-----END PRIVATE KEY-----\n",
        "client_email": "sa@p1.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    chk = GCPProvider().check()
    text = chk.detail + " " + (chk.hint or "")
    assert chk.usable is False and f"the private_key in {key} is not a valid PEM private key" in chk.detail, chk
    assert "new key" in chk.hint and "See https" not in text and "GARBAGESECRET" not in text
    assert "set GOOGLE_APPLICATION_CREDENTIALS to" not in chk.hint  # it is set already


def test_check_names_the_adc_file_and_google_cloud_project(monkeypatch, tmp_path):
    from broker.providers.gcp import GCPProvider

    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    (tmp_path / "application_default_credentials.json").write_text(json.dumps(
        {"type": "authorized_user", "client_id": "c", "client_secret": "SECRETSECRET", "refresh_token": "t"}))
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "envproj")
    chk = GCPProvider().check()
    assert chk.configured and "application default credentials" in chk.detail
    assert "project envproj (from GOOGLE_CLOUD_PROJECT)" in chk.detail and "SECRET" not in chk.detail


# ------------------------------------------------------------------------------------------------ lifecycle
def _t4(p, zone: str | None = None):
    return next(o for o in p.offers(req()) if o.instance_type == "n1-standard-4+t4"
                and (zone is None or o.zone == zone))


def test_bootstrap_is_ledger_first_and_instances_carry_tags_labels_gpu_and_startup_script(emu):
    p = make(emu)
    rec = Rec(emu)
    o = _t4(p)
    net = p.bootstrap("r-abc123", [o], "multi-node", rec)
    kinds = [(a, b) for a, b, _ in rec.log if a == "intent"]
    assert kinds == [("intent", "vpc"), ("intent", "subnet"), ("intent", "firewall"), ("intent", "firewall")]
    assert [x[0] for x in rec.log] == ["intent", "created"] * 4  # each create between its intent and created
    fw = {f["name"]: f for f in emu.live("firewalls")}
    internal = fw["broker-r-abc123-internal"]
    assert internal["sourceTags"] == internal["targetTags"] == [net["tag"]]
    assert {a["IPProtocol"] for a in internal["allowed"]} == {"tcp", "udp", "icmp"}
    assert fw["broker-r-abc123-ssh"]["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    assert emu.live("networks")[0]["autoCreateSubnetworks"] is False

    pid = p.create_instance(node_request(o, net))
    assert pid == f"{o.zone}:broker-r-abc123-n0"
    inst = emu.live("instances")[0]
    assert inst["guestAccelerators"] == [{"acceleratorType": f"zones/{o.zone}/acceleratorTypes/nvidia-tesla-t4",
                                          "acceleratorCount": 1}]
    assert inst["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert inst["labels"][RUN_TAG] == "r-abc123" and inst["labels"][INSTALL_TAG] == "bi0123456789"
    md = {i["key"]: i["value"] for i in inst["metadata"]["items"]}
    assert md["install-nvidia-driver"] == "True" and "broker-deadman" in md["startup-script"]
    assert md["ssh-keys"].startswith("broker:ssh-ed25519 ")
    assert inst["tags"]["items"] == [net["tag"]]
    assert "deeplearning-platform-release" in inst["disks"][0]["source"] or emu.live("disks")
    info = p.describe_instance(pid)
    for _ in range(3):
        info = p.describe_instance(pid)
    assert info.state == "running" and info.private_ip == "10.200.0.2" and info.public_ip == "203.0.113.10"

    tagged = p.list_tagged("r-abc123")
    assert sorted(t.kind for t in tagged) == ["firewall", "firewall", "instance", "subnet", "vpc"]
    assert all(t.installation_id == "bi0123456789" for t in tagged)
    assert next(t for t in tagged if t.kind == "instance").client_token == "res0abcdef"
    assert p.find_by_token("res0abcdef") == pid

    # teardown: network first fails while used (TransientError), the dependency order succeeds
    with pytest.raises(TransientError):
        p.terminate("vpc", net["network"])
    order = sorted(tagged, key=lambda t: p.delete_order.index(t.kind))
    for t in order:
        if t.kind == "instance":
            assert p.terminate("instance", t.provider_id) is False
            assert p.describe_instance(t.provider_id).state == "terminated"
            assert p.terminate("instance", t.provider_id) is True  # idempotent: gone is True
        else:
            assert p.terminate(t.kind, t.provider_id) is True
    assert {c: emu.live(c) for c in ("instances", "disks", "networks", "subnetworks", "firewalls")} == {
        c: [] for c in ("instances", "disks", "networks", "subnetworks", "firewalls")}
    assert p.list_tagged("r-abc123") == []


def test_stockout_in_the_operation_is_a_capacity_error(emu):
    p = make(emu)
    net = p.bootstrap("r-so", [_t4(p)], "multi-node", Rec())
    emu.stockout.add("us-central1-a")
    with pytest.raises(CapacityError) as ei:
        p.create_instance(node_request(_t4(p, "us-central1-a"), net, run_id="r-so"))
    assert "us-central1-a" in ei.value.message and ei.value.code == "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"
    assert ei.value.status is None  # a definite answer: never an ambiguous create
    assert p.create_instance(node_request(_t4(p, "us-central1-b"), net, run_id="r-so")).startswith("us-central1-b:")


def test_quota_exceeded_names_metric_and_region(emu):
    p = make(emu)
    net = p.bootstrap("r-q", [_t4(p)], "multi-node", Rec())
    emu.quota_exceeded["NVIDIA_T4_GPUS"] = "us-central1"
    with pytest.raises(QuotaError) as ei:
        p.create_instance(node_request(_t4(p), net, run_id="r-q"))
    e = ei.value
    assert e.limit_name == "NVIDIA_T4_GPUS" and e.limit == 0 and "us-central1" in e.message
    assert "broker quota request --provider gcp --limit NVIDIA_T4_GPUS" in e.hint
    emu.quota_exceeded = {"GPUS_ALL_REGIONS": "global"}
    with pytest.raises(QuotaError) as ei:
        p.create_instance(node_request(_t4(p), net, run_id="r-q"))
    assert ei.value.limit_name == "GPUS_ALL_REGIONS" and "no other region helps" in ei.value.hint


def test_5xx_on_insert_is_ambiguous_and_a_retry_with_the_same_request_id_makes_one_vm(emu):
    p = make(emu)
    net = p.bootstrap("r-amb", [_t4(p)], "multi-node", Rec())
    emu.fail[("POST", "instances")] = [503]
    with pytest.raises(AmbiguousCreate):
        p.create_instance(node_request(_t4(p), net, run_id="r-amb"))
    pid = p.create_instance(node_request(_t4(p), net, run_id="r-amb"))
    pid2 = p.create_instance(node_request(_t4(p), net, run_id="r-amb"))  # same row: same requestId
    assert pid == pid2 and len(emu.live("instances")) == 1


def test_5xx_and_429_on_delete_are_transient_then_the_delete_goes_through(emu):
    p = make(emu)
    net = p.bootstrap("r-del", [_t4(p)], "multi-node", Rec())
    pid = p.create_instance(node_request(_t4(p), net, run_id="r-del"))
    emu.fail[("DELETE", "instances")] = [503, 429]
    with pytest.raises(TransientError) as e1:
        p.terminate("instance", pid)
    assert e1.value.status == 503
    with pytest.raises(TransientError) as e2:
        p.terminate("instance", pid)
    assert e2.value.status == 429
    assert p.terminate("instance", pid) is False
    assert p.describe_instance(pid).state == "terminated"


def test_list_tagged_fails_loudly_on_an_unreadable_answer(emu):
    from broker.core.provider import ProviderError

    p = make(emu)
    emu.fail[("GET", "instances")] = [500] * 20
    with pytest.raises(ProviderError):
        p.list_tagged("r-x")


def test_provision_fails_over_a_stocked_out_zone_and_teardown_leaves_nothing(emu, tmp_ledger, tmp_path):
    """The core's ledger-first provisioning with the real adapter: zone a is out of stock, so the option in the
    next zone serves; the core's teardown then deletes instances, firewalls, subnet and network in order."""
    from broker.core.records import Run
    from broker.money.provision import provision
    from broker.money.teardown import teardown_run
    from broker.plan.planner import plan

    p = make(emu)
    emu.stockout.add("us-central1-a")
    r = req(2)
    offs = [o for o in p.offers(r) if o.instance_type == "n1-standard-4+t4"]
    opts = [o for o in plan(r, offs, now=utcnow()).options if o.valid and o.topology.value == "multi-node"]
    assert [o.offers[0].zone for o in opts][:1] == ["us-central1-a"], [o.offers[0].zone for o in opts]
    now = utcnow()
    run = tmp_ledger.create_run(Run(id="r-gcpunit", name="t", provider="gcp", topology="multi-node",
                                    status="provisioning", created_at=now, deadline=now + timedelta(hours=1),
                                    run_dir=str(tmp_path / "runs" / "r-gcpunit")))
    Path(run.run_dir).mkdir(parents=True)
    cluster = provision(opts, run, r, tmp_ledger, providers={"gcp": p}, poll_s=0.01, retry_wait_s=0.01,
                        terminate_timeout_s=5)
    assert len(cluster.nodes) == 2
    zones = {i["zone"].rsplit("/", 1)[-1] for i in emu.live("instances")}
    assert zones == {"us-central1-b"}, zones
    inserts = [(m, pth, st) for m, pth, st in emu.journal if m == "POST" and pth.endswith("/instances")]
    assert any("/zones/us-central1-a/" in pth for _, pth, _ in inserts)  # tried, stocked out, moved on
    kinds = sorted(x.kind for x in tmp_ledger.resources(run.id))
    assert kinds.count("instance") >= 2 and {"vpc", "subnet", "firewall"} <= set(kinds)
    assert teardown_run(tmp_ledger, run.id, "test", providers={"gcp": p}, poll_s=0.01) == []
    assert {c: emu.live(c) for c in ("instances", "disks", "networks", "subnetworks", "firewalls")} == {
        c: [] for c in ("instances", "disks", "networks", "subnetworks", "firewalls")}
    assert tmp_ledger.resources(run.id, live_only=True) == []


# ------------------------------------------------------------------------------------------------ quota requests
def _quota(name: str = "NVIDIA_T4_GPUS", region: str | None = "us-central1") -> Quota:
    return Quota(provider="gcp", name=name, region=region, scope=region, limit=0, used=0, unit="gpus",
                 instance_types=["n1-standard-4+t4"], source="test")


def test_quota_request_files_a_preference_and_does_not_duplicate_an_open_one(emu, monkeypatch):
    monkeypatch.setenv("GCP_QUOTA_CONTACT_EMAIL", "ops@example.com")
    p = make(emu)
    r1 = p.request_quota(_quota(), 2, "ddp test")
    assert r1.state == "PENDING" and r1.request_id.startswith(f"projects/{PROJECT}/locations/global/quotaPreferences/")
    pref = emu.objs["quotaPreferences"][r1.request_id]
    assert pref["quotaId"] == "NVIDIA-T4-GPUS-per-project-region" and pref["dimensions"] == {"region": "us-central1"}
    assert pref["quotaConfig"]["preferredValue"] == "2" and pref["service"] == "compute.googleapis.com"
    r2 = p.request_quota(_quota(), 2, "ddp test")
    assert r2.request_id == r1.request_id and "not filed again" in r2.message
    assert len(emu.objs["quotaPreferences"]) == 1
    emu.decide(r1.request_id, 2)
    assert p.quota_request_status(r1).state == "APPROVED"
    g = p.request_quota(_quota("GPUS_ALL_REGIONS", None), 2, "ddp")
    assert emu.objs["quotaPreferences"][g.request_id]["quotaId"] == "GPUS-ALL-REGIONS-per-project"
    emu.decide(g.request_id, 0)
    assert p.quota_request_status(g).state == "DENIED"


def test_quota_request_without_credentials_is_a_draft_with_the_console_link(monkeypatch, tmp_path):
    from broker.providers.gcp import GCPProvider

    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "myproj")
    r = GCPProvider().request_quota(_quota("GPUS_ALL_REGIONS", None), 1, "ddp")
    assert r.state == "DRAFT" and r.form["quotaId"] == "GPUS-ALL-REGIONS-per-project"
    assert r.form["console"] == "https://console.cloud.google.com/iam-admin/quotas?project=myproj"
    assert "--quota-id=GPUS-ALL-REGIONS-per-project --preferred-value=1" in r.form["gcloud"]


def test_quota_request_needs_a_contact_email(emu, monkeypatch):
    from broker.core.provider import BadInput

    monkeypatch.delenv("GCP_QUOTA_CONTACT_EMAIL", raising=False)
    with pytest.raises(BadInput, match="contact email"):
        make(emu).request_quota(_quota(), 2, "x")


# ------------------------------------------------------------------------------------------------ live prices
def test_live_prices_from_the_billing_catalog_follow_pages(emu):
    p = make(emu)
    prices = p.live_prices(["n1-standard-4+t4", "n1-standard-16+4xt4",
                            "n1-standard-8+v100", "g2-standard-4"])
    assert prices["n1-standard-4+t4"] == pytest.approx(0.539999 - 0.35 + 0.30)
    assert prices["n1-standard-16+4xt4"] == pytest.approx(2.16 - 4 * 0.35 + 4 * 0.30)
    assert prices["n1-standard-8+v100"] == pytest.approx(2.86 - 2.48 + 2.40)  # on the 2nd page
    assert "g2-standard-4" not in prices
    assert any("pageToken=1" in path or m == "GET" for m, path, _ in emu.journal)


# ------------------------------------------------------------------------------------------------ CLI
def _env(emu: GCPEmulator, tmp_path: Path) -> dict[str, str]:
    from tests.conftest import REPO

    adc = tmp_path / "gcloud"
    adc.mkdir(exist_ok=True)
    (adc / "application_default_credentials.json").write_text(json.dumps(
        {"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "t"}))
    env = dict(os.environ, PYTHONPATH=str(REPO), CLOUDSDK_CONFIG=str(adc), GOOGLE_CLOUD_PROJECT=PROJECT,
               GCP_COMPUTE_ENDPOINT=emu.url, GCP_QUOTAS_ENDPOINT=emu.url, BROKER_HOME=str(tmp_path / "home"),
               GCP_QUOTA_CONTACT_EMAIL="ops@example.com")
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    return env


def test_broker_quota_check_request_status_against_the_emulator(emu, tmp_path, monkeypatch):
    """The CLI end to end in a subprocess that finds an ADC file; the plain-http emulator endpoints get no token
    (the adapter sends credentials only over https)."""
    from tests.conftest import broker_cmd

    env = _env(emu, tmp_path)
    emu.region_quotas["us-central1"]["NVIDIA_T4_GPUS"] = 0
    p = subprocess.run(broker_cmd("quota", "check", "--provider", "gcp", "--nodes", "2", "--json"), env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)["providers"][0]
    names = {q["name"] for q in out["quotas"]}
    assert {"NVIDIA_T4_GPUS", "GPUS_ALL_REGIONS"} <= names, out
    t4 = next(v for v in out["verdicts"] if v["limit"] == "NVIDIA_T4_GPUS")
    assert not t4["ok"] and "broker quota request --provider gcp --limit NVIDIA_T4_GPUS --value 2" in t4["next_step"]
    p = subprocess.run(broker_cmd("quota", "request", "--provider", "gcp", "--limit", "NVIDIA_T4_GPUS",
                                  "--region", "us-central1", "--nodes", "2", "--instance-type",
                                  "n1-standard-4+t4"), env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "state PENDING" in p.stdout and len(emu.objs["quotaPreferences"]) == 1
    name = next(iter(emu.objs["quotaPreferences"]))
    emu.decide(name, 2)
    p = subprocess.run(broker_cmd("quota", "status", "--provider", "gcp", "--json"), env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout)["requests"]
    assert rows[0]["state"] == "APPROVED", rows


# ------------------------------------------------------------------------------------------------ hybrid, slurm
def test_open_ingress_adds_one_firewall_rule_per_port_to_the_run_tag(emu):
    from broker.core.records import Ingress

    p = make(emu)
    rec = Rec()
    net = p.bootstrap("r-hyb", [_t4(p)], "hybrid", rec)
    rules = [Ingress(protocol="udp", port=51821, cidr="198.51.100.7/32", description="wireguard")]
    p.open_ingress(net, rules, rec)
    p.open_ingress(net, rules, rec)  # idempotent: the existing rule counts as done
    fw = next(f for f in emu.live("firewalls") if f["allowed"][0]["IPProtocol"] == "udp")
    assert fw["sourceRanges"] == ["198.51.100.7/32"] and fw["targetTags"] == [net["tag"]]
    assert fw["allowed"] == [{"IPProtocol": "udp", "ports": ["51821"]}]
    assert len(emu.live("firewalls")) == 3
    assert any(k == "event" and "51821" in m for k, _, m in rec.log)


def test_gcp_hosts_hybrid_runs_and_slurm_clusters_through_its_capabilities(emu, tmp_path, monkeypatch):
    """No core file names gcp: the hybrid hosts and slurm up's node providers are derived from capabilities, and
    slurm up's target on gcp is the CloudTarget over its multi-node options."""
    from broker.run import hybrid
    from broker.run.pipeline import CloudTarget
    from broker.slurm import cluster

    from broker.run.pipeline import RUN_PROVIDERS

    assert "gcp" in hybrid.TUN_PROVIDERS and "gcp" in cluster.UP_PROVIDERS and "gcp" in RUN_PROVIDERS
    env = _env(emu, tmp_path)
    for k in ("CLOUDSDK_CONFIG", "GOOGLE_CLOUD_PROJECT", "GCP_COMPUTE_ENDPOINT", "GCP_QUOTAS_ENDPOINT"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    opts = cluster.UpOptions(provider="gcp", nodes=2, cpu_only=False, budget_usd=5, max_hours=1)
    recipe = cluster.cluster_recipe("c1", 2, max_hours=1, budget_usd=5, gpus_per_node=1, cpu_ok=False)
    target = cluster._target(opts, recipe)
    assert isinstance(target, CloudTarget)
    assert {o.provider for o in target.options} == {"gcp"}
    assert all(o.topology.value == "multi-node" for o in target.options)


def test_broker_check_and_catalog_refresh_from_the_billing_catalog(emu, tmp_path):
    """``broker check`` names the ADC file and the project's source; ``broker catalog refresh --provider gcp``
    writes a dated snapshot with live GPU prices, which then plans with the zones still known."""
    from tests.conftest import broker_cmd

    env = _env(emu, tmp_path)
    env["GCP_BILLING_ENDPOINT"] = emu.url
    p = subprocess.run(broker_cmd("check", "--provider", "gcp", "--json"), env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "application default credentials" in p.stdout and "GOOGLE_CLOUD_PROJECT" in p.stdout, p.stdout
    assert '"s"' not in p.stdout and "refresh_token" not in p.stdout  # no secret of the ADC file
    p = subprocess.run(broker_cmd("catalog", "refresh", "--provider", "gcp"), env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    snap = Path(env["BROKER_HOME"]) / "catalog" / "gcp.csv"
    text = snap.read_text()
    assert "n1-standard-4+t4" in text and "0.489999" in text, text[:3000]
    p = subprocess.run(broker_cmd("plan", "--provider", "gcp", "--budget", "5", "--json"), env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "us-central1-b" in p.stdout  # zones survive a refresh (the adapter's table)


def test_a_plain_http_endpoint_elsewhere_is_refused(monkeypatch):
    from broker.core.provider import BadInput
    from broker.providers.gcp import GCPProvider

    monkeypatch.setenv("GCP_COMPUTE_ENDPOINT", "http://198.51.100.9:8080")
    with pytest.raises(BadInput, match="GCP_COMPUTE_ENDPOINT"):
        GCPProvider()
    monkeypatch.setenv("GCP_COMPUTE_ENDPOINT", "http://127.0.0.1:9")
    assert GCPProvider().api.compute_endpoint == "http://127.0.0.1:9"


def test_broker_plan_offline_shows_gcp_options_and_rejections_without_importing_the_sdks(tmp_path):
    import sys

    from tests.conftest import REPO

    code = ("import sys\nsys.argv = ['broker', 'plan', '--budget', '5', '--wide']\nfrom broker.cli.app import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('SDK=' + ','.join(sorted(m for m in sys.modules if m.startswith(('google.auth', 'google.cloud',"
            " 'google.api_core')))))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "GCP_", "CLOUDSDK"))}
    env.update(PYTHONPATH=str(REPO), CLOUDSDK_CONFIG=str(tmp_path / "nogcloud"), BROKER_HOME=str(tmp_path / "h"),
               COLUMNS="200")
    cp = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                        env=env)
    out = cp.stdout
    assert "SDK=\n" in out or out.rstrip().endswith("SDK="), out[-500:]
    assert "gcp" in out and "n1-standard-4+t4" in out, out[-3000:]
    assert "gcp simulated" in out or "gcp " in out


def test_provision_skips_what_an_exhausted_gpu_quota_covers_and_serves_another_gpu(emu, tmp_ledger, tmp_path):
    """QUOTA_EXCEEDED on NVIDIA_T4_GPUS skips every T4 option of the region (not the L4 ones), with the ready
    `broker quota request` command in the progress."""
    from broker.core.records import Run
    from broker.money.provision import provision
    from broker.money.teardown import teardown_run
    from broker.plan.planner import plan

    p = make(emu)
    emu.quota_exceeded["NVIDIA_T4_GPUS"] = "us-central1"
    r = req(2)
    offs = [o for o in p.offers(r) if o.instance_type in ("n1-standard-4+t4", "g2-standard-4")]
    opts = [o for o in plan(r, offs, now=utcnow()).options if o.valid and o.topology.value == "multi-node"]
    assert opts[0].offers[0].instance_type == "n1-standard-4+t4"
    now = utcnow()
    run = tmp_ledger.create_run(Run(id="r-gcpq", name="t", provider="gcp", topology="multi-node",
                                    status="provisioning", created_at=now, deadline=now + timedelta(hours=1),
                                    run_dir=str(tmp_path / "runs" / "r-gcpq")))
    Path(run.run_dir).mkdir(parents=True)
    said: list[str] = []
    cluster = provision(opts, run, r, tmp_ledger, providers={"gcp": p}, poll_s=0.01, retry_wait_s=0.01,
                        terminate_timeout_s=5, progress=said.append)
    assert {i["machineType"].rsplit("/", 1)[-1] for i in emu.live("instances")} == {"g2-standard-4"}
    assert len(cluster.nodes) == 2
    t4_inserts = [pth for m, pth, st in emu.journal if m == "POST" and pth.endswith("/instances") and st == 403]
    assert len(t4_inserts) == 1, t4_inserts  # one refusal, then the other T4 zones are skipped
    text = "\n".join(str(s) for s in said)
    assert "NVIDIA_T4_GPUS" in text and "us-central1" in text, text[-3000:]
    assert teardown_run(tmp_ledger, run.id, "test", providers={"gcp": p}, poll_s=0.01) == []
    assert {c: emu.live(c) for c in COLLS} == {c: [] for c in COLLS}


COLLS = ("instances", "disks", "networks", "subnetworks", "firewalls")


def test_status_counts_the_gcp_node_switch_as_a_teardown_layer():
    from broker.core.records import Resource
    from broker.money.accounting import node_layer

    res = Resource(id="res1", run_id="r1", provider="gcp", kind="instance", name="n0",
                   deadline=utcnow() + timedelta(hours=1))
    assert node_layer(res) == "self-delete with the VM's service account at deadline + grace (else power off)"
    assert node_layer(res.model_copy(update={"deadline": None})) is None
    assert node_layer(res.model_copy(update={"provider": "netns"})) is None
