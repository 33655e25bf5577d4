"""Money safety, OCI side, at the real boundary: the real ``oci`` SDK against a local HTTP server.

Each test names the item it proves: 1 installation tags, 2 fail closed / ambiguous creates, 3 readiness defaults
and the boot-done marker, 4 quota scope, 6 teardown that finishes (transient mapping, dependency order).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from dataclasses import replace
from typing import Any

import pytest
from werkzeug import Request, Response

oci = pytest.importorskip("oci")

from broker.core.provider import (INSTALL_TAG, RUN_TAG, AmbiguousCreate, ProviderError, QuotaError,  # noqa: E402
                             TransientError)
from broker.providers.oci import TOKEN_TAG, OCIProvider, cloud_init  # noqa: E402
from tests.providers.oci.test_oci import (AD1, AD2, COMP, IGW, RT, SL, SUBNET, VCN, OrderRecorder, _env, cfg, err,  # noqa: E402,F401
                      instance_json, jresp, make, network_server, node_request, server)

INST = "inst-A"


class InstallRecorder(OrderRecorder):
    """The test recorder plus the installation id the real ledger recorder exposes."""

    installation_id = INST


# ------------------------------------------------------------------------------------------------ item 1
def test_every_created_object_carries_the_installation_tag(cfg, server):
    journal: list[tuple[str, str]] = []
    bodies: dict[str, Any] = {}
    network_server(server, journal, bodies)
    p = make(cfg, server)
    p.bootstrap("r1", [offer_a10()], "multi-node", InstallRecorder(journal))
    for kind in ("vcn", "internet_gateway", "security_list", "subnet"):
        assert bodies[kind]["freeformTags"] == {RUN_TAG: "r1", INSTALL_TAG: INST}, kind
    assert bodies["route"]["freeformTags"] == {RUN_TAG: "r1", INSTALL_TAG: INST}  # the default route table

    got: dict[str, Any] = {}

    def launch(request: Request) -> Response:
        got["body"] = json.loads(request.data)
        return jresp(instance_json("ocid1.instance.oc1..i1"))

    server.expect_request("/20160918/instances", method="POST").respond_with_handler(launch)
    p.create_instance(node_request(image="ocid1.image.oc1..mine", installation_id=INST))
    tags = got["body"]["freeformTags"]
    assert tags[RUN_TAG] == "r1" and tags[INSTALL_TAG] == INST and tags[TOKEN_TAG] == "res-abc"


def offer_a10():
    from tests.providers.oci.test_oci import offer

    return offer()


def serve_lists(server, instances: Any, **network: Any) -> None:
    server.expect_request("/20160918/instances", method="GET").respond_with_response(jresp(instances))
    for path in ("vcns", "subnets", "internetGateways", "securityLists"):
        server.expect_request(f"/20160918/{path}", method="GET").respond_with_response(jresp(network.get(path, [])))


def test_list_tagged_reports_the_installation(cfg, server):
    mine = {**instance_json("ocid1.instance.oc1..i1", "RUNNING"), "freeformTags": {RUN_TAG: "r1", INSTALL_TAG: INST}}
    theirs = {**instance_json("ocid1.instance.oc1..i2", "RUNNING"),
              "freeformTags": {RUN_TAG: "r9", INSTALL_TAG: "inst-B"}}
    old = {**instance_json("ocid1.instance.oc1..i3", "RUNNING"), "freeformTags": {RUN_TAG: "r0"}}
    serve_lists(server, [mine, theirs, old], vcns=[
        {"id": VCN, "compartmentId": COMP, "cidrBlocks": ["10.0.0.0/16"], "lifecycleState": "AVAILABLE",
         "displayName": "broker-r1-vcn", "freeformTags": {RUN_TAG: "r1", INSTALL_TAG: INST}}])
    got = {t.provider_id: t.installation_id for t in make(cfg, server).list_tagged(None)}
    assert got == {"ocid1.instance.oc1..i1": INST, "ocid1.instance.oc1..i2": "inst-B", "ocid1.instance.oc1..i3": None,
                   VCN: INST}


# ------------------------------------------------------------------------------------------------ item 2
@pytest.mark.parametrize("answer,what", [
    ({"items": [], "nextPage": None}, "without 'id'"),  # an object where a list is expected (the SDK reads keys)
    ([{"compartmentId": COMP, "lifecycleState": "RUNNING", "freeformTags": {RUN_TAG: "r1"}}], "without 'id'"),
    ([{**instance_json("ocid1.instance.oc1..i1", "RUNNING"), "freeformTags": [RUN_TAG, "r1"]}],
     "could not read"),  # tags: a list
    (["i1", "i2"], "without 'id'"),                     # a bare list of strings
])
def test_unreadable_list_is_an_error_never_empty(cfg, server, answer, what):
    serve_lists(server, answer)
    with pytest.raises(ProviderError) as ei:
        make(cfg, server).list_tagged("r1")
    assert ei.value.call == "list_instances" and "unreadable answer" in ei.value.message and what in ei.value.message
    assert not isinstance(ei.value, TransientError)


def test_unreadable_describe_is_an_error_not_terminated(cfg, server):
    server.expect_request("/20160918/instances/ocid1.instance.oc1..i1").respond_with_response(
        jresp({"id": "ocid1.instance.oc1..i1", "shape": "x"}))
    with pytest.raises(ProviderError) as ei:
        make(cfg, server).describe_instance("ocid1.instance.oc1..i1")
    assert ei.value.call == "get_instance" and "lifecycle_state" in ei.value.message


@pytest.mark.parametrize("status,code", [(500, "InternalError"), (502, "BadGateway"), (503, "ServiceUnavailable")])
def test_launch_5xx_is_ambiguous_and_verifiable_by_token(cfg, server, status, code):
    """The launch reached OCI and failed with a 5xx: it may have happened.  The token tag finds it."""
    server.expect_request("/20160918/instances", method="POST").respond_with_response(err(status, code, "oops"))
    p = make(cfg, server)
    with pytest.raises(AmbiguousCreate) as ei:
        p.create_instance(node_request(image="ocid1.image.oc1..mine"))
    assert ei.value.call == "launch_instance" and ei.value.status == status
    assert len([e for e, _ in server.log if e.method == "POST"]) == 1  # never resent
    made = {**instance_json("ocid1.instance.oc1..i7", "PROVISIONING"),
            "freeformTags": {RUN_TAG: "r1", TOKEN_TAG: "res-abc"}}
    gone = {**instance_json("ocid1.instance.oc1..i6", "TERMINATED"),
            "freeformTags": {RUN_TAG: "r1", TOKEN_TAG: "res-abc"}}
    server.expect_request("/20160918/instances", method="GET").respond_with_response(jresp([gone, made]))
    assert p.find_by_token("res-abc") == "ocid1.instance.oc1..i7"
    assert p.find_by_token("res-other") is None


def test_launch_read_timeout_is_ambiguous(cfg, server):
    def slow(request: Request) -> Response:
        time.sleep(1.5)
        return jresp(instance_json("ocid1.instance.oc1..i8"))

    server.expect_request("/20160918/instances", method="POST").respond_with_handler(slow)
    p = make(cfg, server)
    p.api.client("compute").base_client.timeout = (5.0, 0.5)
    with pytest.raises(AmbiguousCreate) as ei:
        p.create_instance(node_request(image="ocid1.image.oc1..mine"))
    assert "may have happened" in ei.value.message


def test_bootstrap_5xx_keeps_the_intent_row(cfg, server):
    journal: list[tuple[str, str]] = []
    network_server(server, journal, {}, fail_subnet=err(503, "ServiceUnavailable", "try later"))
    rec = InstallRecorder(journal)
    with pytest.raises(AmbiguousCreate):
        make(cfg, server).bootstrap("r1", [offer_a10()], "multi-node", rec)
    subnet_row = next(r for r in rec.rows.values() if r["kind"] == "subnet")
    assert subnet_row["state"] == "intent"  # not "failed": it may exist; list_tagged will tell
    assert ("failed", "subnet") not in journal


# ------------------------------------------------------------------------------------------------ item 3
def test_ready_timeout_default_and_boot_marker(tmp_path):
    from broker.providers.oci import BOOT_DONE

    assert OCIProvider.ssh_ready_timeout_s >= 120 and BOOT_DONE == "boot.done"
    bash = shutil.which("bash")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for t in ("mkdir", "date", "id", "chown", "cat", "echo"):
        if shutil.which(t):
            (bindir / t).symlink_to(shutil.which(t))
    ud = cloud_init("10.0.0.0/16", onstart=f"echo onstart > {tmp_path}/onstart.txt",
                    done_file="/home/opc/broker/job.done")
    work = tmp_path / "work"
    r = subprocess.run([bash, "-c", ud], env={"PATH": str(bindir), "BROKER_WORKROOT": str(work)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (work / "boot.done").exists() and (tmp_path / "onstart.txt").exists()
    assert (work / "boot.done").stat().st_mtime >= (tmp_path / "onstart.txt").stat().st_mtime
    assert ud.rstrip().splitlines()[-3].startswith('BROKER_WORKROOT="${BROKER_WORKROOT:-/home/opc/broker}"')


# ------------------------------------------------------------------------------------------------ item 4
def test_limit_exceeded_scope_is_the_availability_domain(cfg, server):
    server.expect_request("/20160918/instances", method="POST").respond_with_response(err(
        400, "LimitExceeded", "The following service limits were exceeded: gpu-a10-count."))
    server.expect_request("/20190729/services/compute/limits/gpu-a10-count/resourceAvailability") \
        .respond_with_response(jresp({"used": 2, "available": 0}))
    p = make(cfg, server)
    with pytest.raises(QuotaError) as ei:
        p.create_instance(node_request(image="ocid1.image.oc1..mine", offer=replace(offer_a10(), zone=AD2)))
    assert ei.value.scope == AD2 and AD1 not in str(ei.value)
    # what the core skips: AD-2 only; the same shape in AD-1 stays a candidate
    assert offer_a10().zone != ei.value.scope  # the scope is the AD the launch asked for
    assert "--value 3" in ei.value.hint  # used 2 in AD-2 + 1 GPU for this node


# ------------------------------------------------------------------------------------------------ item 6
@pytest.mark.parametrize("status,code", [(500, "InternalError"), (503, "ServiceUnavailable"),
                                         (429, "TooManyRequests"), (409, "Conflict")])
def test_delete_5xx_429_409_is_transient(cfg, server, status, code):
    server.expect_request(f"/20160918/subnets/{SUBNET}", method="DELETE").respond_with_response(
        err(status, code, "busy"))
    server.expect_request("/20160918/instances/ocid1.instance.oc1..i1", method="DELETE").respond_with_response(
        err(status, code, "busy"))
    server.expect_request("/20160918/instances/ocid1.instance.oc1..i1", method="GET").respond_with_response(
        jresp(instance_json("ocid1.instance.oc1..i1", "RUNNING")))
    p = make(cfg, server, conflict_wait_s=0)
    with pytest.raises(TransientError):
        p.terminate("subnet", SUBNET)
    with pytest.raises(TransientError):
        p.terminate("instance", "ocid1.instance.oc1..i1")


def test_terminate_gone_is_true(cfg, server):
    for path in (f"subnets/{SUBNET}", f"vcns/{VCN}", "instances/ocid1.instance.oc1..i1"):
        server.expect_request(f"/20160918/{path}", method="DELETE").respond_with_response(
            err(404, "NotAuthorizedOrNotFound", "gone"))
    p = make(cfg, server)
    assert p.terminate("subnet", SUBNET) and p.terminate("vcn", VCN)
    assert p.terminate("instance", "ocid1.instance.oc1..i1")


def test_run_network_deleted_in_dependency_order(cfg, server):
    """Listed VCN first (as OCI lists them), the cleanup still deletes instance -> subnet -> security list ->
    gateway -> VCN; the VCN is never tried while the subnet exists."""
    tags = {RUN_TAG: "r1", INSTALL_TAG: INST}
    common = {"compartmentId": COMP, "lifecycleState": "AVAILABLE", "freeformTags": tags}
    serve_lists(server, [{**instance_json("ocid1.instance.oc1..i1", "TERMINATED")}],
                vcns=[{**common, "id": VCN, "cidrBlocks": ["10.0.0.0/16"], "defaultRouteTableId": RT}],
                subnets=[{**common, "id": SUBNET, "vcnId": VCN, "cidrBlock": "10.0.1.0/24"}],
                internetGateways=[{**common, "id": IGW, "vcnId": VCN}],
                securityLists=[{**common, "id": SL, "vcnId": VCN}])
    server.expect_request(f"/20160918/internetGateways/{IGW}", method="GET").respond_with_response(jresp(
        {**common, "id": IGW, "vcnId": VCN}))
    server.expect_request(f"/20160918/vcns/{VCN}", method="GET").respond_with_response(jresp(
        {**common, "id": VCN, "cidrBlocks": ["10.0.0.0/16"], "defaultRouteTableId": RT}))
    server.expect_request(f"/20160918/routeTables/{RT}", method="GET").respond_with_response(jresp(
        {**common, "id": RT, "vcnId": VCN, "routeRules": []}))
    for path in (f"subnets/{SUBNET}", f"securityLists/{SL}", f"internetGateways/{IGW}", f"vcns/{VCN}"):
        server.expect_request(f"/20160918/{path}", method="DELETE").respond_with_response(Response(status=204))
    assert make(cfg, server).delete_run_network("r1") == []
    deletes = [e.path.split("/")[2] for e, _ in server.log if e.method == "DELETE"]
    assert deletes == ["subnets", "securityLists", "internetGateways", "vcns"]
    from broker.providers.oci import DELETE_ORDER

    assert DELETE_ORDER.index("subnet") < DELETE_ORDER.index("vcn")


def test_list_5xx_is_transient_at_once_not_retried_for_minutes(cfg, server):
    """Listing is what the watchdog and reconcile run: a 503 must come back as a TransientError after the client's
    own retry strategy (none here), not after the pagination helper's 8 attempts over up to 600 s."""
    server.expect_request("/20160918/instances", method="GET").respond_with_response(
        err(503, "ServiceUnavailable", "try later"))
    t0 = time.monotonic()
    with pytest.raises(TransientError) as ei:
        make(cfg, server).list_tagged("r1")
    assert ei.value.call == "list_instances" and time.monotonic() - t0 < 10
    assert len(server.log) == 1


def test_missing_sdk_is_an_actionable_error_not_a_traceback(cfg, server, monkeypatch):
    """Configured (a config dict) but without the `oci` extra: check() says what to install and a lifecycle call
    is an AuthError naming the install command, never a ModuleNotFoundError."""
    import builtins
    import sys

    from broker.core.provider import AuthError

    real_import = builtins.__import__

    def no_oci(name, *a, **k):
        if name == "oci" or name.startswith("oci."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_oci)
    for mod in [m for m in sys.modules if m == "oci" or m.startswith("oci.")]:
        monkeypatch.delitem(sys.modules, mod)
    p = make(cfg, server)
    chk = p.check()
    assert not chk.configured and "not installed" in chk.detail and "pip install" in chk.hint
    with pytest.raises(AuthError, match="not installed") as ei:
        p.list_tagged("r1")
    assert "pip install" in str(ei.value)
    assert p.offers(__import__("broker.core.model", fromlist=["Requirements"]).Requirements())  # snapshot still plans


def test_boot_wait_command_waits_for_cloud_init_then_the_marker(tmp_path):
    """The command the core runs after SSH accepts logins: `cloud-init status --wait`, then boot.done; it fails
    until the boot script has really finished (item 3)."""
    from broker.providers.oci.scripts import boot_wait_command

    bash = shutil.which("bash")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for t in ("mkdir", "date", "id", "chown", "timeout", "test"):
        if shutil.which(t):
            (bindir / t).symlink_to(shutil.which(t))
    calls = tmp_path / "cloud-init.calls"
    fake = bindir / "cloud-init"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\nexit 1\n')  # "error": a step of user data failed
    fake.chmod(0o755)
    work = tmp_path / "work"
    cmd = boot_wait_command(str(work))
    env = {"PATH": str(bindir)}
    assert subprocess.run([bash, "-c", cmd], env=env, timeout=30).returncode != 0  # booting: no marker yet
    ud = cloud_init("10.0.0.0/16", done_file=f"{work}/job.done")
    assert subprocess.run([bash, "-c", ud], env=env, capture_output=True, timeout=30).returncode == 0
    assert subprocess.run([bash, "-c", cmd], env=env, timeout=30).returncode == 0  # the marker is the truth
    assert calls.read_text().splitlines()[0] == "status --wait"
    assert OCIProvider().boot_wait_command("opc").endswith("test -e /home/opc/broker/boot.done")


def test_delete_conflict_wait_is_bounded(cfg, server):
    """A VCN delete that keeps answering 409 is retried with backoff for ``conflict_wait_s`` seconds of waiting,
    then raised as TransientError for the core to retry later (item 6: never an endless adapter-side loop)."""
    server.expect_request(f"/20160918/vcns/{VCN}", method="DELETE").respond_with_response(
        err(409, "Conflict", "The Vcn has one or more dependent resources"))
    slept: list[float] = []
    p = OCIProvider(config=cfg, service_endpoint=server.url_for("").rstrip("/"), compartment_id=COMP,
                    retry_strategy=oci.retry.NoneRetryStrategy(),
                    circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy(),
                    conflict_wait_s=20, sleep=slept.append)
    with pytest.raises(TransientError) as ei:
        p.terminate("vcn", VCN)
    assert ei.value.status == 409 and slept == [2, 4, 8, 15] and len(server.log) == 5


def test_sdk_refusing_a_request_is_named_not_ambiguous(cfg, server):
    """An id the SDK itself rejects (nothing sent) is a ProviderError naming the call, never a raw ValueError
    nor an AmbiguousCreate."""
    p = make(cfg, server)
    with pytest.raises(ProviderError) as ei:
        p.describe_instance(" ")
    # refused by the adapter's OCID check before the SDK sees it (the SDK's own "invalid request" behind it)
    assert ei.value.call == "get_instance" and "nothing was sent" in ei.value.message
    assert not isinstance(ei.value, TransientError) and len(server.log) == 0
