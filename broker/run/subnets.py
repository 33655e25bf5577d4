"""This machine's emulation address space: the /24s of 198.18.0.0/16 that the netns clusters and the WireGuard
tunnels of hybrid runs take, and the one lock that makes choosing one and creating it atomic.

Shared by the netns adapter (:mod:`broker.providers.netns`, its clusters' subnets) and :mod:`broker.run.hybrid` (a
hybrid run's tunnel on rented VMs), so that neither reads the other's internals; 198.19.0.0/16 belongs to the Slurm
cluster emulation and is never handed out here.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

SUBNET_BASE = "198.18"  # 198.18.0.0/16 only (198.19.0.0/16 belongs to the Slurm cluster)
#: the lock that makes subnet choice and creation atomic among parallel callers (every broker home on the
#: machine): in root's own /run/broker (0700), opened O_NOFOLLOW, never a /tmp path another user could plant
LOCK_NAME = "netns.lock"


def lock_path() -> Path:
    """Where the subnet lock is (:data:`LOCK_NAME` in :func:`broker.core.private.machine_lock_dir`)."""
    from broker.core.private import machine_lock_dir

    return machine_lock_dir() / LOCK_NAME


def subnet_lock() -> Any:
    """The subnet lock file, open (created 0600, O_NOFOLLOW: a symlink planted there is refused, not followed);
    the caller holds ``fcntl.flock(f, LOCK_EX)`` while it picks and creates."""
    from broker.core.private import open_lock

    return os.fdopen(open_lock(lock_path()), "r+")


def used_subnets(*, routes: bool = False) -> set[int]:
    """The third octets x of the ``198.18.x.0/24`` networks an address on this machine is in (``ip -4 addr``), and
    with ``routes`` those a route names too (a tunnel whose interface is gone but whose route stays)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=20).stdout
    used = {int(m.group(1)) for m in re.finditer(rf"inet {re.escape(SUBNET_BASE)}\.(\d+)\.", out)}
    if routes:
        table = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, timeout=20).stdout
        used |= {int(x) for x in re.findall(rf"{re.escape(SUBNET_BASE)}\.(\d+)\.", table)}
    return used
