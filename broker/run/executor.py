"""The executor contract: how the pipeline runs a job's commands on the nodes of one :class:`~broker.core.model.Cluster`.

Three executors implement it: local processes (:class:`broker.run.launch.LocalExecutor`: this machine's simulated
nodes and the ``fake`` cloud), SSH (:class:`broker.run.remote.SSHExecutor`: netns, rented VMs) and Slurm
(:class:`broker.slurm.executor.SlurmExecutor`: ``sbatch`` + ``srun``).  The pipeline (:func:`broker.run.pipeline.run_pipeline`)
calls the steps in this order through :func:`run_steps`:

``reach`` (wait until every node can really be used) -> ``preflight`` (network checks) -> ``stage`` (copy the work
folder, :mod:`broker.run.staging`) -> ``launch`` (setup, then one ``torchrun`` per node, logs streamed as ``[node i]``
until the job ends) -> ``collect`` (artifacts from every node) -> ``finish`` (expect check, rank table) and always
``close``.  A step that finds the job cannot go on returns a failed :class:`~broker.run.supervisor.RunResult` (nothing
started), which skips the remaining steps; steps raise only for Ctrl-C or bugs.

What an executor declares, on this contract (nothing is found out by probing its attributes):

* :meth:`Executor.steps`: the optional steps it runs (``reach``, ``preflight``: the ones its class overrides);
  :func:`run_steps` announces those, a wrapper passes its inner executor's on.
* :meth:`Executor.checkpoint_source`: how the recipe's ``checkpoint_dir`` is copied back from node 0 and put on
  every node of a later attempt (a :class:`broker.run.checkpoint.Source`), or :class:`NoCheckpoints` with the reason
  it cannot.  It is abstract and checked when a concrete executor class is defined: a new executor that does not
  say is a TypeError at import, never a run that silently loses its checkpoints.
"""

from __future__ import annotations

import logging
import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from broker.run.checkpoint import Source
    from broker.run.supervisor import RunResult
    from broker.run.staging import StagePlan

_log = logging.getLogger(__name__)

Say = Callable[[str], None] | None

#: progress line per step
STEP_TEXT = {"reach": "waiting until every node accepts commands", "preflight": "preflight: network checks",
             "stage": "staging the work folder on every node", "launch": "launching one torchrun per node",
             "collect": "collecting artifacts"}


#: the steps an executor may leave out (the base's do nothing); stage, launch and finish every executor has
OPTIONAL_STEPS = ("reach", "preflight")


@dataclass(frozen=True)
class NoCheckpoints:
    """An executor's answer to :meth:`Executor.checkpoint_source` when it cannot copy a checkpoint back: why, in
    words a user reads (the run says it and goes on without checkpoints)."""

    reason: str


class Executor(ABC):
    """Runs the job on the nodes of one cluster.  Subclasses override the steps they need and declare
    :meth:`checkpoint_source` (a concrete subclass that does not is a TypeError when it is defined).

    ``bytes_in`` / ``bytes_out``: bytes this executor sent to the nodes (the staged folder, once per node) and
    fetched from them (artifacts), for providers that bill bandwidth per GB; 0 where nothing crosses a network."""

    bytes_in: int = 0
    bytes_out: int = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        runs = not any(getattr(getattr(cls, m), "__isabstractmethod__", False) for m in ("stage", "launch", "finish"))
        if runs and getattr(cls.checkpoint_source, "__isabstractmethod__", False):
            raise TypeError(f"executor {cls.__module__}.{cls.__qualname__} does not declare "
                            "checkpoint_source(rel_dir): return the broker.run.checkpoint.Source of node 0's folder "
                            "(copy-back and restore), or NoCheckpoints('why not'); without it a recipe's "
                            "checkpoint_dir would be silently lost")

    def steps(self) -> tuple[str, ...]:
        """The optional steps (:data:`OPTIONAL_STEPS`) this executor runs, in order: those its class overrides.  A
        wrapper returns its inner executor's."""
        return tuple(s for s in OPTIONAL_STEPS if getattr(type(self), s) is not getattr(Executor, s))

    @abstractmethod
    def checkpoint_source(self, rel_dir: str) -> "Source | NoCheckpoints":
        """Node 0's ``rel_dir`` (the recipe's ``checkpoint_dir``, relative to the work folder) as a
        :class:`broker.run.checkpoint.Source`: listed and fetched for the copy-back while the job runs, and its
        ``restore`` puts a generation on every node of a later attempt (where it cannot, it raises CopyFailed).
        Called once, before the steps; the source may read the node folders only once ``stage`` made them.
        :class:`NoCheckpoints` (with the reason) where the executor cannot reach that folder.  Raises nothing."""

    def reach(self) -> "RunResult | None":
        """Wait until every node accepts commands (SSH connect + auth with retries, boot scripts done)."""
        return None

    def preflight(self) -> "RunResult | None":
        """Check the network between the nodes (master port, an ephemeral port, interfaces, versions)."""
        return None

    @abstractmethod
    def stage(self) -> "RunResult | None":
        """Put a fresh copy of the staged work folder and the node environment on every node."""

    @abstractmethod
    def launch(self) -> "RunResult":
        """Run the setup commands, then one ``torchrun`` per node; stream logs; return when the job has ended."""

    def collect(self, result: "RunResult") -> None:
        """Fetch the recipe's ``artifacts`` from every node into ``<run>/artifacts/node<i>/``."""

    def collects(self) -> bool:
        """Whether :meth:`collect` has anything to do (the recipe lists artifacts)."""
        return False

    @abstractmethod
    def finish(self, result: "RunResult") -> "RunResult":
        """Complete the result: the expect check on rank 0's log, the rank table, the failing node's log tail."""

    def close(self, job_ended: bool) -> None:
        """Release connections; ``job_ended``: the job ran to an end (not Ctrl-C), so node-side idle timers may
        start counting."""


def run_steps(ex: Executor, say: Say = None) -> "RunResult":
    """Run ``ex``'s steps in order (see the module docstring) and return the finished result.  ``say`` gets one
    progress line per step.  Ctrl-C propagates after ``close(job_ended=False)``."""
    from broker.run.guard import check_node_lost

    ended = False
    kind = type(ex).__name__
    try:
        for step in ("reach", "preflight", "stage"):
            check_node_lost()  # a node lost since the last step: no point in the next one
            if step == "stage" or step in ex.steps():  # only steps this executor declares
                _log.info("step %s (%s)", step, kind)
                if say:
                    say(step)
            res = getattr(ex, step)()
            if res is not None:
                _log.info("step %s ended the run: %s", step, getattr(res, "reason", None) or getattr(res, "status", ""))
                ended = True
                return ex.finish(res)
        check_node_lost()
        _log.info("step launch (%s)", kind)
        if say:
            say("launch")
        res = ex.launch()
        _log.info("job ended: %s%s", getattr(res, "status", "?"),
                  f" ({res.reason})" if getattr(res, "reason", None) else "")
        if ex.collects():
            _log.info("step collect (%s)", kind)
            if say:
                say("collect")
        ex.collect(res)
        ended = True
        return ex.finish(res)
    finally:
        _log.debug("closing the %s (job ended: %s)", kind, ended)
        ex.close(ended)


#: the file in a run's folder that lists what was staged and what was not copied (and by which rule)
STAGED_LIST = "staged.txt"


def not_copied(plan: "StagePlan") -> list[str]:
    """Every entry of ``plan.root`` that is not copied to the nodes, as the ``/``-separated path it would have on a
    node (relative to the root; a folder ``name/`` stands for its content), sorted: the walk's own record
    (:attr:`broker.run.staging.StagePlan.excluded`), so a file staged through a folder link is never also "not copied"
    and every entry has its rule."""
    return sorted(plan.excluded)


def staging_line(plan: "StagePlan", run_dir: Path | None) -> str:
    """The one staging line for the screen, and the full lists in ``<run_dir>/staged.txt`` (:data:`STAGED_LIST`).

    The screen keeps :meth:`broker.run.staging.StagePlan.summary`'s short form (its "not copied" list stops after six
    names) and says where the whole list is; ``-v`` logs the size per node and the whole "not copied" list.
    ``run_dir`` None (or a folder that cannot be written): the short form only.  Never raises for I/O."""
    skipped = not_copied(plan)
    _log.info("staging %d file(s), %s (%d bytes) per node from %s", len(plan.files), plan.size_text(),
              plan.total_bytes, plan.root)
    if skipped:
        _log.info("not copied to the nodes (%d): %s", len(skipped), ", ".join(skipped))
    line = plan.summary() + (" (large: add a .brokerignore)" if plan.too_big else "")
    if run_dir is None:
        return line
    out = Path(run_dir) / STAGED_LIST
    text = [f"# staged from {plan.root}: {len(plan.files)} file(s), {plan.size_text()} per node"]
    text += [Path(f).as_posix() for f in plan.files]
    text += ["", f"# not copied ({len(skipped)})"] + skipped
    by_rule: dict[str, list[str]] = {}
    for name in skipped:
        by_rule.setdefault(plan.excluded[name], []).append(name)
    text += ["", "# why (rule: every entry above)"] + [f"{rule}: {', '.join(names)}"
                                                      for rule, names in sorted(by_rule.items())]
    try:
        from broker.core.private import private_dirs, write_private

        private_dirs(out.parent)
        write_private(out, "\n".join(text) + "\n")
    except OSError as e:
        _log.warning("cannot write %s: %s", out, e)
        return line
    return f"{line}; full list: {out}"


def describe_exit(code: int | None) -> str:
    """A process exit code in words: ``'1'``, or ``'-9 (SIGKILL)'`` for a signal (a negative code, as
    :mod:`subprocess` reports one); ``None`` = still running.  Here, under both the local executor and the diagnose
    step that names a failing rank's code."""
    if code is None:
        return "none (still running)"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)
