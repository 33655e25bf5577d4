"""The ledger: one SQLite file (WAL) recording runs, every billable or cleanable resource, an event log and quota
requests.

Money is data: a resource row is written with state ``intent`` *before* the provider call that creates it, and
updated with the provider id right after (``mark_created``).  Crashes anywhere leave a row that ``broker status``
shows and ``broker down`` / the watchdog clean.  Secrets are never written here.

Location: ``broker.core.config.ledger_path()`` (``$BROKER_HOME/ledger.sqlite``), created 0600 (its ``-wal`` /
``-shm`` files too) in a 0700 home.  Several processes (CLI, watchdog)
share the file; every write is its own short transaction and readers never block writers (WAL).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from broker.core.model import utcnow

if TYPE_CHECKING:
    from broker.core.records import Resource, Run

#: 2: resources gained ``stopped_at``, ``stopped_usd_per_hour``, ``banked_usd``, ``rate_since`` (broker stop/start),
#: an older file gets them on open (:data:`_MIGRATIONS`); and the ``attempts`` table (one row per attempt of a run: a
#: preempted run is rented again), made by the schema script (``IF NOT EXISTS``): a run without rows there had one
#: attempt
SCHEMA_VERSION = 2
_log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    recipe_path TEXT,
    recipe TEXT,
    plan TEXT,
    provider TEXT,
    topology TEXT,
    status TEXT NOT NULL,
    created_at TEXT NOT NULL,
    started_at TEXT,
    ended_at TEXT,
    deadline TEXT,
    budget_usd REAL,
    exit_codes TEXT,
    run_dir TEXT,
    log_paths TEXT,
    message TEXT,
    pid INTEGER
);
CREATE TABLE IF NOT EXISTS resources (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    provider TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    provider_id TEXT,
    region TEXT,
    zone TEXT,
    state TEXT NOT NULL,
    usd_per_hour REAL NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    running_since TEXT,
    terminated_at TEXT,
    deadline TEXT,
    terminated_by TEXT,
    error TEXT,
    attrs TEXT,
    stopped_at TEXT,
    stopped_usd_per_hour REAL,
    banked_usd REAL NOT NULL DEFAULT 0,
    rate_since TEXT
);
CREATE INDEX IF NOT EXISTS resources_run ON resources(run_id);
CREATE INDEX IF NOT EXISTS resources_state ON resources(state);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created_at);
CREATE INDEX IF NOT EXISTS runs_with_pid ON runs(created_at) WHERE pid IS NOT NULL;
CREATE INDEX IF NOT EXISTS resources_live ON resources(created_at) WHERE state != 'terminated';
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    run_id TEXT,
    resource_id TEXT,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    message TEXT
);
CREATE INDEX IF NOT EXISTS events_run ON events(run_id);
CREATE TABLE IF NOT EXISTS attempts (
    run_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    started_at TEXT NOT NULL,
    ended_at TEXT,
    cause TEXT,
    detail TEXT,
    resource_ids TEXT,
    PRIMARY KEY (run_id, attempt)
);
CREATE TABLE IF NOT EXISTS quota_requests (
    id TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    region TEXT,
    scope TEXT,
    limit_name TEXT NOT NULL,
    requested_value REAL NOT NULL,
    unit TEXT,
    provider_request_id TEXT,
    state TEXT,
    reason TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT,
    detail TEXT
);
"""

#: columns added after schema 1, as (table, column, declaration): added to an older file when it is opened
_MIGRATIONS = (("resources", "stopped_at", "TEXT"), ("resources", "stopped_usd_per_hour", "REAL"),
               ("resources", "banked_usd", "REAL NOT NULL DEFAULT 0"), ("resources", "rate_since", "TEXT"),
               ("runs", "pid_start", "INTEGER"))

_RUN_JSON = ("recipe", "plan", "exit_codes", "log_paths")
_RES_JSON = ("attrs",)
_TIMES = ("created_at", "started_at", "ended_at", "deadline", "running_since", "terminated_at", "updated_at", "at",
          "stopped_at", "rate_since")


def _records() -> Any:
    """broker.core.records, imported on first use: its pydantic import (~100 ms) is only paid when a row is read, so
    `broker status` on an empty home never pays it (the comprehension calls this once per row, not at all for
    none)."""
    import broker.core.records

    return broker.core.records


def new_id(prefix: str = "") -> str:
    """A short random id (12 hex chars), optionally prefixed."""
    return prefix + uuid.uuid4().hex[:12]


def _enc(key: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.isoformat()
    if key in _RUN_JSON or key in _RES_JSON or key == "detail":
        return json.dumps(value, default=str)
    return value


def _dec_row(row: sqlite3.Row, json_keys: Iterable[str]) -> dict[str, Any]:
    """The row's columns decoded (JSON columns, times).  Raises _FieldError (a ValueError) naming the column
    whose text cannot be decoded."""
    d = dict(row)
    for k in json_keys:
        if d.get(k) is not None:
            try:
                d[k] = json.loads(d[k])
            except (TypeError, ValueError) as e:
                raise _FieldError(k, f"not JSON: {e}") from None
    for k in _TIMES:
        if d.get(k):
            try:
                d[k] = datetime.fromisoformat(d[k])
            except (TypeError, ValueError) as e:
                raise _FieldError(k, f"not a time: {e}") from None
    return d


#: (table, row id) already reported as damaged in this process: one line each, not one per read
_REPORTED: set[tuple[str, str]] = set()


def damaged_row_message(table: str, row: Any, exc: Exception, ledger_file: Any) -> str:
    """One sentence for a ledger row that does not validate: which run (and resource), which field, what to do."""
    field, why = "?", ""
    errors = getattr(exc, "errors", None)
    d = dict(row)
    value: Any = None
    if callable(errors):
        try:
            err = errors()[0]
            loc = err.get("loc") or ()
            field = ".".join(str(x) for x in loc) or "?"
            if err.get("type") == "attrs_refused":  # an attrs field broker would not write (broker.core.rowattrs)
                ctx = err.get("ctx") or {}
                field, value, why = f"attrs.{ctx.get('field')}", ctx.get("value"), f": {ctx.get('why')}"
        except Exception:  # noqa: BLE001 - the message below still names the row
            pass
    elif isinstance(exc, _FieldError):
        field = exc.field
    if value is None:
        value = d.get(field.split(".")[0]) if field != "?" else None
    run_id = d.get("run_id") if table == "resources" else d.get("id")
    what = f"run {run_id}" + (f" resource {d.get('id')}" if table == "resources" else "")
    shown = value if field.startswith("attrs.") and why else repr(value)
    return (f"damaged ledger row: {what} has an invalid {field} ({shown}){why}; the row is skipped. Fix or remove it "
            f"(sqlite3 {ledger_file} \"SELECT * FROM {table} WHERE id = '{d.get('id')}'\"), or restore the ledger "
            "from a backup; if it names a live resource, check the provider's console")


class _FieldError(ValueError):
    def __init__(self, field: str, why: str):
        super().__init__(why)
        self.field = field


def _private_file(path: Path) -> None:
    """Create the ledger file 0600 before SQLite opens it (SQLite gives its ``-wal`` / ``-shm`` files the
    database file's mode, so they are 0600 too); a ledger an older broker wrote 0644 is narrowed."""
    from broker.core.private import FILE_MODE, private_dir, tighten_file

    private_dir(path.parent)
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE))
    except FileExistsError:
        for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            tighten_file(p)


class Ledger:
    """Access to the ledger file.  Cheap to create; safe to use from several processes.

    Raises ``sqlite3.OperationalError`` only when the file is unusable (after a 30 s busy timeout).
    """

    def __init__(self, path: Path | str | None = None):
        if path is None:
            from broker.core.config import ledger_path

            path = ledger_path()
        self.path = Path(path)
        #: run / resource id -> the sentence for a row that did not validate (:meth:`_row`)
        self.damaged: dict[str, str] = {}
        _private_file(self.path)
        self._db = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._migrate()
        # written only when missing: an INSERT OR IGNORE takes the write lock even when it inserts nothing, and a
        # reader (`broker status` beside a run that holds the lock) must not wait for a writer to open the file
        have = {r[0] for r in self._db.execute("SELECT key FROM meta WHERE key IN ('schema_version', "
                                               "'installation_id')")}
        if "schema_version" not in have:
            self._db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                             (str(SCHEMA_VERSION),))
        # this installation's id: random, created once per ledger (BROKER_HOME); tagged on every created resource
        # beside the run id so orphan handling never touches another installation's resources
        if "installation_id" not in have:
            self._db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('installation_id', ?)",
                             ("bi" + uuid.uuid4().hex[:10],))
        # writes an earlier process could not make (the ledger was locked or its disk full) are recorded now
        from broker.money.journal import journal_exists, replay

        if journal_exists(self.path.parent):
            replay(self)

    def _migrate(self) -> None:
        """Add the columns of :data:`_MIGRATIONS` a ledger written by an older broker lacks (in one transaction,
        so two processes opening an old file at once add each column once), and record the schema version."""
        def missing() -> list[tuple[str, str, str]]:
            have = {t: {r[1] for r in self._db.execute(f"PRAGMA table_info({t})")} for t in {m[0] for m in _MIGRATIONS}}
            return [m for m in _MIGRATIONS if m[1] not in have[m[0]]]

        row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        try:
            older = row is not None and int(row[0]) < SCHEMA_VERSION
        except ValueError:
            older = True
        if not missing() and not older:  # a table the schema script made (IF NOT EXISTS) still needs the version
            return
        with self._tx():
            for table, col, decl in missing():  # read again inside the lock: another process may have added them
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {decl}")
            self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
                             (str(SCHEMA_VERSION),))

    @property
    def schema_version(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0])

    # ------------------------------------------------------------------------------------------- attempts
    def start_attempt(self, run_id: str, actor: str = "cli") -> int:
        """Open the next attempt of ``run_id`` (1 for the first); returns its number."""
        with self._tx():
            (n,) = self._db.execute("SELECT COALESCE(MAX(attempt), 0) + 1 FROM attempts WHERE run_id=?",
                                    (run_id,)).fetchone()
            self._db.execute("INSERT INTO attempts (run_id, attempt, started_at) VALUES (?, ?, ?)",
                             (run_id, n, utcnow().isoformat()))
            self._event(run_id, None, actor, "attempt", f"attempt {n} started")
        return int(n)

    def end_attempt(self, run_id: str, attempt: int, *, cause: str, detail: str | None = None,
                    actor: str = "cli") -> list[str]:
        """Close attempt ``attempt`` of ``run_id`` with ``cause`` (``preempted``, ``succeeded``, ``failed``,
        ``interrupted``, ``error`` ...) and ``detail`` (the why, in words); the run's resources not claimed by an
        earlier attempt become this attempt's (their ids are stored: ``broker cost`` splits by them).  Closing
        an attempt twice keeps the first end.  Returns the resource ids."""
        with self._tx():
            taken: set[str] = set()
            for (ids,) in self._db.execute("SELECT resource_ids FROM attempts WHERE run_id=? AND attempt<>?",
                                           (run_id, attempt)):
                taken.update(json.loads(ids or "[]"))
            mine = [r for (r,) in self._db.execute("SELECT id FROM resources WHERE run_id=? ORDER BY created_at",
                                                    (run_id,)) if r not in taken]
            cur = self._db.execute("UPDATE attempts SET ended_at=?, cause=?, detail=?, resource_ids=? WHERE "
                                   "run_id=? AND attempt=? AND ended_at IS NULL",
                                   (utcnow().isoformat(), cause, detail, json.dumps(mine), run_id, attempt))
            if cur.rowcount:
                self._event(run_id, None, actor, f"attempt-{cause}",
                            f"attempt {attempt} ended: {cause}" + (f": {detail}" if detail else ""))
        return mine

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        """The attempts of ``run_id`` in order: dicts with ``attempt``, ``started_at`` / ``ended_at`` (datetimes;
        ended None while it runs), ``cause``, ``detail``, ``resource_ids`` (list).  Empty: the run had one
        attempt and kept no record of it (an older broker, or a run without restarts)."""
        out = []
        for r in self._db.execute("SELECT attempt, started_at, ended_at, cause, detail, resource_ids FROM attempts "
                                  "WHERE run_id=? ORDER BY attempt", (run_id,)):
            out.append({"attempt": int(r[0]), "started_at": datetime.fromisoformat(r[1]),
                        "ended_at": datetime.fromisoformat(r[2]) if r[2] else None, "cause": r[3],
                        "detail": r[4], "resource_ids": json.loads(r[5] or "[]")})
        return out

    def runs_with_attempts(self) -> set[str]:
        """The ids of the runs that have attempt rows (one query: ``broker cost`` splits only those)."""
        return {r[0] for r in self._db.execute("SELECT DISTINCT run_id FROM attempts")}

    @property
    def installation_id(self) -> str:
        """This installation's id (``bi`` + 10 hex digits), created once per ledger file."""
        row = self._db.execute("SELECT value FROM meta WHERE key='installation_id'").fetchone()
        return str(row[0])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- runs
    def create_run(self, run: Run) -> Run:
        d = run.model_dump()
        cols = list(d)
        self._db.execute(
            f"INSERT INTO runs ({','.join(cols)}) VALUES ({','.join('?' for _ in cols)})",
            [_enc(c, d[c]) for c in cols],
        )
        return run

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Update columns of a run.

        An end the watchdog enforced wins: when the row's message starts with ``watchdog:`` and its status is an
        end the watchdog records (``deadline`` / ``interrupted``), a later ``failed`` / ``interrupted`` (the CLI
        losing its SSH connections because the watchdog terminated the nodes) or an active status (the CLI going on
        to ``running`` / ``tearing_down``) keeps the watchdog's status and message, with the CLI's message appended.
        """
        if not fields:
            return
        from broker.core.records import Run

        bad = set(fields) - set(Run.model_fields)
        if bad:
            raise KeyError(f"unknown run fields: {sorted(bad)}")
        # an active status too (the CLI's "running" / "tearing_down" after the watchdog ended the run): the end stays
        if fields.get("status") in ("failed", "interrupted", "planned", "provisioning", "running", "tearing_down"):
            cur = self._db.execute("SELECT status, message FROM runs WHERE id = ?", (run_id,)).fetchone()
            if cur is not None and cur["status"] in ("deadline", "interrupted") \
                    and (cur["message"] or "").startswith("watchdog:"):
                fields["status"] = cur["status"]
                later = fields.get("message")
                fields["message"] = cur["message"] + (f" (then the CLI: {later})" if later and later not in
                                                      cur["message"] else "")
                fields.pop("ended_at", None)
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._db.execute(f"UPDATE runs SET {sets} WHERE id = ?", [_enc(k, v) for k, v in fields.items()] + [run_id])

    def get_run(self, run_id: str) -> Run | None:
        row = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            # allow a unique prefix
            rows = self._db.execute("SELECT * FROM runs WHERE id LIKE ?", (run_id + "%",)).fetchall()
            if len(rows) != 1:
                return None
            row = rows[0]
        return self._row("runs", row)

    def _row(self, table: str, row: sqlite3.Row) -> Any:
        """The Run / Resource of ``row``, or None when it does not validate (a damaged or edited ledger): then one
        line naming the row, the field and what to do goes to stderr (once per row) and the id is remembered in
        :attr:`damaged` (so ``find_run`` can say why).  A row is input: it never crashes a command."""
        cls = _records().Run if table == "runs" else _records().Resource
        try:
            return cls(**_dec_row(row, _RUN_JSON if table == "runs" else _RES_JSON))
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            import sys

            msg = damaged_row_message(table, row, e, self.path)
            key = (table, str(dict(row).get("id")))
            self.damaged[key[1]] = msg
            if key not in _REPORTED:
                _REPORTED.add(key)
                sys.stderr.write(f"warning: {msg}\n")
            return None

    def find_run(self, run_id: str) -> Run:
        """The run with this id or unique id prefix, or the newest run for ``latest`` (every RUN argument takes
        it).  Raises BadInput naming the matches when the prefix is ambiguous, or saying where to look when nothing
        matches."""
        run = self.get_run(run_id)
        if run is not None:
            return run
        from broker.core.provider import BadInput

        if run_id == "latest":
            newest = self.list_runs(limit=1)
            if not newest:
                raise BadInput("there are no runs yet",
                               hint="`broker run RECIPE` (or `broker run -d RECIPE`) starts one")
            return newest[0]
        hit = next(((rid, m) for rid, m in self.damaged.items() if rid == run_id or rid.startswith(run_id)), None)
        if hit:
            raise BadInput(hit[1], hint=f"`broker down {hit[0]}` still terminates the live resources recorded for it")

        matches = [r["id"] for r in self._db.execute("SELECT id FROM runs WHERE id LIKE ? ORDER BY created_at",
                                                     (run_id + "%",)).fetchall()]
        if matches:
            raise BadInput(f"{run_id!r} matches {len(matches)} runs ({', '.join(matches[:3])}"
                           f"{', ...' if len(matches) > 3 else ''})", hint="give more of the run id")
        raise BadInput(f"no run {run_id!r} in the ledger", hint="`broker status` lists the runs")

    def list_runs(self, limit: int | None = 20, statuses: Iterable[str] | None = None) -> list[Run]:
        """The newest ``limit`` runs (every run with ``limit=None``: what must see all of them, such as settling
        dead CLIs, passes None; a large number would silently drop the oldest), optionally only ``statuses``."""
        q, args = "SELECT * FROM runs", []
        if statuses:
            st = list(statuses)
            q += f" WHERE status IN ({','.join('?' for _ in st)})"
            args += st
        q += " ORDER BY created_at DESC"
        if limit is not None:
            q += " LIMIT ?"
            args.append(limit)
        return [x for r in self._db.execute(q, args).fetchall() if (x := self._row("runs", r)) is not None]

    def cli_pids(self, statuses: Iterable[str]) -> list[tuple[str, str, int, int | None]]:
        """(run id, status, CLI pid, its start time or None) of every run in ``statuses`` that recorded a pid,
        newest first, no cap: what settling dead CLIs needs, without building a Run per row."""
        st = list(statuses)
        q = (f"SELECT id, status, pid, pid_start FROM runs WHERE pid IS NOT NULL AND status IN "
             f"({','.join('?' for _ in st)}) ORDER BY created_at DESC")
        return [(r[0], r[1], int(r[2]), None if r[3] is None else int(r[3])) for r in self._db.execute(q, st)]

    # ------------------------------------------------------------------------------------------- cost (SQL sums)
    def _cost_filter(self, now: datetime, since: datetime | None, provider: str | None) -> tuple[str, dict]:
        """(WHERE clause over ``runs``, parameters incl. those of ``spent_usd_sql()`` at ``now``)."""
        from broker.money.accounting import _frac_s_sql, _whole_s_sql, now_sql_params

        params: dict[str, Any] = dict(now_sql_params(now))
        where = []
        if since is not None:
            sp = now_sql_params(since)
            params.update(since_s=sp["now_s"], since_frac=sp["now_frac"])
            where.append(f"({_whole_s_sql('runs.created_at')} - :since_s) + "
                         f"({_frac_s_sql('runs.created_at')} - :since_frac) >= 0")
        if provider is not None:
            params["provider"] = provider
            where.append("runs.provider = :provider")
        return (" WHERE " + " AND ".join(where)) if where else "", params

    def run_costs(self, now: datetime, *, since: datetime | None = None, provider: str | None = None,
                  limit: int | None = None, run_id: str | None = None) -> list[dict[str, Any]]:
        """What each run cost until ``now`` (US dollars, the rule of ``broker.money.accounting.resource_cost`` summed in
        SQL over all its resources), newest first: dicts with ``run``, ``name``, ``provider``, ``status``,
        ``created_at`` (ISO text) and ``usd``.  ``since``: runs created at or after it; ``limit``: the newest
        ``limit`` only (None: all); ``run_id``: that run only."""
        from broker.money.accounting import spent_usd_sql

        where, params = self._cost_filter(now, since, provider)
        if run_id is not None:
            params["run_id"] = run_id
            where += (" AND" if where else " WHERE") + " runs.id = :run_id"
        runs = f"SELECT id, name, provider, status, created_at FROM runs{where} ORDER BY created_at DESC"
        if limit is not None:
            runs += " LIMIT :limit"
            params["limit"] = limit
        q = (f"SELECT r.*, (SELECT TOTAL({spent_usd_sql()}) FROM resources WHERE resources.run_id = r.id) "
             f"FROM ({runs}) AS r")
        return [{"run": r[0], "name": r[1], "provider": r[2], "status": r[3], "created_at": r[4], "usd": r[5]}
                for r in self._db.execute(q, params)]

    def cost_totals(self, now: datetime, *, since: datetime | None = None,
                    provider: str | None = None) -> dict[str | None, tuple[int, float]]:
        """Per provider: (number of runs, what they cost until ``now`` in US dollars), summed in SQL over every
        run that matches (no cap), with the filters of :meth:`run_costs`."""
        from broker.money.accounting import spent_usd_sql

        where, params = self._cost_filter(now, since, provider)
        counts = {r[0]: int(r[1]) for r in self._db.execute(
            f"SELECT runs.provider, COUNT(*) FROM runs{where} GROUP BY runs.provider", params)}
        usd = {r[0]: float(r[1]) for r in self._db.execute(
            f"SELECT runs.provider, TOTAL({spent_usd_sql()}) FROM resources JOIN runs ON runs.id = resources.run_id"
            f"{where} GROUP BY runs.provider", params)}
        return {p: (n, usd.get(p, 0.0)) for p, n in counts.items()}

    # ------------------------------------------------------------------------------------------- resources
    def record_intent(self, run_id: str, provider: str, kind: str, name: str, *, region: str | None = None,
                      zone: str | None = None, usd_per_hour: float = 0.0, deadline: datetime | None = None,
                      attrs: dict[str, Any] | None = None, resource_id: str | None = None,
                      actor: str = "cli") -> Resource:
        """Write a resource row in state ``intent`` (call *before* the provider's create call)."""
        from broker.core.records import Resource

        res = Resource(id=resource_id or new_id("r-"), run_id=run_id, provider=provider, kind=kind, name=name,
                       region=region, zone=zone, usd_per_hour=usd_per_hour, deadline=deadline, attrs=attrs or {})
        d = res.model_dump()
        cols = list(d)
        with self._tx():
            self._db.execute(
                f"INSERT INTO resources ({','.join(cols)}) VALUES ({','.join('?' for _ in cols)})",
                [_enc(c, d[c]) for c in cols],
            )
            self._event(run_id, res.id, actor, "intent", f"{provider} {kind} {name} about to be created")
        return res

    def mark_created(self, resource_id: str, provider_id: str, *, state: str = "creating", actor: str = "cli",
                     **attrs: Any) -> None:
        """Record the provider id right after the create call returned."""
        with self._tx():
            row = self._db.execute("SELECT run_id, attrs FROM resources WHERE id = ?", (resource_id,)).fetchone()
            if row is None:
                raise KeyError(resource_id)
            merged = {**(json.loads(row["attrs"]) if row["attrs"] else {}), **attrs}
            self._db.execute("UPDATE resources SET provider_id = ?, state = ?, attrs = ? WHERE id = ?",
                             (provider_id, state, json.dumps(merged, default=str), resource_id))
            self._event(row["run_id"], resource_id, actor, "created", f"provider id {provider_id}")

    def update_resource(self, resource_id: str, *, actor: str | None = None, message: str | None = None,
                        **fields: Any) -> None:
        """Update columns of a resource (``attrs`` is merged, not replaced); logs an event when ``actor`` given."""
        from broker.core.records import Resource

        bad = set(fields) - set(Resource.model_fields)
        if bad:
            raise KeyError(f"unknown resource fields: {sorted(bad)}")
        with self._tx():
            row = self._db.execute("SELECT run_id, attrs, state FROM resources WHERE id = ?",
                                   (resource_id,)).fetchone()
            if row is None:
                raise KeyError(resource_id)
            if "attrs" in fields:
                fields["attrs"] = {**(json.loads(row["attrs"]) if row["attrs"] else {}), **fields["attrs"]}
            if fields.get("state") == "running" and "running_since" not in fields:
                cur = self._db.execute("SELECT running_since FROM resources WHERE id = ?", (resource_id,)).fetchone()
                if not cur["running_since"]:
                    fields["running_since"] = utcnow()
            if fields.get("state") == "terminated" and "terminated_at" not in fields:
                fields["terminated_at"] = utcnow()
            if fields:
                sets = ", ".join(f"{k} = ?" for k in fields)
                self._db.execute(f"UPDATE resources SET {sets} WHERE id = ?",
                                 [_enc(k, v) for k, v in fields.items()] + [resource_id])
            if actor:
                action = fields.get("state", "update")
                self._event(row["run_id"], resource_id, actor, str(action), message)

    def change_rate(self, resource_id: str, state: str, *, at: datetime, actor: str, message: str | None = None,
                    **fields: Any) -> None:
        """Move a resource to ``state`` whose billing rate differs (``stopped`` bills ``stopped_usd_per_hour``,
        ``starting`` / ``running`` ``usd_per_hour`` again): the money billed until ``at`` at the old rate is folded
        into ``banked_usd`` and the new rate counts from ``at`` (``rate_since``), in one transaction.  ``fields``:
        further columns (``stopped_usd_per_hour``, ``deadline``, ``attrs`` merged).  Raises KeyError for an
        unknown resource."""
        from broker.money.accounting import resource_cost

        with self._tx():
            row = self._db.execute("SELECT * FROM resources WHERE id = ?", (resource_id,)).fetchone()
            if row is None:
                raise KeyError(resource_id)
            res = _records().Resource(**_dec_row(row, _RES_JSON))
            banked = resource_cost(res, None, at).spent_usd
            if "attrs" in fields:
                fields["attrs"] = {**res.attrs, **fields["attrs"]}
            fields.update(state=state, banked_usd=banked, rate_since=at)
            if state == "stopped":
                fields.setdefault("stopped_at", at)
            elif state in ("starting", "running"):
                fields["stopped_at"] = None
            sets = ", ".join(f"{k} = ?" for k in fields)
            self._db.execute(f"UPDATE resources SET {sets} WHERE id = ?",
                             [_enc(k, v) for k, v in fields.items()] + [resource_id])
            self._event(row["run_id"], resource_id, actor, state, message)

    def add_charge(self, resource_id: str, usd: float, *, at: datetime, actor: str,
                   message: str | None = None) -> None:
        """A one-off charge of ``usd`` US dollars on a resource (bandwidth billed per GB): the money billed until
        ``at`` plus ``usd`` is folded into ``banked_usd`` and the rate counts on from ``at`` (as :meth:`change_rate`
        does), so every total (spent, worst case, the SQL sums of ``broker cost``) includes it.  Raises KeyError
        for an unknown resource."""
        from broker.money.accounting import resource_cost

        with self._tx():
            row = self._db.execute("SELECT * FROM resources WHERE id = ?", (resource_id,)).fetchone()
            if row is None:
                raise KeyError(resource_id)
            res = _records().Resource(**_dec_row(row, _RES_JSON))
            banked = resource_cost(res, None, at).spent_usd + max(0.0, float(usd))
            self._db.execute("UPDATE resources SET banked_usd = ?, rate_since = ? WHERE id = ?",
                             (banked, _enc("rate_since", at), resource_id))
            self._event(row["run_id"], resource_id, actor, "charge", message)

    def claim_termination(self, resource_id: str, actor: str) -> bool:
        """Atomically move a live resource to ``terminating``; False when it is already terminated.

        Several processes (CLI, watchdog) may try; termination itself is idempotent, so a second claim of a
        ``terminating`` row is allowed (the first may have died), but a ``terminated`` row is never touched.
        """
        with self._tx():
            row = self._db.execute("SELECT run_id, state, provider, kind, provider_id, name FROM resources "
                                   "WHERE id = ?", (resource_id,)).fetchone()
            if row is None or row["state"] == "terminated":
                return False
            self._db.execute("UPDATE resources SET state = 'terminating', terminated_by = ? WHERE id = ?",
                             (actor, resource_id))
            self._event(row["run_id"], resource_id, actor, "terminating",
                        f"deleting {row['provider']} {row['kind']} {row['provider_id'] or row['name'] or resource_id}"
                        f" (was {row['state']})")
        return True

    def resource(self, resource_id: str) -> Resource | None:
        row = self._db.execute("SELECT * FROM resources WHERE id = ?", (resource_id,)).fetchone()
        return self._row("resources", row) if row else None

    def resources(self, run_id: str | None = None, *, live_only: bool = False) -> list[Resource]:
        q, args = "SELECT * FROM resources WHERE 1=1", []
        if run_id:
            q += " AND run_id = ?"
            args.append(run_id)
        if live_only:
            q += " AND state != 'terminated'"
        q += " ORDER BY created_at"
        return [x for r in self._db.execute(q, args).fetchall() if (x := self._row("resources", r)) is not None]

    def resources_of(self, run_ids: Iterable[str]) -> dict[str, list[Resource]]:
        """run id -> its resources (oldest first) for every id of ``run_ids``, in one query (a table of N runs asked
        N times); a run without resources maps to []."""
        ids = list(dict.fromkeys(run_ids))
        out: dict[str, list[Resource]] = {i: [] for i in ids}
        for k in range(0, len(ids), 500):  # SQLite's bound-parameter limit
            chunk = ids[k:k + 500]
            q = f"SELECT * FROM resources WHERE run_id IN ({','.join('?' for _ in chunk)}) ORDER BY created_at"
            for r in self._db.execute(q, chunk).fetchall():
                if (x := self._row("resources", r)) is not None:
                    out[x.run_id].append(x)
        return out

    def find_by_provider_id(self, provider: str, provider_id: str) -> Resource | None:
        row = self._db.execute("SELECT * FROM resources WHERE provider = ? AND provider_id = ?",
                               (provider, provider_id)).fetchone()
        return self._row("resources", row) if row else None

    # ------------------------------------------------------------------------------------------- events
    def event(self, run_id: str | None, actor: str, action: str, message: str | None = None,
              resource_id: str | None = None) -> None:
        """Append to the event log (who did what, when)."""
        self._event(run_id, resource_id, actor, action, message)

    def events(self, run_id: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        q, args = "SELECT * FROM events", []
        if run_id:
            q += " WHERE run_id = ?"
            args.append(run_id)
        q += " ORDER BY seq LIMIT ?"
        args.append(limit)
        return [_dec_row(r, ()) for r in self._db.execute(q, args).fetchall()]

    def _event(self, run_id: str | None, resource_id: str | None, actor: str, action: str,
               message: str | None) -> None:
        self._db.execute("INSERT INTO events (at, run_id, resource_id, actor, action, message) VALUES (?,?,?,?,?,?)",
                         (utcnow().isoformat(), run_id, resource_id, actor, action, message))
        # every ledger write of a billable resource (intent, created, running, terminating, terminated) and run
        # event passes here: `broker -v` shows them as they happen
        _log.info("ledger: run %s%s %s by %s%s", run_id or "-", f" resource {resource_id}" if resource_id else "",
                  action, actor, f": {message}" if message else "")

    # ------------------------------------------------------------------------------------------- quota requests
    def add_quota_request(self, provider: str, limit_name: str, requested_value: float, *, region: str | None = None,
                          scope: str | None = None, unit: str | None = None, provider_request_id: str | None = None,
                          state: str | None = None, reason: str | None = None,
                          detail: dict[str, Any] | None = None) -> str:
        qid = new_id("q-")
        self._db.execute(
            "INSERT INTO quota_requests (id, provider, region, scope, limit_name, requested_value, unit, "
            "provider_request_id, state, reason, created_at, updated_at, detail) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (qid, provider, region, scope, limit_name, requested_value, unit, provider_request_id, state, reason,
             utcnow().isoformat(), utcnow().isoformat(), json.dumps(detail or {}, default=str)),
        )
        return qid

    def update_quota_request(self, qid: str, *, state: str | None = None, detail: dict[str, Any] | None = None,
                             provider_request_id: str | None = None) -> None:
        sets, args = ["updated_at = ?"], [utcnow().isoformat()]
        for col, val in (("state", state), ("provider_request_id", provider_request_id)):
            if val is not None:
                sets.append(f"{col} = ?")
                args.append(val)
        if detail is not None:
            sets.append("detail = ?")
            args.append(json.dumps(detail, default=str))
        self._db.execute(f"UPDATE quota_requests SET {', '.join(sets)} WHERE id = ?", args + [qid])

    def quota_requests(self, provider: str | None = None) -> list[dict[str, Any]]:
        q, args = "SELECT * FROM quota_requests", []
        if provider:
            q += " WHERE provider = ?"
            args.append(provider)
        q += " ORDER BY created_at"
        return [_dec_row(r, ("detail",)) for r in self._db.execute(q, args).fetchall()]

    # ------------------------------------------------------------------------------------------- helpers
    def _tx(self) -> "_Tx":
        return _Tx(self._db)


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT (or ROLLBACK on error): one writer at a time across processes."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.outer = False

    def __enter__(self) -> None:
        # inside an open transaction (a journal replay applies many writes as one): part of it
        self.outer = not self.db.in_transaction
        if self.outer:
            self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self.outer:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
