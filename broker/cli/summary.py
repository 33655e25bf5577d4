"""Rendering of a finished run (shared by every provider's run path)."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from broker.run.supervisor import RunResult, describe_exit
from broker.core.records import Run, run_where
from broker.core.ui import console, node_text, usd

#: the most characters of one rank fact (host, device, backend, versions) shown: a node chooses these values
MAX_FACT = 64


def fact_text(value: object) -> str:
    """One value from a node's rank facts, ready for rich markup: control and bidi characters removed
    (:func:`broker.core.ui.node_text`), cut to :data:`MAX_FACT` characters, and markup escaped (a node's ``[bold]`` is
    shown, not obeyed)."""
    text = node_text(str(value)).replace("\n", " ").replace("\t", " ")
    if len(text) > MAX_FACT:
        text = text[:MAX_FACT - 1] + "…"
    return escape(text)


#: torchelastic's end-of-job barrier on a node whose peer (the store host, node 0) exited first
EXIT_BARRIER_NOISE = "Error waiting on exit barrier"


def render_summary(run: Run, result: RunResult, recipe, cost_usd: float = 0.0) -> None:
    """Topology, per-rank table (from the rank facts, for any script), status, the diagnosis (the rank that
    failed first, its error, cause and fix), exit codes, wall time, cost and where the logs are."""
    rows = result.ranks
    started = any(r.device != "?" or r.host != "?" for r in rows)
    if started:
        print_rank_table(run, rows)
    else:
        console.print(f"run {run.id}: {run.name} ({run_where(run)}): {no_rank_text(result)}",
                      highlight=False)
    colour = "green" if result.ok and not result.error_lines and not getattr(result, "warnings", None) else \
        ("yellow" if result.ok else "red")
    console.print(f"status: [bold {colour}]{result.shown_status}[/]"
                  + (f" - {escape(node_text(result.reason))}" if result.reason else ""))
    run_dir = Path(run.run_dir) if run.run_dir else None
    diag_lines: list[str] = list(result.diagnosis)
    if not diag_lines and run_dir is not None and (not result.ok or result.error_lines):
        from broker.providers import THIS_MACHINE
        from broker.run.diagnose import explain

        try:
            diag_lines = explain(run_dir, result, getattr(recipe, "nodes", None),
                                 local=run.provider in THIS_MACHINE).lines()
        except Exception as e:  # noqa: BLE001 - a diagnosis must never hide the summary
            diag_lines = [f"(no diagnosis: {type(e).__name__}: {e})"]
    if diag_lines:
        console.print("[bold]diagnosis:[/]")
        for line in diag_lines:  # quoted from the nodes' logs: no control sequence reaches the terminal
            console.out(f"  {node_text(line)}", highlight=False)
    codes = ", ".join(f"node {k}: {describe_exit(v)}" for k, v in sorted(result.exit_codes.items()))
    console.print(f"exit codes: {codes or 'none (no node was started)'}")
    print_time_and_cost(run, result, cost_usd)
    preflight = run_dir / "preflight.txt" if run_dir else None
    if preflight is not None and preflight.exists() and preflight_failed(result):
        console.print(f"preflight report (why no rank started): {preflight}", highlight=False)
        preflight = None
    written = {k: p for k, p in sorted(result.log_paths.items()) if _has_content(Path(p))}
    for k, p in written.items():
        console.print(f"log node {k}: {p}", highlight=False)
    if result.log_paths and not written:
        console.print("node logs: none written (no node printed anything)", highlight=False)
    if preflight is not None and preflight.exists():
        console.print(f"preflight: {preflight}", highlight=False)
    if result.tail and not result.ok and not diag_lines:
        console.print(f"[bold]last lines of node {result.failed_node}:[/]")
        for line in result.tail:
            console.out(f"  {node_text(line)}", highlight=False)
    if result.ok and _logs_mention(result, EXIT_BARRIER_NOISE):
        console.print("[dim]note: a node's torchrun logged 'Error waiting on exit barrier' after training finished: "
                      "node 0's agent hosts the rendezvous store and exited first, so the other agent's end-of-job "
                      "barrier lost its connection. Harmless here (every node exited 0).[/]")


def print_rank_table(run: Run, rows: list) -> None:
    """The per-rank table of a run whose ranks reported their facts (node, RANK, LOCAL_RANK, WORLD_SIZE,
    CUDA_VISIBLE_DEVICES, device, backend; versions where they differ), the hosts line below 110 columns and what
    LOCAL_RANK 0 everywhere means."""
    from rich import box

    # the headers are the variables a learner is reading about: never broken mid-word.  Below 110 columns the
    # host and GPU count move to one line under the table so the rest fits 80 columns.
    wide = console.width >= 110
    t = Table(title=f"run {run.id}: {run.name} ({run_where(run)})", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    cols = ["node", *(["host"] if wide else []), "RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES",
            *(["GPUs"] if wide else []), "device", "backend"]
    versions = {(r.python, r.torch, r.cuda, r.nccl) for r in rows if r.torch != "?"}
    if len(versions) > 1:
        cols += ["python", "torch", "CUDA", "NCCL"]
    for col in cols:
        t.add_column(col, no_wrap=True)
    for r in rows:
        cvd = {"": "(empty)", "''": "(empty)", '""': "(empty)"}.get(r.cuda_visible_devices, r.cuda_visible_devices)
        cells = [str(r.node), *([r.host] if wide else []), str(r.rank), str(r.local_rank), str(r.world_size),
                 cvd, *([r.gpus] if wide else []), r.device, r.backend]
        if len(versions) > 1:
            cells += [r.python, r.torch, r.cuda, r.nccl]
        t.add_row(*(fact_text(c) for c in cells))
    console.print(t)
    if not wide:
        # GPUs are known once the script imports torch (the rank shim's hook); "?" is left out, not printed
        per_node: dict = {}  # one entry a node (its first rank): a node with 2 processes was listed twice
        for r in rows:
            if r.host != "?":
                per_node.setdefault(r.node, r)
        console.print("[dim]hosts: " + ", ".join(
            f"node {r.node} = {fact_text(r.host)}"
            + (f" ({fact_text(r.gpus)} GPU(s) visible)" if r.gpus != "?" else "")
            for r in per_node.values()) + "[/]")
    if len(versions) == 1:
        py, tv, cu, nc = (fact_text(v) for v in next(iter(versions)))
        console.print(f"[dim]every rank: Python {py}, torch {tv}, CUDA {cu}, NCCL {nc}[/]")
    if all(r.local_rank == 0 for r in rows) and len(rows) > 1:
        cuda = any(str(r.device).startswith("cuda") for r in rows)  # a CPU (gloo) run has no cuda:0
        console.print("[dim]RANK is global (0..WORLD_SIZE-1); LOCAL_RANK counts processes on one node, so with "
                      "one process per node every LOCAL_RANK is 0"
                      + (" and each node's GPU is its cuda:0" if cuda else "") + ".[/]")


def print_time_and_cost(run: Run, result: RunResult, cost_usd: float) -> None:
    """The wall time and cost (USD) lines: one attempt's, or every attempt's with each one's cause and share."""
    rows = _attempt_rows(run)
    if len(rows) < 2:
        console.print(f"wall time: {result.wall_s:.1f} s   cost: {usd(cost_usd)}")
    else:  # the cost covers every attempt: so does the wall time (the run's, from its start)
        from broker.core.model import utcnow
        from broker.core.prose import usd_parts

        total, each = usd_parts(cost_usd, [a["usd"] for a in rows])
        since = run.started_at or run.created_at
        end = getattr(run, "ended_at", None) or utcnow()  # a summary printed later keeps the run's own end
        whole = f"{(end - since).total_seconds():.1f} s over {len(rows)} attempts" if since else "-"
        console.print(f"wall time: {whole} (the last {result.wall_s:.1f} s)   cost: {total}")
        pre = sum(1 for a in rows if a["cause"] == "preempted")
        console.print(f"attempts: {len(rows)} ({pre} preempted): " + ", ".join(
            f"#{a['attempt']} {a['cause'] or 'running'} {c}" for a, c in zip(rows, each))
            + f"; `broker status {run.id}` has each one, `broker logs {run.id} --attempt N` its logs",
            highlight=False)


def preflight_failed(result: RunResult) -> bool:
    """Whether the run stopped at a failed preflight (the SSH executors' report, or the reason it gave)."""
    report = getattr(result, "preflight", None)
    return (report is not None and not report.ok) or result.reason.startswith("preflight failed")


def no_rank_text(result: RunResult) -> str:
    """The end of the summary's title when no rank reported its facts: a whole sentence on why, true for the case
    (preflight failed, interrupted, the deadline, a step before launch failed, or the ranks exited first)."""
    started = bool(result.exit_codes)
    if preflight_failed(result):
        return "no rank started: preflight failed"
    if result.status == "interrupted":
        return ("interrupted (Ctrl-C) before any rank reported" if started
                else "interrupted (Ctrl-C) before any rank started")
    if result.status == "deadline":
        return "the deadline passed before any rank reported"
    if not started:
        return "no rank started: the run stopped before launch" if not result.ok else "no rank was started"
    if result.ok:
        return "every node exited 0, but no rank reported its facts"
    return "the nodes exited before any rank reported"


def _has_content(p: Path) -> bool:
    try:
        return p.stat().st_size > 0
    except OSError:
        return False


def _logs_mention(result: RunResult, text: str) -> bool:
    for p in result.log_paths.values():
        try:
            if text in Path(p).read_text(encoding="utf-8", errors="replace"):
                return True
        except OSError:
            pass
    return False


def _attempt_rows(run: Run) -> list[dict]:
    """The attempts of a run with what each cost (:func:`broker.run.attempts.attempt_costs`); [] when it kept no
    record.  Never raises: the summary must not break."""
    try:
        from broker.money.ledger import Ledger
        from broker.run.attempts import attempt_costs

        return attempt_costs(Ledger(), run.id)
    except Exception:  # noqa: BLE001
        return []
