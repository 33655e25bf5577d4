"""``broker run RECIPE``: run a recipe end to end and print a summary."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="recipe YAML, e.g. recipes/ddp_2node.yaml"),
        provider: str = typer.Option("local", "--provider", "-p", help="where to run: local (this machine) or fake (test cloud)"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream node logs"),
        as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
        no_watchdog: bool = typer.Option(False, "--no-watchdog", help="do not start the detached watchdog "
                                         "(deadline and budget then rest on this CLI and the node alone)"),
        slurm_host: str = typer.Option(None, "--slurm-host", help="--provider slurm: submit through ssh to this "
                                       "login node (user@host); default: Slurm commands on this machine"),
    ) -> None:
        """Run RECIPE: one torchrun per node, logs streamed as \\[node i], torn down at the end."""
        from broker.ledger import Ledger
        from broker.orchestrate import run_recipe_local
        from broker.recipe import load_recipe
        from broker.ui import console, echo_line, print_json
        from broker.commands.summary import render_summary

        recipe = load_recipe(recipe_path)
        if no_watchdog:
            from broker.ui import err

            err.print("[yellow]warning:[/] --no-watchdog: if this CLI dies, nothing on this machine enforces the "
                      "deadline or the budget (run `broker watchdog` yourself, or rely on the node-side switch)")
        if provider == "slurm":
            from broker.commands.slurm import run_slurm

            run_slurm(recipe, host=slurm_host, quiet=quiet, as_json=as_json, result_dict=result_dict)
        if provider != "local":  # rented machines (fake for now): provision ledger-first, run, tear down
            from broker.commands.lifecycle import run_cloud

            raise typer.Exit(run_cloud(recipe, provider, quiet=quiet, as_json=as_json))
        ledger = Ledger()

        def started(run, devices):
            if not as_json:
                console.print(f"[bold]run {run.id}[/]: {recipe.name}, {recipe.nodes} nodes x "
                              f"{recipe.gpus_per_node} process(es), topology local (this machine, free); {devices}")
                console.print(f"logs: {run.run_dir}")

        run, result = run_recipe_local(recipe, ledger=ledger, echo=None if (quiet or as_json) else echo_line,
                                       on_start=started)
        if as_json:
            print_json({"run": run, "result": result_dict(result)})
        else:
            render_summary(run, result, recipe)
        raise typer.Exit(0 if result.ok else (130 if result.status == "interrupted" else 1))


def result_dict(result) -> dict:
    return {"status": result.status, "reason": result.reason, "wall_s": round(result.wall_s, 3),
            "exit_codes": result.exit_codes, "failed_node": result.failed_node,
            "missing_expect": result.missing_expect, "log_paths": {k: str(v) for k, v in result.log_paths.items()},
            "ranks": [r.__dict__ for r in result.ranks], "usd": 0.0}
