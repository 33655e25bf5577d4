"""A ledger row is data, not a command: crafted ledgers (a real SQLite file) cannot make broker send a request to
a path of the attacker's choosing, nor terminate what the provider does not show with this installation's and
run's tags.  Providers: the Vast emulator (tests/support/vast_emulator.py), moto in server mode, the real oci SDK against
tests/support/oci_emulator.py, and the file-backed fake cloud."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta

import pytest

from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.core.records import Run
from tests.conftest import broker_cmd

from tests.support.vast_emulator import API_KEY as KEY  # noqa: E402
TRAVERSAL = "../../v0/ssh/31337"


def crafted(home, provider: str, provider_id: str, *, run_id: str = "run-crafted", kind: str = "instance",
            state: str = "running", age_s: float = 3600.0, deadline_s: float = 3600.0) -> tuple[Ledger, str]:
    """A ledger under ``home`` with one run and one live row naming ``provider_id`` (as an attacker with write
    access to the file, or a damaged file, would leave it)."""
    lg = Ledger(home / "ledger.sqlite")
    now = utcnow()
    lg.create_run(Run(id=run_id, name="crafted", provider=provider, status="running", created_at=now,
                      deadline=now + timedelta(seconds=deadline_s)))
    rid = lg.record_intent(run_id, provider, kind, f"broker-{run_id}-n0", usd_per_hour=1.0).id
    lg.mark_created(rid, provider_id, state=state)
    lg.update_resource(rid, created_at=now - timedelta(seconds=age_s))
    return lg, rid


# --------------------------------------------------------------------------------------------------- ids
@pytest.mark.parametrize("provider,kind,good,bad", [
    ("vast", "instance", ["31337", "1"], [TRAVERSAL, "31337/", "31337 ", "-1", "1e3", "", "３"]),
    ("oci", "instance", ["ocid1.instance.oc1.phx.anyhqljtexample", "ocid1.instance.oc1..e0001",
                         "ocid1.vcn.oc1.iad.amaaaaaa.abc"], ["ocid1.instance.oc1.phx/../x", "i-0123456789abcdef0",
                                                             "ocid1..", "../ocid1.instance.oc1..e1"]),
    ("aws", "instance", ["i-0123456789abcdef0", "i-1234abcd"], ["sg-0123456789abcdef0", "i-../x", "i-XYZ", ""]),
    ("aws", "security_group", ["sg-0123456789abcdef0"], ["i-0123456789abcdef0", "sg-"]),
    ("aws", "placement_group", ["broker-run-1"], ["../x", "a/b"]),
    ("fake", "instance", ["fake-i-0123456789"], ["../x", "a/b", "a b", "..", "x\n"]),
])
def test_ids_are_validated_per_provider(provider, kind, good, bad):
    from broker.providers import get_provider

    cls = type(get_provider(provider))
    assert all(cls.valid_id(kind, g) for g in good), [g for g in good if not cls.valid_id(kind, g)]
    assert not any(cls.valid_id(kind, b) for b in bad), [b for b in bad if cls.valid_id(kind, b)]


def test_core_holds_no_cloud_id_regex():
    """The id forms live on the adapters; the core asks them through the Provider contract."""
    from tests.conftest import REPO

    for f in ("money/teardown.py", "money/provision.py", "money/reconcile.py", "money/cost.py", "money/watchdog.py",
              "cli/lifecycle.py"):
        text = (REPO / "broker" / f).read_text()
        assert "ocid1" not in text and '"i-' not in text and "[0-9]{" not in text, f


# --------------------------------------------------------------------------------------------------- vast traversal
@pytest.fixture
def vast_emu(monkeypatch):
    from tests.support.vast_emulator import VastEmulator

    emu = VastEmulator(None)
    monkeypatch.setenv("VAST_API_URL", emu.url)
    monkeypatch.setenv("VAST_API_KEY", KEY)
    try:
        yield emu
    finally:
        emu.close()


def test_traversal_id_sends_no_request_with_the_key(vast_emu, broker_home, cli_env):
    """The exact case: provider id ``../../v0/ssh/31337`` made `broker down` send ``DELETE /api/v0/ssh/31337/``
    with the account key.  Now nothing is sent for it, the row stays live and the reason names it."""
    victim = vast_emu.add_instance("not-broker")  # an instance of the account that broker never tagged
    crafted(broker_home, "vast", TRAVERSAL)
    env = dict(cli_env, VAST_API_URL=vast_emu.url, VAST_API_KEY=KEY)
    r = subprocess.run(broker_cmd("down", "run-crafted"), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 4, r.stdout + r.stderr
    paths = [(m, p) for m, p, _ in vast_emu.calls]
    assert not [c for c in paths if c[0] == "DELETE"], paths
    assert not [p for _, p in paths if "ssh" in p or ".." in p], paths
    assert TRAVERSAL in r.stdout + r.stderr and "refused" in (r.stdout + r.stderr)
    assert victim in vast_emu.instances
    lg = Ledger(broker_home / "ledger.sqlite")
    (row,) = lg.resources("run-crafted")
    assert row.state == "running" and "refused" in row.error and TRAVERSAL in row.error


def test_adapter_refuses_and_escapes_before_any_request(vast_emu):
    from broker.core.provider import ProviderError
    from broker.providers.vast import VastProvider

    p = VastProvider(max_attempts=1)
    for verb in (lambda: p.terminate("instance", TRAVERSAL), lambda: p.describe_instance(TRAVERSAL),
                 lambda: p.prepare_access(TRAVERSAL, "ssh-ed25519 AAAA k")):
        with pytest.raises(ProviderError) as e:
            verb()
        assert "digits" in e.value.message and TRAVERSAL in e.value.message
    assert vast_emu.calls == []


def test_vast_row_the_account_holds_without_our_label_is_refused(vast_emu, broker_home):
    """A crafted row naming a real instance of the account (another tool's, no broker label): named, not
    terminated; an instance broker labelled for this installation and run is terminated."""
    from broker.providers.vast import VastProvider, make_label
    from broker.money.teardown import teardown_run

    lg, _ = crafted(broker_home, "vast", "0")
    other = vast_emu.add_instance("my-jupyter-box")
    lg.update_resource(lg.resources("run-crafted")[0].id, provider_id=str(other))
    ours = vast_emu.add_instance(make_label("run-ours", 0, lg.installation_id, "r-tok"))
    lg.create_run(Run(id="run-ours", name="ours", provider="vast", status="running", created_at=utcnow()))
    rid = lg.record_intent("run-ours", "vast", "instance", "broker-run-ours-n0").id
    lg.mark_created(rid, str(ours), state="running")
    p = VastProvider(max_attempts=1, delete_timeout_s=5)
    said: list[str] = []
    left = teardown_run(lg, "run-crafted", "down", providers={"vast": p}, say=said.append, confirm_timeout_s=5,
                        poll_s=0.1)
    assert [r.provider_id for r in left] == [str(other)]
    assert vast_emu.deletes_of(other) == 0 and other in vast_emu.instances
    assert any("refused" in s and str(other) in s for s in said), said
    assert teardown_run(lg, "run-ours", "down", providers={"vast": p}, confirm_timeout_s=5, poll_s=0.1) == []
    assert vast_emu.deletes_of(ours) == 1


# --------------------------------------------------------------------------------------------------- fake cloud
@pytest.fixture
def fake(tmp_path, fake_cloud):
    from broker.providers.fake import FakeProvider

    home = fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    home.mkdir(parents=True, exist_ok=True)
    return FakeProvider(), home


def _fake_instance(p, run_id: str, installation_id: str | None, tagged: bool = True) -> str:
    from broker.core.records import NodeRequest
    from broker.core.model import Requirements

    offer = next(o for o in p.offers(Requirements()) if o.gpu_count == 1)
    pid = p.create_instance(NodeRequest(run_id=run_id, node_index=0, name=f"broker-{run_id}-n0", offer=offer,
                                        ssh_public_key="k", client_token=f"t-{run_id}", tags={"broker-run": run_id},
                                        installation_id=installation_id))
    if not tagged:
        with p._state() as st:
            st["instances"][pid]["tags"] = {}
    return pid


@pytest.mark.parametrize("case", ["untagged", "other-installation", "other-run"])
def test_down_terminates_only_what_the_provider_tags_as_ours(fake, case):
    from typer.testing import CliRunner

    from broker.cli.app import app

    p, home = fake
    lg = Ledger(home / "ledger.sqlite")
    pid = _fake_instance(p, "run-other" if case == "other-run" else "run-crafted",
                         "bi-someone-else" if case == "other-installation" else lg.installation_id,
                         tagged=case != "untagged")
    crafted(home, "fake", pid)
    r = CliRunner().invoke(app, ["down", "run-crafted"])
    assert r.exit_code == 4, r.output
    assert p.instances()[pid]["state"] != "terminated"
    assert "refused" in r.output and pid in r.output
    assert "broker did not create it" in r.output or "carries" in r.output
    assert "1 ledger row(s) refused" in r.output and "delete them in the provider's console" not in r.output


def test_watchdog_does_not_terminate_a_crafted_row_past_its_deadline(fake):
    from broker.money.watchdog import Watchdog

    p, home = fake
    lg = Ledger(home / "ledger.sqlite")
    pid = _fake_instance(p, "run-crafted", None, tagged=False)
    crafted(home, "fake", pid, deadline_s=-60)
    mine = _fake_instance(p, "run-mine", lg.installation_id)
    crafted(home, "fake", mine, run_id="run-mine", deadline_s=-60)
    w = Watchdog(lg, providers={"fake": p}, interval_s=0.1, confirm_timeout_s=2, home=home)
    w.run_once()
    assert p.instances()[pid]["state"] != "terminated"
    assert p.instances()[mine]["state"] == "terminated"
    row = [r for r in lg.resources("run-crafted")][0]
    assert row.state != "terminated" and "refused" in row.error


def test_unreadable_tags_never_count_as_ours(fake, monkeypatch):
    """While the provider's list cannot be read, `down` does not terminate (it cannot tell whose it is); once
    it can, the same row goes."""
    from broker.money.teardown import teardown_run

    p, home = fake
    lg = Ledger(home / "ledger.sqlite")
    pid = _fake_instance(p, "run-crafted", lg.installation_id)
    crafted(home, "fake", pid)
    monkeypatch.setenv("BROKER_FAKE_FAIL", "list")
    left = teardown_run(lg, "run-crafted", "down", providers={"fake": p}, confirm_timeout_s=1, poll_s=0.05,
                        retry_s=0)
    assert left and p.instances()[pid]["state"] != "terminated"
    monkeypatch.setenv("BROKER_FAKE_FAIL", "")
    assert teardown_run(lg, "run-crafted", "down", providers={"fake": p}, confirm_timeout_s=1, poll_s=0.05) == []
    assert p.instances()[pid]["state"] == "terminated"


def test_reconcile_ignores_a_terminated_row_naming_another_installations_object(fake):
    """A (crafted or stale) terminated row for another installation's tagged instance does not make it an orphan
    of ours."""
    from broker.money.reconcile import reconcile

    p, home = fake
    lg = Ledger(home / "ledger.sqlite")
    pid = _fake_instance(p, "run-theirs", "bi-someone-else")
    _, rid = crafted(home, "fake", pid, run_id="run-theirs")
    lg.update_resource(rid, state="terminated")
    rep = reconcile(lg, {"fake": p}, terminate=True, min_age_s=0, confirm_timeout_s=1, poll_s=0.05)
    assert [t.provider_id for t in rep.foreign] == [pid] and rep.orphans == []
    assert p.instances()[pid]["state"] != "terminated"


# --------------------------------------------------------------------------------------------------- aws (moto)
@pytest.fixture
def moto(monkeypatch):
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def test_aws_instance_without_our_tags_is_refused(moto, broker_home):
    import boto3

    from broker.core.provider import INSTALL_TAG, RUN_TAG
    from broker.providers.aws import AWSProvider
    from broker.money.teardown import teardown_run

    session = boto3.session.Session(region_name="us-east-1")
    ec2 = session.client("ec2", endpoint_url=moto)
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    theirs = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="t3.micro")["Instances"][0]
    lg, _ = crafted(broker_home, "aws", theirs["InstanceId"])
    tags = [{"ResourceType": "instance", "Tags": [{"Key": RUN_TAG, "Value": "run-ours"},
                                                  {"Key": INSTALL_TAG, "Value": lg.installation_id}]}]
    ours = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="t3.micro",
                             TagSpecifications=tags)["Instances"][0]["InstanceId"]
    lg.create_run(Run(id="run-ours", name="ours", provider="aws", status="running", created_at=utcnow()))
    rid = lg.record_intent("run-ours", "aws", "instance", "broker-run-ours-n0", region="us-east-1").id
    lg.mark_created(rid, ours, state="running")
    p = AWSProvider(session=session, endpoint_url=moto, region="us-east-1")
    left = teardown_run(lg, "run-crafted", "down", providers={"aws": p}, confirm_timeout_s=5, poll_s=0.1)
    assert [r.provider_id for r in left] == [theirs["InstanceId"]] and "refused" in left[0].error
    state = ec2.describe_instances(InstanceIds=[theirs["InstanceId"]])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] == "running"
    assert teardown_run(lg, "run-ours", "down", providers={"aws": p}, confirm_timeout_s=30, poll_s=0.2) == []


# --------------------------------------------------------------------------------------------------- oci emulator
def test_oci_instance_of_another_installation_is_refused(broker_home, key_pem):
    pytest.importorskip("oci")
    import oci

    from broker.providers.oci import OCIProvider
    from broker.money.teardown import teardown_run
    from tests.support.oci_emulator import OCIEmulator

    comp = "ocid1.compartment.oc1..aaaaaaaatrust"
    with OCIEmulator(compartment=comp, terminate_s=0.1) as emu:
        lg = Ledger(broker_home / "ledger.sqlite")
        theirs = emu.add_instance(tags={"broker-run": "run-crafted", "broker-install": "bi-someone-else"})
        ours = emu.add_instance(tags={"broker-run": "run-ours", "broker-install": lg.installation_id})
        crafted(broker_home, "oci", theirs)
        lg.create_run(Run(id="run-ours", name="ours", provider="oci", status="running", created_at=utcnow()))
        rid = lg.record_intent("run-ours", "oci", "instance", "broker-run-ours-n0").id
        lg.mark_created(rid, ours, state="running")
        cfg = {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": "ocid1.tenancy.oc1..aaaaaaaatenancy",
               "key_content": key_pem, "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff",
               "region": "us-ashburn-1"}
        p = OCIProvider(config=cfg, service_endpoint=emu.url, compartment_id=comp,
                        retry_strategy=oci.retry.NoneRetryStrategy(),
                        circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy())
        left = teardown_run(lg, "run-crafted", "down", providers={"oci": p}, confirm_timeout_s=5, poll_s=0.1)
        assert [r.provider_id for r in left] == [theirs] and "bi-someone-else" in left[0].error
        assert not [j for j in emu.journal if j[0] in ("DELETE", "POST") and theirs in j[1]]
        assert teardown_run(lg, "run-ours", "down", providers={"oci": p}, confirm_timeout_s=10, poll_s=0.2) == []
        left = teardown_run(lg, "run-crafted", "down", providers={"oci": p}, confirm_timeout_s=5, poll_s=0.1)
        assert left  # still refused on a second try, still named


def test_status_json_shows_the_refusal(fake):
    """The refused row stays loud: `broker status --json` lists it live with the reason."""
    from typer.testing import CliRunner

    from broker.cli.app import app

    p, home = fake
    pid = _fake_instance(p, "run-crafted", None, tagged=False)
    crafted(home, "fake", pid)
    CliRunner().invoke(app, ["down", "run-crafted"])
    r = CliRunner().invoke(app, ["status", "--json", "--no-refresh"])
    live = json.loads(r.output)["live_resources"]
    assert [x["provider_id"] for x in live] == [pid] and "refused" in live[0]["error"]
