"""Tables printed into a pipe or file carry no trailing blanks (rich pads every cell to its column's width)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_in_a_pipe_has_no_trailing_blanks(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_"))}
    env.update(BROKER_HOME=str(tmp_path / "h"), OCI_CONFIG_FILE=str(tmp_path / "none"), HOME=str(tmp_path),
               AWS_EC2_METADATA_DISABLED="true", COLUMNS="80")
    out = subprocess.run([sys.executable, "-m", "broker", "plan", "--budget", "5", "--offline"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("provider" in x and "max h" in x for x in lines) and "rejected" in out.stdout  # the tables are there
    assert [x for x in lines if x != x.rstrip()] == []


def test_table_keeps_its_cells_and_a_terminal_keeps_rich_rendering():
    from rich.table import Table

    from broker.core.ui import _Console

    def table() -> Table:
        t = Table(title="t", box=None)  # as broker's tables: no right edge, so rich pads each row with blanks
        t.add_column("name")
        t.add_column("price", justify="right")
        t.add_row("a-long-name", "$1.00")
        t.add_row("b", "")
        return t

    pipe = _Console(file=io.StringIO(), width=40, soft_wrap=True)
    pipe.print(table())
    text = pipe.file.getvalue()
    assert "a-long-name" in text and "$1.00" in text and all(x == x.rstrip() for x in text.splitlines())
    tty = _Console(file=io.StringIO(), width=40, soft_wrap=True, force_terminal=True, color_system=None)
    tty.print(table())
    assert [x.rstrip() for x in tty.file.getvalue().splitlines()] == text.splitlines()
