"""``broker netns up|down|status``: a free local cluster of network namespaces with sshd, to practise on."""

from __future__ import annotations

from pathlib import Path

import typer

netns_app = typer.Typer(help="A local cluster: N nodes in network namespaces on this machine, each with sshd "
                             "(Linux, root).", no_args_is_help=True)


def _clusters_dir() -> Path:
    from broker.config import broker_home

    return broker_home() / "netns-clusters"


def _state_for(cid: str):
    from broker.providers.netns import NetnsCluster, check_cid

    check_cid(cid)  # a whole id only: never a glob pattern
    for st in _clusters_dir().glob(f"*/netns/{cid}/state.json"):
        try:
            return NetnsCluster.load(st.parent)
        except (OSError, ValueError, TypeError):
            continue
    return None


@netns_app.command("up", short_help="Bring up N namespaces, each with its own sshd")
def up_cmd(
    nodes: int = typer.Argument(2, metavar="[NODES]", help="number of nodes"),
    inject: str = typer.Option(None, "--inject", help="fault to reproduce: firewall | wrong-iface | mtu"),
    as_json: bool = typer.Option(False, "--json", help="print the cluster as JSON"),
) -> None:
    """Bring up NODES namespaces joined by a bridge, each running its own sshd; prints how to ssh in."""
    from broker.providers import netns
    from broker.model import utcnow
    from broker.ui import console, print_json

    d = _clusters_dir() / utcnow().strftime("%Y%m%d-%H%M%S")
    c = netns.up(nodes, d, inject=inject)
    cl = c.cluster(c.cid)
    if as_json:
        print_json({"cid": c.cid, "root": str(c.root), "cluster": cl})
        return
    console.print(f"[bold]cluster {c.cid}[/]: {nodes} node(s) on bridge {c.bridge} ({c.gateway}/24)"
                  + (f", fault injected: {inject}" if inject else ""))
    for n in cl.nodes:
        console.print(f"  node{n.node_rank}: {n.host} (netns {c.ns(n.node_rank)})   ssh -F {c.root}/ssh/config "
                      f"node{n.node_rank}")
    console.print(f"remove it with: broker netns down {c.cid}")


@netns_app.command("down", short_help="Delete a cluster's namespaces and processes (idempotent)")
def down_cmd(
    cid: str = typer.Argument(None, metavar="[CID]",
                             help="cluster id (bkn + 6 hex digits), as printed by `broker netns up`"),
    all_: bool = typer.Option(False, "--all", help="remove every leftover netns cluster on this machine"),
) -> None:
    """Kill the cluster's sshd's and processes, delete its namespaces, veths and bridge (idempotent).

    The id must be a whole cluster id ('bkn' + 6 hex digits): a part of one ('bkn') or any other word is an
    error (exit 2), never a pattern."""
    from broker.errors import BadInput

    if all_ and cid:
        raise BadInput("give a cluster id or --all, not both", hint="broker netns down bkn1a2b3c, or --all")
    if not all_ and not cid:
        raise BadInput("name a cluster id or pass --all", hint="`broker netns status` lists them")
    from broker.providers import netns
    from broker.ui import console

    if all_:
        removed = netns.down_all()
    else:
        netns.check_cid(cid)
        c = _state_for(cid)
        removed = c.down() if c else []
        pids = netns.sshd_processes(cid)
        netns._kill_pids(pids, 9)
        removed += [f"sshd pid {p}" for p in pids]
        removed += netns.remove_cid(cid)
        if not removed and c is None:
            console.print(f"no cluster {cid} on this machine: nothing to remove (`broker netns status` lists them)")
            return
    console.print("removed: " + (", ".join(removed) if removed else "nothing (already gone)"))


@netns_app.command("status", short_help="List the netns clusters on this machine")
def status_cmd() -> None:
    """List the netns clusters on this machine (namespaces, links, sshd processes)."""
    from collections import defaultdict

    from broker.providers import netns
    from broker.ui import console

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


def register(app: typer.Typer) -> None:
    app.add_typer(netns_app, name="netns", short_help="A local cluster in network namespaces (Linux, root)")
