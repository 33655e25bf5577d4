"""``broker slurm submit`` end to end on a real 2-node cluster from ``broker slurm up --provider netns`` (munged,
slurmctld, slurmd in two netns nodes): chapter 8's own ``train_ddp.sh`` is refused with each problem at its line
and nothing is queued; the fixed file runs on both nodes with its output shown per node and is a run in the ledger
(``status``, ``logs``, ``cost``); the book's launch (torchrun in the batch shell) submitted with ``--yes`` ends at
its time limit with "only node 0 ever started"; ``broker ssh`` and ``broker exec`` reach the nodes; ``slurm down``
leaves nothing.  Skipped with the reason when not root or slurm-wlm/munge/sshd are missing."""

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

from tests.support.slurm_cluster import why_not_available

from broker.providers import netns

REPO = Path(__file__).resolve().parents[2]
BOOK = REPO / "tests" / "slurm_book"
_why = why_not_available() or netns.missing_requirements()

pytestmark = [pytest.mark.netns, pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_why is not None, reason=f"slurm submit tests: {_why}")]


def broker(home: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "BROKER_HOME": str(home), "PYTHONWARNINGS": "ignore", "BROKER_WATCHDOG_AUTOSTART": "0",
           "COLUMNS": "200"}
    env.pop("SLURM_CONF", None)
    try:
        return subprocess.run([sys.executable, "-m", "broker", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"broker {' '.join(args)} still running after {timeout} s; stderr so far:\n"
                             f"{(e.stderr or b'')[-3000:]!r}") from None


@pytest.fixture(scope="module")
def cluster():
    """A 2-node cluster from `broker slurm up` (module-wide), always removed with `broker slurm down`."""
    home = Path(tempfile.mkdtemp(prefix="broker-slurmsubmit-test-"))
    cid = None
    try:
        cp = broker(home, "slurm", "up", "--provider", "netns", "--nodes", "2", "--name", "sub", "--json")
        assert cp.returncode == 0, cp.stderr[-3000:]
        cid = json.loads(cp.stdout)["cluster_id"]
        yield home, cid
    finally:
        try:
            if cid is not None:
                from broker.slurm.render import ClusterState

                state = ClusterState.load(home / "runs" / cid)
                if state.netns_cid and netns.leftovers(state.netns_cid):
                    cp = broker(home, "slurm", "down", cid)
                    assert cp.returncode == 0, cp.stderr[-2000:]
                    assert not netns.leftovers(state.netns_cid)
        finally:
            shutil.rmtree(home, ignore_errors=True)


class Submit:
    """``broker slurm submit SCRIPT --cluster CID`` started in the background, its stderr read as it comes: waiting
    for the job to run is waiting for submit's own "job N RUNNING" line (it follows the job through squeue), not
    polling another broker command."""

    def __init__(self, home: Path, script: Path, cid: str):
        import threading

        env = {**os.environ, "BROKER_HOME": str(home), "PYTHONWARNINGS": "ignore", "BROKER_WATCHDOG_AUTOSTART": "0"}
        env.pop("SLURM_CONF", None)
        self.p = subprocess.Popen([sys.executable, "-m", "broker", "slurm", "submit", str(script), "--cluster", cid],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.running = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.err.append(line)
            if re.search(r"job \d+ RUNNING", " ".join(line.split())):
                self.running.set()

    def finish(self, timeout: float) -> tuple[str, str]:
        """Wait for the command to end; returns (stdout, stderr)."""
        out = self.p.stdout.read()
        self.p.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return out, "".join(self.err)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()


def _queue(home: Path, cid: str) -> list:
    st = broker(home, "slurm", "status", cid, "--json")
    assert st.returncode == 0, st.stderr
    return json.loads(st.stdout)["queue"]


def test_the_chapters_file_is_refused_with_each_problem_at_its_line(cluster):
    home, cid = cluster
    cp = broker(home, "slurm", "submit", str(BOOK / "train_ddp.sh"), "--cluster", cid)
    assert cp.returncode == 2, (cp.stdout, cp.stderr[-3000:])
    err = cp.stderr
    f = str(BOOK / "train_ddp.sh")
    for line, kind in [(3, "sbatch-partition"), (6, "sbatch-gres"), (7, "sbatch-cpus"), (8, "sbatch-mem"),
                       (16, "shell-no-master-addr"), (18, "shell-rank-from-procid"),
                       (21, "sbatch-torchrun-not-srun")]:
        assert re.search(rf"{re.escape(f)}:{line}: (error|warning) \[{kind}\]", err), (kind, err)
    # what the real nodes have (sinfo / scontrol), and the fix
    assert "it has: broker" in err and "no GPUs" in err and f"have {os.cpu_count()} CPU(s) each" in err
    assert "RealMemory" in err and "scontrol show hostnames" in err and "fix:" in err
    assert "nothing was queued" in err and "--yes" in err
    assert _queue(home, cid) == []


@pytest.mark.timeout(400)
def test_the_fixed_file_runs_on_both_nodes_and_is_a_run_in_the_ledger(cluster):
    home, cid = cluster
    cp = broker(home, "slurm", "submit", str(BOOK / "train_ddp_fixed.sh"), "--cluster", cid, "--", "--epochs", "2",
                timeout=300)
    assert cp.returncode == 0, (cp.stdout[-3000:], cp.stderr[-3000:])
    out, err = cp.stdout, cp.stderr
    assert "no findings against" in err
    assert re.search(r"^\[node 0\] rank 0/2 on node0: all_reduce sum=1 after 2 epoch", out, re.M), out
    assert re.search(r"^\[node 1\] rank 1/2 on node1: all_reduce sum=1 after 2 epoch", out, re.M), out
    assert re.search(r"^\[batch\] job \d+ on node\[0-1\], master node0:", out, re.M), out
    m = re.search(r"run (\S+): Slurm job (\d+) COMPLETED, ExitCode 0:0 \(succeeded\)", " ".join(out.split()))
    assert m, out
    run_id, job_id = m.groups()
    assert f"job {job_id} RUNNING" in " ".join(err.split())  # followed through squeue
    # the job's own --output/--error files, fetched into the run folder's outputs/ (never over broker's own files)
    run_dir = home / "runs" / run_id
    assert (run_dir / "outputs" / f"train_ddp-{job_id}.out").read_text().count("all_reduce sum=1") == 2
    assert (run_dir / "outputs" / f"train_ddp-{job_id}.err").exists()
    # a run in the ledger: status, logs per node, cost
    st = broker(home, "status", run_id, "--json")
    assert st.returncode == 0, st.stderr
    assert '"succeeded"' in st.stdout and '"slurm"' in st.stdout
    lg = broker(home, "logs", run_id, "--node", "1")
    assert lg.returncode == 0 and "rank 1/2 on node1" in lg.stdout and "rank 0/2" not in lg.stdout
    cost = json.loads(broker(home, "cost", "--json").stdout)
    row = next(r for r in cost["runs"] if r["run"] == run_id)
    assert row["provider"] == "slurm" and row["usd"] == 0.0
    from broker.core.config import settings
    from broker.money.ledger import Ledger

    os.environ["BROKER_HOME"] = str(home)
    settings.cache_clear()
    led = Ledger()
    run, clus = led.get_run(run_id), led.get_run(cid)
    assert run.deadline == clus.deadline and run.budget_usd == clus.budget_usd  # the cluster's clock and budget
    (res,) = led.resources(run_id)
    assert res.kind == "slurm_job" and res.provider_id == job_id and res.state == "terminated"
    assert res.attrs["cluster"] == cid


@pytest.mark.timeout(400)
def test_torchrun_in_the_batch_shell_times_out_with_only_node_0_started(cluster, tmp_path):
    home, cid = cluster
    # the chapter's file after the reader removed what Slurm rejected: the launch is still the book's
    text = (BOOK / "train_ddp.sh").read_text()
    keep = [ln for ln in text.splitlines() if not re.search(r"--(gres|mem|cpus-per-task|partition)=", ln)]
    (tmp_path / "train_ddp.sh").write_text("\n".join(keep).replace("--time=00:30:00", "--time=1") + "\n")
    shutil.copy(BOOK / "train.py", tmp_path / "train.py")
    cp = broker(home, "slurm", "submit", str(tmp_path / "train_ddp.sh"), "--cluster", cid, timeout=300)
    assert cp.returncode == 2 and "sbatch-torchrun-not-srun" in cp.stderr  # refused without --yes
    cp = broker(home, "slurm", "submit", str(tmp_path / "train_ddp.sh"), "--cluster", cid, "--yes", timeout=300)
    assert cp.returncode == 1, (cp.stdout[-3000:], cp.stderr[-3000:])
    flat = " ".join(cp.stdout.split())
    assert re.search(r"Slurm job \d+ TIMEOUT", flat), flat
    assert "only node 0 ever started: torchrun is not under srun" in flat
    assert f"train_ddp.sh:{keep.index(next(ln for ln in keep if ln.startswith('torchrun'))) + 1}" in flat
    assert "DUE TO TIME LIMIT" in cp.stdout and "[node 1]" not in cp.stdout


def test_ssh_and_exec_reach_the_nodes(cluster):
    home, cid = cluster
    cp = broker(home, "exec", cid, "--", "hostname")
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert "[node 0] node0" in cp.stdout and "[node 1] node1" in cp.stdout
    cp = broker(home, "exec", cid, "--", "sinfo", "-h", "-N", "-o", "%N %T")
    assert cp.returncode == 0 and "[node 1] node1 idle" in cp.stdout, (cp.stdout, cp.stderr[-2000:])
    cp = broker(home, "ssh", cid, "1", "--", "hostname")
    assert cp.returncode == 0 and cp.stdout.strip() == "node1", cp.stderr[-2000:]
    cp = broker(home, "exec", cid, "--", "false")
    assert cp.returncode == 1 and "[node 0] exit 1" in cp.stdout


@pytest.mark.timeout(300)
def test_ctrl_c_cancels_the_job_and_ends_the_run(cluster, tmp_path):
    import signal

    home, cid = cluster
    (tmp_path / "sleep.sh").write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --time=5\necho started\nsleep 300\n")
    sub = Submit(home, tmp_path / "sleep.sh", cid)
    try:
        assert sub.running.wait(120), "".join(sub.err)[-3000:]
        assert [j["state"] for j in _queue(home, cid)] == ["RUNNING"]
        sub.p.send_signal(signal.SIGINT)
        out, err = sub.finish(timeout=120)
    finally:
        sub.kill()
    assert sub.p.returncode == 130, (out[-2000:], err[-3000:])
    assert _queue(home, cid) == []  # scancelled
    run_id = re.search(r"run (\d{8}-\d{6}-\w+)", err).group(1)
    st = broker(home, "status", run_id, "--json")
    assert '"interrupted"' in st.stdout, st.stdout[-2000:]
    from broker.core.config import settings
    from broker.money.ledger import Ledger

    os.environ["BROKER_HOME"] = str(home)
    settings.cache_clear()
    (res,) = Ledger().resources(run_id)
    assert res.state == "terminated" and res.kind == "slurm_job"  # not left loud in `broker status`


def test_down_leaves_nothing(cluster):
    home, cid = cluster
    from broker.slurm.render import ClusterState
    from broker.slurm.cluster import leftovers

    state = ClusterState.load(home / "runs" / cid)
    cp = broker(home, "slurm", "down", cid, "--json")
    assert cp.returncode == 0 and json.loads(cp.stdout)["left"] == [], cp.stderr[-2000:]
    assert not netns.leftovers(state.netns_cid) and leftovers(state) == []
    cp = broker(home, "slurm", "submit", str(BOOK / "train_ddp_fixed.sh"), "--cluster", cid)
    assert cp.returncode == 2 and "not up" in cp.stderr
