"""Preflight judging on recorded probe results (no network): causes, fixes and the table."""

from __future__ import annotations

from types import SimpleNamespace

from broker.run import preflight as pf
from broker.core.model import TopologyKind
from broker.core.records import Cluster, ClusterNode
from broker.core.recipe import Recipe


def cluster(n=2, env=None):
    return Cluster(run_id="r", provider="oci", topology=TopologyKind.multi_node,
                   nodes=[ClusterNode(node_rank=i, host=f"203.0.113.{i + 1}", private_ip=f"10.0.0.{i + 10}",
                                      env=env or {}) for i in range(n)])


def recipe(**kw):
    base = dict(name="t", script="x.py", workdir=".", nodes=2, gpus_per_node=1)
    base.update(kw)
    return Recipe.model_validate(base)


def info(i, *, torch="2.13.0", gpus=1, mtu=1500, iptables="-P INPUT ACCEPT\n-P OUTPUT ACCEPT\n", iface="ens3"):
    return {"torch": torch, "cuda": gpus > 0, "gpus": gpus, "gpu_names": ["NVIDIA A10"] * gpus,
            "ifaces": {"lo": {"addrs": ["127.0.0.1"], "mtu": 65536}, iface: {"addrs": [f"10.0.0.{i + 10}"],
                                                                              "mtu": mtu}},
            "private_iface": iface, "iptables": iptables}


def probe(port, state, secs=0.003):
    return {"host": "x", "port": port, "state": state, "detail": "", "seconds": secs}


def judge(infos, pairs, *, rcp=None, cl=None, lerr=None):
    ssh = SimpleNamespace(cluster=cl or cluster(len(infos)))
    return pf._judge(ssh, rcp or recipe(), 29500, infos, (pairs, lerr or {}))


OPEN = {(1, 0): [probe(29500, "OPEN"), probe(41000, "OPEN")], (0, 1): [probe(42000, "OPEN")]}


def test_all_good_passes_and_reports_interfaces():
    rep = judge([info(0), info(1)], OPEN)
    assert rep.ok and rep.ifaces == {0: "ens3", 1: "ens3"}
    text = "\n".join(pf.render_text(rep))
    assert "torch 2.13.0 on every node" in text and "master port 29500 OPEN" in text
    assert "preflight PASSED" in text


def test_filtered_without_host_rules_blames_cloud_security_rule():
    pairs = dict(OPEN)
    pairs[(1, 0)] = [probe(29500, "OPEN"), probe(41000, "FILTERED", 2.0)]  # only the master port was opened
    rep = judge([info(0), info(1)], pairs)
    (fail,) = [c for c in rep.checks if c.result == "FAIL"]
    assert fail.check == "tcp 1->0" and "ephemeral port 41000 FILTERED" in fail.detail
    assert "cloud security rule" in fail.detail and "no DROP/REJECT iptables rule" in fail.detail
    assert "ingress rule for all TCP" in fail.fix


def test_filtered_with_host_drop_rule_blames_host_firewall():
    ipt = "-P INPUT ACCEPT\n-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT\n-A INPUT -p tcp -j DROP\n"
    pairs = dict(OPEN)
    pairs[(1, 0)] = [probe(29500, "FILTERED", 2.0), probe(41000, "FILTERED", 2.0)]
    rep = judge([info(0, iptables=ipt), info(1)], pairs)
    (fail,) = [c for c in rep.checks if c.result == "FAIL"]
    assert "host firewall (iptables node 0 INPUT: -A INPUT -p tcp -j DROP)" in fail.detail
    assert "iptables -I INPUT" in fail.fix


def test_drop_policy_and_reject_count_as_host_firewall():
    rep = judge([info(0, iptables="-P INPUT DROP\n-A INPUT -p tcp --dport 22 -j ACCEPT\n"), info(1)],
                {**OPEN, (1, 0): [probe(29500, "FILTERED", 2.0), probe(41000, "FILTERED", 2.0)]})
    assert "host firewall" in rep.failures()[0] and "-P INPUT DROP" in rep.failures()[0]
    rep = judge([info(0), info(1, iptables="-A OUTPUT -p tcp -j REJECT --reject-with tcp-reset\n")],
                {**OPEN, (1, 0): [probe(29500, "REFUSED"), probe(41000, "REFUSED")]})
    assert "node 1 OUTPUT" in rep.failures()[0]


def test_unreachable_names_the_network():
    rep = judge([info(0), info(1)], {**OPEN, (1, 0): [probe(29500, "UNREACHABLE"), probe(41000, "UNREACHABLE")]})
    assert "not in one private network" in rep.failures()[0]


def test_torch_missing_and_version_mismatch():
    i1 = info(1)
    del i1["torch"]
    i1["torch_error"] = "ModuleNotFoundError: No module named 'torch'"
    rep = judge([info(0), i1], OPEN)
    assert any("No module named 'torch'" in f for f in rep.failures())
    rep = judge([info(0), info(1, torch="2.4.0")], OPEN)
    assert any("different torch versions: node 0: 2.13.0, node 1: 2.4.0" in f for f in rep.failures())


def test_cuda_counts_against_processes_per_node_and_cpu_ok():
    rep = judge([info(0, gpus=0), info(1, gpus=0)], OPEN)
    assert any("nccl needs CUDA" in f for f in rep.failures())
    rep = judge([info(0, gpus=0), info(1, gpus=0)], OPEN, rcp=recipe(cpu_ok=True))
    assert rep.ok and [c.result for c in rep.checks if c.check == "cuda"] == ["WARN", "WARN"]
    rep = judge([info(0, gpus=1), info(1, gpus=4)], OPEN, rcp=recipe(gpus_per_node=2))
    assert [f for f in rep.failures() if f.startswith("cuda (0)")] and not [
        f for f in rep.failures() if f.startswith("cuda (1)")]


def test_interface_forced_wrong_or_missing_and_private_ip_not_local():
    cl = cluster(env={"NCCL_SOCKET_IFNAME": "eth9"})
    rep = judge([info(0), info(1)], OPEN, cl=cl)
    fails = [c for c in rep.checks if c.result == "FAIL"]
    assert len(fails) == 2 and "eth9 does not exist" in fails[0].detail
    assert fails[0].fix == "unset NCCL_SOCKET_IFNAME or set NCCL_SOCKET_IFNAME=ens3"
    rep = judge([info(0), info(1)], OPEN, rcp=recipe(env={"GLOO_SOCKET_IFNAME": "^docker0"}))
    assert any("exclusion list" in f for f in rep.failures())
    i1 = info(1)
    i1["private_iface"] = None
    rep = judge([info(0), i1], OPEN)
    assert any("10.0.0.11 is on no interface of node 1" in f for f in rep.failures())


def test_mtu_mismatch_fails():
    rep = judge([info(0, mtu=9000), info(1, mtu=1500)], OPEN)
    assert rep.failures() == ["mtu (0,1): MTU differs: node 0 ens3=9000, node 1 ens3=1500 (large frames are "
                              "dropped: the job hangs mid-training)"]


def test_listener_port_in_use_and_probe_errors():
    rep = judge([info(0), info(1)], {(0, 1): [probe(42000, "OPEN")]},
                lerr={0: "cannot listen on port 29500: Address already in use"})
    (fail,) = [c for c in rep.checks if c.result == "FAIL"]
    assert fail.check == "tcp listen" and "another --port" in fail.fix
    rep = judge([RuntimeError("probe info failed on node 1"), info(0)][::-1], OPEN)
    assert any(c.check == "ssh" and c.result == "FAIL" for c in rep.checks)


def test_table_renders_with_rich():
    from rich.console import Console

    from tests.support.preflight_table import render_table

    rep = judge([info(0), info(1)], OPEN)
    con = Console(record=True, width=200)
    con.print(render_table(rep))
    assert "preflight: PASSED" in con.export_text()


def test_only_master_port_busy_is_recognised():
    rep = judge([info(0), info(1)], {(0, 1): [probe(42000, "OPEN")]},
                lerr={0: "cannot listen on port 29500: Address already in use"})
    assert rep.only_master_port_busy(29500) and not rep.only_master_port_busy(29501)
    assert not judge([info(0, mtu=1), info(1)], OPEN).only_master_port_busy(29500)
