"""Cost rules (broker.plan.pricing): exact numbers, and the budget inverse never overshoots."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.plan import pricing
from broker.core.model import Offer

T0 = datetime(2026, 11, 29, tzinfo=timezone.utc)


def offer(provider="vast", usd=0.33, storage=0.15, min_billed=0.0, **kw) -> Offer:
    return Offer(provider=provider, offer_id=kw.pop("offer_id", "x"), instance_type=kw.pop("instance_type", "2x RTX 3090"),
                 gpu_name="RTX 3090", gpu_count=2, gpu_mem_gib=24.0, usd_per_hour=usd,
                 storage_usd_per_gib_month=storage, min_billed_seconds=min_billed, price_source="test", price_time=T0,
                 **kw)


def test_billed_seconds_rounds_up_per_second_with_minimum():
    assert pricing.billed_seconds(3600, 60) == 3600
    assert pricing.billed_seconds(10, 60) == 60
    assert pricing.billed_seconds(10.2, 0) == 11
    assert pricing.billed_seconds(3599.9999999, 0) == 3600  # float noise is not a billed second
    assert pricing.billed_seconds(0, 0) == 0


def test_storage_per_hour_uses_730_hours_per_month():
    assert pricing.storage_usd_per_hour(0.15, 40) == pytest.approx(0.15 * 40 / 730, abs=1e-15)
    assert pricing.storage_usd_per_hour(0.0, 100) == 0.0


def test_setup_allowance_per_provider():
    assert pricing.setup_allowance_seconds("vast") == 600
    assert pricing.setup_allowance_seconds("oci") == 900
    assert pricing.setup_allowance_seconds("aws") == 600
    assert pricing.setup_allowance_seconds("local") == 0
    assert pricing.setup_allowance_seconds("other") == pricing.DEFAULT_SETUP_ALLOWANCE_SECONDS


def test_worst_case_vast_host_one_hour_with_storage_and_allowance():
    # 0.33 $/h + 40 GiB x 0.15 $/GiB/month / 730 h, billed 1 h + 10 min allowance = 4200 s
    got = pricing.worst_case_usd(offer(), hours=1.0, disk_gib=40)
    assert got == pytest.approx(0.385 + 7 / 730, abs=1e-12)  # 0.39458904...


def test_worst_case_two_aws_units():
    g4 = offer("aws", usd=0.526, storage=0.08, min_billed=60, instance_type="g4dn.xlarge")
    got = pricing.worst_case_usd([g4, g4], hours=1.0, disk_gib=40)
    assert got == pytest.approx(2 * (0.526 + 0.08 * 40 / 730) * 4200 / 3600, abs=1e-12)  # 1.23756...


def test_minimum_billed_time_applies():
    oci = offer("oci", usd=2.0, storage=0.0, min_billed=60)
    # 3.6 s of job, no allowance: one minute billed
    assert pricing.worst_case_usd(oci, hours=0.001, allowance_seconds=0) == pytest.approx(2.0 / 60, abs=1e-12)


def test_max_hours_within_exact_seconds():
    # rate 0.338219... $/h: 5 $ buys 53219 whole seconds, minus the 600 s allowance
    assert pricing.max_hours_within(5.0, offer(), disk_gib=40) == pytest.approx(52619 / 3600, abs=1e-12)
    g4 = offer("aws", usd=0.526, storage=0.08, min_billed=60)
    assert pricing.max_hours_within(5.0, [g4, g4], disk_gib=40) == pytest.approx(16368 / 3600, abs=1e-12)


def test_max_hours_free_and_unaffordable():
    assert pricing.max_hours_within(5.0, offer("local", usd=0.0, storage=0.0)) == math.inf
    # 100 $/h with a 10 min allowance: 5 $ does not cover the setup
    assert pricing.max_hours_within(5.0, offer(usd=100.0)) == 0.0
    assert pricing.max_billed_seconds(0.01, 1, 100.0, 60) == -1


def test_mixed_units_binary_search_matches_worst_case():
    a, b = offer(usd=1.0, min_billed=0), offer(usd=2.0, min_billed=600, offer_id="y")
    h = pricing.max_hours_within(3.0, [a, b], allowance_seconds=0)
    assert pricing.worst_case_usd([a, b], h, allowance_seconds=0) <= 3.0
    assert pricing.worst_case_usd([a, b], h + 1 / 3600, allowance_seconds=0) > 3.0


@settings(max_examples=200, deadline=None)
@given(budget=st.floats(0.01, 500), usd=st.floats(0.01, 100), storage=st.floats(0, 0.5),
       count=st.integers(1, 8), min_billed=st.sampled_from([0, 1, 60]), disk=st.floats(0, 500),
       provider=st.sampled_from(["vast", "oci", "aws"]))
def test_budget_inverse_is_tight_and_never_overshoots(budget, usd, storage, count, min_billed, disk, provider):
    units = [offer(provider, usd=usd, storage=storage, min_billed=min_billed)] * count
    h = pricing.max_hours_within(budget, units, disk_gib=disk)
    if h > 0:
        assert pricing.worst_case_usd(units, h, disk_gib=disk) <= budget
        assert pricing.worst_case_usd(units, h + 1 / 3600, disk_gib=disk) > budget
    else:  # not even the allowance fits (or exactly nothing is left for the job)
        assert pricing.worst_case_usd(units, 1 / 3600, disk_gib=disk) > budget
