"""Vast.ai adapter: live offer search, rent / describe / destroy, run-tag listing and the node-side dead-man switch.

A thin synchronous httpx client over Vast.ai's REST API (the ``vastai`` package uses ``requests`` and is heavy; see
``/work/shared/reference/cloud-apis.md`` section A for every endpoint, field and unit used here):

* ``POST /api/v0/bundles/``            search offers (body = the query dict; ``{"offers": [...]}``)
* ``PUT  /api/v0/asks/{id}/``          rent an offer (``{"success": true, "new_contract": <instance id>}``)
* ``GET  /api/v0/instances/{id}/``     show one instance (``?owner=me``; ``{"instances": {...} | null}``)
* ``DELETE /api/v0/instances/{id}/``   destroy (stop is not enough: storage bills until destroy)
* ``GET  /api/v1/instances/``          list own instances, paginated by ``next_token`` (v0 list as fallback)
* ``GET  /api/v0/users/current``       credit (``broker check --online``)

Authentication: ``Authorization: Bearer <key>``.  The key is looked up like the vastai SDK does (explicit argument
→ ``VAST_API_KEY`` (environment, or ``.env`` through :func:`broker.config.settings`) →
``$XDG_CONFIG_HOME/vastai/vast_api_key`` (default ``~/.config/vastai/vast_api_key``) → ``~/.vast_api_key``) and is
never printed, logged or put into an exception (server texts are scrubbed of it).  Base URL: ``VAST_API_URL``
(default ``https://console.vast.ai``).

Retries (tenacity) follow the SDK's ``VastClient``: HTTP 429/502/503/504 and transport errors are retried a bounded
number of times, honouring ``Retry-After`` up to 60 s; a 429 whose JSON says ``"error": "search_quota_exceeded"``
(daily quota, resets at UTC midnight) is not retried.  Renting is never blindly retried on 5xx or a lost
connection (the server may have created the instance): the adapter looks the instance up by its label instead.

Topology: Vast.ai hosts sit behind separate NATs, so only ``simulated`` (one host with N GPUs acting as N nodes)
is offered; the nodes of that host reach each other on ``127.0.0.1`` (``InstanceInfo.private_ip``).
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import os
import shlex
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from broker.model import Capacity, Offer, Requirements, utcnow
from broker.provider import (RUN_TAG, AuthError, BadInput, InstanceInfo, NodeRequest, NotSupported, OfferGone,
                             Provider, ProviderCheck, ProviderError, TaggedResource, TransientError)

if TYPE_CHECKING:  # pragma: no cover
    import httpx

PROVIDER = "vast"
DEFAULT_API_URL = "https://console.vast.ai"
#: Image used when the recipe names none: PyTorch with CUDA 12.4 (runs on hosts with cuda_max_good >= 12.4).
DEFAULT_IMAGE = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
#: Documented limit of the ``onstart`` field (characters); longer scripts are sent gzip+base64 encoded.
ONSTART_LIMIT = 4048
#: Labels are kept this short (Vast documents no limit; 64 is a conservative bound that fits every UI).
LABEL_MAX = 64
#: HTTP statuses retried (as vastai's VastClient does).
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: Longest ``Retry-After`` honoured (seconds); a longer one is not waited for (the SDK's bound).
MAX_RETRY_AFTER_S = 60.0
#: Where the node keeps broker's files (dead-man switch state, decoded onstart).
NODE_DIR = "/root/.broker"

KEY_HINT = ("set VAST_API_KEY (environment or .env) or save the key from https://cloud.vast.ai/manage-keys/ "
            "to ~/.config/vastai/vast_api_key (`vastai set api-key ...`)")
CREDIT_HINT = "add credit at https://cloud.vast.ai/billing/ (Vast.ai is prepaid), then retry"

#: Vast spells GPU models with spaces and variants ("H100 SXM"); a bare family name matches every variant.
GPU_NAME_VARIANTS: dict[str, list[str]] = {
    "H100": ["H100 SXM", "H100 PCIE", "H100 NVL"],
    "A100": ["A100 PCIE", "A100 SXM4", "A100X"],
    "V100": ["Tesla V100"],
    "T4": ["Tesla T4"],
    "P100": ["Tesla P100"],
    "RTX 6000 ADA": ["RTX 6000Ada"],
    "L40S": ["L40S"],
}

#: Offer fields whose query values are strings (every other field's value is sent as a JSON number / bool).
STRING_FIELDS = frozenset({"gpu_name", "geolocation", "cpu_arch", "gpu_arch", "datacenter", "verification",
                           "mobo_name", "cuda_vers", "ubuntu_version", "cluster_id"})
#: Native query-string grammar (vastai.api.query.parse_query): operator spellings → JSON operators.
QUERY_OPS = {">=": "gte", ">": "gt", "gt": "gt", "gte": "gte", "<=": "lte", "<": "lt", "lt": "lt", "lte": "lte",
             "!=": "neq", "==": "eq", "=": "eq", "eq": "eq", "neq": "neq", "noteq": "neq", "not eq": "neq",
             "notin": "notin", "not in": "notin", "nin": "notin", "in": "in"}
QUERY_ALIAS = {"cuda_vers": "cuda_max_good", "display_active": "gpu_display_active", "dlperf_usd": "dlperf_per_dphtotal",
               "dph": "dph_total", "flops_usd": "flops_per_dphtotal"}
#: The CLI grammar's unit conversions: GB → MB for memory fields, days → seconds for ``duration``.
QUERY_MULT = {"cpu_ram": 1000, "gpu_ram": 1000, "gpu_total_ram": 1000, "duration": 24.0 * 60.0 * 60.0}


# --------------------------------------------------------------------------------------------------- API key
def _xdg_key_path() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "vastai" / "vast_api_key"


def find_api_key(explicit: str | None = None) -> tuple[str | None, str]:
    """The Vast.ai API key and where it came from (a description, never the key).

    Order (as the vastai 1.9.1 SDK's ``_resolve_api_key``): ``explicit`` → ``VAST_API_KEY`` (environment, then
    ``.env`` via settings) → ``$XDG_CONFIG_HOME/vastai/vast_api_key`` (``~/.config/vastai/vast_api_key``) →
    ``~/.vast_api_key``.  Returns ``(None, "...")`` when none is found.
    """
    if explicit:
        return explicit.strip(), "the api_key argument"
    env = os.environ.get("VAST_API_KEY", "").strip()
    if env:
        return env, "VAST_API_KEY"
    try:
        from broker.config import settings

        s = settings().vast_api_key
        if s is not None and s.get_secret_value().strip():
            return s.get_secret_value().strip(), "VAST_API_KEY (.env)"
    except Exception:  # a broken .env must not break key lookup from files
        pass
    for path in (_xdg_key_path(), Path.home() / ".vast_api_key"):
        try:
            if path.is_file():
                key = path.read_text().strip()
                if key:
                    return key, str(path)
        except OSError:
            continue
    return None, "no key found (VAST_API_KEY, ~/.config/vastai/vast_api_key, ~/.vast_api_key)"


def api_url(explicit: str | None = None) -> str:
    """Base URL: ``explicit`` → ``VAST_API_URL`` (environment / .env) → ``https://console.vast.ai``."""
    url = explicit or os.environ.get("VAST_API_URL", "").strip()
    if not url:
        try:
            from broker.config import settings

            url = settings().vast_api_url or ""
        except Exception:
            url = ""
    return (url.strip() or DEFAULT_API_URL).rstrip("/")


# --------------------------------------------------------------------------------------------------- query
def _number(value: Any) -> Any:
    """``"2"`` → 2, ``"0.98"`` → 0.98; anything else unchanged (the CLI parser sends numbers as strings)."""
    if isinstance(value, str):
        try:
            f = float(value)
        except ValueError:
            return value
        if math.isfinite(f):
            return int(f) if f.is_integer() and "." not in value and "e" not in value.lower() else f
    return value


def _parse_query_fallback(query: str) -> dict[str, dict[str, Any]]:
    """The vastai CLI query grammar (``field op value`` terms separated by spaces), re-implemented.

    Same regex, operators, aliases, GB→MB / days→s multipliers and ``_``→space rule as
    ``vastai.api.query.parse_query`` 1.9.1; used when the ``vastai`` package (extra ``vast``) is not installed.
    """
    import re

    pattern = (r"([a-zA-Z0-9_]+)( *[=><!]+| +(?:[lg]te?|nin|neq|eq|not ?eq|not ?in|in) )?( *)"
               r"(\[[^\]]+\]|\"[^\"]+\"|[^ ]+)?( *)")
    query = query.strip()
    opts = re.findall(pattern, query)
    if "".join("".join(x) for x in opts) != query:
        raise ValueError("unconsumed text; quote the whole query")
    res: dict[str, dict[str, Any]] = {}
    for field, op, _, value, _ in opts:
        value = value.strip(",[]")
        op_name = QUERY_OPS.get(op.strip())
        field = QUERY_ALIAS.get(field, field)
        if not op_name:
            raise ValueError(f"unknown operator {op.strip()!r} after {field!r}")
        v: Any = value
        if op_name in ("in", "notin"):
            v = [x.strip() for x in value.split(",") if x.strip()]
        if not v:
            raise ValueError(f"blank value for {field!r}")
        if v in ("?", "*", "any"):
            if op_name != "eq":
                raise ValueError("a wildcard only makes sense with =")
            res.pop(field, None)
            continue
        if isinstance(v, list):
            v = [x.replace("_", " ").strip('"') for x in v]
        else:
            v = v.replace("_", " ").strip('"')
        if field in QUERY_MULT:
            v = float(v) * QUERY_MULT[field]
        elif v in ("true", "True"):
            v = True
        elif v in ("false", "False"):
            v = False
        elif v in ("None", "null"):
            v = None
        res.setdefault(field, {})[op_name] = v
    return res


def parse_vast_query(query: str) -> dict[str, dict[str, Any]]:
    """Parse a native Vast.ai query string (``"reliability>0.98 inet_up>=200 gpu_name in [RTX_4090,RTX_3090]"``).

    Uses the ``vastai`` package's own parser when installed (extra ``vast``), else the same grammar re-implemented
    here; either way numeric values are then sent as JSON numbers (the CLI parser leaves them as strings), except
    for string fields (``gpu_name``, ``geolocation`` ...).  ``gpu_ram``/``cpu_ram`` values are GB (×1000 → MB).
    Raises BadInput on a malformed string.
    """
    try:
        try:
            from vastai.api.query import offers_alias, offers_fields, offers_mult, parse_query
        except ImportError:
            parsed = _parse_query_fallback(query)
        else:
            import contextlib
            import io

            with contextlib.redirect_stderr(io.StringIO()):  # "Unrecognized field" warnings
                parsed = parse_query(query, {}, offers_fields, offers_alias, offers_mult)
    except ValueError as exc:
        raise BadInput(f"vast query {query!r}: {exc}",
                       hint="use Vast's syntax: 'field op value' terms, e.g. 'reliability>0.98 inet_up>=200 "
                            "gpu_name in [RTX_4090,RTX_3090]'") from None
    out: dict[str, dict[str, Any]] = {}
    for field, ops in (parsed or {}).items():
        if not isinstance(ops, dict):
            continue
        if field in STRING_FIELDS:
            out[field] = dict(ops)
        else:
            out[field] = {op: ([_number(x) for x in v] if isinstance(v, list) else _number(v)) for op, v in ops.items()}
    return out


def vast_gpu_names(names: list[str]) -> list[str]:
    """Vast.ai spellings for the user's GPU names: ``RTX_4090`` → ``RTX 4090``; ``H100`` → every H100 variant."""
    out: list[str] = []
    for n in names:
        n = " ".join(n.replace("_", " ").split())
        for v in [n, *GPU_NAME_VARIANTS.get(n.upper(), [])]:
            if v not in out:
                out.append(v)
    return out


# --------------------------------------------------------------------------------------------------- dead-man switch
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
    Vast.ai instance (issue 6).

    At boot it (a) saves ``CONTAINER_ID`` / ``CONTAINER_API_KEY`` (Vast injects them into PID 1's environment:
    read from this shell's environment, else ``/proc/1/environ``) into ``<state_dir>/deadman.env`` (mode 0600,
    directory 0700) plus a curl header file, and (b) starts a detached timer (``setsid``; pid in
    ``<state_dir>/deadman.pid``, log ``<state_dir>/deadman.log``) that at ``deadline + grace_seconds`` sends
    ``DELETE <api_url>/api/v0/instances/$CONTAINER_ID/`` with ``Authorization: Bearer $CONTAINER_API_KEY`` (curl,
    or python3's urllib when curl is missing), retrying every ``retry_seconds`` up to ``max_tries`` times until
    the API answers 2xx or 404 (gone).  That DELETE lives in ``<state_dir>/destroy.sh`` (one copy, used by both
    the timer and the idle stop).  The key is never printed.  Re-running it (instance restart) re-arms it.
    Source of the mechanism: Vast docs, guides/instances/docker-environment (cloud-apis.md A7).

    With ``idle_minutes`` it also starts the idle stop (:func:`broker.nodescripts.idle_watch_launcher`; pid in
    ``<state_dir>/idle.pid``, log ``idle.log``): once ``done_file`` (the SSH runner touches ``<workroot>/job.done``
    when the job has ended) exists and no SSH session was seen for ``idle_minutes``, it runs ``destroy.sh``.
    ``idle_poll_s``: seconds between its checks.  ``deadline`` None: no timer (idle stop only).

    ``deadline`` naive = UTC.  Returns a script fragment meant to run first in the instance's ``onstart``.
    """
    d = shlex.quote(state_dir)
    fire_iso = timer = None
    if deadline is not None:
        if deadline.tzinfo is None:
            deadline = deadline.replace(tzinfo=timezone.utc)
        fire_at = int(math.ceil(deadline.timestamp() + grace_seconds))
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
        from broker.nodescripts import idle_watch_launcher

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


def fit_onstart(script: str, *, limit: int = ONSTART_LIMIT, workdir: str = NODE_DIR) -> str:
    """``script`` as is when it fits Vast's ``onstart`` limit, else a one-line loader of its gzip+base64 form.

    Raises BadInput when even the compressed loader exceeds ``limit`` characters.
    """
    if len(script) <= limit:
        return script
    blob = base64.b64encode(gzip.compress(script.encode(), mtime=0)).decode()
    w = shlex.quote(workdir)
    loader = (f"mkdir -p {w} && echo '{blob}' | base64 -d | gunzip > {w}/onstart.sh && "
              f"bash {w}/onstart.sh")
    if len(loader) > limit:
        raise BadInput(f"vast: the instance's onstart script is {len(script)} characters, {len(loader)} even "
                       f"gzip+base64 encoded; Vast.ai accepts {limit}",
                       hint="shorten the recipe's onstart/setup commands (or put them in a script in the image)")
    return loader


# --------------------------------------------------------------------------------------------------- adapter
class _Retry(Exception):
    """A retryable HTTP answer (internal)."""

    def __init__(self, response: "httpx.Response", delay: float | None):
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.delay = delay


def _body_message(r: "httpx.Response") -> str:
    try:
        data = r.json()
    except ValueError:
        return (r.text or "").strip()[:300]
    if isinstance(data, dict):
        parts = [str(data[k]) for k in ("error", "msg", "detail", "message") if data.get(k)]
        return "; ".join(dict.fromkeys(parts)) or json.dumps(data)[:300]
    return json.dumps(data)[:300]


def _search_quota_exceeded(r: "httpx.Response") -> bool:
    if r.status_code != 429:
        return False
    try:
        data = r.json()
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("error") == "search_quota_exceeded"


def _retry_after(r: "httpx.Response") -> float | None:
    try:
        return max(0.0, float(r.headers["Retry-After"]))
    except (KeyError, TypeError, ValueError):
        return None


_GONE_WORDS = ("no_such_ask", "not available", "no longer available", "unavailable", "rented", "not found",
               "does not exist", "already")


class VastProvider(Provider):
    """Vast.ai: live offers (one host = one offer, ``simulated`` topology only) and the instance lifecycle.

    Constructor arguments (all optional; no I/O happens here): ``api_key`` (else the SDK's lookup order),
    ``api_url`` (else ``VAST_API_URL``), ``max_attempts`` per request (retries on 429/502/503/504), ``backoff_s``
    (first wait when no ``Retry-After``; doubles, capped at 10 s), ``sleep`` (injectable for tests),
    ``timeout_s`` per request, search defaults ``min_reliability`` (0-1), ``min_inet_mbps`` (Mbit/s up and down),
    ``min_cuda`` (driver's max CUDA version), ``limit`` (offers per search) and ``price_tolerance`` (fraction a
    re-quoted price may rise before create refuses with OfferGone).
    """

    name = PROVIDER
    topologies: ClassVar[tuple[str, ...]] = ("simulated",)

    def __init__(self, api_key: str | None = None, api_url: str | None = None, *, max_attempts: int = 4,
                 backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep, timeout_s: float = 60.0,
                 min_reliability: float = 0.98, min_inet_mbps: float = 100.0, min_cuda: float = 12.1,
                 limit: int = 64, price_tolerance: float = 0.10):
        self._explicit_key = api_key
        self._explicit_url = api_url
        self.max_attempts = max(1, int(max_attempts))
        self.backoff_s = backoff_s
        self._sleep = sleep
        self.timeout_s = timeout_s
        self.min_reliability = min_reliability
        self.min_inet_mbps = min_inet_mbps
        self.min_cuda = min_cuda
        self.limit = limit
        self.price_tolerance = price_tolerance
        self._client: "httpx.Client | None" = None
        self._key: str | None = None
        self._last_source: str | None = None  # "live" | "snapshot <date>" after offers()
        self._live_error: str | None = None  # why the last live search fell back to the snapshot

    # ------------------------------------------------------------------ plumbing
    @property
    def api_url(self) -> str:
        return api_url(self._explicit_url)

    def _api_key(self) -> str | None:
        return find_api_key(self._explicit_key)[0]

    def _scrub(self, text: str) -> str:
        out = text
        for key in {self._key, self._api_key()}:
            if key and len(key) >= 6:
                out = out.replace(key, "***")
        return out

    def _http(self, call: str) -> "httpx.Client":
        key = self._api_key()
        if not key:
            raise AuthError(PROVIDER, call, "no Vast.ai API key found", hint=KEY_HINT)
        if self._client is None or key != self._key:
            import httpx

            if self._client is not None:
                self._client.close()
            self._key = key
            self._client = httpx.Client(base_url=self.api_url, timeout=self.timeout_s,
                                        headers={"Authorization": f"Bearer {key}", "Accept": "application/json",
                                                 "User-Agent": "broker (vast adapter)"})
        return self._client

    def close(self) -> None:
        """Close the HTTP connection pool."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def _wait(self, state: Any) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Retry) and exc.delay is not None:
            return exc.delay
        return min(10.0, self.backoff_s * (2 ** (state.attempt_number - 1)))

    def _request(self, method: str, path: str, call: str, *, json_body: Any = None,
                 params: dict[str, Any] | None = None, retry: bool = True) -> "httpx.Response":
        """One API call with bounded retries.  Returns the final response (any status); raises TransientError
        when retries are exhausted or the network fails, AuthError without a key."""
        import httpx
        from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt

        client = self._http(call)

        def once() -> httpx.Response:
            r = client.request(method, path, json=json_body, params=params)
            if retry and r.status_code in RETRY_STATUSES and not _search_quota_exceeded(r):
                delay = _retry_after(r)
                if delay is None or delay <= MAX_RETRY_AFTER_S:
                    raise _Retry(r, delay)
            return r

        try:
            for attempt in Retrying(stop=stop_after_attempt(self.max_attempts if retry else 1), wait=self._wait,
                                    retry=retry_if_exception_type((_Retry, httpx.TransportError)),
                                    sleep=self._sleep, reraise=True):
                with attempt:
                    return once()
        except _Retry as exc:
            r = exc.response
            raise TransientError(PROVIDER, call, f"Vast.ai answered HTTP {r.status_code} "
                                 f"({self._scrub(_body_message(r))}) after {self.max_attempts} tries",
                                 hint="Vast.ai is throttling or unavailable; retry in a minute",
                                 status=r.status_code) from None
        except httpx.TransportError as exc:
            raise TransientError(PROVIDER, call, f"cannot reach Vast.ai at {self.api_url}: "
                                 f"{type(exc).__name__}: {self._scrub(str(exc))}",
                                 hint="check the network or VAST_API_URL, then retry") from None
        except RetryError:  # pragma: no cover - reraise=True makes this unreachable
            raise TransientError(PROVIDER, call, "retries exhausted") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _raise_for(self, r: "httpx.Response", call: str) -> None:
        """Map a non-2xx answer to broker errors (never includes the key)."""
        if r.is_success:
            return
        msg = self._scrub(_body_message(r))
        status = r.status_code
        low = msg.lower()
        if status in (401, 403):
            raise AuthError(PROVIDER, call, f"Vast.ai rejected the API key (HTTP {status}: {msg})", hint=KEY_HINT,
                            status=status)
        if status == 402 or "insufficient" in low or "credit" in low or "balance" in low:
            raise ProviderError(PROVIDER, call, f"Vast.ai says the account cannot pay (HTTP {status}: {msg})",
                                hint=CREDIT_HINT, code="insufficient_credit", status=status)
        if _search_quota_exceeded(r):
            raise ProviderError(PROVIDER, call, f"Vast.ai's daily search quota is used up (HTTP 429: {msg})",
                                hint="it resets at 00:00 UTC; until then plan from the snapshot (unset VAST_API_KEY)",
                                code="search_quota_exceeded", status=status)
        if status == 429 or status >= 500:
            raise TransientError(PROVIDER, call, f"Vast.ai answered HTTP {status} ({msg})",
                                 hint="Vast.ai is throttling or unavailable; retry in a minute", status=status)
        raise ProviderError(PROVIDER, call, f"Vast.ai answered HTTP {status} ({msg})",
                            hint="check the request (offer id, image, disk) and retry", status=status)

    # ------------------------------------------------------------------ read side
    def check(self, online: bool = False) -> ProviderCheck:
        """Whether a key is configured (no network) and, with ``online``, usable (``GET /api/v0/users/current``;
        the detail shows the credit in USD, never the key)."""
        key, source = find_api_key(self._explicit_key)
        if not key:
            return ProviderCheck(provider=PROVIDER, configured=False, usable=None, detail=source, hint=KEY_HINT)
        if not online:
            return ProviderCheck(provider=PROVIDER, configured=True, usable=None, detail=f"key from {source}")
        try:
            r = self._request("GET", "/api/v0/users/current", "check (users/current)")
            self._raise_for(r, "check (users/current)")
            data = r.json()
        except AuthError as exc:
            return ProviderCheck(provider=PROVIDER, configured=True, usable=False, detail=exc.message, hint=KEY_HINT)
        except ProviderError as exc:
            return ProviderCheck(provider=PROVIDER, configured=True, usable=False, detail=exc.message, hint=exc.hint)
        credit = data.get("credit") if isinstance(data, dict) else None
        detail = f"key from {source}; {self.api_url}"
        if isinstance(credit, (int, float)):
            detail += f"; credit ${credit:.2f}"
        hint = CREDIT_HINT if isinstance(credit, (int, float)) and credit <= 0 else None
        return ProviderCheck(provider=PROVIDER, configured=True, usable=True, detail=detail, hint=hint)

    def search_query(self, req: Requirements, vast_query: str | None = None) -> dict[str, Any]:
        """The ``POST /api/v0/bundles/`` body for ``req``: one host with ``nodes × gpus_per_node`` GPUs or more.

        Units: ``gpu_ram`` MB per GPU (GiB × 1024), ``inet_up``/``inet_down`` Mbit/s, ``reliability`` 0-1,
        ``duration`` seconds, ``allocated_storage`` GiB (so ``dph_total`` includes the recipe's disk).
        ``vast_query`` (native syntax) replaces the default filter of each field it names.
        """
        q: dict[str, Any] = {
            "num_gpus": {"gte": int(req.nodes * req.gpus_per_node)},
            "gpu_ram": {"gte": round(req.gpu_mem_floor_gib * 1024)},
            "reliability": {"gte": self.min_reliability},
            "inet_up": {"gte": self.min_inet_mbps},
            "inet_down": {"gte": self.min_inet_mbps},
            "cuda_max_good": {"gte": self.min_cuda},
            "direct_port_count": {"gte": 1},
            "verified": {"eq": True},
            "rentable": {"eq": True},
            "rented": {"eq": False},
            "external": {"eq": False},
        }
        if req.gpu_names:
            q["gpu_name"] = {"in": vast_gpu_names(req.gpu_names)}
        if req.hours:
            q["duration"] = {"gte": round(req.hours * 3600)}  # the host must stay listed past the deadline
        if vast_query:
            q.update(parse_vast_query(vast_query))
        q["order"] = [["dph_total", "asc"]]
        q["type"] = "on-demand"
        q["limit"] = int(self.limit)
        q["allocated_storage"] = float(req.disk_gib)
        return q

    def _search(self, query: dict[str, Any], call: str) -> list[dict[str, Any]]:
        r = self._request("POST", "/api/v0/bundles/", call, json_body=query)
        self._raise_for(r, call)
        data = r.json()
        rows = data.get("offers") if isinstance(data, dict) else data
        return [o for o in (rows or []) if isinstance(o, dict)]

    def offers(self, req: Requirements, vast_query: str | None = None) -> list[Offer]:
        """Live offers (``POST /api/v0/bundles/``, cheapest first) when a key is configured, else the shipped
        snapshot (``broker.catalog.snapshot_offers``; [] when that module is absent).  When Vast.ai cannot be
        reached (network, 5xx/429 after retries, daily search quota used up) the snapshot is used too and
        :meth:`price_note` says why.

        ``vast_query``: Vast's native query string, merged over the defaults (see :meth:`search_query`).
        Raises AuthError (key rejected), ProviderError (other refusals), BadInput (malformed ``vast_query``).
        """
        if req.topology in ("multi-node", "local"):
            return []  # Vast hosts share no private network; only "simulated" is offered
        if not self._api_key():
            self._live_error = None
            return self._snapshot(req)
        try:
            return self.live_offers(req, vast_query)
        except ProviderError as exc:
            if not (isinstance(exc, TransientError) or exc.code == "search_quota_exceeded"):
                raise
            self._live_error = exc.message
            return self._snapshot(req)

    def live_offers(self, req: Requirements, vast_query: str | None = None) -> list[Offer]:
        """Offers from a live search only (no snapshot fallback).

        Raises AuthError, TransientError (429/5xx after retries, network), ProviderError, BadInput.
        """
        rows = self._search(self.search_query(req, vast_query), "search offers (POST /api/v0/bundles/)")
        now = utcnow()
        self._last_source = "live"
        self._live_error = None
        return [o for o in (offer_from_row(row, now) for row in rows) if o is not None]

    def _snapshot(self, req: Requirements) -> list[Offer]:
        try:
            from broker.catalog import snapshot_offers
        except ImportError:
            self._last_source = "snapshot (not installed)"
            return []
        offers = list(snapshot_offers("vast", req))
        if offers:
            self._last_source = f"snapshot {min(o.price_time for o in offers).date().isoformat()}"
        else:
            self._last_source = "snapshot"
        return offers

    def capacity(self, offers: list[Offer]) -> list[Capacity]:
        """A live offer is one rentable host right now (AVAILABLE, count 1); snapshot offers are UNKNOWN."""
        out = []
        for o in offers:
            if o.provider != PROVIDER:
                continue
            live = o.price_source.startswith("live")
            out.append(Capacity(provider=PROVIDER, region=o.region, instance_type=o.instance_type,
                                status="AVAILABLE" if live else "UNKNOWN", available_count=1 if live else None,
                                source=o.price_source))
        return out

    def price_note(self) -> str | None:
        """Where Vast prices come from: ``vast: live offers ...``, ``vast: snapshot <date>; live quote needs
        VAST_API_KEY`` or, when the live search failed, ``vast: snapshot <date> (live search failed: ...)``."""
        src = self._last_source if (self._last_source or "").startswith("snapshot ") else None
        if src is None:  # no snapshot offer matched this job: still name the snapshot's date
            try:
                from broker.catalog import snapshot_info

                src = f"snapshot {snapshot_info('vast')[0]}"
            except (ImportError, FileNotFoundError):
                src = "snapshot"
        if self._live_error:
            return f"vast: {src} (live search failed: {self._live_error})"
        if self._api_key():
            return "vast: live offers (Vast.ai /api/v0/bundles/, storage for the recipe's disk included)"
        return f"vast: {src}; live quote needs VAST_API_KEY"

    # ------------------------------------------------------------------ lifecycle
    def _label(self, run_id: str, node_index: int) -> str:
        suffix = f":n{node_index}"
        room = LABEL_MAX - len(RUN_TAG) - 1 - len(suffix)
        return f"{RUN_TAG}:{run_id[:room]}{suffix}"

    def requote(self, offer: Offer, disk_gib: float) -> dict[str, Any]:
        """The offer's current row (``POST /api/v0/bundles/`` with ``id`` eq); raises OfferGone when it is no
        longer rentable or its ``dph_total`` rose more than ``price_tolerance`` above ``offer.usd_per_hour``."""
        call = f"re-quote offer {offer.offer_id}"
        try:
            ask_id = int(offer.offer_id)
        except ValueError:
            raise BadInput(f"vast: offer id {offer.offer_id!r} is not a Vast.ai ask id",
                           hint="plan with live Vast offers (set VAST_API_KEY) before `broker run`") from None
        q = {"id": {"eq": ask_id}, "rentable": {"eq": True}, "rented": {"eq": False}, "type": "on-demand",
             "limit": 1, "allocated_storage": float(disk_gib)}
        rows = [r for r in self._search(q, call) if str(r.get("id")) == offer.offer_id]
        if not rows:
            raise OfferGone(PROVIDER, call, f"offer {offer.offer_id} ({offer.instance_type}) is no longer rentable "
                            "(rented by someone else or withdrawn)", hint="broker moves on to the next offer")
        row = rows[0]
        price = float(row.get("dph_total") or 0.0)
        if price > offer.usd_per_hour * (1 + self.price_tolerance):
            raise OfferGone(PROVIDER, call, f"offer {offer.offer_id} now costs ${price:.4f}/h, planned "
                            f"${offer.usd_per_hour:.4f}/h (+{(price / offer.usd_per_hour - 1) * 100:.0f}% > "
                            f"{self.price_tolerance * 100:.0f}%)", hint="re-plan (`broker plan`) to see current prices")
        return row

    def create_body(self, req: NodeRequest) -> dict[str, Any]:
        """The ``PUT /api/v0/asks/{id}/`` body: image, disk (GiB), env, onstart (dead-man switch first, with the
        idle stop when ``req.idle_minutes``, then the SSH key, then the request's own onstart; gzip+base64 when
        over 4048 chars), label, runtype ssh."""
        parts = ["#!/bin/bash"]
        if req.deadline is not None or req.idle_minutes:
            from broker.nodescripts import job_done_path

            parts.append(onstart_script(req.deadline, req.grace_seconds, self.api_url, idle_minutes=req.idle_minutes,
                                        done_file=job_done_path("root", self.node_workroot)))
        if req.ssh_public_key.strip():
            k = shlex.quote(req.ssh_public_key.strip())
            parts.append("mkdir -p /root/.ssh && chmod 700 /root/.ssh && touch /root/.ssh/authorized_keys && "
                         f"(grep -qxF {k} /root/.ssh/authorized_keys || echo {k} >> /root/.ssh/authorized_keys) && "
                         "chmod 600 /root/.ssh/authorized_keys")
        if req.onstart:
            parts.append(req.onstart)
        env: dict[str, str] = {"BROKER_RUN_ID": req.run_id, "BROKER_NODE_INDEX": str(req.node_index)}
        for port in req.network.get("ports", []) or []:  # only when the topology needs a port from outside
            env[f"-p {int(port)}:{int(port)}"] = "1"
        return {
            "client_id": "me",
            "image": req.image or DEFAULT_IMAGE,
            "disk": float(req.disk_gib),
            "env": env,
            "onstart": fit_onstart("\n".join(parts) + "\n"),
            "runtype": "ssh_direc ssh_proxy",
            "label": self._label(req.run_id, req.node_index),
            "cancel_unavail": True,
            "target_state": "running",
        }

    def create_instance(self, req: NodeRequest) -> str:
        """Rent ``req.offer`` (re-quoted live first); returns the instance (contract) id.

        Raises OfferGone (rented by someone else, withdrawn, or price up > tolerance), AuthError (401/403),
        ProviderError (402 / insufficient credit, hint: add credit), TransientError (429/5xx after retries).
        A 5xx or lost connection during the rent is not retried blindly: the instance is looked up by its label
        (and machine) and returned when it exists.
        """
        self.requote(req.offer, req.disk_gib)
        body = self.create_body(req)
        call = f"create instance from offer {req.offer.offer_id} (PUT /api/v0/asks/{req.offer.offer_id}/)"
        path = f"/api/v0/asks/{req.offer.offer_id}/"
        import httpx

        client = self._http(call)
        tries = 0
        while True:
            tries += 1
            try:
                r = client.put(path, json=body)
            except httpx.TransportError as exc:
                found = self._find_by_label(body["label"], req.offer)
                if found:
                    return found
                raise TransientError(PROVIDER, call, f"cannot reach Vast.ai: {type(exc).__name__}",
                                     hint="no instance with this run's label exists; retry") from None
            if r.status_code == 429 and tries < self.max_attempts and not _search_quota_exceeded(r):
                # 429 = rejected before processing: safe to resend
                self._sleep(min(MAX_RETRY_AFTER_S, _retry_after(r) or self.backoff_s * 2 ** (tries - 1)))
                continue
            break
        if r.status_code >= 500:
            found = self._find_by_label(body["label"], req.offer)
            if found:
                return found
        data: Any = None
        try:
            data = r.json()
        except ValueError:
            pass
        msg = self._scrub(_body_message(r)).lower()
        gone = any(w in msg for w in _GONE_WORDS)
        if r.status_code in (400, 404, 410) and gone:
            raise OfferGone(PROVIDER, call, f"offer {req.offer.offer_id} was taken before it could be rented "
                            f"(HTTP {r.status_code}: {self._scrub(_body_message(r))})",
                            hint="broker moves on to the next offer", status=r.status_code)
        self._raise_for(r, call)
        if not isinstance(data, dict) or not data.get("success") or data.get("new_contract") is None:
            if gone:
                raise OfferGone(PROVIDER, call, f"offer {req.offer.offer_id} was taken before it could be rented "
                                f"({self._scrub(_body_message(r))})", hint="broker moves on to the next offer")
            raise ProviderError(PROVIDER, call, f"unexpected answer {self._scrub(_body_message(r))!r}",
                                hint="check `broker reconcile` for an instance carrying this run's label")
        return str(data["new_contract"])

    def _find_by_label(self, label: str, offer: Offer | None = None) -> str | None:
        try:
            rows = self._list_rows()
        except ProviderError:
            return None
        machine = (offer.attrs.get("machine_id") if offer else None)
        for row in rows:
            if row.get("label") == label and (machine is None or row.get("machine_id") in (None, machine)):
                return str(row["id"])
        return None

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        """``GET /api/v0/instances/{id}/?owner=me`` mapped to InstanceInfo.

        ``actual_status``: null/created/loading/rebooting → pending; running → running; exited/offline/unknown/
        frozen → failed (they never become running: destroy it); stopped → stopped.  Gone (null or 404) →
        terminated.  SSH: ``ports["22/tcp"][0]["HostPort"]`` on ``public_ipaddr`` (direct) else
        ``ssh_host:ssh_port`` (proxy).  ``private_ip`` is 127.0.0.1: the simulated nodes share the one host.
        """
        call = f"describe instance {provider_id} (GET /api/v0/instances/{provider_id}/)"
        r = self._request("GET", f"/api/v0/instances/{provider_id}/", call, params={"owner": "me"})
        if r.status_code == 404:
            return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not found")
        self._raise_for(r, call)
        data = r.json()
        row = data.get("instances") if isinstance(data, dict) else None
        if isinstance(row, list):
            row = next((x for x in row if str(x.get("id")) == str(provider_id)), None)
        if not row:
            return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not found")
        return instance_info(provider_id, row)

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Destroy an instance (``DELETE /api/v0/instances/{id}/``; stop would keep billing storage).

        Idempotent: 404 / "not found" counts as gone.  Returns True when a describe confirms it gone.
        Raises NotSupported for kinds other than ``instance`` (Vast has no other billable objects here).
        """
        if kind != "instance":
            raise NotSupported(PROVIDER, f"terminate {kind}", "Vast.ai resources are instances only")
        call = f"destroy instance {provider_id} (DELETE /api/v0/instances/{provider_id}/)"
        r = self._request("DELETE", f"/api/v0/instances/{provider_id}/", call, json_body={})
        msg = _body_message(r).lower()
        if r.status_code != 404 and not (r.status_code in (400, 410) and any(w in msg for w in _GONE_WORDS)):
            self._raise_for(r, call)
            try:
                data = r.json()
            except ValueError:
                data = {}
            if isinstance(data, dict) and data.get("success") is False and not any(w in msg for w in _GONE_WORDS):
                raise ProviderError(PROVIDER, call, f"Vast.ai refused: {self._scrub(_body_message(r))}",
                                    hint="retry `broker down`; the instance stays listed until it is gone")
        return self.describe_instance(provider_id).state == "terminated"

    def _list_rows(self) -> list[dict[str, Any]]:
        """Every instance of the account: v1 list paginated by ``next_token``; v0 list when v1 is absent."""
        call = "list instances (GET /api/v1/instances/)"
        rows: list[dict[str, Any]] = []
        params: dict[str, Any] = {"select_filters": json.dumps({}),
                                  "order_by": json.dumps([{"col": "id", "dir": "asc"}]), "limit": json.dumps(25)}
        for _ in range(10_000):
            r = self._request("GET", "/api/v1/instances/", call, params=params)
            if r.status_code in (404, 405) and not rows:
                r0 = self._request("GET", "/api/v0/instances/", "list instances (GET /api/v0/instances/)",
                                   params={"owner": "me"})
                self._raise_for(r0, "list instances (GET /api/v0/instances/)")
                return [x for x in (r0.json().get("instances") or []) if isinstance(x, dict)]
            self._raise_for(r, call)
            data = r.json()
            rows.extend(x for x in (data.get("instances") or []) if isinstance(x, dict))
            token = data.get("next_token")
            if not token:
                break
            params["after_token"] = token if isinstance(token, str) else json.dumps(token)
        return rows

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Instances whose label starts with ``broker-run:`` (all runs, or ``run_id``'s).  ``name`` is rebuilt as
        ``broker-<run_id>-n<i>`` (the ledger's node name) from the label ``broker-run:<run_id>:n<i>``.

        Without a configured key nothing can be listed and [] is returned (reconcile / the watchdog loop over
        every provider); a rejected key raises AuthError.
        """
        if not self._api_key():
            return []
        out = []
        for row in self._list_rows():
            parsed = parse_label(row.get("label"))
            if parsed is None:
                continue
            rid, idx = parsed
            if run_id is not None and rid != run_id:
                continue
            start = row.get("start_date")
            out.append(TaggedResource(
                provider=PROVIDER, kind="instance", provider_id=str(row.get("id")), run_id=rid,
                region=row.get("geolocation"), state=row.get("actual_status") or row.get("cur_state"),
                created_at=datetime.fromtimestamp(float(start), timezone.utc) if isinstance(start, (int, float))
                else None,
                usd_per_hour=float(row["dph_total"]) if isinstance(row.get("dph_total"), (int, float)) else None,
                name=f"broker-{rid}-n{idx}" if idx is not None else row.get("label")))
        return out


# --------------------------------------------------------------------------------------------------- mapping
def parse_label(label: Any) -> tuple[str, int | None] | None:
    """``"broker-run:<run_id>:n<i>"`` → ``(run_id, i)``; ``"broker-run:<run_id>"`` → ``(run_id, None)``; else None."""
    if not isinstance(label, str) or not label.startswith(RUN_TAG + ":"):
        return None
    rest = label[len(RUN_TAG) + 1:]
    rid, sep, node = rest.rpartition(":")
    if sep and node.startswith("n") and node[1:].isdigit() and rid:
        return rid, int(node[1:])
    return (rest, None) if rest else None


def offer_from_row(row: dict[str, Any], now: datetime | None = None) -> Offer | None:
    """One ``/bundles/`` row → Offer (None when a required field is missing).

    Units: ``gpu_ram``/``cpu_ram`` MB → GiB (/1024); ``dph_total`` $/h for the whole host *including* storage at
    the searched ``allocated_storage``; ``storage_cost`` $/GB/month; ``inet_*_cost`` $/GB.
    """
    now = now or utcnow()
    try:
        n = int(row["num_gpus"])
        gpu = str(row["gpu_name"])
        price = float(row["dph_total"])
        oid = str(row["id"])
    except (KeyError, TypeError, ValueError):
        return None
    attrs_keys = ("machine_id", "host_id", "reliability", "reliability2", "inet_up", "inet_down", "inet_up_cost",
                  "inet_down_cost", "cuda_max_good", "driver_version", "verification", "direct_port_count",
                  "dph_base", "disk_space", "duration", "dlperf", "compute_cap", "public_ipaddr", "static_ip")
    attrs = {k: row[k] for k in attrs_keys if row.get(k) is not None}
    return Offer(
        provider=PROVIDER, offer_id=oid, instance_type=f"{n}x {gpu}", region=row.get("geolocation") or None,
        gpu_name=gpu, gpu_count=n, gpu_mem_gib=round(float(row.get("gpu_ram") or 0) / 1024, 2),
        vcpus=float(row.get("cpu_cores_effective") or row.get("cpu_cores") or 0),
        ram_gib=round(float(row.get("cpu_ram") or 0) / 1024, 2), usd_per_hour=price,
        # dph_total already prices the searched disk (allocated_storage = the recipe's disk_gib): storage must not
        # be added again, so the Offer carries none; the host's storage_cost stays visible in attrs
        storage_usd_per_gib_month=0.0, min_billed_seconds=1.0, private_network=False,
        price_source=f"live Vast.ai /api/v0/bundles/ {now.strftime('%Y-%m-%d %H:%M UTC')}", price_time=now,
        attrs={**attrs, "dph_includes_storage": True, "storage_cost": float(row.get("storage_cost") or 0.0)})


_PENDING = {None, "", "created", "loading", "rebooting", "scheduling"}
_FAILED = {"exited", "offline", "unknown", "frozen"}


def instance_info(provider_id: str, row: dict[str, Any]) -> InstanceInfo:
    """One instance row (show / list) → InstanceInfo (see :meth:`VastProvider.describe_instance`)."""
    raw = row.get("actual_status")
    if raw in _PENDING:
        state = "pending"
    elif raw == "running":
        state = "running"
    elif raw in _FAILED:
        state = "failed"
    elif raw == "stopped":
        state = "stopped"
    else:
        state = "unknown"
    ssh_host, ssh_port = row.get("ssh_host"), row.get("ssh_port")
    ports = row.get("ports")
    public = row.get("public_ipaddr") or None
    if isinstance(public, str):
        public = public.strip() or None
    if isinstance(ports, dict) and ports.get("22/tcp") and public:
        try:
            ssh_host, ssh_port = public, int(ports["22/tcp"][0]["HostPort"])
        except (KeyError, IndexError, TypeError, ValueError):
            pass
    try:
        port = int(ssh_port) if ssh_port is not None else 22
    except (TypeError, ValueError):
        port = 22
    msg = row.get("status_msg")
    return InstanceInfo(provider_id=str(provider_id), state=state, raw_state=raw if raw is not None else "null",
                        public_ip=public, private_ip="127.0.0.1", ssh_host=ssh_host or None, ssh_port=port,
                        ssh_user="root", message=str(msg).strip() if msg else None,
                        usd_per_hour=float(row["dph_total"]) if isinstance(row.get("dph_total"), (int, float))
                        else None)
