"""``broker slurm up|status|down``: a Slurm cluster of its own on acquired nodes, built over SSH.

The cluster is a *run* in the ledger (provider = the node provider, topology ``slurm-cluster``, a hard deadline
from ``--max-hours``, a budget): its nodes are acquired through the pipeline's targets
(the netns adapter's own target for ``netns``, :class:`broker.run.cloudtarget.CloudTarget` - ledger-first
:func:`broker.money.provision.provision` - for ``oci``/``aws``), so the watchdog, the deadline, ``broker down`` and
``broker status`` apply to it exactly as to any run.  Its id (the run id) is the cluster id.

Then, over SSH (:class:`broker.run.sshcluster.SSHCluster`), on every node:

1. facts: ``nproc``, ``MemTotal`` of ``/proc/meminfo``, ``nvidia-smi -L`` (GPUs), ``hostname -s``, and whether the
   Slurm and MUNGE binaries are there; on netns nodes they are this machine's (missing = install them here), on
   cloud VMs ``apt-get install slurm-wlm munge`` (the boot script :func:`cloud_onstart` already started it);
2. one MUNGE key per cluster (1024 random bytes, generated in memory, written over SFTP with mode 0400 on every
   node, never printed and never in the ledger);
3. ``slurm.conf`` (:func:`render_slurm_conf`: node 0 = slurmctld + slurmd, the others slurmd; the real CPU, memory
   and GPU counts) and ``gres.conf`` (:func:`render_gres_conf`) under the per-cluster folder ``<base>/etc``;
4. ``munged`` with its own key, socket, pid, log and seed files; ``slurmctld`` on node 0 and ``slurmd -N node<i>``
   on every node with that ``slurm.conf`` (``-f``; client commands get ``SLURM_CONF``), their state, pid and log
   files under ``<base>``.  The MUNGE socket lives in ``/run/broker-munge-<tag>/``: one path in ``slurm.conf``
   (``AuthInfo=socket=``) that is each node's own (a netns node has a private ``/run``; a VM has its own disk);
5. one shared directory at the same absolute path on every node: netns nodes share this machine's file system
   (``<run dir>/cluster/shared``); cloud VMs mount ``/srv/broker-shared`` over NFS from node 0
   (:func:`nfs_server_script` / :func:`nfs_client_script`, restricted to the private network's CIDR).

Done when ``sinfo`` on node 0 shows every node ``idle``.

Inside a netns node (``ip netns exec`` + a private mount namespace) ``/sys/fs/cgroup`` is empty: slurmd needs
this machine's cgroup layout mounted again there (:func:`cgroup_mount_script`); those mounts live and die with
the node's mount namespace.  The host's ``/etc`` is shared, so nothing is written to ``/etc/slurm`` or
``/etc/munge``: every daemon is pointed at the cluster's own files.

``broker slurm down`` stops the daemons by PID (their pid files, over SSH), releases the nodes through the same
target (namespaces deleted / VMs terminated and confirmed gone), and checks that no namespace, daemon or mount of
the cluster is left.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from broker.core.provider import BadInput, BrokerError, ProviderError
from broker.core.prose import usd
from broker.core.sshkeys import host_key_name
from broker.providers import SLURM_NODES, capability
from broker.slurm.render import (CLOUD_BASE, CLOUD_CGROUPS, CLOUD_SHARED_DIR, ClusterState, FACTS_CMD, NodeFacts, Say,
                                 cgroup_mount_script, cloud_onstart, nfs_client_script, nfs_server_script, parse_facts,
                                 parse_sinfo_nodes, private_cidr, render_gres_conf, render_slurm_conf, sinfo_cmd,
                                 start_script, stop_script)

if TYPE_CHECKING:
    from broker.money.ledger import Ledger
    from broker.core.records import Cluster, Run
    from broker.run.sshcluster import SSHCluster
    from broker.slurm.executor import SlurmOptions


#: the run topology of a Slurm cluster broker built
TOPOLOGY = "slurm-cluster"
#: node providers ``broker slurm up`` acquires from (their ``slurm_nodes`` capability)
UP_PROVIDERS = SLURM_NODES
DEFAULT_MAX_HOURS = 2.0
DEFAULT_BUDGET_USD = 5.0


# --------------------------------------------------------------------------------------------------- SSH shell
def ssh_argv(state: ClusterState) -> list[str]:
    """``ssh`` to node 0 with the cluster's key and pinned host keys (one shared connection, 30 s linger)."""
    from broker.core.private import control_path

    n = state.nodes[0]
    # the shared connection's socket in this user's 0700 runtime folder (never shared /tmp)
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-o", "LogLevel=ERROR",
            "-o", "ControlMaster=auto", "-o", f"ControlPath={control_path('slurm-' + state.cluster_id[-6:])}",
            "-o", "ControlPersist=30", "-p", str(n.port)]
    if state.ssh_key_path:
        argv += ["-i", state.ssh_key_path, "-o", "IdentitiesOnly=yes"]
    if state.known_hosts_path:
        argv += ["-o", f"UserKnownHostsFile={state.known_hosts_path}", "-o", "StrictHostKeyChecking=yes"]
    alias = getattr(n, "host_key_alias", "")
    if alias:  # pinned per machine (by resource id), as the runner pinned it; read from a file: checked
        if not re.fullmatch(r"broker-res-[A-Za-z0-9._-]{1,100}", str(alias)):
            raise BadInput(f"refused: cluster {state.cluster_id}'s node 0 host key name {alias!r} is not one broker "
                           "writes", hint="the cluster's state file was edited")
        argv += ["-o", f"HostKeyAlias={alias}"]
    from broker.core.runfolder import USER_RE, valid_host

    if not USER_RE.fullmatch(str(n.user)) or not valid_host(n.host):  # read from the run's folder: input
        raise BadInput(f"refused: cluster {state.cluster_id}'s node 0 user {n.user!r} / host {n.host!r} is not a "
                       "user name / an IP address or DNS name", hint="the cluster's state file was edited")
    return argv + ["-l", str(n.user), "--", n.host]


def node0_shell(state: ClusterState):
    """A :class:`broker.slurm.shell.Shell` whose commands run on node 0 over SSH with the cluster's key and
    ``SLURM_CONF`` pointing at the cluster's ``slurm.conf``."""
    from broker.slurm.shell import Shell

    class ClusterShell(Shell):
        def argv(self, argv: list[str]) -> list[str]:
            # sbatch exports the environment: torchrun's temporary folders land in the cluster's shared folder
            return ssh_argv(state) + [f"export SLURM_CONF={shlex.quote(state.conf)} "
                                      f"TMPDIR={shlex.quote(state.shared_dir + '/tmp')}; " + shlex.join(argv)]

    return ClusterShell(f"node0 of cluster {state.cluster_id}")


def slurm_ssh_argv(run: Any, argv: list[str], command: list[str] | None) -> list[str]:
    """``broker ssh`` on a cluster ``broker slurm up`` built: the session gets ``SLURM_CONF`` (the cluster's
    ``slurm.conf`` is not in the default place, so ``sinfo`` would find no configuration source).  ``argv``: the
    ssh argv as built for any kept run (``... -l USER -- HOST`` then the command when one is given); returned with
    ``export SLURM_CONF=...;`` in front of the command, or for a shell ``-t`` and a login shell that has it.  Any
    other run: ``argv`` unchanged."""
    if getattr(run, "topology", None) != TOPOLOGY or not getattr(run, "run_dir", None):
        return argv
    try:
        conf = ClusterState.load(Path(run.run_dir)).conf
    except Exception:  # noqa: BLE001 - no state file: the session works, only without SLURM_CONF
        return argv
    export = f"export SLURM_CONF={shlex.quote(conf)};"
    try:
        h = argv.index("--") + 1  # ssh's own options end at "--"; the host follows, then the command
    except ValueError:
        return argv
    if h >= len(argv):
        return argv
    if command:
        return [*argv[:h + 1], export, *argv[h + 1:]]
    return [*argv[:h - 1], "-t", "--", argv[h], f'{export} exec "${{SHELL:-/bin/bash}}" -l']


def close_shell(state: ClusterState) -> None:
    """End the shared SSH connection to node 0 (``ssh -O exit``), if one lingers."""
    import subprocess

    argv = ssh_argv(state)
    subprocess.run(argv[:-1] + ["-O", "exit", argv[-1]], capture_output=True, timeout=15)


# --------------------------------------------------------------------------------------------------- the recipe
def cluster_recipe(name: str, nodes: int, *, max_hours: float, budget_usd: float, gpus_per_node: int = 1,
                   cpu_ok: bool = True, gpu_models: list[str] | None = None):
    """The Recipe that describes a cluster's nodes to the targets and the planner (no script is ever run);
    ``cpu_ok`` makes it a CPU-only job (``gpus_per_node: 0``: CPU and free-tier machines qualify)."""
    from broker.core.recipe import GpuSpec, Recipe

    return Recipe(name=f"slurm-{name}", script=Path("slurm-cluster"), workdir=Path("."), nodes=nodes,
                  gpus_per_node=0 if cpu_ok else max(1, gpus_per_node), cpu_ok=cpu_ok, max_hours=max_hours,
                  budget_usd=budget_usd,
                  topology="multi-node", gpu=GpuSpec(models=gpu_models or [], min_mem_gib=0))


def cpu_options(recipe: Any, provider: str) -> list:
    """Ranked valid options for a CPU-only cluster on ``provider``: its own offers plus the free-tier CPU machines
    (``providers/snapshots/free_tier.csv``, $0.00 within their limits).  Raises AuthError without credentials (a
    snapshot price cannot be rented)."""
    from broker.plan.catalog import SHIPPED_DIR
    from broker.plan.facts import gather
    from broker.plan.planner import free_tier_offers, plan
    from broker.core.provider import not_configured_error
    from broker.providers import get_provider

    chk = get_provider(provider).check()
    if not chk.configured:
        raise not_configured_error(chk, "nothing can be rented")
    req = recipe.requirements()
    facts = gather(req, [provider])
    offers = list(facts.offers) + free_tier_offers(req, (SHIPPED_DIR / "free_tier.csv").read_text())
    p = plan(req, offers, facts.quotas, facts.capacities, notes=facts.notes)
    return [o for o in p.options if o.valid and o.provider == provider]


# --------------------------------------------------------------------------------------------------- up
@dataclass
class UpOptions:
    provider: str = "netns"
    nodes: int = 2
    name: str | None = None
    max_hours: float = DEFAULT_MAX_HOURS
    budget_usd: float = DEFAULT_BUDGET_USD
    gpus_per_node: int = 1
    cpu_only: bool = True
    idle_timeout_s: float = 120.0
    watchdog: bool = True


def _target(opts: UpOptions, recipe: Any):
    from broker.core.target import RunRequest
    from broker.providers import provider_class
    from broker.run.cloudtarget import CloudTarget
    from broker.run.planstep import plan_for_run

    own = provider_class(opts.provider).run_target(recipe, RunRequest(provider=opts.provider))
    if own is not None:  # nodes the provider hands over itself (the netns emulation)
        return own
    if opts.provider in UP_PROVIDERS:  # rented nodes
        if recipe.cpu_only:
            options = cpu_options(recipe, opts.provider)
        else:
            _, options = plan_for_run(recipe, opts.provider)
        options = [o for o in options if o.topology.value == "multi-node"]
        if not options:
            from broker.core.provider import NoValidPlan

            raise NoValidPlan(f"no multi-node option on {opts.provider} for {opts.nodes} node(s) within "
                              f"{usd(opts.budget_usd)} and {opts.max_hours:g} h",
                              hint=f"`broker plan --provider {opts.provider} --nodes {opts.nodes} --topology "
                                   "multi-node" + (" --cpu-only`" if recipe.cpu_only else "`") + " shows why")
        return CloudTarget(recipe, options, watchdog=opts.watchdog, onstart=cloud_onstart())
    from broker.providers import why_not

    raise BadInput(f"--provider {opts.provider!r}: slurm up acquires nodes from {', '.join(UP_PROVIDERS)} "
                   f"({why_not(opts.provider, 'slurm-nodes')})")


def up(opts: UpOptions, *, ledger: "Ledger", say: Say | None = None,
       confirm: Callable[[Any], bool] | None = None) -> ClusterState:
    """Acquire ``opts.nodes`` nodes, record the cluster as a run, build Slurm on them over SSH and wait until
    ``sinfo`` shows every node idle; returns the cluster's state.  On any failure the nodes are released (shielded
    from one Ctrl-C), the run is recorded as failed and the error re-raised."""
    from broker.run.runrecord import Context, Declined, Hooks, end_run, new_run
    from broker.run.guard import shielded

    if not 1 <= opts.nodes <= 64:
        raise BadInput(f"--nodes {opts.nodes}: a cluster has 1 to 64 nodes")
    if opts.max_hours <= 0:
        raise BadInput("--max-hours must be positive")
    name = opts.name or f"c{secrets.token_hex(3)}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}", name):
        raise BadInput(f"--name {name!r}: letters, digits, '-' and '_' (at most 40, starting with a letter or digit)")
    recipe = cluster_recipe(name, opts.nodes, max_hours=opts.max_hours, budget_usd=opts.budget_usd,
                            gpus_per_node=opts.gpus_per_node, cpu_ok=opts.cpu_only)
    from broker.money.journal import failsafe

    ledger = failsafe(ledger, say)  # a ledger it cannot write never stops the release below
    hooks = Hooks(say=say, confirm=confirm)
    ctx = Context(ledger=ledger, hooks=hooks)
    target = _target(opts, recipe)
    target.check()
    quote = target.quote()
    if quote is not None and confirm is not None and not confirm(quote):
        raise Declined("not confirmed: nothing was created", hint="run again and answer y, or pass --yes")
    target.prepare(ctx)
    if opts.watchdog and not capability(opts.provider, "rents"):  # a rented cloud's target arms it in prepare
        _start_watchdog(ctx)
    run = new_run(ledger, recipe, provider=target.provider, topology=TOPOLOGY, plan=target.plan_record())
    ledger.event(run.id, "cli", "start", f"slurm cluster {name}: {target.describe()}")
    ctx.say(f"cluster {run.id}: acquiring {opts.nodes} node(s) on {opts.provider}")
    try:
        cluster = target.acquire(run, ctx)
        ledger.update_run(run.id, status="provisioning", topology=TOPOLOGY)
        state = build(cluster, run, name=name, provider=opts.provider, say=ctx.say,
                      netns_cid=getattr(getattr(target, "cluster_state", None), "cid", None),
                      idle_timeout_s=opts.idle_timeout_s, max_hours=opts.max_hours)
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        message = getattr(e, "message", None) or str(e) or type(e).__name__
        try:
            with shielded(say):
                left, _ = target.release(run, ctx, keep=False)
        finally:
            end_run(ledger, run.id, None, status=status, message=f"slurm up failed: {message}", say=say)
        raise
    # the cluster outlives this CLI: no driving pid (the watchdog's dead-CLI rule must not end it); the deadline
    # and the budget still apply
    ledger.update_run(run.id, status="running", pid=None,
                      message=f"Slurm cluster {name} up: {len(state.nodes)} node(s) idle")
    ledger.event(run.id, "cli", "slurm-up", f"{len(state.nodes)} node(s) idle; shared dir {state.shared_dir}")
    return state


def _start_watchdog(ctx: Any) -> None:
    from broker.core.config import settings

    if not settings().broker_watchdog_autostart:
        return
    from broker.money.watchdog import start_detached

    pid = start_detached()
    if pid:
        ctx.say(f"watchdog started (pid {pid}); it enforces the cluster's deadline even after this CLI exits")


def build(cluster: "Cluster", run: "Run", *, name: str, provider: str, say: Say, netns_cid: str | None = None,
          idle_timeout_s: float = 120.0, max_hours: float | None = None) -> ClusterState:
    """Build Slurm on the acquired ``cluster`` over SSH (module docstring steps 1-5); returns the saved state."""
    from broker.run.sshcluster import SSHCluster

    run_dir = Path(run.run_dir or ".")
    netns = not capability(provider, "rents")  # nodes nobody rents are this machine's (the netns emulation)
    base = str(run_dir.resolve() / "cluster") if netns else f"{CLOUD_BASE}/{run.id}"
    shared = f"{base}/shared" if netns else CLOUD_SHARED_DIR
    note = (f"{provider} nodes share this machine's file system: the same path on every node" if netns else
            f"NFS from node 0 ({cluster.nodes[0].private_ip}) mounted at the same path on every node")
    t0 = time.monotonic()
    ssh = SSHCluster(cluster, run_dir=run_dir)
    try:
        _open(ssh, timeout_s=300.0 if not netns else 30.0)
        say(f"reached {len(cluster.nodes)} node(s) over SSH")
        from broker.run.sshcluster import arequire_root

        # every step below that touches /var/lib, /srv, /etc or starts a daemon runs as root (sudo -n on a VM
        # whose login user is the image's): a login user without passwordless sudo is named before anything
        for r in ssh.gather([arequire_root(ssh, i, "slurm") for i in range(len(cluster.nodes))], timeout=60):
            if isinstance(r, BaseException):
                raise r
        facts = [parse_facts(_must(ssh, i, FACTS_CMD, "read node facts")) for i in range(len(cluster.nodes))]
        _ensure_binaries(ssh, facts, netns=netns, say=say)
        nodes = []
        for i, (cn, f) in enumerate(zip(cluster.nodes, facts)):
            devs = [int(g) for g in cn.gpu_indices] if cn.gpu_indices else [g[0] for g in f["gpus"]]
            nodes.append(NodeFacts(name=f"node{i}", host=cn.host, port=cn.port, user=cn.user,
                                   private_ip=cn.private_ip, hostname=f["hostname"] or f"node{i}", cpus=f["cpus"],
                                   memory_mb=f["memory_mb"], gpus=len(devs), gpu_devices=devs,
                                   gpu_name=f["gpus"][0][1] if f["gpus"] else "",
                                   host_key_alias=host_key_name(cn.host, cn.port, cn.resource_id)
                                   if cn.resource_id else ""))
        state = ClusterState(cluster_id=run.id, name=name, provider=provider, base=base, shared_dir=shared,
                             shared_note=note, python=cluster.python, ssh_key_path=cluster.ssh_key_path,
                             known_hosts_path=cluster.known_hosts_path or str(ssh.known_hosts), nodes=nodes,
                             munge_socket=f"/run/broker-munge-{run.id[-6:]}/munge.socket", netns_cid=netns_cid,
                             munge_user="root" if netns else _munge_user(ssh))
        state.save(run_dir)
        # `broker ssh CLUSTER [NODE]` reads the nodes from here, as for any run (paths and addresses, no secret)
        (run_dir / "cluster.json").write_text(cluster.model_copy(update={
            "known_hosts_path": state.known_hosts_path}).model_dump_json(indent=2))
        say("nodes: " + "; ".join(f"{n.name} {n.private_ip} {n.cpus} CPU, {n.memory_mb} MiB"
                                  + (f", {n.gpus} GPU" if n.gpus else "") for n in nodes))
        conf = render_slurm_conf(cluster_name=f"b{name}"[:40].replace("_", "-"), controller=nodes[0].hostname,
                                 controller_addr=nodes[0].private_ip, nodes=nodes, base=base,
                                 munge_socket=state.munge_socket, spool_dir=state.spool_dir,
                                 max_minutes=int(max_hours * 60) + 1 if max_hours else None)
        gres = render_gres_conf(nodes)
        key = secrets.token_bytes(1024)  # the cluster's MUNGE key: in memory, then 0400 files on the nodes
        writes = []
        for i in range(len(nodes)):
            if netns and i > 0:
                targets = []  # one file system: node 0's copies of the configs are every node's
            else:
                targets = [(conf.encode(), f"{base}/etc/slurm.conf", 0o644), (gres.encode(), f"{base}/etc/gres.conf",
                                                                              0o644)]
            writes.append(_prepare_node(ssh, state, i, key, targets, netns=netns))
        for r in ssh.gather(writes, timeout=120):
            if isinstance(r, BaseException):
                raise r
        del key
        if not netns:
            _cloud_network(ssh, state, say)
            state.save(run_dir)  # the shared directory's note
        cg = cgroup_mount_script() if netns else CLOUD_CGROUPS.format(script=cgroup_mount_script())
        say("starting munged, slurmctld (node0) and slurmd on every node")
        _must(ssh, 0, start_script(state, 0, cgroups=cg), "start munged/slurmctld/slurmd on node0", timeout=60,
              root=True)
        outs = ssh.gather([ssh.arun(i, _root(ssh, i, start_script(state, i, cgroups=cg)), timeout=60)
                           for i in range(1, len(nodes))], timeout=90)
        for i, r in enumerate(outs, start=1):
            if isinstance(r, BaseException):
                raise r
            if r[0] != 0:
                raise ProviderError("slurm", f"start node{i}", f"exit {r[0]}: {r[1].strip()[-500:]}\n"
                                    + _logs(ssh, state, i))
        _wait_idle(ssh, state, idle_timeout_s)
        say(f"sinfo on node0: {len(nodes)} node(s) idle after {time.monotonic() - t0:.1f} s")
        return state
    finally:
        ssh.close()


def _open(ssh: "SSHCluster", timeout_s: float) -> None:
    stop = time.monotonic() + timeout_s
    while True:
        try:
            ssh.open()
            return
        except ProviderError:
            if time.monotonic() > stop:
                raise
            time.sleep(2.0)


def _root(ssh: "SSHCluster", i: int, cmd: str) -> str:
    """``cmd`` run as root on node ``i`` (through ``sudo -n`` when its login user is not root)."""
    from broker.run.sshcluster import as_root

    return as_root(cmd, ssh.cluster.nodes[i])


def _munge_user(ssh: "SSHCluster") -> str:
    """``munge`` when every node has that account (the munge package makes it), else root."""
    ok = all(ssh.run(i, "id -u munge", timeout=20)[0] == 0 for i in range(len(ssh.cluster.nodes)))
    return "munge" if ok else "root"


def _must(ssh: "SSHCluster", i: int, cmd: str, what: str, *, timeout: float = 60.0, root: bool = False) -> str:
    code, out = ssh.run(i, _root(ssh, i, cmd) if root else cmd, timeout=timeout)
    if code != 0:
        raise ProviderError("slurm", what, f"node{i}: exit {code}: {out.strip()[-800:]}")
    return out


def _ensure_binaries(ssh: "SSHCluster", facts: list[dict], *, netns: bool, say: Say) -> None:
    missing = sorted({b for f in facts for b in f["missing"]})
    if not missing:
        return
    if netns:
        raise ProviderError("slurm", "check binaries", f"netns nodes use this machine's binaries and "
                            f"{', '.join(missing)} are missing here",
                            hint="apt-get install -y slurm-wlm munge")
    say(f"installing slurm-wlm and munge ({', '.join(missing)} missing)")
    cmd = ("export DEBIAN_FRONTEND=noninteractive; for k in 1 2 3; do apt-get update -q && apt-get install -y -q "
           "slurm-wlm munge nfs-kernel-server nfs-common && break; sleep 10; done; "
           "systemctl disable --now slurmd slurmctld >/dev/null 2>&1; true")
    for r in ssh.gather([ssh.arun(i, _root(ssh, i, cmd), timeout=900) for i in range(len(facts))], timeout=960):
        if isinstance(r, BaseException):
            raise r
    for i in range(len(facts)):
        left = parse_facts(_must(ssh, i, FACTS_CMD, "read node facts"))["missing"]
        if left:
            raise ProviderError("slurm", "apt-get install", f"node{i} still lacks {', '.join(left)}",
                                hint="check the image (Debian/Ubuntu with apt) and the node's access to its mirror")


async def _prepare_node(ssh: "SSHCluster", state: ClusterState, i: int, key: bytes,
                        files: list[tuple[bytes, str, int]], *, netns: bool) -> None:
    q = shlex.quote
    d = state.node_dir(i)
    mu = state.munge_user
    code, out = await ssh.arun(i, _root(ssh, i, (
        f"set -e; umask 022; mkdir -p {q(state.base)}/etc {q(d)}/munge {q(state.shared_dir)}/tmp; "
        f"chmod 700 {q(d)}/munge; rm -f {q(d)}/munge/munge.key; "
        f"chmod 1777 {q(state.shared_dir)} {q(state.shared_dir)}/tmp"
        + (f"; chown {q(mu)}: {q(d)}/munge" if mu != "root" else ""))))
    if code != 0:
        raise ProviderError("slurm", f"prepare node{i}", f"exit {code}: {out.strip()[-300:]}")
    await _aput_as_root(ssh, i, key, f"{d}/munge/munge.key", 0o400, owner=mu)
    for data, path, mode in files:
        await _aput_as_root(ssh, i, data, path, mode)


async def _aput_as_root(ssh: "SSHCluster", i: int, data: bytes, path: str, mode: int, *, owner: str = "root") -> None:
    """Write ``data`` to ``path`` on node ``i`` as root (the folders are root's), owned by ``owner`` with ``mode``:
    sent on stdin (base64), never on a command line; the file is created 0600 (umask 077), given its owner and
    mode, then renamed into place, so a key is never readable by anyone else, even for a moment."""
    import base64

    q = shlex.quote
    fill = "base64 -d" if data else ":"  # an empty file (gres.conf without GPUs): no stdin to wait for
    script = (f"set -e; umask 077; t={q(path)}.new; rm -f \"$t\"; {fill} > \"$t\"; "
              + (f"chown {q(owner)}: \"$t\"; " if owner != "root" else "")
              + f"chmod {mode:o} \"$t\"; mv -f \"$t\" {q(path)}")
    code, out = await ssh.arun(i, _root(ssh, i, script), timeout=60,
                               input=base64.b64encode(data).decode() if data else None)
    if code != 0:
        raise ProviderError("slurm", f"write {path} on node{i}", f"exit {code}: {out.strip()[-300:]}")


def _cloud_network(ssh: "SSHCluster", state: ClusterState, say: Say) -> None:
    """Cloud VMs: every node's name in /etc/hosts (jobs use ``node0`` as MASTER_ADDR) and the NFS share."""
    hosts = "".join(f"{n.private_ip} {n.name}\n" for n in state.nodes)
    q = shlex.quote
    cmd = (f"grep -v ' node[0-9]*$' /etc/hosts > /etc/hosts.broker; printf %s {q(hosts)} >> /etc/hosts.broker; "
           "cat /etc/hosts.broker > /etc/hosts; rm -f /etc/hosts.broker")
    for i in range(len(state.nodes)):
        _must(ssh, i, cmd, "write /etc/hosts", root=True)
    shared_on = _already_shared(ssh, state)
    if shared_on:
        # a cluster file system (or one disk behind every node) is already there: an NFS export over it would
        # only add a second path to the same files
        say(f"{state.shared_dir} is already one file system on every node ({shared_on}): no NFS export needed")
        state.shared_note = f"{state.shared_dir}: already shared by the nodes (a file written on node0 is seen on " \
                            "every node)"
        return
    cidr = private_cidr([n.private_ip for n in state.nodes])
    say(f"NFS: {state.shared_dir} exported from node0 to {cidr}")
    _must(ssh, 0, nfs_server_script(state.shared_dir, cidr), "NFS export on node0", timeout=120, root=True)
    for i in range(1, len(state.nodes)):
        _must(ssh, i, nfs_client_script(state.nodes[0].private_ip, state.shared_dir), "NFS mount", timeout=400,
              root=True)


def _already_shared(ssh: "SSHCluster", state: ClusterState) -> str:
    """A marker written into the shared directory on node 0 and looked for on the others: "" when some node does
    not see it (NFS is needed), else a note saying so."""
    if len(state.nodes) < 2:
        return "one node"
    q = shlex.quote
    marker = f"{state.shared_dir}/.broker-shared-{secrets.token_hex(4)}"
    _must(ssh, 0, f"mkdir -p {q(state.shared_dir)} && echo {q(state.cluster_id)} > {q(marker)}", "shared dir marker",
          root=True)
    try:
        for i in range(1, len(state.nodes)):
            code, out = ssh.run(i, f"cat {q(marker)} 2>/dev/null", timeout=20)
            if code != 0 or out.strip() != state.cluster_id:
                return ""
        return f"node0's marker file seen on node1..node{len(state.nodes) - 1}"
    finally:
        ssh.run(0, _root(ssh, 0, f"rm -f {q(marker)}"), timeout=20)


def _logs(ssh: "SSHCluster", state: ClusterState, i: int, n: int = 15) -> str:
    q = shlex.quote
    files = [f"{state.node_dir(i)}/slurmd.log", f"{state.node_dir(i)}/munge/munged.log",
             f"{state.node_dir(i)}/slurmd.console"]
    if i == 0:
        files += [f"{state.ctld_dir}/slurmctld.log", f"{state.ctld_dir}/slurmctld.console"]
    cmd = "; ".join(f"[ -f {q(f)} ] && echo '--- {f}' && tail -n {n} {q(f)}" for f in files) + "; true"
    try:
        return ssh.run(i, _root(ssh, i, cmd), timeout=20)[1]
    except Exception as e:  # noqa: BLE001 - logs are a courtesy in an error message
        return f"(cannot read node{i}'s logs: {e})"


def _wait_idle(ssh: "SSHCluster", state: ClusterState, timeout_s: float) -> None:
    stop = time.monotonic() + timeout_s
    names = {n.name for n in state.nodes}
    out = ""
    while True:
        code, out = ssh.run(0, sinfo_cmd(state), timeout=20)
        if code == 0:
            rows = parse_sinfo_nodes(out)
            if {r["name"] for r in rows if r["state"] == "idle"} >= names:
                return
        if time.monotonic() > stop:
            logs = "\n".join(_logs(ssh, state, i) for i in range(len(state.nodes)))
            raise ProviderError("slurm", "sinfo", f"the nodes are not idle after {timeout_s:.0f} s (sinfo: "
                                f"{out.strip()[-300:]!r})\n{logs}",
                                hint="the daemons' logs are above; `broker slurm down` removes the cluster")
        time.sleep(0.3)


# --------------------------------------------------------------------------------------------------- lookup
def find(ledger: "Ledger", cluster_id: str) -> tuple["Run", ClusterState]:
    """The cluster's run and state; BadInput when ``cluster_id`` is not a Slurm cluster broker built."""
    run = ledger.get_run(cluster_id)
    if run is None or run.topology != TOPOLOGY:
        raise BadInput(f"no Slurm cluster {cluster_id!r} in the ledger",
                       hint="`broker slurm up` prints the id; `broker status` lists runs (topology slurm-cluster)")
    from broker.core.runfolder import confined_run_dir

    return run, ClusterState.load(confined_run_dir(run))  # a ledger row's folder: only <home>/runs/<id>


def attach(opts: "SlurmOptions", ledger: "Ledger | None" = None):
    """For ``broker run --provider slurm --cluster ID``: a SlurmProvider whose commands run on node 0 of the
    cluster, and ``opts`` pointed there (host label, the shared directory for job folders, the nodes' Python)."""
    from broker.money.accounting import ACTIVE_STATUSES
    from broker.money.ledger import Ledger
    from broker.providers import get_provider

    led = ledger or Ledger()
    run, state = find(led, opts.cluster or "")
    if run.status not in ACTIVE_STATUSES:
        raise BadInput(f"Slurm cluster {run.id} is {run.status}, not up",
                       hint="start one with `broker slurm up --provider netns --nodes 2`")
    prov = get_provider("slurm")  # the adapter through the registry: this layer imports none
    prov.shell = node0_shell(state)
    # the job's ledger row names node 0 as a login ([user@]host, what its schema takes); commands still go through
    # the cluster's shell above (its key and pinned host key)
    n0 = state.nodes[0]
    prov.host = opts.host = f"{n0.user}@{n0.host}"
    opts.remote_base = f"{state.shared_dir}/jobs"
    if opts.python in (None, "", "python3"):
        opts.python = state.python
    return prov


# --------------------------------------------------------------------------------------------------- exec
def exec_on_cluster(ledger: "Ledger", run_id: str, command: list[str], *, echo: Say | None = None,
                    timeout_s: float = 600.0) -> int | None:
    """``broker exec CLUSTER -- CMD``: run ``command`` on every node of the Slurm cluster ``run_id`` (id or unique
    prefix) over SSH with ``SLURM_CONF`` set, printing ``[node i] line``; returns the highest exit status.  None
    when ``run_id`` is not a cluster from ``broker slurm up`` (the caller runs a recipe instead).  Raises BadInput
    when the cluster is down or no command is given."""
    from broker.money.accounting import ACTIVE_STATUSES
    from broker.core.records import Cluster
    from broker.run.sshcluster import run_on_every_node

    try:
        run = ledger.find_run(run_id)
    except BrokerError:
        return None
    if run.topology != TOPOLOGY:
        return None
    if not command:
        raise BadInput(f"no command for cluster {run.id}", hint=f"broker exec {run.id} -- sinfo -N")
    if run.status not in ACTIVE_STATUSES:
        raise BadInput(f"Slurm cluster {run.id} is {run.status}, not up",
                       hint="start one with `broker slurm up --provider netns --nodes 2`")
    from broker.core.runfolder import check_cluster, confined_run_dir

    folder = confined_run_dir(run)  # a ledger row's folder is input: only <home>/runs/<run id>
    state = ClusterState.load(folder)
    cl = Cluster.model_validate_json((folder / "cluster.json").read_text()) \
        if (folder / "cluster.json").exists() else None
    if cl is not None:
        check_cluster(cl, run, folder)
    if cl is None:
        from broker.core.model import TopologyKind
        from broker.core.records import ClusterNode

        cl = Cluster(run_id=state.cluster_id, provider=state.provider, topology=TopologyKind.multi_node,
                     nodes=[ClusterNode(node_rank=i, host=n.host, port=n.port, user=n.user, private_ip=n.private_ip)
                            for i, n in enumerate(state.nodes)],
                     ssh_key_path=state.ssh_key_path, known_hosts_path=state.known_hosts_path)
    echo = echo or print
    line = f"export SLURM_CONF={shlex.quote(state.conf)}; " + (command[0] if len(command) == 1 else
                                                               shlex.join(command))
    return run_on_every_node(cl, line, run_dir=folder, echo=echo, timeout_s=timeout_s)


# --------------------------------------------------------------------------------------------------- status
def status(ledger: "Ledger", cluster_id: str) -> dict[str, Any]:
    """Nodes with their Slurm state, the queue, cost so far and the deadline (``broker slurm status``)."""
    from broker.money.accounting import ACTIVE_STATUSES
    from broker.money.cost import run_spent_usd

    run, state = find(ledger, cluster_id)
    out: dict[str, Any] = {"cluster_id": run.id, "name": state.name, "provider": state.provider,
                           "status": run.status, "deadline": run.deadline.isoformat() if run.deadline else None,
                           "budget_usd": run.budget_usd, "cost_usd": round(run_spent_usd(ledger, run.id), 6),
                           "shared_dir": state.shared_dir, "slurm_conf": state.conf, "nodes": [], "queue": [],
                           "error": None}
    if run.status not in ACTIVE_STATUSES:
        out["nodes"] = [{"name": n.name, "state": "down", "cpus": n.cpus, "gpus": n.gpus} for n in state.nodes]
        return out
    sh = node0_shell(state)
    try:
        out["nodes"] = parse_sinfo_nodes(sh.text(["sinfo", "-h", "-N", "-o", "%N|%T|%c|%G"], call="sinfo",
                                                 timeout=30))
        q = sh.text(["squeue", "-h", "-o", "%i|%j|%T|%M|%D|%R"], call="squeue", timeout=30)
        for line in q.strip().splitlines():
            f = (line.split("|") + [""] * 6)[:6]
            out["queue"].append({"job_id": f[0], "name": f[1], "state": f[2], "time": f[3], "nodes": f[4],
                                 "reason": f[5]})
    except BrokerError as e:
        out["error"] = e.message
    return out


# --------------------------------------------------------------------------------------------------- down
def down(ledger: "Ledger", cluster_id: str, *, say: Say | None = None, actor: str = "cli") -> list[str]:
    """Stop the daemons by PID, release the nodes through the cluster's target, check that nothing is left; the
    run ends ``torn_down``.  Returns what is still there (empty = nothing)."""
    from broker.run.runrecord import Context, Hooks, end_run
    from broker.run.guard import shielded

    from broker.money.journal import failsafe

    ledger = failsafe(ledger, say)  # a ledger it cannot write never stops the release below
    run, state = find(ledger, cluster_id)
    say = say or (lambda _m: None)
    stopped = _stop_daemons(state, say)
    ctx = Context(ledger=ledger, hooks=Hooks(say=say), actor=actor)
    ledger.update_run(run.id, status="tearing_down")
    target = _release_target(run, state)
    with shielded(say):
        left_res, _ = target.release(run, ctx, keep=False)
    try:
        close_shell(state)
    except Exception:  # noqa: BLE001 - no lingering connection is fine
        pass
    left = [f"{r.provider} {r.kind} {r.provider_id or r.name} still live" for r in left_res]
    left += leftovers(state)
    msg = (f"Slurm cluster torn down ({stopped} daemon(s) stopped by PID)" if not left else
           "Slurm cluster teardown incomplete: " + "; ".join(left))
    end_run(ledger, run.id, None, status="torn_down" if not left else "failed", message=msg, actor=actor, say=say)
    return left


def _release_target(run: "Run", state: ClusterState):
    from broker.core.model import PlanOption
    from broker.core.target import RunRequest
    from broker.providers import provider_class
    from broker.run.cloudtarget import CloudTarget

    recipe = cluster_recipe(state.name, len(state.nodes), max_hours=1.0, budget_usd=run.budget_usd or 1.0)
    own = provider_class(state.provider).run_target(recipe, RunRequest(provider=state.provider))
    if own is not None:  # the emulation's target, pointed at the namespaces it made (when their state is there)
        if state.netns_cid and hasattr(own, "reattach"):
            own.reattach(Path(run.run_dir or ".").resolve(), state.netns_cid)
        return own
    options = [PlanOption.from_dict(o) for o in (run.plan or {}).get("options", [])]
    return CloudTarget(recipe, options, keep_when_idle=False)


def _stop_daemons(state: ClusterState, say: Say) -> int:
    """SIGTERM (then SIGKILL) every daemon of the cluster by its pid file, over SSH; returns how many pid files
    named a live daemon.  Unreachable nodes are skipped (their release removes everything)."""
    from broker.core.model import TopologyKind
    from broker.core.records import Cluster, ClusterNode
    from broker.run.sshcluster import SSHCluster

    cl = Cluster(run_id=state.cluster_id, provider=state.provider, topology=TopologyKind.multi_node,
                 nodes=[ClusterNode(node_rank=i, host=n.host, port=n.port, user=n.user, private_ip=n.private_ip)
                        for i, n in enumerate(state.nodes)],
                 ssh_key_path=state.ssh_key_path, known_hosts_path=state.known_hosts_path)
    ssh = SSHCluster(cl, run_dir=Path("."), connect_timeout_s=10)
    count = 0
    try:
        for i in range(len(state.nodes)):
            try:
                code, out = ssh.run(i, _root(ssh, i, stop_script(state, i)), timeout=40)
            except BrokerError as e:
                say(f"node{i}: cannot stop its daemons over SSH ({e.message}); releasing the node removes them")
                continue
            m = re.search(r"STOPPED=(\d+)", out)
            count += int(m.group(1)) if m else 0
            still = re.findall(r"STILL=(\d+)", out)
            if still:
                say(f"node{i}: daemons {', '.join(still)} needed SIGKILL")
        say(f"stopped {count} daemon(s) by PID")
    finally:
        ssh.close()
    return count


def leftovers(state: ClusterState) -> list[str]:
    """What of the cluster is still on this machine: namespaces (netns), daemons whose command line names the
    cluster's folder, mounts under it.  Cloud nodes are checked by their release (terminated and confirmed)."""
    out: list[str] = []
    if state.netns_cid:  # the emulated nodes still on this machine, as their provider lists them
        from broker.providers import get_provider

        out += [f"{t.provider} {t.kind} {t.provider_id} still here"
                for t in get_provider(state.provider).list_tagged(state.cluster_id)]
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            st = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if st != "Z" and state.base in cmd and any(x in cmd for x in ("munged", "slurmd", "slurmctld")):
            out.append(f"process {d.name}: {cmd.strip()[:120]}")
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        mounts = []
    out += [f"mount {m.split()[1]}" for m in mounts if len(m.split()) > 1 and m.split()[1].startswith(state.base)]
    return out
