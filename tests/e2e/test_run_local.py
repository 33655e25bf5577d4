"""`broker run` end to end on this machine: real torchrun processes, real gloo, real ledger."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from broker.money.ledger import Ledger
from tests.conftest import REPO, broker_cmd

pytestmark = pytest.mark.slow


def flat(text: str) -> str:
    """``text`` with wrapped prose joined again (broker wraps at the width between words; node log lines are not
    wrapped)."""
    return " ".join(text.split())


def _run(args, env, timeout=240):
    return subprocess.run(broker_cmd(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_main_job_two_nodes_gloo(cli_env, broker_home):
    p = _run(["run", "recipes/ddp_2node.yaml", "--json"], cli_env)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    res = out["result"]
    assert res["status"] == "succeeded"
    assert res["exit_codes"] == {"0": 0, "1": 0}
    assert [(r["node"], r["rank"], r["local_rank"], r["world_size"], r["device"], r["backend"]) for r in res["ranks"]] \
        == [(0, 0, 0, 2, "cpu", "gloo"), (1, 1, 0, 2, "cpu", "gloo")]
    log0 = Path(res["log_paths"]["0"]).read_text()
    log1 = Path(res["log_paths"]["1"]).read_text()
    assert "all_reduce_sum=3 expected=3 ALLREDUCE_OK" in log0 and "all_reduce_sum=3 expected=3 ALLREDUCE_OK" in log1
    acc = float(log0.split("heldout_accuracy=")[1].split()[0])
    assert acc >= 0.85
    losses = [float(line.split("loss=")[1].split()[0]) for line in log0.splitlines() if line.startswith("epoch=")]
    assert len(losses) == 12 and losses[-1] < losses[0] / 5
    # the checkpoint is written by global rank 0 only: node 0's work dir has it, node 1's does not
    run_dir = Path(out["run"]["run_dir"])
    ckpt = run_dir / "node0" / "work" / "checkpoint.pt"
    assert ckpt.exists() and not (run_dir / "node1" / "work" / "checkpoint.pt").exists()
    state = torch.load(ckpt, weights_only=True)
    assert state["world_size"] == 2 and state["accuracy"] == pytest.approx(acc, abs=1e-4)
    # the ledger has the run with its exit codes and logs
    run = Ledger().get_run(out["run"]["id"])
    assert run.status == "succeeded" and run.exit_codes == {"0": 0, "1": 0}
    assert set(run.log_paths) == {"0", "1"} and (run_dir / "recipe.json").exists()
    st = _run(["status", "--json"], cli_env, timeout=60)
    assert st.returncode == 0 and out["run"]["id"] in st.stdout


def _recipe(tmp_path: Path, extra_args: list[str], expect: list[str]) -> Path:
    r = tmp_path / "r.yaml"
    r.write_text(json.dumps({
        "name": "drill", "script": str(REPO / "recipes" / "ddp_train.py"), "workdir": str(REPO / "recipes"),
        "args": ["--epochs", "3", *extra_args], "env": {"DDP_TIMEOUT_S": "60"}, "nodes": 2, "cpu_ok": True,
        "max_hours": 0.1, "expect": expect}))
    return r


def test_crash_on_node_1_stops_both_nodes(cli_env, tmp_path):
    p = _run(["run", str(_recipe(tmp_path, ["--crash-on-rank", "1"], ["DDP_OK"]))], cli_env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "status: failed" in p.stdout and "node 1 exited with code 1" in p.stdout
    assert "deliberate crash on rank 1" in p.stdout  # the crash is shown
    # the diagnosis names the rank that failed first, its own error and its line, not torchrun's summary block
    assert "diagnosis:" in p.stdout
    assert "node 1, rank 1 failed first: RuntimeError: deliberate crash on rank 1 (--crash-on-rank)" in flat(p.stdout)
    assert "at ddp_train.py:119 in main: raise RuntimeError(" in flat(p.stdout)
    run = Ledger().list_runs(limit=1)[0]
    assert run.status == "failed" and run.exit_codes["1"] == 1 and run.exit_codes["0"] not in (0, None)


def test_expect_not_met_fails(cli_env, tmp_path):
    p = _run(["run", str(_recipe(tmp_path, [], ["DDP_OK", "THIS_NEVER_APPEARS"])), "--quiet"], cli_env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "lacks the expected output" in p.stdout and "THIS_NEVER_APPEARS" in p.stdout


def test_bad_recipe_exit_2(cli_env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nscript: ddp_train.py\nnodse: 2\n")
    p = _run(["run", str(bad)], cli_env, timeout=60)
    assert p.returncode == 2
    assert "bad.yaml:3: unknown field 'nodse': did you mean 'nodes'?" in flat(p.stderr)


def test_ctrl_c_stops_every_node(cli_env, tmp_path):
    """SIGINT to `broker run` (what Ctrl-C sends): every node is stopped, exit 130, the ledger says interrupted."""
    import signal
    import time

    recipe = _recipe(tmp_path, [], ["DDP_OK"])
    text = recipe.read_text().replace('"--epochs", "3"', '"--epochs", "100000"')
    recipe.write_text(text)
    p = subprocess.Popen(broker_cmd("run", str(recipe)), cwd=REPO, env=cli_env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.monotonic() + 120
    for line in p.stdout:  # wait until both nodes train
        seen.append(line)
        if "epoch=0" in line or time.monotonic() > deadline:
            break
    assert any("epoch=0" in s for s in seen), "".join(seen[-20:])
    p.send_signal(signal.SIGINT)
    rest, _ = p.communicate(timeout=60)
    assert p.returncode == 130, rest[-2000:]
    assert "status: interrupted" in rest
    run = Ledger().list_runs(limit=1)[0]
    assert run.status == "interrupted"
    # no process of this run is left: torchrun agents and workers ran with cwd inside the run directory
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.readlink(proc / "cwd").startswith(run.run_dir) and (proc / "stat").read_text().split()[2] != "Z":
                    left.append(proc.name)
            except OSError:
                pass
    assert left == []


def test_a_script_importing_torch_shows_no_numpy_warning(cli_env, tmp_path):
    """Seen by a new user: every recipe without PYTHONWARNINGS printed torch's "Failed to initialize NumPy"
    (the install had no numpy); the train extra installs it."""
    (tmp_path / "t.py").write_text("import torch\nprint('T', torch.zeros(2).numpy().sum())\n")
    (tmp_path / "r.yaml").write_text("name: np\nscript: t.py\nnodes: 1\ngpus_per_node: 0\ncpu_ok: true\n"
                                     "expect: ['T 0.0']\n")
    env = {k: v for k, v in cli_env.items() if k != "PYTHONWARNINGS"}
    p = _run(["run", str(tmp_path / "r.yaml"), "--provider", "local"], env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Failed to initialize NumPy" not in p.stdout + p.stderr


def test_symlinks_out_of_the_workdir_never_reach_the_node(cli_env, tmp_path):
    """The new-user trial: `shadowlink -> <a file outside>` and `envlink -> .env` in the workdir; a local run copied
    their contents into node0/work.  Now neither is staged, and the staged summary names the skipped link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "shadow").write_text("root:SECRET-HASH\n")
    w = tmp_path / "ws"
    w.mkdir()
    (w / "train.py").write_text("import os\nprint('FILES', sorted(os.listdir('.')), flush=True)\n")
    (w / ".env").write_text("API_KEY=SECRET-ENV\n")
    os.symlink(outside / "shadow", w / "shadowlink")
    os.symlink(".env", w / "envlink")
    os.symlink("train.py", w / "same.py")
    (w / "ws.yaml").write_text("name: ws\nscript: train.py\nnodes: 1\ncpu_ok: true\nmax_hours: 0.1\n")
    p = _run(["run", str(w / "ws.yaml"), "--provider", "local"], cli_env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "shadowlink (symlink outside the workdir)" in out and "SECRET" not in out
    work = next(Path(cli_env["BROKER_HOME"]).rglob("node0/work"))
    assert sorted(x.name for x in work.iterdir()) == ["same.py", "train.py", "ws.yaml"]
    assert not (work / "same.py").is_symlink() and (work / "same.py").read_text() == (w / "train.py").read_text()
