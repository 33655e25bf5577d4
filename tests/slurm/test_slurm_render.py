"""broker slurm render: the sbatch script's key lines, bash syntax, and its behaviour under a stand-in srun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from broker.core.recipe import load_recipe
from broker.slurm.executor import node_exit_codes, render_sbatch, slurm_time

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def recipe(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"""
name: ddp-fast
script: {REPO}/recipes/ddp_train.py
workdir: {REPO}/recipes
args: ["--epochs", "2", "--note", "it's a $HOME test"]
env: {{DDP_TIMEOUT_S: "60", WEIRD: "a b'c"}}
setup: ["echo setup-$(hostname) > setup-$SLURM_NODEID.txt"]
nodes: 3
gpus_per_node: 2
cpu_ok: true
max_hours: 0.25
""")
    return load_recipe(p)


def test_render_key_lines(recipe, tmp_path):
    s = render_sbatch(recipe, log_dir=tmp_path / "logs", partition="gpu", account="proj1")
    assert s.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --time=00:15:00", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj1", "set -euo pipefail", 'mkdir -p "$LOG_DIR"',
                 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
                 "export MASTER_PORT=$(( 29500 + SLURM_JOB_ID % 19500 ))", "exit $rc"):
        assert line in s.splitlines(), line
    # per-node output pattern (%n = node index within the job), one srun task per node, kill on bad exit
    assert '--output="$LOG_DIR/%x-%j-node%n.out"' in s
    assert "--kill-on-bad-exit=1" in s and "--ntasks-per-node=1" in s
    # the node rank sits inside single quotes: expanded by the shell on each node, never by the batch shell
    train = [ln for ln in s.splitlines() if "torch.distributed.run" in ln]
    assert len(train) == 1
    assert re.search(r"bash -c '[^']*--node_rank=\$SLURM_NODEID", train[0])
    assert "--nnodes=$SLURM_NNODES" in train[0] and "--nproc_per_node=2" in train[0]
    # torchrun is never started straight from the batch script
    assert not any(ln.lstrip().startswith(("torchrun", "python")) for ln in s.splitlines())
    # the training step is the last thing that decides the exit status
    body = [ln for ln in s.splitlines() if ln.strip() and not ln.startswith("#")]
    assert body[-1] == "exit $rc"
    assert subprocess.run(["bash", "-n"], input=s, text=True).returncode == 0


def test_render_cpu_only_and_fixed_port(recipe, tmp_path):
    s = render_sbatch(recipe, log_dir=tmp_path, gpus=False, port=31234, time="01:02:03")
    assert "--gpus-per-node" not in s
    assert "#SBATCH --cpus-per-task=2" in s and "#SBATCH --time=01:02:03" in s
    assert "export MASTER_PORT=31234" in s and "export CUDA_VISIBLE_DEVICES=''" in s


def test_render_rejects_bad_input(recipe, tmp_path):
    from broker.core.provider import BadInput

    with pytest.raises(BadInput, match="HH:MM:SS"):
        render_sbatch(recipe, log_dir=tmp_path, time="90 minutes")
    with pytest.raises(BadInput, match="whitespace"):
        render_sbatch(recipe, log_dir=tmp_path / "a b")
    with pytest.raises(BadInput, match="cpu_ok"):
        render_sbatch(recipe.model_copy(update={"cpu_ok": False}), log_dir=tmp_path, gpus=False)


def test_slurm_time():
    assert slurm_time(0.5) == "00:30:00"
    assert slurm_time(0.001) == "00:01:00"
    assert slurm_time(25.01) == "25:01:00"


FAKE_SRUN = r"""#!/bin/bash
# stand-in for srun: runs the command once per node with SLURM_NODEID set, output to the --output pattern;
# exits with the first failing node's status (what --kill-on-bad-exit does)
n=1; out=/dev/stdout; append=0
while [[ $1 == --* ]]; do case $1 in --nodes=*) n=${1#--nodes=};; --output=*) out=${1#--output=};;
  --open-mode=append) append=1;; esac; shift; done
rc=0
for ((i=0; i<n; i++)); do
  f=${out//%n/$i}; f=${f//%x/$SLURM_JOB_NAME}; f=${f//%j/$SLURM_JOB_ID}
  [ $append = 1 ] || : > "$f"
  SLURM_NODEID=$i "$@" >> "$f" 2>&1 || { r=$?; [ $rc = 0 ] && rc=$r; }
done
exit $rc
"""

FAKE_PY = r"""#!/bin/bash
echo "argv: $*"
echo "env: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT WEIRD=$WEIRD"
[ "$SLURM_NODEID" = "${FAIL_NODE:-x}" ] && { echo "boom on node $SLURM_NODEID"; exit 7; }
exit 0
"""


def _run_with_fakes(recipe, tmp_path, fail_node=None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", "#!/bin/sh\necho node7\necho node8\necho node9\n"),
                       ("fakepy", FAKE_PY)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    logs = tmp_path / "logs"
    script = render_sbatch(recipe, log_dir=logs, python=str(bin_dir / "fakepy"), workdir=tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NAME": "ddp-fast", "SLURM_JOB_NODELIST": "node[7-9]", "SLURM_NNODES": "3"}
    if fail_node is not None:
        env["FAIL_NODE"] = str(fail_node)
    cp = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    return cp, logs


def test_script_runs_one_torchrun_per_node_with_its_rank(recipe, tmp_path):
    cp, logs = _run_with_fakes(recipe, tmp_path)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "MASTER_ADDR=node7 MASTER_PORT=" in cp.stdout
    for i in range(3):
        text = (logs / f"ddp-fast-4242-node{i}.out").read_text()
        assert f"--node_rank={i} " in text, text
        assert "--nnodes=3 --nproc_per_node=2" in text and "--master_addr=node7" in text
        assert "ddp_train.py --epochs 2 --note it's a $HOME test" in text  # args arrive verbatim
        assert "WEIRD=a b'c" in text and f"setup-{i}.txt" not in text
        assert (tmp_path / f"setup-{i}.txt").exists()  # setup ran once per node, before training
        assert text.index("broker: setup") < text.index("argv:")


def test_script_exit_status_is_the_trainings(recipe, tmp_path):
    cp, logs = _run_with_fakes(recipe, tmp_path, fail_node=1)
    assert cp.returncode == 7, cp.stdout + cp.stderr
    assert "boom on node 1" in (logs / "ddp-fast-4242-node1.out").read_text()


def test_node_exit_codes_from_srun_messages():
    log = ("srun: error: node1: task 1: Exited with exit code 1\n"
           "srun: error: node0: task 0: Terminated\n"
           "srun: Force Terminated StepId=12.1\n")
    codes, failed = node_exit_codes(log, 2, job_ok=False)
    assert codes == {0: -15, 1: 1} and failed == 1
    codes, failed = node_exit_codes("srun: error: node[0-1]: tasks 0-1: Killed\n", 2, job_ok=False)
    assert codes == {0: -9, 1: -9} and failed == 0
    assert node_exit_codes("", 2, job_ok=True) == ({0: 0, 1: 0}, None)


def test_cli_render_writes_script_only(recipe, tmp_path):
    out = tmp_path / "job.sbatch"
    cp = subprocess.run([sys.executable, "-m", "broker", "slurm", "render", str(recipe.path), "--partition", "debug",
                         "--time", "00:05:00", "--output", str(out), "--cpu-only"],
                        cwd=REPO, capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    s = out.read_text()
    assert "#SBATCH --partition=debug" in s and "#SBATCH --time=00:05:00" in s and "--gpus-per-node" not in s
    # no side effects: the log folder is not created here (the printed submit line does it, beside sbatch)
    assert not (tmp_path / "slurm-logs").exists() and not (REPO / "slurm-logs").exists()
    assert "LOG_DIR=slurm-logs" in s.splitlines() and "mkdir -p slurm-logs && sbatch" in cp.stderr
    cp = subprocess.run([sys.executable, "-m", "broker", "slurm", "render", str(recipe.path), "--time", "5m"],
                        cwd=REPO, capture_output=True, text=True)
    assert cp.returncode == 2 and "HH:MM:SS" in cp.stderr


def test_run_without_slurm_commands_is_a_provider_error(recipe, tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "BROKER_HOME": str(tmp_path / "home")}
    cp = subprocess.run([sys.executable, "-m", "broker", "run", str(recipe.path), "--provider", "slurm"],
                        cwd=REPO, env=env, capture_output=True, text=True)
    assert cp.returncode == 4, cp.stdout + cp.stderr
    assert "sinfo is not installed" in cp.stderr and "--slurm-host" in cp.stderr
