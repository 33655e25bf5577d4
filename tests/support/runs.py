"""Whole-run entry points the tests drive directly (production goes through :func:`broker.run.pipeline.run_recipe`):
one :class:`~broker.run.executor.Executor` run through :func:`broker.run.executor.run_steps`, or a Slurm recipe
through the pipeline without the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from broker.core.records import Cluster
from broker.core.recipe import Recipe
from broker.run.executor import run_steps
from broker.run.launch import LocalExecutor, LocalLaunchSpec
from broker.run.remote import RemoteRunResult, SSHExecutor
from broker.run.sshcluster import Echo
from broker.run.supervisor import RunResult
from broker.slurm.executor import SlurmOptions


def run_local(spec: LocalLaunchSpec, run_dir: Path, *, echo: Callable[[str], None] | None = print) -> RunResult:
    """Run the job as ``spec.nnodes`` simulated nodes on this machine (:class:`LocalExecutor` through
    :func:`broker.run.executor.run_steps`); returns the result (never raises for a failing job)."""
    return run_steps(LocalExecutor(spec, run_dir, echo=echo))


def run_remote(cluster: Cluster, recipe: Recipe, run_dir: Path, *, echo: Echo = print, port: int | None = None,
               preflight: bool = True, connect_timeout_s: float = 20.0,
               ready_timeout_s: float = 0.0) -> RemoteRunResult:
    """Run ``recipe`` on ``cluster``'s nodes over SSH (:class:`SSHExecutor` through
    :func:`broker.run.executor.run_steps`); returns the result (never raises for a failing job)."""
    ex = SSHExecutor(cluster, recipe, run_dir, echo=echo, port=port, preflight=preflight,
                     connect_timeout_s=connect_timeout_s, ready_timeout_s=ready_timeout_s)
    return run_steps(ex)  # type: ignore[return-value]

def run_recipe_slurm(recipe: Recipe, *, ledger, echo: Callable[[str], None] | None,
                     options: SlurmOptions | None = None, provider=None,
                     on_start: Callable[[object, str], None] | None = None):
    """Submit ``recipe`` to Slurm, follow it to the end and record it in the ledger; returns (Run, RunResult).
    Runs through the one pipeline (:func:`broker.run.pipeline.run_pipeline` with a
    :class:`broker.slurm.target.SlurmTarget`)."""
    from broker.run.runrecord import Hooks
    from broker.slurm.target import SlurmTarget
    from broker.run.pipeline import run_pipeline

    target = SlurmTarget(recipe, options or SlurmOptions(), provider=provider)
    out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks(echo=echo, on_start=on_start))
    return out.run, out.result



class DeadlineNow:
    """Brings a run's wall-clock deadline forward: installed with ``monkeypatch``, the clock the deadline is measured
    with (``module``'s ``time`` module under the name ``attr``: by default :mod:`broker.run.supervisor`'s ``time``;
    the Slurm executor's is ``time_mod``) runs as the real one until :meth:`now` / :meth:`after` fires, then jumps
    ``jump_s`` ahead, so the next tick finds the deadline passed.  A test that needs a run to reach its deadline at
    a given point (the hang reached, a report made) then waits for that event, not for a deadline long enough for a
    loaded machine's start-up.  Everything else (the stall watch's own clock, the nodes) keeps real time.
    """

    def __init__(self, monkeypatch, module=None, attr: str = "time", jump_s: float = 100_000.0):
        import time as real_time

        if module is None:
            from broker.run import supervisor as module

        self._time = real_time
        self._jump_s = jump_s
        self.offset = 0.0
        self.fired_at: float | None = None
        self._armed = False
        clock = self

        class _Time:
            def __getattr__(self, name):
                return getattr(real_time, name)

            @staticmethod
            def monotonic() -> float:
                return real_time.monotonic() + clock.offset

        monkeypatch.setattr(module, attr, _Time())

    def now(self) -> None:
        """The deadline passes at the supervisor's next tick."""
        if self.fired_at is None:
            self.fired_at = self._time.monotonic()
            self.offset = self._jump_s

    def after(self, delay_s: float) -> None:
        """The deadline passes ``delay_s`` seconds from now (a timer thread; the caller, often an echo, returns).
        Only the first call counts."""
        import threading

        if self._armed:
            return
        self._armed = True
        t = threading.Timer(delay_s, self.now)
        t.daemon = True
        t.start()
