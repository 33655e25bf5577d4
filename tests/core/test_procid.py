"""A PID is not an identity: a recorded process is (pid, start time, name) and nothing that does not match all of
them is signalled.  Real processes, real signals, a real SQLite ledger; the exact case: a `broker run -d` whose
pid stayed in the ledger and in detached.json, taken later by an unrelated process that ignores SIGINT."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from broker.core import procid
from broker.core.model import utcnow
from broker.core.records import Run
from broker.money.ledger import Ledger
from tests.conftest import REPO, broker_cmd

RUN_ID = "20261206-000000-d0d0d0"

#: an unrelated process: notes every SIGINT in a file and goes on (as one that ignores it would)
_STUBBORN = """
import signal, sys, time
mark = sys.argv[1]
def noted(*_):
    open(mark, "a").write("SIGINT\\n")
signal.signal(signal.SIGINT, noted)
print("ready", flush=True)
time.sleep(300)
"""


def _stubborn(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    mark = tmp_path / "got-sigint"
    p = subprocess.Popen([sys.executable, "-c", _STUBBORN, str(mark)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"  # the handler is installed
    return p, mark


def _ended_identity() -> procid.ProcessId:
    """The identity of a process that has exited (recorded while it ran)."""
    p = subprocess.Popen(["sleep", "30"])
    ident = procid.record(p.pid)
    p.kill()
    p.wait()
    assert ident is not None and not procid.matches(ident)
    return ident


@pytest.fixture
def stubborn(tmp_path):
    p, mark = _stubborn(tmp_path)
    yield p, mark
    p.kill()
    p.wait()


def test_an_identity_matches_its_process_only(stubborn):
    p, _ = stubborn
    me = procid.record(p.pid)
    assert me is not None and procid.matches(me)
    assert not procid.matches(procid.ProcessId(p.pid, me.start + 1, me.comm))  # same pid, another start time
    assert not procid.matches(procid.ProcessId(p.pid, me.start, "wireguard-go"))  # same pid, another program
    assert procid.ProcessId.from_text(me.to_text()) == me
    assert procid.ProcessId.from_text(str(p.pid)) is None  # a bare pid (an older pid file) is not an identity


def test_a_recycled_pid_is_not_signalled_and_a_matching_one_is(stubborn):
    p, mark = stubborn
    old = _ended_identity()
    recycled = procid.ProcessId(p.pid, old.start, old.comm)  # the record now points at an unrelated process
    assert not procid.send(recycled, signal.SIGINT)
    time.sleep(0.2)
    assert not mark.exists() and p.poll() is None
    assert procid.send(procid.record(p.pid), signal.SIGINT)  # the real identity is signalled
    deadline = time.monotonic() + 10
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mark.read_text() == "SIGINT\n"


def _ended_detached_run(home: Path, pid: int, pid_start: int | None, marker: dict) -> None:
    run_dir = home / "runs" / RUN_ID
    run_dir.mkdir(parents=True)
    (run_dir / "detached.json").write_text(json.dumps(marker))
    lg = Ledger(home / "ledger.sqlite")
    now = utcnow()
    lg.create_run(Run(id=RUN_ID, name="bg", provider="local", topology="local", status="succeeded",
                      created_at=now - timedelta(minutes=5), ended_at=now - timedelta(minutes=1),
                      run_dir=str(run_dir), pid=pid, pid_start=pid_start))
    lg.close()


@pytest.mark.parametrize("legacy", [False, True], ids=["stale-identity", "bare-pid-marker"])
def test_down_does_not_signal_or_wait_on_a_pid_the_run_left_behind(stubborn, broker_home, cli_env, legacy):
    p, mark = stubborn
    old = _ended_identity()
    if legacy:  # what an older broker wrote: a pid and nothing else
        _ended_detached_run(broker_home, p.pid, None, {"pid": p.pid})
    else:
        _ended_detached_run(broker_home, p.pid, old.start, {"pid": p.pid, "start": old.start, "comm": old.comm})
    t0 = time.monotonic()
    r = subprocess.run(broker_cmd("down", RUN_ID, "--yes"), cwd=REPO, env=cli_env, capture_output=True, text=True,
                       timeout=90, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert not mark.exists(), "an unrelated process got broker down's SIGINT"
    assert p.poll() is None
    assert took < 60, f"broker down waited {took:.0f} s on a process that is not the run's"
    assert "interrupted" not in r.stdout


def test_down_still_interrupts_the_live_background_run(broker_home, tmp_path):
    """The identity that matches is signalled: a live `broker run -d` stand-in ends on SIGINT."""
    from broker.cli.detached import stop_detached

    p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(300)"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        me = procid.record(p.pid)
        _ended_detached_run(broker_home, p.pid, me.start, me.to_dict())
        run = Ledger().get_run(RUN_ID)
        assert stop_detached(run, grace_s=20)
        assert p.poll() is not None  # it ended on the SIGINT (KeyboardInterrupt) within the grace
    finally:
        p.kill()
        p.wait()


def test_a_wireguard_pid_file_naming_someone_else_is_not_signalled(stubborn, tmp_path):
    from broker.run.wireguard import stop_process

    p, _ = stubborn
    pidfile = tmp_path / "node0.conf.pid"
    pidfile.write_text(str(p.pid))  # an older broker's bare pid
    assert not stop_process(pidfile, wait_s=0.5)
    me = procid.record(p.pid)
    pidfile.write_text(procid.ProcessId(p.pid, me.start, "wireguard-go").to_text())  # right pid, other program
    assert not stop_process(pidfile, wait_s=0.5)
    old = _ended_identity()
    pidfile.write_text(procid.ProcessId(p.pid, old.start, me.comm).to_text())  # right name, other start time
    assert not stop_process(pidfile, wait_s=0.5)
    assert p.poll() is None
    pidfile.write_text(me.to_text())  # the process itself: stopped (SIGTERM is not caught by it)
    assert stop_process(pidfile, wait_s=5)
    assert not procid.matches(me)  # gone (stop_process reaped its child)


def test_a_run_whose_cli_pid_was_reused_is_settled_as_interrupted(stubborn, broker_home):
    """The watchdog's rule for dead CLIs: a live process at the recorded pid with another start time is not the
    run's CLI (before: the run stayed `running` and its nodes billed until the deadline)."""
    from broker.money.watchdog import Watchdog

    p, _ = stubborn
    old = _ended_identity()
    lg = Ledger()
    now = utcnow()
    lg.create_run(Run(id=RUN_ID, name="fg", provider="local", topology="local", status="running", created_at=now,
                      deadline=now + timedelta(hours=1), run_dir=str(broker_home / "runs" / RUN_ID), pid=p.pid,
                      pid_start=old.start))
    Watchdog(lg, providers={}).run_once()
    assert lg.get_run(RUN_ID).status == "interrupted"
    assert p.poll() is None


def test_the_probe_kill_leaves_an_unrelated_group_that_took_the_jobs_group_id(tmp_path):
    """A node's ``torchrun.pid`` names the job's process group; once the job ended the id may be another group's.
    With the run's markers, only marked members (and their children) are signalled: the unrelated group lives,
    the marked job does not."""
    import os

    probe = REPO / "broker" / "run" / "probe_script.py"
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)  # an unrelated group: no markers
    job = subprocess.Popen(["sleep", "300"], start_new_session=True,
                           env=dict(os.environ, BROKER_RUN_ID=RUN_ID, BROKER_NODE_RANK="0"))
    try:
        pidfile = tmp_path / "torchrun.pid"
        pidfile.write_text(str(other.pid))  # the recorded group id is now the unrelated group's
        r = subprocess.run([sys.executable, str(probe), "kill", str(pidfile), "1", f"BROKER_RUN_ID={RUN_ID}",
                            "BROKER_NODE_RANK=0"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert job.wait(timeout=10) is not None  # the marked job was stopped
        time.sleep(0.1)
        assert other.poll() is None, "the unrelated process group was signalled"
    finally:
        for p in (other, job):
            p.kill()
            p.wait()


def test_a_detached_run_that_ended_leaves_no_pid_behind(cli_env, tmp_path):
    """The start of the exact case: once a `broker run -d` ended, its pid stays neither in the ledger nor in
    detached.json (nothing is left for a later process to be mistaken for it)."""
    from tests.cli.test_everyday import _cli, _detached_id, _ticker, _wait_ended, _wait_row

    p = _cli(["run", "-d", str(_ticker(tmp_path))], dict(cli_env, TICKS="2", TICK_S="0.2"))
    assert p.returncode == 0, p.stderr
    run_id = _detached_id(p)
    row = _wait_row(run_id)
    assert row.pid and row.pid_start is not None  # while it runs: its identity
    assert _wait_ended(run_id) == "succeeded"
    run = Ledger().get_run(run_id)
    assert run.pid is None and run.pid_start is None
    marker = Path(run.run_dir) / "detached.json"
    deadline = time.monotonic() + 30  # removed as the background process exits
    while marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not marker.exists()
