"""Recipe ``idle_minutes`` end to end on the fake cloud: ``run_on_cloud`` keeps the nodes of a finished job (attrs
carry ``idle_minutes``, the run is ended), the watchdog terminates them once the idle time has passed; without
``idle_minutes``, or without a watchdog, or after Ctrl-C, the run is torn down at once as before."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.support.clock import FakeClock
from broker.run.cloudtarget import CloudTarget
from broker.run.runrecord import Hooks
from tests.support.plans import rank_options
from broker.run.pipeline import run_pipeline
from broker.money.ledger import Ledger
from broker.core.recipe import load_recipe
from broker.money.watchdog import Watchdog
from broker.providers.fake import FakeProvider
from tests.conftest import REPO, broker_cmd


@pytest.fixture
def home(fake_cloud_home):
    return fake_cloud_home


@pytest.fixture
def ledger(home):
    led = Ledger(home / "ledger.sqlite")
    yield led
    led.close()


def _recipe(tmp_path, idle: str = "", script: str = "print('JOB_OK', flush=True)\n"):
    work = tmp_path / "recipe"  # not the broker home (tmp_path): the work dir is copied into the run folder
    work.mkdir(exist_ok=True)
    (work / "job.py").write_text(script)
    r = work / "r.yaml"
    r.write_text("name: idle\nscript: job.py\nnodes: 1\ncpu_ok: true\nmax_hours: 1\nbudget_usd: 5\n"
                 f"expect: [JOB_OK]\n{idle}")
    return r


def _run(tmp_path, ledger, idle: str = "", **kw):
    recipe = load_recipe(_recipe(tmp_path, idle, **{k: v for k, v in kw.items() if k == "script"}))
    cloud = FakeProvider()
    target = CloudTarget(recipe, rank_options(cloud, recipe.requirements()), providers={"fake": cloud}, poll_s=0.05,
                         **{k: v for k, v in kw.items() if k != "script"})
    out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks())
    return out, cloud


def _live(cloud):
    return [i for i in cloud.instances().values() if i["state"] != "terminated"]


def test_idle_minutes_keeps_the_nodes_until_the_watchdog_sees_the_idle_time(tmp_path, ledger):
    out, cloud = _run(tmp_path, ledger, "idle_minutes: 10\n")
    assert out.result is not None and out.result.ok
    assert out.kept_until_idle and out.left == []
    rows = ledger.resources(out.run.id)
    inst = [r for r in rows if r.kind == "instance"]
    assert len(inst) == 1 and inst[0].live and inst[0].attrs["idle_minutes"] == 10
    assert [r.id for r in out.kept] == [inst[0].id]
    assert len(_live(cloud)) == 1  # still there at the provider
    run = ledger.get_run(out.run.id)
    assert run.status == "succeeded" and run.ended_at is not None
    assert "kept for inspection" in (run.message or "")
    assert any(e["action"] == "keep-idle" for e in ledger.events(run.id))

    clock = FakeClock(run.ended_at)
    w = Watchdog(ledger, providers={"fake": cloud}, clock=clock, interval_s=5, home=ledger.path.parent,
                 orphan_scan_s=0)
    clock.advance(9 * 60)  # past the ordinary 120 s grace, inside the idle time
    assert [a for a in w.run_once() if a.kind == "terminate"] == []
    assert len(_live(cloud)) == 1
    clock.advance(61)
    acts = [a for a in w.run_once() if a.kind == "terminate"]
    assert [a.resource_id for a in acts] == [inst[0].id]
    assert "idle 10 min after the job ended (succeeded)" in acts[0].reason
    res = ledger.resource(inst[0].id)
    assert res.state == "terminated" and res.terminated_by == "watchdog"
    assert _live(cloud) == []


def test_failed_job_is_kept_too_with_its_status(tmp_path, ledger):
    out, cloud = _run(tmp_path, ledger, "idle_minutes: 1\n", script="raise SystemExit(3)\n")
    assert out.result is not None and out.result.status == "failed"
    assert out.kept_until_idle and len(_live(cloud)) == 1
    assert ledger.get_run(out.run.id).status == "failed"
    from broker.money.teardown import teardown_run

    assert teardown_run(ledger, out.run.id, "down") == [] and _live(cloud) == []


def test_without_idle_minutes_the_run_is_torn_down_at_once(tmp_path, ledger):
    out, cloud = _run(tmp_path, ledger)
    assert out.result.ok and not out.kept_until_idle and out.kept == []
    rows = ledger.resources(out.run.id)
    assert rows and all(r.state == "terminated" and r.terminated_by == "cli" for r in rows)
    assert all("idle_minutes" not in r.attrs for r in rows)
    assert _live(cloud) == [] and ledger.get_run(out.run.id).status == "succeeded"


def test_keep_when_idle_false_tears_down_at_once(tmp_path, ledger):
    out, cloud = _run(tmp_path, ledger, "idle_minutes: 10\n", keep_when_idle=False)
    assert out.result.ok and not out.kept_until_idle
    assert _live(cloud) == [] and all(r.state == "terminated" for r in ledger.resources(out.run.id))


def test_ctrl_c_tears_down_even_with_idle_minutes(tmp_path, ledger, monkeypatch):
    import broker.run.launch as launch

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch.LocalExecutor, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, ledger, "idle_minutes: 10\n")
    runs = ledger.list_runs(limit=10)
    assert len(runs) == 1 and runs[0].status == "interrupted"
    assert all(r.state == "terminated" for r in ledger.resources(runs[0].id))


def test_cli_keeps_nodes_with_a_watchdog_and_says_how_to_reach_and_stop_them(cli_env, broker_home, tmp_path):
    env = dict(cli_env, BROKER_WATCHDOG_AUTOSTART="1", BROKER_FAKE_STATE=str(tmp_path / "fake.json"))
    recipe = _recipe(tmp_path, "idle_minutes: 5\n")
    p = subprocess.run(broker_cmd("run", str(recipe), "--provider", "fake", "-q", "--yes"), cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    wd_pid = None
    try:
        assert p.returncode == 0, p.stdout + p.stderr
        wd_pid = int(p.stderr.split("watchdog started (pid ")[1].split(")")[0])
        assert "nodes kept for inspection (recipe idle_minutes=5)" in p.stderr
        assert "the watchdog terminates them 5 min after the job ended" in p.stderr  # fake: no node-side watch
        run_id = p.stderr.split("stop them now: broker down ")[1].split()[0]
        led = Ledger(broker_home / "ledger.sqlite")
        try:
            assert [r.attrs["idle_minutes"] for r in led.resources(run_id, live_only=True)] == [5]
            assert led.get_run(run_id).status == "succeeded"
        finally:
            led.close()
    finally:
        if wd_pid:
            os.kill(wd_pid, signal.SIGKILL)
        d = subprocess.run(broker_cmd("down", "--all", "--yes"), cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
        assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.parametrize("flags,why", [(["--no-watchdog"], "--no-watchdog"),
                                       ([], "no watchdog is running (BROKER_WATCHDOG_AUTOSTART is off")])
def test_cli_without_a_watchdog_ignores_idle_minutes_and_says_why(cli_env, broker_home, tmp_path, flags, why):
    env = dict(cli_env, BROKER_FAKE_STATE=str(tmp_path / "fake.json"))  # autostart off (conftest)
    recipe = _recipe(tmp_path, "idle_minutes: 5\n")
    p = subprocess.run(broker_cmd("run", str(recipe), "--provider", "fake", "-q", "--yes", *flags), cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"idle_minutes=5 is ignored: {why}" in p.stderr.replace("\n", " ")
    assert "kept for inspection" not in p.stderr
    led = Ledger(broker_home / "ledger.sqlite")
    try:
        assert led.resources(live_only=True) == []
    finally:
        led.close()


def test_idle_minutes_set_by_the_flag_is_named_as_the_flag(cli_env, broker_home, tmp_path):
    """`--idle-minutes 5` was reported as "(recipe idle_minutes=5)": a line names what the user typed."""
    env = dict(cli_env, BROKER_FAKE_STATE=str(tmp_path / "fake.json"))
    recipe = _recipe(tmp_path, "")
    p = subprocess.run(broker_cmd("run", str(recipe), "--provider", "fake", "-q", "--yes", "--no-watchdog",
                                  "--idle-minutes", "5"), cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    text = p.stderr.replace("\n", " ")
    assert "--idle-minutes 5 is ignored: --no-watchdog" in text and "recipe idle_minutes" not in text, text


def test_kept_message_names_the_key_endpoint_and_how_to_stop():
    from types import SimpleNamespace

    from broker.cli.lifecycle import kept_message
    from broker.core.model import TopologyKind, utcnow
    from broker.core.records import Cluster, ClusterNode, Resource

    cluster = Cluster(run_id="run-x", provider="vast", topology=TopologyKind.multi_node, workroot="/root/broker",
                      ssh_key_path="/home/me/.broker/runs/run-x/ssh/id_ed25519",
                      nodes=[ClusterNode(node_rank=0, host="ssh5.vast.ai", port=31456, user="root",
                                         private_ip="10.0.0.5")])
    res = Resource(id="res-1", run_id="run-x", provider="vast", kind="instance", name="broker-run-x-n0",
                   provider_id="456", state="running", created_at=utcnow())
    lines = kept_message(SimpleNamespace(run=SimpleNamespace(id="run-x"), cluster=cluster, kept=[res]), 15)
    text = "\n".join(lines)
    assert "vast 456" in lines[0]
    assert "ssh -i /home/me/.broker/runs/run-x/ssh/id_ed25519 -p 31456 root@ssh5.vast.ai" in text
    assert "15 min after the last SSH session closes" in text and "watchdog 15 min after the job ended" in text
    assert lines[-1].strip() == "stop them now: broker down run-x"
