"""OCI: what broker sends and reads held against the ``oci`` SDK's own models, through the REAL SDK against
tests/support/oci_emulator.py: every request body broker's adapter sends is a document of the SDK model of that
operation (no field the model lacks, nested and polymorphic types followed), and every answer the emulator gives
reads into the SDK model without a field the model lacks, so a drift of broker or of the emulator from the API
fails here.  Also: OCI keeps listing a terminated instance (TERMINATED) for hours; broker never counts it as live
and never deletes it again."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

import pytest

oci = pytest.importorskip("oci")

from broker.core.model import Requirements, utcnow  # noqa: E402
from tests.support.oci_emulator import OCIEmulator  # noqa: E402

TENANCY = "ocid1.tenancy.oc1..aaaaaaaatenancy"
COMP = "ocid1.compartment.oc1..aaaaaaaaparity"
AD = "Uocm:US-ASHBURN-AD-1"
REGION = "us-ashburn-1"


def _adapter(emu: OCIEmulator, key_pem: str):
    from broker.providers.oci import OCIProvider

    cfg = {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": TENANCY, "key_content": key_pem,
           "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff", "region": REGION}
    return OCIProvider(config=cfg, service_endpoint=emu.url, compartment_id=COMP, availability_domains=[AD],
                       retry_strategy=oci.retry.NoneRetryStrategy(),
                       circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy(), conflict_wait_s=2.0)


@pytest.fixture
def oci_env(key_pem, tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    with OCIEmulator(compartment=COMP, ads=(AD,), region=REGION, boot_s=0.0, terminate_s=0.1,
                     subnet_delete_s=0.1) as emu:
        yield emu, _adapter(emu, key_pem)


def _req() -> Requirements:
    return Requirements(nodes=1, gpus_per_node=1, gpu_names=["A10"], min_gpu_mem_gib=16, hours=1.0,
                        budget_usd=20.0, topology="simulated", disk_gib=50)


def _node(offer: Any, net: dict, run_id: str = "20261201-000000-ocipar", token: str = "res-1"):
    from broker.core.records import NodeRequest

    return NodeRequest(run_id=run_id, node_index=0, name=f"broker-{run_id}-n0", offer=offer,
                       ssh_public_key="ssh-ed25519 AAAATEST broker", client_token=token,
                       installation_id="bi0123456789", image="ocid1.image.oc1..aaaaaaaaimage",
                       deadline=utcnow() + timedelta(hours=1), disk_gib=50, network=net)


class _Rec:
    installation_id = "bi0123456789"

    def intent(self, kind: str, name: str, **kw: Any) -> str:
        return name

    def created(self, rid: str, pid: str, **kw: Any) -> None:
        pass

    def failed(self, rid: str, error: str) -> None:
        pass

    def event(self, message: str) -> None:
        pass


# ------------------------------------------------------------------------------------------------ the SDK's models
def _model(name: str) -> Any:
    for mod in (oci.core.models, oci.limits.models, oci.identity.models):
        if hasattr(mod, name):
            return getattr(mod, name)
    return None


def strays(doc: Any, type_name: str, where: str = "") -> list[str]:
    """Fields of the JSON ``doc`` that the SDK type ``type_name`` (``LaunchInstanceDetails``,
    ``list[IngressSecurityRule]``, ``dict(str, str)``) does not have, as dotted paths; polymorphic models are
    resolved with the SDK's own ``get_subtype``."""
    if doc is None:
        return []
    m = re.fullmatch(r"list\[(.+)\]", type_name)
    if m:
        return [s for i, x in enumerate(doc) for s in strays(x, m.group(1), f"{where}[{i}]")]
    if type_name.startswith("dict(") or type_name in ("str", "int", "float", "bool", "datetime", "object"):
        return []
    cls = _model(type_name)
    if cls is None:
        return [f"{where or '.'}: unknown SDK type {type_name}"]
    if hasattr(cls, "get_subtype"):
        sub = cls.get_subtype(doc)
        cls = _model(sub) or cls
    inst = cls()
    by_json = {v: k for k, v in inst.attribute_map.items()}
    out = []
    for key, val in doc.items():
        attr = by_json.get(key)
        if attr is None:
            out.append(f"{where}.{key}".lstrip("."))
            continue
        out += strays(val, inst.swagger_types[attr], f"{where}.{key}")
    return out


#: (method, path pattern) -> (SDK model of the request body, SDK model of the answer)
OPS: dict[tuple[str, str], tuple[str | None, str | None]] = {
    ("POST", r"/20160918/vcns"): ("CreateVcnDetails", "Vcn"),
    ("POST", r"/20160918/internetGateways"): ("CreateInternetGatewayDetails", "InternetGateway"),
    ("POST", r"/20160918/securityLists"): ("CreateSecurityListDetails", "SecurityList"),
    ("POST", r"/20160918/subnets"): ("CreateSubnetDetails", "Subnet"),
    ("PUT", r"/20160918/routeTables/[^/]+"): ("UpdateRouteTableDetails", "RouteTable"),
    ("POST", r"/20160918/instances/?"): ("LaunchInstanceDetails", "Instance"),
    ("GET", r"/20160918/instances/[^/]+"): (None, "Instance"),
    ("GET", r"/20160918/instances/?"): (None, "list[Instance]"),
    ("GET", r"/20160918/vcns/[^/]+"): (None, "Vcn"),
    ("GET", r"/20160918/subnets/[^/]+"): (None, "Subnet"),
    ("GET", r"/20160918/vnicAttachments/?"): (None, "list[VnicAttachment]"),
    ("GET", r"/20160918/vnics/[^/]+"): (None, "Vnic"),
    ("GET", r"/20160918/images/?"): (None, "list[Image]"),
}


def _check(exchanges: list) -> tuple[set[str], list[str]]:
    seen, bad = set(), []
    for method, path, body, status, answer in exchanges:
        if status >= 400:
            continue
        for (m, pat), (req_t, ans_t) in OPS.items():
            if m == method and re.fullmatch(pat, path):
                seen.add(f"{m} {pat}")
                if req_t:
                    bad += [f"{method} {path} request: {s}" for s in strays(body, req_t)]
                if ans_t and answer is not None:
                    bad += [f"{method} {path} answer: {s}" for s in strays(answer, ans_t)]
    return seen, bad


def test_strays_finds_a_field_the_sdk_model_lacks():
    assert strays({"compartmentId": "c", "shape": "VM.GPU.A10.1", "sourceDetails": {
        "sourceType": "image", "imageId": "i", "bootVolumeSizeInGBs": 50}}, "LaunchInstanceDetails") == []
    assert strays({"shape": "x", "preemptible": True}, "LaunchInstanceDetails") == ["preemptible"]
    assert strays({"sourceDetails": {"sourceType": "image", "bootVolumeSizeGbs": 50}},
                  "LaunchInstanceDetails") == [".sourceDetails.bootVolumeSizeGbs".lstrip(".")]


def test_every_request_broker_sends_and_every_answer_it_reads_is_the_sdks_model(oci_env):
    """A whole life: bootstrap (VCN, gateway, route table, security list, subnet), launch on demand and
    preemptible, describe, list, terminate, network teardown; each body and answer held to the SDK model."""
    from broker.plan import interruptible as spot
    from broker.plan.planner import plan

    emu, prov = oci_env
    offer = next(o for o in prov.offers(_req()) if o.instance_type == "VM.GPU.A10.1")
    net = prov.bootstrap("20261201-000000-ocipar", [offer], "multi-node", _Rec())
    iid = prov.create_instance(_node(offer, net))
    v100 = Requirements(nodes=1, gpus_per_node=1, gpu_names=["V100"], min_gpu_mem_gib=16, hours=1.0,
                        budget_usd=20.0, topology="simulated", interruptible="true", disk_gib=50)
    pre = plan(v100, prov.offers(v100)).chosen.offers[0]
    assert pre.attrs.get(spot.PRICE_ATTR)
    pid = prov.create_instance(_node(pre, net, token="res-2"))
    assert prov.describe_instance(iid).state == "running"
    tagged = prov.list_tagged("20261201-000000-ocipar")
    for i in (iid, pid):
        prov.terminate("instance", i)
    deadline = time.monotonic() + 10
    while any(prov.describe_instance(i).state != "terminated" for i in (iid, pid)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    seen, bad = _check(emu.exchanges)
    assert bad == [], bad
    assert {"POST /20160918/vcns", "POST /20160918/subnets", "POST /20160918/instances/?",
            "GET /20160918/instances/[^/]+", "GET /20160918/instances/?"} <= seen, seen
    assert {t.kind for t in tagged} >= {"instance", "vcn", "subnet"}


# ------------------------------------------------------------------------------------------------ TERMINATED rows
def test_a_terminated_instance_listed_for_hours_is_neither_live_nor_deleted_again(oci_env, tmp_path):
    """OCI lists a terminated instance (TERMINATED) for hours after its end: reconcile's listing, the token lookup
    and `broker down` leave it alone, and a terminate of it is answered from its state without another DELETE."""
    from broker.core.records import Run
    from broker.money.ledger import Ledger
    from broker.money.teardown import teardown_run

    emu, prov = oci_env
    run = "20261201-000000-ocidone"
    lg = Ledger(tmp_path / "ledger.sqlite")
    gone = emu.add_instance(tags={"broker-run": run, "broker-install": lg.installation_id,
                                  "broker-client-token": "res-old"}, state="TERMINATED", age_s=3 * 3600)
    assert gone in {i["id"] for i in emu.objs["instances"].values()}  # still listed by the API
    assert prov.list_tagged(run) == [] and prov.list_tagged(None) == []
    assert prov.find_by_token("res-old") is None
    deletes = lambda: [j for j in emu.journal if j[0] == "DELETE" and gone in j[1]]  # noqa: E731
    assert prov.terminate("instance", gone) is True  # OCI answers 409 IncorrectState: it is gone, done
    lg.create_run(Run(id=run, name="done", provider="oci", status="running", created_at=utcnow()))
    rid = lg.record_intent(run, "oci", "instance", f"broker-{run}-n0").id
    lg.mark_created(rid, gone, state="running")
    n = len(deletes())
    assert teardown_run(lg, run, "down", providers={"oci": prov}, confirm_timeout_s=5, poll_s=0.05) == []
    assert len(deletes()) <= n + 1  # at most one more terminate, never a loop
    assert lg.resources(run, live_only=True) == []
