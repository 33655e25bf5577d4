"""Money truth against independent emulators: the provider's word beats broker's own belief.

* a DELETE answered ``{"success": true}`` whose instance stays is re-sent until the provider shows it gone, or the
  resource is named with its id, its $/h and the command that retries;
* (more below: the run's clock, the provider's rate, signals, create errors, the dead-man grace).

The Vast.ai adapter talks HTTP to tests/vast_emulator.py (no netns: the instances here need no host).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from broker.ledger import Ledger
from broker.model import Run, utcnow
from broker.teardown import terminate_resource
from tests.vast_emulator import API_KEY, VastEmulator


@pytest.fixture
def vast_env(tmp_path, monkeypatch):
    """An isolated broker home; ``start(**kw)`` runs a hostless VastEmulator and points the adapter at it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "broker"))
    monkeypatch.chdir(tmp_path)
    from broker.config import settings

    settings.cache_clear()
    started: list[VastEmulator] = []

    def start(**kw) -> VastEmulator:
        kw.setdefault("hostless", True)
        emu = VastEmulator(None, **kw)
        started.append(emu)
        monkeypatch.setenv("VAST_API_URL", emu.url)
        monkeypatch.setenv("VAST_API_KEY", API_KEY)
        settings.cache_clear()
        return emu

    try:
        yield start
    finally:
        for emu in started:
            emu.close()
        settings.cache_clear()


def _vast(**kw):
    from broker.providers.vast import VastProvider

    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("delete_timeout_s", 5.0)
    return VastProvider(**kw)


def _run(ledger: Ledger, tmp: Path, run_id: str = "20261201-120000-abcdef", hours: float = 1.0,
         budget: float = 5.0) -> Run:
    now = utcnow()
    run = Run(id=run_id, name="t", provider="vast", topology="simulated", status="running", created_at=now,
              deadline=now + timedelta(hours=hours), run_dir=str(tmp / "runs" / run_id), budget_usd=budget)
    Path(run.run_dir).mkdir(parents=True)
    return ledger.create_run(run)


def _instance_row(ledger: Ledger, run: Run, emu: VastEmulator, usd_per_hour: float = 0.4):
    from broker.providers.vast.lifecycle import make_label

    iid = emu.add_instance(make_label(run.id, 0, ledger.installation_id), age_s=60)
    res = ledger.record_intent(run.id, "vast", "instance", f"broker-{run.id}-n0", usd_per_hour=usd_per_hour,
                               deadline=run.deadline)
    ledger.mark_created(res.id, str(iid), state="running")
    return iid, ledger.resource(res.id)


# --------------------------------------------------------------------------------------------------- teardown
def test_a_delete_answered_success_whose_instance_stays_is_sent_again_until_gone(vast_env, tmp_path):
    emu = vast_env(lying_deletes=2)
    ledger = Ledger()
    run = _run(ledger, tmp_path)
    iid, res = _instance_row(ledger, run, emu)
    said: list[str] = []
    assert terminate_resource(ledger, res, "cli", provider=_vast(), confirm_timeout_s=20, poll_s=0.02,
                              say=said.append)
    assert iid not in emu.instances and iid in emu.destroyed
    assert emu.deletes_of(iid) == 3  # two accepted-but-ignored deletes, then the one that took
    assert ledger.resource(res.id).state == "terminated"
    assert any("re-sending until the provider shows it gone" in s for s in said), said


def test_an_instance_that_will_not_go_is_named_with_its_rate_and_the_retry_command(vast_env, tmp_path):
    emu = vast_env(lying_deletes=10_000)
    ledger = Ledger()
    run = _run(ledger, tmp_path)
    iid, res = _instance_row(ledger, run, emu, usd_per_hour=0.4123)
    said: list[str] = []
    assert not terminate_resource(ledger, res, "cli", provider=_vast(), confirm_timeout_s=1.0, poll_s=0.02,
                                  say=said.append)
    assert iid in emu.instances and emu.deletes_of(iid) >= 3  # re-sent with backoff, not polled silently
    row = ledger.resource(res.id)
    assert row.live and str(iid) in row.error and "$0.4123/h" in row.error
    assert f"`broker down {run.id}`" in row.error
    assert any(str(iid) in s and "$0.4123/h" in s for s in said)
