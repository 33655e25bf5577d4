"""``broker run RECIPE`` / ``broker run SCRIPT.py``: plan, run and tear down a recipe (or the recipe a bare training
script stands for, :mod:`broker.core.scriptrecipe`), then print a summary.

Where it runs:

* no ``--provider``: the planner picks the cheapest valid option over this machine and every cloud (this machine
  is free, so a job it can serve runs here; otherwise the cheapest cloud option with credentials, failing over
  down the ranked options);
* ``--provider local``: this machine (``simulated`` nodes on loopback);
* ``--provider netns``: N network namespaces with their own sshd on this machine, the job over SSH (root);
* ``--provider slurm``: ``sbatch`` on a Slurm cluster (here or through ``--slurm-host``);
* ``--provider vast|oci|aws|fake``: plan over that provider only, provision, run over SSH, tear down.

Every case goes through the one pipeline (:mod:`broker.run.pipeline`); this module is the terminal UI around it.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, List, Optional

import typer

# background runs (`broker run -d`, and `broker down` interrupting one) live in their own module, which `broker down`
# imports too
from broker.cli.detached import _tell_detached_parent, quote_path, run_detached

def _provider_help() -> str:
    """``--provider``'s help, listing the registry's providers (a new adapter joins it by itself)."""
    from broker import providers as registry

    real = [n for n in registry.REGISTRY if n not in registry.PRETEND]
    fake = [n for n in registry.REGISTRY if n in registry.PRETEND]
    return ("where to run: " + ", ".join(real) + (f", or {' or '.join(fake)} (a pretend cloud, to try the money "
                                                  "paths)" if fake else "")
            + "; default: the cheapest valid plan")


def run_cmd(
    recipe_path: Path = typer.Argument(..., metavar="RECIPE|SCRIPT.py", help="recipe YAML, e.g. "
                                       "recipes/ddp_2node.yaml, or a training script run with the recipe "
                                       "defaults and the options below (its folder is copied to every node)"),
    script_args: Optional[List[str]] = typer.Argument(None, metavar="[-- SCRIPT ARGS]",
                                                      help="SCRIPT.py only: the script's own arguments"),
    provider: str = typer.Option(None, "--provider", "-p", help=_provider_help()),
    inject: str = typer.Option(None, "--inject", help="netns only: reproduce a fault (firewall | wrong-iface | "
                               "mtu; with --topology hybrid: udp-blocked, direct-blocked) so preflight catches it"),
    slurm_host: str = typer.Option(None, "--slurm-host", help="--provider slurm: submit through ssh to this "
                                   "login node (user@host); default: Slurm commands on this machine"),
    cluster: str = typer.Option(None, "--cluster", help="--provider slurm: submit to this cluster from `broker "
                                "slurm up` (through its node 0); --provider netns: run on this cluster from "
                                "`broker netns up` (its id or run id)"),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", metavar="NAME=VALUE",
                                               help="a provider's own option (repeat for several), checked by "
                                               "that provider, e.g. -o inject=mtu is --inject mtu"),
    topology: str = typer.Option(None, "--topology", help="override the recipe's topology; hybrid = node 0 on "
                                 "this machine, the rest on VMs over a WireGuard tunnel (with --provider netns: "
                                 "emulated here, two sites behind two NATs)"),
    mesh: str = typer.Option("wireguard", "--mesh", help="hybrid only: wireguard (a tunnel per run) or "
                             "tailscale (an existing tailnet; TS_AUTHKEY in the environment or .env)"),
    no_watchdog: bool = typer.Option(False, "--no-watchdog", help="do not start the detached watchdog "
                                     "(deadline and budget then rest on this CLI and the node alone)"),
    yes: bool = typer.Option(False, "--yes", "-y", help="paid options: do not ask before spending (required "
                             "without a terminal)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream node logs"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    detach: bool = typer.Option(False, "--detach", "-d", help="run in the background: print the run id and "
                                "how to follow it (`broker logs -f`), then return; paid runs need --yes"),
    idle_minutes: float = typer.Option(None, "--idle-minutes", metavar="MINUTES", help="keep the nodes this "
                                       "many minutes after the job for `broker ssh`/`exec` (overrides the "
                                       "recipe's idle_minutes)"),
    interruptible: str = typer.Option(None, "--interruptible", metavar="[true|false|auto]",
                                      help="rent interruptible (bid / spot / preemptible) capacity: true, false "
                                      "or auto (only when its expected cost with restarts is lower); overrides "
                                      "the recipe's interruptible (a preempted run resumes from its "
                                      "checkpoint_dir)"),
    nodes: int = typer.Option(None, "--nodes", "-n", help="SCRIPT.py: how many nodes (default 2)"),
    gpus_per_node: int = typer.Option(None, "--gpus-per-node", help="SCRIPT.py: GPUs per node (default 1; 0: "
                                      "CPU only, with --cpu-ok)"),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", help="SCRIPT.py: a GPU model to accept (repeat for "
                                            "several; default any)"),
    budget: float = typer.Option(None, "--budget", "-b", metavar="USD", help="SCRIPT.py: the budget in "
                                 "dollars (default 5)"),
    hours: float = typer.Option(None, "--hours", help="SCRIPT.py: the hard deadline in hours (default 1)"),
    cpu_ok: bool = typer.Option(False, "--cpu-ok", help="SCRIPT.py: gloo on CPU is fine (this machine without "
                                "a GPU)"),
    setup: Optional[List[str]] = typer.Option(None, "--setup", help="SCRIPT.py: a shell command run on every "
                                              "node before the job (repeat for several), e.g. "
                                              "'pip install -r requirements.txt'"),
    save: Path = typer.Option(None, "--save", metavar="FILE", help="SCRIPT.py: also write the equivalent "
                              "recipe to FILE"),
) -> None:
    """Run RECIPE (or SCRIPT.py with the recipe defaults): one torchrun per node, logs streamed as [node i],
    torn down at the end."""
    from broker.core.limits import check_number
    from broker.core.recipe import load_recipe
    from broker.core.scriptrecipe import is_script

    check_number("--idle-minutes", "idle_minutes", idle_minutes)
    script_flags = {"--nodes": nodes, "--gpus-per-node": gpus_per_node, "--gpu": gpu or None,
                    "--budget": budget, "--hours": hours, "--cpu-ok": cpu_ok or None, "--setup": setup or None,
                    "--save": save, "SCRIPT ARGS": script_args or None}
    if is_script(recipe_path):
        recipe = _script_recipe(recipe_path, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, budget=budget,
                                hours=hours, cpu_ok=cpu_ok, setup=setup, save=save, args=script_args or [],
                                as_json=as_json)
    else:
        _refuse_script_flags(script_flags, recipe_path)
        recipe = load_recipe(recipe_path)
    recipe = recipe.with_interruptible(interruptible, "--interruptible")
    recipe = recipe.with_idle_minutes(idle_minutes)
    if detach:  # checked here (bad input fails in the foreground); the background process lints again
        lint_or_refuse(recipe, as_json=as_json)
        argv = _background_argv(
            recipe, recipe_path, script_flags, script_args,
            before=[("--provider", provider), ("--inject", inject), ("--slurm-host", slurm_host),
                    ("--cluster", cluster), ("--topology", topology),
                    ("--interruptible", recipe.interruptible if interruptible is not None else None)],
            after=[("--option", option or None), ("--mesh", mesh), ("--no-watchdog", no_watchdog or None),
                   ("--yes", yes or None), ("--idle-minutes", idle_minutes)])
        raise typer.Exit(run_detached(argv, recipe, as_json=as_json, provider=provider, yes=yes))
    lint_or_refuse(recipe, as_json=as_json)
    if topology is not None and topology not in ("simulated", "multi-node", "hybrid", "any"):
        from broker.core.provider import BadInput

        raise BadInput(f"--topology {topology!r} is not a topology", hint="simulated, multi-node, hybrid or any")
    raise typer.Exit(run_with_ui(recipe, provider=provider, inject=inject, slurm_host=slurm_host,
                                 cluster=cluster, watchdog=not no_watchdog, yes=yes, quiet=quiet, as_json=as_json,
                                 topology=topology, mesh=mesh, options=provider_options(option or [])))


def _background_argv(recipe: Any, recipe_path: Path, script_flags: dict[str, Any], script_args: list[str] | None,
                     *, before: list[tuple[str, Any]], after: list[tuple[str, Any]]) -> list[str]:
    """The command line of the background process of ``broker run -d``: the recipe, the flags ``before``, the
    SCRIPT.py flags (the background process builds the same recipe from them), the flags ``after``, then the
    script's own arguments.  A value None is left out, True is a switch, a list repeats its flag."""
    from broker.core.scriptrecipe import is_script

    def flags(pairs: list[tuple[str, Any]]) -> list[str]:
        out: list[str] = []
        for flag, value in pairs:
            for v in ([] if value is None else value if isinstance(value, list) else [value]):
                out += [flag] if v is True else [flag, str(v)]
        return out

    script = is_script(recipe_path)
    return ([str(recipe.path or recipe_path.resolve())] + flags(before)
            + (flags([(f, v) for f, v in script_flags.items() if f not in ("--save", "SCRIPT ARGS")]) if script else [])
            + flags(after) + (["--", *script_args] if script and script_args else []))


def run_on_kept(run_id: str, recipe: Any, *, quiet: bool, as_json: bool) -> int:
    """``broker exec RUN RECIPE``: the
    linted ``recipe`` on the live nodes of run ``run_id``, no provisioning, summary printed; returns the exit
    code (4 when something stayed live that should not have).  Raises BadInput when the run has no nodes to
    reach (:func:`broker.run.kept.kept_cluster` says why)."""
    from broker.cli.lifecycle import ProgressPrinter
    from broker.cli.summary import render_summary
    from broker.core.ui import console, echo_node_line, print_json
    from broker.money.ledger import Ledger
    from broker.run.kept import KeptTarget, kept_cluster
    from broker.run.pipeline import run_pipeline
    from broker.run.runrecord import Hooks

    ledger = Ledger()
    origin, cluster = kept_cluster(ledger, run_id)
    prog = ProgressPrinter(ledger)

    def started(run: Any, description: str) -> None:
        prog.bind(run)
        if not as_json:
            with prog.paused():
                console.print(f"[bold]run {run.id}[/]: {recipe.name}, {description}", highlight=False)

    try:
        out = run_pipeline(recipe, KeptTarget(origin, cluster), ledger=ledger,
                           hooks=Hooks(echo=None if (quiet or as_json) else echo_node_line, say=prog,
                                       on_start=started))
    finally:
        prog.close()
    if as_json:
        print_json({"run": out.run, "result": result_dict(out.result) if out.result else None,
                    "kept_from": origin.id})
    elif out.result is not None:
        render_summary(out.run, out.result, recipe, out.cost_usd)
        console.print(f"nodes of {origin.id} still kept; idle timer restarted; `broker down {origin.id}` ends them",
                      highlight=False)
    return out.exit_code if not out.left else 4


def _refuse_script_flags(flags: dict[str, Any], recipe_path: Path) -> None:
    """A recipe run takes the job's shape from the recipe: the SCRIPT.py options name the field to edit instead
    (BadInput)."""
    from broker.core.provider import BadInput

    field = {"--nodes": "nodes", "--gpus-per-node": "gpus_per_node", "--gpu": "gpu: models", "--budget":
             "budget_usd", "--hours": "max_hours", "--cpu-ok": "cpu_ok", "--setup": "setup",
             "SCRIPT ARGS": "args"}
    for flag, value in flags.items():
        if value is None:
            continue
        if flag == "--save":
            raise BadInput("--save writes the recipe of `broker run SCRIPT.py`; this run has its recipe already",
                           hint=f"copy {recipe_path} instead")
        what = "extra arguments after the recipe" if flag == "SCRIPT ARGS" else f"{flag} is for `broker run SCRIPT.py`"
        raise BadInput(f"{what}; for a run of a recipe it is the recipe's `{field[flag]}:` field",
                       hint=f"edit {recipe_path} (its `{field[flag]}:` field), or run the script itself: "
                            f"broker run SCRIPT.py {'-- ARGS' if flag == 'SCRIPT ARGS' else flag + ' ...'}")


def _script_recipe(script: Path, *, nodes: int | None, gpus_per_node: int | None, gpu: list[str] | None,
                   budget: float | None, hours: float | None, cpu_ok: bool, setup: list[str] | None,
                   save: Path | None, args: list[str], as_json: bool) -> Any:
    """The Recipe for ``broker run SCRIPT.py`` (flags checked with their limits first, so an error names the
    flag), with the equivalent recipe printed (and written with ``--save``)."""
    from broker.core.limits import check_number
    from broker.core.provider import BadInput
    from broker.core.scriptrecipe import load_script, placed, recipe_data, recipe_text, requirements_note
    from broker.core.scriptrecipe import save as save_recipe
    from broker.core.ui import err

    for flag, field, value in (("--nodes", "nodes", nodes), ("--gpus-per-node", "gpus_per_node", gpus_per_node),
                               ("--budget", "budget_usd", budget), ("--hours", "max_hours", hours)):
        check_number(flag, field, value)
    if gpus_per_node == 0 and not cpu_ok:  # the recipe's own check would name a file that is not there
        raise BadInput("--gpus-per-node 0 is a CPU-only job, which needs --cpu-ok (gloo on CPU)",
                       hint="add --cpu-ok, or ask for GPUs: --gpus-per-node 1")
    data = recipe_data(script, args=args, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, budget_usd=budget,
                       max_hours=hours, cpu_ok=cpu_ok, setup=setup)
    recipe = load_script(script, data)
    if not as_json:
        # the text is what --save would write in this folder: pasted into a file here, it runs the same job
        text = recipe_text(placed(data, script, Path.cwd()))
        err.print(f"running {script} as this recipe (as a file in this folder; --save FILE writes it):",
                  markup=False)
        err.print("  " + text.rstrip("\n").replace("\n", "\n  "), markup=False, soft_wrap=True)
    if save is not None:
        written = save_recipe(save, data, script)
        if not as_json:
            err.print(f"saved: {written} (`broker run {shlex.quote(str(written))}` runs it again)", markup=False,
                      soft_wrap=True)
    note = requirements_note(script, setup)
    if note and not as_json:
        err.print(note, markup=False)
    return recipe


def lint_or_refuse(recipe: Any, *, as_json: bool) -> None:
    """Run the script lint; print findings as warnings; exit 2 when the recipe asks for ``strict_lint``."""
    from rich.markup import escape

    from broker.lint.rules import lint_recipe
    from broker.core.ui import err

    for w in getattr(recipe, "warnings", ()):  # secret-looking env values: point to secrets:
        err.print(f"[yellow]warning:[/] {escape(w)}", markup=True, highlight=False)
    findings, refuse = lint_recipe(recipe)
    for f in findings:
        err.print(f"[yellow]lint:[/] {escape(f.format())}", markup=True, highlight=False)
    if refuse:
        from broker.core.provider import BadInput

        raise BadInput(f"{len(findings)} lint finding(s) in {recipe.script} and the recipe sets strict_lint",
                       hint="fix them (see above) or set strict_lint: false to run anyway")


def confirm_spending(quote: Any, *, yes: bool, as_json: bool) -> bool:
    """Show what a paid run may cost and ask ``Proceed? [y/N]``; ``yes`` skips the question.  Without a terminal
    (CI, ``</dev/null``) a paid run without ``--yes`` is refused before anything is created (Declined, exit 2)."""
    import sys

    from broker.run.runrecord import Declined
    from broker.core.ui import err

    for line in quote.lines():
        err.print(line, markup=False, highlight=False)
    if yes:
        return True
    if not sys.stdin.isatty():
        raise Declined("this run rents paid machines and there is no terminal to confirm it: nothing was created",
                       hint="pass --yes to confirm the cost shown above")
    err.print("Proceed? [y/N] ", end="", markup=False, highlight=False)
    try:
        answer = sys.stdin.readline().strip().lower()
    except (EOFError, KeyboardInterrupt):
        answer = ""
    return answer in ("y", "yes")


def provider_options(pairs: list[str]) -> dict[str, str]:
    """``--option NAME=VALUE`` pairs as the run request's options (``{"--NAME": VALUE}``, the form the adapters
    declare); raises BadInput for a pair without ``=``."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name.strip("-"):
            from broker.core.provider import BadInput

            raise BadInput(f"--option {pair!r} is not NAME=VALUE", hint="e.g. --option inject=mtu")
        out["--" + name.strip("-")] = value
    return out


def run_with_ui(recipe: Any, *, provider: str | None, inject: str | None = None, slurm_host: str | None = None,
                cluster: str | None = None, watchdog: bool = True, yes: bool = False, quiet: bool = False,
                as_json: bool = False, topology: str | None = None,
                mesh: str = "wireguard", options: dict[str, str] | None = None) -> int:
    """``broker run`` through the one pipeline (:func:`broker.run.pipeline.choose_target` then
    :func:`~broker.run.pipeline.run_pipeline`) with the terminal UI: the run
    header, ``[node i]`` log lines, progress with elapsed time and running cost, the confirmation of paid runs,
    the summary; returns the exit code."""
    from broker.cli.lifecycle import ProgressPrinter, commands_in, kept_message
    from broker.cli.summary import render_summary
    from broker.money.ledger import Ledger
    from broker.core.target import RunRequest
    from broker.run.runrecord import Hooks
    from broker.run.pipeline import choose_target, run_pipeline
    from broker.core.ui import console, echo_node_line, err, print_json

    # a provider's own flags travel by name; the adapter that declares them checks them (broker.core.target)
    options = {**(options or {}), **{flag: value for flag, value in (
        ("--inject", inject), ("--slurm-host", slurm_host), ("--cluster", cluster)) if value}}
    ledger = Ledger()
    prog = ProgressPrinter(ledger)

    def started(run: Any, description: str) -> None:
        prog.bind(run)
        _tell_detached_parent(run)
        if not as_json:
            with prog.paused():  # stdout under stderr's live line: the line first steps aside
                console.print(f"[bold]run {run.id}[/]: {recipe.name}, {recipe.nodes} nodes x "
                              f"{recipe.gpus_per_node} process(es), {description}", highlight=False)
                console.print(f"logs: {quote_path(run.run_dir)}", highlight=False)

    hooks = Hooks(echo=None if (quiet or as_json) else echo_node_line, say=prog, on_start=started,
                  confirm=lambda q: confirm_spending(q, yes=yes, as_json=as_json))
    try:
        target = choose_target(recipe, RunRequest(provider=provider, options=options, watchdog=watchdog,
                                                  topology=topology, mesh=mesh), say=hooks.say)
        out = run_pipeline(recipe, target, ledger=ledger, hooks=hooks)
    finally:
        prog.close()
    origin = target.kept_from()  # nodes kept by an earlier run (a `broker netns up` cluster): they stay
    if as_json:
        print_json({"run": out.run, "result": result_dict(out.result, out.cost_usd) if out.result else None,
                    "cluster": out.cluster, "cost_usd": out.cost_usd, "still_live": out.left,
                    "kept_until_idle": out.kept_until_idle, "kept": out.kept,
                    **({"kept_from": origin} if origin else {})})
    elif out.result is not None:
        render_summary(out.run, out.result, recipe, out.cost_usd)
        if origin:
            console.print(f"nodes of {origin} still kept; idle timer restarted; `broker down {origin}` ends them",
                          highlight=False)
    if out.kept_until_idle and not as_json:
        for line in kept_message(out, recipe.idle_minutes, recipe.idle_words()):
            err.print(line, markup=False, highlight=False, keep=commands_in(line))  # each command whole
    if out.left:
        err.print("[bold red]still live after teardown:[/] " + ", ".join(
            f"{r.provider} {r.kind} {r.provider_id or r.name}" for r in out.left) + f"; run `broker down {out.run.id}`")
    return out.exit_code


def result_dict(result: Any, usd: float = 0.0) -> dict:
    """A RunResult as JSON-ready data."""
    return {"status": result.status, "reason": result.reason, "wall_s": round(result.wall_s, 3),
            "exit_codes": result.exit_codes, "failed_node": result.failed_node,
            "missing_expect": result.missing_expect, "log_paths": {k: str(v) for k, v in result.log_paths.items()},
            "ranks": [r.__dict__ for r in result.ranks], "usd": round(usd, 6),
            "shown_status": result.shown_status, "error_lines": list(result.error_lines),
            "diagnosis": list(result.diagnosis), "warnings": list(getattr(result, "warnings", []))}
