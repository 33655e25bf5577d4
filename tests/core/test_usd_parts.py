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
