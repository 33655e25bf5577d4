"""Money truth against independent emulators: the provider's word beats broker's own belief.

* a DELETE answered ``{"success": true}`` whose instance stays is re-sent until the provider shows it gone, or the
  resource is named with its id, its $/h and the command that retries;
* SIGTERM, SIGHUP and a closed terminal (a real pty) tear down a real ``broker run`` like Ctrl-C, exit 143 / 129;
* one clock per run: instances that never leave ``loading`` end at the deadline with nothing more rented (also when
  the watchdog kills them), the run's status stays ``deadline``, the job's limit is what is left of the clock;
* the provider's rate (``dph_total`` 60x the plan) drives every money figure and stops a run it no longer fits;
* the dead-man grace scales with the job; a node stopped mid-job ends the run and shows as stopped.

The Vast.ai adapter talks HTTP to tests/support/vast_emulator.py (no netns: the instances here need no host); the signal
and stopped-node cases use the file-backed fake cloud.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.core.records import Run
from broker.money.teardown import terminate_resource
from tests.support.vast_emulator import API_KEY, VastEmulator


@pytest.fixture
def vast_env(tmp_path, monkeypatch):
    """An isolated broker home; ``start(**kw)`` runs a hostless VastEmulator and points the adapter at it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "broker"))
    monkeypatch.chdir(tmp_path)
    from broker.core.config import settings

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
        if step.startswith("/"):  # a file the job itself writes: the job is running
            (tmp_path / "recipe" / "job.py").write_text(f"import pathlib, time\npathlib.Path({step!r}).touch()\n"
                                                        "time.sleep(300)\n")
        hang = {} if step.startswith("/") else {"BROKER_FAKE_HANG": step}
        proc = subprocess.Popen([sys.executable, "-m", "broker", "run", str(tmp_path / "recipe" / "r.yaml"),
                                 "--provider", "fake", "--yes"], cwd=REPO, env=dict(e, **hang),
                                start_new_session=popen.pop("start_new_session", True), **popen)
        procs.append(proc)
        marker = Path(step) if step.startswith("/") else Path(f"{e['BROKER_FAKE_STATE']}.hang-{step}")
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


def test_sigterm_while_the_job_runs_stops_it_and_tears_down(fake_run, tmp_path):
    import signal

    proc, e = fake_run(str(tmp_path / "job-started"))
    assert len(_fake_live(e)) == 1
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    out = out.decode()
    assert proc.returncode == 143, out
    assert _fake_live(e) == set() and "terminated by SIGTERM" in out
    run = _run_status(e)["runs"][0]
    assert run["status"] == "interrupted" and "SIGTERM" in run["message"]


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


# --------------------------------------------------------------------------------------------------- one clock
def _climbing_offers():
    """Five hosts, each dearer than the last, up to an H100 at $4.38/h (the exact case)."""
    from tests.support.vast_emulator import offer_row

    rows = [offer_row(5101 + i, machine_id=11 + i, num_gpus=2, dph_total=p, gpu_name=g)
            for i, (p, g) in enumerate([(0.30, "RTX 3090"), (0.45, "RTX 4090"), (0.90, "A100 PCIE"),
                                        (1.60, "A100 SXM4"), (4.38, "H100 SXM")])]
    for r in rows:
        r["gpu_ram"] = 81920 if "H100" in r["gpu_name"] or "A100" in r["gpu_name"] else 24576
    return rows


def _vast_options(p, budget: float = 50.0, at_least: int = 3):
    from broker.core.model import Requirements
    from tests.support.plans import rank_options

    req = Requirements(nodes=2, gpus_per_node=1, cpu_ok=True, topology="simulated", budget_usd=budget, hours=1)
    opts = [o for o in rank_options(p, req) if o.provider == "vast"]
    assert len(opts) >= at_least, opts
    return opts


def _rents(emu) -> int:
    return sum(1 for m, path, _ in emu.calls if m == "PUT" and path.startswith("/api/v0/asks/"))


def test_instances_that_never_leave_loading_end_at_the_deadline_and_nothing_more_is_rented(vast_env, tmp_path):
    from broker.money.cost import ClockOut
    from broker.money.provision import provision

    emu = vast_env(offers=_climbing_offers(), never_ready=True, boot_s=0.2)
    ledger = Ledger()
    p = _vast()
    run = _run(ledger, tmp_path, hours=4 / 3600)  # the deadline is 4 s away; the ready timeout is 900 s
    with pytest.raises(ClockOut, match="deadline") as err:
        provision(_vast_options(p), run, _req(), ledger, providers={"vast": p}, ready_timeout_s=900, poll_s=0.1,
                  retry_wait_s=0.01, terminate_timeout_s=10)
    assert err.value.status == "deadline"
    assert _rents(emu) == 1  # the first offer only: nothing after the deadline
    assert emu.instances == {} and ledger.resources(run.id, live_only=True) == []


def test_a_watchdog_kill_at_the_deadline_is_not_a_failed_offer(vast_env, tmp_path):
    """The watchdog terminates the loading instance at the deadline; the CLI then sees it "not found": that is the
    end of the run (status deadline), never a reason to rent the next, dearer offer."""
    import threading
    import time

    from broker.money.cost import ClockOut
    from broker.money.provision import provision
    from broker.money.watchdog import Watchdog

    emu = vast_env(offers=_climbing_offers(), never_ready=True, boot_s=0.2)
    ledger = Ledger()
    p = _vast()
    run = _run(ledger, tmp_path, hours=3 / 3600)
    stop = threading.Event()

    def watchdog() -> None:
        w = Watchdog(Ledger(), providers={"vast": _vast()}, interval_s=0.2, confirm_timeout_s=5)
        while not stop.is_set():
            w.run_once()
            time.sleep(0.2)

    t = threading.Thread(target=watchdog, daemon=True)
    t.start()
    try:
        with pytest.raises(ClockOut):
            provision(_vast_options(p), run, _req(), ledger, providers={"vast": p}, ready_timeout_s=900, poll_s=0.1,
                      retry_wait_s=0.01, terminate_timeout_s=10)
    finally:
        stop.set()
        t.join(timeout=30)
    assert _rents(emu) == 1 and emu.instances == {}


def test_a_run_whose_instances_never_load_ends_as_deadline_through_the_pipeline(vast_env, tmp_path):
    from datetime import timedelta

    from broker.run.cloudtarget import CloudTarget
    from broker.run.runrecord import Hooks
    from broker.run.pipeline import run_pipeline
    from broker.money.cost import ClockOut
    from broker.core.recipe import load_recipe

    emu = vast_env(offers=_climbing_offers(), never_ready=True, boot_s=0.2)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "job.py").write_text("print('JOB_OK')\n")
    (tmp_path / "r" / "r.yaml").write_text("name: t\nscript: job.py\nnodes: 2\ncpu_ok: true\n"
                                           "topology: simulated\nbudget_usd: 50\nmax_hours: 1\n")
    recipe = load_recipe(tmp_path / "r" / "r.yaml")
    p = _vast()
    ledger = Ledger()

    def shorten(run, _desc) -> None:  # a deadline 4 s away (the recipe's smallest max_hours is far longer)
        ledger.update_run(run.id, deadline=utcnow() + timedelta(seconds=4))

    said: list[str] = []
    target = CloudTarget(recipe, _vast_options(p), providers={"vast": p}, poll_s=0.1, ready_timeout_s=900)
    with pytest.raises(ClockOut):
        run_pipeline(recipe, target, ledger=ledger, hooks=Hooks(say=said.append, on_start=shorten))
    (run,) = ledger.list_runs()
    assert run.status == "deadline" and "deadline" in run.message
    assert _rents(emu) == 1 and emu.instances == {}


def test_the_deadline_status_survives_the_clis_later_steps(vast_env, tmp_path):
    ledger = Ledger()
    run = _run(ledger, tmp_path)
    ledger.update_run(run.id, status="deadline", message="watchdog: deadline passed 0 s ago")
    for later in ("running", "tearing_down", "failed"):
        ledger.update_run(run.id, status=later, message=f"then {later}")
    assert ledger.get_run(run.id).status == "deadline"


def _req():
    from broker.core.model import Requirements

    return Requirements(nodes=2, gpus_per_node=1, cpu_ok=True, topology="simulated", budget_usd=50, hours=1)


# --------------------------------------------------------------------------------------------------- the provider's rate
def test_a_reported_rate_60_times_the_plan_stops_the_run_with_both_numbers(vast_env, tmp_path):
    from broker.money.cost import RateAboveBudget, run_spent_usd
    from broker.money.provision import provision
    from tests.support.vast_emulator import offer_row

    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.30)], dph_factor=60, boot_s=0.4)
    ledger = Ledger()
    p = _vast()
    run = _run(ledger, tmp_path, budget=0.50)
    with pytest.raises(RateAboveBudget) as err:
        provision(_vast_options(p, budget=0.5, at_least=1)[:1], run, _req(), ledger, providers={"vast": p}, poll_s=0.05,
                  retry_wait_s=0.01, terminate_timeout_s=10)
    msg = err.value.message
    assert "$18.00/h" in msg and "$0.3" in msg and "budget $0.50" in msg, msg
    assert emu.instances == {}  # torn down
    (row,) = ledger.resources(run.id)
    assert row.usd_per_hour == pytest.approx(18.0) and row.attrs["planned_usd_per_hour"] < 0.5
    assert row.state == "terminated"
    # the money so far is counted at the provider's rate: 18 $/h from the intent on
    age_h = (row.terminated_at - row.created_at).total_seconds() / 3600
    assert run_spent_usd(ledger, run.id) >= 18.0 * age_h * 0.999


def test_a_reported_rate_that_still_fits_goes_on_and_every_figure_uses_it(vast_env, tmp_path):
    from broker.money.accounting import run_cost as account
    from broker.money.provision import provision

    from tests.support.vast_emulator import offer_row

    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.30)], dph_factor=2.0, boot_s=0.4)
    ledger = Ledger()
    p = _vast()
    run = _run(ledger, tmp_path, budget=50)
    said: list[str] = []
    cluster = provision(_vast_options(p, at_least=1)[:1], run, _req(), ledger, providers={"vast": p}, poll_s=0.05,
                        retry_wait_s=0.01, terminate_timeout_s=10, progress=said.append)
    assert cluster.nodes
    (row,) = ledger.resources(run.id, live_only=True)
    assert row.usd_per_hour == pytest.approx(0.60) and row.attrs["rate_source"] == "vast reported"
    assert any("$0.60/h" in s and "above the planned" in s and "still fits" in s for s in said), said
    rc = account(ledger.get_run(run.id), ledger.resources(run.id), utcnow())
    assert rc.usd_per_hour == pytest.approx(0.60)  # status / cost / the watchdog's budget rule read this
    assert emu.instances


# --------------------------------------------------------------------------------------------------- dead-man grace
@pytest.mark.parametrize("hours,grace", [(72 / 3600, 60), (0.5, 180), (1.0, 300), (24, 300)])
def test_the_dead_man_grace_scales_with_the_job_and_is_stated(vast_env, tmp_path, hours, grace):
    import math

    from broker.money.accounting import node_layer
    from broker.money.provision import provision
    from tests.support.vast_emulator import offer_row

    emu = vast_env(offers=[offer_row(5101, machine_id=11, dph_total=0.30)], boot_s=0.2)
    ledger = Ledger()
    p = _vast()
    now = utcnow()
    run = _run(ledger, tmp_path, hours=hours)
    ledger.update_run(run.id, started_at=now, deadline=now + timedelta(hours=hours))
    run = ledger.get_run(run.id)
    provision(_vast_options(p, at_least=1)[:1], run, _req(), ledger, providers={"vast": p}, poll_s=0.05,
              retry_wait_s=0.01, terminate_timeout_s=10)
    (body,) = [b for m, path, b in emu.calls if m == "PUT" and path.startswith("/api/v0/asks/")]
    fire_at = int(math.ceil(run.deadline.timestamp() + grace))
    assert f"sleep_until={fire_at}" in body["onstart"] or str(fire_at) in body["onstart"]
    (row,) = ledger.resources(run.id, live_only=True)
    assert row.attrs["deadman_grace_s"] == pytest.approx(grace)
    assert f"deadline + {grace:g} s grace" in node_layer(row, run)


# --------------------------------------------------------------------------------------------------- node stopped
def test_a_node_stopped_mid_job_ends_the_run_promptly_and_shows_as_stopped(tmp_path, fake_cloud):
    import json
    import threading
    import time

    from typer.testing import CliRunner

    from broker.cli.app import app
    from broker.run.cloudtarget import CloudTarget
    from broker.run.runrecord import Hooks
    from broker.run.guard import NodeLost
    from tests.support.plans import rank_options
    from broker.run.pipeline import run_pipeline
    from broker.providers.fake import FakeProvider
    from broker.core.recipe import load_recipe

    state = tmp_path / "fake.json"
    fake_cloud(tmp_path / "home", state)
    (tmp_path / "r").mkdir()
    started = tmp_path / "started"
    (tmp_path / "r" / "job.py").write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\n"
                                           "time.sleep(300)\n")
    (tmp_path / "r" / "r.yaml").write_text("name: t\nscript: job.py\nnodes: 1\ncpu_ok: true\n"
                                           "topology: simulated\nbudget_usd: 50\nmax_hours: 1\n")
    recipe = load_recipe(tmp_path / "r" / "r.yaml")
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    seen: dict = {}

    def stop_it() -> None:  # the console / the provider stops the node while the job runs
        while not started.exists():
            time.sleep(0.05)
        (iid,) = [i for i, x in p.instances().items() if x["state"] == "running"]
        with p._state() as st:
            st["instances"][iid]["state"] = "stopped"
        for _ in range(400):  # what `broker status` says before the run has torn it down
            r = CliRunner().invoke(app, ["status", "--json"])
            live = json.loads(r.output)["live_resources"] if r.exit_code == 0 else []
            if live and (live[0].get("attrs") or {}).get("provider_state") == "stopped":
                seen["status"] = CliRunner().invoke(app, ["status"]).output
                return
            time.sleep(0.02)

    t = threading.Thread(target=stop_it, daemon=True)
    t.start()
    said: list[str] = []
    with pytest.raises(NodeLost, match="stopped"):
        run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                     ledger=ledger, hooks=Hooks(say=said.append))
    t.join(timeout=30)
    (run,) = ledger.list_runs()
    assert run.status == "failed" and "stopped" in run.message
    (row,) = [r for r in ledger.resources(run.id) if r.kind == "instance"]
    assert row.state == "terminated" and row.attrs["provider_state"] == "stopped"
    assert "status" in seen and "stopped" in seen["status"]


def test_the_job_ends_on_the_runs_clock_not_on_max_hours_counted_again(tmp_path, fake_cloud):
    """Provisioning took part of the run's time: the SSH executor's limit is what is left of the deadline (or of
    the budget at the rates the ledger holds), not the recipe's max_hours from now."""
    from broker.core.records import Cluster, ClusterNode
    from broker.run.runrecord import Context, Hooks
    from broker.run.kept import cluster_executor
    from broker.core.recipe import load_recipe

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "job.py").write_text("print('hi')\n")
    (tmp_path / "r" / "r.yaml").write_text("name: t\nscript: job.py\nnodes: 1\ncpu_ok: true\n"
                                           "topology: simulated\nbudget_usd: 50\nmax_hours: 1\n")
    recipe = load_recipe(tmp_path / "r" / "r.yaml")
    ledger = Ledger()
    run = _run(ledger, tmp_path, hours=1.0)
    ledger.update_run(run.id, deadline=utcnow() + timedelta(seconds=120))
    cluster = Cluster(run_id=run.id, provider="vast", topology="simulated", workroot=str(tmp_path / "w"),
                      nodes=[ClusterNode(node_rank=0, host="127.0.0.1", port=22, user="root",
                                         private_ip="127.0.0.1")])
    ex = cluster_executor(recipe, ledger.get_run(run.id), cluster, Context(ledger=ledger, hooks=Hooks()))
    assert 100 < ex.deadline_s <= 120
    # the budget runs out first: $1 at $60/h lasts 60 s
    res = ledger.record_intent(run.id, "vast", "instance", "n0", usd_per_hour=60.0, deadline=run.deadline)
    ledger.mark_created(res.id, "1", state="running")
    ledger.update_run(run.id, budget_usd=1.0, deadline=utcnow() + timedelta(hours=1))
    ex = cluster_executor(recipe, ledger.get_run(run.id), cluster, Context(ledger=ledger, hooks=Hooks()))
    assert 50 < ex.deadline_s <= 60


def test_the_watchdog_takes_the_providers_rate_and_enforces_the_budget_with_it(vast_env, tmp_path):
    """The CLI died before it recorded the rate: the watchdog's scan reads ``dph_total`` 60x the plan from the
    instance list and its budget rule stops the instance at that rate."""
    from broker.money.watchdog import Watchdog

    emu = vast_env(dph_factor=60)
    ledger = Ledger()
    run = _run(ledger, tmp_path, budget=0.50)
    iid, res = _instance_row(ledger, run, emu, usd_per_hour=0.40)  # the plan's $0.40/h: $0.013 in 2 min
    ledger.update_resource(res.id, created_at=utcnow() - timedelta(minutes=2))
    w = Watchdog(ledger, providers={"vast": _vast()}, orphan_scan_s=0, confirm_timeout_s=5, home=tmp_path / "wd")
    acts = w.run_once() + w.run_once()
    row = ledger.resource(res.id)
    assert row.usd_per_hour == pytest.approx(24.0) and row.attrs["planned_usd_per_hour"] == pytest.approx(0.40)
    assert any(a.kind == "terminate" and "budget" in a.reason for a in acts), acts
    assert iid not in emu.instances and row.state == "terminated"
