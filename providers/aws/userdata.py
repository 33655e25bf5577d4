"""AWS boot script: the user data cloud-init runs once (as root) at first boot -- dead-man switch (scheduled
``shutdown -h`` with shutdown behaviour ``terminate``), idle stop, SSH key, ``onstart``, boot-done marker."""

from __future__ import annotations

import math
import shlex
from datetime import datetime, timezone

#: SSH user of the Deep Learning AMI (Ubuntu).
SSH_USER = "ubuntu"
#: Where the node keeps broker's own files (idle stop script, pid and log).
NODE_STATE_DIR = "/var/lib/broker"
#: Name of the marker the user data writes into the node's workroot when it has finished.
BOOT_DONE = "boot.done"


def user_data_script(deadline: datetime | None, grace_seconds: float, ssh_public_key: str,
                     onstart: str | None = None, *, idle_minutes: float | None = None,
                     idle_poll_s: float = 30.0, state_dir: str = NODE_STATE_DIR,
                     done_file: str | None = None, ssh_user: str = SSH_USER) -> str:
    """The user-data shell script run once by cloud-init (as root) at first boot.

    1. Arms the dead-man switch first: ``shutdown -h +M`` where ``M`` = whole minutes (rounded up) from *boot
       time* to ``deadline + grace_seconds`` (computed on the node from the absolute epoch, so slow boots do not
       push the deadline out; 0 when already past).  With ``InstanceInitiatedShutdownBehavior="terminate"`` the
       shutdown terminates the instance and stops all billing.  No deadline: nothing is scheduled.
    2. With ``idle_minutes``: starts the idle stop (:func:`broker.core.nodescripts.idle_watch_launcher`, files in
       ``state_dir``): once ``done_file`` (default ``/home/ubuntu/broker/job.done``; the SSH runner touches it
       when the job has ended) exists and no SSH session was seen for ``idle_minutes``, it runs
       ``shutdown -h now`` (a terminate, as in 1).
       ``idle_poll_s``: seconds between its checks.
    3. Appends ``ssh_public_key`` to ``$BROKER_SSH_HOME/.ssh/authorized_keys`` (default ``ssh_user``'s home:
       ``/home/<ssh_user>``, ``/root`` for root).
    4. Runs ``onstart`` (extra shell) if given.
    5. Last, writes the boot-done marker ``<workroot>/boot.done`` (:data:`BOOT_DONE` beside ``done_file``;
       ``$BROKER_WORKROOT`` overrides the folder), owned by ``ssh_user``: the core waits for it (or for
       ``cloud-init status --wait``) before preflight.
    """
    from broker.core.nodescripts import job_done_path

    done_file = done_file or job_done_path(ssh_user)
    lines = ["#!/bin/bash", "# broker node bootstrap (user data)", "set -u"]
    if deadline is not None:
        if deadline.tzinfo is None:
            deadline = deadline.replace(tzinfo=timezone.utc)
        fire_epoch = int(math.ceil(deadline.timestamp() + float(grace_seconds)))
        lines += [
            "# dead-man switch: shutdown at the hard deadline + grace; shutdown behaviour 'terminate' ends billing",
            f"BROKER_FIRE_EPOCH={fire_epoch}",
            'broker_now=$(date +%s)',
            'broker_minutes=$(( (BROKER_FIRE_EPOCH - broker_now + 59) / 60 ))',
            'if [ "$broker_minutes" -lt 0 ]; then broker_minutes=0; fi',
            'shutdown -h "+${broker_minutes}" "broker: hard deadline reached, terminating" '
            '|| echo "broker: could not schedule shutdown" >&2',
        ]
    if idle_minutes:
        from broker.core.nodescripts import idle_watch_launcher

        lines.append(idle_watch_launcher(
            idle_minutes, 'shutdown -h now "broker: idle stop (job ended, no SSH session), terminating"',
            done_file=done_file, state_dir=state_dir, poll_s=idle_poll_s).rstrip("\n"))
    key = ssh_public_key.strip()
    u = shlex.quote(ssh_user)
    if key:
        lines += [
            'BROKER_SSH_HOME="${BROKER_SSH_HOME:-' + ("/root" if ssh_user == "root" else f"/home/{ssh_user}") + '}"',
            'mkdir -p "$BROKER_SSH_HOME/.ssh" && chmod 700 "$BROKER_SSH_HOME/.ssh"',
            f'printf "%s\\n" {shlex.quote(key)} >> "$BROKER_SSH_HOME/.ssh/authorized_keys"',
            'chmod 600 "$BROKER_SSH_HOME/.ssh/authorized_keys"',
            f'if id {u} >/dev/null 2>&1; then chown -R {u}:{u} "$BROKER_SSH_HOME/.ssh"; fi',
        ]
    if onstart:
        lines += ["# onstart", onstart]
    lines.append(boot_done_script(done_file.rsplit("/", 1)[0] + "/" + BOOT_DONE, ssh_user).rstrip("\n"))
    return "\n".join(lines) + "\n"


def boot_done_script(path: str, ssh_user: str) -> str:
    """Shell that writes the boot-done marker ``path`` (``<workroot>/boot.done``) last, owned by ``ssh_user`` so
    the run can write beside it; ``$BROKER_WORKROOT`` overrides the folder (tests)."""
    folder, name = path.rsplit("/", 1)
    u = shlex.quote(ssh_user)
    return f"""# broker: boot finished -> marker the core waits for before preflight
BROKER_WORKROOT="${{BROKER_WORKROOT:-{folder}}}"
mkdir -p "$BROKER_WORKROOT" && date -u +%Y-%m-%dT%H:%M:%SZ > "$BROKER_WORKROOT/{name}"
if id {u} >/dev/null 2>&1; then chown {u}:{u} "$BROKER_WORKROOT" "$BROKER_WORKROOT/{name}" 2>/dev/null || true; fi
"""


def boot_wait_command(workroot: str, *, timeout_s: int = 900) -> str:
    """Shell the core runs on a node (over SSH, after it accepts logins) to wait for the boot script: waits for
    cloud-init to finish where it exists (``cloud-init status --wait``, at most ``timeout_s`` seconds), then
    exits 0 only when the boot-done marker ``<workroot>/boot.done`` exists."""
    marker = shlex.quote(workroot.rstrip("/") + "/" + BOOT_DONE)
    return (f"if command -v cloud-init >/dev/null 2>&1; then timeout {int(timeout_s)} cloud-init status --wait "
            f">/dev/null 2>&1; fi; test -e {marker}")
