"""The pipeline's target for a Slurm cluster (:class:`SlurmTarget`): what ``broker run --provider slurm`` acquires
(nothing: the partition is checked) and which executor runs the job (:class:`broker.slurm.executor.SlurmExecutor`).

The Slurm adapter hands it to the pipeline (:meth:`broker.providers.slurm.SlurmProvider.run_target`), so the run
layer never imports the Slurm layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.core.recipe import Recipe
from broker.core.records import Cluster, Run
from broker.providers import get_provider
from broker.run.runrecord import Context
from broker.core.target import Target

if TYPE_CHECKING:
    from broker.run.executor import Executor
    from broker.core.target import RunRequest
    from broker.slurm.executor import SlurmOptions


class SlurmTarget(Target):
    """A Slurm cluster broker does not own (here or through ``options.host``): acquire checks the partition; the
    job is the executor's (:class:`broker.slurm.executor.SlurmExecutor`), the cluster's own accounting applies ($0 here)."""

    provider, topology = "slurm", "slurm"
    #: a Slurm job is submitted once: broker does not resubmit one the cluster preempted (its own requeue may)
    restarts = False

    def __init__(self, recipe: Recipe, options: "SlurmOptions", *, provider: Any = None):
        self.recipe, self.opts = recipe, options
        if provider is None and options.cluster:  # a cluster from `broker slurm up`: commands run on its node 0
            from broker.slurm.cluster import attach

            provider = attach(options)
        self.prov = provider or get_provider("slurm", host=options.host)  # the adapter through the registry
        self.gpus = False

    def check(self) -> None:
        """Raises BadInput for ``interruptible: true`` (nothing here rents interruptible capacity or restarts a
        job), NoValidPlan / BadInput from :func:`broker.slurm.executor.slurm_preconditions`."""
        from broker.slurm.executor import slurm_preconditions

        if self.recipe.interruptible == "true":
            from broker.core.provider import BadInput

            flag = getattr(self.recipe, "_interruptible_flag", None)
            said = self.recipe.where("interruptible") + ("" if flag else ": true")
            raise BadInput(f"{said} asks for interruptible capacity, which a Slurm cluster does not rent, and "
                           "broker does not resubmit a Slurm job after a preemption",
                           hint=("pass --interruptible false (or auto)" if flag else
                                 "set interruptible: false (or auto) in the recipe, or pass --interruptible false")
                           + " to run it on Slurm; checkpoint_dir: is still copied back every checkpoint_every_s")

        self.gpus = slurm_preconditions(self.recipe, self.prov, self.opts)

    def plan_record(self) -> dict[str, Any]:
        o = self.opts
        return {**super().plan_record(), "host": o.host, "partition": o.partition, "account": o.account,
                "gpus": self.gpus}

    def describe(self) -> str:
        return (f"topology slurm (Slurm {self.prov.shell.where}, "
                f"{'GPUs' if self.gpus else 'no GPU: gloo on CPU (cpu_ok)'})")

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.slurm.executor import SlurmExecutor

        return SlurmExecutor(recipe, self.prov, self.opts, run=run, ledger=ctx.ledger, gpus=self.gpus,
                             echo=ctx.hooks.echo)


def target_for(recipe: Recipe, request: "RunRequest") -> SlurmTarget:
    """The target of ``broker run --provider slurm``: the request's Slurm options (``--slurm-host``, ``--cluster``)
    over the settings' defaults (``BROKER_SLURM_HOST``, ``_PARTITION``, ``_ACCOUNT``, ``_PYTHON``).  Raises
    BadInput for ``--topology hybrid`` (a Slurm partition is not one end of a tunnel)."""
    from broker.core.config import settings
    from broker.run.planstep import no_hybrid_here
    from broker.slurm.executor import SlurmOptions

    if (request.topology or recipe.topology) == "hybrid":
        raise no_hybrid_here("slurm")
    s = settings()
    return SlurmTarget(recipe, SlurmOptions(host=request.option("--slurm-host") or s.broker_slurm_host,
                                            partition=s.broker_slurm_partition, account=s.broker_slurm_account,
                                            python=s.broker_slurm_python, cluster=request.option("--cluster")))
