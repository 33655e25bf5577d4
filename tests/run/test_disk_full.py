"""Issue 13 item 8: a job that fills the filesystem holding BROKER_HOME (checkpoints bigger than the free space).
The run must end in the ledger (never stay `running`), the full filesystem is named, and node output keeps
streaming although the log files cannot be written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs root to mount a tmpfs")

FILLER = """
import os
rank = int(os.environ["RANK"])
print(f"rank {rank} writing a checkpoint", flush=True)
with open(f"ckpt{rank}.bin", "wb") as f:
    for _ in range(64):
        f.write(b"x" * (1 << 20))  # 64 MiB per rank into a 24 MiB filesystem: ENOSPC
print("never printed", flush=True)
"""


@needs_root
def test_a_job_that_fills_broker_home_ends_in_the_ledger_and_names_the_full_filesystem(tmp_path, cli_env):
    home = tmp_path / "small-home"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(home)], check=True)
    try:
        job = tmp_path / "job"
        job.mkdir()
        (job / "filler.py").write_text(FILLER)
        (job / "r.yaml").write_text("name: filler\nscript: filler.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n")
        env = dict(cli_env, BROKER_HOME=str(home))
        p = subprocess.run([sys.executable, "-m", "broker", "run", str(job / "r.yaml"), "--json"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        out = p.stdout + p.stderr
        assert p.returncode == 1, out
        assert "No space left on device" in out
        import sqlite3

        db = sqlite3.connect(str(home / "ledger.sqlite"))
        status, message = db.execute("SELECT status, message FROM runs").fetchone()
        db.close()
        assert status == "failed", (status, message)
        print("ledger message:", message)
        assert "is full" in (message or "") and "space reserve" in message
        data = json.loads(p.stdout)
        assert data["run"]["status"] == "failed"
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)
