"""Day-2 commands: ``broker logs``, ``broker ssh``, ``broker exec``, ``broker cost``, ``broker clean``.

All read the ledger; RUN may be a unique prefix of a run id (as in ``broker status``).  ``exec`` runs through the one
pipeline (:class:`broker.pipeline.KeptTarget`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Optional

import typer


def _node_log(run: Any, node: int) -> Path:
    p = (run.log_paths or {}).get(str(node))
    return Path(p) if p else Path(run.run_dir or ".") / f"node{node}.log"


def follow_log(ledger: Any, run_id: str, path: Path, *, out: Any = None, poll_s: float = 0.5,
               timeout_s: float | None = None) -> None:
    """Print ``path`` and, while the run is active (its CLI alive), what is appended to it; returns once the run
    has ended and the rest is printed (or after ``timeout_s``)."""
    from broker.accounting import ACTIVE_STATUSES, pid_alive

    out = out or sys.stdout
    pos = 0
    t0 = time.monotonic()
    while True:
        if path.exists():
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
            if data:
                out.write(data.decode("utf-8", errors="replace"))
                out.flush()
                pos += len(data)
        run = ledger.get_run(run_id)
        active = run is not None and run.status in ACTIVE_STATUSES and pid_alive(run.pid)
        if not active:
            if path.exists() and path.stat().st_size > pos:
                continue  # the last lines written before the end
            return
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            return
        time.sleep(poll_s)


def ssh_argv(cluster: Any, node: int, command: list[str] | None = None) -> list[str]:
    """``ssh`` argv for node ``node`` of a stored cluster: the run's key, its known_hosts (new keys accepted and
    added, changed keys refused), the node's user, host and port."""
    n = cluster.nodes[node]
    argv = ["ssh", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=accept-new"]
    if cluster.ssh_key_path:
        argv += ["-i", cluster.ssh_key_path]
    if cluster.known_hosts_path:
        argv += ["-o", f"UserKnownHostsFile={cluster.known_hosts_path}"]
    if n.port and n.port != 22:
        argv += ["-p", str(n.port)]
    argv.append(f"{n.user}@{n.host}")
    if command:
        argv += ["--", *command]
    return argv


def ssh_config(run_id: str, cluster: Any) -> str:
    """``Host`` entries for ``~/.ssh/config`` (one per node: ``broker-<run>-n<i>``)."""
    out = []
    for n in cluster.nodes:
        if getattr(n, "local", False):  # node 0 of a hybrid run is this machine
            continue
        lines = [f"Host broker-{run_id}-n{n.node_rank}", f"  HostName {n.host}", f"  User {n.user}"]
        if n.port and n.port != 22:
            lines.append(f"  Port {n.port}")
        if cluster.ssh_key_path:
            lines += [f"  IdentityFile {cluster.ssh_key_path}", "  IdentitiesOnly yes"]
        if cluster.known_hosts_path:
            lines.append(f"  UserKnownHostsFile {cluster.known_hosts_path}")
        lines.append("  StrictHostKeyChecking accept-new")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def cost_data(ledger: Any, *, since: datetime | None = None, provider: str | None = None,
              rows: int | None = None) -> dict[str, Any]:
    """What runs cost per the ledger (USD), summed in SQL: ``by_provider`` and ``total_usd`` over every matching
    run (``run_count`` of them), ``runs`` the newest ``rows`` of them (all with None), newest first."""
    from broker.model import utcnow

    now = utcnow()
    totals = ledger.cost_totals(now, since=since, provider=provider)
    runs = [dict(r, usd=round(r["usd"], 6)) for r in ledger.run_costs(now, since=since, provider=provider,
                                                                        limit=rows)]
    return {"since": since.isoformat() if since else None, "provider": provider, "runs": runs,
            "run_count": sum(n for n, _ in totals.values()),
            "by_provider": {p: round(usd, 6) for p, (_n, usd) in totals.items()},
            "total_usd": round(sum(usd for _n, usd in totals.values()), 6)}


def _dir_size(p: Path) -> int:
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            try:
                total += (Path(root) / f).lstat().st_size
            except OSError:
                pass
    return total


def clean_runs(ledger: Any, *, older_than_days: float = 0.0, dry_run: bool = False) -> tuple[list[str], int]:
    """Remove the run folders of ended runs older than ``older_than_days`` (by end time); never a run that is active
    or still has live resources.  Returns (removed run ids, bytes freed)."""
    from broker.accounting import ENDED_STATUSES
    from broker.model import utcnow

    cutoff = utcnow() - timedelta(days=older_than_days)
    removed, freed = [], 0
    for r in ledger.list_runs(limit=None):
        if r.status not in ENDED_STATUSES or not r.run_dir or not Path(r.run_dir).exists():
            continue
        if ledger.resources(r.id, live_only=True):
            continue
        if (r.ended_at or r.created_at) and (r.ended_at or r.created_at) > cutoff:
            continue
        size = _dir_size(Path(r.run_dir))
        if not dry_run:
            shutil.rmtree(r.run_dir, ignore_errors=True)
            ledger.event(r.id, "cli", "clean", f"run folder removed ({size} bytes)")
        removed.append(r.id)
        freed += size
    return removed, freed


def _parse_since(value: str | None) -> datetime | None:
    if not value:
        return None
    from broker.provider import BadInput

    try:
        d = datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(f"--since {value!r} is not a date", hint="use YYYY-MM-DD (or an ISO time)") from None
    return d if d.tzinfo else d.replace(tzinfo=timezone.utc)


def register(app: typer.Typer) -> None:
    @app.command("logs", short_help="Print a run's node log; -f follows a live run")
    def logs_cmd(
        run_id: str = typer.Argument(..., metavar="RUN", help="run id or a unique prefix (see `broker status`)"),
        node: int = typer.Option(0, "--node", "-n", help="which node's log (default 0)"),
        follow: bool = typer.Option(False, "--follow", "-f", help="keep printing while the run is live"),
    ) -> None:
        """Print a run's node log (past or running); -f follows a live run until it ends."""
        from broker.ledger import Ledger
        from broker.provider import BadInput

        ledger = Ledger()
        run = ledger.find_run(run_id)
        nodes = int((run.recipe or {}).get("nodes") or 1)
        if not 0 <= node < max(nodes, 1):
            raise BadInput(f"run {run.id} has {nodes} node(s): no node {node}", hint=f"--node 0..{nodes - 1}")
        path = _node_log(run, node)
        if follow:
            follow_log(ledger, run.id, path)
            return
        if not path.exists():
            raise BadInput(f"run {run.id} has no log for node {node} ({path})",
                           hint="the run may have ended before the node started; `broker status " + run.id + "`")
        sys.stdout.write(path.read_text(encoding="utf-8", errors="replace"))

    @app.command("ssh", short_help="A shell (or one command) on a node of a live or kept run",
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def ssh_cmd(
        ctx: typer.Context,
        run_id: str = typer.Argument(..., metavar="RUN", help="run id or a unique prefix"),
        node_arg: Optional[str] = typer.Argument(None, metavar="[NODE]", help="node index (default 0)"),
        config: bool = typer.Option(False, "--config", help="print Host entries for ~/.ssh/config instead"),
    ) -> None:
        """A shell (or, after --, one command) on a node of a live or kept run, with the run's key and known_hosts."""
        from broker.ledger import Ledger
        from broker.pipeline import kept_cluster
        from broker.provider import BadInput

        run, cluster = kept_cluster(Ledger(), run_id)
        if cluster.local_exec:
            raise BadInput(f"the nodes of run {run.id} are processes on this machine ({cluster.provider}): no SSH",
                           hint=f"their folders are under {run.run_dir}")
        if config:
            sys.stdout.write(ssh_config(run.id, cluster))
            return
        command = [a for a in ctx.args if a != "--"]
        if node_arg is not None and not node_arg.isdigit():  # `broker ssh RUN -- CMD`: no NODE given
            command, node_arg = [node_arg, *command], None
        node = int(node_arg or 0)
        if not 0 <= node < len(cluster.nodes):
            raise BadInput(f"run {run.id} has {len(cluster.nodes)} node(s): no node {node}",
                           hint=f"broker ssh {run.id} 0..{len(cluster.nodes) - 1}")
        if cluster.nodes[node].local:  # node 0 of a hybrid run: this machine
            raise BadInput(f"node {node} of run {run.id} is this machine (hybrid): no SSH needed",
                           hint=f"its folder is {cluster.nodes[node].workroot or run.run_dir}; the VMs are nodes "
                                f"1..{len(cluster.nodes) - 1}")
        argv = ssh_argv(cluster, node, command or None)
        if shutil.which("ssh") is None:
            raise BadInput("the ssh client is not installed", hint="apt-get install openssh-client")
        if command:
            import subprocess

            raise typer.Exit(subprocess.run(argv).returncode)
        os.execvp("ssh", argv)

    @app.command("exec", short_help="Run a recipe on the kept nodes of a run (no provisioning)")
    def exec_cmd(
        run_id: str = typer.Argument(..., metavar="RUN", help="a run whose nodes were kept (recipe idle_minutes)"),
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="the recipe to run on those nodes"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream node logs"),
        as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    ) -> None:
        """Run RECIPE on the kept nodes of RUN (recipe idle_minutes), without provisioning; the idle timer restarts."""
        from broker.commands.lifecycle import ProgressPrinter
        from broker.commands.run import lint_or_refuse, result_dict
        from broker.commands.summary import render_summary
        from broker.ledger import Ledger
        from broker.pipeline import Hooks, KeptTarget, kept_cluster, run_pipeline
        from broker.recipe import load_recipe
        from broker.ui import console, echo_line, print_json

        recipe = load_recipe(recipe_path)
        lint_or_refuse(recipe, as_json=as_json)
        ledger = Ledger()
        origin, cluster = kept_cluster(ledger, run_id)
        prog = ProgressPrinter(ledger)

        def started(run: Any, description: str) -> None:
            prog.bind(run)
            if not as_json:
                console.print(f"[bold]run {run.id}[/]: {recipe.name}, {description}", highlight=False)

        try:
            out = run_pipeline(recipe, KeptTarget(origin, cluster), ledger=ledger,
                               hooks=Hooks(echo=None if (quiet or as_json) else echo_line, say=prog,
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
        raise typer.Exit(out.exit_code if not out.left else 4)

    @app.command("cost", short_help="What runs cost, per run and per provider (USD)")
    def cost_cmd(
        since: Optional[str] = typer.Option(None, "--since", help="only runs created on or after this date "
                                            "(YYYY-MM-DD)"),
        provider: Optional[str] = typer.Option(None, "--provider", "-p", help="only runs on this provider"),
        as_json: bool = typer.Option(False, "--json", help="print JSON"),
    ) -> None:
        """What runs cost, per run and per provider, from the ledger (USD)."""
        from rich.table import Table

        from broker.ledger import Ledger
        from broker.ui import console, print_json, usd

        data = cost_data(Ledger(), since=_parse_since(since), provider=provider, rows=None if as_json else 50)
        if as_json:
            print_json(data)
            return
        t = Table(title="cost per run (ledger)", title_justify="left")
        for col in ("run", "provider", "status", "cost"):
            t.add_column(col, justify="right" if col == "cost" else "left")
        for r in data["runs"][:50]:
            t.add_row(r["run"], r["provider"], r["status"], usd(r["usd"]))
        console.print(t)
        if data["run_count"] > 50:
            console.print(f"... {data['run_count'] - 50} older run(s); --json lists all")
        for p, v in sorted(data["by_provider"].items(), key=lambda kv: str(kv[0])):
            console.print(f"{p}: {usd(v)}", highlight=False)
        console.print(f"total: {usd(data['total_usd'])} over {data['run_count']} run(s)", highlight=False)

    @app.command("clean", short_help="Remove the folders of ended runs (logs, work copies)")
    def clean_cmd(
        older_than: float = typer.Option(0.0, "--older-than", metavar="DAYS", min=0,
                                         help="only runs that ended at least DAYS days ago"),
        dry_run: bool = typer.Option(False, "--dry-run", help="say what would be removed"),
    ) -> None:
        """Remove the run folders of ended runs (logs, work copies, artifacts), never of live ones."""
        from broker.ledger import Ledger
        from broker.ui import console

        removed, freed = clean_runs(Ledger(), older_than_days=older_than, dry_run=dry_run)
        verb = "would remove" if dry_run else "removed"
        console.print(f"{verb} {len(removed)} run folder(s), {freed / 1e6:.1f} MB"
                      + (f": {', '.join(removed[:10])}{' ...' if len(removed) > 10 else ''}" if removed else ""),
                      highlight=False)


