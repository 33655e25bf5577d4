"""``broker slurm up --provider oci`` and ``--provider gcp`` end to end, not only rendered: the CLI, the REAL ``oci``
SDK / Google clients pointed at the local emulators (tests/support/oci_emulator.py, ``OCI_SERVICE_ENDPOINT``;
tests/support/gcp_emulator.py, ``GCP_COMPUTE_ENDPOINT``), two "instances" that are netns hosts with real sshd whose
login user is the image's own (``ubuntu`` on OCI, the ``ssh-keys`` user on GCE) with passwordless sudo, root login
refused: munge (its key 0400, owned by munge), slurmctld and slurmd started through ``sudo -n`` over SSH on the
cloud path, ``sinfo`` shows both nodes idle, a recipe runs through ``broker run --provider slurm --cluster``,
``slurm down`` terminates every cloud object (confirmed by the emulator) and leaves no daemon.

Each "VM" gets what a real VM has of its own: a private ``/var/lib/broker-slurm`` (the cluster's base) bind-mounted
in its mount namespace; ``/srv/broker-shared`` is one folder bind-mounted on both, standing in for the NFS mount
(this machine has no NFS server: the export/mount scripts are covered by rendering in test_slurm_up_render.py,
and ``slurm up`` sees the directory already shared and skips NFS, saying so)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

oci = pytest.importorskip("oci")

from tests.support.slurm_cluster import why_not_available

from tests.conftest import REPO, broker_cmd  # noqa: E402
from tests.support.gcp_emulator import GCPEmulator, authorize_on  # noqa: E402
from tests.support.oci_emulator import OCIEmulator  # noqa: E402
from tests.e2e.test_oci_e2e import AD, COMP, REGION, oci_config_file  # noqa: E402

_why = why_not_available()
pytestmark = [pytest.mark.netns, pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_why is not None, reason=f"slurm up on OCI: {_why}")]

CLOUD_BASE = "/var/lib/broker-slurm"
SHARED = "/srv/broker-shared"
#: the images' login users (passwordless sudo, root cannot log in): OCI's Ubuntu image, the GCE metadata ssh-keys user
LOGIN = {"oci": "ubuntu", "gcp": "broker"}


class Cloud:
    def __init__(self, hosts: Any, tmp_path: Path, provider: str):
        self.hosts, self.tmp = hosts, tmp_path
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
        if provider == "oci":
            self.emu: Any = OCIEmulator(compartment=COMP, ads=(AD,), region=REGION, addresses=self.addresses,
                                        on_running=self.on_running, login_user=LOGIN["oci"])
        else:
            self.emu = GCPEmulator(project="broker-slurm", addresses=self.addresses,
                                   on_running=authorize_on(hosts, user=LOGIN["gcp"]))
        self.provider = provider

    def env(self, key_pem: str) -> dict[str, str]:
        if self.provider == "oci":
            return dict(OCI_CONFIG_FILE=str(oci_config_file(self.tmp, key_pem)), OCI_SERVICE_ENDPOINT=self.emu.url,
                        OCI_COMPARTMENT_ID=COMP)
        adc = self.tmp / "gcloud"
        adc.mkdir()
        (adc / "application_default_credentials.json").write_text(json.dumps(
            {"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "t"}))
        return dict(CLOUDSDK_CONFIG=str(adc), GOOGLE_CLOUD_PROJECT=self.emu.project, GCP_COMPUTE_ENDPOINT=self.emu.url,
                    GCP_QUOTAS_ENDPOINT=self.emu.url, GCP_BILLING_ENDPOINT=self.emu.url, GCP_SSH_USER=LOGIN["gcp"])

    def live(self) -> dict[str, list[str]]:
        colls = (("instances", "subnets", "securityLists", "internetGateways", "vcns") if self.provider == "oci"
                 else ("instances", "disks", "networks", "subnetworks", "firewalls"))
        return {c: [str(o.get("id") or o.get("name")) for o in self.emu.live(c)] for c in colls}

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


@pytest.fixture(params=["oci", "gcp"])
def cloud(netns_hosts, tmp_path, request):
    c = Cloud(netns_hosts(2, login_user=LOGIN[request.param]), tmp_path, request.param)
    c.emu.__enter__()
    yield c
    c.close()


def _recipe(tmp_path: Path) -> Path:
    """The shipped DDP script, 2 epochs, CPU: what a user runs on the cluster."""
    work = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    (work / "r.yaml").write_text(
        "name: slurm-cloud\nscript: ddp_train.py\nargs: ['--epochs', '2']\nnodes: 2\ncpu_ok: true\n"
        "budget_usd: 5\nmax_hours: 0.2\nenv: {DDP_TIMEOUT_S: '60', PYTHONWARNINGS: ignore}\n"
        "expect: ['ALLREDUCE_OK', 'DDP_OK']\n")
    return work / "r.yaml"


@pytest.mark.timeout(900)
def test_slurm_up_on_a_cloud_vm_whose_login_is_not_root_runs_a_recipe_and_down_leaves_nothing(cloud, tmp_path,
                                                                                              key_pem, cli_env):
    p = cloud.provider
    env = dict(cli_env, **cloud.env(key_pem), COLUMNS="200")

    def broker(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(broker_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)

    cid = None
    try:
        cp = broker("slurm", "up", "--provider", p, "--nodes", "2", "--name", f"{p}up", "--yes", "--json",
                    "--no-watchdog")
        assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-4000:])
        print(f"$ broker slurm up --provider {p} --nodes 2 (login user {LOGIN[p]})\n" + cp.stderr)
        info = json.loads(cp.stdout)
        cid = info["cluster_id"]
        assert [n["private_ip"] for n in info["nodes"]] == [cloud.hosts.ip(0), cloud.hosts.ip(1)]
        assert "2 node(s) idle" in cp.stderr and "no NFS export needed" in cp.stderr, cp.stderr[-3000:]
        assert len(cloud.emu.live("instances")) == 2
        st = json.loads(broker("slurm", "status", cid, "--json").stdout)
        assert [(n["name"], n["state"]) for n in st["nodes"]] == [("node0", "idle"), ("node1", "idle")]
        assert st["provider"] == p and st["shared_dir"] == SHARED
        # the MUNGE key on each VM's disk: 0400, owned by munge (munged runs as munge, started through sudo)
        for i in range(2):
            key = tmp_path / f"vm{i}-var-lib-broker-slurm" / cid / "nodes" / f"node{i}" / "munge" / "munge.key"
            assert (key.stat().st_mode & 0o777, key.stat().st_uid) == (0o400, pwd.getpwnam("munge").pw_uid), key
        cp = broker("run", str(_recipe(tmp_path)), "--provider", "slurm", "--cluster", cid, "--json", timeout=500)
        assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-3000:])
        print(f"$ broker run r.yaml --provider slurm --cluster {cid}\n" + cp.stderr[-1500:])
        out = json.loads(cp.stdout)
        assert out["result"]["status"] == "succeeded", out["result"]
        logs = {int(k): Path(v).read_text() for k, v in out["result"]["log_paths"].items()}
        assert re.search(r"RANK=0 .*host=node0", logs[0]) and re.search(r"RANK=1 .*host=node1", logs[1]), logs
        cp = broker("slurm", "down", cid, "--json")
        assert cp.returncode == 0 and json.loads(cp.stdout)["left"] == [], cp.stderr[-3000:]
        assert "stopped 5 daemon(s) by PID" in cp.stderr
        print(f"$ broker slurm down {cid}\n" + cp.stderr)
        cid = None
        live = cloud.live()
        assert live == {c: [] for c in live}, live
        left = subprocess.run(["pgrep", "-af", f"{CLOUD_BASE}/{info['cluster_id']}"], capture_output=True, text=True)
        assert left.stdout.strip() == "", left.stdout
    finally:
        if cid is not None:
            broker("slurm", "down", cid)
