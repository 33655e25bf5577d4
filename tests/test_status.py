"""`broker status` shows money (spent, worst case, time left) and the armed layers per run and live resource."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from broker.cli import app
from broker.ledger import Ledger
from broker.model import utcnow
from broker.watchdog import Watchdog
from broker.providers.fake import FakeProvider
from test_watchdog_helpers import make_run, provision


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.setenv("BROKER_FAKE_STATE", str(tmp_path / "fake-cloud.json"))
    from broker import ui

    monkeypatch.setattr(ui.console, "_width", 260)
    led = Ledger(tmp_path / "ledger.sqlite")
    now = utcnow()
    run = make_run(led, deadline=now + timedelta(hours=1), budget_usd=5.0, pid=os.getpid())
    rows = provision(led, FakeProvider(), run, nodes=2, usd_per_hour=1.0)
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
    assert "spent / budget" in out and "$2.00 / $5.00" in out and "worst case" in out
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
