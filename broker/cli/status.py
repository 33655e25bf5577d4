"""``broker status``: runs and live resources from the ledger, with money and the armed teardown layers.

Per run: id, recipe name, where (provider and topology), state, spent so far / budget, time left (``--wide``:
start, USD/hour, worst case at the deadline, exit codes).  Per live resource: run, provider, kind, id, state,
USD/hour, spent so far, worst case at the deadline, time left, armed layers (CLI, watchdog, node); the error of a failed terminate is printed in full below
the table (red).  Readable at 80 columns; ``--wide`` or ``broker status RUN`` give the details.  Money follows
:mod:`broker.money.accounting` (billing counted from creation, per second; a create that never happened costs $0).

The truth, not the ledger's last guess: unless ``--no-refresh``, live instances are described at their
provider (when its adapter says it is configured) and those the provider reports gone - e.g. destroyed by the
node's own dead-man switch - are marked ``terminated`` (by ``provider``, at the time seen); a run still marked
active whose CLI process is dead on this machine is marked ``interrupted`` (as the watchdog does).  Rows left
``unknown`` by an ambiguous create are shown as possibly billing (counted at their worst case).
"""

from __future__ import annotations

import logging
from typing import Any

import typer

# where a run ran and its status in the narrow table's words: one implementation, shared with the parser-free start
# (broker.cli.faststatus prints the same table without rich)
from broker.cli.faststatus import run_status_words as _run_status_words
from broker.cli.faststatus import NO_WATCHDOG_HINT
from broker.cli.faststatus import short_where as _short_where

_log = logging.getLogger(__name__)


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


def refresh_live(ledger, providers: dict | None = None, now=None) -> dict[str, str]:
    """Ask the providers about every live instance of the ledger (``describe_instance``); mark those reported gone
    ``terminated`` (by ``provider``) and those reported running ``running``.  Only providers whose adapter says it
    is configured are asked (``providers`` given: those).  Returns provider -> why it was not (fully) refreshed."""
    from broker.money.accounting import system_clock
    from broker.providers import THIS_MACHINE

    now = now or system_clock()
    cache: dict[str, Any] = dict(providers or {})
    notes: dict[str, str] = {}
    rows = [r for r in ledger.resources(live_only=True)
            if r.kind == "instance" and r.provider_id and r.provider not in THIS_MACHINE]
    _log.info("status: ledger %s; %d live instance(s) to refresh at their provider", getattr(ledger, "path", "?"),
              len(rows))
    for res in rows:
        if res.provider in notes:
            continue
        p = cache.get(res.provider)
        if p is None:
            if providers is not None:
                continue
            try:
                from broker.providers import get_provider

                p = get_provider(res.provider)
                if not p.check().configured:
                    notes[res.provider] = "not refreshed: no credentials"
                    continue
            except Exception as e:  # noqa: BLE001 - status must still print
                notes[res.provider] = f"not refreshed: {e}"
                continue
            cache[res.provider] = p
        try:
            info = p.describe_instance(res.provider_id, region=res.region)
        except Exception as e:  # noqa: BLE001 - a provider that cannot answer: say so, keep the ledger's view
            notes[res.provider] = f"not refreshed: {getattr(e, 'message', None) or e}"
            _log.info("status: %s %s: %s", res.provider, res.provider_id, notes[res.provider])
            continue
        _log.info("status: %s %s is %s at the provider (ledger: %s)", res.provider, res.provider_id, info.state,
                  res.state)
        if info.state == "terminated":
            # a terminate broker claimed (the watchdog, `broker down`) keeps its actor: who ended it tells a
            # preemption from broker's own end (broker.run.attempts.broker_ended)
            by = res.terminated_by if res.state == "terminating" and res.terminated_by else "provider"
            ledger.update_resource(res.id, state="terminated", terminated_at=now, terminated_by=by,
                                   error=None, actor="status",
                                   message=f"{res.provider} reports {res.provider_id} gone "
                                           f"({info.raw_state or info.state}; e.g. the node's own dead-man switch "
                                           "or the console): marked terminated when seen")
        elif info.state == "running" and res.state in ("creating", "intent", "starting"):
            ledger.update_resource(res.id, state="running", actor="status", message=f"{res.provider_id} running")
        elif info.state == "stopped" and res.state == "stopping":  # a `broker stop` that did not wait it out
            ledger.change_rate(res.id, "stopped", at=now, actor="status",
                               message=f"{res.provider_id} stopped (confirmed by `broker status`)")
    return notes


def settle_runs(ledger, now=None) -> list[str]:
    """Runs still marked active whose CLI process (``Run.pid``) is dead on this machine become ``interrupted``
    (the watchdog's rule (d)); returns their ids."""
    from broker.money.accounting import ACTIVE_STATUSES, cli_alive, system_clock

    now = now or system_clock()
    out = []
    for run_id, status, pid, pid_start in ledger.cli_pids(ACTIVE_STATUSES):
        if cli_alive(pid, pid_start):
            continue
        n_live = len(ledger.resources(run_id, live_only=True))
        msg = (f"the CLI process (pid {pid}) died while the run was {status}; run marked interrupted"
               + (f"; {n_live} resource(s) still live: `broker down {run_id}`" if n_live else "; nothing is live"))
        ledger.update_run(run_id, status="interrupted", ended_at=now, message=msg)
        ledger.event(run_id, "status", "cli-dead", msg)
        out.append(run_id)
    return out


def status_data(ledger, limit: int = 20, now=None, *, refresh: bool = False,
                providers: dict | None = None) -> dict[str, Any]:
    """Everything ``broker status --json`` prints: runs (with ``cost``), live resources (with ``cost``,
    ``layers``, ``node_layer``), the watchdog's heartbeat, totals over live resources (``possibly_billing``:
    rows left ``unknown`` by an ambiguous create) and ``refresh`` notes (provider -> why not refreshed).  With
    ``refresh`` the providers are asked first (:func:`refresh_live`) and dead CLIs settled (:func:`settle_runs`)."""
    from broker.money.accounting import (armed_layers, node_layer, resource_cost, run_cost, switch_overdue_s,
                                         system_clock, watchdog_state)

    now = now or system_clock()
    notes = refresh_live(ledger, providers, now) if refresh else {}
    settle_runs(ledger, now)
    wd = watchdog_state(now)
    runs = ledger.list_runs(limit=limit)
    live = ledger.resources(live_only=True)
    run_by_id = {r.id: r for r in runs}
    for rid in {r.run_id for r in live} - set(run_by_id):  # a live resource of an older run
        run = ledger.get_run(rid)
        if run is not None and run.id == rid:
            run_by_id[rid] = run
    res_by_run = ledger.resources_of(r.id for r in runs)
    out_runs = []
    for run in runs:
        rc = run_cost(run, res_by_run[run.id], now).to_dict()
        rc.pop("resources")
        out_runs.append({**run.model_dump(mode="json"), "cost": rc})
    out_live = []
    for res in live:
        run = run_by_id.get(res.run_id)
        c = resource_cost(res, run, now).to_dict()
        out_live.append({**res.model_dump(mode="json"), "cost": c, "layers": armed_layers(res, run, wd, now),
                         "node_layer": node_layer(res, run), "switch_overdue_s": switch_overdue_s(res, run, now)})
    totals = {"usd_per_hour": sum(r["cost"]["usd_per_hour"] for r in out_live),
              "spent_usd": sum(r["cost"]["spent_usd"] for r in out_live),
              "errors": sum(1 for r in out_live if r.get("error") and r["state"] != "unknown"),
              "possibly_billing": sum(1 for r in out_live if r["state"] == "unknown")}
    return {"now": now.isoformat(), "runs": out_runs, "live_resources": out_live, "watchdog": wd.to_dict(),
            "totals": totals, "refresh": {"done": refresh, "notes": notes}}


def _fit_name_where(width: int, fixed: int, name_w: int, where_w: int) -> tuple[int, int]:
    """Widths of the name and where columns (cells) when the other columns take ``fixed`` cells of a ``width``
    table: both whole when they fit, else the place whole while the name keeps 10 cells, the name ellipsized to
    the rest (never wrapped: a run's row stays one line); the place is cut only below that."""
    room = max(18, width - fixed)
    if name_w + where_w <= room:
        return name_w, where_w
    name_min = min(name_w, 10)
    if room - where_w >= name_min:
        return room - where_w, where_w
    return name_min, room - name_min


def _shown_state(r: dict[str, Any]) -> str:
    """The ledger state, or what the provider last showed when that is worse (a node stopped mid-job)."""
    if r["state"] == "stopped":  # `broker stop`: on purpose, its disk billing
        return "stopped (disk)"
    seen = (r.get("attrs") or {}).get("provider_state")
    return str(seen) if seen in ("stopped", "failed") and r["state"] == "running" else r["state"]


def _state_text(state: str) -> str:
    if state in ("stopped", "failed"):
        return f"[bold red]{state}[/]"
    if state == "orphan":
        return "[bold red]orphan[/]"
    if state == "unknown":
        return "[bold red]unknown[/]"
    return state


def _narrow_runs_table(rows: list[tuple[str, str, str, str, str, str]], width: int):
    """The runs table at ``width`` cells (the terminal's, 80 in a pipe): one line per run (id, name, where,
    status, spent / budget, time left); ids, states and money whole, the name (then the place) ellipsized to fit
    rather than wrapped."""
    from rich import box
    from rich.cells import cell_len
    from rich.markup import escape, render
    from rich.table import Table

    # the time left only when a run is still active (an ended run's is "-"): the room goes to names and places
    head = ("run", "name", "where", "status", "spent / budget", "left")
    if all(row[5] == "-" for row in rows):
        head, rows = head[:5], [row[:5] for row in rows]

    def nat(i: int) -> int:
        return max([cell_len(head[i])] + [cell_len(render(row[i]).plain if i == 4 else row[i]) for row in rows])

    gaps = 2 * (len(head) - 1)  # collapse_padding: two cells between columns, none at the edges
    fixed = gaps + sum(nat(i) for i in range(len(head)) if i not in (1, 2))
    if fixed + nat(1) + nat(2) > width:  # tight: "$0.00/$5.00" gives names two more cells
        head = head[:4] + ("spent/budget",) + head[5:]
        rows = [row[:4] + (row[4].replace(" / ", "/"),) + row[5:] for row in rows]
        fixed = gaps + sum(nat(i) for i in range(len(head)) if i not in (1, 2))
    name_w, where_w = _fit_name_where(width, fixed, nat(1), nat(2))
    t = Table(title="runs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
              show_edge=False)
    for i, col in enumerate(head):
        t.add_column(col, no_wrap=True, overflow="ellipsis" if i in (1, 2) else "fold",
                     max_width={1: name_w, 2: where_w}.get(i))
    for row in rows:
        t.add_row(row[0], escape(row[1]), escape(row[2]), *row[3:])
    return t


def _resource_table(rows: list[dict[str, Any]], title: str, *, wide: bool = False,
                    spent: "list[str] | None" = None):
    """Live resources.  Narrow (80 columns): run + resource in one cell (folded, never cut), state, $/h, spent,
    worst case, time left, layers; errors go below the table (:func:`_resource_notes`).  ``wide``: one column each,
    errors inline.  ``spent``: each row's spent as printed (:func:`broker.core.prose.usd_parts` of the total
    printed beside the table, so the rows add up to it); default each row's own :func:`usd`."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from broker.core.ui import usd

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    if wide:
        cols = ("run", "provider", "kind", "id", "state", "age", "$/h", "spent", "worst case", "time left",
                "layers", "error")
    else:
        cols = ("run / resource", "state", "$/h", "spent", "worst", "left", "layers")
    for col in cols:  # short values never wrap (nor are cut: print_table); names, ids and errors fold
        t.add_column(col, overflow="fold", no_wrap=col not in ("run / resource", "id", "error", "layers"))
    for i, r in enumerate(rows):
        c = r["cost"]
        paid = spent[i] if spent is not None else usd(c["spent_usd"])
        billing = c["usd_per_hour"] > 0
        left = c["time_left_s"]
        left_txt = _dur(left)
        if left is not None and left < 0:
            left_txt = f"[bold red]{left_txt}[/]"
        ident = escape(r["provider_id"] or f"({r['name']})")
        worst = usd(c["worst_case_usd"]) if c["worst_case_usd"] is not None else "[red]unbounded[/]"
        if c["worst_case_usd"] is not None and abs(c["worst_case_usd"] - c["spent_usd"]) < 1e-9:
            worst = paid  # it can bill no more (terminated): the same figure as spent, as printed
        rate = usd(c["usd_per_hour"]) if billing else "free"
        if wide:
            t.add_row(r["run_id"], r["provider"], r["kind"], ident, _state_text(_shown_state(r)), _dur(c["age_s"]),
                      rate, paid, worst, left_txt, _layers_text(r["layers"], billing),
                      f"[bold red]{escape(r['error'])}[/]" if r.get("error") else "")
        else:
            t.add_row(f"{r['run_id']}\n{r['provider']} {r['kind']} {ident}", _state_text(_shown_state(r)), rate,
                      paid, worst, left_txt, _layers_text(r["layers"], billing))
    return t


def _resource_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One full line per resource that needs attention (failed terminate, unknown create, orphan, stopped)."""
    from rich.markup import escape

    from broker.core.ui import usd

    out = []
    for r in rows:
        what = f"{r['provider']} {r['kind']} {r['provider_id'] or r['name']}"
        if r["state"] == "unknown":
            out.append(f"[bold red]possibly billing[/]: {escape(what)} of run {r['run_id']}: an ambiguous create "
                       f"not resolved yet ({escape(r.get('error') or 'no list could tell')}); `broker down "
                       f"{r['run_id']}` or `broker reconcile` resolves it")
        elif r.get("error"):
            out.append(f"[bold red]{escape(what)}[/]: {escape(r['error'])}")
        if r["state"] == "stopped":
            c = r.get("cost") or {}
            dl = f" until {str(c.get('deadline'))[:16]}Z" if c.get("deadline") else ""
            out.append(f"{escape(what)} of run {r['run_id']}: stopped, billing {usd(c.get('usd_per_hour') or 0.0)}"
                       f"/h for its disk{dl}; `broker start {r['run_id']}` resumes it, `broker down "
                       f"{r['run_id']}` deletes it")
        if r.get("switch_overdue_s"):
            c = r.get("cost") or {}
            out.append(f"[bold red]{escape(what)} of run {r['run_id']}: its node switch should have fired "
                       f"{_dur(r['switch_overdue_s'])} ago (deadline + grace passed) and did not[/]: it still bills "
                       f"{usd(c.get('usd_per_hour') or 0.0)}/h; `broker down {r['run_id']}` ends it now")
        elif r.get("node_layer") and (r.get("attrs") or {}).get("deadman_grace_s") is not None:
            out.append(f"{escape(what)}: node switch: {escape(r['node_layer'])}")  # the grace scales with the job
    return out


def _ago(seconds: float | None) -> str:
    """``12 s ago``: a heartbeat a moment ahead of this process's clock reads as ``0 s ago`` (it printed
    "passed 1 s ago ago")."""
    return "-" if seconds is None else f"{_dur(max(0.0, seconds))} ago"


def _watchdog_line(wd: dict[str, Any], live_providers: set[str] | None = None) -> str:
    """The watchdog's state, and its provider errors: only those of a cloud or of a provider that holds a live
    resource of this installation (``live_providers``; None: all), each on one line (a backend's multi-line
    stderr is cut to its first line: ``broker status --json`` has it whole)."""
    from rich.markup import escape

    from broker.providers import CLOUD

    if wd["alive"]:
        line = f"watchdog: [green]running[/] (pid {wd['pid']}, last pass {_ago(wd['age_s'])})"
    elif wd.get("other_ledger"):
        line = (f"watchdog: [bold red]not guarding this home[/] (pid {wd['pid']} last passed over another ledger: "
                "this home was deleted or replaced since it started): the next `broker run` starts this home's "
                "own, or start `broker watchdog`")
    elif wd["pid"]:
        line = (f"watchdog: [bold red]not running[/] (pid {wd['pid']} last seen {_ago(wd['age_s'])}): "
                "start `broker watchdog`")
    else:
        line = f"watchdog: [yellow]not running[/] {NO_WATCHDOG_HINT}"
    for prov, msg in (wd.get("errors") or {}).items():
        if live_providers is not None and prov not in CLOUD and prov not in live_providers:
            continue  # an optional backend holding nothing of ours: its failure is no news
        first = msg.strip().splitlines()[0] if msg.strip() else msg
        line += f"\n  [bold red]{escape(prov)}: {escape(first)}[/]"
    return line


def _print_nothing_yet() -> None:
    """What ``broker status`` prints for a ledger with no run, no live resource and no watchdog ever started, as
    the rich path prints it (the watchdog state in yellow on a colour terminal), without importing rich."""
    import os
    import sys

    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    state = "\033[33mnot running\033[0m" if color else "not running"
    sys.stdout.write("no runs yet (`broker run recipes/ddp_2node.yaml` starts one).\n"
                     f"watchdog: {state} {NO_WATCHDOG_HINT}\n"
                     "no live resources (nothing is billing).\n")


def _print_starting(line: str) -> None:
    """A starting run's line, wrapped at the terminal's width like the rest (it ran to 130 columns), its
    `backticked` command kept whole."""
    from broker.core.ui import console

    console.print(line, markup=False, highlight=False)


def status_cmd(
    run_id: str = typer.Argument(None, metavar="[RUN]", help="show one run in detail"),
    limit: int = typer.Option(20, "--limit", "-n", help="how many recent runs"),
    wide: bool = typer.Option(False, "--wide", "-w", help="every column (name, where, start, $/h, exit codes, "
                              "age, errors inline)"),
    no_refresh: bool = typer.Option(False, "--no-refresh", help="do not ask the providers about live "
                                    "instances (the ledger's view only; no network)"),
    refresh: bool = typer.Option(False, "--refresh", "-r", help="ask the providers about live instances: "
                                 "the default (as `sky status -r`)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Recent runs (status, spent/budget, worst case, time left) and every live resource (cost, armed layers
    CLI / watchdog / node, errors).  Live instances are first checked at their provider (--no-refresh skips)."""
    from broker.money.ledger import Ledger

    if refresh and no_refresh:
        from broker.core.provider import BadInput

        raise BadInput("--refresh and --no-refresh contradict each other",
                       hint="status refreshes by default: drop --refresh, or keep --no-refresh alone")

    ledger = Ledger()
    from broker.cli import starting

    pend = starting.find(ledger, run_id) if run_id else None
    if pend is not None:  # `broker run -d` whose background process has not written its row (yet)
        if as_json:
            from broker.core.ui import print_json

            print_json({"starting": pend})
        elif pend["alive"]:
            _print_starting(starting.describe(pend))
        if not pend["alive"]:
            raise starting.not_started(pend)
        return
    if run_id:
        show_run(ledger, run_id, wide=wide, no_refresh=no_refresh, as_json=as_json)
        return
    pending = starting.pending(ledger)
    if as_json:
        from broker.core.ui import print_json

        print_json({**status_data(ledger, limit=limit, refresh=not no_refresh), "starting": pending})
        return
    data = status_data(ledger, limit=limit, refresh=not no_refresh)
    for d in pending:
        _print_starting(starting.describe(d))
    if not data["runs"] and not data["live_resources"] and not data["refresh"]["notes"] \
            and not data["watchdog"]["pid"]:
        _print_nothing_yet()  # without rich (~60 ms of a start): nothing to lay out
        return
    show_runs(data, wide=wide)
    show_live_resources(data, wide=wide)


def show_run(ledger: Any, run_id: str, *, wide: bool, no_refresh: bool, as_json: bool) -> None:
    """``broker status RUN``: one run in detail (its diagnosis, times, cost against its budget, attempts,
    resources and events), or as JSON; its live instances are first checked at their provider unless
    ``no_refresh``."""
    from rich.markup import escape

    from broker.core.prose import usd_parts
    from broker.core.records import run_where
    from broker.core.ui import console, node_text, print_table, usd
    from broker.money.accounting import (armed_layers, node_layer, resource_cost, run_cost, switch_overdue_s,
                                         system_clock, watchdog_state)

    run = ledger.find_run(run_id)
    now = system_clock()
    notes = {} if no_refresh else refresh_live(ledger, None, now)
    settle_runs(ledger, now)
    run = ledger.find_run(run.id)
    wd = watchdog_state(now)
    res = ledger.resources(run.id)
    rc = run_cost(run, res, now)
    rows = [{**r.model_dump(mode="json"), "cost": resource_cost(r, run, now).to_dict(),
             "layers": armed_layers(r, run, wd, now), "node_layer": node_layer(r, run),
             "switch_overdue_s": switch_overdue_s(r, run, now)} for r in res]
    cost = rc.to_dict()
    cost.pop("resources")
    if as_json:
        from broker.core.ui import print_json

        from broker.cli.rundiag import diagnosis_lines
        from broker.run.attempts import attempt_costs

        attempts = [{**a, "started_at": a["started_at"].isoformat(),
                     "ended_at": a["ended_at"].isoformat() if a["ended_at"] else None}
                    for a in attempt_costs(ledger, run.id)]
        print_json({"run": run, "cost": cost, "resources": rows, "events": ledger.events(run.id),
                    "attempts": attempts, "diagnosis": diagnosis_lines(run),
                    "watchdog": wd.to_dict(), "refresh": {"done": not no_refresh, "notes": notes}})
        return
    console.print(f"[bold]{run.id}[/] {escape(run.name)}: {run.status} ({run_where(run)})")
    if run.message:  # may quote a node's output (its error): no control sequence reaches the terminal
        console.print(f"  {escape(node_text(run.message))}")
    from broker.cli.rundiag import detached_output, diagnosis_lines

    diag = diagnosis_lines(run)
    if diag:  # quoted from the nodes' logs: control characters stripped, markup escaped
        console.print("  [bold]diagnosis:[/]")
        for line in diag:
            console.print(f"    {escape(node_text(line))}", highlight=False)
    out_file = detached_output(run)
    if out_file is not None:
        console.print(f"  output (background run): {escape(str(out_file))}", highlight=False)
    if run.started_at:
        console.print(f"  started {run.started_at:%Y-%m-%d %H:%M:%S}Z" + (
            f", ended {run.ended_at:%H:%M:%S}Z" if run.ended_at else ""))
    codes = ", ".join(f"node {k}: {v}" for k, v in run.exit_codes.items()) or "-"
    console.print(f"  exit codes: {codes}")
    console.print(f"  run dir: {run.run_dir}")
    active = run.status in ("planned", "provisioning", "running", "tearing_down") or rc.live
    # the resources' spent, as printed in their table, add up to the run's as printed here
    spent_txt, spent_each = usd_parts(rc.spent_usd, [r["cost"]["spent_usd"] for r in rows])
    console.print(f"  spent {spent_txt} of budget {usd(rc.budget_usd)}; live {usd(rc.usd_per_hour)}/h; "
                  f"worst case at deadline {usd(rc.worst_case_usd)}"
                  + (f"; time left {_dur(rc.time_left_s)}" if active else ""))
    for prov, why in notes.items():
        console.print(f"  [yellow]{escape(prov)}[/]: {escape(why)}")
    from broker.run.attempts import attempt_lines

    for line in attempt_lines(ledger, run.id):  # a preempted run: each attempt, its cause and cost
        console.print(f"  {escape(node_text(line))}", highlight=False)
    if rows:
        print_table(_resource_table(rows, "resources", wide=wide, spent=spent_each), wide=wide)
        for line in _resource_notes([r for r in rows if r["state"] != "terminated"]):
            console.print("  " + line)
    for ev in ledger.events(run.id, limit=1000):
        console.print(f"  {ev['at']:%H:%M:%S} {ev['actor']:>8} {ev['action']:<12} "
                      f"{escape(node_text(ev['message'] or ''))}")


def show_runs(data: dict[str, Any], *, wide: bool) -> None:
    """The recent runs of :func:`status_data`'s ``data`` as a table (every column with ``wide``), the newest
    run's failure, the watchdog line and why a provider was not asked."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from broker.core.ui import console, node_text, print_table, usd

    if wide:
        t = Table(title="runs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
        cols = ("run", "name", "status", "where", "started (UTC)", "spent / budget", "$/h", "worst case",
                "time left", "exit codes")
        for col in cols:  # short values (ids, states, money, times) never wrap; names and places fold
            t.add_column(col, no_wrap=col not in ("name", "where", "spent / budget", "exit codes"),
                         overflow="fold")
    rows_narrow = []
    for r in data["runs"]:
        c = r["cost"]
        over = c["budget_usd"] is not None and c["spent_usd"] >= c["budget_usd"]
        spent = f"{usd(c['spent_usd'])} / {usd(c['budget_usd'])}"
        spent = f"[bold red]{spent}[/]" if over else spent
        active = r["status"] in ("planned", "provisioning", "running", "tearing_down") or c["live"]
        worst = usd(c["worst_case_usd"]) if c["worst_case_usd"] is not None else "[red]unbounded[/]"
        left = _dur(c["time_left_s"]) if active else "-"
        if wide:
            t.add_row(r["id"], escape(r["name"]), r["status"], f"{r['topology']} on {r['provider']}",
                      (r["started_at"] or "-")[5:16].replace("T", " "), spent,
                      usd(c["usd_per_hour"]) if c["live"] else "-", worst, left,
                      " ".join(f"{k}:{v}" for k, v in r["exit_codes"].items()))
        else:
            rows_narrow.append((r["id"], r["name"], _short_where(r["provider"], r["topology"]),
                                _run_status_words(r["status"]), spent, left))
    if not wide:
        t = _narrow_runs_table(rows_narrow, console.width)
    if data["runs"]:
        print_table(t, wide=wide)
        from broker.cli.rundiag import latest_failure_line

        why = latest_failure_line(data["runs"][0])  # the newest run failed: its cause, not only "failed"
        if why:
            console.print(escape(node_text(why)), highlight=False)
    else:
        console.print("no runs yet (`broker run recipes/ddp_2node.yaml` starts one).")
    console.print(_watchdog_line(data["watchdog"], {r["provider"] for r in data["live_resources"]}))
    for prov, why in data["refresh"]["notes"].items():
        console.print(f"  [yellow]{escape(prov)}[/]: {escape(why)}")


def show_live_resources(data: dict[str, Any], *, wide: bool) -> None:
    """The live resources of :func:`status_data`'s ``data`` (what bills now), their notes and totals; their spent
    amounts add up to the total shown."""
    from broker.core.prose import usd_parts
    from broker.core.ui import console, print_table, usd

    live = data["live_resources"]
    if not live:
        console.print("no live resources (nothing is billing).")
        return
    tot = data["totals"]
    spent_txt, spent_each = usd_parts(tot["spent_usd"], [r["cost"]["spent_usd"] for r in live])
    print_table(_resource_table(live, "live resources", wide=wide, spent=spent_each), wide=wide)
    for line in _resource_notes(live):
        console.print(line)
    console.print(f"live: {len(live)} resource(s), {usd(tot['usd_per_hour'])}/h, spent so far "
                  f"{spent_txt}"
                  + (f"; [bold red]{tot['errors']} failed terminate(s)[/]: `broker down RUN` retries"
                     if tot["errors"] else "")
                  + (f"; [bold red]{tot['possibly_billing']} possibly billing[/] (unknown create)"
                     if tot["possibly_billing"] else ""))
    if not wide:
        console.print("[dim]details: `broker status RUN` or `broker status --wide`[/]")
