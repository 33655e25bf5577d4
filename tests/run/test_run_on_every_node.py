"""``broker.run.sshcluster.run_on_every_node`` (what ``broker exec`` runs for kept nodes and for Slurm clusters):
``[node i]`` prefixes, ``exit N`` after a failure, a node not reached, a command that outlives its time, and the
worst exit status.  Node 0 is this machine (``ClusterNode.local``: commands run as local processes); node 1 is an
SSH endpoint on a loopback port nothing listens on."""

from __future__ import annotations

import socket
import sys

from broker.core.model import TopologyKind
from broker.core.records import Cluster, ClusterNode
from broker.run.sshcluster import run_on_every_node


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is: nothing listens there


def _cluster(tmp_path, *, unreachable: bool) -> Cluster:
    nodes = [ClusterNode(node_rank=0, host="127.0.0.1", private_ip="127.0.0.1", local=True)]
    if unreachable:
        nodes.append(ClusterNode(node_rank=1, host="127.0.0.1", port=_closed_port(), private_ip="127.0.0.1"))
    return Cluster(run_id="r-exec", provider="netns", topology=TopologyKind.hybrid, python=sys.executable,
                   workroot=str(tmp_path / "root"), nodes=nodes,
                   known_hosts_path=str(tmp_path / "known_hosts"))


def test_prefixes_each_line_and_returns_the_worst_status(tmp_path):
    said: list[str] = []
    code = run_on_every_node(_cluster(tmp_path, unreachable=True), "echo one; echo two; exit 3", run_dir=tmp_path,
                             echo=said.append, timeout_s=20)
    assert said[:3] == ["[node 0] one", "[node 0] two", "[node 0] exit 3"]
    assert len(said) == 4 and said[3].startswith("[node 1] cannot run it: ")
    assert code == 255  # the node not reached outranks node 0's 3


def test_a_clean_run_says_no_exit_line(tmp_path):
    said: list[str] = []
    assert run_on_every_node(_cluster(tmp_path, unreachable=False), "echo ok", run_dir=tmp_path, echo=said.append,
                             timeout_s=20) == 0
    assert said == ["[node 0] ok"]


def test_a_command_that_outlives_its_time_counts_as_255(tmp_path):
    """It raised TypeError (max of 0 and None): the exit status of a timed-out command is None."""
    said: list[str] = []
    code = run_on_every_node(_cluster(tmp_path, unreachable=False), "sleep 30", run_dir=tmp_path,
                             echo=said.append, timeout_s=0.5)
    assert code == 255
    assert said[-1] == "[node 0] no exit status after 0.5 s"
