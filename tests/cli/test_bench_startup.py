"""bench/cli_startup.py refuses to time a broker that cannot run (it used to report "1.0x ... met")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fails_loudly_when_broker_does_not_run(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(os.path.realpath(sys.executable))
    script = bindir / "broker"  # the console script beside the interpreter: it cannot run
    script.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named typer' >&2\nexit 1\n")
    script.chmod(0o755)
    cp = subprocess.run([str(bindir / "python"), str(ROOT / "bench" / "cli_startup.py"), "--starts", "1"],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode != 0, cp.stdout
    assert "No module named typer" in cp.stderr
    assert "exited 1" in cp.stderr and "venv" in cp.stderr
    assert "met" not in cp.stdout
