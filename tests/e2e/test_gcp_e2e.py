"""The REAL gcp adapter end to end through the whole pipeline: ``run_pipeline(recipe, CloudTarget(...))`` with the
official Google clients pointed at tests/support/gcp_emulator.py (AnonymousCredentials, REST transport): the run's VPC,
subnet and firewall rules, two single-GPU "VMs" (multi-node), the SSH executor, teardown in dependency order.  The
"instances" are two network-namespace hosts with real sshd (tests/conftest.py ``netns_hosts``): the emulator gives
each instance networkIP = natIP = the netns host's address and, when it turns RUNNING, appends the instance's
``ssh-keys`` metadata to that host's authorized_keys (what the guest agent does on a real VM: that user, ``broker``,
has passwordless sudo and root cannot log in, as on the real images).  Nothing leaves
127.0.0.0/8 and the namespaces."""

from __future__ import annotations

from pathlib import Path
import shutil
from typing import Any

import pytest

pytest.importorskip("google.cloud.compute_v1")

from google.auth.credentials import AnonymousCredentials  # noqa: E402

from broker.core.model import utcnow  # noqa: E402
from broker.core.recipe import load_recipe  # noqa: E402
from broker.money.ledger import Ledger  # noqa: E402
from broker.plan.planner import plan  # noqa: E402
from broker.run.pipeline import CloudTarget, Hooks, run_pipeline  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.support.gcp_emulator import authorize_on, GCPEmulator  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]
COLLS = ("instances", "disks", "networks", "subnetworks", "firewalls")


def _recipe(tmp_path: Path):
    work = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    (work / "r.yaml").write_text(
        "name: gcp-e2e\nscript: ddp_train.py\nargs: ['--epochs', '2']\nnodes: 2\ncpu_ok: true\n"
        "topology: multi-node\nbudget_usd: 20\nmax_hours: 0.2\nenv: {DDP_TIMEOUT_S: '60'}\n"
        "expect: ['ALLREDUCE_OK', 'DDP_OK']\n")
    return load_recipe(work / "r.yaml")


def test_two_node_run_on_emulated_gcp_succeeds_and_leaves_nothing(netns_hosts, tmp_path):
    from broker.providers.gcp import GCPProvider

    hosts = netns_hosts(2, login_user="broker")  # the ssh-keys user, with sudo: root cannot log in

    on_running = authorize_on(hosts, user="broker")

    with GCPEmulator(project="broker-e2e", addresses=lambda i: (hosts.ip(i), hosts.ip(i)),
                     on_running=on_running) as emu:
        emu.stockout.add("us-central1-a")  # the first zone is out of stock: failover to the next one
        p = GCPProvider(project="broker-e2e", credentials=AnonymousCredentials(), compute_endpoint=emu.url,
                        poll_s=0.05)
        recipe = _recipe(tmp_path)
        req = recipe.requirements()
        offers = [o for o in p.offers(req) if o.instance_type == "n1-standard-4+t4"]
        options = [o for o in plan(req, offers, now=utcnow()).options if o.valid]
        assert options and options[0].offers[0].zone == "us-central1-a"
        lines: list[str] = []
        ledger = Ledger()
        out = run_pipeline(recipe, CloudTarget(recipe, options[:3], providers={"gcp": p}, poll_s=0.2),
                           ledger=ledger, hooks=Hooks(echo=lines.append, say=lines.append))
        assert out.result is not None and out.result.ok, (out.result and out.result.reason, lines[-40:])
        assert [(r.node, r.rank, r.world_size) for r in out.result.ranks] == [(0, 0, 2), (1, 1, 2)]
        assert out.cluster.master_addr == hosts.ip(0)
        assert any("capacity" in line and "us-central1-a" in line for line in lines), lines
        kinds = sorted(r.kind for r in Ledger().resources(out.run.id))
        assert {"vpc", "subnet", "firewall"} <= set(kinds) and kinds.count("firewall") == 2
        assert out.left == [] and ledger.resources(out.run.id, live_only=True) == []
        assert {c: emu.live(c) for c in COLLS} == {c: [] for c in COLLS}
        assert out.run.status == "succeeded"
        deletes = [pth.split("/")[-2] for m, pth, st in emu.journal if m == "DELETE" and st == 200]
        rank = {"instances": 0, "subnetworks": 1, "firewalls": 2, "networks": 3}
        assert [rank[c] for c in deletes] == sorted(rank[c] for c in deletes), deletes
