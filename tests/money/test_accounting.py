"""Budget accounting: spent so far, worst case at the deadline, time left, budget refusal, armed layers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.money.accounting import (armed_layers, check_budget, node_layer, pid_alive, resource_cost, run_cost,
                                     watchdog_state)
from tests.support.clock import FakeClock
from broker.core.model import utcnow
from broker.core.records import Resource, Run
from broker.core.provider import NoValidPlan

T0 = utcnow().replace(microsecond=0)


def res(**kw) -> Resource:
    base = dict(id="r-1", run_id="run-1", provider="fake", kind="instance", name="n0", provider_id="i-1",
                state="running", usd_per_hour=2.0, created_at=T0)
    base.update(kw)
    return Resource(**base)


def run(**kw) -> Run:
    base = dict(id="run-1", name="t", provider="fake", status="running", created_at=T0,
                deadline=T0 + timedelta(hours=2), budget_usd=5.0)
    base.update(kw)
    return Run(**base)


def test_resource_cost_per_second_from_creation():
    c = resource_cost(res(), run(), T0 + timedelta(minutes=30))
    assert c.usd_per_hour == 2.0 and c.age_s == 1800
    assert c.spent_usd == pytest.approx(1.0)
    assert c.worst_case_usd == pytest.approx(4.0)  # 2 h at $2/h
    assert c.time_left_s == pytest.approx(1.5 * 3600)
    assert resource_cost(res(), run(), T0 + timedelta(seconds=1)).spent_usd == pytest.approx(2.0 / 3600)


def test_own_deadline_wins_and_terminated_stops_billing():
    r = res(deadline=T0 + timedelta(hours=1))
    assert resource_cost(r, run(), T0).worst_case_usd == pytest.approx(2.0)
    t = res(state="terminated", terminated_at=T0 + timedelta(minutes=15))
    c = resource_cost(t, run(), T0 + timedelta(hours=5))
    assert c.spent_usd == pytest.approx(0.5) and c.worst_case_usd == pytest.approx(0.5) and c.time_left_s is None


def test_storage_is_inside_usd_per_hour_and_not_added_twice():
    # provisioning records usd_per_hour = compute + storage and shows the storage part in attrs
    c = resource_cost(res(usd_per_hour=2.5, attrs={"storage_usd_per_hour": 0.5}), run(), T0 + timedelta(hours=1))
    assert c.usd_per_hour == 2.5 and c.spent_usd == pytest.approx(2.5)


def test_minimum_billed_seconds_once_created():
    r = res(usd_per_hour=3600.0, attrs={"min_billed_seconds": 60})  # $1 per second
    assert resource_cost(r, run(), T0 + timedelta(seconds=10)).spent_usd == pytest.approx(60.0)
    assert resource_cost(r, run(), T0 + timedelta(seconds=90)).spent_usd == pytest.approx(90.0)
    intent = res(provider_id=None, usd_per_hour=3600.0, attrs={"min_billed_seconds": 60})
    assert resource_cost(intent, run(), T0 + timedelta(seconds=10)).spent_usd == pytest.approx(10.0)


def test_run_cost_sums_live_and_terminated_and_budget_left():
    rows = [res(id="a"), res(id="b", usd_per_hour=1.0, state="terminated", terminated_at=T0 + timedelta(hours=1)),
            res(id="v", kind="volume", usd_per_hour=0.1)]
    rc = run_cost(run(), rows, T0 + timedelta(hours=1))
    assert rc.spent_usd == pytest.approx(2.0 + 1.0 + 0.1)
    assert rc.usd_per_hour == pytest.approx(2.1) and rc.live == 2
    assert rc.worst_case_usd == pytest.approx(4.0 + 1.0 + 0.2)
    assert rc.budget_left_usd == pytest.approx(5.0 - 3.1)
    assert rc.time_left_s == pytest.approx(3600)
    unbounded = run_cost(run(deadline=None), [res()], T0)
    assert unbounded.worst_case_usd is None and unbounded.deadline is None


@settings(max_examples=60, deadline=None)
@given(usd=st.floats(0, 500), minutes=st.floats(0, 600), dl_minutes=st.floats(1, 600))
def test_spent_never_exceeds_worst_case_before_the_deadline(usd, minutes, dl_minutes):
    r = run(deadline=T0 + timedelta(minutes=dl_minutes))
    now = T0 + timedelta(minutes=min(minutes, dl_minutes))
    c = resource_cost(res(usd_per_hour=usd), r, now)
    assert c.spent_usd <= c.worst_case_usd + 1e-9
    assert c.time_left_s >= -1e-6


def test_check_budget_fits_returns_none():
    assert check_budget(4.99, 5.0, 4.99) is None
    assert check_budget(100.0, None, 100.0) is None


def test_check_budget_refuses_and_says_what_fits():
    with pytest.raises(NoValidPlan) as ei:
        check_budget(7.20, 5.0, 7.20)
    e = ei.value
    assert e.exit_code == 3
    assert e.message == "worst case $7.20 (1.00 h at $7.20/h) exceeds the budget $5.00; at most 0.69 h fits"
    assert e.hint == "set max_hours: 0.69 or raise budget_usd to at least $7.20"
    with pytest.raises(NoValidPlan) as ei:
        check_budget(7.20, 0.05, 7.20)
    assert "not even 0.01 h fits" in ei.value.message


def test_fake_clock():
    c = FakeClock(T0)
    assert c() == T0 and c.advance(90) == T0 + timedelta(seconds=90) and c() == T0 + timedelta(seconds=90)


def test_pid_alive_sees_exited_and_zombie_processes_as_dead():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pid_alive(p.pid) and time.monotonic() < deadline:  # a zombie until reaped: still "dead"
            time.sleep(0.05)
        assert not pid_alive(p.pid)
    finally:
        p.kill()
        p.wait(timeout=10)
    assert not pid_alive(p.pid) and not pid_alive(None) and not pid_alive(0)


def test_node_layer_recorded_or_per_provider(monkeypatch):
    monkeypatch.delenv("OCI_INSTANCE_PRINCIPAL", raising=False)
    assert node_layer(res(), run()) is None  # fake: no node-side switch
    assert node_layer(res(attrs={"deadman": True}), run()) == "dead-man switch"
    assert node_layer(res(provider="vast", attrs={"node_layer": "vast self-destroy at deadline +300 s"}), run()) \
        == "vast self-destroy at deadline +300 s"
    assert node_layer(res(provider="vast", attrs={"deadman": False}), run()) is None
    assert "Vast API" in node_layer(res(provider="vast"), run())
    assert node_layer(res(provider="vast"), run(deadline=None)) is None  # armed only with a deadline
    assert "InstanceInitiatedShutdownBehavior=terminate" in node_layer(res(provider="aws"), run())
    assert node_layer(res(provider="aws", kind="vpc"), run()) is None
    assert node_layer(res(provider="oci"), run()) is None  # no instance principal: cli + watchdog only
    assert "instance principal" in node_layer(res(provider="oci", attrs={"instance_principal": True}), run())


def test_armed_layers(tmp_path):
    now = utcnow()
    from broker.core.procid import record
    from broker.money.ledger import Ledger

    lg = Ledger(tmp_path / "ledger.sqlite")  # a heartbeat counts for the home whose ledger its last pass read
    (tmp_path / "watchdog.json").write_text(json.dumps(
        {"pid": os.getpid(), "pid_start": record().start, "installation_id": lg.installation_id,
         "heartbeat_at": now.isoformat(), "interval_s": 5, "started_at": now.isoformat()}))
    lg.close()
    wd = watchdog_state(now + timedelta(seconds=3), home=tmp_path)
    assert wd.alive and wd.age_s == pytest.approx(3)
    assert armed_layers(res(attrs={"deadman": True}), run(pid=os.getpid()), wd) == \
        {"cli": True, "watchdog": True, "node": True}
    assert armed_layers(res(), run(pid=os.getpid(), status="succeeded"), wd)["cli"] is False
    stale = watchdog_state(now + timedelta(hours=1), home=tmp_path)
    assert not stale.alive
    assert armed_layers(res(), run(pid=None), stale) == {"cli": False, "watchdog": False, "node": False}
    assert not watchdog_state(now, home=tmp_path / "nothing").alive
