"""OCI adapter against the REAL ``oci`` SDK pointed at a local HTTP server (docs/reference/cloud-apis.md D3).

Responses are camelCase JSON as the OCI APIs return them; requests (paths, query parameters, bodies) are asserted.
Retries and the circuit breaker are off so each test sees exactly the requests the adapter makes.
"""

from __future__ import annotations

import base64
import json
import socket
from typing import Any

import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

oci = pytest.importorskip("oci")

from broker.core.model import Offer, Quota, Requirements, utcnow  # noqa: E402
from broker.core.provider import RUN_TAG, AuthError, CapacityError, ProviderError, QuotaError, TransientError
from broker.core.records import NodeRequest, QuotaRequest
from broker.providers.oci import OCIProvider, limit_for_shape  # noqa: E402

TENANCY = "ocid1.tenancy.oc1..aaaaaaaatenancy"
COMP = "ocid1.compartment.oc1..aaaaaaaacomp"
AD1, AD2 = "Uocm:US-ASHBURN-AD-1", "Uocm:US-ASHBURN-AD-2"
REGION = "us-ashburn-1"
PEM_MARK = "BEGIN PRIVATE KEY"


@pytest.fixture
def cfg(key_pem: str) -> dict[str, Any]:
    return {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": TENANCY,
            "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff", "key_content": key_pem,
            "region": REGION}


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path):
    from broker.core.config import settings

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    for var in ("OCI_CONFIG_FILE", "OCI_PROFILE", "OCI_COMPARTMENT_ID", "OCI_REGION", "OCI_SERVICE_ENDPOINT",
                "OCI_IMAGE_ID", "OCI_SUBNET_ID", "OCI_INSTANCE_PRINCIPAL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OCI_CONFIG_FILE", str(tmp_path / "no-such-oci-config"))
    monkeypatch.chdir(tmp_path)  # no stray .env
    settings.cache_clear()
    yield
    settings.cache_clear()


@pytest.fixture
def server(own_httpserver):
    return own_httpserver


def make(cfg: dict[str, Any], server: HTTPServer, **kw: Any) -> OCIProvider:
    kw.setdefault("availability_domains", [AD1, AD2])
    return OCIProvider(config=cfg, service_endpoint=server.url_for("").rstrip("/"), compartment_id=COMP,
                       retry_strategy=oci.retry.NoneRetryStrategy(),
                       circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy(),
                       sleep=lambda s: None, **kw)


def jresp(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj), status=status, content_type="application/json",
                    headers={"opc-request-id": "req-1", **(headers or {})})


def err(status: int, code: str, message: str) -> Response:
    return jresp({"code": code, "message": message}, status=status)


def offer(shape: str = "VM.GPU.A10.1", zone: str | None = AD1) -> Offer:
    return Offer(provider="oci", offer_id=shape, instance_type=shape, region=REGION, zone=zone, gpu_name="A10",
                 gpu_count=1, gpu_mem_gib=24, usd_per_hour=2.0, price_source="test", price_time=utcnow(),
                 private_network=True)


def instance_json(iid: str, state: str = "PROVISIONING", **extra: Any) -> dict[str, Any]:
    return {"id": iid, "compartmentId": COMP, "availabilityDomain": AD1, "shape": "VM.GPU.A10.1",
            "lifecycleState": state, "displayName": "broker-r1-n0", "region": "iad", "imageId": "ocid1.image.oc1..img",
            "timeCreated": "2026-11-30T00:00:00.000Z", "freeformTags": {RUN_TAG: "r1", "broker-ssh-user": "opc"},
            **extra}


# ------------------------------------------------------------------------------------------------ check / offers
def test_check_configured_from_dict_and_file(cfg, server, tmp_path, monkeypatch):
    chk = make(cfg, server).check()
    assert chk.configured and chk.usable is None and REGION in chk.detail
    # the same profile from a file, chosen by OCI_CONFIG_FILE / OCI_PROFILE
    keyf = tmp_path / "key.pem"
    keyf.write_text(cfg["key_content"])
    conf = tmp_path / "oci-config"
    conf.write_text(f"[WORK]\nuser={cfg['user']}\ntenancy={TENANCY}\nfingerprint={cfg['fingerprint']}\n"
                    f"key_file={keyf}\nregion=eu-frankfurt-1\n")
    monkeypatch.setenv("OCI_CONFIG_FILE", str(conf))
    monkeypatch.setenv("OCI_PROFILE", "WORK")
    from broker.core.config import settings

    settings.cache_clear()
    p = OCIProvider()
    assert p.check().configured and p.region == "eu-frankfurt-1"
    assert len(server.log) == 0  # check() makes no network call


def test_check_unconfigured_names_fix(cfg, tmp_path, monkeypatch):
    chk = OCIProvider().check()  # OCI_CONFIG_FILE points at a missing file
    assert not chk.configured
    assert "OCI" in str(chk.hint) or "oci" in chk.detail
    assert "oci setup config" in chk.hint and "OCI_CONFIG_FILE" in chk.hint and "OCI_PROFILE" in chk.hint
    # malformed fingerprint: named, and the key never appears in the message
    bad = dict(cfg, fingerprint="not-a-fingerprint")
    chk = OCIProvider(config=bad).check()
    assert not chk.configured and "fingerprint" in chk.detail
    assert PEM_MARK not in chk.detail + str(chk.hint)
    with pytest.raises(AuthError) as ei:
        OCIProvider(config=bad).availability_domains()
    assert ei.value.provider == "oci" and PEM_MARK not in str(ei.value)


def test_bad_private_key_is_auth_error(cfg, server):
    bad = dict(cfg, key_content="-----BEGIN PRIVATE KEY-----\nnot-a-key\n-----END PRIVATE KEY-----\n")
    with pytest.raises(AuthError) as ei:
        make(bad, server).create_instance(node_request(image="ocid1.image.oc1..mine"))
    assert "private key is invalid" in str(ei.value) and "not-a-key" not in str(ei.value)
    chk = make(bad, server).check()
    assert chk.configured and chk.usable is False and "private key is invalid" in chk.detail
    assert "not-a-key" not in chk.detail + str(chk.hint)
    assert len(server.log) == 0


def test_offers_unconfigured_from_snapshot_without_network():
    req = Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16)
    offers = OCIProvider().offers(req)
    shapes = {o.instance_type for o in offers}
    assert {"VM.GPU.A10.1", "VM.GPU2.1", "BM.GPU.H100.8"} <= shapes
    a10 = next(o for o in offers if o.instance_type == "VM.GPU.A10.1")
    assert a10.usd_per_hour == 2.0 and a10.gpu_count == 1 and a10.gpu_mem_gib == 24
    assert a10.private_network and a10.zone is None
    assert a10.attrs["limit_name"] == "gpu-a10-count" and a10.price_source
    h100 = next(o for o in offers if o.instance_type == "BM.GPU.H100.8")
    assert h100.attrs["limit_name"] == "gpu-h100-count" and h100.attrs["limit_unconfirmed"] is True
    # GPU-memory and model filters apply
    big = OCIProvider().offers(Requirements(min_gpu_mem_gib=64))
    assert {o.instance_type for o in big} == {"BM.GPU.A100-v2.8", "BM.GPU.H100.8"}
    assert {o.gpu_name for o in OCIProvider().offers(Requirements(gpu_names=["a10"]))} == {"A10"}


def test_offers_configured_expand_per_listed_ad(cfg, server):
    server.expect_ordered_request("/20160918/availabilityDomains", method="GET",
                                  query_string={"compartmentId": TENANCY}).respond_with_response(
        jresp([{"name": AD1, "id": "ocid1.ad.1", "compartmentId": TENANCY},
               {"name": AD2, "id": "ocid1.ad.2", "compartmentId": TENANCY}]))
    p = make(cfg, server, availability_domains=None)
    offers = p.offers(Requirements(gpu_names=["A10"], gpus_per_node=1))
    server.check_assertions()
    a10 = [o for o in offers if o.instance_type == "VM.GPU.A10.1"]
    assert sorted(o.zone for o in a10) == [AD1, AD2]
    assert all(o.region == REGION and o.private_network for o in a10)
    assert len({o.key for o in offers}) == len(offers)


def test_limit_names():
    assert limit_for_shape("VM.GPU.A10.2") == limit_for_shape("BM.GPU.A10.4") == "gpu-a10-count"
    assert limit_for_shape("VM.GPU2.1") == "gpu2-count" and limit_for_shape("VM.GPU3.4") == "gpu3-count"
    assert limit_for_shape("BM.GPU4.8") == "gpu4-count"
    assert limit_for_shape("BM.GPU.A100-v2.8") == "gpu-a100-v2-count"
    assert limit_for_shape("VM.Standard.E4.Flex") is None


# ------------------------------------------------------------------------------------------------ quotas / capacity
def test_quotas_read_per_ad(cfg, server):
    path = "/20190729/services/compute/limits/gpu-a10-count/resourceAvailability"
    server.expect_request(path, query_string={"compartmentId": TENANCY, "availabilityDomain": AD1}) \
        .respond_with_response(jresp({"used": 1, "available": 3}))
    server.expect_request(path, query_string={"compartmentId": TENANCY, "availabilityDomain": AD2}) \
        .respond_with_response(jresp({"used": 0, "available": 0}))
    p = make(cfg, server)
    qs = p.quotas(Requirements(), [offer("VM.GPU.A10.1", AD1), offer("VM.GPU.A10.2", AD2)])
    server.check_assertions()
    by_ad = {q.scope: q for q in qs}
    assert set(by_ad) == {AD1, AD2}
    q1 = by_ad[AD1]
    assert (q1.name, q1.limit, q1.used, q1.available, q1.unit) == ("gpu-a10-count", 4, 1, 3, "gpus")
    assert q1.instance_types == ["VM.GPU.A10.1", "VM.GPU.A10.2"] and q1.region == REGION
    assert by_ad[AD2].limit == 0


def test_quotas_all_refused_is_auth_error(cfg, server):
    server.expect_request("/20190729/services/compute/limits/gpu-a10-count/resourceAvailability") \
        .respond_with_response(err(404, "NotAuthorizedOrNotFound", "Authorization failed or requested resource "
                                                                    "not found."))
    with pytest.raises(AuthError) as ei:
        make(cfg, server).quotas(Requirements(), [offer()])
    assert "resource-availability" in str(ei.value)


def test_limit_values_paginated(cfg, server):
    q = {"compartmentId": TENANCY, "serviceName": "compute", "sortBy": "name"}
    server.expect_ordered_request("/20190729/limitValues", query_string=q).respond_with_response(
        jresp([{"name": "gpu-a10-count", "scopeType": "AD", "availabilityDomain": AD1, "value": 2},
               {"name": "standard-e4-core-count", "scopeType": "AD", "availabilityDomain": AD1, "value": 100}],
              headers={"opc-next-page": "p2"}))
    server.expect_ordered_request("/20190729/limitValues", query_string={**q, "page": "p2"}).respond_with_response(
        jresp([{"name": "gpu-a10-count", "scopeType": "AD", "availabilityDomain": AD2, "value": 0}]))
    rows = make(cfg, server).limit_values()
    server.check_assertions()
    assert rows == [{"name": "gpu-a10-count", "scope_type": "AD", "availability_domain": AD1, "value": 2},
                    {"name": "gpu-a10-count", "scope_type": "AD", "availability_domain": AD2, "value": 0}]


def test_capacity_report_per_ad(cfg, server):
    seen: list[dict[str, Any]] = []

    def handler(request: Request) -> Response:
        body = json.loads(request.data)
        seen.append(body)
        status = {AD1: "AVAILABLE", AD2: "OUT_OF_HOST_CAPACITY"}[body["availabilityDomain"]]
        return jresp({"compartmentId": body["compartmentId"], "availabilityDomain": body["availabilityDomain"],
                      "timeCreated": "2026-11-30T00:00:00.000Z",
                      "shapeAvailabilities": [
                          {"instanceShape": s["instanceShape"], "availabilityStatus":
                              "HARDWARE_NOT_SUPPORTED" if s["instanceShape"] == "BM.GPU2.2" else status,
                           "availableCount": 2 if status == "AVAILABLE" else 0}
                          for s in body["shapeAvailabilities"]]})

    server.expect_request("/20160918/computeCapacityReports", method="POST").respond_with_handler(handler)
    caps = make(cfg, server).capacity([offer("VM.GPU.A10.1", AD1), offer("VM.GPU.A10.1", AD2),
                                       offer("BM.GPU2.2", AD2)])
    assert len(seen) == 2 and {b["compartmentId"] for b in seen} == {TENANCY}
    assert [s["instanceShape"] for s in seen[1]["shapeAvailabilities"]] == ["VM.GPU.A10.1", "BM.GPU2.2"]
    got = {(c.zone, c.instance_type): (c.status, c.available_count) for c in caps}
    assert got == {(AD1, "VM.GPU.A10.1"): ("AVAILABLE", 2), (AD2, "VM.GPU.A10.1"): ("OUT_OF_HOST_CAPACITY", 0),
                   (AD2, "BM.GPU2.2"): ("NOT_OFFERED", 0)}


def test_unconfigured_reads_are_empty():
    p = OCIProvider()
    assert p.quotas(Requirements(), [offer()]) == [] and p.capacity([offer()]) == []


# ------------------------------------------------------------------------------------------------ bootstrap
class OrderRecorder:
    """A tiny Recorder writing into a shared journal that the HTTP handlers also write to."""

    def __init__(self, journal: list[tuple[str, str]]):
        self.journal = journal
        self.rows: dict[str, dict[str, Any]] = {}

    def intent(self, kind, name, *, region=None, zone=None, usd_per_hour=0.0, attrs=None):
        rid = f"res-{len(self.rows)}"
        self.rows[rid] = {"kind": kind, "name": name, "state": "intent", "region": region}
        self.journal.append(("intent", kind))
        return rid

    def created(self, resource_id, provider_id, **attrs):
        self.rows[resource_id].update(state="created", provider_id=provider_id)
        self.journal.append(("created", self.rows[resource_id]["kind"]))

    def failed(self, resource_id, error):
        self.rows[resource_id].update(state="failed", error=error)
        self.journal.append(("failed", self.rows[resource_id]["kind"]))

    def event(self, message):
        self.journal.append(("event", message))


VCN = "ocid1.vcn.oc1..vcn"
RT = "ocid1.routetable.oc1..rt"
IGW = "ocid1.internetgateway.oc1..igw"
SL = "ocid1.securitylist.oc1..sl"
SUBNET = "ocid1.subnet.oc1..subnet"


def network_server(server: HTTPServer, journal: list[tuple[str, str]], bodies: dict[str, Any],
                   fail_subnet: Response | None = None) -> None:
    def h(kind: str, resp: dict[str, Any], fail: Response | None = None):
        def handler(request: Request) -> Response:
            journal.append(("http", kind))
            bodies[kind] = json.loads(request.data)
            return fail if fail is not None else jresp(resp)
        return handler

    common = {"compartmentId": COMP, "lifecycleState": "AVAILABLE", "timeCreated": "2026-11-30T00:00:00.000Z"}
    server.expect_request("/20160918/vcns", method="POST").respond_with_handler(h("vcn", {
        **common, "id": VCN, "cidrBlock": "10.0.0.0/16", "cidrBlocks": ["10.0.0.0/16"], "defaultRouteTableId": RT,
        "displayName": "broker-r1-vcn"}))
    server.expect_request("/20160918/internetGateways", method="POST").respond_with_handler(
        h("internet_gateway", {**common, "id": IGW, "vcnId": VCN, "isEnabled": True}))
    server.expect_request(f"/20160918/routeTables/{RT}", method="PUT").respond_with_handler(
        h("route", {**common, "id": RT, "vcnId": VCN, "routeRules": [
            {"destination": "0.0.0.0/0", "destinationType": "CIDR_BLOCK", "networkEntityId": IGW}]}))
    server.expect_request("/20160918/securityLists", method="POST").respond_with_handler(h("security_list", {
        **common, "id": SL, "vcnId": VCN, "displayName": "broker-r1-sl", "ingressSecurityRules": [],
        "egressSecurityRules": []}))
    server.expect_request("/20160918/subnets", method="POST").respond_with_handler(h("subnet", {
        **common, "id": SUBNET, "vcnId": VCN, "cidrBlock": "10.0.1.0/24", "routeTableId": RT,
        "securityListIds": [SL]}, fail_subnet))


def test_bootstrap_creates_network_ledger_first(cfg, server):
    journal: list[tuple[str, str]] = []
    bodies: dict[str, Any] = {}
    network_server(server, journal, bodies)
    rec = OrderRecorder(journal)
    net = make(cfg, server).bootstrap("r1", [offer(), offer()], "multi-node", rec)
    assert net["subnet_id"] == SUBNET and net["vcn_id"] == VCN and net["vcn_cidr"] == "10.0.0.0/16"
    steps = [j for j in journal if j[0] != "event"]
    assert steps == [("intent", "vcn"), ("http", "vcn"), ("created", "vcn"),
                     ("intent", "internet_gateway"), ("http", "internet_gateway"), ("created", "internet_gateway"),
                     ("http", "route"),
                     ("intent", "security_list"), ("http", "security_list"), ("created", "security_list"),
                     ("intent", "subnet"), ("http", "subnet"), ("created", "subnet")]
    assert {r["provider_id"] for r in rec.rows.values()} == {VCN, IGW, SL, SUBNET}
    for kind in ("vcn", "internet_gateway", "security_list", "subnet"):
        assert bodies[kind]["freeformTags"] == {RUN_TAG: "r1"}, kind
        assert bodies[kind]["compartmentId"] == COMP
    assert bodies["vcn"]["cidrBlocks"] == ["10.0.0.0/16"]
    assert bodies["route"]["routeRules"] == [{"destination": "0.0.0.0/0", "destinationType": "CIDR_BLOCK",
                                              "networkEntityId": IGW}]
    ingress = bodies["security_list"]["ingressSecurityRules"]
    assert len(ingress) == 2
    intra = next(r for r in ingress if r["protocol"] == "all")
    assert intra["source"] == "10.0.0.0/16" and intra["isStateless"] is False
    ssh = next(r for r in ingress if r["protocol"] == "6")
    assert ssh["source"] == "0.0.0.0/0" and ssh["tcpOptions"]["destinationPortRange"] == {"min": 22, "max": 22}
    # nothing but SSH is open to the world
    assert all(r["source"] == "10.0.0.0/16" or r.get("tcpOptions", {}).get("destinationPortRange")
               == {"min": 22, "max": 22} for r in ingress)
    assert bodies["security_list"]["egressSecurityRules"][0]["protocol"] == "all"
    sub = bodies["subnet"]
    assert sub["cidrBlock"] == "10.0.1.0/24" and "availabilityDomain" not in sub  # regional
    assert sub["securityListIds"] == [SL] and sub["routeTableId"] == RT and sub["prohibitPublicIpOnVnic"] is False


def test_bootstrap_failed_create_is_recorded(cfg, server):
    journal: list[tuple[str, str]] = []
    network_server(server, journal, {}, fail_subnet=err(400, "LimitExceeded",
                                                        "The following service limits were exceeded: subnet-count."))
    rec = OrderRecorder(journal)
    with pytest.raises(QuotaError) as ei:
        make(cfg, server).bootstrap("r1", [offer()], "multi-node", rec)
    assert "subnet-count" in str(ei.value)
    assert "broker quota request" not in str(ei.value) and "Limits, Quotas and Usage" in ei.value.hint
    assert journal[-1] == ("failed", "subnet")
    assert [r["state"] for r in rec.rows.values()] == ["created", "created", "created", "failed"]


def test_bootstrap_reuses_named_subnet(cfg, server, monkeypatch):
    monkeypatch.setenv("OCI_SUBNET_ID", SUBNET)
    from broker.core.config import settings

    settings.cache_clear()
    server.expect_request(f"/20160918/subnets/{SUBNET}", method="GET").respond_with_response(jresp(
        {"id": SUBNET, "vcnId": VCN, "compartmentId": COMP, "cidrBlock": "172.16.1.0/24",
         "lifecycleState": "AVAILABLE"}))
    server.expect_request(f"/20160918/vcns/{VCN}", method="GET").respond_with_response(jresp(
        {"id": VCN, "compartmentId": COMP, "cidrBlocks": ["172.16.0.0/16"], "cidrBlock": "172.16.0.0/16",
         "lifecycleState": "AVAILABLE", "defaultRouteTableId": RT}))
    journal: list[tuple[str, str]] = []
    net = make(cfg, server).bootstrap("r1", [offer()], "multi-node", OrderRecorder(journal))
    assert net["subnet_id"] == SUBNET and net["vcn_cidr"] == "172.16.0.0/16"
    assert [j for j in journal if j[0] != "event"] == []  # nothing created, nothing recorded
    assert all(e.method == "GET" for e, _ in server.log)


# ------------------------------------------------------------------------------------------------ launch
def node_request(**kw: Any) -> NodeRequest:
    base = dict(run_id="r1", node_index=0, name="broker-r1-n0", offer=offer(), ssh_public_key="ssh-ed25519 AAAA test",
                client_token="res-abc", network={"subnet_id": SUBNET, "vcn_id": VCN, "vcn_cidr": "10.0.0.0/16"})
    base.update(kw)
    return NodeRequest(**base)


def serve_images(server: HTTPServer) -> None:
    server.expect_request("/20160918/images", method="GET", query_string={
        "compartmentId": COMP, "operatingSystem": "Oracle Linux", "shape": "VM.GPU.A10.1", "sortBy": "TIMECREATED",
        "sortOrder": "DESC", "lifecycleState": "AVAILABLE"}).respond_with_response(jresp([
            {"id": "ocid1.image.oc1..plain", "compartmentId": None, "displayName": "Oracle-Linux-8.10-2026.10.01-0",
             "operatingSystem": "Oracle Linux", "operatingSystemVersion": "8", "lifecycleState": "AVAILABLE",
             "timeCreated": "2026-10-01T00:00:00.000Z", "createImageAllowed": True},
            {"id": "ocid1.image.oc1..gpu", "compartmentId": None,
             "displayName": "Oracle-Linux-8.10-Gen2-GPU-2026.09.30-0", "operatingSystem": "Oracle Linux",
             "operatingSystemVersion": "8", "lifecycleState": "AVAILABLE", "timeCreated": "2026-09-30T00:00:00.000Z",
             "createImageAllowed": True}]))


def test_launch_ok(cfg, server):
    serve_images(server)
    got: dict[str, Any] = {}

    def handler(request: Request) -> Response:
        got["body"] = json.loads(request.data)
        got["headers"] = dict(request.headers)
        return jresp(instance_json("ocid1.instance.oc1..i1"))

    server.expect_request("/20160918/instances", method="POST").respond_with_handler(handler)
    iid = make(cfg, server).create_instance(node_request())
    assert iid == "ocid1.instance.oc1..i1"
    b = got["body"]
    assert b["shape"] == "VM.GPU.A10.1" and b["availabilityDomain"] == AD1 and b["compartmentId"] == COMP
    assert b["displayName"] == "broker-r1-n0"
    assert b["sourceDetails"]["sourceType"] == "image" and b["sourceDetails"]["imageId"] == "ocid1.image.oc1..gpu"
    assert b["createVnicDetails"] == {"subnetId": SUBNET, "assignPublicIp": True}
    assert b["freeformTags"][RUN_TAG] == "r1" and b["freeformTags"]["broker-ssh-user"] == "opc"
    assert b["metadata"]["ssh_authorized_keys"] == "ssh-ed25519 AAAA test"
    ud = base64.b64decode(b["metadata"]["user_data"]).decode()
    assert ud.startswith("#!/bin/bash")
    assert "BROKER_VCN_CIDR=10.0.0.0/16" in ud
    assert 'firewall-cmd --permanent --zone=trusted --add-source="$BROKER_VCN_CIDR"' in ud
    assert "firewall-cmd --reload" in ud
    assert 'iptables -I INPUT 1 -s "$BROKER_VCN_CIDR" -j ACCEPT' in ud
    assert "0.0.0.0/0" not in ud and "broker-deadman" not in ud  # dead-man switch not armed by default
    assert got["headers"].get("Opc-Retry-Token") == "res-abc"
    assert len([e for e, _ in server.log if e.method == "POST"]) == 1


def test_launch_with_user_image_and_deadman(cfg, server):
    got: dict[str, Any] = {}

    def handler(request: Request) -> Response:
        got["body"] = json.loads(request.data)
        return jresp(instance_json("ocid1.instance.oc1..i2"))

    server.expect_request("/20160918/instances", method="POST").respond_with_handler(handler)
    p = make(cfg, server, instance_principal=True)
    p.create_instance(node_request(image="ocid1.image.oc1..mine", deadline=utcnow(), onstart="echo hello"))
    ud = base64.b64decode(got["body"]["metadata"]["user_data"]).decode()
    assert got["body"]["sourceDetails"]["imageId"] == "ocid1.image.oc1..mine"
    assert "broker-deadman" in ud and "--auth instance_principal" in ud
    # onstart runs after the switches are armed; only the boot-done marker comes after it
    assert ud.index("echo hello") > ud.index("broker-deadman") and ud.index("echo hello") < ud.index("boot.done")


def test_launch_out_of_host_capacity(cfg, server):
    server.expect_request("/20160918/instances", method="POST").respond_with_response(
        err(500, "InternalError", "Out of host capacity."))
    with pytest.raises(CapacityError) as ei:
        make(cfg, server).create_instance(node_request(image="ocid1.image.oc1..mine"))
    e = ei.value
    assert e.provider == "oci" and e.call == "launch_instance" and e.status == 500
    assert AD1 in e.message and "next availability domain" in e.hint
    assert len(server.log) == 1  # launch is not retried


def test_launch_generic_500_is_transient(cfg, server):
    server.expect_request("/20160918/instances", method="POST").respond_with_response(
        err(500, "InternalError", "Internal error occurred"))
    with pytest.raises(TransientError):
        make(cfg, server).create_instance(node_request(image="ocid1.image.oc1..mine"))


def test_launch_limit_exceeded_names_limit_and_command(cfg, server):
    server.expect_request("/20160918/instances", method="POST").respond_with_response(err(
        400, "LimitExceeded", "The following service limits were exceeded: gpu-a10-count. Request a service limit "
                              "increase from the service limits page in the console. "))
    server.expect_request("/20190729/services/compute/limits/gpu-a10-count/resourceAvailability",
                          query_string={"compartmentId": TENANCY, "availabilityDomain": AD1}).respond_with_response(
        jresp({"used": 1, "available": 0}))
    with pytest.raises(QuotaError) as ei:
        make(cfg, server).create_instance(node_request(image="ocid1.image.oc1..mine"))
    text = str(ei.value)
    assert "gpu-a10-count" in ei.value.message
    assert f"broker quota request --provider oci --limit gpu-a10-count --value 2 --scope {AD1}" in text


@pytest.mark.parametrize("status,code,exc", [(401, "NotAuthenticated", AuthError),
                                             (404, "NotAuthorizedOrNotFound", AuthError),
                                             (429, "TooManyRequests", TransientError),
                                             (400, "InvalidParameter", ProviderError)])
def test_launch_error_mapping(cfg, server, status, code, exc):
    server.expect_request("/20160918/instances", method="POST").respond_with_response(err(status, code, "nope"))
    with pytest.raises(exc) as ei:
        make(cfg, server).create_instance(node_request(image="ocid1.image.oc1..mine"))
    assert type(ei.value) is exc and ei.value.status == status
    assert PEM_MARK not in str(ei.value)


def test_network_failure_is_transient(cfg):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = OCIProvider(config=cfg, service_endpoint=f"http://127.0.0.1:{port}", compartment_id=COMP,
                    availability_domains=[AD1], retry_strategy=oci.retry.NoneRetryStrategy(),
                    circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy())
    with pytest.raises(TransientError) as ei:
        p.create_instance(node_request(image="ocid1.image.oc1..mine"))
    assert "network error" in ei.value.message


# ------------------------------------------------------------------------------------------------ describe / terminate
def test_describe_running_with_ips_and_gone(cfg, server):
    iid = "ocid1.instance.oc1..i1"
    server.expect_request(f"/20160918/instances/{iid}").respond_with_response(jresp(instance_json(iid, "RUNNING")))
    server.expect_request("/20160918/vnicAttachments", query_string={"compartmentId": COMP, "instanceId": iid}) \
        .respond_with_response(jresp([{"id": "att1", "instanceId": iid, "vnicId": "vnic1", "lifecycleState": "ATTACHED",
                                       "availabilityDomain": AD1, "compartmentId": COMP, "subnetId": SUBNET,
                                       "timeCreated": "2026-11-30T00:00:00.000Z"}]))
    server.expect_request("/20160918/vnics/vnic1").respond_with_response(jresp(
        {"id": "vnic1", "isPrimary": True, "privateIp": "10.0.1.5", "publicIp": "192.0.2.10", "lifecycleState":
         "AVAILABLE", "availabilityDomain": AD1, "compartmentId": COMP, "subnetId": SUBNET}))
    server.expect_request("/20160918/instances/ocid1.instance.oc1..gone").respond_with_response(
        err(404, "NotAuthorizedOrNotFound", "Authorization failed or requested resource not found."))
    p = make(cfg, server)
    info = p.describe_instance(iid)
    assert (info.state, info.private_ip, info.public_ip, info.ssh_host, info.ssh_user) == \
        ("running", "10.0.1.5", "192.0.2.10", "192.0.2.10", "opc")
    assert info.usd_per_hour == 2.0
    assert p.describe_instance("ocid1.instance.oc1..gone").state == "terminated"


@pytest.mark.parametrize("raw,state", [("PROVISIONING", "pending"), ("STARTING", "pending"),
                                       ("TERMINATING", "terminating"), ("TERMINATED", "terminated"),
                                       ("STOPPED", "stopped")])
def test_describe_states(cfg, server, raw, state):
    server.expect_request("/20160918/instances/ocid1.instance.oc1..i9").respond_with_response(
        jresp(instance_json("ocid1.instance.oc1..i9", raw)))
    info = make(cfg, server).describe_instance("ocid1.instance.oc1..i9")
    assert info.state == state and info.raw_state == raw and info.private_ip is None


def test_terminate_instance_preserve_boot_volume_false_and_idempotent(cfg, server):
    server.expect_ordered_request("/20160918/instances/ocid1.instance.oc1..i1", method="DELETE",
                                  query_string={"preserveBootVolume": "false"}).respond_with_response(
        Response(status=204, headers={"opc-request-id": "r"}))
    server.expect_ordered_request("/20160918/instances/ocid1.instance.oc1..i1", method="DELETE",
                                  query_string={"preserveBootVolume": "false"}).respond_with_response(
        err(404, "NotAuthorizedOrNotFound", "Authorization failed or requested resource not found."))
    p = make(cfg, server)
    # requested; the caller polls describe until TERMINATED
    assert p.terminate("instance", "ocid1.instance.oc1..i1") is False
    assert p.terminate("instance", "ocid1.instance.oc1..i1") is True  # already gone
    server.check_assertions()


def serve_network_reads(server: HTTPServer, route_rules: list[dict[str, Any]]) -> None:
    """GET of the run's internet gateway, its VCN and the VCN's default route table (holding ``route_rules``)."""
    server.expect_request(f"/20160918/internetGateways/{IGW}", method="GET").respond_with_response(jresp(
        {"id": IGW, "vcnId": VCN, "compartmentId": COMP, "lifecycleState": "AVAILABLE", "isEnabled": True}))
    server.expect_request(f"/20160918/vcns/{VCN}", method="GET").respond_with_response(jresp(
        {"id": VCN, "compartmentId": COMP, "cidrBlocks": ["10.0.0.0/16"], "lifecycleState": "AVAILABLE",
         "defaultRouteTableId": RT}))
    server.expect_request(f"/20160918/routeTables/{RT}", method="GET").respond_with_response(jresp(
        {"id": RT, "vcnId": VCN, "compartmentId": COMP, "lifecycleState": "AVAILABLE", "routeRules": route_rules}))


def test_terminate_network_objects(cfg, server):
    server.expect_request(f"/20160918/subnets/{SUBNET}", method="DELETE").respond_with_response(
        err(404, "NotAuthorizedOrNotFound", "gone"))
    server.expect_request(f"/20160918/securityLists/{SL}", method="DELETE").respond_with_response(
        Response(status=204))
    serve_network_reads(server, [
        {"destination": "0.0.0.0/0", "destinationType": "CIDR_BLOCK", "networkEntityId": IGW},
        {"destination": "192.168.0.0/16", "destinationType": "CIDR_BLOCK", "networkEntityId": "other"}])
    put: dict[str, Any] = {}

    def put_handler(request: Request) -> Response:
        put["body"] = json.loads(request.data)
        return jresp({"id": RT, "vcnId": VCN, "compartmentId": COMP, "lifecycleState": "AVAILABLE",
                      "routeRules": put["body"]["routeRules"]})

    server.expect_request(f"/20160918/routeTables/{RT}", method="PUT").respond_with_handler(put_handler)
    server.expect_request(f"/20160918/internetGateways/{IGW}", method="DELETE").respond_with_response(
        Response(status=204))
    # VCN delete: 409 while the subnet is still terminating, then accepted
    server.expect_oneshot_request(f"/20160918/vcns/{VCN}", method="DELETE").respond_with_response(
        err(409, "Conflict", "The Vcn has one or more dependent resources"))
    server.expect_oneshot_request(f"/20160918/vcns/{VCN}", method="DELETE").respond_with_response(
        Response(status=204))
    p = make(cfg, server)
    assert p.terminate("subnet", SUBNET) is True
    assert p.terminate("security_list", SL) is True
    assert p.terminate("internet_gateway", IGW) is True
    assert put["body"]["routeRules"] == [{"destination": "192.168.0.0/16", "destinationType": "CIDR_BLOCK",
                                          "networkEntityId": "other"}]
    assert p.terminate("vcn", VCN) is True
    methods = [(e.method, e.path) for e, _ in server.log]
    assert methods.index(("PUT", f"/20160918/routeTables/{RT}")) < \
        methods.index(("DELETE", f"/20160918/internetGateways/{IGW}"))
    assert methods.count(("DELETE", f"/20160918/vcns/{VCN}")) == 2


def test_list_tagged(cfg, server):
    server.expect_request("/20160918/instances", method="GET", query_string={"compartmentId": COMP}) \
        .respond_with_response(jresp([instance_json("ocid1.instance.oc1..i1", "RUNNING"),
                                      instance_json("ocid1.instance.oc1..i2", "TERMINATED"),
                                      {**instance_json("ocid1.instance.oc1..i3", "RUNNING"),
                                       "freeformTags": {RUN_TAG: "other"}},
                                      {**instance_json("ocid1.instance.oc1..i4", "RUNNING"), "freeformTags": {}}]))
    server.expect_request("/20160918/vcns", method="GET").respond_with_response(jresp([
        {"id": VCN, "compartmentId": COMP, "cidrBlocks": ["10.0.0.0/16"], "lifecycleState": "AVAILABLE",
         "displayName": "broker-r1-vcn", "freeformTags": {RUN_TAG: "r1"}, "timeCreated": "2026-11-30T00:00:00.000Z"}]))
    for path in ("subnets", "internetGateways", "securityLists"):
        server.expect_request(f"/20160918/{path}", method="GET").respond_with_response(jresp([]))
    p = make(cfg, server)
    tagged = p.list_tagged("r1")
    assert [(t.kind, t.provider_id, t.run_id) for t in tagged] == [("instance", "ocid1.instance.oc1..i1", "r1"),
                                                                   ("vcn", VCN, "r1")]
    assert tagged[0].usd_per_hour == 2.0 and tagged[1].name == "broker-r1-vcn"
    assert {t.provider_id for t in p.list_tagged(None)} == {"ocid1.instance.oc1..i1", "ocid1.instance.oc1..i3", VCN}


# ------------------------------------------------------------------------------------------------ quota requests
def a10_quota(scope: str = AD1) -> Quota:
    return Quota(provider="oci", name="gpu-a10-count", region=REGION, scope=scope, limit=1, used=1, unit="gpus",
                 instance_types=["VM.GPU.A10.1"])


def test_quota_request_draft_makes_no_call(cfg, server):
    r = make(cfg, server).request_quota(a10_quota(), 2, "PyTorch DDP validation", draft=True)
    assert r.state == "DRAFT" and r.request_id is None and r.value == 2 and r.unit == "gpus"
    assert r.form["limit"] == "gpu-a10-count" and r.form["scope (availability domain)"] == AD1
    assert r.form["service"] == "compute" and r.form["region"] == REGION
    assert len(server.log) == 0


def test_quota_request_open_request_is_returned_not_duplicated(cfg, server):
    server.expect_request("/20251101/limitsIncreaseItemRequests", method="GET",
                          query_string={"compartmentId": TENANCY, "service": "compute"}).respond_with_response(jresp({
                              "items": [{"id": "item0", "compartmentId": TENANCY, "region": REGION, "scope": AD2,
                                         "serviceName": "compute", "limitName": "gpu-a10-count", "value": 4,
                                         "limitsIncreaseRequestId": "lir-other-ad", "lifecycleState": "IN_PROGRESS",
                                         "timeCreated": "2026-11-29T10:00:00.000Z"},
                                        {"id": "item1", "compartmentId": TENANCY, "region": REGION, "scope": AD1,
                                         "serviceName": "compute", "limitName": "gpu-a10-count", "value": 2,
                                         "limitsIncreaseRequestId": "lir-open", "lifecycleState": "ACCEPTED",
                                         "timeCreated": "2026-11-29T12:00:00.000Z"}]}))
    r = make(cfg, server).request_quota(a10_quota(), 2, "PyTorch DDP validation")
    assert r.request_id == "lir-open" and r.state == "ACCEPTED" and "not filed again" in r.message
    assert not [e for e, _ in server.log if e.method == "POST"]


def test_quota_request_files_with_required_answers(cfg, server):
    server.expect_request("/20251101/limitsIncreaseItemRequests", method="GET").respond_with_response(jresp({
        "items": [{"id": "old", "compartmentId": TENANCY, "region": REGION, "scope": AD1, "serviceName": "compute",
                   "limitName": "gpu-a10-count", "value": 1, "limitsIncreaseRequestId": "lir-done",
                   "lifecycleState": "SUCCEEDED", "timeCreated": "2026-10-01T00:00:00.000Z"}]}))
    server.expect_request("/20251101/limitsIncreaseQuestionnaires", method="GET", query_string={
        "compartmentId": TENANCY, "serviceName": "compute", "limitName": "gpu-a10-count"}).respond_with_response(
        jresp({"items": [
            {"id": "q-use", "service": "compute", "limitName": "gpu-a10-count", "questionText": "Describe the use case",
             "questionType": "TEXT", "isRequired": True},
            {"id": "q-n", "service": "compute", "limitName": "gpu-a10-count", "questionText": "How many instances?",
             "questionType": "NUMBER", "isRequired": True},
            {"id": "q-env", "service": "compute", "limitName": "gpu-a10-count", "questionText": "Environment",
             "questionType": "RADIO", "options": {"DEV": "Development", "PROD": "Production"}, "isRequired": True},
            {"id": "q-opt", "service": "compute", "limitName": "gpu-a10-count", "questionText": "Anything else?",
             "questionType": "TEXT", "isRequired": False}]}))
    got: dict[str, Any] = {}

    def create(request: Request) -> Response:
        got["body"] = json.loads(request.data)
        return jresp({"id": "lir-new", "compartmentId": TENANCY, "displayName": got["body"]["displayName"],
                      "lifecycleState": "ACCEPTED", "justification": got["body"]["justification"],
                      "timeCreated": "2026-11-30T00:00:00.000Z", "limitsIncreaseItemRequests": []})

    server.expect_request("/20251101/limitsIncreaseRequests", method="POST").respond_with_handler(create)
    r = make(cfg, server).request_quota(a10_quota(), 2, "PyTorch DDP validation on 2 nodes")
    assert (r.request_id, r.state, r.value) == ("lir-new", "ACCEPTED", 2)
    b = got["body"]
    assert b["compartmentId"] == TENANCY and b["justification"] == "PyTorch DDP validation on 2 nodes"
    (item,) = b["limitsIncreaseItemRequests"]
    assert (item["serviceName"], item["limitName"], item["region"], item["scope"], item["value"]) == \
        ("compute", "gpu-a10-count", REGION, AD1, 2)
    answers = {a["id"]: a["questionResponse"] for a in item["questionnaireResponse"]}
    assert answers == {"q-use": "PyTorch DDP validation on 2 nodes", "q-n": "2", "q-env": "DEV"}


def test_quota_request_permission_error(cfg, server):
    server.expect_request("/20251101/limitsIncreaseItemRequests").respond_with_response(
        err(404, "NotAuthorizedOrNotFound", "Authorization failed or requested resource not found."))
    with pytest.raises(AuthError) as ei:
        make(cfg, server).request_quota(a10_quota(), 2, "x")
    text = str(ei.value)
    assert "oci" in text and "Limits Increase API" in text and "IAM policy" in text and "--draft" in text


def test_quota_request_status(cfg, server):
    server.expect_request("/20251101/limitsIncreaseRequests/lir-new").respond_with_response(jresp({
        "id": "lir-new", "compartmentId": TENANCY, "displayName": "x", "lifecycleState": "SUCCEEDED",
        "justification": "y", "limitsIncreaseItemRequests": [
            {"id": "it", "compartmentId": TENANCY, "region": REGION, "scope": AD1, "serviceName": "compute",
             "limitName": "gpu-a10-count", "value": 2, "lifecycleState": "SUCCEEDED"}]}))
    req = QuotaRequest(provider="oci", limit_name="gpu-a10-count", value=2, unit="gpus", request_id="lir-new",
                       state="ACCEPTED")
    r = make(cfg, server).quota_request_status(req)
    assert r.state == "SUCCEEDED" and "gpu-a10-count SUCCEEDED" in r.message


# ------------------------------------------------------------------------------------------------ with the real ledger
class LedgerRecorder:
    """Adapter of broker.money.ledger.Ledger to the Recorder protocol (what provisioning hands to bootstrap)."""

    def __init__(self, ledger, run_id: str, journal: list[tuple[str, str]]):
        self.ledger, self.run_id, self.journal = ledger, run_id, journal

    def intent(self, kind, name, *, region=None, zone=None, usd_per_hour=0.0, attrs=None):
        self.journal.append(("intent", kind))
        return self.ledger.record_intent(self.run_id, "oci", kind, name, region=region, zone=zone,
                                         usd_per_hour=usd_per_hour, attrs=attrs).id

    def created(self, resource_id, provider_id, **attrs):
        self.ledger.mark_created(resource_id, provider_id, **attrs)

    def failed(self, resource_id, error):
        self.ledger.update_resource(resource_id, state="failed", error=error, actor="test")

    def event(self, message):
        self.ledger.event(self.run_id, "test", "progress", message)


def test_bootstrap_launch_and_teardown_through_the_ledger(cfg, server, tmp_path):
    from broker.money.ledger import Ledger
    from broker.core.records import Run
    from broker.money.teardown import teardown_run

    journal: list[tuple[str, str]] = []
    network_server(server, journal, {})
    iid = "ocid1.instance.oc1..i1"
    server.expect_request("/20160918/instances", method="POST").respond_with_response(jresp(instance_json(iid)))
    server.expect_request(f"/20160918/instances/{iid}", method="DELETE",
                          query_string={"preserveBootVolume": "false"}).respond_with_response(Response(status=204))
    server.expect_request(f"/20160918/instances/{iid}", method="GET").respond_with_response(
        jresp(instance_json(iid, "TERMINATED")))
    for path in (f"subnets/{SUBNET}", f"securityLists/{SL}", f"internetGateways/{IGW}", f"vcns/{VCN}"):
        server.expect_request(f"/20160918/{path}", method="DELETE").respond_with_response(Response(status=204))
    serve_network_reads(server, [{"destination": "0.0.0.0/0", "destinationType": "CIDR_BLOCK",
                                  "networkEntityId": IGW}])

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.create_run(Run(id="r1", name="t", provider="oci", topology="multi-node"))
        p = make(cfg, server)
        net = p.bootstrap("r1", [offer()], "multi-node", LedgerRecorder(ledger, "r1", journal))
        res = ledger.record_intent("r1", "oci", "instance", "broker-r1-n0", zone=AD1, usd_per_hour=2.0)
        provider_id = p.create_instance(node_request(network=net, image="ocid1.image.oc1..mine",
                                                     client_token=res.id))
        ledger.mark_created(res.id, provider_id)
        rows = ledger.resources("r1")
        assert sorted((r.kind, r.provider_id) for r in rows) == sorted(
            [("vcn", VCN), ("internet_gateway", IGW), ("security_list", SL), ("subnet", SUBNET),
             ("instance", iid)])
        igw_row = next(r for r in rows if r.kind == "internet_gateway")
        assert igw_row.attrs["route_table_id"] == RT  # lets terminate() clear the route without a VCN lookup
        left = teardown_run(ledger, "r1", "test", providers={"oci": p}, poll_s=0.0, confirm_timeout_s=5)
        assert left == []
        assert all(r.state == "terminated" for r in ledger.resources("r1"))
    assert ("PUT", f"/20160918/routeTables/{RT}") in [(e.method, e.path) for e, _ in server.log][-6:]
    deletes = [e.path for e, _ in server.log if e.method == "DELETE"]
    assert deletes == [f"/20160918/instances/{iid}", f"/20160918/subnets/{SUBNET}", f"/20160918/securityLists/{SL}",
                       f"/20160918/internetGateways/{IGW}", f"/20160918/vcns/{VCN}"]


def test_unconfigured_offers_do_not_import_the_sdk(tmp_path):
    """`broker plan` without OCI credentials must stay fast: the snapshot path never imports `oci` (0.6 s here)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; import broker.providers.oci as o; from broker.core.model import Requirements; "
            "p = o.OCIProvider(); n = len(p.offers(Requirements())); c = p.check().configured; "
            "assert n > 0 and not c; assert 'oci' not in sys.modules, 'oci imported'; print('ok')")
    env = {**os.environ, "OCI_CONFIG_FILE": str(tmp_path / "absent"), "BROKER_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[3]), env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_launch_never_retried_even_with_a_retrying_client(cfg, server):
    """A client-level retry strategy applies to every operation in the SDK; launch must still be one attempt."""
    server.expect_request("/20160918/instances", method="POST").respond_with_response(
        err(500, "InternalError", "Out of host capacity."))
    server.expect_request("/20160918/availabilityDomains").respond_with_response(
        err(503, "ServiceUnavailable", "try later"))
    retrying = oci.retry.RetryStrategyBuilder(max_attempts=3, retry_base_sleep_time_seconds=0.01,
                                              retry_max_wait_between_calls_seconds=0.02).get_retry_strategy()
    p = OCIProvider(config=cfg, service_endpoint=server.url_for("").rstrip("/"), compartment_id=COMP,
                    availability_domains=[AD1], retry_strategy=retrying,
                    circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy())
    with pytest.raises(CapacityError):
        p.create_instance(node_request(image="ocid1.image.oc1..mine"))
    assert len([e for e, _ in server.log if e.method == "POST"]) == 1
    # ... while a read is retried by the same client (the strategy is really active)
    p2 = OCIProvider(config=cfg, service_endpoint=server.url_for("").rstrip("/"), compartment_id=COMP,
                     retry_strategy=retrying, circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy())
    with pytest.raises(TransientError):
        p2.availability_domains()
    assert len([e for e, _ in server.log if e.path.endswith("availabilityDomains")]) == 3


def test_calls_are_logged_with_name_and_outcome_never_the_key(cfg, server, caplog):
    """`broker -v`: each OCI call through the one error-mapping place is logged with its name and outcome; the
    signing key (and its config) never."""
    import logging

    path = "/20190729/services/compute/limits/gpu-a10-count/resourceAvailability"
    server.expect_request(path).respond_with_response(jresp({"used": 1, "available": 3}))
    with caplog.at_level(logging.DEBUG, logger="broker"):
        make(cfg, server).quotas(Requirements(), [offer("VM.GPU.A10.1", AD1)])
    ok = [r.getMessage() for r in caplog.records if r.name == "broker.providers.oci.sdk" and r.levelname == "INFO"]
    assert ok and all(m.startswith("oci ") and ": ok (" in m for m in ok), ok
    assert "PRIVATE KEY" not in caplog.text and "fingerprint" not in caplog.text


def test_a_refused_call_is_logged_as_failed(cfg, server, caplog):
    import logging

    server.expect_request("/20190729/services/compute/limits/gpu-a10-count/resourceAvailability") \
        .respond_with_response(err(404, "NotAuthorizedOrNotFound", "Authorization failed."))
    with caplog.at_level(logging.INFO, logger="broker"), pytest.raises(AuthError):
        make(cfg, server).quotas(Requirements(), [offer()])
    assert any(": failed (" in r.getMessage() and "NotAuthorizedOrNotFound" in r.getMessage()
               for r in caplog.records if r.name == "broker.providers.oci.sdk"), caplog.text
