"""Words for money and places in run summaries: parts of a cost add up as printed (broker.core.prose.usd_parts);
a run's headline (broker.core.records.run_where)."""

from __future__ import annotations

import pytest

from broker.core.prose import usd_parts


@pytest.mark.parametrize("total, parts, want", [
    (0.03, [0.015, 0.015], ("$0.0300", ["$0.0150", "$0.0150"])),  # $0.01 + $0.01 beside $0.03: 4 decimals
    (0.0166, [0.0083, 0.0083], ("$0.0166", ["$0.0083", "$0.0083"])),  # sub-cent parts beside a $0.02 total
    # thirds of a cent: each part rounds down, the total up; the larger remainder takes the missing 0.0001
    (0.016667, [0.0083336, 0.0083334], ("$0.0167", ["$0.0084", "$0.0083"])),
    (0.05, [0.0166667, 0.0166667, 0.0166666], ("$0.0500", ["$0.0167", "$0.0167", "$0.0166"])),
    (1.5, [1.0, 0.5], ("$1.50", ["$1.00", "$0.50"])),  # cents add up: kept
    (2.0, [], ("$2.00", [])),
])
def test_parts_and_total_add_up_as_printed(total, parts, want):
    got = usd_parts(total, parts)
    assert got == want
    if parts:
        assert sum(float(x[1:]) for x in got[1]) == pytest.approx(float(got[0][1:]), abs=1e-4)


def test_a_runs_headline_names_local_once():
    from types import SimpleNamespace

    from broker.core.records import run_where

    assert run_where(SimpleNamespace(topology="local", provider="local")) == "local"
    assert run_where(SimpleNamespace(topology="multi-node", provider="aws")) == "multi-node on aws"


def test_status_attempt_lines_add_up_to_their_total(monkeypatch):
    """`broker status RUN` read "$0.0084 ... $0.0083 ... $0.0168 in all" for a run that `broker cost` showed as
    $0.0084 + $0.0084 (a GPU resume on the fake cloud): the lines use the same rounded parts."""
    from datetime import datetime, timezone

    from broker.run import attempts

    t = datetime(2026, 12, 2, 22, 1, tzinfo=timezone.utc)
    rows = [{"attempt": 1, "started_at": t, "ended_at": t, "cause": "preempted", "detail": "taken back",
             "usd": 0.0083846, "resources": ["fake instance a"]},
            {"attempt": 2, "started_at": t, "ended_at": t, "cause": "succeeded", "detail": None,
             "usd": 0.0083512, "resources": ["fake instance b"]}]
    monkeypatch.setattr(attempts, "attempt_costs", lambda ledger, run_id: rows)
    lines = attempts.attempt_lines(None, "r")
    parts = [float(line.split("; $")[1].split(";")[0]) for line in lines[:2]]
    total = float(lines[2].split(", $")[1].split()[0])
    assert lines[2].startswith("preemptions: 1; 2 attempt(s), $") and lines[2].endswith(" in all")
    assert abs(sum(parts) - total) < 1e-9 and total == 0.0167, lines
