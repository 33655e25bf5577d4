"""Faults of netns hosts (:mod:`broker.providers.netns`) for end-to-end tests: a cloud instance that is a network
namespace host is lost."""

from __future__ import annotations

import os
import signal
import subprocess


def kill_host(ns: str) -> list[int]:
    """The host is lost: every process in network namespace ``ns`` (sshd, torchrun, the job) is SIGKILLed.
    Returns the pids signalled."""
    killed = []
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
            killed.append(int(pid))
        except (ProcessLookupError, ValueError):
            pass
    return killed
