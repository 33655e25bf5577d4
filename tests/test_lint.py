"""broker lint: one test per mistake kind on small scripts, a clean script, the CLI exit codes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.lint import lint_script, lint_source

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))


def kinds(src: str) -> list[tuple[int, str]]:
    return [(f.line, f.kind) for f in lint_source(textwrap.dedent(src), "t.py")]


def test_device_from_global_rank():
    src = """
    import os, torch, torch.distributed as dist
    rank = int(os.environ["RANK"])
    g = dist.get_rank()
    r2 = int(os.getenv("RANK", "0"))
    torch.cuda.set_device(rank)
    model = torch.nn.Linear(2, 2).cuda(g)
    dev = f"cuda:{r2}"
    d = torch.device("cuda", rank)
    x = torch.zeros(1).to(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[g])
    """
    got = kinds(src)
    assert got == [(6, "device-from-rank"), (7, "device-from-rank"), (8, "device-from-rank"),
                   (9, "device-from-rank"), (10, "device-from-rank"), (11, "device-from-rank")]
    f = lint_source(textwrap.dedent(src), "t.py")[0]
    assert f.format().startswith("t.py:6: [device-from-rank]") and "LOCAL_RANK" in f.fix


def test_device_from_local_rank_or_modulo_is_fine():
    assert kinds("""
    import os, torch
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(local_rank)
    d = torch.device("cuda", local_rank)
    e = torch.device("cuda", rank % torch.cuda.device_count())
    s = f"cuda:{local_rank}"
    shard = list(range(10))[rank]
    y = torch.zeros(1).cuda(shard)
    """) == []


def test_nccl_without_cuda_fallback():
    assert kinds("""
    import torch.distributed as dist
    dist.init_process_group(backend="nccl")
    """) == [(3, "nccl-no-fallback")]
    assert kinds("""
    import torch.distributed as dist
    dist.init_process_group("nccl", timeout=None)
    """) == [(3, "nccl-no-fallback")]


def test_nccl_with_fallback_or_guard_is_fine():
    assert kinds("""
    import torch, torch.distributed as dist
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    """) == []
    assert kinds("""
    import sys, torch, torch.distributed as dist
    if torch.cuda.is_available():
        dist.init_process_group(backend="nccl")
    else:
        dist.init_process_group(backend="gloo")
    """) == []
    assert kinds("""
    import sys, torch, torch.distributed as dist
    if not torch.cuda.is_available():
        sys.exit("this job needs GPUs")
    dist.init_process_group(backend="nccl")
    """) == []


def test_rank0_work_keyed_on_local_rank():
    got = kinds("""
    import os, torch
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if local_rank == 0:
        torch.save({}, "ckpt.pt")
    if int(os.environ["LOCAL_RANK"]) == 0:
        with open("metrics.json", "w") as f:
            f.write("{}")
    if local_rank == 0:
        print("hello")  # printing is fine
    if local_rank == 0:
        with open("data.csv") as f:  # reading is fine
            f.read()
    """)
    assert got == [(5, "local-rank-writes"), (7, "local-rank-writes")]


def test_download_by_global_rank_zero_only():
    got = kinds("""
    import os, urllib.request, torch.distributed as dist
    from torchvision import datasets
    rank = int(os.environ["RANK"])
    if rank == 0:
        urllib.request.urlretrieve("https://example.invalid/x.bin", "x.bin")
    if dist.get_rank() == 0:
        ds = datasets.MNIST("data", download=True)
    local_rank = int(os.environ["LOCAL_RANK"])
    if local_rank == 0:  # once per node: correct
        urllib.request.urlretrieve("https://example.invalid/x.bin", "x.bin")
    if rank == 0:
        import torch; torch.save({}, "ckpt.pt")  # one writer keyed on the global rank: correct
    """)
    assert got == [(6, "download-global-rank-0"), (8, "download-global-rank-0")]


def test_shipped_training_script_is_clean():
    assert lint_script(ROOT / "recipes" / "ddp_train.py") == []


def test_syntax_error_is_one_finding():
    (f,) = lint_source("def x(:\n", "bad.py")
    assert f.kind == "syntax-error" and f.line == 1


def test_cli_warns_by_default_and_strict_fails(tmp_path):
    from broker.cli import app

    bad = tmp_path / "bad.py"
    bad.write_text("import os, torch\nrank = int(os.environ['RANK'])\ntorch.cuda.set_device(rank)\n")
    r = CliRunner().invoke(app, ["lint", str(bad)])
    assert r.exit_code == 0 and f"{bad}:3:" in r.output and "device-from-rank" in r.output
    assert "fix:" in r.output
    r = CliRunner().invoke(app, ["lint", str(bad), "--strict"])
    assert r.exit_code == 1
    r = CliRunner().invoke(app, ["lint", str(ROOT / "recipes" / "ddp_train.py"), "--strict"])
    assert r.exit_code == 0 and "no findings" in r.output


def test_lint_recipe_strict_refuses(tmp_path):
    from broker.lint import lint_recipe
    from broker.recipe import load_recipe

    (tmp_path / "t.py").write_text("import torch.distributed as dist\ndist.init_process_group('nccl')\n")
    (tmp_path / "r.yaml").write_text("name: t\nscript: t.py\nstrict_lint: true\n")
    findings, refuse = lint_recipe(load_recipe(tmp_path / "r.yaml"))
    assert [f.kind for f in findings] == ["nccl-no-fallback"] and refuse
    (tmp_path / "r.yaml").write_text("name: t\nscript: t.py\n")
    assert lint_recipe(load_recipe(tmp_path / "r.yaml"))[1] is False
    assert lint_recipe(load_recipe(ROOT / "recipes" / "ddp_2node.yaml")) == ([], False)


def test_cli_syntax_error_fails_even_without_strict(tmp_path):
    from broker.cli import app

    bad = tmp_path / "broken.py"
    bad.write_text("def x(:\n")
    r = CliRunner().invoke(app, ["lint", str(bad)])
    assert r.exit_code == 1 and "syntax-error" in r.output and "error" in r.output
