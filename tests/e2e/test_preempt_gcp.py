"""A preempted Spot run on the REAL gcp adapter end to end: the official Google clients against
tests/support/gcp_emulator.py, whose "VMs" are network-namespace hosts with a real sshd (tests/conftest.py
``netns_hosts``; each insert gets the next host).  Mid-run, once a checkpoint copy exists, Google preempts the Spot
VM (the emulator's ``compute.instances.preempted`` operation, the VM deleted per instanceTerminationAction DELETE)
and the host dies with it; broker records the preemption in Google's words, rents a Spot VM again, puts the
checkpoint back and the shipped ddp_train.py resumes from it.  Nothing leaves 127.0.0.0/8 and the namespaces."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("google.cloud.compute_v1")

from google.auth.credentials import AnonymousCredentials  # noqa: E402

from broker.core.recipe import load_recipe  # noqa: E402
from broker.core.sshkeys import host_key_name, pinned_keys  # noqa: E402
from broker.money.ledger import Ledger  # noqa: E402
from broker.run.pipeline import CloudTarget, Hooks, run_pipeline  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.support.gcp_emulator import authorize_on, GCPEmulator  # noqa: E402
from tests.support.netns_faults import kill_host as _kill_host, rehost  # noqa: E402
from tests.support.plans import rank_options  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]
COLLS = ("instances", "disks", "networks", "subnetworks", "firewalls")


@pytest.mark.parametrize("same_address", [False, True], ids=["new-address", "recycled-address-new-host-key"])
def test_gcp_spot_vm_preempted_mid_run_is_rented_again_and_the_job_resumes(netns_hosts, tmp_path, same_address):
    """``same_address``: the VM rented again gets the preempted one's address (Google recycles ephemeral
    addresses) with a new host key: a new machine, reached, never refused as a changed key."""
    from broker.providers.gcp import GCPProvider
    from broker.run.attempts import attempt_costs
    from broker.run.checkpoint import latest_generation

    hosts = netns_hosts(1 if same_address else 2)
    inserts: list[int] = []
    new_keys: list[str] = []

    def addresses(_node: int) -> tuple[str, str]:
        inserts.append(len(inserts))  # each new VM is the next host: the preempted one is dead
        if same_address:  # ... or the same host made a new machine: same address, another host key
            if len(inserts) > 1:
                new_keys.append(rehost(hosts, 0))
            return hosts.ip(0), hosts.ip(0)
        ip = hosts.ip(inserts[-1])
        return ip, ip

    on_running = authorize_on(hosts)

    with GCPEmulator(project="broker-e2e", addresses=addresses, on_running=on_running) as emu:
        p = GCPProvider(project="broker-e2e", credentials=AnonymousCredentials(), compute_endpoint=emu.url,
                        ssh_user="root", poll_s=0.05)
        p.node_workroot = str(tmp_path / "node-work")
        work = tmp_path / "recipe"
        shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
        (work / "r.yaml").write_text(
            "name: gcp-preempt\nscript: ddp_train.py\nargs: [--epochs, '40', --resume-dir, ck]\nnodes: 2\n"
            "cpu_ok: true\ntopology: simulated\nbudget_usd: 10\nmax_hours: 0.2\ngpu: {models: [T4]}\n"
            "interruptible: true\ncheckpoint_dir: ck\ncheckpoint_every_s: 1\nmax_restarts: 2\n"
            "env: {DDP_TIMEOUT_S: '60', PYTHONWARNINGS: ignore}\nexpect: ['DDP_OK']\n")
        recipe = load_recipe(work / "r.yaml")
        options = rank_options(p, recipe.requirements())
        assert options and all(o.interruptible for o in options)
        ledger = Ledger()
        preempted: list[str] = []
        stamps: dict[str, float] = {}
        said: list[str] = []
        after: list[tuple[float, str]] = []

        def say(line: Any) -> None:
            said.append(str(line))
            if "preempted" in stamps:
                after.append((time.monotonic() - stamps["preempted"], str(line)[:90]))

        def preempt_first_vm() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                runs = ledger.list_runs()
                if runs and runs[0].run_dir and latest_generation(Path(runs[0].run_dir)) is not None:
                    with emu.lock:
                        inst = next(iter(emu.objs["instances"].values()))
                    zone = inst["zone"].rsplit("/", 1)[-1]
                    emu.preempt(zone, inst["name"])
                    _kill_host(hosts.ns(0))
                    stamps["preempted"] = time.monotonic()
                    preempted.append(f"{zone}:{inst['name']}")
                    return
                time.sleep(0.05)

        t = threading.Thread(target=preempt_first_vm, daemon=True)
        t.start()
        target = CloudTarget(recipe, options, providers={"gcp": p}, poll_s=0.2, ready_timeout_s=60)
        out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks(say=say))
        t.join(timeout=5)
        assert len(preempted) == 1, said[-20:]
        log = Path(out.run.run_dir, "node0.log").read_text()
        assert out.exit_code == 0, (out.result and out.result.reason, said[-20:], log[-1500:])
        assert int(log.split("resumed_from_epoch=")[1].split()[0]) > 0
        attempts = ledger.attempts(out.run.id)
        assert [a["cause"] for a in attempts] == ["preempted", "succeeded"], said[-20:]
        assert "compute.instances.preempted" in (attempts[0]["detail"] or ""), attempts[0]
        # both attempts rented Spot VMs, two VMs in all, each its own incarnation of the node's name
        spot = [i for i in emu.objs["operations"].values() if i["op"]["operationType"] == "insert"
                and "/instances/" in i["op"]["targetLink"]]
        assert len(spot) == 2 and inserts == [0, 1]
        if same_address:  # both VMs answered on one address, each pinned under its own resource id
            kh = Path(out.run.run_dir) / "ssh" / "known_hosts"
            rows = sorted((r for r in ledger.resources(out.run.id) if r.kind == "instance"),
                          key=lambda r: r.created_at)
            pins = [pinned_keys(kh, host_key_name(hosts.ip(0), 22, r.id)) for r in rows]
            assert len(new_keys) == 1 and pins[1] == new_keys and pins[0] and pins[0] != pins[1], pins
            assert not any("not trusted" in line or "host key" in line for line in said), said[-20:]
        assert ledger.resources(out.run.id, live_only=True) == []
        assert {c: emu.live(c) for c in COLLS} == {c: [] for c in COLLS}
        costs = attempt_costs(ledger, out.run.id)
        assert len(costs) == 2 and all(a["usd"] > 0 for a in costs)
        gap = (attempts[1]["started_at"] - attempts[0]["ended_at"]).total_seconds()
        print(f"attempt 1 {attempts[0]['started_at']:%H:%M:%S}-{attempts[0]['ended_at']:%H:%M:%S}, "
              f"attempt 2 from {attempts[1]['started_at']:%H:%M:%S} (+{gap:.1f} s); progress after the preemption:")
        for dt, line in after[:40]:
            print(f"  +{dt:6.1f} s  {line}")
        rows = [r for r in ledger.resources(out.run.id) if r.kind == "instance"]
        assert rows and all((r.attrs or {}).get("interruptible") is True for r in rows)
