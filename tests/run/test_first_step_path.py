"""broker's own seconds on the way to the first training step and out of a run: the imports done while a rented
machine boots, one SFTP session per node for the node scripts, and no exit-time garbage collection in the CLI or
in the torchrun launcher it wraps (bench/first_step.py and bench/launch_overhead.py measure the seconds)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import textwrap
import types
from pathlib import Path

import pytest

from broker.core.warm import warm_imports


# ------------------------------------------------------------------------------------------------ warm imports
def test_every_module_the_ssh_executor_warms_exists():
    """A renamed module in REACH_MODULES would be skipped silently by the warm thread (its failure is left to the
    real import): each name must resolve."""
    from broker.run.remote import REACH_MODULES

    missing = [n for n in REACH_MODULES if importlib.util.find_spec(n) is None]
    assert not missing, missing


def test_warm_imports_loads_the_modules_and_then_the_list_the_last_one_names(tmp_path, monkeypatch):
    pkg = tmp_path / "warmpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "first.py").write_text("NEXT = ('warmpkg.second', 'warmpkg.broken', 'warmpkg.third')\n")
    (pkg / "second.py").write_text("")
    (pkg / "broken.py").write_text("raise RuntimeError('an import that fails')\n")
    (pkg / "third.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("warmpkg")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        t = warm_imports(["warmpkg.nothere", "warmpkg.first"], then="NEXT")
        t.join(timeout=30)
        assert not t.is_alive() and t.daemon
        # a failing import neither stops the rest nor raises on this thread: the real import raises it later
        assert {"warmpkg.first", "warmpkg.second", "warmpkg.third"} <= set(sys.modules)
        assert "warmpkg.broken" not in sys.modules
        with pytest.raises(RuntimeError, match="an import that fails"):
            importlib.import_module("warmpkg.broken")
    finally:
        for name in [m for m in sys.modules if m.startswith("warmpkg")]:
            sys.modules.pop(name, None)


def test_the_cloud_target_warms_the_ssh_executor_while_the_machines_boot(monkeypatch):
    from broker.run import cloudtarget

    seen = []
    monkeypatch.setattr("broker.core.warm.warm_imports", lambda names, then=None: seen.append((list(names), then)))
    cloudtarget._warm_reach()
    assert seen == [(["broker.run.remote"], "REACH_MODULES")]


# ------------------------------------------------------------------------------------------------ node scripts
class _Sftp:
    def __init__(self, log):
        self.log = log

    async def __aenter__(self):
        self.log.append("session")
        return self

    async def __aexit__(self, *exc):
        return False

    async def makedirs(self, path, exist_ok=False):
        self.log.append(("mkdir", path))

    async def remove(self, path):
        import asyncssh

        raise asyncssh.SFTPNoSuchFile("no such file")

    def open(self, path, mode, attrs=None):
        log = self.log

        class _F:
            async def __aenter__(self):
                return self

            async def __aexit__(self, *exc):
                return False

            async def write(self, data):
                log.append(("write", path, data, attrs.permissions))

        return _F()


class _Conn:
    def __init__(self, log):
        self.log = log

    def start_sftp_client(self):
        return _Sftp(self.log)


def test_files_for_one_node_travel_in_one_sftp_session_with_their_modes():
    """The node's sshd starts an sftp-server per session; the probe and the shim's three files took four."""
    from broker.run.sshcluster import SSHCluster

    log: list = []
    stub = types.SimpleNamespace()

    async def aconn(i):
        return _Conn(log)

    stub.aconn = aconn
    files = [(b"a", "/w/n/probe.py", 0o644), (b"b", "/w/n/rankshim.py", 0o644), (b"s", "/w/n/sub/env.sh", 0o600)]
    asyncio.run(SSHCluster.aput_files(stub, 0, files))
    assert log.count("session") == 1
    assert [x[1:] for x in log if x[0] == "write"] == [("/w/n/probe.py", b"a", 0o644),
                                                       ("/w/n/rankshim.py", b"b", 0o644),
                                                       ("/w/n/sub/env.sh", b"s", 0o600)]
    assert [x[1] for x in log if x[0] == "mkdir"] == ["/w/n", "/w/n/sub"]


def test_the_node_scripts_go_to_each_node_in_one_call():
    from broker.run import remote
    from broker.run.rankshim import SHIM_FILES

    calls: dict[int, list] = {}

    class Ssh:
        def probe(self, i):
            return f"/base{i}/probe.py"

        def base(self, i):
            return f"/base{i}"

        async def aput_files(self, i, files):
            calls.setdefault(i, []).append(files)

        def gather(self, coros, timeout):
            async def _all():
                return await asyncio.gather(*coros, return_exceptions=True)
            return asyncio.run(_all())

    assert remote.upload_node_scripts(Ssh(), 2) == [None, None]
    for i in (0, 1):
        assert len(calls[i]) == 1
        paths = [p for _, p, _ in calls[i][0]]
        assert paths == [f"/base{i}/probe.py"] + [f"/base{i}/{n}" for n in SHIM_FILES]
        shim = dict((p, d) for d, p, _ in calls[i][0])[f"/base{i}/rankshim.py"]
        assert shim == Path(remote.RANKSHIM).read_bytes()


# ------------------------------------------------------------------------------------------------ exit
def test_the_cli_freezes_its_objects_before_the_interpreter_exits(monkeypatch):
    """The last garbage collection of the interpreter walked every object of the ~600 modules loaded (0.1 s of
    a run's end): main() moves them out of its reach first."""
    import gc

    from broker.cli import app

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    with pytest.raises(SystemExit) as e:
        app.main(["--version"])
    assert e.value.code == 0 and frozen == [True]


def test_the_torchrun_launcher_freezes_its_objects_when_torchrun_returns_or_fails(monkeypatch):
    """torchrun's process imports torch (0.25-0.5 s of exit-time collection); the shim that starts it freezes
    them whether torchrun returned or raised (a failed worker: SystemExit 1)."""
    import gc

    from broker.run import rankshim

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    outcome = {"raise": None}

    def fake_main():
        if outcome["raise"] is not None:
            raise outcome["raise"]

    run_mod = types.ModuleType("torch.distributed.run")
    run_mod.main = fake_main
    torch_mod = types.ModuleType("torch")
    dist_mod = types.ModuleType("torch.distributed")
    torch_mod.distributed = dist_mod
    dist_mod.run = run_mod
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch", torch_mod))
    monkeypatch.setitem(sys.modules, "torch.distributed", sys.modules.get("torch.distributed", dist_mod))
    monkeypatch.setitem(sys.modules, "torch.distributed.run", run_mod)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = ["--nnodes=1", "--node_rank=1", "train.py"]  # node_rank 1: no rendezvous binding (no torch needed)
    assert rankshim._torchrun(args) == 0
    outcome["raise"] = SystemExit(1)
    with pytest.raises(SystemExit):
        rankshim._torchrun(args)
    assert frozen == [True, True]


def test_a_cli_run_still_writes_everything_at_exit(tmp_path):
    """With the exit-time collection skipped, what the CLI writes on its way out (the ledger, the summary) is
    complete: atexit handlers and file closing still run."""
    import subprocess

    code = textwrap.dedent("""
        import atexit, sys
        f = open(sys.argv[1], "w")
        f.write("buffered, never flushed by hand")
        atexit.register(lambda: open(sys.argv[2], "w").write("atexit ran"))
        from broker.cli.app import main
        main(["--version"])
    """)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    r = subprocess.run([sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert a.read_text() == "buffered, never flushed by hand"
    assert b.read_text() == "atexit ran"
