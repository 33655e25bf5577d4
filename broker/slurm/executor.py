"""The Slurm executor: a recipe's job submitted as the sbatch script :mod:`broker.slurm.sbatch` renders, its
per-node logs followed, its state polled to the end (cancelled at the deadline, on Ctrl-C, on a stall or when Slurm
will never start it), its outputs and checkpoints fetched.

The rendering names stay importable from here (``render_sbatch``, ``slurm_time``, ``check_time``, ...).
"""

from __future__ import annotations

import re
import shlex
import time as time_mod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from broker.run.supervisor import RunResult

from broker.run.executor import Executor
from broker.core.provider import BadInput
from broker.core.recipe import Recipe
from broker.slurm.sbatch import (PORT_BASE, PORT_SPAN, batch_log_path, check_time, job_name,  # noqa: F401 - the
                                 node_log_path, node_log_pattern, render_sbatch, slurm_time,  # rendering's names
                                 time_seconds)  # as callers import them from here

# --------------------------------------------------------------------------------------------------- running
class LogFollower:
    """Tails files on the cluster (through the provider's shell) into local files and the console.

    Each followed file has a label (``node 0``, ``batch``); complete lines are appended to the local copy and
    echoed as ``[label] line``; a last partial line is kept until it is complete or :meth:`pump` is called with
    ``final=True``.
    """

    def __init__(self, shell, echo: Callable[[str], None] | None):
        self.shell = shell
        self.echo = echo
        self.files: list[dict] = []
        #: called whenever a followed file grew (the stall watch's last-output time)
        self.on_data: Callable[[], None] | None = None

    def add(self, label: str, remote: str, local: Path) -> None:
        local.write_text("")
        self.files.append({"label": label, "remote": remote, "local": local, "offset": 0, "partial": b""})

    def pump(self, final: bool = False) -> None:
        for f in self.files:
            data = self.shell.read_from(f["remote"], f["offset"])
            if not data and not (final and f["partial"]):
                continue
            f["offset"] += len(data)
            if data and self.on_data is not None:
                self.on_data()
            buf = f["partial"] + data
            lines = buf.split(b"\n")
            f["partial"] = lines.pop()
            if final and f["partial"]:
                lines.append(f["partial"])
                f["partial"] = b""
            if not lines:
                continue
            text = [ln.decode("utf-8", errors="replace").rstrip("\r") for ln in lines]
            with open(f["local"], "a", encoding="utf-8") as out:
                out.write("".join(t + "\n" for t in text))
            if self.echo is not None:
                for t in text:
                    self.echo(f"[{f['label']}] {t}")


_SRUN_ERR = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (Exited with exit code (\d+)|Terminated|Killed"
                       r"|.*)$", re.MULTILINE)


def _task_ids(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def node_exit_codes(batch_log: str, nnodes: int, job_ok: bool) -> tuple[dict[int, int | None], int | None]:
    """Per-node exit codes from srun's error lines in the batch log, and the node that failed first.

    With ``--ntasks-per-node=1`` task *i* runs on node *i*.  ``srun: error: node1: task 1: Exited with exit code 1``
    gives node 1 code 1; ``Terminated``/``Killed`` (a peer stopped by ``--kill-on-bad-exit``) give -15/-9.  Nodes
    without a line get 0 when the job succeeded, else None (unknown).  The failing node is the first one that
    exited with a non-zero code of its own (not a signal), else the first one that was signalled.
    """
    codes: dict[int, int | None] = {i: (0 if job_ok else None) for i in range(nnodes)}
    exited, signalled = [], []
    for m in _SRUN_ERR.finditer(batch_log):
        for t in _task_ids(m.group(2)):
            if t >= nnodes:
                continue
            if m.group(4) is not None:
                codes[t] = int(m.group(4))
                exited.append(t)
            elif m.group(3) == "Terminated":
                codes[t] = -15
                signalled.append(t)
            elif m.group(3) == "Killed":
                codes[t] = -9
                signalled.append(t)
    failed = next((t for t in exited if codes[t]), None)
    if failed is None and signalled:
        failed = signalled[0]
    return codes, failed


def stack_step_argv(job_id: str, nnodes: int, python: str, shim: str, facts_dir: str) -> list[str]:
    """The ``srun`` step that prints the stacks of the ranks of every node of job ``job_id``: one
    ``rankshim.py --dump-stacks`` per node, each printing its answer in short tagged lines
    (:func:`broker.run.rankshim.frame_answer`; srun interleaves long lines of several tasks).

    ``--overlap``: the step shares the CPUs, memory and GPUs of the training step (without it, it would wait
    for them, i.e. for ever); ``--ntasks-per-node=1``: one reader per node, which signals only the ranks of its own
    host (the facts folder is shared by every node; a pid means something only on its own host)."""
    return ["srun", f"--jobid={job_id}", "--overlap", f"--nodes={nnodes}", "--ntasks-per-node=1", "--quiet",
            "--kill-on-bad-exit=0", python, shim, "--dump-stacks", facts_dir]


def slurm_sampler(sh, job_id: str, nnodes: int, python: str, shim: str, facts_dir: str,
                  before: Callable[[], None] | None = None, timeout_s: float = 40.0):
    """A :data:`broker.run.stall.Sampler` for a running Slurm job: :func:`stack_step_argv` through the provider's
    shell (here or over ssh to the login node).  ``before`` runs first (the log follower's pump: output that came
    in the meantime counts as progress).  A step that fails or times out gives no stacks (an empty sample)."""

    def sample() -> dict[str, dict]:
        if before is not None:
            before()
        cp = sh.run(stack_step_argv(job_id, nnodes, python, shim, facts_dir), call="srun --dump-stacks",
                    timeout=timeout_s)
        from broker.run.stall import stack_answers

        out = cp.stdout.decode("utf-8", "replace") if isinstance(cp.stdout, bytes) else str(cp.stdout or "")
        return stack_answers(out)

    return sample


@dataclass
class SlurmOptions:
    """Where and how to submit: ``host`` (``user@login`` for SSH, None = this machine), partition, account,
    ``time`` (HH:MM:SS; default from max_hours), ``python`` on the nodes, poll interval in seconds."""

    host: str | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    python: str = "python3"
    poll_s: float = 0.5
    cancel_timeout_s: float = 60.0
    max_poll_errors: int = 30
    #: a Slurm cluster broker built (``broker slurm up``): its id; commands then run on its node 0
    #: (:func:`broker.slurm.cluster.attach`)
    cluster: str | None = None
    #: folder on the cluster's shared file system for job folders (``<remote_base>/<run id>``); None = the login
    #: user's ``~/.broker/slurm`` (remote) or the run folder (here)
    remote_base: str | None = None


class SlurmExecutor(Executor):
    """The job as one sbatch job on a Slurm cluster (here or through ``opts.host``): the executor steps of
    :mod:`broker.run.executor`.

    Ledger: one ``slurm_job`` resource (``usd_per_hour`` 0) written *before* ``sbatch`` and given the job id right
    after, so ``broker down`` can scancel it.  Logs: ``<run dir>/node<i>.log`` (copies of the per-node Slurm logs,
    streamed as ``[node i]``) and ``<run dir>/batch.log`` (the batch step, streamed as ``[batch]``).  The deadline
    (``max_hours``) and Ctrl-C end the job with ``scancel``.  Raises ProviderError when submission fails (nothing
    left running).
    """

    def __init__(self, recipe: Recipe, prov, opts: "SlurmOptions", *, run, ledger, gpus: bool,
                 echo: Callable[[str], None] | None):
        self.recipe, self.prov, self.opts, self.run, self.ledger, self.gpus = recipe, prov, opts, run, ledger, gpus
        self.echo = echo
        self.sh = prov.shell
        self.run_dir = Path(run.run_dir or ".")
        self.name = job_name(recipe)
        if opts.remote_base:  # a cluster's shared folder (`broker slurm up`)
            base = f"{opts.remote_base.rstrip('/')}/{run.id}"
        else:
            base = f"{self.sh.home()}/.broker/slurm/{run.id}" if opts.host else str(self.run_dir / "slurm")
        self.base = base
        self.work, self.log_dir, self.script_path = f"{base}/work", f"{base}/logs", f"{base}/job.sbatch"
        self.shim_path, self.facts_dir = f"{base}/rankshim.py", f"{base}/facts"
        self.attrs = {"host": opts.host, "log_dir": self.log_dir, "script": self.script_path}
        if opts.cluster:
            self.attrs["cluster"] = opts.cluster
        self.job_id: str | None = None
        self.res_id: str | None = None
        self.logs = {i: self.run_dir / f"node{i}.log" for i in range(recipe.nodes)}
        self.t0 = time_mod.monotonic()

    def stage(self) -> None:
        from broker.run.staging import recipe_stage_plan, staged_tar

        recipe, sh = self.recipe, self.sh
        sh.mkdir(self.base)
        assert recipe.workdir is not None
        plan = recipe_stage_plan(recipe.workdir, recipe.script, recipe.args, checkpoint_dir=recipe.checkpoint_dir,
                                 resume_checkpoint=recipe.resume_checkpoint)
        from broker.run.executor import staging_line

        line = staging_line(plan, self.run_dir if str(self.run_dir) != "." else None)
        if self.echo:
            self.echo(f"[slurm] {line}")
        with staged_tar(plan, self.run_dir if str(self.run_dir) != "." else None) as tar:
            sh.put_tgz(tar, self.work)  # streamed from one file on disk: memory stays flat
        sh.mkdir(self.log_dir)  # before sbatch: Slurm cannot open --output files in a missing directory
        from broker.run.launch import RANKSHIM
        from broker.run.rankshim import SHIM_FILES

        for name in SHIM_FILES:  # rank facts for any script (the summary's rank table); the parts go beside it
            sh.write(f"{self.base}/{name}", RANKSHIM.with_name(name).read_text())
        sh.mkdir(self.facts_dir)
        script = render_sbatch(recipe, partition=self.opts.partition, account=self.opts.account,
                               time=self.opts.time, log_dir=self.log_dir, python=self.opts.python, workdir=self.work,
                               gpus=self.gpus, shim=self.shim_path, facts_dir=self.facts_dir)
        sh.write(self.script_path, script)
        from broker.core.private import mask_secrets, write_private

        write_private(self.run_dir / "job.sbatch", mask_secrets(script))  # the run folder's copy: no secret values
        return None

    def launch(self) -> "RunResult":
        """Submit the job, follow its logs and state to its end (or cancel it at the deadline, on Ctrl-C, a stall
        or a job Slurm will never start) and return how it ended.  Raises ProviderError when sbatch fails or the
        job cannot be followed for ``opts.max_poll_errors`` polls in a row."""
        job_id = self._submit()
        follower = LogFollower(self.sh, self.echo)
        follower.add("batch", batch_log_path(self.log_dir, self.name, job_id), self.run_dir / "batch.log")
        for i in range(self.recipe.nodes):
            follower.add(f"node {i}", node_log_path(self.log_dir, self.name, job_id, i), self.logs[i])
        watch = self._stall_watch(follower, job_id)
        try:
            status, reason, info, stalled = self._follow(job_id, follower, watch)
        except KeyboardInterrupt:
            status, reason, info, stalled = ("interrupted", f"interrupted (Ctrl-C); cancelled Slurm job {job_id}",
                                             None, False)
        if status is not None:  # deadline, Ctrl-C, a stall or hopeless: scancel and wait for a final state
            info = self._cancel_and_wait(follower, job_id)
        follower.pump(final=True)
        assert info is not None
        if info.done:
            self.ledger.update_resource(self.res_id, state="terminated", terminated_by="cli", actor="cli",
                                        message=f"Slurm job {job_id} ended: {info.state}, exit {info.exit_code}",
                                        attrs={"nodes": info.nodes, "final_state": info.state})
        return self._result(job_id, info, status, reason, stalled)

    def _submit(self) -> str:
        """sbatch the script, its ``slurm_job`` row written first (ledger-first: a crash in between is resolved by
        the run tag); returns the job id."""
        ledger, run, where = self.ledger, self.run, self.sh.where
        res = ledger.record_intent(run.id, "slurm", "slurm_job", self.name, usd_per_hour=0.0, deadline=run.deadline,
                                   attrs=self.attrs)
        self.res_id = res_id = res.id
        try:
            job_id = self.prov.submit(self.script_path, run_id=run.id)
        except BaseException as e:
            # sbatch either printed a job id or submitted nothing; a crash in between is resolved by the run tag
            ledger.update_resource(res_id, state="terminated", error=str(e)[:500], actor="cli",
                                   message="sbatch failed: nothing was submitted")
            raise
        self.job_id = job_id
        ledger.mark_created(res_id, job_id, state="running")
        ledger.event(run.id, "cli", "submitted", f"Slurm job {job_id} {where}", resource_id=res_id)
        if self.echo:
            self.echo(f"[slurm] submitted job {job_id} {where}; script {self.script_path}")
        return job_id

    def _follow(self, job_id: str, follower: LogFollower, watch: Any) -> tuple[str | None, str, Any, bool]:
        """Stream the job's logs and poll its state until it ends (status None) or broker must cancel it: Slurm
        will never start it, the recipe's deadline passed, or the stall watch names a hang.  Returns (status,
        reason, the last JobInfo, whether it stalled)."""
        from broker.core.provider import ProviderError

        recipe, ledger, run, prov, opts, attrs, echo = (self.recipe, self.ledger, self.run, self.prov, self.opts,
                                                        self.attrs, self.echo)
        deadline_s = recipe.max_hours * 3600
        info = None
        last_state = ""
        next_state = 0.0
        poll_s = max(opts.poll_s, 2.0) if opts.host else opts.poll_s  # each poll is an ssh round trip there
        errors = 0
        while True:
            now = time_mod.monotonic()
            fresh = None
            try:
                follower.pump()
                if now >= next_state:
                    fresh = prov.job(job_id, attrs=attrs)
                    next_state = now + poll_s
                errors = 0
            except ProviderError as e:  # an ssh blip or a slow slurmctld: keep following, give up after a while
                errors += 1
                if errors >= opts.max_poll_errors:
                    raise
                if echo:
                    echo(f"[slurm] cannot follow job {job_id} right now ({e.message}); retrying")
                time_mod.sleep(poll_s)
                continue
            if fresh is not None:
                info = fresh
                if info.state != last_state:
                    last_state = info.state
                    if watch is not None and info.state == "RUNNING":
                        watch.last_output = watch.clock()  # silence counts from the start, not from sbatch
                    ledger.event(run.id, "cli", "job_state", f"{job_id} {info.state} {info.reason}".strip(),
                                 resource_id=self.res_id)
                    if echo and info.state in ("PENDING", "RUNNING"):
                        echo(f"[slurm] job {job_id} {info.state}"
                             + (f" ({info.reason})" if info.reason and info.state == "PENDING" else ""))
                if info.done:
                    return None, "", info, False
                if info.hopeless:
                    return "failed", (f"Slurm will never start job {job_id} as submitted (pending: {info.reason}); "
                                      "cancelled it"), info, False
            if now - self.t0 > deadline_s:
                if watch is not None and last_state == "RUNNING":
                    watch.at_deadline()  # where every rank was: a deadline report is never empty
                return "deadline", f"deadline of {deadline_s:.0f} s reached; cancelled Slurm job {job_id}", info, False
            if watch is not None and last_state == "RUNNING" and watch.check():
                return "failed", f"{watch.reason}; cancelled Slurm job {job_id}", info, True
            time_mod.sleep(poll_s)

    def _cancel_and_wait(self, follower: LogFollower, job_id: str) -> Any:
        """scancel the job and wait up to ``opts.cancel_timeout_s`` for a final state; returns the last JobInfo."""
        prov, opts, attrs = self.prov, self.opts, self.attrs
        self._quiet_after_cancel(follower, job_id)
        prov.cancel(job_id, attrs=attrs)
        stop_by = time_mod.monotonic() + opts.cancel_timeout_s
        info = prov.job(job_id, attrs=attrs)
        while not info.done and time_mod.monotonic() < stop_by:
            time_mod.sleep(opts.poll_s)
            info = prov.job(job_id, attrs=attrs)
        return info

    def _result(self, job_id: str, info: Any, status: str | None, reason: str, stalled: bool) -> "RunResult":
        """The run's result from the job's final ``info`` and the batch log's per-node exit codes: ``status`` as
        broker decided it (a cancel), else succeeded or failed with the node that failed first and why."""
        from broker.run.supervisor import RunResult, describe_exit

        recipe = self.recipe
        batch_text = (self.run_dir / "batch.log").read_text(encoding="utf-8", errors="replace")
        job_ok = info.state == "COMPLETED" and (info.exit_code or 0) == 0
        codes, failed = node_exit_codes(batch_text, recipe.nodes, job_ok)
        if status is None:
            if job_ok:
                status = "succeeded"
            else:
                status = "failed"
                if failed is None:
                    failed = 0
                detail = (f"node {failed} exited with code {describe_exit(codes.get(failed))}"
                          if codes.get(failed) is not None else "the job failed")
                host = (f" ({info.nodes[failed]})" if failed < len(info.nodes) and codes.get(failed) is not None
                        else "")
                why = f" ({info.reason})" if info.reason and info.reason != "None" else ""
                reason = (f"{detail}{host}; Slurm job {job_id} {info.state}{why}, ExitCode "
                          f"{info.exit_code}:{info.signal or 0}")
        codes = {k: v for k, v in codes.items() if v is not None}  # nodes whose exit Slurm did not report
        # a stalled job was cancelled by broker: no node failed by itself (the stall names every rank's place)
        return RunResult(status=status, exit_codes=codes, wall_s=time_mod.monotonic() - self.t0, log_paths=self.logs,
                         reason=reason, failed_node=failed if status == "failed" and not stalled else None)

    def _quiet_after_cancel(self, follower: LogFollower, job_id: str) -> None:
        """One console line for the scancel broker is about to send; what the job prints after it (torchrun's
        ``SignalException`` traceback on every node, ~30 lines a node, srun's ``Terminated``) goes to the logs
        only.  The lines printed so far are shown first."""
        if self.echo is None:
            return
        try:
            follower.pump()
        except Exception:  # noqa: BLE001 - the final pump after the cancel copies what is left
            pass
        self.echo(f"[slurm] cancelling job {job_id} (scancel: SIGTERM to every node, SIGKILL after the cluster's "
                  "KillWait); what the nodes print from now on is only in their logs")
        follower.echo = None

    def _stall_watch(self, follower: LogFollower, job_id: str):
        """The stall watch of a running job (None when the recipe's ``stall_s`` is 0): silence measured on the
        followed logs, stacks read on every node by an overlapping ``srun`` step (:func:`slurm_sampler`)."""
        recipe = self.recipe
        if not recipe.stall_s:
            return None
        from broker.run.stall import StallWatch

        watch = StallWatch(recipe.stall_s, slurm_sampler(self.sh, job_id, recipe.nodes, self.opts.python,
                                                         self.shim_path, self.facts_dir, before=follower.pump),
                           on_stall=recipe.on_stall, run_dir=self.run_dir, echo=self.echo,
                           world_size=recipe.world_size)

        def stamp() -> None:
            watch.last_output = watch.clock()

        follower.on_data = stamp
        return watch

    def collects(self) -> bool:
        return bool(self.recipe.artifacts)

    def collect(self, result) -> None:
        """Artifacts from the job folder (one folder that every node of the allocation writes to) into
        ``<run>/artifacts/node0/`` (local clusters; on a remote login node, listed and copied back over ssh)."""
        from broker.run.artifacts import ArtifactBudget, RefusedArtifact, collect_local, record_artifacts

        pats = list(self.recipe.artifacts)
        if not pats:
            return
        root = self.run_dir / "artifacts" / "node0"
        budget = ArtifactBudget()
        found: dict[int, list[str]] = {0: []}
        refused: dict[int, list[str]] = {0: []}
        if self.opts.host is None:
            found[0], refused[0] = collect_local(Path(self.work), pats, root, budget)
        else:
            for pat in pats:
                if Path(pat).is_absolute() or ".." in Path(pat).parts:
                    continue
                try:
                    if self._fetch_remote(pat, root, budget):
                        found[0].append(pat)
                except RefusedArtifact as e:
                    refused[0].append(f"{pat!r} ({e})")
        record_artifacts(result, pats, found, self.run_dir, self.echo, refused)

    def _fetch_remote(self, rel: str, root: Path, budget) -> bool:
        """The job folder's ``rel`` into ``root`` (:meth:`fetch_remote`); False when it is not there."""
        from broker.run.artifacts import artifact_destination

        return SlurmExecutor.fetch_remote(self, self.work, rel, artifact_destination(root, rel), budget) is not None

    def checkpoint_source(self, rel_dir: str):
        """The recipe's ``checkpoint_dir`` in the job folder (shared by every node; rank 0 writes it) as a
        :class:`broker.run.checkpoint.Source` for the copy-back (:mod:`broker.slurm.checkpoint`)."""
        if self.opts.host is None:
            from broker.run.checkpoint import LocalSource

            return LocalSource(Path(self.work) / rel_dir)
        from broker.slurm.checkpoint import ShellSource

        def fetch(folder: str, rel: str, dst: Path, budget) -> int:
            got = self.fetch_remote(folder, rel, dst, budget)
            if got is None:
                raise FileNotFoundError(f"{folder}/{rel} is gone {self.sh.where}")
            return got

        return ShellSource(self.sh, f"{self.work}/{rel_dir}", fetch)

    def fetch_remote(self, base: str, rel: str, dst: Path, budget) -> int | None:
        """Copy ``<base>/<rel>`` from the login node into the new local file ``dst`` within ``budget``; returns the
        bytes written, None when it is not there.  The login node resolves it first (``realpath``): a symlink out
        of ``base``, a file that is not regular or one over a cap is refused (RefusedArtifact), and no more than
        the cap is ever read."""
        import subprocess

        from broker.run.supervisor import READ_CHUNK
        from broker.run.artifacts import RefusedArtifact, write_capped

        q = shlex.quote
        check = (f"w=$(realpath -e -- {q(base)}) && p=$(realpath -e -- {q(base + '/' + rel)}) || exit 3; "
                 'case "$p" in "$w"/*) ;; *) echo "OUTSIDE $p"; exit 0;; esac; '
                 '[ -f "$p" ] || { echo "NOTFILE"; exit 0; }; echo "FILE $(stat -L -c %s -- "$p") $p"')
        cp = self.sh.run(["sh", "-c", check], call="realpath", timeout=30)
        out = cp.stdout.decode("utf-8", "replace").strip() if isinstance(cp.stdout, bytes) else str(cp.stdout)
        if cp.returncode != 0 or not out:
            return None
        kind, _, rest = out.partition(" ")
        if kind == "OUTSIDE":
            raise RefusedArtifact(f"a symlink to {rest!r}, outside {'the job folder' if base == self.work else base}")
        if kind != "FILE":
            raise RefusedArtifact("not a regular file")
        size, _, real = rest.partition(" ")
        budget.check(int(size) if size.isdigit() else 0)
        # streamed, never more than the cap: the file may have grown since, and it may be large
        p = subprocess.Popen(self.sh.argv(["head", "-c", str(budget.per_file + 1), "--", real]),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert p.stdout is not None
        try:
            return write_capped(dst, iter(lambda: p.stdout.read(READ_CHUNK), b""), budget)  # type: ignore[union-attr]
        finally:
            p.stdout.close()
            p.kill()
            p.wait()

    def fetch_facts(self) -> int:
        """Copy the ranks' facts from the job's shared ``facts`` folder into ``<run>/node<i>/facts/`` (node i from
        each file), where the rank table reads them; returns how many.  Best effort: a missing file is a rank
        without facts (the table then uses the log's own RANK line)."""
        import json
        import re
        import shlex

        try:
            names = self.sh.text(["sh", "-c", f"ls {shlex.quote(self.facts_dir)} 2>/dev/null || true"],
                                 call="ls facts").split()
        except Exception:  # noqa: BLE001 - the table falls back to the logs
            return 0
        got = 0
        for name in names:
            if not re.fullmatch(r"rank\d+\.json", name):
                continue
            data = self.sh.read_from(f"{self.facts_dir}/{name}", 0)
            try:
                node = int(json.loads(data).get("node") or 0)
            except (ValueError, TypeError, AttributeError):
                continue
            dst = self.run_dir / f"node{node}" / "facts" / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            got += 1
        return got

    def finish(self, result):
        from broker.run.supervisor import finish_result

        self.fetch_facts()
        result.wall_s = time_mod.monotonic() - self.t0
        return finish_result(result, list(self.recipe.expect), nnodes=self.recipe.nodes,
                             nproc_per_node=self.recipe.gpus_per_node)

    def close(self, job_ended: bool) -> None:
        if not job_ended and self.job_id is not None:  # crashed or interrupted before a result: cancel it
            try:
                self.prov.cancel(self.job_id, attrs=self.attrs)
            except Exception:  # noqa: BLE001 - the ledger row stays live; broker down retries
                pass


def slurm_preconditions(recipe: Recipe, prov, opts: "SlurmOptions") -> bool:
    """Check the partition can serve ``recipe``; returns whether it has GPUs.  Raises NoValidPlan / BadInput."""
    from broker.core.provider import NoValidPlan

    sh = prov.shell
    gpus = prov.has_gpus(opts.partition)
    if not gpus and not recipe.cpu_ok:
        raise NoValidPlan(f"the Slurm partition {opts.partition or '(default)'} {sh.where} has no GPUs "
                          f"(sinfo shows no gpu GRES) and {recipe.name} needs {recipe.world_size}",
                          hint="choose a GPU partition (BROKER_SLURM_PARTITION), or set cpu_ok: true for a gloo check")
    have = prov.partition_nodes(opts.partition)
    if have is None and opts.partition:
        raise BadInput(f"the Slurm cluster {sh.where} has no partition {opts.partition!r}",
                       hint="see `sinfo` for the partitions; set BROKER_SLURM_PARTITION to one of them")
    if have is not None and have < recipe.nodes:
        raise NoValidPlan(f"the Slurm partition {opts.partition or '(default)'} {sh.where} has {have} node(s); "
                          f"{recipe.name} needs {recipe.nodes}",
                          hint="choose a bigger partition (BROKER_SLURM_PARTITION) or lower 'nodes' in the recipe")
    return gpus
