"""Money safety for the Vast.ai adapter, at its real boundary (httpx + respx).

Each test models what the Vast.ai API answers (field names, units and error bodies per docs/reference/cloud-apis.md section A),
including the malformed and ambiguous answers seen against an independent emulator: a list without
``instances``, a bare JSON list, HTML instead of JSON, a rent answered ``502 {"success": false}`` after the
instance was made, 5xx on DELETE, 429 past the retries, a host with less disk than asked.
"""

from __future__ import annotations

import json
import sys

import httpx
import pytest
import respx

from broker.core.model import Requirements
from broker.core.provider import AmbiguousCreate, BadInput, OfferGone, ProviderError, TransientError

from tests.providers.vast.test_vast import KEY, LABEL, URL, a_offer, env, instance_row, make_provider, node_request, offer_row

__all__ = ["env"]  # the autouse fixture isolating HOME / VAST_* (imported so it applies here too)

RUN = "20261130-141522-abcdef"  # broker.run.runrecord.new_run's run id shape (22 characters)
INSTALL = "bi0123456789"  # broker.money.ledger's installation id shape
TOKEN = "r-0123456789ab"  # broker.money.ledger.new_id("r-"): the client token


def show(mock, iid, *answers):
    route = mock.get(f"/api/v0/instances/{iid}/", params={"owner": "me"})
    route.side_effect = list(answers)
    return route


# --------------------------------------------------------------------------------------------------- item 1
def test_label_carries_installation_id_and_client_token_within_the_length_limit():
    from broker.providers.vast import LABEL_MAX, Label, make_label, parse_label, read_label

    p = make_provider()
    body = p.create_body(node_request(run_id=RUN, installation_id=INSTALL, client_token=TOKEN))
    label = body["label"]
    assert label == f"broker-run:{RUN}:n0/{INSTALL}/{TOKEN}" and len(label) <= LABEL_MAX
    assert read_label(label) == Label(RUN, 0, INSTALL, TOKEN)
    assert parse_label(label) == (RUN, 0)
    # a run id too long for the limit is cut, never the installation id or the token (they decide what is killed)
    long = make_label("r" * 90, 3, INSTALL, TOKEN)
    assert len(long) == LABEL_MAX and read_label(long)[2:] == (INSTALL, TOKEN)
    # labels written before the installation id existed still read, with None for what they lack
    assert read_label("broker-run:r9:n1") == Label("r9", 1, None, None)
    assert read_label(f"broker-run:r9:n1//{TOKEN}") == Label("r9", 1, None, TOKEN)
    assert read_label("broker-run:a:b:n2/biX") == Label("a:b", 2, "biX", None)
    assert make_label("r9", 1, None, TOKEN) == f"broker-run:r9:n1//{TOKEN}"


def test_list_tagged_reports_each_instances_installation():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.get("/api/v1/instances/").respond(json={"instances": [
            instance_row(id=1, label=f"broker-run:{RUN}:n0/{INSTALL}/{TOKEN}"),
            instance_row(id=2, label=f"broker-run:{RUN}x:n0/biOTHERHOME1/r-ffffffffffff"),
            instance_row(id=3, label="broker-run:old-run:n0"),
            instance_row(id=4, label="jupyter notebook")], "next_token": None, "total_instances": 4})
        tagged = {t.provider_id: t for t in p.list_tagged()}
    assert set(tagged) == {"1", "2", "3"}
    assert (tagged["1"].installation_id, tagged["1"].client_token, tagged["1"].name) == (
        INSTALL, TOKEN, f"broker-{RUN}-n0")
    assert tagged["2"].installation_id == "biOTHERHOME1" and tagged["2"].run_id == f"{RUN}x"
    assert tagged["3"].installation_id is None and tagged["3"].client_token is None


# --------------------------------------------------------------------------------------------------- item 2
MALFORMED = [
    pytest.param(httpx.Response(200, json={"results": [instance_row()], "next_token": None}), id="results-key"),
    pytest.param(httpx.Response(200, json=[instance_row()]), id="bare-list"),
    pytest.param(httpx.Response(200, text="<html>maintenance</html>", headers={"content-type": "text/html"}),
                 id="not-json"),
    pytest.param(httpx.Response(200, json={"instances": [{"label": "broker-run:r1:n0"}]}), id="row-without-id"),
    pytest.param(httpx.Response(200, json={"instances": None, "next_token": None}), id="instances-null"),
]


@pytest.mark.parametrize("answer", MALFORMED)
def test_an_unreadable_instance_list_is_an_error_never_an_empty_list(answer):
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.get("/api/v1/instances/").mock(return_value=answer)
        with pytest.raises(ProviderError, match=r"list instances \(GET /api/v1/instances/\).*unrecognised answer"):
            p.list_tagged()


def test_an_unreadable_second_page_or_v0_fallback_is_an_error_too():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.get("/api/v1/instances/").side_effect = [
            httpx.Response(200, json={"instances": [instance_row(id=1)], "next_token": "t2"}),
            httpx.Response(200, json={"results": [instance_row(id=2)], "next_token": None})]
        with pytest.raises(ProviderError, match="unrecognised answer"):
            p.list_tagged()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.get("/api/v1/instances/").respond(404)
        mock.get("/api/v0/instances/", params={"owner": "me"}).respond(json=[instance_row()])
        with pytest.raises(ProviderError, match=r"GET /api/v0/instances/.*unrecognised answer"):
            p.list_tagged()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:  # a token that never ends the list
        mock.get("/api/v1/instances/").respond(json={"instances": [instance_row(id=1)], "next_token": "same"})
        with pytest.raises(ProviderError, match="next_token"):
            p.list_tagged()


@pytest.mark.parametrize("answer", [
    pytest.param(httpx.Response(200, json={"results": instance_row()}), id="results-key"),
    pytest.param(httpx.Response(200, json=[instance_row()]), id="bare-list"),
    pytest.param(httpx.Response(200, text="Bad Gateway"), id="not-json"),
    pytest.param(httpx.Response(200, json={"instances": {"status": "?"}}), id="row-without-id"),
])
def test_an_unreadable_describe_is_an_error_never_terminated(answer):
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.get("/api/v0/instances/456/", params={"owner": "me"}).mock(return_value=answer)
        with pytest.raises(ProviderError, match=r"describe instance 456.*unrecognised answer"):
            p.describe_instance("456")


def test_an_unreadable_search_is_an_error_never_no_offers():
    p = make_provider()
    for answer in ({"results": [offer_row()]}, [offer_row()], {"offers": "none"}):
        with respx.mock(base_url=URL) as mock:
            mock.post("/api/v0/bundles/").respond(json=answer)
            with pytest.raises(ProviderError, match=r"search offers.*unrecognised answer"):
                p.offers(Requirements())


class FakeVast:
    """A Vast.ai account whose rent creates the instance but answers ``502 {"success": false}``, and whose list
    answers in an unknown shape ``bad_lists`` times before answering properly."""

    def __init__(self, bad_lists: int, rent_answer: httpx.Response | Exception):
        self.instances: list[dict] = []
        self.bad_lists = bad_lists
        self.rent_answer = rent_answer

    def rent(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.instances.append(instance_row(id=500 + len(self.instances), label=body["label"],
                                           actual_status="loading", disk_space=body["disk"]))
        if isinstance(self.rent_answer, Exception):
            raise self.rent_answer
        return self.rent_answer

    def list(self, request: httpx.Request) -> httpx.Response:
        if self.bad_lists > 0:
            self.bad_lists -= 1
            return httpx.Response(200, json={"results": self.instances, "next_token": None})
        return httpx.Response(200, json={"instances": self.instances, "next_token": None})


@pytest.mark.parametrize("rent_answer", [
    pytest.param(httpx.Response(502, json={"success": False}), id="502-success-false"),
    pytest.param(httpx.ReadTimeout("read timed out"), id="timeout"),
    pytest.param(httpx.Response(200, json={"success": True}), id="2xx-without-id"),
])
def test_an_ambiguous_create_rents_at_most_once_per_intent_whatever_the_api_answers(rent_answer):
    """The emulator run: create answered 502 after renting + list without ``instances`` = 4 instances billing,
    all marked "never happened".  Now: one PUT per intent, AmbiguousCreate while unverifiable, then the id."""
    vast = FakeVast(bad_lists=3, rent_answer=rent_answer)
    p = make_provider()
    req = node_request()
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        put = mock.put("/api/v0/asks/29981234/").mock(side_effect=vast.rent)
        mock.get("/api/v1/instances/").mock(side_effect=vast.list)
        for _ in range(3):  # e.g. the core's retries of a TransientError: each one only looks
            with pytest.raises(AmbiguousCreate) as ei:
                p.create_instance(req)
            assert isinstance(ei.value, TransientError) and ei.value.ambiguous is True
            assert "unknown" in ei.value.message and LABEL in (ei.value.hint or "")
        assert put.call_count == 1 and len(vast.instances) == 1
        assert p.create_instance(req) == "500"  # the list is readable again: the instance is found, not re-rented
    assert put.call_count == 1 and len(vast.instances) == 1


def test_an_ambiguous_create_with_nothing_listed_is_still_not_rented_again():
    p = make_provider()
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        put = mock.put("/api/v0/asks/29981234/").respond(503, json={"success": False, "error": "server_error"})
        mock.get("/api/v1/instances/").respond(json={"instances": [], "next_token": None})
        for _ in range(2):
            with pytest.raises(AmbiguousCreate, match="no instance labelled .* is listed yet"):
                p.create_instance(node_request())
    assert put.call_count == 1


def test_a_create_that_never_reached_vast_is_a_plain_transient_error():
    p = make_provider()
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row()]})
        put = mock.put("/api/v0/asks/29981234/").mock(side_effect=httpx.ConnectError("connection refused"))
        with pytest.raises(TransientError) as ei:
            p.create_instance(node_request())
    assert not ei.value.ambiguous and put.call_count == 1 and "cannot reach Vast.ai" in ei.value.message


# --------------------------------------------------------------------------------------------------- item 3
def test_prepare_access_attaches_the_key_through_the_key_api_idempotently():
    p = make_provider()
    pub = "ssh-ed25519 AAAAC3NzaTESTKEY broker-r1a2b3"
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        route = mock.post("/api/v0/instances/456/ssh/")
        route.side_effect = [httpx.Response(502, text="Bad Gateway"),
                             httpx.Response(200, json={"success": True, "msg": "ssh key attached"}),
                             httpx.Response(400, json={"success": False, "msg": "ssh key already exists"})]
        assert p.prepare_access("456", pub + "\n") is True
        assert p.prepare_access("456", pub) is True  # second call: already there -> done
    assert json.loads(route.calls[0].request.content) == {"ssh_key": pub}
    assert route.calls[0].request.headers["Authorization"] == f"Bearer {KEY}" and p.sleeps == [0.5]
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/instances/456/ssh/").respond(404, json={"success": False, "error": "no_such_instance"})
        with pytest.raises(ProviderError, match="attach the run's SSH key"):
            p.prepare_access("456", pub)
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/instances/456/ssh/").respond(200, json=["ok"])
        with pytest.raises(ProviderError, match="unrecognised answer"):
            p.prepare_access("456", pub)
    with pytest.raises(BadInput):
        p.prepare_access("456", " ")


# --------------------------------------------------------------------------------------------------- item 6
def test_destroy_is_retried_on_5xx_and_429_then_confirmed_by_describe():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        d = mock.delete("/api/v0/instances/456/")
        d.side_effect = [httpx.Response(500, text="Internal Server Error"),
                         httpx.Response(409, json={"error": "conflict", "msg": "instance is changing state"}),
                         httpx.Response(429, headers={"Retry-After": "3"}, json={"detail": "too frequent"}),
                         httpx.Response(200, json={"success": True})]
        g = show(mock, 456, httpx.Response(200, json={"instances": None}))
        assert p.terminate("instance", "456") is True
    assert d.call_count == 4 and g.call_count == 1 and p.sleeps == [0.5, 1.0, 3.0]


def test_destroy_gives_up_after_a_bounded_time_and_404_is_gone():
    p = make_provider(delete_attempts=5)
    with respx.mock(base_url=URL) as mock:
        d = mock.delete("/api/v0/instances/456/").respond(503, text="Service Unavailable")
        with pytest.raises(TransientError, match="HTTP 503"):
            p.terminate("instance", "456")
    assert d.call_count == 5 and sum(p.sleeps) <= 60
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.delete("/api/v0/instances/456/").respond(404, json={"error": "no_such_instance"})
        g = show(mock, 456, httpx.Response(200, json={"instances": None}))
        assert make_provider().terminate("instance", "456") is True
    assert g.call_count == 1  # confirmed by describe, not assumed
    with respx.mock(base_url=URL, assert_all_called=True) as mock:  # 404 but still listed: not confirmed
        mock.delete("/api/v0/instances/456/").respond(404, json={"error": "no_such_instance"})
        show(mock, 456, httpx.Response(200, json={"instances": instance_row()}))
        assert make_provider().terminate("instance", "456") is False


# --------------------------------------------------------------------------------------------------- item 7
def test_search_asks_for_the_disk_and_drops_hosts_with_less():
    p = make_provider()
    with respx.mock(base_url=URL) as mock:
        route = mock.post("/api/v0/bundles/").respond(json={"offers": [
            offer_row(id=1, disk_space=500.0), offer_row(id=2, disk_space=812.7)]})
        offers = p.offers(Requirements(disk_gib=600))
    sent = json.loads(route.calls.last.request.content)
    assert sent["disk_space"] == {"gte": 600.0} and sent["allocated_storage"] == 600.0
    assert [o.offer_id for o in offers] == ["2"]


def test_requote_refuses_a_host_with_less_disk():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=False) as mock:
        q = mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row(disk_space=500.0)]})
        put = mock.put("/api/v0/asks/29981234/").respond(json={"success": True, "new_contract": 1})
        with pytest.raises(OfferGone, match="500 GB of disk, the recipe asks 600 GiB"):
            p.create_instance(node_request(disk_gib=600.0))
    assert json.loads(q.calls.last.request.content)["disk_space"] == {"gte": 600.0} and put.call_count == 0


def test_a_created_instance_with_less_disk_is_destroyed_and_fails_over():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row(disk_space=900.0)]})
        mock.put("/api/v0/asks/29981234/").respond(json={"success": True, "new_contract": 456})
        g = show(mock, 456, httpx.Response(200, json={"instances": instance_row(disk_space=500.0, label=LABEL)}),
                 httpx.Response(200, json={"instances": None}))
        d = mock.delete("/api/v0/instances/456/").respond(json={"success": True})
        with pytest.raises(OfferGone, match="came with 500 GB of disk, the recipe asks 600 GiB; it was destroyed"):
            p.create_instance(node_request(disk_gib=600.0))
    assert d.call_count == 1 and g.call_count == 2


def test_disk_unknown_at_create_is_checked_by_describe():
    p = make_provider()
    with respx.mock(base_url=URL, assert_all_called=True) as mock:
        mock.post("/api/v0/bundles/").respond(json={"offers": [offer_row(disk_space=900.0)]})
        mock.put("/api/v0/asks/29981234/").respond(json={"success": True, "new_contract": 456})
        show(mock, 456, httpx.Response(200, json={"instances": instance_row(disk_space=None, actual_status=None)}),
             httpx.Response(200, json={"instances": instance_row(disk_space=500.0)}))
        assert p.create_instance(node_request(disk_gib=600.0)) == "456"
        info = p.describe_instance("456")
    assert info.state == "failed" and "500 GB is less than the 600 GiB asked" in (info.message or "")


# --------------------------------------------------------------------------------------------------- item 8
def test_rate_limit_past_the_retries_says_so_and_never_falls_back_to_the_snapshot(monkeypatch):
    fake = type(sys)("broker.plan.catalog")
    calls = []
    fake.snapshot_offers = lambda prov, req: calls.append(prov) or [a_offer()]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "broker.plan.catalog", fake)
    p = make_provider(max_attempts=3)
    with respx.mock(base_url=URL) as mock:
        route = mock.post("/api/v0/bundles/").respond(
            429, headers={"Retry-After": "30"}, json={"detail": "API requests too frequent endpoint threshold=5"})
        with pytest.raises(TransientError) as ei:
            p.offers(Requirements())
    err = ei.value
    assert route.call_count == 3 and p.sleeps == [30.0, 30.0] and calls == []
    assert "rate-limited" in err.message and err.code == "rate_limited" and err.status == 429
    assert "retry in 30 s" in (err.hint or "") and "--offline" in (err.hint or "") and err.exit_code == 4
    # the daily search quota: not retried, says when it resets and --offline, no snapshot either
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(429, json={"error": "search_quota_exceeded", "msg": "daily quota"})
        with pytest.raises(ProviderError, match="daily search quota") as ei:
            p.offers(Requirements())
    assert "00:00 UTC" in (ei.value.hint or "") and "--offline" in (ei.value.hint or "") and calls == []


def test_adapter_imports_only_the_contract():
    """The adapter depends on broker.core.model / provider / config / nodescripts / catalog only."""
    import ast
    from pathlib import Path

    import broker.providers.vast as pkg

    # broker.core.prose: the one money formatter every message uses; broker.providers.declared: its capabilities
    allowed = {"broker.core.model", "broker.core.provider", "broker.core.records", "broker.core.config", "broker.core.nodescripts", "broker.plan.catalog",
               "broker.core.prose", "broker.providers.declared"}
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("broker"):
                mod = node.module
                assert mod in allowed or mod.startswith("broker.providers.vast"), f"{path.name} imports {mod}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("broker") or a.name == "providers" for a in node.names), path
                if path.name != "client.py":  # only the client speaks HTTP
                    assert not any(a.name == "httpx" for a in node.names), path
