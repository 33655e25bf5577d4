"""``broker slurm submit FILE.sh --cluster ID [-- ARGS]``: a user's own sbatch file on a cluster ``broker slurm up``
built.

1. **Check** before anything is queued: the ``#SBATCH`` header against the cluster's real nodes (``sinfo -h -o
   '%P|%l|%D|%N'``, ``scontrol show node -o``) and the launch lines (:mod:`broker.lint.shell`), each finding with
   ``file:line``, what the cluster has and the fix.  A finding in :data:`broker.lint.shell.FATAL` (the job cannot run
   as written) refuses the submission (BadInput, exit 2) unless ``yes``.
2. **A run** in the ledger: provider ``slurm``, topology ``slurm``, the cluster's deadline and budget, one
   ``slurm_job`` resource written before ``sbatch`` (``attrs.cluster``: ``broker down RUN`` scancels it through
   node 0); so ``broker status``, ``broker logs RUN [--node I]`` and ``broker cost`` show it.
3. **Stage** the file's folder (``broker.run.staging``: .gitignore / .brokerignore respected) to
   ``<shared dir>/jobs/<run id>/work`` and create the folders of ``--output``/``--error`` there (Slurm cannot open
   a file in a missing folder: the job would end at once with no log).
4. **sbatch** ``--chdir=<work>`` (a relative ``--chdir`` of the file taken against ``<work>``) with the cluster's Python first on ``PATH``
   (``torchrun`` and ``python`` of the nodes), ``--comment=broker-run=<run id>``, the script's own arguments.
5. **Follow**: ``squeue`` (PENDING with its reason, RUNNING), then ``sacct``/``scontrol`` for the final state
   (COMPLETED, FAILED, TIMEOUT, CANCELLED, ...); the job's ``StdOut``/``StdErr`` (``scontrol show job``) are
   streamed as they grow, ``srun --label`` lines (``3: text``) tagged ``[node i]`` (task // ntasks-per-node),
   others ``[batch]`` (the batch shell runs on node 0).  Copies land in the run folder: the two files as Slurm
   named them under ``outputs/`` (:func:`output_copy`: never over broker's own ``recipe.json`` or ``node0.log``),
   ``node<i>.log`` per node.  The cluster's deadline and Ctrl-C end the job with ``scancel``.
6. **Stall watch** (``stall_s`` seconds, default 60 as a recipe's; 0 turns it off), as ``broker run`` has: the job's
   ranks are not started by broker, so a ``sitecustomize.py`` first on the job's ``PYTHONPATH`` gives every torchrun
   worker (``RANK`` set) rank facts and stacks on ``SIGUSR1`` (:func:`broker.run.rankshim.attach`); when the followed
   files are silent for ``stall_s`` while the job runs, the ranks' stacks are read on every node by an overlapping
   ``srun`` step (:func:`broker.slurm.executor.slurm_sampler`) and :class:`broker.run.stall.StallWatch` names the
   hang (``[broker] rank 0 waits in all_reduce ...``, ``<run>/stall.json``); ``on_stall`` ``stop`` (the default, as
   the recipe field of ``broker run``) then scancels the job, ``report`` lets it run on.
7. **End** with the Slurm state, the exit code and the diagnosis: the catalogue :func:`broker.run.diagnose.explain`
   uses for ``broker run``, plus "only node 0 ever started: torchrun is not under srun" when a multi-node job
   whose torchrun runs in the batch shell did not complete.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from broker.core.provider import BadInput, ProviderError

if TYPE_CHECKING:
    from broker.money.ledger import Ledger
    from broker.lint.kinds import Finding
    from broker.lint.shell import ClusterNodes

Say = Callable[[str], None]
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
#: control characters a node's output may not send to the terminal (tab kept)
_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x9b]")


@dataclass
class Outcome:
    """How a submitted job ended: the run id, Slurm's job id, ``state`` (Slurm's word), ``exit_code``/``signal``
    (``ExitCode=code:signal``), ``status`` (succeeded | failed | deadline | interrupted), the findings printed
    before submission, the local copies of the logs and the diagnosis lines."""

    run_id: str
    job_id: str | None
    state: str
    exit_code: int | None
    signal: int | None
    status: str
    findings: list["Finding"] = field(default_factory=list)
    log_paths: dict[int, Path] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    #: what Slurm itself says of a job that ended without writing any output (read before the diagnosis)
    slurm_notes: list[str] = field(default_factory=list)

    @property
    def exit_status(self) -> int:
        """The CLI's exit status: 0 completed with code 0, 130 interrupted, 1 otherwise."""
        return 0 if self.status == "succeeded" else 130 if self.status == "interrupted" else 1


def cluster_nodes(sh: Any, deadline: Any = None) -> "ClusterNodes":
    """What the cluster's nodes offer, asked on node 0 (``sinfo`` partitions with MaxTime, ``scontrol show node``
    CPUs, memory, GPUs) and the minutes left before ``deadline`` (a datetime).  Raises ProviderError when Slurm
    does not answer."""
    from broker.core.model import utcnow
    from broker.lint.shell import ClusterNodes, parse_scontrol_nodes, parse_sinfo_partitions

    parts = parse_sinfo_partitions(sh.text(["sinfo", "-h", "-o", "%P|%l|%D|%N"], call="sinfo", timeout=30))
    nodes = parse_scontrol_nodes(sh.text(["scontrol", "show", "node", "-o"], call="scontrol show node", timeout=30))
    left = (deadline - utcnow()).total_seconds() / 60 if deadline is not None else None
    return ClusterNodes(parts, nodes, minutes_left=left)


def check(script: Path, cluster: "ClusterNodes", *, where: str) -> list["Finding"]:
    """The launch-line findings and the header-against-cluster findings of ``script``, sorted by line."""
    from broker.lint.shell import check_against_cluster, lint_shell, sbatch_nodes

    text = script.read_text(encoding="utf-8", errors="replace")
    shown = str(script)
    found = lint_shell(text, shown, nodes=sbatch_nodes(text)) + check_against_cluster(text, shown, cluster,
                                                                                       where=where)
    return sorted(found, key=lambda f: (f.line, f.kind))


def expand_pattern(pattern: str, *, job_id: str, name: str, user: str = "root", node: str = "node0") -> str:
    """sbatch's filename pattern (``%j %J %A %x %u %N %n %t %a %%``) for the batch step's own files."""
    subs = {"j": job_id, "J": job_id, "A": job_id, "a": "4294967294", "x": name, "u": user, "N": node, "n": "0",
            "t": "0", "s": "batch", "%": "%"}
    return re.sub(r"%(\d*)([jJAaxuNnts%])", lambda m: subs[m.group(2)].zfill(int(m.group(1) or 0)), pattern)


#: the folder of a run's folder that holds the copies of the job's own ``--output``/``--error`` files
OUTPUTS = "outputs"


def output_copy(run_dir: Path, remote: str, fallback: str) -> tuple[Path, str | None]:
    """Where the copy of the job's output file ``remote`` (a path on the cluster, as Slurm names it: the job's
    ``--output``/``--error``, so the job's to choose) goes: ``<run_dir>/outputs/<its file name>``, never beside
    broker's own files; a name that is not a plain file name there (control characters, ``..``, empty) gets
    ``fallback`` instead, and the second value says why (None when the name was taken)."""
    from pathlib import PurePosixPath

    from broker.run.artifacts import RefusedArtifact, artifact_destination

    root = run_dir / OUTPUTS
    name = PurePosixPath(remote).name
    try:
        return artifact_destination(root, name), None
    except RefusedArtifact as e:
        return root / fallback, f"{name!r} ({e})"


class _Stream:
    """One remote file followed by offset; complete lines are handed to ``on_line``."""

    def __init__(self, sh: Any, remote: str, local: Path, on_line: Callable[[str], None]):
        from broker.run.artifacts import open_artifact

        self.sh, self.remote, self.local, self.on_line = sh, remote, local, on_line
        self.offset, self.partial = 0, b""
        open_artifact(local).close()  # a new file (0600, its folder 0700), never through a link

    def pump(self, final: bool = False) -> None:
        data = self.sh.read_from(self.remote, self.offset)
        if data:
            self.offset += len(data)
            with open(self.local, "ab") as f:
                f.write(data)
        buf = self.partial + data
        lines = buf.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        for ln in lines:
            self.on_line(ln.decode("utf-8", errors="replace").rstrip("\r"))


def submit(ledger: "Ledger", cluster_id: str, script: Path, args: list[str] | None = None, *, yes: bool = False,
           echo: Say | None = None, say: Say | None = None, poll_s: float = 1.0,
           report: Callable[[list["Finding"]], None] | None = None, stall_s: float = 60.0,
           on_stall: str = "stop") -> Outcome:
    """Check, record, stage, sbatch and follow ``script`` on the cluster ``cluster_id`` (module docstring).

    ``echo`` gets each log line (``[node i] ...`` / ``[batch] ...``) and the stall watch's ``[broker] ...`` lines,
    ``say`` progress, ``report`` the findings before anything is queued; ``stall_s``: seconds of silence before the
    ranks' stacks are read (0: no stall watch), ``on_stall``: ``stop`` (scancel a stalled job) or ``report``.  Raises BadInput (not a cluster, the cluster is down, a file that cannot be read, a
    finding that means it cannot run and no ``yes``), ProviderError (Slurm or SSH refused)."""
    from broker.money.journal import failsafe

    ledger = failsafe(ledger, say)  # the job's cancel and end never wait for a ledger it cannot write
    from broker.money.accounting import ACTIVE_STATUSES
    from broker.run.supervisor import RunResult
    from broker.run.runrecord import end_run, new_run
    from broker.providers import get_provider
    from broker.lint.shell import header, sbatch_nodes
    from broker.slurm.cluster import find, node0_shell

    say = say or (lambda _m: None)
    run_c, state = find(ledger, cluster_id)
    if run_c.status not in ACTIVE_STATUSES:
        raise BadInput(f"Slurm cluster {run_c.id} is {run_c.status}, not up",
                       hint="start one with `broker slurm up --provider netns --nodes 2`")
    script = Path(script)
    sh = node0_shell(state)
    text, facts, findings, fatal = _checked_file(sh, script, run_c, yes=yes, report=report)
    h = header(text)
    nnodes = sbatch_nodes(text)
    per_node = int(h["ntasks-per-node"].value) if "ntasks-per-node" in h and \
        h["ntasks-per-node"].value.isdigit() else 1
    name = h["job-name"].value if "job-name" in h else script.name
    recipe = _job_recipe(script, nnodes, facts, run_c, args=args, stall_s=stall_s, on_stall=on_stall)
    run = new_run(ledger, recipe, provider="slurm", topology="slurm",
                  plan={"cluster": run_c.id, "script": str(script.resolve()), "findings": len(findings)})
    ledger.update_run(run.id, deadline=run_c.deadline, budget_usd=run_c.budget_usd)  # the cluster's clock and budget
    run_dir = Path(run.run_dir or ".")
    ledger.event(run.id, "cli", "start", f"sbatch {script.name} on Slurm cluster {run_c.id}"
                 + (f" ({len(fatal)} finding(s) overridden by --yes)" if fatal else ""))
    (run_dir / script.name).write_text(text)

    prov = get_provider("slurm")  # the adapter through the registry: this layer imports none
    prov.shell, prov.host = sh, sh.host
    base = f"{state.shared_dir}/jobs/{run.id}"
    work = f"{base}/work"
    # the row names node 0 as a login ([user@]host, what its schema takes); commands go through the cluster's shell
    n0 = state.nodes[0]
    attrs = {"host": f"{n0.user}@{n0.host}", "cluster": run_c.id, "script": f"{work}/{script.name}"}
    job_id: str | None = None
    status, reason = "failed", ""
    info = None
    res_id = None
    out = Outcome(run.id, None, "NOT_SUBMITTED", None, None, "failed", findings=findings)
    t0 = time.monotonic()
    try:
        chdir = _stage(sh, script, h, base=base, work=work, run_dir=run_dir, say=say)
        res = ledger.record_intent(run.id, "slurm", "slurm_job", name, usd_per_hour=0.0, deadline=run_c.deadline,
                                   attrs=attrs)
        res_id = res.id
        # on the command line it wins over the file's own: a relative `#SBATCH --chdir=.` would be taken against
        # the home of the user slurmd runs the job as (/root), not the staged folder
        extra = [f"--chdir={chdir}"]
        prefix, stall = _job_prefix(sh, state, base, stall_s=stall_s, on_stall=on_stall)
        try:
            job_id = prov.submit(f"{work}/{script.name}", run_id=run.id, extra=extra, args=list(args or []),
                                 prefix=prefix)
        except BaseException as e:
            ledger.update_resource(res_id, state="terminated", error=str(e)[:500], actor="cli",
                                   message="sbatch failed: nothing was submitted")
            raise
        out.job_id = job_id
        ledger.mark_created(res_id, job_id, state="running")
        ledger.event(run.id, "cli", "submitted", f"Slurm job {job_id} on cluster {run_c.id}", resource_id=res_id)
        say(f"submitted job {job_id} ({name}, {nnodes} node(s)) on cluster {run_c.id}; run {run.id}")
        status, reason, info, out = _follow(prov, sh, attrs, job_id, run, run_c.deadline, h, name, per_node,
                                            nnodes, run_dir, out, echo=echo, say=say, poll_s=poll_s, ledger=ledger,
                                            res_id=res_id, stall=stall)
    except BaseException as e:
        # the job is cancelled unless it ended on its own (info): a failure or Ctrl-C leaves nothing queued
        _end_after_failure(ledger, prov, run, e, job_id=job_id if info is None else None, named_job=job_id,
                           attrs=attrs, res_id=res_id, say=say)
        raise
    if info is not None and info.done and res_id:
        ledger.update_resource(res_id, state="terminated", terminated_by="cli", actor="cli",
                               message=f"Slurm job {job_id} ended: {info.state}, exit {info.exit_code}",
                               attrs={"nodes": info.nodes, "final_state": info.state})
    out.status = status
    # Slurm reports one exit code for the batch step, not one per node: per-node codes only when all is well
    result = RunResult(status=status, exit_codes={i: 0 for i in out.log_paths} if status == "succeeded" else {},
                       wall_s=time.monotonic() - t0, log_paths=out.log_paths, reason=reason)
    out.diagnosis = diagnose(out, findings, nnodes, run_dir, result)
    if out.diagnosis:
        (run_dir / "diagnosis.txt").write_text("\n".join(out.diagnosis) + "\n")
    end_run(ledger, run.id, result, status=status, message=end_message(job_id, out, reason))
    return out


def _checked_file(sh: Any, script: Path, run_c: Any, *, yes: bool,
                  report: Callable[[list["Finding"]], None] | None) -> tuple[str, "ClusterNodes", list["Finding"],
                                                                                list["Finding"]]:
    """Read ``script`` and check it against the cluster's real nodes (``sh``: node 0's shell); ``report`` gets
    the findings.  Returns (its text, the nodes' facts, the findings, the fatal ones).  Raises BadInput (a file
    that cannot be read; a fatal finding and no ``yes``: nothing is queued)."""
    from broker.lint.shell import FATAL

    try:
        text = script.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise BadInput(f"{script}: cannot read it ({e.strerror or e})", hint="give the path of your sbatch file") \
            from None
    facts = cluster_nodes(sh, run_c.deadline)
    findings = check(script, facts, where=f"cluster {run_c.id}")
    if report:
        report(findings)
    fatal = [f for f in findings if f.kind in FATAL]
    if fatal and not yes:
        raise BadInput(f"{script} cannot run as written on cluster {run_c.id}: {len(fatal)} problem(s), each at its "
                       "line above; nothing was queued",
                       hint="fix those lines (the fix is under each), or pass --yes to submit it anyway")
    return text, facts, findings, fatal


def _job_recipe(script: Path, nnodes: int, facts: "ClusterNodes", run_c: Any, *, args: list[str] | None,
                stall_s: float, on_stall: str) -> Any:
    """The recipe the job's run is recorded with: ``nnodes`` CPU nodes, the time the cluster has left (an hour
    when unknown) and its budget, the script's folder and arguments, the stall watch's settings.  Raises BadInput
    for ``stall_s`` outside 0..86400 seconds or ``on_stall`` not ``stop`` / ``report``."""
    from broker.slurm.cluster import cluster_recipe

    minutes = facts.minutes_left if facts.minutes_left is not None else 60.0
    recipe = cluster_recipe(re.sub(r"[^A-Za-z0-9_-]", "-", script.stem)[:30] or "job", max(1, nnodes),
                            max_hours=max(minutes / 60, 1 / 3600), budget_usd=run_c.budget_usd or 0.0)
    if not 0 <= stall_s <= 86400:  # a recipe's stall_s bounds (NaN fails too)
        raise BadInput(f"--stall-s {stall_s:g} is outside 0..86400 seconds", hint="--stall-s 60 (0: no stall watch)")
    if on_stall not in ("stop", "report"):
        raise BadInput(f"--on-stall {on_stall!r} is not stop or report", hint="--on-stall stop (the default) or "
                       "--on-stall report")
    return recipe.model_copy(update={"name": f"sbatch-{script.stem}", "script": script.resolve(),
                                     "workdir": script.resolve().parent, "args": list(args or []),
                                     "stall_s": float(stall_s), "on_stall": on_stall})


def _stage(sh: Any, script: Path, h: dict, *, base: str, work: str, run_dir: Path, say: Say) -> str:
    """Copy the script's folder to ``work`` on the cluster and create the job's --output/--error folders there;
    returns the job's folder (``--chdir``)."""
    from broker.run.executor import staging_line
    from broker.run.staging import stage_plan, tar_staged

    plan = stage_plan(script.resolve().parent)
    say(staging_line(plan, run_dir) + f" -> {work}")
    sh.mkdir(base)
    sh.put_tgz(tar_staged(plan), work)
    chdir = job_dir(h, work)
    made = _output_dirs(h, chdir)
    if made:
        sh.text(["mkdir", "-p", *made], call="mkdir")
        say(f"created {', '.join(os.path.relpath(d, work) + '/' for d in made)} in the job folder (Slurm "
            "cannot open --output/--error files in a missing folder: the job would end at once with no log)")
    return chdir


def _job_prefix(sh: Any, state: Any, base: str, *, stall_s: float, on_stall: str) -> tuple[list[str], dict | None]:
    """The command sbatch runs under (``env PATH=<the cluster's Python>...``, and with a stall watch its hook on
    ``PYTHONPATH``) and the stall watch's settings (:func:`_stall_hook`'s paths with ``stall_s``, ``on_stall``,
    ``python``; None when ``stall_s`` is 0)."""
    pydir = str(Path(state.python).parent) if state.python.startswith("/") else None
    prefix = (["env", f"PATH={pydir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
              if pydir else [])
    stall = None
    if stall_s:
        stall = _stall_hook(sh, base)
        prefix = (prefix or ["env"]) + [f"PYTHONPATH={stall['hook']}", f"BROKER_FACTS_DIR={stall['facts']}"]
        stall.update(stall_s=float(stall_s), on_stall=on_stall, python=state.python)
    return prefix, stall


def _end_after_failure(ledger: "Ledger", prov: Any, run: Any, e: BaseException, *, job_id: str | None,
                       named_job: str | None, attrs: dict, res_id: str | None, say: Say) -> None:
    """After ``e`` (a failure or Ctrl-C) ended the submission: cancel ``job_id`` (shielded from a second Ctrl-C;
    its row terminated when Slurm shows it gone, else left live for `broker down` / the watchdog) and end the run
    saying why (``named_job``: the job that was submitted, if any)."""
    from broker.run.guard import shielded
    from broker.run.runrecord import end_run

    interrupted = isinstance(e, KeyboardInterrupt)
    if job_id:
        try:
            with shielded(say):  # a second Ctrl-C must not leave the job running
                gone = _cancel(prov, job_id, attrs)
            if gone.done and res_id:
                ledger.update_resource(res_id, state="terminated", terminated_by="cli", actor="cli",
                                       message=f"Slurm job {job_id} cancelled: {gone.state}")
        except Exception as ce:  # noqa: BLE001 - the row stays live: `broker down` / the watchdog retry
            say(f"could not cancel Slurm job {job_id} ({getattr(ce, 'message', None) or ce}); "
                f"`broker down {run.id}` retries")
    why = ("interrupted (Ctrl-C)" if interrupted else
           f"slurm submit failed: {getattr(e, 'message', None) or e}")
    if named_job:
        why += f"; cancelled Slurm job {named_job}"
    end_run(ledger, run.id, None, status="interrupted" if interrupted else "failed", message=why)


def _stall_hook(sh: Any, base: str) -> dict[str, str]:
    """Write the stall watch's hook on the cluster: ``<base>/hook/`` with :mod:`broker.run.rankshim` and its
    :data:`~broker.run.rankshim.SITECUSTOMIZE` (first on the job's ``PYTHONPATH``), and the shared ``<base>/facts``
    folder the ranks' facts and stacks go to.  Returns ``{"hook", "facts", "shim"}`` (paths on the cluster)."""
    from broker.run.launch import RANKSHIM
    from broker.run.rankshim import SHIM_FILES, SITECUSTOMIZE

    hook, facts = f"{base}/hook", f"{base}/facts"
    sh.mkdir(hook)
    sh.mkdir(facts)
    for name in SHIM_FILES:  # the shim loads its parts from its own folder
        sh.write(f"{hook}/{name}", RANKSHIM.with_name(name).read_text())
    sh.write(f"{hook}/sitecustomize.py", SITECUSTOMIZE)
    return {"hook": hook, "facts": facts, "shim": f"{hook}/rankshim.py"}


def end_message(job_id: str | None, out: Outcome, reason: str) -> str:
    """The run's closing line: Slurm's state and exit code once, then the reason when it says more (a reason
    that already is the state line, ``Slurm job 7 FAILED (JobLaunchFailure), ExitCode 0:53``, replaces it)."""
    line = f"Slurm job {job_id} {out.state}, ExitCode {out.exit_code}:{out.signal or 0}"
    if not reason:
        return line
    return reason if reason.startswith(f"Slurm job {job_id} {out.state}") else f"{line}; {reason}"


def job_dir(h: dict, work: str) -> str:
    """The job's working directory on the cluster: the staged folder ``work``, or the file's ``--chdir``
    taken against it when relative (an absolute one is kept as written)."""
    d = h.get("chdir")
    if d is None or not d.value.strip():
        return work
    v = d.value.strip()
    return v if v.startswith("/") else os.path.normpath(f"{work}/{v}")


def _output_dirs(h: dict, work: str) -> list[str]:
    """Folders of ``--output``/``--error`` (relative to the job folder) that hold no ``%`` pattern."""
    dirs = []
    for key in ("output", "error"):
        d = h.get(key)
        if d is None or not d.value or "/" not in d.value:
            continue
        folder = d.value.rsplit("/", 1)[0]
        if "%" in folder or ".." in Path(folder).parts:
            continue
        full = folder if folder.startswith("/") else f"{work}/{folder}"
        if full not in dirs:
            dirs.append(full)
    return dirs


def _cancel(prov: Any, job_id: str, attrs: dict, timeout_s: float = 60.0) -> Any:
    prov.cancel(job_id, attrs=attrs)
    stop = time.monotonic() + timeout_s
    info = prov.job(job_id, attrs=attrs)
    while not info.done and time.monotonic() < stop:
        time.sleep(0.5)
        info = prov.job(job_id, attrs=attrs)
    return info


def job_files(sh: Any, job_id: str, name: str) -> tuple[str | None, str | None, str]:
    """(StdOut, StdErr, the first node) of a job per ``scontrol show job -o`` with sbatch's patterns expanded (Slurm
    22.05 prints them as given); (None, None, "") while slurmctld does not answer."""
    from broker.slurm.shell import parse_scontrol_job

    cp = sh.run(["scontrol", "show", "job", "-o", job_id], call="scontrol show job", timeout=30)
    if cp.returncode != 0 or not cp.stdout:
        return None, None, ""
    kv = parse_scontrol_job(cp.stdout.decode(errors="replace") if isinstance(cp.stdout, bytes) else cp.stdout)
    first = (kv.get("BatchHost") or "").strip()
    if first in ("", "(null)"):
        first = "node0"
    user = (kv.get("UserId") or "root(0)").split("(")[0] or "root"
    jname = kv.get("JobName") or name
    std = []
    for key in ("StdOut", "StdErr"):
        v = kv.get(key)
        std.append(expand_pattern(v, job_id=job_id, name=jname, user=user, node=first) if v else None)
    return std[0], std[1], first


def route_line(line: str, logs: dict[int, Path], per_node: int, tag: str = "") -> str:
    """Append one line of the job's output to its node's log and return it as shown: ``srun --label`` lines
    (``3: text``) belong to node ``task // per_node`` (``[node i] text``); any other line is the batch shell's,
    which runs on the job's first node (``[batch<tag>] line``, kept in node 0's log).  Control characters are
    stripped from what is shown (a node may not drive the terminal); the log keeps the bytes as written."""
    m = _LABEL.match(line)
    node = int(m.group(1)) // max(1, per_node) if m else None
    if m and node in logs:
        with open(logs[node], "a", encoding="utf-8") as fh:
            fh.write(m.group(2) + "\n")
        shown = f"[node {node}] {m.group(2)}"
    else:
        with open(logs[0], "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
        shown = f"[batch{tag}] {line}"
    return _CTRL.sub("", shown)


def is_stream_noise(shown: str) -> bool:
    """Whether a shown line (``[node i] ...`` or ``[batch...] ...``) is known harmless noise the terminal leaves
    out, as ``broker run``'s stream does (:func:`broker.core.ui.is_terminal_noise`); the logs keep every line."""
    from broker.core.ui import TERMINAL_NOISE, is_terminal_noise

    if is_terminal_noise(shown):
        return True
    m = re.match(r"\[batch[^\]]*\]\s?(.*)\Z", shown, re.S)
    return bool(m) and any(n in m.group(1) for n in TERMINAL_NOISE)


def _local_copy(run_dir: Path, path: str, job_id: str, tag: str, say: Say) -> Path:
    """:func:`output_copy` of the job's output file ``path``, saying when its name could not be used."""
    local, refused = output_copy(run_dir, path, f"slurm-{job_id}.{'err' if tag else 'out'}")
    if refused:
        say(f"the job's output file name {refused} is not used for the copy: {local}")
    return local


def _follow(prov, sh, attrs, job_id, run, deadline, h, name, per_node, nnodes, run_dir: Path, out: Outcome, *,
            echo, say, poll_s, ledger, res_id, stall=None):
    """Follow the job to its end, streaming its files; returns (status, reason, final JobInfo, out).  ``stall``
    (:func:`_stall_hook`'s paths with ``stall_s``, ``on_stall``, ``python``): watch the running job for a hang."""
    logs = {i: run_dir / f"node{i}.log" for i in range(max(1, nnodes))}
    for p in logs.values():
        p.write_text("")
    out.log_paths = logs
    streams: list[_Stream] = []

    watch = None  # the stall watch, below
    quiet = []  # set once broker cancels the job: what it prints after (torchrun's SignalException) is log only

    def on_line(tag: str):
        def f(line: str) -> None:
            if watch is not None:  # every line of the job's files is progress for the stall watch
                watch.last_output = watch.clock()
            shown = route_line(line, logs, per_node, tag)
            if echo and not quiet and not is_stream_noise(shown):
                echo(shown)
        return f

    def cancelling() -> None:
        for s in streams:
            try:
                s.pump()
            except ProviderError:
                pass
        say(f"cancelling job {job_id} (scancel: SIGTERM to every node, SIGKILL after the cluster's KillWait); what "
            "the nodes print from now on is only in their logs")
        quiet.append(True)

    last, info, status, reason = "", None, None, ""
    errors = 0
    files_known = False
    if stall:
        watch = _stall_watch(sh, job_id, nnodes, stall, streams, run_dir=run_dir, echo=echo or say)
    while True:
        try:
            if not files_known:
                files_known = _follow_job_files(sh, job_id, name, streams, out, on_line, run_dir=run_dir, say=say)
            for s in streams:
                s.pump()
            info = prov.job(job_id, attrs=attrs)
            errors = 0
        except ProviderError as e:
            errors += 1
            if errors >= 30:
                raise
            say(f"cannot follow job {job_id} right now ({e.message}); retrying")
            time.sleep(poll_s)
            continue
        if info.state != last:
            last = info.state
            ledger.event(run.id, "cli", "job_state", f"{job_id} {info.state} {info.reason}".strip(), resource_id=res_id)
            if not info.done:
                say(f"job {job_id} {info.state}" + (f" ({info.reason})" if info.reason and info.state == "PENDING"
                                                    else ""))
        if info.done:
            break
        stop = _why_stop(info, job_id, deadline, watch)
        if stop is not None:  # broker ends the job: what it prints from now on is only in the logs
            status, reason = stop
            cancelling()
            info = _cancel(prov, job_id, attrs)
            break
        time.sleep(poll_s)
    if not files_known:
        so, se, _ = job_files(sh, job_id, name)
        for path in dict.fromkeys(p for p in (so, se) if p):
            local = _local_copy(run_dir, path, job_id, " stderr" if path != so else "", say)
            streams.append(_Stream(sh, path, local, on_line("")))
            out.files.append(local)
    for s in streams:
        s.pump(final=True)
    return (*_ended(sh, job_id, info, out, status, reason), info, out)


def _stall_watch(sh: Any, job_id: str, nnodes: int, stall: dict, streams: list[_Stream], *, run_dir: Path,
                 echo: Say) -> Any:
    """The stall watch of a running job (:class:`broker.run.stall.StallWatch`): the ranks' stacks read on every
    node by :func:`broker.slurm.executor.slurm_sampler`, the job's ``streams`` pumped first (output that came while
    the stacks are read counts as progress)."""
    from broker.run.stall import StallWatch
    from broker.slurm.executor import slurm_sampler

    def pump_all() -> None:
        for s in streams:
            s.pump()

    return StallWatch(stall["stall_s"], slurm_sampler(sh, job_id, max(1, nnodes), stall["python"],
                                                      stall["shim"], stall["facts"], before=pump_all),
                      on_stall=stall["on_stall"], run_dir=run_dir, echo=echo, report_hint="--on-stall report")


def _follow_job_files(sh: Any, job_id: str, name: str, streams: list[_Stream], out: Outcome,
                      on_line: Callable[[str], Callable[[str], None]], *, run_dir: Path, say: Say) -> bool:
    """Start streaming the job's StdOut and StdErr (one stream when they are one file) into local copies, once
    Slurm names them; returns whether it did (False: not known yet, ask again)."""
    from broker.core.ui import visible_controls

    so, se, _first = job_files(sh, job_id, name)
    if not so:
        return False
    seen = set()
    for path, tag in ((so, ""), (se, " stderr")):
        if not path or path in seen:
            continue
        seen.add(path)
        local = _local_copy(run_dir, path, job_id, tag, say)
        streams.append(_Stream(sh, path, local, on_line(tag if path != so else "")))
        out.files.append(local)
        say(f"following {visible_controls(path)}")  # the job chose the name: no raw ESC
    return True


def _why_stop(info: Any, job_id: str, deadline: Any, watch: Any) -> tuple[str, str] | None:
    """(status, reason) when broker must cancel the still-running job: Slurm will never start it, the cluster's
    deadline passed (the stall watch reads the stacks first), or the stall watch names a hang; None to go on.
    Time queued is not silence: the stall watch's clock starts when the job runs."""
    from broker.core.model import utcnow

    if info.hopeless:
        return "failed", f"Slurm will never start job {job_id} as submitted (pending: {info.reason}); cancelled it"
    if deadline is not None and utcnow() >= deadline:
        if watch is not None and info.state == "RUNNING":
            watch.at_deadline()
        return "deadline", (f"the cluster's deadline ({deadline.isoformat()}) was reached; cancelled Slurm job "
                            f"{job_id}")
    if watch is not None:
        if info.state != "RUNNING":
            watch.last_output = watch.clock()
        elif watch.check():
            return "failed", f"{watch.reason}; cancelled Slurm job {job_id}"
    return None


def _ended(sh: Any, job_id: str, info: Any, out: Outcome, status: str | None, reason: str) -> tuple[str, str]:
    """Fill ``out`` from the job's final ``info`` (with Slurm's own account of a job that failed without a line of
    output) and return (status, reason): ``status`` as broker decided it, else from Slurm's state and exit code."""
    out.state, out.exit_code, out.signal, out.nodes = info.state, info.exit_code, info.signal, info.nodes
    if info.state != "COMPLETED" and not any(p.exists() and p.stat().st_size for p in out.files):
        try:
            out.slurm_notes = no_output_reason(sh, job_id, info)
        except Exception as e:  # noqa: BLE001 - the note is best effort; the state and exit code stand
            out.slurm_notes = [f"(could not ask Slurm why job {job_id} wrote nothing: {type(e).__name__}: {e})"]
    if status is None:
        status = "succeeded" if info.state == "COMPLETED" and (info.exit_code or 0) == 0 else "failed"
        if status == "failed":
            why = f" ({info.reason})" if info.reason and info.reason != "None" else ""
            reason = f"Slurm job {job_id} {info.state}{why}, ExitCode {info.exit_code}:{info.signal or 0}"
    return status, reason


def no_output_reason(sh: Any, job_id: str, info: Any) -> list[str]:
    """Why a job that ended without a line of output did so, from Slurm's own record (``scontrol show job``:
    Reason, StdOut, WorkDir) and whether the folder of its StdOut exists on node 0 (slurmd cannot create it:
    "Could not open stdout file" in slurmd's log, the job FAILED before the script ran)."""
    from broker.slurm.shell import parse_scontrol_job

    cp = sh.run(["scontrol", "show", "job", "-o", job_id], call="scontrol show job", timeout=30)
    raw = cp.stdout.decode(errors="replace") if isinstance(cp.stdout, bytes) else (cp.stdout or "")
    kv = parse_scontrol_job(raw) if cp.returncode == 0 and raw.strip() else {}
    code = f"ExitCode {info.exit_code}:{info.signal or 0}"
    reason = (kv.get("Reason") or getattr(info, "reason", "") or "").strip()
    said = f"Slurm job {job_id} {info.state} ({code}" + (f", Reason={reason}" if reason and reason != "None"
                                                           else "") + ") without writing any output"
    std = kv.get("StdOut")
    if not std:
        return [said + "; Slurm no longer remembers the job's files (scontrol show job): slurmd's log on the "
                "job's first node says why"]
    first = (kv.get("BatchHost") or "node0").strip()
    user = (kv.get("UserId") or "root(0)").split("(")[0] or "root"
    path = expand_pattern(std, job_id=job_id, name=kv.get("JobName") or "", user=user, node=first)
    folder = path.rsplit("/", 1)[0] or "/"
    there = sh.run(["test", "-d", folder], call="test -d", timeout=30).returncode == 0
    if not there:
        return [said + f": its output file {path} (StdOut; WorkDir={kv.get('WorkDir', '?')}) is in a folder that "
                f"does not exist ({folder}); slurmd could not open it, so the job ended before the script ran",
                "fix: point #SBATCH --output/--error at a folder that exists before sbatch (a folder of the "
                "submitted file's own, without %j in its name, is created by `broker slurm submit`)"]
    return [said + f"; its output file is {path} (StdOut; WorkDir={kv.get('WorkDir', '?')}): if it is missing, "
            "slurmd could not open it (permissions or a file system the nodes do not share)"]


def diagnose(out: Outcome, findings: list["Finding"], nnodes: int, run_dir: Path, result: Any) -> list[str]:
    """The diagnosis lines of a job that did not complete: torchrun outside srun on a multi-node job first (the
    logs say nothing of it: node 0 waits in the rendezvous until the time limit), then the catalogue."""
    if out.status == "succeeded":
        return []
    lines: list[str] = list(out.slurm_notes)
    not_srun = [f for f in findings if f.kind == "sbatch-torchrun-not-srun"]
    if not_srun and nnodes > 1:
        others = [i for i, p in out.log_paths.items() if i > 0 and p.exists() and p.stat().st_size]
        f = not_srun[0]
        lines.append(f"only node 0 ever started: torchrun is not under srun ({f.path}:{f.line}); the batch shell "
                     f"runs on the first node of the {nnodes}-node allocation only, so its torchrun waited for the "
                     f"other node(s) until Slurm ended the job ({out.state})"
                     + ("" if others else "; no output from "
                        + ("node 1" if nnodes == 2 else f"nodes 1..{nnodes - 1}")))
        lines.append(f"fix: {f.fix.replace('`', '')}")
    try:
        from broker.run.diagnose import explain

        catalogue = explain(run_dir, result, nnodes).lines()
    except Exception as e:  # noqa: BLE001 - a diagnosis is best effort
        catalogue = [f"(no catalogue diagnosis: {type(e).__name__}: {e})"]
    # the time-limit entry restates the torchrun-outside-srun paragraph above: said once is enough
    return lines + _said_once(catalogue, drop={"slurm-time-limit"} if lines and not_srun and nnodes > 1 else set())


_CAUSE = re.compile(r"^cause \[([\w-]+)\](?: \(node \d+\))?: (.*)$")


def _said_once(lines: list[str], drop: set[str]) -> list[str]:
    """The catalogue's lines without repeats: a cause in ``drop`` goes with its indented fix lines, a headline
    that a cause line repeats word for word goes (the cause keeps its fix), and an exact repeat goes."""
    causes = {m.group(2): m.group(1) for m in map(_CAUSE.match, lines) if m}
    out: list[str] = []
    skipping = False
    for ln in lines:
        m = _CAUSE.match(ln)
        if m:
            skipping = m.group(1) in drop
        elif skipping and ln.startswith(" "):
            continue
        else:
            skipping = False
        if skipping or (not m and causes.get(ln) in drop) or (not m and ln in causes) or (
                ln in out and not ln.startswith(" ")):
            continue
        out.append(ln)
    return out


def format_finding(f: "Finding") -> str:
    """``file:line: error|warning [kind] message`` (the fix follows on its own line in the CLI)."""
    from broker.lint.shell import FATAL

    return f"{f.path}:{f.line}: {'error' if f.kind in FATAL else 'warning'} [{f.kind}] {f.message}"
