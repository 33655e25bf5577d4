"""``broker slurm render RECIPE``: the sbatch script broker would submit for a recipe (see broker/slurm.py)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    slurm = typer.Typer(help="Slurm clusters: render the sbatch script of a recipe (run it with "
                             "`broker run RECIPE --provider slurm`).", no_args_is_help=True)
    app.add_typer(slurm, name="slurm")

    @slurm.command("render")
    def render_cmd(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="recipe YAML, e.g. recipes/ddp_2node.yaml"),
        partition: str = typer.Option(None, "--partition", "-p", help="Slurm partition (default: the cluster's)"),
        account: str = typer.Option(None, "--account", "-A", help="Slurm account to charge"),
        time: str = typer.Option(None, "--time", "-t", metavar="TIME",
                                 help="wall-clock limit, any sbatch form: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                                      "D-HH:MM:SS (default: the recipe's max_hours)"),
        output: Path = typer.Option(None, "--output", "-o", help="write the script here instead of printing it"),
        log_dir: str = typer.Option(None, "--log-dir",
                                    help="directory for the per-node logs on the cluster, relative to the job "
                                         "folder (default: slurm-logs); it must exist before sbatch (not created "
                                         "here)"),
        workdir: str = typer.Option(None, "--workdir", help="job folder on the cluster (default: the folder you "
                                                            "submit from, holding a copy of the recipe's workdir)"),
        python: str = typer.Option("python3", "--python", help="Python with torch on the nodes"),
        port: int = typer.Option(None, "--port", help="fixed MASTER_PORT (default: derived from the job id)"),
        cpu_only: bool = typer.Option(False, "--cpu-only",
                                      help="no --gpus-per-node (CPU-only cluster, cpu_ok recipes, gloo)"),
    ) -> None:
        """Print (or write with --output) the sbatch script for RECIPE: srun starts one torchrun per node.

        No side effects besides --output: nothing is created, and the script holds no path of this machine unless
        given (--workdir, --log-dir).  sbatch opens the batch log before the script runs, so the log folder must
        exist when submitting: the printed submit line creates it."""
        import shlex

        from broker.recipe import load_recipe
        from broker.slurm import render_sbatch

        recipe = load_recipe(recipe_path, resolve=False)  # env ${NAME} stays a reference: no secret printed
        logs = log_dir or "slurm-logs"
        script = render_sbatch(recipe, partition=partition, account=account, time=time, log_dir=logs,
                               port=port, python=python, workdir=workdir or ".", gpus=not cpu_only, env_refs=True)
        if output:
            output.write_text(script)
            output.chmod(0o755)
        job = shlex.quote(str(output)) if output else "job.sbatch"
        where = (f"in {shlex.quote(workdir)}" if workdir else
                 f"from a copy of {recipe.workdir} on the cluster (the job runs in the folder you submit from)")
        typer.echo(("wrote " + str(output) + "; " if output else "")
                   + f"logs go to {logs}/ (relative to the job folder); it must exist before sbatch opens the "
                   f"batch log. Submit {where}:\n  mkdir -p {shlex.quote(logs)} && sbatch {job}", err=True)
        refs = recipe.env_references()
        if refs:
            typer.echo(f"the job reads {', '.join(refs)} from the environment sbatch is run in (sbatch exports it)",
                       err=True)
        if not output:
            typer.echo(script, nl=False)
