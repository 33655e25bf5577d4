"""The paid targets: :class:`CloudTarget` (ledger-first provisioning with failover, teardown or idle keep) and
:class:`CloudHybridTarget` (cloud nodes joined to local ones over WireGuard).
"""

from __future__ import annotations

import os
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from broker.core.model import Plan, PlanOption, to_json
from broker.core.prose import usd
from broker.core.records import Cluster, Resource, Run
from broker.core.provider import BadInput, NoValidPlan, Provider, ProviderError
from broker.core.recipe import Recipe
from broker.providers import REGISTRY, capability, provider_class
from broker.run.runrecord import Context, Quote
from broker.run.guard import MONITOR_S, watch_nodes
from broker.run.targets import KEEP_STATUSES, Target, _keep_until_idle
from broker.run.kept import cluster_executor

if TYPE_CHECKING:
    from broker.run.executor import Executor


def _warm_reach() -> None:
    """While the machines boot: import what the SSH executor needs to reach them, check them and stage the work
    folder (:data:`broker.run.remote.REACH_MODULES`), so that it is not done while they bill and the job waits."""
    from broker.core.warm import warm_imports

    warm_imports(["broker.run.remote"], then="REACH_MODULES")


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
        #: seconds between the describes of the nodes while the job runs (a node stopped mid-job ends it): the
        #: shortest ``node_check_s`` of the providers this run may rent from, unless given
        given = provision_kw.pop("monitor_s", None)
        self.monitor_s = float(given) if given is not None else min(
            (float(capability(o.provider, "node_check_s")) for o in self.options), default=MONITOR_S)
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
            ctx.say(f"note: {recipe.idle_words()} is ignored: {why}: nothing would terminate "
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
        return (f"{o.topology.value} on {o.provider} ({o.summary}, {usd(o.usd_per_hour)}/h, worst case "
                f"{usd(o.worst_case_usd)}); {len(self.options)} ranked option(s) for failover")

    def acquire(self, run: Run, ctx: Context) -> Cluster:
        from broker.money.provision import provision

        ctx.ledger.update_run(run.id, status="provisioning")
        cluster = provision(self.options, run, self.recipe, ctx.ledger, providers=self.providers,
                            progress=ctx.hooks.say, ready_timeout_s=self.ready_timeout_s, poll_s=self.poll_s,
                            actor=ctx.actor, while_waiting=_warm_reach, **self.provision_kw)
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
        from broker.money.cost import run_clock

        left, why = run_clock(ctx.ledger, run)  # the run's one clock bounds the sshd / boot wait too
        if left < ready:
            ctx.say(f"waiting at most {max(1.0, left):.0f} s for SSH and boot (the run's {why} is that close)")
            ready = max(1.0, left)
        return cluster_executor(recipe, run, cluster, ctx, ready_timeout_s=ready,
                                on_auth_failure=self._reauthorise(cluster, ctx),
                                boot_wait=self._boot_wait(cluster))

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

    def _boot_wait(self, cluster: Cluster) -> str | None:
        """The adapter's command that waits for its boot script on a node (Provider.boot_wait_command); None for a
        provider without one, or an unregistered test double not handed in."""
        p = (self.providers or {}).get(cluster.provider)
        if p is None and cluster.provider in REGISTRY:
            p = provider_class(cluster.provider)()
        return None if p is None or not cluster.nodes else p.boot_wait_command(cluster.nodes[0].user)

    def keep(self, recipe: Recipe, status: str) -> bool:
        return bool(recipe.idle_minutes) and self.keep_when_idle and status in KEEP_STATUSES

    def watching(self, run: Run, ctx: Context) -> "contextlib.AbstractContextManager[None]":
        """While the job runs: describe every instance of ``run`` each ``monitor_s`` seconds; one the provider
        shows stopped / failed / gone ends the job at once (:func:`broker.run.guard.watch_nodes`)."""
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
        from broker.core.rowattrs import row_address

        return str((row_address(res.attrs, "public_ip") if res else None) or node.host)

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
                hybrid.local_node_down({"run_id": run.id, "iface": m.iface, "keys": str(m.keys),
                                        "pidfile": str(m.keys / "node0.conf.pid")})
        finally:
            left, kept = super().release(run, ctx, keep=False)
        return left, kept
