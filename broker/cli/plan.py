"""What ``broker plan`` does and shows: :func:`plan_command` (the body both parsers run) and the plan's rendering.

The commands (``broker plan``, ``offers``, ``check``) are in :mod:`broker.cli.planning`, ``broker catalog`` in
:mod:`broker.cli.catalog`: this module imports no Typer, so ``broker plan``'s parser-free start
(:mod:`broker.cli.fastplan`) stays quick.

Facts come from the adapters (``providers.get_provider(name)``): offers, quotas, capacity and a price note.  A
provider whose adapter is missing or raises is reported in the notes and never stops the plan; its offers then
come from the shipped (or refreshed) price snapshot (:mod:`broker.plan.catalog`).  No SDK client is created here, so a
machine without credentials plans offline (no network call at all).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from broker.core.model import Offer, Plan, PlanOption, Requirements
    from broker.core.plaintable import Table

from broker.plan.facts import (CLOUD, CREDENTIALS_HINT, DEFAULT_PROVIDERS, _short, check_names, gather,  # noqa: E402
                          log_plan)


# ------------------------------------------------------------------------------------------------ rendering
def what(opt: "PlanOption") -> str:
    """What is rented: ``2 x g5.xlarge``, ``2x RTX 3090`` (a Vast.ai host), ``this machine``."""
    from broker.providers import THIS_MACHINE

    if opt.provider in THIS_MACHINE:
        return "this machine"
    if not opt.offers:
        return "-"
    o = opt.offers[0]
    if opt.topology.value == "hybrid":
        return f"here + {len(opt.offers)} x {o.instance_type}"
    return f"{len(opt.offers)} x {o.instance_type}" if opt.topology.value == "multi-node" else o.instance_type


def where_of(o: "Offer", zones: list[str] | None = None) -> str:
    """Region and zone(s) of an offer: ``us-east-1/us-east-1a``, ``Quebec, CA, NA``; '' when unknown."""
    zone = ",".join(zones) if zones else o.zone
    return "/".join(x.strip(" ,") for x in (o.region, zone) if x and x.strip(" ,"))


def where(opt: "PlanOption", zones: list[str] | None = None) -> str:
    """Region and zone(s): ``us-east-1/us-east-1a,us-east-1b``, ``Quebec, CA, NA``; '' when unknown."""
    return where_of(opt.offers[0], zones) if opt.offers else ""


def rented(opt: "PlanOption", zones: list[str] | None = None) -> str:
    """What is rented, in words: ``2 x g5.xlarge (us-east-1/us-east-1a)``, ``2x RTX 3090 (Quebec, CA, NA)``.

    ``zones``: equal options in several zones, shown as one (``us-east-1/us-east-1a,us-east-1b``)."""
    w = where(opt, zones)
    return f"{what(opt)} ({w})" if w else what(opt)


def group_zones(options: list["PlanOption"]) -> list[tuple["PlanOption", list[str]]]:
    """Options that differ only by zone (same provider, topology, offer, region, cost and reasons) as one row each,
    in order; the first keeps its place, the zones of the others are listed with it."""
    rows: list[tuple[PlanOption, list[str]]] = []
    index: dict[tuple, int] = {}
    for o in options:
        first = o.offers[0] if o.offers else None
        if first is None or first.zone is None:
            rows.append((o, []))
            continue
        # the instance type, not the offer id: adapters whose ids name the zone (GCP's ``type@zone``) group too
        k = (o.provider, o.topology, first.instance_type, first.region, o.interruptible, o.worst_case_usd,
             tuple(o.rejected))
        if k in index:
            rows[index[k]][1].append(first.zone)
        else:
            index[k] = len(rows)
            rows.append((o, [first.zone]))
    return rows


def gpus(opt: "PlanOption") -> str:
    if not opt.offers:
        return "-"
    o = opt.offers[0]
    n = sum(x.gpu_count for x in opt.offers)
    if n == 0:
        return "CPU (gloo)"
    name = "" if o.gpu_name in o.instance_type else f" {o.gpu_name}"  # a Vast label already names the model
    return f"{n}x{name} {round(o.gpu_mem_gib):g} GiB" if o.gpu_mem_gib else f"{n}x{name or ' GPU'}"


def hours_floor(h: float) -> str:
    """Hours to 2 decimals, rounded down (a deadline shown must never be later than the one that fits)."""
    import math

    return f"{math.floor(h * 100 + 1e-9) / 100:.2f}"


def max_hours_text(opt: "PlanOption", budget: float | None) -> str:
    if budget is None:
        return "-"
    if opt.max_hours_within_budget is None:
        return "unlimited"
    return hours_floor(opt.max_hours_within_budget)


def next_step(plan: "Plan", recipe: Path | None) -> str | None:
    """The command to run next: `broker run ...` for the chosen option (after configuring its provider when it has
    no credentials yet), or the quota request that would unblock a rejected option."""
    c = plan.chosen
    if c is None:
        steps = [o.next_step for o in plan.rejected if o.next_step]
        return steps[0] if steps else None
    import shlex

    # quoted: `--recipe "my recipes/job.yaml"` must give a command that works when pasted
    run = f"broker run {shlex.quote(str(recipe)) if recipe else 'RECIPE.yaml'} --provider {c.provider}"
    if c.topology.value == "hybrid":  # node 0 is this machine (docs/hybrid.md)
        run += " --topology hybrid"
    if c.provider in CLOUD:
        from broker.providers import get_provider

        try:
            configured = get_provider(c.provider).check().configured
        except Exception:  # noqa: BLE001 - an adapter that cannot start is not configured
            configured = False
        if not configured:
            return f"configure {c.provider} ({CREDENTIALS_HINT[c.provider]}; see .env.example), then {run}"
    return run


def source_short(price_source: str) -> str:
    """``snapshot 2026-11-29 (SkyPilot catalog medians)`` -> ``snap 11-29`` (the notes give source and year);
    ``live ...`` -> ``live``; an interruptible price's (:func:`broker.plan.interruptible.variant`) the same, a bid's
    margin first (``interruptible: bid 10% over snapshot 2026-11-29`` -> ``bid+10% snap 11-29``: the row says
    ``int.``); anything else up to its first parenthesis."""
    if price_source.startswith("interruptible: "):
        rest = price_source[len("interruptible: "):]
        if rest.startswith("bid ") and "% over " in rest:
            pct, _, src = rest[len("bid "):].partition("% over ")
            return f"bid+{pct}% {source_short(src)}"
        return source_short(rest)
    head = price_source.split(" (")[0]
    if head.startswith("live"):
        return "live"
    return "snap " + head.split()[1][5:] if head.startswith("snapshot ") and len(head.split()) > 1 else head


def compact_gpus(opt: "PlanOption") -> str:
    """GPU memory in a few characters for the 80-column table: ``24G``, ``2x16G`` per node; '' for CPU."""
    if not opt.offers or not opt.offers[0].gpu_count:
        return ""
    return f"{round(opt.offers[0].gpu_mem_gib):g}G"


#: width of the rejected table's option column below WIDE_COLUMNS (cells)
OPTION_WIDTH = 24

#: terminal width from which ``broker plan`` shows every column (GPUs, prices, where) without --wide
WIDE_COLUMNS = 120


class _Ops:
    """What ``broker plan`` prints, recorded in order: prose lines (console markup) and tables
    (:class:`broker.core.plaintable.Table`), for rich or for the plain renderer to print alike."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.items: list[tuple[str, Any, bool]] = []

    def line(self, markup: str) -> None:
        self.items.append(("line", markup, False))

    def table(self, table: Any, *, wide: bool = False) -> None:
        self.items.append(("table", table, wide))

    def texts(self) -> "list[str]":
        out: list[str] = []
        for kind, x, _ in self.items:
            if kind == "line":
                out.append(x)
            else:
                out += [x.title or ""] + [c.header for c in x.columns] + [t for c in x.columns for t, _ in c.cells]
        return out


class RichOut:
    """Prints recorded output through a rich console (:data:`broker.core.ui.console` by default): the terminal's
    way, and the reference the plain renderer is checked against."""

    def __init__(self, console: Any = None) -> None:
        if console is None:
            from broker.core.ui import console
        self.console = console

    @property
    def width(self) -> int:
        return int(self.console.width)

    def replay(self, ops: _Ops) -> None:
        from rich import box
        from rich.table import Table

        from broker.core.ui import Wrapped, print_table

        for kind, x, wide in ops.items:
            if kind == "line":
                self.console.print(x, soft_wrap=False)
                continue
            t = Table(title=x.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                      collapse_padding=True)
            for c in x.columns:
                t.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, overflow=c.overflow,
                             max_width=c.max_width)
            for row in zip(*(c.cells for c in x.columns)):
                t.add_row(*(Wrapped(text) if wrapped else text for text, wrapped in row))
            print_table(t, wide=wide, out=self.console)


class PlainOut:
    """Prints recorded output as rich prints it into a pipe or file, without importing rich
    (:mod:`broker.core.plaintable`); output with anything but printable ASCII goes to :class:`RichOut`."""

    def __init__(self, stream: Any = None, width: int | None = None) -> None:
        import os
        import sys

        from broker.core.plaintable import console_width
        from broker.core.prose import NO_WRAP_WIDTH

        self.stream = stream if stream is not None else sys.stdout
        self.width = console_width() if width is None else width
        no_wrap = os.environ.get("BROKER_NO_WRAP", "").strip() not in ("", "0")
        self.prose_width = NO_WRAP_WIDTH if no_wrap else self.width

    def replay(self, ops: _Ops) -> None:
        from broker.core.plaintable import markup_plain, plain_text_ok, table_text, write
        from broker.core.prose import wrap_plain

        if not all(plain_text_ok(t) for t in ops.texts()):
            RichOut().replay(ops)
            return
        parts = []
        for kind, x, wide in ops.items:
            if kind == "line":
                parts.append("\n".join(wrap_plain(markup_plain(x), self.prose_width)) + "\n")
            else:
                parts.append(table_text(x, self.width, self.prose_width, wide=wide))
        write(self.stream, "".join(parts))


def plain_stream(stream: Any) -> bool:
    """Whether ``broker plan`` prints to ``stream`` without rich: rich would write it as a plain file (no terminal,
    :func:`broker.core.plaintable.stream_is_plain`) and rich's consoles are not loaded yet (once they are, a test
    or a caller may have set them up: they print)."""
    import sys

    from broker.core.plaintable import stream_is_plain

    return "broker.core.ui" not in sys.modules and stream_is_plain(stream)


def stdout_out() -> "RichOut | PlainOut":
    """Where ``broker plan`` prints: :class:`PlainOut` into a pipe or file, else rich (a terminal)."""
    import sys

    return PlainOut(sys.stdout) if plain_stream(sys.stdout) else RichOut()


def render_plan(plan: "Plan", recipe: Path | None, *, limit: int = 8, rejected_limit: int = 12,
                wide: bool | None = None, out: "RichOut | PlainOut | None" = None,
                recipe_sets: "tuple[str, str | None] | None" = None, words: dict[str, str] | None = None) -> None:
    """Print ``plan`` (the job, the best options, the rejected ones and why, notes, the choice and the next step)
    on ``out`` (default :func:`stdout_out`).  ``recipe_sets``: the recipe file's own (``interruptible``,
    ``checkpoint_dir``), so an interruptible choice names only what the recipe still lacks; None = no recipe.
    ``words``: how the user set the budget and the deadline (:func:`broker.plan.explain.limit_words`; default: the flags)."""
    from broker.core.plaintable import escape

    out = out if out is not None else stdout_out()
    ops = _Ops(out.width)
    natural = wide is True  # --wide: every column at its natural width, wider than the terminal if need be
    auto = wide is None  # a wide terminal: every column where they fit it whole
    if wide is None:
        wide = ops.width >= WIDE_COLUMNS
    ops.line(job_line(plan.requirements))
    prices = prices_line(plan)
    if prices:
        ops.line(prices)
    if plan.options:
        wide = show_best_options(ops, plan, limit=limit, wide=wide, natural=natural, auto=auto)
    if plan.rejected:
        ops.table(rejected_table(plan, rejected_limit=rejected_limit, wide=wide))
        if len(plan.rejected) > rejected_limit:
            ops.line(f"({len(plan.rejected) - rejected_limit} more of the {len(plan.rejected)} rejected options kept "
                     "in --json)")
    for n in plan.notes:
        ops.line(f"[dim]note:[/] {escape(n)}")
    step = next_step(plan, recipe)
    show_choice(ops, plan, recipe_sets=recipe_sets, words=words)
    if step:
        ops.line(f"[bold]next:[/] {escape(step)}")
    out.replay(ops)


def prices_line(plan: "Plan") -> str | None:
    """Where the plan's prices come from, under its first line: the dated snapshots shipped with broker (or the
    user's ``broker catalog refresh`` of them) and their dates, or which providers answered live; None for a plan
    without offers.  A plan made with no credentials says so here, not only in the notes at its end."""
    from broker.plan.catalog import shipped_path, snapshot_path
    from broker.providers import NOT_RENTED

    offers = [o for opt in [*plan.options, *plan.rejected] for o in getattr(opt, "offers", ())
              if o.provider not in NOT_RENTED]  # this machine, netns, slurm: no price to come from anywhere
    if not offers:
        return None
    snap: dict[str, str] = {}
    live: set[str] = set()
    for o in offers:
        src = o.price_source.removeprefix("interruptible: ")
        if src.startswith("snapshot "):
            snap.setdefault(o.provider, src.split()[1])
        else:
            live.add(o.provider)
    if not snap:
        return f"[dim]prices:[/] live from {', '.join(sorted(live))}"
    try:
        refreshed = {p for p in snap if snapshot_path(p) not in (None, shipped_path(p))}
    except (OSError, KeyError, ValueError):
        refreshed = set()
    dates = sorted(set(snap.values()))
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    origin = ("refreshed by `broker catalog refresh`" if refreshed == set(snap) else
              "shipped with broker" if not refreshed else
              f"shipped with broker ({', '.join(sorted(refreshed))} refreshed)")
    text = f"[dim]prices:[/] dated snapshots {origin}, {when}"
    if live:
        return text + f", for {', '.join(sorted(set(snap) - live))}; live from {', '.join(sorted(live))}"
    return text + "; no provider was asked (notes below: what gives live prices)"


def job_line(req: "Requirements") -> str:
    """The plan's first line: the job asked for (nodes, GPUs, deadline, budget, topology), as markup."""
    from broker.core.plaintable import escape
    from broker.core.prose import usd

    models = ", ".join(req.gpu_names) if req.gpu_names else "any model"
    hours = f"{req.hours:g} h deadline" if req.hours is not None else "as long as the budget affords"
    budget = usd(req.budget_usd) if req.budget_usd is not None else "none"
    job = (f"{req.nodes} node(s), CPU only (gloo)" if req.gpus_per_node == 0 else
           f"{req.nodes} node(s) x {req.gpus_per_node} GPU (>= {req.min_gpu_mem_gib:g} GiB, {escape(models)})")
    return (f"[bold]job:[/] {job}, {hours}, budget {budget}, topology {req.topology}"
            + (", cpu_ok" if req.cpu_ok and req.gpus_per_node else ""))


def best_options_table(plan: "Plan", *, limit: int, compact: bool, wide: bool) -> "Table":
    """The best options; ``compact``: an interruptible row's "int." and saving under its topology and $/h
    instead of beside them, for a width where the one-line rows would cut the names; ``wide``: every
    column."""
    from broker.core.plaintable import Column, Table, drop_empty_columns, escape
    from broker.core.prose import usd

    req = plan.requirements
    deadline = f"{req.hours:g} h" if req.hours is not None else "the longest affordable run"
    spot = any(o.interruptible for o in plan.options)
    t = Table(title=f"best options ({plan.valid_count or len(plan.options)} valid; * = chosen; worst = at "
                    f"{deadline} + setup)", columns=[])
    # short values (money, hours, memory) never wrap nor are cut; only the long names (rented, GPUs, where)
    # wrap, and fold a word longer than their column
    cols = [("", "left", True), ("provider", "left", True), ("topology", "left", True),
            ("rented", "left", False)]
    cols += [("GPUs", "left", False)] if wide else [("mem", "right", True)]
    cols += [("$/h", "right", True), ("worst", "right", True)]
    if spot:  # interruptible options: their expected cost with restarts beside the worst case, and what
        # their $/h saves on the same machine on demand (the cheapest on-demand row is often another one)
        cols += [("exp", "right", True)] + ([] if compact else [("off", "right", True)])
    cols += [("max h", "right", True)]
    if wide:
        cols += [("prices", "left", True), ("where", "left", False)]
    for col, just, nowrap in cols:
        t.columns.append(Column(col, justify=just, no_wrap=nowrap, overflow="fold"))
    for i, (o, zones) in enumerate(group_zones(plan.options)[:limit]):
        topo = o.topology.value + (("\n" if compact else " ") + "int." if o.interruptible else "")
        rate = usd(o.usd_per_hour) + (f"\n-{saves_text(o)}" if compact and saves_text(o) else "")
        row = ["[bold green]*[/]" if i == 0 else "", o.provider, topo, escape(what(o)),
               escape(gpus(o)) if wide else compact_gpus(o), rate, usd(o.worst_case_usd)]
        if spot:
            row += [usd(o.expected_usd) if o.expected_usd is not None else "-"]
            row += [] if compact else [saves_text(o)]
        row += [max_hours_text(o, req.budget_usd)]
        if wide:
            row += [escape(source_short(o.price_source)), escape(where(o, zones))]
        t.add_row(*row)
    return drop_empty_columns(t)


def show_best_options(ops: _Ops, plan: "Plan", *, limit: int, wide: bool, natural: bool, auto: bool) -> bool:
    """Add the best-options table and its legend to ``ops`` in the layout that fits ``ops.width`` (``auto``: the
    wide one only where it fits whole; ``natural``: --wide, every column whatever the width); returns whether the
    wide layout was kept (the rejected table follows it)."""
    from broker.core.plaintable import measure
    from broker.core.prose import NO_WRAP_WIDTH
    from broker.plan.interruptible import attempts_words

    req = plan.requirements
    spot = any(o.interruptible for o in plan.options)
    t = best_options_table(plan, limit=limit, compact=False, wide=wide)
    if auto and wide and measure(t, NO_WRAP_WIDTH)[1] > ops.width:
        wide = False  # the wide columns would cut the names at this width: the narrow layout, whole
        t = best_options_table(plan, limit=limit, compact=False, wide=False)
    compact = spot and not wide and measure(t, NO_WRAP_WIDTH)[1] > ops.width
    if compact:
        t = best_options_table(plan, limit=limit, compact=True, wide=False)
    ops.table(t, wide=natural)
    if not wide:
        ops.line("[dim]max h = the longest run the budget affords; --wide adds GPU models, price sources "
                 "and where each option is[/]")
    if spot:
        saving = ("-N% under a $/h = that much below the same machine on demand" if compact else
                  "off = its $/h below the same machine on demand")
        ops.line(f"[dim]int. = interruptible (bid / spot / preemptible): worst covers "
                 f"{attempts_words(req.max_restarts + 1)} (max_restarts {req.max_restarts}), exp = expected cost "
                 f"with restarts, {saving}[/]")
    return wide


def rejected_table(plan: "Plan", *, rejected_limit: int, wide: bool) -> "Table":
    """The first ``rejected_limit`` rejected options and why, one row for a machine refused alike in N zones;
    ``wide``: provider, topology, rented, worst case and why in columns of their own."""
    from broker.core.plaintable import Column, Table, escape
    from broker.core.prose import cell_len, usd

    req = plan.requirements
    t = Table(title="rejected", columns=[])
    if wide:
        for col in ("provider", "topology", "rented", "worst case", "why"):
            t.columns.append(Column(col, no_wrap=col in ("provider", "topology", "worst case")))
    else:  # 80 columns: the option in one narrow column, the reasons beside it
        t.columns += [Column("option (worst case)", max_width=OPTION_WIDTH), Column("why")]
    shown = group_zones(plan.rejected[:rejected_limit])  # one row for a machine refused alike in N zones
    for o, zones in shown:
        why = "; ".join(o.rejected)
        if len(zones) > 1:
            why += f" (same in {len(zones)} zones: {', '.join(zones)})"
        if o.next_step:
            why += f"\n-> {o.next_step}"
        # beside the budget: $5.0029 over a $5.00 budget must not read "$5.00"
        worst = usd(o.worst_case_usd, req.budget_usd) if o.offers else "-"
        if wide:  # (text, True): a cell word-wrapped first (broker.core.ui.Wrapped)
            t.add_row(o.provider, o.topology.value, escape(rented(o)), worst, (why, True))
        else:  # the worst case on a line of its own when it does not fit beside what is rented
            option = f"{what(o)} ({worst})"
            if cell_len(option) > OPTION_WIDTH:
                option = f"{what(o)}\n({worst})"
            t.add_row((f"{o.provider} {o.topology.value}\n{option}", True), (why, True))
    return t


def show_choice(ops: _Ops, plan: "Plan", *, recipe_sets: "tuple[str, str | None] | None",
                words: dict[str, str] | None) -> None:
    """Add what was chosen (with what an interruptible choice needs, and a cheaper option a quota increase would
    open) to ``ops``; with no choice, the cheapest option the budget alone blocked and which limit to raise."""
    from broker.core.plaintable import escape
    from broker.core.prose import usd
    from broker.plan.interruptible import attempts_words

    req = plan.requirements
    c = plan.chosen
    if c is not None:
        ops.line(f"[bold]chosen:[/] {c.topology.value} on {c.provider}: {escape(rented(c))}, worst case "
                 f"{usd(c.worst_case_usd)} at a {hours_floor(c.hours)} h deadline ({escape(c.price_source)})")
        if c.interruptible:
            ops.line(f"  interruptible: expected {usd(c.expected_usd or 0)}; the worst case covers "
                     + attempts_words(c.max_restarts + 1) + interruptible_needs(req.interruptible, recipe_sets))
        cheaper = [o for o in plan.rejected if o.next_step and o.worst_case_usd < c.worst_case_usd]
        if cheaper:
            ops.line(f"cheaper after a quota increase: {escape(rented(cheaper[0]))} on {cheaper[0].provider} "
                     f"({usd(cheaper[0].worst_case_usd)}): {escape(cheaper[0].next_step or '')}")
        return
    from broker.core.model import RejectionKind

    only_budget = [o for o in plan.rejected if o.offers and o.rejected
                   and all(r.kind is RejectionKind.budget for r in o.rejected)]
    if only_budget:
        b = min(only_budget, key=lambda o: o.worst_case_usd)
        ops.line(f"cheapest option blocked only by the budget: {b.topology.value} {escape(rented(b))} on "
                 f"{b.provider}, worst case {usd(b.worst_case_usd)} at a {b.hours:.2f} h deadline "
                 f"(raise {(words or {}).get('budget', '--budget')} or shorten "
                 f"{(words or {}).get('hours', '--hours')})")


def saves_text(o: "PlanOption") -> str:
    """An interruptible row's ``off`` cell: how much lower its $/h is than the same offers on demand (``61%``);
    ``""`` for an on-demand row or an unknown on-demand price."""
    od = o.on_demand_usd_per_hour
    if not o.interruptible or od is None or od <= 0:
        return ""
    return f"{max(0.0, 1 - o.usd_per_hour / od):.0%}"


def interruptible_needs(value: str, recipe_sets: "tuple[str, str | None] | None") -> str:
    """``"; the run needs ..."`` naming what a run of an interruptible choice needs that the recipe lacks (the
    ``interruptible:`` value ``value`` (``true``/``auto``) and a ``checkpoint_dir:``), ``""`` when it has both.
    ``recipe_sets``: the recipe's own (``interruptible``, ``checkpoint_dir``); None = no recipe (both lacking)."""
    has_value, ckpt = recipe_sets if recipe_sets is not None else ("false", None)
    needs = []
    if has_value not in ("true", "auto"):  # either word rents this choice; false never does
        needs.append(f"`interruptible: {value}` in the recipe (or `broker run --interruptible {value}`)")
    if ckpt is None:
        needs.append("a `checkpoint_dir:` in the recipe to resume from")
    return "; the run needs " + " and ".join(needs) if needs else ""


# ------------------------------------------------------------------------------------------------ commands
def _requirements(recipe: Path | None, sets: "list | None" = None, **flags: Any) -> "Requirements":
    from broker.core.model import Requirements

    base: dict[str, Any] = {}
    if recipe is not None:
        from broker.core.recipe import load_recipe

        r = load_recipe(recipe, resolve=False)
        base = asdict(r.requirements())  # planning needs no env values
        try:  # the staged work folder travels to every node: priced per GB where the offer names a rate
            from broker.run.staging import recipe_stage_plan

            staged = recipe_stage_plan(Path(r.workdir), r.script, r.args, checkpoint_dir=r.checkpoint_dir)
            base["transfer_in_gb"] = staged.total_bytes / 1e9
        except (OSError, ValueError):
            pass  # a folder that cannot be read now is reported by the run itself
        if sets is not None:
            sets.extend((r.interruptible, r.checkpoint_dir))
    else:
        base = asdict(Requirements(budget_usd=None))
    for k, v in flags.items():
        if v is not None and v != []:
            base[k] = v
    return Requirements(**base)


def add_free_tier(req: "Requirements", facts: Any, names: list[str]) -> None:
    """``--cpu-only``: add the free-tier snapshot's $0.00 CPU offers (``providers/snapshots/free_tier.csv``) of the
    planned providers to ``facts`` and say where they come from."""
    from broker.plan.catalog import SHIPPED_DIR
    from broker.plan.planner import free_tier_offers, parse_free_tier

    text = (SHIPPED_DIR / "free_tier.csv").read_text()
    offers = [o for o in free_tier_offers(req, text) if o.provider in names]
    facts.offers.extend(offers)
    if offers:
        meta, _ = parse_free_tier(text)
        types = ", ".join(sorted({o.instance_type for o in offers}))
        facts.notes.append(f"free tier ({meta.get('date', '?')}): {types}"
                           " at $0.00 within their limits (OCI: 2 E2.1.Micro per tenancy, A1 within 4 OCPUs / 24 GB; "
                           "AWS: 750 instance-hours a month); see providers/snapshots/free_tier.csv for the "
                           "assumptions")


def plan_command(*, budget: float | None = None, nodes: int | None = None, gpus_per_node: int | None = None,
                 gpu: "list[str] | None" = None, min_gpu_mem: float | None = None, hours: float | None = None,
                 max_run: bool = False, topology: str | None = None, provider: "list[str] | None" = None,
                 recipe: Path | None = None, cpu_ok: bool | None = None, cpu_only: bool = False,
                 disk: float | None = None, top: int = 8, vast_query: str | None = None, offline: bool = False,
                 wide: bool | None = None, as_json: bool = False, interruptible: str | None = None) -> int:
    """``broker plan``'s body, for the Typer command and for the parser-free start of
    :mod:`broker.cli.fastplan` alike (the parameters are the command's options, already parsed): prints the plan
    and returns the exit code, 0 or 3 (no valid plan).  Raises :class:`broker.core.errors.BadInput` for a bad
    value."""
    from broker.core.errors import BadInput
    from broker.core.limits import check_number

    # the same limits as a recipe's (broker.core.limits), before anything is planned
    for flag, field, value in (("--nodes", "nodes", nodes), ("--gpus-per-node", "gpus_per_node", gpus_per_node),
                               ("--budget", "budget_usd", budget), ("--hours", "max_hours", hours),
                               ("--min-gpu-mem", "min_mem_gib", min_gpu_mem), ("--disk", "disk_gib", disk)):
        check_number(flag, field, value)
    from broker.plan.planner import plan as make_plan
    from broker.core.prose import print_json

    if topology is not None and topology not in ("simulated", "multi-node", "local", "hybrid", "any"):
        raise BadInput(f"--topology {topology!r} is not a topology",
                       hint="simulated, multi-node, local, hybrid or any")
    if interruptible is not None:  # the recipe field's words and error (broker run --interruptible says the same)
        from broker.core.recipe import check_interruptible

        interruptible = check_interruptible("--interruptible", interruptible)
    if max_run and hours is not None:
        raise BadInput("--max-run and --hours both set the deadline", hint="give one of them")
    if max_run and budget is None and recipe is None:
        raise BadInput("--max-run needs --budget", hint="e.g. broker plan --budget 5 --max-run")
    sets: list = []  # the recipe file's (interruptible, checkpoint_dir), before a flag changes the first
    req = _requirements(recipe, sets, nodes=nodes, gpus_per_node=gpus_per_node, gpu_names=gpu or None,
                        min_gpu_mem_gib=min_gpu_mem, hours=hours, budget_usd=budget, topology=topology,
                        cpu_ok=cpu_ok, disk_gib=disk, providers=provider or None,
                        interruptible=interruptible)
    if max_run:
        req = replace(req, hours=None)
    if cpu_only:
        req = replace(req, gpus_per_node=0, cpu_ok=True)
    names = check_names(provider) if provider else list(DEFAULT_PROVIDERS)
    facts = gather(req, names, vast_query=vast_query, offline=offline)
    if cpu_only or (req.gpus_per_node == 0 and req.cpu_ok):  # --cpu-only or a recipe's gpus_per_node: 0
        add_free_tier(req, facts, names)
    p = make_plan(req, facts.offers, facts.quotas, facts.capacities, notes=facts.notes, here=facts.here,
                  unavailable=facts.unavailable, top_k=max(top * 8, 20))
    log_plan(p)
    hint = ""
    from broker.plan.explain import limit_words

    words = limit_words(recipe, budget, hours if not max_run else None, cpu_ok)
    if p.chosen is None:  # why, and what to change (broker.plan.explain is read only then)
        from broker.plan.explain import no_plan_hints

        hint = "; ".join(no_plan_hints(p, cpu_ok=req.cpu_ok, budget_given=req.budget_usd is not None,
                                       words=words)) or (
            "no offer matched the job at all (GPU model, memory, providers): see the notes above"
            if not p.rejected else "relax the job, raise the budget or request quota")
    no_plan = ("no valid plan: every option is rejected (the reasons are in plan.rejected)", hint)
    if as_json:
        # schema_version first: print_json adds it (broker.core.ui.JSON_SCHEMA_VERSION), as for every --json object
        doc: dict[str, Any] = {"chosen": p.chosen,
                               "next_step": next_step(p, recipe), "plan": p}
        if p.chosen is None:  # like every error in JSON mode: an error object beside the plan
            doc["error"] = {"type": "NoValidPlan", "kind": "no_valid_plan", "message": no_plan[0],
                            "hint": no_plan[1], "exit_code": 3}
        print_json(doc)
    else:
        render_plan(p, recipe, limit=top, wide=wide, recipe_sets=(sets[0], sets[1]) if sets else None,
                    words=words)
    if p.chosen is None:
        if as_json:  # the one-line message on stderr, as for other errors in JSON mode
            from broker.cli.report import _report

            _report(3, *no_plan, kind="NoValidPlan", as_json=True, json_object=False)
        else:
            import sys

            from broker.core.plaintable import escape as esc

            msg = f"[bold red]no valid plan:[/] every option is rejected (reasons above); {esc(hint)}"
            if plain_stream(sys.stderr):  # into a pipe or file: rich's text without rich
                ops = _Ops(0)
                ops.line(msg)
                PlainOut(sys.stderr).replay(ops)
            else:
                from broker.core.ui import err

                err.print(msg, markup=True)
        return 3
    return 0


def _where_between_words(t: Any, width: int) -> None:
    """Give the offers table's ``where`` column its longest word as its least width (a region id such as
    us-central1, "Washington,") when the other columns leave room for it within ``width``: a place then wraps
    between words, never inside one.  Where they do not, the column folds as before."""
    from rich.cells import cell_len

    cols = t.columns
    where = next((c for c in cols if c.header == "where"), None)
    if where is None:
        return
    longest = max((cell_len(w) for x in where._cells for w in str(x).split()), default=0)
    # the other columns never fold (ids, models, prices): their widest cells, two cells of padding each, and the
    # table's edge must leave the where column its longest word
    others = sum(max(cell_len(str(c.header)), *(cell_len(str(x)) for x in c._cells)) for c in cols if c is not where)
    if others + 2 * len(cols) - 1 + longest <= width:
        where.min_width = longest


def live_catalog(name: str) -> "tuple[list[Offer], str] | str":
    """Offers for a refreshed snapshot of ``name`` and their source, or why there is no live source.

    Raises what the source raises (provider errors, httpx errors)."""
    from broker.plan import catalog
    from broker.core.model import Requirements

    from broker.providers import capabilities, get_provider, provider_class

    caps = capabilities(name)
    try:
        if caps.live_price_list == "public":  # a public price list: no credentials needed
            return provider_class(name).public_price_offers()
        p = get_provider(name)
    except ImportError as e:
        return f"adapter not available ({_short(e)})"
    chk = p.check()
    if not chk.configured:
        return f"no credentials ({chk.hint or caps.credentials_hint or ''})"
    req = Requirements(nodes=1, gpus_per_node=1, min_gpu_mem_gib=0, hours=None, budget_usd=None)
    if caps.live_offer_search:  # a live market search, no snapshot fallback
        offers = p.live_offers(req)
        return list(offers), f"live {name} offer search (broker catalog refresh)"
    if caps.live_price_list == "api":  # list prices for the snapshot's instance types, with credentials
        source = p.live_prices_source
        return catalog.repriced_offers(name, p.live_prices, source=source), source
    live = [o for o in p.offers(req) if not o.price_source.startswith("snapshot")]
    return live, f"live {name} offers (broker catalog refresh)"
