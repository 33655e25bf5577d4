"""`broker status` never calls a node switch a guard once its deadline + grace has passed while the machine still
bills: it says the switch should have fired and did not, and what ends the machine (`broker down RUN`).  A real
SQLite ledger and the real CLI."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta

from broker.core.model import utcnow
from broker.core.records import Run
from broker.money.accounting import WatchdogState, armed_layers, switch_overdue_s
from broker.money.ledger import Ledger
from tests.conftest import REPO, broker_cmd

RUN_ID = "20261206-000000-5a1c4e"


def _vast_run(home, *, deadline_ago_s: float, grace_s: float = 60.0):
    lg = Ledger(home / "ledger.sqlite")
    now = utcnow()
    lg.create_run(Run(id=RUN_ID, name="late", provider="vast", topology="simulated", status="running",
                      created_at=now - timedelta(hours=1), deadline=now - timedelta(seconds=deadline_ago_s),
                      run_dir=str(home / "runs" / RUN_ID), recipe={"max_hours": 0.5}))
    rid = lg.record_intent(RUN_ID, "vast", "instance", "node0", usd_per_hour=0.41,
                           deadline=now - timedelta(seconds=deadline_ago_s),
                           attrs={"deadman_grace_s": grace_s}).id
    lg.mark_created(rid, "4242", state="running")
    return lg, lg.resource(rid), lg.get_run(RUN_ID)


def test_a_switch_past_its_time_is_no_guard(broker_home):
    lg, res, run = _vast_run(broker_home, deadline_ago_s=600)
    assert 530 < switch_overdue_s(res, run) < 550
    assert armed_layers(res, run, WatchdogState())["node"] is False
    lg.close()


def test_a_switch_within_its_grace_still_guards(broker_home):
    lg, res, run = _vast_run(broker_home, deadline_ago_s=30)
    assert switch_overdue_s(res, run) is None
    assert armed_layers(res, run, WatchdogState())["node"] is True
    assert switch_overdue_s(res.model_copy(update={"state": "stopped"}), run) is None  # a stopped one: no switch
    lg.close()


def test_status_says_the_switch_should_have_fired(broker_home, cli_env):
    _vast_run(broker_home, deadline_ago_s=600)[0].close()
    r = subprocess.run(broker_cmd("status", RUN_ID, "--no-refresh"), cwd=REPO, env=dict(cli_env, COLUMNS="200"),
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "should have fired" in out and "did not" in out, out
    assert f"broker down {RUN_ID}" in out, out
    j = subprocess.run(broker_cmd("status", "--json", "--no-refresh"), cwd=REPO, env=cli_env, capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    live = json.loads(j.stdout)["live_resources"]
    assert live[0]["switch_overdue_s"] > 500 and live[0]["layers"]["node"] is False
