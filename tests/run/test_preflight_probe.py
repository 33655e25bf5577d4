"""The stdlib probe that preflight runs on the nodes, exercised locally on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import broker.run.probe_script as probe

PROBE = Path(probe.__file__)


def test_listen_and_connect_open_and_refused():
    lst = subprocess.Popen([sys.executable, str(PROBE), "listen", "10", "1", "0"], stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(lst.stdout.readline())["ports"][0]
        out = subprocess.run([sys.executable, str(PROBE), "connect", "2", "127.0.0.1", str(port)],
                             capture_output=True, text=True, timeout=30).stdout
        assert json.loads(out)["state"] == "OPEN"
        assert lst.wait(timeout=10) == 0  # exits once every port was hit
    finally:
        lst.kill()
    out = subprocess.run([sys.executable, str(PROBE), "connect", "2", "127.0.0.1", str(port)],
                         capture_output=True, text=True, timeout=30).stdout
    assert json.loads(out)["state"] == "REFUSED"


def test_listen_reports_a_busy_port():
    lst = subprocess.Popen([sys.executable, str(PROBE), "listen", "10", "5", "0"], stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(lst.stdout.readline())["ports"][0]
        out = subprocess.run([sys.executable, str(PROBE), "listen", "1", "1", str(port)], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 3 and "cannot listen on port" in json.loads(out.stdout)["error"]
    finally:
        lst.kill()
        lst.wait()


def test_interfaces_without_the_ip_tool(monkeypatch):
    monkeypatch.setattr(probe, "_run", lambda argv, timeout=5.0: (-1, "ip: not found"))
    ifs = probe._ifaces()
    assert "127.0.0.1" in ifs["lo"]["addrs"] and ifs["lo"]["mtu"]


def test_kill_sweeps_group_descendants_and_marked_orphans(tmp_path):
    pidfile = tmp_path / "pid"
    env = dict(os.environ, BROKER_RUN_ID="probe-test", BROKER_NODE_RANK="3")
    # a group leader with a child, and an orphan in its own session carrying the marker
    leader = subprocess.Popen(["sh", "-c", f"echo $$ > {pidfile}; sleep 60 & wait"], start_new_session=True, env=env)
    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True, env=env)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True,
                             env=dict(env, BROKER_NODE_RANK="4"))  # another node's process: untouched
    try:
        deadline = time.monotonic() + 5
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        out = subprocess.run([sys.executable, str(PROBE), "kill", str(pidfile), "2", "BROKER_RUN_ID=probe-test",
                              "BROKER_NODE_RANK=3"], capture_output=True, text=True, timeout=30).stdout
        res = json.loads(out)
        assert leader.pid in res["terminated"] and orphan.pid in res["terminated"]
        assert other.pid not in res["terminated"]
        assert leader.wait(timeout=5) is not None and orphan.wait(timeout=5) is not None
        assert other.poll() is None
    finally:
        for p in (leader, orphan, other):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()


def _fake_torch(folder: Path, *, cuda: str | None, init: str = "") -> Path:
    """A ``torch`` package in ``folder`` with a version file as torch's wheels write it (``cuda`` its CUDA build)
    and ``init`` as its ``__init__``."""
    pkg = folder / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (pkg / "version.py").write_text("from typing import Optional\n__version__ = '9.1.0+fake'\ndebug = False\n"
                                    f"cuda: Optional[str] = {cuda!r}\nhip: Optional[str] = None\n")
    return folder


def _info(env_path: Path | None = None, *flags: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(env_path) if env_path else "")
    out = subprocess.run([sys.executable, *flags, str(PROBE), "info", "127.0.0.1"], capture_output=True, text=True,
                         timeout=120, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_cpu_build_of_torch_is_read_from_its_files_without_importing_it(tmp_path):
    """The job imports torch right after preflight: a CPU build's facts (version, no GPU, no NCCL) come from its
    version file, so preflight no longer pays an import (seconds) on every node.  The fake package's import would
    fail: the facts cannot have come from it."""
    d = _info(_fake_torch(tmp_path, cuda=None, init="raise ImportError('imported')"))
    assert d["torch"] == "9.1.0+fake" and d.get("torch_from") == "files", d
    assert (d["gpus"], d["cuda"], d["nccl"], d["nccl_version"]) == (0, False, False, None)
    assert "torch_error" not in d


def test_a_gpu_build_of_torch_is_still_imported_and_a_broken_one_named(tmp_path):
    """A CUDA build needs the import (devices visible, NCCL version): a broken one is named by its import error,
    as before."""
    d = _info(_fake_torch(tmp_path, cuda="12.4",
                          init="raise ImportError('libcudart.so.12: cannot open shared object file')"))
    assert "libcudart.so.12: cannot open shared object file" in d["torch_error"], d
    assert "torch" not in d and "torch_from" not in d


def test_no_torch_is_named_as_the_import_names_it(tmp_path):
    """A python without torch (``-S``: no site-packages): the same words as ``import torch`` gives, which
    preflight's torch row quotes."""
    d = _info(None, "-S")
    assert d["torch_error"] == "ModuleNotFoundError: No module named 'torch'", d
