"""``broker netns up|down|status``: a free local cluster of network namespaces with sshd, to practise on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

netns_app = typer.Typer(help="A local cluster: N nodes in network namespaces on this machine, each with sshd "
                             "(Linux, root).", no_args_is_help=True)


def _clusters_dir() -> Path:
    from broker.core.config import broker_home

    return broker_home() / "netns-clusters"


#: clusters above this many nodes are brought up only after a confirmation (--yes without a terminal): each node is
#: a namespace with its own sshd
CONFIRM_ABOVE_NODES = 8
#: a cluster's default lifetime (hours): the watchdog removes it at the deadline
DEFAULT_HOURS = 8.0


def _state_for(cid: str):
    from broker.core.config import runs_dir
    from broker.providers.netns import NetnsCluster, check_cid

    check_cid(cid)  # a whole id only: never a glob pattern
    found = [*runs_dir().glob(f"*/netns/{cid}/state.json"), *_clusters_dir().glob(f"*/netns/{cid}/state.json")]
    for st in found:
        try:
            return NetnsCluster.load(st.parent)
        except (OSError, ValueError, TypeError):
            continue
    return None


@netns_app.command("up", short_help="Bring up N namespaces, each with its own sshd")
def up_cmd(
    nodes: int = typer.Argument(2, metavar="[NODES]", help="number of nodes"),
    inject: str = typer.Option(None, "--inject", help="fault to reproduce: firewall | wrong-iface | mtu"),
    hours: float = typer.Option(DEFAULT_HOURS, "--hours", min=0.01, max=168.0,
                                help="remove the cluster after this many hours (the watchdog enforces it)"),
    yes: bool = typer.Option(False, "--yes", "-y", help=f"do not ask before bringing up more than "
                             f"{CONFIRM_ABOVE_NODES} nodes (required without a terminal)"),
    as_json: bool = typer.Option(False, "--json", help="print the cluster as JSON"),
) -> None:
    """Bring up NODES namespaces joined by a bridge, each running its own sshd; prints how to ssh in.  The cluster
    is a run in the ledger (`broker status` lists it, `broker down RUN` removes it) with a deadline (--hours)."""
    import sys

    from broker.core.errors import BadInput
    from broker.core.ui import console, print_json

    if nodes < 1:
        raise BadInput(f"NODES {nodes} is not a number of nodes", hint="e.g. broker netns up 2")
    if nodes > CONFIRM_ABOVE_NODES and not yes:
        what = f"{nodes} network namespaces, each with its own sshd process"
        if not sys.stdin.isatty():
            raise BadInput(f"{what} is a lot for one machine, and there is no terminal to confirm it: nothing was "
                           "created", hint=f"pass --yes to bring up {nodes} nodes anyway")
        if not typer.confirm(f"bring up {what}?", default=False, err=True):
            raise typer.Exit(1)
    c, run = _up_in_ledger(nodes, inject=inject, hours=hours)
    cl = c.cluster(c.cid)
    if as_json:
        print_json({"cid": c.cid, "root": str(c.root), "cluster": cl, "run_id": run.id,
                    "deadline": run.deadline})
        return
    console.print(f"[bold]cluster {c.cid}[/]: {nodes} node(s) on bridge {c.bridge} ({c.gateway}/24)"
                  + (f", fault injected: {inject}" if inject else ""))
    for n in cl.nodes:
        text, cmd = node_line(c, n)
        console.print(text, keep=[cmd])  # the command whole, even past the terminal's width: pasted, it runs
    console.print(f"run {run.id} in the ledger; removed at {run.deadline:%Y-%m-%d %H:%M}Z (in {hours:g} h) by "
                  "the watchdog", highlight=False)
    console.print(f"remove it with: broker netns down {c.cid}  (or broker down {run.id})", highlight=False)


def node_line(c: Any, n: Any) -> tuple[str, str]:
    """(the line ``netns up`` prints for node ``n`` of cluster handle ``c``, the ssh command in it)."""
    import shlex

    cmd = f"ssh -F {shlex.quote(str(c.root / 'ssh' / 'config'))} node{n.node_rank}"
    return f"  node{n.node_rank}: {n.host} (netns {c.ns(n.node_rank)})   {cmd}", cmd


def _up_in_ledger(nodes: int, *, inject: str | None, hours: float):
    """Bring up a cluster recorded ledger-first: a run (``netns-cluster``, topology multi-node, deadline ``hours``
    from now, no CLI process driving it) whose ``netns_node`` rows are written before the namespaces exist, then
    the watchdog started (it removes the cluster at the deadline).  Returns (cluster handle, run)."""
    from datetime import timedelta

    from broker.core.config import runs_dir
    from broker.money.ledger import Ledger
    from broker.core.model import utcnow
    from broker.core.records import Run
    from broker.providers import netns

    ledger = Ledger()
    now = utcnow()
    cid = netns.new_cid()
    run_id = now.strftime("%Y%m%d-%H%M%S-") + cid[3:]
    run_dir = runs_dir() / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    run = ledger.create_run(Run(id=run_id, name="netns-cluster", provider="netns", topology="multi-node",
                                status="running", created_at=now, started_at=now, deadline=now + timedelta(hours=hours),
                                budget_usd=None, run_dir=str(run_dir), pid=None,
                                message=f"`broker netns up {nodes}`: cluster {cid}"))
    rows = [ledger.record_intent(run.id, "netns", "netns_node", f"node{i}", deadline=run.deadline,
                                 attrs={"cid": cid}) for i in range(nodes)]
    ledger.event(run.id, "cli", "start", f"netns cluster {cid}: {nodes} node(s), deadline in {hours:g} h")
    try:
        c = netns.up(nodes, run_dir, inject=inject, cid=cid)
    except BaseException as e:
        for row in rows:
            ledger.update_resource(row.id, state="terminated", terminated_at=utcnow(), terminated_by="cli",
                                   actor="cli", message="never created: netns up failed")
        ledger.update_run(run.id, status="failed", ended_at=utcnow(), message=f"netns up failed: {e}")
        raise
    for i, row in enumerate(rows):
        ledger.mark_created(row.id, f"{cid}:{i}", state="running")
    try:
        from broker.core.config import settings

        if settings().broker_watchdog_autostart:  # as `broker run` does
            from broker.money.watchdog import start_detached

            start_detached()
    except Exception:  # noqa: BLE001 - the cluster stands; `broker status` says the watchdog is not running
        pass
    return c, run


def _end_in_ledger(cid: str) -> None:
    """After ``netns down``: the cluster's ledger rows terminated and its run ended (idempotent)."""
    from broker.money.ledger import Ledger
    from broker.core.model import utcnow

    ledger = Ledger()
    runs = set()
    for r in ledger.resources(live_only=True):
        if r.kind == "netns_node" and (r.provider_id or "").split(":")[0] == cid:
            ledger.update_resource(r.id, state="terminated", terminated_at=utcnow(), terminated_by="cli",
                                   actor="cli", message=f"`broker netns down {cid}`")
            runs.add(r.run_id)
    for rid in runs:
        run = ledger.get_run(rid)
        if run is not None and run.name == "netns-cluster" and not ledger.resources(rid, live_only=True):
            ledger.update_run(rid, status="torn_down", ended_at=utcnow(), message=f"`broker netns down {cid}`")
            ledger.event(rid, "cli", "end", "torn_down")


@netns_app.command("down", short_help="Delete a cluster's namespaces and processes (idempotent)")
def down_cmd(
    cid: str = typer.Argument(None, metavar="[CID]",
                             help="cluster id (bkn + 6 hex digits), as printed by `broker netns up`"),
    all_: bool = typer.Option(False, "--all", help="remove every leftover netns cluster on this machine"),
) -> None:
    """Kill the cluster's sshd's and processes, delete its namespaces, veths and bridge (idempotent).

    The id must be a whole cluster id ('bkn' + 6 hex digits): a part of one ('bkn') or any other word is an
    error (exit 2), never a pattern."""
    from broker.core.errors import BadInput

    if all_ and cid:
        raise BadInput("give a cluster id or --all, not both", hint="broker netns down bkn1a2b3c, or --all")
    if not all_ and not cid:
        raise BadInput("name a cluster id or pass --all", hint="`broker netns status` lists them")
    from broker.providers import netns
    from broker.core.ui import console

    if all_:
        removed = netns.down_all()
        from broker.money.ledger import Ledger

        for cid_ in {(r.provider_id or "").split(":")[0] for r in Ledger().resources(live_only=True)
                     if r.kind == "netns_node" and r.provider_id}:
            if not netns.leftovers(cid_):
                _end_in_ledger(cid_)
    else:
        netns.check_cid(cid)
        c = _state_for(cid)
        removed = c.down() if c else []
        pids = netns.sshd_processes(cid)
        netns._kill_pids(pids, 9)
        removed += [f"sshd pid {p}" for p in pids]
        removed += netns.remove_cid(cid)
        _end_in_ledger(cid)
        if not removed and c is None:
            console.print(f"no cluster {cid} on this machine: nothing to remove (`broker netns status` lists them)")
            return
    console.print("removed: " + (", ".join(removed) if removed else "nothing (already gone)"))


@netns_app.command("status", short_help="List the netns clusters on this machine")
def status_cmd() -> None:
    """List the netns clusters on this machine (namespaces, links, sshd processes)."""
    from collections import defaultdict

    from broker.providers import netns
    from broker.core.ui import console

    by: dict[str, list[str]] = defaultdict(list)
    for item in netns.leftovers():
        name = item.split()[1]
        by[name[:9]].append(item)
    if not by:
        console.print("no netns clusters")
        return
    for cid, items in sorted(by.items()):
        sshd = netns.sshd_processes(cid)
        c = _state_for(cid)
        where = f" state {c.root}" if c else ""
        console.print(f"[bold]{cid}[/]: {', '.join(items)}; sshd pids {sshd or '-'}{where}")

