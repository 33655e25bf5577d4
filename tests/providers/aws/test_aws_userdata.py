"""The AWS user-data script run for real in a local bash, with a PATH-shimmed ``shutdown`` that records its args."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from broker.providers.aws import user_data_script


def run_script(tmp_path: Path, script: str) -> tuple[list[str], Path, subprocess.CompletedProcess]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    log = tmp_path / "shutdown.args"
    shim = bindir / "shutdown"
    shim.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {log}\n')
    shim.chmod(0o755)
    home = tmp_path / "home"
    path = tmp_path / "user-data.sh"
    path.write_text(script)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "BROKER_SSH_HOME": str(home)}
    cp = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    args = log.read_text().splitlines() if log.exists() else []
    return args, home, cp


def test_arms_shutdown_at_deadline_plus_grace_and_installs_key(tmp_path):
    now = int(time.time())
    deadline = datetime.fromtimestamp(now + 600, timezone.utc)  # 10 min + 300 s grace = 15 min
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBroker broker@test"
    args, home, cp = run_script(tmp_path, user_data_script(deadline, 300, key, onstart="echo ONSTART_RAN"))
    assert cp.returncode == 0, cp.stderr
    assert args[0] == "-h" and args[1] == "+15", args
    assert "deadline" in args[2]
    assert (home / ".ssh" / "authorized_keys").read_text() == key + "\n"
    assert oct((home / ".ssh" / "authorized_keys").stat().st_mode & 0o777) == "0o600"
    assert "ONSTART_RAN" in cp.stdout


@pytest.mark.parametrize("offset,grace,minutes", [(-3600, 300, "+0"), (0, 90, "+2"), (3600, 0, "+60")])
def test_minutes_rounding_and_past_deadline(tmp_path, offset, grace, minutes):
    deadline = datetime.fromtimestamp(int(time.time()) + offset, timezone.utc)
    args, _, cp = run_script(tmp_path, user_data_script(deadline, grace, ""))
    assert cp.returncode == 0, cp.stderr
    assert args[:2] == ["-h", minutes]


def test_no_deadline_schedules_nothing_and_key_is_quoted(tmp_path):
    hostile = "ssh-ed25519 AAAA x'; touch /tmp/pwned-broker-test; echo '"
    args, home, cp = run_script(tmp_path, user_data_script(None, 300, hostile))
    assert cp.returncode == 0 and args == []
    assert (home / ".ssh" / "authorized_keys").read_text() == hostile + "\n"
    assert not Path("/tmp/pwned-broker-test").exists()
