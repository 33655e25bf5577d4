"""The one run pipeline: every ``broker run`` goes through :func:`run_recipe` -> :func:`run_pipeline`, whatever the
provider.

::

    plan ─► confirm ─► acquire ─► reach ─► preflight ─► stage ─► launch + stream ─► collect ─► diagnose
         ─► release ─► record

* **plan** (:func:`broker.run.planstep.plan_for_run`): the pure planner over the providers' offers, quotas and
  capacity; the ranked valid options broker can act on pick a target (:mod:`broker.run.targets`).
* **confirm**: a paid target shows its :class:`~broker.run.runrecord.Quote` (option, $/hour, hard deadline, worst
  case) to ``Hooks.confirm`` before anything is created or recorded; free targets (local, netns, Slurm) never ask.
* **acquire / release** belong to the :class:`~broker.run.targets.Target` (what the provider supplies):
  :class:`~broker.run.targets.LocalTarget` (this machine: nothing), :class:`~broker.run.targets.NetnsTarget`
  (network namespaces with sshd), :class:`~broker.run.cloudtarget.CloudTarget` (ledger-first provisioning with
  failover, :mod:`broker.money.provision`; teardown or idle keep), :class:`~broker.slurm.target.SlurmTarget` (the
  partition's preconditions; the job itself is the executor's); nodes kept after a run: :mod:`broker.run.kept`.
* **reach .. collect** belong to the target's :class:`~broker.run.executor.Executor`: local processes
  (:class:`broker.run.launch.LocalExecutor`), SSH (:class:`broker.run.remote.SSHExecutor`) or Slurm
  (:class:`broker.slurm.executor.SlurmExecutor`), run in order by :func:`broker.run.executor.run_steps`.
* **record**: the run row (created before acquire, with ``recipe.json`` and ``plan.json`` in its folder) gets its
  status, exit codes, log paths and end event (:func:`broker.run.runrecord.end_run`), also after a failure or Ctrl-C.

Release is shielded: a Ctrl-C during teardown says that resources are still being released; a second one within
2 s abandons the teardown (the watchdog and ``broker down`` finish it: every resource is in the ledger).
"""

from __future__ import annotations

import logging
from dataclasses import replace as _dc_replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from broker.core.records import Cluster, Resource, Run
from broker.core.provider import BadInput, BrokerError, NoValidPlan
from broker.core.recipe import Recipe
# the contract the providers answer (re-exported: `from broker.run.pipeline import RunRequest, Target` works)
from broker.core.target import RunRequest, Target
# adapters by name through the registry (imported when asked): the run layer imports none
from broker.providers import REGISTRY, known, names_where, plugins, provider_class
from broker.run.runrecord import Context, Declined, Hooks, RunOutcome, Say, end_run, new_run
from broker.run.guard import shielded
from broker.run.targets import LocalTarget  # noqa: F401 - re-exported
from broker.run.cloudtarget import CloudHybridTarget, CloudTarget
from broker.run.planstep import plan_for_run

_log = logging.getLogger(__name__)


if TYPE_CHECKING:
    from broker.run.supervisor import RunResult
    from broker.money.ledger import Ledger


def _signal_name(e: BaseException) -> str:
    """"Ctrl-C" for a KeyboardInterrupt, else the signal's name (SIGTERM / SIGHUP: :class:`broker.core.errors.Terminated`)."""
    return getattr(e, "signame", None) or "Ctrl-C"


class _QuietWhenGone:
    """A console callable that stops printing once its terminal is gone (a closed terminal answers EIO; a closed
    pipe EPIPE): the teardown that follows a SIGHUP must not die on a progress line.  A wrapped echo that takes
    whole blocks of node output (``block(prefix, text)``, :data:`broker.core.ui.echo_line`) keeps taking them."""

    def __init__(self, fn: Callable[[str], None]):
        self._fn = fn
        self._gone = False
        if getattr(fn, "block", None) is not None:
            self.block = self._block

    def _guard(self, show: Callable[[], None], text: str) -> None:
        if self._gone:
            _log.info("%s", text)
            return
        try:
            show()
        except (OSError, ValueError, SystemExit):  # SystemExit: broker.core.errors.OutputClosed
            self._gone = True
            _log.info("%s", text)

    def __call__(self, msg: str) -> None:
        self._guard(lambda: self._fn(msg), msg)

    def _block(self, prefix: str, text: str) -> None:
        self._guard(lambda: self._fn.block(prefix, text), text)  # type: ignore[attr-defined]


def _quiet_when_gone(fn: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """``fn`` wrapped in :class:`_QuietWhenGone` (None stays None)."""
    return None if fn is None else _QuietWhenGone(fn)


def _charge_bandwidth(ctx: Context, run_id: str, ex: Any) -> None:
    """The bytes the executor moved (a checkpointing wrapper's copies plus its inner executor's staging and
    artifacts), billed at the run's per-GB rates (:func:`broker.money.cost.charge_transfer`); a ledger that cannot
    take the charge is logged, never a reason to fail the run (its teardown comes next)."""
    parts = [ex] + ([ex.inner] if getattr(ex, "inner", None) is not None else [])
    moved_in = sum(int(getattr(x, "bytes_in", 0) or 0) for x in parts)
    moved_out = sum(int(getattr(x, "bytes_out", 0) or 0) for x in parts)
    if moved_in <= 0 and moved_out <= 0:
        return
    try:
        from broker.money.cost import charge_transfer

        charge_transfer(ctx.ledger, run_id, moved_in, moved_out, actor=ctx.actor, say=ctx.say)
    except Exception as e:  # noqa: BLE001 - fail safe: the money record must not stop the teardown
        _log.warning("bandwidth charge of run %s not recorded: %s", run_id, e)


def run_pipeline(recipe: Recipe, target: Target, *, ledger: "Ledger", hooks: Hooks | None = None,
                 actor: str = "cli") -> RunOutcome:
    """Run ``recipe`` on ``target`` through every step (module docstring) and record it; returns the outcome.

    Raises Declined (exit 2) when a paid target is not confirmed (nothing created, no run recorded); raises what
    acquire raises (NoValidPlan, ProviderError...) *after* release ran and the run's end was recorded.  A failing
    job is not an exception: see ``RunOutcome.result``.
    """
    ctx, run = _confirm_and_start(recipe, target, ledger, hooks or Hooks(), actor)
    ledger, hooks = ctx.ledger, ctx.hooks
    result: RunResult | None = None
    cluster: Cluster | None = None
    status, message = "failed", None
    left: list[Resource] = []
    kept: list[Resource] = []
    keep = False

    def attempt() -> "tuple[Cluster | None, RunResult]":
        nonlocal cluster
        cluster = target.acquire(run, ctx)
        return cluster, _run_on(recipe, target, run, ctx, cluster)

    def release_between() -> list[Resource]:
        return target.release(run, ctx, keep=False)[0] if target.releases else []

    try:
        from broker.run.attempts import run_attempts

        # a preempted interruptible run is released, rented again and relaunched here (broker.run.attempts)
        cluster, result = run_attempts(recipe, target, run, ctx, attempt, release_between)
        result = diagnose(result, recipe, Path(run.run_dir or "."), local=target.runs_here)
        status, message = result.status, result.reason
        keep = target.keep(recipe, status)
    except KeyboardInterrupt as e:
        status, message = "interrupted", f"interrupted ({_signal_name(e)}) before the job finished"
        raise
    except BrokerError as e:
        message = e.message
        from broker.money.cost import ClockOut

        if isinstance(e, ClockOut):  # the run's clock ran out while provisioning: deadline / budget
            status = e.status
        raise
    except Exception as e:  # noqa: BLE001 - recorded, then re-raised after release
        message = str(e)
        raise
    finally:
        try:
            left, kept = _release(target, run, ctx, status=status, keep=keep)
        finally:
            message = _closing_message(recipe, run, ctx, message, left, kept, released=target.releases)
            # the run has ended: its CLI is no longer recorded (a pid outlives its process and is reused)
            updated = end_run(ledger, run.id, result, status=status, message=message, actor=actor, say=hooks.say,
                              pid=None, pid_start=None)
    from broker.money.cost import run_spent_usd

    return RunOutcome(updated, result, cluster, left, run_spent_usd(ledger, run.id), kept_until_idle=bool(kept),
                      kept=kept)


def _confirm_and_start(recipe: Recipe, target: Target, ledger: "Ledger", hooks: Hooks,
                       actor: str) -> "tuple[Context, Run]":
    """The steps before anything is acquired: the target's preconditions, a paid target's quote confirmed, what
    must outlive the CLI armed, the run row and its folder recorded, ``on_start`` told.  The ledger is wrapped so
    that a write it cannot take (locked, full disk) never stops a teardown (:mod:`broker.money.journal`).  Raises
    Declined when the quote is not confirmed (nothing created or recorded)."""
    from broker.money.journal import failsafe

    if hooks.say is not None or hooks.echo is not None:
        hooks = _dc_replace(hooks, say=_quiet_when_gone(hooks.say), echo=_quiet_when_gone(hooks.echo))
    # from here on, a ledger that cannot be written (locked, full disk) never stops a teardown: the writes after a
    # provider acted are kept, journalled and named at exit (broker.money.journal)
    ledger = failsafe(ledger, hooks.say)
    ctx = Context(ledger=ledger, hooks=hooks, actor=actor)
    target.check()
    quote = target.quote()
    _log.info("target: %s (%s, topology %s)", type(target).__name__, target.provider, target.topology)
    if quote is not None:
        _log.info("quote: $%.4f/h, worst case $%.2f", getattr(quote, "usd_per_hour", 0.0) or 0.0,
                  getattr(quote, "worst_case_usd", 0.0) or 0.0)
    if quote is not None and hooks.confirm is not None and not hooks.confirm(quote):
        raise Declined("not confirmed: nothing was created", hint="run again and answer y, or pass --yes")
    target.prepare(ctx)
    run = new_run(ledger, recipe, provider=target.provider, topology=target.topology, plan=target.plan_record())
    _log.info("run %s: %s on %s (%s), folder %s", run.id, recipe.name, target.provider, target.describe(), run.run_dir)
    ledger.event(run.id, actor, "start", f"{recipe.name}: {target.describe()}")
    if hooks.on_start:
        hooks.on_start(run, target.describe())
    return ctx, run


def _run_on(recipe: Recipe, target: Target, run: "Run", ctx: Context, cluster: Cluster | None) -> "RunResult":
    """The executor steps on the acquired ``cluster`` (reach .. collect, checkpoints copied back), with the target
    watching its nodes; the cluster is written for `broker ssh` / `broker exec` and the bytes moved are billed."""
    from broker.run.checkpoint import with_checkpoints
    from broker.run.executor import STEP_TEXT, run_steps

    if cluster is not None:  # for `broker ssh` / `broker exec` (paths and addresses only, no secret)
        from broker.core.private import write_private

        write_private(Path(run.run_dir or ".", "cluster.json"), cluster.model_dump_json(indent=2))
    ex = with_checkpoints(target.executor(recipe, run, cluster, ctx), recipe, Path(run.run_dir or "."), ctx.say)
    with target.watching(run, ctx):
        try:
            return run_steps(ex, (lambda step: ctx.say(STEP_TEXT[step])) if ctx.hooks.say else None)
        finally:
            _charge_bandwidth(ctx, run.id, ex)


def _release(target: Target, run: "Run", ctx: Context, *, status: str,
             keep: bool) -> "tuple[list[Resource], list[Resource]]":
    """The release step, shielded from a single Ctrl-C; returns (still live, kept)."""
    if not target.releases:
        return [], []
    _log.info("run %s: releasing (%s; keep: %s)", run.id, status, keep)
    with shielded(ctx.hooks.say):
        left, kept = target.release(run, ctx, keep=keep)
    _log.info("run %s: released; still live: %d, kept: %d", run.id, len(left), len(kept))
    return left, kept


def _closing_message(recipe: Recipe, run: "Run", ctx: Context, message: str | None, left: list[Resource],
                     kept: list[Resource], *, released: bool) -> str | None:
    """The run's end message with what release left: nodes kept for inspection (said now too), resources still
    live (with the ``broker down`` that ends them); the run's SSH Host entries go when its machines are gone."""
    if kept:
        message = ((message + "; ") if message else "") + (
            f"{len(kept)} node(s) kept for inspection: idle stop after {recipe.idle_minutes:g} min")
        ctx.say(f"keeping {len(kept)} node(s) for inspection: idle stop after {recipe.idle_minutes:g} min")
    if not kept and not left and released:  # its machines are gone: so are their Host entries
        from broker.core.sshconfig import forget_run_hosts

        forget_run_hosts(run.id)
    if left:
        message = ((message + "; ") if message else "") + "still live after teardown: " + ", ".join(
            f"{r.provider} {r.kind} {r.provider_id or r.name}" for r in left) + f" (run `broker down {run.id}`)"
    return message


def diagnose(result: "RunResult", recipe: Recipe, run_dir: Path, *, local: bool = False) -> "RunResult":
    """The diagnose step: for a failed run (or one whose ranks exited 0 but printed errors), the node and rank that
    failed first, that rank's own exception and the cause and fix from the catalogue (:func:`broker.run.diagnose.explain`,
    from the rank facts and the node logs); kept in ``result.diagnosis`` and written to ``<run>/diagnosis.txt``.
    Never raises: a diagnosis must not break the record of a run."""
    if result.ok and not result.error_lines and not getattr(result, "warnings", None):
        return result
    try:
        from broker.run.diagnose import explain

        result.diagnosis = explain(run_dir, result, recipe.nodes, local=local,
                                   script=getattr(recipe, "script", None)).lines()
    except Exception as e:  # noqa: BLE001
        result.diagnosis = [f"(no diagnosis: {type(e).__name__}: {e})"]
    if result.diagnosis:
        try:
            from broker.core.private import write_private

            write_private(run_dir / "diagnosis.txt", "\n".join(result.diagnosis) + "\n")
        except OSError:
            pass
    return result


#: providers ``broker run --provider`` accepts: every registered one
RUN_PROVIDERS = tuple(REGISTRY)


def check_options(recipe: Recipe, req: RunRequest) -> None:
    """Every provider option of ``req`` (``--inject``, ``--slurm-host``, ``--cluster``...) belongs to the chosen
    provider (its :attr:`~broker.core.provider.Provider.run_options`; the adapter checks the value when it builds its
    target).  Raises BadInput for one it does not take, naming the provider(s) that do: the one adapter that takes
    it words the error (:meth:`~broker.core.provider.Provider.misplaced_option`)."""
    for flag in req.options:
        if req.provider is not None and flag in provider_class(req.provider).run_options:
            continue
        takers = [n for n in (*RUN_PROVIDERS, *plugins()) if flag in provider_class(n).run_options]
        if len(takers) == 1:
            raise provider_class(takers[0]).misplaced_option(recipe, req, flag)
        if not takers:
            raise _unknown_option(flag)
        raise BadInput(f"{flag} works with " + " or ".join(
            f"--provider {n} ({provider_class(n).run_options[flag]})" for n in takers),
            hint="broker run RECIPE " + ", or ".join(f"--provider {n} {flag} ID" for n in takers))


def _unknown_option(flag: str) -> BadInput:
    """The error for an option no provider declares (``-o foo=bar``: ``--foo``), as the user typed it, with the
    options that exist and the providers that take them."""
    by_option: dict[str, list[str]] = {}
    for n in (*RUN_PROVIDERS, *plugins()):
        for f in provider_class(n).run_options:
            by_option.setdefault(f, []).append(n)
    name = flag.lstrip("-")
    known = ", ".join(f"-o {f.lstrip('-')}=VALUE ({' or '.join(ns)})" for f, ns in sorted(by_option.items()))
    return BadInput(f"-o {name}: no provider takes an option called {name!r}",
                    hint=f"the providers' options: {known}" if known else "no provider takes options")


def choose_target(recipe: Recipe, req: RunRequest, *, say: Say | None = None) -> Target:
    """The plan step: the :class:`Target` for ``recipe``.  Every provider hands its own
    (:meth:`broker.core.provider.Provider.run_target`): a named one first; rented clouds answer None and get the
    plan over them with :class:`CloudTarget` (failover down the ranked options); without ``--provider`` the plan
    picks, and the chosen option's provider is asked the same way (this machine when it can serve the job: free).
    Raises BadInput for an unknown provider or an option another provider takes."""
    p = req.provider
    if p is not None and p not in RUN_PROVIDERS and not known(p):  # a plug-in provider is looked up only now
        raise BadInput(f"--provider {p!r} is not a provider broker can run on",
                       hint=f"choose one of: {', '.join([*RUN_PROVIDERS, *plugins()])} (or leave it out to let the "
                       "plan decide)")
    topo = req.topology or recipe.topology
    _log.debug("choosing the target: provider %s, topology %s (%s)", p or "any (the plan decides)", topo,
               "--topology" if req.topology else "the recipe")
    check_options(recipe, req)
    if topo == "hybrid":
        _check_mesh(req.mesh)
    if p is not None:
        own = provider_class(p).run_target(recipe, req, say=say)
        if own is not None:
            return own
    if topo == "hybrid":
        return hybrid_target(recipe, req)
    plan, options = plan_for_run(recipe, p)
    first = options[0]
    _log.info("plan: %s on %s first, %d usable option(s) for failover", first.topology.value, first.provider,
              len(options))
    warn = recipe.chosen_interruptible_warning() if first.interruptible else None
    if warn and say:
        say(f"warning: {warn}")
    if first.provider != p:  # the plan chose among providers: the chosen one hands its target too
        own = provider_class(first.provider).run_target(
            recipe, _dc_replace(req, provider=first.provider, plan=plan), say=say)
        if own is not None:
            return own
    return CloudTarget(recipe, options, watchdog=req.watchdog)


def _check_mesh(mesh: str) -> None:
    from broker.run.hybrid import MESHES

    if mesh not in MESHES:
        raise BadInput(f"--mesh {mesh!r} is not a mesh", hint=f"choose one of: {', '.join(MESHES)}")


def hybrid_target(recipe: Recipe, req: RunRequest) -> Target:
    """The target of a ``hybrid`` run on rented VMs: this machine + the ranked hybrid options on the providers that
    can host them (:class:`CloudHybridTarget`, ``--mesh wireguard|tailscale``); a provider without /dev/net/tun
    is refused with that reason (exit 3).  (Providers that emulate it or refuse it say so from ``run_target``.)"""
    from broker.run.hybrid import TUN_PROVIDERS, why_not_hybrid

    p = req.provider
    _check_mesh(req.mesh)
    if p is not None and why_not_hybrid(p):
        emulated = names_where(lambda c: "hybrid" in c.topologies and not c.rents)
        raise NoValidPlan(f"no hybrid option on {p}: {why_not_hybrid(p)}",
                          hint=f"use --provider {' or '.join(TUN_PROVIDERS)}, or --provider "
                          f"{' or '.join(emulated)} to emulate it")
    if recipe.nodes < 2:
        raise BadInput("the hybrid topology needs at least 2 nodes (this machine + one VM)")
    plan, options = plan_for_run(recipe.model_copy(update={"topology": "hybrid"}), p)
    hybrid = [o for o in options if o.topology.value == "hybrid" and o.provider in TUN_PROVIDERS]
    if not hybrid:
        raise NoValidPlan(f"no valid hybrid option for {recipe.name}" + (f" on {p}" if p else ""),
                          hint="`broker plan --topology hybrid` shows why each was rejected")
    return CloudHybridTarget(recipe, hybrid, mesh=req.mesh, watchdog=req.watchdog)


def run_recipe(recipe: Recipe, req: RunRequest, *, ledger: "Ledger", hooks: Hooks | None = None) -> RunOutcome:
    """``broker run``: plan -> (confirm ->) acquire -> ... -> record, for every provider.  The one entry point."""
    hooks = hooks or Hooks()
    target = choose_target(recipe, req, say=hooks.say)
    return run_pipeline(recipe, target, ledger=ledger, hooks=hooks)
