"""The watchdog: enforces deadlines and budgets from the ledger alone, even when the CLI that started a run died.

Each pass (:meth:`Watchdog.run_once`) reads the ledger and terminates, through
:func:`broker.money.teardown.terminate_resource` (actor ``"watchdog"``), every live resource

(a) whose deadline (its own, else its run's) has passed;
(b) whose run's spent-so-far (hourly x elapsed since creation, storage included when recorded; see
    :mod:`broker.money.accounting`) reaches the run's ``budget_usd`` - or would reach it before the next pass;
(c) whose run has ended (succeeded / failed / interrupted / deadline / torn_down) while the resource is still live
    ``ended_grace_s`` (default 120 s) after the end: the CLI's teardown did not complete.  A resource with
    ``attrs["idle_minutes"]`` (or recipe ``idle_minutes`` in the run's recipe: the cluster is kept for the user after
    the job) waits that
    many minutes instead.  The watchdog cannot see SSH sessions on the node, so this is an upper bound; the
    session-aware idle stop runs on the node (:func:`idle_watch_script`);
(d) whose run is still marked active but whose driving CLI process (``Run.pid``) is dead on this machine: a run
    whose CLI died cannot use its machines any more (nobody streams logs, runs the next step or tears down), so
    the run is marked ``interrupted`` at once (event ``cli-dead``) and rule (c) terminates its resources after
    the same grace (``ended_grace_s``), or earlier when the deadline or the budget says so.  The grace covers a
    misjudged pid (e.g. a ledger shared with another machine) at the price of at most two minutes of billing.

Stopped machines (``broker stop`` / ``broker start``): a resource the user stopped (``stopping`` / ``stopped`` /
``starting``) or started again (``attrs["restarted_at"]``) is held on purpose, so rule (c) leaves it; rules (a)
and (b) hold as ever: ``broker stop`` gives the stopped disk its own deadline (``--hours``, default 24 h) and
``broker start`` the running machine another (``--hours``), both on the resource row, and the budget counts the
disk rate while stopped.  The watchdog deletes a stopped machine at its deadline like any other.

Orphans: every ``orphan_scan_s`` (default 60 s; always on the first pass) the providers that hold resources in the
ledger, or are configured, are asked for what carries broker's run tag (``list_tagged``).  Tagged objects of *this*
installation (INSTALL_TAG = :attr:`broker.money.ledger.Ledger.installation_id`) the ledger does not know (and that are
not the pending create of an ``intent`` / ``unknown`` row) are recorded on first sight as ledger rows in state
``orphan`` (``attrs["orphan_first_seen"]``) and terminated once seen for longer than ``orphan_grace_s`` (default
600 s).  Another installation's objects (another id, or none) are never recorded or touched: they are logged once
as "other installation" (``broker reconcile --include-foreign`` is the only way to touch them).  A list that
raises is an error of that provider (logged, in the heartbeat), never "nothing there".

Unknown creates: a row left ``unknown`` by an ambiguous create (:mod:`broker.money.provision`) is resolved on every pass
through :func:`broker.money.teardown.terminate_resource` (a list finds it -> terminated; proves it absent -> marked
never created); until then each pass reports it as ``possibly-billing``.

Runs: before terminating for a deadline or a budget, the watchdog records that reason on the run (status
``deadline`` / ``interrupted``, message ``watchdog: ...``); the ledger keeps it when the dying CLI later reports a
mere ``failed`` (e.g. "ssh connection lost").

Every action goes to the ledger's event log with actor ``"watchdog"`` and the reason.  Provider errors never stop
the loop: they are logged (once per distinct message), kept on the resource row (loud in ``broker status``) and
retried with backoff on later passes.

One instance at a time: ``<broker home>/watchdog.lock`` is held with ``fcntl.flock`` (non-blocking) and names the
holder's pid; a second watchdog raises :class:`WatchdogBusy` (the CLI prints who holds the lock and exits 0, so
cron and systemd do not count it as a failure).  A heartbeat (``<home>/watchdog.json``: pid, start, last pass,
interval, provider errors) is rewritten after every pass; ``broker status`` reads it for the "watchdog" layer.

Restart safety: the watchdog keeps no state that matters outside the ledger.  Killed and restarted, it reads the
ledger again: ``terminated`` rows are never touched; a row left ``terminating`` by a killed process is first
described and, when the provider says it is gone, only marked ``terminated`` (no second terminate call); while
the provider says ``terminating`` it is described again on the next pass, not terminated again.  A terminate not
confirmed within ``confirm_timeout_s`` (30 s) is confirmed that way on later passes, so one slow cloud does not
hold up the others.

Limits: the CLI check reads ``Run.pid`` on *this* machine (a ledger shared with another machine, or a reused pid,
misjudges it: the grace above and the deadline bound the cost).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any, Callable

from broker.money.accounting import (ACTIVE_STATUSES, ENDED_STATUSES, Clock, effective_deadline, heartbeat_path,
                               cli_alive, home_installation_id, run_cost, system_clock, watchdog_state)
from broker.money.ledger import Ledger
from broker.core.prose import usd
from broker.core.records import Resource, Run
from broker.core.provider import Provider
from broker.money.teardown import kind_rank, teardown_order, terminate_resource


class WatchdogBusy(Exception):
    """Another watchdog holds the lock.  ``pid`` is the holder's (None when it could not be read)."""

    def __init__(self, pid: int | None, path: Path):
        self.pid = pid
        self.path = path
        who = f"pid {pid}" if pid else "another process"
        super().__init__(f"another watchdog ({who}) is already running: it holds {path}; this one exits")


@dataclass
class Action:
    """One thing a pass did: ``kind`` is terminate | orphan-found | cli-dead | error."""

    kind: str
    run_id: str | None
    resource_id: str | None
    reason: str
    ok: bool = True
    provider: str | None = None
    provider_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lock_path(home: Path | None = None, scope: str | None = None) -> Path:
    if home is None:
        from broker.core.config import broker_home

        home = broker_home()
    return Path(home) / (f"watchdog-{scope}.lock" if scope else "watchdog.lock")


def _lock_holder(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text() or "{}").get("pid") or 0) or None
    except (OSError, ValueError, AttributeError):
        return None


def _lock_held(path: Path) -> bool:
    """Whether a live process holds the flock on ``path`` now (the kernel's answer, not a pid in the file)."""
    if not path.exists():
        return False
    try:
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


class WatchdogLock:
    """The exclusive, non-blocking ``flock`` on ``<home>/watchdog.lock`` (released by the kernel when the holder
    dies, also on SIGKILL).  Raises :class:`WatchdogBusy` when held elsewhere."""

    def __init__(self, home: Path | None = None, scope: str | None = None):
        self.path = lock_path(home, scope)
        self._f: IO[str] | None = None

    def acquire(self) -> "WatchdogLock":
        from broker.core.private import private_dir, private_opener

        private_dir(self.path.parent)
        f = open(self.path, "a+", opener=private_opener)  # 0600 from creation
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise WatchdogBusy(_lock_holder(self.path), self.path) from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid()}))
        f.flush()
        self._f = f
        return self

    def release(self) -> None:
        if self._f is not None:
            self._f.close()  # closing the descriptor drops the flock
            self._f = None

    def __enter__(self) -> "WatchdogLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.0f} min"


class Watchdog:
    """Deadline, budget, ended-run and orphan enforcement over the ledger.

    ``providers``: adapters by name (tests); by default they are created on demand with
    ``providers.get_provider``.  ``clock``: a :data:`broker.money.accounting.Clock` (tests drive long cases with a fake
    one).  Times in seconds.
    """

    def __init__(self, ledger: Ledger, providers: dict[str, Provider] | None = None, clock: Clock | None = None,
                 interval_s: float = 5.0, orphan_grace_s: float = 600.0, actor: str = "watchdog", *,
                 ended_grace_s: float = 120.0, orphan_scan_s: float = 60.0, confirm_timeout_s: float = 30.0,
                 home: Path | None = None, say: Callable[[str], None] | None = None, scope: str | None = None):
        from broker.core import provider_env
        from broker.money.journal import failsafe

        # a ledger it cannot write (locked by another process, a full disk) never stops a delete: what cannot be
        # recorded is kept, journalled and retried on every pass (broker.money.journal)
        self.ledger = failsafe(ledger, say)
        # the provider environment this process was started with; a run made with another is served with its own
        # recorded settings (provider_env.applied), or, when its secrets were only in its CLI's environment, left
        # to the watchdog its CLI starts for it (``scope``: that environment's fingerprint; it serves only those)
        self.own_env = provider_env.capture(home=home)
        self.own_fp = provider_env.fingerprint(self.own_env)
        self.scope = scope
        self.unserved: dict[str, str] = {}  # run id -> why this watchdog cannot act for it
        self._env_key: str | None = None
        self._given = dict(providers) if providers is not None else None
        self._cache: dict[str, Provider] = dict(providers or {})
        self.clock: Clock = clock or system_clock
        self.interval_s = float(interval_s)
        self.orphan_grace_s = float(orphan_grace_s)
        self.actor = actor
        self.ended_grace_s = float(ended_grace_s)
        self.orphan_scan_s = float(orphan_scan_s)
        self.confirm_timeout_s = float(confirm_timeout_s)
        self.home = home
        self.say = say
        self.errors: dict[str, str] = {}  # provider -> last orphan-scan error (heartbeat, status)
        self._last_scan: datetime | None = None
        self._retry: dict[str, tuple[datetime, int]] = {}  # resource id -> (next try, failures)
        self._told: set[str] = set()  # foreign provider ids / unknown rows already logged
        self.started_at = system_clock()
        self.passes = 0
        self._stop = False

    # ------------------------------------------------------------------------------------------- providers
    def _provider(self, name: str) -> Provider:
        if self._given is not None:
            return self._cache[name]
        key: Any = name if self._env_key is None else (name, self._env_key)  # one adapter per environment
        if key not in self._cache:
            from broker.providers import get_provider

            self._cache[key] = get_provider(name)
        return self._cache[key]

    def _serving(self, run_id: str) -> Any:
        """A context for handling ``run_id``: None when this watchdog cannot act for the run (recorded in
        :attr:`unserved`, said once), else a context manager that applies the run's provider settings when they
        differ from this process's."""
        import contextlib

        from broker.core import provider_env

        env = None
        run = self._get_run(run_id)
        if run is not None and self._given is None:
            try:
                from broker.core.runfolder import confined_run_dir

                env = provider_env.read(confined_run_dir(run))
            except Exception:  # noqa: BLE001 - a damaged row or folder: served as before
                env = None
        fp = provider_env.fingerprint(env) if env is not None else None
        if self.scope is not None:  # the watchdog of one environment: only the runs made with it
            return contextlib.nullcontext() if fp == self.own_fp else None
        if env is None or fp == self.own_fp:
            return contextlib.nullcontext()
        if not provider_env.servable(env, self.own_env):
            why = (f"its provider credentials ({', '.join(env['secrets'])}) were in its CLI's environment only and "
                   "differ from this watchdog's: the watchdog its CLI started for it acts for it")
            if self.unserved.get(run_id) != why:
                self.unserved[run_id] = why
                self._log(run_id, "not-served", why)
            return None
        self.unserved.pop(run_id, None)

        @contextlib.contextmanager
        def _applied() -> Any:
            self._env_key = fp
            try:
                with provider_env.applied(env):
                    yield
            finally:
                self._env_key = None
        return _applied()

    def _scan_providers(self) -> list[str]:
        """Providers to ask for tagged resources: the given ones, else those holding a live row of the ledger plus
        configured clouds.  An optional backend (slurm, netns) whose rows all ended is not asked: on a machine
        with its commands but no cluster it would only fail (``squeue: fatal: ...``) on every pass."""
        if self._given is not None:
            return list(self._given)
        names = {r.provider for r in self.ledger.resources(live_only=True)} - {"local"}
        from broker.providers import CLOUD

        for name in CLOUD:
            if name in names:
                continue
            try:
                if self._provider(name).check().configured:
                    names.add(name)
            except Exception:  # SDK missing, adapter absent: not configured
                continue
        return sorted(names)

    # ------------------------------------------------------------------------------------------- logging
    def _log(self, run_id: str | None, action: str, message: str, resource_id: str | None = None) -> None:
        self.ledger.event(run_id, self.actor, action, message, resource_id=resource_id)
        if self.say:
            self.say(f"{action}: {message}" + (f" [{run_id}]" if run_id else ""))

    # ------------------------------------------------------------------------------------------- one pass
    def run_once(self) -> list[Action]:
        """One pass over the ledger; returns what it did.  Never raises for provider failures."""
        now = self.clock()
        actions: list[Action] = []
        self.ledger.retry()  # writes an earlier pass could not make
        actions += self._check_clis(now)
        if self._last_scan is None or (now - self._last_scan).total_seconds() >= self.orphan_scan_s:
            self._last_scan = now
            try:
                actions += self._scan_orphans(now)
            except sqlite3.Error as e:  # an orphan cannot be recorded now: found again next scan; enforce anyway
                self._last_scan = None
                actions.append(Action("error", None, None, f"orphan scan not recorded: {e}", ok=False))
        live = self.ledger.resources(live_only=True)
        by_run: dict[str, list[Resource]] = {}
        for res in live:
            by_run.setdefault(res.run_id, []).append(res)
        for run_id, rows in by_run.items():
            try:
                serving = self._serving(run_id)
                if serving is None:
                    continue
                with serving:
                    actions += self._enforce_run(run_id, rows, now)
            except Exception as e:  # the ledger or a bug: keep the loop alive, say so loudly
                self._log(run_id, "error", f"pass failed for this run: {type(e).__name__}: {e}")
                actions.append(Action("error", run_id, None, f"{type(e).__name__}: {e}", ok=False))
        for res in self.ledger.resources(live_only=True):
            if res.state != "unknown":
                continue
            msg = (f"possibly billing: {res.provider} {res.kind} {res.name}: an ambiguous create not resolved yet "
                   f"({res.error or 'no list could tell'}); counted at {usd(res.usd_per_hour, up_to=4)}/h until "
                   "resolved")
            if res.id not in self._told:
                self._told.add(res.id)
                self._log(res.run_id, "possibly-billing", msg, resource_id=res.id)
            actions.append(Action("possibly-billing", res.run_id, res.id, msg, ok=False, provider=res.provider))
        self.passes += 1
        return actions

    def _get_run(self, run_id: str) -> Run | None:
        run = self.ledger.get_run(run_id)
        return run if run is not None and run.id == run_id else None  # get_run also matches prefixes

    def _check_clis(self, now: datetime) -> list[Action]:
        """Rule (d): runs marked active whose CLI process is dead become ``interrupted``."""
        out = []
        for run_id, status, pid, pid_start in self.ledger.cli_pids(ACTIVE_STATUSES):
            if cli_alive(pid, pid_start):
                continue
            n_live = len(self.ledger.resources(run_id, live_only=True))
            msg = (f"the CLI process (pid {pid}) died while the run was {status}; run marked interrupted"
                   + (f"; its {n_live} live resource(s) are terminated after {_ago(self.ended_grace_s)} grace "
                      f"(or at the deadline / budget, whichever comes first)" if n_live else ""))
            self.ledger.update_run(run_id, status="interrupted", ended_at=now, message=msg)
            self._log(run_id, "cli-dead", msg)
            out.append(Action("cli-dead", run_id, None, msg))
        return out

    def _reason(self, res: Resource, run: Run | None, spent: float | None, hourly: float | None,
                now: datetime) -> tuple[str, str] | None:
        """Why ``res`` must go now: (rule, sentence) with rule deadline | budget | ended | idle | orphan; None =
        keep it."""
        dl = effective_deadline(res, run)
        if dl is not None and now >= dl:
            return "deadline", f"deadline passed {_ago((now - dl).total_seconds())} ago ({dl:%Y-%m-%d %H:%M:%S}Z)"
        if run is not None and run.budget_usd is not None and spent is not None:
            if spent >= run.budget_usd:
                return "budget", f"budget {usd(run.budget_usd)} reached: spent {usd(spent, run.budget_usd)}"
            if hourly and spent + hourly * self.interval_s / 3600.0 >= run.budget_usd:
                return "budget", (f"budget {usd(run.budget_usd)} would be reached before the next pass: spent "
                                  f"{usd(spent, places=4)} at {usd(hourly)}/h")
        if run is not None and run.budget_usd is not None and (res.attrs or {}).get("rate_unknown"):
            # the provider's rate for it cannot be read: the worst case is unbounded, the budget cannot be shown
            # to hold (a rate the provider reports readably again clears this)
            return "budget", (f"the provider reports a rate broker cannot read ({res.attrs['rate_unknown']}): the "
                              f"budget {usd(run.budget_usd)} cannot be shown to hold")
        held = res.state in ("stopping", "stopped", "starting") or bool(res.attrs.get("restarted_at"))
        if run is not None and run.status in ENDED_STATUSES and not held:
            idle_min = res.attrs.get("idle_minutes") or (run.recipe or {}).get("idle_minutes")
            grace = float(idle_min) * 60.0 if idle_min else self.ended_grace_s
            since = (now - run.ended_at).total_seconds() if run.ended_at else float("inf")
            if since >= grace:
                if idle_min:
                    return "idle", f"idle {float(idle_min):g} min after the job ended ({run.status})"
                when = f"{_ago(since)} ago" if since != float("inf") else "earlier"
                return "ended", f"run {run.status} {when} but this resource is still live (teardown did not complete)"
        if res.state == "unknown" or (res.attrs.get("ambiguous_create_at") and not res.provider_id):
            return "unknown", "an ambiguous create: resolving it by run tag (found -> terminate; absent -> never created)"
        if res.state == "orphan":
            seen = res.attrs.get("orphan_first_seen")
            first = datetime.fromisoformat(seen) if seen else res.created_at
            age = (now - first).total_seconds()
            if age >= self.orphan_grace_s:
                return "orphan", (f"orphan: carries run tag {res.attrs.get('tag_run_id')!r} but the ledger did not "
                                  f"know it; first seen {_ago(age)} ago (grace {_ago(self.orphan_grace_s)})")
        return None

    def _enforce_run(self, run_id: str, rows: list[Resource], now: datetime) -> list[Action]:
        run = self._get_run(run_id)
        spent = hourly = None
        if run is not None:
            rc = run_cost(run, self.ledger.resources(run_id), now)
            spent, hourly = rc.spent_usd, rc.usd_per_hour
        todo = {res.id: r for res in rows if (r := self._reason(res, run, spent, hourly, now))}
        if not todo:
            return []
        ending = [r for r in todo.values() if r[0] in ("deadline", "budget")]
        if run is not None and run.status in ACTIVE_STATUSES and ending:
            rule, why = ending[0]
            self.ledger.update_run(run_id, status="deadline" if rule == "deadline" else "interrupted", ended_at=now,
                                   message=f"watchdog: {why}")
        out: list[Action] = []
        targets = teardown_order([r for r in rows if r.id in todo])
        for res in targets:
            if kind_rank(res.kind) > 0:
                # dependency order: a subnet / VCN cannot go while an instance (or a subnet) still sits in it
                if any(r.provider == res.provider and kind_rank(r.kind) < kind_rank(res.kind)
                       for r in self.ledger.resources(run_id, live_only=True)):
                    continue
            nxt = self._retry.get(res.id)
            if nxt and now < nxt[0]:
                continue
            out.append(self._terminate(res, todo[res.id][1], now))
        if out and not self.ledger.resources(run_id, live_only=True):  # the run's machines are gone: so are
            from broker.core.sshconfig import forget_run_hosts            # their Host entries (addresses reused)

            forget_run_hosts(run_id, own=Path(self.home) / "ssh_config" if self.home else None)
        return out

    def _terminate(self, res: Resource, reason: str, now: datetime) -> Action:
        what = f"{res.provider} {res.kind} {res.provider_id or res.name}"
        ok = False
        try:
            p = self._provider(res.provider)
            if res.state == "terminating" and res.provider_id and res.kind == "instance":
                # claimed before (maybe by a watchdog that was killed): confirm first, never terminate twice
                info = p.describe_instance(res.provider_id, region=res.region)
                if info.state == "terminated":
                    self.ledger.update_resource(res.id, state="terminated", error=None, actor=self.actor,
                                                message=f"{what} confirmed gone (terminate requested earlier by "
                                                        f"{res.terminated_by or '?'})")
                    ok = True
                elif info.state == "terminating":  # the provider is on it: look again next pass, no new call
                    self._retry.pop(res.id, None)
                    return Action("terminate", res.run_id, res.id, f"{reason}; terminate in progress "
                                  f"(provider state {info.raw_state or info.state})", ok=False,
                                  provider=res.provider, provider_id=res.provider_id)
            if not ok:
                self._log(res.run_id, "terminate", f"{what}: {reason}", resource_id=res.id)
                ok = terminate_resource(self.ledger, res, self.actor, provider=p,
                                        confirm_timeout_s=self.confirm_timeout_s, retry_s=self.confirm_timeout_s,
                                        poll_s=min(2.0, max(0.2, self.interval_s)))
        except Exception as e:  # unexpected (non-ProviderError) failure: record, keep going
            msg = f"{type(e).__name__}: {e}"
            try:
                self.ledger.update_resource(res.id, error=f"watchdog: {msg}", actor=self.actor,
                                            message=f"terminate failed: {msg}")
            except Exception:
                pass
        if ok:
            self._retry.pop(res.id, None)
        else:
            fails = self._retry.get(res.id, (now, 0))[1] + 1
            delay = min(300.0, self.interval_s * 2 ** min(fails, 8))
            self._retry[res.id] = (now + timedelta(seconds=delay), fails)
            after = self.ledger.resource(res.id)
            self._log(res.run_id, "retry", f"{what} still live ({(after.error if after else None) or 'not confirmed'}"
                      f"); next try in {_ago(delay)}", resource_id=res.id)
        return Action("terminate", res.run_id, res.id, reason, ok=ok, provider=res.provider,
                      provider_id=res.provider_id)

    # ------------------------------------------------------------------------------------------- orphans
    def _pending_create(self, provider: str, tagged: Any) -> bool:
        """An ``intent``/``creating`` row without provider id that this tagged object may be the create of."""
        if not tagged.run_id:
            return False
        for r in self.ledger.resources(tagged.run_id):
            if (r.provider == provider and r.kind == tagged.kind and not r.provider_id
                    and r.state in ("intent", "creating", "terminating", "unknown")
                    and (tagged.name is None or r.name == tagged.name)):
                return True
        return False

    def _scan_orphans(self, now: datetime) -> list[Action]:
        out: list[Action] = []
        for name in self._scan_providers():
            try:
                tagged = self._provider(name).list_tagged(None)
            except Exception as e:
                msg = f"{name}: list_tagged failed: {type(e).__name__}: {e}; orphan scan retried next pass"
                if self.errors.get(name) != msg:
                    self._log(None, "error", msg)
                    out.append(Action("error", None, None, msg, ok=False, provider=name))
                self.errors[name] = msg
                continue
            self.errors.pop(name, None)
            mine = self.ledger.installation_id
            for t in tagged:
                if t.state == "terminated":
                    continue
                known = self.ledger.find_by_provider_id(name, t.provider_id)
                if known is not None:
                    if known.live and t.rate_unreadable and known.kind == "instance":
                        # a rate it cannot read is unknown, never the planned one: recorded and said once
                        from broker.money.cost import note_unknown_rate

                        if (known.attrs or {}).get("rate_unknown") != t.rate_unreadable:
                            _r, line = note_unknown_rate(self._provider(name), self.ledger, known,
                                                         t.rate_unreadable, actor=self.actor)
                            self._log(known.run_id, "rate", line)
                    if known.live and t.usd_per_hour is not None and known.kind == "instance":
                        # the provider's rate, also when the CLI died before it could record it: the budget
                        # rule above then counts what is really billed
                        from broker.money.cost import adopt_reported_rate

                        adopt_reported_rate(self._provider(name), self.ledger, known, t.usd_per_hour,
                                            actor=self.actor)
                    continue
                if self._pending_create(name, t):
                    continue
                if t.installation_id != mine:  # another BROKER_HOME's (or an older broker's): never ours to kill
                    key = f"{name}:{t.provider_id}"
                    if key not in self._told:
                        self._told.add(key)
                        msg = (f"other installation: {name} {t.kind} {t.provider_id} (run {t.run_id}, installation "
                               f"{t.installation_id or 'none'}) is not this installation's ({mine}): left alone")
                        self._log(None, "foreign", msg)
                        out.append(Action("foreign", t.run_id, None, msg, provider=name, provider_id=t.provider_id))
                    continue
                run_id = t.run_id or "unknown"
                res = self.ledger.record_intent(
                    run_id, name, t.kind, t.name or t.provider_id, region=t.region,
                    usd_per_hour=float(t.usd_per_hour or 0.0), actor=self.actor,
                    attrs={"orphan": True, "orphan_first_seen": now.isoformat(), "tag_run_id": t.run_id,
                           **({"rate_unknown": t.rate_unreadable} if t.rate_unreadable else {})})
                msg = (f"orphan: {name} {t.kind} {t.provider_id} carries run tag {t.run_id!r} but the ledger did "
                       f"not know it; recorded, terminated after {_ago(self.orphan_grace_s)} unless claimed")
                self.ledger.update_resource(res.id, provider_id=t.provider_id, state="orphan",
                                            created_at=t.created_at or now, actor=self.actor, message=msg)
                self._log(run_id, "orphan-found", msg, resource_id=res.id)
                out.append(Action("orphan-found", run_id, res.id, msg, provider=name, provider_id=t.provider_id))
        return out

    # ------------------------------------------------------------------------------------------- loop
    def write_heartbeat(self) -> None:
        """Rewrite ``<home>/watchdog.json`` (``watchdog-<scope>.json`` for a scoped one) atomically after a pass:
        this process's identity (pid, start time, name), start, now, interval, provider errors, the installation id
        of the ledger the pass read and which runs it can act for (its secrets' digest, its scope).  Nothing is
        written when the ledger now at the home is not the one this watchdog reads (the home was deleted and made
        again): it would claim to guard a home it does not see; a new run then starts that home's own."""
        from broker.core import procid
        from broker.core.private import write_private

        path = heartbeat_path(self.home, self.scope)
        mine = self.ledger.installation_id
        if home_installation_id(path.parent) != mine:
            if "home" not in self._told:
                self._told.add("home")
                print(f"watchdog: {path.parent / 'ledger.sqlite'} is no longer the ledger this watchdog reads "
                      f"(installation {mine}; the home was deleted or replaced): it guards only what that ledger "
                      "held and no longer reports for this home", file=sys.stderr, flush=True)
            return
        me = procid.record()
        tmp = path.with_name(f".watchdog.{os.getpid()}.tmp")
        write_private(tmp, json.dumps({"pid": os.getpid(), "pid_start": me.start if me else None,
                                       "comm": me.comm if me else None, "installation_id": mine,
                                       "started_at": self.started_at.isoformat(),
                                       "heartbeat_at": system_clock().isoformat(), "interval_s": self.interval_s,
                                       "passes": self.passes, "errors": self.errors,
                                       "secrets_digest": self.own_env["secrets_digest"], "scope": self.scope,
                                       "unserved": self.unserved}))
        os.replace(tmp, path)

    def _beat(self) -> None:
        """:meth:`write_heartbeat`, never fatal: a full or read-only home must not end the watchdog (its deletes
        need no file); the stale heartbeat then shows it as not alive, which is the truth that can be shown."""
        try:
            self.write_heartbeat()
        except OSError as e:
            if "heartbeat" not in self._told:
                self._told.add("heartbeat")
                print(f"watchdog: cannot write its heartbeat ({e}); still enforcing", file=sys.stderr, flush=True)
        else:
            self._told.discard("heartbeat")

    def stop(self, *_: object) -> None:
        self._stop = True

    def _idle(self) -> bool:
        return not self.ledger.resources(live_only=True) and not self.ledger.list_runs(limit=1,
                                                                                      statuses=ACTIVE_STATUSES)

    def run_forever(self, *, exit_when_idle_s: float | None = None,
                    on_actions: Callable[[list[Action]], None] | None = None) -> None:
        """Pass every ``interval_s`` until SIGTERM/SIGINT (or, with ``exit_when_idle_s``, until nothing has been
        live or active for that long).  Hold the lock (:class:`WatchdogLock`) around this."""
        try:
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        except ValueError:  # not the main thread (tests)
            pass
        idle_since: float | None = None  # the heartbeat is written after each completed pass, never before one
        try:
            while not self._stop:
                t0 = time.monotonic()
                try:
                    actions = self.run_once()
                    if on_actions and actions:
                        on_actions(actions)
                except Exception as e:  # e.g. the ledger locked for > 30 s: report and try again
                    print(f"watchdog: pass failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._beat()
                if exit_when_idle_s is not None:
                    if self._idle():
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since >= exit_when_idle_s:
                            break
                    else:
                        idle_since = None
                while not self._stop and time.monotonic() - t0 < self.interval_s:
                    time.sleep(min(0.1, self.interval_s))
        finally:
            try:  # only its own: a watchdog of a deleted home must not remove the new home's watchdog's heartbeat
                hb = heartbeat_path(self.home, self.scope)
                if json.loads(hb.read_text()).get("pid") == os.getpid():
                    hb.unlink()
            except (OSError, ValueError, AttributeError):
                pass


# --------------------------------------------------------------------------------------------------- detached
def start_detached(home: Path | None = None, *, interval_s: float | None = None,
                   exit_when_idle_s: float | None = 900.0, python: str | None = None) -> int | None:
    """Start ``python -m broker watchdog`` detached (new session, stdio to ``<home>/watchdog.log``) unless one is
    running; returns the new pid, or None when a watchdog is already running (fresh heartbeat or live lock
    holder).  It exits on its own after ``exit_when_idle_s`` seconds with nothing live (None = never)."""
    from broker.core.config import broker_home

    home = Path(home) if home else broker_home()
    from broker.core import provider_env

    own = provider_env.capture(home=home)
    scope = None
    state = watchdog_state(home=home)
    if state.alive or _lock_held(lock_path(home)):  # one runs, or is starting (before its first pass)
        if not own["secrets"] or not state.alive or provider_env.servable(own, {"secrets_digest":
                                                                               state.secrets_digest}):
            return None  # it acts for this process's runs (with their recorded settings where they differ)
        # this process's credentials are only in its environment and differ from the running watchdog's: the
        # runs made with them get a watchdog of their own, started with this environment
        scope = provider_env.fingerprint(own)
        if watchdog_state(home=home, scope=scope).alive or _lock_held(lock_path(home, scope)):
            return None
    root = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ, BROKER_HOME=str(home))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [python or sys.executable, "-m", "broker", "watchdog"]
    if interval_s:
        argv += ["--interval", str(interval_s)]
    if exit_when_idle_s is not None:
        argv += ["--exit-when-idle", str(exit_when_idle_s)]
    if scope:
        argv += ["--scope", scope]
    from broker.core.private import private_opener

    log_name = f"watchdog-{scope}.log" if scope else "watchdog.log"
    with open(home / log_name, "ab", opener=private_opener) as log:  # 0600 from creation
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env=env)
    return proc.pid


# node-side scripts live in broker.core.nodescripts (adapters embed them); re-exported for older callers
from broker.core.nodescripts import idle_watch_launcher, idle_watch_script  # noqa: E402,F401
