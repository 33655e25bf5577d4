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


# --------------------------------------------------------------------------------------------------- signals
SIG_RECIPE = """\
name: sig-probe
script: job.py
nodes: 1
gpus_per_node: 1
cpu_ok: true
budget_usd: 5
max_hours: 0.25
expect: ["JOB_OK"]
"""


@pytest.fixture
def fake_run(tmp_path):
    """``start(hang_step)``: a real ``broker run --provider fake`` subprocess that blocks at ``hang_step`` (the fake
    cloud writes a marker there); returns (process, env)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "job.py").write_text("print('JOB_OK', flush=True)\n")
    (tmp_path / "recipe" / "r.yaml").write_text(SIG_RECIPE)
    e = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    e.update(BROKER_HOME=str(tmp_path / "home"), BROKER_FAKE_STATE=str(tmp_path / "fake.json"),
             PYTHONPATH=str(REPO), BROKER_WATCHDOG_AUTOSTART="0")
    procs: list[subprocess.Popen] = []

    def start(step: str, **popen):
        import time

        popen.setdefault("stdout", subprocess.PIPE)
        popen.setdefault("stderr", subprocess.STDOUT)
        proc = subprocess.Popen([sys.executable, "-m", "broker", "run", str(tmp_path / "recipe" / "r.yaml"),
                                 "--provider", "fake", "--yes"], cwd=REPO, env=dict(e, BROKER_FAKE_HANG=step),
                                start_new_session=popen.pop("start_new_session", True), **popen)
        procs.append(proc)
        marker = Path(f"{e['BROKER_FAKE_STATE']}.hang-{step}")
        t0 = time.monotonic()
        while not marker.exists():
            assert proc.poll() is None, f"broker run ended (rc {proc.returncode}) before {step}"
            assert time.monotonic() - t0 < 90, f"broker run never reached {step}"
            time.sleep(0.05)
        return proc, e

    yield start
    import os as _os
    import signal as _signal

    for proc in procs:
        if proc.poll() is None:
            _os.killpg(proc.pid, _signal.SIGKILL)
            proc.wait(timeout=30)


def _fake_live(e: dict) -> set[str]:
    import json

    p = Path(e["BROKER_FAKE_STATE"])
    st = json.loads(p.read_text()) if p.exists() else {"instances": {}}
    return {i for i, x in st["instances"].items() if x["state"] != "terminated"}


def _run_status(e: dict) -> dict:
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    r = subprocess.run([sys.executable, "-m", "broker", "status", "--json"], cwd=REPO, env=e, capture_output=True,
                       text=True, timeout=60)
    return json.loads(r.stdout)


@pytest.mark.parametrize("sig,code,name", [("SIGTERM", 143, "SIGTERM"), ("SIGHUP", 129, "SIGHUP")])
def test_sigterm_and_sighup_tear_down_like_ctrl_c_and_say_so(fake_run, sig, code, name):
    import signal

    proc, e = fake_run("ready")
    assert len(_fake_live(e)) == 1
    proc.send_signal(getattr(signal, sig))
    out, _ = proc.communicate(timeout=60)
    out = out.decode()
    assert proc.returncode == code, out
    assert _fake_live(e) == set() and "tearing down" in out
    assert f"terminated by {name}" in out
    st = _run_status(e)
    assert st["live_resources"] == [] and st["runs"][0]["status"] == "interrupted"
    assert name in (st["runs"][0].get("message") or "")


def test_a_closed_terminal_tears_down(fake_run):
    """The CLI on a pseudo-terminal that is its controlling terminal; closing the terminal (the master side)
    sends SIGHUP and makes every later write fail (EIO): the teardown still finishes."""
    import fcntl
    import os
    import pty
    import termios
    import time

    master, slave = pty.openpty()

    def ctty() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        proc, e = fake_run("ready", stdin=slave, stdout=slave, stderr=slave, start_new_session=False,
                           preexec_fn=ctty)
    finally:
        os.close(slave)
    assert len(_fake_live(e)) == 1
    os.close(master)  # the terminal goes away
    proc.wait(timeout=60)
    assert proc.returncode == 129
    t0 = time.monotonic()
    assert _fake_live(e) == set()
    st = _run_status(e)
    assert st["live_resources"] == [] and st["runs"][0]["status"] == "interrupted", time.monotonic() - t0
