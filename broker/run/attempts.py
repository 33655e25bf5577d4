"""Attempts of one run: a preempted interruptible run is released, rented again and relaunched.

:func:`run_attempts` is the pipeline's acquire..run step repeated: each attempt is a ledger row
(:meth:`broker.money.ledger.Ledger.start_attempt` / ``end_attempt``: number, started/ended, cause, the resources it
rented, hence its cost).  When an attempt ends because a node was **lost** (the provider shows the instance
stopped / terminated while the job ran: :class:`broker.run.guard.NodeLost`; the SSH connection to a node
dropped: its exit code is unknown; the provider's :meth:`broker.core.provider.Provider.preemption` says it took
the instance back) the run is **preempted**: what is left is torn down (confirmed), the run's clock is checked,
and the same ranked options are provisioned again through the same path as the first attempt (failover picks
the next option when the first has no capacity); the checkpoint wrapper (:mod:`broker.run.checkpoint`) restores
the latest copy of ``checkpoint_dir`` on the new node(s) before the same command is launched.

A job that **crashed** (a rank exited non-zero: a traceback, an OOM kill, a failed setup) is never restarted:
the fault would repeat.  Nor is a node that broker itself ended (the watchdog at the deadline or budget,
``broker down`` from another terminal): the ledger says so (:func:`broker_ended`) before any provider is asked.  Restarts are only for recipes with ``interruptible: true|auto``, at most
``max_restarts`` of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from broker.core.provider import BrokerError, Provider

if TYPE_CHECKING:
    from broker.core.records import Cluster, Run
    from broker.core.recipe import Recipe
    from broker.run.runrecord import Context
    from broker.run.supervisor import RunResult
    from broker.run.targets import Target

_log = logging.getLogger(__name__)

#: fewest seconds left on the run's clock for another attempt to be worth renting
MIN_ATTEMPT_S = 60.0


class RestartsExhausted(BrokerError):
    """The run was preempted more often than its recipe's ``max_restarts`` allows (exit 1)."""

    exit_code = 1


@dataclass
class Verdict:
    """How an attempt ended: ``preempted`` (rent again) or not, and why in words."""

    preempted: bool
    why: str


def restarts_enabled(recipe: "Recipe") -> bool:
    """Whether a lost node makes broker rent again: the recipe asks for interruptible capacity (``true`` /
    ``auto``)."""
    return str(getattr(recipe, "interruptible", "false")).lower() in ("true", "auto")


#: ledger states of an instance that only broker writes, before its own terminate / stop call
_BROKER_ENDING = ("terminating", "terminated", "stopping", "stopped")


def broker_ended(ctx: "Context", run: "Run") -> str | None:
    """Why broker itself ended a node of the attempt that runs now, in another process (the watchdog at the
    deadline or budget, ``broker down`` in another terminal, ``broker stop``), read from the ledger alone; None
    when it did not.

    broker writes its claim to the ledger before its terminate / stop call (:meth:`Ledger.claim_termination`:
    state ``terminating``, ``terminated_by`` = the actor), so by the time the job sees a node go, a node broker
    ended shows it here; a provider's reclaim never does.  That is how the two are told apart where the provider
    records no reason (OCI's Instance says TERMINATED either way).  Not counted: rows of earlier attempts, rows
    ended by this process (``ctx.actor``: a failed create or a failover while acquiring) and rows marked
    ``terminated_by 'provider'`` (another process saw the provider end it)."""
    ledger = ctx.ledger
    earlier = {i for a in ledger.attempts(run.id) if a["ended_at"] is not None for i in a["resource_ids"]}
    cur = ledger.get_run(run.id)
    said = f" ({cur.message})" if cur is not None and (cur.message or "").startswith("watchdog:") else ""
    for res in ledger.resources(run.id):
        if res.id in earlier or res.kind != "instance" or res.state not in _BROKER_ENDING:
            continue
        what = f"{res.provider} instance {res.provider_id or res.name}"
        if res.state in ("stopping", "stopped"):
            return f"{what} was stopped by broker (`broker stop`)"
        if res.terminated_by not in (None, "provider", ctx.actor):
            return f"{what} was terminated by broker's {res.terminated_by}{said}"
    if said:  # the watchdog ended the run before its terminate reached the ledger row
        return f"the run was ended by broker's watchdog{said}"
    return None


def provider_preemption(ctx: "Context", run: "Run", providers: dict[str, Provider] | None) -> str | None:
    """The first reason a provider gives for having taken one of ``run``'s live instances back
    (:meth:`Provider.preemption`), else None.  A provider that cannot be asked counts as "no word".  A row broker
    is terminating or stopping (the ledger's claim precedes the call) is not asked: an adapter that cannot see
    who terminated (OCI) would call broker's own terminate a preemption."""
    from broker.providers import get_provider

    cache: dict[str, Provider] = dict(providers or {})
    for res in ctx.ledger.resources(run.id, live_only=True):
        if res.kind != "instance" or not res.provider_id or res.state in _BROKER_ENDING:
            continue
        try:
            p = cache.get(res.provider) or cache.setdefault(res.provider, get_provider(res.provider))
            why = p.preemption(res.provider_id)
        except Exception as e:  # noqa: BLE001 - the node evidence below still decides
            _log.info("preemption(%s) at %s failed: %s", res.provider_id, res.provider, e)
            continue
        if why:
            return f"{res.provider} {res.provider_id}: {why}"
    return None


def classify(result: "RunResult | None", lost: BaseException | None, provider_word: str | None) -> Verdict:
    """Tell a preemption from a crash.  ``lost``: the NodeLost the node watch raised (the provider showed a node
    stopped / gone); ``provider_word``: :func:`provider_preemption`'s answer; ``result``: the job's result.

    Preempted: the provider says so, or a node was lost (watch), or a node's SSH connection dropped (its exit
    code is unknown: ``None``) before any rank exited non-zero on its own.  Everything else (a rank exited non-zero with a
    traceback, setup failed, the deadline) is the job's own end: not restarted."""
    if provider_word:
        return Verdict(True, f"the provider took a node back ({provider_word})")
    if lost is not None:
        return Verdict(True, getattr(lost, "message", None) or str(lost))
    if result is None or result.ok:
        return Verdict(False, "")
    codes = result.exit_codes or {}
    crashed = [r for r, c in codes.items() if c not in (None, 0)]
    gone = [r for r, c in codes.items() if c is None]
    # a node whose connection dropped first (the supervisor then stopped the others: their codes are ours)
    if gone and result.status == "failed" and (not crashed or result.failed_node in gone):
        return Verdict(True, result.reason or f"node {gone[0]} was lost (its SSH connection dropped)")
    return Verdict(False, result.reason or result.status)


def ranks_finished(recipe: "Recipe", run: "Run", result: "RunResult | None") -> str | None:
    """Why the job counts as done although its attempt ended with a lost node (None when it does not): every node
    exited 0 before the loss was noticed, or rank 0's log (``<run>/node0.log``) already holds every ``expect``
    line.  Such a job is never rented again: it finished its work, a new attempt would only repeat the end."""
    from broker.run.supervisor import check_expect

    codes = getattr(result, "exit_codes", None) or {}
    if getattr(result, "missing_expect", None):
        return None  # exited 0 without its expected output: not a finished job
    if codes and len(codes) >= int(getattr(recipe, "nodes", 1) or 1) and all(c == 0 for c in codes.values()):
        return "every node had exited 0"
    expect = list(getattr(recipe, "expect", None) or [])
    log = Path(run.run_dir or ".") / "node0.log"
    if expect and log.exists() and not check_expect(log, expect):
        return f"rank 0's log already held every expected line ({', '.join(repr(e) for e in expect)})"
    return None


def finished_result(recipe: "Recipe", run: "Run", result: "RunResult | None", why: str,
                    lost: str) -> "RunResult":
    """The succeeded result of a job whose ranks finished (:func:`ranks_finished` says ``why``) before node loss
    ``lost`` was noticed: built from the logs when the attempt returned none; what could not be collected from the
    lost node(s) (artifacts, a last checkpoint copy) is a warning."""
    from broker.run.supervisor import RunResult, finish_result

    run_dir = Path(run.run_dir or ".")
    n = int(getattr(recipe, "nodes", 1) or 1)
    if result is None:
        logs = {i: run_dir / f"node{i}.log" for i in range(n)}
        result = RunResult(status="succeeded", exit_codes={i: None for i in range(n)}, wall_s=0.0, log_paths=logs)
    result.status, result.failed_node, result.tail = "succeeded", None, []
    if result.log_paths.get(0) is not None:
        result = finish_result(result, list(getattr(recipe, "expect", None) or []), nnodes=n,
                               nproc_per_node=int(getattr(recipe, "gpus_per_node", 1) or 1))
    result.reason = f"the job finished ({why}) before a node was lost ({lost}): done, not rented again"
    if getattr(recipe, "artifacts", None) and result.exit_codes and None in result.exit_codes.values():
        result.warnings = [*result.warnings, "the lost node(s) could not be asked for the recipe's artifacts"]
    return result


def attempt_costs(ledger: Any, run_id: str) -> list[dict[str, Any]]:
    """Every attempt of ``run_id`` with its cost: the dicts of :meth:`Ledger.attempts` plus ``usd`` (what its
    resources cost, per :func:`broker.money.accounting.resource_cost`) and ``resources`` (``provider kind id``).
    The last attempt while it runs owns every resource no earlier attempt holds."""
    from broker.core.model import utcnow
    from broker.money.cost import spent_usd

    rows = ledger.attempts(run_id)
    if not rows:
        return []
    now = utcnow()
    by_id = {r.id: r for r in ledger.resources(run_id)}
    taken = {i for a in rows for i in a["resource_ids"]}
    for a in rows:
        ids = list(a["resource_ids"])
        if a["ended_at"] is None and a is rows[-1]:
            ids += [i for i in by_id if i not in taken]
        res = [by_id[i] for i in ids if i in by_id]
        a["usd"] = sum(spent_usd(r, now) for r in res)
        a["resources"] = [f"{r.provider} {r.kind} {r.provider_id or r.name}" for r in res]
    return rows


def attempt_lines(ledger: Any, run_id: str) -> list[str]:
    """One line per attempt for ``broker status RUN`` / ``broker cost`` (empty when the run kept no record)."""
    from broker.core.prose import usd_parts

    rows = attempt_costs(ledger, run_id)
    # the parts as printed add up to the total as printed (the same figures as the summary and `broker cost`)
    total, each = usd_parts(sum(a["usd"] for a in rows), [a["usd"] for a in rows])
    out = []
    for a, usd_text in zip(rows, each):
        end = a["ended_at"].strftime("%H:%M:%S") if a["ended_at"] else "running"
        cause = a["cause"] or "running"
        what = ", ".join(a["resources"]) or "no resources"
        out.append(f"attempt {a['attempt']}: {a['started_at'].strftime('%H:%M:%S')}-{end} {cause}"
                   + (f" ({a['detail']})" if a["detail"] and cause != "succeeded" else "")
                   + f"; {usd_text}; {what}")
    pre = sum(1 for a in rows if a["cause"] == "preempted")
    if pre:
        out.append(f"preemptions: {pre}; {len(rows)} attempt(s), {total} in all")
    return out


def keep_logs(run_dir: Path, n: int) -> None:
    """Move attempt ``n``'s node logs (``<run>/node<i>.log``) to ``<run>/attempt<n>/``: the next attempt writes
    its own, and what the preempted one printed stays readable."""
    import os

    from broker.core.private import private_dirs

    logs = sorted(run_dir.glob("node*.log"))
    if not logs:
        return
    dest = private_dirs(run_dir / f"attempt{n}")
    for p in logs:
        try:
            os.replace(p, dest / p.name)
        except OSError as e:
            _log.info("could not keep %s: %s", p, e)


def run_attempts(recipe: "Recipe", target: "Target", run: "Run", ctx: "Context",
                 attempt: Callable[[], "tuple[Cluster | None, RunResult]"],
                 release: Callable[[], list]) -> "tuple[Cluster | None, RunResult]":
    """Run ``attempt()`` (acquire + the executor steps; returns (cluster, result)) once, or, for a recipe with
    restarts (:func:`restarts_enabled`) on a target that can acquire again (``Target.restarts``), again after each
    preemption, up to ``max_restarts`` times: between two
    attempts ``release()`` tears down what is left (its return: resources still live; any = stop, loudly).
    Returns the last attempt's (cluster, result).  Raises what ``attempt`` raises for anything but a lost node;
    RestartsExhausted when the run was preempted ``max_restarts + 1`` times; NodeLost when a lost node cannot be
    replaced (restarts off, the clock ran out, teardown not confirmed)."""
    from broker.run.guard import NodeLost

    if not restarts_enabled(recipe) or not getattr(target, "restarts", True):
        try:
            cluster, result = attempt()
        except NodeLost as e:
            why = ranks_finished(recipe, run, None)
            if why is None:
                raise
            result = finished_result(recipe, run, None, why, getattr(e, "message", None) or str(e))
            ctx.say(result.reason)
            return None, result
        if not result.ok and (why := ranks_finished(recipe, run, result)) and classify(result, None, None).preempted:
            result = finished_result(recipe, run, result, why, result.reason or "its connection dropped")
            ctx.say(result.reason)
        return cluster, result
    ledger = ctx.ledger
    max_restarts = int(getattr(recipe, "max_restarts", 3) or 0)
    providers = getattr(target, "providers", None)
    while True:
        n = ledger.start_attempt(run.id, ctx.actor)
        result, cluster, lost = None, None, None
        try:
            cluster, result = attempt()
        except NodeLost as e:
            lost = e
        except BaseException as e:
            cause = "interrupted" if isinstance(e, KeyboardInterrupt) else "error"
            ledger.end_attempt(run.id, n, cause=cause, detail=str(getattr(e, "message", None) or e)[:500],
                               actor=ctx.actor)
            raise
        word = ended = None
        if lost is not None or (result is not None and not result.ok):
            ended = broker_ended(ctx, run)
            word = None if ended else provider_preemption(ctx, run, providers)
        if ended:
            # broker ended the node (the watchdog at the deadline, `broker down`): the job's end, never a
            # preemption, and nothing is rented again
            cur = ledger.get_run(run.id)
            cause = cur.status if cur is not None and cur.status in ("deadline", "interrupted") else "terminated"
            why = f"{ended}: not a preemption; nothing is rented again"
            ledger.end_attempt(run.id, n, cause=cause, detail=why[:500], actor=ctx.actor)
            ctx.say(f"attempt {n} ended: {why}")
            if result is None:
                raise NodeLost(why, hint=f"`broker status {run.id}` shows who ended it")
            result.reason = why + (f" ({result.reason})" if result.reason else "")
            return cluster, result
        v = classify(result, lost, word)
        done = ranks_finished(recipe, run, result) if v.preempted else None
        if done:
            # the ranks had finished before the loss was noticed: the job is done; renting again would re-run
            # its end (the last epoch) and bill for it
            result = finished_result(recipe, run, result, done, v.why)
            ledger.end_attempt(run.id, n, cause="succeeded", detail=result.reason[:500], actor=ctx.actor)
            ctx.say(f"attempt {n}: {result.reason}")
            return cluster, result
        if not v.preempted:
            ledger.end_attempt(run.id, n, cause=result.status if result is not None else "failed",
                               detail=(result.reason if result is not None else None), actor=ctx.actor)
            return cluster, result  # type: ignore[return-value]
        ledger.end_attempt(run.id, n, cause="preempted", detail=v.why[:500], actor=ctx.actor)
        ctx.say(f"attempt {n} preempted: {v.why}")
        if n > max_restarts:
            raise RestartsExhausted(
                f"run {run.id} was preempted {n} time(s); max_restarts: {max_restarts} allows no more: stopped",
                hint=f"`broker status {run.id}` lists the attempts; raise max_restarts in the recipe, or set "
                     "interruptible: false to rent on-demand capacity")
        from broker.run.guard import shielded

        with shielded(ctx.hooks.say):
            left = release()
        if left:
            raise NodeLost(f"attempt {n} was preempted and teardown left {len(left)} resource(s) live; not renting "
                           "again", hint=f"`broker down {run.id}` ends them")
        from broker.money.cost import run_clock

        secs, why = run_clock(ledger, ledger.get_run(run.id) or run)
        if secs < MIN_ATTEMPT_S:
            raise NodeLost(f"attempt {n} was preempted and only {max(0.0, secs):.0f} s are left on the run's {why}: "
                           "not renting again", hint=f"`broker status {run.id}` lists the attempts")
        keep_logs(Path(run.run_dir or "."), n)
        ck = getattr(recipe, "checkpoint_dir", None)
        from broker.run.checkpoint import latest_generation

        gen = latest_generation(Path(run.run_dir or "."))
        ctx.say(f"renting again: attempt {n + 1} of at most {max_restarts + 1}"
                + (f"; it resumes from checkpoint {gen.name}" if gen is not None else
                   "; no checkpoint copied yet: the job starts over" if ck else "; no checkpoint_dir: it starts over"))
