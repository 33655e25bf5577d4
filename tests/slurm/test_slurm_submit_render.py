"""``broker slurm render`` then ``broker slurm submit`` of what it wrote, on a real 2-node netns cluster: a CPU
recipe's render runs in the staged folder (its relative ``#SBATCH --chdir=.`` is the staged folder, not the home of
slurmd's user), and a job whose ``--output`` folder does not exist is diagnosed from Slurm's own record instead of
ending with an empty log.  Skipped with the reason when not root or slurm-wlm/munge/sshd are missing."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.slurm.test_slurm_submit import REPO, Submit, broker, cluster, pytestmark  # noqa: F401 - the module's cluster fixture


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
    import signal

    home, cid = cluster
    (tmp_path / "sleep.sh").write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --time=3\necho started\nsleep 120\n")
    sub = Submit(home, tmp_path / "sleep.sh", cid)
    try:
        assert sub.running.wait(120), "".join(sub.err)[-3000:]
        cp = broker(home, "reconcile")  # the live job is the cluster's, known to the ledger: nothing to report
        assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-2000:])
        _no_local_squeue(cp)
        _no_local_squeue(broker(home, "status"))
        sub.p.send_signal(signal.SIGINT)
        sub.finish(timeout=120)
    finally:
        sub.kill()
    cp = broker(home, "slurm", "down", cid)
    assert cp.returncode == 0, cp.stderr[-2000:]
    cp = broker(home, "reconcile")  # the cluster is gone, and with it its jobs
    assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-2000:])
    _no_local_squeue(cp)


def test_a_job_broker_cancels_shows_one_line_and_keeps_torchruns_tracebacks_in_the_logs(tmp_path):
    """The cluster's deadline: broker scancels the job; the console gets one line for it, and the SignalException
    tracebacks torchrun prints for the SIGTERM are in the copied logs only (never ~30 lines a node on screen)."""
    import datetime
    import subprocess as sp
    from types import SimpleNamespace

    from broker.core.model import utcnow
    from broker.providers.slurm import JobInfo
    from broker.slurm.submit import Outcome, _follow

    (tmp_path / "cluster").mkdir()
    out_file = tmp_path / "cluster" / "slurm-7.out"
    out_file.write_text("0: epoch 0 loss 1.0\n1: epoch 0 loss 1.1\n")
    trace = ("0: Traceback (most recent call last):\n0:   File \"run.py\", line 86, in _terminate_process_handler\n"
             "0: torch.distributed.elastic.multiprocessing.api.SignalException: Process 9 got signal: 15\n")

    class Sh:
        def run(self, argv, **kw):
            return sp.CompletedProcess(argv, 0, stdout=f"JobId=7 JobName=j StdOut={out_file} StdErr={out_file} "
                                                       "BatchHost=node0 UserId=root(0)".encode(), stderr=b"")

        def read_from(self, path, offset):
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read()

    class Prov:
        cancelled = False

        def job(self, job_id, attrs=None):
            return JobInfo(job_id, "CANCELLED" if self.cancelled else "RUNNING")

        def cancel(self, job_id, attrs=None):
            self.cancelled = True
            with open(out_file, "a") as f:
                f.write(trace)

    shown, said = [], []
    ledger = SimpleNamespace(event=lambda *a, **k: None)
    run = SimpleNamespace(id="r1")
    out = Outcome("r1", "7", "RUNNING", None, None, "failed")
    status, reason, info, out = _follow(Prov(), Sh(), {}, "7", run, utcnow() - datetime.timedelta(seconds=1), {},
                                        "j", 1, 2, tmp_path, out, echo=shown.append, say=said.append, poll_s=0.01,
                                        ledger=ledger, res_id=None)
    assert status == "deadline" and info.state == "CANCELLED"
    assert "[node 0] epoch 0 loss 1.0" in shown and "[node 1] epoch 0 loss 1.1" in shown
    assert not any("SignalException" in s or "Traceback" in s for s in shown), shown
    assert sum(s.startswith("cancelling job 7 (scancel") for s in said) == 1, said
    assert "SignalException" in (tmp_path / "node0.log").read_text()
