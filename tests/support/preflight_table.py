"""The preflight report as a rich Table (the CLI prints :func:`broker.run.preflight.render_text`)."""

from __future__ import annotations

from typing import Any

from broker.run.preflight import PreflightReport


def render_table(report: PreflightReport) -> Any:
    """A rich Table of the checks."""
    from rich.table import Table

    t = Table(title=f"preflight: {'PASSED' if report.ok else 'FAILED'} in {report.wall_s:.1f} s")
    for col in ("check", "node(s)", "result", "detail", "fix"):
        t.add_column(col, overflow="fold")
    style = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
    for c in report.checks:
        t.add_row(c.check, c.nodes, f"[{style.get(c.result, '')}]{c.result}[/]", c.detail, c.fix)
    return t
