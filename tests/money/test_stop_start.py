"""`broker stop` / `broker start`: the ledger's stopped state (schema 2, migrated from schema 1), the money model
that bills a stopped machine its disk only, the watchdog leaving held machines to their deadline, and the three
clouds' stop / start at their real boundaries (the Vast emulator, the real oci SDK against the OCI emulator, moto)."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from broker.core.model import utcnow
from broker.core.records import Resource, Run
from broker.money.accounting import now_sql_params, resource_cost, spent_usd_sql
from broker.money.ledger import SCHEMA_VERSION, Ledger
from tests.conftest import REPO
from tests.support.ledgers import schema_1_ledger



def _run(ledger: Ledger, provider: str, *, status: str = "succeeded", budget: float | None = None) -> Run:
    now = utcnow()
    run = Run(id="20261202-000000-" + provider[:6].ljust(6, "x"), name="kept", provider=provider,
              topology="simulated", status=status, created_at=now - timedelta(hours=1), ended_at=now,
              deadline=now + timedelta(hours=1), budget_usd=budget, recipe={"max_hours": 2.0})
    return ledger.create_run(run)


def _instance(ledger: Ledger, run: Run, provider: str, provider_id: str, rate: float = 2.0, **attrs) -> Resource:
    res = ledger.record_intent(run.id, provider, "instance", "node0", usd_per_hour=rate, attrs=attrs)
    ledger.mark_created(res.id, provider_id, state="running")
    ledger.update_resource(res.id, created_at=utcnow() - timedelta(hours=1))
    return ledger.resource(res.id)


def _sql_spent(ledger: Ledger, rid: str, now) -> float:
    return ledger._db.execute(f"SELECT {spent_usd_sql()} FROM resources WHERE id = :rid",
                              {**now_sql_params(now), "rid": rid}).fetchone()[0]


# ------------------------------------------------------------------------------------------- ledger + money
def test_a_schema_1_ledger_is_migrated_on_open_and_its_rows_keep_their_cost(tmp_path):
    path = tmp_path / "ledger.sqlite"
    db = schema_1_ledger(path)
    t0 = (utcnow() - timedelta(hours=2)).isoformat()
    db.execute("INSERT INTO runs (id, name, status, created_at, provider, topology) VALUES "
               "('r1', 'old', 'succeeded', ?, 'vast', 'simulated')", (t0,))
    db.execute("INSERT INTO resources (id, run_id, provider, kind, name, provider_id, state, usd_per_hour, "
               "created_at, attrs) VALUES ('x1', 'r1', 'vast', 'instance', 'n0', '123', 'running', 1.5, ?, '{}')",
               (t0,))
    db.commit()
    db.close()
    led = Ledger(path)
    cols = {r[1] for r in led._db.execute("PRAGMA table_info(resources)")}
    assert {"stopped_at", "stopped_usd_per_hour", "banked_usd", "rate_since"} <= cols
    assert led._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    res = led.resource("x1")
    assert res is not None and res.banked_usd == 0.0 and res.rate_since is None
    now = utcnow()
    assert resource_cost(res, None, now).spent_usd == pytest.approx(3.0, rel=1e-3)
    assert _sql_spent(led, "x1", now) == pytest.approx(resource_cost(res, None, now).spent_usd, abs=1e-9)
    led.close()
    Ledger(path).close()  # a second open of the migrated file adds nothing (no duplicate column error)


def test_a_stopped_row_bills_its_disk_rate_in_python_and_in_sql(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    run = _run(led, "vast")
    res = _instance(led, run, "vast", "31001", rate=2.0)
    t_stop = utcnow()
    led.update_resource(res.id, state="stopping", stopped_usd_per_hour=0.05)
    mid = led.resource(res.id)
    assert resource_cost(mid, run, t_stop).usd_per_hour == 2.0  # full rate until the stop is confirmed
    led.change_rate(res.id, "stopped", at=t_stop, actor="test")
    res = led.resource(res.id)
    assert res.state == "stopped" and res.stopped_at is not None and res.banked_usd == pytest.approx(2.0, rel=1e-3)
    later = t_stop + timedelta(hours=10)
    c = resource_cost(res, run, later)
    assert c.usd_per_hour == 0.05
    assert c.spent_usd == pytest.approx(2.0 + 0.5, rel=1e-3)  # 1 h at $2 + 10 h at $0.05
    assert _sql_spent(led, res.id, later) == pytest.approx(c.spent_usd, abs=1e-9)
    assert led.cost_totals(later)["vast"][1] == pytest.approx(c.spent_usd, abs=1e-9)
    # started again: the full rate from the start request on
    led.change_rate(res.id, "starting", at=later, actor="test")
    res = led.resource(res.id)
    c2 = resource_cost(res, run, later + timedelta(hours=1))
    assert c2.usd_per_hour == 2.0 and c2.spent_usd == pytest.approx(2.5 + 2.0, rel=1e-3)
    assert _sql_spent(led, res.id, later + timedelta(hours=1)) == pytest.approx(c2.spent_usd, abs=1e-9)


def test_the_watchdog_leaves_a_stopped_machine_to_its_own_deadline(tmp_path):
    from tests.support.clock import FakeClock
    from broker.money.watchdog import Watchdog

    from broker.core.provider import Provider

    class Never(Provider):
        name = "vast"

        def terminate(self, *a, **k):
            calls.append(a)
            return True

        def describe_instance(self, pid, region=None):
            from broker.core.records import InstanceInfo
            return InstanceInfo(provider_id=pid, state="terminated" if calls else "stopped")

        def list_tagged(self, run_id=None):
            return []

    calls: list = []
    led = Ledger(tmp_path / "l.sqlite")
    run = _run(led, "vast")
    led.update_run(run.id, ended_at=utcnow() - timedelta(hours=1))  # ended long ago: rule (c) would apply
    res = _instance(led, run, "vast", "31001")
    led.change_rate(res.id, "stopped", at=utcnow(), actor="test", stopped_usd_per_hour=0.05,
                    deadline=utcnow() + timedelta(hours=24))
    clock = FakeClock()
    wd = Watchdog(led, providers={"vast": Never()}, clock=clock, home=tmp_path)
    wd.run_once()
    assert not calls and led.resource(res.id).state == "stopped"
    clock.advance(25 * 3600)  # past the stopped disk's deadline: deleted like any other
    wd.run_once()
    assert calls and led.resource(res.id).state == "terminated"


@pytest.mark.parametrize("provider", ["local", "netns", "slurm"])
def test_providers_that_cannot_stop_are_refused_naming_what_to_do(tmp_path, provider):
    from broker.cli.stopstart import stop_run
    from broker.core.provider import BadInput

    led = Ledger(tmp_path / "l.sqlite")
    run = _run(led, provider)
    _instance(led, run, provider, "n-0")
    with pytest.raises(BadInput) as e:
        stop_run(led, run.id)
    assert "cannot be stopped" in e.value.message and f"broker down {run.id}" in e.value.hint
    assert "vast" in e.value.hint and "aws" in e.value.hint


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "cli-alive"])
def test_a_local_run_is_refused_with_its_providers_reason_whatever_its_state(tmp_path, ended):
    """`broker stop` of a local run said "has no live machines" (ended) or "wait for the job ... --idle-minutes"
    (CLI alive): neither leads anywhere; the reason the local provider declares comes first."""
    import os

    from broker.cli.stopstart import start_run, stop_run
    from broker.core.provider import BadInput

    led = Ledger(tmp_path / "l.sqlite")
    if ended:
        run = _run(led, "local")
        led.update_run(run.id, status="succeeded", ended_at=utcnow())
    else:
        run = _run(led, "local", status="running")
        led.update_run(run.id, pid=os.getpid())
    for verb in (stop_run, start_run):
        with pytest.raises(BadInput) as e:
            verb(led, run.id)
        assert "cannot be stopped" in e.value.message and "processes on this machine" in e.value.message
        assert f"broker down {run.id}" in e.value.hint


def test_a_run_whose_cli_still_drives_the_job_is_not_stopped(tmp_path):
    import os

    from broker.cli.stopstart import stop_run
    from broker.core.provider import BadInput

    led = Ledger(tmp_path / "l.sqlite")
    run = _run(led, "vast", status="running")
    led.update_run(run.id, pid=os.getpid())
    _instance(led, run, "vast", "31001")
    with pytest.raises(BadInput, match="still running"):
        stop_run(led, run.id)


# ------------------------------------------------------------------------------------------- Vast.ai
@pytest.fixture
def vast():
    from broker.providers.vast import VastProvider
    from tests.support.vast_emulator import API_KEY, VastEmulator

    emu = VastEmulator(None, hostless=True, boot_s=0.2)
    p = VastProvider(api_key=API_KEY, api_url=emu.url, sleep=lambda s: None)
    try:
        yield emu, p
    finally:
        p.close()
        emu.close()


def test_vast_stop_is_ledger_first_bills_storage_and_start_brings_it_back(tmp_path, vast):
    from broker.cli.stopstart import start_run, stop_run

    emu, p = vast
    iid = emu.add_instance("other", age_s=3600)
    led = Ledger(tmp_path / "l.sqlite")
    run = _run(led, "vast")
    res = _instance(led, run, "vast", str(iid))
    seen: list[str] = []
    real_stop, real_start = p.stop, p.start

    def stop(pid, region=None):
        seen.append(led.resource(res.id).state)  # what the ledger said while the call was made
        real_stop(pid, region=region)

    def start(pid, region=None):
        seen.append(led.resource(res.id).state)
        real_start(pid, region=region)

    p.stop, p.start = stop, start
    rows = stop_run(led, run.id, hours=5, poll_s=0.05, providers={"vast": p})
    assert ("PUT", f"/api/v0/instances/{iid}/", {"state": "stopped"}) in emu.calls
    assert seen == ["stopping"] and rows[0]["state"] == "stopped"
    stopped = led.resource(res.id)
    # storage_cost 0.1 $/GB/month x 200 GB / 720 h
    assert stopped.state == "stopped" and stopped.stopped_usd_per_hour == pytest.approx(0.1 * 200 / 720)
    assert stopped.deadline is not None and stopped.deadline > utcnow() + timedelta(hours=4.9)
    assert resource_cost(stopped, run, utcnow()).usd_per_hour == pytest.approx(0.1 * 200 / 720)
    assert [e["action"] for e in led.events(run.id)][-2:] == ["stopping", "stopped"]

    out = start_run(led, run.id, hours=1, poll_s=0.05, providers={"vast": p}, ssh_check=False)
    assert ("PUT", f"/api/v0/instances/{iid}/", {"state": "running"}) in emu.calls
    assert seen == ["stopping", "starting"] and out[0]["state"] == "running"
    back = led.resource(res.id)
    assert back.state == "running" and back.attrs.get("restarted_at") and back.stopped_at is None
    assert resource_cost(back, run, utcnow()).usd_per_hour == 2.0


def test_vast_start_refused_over_budget_says_how_long_fits(tmp_path, vast):
    from broker.cli.stopstart import start_run, stop_run
    from broker.core.provider import NoValidPlan

    emu, p = vast
    iid = emu.add_instance("x", age_s=3600)
    led = Ledger(tmp_path / "l.sqlite")
    run = _run(led, "vast", budget=3.0)  # $2 spent in the hour it ran
    _instance(led, run, "vast", str(iid))
    stop_run(led, run.id, poll_s=0.05, providers={"vast": p})
    with pytest.raises(NoValidPlan) as e:
        start_run(led, run.id, hours=2, providers={"vast": p}, ssh_check=False)
    assert "over its budget" in e.value.message and "--hours 0.4" in e.value.hint
    assert not [c for c in emu.calls if c[2] == {"state": "running"}]  # nothing was asked of Vast


# ------------------------------------------------------------------------------------------- OCI
def test_oci_stop_and_start_with_the_real_sdk_refresh_the_address(tmp_path, key_pem, monkeypatch):
    oci = pytest.importorskip("oci")
    from broker.cli.stopstart import start_run, stop_run
    from broker.providers.oci import OCIProvider
    from tests.support.oci_emulator import OCIEmulator

    comp = "ocid1.compartment.oc1..aaaaaaaacomp"
    with OCIEmulator(compartment=comp, boot_s=0.2, restart_addresses=lambda n: "198.51.100.7") as emu:
        iid = emu.add_instance(tags={"broker-run": "r"})
        inst = emu.objs["instances"][iid]
        inst["shape"] = "VM.Standard.E4.Flex"
        vid, aid = emu.new_id("vnic"), emu.new_id("vnicattachment")
        emu.objs["vnics"][vid] = {"id": vid, "compartmentId": comp, "isPrimary": True, "privateIp": "10.0.1.5",
                                  "publicIp": "198.51.100.2", "lifecycleState": "AVAILABLE"}
        emu.objs["vnicAttachments"][aid] = {"id": aid, "compartmentId": comp, "instanceId": iid, "vnicId": vid,
                                            "lifecycleState": "ATTACHED"}
        cfg = {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": "ocid1.tenancy.oc1..aaaaaaaatenancy",
               "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff", "key_content": key_pem,
               "region": "us-ashburn-1"}
        p = OCIProvider(config=cfg, service_endpoint=emu.url, compartment_id=comp,
                        retry_strategy=oci.retry.NoneRetryStrategy(),
                        circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy())
        led = Ledger(tmp_path / "l.sqlite")
        run = _run(led, "oci")
        res = _instance(led, run, "oci", iid, rate=1.0, disk_gib=100)
        rows = stop_run(led, run.id, poll_s=0.05, providers={"oci": p})
        assert (iid, "STOP") in emu.actions and rows[0]["state"] == "stopped"
        assert led.resource(res.id).stopped_usd_per_hour == pytest.approx(100 * 0.0425 / 730)
        out = start_run(led, run.id, poll_s=0.05, providers={"oci": p}, ssh_check=False)
        assert (iid, "START") in emu.actions and out[0]["state"] == "running"
        assert led.resource(res.id).attrs["public_ip"] == "198.51.100.7"  # the new ephemeral IP


def test_oci_gpu_shapes_bill_in_full_while_stopped():
    from broker.providers.oci.lifecycle import keeps_billing_stopped

    assert keeps_billing_stopped("BM.GPU.H100.8") and keeps_billing_stopped("VM.GPU3.1")
    assert not keeps_billing_stopped("VM.GPU.A10.1") and not keeps_billing_stopped("VM.Standard.E4.Flex")


# ------------------------------------------------------------------------------------------- AWS (moto)
def test_aws_stop_and_start_against_moto_bill_the_ebs_volume(tmp_path, monkeypatch):
    pytest.importorskip("moto")
    import boto3
    from moto.server import ThreadedMotoServer

    from broker.cli.stopstart import start_run, stop_run
    from broker.providers.aws import AWSProvider

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=url)
        ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        iid = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="g5.xlarge", BlockDeviceMappings=[
            {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 150, "VolumeType": "gp3"}}])["Instances"][0]["InstanceId"]
        session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                        region_name="us-east-1")
        p = AWSProvider(session=session, endpoint_url=url, region="us-east-1")
        led = Ledger(tmp_path / "l.sqlite")
        run = _run(led, "aws")
        res = _instance(led, run, "aws", iid, rate=1.006)
        rows = stop_run(led, run.id, poll_s=0.05, providers={"aws": p})
        assert rows[0]["state"] == "stopped"
        state = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]
        assert state == "stopped"
        vols = ec2.describe_volumes(Filters=[{"Name": "attachment.instance-id", "Values": [iid]}])["Volumes"]
        gb = sum(v["Size"] for v in vols)
        assert led.resource(res.id).stopped_usd_per_hour == pytest.approx(gb * 0.08 / 730)
        out = start_run(led, run.id, poll_s=0.05, providers={"aws": p}, ssh_check=False)
        assert out[0]["state"] == "running"
        state = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]
        assert state == "running"
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------- the CLI
def _fake_instance(led: Ledger, home: Path, state_name: str) -> tuple[Run, Resource, Path]:
    """A run in ``led`` with one fake instance ``fake-i-1`` at $2/h, in ``state_name`` in the fake cloud's state
    file under ``home``: (run, its ledger row, the state file)."""
    run = _run(led, "fake")
    state = home / "fake-cloud.json"
    state.write_text(json.dumps({"instances": {"fake-i-1": {
        "id": "fake-i-1", "state": state_name, "created_at": 0, "zone": "fake-zone-1", "instance_type": "fake.1",
        "usd_per_hour": 2.0, "tags": {"broker-run": run.id}, "client_token": "t", "name": "n0", "gpu_count": 1}},
        "networks": {}}))
    return run, _instance(led, run, "fake", "fake-i-1"), state


def test_cli_stop_status_cost_and_start_on_the_fake_cloud(cli_env, tmp_path):
    home = Path(cli_env["BROKER_HOME"])
    led = Ledger(home / "ledger.sqlite")
    run, res, state = _fake_instance(led, home, "running")

    def cli(*args):
        return subprocess.run([cli_env.get("PYTHON", "python"), "-m", "broker", *args], cwd=REPO, env=cli_env,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)

    import sys
    cli_env["PYTHON"] = sys.executable
    r = cli("stop", run.id, "--hours", "3", "--no-watchdog")
    assert r.returncode == 0, r.stderr
    assert "stopped, billing $0.02/h for its disk" in r.stdout and f"broker start {run.id}" in r.stdout
    assert led.resource(res.id).state == "stopped"
    assert json.loads(state.read_text())["instances"]["fake-i-1"]["state"] == "stopped"
    st = cli("status")
    assert st.returncode == 0, st.stderr
    c = cli("cost")
    assert c.returncode == 0 and "stopped, billing $0.02/h for its disk" in c.stdout, c.stdout + c.stderr
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nscript: t.py\ncpu_ok: true\n")
    (tmp_path / "t.py").write_text("print('ran')\n")
    # not a wait for a machine that is off, nor a job "run" on it
    for args in (["ssh", run.id], ["exec", run.id, "--", "true"], ["exec", run.id, str(recipe)]):
        q = cli(*args)
        assert q.returncode == 2 and "are stopped" in q.stderr and f"broker start {run.id}" in q.stderr, q.stderr
    assert "stopped, billing $0.02/h for its disk" in " ".join(st.stdout.split()), st.stdout
    r = cli("start", run.id, "--hours", "1")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "running at" in r.stdout and led.resource(res.id).state == "running"
    again = cli("start", run.id)
    assert again.returncode == 2 and f"broker stop {run.id}" in again.stderr, again.stderr


@pytest.mark.netns
def test_vast_start_refreshes_the_ssh_address_and_logs_in_again(netns_hosts, broker_home, tmp_path):
    """A Vast host maps its SSH port anew on start: the run's cluster.json gets the new port and `broker start`
    logs in with the run's key through it (a real sshd in a network namespace behind the emulator's late port)."""
    from broker.cli.stopstart import start_run, stop_run
    from broker.core.config import runs_dir
    from broker.core.private import private_dir, write_private
    from broker.core.records import Cluster, ClusterNode
    from broker.providers.vast import VastProvider
    from tests.support.vast_emulator import API_KEY, VastEmulator

    hosts = netns_hosts(1)
    emu = VastEmulator(hosts, boot_s=0.2, sshd_delay_s=0.5)
    p = VastProvider(api_key=API_KEY, api_url=emu.url, sleep=lambda s: None)
    try:
        iid = emu.add_instance("kept", host=0)
        led = Ledger()
        run = _run(led, "vast")
        folder = private_dir(runs_dir() / run.id)
        led.update_run(run.id, run_dir=str(folder))
        run = led.get_run(run.id)
        key = folder / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        p.prepare_access(str(iid), (folder / "id_ed25519.pub").read_text().strip())
        res = _instance(led, run, "vast", str(iid))
        info = p.describe_instance(str(iid))
        old_port = info.ssh_port
        write_private(folder / "cluster.json", Cluster(
            run_id=run.id, provider="vast", topology="simulated", ssh_key_path=str(key),
            known_hosts_path=str(folder / "known_hosts"),
            nodes=[ClusterNode(node_rank=0, host=info.ssh_host, port=old_port, private_ip="127.0.0.1",
                               resource_id=res.id)]).model_dump_json())
        stop_run(led, run.id, poll_s=0.05, providers={"vast": p})
        out = start_run(led, run.id, poll_s=0.1, timeout_s=60, providers={"vast": p})
        assert out[0]["state"] == "running" and out[0]["port"] != old_port, out
        assert out[0]["ssh"] is True, out
        stored = Cluster.model_validate_json((folder / "cluster.json").read_text())
        assert stored.nodes[0].port == out[0]["port"]
        assert led.resource(res.id).attrs["ssh_port"] == out[0]["port"]
    finally:
        p.close()
        emu.close()


def test_a_refused_stop_leaves_the_row_as_it_was(tmp_path, vast):
    from broker.cli.stopstart import stop_run
    from broker.core.provider import ProviderError

    emu, p = vast
    iid = emu.add_instance("x", age_s=3600)
    led = Ledger(tmp_path / "l.sqlite")
    run = _run(led, "vast")
    res = _instance(led, run, "vast", str(iid))
    emu.refuse_state = "the host is being serviced"
    with pytest.raises(ProviderError, match="the host is being serviced"):
        stop_run(led, run.id, poll_s=0.05, providers={"vast": p})
    after = led.resource(res.id)
    assert after.state == "running" and after.deadline == res.deadline and after.stopped_at is None


def _stopped_fake(cli_env):
    """A ledger run with one stopped fake instance (its state file says so too): (run, resource, state path)."""
    home = Path(cli_env["BROKER_HOME"])
    led = Ledger(home / "ledger.sqlite")
    run, res, state = _fake_instance(led, home, "stopped")
    led.update_resource(res.id, state="stopped", stopped_usd_per_hour=0.02)
    led.close()
    return run, res, state


def test_start_that_does_not_come_back_in_time_says_so_with_progress_and_what_still_bills(cli_env):
    """`broker start` printed nothing while it waited, then "log in: broker ssh" after "not running within 600 s"."""
    import sys

    run, res, _ = _stopped_fake(cli_env)
    env = dict(cli_env, BROKER_FAKE_READY_S="120")  # the machine stays pending past --timeout
    r = subprocess.run([sys.executable, "-m", "broker", "start", run.id, "--timeout", "4"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "start requested" in r.stderr and "is pending after" in r.stderr and "waiting at most" in r.stderr
    out = " ".join(r.stdout.split())
    assert "(not running within 4 s)" in out and "log in" not in out
    assert "still rented and billing: fake fake-i-1 starting $2.00/h" in out and f"broker down {run.id}" in out


def test_a_signal_during_start_names_what_is_still_billing_not_a_teardown(cli_env):
    import signal
    import sys
    import time

    run, res, _ = _stopped_fake(cli_env)
    env = dict(cli_env, BROKER_FAKE_READY_S="120")
    p = subprocess.Popen([sys.executable, "-m", "broker", "start", run.id, "--timeout", "60"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        seen = ""
        deadline = time.monotonic() + 60
        while "start requested" not in seen and time.monotonic() < deadline:  # it is waiting for the machine
            seen += p.stderr.readline()
        assert "start requested" in seen
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    err = " ".join((seen + err).split())
    assert p.returncode == 143, err
    assert "still rented and billing: fake fake-i-1 starting $2.00/h" in err and "tore down" not in err, err
