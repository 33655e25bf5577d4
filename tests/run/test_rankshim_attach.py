"""``rankshim.attach`` through the generated ``sitecustomize.py`` (what ``broker slurm submit`` puts first on a job's
PYTHONPATH): a torchrun worker (RANK set) that broker did not start gets its facts file and answers
``--dump-stacks`` with its real stack; a process without RANK (torchrun's own agent, the batch shell's helpers) is
left alone; a sitecustomize the hook shadows still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import wait_for

from broker.run import rankshim
from broker.run.launch import RANKSHIM

SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(60)\n"


def _hook(tmp_path: Path) -> Path:
    hook = tmp_path / "hook"
    hook.mkdir()
    for name in rankshim.SHIM_FILES:  # the shim and the parts it loads from its own folder
        (hook / name).write_text(RANKSHIM.with_name(name).read_text())
    (hook / "sitecustomize.py").write_text(rankshim.SITECUSTOMIZE)
    return hook


def _start(tmp_path: Path, hook: Path, facts: Path, extra: dict[str, str], pythonpath: str | None = None):
    (tmp_path / "train.py").write_text(SLEEPER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONPATH", "BROKER_FACTS_DIR")}
    env.update({"PYTHONPATH": pythonpath or str(hook), "BROKER_FACTS_DIR": str(facts), **extra})
    p = subprocess.Popen([sys.executable, str(tmp_path / "train.py")], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def test_a_worker_started_by_its_own_torchrun_answers_dump_stacks(tmp_path):
    hook, facts = _hook(tmp_path), tmp_path / "facts"
    p = _start(tmp_path, hook, facts, {"RANK": "3", "GROUP_RANK": "1", "WORLD_SIZE": "4"})
    try:
        d = json.loads((facts / "rank3.json").read_text())
        assert d["pid"] == p.pid and d["rank"] == 3 and d["node"] == 1 and d["stack_file"] == "rank3.stack"
        out = rankshim.dump_stacks(str(facts), wait_s=5, use_pyspy=False)
        assert out["3"]["tool"] == "faulthandler" and out["3"]["node"] == 1
        assert f'File "{tmp_path / "train.py"}", line ' in out["3"]["text"], out["3"]["text"]  # the rank's own stack
    finally:
        p.kill()
        p.wait()
    # once the rank is gone it reads as ended, not as a rank to signal
    assert wait_for(lambda: rankshim.dump_stacks(str(facts), use_pyspy=False).get("3", {}).get("ended"), 5)


def test_a_process_without_rank_is_left_alone_and_a_shadowed_sitecustomize_still_runs(tmp_path):
    hook, facts = _hook(tmp_path), tmp_path / "facts"
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text(f"open({str(tmp_path / 'own-ran')!r}, 'w').write('yes')\n")
    p = _start(tmp_path, hook, facts, {}, pythonpath=f"{hook}{os.pathsep}{own}")
    try:
        time.sleep(0.2)
        assert not facts.exists() or not list(facts.iterdir())  # torchrun's agent is no rank
        assert (tmp_path / "own-ran").read_text() == "yes"
    finally:
        p.kill()
        p.wait()
