"""The one run pipeline: every ``broker run`` goes through :func:`run_recipe` -> :func:`run_pipeline`, whatever the
provider.

::

    plan ─► confirm ─► acquire ─► reach ─► preflight ─► stage ─► launch + stream ─► collect ─► diagnose
         ─► release ─► record

* **plan** (:func:`plan_for_run`): the pure planner over the providers' offers, quotas and capacity; the ranked
  valid options broker can act on pick a :class:`Target`.
* **confirm**: a paid target shows its :class:`Quote` (option, $/hour, hard deadline, worst case) to
  ``Hooks.confirm`` before anything is created or recorded; free targets (local, netns, Slurm) never ask.
* **acquire / release** belong to the :class:`Target` (what the provider supplies): :class:`LocalTarget` (this
  machine: nothing), :class:`NetnsTarget` (network namespaces with sshd), :class:`CloudTarget` (ledger-first
  provisioning with failover, :mod:`broker.money.provision`; teardown or idle keep), :class:`broker.slurm.target.SlurmTarget` (the
  partition's preconditions; the job itself is the executor's).
* **reach .. collect** belong to the target's :class:`~broker.run.executor.Executor`: local processes
  (:class:`broker.run.launch.LocalExecutor`), SSH (:class:`broker.run.remote.SSHExecutor`) or Slurm
  (:class:`broker.slurm.executor.SlurmExecutor`), run in order by :func:`broker.run.executor.run_steps`.
* **record**: the run row (created before acquire, with ``recipe.json`` and ``plan.json`` in its folder) gets its
  status, exit codes, log paths and end event (:func:`end_run`), also after a failure or Ctrl-C.

Release is shielded: a Ctrl-C during teardown says that resources are still being released; a second one within
2 s abandons the teardown (the watchdog and ``broker down`` finish it: every resource is in the ledger).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass, field, replace as _dc_replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from broker.core.model import Plan, PlanOption, Requirements, to_json, utcnow
from broker.core.records import Cluster, Resource, Run
from broker.core.provider import AuthError, BadInput, BrokerError, NoValidPlan, Provider, ProviderError
from broker.core.recipe import Recipe
# adapters by name through the registry (imported when asked): the run layer imports none
from broker.providers import REGISTRY, adapter_module, capability, provider_class

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from broker.run.executor import Executor
    from broker.run.launch import LocalLaunchSpec, RunResult
    from broker.money.ledger import Ledger
    from broker.slurm.executor import SlurmOptions

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
        budget = f" of budget ${self.budget_usd:.2f}" if self.budget_usd is not None else ""
        more = (f"; on failure, up to {self.failover_options - 1} other ranked option(s) within the same budget"
                if self.failover_options > 1 else "")
        return [f"chosen: {self.summary}",
                f"price: ${self.usd_per_hour:.2f}/hour; hard deadline {self.deadline_hours:g} h; worst case "
                f"${self.worst_case_usd:.2f}{budget}{more}"]


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

    run_id = utcnow().strftime("%Y%m%d-%H%M%S-") + new_id()[:6]
    from broker.core.private import private_dir, write_private

    run_dir = private_dir(runs_dir() / run_id)  # 0700; its files 0600 from their creation
    now = utcnow()
    recipe_data = recipe.model_dump(mode="json")  # secrets: names only; secret-looking env values masked
    write_private(run_dir / "recipe.json", json.dumps(recipe_data, indent=2))
    if plan is not None:
        write_private(run_dir / "plan.json", json.dumps(plan, indent=2, default=str))
    _reserve_space(ledger)
    run = Run(id=run_id, name=recipe.name, recipe_path=str(recipe.path) if recipe.path else None,
              recipe=recipe_data, plan=plan, provider=provider, topology=topology, status="running",
              created_at=now, started_at=now, deadline=now + timedelta(hours=recipe.max_hours),
              budget_usd=recipe.budget_usd, run_dir=str(run_dir), pid=os.getpid())
    return ledger.create_run(run)


#: bytes kept free beside the ledger (``<home>/.space-reserve``) so the end of a run can be recorded even when the
#: job filled the filesystem: released on the first "database or disk is full", re-made by the next run
SPACE_RESERVE_BYTES = 2 * 1024 * 1024


def _reserve_path(ledger: "Ledger") -> Path:
    return ledger.path.parent / ".space-reserve"


def _reserve_space(ledger: "Ledger") -> None:
    p = _reserve_path(ledger)
    try:
        if not p.exists() or p.stat().st_size < SPACE_RESERVE_BYTES:
            with open(p, "wb") as f:
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


# --------------------------------------------------------------------------------------------------- targets
class Target(ABC):
    """Where a run's nodes come from: the provider side of the pipeline (acquire / release) and the executor that
    runs the job on them.  A new provider plugs in with a Target (or through :class:`CloudTarget` by implementing
    the :class:`broker.core.provider.Provider` lifecycle verbs)."""

    provider: str = "?"
    topology: str = "?"

    def check(self) -> None:
        """Preconditions that must hold before anything is recorded (raise BadInput / NoValidPlan / ProviderError)."""

    def quote(self) -> Quote | None:
        """A paid target's price, shown for confirmation; None = free."""
        return None

    def prepare(self, ctx: Context) -> None:
        """After confirmation, before the run row: arm what must outlive the CLI (the watchdog)."""

    def plan_record(self) -> dict[str, Any]:
        """What goes into the run's ``plan.json`` and ledger row."""
        return {"provider": self.provider, "topology": self.topology, "usd_per_hour": 0.0}

    @abstractmethod
    def describe(self) -> str:
        """One line for the run header: devices, nodes, prices."""

    def acquire(self, run: Run, ctx: Context) -> Cluster | None:
        """Make the nodes exist (ledger-first); returns the cluster (None: this machine's processes)."""
        return None

    @abstractmethod
    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        """The executor for the acquired nodes."""

    def keep(self, recipe: Recipe, status: str) -> bool:
        """Whether the nodes of a job that ended with ``status`` are kept (recipe ``idle_minutes``)."""
        return False

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        """Tear down what acquire made, or keep it (``keep``); returns (still live after teardown, kept)."""
        return [], []

    def watching(self, run: Run, ctx: Context) -> "contextlib.AbstractContextManager[None]":
        """A context held while the job runs (cloud targets watch their nodes there); nothing by default."""
        return contextlib.nullcontext()

    @property
    def releases(self) -> bool:
        """Whether release has anything to do (a Ctrl-C during it is shielded)."""
        return False


def local_spec(recipe: Recipe) -> "tuple[LocalLaunchSpec, str]":
    """The launch spec for the ``local`` topology and a one-line description of the devices used.

    Raises NoValidPlan when this machine cannot serve the recipe (no GPU and not cpu_ok, too few GPUs...).
    """
    from broker.run.launch import LocalLaunchSpec
    from broker.providers import get_provider

    local = get_provider("local")  # through the registry: the run layer imports no adapter
    req = recipe.requirements()
    why = local.why_not(req)
    if why:
        raise NoValidPlan(f"this machine cannot run {recipe.name}: {why}",
                          hint="use --provider with a cloud provider, or allow a CPU logic check (cpu_ok: true)")
    node_envs = [local.node_env(req, i) for i in range(recipe.nodes)]
    if local.uses_gpus(req):
        devices = "; ".join(f"node {i}: CUDA_VISIBLE_DEVICES={e['CUDA_VISIBLE_DEVICES']}" for i, e in enumerate(node_envs))
    else:
        devices = "no GPU used: gloo on CPU (cpu_ok)"
    assert recipe.workdir is not None
    spec = LocalLaunchSpec(script_rel=str(recipe.script.relative_to(recipe.workdir)), args=list(recipe.args),
                           workdir=recipe.workdir, nnodes=recipe.nodes, nproc_per_node=recipe.gpus_per_node,
                           env=dict(recipe.env), node_envs=node_envs, setup=list(recipe.setup),
                           expect=list(recipe.expect), deadline_s=recipe.max_hours * 3600,
                           artifacts=list(recipe.artifacts), stall_s=recipe.stall_s, on_stall=recipe.on_stall)
    return spec, devices


class LocalTarget(Target):
    """This machine, free: ``nodes`` simulated nodes as local processes (topology ``local``)."""

    provider, topology = "local", "local"

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.spec, self.devices = local_spec(recipe)

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices}

    def describe(self) -> str:
        return f"topology local (this machine, free); {self.devices}"

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.run.launch import LocalExecutor

        return LocalExecutor(self.spec, Path(run.run_dir or "."), echo=ctx.hooks.echo, say=ctx.hooks.say)


def cloud_nodes(nodes: int) -> str:
    """The cloud side of a hybrid run of ``nodes`` nodes (node 0 is this machine): "node 1" or "nodes 1-3"."""
    return "node 1" if nodes == 2 else f"nodes 1-{nodes - 1}"


def inject_error(inject: str, *, hybrid: bool) -> BadInput:
    """The error for a ``--inject`` fault the chosen netns topology cannot inject: a fault of the other topology
    says which ``--topology`` it needs; an unknown one lists both sets."""
    netns = adapter_module("netns")

    plain = ", ".join(netns.INJECTS)
    tunnel = ", ".join(netns.HYBRID_INJECTS)
    both = f"without --topology hybrid: {plain}; with --topology hybrid: {tunnel}"
    if not hybrid and inject in netns.HYBRID_INJECTS:
        return BadInput(f"fault {inject!r} needs --topology hybrid (it breaks the tunnel between the two sites)",
                        hint=f"add --topology hybrid; the faults are {both}")
    if hybrid and inject in netns.INJECTS:
        return BadInput(f"fault {inject!r} is not one of the hybrid topology's (it needs the plain netns topology)",
                        hint=f"drop --topology hybrid; the faults are {both}")
    from broker.core.choices import closest

    near = closest(inject, (*netns.INJECTS, *netns.HYBRID_INJECTS))
    return BadInput(f"unknown fault {inject!r}",
                    hint=(f"did you mean --inject {near}? " if near else "") + f"choose one of: {both}")


class NetnsTarget(Target):
    """N network namespaces on this machine, each with its own sshd (``broker.providers.netns``), free; the job
    runs over SSH exactly as on rented VMs.  Nodes are ledger rows of kind ``netns_node`` ($0/hour), recorded
    before the namespaces exist and released through :func:`broker.money.teardown.teardown_run`."""

    provider, topology = "netns", "multi-node"

    def __init__(self, recipe: Recipe, *, inject: str | None = None, port: int | None = None):
        netns = adapter_module("netns")
        self.recipe, self.inject, self.port = recipe, inject, port
        self.netns = netns
        self.cluster_state: Any = None
        self.use_gpus = False
        self.devices = ""

    def check(self) -> None:
        netns = self.netns
        if self.inject is not None and self.inject not in netns.INJECTS:
            raise inject_error(self.inject, hybrid=False)
        why = netns.missing_requirements()
        if why:
            raise ProviderError("netns", "up", why, hint="run as root on Linux with openssh-server and iproute2")
        r = self.recipe
        self.use_gpus = netns.gpu_count() >= r.nodes * r.gpus_per_node
        self.devices = ("one GPU set per node (CUDA_VISIBLE_DEVICES, distinct NCCL_HOSTID)" if self.use_gpus
                        else "no GPU used: gloo on CPU")

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices, "inject": self.inject}

    def describe(self) -> str:
        return (f"topology multi-node over SSH (netns, free); {self.devices}"
                + (f"; fault injected: {self.inject}" if self.inject else ""))

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        netns, r = self.netns, self.recipe
        cid = netns.new_cid()
        rows = [ctx.ledger.record_intent(run.id, "netns", "netns_node", f"node{i}", attrs={"cid": cid})
                for i in range(r.nodes)]
        ctx.say(f"creating {r.nodes} network namespace(s) with sshd (cluster {cid})")
        self.cluster_state = c = netns.up(r.nodes, Path(run.run_dir or "."), inject=self.inject,
                                          gpus_per_node=r.gpus_per_node, use_gpus=self.use_gpus, cid=cid)
        for i, row in enumerate(rows):
            ctx.ledger.mark_created(row.id, f"{cid}:{i}", state="running")
        ctx.say(f"cluster {cid}: " + ", ".join(f"node{i}={c.ip(i)}" for i in range(c.n)))
        return c.cluster(run.id)

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.run.remote import SSHExecutor

        assert cluster is not None
        return SSHExecutor(cluster, recipe, Path(run.run_dir or "."), echo=ctx.hooks.echo, port=self.port,
                           say=ctx.hooks.say)

    def keep(self, recipe: Recipe, status: str) -> bool:
        """Recipe ``idle_minutes``: keep the (free) namespaces for `broker ssh` / `broker exec`; a running watchdog
        removes them ``idle_minutes`` after the job, `broker down RUN` at once."""
        return bool(recipe.idle_minutes) and status in KEEP_STATUSES

    @property
    def releases(self) -> bool:
        return True

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        from broker.money.teardown import teardown_run

        if keep:
            return [], _keep_until_idle(ctx.ledger, run, float(self.recipe.idle_minutes or 0), ctx.actor)
        if self.cluster_state is not None:
            self.cluster_state.down()
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers={"netns": self.netns.NetnsProvider()},
                            confirm_timeout_s=30)
        return left, []


class HybridTarget(Target):
    """The ``hybrid`` topology emulated on this machine (``--provider netns --topology hybrid``): node 0 in a "home"
    namespace behind one NAT, nodes 1.. in a "cloud" site behind another, only the WireGuard UDP port between them
    (:func:`broker.providers.netns.up_hybrid`), a per-run WireGuard tunnel (:func:`broker.run.hybrid.tunnel_up`), the
    job over SSH with every rank on the tunnel interface.  Free; ledger rows of kind ``netns_node`` as for
    :class:`NetnsTarget` (``broker down`` removes namespaces, interfaces and keys)."""

    provider, topology = "netns", "hybrid"

    def __init__(self, recipe: Recipe, *, inject: str | None = None, port: int | None = None):
        netns = adapter_module("netns")
        self.recipe, self.inject, self.port = recipe, inject, port
        self.netns = netns
        self.cluster_state: Any = None
        self.sites: Any = None
        self.tunnel: Any = None
        self.use_gpus = False
        self.devices = "no GPU used: gloo on CPU over the tunnel"

    def check(self) -> None:
        from broker.run.wireguard import missing_tools

        netns = self.netns
        if self.inject is not None and self.inject not in netns.HYBRID_INJECTS:
            raise inject_error(self.inject, hybrid=True)
        if self.recipe.nodes < 2:
            raise BadInput("the hybrid topology needs at least 2 nodes (this machine + one VM)")
        why = netns.missing_requirements() or missing_tools()
        if why:
            raise ProviderError("netns", "up hybrid", why, hint="run as root on Linux with openssh-server, iproute2, "
                                "iptables and wireguard-tools (+ wireguard-go without the kernel module)")
        r = self.recipe
        self.use_gpus = netns.gpu_count() >= r.nodes * r.gpus_per_node > 0
        self.devices = ("one GPU set per node (CUDA_VISIBLE_DEVICES, distinct NCCL_HOSTID), NCCL sockets over the "
                        "tunnel" if self.use_gpus else "no GPU used: gloo on CPU over the tunnel")

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "devices": self.devices, "inject": self.inject}

    def describe(self) -> str:
        return ("topology hybrid emulated (netns: home + cloud behind two NATs, WireGuard between them, free); "
                + self.devices + (f"; fault injected: {self.inject}" if self.inject else ""))

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        from broker.run.hybrid import emulated_cluster, tunnel_up

        netns, r = self.netns, self.recipe
        cid = netns.new_cid()
        rows = [ctx.ledger.record_intent(run.id, "netns", "netns_node", f"node{i}", attrs={"cid": cid, "hybrid": True})
                for i in range(r.nodes)]
        ctx.say(f"creating the two sites (home: node 0; cloud: {cloud_nodes(r.nodes)}) behind two NATs (cluster {cid})")
        self.cluster_state, self.sites = netns.up_hybrid(r.nodes, Path(run.run_dir or "."), cid=cid, inject=self.inject,
                                                         gpus_per_node=r.gpus_per_node if self.use_gpus else 0)
        for i, row in enumerate(rows):
            ctx.ledger.mark_created(row.id, f"{cid}:{i}", state="running")
        self.tunnel = t = tunnel_up(self.cluster_state, self.sites)
        ctx.say(f"WireGuard tunnel up ({t.how}, MTU {t.mtu}): " + ", ".join(
            f"node{i}={a} on {t.ifaces[i]}" for i, a in enumerate(t.addresses)) + "; keys in the run folder (0600), "
            "deleted at teardown")
        return emulated_cluster(self.cluster_state, t, run.id)

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.run.hybrid import make_executor

        assert cluster is not None and self.sites is not None
        ports = {i: self.sites.vm_port(i) for i in range(1, len(cluster.nodes))}
        return make_executor(cluster, recipe, Path(run.run_dir or "."), ports=ports, mtu=self.tunnel.mtu,
                             echo=ctx.hooks.echo, port=self.port, say=ctx.hooks.say)

    @property
    def releases(self) -> bool:
        return True

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        from broker.run.hybrid import tunnel_down
        from broker.money.teardown import teardown_run

        if self.cluster_state is not None:
            try:
                tunnel_down(self.cluster_state, self.tunnel)
            finally:
                self.cluster_state.down()
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers={"netns": self.netns.NetnsProvider()},
                            confirm_timeout_s=30)
        return left, []


class CloudTarget(Target):
    """Rented machines: the ranked plan options in failover order, provisioned ledger-first
    (:func:`broker.money.provision.provision`), torn down at the end (:func:`broker.money.teardown.teardown_run`) or kept
    until idle (recipe ``idle_minutes`` with a watchdog running)."""

    def __init__(self, recipe: Recipe, options: Plan | PlanOption | Iterable[PlanOption], *,
                 providers: dict[str, Provider] | None = None, keep_when_idle: bool = True,
                 ready_timeout_s: float = 900.0, poll_s: float = 5.0, ssh_ready_timeout_s: float | None = None,
                 watchdog: bool | None = None, **provision_kw: Any):
        from broker.money.provision import _options

        self.recipe = recipe
        self.options = _options(options)
        if not self.options:
            raise NoValidPlan(f"no plan option for {recipe.name}", hint="`broker plan` shows why each was rejected")
        first = self.options[0]
        self.provider, self.topology = first.provider, first.topology.value
        self.providers = providers
        self.keep_when_idle = keep_when_idle
        self.ready_timeout_s, self.poll_s = ready_timeout_s, poll_s
        self.ssh_ready_timeout_s = ssh_ready_timeout_s
        self.watchdog = watchdog  # None: leave the watchdog to the caller; True: start one; False: --no-watchdog
        #: seconds between the describes of the nodes while the job runs (a node stopped mid-job ends it)
        self.monitor_s = float(provision_kw.pop("monitor_s", MONITOR_S))
        self.provision_kw = provision_kw

    def check(self) -> None:
        from broker.money.accounting import check_budget

        best = self.options[0]
        check_budget(best.worst_case_usd, self.recipe.budget_usd, best.usd_per_hour)

    def prepare(self, ctx: Context) -> None:
        """Start the detached watchdog (unless ``watchdog`` is False or None) and decide whether recipe
        ``idle_minutes`` may keep nodes: only while a watchdog runs (else nothing would terminate them)."""
        if self.watchdog is None:
            return
        from broker.core.config import settings

        recipe = self.recipe
        have = False
        if not self.watchdog:
            ctx.say("warning: --no-watchdog: if this CLI dies, nothing on this machine enforces the deadline or the "
                    "budget (run `broker watchdog` yourself, or rely on the node-side switch)")
        elif settings().broker_watchdog_autostart:
            from broker.money.watchdog import start_detached

            pid = start_detached()
            have = True  # started now, or None: one is already running
            if pid:
                ctx.say(f"watchdog started (pid {pid}); it enforces the deadline and budget even if this CLI dies")
        elif recipe.idle_minutes:
            from broker.money.accounting import watchdog_state

            have = watchdog_state().alive
        if recipe.idle_minutes and not have:
            why = ("--no-watchdog" if not self.watchdog else
                   "no watchdog is running (BROKER_WATCHDOG_AUTOSTART is off; start `broker watchdog`)")
            ctx.say(f"note: recipe idle_minutes={recipe.idle_minutes:g} is ignored: {why}: nothing would terminate "
                    "kept nodes, so they are torn down when the job ends")
        self.keep_when_idle = have

    def quote(self) -> Quote:
        o = self.options[0]
        return Quote(provider=o.provider, topology=o.topology.value, summary=f"{o.topology.value} on {o.provider}: "
                     f"{o.summary}", usd_per_hour=o.usd_per_hour, deadline_hours=self.recipe.max_hours,
                     worst_case_usd=o.worst_case_usd, budget_usd=self.recipe.budget_usd,
                     failover_options=len(self.options))

    def plan_record(self) -> dict[str, Any]:
        return {"options": to_json(self.options)}

    def describe(self) -> str:
        o = self.options[0]
        return (f"{o.topology.value} on {o.provider} ({o.summary}, ${o.usd_per_hour:.2f}/h, worst case "
                f"${o.worst_case_usd:.2f}); {len(self.options)} ranked option(s) for failover")

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        from broker.money.provision import provision

        ctx.ledger.update_run(run.id, status="provisioning")
        cluster = provision(self.options, run, self.recipe, ctx.ledger, providers=self.providers,
                            progress=ctx.hooks.say, ready_timeout_s=self.ready_timeout_s, poll_s=self.poll_s,
                            actor=ctx.actor, **self.provision_kw)
        self.provider, self.topology = cluster.provider, cluster.topology.value
        ctx.ledger.update_run(run.id, status="running", provider=cluster.provider, topology=cluster.topology.value)
        return cluster

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        assert cluster is not None
        ctx.say(f"launching {len(cluster.nodes)} node(s) on {cluster.provider}")
        if cluster.local_exec:  # the fake cloud: "instances" are this machine
            return cluster_executor(recipe, run, cluster, ctx)
        ready = self.ssh_ready_timeout_s
        if ready is None:
            ready = recipe.ready_timeout_s if getattr(recipe, "ready_timeout_s", None) else \
                self._adapter_ready_timeout(cluster.provider)
        from broker.money.provision import run_clock

        left, why = run_clock(ctx.ledger, run)  # the run's one clock bounds the sshd / boot wait too
        if left < ready:
            ctx.say(f"waiting at most {max(1.0, left):.0f} s for SSH and boot (the run's {why} is that close)")
            ready = max(1.0, left)
        return cluster_executor(recipe, run, cluster, ctx, ready_timeout_s=ready,
                                on_auth_failure=self._reauthorise(cluster, ctx),
                                boot_wait=self._boot_wait(cluster))

    def _boot_wait(self, cluster: Cluster) -> str | None:
        """The adapter's command that waits for its boot script on a node (Provider.boot_wait_command); None for a
        provider without one, or an unregistered test double not handed in."""
        p = (self.providers or {}).get(cluster.provider)
        if p is None and cluster.provider in REGISTRY:
            p = provider_class(cluster.provider)()
        return None if p is None or not cluster.nodes else p.boot_wait_command(cluster.nodes[0].user)

    def _reauthorise(self, cluster: Cluster, ctx: Context) -> Callable[[], None] | None:
        """When SSH logins are refused (the key has not reached the node yet), put the run's public key in through
        the provider's key API again (Vast: ``POST /instances/{id}/ssh/``); None when there is no key file."""
        if not cluster.ssh_key_path:
            return None
        pub = Path(cluster.ssh_key_path + ".pub")

        def again() -> None:
            from broker.providers import get_provider

            try:
                key = pub.read_text().strip()
                p = (self.providers or {}).get(cluster.provider) or get_provider(cluster.provider)
                for rid in {n.resource_id for n in cluster.nodes if n.resource_id}:
                    res = ctx.ledger.resource(rid)
                    if res is not None and res.provider_id:
                        p.prepare_access(res.provider_id, key)
            except Exception as e:  # noqa: BLE001 - the login retries go on; the last error is what is reported
                ctx.say(f"could not put the key in again through {cluster.provider}'s key API: {e}")

        return again

    def _adapter_ready_timeout(self, name: str) -> float:
        """The adapter's ``ssh_ready_timeout_s`` (how long its nodes may take from RUNNING to accepting SSH): the
        instance handed in, else the registry's capability (the contract's default for an unregistered name)."""
        p = (self.providers or {}).get(name)
        return float(p.ssh_ready_timeout_s if p is not None else capability(name, "ssh_ready_timeout_s"))

    def keep(self, recipe: Recipe, status: str) -> bool:
        return bool(recipe.idle_minutes) and self.keep_when_idle and status in KEEP_STATUSES

    def watching(self, run: Run, ctx: Context) -> "contextlib.AbstractContextManager[None]":
        """While the job runs: describe every instance of ``run`` each ``monitor_s`` seconds; one the provider
        shows stopped / failed / gone ends the job at once (:func:`watch_nodes`)."""
        return watch_nodes(ctx.ledger, run, self.providers, ctx, interval_s=self.monitor_s)

    @property
    def releases(self) -> bool:
        return True

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        from broker.money.teardown import teardown_run

        if keep:
            return [], _keep_until_idle(ctx.ledger, run, float(self.recipe.idle_minutes or 0), ctx.actor)
        ctx.ledger.update_run(run.id, status="tearing_down")
        ctx.say("tearing down")
        left = teardown_run(ctx.ledger, run.id, ctx.actor, providers=self.providers, say=ctx.hooks.say,
                            poll_s=min(self.poll_s, 2.0))
        return left, []


class CloudHybridTarget(CloudTarget):
    """The ``hybrid`` topology on rented VMs (``--provider oci|aws --topology hybrid``): node 0 is THIS machine,
    nodes 1..N-1 are VMs of the ranked hybrid plan options, provisioned ledger-first through :class:`CloudTarget`
    (same failover, watchdog and teardown), joined by a mesh (:class:`broker.run.hybrid.CloudMesh`):

    * ``wireguard`` (default): a tunnel made for the run (:func:`broker.run.hybrid.wireguard_mesh`): keys per run (never
      in the ledger), each VM's config in its boot script (:func:`broker.run.wireguard.user_data_script` through
      ``NodeRequest.onstart``), the run's network opened for exactly the VMs' UDP ports from this machine's public
      address where known (:meth:`broker.core.provider.Provider.open_ingress`), then node 0's interface here (kernel
      module or ``wireguard-go``; Endpoint = each VM's public IP, PersistentKeepalive 25);
    * ``tailscale``: an existing tailnet (:func:`broker.run.hybrid.tailscale_mesh`): the VMs' boot lines run
      ``tailscale up --authkey``; this machine's tailnet address is ``MASTER_ADDR``; nothing is created here.

    This machine's part (node 0's job; the interface, pid file and key folder, never a key) is a ledger row
    (provider ``local``, kind ``local_node``) recorded before the interface exists, so ``broker down`` and the
    watchdog remove it after a SIGKILL of the CLI (:func:`broker.run.hybrid.local_node_down`).

    The executor is the SSH executor with node 0 as local processes (:mod:`broker.run.localconn`) and the tunnel
    checks first in preflight (:func:`broker.run.hybrid.make_executor`)."""

    def __init__(self, recipe: Recipe, options: Plan | PlanOption | Iterable[PlanOption], *, mesh: str = "wireguard",
                 env_file: Path | None = None, tailscale_exe: str | None = None, **kw: Any):
        super().__init__(recipe, options, **kw)
        self.mesh_kind, self.env_file, self.tailscale_exe = mesh, env_file, tailscale_exe
        self.mesh: Any = None
        self.tunnel_row: str | None = None
        self.local_attrs: dict[str, Any] = {}
        self.inner: dict[int, tuple[str, str]] = {}

    def check(self) -> None:
        from broker.run.wireguard import missing_tools

        if self.recipe.nodes < 2:
            raise BadInput("the hybrid topology needs at least 2 nodes (this machine + one VM)")
        if self.mesh_kind == "wireguard":
            why = missing_tools()
            if why:
                raise ProviderError("wireguard", "local tunnel", why, hint="node 0 (this machine) needs "
                                    "wireguard-tools, and wireguard-go where the kernel has no wireguard module; "
                                    "or use --mesh tailscale")
            if os.geteuid() != 0:
                raise ProviderError("wireguard", "local tunnel", "creating this machine's WireGuard interface needs "
                                    "root", hint="run broker as root (sudo), or use --mesh tailscale")
        else:
            from broker.run.hybrid import tailscale_authkey, tailscale_self

            if not tailscale_authkey(self.env_file):
                raise BadInput("--mesh tailscale needs TS_AUTHKEY", hint="export TS_AUTHKEY=tskey-auth-... (or put "
                               "it in .env)")
            tailscale_self(exe=self.tailscale_exe)  # this machine must be on the tailnet before anything is rented
        super().check()

    def describe(self) -> str:
        return "node 0 = this machine (free) + " + super().describe() + f"; mesh {self.mesh_kind}"

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "mesh": self.mesh_kind}

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        import sys

        from broker.run import hybrid
        r = self.recipe
        run_dir = Path(run.run_dir or ".")
        if self.mesh_kind == "wireguard":
            self.mesh = m = hybrid.wireguard_mesh(r.nodes, run.id, run_dir)
            caller = hybrid.caller_public_ip()
            rules = hybrid.ingress_rules(m.tunnel, caller)
            ctx.say(f"WireGuard tunnel {m.tunnel.subnet}: node 0 (this machine) {m.master_addr} on {m.iface}; VMs "
                    f"listen on UDP {', '.join(str(p) for p in sorted(m.ports.values()))}, opened from "
                    f"{rules[0].cidr}" + ("" if caller else " (this machine's public address is unknown: set "
                                          "BROKER_PUBLIC_IP to scope the rule)"))
        else:
            self.mesh = m = hybrid.tailscale_mesh(r.nodes, run.id, env_file=self.env_file, exe=self.tailscale_exe)
            rules = []
            ctx.say(f"tailnet: node 0 (this machine) {m.master_addr} on {m.iface}; the VMs join with TS_AUTHKEY")
        self.provision_kw = {**self.provision_kw, "node_onstart": lambda i: m.vm_boot.get(i),
                             "ingress": rules or None}
        vms = super().acquire(run, ctx)
        workroot = str(run_dir / "here")
        self.local_attrs = hybrid.local_node_attrs(m, run_id=run.id, node0_base=f"{workroot}/{run.id}/node0",
                                                   python=sys.executable)
        row = ctx.ledger.record_intent(run.id, "local", "local_node", "node0", attrs=self.local_attrs)
        self.tunnel_row = row.id
        if m.mesh != "wireguard":
            ctx.ledger.mark_created(row.id, "node0", state="running")
        else:
            ports = m.ports or {}
            endpoints = {k + 1: f"{self._public_ip(n, ctx)}:{ports[k + 1]}" for k, n in enumerate(vms.nodes)}
            self.inner = {k + 1: (n.private_ip, m.tunnel.peers[k + 1].public_key) for k, n in enumerate(vms.nodes)}
            how = hybrid.wireguard_up(m, endpoints, log=run_dir / "wireguard.log")
            ctx.ledger.mark_created(row.id, "node0", state="running", how=how)
            ctx.say(f"WireGuard up on this machine ({how}, MTU {m.mtu}): {m.iface} {m.master_addr} -> "
                    + ", ".join(f"node{i} {ep}" for i, ep in endpoints.items())
                    + f"; keys in {m.keys} (0600), deleted at teardown")
        cluster = hybrid.cloud_cluster(vms, m, run_id=run.id, workroot=workroot, python=sys.executable)
        self.topology = "hybrid"
        return cluster

    def _public_ip(self, node: Any, ctx: Context) -> str:
        """A VM's public address (its WireGuard endpoint): the ledger row's ``public_ip``, else its SSH host."""
        res = ctx.ledger.resource(node.resource_id) if node.resource_id else None
        return str(((res.attrs or {}).get("public_ip") if res else None) or node.host)

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        from broker.run.hybrid import make_executor

        assert cluster is not None and self.mesh is not None
        ctx.say(f"launching node 0 here and {len(cluster.nodes) - 1} node(s) on {cluster.provider}")
        ready = self.ssh_ready_timeout_s
        if ready is None:
            ready = recipe.ready_timeout_s if getattr(recipe, "ready_timeout_s", None) else \
                self._adapter_ready_timeout(cluster.provider)
        m = self.mesh
        return make_executor(cluster, recipe, Path(run.run_dir or "."), ports=m.ports or {}, mtu=m.mtu,
                             inner=self.inner, tailnet=m.mesh == "tailscale", echo=ctx.hooks.echo,
                             say=ctx.hooks.say, ready_timeout_s=ready,
                             on_auth_failure=self._reauthorise(cluster, ctx))

    def keep(self, recipe: Recipe, status: str) -> bool:
        return False  # node 0 is this machine and the tunnel ends with the run: nothing is kept

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        from broker.run import hybrid
        from broker.money.teardown import terminate_resource

        m = self.mesh
        try:
            if self.tunnel_row is not None:
                res = ctx.ledger.resource(self.tunnel_row)
                if res is not None and res.live:
                    from broker.providers import get_provider

                    terminate_resource(ctx.ledger, res, ctx.actor, provider=get_provider("local"), say=ctx.hooks.say)
            if m is not None and m.keys is not None:  # also when acquire failed before the row existed
                hybrid.local_node_down({"iface": m.iface, "pidfile": str(m.keys / "node0.conf.pid"),
                                        "keys": str(m.keys)})
        finally:
            left, kept = super().release(run, ctx, keep=False)
        return left, kept


#: Job statuses after which recipe ``idle_minutes`` keeps the nodes (the job ran to an end on its own).
KEEP_STATUSES = ("succeeded", "failed")
#: ledger resource kinds that are nodes (kept until idle, reached by `broker ssh` / `broker exec`)
NODE_KINDS = ("instance", "netns_node")


class KeptTarget(Target):
    """The kept nodes of an earlier run (recipe ``idle_minutes``): ``broker exec RUN RECIPE`` runs another recipe on
    them without provisioning (acquire = the stored cluster; release = nothing, the nodes stay with their run).
    The origin run's idle timer restarts when the job ends."""

    def __init__(self, origin: Run, cluster: Cluster):
        self.origin, self.cluster = origin, cluster
        self.provider, self.topology = cluster.provider, cluster.topology.value

    def plan_record(self) -> dict[str, Any]:
        return {**super().plan_record(), "kept_from": self.origin.id}

    def describe(self) -> str:
        return (f"topology {self.topology} on the kept nodes of run {self.origin.id} ({self.provider}), no "
                "provisioning")

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        return self.cluster.model_copy(update={"run_id": run.id})

    def executor(self, recipe: Recipe, run: Run, cluster: Cluster | None, ctx: Context) -> "Executor":
        assert cluster is not None
        if len(cluster.nodes) != recipe.nodes:
            raise BadInput(f"run {self.origin.id} kept {len(cluster.nodes)} node(s) but recipe {recipe.name} asks for "
                           f"{recipe.nodes}", hint=f"set nodes: {len(cluster.nodes)} in the recipe")
        return cluster_executor(recipe, run, cluster, ctx)

    @property
    def releases(self) -> bool:
        return True

    def release(self, run: Run, ctx: Context, *, keep: bool) -> tuple[list[Resource], list[Resource]]:
        ctx.ledger.update_run(self.origin.id, ended_at=utcnow())  # the watchdog's idle rule counts from here
        ctx.ledger.event(self.origin.id, ctx.actor, "exec", f"run {run.id} used the kept nodes; idle timer restarted")
        return [], []  # the nodes stay with (and are ended through) the origin run


def netns_cluster(run: Run) -> Cluster | None:
    """The cluster of a ``broker netns up`` run (its state in ``<run dir>/netns/<cid>/state.json``), as the
    Cluster ssh and exec reach; None when the run's folder holds none."""
    if run.provider != "netns" or not run.run_dir:
        return None
    states = sorted(Path(run.run_dir, "netns").glob("*/state.json"))
    if not states:
        return None
    return adapter_module("netns").NetnsCluster.load(states[0].parent).cluster(run.id)


def kept_cluster(ledger: "Ledger", run_id: str) -> tuple[Run, Cluster]:
    """The run (id or unique prefix) and its stored cluster, when its nodes are still live (a running run, or a
    kept one).  Raises BadInput saying why not."""
    from broker.core.runfolder import check_cluster, confined_run_dir

    run = ledger.find_run(run_id)
    folder = confined_run_dir(run)  # a ledger row is input: its folder must be <home>/runs/<run id>
    path = folder / "cluster.json"
    stood_up = None if path.exists() else netns_cluster(run)  # `broker netns up`: a cluster with no job
    if stood_up is not None:
        if not [r for r in ledger.resources(run.id, live_only=True) if r.kind in NODE_KINDS]:
            raise BadInput(f"the nodes of netns cluster {run.id} are gone (status {run.status})",
                           hint="`broker netns up 2` stands up a new one")
        return run, check_cluster(stood_up, run, folder)
    if not path.exists() and any(e.get("action") == "clean" for e in ledger.events(run.id, limit=1_000_000)):
        raise BadInput(f"the folder of run {run.id} ({run.run_dir}) was removed by `broker clean`: its cluster "
                       "record and keys are gone, so there are no nodes to reach",
                       hint=f"`broker status {run.id}` still shows what the run did and cost")
    if not path.exists():
        raise BadInput(f"run {run.id} has no nodes to reach ({run.provider}: "
                       f"{'processes on this machine' if run.provider == 'local' else 'no cluster recorded'})",
                       hint=f"`broker status {run.id}` shows what it did; `broker ssh` and `broker exec` reach "
                            "the nodes of a live or kept run (rented machines, `broker netns up`)")
    live = [r for r in ledger.resources(run.id, live_only=True) if r.kind in NODE_KINDS]
    if not live:
        raise BadInput(f"the nodes of run {run.id} are gone (status {run.status})",
                       hint="set idle_minutes in the recipe to keep the nodes after the job, then `broker run` again")
    try:
        cluster = Cluster.model_validate_json(path.read_text())
    except ValueError as e:
        raise BadInput(f"the cluster record {path} of run {run.id} cannot be read: {str(e).splitlines()[0]}",
                       hint=f"the run's folder was damaged or edited; `broker down {run.id}` still ends its nodes") \
            from None
    return run, check_cluster(cluster, run, folder)


def cluster_spec(recipe: Recipe, cluster: Cluster, run: Run) -> "LocalLaunchSpec":
    """The launch spec for a ``local_exec`` cluster: each node's CUDA_VISIBLE_DEVICES from its gpu_indices."""
    from broker.run.launch import LocalLaunchSpec

    assert recipe.workdir is not None
    node_envs = []
    for n in cluster.nodes:
        env = {"BROKER_RUN_ID": run.id, "BROKER_MASTER_ADDR": cluster.master_addr}
        if n.gpu_indices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(n.gpu_indices)
        env.update(n.env)
        node_envs.append(env)
    deadline_s = recipe.max_hours * 3600
    if run.deadline:
        deadline_s = max(1.0, (run.deadline - utcnow()).total_seconds())
    return LocalLaunchSpec(script_rel=str(recipe.script.relative_to(recipe.workdir)), args=list(recipe.args),
                           workdir=recipe.workdir, nnodes=len(cluster.nodes), nproc_per_node=recipe.gpus_per_node,
                           env=dict(recipe.env), node_envs=node_envs, setup=list(recipe.setup),
                           expect=list(recipe.expect), deadline_s=deadline_s, artifacts=list(recipe.artifacts),
                           stall_s=recipe.stall_s, on_stall=recipe.on_stall)


def cluster_executor(recipe: Recipe, run: Run, cluster: Cluster, ctx: Context, **ssh: Any) -> "Executor":
    """The executor for an acquired cluster: local processes when its nodes are this machine (``local_exec``: the
    fake cloud), else SSH (``ssh``: SSHExecutor options such as ``ready_timeout_s``)."""
    from broker.money.provision import run_clock

    if cluster.local_exec:
        from broker.run.launch import LocalExecutor

        spec = cluster_spec(recipe, cluster, run)
        left = run_clock(ctx.ledger, run)[0]  # the run's one clock, as below
        if spec.deadline_s is None or left < spec.deadline_s:
            spec = _dc_replace(spec, deadline_s=max(1.0, left))
        return LocalExecutor(spec, Path(run.run_dir or "."), echo=ctx.hooks.echo, say=ctx.hooks.say)
    from broker.run.remote import SSHExecutor

    ex = SSHExecutor(cluster, recipe, Path(run.run_dir or "."), echo=ctx.hooks.echo, say=ctx.hooks.say, **ssh)
    # the job ends on the run's one clock (its deadline or its budget at the rates the ledger holds), not
    # max_hours counted again from now: provisioning already spent part of it
    left = run_clock(ctx.ledger, run)[0]
    if left < ex.deadline_s:
        ex.deadline_s = max(1.0, left)
    return ex


def _keep_until_idle(ledger: "Ledger", run: Run, idle_minutes: float, actor: str) -> list[Resource]:
    """Record ``attrs["idle_minutes"]`` on every live instance of ``run`` (the watchdog's idle rule reads it) and
    log why nothing was torn down; returns the kept instances."""
    kept = [r for r in ledger.resources(run.id, live_only=True) if r.kind in NODE_KINDS]
    for r in kept:
        ledger.update_resource(r.id, attrs={"idle_minutes": idle_minutes}, actor=actor,
                               message=f"kept for inspection: idle stop after {idle_minutes:g} min")
    ledger.event(run.id, actor, "keep-idle",
                 f"recipe idle_minutes={idle_minutes:g}: kept {len(kept)} node(s) instead of tearing down; the "
                 f"watchdog terminates them {idle_minutes:g} min after the job ended (or at the deadline / budget), "
                 f"`broker down {run.id}` at once")
    return kept


# --------------------------------------------------------------------------------------------------- the pipeline
@contextmanager
def shielded(say: Say | None, *, window_s: float = 2.0) -> Iterator[None]:
    """Shield a release from Ctrl-C: the first Ctrl-C says teardown is still running; a second one within
    ``window_s`` seconds abandons it (raises KeyboardInterrupt; the watchdog / ``broker down`` finish).  Only in the
    main thread (signal handlers live there); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    last = [0.0]

    def handler(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if now - last[0] <= window_s:
            if say:
                say("teardown abandoned: the watchdog (or `broker down RUN`) finishes it; every resource is in the "
                    "ledger")
            raise KeyboardInterrupt
        last[0] = now
        if say:
            say(f"still releasing resources (teardown); press Ctrl-C again within {window_s:g} s to abandon it and "
                "leave the rest to the watchdog")

    def hold(signum: int, frame: Any) -> None:
        # SIGTERM / SIGHUP while tearing down (`timeout` sends TERM again, the closed terminal HUP): the teardown
        # they asked for is running; only a second Ctrl-C abandons it
        if say:
            try:
                say(f"{signal.Signals(signum).name} received: still releasing resources (teardown); broker exits "
                    "when it is done")
            except (OSError, ValueError, SystemExit):  # the terminal is gone (SIGHUP): say nothing
                pass

    old = signal.signal(signal.SIGINT, handler)
    olds = {sig: signal.signal(sig, hold) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        for sig, h in olds.items():
            signal.signal(sig, h)


#: seconds between the describes of a cloud run's nodes while its job runs (CloudTarget ``monitor_s``)
MONITOR_S = 30.0


class NodeLost(BrokerError):
    """A node the job runs on was stopped, failed or disappeared at the provider while the job ran (exit 1)."""

    exit_code = 1


def watch_nodes(ledger: "Ledger", run: Run, providers: dict[str, Provider] | None, ctx: Context, *,
                interval_s: float) -> "contextlib.AbstractContextManager[None]":
    """A context for the job's duration: a thread describes every live instance of ``run`` each ``interval_s``
    seconds; one that the provider shows ``stopped`` / ``failed`` / ``terminated`` gets that state and why on its
    ledger row (``attrs["provider_state"]``, ``error``: ``broker status`` shows it) and the job is ended at once
    (:class:`NodeLost` raised in the main thread through SIGUSR2), instead of waiting for SSH to time out while the
    other nodes bill.  Describe errors are ignored (the next pass looks again).  Outside the main thread: nothing."""
    import _thread

    if threading.current_thread() is not threading.main_thread() or interval_s <= 0:
        return contextlib.nullcontext()

    @contextmanager
    def watching() -> Iterator[None]:
        stop = threading.Event()
        lost: list[str] = []

        def on_lost(signum: int, frame: Any) -> None:
            if lost and not stop.is_set():
                raise NodeLost(lost[0], hint=f"`broker status {run.id}` shows the node; the run is torn down")

        def loop() -> None:
            from broker.providers import get_provider

            cache: dict[str, Provider] = dict(providers or {})
            while not stop.wait(interval_s):
                for res in ledger.resources(run.id, live_only=True):
                    if res.kind != "instance" or not res.provider_id or res.state in ("terminating", "terminated"):
                        continue
                    try:
                        p = cache.get(res.provider) or cache.setdefault(res.provider, get_provider(res.provider))
                        info = p.describe_instance(res.provider_id, region=res.region)
                    except Exception:  # noqa: BLE001 - a failed describe proves nothing: the next pass looks again
                        continue
                    if info.state not in ("stopped", "failed", "terminated") or stop.is_set():
                        continue
                    raw = info.raw_state or info.state
                    msg = (f"node {res.attrs.get('node_index', '?')} ({res.provider} {res.provider_id}) became {raw} "
                           "at the provider while the job ran"
                           + (f" ({info.message})" if info.message else "")
                           + ("; it may still bill its disk" if info.state == "stopped" else "")
                           + ": ended the job")
                    ledger.update_resource(res.id, error=msg, attrs={"provider_state": info.state},
                                           actor=ctx.actor, message=msg)
                    lost.append(msg)
                    ctx.say(msg)
                    _thread.interrupt_main(signal.SIGUSR2)
                    return

        old = signal.signal(signal.SIGUSR2, on_lost)
        t = threading.Thread(target=loop, name=f"watch-nodes-{run.id}", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(timeout=interval_s + 30)
            signal.signal(signal.SIGUSR2, old)

    return watching()


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


def run_pipeline(recipe: Recipe, target: Target, *, ledger: "Ledger", hooks: Hooks | None = None,
                 actor: str = "cli") -> RunOutcome:
    """Run ``recipe`` on ``target`` through every step (module docstring) and record it; returns the outcome.

    Raises Declined (exit 2) when a paid target is not confirmed (nothing created, no run recorded); raises what
    acquire raises (NoValidPlan, ProviderError...) *after* release ran and the run's end was recorded.  A failing
    job is not an exception: see ``RunOutcome.result``.
    """
    from broker.run.executor import STEP_TEXT, run_steps

    hooks = hooks or Hooks()
    if hooks.say is not None or hooks.echo is not None:
        hooks = _dc_replace(hooks, say=_quiet_when_gone(hooks.say), echo=_quiet_when_gone(hooks.echo))
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
    result: RunResult | None = None
    cluster: Cluster | None = None
    status, message = "failed", None
    left: list[Resource] = []
    kept: list[Resource] = []
    keep = False
    try:
        cluster = target.acquire(run, ctx)
        if cluster is not None:  # for `broker ssh` / `broker exec` (paths and addresses only, no secret)
            from broker.core.private import write_private

            write_private(Path(run.run_dir or ".", "cluster.json"), cluster.model_dump_json(indent=2))
        ex = target.executor(recipe, run, cluster, ctx)
        with target.watching(run, ctx):
            result = run_steps(ex, (lambda step: ctx.say(STEP_TEXT[step])) if hooks.say else None)
        result = diagnose(result, recipe, Path(run.run_dir or "."))
        status, message = result.status, result.reason
        keep = target.keep(recipe, status)
    except KeyboardInterrupt as e:
        status, message = "interrupted", f"interrupted ({_signal_name(e)}) before the job finished"
        raise
    except BrokerError as e:
        message = e.message
        from broker.money.provision import ClockOut

        if isinstance(e, ClockOut):  # the run's clock ran out while provisioning: deadline / budget
            status = e.status
        raise
    except Exception as e:  # noqa: BLE001 - recorded, then re-raised after release
        message = str(e)
        raise
    finally:
        try:
            if target.releases:
                _log.info("run %s: releasing (%s; keep: %s)", run.id, status, keep)
                with shielded(hooks.say):
                    left, kept = target.release(run, ctx, keep=keep)
                _log.info("run %s: released; still live: %d, kept: %d", run.id, len(left), len(kept))
        finally:
            if kept:
                message = ((message + "; ") if message else "") + (
                    f"{len(kept)} node(s) kept for inspection: idle stop after {recipe.idle_minutes:g} min")
                ctx.say(f"keeping {len(kept)} node(s) for inspection: idle stop after {recipe.idle_minutes:g} min")
            if left:
                message = ((message + "; ") if message else "") + "still live after teardown: " + ", ".join(
                    f"{r.provider} {r.kind} {r.provider_id or r.name}" for r in left) + f" (run `broker down {run.id}`)"
            updated = end_run(ledger, run.id, result, status=status, message=message, actor=actor, say=hooks.say,
                              pid=os.getpid())
    from broker.money.provision import run_cost

    return RunOutcome(updated, result, cluster, left, run_cost(ledger, run.id), kept_until_idle=bool(kept),
                      kept=kept)


def diagnose(result: "RunResult", recipe: Recipe, run_dir: Path) -> "RunResult":
    """The diagnose step: for a failed run (or one whose ranks exited 0 but printed errors), the node and rank that
    failed first, that rank's own exception and the cause and fix from the catalogue (:func:`broker.run.diagnose.explain`,
    from the rank facts and the node logs); kept in ``result.diagnosis`` and written to ``<run>/diagnosis.txt``.
    Never raises: a diagnosis must not break the record of a run."""
    if result.ok and not result.error_lines and not getattr(result, "warnings", None):
        return result
    try:
        from broker.run.diagnose import explain

        result.diagnosis = explain(run_dir, result, recipe.nodes).lines()
    except Exception as e:  # noqa: BLE001
        result.diagnosis = [f"(no diagnosis: {type(e).__name__}: {e})"]
    if result.diagnosis:
        try:
            from broker.core.private import write_private

            write_private(run_dir / "diagnosis.txt", "\n".join(result.diagnosis) + "\n")
        except OSError:
            pass
    return result


# --------------------------------------------------------------------------------------------------- plan + entry
def local_choice_text(plan: Plan, recipe: Recipe) -> str:
    """What ``broker run`` says when this machine is the plan's choice.  The count is the plan's valid options,
    this machine included, as ``broker plan`` counts them ("N valid"); for a CPU-only job ``broker plan`` also adds
    the free-tier snapshot's $0.00 CPU offers, which a run never rents, so its count can be higher: said here."""
    valid = plan.valid_count or len(plan.options)
    if valid <= 1:
        return "plan: this machine (free) is the only valid option"
    cpu_only = recipe.gpus_per_node == 0 and recipe.cpu_ok
    extra = (" (for a CPU-only job it also counts the free-tier CPU offers, which a run does not rent)"
             if cpu_only else "")
    return (f"plan: this machine (free) is the cheapest of {valid} valid options; "
            f"`broker plan --recipe {shlex.quote(str(recipe.path))}` lists them{extra}")


def plan_for_run(recipe: Recipe, provider: str | None) -> tuple[Plan, list[PlanOption]]:
    """Plan ``recipe`` over every provider (``provider`` None) or one, and return the plan and the ranked valid
    options broker can act on: this machine, or clouds whose credentials are configured (a snapshot price cannot
    be rented).  Raises NoValidPlan (exit 3) naming the cheapest rejected options, or the credentials needed.
    """
    from broker.plan.facts import DEFAULT_PROVIDERS, gather, log_plan
    from broker.plan.planner import plan as make_plan
    from broker.providers import get_provider

    req = recipe.requirements()
    names = [provider] if provider else list(DEFAULT_PROVIDERS)
    facts = gather(req, names)
    plan = make_plan(req, facts.offers, facts.quotas, facts.capacities, notes=facts.notes, here=facts.here,
                     unavailable=facts.unavailable)
    log_plan(plan)
    if plan.chosen is None:
        from broker.plan.explain import no_plan_error

        raise no_plan_error(recipe, plan)
    usable: list = []
    missing: dict[str, str] = {}
    for opt in plan.options:
        if opt.provider == "local":
            usable.append(opt)
            continue
        if opt.provider not in missing:
            try:
                chk = get_provider(opt.provider).check()
                missing[opt.provider] = "" if chk.configured else (chk.hint or chk.detail or "no credentials")
            except Exception as e:  # noqa: BLE001 - an adapter that cannot start cannot rent
                missing[opt.provider] = str(e)
        if not missing[opt.provider]:
            usable.append(opt)
    if not usable:
        best = plan.chosen
        if provider:
            raise AuthError(provider, "credentials check", f"no credentials: the plan on {provider} comes from a "
                            "price snapshot and nothing can be rented", hint=missing.get(provider) or None)
        need = "; ".join(f"{p}: {why}" for p, why in missing.items() if why)
        cpu = "" if recipe.cpu_ok else "; or set cpu_ok: true in the recipe to run a CPU logic check on this machine"
        raise NoValidPlan(f"the cheapest plan is {best.topology.value} on {best.provider} ({best.summary}, worst case "
                          f"${best.worst_case_usd:.2f}) but no provider with credentials can serve {recipe.name}",
                          hint=f"configure one (see .env.example): {need}{cpu}")
    return plan, usable


def rank_options(provider: Provider, req: Requirements) -> list[PlanOption]:
    """The valid plan options on one provider, ranked by the planner (:func:`broker.plan.planner.plan`) from the
    provider's offers, quotas and capacity."""
    from broker.plan.planner import plan

    offers = provider.offers(req)
    p = plan(req, offers, provider.quotas(req, offers), provider.capacity(offers), now=utcnow())
    return [o for o in p.options if o.valid]


#: providers ``broker run --provider`` accepts: every registered one
RUN_PROVIDERS = tuple(REGISTRY)


@dataclass
class RunRequest:
    """How ``broker run`` was asked: ``provider`` (None = the plan decides), netns ``inject``, Slurm options,
    ``watchdog`` (False = ``--no-watchdog``: rented runs then rest on the CLI and the node-side switch)."""

    provider: str | None = None
    inject: str | None = None
    slurm: "SlurmOptions | None" = None
    watchdog: bool = True
    topology: str | None = None  # None = the recipe's; "hybrid": this machine + VMs over a tunnel
    mesh: str = "wireguard"  # hybrid: wireguard (per-run tunnel) | tailscale (an existing tailnet)


def choose_target(recipe: Recipe, req: RunRequest, *, say: Say | None = None) -> Target:
    """The plan step: the :class:`Target` for ``recipe`` (this machine when it can serve the job, it is free;
    otherwise the cheapest valid cloud option with credentials, with the rest for failover)."""
    p = req.provider
    if p is not None and p not in RUN_PROVIDERS:
        raise BadInput(f"--provider {p!r} is not a provider broker can run on",
                       hint=f"choose one of: {', '.join(RUN_PROVIDERS)} (or leave it out to let the plan decide)")
    topo = req.topology or recipe.topology
    _log.debug("choosing the target: provider %s, topology %s (%s)", p or "any (the plan decides)", topo,
               "--topology" if req.topology else "the recipe")
    if req.inject and p != "netns":
        netns = adapter_module("netns")

        if req.inject not in (*netns.INJECTS, *netns.HYBRID_INJECTS):
            raise inject_error(req.inject, hybrid=topo == "hybrid")
        hybrid = topo == "hybrid" or req.inject in netns.HYBRID_INJECTS
        raise BadInput("--inject works with --provider netns only (faults are injected into the emulated network)",
                       hint=f"broker run {shlex.quote(str(recipe.path))} --provider netns"
                       + (" --topology hybrid" if hybrid else "")
                       + f" --inject {req.inject}")
    if topo == "hybrid":
        return hybrid_target(recipe, req)
    if p == "local":
        return LocalTarget(recipe)
    if p == "netns":
        return NetnsTarget(recipe, inject=req.inject)
    if p in REGISTRY:  # a provider whose nodes are not rented VMs (a scheduler) brings its own target
        own = provider_class(p).run_target(recipe, req)
        if own is not None:
            return own
    plan, options = plan_for_run(recipe, p)
    _log.info("plan: %s on %s first, %d usable option(s) for failover", options[0].topology.value,
              options[0].provider, len(options))
    if options[0].provider == "local":
        if say:
            say(local_choice_text(plan, recipe))
        return LocalTarget(recipe)
    return CloudTarget(recipe, options, watchdog=req.watchdog)


def hybrid_target(recipe: Recipe, req: RunRequest) -> Target:
    """The target of a ``hybrid`` run: the emulation (``--provider netns``), or this machine + rented VMs of the
    ranked hybrid options on oci / aws (:class:`CloudHybridTarget`, ``--mesh wireguard|tailscale``); a provider
    without /dev/net/tun is refused with that reason (exit 3)."""
    from broker.run.hybrid import MESHES, TUN_PROVIDERS, why_not_hybrid

    p = req.provider
    if req.mesh not in MESHES:
        raise BadInput(f"--mesh {req.mesh!r} is not a mesh", hint=f"choose one of: {', '.join(MESHES)}")
    if p == "netns":
        if req.mesh != "wireguard":
            raise BadInput("the emulated hybrid run (--provider netns) uses its own WireGuard tunnel",
                           hint="leave out --mesh (or --mesh wireguard)")
        return HybridTarget(recipe, inject=req.inject)
    if p in ("local", "slurm"):
        raise BadInput(f"--topology hybrid does not apply to --provider {p}",
                       hint="--provider netns emulates it here; oci or aws rent the cloud side")
    if p is not None and why_not_hybrid(p):
        raise NoValidPlan(f"no hybrid option on {p}: {why_not_hybrid(p)}",
                          hint=f"use --provider {' or '.join(TUN_PROVIDERS)}, or --provider netns to emulate it")
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
