"""broker run --provider slurm on a real two-node Slurm 22.05 cluster (munged, slurmctld, two slurmd in network
namespaces; see tests/support/slurm_cluster.py).  Skipped with the reason when not root or slurm-wlm/munge are missing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    from tests.support.slurm_cluster import cluster_fixture
except ImportError:  # tests/ imported as a package
    from tests.support.slurm_cluster import cluster_fixture

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_fixture()


def write_recipe(tmp_path: Path, *, args: list[str], max_hours: float = 0.05, name: str = "ddp-slurm") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"""
name: {name}
script: {REPO}/recipes/ddp_train.py
workdir: {REPO}/recipes
args: {json.dumps(args)}
env: {{DDP_TIMEOUT_S: "60", PYTHONWARNINGS: ignore}}
setup: ["hostname > setup-$(hostname).txt"]
nodes: 2
gpus_per_node: 1
cpu_ok: true
max_hours: {max_hours}
expect: ["ALLREDUCE_OK", "heldout_accuracy=0\\\\.[5-9]", "DDP_OK"]
""")
    return p


def broker_run(cluster, tmp_path: Path, recipe: Path, *extra: str, timeout: float = 240,
               env_extra: dict[str, str] | None = None):
    (tmp_path / "tmp").mkdir(exist_ok=True)  # sbatch exports it: torchrun's torchelastic_* dirs land here
    env = {**os.environ, **cluster.env, "BROKER_HOME": str(tmp_path / "home"), "BROKER_SLURM_PYTHON": sys.executable,
           "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp_path / "tmp"), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "broker", "run", str(recipe), "--provider", "slurm", *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def ledger_rows(tmp_path: Path):
    from broker.money.ledger import Ledger

    with Ledger(tmp_path / "home" / "ledger.sqlite") as led:
        runs = led.list_runs()
        assert len(runs) == 1
        return runs[0], led.resources(runs[0].id)


def test_recipe_runs_on_two_slurm_nodes(cluster, tmp_path):
    recipe = write_recipe(tmp_path, args=["--epochs", "3", "--min-accuracy", "0.5"])
    t0 = time.monotonic()
    # the default interpreter "python3" resolves on the nodes through the PATH sbatch exports from the submitter
    # (unlike a non-interactive ssh session): the venv's python3 comes first here, the system one has no torch
    venv_bin = str(Path(sys.executable).parent)
    assert os.access(os.path.join(venv_bin, "python3"), os.X_OK)
    cp = broker_run(cluster, tmp_path, recipe, env_extra={"BROKER_SLURM_PYTHON": "python3",
                                                          "PATH": f"{venv_bin}:{os.environ['PATH']}"})
    wall = time.monotonic() - t0
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, f"{out}\n{cluster.logs()}"
    # streamed per-node logs with [node i] prefixes; node0 = RANK 0 and node1 = RANK 1 (node rank from SLURM_NODEID)
    assert re.search(r"^\[node 0\] RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 device=cpu backend=gloo host=node0 ", out, re.M), out
    assert re.search(r"^\[node 1\] RANK=1 LOCAL_RANK=0 WORLD_SIZE=2 device=cpu backend=gloo host=node1 ", out, re.M), out
    assert "[node 0] DDP_OK" in out and "status: succeeded" in out
    run, resources = ledger_rows(tmp_path)
    assert run.provider == "slurm" and run.status == "succeeded" and run.exit_codes == {"0": 0, "1": 0}
    job = resources[0]
    assert (job.kind, job.provider, job.usd_per_hour, job.state) == ("slurm_job", "slurm", 0.0, "terminated")
    assert job.provider_id and job.provider_id.isdigit() and job.attrs["final_state"] == "COMPLETED"
    assert job.attrs["nodes"] == ["node0", "node1"]
    run_dir = Path(run.run_dir)
    n0, n1 = (run_dir / "node0.log").read_text(), (run_dir / "node1.log").read_text()
    assert "host=node0" in n0 and "host=node1" not in n0 and "host=node1" in n1 and "DDP_OK" not in n1
    # Slurm's own per-node files differ per node and the log dir existed before submission
    slurm_logs = sorted(p.name for p in (run_dir / "slurm" / "logs").iterdir())
    assert slurm_logs == [f"ddp-slurm-{job.provider_id}-batch.out", f"ddp-slurm-{job.provider_id}-node0.out",
                          f"ddp-slurm-{job.provider_id}-node1.out"]
    # setup ran once on each node, in the job's shared working directory
    work = run_dir / "slurm" / "work"
    assert (work / "setup-node0.txt").read_text().strip() == "node0"
    assert (work / "setup-node1.txt").read_text().strip() == "node1"
    assert (work / "checkpoint.pt").exists()
    assert list((tmp_path / "tmp").glob("torchelastic_*"))  # the job saw the submitter's environment
    # the rank shim ran in front of the script on every node: facts per rank, copied back per node
    import json

    facts = {i: json.loads((run_dir / f"node{i}" / "facts" / f"rank{i}.json").read_text()) for i in (0, 1)}
    assert [(f["node"], f["rank"], f["world_size"], f["host"]) for f in facts.values()] == [
        (0, 0, 2, "node0"), (1, 1, 2, "node1")]
    assert "rankshim.py --facts" in (run_dir / "job.sbatch").read_text()
    print(f"slurm run wall time {wall:.1f} s")


def test_failure_on_one_node_fails_job_and_run(cluster, tmp_path):
    recipe = write_recipe(tmp_path, args=["--epochs", "4", "--crash-on-rank", "1"], name="ddp-crash")
    cp = broker_run(cluster, tmp_path, recipe)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 1, out
    assert "deliberate crash on rank 1" in out
    assert re.search(r"status: failed - node 1 exited with code 1 \(node1\); Slurm job \d+ FAILED", out), out
    run, resources = ledger_rows(tmp_path)
    assert run.status == "failed" and run.exit_codes["1"] == 1
    assert resources[0].attrs["final_state"] == "FAILED" and resources[0].state == "terminated"


def test_deadline_cancels_the_job(cluster, tmp_path):
    # 0.0015 h = 5.4 s: far shorter than 500 epochs
    recipe = write_recipe(tmp_path, args=["--epochs", "500"], max_hours=0.0015, name="ddp-long")
    cp = broker_run(cluster, tmp_path, recipe)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 1, out
    assert "status: deadline" in out and "cancelled Slurm job" in out
    run, resources = ledger_rows(tmp_path)
    assert run.status == "deadline"
    assert resources[0].attrs["final_state"] == "CANCELLED" and resources[0].state == "terminated"
    assert cluster.client("squeue", "-h").stdout.strip() == ""


def test_terminate_scancels_a_ledger_job(cluster, tmp_path, monkeypatch):
    """broker down / the watchdog: teardown_run -> SlurmProvider.terminate('slurm_job', id) = scancel."""
    from broker.money.ledger import Ledger
    from broker.money.teardown import teardown_run
    from broker.providers.slurm import SlurmProvider

    for k, v in cluster.env.items():
        monkeypatch.setenv(k, v)
    prov = SlurmProvider()
    (tmp_path / "job.sh").write_text("#!/bin/bash\nsleep 300\n")
    job_id = prov.submit(str(tmp_path / "job.sh"), run_id="run-x",
                         extra=["--nodes=1", f"--output={tmp_path}/out.txt", "--job-name=sleeper"])
    assert [t.provider_id for t in prov.list_tagged("run-x")] == [job_id]
    with Ledger(tmp_path / "ledger.sqlite") as led:
        res = led.record_intent("run-x", "slurm", "slurm_job", "sleeper")
        led.mark_created(res.id, job_id, state="running")
        t0 = time.monotonic()
        while prov.job(job_id).state != "RUNNING" and time.monotonic() - t0 < 20:
            time.sleep(0.2)
        left = teardown_run(led, "run-x", "test", providers={"slurm": prov})
        assert left == []
    assert prov.job(job_id).state == "CANCELLED"
    assert prov.terminate("slurm_job", job_id) is True  # idempotent


FAKE_SSH = r"""#!/bin/bash
# stand-in for ssh: drops the options, records the host, runs the remote command string with bash (as sshd does
# with the login shell), in a home directory of the test's own
while [[ $1 == -* ]]; do case $1 in -o|-p|-i|-F|-l) shift 2;; *) shift;; esac; done
echo "$1 $2" >> "$FAKE_SSH_LOG"; shift
export HOME="$FAKE_SSH_HOME"
cd "$HOME"
exec bash -c "$*"
"""


def test_run_through_ssh_login_node(cluster, tmp_path):
    """--slurm-host: every Slurm command and file access goes through `ssh <host> '<command>'`."""
    bin_dir, home = tmp_path / "bin", tmp_path / "login-home"
    bin_dir.mkdir()
    home.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    recipe = write_recipe(tmp_path, args=["--epochs", "2", "--min-accuracy", "0.5"], name="ddp-ssh")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SSH_LOG": str(tmp_path / "ssh.log"),
           "FAKE_SSH_HOME": str(home)}
    os.environ.update(env)  # broker_run copies os.environ
    try:
        cp = broker_run(cluster, tmp_path, recipe, "--slurm-host", "alice@login1")
    finally:
        for k in env:
            if k != "PATH":
                os.environ.pop(k)
        os.environ["PATH"] = env["PATH"].split(":", 1)[1]
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    assert "on alice@login1 (ssh)" in out
    assert re.search(r"^\[node 1\] RANK=1 .*host=node1 ", out, re.M), out
    calls = (tmp_path / "ssh.log").read_text().splitlines()
    assert all(c.startswith("alice@login1 ") for c in calls)
    for cmd in ("sbatch", "squeue", "tail", "tar", "sinfo"):
        assert any(c.split()[1] == cmd or f" {cmd} " in c for c in calls), (cmd, calls)
    run, resources = ledger_rows(tmp_path)
    assert run.status == "succeeded" and resources[0].attrs["host"] == "alice@login1"
    remote = home / ".broker" / "slurm" / run.id
    assert (remote / "work" / "checkpoint.pt").exists() and (remote / "job.sbatch").exists()
    assert "DDP_OK" in (Path(run.run_dir) / "node0.log").read_text()


def test_ctrl_c_cancels_the_job(cluster, tmp_path):
    recipe = write_recipe(tmp_path, args=["--epochs", "500"], max_hours=0.1, name="ddp-int")
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, **cluster.env, "BROKER_HOME": str(tmp_path / "home"), "BROKER_SLURM_PYTHON": sys.executable,
           "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen([sys.executable, "-m", "broker", "run", str(recipe), "--provider", "slurm"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[node 0] epoch=0"):
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    assert "status: interrupted" in out
    run, resources = ledger_rows(tmp_path)
    assert run.status == "interrupted" and resources[0].attrs["final_state"] == "CANCELLED"
    assert cluster.client("squeue", "-h").stdout.strip() == ""


def test_more_nodes_than_the_partition_is_no_valid_plan(cluster, tmp_path):
    # Slurm 22.05 accepts such a job and leaves it pending (PartitionConfig) forever: check before submitting
    recipe = write_recipe(tmp_path, args=[], name="ddp-3n")
    recipe.write_text(recipe.read_text().replace("nodes: 2", "nodes: 3"))
    cp = broker_run(cluster, tmp_path, recipe, timeout=60)
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert "has 2 node(s); ddp-3n needs 3" in cp.stderr
    assert cluster.client("squeue", "-h").stdout.strip() == ""


def test_job_that_can_never_start_is_cancelled(cluster, tmp_path):
    # --time 01:00:00 > the partition's MaxTime=30: Slurm 22.05 accepts it, then it pends (PartitionConfig) forever
    recipe = write_recipe(tmp_path, args=[], max_hours=1.0, name="ddp-toolong")
    cp = broker_run(cluster, tmp_path, recipe, timeout=90)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 1, out
    assert "Slurm will never start job" in out and "(pending: PartitionConfig)" in out
    run, resources = ledger_rows(tmp_path)
    assert run.status == "failed" and resources[0].attrs["final_state"] == "CANCELLED"
    assert cluster.client("squeue", "-h").stdout.strip() == ""


def test_unknown_partition_is_bad_input(cluster, tmp_path):
    recipe = write_recipe(tmp_path, args=[], name="ddp-badpart")
    cp = broker_run(cluster, tmp_path, recipe, timeout=60, env_extra={"BROKER_SLURM_PARTITION": "nosuchpart"})
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert "has no partition 'nosuchpart'" in cp.stderr


def test_sbatch_rejection_is_a_provider_error(cluster, tmp_path, monkeypatch):
    """sbatch refuses a GPU request on a cluster without GPU GRES at once: the run fails with exit 4 semantics
    (ProviderError naming sbatch and its message), the ledger row is closed, and nothing is queued."""
    from broker.money.ledger import Ledger
    from broker.core.provider import ProviderError
    from broker.core.recipe import load_recipe
    from broker.slurm.executor import SlurmOptions
    from broker.slurm.target import run_recipe_slurm
    from broker.providers.slurm import SlurmProvider

    for k, v in {**cluster.env, "BROKER_HOME": str(tmp_path / "home")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(SlurmProvider, "has_gpus", lambda self, partition=None: True)  # a wrong belief
    recipe = load_recipe(write_recipe(tmp_path, args=[], name="ddp-gpu"))
    with Ledger(tmp_path / "home" / "ledger.sqlite") as led:
        with pytest.raises(ProviderError, match="sbatch failed: .*(gres|GRES)") as e:
            run_recipe_slurm(recipe, ledger=led, echo=None, options=SlurmOptions(python=sys.executable))
        assert e.value.exit_code == 4
    run, resources = ledger_rows(tmp_path)
    assert run.status == "failed" and "sbatch failed" in run.message
    assert resources[0].state == "terminated" and resources[0].provider_id is None and resources[0].error
    assert cluster.client("squeue", "-h").stdout.strip() == ""


def test_log_dir_missing_at_submission_is_reported_not_hung(cluster, tmp_path, monkeypatch):
    """Why the submitter creates the log directory: without it sbatch exits 0 and the job dies at launch
    (JobLaunchFailure) with no log at all.  broker must report that as a failed run, promptly."""
    from broker.money.ledger import Ledger
    from broker.slurm.executor import SlurmOptions
    from broker.slurm.target import run_recipe_slurm
    from broker.providers.slurm import Shell

    for k, v in {**cluster.env, "BROKER_HOME": str(tmp_path / "home")}.items():
        monkeypatch.setenv(k, v)
    real_mkdir = Shell.mkdir
    monkeypatch.setattr(Shell, "mkdir", lambda self, path: None if path.endswith("/logs") else real_mkdir(self, path))
    recipe_path = write_recipe(tmp_path, args=[], name="ddp-nolog")
    from broker.core.recipe import load_recipe

    with Ledger(tmp_path / "home" / "ledger.sqlite") as led:
        run, result = run_recipe_slurm(load_recipe(recipe_path), ledger=led, echo=None,
                                       options=SlurmOptions(python=sys.executable))
    assert result.status == "failed" and run.status == "failed"
    assert "JobLaunchFailure" in result.reason, result.reason
