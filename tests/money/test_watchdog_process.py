"""The watchdog as real processes: a SIGKILLed CLI, a SIGKILLed and restarted watchdog, two watchdogs at once,
and start_detached.  Every process is killed in teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from broker.money.accounting import pid_alive, watchdog_state
from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.providers.fake import FakeProvider
from tests.support.watchdog_helpers import make_run, provision

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(fake_cloud_home):
    return fake_cloud_home


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    extra_pids: list[int] = []
    yield started, extra_pids
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
    for pid in extra_pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, BROKER_HOME=str(home), BROKER_FAKE_STATE=str(home / "fake-cloud.json"),
               PYTHONPATH=str(ROOT))
    for var in ("BROKER_FAKE_FAIL", "BROKER_FAKE_HANG"):
        env.pop(var, None)
    env.update(extra)
    return env


def start_watchdog(home: Path, procs, *args: str, name: str = "wd", **extra: str) -> subprocess.Popen:
    out = open(home / f"{name}.out", "w")
    p = subprocess.Popen([sys.executable, "-m", "broker", "watchdog", *args], cwd=ROOT, env=env_for(home, **extra),
                         stdout=out, stderr=subprocess.STDOUT, text=True)
    out.close()
    procs[0].append(p)
    return p


def wait_for(cond, timeout: float, what: str, poll: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


CLI_SCRIPT = """
import os, sys, time
from datetime import timedelta
sys.path.insert(0, sys.argv[1])
from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.providers.fake import FakeProvider
from tests.support.watchdog_helpers import make_run, provision
led = Ledger()
run = make_run(led, deadline=utcnow() + timedelta(seconds=3), pid=os.getpid())
provision(led, FakeProvider(), run, nodes=2, usd_per_hour=1.0)
print(run.id, flush=True)
time.sleep(600)
"""


def test_sigkilled_cli_watchdog_terminates_everything_within_one_interval_after_deadline(home, procs):
    interval = 0.5
    wd = start_watchdog(home, procs, "--interval", str(interval))
    wait_for(lambda: watchdog_state(home=home).alive, 120, "the watchdog's heartbeat")
    # the "CLI": registers itself as the run's pid, provisions ledger-first (deadline = now + 3 s), is SIGKILLed
    cli = subprocess.Popen([sys.executable, "-c", CLI_SCRIPT, str(TESTS)], cwd=ROOT, env=env_for(home),
                           stdout=subprocess.PIPE, text=True)
    procs[0].append(cli)
    run_id = cli.stdout.readline().strip()
    assert run_id, "the CLI process did not start the run"
    os.kill(cli.pid, signal.SIGKILL)
    cli.wait(timeout=30)
    led = Ledger(home / "ledger.sqlite")
    run = led.get_run(run_id)
    assert run.pid == cli.pid
    rows = wait_for(lambda: (rs := led.resources(run_id)) and all(r.state == "terminated" for r in rs) and rs,
                    60, "every resource terminated")
    assert len(rows) == 2 and wd.poll() is None
    lag = max((r.terminated_at - run.deadline).total_seconds() for r in rows)
    print(f"termination lag after the deadline: {lag:.2f} s (interval {interval} s)")
    assert lag <= interval + 2.5  # one polling interval plus the pass itself on a loaded 2-core box
    fake = FakeProvider(home / "fake-cloud.json").instances()
    for r in rows:
        assert r.terminated_by == "watchdog" and r.terminated_at >= run.deadline
        assert fake[r.provider_id]["state"] == "terminated" and fake[r.provider_id]["terminate_calls"] == 1
    evs = led.events(run_id)
    done = [e for e in evs if e["actor"] == "watchdog" and e["action"] == "terminated"]
    assert {e["resource_id"] for e in done} == {r.id for r in rows}
    why = [e for e in evs if e["actor"] == "watchdog" and e["action"] == "terminate"]
    assert all("deadline passed" in e["message"] for e in why) and len(why) == 2
    assert any(e["action"] == "cli-dead" and f"pid {cli.pid}" in e["message"] for e in evs)
    assert led.get_run(run_id).status == "interrupted"
    led.close()


def test_watchdog_sigkilled_mid_teardown_and_restarted_resumes_without_double_terminate(home, procs):
    led = Ledger(home / "ledger.sqlite")
    fake = FakeProvider(home / "fake-cloud.json")
    run = make_run(led, deadline=utcnow() - timedelta(seconds=1))
    rows = provision(led, fake, run, nodes=3)
    hang = Path(f"{home / 'fake-cloud.json'}.hang-after-terminate")
    wd1 = start_watchdog(home, procs, "--interval", "0.5", name="wd1", BROKER_FAKE_HANG="after-terminate")
    wait_for(hang.exists, 120, "watchdog #1 to hang right after its first terminate call")
    os.kill(wd1.pid, signal.SIGKILL)
    wd1.wait(timeout=30)
    states = {r.id: led.resource(r.id).state for r in rows}
    assert sorted(states.values()) == ["running", "running", "terminating"]  # killed between call and record
    wd2 = start_watchdog(home, procs, "--interval", "0.5", name="wd2")
    wait_for(lambda: all(led.resource(r.id).state == "terminated" for r in rows), 60, "all terminated by #2")
    inst = fake.instances()
    assert {inst[r.provider_id]["terminate_calls"] for r in rows} == {1}  # never twice, none missed
    time.sleep(1.5)  # a few more passes change nothing
    assert {fake.instances()[r.provider_id]["terminate_calls"] for r in rows} == {1}
    wd2.send_signal(signal.SIGTERM)
    assert wd2.wait(timeout=30) == 0
    assert not (home / "watchdog.json").exists()  # a clean stop removes the heartbeat
    led.close()


def test_two_watchdogs_started_at_once_one_runs_one_exits_with_a_clear_message(home, procs):
    a = start_watchdog(home, procs, "--interval", "0.5", name="a")
    b = start_watchdog(home, procs, "--interval", "0.5", name="b")
    loser = wait_for(lambda: next((p for p in (a, b) if p.poll() is not None), None), 120, "one of them to exit")
    winner = b if loser is a else a
    assert loser.returncode == 0
    msg = (home / ("a.out" if loser is a else "b.out")).read_text()
    assert "another watchdog" in msg and "is already running" in msg and "watchdog.lock" in msg
    if "(pid " in msg:
        assert f"(pid {winner.pid})" in msg
    time.sleep(1.0)
    assert winner.poll() is None
    wait_for(lambda: watchdog_state(home=home).pid == winner.pid, 60, "the winner's heartbeat")


def test_start_detached_starts_one_and_it_exits_when_idle(home, procs):
    from broker.money.watchdog import start_detached

    pid = start_detached(home, interval_s=0.5, exit_when_idle_s=2.0)
    assert pid
    procs[1].append(pid)
    wait_for(lambda: watchdog_state(home=home).alive, 120, "the detached watchdog's heartbeat")
    assert os.getsid(pid) == pid  # its own session: survives the CLI's terminal
    assert start_detached(home, interval_s=0.5) is None  # one is running
    wait_for(lambda: not pid_alive(pid), 60, "the idle watchdog to exit")
    assert "watchdog started" in (home / "watchdog.log").read_text()


DETACHING_CLI = """
import os, sys, time
from datetime import timedelta
sys.path.insert(0, sys.argv[1])
from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.money.watchdog import start_detached
from broker.providers.fake import FakeProvider
from tests.support.watchdog_helpers import make_run, provision
wd_pid = start_detached(interval_s=0.5, exit_when_idle_s=5)  # what `broker run` does before provisioning
led = Ledger()
run = make_run(led, deadline=utcnow() + timedelta(seconds=3), pid=os.getpid())
provision(led, FakeProvider(), run, nodes=2, usd_per_hour=1.0)
print(run.id, wd_pid, flush=True)
time.sleep(600)
"""


def test_cli_that_started_a_detached_watchdog_is_sigkilled_and_the_watchdog_cleans_up(home, procs):
    cli = subprocess.Popen([sys.executable, "-c", DETACHING_CLI, str(TESTS)], cwd=ROOT, env=env_for(home),
                           stdout=subprocess.PIPE, text=True)
    procs[0].append(cli)
    run_id, wd_pid = cli.stdout.readline().split()
    procs[1].append(int(wd_pid))
    os.kill(cli.pid, signal.SIGKILL)  # the CLI dies mid-run
    cli.wait(timeout=30)
    assert pid_alive(int(wd_pid))  # the watchdog lives on in its own session
    led = Ledger(home / "ledger.sqlite")
    rows = wait_for(lambda: (rs := led.resources(run_id)) and all(r.state == "terminated" for r in rs) and rs,
                    90, "every resource terminated by the detached watchdog")
    run = led.get_run(run_id)
    assert all(r.terminated_by == "watchdog" and r.terminated_at >= run.deadline for r in rows)
    assert {e["resource_id"] for e in led.events(run_id) if e["actor"] == "watchdog" and e["action"] == "terminated"} \
        == {r.id for r in rows}
    wait_for(lambda: not pid_alive(int(wd_pid)), 60, "the watchdog to exit once idle")
    led.close()
