"""Shared fixtures: every test gets its own broker home (ledger, run dirs) and no cloud credentials."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_CLOUD_ENV = ("VAST_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
              "OCI_CONFIG_FILE", "OCI_PROFILE", "OCI_SERVICE_ENDPOINT", "AWS_ENDPOINT_URL")


def pytest_configure(config):
    """The Ctrl-C tests send SIGINT to the commands they start, as a terminal does to its foreground command.  A
    suite started as a background job of a script inherits SIGINT ignored, and so would every command it starts:
    give this process the default back (its children inherit that instead)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def no_stray_watchdogs(tmp_path_factory):
    """At the end of the session, kill any `broker watchdog` a test started detached under pytest's temp dir."""
    import signal

    yield
    base = str(tmp_path_factory.getbasetemp())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"watchdog" in cmd and b"broker" in cmd and any(
                e.startswith(b"BROKER_HOME=" + base.encode()) for e in env):
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(autouse=True)
def broker_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("broker-home")
    monkeypatch.setenv("BROKER_HOME", str(home))
    for name in _CLOUD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OCI_CONFIG_FILE", str(home / "no-oci-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "no-aws-credentials"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "xdg-config"))
    # `broker run` on rented (fake) machines would start a detached watchdog per test; tests that want one
    # start it themselves (tests/money/test_watchdog_process.py, test_run_starts_the_watchdog)
    monkeypatch.setenv("BROKER_WATCHDOG_AUTOSTART", "0")
    # a hybrid run looks up this machine's public address unless told: never from a test
    monkeypatch.setenv("BROKER_PUBLIC_IP", "none")
    # prose is not wrapped at the width in tests that check what is said (tests/cli/test_narrow.py checks the wrapping,
    # with this unset)
    monkeypatch.setenv("BROKER_NO_WRAP", "1")
    from broker.core.config import settings

    settings.cache_clear()
    yield home
    settings.cache_clear()
    # the journal's writes kept in memory belong to one process's run of broker: a test that left some (a locked or
    # full ledger) must not make a later in-process CLI call exit +10 for them
    journal = sys.modules.get("broker.money.journal")
    if journal is not None:
        with journal._ALL_LOCK:
            journal._ALL.clear()


def wait_for(cond, timeout: float) -> bool:
    """Poll ``cond`` every 0.1 s for up to ``timeout`` seconds; its last value decides."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def broker_cmd(*args: str) -> list[str]:
    """argv that runs this checkout's CLI in a subprocess."""
    return [sys.executable, "-m", "broker", *args]


@pytest.fixture
def cli_env(broker_home):
    """Environment for a `python -m broker` subprocess (this checkout first on the path)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore"
    return env


#: providers/fake.py variables that inject failures, hangs, delays and prices (see its docstring)
FAKE_INJECTION_ENV = ("BROKER_FAKE_FAIL", "BROKER_FAKE_HANG", "BROKER_FAKE_READY_S", "BROKER_FAKE_USD_PER_HOUR",
                      "BROKER_FAKE_PREEMPT")


@pytest.fixture
def fake_cloud(monkeypatch):
    """``use(home, state)``: BROKER_HOME=``home``, the file-backed fake cloud (providers/fake.py) keeps its state in
    ``state``, and no failure injection is set; returns ``home``."""

    def use(home: Path, state: Path) -> Path:
        monkeypatch.setenv("BROKER_HOME", str(home))
        monkeypatch.setenv("BROKER_FAKE_STATE", str(state))
        for var in FAKE_INJECTION_ENV:
            monkeypatch.delenv(var, raising=False)
        return home

    return use


@pytest.fixture
def fake_cloud_home(tmp_path, fake_cloud):
    """``tmp_path`` as the broker home, the fake cloud's state in ``<home>/fake-cloud.json``, no injection."""
    return fake_cloud(tmp_path, tmp_path / "fake-cloud.json")


@pytest.fixture
def own_httpserver():
    """A pytest-httpserver ``HTTPServer`` on 127.0.0.1 (free port) for this test alone (the plugin's ``httpserver``
    is one session-wide server shared with other modules); cleared and stopped at the end."""
    from pytest_httpserver import HTTPServer

    srv = HTTPServer(host="127.0.0.1", port=0)
    srv.start()
    try:
        yield srv
    finally:
        srv.clear()
        if srv.is_running():
            srv.stop()


@pytest.fixture
def tmp_ledger(tmp_path):
    """A ledger at ``tmp_path/ledger.sqlite``, closed at the end."""
    from broker.money.ledger import Ledger

    led = Ledger(tmp_path / "ledger.sqlite")
    yield led
    led.close()


@pytest.fixture
def bg_pidfiles():
    """pid files of background processes a test's shell script starts (dead-man timers, idle watches); each one's
    process group is killed at the end (they run under setsid and lead their group, with their `sleep`)."""
    import signal

    pidfiles: list[Path] = []
    yield pidfiles
    for pf in pidfiles:
        try:
            pid = int(pf.read_text().strip())
        except (OSError, ValueError):
            continue
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def fake_ssh_sessions(tmp_path):
    """(PATH with a fake `who` and `pgrep` first, the flag file that makes `who` report a logged-in session)."""
    bindir = tmp_path / "fake-bin"
    bindir.mkdir()
    sessions = tmp_path / "sessions"
    (bindir / "who").write_text(f"#!/bin/sh\n[ -e {sessions} ] && echo 'root pts/0 2026-11-30 01:00 (198.18.0.1)'\n"
                                "exit 0\n")
    (bindir / "pgrep").write_text("#!/bin/sh\nexit 1\n")  # no sshd session processes
    for f in bindir.iterdir():
        f.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}", sessions


@pytest.fixture(scope="session")
def key_pem() -> str:
    """A throwaway RSA private key (PKCS8 PEM) for the OCI SDK's request signing against the local emulator."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def netns_missing() -> str | None:
    """None when network-namespace hosts can be made here (root, iproute2, sshd); else why not."""
    from broker.providers.netns import missing_requirements

    return missing_requirements()


@pytest.fixture
def netns_hosts(tmp_path):
    """``make(n, login_user="root")``: a netns cluster of n hosts with sshd (skips where none can be made; another
    ``login_user`` = a cloud image's: that user with passwordless sudo, root login refused); every cluster made is
    removed at the end, leaving no namespace or link (other clusters may run beside ours)."""
    why = netns_missing()
    if why:
        pytest.skip(why)
    from broker.providers import netns

    made = []

    def make(n: int, login_user: str = "root"):
        if login_user != "root" and not shutil.which("sudo"):
            pytest.skip("an image's login user needs sudo (apt-get install sudo; scripts/test installs it as root)")
        c = netns.up(n, tmp_path / f"hosts{len(made)}", use_gpus=False, login_user=login_user)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.down()
        assert [x for c in made for x in netns.leftovers(c.cid)] == []
