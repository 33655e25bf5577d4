"""The whole rented-machine path over SSH: plan -> ledger-first provisioning -> preflight + torchrun over SSH ->
teardown, with "instances" that are real hosts: network namespaces with their own sshd (providers.netns).

The provider here is the file-backed fake cloud whose instances answer `describe_instance` with a netns node's
address, and whose create puts the run's fresh public key into the nodes' authorized_keys, as cloud-init does on
a real VM.  Both topologies go through the same SSH runner: `multi-node` (one instance per node, master_addr =
node 0's private IP) and `simulated` (one 2-GPU host, two torchruns on it, master_addr 127.0.0.1).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from broker.run.cloudtarget import CloudTarget
from broker.run.runrecord import Hooks
from tests.support.plans import rank_options
from broker.run.pipeline import run_pipeline
from broker.money.ledger import Ledger
from broker.core.model import TopologyKind
from broker.core.records import InstanceInfo, NodeRequest
from broker.core.recipe import load_recipe
from broker.providers.fake import FakeProvider
from tests.conftest import REPO

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture
def hosts(netns_hosts):
    """Two netns hosts with sshd: the "instances" (tests/conftest.py netns_hosts)."""
    return netns_hosts(2)


class NetnsBackedCloud(FakeProvider):
    """The fake cloud, but its instances are reachable hosts (netns nodes) reached over SSH."""

    local_exec = False

    def __init__(self, hosts, workroot: Path):
        super().__init__()
        self.hosts = hosts
        self.node_workroot = str(workroot)
        self.node_of: dict[str, int] = {}

    def create_instance(self, req: NodeRequest) -> str:
        iid = super().create_instance(req)
        self.node_of[iid] = req.node_index
        keys = self.hosts.root / "ssh" / "authorized_keys"
        with open(keys, "a") as f:  # what cloud-init does with the instance's ssh_authorized_keys
            f.write(req.ssh_public_key.strip() + "\n")
        return iid

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        info = super().describe_instance(provider_id, region=region)
        if info.state == "terminated":
            return info
        ip = self.hosts.ip(self.node_of.get(provider_id, 0))
        return info.model_copy(update={"public_ip": ip, "private_ip": ip, "ssh_host": ip, "ssh_user": "root"})


def _recipe(tmp_path: Path, topology: str):
    work = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    (work / "r.yaml").write_text(
        f"name: ssh-{topology}\nscript: ddp_train.py\nargs: ['--epochs', '3']\nnodes: 2\ncpu_ok: true\n"
        f"topology: {topology}\nbudget_usd: 5\nmax_hours: 0.2\nenv: {{DDP_TIMEOUT_S: '60'}}\n"
        "expect: ['ALLREDUCE_OK', 'DDP_OK']\nartifacts: [checkpoint.pt]\n")
    return load_recipe(work / "r.yaml")


@pytest.mark.parametrize("topology", ["multi-node", "simulated"])
def test_rented_cluster_runs_over_ssh_and_is_torn_down(hosts, tmp_path, monkeypatch, topology):
    monkeypatch.setenv("BROKER_FAKE_STATE", str(tmp_path / "fake.json"))
    cloud = NetnsBackedCloud(hosts, tmp_path / "node-work")
    recipe = _recipe(tmp_path, topology)
    options = rank_options(cloud, recipe.requirements())
    assert options and all(o.topology == TopologyKind(topology) for o in options)
    ledger = Ledger()
    lines: list[str] = []
    out = run_pipeline(recipe, CloudTarget(recipe, options, providers={"fake": cloud}, poll_s=0.05), ledger=ledger,
                       hooks=Hooks(echo=lines.append))

    assert out.result is not None and out.result.ok, (out.result and out.result.reason, lines[-30:])
    assert [(r.node, r.rank, r.world_size, r.backend) for r in out.result.ranks] == [(0, 0, 2, "gloo"),
                                                                                    (1, 1, 2, "gloo")]
    assert any(line.startswith("[node 1]") and "ALLREDUCE_OK" in line for line in lines)
    master = out.cluster.master_addr
    assert master == (hosts.ip(0) if topology == "multi-node" else "127.0.0.1")
    assert len({n.host for n in out.cluster.nodes}) == (2 if topology == "multi-node" else 1)
    assert (Path(out.run.run_dir) / "artifacts" / "node0" / "checkpoint.pt").exists()  # artifact from node 0
    assert (tmp_path / "node-work" / "job.done").exists()  # <workroot>/job.done: the node-side idle stop's cue
    # money: every instance was recorded before it was created, and nothing is left billing
    rows = ledger.resources(out.run.id)
    kinds = sorted(r.kind for r in rows)  # multi-node: a private network (vcn + subnet) first
    assert kinds == (["instance", "instance", "subnet", "vcn"] if topology == "multi-node" else ["instance"])
    assert all(r.state == "terminated" and r.terminated_by == "cli" for r in rows)
    events = [(e["resource_id"], e["action"]) for e in ledger.events(out.run.id)]
    for r in rows:
        mine = [a for rid, a in events if rid == r.id]
        assert mine.index("intent") < mine.index("created") < mine.index("terminated")
    assert not [i for i in cloud.instances().values() if i["state"] != "terminated"]
    assert out.run.status == "succeeded" and out.left == []
