"""Stall detection for ``broker slurm submit`` of a user's own sbatch file, on a real 2-node cluster from ``broker
slurm up --provider netns`` (the cluster ``submit`` needs; the same one tests/slurm/test_slurm_submit.py uses): the
file starts its own torchrun per node under srun (broker starts no rank), rank 0 waits in all_reduce and rank 1
sleeps.  The hang is named with both ranks' places and, with the default --on-stall stop, the job is scancelled long
before its time limit; --on-stall report names it and lets Slurm's time limit end it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.slurm.test_slurm_submit import _queue, _why, broker, cluster  # noqa: F401 - the module's cluster

pytestmark = [pytest.mark.netns, pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_why is not None, reason=f"slurm submit tests: {_why}")]

from tests.support.hangs import HANG, WANT

SBATCH = """\
#!/bin/bash
#SBATCH --job-name=hang
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time={time}
#SBATCH --output=logs/%x-%j.out
#SBATCH --error=logs/%x-%j.err
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((29500 + SLURM_JOB_ID % 10000))
export PYTHONWARNINGS=ignore
srun --label --kill-on-bad-exit=1 bash -c 'exec torchrun --nnodes=$SLURM_NNODES --nproc_per_node=1 \\
    --node_rank=$SLURM_NODEID --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py'
"""


def _job(tmp_path: Path, time_limit: str) -> Path:
    (tmp_path / "train.py").write_text(HANG)
    (tmp_path / "hang.sh").write_text(SBATCH.format(time=time_limit))
    return tmp_path / "hang.sh"


def _run_dir(out: str, home: Path) -> Path:
    run_id = re.search(r"run (\d{8}-\d{6}-\w+): Slurm job", " ".join(out.split())).group(1)
    return home / "runs" / run_id


@pytest.mark.timeout(400)
def test_a_hang_in_your_own_sbatch_file_is_named_and_cancelled(cluster):  # noqa: F811
    import tempfile

    home, cid = cluster
    tmp_path = Path(tempfile.mkdtemp(prefix="stall-submit-", dir=home))
    t0 = time.monotonic()
    cp = broker(home, "slurm", "submit", str(_job(tmp_path, "00:10:00")), "--cluster", cid, "--stall-s", "5",
                timeout=300)
    wall = time.monotonic() - t0
    out = cp.stdout + cp.stderr
    assert cp.returncode == 1, out[-4000:]
    assert f"[broker] {WANT}" in out, out[-4000:]
    assert "[broker] cause: rank(s) 1 never reached the all_reduce" in out, out[-4000:]
    flat = " ".join(cp.stdout.split())
    assert re.search(r"Slurm job \d+ CANCELLED", flat), flat
    assert "TIME LIMIT" not in out  # ended by broker, long before its 10 minutes
    assert _queue(home, cid) == []  # scancelled: nothing left in the queue
    run_dir = _run_dir(cp.stdout, home)
    st = json.loads((run_dir / "stall.json").read_text())
    assert st["stopped"] and st["when"] == "stall"
    assert [(r["rank"], r["node"], r["collective"]) for r in st["ranks"]] == [(0, 0, "all_reduce"), (1, 1, None)]
    assert f"stalled: {WANT}" in flat, flat  # the diagnosis names it too
    assert "(--on-stall report keeps a stalled run going)" in out, out[-4000:]
    print(f"slurm submit stall: wall {wall:.1f} s, silence before the verdict {st['silent_s']} s")
    assert st["silent_s"] < 5 + 30, st


@pytest.mark.timeout(400)
def test_on_stall_report_names_the_hang_and_lets_the_time_limit_end_it(cluster):  # noqa: F811
    import tempfile

    home, cid = cluster
    tmp_path = Path(tempfile.mkdtemp(prefix="stall-submit-", dir=home))
    cp = broker(home, "slurm", "submit", str(_job(tmp_path, "1")), "--cluster", cid, "--stall-s", "5",
                "--on-stall", "report", timeout=300)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 1, out[-4000:]
    assert f"[broker] {WANT}" in out and "the run goes on" in out, out[-4000:]
    assert re.search(r"Slurm job \d+ TIMEOUT", " ".join(cp.stdout.split())), cp.stdout[-3000:]
    st = json.loads((_run_dir(cp.stdout, home) / "stall.json").read_text())
    assert not st["stopped"]
