"""Ctrl-C on `broker logs -f` stops the following, not the run: it said "error: interrupted" while the run went
on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
def test_ctrl_c_on_logs_follow_says_the_run_goes_on(cli_env, tmp_path):
    (tmp_path / "sleepy.py").write_text(
        "import os, time\nprint(f'STARTED rank={os.environ.get(\"RANK\")}', flush=True)\ntime.sleep(120)\n")
    env = dict(cli_env, COLUMNS="200")
    cp = subprocess.run([sys.executable, "-m", "broker", "run", "sleepy.py", "--cpu-ok", "--provider", "local",
                         "--hours", "0.1", "-d"], env=env, cwd=tmp_path, capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    run_id = re.search(r"broker logs -f (\S+)", cp.stdout)[1]
    follower = subprocess.Popen([sys.executable, "-m", "broker", "logs", "-f", run_id], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "STARTED" not in line and time.monotonic() < deadline:  # the log is being followed
            line = follower.stdout.readline()
            assert line or follower.poll() is None, follower.stderr.read()
        assert "STARTED" in line
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err
        assert "error" not in err and f"run {run_id} goes on" in err, err
        st = subprocess.run([sys.executable, "-m", "broker", "status", run_id, "--no-refresh"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert "running" in st.stdout, st.stdout
    finally:
        if follower.poll() is None:
            follower.kill()
        subprocess.run([sys.executable, "-m", "broker", "down", run_id, "--yes"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
