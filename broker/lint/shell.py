"""Static check of shell scripts that launch distributed training: torchrun / srun lines of any shell script, and the
``#SBATCH`` header of a batch script against the nodes of a real cluster (``broker slurm submit``).

Launch rules (any shell script; ``Finding.kind``), on top of :func:`broker.lint.sbatch.lint_sbatch`'s two
(``sbatch-torchrun-not-srun``, ``sbatch-no-node-rank``):

* ``sbatch-torchrun-per-task`` -- ``srun ... torchrun`` in a job with ``--ntasks-per-node`` above 1 (and no
  ``--ntasks-per-node=1`` on the srun line): srun starts one torchrun per *task*, several per node, all with the
  node's rank.
* ``sbatch-python-not-srun`` -- ``python train.py`` in the batch shell of a multi-node job where ``train.py``
  (found beside the batch script) calls ``init_process_group``: it runs once, on the first node, and waits for
  ranks that never start.
* ``shell-node-rank-expanded-early`` -- ``srun ... torchrun --node_rank=$SLURM_NODEID`` with the variable outside
  single quotes: the *calling* shell (the batch shell, on the first node) expands it once, so every node claims
  node rank 0 and the rendezvous never completes.
* ``shell-rank-from-procid`` -- ``RANK=$SLURM_PROCID`` (or ``export RANK=...``) in a script that starts torchrun:
  torchrun sets ``RANK`` for each of its workers itself, and ``SLURM_PROCID`` counts Slurm tasks (in the batch
  shell it is 0 on the one node that runs it), so the value is wrong wherever it is read.
* ``shell-no-master-addr`` -- a multi-node static torchrun (``--node_rank``) with no ``--master_addr`` (torchrun
  then uses 127.0.0.1: each node waits for itself), or a batch script that passes ``$MASTER_ADDR`` but never sets
  it, or sets it to ``localhost``/``127.*``.  The first host of ``scontrol show hostnames "$SLURM_JOB_NODELIST"``
  is the address every node can reach.

Cluster rules (:func:`check_against_cluster`, ``#SBATCH`` directives against ``sinfo`` / ``scontrol show node``):
``sbatch-partition``, ``sbatch-nodes``, ``sbatch-gres``, ``sbatch-cpus``, ``sbatch-mem``, ``sbatch-time``
(beyond the partition's ``MaxTime``: pending forever) and ``sbatch-time-deadline`` (longer than the cluster has
left before its deadline: a warning).

:data:`FATAL` lists the kinds after which the job cannot run as written (``broker slurm submit`` refuses them
without ``--yes``).  The module imports nothing heavy: ``broker lint`` on a shell script never loads astroid.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from broker.lint.kinds import FIXES as PY_FIXES
from broker.lint.kinds import Finding
from broker.lint.sbatch import _shell_commands, _TORCHRUN, is_sbatch, lint_sbatch

#: suffixes and shebangs that make a file a shell script for ``broker lint``
SHELL_SUFFIXES = {".sh", ".bash", ".sbatch", ".slurm"}
_SHEBANG = re.compile(r"#!\s*\S*\b(ba|z|k|da)?sh\b|#!\s*/usr/bin/env\s+(ba|z|k|da)?sh\b")

MASTER_FIX = ('set it from the allocation, in the batch shell: `export MASTER_ADDR=$(scontrol show hostnames '
              '"$SLURM_JOB_NODELIST" | head -n 1)` and pass `--master_addr=$MASTER_ADDR` to torchrun')
FIXES = {
    "shell-node-rank-expanded-early": "put the torchrun line in single quotes so each node expands its own index: "
                                      "`srun bash -c 'exec torchrun --node_rank=$SLURM_NODEID ...'`",
    "shell-rank-from-procid": "drop the RANK line: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE for its workers; "
                              "give torchrun the node's index instead: `--node_rank=$SLURM_NODEID` (inside the "
                              "single-quoted srun command)",
    "shell-no-master-addr": MASTER_FIX,
    "sbatch-torchrun-per-task": "one torchrun per node: `#SBATCH --ntasks-per-node=1` (torchrun starts the node's "
                                "GPUS workers with `--nproc_per_node=GPUS`), or `srun --ntasks-per-node=1 ...` on "
                                "the torchrun line",
    "sbatch-python-not-srun": "start it once per task through srun: `srun --ntasks-per-node=GPUS python train.py` "
                              "(the script then reads SLURM_PROCID / SLURM_NTASKS), or one torchrun per node: "
                              "`srun bash -c 'exec torchrun --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID "
                              "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py'`",
    "sbatch-partition": "",
    "sbatch-nodes": "",
    "sbatch-gres": "",
    "sbatch-cpus": "",
    "sbatch-mem": "",
    "sbatch-time": "",
    "sbatch-time-deadline": "",
}
#: findings after which the job cannot run as written (refused by ``broker slurm submit`` without ``--yes``)
FATAL = {"sbatch-torchrun-not-srun", "sbatch-no-node-rank", "shell-node-rank-expanded-early", "sbatch-python-not-srun",
         "sbatch-torchrun-per-task",
         "shell-no-master-addr", "sbatch-partition", "sbatch-nodes", "sbatch-gres", "sbatch-cpus", "sbatch-mem",
         "sbatch-time"}

#: long names of the sbatch options the header check reads (short forms mapped to them)
_SHORT = {"-N": "nodes", "-c": "cpus-per-task", "-t": "time", "-p": "partition", "-o": "output", "-e": "error",
          "-J": "job-name", "-n": "ntasks", "-G": "gpus", "-D": "chdir"}


def is_shell_script(path: Path, text: str | None = None) -> bool:
    """A shell script: a shell suffix or a ``#!/bin/sh``-like first line (``#!/bin/bash``, ``#!/usr/bin/env bash``)."""
    if path.suffix in SHELL_SUFFIXES:
        return True
    if text is None:
        try:
            with path.open(encoding="utf-8", errors="replace") as fh:
                text = fh.readline()
        except OSError:
            return False
    return bool(_SHEBANG.match(text.split("\n", 1)[0]))


def launches(path: Path) -> bool:
    """A shell script that starts distributed training (mentions torchrun, ``torch.distributed.run`` or srun): what
    ``broker lint DIR`` picks up besides batch scripts."""
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            text = fh.read(65536)
    except OSError:
        return False
    return re.search(r"\b(torchrun|torch\.distributed\.(run|launch)|srun)\b", text) is not None


# --------------------------------------------------------------------------------------------------- header
@dataclass(frozen=True)
class Directive:
    """One ``#SBATCH`` option: its 1-based ``line``, the long option name without dashes, its value ("" for a
    flag)."""

    line: int
    name: str
    value: str


def sbatch_directives(text: str) -> list[Directive]:
    """The ``#SBATCH`` options of a batch script's header, in order (sbatch stops reading them at the first
    command line)."""
    out: list[Directive] = []
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or (line.startswith("#") and not line.startswith("#SBATCH")):
            continue
        if not line.startswith("#SBATCH"):
            break
        try:
            toks = shlex.split(line[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        j = 0
        while j < len(toks):
            t = toks[j]
            if t.startswith("--"):
                name, eq, value = t[2:].partition("=")
                if not eq and j + 1 < len(toks) and not toks[j + 1].startswith("-"):
                    value, j = toks[j + 1], j + 1
                out.append(Directive(i, name, value))
            elif t[:2] in _SHORT:
                value = t[2:].lstrip("=")
                if not value and j + 1 < len(toks):
                    value, j = toks[j + 1], j + 1
                out.append(Directive(i, _SHORT[t[:2]], value))
            j += 1
    return out


def header(text: str) -> dict[str, Directive]:
    """The last ``#SBATCH`` value of each option (sbatch: a later one wins)."""
    return {d.name: d for d in sbatch_directives(text)}


def _nodes(value: str) -> int:
    nums = [int(x) for x in re.findall(r"\d+", value.split(":")[0])]
    return min(nums) if nums else 1


def sbatch_nodes(text: str) -> int:
    """How many nodes the header asks for (the minimum of a ``2-4`` range; 1 when it does not say)."""
    d = header(text).get("nodes")
    return _nodes(d.value) if d else 1


def parse_mem_mb(value: str) -> int | None:
    """sbatch ``--mem`` (``32G``, ``4096``, ``500M``, ``1T``; default unit MiB) -> MiB; None when unreadable
    (``0`` means "all of the node's memory" and returns 0)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)B?", value.strip().upper())
    if not m:
        return None
    n = float(m.group(1))
    return int(n * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)])


def parse_minutes(value: str) -> float | None:
    """sbatch ``--time`` (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; ``INFINITE``/``UNLIMITED``) ->
    minutes (``inf`` for no limit); None when unreadable."""
    v = value.strip()
    if v.upper() in ("INFINITE", "UNLIMITED", "-1"):
        return float("inf")
    days = 0
    if "-" in v:
        d, _, v = v.partition("-")
        if not d.isdigit():
            return None
        days = int(d)
        parts = [int(p) for p in v.split(":")] if all(p.isdigit() for p in v.split(":")) else None
        if parts is None or not 1 <= len(parts) <= 3:
            return None
        h, m, s = (parts + [0, 0])[:3]
        return days * 1440 + h * 60 + m + s / 60
    parts_s = v.split(":")
    if not all(p.isdigit() for p in parts_s) or not 1 <= len(parts_s) <= 3:
        return None
    parts = [int(p) for p in parts_s]
    if len(parts) == 1:
        return float(parts[0])
    if len(parts) == 2:
        return parts[0] + parts[1] / 60
    return parts[0] * 60 + parts[1] + parts[2] / 60


def gpus_asked(h: dict[str, Directive]) -> tuple[int, Directive | None]:
    """GPUs per node the header asks for (``--gres=gpu[:type]:N``, ``--gpus-per-node``, ``--gpus``/-G spread over
    the nodes) and the directive that asks."""
    d = h.get("gres")
    if d:
        for g in d.value.split(","):
            m = re.fullmatch(r"gpu(?::[^:]+)?(?::(\d+))?", g.strip())
            if m:
                return int(m.group(1) or 1), d
    d = h.get("gpus-per-node")
    if d:
        m = re.search(r"(\d+)$", d.value)
        return (int(m.group(1)) if m else 1), d
    d = h.get("gpus")
    if d:
        m = re.search(r"(\d+)$", d.value)
        n = int(m.group(1)) if m else 1
        return max(1, -(-n // max(1, _nodes(h["nodes"].value) if "nodes" in h else 1))), d
    return 0, None


# --------------------------------------------------------------------------------------------------- launch rules
def _torchrun_lines(text: str) -> list[tuple[int, str, int]]:
    """(line of the launcher, the logical command, offset of the launcher in it) for each torchrun line."""
    out = []
    for lineno, line in _shell_commands(text):
        m = _TORCHRUN.search(line)
        if not m or re.match(r"\s*(echo|printf)\b", line):
            continue
        out.append((lineno + line[:m.start(1)].count("\n"), line, m.start(1)))
    return out


def _unquoted_refs(s: str, names: str, start: int = 0) -> bool:
    """True when ``$NAME``/``${NAME}`` of ``names`` (a regex alternation) appears outside single quotes in
    ``s[start:]`` (quotes are tracked from the start of ``s``)."""
    quote = None
    out = []
    for ch in s:
        if quote == "'":
            if ch == "'":
                quote = None
            out.append(" ")
            continue
        if ch == "'" and quote is None:
            quote = "'"
            out.append(" ")
            continue
        if ch == '"':
            quote = None if quote == '"' else '"'
        out.append(ch)
    return re.search(r"\$\{?(?:" + names + r")\b", "".join(out)[start:]) is not None


_PYTHON = re.compile(r"(?:^|[\s;&|(])((?:\S*/)?python[\d.]*)\s+(?:-[A-Za-z]+\s+)*(?P<script>[^\s;&|]+\.py)\b")


def _python_not_srun(commands: list[tuple[int, str]], path: str, nodes: int, base: Path | None) -> list[Finding]:
    """``python train.py`` in the batch shell of a multi-node job, when ``train.py`` (beside the batch script)
    starts a process group: it runs once, on the first node, and waits for ranks that never start."""
    out = []
    for lineno, line in commands:
        m = _PYTHON.search(line)
        if not m or re.match(r"\s*(echo|printf)\b", line) or _TORCHRUN.search(line):
            continue
        if re.search(r"(?:^|[\s;&|(])srun\b", line[:m.start(1)]):
            continue
        script = Path(m.group("script"))
        target = script if script.is_absolute() or base is None else base / script
        try:
            distributed = "init_process_group" in target.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if distributed:
            out.append(Finding(path, lineno + line[:m.start(1)].count("\n"), "sbatch-python-not-srun",
                               f"{m.group('script')} starts a process group but runs in the batch shell of a "
                               f"{nodes}-node job: once, on the first node only, waiting for ranks that never start",
                               FIXES["sbatch-python-not-srun"]))
    return out


def lint_shell(text: str, path: str = "<script.sh>", *, nodes: int | None = None,
               base: Path | None = None) -> list[Finding]:
    """Findings for the launch lines of a shell script (sorted by line).  ``nodes``: the allocation's size when
    known (default: the ``#SBATCH --nodes`` of the header; a torchrun ``--nnodes`` above 1 or ``$SLURM_NNODES``
    also makes a line multi-node).  ``base``: the folder the script's relative paths start from (default: the
    folder of ``path``), where ``python train.py`` is looked at."""
    findings = list(lint_sbatch(text, path)) if is_sbatch(text) else []
    batch = is_sbatch(text)
    n_alloc = nodes if nodes is not None else sbatch_nodes(text)
    commands = _shell_commands(text)
    runs = _torchrun_lines(text)
    if batch and n_alloc > 1:
        findings += _python_not_srun(commands, path, n_alloc, base if base is not None else Path(path).parent)
    master_set: list[tuple[int, str]] = []
    for lineno, line in commands:
        for m in re.finditer(r"(?:^|[\s;&|(])(?:export\s+)?MASTER_ADDR=(\S*)", line):
            master_set.append((lineno, m.group(1)))
        if runs:
            m = re.search(r"(?:^|[\s;&|(])(?:export\s+)?RANK=[\"']?\$\{?SLURM_PROCID\b", line)
            if m:
                findings.append(Finding(path, lineno + line[:m.start()].count("\n"), "shell-rank-from-procid",
                                        "RANK is set from SLURM_PROCID in a script that starts torchrun: torchrun "
                                        "sets RANK for each worker itself, and SLURM_PROCID counts Slurm tasks (0 "
                                        "in the batch shell, which runs on the first node only)",
                                        FIXES["shell-rank-from-procid"]))
    for lineno, line, at in runs:
        before, after = line[:at], line[at:]
        nn = re.search(r"--nnodes[= ](\S+)", after)
        multi = n_alloc > 1 or bool(nn and (("SLURM_NNODES" in nn.group(1) or "SLURM_JOB_NUM_NODES" in nn.group(1))
                                             or _nodes(nn.group(1)) > 1))
        if not multi:
            continue
        srun = re.search(r"(?:^|[\s;&|(])srun\b", before)
        tasks_d = header(text).get("ntasks-per-node") if batch else None
        if (srun and tasks_d and tasks_d.value.isdigit() and int(tasks_d.value) > 1
                and not re.search(r"--ntasks-per-node[= ]1\b|--ntasks[= ]\$\{?SLURM_(JOB_)?NNODES\b|-n\s*\$\{?SLURM_"
                                  r"(JOB_)?NNODES\b", before[srun.start():])):
            findings.append(Finding(path, lineno, "sbatch-torchrun-per-task",
                                    f"srun starts torchrun once per task and the job has --ntasks-per-node="
                                    f"{tasks_d.value} (line {tasks_d.line}): {tasks_d.value} torchrun agents per node "
                                    "claim the same node rank", FIXES["sbatch-torchrun-per-task"]))
        if srun and _unquoted_refs(line, "SLURM_NODEID|SLURM_PROCID", at):
            findings.append(Finding(path, lineno, "shell-node-rank-expanded-early",
                                    "the node rank ($SLURM_NODEID) on this srun line is outside single quotes: the "
                                    "shell that runs srun expands it once, on the first node, so every node "
                                    "claims node rank 0", FIXES["shell-node-rank-expanded-early"]))
        # a loopback master written on the line itself: every node then looks for the master on itself
        lit = re.search(r"--(master[_-]addr|rdzv[_-]endpoint)[= ]['\"]?(localhost|127\.\d+\.\d+\.\d+|::1|"
                        r"\[::1\])(?![\w.-])", after)
        if lit:
            findings.append(Finding(path, lineno + after[:lit.start()].count("\n"), "shell-no-master-addr",
                                    f"--{lit.group(1)}={lit.group(2)} on a multi-node torchrun: each node looks for "
                                    "the master on itself and waits until the rendezvous times out", MASTER_FIX))
            continue
        static = re.search(r"--node[_-]rank\b", after) and not re.search(r"--rdzv[_-]endpoint\b", after)
        if static and "--standalone" not in after and "PET_MASTER_ADDR" not in text:  # torchrun's own env form
            if not re.search(r"--master[_-]addr\b", after):
                findings.append(Finding(path, lineno, "shell-no-master-addr",
                                        "torchrun with --node_rank and no --master_addr on several nodes: it uses "
                                        "127.0.0.1, so every node waits for a master on itself", MASTER_FIX))
                continue
        uses = re.search(r"--(?:master[_-]addr|rdzv[_-]endpoint)[= ]['\"]?\$\{?MASTER_ADDR\b", after)
        if uses and batch:
            good = [(ln, v) for ln, v in master_set if ln <= lineno]
            if not master_set:
                findings.append(Finding(path, lineno, "shell-no-master-addr",
                                        "torchrun is given $MASTER_ADDR, which this batch script never sets (sbatch "
                                        "does not set it): it is empty or whatever the submitting shell held",
                                        MASTER_FIX))
            else:
                ln, v = (good or master_set)[-1]
                if re.match(r"['\"]?(localhost|127\.\d+\.\d+\.\d+|::1)\b", v):
                    findings.append(Finding(path, ln, "shell-no-master-addr",
                                            f"MASTER_ADDR={v} on a {max(n_alloc, 2)}-node job: each node looks for "
                                            "the master on itself", MASTER_FIX))
    seen = set()
    out = []
    for f in sorted(findings, key=lambda f: (f.line, f.kind)):
        if (f.line, f.kind) not in seen:
            seen.add((f.line, f.kind))
            out.append(f)
    return _suppressed(out, text)


def _suppressed(findings: list[Finding], text: str) -> list[Finding]:
    lines = text.splitlines()
    keep = []
    for f in findings:
        src = lines[f.line - 1] if 0 < f.line <= len(lines) else ""
        m = re.search(r"#\s*broker-lint:\s*ignore(?:\[([\w,\s-]+)\])?", src)
        if m and (m.group(1) is None or f.kind in {k.strip() for k in m.group(1).split(",")}):
            continue
        keep.append(f)
    return keep


def fix_for(kind: str) -> str:
    return FIXES.get(kind) or PY_FIXES.get(kind, "")


# --------------------------------------------------------------------------------------------------- cluster rules
@dataclass
class ClusterNodes:
    """What a cluster's nodes offer, as ``sinfo`` / ``scontrol show node`` report it: ``partitions`` (name ->
    {"nodes": count, "max_minutes": MaxTime in minutes or inf, "default": bool, "names": [node names]}),
    ``nodes`` (name -> {"cpus", "memory_mb", "gpus"}), and ``minutes_left`` before the cluster's deadline (None =
    no deadline known)."""

    partitions: dict[str, dict] = field(default_factory=dict)
    nodes: dict[str, dict] = field(default_factory=dict)
    minutes_left: float | None = None

    def default_partition(self) -> str | None:
        for name, p in self.partitions.items():
            if p.get("default"):
                return name
        return next(iter(self.partitions), None)


def parse_sinfo_partitions(out: str) -> dict[str, dict]:
    """``sinfo -h -o '%P|%l|%D|%N'`` -> partitions (see :class:`ClusterNodes`; node names as sinfo prints them,
    possibly compressed, e.g. ``node[0-1]``)."""
    parts: dict[str, dict] = {}
    for line in out.strip().splitlines():
        f = line.strip().split("|")
        if len(f) < 3:
            continue
        name = f[0].rstrip("*")
        p = parts.setdefault(name, {"nodes": 0, "max_minutes": float("inf"), "default": False, "nodelist": []})
        p["default"] = p["default"] or f[0].endswith("*")
        p["max_minutes"] = parse_minutes(f[1]) if parse_minutes(f[1]) is not None else float("inf")
        p["nodes"] += int(f[2]) if f[2].strip().isdigit() else 0
        if len(f) > 3:
            p["nodelist"].append(f[3].strip())
    return parts


def parse_scontrol_nodes(out: str) -> dict[str, dict]:
    """``scontrol show node -o`` (one line per node) -> name -> {"cpus", "memory_mb", "gpus", "partitions"}."""
    nodes: dict[str, dict] = {}
    for line in out.strip().splitlines():
        kv = dict(re.findall(r"(\w+)=(\S*)", line))
        name = kv.get("NodeName")
        if not name:
            continue
        gpus = 0
        for g in (kv.get("Gres") or "").split(","):
            m = re.match(r"gpu(?::[^:(]+)?:(\d+)", g.strip())
            if m:
                gpus += int(m.group(1))
        nodes[name] = {"cpus": int(kv.get("CPUTot") or 0), "memory_mb": int(kv.get("RealMemory") or 0),
                       "gpus": gpus, "partitions": [p for p in (kv.get("Partitions") or "").split(",") if p]}
    return nodes


def _fmt_mb(mb: int) -> str:
    return f"{mb / 1024:.1f} GiB ({mb} MiB)" if mb >= 1024 else f"{mb} MiB"


_SRUN_OPT = re.compile(r"(?<![\w-])--(cpus-per-task|gpus-per-node|gpus|gres)(?:=|\s+)(\S+)")


def _srun_repeats(text: str, refused: Callable[[str, str], bool]) -> list[tuple[int, str]]:
    """(line, ``--option=value``) of each ``srun`` command line that repeats an option ``refused(option, value)``
    names: srun asks for its step's resources again, so fixing only the ``#SBATCH`` line leaves the step refused."""
    out = []
    for lineno, line in _shell_commands(text):
        m = re.search(r"(?<![\w-])srun\b", line)
        if not m or re.match(r"\s*(echo|printf)\b", line):
            continue
        for o in _SRUN_OPT.finditer(line, m.end()):
            if refused(o.group(1), o.group(2).strip("'\"")):
                out.append((lineno + line[:o.start()].count("\n"), f"--{o.group(1)}={o.group(2)}"))
    return out


def _also_msg(also: list[tuple[int, str]], path: str) -> str:
    return "".join(f"; the srun line at {path}:{ln} asks for it again ({opt})" for ln, opt in also)


def _also_fix(also: list[tuple[int, str]], instead: str) -> str:
    if not also:
        return ""
    where = ", ".join(str(ln) for ln, _ in also)
    return f"; change the srun line{'s' if len(also) > 1 else ''} ({where}) too ({instead})"


def check_against_cluster(text: str, path: str, cluster: ClusterNodes, *, where: str = "this cluster") -> list[Finding]:
    """Each ``#SBATCH`` directive of the header against what the cluster's nodes have (see the module docstring);
    every finding names the directive's line, what the cluster has and the line to write instead."""
    h = header(text)
    out: list[Finding] = []
    part_d = h.get("partition")
    part = part_d.value.split(",")[0] if part_d else cluster.default_partition()
    names = ", ".join(cluster.partitions) or "none"
    if part_d and part not in cluster.partitions:
        default = cluster.default_partition()
        out.append(Finding(path, part_d.line, "sbatch-partition",
                           f"--partition={part_d.value}: {where} has no partition {part!r} (it has: {names}); "
                           "sbatch refuses the job (invalid partition name specified)",
                           f"`#SBATCH --partition={default}` or remove the line (the default partition is "
                           f"{default})"))
        part = default
    p = cluster.partitions.get(part or "", {})
    members = [n for n, info in cluster.nodes.items() if not info.get("partitions") or part in info["partitions"]]
    pool = {n: cluster.nodes[n] for n in members} or cluster.nodes
    total = p.get("nodes") or len(pool)
    nodes_d = h.get("nodes")
    want_nodes = _nodes(nodes_d.value) if nodes_d else 1
    if nodes_d and want_nodes > total:
        out.append(Finding(path, nodes_d.line, "sbatch-nodes",
                           f"--nodes={nodes_d.value}: partition {part} of {where} has {total} node(s); the job "
                           "would never start", f"`#SBATCH --nodes={total}` (or a bigger cluster: `broker slurm up "
                           f"--nodes {want_nodes}`)"))
    # per-node requests: how many nodes can hold one share of the job
    tasks_d = h.get("ntasks-per-node")
    cpt_d = h.get("cpus-per-task")
    tasks = int(tasks_d.value) if tasks_d and tasks_d.value.isdigit() else 1
    cpt = int(cpt_d.value) if cpt_d and cpt_d.value.isdigit() else 1
    max_cpus = max((n["cpus"] for n in pool.values()), default=0)
    if (tasks_d or cpt_d) and tasks * cpt > max_cpus:
        d = cpt_d if cpt_d and cpt > 1 else tasks_d
        assert d is not None
        fit = max(1, max_cpus // max(1, tasks)) if d is cpt_d else max(1, max_cpus // max(1, cpt))
        what = (f"--ntasks-per-node={tasks} x --cpus-per-task={cpt} = {tasks * cpt} CPUs per node"
                if tasks_d and cpt_d else f"--{d.name}={d.value}")
        also = _srun_repeats(text, lambda o, v: o == "cpus-per-task" and v.isdigit() and int(v) > max_cpus)
        out.append(Finding(path, d.line, "sbatch-cpus",
                           f"{what}: the nodes of {where} have {max_cpus} CPU(s) each; the job would never start "
                           "(sbatch: Requested node configuration is not available)" + _also_msg(also, path),
                           f"`#SBATCH --{d.name}={fit}` (torchrun starts the node's workers itself: one task "
                           "per node is the usual shape)" + _also_fix(also, f"--cpus-per-task={fit}")))
    gpus, gd = gpus_asked(h)
    max_gpus = max((n["gpus"] for n in pool.values()), default=0)
    if gd is not None and gpus > max_gpus:
        if max_gpus == 0:
            msg = (f"--{gd.name}={gd.value}: the nodes of {where} have no GPUs (no gpu GRES in sinfo); sbatch "
                   "refuses the job (Invalid generic resource (gres) specification)")
            fix = ("remove the line and let the job run on CPU: the training script must then pick gloo "
                   "(`backend = 'nccl' if torch.cuda.is_available() else 'gloo'`) and torchrun "
                   "`--nproc_per_node=1`")
        else:
            msg = f"--{gd.name}={gd.value}: the nodes of {where} have at most {max_gpus} GPU(s) each"
            fix = f"`#SBATCH --gres=gpu:{max_gpus}` (and torchrun `--nproc_per_node={max_gpus}`)"
        also = _srun_repeats(text, lambda o, v: (o in ("gpus-per-node", "gpus") and (max_gpus == 0 or (
            re.search(r"(\d+)$", v) and int(re.search(r"(\d+)$", v).group(1)) > max_gpus)))
            or (o == "gres" and "gpu" in v))
        out.append(Finding(path, gd.line, "sbatch-gres", msg + _also_msg(also, path),
                           fix + _also_fix(also, "no GPU option" if max_gpus == 0 else f"--gpus-per-node={max_gpus}")))
    mem_d = h.get("mem")
    if mem_d:
        mb = parse_mem_mb(mem_d.value)
        max_mb = max((n["memory_mb"] for n in pool.values()), default=0)
        if mb is not None and mb > max_mb:
            out.append(Finding(path, mem_d.line, "sbatch-mem",
                               f"--mem={mem_d.value}: the nodes of {where} have {_fmt_mb(max_mb)} of memory each "
                               "(RealMemory); the job would never start",
                               f"`#SBATCH --mem={max(1, max_mb * 9 // 10)}M` or remove the line (the whole node's "
                               "memory is then available)"))
    time_d = h.get("time")
    if time_d:
        mins = parse_minutes(time_d.value)
        limit = p.get("max_minutes", float("inf"))
        if mins is None:
            out.append(Finding(path, time_d.line, "sbatch-time",
                               f"--time={time_d.value}: not a time sbatch reads", "`#SBATCH --time=00:30:00` "
                               "(minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)"))
        elif mins > limit:
            out.append(Finding(path, time_d.line, "sbatch-time",
                               f"--time={time_d.value}: partition {part} allows {limit:.0f} minute(s) (MaxTime); "
                               "the job would stay PENDING (PartitionTimeLimit) for ever",
                               f"`#SBATCH --time={int(limit)}`"))
        elif cluster.minutes_left is not None and mins > cluster.minutes_left:
            out.append(Finding(path, time_d.line, "sbatch-time-deadline",
                               f"--time={time_d.value}: {where} is torn down at its deadline in "
                               f"{cluster.minutes_left:.0f} minute(s), before this limit",
                               f"`#SBATCH --time={max(1, int(cluster.minutes_left))}` (or `broker slurm up "
                               "--max-hours` for a longer-lived cluster)"))
    return sorted(out, key=lambda f: f.line)
