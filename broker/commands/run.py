"""``broker run RECIPE``: run a recipe end to end and print a summary."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="recipe YAML, e.g. recipes/ddp_2node.yaml"),
        provider: str = typer.Option("local", "--provider", "-p", help="where to run: local (this machine), netns "
                                     "(namespaces with sshd on this machine, over SSH; root)"),
        inject: str = typer.Option(None, "--inject", help="netns only: reproduce a fault (firewall | wrong-iface | "
                                   "mtu) so preflight catches it"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream node logs"),
        as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    ) -> None:
        """Run RECIPE: one torchrun per node, logs streamed as [node i], torn down at the end."""
        from broker.ledger import Ledger
        from broker.orchestrate import run_recipe_local
        from broker.provider import BadInput
        from broker.recipe import load_recipe
        from broker.ui import console, echo_line, print_json
        from broker.commands.summary import render_summary

        recipe = load_recipe(recipe_path)
        if provider not in ("local", "netns"):
            raise BadInput(f"provider {provider!r} is not available for runs yet", hint="use --provider local")
        if inject and provider != "netns":
            raise BadInput("--inject works with --provider netns only")
        ledger = Ledger()

        def started(run, devices):
            if not as_json:
                console.print(f"[bold]run {run.id}[/]: {recipe.name}, {recipe.nodes} nodes x "
                              f"{recipe.gpus_per_node} process(es), topology local (this machine, free); {devices}")
                console.print(f"logs: {run.run_dir}")

        echo = None if (quiet or as_json) else echo_line
        if provider == "netns":
            from providers.netns import run_recipe as run_recipe_netns

            def started_netns(run, devices):
                if not as_json:
                    console.print(f"[bold]run {run.id}[/]: {recipe.name}, {recipe.nodes} nodes x "
                                  f"{recipe.gpus_per_node} process(es), topology multi-node over SSH (netns, free); "
                                  f"{devices}\nlogs: {run.run_dir}")

            run, result = run_recipe_netns(recipe, ledger=ledger, echo=echo, inject=inject, on_start=started_netns)
        else:
            run, result = run_recipe_local(recipe, ledger=ledger, echo=echo, on_start=started)
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
