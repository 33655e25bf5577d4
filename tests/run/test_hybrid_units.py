"""The hybrid topology without namespaces: keys and configs, cloud-init and security rules for the WireGuard port,
the planner (VMs only priced; Vast rejected with its reason), the run command's refusals, the tailscale mesh
against a stand-in `tailscale` command."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from broker.run import hybrid

from broker.run import wireguard as wg
from broker.core.model import Offer, Requirements, TopologyKind, utcnow
from broker.plan.planner import plan

ROOT = Path(__file__).resolve().parents[2]


def _tunnel(n: int = 2) -> wg.Tunnel:
    return wg.make_tunnel(n, "198.18.77.0/24", {i: f"203.0.113.{i}:{51820 + i - 1}" for i in range(1, n)})


# --------------------------------------------------------------------------------------------------- keys, configs
def test_keys_are_x25519_and_match_wg_pubkey():
    priv, pub = wg.genkey()
    assert len(base64.b64decode(priv)) == 32 and len(base64.b64decode(pub)) == 32
    assert wg.pubkey(priv) == pub
    assert wg.genkey()[0] != priv  # fresh per call
    if subprocess.run(["which", "wg"], capture_output=True).returncode == 0:
        out = subprocess.run(["wg", "pubkey"], input=priv, capture_output=True, text=True).stdout.strip()
        assert out == pub


def test_configs_home_dials_out_with_keepalive_and_files_are_0600(tmp_path):
    t = _tunnel(3)
    home = t.conf(0)
    assert "ListenPort" not in home  # behind NAT: no fixed port
    assert home.count("PersistentKeepalive = 25") == 2
    assert "Endpoint = 203.0.113.1:51820" in home and "Endpoint = 203.0.113.2:51821" in home
    vm1 = t.conf(1, inner_endpoints={2: "10.0.0.12:51821"})
    assert "ListenPort = 51820" in vm1 and "PersistentKeepalive" not in vm1
    assert f"PublicKey = {t.peers[0].public_key}" in vm1
    assert "Endpoint = 10.0.0.12:51821" in vm1  # VMs reach each other on their private network
    assert vm1.split("[Peer]")[1].count("Endpoint") == 0  # home has no endpoint: learned from its handshake
    assert t.peers[0].address == "198.18.77.1" and t.peers[2].address == "198.18.77.3"
    paths = wg.write_confs(t, tmp_path / "wg")
    assert stat.S_IMODE((tmp_path / "wg").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in paths)
    assert t.peers[1].private_key in paths[1].read_text()
    assert t.peers[1].private_key not in repr(t)  # never in reprs (logs, ledger)
    assert wg.forget(tmp_path / "wg") and not (tmp_path / "wg").exists()
    assert not wg.forget(tmp_path / "wg")


# --------------------------------------------------------------------------------------------------- cloud side
def test_cloud_init_installs_wireguard_and_writes_the_vm_config():
    t = _tunnel(2)
    text = wg.cloud_init(t, 1)
    assert text.startswith("#cloud-config\n")
    doc = yaml.safe_load(text)
    assert "wireguard-tools" in doc["packages"]
    f = doc["write_files"][0]
    assert f["path"] == "/etc/wireguard/wg0.conf" and f["permissions"] == "0600"
    conf = f["content"]
    assert f"PrivateKey = {t.peers[1].private_key}" in conf
    assert "Address = 198.18.77.2/24" in conf and "MTU = 1420" in conf and "ListenPort = 51820" in conf
    assert f"PublicKey = {t.peers[0].public_key}" in conf
    cmds = [" ".join(c) if isinstance(c, list) else c for c in doc["runcmd"]]
    assert any("--dport 51820" in c and "udp" in c for c in cmds)
    assert any("wg-quick@wg0" in c for c in cmds)
    with pytest.raises(ValueError):
        wg.cloud_init(t, 0)
    script = wg.user_data_script(t, 1)
    assert "wg-quick" in script and "umask 077" in script and t.peers[1].private_key in script
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0


def test_security_rules_open_only_the_wireguard_port_scoped_to_the_caller():
    t = _tunnel(3)
    rules = wg.security_rules(t, "203.0.113.9")
    assert rules["aws"] == [
        {"IpProtocol": "udp", "FromPort": 51820, "ToPort": 51820,
         "IpRanges": [{"CidrIp": "203.0.113.9/32", "Description": "broker hybrid: WireGuard from this machine"}]},
        {"IpProtocol": "udp", "FromPort": 51821, "ToPort": 51821,
         "IpRanges": [{"CidrIp": "203.0.113.9/32", "Description": "broker hybrid: WireGuard from this machine"}]}]
    oci = rules["oci"][0]
    assert oci["protocol"] == "17" and oci["source"] == "203.0.113.9/32"
    assert oci["udp_options"] == {"destination_port_range": {"min": 51820, "max": 51820}}
    assert "tcp_options" not in oci
    unknown = wg.security_rules(t, None)
    assert unknown["aws"][0]["IpRanges"][0]["CidrIp"] == "0.0.0.0/0"
    assert "unknown" in unknown["oci"][0]["description"]
    v6 = wg.aws_ingress(51820, "2001:db8::1")
    assert v6["Ipv6Ranges"][0]["CidrIpv6"] == "2001:db8::1/128"


# --------------------------------------------------------------------------------------------------- planner
def _offer(provider: str, usd: float, gpus: int = 1, itype: str = "vm.gpu") -> Offer:
    return Offer(provider=provider, offer_id=f"{provider}-{itype}", instance_type=itype, gpu_name="A10",
                 gpu_count=gpus, gpu_mem_gib=24, vcpus=8, usd_per_hour=usd, private_network=provider != "vast",
                 price_source="test", price_time=utcnow(), region="r1")


def test_planner_prices_hybrid_as_the_vms_only_and_rejects_vast_with_its_reason():
    req = Requirements(nodes=2, gpus_per_node=1, hours=1.0, budget_usd=50, topology="hybrid")
    offers = [_offer("vast", 0.20), _offer("aws", 1.00), _offer("oci", 2.00)]
    p = plan(req, offers)
    assert [o.provider for o in p.options] == ["aws", "oci"]
    best = p.options[0]
    assert best.topology is TopologyKind.hybrid and len(best.offers) == 1  # one VM: node 0 is this machine
    assert best.usd_per_hour == pytest.approx(1.00, abs=0.01)
    assert "this machine + 1 x vm.gpu" in best.summary  # VMs counted as the plan table does
    vast = [o for o in p.rejected if o.provider == "vast"]
    assert vast and "/dev/net/tun" in vast[0].rejected[0] and "vast containers have none" in vast[0].rejected[0]
    assert any("priced as the VMs only" in n for n in p.notes)
    # the same job as multi-node rents both nodes: hybrid halves the rented cost
    multi = plan(replace(req, topology="multi-node"), offers)
    assert multi.options[0].usd_per_hour == pytest.approx(2 * best.usd_per_hour, rel=0.01)
    # 3 nodes: two VMs
    p3 = plan(replace(req, nodes=3), offers)
    assert len(p3.options[0].offers) == 2
    # "any" never picks hybrid on its own (it uses this machine: opt-in), it names the cheapest in a note
    anyp = plan(replace(req, topology="any"), offers)
    assert all(o.topology is not TopologyKind.hybrid for o in anyp.options + anyp.rejected)
    also = [n for n in anyp.notes if n.startswith("also possible: hybrid")]
    assert len(also) == 1 and "1 x vm.gpu" in also[0] and "on aws" in also[0] and "--topology hybrid" in also[0]


def test_hybrid_needs_this_machine_to_be_a_valid_node_0():
    """Node 0 is this machine: a GPU job without a GPU here is no hybrid option (cpu_ok makes it gloo on CPU);
    too little GPU memory here is named; memory unknown (driver listing only) is not held against it."""
    req = Requirements(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16, hours=1.0, budget_usd=50, topology="hybrid")
    offers = [_offer("aws", 1.00)]
    none = plan(req, offers, here=(0, 0.0))
    assert not none.options and "node 0 is this machine, which has no GPU" in none.rejected[0].rejected[0]
    assert "cpu_ok" in none.rejected[0].rejected[0]
    assert plan(replace(req, cpu_ok=True), offers, here=(0, 0.0)).options
    small = plan(req, offers, here=(1, 8.0))
    assert not small.options and "GPU memory 8 GiB < 16 GiB" in small.rejected[0].rejected[0]
    assert plan(req, offers, here=(1, 24.0)).options and plan(req, offers, here=(1, 0.0)).options
    two = replace(req, gpus_per_node=2)
    assert "1 GPU(s) < 2 per node" in plan(two, [_offer("aws", 1.00, gpus=2)], here=(1, 24.0)).rejected[0].rejected[0]
    # under "any" an invalid node 0 just means no hybrid note, and nothing hybrid in the rejected table
    anyp = plan(replace(req, topology="any"), offers, here=(0, 0.0))
    assert not [n for n in anyp.notes if n.startswith("also possible")]
    assert all(o.topology is not TopologyKind.hybrid for o in anyp.rejected)


def test_plan_cli_shows_hybrid_beside_the_others(tmp_path):
    env = dict(os.environ, BROKER_HOME=str(tmp_path / "home"), PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-m", "broker", "plan", "--nodes", "2", "--topology", "hybrid", "--json",
                        "--provider", "vast", "--provider", "aws", "--provider", "oci", "--cpu-ok"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 3), p.stdout + p.stderr
    import json

    top = json.loads(p.stdout)
    # the cloud side is launched: the next step runs the chosen hybrid option itself, not the emulation
    chosen = top["plan"]["options"][0]["provider"]
    assert f"--provider {chosen} --topology hybrid" in top["next_step"], top["next_step"]
    assert "netns" not in top["next_step"] and "not wired" not in top["next_step"]
    d = top["plan"]
    topos = {o["topology"] for o in d["options"]}
    assert topos <= {"hybrid"} and d["options"], d["options"][:2]
    assert any(o["provider"] == "vast" and "/dev/net/tun" in o["rejected"][0] for o in d["rejected"])


# --------------------------------------------------------------------------------------------------- run refusals
def test_run_hybrid_on_vast_is_refused_with_the_reason(tmp_path):
    from broker.run.pipeline import RunRequest, choose_target
    from broker.core.provider import BadInput, NoValidPlan
    from broker.core.recipe import load_recipe

    r = tmp_path / "r.yaml"
    (tmp_path / "j.py").write_text("print(1)\n")
    r.write_text("name: h\nscript: j.py\nnodes: 2\ncpu_ok: true\ntopology: hybrid\n")
    rec = load_recipe(r)
    with pytest.raises(NoValidPlan, match="/dev/net/tun"):
        choose_target(rec, RunRequest(provider="vast"))
    with pytest.raises(BadInput, match="does not apply"):
        choose_target(rec, RunRequest(provider="local"))
    with pytest.raises(BadInput, match="mesh"):
        choose_target(rec, RunRequest(provider="netns", mesh="zerotier"))
    t = choose_target(rec, RunRequest(provider="netns"))
    assert t.topology == "hybrid"


# --------------------------------------------------------------------------------------------------- tailscale
def _stand_in(tmp_path: Path, state: str = "Running") -> Path:
    exe = tmp_path / "tailscale"
    log = tmp_path / "tailscale.log"
    exe.write_text(f"""#!/bin/sh
echo "$@" >> {log}
case "$1" in
  status) echo '{{"BackendState": "{state}"}}';;
  ip) echo 100.101.102.103;;
  up) exit 0;;
esac
""")
    exe.chmod(0o755)
    return exe


def test_tailscale_mesh_with_a_stand_in_command(tmp_path, monkeypatch):
    exe = _stand_in(tmp_path)
    monkeypatch.delenv("TS_AUTHKEY", raising=False)
    with pytest.raises(hybrid.BadInput, match="TS_AUTHKEY"):
        hybrid.tailscale_plan(2, "run1", env_file=tmp_path / "none", exe=str(exe))
    (tmp_path / ".env").write_text("# keys\nexport TS_AUTHKEY='tskey-auth-abc'\n")
    got = hybrid.tailscale_plan(2, "run1", env_file=tmp_path / ".env", exe=str(exe))
    assert got["master_addr"] == "100.101.102.103" and got["iface"] == "tailscale0"
    assert got["env"]["GLOO_SOCKET_IFNAME"] == "tailscale0" and got["env"]["NCCL_IB_DISABLE"] == "1"
    boot = got["vm_boot"][1]
    assert "tailscale up --authkey=tskey-auth-abc --hostname=broker-run1-node1" in boot
    assert subprocess.run(["sh", "-n"], input=boot, text=True).returncode == 0
    # the VM's command line runs against the stand-in exactly as written
    argv = hybrid.tailscale_up_argv("tskey-auth-abc", "n1", exe=str(exe))
    assert subprocess.run(argv).returncode == 0
    assert "up --authkey=tskey-auth-abc --hostname=n1" in (tmp_path / "tailscale.log").read_text()
    monkeypatch.setenv("TS_AUTHKEY", "tskey-env")
    assert hybrid.tailscale_authkey(tmp_path / ".env") == "tskey-env"  # the environment wins


def test_tailscale_not_running_here_is_named(tmp_path, monkeypatch):
    exe = _stand_in(tmp_path, state="NeedsLogin")
    monkeypatch.setenv("TS_AUTHKEY", "tskey-x")
    with pytest.raises(hybrid.ProviderError, match="not on a tailnet"):
        hybrid.tailscale_plan(2, "r", exe=str(exe))


# --------------------------------------------------------------------------------------------------- tunnel preflight
def _cluster():
    from broker.core.records import Cluster, ClusterNode

    nodes = [ClusterNode(node_rank=i, host=f"10.0.0.{i}", private_ip=f"198.18.5.{i + 1}",
                         env=hybrid.tunnel_env(f"wgabc{i}")) for i in range(2)]
    return Cluster(run_id="r", provider="netns", topology=TopologyKind.hybrid, nodes=nodes, python="python3")


class _Nodes:
    """Stands in for SSHCluster.run: answers `wg show` and the MTU read per node."""

    KEY = "x" * 42 + "Q="  # the shape of a WireGuard public key (32 bytes, base64)

    def __init__(self, handshake: int, mtu1: str = "1420", wg: dict[int, tuple[int, str]] | None = None):
        self.handshake, self.mtu1, self.cmds, self.wg = handshake, mtu1, [], wg or {}

    def __call__(self, i, cmd, timeout=60.0):
        self.cmds.append((i, cmd))
        if cmd.startswith("wg ") and i in self.wg:
            return self.wg[i]
        if "public-key" in cmd:
            return 0, self.KEY + "\n"
        if "latest-handshakes" in cmd:
            return 0, f"{self.KEY}\t{self.handshake}\n"
        if "/mtu" in cmd:
            return 0, ("1420" if i == 0 else self.mtu1) + "\n"
        return 0, ""


def test_tunnel_preflight_passes_with_a_handshake_and_the_tunnel_mtu():
    nodes = _Nodes(handshake=1764500000)
    rows = hybrid.handshake_check(nodes, _cluster(), {1: 51820}, 1420, wait_s=1)
    assert [(r.check, r.result) for r in rows] == [("tunnel", "PASS"), ("tunnel mtu", "PASS"), ("tunnel mtu", "PASS")]
    assert any(i == 0 and "sendto" in c for i, c in nodes.cmds)  # node 0 sends through the tunnel first
    assert any(i == 0 and "wg show wgabc0 latest-handshakes" in c for i, c in nodes.cmds)


def test_tunnel_preflight_names_a_blocked_udp_port_and_a_wrong_mtu():
    import time

    t0 = time.monotonic()
    rows = hybrid.handshake_check(_Nodes(handshake=0, mtu1="1500"), _cluster(), {1: 51820}, 1420, wait_s=1)
    assert time.monotonic() - t0 < 5
    tun = next(r for r in rows if r.check == "tunnel")
    assert tun.result == "FAIL" and "UDP port 51820 is blocked" in tun.detail and "open UDP 51820" in tun.fix
    mtu = [r for r in rows if r.check == "tunnel mtu"]
    assert mtu[0].result == "PASS" and mtu[1].result == "FAIL" and "wgabc1 MTU 1500" in mtu[1].detail
    assert "ip link set dev wgabc1 mtu 1420" in mtu[1].fix


def test_tunnel_preflight_names_a_node_where_wg_cannot_run_not_a_blocked_port():
    """Seen on the 2x H200 device: `wg` was not on the SSH session's PATH of the nodes, `wg show` printed an error
    and preflight blamed a blocked UDP port.  A failed `wg show` is its own FAIL, naming the command and its output."""
    import time

    for who, answer in ((1, (127, "bash: line 1: wg: command not found")),
                        (0, (1, "Unable to access interface: No such file or directory"))):
        t0 = time.monotonic()
        rows = hybrid.handshake_check(_Nodes(handshake=1764500000, wg={who: answer}), _cluster(), {1: 51820}, 1420,
                                      wait_s=3)
        assert time.monotonic() - t0 < 3  # no point waiting for a handshake nobody can read
        tun = next(r for r in rows if r.check == "tunnel")
        assert tun.result == "FAIL" and "blocked" not in tun.detail, tun.detail
        assert f"on node {who}: exit {answer[0]}: {answer[1]}" in tun.detail and "wireguard-tools" in tun.fix


@pytest.mark.netns
def test_emulated_hybrid_nodes_keep_their_gpus_and_host_ids(tmp_path):
    """On a GPU machine the emulated hybrid run gives each namespace its own GPU and NCCL_HOSTID (as ``--provider
    netns`` does), so NCCL uses sockets over the tunnel; the tunnel interface is in every node's env."""
    from broker.run.hybrid import EmulatedTunnel, emulated_cluster
    from broker.providers.netns import NetnsCluster

    c = NetnsCluster(cid="bkn0a1b2c", root=tmp_path, subnet=7, n=2, gpus_per_node=1)
    t = EmulatedTunnel(cid=c.cid, keys=tmp_path / "wg", ifaces=["wg0a1b2c0", "wg0a1b2c1"],
                       addresses=["198.18.9.1", "198.18.9.2"], mtu=1420, how="wireguard-go", endpoints={})
    cl = emulated_cluster(c, t, "r-1")
    assert [n.gpu_indices for n in cl.nodes] == [["0"], ["1"]]
    assert [n.env["NCCL_HOSTID"] for n in cl.nodes] == ["bkn0a1b2c-node0", "bkn0a1b2c-node1"]
    assert [n.env["NCCL_SOCKET_IFNAME"] for n in cl.nodes] == t.ifaces
    assert [n.private_ip for n in cl.nodes] == t.addresses
    cpu = emulated_cluster(NetnsCluster(cid="bkn0a1b2c", root=tmp_path, subnet=7, n=2), t, "r-1")
    assert [n.gpu_indices for n in cpu.nodes] == [None, None] and "NCCL_HOSTID" not in cpu.nodes[0].env


def test_cloud_side_of_a_hybrid_run_is_named_in_words():
    """The emulated hybrid run said `cloud: nodes 1-1` for one VM."""
    from broker.run.targets import cloud_nodes

    assert cloud_nodes(2) == "node 1"
    assert cloud_nodes(4) == "nodes 1-3"


def test_passing_tunnel_checks_are_rows_of_the_one_preflight_table(tmp_path, monkeypatch):
    """A passing hybrid run printed its tunnel checks as `[preflight] PASS tunnel ...` lines above the table's
    header; they are now the first rows of the same table (screen, preflight.txt and preflight.json alike)."""
    from types import SimpleNamespace

    from broker.run import preflight as pf
    cluster = _cluster()
    recipe = SimpleNamespace(nodes=2, name="j", max_hours=0.1)
    tunnel = [pf.Check("tunnel", "0<->1", "PASS", "WireGuard handshake between node 0 and node 1"),
              pf.Check("tunnel mtu", "0", "PASS", "wg0 MTU 1420 (the tunnel's)")]
    monkeypatch.setattr(hybrid, "handshake_check", lambda *a, **k: list(tunnel))
    monkeypatch.setattr(pf, "run_preflight", lambda *a, **k: pf.PreflightReport(
        checks=[pf.Check("tcp listen", "0", "PASS", "node 0 listens")], wall_s=0.1))
    said: list[str] = []
    ex = hybrid.make_executor(cluster, recipe, tmp_path, ports={0: 51820, 1: 51820}, mtu=1420, echo=said.append,
                              port=29500)
    assert ex.preflight() is None
    lines = [ln for ln in said if ln.startswith("[preflight]")]
    assert lines[0].split()[1:3] == ["check", "node(s)"], said  # the header first, then every row
    assert not any(ln.startswith("[preflight] PASS") for ln in lines), said
    body = [ln.split()[1] for ln in lines[1:-1]]
    assert body == ["tunnel", "tunnel", "tcp"], said
    text = (tmp_path / "preflight.txt").read_text().splitlines()
    assert [ln.split()[0] for ln in text[1:-1]] == ["tunnel", "tunnel", "tcp"], text
