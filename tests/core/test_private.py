"""Private by default, at the real boundary: file modes under umask 022 (in a subprocess), a second unprivileged
user (``nobody``) planting a socket at the old shared ControlPath and a symlink at a lock path, node files created
with their SFTP mode (an asyncssh SFTP server on loopback that records every call), an old ledger row's secrets."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, broker_cmd

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user (nobody)")


def mode(p: Path | str) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _child(code: str, env: dict[str, str], umask: int = 0o022) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python under ``umask`` (this checkout first on the path)."""
    env = {**env, "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", f"import os; os.umask({umask:#o})\n" + textwrap.dedent(code)],
                          env=env, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------------------------------- modes
def test_home_ledger_run_folder_and_keys_are_private_under_umask_022(tmp_path, broker_home):
    """A fresh home under umask 022: home and runs 0700, ledger (+wal, +shm) 0600, run folder 0700 with recipe.json
    and plan.json 0600, the run's SSH key folder 0700 with both keys 0600 -- and no chmod call on the way (every
    file created with its final mode)."""
    home = tmp_path / "fresh-home"
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "train.py").write_text("print('x')\n")
    (tmp_path / "r.yaml").write_text("name: t\nscript: w/train.py\nnodes: 2\ngpus_per_node: 0\ncpu_ok: true\n")
    p = _child(f"""
        import json
        def no_chmod(*a, **k):
            raise AssertionError(f"chmod called: {{a}}")
        os.chmod = os.fchmod = no_chmod
        from broker.money.ledger import Ledger
        from broker.core.recipe import load_recipe
        from broker.run.runrecord import new_run
        from broker.core import sshkeys
        led = Ledger()
        run = new_run(led, load_recipe({str(tmp_path / 'r.yaml')!r}), provider="local", topology="local",
                      plan={{"x": 1}})
        sshkeys.generate(run.run_dir)
        print(json.dumps(run.run_dir))
    """, {**os.environ, "BROKER_HOME": str(home)})
    assert p.returncode == 0, p.stderr
    run_dir = Path(json.loads(p.stdout.strip().splitlines()[-1]))
    assert mode(home) == 0o700 and mode(home / "runs") == 0o700 and mode(run_dir) == 0o700
    for f in ("ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"):
        if (home / f).exists() or f == "ledger.sqlite":
            assert mode(home / f) == 0o600, f
    assert mode(run_dir / "recipe.json") == 0o600 and mode(run_dir / "plan.json") == 0o600
    assert mode(run_dir / "ssh") == 0o700
    assert mode(run_dir / "ssh" / "id_ed25519") == 0o600 and mode(run_dir / "ssh" / "id_ed25519.pub") == 0o600


def test_an_older_home_is_narrowed_and_an_unrelated_folder_is_not(tmp_path):
    """A home an older broker made 0755 with a 0644 ledger is narrowed on first use; BROKER_HOME pointing at a
    folder that holds no ledger keeps its mode (broker never chmods a folder that is not its own)."""
    old = tmp_path / "old-home"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    (old / "ledger.sqlite").touch()
    os.chmod(old / "ledger.sqlite", 0o644)
    other = tmp_path / "project"
    other.mkdir()
    os.chmod(other, 0o755)
    code = "from broker.money.ledger import Ledger; Ledger().close()"
    assert _child(code, {**os.environ, "BROKER_HOME": str(old)}).returncode == 0
    assert mode(old) == 0o700 and mode(old / "ledger.sqlite") == 0o600
    assert _child(code, {**os.environ, "BROKER_HOME": str(other)}).returncode == 0
    assert mode(other) == 0o755 and mode(other / "ledger.sqlite") == 0o600


def test_write_private_never_follows_a_symlink_and_narrows_before_writing(tmp_path):
    from broker.core.private import write_private

    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(OSError):
        write_private(tmp_path / "link", "secret")
    assert victim.read_text() == "keep"
    wide = tmp_path / "wide"
    wide.write_text("old")
    os.chmod(wide, 0o644)
    write_private(wide, "secret")
    assert mode(wide) == 0o600 and wide.read_text() == "secret"


# --------------------------------------------------------------------------------------------------- node files
def _sftp_server(root: Path, calls: list):
    import asyncssh

    class Recording(asyncssh.SFTPServer):
        def __init__(self, chan):
            super().__init__(chan, chroot=str(root).encode())

        def open(self, path, pflags, attrs):
            calls.append(("open", path.decode(), attrs.permissions))
            return super().open(path, pflags, attrs)

        def setstat(self, path, attrs):
            calls.append(("setstat", path.decode(), attrs.permissions))
            return super().setstat(path, attrs)

        def fsetstat(self, file_obj, attrs):
            calls.append(("fsetstat", None, attrs.permissions))
            return super().fsetstat(file_obj, attrs)

    class NoAuth(asyncssh.SSHServer):
        def begin_auth(self, username):
            return False  # loopback test server: no authentication

    return Recording, NoAuth


def test_node_secret_files_are_created_with_their_mode_over_sftp(tmp_path):
    """``env.sh`` (0600) goes to the node as an SFTP open whose attributes carry 0600: the file never exists with
    another mode and no chmod (setstat) follows the write; a 0644 file already there is replaced, not reused."""
    import asyncssh

    from broker.core.model import TopologyKind
    from broker.core.records import Cluster, ClusterNode
    from broker.run.sshcluster import SSHCluster

    root = tmp_path / "node-fs"
    (root / "w").mkdir(parents=True)
    calls: list = []
    Recording, NoAuth = _sftp_server(root, calls)
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    cl = Cluster(run_id="r1", provider="aws", topology=TopologyKind.multi_node, workroot="/w",
                 nodes=[ClusterNode(node_rank=0, host="127.0.0.1", port=1, private_ip="127.0.0.1")])
    ssh = SSHCluster(cl, run_dir=tmp_path / "run")
    try:
        async def start():
            return await asyncssh.listen("127.0.0.1", 0, server_host_keys=[host_key], server_factory=NoAuth,
                                         sftp_factory=Recording)

        server = ssh.loop.call(start(), timeout=30)
        cl.nodes[0].port = server.sockets[0].getsockname()[1]
        (root / "w" / "old.sh").write_text("stale")
        os.chmod(root / "w" / "old.sh", 0o644)
        old = os.umask(0o022)
        try:
            ssh.loop.call(ssh.aput_bytes(0, b"export TOKEN=x\n", "/w/env.sh", 0o600), timeout=30)
            ssh.loop.call(ssh.aput_bytes(0, b"export TOKEN=y\n", "/w/old.sh", 0o600), timeout=30)
        finally:
            os.umask(old)
        server.close()
    finally:
        ssh.close()
        ssh.loop.close()
    assert mode(root / "w" / "env.sh") == 0o600 and mode(root / "w" / "old.sh") == 0o600
    assert (root / "w" / "old.sh").read_text() == "export TOKEN=y\n"
    opens = [c for c in calls if c[0] == "open"]
    assert [(p, m) for _, p, m in opens] == [("/w/env.sh", 0o600), ("/w/old.sh", 0o600)]
    assert not [c for c in calls if c[0] in ("setstat", "fsetstat")], calls


# --------------------------------------------------------------------------------------------------- runtime
def _as_nobody(code: str, timeout: float = 60) -> subprocess.Popen:
    """``code`` run by a Python as user ``nobody`` (setuid in the child; the system's Python: nobody may not
    enter this checkout's venv), stdout piped."""
    import shutil

    py = next((p for p in ("/usr/bin/python3", shutil.which("python3")) if p and os.access(p, os.X_OK)), None)
    if py is None:
        pytest.skip("no system python3 for the second user")
    return subprocess.Popen([py, "-c", textwrap.dedent(code)], user="nobody", group="nogroup",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/tmp",
                            env={"PATH": os.environ["PATH"]})


@contextlib.contextmanager
def _shared_tmp():
    """A sticky world-writable folder directly under /tmp (as /tmp itself: nobody can reach it, pytest's own
    temporary folders are 0700), removed afterwards."""
    import shutil

    d = Path(tempfile.mkdtemp(prefix="broker-test-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _expanded_control_path(template: str, dest: str) -> str:
    out = subprocess.run(["ssh", "-G", "-o", f"ControlPath={template}", dest], capture_output=True, text=True,
                         timeout=30).stdout
    return next(line.split(None, 1)[1] for line in out.splitlines() if line.startswith("controlpath "))


@ROOT_ONLY
def test_a_socket_planted_at_the_old_controlpath_never_hears_from_broker(tmp_path):
    """Another user binds ``/tmp/broker-ssh-%C`` first (what the shared ControlPath was): broker's ssh to the
    Slurm login host must not connect to it (it would send that user our commands and the batch script)."""
    from broker.core.provider import ProviderError
    from broker.providers.slurm import Shell

    dest = f"u{uuid.uuid4().hex[:10]}@127.0.0.1"
    planted = _expanded_control_path("/tmp/broker-ssh-%C", dest)
    assert planted.startswith("/tmp/broker-ssh-")
    listener = _as_nobody(f"""
        import socket, sys
        s = socket.socket(socket.AF_UNIX)
        s.bind({planted!r})
        s.listen(4)
        s.settimeout(25)
        print("READY", flush=True)
        try:
            c, _ = s.accept()
            print("CONNECTED", flush=True)
        except socket.timeout:
            print("NONE", flush=True)
    """)
    try:
        assert listener.stdout.readline().strip() == "READY", listener.stderr.read()
        assert os.stat(planted).st_uid != os.geteuid()
        sh = Shell(dest)
        try:
            sh.run(["sinfo"], timeout=20)  # no sshd answers as this user: ssh fails, what matters is where it went
        except ProviderError:
            pass
        listener.send_signal(15)
        out, _ = listener.communicate(timeout=30)
        assert "CONNECTED" not in out, "broker's ssh connected to the socket another user planted"
        cp = next(a.split("=", 1)[1] for a in sh.argv(["sinfo"]) if a.startswith("ControlPath="))
        assert not cp.startswith("/tmp/broker-ssh-")
        folder = Path(cp).parent
        assert os.stat(folder).st_uid == os.geteuid() and mode(folder) == 0o700
        assert len(_expanded_control_path(cp, dest)) + 17 <= 107  # ssh binds <path>.<16 chars> first
    finally:
        if listener.poll() is None:
            listener.kill()
        listener.wait(timeout=10)
        Path(planted).unlink(missing_ok=True)


def test_slurm_cluster_controlpath_is_in_a_private_folder(tmp_path):
    from broker.slurm.cluster import ssh_argv

    class N:
        host, port, user = "198.18.0.10", 22, "root"

    class S:
        cluster_id, nodes, ssh_key_path, known_hosts_path = "bsc1a2b3c", [N()], None, None

    argv = ssh_argv(S())
    cp = next(a.split("=", 1)[1] for a in argv if a.startswith("ControlPath="))
    assert not cp.startswith("/tmp/broker-slurm") and cp.endswith("slurm-1a2b3c-%C")
    assert mode(Path(cp).parent) == 0o700 and os.stat(Path(cp).parent).st_uid == os.geteuid()


@ROOT_ONLY
def test_a_runtime_folder_another_user_made_is_refused(tmp_path, monkeypatch):
    """The short /tmp fallback (used when the home's path is too long for a socket) made first by another user,
    and a symlink or a 0755 folder in the home, are refused with the folder and the fix -- never used."""
    from broker.core import private
    from broker.core.errors import BadInput
    from broker.core.private import check_private_dir, runtime_dir

    long_home = tmp_path / ("h" * 80)
    monkeypatch.setenv("BROKER_HOME", str(long_home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "no-such-runtime"))
    with _shared_tmp() as shared:
        monkeypatch.setattr(private, "SHORT_BASE", shared)  # stands in for /tmp (the same sticky 1777 folder)
        fallback = shared / f"broker-{os.geteuid()}"
        planter = _as_nobody(f"import os; os.mkdir({str(fallback)!r}, 0o777); os.chmod({str(fallback)!r}, 0o777)")
        planter.wait(timeout=30)
        assert os.stat(fallback).st_uid != os.geteuid()
        with pytest.raises(BadInput) as e:
            runtime_dir(socket_room=60)
        assert str(fallback) in str(e.value) and "rm -r" in e.value.hint
        assert mode(fallback) == 0o777  # refused, not "fixed" and used
    wide = tmp_path / "wide"
    wide.mkdir()
    os.chmod(wide, 0o755)
    with pytest.raises(BadInput, match="0755"):
        check_private_dir(wide)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadInput, match="symbolic link"):
        check_private_dir(tmp_path / "link")


@ROOT_ONLY
def test_root_never_follows_a_symlink_planted_at_a_lock_path(tmp_path):
    """``nobody`` plants a symlink at a lock path (as at the old /tmp/broker-netns.lock): root's lock open refuses it
    (O_NOFOLLOW) and the file it points to is neither created nor truncated; the netns lock itself lives in root's
    own /run/broker (0700), not in /tmp."""
    from broker.core.private import open_lock
    from broker.providers import netns

    with _shared_tmp() as shared:
        victim = shared / "victim"  # root's file that a followed link would truncate
        victim.write_text("root's data")
        lock = shared / "broker-netns.lock"
        planter = _as_nobody(f"import os; os.symlink({str(victim)!r}, {str(lock)!r})")
        planter.wait(timeout=30)
        assert os.lstat(lock).st_uid != 0 and lock.is_symlink()
        with pytest.raises(OSError):
            open_lock(lock)
        assert victim.read_text() == "root's data"
    path = netns.lock_path()
    assert not str(path).startswith("/tmp/")
    assert mode(path.parent) == 0o700 and os.stat(path.parent).st_uid == 0
    with netns._subnet_lock() as f:
        assert mode(path) == 0o600 and os.fstat(f.fileno()).st_uid == 0


# --------------------------------------------------------------------------------------------------- secrets
def test_a_missing_secret_is_an_error_before_anything_is_rented(tmp_path, cli_env, broker_home):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "train.py").write_text("print('x')\n")
    r = tmp_path / "r.yaml"
    r.write_text("name: t\nscript: w/train.py\nnodes: 2\ngpus_per_node: 0\ncpu_ok: true\n"
                 "secrets:\n  - WANDB_API_KEY\n  - BROKER_TEST_MISSING_SECRET\n")
    env = {**cli_env, "WANDB_API_KEY": "present-value-123"}
    env.pop("BROKER_TEST_MISSING_SECRET", None)
    p = subprocess.run(broker_cmd("run", str(r), "--provider", "local"), cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    flat = " ".join(p.stderr.split())
    assert f"{r}:8" in flat and "BROKER_TEST_MISSING_SECRET is not set" in flat
    assert "export BROKER_TEST_MISSING_SECRET=" in flat and "present-value-123" not in p.stdout + p.stderr
    assert not (broker_home / "runs").exists() or not list((broker_home / "runs").iterdir())


def test_secret_names_are_validated():
    from broker.core.recipe import Recipe

    with pytest.raises(Exception, match="not a valid environment variable name"):
        Recipe.model_validate(dict(name="t", script="t.py", secrets=["abc=def"]))
    with pytest.raises(Exception, match="both 'env' and 'secrets'"):
        Recipe.model_validate(dict(name="t", script="t.py", env={"HF_TOKEN": "x"}, secrets=["HF_TOKEN"]))


def test_an_old_ledger_row_with_a_clear_env_secret_is_masked_in_status_json(cli_env, broker_home):
    """A run row written by an older broker holds ``AWS_SECRET_ACCESS_KEY`` in clear: ``broker status RUN
    --json`` shows it masked (the record masks whatever wrote the row)."""
    from broker.money.ledger import Ledger
    from broker.core.records import Run

    sentinel = "old-row-sentinel-" + uuid.uuid4().hex
    with Ledger() as led:
        led.create_run(Run(id="20260101-000000-abcdef", name="t", status="succeeded"))
    db = sqlite3.connect(broker_home / "ledger.sqlite")
    db.execute("UPDATE runs SET recipe = ? WHERE id = ?",
               (json.dumps({"name": "t", "env": {"AWS_SECRET_ACCESS_KEY": sentinel, "PLAIN": "p"}}),
                "20260101-000000-abcdef"))
    db.commit()
    db.close()
    p = subprocess.run(broker_cmd("status", "20260101-000000-abcdef", "--json"), env=cli_env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert sentinel not in p.stdout and "PLAIN" in p.stdout and '"p"' in p.stdout


def test_credential_files_are_not_staged_and_named_as_skipped(tmp_path):
    from broker.run.executor import staging_line
    from broker.run.staging import stage_plan

    w = tmp_path / "w"
    w.mkdir()
    names = ["credentials.json", "credentials-prod.json", "token.json", "token_drive.json", "wg0.conf",
             "home.wg.conf", ".netrc", "id_rsa", "id_ed25519.pub", "server.pem", "tls.key"]
    for n in names + ["train.py", "id_utils.py", "config.json"]:
        (w / n).write_text("x")
    plan = stage_plan(w)
    assert sorted(str(f) for f in plan.files) == ["config.json", "id_utils.py", "train.py"]
    run = tmp_path / "run"
    run.mkdir()
    staging_line(plan, run)
    listed = (run / "staged.txt").read_text()
    skipped = listed.split("# not copied", 1)[1]
    assert all(n in skipped for n in names)


def test_local_jobs_do_not_inherit_brokers_cloud_credentials():
    from broker.run.launch import node_environment

    base = {"PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0",
            "NCCL_DEBUG": "INFO", "VAST_API_KEY": "v", "AWS_SECRET_ACCESS_KEY": "a", "AWS_ACCESS_KEY_ID": "i",
            "OCI_CLI_KEY_FILE": "o", "TS_AUTHKEY": "t", "GOOGLE_APPLICATION_CREDENTIALS": "g",
            "BROKER_HOME": "/h"}
    env = node_environment(base, {"MY_SECRET": "s"})
    assert {"PATH", "HOME", "LANG", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "MY_SECRET"} <= set(env)
    assert not {"VAST_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "OCI_CLI_KEY_FILE", "TS_AUTHKEY",
                "GOOGLE_APPLICATION_CREDENTIALS"} & set(env)
    # a recipe that names one (secrets: [AWS_SECRET_ACCESS_KEY]) passes it on
    assert node_environment(base, {"AWS_SECRET_ACCESS_KEY": "a"})["AWS_SECRET_ACCESS_KEY"] == "a"


# --------------------------------------------------------------------------------------------------- e2e
TRAIN = '''
import hashlib, os, sys, time
import torch.distributed as dist

ready, go, want_secret, want_env = sys.argv[1:5]
dist.init_process_group("gloo")
rank = dist.get_rank()
h = lambda name: hashlib.sha256(os.environ.get(name, "").encode()).hexdigest()
print(f"rank={rank} SECRET_{'OK' if h('BROKER_TEST_SECRET') == want_secret else 'WRONG'} "
      f"ENV_{'OK' if h('WANDB_API_KEY') == want_env else 'WRONG'} "
      f"CLOUD_{'LEAKED' if 'VAST_API_KEY' in os.environ or 'AWS_SECRET_ACCESS_KEY' in os.environ else 'ABSENT'}",
      flush=True)
if rank == 0:
    open(ready, "w").close()
    end = time.monotonic() + 90
    while not os.path.exists(go) and time.monotonic() < end:
        time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
'''


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, port) of every listening TCP socket (v4 and v6) that a process in ``pids`` holds."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    t = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if t.startswith("socket:["):
                    inodes.add(t[8:-1])
        except OSError:
            continue
    out = []
    for table, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A = LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # /proc prints 32-bit words
                out.append((socket.inet_ntop(fam, raw), int(hexport, 16)))
    return out


def _job_pids(mark: str) -> set[int]:
    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"BROKER_TEST_MARK={mark}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    found.add(int(d.name))
            except OSError:
                pass
    return found


def _job(tmp_path: Path, *, env: dict[str, str], secrets: list[str], hashes: tuple[str, str]) -> Path:
    """A 2-node CPU recipe outside its work folder (nothing in the recipe file is staged) running TRAIN."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(TRAIN)
    recipe = tmp_path / "r.yaml"
    lines = "".join(f'  {k}: "{v}"\n' for k, v in env.items())
    recipe.write_text(textwrap.dedent(f"""\
        name: trust-e2e
        script: job/train.py
        workdir: job
        args: ["{tmp_path / 'ready'}", "{tmp_path / 'go'}", "{hashes[0]}", "{hashes[1]}"]
        nodes: 2
        gpus_per_node: 0
        cpu_ok: true
        max_hours: 0.1
    """) + "env:\n" + lines + (f"secrets: [{', '.join(secrets)}]\n" if secrets else ""))
    return recipe


def _sha(v: str) -> str:
    import hashlib

    return hashlib.sha256(v.encode()).hexdigest()


@pytest.mark.slow
def test_local_rendezvous_listens_on_loopback_only(tmp_path, cli_env):
    """A real 2-node local run: while it runs (rank 0 waits after init_process_group), every listening TCP socket
    of the job's processes -- torchrun's agents with the c10d store, the ranks' gloo pairs -- is on 127.0.0.1,
    none on every interface (``*:PORT``)."""
    import time

    mark = uuid.uuid4().hex
    recipe = _job(tmp_path, env={"BROKER_TEST_MARK": mark}, secrets=[], hashes=(_sha(""), _sha("")))
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = subprocess.Popen(broker_cmd("run", str(recipe), "--provider", "local", "--json"), cwd=tmp_path,
                            env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 180
        while not ready.exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert ready.exists(), "rank 0 never got past init_process_group"
        pids = _job_pids(mark)
        listening = _listening(pids)
        names = sorted(Path(f"/proc/{p}/comm").read_text().strip() for p in pids if Path(f"/proc/{p}/comm").exists())
        go.touch()
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    assert "pt_elastic" in names and listening, (names, listening)  # the agents hold the store's listener
    assert all(addr in ("127.0.0.1", "::1") for addr, _ in listening), listening


@pytest.mark.slow
def test_local_run_secrets_reach_only_the_ranks(tmp_path, cli_env, broker_home):
    """A real 2-node local run with ``secrets: [BROKER_TEST_SECRET]`` and a secret-looking ``env:`` name: both
    ranks see both values and none of broker's cloud credentials; neither value is anywhere in the run folder,
    the ledger, the -v log or the --json outputs (``run --json``, ``status RUN --json``)."""
    secret = "sentinel-secret-" + uuid.uuid4().hex
    literal = "sentinel-literal-" + uuid.uuid4().hex
    cloud = "sentinel-cloud-" + uuid.uuid4().hex
    recipe = _job(tmp_path, env={"WANDB_API_KEY": literal}, secrets=["BROKER_TEST_SECRET"],
                  hashes=(_sha(secret), _sha(literal)))
    (tmp_path / "go").touch()  # rank 0 does not wait
    env = {**cli_env, "BROKER_TEST_SECRET": secret, "VAST_API_KEY": cloud, "AWS_SECRET_ACCESS_KEY": cloud}
    p = subprocess.run(broker_cmd("-v", "run", str(recipe), "--provider", "local", "--json"), cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, out + err
    # the ranks saw the values; no cloud credential reached them
    result = json.loads(out)
    run_dir = Path(result["run"]["run_dir"])
    logs = "".join((run_dir / f"node{i}.log").read_text() for i in range(2))
    assert logs.count("SECRET_OK ENV_OK CLOUD_ABSENT") == 2, logs
    assert "looks like a secret" in err and "secrets: [WANDB_API_KEY]" in err
    # nowhere on disk or in the outputs
    status = subprocess.run(broker_cmd("status", result["run"]["id"], "--json"), env=cli_env, capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == 0
    texts = {"run --json": out, "-v log": err, "status --json": status.stdout}
    for f in list(run_dir.rglob("*")) + list(broker_home.glob("ledger.sqlite*")):
        if f.is_file():
            texts[str(f)] = f.read_bytes().decode("utf-8", "replace")
    for where, text in texts.items():
        for value in (secret, literal, cloud):
            assert value not in text, f"a secret value is in {where}"
    recorded = json.loads((run_dir / "recipe.json").read_text())
    assert recorded["secrets"] == ["BROKER_TEST_SECRET"] and recorded["env"]["WANDB_API_KEY"] == "********"


def test_slurm_batch_script_is_written_0600(tmp_path):
    """The batch script carries the recipe's env and secrets: the Slurm shell writes it 0600 from its creation
    (here, under umask 022; over ssh the same with ``umask 077``), also over an older 0644 file."""
    from broker.providers.slurm import Shell

    old = os.umask(0o022)
    try:
        Shell().write(str(tmp_path / "job.sbatch"), "export HF_TOKEN=x\n")
        (tmp_path / "old.sbatch").write_text("stale")
        os.chmod(tmp_path / "old.sbatch", 0o644)
        Shell().write(str(tmp_path / "old.sbatch"), "export HF_TOKEN=y\n")
    finally:
        os.umask(old)
    assert mode(tmp_path / "job.sbatch") == 0o600 and mode(tmp_path / "old.sbatch") == 0o600
    assert (tmp_path / "old.sbatch").read_text() == "export HF_TOKEN=y\n"


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_every_file_in_the_home_is_created_private_under_a_permissive_umask(tmp_path, umask):
    """Under umask 022 and 000 (no chmod allowed on the way): the space reserve, the lint cache, the watchdog's
    heartbeat, lock and log, a detached run's marker and the run's pinned host keys are created 0600 in 0700
    folders: walking the home finds no group or other bit anywhere."""
    home = tmp_path / "fresh-home"
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "train.py").write_text("print('x')\n")
    (tmp_path / "r.yaml").write_text("name: t\nscript: w/train.py\nnodes: 2\ngpus_per_node: 0\ncpu_ok: true\n")
    p = _child(f"""
        import json
        from pathlib import Path
        def no_chmod(*a, **k):
            raise AssertionError(f"chmod called: {{a}}")
        os.chmod = os.fchmod = no_chmod
        from broker.money.ledger import Ledger
        from broker.core.recipe import load_recipe
        from broker.run.runrecord import new_run
        from broker.core import sshkeys
        from broker.lint.rules import _cached_lint
        from broker.money.watchdog import Watchdog, WatchdogLock, start_detached
        from broker.cli.detached import DETACHED_ENV, _tell_detached_parent
        led = Ledger()
        recipe = load_recipe({str(tmp_path / 'r.yaml')!r})
        run = new_run(led, recipe, provider="local", topology="local", plan={{"x": 1}})
        _cached_lint(Path(recipe.script))
        assert start_detached(python="/bin/true")  # before a heartbeat says one runs
        wd = Watchdog(led, providers={{}})
        wd.write_heartbeat()
        lock = WatchdogLock().acquire()
        lock.release()
        os.environ[DETACHED_ENV] = "1"
        _tell_detached_parent(run)
        marker = Path(run.run_dir) / "detached.json"  # removed when this process ends: its mode is read now
        assert marker.exists() and not marker.stat().st_mode & 0o077, oct(marker.stat().st_mode)
        sshkeys.pin_host_key(Path(run.run_dir) / "ssh" / "known_hosts", "broker-res-r-1", "ssh-ed25519 AAAA")
        print(json.dumps(run.run_dir))
    """, {**os.environ, "BROKER_HOME": str(home)}, umask=umask)
    assert p.returncode == 0, p.stderr
    run_dir = Path(json.loads(p.stdout.strip().splitlines()[-1]))
    made = {home / ".space-reserve", home / "cache" / "lint.json", home / "watchdog.json", home / "watchdog.lock",
            home / "watchdog.log", run_dir / "ssh" / "known_hosts"}
    assert not (run_dir / "detached.json").exists()  # the run's process ended: its identity is not left behind
    assert all(f.exists() for f in made), sorted(str(f) for f in made if not f.exists())
    wide = [f"{q} {mode(q):o}" for q in [home, *home.rglob("*")] if mode(q) & 0o077]
    assert wide == []
