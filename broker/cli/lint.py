"""``broker lint PATH... [--json]``: static check of training scripts and Slurm batch scripts for multi-host
mistakes.  Exit status: 0 no findings, 1 findings, 2 bad input."""

from __future__ import annotations

from pathlib import Path

import typer


def lint_cmd(
    paths: list[Path] = typer.Argument(..., metavar="PATH...",
                                       help="training scripts, Slurm batch scripts (#SBATCH), broker recipes "
                                            "(.yaml: their fields and the script they name) or directories "
                                            "(their *.py, batch scripts and recipes, recursively)"),
    as_json: bool = typer.Option(False, "--json", help="print the findings as JSON"),
    strict: bool = typer.Option(False, "--strict", hidden=True,
                                help="accepted for old scripts: findings always exit 1 now"),
) -> None:
    """Check Python training scripts for: the GPU picked from the global rank; nccl without a CUDA fallback;
    rank-0 work (writes, result prints, checkpoints, profiler traces) keyed on LOCAL_RANK; downloads by
    global rank 0 only; SLURM_PROCID/SLURM_NTASKS preferred over torchrun's RANK/WORLD_SIZE.  Check Slurm
    batch scripts for torchrun started from the batch shell of a multi-node allocation (not through srun)
    and torchrun without --node_rank or a rendezvous; a broker recipe (.yaml) for its fields and the script it
    names (as `broker run` lints it); any shell script for the node rank expanded before srun,
    RANK=$SLURM_PROCID under torchrun and a master address that is not node 0's.  Prints file:line, the
    mistake and the fix.

    Exit status: 0 no findings, 1 findings, 2 bad input (a missing path).

    Silence one finding with a `# broker-lint: ignore[KIND]` comment on its line.
    """
    from dataclasses import asdict

    from rich.markup import escape

    from broker.lint.rules import lint_script, lintable_files
    from broker.core.provider import BadInput
    from broker.core.ui import console, print_json

    def print_fix(fix: str) -> None:
        """``fix: PROSE`` wrapped as prose, each `backticked` code snippet verbatim on a line of its own
        (never wrapped: it is meant to be copied)."""
        import re

        parts = re.split(r"`([^`]+)`", fix)
        prose: list[str] = []
        first = True

        def flush() -> None:
            nonlocal first
            text = " ".join(" ".join(prose).split()).strip(" ;,")
            prose.clear()
            if text:
                console.print(("    fix: " if first else "      ") + escape(text), highlight=False)
                first = False

        for i, part in enumerate(parts):
            if i % 2 == 0:
                prose.append(part)
                continue
            flush()
            if first:
                console.print("    fix:", highlight=False)
                first = False
            console.verbatim("        " + part)
        flush()

    from broker.lint.recipes import RECIPE_ADVICE, is_yaml_path

    files, problems = lintable_files(paths)
    if problems:
        # a problem that already says what to pass instead stays one line
        raise BadInput("; ".join(problems),
                       hint=None if all(RECIPE_ADVICE in p for p in problems) else
                       "give Python training scripts, Slurm batch scripts (#SBATCH), broker recipes (.yaml) "
                       "or directories holding them")
    findings = []
    for f in files:
        try:
            for x in lint_script(f):
                if x not in findings:  # a recipe's script given (or found) as well: each finding once
                    findings.append(x)
        except OSError as e:
            raise BadInput(f"{f}: cannot read it ({e.strerror or e})", hint="check the path and its permissions")
    recipes = sum(1 for f in files if is_yaml_path(f))
    if as_json:
        print_json({"paths": [str(p) for p in paths], "files": [str(f) for f in files],
                    "findings": [asdict(f) for f in findings]})
    elif not findings:
        what = str(files[0]) if len(files) == 1 else (
            f"{len(files)} files ({recipes} recipe{'s' if recipes != 1 else ''})" if recipes
            else f"{len(files)} files")
        console.print(f"{escape(what)}: no findings", highlight=False)
    else:
        for f in findings:
            console.print(f"{escape(f.path)}:{f.line}: [bold red]error[/] {escape('[' + f.kind + ']')} "
                          f"{escape(f.message)}", highlight=False)
            print_fix(f.fix)
        console.print(f"{len(findings)} finding(s) in {len({f.path for f in findings})} of {len(files)} file(s)",
                      highlight=False)
    raise typer.Exit(1 if findings else 0)
