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


def rehost(hosts, i: int = 0) -> str:
    """Host ``i`` of netns cluster ``hosts`` becomes another machine on the same address (a re-rented VM on a freed
    address): everything in it is killed, it gets a new SSH host key and its sshd starts again.  Returns the new
    host key (``<type> <base64>``)."""
    from pathlib import Path

    from broker.providers import netns

    kill_host(hosts.ns(i))
    key = Path(hosts.root) / f"node{i}" / "ssh_host_ed25519_key"
    for p in (key, Path(f"{key}.pub")):
        p.unlink(missing_ok=True)
    netns._start_sshds(hosts, 15.0, only=i)
    return " ".join(Path(f"{key}.pub").read_text().split()[:2])
