"""Every command broker prints can be pasted: a path with a space is shell-quoted (`next: broker run my
recipes/job.yaml` failed when pasted)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys

from tests.conftest import REPO


def _broker(cli_env, cwd, *args: str) -> subprocess.CompletedProcess:
    env = dict(cli_env, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "broker", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_plan_s_next_step_quotes_a_recipe_path_with_a_space(cli_env, tmp_path):
    folder = tmp_path / "my recipes"
    folder.mkdir()
    shutil.copy(REPO / "recipes" / "ddp_2node.yaml", folder / "job.yaml")
    shutil.copy(REPO / "recipes" / "ddp_train.py", folder / "ddp_train.py")
    cp = _broker(cli_env, tmp_path, "plan", "--recipe", "my recipes/job.yaml")
    assert cp.returncode == 0, cp.stderr
    line = next(l for l in cp.stdout.splitlines() if l.startswith("next: "))
    words = shlex.split(line[len("next: "):])
    assert words[:3] == ["broker", "run", "my recipes/job.yaml"], line


def test_init_s_next_steps_quote_a_folder_with_a_space(cli_env, tmp_path):
    cp = _broker(cli_env, tmp_path, "init", "my dir")
    assert cp.returncode == 0, cp.stderr
    text = " ".join(cp.stdout.split())
    m = re.search(r"next: (broker plan --recipe .+?) then: (broker run .+)$", text)
    assert m, cp.stdout
    assert shlex.split(m[1])[3] == "my dir/ddp_2node.yaml"
    assert shlex.split(m[2])[2] == "my dir/ddp_2node.yaml"
