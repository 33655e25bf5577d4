"""GCP boot script: the instance's ``startup-script`` metadata (dead-man switch, idle stop, onstart, boot-done
marker).

The dead-man switch deletes the VM itself at deadline + grace: the metadata server gives the VM's project, zone,
name and an access token of its service account (broker attaches the default service account with the
``compute`` scope), and ``DELETE .../instances/<name>`` ends all billing (the boot disk is auto-deleted).  When that
call fails (no scope, API off) it powers the VM off: a TERMINATED (stopped) GCP VM bills neither vCPUs nor GPUs,
only its disk, which the watchdog / ``broker down`` then delete.  The generic pieces (idle watch, job-done path)
come from :mod:`broker.core.nodescripts`.
"""

from __future__ import annotations

import shlex
from datetime import datetime

BOOT_DONE = "boot.done"


def self_delete_function(*, api: str | None = None) -> str:
    """Bash function ``broker_self_delete WHY``: reads project / zone / name and a token from the metadata server
    (``$BROKER_GCE_METADATA``, default ``http://metadata.google.internal``, header ``Metadata-Flavor: Google``),
    sends ``DELETE`` to the Compute API (``$BROKER_GCE_API``, default ``https://compute.googleapis.com``), retrying
    three times a minute apart, then powers off."""
    default_api = shlex.quote(api or "https://compute.googleapis.com")
    return f"""broker_self_delete() {{
MD="${{BROKER_GCE_METADATA:-http://metadata.google.internal}}/computeMetadata/v1"
API="${{BROKER_GCE_API:-{default_api}}}"
H="Metadata-Flavor: Google"
echo "$1: deleting this VM"
for i in 1 2 3; do
  P=$(curl -sf -H "$H" "$MD/project/project-id")
  Z=$(curl -sf -H "$H" "$MD/instance/zone"); Z="${{Z##*/}}"
  N=$(curl -sf -H "$H" "$MD/instance/name")
  T=$(curl -sf -H "$H" "$MD/instance/service-accounts/default/token" | sed -n 's/.*"access_token" *: *"\\([^"]*\\)".*/\\1/p')
  if [ -n "$P" ] && [ -n "$Z" ] && [ -n "$N" ] && [ -n "$T" ] && \\
     curl -sf -X DELETE -H "Authorization: Bearer $T" "$API/compute/v1/projects/$P/zones/$Z/instances/$N" >/dev/null; then
    exit 0
  fi
  sleep "${{BROKER_DEADMAN_RETRY_S:-60}}"
done
echo "$1: delete failed, powering off (a stopped VM bills no vCPU / GPU)"
poweroff || shutdown -h now
}}
"""


def deadman_script(deadline: datetime, grace_seconds: float, *,
                   install_path: str = "/usr/local/sbin/broker-deadman") -> str:
    """Shell that arms the watcher at boot: writes ``install_path`` (sleep until deadline + grace, then
    :func:`self_delete_function`) and runs it as a transient systemd unit (``nohup`` fallback)."""
    fire = int(deadline.timestamp() + grace_seconds)
    path = shlex.quote(install_path)
    body = f"""#!/bin/bash
# broker dead-man switch (GCP): delete this VM at the run's deadline + grace, even with no broker alive.
FIRE_AT={fire}
while [ "$(date +%s)" -lt "$FIRE_AT" ]; do sleep "${{BROKER_DEADMAN_POLL_S:-20}}"; done
{self_delete_function()}broker_self_delete "broker dead-man switch: deadline passed"
"""
    return f"""# broker: arm the node-side dead-man switch
cat > {path} <<'BROKER_DEADMAN_EOF'
{body}BROKER_DEADMAN_EOF
chmod 0755 {path}
if command -v systemd-run >/dev/null 2>&1; then
  systemd-run --unit=broker-deadman --property=Restart=on-failure {path}
else
  nohup {path} >/var/log/broker-deadman.log 2>&1 &
fi
"""


def boot_done_script(path: str, ssh_user: str) -> str:
    folder, name = path.rsplit("/", 1)
    u = shlex.quote(ssh_user)
    return f"""# broker: boot finished
BROKER_WORKROOT="${{BROKER_WORKROOT:-{folder}}}"
mkdir -p "$BROKER_WORKROOT" && date -u +%Y-%m-%dT%H:%M:%SZ > "$BROKER_WORKROOT/{name}"
if id {u} >/dev/null 2>&1; then chown {u}:{u} "$BROKER_WORKROOT" "$BROKER_WORKROOT/{name}" 2>/dev/null || true; fi
"""


def startup_script(*, deadline: datetime | None = None, grace_seconds: float = 300.0, onstart: str | None = None,
                   idle_minutes: float | None = None, done_file: str = "/root/broker/job.done",
                   ssh_user: str = "root") -> str:
    """The ``startup-script`` metadata value: the dead-man switch when ``deadline`` is given, the idle stop
    (``idle_minutes``: job ended and no SSH session -> self-delete), ``onstart``, then the boot-done marker
    beside ``done_file``.  GCE runs it on every boot; the switch re-arms with the same deadline."""
    parts = ["#!/bin/bash"]  # no `set -e`: a failing step must not skip the rest
    if deadline is not None:
        parts.append(deadman_script(deadline, grace_seconds))
    if idle_minutes:
        from broker.core.nodescripts import idle_watch_launcher

        parts.append(idle_watch_launcher(idle_minutes, 'broker_self_delete "broker idle stop: job ended, no SSH"',
                                         done_file=done_file, state_dir="/var/lib/broker", poll_s=30.0,
                                         prelude=self_delete_function()))
    if onstart:
        parts.append("# broker: onstart\n" + onstart.rstrip() + "\n")
    parts.append(boot_done_script(done_file.rsplit("/", 1)[0] + "/" + BOOT_DONE, ssh_user))
    return "\n".join(parts)
