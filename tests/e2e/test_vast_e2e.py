"""The real Vast.ai adapter through the whole pipeline (plan -> provision -> SSH executor -> teardown) against a
stateful Vast API emulator (tests/support/vast_emulator.py) whose instances are netns hosts with a real sshd.

Vast is simulated-only: one 2-GPU host is ONE netns host carrying two simulated nodes (gloo on CPU, cpu_ok).  The
adapter is pointed at the emulator with VAST_API_URL and a fake VAST_API_KEY; `onstart` never runs, so the run's
key reaches the host only through the key API (``POST /api/v0/instances/{id}/ssh/``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.core.model import TopologyKind
from broker.run.cloudtarget import CloudTarget
from broker.run.runrecord import Hooks
from tests.support.plans import rank_options
from broker.run.pipeline import run_pipeline
from broker.core.recipe import load_recipe
from tests.conftest import REPO, broker_cmd
from tests.support.vast_emulator import API_KEY, VastEmulator

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture
def hosts(netns_hosts):
    """``make(n)``: a netns cluster of n hosts with sshd, removed at the end (tests/conftest.py netns_hosts)."""
    return netns_hosts


@pytest.fixture
def emulator(monkeypatch):
    """``start(hosts, **kw)``: a VastEmulator on 127.0.0.1, the adapter pointed at it (VAST_API_URL + fake key)."""
    started: list[VastEmulator] = []

    def start(c, **kw) -> VastEmulator:
        emu = VastEmulator(c, **kw)
        started.append(emu)
        monkeypatch.setenv("VAST_API_URL", emu.url)
        monkeypatch.setenv("VAST_API_KEY", API_KEY)
        return emu

    try:
        yield start
    finally:
        for emu in started:
            emu.close()


def _recipe(tmp_path: Path):
    work = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    (work / "r.yaml").write_text(
        "name: vast-e2e\nscript: ddp_train.py\nargs: ['--epochs', '2']\nnodes: 2\ncpu_ok: true\n"
        "topology: simulated\nbudget_usd: 5\nmax_hours: 0.2\ndisk_gib: 40\n"
        "env: {DDP_TIMEOUT_S: '60', PYTHONWARNINGS: ignore}\n"
        "expect: ['ALLREDUCE_OK', 'DDP_OK']\nartifacts: [checkpoint.pt]\n")
    return load_recipe(work / "r.yaml")


def _vast(tmp_path: Path):
    from broker.providers.vast import VastProvider

    p = VastProvider(backoff_s=0.2, delete_timeout_s=30.0)
    p.node_workroot = str(tmp_path / "node-work")  # the netns hosts share this machine's filesystem
    return p


def _run(tmp_path: Path, *, ssh_ready_timeout_s: float | None = None):
    recipe = _recipe(tmp_path)
    vast = _vast(tmp_path)
    options = rank_options(vast, recipe.requirements())
    assert options and all(o.provider == "vast" and o.topology == TopologyKind.simulated for o in options)
    ledger = Ledger()
    lines: list[str] = []
    said = _Said()
    target = CloudTarget(recipe, options, providers={"vast": vast}, poll_s=0.2, ready_timeout_s=60,
                         ssh_ready_timeout_s=ssh_ready_timeout_s)
    out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks(echo=lines.append, say=said.append))
    return out, ledger, lines, said


class _Said(list):
    """Progress lines, each also kept with the monotonic time it was said (``at``)."""

    def __init__(self):
        super().__init__()
        self.at: list[tuple[float, str]] = []

    def append(self, line: str) -> None:
        import time

        self.at.append((time.monotonic(), line))
        super().append(line)

    def first(self, words: str) -> float:
        return next(t for t, s in self.at if words in s)


def _run_key(out) -> str:
    return (Path(out.run.run_dir) / "ssh" / "id_ed25519.pub").read_text().strip()


def _assert_clean_success(out, ledger, emu, lines, said):
    assert out.result is not None and out.result.ok, (out.result and out.result.reason, said[-15:], lines[-15:])
    assert [(r.node, r.rank, r.world_size, r.backend) for r in out.result.ranks] == [(0, 0, 2, "gloo"),
                                                                                    (1, 1, 2, "gloo")]
    assert out.cluster.master_addr == "127.0.0.1" and len({(n.host, n.port) for n in out.cluster.nodes}) == 1
    assert (Path(out.run.run_dir) / "artifacts" / "node0" / "checkpoint.pt").exists()
    rows = ledger.resources(out.run.id)
    assert [r.kind for r in rows] == ["instance"] and rows[0].state == "terminated"
    assert sum(1 for m, p, _ in emu.calls if m == "PUT" and p.startswith("/api/v0/asks/")) == 1  # no failover
    iid = int(rows[0].provider_id)
    assert iid in emu.destroyed and iid not in emu.instances
    assert out.run.status == "succeeded" and out.left == [] and out.exit_code == 0
    return iid


def test_sshd_that_starts_after_running_is_waited_for(hosts, emulator, tmp_path):
    # 4 s: the first connects are refused (the retries back off 1, 2, 4 s), and the wait ends after ~4-8 s
    emu = emulator(hosts(1), sshd_delay_s=4.0)
    out, ledger, lines, said = _run(tmp_path)
    iid = _assert_clean_success(out, ledger, emu, lines, said)
    assert any("waiting for SSH" in s for s in said) and any("accepts SSH" in s for s in said), said
    # the API said running ~4 s before sshd accepted; the run waited for SSH instead of failing at once
    waited = said.first("accepts SSH") - said.first(f"vast: {iid} is running")
    assert 3.5 <= waited < 30.0, (waited, said)


def test_run_key_reaches_the_host_only_through_the_key_api(hosts, emulator, tmp_path):
    c = hosts(1)
    before = (c.root / "ssh" / "authorized_keys").read_text()
    emu = emulator(c)
    out, ledger, lines, said = _run(tmp_path)
    iid = _assert_clean_success(out, ledger, emu, lines, said)
    key = _run_key(out)
    assert key not in before  # the host did not know the run's key before the key API call
    assert emu.keys_posted == [(iid, key)]
    assert ("POST", f"/api/v0/instances/{iid}/ssh/", {"ssh_key": key}) in emu.calls
    rent = next(b for m, p, b in emu.calls if m == "PUT" and p.startswith("/api/v0/asks/"))
    assert key in rent["onstart"]  # the onstart copy is sent too, but nothing here runs it


def test_without_the_key_api_the_run_cannot_log_in(hosts, emulator, tmp_path):
    """The control for the test above: the emulator takes the key API call but does not install the key, so
    the host only has the onstart copy (never run): SSH auth fails, and the instance is still torn down."""
    emu = emulator(hosts(1), install_posted_keys=False)
    out, ledger, lines, said = _run(tmp_path, ssh_ready_timeout_s=4)
    assert out.result is not None and not out.result.ok
    assert "Permission denied" in out.result.reason and "cannot reach node 0" in out.result.reason, out.result.reason
    assert any("waiting for SSH" in s and "Permission denied" in s for s in said), said  # auth was retried
    assert len(emu.keys_posted) >= 2  # posted again when the logins were refused (and still never installed)
    assert not emu.instances and out.left == []
    assert out.run.status == "failed" and out.exit_code == 1


def test_a_key_lost_by_the_key_api_is_posted_again_when_logins_are_refused(hosts, emulator, tmp_path):
    """Retry on auth failure.  The first key API call is answered with success but the key never
    reaches the host; SSH refuses the login, broker posts the key again, the next login works."""
    emu = emulator(hosts(1), lose_first_keys=1)
    out, ledger, lines, said = _run(tmp_path)
    _assert_clean_success(out, ledger, emu, lines, said)
    assert len(emu.keys_posted) >= 2 and len({k for _, k in emu.keys_posted}) == 1
    assert any("Permission denied" in s for s in said), said


def test_foreign_installation_instance_is_left_alone(hosts, emulator, tmp_path, cli_env):
    from broker.providers.vast import make_label

    c = hosts(2)
    emu = emulator(c)
    foreign = emu.add_instance(make_label("20261130-090000-abcdef", 0, "bi0123456789", "res0123456789a"), host=1)
    out, ledger, lines, said = _run(tmp_path)
    _assert_clean_success(out, ledger, emu, lines, said)
    assert ledger.installation_id != "bi0123456789"
    env = dict(cli_env, VAST_API_URL=emu.url, VAST_API_KEY=API_KEY)
    for argv in (("reconcile", "--provider", "vast", "--terminate", "--yes"), ("watchdog", "--once")):
        p = subprocess.run(broker_cmd(*argv), cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        text = " ".join((p.stdout + p.stderr).split())
        assert p.returncode == 0, text
        assert f"other installation: vast instance {foreign}" in text and "bi0123456789" in text, text
        assert "left alone" in text, text
    assert foreign in emu.instances and emu.deletes_of(foreign) == 0


def test_a_5xx_on_the_first_delete_is_retried_and_the_instance_is_gone(hosts, emulator, tmp_path):
    emu = emulator(hosts(1), delete_failures=1)
    out, ledger, lines, said = _run(tmp_path)
    iid = _assert_clean_success(out, ledger, emu, lines, said)
    assert emu.deletes_of(iid) == 2  # one 500, then the retry that destroyed it
    assert "still live" not in (out.run.message or "")
