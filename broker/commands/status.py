"""``broker status``: runs and live resources from the ledger."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("status")
    def status_cmd(
        run_id: str = typer.Argument(None, help="show one run in detail"),
        limit: int = typer.Option(20, "--limit", "-n", help="how many recent runs"),
        as_json: bool = typer.Option(False, "--json", help="print JSON"),
    ) -> None:
        """List recent runs (status, times, exit codes, logs) and every live resource."""
        from rich.markup import escape
        from rich.table import Table

        from broker.ledger import Ledger
        from broker.provider import BadInput
        from broker.ui import console, print_json

        ledger = Ledger()
        if run_id:
            run = ledger.get_run(run_id)
            if run is None:
                raise BadInput(f"no run {run_id!r} in the ledger", hint="`broker status` lists the runs")
            res = ledger.resources(run.id)
            if as_json:
                print_json({"run": run, "resources": res, "events": ledger.events(run.id)})
                return
            console.print(f"[bold]{run.id}[/] {run.name}: {run.status} ({run.topology} on {run.provider})")
            if run.message:
                console.print(f"  {escape(run.message)}")
            console.print(f"  started {run.started_at:%Y-%m-%d %H:%M:%S}Z" + (
                f", ended {run.ended_at:%H:%M:%S}Z" if run.ended_at else ""))
            console.print(f"  exit codes: {run.exit_codes}   run dir: {run.run_dir}")
            for ev in ledger.events(run.id):
                console.print(f"  {ev['at']:%H:%M:%S} {ev['actor']:>8} {ev['action']:<12} {escape(ev['message'] or '')}")
            return
        runs = ledger.list_runs(limit=limit)
        live = ledger.resources(live_only=True)
        if as_json:
            print_json({"runs": runs, "live_resources": live})
            return
        t = Table(title="runs", title_justify="left")
        for col in ("run", "name", "status", "provider", "topology", "started (UTC)", "exit codes"):
            t.add_column(col)
        for r in runs:
            t.add_row(r.id, r.name, r.status, r.provider, r.topology,
                      f"{r.started_at:%Y-%m-%d %H:%M:%S}" if r.started_at else "-",
                      " ".join(f"{k}:{v}" for k, v in r.exit_codes.items()))
        console.print(t)
        if not live:
            console.print("no live resources (nothing is billing).")
