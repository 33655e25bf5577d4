"""``broker down`` / ``broker reconcile`` through the CLI, and the per-run SSH key."""

from __future__ import annotations

import json
import stat
import subprocess
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from broker.cli.app import app
from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.core.records import Run
from broker.core.records import NodeRequest
from broker.providers.fake import FakeProvider


@pytest.fixture
def env(tmp_path, fake_cloud):
    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    return tmp_path


def _ledger() -> Ledger:
    from broker.core.config import ledger_path

    return Ledger(ledger_path())


def _instance(p: FakeProvider, lg: Ledger, run_id: str, i: int = 0, *, record: bool = True) -> str:
    """A running fake instance, recorded ledger-first like provision does (or not at all)."""
    offer = next(o for o in p.offers(_req()) if o.gpu_count == 1)
    name = f"broker-{run_id}-n{i}"
    rid = lg.record_intent(run_id, "fake", "instance", name, usd_per_hour=offer.usd_per_hour).id if record else f"t{i}"
    pid = p.create_instance(NodeRequest(run_id=run_id, node_index=i, name=name, offer=offer, ssh_public_key="k",
                                        client_token=rid, tags={"broker-run": run_id},
                                        installation_id=lg.installation_id))
    if record:
        lg.mark_created(rid, pid)
    return pid


def _req():
    from broker.core.model import Requirements

    return Requirements()


def _run(lg: Ledger, run_id: str) -> None:
    now = utcnow()
    lg.create_run(Run(id=run_id, name="t", provider="fake", status="running", created_at=now,
                      deadline=now + timedelta(hours=1)))


def test_down_terminates_every_resource_of_the_run_idempotently(env):
    p, lg = FakeProvider(), _ledger()
    _run(lg, "run-a")
    _run(lg, "run-b")
    a0, a1 = _instance(p, lg, "run-a", 0), _instance(p, lg, "run-a", 1)
    b0 = _instance(p, lg, "run-b", 0)
    r = CliRunner().invoke(app, ["down", "run-a", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert {x["id"] for x in out["resources"]} == {a0, a1} and out["still_live"] == []
    inst = p.instances()
    assert inst[a0]["state"] == inst[a1]["state"] == "terminated" and inst[b0]["state"] != "terminated"
    again = CliRunner().invoke(app, ["down", "run-a"])  # idempotent
    assert again.exit_code == 0 and "0 live resource(s)" in again.output
    r = CliRunner().invoke(app, ["down", "--all", "--yes"])
    assert r.exit_code == 0, r.output
    assert p.instances()[b0]["state"] == "terminated"


def test_down_exits_4_and_says_what_to_do_when_terminate_fails(env, monkeypatch):
    p, lg = FakeProvider(), _ledger()
    _run(lg, "run-a")
    a0 = _instance(p, lg, "run-a")
    monkeypatch.setenv("BROKER_FAKE_FAIL", "terminate")
    r = CliRunner().invoke(app, ["down", "run-a"])
    assert r.exit_code == 4
    assert "STILL LIVE" in r.output and a0 in r.output and "broker down run-a" in r.output
    row = lg.find_by_provider_id("fake", a0)
    assert row.live and "HTTP 500" in row.error
    monkeypatch.delenv("BROKER_FAKE_FAIL")
    assert CliRunner().invoke(app, ["down", "run-a"]).exit_code == 0
    assert lg.find_by_provider_id("fake", a0).state == "terminated"


def test_down_unknown_run_is_bad_input(env):
    r = CliRunner().invoke(app, ["down", "nope"])
    assert r.exit_code != 0 and "no run 'nope'" in str(r.exception)


def test_reconcile_lists_then_terminates_orphans(env):
    p, lg = FakeProvider(), _ledger()
    _run(lg, "run-a")
    known = _instance(p, lg, "run-a", 0)
    orphan = _instance(p, lg, "ghost", 0, record=False)
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--json", "--min-age", "0"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert [o["provider_id"] for o in out["orphans"]] == [orphan] and out["known"] == 1
    assert p.instances()[orphan]["state"] != "terminated"  # listing never terminates
    # non-interactive --terminate without --yes refuses
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--terminate", "--min-age", "0"])
    assert r.exit_code != 0 and p.instances()[orphan]["state"] != "terminated"
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--terminate", "--yes", "--min-age", "0"])
    assert r.exit_code == 0, r.output
    assert p.instances()[orphan]["state"] == "terminated" and p.instances()[known]["state"] != "terminated"
    row = lg.find_by_provider_id("fake", orphan)
    assert row.state == "terminated" and row.terminated_by == "reconcile"
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake"])
    assert "no orphans" in r.output


def test_reconcile_reopens_a_row_the_ledger_wrongly_has_as_terminated(env):
    p, lg = FakeProvider(), _ledger()
    _run(lg, "run-a")
    iid = _instance(p, lg, "run-a")
    row = lg.find_by_provider_id("fake", iid)
    lg.update_resource(row.id, state="terminated")  # the ledger believes it is gone; the cloud disagrees
    r = CliRunner().invoke(app, ["reconcile", "--terminate", "--yes", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["terminated"] == [row.id]
    assert p.instances()[iid]["state"] == "terminated"
    assert "orphan" in [e["action"] for e in lg.events("run-a")]


def test_ssh_key_is_fresh_0600_and_valid_openssh(env):
    from broker.core import sshkeys
    a = sshkeys.generate(env / "r1")
    b = sshkeys.generate(env / "r2")
    assert a.public_key != b.public_key and a.public_key.startswith("ssh-ed25519 ")
    assert stat.S_IMODE(a.private_key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(a.private_key_path.parent.stat().st_mode) == 0o700
    assert a.private_key_path.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    assert "PRIVATE" not in repr(a)
    assert sshkeys.generate(env / "r1").public_key == a.public_key  # reused within a run
    if subprocess.run(["which", "ssh-keygen"], capture_output=True).returncode == 0:
        out = subprocess.run(["ssh-keygen", "-y", "-f", str(a.private_key_path)], capture_output=True, text=True,
                             timeout=10)
        assert out.stdout.split()[:2] == a.public_key.split()[:2]
        fp = subprocess.run(["ssh-keygen", "-lf", str(a.public_key_path)], capture_output=True, text=True, timeout=10)
        assert a.fingerprint in fp.stdout


def test_down_and_status_say_when_a_prefix_is_ambiguous(tmp_path):
    """`broker down 2026` with several runs said "no run '2026' in the ledger"; it must say the prefix is ambiguous."""
    from typer.testing import CliRunner

    from broker.cli.app import app
    from broker.money.ledger import Ledger
    from broker.core.records import Run
    from broker.core.provider import BadInput

    lg = Ledger()
    for rid in ("20261130-010101-aaaaaa", "20261130-020202-bbbbbb"):
        lg.create_run(Run(id=rid, name="x"))
    for cmd in (["down", "2026"], ["status", "2026"]):
        r = CliRunner().invoke(app, cmd)
        assert isinstance(r.exception, BadInput) and "matches 2 runs" in str(r.exception), cmd
    r = CliRunner().invoke(app, ["down", "nosuch"])
    assert isinstance(r.exception, BadInput) and "no run 'nosuch'" in str(r.exception)
    r = CliRunner().invoke(app, ["status", "20261130-02"])
    assert r.exit_code == 0 and "20261130-020202-bbbbbb" in r.output
