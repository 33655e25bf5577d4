"""The one run pipeline: staging, artifacts from every node, confirmation of paid runs, the shielded release, SSH
readiness retries, and the layering rules (adapters never import orchestration; `providers` is not a top-level
module of an installed broker)."""

from __future__ import annotations

import ast
import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.run.runrecord import Hooks
from broker.run.targets import LocalTarget
from broker.run.pipeline import run_pipeline
from broker.run.guard import shielded
from broker.core.recipe import RecipeError, load_recipe
from broker.run.staging import stage_plan
from tests.conftest import REPO, broker_cmd
from tests.support.netfwd import LateForwarder


# --------------------------------------------------------------------------------------------------- staging
def test_staging_skips_secrets_venvs_and_ignored_files(tmp_path):
    w = tmp_path / "w"
    (w / "pkg").mkdir(parents=True)
    (w / "train.py").write_text("print('hi')\n")
    (w / "pkg" / "model.py").write_text("x = 1\n")
    for secret in (".env", ".env.local", "id_ed25519", "id_rsa.pub", "key.pem", "pkg/.env"):
        (w / secret).write_text("SECRET=1\n")
    (w / ".venv" / "bin").mkdir(parents=True)
    (w / ".venv" / "bin" / "python").write_text("")
    (w / "myenv").mkdir()
    (w / "myenv" / "pyvenv.cfg").write_text("home = /usr\n")  # a venv under any name
    (w / "node_modules" / "x").mkdir(parents=True)
    (w / ".git").mkdir()
    (w / ".git" / "config").write_text("")
    (w / "data").mkdir()
    (w / "data" / "big.bin").write_bytes(b"x" * 1000)
    (w / "logs").mkdir()
    (w / "logs" / "a.log").write_text("log\n")
    (w / ".gitignore").write_text("data/\n")
    (w / ".brokerignore").write_text("*.log\n")
    plan = stage_plan(w)
    files = sorted(p.as_posix() for p in plan.files)
    assert files == [".brokerignore", ".gitignore", "pkg/model.py", "train.py"]
    assert plan.total_bytes == sum((w / f).stat().st_size for f in files)
    assert "per node" in plan.summary() and not plan.too_big


def _staged_trees(plan, tmp_path):
    """What the local executor (copy_staged) and the SSH/Slurm executors (tar_staged, unpacked) put on a node:
    {relative path: ("file", bytes) | ("link", target)} for each."""
    import io
    import tarfile

    from broker.run.staging import copy_staged, tar_staged

    def tree(d: Path) -> dict:
        out = {}
        for p in sorted(d.rglob("*")):
            rel = p.relative_to(d).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = ("file", p.read_bytes())
        return out

    copy_staged(plan, tmp_path / "local")
    (tmp_path / "remote").mkdir()
    with tarfile.open(fileobj=io.BytesIO(tar_staged(plan)), mode="r:gz") as tar:
        tar.extractall(tmp_path / "remote", filter="tar")
    return tree(tmp_path / "local"), tree(tmp_path / "remote")


def test_staging_symlinks_one_rule_for_every_executor(tmp_path):
    """A link out of the workdir (the trial's `shadowlink -> /etc/shadow`) or to an excluded file (`envlink -> .env`)
    is never staged, by the local copy or the SSH tarball; a link to an allowed file or folder inside it is staged
    as the same regular file(s) by both; folder links never loop."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "shadow").write_text("root:SECRET-HASH\n")
    (outside / "dir" / "f.txt").write_text("outside\n")
    w = tmp_path / "w"
    (w / "pkg").mkdir(parents=True)
    (w / "train.py").write_text("print('hi')\n")
    (w / "pkg" / "model.py").write_text("x = 1\n")
    (w / ".env").write_text("API_KEY=SECRET-ENV\n")
    (w / "id_ed25519").write_text("SECRET-KEY\n")
    (w / "data").mkdir()
    (w / "data" / "big.bin").write_text("SECRET-IGNORED\n")
    (w / ".gitignore").write_text("data/\n")
    links = {"shadowlink": outside / "shadow", "outdir": outside / "dir", "envlink": ".env", "keylink": "id_ed25519",
             "datalink": "data/big.bin", "datadir": "data", "same.py": "train.py", "abs.py": w / "pkg" / "model.py",
             "pkglink": "pkg", "loop": ".", "dangling": "nowhere.txt"}
    for name, target in links.items():
        os.symlink(target, w / name)
    os.symlink("..", w / "pkg" / "up")  # a loop through the parent
    plan = stage_plan(w)
    staged = sorted(p.as_posix() for p in plan.files)
    assert staged == [".gitignore", "abs.py", "pkg/model.py", "pkglink/model.py", "same.py", "train.py"], staged
    summary = plan.summary()
    assert "shadowlink (symlink outside the workdir)" in summary and "SECRET" not in summary
    skipped = {rule: sorted(names) for rule, names in plan.skipped.items()}
    assert skipped["symlink outside the workdir"] == ["outdir", "shadowlink"]
    assert skipped["symlink to an excluded path"] == ["datadir", "datalink", "envlink", "keylink"]
    assert skipped["symlink loop"] == ["loop", "pkg/up", "pkglink/up"]
    assert skipped["dangling symlink"] == ["dangling"]
    assert plan.total_bytes == sum(len(f.read_bytes()) for f in (w / x for x in staged))
    local, remote = _staged_trees(plan, tmp_path)
    assert local == remote  # the same on every executor
    assert all(kind == "file" for kind, _ in local.values()), local  # copies, never links (dangling elsewhere)
    assert local["same.py"] == ("file", b"print('hi')\n") and local["pkglink/model.py"] == ("file", b"x = 1\n")
    assert not any(b"SECRET" in data for _, data in local.values())


def test_staged_list_not_copied_list_and_summary_agree(tmp_path):
    """The trial's staged.txt contradicted itself: `datalink/README.md` staged while `datalink/` was "not copied"
    with no reason; `sub/` not copied while the why-section and the printed line said `.aws/`; `loop1`/`loop2`
    (links to each other) called dangling; the line said `.env` where the file said `wd/.env`.  Now one record:
    the same relative paths everywhere, every not-copied entry under its rule, loops named as loops."""
    from broker.run.executor import STAGED_LIST, staging_line

    w = tmp_path / "w"
    (w / "data").mkdir(parents=True)
    (w / "data" / "README.md").write_text("data\n")
    (w / "train.py").write_text("print(1)\n")
    os.symlink("data", w / "datalink")
    (w / "sub" / ".aws").mkdir(parents=True)
    (w / "sub" / ".aws" / "credentials").write_text("SECRET\n")
    (w / "sub" / "ok.py").write_text("x = 1\n")
    (w / "wd").mkdir()
    (w / "wd" / ".env").write_text("SECRET\n")
    os.symlink("loop2", w / "loop1")
    os.symlink("loop1", w / "loop2")
    plan = stage_plan(w)
    run = tmp_path / "run"
    line = staging_line(plan, run)
    text = (run / STAGED_LIST).read_text()
    head, rest = text.split("\n# not copied (")
    staged = [ln for ln in head.splitlines()[1:] if ln]
    body, why = rest.split("\n# why")
    listed = [ln for ln in body.splitlines()[1:] if ln]
    reasons = {}
    for ln in why.splitlines()[1:]:
        if ln:
            rule, names = ln.split(": ", 1)
            for n in names.split(", "):
                reasons[n] = rule
    assert "datalink/README.md" in staged and "data/README.md" in staged, text
    for entry in listed:  # nothing both staged and not copied
        assert not any(f == entry or f.startswith(entry) for f in staged if entry.endswith("/") or f == entry), \
            (entry, text)
    assert sorted(reasons) == sorted(listed), text  # every not-copied entry has its reason
    assert "sub/.aws/" in listed and reasons["sub/.aws/"] == "always" and "sub/" not in listed, text
    assert "wd/.env" in listed and ".env" not in listed and ".aws/" not in listed, text
    assert reasons["loop1"] == reasons["loop2"] == "symlink loop", text
    flat = " ".join(line.split())
    assert "sub/.aws/" in flat and "wd/.env" in flat and "loop1 (symlink loop)" in flat, line
    assert "dangling" not in flat, line


def test_staging_skips_every_dotenv_file(tmp_path):
    """`.env*` as documented: .envrc (direnv), .env.local, .env.production are secrets as much as .env."""
    w = tmp_path / "w"
    w.mkdir()
    (w / "train.py").write_text("print('hi')\n")
    for name in (".env", ".envrc", ".env.local", ".env.production", ".env.example"):
        (w / name).write_text("TOKEN=SECRET\n")
    plan = stage_plan(w)
    assert [p.as_posix() for p in plan.files] == ["train.py"]
    assert sorted(plan.skipped["always"]) == [".env", ".env.example", ".env.local", ".env.production", ".envrc"]


def test_staging_applies_the_gitignore_files_of_the_enclosing_repository(tmp_path):
    """Inside a git work tree the .gitignore files from the repository root down to the workdir apply (each relative
    to its own folder, the deepest decisive pattern winning) and .git/info/exclude too, as `git status` sees it."""
    repo = tmp_path / "repo"
    w = repo / "proj" / "recipes"
    (w / "sub").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("checkpoint.pt\n*.ckpt\n/top_only.txt\n/proj/recipes/outputs/\n")
    (repo / "proj" / ".gitignore").write_text("!keep.ckpt\nscratch/\n")
    (repo / ".git" / "info" / "exclude").write_text("local-notes.md\n")
    (w / ".gitignore").write_text("sub/*.log\n")
    files = {"train.py": "print(1)\n", "checkpoint.pt": "w", "sub/checkpoint.pt": "w", "a.ckpt": "w",
             "keep.ckpt": "kept", "top_only.txt": "not anchored here", "outputs/o.bin": "o", "scratch/s.txt": "s",
             "local-notes.md": "n", "sub/x.log": "l", "sub/ok.py": "ok\n"}
    for rel, text in files.items():
        (w / rel).parent.mkdir(parents=True, exist_ok=True)
        (w / rel).write_text(text)
    staged = sorted(p.as_posix() for p in stage_plan(w).files)
    assert staged == [".gitignore", "keep.ckpt", "sub/ok.py", "top_only.txt", "train.py"], staged
    # the same verdicts as git's own
    shown = subprocess.run(["git", "-C", str(w), "ls-files", "--others", "--exclude-standard", "."],
                           capture_output=True, text=True, check=True).stdout.split()
    assert sorted(shown) == staged


def test_script_outside_the_recipe_folder_is_refused_unless_workdir_says_so(tmp_path):
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / ".env").write_text("KEY=1\n")
    (tmp_path / "train.py").write_text("print(1)\n")
    d = tmp_path / "recipes"
    d.mkdir()
    (d / "r.yaml").write_text("name: r\nscript: ../train.py\ncpu_ok: true\n")
    with pytest.raises(RecipeError, match=r"r\.yaml:2: field 'script'.*outside the recipe's folder"):
        load_recipe(d / "r.yaml")
    (d / "r.yaml").write_text("name: r\nscript: ../train.py\nworkdir: ..\ncpu_ok: true\n")
    assert load_recipe(d / "r.yaml").workdir.resolve() == tmp_path


# --------------------------------------------------------------------------------------------------- local runs
SHARDS = """
import os, shutil, sys
rank = int(os.environ["RANK"])
open(f"shard_rank{rank}.txt", "w").write(f"rank {rank}\\n")
print("python", sys.executable, "which", shutil.which("python"), flush=True)
print("DONE", flush=True)
"""


def _job(tmp_path: Path, extra: str = "") -> Path:
    d = tmp_path / "job"
    d.mkdir(exist_ok=True)
    (d / "shards.py").write_text(SHARDS)
    (d / ".env").write_text("TOKEN=never-copied\n")
    (d / "r.yaml").write_text("name: shards\nscript: shards.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n"
                              "expect: [DONE]\nartifacts: ['shard_rank*.txt']\n"
                              "setup: ['command -v python > which-python.txt']\n" + extra)
    return d / "r.yaml"


def test_local_run_collects_artifacts_from_every_node_and_stages_no_secret(tmp_path):
    recipe = load_recipe(_job(tmp_path))
    lines: list[str] = []
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=Ledger(), hooks=Hooks(echo=lines.append))
    assert out.result is not None and out.result.ok, (out.result.reason, lines[-20:])
    run_dir = Path(out.run.run_dir)
    assert (run_dir / "artifacts" / "node0" / "shard_rank0.txt").read_text() == "rank 0\n"
    assert (run_dir / "artifacts" / "node1" / "shard_rank1.txt").read_text() == "rank 1\n"
    assert not (run_dir / "node0" / "work" / ".env").exists()
    # setup runs with the training interpreter first on PATH (the venv's python, not the system's)
    which = (run_dir / "node0" / "work" / "which-python.txt").read_text().strip()
    assert Path(which).parent == Path(sys.executable).parent
    assert out.run.status == "succeeded" and out.exit_code == 0


def test_a_listed_artifact_no_node_produced_fails_the_run_with_its_name(tmp_path):
    path = _job(tmp_path)
    path.write_text(path.read_text().replace("artifacts: ['shard_rank*.txt']", "artifacts: ['shard_rank*.txt', "
                                                                                "'model.pt']"))
    recipe = load_recipe(path)
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=Ledger(), hooks=Hooks())
    assert out.result.status == "failed" and "model.pt" in out.result.reason
    assert out.run.status == "failed" and out.exit_code == 1


# --------------------------------------------------------------------------------------------------- confirmation
def _fake_env(cli_env, tmp_path):
    return dict(cli_env, BROKER_FAKE_STATE=str(tmp_path / "fake.json"))


def _fake_instances(tmp_path) -> dict:
    p = tmp_path / "fake.json"
    return json.loads(p.read_text()).get("instances", {}) if p.exists() else {}


def test_paid_run_without_a_terminal_and_without_yes_creates_nothing(cli_env, tmp_path):
    env = _fake_env(cli_env, tmp_path)
    p = subprocess.run(broker_cmd("run", str(_job(tmp_path)), "--provider", "fake", "-q"), cwd=REPO, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--yes" in p.stderr and "worst case $" in p.stderr and "/hour" in p.stderr
    assert _fake_instances(tmp_path) == {}
    assert Ledger().list_runs() == []  # nothing recorded: nothing was created


def _run_in_pty(argv, env, answer: bytes, timeout: float = 180) -> tuple[int, str]:
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    asked = False
    import select

    while proc.poll() is None and time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.2)
        if r:
            chunk = os.read(proc.stdout.fileno(), 4096)
            out += chunk
        if not asked and b"Proceed? [y/N]" in out:
            os.write(master, answer)
            asked = True
    out += proc.stdout.read() or b""
    proc.wait(timeout=30)
    os.close(master)
    return proc.returncode, out.decode(errors="replace")


def test_paid_run_asks_on_a_terminal_no_refuses_yes_runs(cli_env, tmp_path):
    env = _fake_env(cli_env, tmp_path)
    argv = broker_cmd("run", str(_job(tmp_path)), "--provider", "fake", "-q")
    code, out = _run_in_pty(argv, env, b"n\n")
    assert code == 2 and "Proceed? [y/N]" in out and "not confirmed" in out, out
    assert _fake_instances(tmp_path) == {}
    code, out = _run_in_pty(argv, env, b"y\n")
    assert code == 0, out
    inst = _fake_instances(tmp_path)
    assert inst and all(i["state"] == "terminated" for i in inst.values())


# --------------------------------------------------------------------------------------------------- Ctrl-C
def test_release_is_shielded_from_one_ctrl_c_and_abandoned_by_a_second():
    before = signal.getsignal(signal.SIGINT)  # default, or broker.cli.app's when an earlier test ran cli.main in-process
    said: list[str] = []
    with shielded(said.append):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler ran: no KeyboardInterrupt
    assert said and "still releasing" in said[0]
    said.clear()
    with pytest.raises(KeyboardInterrupt):
        with shielded(said.append):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    assert any("abandoned" in s for s in said)
    assert signal.getsignal(signal.SIGINT) is before


# --------------------------------------------------------------------------------------------------- layering
def test_adapters_import_no_orchestration():
    banned = {"broker.run.pipeline", "broker.money.provision", "broker.money.teardown", "broker.money.watchdog", "broker.run.remote",
              "broker.run.launch", "broker.run.executor", "broker.slurm.executor", "broker.orchestrate", "broker.cloudrun"}
    bad = []
    for path in (REPO / "providers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                    if any(n == b or n.startswith(b + ".") for b in banned)]
    assert bad == []


def test_installed_broker_has_broker_providers_and_no_top_level_providers(tmp_path):
    code = ("import importlib.util, broker.providers as p; from broker.providers import get_provider; "
            "print(get_provider('local').name, importlib.util.find_spec('providers'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["local", "None"]


# --------------------------------------------------------------------------------------------------- SSH readiness
@pytest.mark.netns
def test_ssh_connect_is_retried_until_a_late_sshd_accepts(tmp_path):
    from broker.providers import netns

    why = netns.missing_requirements()
    if why:
        pytest.skip(f"netns: {why}")
    from broker.run.remote import SSHExecutor
    from tests.support.runs import run_remote

    c = netns.up(2, tmp_path / "c", use_gpus=False)
    try:
        recipe = load_recipe(REPO / "recipes" / "ddp_2node.yaml").model_copy(
            update={"args": ["--epochs", "2", "--min-accuracy", "0"], "expect": ["DDP_OK"]})
        cluster = c.cluster("late1")

        def late_cluster(fwd: LateForwarder):
            return cluster.model_copy(update={"nodes": [cluster.nodes[0], cluster.nodes[1].model_copy(
                update={"host": "127.0.0.1", "port": fwd.port})]})

        # without retries, the first refused connect ends the run before anything starts
        fwd0 = LateForwarder((c.ip(1), 22), delay_s=60.0)
        res = run_remote(late_cluster(fwd0), recipe, tmp_path / "run0", echo=None, connect_timeout_s=2)
        fwd0.stop.set()
        assert res.status == "failed" and "cannot reach node 1" in res.reason and res.exit_codes == {}
        fwd = LateForwarder((c.ip(1), 22), delay_s=4.0)
        late = late_cluster(fwd)
        said: list[str] = []
        t0 = time.monotonic()
        from broker.run.executor import run_steps

        res = run_steps(SSHExecutor(late, recipe, tmp_path / "run1", echo=None, connect_timeout_s=2,
                                    ready_timeout_s=60, say=said.append))
        assert res.ok, res.reason
        assert time.monotonic() - t0 >= 3.5
        assert any("waiting for SSH" in s for s in said) and any("accepts SSH" in s for s in said)
        fwd.stop.set()
    finally:
        c.down()


def test_no_docstring_points_outside_the_repository():
    """References in code name files of this repository (docs/design.md, docs/reference/...), never the
    team's shared folder."""
    import re

    bad = []
    for path in [*(REPO / "broker").rglob("*.py"), *(REPO / "providers").rglob("*.py"), *(REPO / "recipes").rglob("*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "/work/" in line or "shared/" in line or re.search(r"(?<![/\w])(DESIGN\.md|cloud-apis\.md|local-cluster\.md)",
                                                                 line):
                bad.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:80]}")
    assert bad == []
    for ref in ("docs/design.md", "docs/reference/cloud-apis.md", "docs/reference/local-cluster.md"):
        assert (REPO / ref).is_file()


def test_run_counts_valid_options_as_plan_does_and_says_why_plan_may_count_more(tmp_path):
    """`broker run` said "41 other valid option(s)" where `broker plan` said "50 valid" for the same CPU-only job:
    run counted the others (not this machine) and plan adds the free-tier CPU offers that a run never rents.  Run
    now counts as plan does (this machine included) and names the free-tier difference."""
    from types import SimpleNamespace

    from broker.run.planstep import local_choice_text

    plan = SimpleNamespace(valid_count=42, options=[])
    cpu = SimpleNamespace(gpus_per_node=0, cpu_ok=True, path="it.yaml", plan_flags=lambda: "")
    text = local_choice_text(plan, cpu)
    assert "cheapest of 42 valid options" in text and "free-tier CPU offers" in text and "other" not in text
    gpu = SimpleNamespace(gpus_per_node=1, cpu_ok=False, path="g.yaml", plan_flags=lambda: "")
    assert "free-tier" not in local_choice_text(plan, gpu)
    assert local_choice_text(SimpleNamespace(valid_count=1, options=[]), gpu).endswith("the only valid option")


def test_hints_name_the_recipe_path_as_typed_under_the_current_folder(tmp_path, monkeypatch):
    """The first run's hint said `broker plan --recipe /abs/.../recipes/ddp_2node.yaml` for a path typed as
    recipes/ddp_2node.yaml (the loader keeps the resolved path)."""
    from types import SimpleNamespace

    from broker.run.planstep import free_try_hint, local_choice_text

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.yaml").write_text("")
    monkeypatch.chdir(tmp_path)
    rec = SimpleNamespace(gpus_per_node=1, cpu_ok=True, interruptible="false", plan_flags=lambda: "",
                          path=(tmp_path / "recipes" / "r.yaml").resolve())
    text = local_choice_text(SimpleNamespace(valid_count=3, options=[]), rec)
    assert "`broker plan --recipe recipes/r.yaml` lists them" in text, text
    assert "`broker run recipes/r.yaml --provider local`" in free_try_hint(rec)
    outside = SimpleNamespace(**{**vars(rec), "path": Path("/elsewhere/r.yaml")})
    assert "--recipe /elsewhere/r.yaml`" in local_choice_text(SimpleNamespace(valid_count=3, options=[]), outside)
