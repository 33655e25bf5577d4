"""netns hosts that behave like a cloud image (the emulators' VMs): the image's login user with passwordless sudo
and its own home, root login refused, this machine's Python usable by that user."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = [pytest.mark.netns]


def test_login_user_has_passwordless_sudo_and_root_cannot_log_in(netns_hosts):
    c = netns_hosts(1, login_user="opc")
    base = ["ssh", "-i", str(c.key_path), "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={c.known_hosts}",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    p = subprocess.run(base + [f"opc@{c.ip(0)}", "id -un; sudo -n id -u; echo $HOME; python3 -c 'import torch'"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["opc", "0", "/home/opc"], (p.stdout, p.stderr)
    p = subprocess.run(base + [f"root@{c.ip(0)}", "true"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 255 and "Permission denied" in p.stderr, p.stderr
    assert c.cluster("r").nodes[0].user == "opc"


def test_a_login_user_without_passwordless_sudo_is_named_before_anything_runs(netns_hosts, tmp_path):
    """What the Slurm builder checks first on every node (broker.run.sshcluster.arequire_root): sudo that asks for a
    password is a sentence naming the user and the node, not a 'Permission denied' halfway through."""
    from broker.core.provider import ProviderError
    from broker.run.sshcluster import SSHCluster, arequire_root, as_root

    c = netns_hosts(1, login_user="opc")
    (c.root / "sudoers.d" / "90-broker-login").unlink()  # the image's login user, without its NOPASSWD rule
    ssh = SSHCluster(c.cluster("r"), run_dir=tmp_path)
    try:
        with pytest.raises(ProviderError) as e:
            ssh.loop.call(arequire_root(ssh, 0, "slurm"), timeout=60)
        assert "the login user opc on node0 needs passwordless sudo: " in e.value.message, e.value.message
        assert "password is required" in e.value.message
        code, out = ssh.run(0, as_root("mkdir -p /var/lib/x", c.cluster("r").nodes[0]))
        assert code != 0
    finally:
        ssh.close()


def test_as_root_wraps_only_what_a_non_root_login_needs():
    from broker.core.records import ClusterNode
    from broker.run.sshcluster import as_root, root_prefix

    vm = ClusterNode(node_rank=1, host="h", user="ubuntu", private_ip="10.0.0.2")
    assert as_root("set -e; echo 'a b' > /etc/x", vm) == "sudo -n sh -c 'set -e; echo '\"'\"'a b'\"'\"' > /etc/x'"
    assert as_root("true", vm.model_copy(update={"user": "root"})) == "true"
    assert root_prefix(vm.model_copy(update={"local": True})) == "" and root_prefix(vm) == "sudo -n "
