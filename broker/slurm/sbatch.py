"""sbatch scripts for recipes: one ``torchrun`` per node, started by ``srun``.

:func:`render_sbatch` turns a :class:`~broker.core.recipe.Recipe` into a batch script; ``broker slurm render`` prints
it and the ``slurm`` provider (``providers/slurm.py``) submits it.

The broken published pattern
----------------------------
Many tutorials put ``torchrun --nnodes=2 ... train.py`` straight into the batch script.  The batch script runs on
the *first* node of the allocation only, so exactly one torchrun starts: it waits for the second node's agent
until the rendezvous timeout (900 s for static rendezvous) and the job burns the whole allocation doing nothing;
variants that start it in the background and end the script with ``wait; echo done`` (or any trailing command)
even make Slurm report ``COMPLETED``, because a batch job's exit status is its script's last command's.  Variants
that pass ``--node_rank=$SLURM_NODEID`` without ``srun`` get node rank 0 on the batch host only, and variants that
do use ``srun`` but write ``srun torchrun --node_rank=$SLURM_NODEID`` expand ``$SLURM_NODEID`` *once*, in the batch
shell on node 0, so every node claims node rank 0.

The working pattern, rendered here:

* ``#SBATCH --nodes=N --ntasks-per-node=1``: one task per node, and that task is torchrun, which starts the
  node's ``G`` worker processes (``--nproc_per_node=G``);
* ``MASTER_ADDR`` = the first host of ``scontrol show hostnames "$SLURM_JOB_NODELIST"`` and a ``MASTER_PORT``
  derived from the job id (high range, so two jobs sharing a node do not collide) or chosen at render time;
* ``srun --kill-on-bad-exit=1 bash -c '... --node_rank=$SLURM_NODEID ...'``: single quotes, so the node rank is
  expanded by the shell srun starts *on each node* (Slurm sets ``SLURM_NODEID`` per node), and one failing node
  ends the whole step instead of leaving its peers waiting;
* per-node logs from ``srun --output=<dir>/%x-%j-node%n.out`` (``%n`` = node index within the job): the batch
  script's own ``#SBATCH --output`` only captures the batch step, i.e. node 0's shell;
* the log directory is created by the submitter *before* ``sbatch``: slurmstepd opens the ``--output`` file
  before the script runs, and with a missing directory ``sbatch`` still exits 0 while the job ends at once as
  ``JobState=FAILED Reason=JobLaunchFailure ExitCode=0:53`` with no log anywhere (measured on Slurm 22.05); the
  script creates it again (``mkdir -p``) for its ``srun`` steps;
* ``setup`` runs once per node in its own ``srun`` step before training;
* ``set -euo pipefail`` and the training ``srun`` as the last command (``exit $rc``), so the job's state and
  exit code are the training's.

Source of the Slurm facts: the sbatch/srun man pages of Slurm 22.05 (filename patterns ``%x %j %n``,
``--kill-on-bad-exit``, ``--open-mode``, ``SLURM_NODEID``/``SLURM_NNODES``), verified on a two-node Slurm 22.05
cluster (tests/slurm/test_slurm_run.py).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from broker.core.provider import BadInput
from broker.core.recipe import Recipe

#: MASTER_PORT = BASE + SLURM_JOB_ID % SPAN when no port is given at render time (ports 29500..48999)
PORT_BASE = 29500
PORT_SPAN = 19500

#: sbatch --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME_FORMS = (
    re.compile(r"^(?P<m>\d+)$"),
    re.compile(r"^(?P<m>\d+):(?P<s>\d{1,2})$"),
    re.compile(r"^(?P<h>\d+):(?P<m>\d{1,2}):(?P<s>\d{1,2})$"),
    re.compile(r"^(?P<d>\d+)-(?P<h>\d{1,2})$"),
    re.compile(r"^(?P<d>\d+)-(?P<h>\d{1,2}):(?P<m>\d{1,2})$"),
    re.compile(r"^(?P<d>\d+)-(?P<h>\d{1,2}):(?P<m>\d{1,2}):(?P<s>\d{1,2})$"),
)
_TIME_HELP = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def slurm_time(max_hours: float) -> str:
    """``HH:MM:SS`` (Slurm ``--time``) for ``max_hours`` hours, rounded up to the next minute, at least 1 min."""
    minutes = max(1, int(-(-max_hours * 60 // 1)))
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


_ENV_REF = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")


def _env_ref_value(template: str) -> str:
    """``template`` double-quoted for bash with only its ``${NAME}`` references left to expand."""
    out, pos = [], 0
    for m in _ENV_REF.finditer(template):
        out.append(re.sub(r'([\\"$`])', r"\\\1", template[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(re.sub(r'([\\"$`])', r"\\\1", template[pos:]))
    return '"' + "".join(out) + '"'


def time_seconds(value: str) -> int | None:
    """Seconds of an sbatch ``--time`` value in any of its forms (:data:`_TIME_HELP`); None when malformed."""
    v = value.strip()
    for form in _TIME_FORMS:
        m = form.match(v)
        if not m:
            continue
        g = {k: int(x) for k, x in m.groupdict().items() if x is not None}
        if "d" in g and g.get("h", 0) > 23:
            return None
        if "h" in g and g.get("m", 0) > 59:  # minutes alone (or MM:SS) may exceed 59
            return None
        if g.get("s", 0) > 59:
            return None
        return ((g.get("d", 0) * 24 + g.get("h", 0)) * 60 + g.get("m", 0)) * 60 + g.get("s", 0)
    return None


def check_time(value: str) -> str:
    """Validate an sbatch ``--time`` value (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); raises
    BadInput.  Zero (Slurm's "no limit") is refused: every run has a hard deadline."""
    secs = time_seconds(value)
    if secs is None:
        raise BadInput(f"--time {value!r} is not a Slurm time: give {_TIME_HELP}",
                       hint="e.g. 30 (minutes), 00:30:00 (HH:MM:SS) or 1-12 (1 day 12 hours)")
    if secs == 0:
        raise BadInput(f"--time {value!r} means no time limit", hint="every run has a hard deadline: e.g. 00:30:00")
    return value.strip()


def job_name(recipe: Recipe) -> str:
    """Slurm job name (``%x`` in file patterns): the recipe name, safe for file names."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", recipe.name)


def node_log_pattern(log_dir: str | Path) -> str:
    """The srun ``--output`` pattern of the per-node logs: ``<dir>/%x-%j-node%n.out``."""
    return f"{log_dir}/%x-%j-node%n.out"


def node_log_path(log_dir: str | Path, name: str, job_id: str, node: int) -> str:
    """The per-node log file Slurm writes for ``node`` (pattern of :func:`node_log_pattern` expanded)."""
    return f"{log_dir}/{name}-{job_id}-node{node}.out"


def batch_log_path(log_dir: str | Path, name: str, job_id: str) -> str:
    """The batch step's log (``#SBATCH --output``): the batch shell on node 0 and srun's own messages."""
    return f"{log_dir}/{name}-{job_id}-batch.out"


def render_sbatch(recipe: Recipe, *, partition: str | None = None, account: str | None = None,
                  time: str | None = None, log_dir: str | Path, port: int | None = None, python: str = "python3",
                  workdir: str | Path | None = None, gpus: bool = True, cpus_per_task: int | None = None,
                  env_refs: bool = False, shim: str | None = None, facts_dir: str | None = None) -> str:
    """The sbatch script (bash) for ``recipe``.

    ``log_dir``: where Slurm writes ``<name>-<jobid>-batch.out`` and the per-node ``<name>-<jobid>-node<i>.out``;
    the caller must create it before ``sbatch`` (the script creates it again for the srun steps).
    ``time``: ``HH:MM:SS`` wall-clock limit (default: the recipe's ``max_hours``, rounded up to a minute).
    ``port``: fixed ``MASTER_PORT``; default ``29500 + SLURM_JOB_ID % 19500`` (evaluated in the job).
    ``python``: the interpreter on the nodes that has torch (``python -m torch.distributed.run`` = torchrun).
    ``workdir``: the job's working directory on the cluster's shared file system (``#SBATCH --chdir``); the
    recipe's script path is taken relative to the recipe's workdir and run from there.  Default: the recipe's
    workdir itself.
    ``gpus``: request ``--gpus-per-node`` (False for CPU-only clusters running a ``cpu_ok`` recipe with gloo;
    always False for a ``gpus_per_node: 0`` recipe).
    ``cpus_per_task``: CPUs for each node's torchrun and its workers (default 4 per GPU, 1 per process on CPU).
    ``env_refs``: write env values that reference ``${NAME}`` as written (expanded in the job from the submitting
    environment) instead of their resolved values: a script that is printed never carries a secret.
    ``shim``/``facts_dir``: paths on the cluster of :mod:`broker.run.rankshim` and the shared folder its per-rank facts
    go to (``broker run`` on Slurm); torchrun then runs the shim in front of the script (``slurm render`` leaves
    them out: the script stands alone).

    Raises BadInput for a malformed ``time``, a ``log_dir``/``workdir`` with whitespace, quotes or ``%``, or a recipe that needs GPUs when ``gpus`` is False.
    """
    if getattr(recipe, "cpu_only", False):  # gpus_per_node: 0 asks for no GPU at all: never --gpus-per-node
        gpus = False
    if not gpus and not recipe.cpu_ok:
        raise BadInput(f"recipe {recipe.name} needs GPUs (cpu_ok is false) but the script was asked for CPU only",
                       hint="drop --cpu-only, or set cpu_ok: true in the recipe for a gloo logic check")
    assert recipe.workdir is not None
    g = recipe.gpus_per_node
    n = recipe.nodes
    limit = check_time(time) if time else slurm_time(recipe.max_hours)
    cpus = cpus_per_task or (4 * g if gpus else g)
    name = job_name(recipe)
    wd = str(workdir) if workdir is not None else str(recipe.workdir)
    script_rel = str(recipe.script.relative_to(recipe.workdir))
    log_dir = str(log_dir)
    for what, value in (("log_dir", log_dir), ("workdir", wd)):
        if re.search(r'[\s"\'%]', value):  # #SBATCH lines are split on whitespace; % starts a file pattern
            raise BadInput(f"{what} {value!r} contains whitespace, a quote or '%', which #SBATCH lines cannot carry",
                           hint="use a directory path without spaces, quotes or '%'")
    q = shlex.quote

    lines = _sbatch_header(recipe, name=name, gpus=gpus, cpus=cpus, limit=limit, workdir=wd, log_dir=log_dir,
                           partition=partition, account=account)
    lines += [
        "set -euo pipefail",
        "",
        f"LOG_DIR={q(log_dir)}",
        'mkdir -p "$LOG_DIR"',
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
    ]
    if port is not None:
        lines.append(f"export MASTER_PORT={int(port)}")
    else:
        lines.append(f"export MASTER_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))")
    lines += _export_lines(recipe, gpus=gpus, env_refs=env_refs)
    lines += [
        'echo "broker: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST ($SLURM_NNODES nodes), '
        'MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"',
        "",
        "# every srun step appends to the same per-node file: %n = node index within the job",
        # --cpus-per-task again: srun 22.05 no longer inherits it from the job (each step would get 1 CPU)
        f'STEP=(srun --nodes={n} --ntasks-per-node=1 --cpus-per-task={cpus}'
        + (f" --gpus-per-node={g}" if gpus else "")
        + f' --kill-on-bad-exit=1 --open-mode=append --output="{node_log_pattern("$LOG_DIR")}")',
    ]
    return "\n".join(lines + _step_lines(recipe, python=python, shim=shim, facts_dir=facts_dir,
                                         script_rel=script_rel))


def _sbatch_header(recipe: Recipe, *, name: str, gpus: bool, cpus: int, limit: str, workdir: str, log_dir: str,
                   partition: str | None, account: str | None) -> list[str]:
    """The script's first lines: the shebang, what it is, and the ``#SBATCH`` options (one task per node, its
    GPUs and CPUs, the time limit, the job folder, the batch step's log, the partition and account if given)."""
    n, g = recipe.nodes, recipe.gpus_per_node
    lines = [
        "#!/bin/bash",
        f"# broker: sbatch script for recipe {recipe.name} ({n} nodes x {g} process(es)); see broker/slurm/executor.py",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={n}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={g}")
    lines += [
        f"#SBATCH --cpus-per-task={cpus}",
        f"#SBATCH --time={limit}",
        f"#SBATCH --chdir={workdir}",
        # batch step only (node 0's shell + srun's own error lines); the nodes' logs come from srun --output
        f"#SBATCH --output={log_dir}/%x-%j-batch.out",
        f"#SBATCH --error={log_dir}/%x-%j-batch.out",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    return lines


def _export_lines(recipe: Recipe, *, gpus: bool, env_refs: bool) -> list[str]:
    """``export NAME=value`` for the job's environment (unbuffered Python, one OpenMP thread, the recipe's env; no
    GPU visible on a CPU-only job); with ``env_refs`` a value written as ``${NAME}`` stays a reference."""
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **recipe.env}
    if not gpus:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    written = recipe.model_dump(include={"env"})["env"] if env_refs else {}  # ${NAME} kept as written
    lines = []
    for k, v in env.items():
        t = written.get(k)
        value = _env_ref_value(t) if t is not None and _ENV_REF.search(t) else shlex.quote(v)
        lines.append(f"export {k}={value}")
    return lines


def _step_lines(recipe: Recipe, *, python: str, shim: str | None, facts_dir: str | None,
                script_rel: str) -> list[str]:
    """The srun steps: the recipe's setup once per node, then one torchrun per node (behind the rank shim when
    ``shim`` is given), and the script's exit with the training step's status."""
    q = shlex.quote
    lines: list[str] = []
    if recipe.setup:
        setup = " && ".join(f"( {c} )" for c in recipe.setup)
        inner = f'echo "broker: setup on $(hostname) (node $SLURM_NODEID)"; set -e; {setup}'
        lines += ["", "# setup: once per node, before training", f'"${{STEP[@]}}" bash -c {q(inner)}']
    torchrun = " ".join([
        q(python), "-m", "torch.distributed.run", "--nnodes=$SLURM_NNODES",
        f"--nproc_per_node={recipe.gpus_per_node}",
        "--node_rank=$SLURM_NODEID", "--master_addr=$MASTER_ADDR", "--master_port=$MASTER_PORT",
        *([q(shim), *(["--facts", q(facts_dir)] if facts_dir else []), "--"] if shim else []),
        q(script_rel), *(q(a) for a in recipe.args)])
    inner = (f'echo "broker: node $SLURM_NODEID on $(hostname): torchrun --node_rank=$SLURM_NODEID"; '
             f"exec {torchrun}")
    return lines + [
        "",
        "# one torchrun per node; single quotes: $SLURM_NODEID is expanded on each node, not here",
        "rc=0",
        f'"${{STEP[@]}}" bash -c {q(inner)} || rc=$?',
        'echo "broker: training step exit status $rc"',
        "exit $rc",
        "",
    ]
