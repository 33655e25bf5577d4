"""`broker watchdog --once --json` while another watchdog holds the lock printed nothing (exit 0): a script now
reads which watchdog holds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from broker.money.watchdog import WatchdogLock


def test_once_json_says_which_watchdog_holds_the_lock(cli_env):
    with WatchdogLock() as lock:  # this process is the running watchdog
        cp = subprocess.run([sys.executable, "-m", "broker", "watchdog", "--once", "--json"], env=cli_env,
                            capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    assert doc["busy"] is True and doc["actions"] == [] and doc["lock"] == str(lock.path)
    assert doc["holder_pid"] in (os.getpid(), None)
    assert "already running" in doc["message"]
