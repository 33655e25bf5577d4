"""Money as broker shows it: one formatter (broker.core.prose.usd) with its edge rules, and one split of a total
into parts that add up as shown (usd_parts)."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.prose import usd, usd_parts


def _value(text: str) -> Decimal:
    assert text.startswith(("$", "-$")), text
    return Decimal(text.replace("$", "").replace(",", ""))


@pytest.mark.parametrize("x, want", [
    (None, "-"), (float("nan"), "-"), (float("inf"), "-"),  # unknown is never $0.00
    (0, "$0.00"), (0.0, "$0.00"), (-0.0, "$0.00"), (-0.001 * 0, "$0.00"),
    (1.5, "$1.50"), (-1.5, "-$1.50"), (1234567.891, "$1,234,567.89"), (-1234.5, "-$1,234.50"),
    (0.01, "$0.01"), (0.0044, "$0.0044"), (-0.0044, "-$0.0044"), (0.00999, "$0.0100"),
    (0.00005, "$0.0001"), (0.0000042, "$0.0000"), (-0.0000042, "$0.0000"),  # 2 or 4 decimals, always
])
def test_edges(x, want):
    assert usd(x) == want


def test_beside_a_budget_the_digits_tell_them_apart():
    assert usd(5.0029, 5.0) == "$5.0029" and usd(5.0, 5.0) == "$5.00"  # equal amounts need no extra digits
    assert usd(5.2, 5.0) == "$5.20" and usd(4.9971, 5.0) == "$4.9971"


def test_fixed_places_and_prices_as_stated():
    assert usd(0.0029, places=4) == "$0.0029" and usd(2, places=4) == "$2.0000" and usd(-0.00001, places=2) == "$0.00"
    assert usd(1.006, up_to=4) == "$1.006" and usd(0.6, up_to=4) == "$0.60" and usd(0.4123, up_to=4) == "$0.4123"
    assert usd(12.34567, up_to=4) == "$12.3457" and usd(2, up_to=4) == "$2.00" and usd(0.0044, up_to=4) == "$0.0044"
    assert usd(None, up_to=4) == "-"


@given(st.floats(min_value=-1e7, max_value=1e7, allow_nan=False))
def test_an_amount_reads_as_zero_only_below_its_last_digit_and_is_within_its_rounding(x):
    text = usd(x)
    v = _value(text)
    places = len(text.rsplit(".", 1)[1])
    assert places in (2, 4), text
    if abs(x) >= 0.00005:
        assert v != 0 and (v < 0) == (x < 0), (x, text)
    else:
        assert text == "$0.0000" or x == 0, (x, text)
    assert abs(float(v) - x) <= 0.5 * 10 ** -places + 1e-9 * max(1.0, abs(x))


@settings(max_examples=300)
@given(st.lists(st.floats(min_value=0, max_value=1e5, allow_nan=False), min_size=1, max_size=12))
def test_the_shown_parts_always_add_up_to_the_shown_total(parts):
    total = math.fsum(parts)
    shown_total, shown = usd_parts(total, parts)
    assert len(shown) == len(parts)
    assert sum(_value(s) for s in shown) == _value(shown_total), (parts, shown_total, shown)
    # and each is its part, to the digits shown (or within the one unit the largest remainder moves)
    for s, x in zip(shown, parts):
        places = len(s.rsplit(".", 1)[1])
        assert abs(float(_value(s)) - x) <= 10 ** -places + 1e-9 * max(1.0, x), (x, s)


@given(st.lists(st.integers(min_value=0, max_value=10**7), min_size=1, max_size=8))
def test_whole_cents_stay_cents(cents):
    parts = [c / 100 for c in cents]
    shown_total, shown = usd_parts(math.fsum(parts), parts)
    if all(c >= 1 or c == 0 for c in cents):
        assert all(len(s.rsplit(".", 1)[1]) == 2 for s in [shown_total, *shown]), (shown_total, shown)


def test_a_budget_refusal_never_asks_for_less_than_the_worst_case():
    """check_budget said "worst case $5.00 ... exceeds the budget $5.00" and "raise budget_usd to at least $5.00"
    for a $5.0029 worst case: the amounts now differ as shown and the hint rounds up to the cent."""
    from broker.core.provider import NoValidPlan
    from broker.core.prose import cents_up
    from broker.money.accounting import check_budget

    with pytest.raises(NoValidPlan) as ei:
        check_budget(5.0029, 5.0, 5.0029)
    assert ei.value.message.startswith("worst case $5.0029 (1.00 h at $5.00/h) exceeds the budget $5.00")
    assert ei.value.hint.endswith("raise budget_usd to at least $5.01"), ei.value.hint
    assert cents_up(7.2) == 7.2 and cents_up(7.2001) == 7.21 and cents_up(0.000044) == 0.01
