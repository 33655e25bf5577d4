"""Running a recipe on separate hosts over SSH (asyncssh): upload, preflight, setup, torchrun per node, supervise.

:class:`SSHExecutor` is the entry point (run by :func:`broker.run.executor.run_steps`).  Per node ``i`` of the :class:`~broker.core.model.Cluster`:

1. connect (one asyncssh connection per node, kept open; keepalives every 5 s so a dead link is noticed within
   about 15 s); upload the stdlib probe (``broker/run/probe_script.py``) to ``<workroot>/<run_id>/node<i>/probe.py``;
2. preflight (:mod:`broker.run.preflight`): one table of checks; any FAIL ends the run before launch (status
   ``failed``, nothing started);
3. upload the recipe's ``workdir`` (a tar.gz over SFTP, unpacked there) to ``<workroot>/<run_id>/node<i>/work``
   (a per-node folder because simulated nodes on one host, and netns nodes, share one filesystem), started beside
   preflight's checks (a failed preflight cancels it), then the node's environment as ``env.sh`` (mode 0600; values
   never appear on a command line or in the logs; it needs the interface preflight finds);
4. run the recipe's ``setup`` commands once per node (all nodes in parallel);
5. start ``<cluster.python> -m torch.distributed.run --nnodes --nproc_per_node --node_rank=i
   --master_addr=<node 0 private IP> --master_port=<port>`` under ``setsid`` (its process group id goes to
   ``torchrun.pid``) and hand the nodes to :class:`broker.run.supervisor.Supervisor` (``[node i]`` logs, per-node log
   files, stop all when one fails, deadline, Ctrl-C);
6. fetch the recipe's ``artifacts`` from node 0's work folder into the run folder;
7. when the job has ended (success or failure, not Ctrl-C), touch ``<workroot>/job.done`` on every node (best
   effort): the node-side idle stop (recipe ``idle_minutes``) counts from then.

Environment of each node, later layers win: ``PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1``, ``TMPDIR`` in the node's
run folder, ``BROKER_RUN_ID``/``BROKER_NODE_RANK`` (the marker that finds orphans), ``NCCL_SOCKET_IFNAME`` =
``GLOO_SOCKET_IFNAME`` = the interface holding the node's private address (found by preflight; an exact name,
because gloo rejects ``^`` exclusion lists), the recipe's ``env``, ``CUDA_VISIBLE_DEVICES`` from
``ClusterNode.gpu_indices``, then ``ClusterNode.env``.

Stopping a node kills it for real: a second SSH channel runs ``probe.py kill`` which SIGTERMs the process group,
every descendant (torchrun starts its workers in new sessions) and every process whose environment carries this
run's and node's ``BROKER_RUN_ID``/``BROKER_NODE_RANK`` (workers orphaned by a killed torchrun), and SIGKILLs what
is left after the grace period.  A node whose launched process has exited counts as ended even while an orphan
still holds its output open (after ``EXIT_DRAIN_S``).  If the SSH connection of a running node drops, that node counts as failed (exit code None, reason "ssh
connection to node i lost"), the others are stopped, and the caller's teardown still runs.

Host keys are pinned per machine, never per address (:func:`broker.core.sshkeys.host_key_name`): a node with a
resource id is looked up in ``cluster.known_hosts_path`` (without one, ``<run_dir>/known_hosts``) under
``broker-res-<id>`` (OpenSSH's ``HostKeyAlias``).  A machine not pinned yet (a fresh VM, a re-rented one on a
freed address) is accepted on first connect and its key pinned (``accept-new``); a pinned machine that answers
with another key (the same machine started again on a new address, or something else on its address) is
refused at once with :class:`~broker.run.sshcluster.HostKeyChanged`, never retried.  asyncssh is imported
lazily.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import shlex
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from broker.run.executor import Executor, staging_line
from broker.run.launch import RANKSHIM, torchrun_argv
from broker.run.supervisor import RunResult, Supervisor, describe_exit, finish_result, log_tail
from broker.core.records import Cluster
from broker.core.provider import BadInput, ProviderError
from broker.core.recipe import Recipe
from broker.run.sshcluster import Echo, HostKeyChanged, RemoteNode, SSHCluster, node_base, node_python

_log = logging.getLogger(__name__)


if TYPE_CHECKING:
    from broker.run.preflight import PreflightReport
    from broker.run.staging import StagedTar


PROBE_SOURCE = Path(__file__).with_name("probe_script.py")


@dataclass
class RemoteRunResult(RunResult):
    """A :class:`RunResult` plus the preflight report (None when preflight was skipped)."""

    preflight: "PreflightReport | None" = None


def node_env(cluster: Cluster, recipe: Recipe, i: int, iface: str | None) -> dict[str, str]:
    """The environment of node ``i``'s torchrun (layers as in the module docstring)."""
    node = cluster.nodes[i]
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "BROKER_NODE_RANK": str(i),
           "BROKER_RUN_ID": cluster.run_id,
           # torchrun's and the job's temporary files stay in the run's folder on the node
           "TMPDIR": f"{node_base(cluster, i)}/tmp"}
    if iface:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = iface
    env.update(recipe.env)
    if node.gpu_indices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(node.gpu_indices)
    env.update(node.env)
    return env


def env_file(env: dict[str, str], python: str | None = None) -> bytes:
    """``env.sh`` for a node: one quoted ``export`` per variable; with an absolute ``python`` (the training
    interpreter), its ``bin/`` goes first on ``PATH`` so ``setup`` commands use that Python and pip."""
    lines = [f"export {k}={shlex.quote(v)}\n" for k, v in env.items()]
    if python and python.startswith("/"):
        bindir = python.rsplit("/", 1)[0] or "/"
        lines.append(f'export PATH={shlex.quote(bindir)}:"$PATH"\n')
    return "".join(lines).encode()


def launch_command(ssh: SSHCluster, recipe: Recipe, i: int, port: int) -> tuple[str, list[str]]:
    """(shell line run over ssh, the torchrun argv shown in the log) for node ``i``."""
    assert recipe.workdir is not None
    c = ssh.cluster
    base = ssh.base(i)
    argv = torchrun_argv(str(recipe.script.relative_to(recipe.workdir)), recipe.args, nnodes=len(c.nodes),
                         nproc_per_node=recipe.gpus_per_node, node_rank=i, master_addr=c.master_addr,
                         master_port=port, python=node_python(c, i), shim=f"{base}/{SHIM_NAME}", facts_dir=f"{base}/facts")
    q = shlex.quote
    line = (f"cd {q(ssh.work(i))} && . {q(base + '/env.sh')} && exec setsid -w sh -c "
            f"'echo $$ > \"$0\"; exec \"$@\"' {q(base + '/torchrun.pid')} " + " ".join(q(a) for a in argv))
    return line, argv


#: the rank-facts shim's file name in a node's folder (uploaded beside probe.py)
SHIM_NAME = "rankshim.py"


def upload_node_scripts(ssh: SSHCluster, n: int) -> list[Any]:
    """Upload the stdlib probe and the rank-facts shim (:mod:`broker.run.rankshim`) to every node's folder;
    returns one result or exception per node."""
    from broker.run.rankshim import SHIM_FILES

    probe = PROBE_SOURCE.read_bytes()
    # the shim loads its parts from its own folder: every one of them goes beside it
    shim = {name: RANKSHIM.with_name(name).read_bytes() for name in SHIM_FILES}

    async def _one(i: int) -> None:
        await ssh.aput_files(i, [(probe, ssh.probe(i), 0o644)]
                             + [(data, f"{ssh.base(i)}/{name}", 0o644) for name, data in shim.items()])

    return ssh.gather([_one(i) for i in range(n)], timeout=120)


def fetch_facts(ssh: SSHCluster, run_dir: Path, n: int) -> int:
    """Copy every node's rank facts (``<node folder>/facts/rank*.json``, and the flight recorder's
    ``fr_trace_rank*`` dumps) to ``run_dir/node<i>/facts/``, best effort (nodes whose connection is gone are
    skipped); returns how many files came back.  The names are the node's answer: only those two forms, each
    under its size cap."""
    from broker.run.artifacts import ArtifactBudget

    async def _one(i: int) -> int:
        conn = ssh._conns.get(i)
        if conn is None or conn.is_closed():
            return 0
        remote = f"{ssh.base(i)}/facts"
        got = 0
        async with conn.start_sftp_client() as sftp:
            try:
                names = await sftp.listdir(remote)
            except Exception:  # noqa: BLE001 - no facts (the job never started)
                return 0
            from broker.core.private import private_dirs

            dst = private_dirs(Path(run_dir) / f"node{i}" / "facts")
        for name in names:  # a name the node sends back: only rank<r>.json / fr_trace_rank<r>, each capped
            if not isinstance(name, str):
                continue
            if re.fullmatch(r"rank\d{1,6}\.json", name):
                cap = FACTS_MAX_BYTES
            elif re.fullmatch(r"fr_trace_rank\d{1,6}", name):
                cap = FR_TRACE_MAX_BYTES
            else:
                continue
            budget = ArtifactBudget(per_file=cap, total=cap)
            try:
                await afetch_checked(ssh, i, remote, name, dst / name, budget)
                got += 1
            except Exception:  # noqa: BLE001 - a rank without facts: the table uses its log line
                pass
        return got

    res = ssh.gather([_one(i) for i in range(n)], timeout=60)
    return sum(r for r in res if isinstance(r, int))


#: what :class:`SSHExecutor` imports lazily on its way to the launch (connect, boot wait, preflight, staging):
#: :func:`broker.core.warm.warm_imports` loads them while a rented machine boots, off the path to the job
REACH_MODULES = ("asyncssh", "broker.run.rankshim", "broker.run.preflight", "broker.run.staging",
                 "broker.run.stagetar", "pathspec", "tarfile", "broker.run.stall", "broker.run.artifacts",
                 "broker.run.checkpoint")


class SSHExecutor(Executor):
    """The job on ``cluster``'s nodes over SSH (netns hosts, rented VMs): the executor steps of
    :mod:`broker.run.executor`, as laid out in this module's docstring.

    ``port``: the master port (default: random in 29500-29999, checked free by preflight on node 0).
    ``preflight``: run the checks (a FAIL ends the run, status ``failed``, before anything starts).
    ``ready_timeout_s``: how long :meth:`reach` retries SSH connect + auth (nodes that report RUNNING often accept
    SSH 30-60 s later), with exponential backoff capped at 10 s; then it waits for boot scripts
    (``boot_wait``: the adapter's command, :meth:`broker.core.provider.Provider.boot_wait_command`, exit 0 =
    booted; else ``cloud-init status --wait`` where cloud-init exists), at most the remaining time.
    Raises BadInput when the cluster and recipe disagree on the node count.  Node logs: ``run_dir/node<i>.log``;
    preflight: ``run_dir/preflight.json`` and ``preflight.txt``; artifacts: ``run_dir/artifacts/node<i>/``.
    """

    def __init__(self, cluster: Cluster, recipe: Recipe, run_dir: Path, *, echo: Echo = print,
                 port: int | None = None, preflight: bool = True, connect_timeout_s: float = 20.0,
                 ready_timeout_s: float = 0.0, say: Echo = None,
                 on_auth_failure: Callable[[], None] | None = None, boot_wait: str | None = None):
        n = len(cluster.nodes)
        if n != recipe.nodes:
            raise BadInput(f"the cluster has {n} nodes but recipe {recipe.name} asks for {recipe.nodes}")
        self.cluster, self.recipe, self.n = cluster, recipe, n
        from broker.core.private import private_dirs, write_private

        self.run_dir = Path(run_dir)
        private_dirs(self.run_dir)
        self.echo, self.say = echo, say
        self.t0 = time.monotonic()
        self.logs = {i: self.run_dir / f"node{i}.log" for i in range(n)}
        for p in self.logs.values():
            write_private(p, "")
        self.port_given = port is not None
        self.port = port or random.randint(29500, 29999)
        self.do_preflight = preflight
        self.ready_timeout_s = ready_timeout_s
        self.on_auth_failure = on_auth_failure  # e.g. the provider's key API again, when logins are refused
        self.boot_wait = boot_wait  # the adapter's own wait for its boot script (Provider.boot_wait_command)
        self.deadline_s = recipe.max_hours * 3600
        self.ssh = SSHCluster(cluster, run_dir=self.run_dir, connect_timeout_s=connect_timeout_s)
        self.report: "PreflightReport | None" = None
        self.ifaces: dict[int, str] = {}
        #: preflight rows checked before the table's own (a hybrid run's tunnel rows): the first rows of its table
        self.lead_checks: list = []
        #: the work folder's upload started beside preflight: (plan, its tar, the future of every node's upload)
        self._upload: Any = None

    def _say(self, msg: str) -> None:
        if self.echo is not None:
            self.echo(msg)

    def _fail(self, reason: str, *, node: int | None = None) -> RemoteRunResult:
        return RemoteRunResult(status="failed", exit_codes={},  # nothing was started
                               wall_s=time.monotonic() - self.t0, log_paths=self.logs, reason=reason,
                               failed_node=node, preflight=self.report)

    # ------------------------------------------------------------------ steps
    def reach(self) -> RemoteRunResult | None:
        ssh, n = self.ssh, self.n
        try:
            self._open_with_retries()
            if self.ready_timeout_s > 0:
                self._wait_boot()
            errs = upload_node_scripts(ssh, n)
            bad = [(i, e) for i, e in enumerate(errs) if isinstance(e, BaseException)]
            if bad:
                raise ProviderError("ssh", f"upload to node {bad[0][0]}", str(bad[0][1]))
        except ProviderError as e:
            return self._fail(f"{e.message}" + (f" ({e.hint})" if e.hint else ""))
        return None

    def _open_with_retries(self) -> None:
        """Connect to every node; with ``ready_timeout_s`` retry refused / timed-out connects and failed auth
        (keys often arrive after sshd starts) with exponential backoff until that time has passed."""
        stop_at = time.monotonic() + self.ready_timeout_s
        delay, attempt = 1.0, 0
        while True:
            attempt += 1
            try:
                self.ssh.open()
                if attempt > 1 and self.say:
                    self.say(f"every node accepts SSH (attempt {attempt})")
                return
            except HostKeyChanged:
                raise  # waiting longer cannot make a changed key right: say so now
            except ProviderError as e:
                left = stop_at - time.monotonic()
                if left <= 0:
                    if attempt > 1:
                        e.message += f" (retried {attempt} times over {self.ready_timeout_s:.0f} s)"
                    raise
                if self.say and (attempt in (1, 2, 5) or attempt % 10 == 0):
                    self.say(f"waiting for SSH: {e.message}; retrying for up to {left:.0f} s more")
                if self.on_auth_failure is not None and _auth_refused(e) and attempt in (1, 3, 6, 10):
                    self.on_auth_failure()
                from broker.run.guard import check_node_lost

                check_node_lost()  # a node the provider lost will not answer: stop waiting for it
                time.sleep(min(delay, max(0.1, left)))
                delay = min(delay * 2, 10.0)

    def _wait_boot(self) -> None:
        """Wait for boot scripts on every node: the adapter's :attr:`boot_wait` command (exit 0 = booted: its
        boot-done marker is there), else ``cloud-init status --wait`` where cloud-init exists.  Raises
        ProviderError naming the node when a boot script did not finish or failed."""
        cmd = self.boot_wait or (
            "if command -v cloud-init >/dev/null 2>&1; then cloud-init status --wait >/dev/null 2>&1; "
            "cloud-init status 2>/dev/null | tail -1; else echo 'status: no cloud-init'; fi")
        ssh = self.ssh
        t = max(30.0, self.ready_timeout_s)
        remote = [i for i in range(self.n) if not self.cluster.nodes[i].local]  # this machine booted long ago
        outs = ssh.gather([ssh.arun(i, cmd, timeout=t) for i in remote], timeout=t + 30)
        for i, o in zip(remote, outs):
            if isinstance(o, BaseException) or o[0] is None:
                raise ProviderError("ssh", f"boot scripts on node {i}", f"cloud-init did not finish: {o}",
                                    hint="see /var/log/cloud-init-output.log on the node")
            if self.boot_wait and o[0] != 0:
                tail = o[1].strip().splitlines()[-1:] if o[1].strip() else []
                raise ProviderError("ssh", f"boot scripts on node {i}",
                                    f"the boot script did not finish within {t:.0f} s (its boot-done marker is "
                                    f"missing, exit {o[0]}{': ' + tail[0] if tail else ''})",
                                    hint="see /var/log/cloud-init-output.log on the node; `broker down` the run "
                                         "if it is stuck")
            if "error" in o[1].lower():
                raise ProviderError("ssh", f"boot scripts on node {i}", f"cloud-init reported {o[1].strip()}",
                                    hint="see /var/log/cloud-init-output.log on the node")

    def preflight(self) -> RemoteRunResult | None:
        from broker.run import preflight as pf
        ssh, recipe = self.ssh, self.recipe
        if not self.do_preflight:
            self.ifaces = pf.detect_ifaces(ssh)
            return None
        try:
            self._start_upload()  # the work folder travels to every node while the checks run
        except Exception as e:  # noqa: BLE001 - stage() stages it the plain way and reports what fails
            _log.debug("staging beside preflight not started: %s", e)
            self._end_upload(timeout=None)
        report = pf.run_preflight(ssh, recipe, self.port)
        for _ in range(3):  # a randomly chosen master port that is busy on node 0: pick another one
            if self.port_given or not report.only_master_port_busy(self.port):
                break
            self.port = random.randint(29500, 29999)
            report = pf.run_preflight(ssh, recipe, self.port)
        report.checks[:0] = self.lead_checks
        self.report = report
        from broker.core.private import write_private

        write_private(self.run_dir / "preflight.json", json.dumps(report.to_dict(), indent=2))
        text = pf.render_text(report)
        write_private(self.run_dir / "preflight.txt", "\n".join(text) + "\n")
        for line in text:
            self._say(f"[preflight] {line}")
        if not report.ok:
            return self._fail("preflight failed: " + "; ".join(report.failures()))
        self.ifaces = report.ifaces
        return None

    def _stage_plan(self) -> Any:
        """What of the recipe's work folder goes to the nodes, its staging line said (once per run)."""
        from broker.run.staging import recipe_stage_plan

        recipe = self.recipe
        assert recipe.workdir is not None
        plan = recipe_stage_plan(recipe.workdir, recipe.script, recipe.args, checkpoint_dir=recipe.checkpoint_dir,
                                 resume_checkpoint=recipe.resume_checkpoint)
        line = staging_line(plan, self.run_dir)
        if self.say:
            self.say(line)
        return plan

    def _start_upload(self) -> None:
        """Start unpacking the work folder on every node, in the background of the SSH loop: :meth:`stage` waits for
        it and adds each node's environment (which needs the interface preflight finds).  Preflight's checks and
        the upload use the network and the nodes' CPUs at once instead of one after the other."""
        from broker.run.staging import staged_tar

        if self._upload is not None:
            return
        ssh, n, recipe = self.ssh, self.n, self.recipe
        if getattr(recipe, "workdir", None) is None or not Path(recipe.workdir).is_dir():
            return  # stage() names what is wrong
        plan = self._stage_plan()
        tar_cm = staged_tar(plan, self.run_dir)  # one file on disk, streamed to every node
        tar = tar_cm.__enter__()

        async def _all() -> list[Any]:
            return await asyncio.gather(*(ssh.aupload_tgz(i, tar, ssh.work(i)) for i in range(n)),
                                        return_exceptions=True)

        self._upload = (plan, tar_cm, asyncio.run_coroutine_threadsafe(_all(), ssh.loop.loop))

    def _end_upload(self, timeout: float | None) -> list[Any] | None:
        """Wait for :meth:`_start_upload`'s uploads (None: cancel them) and remove the local tar; their results."""
        if self._upload is None:
            return None
        plan, tar_cm, fut = self._upload
        self._upload = None
        try:
            if timeout is None:
                fut.cancel()
                return None
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise
        finally:
            tar_cm.__exit__(None, None, None)

    def stage(self) -> RemoteRunResult | None:
        from broker.run.staging import staged_tar

        ssh, recipe, n = self.ssh, self.recipe, self.n
        envs = [node_env(self.cluster, recipe, i, self.ifaces.get(i)) for i in range(n)]
        if self._upload is not None:  # started beside preflight: the environment is all that is left
            plan = self._upload[0]
            errs = self._end_upload(timeout=600)
            if not any(isinstance(e, BaseException) for e in errs):
                errs = ssh.gather([_prepare_env(ssh, i, envs[i]) for i in range(n)], timeout=600)
        else:
            plan = self._stage_plan()
            with staged_tar(plan, self.run_dir) as tar:  # one file on disk, streamed to every node
                errs = ssh.gather([_prepare(ssh, i, tar, envs[i]) for i in range(n)], timeout=600)
        self.bytes_in = plan.total_bytes * n
        for i, e in enumerate(errs):
            if isinstance(e, BaseException):
                msg = e.message if isinstance(e, ProviderError) else str(e)
                return self._fail(f"preparing node {i} failed: {msg}", node=i)
        return None

    def launch(self) -> RemoteRunResult:
        ssh, recipe, n, logs = self.ssh, self.recipe, self.n, self.logs
        if recipe.setup:
            codes = ssh.gather([_setup(ssh, i, recipe.setup, logs[i], self.echo) for i in range(n)],
                               timeout=self.deadline_s)
            for i, c in enumerate(codes):
                if isinstance(c, BaseException) or c[0] != 0:
                    what = str(c) if isinstance(c, BaseException) else f"(exit {describe_exit(c[0])}): {c[1]}"
                    res = self._fail(f"setup command failed on node {i} {what}", node=i)
                    res.tail = log_tail(logs[i])
                    return res
        nodes: list[RemoteNode] = []
        sup = Supervisor(logs, echo=self.echo)
        if recipe.stall_s:
            from broker.run.stall import StallWatch, remote_sampler, remote_stack_command
            sup.stall = StallWatch(recipe.stall_s, remote_sampler(lambda i, cmd: ssh.run(i, cmd, timeout=15),
                                                                  {i: remote_stack_command(node_python(ssh.cluster, i),
                                                                                           ssh.base(i), SHIM_NAME)
                                                                   for i in range(n)}),
                                   on_stall=recipe.on_stall, run_dir=self.run_dir, echo=self.echo,
                                   world_size=n * recipe.gpus_per_node)
        try:
            for i in range(n):
                line, argv = launch_command(ssh, recipe, i, self.port)
                from broker.run.launch import record_launch

                record_launch(self.run_dir, i, argv)
                nodes.append(RemoteNode(ssh, i, line))
        except BaseException as e:
            sup.stop_all(nodes)  # type: ignore[arg-type]
            if isinstance(e, Exception):
                return self._fail(f"starting torchrun on node {len(nodes)} failed: {e}", node=len(nodes))
            raise
        remaining = max(1.0, self.deadline_s - (time.monotonic() - self.t0))
        base = sup.run(nodes, deadline_s=remaining)  # type: ignore[arg-type]
        # nodes that ended while an orphan still held their output, or ended on their own: sweep their leftovers
        sweep = [threading.Thread(target=nd.stop, args=(1.0,)) for nd in nodes if not nd.finished]
        for th in sweep:
            th.start()
        for th in sweep:
            th.join()
        res = RemoteRunResult(**base.__dict__, preflight=self.report)
        lost = [nd.node_rank for nd in nodes if nd.lost]
        for r in lost:
            res.exit_codes[r] = None
        if lost and res.status == "failed":
            first = res.failed_node if res.failed_node in lost else lost[0]
            res.failed_node = first
            res.reason = (f"ssh connection to node {first} lost (its job's fate is unknown); stopped the other "
                          "nodes")
        fetch_facts(ssh, self.run_dir, n)
        return res

    def checkpoint_source(self, rel_dir: str):
        """``rel_dir`` in node 0's work folder over this executor's SSH connections, restored on every node
        (:class:`broker.run.checkpoint.SSHSource`)."""
        from broker.run.checkpoint import SSHSource

        return SSHSource(self.ssh, rel_dir, list_files=_alist_artifacts, fetch_file=afetch_checked)

    def collects(self) -> bool:
        return bool(self.recipe.artifacts)

    def collect(self, result: RunResult) -> None:
        if self.recipe.artifacts:
            before = _tree_bytes(self.run_dir / "artifacts")
            try:
                _collect_artifacts(self.ssh, self.n, list(self.recipe.artifacts), self.run_dir, result, self.echo)
            finally:
                self.bytes_out += max(0, _tree_bytes(self.run_dir / "artifacts") - before)

    def finish(self, result: RunResult) -> RunResult:
        result.wall_s = time.monotonic() - self.t0
        return finish_result(result, self.recipe.expect, nnodes=self.n, nproc_per_node=self.recipe.gpus_per_node)

    def close(self, job_ended: bool) -> None:
        try:
            self._end_upload(timeout=None)  # a preflight that failed: its upload is of no use
            if job_ended:
                _mark_done(self.ssh, self.n)
        finally:
            self.ssh.close()


def _tree_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder`` (0 when it does not exist); links are not followed."""
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _auth_refused(e: ProviderError) -> bool:
    """An SSH failure where the node answered but refused the login (the key is not there yet)."""
    text = e.message.lower()
    return "permission denied" in text or "authentication" in text


def _mark_done(ssh: SSHCluster, n: int) -> None:
    """Touch ``<workroot>/job.done`` (:func:`broker.core.nodescripts.job_done_path`) on every node, best effort (only
    nodes whose connection is still open; no reconnect): the job has ended, so the node-side idle watch
    (:func:`broker.core.nodescripts.idle_watch_script`) starts counting."""
    def cmd(i: int) -> str:
        root = ssh.root(i).rstrip("/")
        return f"mkdir -p {shlex.quote(root)} && touch {shlex.quote(root + '/job.done')}"

    live = [i for i in range(n) if (c := ssh._conns.get(i)) is not None and not c.is_closed()]
    if not live:
        return
    try:
        ssh.gather([ssh.arun(i, cmd(i), timeout=15) for i in live], timeout=30)
    except Exception:  # noqa: BLE001 - best effort: the watchdog still ends the nodes after idle_minutes
        pass


async def _prepare(ssh: SSHCluster, i: int, tgz: "bytes | StagedTar", env: dict[str, str]) -> None:
    await ssh.aupload_tgz(i, tgz, ssh.work(i))
    await _prepare_env(ssh, i, env)


async def _prepare_env(ssh: SSHCluster, i: int, env: dict[str, str]) -> None:
    """Node ``i``'s environment file (and its TMPDIR), beside the unpacked work folder."""
    if env.get("TMPDIR"):
        await ssh.arun(i, f"mkdir -p {shlex.quote(env['TMPDIR'])}", timeout=30)
    await ssh.aput_bytes(i, env_file(env, node_python(ssh.cluster, i)), ssh.base(i) + "/env.sh", 0o600)


async def _setup(ssh: SSHCluster, i: int, commands: list[str], log: Path, echo: Echo) -> tuple[int | None, str]:
    """Run the setup commands in order on node ``i``, streaming into its log; (exit code, failing command)."""
    import asyncssh

    q = shlex.quote
    conn = await ssh.aconn(i)
    for cmd in commands:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"$ {cmd}\n")
        if echo:
            echo(f"[node {i}] $ {cmd}")
        line = f"cd {q(ssh.work(i))} && . {q(ssh.base(i) + '/env.sh')} && exec bash -c {q(cmd)}"
        _log.debug("ssh node %d: %s", i, line)
        async with conn.create_process(line, stderr=asyncssh.STDOUT, encoding="utf-8", errors="replace") as proc:
            with open(log, "a", encoding="utf-8") as f:
                async for out in proc.stdout:
                    f.write(out if out.endswith("\n") else out + "\n")
                    f.flush()
                    if echo:
                        echo(f"[node {i}] {out.rstrip()}")
            await proc.wait()
        if proc.returncode != 0:
            return proc.returncode, cmd
    return 0, ""


#: the most bytes the node's answer to the artifact listing may hold (a node that answers endlessly is refused)
LISTING_MAX_BYTES = 16 << 20
#: the most bytes one rank-facts file may hold
#: a flight-recorder dump (pickled entries of the last collectives per rank), bytes
FR_TRACE_MAX_BYTES = 64 << 20
FACTS_MAX_BYTES = 1 << 20

_LISTER = ("import glob, json, os, sys; pats = sys.argv[1:]; "
           "print(json.dumps(sorted({p for pat in pats for p in glob.glob(pat, recursive=True) "
           "if os.path.isfile(p) or os.path.islink(p)})))")


async def _alist_artifacts(ssh: SSHCluster, i: int, patterns: list[str], *, folder: str | None = None,
                           lister: str = _LISTER, missing_ok: bool = False) -> list[Any]:
    """The names node ``i`` says match ``patterns`` in its work folder (unchecked: the caller validates each).
    ``folder`` / ``lister``: another folder and listing script (the checkpoint copy-back's, with sizes);
    ``missing_ok``: a folder that does not exist lists as empty.
    Raises RefusedArtifact when the answer is over :data:`LISTING_MAX_BYTES` or not a JSON list."""
    from broker.run.artifacts import RefusedArtifact

    q = shlex.quote
    where = q(folder or ssh.work(i))
    cmd = (f"[ -d {where} ] || {{ echo '[]'; exit 0; }}; " if missing_ok else "") + \
        f"cd {where} && {ssh.py(i)} -c {q(lister)} " + " ".join(q(p) for p in patterns)
    conn = await ssh.aconn(i)
    chunks, size = [], 0
    async with conn.create_process(cmd, encoding="utf-8", errors="replace") as proc:
        async def _read() -> None:
            nonlocal size
            while data := await proc.stdout.read(1 << 16):
                size += len(data)
                if size > LISTING_MAX_BYTES:
                    raise RefusedArtifact(f"the node's list of artifacts is over {LISTING_MAX_BYTES >> 20} MiB")
                chunks.append(data)
        await asyncio.wait_for(_read(), 60)
        await asyncio.wait_for(proc.wait(), 30)
    if proc.returncode != 0:
        return []
    try:
        names = json.loads("".join(chunks).strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RefusedArtifact("the node's list of artifacts is not JSON") from None
    if not isinstance(names, list):
        raise RefusedArtifact("the node's list of artifacts is not a list")
    return names


async def afetch_checked(ssh: SSHCluster, i: int, folder: str, rel: str, dst: Path, budget: Any) -> int:
    """Copy ``<folder>/<rel>`` from node ``i`` to the new local file ``dst`` over SFTP, within ``budget``
    (:class:`broker.run.artifacts.ArtifactBudget`, counted while the bytes come: a node may misreport a size); returns
    the bytes written.  Raises RefusedArtifact when the node resolves the path (SFTP ``realpath``: symlinks
    followed) outside ``folder``, or to something that is not a regular file, or over a cap (the partial file is
    removed); asyncssh's SFTP errors when it cannot be read."""
    import stat as st

    from broker.run.supervisor import READ_CHUNK
    from broker.run.artifacts import RefusedArtifact, open_artifact

    conn = await ssh.aconn(i)
    async with conn.start_sftp_client() as sftp:
        base = (await sftp.realpath(folder)).rstrip("/") + "/"
        real = await sftp.realpath(f"{folder}/{rel}")
        if not real.startswith(base):
            raise RefusedArtifact(f"a symlink to {real!r}, outside node {i}'s work folder")
        attrs = await sftp.stat(real)
        if attrs.permissions is None or not st.S_ISREG(attrs.permissions):
            raise RefusedArtifact("not a regular file")
        budget.check(attrs.size or 0)
        got = 0
        try:
            async with sftp.open(real, "rb") as f:
                with open_artifact(dst) as out:
                    while data := await f.read(READ_CHUNK):
                        got += len(data)
                        budget.check(got)
                        out.write(data)
        except BaseException:
            dst.unlink(missing_ok=True)
            raise
    budget.used += got
    return got


def _collect_artifacts(ssh: SSHCluster, n: int, patterns: list[str], run_dir: Path, result: RunResult,
                       echo: Echo, budget: Any = None) -> None:
    """Fetch the files matching the recipe's ``artifacts`` globs from EVERY node's work folder into
    ``run_dir/artifacts/node<i>/`` (nodes whose connection is gone are skipped and named).  Every name a node sends
    back is checked before anything is written (:func:`broker.run.artifacts.artifact_destination`, then
    :func:`afetch_checked`); a refused one fails the run with its name and why."""
    from broker.run.artifacts import ArtifactBudget, RefusedArtifact, artifact_destination, record_artifacts

    budget = budget or ArtifactBudget()
    found: dict[int, list[str]] = {}
    refused: dict[int, list[str]] = {}
    safe = [p for p in patterns if not (Path(p).is_absolute() or ".." in Path(p).parts)]
    for i in range(n):
        got: list[str] = []
        bad: list[str] = refused.setdefault(i, [])
        found[i] = got
        root = run_dir / "artifacts" / f"node{i}"
        try:
            names = ssh.loop.call(_alist_artifacts(ssh, i, safe), timeout=120) if safe else []
        except RefusedArtifact as e:
            bad.append(f"(the listing) ({e})")
            continue
        except Exception as e:  # noqa: BLE001 - the node is gone: its artifacts count as missing below
            if echo:
                echo(f"[broker] artifacts of node {i} could not be listed: {e}")
            continue
        for rel in names:
            shown = repr(rel) if isinstance(rel, str) else repr(rel)[:80]
            try:
                if len(got) >= budget.max_files:
                    raise RefusedArtifact(f"more than {budget.max_files} files")
                dst = artifact_destination(root, rel)
                ssh.loop.call(afetch_checked(ssh, i, ssh.work(i), rel, dst, budget), timeout=3600)
                got.append(rel)
            except RefusedArtifact as e:
                bad.append(f"{shown} ({e})")
            except Exception as e:  # noqa: BLE001 - named in the log; a missing artifact fails the run below
                if echo:
                    echo(f"[broker] artifact {shown} could not be fetched from node {i}: {e}")
    record_artifacts(result, patterns, found, run_dir, echo, refused)
