"""Crash safety with real process kills.

``broker run --provider fake`` runs in a subprocess with ``BROKER_FAKE_HANG=<step>``: it blocks at that exact
lifecycle point and writes a marker; the test SIGKILLs it there (no ``finally`` runs), then shows that
``broker status`` lists the resource as live, that every instance the fake cloud holds is known to the ledger or
found by ``broker reconcile``, and that ``broker down`` (or ``broker reconcile --terminate``) leaves nothing live.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """\
name: crash-probe
script: job.py
nodes: {nodes}
gpus_per_node: 1
cpu_ok: true
budget_usd: 5
max_hours: 0.25
expect: ["JOB_OK"]
"""
JOB = "import os\nprint('rank', os.environ.get('RANK'), flush=True)\nprint('JOB_OK', flush=True)\nos._exit(0)\n"


@pytest.fixture
def env(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "job.py").write_text(JOB)
    (tmp_path / "recipe" / "r.yaml").write_text(RECIPE.format(nodes=1))
    e = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    # no detached watchdog: these tests prove that the ledger alone lets `down` / `reconcile` clean up
    e.update(BROKER_HOME=str(tmp_path / "home"), BROKER_FAKE_STATE=str(tmp_path / "fake.json"),
             PYTHONPATH=str(ROOT), BROKER_WATCHDOG_AUTOSTART="0")
    return tmp_path, e


def broker(args: list[str], e: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker", *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)


def start_and_kill_at(step: str, tmp: Path, e: dict, fail: str = "") -> None:
    marker = Path(f"{e['BROKER_FAKE_STATE']}.hang-{step}")
    env = dict(e, BROKER_FAKE_HANG=step, **({"BROKER_FAKE_FAIL": fail} if fail else {}))
    proc = subprocess.Popen([sys.executable, "-m", "broker", "run", str(tmp / "recipe" / "r.yaml"), "--provider",
                             "fake", "--quiet", "--yes"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"broker run ended (rc {proc.returncode}) before reaching {step}:\n{proc.stdout.read()}")
            if time.monotonic() - t0 > 90:
                pytest.fail(f"broker run never reached {step}")
            time.sleep(0.05)
        assert int(marker.read_text()) == proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI and any job processes it started
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def fake_live(e: dict) -> set[str]:
    p = Path(e["BROKER_FAKE_STATE"])
    st = json.loads(p.read_text()) if p.exists() else {"instances": {}}
    return {i for i, x in st["instances"].items() if x["state"] != "terminated"}


def check_nothing_unseen(e: dict) -> dict:
    """Every instance the fake cloud holds is live in the ledger or reported by reconcile."""
    rec = broker(["reconcile", "--provider", "fake", "--json", "--yes"], e)
    assert rec.returncode == 0, rec.stderr
    out = json.loads(rec.stdout)
    status = json.loads(broker(["status", "--json"], e).stdout)
    ledger_ids = {r["provider_id"] for r in status["live_resources"] if r["provider_id"]}
    seen = ledger_ids | {o["provider_id"] for o in out["orphans"]} | {o["provider_id"] for o in out["adopted"]}
    assert fake_live(e) <= seen, f"resources neither the ledger nor reconcile know: {fake_live(e) - seen}"
    return status


STEPS = ["before-create", "after-create", "ready", "before-terminate", "after-terminate"]


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_each_step_leaves_nothing_down_cannot_find(env, step):
    tmp, e = env
    start_and_kill_at(step, tmp, e)
    status = json.loads(broker(["status", "--json", "--no-refresh"], e).stdout)  # the ledger's own view
    live = status["live_resources"]
    assert len(live) == 1, f"{step}: the ledger must show the resource as live: {status}"
    row = live[0]
    assert row["kind"] == "instance" and row["usd_per_hour"] > 0
    if step in ("before-create", "after-create"):
        assert row["state"] == "intent" and row["provider_id"] is None
    if step == "after-create":
        assert len(fake_live(e)) == 1  # created, but its id never reached the ledger: resolved by the run tag
    status = check_nothing_unseen(e)
    if step == "after-create":  # reconcile lists it as the intent's object without writing; down resolves it
        assert status["live_resources"][0]["provider_id"] is None
    if step == "ready":  # the provider reported running; the CLI died before recording it
        assert row["state"] == "creating" and row["provider_id"] in fake_live(e)
        # `broker status` (refreshing from the provider) shows what the provider says
        assert [r["state"] for r in status["live_resources"]] == ["running"]
    if step in ("before-terminate", "after-terminate"):
        assert row["state"] == "terminating"
        assert fake_live(e) == (set() if step == "after-terminate" else {row["provider_id"]})
    run_id = row["run_id"]
    down = broker(["down", run_id], e)
    assert down.returncode == 0, down.stdout + down.stderr
    assert fake_live(e) == set()
    status = json.loads(broker(["status", "--json"], e).stdout)
    assert status["live_resources"] == []


def test_lost_ledger_row_after_create_is_found_and_removed_by_reconcile(env):
    """Worst case: the crash lands after create and the ledger row is gone (or wrongly says terminated)."""
    tmp, e = env
    start_and_kill_at("after-create", tmp, e)
    import sqlite3

    db = sqlite3.connect(Path(e["BROKER_HOME"]) / "ledger.sqlite")
    db.execute("DELETE FROM resources")
    db.commit()
    db.close()
    assert len(fake_live(e)) == 1
    out = json.loads(broker(["reconcile", "--provider", "fake", "--json"], e).stdout)
    assert out["orphans"] == [] and {o["provider_id"] for o in out["young"]} == fake_live(e)  # seconds old
    out = json.loads(broker(["reconcile", "--provider", "fake", "--json", "--min-age", "0"], e).stdout)
    assert {o["provider_id"] for o in out["orphans"]} == fake_live(e)
    rec = broker(["reconcile", "--provider", "fake", "--terminate", "--yes", "--min-age", "0"], e)
    assert rec.returncode == 0, rec.stdout + rec.stderr
    assert fake_live(e) == set()
    status = json.loads(broker(["status", "--json"], e).stdout)
    assert status["live_resources"] == []


def test_clean_run_tears_down_and_reports_cost(env):
    tmp, e = env
    (tmp / "recipe" / "r.yaml").write_text(RECIPE.format(nodes=2))
    r = broker(["run", str(tmp / "recipe" / "r.yaml"), "--provider", "fake", "--json", "--yes"], e, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["result"]["status"] == "succeeded" and out["still_live"] == []
    assert out["cluster"]["topology"] == "simulated" and out["cost_usd"] > 0
    assert [n["gpu_indices"] for n in out["cluster"]["nodes"]] == [["0"], ["1"]]
    assert fake_live(e) == set() and "tearing down" in r.stderr


def test_ctrl_c_while_provisioning_tears_down_before_exit(env):
    tmp, e = env
    marker = Path(f"{e['BROKER_FAKE_STATE']}.hang-ready")
    proc = subprocess.Popen([sys.executable, "-m", "broker", "run", str(tmp / "recipe" / "r.yaml"), "--provider",
                             "fake", "--quiet", "--yes"], cwd=ROOT, env=dict(e, BROKER_FAKE_HANG="ready"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not marker.exists() and proc.poll() is None and time.monotonic() - t0 < 90:
            time.sleep(0.05)
        assert marker.exists(), proc.stdout.read() if proc.poll() is not None else "never reached ready"
        assert len(fake_live(e)) == 1
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, out
    assert fake_live(e) == set() and "tearing down" in out
    status = json.loads(broker(["status", "--json"], e).stdout)
    assert status["live_resources"] == [] and status["runs"][0]["status"] == "interrupted"


def test_sigkill_after_network_create_is_resolved_by_tag(env):
    """multi-node bootstrap: killed after the VCN exists but before its id reached the ledger."""
    tmp, e = env
    (tmp / "recipe" / "r.yaml").write_text(RECIPE.format(nodes=2) + "topology: multi-node\n")
    start_and_kill_at("after-vcn", tmp, e)
    state = json.loads(Path(e["BROKER_FAKE_STATE"]).read_text())
    assert [n["state"] for n in state["networks"].values()] == ["available"]
    live = json.loads(broker(["status", "--json"], e).stdout)["live_resources"]
    assert [(r["kind"], r["state"], r["provider_id"]) for r in live] == [("vcn", "intent", None)]
    down = broker(["down", live[0]["run_id"]], e)
    assert down.returncode == 0, down.stdout + down.stderr
    state = json.loads(Path(e["BROKER_FAKE_STATE"]).read_text())
    assert [n["state"] for n in state["networks"].values()] == ["terminated"]
