"""``broker catalog show|refresh``: the price snapshots in effect, and new ones from live sources."""

from __future__ import annotations

import typer

from broker.cli.plan import live_catalog
from broker.plan.facts import CLOUD, _short
from broker.providers import SNAPSHOT

#: ``broker catalog``: its subcommands below (broker.cli.app.COMMAND_TABLE adds the group)
catalog_app = typer.Typer(help="Price snapshots: show what is in effect, refresh from live APIs.",
                          no_args_is_help=True)


@catalog_app.command("show", short_help="Date, source and size of each price snapshot in effect")
def catalog_show(
    provider: list[str] = typer.Argument(None, metavar="[PROVIDER]...",
                                         help=f"providers (default: {' '.join(SNAPSHOT)})"),
    offers: bool = typer.Option(False, "--offers", help="also list the snapshot's offers"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Date, source, notes and size of each provider's price snapshot in effect."""
    from rich.markup import escape
    from rich.table import Table

    from broker.plan import catalog
    from broker.core.provider import BadInput
    from broker.core.ui import console, print_json

    names = list(provider) if provider else list(catalog.PROVIDERS)
    metas = []
    for n in names:
        try:
            metas.append(catalog.snapshot_meta(n))
        except FileNotFoundError as e:
            raise BadInput(str(e), hint=f"providers with snapshots: {', '.join(catalog.PROVIDERS)}") from None
    if as_json:
        print_json({"snapshots": [{**m, **({"offer_list": catalog.snapshot_offers(m['provider'])} if offers
                                             else {})} for m in metas]})
        return
    for m in metas:
        kind = "refreshed" if m["overlay"] else "shipped"
        console.print(f"[bold]{m['provider']}[/]: snapshot {m['date']} ({escape(m.get('label', ''))}), "
                      f"{m['offers']} offers, {kind}: {escape(m['path'])}")
        console.print(f"  source: {escape(m.get('source', ''))}")
        for note in m.get("notes", []):
            console.print(f"  note: {escape(note)}")
        if offers:
            t = Table(show_header=True)
            for col in ("instance type", "GPUs", "GiB/GPU", "$/h", "region", "min billed s", "storage $/GiB/mo"):
                t.add_column(col)
            for o in catalog.snapshot_offers(m["provider"]):
                t.add_row(escape(o.instance_type), f"{o.gpu_count}x {escape(o.gpu_name)}", f"{o.gpu_mem_gib:g}",
                          f"{o.usd_per_hour:g}", escape(o.region or "any"), f"{o.min_billed_seconds:g}",
                          f"{o.storage_usd_per_gib_month:g}")
            console.print(t)


@catalog_app.command("refresh", short_help="Write new dated price snapshots from live sources")
def catalog_refresh(
    provider: list[str] = typer.Option(None, "--provider", "-p", help="provider (repeatable; default all clouds)"),
) -> None:
    """Write new dated snapshots from live sources (kept in the broker home, used before the shipped ones).

    Vast.ai: a live offer search (VAST_API_KEY).  AWS: the Pricing API (AWS credentials).  OCI: Oracle's
    public price list (no credentials).  A provider whose source is unavailable keeps its snapshot."""
    from rich.markup import escape

    from broker.plan import catalog
    from broker.core.ui import console

    failed = 0
    for name in (list(provider) if provider else list(CLOUD)):
        date, _ = catalog.snapshot_info(name)
        keep = f"keeping snapshot {date}"
        try:
            got = live_catalog(name)
        except Exception as e:  # an unreachable source or a broken adapter: reported, never a crash
            failed += 1
            why = _short(e).removeprefix(f"{name}: ")  # a provider error names its provider already
            console.print(f"[red]{name}: refresh failed[/]: {escape(why)}; {keep}")
            continue
        if isinstance(got, str):
            console.print(f"{name}: {escape(got)}; {keep}")
            continue
        offers, source = got
        if not offers:
            console.print(f"{name}: the live source returned no offers; {keep}")
            continue
        path = catalog.refresh(name, offers, source=source)
        console.print(f"{name}: wrote {len(offers)} offers ({escape(source)}) to {escape(str(path))}")
    if failed:
        raise typer.Exit(4)
