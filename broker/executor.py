"""The executor contract: how the pipeline runs a job's commands on the nodes of one :class:`~broker.model.Cluster`.

Three executors implement it: local processes (:class:`broker.launch.LocalExecutor`: this machine's simulated
nodes and the ``fake`` cloud), SSH (:class:`broker.remote.SSHExecutor`: netns, rented VMs) and Slurm
(:class:`broker.slurm.SlurmExecutor`: ``sbatch`` + ``srun``).  The pipeline (:func:`broker.pipeline.run_pipeline`)
calls the steps in this order through :func:`run_steps`:

``reach`` (wait until every node can really be used) -> ``preflight`` (network checks) -> ``stage`` (copy the work
folder, :mod:`broker.staging`) -> ``launch`` (setup, then one ``torchrun`` per node, logs streamed as ``[node i]``
until the job ends) -> ``collect`` (artifacts from every node) -> ``finish`` (expect check, rank table) and always
``close``.  A step that finds the job cannot go on returns a failed :class:`~broker.launch.RunResult` (nothing
started), which skips the remaining steps; steps raise only for Ctrl-C or bugs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from broker.launch import RunResult

Say = Callable[[str], None] | None

#: the step names, in order (progress lines and the ledger's events use them)
STEPS = ("reach", "preflight", "stage", "launch", "collect")
#: progress line per step
STEP_TEXT = {"reach": "waiting until every node accepts commands", "preflight": "preflight: network checks",
             "stage": "staging the work folder on every node", "launch": "launching one torchrun per node",
             "collect": "collecting artifacts"}


class Executor(ABC):
    """Runs the job on the nodes of one cluster.  Subclasses override the steps they need."""

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
    ended = False
    try:
        for step in ("reach", "preflight", "stage"):
            if say and getattr(type(ex), step) is not getattr(Executor, step):  # only steps this executor has
                say(step)
            res = getattr(ex, step)()
            if res is not None:
                ended = True
                return ex.finish(res)
        if say:
            say("launch")
        res = ex.launch()
        if say and ex.collects():
            say("collect")
        ex.collect(res)
        ended = True
        return ex.finish(res)
    finally:
        ex.close(ended)
