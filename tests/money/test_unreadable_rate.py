"""A provider rate broker cannot read is unknown, never the planned price: a Vast instance row's ``dph_total`` as
a string ("24.7200", 60x the plan: read as the provider's number and judged against the budget), as text, negative,
NaN or missing (unknown: said, and the budget guard takes the worst case, so the run stops and tears down).
Against the project's Vast API emulator with the real adapter."""

from __future__ import annotations

import pytest

from broker.money.ledger import Ledger
from tests.money.test_money_truth import _req, _run, _vast, _vast_options, vast_env  # noqa: F401 - the fixture
from tests.support.vast_emulator import offer_row


def _provision(vast_env, tmp_path, dph_as, budget=0.50):  # noqa: F811 - the fixture
    from broker.money.provision import provision

    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.41)], boot_s=0.4, dph_as=dph_as)
    ledger = Ledger()
    p = _vast()
    run = _run(ledger, tmp_path, budget=budget)
    said: list[str] = []
    try:
        out = provision(_vast_options(p, budget=max(budget, 0.5), at_least=1)[:1], run, _req(), ledger,
                        providers={"vast": p}, poll_s=0.05, retry_wait_s=0.01, terminate_timeout_s=10,
                        progress=said.append)
        err = None
    except Exception as e:  # noqa: BLE001
        out, err = None, e
    return emu, ledger, run, said, out, err


def test_a_rate_sent_as_a_decimal_string_is_the_providers_number_and_stops_a_run_it_breaks(vast_env, tmp_path):  # noqa: F811
    from broker.money.cost import RateAboveBudget, run_spent_usd

    emu, ledger, run, _said, _out, err = _provision(vast_env, tmp_path, lambda v: "24.7200")
    assert isinstance(err, RateAboveBudget), err
    assert "$24.72/h" in err.message and "$0.41" in err.message and "budget $0.50" in err.message, err.message
    assert emu.instances == {}  # torn down
    (row,) = ledger.resources(run.id)
    assert row.state == "terminated" and row.usd_per_hour == pytest.approx(24.72)
    age_h = (row.terminated_at - row.created_at).total_seconds() / 3600
    assert run_spent_usd(ledger, run.id) >= 24.72 * age_h * 0.999  # counted at the provider's rate


@pytest.mark.parametrize("raw,why", [("n/a", "'n/a' is not a number"), (-1, "-1 is not a price"),
                                     (float("nan"), "nan is not a price"), (..., "has no dph_total")])
def test_an_unreadable_or_missing_rate_is_unknown_said_and_stops_a_run_with_a_budget(vast_env, tmp_path, raw, why):  # noqa: F811
    from broker.money.cost import RateAboveBudget

    emu, ledger, run, _said, _out, err = _provision(vast_env, tmp_path, lambda v: raw)
    assert isinstance(err, RateAboveBudget), err
    assert why in err.message and "unknown" in err.message and "cannot be shown to fit its budget $0.50" in \
        err.message, err.message
    assert "not the planned $0.41/h" in err.message
    assert emu.instances == {}
    (row,) = ledger.resources(run.id)
    assert row.state == "terminated" and why in row.attrs["rate_unknown"]


def test_the_record_reads_every_adapters_rate_the_same_way():
    from broker.core.records import InstanceInfo, TaggedResource, read_rate

    assert read_rate("24.7200") == (24.72, None) and read_rate(0.41) == (0.41, None) and read_rate(None) == (None,
                                                                                                            None)
    for bad in ("1e3", "24,72", "", True, float("inf"), -0.5, [1]):
        assert read_rate(bad)[0] is None and read_rate(bad)[1], bad
    i = InstanceInfo(provider_id="1", state="running", usd_per_hour=float("nan"))
    assert i.usd_per_hour is None and i.rate_unreadable == "nan is not a price"
    t = TaggedResource(provider="x", kind="instance", provider_id="1", run_id=None, usd_per_hour="abc")
    assert t.usd_per_hour is None and "not a number" in t.rate_unreadable


def test_the_watchdog_stops_an_instance_whose_rate_it_cannot_read_when_the_run_has_a_budget(vast_env, tmp_path):  # noqa: F811
    """The CLI died before it saw the rate: the watchdog's scan reads a ``dph_total`` it cannot read, records it as
    unknown (said once) and its budget rule stops the instance: the budget cannot be shown to hold."""
    from datetime import timedelta

    from broker.core.model import utcnow
    from broker.money.watchdog import Watchdog
    from tests.money.test_money_truth import _instance_row

    emu = vast_env(dph_as=lambda v: "call us")
    ledger = Ledger()
    run = _run(ledger, tmp_path, budget=50.0)
    iid, res = _instance_row(ledger, run, emu, usd_per_hour=0.40)
    ledger.update_resource(res.id, created_at=utcnow() - timedelta(minutes=2))
    w = Watchdog(ledger, providers={"vast": _vast()}, orphan_scan_s=0, confirm_timeout_s=5, home=tmp_path / "wd")
    acts = w.run_once() + w.run_once()
    row = ledger.resource(res.id)
    assert row.attrs["rate_unknown"] == "'call us' is not a number"
    assert any(a.kind == "terminate" and "cannot be shown to hold" in a.reason for a in acts), acts
    assert iid not in emu.instances and row.state == "terminated"


def test_an_orphan_whose_rate_cannot_be_read_is_recorded_as_unknown(vast_env, tmp_path):  # noqa: F811
    from broker.money.watchdog import Watchdog
    from broker.providers.vast.lifecycle import make_label

    emu = vast_env(dph_as=lambda v: ...)  # no dph_total at all
    ledger = Ledger()
    emu.add_instance(make_label("20261201-000000-deadbe", 0, ledger.installation_id), age_s=60)
    w = Watchdog(ledger, providers={"vast": _vast()}, orphan_scan_s=0, confirm_timeout_s=5, home=tmp_path / "wd")
    w.run_once()
    (row,) = [r for r in ledger.resources("20261201-000000-deadbe")]
    assert row.attrs["orphan"] is True and row.attrs["rate_unknown"] == "the instance row has no dph_total"
