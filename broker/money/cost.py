"""What a run has spent and how long its one clock has left, from the ledger: :func:`spent_usd` per resource,
:func:`run_spent_usd` per run (through :func:`broker.money.accounting.run_cost`, the one place a run's money is
summed), :func:`run_clock` / :func:`check_clock` (deadline and budget), and the provider-reported rate that replaces
the planned one (:func:`record_reported_rate`, :class:`RateAboveBudget`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Callable

from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.core.prose import usd as usd_text
from broker.core.records import Resource, Run
from broker.core.provider import BrokerError, Provider


Progress = Callable[[str], None]

#: hours in a billing month (8760 / 12), to turn USD per GiB-month into USD per hour
HOURS_PER_MONTH = 730.0


# --------------------------------------------------------------------------------------------------- costs
def spent_usd(res: Resource, now: datetime | None = None) -> float:
    """US dollars ``res`` has cost so far (see :func:`broker.money.accounting.resource_cost`: per second from the
    intent's ``created_at`` until termination or ``now``, at least the minimum billed seconds once created)."""
    from broker.money.accounting import resource_cost

    return resource_cost(res, None, now or utcnow()).spent_usd


def run_spent_usd(ledger: Ledger, run_id: str, now: datetime | None = None) -> float:
    """US dollars ``run_id`` has cost so far (live and terminated resources): the ``spent_usd`` of
    :func:`broker.money.accounting.run_cost`, the one place a run's money is summed."""
    from broker.money.accounting import run_cost as _run_cost

    run = ledger.get_run(run_id)
    rows = ledger.resources(run_id)
    if run is None or run.id != run_id:  # rows without a run row (reconcile's "unknown" run)
        return sum(spent_usd(r, now) for r in rows)
    return _run_cost(run, rows, now or utcnow()).spent_usd


def run_clock(ledger: Ledger, run: Run, now: datetime | None = None) -> tuple[float, str]:
    """Seconds the run has left on its one clock and what ends it first: ``(seconds, "deadline" | "budget")``.

    The deadline is ``run.deadline``; the budget ends when what the run has spent plus what its live resources
    bill per hour (the provider's reported rate where the ledger has it) reaches ``run.budget_usd``.  Without a
    deadline and a budget: ``(inf, "deadline")``.  Negative or 0 = the clock has run out: nothing new may be
    rented and every wait ends."""
    from broker.money.accounting import _aware, run_cost as _run_cost

    now = now or utcnow()
    left, why = float("inf"), "deadline"
    cur = ledger.get_run(run.id) or run
    dl = _aware(cur.deadline)
    if dl is not None:
        left = (dl - now).total_seconds()
    if cur.budget_usd is not None:
        rc = _run_cost(cur, ledger.resources(run.id), now)
        room = cur.budget_usd - rc.spent_usd
        b_left = room / rc.usd_per_hour * 3600.0 if rc.usd_per_hour > 0 else (float("inf") if room > 0 else 0.0)
        if b_left < left:
            left, why = b_left, "budget"
    return left, why


def live_usd_per_hour(ledger: Ledger, run_id: str | None = None) -> float:
    """What the live resources (of ``run_id``, or all) bill per hour right now, USD/hour."""
    return sum(r.usd_per_hour for r in ledger.resources(run_id, live_only=True))


class ClockOut(BrokerError):
    """The run's one clock ran out while provisioning: its deadline passed, its budget is spent, or the watchdog
    ended the run.  Nothing more is rented; the run ends with ``status`` (``deadline`` or ``interrupted``) and
    exit code 1 after teardown."""

    exit_code = 1

    def __init__(self, message: str, *, status: str = "deadline", hint: str | None = None):
        super().__init__(message, hint=hint)
        self.status = status


class RateAboveBudget(ClockOut):
    """The provider reports a rate more than :data:`RATE_TOLERANCE` above the planned one and at that rate the run
    no longer fits its budget: the run stops and is torn down (exit 3, like a plan that does not fit)."""

    exit_code = 3


#: a reported rate this much above the planned one (0.10 = 10 %) is checked against the budget
RATE_TOLERANCE = 0.10


def adopt_reported_rate(p: Provider, ledger: Ledger, res: Resource, reported_usd_per_hour: float, *,
                        actor: str) -> tuple[Resource, float, float, bool]:
    """Write the provider's rate for ``res`` to the ledger (see :func:`record_reported_rate`, which also judges
    it); returns (the updated row, planned $/hour, the rate now recorded, whether it changed)."""
    a = res.attrs or {}
    planned = float(a.get("planned_usd_per_hour", res.usd_per_hour) or 0.0)
    storage = 0.0 if getattr(p, "reported_rate_includes_storage", False) else float(a.get("storage_usd_per_hour")
                                                                                    or 0.0)
    rate = round(float(reported_usd_per_hour) + storage, 6)
    changed = abs(rate - float(res.usd_per_hour or 0.0)) > 1e-9 or bool(a.get("rate_unknown"))
    if changed:
        ledger.update_resource(res.id, usd_per_hour=rate, actor=actor,
                               attrs={"planned_usd_per_hour": planned, "reported_usd_per_hour": rate,
                                      "rate_source": f"{p.name} reported", "rate_unknown": None},
                               message=f"{p.name} reports {usd_text(rate, up_to=4)}/h for {res.provider_id} (planned "
                                       f"{usd_text(planned, up_to=4)}/h)")
    return ledger.resource(res.id) or res, planned, rate, changed


def record_reported_rate(p: Provider, ledger: Ledger, res: Resource, run: Run, reported_usd_per_hour: float, *,
                         say: Progress, actor: str) -> Resource:
    """Make the provider's rate the ledger's: ``res.usd_per_hour`` becomes what ``p`` reports for the instance
    (US dollars per hour; plus the recorded storage rate unless the adapter's ``reported_rate_includes_storage``,
    as Vast's ``dph_total``), the planned one kept in ``attrs["planned_usd_per_hour"]``.  Every money figure reads
    the ledger (status, cost, the budget guard, the watchdog), so they all use it from here on.

    A reported rate more than :data:`RATE_TOLERANCE` above the planned one is said with both numbers; when the
    run's worst case at that rate (until its deadline) exceeds its budget, raises :class:`RateAboveBudget`."""
    from broker.money.accounting import run_cost as _run_cost

    res, planned, rate, changed = adopt_reported_rate(p, ledger, res, reported_usd_per_hour, actor=actor)
    if changed and planned > 0 and rate > planned * (1 + RATE_TOLERANCE):
        cur = ledger.get_run(run.id) or run
        rc = _run_cost(cur, ledger.resources(run.id), utcnow())
        pct = (rate / planned - 1) * 100
        both = (f"{p.name} reports {usd_text(rate, up_to=4)}/h for {res.provider_id}, {pct:.0f} % above the "
                f"planned {usd_text(planned, up_to=4)}/h")
        if cur.budget_usd is not None and (rc.worst_case_usd is None or rc.worst_case_usd > cur.budget_usd + 1e-9):
            worst = "unbounded" if rc.worst_case_usd is None else usd_text(rc.worst_case_usd, cur.budget_usd)
            raise RateAboveBudget(f"{both}: at that rate the run's worst case is {worst}, above its budget "
                                  f"{usd_text(cur.budget_usd)}; stopping and tearing down", status="failed",
                                  hint="raise budget_usd or lower max_hours in the recipe, or pick another offer "
                                       "(`broker plan` shows the planned prices)")
        say(f"{both}; the worst case at that rate ({usd_text(float(rc.worst_case_usd or 0))}) still fits the "
            "budget" + (f" {usd_text(cur.budget_usd)}" if cur.budget_usd is not None else "") + ": going on")
    return res


def note_unknown_rate(p: Provider, ledger: Ledger, res: Resource, why: str, *, actor: str) -> tuple[Resource, str]:
    """Record on ``res`` that ``p`` reported a rate broker cannot read (``why``, from
    :func:`broker.core.records.read_rate`): ``attrs["rate_unknown"]``, and the rate source says so; the ledger's
    number stays the planned one only because a row needs one (every line that shows it says it is unknown).
    Returns (the row, the line to show)."""
    a = res.attrs or {}
    planned = float(a.get("planned_usd_per_hour", res.usd_per_hour) or 0.0)
    line = (f"{p.name} reports a rate broker cannot read for {res.provider_id} ({why}): its real rate is unknown, "
            f"not the planned {usd_text(planned, up_to=4)}/h; costs shown for it may be low")
    if a.get("rate_unknown") != why:
        ledger.update_resource(res.id, actor=actor, message=line,
                               attrs={"planned_usd_per_hour": planned, "rate_unknown": why,
                                      "rate_source": f"{p.name} reported an unreadable rate"})
    return ledger.resource(res.id) or res, line


def record_unknown_rate(p: Provider, ledger: Ledger, res: Resource, run: Run, why: str, *, say: Progress,
                        actor: str) -> Resource:
    """The provider reported a rate for ``res`` that broker cannot read (text, negative, NaN, missing): the rate is
    unknown, never the planned one (:func:`note_unknown_rate`), and the line says so.  The budget guard takes the
    worst case: with an unknown rate the run's cost cannot be shown to fit a budget, so a run with a budget raises
    :class:`RateAboveBudget` (stop and tear down, exit 3); a run without one goes on."""
    res, line = note_unknown_rate(p, ledger, res, why, actor=actor)
    cur = ledger.get_run(run.id) or run
    if cur.budget_usd is not None:
        raise RateAboveBudget(f"{line}; with an unknown rate the run cannot be shown to fit its budget "
                              f"{usd_text(cur.budget_usd)}: stopping and tearing down", status="failed",
                              hint=f"check the instance's price in the {p.name} console; pick another offer "
                                   "(`broker plan` shows the planned prices)")
    say(line + "; the run has no budget to guard: going on")
    return res


def check_clock(ledger: Ledger, run: Run, doing: str) -> float:
    """Seconds left on the run's clock (:func:`run_clock`) before ``doing`` (e.g. "renting the next offer");
    raises :class:`ClockOut` when none are left or the run was ended by the watchdog (its status is an end)."""
    from broker.money.accounting import ENDED_STATUSES

    cur = ledger.get_run(run.id)
    if cur is not None and cur.id == run.id and cur.status in ENDED_STATUSES:
        raise ClockOut(f"run {run.id} ended ({cur.status}: {cur.message or 'no message'}) before {doing}; "
                       "nothing more is rented", status=cur.status if cur.status != "failed" else "interrupted",
                       hint=f"`broker status {run.id}` shows what is left; `broker down {run.id}` removes it")
    left, why = run_clock(ledger, run)
    if left <= 0:
        if why == "budget":
            msg = (f"the run's budget {usd_text(float(run.budget_usd or 0))} is spent before {doing}; nothing more is "
                   "rented")
            status = "interrupted"
        else:
            msg = f"the run's deadline passed before {doing}; nothing is rented after the deadline"
            status = "deadline"
        raise ClockOut(msg, status=status, hint="raise max_hours / budget_usd in the recipe, or pick offers that "
                                                "start faster (`broker plan` lists them)")
    return left


def charge_transfer(ledger: Ledger, run_id: str, bytes_in: int, bytes_out: int, *, actor: str,
                    say: Progress | None = None, now: datetime | None = None) -> float:
    """Bill the bytes a run moved at its instances' per-GB rates (ledger attrs ``transfer_in_usd_per_gb`` /
    ``transfer_out_usd_per_gb``, recorded from the offer): ``bytes_in`` staged to the nodes, ``bytes_out``
    collected from them (artifacts), shared evenly over the run's rented instances.  Each charge goes into the
    row's banked money (:meth:`Ledger.add_charge`) and is said once.  Returns the USD charged (0 when no instance
    names a rate)."""
    from broker.plan.pricing import TRANSFER_IN_ATTR, TRANSFER_OUT_ATTR, transfer_usd

    rows = [r for r in ledger.resources(run_id) if r.kind == "instance" and r.provider_id]
    if not rows or (bytes_in <= 0 and bytes_out <= 0):
        return 0.0
    at = now or utcnow()
    in_gb, out_gb = bytes_in / 1e9 / len(rows), bytes_out / 1e9 / len(rows)
    total = 0.0
    for r in rows:
        usd = transfer_usd(r.attrs or {}, in_gb, out_gb)
        if usd <= 0:
            continue
        a = r.attrs or {}
        ledger.add_charge(r.id, usd, at=at, actor=actor,
                          message=f"bandwidth {usd_text(usd, up_to=4)}: {in_gb:.3g} GB in x "
                                  f"{usd_text(a.get(TRANSFER_IN_ATTR) or 0, up_to=4)}/GB, {out_gb:.3g} GB out x "
                                  f"{usd_text(a.get(TRANSFER_OUT_ATTR) or 0, up_to=4)}/GB")
        total += usd
    if total > 0 and say:
        say(f"bandwidth: {usd_text(total, up_to=4)} for {bytes_in / 1e9:.3g} GB staged and {bytes_out / 1e9:.3g} GB "
            "collected (the provider's per-GB rates)")
    return total
