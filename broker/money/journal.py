"""When the ledger cannot be written: teardown goes on, and what could not be recorded is kept, journalled, retried
and replayed.

A delete never waits for the ledger.  The writes made *after* a provider acted (a resource claimed, created,
running, terminated; a run's status and end; events; attempts) go through :class:`FailSafeLedger`.  When one fails
because the ledger cannot be written (``database is locked`` after a short busy wait, ``database or disk is full``,
a read-only file, an I/O error):

* on a full filesystem the space reserve beside the ledger (``.space-reserve``, made at the start of every run) is
  released first and the write tried again: that is what the reserve is for;
* otherwise the write is kept in memory (in order: a later write of the same process queues behind it, so a newer
  state is never overwritten by an older one), appended to the journal (:data:`JOURNAL_NAME` beside the ledger:
  one JSON line per write, created 0600, ``flock``-ed, fsync-ed) and tried again before each later write of the
  process and once more before it exits (:func:`flush_all`);
* reads see the kept writes (a resource whose ``terminated`` is kept reads terminated in this process);
* the next broker process that opens the ledger and can write it replays the journal (:func:`replay`): every
  entry in one transaction, each entry's id marked in ``meta`` so it is applied once, then the journal is emptied;
* the CLI names every write still not recorded when it exits (:func:`unrecorded_lines`: the resource, its id, its
  $/hour, whether the provider deleted it, the command that ends it) and adds :data:`EXIT_UNRECORDED` to its exit
  code (docs/security.md "When broker's own ledger or disk fails").

Writes made *before* a provider call (``record_intent``, ``create_run``) are never journalled: they raise, and
nothing is created (ledger-first).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import sqlite3
import threading
import uuid
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from broker.core.model import utcnow
from broker.core.prose import usd

if TYPE_CHECKING:
    from broker.money.ledger import Ledger

_log = logging.getLogger(__name__)

#: the journal's file name, beside the ledger
JOURNAL_NAME = "ledger.journal"
#: the space reserve's file name, beside the ledger (made by broker.run.runrecord at the start of a run)
RESERVE_NAME = ".space-reserve"
#: added to a CLI exit code 0..4 when something could not be recorded in the ledger (10: the job succeeded and
#: everything is gone, but the ledger does not say so yet; 11: the job failed; 14: something may still bill)
EXIT_UNRECORDED = 10
#: seconds a fail-safe write waits for another process's lock before it is journalled (broker's own
#: transactions last milliseconds; a longer hold is a stuck or foreign process)
BUSY_S = 5.0
#: seconds a retry of the kept writes waits for the lock
RETRY_BUSY_S = 0.5
#: the ledger writes :class:`FailSafeLedger` keeps when the ledger cannot take them, with what they return then
FAILSAFE_OPS: dict[str, Any] = {"update_resource": None, "claim_termination": True, "mark_created": None,
                                "update_run": None, "event": None, "end_attempt": [], "change_rate": None}
#: ledger writes made before a provider call: never kept (they raise), but the kept writes are tried before them
_FIRST_WRITES = frozenset({"record_intent", "create_run", "start_attempt", "add_quota_request"})
_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def unwritable(e: BaseException) -> str | None:
    """Why the ledger cannot be written, when ``e`` says so (``database is locked``, ``database or disk is full``,
    read-only, I/O error, cannot open); None for any other error (a bug, a constraint: those still raise)."""
    if not isinstance(e, (sqlite3.OperationalError, sqlite3.DatabaseError)) or isinstance(e, sqlite3.IntegrityError):
        return None
    text = str(e)
    for word in ("locked", "busy", "full", "readonly", "read-only", "disk I/O", "unable to open", "malformed"):
        if word in text:
            return text
    return None


def release_reserve(folder: Path) -> bool:
    """Delete the space reserve in ``folder`` (True when there was one): room for the ledger or journal write."""
    try:
        (folder / RESERVE_NAME).unlink()
        return True
    except OSError:
        return False


def _default(v: Any) -> Any:
    if isinstance(v, datetime):
        return {"$dt": v.isoformat()}
    return str(v)


def _hook(d: dict) -> Any:
    if set(d) == {"$dt"}:
        return datetime.fromisoformat(d["$dt"])
    return d


def fallback_path(folder: Path) -> Path:
    """Where the journal goes when the ledger's own filesystem cannot take it either (full after the reserve went,
    read-only): ``/tmp/broker-<uid>/ledger-<hash of the folder>.journal`` (the folder 0700, checked as ours), used
    only when it is another filesystem.  Read back by :func:`replay` like the journal beside the ledger."""
    import hashlib

    from broker.core.private import SHORT_BASE

    tag = hashlib.sha256(str(Path(folder).absolute()).encode()).hexdigest()[:12]
    return SHORT_BASE / f"broker-{os.geteuid()}" / f"ledger-{tag}.journal"


def _fallback_usable(folder: Path) -> Path | None:
    from broker.core.private import check_private_dir, private_dir

    p = fallback_path(folder)
    try:
        check_private_dir(private_dir(p.parent))
        if os.stat(p.parent).st_dev == os.stat(folder).st_dev:
            return None  # the same filesystem: no better off
    except Exception:  # noqa: BLE001 - an unsafe or unmakeable folder is not used
        return None
    return p


class Journal:
    """The append-only journal beside the ledger (``<folder>/ledger.journal``, 0600), and its fallback on another
    filesystem (:func:`fallback_path`)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / JOURNAL_NAME
        #: where the last entry went (the fallback when the folder's filesystem could not take it)
        self.written_to = self.path

    def paths(self) -> list[Path]:
        return [self.path, fallback_path(self.folder)]

    def append(self, entry: dict[str, Any]) -> bool:
        """Append one entry (a JSON line, flock-ed, fsync-ed); on a full filesystem the space reserve is released
        and the append tried again, then the fallback on another filesystem is tried.  False when neither can be
        written (the entry then lives in memory only)."""
        line = (json.dumps(entry, default=_default) + "\n").encode()
        if self._append(self.path, line, self.folder):
            self.written_to = self.path
            return True
        other = _fallback_usable(self.folder)
        if other is not None and self._append(other, line, None):
            self.written_to = other
            return True
        return False

    @staticmethod
    def _append(path: Path, line: bytes, reserve_in: Path | None) -> bool:
        for _ in range(2):
            try:
                fd = os.open(path, _OPEN_FLAGS, 0o600)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT) and reserve_in is not None and release_reserve(reserve_in):
                    continue
                _log.warning("cannot open the ledger journal %s: %s", path, e)
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                try:
                    os.write(fd, line)
                    os.fsync(fd)
                    return True
                except OSError as e:
                    os.ftruncate(fd, size)  # never half a line
                    if e.errno in (errno.ENOSPC, errno.EDQUOT) and reserve_in is not None and \
                            release_reserve(reserve_in):
                        continue
                    _log.warning("cannot write the ledger journal %s: %s", path, e)
                    return False
            finally:
                os.close(fd)
        return False

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """Every well-formed entry of the journal file ``path``, in order (a line that does not parse is skipped and
        logged)."""
        try:
            data = path.read_bytes()
        except OSError:
            return []
        out = []
        for raw in data.splitlines():
            try:
                e = json.loads(raw, object_hook=_hook)
            except ValueError:
                _log.warning("skipping a damaged line of the ledger journal %s", path)
                continue
            if isinstance(e, dict) and e.get("op") in FAILSAFE_OPS and isinstance(e.get("id"), str):
                out.append(e)
        return out


def _apply(ledger: "Ledger", entry: dict[str, Any]) -> None:
    """Apply one entry through the ledger's own method (its field checks hold).  A row that ended stays ended: a
    journalled state older than ``terminated`` is not written over it."""
    op, args, kwargs = entry["op"], list(entry.get("args") or []), dict(entry.get("kwargs") or {})
    if op in ("update_resource", "change_rate") and args:
        cur = ledger.resource(str(args[0]))
        if cur is None:
            return
        if cur.state == "terminated":
            if op == "change_rate" or kwargs.get("state") not in (None, "terminated"):
                return
    if op == "event" and len(args) >= 4:
        args[3] = f"{args[3] or ''} [at {entry.get('at')}, from the journal]".strip()
    getattr(ledger, op)(*args, **kwargs)


def journal_exists(folder: Path) -> bool:
    """Whether a journal (beside the ledger in ``folder``, or its fallback) waits to be replayed."""
    return any(os.path.exists(p) for p in Journal(folder).paths())


def replay(ledger: "Ledger", *, busy_s: float = RETRY_BUSY_S) -> int:
    """Write the journals of ``ledger`` (beside it, and the fallback) into it: every entry not applied before, in one
    transaction per file, then empty the file.  Returns how many entries were applied (0 when there is no journal);
    never raises for a ledger that still cannot be written (the journal stays for the next command)."""
    return sum(_replay_file(ledger, p, busy_s) for p in Journal(ledger.path.parent).paths() if os.path.exists(p))


def _replay_file(ledger: "Ledger", path: Path, busy_s: float) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    db = ledger._db
    applied = 0
    try:
        if os.fstat(fd).st_uid != os.geteuid():  # a journal is input: only one this user wrote
            return 0
        fcntl.flock(fd, fcntl.LOCK_EX)
        entries = Journal.read(path)
        if not entries:
            os.ftruncate(fd, 0)
            return 0
        with _busy(ledger, busy_s):
            done = {r[0][len("journal:"):] for r in db.execute("SELECT key FROM meta WHERE key LIKE 'journal:%'")}
            todo = [e for e in entries if e["id"] not in done]
            with ledger._tx():
                for e in todo:
                    try:
                        _apply(ledger, e)
                    except (KeyError, TypeError, ValueError) as err:  # a row gone, a damaged entry: skip it
                        _log.warning("journal entry %s not applied: %s", e.get("id"), err)
                    db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (f"journal:{e['id']}", "1"))
                if todo:
                    why = sorted({str(e.get("why")) for e in todo if e.get("why")})
                    ledger.event(None, "journal", "journal-replay",
                                 f"{len(todo)} write(s) made between {todo[0].get('at')} and {todo[-1].get('at')} "
                                 f"while the ledger could not be written ({'; '.join(why)[:300]}) recorded now "
                                 f"from {path}")
            applied = len(todo)
        os.ftruncate(fd, 0)
        try:
            with _busy(ledger, busy_s), ledger._tx():
                db.execute("DELETE FROM meta WHERE key LIKE 'journal:%'")
        except sqlite3.Error:
            pass  # the marks only keep entries from being applied twice; stale ones are harmless
        if applied:
            _log.info("replayed %d journalled ledger write(s) from %s", applied, path)
        return applied
    except sqlite3.Error as e:
        if unwritable(e) is None:
            raise
        _log.info("the ledger journal %s waits: %s", path, e)
        if path not in _TOLD:  # once per process, like a damaged row: the user sees why the ledger lags
            _TOLD.add(path)
            import sys

            try:
                sys.stderr.write(f"warning: {len(Journal.read(path))} ledger write(s) an earlier broker command "
                                 f"could not make wait in {path}: the ledger cannot be written now ({e}); the next "
                                 "command that can write it records them\n")
            except (OSError, ValueError):
                pass
        return 0
    finally:
        os.close(fd)


#: journals already named on stderr in this process
_TOLD: set[Path] = set()


class _busy:
    """The ledger connection's busy timeout set to ``seconds`` for a block, then back to the ledger's own."""

    def __init__(self, ledger: "Ledger", seconds: float):
        self.db, self.ms = ledger._db, int(seconds * 1000)

    def __enter__(self) -> None:
        self.db.execute(f"PRAGMA busy_timeout={self.ms}")

    def __exit__(self, *exc: object) -> None:
        try:
            self.db.execute("PRAGMA busy_timeout=30000")
        except sqlite3.Error:
            pass


#: every FailSafeLedger of this process (what the CLI names at exit)
_ALL: "list[FailSafeLedger]" = []
_ALL_LOCK = threading.Lock()


class FailSafeLedger:
    """A :class:`~broker.money.ledger.Ledger` whose after-the-fact writes (:data:`FAILSAFE_OPS`) never raise because
    the ledger cannot be written: they are kept, journalled and retried (module docstring).  Everything else
    (reads, ``record_intent``, ``create_run``) goes to the ledger unchanged.  ``say``: one line when a write is first
    kept, and when the space reserve is released."""

    def __init__(self, ledger: "Ledger", say: Callable[[str], None] | None = None):
        self._ledger = ledger
        self.say = say
        self.pending: list[dict[str, Any]] = []
        #: entries that could not be journalled either (memory only)
        self.unjournalled: set[str] = set()
        self.journal = Journal(ledger.path.parent)
        self._lock = threading.RLock()
        self._note: str | None = None  # the full filesystem, for the next run message written
        with _ALL_LOCK:
            _ALL[:] = [f for f in _ALL if f.pending]  # only those with something to name at exit stay
            _ALL.append(self)

    def __getattr__(self, name: str) -> Any:
        if name in FAILSAFE_OPS:
            return lambda *a, **kw: self._write(name, a, kw)
        if name in _FIRST_WRITES:
            def first(*a: Any, **kw: Any) -> Any:
                # the kept writes go first (an attempt's end before the next attempt's rows); this one raises when
                # the ledger cannot take it: nothing is created unrecorded
                with self._lock:
                    self.retry()
                    return getattr(self._ledger, name)(*a, **kw)
            return first
        return getattr(self._ledger, name)

    @property
    def raw(self) -> "Ledger":
        return self._ledger

    # ------------------------------------------------------------------------------------------- writes
    def _prepare(self, op: str, args: tuple, kwargs: dict[str, Any]) -> None:
        """Fill in the times the ledger would take from its clock at write time: a replay later must record when
        it happened, not when it was replayed."""
        now = utcnow()
        if op == "update_resource" and kwargs.get("state") == "terminated":
            kwargs.setdefault("terminated_at", now)
        if op == "update_resource" and kwargs.get("state") == "running" and "running_since" not in kwargs and args:
            cur = self._read_resource(str(args[0]))
            if cur is not None and cur.running_since is None:
                kwargs["running_since"] = now
        if op == "update_run" and self._note and kwargs.get("message") and self._note not in kwargs["message"]:
            kwargs["message"] = f"{kwargs['message']}; {self._note}"
            self._note = None

    def _write(self, op: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        with self._lock:
            self._prepare(op, args, kwargs)
            if self.pending:
                self.retry()
            if not self.pending:
                why = None
                for _ in range(2):
                    try:
                        with _busy(self._ledger, BUSY_S):
                            return getattr(self._ledger, op)(*args, **kwargs)
                    except sqlite3.Error as e:
                        why = unwritable(e)
                        if why is None:
                            raise
                        if "full" not in why or not release_reserve(self._ledger.path.parent):
                            break
                        self._note = (f"the filesystem holding {self._ledger.path.parent} is full; freed broker's "
                                      "space reserve to record the run: free space before the next run")
                        self._tell(self._note)
                        self._prepare(op, args, kwargs)
            else:
                why = self.pending[-1].get("why")
            entry = {"id": uuid.uuid4().hex, "at": utcnow().isoformat(), "pid": os.getpid(), "op": op,
                     "args": list(args), "kwargs": kwargs, "why": why}
            first = not self.pending
            self.pending.append(entry)
            if not self.journal.append(entry):
                self.unjournalled.add(entry["id"])
            if first:
                self._tell(f"the ledger ({self._ledger.path}) cannot be written ({why}): broker goes on (a delete "
                           f"never waits for it); what it cannot record is kept in {self.journal.written_to} and "
                           "written by the next broker command")
            return FAILSAFE_OPS[op]

    def retry(self, busy_s: float = RETRY_BUSY_S) -> bool:
        """Write the kept entries into the ledger (in one transaction, marked applied so the journal's replay skips
        them); True when nothing is kept any more."""
        with self._lock:
            if not self.pending:
                return True
            db = self._ledger._db
            try:
                with _busy(self._ledger, busy_s), self._ledger._tx():
                    for e in self.pending:
                        try:
                            _apply(self._ledger, e)
                        except (KeyError, TypeError, ValueError) as err:
                            _log.warning("kept ledger write %s not applied: %s", e["op"], err)
                        db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                                   (f"journal:{e['id']}", "1"))
            except sqlite3.Error as e:
                if unwritable(e) is None:
                    raise
                if "full" in str(e) and release_reserve(self._ledger.path.parent):
                    return self.retry(busy_s)
                return False
            self.pending.clear()
            self.unjournalled.clear()
            replay(self._ledger, busy_s=busy_s)  # empties the journal (the entries are marked applied)
            return True

    def _tell(self, msg: str) -> None:
        _log.info("%s", msg)
        if self.say:
            try:
                self.say(msg)
            except Exception:  # noqa: BLE001 - a closed terminal must not stop a teardown
                pass

    # ------------------------------------------------------------------------------------------- reads
    def _overlay(self, kind: str, key: str, obj: Any) -> Any:
        """``obj`` (a Resource or Run) with the kept writes for ``key`` applied."""
        if obj is None:
            return None
        upd: dict[str, Any] = {}
        attrs = dict(getattr(obj, "attrs", None) or {}) if kind == "resources" else {}
        for e in self.pending:
            args, kw = e.get("args") or [], e.get("kwargs") or {}
            if not args or str(args[0]) != key:
                continue
            if kind == "resources":
                if e["op"] in ("update_resource", "change_rate"):
                    upd.update({k: v for k, v in kw.items() if k not in ("attrs", "actor", "message", "at")})
                    attrs.update(kw.get("attrs") or {})
                    if e["op"] == "change_rate" and len(args) > 1:
                        upd["state"] = args[1]
                elif e["op"] == "claim_termination":
                    upd["state"] = "terminating"
                elif e["op"] == "mark_created" and len(args) > 1:
                    upd.update(provider_id=args[1], state=kw.get("state", "creating"))
                    attrs.update({k: v for k, v in kw.items() if k not in ("state", "actor")})
                if attrs != (getattr(obj, "attrs", None) or {}):
                    upd["attrs"] = attrs
            elif kind == "runs" and e["op"] == "update_run":
                upd.update(kw)
        if not upd:
            return obj
        fields = set(type(obj).model_fields)
        return obj.model_copy(update={k: v for k, v in upd.items() if k in fields})

    def _read_resource(self, rid: str) -> Any:
        return self._overlay("resources", rid, self._ledger.resource(rid))

    def resource(self, resource_id: str) -> Any:
        return self._read_resource(resource_id)

    def resources(self, run_id: str | None = None, *, live_only: bool = False) -> list[Any]:
        rows = [self._overlay("resources", r.id, r) for r in self._ledger.resources(run_id, live_only=live_only)]
        return [r for r in rows if not live_only or r.state != "terminated"]

    def get_run(self, run_id: str) -> Any:
        run = self._ledger.get_run(run_id)
        return self._overlay("runs", run.id, run) if run is not None else None

    def find_run(self, run_id: str) -> Any:
        run = self._ledger.find_run(run_id)
        return self._overlay("runs", run.id, run)

    # ------------------------------------------------------------------------------------------- the report
    def unrecorded(self) -> list[dict[str, Any]]:
        """One dict per resource (or run) with kept writes: ``what`` (provider kind id), ``usd_per_hour``, ``gone``
        (the kept state is terminated), ``command`` (what ends it), ``run_id``, ``journalled``."""
        out: dict[str, dict[str, Any]] = {}
        for e in self.pending:
            args = e.get("args") or []
            if not args:
                continue
            if e["op"] in ("update_resource", "claim_termination", "mark_created", "change_rate"):
                res = self._read_resource(str(args[0]))
                if res is None:
                    continue
                out[res.id] = {"what": f"{res.provider} {res.kind} {res.provider_id or res.name}",
                               "usd_per_hour": float(res.usd_per_hour or 0.0), "gone": res.state == "terminated",
                               "command": f"broker down {res.run_id}", "run_id": res.run_id,
                               "journalled": e["id"] not in self.unjournalled}
            elif e["op"] in ("update_run", "end_attempt", "event") and args[0]:
                rid = str(args[0])
                out.setdefault(f"run:{rid}", {"what": f"run {rid}", "usd_per_hour": 0.0, "gone": True,
                                              "command": "broker status", "run_id": rid,
                                              "journalled": e["id"] not in self.unjournalled})
        return list(out.values())


def failsafe(ledger: Any, say: Callable[[str], None] | None = None) -> FailSafeLedger:
    """``ledger`` as a :class:`FailSafeLedger` (itself when it is one already; ``say`` set when it has none)."""
    if isinstance(ledger, FailSafeLedger):
        if say is not None and ledger.say is None:
            ledger.say = say
        return ledger
    return FailSafeLedger(ledger, say)


def flush_all(busy_s: float = RETRY_BUSY_S) -> None:
    """One more try to write every kept entry of this process (the CLI calls it before it exits)."""
    with _ALL_LOCK:
        todo = list(_ALL)
    for f in todo:
        try:
            f.retry(busy_s)
        except Exception as e:  # noqa: BLE001 - the journal still holds them
            _log.info("retry of kept ledger writes failed: %s", e)


def unrecorded_lines() -> list[str]:
    """The sentences naming each resource (and run) whose writes this process could not record, after one last
    retry; empty when everything reached the ledger."""
    flush_all()
    with _ALL_LOCK:
        todo = list(_ALL)
    lines: list[str] = []
    seen: set[str] = set()
    for f in todo:
        items = f.unrecorded()
        if not items:
            continue
        where = (f"kept in {f.journal.written_to}; the next broker command that can write the ledger records it"
                 if all(i["journalled"] for i in items) else
                 f"NOT journalled either ({f.journal.path} could not be written): the ledger will not know")
        for i in items:
            if i["what"] in seen:
                continue
            seen.add(i["what"])
            if i["what"].startswith("run "):
                lines.append(f"{i['what']}: its end could not be recorded in the ledger; {where}")
            elif i["gone"]:
                lines.append(f"{i['what']} ({usd(i['usd_per_hour'], up_to=4)}/h) was deleted at the provider but the "
                             f"ledger still shows it live; {where} (or `{i['command']}` confirms it)")
            else:
                lines.append(f"{i['what']} may still bill {usd(i['usd_per_hour'], up_to=4)}/h and the ledger could not "
                             f"record its state; end it with `{i['command']}`; {where}")
    return lines


def exit_code(code: int, unrecorded: bool) -> int:
    """The CLI's exit code when ``unrecorded``: codes 0..4 (docs/design.md) get :data:`EXIT_UNRECORDED` added (10:
    the job succeeded; 11: it failed; 14: something stayed live); others (interrupted 130 / 143 / 129) stay."""
    return code + EXIT_UNRECORDED if unrecorded and 0 <= code <= 4 else code


def pending_anywhere() -> bool:
    with _ALL_LOCK:
        return any(f.pending for f in _ALL)
