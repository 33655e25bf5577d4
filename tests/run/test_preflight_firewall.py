"""Preflight: the host firewall layer named right (iptables, nftables, firewalld read as root), version skew,
disk and IPv6-only addresses, on recorded probe output (no network)."""

from __future__ import annotations

import os

from broker.run import preflight as pf
from broker.run import probe_script
from tests.run.test_preflight import OPEN, cluster, info, judge, probe, recipe

#: an OCI platform image's iptables (abridged): SSH and established traffic in, everything else REJECTed with
#: icmp-host-prohibited, which the prober sees as "No route to host" (UNREACHABLE)
OCI_IPTABLES = """-P INPUT ACCEPT
-P FORWARD ACCEPT
-P OUTPUT ACCEPT
-N InstanceServices
-A INPUT -m state --state RELATED,ESTABLISHED -j ACCEPT
-A INPUT -p icmp -j ACCEPT
-A INPUT -i lo -j ACCEPT
-A INPUT -p udp -m udp --sport 123 -j ACCEPT
-A INPUT -p tcp -m state --state NEW -m tcp --dport 22 -j ACCEPT
-A INPUT -j REJECT --reject-with icmp-host-prohibited
-A FORWARD -j REJECT --reject-with icmp-host-prohibited
-A OUTPUT -d 169.254.0.0/16 -j InstanceServices
"""

NFT_RULESET = """table inet filter {
	chain input {
		type filter hook input priority filter; policy drop;
		ct state established,related accept
		iif "lo" accept
		tcp dport 22 accept
	}
	chain forward {
		type filter hook forward priority filter; policy drop;
	}
	chain output {
		type filter hook output priority filter; policy accept;
	}
}
"""

FIREWALLD_LIST = """public (active)
  target: default
  icmp-block-inversion: no
  interfaces: ens3
  sources:
  services: dhcpv6-client ssh
  ports:
  protocols:
  forward: yes
"""

UNREACH = {**OPEN, (1, 0): [probe(29500, "UNREACHABLE"), probe(41000, "UNREACHABLE")]}
FILTERED = {**OPEN, (1, 0): [probe(29500, "FILTERED", 2.0), probe(41000, "FILTERED", 2.0)]}


def fw_info(i, *, iptables=None, nft=None, firewalld=None, as_root=True, ipt_err=None, nft_err=None, **kw):
    d = info(i, iptables=iptables, **kw)
    d["cidrs"] = {"ens3": [f"10.0.0.{i + 10}/24"]}
    d["firewall"] = {"as_root": as_root, "iptables": iptables, "iptables_error": ipt_err, "nft": nft,
                     "nft_error": nft_err, "firewalld": firewalld}
    return d


def the_fail(rep):
    (fail,) = [c for c in rep.checks if c.result == "FAIL"]
    return fail


def test_oci_reject_looks_unreachable_but_the_host_firewall_is_named_with_the_command():
    """The REJECT rule came after the route verdict; now the host rule is named first."""
    rep = judge([fw_info(0, iptables=OCI_IPTABLES), fw_info(1, iptables=OCI_IPTABLES)], UNREACH)
    fail = the_fail(rep)
    assert "host firewall (iptables node 0 INPUT: -A INPUT -j REJECT --reject-with icmp-host-prohibited)" \
        in fail.detail
    assert "not in one private network" not in fail.detail
    assert "`sudo iptables -I INPUT -s 10.0.0.0/24 -p tcp -j ACCEPT`" in fail.fix


def test_accept_for_the_port_or_the_source_before_the_reject_lets_the_cloud_rule_be_named():
    opened = OCI_IPTABLES.replace("-A INPUT -j REJECT", "-A INPUT -s 10.0.0.0/24 -j ACCEPT\n-A INPUT -j REJECT")
    rep = judge([fw_info(0, iptables=opened), fw_info(1, iptables=opened)], FILTERED)
    fail = the_fail(rep)
    assert "cloud security rule" in fail.detail and "host firewall (" not in fail.detail
    ported = OCI_IPTABLES.replace("--dport 22 -j ACCEPT", "--dport 22 -j ACCEPT\n-A INPUT -p tcp --dport "
                                  "29000:42000 -j ACCEPT")
    rep = judge([fw_info(0, iptables=ported), fw_info(1)], FILTERED)
    assert "cloud security rule" in the_fail(rep).detail


def test_nftables_drop_policy_is_named_with_an_nft_command():
    rep = judge([fw_info(0, nft=NFT_RULESET), fw_info(1)], FILTERED)
    fail = the_fail(rep)
    assert "host firewall (nftables node 0 table inet filter chain input: type filter hook input priority " \
           "filter; policy drop;)" in fail.detail
    assert "`sudo nft insert rule inet filter input ip saddr 10.0.0.0/24 meta l4proto tcp accept`" in fail.fix


def test_firewalld_zone_is_named_with_a_firewall_cmd_command():
    fwd = {"state": "running", "zone": "public", "list": FIREWALLD_LIST}
    rep = judge([fw_info(0, firewalld=fwd, nft=NFT_RULESET), fw_info(1)], UNREACH)
    fail = the_fail(rep)
    assert "host firewall (firewalld node 0: firewalld zone public opens only: services dhcpv6-client ssh" \
        in fail.detail
    assert "firewall-cmd --permanent --zone=trusted --add-source=10.0.0.0/24" in fail.fix
    opened = {"state": "running", "zone": "public", "list": FIREWALLD_LIST.replace("  ports:\n",
                                                                                   "  ports: 1-65535/tcp\n")}
    rep = judge([fw_info(0, firewalld=opened), fw_info(1)], FILTERED)
    assert "cloud security rule" in the_fail(rep).detail


def test_unreadable_rules_say_sudo_and_still_name_the_route_for_unreachable():
    err = "sudo: a password is required"
    rep = judge([fw_info(0, as_root=False, ipt_err=err, nft_err=err), fw_info(1)], UNREACH)
    fail = the_fail(rep)
    assert "not in one private network" in fail.detail and "`sudo -n` refused" in fail.detail
    rep = judge([fw_info(0, as_root=False, ipt_err=err, nft_err=err), fw_info(1)], FILTERED)
    assert "host firewall not readable" in the_fail(rep).detail


def test_host_rules_that_allow_name_the_cloud_security_rule():
    rep = judge([fw_info(0, iptables="-P INPUT ACCEPT\n-P OUTPUT ACCEPT\n"), fw_info(1)], FILTERED)
    fail = the_fail(rep)
    assert "cloud security rule" in fail.detail and "no DROP/REJECT iptables rule" in fail.detail


def test_python_and_nccl_skew():
    a, b = info(0), info(1)
    a.update(pyversion="3.12.3", nccl_version="2.28.9")
    b.update(pyversion="3.10.12", nccl_version="2.21.5")
    rep = judge([a, b], OPEN)
    fails = rep.failures()
    assert any(f.startswith("python (0,1): different Python versions: node 0: 3.12.3, node 1: 3.10.12") for f in fails)
    assert any(f.startswith("nccl (0,1): different NCCL versions: node 0: 2.28.9, node 1: 2.21.5") for f in fails)
    b.update(pyversion="3.12.1", nccl_version="2.28.9")
    rep = judge([a, b], OPEN)
    assert rep.ok and any(c.check == "python" and c.result == "WARN" for c in rep.checks)
    assert any(c.check == "nccl" and c.result == "PASS" for c in rep.checks)


def test_disk_against_disk_gib():
    def with_disk(i, free_gib, total_gib):
        d = info(i)
        d["disk"] = {"path": "/root", "free_bytes": int(free_gib * 2**30), "total_bytes": int(total_gib * 2**30)}
        return d

    rep = judge([with_disk(0, 80, 100), with_disk(1, 0.5, 100)], OPEN, rcp=recipe(disk_gib=100))
    assert rep.failures() == ["disk (1): 0.5 GiB free of 100.0 GiB at /root: not enough for a checkpoint or the "
                              "job's temporary files"]
    rep = judge([with_disk(0, 400, 500), with_disk(1, 400, 500)], OPEN, rcp=recipe(disk_gib=600))
    assert len(rep.failures()) == 2 and "asks for disk_gib 600" in rep.failures()[0]
    rep = judge([with_disk(0, 10, 100), with_disk(1, 90, 100)], OPEN, rcp=recipe(disk_gib=100))
    assert rep.ok and [c.result for c in rep.checks if c.check == "disk"] == ["WARN", "PASS"]


def test_ipv6_only_private_address_is_named_as_such():
    cl = cluster()
    cl.nodes[1].private_ip = "fd00:10::11"
    b = info(1)
    b["private_iface"] = None
    b["ifaces"]["ens3"]["addrs"] = []
    b["ifaces6"] = {"ens3": ["fd00:10::11"]}
    rep = judge([info(0), b], OPEN, cl=cl)
    f = [x for x in rep.failures() if x.startswith("interface (1)")][0]
    assert "private address fd00:10::11 is IPv6-only (on ens3 of node 1" in f


def test_probe_reads_rules_through_sudo_n_when_not_root(monkeypatch):
    calls = []
    monkeypatch.setattr(probe_script.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(probe_script, "_tool", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(probe_script, "_run", lambda argv, timeout=5.0: (calls.append(argv) or
                                                                        (1, "sudo: a password is required")))
    fw = probe_script.firewall()
    assert ["sudo", "-n", "/usr/sbin/iptables", "-S"] in calls and ["sudo", "-n", "/usr/sbin/nft", "list",
                                                                     "ruleset"] in calls
    assert fw["iptables"] is None and fw["iptables_error"] == "sudo: a password is required" and not fw["as_root"]
    monkeypatch.setattr(probe_script.os, "geteuid", lambda: 0)
    calls.clear()
    probe_script.firewall()
    assert ["/usr/sbin/iptables", "-S"] in calls


def test_probe_info_reports_disk_python_and_ipv6(tmp_path):
    d = probe_script.info("127.0.0.1", str(tmp_path / "not" / "yet"))
    assert d["disk"]["path"] == str(tmp_path) and d["disk"]["free_bytes"] > 0
    assert d["pyversion"].count(".") == 2 and "ifaces6" in d and "firewall" in d
    assert os.geteuid() != 0 or d["firewall"]["as_root"]


def test_a_rule_bound_to_another_interface_does_not_open_this_one():
    """`-i wg0 -j ACCEPT` opens the tunnel, not eth0 (it was read as accepting everything, and a REJECT after it
    went unnamed: "no DROP/REJECT iptables rule")."""
    rules = OCI_IPTABLES.replace("-A INPUT -j REJECT", "-A INPUT -i wg0 -j ACCEPT\n-A INPUT -j REJECT")
    assert pf.iptables_verdict(rules, "INPUT", 40000, "10.0.0.10", "ens3")[0] == "REJECT"
    assert pf.iptables_verdict(rules, "INPUT", 40000, "10.0.0.10", None)[0] == "REJECT"
    assert pf.iptables_verdict(rules, "INPUT", 40000, "10.0.0.10", "wg0") == ("ACCEPT", "-A INPUT -i wg0 -j ACCEPT")
    assert pf.iptables_verdict(rules.replace("-i wg0", "! -i ens3"), "INPUT", 1, None, "wg0")[0] == "ACCEPT"
    cause, fix = pf._cause("UNREACHABLE", 0, 1, {1: fw_info(1, iptables=rules)}, 40000, {0: "10.0.0.10"},
                           {1: "ens3"})
    assert "host firewall (iptables node 1 INPUT: -A INPUT -j REJECT --reject-with icmp-host-prohibited)" in cause


def test_inside_a_tunnel_a_drop_is_the_hosts_firewall_not_a_cloud_security_rule():
    """Cloud security rules see only WireGuard's UDP (the handshake passed): a probe dropped inside the tunnel is
    pointed at the node's host firewall on the tunnel interface, with the command that opens it."""
    allow = "-P INPUT ACCEPT\n-P OUTPUT ACCEPT\n"
    cause, fix = pf._cause("FILTERED", 0, 1, {1: fw_info(1, iptables=allow)}, 40000, {0: "198.18.9.1"},
                           {0: "bkwgabc", 1: "wg0"}, tunnel=True)
    assert "inside the tunnel: node 1's host firewall on wg0" in cause and "security list" not in cause
    assert "`sudo iptables -I INPUT -i wg0 -j ACCEPT`" in fix
    err = "sudo: a password is required"
    cause, _ = pf._cause("FILTERED", 0, 1, {1: fw_info(1, as_root=False, ipt_err=err, nft_err=err)}, 40000,
                         {}, {1: "wg0"}, tunnel=True)
    assert "could not be read" in cause and "passwordless sudo" in cause
