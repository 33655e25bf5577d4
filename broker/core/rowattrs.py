"""The ``attrs`` of a ledger resource row, as data with a schema per kind (never a free dict that can command).

A ledger row is input: another local user or an edited file may have written it.  Every attrs field that names a
program, a path, a PID, an interface or a host is checked against what broker itself writes there before anything
uses it; a row that fails is *damaged* (:class:`broker.money.ledger.Ledger` names it once and skips it, as it does a
row with a bad state or time), so ``broker down``, the watchdog, ``reconcile`` and ``status`` never act on it.

What broker writes, per kind (:data:`SCHEMAS`; fields not listed are facts such as prices and are not checked here):

* ``local_node`` (this machine's part of a hybrid run): ``python`` is this interpreter (``sys.executable``);
  ``probe``, ``job_pidfile``, ``pidfile`` and ``keys`` are inside ``<home>/runs/<the row's run id>/`` (resolved: no
  ``..``, no symlink out); ``iface`` is the run's own tunnel interface (:func:`tunnel_iface`); ``run_id`` is the row's
  run; ``subnet`` is a /24 of 198.18.0.0/15; ``mesh`` and ``how`` are one of their few words;
* ``netns_node``: ``cid`` is a whole netns cluster id (``bkn`` + 6 hex digits);
* ``slurm_job``: ``host`` is ``[user@]host`` (a user name, an IP address or DNS name; never an ssh option);
  ``cluster`` is a run id;
* every other kind: ``python``, ``probe``, ``pid``, ``pidfile``, ``job_pidfile``, ``keys`` and ``iface`` are refused
  (broker records no program, process or interface on them).

A rented machine's addresses (``public_ip``, ``ssh_host``) are not reasons to skip its row: that would leave it
billing with nobody to end it (the provider's tags decide what ``down`` may terminate); they are checked where they
are used (:func:`row_address`).

Errors: :func:`check_attrs` raises :class:`AttrsRefused` (a ValueError) naming the field, the value and why.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

#: this machine's WireGuard interface of a hybrid run: ``bkwg`` + the run id's last 6 letters / digits
TUNNEL_IFACE_PREFIX = "bkwg"
#: a netns cluster id (providers.netns): ``bkn`` and 6 hex digits
NETNS_CID_RE = re.compile(r"bkn[0-9a-f]{6}")
#: a run id (broker.core.runfolder.RUN_ID_RE)
_RUN_ID_RE = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")
#: where broker's tunnels and netns clusters take their addresses
_OWN_NET = ipaddress.ip_network("198.18.0.0/15")


class AttrsRefused(ValueError):
    """An attrs field of a ledger row that broker would not have written: ``field``, ``value`` and ``why``."""

    def __init__(self, field: str, value: Any, why: str):
        super().__init__(f"attrs.{field} = {value!r}: {why}")
        self.field, self.value, self.why = field, value, why


def tunnel_iface(run_id: str) -> str:
    """This machine's tunnel interface of run ``run_id``: ``bkwg`` + the run id's last 6 characters (letters and
    digits only; at most 15 characters, Linux's limit)."""
    tail = re.sub(r"[^a-z0-9]", "", run_id.lower())[-6:]
    return f"{TUNNEL_IFACE_PREFIX}{tail}"


def is_this_python(value: Any) -> bool:
    """Whether ``value`` names this interpreter (``sys.executable``, the same path or the same real file)."""
    if not isinstance(value, str) or not value or not sys.executable:
        return False
    if value == sys.executable:
        return True
    try:
        return os.path.isabs(value) and os.path.realpath(value) == os.path.realpath(sys.executable)
    except (OSError, ValueError):
        return False


def valid_user_host(value: Any) -> bool:
    """``[user@]host`` with a user name of :data:`broker.core.runfolder.USER_RE`'s form and an IP / DNS host."""
    from broker.core.runfolder import USER_RE, valid_host

    if not isinstance(value, str):
        return False
    user, _, host = value.rpartition("@")
    return (not user or bool(USER_RE.fullmatch(user))) and valid_host(host)


def _inside_run(value: Any, run_id: str, runs: Path) -> str | None:
    """Why ``value`` is not a path inside ``<runs>/<run_id>/`` (None when it is)."""
    if not isinstance(value, str) or not value:
        return "not a path"
    if any(ord(c) < 32 for c in value):
        return "holds control characters"
    p = Path(value)
    if not p.is_absolute():
        return "a relative path"
    if ".." in p.parts:
        return "contains '..'"
    try:
        folder = (Path(runs).resolve(strict=False) / run_id)
        real = p.resolve(strict=False)
    except (OSError, RuntimeError) as e:
        return f"cannot be resolved ({e})"
    if folder not in real.parents:
        return f"not inside the run's folder {folder}"
    return None


# ------------------------------------------------------------------------------------------------ field checks
#: a check: (value, the row's run id, the runs folder) -> why it is refused, or None
Check = Callable[[Any, str, Path], "str | None"]


def _path(v: Any, run_id: str, runs: Path) -> str | None:
    return _inside_run(v, run_id, runs)


def _python(v: Any, run_id: str, runs: Path) -> str | None:
    return None if is_this_python(v) else f"not this interpreter ({sys.executable})"


def _iface(v: Any, run_id: str, runs: Path) -> str | None:
    return None if v == tunnel_iface(run_id) else f"not this run's tunnel interface ({tunnel_iface(run_id)})"


def _same_run(v: Any, run_id: str, runs: Path) -> str | None:
    return None if v == run_id else f"not the row's run ({run_id})"


def _run_id(v: Any, run_id: str, runs: Path) -> str | None:
    return None if isinstance(v, str) and _RUN_ID_RE.fullmatch(v) else "not a run id"


def _subnet(v: Any, run_id: str, runs: Path) -> str | None:
    try:
        net = ipaddress.ip_network(str(v), strict=True)
    except ValueError:
        return "not a network"
    return None if net.prefixlen >= 16 and net.subnet_of(_OWN_NET) else f"not inside {_OWN_NET}"  # type: ignore[arg-type]


def _user_host(v: Any, run_id: str, runs: Path) -> str | None:
    return None if valid_user_host(v) else "not a [user@]host (an IP address or DNS name)"


def _cid(v: Any, run_id: str, runs: Path) -> str | None:
    return None if isinstance(v, str) and NETNS_CID_RE.fullmatch(v) else "not a netns cluster id (bkn + 6 hex digits)"


def _one_of(*words: str) -> Check:
    def check(v: Any, run_id: str, runs: Path) -> str | None:
        return None if v in words else f"not one of {', '.join(words)}"
    return check


def _never(v: Any, run_id: str, runs: Path) -> str | None:
    return "broker records no process or pid file on this kind of row"


def _flag(v: Any, run_id: str, runs: Path) -> str | None:
    return None if isinstance(v, bool) else "not true / false"


#: fields checked on every kind of row (a kind's own schema below may override one)
COMMON: dict[str, Check] = {"pid": _never, "pidfile": _never, "python": _never, "probe": _never,
                            "job_pidfile": _never, "keys": _never, "iface": _never}

#: kind -> field -> check (what broker writes on rows of that kind)
SCHEMAS: dict[str, dict[str, Check]] = {
    "local_node": {"run_id": _same_run, "mesh": _one_of("wireguard", "tailscale"), "python": _python,
                   "probe": _path, "job_pidfile": _path, "pidfile": _path, "keys": _path, "iface": _iface,
                   "subnet": _subnet, "how": _one_of("kernel", "wireguard-go")},
    "netns_node": {"cid": _cid, "hybrid": _flag},
    "slurm_job": {"cluster": _run_id, "host": _user_host},
}


def row_address(attrs: dict[str, Any] | None, field: str) -> str | None:
    """``attrs[field]`` (``public_ip``, ``private_ip``, ``ssh_host``) when it is an IP address or DNS name, else None
    (absent, or a value broker would not have recorded: then it is not used)."""
    from broker.core.runfolder import valid_host

    v = (attrs or {}).get(field)
    return v if isinstance(v, str) and valid_host(v) else None


def check_attrs(kind: str, run_id: str, attrs: dict[str, Any] | None, *, runs: Path | None = None) -> dict[str, Any]:
    """``attrs`` when every field that names a program, a path, a PID, an interface or a host is what broker writes
    on a ``kind`` row of run ``run_id`` (:data:`SCHEMAS`, :data:`COMMON`; ``None`` values are absent fields);
    raises :class:`AttrsRefused` for the first one that is not.  ``runs``: the runs folder (default
    ``<home>/runs``), read only when a path field is present."""
    if not attrs:
        return attrs or {}
    if not isinstance(attrs, dict):
        raise AttrsRefused("", attrs, "not a JSON object")
    schema = {**COMMON, **SCHEMAS.get(kind, {})}
    for field, check in schema.items():
        value = attrs.get(field)
        if value is None:
            continue
        if check is _path and runs is None:
            from broker.core.config import runs_dir

            runs = runs_dir()
        why = check(value, run_id, runs if runs is not None else Path("/nonexistent"))
        if why:
            raise AttrsRefused(field, value, why)
    return attrs


def local_node_run(attrs: dict[str, Any], *, runs: Path | None = None) -> str:
    """The run a ``local_node`` attrs belongs to: its ``run_id``, else the run folder its ``keys`` / ``pidfile``
    sit in; raises :class:`AttrsRefused` when neither names one (nothing of it is then used)."""
    rid = attrs.get("run_id")
    if isinstance(rid, str) and _RUN_ID_RE.fullmatch(rid):
        return rid
    if runs is None:
        from broker.core.config import runs_dir

        runs = runs_dir()
    for field in ("keys", "pidfile", "probe", "job_pidfile"):
        v = attrs.get(field)
        if isinstance(v, str) and Path(v).is_absolute():
            try:
                parts = Path(v).resolve(strict=False).relative_to(Path(runs).resolve(strict=False)).parts
            except ValueError:
                raise AttrsRefused(field, v, f"not inside {runs}") from None
            if parts and _RUN_ID_RE.fullmatch(parts[0]):
                return parts[0]
    raise AttrsRefused("run_id", rid, "no run named")
