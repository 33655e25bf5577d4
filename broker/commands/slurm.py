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
        time: str = typer.Option(None, "--time", "-t", metavar="HH:MM:SS",
                                 help="wall-clock limit (default: the recipe's max_hours)"),
        output: Path = typer.Option(None, "--output", "-o", help="write the script here instead of printing it"),
        log_dir: str = typer.Option(None, "--log-dir",
                                    help="directory for the per-node logs on the cluster (default: ./slurm-logs "
                                         "next to the output file, or in the current directory); created now"),
        workdir: str = typer.Option(None, "--workdir", help="job directory on the cluster (default: the recipe's "
                                                            "workdir)"),
        python: str = typer.Option("python3", "--python", help="Python with torch on the nodes"),
        port: int = typer.Option(None, "--port", help="fixed MASTER_PORT (default: derived from the job id)"),
        cpu_only: bool = typer.Option(False, "--cpu-only",
                                      help="no --gpus-per-node (CPU-only cluster, cpu_ok recipes, gloo)"),
    ) -> None:
        """Print (or write with --output) the sbatch script for RECIPE: srun starts one torchrun per node."""
        from broker.recipe import load_recipe
        from broker.slurm import render_sbatch

        recipe = load_recipe(recipe_path)
        base = output.resolve().parent if output else Path.cwd()
        logs = Path(log_dir) if log_dir else base / "slurm-logs"
        script = render_sbatch(recipe, partition=partition, account=account, time=time, log_dir=logs.absolute(),
                               port=port, python=python, workdir=workdir, gpus=not cpu_only)
        # sbatch cannot open --output files in a missing directory (the job then fails without a log)
        logs.mkdir(parents=True, exist_ok=True)
        if output:
            output.write_text(script)
            output.chmod(0o755)
            typer.echo(f"wrote {output} (logs in {logs}); submit with: sbatch {output}", err=True)
        else:
            typer.echo(script, nl=False)
