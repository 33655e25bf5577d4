"""The node-side idle stop (recipe ``idle_minutes``) run for real: each provider's generated boot script runs in a
local bash with fake ``who``/``pgrep`` on PATH and a short idle time.  It must not fire while the job runs (no
``job.done``) nor while an SSH session is seen, and must fire once the job has ended and nobody is logged in:
Vast.ai - the same DELETE as the dead-man switch (fake API on 127.0.0.1, right id and key); AWS - ``shutdown -h
now``; OCI (instance principal) - the dead-man switch's terminate call."""

from __future__ import annotations

import base64
import gzip
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for

from broker.providers.aws import user_data_script
from broker.providers.oci import idle_cloud_init
from broker.providers.vast import onstart_script

INSTANCE_ID = "4242"
SECRET = "idle-secret-k"
IDLE_MIN = 0.02  # 1.2 s, rounded to 1 s by the watch
POLL_S = 0.2


@pytest.fixture
def node(tmp_path, fake_ssh_sessions):
    """(env PATH with fake who/pgrep first, sessions flag file, done file, state dir)."""
    path, sessions = fake_ssh_sessions
    bindir = tmp_path / "fake-bin"
    return bindir, path, sessions, tmp_path / "work" / "job.done", tmp_path / "state"


def run_boot(script: str, path: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), **(extra or {})}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def idle_phases(fired, sessions: Path, done: Path, state: Path) -> None:
    """Job running -> no fire; job ended but a session -> no fire; session closed -> fires."""
    assert wait_for(lambda: (state / "idle.pid").exists(), 10), "idle watch did not start"
    time.sleep(1.6)  # longer than the idle time: the job has not ended
    assert not fired()
    sessions.write_text("1")
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text("")
    time.sleep(1.6)  # job ended, but someone is logged in
    assert not fired()
    sessions.unlink()
    assert wait_for(fired, 30), (state / "idle.log").read_text() if (state / "idle.log").exists() else "no log"


def test_vast_idle_stop_sends_the_dead_man_delete(node, bg_pidfiles, own_httpserver):
    _bindir, path, sessions, done, state = node
    srv = own_httpserver
    srv.expect_request(f"/api/v0/instances/{INSTANCE_ID}/", method="DELETE",
                       headers={"Authorization": f"Bearer {SECRET}"}).respond_with_json({"success": True})
    bg_pidfiles += [state / "idle.pid", state / "deadman.pid"]
    from broker.core.model import utcnow
    from datetime import timedelta

    script = onstart_script(utcnow() + timedelta(hours=1), 0, srv.url_for("/").rstrip("/"), state_dir=str(state),
                            retry_seconds=0.2, idle_minutes=IDLE_MIN, done_file=str(done), idle_poll_s=POLL_S)
    proc = run_boot(script, path, {"CONTAINER_ID": INSTANCE_ID, "CONTAINER_API_KEY": SECRET})
    assert proc.returncode == 0, proc.stderr
    assert "idle stop armed" in proc.stdout and "dead-man switch armed" in proc.stdout
    idle_phases(lambda: len(srv.log) > 0, sessions, done, state)
    req, _ = srv.log[0]
    assert req.method == "DELETE" and req.path == f"/api/v0/instances/{INSTANCE_ID}/"
    assert req.headers["Authorization"] == f"Bearer {SECRET}"
    assert wait_for(lambda: "idle stop: DELETE" in (state / "idle.log").read_text()
                    and "HTTP 200" in (state / "idle.log").read_text(), 10)
    log = (state / "idle.log").read_text()
    assert "no SSH session for 1 s after the job ended" in log and SECRET not in log + proc.stdout + proc.stderr
    assert len(srv.log) == 1  # the dead-man timer (1 h away) has not fired


def test_vast_onstart_without_idle_minutes_starts_no_idle_watch(node, bg_pidfiles):
    _bindir, path, _sessions, _done, state = node
    bg_pidfiles.append(state / "deadman.pid")
    from broker.core.model import utcnow
    from datetime import timedelta

    script = onstart_script(utcnow() + timedelta(hours=1), 0, "http://127.0.0.1:9", state_dir=str(state))
    assert "broker_idle_watch" not in script
    proc = run_boot(script, path, {"CONTAINER_ID": INSTANCE_ID, "CONTAINER_API_KEY": SECRET})
    assert proc.returncode == 0 and "idle stop" not in proc.stdout
    assert wait_for(lambda: (state / "deadman.pid").exists(), 10)  # so the fixture can kill the timer
    assert not (state / "idle.pid").exists()


def test_vast_create_body_arms_idle_stop_for_the_root_workroot():
    from tests.providers.vast.test_vast import make_provider, node_request

    p = make_provider()
    onstart = p.create_body(node_request(idle_minutes=15))["onstart"]
    if "base64 -d" in onstart:  # over the onstart limit: the gzip+base64 loader
        onstart = gzip.decompress(base64.b64decode(onstart.split("echo '")[1].split("'")[0])).decode()
    subprocess.run(["bash", "-n", "-c", onstart], check=True, timeout=30)
    assert "done_file=/root/broker/job.done" in onstart and "idle_s=900" in onstart
    assert 'bash /root/.broker/destroy.sh "idle stop"' in onstart and "FIRE_AT=" in onstart
    assert "broker_idle_watch" not in p.create_body(node_request())["onstart"]
    idle_only = p.create_body(node_request(deadline=None, idle_minutes=15))["onstart"]
    if "base64 -d" in idle_only:
        idle_only = gzip.decompress(base64.b64decode(idle_only.split("echo '")[1].split("'")[0])).decode()
    assert "broker_idle_watch" in idle_only and "dead-man" not in idle_only


def _shutdown_shim(bindir: Path, log: Path) -> None:
    shim = bindir / "shutdown"
    shim.write_text(f'#!/bin/bash\necho "$*" >> {log}\n')
    shim.chmod(0o755)


def test_aws_idle_stop_calls_shutdown_now(node, bg_pidfiles, tmp_path):
    bindir, path, sessions, done, state = node
    log = tmp_path / "shutdown.calls"
    _shutdown_shim(bindir, log)
    bg_pidfiles.append(state / "idle.pid")
    script = user_data_script(None, 300, "", idle_minutes=IDLE_MIN, idle_poll_s=POLL_S, state_dir=str(state),
                              done_file=str(done))
    proc = run_boot(script, path)
    assert proc.returncode == 0, proc.stderr
    assert "idle stop armed" in proc.stdout
    idle_phases(log.exists, sessions, done, state)
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and calls[0].split()[:2] == ["-h", "now"], calls


def test_aws_user_data_default_done_file_is_the_ubuntu_workroot():
    script = user_data_script(None, 300, "", idle_minutes=10)
    assert "done_file=/home/ubuntu/broker/job.done" in script and "idle_s=600" in script
    assert "broker_idle_watch" not in user_data_script(None, 300, "")


def test_oci_idle_stop_terminates_itself_with_the_instance_principal(node, bg_pidfiles, tmp_path, own_httpserver):
    bindir, path, sessions, done, state = node
    calls = tmp_path / "oci.calls"
    oci = bindir / "oci"
    oci.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    oci.chmod(0o755)
    srv = own_httpserver
    srv.expect_request("/opc/v2/instance/id", method="GET", headers={"Authorization": "Bearer Oracle"}) \
        .respond_with_data("ocid1.instance.oc1..idle")
    bg_pidfiles.append(state / "idle.pid")
    script = idle_cloud_init(IDLE_MIN, done_file=str(done), region="us-ashburn-1", state_dir=str(state),
                             poll_s=POLL_S)
    proc = run_boot(script, path, {"BROKER_IMDS": srv.url_for("").rstrip("/")})
    assert proc.returncode == 0, proc.stderr
    idle_phases(calls.exists, sessions, done, state)
    args = calls.read_text().splitlines()[0].split()
    assert args == ["compute", "instance", "terminate", "--instance-id", "ocid1.instance.oc1..idle",
                    "--preserve-boot-volume", "false", "--force", "--auth", "instance_principal",
                    "--region", "us-ashburn-1"]


def test_oci_cloud_init_arms_idle_only_with_instance_principal():
    from broker.providers.oci import cloud_init

    assert "broker_idle_watch" not in cloud_init("10.0.0.0/16", idle_minutes=5, done_file="/home/opc/broker/job.done")
    ud = cloud_init("10.0.0.0/16", instance_principal=True, idle_minutes=5, done_file="/home/ubuntu/broker/job.done")
    assert "broker_idle_watch" in ud and "done_file=/home/ubuntu/broker/job.done" in ud
    r = subprocess.run(["bash", "-n"], input=ud, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
