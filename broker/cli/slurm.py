"""``broker slurm render RECIPE``: the sbatch script broker would submit for a recipe (see broker/slurm/executor.py).

``broker slurm up|status|down``: a Slurm cluster of broker's own on acquired nodes (see broker/slurm/cluster.py).
"""

from __future__ import annotations

from pathlib import Path

import typer


#: ``broker slurm``: its subcommands below (broker.cli.app.COMMAND_TABLE adds the group)
slurm_app = typer.Typer(help="Slurm clusters: build one on rented or emulated nodes (up), submit your own sbatch "
                             "file to it (submit), look at it (status), release it (down), or print a recipe's "
                             "sbatch script (render; `broker run RECIPE --provider slurm` runs a recipe through "
                             "Slurm).", no_args_is_help=True)


def _up_providers_help() -> str:
    """``--provider`` help of ``slurm up``: every adapter that declares ``slurm_nodes``, the free ones first."""
    from broker.providers import SLURM_NODES, capability

    def words(names: list[str]) -> str:
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]

    free = [n for n in SLURM_NODES if not capability(n, "rents")]
    rented = [n for n in SLURM_NODES if capability(n, "rents")]
    parts = ([f"{words(free)} (network namespaces on this machine, free)"] if free else []) + \
        ([f"{words(rented)} (rented VMs)"] if rented else [])
    return "where the nodes come from: " + ", ".join(parts)


@slurm_app.command("up", short_help="Build a Slurm cluster on acquired nodes over SSH")
def up_cmd(
    provider: str = typer.Option("netns", "--provider", "-p", help=_up_providers_help()),
    nodes: int = typer.Option(2, "--nodes", "-n", help="number of nodes (node0 = slurmctld + slurmd)"),
    name: str = typer.Option(None, "--name", help="cluster name (default: a random one)"),
    max_hours: float = typer.Option(2.0, "--max-hours", help="hard deadline in hours: the watchdog tears the "
                                    "cluster down then"),
    budget: float = typer.Option(5.0, "--budget", help="budget in USD for the cluster's nodes"),
    gpus: bool = typer.Option(False, "--gpus", help="cloud: GPU nodes (default: CPU nodes, cpu_ok jobs)"),
    recipe_path: Path = typer.Option(None, "--recipe", help="a recipe you mean to run: its script is linted "
                                     "for the cluster's nodes (nccl with no CPU fallback on CPU nodes)"),
    no_watchdog: bool = typer.Option(False, "--no-watchdog", help="do not start the detached watchdog"),
    yes: bool = typer.Option(False, "--yes", "-y", help="rented nodes: do not ask before spending"),
    as_json: bool = typer.Option(False, "--json", help='print {"cluster_id": ..., "nodes": [...]}'),
) -> None:
    """Acquire nodes, build Slurm on them over SSH (munge, slurmctld, slurmd) and wait until every node is
    idle; prints the cluster id (use it with `broker run RECIPE --provider slurm --cluster ID`)."""
    from rich.markup import escape

    from broker.cli.run import confirm_spending
    from broker.money.ledger import Ledger
    from broker.slurm.cluster import UpOptions, up
    from broker.core.ui import console, err, print_json

    recipe = None
    if recipe_path is not None:
        from broker.core.recipe import load_recipe

        recipe = load_recipe(recipe_path)

    def say(msg: str) -> None:
        err.print(f"[dim]slurm up[/] {msg}", markup=True, highlight=False)

    opts = UpOptions(provider=provider, nodes=nodes, name=name, max_hours=max_hours, budget_usd=budget,
                     cpu_only=not gpus, watchdog=not no_watchdog)
    state = up(opts, ledger=Ledger(), say=say,
               confirm=lambda q: confirm_spending(q, yes=yes, as_json=as_json))
    advice = cpu_lint_advice(recipe, state) if recipe is not None else []
    for line in advice:
        err.print(f"[yellow]lint:[/] {escape(line)}", markup=True, highlight=False)
    if as_json:
        print_json({**state.to_json(), "advice": advice})
    else:
        err.print(f"shared directory: {state.shared_dir} ({state.shared_note})", markup=False, highlight=False)
        err.print(f"run a recipe: broker run RECIPE --provider slurm --cluster {state.cluster_id}; "
                  f"your own sbatch file: broker slurm submit FILE.sh --cluster {state.cluster_id}; "
                  f"remove it: broker slurm down {state.cluster_id}", markup=False, highlight=False)
        console.print(state.cluster_id, highlight=False)


@slurm_app.command("submit", short_help="Check your own sbatch file against a cluster, submit it, follow it",
               context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit_cmd(
    ctx: typer.Context,
    script: Path = typer.Argument(..., metavar="FILE",
                                  help="your sbatch file (FILE.sh); its folder is staged with it"),
    cluster: str = typer.Option(..., "--cluster", "-c", metavar="ID", help="cluster id from `broker slurm up`"),
    yes: bool = typer.Option(False, "--yes", "-y", help="submit even when a finding says it cannot run as "
                             "written"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream the job's output"),
    stall_s: float = typer.Option(60.0, "--stall-s", metavar="SECONDS", help="seconds without output from the "
                                  "running job before its ranks' stacks are read to name a hang (a recipe's "
                                  "stall_s; 0 turns the watch off)"),
    on_stall: str = typer.Option("stop", "--on-stall", metavar="stop|report", help="a stalled job: stop "
                                 "(scancel it: a hang burns its allocation) or report (name it, let it run); "
                                 "a recipe's on_stall"),
    as_json: bool = typer.Option(False, "--json", help="print the outcome as JSON"),
) -> None:
    """Check FILE (your sbatch file) against the cluster's real nodes (each #SBATCH line, the torchrun/srun
    lines), then stage its folder to the cluster's shared directory, sbatch it (arguments after -- go to the
    script), stream its --output/--error files and end with Slurm's state, the exit code and a diagnosis.
    A job whose output stops for --stall-s while its torchrun workers sit still is named (each rank's place:
    the collective it waits in, or its line) and, with --on-stall stop, cancelled.

    Exit status: 0 completed, 1 the job failed (FAILED, TIMEOUT, CANCELLED, ...), 2 refused (a finding means it
    cannot run as written; --yes submits anyway), 4 Slurm or SSH error, 130 interrupted (the job is cancelled)."""
    from rich.markup import escape

    from broker.money.ledger import Ledger
    from broker.slurm.submit import format_finding, submit
    from broker.core.ui import console, echo_line, err, print_json

    args = [a for a in ctx.args]
    if args and args[0] == "--":
        args = args[1:]

    def report(findings) -> None:  # stderr, also with --json: a refusal's reasons are these lines
        for f in findings:
            err.print(escape(format_finding(f)), markup=True, highlight=False)
            _print_fix(f.fix, err)
        if not findings:
            err.print(f"{escape(str(script))}: no findings against cluster {escape(cluster)}", markup=True,
                      highlight=False)

    def say(msg: str) -> None:
        if not as_json:
            err.print(f"[dim]slurm submit[/] {escape(msg)}", markup=True, highlight=False)

    out = submit(Ledger(), cluster, script, args, yes=yes, report=report, say=say,
                 echo=None if (quiet or as_json) else echo_line, stall_s=stall_s, on_stall=on_stall)
    if as_json:
        from dataclasses import asdict

        d = asdict(out)
        d["log_paths"] = {str(k): str(v) for k, v in out.log_paths.items()}
        d["files"] = [str(p) for p in out.files]
        print_json(d)
    else:
        code = f"{out.exit_code}:{out.signal or 0}" if out.exit_code is not None else "-"
        console.print(f"[bold]run {out.run_id}[/]: Slurm job {out.job_id} {out.state}, ExitCode {code} "
                      f"({out.status}); logs in {escape(str(out.files[0].parent.parent if out.files else ''))}",
                      highlight=False)
        for line in out.diagnosis:
            console.print(escape(line), highlight=False)
    raise typer.Exit(out.exit_status)


@slurm_app.command("status", short_help="A cluster's nodes, queue, cost so far and deadline")
def status_cmd(
    cluster_id: str = typer.Argument(..., metavar="ID", help="cluster id from `broker slurm up`"),
    as_json: bool = typer.Option(False, "--json", help="print as JSON"),
) -> None:
    """Nodes and their Slurm state, the queue, cost so far and the deadline of a cluster."""
    from rich.table import Table

    from broker.money.ledger import Ledger
    from broker.slurm.cluster import status
    from broker.core.ui import console, err, print_json, usd

    st = status(Ledger(), cluster_id)
    if as_json:
        print_json(st)
        return
    console.print(f"[bold]cluster {st['cluster_id']}[/] ({st['name']}, {st['provider']}): {st['status']}; "
                  f"cost so far {usd(st['cost_usd'])}; deadline {st['deadline'] or '-'}; shared "
                  f"{st['shared_dir']}", highlight=False)
    t = Table("node", "state", "cpus", "gpus")
    for n in st["nodes"]:
        t.add_row(n["name"], n["state"], str(n["cpus"]), str(n["gpus"]))
    console.print(t)
    if st["queue"]:
        q = Table("job", "name", "state", "time", "nodes", "reason")
        for j in st["queue"]:
            q.add_row(j["job_id"], j["name"], j["state"], j["time"], j["nodes"], j["reason"])
        console.print(q)
    else:
        console.print("queue: empty", highlight=False)
    console.print(f"on a node (`broker ssh {st['cluster_id']} [NODE]`): export SLURM_CONF={st['slurm_conf']}; "
                  f"or from here: broker exec {st['cluster_id']} -- sinfo -N", markup=False, highlight=False)
    if st["error"]:
        err.print(f"[red]cannot ask the cluster:[/] {st['error']}", markup=True, highlight=False)


@slurm_app.command("down", short_help="Stop a cluster's daemons and release its nodes")
def down_cmd(
    cluster_id: str = typer.Argument(..., metavar="ID", help="cluster id from `broker slurm up`"),
    as_json: bool = typer.Option(False, "--json", help="print what is left as JSON"),
) -> None:
    """Stop the cluster's daemons by PID, release its nodes, check that nothing is left (exit 4 if it is)."""
    from broker.money.ledger import Ledger
    from broker.slurm.cluster import down
    from broker.core.ui import console, err, print_json

    def say(msg: str) -> None:
        err.print(f"[dim]slurm down[/] {msg}", markup=True, highlight=False)

    left = down(Ledger(), cluster_id, say=say)
    if as_json:
        print_json({"cluster_id": cluster_id, "left": left})
    elif left:
        err.print("[bold red]still there:[/] " + "; ".join(left), markup=True, highlight=False)
    else:
        console.print(f"cluster {cluster_id}: torn down, nothing left", highlight=False)
    if left:
        raise typer.Exit(4)


@slurm_app.command("render", short_help="Print (or write) the sbatch script for a recipe")
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

    from broker.core.recipe import load_recipe
    from broker.slurm.sbatch import render_sbatch

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
    from broker.core.ui import err

    submit = f"mkdir -p {shlex.quote(logs)} && sbatch {job}"
    err.print(("wrote " + str(output) + "; " if output else "")
              + f"logs go to {logs}/ (relative to the job folder); it must exist before sbatch opens the "
              f"batch log. Submit {where}:\n  {submit}", markup=False, keep=[submit, where])
    refs = recipe.env_references()
    if refs:
        err.print(f"the job reads {', '.join(refs)} from the environment sbatch is run in (sbatch exports it)",
                  markup=False)
    if not output:
        typer.echo(script, nl=False)


def cpu_lint_advice(recipe, state) -> list[str]:
    """On a cluster without GPUs: the lint's ``nccl-no-fallback`` findings of ``recipe``'s script with the fix
    (the job would fail there instead of using gloo); empty on GPU clusters or clean scripts."""
    from broker.lint.kinds import FIXES
    from broker.lint.rules import lint_script

    if any(n.gpus for n in state.nodes):
        return []
    try:
        findings = lint_script(recipe.script)
    except OSError:
        return []
    return [f"{f.path}:{f.line}: this cluster has CPU nodes only and the script uses nccl with no fallback; "
            f"fix: {FIXES['nccl-no-fallback']}" for f in findings if f.kind == "nccl-no-fallback"]


def _print_fix(fix: str, out) -> None:
    """``    fix: PROSE`` with each `backticked` snippet verbatim on a line of its own (meant to be copied)."""
    import re

    from rich.markup import escape

    parts = re.split(r"`([^`]+)`", fix)
    first = True
    for i, part in enumerate(parts):
        text = " ".join(part.split()).strip(" ;,") if i % 2 == 0 else part
        if not text:
            continue
        lead = "    fix: " if first else "      "
        first = False
        if i % 2 == 0:
            out.print(lead + escape(text), highlight=False)
        else:
            if lead.strip():
                out.print(lead.rstrip(), highlight=False)
            out.verbatim("        " + text) if hasattr(out, "verbatim") else out.print("        " + escape(text))
