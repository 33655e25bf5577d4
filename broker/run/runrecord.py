"""The values the run pipeline passes around (:class:`Quote`, :class:`Hooks`, :class:`Context`,
:class:`RunOutcome`) and the run row's life: :func:`new_run` creates it with its folder, :func:`end_run` records the
end (also on a full filesystem, through the space reserve).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from broker.core.model import utcnow
from broker.core.prose import usd
from broker.core.records import Cluster, Resource, Run
from broker.core.provider import BrokerError
from broker.core.recipe import Recipe

if TYPE_CHECKING:
    from broker.run.supervisor import RunResult
    from broker.money.ledger import Ledger


Say = Callable[[str], None]


# --------------------------------------------------------------------------------------------------- values
@dataclass
class Quote:
    """What a paid run may cost, shown before anything is created: ``usd_per_hour`` of the chosen option,
    ``deadline_hours`` (the hard deadline), ``worst_case_usd`` (every unit billed to the deadline, storage and
    setup allowance included), ``summary`` (e.g. ``simulated on vast: 2x RTX 3090 (Quebec, CA)``)."""

    provider: str
    topology: str
    summary: str
    usd_per_hour: float
    deadline_hours: float
    worst_case_usd: float
    budget_usd: float | None
    failover_options: int = 1

    def lines(self) -> list[str]:
        budget = f" of budget {usd(self.budget_usd)}" if self.budget_usd is not None else ""
        more = (f"; on failure, up to {self.failover_options - 1} other ranked option(s) within the same budget"
                if self.failover_options > 1 else "")
        return [f"chosen: {self.summary}",
                f"price: {usd(self.usd_per_hour)}/hour; hard deadline {self.deadline_hours:g} h; worst case "
                f"{usd(self.worst_case_usd)}{budget}{more}"]


@dataclass
class Hooks:
    """How the pipeline talks to its caller (the CLI): ``echo`` gets node log lines (``[node i] ...``; None =
    quiet), ``say`` progress lines, ``on_start(run, description)`` once the run row exists, ``confirm(quote)`` must
    return True before a paid target creates anything (None = no question: the caller decided)."""

    echo: Callable[[str], None] | None = None
    say: Say | None = None
    on_start: Callable[[Run, str], None] | None = None
    confirm: Callable[[Quote], bool] | None = None


@dataclass
class RunOutcome:
    """What :func:`run_pipeline` ended with.  ``left``: resources still live after release (empty = none);
    ``cost_usd``: the run's spend per the ledger; ``kept_until_idle``: the nodes were kept (recipe
    ``idle_minutes``) and ``kept`` lists them."""

    run: Run
    result: "RunResult | None"
    cluster: Cluster | None = None
    left: list[Resource] = field(default_factory=list)
    cost_usd: float = 0.0
    kept_until_idle: bool = False
    kept: list[Resource] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """docs/design.md exit codes: 0 success, 1 the job failed, 4 something stayed live, 130 interrupted."""
        if self.left:
            return 4
        res = self.result
        if res is not None and res.ok:
            return 0
        return 130 if res is not None and res.status == "interrupted" else 1


class Declined(BrokerError):
    """The user (or the lack of a terminal) did not confirm a paid run; nothing was created (exit 2)."""

    exit_code = 2


@dataclass
class Context:
    ledger: "Ledger"
    hooks: Hooks
    actor: str = "cli"

    def say(self, msg: str) -> None:
        if self.hooks.say:
            self.hooks.say(msg)


# --------------------------------------------------------------------------------------------------- run rows
def new_run(ledger: "Ledger", recipe: Recipe, *, provider: str, topology: str, plan: dict | None = None) -> Run:
    """Create the run row and its directory (``<home>/runs/<run_id>``) with recipe.json and plan.json."""
    from broker.core.config import runs_dir
    from broker.money.ledger import new_id

    from broker.core.runfolder import reserved_run_id

    # `broker run -d` chose and printed the id before this process started
    run_id = reserved_run_id() or utcnow().strftime("%Y%m%d-%H%M%S-") + new_id()[:6]
    from broker.core.private import private_dir, write_private

    run_dir = private_dir(runs_dir() / run_id)  # 0700; its files 0600 from their creation
    now = utcnow()
    recipe_data = recipe.model_dump(mode="json")  # secrets: names only; secret-looking env values masked
    write_private(run_dir / "recipe.json", json.dumps(recipe_data, indent=2))
    if plan is not None:
        write_private(run_dir / "plan.json", json.dumps(plan, indent=2, default=str))
    from broker.core import provider_env

    provider_env.record(run_dir)  # a watchdog another CLI started acts for this run with these settings
    _reserve_space(ledger)
    run = Run(id=run_id, name=recipe.name, recipe_path=str(recipe.path) if recipe.path else None,
              recipe=recipe_data, plan=plan, provider=provider, topology=topology, status="running",
              created_at=now, started_at=now, deadline=now + timedelta(hours=recipe.max_hours),
              budget_usd=recipe.budget_usd, run_dir=str(run_dir), pid=os.getpid(), pid_start=_my_start())
    return ledger.create_run(run)


def _my_start() -> int | None:
    """This process's start time (:mod:`broker.core.procid`): with its pid, the CLI's identity in the run's row."""
    from broker.core.procid import record

    me = record()
    return me.start if me else None


#: bytes kept free beside the ledger (``<home>/.space-reserve``) so the end of a run can be recorded even when the
#: job filled the filesystem: released on the first "database or disk is full", re-made by the next run
SPACE_RESERVE_BYTES = 2 * 1024 * 1024


def _reserve_path(ledger: "Ledger") -> Path:
    return ledger.path.parent / ".space-reserve"


def _reserve_space(ledger: "Ledger") -> None:
    p = _reserve_path(ledger)
    try:
        if not p.exists() or p.stat().st_size < SPACE_RESERVE_BYTES:
            from broker.core.private import private_opener

            with open(p, "wb", opener=private_opener) as f:  # 0600 from creation, as every file in the home
                f.write(b"\0" * SPACE_RESERVE_BYTES)
    except OSError:  # a nearly full disk: the run goes on; end_run then waits for space
        try:
            p.unlink()
        except OSError:
            pass


def end_run(ledger: "Ledger", run_id: str, result: "RunResult | None", *, status: str, message: str | None,
            actor: str = "cli", say: Say | None = None, retry_full_s: float = 120.0, **fields: object) -> Run:
    """Record the end of a run: status, end time, per-node exit codes and log paths from ``result`` (none when the
    job never produced one), the message, an ``end`` event; returns the updated row.

    A full filesystem under the ledger (``database or disk is full``, e.g. the job's checkpoints filled it): the
    space reserve made at the start of the run (:data:`SPACE_RESERVE_BYTES`) is released and the write retried, so
    the run is still recorded as ended; the full filesystem is named (``say``) and the message says so.  Without a
    reserve the write is retried every 2 s for ``retry_full_s`` seconds, then BrokerError names the folder.
    """
    stop_at = time.monotonic() + retry_full_s
    told = False
    while True:
        try:
            ledger.update_run(run_id, status=status, ended_at=utcnow(), message=message,
                              exit_codes={str(k): v for k, v in (result.exit_codes.items() if result else [])},
                              log_paths={str(k): str(v) for k, v in (result.log_paths.items() if result else [])},
                              **fields)
            ledger.event(run_id, actor, "end", status)
            break
        except sqlite3.OperationalError as e:
            reserve = _reserve_path(ledger)
            if "full" in str(e) and reserve.exists():
                reserve.unlink()
                note = (f"the filesystem holding {ledger.path.parent} is full (the job's files filled it); freed "
                        "broker's space reserve to record the end of the run: free space before the next run")
                if say:
                    say(note)
                message = f"{message}; {note}" if message else note
                continue
            if "full" not in str(e) or time.monotonic() > stop_at:
                if "full" in str(e):
                    raise BrokerError(f"cannot record the end of run {run_id}: the filesystem holding the ledger "
                                      f"({ledger.path.parent}) is full",
                                      hint="free space there (e.g. `broker clean`), then `broker status` shows the "
                                           "run again") from None
                raise
            if not told and say:
                say(f"the filesystem holding the ledger ({ledger.path.parent}) is full; waiting for space to record "
                    "the end of the run")
                told = True
            time.sleep(2.0)
    updated = ledger.get_run(run_id)
    assert updated is not None
    return updated
