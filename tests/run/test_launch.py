"""The launcher: per-node argv and environment, supervision (stop-all on failure, deadline), expect checks."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from broker.run.launch import LocalLaunchSpec, free_port, local_argvs, torchrun_argv
from tests.support.runs import run_local
from broker.run.supervisor import LocalNode, Supervisor, check_expect, rank_table
from broker.core.model import Requirements
from broker.run.targets import local_spec
from broker.core.provider import NoValidPlan
from broker.core.recipe import load_recipe
from broker.providers.local import LocalGpu, LocalProvider, detect_gpus

REPO = Path(__file__).resolve().parents[2]


def test_torchrun_argv_static_rendezvous():
    argv = torchrun_argv("train.py", ["--epochs", "3"], nnodes=2, nproc_per_node=1, node_rank=1,
                         master_addr="127.0.0.1", master_port=29533, python="/py")
    assert argv == ["/py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--node_rank=1",
                    "--master_addr=127.0.0.1", "--master_port=29533", "train.py", "--epochs", "3"]


def test_free_port_avoids_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = {free_port() for _ in range(5)}
        assert busy not in ports
        for p in ports:
            with socket.socket() as t:
                t.bind(("127.0.0.1", p))


def test_per_node_argv_env_on_a_two_gpu_host(tmp_path):
    """Simulated topology on a 2-GPU host: node i gets CUDA_VISIBLE_DEVICES=i and --node_rank=i, one port."""
    local = LocalProvider(gpus=[LocalGpu("0", "NVIDIA H200", 140.0), LocalGpu("1", "NVIDIA H200", 140.0)])
    req = Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16)
    assert local.why_not(req) is None and local.uses_gpus(req)
    envs = [local.node_env(req, i) for i in range(2)]
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    spec = LocalLaunchSpec(script_rel="ddp_train.py", args=["--epochs", "1"], workdir=REPO / "recipes", nnodes=2,
                           nproc_per_node=1, env={}, node_envs=envs, setup=[], expect=[], deadline_s=60)
    argvs = local_argvs(spec, 41234, [tmp_path / "node0" / "work", tmp_path / "node1" / "work"])
    for i, argv in enumerate(argvs):
        assert f"--node_rank={i}" in argv and "--nnodes=2" in argv and "--nproc_per_node=1" in argv
        assert "--master_addr=127.0.0.1" in argv and "--master_port=41234" in argv
        assert argv[-3:] == ["ddp_train.py", "--epochs", "1"]


def test_two_gpus_per_node_and_cpu_fallback():
    gpus = [LocalGpu(str(i), "A10", 24.0) for i in range(4)]
    local = LocalProvider(gpus=gpus)
    req = Requirements(nodes=2, gpus_per_node=2)
    assert [local.node_env(req, i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "0,1"},
                                                          {"CUDA_VISIBLE_DEVICES": "2,3"}]
    none = LocalProvider(gpus=[])
    assert "no GPU" in (none.why_not(Requirements(cpu_ok=False)) or "")
    assert none.why_not(Requirements(cpu_ok=True)) is None
    assert none.node_env(Requirements(cpu_ok=True), 1) == {"CUDA_VISIBLE_DEVICES": ""}
    small = LocalProvider(gpus=[LocalGpu("0", "T4", 15.0), LocalGpu("1", "T4", 15.0)])
    assert "15.0 GiB" in (small.why_not(Requirements(min_gpu_mem_gib=16)) or "")
    one = LocalProvider(gpus=[LocalGpu("0", "L4", 22.0)])
    assert "has 1 GPU(s), the job needs 2" in (one.why_not(Requirements(min_gpu_mem_gib=16)) or "")


def test_detect_gpus_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H200, 143771'\necho '1, NVIDIA H200, 143771'\n")
    smi.chmod(0o755)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = detect_gpus(nvidia_smi=str(smi), proc_dir=tmp_path / "none")
    assert [(g.index, g.name, g.mem_gib) for g in gpus] == [("0", "NVIDIA H200", 140.4), ("1", "NVIDIA H200", 140.4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.index for g in detect_gpus(nvidia_smi=str(smi), proc_dir=tmp_path / "none")] == ["1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_gpus(nvidia_smi=str(smi), proc_dir=tmp_path / "none") == []


def test_nvidia_smi_is_found_on_path_as_shutil_which_finds_it(tmp_path, monkeypatch):
    import shutil

    import broker.providers.local as pl

    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "nvidia-smi").write_text("#!/bin/sh\n")  # not executable: passed over
    (second / "nvidia-smi").write_text("#!/bin/sh\n")
    (second / "nvidia-smi").chmod(0o755)
    (first / "nvidia-smi.d").mkdir()
    monkeypatch.setenv("PATH", f"{first}:{tmp_path / 'missing'}:{second}")
    assert pl._which("nvidia-smi") == str(second / "nvidia-smi") == shutil.which("nvidia-smi")
    assert pl._which("nvidia-smi.d") is None is shutil.which("nvidia-smi.d")
    monkeypatch.setenv("PATH", str(first))
    assert pl._which("nvidia-smi") is None is shutil.which("nvidia-smi")
    smi = tmp_path / "c" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho '0, NVIDIA L4, 23034'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi.parent))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g.name for g in detect_gpus(proc_dir=tmp_path / "none")] == ["NVIDIA L4"]


def test_local_spec_refuses_gpu_job_without_gpu(tmp_path, monkeypatch):
    import broker.providers.local as pl

    monkeypatch.setattr(pl, "detect_gpus", lambda: [])
    (tmp_path / "t.py").write_text("")
    (tmp_path / "r.yaml").write_text("name: g\nscript: t.py\ncpu_ok: false\n")
    with pytest.raises(NoValidPlan, match="no GPU"):
        local_spec(load_recipe(tmp_path / "r.yaml"))


def _py_node(rank: int, code: str, cwd: Path) -> LocalNode:
    return LocalNode(rank, [sys.executable, "-c", code], dict(os.environ), cwd)


def test_supervisor_stops_others_when_one_fails(tmp_path):
    logs = {0: tmp_path / "n0.log", 1: tmp_path / "n1.log"}
    # node 0 would wait "forever" (like a torchrun waiting for its peer); node 1 fails after printing
    n0 = _py_node(0, "import time; print('waiting', flush=True); time.sleep(300)", tmp_path)
    n1 = _py_node(1, "import sys; print('boom', flush=True); sys.exit(3)", tmp_path)
    lines: list[str] = []
    t0 = time.monotonic()
    res = Supervisor(logs, echo=lines.append, grace_s=1.0).run([n0, n1], deadline_s=120)
    assert time.monotonic() - t0 < 30
    assert res.status == "failed" and res.failed_node == 1
    assert res.exit_codes[1] == 3 and res.exit_codes[0] is not None and res.exit_codes[0] != 0
    assert "[node 1] boom" in lines and "[node 0] waiting" in lines
    assert "boom" in logs[1].read_text() and "waiting" in logs[0].read_text()


def test_supervisor_kills_sigterm_ignoring_process_group(tmp_path):
    """torchelastic's exit barrier ignores SIGTERM: the group must still die (SIGKILL after the grace)."""
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            "subprocess.Popen([sys.executable, '-c', 'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(\"child.pid\",\"w\").write(str(__import__(\"os\").getpid())); time.sleep(300)']);"
            "print('stubborn', flush=True); time.sleep(300)")
    n0 = _py_node(0, code, tmp_path)
    n1 = _py_node(1, "import time, sys; time.sleep(0.5); sys.exit(1)", tmp_path)
    res = Supervisor({0: tmp_path / "a", 1: tmp_path / "b"}, echo=None, grace_s=0.5).run([n0, n1], deadline_s=60)
    assert res.status == "failed"
    assert res.exit_codes[0] == -9
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a killed child may linger as a zombie until reaped by init
        stat = Path(f"/proc/{child}/stat")
        if stat.exists() and stat.read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("child of the stopped node survived")


def test_supervisor_deadline(tmp_path):
    n0 = _py_node(0, "import time; time.sleep(300)", tmp_path)
    res = Supervisor({0: tmp_path / "a"}, echo=None, grace_s=0.5).run([n0], deadline_s=0.5)
    assert res.status == "deadline" and "deadline" in res.reason


def test_check_expect_and_rank_table(tmp_path):
    log = tmp_path / "n0.log"
    log.write_text("RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 device=cuda:0 backend=nccl host=a\nDDP_OK\n")
    log1 = tmp_path / "n1.log"
    log1.write_text("nothing useful\n")
    assert check_expect(log, ["DDP_OK", r"accuracy=0\.9"]) == [r"accuracy=0\.9"]
    rows = rank_table({0: log, 1: log1}, nnodes=2, nproc_per_node=1)
    assert [(r.node, r.rank, r.local_rank, r.world_size, r.device, r.backend) for r in rows] == [
        (0, 0, 0, 2, "cuda:0", "nccl"), (1, 1, 0, 2, "?", "?")]


def test_setup_failure_names_node_and_command(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "t.py").write_text("print('never')\n")
    spec = LocalLaunchSpec(script_rel="t.py", args=[], workdir=tmp_path / "w", nnodes=2, nproc_per_node=1, env={},
                           node_envs=[{}, {}], setup=["echo ok", "exit 7"], expect=[], deadline_s=60)
    res = run_local(spec, tmp_path / "run", echo=None)
    assert res.status == "failed" and res.failed_node == 0
    assert "setup command failed on node 0" in res.reason and "exit 7" in res.reason


def test_fresh_workdir_per_node(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "t.py").write_text("")
    spec = LocalLaunchSpec(script_rel="t.py", args=[], workdir=tmp_path / "w", nnodes=2, nproc_per_node=1, env={},
                           node_envs=[{}, {}], setup=["touch marker-$BROKER_NODE_RANK", "exit 1"], expect=[],
                           deadline_s=60)
    run_local(spec, tmp_path / "run", echo=None)
    assert (tmp_path / "run" / "node0" / "work" / "marker-0").exists()
    assert not (tmp_path / "w" / "marker-0").exists()
