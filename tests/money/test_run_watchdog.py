"""`broker run` on rented machines starts the detached watchdog (once), and `--no-watchdog` opts out loudly."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from broker.money.accounting import watchdog_state
from tests.conftest import REPO, broker_cmd


def _job(tmp_path):
    (tmp_path / "job.py").write_text("print('JOB_OK', flush=True)\n")
    r = tmp_path / "r.yaml"
    r.write_text("name: wd\nscript: job.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\nexpect: [JOB_OK]\n")
    return r


def test_cloud_run_starts_the_watchdog_once(cli_env, broker_home, tmp_path):
    env = dict(cli_env, BROKER_WATCHDOG_AUTOSTART="1", BROKER_FAKE_STATE=str(tmp_path / "fake.json"))
    pids = []
    try:
        p = subprocess.run(broker_cmd("run", str(_job(tmp_path)), "--provider", "fake", "-q", "--yes"), cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "watchdog started (pid" in p.stderr
        pid = int(p.stderr.split("watchdog started (pid ")[1].split(")")[0])
        pids.append(pid)
        for _ in range(100):  # the detached watchdog takes the lock and writes its heartbeat
            st = watchdog_state(home=broker_home)
            if st.alive:
                break
            time.sleep(0.1)
        assert st.alive and st.pid == pid
        # a second run finds it running and starts none
        p2 = subprocess.run(broker_cmd("run", str(_job(tmp_path)), "--provider", "fake", "-q", "--yes"), cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
        assert p2.returncode == 0 and "watchdog started" not in p2.stderr
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_no_watchdog_warns(cli_env, broker_home, tmp_path):
    env = dict(cli_env, BROKER_WATCHDOG_AUTOSTART="1", BROKER_FAKE_STATE=str(tmp_path / "fake.json"))
    p = subprocess.run(broker_cmd("run", str(_job(tmp_path)), "--provider", "fake", "-q", "--yes", "--no-watchdog"),
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "--no-watchdog" in p.stderr and "nothing on this machine enforces the deadline" in p.stderr
    assert not watchdog_state(home=broker_home).alive
