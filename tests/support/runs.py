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

