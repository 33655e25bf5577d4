"""``broker status`` without Typer, rich or pydantic, for the case it is mostly run in: a pipe or a file, and a ledger
whose runs have ended and that holds nothing live.

Building the Typer app, importing rich and validating rows with the pydantic records cost ~190 ms of a start that
otherwise reads 20 rows.  :func:`broker.cli.app.main` first offers the arguments to :func:`main`: :func:`parse`
takes ``broker status`` with ``--no-refresh``, ``--refresh``/``-r`` or ``--limit``/``-n N``, nothing else, then
:func:`run` reads the ledger read-only with sqlite3 and prints what the full command prints, byte for byte (plain
output: the same table, rows stripped of trailing blanks, as :class:`broker.core.ui._RStripped` prints it).
:func:`run` returns False, having printed nothing, wherever the full command could print anything else or do
anything more, and the full command then runs as before:

* stdout is a terminal (colours, rich's layout) or rich is told to treat it as one (``FORCE_COLOR``,
  ``TTY_COMPATIBLE``);
* the home or the ledger would be created, narrowed (mode), migrated, or has a journal to replay; a background run
  is starting (``<home>/starting``);
* a resource is live (refreshed at its provider, shown with its armed layers, overdue switches, errors), or an
  active run has a CLI process to check (settled as ``interrupted`` when dead), or a listed run is active;
* a row does not pass a check at least as strict as the records' validation (a damaged row: the full command
  skips it and names it on stderr), a time without a zone, a text that is not plain printable ASCII;
* the watchdog's heartbeat carries provider errors or names another ledger; the newest run failed with a cause to
  quote; a line would wrap or the table would not fit the width whole.

tests/cli/test_faststatus.py compares both paths' output over several ledgers and checks each refusal.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

#: the only options taken here; anything else (``--help``, ``--json``, ``--wide``, a RUN argument...) is Typer's
_FLAGS = {"--no-refresh": "no_refresh", "--refresh": "refresh", "-r": "refresh"}
_PRINTABLE = re.compile(r"[ -~]*")

# What opening the ledger the full way checks and decodes, copied from broker.money.ledger so that this start does
# not import it (with uuid, platform, the journal and hashlib: ~20 ms); tests/cli/test_faststatus.py holds each
# copy equal to the ledger's own.
#: every table and index the ledger's schema script creates (a ledger without one is made up by the full command)
SCHEMA_NAMES = frozenset({"meta", "runs", "resources", "resources_run", "resources_state", "runs_created",
                          "runs_with_pid", "resources_live", "events", "events_run", "attempts", "quota_requests"})
#: (table, column) a ledger of an older schema lacks until the full command migrates it
MIGRATED = (("resources", "stopped_at"), ("resources", "stopped_usd_per_hour"), ("resources", "banked_usd"),
            ("resources", "rate_since"), ("runs", "pid_start"))
SCHEMA_VERSION = 2
RUN_JSON = ("recipe", "plan", "exit_codes", "log_paths")
RES_JSON = ("attrs",)
TIMES = ("created_at", "started_at", "ended_at", "deadline", "running_since", "terminated_at", "updated_at", "at",
         "stopped_at", "rate_since")
#: the journal beside the ledger, and the folder of its fallback (broker.money.journal)
JOURNAL_NAME = "ledger.journal"
JOURNAL_FALLBACK = "/tmp/broker-{euid}"


class _NotMine(Exception):
    """The full command must run (see the module docstring)."""


def parse(args: list[str]) -> int | None:
    """The ``--limit`` of ``broker status [--no-refresh | --refresh | -r] [--limit N | -n N]`` (``args`` after the
    program name, no root option), or None when Typer must parse the line."""
    if not args or args[0] != "status" or any(k.endswith("_COMPLETE") for k in os.environ):
        return None
    limit, seen = 20, set()
    rest = args[1:]
    j = 0
    while j < len(rest):
        word = rest[j]
        if word in _FLAGS:
            seen.add(_FLAGS[word])
        elif word in ("--limit", "-n") and j + 1 < len(rest) and rest[j + 1].isdigit():
            limit = int(rest[j + 1])  # given twice: the last one, as click
            j += 1
        else:
            return None
        j += 1
    if len(seen) == 2 or not 1 <= limit <= 1000:  # the contradiction is the full command's error to say
        return None
    return limit


def main(args: list[str]) -> bool:
    """``broker ARGS`` printed here (True), or False when Typer must parse and run the line."""
    limit = parse(args)
    return limit is not None and run(limit)


def run(limit: int) -> bool:
    """Print ``broker status`` for ``limit`` runs when this module can (see the module docstring): True when it
    printed, False (nothing printed, nothing written) when the full command must run."""
    try:
        text = _render(limit)
    except Exception:  # noqa: BLE001 - _NotMine, or a row the money code cannot take: the full command decides
        return False
    sys.stdout.write(text)
    sys.stdout.flush()
    return True


def _width() -> int:
    """The width rich's console takes for stdout (``COLUMNS``, else the first of stdin/stdout/stderr that is a
    terminal, else 80)."""
    columns = os.environ.get("COLUMNS")
    if columns is not None and columns.isdigit():
        return int(columns)
    for fd in (0, 1, 2):
        try:
            w = os.get_terminal_size(fd).columns
        except (AttributeError, ValueError, OSError):
            continue
        return w or 80
    return 80


def _private(path: Any, mode: int, kind: str) -> None:
    """``path`` is this user's ``kind`` (``dir``/``file``), no link, with exactly ``mode``: nothing to create or
    narrow."""
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        raise _NotMine from None
    ok = stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)
    if not ok or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != mode:
        raise _NotMine


def _journal_waits(home: Any) -> bool:
    """broker.money.journal.journal_exists: the journal beside the ledger, or this home's in the fallback folder
    (named by a hash of the home's path, computed only when that folder holds any journal)."""
    if os.path.lexists(home / JOURNAL_NAME):
        return True
    folder = JOURNAL_FALLBACK.format(euid=os.geteuid())
    try:
        if not any(n.endswith(".journal") for n in os.listdir(folder)):
            return False
    except OSError:
        return False
    import hashlib

    tag = hashlib.sha256(str(home.absolute()).encode()).hexdigest()[:12]
    return os.path.lexists(f"{folder}/ledger-{tag}.journal")


def _open(home: Any) -> Any:
    """The ledger, read-only, when opening it the full way would change nothing (schema, migration, meta rows,
    modes, journal)."""
    import sqlite3

    _private(home, 0o700, "dir")
    if not os.access(home, os.W_OK):
        raise _NotMine
    path = home / "ledger.sqlite"
    _private(path, 0o600, "file")
    for side in ("-wal", "-shm"):
        if os.path.lexists(f"{path}{side}"):
            _private(f"{path}{side}", 0o600, "file")
    if _journal_waits(home):
        raise _NotMine
    try:
        if any(os.scandir(home / "starting")):
            raise _NotMine
    except OSError:
        pass
    try:
        db = sqlite3.connect(path.as_uri() + "?mode=ro", uri=True, timeout=30.0)
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
        cols = {t: {r[1] for r in db.execute(f"PRAGMA table_info({t})")} for t in ("runs", "resources")}
        meta = dict(db.execute("SELECT key, value FROM meta WHERE key IN ('schema_version', 'installation_id')"))
        wal = db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # else the full command switches it to WAL
    except sqlite3.Error:
        raise _NotMine from None
    if not wal or not SCHEMA_NAMES <= names or any(c not in cols[t] for t, c in MIGRATED) \
            or "installation_id" not in meta:
        raise _NotMine
    try:
        if int(meta.get("schema_version")) < SCHEMA_VERSION:
            raise _NotMine
    except (TypeError, ValueError):
        raise _NotMine from None
    db.row_factory = sqlite3.Row
    return db


def _decoded(row: Any, json_keys: tuple[str, ...]) -> dict[str, Any]:
    """broker.money.ledger._dec_row: the JSON columns and times decoded; ValueError where one does not decode."""
    import json
    from datetime import datetime

    d = dict(row)
    for k in json_keys:
        if d.get(k) is not None:
            try:
                d[k] = json.loads(d[k])
            except (TypeError, ValueError) as e:
                raise ValueError(k) from e
    for k in TIMES:
        if d.get(k):
            try:
                d[k] = datetime.fromisoformat(d[k])
            except (TypeError, ValueError) as e:
                raise ValueError(k) from e
    return d


def _record(row: Any, json_keys: tuple[str, ...], spec: dict[str, tuple[Any, bool]]) -> Any:
    """The row as an object with the record's fields, when every field passes a check at least as strict as the
    record's validation: ``spec`` field -> (type or set of allowed values, may be None)."""
    from datetime import datetime
    from types import SimpleNamespace

    try:
        d = _decoded(row, json_keys)
    except ValueError:
        raise _NotMine from None
    out = {}
    for field, (kind, optional) in spec.items():
        v = d.get(field)
        if v is None:
            if not optional:
                raise _NotMine
        elif kind is float:
            if type(v) not in (int, float) or v != v or v in (float("inf"), float("-inf")):
                raise _NotMine
            v = float(v)
        elif kind is datetime:
            if not isinstance(v, datetime) or v.tzinfo is None:
                raise _NotMine
        elif isinstance(kind, (set, frozenset)):
            if type(v) is not str or v not in kind:
                raise _NotMine
        elif type(v) is not kind:
            raise _NotMine
        out[field] = v
    return SimpleNamespace(**out)


def _specs() -> tuple[dict, dict]:
    from datetime import datetime
    from typing import get_args

    from broker.core.model import ResourceState, RunStatus

    run = {"id": (str, False), "name": (str, False), "recipe_path": (str, True), "recipe": (dict, False),
           "plan": (dict, True), "provider": (str, False), "topology": (str, False),
           "status": (set(get_args(RunStatus)), False), "created_at": (datetime, False),
           "started_at": (datetime, True), "ended_at": (datetime, True), "deadline": (datetime, True),
           "budget_usd": (float, True), "exit_codes": (dict, False), "run_dir": (str, True),
           "log_paths": (dict, False), "message": (str, True), "pid": (int, True), "pid_start": (int, True)}
    res = {"id": (str, False), "run_id": (str, False), "provider": (str, False), "kind": (str, False),
           "name": (str, False), "provider_id": (str, True), "region": (str, True), "zone": (str, True),
           "state": (set(get_args(ResourceState)), False), "usd_per_hour": (float, False),
           "created_at": (datetime, False), "running_since": (datetime, True), "terminated_at": (datetime, True),
           "deadline": (datetime, True), "terminated_by": (str, True), "error": (str, True),
           "attrs": (dict, False), "stopped_at": (datetime, True), "stopped_usd_per_hour": (float, True),
           "banked_usd": (float, False), "rate_since": (datetime, True)}
    return run, res


def _run(row: Any, spec: dict) -> Any:
    r = _record(row, RUN_JSON, spec)
    if any(type(k) is not str or (v is not None and type(v) is not int) for k, v in r.exit_codes.items()) \
            or any(type(k) is not str or type(v) is not str for k, v in r.log_paths.items()):
        raise _NotMine
    return r


def _resource(row: Any, spec: dict) -> Any:
    from broker.core.rowattrs import AttrsRefused, check_attrs
    r = _record(row, RES_JSON, spec)
    try:
        r.attrs = check_attrs(r.kind, r.run_id, r.attrs, runs=None)
    except (AttrsRefused, ValueError, TypeError):
        raise _NotMine from None
    return r


def _plain(text: str, width: int) -> str:
    """``text`` as one line of prose: printable ASCII that fits ``width`` (no wrap), else the full command."""
    if len(text) > width or not _PRINTABLE.fullmatch(text):
        raise _NotMine
    return text + "\n"


#: what the status line says when no watchdog has run in this home (status.py prints the same words)
NO_WATCHDOG_HINT = "(a paid `broker run` starts it; or `broker watchdog`)"


def _render(limit: int) -> str:
    if "FORCE_COLOR" in os.environ or "TTY_COMPATIBLE" in os.environ:
        raise _NotMine
    try:  # a terminal: colours and rich's layout; an encoding without box lines: rich's ASCII table
        if sys.stdout.isatty() or not str(sys.stdout.encoding).lower().replace("-", "").startswith("utf"):
            raise _NotMine
    except (AttributeError, ValueError):
        raise _NotMine from None
    from pathlib import Path

    from broker.money.accounting import ACTIVE_STATUSES, system_clock, watchdog_state

    width = _width()
    env_home = os.environ.get("BROKER_HOME", "").strip()
    if env_home:  # broker.core.config.home_path, without importing the settings
        home = Path(env_home).expanduser()
    else:
        from broker.core.config import home_path

        home = home_path()
    db = _open(home)
    try:
        marks = ",".join("?" for _ in ACTIVE_STATUSES)
        if db.execute("SELECT 1 FROM resources WHERE state != 'terminated' LIMIT 1").fetchone() \
                or db.execute(f"SELECT 1 FROM runs WHERE pid IS NOT NULL AND status IN ({marks}) LIMIT 1",
                              ACTIVE_STATUSES).fetchone():
            raise _NotMine
        run_spec, res_spec = _specs()
        runs = [_run(r, run_spec) for r in
                db.execute("SELECT * FROM runs ORDER BY created_at DESC LIMIT ?", (limit,)).fetchall()]
        if any(r.status in ACTIVE_STATUSES for r in runs):
            raise _NotMine
        res: dict[str, list[Any]] = {r.id: [] for r in runs}
        ids = list(res)
        for k in range(0, len(ids), 500):
            chunk = ids[k:k + 500]
            q = f"SELECT * FROM resources WHERE run_id IN ({','.join('?' for _ in chunk)}) ORDER BY created_at"
            for row in db.execute(q, chunk).fetchall():
                x = _resource(row, res_spec)
                if x.state != "terminated":
                    raise _NotMine
                res[x.run_id].append(x)
    except Exception as e:  # noqa: BLE001 - a ledger this cannot read: the full command says why
        if isinstance(e, _NotMine):
            raise
        raise _NotMine from None
    finally:
        db.close()
    now = system_clock()
    wd = watchdog_state(now, home=home)  # the home checked above: broker_home() would create nothing
    if wd.errors or wd.other_ledger:
        raise _NotMine
    if not runs and not wd.pid:
        # what status._print_nothing_yet prints in a pipe
        return ("no runs yet (`broker run recipes/ddp_2node.yaml` starts one).\n"
                f"watchdog: not running {NO_WATCHDOG_HINT}\n"
                "no live resources (nothing is billing).\n")
    out = _runs_table(runs, res, now, width) if runs else _plain(
        "no runs yet (`broker run recipes/ddp_2node.yaml` starts one).", width)
    if runs:
        from broker.cli.rundiag import latest_failure_line

        if latest_failure_line({"id": runs[0].id, "status": runs[0].status, "run_dir": runs[0].run_dir}):
            raise _NotMine
    out += _plain(_watchdog_line(wd), width)
    return out + _plain("no live resources (nothing is billing).", width)


def _watchdog_line(wd: Any) -> str:
    """status._watchdog_line as printed in a pipe, for a heartbeat without errors of this ledger."""
    def ago(s: float | None) -> str:
        return "-" if s is None else f"{_dur(max(0.0, s))} ago"

    if wd.alive:
        return f"watchdog: running (pid {wd.pid}, last pass {ago(wd.age_s)})"
    if wd.pid:
        return f"watchdog: not running (pid {wd.pid} last seen {ago(wd.age_s)}): start `broker watchdog`"
    return f"watchdog: not running {NO_WATCHDOG_HINT}"


def _dur(seconds: float) -> str:
    s = abs(seconds)
    txt = f"{s:.0f} s" if s < 120 else (f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h")
    return f"passed {txt} ago" if seconds < 0 else txt


#: a run's ledger status as words, for the narrow table (``--wide`` and ``--json`` keep the ledger's value)
_RUN_STATUS_WORDS = {"torn_down": "torn down", "tearing_down": "tearing down"}


def run_status_words(status: str) -> str:
    """A run's status in the narrow table of ``broker status`` (here and in broker.cli.status)."""
    return _RUN_STATUS_WORDS.get(status, status.replace("_", " "))


def short_where(provider: str | None, topology: str | None) -> str:
    """Where a run ran, for the narrow table of ``broker status`` (here and in broker.cli.status): the provider,
    and the topology when it says more than the provider's name (``vast simulated``, ``oci multi-node``), but not
    one that only repeats the provider (``slurm-cluster`` on ``slurm``) or that a provider which rents nothing
    always has (``netns``: multi-node; the registry's ``NOT_RENTED``)."""
    from broker.providers import NOT_RENTED

    provider = provider or "?"
    if topology and (provider in topology or provider in NOT_RENTED):
        return provider
    if not topology or topology == provider or topology == "any":
        return provider
    return f"{provider} {topology}"


def _runs_table(runs: list[Any], res: dict[str, list[Any]], now: Any, width: int) -> str:
    """The narrow runs table of status._narrow_runs_table as rich prints it in a pipe, when every cell fits whole
    (ended runs only: no time-left column)."""
    from broker.core.prose import usd
    from broker.money.accounting import run_cost

    rows = []
    for r in runs:
        c = run_cost(r, res[r.id], now)
        if c.live or "[" in r.id:  # the full command passes the id to rich unescaped: markup would be read
            raise _NotMine
        rows.append((r.id, r.name, short_where(r.provider, r.topology), run_status_words(r.status),
                     f"{usd(c.spent_usd)} / {usd(c.budget_usd)}"))
    head = ("run", "name", "where", "status", "spent / budget")
    for row in rows:
        for cell in row:
            if not _PRINTABLE.fullmatch(cell):
                raise _NotMine
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head))]
    total = sum(widths) + 2 * (len(head) - 1)
    if total > width:  # tight: "$0.00/$5.00", as the full command (two more cells for the names)
        head = head[:4] + ("spent/budget",)
        rows = [row[:4] + (row[4].replace(" / ", "/"),) for row in rows]
        widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head))]
        total = sum(widths) + 2 * (len(head) - 1)
    if total > width or len("runs") > width:  # the full command ellipsizes a name or a place: not done here
        raise _NotMine
    lines = ["runs", "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(), "\u2500" * total]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines) + "\n"
