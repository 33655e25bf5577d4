"""The rank-facts shim (broker/run/rankshim.py) in front of unchanged scripts, and the local launcher's environment
hygiene, on real processes (torchrun on CPU/gloo for the end-to-end ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.run.launch import (RANKSHIM, LocalLaunchSpec, dropped_inherited, dropped_line, node_environment,
                               torchrun_argv)
from tests.support.runs import run_local

SCRIPTS = Path(__file__).resolve().parents[1] / "diagnose_logs" / "scripts"


def shim(tmp_path: Path, source: str, *args: str, env: dict[str, str] | None = None):
    script = tmp_path / "user" / "train.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(source)
    facts = tmp_path / "facts"
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "BROKER_FACTS_DIR")}
    e.update({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "BROKER_NODE_RANK": "1"}, **(env or {}))
    p = subprocess.run([sys.executable, str(RANKSHIM), "--facts", str(facts), "--", str(script), *args],
                       capture_output=True, text=True, env=e, cwd=tmp_path, timeout=120)
    f = facts / "rank3.json"
    return p, (json.loads(f.read_text()) if f.exists() else None)


def test_script_runs_as_main_with_its_argv_path_and_no_torch(tmp_path):
    src = ("import sys, os\n"
           "assert __name__ == '__main__'\n"
           "import helper\n"  # a module beside the script: sys.path[0] is the script's folder
           "print('argv', sys.argv[1:], 'torch' in sys.modules, os.path.basename(sys.argv[0]))\n")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "helper.py").write_text("X = 1\n")
    p, facts = shim(tmp_path, src, "--epochs", "3")
    assert p.returncode == 0, p.stderr
    assert "argv ['--epochs', '3'] False train.py" in p.stdout  # the shim never imports torch itself
    assert facts["rank"] == 3 and facts["local_rank"] == 1 and facts["world_size"] == 4 and facts["node"] == 1
    assert facts["exit_code"] == 0 and facts["ended"] >= facts["started"] and "torch" not in facts
    assert facts["python"] == sys.version.split()[0] and facts["host"]


def test_uncaught_exception_is_recorded_and_reraised_with_the_same_exit_code(tmp_path):
    src = "def step(x):\n    return 1 / x\n\nstep(0)\n"
    p, facts = shim(tmp_path, src)
    plain = subprocess.run([sys.executable, str(tmp_path / "user" / "train.py")], capture_output=True, text=True)
    assert p.returncode == plain.returncode == 1
    assert "ZeroDivisionError: division by zero" in p.stderr  # the traceback still reaches the log
    assert "rankshim" not in p.stderr and "runpy" not in p.stderr  # as if the script had run alone
    assert p.stderr.count("File ") == plain.stderr.count("File ") == 2
    exc = facts["exception"]
    assert exc["type"] == "ZeroDivisionError" and exc["message"] == "division by zero"
    assert exc["frame"] == {"file": "train.py", "line": 2, "function": "step", "code": "return 1 / x"}
    assert "exit_code" not in facts


@pytest.mark.parametrize("src,code", [("import sys\nsys.exit(3)\n", 3), ("import os\nos._exit(0)\n", 0),
                                      ("raise SystemExit('bye')\n", 1)])
def test_exit_codes_and_os_exit_are_recorded(tmp_path, src, code):
    p, facts = shim(tmp_path, src)
    assert p.returncode == code and facts["exit_code"] == code and "ended" in facts


def test_a_forked_child_exiting_does_not_overwrite_the_ranks_facts(tmp_path):
    """DataLoader workers are forked and end with os._exit(0): that is not the rank's clean exit."""
    src = ("import os, time\n"
           "pid = os.fork()\n"
           "if pid == 0:\n"
           "    os._exit(0)\n"
           "os.waitpid(pid, 0)\n"
           "time.sleep(0.2)\n"
           "os.kill(os.getpid(), 9)\n")  # the rank itself then dies without a word (the OOM killer)
    p, facts = shim(tmp_path, src)
    assert p.returncode == -9
    assert "exit_code" not in facts and "ended" not in facts and "exception" not in facts


def test_torch_device_and_backend_are_recorded_when_the_script_uses_torch(tmp_path):
    """torch.cuda.set_device is wrapped: the device a rank asked for is recorded even when it fails (CPU build)."""
    src = ("import torch, os\n"
           "torch.cuda.set_device(int(os.environ['RANK']))\n")
    p, facts = shim(tmp_path, src, env={"PYTHONWARNINGS": "ignore"})
    assert p.returncode == 1
    assert facts["device"] == "cuda:3" and facts["torch"].startswith("2.") and facts["gpus_visible"] == 0
    assert facts["exception"]["frame"]["code"] == "torch.cuda.set_device(int(os.environ['RANK']))"


def test_environment_hygiene_unit():
    base = {"PATH": "/bin", "GLOO_SOCKET_IFNAME": "bogus0", "NCCL_SOCKET_IFNAME": "eth9", "MASTER_PORT": "1",
            "RANK": "7", "TORCHELASTIC_RUN_ID": "x", "SLURM_PROCID": "0", "NCCL_NVLS_ENABLE": "0",
            "NCCL_DEBUG": "INFO", "RANKING": "keep", "NCCL_VERSION": "2.28.9"}  # an NVIDIA image's label
    recipe = {"NCCL_SOCKET_IFNAME": "ens5"}
    assert dropped_inherited(base, recipe) == ["GLOO_SOCKET_IFNAME", "MASTER_PORT", "RANK", "SLURM_PROCID",
                                               "TORCHELASTIC_RUN_ID"]
    env = node_environment(base, recipe, {"BROKER_NODE_RANK": "0"})
    assert env["NCCL_SOCKET_IFNAME"] == "ens5" and "GLOO_SOCKET_IFNAME" not in env and "RANK" not in env
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_DEBUG"] == "INFO" and env["RANKING"] == "keep"
    assert env["NCCL_VERSION"] == "2.28.9"
    assert "GLOO_SOCKET_IFNAME" in dropped_line(["GLOO_SOCKET_IFNAME"]) and dropped_line([]) == ""


def test_torchrun_argv_with_the_shim():
    argv = torchrun_argv("train.py", ["-x"], nnodes=1, nproc_per_node=1, node_rank=0, master_addr="h",
                         master_port=1, python="/py", shim="/s/rankshim.py", facts_dir="/f")
    assert argv[-6:] == ["/s/rankshim.py", "--facts", "/f", "--", "train.py", "-x"]


@pytest.mark.slow
def test_local_run_drops_an_inherited_bogus_interface_and_says_so(tmp_path, monkeypatch):
    """GLOO_SOCKET_IFNAME=bogus0 exported in the shell used to fail a local run with gloo's raw message."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    monkeypatch.setenv("MASTER_PORT", "1")
    said: list[str] = []
    spec = LocalLaunchSpec(script_rel="fault.py", args=["ok"], workdir=SCRIPTS, nnodes=2, nproc_per_node=1,
                           env={"PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}, node_envs=[{}, {}],
                           setup=[], expect=["rank 0 ok"], deadline_s=120)
    res = run_local(spec, tmp_path / "run", echo=said.append)
    assert res.ok, (res.reason, res.tail)
    line = [s for s in said if s.startswith("[broker] not passed to the nodes")]
    assert line and "GLOO_SOCKET_IFNAME" in line[0] and "MASTER_PORT" in line[0]
    assert "not passed to the nodes" in (tmp_path / "run" / "node0.log").read_text()
    # the table comes from the shim's facts: the script prints no RANK= line
    assert [(r.rank, r.device, r.backend) for r in res.ranks] == [(0, "cpu", "gloo"), (1, "cpu", "gloo")]
    assert res.shown_status == "succeeded"
