"""Rendering of a finished run (shared by every provider's run path)."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from broker.launch import RunResult, describe_exit
from broker.model import Run
from broker.ui import console, usd

#: torchelastic's end-of-job barrier on a node whose peer (the store host, node 0) exited first
EXIT_BARRIER_NOISE = "Error waiting on exit barrier"


def render_summary(run: Run, result: RunResult, recipe, cost_usd: float = 0.0) -> None:
    """Topology, per-rank table, exit codes, wall time, cost and where the logs are."""
    started = any(r.device != "?" for r in result.ranks)
    if started:
        t = Table(title=f"run {run.id}: {run.name} ({run.topology} on {run.provider})", title_justify="left")
        for col in ("node", "RANK", "LOCAL_RANK", "WORLD_SIZE", "device", "backend"):
            t.add_column(col)
        for r in result.ranks:
            t.add_row(str(r.node), str(r.rank), str(r.local_rank), str(r.world_size), r.device, r.backend)
        console.print(t)
        if all(r.local_rank == 0 for r in result.ranks) and len(result.ranks) > 1:
            console.print("[dim]RANK is global (0..WORLD_SIZE-1); LOCAL_RANK counts processes on one node, so with "
                          "one process per node every LOCAL_RANK is 0 and each node's GPU is its cuda:0.[/]")
    else:
        console.print(f"run {run.id}: {run.name} ({run.topology} on {run.provider}): no rank reported in")
    colour = "green" if result.ok else "red"
    console.print(f"status: [bold {colour}]{result.status}[/]" + (f" - {escape(result.reason)}" if result.reason else ""))
    codes = ", ".join(f"node {k}: {describe_exit(v)}" for k, v in sorted(result.exit_codes.items()))
    console.print(f"exit codes: {codes or 'none (no node was started)'}")
    console.print(f"wall time: {result.wall_s:.1f} s   cost: {usd(cost_usd)}")
    for k, p in sorted(result.log_paths.items()):
        console.print(f"log node {k}: {p}")
    run_dir = Path(run.run_dir) if run.run_dir else None
    if run_dir and (run_dir / "preflight.txt").exists():
        console.print(f"preflight: {run_dir / 'preflight.txt'}")
    if result.tail and not result.ok:
        console.print(f"[bold]last lines of node {result.failed_node}:[/]")
        for line in result.tail:
            console.out(f"  {line}", highlight=False)
    if result.ok and _logs_mention(result, EXIT_BARRIER_NOISE):
        console.print("[dim]note: a node's torchrun logged 'Error waiting on exit barrier' after training finished: "
                      "node 0's agent hosts the rendezvous store and exited first, so the other agent's end-of-job "
                      "barrier lost its connection. Harmless here (every node exited 0).[/]")


def _logs_mention(result: RunResult, text: str) -> bool:
    for p in result.log_paths.values():
        try:
            if text in Path(p).read_text(encoding="utf-8", errors="replace"):
                return True
        except OSError:
            pass
    return False
