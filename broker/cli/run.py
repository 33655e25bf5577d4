"""``broker run RECIPE``: plan, run and tear down a recipe, then print a summary.

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

from pathlib import Path
from typing import Any

import typer

def register(app: typer.Typer) -> None:
    @app.command("run", short_help="Run a recipe: one torchrun per node, torn down at the end")
    def run_cmd(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="recipe YAML, e.g. recipes/ddp_2node.yaml"),
        provider: str = typer.Option(None, "--provider", "-p", help="where to run: local, netns, slurm, vast, oci, "
                                     "aws, or fake (a pretend cloud, to try the money paths); default: the "
                                     "cheapest valid plan"),
        inject: str = typer.Option(None, "--inject", help="netns only: reproduce a fault (firewall | wrong-iface | "
                                   "mtu; with --topology hybrid: udp-blocked, direct-blocked) so preflight catches it"),
        slurm_host: str = typer.Option(None, "--slurm-host", help="--provider slurm: submit through ssh to this "
                                       "login node (user@host); default: Slurm commands on this machine"),
        cluster: str = typer.Option(None, "--cluster", help="--provider slurm: submit to this cluster from `broker "
                                    "slurm up` (through its node 0)"),
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
    ) -> None:
        """Run RECIPE: one torchrun per node, logs streamed as [node i], torn down at the end."""
        from broker.core.limits import check_number
        from broker.core.recipe import load_recipe

        check_number("--idle-minutes", "idle_minutes", idle_minutes)
        recipe = load_recipe(recipe_path)
        if idle_minutes is not None:
            recipe = recipe.model_copy(update={"idle_minutes": float(idle_minutes)})
        if detach:  # checked here (bad input fails in the foreground); the background process lints again
            lint_or_refuse(recipe, as_json=as_json)
            argv = [str(recipe.path or recipe_path)]
            for flag, value in (("--provider", provider), ("--inject", inject), ("--slurm-host", slurm_host),
                                ("--cluster", cluster), ("--topology", topology)):
                if value is not None:
                    argv += [flag, value]
            argv += ["--mesh", mesh] + ["--no-watchdog"] * no_watchdog + ["--yes"] * yes
            if idle_minutes is not None:
                argv += ["--idle-minutes", str(idle_minutes)]
            raise typer.Exit(run_detached(argv, recipe, as_json=as_json))
        lint_or_refuse(recipe, as_json=as_json)
        if topology is not None and topology not in ("simulated", "multi-node", "hybrid", "any"):
            from broker.core.provider import BadInput

            raise BadInput(f"--topology {topology!r} is not a topology", hint="simulated, multi-node, hybrid or any")
        if cluster and provider != "slurm":
            from broker.core.provider import BadInput

            raise BadInput("--cluster works with --provider slurm only",
                           hint="broker run RECIPE --provider slurm --cluster ID")
        raise typer.Exit(run_with_ui(recipe, provider=provider, inject=inject, slurm_host=slurm_host,
                                     cluster=cluster, watchdog=not no_watchdog, yes=yes, quiet=quiet, as_json=as_json,
                                     topology=topology, mesh=mesh))


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


def run_with_ui(recipe: Any, *, provider: str | None, inject: str | None = None, slurm_host: str | None = None,
                cluster: str | None = None, watchdog: bool = True, yes: bool = False, quiet: bool = False,
                as_json: bool = False, topology: str | None = None,
                mesh: str = "wireguard") -> int:
    """``broker run`` through the one pipeline (:func:`broker.run.pipeline.run_recipe`) with the terminal UI: the run
    header, ``[node i]`` log lines, progress with elapsed time and running cost, the confirmation of paid runs,
    the summary; returns the exit code."""
    from broker.cli.lifecycle import ProgressPrinter, kept_message
    from broker.cli.summary import render_summary
    from broker.money.ledger import Ledger
    from broker.run.runrecord import Hooks
    from broker.run.pipeline import RunRequest, run_recipe
    from broker.core.ui import console, echo_node_line, err, print_json

    slurm = None
    if provider == "slurm":
        from broker.core.config import settings
        from broker.slurm.executor import SlurmOptions

        s = settings()
        slurm = SlurmOptions(host=slurm_host or s.broker_slurm_host, partition=s.broker_slurm_partition,
                             account=s.broker_slurm_account, python=s.broker_slurm_python, cluster=cluster)
    ledger = Ledger()
    prog = ProgressPrinter(ledger)

    def started(run: Any, description: str) -> None:
        prog.bind(run)
        _tell_detached_parent(run)
        if not as_json:
            console.print(f"[bold]run {run.id}[/]: {recipe.name}, {recipe.nodes} nodes x {recipe.gpus_per_node} "
                          f"process(es), {description}", highlight=False)
            console.print(f"logs: {quote_path(run.run_dir)}", highlight=False)

    hooks = Hooks(echo=None if (quiet or as_json) else echo_node_line, say=prog, on_start=started,
                  confirm=lambda q: confirm_spending(q, yes=yes, as_json=as_json))
    try:
        out = run_recipe(recipe, RunRequest(provider=provider, inject=inject, slurm=slurm, watchdog=watchdog,
                                             topology=topology, mesh=mesh),
                         ledger=ledger, hooks=hooks)
    finally:
        prog.close()
    if as_json:
        print_json({"run": out.run, "result": result_dict(out.result, out.cost_usd) if out.result else None,
                    "cluster": out.cluster, "cost_usd": out.cost_usd, "still_live": out.left,
                    "kept_until_idle": out.kept_until_idle, "kept": out.kept})
    elif out.result is not None:
        render_summary(out.run, out.result, recipe, out.cost_usd)
    if out.kept_until_idle and not as_json:
        for line in kept_message(out, recipe.idle_minutes):
            err.print(line, markup=False, highlight=False, soft_wrap=True)  # copy-paste: no wrapping
    if out.left:
        err.print("[bold red]still live after teardown:[/] " + ", ".join(
            f"{r.provider} {r.kind} {r.provider_id or r.name}" for r in out.left) + f"; run `broker down {out.run.id}`")
    return out.exit_code


#: environment variable set for a background ``broker run`` (``-d``): its run folder gets :data:`DETACHED_MARKER`
DETACHED_ENV = "BROKER_DETACHED_RUN"
#: marker in a run's folder: the run is driven by a background process (``broker down`` interrupts it first)
DETACHED_MARKER = "detached.json"
#: how long ``broker run -d`` waits for the background process to create its run, seconds
DETACH_START_TIMEOUT_S = 300.0


def _tell_detached_parent(run: Any) -> None:
    """In a background run (``-d``): mark the run folder as driven by this process (for ``broker down``)."""
    import json
    import os

    if os.environ.pop(DETACHED_ENV, None) != "1" or not run.run_dir:
        return
    try:
        (Path(run.run_dir) / DETACHED_MARKER).write_text(json.dumps({"pid": os.getpid()}))
    except OSError:
        pass


def run_detached(args: list[str], recipe: Any, *, as_json: bool = False,
                 timeout_s: float = DETACH_START_TIMEOUT_S) -> int:
    """``broker run -d``: start ``broker run ARGS -q`` as a background process (its own session, stdin closed,
    output to ``<home>/logs/run-<time>-<pid>.out``), wait until it has created its run (the ledger's row with its
    pid) or ended, print the run id and how to follow it; returns 0, or the background process's exit code when
    it ended before the run started (its output is shown then: e.g. a paid run without --yes)."""
    import os
    import subprocess
    import sys
    import time

    from broker.core.config import home_path
    from broker.money.ledger import Ledger
    from broker.core.ui import console, print_json

    logs = home_path() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out_path = logs / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.out"
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    env = dict(os.environ, **{DETACHED_ENV: "1"})
    try:
        proc = subprocess.Popen([sys.executable, "-m", "broker", "run", *args, "-q"], stdin=subprocess.DEVNULL,
                                stdout=fd, stderr=fd, env=env, start_new_session=True, close_fds=True)
    finally:
        os.close(fd)
    ledger = Ledger()
    t0 = time.monotonic()
    run_id = None
    while time.monotonic() - t0 < timeout_s:
        # the run row carries its CLI's pid (broker.run.runrecord.new_run): the background process's
        run_id = next((r.id for r in ledger.list_runs(limit=20) if r.pid == proc.pid), None)
        if run_id is not None or proc.poll() is not None:
            break
        time.sleep(0.1)
    if run_id is None:
        run_id = next((r.id for r in ledger.list_runs(limit=20) if r.pid == proc.pid), None)
    if run_id is None:
        code = proc.poll()
        text = out_path.read_text(encoding="utf-8", errors="replace")
        if code is None:
            from broker.core.provider import ProviderError

            raise ProviderError(f"the background run did not start within {timeout_s:.0f} s (pid {proc.pid} is "
                                f"still working)", hint=f"its output so far is in {out_path}; `broker status` "
                                                          "shows the run once it starts")
        sys.stderr.write(text)
        return code or 1
    if as_json:
        print_json({"run_id": run_id, "pid": proc.pid, "output": str(out_path), "detached": True})
        return 0
    console.print(f"[bold]run {run_id}[/]: {recipe.name}, running in the background (pid {proc.pid})",
                  highlight=False)
    for what, cmd in (("follow its log", f"broker logs -f {run_id}"), ("its state", f"broker status {run_id}"),
                      ("stop it", f"broker down {run_id}")):
        console.print(f"  {what + ':':<15} {cmd}", highlight=False, soft_wrap=True)
    # on stdout with the rest: `broker run -d > file` and `X=$(broker run -d ...)` get every line, in order
    console.print(f"  {'output:':<15} {quote_path(out_path)}", markup=False, highlight=False, soft_wrap=True)
    sys.stdout.flush()
    return 0


def quote_path(p: Any) -> str:
    """``p`` as a shell word a user can paste (quoted when it holds spaces or shell characters)."""
    import shlex

    return shlex.quote(str(p))


def stop_detached(run: Any, *, grace_s: float = 120.0) -> bool:
    """When ``run`` is driven by a live background process (``broker run -d``): interrupt it (SIGINT, the same
    shielded teardown as Ctrl-C) and wait up to ``grace_s`` seconds for it to end.  Returns True when one was
    interrupted.  A pid whose folder has no detached marker naming it is never signalled."""
    import json
    import os
    import signal
    import time

    from broker.money.accounting import pid_alive

    if not run.run_dir or not run.pid or not pid_alive(run.pid):
        return False
    from broker.core.provider import BadInput
    from broker.core.runfolder import confined_run_dir

    try:  # the marker is trusted only in the run's own folder (a crafted row must not pick the pid signalled)
        folder = confined_run_dir(run)
    except BadInput:
        return False
    try:
        marker = json.loads((folder / DETACHED_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("pid") != run.pid:
        return False
    try:
        os.kill(run.pid, signal.SIGINT)
    except OSError:
        return False
    t0 = time.monotonic()
    while pid_alive(run.pid) and time.monotonic() - t0 < grace_s:
        time.sleep(0.2)
    if not pid_alive(run.pid):
        _say_who_interrupted(run.id)
    return True


def _say_who_interrupted(run_id: str) -> None:
    """The background run took ``broker down``'s SIGINT for a Ctrl-C: its ledger row says who stopped it."""
    import re

    from broker.money.ledger import Ledger

    ledger = Ledger()
    ended = ledger.get_run(run_id)
    if ended is None or ended.status != "interrupted" or not ended.message:
        return
    said = re.sub(r"interrupted \((?:Ctrl-C|SIGINT)\)", "interrupted by `broker down`", ended.message)
    if said != ended.message:
        ledger.update_run(run_id, message=said)


def result_dict(result: Any, usd: float = 0.0) -> dict:
    """A RunResult as JSON-ready data."""
    return {"status": result.status, "reason": result.reason, "wall_s": round(result.wall_s, 3),
            "exit_codes": result.exit_codes, "failed_node": result.failed_node,
            "missing_expect": result.missing_expect, "log_paths": {k: str(v) for k, v in result.log_paths.items()},
            "ranks": [r.__dict__ for r in result.ranks], "usd": round(usd, 6),
            "shown_status": result.shown_status, "error_lines": list(result.error_lines),
            "diagnosis": list(result.diagnosis), "warnings": list(getattr(result, "warnings", []))}
