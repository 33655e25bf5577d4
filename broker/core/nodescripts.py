"""Node-side boot scripts that every adapter embeds in its own boot mechanism (Vast.ai ``onstart``, OCI cloud-init,
AWS user data): the idle watch and the job-done marker's path (the dead-man switches are provider-specific and
stay in each adapter, built from these pieces).

Adapters depend on this module and on the core contract (:mod:`broker.core.model`, :mod:`broker.core.provider`,
:mod:`broker.core.config`) only, never on orchestration (pipeline, provisioning, teardown, watchdog).

* :func:`node_workroot` / :func:`job_done_path` -- where run files and the ``job.done`` marker live on a node; the
  SSH executor touches ``job.done`` on every node when the job has ended;
* :func:`idle_watch_script` / :func:`idle_watch_launcher` -- the idle stop: once ``job.done`` exists and no SSH
  session has been seen for ``idle_minutes``, run the provider's self-terminate;
* :func:`deadman_fire_at` / :func:`armed_confirmation` / :func:`read_armed` -- when a dead-man switch fires, and the
  line a node prints once its switch is armed (``broker start`` re-arms a started node's switch over SSH and
  believes only that line).
"""

from __future__ import annotations

import math
import re
import shlex
from datetime import datetime, timezone


#: bounds of the node-side dead-man switch's grace after the deadline (seconds), see :func:`deadman_grace_s`
DEADMAN_GRACE_MIN_S = 60.0
DEADMAN_GRACE_MAX_S = 300.0


def deadman_grace_s(max_hours: float | None) -> float:
    """Seconds after the deadline at which a node's dead-man switch fires: 10 % of the run's ``max_hours`` (in
    hours), at least :data:`DEADMAN_GRACE_MIN_S` (the CLI and the watchdog get the first minute to tear down
    cleanly) and at most :data:`DEADMAN_GRACE_MAX_S` (a short job is not billed 5 more minutes when the CLI died):
    ``min(300, max(60, 0.1 * max_hours * 3600))``.  Unknown ``max_hours``: the maximum."""
    if max_hours is None or max_hours <= 0:
        return DEADMAN_GRACE_MAX_S
    return min(DEADMAN_GRACE_MAX_S, max(DEADMAN_GRACE_MIN_S, 0.1 * float(max_hours) * 3600.0))


def deadman_fire_at(deadline: datetime, grace_seconds: float) -> int:
    """When a node's dead-man switch fires: ``deadline + grace_seconds`` as whole Unix seconds, rounded up (never
    before the deadline).  ``deadline`` naive = UTC."""
    if deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=timezone.utc)
    return int(math.ceil(deadline.timestamp() + grace_seconds))


#: the word a node prints, then the fire time (Unix seconds), once its dead-man switch is armed and running
ARMED_WORD = "BROKER_DEADMAN_ARMED"
_ARMED_RE = rf"(?m)^{ARMED_WORD} (\d{{1,12}})$"


def armed_confirmation(pid_file: str, script_file: str, fire_at: int, *, wait_s: int = 10) -> str:
    """Shell that prints ``BROKER_DEADMAN_ARMED <fire_at>`` only when the node's dead-man switch really is armed:
    within ``wait_s`` seconds, ``pid_file`` names a live process whose command line holds ``script_file``'s name
    and ``script_file`` carries ``FIRE_AT=<fire_at>`` (the timer's own line).  Otherwise it prints why not to
    stderr and exits 1.  Appended by an adapter to the arming shell it runs again over SSH (``broker start``)."""
    pf, sf, name = shlex.quote(pid_file), shlex.quote(script_file), shlex.quote(script_file.rsplit("/", 1)[-1])
    tries = max(1, int(wait_s) * 5)
    return f"""# --- broker: confirm the dead-man switch is armed for {fire_at}
_n=0
while [ "$_n" -lt {tries} ]; do
  _p=$(cat {pf} 2>/dev/null)
  if [ -n "$_p" ] && grep -q {name} "/proc/$_p/cmdline" 2>/dev/null && grep -qx 'FIRE_AT={fire_at}' {sf} 2>/dev/null; then
    echo "{ARMED_WORD} {fire_at}"
    exit 0
  fi
  _n=$((_n + 1)); sleep 0.2
done
echo "broker: the dead-man switch is not running with FIRE_AT={fire_at} ({pf}, {sf})" >&2
exit 1
"""


def read_armed(stdout: str) -> int | None:
    """The fire time (Unix seconds) a node's :func:`armed_confirmation` printed in ``stdout`` (untrusted node
    output: only a whole line of the exact form counts), or None when it printed none."""
    m = re.findall(_ARMED_RE, stdout or "")
    return int(m[-1]) if m else None


def node_workroot(ssh_user: str, override: str | None = None) -> str:
    """The folder on a node for broker's run files (``Cluster.workroot``): ``override`` (the adapter's
    ``node_workroot``) when set, else ``/root/broker`` for root and ``/home/<user>/broker`` for anyone else."""
    return override or ("/root/broker" if ssh_user == "root" else f"/home/{ssh_user}/broker")


def job_done_path(ssh_user: str, override: str | None = None) -> str:
    """``<workroot>/job.done``: the SSH runner (:class:`broker.run.remote.SSHExecutor`) touches it on every node when the
    job has ended; the node-side idle watch (:func:`broker.core.nodescripts.idle_watch_script`) starts counting then."""
    return node_workroot(ssh_user, override).rstrip("/") + "/job.done"


def idle_watch_script(idle_minutes: float, on_idle: str, *, done_file: str = "/root/broker/job.done",
                      poll_s: float = 30.0) -> str:
    """A bash function ``broker_idle_watch`` for the node: once ``done_file`` exists (the runner touches it when
    the job ended) and no SSH session is seen (``who`` is empty and no ``sshd: user@`` process) for
    ``idle_minutes`` minutes, it runs ``on_idle`` (the provider's self-terminate, e.g. the Vast adapter's
    ``DELETE /api/v0/instances/$CONTAINER_ID/``) and returns.  Start it in the background from the onstart /
    user-data script: ``broker_idle_watch &``.  An SSH login resets the idle time."""
    idle_s = max(1, int(round(idle_minutes * 60)))
    return f"""broker_idle_watch() {{
  # broker idle stop: job ended + no SSH session for {idle_s} s -> {on_idle.splitlines()[0] if on_idle else ''}
  local idle_s={idle_s} poll_s={poll_s:g} done_file={shlex.quote(done_file)} since=""
  while :; do
    if [ -e "$done_file" ] && [ -z "$(who 2>/dev/null)" ] && ! pgrep -f 'sshd: [^ ]+@' >/dev/null 2>&1; then
      [ -n "$since" ] || since=$(date +%s)
      if [ $(( $(date +%s) - since )) -ge "$idle_s" ]; then
        echo "broker idle watch: no SSH session for ${{idle_s}} s after the job ended: stopping this node"
        {on_idle}
        return 0
      fi
    else
      since=""
    fi
    sleep "$poll_s"
  done
}}
"""


def idle_watch_launcher(idle_minutes: float, on_idle: str, *, done_file: str, state_dir: str,
                        poll_s: float = 30.0, prelude: str = "") -> str:
    """Shell for an onstart / user-data script that starts the node-side idle stop in the background.

    It writes ``<state_dir>/idle.sh`` (``prelude``, then :func:`idle_watch_script`, then ``broker_idle_watch``;
    its pid goes to ``<state_dir>/idle.pid``; a watch left by an earlier boot is stopped) and starts it detached (``setsid``, else ``nohup``; stdin from
    /dev/null, output to ``<state_dir>/idle.log``, so a boot script's caller such as cloud-init does not wait for
    it).  ``on_idle``: the provider's self-terminate; ``done_file``: ``<workroot>/job.done``
    (:func:`broker.core.nodescripts.job_done_path`); ``poll_s``: seconds between checks."""
    d = shlex.quote(state_dir)
    body = (prelude.rstrip("\n") + "\n" if prelude else "") + idle_watch_script(
        idle_minutes, on_idle, done_file=done_file, poll_s=poll_s)
    return f"""# --- broker idle stop: after the job ended and {idle_minutes:g} min without an SSH session, stop this node
mkdir -p {d} && chmod 700 {d}
cat > {d}/idle.sh <<'BROKER_IDLE_EOF'
#!/bin/bash
echo $$ > {d}/idle.pid
{body}broker_idle_watch
BROKER_IDLE_EOF
old=$(cat {d}/idle.pid 2>/dev/null)
if [ -n "$old" ] && grep -q idle.sh "/proc/$old/cmdline" 2>/dev/null; then kill "$old" 2>/dev/null; fi
if command -v setsid >/dev/null 2>&1; then
  setsid bash {d}/idle.sh </dev/null >>{d}/idle.log 2>&1 &
else
  nohup bash {d}/idle.sh </dev/null >>{d}/idle.log 2>&1 &
fi
echo "broker: idle stop armed ({idle_minutes:g} min without SSH after {done_file} appears)"
# --- end of idle stop
"""
