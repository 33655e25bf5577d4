"""broker lint: one test per mistake kind on small scripts, a clean script, the CLI exit codes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.lint.rules import lint_script
from broker.lint.script import lint_source

ROOT = Path(__file__).resolve().parents[2]


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


def test_cli_exit_codes_match_the_words(tmp_path):
    """0 no findings, 1 findings (with or without the old --strict), 2 bad input."""
    from broker.cli.app import app
    from broker.core.provider import BadInput

    bad = tmp_path / "bad.py"
    bad.write_text("import os, torch\nrank = int(os.environ['RANK'])\ntorch.cuda.set_device(rank)\n")
    r = CliRunner().invoke(app, ["lint", str(bad)])
    assert r.exit_code == 1 and f"{bad}:3:" in r.output and "device-from-rank" in r.output
    assert "fix:" in r.output and "1 finding(s)" in r.output
    assert CliRunner().invoke(app, ["lint", str(bad), "--strict"]).exit_code == 1
    r = CliRunner().invoke(app, ["lint", str(ROOT / "recipes" / "ddp_train.py")])
    assert r.exit_code == 0 and "no findings" in r.output
    r = CliRunner().invoke(app, ["lint", str(tmp_path / "missing.py")])
    assert isinstance(r.exception, BadInput) and r.exception.exit_code == 2 and "missing.py" in str(r.exception)
    sh = tmp_path / "setup.sh"
    sh.write_text("#!/bin/bash\npip install torch\n")
    r = CliRunner().invoke(app, ["lint", str(sh)])  # a shell script without #SBATCH: its launch lines are checked
    assert r.exit_code == 0 and "no findings" in r.output, r.output
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(app, ["lint", str(tmp_path / "empty")])
    assert isinstance(r.exception, BadInput) and "no Python" in str(r.exception)
    r = CliRunner().invoke(app, ["lint", "--help"])
    assert r.exit_code == 0 and "0 no findings" in " ".join(r.output.split())


def test_cli_several_paths_and_directories_json(tmp_path):
    import json

    from broker.cli.app import app

    d = tmp_path / "proj"
    (d / "sub").mkdir(parents=True)
    (d / ".venv").mkdir()
    (d / ".venv" / "x.py").write_text("import torch.distributed as d\nd.init_process_group('nccl')\n")
    (d / "sub" / "train.py").write_text("import torch.distributed as d\nd.init_process_group('nccl')\n")
    (d / "ok.py").write_text("print('hi')\n")
    (d / "job.sbatch").write_text("#!/bin/bash\n#SBATCH --nodes=2\ntorchrun --nproc_per_node=2 train.py\n")
    (d / "tool.sh").write_text("#!/bin/bash\necho not a batch script\n")
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    r = CliRunner().invoke(app, ["lint", str(d), str(other), "--json"])
    assert r.exit_code == 1, r.output
    out = json.loads(r.output)
    assert sorted(Path(f).name for f in out["files"]) == ["job.sbatch", "ok.py", "other.py", "train.py"]
    got = sorted((Path(f["path"]).name, f["line"], f["kind"]) for f in out["findings"])
    assert got == [("job.sbatch", 3, "sbatch-no-node-rank"), ("job.sbatch", 3, "sbatch-torchrun-not-srun"),
                   ("train.py", 2, "nccl-no-fallback")]
    assert all(f["fix"] and f["message"] for f in out["findings"])
    r = CliRunner().invoke(app, ["lint", str(d / "ok.py"), str(other), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["findings"] == []


def test_sbatch_fix_is_the_srun_pattern_broker_renders(tmp_path):
    from broker.lint.sbatch import lint_sbatch
    from broker.core.recipe import load_recipe
    from broker.slurm.executor import render_sbatch

    (f,) = [x for x in lint_sbatch("#!/bin/bash\n#SBATCH -N 2\ntorchrun --node_rank=0 t.py\n", "j.sbatch")]
    assert f.kind == "sbatch-torchrun-not-srun" and "only the first node" in f.message
    assert "srun" in f.fix and "--node_rank=$SLURM_NODEID" in f.fix
    recipe = load_recipe(ROOT / "recipes" / "ddp_2node.yaml")
    assert recipe.nodes > 1
    script = render_sbatch(recipe, log_dir=tmp_path / "logs")
    assert "--node_rank=$SLURM_NODEID" in script and lint_sbatch(script, "rendered.sbatch") == []
    p = tmp_path / "rendered.sbatch"
    p.write_text(script)
    assert lint_script(p) == []


def test_shipped_recipes_are_clean():
    for name in ("ddp_train.py", "allreduce_bench.py"):
        assert lint_script(ROOT / "recipes" / name) == [], name
        assert lint_script(ROOT / "recipes" / name, launched_by_torchrun=True) == [], name


def test_recipe_script_reading_slurm_rank_is_flagged(tmp_path):
    """broker starts a recipe's script with torchrun: SLURM_PROCID there is the node's task index."""
    src = "import os\nrank = int(os.environ['SLURM_PROCID'])\n"
    assert kinds(src) == []  # a standalone script may be started by srun alone
    assert [(f.line, f.kind) for f in lint_source(src, "t.py", launched_by_torchrun=True)] == \
        [(2, "slurm-env-under-torchrun")]


def test_ignore_comment_silences_only_its_kind():
    src = """
    import os, torch
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)  # broker-lint: ignore[nccl-no-fallback]
    torch.cuda.set_device(rank)  # broker-lint: ignore[device-from-rank]
    torch.cuda.set_device(rank)  # broker-lint: ignore
    """
    assert kinds(src) == [(4, "device-from-rank")]


def test_core_cli_does_not_import_astroid():
    import subprocess
    import sys

    code = "import sys, broker.cli.app; assert 'astroid' not in sys.modules, 'astroid imported at start'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_lint_recipe_strict_refuses(tmp_path):
    from broker.lint.rules import lint_recipe
    from broker.core.recipe import load_recipe

    (tmp_path / "t.py").write_text("import torch.distributed as dist\ndist.init_process_group('nccl')\n")
    (tmp_path / "r.yaml").write_text("name: t\nscript: t.py\nstrict_lint: true\n")
    findings, refuse = lint_recipe(load_recipe(tmp_path / "r.yaml"))
    assert [f.kind for f in findings] == ["nccl-no-fallback"] and refuse
    (tmp_path / "r.yaml").write_text("name: t\nscript: t.py\n")
    assert lint_recipe(load_recipe(tmp_path / "r.yaml"))[1] is False
    assert lint_recipe(load_recipe(ROOT / "recipes" / "ddp_2node.yaml")) == ([], False)


def test_cli_syntax_error_is_a_finding(tmp_path):
    from broker.cli.app import app

    bad = tmp_path / "broken.py"
    bad.write_text("def x(:\n")
    r = CliRunner().invoke(app, ["lint", str(bad)])
    assert r.exit_code == 1 and "syntax-error" in r.output and "error" in r.output


def test_lint_never_parses_the_modules_a_script_imports():
    """astroid would parse torch to build `torch.backends.cudnn.benchmark = True` (20 s on a dataclass file)."""
    from astroid.manager import AstroidManager

    src = """
    import torch
    from dataclasses import dataclass
    from torch.distributed.fsdp import ShardingStrategy
    torch.backends.cudnn.benchmark = True

    @dataclass
    class Config:
        strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """
    assert kinds(src) == []
    cache = AstroidManager.brain["astroid_cache"]
    assert not [k for k in cache if k == "torch" or k.startswith("torch.")]
    assert "torch" not in AstroidManager().module_denylist  # the deny-list is astroid's own again afterwards


def test_provenance_walk_is_linear_not_exponential():
    """Each value is worked out once per node: a chain of 40 names that each take one of three earlier values.
    The unmemoised walk was exponential (minutes on torch/distributed/_state_dict_utils.py) and, capped at 12
    levels, lost the rank here."""
    import time

    lines = ["import os, sys, torch", "x0 = int(os.environ['RANK'])"]
    for i in range(1, 40):
        lines += [f"if len(sys.argv) == {i}:", f"    x{i} = x{i - 1}", f"elif len(sys.argv) == {i + 100}:",
                  f"    x{i} = x{i - 1} + 1", "else:", f"    x{i} = x{i - 1} * 1"]
    lines.append("torch.cuda.set_device(x39)")
    t0 = time.perf_counter()
    got = lint_source("\n".join(lines) + "\n", "chain.py")
    assert time.perf_counter() - t0 < 20
    assert [(f.line, f.kind) for f in got] == [(len(lines), "device-from-rank")]


def test_recipe_lint_is_cached_by_script_content(tmp_path, monkeypatch):
    """`broker run` lints the same script every run: the result is cached by content, and an edit is linted anew."""
    import broker.lint.rules as lint
    from broker.core.recipe import load_recipe

    d = tmp_path / "job"
    d.mkdir()
    (d / "train.py").write_text("import os, torch\ntorch.cuda.set_device(int(os.environ['RANK']))\n")
    (d / "r.yaml").write_text("name: j\nscript: train.py\ncpu_ok: true\n")
    recipe = load_recipe(d / "r.yaml")
    calls = []
    real = lint.lint_script
    monkeypatch.setattr(lint, "lint_script", lambda *a, **k: calls.append(a) or real(*a, **k))
    first, _ = lint.lint_recipe(recipe)
    second, _ = lint.lint_recipe(recipe)
    assert [f.kind for f in first] == [f.kind for f in second] == ["device-from-rank"] and len(calls) == 1
    (d / "train.py").write_text("import os, torch\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n")
    third, _ = lint.lint_recipe(recipe)
    assert third == [] and len(calls) == 2
