"""A run's folder, its cluster.json, its log paths and its Slurm job ids come from a ledger row, so they are input:
crafted rows (a real SQLite ledger) and folders (owned by ``nobody``) cannot make ``broker ssh`` run a command, make
``broker logs`` print a file outside the run, make ``broker clean`` delete outside ``<home>/runs/<run id>`` (also
when a symlink is swapped in between its check and its removal), nor make ``broker down`` scancel a job whose
comment does not name the run.  Every command runs as a real subprocess."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.core.model import utcnow
from broker.core.records import Run
from tests.conftest import REPO, broker_cmd


def _cli(args, env, timeout=120):
    return subprocess.run(broker_cmd(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _nobody() -> tuple[int, int]:
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def _live_run(home: Path, run_id: str, run_dir: str, *, provider: str = "netns", kind: str = "netns_node",
              provider_id: str = "n0", log_paths: dict | None = None, status: str = "running") -> Ledger:
    lg = Ledger(home / "ledger.sqlite")
    now = utcnow()
    lg.create_run(Run(id=run_id, name="crafted", provider=provider, topology="multi_node", status=status,
                      created_at=now, deadline=now + timedelta(hours=1), run_dir=run_dir,
                      recipe={"nodes": 1}, log_paths=log_paths or {}))
    rid = lg.record_intent(run_id, provider, kind, f"broker-{run_id}-n0", usd_per_hour=0.0).id
    lg.mark_created(rid, provider_id, state="running")
    return lg


def _cluster_json(folder: Path, *, user: str = "root", host: str = "127.0.0.1", port: int = 22,
                  key: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cluster.json").write_text(json.dumps({
        "run_id": folder.name, "provider": "netns", "topology": "multi-node", "master_addr": host,
        "ssh_key_path": key,
        "nodes": [{"node_rank": 0, "host": host, "port": port, "user": user, "private_ip": host}]}))


# --------------------------------------------------------------------------------------------------- ssh
def test_ssh_refuses_a_run_folder_outside_the_home(broker_home, cli_env, tmp_path):
    """The exact case: a row with run_dir=/tmp/evilrun (owned by nobody) whose cluster.json's user is an ssh
    option ran ``id > /tmp/pwned`` as root through `broker ssh RUN -- true`."""
    uid, gid = _nobody()
    evil = Path(f"/tmp/evilrun-{uuid.uuid4().hex[:8]}")
    pwned = Path(f"/tmp/pwned-{uuid.uuid4().hex[:8]}")
    try:
        _cluster_json(evil, user=f"-oProxyCommand=sh -c 'id > {pwned}' #")
        for p in (evil, evil / "cluster.json"):
            os.chown(p, uid, gid)
        _live_run(broker_home, "20261201-000000-evil01", str(evil)).close()
        r = _cli(["ssh", "20261201-000000-evil01", "--", "true"], cli_env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "refused" in r.stderr and "20261201-000000-evil01" in r.stderr and str(evil) in r.stderr, r.stderr
        assert not pwned.exists()
    finally:
        shutil.rmtree(evil, ignore_errors=True)
        pwned.unlink(missing_ok=True)


@pytest.mark.parametrize("field,value", [
    ("user", "-oProxyCommand=sh -c 'id > {pwned}' #"),
    ("user", "root@127.0.0.1 -oProxyCommand=x"),
    ("host", "-oProxyCommand=sh -c 'id > {pwned}'"),
    ("host", "127.0.0.1 -oProxyCommand=x"),
    ("port", 0),
    ("port", 70000),
    ("key", "/etc/shadow"),
])
def test_ssh_refuses_a_cluster_json_with_unsafe_fields(field, value, broker_home, cli_env):
    """Inside the home too: cluster.json's user / host / port / key path are checked before any ssh argv."""
    run_id = "20261201-000000-bad" + str(abs(hash((field, str(value)))) % 1000).zfill(3)
    folder = broker_home / "runs" / run_id
    pwned = Path(f"/tmp/pwned-{uuid.uuid4().hex[:8]}")
    value = value.format(pwned=pwned) if isinstance(value, str) else value
    _cluster_json(folder, **{field: value})
    _live_run(broker_home, run_id, str(folder)).close()
    try:
        r = _cli(["ssh", run_id, "--", "true"], cli_env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "refused" in r.stderr and run_id in r.stderr, r.stderr
        assert not pwned.exists()
    finally:
        pwned.unlink(missing_ok=True)


def test_ssh_config_install_refuses_injected_lines(broker_home, cli_env, tmp_path):
    """The exact case: a host with newlines wrote ``ProxyCommand`` / ``Host *`` lines into broker's ssh_config."""
    run_id = "20261201-000000-inject"
    folder = broker_home / "runs" / run_id
    _cluster_json(folder, host="1.2.3.4\n  ProxyCommand sh -c 'id > /tmp/x'\nHost *\n  User root")
    _live_run(broker_home, run_id, str(folder)).close()
    env = dict(cli_env, HOME=str(tmp_path / "userhome"))
    r = _cli(["ssh", run_id, "--config", "--install"], env)
    assert r.returncode == 2, r.stdout + r.stderr
    own = broker_home / "ssh_config"
    assert not own.exists() or "ProxyCommand" not in own.read_text()
    assert not (tmp_path / "userhome" / ".ssh" / "config").exists()


def test_ssh_argv_keeps_user_and_host_out_of_option_parsing():
    from broker.cli.day2 import ssh_argv, ssh_config
    from broker.core.records import Cluster
    from broker.core.provider import BadInput

    c = Cluster.model_validate({"run_id": "r", "provider": "netns", "topology": "multi-node",
                                "master_addr": "10.0.0.1",
                                "nodes": [{"node_rank": 0, "host": "10.0.0.1", "port": 2222, "user": "ubuntu",
                                           "private_ip": "10.0.0.1"}]})
    argv = ssh_argv(c, 0, ["nvidia-smi", "-L"])
    i = argv.index("--")
    assert argv[i - 2:i] == ["-l", "ubuntu"] and argv[i + 1:] == ["10.0.0.1", "nvidia-smi", "-L"], argv
    assert "ubuntu@" not in " ".join(argv)
    bad = c.model_copy(update={"ssh_key_path": "/k\n  ProxyCommand x"})
    with pytest.raises(BadInput):
        ssh_config("r", bad)


# --------------------------------------------------------------------------------------------------- logs
def test_logs_prints_no_file_outside_the_run_folder(broker_home, cli_env, tmp_path):
    """The exact case: ``log_paths={"0": "/tmp/rootonly"}`` made `broker logs RUN` print that file."""
    secret = tmp_path / "rootonly"
    secret.write_text("ROOT-ONLY-SECRET\n")
    secret.chmod(0o600)
    run_id = "20261201-000000-logs01"
    folder = broker_home / "runs" / run_id
    folder.mkdir(parents=True)
    _live_run(broker_home, run_id, str(folder), log_paths={"0": str(secret)}, status="failed").close()
    r = _cli(["logs", run_id], cli_env)
    assert r.returncode == 2 and "ROOT-ONLY-SECRET" not in r.stdout, r.stdout + r.stderr
    assert "refused" in r.stderr and run_id in r.stderr


def test_logs_does_not_follow_a_symlink_out_of_the_run_folder(broker_home, cli_env, tmp_path):
    secret = tmp_path / "rootonly"
    secret.write_text("ROOT-ONLY-SECRET\n")
    run_id = "20261201-000000-logs02"
    folder = broker_home / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "node0.log").symlink_to(secret)
    _live_run(broker_home, run_id, str(folder), status="failed").close()
    r = _cli(["logs", run_id], cli_env)
    assert r.returncode == 2 and "ROOT-ONLY-SECRET" not in r.stdout, r.stdout + r.stderr


def test_logs_of_a_run_folder_outside_the_home_are_refused(broker_home, cli_env, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "node0.log").write_text("NOT-THIS-RUNS\n")
    _live_run(broker_home, "20261201-000000-logs03", str(other), status="failed").close()
    r = _cli(["logs", "20261201-000000-logs03"], cli_env)
    assert r.returncode == 2 and "NOT-THIS-RUNS" not in r.stdout, r.stdout + r.stderr


def test_logs_of_an_ordinary_run_still_print(broker_home, cli_env):
    run_id = "20261201-000000-logs04"
    folder = broker_home / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "node0.log").write_text("hello from rank 0\n")
    _live_run(broker_home, run_id, str(folder), log_paths={"0": str(folder / "node0.log")}, status="failed").close()
    r = _cli(["logs", run_id], cli_env)
    assert r.returncode == 0 and "hello from rank 0" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------------------------------- clean
def _ended(home: Path, run_id: str, run_dir: str) -> None:
    lg = Ledger(home / "ledger.sqlite")
    now = utcnow()
    lg.create_run(Run(id=run_id, name="old", provider="local", topology="local", status="succeeded",
                      created_at=now - timedelta(days=3), ended_at=now - timedelta(days=2), run_dir=run_dir))
    lg.close()


def test_clean_refuses_a_row_naming_another_runs_folder(broker_home, cli_env):
    keep = broker_home / "runs" / "20261201-000000-live01"
    keep.mkdir(parents=True)
    (keep / "checkpoint.pt").write_text("weights")
    lg = Ledger(broker_home / "ledger.sqlite")
    lg.create_run(Run(id="20261201-000000-live01", name="live", status="running", run_dir=str(keep), pid=1))
    lg.close()
    _ended(broker_home, "20261201-000000-crafted", str(keep))
    r = _cli(["clean", "--yes"], cli_env)
    assert (keep / "checkpoint.pt").exists(), r.stdout + r.stderr
    assert "refused" in r.stderr and "20261201-000000-crafted" in r.stderr, r.stderr


def test_clean_removes_the_checked_path_not_a_swapped_symlink(broker_home, tmp_path):
    """The race: a row's run_dir reached the home through a symlinked parent; clean checked it, then the symlink
    was pointed at a victim and the unresolved path was rmtree-d there.  Now the resolved path is removed."""
    from broker.cli import day2

    run_id = "20261201-000000-race01"
    real = broker_home / "runs" / run_id
    real.mkdir(parents=True)
    (real / "node0.log").write_text("x")
    alias = tmp_path / "alias"
    alias.symlink_to(broker_home)
    victim = tmp_path / "victim2"
    (victim / "runs" / run_id).mkdir(parents=True)
    (victim / "runs" / run_id / "victim").write_text("keep me")
    _ended(broker_home, run_id, str(alias / "runs" / run_id))
    lg = Ledger(broker_home / "ledger.sqlite")
    todo, _ = day2.clean_candidates(lg)  # what `broker clean` lists and asks about
    alias.unlink()
    alias.symlink_to(victim)  # what another user does between the check and the removal
    removed, _ = day2.remove_run_folders(lg, todo)
    assert (victim / "runs" / run_id / "victim").exists()
    assert removed == [run_id] and not real.exists()


# --------------------------------------------------------------------------------------------------- slurm down
@pytest.fixture
def fake_slurm(tmp_path):
    """squeue / scancel / sacct first on PATH, logging their arguments; the job's comment comes from COMMENT."""
    d = tmp_path / "bin"
    d.mkdir()
    log = tmp_path / "calls.log"
    bodies = {
        # the job leaves the queue once scancel ran; its comment (%k) comes from squeue.out
        "squeue": f'[ -e {d}/cancelled ] && exit 0\n'
                  f'case "$*" in *%k*) cat {d}/squeue.out ;; *) echo "RUNNING|None" ;; esac\n',
        "scancel": f"touch {d}/cancelled\n",
        "sacct": 'echo "$2|CANCELLED by 0|0:15|"\n',
        "scontrol": "exit 1\n",
    }
    for name, body in bodies.items():
        (d / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\n' + body)
        (d / name).chmod(0o755)
    return d, log


@pytest.mark.parametrize("comment,expect_cancel", [
    ("broker-run=20261201-000000-slurm1x", False),  # a run whose id merely starts with this one's
    ("broker-run=20261201", False),                 # a prefix of this run's id: Slurm never cuts the comment
    ("", False),                                   # a job without broker's tag: not ours
    ("broker-run=20261201-000000-other1", False),  # another run's job
    ("broker-run=20261201-000000-slurm1", True),   # this run's own job
])
def test_down_scancels_only_a_job_whose_comment_names_the_run(comment, expect_cancel, fake_slurm, broker_home,
                                                               cli_env):
    d, log = fake_slurm
    (d / "squeue.out").write_text(f"{comment}|RUNNING\n")
    run_id = "20261201-000000-slurm1"
    _live_run(broker_home, run_id, str(broker_home / "runs" / run_id), provider="slurm", kind="slurm_job",
              provider_id="777").close()
    env = dict(cli_env, PATH=f"{d}:{cli_env['PATH']}")
    r = _cli(["down", run_id], env)
    calls = log.read_text() if log.exists() else ""
    assert ("scancel 777" in calls) == expect_cancel, (calls, r.stdout + r.stderr)
    if not expect_cancel:
        assert "refused" in r.stdout + r.stderr, r.stdout + r.stderr
        assert "squeue -h -j 777" in calls


@pytest.mark.parametrize("job_id", ["--me", "777_1", "777 --user=root"])
def test_down_sends_nothing_for_a_job_id_that_is_not_digits(job_id, fake_slurm, broker_home, cli_env):
    """``--me`` as a job id would have made scancel cancel every job of the user."""
    d, log = fake_slurm
    run_id = "20261201-000000-slurm2"
    _live_run(broker_home, run_id, str(broker_home / "runs" / run_id), provider="slurm", kind="slurm_job",
              provider_id=job_id).close()
    env = dict(cli_env, PATH=f"{d}:{cli_env['PATH']}")
    r = _cli(["down", run_id], env)
    assert not log.exists() or "scancel" not in log.read_text(), log.read_text()
    assert "refused" in r.stdout + r.stderr, r.stdout + r.stderr


def test_down_does_not_ssh_to_a_host_a_row_names_as_an_option(fake_slurm, broker_home, cli_env, tmp_path):
    """A slurm_job row's ``attrs.host`` picks where squeue / scancel run: an ssh option there is refused."""
    d, log = fake_slurm
    (d / "ssh").write_text(f'#!/bin/bash\necho "ssh $*" >> {log}\n')
    (d / "ssh").chmod(0o755)
    run_id = "20261201-000000-slurm3"
    lg = _live_run(broker_home, run_id, str(broker_home / "runs" / run_id), provider="slurm", kind="slurm_job",
                   provider_id="777")
    rid = lg.resources(run_id)[0].id
    lg.update_resource(rid, attrs={"host": "-oProxyCommand=touch /tmp/x"})
    lg.close()
    r = _cli(["down", run_id], dict(cli_env, PATH=f"{d}:{cli_env['PATH']}"))
    calls = log.read_text() if log.exists() else ""
    assert "ssh" not in calls and "scancel" not in calls, calls
    # the row is damaged (its attrs name what broker never writes there): named, then skipped
    assert "damaged ledger row" in r.stderr and "attrs.host" in r.stderr, r.stdout + r.stderr


def test_down_signals_no_pid_named_by_a_crafted_run_folder(broker_home, cli_env, tmp_path):
    """``down`` interrupts a detached run by the pid in its folder's marker: a row whose folder is elsewhere (with a
    marker naming any live process) must not make root signal that process."""
    victim = subprocess.Popen(["sleep", "60"])
    try:
        evil = tmp_path / "evil"
        evil.mkdir()
        (evil / ".detached").write_text(json.dumps({"pid": victim.pid}))
        from broker.cli import detached as run_mod

        (evil / run_mod.DETACHED_MARKER).write_text(json.dumps({"pid": victim.pid}))
        lg = Ledger(broker_home / "ledger.sqlite")
        lg.create_run(Run(id="20261201-000000-sig001", name="x", status="running", run_dir=str(evil),
                          pid=victim.pid))
        lg.close()
        _cli(["down", "20261201-000000-sig001"], cli_env)
        assert victim.poll() is None, "the process named by the crafted folder was signalled"
    finally:
        victim.kill()
        victim.wait()
