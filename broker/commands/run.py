"""``broker run RECIPE``: plan, run and tear down a recipe, then print a summary.

Where it runs:

* no ``--provider``: the planner picks the cheapest valid option over this machine and every cloud (this machine
  is free, so a job it can serve runs here; otherwise the cheapest cloud option with credentials, failing over
  down the ranked options);
* ``--provider local``: this machine (``simulated`` nodes on loopback);
* ``--provider netns``: N network namespaces with their own sshd on this machine, the job over SSH (root);
* ``--provider slurm``: ``sbatch`` on a Slurm cluster (here or through ``--slurm-host``);
* ``--provider vast|oci|aws|fake``: plan over that provider only, provision, run over SSH, tear down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

RUN_PROVIDERS = ("local", "netns", "slurm", "vast", "oci", "aws", "fake")


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="recipe YAML, e.g. recipes/ddp_2node.yaml"),
        provider: str = typer.Option(None, "--provider", "-p", help="where to run: local, netns, slurm, vast, oci, "
                                     "aws, or fake (a pretend cloud, to try the money paths); default: the "
                                     "cheapest valid plan"),
        inject: str = typer.Option(None, "--inject", help="netns only: reproduce a fault (firewall | wrong-iface | "
                                   "mtu) so preflight catches it"),
        slurm_host: str = typer.Option(None, "--slurm-host", help="--provider slurm: submit through ssh to this "
                                       "login node (user@host); default: Slurm commands on this machine"),
        no_watchdog: bool = typer.Option(False, "--no-watchdog", help="do not start the detached watchdog "
                                         "(deadline and budget then rest on this CLI and the node alone)"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream node logs"),
        as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    ) -> None:
        """Run RECIPE: one torchrun per node, logs streamed as \\[node i], torn down at the end."""
        from broker.provider import BadInput
        from broker.recipe import load_recipe

        if provider is not None and provider not in RUN_PROVIDERS:
            raise BadInput(f"--provider {provider!r} is not a provider broker can run on",
                           hint=f"choose one of: {', '.join(RUN_PROVIDERS)} (or leave it out to let the plan decide)")
        if inject and provider != "netns":
            raise BadInput("--inject works with --provider netns only",
                           hint="broker run RECIPE --provider netns --inject firewall")
        recipe = load_recipe(recipe_path)
        lint_or_refuse(recipe, as_json=as_json)
        if provider == "slurm":
            from broker.commands.slurm import run_slurm

            run_slurm(recipe, host=slurm_host, quiet=quiet, as_json=as_json, result_dict=result_dict)
        if provider in ("local", "netns"):
            raise typer.Exit(run_here(recipe, provider, inject=inject, quiet=quiet, as_json=as_json))

        from broker.commands.lifecycle import run_cloud
        from broker.orchestrate import plan_for_run

        plan, options = plan_for_run(recipe, provider)
        if options[0].provider == "local":
            if not as_json:
                from broker.ui import console

                others = (plan.valid_count or len(plan.options)) - 1
                console.print("plan: this machine (free) is the only valid option" if others == 0 else
                              f"plan: this machine (free) is the cheapest valid option ({others} other valid "
                              f"option(s); `broker plan --recipe {recipe_path}` lists them)")
            raise typer.Exit(run_here(recipe, "local", quiet=quiet, as_json=as_json))
        raise typer.Exit(run_cloud(recipe, options, plan=plan, quiet=quiet, as_json=as_json,
                                   watchdog=not no_watchdog))


def lint_or_refuse(recipe: Any, *, as_json: bool) -> None:
    """Run the script lint; print findings as warnings; exit 2 when the recipe asks for ``strict_lint``."""
    from rich.markup import escape

    from broker.lint import lint_recipe
    from broker.ui import err

    findings, refuse = lint_recipe(recipe)
    for f in findings:
        err.print(f"[yellow]lint:[/] {escape(f.format())}", markup=True, highlight=False)
    if refuse:
        from broker.provider import BadInput

        raise BadInput(f"{len(findings)} lint finding(s) in {recipe.script} and the recipe sets strict_lint",
                       hint="fix them (see above) or set strict_lint: false to run anyway")


def run_here(recipe: Any, provider: str, *, inject: str | None = None, quiet: bool, as_json: bool) -> int:
    """The free providers on this machine: ``local`` (loopback) and ``netns`` (namespaces over SSH)."""
    from broker.commands.summary import render_summary
    from broker.ledger import Ledger
    from broker.ui import console, echo_line, print_json

    ledger = Ledger()
    topo = "local (this machine, free)" if provider == "local" else "multi-node over SSH (netns, free)"

    def started(run: Any, devices: str) -> None:
        if not as_json:
            console.print(f"[bold]run {run.id}[/]: {recipe.name}, {recipe.nodes} nodes x {recipe.gpus_per_node} "
                          f"process(es), topology {topo}; {devices}")
            console.print(f"logs: {run.run_dir}")

    echo = None if (quiet or as_json) else echo_line
    if provider == "netns":
        from broker.providers.netns import run_recipe as run_recipe_netns

        run, result = run_recipe_netns(recipe, ledger=ledger, echo=echo, inject=inject, on_start=started)
    else:
        from broker.orchestrate import run_recipe_local

        run, result = run_recipe_local(recipe, ledger=ledger, echo=echo, on_start=started)
    if as_json:
        print_json({"run": run, "result": result_dict(result)})
    else:
        render_summary(run, result, recipe)
    return 0 if result.ok else (130 if result.status == "interrupted" else 1)


def result_dict(result: Any, usd: float = 0.0) -> dict:
    """A RunResult as JSON-ready data."""
    return {"status": result.status, "reason": result.reason, "wall_s": round(result.wall_s, 3),
            "exit_codes": result.exit_codes, "failed_node": result.failed_node,
            "missing_expect": result.missing_expect, "log_paths": {k: str(v) for k, v in result.log_paths.items()},
            "ranks": [r.__dict__ for r in result.ranks], "usd": round(usd, 6)}
