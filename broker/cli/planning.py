"""``broker plan``, ``broker offers`` and ``broker check``: the commands (their bodies and the plan's rendering
live in :mod:`broker.cli.plan`, which ``broker plan``'s parser-free start imports without Typer)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from broker.cli import plan
from broker.cli.plan import WIDE_COLUMNS, _where_between_words, where_of
from broker.plan.facts import CLOUD, DEFAULT_PROVIDERS, _short, check_names, gather

_log = logging.getLogger("broker.cli.plan")  # the plan commands' log lines keep their logger's name


def plan_cmd(
    budget: float = typer.Option(None, "--budget", "-b", help="total budget in USD (worst case must fit)"),
    nodes: int = typer.Option(None, "--nodes", "-n", help="nodes (default 2)"),
    gpus_per_node: int = typer.Option(None, "--gpus-per-node", help="GPUs per node (default 1)"),
    gpu: list[str] = typer.Option(None, "--gpu", help="accepted GPU model (repeatable; default any)"),
    min_gpu_mem: float = typer.Option(None, "--min-gpu-mem", help="GiB per GPU (default 16)"),
    hours: float = typer.Option(None, "--hours", help="hard deadline in hours (default 1)"),
    max_run: bool = typer.Option(False, "--max-run", help="deadline = the longest run the budget affords"),
    topology: str = typer.Option(None, "--topology", help="simulated | multi-node | local | hybrid | any"),
    provider: list[str] = typer.Option(None, "--provider", "-p", help="provider to plan over (repeatable)"),
    recipe: Path = typer.Option(None, "--recipe", "-r", help="take the job from this recipe"),
    cpu_ok: bool = typer.Option(None, "--cpu-ok/--no-cpu-ok", help="accept gloo on CPU (local logic check)"),
    cpu_only: bool = typer.Option(False, "--cpu-only", help="a CPU-only job (0 GPUs per node, gloo): free-tier "
                                  "machines (OCI Always Free, AWS free tier) are $0.00 options within their "
                                  "limits"),
    disk: float = typer.Option(None, "--disk", help="disk per node in GiB (default 40)"),
    top: int = typer.Option(8, "--top", min=1, help="how many valid options to show"),
    vast_query: str = typer.Option(None, "--vast-query", help="Vast native filters, e.g. 'reliability>0.98'"),
    offline: bool = typer.Option(False, "--offline", help="ask no provider: plan clouds from the shipped price "
                                 "snapshots (also when an API is rate-limited or down)"),
    wide: bool = typer.Option(None, "--wide/--narrow", help="every column (GPU models, price sources, where); "
                              "default: when the terminal has 120 columns or more"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    interruptible: str = typer.Option(None, "--interruptible", help="false | true | auto: rent interruptible "
                                      "(bid / spot / preemptible) capacity; auto = only when its expected cost "
                                      "with restarts is lower (default: the recipe's, else false)"),
) -> None:
    """The cheapest valid way to run the job within a budget, and why every other option was rejected."""
    code = plan.plan_command(budget=budget, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, min_gpu_mem=min_gpu_mem,
                        hours=hours, max_run=max_run, topology=topology, provider=provider, recipe=recipe,
                        cpu_ok=cpu_ok, cpu_only=cpu_only, disk=disk, top=top, vast_query=vast_query,
                        offline=offline, wide=wide, as_json=as_json, interruptible=interruptible)
    if code:
        raise typer.Exit(code)


def offers_cmd(
    gpu: list[str] = typer.Option(None, "--gpu", help="GPU model (repeatable), e.g. 'RTX 4090', A10"),
    min_gpu_mem: float = typer.Option(0.0, "--min-gpu-mem", min=0, help="GiB per GPU"),
    num_gpus: int = typer.Option(1, "--num-gpus", min=1, help="at least this many GPUs per offer"),
    provider: list[str] = typer.Option(None, "--provider", "-p", help="provider (repeatable; default all clouds)"),
    limit: int = typer.Option(30, "--limit", "-l", min=1, help="rows to show"),
    vast_query: str = typer.Option(None, "--vast-query", help="Vast native filters, e.g. 'reliability>0.98'"),
    wide: bool = typer.Option(None, "--wide/--narrow", help="every column (vCPU/RAM, disk price); default: "
                              f"when the terminal has {WIDE_COLUMNS} columns"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Raw offers, cheapest first (like `vastai search offers`), live where configured, else the snapshot."""
    from rich.markup import escape
    from rich.table import Table

    from broker.core.model import Requirements
    from broker.plan.planner import fmt_num, gpu_name_matches
    from broker.core.ui import console, print_json, print_table, usd

    req = Requirements(nodes=1, gpus_per_node=num_gpus, gpu_names=list(gpu or []), min_gpu_mem_gib=min_gpu_mem,
                       hours=None, budget_usd=None, topology="any")
    facts = gather(req, check_names(provider) if provider else list(CLOUD), facts_too=False,
                   vast_query=vast_query)
    rows = [o for o in facts.offers if o.gpu_count >= num_gpus and o.gpu_mem_gib >= min_gpu_mem
            and (not gpu or any(gpu_name_matches(g, o.gpu_name) for g in gpu))]
    from broker.providers import THIS_MACHINE, get_provider

    for name in [n for n in provider or [] if n in THIS_MACHINE]:
        if any(o.provider == name for o in rows):
            continue
        # this machine is listed as it is, even when it does not meet the filters (no GPU: a CPU check only)
        here = get_provider(name).machine_offer()
        rows.append(here)
        facts.notes.append(f"{name}: this machine " + (f"has {here.gpu_count} GPU(s), fewer or smaller than asked"
                           if here.gpu_count else "has no GPU: it runs a job with cpu_ok: true (gloo on CPU), "
                           "free"))
    rows.sort(key=lambda o: (o.usd_per_hour, o.key))
    if as_json:
        print_json({"offers": rows[:limit], "total": len(rows), "notes": facts.notes})
        return
    from rich import box

    t = Table(title=f"offers ({min(limit, len(rows))} of {len(rows)}, cheapest first)", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    if wide is None:
        wide = console.width >= WIDE_COLUMNS
    cols = [("provider", True), ("offer", True), ("GPUs", True)]  # ids and models never fold
    cols += [("vCPU/RAM GiB", True), ("$/hour", True), ("disk $/GiB/mo", True)] if wide else [("$/hour", True)]
    cols += [("where", False), ("net", True)]  # net: "private" (a private network across nodes) or "public"
    for col, nowrap in cols:
        t.add_column(col, no_wrap=nowrap, overflow="fold",
                     justify="right" if col.startswith(("$", "disk")) else "left")
    for o in rows[:limit]:
        if o.offer_id.startswith("snapshot"):  # a price point, not a rentable offer id
            offer = "snapshot" if o.gpu_name in o.instance_type else o.instance_type
        elif o.offer_id == o.instance_type or o.gpu_name in o.instance_type:
            offer = o.offer_id
        else:
            offer = f"{o.offer_id} ({o.instance_type})"
        gpus = (f"{o.gpu_count}x {o.gpu_name} {round(o.gpu_mem_gib):g}G" if o.gpu_count else
                f"none ({fmt_num(o.vcpus)} CPUs)")
        cells = [o.provider, escape(offer), escape(gpus)]
        if wide:
            cells += [f"{fmt_num(o.vcpus) if o.vcpus else '?'}/{fmt_num(o.ram_gib) if o.ram_gib else '?'}",
                      usd(o.usd_per_hour),
                      "incl." if o.attrs.get("dph_includes_storage") else f"{o.storage_usd_per_gib_month:g}"]
        else:
            cells += [usd(o.usd_per_hour)]
        cells += [escape(where_of(o) or "any"), "private" if o.private_network else "public"]
        t.add_row(*cells)
    _where_between_words(t, console.width)
    print_table(t, wide=wide)
    if not wide:
        console.print("[dim]net: private = the nodes share a private network; --wide adds vCPU/RAM and disk "
                      "prices[/]")
    for n in facts.notes:
        console.print(f"[dim]note:[/] {escape(n)}")


def check_cmd(
    provider: list[str] = typer.Option(None, "--provider", "-p", help="provider (repeatable; default all)"),
    online: bool = typer.Option(False, "--online", help="also make one cheap authenticated call where the "
                                "adapter has one (Vast.ai: current user and credit)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Whether each provider's credentials are present (no network) and, with --online, usable."""
    import inspect

    from rich.markup import escape
    from broker.core.provider import ProviderCheck
    from broker.core.ui import console, print_json
    from broker.providers import get_provider

    results: list[ProviderCheck] = []
    for name in check_names(provider) if provider else list(DEFAULT_PROVIDERS):
        try:
            p = get_provider(name)
            if online and "online" in inspect.signature(p.check).parameters:
                results.append(p.check(online=True))  # type: ignore[call-arg]
            else:
                results.append(p.check())
        except ImportError as e:
            results.append(ProviderCheck(provider=name, configured=False, usable=None,
                                         detail=f"adapter broker.providers.{name} not available: {_short(e)}",
                                         hint="plans use the shipped price snapshot"))
        except Exception as e:
            results.append(ProviderCheck(provider=name, configured=False, usable=False, detail=_short(e)))
        r = results[-1]
        _log.info("check %s: credentials %s, %s%s", name, "present" if r.configured else "missing",
                  {True: "usable", False: "not usable", None: "not tried online"}[r.usable],
                  f" ({r.detail})" if r.detail else "")
    if as_json:
        print_json({"providers": results})
        return
    # one block per provider (URLs and key paths are never cut: they are what the user must copy)
    for r in results:
        usable = {True: "usable", False: "NOT usable", None: "not tried online"}[r.usable]
        state = "[green]present[/]" if r.configured else "[yellow]missing[/]"
        console.print(f"[bold]{r.provider}[/]: credentials {state}, {usable}", highlight=False)
        if r.detail:
            console.print(f"  {escape(r.detail)}", highlight=False, soft_wrap=False)
        if r.hint:
            console.print(f"  -> {escape(r.hint)}", highlight=False, soft_wrap=True)
