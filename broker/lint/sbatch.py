"""The Slurm batch-script rules (``sbatch-torchrun-not-srun``, ``sbatch-no-node-rank``): whether a file is a batch
script, how many nodes it asks for, and the commands its shell runs.
"""

from __future__ import annotations

import re
import shlex

from broker.lint.kinds import FIXES, Finding


# ====================================================================================================== Slurm
_TORCHRUN = re.compile(r"(?:^|[\s;&|(`'\"])"
                       r"(torchrun|python[\w.]*\s+(?:-\S+\s+)*-m\s+torch\.distributed\.(?:run|launch))"
                       r"(?=\s|$|['\"])")


def is_sbatch(text: str) -> bool:
    """A Slurm batch script: ``#SBATCH`` directives in its header."""
    return bool(re.search(r"^#SBATCH\s", text, flags=re.M))


def _sbatch_nodes(text: str) -> tuple[int, int]:
    """(the most nodes the ``#SBATCH`` header asks for, its line); (1, 0) when it does not say."""
    most, where = 1, 0
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or (line.startswith("#") and not line.startswith("#SBATCH")):
            continue
        if not line.startswith("#SBATCH"):
            break  # sbatch stops reading directives at the first command
        try:
            toks = shlex.split(line[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        for j, t in enumerate(toks):
            value = None
            if t.startswith("--nodes="):
                value = t.split("=", 1)[1]
            elif t in ("--nodes", "-N") and j + 1 < len(toks):
                value = toks[j + 1]
            elif t.startswith("-N") and len(t) > 2:
                value = t[2:].lstrip("=")
            if value:
                nums = [int(x) for x in re.findall(r"\d+", value.split(":")[0])]
                if nums and max(nums) > most:
                    most, where = max(nums), i
    return most, where


def _shell_commands(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each command line of a shell script: backslash continuations and quoted strings
    that span lines are joined (with their newlines, so a position still tells its line), comments dropped,
    here-document bodies (text for another file) skipped."""
    out: list[tuple[int, str]] = []
    cur, start, quote, heredoc = "", 0, None, None
    for lineno, line in enumerate(text.splitlines(), 1):
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        if not cur and quote is None:
            start = lineno
        continued = False
        j = 0
        while j < len(line):
            ch = line[j]
            if quote:
                if ch == quote:
                    quote = None
                elif ch == "\\" and quote == '"' and j + 1 < len(line):
                    cur += ch
                    j += 1
                    ch = line[j]
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (j == 0 or line[j - 1].isspace()):
                break  # a comment to the end of the line
            elif ch == "\\":
                if j == len(line) - 1:
                    continued = True
                    break
                cur += ch
                j += 1
                ch = line[j]
            cur += ch
            j += 1
        if quote is not None:
            cur += "\n"
            continue
        if continued:
            cur += "\n"
            continue
        if cur.strip():
            out.append((start, cur))
            m = re.search(r"(?<!<)<<-?(?!<)\s*['\"]?(\w+)", cur)
            heredoc = m.group(1) if m else None
        cur = ""
    if cur.strip():
        out.append((start, cur))
    return out


def lint_sbatch(text: str, path: str = "<job.sbatch>") -> list[Finding]:
    """Findings for a Slurm batch script: torchrun started from the batch shell of a multi-node allocation
    (instead of once per node through srun) and torchrun without a node rank or rendezvous."""
    nodes, nodes_line = _sbatch_nodes(text)
    if nodes <= 1:
        return []
    logical = _shell_commands(text)
    srun_vars = set()
    for _, line in logical:  # STEP=(srun ...) / SRUN="srun ..." -> "${STEP[@]}" torchrun ...
        for m in re.finditer(r"\b(\w+)=\(?['\"]?srun\b", line):
            srun_vars.add(m.group(1))
    findings: list[Finding] = []
    for lineno, line in logical:
        m = _TORCHRUN.search(line)
        if not m or re.match(r"\s*(echo|printf)\b", line):
            continue
        before = line[:m.start(1)]
        by_srun = re.search(r"(?:^|[\s;&|(])srun\b", before) or any(
            re.search(r"\$\{?" + re.escape(v) + r"\b", before) for v in srun_vars)
        launcher = "torchrun" if m.group(1) == "torchrun" else "python -m torch.distributed.run"
        lineno += line[:m.start(1)].count("\n")  # the line torchrun stands on
        if not by_srun:
            findings.append(Finding(path, lineno, "sbatch-torchrun-not-srun",
                                    f"{launcher} runs in the batch shell of a {nodes}-node allocation "
                                    f"(line {nodes_line}): only the first node runs it, and the job waits for the "
                                    "other nodes until its time limit", FIXES["sbatch-torchrun-not-srun"]))
        after = line[m.start(1):]
        rank = re.search(r"--node[_-]rank\b", after)
        rdzv = re.search(r"--rdzv[_-](?:backend|endpoint)\b", after)
        if "--standalone" in after or not (rank or rdzv):
            why = "--standalone" if "--standalone" in after else "neither --node_rank nor a rendezvous"
            findings.append(Finding(path, lineno, "sbatch-no-node-rank",
                                    f"torchrun with {why} in a {nodes}-node allocation: the nodes never form one job",
                                    FIXES["sbatch-no-node-rank"]))
    return findings
