"""``broker status``: runs and live resources from the ledger, with money and the armed teardown layers.

Per run: spent so far / budget, USD/hour of what is live, worst case at the deadline, time left.  Per live
resource: provider, kind, id, age, USD/hour, spent so far, worst case at the deadline, time left, armed layers
(CLI, watchdog, node) and the error of a failed terminate (red).  Money follows :mod:`broker.accounting`
(billing counted from creation, per second).
"""

from __future__ import annotations

from typing import Any

import typer


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    neg = seconds < 0
    s = abs(seconds)
    txt = f"{s:.0f} s" if s < 120 else (f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h")
    return f"passed {txt} ago" if neg else txt


def _layers_text(layers: dict[str, bool], billing: bool) -> str:
    on = [k for k in ("cli", "watchdog", "node") if layers.get(k)]
    if not on:
        return "[bold red]none[/]" if billing else "[dim]none[/]"
    return " ".join(f"[green]{k}[/]" for k in on)


def status_data(ledger, limit: int = 20, now=None) -> dict[str, Any]:
    """Everything ``broker status --json`` prints: runs (with ``cost``), live resources (with ``cost``,
    ``layers``, ``node_layer``), the watchdog's heartbeat, and totals over live resources."""
    from broker.accounting import armed_layers, node_layer, resource_cost, run_cost, system_clock, watchdog_state

    now = now or system_clock()
    wd = watchdog_state(now)
    runs = ledger.list_runs(limit=limit)
    live = ledger.resources(live_only=True)
    run_ids = {r.id for r in runs} | {r.run_id for r in live}
    run_by_id = {}
    for rid in run_ids:
        run = ledger.get_run(rid)
        if run is not None and run.id == rid:
            run_by_id[rid] = run
    out_runs = []
    for run in runs:
        rc = run_cost(run, ledger.resources(run.id), now).to_dict()
        rc.pop("resources")
        out_runs.append({**run.model_dump(mode="json"), "cost": rc})
    out_live = []
    for res in live:
        run = run_by_id.get(res.run_id)
        c = resource_cost(res, run, now).to_dict()
        out_live.append({**res.model_dump(mode="json"), "cost": c, "layers": armed_layers(res, run, wd),
                         "node_layer": node_layer(res, run)})
    totals = {"usd_per_hour": sum(r["cost"]["usd_per_hour"] for r in out_live),
              "spent_usd": sum(r["cost"]["spent_usd"] for r in out_live),
              "errors": sum(1 for r in out_live if r.get("error"))}
    return {"now": now.isoformat(), "runs": out_runs, "live_resources": out_live, "watchdog": wd.to_dict(),
            "totals": totals}


def _resource_table(rows: list[dict[str, Any]], title: str):
    from rich.markup import escape
    from rich.table import Table

    from broker.ui import usd

    t = Table(title=title, title_justify="left")
    for col in ("run", "provider", "kind", "id", "state", "age", "$/h", "spent", "worst case", "time left",
                "layers", "error"):
        t.add_column(col)
    for r in rows:
        c = r["cost"]
        billing = c["usd_per_hour"] > 0
        left = c["time_left_s"]
        left_txt = _dur(left)
        if left is not None and left < 0:
            left_txt = f"[bold red]{left_txt}[/]"
        state = r["state"] if r["state"] != "orphan" else "[bold red]orphan[/]"
        t.add_row(r["run_id"], r["provider"], r["kind"], escape(r["provider_id"] or f"({r['name']})"), state,
                  _dur(c["age_s"]), usd(c["usd_per_hour"]) if billing else "free", usd(c["spent_usd"]),
                  usd(c["worst_case_usd"]) if c["worst_case_usd"] is not None else "[red]unbounded[/]", left_txt,
                  _layers_text(r["layers"], billing),
                  f"[bold red]{escape(r['error'])}[/]" if r.get("error") else "")
    return t


def _watchdog_line(wd: dict[str, Any]) -> str:
    from rich.markup import escape

    if wd["alive"]:
        line = f"watchdog: [green]running[/] (pid {wd['pid']}, last pass {_dur(wd['age_s'])} ago)"
    elif wd["pid"]:
        line = (f"watchdog: [bold red]not running[/] (pid {wd['pid']} last seen {_dur(wd['age_s'])} ago): "
                "start `broker watchdog`")
    else:
        line = "watchdog: [yellow]not running[/] (`broker run` starts it; or `broker watchdog`)"
    for prov, msg in (wd.get("errors") or {}).items():
        line += f"\n  [bold red]{escape(prov)}: {escape(msg)}[/]"
    return line


def register(app: typer.Typer) -> None:
    @app.command("status")
    def status_cmd(
        run_id: str = typer.Argument(None, help="show one run in detail"),
        limit: int = typer.Option(20, "--limit", "-n", help="how many recent runs"),
        as_json: bool = typer.Option(False, "--json", help="print JSON"),
    ) -> None:
        """Recent runs (status, spent/budget, worst case, time left) and every live resource (cost, armed layers
        CLI / watchdog / node, errors)."""
        from rich.markup import escape
        from rich.table import Table

        from broker.accounting import armed_layers, node_layer, resource_cost, run_cost, system_clock, watchdog_state
        from broker.ledger import Ledger
        from broker.ui import console, usd

        ledger = Ledger()
        if run_id:
            run = ledger.find_run(run_id)
            now = system_clock()
            wd = watchdog_state(now)
            res = ledger.resources(run.id)
            rc = run_cost(run, res, now)
            rows = [{**r.model_dump(mode="json"), "cost": resource_cost(r, run, now).to_dict(),
                     "layers": armed_layers(r, run, wd), "node_layer": node_layer(r, run)} for r in res]
            cost = rc.to_dict()
            cost.pop("resources")
            if as_json:
                from broker.ui import print_json

                print_json({"run": run, "cost": cost, "resources": rows, "events": ledger.events(run.id),
                            "watchdog": wd.to_dict()})
                return
            console.print(f"[bold]{run.id}[/] {run.name}: {run.status} ({run.topology} on {run.provider})")
            if run.message:
                console.print(f"  {escape(run.message)}")
            if run.started_at:
                console.print(f"  started {run.started_at:%Y-%m-%d %H:%M:%S}Z" + (
                    f", ended {run.ended_at:%H:%M:%S}Z" if run.ended_at else ""))
            codes = ", ".join(f"node {k}: {v}" for k, v in run.exit_codes.items()) or "-"
            console.print(f"  exit codes: {codes}   run dir: {run.run_dir}")
            active = run.status in ("planned", "provisioning", "running", "tearing_down") or rc.live
            console.print(f"  spent {usd(rc.spent_usd)} of budget {usd(rc.budget_usd)}; live {usd(rc.usd_per_hour)}/h; "
                          f"worst case at deadline {usd(rc.worst_case_usd)}"
                          + (f"; time left {_dur(rc.time_left_s)}" if active else ""))
            if rows:
                console.print(_resource_table(rows, "resources"))
            for ev in ledger.events(run.id, limit=1000):
                console.print(f"  {ev['at']:%H:%M:%S} {ev['actor']:>8} {ev['action']:<12} "
                              f"{escape(ev['message'] or '')}")
            return
        data = status_data(ledger, limit=limit)
        if as_json:
            from broker.ui import print_json

            print_json(data)
            return
        from rich import box

        t = Table(title="runs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col in ("run", "name", "status", "where", "started (UTC)", "spent / budget", "$/h", "worst case",
                    "time left", "exit codes"):
            t.add_column(col, no_wrap=col in ("run", "status", "$/h", "time left"))
        for r in data["runs"]:
            c = r["cost"]
            over = c["budget_usd"] is not None and c["spent_usd"] >= c["budget_usd"]
            spent = f"{usd(c['spent_usd'])} / {usd(c['budget_usd'])}"
            active = r["status"] in ("planned", "provisioning", "running", "tearing_down") or c["live"]
            t.add_row(r["id"], r["name"], r["status"], f"{r['topology']} on {r['provider']}",
                      (r["started_at"] or "-")[5:16].replace("T", " "),
                      f"[bold red]{spent}[/]" if over else spent,
                      usd(c["usd_per_hour"]) if c["live"] else "-",
                      usd(c["worst_case_usd"]) if c["worst_case_usd"] is not None else "[red]unbounded[/]",
                      _dur(c["time_left_s"]) if active else "-",
                      " ".join(f"{k}:{v}" for k, v in r["exit_codes"].items()))
        if data["runs"]:
            console.print(t)
        else:
            console.print("no runs yet (`broker run recipes/ddp_2node.yaml` starts one).")
        console.print(_watchdog_line(data["watchdog"]))
        live = data["live_resources"]
        if not live:
            console.print("no live resources (nothing is billing).")
            return
        console.print(_resource_table(live, "live resources"))
        tot = data["totals"]
        console.print(f"live: {len(live)} resource(s), {usd(tot['usd_per_hour'])}/h, spent so far "
                      f"{usd(tot['spent_usd'])}" + (f"; [bold red]{tot['errors']} failed terminate(s)[/]: "
                                                  "`broker down RUN` retries" if tot["errors"] else ""))
