"""The Vast.ai node-side dead-man switch, run for real: the generated onstart shell runs in a local bash with
``CONTAINER_ID``/``CONTAINER_API_KEY`` in its environment, against a fake Vast API (pytest-httpserver on
127.0.0.1); the DELETE must arrive with the instance id and the per-instance key, and the key must never be printed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conftest import wait_for

from broker.core.model import utcnow
from broker.providers.vast import onstart_script

INSTANCE_ID = "12345"
SECRET = "secret-k"


@pytest.fixture
def httpserver(own_httpserver):
    """A fake Vast API on 127.0.0.1 (own instance: the plugin's session server is shared with other modules)."""
    return own_httpserver


def run_onstart(script: str, env_extra: dict[str, str], path: str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": path or os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env_extra}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def arm_and_wait(httpserver, tmp_path, bg_pidfiles, *, path: str | None = None):
    httpserver.expect_request(f"/api/v0/instances/{INSTANCE_ID}/", method="DELETE",
                              headers={"Authorization": f"Bearer {SECRET}"}).respond_with_json({"success": True})
    state = tmp_path / "state"
    bg_pidfiles.append(state / "deadman.pid")
    deadline = utcnow() + timedelta(seconds=2)
    script = onstart_script(deadline, 0.0, httpserver.url_for("/").rstrip("/"), state_dir=str(state),
                            retry_seconds=0.5)
    t0 = time.monotonic()
    proc = run_onstart(script, {"CONTAINER_ID": INSTANCE_ID, "CONTAINER_API_KEY": SECRET}, path)
    assert proc.returncode == 0, proc.stderr
    assert "dead-man switch armed" in proc.stdout
    assert wait_for(lambda: len(httpserver.log) > 0, 30), (state / "deadman.log").read_text()
    elapsed = time.monotonic() - t0
    req, _resp = httpserver.log[0]
    assert req.method == "DELETE" and req.path == f"/api/v0/instances/{INSTANCE_ID}/"
    assert req.headers["Authorization"] == f"Bearer {SECRET}"
    assert elapsed >= 1.0  # not before the deadline
    assert wait_for(lambda: "HTTP 200" in (state / "deadman.log").read_text(), 10)
    log = (state / "deadman.log").read_text()
    for text in (proc.stdout, proc.stderr, log):
        assert SECRET not in text
    # saved for later use, root-only
    assert stat.S_IMODE((state / "deadman.env").stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert f"CONTAINER_ID={INSTANCE_ID}" in (state / "deadman.env").read_text()
    return state


def test_dead_man_switch_fires_delete_with_curl(httpserver, tmp_path, bg_pidfiles):
    assert shutil.which("curl"), "curl is needed for this test"
    arm_and_wait(httpserver, tmp_path, bg_pidfiles)


def test_dead_man_switch_falls_back_to_python_without_curl(httpserver, tmp_path, bg_pidfiles):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "date", "sleep", "sed", "head", "cat", "tr", "mkdir", "chmod", "printenv", "setsid",
                 "nohup", "grep"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    (bindir / "python3").symlink_to(os.path.realpath(sys.executable))  # a real interpreter, not a pyenv shim
    assert not (bindir / "curl").exists()
    state = arm_and_wait(httpserver, tmp_path, bg_pidfiles, path=str(bindir))
    assert "curl" not in (state / "deadman.log").read_text()


def test_dead_man_switch_retries_until_the_api_answers(httpserver, tmp_path, bg_pidfiles):
    uri = f"/api/v0/instances/{INSTANCE_ID}/"
    httpserver.expect_ordered_request(uri, method="DELETE").respond_with_data("busy", status=503)
    httpserver.expect_ordered_request(uri, method="DELETE").respond_with_json({"error": "not found"}, status=404)
    state = tmp_path / "state"
    bg_pidfiles.append(state / "deadman.pid")
    script = onstart_script(utcnow() + timedelta(seconds=1), 0.0, httpserver.url_for("/").rstrip("/"),
                            state_dir=str(state), retry_seconds=0.2)
    proc = run_onstart(script, {"CONTAINER_ID": INSTANCE_ID, "CONTAINER_API_KEY": SECRET})
    assert proc.returncode == 0, proc.stderr
    # 503 is retried; 404 (already gone) ends the timer
    assert wait_for(lambda: "HTTP 404" in ((state / "deadman.log").read_text()
                                            if (state / "deadman.log").exists() else ""), 30)
    assert len(httpserver.log) == 2
    pid = int((state / "deadman.pid").read_text())
    assert wait_for(lambda: not Path(f"/proc/{pid}").exists() or "Z" in _proc_state(pid), 10)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except OSError:
        return "Z"


def test_not_armed_without_container_vars(tmp_path):
    state = tmp_path / "state"
    script = onstart_script(utcnow() + timedelta(hours=1), 300, "http://127.0.0.1:9", state_dir=str(state))
    proc = run_onstart(script, {})
    assert proc.returncode == 0
    assert "NOT armed" in proc.stderr
    assert not (state / "deadman.pid").exists() and not (state / "deadman.env").exists()


def test_script_text_holds_no_secret_and_fires_after_grace():
    from datetime import datetime, timezone

    script = onstart_script(datetime(2026, 11, 30, 3, 0, tzinfo=timezone.utc), 300, "https://console.vast.ai/")
    assert "2026-11-30T03:05:00Z" in script and "FIRE_AT=1796007900" in script
    assert "API_URL=https://console.vast.ai\n" in script
    assert "set -x" not in script and "CONTAINER_API_KEY=%s" in script  # written via printf, not echoed
