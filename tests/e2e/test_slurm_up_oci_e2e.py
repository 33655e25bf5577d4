"""``broker slurm up --provider oci`` end to end, not only rendered: the CLI, the REAL ``oci`` SDK pointed at the
local emulator (tests/support/oci_emulator.py, ``OCI_SERVICE_ENDPOINT``), two "instances" that are netns hosts with real
sshd (as tests/e2e/test_oci_e2e.py): munge, slurmctld and slurmd started over SSH on the cloud path, ``sinfo`` shows
both nodes idle, ``broker slurm submit`` runs the chapter's fixed file on both nodes, ``slurm down`` terminates
every OCI object (confirmed by the emulator) and leaves no daemon.

Each "VM" gets what a real VM has of its own: a private ``/var/lib/broker-slurm`` (the cluster's base) bind-mounted
in its mount namespace; ``/srv/broker-shared`` is one folder bind-mounted on both, standing in for the NFS mount
(this machine has no NFS server: the export/mount scripts are covered by rendering in test_slurm_up_render.py,
and ``slurm up`` sees the directory already shared and skips NFS, saying so)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

oci = pytest.importorskip("oci")

try:
    from tests.support.slurm_cluster import why_not_available
except ImportError:  # tests/ imported as a package
    from tests.support.slurm_cluster import why_not_available

from tests.conftest import REPO, broker_cmd  # noqa: E402
from tests.support.oci_emulator import OCIEmulator  # noqa: E402
from tests.e2e.test_oci_e2e import AD, COMP, REGION, oci_config_file  # noqa: E402

_why = why_not_available()
pytestmark = [pytest.mark.netns, pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_why is not None, reason=f"slurm up on OCI: {_why}")]

CLOUD_BASE = "/var/lib/broker-slurm"
SHARED = "/srv/broker-shared"


class Cloud:
    def __init__(self, hosts: Any, tmp_path: Path):
        self.hosts = hosts
        self.made: list[str] = []
        for d in (CLOUD_BASE, SHARED):  # mount points on this machine (removed after, when we made them)
            if not Path(d).exists():
                Path(d).mkdir(parents=True)
                self.made.append(d)
        shared = tmp_path / "shared"
        shared.mkdir()
        for i, pid in enumerate(hosts.sshd_pids):
            disk = tmp_path / f"vm{i}-var-lib-broker-slurm"
            disk.mkdir()
            for src, dst in ((disk, CLOUD_BASE), (shared, SHARED)):
                subprocess.run(["nsenter", "-t", str(pid), "-m", "mount", "--bind", str(src), dst], check=True)
        self.emu = OCIEmulator(compartment=COMP, ads=(AD,), region=REGION, addresses=self.addresses,
                               on_running=self.on_running, login_user="root")

    def addresses(self, node: int) -> tuple[str, str]:
        return self.hosts.ip(node), self.hosts.ip(node)

    def on_running(self, inst: dict[str, Any]) -> None:
        with open(self.hosts.root / "ssh" / "authorized_keys", "a") as f:  # what cloud-init does
            f.write(inst["metadata"]["ssh_authorized_keys"].strip() + "\n")

    def close(self) -> None:
        self.emu.__exit__()
        for d in self.made:
            try:
                Path(d).rmdir()
            except OSError:
                pass


@pytest.fixture
def cloud(netns_hosts, tmp_path):
    c = Cloud(netns_hosts(2), tmp_path)
    c.emu.__enter__()
    yield c
    c.close()


def test_slurm_up_on_oci_builds_runs_a_job_and_down_leaves_nothing(cloud, tmp_path, key_pem, cli_env):
    env = dict(cli_env, OCI_CONFIG_FILE=str(oci_config_file(tmp_path, key_pem)), OCI_SERVICE_ENDPOINT=cloud.emu.url,
               OCI_COMPARTMENT_ID=COMP, COLUMNS="200")

    def broker(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(broker_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)

    cid = None
    try:
        cp = broker("slurm", "up", "--provider", "oci", "--nodes", "2", "--name", "ociup", "--yes", "--json",
                    "--no-watchdog")
        assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-4000:])
        info = json.loads(cp.stdout)
        cid = info["cluster_id"]
        assert [n["private_ip"] for n in info["nodes"]] == [cloud.hosts.ip(0), cloud.hosts.ip(1)]
        assert "2 node(s) idle" in cp.stderr and "no NFS export needed" in cp.stderr, cp.stderr[-3000:]
        assert len(cloud.emu.live("instances")) == 2
        st = json.loads(broker("slurm", "status", cid, "--json").stdout)
        assert [(n["name"], n["state"]) for n in st["nodes"]] == [("node0", "idle"), ("node1", "idle")]
        assert st["provider"] == "oci" and st["shared_dir"] == SHARED
        cp = broker("slurm", "submit", str(REPO / "tests" / "slurm_book" / "train_ddp_fixed.sh"), "--cluster", cid)
        assert cp.returncode == 0, (cp.stdout[-3000:], cp.stderr[-3000:])
        assert re.search(r"^\[node 0\] rank 0/2 on node0", cp.stdout, re.M), cp.stdout
        assert re.search(r"^\[node 1\] rank 1/2 on node1", cp.stdout, re.M), cp.stdout
        cp = broker("slurm", "down", cid, "--json")
        assert cp.returncode == 0 and json.loads(cp.stdout)["left"] == [], cp.stderr[-3000:]
        assert "stopped 5 daemon(s) by PID" in cp.stderr
        cid = None
        live = {c: [o["id"] for o in cloud.emu.live(c)] for c in ("instances", "subnets", "securityLists",
                                                                   "internetGateways", "vcns")}
        assert live == {c: [] for c in live}, live
        left = subprocess.run(["pgrep", "-af", f"{CLOUD_BASE}/{info['cluster_id']}"], capture_output=True, text=True)
        assert left.stdout.strip() == "", left.stdout
    finally:
        if cid is not None:
            broker("slurm", "down", cid)
