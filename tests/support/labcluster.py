"""A pretend provider that exists only in the tests: a lab cluster whose "hosts" are this machine's processes.

It follows docs/architecture.md, "Adding a provider", for a provider whose nodes are not rented VMs, with no edit
to broker/: a :class:`~broker.core.provider.Provider` subclass that declares its capabilities and its own
``broker run`` option (``--lab-queue``), and hands the pipeline its own :class:`~broker.core.target.Target` from
``run_target``.  It is installed through the ``broker.providers`` entry point group (the test writes a
``dist-info`` with that entry point), the way a package outside broker adds a provider.

The lab's bookkeeping is a reservation file per run (``<run dir>/lab-reservation.json``): written by ``acquire``
before any node starts, removed by ``release``; a queue name outside :data:`QUEUES` is refused by ``run_target``
(the adapter checks its own option).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from broker.core.model import Offer, Requirements
from broker.core.provider import BadInput, NoValidPlan, Provider, ProviderCheck
from broker.core.target import RunRequest, Target

#: the lab's queues (its only option)
QUEUES = ("short", "long")


class LabTarget(Target):
    """N "hosts" of the lab = N process groups on this machine, gloo on CPU; free."""

    provider, topology = "lab", "multi-node"
    restarts = False
    runs_here = True

    def __init__(self, recipe: Any, queue: str):
        self.recipe, self.queue = recipe, queue

    def check(self) -> None:
        if self.recipe.gpus_per_node and not self.recipe.cpu_ok:
            raise NoValidPlan(f"the lab has no GPUs and {self.recipe.name} needs them", hint="set cpu_ok: true")

    def describe(self) -> str:
        return f"topology multi-node on the lab's {self.queue} queue ({self.recipe.nodes} hosts, free)"

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "queue": self.queue}

    def acquire(self, run: Any, ctx: Any) -> None:
        path = Path(run.run_dir) / "lab-reservation.json"
        path.write_text(json.dumps({"run": run.id, "queue": self.queue, "hosts": self.recipe.nodes}))
        ctx.say(f"lab: reserved {self.recipe.nodes} host(s) on queue {self.queue}")
        return None

    def executor(self, recipe: Any, run: Any, cluster: Any, ctx: Any) -> Any:
        from broker.run.launch import LocalExecutor, LocalLaunchSpec

        r = recipe
        spec = LocalLaunchSpec(script_rel=str(r.script.relative_to(r.workdir)), args=list(r.args), workdir=r.workdir,
                               nnodes=r.nodes, nproc_per_node=max(1, r.gpus_per_node), env=dict(r.env),
                               node_envs=[{"CUDA_VISIBLE_DEVICES": "", "LAB_HOST": f"lab{i}"} for i in range(r.nodes)],
                               setup=list(r.setup), expect=list(r.expect), deadline_s=r.max_hours * 3600,
                               artifacts=list(r.artifacts))
        return LocalExecutor(spec, Path(run.run_dir), echo=ctx.hooks.echo, say=ctx.hooks.say)

    @property
    def releases(self) -> bool:
        return True

    def release(self, run: Any, ctx: Any, *, keep: bool) -> tuple[list, list]:
        (Path(run.run_dir) / "lab-reservation.json").unlink(missing_ok=True)
        ctx.say("lab: reservation released")
        return [], []


class LabProvider(Provider):
    """The pretend lab cluster (module docstring)."""

    name = "lab"
    topologies = ("multi-node",)
    rents = False
    planned_by_default = False
    setup_allowance_s = 0
    local_exec = True
    run_options = {"--lab-queue": "the lab's queue to run on"}

    def check(self) -> ProviderCheck:
        return ProviderCheck(provider=self.name, configured=True, usable=True, detail=f"{os.cpu_count()} CPU(s)")

    def offers(self, req: Requirements) -> list[Offer]:
        return []

    @classmethod
    def run_target(cls, recipe: Any, request: RunRequest, *, say: Any = None) -> Target:
        queue = request.option("--lab-queue") or "short"
        if queue not in QUEUES:
            raise BadInput(f"--lab-queue {queue!r} is not a queue of the lab", hint=f"choose one of: {', '.join(QUEUES)}")
        return LabTarget(recipe, queue)
