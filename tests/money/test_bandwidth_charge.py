"""Bandwidth billed per GB (Vast.ai's ``inet_*_cost``): the bytes a run staged and collected are charged at the
rates its ledger rows carry, into the row's banked money, so the run's spent, worst case and the SQL totals of
``broker cost`` all include them (real SQLite ledger)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from broker.core.model import utcnow
from broker.core.records import Run
from broker.money.accounting import run_cost
from broker.money.cost import charge_transfer
from broker.money.ledger import Ledger


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    return Ledger()


def _run(ledger: Ledger, tmp: Path) -> Run:
    now = utcnow()
    run = Run(id="20261201-120000-bwbwbw", name="t", provider="vast", topology="simulated", status="running",
              created_at=now, deadline=now + timedelta(hours=1), run_dir=str(tmp / "run"), budget_usd=5.0)
    Path(run.run_dir).mkdir(parents=True)
    return ledger.create_run(run)


def test_staged_and_collected_bytes_are_charged_at_the_rows_rates(ledger, tmp_path):
    run = _run(ledger, tmp_path)
    res = ledger.record_intent(run.id, "vast", "instance", f"broker-{run.id}-n0", usd_per_hour=0.40,
                               deadline=run.deadline, attrs={"transfer_in_usd_per_gb": 0.02,
                                                             "transfer_out_usd_per_gb": 0.05})
    ledger.mark_created(res.id, "31337", state="running")
    now = utcnow()
    before = run_cost(ledger.get_run(run.id), ledger.resources(run.id), now)
    said: list[str] = []
    usd = charge_transfer(ledger, run.id, 50 * 10**9, 10 * 10**9, actor="cli", say=said.append, now=now)
    assert usd == pytest.approx(50 * 0.02 + 10 * 0.05)
    after = run_cost(ledger.get_run(run.id), ledger.resources(run.id), now)
    assert after.spent_usd == pytest.approx(before.spent_usd + 1.5)
    assert after.worst_case_usd == pytest.approx(before.worst_case_usd + 1.5, abs=1e-3)
    [row] = ledger.run_costs(now, run_id=run.id)
    assert row["usd"] == pytest.approx(after.spent_usd)  # broker cost's SQL sum agrees
    assert said and "$1.5" in said[0]


def test_rows_without_rates_are_not_charged(ledger, tmp_path):
    run = _run(ledger, tmp_path)
    res = ledger.record_intent(run.id, "aws", "instance", f"broker-{run.id}-n0", usd_per_hour=1.0,
                               deadline=run.deadline)
    ledger.mark_created(res.id, "i-0abc", state="running")
    assert charge_transfer(ledger, run.id, 10**9, 10**9, actor="cli") == 0.0
    assert ledger.resource(res.id).banked_usd == 0.0


def test_the_pipeline_charges_what_the_executor_moved_and_never_fails_on_it(ledger, tmp_path):
    from types import SimpleNamespace

    from broker.run.pipeline import _charge_bandwidth
    from broker.run.runrecord import Context, Hooks

    run = _run(ledger, tmp_path)
    res = ledger.record_intent(run.id, "vast", "instance", f"broker-{run.id}-n0", usd_per_hour=0.40,
                               deadline=run.deadline, attrs={"transfer_in_usd_per_gb": 0.02})
    ledger.mark_created(res.id, "31337", state="running")
    said: list[str] = []
    ctx = Context(ledger=ledger, hooks=Hooks(say=said.append))
    inner = SimpleNamespace(bytes_in=2 * 10**9, bytes_out=0)  # what the SSH executor counted while staging
    wrapper = SimpleNamespace(inner=inner, bytes_in=0, bytes_out=10**9)  # checkpoint copies fetched meanwhile
    _charge_bandwidth(ctx, run.id, wrapper)
    assert ledger.resource(res.id).banked_usd >= 0.04 and any("2 GB staged and 1 GB collected" in s for s in said)

    class Broken:
        def resources(self, run_id):
            raise OSError("disk full")

    _charge_bandwidth(Context(ledger=Broken(), hooks=Hooks()), run.id, inner)  # logged, not raised


def test_provision_records_the_offers_transfer_rates(tmp_path, fake_cloud):
    from dataclasses import replace

    from broker.core.model import Requirements
    from broker.money.provision import provision
    from broker.providers.fake import FakeProvider
    from tests.money.test_create_errors import _run as fake_run
    from tests.support.plans import rank_options

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    p = FakeProvider()
    req = Requirements(nodes=1, gpus_per_node=1, cpu_ok=True, topology="simulated", budget_usd=100, hours=1)
    opt = [o for o in rank_options(p, req) if o.topology.value == "simulated"][0]
    rated = replace(opt.offers[0], attrs={**opt.offers[0].attrs, "transfer_in_usd_per_gb": 0.02,
                                          "transfer_out_usd_per_gb": 0.05})
    opt = replace(opt, offers=[rated] * len(opt.offers))
    led = Ledger()
    provision([opt], fake_run(led, tmp_path, "fake"), Requirements(), led, providers={"fake": p}, poll_s=0.02,
              retry_wait_s=0.01, terminate_timeout_s=5)
    [row] = [r for r in led.resources() if r.kind == "instance"]
    assert (row.attrs["transfer_in_usd_per_gb"], row.attrs["transfer_out_usd_per_gb"]) == (0.02, 0.05)
