"""The crash log goes only to this user's own 0700 folders, created 0600 without following a planted name (another
user, ``nobody`` here, plants symlinks and folders); a ledger row that does not validate (a real SQLite file
edited by hand) is reported as a damaged row and skipped, never an internal crash of status / down / logs."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.core.records import Run
from tests.conftest import REPO, broker_cmd


def _nobody() -> tuple[int, int]:
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def _crash(monkeypatch, home: Path) -> Path | None:
    from broker.cli.app import crash_log

    monkeypatch.setenv("BROKER_HOME", str(home))
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        return crash_log(e)


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A world-writable sticky folder standing in for /tmp (TMPDIR and broker's short base both point there)."""
    from broker.core import private
    t = tmp_path / "tmp"
    t.mkdir()
    t.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(t))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(private, "SHORT_BASE", t)
    return t


@pytest.fixture
def unwritable_home(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    return f  # a file: the home's logs folder cannot be made


def _victim(tmp_path: Path) -> Path:
    uid, gid = _nobody()
    v = tmp_path / "nobodys"
    v.mkdir()
    v.chmod(0o777)
    os.chown(v, uid, gid)
    return v


def test_crash_log_does_not_follow_a_planted_temp_folder(shared_tmp, unwritable_home, tmp_path, monkeypatch):
    """The exact case: the fallback ``/tmp/broker-logs`` was a symlink planted by another user."""
    victim = _victim(tmp_path)
    link = shared_tmp / "broker-logs"
    link.symlink_to(victim)
    os.lchown(link, *_nobody())
    log = _crash(monkeypatch, unwritable_home)
    assert list(victim.iterdir()) == []
    assert log is not None and log.parent == shared_tmp / f"broker-{os.geteuid()}" / "logs"
    assert log.stat().st_mode & 0o777 == 0o600 and log.parent.stat().st_mode & 0o777 == 0o700
    assert log.parent.parent.stat().st_uid == os.geteuid()


def test_crash_log_refuses_a_per_user_folder_another_user_made(shared_tmp, unwritable_home, tmp_path,
                                                               monkeypatch):
    planted = shared_tmp / f"broker-{os.geteuid()}"
    planted.mkdir()
    (planted / "logs").mkdir()
    for p in (planted, planted / "logs"):
        p.chmod(0o777)
        os.chown(p, *_nobody())
    log = _crash(monkeypatch, unwritable_home)
    assert log is None  # nowhere safe to write: no log rather than one another user can read or redirect
    assert list((planted / "logs").iterdir()) == []


def test_crash_log_never_opens_a_planted_name(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True, mode=0o700)
    target = tmp_path / "target"
    target.write_text("untouched\n")
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20261201-000000")
    planted = home / "logs" / f"crash-20261201-000000-{os.getpid()}.log"
    planted.symlink_to(target)
    log = _crash(monkeypatch, home)
    assert target.read_text() == "untouched\n"
    assert log is not None and log != planted and log.parent == home / "logs" and not log.is_symlink()
    assert "RuntimeError: boom" in log.read_text() and log.stat().st_mode & 0o777 == 0o600


# --------------------------------------------------------------------------------------------------- damaged rows
def _cli(args, env):
    return subprocess.run(broker_cmd(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def damaged(broker_home):
    lg = Ledger(broker_home / "ledger.sqlite")
    lg.create_run(Run(id="20261201-000000-ended0", name="x", status="succeeded"))
    lg.create_run(Run(id="20261201-000000-codes0", name="y", provider="fake", status="running", pid=1))
    rid = lg.record_intent("20261201-000000-codes0", "fake", "instance", "n0", usd_per_hour=1.0).id
    lg._db.execute("UPDATE runs SET ended_at = '' WHERE id = '20261201-000000-ended0'")
    lg._db.execute("UPDATE runs SET exit_codes = NULL WHERE id = '20261201-000000-codes0'")
    lg._db.execute("UPDATE runs SET recipe = '{not json' WHERE id = '20261201-000000-ended0'")
    lg.close()
    return rid


@pytest.mark.parametrize("args,code", [
    (["status"], 0),
    (["status", "--json"], 0),
    (["status", "20261201-000000-ended0"], 2),
    (["logs", "20261201-000000-ended0"], 2),
    (["down", "20261201-000000-codes0"], 0),
])
def test_a_damaged_row_is_reported_not_a_crash(args, code, damaged, cli_env):
    r = _cli(args, cli_env)
    assert r.returncode == code, r.stdout + r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr and "ValidationError" not in r.stderr
    assert "damaged ledger row" in r.stderr, r.stderr
    if "ended0" in " ".join(args):
        assert "20261201-000000-ended0" in r.stderr and ("ended_at" in r.stderr or "recipe" in r.stderr)
    if args[0] == "down":
        assert "exit_codes" in r.stderr and "terminated" in r.stdout  # its resources are still ended
    if args[-1] == "--json":
        json.loads(r.stdout)
