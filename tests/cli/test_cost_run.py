"""`broker cost RUN`: the id a run's summary names (or a unique prefix, or `latest`) shows that run alone; it was
refused as an unexpected argument."""

from __future__ import annotations

import json
from datetime import timedelta

from typer.testing import CliRunner

from broker.cli.app import app
from broker.core.model import utcnow
from broker.money.ledger import Ledger
from broker.providers.fake import FakeProvider
from tests.support.watchdog_helpers import make_run, provision


def _two_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.setenv("BROKER_FAKE_STATE", str(tmp_path / "fake-cloud.json"))
    led = Ledger(tmp_path / "ledger.sqlite")
    now = utcnow()
    runs = []
    for rate in (1.0, 3.0):
        run = make_run(led, deadline=now + timedelta(hours=1), budget_usd=5.0)
        for r in provision(led, FakeProvider(), run, nodes=1, usd_per_hour=rate):
            led.update_resource(r.id, created_at=now - timedelta(hours=1))
        runs.append(run)
    led.close()
    return runs


def test_cost_of_one_run_by_id_or_prefix_shows_that_run_alone(tmp_path, monkeypatch):
    first, second = _two_runs(tmp_path, monkeypatch)
    for word in (first.id, first.id[:-2]):
        res = CliRunner().invoke(app, ["cost", word, "--json"])
        assert res.exit_code == 0, res.output
        data = json.loads(res.output)
        assert [r["run"] for r in data["runs"]] == [first.id]
        assert data["run_count"] == 1
        assert abs(data["runs"][0]["usd"] - 1.0) < 0.01
    res = CliRunner().invoke(app, ["cost", "--json"])
    assert {r["run"] for r in json.loads(res.output)["runs"]} == {first.id, second.id}


def test_cost_of_an_unknown_run_says_where_to_look(tmp_path, monkeypatch):
    _two_runs(tmp_path, monkeypatch)
    from broker.core.errors import BadInput

    res = CliRunner().invoke(app, ["cost", "nope"])
    assert isinstance(res.exception, BadInput) and "no run 'nope'" in str(res.exception)
