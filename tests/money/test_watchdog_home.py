"""A watchdog is known alive only by what it checked last: its heartbeat (written after each completed pass) names
its process identity and the ledger the pass read.  The exact case: the home was deleted and made again while a
watchdog ran; `status` said "watchdog: running" and a new run did not start its own.  Real processes, a real
SQLite ledger."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from broker.core import procid
from broker.core.model import utcnow
from broker.money.accounting import watchdog_state
from broker.money.ledger import Ledger
from broker.money.watchdog import start_detached
from tests.conftest import REPO, broker_cmd


def _wait(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def started():
    pids: list[procid.ProcessId] = []
    yield pids
    for ident in pids:  # only the watchdogs this test started, by their identity
        procid.stop(ident, grace_s=5)


def test_a_watchdog_of_a_deleted_home_is_not_this_homes(broker_home, started):
    home = broker_home
    Ledger(home / "ledger.sqlite").close()
    first = start_detached(home, interval_s=0.2, exit_when_idle_s=None)
    assert first
    started.append(procid.record(first))
    _wait(lambda: watchdog_state(home=home).alive, 60, "the first watchdog's first pass")
    assert watchdog_state(home=home).pid == first

    shutil.rmtree(home)  # the home deleted and made again, with a new ledger, while the watchdog runs
    home.mkdir(mode=0o700)
    Ledger(home / "ledger.sqlite").close()
    time.sleep(1.0)  # five of its passes: before, each one rewrote the new home's heartbeat
    st = watchdog_state(home=home)
    assert not st.alive, "a watchdog that reads the deleted ledger counted as this home's"
    assert procid.matches(started[0]), "the old watchdog keeps guarding what it opened"

    second = start_detached(home, interval_s=0.2, exit_when_idle_s=None)
    assert second and second != first, "no watchdog was started for the new home"
    started.append(procid.record(second))
    _wait(lambda: watchdog_state(home=home).alive, 60, "the new home's watchdog")
    assert watchdog_state(home=home).pid == second


def _heartbeat(home: Path, **over) -> None:
    me = procid.record()
    data = {"pid": me.pid, "pid_start": me.start, "comm": me.comm,
            "installation_id": Ledger(home / "ledger.sqlite").installation_id, "started_at": utcnow().isoformat(),
            "heartbeat_at": utcnow().isoformat(), "interval_s": 5.0, "passes": 3, "errors": {}}
    data.update(over)
    (home / "watchdog.json").write_text(json.dumps(data))


def test_a_heartbeat_counts_only_for_its_process_and_this_homes_ledger(broker_home):
    _heartbeat(broker_home)
    assert watchdog_state(home=broker_home).alive  # the control: this process, this ledger, just now
    _heartbeat(broker_home, pid_start=procid.record().start + 1)  # this pid, but another process's start time
    assert not watchdog_state(home=broker_home).alive
    _heartbeat(broker_home, installation_id="bi0000000000")  # another ledger
    st = watchdog_state(home=broker_home)
    assert not st.alive and st.other_ledger
    _heartbeat(broker_home, installation_id=None)  # an older watchdog's heartbeat says nothing of the ledger
    assert not watchdog_state(home=broker_home).alive


def test_status_says_a_watchdog_of_another_ledger_guards_nothing_here(broker_home, cli_env):
    _heartbeat(broker_home, installation_id="bi0000000000")
    r = subprocess.run(broker_cmd("status"), cwd=REPO, env=dict(cli_env, COLUMNS="200"), capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "watchdog: running" not in r.stdout, r.stdout
    assert "not guarding this home" in r.stdout, r.stdout + r.stderr
