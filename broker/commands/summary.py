"""Rendering of a finished run (shared by every provider's run path)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from broker.launch import RunResult, describe_exit
from broker.model import Run
from broker.ui import console, usd


def render_summary(run: Run, result: RunResult, recipe, cost_usd: float = 0.0) -> None:
    """Topology, per-rank table, exit codes, wall time, cost and where the logs are."""
    t = Table(title=f"run {run.id}: {run.name} ({run.topology} on {run.provider})", title_justify="left")
    for col in ("node", "RANK", "LOCAL_RANK", "WORLD_SIZE", "device", "backend"):
        t.add_column(col)
    for r in result.ranks:
        t.add_row(str(r.node), str(r.rank), str(r.local_rank), str(r.world_size), r.device, r.backend)
    console.print(t)
    codes = ", ".join(f"node {k}: {describe_exit(v)}" for k, v in sorted(result.exit_codes.items()))
    colour = "green" if result.ok else "red"
    console.print(f"status: [bold {colour}]{result.status}[/]" + (f" - {escape(result.reason)}" if result.reason else ""))
    console.print(f"exit codes: {codes}")
    console.print(f"wall time: {result.wall_s:.1f} s   cost: {usd(cost_usd)}")
    for k, p in sorted(result.log_paths.items()):
        console.print(f"log node {k}: {p}")
    if result.tail and not result.ok:
        console.print(f"[bold]last lines of node {result.failed_node}:[/]")
        for line in result.tail:
            console.out(f"  {line}", highlight=False)
