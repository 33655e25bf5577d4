"""Budget accounting (pure): what each resource and run has cost, what it can cost at worst, and which teardown
layers are armed.

Billing model (conservative, documented): a resource bills ``usd_per_hour`` (US dollars per hour) from its
``created_at`` - the moment broker recorded the intent, i.e. *before* the provider's create call - until its
``terminated_at`` (or now while live), per second.  Real providers start billing a little later (Vast.ai on
container start, OCI/AWS on launch; see docs/reference/cloud-apis.md) and some bill a minimum (AWS/OCI per
second with a 60 s minimum): counting from creation over-estimates by a few seconds to minutes, never under.
Once a resource was created (it has a provider id) at least ``attrs["min_billed_seconds"]`` (e.g. AWS's 60 s)
are charged.  A row that ended without ever getting a provider id (the create failed and a list proved nothing
exists) cost nothing: $0, not the seconds between the intent and the failure.  A live row without provider id
(a create in flight, or ``unknown`` after an ambiguous create) is counted as billing.  Storage counts when it is recorded: inside the instance's ``usd_per_hour`` (provisioning adds the
disk's price there and shows the part in ``attrs["storage_usd_per_hour"]``, which is therefore not added again)
or as its own ledger row (``kind="volume"`` with its ``usd_per_hour``).  The same rule as
``broker.money.cost.spent_usd``.

Stopped machines (``broker stop``): a ``stopped`` row bills ``stopped_usd_per_hour`` (its disk, as the provider
reports it or the adapter documents it) from the moment the stop was *confirmed*; until then (``stopping``) and
from the moment a start is *requested* (``starting``) it bills its full ``usd_per_hour`` again, so a change of
state never lowers the count before the provider has acted.  Each change folds the money so far into
``banked_usd`` and the new rate counts from ``rate_since``: spent = banked + rate x (end - rate_since).

Everything here takes ``now`` explicitly (or a :data:`Clock`) so tests can drive long cases with a fake clock.
Nothing here does I/O except :func:`pid_alive` / :func:`cli_alive` (``/proc`` probes), :func:`watchdog_state`
(reads the watchdog's heartbeat file) and :func:`home_installation_id` (reads the home's ledger, read-only).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from broker.core.model import utcnow
from broker.core.prose import cents_up, usd
from broker.core.provider import NoValidPlan

if TYPE_CHECKING:  # the pydantic records (~100 ms to import): `broker status` on an empty home needs none
    from broker.core.records import Resource, Run

#: A clock: a callable returning the current time as an aware (UTC) datetime.
Clock = Callable[[], datetime]

#: Run statuses in which the CLI is (or should be) driving the run.
ACTIVE_STATUSES = ("planned", "provisioning", "running", "tearing_down")
#: Run statuses after which nothing of the run should still bill.
ENDED_STATUSES = ("succeeded", "failed", "interrupted", "deadline", "torn_down")


def system_clock() -> datetime:
    """The real clock (UTC, aware)."""
    return utcnow()


def _aware(t: datetime | None) -> datetime | None:
    if t is not None and t.tzinfo is None:
        return t.replace(tzinfo=timezone.utc)
    return t


# --------------------------------------------------------------------------------------------------- resources
def hourly_usd(res: Resource) -> float:
    """What ``res`` bills per hour (US dollars), storage included; a ``stopped`` row its disk only (see the module
    docstring)."""
    if res.state == "stopped" and res.stopped_usd_per_hour is not None:
        return float(res.stopped_usd_per_hour)
    return float(res.usd_per_hour or 0.0)


def _whole_s_sql(col: str) -> str:
    """SQL: whole seconds since 1970 of ISO-8601 text column ``col`` as the ledger writes it (Python's
    ``isoformat()``: ``2026-01-02T03:04:05[.123456][+00:00]``, six digits of fraction when there is one).  The
    fraction is cut off first: SQLite keeps milliseconds only and would round into the next second."""
    tz = f"CASE WHEN substr({col}, 20, 1) = '.' THEN substr({col}, 27) ELSE substr({col}, 20) END"
    return f"round((julianday(substr({col}, 1, 19) || {tz}) - 2440587.5) * 86400.0)"


def _frac_s_sql(col: str) -> str:
    """SQL: the fraction of the second of ISO-8601 text column ``col`` (0.0 without one), to the microsecond."""
    return f"(CASE WHEN substr({col}, 20, 1) = '.' THEN CAST(substr({col}, 21, 6) AS INTEGER) / 1e6 ELSE 0.0 END)"


def rate_sql(t: str = "resources") -> str:
    """The SQL twin of :func:`hourly_usd` over row ``t`` of the ``resources`` table (US dollars per hour): keep the
    two in step."""
    return (f"(CASE WHEN {t}.state = 'stopped' AND {t}.stopped_usd_per_hour IS NOT NULL "
            f"THEN {t}.stopped_usd_per_hour ELSE {t}.usd_per_hour END)")


def spent_usd_sql(t: str = "resources") -> str:
    """The SQL twin of ``resource_cost(res, None, now).spent_usd`` over row ``t`` of the ``resources`` table (US
    dollars): rate x billed seconds / 3600, for sums in the database (``broker cost`` over 100,000s of runs).
    Named parameters from :func:`now_sql_params`.  The age subtracts whole and fractional seconds apart so it keeps
    the microsecond, as ``timedelta.total_seconds`` does."""
    ended = f"{t}.state = 'terminated' AND COALESCE({t}.terminated_at, '') != ''"
    since = f"COALESCE({t}.rate_since, {t}.created_at)"  # the current rate's start (created_at: never changed)
    age = (f"max(0.0, (CASE WHEN {ended} THEN {_whole_s_sql(t + '.terminated_at')} ELSE :now_s END"
           f" - {_whole_s_sql(since)})"
           f" + (CASE WHEN {ended} THEN {_frac_s_sql(t + '.terminated_at')} ELSE :now_frac END"
           f" - {_frac_s_sql(since)}))")
    has_id = f"COALESCE({t}.provider_id, '') != ''"
    minimum = f"COALESCE(CAST(json_extract({t}.attrs, '$.min_billed_seconds') AS REAL), 0.0)"
    floor = f"(CASE WHEN {has_id} THEN {t}.usd_per_hour * {minimum} / 3600.0 ELSE 0.0 END)"
    return (f"(CASE WHEN {t}.state = 'terminated' AND NOT {has_id} THEN 0.0"  # never rented
            f" ELSE max(COALESCE({t}.banked_usd, 0.0) + {rate_sql(t)} * {age} / 3600.0, {floor}) END)")


def now_sql_params(now: datetime) -> dict[str, float]:
    """``{"now_s": .., "now_frac": ..}`` for :func:`spent_usd_sql`: ``now`` as whole seconds since 1970 and the
    fraction, apart (a float of the whole timestamp would round the microseconds)."""
    now = _aware(now)
    whole = now.replace(microsecond=0)
    return {"now_s": int(whole.timestamp()), "now_frac": now.microsecond / 1e6}


def _billed_s(res: Resource, seconds: float) -> float:
    if res.provider_id:
        return max(seconds, float(res.attrs.get("min_billed_seconds") or 0.0))
    return seconds


def effective_deadline(res: Resource, run: Run | None) -> datetime | None:
    """The resource's own deadline, else its run's (None when neither has one)."""
    return _aware(res.deadline) or (_aware(run.deadline) if run else None)


@dataclass
class ResourceCost:
    """Money of one resource at ``now``.  Dollars (``*_usd``), dollars per hour, seconds."""

    resource_id: str
    usd_per_hour: float
    age_s: float  # since created_at (until terminated_at when terminated)
    spent_usd: float  # hourly x age, per second (at least the minimum billed seconds once created)
    deadline: datetime | None
    worst_case_usd: float | None  # hourly x (deadline - created_at); None without a deadline
    time_left_s: float | None  # deadline - now (negative = passed); None without a deadline or when terminated

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["deadline"] = self.deadline.isoformat() if self.deadline else None
        return d


def resource_cost(res: Resource, run: Run | None, now: datetime) -> ResourceCost:
    """Spent so far, worst case at the deadline and time left for ``res`` at ``now``."""
    hourly = hourly_usd(res)
    created = _aware(res.created_at) or now
    end = _aware(res.terminated_at) if res.state == "terminated" and res.terminated_at else now
    age = max(0.0, (end - created).total_seconds())
    dl = effective_deadline(res, run)
    worst = None
    left = None
    never = res.state == "terminated" and not res.provider_id  # nothing was ever rented
    changed = res.rate_since is not None  # broker stop / start changed the rate: banked + current segment
    if changed:
        seg = max(0.0, (end - _aware(res.rate_since)).total_seconds())
        floor = float(res.usd_per_hour or 0.0) * _billed_s(res, 0.0) / 3600.0
        spent = 0.0 if never else max(float(res.banked_usd or 0.0) + hourly * seg / 3600.0, floor)
    else:
        spent = 0.0 if never else hourly * _billed_s(res, age) / 3600.0
    if dl is not None:
        if changed:
            worst = spent + hourly * max(0.0, (dl - now).total_seconds()) / 3600.0
        else:
            worst = hourly * _billed_s(res, max(0.0, (dl - created).total_seconds(), age)) / 3600.0
        if res.state == "terminated":
            worst = spent  # it cannot bill any more
        else:
            left = (dl - now).total_seconds()
    return ResourceCost(resource_id=res.id, usd_per_hour=hourly, age_s=age, spent_usd=spent,
                        deadline=dl, worst_case_usd=worst, time_left_s=left)


@dataclass
class RunCost:
    """Money of one run at ``now``: sums over all its resources (terminated ones count what they cost)."""

    run_id: str
    usd_per_hour: float  # of the live resources
    spent_usd: float
    worst_case_usd: float | None  # None when a live resource has no deadline (unbounded)
    budget_usd: float | None
    budget_left_usd: float | None
    deadline: datetime | None
    time_left_s: float | None
    live: int
    resources: list[ResourceCost] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["deadline"] = self.deadline.isoformat() if self.deadline else None
        d["resources"] = [r.to_dict() for r in self.resources]
        return d


def run_cost(run: Run, resources: Iterable[Resource], now: datetime) -> RunCost:
    """Sum :func:`resource_cost` over ``resources`` (all of the run's rows, live or not)."""
    costs = []
    hourly = spent = worst = 0.0
    unbounded = False
    live = 0
    for res in resources:
        c = resource_cost(res, run, now)
        costs.append(c)
        spent += c.spent_usd
        if res.state != "terminated":
            live += 1
            hourly += c.usd_per_hour
            if c.worst_case_usd is None:
                unbounded = unbounded or c.usd_per_hour > 0
            else:
                worst += c.worst_case_usd
        else:
            worst += c.spent_usd
    dl = _aware(run.deadline)
    return RunCost(run_id=run.id, usd_per_hour=hourly, spent_usd=spent,
                   worst_case_usd=None if unbounded else worst, budget_usd=run.budget_usd,
                   budget_left_usd=None if run.budget_usd is None else run.budget_usd - spent, deadline=dl,
                   time_left_s=(dl - now).total_seconds() if dl else None, live=live, resources=costs)


# --------------------------------------------------------------------------------------------------- budget
def check_budget(worst_case_usd: float, budget_usd: float | None, usd_per_hour: float) -> None:
    """Refuse a plan whose worst case (hourly x deadline, storage included) exceeds the budget.

    Returns None when it fits (or there is no budget).  Raises :class:`NoValidPlan` (exit 3) naming the worst
    case, the budget and the longest ``max_hours`` that fits, e.g. message "worst case $7.20 (1.00 h at
    $7.20/h) exceeds the budget $5.00; at most 0.69 h fits", hint "set max_hours: 0.69 or raise budget_usd to at
    least $7.20".
    """
    if budget_usd is None or worst_case_usd <= budget_usd + 1e-9:
        return None
    if usd_per_hour > 0:
        hours = worst_case_usd / usd_per_hour
        fit = math.floor(budget_usd / usd_per_hour * 100) / 100  # round down: never stretch the budget
        what = f"{hours:.2f} h at {usd(usd_per_hour)}/h"
        if fit > 0:
            hint = f"set max_hours: {fit:.2f} or raise budget_usd to at least {usd(cents_up(worst_case_usd))}"
            fits = f"; at most {fit:.2f} h fits"
        else:
            hint = f"raise budget_usd to at least {usd(cents_up(usd_per_hour / 100))} (0.01 h) or pick a cheaper offer"
            fits = "; not even 0.01 h fits"
    else:
        what, fits, hint = "fixed costs", "", f"raise budget_usd to at least {usd(cents_up(worst_case_usd))}"
    raise NoValidPlan(f"worst case {usd(worst_case_usd, budget_usd)} ({what}) exceeds the budget {usd(budget_usd)}"
                      f"{fits}", hint=hint)


# --------------------------------------------------------------------------------------------------- layers
def pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists on this machine and is not a zombie (signal-0 probe + /proc state)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def cli_alive(pid: int | None, pid_start: int | None) -> bool:
    """Whether the process a run recorded as its CLI still runs: the same pid *and* start time
    (:mod:`broker.core.procid`; a reused pid is someone else's); a row of an older broker without a start time
    falls back to :func:`pid_alive`.  ``run``-free so the settling loops need no Run per row."""
    if pid_start is None:
        return pid_alive(pid)
    from broker.core.procid import ProcessId, matches

    return bool(pid) and matches(ProcessId(int(pid), int(pid_start)))  # type: ignore[arg-type]


@dataclass
class WatchdogState:
    """What the heartbeat file says about the running watchdog."""

    pid: int | None = None
    heartbeat_at: datetime | None = None
    interval_s: float | None = None
    started_at: datetime | None = None
    alive: bool = False  # the process that wrote the heartbeat runs, its last pass is fresh and was over this home
    #: the heartbeat's process runs but its last pass was over another ledger (this home was deleted and made
    #: again, or the file replaced): it guards nothing here
    other_ledger: bool = False
    age_s: float | None = None
    errors: dict[str, str] = field(default_factory=dict)  # provider -> last error of an orphan scan
    #: keyed digest of the secrets in the watchdog's environment ("" none): which runs it can act for
    secrets_digest: str = ""
    home: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("heartbeat_at", "started_at"):
            d[k] = d[k].isoformat() if d[k] else None
        return d


def heartbeat_path(home: Path | None = None, scope: str | None = None) -> Path:
    """``<broker home>/watchdog.json``: pid, start time, last heartbeat, interval, provider errors
    (``watchdog-<scope>.json`` for the watchdog of the runs made with one provider environment)."""
    if home is None:
        from broker.core.config import broker_home

        home = broker_home()
    return Path(home) / (f"watchdog-{scope}.json" if scope else "watchdog.json")


def watchdog_state(now: datetime | None = None, home: Path | None = None,
                   stale_after_s: float | None = None, scope: str | None = None) -> WatchdogState:
    """Read the heartbeat (written after each completed pass; ``scope``: the heartbeat of the watchdog of the runs
    made with one provider environment).  The watchdog counts as armed only when the process that wrote it still
    runs (pid *and* start time, :mod:`broker.core.procid`), the heartbeat is younger than ``stale_after_s``
    (default: 3 intervals + 60 s: a pass may spend up to 30 s confirming a termination), and that pass was over
    *this* home's ledger (its installation id): a watchdog whose home was deleted and made again guards the old,
    deleted ledger and nothing here."""
    now = now or utcnow()
    try:
        data = json.loads(heartbeat_path(home, scope).read_text())
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except (OSError, ValueError):
        return WatchdogState()
    hb = datetime.fromisoformat(data["heartbeat_at"]) if data.get("heartbeat_at") else None
    st = datetime.fromisoformat(data["started_at"]) if data.get("started_at") else None
    interval = float(data.get("interval_s") or 5.0)
    age = (now - hb).total_seconds() if hb else None
    limit = stale_after_s if stale_after_s is not None else 3 * interval + 60.0
    start = data.get("pid_start")
    runs = bool(data.get("pid")) and cli_alive(int(data["pid"]), start if isinstance(start, int) else None)
    fresh = runs and age is not None and age <= limit
    here = fresh and bool(data.get("installation_id")) and \
        data.get("installation_id") == home_installation_id(heartbeat_path(home).parent)
    return WatchdogState(pid=data.get("pid"), heartbeat_at=hb, interval_s=interval, started_at=st, alive=here,
                         age_s=age, errors=dict(data.get("errors") or {}), other_ledger=fresh and not here,
                         secrets_digest=str(data.get("secrets_digest") or ""),
                         home=str(home) if home is not None else None)


def home_installation_id(home: Path) -> str | None:
    """The installation id of the ledger now at ``<home>/ledger.sqlite`` (read-only; None when there is none or
    it cannot be read): what a watchdog's heartbeat must name to count as this home's."""
    import sqlite3

    path = Path(home) / "ledger.sqlite"
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            row = db.execute("SELECT value FROM meta WHERE key='installation_id'").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return str(row[0]) if row else None


def watchdog_serves(run: Run | None, wd: WatchdogState) -> bool:
    """Whether a live watchdog can act for ``run``: the heartbeat's (``wd``) when the run's recorded provider
    environment (:mod:`broker.core.provider_env`) is one it can serve, else the run's own scoped watchdog."""
    if run is None:
        return wd.alive
    from broker.core import provider_env

    try:
        from broker.core.runfolder import confined_run_dir

        env = provider_env.read(confined_run_dir(run))
    except Exception:  # noqa: BLE001 - no readable record: the run is served as before
        env = None
    if env is None:
        return wd.alive
    if wd.alive and provider_env.servable(env, {"secrets_digest": wd.secrets_digest}):
        return True
    home = Path(wd.home) if wd.home else None
    return watchdog_state(home=home, scope=provider_env.fingerprint(env)).alive


def _requirement_setting(provider: str, requirement: str) -> bool:
    """The setting ``<provider>_<requirement>`` (``OCI_INSTANCE_PRINCIPAL``): whether a node switch that needs
    ``requirement`` is armed on resources whose row does not record it."""
    try:
        from broker.core.config import settings

        return bool(getattr(settings(), f"{provider}_{requirement}", False))
    except Exception:
        return False


def node_layer(res: Resource, run: Run | None = None) -> str | None:
    """The node-side dead-man switch of ``res``, as a short description, or None.

    Recorded facts win: ``attrs["node_layer"]`` (a description) or ``attrs["deadman"]`` (true / false).
    Otherwise it is what the adapter declares it arms when the node has a deadline (its ``node_switch``
    capability, armed only with ``node_switch_requires`` where one is named; docs/design.md, invariant 4):
    Vast.ai - the onstart script destroys its own instance through the API (``CONTAINER_ID`` /
    ``CONTAINER_API_KEY``) at deadline + grace; AWS - ``InstanceInitiatedShutdownBehavior=terminate`` and a
    scheduled ``shutdown``; OCI - only with an instance principal (``attrs["instance_principal"]``, else the
    ``OCI_INSTANCE_PRINCIPAL`` setting), because an in-OS shutdown does not stop OCI GPU billing and only an API
    terminate does.  Other providers (local, fake, netns, slurm): none.
    """
    a = res.attrs or {}
    if a.get("node_layer"):
        return str(a["node_layer"])
    if "deadman" in a:
        return "dead-man switch" if a["deadman"] else None
    if res.kind != "instance" or effective_deadline(res, run) is None:
        return None
    g = a.get("deadman_grace_s")
    grace = f"deadline + {float(g):g} s grace" if isinstance(g, (int, float)) else "deadline + grace"
    if not switch_armable(res):
        return None
    from broker.providers import capability

    return capability(res.provider, "node_switch").format(grace=grace)


def switch_armable(res: Resource) -> bool:
    """Whether ``res``'s provider arms a node-side dead-man switch on it: its ``node_switch`` capability, and where
    ``node_switch_requires`` names a requirement, the row's attribute of that name (else the setting
    ``<provider>_<requirement>``, ``OCI_INSTANCE_PRINCIPAL``).  What the row records of an armed switch
    (``attrs["deadman"]``) is not looked at."""
    from broker.providers import capability

    if capability(res.provider, "node_switch") is None:
        return False
    need = capability(res.provider, "node_switch_requires")
    a = res.attrs or {}
    return need is None or bool(a[need] if need in a else _requirement_setting(res.provider, need))


#: resource states in which a machine bills and its node switch is expected to end it
_SWITCH_BILLING_STATES = ("creating", "running", "starting", "terminating", "orphan", "unknown", "failed")


def switch_overdue_s(res: Resource, run: Run | None, now: datetime | None = None) -> float | None:
    """Seconds since ``res``'s node-side switch should have fired (its deadline + grace: the row's
    ``deadman_grace_s``, else the run's :func:`broker.core.nodescripts.deadman_grace_s`) while the ledger still
    shows it billing; None when it has no switch, no deadline, does not bill, or the time has not come.  Such a
    switch did not fire: it guards nothing any more."""
    if node_layer(res, run) is None or res.state not in _SWITCH_BILLING_STATES or not res.usd_per_hour:
        return None
    deadline = effective_deadline(res, run)
    if deadline is None:
        return None
    from broker.core.nodescripts import deadman_grace_s

    g = (res.attrs or {}).get("deadman_grace_s")
    if isinstance(g, bool) or not isinstance(g, (int, float)):
        hours = (run.recipe or {}).get("max_hours") if run else None
        g = deadman_grace_s(float(hours) if isinstance(hours, (int, float)) else None)
    late = ((now or utcnow()) - deadline).total_seconds() - float(g)
    return late if late > 0 else None


def armed_layers(res: Resource, run: Run | None, wd: WatchdogState,
                 now: datetime | None = None) -> dict[str, bool]:
    """The teardown layers protecting ``res``: ``cli`` (the run's CLI process is alive here and the run is
    active), ``watchdog`` (a watchdog guards this home and can act for this run's provider environment:
    :func:`watchdog_state`, :func:`watchdog_serves`), ``node`` (a node-side dead-man switch was armed at
    provisioning and its time has not passed: one that should have fired at ``now`` and the machine still bills
    guards nothing, :func:`switch_overdue_s`)."""
    cli = bool(run and run.status in ACTIVE_STATUSES and cli_alive(run.pid, run.pid_start))
    node = node_layer(res, run) is not None and switch_overdue_s(res, run, now) is None
    return {"cli": cli, "watchdog": watchdog_serves(run, wd), "node": node}
