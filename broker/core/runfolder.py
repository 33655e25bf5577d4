"""A run's folder and what broker reads from it, as input: a ledger row's ``run_dir`` / ``log_paths`` and the
``cluster.json`` inside the folder may have been crafted (another local user, an edited ledger), so before any of
them names a file to read, delete or pass to ``ssh``:

* :func:`confined_run_dir`: the row's folder must be ``<real home>/runs/<the row's own id>`` (resolved, no symlink
  on the way); otherwise BadInput naming the row;
* :func:`confined_log`: a log path must resolve inside that folder;
* :func:`check_cluster`: every node's ``user`` / ``host`` / ``port`` and the key / known_hosts paths have a safe
  form (a user name, an IP address or DNS name, 1..65535, paths inside the run folder) before they reach an ssh
  argv or an ssh_config line.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from broker.core.provider import BadInput

#: an SSH user name as broker's providers create them (no leading '-': never an ssh option)
USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
#: one DNS label
_LABEL_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def run_dir_refusal(run_dir: str | None, run_id: str, runs: Path) -> tuple[str | None, Path | None]:
    """(why ``run_dir`` is refused, None) or (None, its real path) when it resolves to exactly
    ``<real runs>/<run_id>``: refused are a missing value, relative paths, ``..`` parts, a symlink anywhere on the
    way (the resolved path differs from the absolute one), and another run's folder."""
    if not run_dir:
        return "no folder recorded", None
    p = Path(run_dir)
    if not p.is_absolute():
        return f"{run_dir!r} is a relative path", None
    if ".." in p.parts:
        return f"{run_dir!r} contains '..'", None
    try:
        root = runs.resolve(strict=True)
        real = p.resolve(strict=False)
    except (OSError, RuntimeError) as e:
        return f"{run_dir} cannot be resolved ({e})", None
    if p.is_symlink():
        return f"{run_dir} is a symbolic link (to {os.readlink(p)})", None
    if real != root / run_id:
        if real.parent == root:
            return f"{run_dir} is the folder of another run ({real.name}), not of run {run_id}", None
        return f"{run_dir} is not {root / run_id}", None
    return None, real


def confined_run_dir(run: Any, *, runs: Path | None = None) -> Path:
    """The real path of ``run``'s folder when the ledger row's ``run_dir`` is ``<home>/runs/<run.id>``; raises
    BadInput naming the row otherwise (nothing in it is then read, run or deleted)."""
    if runs is None:
        from broker.core.config import runs_dir

        runs = runs_dir()
    why, real = run_dir_refusal(run.run_dir, run.id, runs)
    if why:
        raise BadInput(f"refused: the ledger row of run {run.id} names the folder {run.run_dir!r}: {why}; a run's "
                       f"folder must be {Path(runs) / run.id}",
                       hint="the ledger row was damaged or edited by someone else: check `broker status` and the "
                            "ledger's owner; nothing in that folder was used")
    assert real is not None
    return real


def confined_log(run: Any, node: int, *, runs: Path | None = None) -> Path:
    """Node ``node``'s log of ``run``: the row's ``log_paths`` entry (default ``node<i>.log``) resolved inside the
    run's confined folder; raises BadInput naming the row when it points elsewhere."""
    folder = confined_run_dir(run, runs=runs)
    raw = (run.log_paths or {}).get(str(node))
    p = Path(raw) if raw else folder / f"node{node}.log"
    if not p.is_absolute():
        p = folder / p
    real = p.resolve(strict=False)
    if real != folder and folder not in real.parents:
        raise BadInput(f"refused: the ledger row of run {run.id} names {raw!r} as node {node}'s log, which is not "
                       f"inside the run's folder {folder}",
                       hint="the ledger row was damaged or edited; nothing was read")
    return real


def valid_host(host: Any) -> bool:
    """An IP address or a DNS name (labels of letters, digits, ``-`` / ``_``; no spaces, no leading ``-``)."""
    if not isinstance(host, str) or not host or host.startswith("-") or len(host) > 253:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return all(_LABEL_RE.fullmatch(label) for label in host.rstrip(".").split("."))


def check_cluster(cluster: Any, run: Any, folder: Path) -> Any:
    """``cluster`` (a stored cluster.json) when every node's user, host and port and the key / known_hosts
    paths have a safe form (:data:`USER_RE`, :func:`valid_host`, 1..65535, inside ``folder``); raises BadInput
    naming the run, node and field otherwise."""
    def refuse(what: str, value: Any) -> BadInput:
        return BadInput(f"refused: {folder / 'cluster.json'} of run {run.id} has {what} {value!r}, which is not "
                        "allowed; nothing was run",
                        hint="the run's folder was edited by someone else; `broker down "
                             f"{run.id}` still ends its nodes")

    for n in cluster.nodes:
        if getattr(n, "local", False):
            continue
        if not isinstance(n.user, str) or not USER_RE.fullmatch(n.user):
            raise refuse(f"node {n.node_rank} user", n.user)
        if not valid_host(n.host):
            raise refuse(f"node {n.node_rank} host", n.host)
        if n.port is not None and (isinstance(n.port, bool) or not isinstance(n.port, int)
                                   or not 1 <= n.port <= 65535):
            raise refuse(f"node {n.node_rank} port", n.port)
    for field in ("ssh_key_path", "known_hosts_path"):
        value = getattr(cluster, field, None)
        if not value:
            continue
        real = Path(value).resolve(strict=False)
        if folder not in real.parents or any(c in str(value) for c in "\n\r\"'") or str(value).startswith("-"):
            raise refuse(field, value)
    return cluster


# --------------------------------------------------------------------------------------------------- run ids
#: environment variable that hands a background ``broker run -d`` the run id its parent chose and printed
RUN_ID_ENV = "BROKER_RUN_ID"
#: the form of a run id: UTC start ``YYYYMMDD-HHMMSS`` and 6 hex digits
RUN_ID_RE = r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}"


def make_run_id() -> str:
    """A new run id: the UTC time and 6 random hex digits (``20261202-004241-3fa9c1``)."""
    import uuid

    from broker.core.model import utcnow

    return utcnow().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def reserved_run_id() -> str | None:
    """The run id a ``broker run -d`` parent chose for this process (:data:`RUN_ID_ENV`, taken once: removed from
    the environment so no child process inherits it), or None.  An id of another form is ignored (None)."""
    import os
    import re

    rid = os.environ.pop(RUN_ID_ENV, None)
    return rid if rid and re.fullmatch(RUN_ID_RE, rid) else None
