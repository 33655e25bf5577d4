"""Host keys are pinned per machine, never per address, against a real sshd in a network namespace: a machine
re-rented on a freed address (a new resource id, a new host key) is reached; the same machine (same resource id)
answering with a changed key is refused at once, by the runner and by ``broker ssh``, with a message that says why."""

from __future__ import annotations

import subprocess
import time

import pytest

from broker.core.model import TopologyKind
from broker.core.records import Cluster, ClusterNode
from broker.core.recipe import Recipe
from broker.core.sshkeys import host_key_name, pinned_keys
from broker.run.remote import SSHExecutor
from broker.run.sshcluster import HostKeyChanged, SSHCluster
from tests.support.netns_faults import rehost

pytestmark = [pytest.mark.netns]


def _cluster(hosts, rid: str, kh) -> Cluster:
    ip = hosts.ip(0)
    return Cluster(run_id="20261206-000000-abcdef", provider="gcp", topology=TopologyKind.multi_node,
                   nodes=[ClusterNode(node_rank=0, host=ip, private_ip=ip, resource_id=rid)],
                   ssh_key_path=str(hosts.key_path), known_hosts_path=str(kh), python="python3",
                   workroot=str(hosts.root / "work"))


def _open(cluster: Cluster, run_dir) -> None:
    ssh = SSHCluster(cluster, run_dir=run_dir, connect_timeout_s=5)
    try:
        ssh.open()
    finally:
        ssh.close()


def test_a_rerented_machine_on_the_same_address_is_a_new_machine(netns_hosts, tmp_path):
    from broker.cli.day2 import ssh_argv

    hosts = netns_hosts(1)
    kh = tmp_path / "run" / "ssh" / "known_hosts"
    first = _cluster(hosts, "r-first", kh)
    _open(first, tmp_path / "run")
    old = pinned_keys(kh, host_key_name(hosts.ip(0), 22, "r-first"))
    assert len(old) == 1 and kh.stat().st_mode & 0o777 == 0o600

    new_key = rehost(hosts)  # the provider reclaimed the VM and rented another one on the same address
    assert new_key not in old

    # the re-rented VM is another resource: its key is pinned under its own name, the old pin is not consulted
    second = _cluster(hosts, "r-second", kh)
    _open(second, tmp_path / "run")
    assert pinned_keys(kh, host_key_name(hosts.ip(0), 22, "r-second")) == [new_key]
    assert pinned_keys(kh, host_key_name(hosts.ip(0), 22, "r-first")) == old  # untouched

    # `broker ssh` (OpenSSH) uses the same per-machine pin
    def ssh(cluster: Cluster) -> subprocess.CompletedProcess:
        argv = ssh_argv(cluster, 0, ["true"])
        argv[1:1] = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    assert ssh(second).returncode == 0
    refused = ssh(first)
    assert refused.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in refused.stderr

    # the SAME machine (resource id r-first) answering with another key is refused, by the runner at once: a
    # changed key is never retried for the SSH ready time, and the message names the machine and why
    with pytest.raises(HostKeyChanged) as e:
        _open(first, tmp_path / "run")
    assert "r-first" in e.value.message and "man-in-the-middle" in e.value.message
    assert "rebuilt" in e.value.message and "port" not in (e.value.hint or "")

    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "t.py").write_text("print('x')\n")
    recipe = Recipe.model_validate(dict(name="t", script=tmp_path / "w" / "t.py", workdir=tmp_path / "w", nodes=1))
    ex = SSHExecutor(first, recipe, tmp_path / "run", echo=None, ready_timeout_s=120, connect_timeout_s=5)
    t0 = time.monotonic()
    try:
        res = ex.reach()
    finally:
        ex.close(False)
    took = time.monotonic() - t0
    assert res is not None and res.status == "failed"
    assert "man-in-the-middle" in res.reason and "retried" not in res.reason
    assert took < 30, took  # not the 120 s of SSH ready time


def test_the_connection_to_a_real_sshd_uses_aes_gcm(netns_hosts, tmp_path):
    """asyncssh's first choice, chacha20-poly1305, costs 38 us a packet in Python against 3.3 us for AES-GCM: the
    CPU of the log stream and the uploads, taken from the ranks beside them.  A stock OpenSSH sshd agrees on
    aes128-gcm, and every default cipher stays offered for an sshd that has no GCM."""
    from asyncssh.encryption import get_default_encryption_algs

    from broker.run.sshcluster import encryption_preference

    prefs = encryption_preference()
    assert prefs[0] == "aes128-gcm@openssh.com"
    assert sorted(prefs) == sorted(a.decode() for a in get_default_encryption_algs())
    hosts = netns_hosts(1)
    ssh = SSHCluster(_cluster(hosts, "r-gcm", tmp_path / "run" / "ssh" / "known_hosts"), run_dir=tmp_path / "run",
                     connect_timeout_s=5)
    try:
        ssh.open()

        async def cipher():
            conn = await ssh.aconn(0)
            return conn.get_extra_info("send_cipher"), conn.get_extra_info("recv_cipher")

        assert ssh.loop.call(cipher(), timeout=30) == ("aes128-gcm@openssh.com", "aes128-gcm@openssh.com")
    finally:
        ssh.close()
