"""What a provider hands the run pipeline: the :class:`Target` contract (where a run's nodes come from) and the
:class:`RunRequest` (how ``broker run`` was asked), beside the adapter contract that names them
(:meth:`broker.core.provider.Provider.run_target`).

Every provider answers ``run_target``: rented clouds with the pipeline's default (planned, ledger-first
provisioning: :class:`broker.run.cloudtarget.CloudTarget`), the others with their own target (this machine:
``broker.providers.local``; network namespaces: ``broker.providers.netns.target``; a Slurm partition:
:mod:`broker.slurm.target`).  A provider's own ``broker run`` options travel in :attr:`RunRequest.options`, keyed by
their flag, and are checked by the adapter that declares them (:attr:`broker.core.provider.Provider.run_options`).

The values the pipeline passes a target (its :class:`RunContext`, a quote, an executor) are described here as
protocols: the run layer implements them (:mod:`broker.run.runrecord`, :mod:`broker.run.executor`), and this module
imports nothing above the core.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from broker.core.recipe import Recipe
    from broker.core.records import Cluster, Resource, Run


class RunContext(Protocol):
    """What a target's steps get from the pipeline (:class:`broker.run.runrecord.Context`): the ``ledger``
    (:class:`broker.money.ledger.Ledger`), the caller's ``hooks`` (``echo``, ``say``, ``on_start``, ``confirm``),
    the ``actor`` written into ledger events, and ``say`` for progress lines."""

    ledger: Any
    hooks: Any
    actor: str

    def say(self, msg: str) -> None: ...


class PriceQuote(Protocol):
    """A paid target's price (:class:`broker.run.runrecord.Quote`): $/hour, hard deadline, worst case."""

    usd_per_hour: float
    worst_case_usd: float

    def lines(self) -> list[str]: ...


class Target(ABC):
    """Where a run's nodes come from: the provider side of the pipeline (acquire / release) and the executor that
    runs the job on them.  A provider hands one over from :meth:`broker.core.provider.Provider.run_target`; a
    rented cloud gets the pipeline's default by implementing the :class:`broker.core.provider.Provider` lifecycle
    verbs."""

    provider: str = "?"
    topology: str = "?"
    #: a lost node can be replaced by acquiring again (:mod:`broker.run.attempts`); False: the job runs once
    restarts: bool = True
    #: the job's processes run on this machine, outside any emulated host (the diagnosis then reads this
    #: machine's facts)
    runs_here: bool = False

    def check(self) -> None:
        """Preconditions that must hold before anything is recorded (raise BadInput / NoValidPlan / ProviderError)."""

    def quote(self) -> "PriceQuote | None":
        """A paid target's price, shown for confirmation; None = free."""
        return None

    def prepare(self, ctx: RunContext) -> None:
        """After confirmation, before the run row: arm what must outlive the CLI (the watchdog)."""

    def plan_record(self) -> dict[str, Any]:
        """What goes into the run's ``plan.json`` and ledger row."""
        return {"provider": self.provider, "topology": self.topology, "usd_per_hour": 0.0}

    @abstractmethod
    def describe(self) -> str:
        """One line for the run header: devices, nodes, prices."""

    def acquire(self, run: "Run", ctx: RunContext) -> "Cluster | None":
        """Make the nodes exist (ledger-first); returns the cluster (None: this machine's processes)."""
        return None

    @abstractmethod
    def executor(self, recipe: "Recipe", run: "Run", cluster: "Cluster | None", ctx: RunContext) -> Any:
        """The executor for the acquired nodes (a :class:`broker.run.executor.Executor`: reach, preflight,
        stage, launch, collect)."""

    def keep(self, recipe: "Recipe", status: str) -> bool:
        """Whether the nodes of a job that ended with ``status`` are kept (recipe ``idle_minutes``)."""
        return False

    def release(self, run: "Run", ctx: RunContext, *, keep: bool) -> "tuple[list[Resource], list[Resource]]":
        """Tear down what acquire made, or keep it (``keep``); returns (still live after teardown, kept)."""
        return [], []

    def watching(self, run: "Run", ctx: RunContext) -> "contextlib.AbstractContextManager[None]":
        """A context held while the job runs (cloud targets watch their nodes there); nothing by default."""
        return contextlib.nullcontext()

    @property
    def releases(self) -> bool:
        """Whether release has anything to do (a Ctrl-C during it is shielded)."""
        return False

    def kept_from(self) -> str | None:
        """The run whose kept nodes this target runs on (``broker exec``, ``--cluster`` of an emulation); None:
        nodes of its own."""
        return None


@dataclass
class RunRequest:
    """How ``broker run`` was asked.

    ``provider``: None = the plan decides.  ``options``: the provider's own options, keyed by their flag
    (``{"--inject": "mtu"}``, ``{"--slurm-host": "user@login"}``); the adapter that declares a flag in its
    :attr:`~broker.core.provider.Provider.run_options` checks its value, any other provider refuses it with the
    provider that takes it.  ``watchdog``: False = ``--no-watchdog`` (rented runs then rest on the CLI and the
    node-side switch).  ``topology``: None = the recipe's (``hybrid``: this machine + VMs over a tunnel).
    ``mesh``: hybrid only, ``wireguard`` (a per-run tunnel) or ``tailscale`` (an existing tailnet).  ``plan``: set
    by the pipeline when the planner chose this provider among several (the :class:`broker.core.model.Plan`), so
    its target can say why it was chosen.
    """

    provider: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    watchdog: bool = True
    topology: str | None = None
    mesh: str = "wireguard"
    plan: Any = None

    def option(self, flag: str) -> str | None:
        """The value given for ``flag`` (``"--inject"``), None when it was not given."""
        return self.options.get(flag)

