"""``broker slurm up --provider netns --nodes 2`` end to end: real munged, slurmctld and slurmd started over SSH
inside two netns nodes, ``sinfo`` shows 2 idle nodes, ``ddp_2node.yaml`` runs through the cluster with RANK 0 and 1
on different nodes, ``slurm down`` leaves no namespace, daemon or mount.  Skipped with the reason when not root or
slurm-wlm/munge/sshd are missing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

try:
    from tests.support.slurm_cluster import why_not_available
except ImportError:  # tests/ imported as a package
    from tests.support.slurm_cluster import why_not_available

from broker.providers import netns

REPO = Path(__file__).resolve().parents[2]
_why = why_not_available() or netns.missing_requirements()

pytestmark = [pytest.mark.netns, pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_why is not None, reason=f"slurm up tests: {_why}")]


def broker(home: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "BROKER_HOME": str(home), "PYTHONWARNINGS": "ignore", "BROKER_WATCHDOG_AUTOSTART": "0"}
    env.pop("SLURM_CONF", None)
    try:
        return subprocess.run([sys.executable, "-m", "broker", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # say where it stood (the machine may be loaded)
        raise AssertionError(f"broker {' '.join(args)} still running after {timeout} s; stderr so far:\n"
                             f"{(e.stderr or b'')[-3000:]!r}") from None


@pytest.fixture(scope="module")
def cluster():
    """A cluster from `broker slurm up` (module-wide); always torn down with `broker slurm down`.  Its home is
    a folder of its own, not pytest's numbered temp folders: a parallel pytest session prunes those, and the
    cluster's state (and the daemons' files) must outlive the module."""
    home = Path(tempfile.mkdtemp(prefix="broker-slurmup-test-"))
    info = None
    try:
        cp = broker(home, "slurm", "up", "--provider", "netns", "--nodes", "2", "--name", "t1", "--json")
        assert cp.returncode == 0, cp.stderr[-3000:]
        info = json.loads(cp.stdout)
        yield home, info, cp
    finally:
        try:
            if info is not None:
                state = _state(home, info["cluster_id"])
                if state.netns_cid and netns.leftovers(state.netns_cid):
                    broker(home, "slurm", "down", info["cluster_id"])
                    assert not netns.leftovers(state.netns_cid)
        finally:
            shutil.rmtree(home, ignore_errors=True)


def _state(home: Path, cid: str):
    from broker.slurm.render import ClusterState

    return ClusterState.load(home / "runs" / cid)


def _run_row(home: Path, run_id: str):
    os.environ["BROKER_HOME"] = str(home)
    from broker.core.config import settings
    from broker.money.ledger import Ledger

    settings.cache_clear()
    led = Ledger()
    return led, led.get_run(run_id)


def test_up_prints_the_cluster_and_every_node_is_idle(cluster):
    home, info, cp = cluster
    assert [n["name"] for n in info["nodes"]] == ["node0", "node1"]
    assert all(n["cpus"] == os.cpu_count() and n["memory_mb"] > 0 and n["gpus"] == 0 for n in info["nodes"])
    assert "2 node(s) idle" in cp.stderr
    st = broker(home, "slurm", "status", info["cluster_id"], "--json")
    assert st.returncode == 0, st.stderr
    data = json.loads(st.stdout)
    assert [(n["name"], n["state"]) for n in data["nodes"]] == [("node0", "idle"), ("node1", "idle")]
    assert data["queue"] == [] and data["cost_usd"] == 0.0 and data["deadline"]


def test_the_cluster_is_a_run_with_ledger_resources_and_a_deadline(cluster):
    home, info, _ = cluster
    led, run = _run_row(home, info["cluster_id"])
    assert run.provider == "netns" and run.topology == "slurm-cluster" and run.status == "running"
    assert run.pid is None  # the cluster outlives the CLI: the watchdog's dead-CLI rule must not end it
    hours = (run.deadline - run.created_at).total_seconds() / 3600
    assert abs(hours - 2.0) < 0.01  # --max-hours default
    live = led.resources(run.id, live_only=True)
    assert sorted(r.name for r in live) == ["node0", "node1"] and {r.kind for r in live} == {"netns_node"}


def test_munge_key_is_per_cluster_0400_same_everywhere_and_never_recorded(cluster):
    home, info, cp = cluster
    state = _state(home, info["cluster_id"])
    keys = [Path(state.node_dir(i)) / "munge" / "munge.key" for i in range(2)]
    assert all(k.stat().st_mode & 0o777 == 0o400 for k in keys)
    data = [k.read_bytes() for k in keys]
    assert data[0] == data[1] and len(data[0]) == 1024
    host_key = Path("/etc/munge/munge.key")
    if host_key.exists():
        assert data[0] != host_key.read_bytes()  # generated per cluster, not the machine's
    ledger_bytes = b"".join(p.read_bytes() for p in home.glob("ledger.sqlite*") if p.is_file())
    assert ledger_bytes and data[0][:32] not in ledger_bytes
    for text in (cp.stdout, cp.stderr, (home / "runs" / info["cluster_id"] / "slurmcluster.json").read_text()):
        assert data[0].hex()[:32] not in text
    conf = Path(state.conf).read_text()
    assert "SlurmctldHost=node0(" in conf and "NodeName=node1 NodeAddr=" in conf


@pytest.mark.timeout(600)
def test_ddp_2node_runs_through_the_cluster_with_ranks_on_different_nodes(cluster):
    home, info, _ = cluster
    cp = broker(home, "run", "recipes/ddp_2node.yaml", "--provider", "slurm", "--cluster", info["cluster_id"],
                "--json", timeout=500)
    assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-3000:])
    out = json.loads(cp.stdout)
    assert out["result"]["status"] == "succeeded"
    logs = {int(k): Path(v).read_text() for k, v in out["result"]["log_paths"].items()}
    assert re.search(r"RANK=0 .*host=node0", logs[0]) and re.search(r"RANK=1 .*host=node1", logs[1])
    assert out["run"]["provider"] == "slurm"
    # the job folder sits in the cluster's shared directory
    state = _state(home, info["cluster_id"])
    assert (Path(state.shared_dir) / "jobs" / out["run"]["id"] / "work" / "checkpoint.pt").exists()


def test_down_leaves_no_namespace_daemon_or_mount(cluster):
    home, info, _ = cluster
    state = _state(home, info["cluster_id"])
    from broker.slurm.cluster import leftovers
    from broker.slurm.render import pid_files

    pidfiles = [Path(f) for i in range(2) for f in pid_files(state, i)]
    pids = [int(p.read_text().strip()) for p in pidfiles if p.exists() and p.read_text().strip()]
    assert len(pids) == 5  # munged x2, slurmd x2, slurmctld
    assert all(Path(f"/proc/{p}").exists() for p in pids)
    cp = broker(home, "slurm", "down", info["cluster_id"], "--json")
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert json.loads(cp.stdout)["left"] == []
    assert "stopped 5 daemon(s) by PID" in cp.stderr

    def alive(pid: int) -> bool:
        try:
            st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return st != "Z"

    assert not [p for p in pids if alive(p)]
    assert not netns.leftovers(state.netns_cid)
    assert state.base not in Path("/proc/self/mounts").read_text()
    assert leftovers(state) == []
    led, run = _run_row(home, info["cluster_id"])
    assert run.status == "torn_down" and not led.resources(run.id, live_only=True)
    st = broker(home, "slurm", "status", info["cluster_id"], "--json")
    assert json.loads(st.stdout)["status"] == "torn_down"
    # a job on a cluster that is down is refused with a sentence, not a hang
    cp = broker(home, "run", "recipes/ddp_2node.yaml", "--provider", "slurm", "--cluster", info["cluster_id"])
    assert cp.returncode == 2 and "not up" in cp.stderr
