"""Vast.ai adapter at its real boundary (httpx + respx): request bodies asserted, responses shaped like the API's.

Fixture fields and units follow docs/reference/cloud-apis.md section A (offers: gpu_ram MB, cpu_ram MB,
dph_total $/h incl. storage, storage_cost $/GB/month; instances: actual_status, ports, ssh_host/ssh_port ...).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone

import httpx
import pytest
import re

import respx

from broker.core.model import Offer, Requirements
from broker.core.provider import AuthError, BadInput, OfferGone, ProviderError, TransientError
from broker.core.records import NodeRequest

URL = "https://console.vast.ai"
KEY = "vk-test-0123456789abcdef"
#: The label create_body writes for node_request(): run, node, installation id, client token (the ledger row id).
LABEL = "broker-run:r1a2b3:n0/bi0123456789/res-1"


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    """Isolated HOME/XDG/.env/broker home; no Vast settings from the outside world."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "broker"))
    for var in ("VAST_API_KEY", "VAST_API_URL", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # no stray .env
    from broker.core.config import settings

    settings.cache_clear()
    yield home
    settings.cache_clear()


def make_provider(**kw):
    from broker.providers.vast import VastProvider

    sleeps: list[float] = []
    kw.setdefault("api_key", KEY)
    p = VastProvider(sleep=sleeps.append, **kw)
    p.sleeps = sleeps  # type: ignore[attr-defined]
    return p


def offer_row(**over):
    """One /bundles/ offer row as Vast returns it (subset of real fields, real units)."""
    row = {
        "id": 29981234, "ask_contract_id": 29981234, "bundle_id": 771, "machine_id": 41122, "host_id": 90210,
        "num_gpus": 2, "gpu_name": "RTX 4090", "gpu_ram": 24564, "gpu_total_ram": 49128,
        "cpu_cores": 32, "cpu_cores_effective": 16.0, "cpu_ram": 64308, "disk_space": 200.5,
        "dph_total": 0.7421, "dph_base": 0.71, "storage_cost": 0.15, "inet_up": 812.3, "inet_down": 904.1,
        "inet_up_cost": 0.005, "inet_down_cost": 0.004, "reliability": 0.9953, "reliability2": 0.9953,
        "geolocation": "Oregon, US", "cuda_max_good": 12.4, "driver_version": "550.54.14",
        "verification": "verified", "vericode": 1, "direct_port_count": 100, "rentable": True, "rented": False,
        "external": False, "duration": 2_592_000.0, "public_ipaddr": "203.0.113.7", "score": 210.3,
    }
    row.update(over)
    return row


def instance_row(**over):
    row = {
        "id": 456, "machine_id": 41122, "host_id": 90210, "actual_status": "running", "intended_status": "running",
        "cur_state": "running", "next_state": "running", "status_msg": "success, running pytorch/pytorch_2.5.1",
        "ssh_host": "ssh5.vast.ai", "ssh_port": 31456, "ssh_idx": "5", "public_ipaddr": "203.0.113.7",
        "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": "40022"}]}, "local_ipaddrs": "10.0.0.5 172.17.0.1",
        "dph_total": 0.7421, "num_gpus": 2, "gpu_name": "RTX 4090", "gpu_ram": 24564, "cpu_ram": 64308,
        "disk_space": 40.0, "label": "broker-run:r1a2b3:n0", "start_date": 1764460800.0, "geolocation": "Oregon, US",
        "extra_env": [["BROKER_RUN_ID", "r1a2b3"]], "image_runtype": "ssh_direc ssh_proxy",
    }
    row.update(over)
    return row


def a_offer(**over) -> Offer:
    from broker.providers.vast import offer_from_row

    o = offer_from_row(offer_row(**over))
    assert o is not None
    return o


def node_request(**over) -> NodeRequest:
    base = dict(run_id="r1a2b3", node_index=0, name="broker-r1a2b3-n0", offer=a_offer(),
                ssh_public_key="ssh-ed25519 AAAAC3NzaTESTKEY broker-r1a2b3", client_token="res-1", disk_gib=40.0,
                installation_id="bi0123456789",
                deadline=datetime(2026, 11, 30, 3, 0, tzinfo=timezone.utc), grace_seconds=300.0)
    base.update(over)
    return NodeRequest(**base)


# --------------------------------------------------------------------------------------------------- key lookup
def test_key_lookup_order(env, monkeypatch, tmp_path):
    from broker.providers.vast import find_api_key
    from broker.core.config import settings

    assert find_api_key()[0] is None
    legacy = env / ".vast_api_key"
    legacy.write_text("legacy-key\n")
    assert find_api_key() == ("legacy-key", str(legacy))
    xdg_default = env / ".config" / "vastai" / "vast_api_key"
    xdg_default.parent.mkdir(parents=True)
    xdg_default.write_text("xdg-default-key")
    assert find_api_key()[0] == "xdg-default-key"
    xdg = tmp_path / "xdg"
    (xdg / "vastai").mkdir(parents=True)
    (xdg / "vastai" / "vast_api_key").write_text(" xdg-key \n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    assert find_api_key() == ("xdg-key", str(xdg / "vastai" / "vast_api_key"))
    (tmp_path / ".env").write_text("VAST_API_KEY=dotenv-key\n")
    settings.cache_clear()
    assert find_api_key() == ("dotenv-key", "VAST_API_KEY (.env)")
    monkeypatch.setenv("VAST_API_KEY", "env-key")
    assert find_api_key() == ("env-key", "VAST_API_KEY")
    assert find_api_key("explicit-key") == ("explicit-key", "the api_key argument")


def test_api_url_override(monkeypatch):
    from broker.providers.vast import VastProvider

    assert VastProvider().api_url == URL
    monkeypatch.setenv("VAST_API_URL", "http://127.0.0.1:9/")
    assert VastProvider().api_url == "http://127.0.0.1:9"


# --------------------------------------------------------------------------------------------------- check
def test_check_offline_makes_no_call(env):
    from broker.providers.vast import VastProvider

    with respx.mock(assert_all_mocked=True) as mock:
        c = VastProvider().check()
        assert not c.configured and c.usable is None and "VAST_API_KEY" in (c.hint or "")
        (env / ".vast_api_key").write_text(KEY)
        c = VastProvider().check()
        assert c.configured and c.usable is None
        assert KEY not in repr(c)
        assert mock.calls.call_count == 0


def test_check_online_shows_credit_not_key():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        route = mock.get("/api/v0/users/current").respond(
            json={"id": 7, "email": "u@example.org", "credit": 12.345, "balance": 0.0, "can_pay": True})
        c = p.check(online=True)
    assert c.usable is True and "credit $12.35" in c.detail
    assert route.calls.last.request.headers["Authorization"] == f"Bearer {KEY}"
    assert KEY not in repr(c)
    with respx.mock(base_url=URL) as mock:
        mock.get("/api/v0/users/current").respond(401, json={"detail": "Invalid API key"})
        c = make_provider().check(online=True)
    assert c.configured and c.usable is False and "Vast.ai" in c.detail


# --------------------------------------------------------------------------------------------------- offers
def test_search_query_body_and_mapping():
    p = make_provider()
    req = Requirements(nodes=2, gpus_per_node=1, gpu_names=["RTX_4090", "H100"], min_gpu_mem_gib=16, hours=2,
                       disk_gib=60)
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        route = mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row(), offer_row(
            id=300, num_gpus=4, gpu_name="H100 SXM", gpu_ram=81559, dph_total=8.53, geolocation="Texas, US")]})
        offers = p.offers(req)
    sent = json.loads(route.calls.last.request.content)
    assert sent == {
        "num_gpus": {"gte": 2}, "gpu_ram": {"gte": 16056}, "reliability": {"gte": 0.98},  # 16 GiB less 2 %
        "inet_up": {"gte": 100.0}, "inet_down": {"gte": 100.0}, "cuda_max_good": {"gte": 12.1},
        "direct_port_count": {"gte": 1}, "disk_space": {"gte": 60.0}, "verified": {"eq": True},
        "rentable": {"eq": True},
        "rented": {"eq": False}, "external": {"eq": False},
        "gpu_name": {"in": ["RTX 4090", "H100", "H100 SXM", "H100 PCIE", "H100 NVL"]},
        "duration": {"gte": 7200}, "order": [["dph_total", "asc"]], "type": "on-demand", "limit": 64,
        "allocated_storage": 60.0,
    }
    assert route.calls.last.request.headers["Authorization"] == f"Bearer {KEY}"
    o = offers[0]
    assert (o.provider, o.offer_id, o.instance_type, o.gpu_name, o.gpu_count) == (
        "vast", "29981234", "2x RTX 4090", "RTX 4090", 2)
    assert o.gpu_mem_gib == pytest.approx(24564 / 1024, abs=0.01)  # MB -> GiB
    assert o.ram_gib == pytest.approx(64308 / 1024, abs=0.01)
    # dph_total already includes the searched disk: storage is not priced a second time
    assert o.vcpus == 16.0 and o.usd_per_hour == 0.7421 and o.storage_usd_per_gib_month == 0.0
    assert o.attrs["dph_includes_storage"] is True and o.attrs["storage_cost"] == 0.15
    assert o.region == "Oregon, US" and o.private_network is False and o.min_billed_seconds <= 60
    assert o.price_source.startswith("live Vast.ai /api/v0/bundles/")
    assert o.attrs["machine_id"] == 41122 and o.attrs["host_id"] == 90210 and o.attrs["reliability"] == 0.9953
    assert o.attrs["inet_up"] == 812.3 and o.attrs["inet_down_cost"] == 0.004 and o.attrs["cuda_max_good"] == 12.4
    assert o.attrs["verification"] == "verified" and o.attrs["direct_port_count"] == 100
    assert offers[1].instance_type == "4x H100 SXM" and offers[1].gpu_mem_gib == pytest.approx(79.65, abs=0.01)
    assert p.price_note().startswith("vast: live offers")


def test_native_query_merged_with_numbers():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        route = mock.post("/api/v0/bundles/").respond(json={"offers": []})
        assert p.offers(Requirements(), vast_query="reliability>0.95 inet_up>=200 "
                                                   "gpu_name in [RTX_4090,RTX_3090] gpu_ram>=24 dph<1.5 "
                                                   "geolocation=US") == []
    sent = json.loads(route.calls.last.request.content)
    assert sent["reliability"] == {"gt": 0.95}  # replaces the default gte 0.98
    assert sent["inet_up"] == {"gte": 200} and sent["inet_down"] == {"gte": 100.0}
    assert sent["gpu_name"] == {"in": ["RTX 4090", "RTX 3090"]}
    assert sent["gpu_ram"] == {"gte": 24000} and sent["dph_total"] == {"lt": 1.5}
    assert sent["geolocation"] == {"eq": "US"} and sent["verified"] == {"eq": True}
    with pytest.raises(BadInput, match="vast query"):
        p.search_query(Requirements(), vast_query="reliability ~ 3")


@pytest.mark.parametrize("q", ["reliability>0.98 inet_up>=200", "gpu_name in [RTX_4090,A100_SXM4] num_gpus=2",
                               "cuda_vers>=12.4 dph<=0.9 verified=false geolocation notin [CN,RU]",
                               "gpu_ram>=40 cpu_ram>64 duration>3 gpu_name=any"])
def test_fallback_parser_matches_vastai(q):
    """Our re-implementation gives what vastai's parse_query gives (when the `vast` extra is installed)."""
    vq = pytest.importorskip("vastai.api.query")
    from broker.providers.vast import _parse_query_fallback

    assert _parse_query_fallback(q) == vq.parse_query(q, {}, vq.offers_fields, vq.offers_alias, vq.offers_mult)


def test_fallback_parser_grammar():
    from broker.providers.vast import _parse_query_fallback, parse_vast_query

    assert _parse_query_fallback("gpu_name in [RTX_4090,RTX_3090] cuda_vers>=12.4 gpu_ram>=24 rentable=true") == {
        "gpu_name": {"in": ["RTX 4090", "RTX 3090"]}, "cuda_max_good": {"gte": "12.4"}, "gpu_ram": {"gte": 24000.0},
        "rentable": {"eq": True}}
    assert parse_vast_query("num_gpus>=2 cuda_vers>=12.4 geolocation=US") == {
        "num_gpus": {"gte": 2}, "cuda_max_good": {"gte": 12.4}, "geolocation": {"eq": "US"}}


def test_snapshot_fallback_without_key(monkeypatch):
    from broker.providers.vast import VastProvider

    p = VastProvider()
    with respx.mock(assert_all_mocked=True) as mock:
        monkeypatch.setitem(sys.modules, "broker.plan.catalog", None)  # module absent -> []
        assert p.offers(Requirements()) == []
        snap = replace(a_offer(), price_source="snapshot 2026-11-29",
                       price_time=datetime(2026, 11, 29, tzinfo=timezone.utc))
        fake = type(sys)("broker.plan.catalog")
        calls = []
        fake.snapshot_offers = lambda prov, req: calls.append((prov, req)) or [snap]  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "broker.plan.catalog", fake)
        assert p.offers(Requirements()) == [snap]
        assert calls[0][0] == "vast" and mock.calls.call_count == 0
    assert p.price_note() == "vast: snapshot 2026-11-29; live quote needs VAST_API_KEY"


def test_multi_node_gets_no_vast_offers():
    with respx.mock(assert_all_mocked=True):
        assert make_provider().offers(Requirements(topology="multi-node")) == []


# --------------------------------------------------------------------------------------------------- errors, retries
def test_429_then_success_honours_retry_after():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        route = mock.post("/api/v0/bundles/")
        route.side_effect = [httpx.Response(429, headers={"Retry-After": "1.5"},
                                            json={"detail": "API requests too frequent endpoint threshold=5"}),
                             httpx.Response(200, json={"offers": [offer_row()]})]
        offers = p.offers(Requirements())
    assert len(offers) == 1 and route.call_count == 2 and p.sleeps == [1.5]


def test_5xx_exhausted_is_transient_and_search_quota_not_retried():
    p = make_provider(max_attempts=3, backoff_s=0.25)
    with respx.mock(base_url=URL) as mock:
        route = mock.post("/api/v0/bundles/").respond(503, text="upstream down")
        with pytest.raises(TransientError, match="HTTP 503") as ei:
            p.live_offers(Requirements())
    assert route.call_count == 3 and p.sleeps == [0.25, 0.5] and ei.value.exit_code == 4
    p = make_provider()
    with respx.mock(base_url=URL) as mock:
        route = mock.post("/api/v0/bundles/").respond(429, json={"error": "search_quota_exceeded",
                                                                 "msg": "daily search quota exceeded"})
        with pytest.raises(ProviderError) as ei:
            p.live_offers(Requirements())
    assert route.call_count == 1 and p.sleeps == [] and ei.value.code == "search_quota_exceeded"
    assert not isinstance(ei.value, TransientError) and "UTC" in (ei.value.hint or "")


def test_401_is_auth_error_without_the_key():
    p = make_provider()
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(401, json={"detail": f"invalid api key {KEY}"})  # even if echoed
        with pytest.raises(AuthError) as ei:
            p.offers(Requirements())
    text = str(ei.value)
    assert "Vast.ai" in text and "search offers" in text and "VAST_API_KEY" in text
    assert KEY not in text and KEY not in repr(ei.value.args)


def test_transport_error_is_transient_without_key():
    p = make_provider(max_attempts=2)
    with respx.mock(base_url=URL) as mock:
        mock.get("/api/v0/instances/9/").mock(side_effect=httpx.ConnectError("connection refused"))
        with pytest.raises(TransientError, match="cannot reach Vast.ai") as ei:
            p.describe_instance("9")
    assert KEY not in str(ei.value) and len(p.sleeps) == 1


# --------------------------------------------------------------------------------------------------- create
def test_create_requotes_then_rents_with_the_right_body():
    p = make_provider()
    req = node_request(onstart="echo user-setup", image=None)
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        search = mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row(dph_total=0.75)]})
        put = mock.put("/api/v0/asks/29981234/").respond(json={"success": True, "new_contract": 456})
        mock.get("/api/v0/instances/456/", params={"owner": "me"}).respond(json={"instances": instance_row(
            actual_status=None, label=LABEL)})  # read back: its disk is checked
        assert p.create_instance(req) == "456"
    q = json.loads(search.calls.last.request.content)
    assert q["id"] == {"eq": 29981234} and q["rented"] == {"eq": False} and q["allocated_storage"] == 40.0
    body = json.loads(put.calls.last.request.content)
    assert body["client_id"] == "me" and body["image"] == "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
    assert body["disk"] == 40.0 and body["runtype"] == "ssh_direc ssh_proxy" and body["cancel_unavail"] is True
    assert body["target_state"] == "running" and body["label"] == LABEL
    assert body["env"] == {"BROKER_RUN_ID": "r1a2b3", "BROKER_NODE_INDEX": "0"}
    on = body["onstart"]
    assert len(on) <= 4048
    dms, key, user = on.index("dead-man switch"), on.index("AAAAC3NzaTESTKEY"), on.index("echo user-setup")
    assert dms < key < user  # armed before anything of the user's runs
    assert "/api/v0/instances/$id/" in on and "https://console.vast.ai" in on
    assert put.calls.last.request.headers["Authorization"] == f"Bearer {KEY}"


def test_offer_rented_between_search_and_create():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=False) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": []})  # re-quote: gone
        put = mock.put("/api/v0/asks/29981234/")
        put.respond(json={"success": True, "new_contract": 1})  # must never be reached
        with pytest.raises(OfferGone, match="no longer rentable"):
            p.create_instance(node_request())
        assert put.call_count == 0
    # re-quote still lists it, but someone rents it first: the PUT answers no_such_ask
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        mock.put("/api/v0/asks/29981234/").respond(400, json={
            "success": False, "error": "no_such_ask", "msg": "Instance type no longer available."})
        with pytest.raises(OfferGone, match="taken before it could be rented"):
            p.create_instance(node_request())


def test_price_rise_over_tolerance_is_offer_gone():
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row(dph_total=0.90)]})
        with pytest.raises(OfferGone, match=r"\+21% > 10%"):
            make_provider().create_instance(node_request())


def test_create_402_says_add_credit_and_401_auth():
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        mock.put("/api/v0/asks/29981234/").respond(402, json={"success": False, "error": "insufficient_credit",
                                                               "msg": "Your credit balance is too low"})
        with pytest.raises(ProviderError) as ei:
            make_provider().create_instance(node_request())
    assert not isinstance(ei.value, OfferGone) and "billing" in (ei.value.hint or "")
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(403, json={"detail": "forbidden"})
        with pytest.raises(AuthError, match="Vast.ai rejected the API key"):
            make_provider().create_instance(node_request())


def test_create_5xx_finds_the_instance_by_label_instead_of_renting_twice():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        put = mock.put("/api/v0/asks/29981234/").respond(502, text="Bad Gateway")
        mock.get("/api/v1/instances/").respond(json={"instances": [
            instance_row(id=455, label="broker-run:other:n0"), instance_row(id=454, label="broker-run:r1a2b3:n0"),
            instance_row(id=456, actual_status="loading", label=LABEL)],
            "next_token": None, "total_instances": 2})
        assert p.create_instance(node_request()) == "456"
    assert put.call_count == 1  # never re-sent


def test_onstart_size_handling(tmp_path):
    from broker.providers.vast import fit_onstart

    small = "echo hi\n"
    assert fit_onstart(small) == small
    out = tmp_path / "out.txt"
    big = f"echo decoded-ok > {out}\n" + "# padding line for a long setup script\n" * 300
    assert len(big) > 4048
    loader = fit_onstart(big, workdir=str(tmp_path / "w"))
    assert len(loader) <= 4048 and "base64 -d | gunzip" in loader
    subprocess.run(["bash", "-c", loader], check=True, timeout=30)
    assert out.read_text() == "decoded-ok\n" and (tmp_path / "w" / "onstart.sh").read_text() == big
    noise = os.urandom(6000).hex()  # incompressible
    with pytest.raises(BadInput, match="4048"):
        fit_onstart(f"# {noise}\n")
    with respx.mock(base_url=URL, assert_all_called=True) as mock:  # create_body uses the loader for a big onstart
        body = make_provider().create_body(node_request(onstart="echo setup\n" * 600))
        assert body["onstart"].startswith("mkdir -p /root/.broker && echo '") and len(body["onstart"]) <= 4048
        assert mock.calls.call_count == 0


# --------------------------------------------------------------------------------------------------- describe
def test_describe_states_and_ssh_endpoint():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        route = mock.get("/api/v0/instances/456/", params={"owner": "me"})
        route.side_effect = [
            httpx.Response(200, json={"instances": instance_row()}),
            httpx.Response(200, json={"instances": instance_row(ports={}, actual_status="running")}),
            httpx.Response(200, json={"instances": instance_row(actual_status="exited",
                                                                status_msg="Error: OCI runtime create failed")}),
            httpx.Response(200, json={"instances": instance_row(actual_status="stopped")}),
            httpx.Response(200, json={"instances": None}),
            httpx.Response(404, json={"error": "no_such_instance"}),
        ]
        i = p.describe_instance("456")
        assert (i.state, i.ssh_host, i.ssh_port, i.public_ip, i.private_ip) == (
            "running", "203.0.113.7", 40022, "203.0.113.7", "127.0.0.1")
        assert i.usd_per_hour == 0.7421
        i = p.describe_instance("456")
        assert (i.ssh_host, i.ssh_port) == ("ssh5.vast.ai", 31456)  # no direct port -> proxy
        i = p.describe_instance("456")
        assert i.state == "failed" and i.raw_state == "exited" and "OCI runtime" in (i.message or "")
        assert p.describe_instance("456").state == "stopped"
        assert p.describe_instance("456").state == "terminated"
        assert p.describe_instance("456").state == "terminated"


def test_instance_stuck_in_loading_stays_pending():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        route = mock.get("/api/v0/instances/456/", params={"owner": "me"}).respond(json={"instances": instance_row(
            actual_status="loading", status_msg="Pulling image layers 37%", ports={}, public_ipaddr=None,
            ssh_host=None, ssh_port=None)})
        states = [p.describe_instance("456") for _ in range(5)]
    assert route.call_count == 5 and {s.state for s in states} == {"pending"}
    assert states[0].raw_state == "loading" and states[0].ssh_host is None and "Pulling" in states[0].message
    for raw, want in ((None, "pending"), ("created", "pending"), ("offline", "failed"), ("unknown", "failed"),
                      ("frozen", "failed")):
        from broker.providers.vast import instance_info

        assert instance_info("1", instance_row(actual_status=raw)).state == want


# --------------------------------------------------------------------------------------------------- terminate
def test_terminate_idempotent():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        d = mock.delete("/api/v0/instances/456/").respond(json={"success": True})
        mock.get("/api/v0/instances/456/", params={"owner": "me"}).respond(json={"instances": None})
        assert p.terminate("instance", "456") is True
        assert json.loads(d.calls.last.request.content) == {}
    with respx.mock(base_url=URL, assert_all_called=True) as mock:  # already gone
        mock.delete("/api/v0/instances/456/").respond(404, json={"error": "no_such_instance"})
        mock.get("/api/v0/instances/456/", params={"owner": "me"}).respond(404, json={"error": "not found"})
        assert p.terminate("instance", "456") is True
    with respx.mock(base_url=URL, assert_all_called=True) as mock:  # accepted, not yet gone
        mock.delete("/api/v0/instances/456/").respond(json={"success": True})
        mock.get("/api/v0/instances/456/", params={"owner": "me"}).respond(
            json={"instances": instance_row(intended_status="stopped")})
        assert p.terminate("instance", "456") is False
    with respx.mock(base_url=URL) as mock:
        mock.delete("/api/v0/instances/456/").respond(500, text="oops")
        with pytest.raises(TransientError):
            make_provider(max_attempts=1).terminate("instance", "456")


# --------------------------------------------------------------------------------------------------- list_tagged
def test_list_tagged_paginates_and_parses_labels():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        route = mock.get("/api/v1/instances/")
        route.side_effect = [
            httpx.Response(200, json={"instances": [instance_row(id=1, label="broker-run:r1a2b3:n0"),
                                                    instance_row(id=2, label="my notebook")],
                                      "next_token": "tok-2", "total_instances": 4}),
            httpx.Response(200, json={"instances": [instance_row(id=3, label="broker-run:r9:n1", dph_total=1.2),
                                                    instance_row(id=4, label=None)],
                                      "next_token": None, "total_instances": 4}),
        ]
        tagged = p.list_tagged()
    first, second = route.calls[0].request.url.params, route.calls[1].request.url.params
    assert json.loads(first["select_filters"]) == {} and json.loads(first["order_by"]) == [{"col": "id", "dir": "asc"}]
    assert first["limit"] == "25" and "after_token" not in first and second["after_token"] == "tok-2"
    assert [(t.provider_id, t.run_id, t.name) for t in tagged] == [("1", "r1a2b3", "broker-r1a2b3-n0"),
                                                                   ("3", "r9", "broker-r9-n1")]
    assert tagged[1].usd_per_hour == 1.2 and tagged[0].kind == "instance" and tagged[0].created_at is not None
    with respx.mock(base_url=URL, assert_all_called=True) as mock:  # v1 missing -> v0 list
        mock.get("/api/v1/instances/").respond(404)
        mock.get("/api/v0/instances/", params={"owner": "me"}).respond(json={"instances": [
            instance_row(id=7, label="broker-run:r9:n0"), instance_row(id=8, label="broker-run:r1a2b3:n1")]})
        assert [t.provider_id for t in p.list_tagged("r9")] == ["7"]


def test_label_round_trip():
    from broker.providers.vast import VastProvider, parse_label

    p = VastProvider(api_key=KEY)
    assert parse_label(p._label("run-20261130-ab:c", 3)) == ("run-20261130-ab:c", 3)
    assert len(p._label("x" * 200, 12)) <= 64
    assert parse_label("broker-run:abc") == ("abc", None) and parse_label("other:abc:n0") is None


def test_provider_registry_and_terminate_kind():
    from broker.providers import get_provider
    from broker.core.provider import NotSupported

    p = get_provider("vast")
    assert p.name == "vast" and p.topologies == ("simulated",)
    with pytest.raises(NotSupported):
        p.terminate("vcn", "x")


def test_create_body_onstart_is_valid_bash_and_snapshot_offer_is_refused():
    p = make_provider()
    body = p.create_body(node_request(onstart="echo 'user step'"))
    subprocess.run(["bash", "-n", "-c", body["onstart"]], check=True, timeout=30)
    assert "FIRE_AT=1796007900" in body["onstart"]  # deadline 03:00 + 300 s grace
    no_deadline = p.create_body(node_request(deadline=None))
    assert "dead-man" not in no_deadline["onstart"]
    snap = replace(a_offer(), offer_id="2x-RTX_4090")
    with respx.mock(assert_all_mocked=True), pytest.raises(BadInput, match="not a Vast.ai ask id"):
        p.create_instance(node_request(offer=snap))


def test_unreachable_live_search_with_a_key_raises_instead_of_planning_from_the_snapshot(monkeypatch):
    """With a key, a failed live search used to plan silently from the snapshot, whose offers
    cannot be rented ("offer id 'snapshot:...' is not a Vast.ai ask id"); it now raises and says --offline."""
    snap = replace(a_offer(), offer_id="2x-RTX_4090", price_source="snapshot 2026-11-29",
                   price_time=datetime(2026, 11, 29, tzinfo=timezone.utc))
    fake = type(sys)("broker.plan.catalog")
    calls = []
    fake.snapshot_offers = lambda prov, req: calls.append(prov) or [snap]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "broker.plan.catalog", fake)
    p = make_provider(max_attempts=2)
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(503, text="Service Unavailable")
        with pytest.raises(TransientError, match="HTTP 503"):
            p.offers(Requirements())
    assert calls == []
    with respx.mock(base_url=URL) as mock:  # a rejected key is not hidden behind the snapshot
        mock.post("/api/v0/bundles/").respond(401, json={"detail": "bad key"})
        with pytest.raises(AuthError):
            p.offers(Requirements())
    with respx.mock(base_url=URL) as mock:  # and a later good search clears the note
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        assert p.offers(Requirements())[0].offer_id == "29981234"
    assert p.price_note().startswith("vast: live offers")


def test_create_429_is_resent_after_retry_after_and_list_without_key_is_empty(monkeypatch):
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        put = mock.put("/api/v0/asks/29981234/")
        put.side_effect = [httpx.Response(429, headers={"Retry-After": "2"}, json={"detail": "too frequent"}),
                           httpx.Response(200, json={"success": True, "new_contract": 777})]
        mock.get("/api/v0/instances/777/", params={"owner": "me"}).respond(json={"instances": instance_row(id=777)})
        assert p.create_instance(node_request()) == "777"
    assert put.call_count == 2 and p.sleeps == [2.0]
    from broker.providers.vast import VastProvider

    with respx.mock(assert_all_mocked=True) as mock:
        assert VastProvider().list_tagged() == [] and mock.calls.call_count == 0


def test_teardown_resolves_a_crashed_create_through_the_label(tmp_path):
    """Crash between the rent and mark_created: the ledger row has no id; teardown finds it by the run label."""
    from broker.money.ledger import Ledger
    from broker.money.teardown import terminate_resource

    p = make_provider()
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        res = ledger.record_intent("r1a2b3", "vast", "instance", "broker-r1a2b3-n0", usd_per_hour=0.7421)
        with respx.mock(base_url=URL, assert_all_called=True) as mock:
            mock.get("/api/v1/instances/").respond(json={"instances": [instance_row(id=456)], "next_token": None})
            d = mock.delete("/api/v0/instances/456/").respond(json={"success": True})
            mock.get("/api/v0/instances/456/", params={"owner": "me"}).respond(json={"instances": None})
            assert terminate_resource(ledger, res, "test", provider=p, poll_s=0.01) is True
        assert d.call_count == 1
        row = ledger.resource(res.id)
        assert row.state == "terminated" and row.provider_id == "456"


def test_live_offer_storage_is_not_priced_twice():
    """dph_total already includes the searched disk: the worst case is dph_total x the deadline, nothing more
    (a bug priced the disk a second time from storage_cost)."""
    from broker.plan import pricing
    from broker.providers.vast import offer_from_row

    o = offer_from_row(offer_row(dph_total=0.36, storage_cost=0.2))
    assert pricing.worst_case_usd(o, 1.0, disk_gib=40, allowance_seconds=0) == pytest.approx(0.36)


def test_a_24_gib_job_queries_low_enough_for_an_rtx_4090():
    """Vast reports an RTX 4090 as 24564 MB (23.99 GiB); a query for 24 GiB x 1024 = 24576 MB missed every 4090."""
    p = make_provider()
    with respx.mock(base_url=URL) as mock:
        route = mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        offers = p.offers(Requirements(nodes=2, min_gpu_mem_gib=24))
    assert json.loads(route.calls.last.request.content)["gpu_ram"]["gte"] <= 24564
    assert [o.gpu_name for o in offers] == ["RTX 4090"]


def test_verbose_plan_logs_the_calls_and_never_the_key(monkeypatch, capsys):
    """`broker -vv plan` against the (respx-mocked) Vast API logs which providers are asked, that Vast's offers are
    live, each API call with its outcome and the request path, and never the key (nor the Authorization header),
    though the key is in the environment and in every request."""
    from broker.cli import app as cli
    monkeypatch.setenv("VAST_API_KEY", KEY)
    monkeypatch.setenv("COLUMNS", "80")
    with respx.mock(base_url=URL, assert_all_mocked=True, assert_all_called=False) as mock:
        route = mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row(), offer_row(id=300, machine_id=7)]})
        other = mock.route().respond(json={})  # anything else the adapter asks (user, credit): an empty answer
        with pytest.raises(SystemExit) as ex:
            cli.main(["-vv", "plan", "--budget", "5", "--provider", "vast", "--nodes", "1", "--gpus-per-node", "2"])
    out = capsys.readouterr()
    assert route.called and route.calls.last.request.headers["Authorization"] == f"Bearer {KEY}"
    assert ex.value.code in (0, 3), out.err
    assert KEY not in out.err and KEY not in out.out and "Bearer" not in out.err, out.err
    assert "INFO broker.plan.facts: asking providers vast" in out.err
    assert "vast: asking for offers (live API)" in out.err
    assert re.search(r"INFO broker\.providers\.vast\.client: vast search offers.*: HTTP 200 \(1 try", out.err)
    assert re.search(r"DEBUG broker\.providers\.vast\.client: .*POST /api/v0/bundles/", out.err)
    assert "DEBUG broker.plan.facts: chosen: simulated on vast" in out.err
    assert not other.called or all(KEY not in str(c.request.url) for c in other.calls)
