"""SSH runner pieces that need no network: node environment layers, the launch line, env.sh, known_hosts."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from broker.core.model import TopologyKind
from broker.core.records import Cluster, ClusterNode
from broker.core.recipe import Recipe
from broker.core.sshkeys import host_key_name, pin_host_key, pinned_keys
from broker.run.sshcluster import SSHCluster
from broker.run.remote import env_file, launch_command, node_env


def make(tmp_path: Path):
    cl = Cluster(run_id="run1", provider="aws", topology=TopologyKind.multi_node, python="/opt/py/bin/python3",
                 workroot="/root/broker",
                 nodes=[ClusterNode(node_rank=0, host="203.0.113.5", private_ip="10.0.0.10", gpu_indices=["0"]),
                        ClusterNode(node_rank=1, host="203.0.113.6", private_ip="10.0.0.11", gpu_indices=["1", "2"],
                                    env={"NCCL_HOSTID": "h1"})])
    (tmp_path / "w").mkdir(exist_ok=True)
    (tmp_path / "w" / "train.py").write_text("print('x')\n")
    r = Recipe.model_validate(dict(name="t", script=tmp_path / "w" / "train.py", workdir=tmp_path / "w", nodes=2,
                                   gpus_per_node=2, args=["--msg", "it's fine"], env={"A": "1"}))
    return cl, r


def test_node_env_layers(tmp_path):
    cl, r = make(tmp_path)
    e0 = node_env(cl, r, 0, "ens5")
    assert e0["NCCL_SOCKET_IFNAME"] == e0["GLOO_SOCKET_IFNAME"] == "ens5"
    assert e0["CUDA_VISIBLE_DEVICES"] == "0" and e0["A"] == "1" and e0["BROKER_NODE_RANK"] == "0"
    e1 = node_env(cl, r.model_copy(update={"env": {"GLOO_SOCKET_IFNAME": "eth1"}}), 1, "ens5")
    assert e1["GLOO_SOCKET_IFNAME"] == "eth1"  # the recipe may force it (preflight checks it)
    assert e1["CUDA_VISIBLE_DEVICES"] == "1,2" and e1["NCCL_HOSTID"] == "h1"


def test_launch_command_is_static_rendezvous_under_setsid(tmp_path):
    cl, r = make(tmp_path)
    ssh = SSHCluster(cl, run_dir=tmp_path)
    try:
        line, argv = launch_command(ssh, r, 1, 29612)
    finally:
        ssh.loop.close()
    # torchrun started by the shim (--torchrun): node 0's rendezvous store then listens on master_addr only
    assert argv == ["/opt/py/bin/python3", "/root/broker/run1/node1/rankshim.py", "--torchrun", "--nnodes=2",
                    "--nproc_per_node=2",
                    "--node_rank=1", "--master_addr=10.0.0.10", "--master_port=29612",
                    "/root/broker/run1/node1/rankshim.py", "--facts", "/root/broker/run1/node1/facts", "--",
                    "train.py", "--msg", "it's fine"]
    assert line.startswith("cd /root/broker/run1/node1/work && . /root/broker/run1/node1/env.sh && exec setsid -w")
    assert shlex.split(line)[-len(argv):] == argv  # quoting round-trips


def test_env_file_quotes_values(tmp_path):
    data = env_file({"A": "it's $HOME", "B": "x y"})
    f = tmp_path / "env.sh"
    f.write_bytes(data)
    out = subprocess.run(["sh", "-c", f". {f}; printf '%s|%s' \"$A\" \"$B\""], capture_output=True, text=True)
    assert out.stdout == "it's $HOME|x y"


def test_known_hosts_match(tmp_path):
    kh = tmp_path / "kh"
    kh.write_text("10.0.0.1,node0 ssh-ed25519 AAAA\n[10.0.0.2]:2222 ssh-ed25519 BBBB\n# c\n"
                  "broker-res-r-1 ssh-ed25519 CCCC\n")
    assert pinned_keys(kh, host_key_name("10.0.0.1", 22)) == ["ssh-ed25519 AAAA"]
    assert pinned_keys(kh, "node0") == ["ssh-ed25519 AAAA"]
    assert pinned_keys(kh, host_key_name("10.0.0.2", 2222)) == ["ssh-ed25519 BBBB"]
    assert pinned_keys(kh, host_key_name("10.0.0.2", 22)) == []
    assert pinned_keys(tmp_path / "none", "10.0.0.1") == []
    # a machine with a resource id is pinned by that id only: the address line of whatever held it before is no pin
    assert pinned_keys(kh, host_key_name("10.0.0.1", 22, "r-1")) == ["ssh-ed25519 CCCC"]
    assert pinned_keys(kh, host_key_name("10.0.0.1", 22, "r-2")) == []
    odd = host_key_name("10.0.0.1", 22, "ocid1.instance..a b*")
    assert odd.startswith("broker-res-h") and " " not in odd and "*" not in odd


def test_pinned_key_file_is_created_0600_under_any_umask(tmp_path):
    import os

    old = os.umask(0)
    try:
        pin_host_key(tmp_path / "ssh" / "known_hosts", "broker-res-r-1", "ssh-ed25519 AAAA comment")
    finally:
        os.umask(old)
    assert (tmp_path / "ssh" / "known_hosts").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "ssh").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "ssh" / "known_hosts").read_text() == "broker-res-r-1 ssh-ed25519 AAAA\n"
