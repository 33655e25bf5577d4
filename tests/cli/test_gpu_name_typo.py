"""A GPU model that matches no offer is named as the cause, with the nearest models (`plan --gpu "RTX 4900"`
ended with "this machine has no GPU: add --cpu-ok")."""

from __future__ import annotations

import subprocess
import sys


def test_a_mistyped_gpu_model_gets_a_did_you_mean_and_not_the_cpu_ok_hint(cli_env):
    env = dict(cli_env, COLUMNS="200")
    cp = subprocess.run([sys.executable, "-m", "broker", "plan", "--gpu", "RTX 4900"], env=env,
                        capture_output=True, text=True, timeout=120)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 3, out
    assert "did you mean RTX 4090" in out
    last = [l for l in out.splitlines() if l.startswith("no valid plan")][-1]
    assert "RTX 4900" in last and "check the name" in last and "--cpu-ok" not in last, last


def test_a_known_model_on_a_machine_without_a_gpu_still_gets_the_plan(cli_env):
    env = dict(cli_env, COLUMNS="200")
    cp = subprocess.run([sys.executable, "-m", "broker", "plan", "--gpu", "RTX 4090"], env=env,
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "did you mean" not in cp.stdout


def test_a_run_on_this_machine_still_says_the_gpu_model_matches_nothing(cli_env, tmp_path):
    """`broker run SCRIPT.py --gpu 'RTX 4900' --cpu-ok` ran here and only said "this machine (free) is the only
    valid option": the typo went unseen."""
    from tests.cli.test_run_script import TINY_DDP

    (tmp_path / "tiny_ddp.py").write_text(TINY_DDP)
    env = dict(cli_env, COLUMNS="200")
    cp = subprocess.run([sys.executable, "-m", "broker", "run", "tiny_ddp.py", "--gpu", "RTX 4900", "--cpu-ok",
                         "--hours", "0.2", "-q"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "warning: no offer has GPU model RTX 4900 (did you mean RTX 4090" in cp.stderr, cp.stderr
