"""checkpoint_dir on Slurm: copied back from the job folder (rank 0 writes it; every node shares it) every
checkpoint_every_s and at the end, with the one incremental, atomic copy-back of broker/run/checkpoint.py, here and
through an ssh login node; a stale checkpoint in the work folder is not staged; ``interruptible: true`` with a
Slurm target is refused naming the file, the field and the fix (broker does not resubmit Slurm jobs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, broker_cmd
from tests.slurm.test_slurm_run import FAKE_SSH, broker_run, ledger_rows
from tests.support.slurm_cluster import cluster_fixture

STEPS = 8

# rank 0 saves after every step (tmp + rename); every rank resumes from the checkpoint when there is one
JOB = f"""
import json, os, pathlib, time
ck = pathlib.Path("ckpt")
state = ck / "state.json"
start = json.loads(state.read_text())["step"] if state.exists() else 0
print("resumed from step", start, flush=True)
for step in range(start, {STEPS}):
    time.sleep(0.6)
    if os.environ.get("RANK") == "0":
        ck.mkdir(exist_ok=True)
        tmp = ck / "state.json.tmp"; tmp.write_text(json.dumps({{"step": step + 1}})); os.replace(tmp, state)
        if step == 0:
            (ck / "w.bin").write_bytes(b"w" * 1000)
print("finished", flush=True)
"""


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_fixture()


def _recipe(tmp_path: Path, extra: str = "") -> Path:
    d = tmp_path / "w"
    (d / "ckpt").mkdir(parents=True)
    (d / "ckpt" / "state.json").write_text(json.dumps({"step": 100}))  # left by an earlier run: not staged
    (d / "job.py").write_text(JOB)
    p = tmp_path / "ck.yaml"
    p.write_text(f"name: ck\nscript: {d}/job.py\nworkdir: {d}\nnodes: 2\ngpus_per_node: 1\ncpu_ok: true\n"
                 "max_hours: 0.05\nstall_s: 0\ncheckpoint_dir: ckpt\ncheckpoint_every_s: 1\n" + extra)
    return p


def _check_copied_back(tmp_path: Path, out: str) -> Path:
    run, _ = ledger_rows(tmp_path)
    assert run.status == "succeeded", out
    for i in (0, 1):  # the stale checkpoint was not staged: both nodes started from step 0
        assert "resumed from step 0" in Path(run.run_dir, f"node{i}.log").read_text(), out
    root = Path(run.run_dir) / "checkpoints"
    latest = (root / "LATEST").read_text().strip()
    assert re.fullmatch(r"gen-\d{6}", latest)
    assert int(latest[4:]) >= 2, latest  # copies while the job ran, then the last one at the end
    gen = root / latest
    assert json.loads((gen / "state.json").read_text()) == {"step": STEPS}  # the end copy has the last step
    assert (gen / "w.bin").read_bytes() == b"w" * 1000
    assert not (gen / "state.json.tmp").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    assert "checkpoint_dir ckpt/ not staged" in out and "checkpoint ckpt copied back" in out, out
    assert json.loads((tmp_path / "w" / "ckpt" / "state.json").read_text()) == {"step": 100}  # the user's, untouched
    return gen


@pytest.mark.slurm
@pytest.mark.slow
def test_checkpoint_dir_is_copied_back_from_a_slurm_job(cluster, tmp_path):
    cp = broker_run(cluster, tmp_path, _recipe(tmp_path))
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, f"{out}\n{cluster.logs()}"
    _check_copied_back(tmp_path, out)


@pytest.mark.slurm
@pytest.mark.slow
def test_checkpoint_dir_is_copied_back_through_the_login_node(cluster, tmp_path):
    """--slurm-host: listed and read through `ssh <host>` (python3 lists, realpath confines, head caps)."""
    bin_dir, home = tmp_path / "bin", tmp_path / "login-home"
    bin_dir.mkdir()
    home.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SSH_LOG": str(tmp_path / "ssh.log"),
           "FAKE_SSH_HOME": str(home)}
    cp = broker_run(cluster, tmp_path, _recipe(tmp_path), "--slurm-host", "alice@login1", env_extra=env)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, f"{out}\n{cluster.logs()}"
    assert "on alice@login1 (ssh)" in out
    _check_copied_back(tmp_path, out)
    assert any("python3 -c" in c or c.split()[1] == "sh" for c in (tmp_path / "ssh.log").read_text().splitlines())


def test_the_login_node_source_refuses_a_link_out_and_keeps_the_last_good_copy(tmp_path, monkeypatch):
    """The ssh path's Source on its own (the fake ssh runs the command here, as sshd would there)."""
    from broker.providers.slurm import Shell
    from broker.run.checkpoint import copy_back, latest_generation
    from broker.slurm.executor import SlurmExecutor

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    monkeypatch.setenv("FAKE_SSH_HOME", str(tmp_path))
    work = tmp_path / "job" / "work"
    (work / "ckpt").mkdir(parents=True)
    ex = SimpleNamespace(work=str(work), sh=Shell("alice@login1"), opts=SimpleNamespace(host="alice@login1"))
    ex.fetch_remote = lambda *a: SlurmExecutor.fetch_remote(ex, *a)
    src = SlurmExecutor.checkpoint_source(ex, "ckpt")
    run = tmp_path / "run"
    assert copy_back(src, run) == (None, 0)  # nothing saved yet: no generation
    (work / "ckpt" / "a.pt").write_bytes(b"a" * 10)
    gen, got = copy_back(src, run)
    assert gen.name == "gen-000001" and got == 10 and (gen / "a.pt").read_bytes() == b"a" * 10
    (tmp_path / "secret").write_text("s")
    (work / "ckpt" / "leak.pt").symlink_to(tmp_path / "secret")
    refused: list[str] = []  # a link out is refused by name, never followed; the rest is still copied
    copy_back(src, run, refused=refused)
    assert any("leak.pt" in r and "outside" in r for r in refused), refused
    last = latest_generation(run)
    assert not (last / "leak.pt").exists() and (last / "a.pt").read_bytes() == b"a" * 10
    assert any(line.startswith("alice@login1 ") for line in (tmp_path / "ssh.log").read_text().splitlines())


def _run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(broker_cmd(*args), cwd=REPO, env={**env, "COLUMNS": "200"}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def test_interruptible_true_on_slurm_names_the_file_the_field_and_the_fix(tmp_path, cli_env):
    path = _recipe(tmp_path, "interruptible: true\n")
    p = _run(cli_env, "run", str(path), "--provider", "slurm")
    text = " ".join(p.stderr.split())
    assert p.returncode == 2, text
    assert f"{path}:11: field 'interruptible': true asks for interruptible capacity" in text, text
    assert "broker does not resubmit a Slurm job" in text and "set interruptible: false (or auto)" in text
    assert not (Path(cli_env["BROKER_HOME"]) / "runs").exists() or not list((Path(cli_env["BROKER_HOME"]) /
                                                                             "runs").iterdir())
    p = _run(cli_env, "run", str(_recipe(tmp_path / "b")), "--provider", "slurm", "--interruptible", "true")
    text = " ".join(p.stderr.split())
    assert p.returncode == 2 and "--interruptible true asks for interruptible capacity" in text, text
    assert "pass --interruptible false (or auto)" in text


def test_a_slurm_target_runs_an_auto_recipe_once(tmp_path):
    """interruptible: auto on Slurm: no interruptible capacity there, so no restarts: one attempt, no attempt rows."""
    from broker.core.recipe import load_recipe
    from broker.run.attempts import run_attempts
    from broker.slurm.executor import SlurmOptions
    from broker.slurm.target import SlurmTarget

    recipe = load_recipe(_recipe(tmp_path, "interruptible: auto\n"))
    target = SlurmTarget(recipe, SlurmOptions())
    assert target.restarts is False
    calls: list[int] = []
    result = SimpleNamespace(ok=True)
    out = run_attempts(recipe, target, SimpleNamespace(id="r"), SimpleNamespace(ledger=None),
                       lambda: calls.append(1) or (None, result), lambda: [])
    assert out == (None, result) and calls == [1]
