"""``broker lint SCRIPT [--strict]``: static check of a training script for multi-host mistakes."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("lint")
    def lint_cmd(
        script: Path = typer.Argument(..., metavar="SCRIPT", help="training script, e.g. recipes/ddp_train.py"),
        strict: bool = typer.Option(False, "--strict", help="exit 1 when there is any finding"),
        as_json: bool = typer.Option(False, "--json", help="print the findings as JSON"),
    ) -> None:
        """Check SCRIPT for device-from-global-rank, nccl without CUDA fallback, LOCAL_RANK-0 writes and
        global-rank-0-only downloads; prints file:line, the mistake and the fix (warnings unless --strict)."""
        from dataclasses import asdict

        from rich.markup import escape

        from broker.lint import lint_script
        from broker.provider import BadInput
        from broker.ui import console, print_json

        if not script.is_file():
            raise BadInput(f"{script}: no such file", hint="give the path of a Python training script")
        findings = lint_script(script)
        if as_json:
            print_json({"script": str(script), "findings": [asdict(f) for f in findings]})
        elif not findings:
            console.print(f"{escape(str(script))}: no findings")
        else:
            for f in findings:
                level = "[bold red]error[/]" if strict or f.kind == "syntax-error" else "[yellow]warning[/]"
                console.print(f"{escape(f.path)}:{f.line}: {level} {escape('[' + f.kind + ']')} {escape(f.message)}", highlight=False)
                console.print(f"    fix: {escape(f.fix)}", highlight=False)
            console.print(f"{len(findings)} finding(s)" + ("" if strict else " (warnings; --strict makes them errors)"))
        # a script that does not parse cannot run anywhere: always an error
        raise typer.Exit(1 if (strict and findings) or any(f.kind == "syntax-error" for f in findings) else 0)
