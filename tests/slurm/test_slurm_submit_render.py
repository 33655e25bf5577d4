"""``broker slurm render`` then ``broker slurm submit`` of what it wrote, on a real 2-node netns cluster: a CPU
recipe's render runs in the staged folder (its relative ``#SBATCH --chdir=.`` is the staged folder, not the home of
slurmd's user), and a job whose ``--output`` folder does not exist is diagnosed from Slurm's own record instead of
ending with an empty log.  Skipped with the reason when not root or slurm-wlm/munge/sshd are missing."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

try:
    from tests.slurm.test_slurm_submit import REPO, broker, cluster, pytestmark  # noqa: F401 - the module's cluster fixture
except ImportError:  # tests/ imported as a package
    from tests.slurm.test_slurm_submit import REPO, broker, cluster, pytestmark  # noqa: F401


@pytest.mark.timeout(400)
def test_renders_output_for_a_cpu_recipe_runs_in_the_staged_folder(cluster, tmp_path):
    home, cid = cluster
    shutil.copy(REPO / "recipes" / "ddp_train.py", tmp_path / "ddp_train.py")
    shutil.copytree(REPO / "recipes" / "data", tmp_path / "data")
    text = (REPO / "recipes" / "ddp_2node.yaml").read_text().replace("gpus_per_node: 1", "gpus_per_node: 0")
    text = text.replace('args: ["--epochs", "12", "--min-accuracy", "0.85"]', 'args: ["--epochs", "2"]')
    (tmp_path / "cpu.yaml").write_text(text)
    cp = broker(home, "slurm", "render", str(tmp_path / "cpu.yaml"), "--output", str(tmp_path / "job.sbatch"))
    assert cp.returncode == 0, cp.stderr
    assert "#SBATCH --chdir=." in (tmp_path / "job.sbatch").read_text()
    cp = broker(home, "slurm", "submit", str(tmp_path / "job.sbatch"), "--cluster", cid, timeout=300)
    assert cp.returncode == 0, (cp.stdout[-3000:], cp.stderr[-3000:])
    flat = " ".join(cp.stdout.split())
    assert re.search(r"Slurm job \d+ COMPLETED, ExitCode 0:0 \(succeeded\)", flat), flat
    assert "ALLREDUCE_OK" in cp.stdout or "DDP_OK" in cp.stdout or "broker: training step exit status 0" in \
        cp.stdout, cp.stdout[-3000:]


@pytest.mark.timeout(300)
def test_a_job_that_cannot_open_its_output_is_diagnosed_from_slurm(cluster, tmp_path):
    home, cid = cluster
    # %j in the folder: nothing can create it before sbatch, and slurmd does not
    (tmp_path / "nolog.sh").write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --time=2\n"
                                       "#SBATCH --output=logs-%j/out.txt\necho never\n")
    cp = broker(home, "slurm", "submit", str(tmp_path / "nolog.sh"), "--cluster", cid, timeout=240)
    assert cp.returncode == 1, (cp.stdout[-3000:], cp.stderr[-3000:])
    flat = " ".join(cp.stdout.split())
    assert re.search(r"Slurm job (\d+) FAILED \(ExitCode \d+:\d+.*\) without writing any output", flat), flat
    job_id = re.search(r"Slurm job (\d+) FAILED", flat).group(1)
    assert f"logs-{job_id}/out.txt" in flat and "folder that does not exist" in flat, flat


def test_ssh_on_a_slurm_up_cluster_has_slurm_conf(cluster):
    home, cid = cluster
    cp = broker(home, "ssh", cid, "0", "--", "sinfo", "-h", "-N", "-o", "%N")
    assert cp.returncode == 0, (cp.stdout, cp.stderr[-2000:])
    assert "node0" in cp.stdout and "node1" in cp.stdout
    # an interactive session: a terminal and a login shell that has SLURM_CONF
    from broker.money.ledger import Ledger
    from broker.slurm.render import ClusterState
    from broker.slurm.cluster import slurm_ssh_argv

    import os

    from broker.core.config import settings

    os.environ["BROKER_HOME"] = str(home)
    settings.cache_clear()
    run = Ledger().get_run(cid)
    conf = ClusterState.load(Path(run.run_dir)).conf
    # the argv `broker ssh` builds: ssh's options, then "--", the host and the command (nothing after "--" is an
    # ssh option)
    argv = slurm_ssh_argv(run, ["ssh", "-p", "22", "-l", "root", "--", "198.18.0.2"], None)
    assert argv[:7] == ["ssh", "-p", "22", "-l", "root", "-t", "--"] and argv[7] == "198.18.0.2"
    assert argv[8].startswith(f"export SLURM_CONF={conf};") and argv[8].endswith('exec "${SHELL:-/bin/bash}" -l')
    assert slurm_ssh_argv(run, ["ssh", "-l", "root", "--", "h", "hostname"], ["hostname"]) == \
        ["ssh", "-l", "root", "--", "h", f"export SLURM_CONF={conf};", "hostname"]


def _no_local_squeue(cp) -> None:
    text = cp.stdout + cp.stderr
    assert "squeue: error" not in text and "squeue: fatal" not in text and "list_tagged failed" not in text, text


@pytest.mark.timeout(300)
def test_reconcile_asks_the_clusters_controller_and_a_down_cluster_holds_no_job(cluster, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    home, cid = cluster
    (tmp_path / "sleep.sh").write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --time=3\necho started\nsleep 120\n")
    env = {**os.environ, "BROKER_HOME": str(home), "PYTHONWARNINGS": "ignore", "BROKER_WATCHDOG_AUTOSTART": "0"}
    env.pop("SLURM_CONF", None)
    p = subprocess.Popen([sys.executable, "-m", "broker", "slurm", "submit", str(tmp_path / "sleep.sh"), "--cluster",
                          cid], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stop = time.monotonic() + 120
        while time.monotonic() < stop and "RUNNING" not in broker(home, "slurm", "status", cid, "--json").stdout:
            time.sleep(1)
        cp = broker(home, "reconcile")  # the live job is the cluster's, known to the ledger: nothing to report
        assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-2000:])
        _no_local_squeue(cp)
        _no_local_squeue(broker(home, "status"))
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    cp = broker(home, "slurm", "down", cid)
    assert cp.returncode == 0, cp.stderr[-2000:]
    cp = broker(home, "reconcile")  # the cluster is gone, and with it its jobs
    assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-2000:])
    _no_local_squeue(cp)
