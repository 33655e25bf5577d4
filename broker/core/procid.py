"""A recorded process is an identity, never a bare PID: (PID, start time, command name).

A PID is reused once its process ended; a PID file, a ledger row or a marker that outlived its process then names
someone else's.  broker records a process it will signal later as :class:`ProcessId` (the PID, its start time in
clock ticks since boot: field 22 of ``/proc/PID/stat``, and its command name: ``/proc/PID/comm``), and signals only
a process that matches all of them now (:func:`send`).  Where Linux has pidfds the check and the signal are made on
one pidfd, so a PID reused between them is not hit either.  A record without a start time (written by an older
broker) matches nothing: it is never signalled.

Linux only (``/proc``); elsewhere nothing matches and nothing is signalled.
"""

from __future__ import annotations

import json
import os
import signal as _signal
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProcessId:
    """One process: ``pid``, ``start`` (clock ticks after boot, ``/proc/PID/stat`` field 22), ``comm`` (its
    command name as ``/proc/PID/comm`` shows it, at most 15 characters; None = not checked)."""

    pid: int
    start: int
    comm: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "start": self.start, "comm": self.comm}

    def to_text(self) -> str:
        """One line for a PID file: JSON (the PID alone is not enough to signal it later)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any) -> "ProcessId | None":
        """The identity in ``d`` (``pid``, ``start``, optional ``comm``), or None when it is incomplete or malformed
        (an older record with a PID only is not an identity)."""
        if not isinstance(d, dict):
            return None
        pid, start, comm = d.get("pid"), d.get("start"), d.get("comm")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            return None
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            return None
        if comm is not None and not isinstance(comm, str):
            return None
        return cls(pid, start, comm)

    @classmethod
    def from_text(cls, text: str) -> "ProcessId | None":
        """The identity a PID file written by :meth:`to_text` holds; None for anything else (a bare PID)."""
        try:
            return cls.from_dict(json.loads(text))
        except (TypeError, ValueError):
            return None


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(state letter, start ticks, comm) of ``pid`` from /proc, or None when there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    head, _, rest = raw.rpartition(")")
    fields = rest.split()
    try:  # fields after "(comm)": state is field 3, starttime field 22
        return fields[0], int(fields[19]), head.split("(", 1)[1]
    except (IndexError, ValueError):
        return None


def record(pid: int | None = None, *, comm: bool = True) -> ProcessId | None:
    """The identity of process ``pid`` (default: this process) as it runs now; None when it is gone.
    ``comm``: also record its command name (checked by :func:`matches`)."""
    pid = os.getpid() if pid is None else int(pid)
    st = _stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return None
    return ProcessId(pid, st[1], st[2] if comm else None)


def matches(ident: ProcessId | None) -> bool:
    """Whether ``ident``'s PID is now a live (not zombie) process with the recorded start time and command name."""
    if ident is None:
        return False
    st = _stat(ident.pid)
    if st is None or st[0] in ("Z", "X") or st[1] != ident.start:
        return False
    return ident.comm is None or st[2] == ident.comm


def send(ident: ProcessId | None, sig: int) -> bool:
    """Send ``sig`` to the process ``ident`` names, only when it still is that process (:func:`matches`); True when
    sent.  With pidfds the PID is pinned first and checked after, so it cannot be reused between check and signal.
    Never raises for a process that is gone or not ours."""
    if ident is None or not matches(ident):
        return False
    pidfd_open = getattr(os, "pidfd_open", None)
    pidfd_send = getattr(_signal, "pidfd_send_signal", None)
    if pidfd_open is not None and pidfd_send is not None:
        try:
            fd = pidfd_open(ident.pid)
        except OSError:
            return False
        try:
            if not matches(ident):  # pinned now: what the pidfd holds is the process checked here
                return False
            pidfd_send(fd, sig)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    try:
        os.kill(ident.pid, sig)
        return True
    except OSError:
        return False


def wait_gone(ident: ProcessId | None, timeout_s: float, *, poll_s: float = 0.05) -> bool:
    """Wait up to ``timeout_s`` seconds until ``ident`` no longer matches a live process (it ended, or its PID is
    someone else's now); True when gone.  Reaps it when it is this process's child."""
    end = time.monotonic() + timeout_s
    while True:
        if not matches(ident):
            _reap(ident)
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)


def _reap(ident: ProcessId | None) -> None:
    """Collect ``ident``'s exit status when it has ended (a zombie with the recorded start time) and is this
    process's child, so no zombie is left; anything else is left to its parent."""
    if ident is None:
        return
    st = _stat(ident.pid)
    if st is None or st[0] != "Z" or st[1] != ident.start:
        return
    end = time.monotonic() + 2.0  # a multi-threaded process (wireguard-go) is waitable only once every thread ended
    while time.monotonic() < end:
        try:
            if os.waitpid(ident.pid, os.WNOHANG)[0] == ident.pid:
                return
        except ChildProcessError:
            return
        time.sleep(0.01)


def stop(ident: ProcessId | None, *, grace_s: float = 3.0) -> bool:
    """SIGTERM the process ``ident`` names, wait up to ``grace_s`` seconds, then SIGKILL; each signal only while it
    still matches; one that already ended and is this process's child is reaped (no zombie is left).  Returns
    whether anything was signalled."""
    if not send(ident, _signal.SIGTERM):
        _reap(ident)  # it may have ended already (e.g. its interface was removed)
        return False
    if not wait_gone(ident, grace_s):
        send(ident, _signal.SIGKILL)
        wait_gone(ident, 2.0)
    return True
