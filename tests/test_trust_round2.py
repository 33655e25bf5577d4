"""Trust boundaries, second round: what a node writes into its rank facts, what a folder's ``.env`` sets, what a
job prints of its secrets, which files staging ships and the modes of a run folder's files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from broker.launch import RunResult, rank_table

HOSTILE = "\x1b]0;TITLE\x07\x1b[2J\x9b2J\x1b]8;;http://evil.example/\x1b\\link\x1b]8;;\x1b\\[/dim][bold]BOLD\u202eevil"


def _hostile_facts(tmp_path: Path) -> dict[int, Path]:
    facts = tmp_path / "node0" / "facts"
    facts.mkdir(parents=True)
    (facts / "rank0.json").write_text(json.dumps({
        "rank": 0, "local_rank": 0, "world_size": 1, "host": "h" + HOSTILE, "python": "3" + HOSTILE,
        "device": "cpu" + HOSTILE, "backend": "gloo" + HOSTILE, "torch": "2" + HOSTILE, "gpus_visible": "0",
        "cuda_visible_devices": HOSTILE + "x" * 5000}))
    log = tmp_path / "node0.log"
    log.write_text("")
    return {0: log}


@pytest.mark.parametrize("width", [80, 200])
def test_node_facts_reach_the_summary_without_controls_or_markup(tmp_path, capsys, monkeypatch, width):
    from broker import ui
    from broker.commands import summary

    logs = _hostile_facts(tmp_path)
    rows = rank_table(logs, nnodes=1, nproc_per_node=1)
    assert all(len(getattr(rows[0], k)) <= 256 for k in ("host", "cuda_visible_devices"))
    rr = RunResult(status="succeeded", exit_codes={0: 0}, wall_s=1.0, log_paths=logs, ranks=rows)
    monkeypatch.setattr(ui.console, "width", width)
    run = SimpleNamespace(id="r1", name="t", topology="local", provider="local", run_dir=str(tmp_path))
    summary.render_summary(run, rr, SimpleNamespace(nodes=1))
    out = capsys.readouterr().out
    for bad in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert bad not in out
    assert "[/dim][bold]BOLD" in out  # shown as text, not obeyed
    assert "every rank: Python 3" in out
    if width < 110:
        assert "hosts: node 0 = h" in out
    assert "x" * 100 not in out  # each value bounded


def test_bidi_controls_are_removed_and_shown_with_v():
    from broker import ui

    assert ui.strip_controls("a\u202eb\u2066c\u2069d\u202a—’\n") == "abcd—’\n"
    assert ui.strip_controls("\x1b[31m\u202dx\x9b2J") == "x"
    assert ui.visible_controls("a\u202eb") == "a\\u202eb"
    # the fast path and the one regex agree on text with bidi controls too
    import random

    alphabet = list("ab \t\n\r\x1b[]0;2Km\x07\\\x9c\x9b") + ["\u202e", "\u2066", "\u2014", "\u2069", "\u00e9"]
    rng = random.Random(3)
    for _ in range(5000):
        t = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        want = ui._CONTROLS.sub("", ui._OVERWRITTEN.sub("", t) if "\r" in t else t)
        assert ui.strip_controls(t) == want, repr(t)
