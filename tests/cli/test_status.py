"""`broker status` shows money (spent, worst case, time left) and the armed layers per run and live resource."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from broker.cli.app import app
from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.money.watchdog import Watchdog
from broker.providers.fake import FakeProvider
from tests.support.watchdog_helpers import make_run, provision


def _two_nodes(tmp_path, monkeypatch, *, width: int, usd_per_hour: float):
    """A ledger in ``tmp_path`` (the broker home) with a run of two fake instances at ``usd_per_hour`` each, the
    console ``width`` wide: (ledger, run, its resources, now)."""
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.setenv("BROKER_FAKE_STATE", str(tmp_path / "fake-cloud.json"))
    from broker.core import ui
    monkeypatch.setattr(ui.console, "_width", width)
    led = Ledger(tmp_path / "ledger.sqlite")
    now = utcnow()
    run = make_run(led, deadline=now + timedelta(hours=1), budget_usd=5.0, pid=os.getpid())
    return led, run, provision(led, FakeProvider(), run, nodes=2, usd_per_hour=usd_per_hour), now


@pytest.fixture
def setup(tmp_path, monkeypatch):
    led, run, rows, now = _two_nodes(tmp_path, monkeypatch, width=260, usd_per_hour=1.0)
    for r in rows:  # an hour old
        led.update_resource(r.id, created_at=now - timedelta(hours=1))
    led.update_resource(rows[0].id, attrs={"node_layer": "fake self-destroy at deadline +300 s"})
    led.update_resource(rows[1].id, error="fake: terminate failed: HTTP 500 (injected)")
    yield led, run, rows, tmp_path
    led.close()


def test_status_json_money_and_layers(setup):
    led, run, rows, home = setup
    Watchdog(led, providers={}, home=home).write_heartbeat()  # a live watchdog (this process)
    res = CliRunner().invoke(app, ["status", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["watchdog"]["alive"] and data["watchdog"]["pid"] == os.getpid()
    live = {r["id"]: r for r in data["live_resources"]}
    assert set(live) == {r.id for r in rows}
    for r in live.values():
        c = r["cost"]
        assert c["usd_per_hour"] == 1.0
        assert c["spent_usd"] == pytest.approx(1.0, abs=0.01)  # 1 h at $1/h
        assert c["worst_case_usd"] == pytest.approx(2.0, abs=0.01)  # created 1 h ago, deadline in 1 h
        assert 3500 < c["time_left_s"] <= 3600
    assert live[rows[0].id]["layers"] == {"cli": True, "watchdog": True, "node": True}
    assert live[rows[0].id]["node_layer"] == "fake self-destroy at deadline +300 s"
    assert live[rows[1].id]["layers"] == {"cli": True, "watchdog": True, "node": False}
    assert "HTTP 500" in live[rows[1].id]["error"]
    (r0,) = [r for r in data["runs"] if r["id"] == run.id]
    assert r0["cost"]["spent_usd"] == pytest.approx(2.0, abs=0.02)
    assert r0["cost"]["budget_usd"] == 5.0 and r0["cost"]["budget_left_usd"] == pytest.approx(3.0, abs=0.02)
    assert r0["cost"]["worst_case_usd"] == pytest.approx(4.0, abs=0.02)
    assert data["totals"]["usd_per_hour"] == 2.0 and data["totals"]["errors"] == 1


def test_status_without_watchdog_shows_it_unarmed(setup):
    led, run, rows, home = setup
    data = json.loads(CliRunner().invoke(app, ["status", "--json"]).output)
    assert not data["watchdog"]["alive"]
    assert all(r["layers"]["watchdog"] is False for r in data["live_resources"])
    led.update_run(run.id, status="interrupted")  # CLI no longer driving
    data = json.loads(CliRunner().invoke(app, ["status", "--json"]).output)
    assert all(r["layers"]["cli"] is False for r in data["live_resources"])


def test_status_table_and_detail_view(setup):
    led, run, rows, home = setup
    Watchdog(led, providers={}, home=home).write_heartbeat()
    res = CliRunner().invoke(app, ["status"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "spent / budget" in out and "$2.00 / $5.00" in out and "worst" in out
    assert "watchdog: running" in out and f"pid {os.getpid()}" in out
    assert rows[0].provider_id in out and "cli watchdog node" in out
    assert "HTTP 500 (injected)" in out and "1 failed terminate(s)" in out
    det = CliRunner().invoke(app, ["status", run.id])
    assert det.exit_code == 0, det.output
    assert "spent $2.00 of budget $5.00" in det.output and "intent" in det.output and rows[1].provider_id in det.output
    dj = json.loads(CliRunner().invoke(app, ["status", run.id, "--json"]).output)
    assert dj["run"]["id"] == run.id and dj["cost"]["spent_usd"] == pytest.approx(2.0, abs=0.02)
    assert {r["id"] for r in dj["resources"]} == {r.id for r in rows} and dj["events"]


def test_status_empty_ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    res = CliRunner().invoke(app, ["status"])
    assert res.exit_code == 0 and "no live resources" in res.output and "watchdog: not running" in res.output


# ------------------------------------------------------------------------------------ dead CLIs, settled runs
def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_status_refresh_marks_an_instance_the_provider_destroyed(setup):
    """The node's dead-man switch destroyed the instance: status must not keep showing it running and billing."""
    led, run, rows, home = setup
    fake = FakeProvider()
    fake.destroy(rows[0].provider_id)
    data = json.loads(CliRunner().invoke(app, ["status", "--json", "--no-refresh"]).output)
    assert rows[0].id in {r["id"] for r in data["live_resources"]}  # the ledger's view only
    data = json.loads(CliRunner().invoke(app, ["status", "--json"]).output)
    assert {r["id"] for r in data["live_resources"]} == {rows[1].id}
    row = led.resource(rows[0].id)
    assert row.state == "terminated" and row.terminated_by == "provider" and row.terminated_at is not None
    assert data["totals"]["usd_per_hour"] == 1.0


def test_sigkilled_cli_then_down_is_not_provisioning_with_time_left(setup):
    led, run, rows, home = setup
    led.update_run(run.id, status="provisioning", pid=_dead_pid())
    r = CliRunner().invoke(app, ["down", run.id])
    assert r.exit_code == 0, r.output
    after = led.get_run(run.id)
    assert after.status == "interrupted" and "broker down" in after.message
    data = json.loads(CliRunner().invoke(app, ["status", "--json"]).output)
    (r0,) = [r for r in data["runs"] if r["id"] == run.id]
    assert r0["status"] == "interrupted" and r0["cost"]["live"] == 0
    out = CliRunner().invoke(app, ["status"]).output
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(run.id))
    assert "interrupted" in line and "min" not in line  # no time left for an ended run


def test_status_settles_a_run_whose_cli_died(setup):
    led, run, rows, home = setup
    led.update_run(run.id, status="provisioning", pid=_dead_pid())
    data = json.loads(CliRunner().invoke(app, ["status", "--json", "--no-refresh"]).output)
    (r0,) = [r for r in data["runs"] if r["id"] == run.id]
    assert r0["status"] == "interrupted" and "died" in r0["message"]


def test_watchdog_deadline_is_kept_when_the_cli_then_reports_ssh_lost(setup):
    from tests.support.clock import FakeClock
    from broker.run.runrecord import end_run

    led, run, rows, home = setup
    clock = FakeClock()
    clock.advance(3700)  # past the 1 h deadline
    Watchdog(led, providers={"fake": FakeProvider()}, clock=clock, home=home).run_once()
    assert led.get_run(run.id).status == "deadline"
    end_run(led, run.id, None, status="failed", message="ssh connection lost")  # the CLI, moments later
    after = led.get_run(run.id)
    assert after.status == "deadline" and after.message.startswith("watchdog: deadline passed")
    assert "ssh connection lost" in after.message


def test_a_run_that_rented_nothing_shows_zero_spent(tmp_path, monkeypatch, fake_cloud):
    from pathlib import Path

    from tests.support.plans import rank_options
    from broker.core.model import Requirements
    from broker.core.provider import NoValidPlan
    from broker.money.provision import provision

    fake_cloud(tmp_path, tmp_path / "fake-cloud.json")
    monkeypatch.setenv("BROKER_FAKE_FAIL", "capacity@fake-zone-1,capacity@fake-zone-2")
    led = Ledger(tmp_path / "ledger.sqlite")
    run = make_run(led, pid=os.getpid())
    led.update_run(run.id, run_dir=str(tmp_path / "r"))
    Path(tmp_path / "r").mkdir()
    run = led.get_run(run.id)
    p = FakeProvider()
    req = Requirements(nodes=2, gpus_per_node=1, cpu_ok=True, topology="simulated", budget_usd=100, hours=1)
    with pytest.raises(NoValidPlan):
        provision(rank_options(p, req), run, req, led, providers={"fake": p}, poll_s=0.01, retry_wait_s=0.01)
    import time

    time.sleep(0.05)
    data = json.loads(CliRunner().invoke(app, ["status", "--json", "--no-refresh"]).output)
    (r0,) = [r for r in data["runs"] if r["id"] == run.id]
    assert led.resources(run.id) and r0["cost"]["spent_usd"] == 0.0


def test_status_is_readable_at_80_columns(setup, monkeypatch):
    from broker.core import ui
    led, run, rows, home = setup
    monkeypatch.setattr(ui.console, "_width", 80)
    out = CliRunner().invoke(app, ["status"]).output
    # tables fit in 80 columns; sentences are soft-wrapped by the terminal (never cut, copy-paste intact)
    assert all(len(line) <= 80 for line in out.splitlines() if line.startswith(" ")), out
    assert "…" not in out  # nothing cut: ids fold, hints wrap
    assert rows[0].provider_id in out.replace("\n", "") and "HTTP 500 (injected)" in out
    assert "broker down RUN" in out.replace("\n", " ")
    det = CliRunner().invoke(app, ["status", run.id]).output
    assert "…" not in det
    wide = CliRunner().invoke(app, ["status", "--wide"]).output
    assert "exit codes" in wide.replace("\n", " ") or "exit" in wide


def test_the_resources_spent_add_up_to_the_runs_as_printed(tmp_path, monkeypatch):
    """A preempted run's two instances cost $0.015 each: the table read $0.01 and $0.01 under "spent $0.03".
    The run's spent and its resources' are printed as parts that add up (4 decimals where cents would not)."""
    import re

    led, run, rows, now = _two_nodes(tmp_path, monkeypatch, width=200, usd_per_hour=0.9)
    for r in rows:  # 60 s each at $0.90/h: $0.015
        led.update_resource(r.id, created_at=now - timedelta(seconds=60), state="terminated", terminated_at=now)
    try:
        res = CliRunner().invoke(app, ["status", run.id, "--no-refresh"])
        assert res.exit_code == 0, res.output
        assert "spent $0.0300 of budget $5.00" in res.output, res.output
        shown = re.findall(r"terminated\s+\S+\s+(\$\d+\.\d+)\s+(\$\d+\.\d+)", res.output)
        assert shown == [("$0.0150", "$0.0150")] * 2, res.output  # spent, and worst (no more than spent)
    finally:
        led.close()


def test_a_heartbeat_a_moment_ahead_reads_as_just_now():
    """`last pass passed 1 s ago ago`: a heartbeat written a moment after status read the clock."""
    from broker.cli.status import _watchdog_line

    line = _watchdog_line({"alive": True, "pid": 42, "age_s": -0.8, "errors": {}})
    assert "ago ago" not in line and "passed" not in line and "last pass 0 s ago" in line
    dead = _watchdog_line({"alive": False, "pid": 42, "age_s": -3, "errors": {}})
    assert "ago ago" not in dead and "last seen 0 s ago" in dead
