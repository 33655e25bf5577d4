"""Faults of netns hosts (:mod:`broker.providers.netns`) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess


def kill_host(ns: str) -> None:
    """Kill every process in network namespace ``ns``: the host is lost (its sshd and the job's ranks)."""
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
