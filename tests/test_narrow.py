"""Readable at 80 columns (issue 15): `broker plan` and `broker check` fit an 80-column terminal without cutting
what a user must read or copy (no '…'), and `--wide` brings the full plan table back."""

from __future__ import annotations

import re
import subprocess

import pytest
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


def _rejected_cells(text: str) -> tuple[list[str], list[str]]:
    """The lines of the rejected table's two columns (option, why) at 80 columns."""
    lines = text.split("\nrejected\n", 1)[1].splitlines()
    head = next(i for i, ln in enumerate(lines) if "why" in ln and "option" in ln)
    at = lines[head].index("why")
    body = []
    for ln in lines[head + 2:]:
        if not ln.strip():
            break
        body.append(ln)
    return [ln[:at].strip() for ln in body], [ln[at:].strip() for ln in body]


@pytest.mark.parametrize("args", [["plan", "--budget", "5"], ["plan", "--nodes", "2", "--topology", "hybrid", "--cpu-ok"]])
def test_rejected_reasons_wrap_without_a_lone_word(cli_env, args):
    out = _out(args, cli_env)
    option, why = _rejected_cells(out)
    assert len(why) >= 10, out
    lone = [w for w in why if len(w.split()) == 1]
    assert not lone, (lone, out)
    # the option column: a lone piece is only the worst case on its own line, e.g. "($0.43)"
    assert all(len(o.split()) != 1 or re.fullmatch(r"\(\$[\d.,]+\)|\(-\)", o) for o in option), option


def test_wrap_words_keeps_breaks_and_moves_a_widow():
    from broker.ui import wrap_words

    assert wrap_words("worst case $5.01 at 1 h > budget $5.00; affords 0.99 h", 52) == [
        "worst case $5.01 at 1 h > budget $5.00; affords", "0.99 h"]
    assert wrap_words("a b\n-> do this", 80) == ["a b", "-> do this"]
    assert wrap_words("one two", 3) == ["one", "two"]  # two words: nothing to give
    assert wrap_words("x" * 10 + " y", 5) == ["x" * 10, "y"]  # a word wider than the cell keeps its own line
