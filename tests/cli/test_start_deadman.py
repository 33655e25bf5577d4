"""`broker start` arms the node-side dead-man switch again: a stop ends the first boot's timer (the machine is off),
so a started Vast instance must get a timer for its *new* deadline, or broker must say that only the watchdog
guards it.  Real sshd in a network namespace as the instance's host, the Vast emulator as its API (listening on
the namespaces' bridge, so the node's own DELETE reaches it), the first boot's onstart run on the node for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conftest import wait_for

pytestmark = pytest.mark.netns


def _kept_vast_run(netns_hosts, tmp_path):
    """A Vast run whose instance (a netns host with sshd) was rented, with the run's key and cluster.json: returns
    (emulator, provider, ledger, run, resource, instance id, the node's state folder, ssh argv prefix)."""
    from broker.core.config import runs_dir
    from broker.core.model import utcnow
    from broker.core.private import private_dir, write_private
    from broker.core.records import Cluster, ClusterNode, Run
    from broker.money.ledger import Ledger
    from broker.providers.vast import VastProvider
    from tests.support.vast_emulator import API_KEY, VastEmulator

    hosts = netns_hosts(1)
    emu = VastEmulator(hosts, boot_s=0.2, bind=hosts.gateway)
    node_dir = tmp_path / "node-broker"  # the instance's /root/.broker (the netns host shares this filesystem)
    p = VastProvider(api_key=API_KEY, api_url=emu.url, sleep=lambda s: None, node_dir=str(node_dir))
    iid = emu.add_instance("kept", host=0)
    led = Ledger()
    now = utcnow()
    run = led.create_run(Run(id="20261202-000000-rearmx", name="kept", provider="vast", topology="simulated",
                             status="succeeded", created_at=now - timedelta(hours=1), ended_at=now,
                             deadline=now + timedelta(hours=1), recipe={"max_hours": 2.0}))
    folder = private_dir(runs_dir() / run.id)
    led.update_run(run.id, run_dir=str(folder))
    run = led.get_run(run.id)
    key = folder / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    p.prepare_access(str(iid), (folder / "id_ed25519.pub").read_text().strip())
    res = led.record_intent(run.id, "vast", "instance", "node0", usd_per_hour=0.4, deadline=run.deadline,
                            attrs={"deadman_grace_s": 0.0})
    led.mark_created(res.id, str(iid), state="running")
    info = p.describe_instance(str(iid))
    cluster = Cluster(run_id=run.id, provider="vast", topology="simulated", ssh_key_path=str(key),
                      known_hosts_path=str(folder / "known_hosts"),
                      nodes=[ClusterNode(node_rank=0, host=info.ssh_host, port=info.ssh_port,
                                         private_ip=info.ssh_host, resource_id=res.id)])
    write_private(folder / "cluster.json", cluster.model_dump_json())
    from broker.cli.day2 import ssh_argv

    ssh = ssh_argv(cluster, 0)
    ssh[1:1] = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
    return emu, p, led, run, led.resource(res.id), iid, node_dir, ssh


def _power_off(node_dir: Path) -> None:
    """What a stop does to the container's processes: the first boot's timer is gone."""
    pid = int((node_dir / "deadman.pid").read_text())
    os.killpg(pid, signal.SIGKILL)
    assert wait_for(lambda: not Path(f"/proc/{pid}").exists() or " Z " in Path(f"/proc/{pid}/stat").read_text(), 10)


def _fire_at(node_dir: Path) -> int:
    line = next(x for x in (node_dir / "deadman.sh").read_text().splitlines() if x.startswith("FIRE_AT="))
    return int(line.split("=", 1)[1])


def test_start_rearms_the_node_dead_man_switch_for_the_new_deadline(netns_hosts, broker_home, tmp_path,
                                                                    bg_pidfiles):
    from broker.cli.stopstart import start_run, stop_run
    from broker.core.model import utcnow
    from broker.providers.vast import onstart_script
    from tests.support.vast_emulator import API_KEY

    emu, p, led, run, res, iid, node_dir, ssh = _kept_vast_run(netns_hosts, tmp_path)
    bg_pidfiles.append(node_dir / "deadman.pid")
    try:
        # first boot: the instance's onstart arms the switch for the run's deadline, with the key Vast injects
        first = onstart_script(run.deadline, 0.0, emu.url, state_dir=str(node_dir), retry_seconds=0.5)
        boot = subprocess.run(ssh + ["env", f"CONTAINER_ID={iid}", f"CONTAINER_API_KEY={API_KEY}", "bash", "-s"],
                              input=first, capture_output=True, text=True, timeout=60)
        assert boot.returncode == 0 and "dead-man switch armed" in boot.stdout, boot.stdout + boot.stderr
        old_fire = _fire_at(node_dir)

        stop_run(led, run.id, poll_s=0.05, providers={"vast": p})
        assert led.resource(res.id).attrs["deadman"] is False
        _power_off(node_dir)

        out = start_run(led, run.id, hours=4 / 3600, poll_s=0.1, timeout_s=60, providers={"vast": p})
        row = out[0]
        assert row["state"] == "running" and row["ssh"] is True, row
        assert row["deadman"] is True, row
        new_deadline = led.resource(res.id).deadline
        want = int(-(-new_deadline.timestamp() // 1))  # deadline + 0 s grace, rounded up
        assert _fire_at(node_dir) == want != old_fire
        pid = int((node_dir / "deadman.pid").read_text())
        assert "deadman.sh" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        back = led.resource(res.id)
        assert back.attrs["deadman"] is True and back.attrs["deadman_fire_at"][:19] == row["deadman_fire_at"][:19]
        assert any("re-armed" in (e.get("message") or "") for e in led.events(run.id))

        # the node-side action: at the new deadline the node deletes its own instance through the API
        assert iid not in emu.destroyed
        assert wait_for(lambda: iid in emu.destroyed, 40), (node_dir / "deadman.log").read_text()
        assert utcnow() >= new_deadline - timedelta(seconds=1)  # not before the deadline
        assert API_KEY not in (node_dir / "deadman.log").read_text()
    finally:
        p.close()
        emu.close()


def test_start_says_when_the_switch_could_not_be_rearmed(netns_hosts, broker_home, tmp_path, bg_pidfiles):
    """A node that never saved its instance key (no first-boot switch, no CONTAINER_* anywhere) cannot be armed:
    the ledger keeps ``deadman`` False with why, and `broker start` does not claim the layer."""
    from broker.cli.stopstart import start_run, stop_run

    emu, p, led, run, res, iid, node_dir, ssh = _kept_vast_run(netns_hosts, tmp_path)
    bg_pidfiles.append(node_dir / "deadman.pid")
    try:
        stop_run(led, run.id, poll_s=0.05, providers={"vast": p})
        out = start_run(led, run.id, hours=1, poll_s=0.1, timeout_s=60, providers={"vast": p})
        row = out[0]
        assert row["ssh"] is True and row["deadman"] is False, row
        assert "did not confirm" in row["deadman_why"], row
        after = led.resource(res.id)
        assert after.attrs["deadman"] is False and after.attrs["deadman_why"] == row["deadman_why"]
        assert any("NOT re-armed" in (e.get("message") or "") and "watchdog" in e["message"]
                   for e in led.events(run.id))
        assert not (node_dir / "deadman.pid").exists()
    finally:
        p.close()
        emu.close()


@pytest.mark.parametrize("principal, want", [(False, None), (True, False)])
def test_a_machine_that_never_held_a_switch_is_not_reported_as_unarmed(broker_home, monkeypatch, principal, want):
    """OCI arms its switch only with an instance principal: without one no layer was lost by the stop, so `broker
    start` says nothing of it; with one, OCI (no re-arm script yet) is reported NOT re-armed, never as armed."""
    from broker.cli.stopstart import _rearm_deadman
    from broker.core.model import utcnow
    from broker.core.records import Run
    from broker.money.ledger import Ledger
    from broker.providers.oci import OCIProvider

    monkeypatch.delenv("OCI_INSTANCE_PRINCIPAL", raising=False)
    led = Ledger()
    now = utcnow()
    run = led.create_run(Run(id="20261202-000000-ociabc", name="kept", provider="oci", topology="simulated",
                             status="succeeded", created_at=now, deadline=now + timedelta(hours=1)))
    res = led.record_intent(run.id, "oci", "instance", "node0", usd_per_hour=1.0,
                            attrs={"instance_principal": principal, "deadman": False})
    led.mark_created(res.id, "ocid1.instance.oc1..x", state="running")
    row = {"resource": res.id, "state": "running", "ssh": True, "deadline": (now + timedelta(hours=1)).isoformat(),
           "deadman": None, "deadman_why": None, "deadman_fire_at": None}
    _rearm_deadman(led, run, [row], {res.id: (OCIProvider.__new__(OCIProvider), led.resource(res.id))}, hours=1)
    assert row["deadman"] is want, row
    assert led.resource(res.id).attrs["deadman"] is False
    if want is False:
        assert "cannot re-arm oci" in row["deadman_why"]


def test_start_with_a_malformed_address_records_nothing_and_stops_the_machine_again(netns_hosts, broker_home,
                                                                                   tmp_path, bg_pidfiles):
    """A provider answer whose new address is not an address is never written to the ledger or cluster.json:
    broker says which call returned what, keeps the machine accounted for, and stops it again (confirmed)."""
    from broker.cli.stopstart import start_run, stop_run

    emu, p, led, run, res, iid, node_dir, ssh = _kept_vast_run(netns_hosts, tmp_path)
    try:
        stop_run(led, run.id, poll_s=0.05, providers={"vast": p})
        cluster_before = (Path(run.run_dir) / "cluster.json").read_text()
        real = p.describe_instance

        def answers_a_bad_address(provider_id, *, region=None):  # the real answer, its address made malformed
            info = real(provider_id, region=region)
            if info.state != "running":
                return info
            return info.model_copy(update={"ssh_host": "198.18.0.999", "public_ip": "198.18.0.999"})

        p.describe_instance = answers_a_bad_address
        out = start_run(led, run.id, hours=1, poll_s=0.1, timeout_s=30, providers={"vast": p})
        row = out[0]
        assert "describe_instance" in row["error"] and "198.18.0.999" in row["error"], row
        assert "not an IP address" in row["error"] and "edited" not in row["error"]
        assert row["state"] == "stopped" and row["fix"] == f"broker down {run.id}" and row["ssh"] is None, row
        after = led.resource(res.id)
        assert after.state == "stopped" and "198.18.0.999" not in str(after.attrs)
        assert json.loads((Path(run.run_dir) / "cluster.json").read_text()) == json.loads(cluster_before)
        assert emu.instances[int(iid)].stopped  # the provider stopped it again
        msgs = [e.get("message") or "" for e in led.events(run.id)]
        assert any("stopped again" in m for m in msgs), msgs
    finally:
        p.close()
        emu.close()


def test_start_refuses_a_changed_host_key_of_the_same_machine(netns_hosts, broker_home, tmp_path, bg_pidfiles):
    """A machine started again answers on its (new) address with a host key other than the one pinned for it (same
    resource id): `broker start` says so at once (no SSH-ready retries), never logs in, never re-arms over it."""
    import time

    from broker.cli.stopstart import start_run, stop_run
    from tests.support.netns_faults import rehost

    emu, p, led, run, res, iid, node_dir, ssh = _kept_vast_run(netns_hosts, tmp_path)
    try:
        assert subprocess.run(ssh + ["true"], capture_output=True, timeout=60).returncode == 0  # pins its key
        stop_run(led, run.id, poll_s=0.05, providers={"vast": p})
        rehost(emu.hosts, 0)  # something else answers where the machine comes back
        t0 = time.monotonic()
        out = start_run(led, run.id, hours=1, poll_s=0.1, timeout_s=120, providers={"vast": p})
        took = time.monotonic() - t0
        row = out[0]
        assert row["state"] == "running" and row["ssh"] is False, row
        assert "man-in-the-middle" in row["ssh_why"] and "rebuilt" in row["ssh_why"], row
        assert took < 60, took  # not the 120 s of SSH retries
        assert row["deadman"] is False and "host key" in row["deadman_why"], row
    finally:
        p.close()
        emu.close()
