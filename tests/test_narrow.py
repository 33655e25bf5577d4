"""Readable at 80 columns (issue 15): `broker plan` and `broker check` fit an 80-column terminal without cutting
what a user must read or copy (no '…'), and `--wide` brings the full plan table back."""

from __future__ import annotations

import re
import subprocess

from rich.cells import cell_len

from tests.conftest import REPO, broker_cmd


def _out(args, env, columns=80):
    p = subprocess.run(broker_cmd(*args), cwd=REPO, env=dict(env, COLUMNS=str(columns)), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _table_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(" ") or "─" in ln]


def test_plan_fits_80_columns_and_cuts_nothing(cli_env):
    out = _out(["plan", "--budget", "5"], cli_env)
    assert "…" not in out
    assert all(cell_len(ln) <= 80 for ln in _table_lines(out)), [ln for ln in _table_lines(out) if cell_len(ln) > 80]
    assert re.search(r"^ \*\s+vast\s+simulated\s+2x RTX 3090\s+24G\s+\$0\.34", out, re.M), out
    assert "--wide adds" in out
    wide = _out(["plan", "--budget", "5", "--wide"], cli_env, columns=160)
    assert "snap 11-29" in wide and "Quebec" in wide


def test_check_shows_urls_and_key_paths_whole_at_80_columns(cli_env):
    out = _out(["check"], cli_env)
    assert "…" not in out
    assert "https://cloud.vast.ai/manage-keys/" in out and "~/.config/vastai/vast_api_key" in out
    assert "~/.oci/config" in out


def test_names_with_colons_print_as_written():
    """A recipe or offer name like ``demo:fire:`` is printed as written, not turned into an emoji by rich."""
    from broker.ui import console, err

    for c in (console, err):
        with c.capture() as cap:
            c.print("run demo:fire: on node:rocket:1")
        assert "demo:fire: on node:rocket:1" in cap.get()
