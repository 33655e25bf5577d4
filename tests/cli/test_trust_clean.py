"""`broker clean` deletes only inside `<home>/runs/`, lists what it will delete and asks first; afterwards `logs`
and `ssh` say the folder was removed by clean.  Crafted ledgers are real SQLite files; the prompt is answered on a
real pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.core.records import Run
from tests.conftest import REPO, broker_cmd


def _cli(args, env, cwd=REPO):
    return subprocess.run(broker_cmd(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def _ended_run(home: Path, run_id: str, run_dir: Path | str, *, files: dict[str, str] | None = None) -> None:
    lg = Ledger(home / "ledger.sqlite")
    now = utcnow()
    lg.create_run(Run(id=run_id, name="old", provider="local", topology="local", status="succeeded",
                      created_at=now - timedelta(days=3), ended_at=now - timedelta(days=2), run_dir=str(run_dir)))
    d = Path(run_dir)
    if files is not None:
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text)
    lg.close()


@pytest.fixture
def victim(tmp_path):
    """A folder outside the broker home that must survive every crafted row."""
    v = tmp_path / "victim"
    v.mkdir()
    (v / "precious.txt").write_text("keep me\n")
    return v


def _runs(home: Path) -> Path:
    r = home / "runs"
    r.mkdir(exist_ok=True)
    return r


@pytest.mark.parametrize("case", ["outside", "dotdot", "symlink", "runs-itself", "relative"])
def test_crafted_run_dir_is_refused_and_named(case, broker_home, cli_env, victim):
    runs = _runs(broker_home)
    run_dir = {"outside": str(victim),
               "dotdot": f"{runs}/{os.path.relpath(victim, runs)}",
               "symlink": str(runs / "20261101-000000-link00"),
               "runs-itself": str(runs),
               "relative": "victim"}[case]
    if case == "symlink":
        os.symlink(victim, run_dir)
    _ended_run(broker_home, "20261101-000000-evil00", run_dir)
    _ended_run(broker_home, "20261101-000000-good00", runs / "20261101-000000-good00",
                      files={"node0.log": "ok\n"})
    r = _cli(["clean", "--yes"], cli_env, cwd=victim.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (victim / "precious.txt").read_text() == "keep me\n"
    assert "refused" in r.stderr and "20261101-000000-evil00" in r.stderr, r.stderr
    assert not (runs / "20261101-000000-good00").exists()  # the honest row is cleaned
    assert runs.is_dir()
    if case == "symlink":
        assert Path(run_dir).is_symlink()


def test_clean_lists_and_refuses_without_a_terminal_or_yes(broker_home, cli_env):
    runs = _runs(broker_home)
    for i in range(2):
        _ended_run(broker_home, f"20261101-00000{i}-old00{i}", runs / f"20261101-00000{i}-old00{i}",
                   files={"node0.log": "x" * 200_000, "ckpt.pt": "y" * 1_000_000})
    r = _cli(["clean"], cli_env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--yes" in r.stderr and "2 run folder(s)" in r.stdout + r.stderr
    assert "20261101-000000-old000" in r.stdout and "MB" in r.stdout  # listed with sizes
    assert all((runs / f"20261101-00000{i}-old00{i}" / "ckpt.pt").exists() for i in range(2))
    dry = _cli(["clean", "--dry-run"], cli_env)
    assert dry.returncode == 0 and "would remove 2 run folder(s)" in dry.stdout
    assert all((runs / f"20261101-00000{i}-old00{i}").exists() for i in range(2))


def _on_pty(args, env, answer: str) -> tuple[int, str]:
    """Run the CLI with its stdin/stdout on a pseudo-terminal; type ``answer`` once it asks."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(broker_cmd(*args), cwd=REPO, env=dict(env, COLUMNS="200"), stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True)
    os.close(slave)
    out, sent, end = b"", False, time.monotonic() + 60
    try:
        while time.monotonic() < end:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            if not sent and b"[y/N]" in out:
                os.write(master, answer.encode() + b"\n")
                sent = True
            if proc.poll() is not None and not r:
                break
        return proc.wait(timeout=30), out.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def test_clean_asks_on_a_terminal(broker_home, cli_env):
    runs = _runs(broker_home)
    d = runs / "20261101-000000-ask000"
    _ended_run(broker_home, d.name, d, files={"node0.log": "x\n"})
    rc, out = _on_pty(["clean"], cli_env, "n")
    assert rc == 1 and d.exists() and "remove these 1 run folder(s)" in out, out
    rc, out = _on_pty(["clean"], cli_env, "y")
    assert rc == 0 and not d.exists() and "removed 1 run folder(s)" in out, out


def test_logs_and_ssh_after_clean_say_clean_removed_the_folder(broker_home, cli_env):
    runs = _runs(broker_home)
    d = runs / "20261101-000000-gone00"
    _ended_run(broker_home, d.name, d, files={"node0.log": "hello\n", "cluster.json": "{}"})
    assert _cli(["logs", d.name], cli_env).stdout == "hello\n"
    assert _cli(["clean", "--yes"], cli_env).returncode == 0
    logs = _cli(["logs", d.name], cli_env)
    assert logs.returncode == 2 and "removed by `broker clean`" in logs.stderr, logs.stderr
    assert "may have ended before the node started" not in logs.stderr
    ssh = _cli(["ssh", d.name], cli_env)
    assert ssh.returncode == 2 and "removed by `broker clean`" in ssh.stderr, ssh.stderr
