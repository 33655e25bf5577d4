"""`broker netns down ID` matches whole cluster ids only: a malformed id is bad input (exit 2), and neither a
prefix (`bkn`) nor a word found in command lines (`sshd`) ever acts like --all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.core.errors import BadInput
from broker.providers.netns import cluster as netns  # the machinery itself: the fixture below patches its helpers

ROOT = Path(__file__).resolve().parents[3]


def broker(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, BROKER_HOME=str(home), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "broker", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("bad", ["bogusid", "bkn", "sshd", "bkn1a2b3", "bkn1a2b3c4", "BKN1A2B3C", "bkn1a2b3g",
                                 "bkn1a2b3c*", "bkn1a2b3cn0", "", "*"])
def test_check_cid_rejects_everything_but_a_whole_id(bad):
    with pytest.raises(BadInput, match="not a netns cluster id"):
        netns.check_cid(bad)


def test_check_cid_accepts_whole_ids():
    assert netns.check_cid("bkn1a2b3c") == "bkn1a2b3c"
    assert netns.check_cid(netns.new_cid())


def test_cid_of_names():
    assert netns.cid_of("bkn1a2b3cn0") == "bkn1a2b3c"
    assert netns.cid_of("bkn1a2b3cv12") == "bkn1a2b3c"
    assert netns.cid_of("bkn1a2b3cbr") == "bkn1a2b3c"
    assert netns.cid_of("bkn1a2b3cp0") is None  # the node-side peer lives in the namespace, not in `ip link`
    assert netns.cid_of("eth0") is None and netns.cid_of("bkn") is None


@pytest.fixture
def fake_host(monkeypatch):
    """Two clusters whose ids share a 5-digit prefix, plus a foreign namespace; records every `ip` call."""
    ns = ["bkn1a2b3cn0", "bkn1a2b3cn1", "bkn1a2b3dn0", "bkn1a2b3dn1", "other"]
    links = ["bkn1a2b3cbr", "bkn1a2b3cv0", "bkn1a2b3cv1", "bkn1a2b3dbr", "bkn1a2b3dv0", "eth0", "lo"]
    calls: list[list[str]] = []

    def run(argv, check=True, timeout=20):
        calls.append(list(argv))
        if argv[:3] == ["ip", "netns", "del"]:
            ns.remove(argv[3])
        if argv[:3] == ["ip", "link", "del"]:
            links.remove(argv[3])
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(netns, "_ns_list", lambda: list(ns))
    monkeypatch.setattr(netns, "_links", lambda: list(links))
    monkeypatch.setattr(netns, "_ns_pids", lambda name: [])
    monkeypatch.setattr(netns, "_run", run)
    return ns, links, calls


def test_remove_cid_touches_only_its_own_cluster(fake_host):
    ns, links, calls = fake_host
    removed = netns.remove_cid("bkn1a2b3c")
    assert sorted(removed) == ["link bkn1a2b3cbr", "link bkn1a2b3cv0", "link bkn1a2b3cv1", "netns bkn1a2b3cn0",
                               "netns bkn1a2b3cn1"]
    assert ns == ["bkn1a2b3dn0", "bkn1a2b3dn1", "other"]
    assert links == ["bkn1a2b3dbr", "bkn1a2b3dv0", "eth0", "lo"]
    assert all("bkn1a2b3d" not in " ".join(c) for c in calls)


@pytest.mark.parametrize("prefix", ["bkn", "bkn1a2b3", "bkn1a2b3cn0"])
def test_remove_and_leftovers_refuse_a_prefix(fake_host, prefix):
    ns, links, calls = fake_host
    with pytest.raises(BadInput):
        netns.remove_cid(prefix)
    with pytest.raises(BadInput):
        netns.leftovers(prefix)
    with pytest.raises(BadInput):
        netns.sshd_processes(prefix)
    assert calls == [] and len(ns) == 5


def test_leftovers_whole_id(fake_host):
    assert netns.leftovers("bkn1a2b3c") == ["netns bkn1a2b3cn0", "netns bkn1a2b3cn1", "link bkn1a2b3cbr",
                                            "link bkn1a2b3cv0", "link bkn1a2b3cv1"]
    assert netns.leftovers("bkn000000") == []


@pytest.fixture
def fake_sshd(tmp_path):
    """A process whose command line looks like a netns cluster's sshd (a sleeping Python with sshd's arguments)."""
    cfg = tmp_path / "runs" / "r1" / "netns" / "bkn1a2b3c" / "node0" / "sshd_config"
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "/usr/sbin/sshd", "-D", "-e", "-f",
                          str(cfg)])
    time.sleep(0.1)
    yield p
    p.kill()
    p.wait()


def test_sshd_processes_whole_id(fake_sshd):
    assert fake_sshd.pid in netns.sshd_processes("bkn1a2b3c")
    assert fake_sshd.pid not in netns.sshd_processes("bkn1a2b3d")
    assert fake_sshd.pid in netns.sshd_processes()  # all (for --all)


@pytest.mark.parametrize("bad", ["bogusid", "bkn", "sshd", "bkn1a2b3"])
def test_cli_down_bad_id_exits_2_and_kills_nothing(tmp_path, fake_sshd, bad):
    cp = broker("netns", "down", bad, home=tmp_path / "home")
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert "not a netns cluster id" in cp.stderr and "broker netns status" in cp.stderr
    assert "Traceback" not in cp.stderr
    assert fake_sshd.poll() is None  # still running


def test_cli_down_unknown_whole_id_is_idempotent(tmp_path, fake_sshd):
    cp = broker("netns", "down", "bkn000000", home=tmp_path / "home")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "no cluster bkn000000" in cp.stdout
    assert fake_sshd.poll() is None


def test_cli_down_needs_id_or_all(tmp_path):
    cp = broker("netns", "down", home=tmp_path / "home")
    assert cp.returncode == 2 and "--all" in cp.stderr
    cp = broker("netns", "down", "bkn000000", "--all", home=tmp_path / "home")
    assert cp.returncode == 2 and "not both" in cp.stderr


def test_cli_down_kills_the_matching_fake_sshd(tmp_path, fake_sshd):
    cp = broker("netns", "down", "bkn1a2b3c", home=tmp_path / "home")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"sshd pid {fake_sshd.pid}" in cp.stdout
    fake_sshd.wait(timeout=5)


_why = netns.missing_requirements()


@pytest.mark.netns
@pytest.mark.skipif(_why is not None, reason=f"netns tests: {_why}")
def test_real_cluster_survives_a_prefix_and_goes_with_its_id(tmp_path):
    c = netns.up(1, tmp_path / "c", use_gpus=False)
    try:
        home = tmp_path / "home"
        for bad in ("bkn", c.cid[:-1], "sshd"):
            cp = broker("netns", "down", bad, home=home)
            assert cp.returncode == 2, cp.stdout + cp.stderr
        assert netns.leftovers(c.cid) and netns.sshd_processes(c.cid)
        other = "bkn" + ("000000" if c.cid != "bkn000000" else "000001")
        assert broker("netns", "down", other, home=home).returncode == 0
        assert netns.leftovers(c.cid) and netns.sshd_processes(c.cid)
        cp = broker("netns", "down", c.cid, home=home)
        assert cp.returncode == 0 and f"netns {c.cid}n0" in cp.stdout, cp.stdout + cp.stderr
        deadline = time.monotonic() + 5
        while (netns.leftovers(c.cid) or netns.sshd_processes(c.cid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not netns.leftovers(c.cid) and not netns.sshd_processes(c.cid)
    finally:
        c.down()
        for p in netns.sshd_processes(c.cid):
            os.kill(p, signal.SIGKILL)
