"""A preempted run on the real Vast.ai adapter against the Vast API emulator (tests/vast_emulator.py), whose
instances are netns hosts with a real sshd: the host of the first instance is killed mid-run (every process in its
namespace: the host is lost), broker records the preemption, deletes that instance, rents the next offer, puts the
checkpoint back and the shipped ddp_train.py resumes from it."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
from tests.support.plans import rank_options
from broker.core.recipe import load_recipe
from tests.conftest import REPO
from tests.support.netns_faults import kill_host
from tests.support.vast_emulator import API_KEY, VastEmulator, offer_row

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def test_vast_host_killed_mid_run_is_rented_again_and_the_job_resumes(netns_hosts, tmp_path, monkeypatch):
    from broker.providers.vast import VastProvider
    from broker.run.checkpoint import latest_generation

    c = netns_hosts(2)
    emu = VastEmulator(c, offers=[offer_row(5101, machine_id=11), offer_row(5102, machine_id=12)])
    monkeypatch.setenv("VAST_API_URL", emu.url)
    monkeypatch.setenv("VAST_API_KEY", API_KEY)
    try:
        work = tmp_path / "recipe"
        shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
        (work / "r.yaml").write_text(
            "name: vast-preempt\nscript: ddp_train.py\nargs: [--epochs, '40', --resume-dir, ck]\nnodes: 2\n"
            "cpu_ok: true\ntopology: simulated\nbudget_usd: 5\nmax_hours: 0.2\ndisk_gib: 40\n"
            "interruptible: true\ncheckpoint_dir: ck\ncheckpoint_every_s: 1\n"
            "env: {DDP_TIMEOUT_S: '60', PYTHONWARNINGS: ignore}\nexpect: ['DDP_OK']\n")
        recipe = load_recipe(work / "r.yaml")
        vast = VastProvider(backoff_s=0.2, delete_timeout_s=30.0)
        vast.node_workroot = str(tmp_path / "node-work")
        options = rank_options(vast, recipe.requirements())
        ledger = Ledger()
        killed: list[int] = []

        def kill_first_host() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                runs = ledger.list_runs()
                if runs and runs[0].run_dir and latest_generation(Path(runs[0].run_dir)) is not None:
                    with emu._lock:
                        hosts = [i.host for i in emu.instances.values() if i.host is not None]
                    kill_host(c.ns(hosts[0]))
                    killed.append(hosts[0])
                    return
                time.sleep(0.05)

        t = threading.Thread(target=kill_first_host, daemon=True)
        t.start()
        said: list[str] = []
        target = CloudTarget(recipe, options, providers={"vast": vast}, poll_s=0.2, ready_timeout_s=60)
        out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks(say=said.append))
        t.join(timeout=5)
        assert killed == [0], said
        log = Path(out.run.run_dir, "node0.log").read_text()
        assert out.exit_code == 0, (out.result.reason, said[-12:], log[-1500:])
        assert int(log.split("resumed_from_epoch=")[1].split()[0]) > 0
        attempts = ledger.attempts(out.run.id)
        assert [a["cause"] for a in attempts] == ["preempted", "succeeded"]
        rows = {r.id: r for r in ledger.resources(out.run.id)}
        iids = [int(rows[a["resource_ids"][0]].provider_id) for a in attempts]
        assert len(set(iids)) == 2 and all(i in emu.destroyed and i not in emu.instances for i in iids)
        assert ledger.resources(out.run.id, live_only=True) == []
        from broker.run.attempts import attempt_costs

        assert all(a["usd"] > 0 for a in attempt_costs(ledger, out.run.id))
    finally:
        emu.close()
