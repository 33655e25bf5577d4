"""Watchdog passes driven by a fake clock (in-process): deadline, budget, ended runs, dead CLIs, idle stop,
orphans, restart safety, provider errors, the lock and the node-side idle watch script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.clock import FakeClock
from broker.core.model import Requirements
from broker.core.provider import ProviderError
from broker.core.records import NodeRequest
from broker.money.watchdog import Watchdog, WatchdogBusy, WatchdogLock, idle_watch_script
from tests.support.watchdog_helpers import CountingFake, make_run, provision


@pytest.fixture
def home(fake_cloud_home):
    return fake_cloud_home


@pytest.fixture
def ledger(home, tmp_ledger):
    return tmp_ledger  # home / "ledger.sqlite"


@pytest.fixture
def fake(home):
    return CountingFake(home / "fake-cloud.json")


def wd(ledger, fake, clock, **kw):
    kw.setdefault("orphan_scan_s", 0)
    return Watchdog(ledger, providers={"fake": fake}, clock=clock, interval_s=5, home=ledger.path.parent, **kw)


def one_node_past_deadline(ledger, fake):
    """(clock, run, rows): a run with a 10 s deadline and one node on ``fake``, the clock 11 s later."""
    clock = FakeClock()
    run = make_run(ledger, deadline_s=10, now=clock())
    rows = provision(ledger, fake, run, nodes=1)
    clock.advance(11)
    return clock, run, rows


def watchdog_events(ledger, run_id, action=None):
    return [e for e in ledger.events(run_id) if e["actor"] == "watchdog" and (action is None or e["action"] == action)]


def test_deadline_terminates_every_resource_and_logs_who_and_why(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=3600, now=clock())
    rows = provision(ledger, fake, run, nodes=2)
    w = wd(ledger, fake, clock)
    assert w.run_once() == []
    clock.advance(3599)
    assert [a for a in w.run_once() if a.kind == "terminate"] == []
    clock.advance(13)  # 12 s past the deadline
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert {a.resource_id for a in acts} == {r.id for r in rows} and all(a.ok for a in acts)
    assert all("deadline passed 12 s ago" in a.reason for a in acts)
    for r in rows:
        after = ledger.resource(r.id)
        assert after.state == "terminated" and after.terminated_by == "watchdog" and after.terminated_at
        assert fake.instances()[r.provider_id]["state"] == "terminated"
    term = watchdog_events(ledger, run.id, "terminated")
    assert {e["resource_id"] for e in term} == {r.id for r in rows}
    assert any("deadline passed 12 s ago" in (e["message"] or "") for e in watchdog_events(ledger, run.id, "terminate"))
    assert ledger.get_run(run.id).status == "deadline"
    # nothing left: further passes do nothing and never call terminate again
    assert w.run_once() == []
    assert fake.terminate_calls == {r.provider_id: 1 for r in rows}


def test_budget_crossed_terminates_run(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=10 * 3600, budget_usd=5.0, now=clock())
    rows = provision(ledger, fake, run, nodes=2, usd_per_hour=1.0)  # $2/h together
    w = wd(ledger, fake, clock)
    clock.advance(2 * 3600)  # $4 spent
    assert [a for a in w.run_once() if a.kind == "terminate"] == []
    clock.advance(0.5 * 3600 + 18)  # $5.01 spent
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert len(acts) == 2 and all(a.reason == "budget $5.00 reached: spent $5.01" for a in acts)
    assert all(ledger.resource(r.id).state == "terminated" for r in rows)
    run_after = ledger.get_run(run.id)
    assert run_after.status == "interrupted" and "budget $5.00 reached" in run_after.message


def test_budget_lookahead_stops_before_the_next_pass_would_overspend(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=10 * 3600, budget_usd=1.0, now=clock())
    provision(ledger, fake, run, nodes=1, usd_per_hour=3600.0)  # $1 per second
    w = wd(ledger, fake, clock)  # interval 5 s
    clock.advance(0.5)  # $0.50 spent, $5 more before the next pass
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert len(acts) == 1 and "would be reached before the next pass" in acts[0].reason


def test_ended_run_with_live_resource_is_cleaned_after_grace(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=3600, now=clock())
    rows = provision(ledger, fake, run, nodes=2)
    ledger.update_run(run.id, status="succeeded", ended_at=clock())
    # the CLI's teardown got one of the two
    ledger.claim_termination(rows[0].id, "cli")
    # the event says what is being deleted (it had no message: `cli terminating` and nothing after it)
    (ev,) = [e for e in ledger.events(run.id) if e["action"] == "terminating"]
    assert ev["message"] == f"deleting fake instance {rows[0].provider_id} (was running)", ev
    fake.terminate("instance", rows[0].provider_id)
    ledger.update_resource(rows[0].id, state="terminated", terminated_by="cli", actor="cli")
    w = wd(ledger, fake, clock, ended_grace_s=120)
    clock.advance(60)
    assert [a for a in w.run_once() if a.kind == "terminate"] == []
    clock.advance(61)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert [a.resource_id for a in acts] == [rows[1].id]
    assert "run succeeded 121 s ago but this resource is still live" in acts[0].reason
    assert ledger.resource(rows[1].id).terminated_by == "watchdog"
    assert ledger.resource(rows[0].id).terminated_by == "cli"
    assert fake.terminate_calls == {rows[0].provider_id: 1, rows[1].provider_id: 1}


def test_dead_cli_marks_run_interrupted_then_terminates_after_grace(ledger, fake):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    clock = FakeClock()
    run = make_run(ledger, deadline_s=3600, pid=dead.pid, now=clock())
    alive_run = make_run(ledger, deadline_s=3600, pid=os.getpid(), now=clock())
    rows = provision(ledger, fake, run, nodes=2)
    other = provision(ledger, fake, alive_run, nodes=1)
    w = wd(ledger, fake, clock, ended_grace_s=120)
    acts = w.run_once()
    assert [a.kind for a in acts] == ["cli-dead"] and acts[0].run_id == run.id
    r = ledger.get_run(run.id)
    assert r.status == "interrupted" and f"pid {dead.pid}" in r.message
    assert ledger.get_run(alive_run.id).status == "running"
    assert watchdog_events(ledger, run.id, "cli-dead")
    clock.advance(121)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert {a.resource_id for a in acts} == {x.id for x in rows}
    assert ledger.resource(other[0].id).state == "running"  # its CLI is alive


def test_idle_minutes_keeps_the_node_for_the_idle_time_after_the_job(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=3600, now=clock())
    rows = provision(ledger, fake, run, nodes=1, attrs={"idle_minutes": 5})
    ledger.update_run(run.id, status="succeeded", ended_at=clock())
    w = wd(ledger, fake, clock, ended_grace_s=120)
    clock.advance(200)  # past the ordinary grace, inside the idle time
    assert [a for a in w.run_once() if a.kind == "terminate"] == []
    clock.advance(101)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert len(acts) == 1 and acts[0].reason == "idle 5 min after the job ended (succeeded)"
    assert ledger.resource(rows[0].id).state == "terminated"


def _create_tagged(fake, run_id, name, token, installation_id=None):
    """A tagged fake instance; ``installation_id`` defaults to the test's BROKER_HOME ledger's (this installation)."""
    if installation_id is None:
        from broker.money.ledger import Ledger

        installation_id = Ledger().installation_id
    offer = fake.offers(Requirements())[0]
    return fake.create_instance(NodeRequest(run_id=run_id, node_index=0, name=name, offer=offer,
                                            ssh_public_key="k", client_token=token, installation_id=installation_id))


def test_orphan_recorded_on_first_sight_and_terminated_after_grace(ledger, fake):
    clock = FakeClock()
    orphan_id = _create_tagged(fake, "run-lost", "broker-run-lost-n0", "tok-1")
    w = wd(ledger, fake, clock, orphan_grace_s=600)
    acts = w.run_once()
    assert [a.kind for a in acts] == ["orphan-found"]
    row = ledger.find_by_provider_id("fake", orphan_id)
    assert row.state == "orphan" and row.run_id == "run-lost" and row.attrs["orphan_first_seen"]
    assert row.usd_per_hour == 1.0
    assert watchdog_events(ledger, "run-lost", "orphan-found")
    clock.advance(599)
    assert [a for a in w.run_once() if a.kind in ("terminate", "orphan-found")] == []  # seen, not yet due
    assert len(ledger.resources("run-lost")) == 1  # not recorded twice
    clock.advance(2)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert [a.provider_id for a in acts] == [orphan_id] and "orphan" in acts[0].reason
    assert fake.instances()[orphan_id]["state"] == "terminated"
    assert ledger.find_by_provider_id("fake", orphan_id).terminated_by == "watchdog"


def test_orphan_grace_survives_a_restart(ledger, fake):
    clock = FakeClock()
    orphan_id = _create_tagged(fake, "run-lost", "n0", "tok-2")
    wd(ledger, fake, clock).run_once()
    clock.advance(601)
    acts = [a for a in wd(ledger, fake, clock).run_once() if a.kind == "terminate"]  # a new watchdog process
    assert [a.provider_id for a in acts] == [orphan_id]


def test_pending_create_is_not_an_orphan(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, now=clock())
    res = ledger.record_intent(run.id, "fake", "instance", "broker-n0", usd_per_hour=1.0)
    _create_tagged(fake, run.id, "broker-n0", res.id)  # created; mark_created not yet written
    assert wd(ledger, fake, clock).run_once() == []
    assert len(ledger.resources(run.id)) == 1


def test_restart_does_not_terminate_twice_or_miss_anything(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=60, now=clock())
    rows = provision(ledger, fake, run, nodes=3)
    clock.advance(61)
    # watchdog #1 claimed and terminated the newest node, then was killed before writing "terminated"
    victim = rows[-1]
    assert ledger.claim_termination(victim.id, "watchdog")
    fake.terminate("instance", victim.provider_id)
    # watchdog #2 (fresh object: no memory) resumes from the ledger alone
    acts = [a for a in wd(ledger, fake, clock).run_once() if a.kind == "terminate"]
    assert {a.resource_id for a in acts} == {r.id for r in rows}
    assert all(ledger.resource(r.id).state == "terminated" for r in rows)
    assert fake.terminate_calls == {r.provider_id: 1 for r in rows}
    # and a third one finds nothing to do
    assert wd(ledger, fake, clock).run_once() == []
    assert sum(fake.terminate_calls.values()) == 3


def test_failed_terminate_is_loud_retried_with_backoff_and_never_crashes(ledger, fake, monkeypatch):
    clock, run, rows = one_node_past_deadline(ledger, fake)
    monkeypatch.setenv("BROKER_FAKE_FAIL", "terminate")
    w = wd(ledger, fake, clock)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert len(acts) == 1 and not acts[0].ok
    row = ledger.resource(rows[0].id)
    assert row.state != "terminated" and "HTTP 500 (injected)" in row.error
    assert watchdog_events(ledger, run.id, "retry")
    assert [a for a in w.run_once() if a.kind == "terminate"] == []  # backing off (10 s)
    monkeypatch.delenv("BROKER_FAKE_FAIL")
    clock.advance(11)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert len(acts) == 1 and acts[0].ok
    row = ledger.resource(rows[0].id)
    assert row.state == "terminated" and row.error is None


class BrokenList(CountingFake):
    """The account-wide list (the orphan scan) fails; one run's objects can still be read back (the ownership
    check before a terminate reads them: tests/money/test_trust_ledger.py covers a list that fails for both)."""

    def list_tagged(self, run_id=None):
        if run_id is None:
            raise ProviderError("fake", "list_tagged", "HTTP 503 (injected)")
        return super().list_tagged(run_id)


def test_list_tagged_error_is_logged_once_and_the_pass_goes_on(ledger, home):
    fake = BrokenList(home / "fake-cloud.json")
    clock, _, rows = one_node_past_deadline(ledger, fake)
    w = wd(ledger, fake, clock)
    acts = w.run_once()
    assert [a.kind for a in acts] == ["error", "terminate"] and acts[1].ok
    assert "HTTP 503" in w.errors["fake"]
    assert [a.kind for a in w.run_once()] == []  # same error: not logged again
    assert len([e for e in ledger.events() if e["action"] == "error"]) == 1
    assert ledger.resource(rows[0].id).state == "terminated"
    w.write_heartbeat()
    from broker.money.accounting import watchdog_state

    st = watchdog_state(home=home)
    assert st.alive and st.pid == os.getpid() and "HTTP 503" in st.errors["fake"]


def test_default_providers_are_the_ones_in_the_ledger(ledger, fake, home):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=10, now=clock())
    provision(ledger, fake, run, nodes=1)
    w = Watchdog(ledger, clock=clock, home=home)
    assert "fake" in w._scan_providers() and "local" not in w._scan_providers()
    clock.advance(11)
    acts = [a for a in w.run_once() if a.kind == "terminate"]  # the provider built by name (state from env)
    assert len(acts) == 1 and acts[0].ok


def test_lock_is_exclusive_and_names_the_holder(home):
    with WatchdogLock(home):
        with pytest.raises(WatchdogBusy) as ei:
            WatchdogLock(home).acquire()
        assert ei.value.pid == os.getpid() and f"pid {os.getpid()}" in str(ei.value)
    with WatchdogLock(home):  # released: can be taken again
        pass


# ------------------------------------------------------------------------------------------- node idle script
def test_idle_watch_script_fires_only_after_job_end_without_ssh_sessions(tmp_path, fake_ssh_sessions):
    path, sessions = fake_ssh_sessions
    done, fired = tmp_path / "job.done", tmp_path / "fired"
    script = idle_watch_script(1 / 60, f"echo stopped > {fired}", done_file=str(done), poll_s=0.2)
    env = dict(os.environ, PATH=path)
    sessions.write_text("1")
    proc = subprocess.Popen(["bash", "-c", script + "\nbroker_idle_watch"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.5)
        assert not fired.exists()  # job still running
        done.write_text("")
        time.sleep(1.5)
        assert not fired.exists()  # job ended but someone is logged in
        sessions.unlink()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and fired.read_text().strip() == "stopped"
        assert "no SSH session for 1 s after the job ended" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_orphan_of_an_active_run_is_terminated_without_ending_the_run(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=3600, pid=os.getpid(), now=clock())
    rows = provision(ledger, fake, run, nodes=1)
    stray = _create_tagged(fake, run.id, "not-a-ledger-name", "tok-stray")
    w = wd(ledger, fake, clock, orphan_grace_s=600)
    assert [a.kind for a in w.run_once()] == ["orphan-found"]
    clock.advance(601)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert [a.provider_id for a in acts] == [stray]
    assert ledger.get_run(run.id).status == "running" and ledger.resource(rows[0].id).state == "running"


def test_idle_minutes_from_the_runs_recipe(ledger, fake):
    clock = FakeClock()
    run = make_run(ledger, deadline_s=3600, now=clock())
    ledger.update_run(run.id, recipe={"name": "x", "idle_minutes": 10}, status="failed", ended_at=clock())
    provision(ledger, fake, run, nodes=1)
    w = wd(ledger, fake, clock)
    clock.advance(599)
    assert [a for a in w.run_once() if a.kind == "terminate"] == []
    clock.advance(2)
    assert [a.reason for a in w.run_once() if a.kind == "terminate"] == ["idle 10 min after the job ended (failed)"]


class SlowTerminate(CountingFake):
    """Terminate accepted but the instance reports ``terminating`` for the next ``slow`` describes."""

    slow = 2

    def terminate(self, kind, provider_id, *, region=None, attrs=None):
        super().terminate(kind, provider_id, region=region, attrs=attrs)
        return False

    def describe_instance(self, provider_id, *, region=None):
        info = super().describe_instance(provider_id, region=region)
        if info.state == "terminated" and self.slow > 0:
            self.slow -= 1
            return info.model_copy(update={"state": "terminating"})
        return info


def test_unconfirmed_terminate_is_confirmed_on_a_later_pass_not_repeated(ledger, home):
    fake = SlowTerminate(home / "fake-cloud.json")
    clock, _, rows = one_node_past_deadline(ledger, fake)
    w = wd(ledger, fake, clock, confirm_timeout_s=0)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert len(acts) == 1 and not acts[0].ok
    row = ledger.resource(rows[0].id)
    assert row.state == "terminating" and "still not gone" in row.error
    clock.advance(11)
    acts = [a for a in w.run_once() if a.kind == "terminate"]  # the provider still says terminating
    assert len(acts) == 1 and not acts[0].ok and "terminate in progress" in acts[0].reason
    acts = [a for a in w.run_once() if a.kind == "terminate"]  # next pass, no backoff: now gone
    assert len(acts) == 1 and acts[0].ok
    row = ledger.resource(rows[0].id)
    assert row.state == "terminated" and row.error is None and row.terminated_by == "watchdog"
    assert fake.terminate_calls == {rows[0].provider_id: 1}


def test_cli_once_json_and_busy_lock(ledger, fake, home):
    from typer.testing import CliRunner

    from broker.cli.app import app

    run = make_run(ledger, deadline_s=-1)
    rows = provision(ledger, fake, run, nodes=1)
    with WatchdogLock(home):
        res = CliRunner().invoke(app, ["watchdog", "--once"])
        assert res.exit_code == 0 and f"another watchdog (pid {os.getpid()}) is already running" in res.output
        assert ledger.resource(rows[0].id).state == "running"  # the lock holder does the work, not this one
    res = CliRunner().invoke(app, ["watchdog", "--once", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["schema_version"] == 1
    acts = doc["actions"]
    term = [a for a in acts if a["kind"] == "terminate"]
    assert [a["resource_id"] for a in term] == [rows[0].id] and term[0]["ok"]
    assert "deadline passed" in term[0]["reason"]
    assert ledger.resource(rows[0].id).state == "terminated"


def test_the_watchdogs_teardown_removes_the_runs_ssh_host_entries(ledger, fake):
    """A run whose machines the watchdog deleted keeps no ``Host`` block (``StrictHostKeyChecking accept-new`` to
    an address that may be someone else's now); another run's block stays."""
    from types import SimpleNamespace as NS

    from broker.cli.day2 import install_ssh_config, ssh_config

    clock, run, rows = one_node_past_deadline(ledger, fake)
    own = ledger.path.parent / "ssh_config"
    user = ledger.path.parent / "dot-ssh" / "config"
    node = NS(node_rank=0, host="198.18.0.9", user="root", port=22, local=False, resource_id=rows[0].id)
    cluster = NS(nodes=[node], ssh_key_path=None, known_hosts_path=None)
    install_ssh_config(run.id, ssh_config(run.id, cluster), user_config=user, own=own)
    install_ssh_config("other-run", ssh_config("other-run", cluster), user_config=user, own=own)
    w = wd(ledger, fake, clock)
    assert all(a.ok for a in w.run_once() if a.kind == "terminate")
    assert ledger.resources(run.id, live_only=True) == []
    text = own.read_text()
    assert f"broker-{run.id}-n0" not in text and f"broker run {run.id}" not in text
    assert "Host broker-other-run-n0" in text
