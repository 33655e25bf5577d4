"""What a Vast.ai instance runs at boot (its ``onstart``): the node-side dead-man switch, the idle stop and the run's
SSH key, delivered within Vast's 4048-character ``onstart`` limit.

The idle watch itself and the job-done marker come from :mod:`broker.core.nodescripts` (shared by every adapter); this
module owns Vast's self-destroy (``DELETE /api/v0/instances/$CONTAINER_ID/`` with the per-instance key Vast injects,
docs/reference/cloud-apis.md A7) and the delivery.
"""

from __future__ import annotations

import shlex
from datetime import datetime, timezone

from broker.core.nodescripts import armed_confirmation, deadman_fire_at
from broker.core.provider import BadInput

#: Documented limit of the ``onstart`` field (characters); longer scripts are sent gzip+base64 encoded.
ONSTART_LIMIT = 4048
#: Where the node keeps broker's files (dead-man switch state, decoded onstart).
NODE_DIR = "/root/.broker"


_TIMER = r"""#!/bin/bash
# broker dead-man switch timer (generated): destroys this Vast.ai instance at FIRE_AT (epoch seconds, UTC).
DIR=@DIR@
FIRE_AT=@FIRE_AT@
echo $$ > "$DIR/deadman.pid"
while :; do
  now=$(date +%s)
  [ "$now" -ge "$FIRE_AT" ] && break
  left=$((FIRE_AT - now)); [ "$left" -gt 60 ] && left=60
  sleep "$left"
done
exec bash "$DIR/destroy.sh" "dead-man switch"
"""

#: ``<state_dir>/destroy.sh WHY``: the instance's self-destroy, shared by the dead-man switch and the idle stop.
_DESTROY = r"""#!/bin/bash
# broker self-destroy (generated): DELETE this Vast.ai instance through the API, retried until 2xx or 404 (gone).
DIR=@DIR@
API_URL=@API_URL@
RETRY_S=@RETRY_S@
MAX_TRIES=@MAX_TRIES@
WHY=${1:-self-destroy}
id=$(sed -n 's/^CONTAINER_ID=//p' "$DIR/deadman.env" | head -n 1)
url="$API_URL/api/v0/instances/$id/"
n=0
while [ "$n" -lt "$MAX_TRIES" ]; do
  n=$((n + 1))
  if command -v curl >/dev/null 2>&1; then
    # the key goes in a header file (-H @file), so it is never on a command line or in a log
    code=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 30 -X DELETE -H @"$DIR/deadman.hdr" \
           -H 'Content-Type: application/json' --data '{}' "$url")
  elif command -v python3 >/dev/null 2>&1; then
    code=$(python3 - "$DIR/deadman.env" "$url" <<'PY'
import sys, urllib.error, urllib.request
env = dict(l.rstrip("\n").split("=", 1) for l in open(sys.argv[1]) if "=" in l)
req = urllib.request.Request(sys.argv[2], data=b"{}", method="DELETE", headers={
    "Authorization": "Bearer " + env.get("CONTAINER_API_KEY", ""), "Content-Type": "application/json"})
try:
    print(urllib.request.urlopen(req, timeout=30).status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception as e:
    print("000")
PY
)
  else
    echo "$WHY: neither curl nor python3 is installed; cannot call the API"
    code=000
  fi
  code=${code:-000}
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $WHY: DELETE $url -> HTTP $code (try $n)"
  case "$code" in
    2??|404) exit 0 ;;
  esac
  sleep "$RETRY_S"
done
exit 1
"""


def onstart_script(deadline: datetime | None, grace_seconds: float, api_url: str, *, state_dir: str = NODE_DIR,
                   retry_seconds: float = 15.0, max_tries: int = 480, idle_minutes: float | None = None,
                   done_file: str = "/root/broker/job.done", idle_poll_s: float = 30.0) -> str:
    """Shell (bash) that arms the node-side dead-man switch (and, with ``idle_minutes``, the idle stop) of a
    Vast.ai instance.

    At boot it (a) saves ``CONTAINER_ID`` / ``CONTAINER_API_KEY`` (Vast injects them into PID 1's environment:
    read from this shell's environment, else ``/proc/1/environ``, else what an earlier boot saved) into ``<state_dir>/deadman.env`` (mode 0600,
    directory 0700) plus a curl header file, and (b) starts a detached timer (``setsid``; pid in
    ``<state_dir>/deadman.pid``, log ``<state_dir>/deadman.log``) that at ``deadline + grace_seconds`` sends
    ``DELETE <api_url>/api/v0/instances/$CONTAINER_ID/`` with ``Authorization: Bearer $CONTAINER_API_KEY`` (curl,
    or python3's urllib when curl is missing), retrying every ``retry_seconds`` up to ``max_tries`` times until
    the API answers 2xx or 404 (gone).  That DELETE lives in ``<state_dir>/destroy.sh`` (one copy, used by both
    the timer and the idle stop).  The key is never printed.  Re-running it (instance restart) re-arms it.
    Source of the mechanism: Vast docs, guides/instances/docker-environment (docs/reference/cloud-apis.md A7).

    With ``idle_minutes`` it also starts the idle stop (:func:`broker.core.nodescripts.idle_watch_launcher`; pid in
    ``<state_dir>/idle.pid``, log ``idle.log``): once ``done_file`` (the SSH runner touches ``<workroot>/job.done``
    when the job has ended) exists and no SSH session was seen for ``idle_minutes``, it runs ``destroy.sh``.
    ``idle_poll_s``: seconds between its checks.  ``deadline`` None: no timer (idle stop only).

    ``deadline`` naive = UTC.  Returns a script fragment meant to run first in the instance's ``onstart``.
    """
    d = shlex.quote(state_dir)
    fire_iso = timer = None
    if deadline is not None:
        fire_at = deadman_fire_at(deadline, grace_seconds)
        fire_iso = datetime.fromtimestamp(fire_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        timer = _TIMER.replace("@DIR@", d).replace("@FIRE_AT@", str(fire_at))
    destroy = (_DESTROY.replace("@DIR@", d).replace("@API_URL@", shlex.quote(api_url.rstrip("/")))
               .replace("@RETRY_S@", shlex.quote(f"{retry_seconds:g}")).replace("@MAX_TRIES@", str(int(max_tries))))
    arm_timer = "" if timer is None else f"""  cat > "$DIR/deadman.sh" <<'BROKER_DMS_EOF'
{timer}BROKER_DMS_EOF
  old=$(cat "$DIR/deadman.pid" 2>/dev/null)
  if [ -n "$old" ] && grep -q deadman.sh "/proc/$old/cmdline" 2>/dev/null; then kill "$old" 2>/dev/null; fi
  if command -v setsid >/dev/null 2>&1; then
    setsid bash "$DIR/deadman.sh" </dev/null >>"$DIR/deadman.log" 2>&1 &
  else
    nohup bash "$DIR/deadman.sh" </dev/null >>"$DIR/deadman.log" 2>&1 &
  fi
  echo "broker: dead-man switch armed for {fire_iso} (instance $_dms_id)"
"""
    arm_idle = ""
    if idle_minutes:
        from broker.core.nodescripts import idle_watch_launcher

        arm_idle = idle_watch_launcher(idle_minutes, f'bash {d}/destroy.sh "idle stop"', done_file=done_file,
                                       state_dir=state_dir, poll_s=idle_poll_s)
    what = " + ".join(x for x in ("dead-man switch" if timer else "", "idle stop" if arm_idle else "") if x)
    head = (f"dead-man switch: destroy this instance at {fire_iso} even if no broker process is alive" if timer
            else "idle stop: destroy this instance once idle")
    return f"""# --- broker {head}
(
umask 077
DIR={d}
mkdir -p "$DIR" && chmod 700 "$DIR"
_dms_get() {{
  v=$(printenv "$1")
  if [ -z "$v" ] && [ -r /proc/1/environ ]; then
    v=$(tr '\\0' '\\n' < /proc/1/environ | sed -n "s/^$1=//p" | head -n 1)
  fi
  if [ -z "$v" ] && [ -r "$DIR/deadman.env" ]; then
    v=$(sed -n "s/^$1=//p" "$DIR/deadman.env" | head -n 1)
  fi
  printf '%s' "$v"
}}
_dms_id=$(_dms_get CONTAINER_ID)
_dms_key=$(_dms_get CONTAINER_API_KEY)
if [ -z "$_dms_id" ] || [ -z "$_dms_key" ]; then
  echo "broker: {what} NOT armed (CONTAINER_ID / CONTAINER_API_KEY not found)" >&2
else
  printf 'CONTAINER_ID=%s\\nCONTAINER_API_KEY=%s\\n' "$_dms_id" "$_dms_key" > "$DIR/deadman.env"
  printf 'Authorization: Bearer %s\\n' "$_dms_key" > "$DIR/deadman.hdr"
  chmod 600 "$DIR/deadman.env" "$DIR/deadman.hdr"
  cat > "$DIR/destroy.sh" <<'BROKER_DESTROY_EOF'
{destroy}BROKER_DESTROY_EOF
{arm_timer}{arm_idle}fi
)
# --- end of {"dead-man switch" if timer else "idle stop"}
"""


def rearm_script(deadline: datetime, grace_seconds: float, api_url: str, *, state_dir: str = NODE_DIR,
                 retry_seconds: float = 15.0, max_tries: int = 480) -> str:
    """Bash run over SSH on a started instance (``broker start``) that arms its dead-man switch again for
    ``deadline + grace_seconds``: the dead-man part of :func:`onstart_script` (the instance's key from the
    environment, ``/proc/1/environ`` or the first boot's ``<state_dir>/deadman.env``; a timer left by an earlier
    boot is stopped), then :func:`broker.core.nodescripts.armed_confirmation`: it prints ``BROKER_DEADMAN_ARMED
    <fire_at>`` only when the new timer runs, else exits 1 saying why."""
    return (onstart_script(deadline, grace_seconds, api_url, state_dir=state_dir, retry_seconds=retry_seconds,
                           max_tries=max_tries)
            + armed_confirmation(f"{state_dir}/deadman.pid", f"{state_dir}/deadman.sh",
                                 deadman_fire_at(deadline, grace_seconds)))


def fit_onstart(script: str, *, limit: int = ONSTART_LIMIT, workdir: str = NODE_DIR) -> str:
    """``script`` as is when it fits Vast's ``onstart`` limit, else a one-line loader of its gzip+base64 form.

    Raises BadInput when even the compressed loader exceeds ``limit`` characters.
    """
    if len(script) <= limit:
        return script
    import base64
    import gzip

    blob = base64.b64encode(gzip.compress(script.encode(), mtime=0)).decode()
    w = shlex.quote(workdir)
    loader = (f"mkdir -p {w} && echo '{blob}' | base64 -d | gunzip > {w}/onstart.sh && "
              f"bash {w}/onstart.sh")
    if len(loader) > limit:
        raise BadInput(f"vast: the instance's onstart script is {len(script)} characters, {len(loader)} even "
                       f"gzip+base64 encoded; Vast.ai accepts {limit}",
                       hint="shorten the recipe's onstart/setup commands (or put them in a script in the image)")
    return loader




def authorized_key_script(public_key: str) -> str:
    """Shell that adds ``public_key`` to root's ``authorized_keys`` once (idempotent); "" for an empty key."""
    if not public_key.strip():
        return ""
    k = shlex.quote(public_key.strip())
    return ("mkdir -p /root/.ssh && chmod 700 /root/.ssh && touch /root/.ssh/authorized_keys && "
            f"(grep -qxF {k} /root/.ssh/authorized_keys || echo {k} >> /root/.ssh/authorized_keys) && "
            "chmod 600 /root/.ssh/authorized_keys")
