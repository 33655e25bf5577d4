"""The cloud side of the hybrid topology without namespaces: what the AWS adapter really sends for a hybrid run (moto in server
mode: the instance's user data carries node 1's WireGuard config, the security group gets the UDP port only, from
the caller's /32), how many VMs a hybrid option rents, the neutral ingress rules, and the plan step's targets."""

from __future__ import annotations

import base64
import ipaddress
from datetime import timedelta
from pathlib import Path

import pytest

from broker.money.ledger import Ledger
from broker.core.model import Requirements, utcnow
from broker.core.records import Run
from broker.plan.planner import plan
from broker.core.provider import NoValidPlan
from tests.providers.aws.test_aws_moto import ec2, env, image_id, moto_url, offer, prov  # noqa: F401 - fixtures

pytest.importorskip("moto")


def _run(tmp_path: Path, run_id: str = "20261130-120000-abc123") -> Run:
    now = utcnow()
    run = Run(id=run_id, name="t", provider="aws", topology="hybrid", status="provisioning", created_at=now,
              deadline=now + timedelta(hours=1), run_dir=str(tmp_path / "runs" / run_id))
    Path(run.run_dir).mkdir(parents=True)
    return Ledger().create_run(run)


def test_aws_hybrid_provision_user_data_and_udp_ingress_from_the_caller(prov, ec2, tmp_path):  # noqa: F811
    from broker.run import hybrid
    from broker.money.provision import provision
    from broker.money.teardown import teardown_run

    req = Requirements(nodes=3, gpus_per_node=1, hours=1.0, budget_usd=50, topology="hybrid")
    opts = [o for o in plan(req, [offer()]).options if o.valid and o.topology.value == "hybrid"]
    assert opts and len(opts[0].offers) == 2  # 3 nodes: this machine + 2 VMs
    run = _run(tmp_path)
    mesh = hybrid.wireguard_mesh(3, run.id, Path(run.run_dir), subnet="198.18.77.0/24")
    rules = hybrid.ingress_rules(mesh.tunnel, "198.51.100.7")
    ledger = Ledger()
    cluster = provision(opts[:1], run, req, ledger, providers={"aws": prov}, poll_s=0.1, image=image_id(ec2),
                        node_onstart=lambda i: mesh.vm_boot.get(i), ingress=rules)
    try:
        assert len(cluster.nodes) == 2
        rows = [r for r in ledger.resources(run.id) if r.kind == "instance"]
        assert sorted(r.attrs["node_index"] for r in rows) == [1, 2] and sorted(r.name for r in rows) == [
            f"broker-{run.id}-n1", f"broker-{run.id}-n2"]
        sg = next(r.provider_id for r in ledger.resources(run.id) if r.kind == "security_group")
        perms = ec2.describe_security_groups(GroupIds=[sg])["SecurityGroups"][0]["IpPermissions"]
        udp = sorted((p["FromPort"], p["ToPort"], [x["CidrIp"] for x in p["IpRanges"]])
                     for p in perms if p["IpProtocol"] == "udp")
        assert udp == [(51820, 51820, ["198.51.100.7/32"]), (51821, 51821, ["198.51.100.7/32"])], perms
        assert {p["IpProtocol"] for p in perms} == {"-1", "tcp", "udp"}  # members, SSH, WireGuard: nothing else
        for r in rows:
            i = r.attrs["node_index"]
            ud = ec2.describe_instance_attribute(InstanceId=r.provider_id, Attribute="userData")
            script = base64.b64decode(ud["UserData"]["Value"]).decode()
            peer = mesh.tunnel.peers[i]
            assert f"PrivateKey = {peer.private_key}" in script and f"ListenPort = {51820 + i - 1}" in script
            assert f"Address = 198.18.77.{1 + i}/24" in script and "MTU = 1420" in script
            assert "wg-quick up wg0" in script and "shutdown -h" in script  # beside the dead-man switch
            others = [p for j, p in enumerate(mesh.tunnel.peers) if j != i]
            assert all(p.private_key not in script for p in others)  # each VM gets only its own key
        # the keys never reach the ledger
        for r in ledger.resources(run.id):
            assert all(p.private_key not in str(r.attrs) for p in mesh.tunnel.peers)
    finally:
        assert teardown_run(ledger, run.id, "test", providers={"aws": prov}, poll_s=0.1) == []


def test_ingress_rules_unknown_caller_and_ipv6(tmp_path):
    from broker.run import hybrid
    mesh = hybrid.wireguard_mesh(2, "r-x", tmp_path, subnet="198.18.78.0/24")
    assert oct(mesh.keys.stat().st_mode & 0o777) == "0o700"
    try:
        assert [(r.protocol, r.port, r.cidr) for r in hybrid.ingress_rules(mesh.tunnel, None)] == [
            ("udp", 51820, "0.0.0.0/0")]
        assert hybrid.ingress_rules(mesh.tunnel, "2001:db8::1")[0].cidr == "2001:db8::1/128"
        from broker.providers.aws.network import ip_permission

        assert ip_permission(hybrid.ingress_rules(mesh.tunnel, "2001:db8::1")[0])["Ipv6Ranges"][0]["CidrIpv6"] == \
            "2001:db8::1/128"
    finally:
        from broker.run.wireguard import forget

        forget(mesh.keys)


def test_local_iface_and_tunnel_subnet():
    from broker.run import hybrid
    assert hybrid.local_iface("20261130-152712-558c39") == "bkwg558c39"
    assert len(hybrid.local_iface("x" * 40)) <= 15
    net = ipaddress.ip_network(hybrid.free_tunnel_subnet())
    assert net.prefixlen == 24 and net.subnet_of(ipaddress.ip_network("198.18.0.0/15"))


def test_caller_public_ip_from_env(monkeypatch):
    from broker.run.hybrid import caller_public_ip

    monkeypatch.setenv("BROKER_PUBLIC_IP", "203.0.113.9")
    assert caller_public_ip() == "203.0.113.9"
    monkeypatch.setenv("BROKER_PUBLIC_IP", "none")
    assert caller_public_ip() is None


def test_vast_is_still_refused_for_hybrid_with_its_reason(tmp_path):
    from broker.run.pipeline import RunRequest, hybrid_target
    from broker.core.recipe import load_recipe

    r = tmp_path / "r.yaml"
    (tmp_path / "t.py").write_text("print(1)\n")
    r.write_text("name: h\nscript: t.py\nnodes: 2\ncpu_ok: true\ntopology: hybrid\n")
    with pytest.raises(NoValidPlan) as e:
        hybrid_target(load_recipe(r), RunRequest(provider="vast", topology="hybrid"))
    assert "/dev/net/tun" in e.value.message
    with pytest.raises(Exception) as e2:  # oci without credentials: a plan, not "not launched yet"
        hybrid_target(load_recipe(r), RunRequest(provider="oci", topology="hybrid"))
    assert "not launched" not in str(e2.value)


def test_local_node_inside_the_ssh_cluster_runs_here(tmp_path, monkeypatch):
    """A ``local`` node of an SSH cluster (a hybrid run's node 0): commands, files, streamed processes and
    timeouts through SSHCluster's own calls, no SSH; TS_AUTHKEY does not reach its commands."""
    import asyncssh

    from broker.core.records import Cluster, ClusterNode
    from broker.run.sshcluster import SSHCluster, node_base

    monkeypatch.setenv("TS_AUTHKEY", "tskey-auth-secret")
    node = ClusterNode(node_rank=0, host="localhost", port=0, private_ip="127.0.0.1", local=True,
                       workroot=str(tmp_path / "here"))
    c = Cluster(run_id="r1", provider="oci", topology="hybrid", nodes=[node], workroot="/nonexistent")
    assert node_base(c, 0) == f"{tmp_path}/here/r1/node0"
    ssh = SSHCluster(c, run_dir=tmp_path / "run")
    try:
        ssh.open()
        assert ssh.run(0, "echo hi; echo err >&2; echo ${TS_AUTHKEY:-none}; exit 3") == (3, "hi\nerr\nnone\n")
        code, out = ssh.run(0, "sleep 5", timeout=0.5)
        assert code is None and "timed out" in out
        remote = f"{node_base(c, 0)}/f.txt"
        ssh.loop.call(ssh.aput_bytes(0, b"data", remote, 0o600), timeout=10)
        assert Path(remote).read_bytes() == b"data" and oct(Path(remote).stat().st_mode & 0o777) == "0o600"
        assert ssh.loop.call(ssh.aget(0, remote, tmp_path / "back.txt"), timeout=10) is True
        assert (tmp_path / "back.txt").read_bytes() == b"data"
        assert ssh.loop.call(ssh.aget(0, remote + ".missing", tmp_path / "x"), timeout=10) is False

        async def stream() -> tuple[list[str], int | None]:
            conn = await ssh.aconn(0)
            proc = await conn.create_process("printf 'a\\nb\\n'; exit 4", stderr=asyncssh.STDOUT, encoding="utf-8")
            lines = [line async for line in proc.stdout]
            await proc.wait()
            return lines, proc.returncode

        assert ssh.loop.call(stream(), timeout=10) == (["a\n", "b\n"], 4)
    finally:
        ssh.close()


def test_local_node_row_without_id_is_still_removed_by_teardown(tmp_path):
    """The CLI died between the ledger intent of this machine's tunnel and its `created`: `broker down`'s teardown
    lists what is here (the key folder) and runs the removal with the row's attrs."""
    from broker.core.config import runs_dir
    from broker.money.teardown import teardown_run

    run = _run(tmp_path, "20261130-130000-def456")
    keys = runs_dir() / run.id / "wg"
    keys.mkdir(parents=True, mode=0o700)
    (keys / "node0.conf").write_text("[Interface]\nPrivateKey = secret\n")
    ledger = Ledger()
    ledger.record_intent(run.id, "local", "local_node", "node0", attrs={"keys": str(keys), "iface": "bkwgdef456",
                                                                      "pidfile": str(keys / "node0.conf.pid")})
    assert teardown_run(ledger, run.id, "test") == []
    assert not keys.exists()
    row = ledger.resources(run.id)[0]
    assert row.state == "terminated" and not (row.attrs or {}).get("never_created")


def test_caller_public_ip_lookup_and_a_bad_setting(monkeypatch):
    """Unset BROKER_PUBLIC_IP: one lookup (respx here); a failed or odd answer is "unknown"; a bad value is
    BadInput naming the variable, not a traceback."""
    import httpx
    import respx

    from broker.run.hybrid import caller_public_ip
    from broker.core.provider import BadInput

    monkeypatch.delenv("BROKER_PUBLIC_IP")
    with respx.mock(assert_all_called=True) as mock:
        route = mock.get("https://checkip.amazonaws.com")
        route.return_value = httpx.Response(200, text="203.0.113.44\n")
        assert caller_public_ip() == "203.0.113.44"
        route.return_value = httpx.Response(503, text="busy")
        assert caller_public_ip() is None
        route.return_value = httpx.Response(200, text="<html>captive portal</html>")
        assert caller_public_ip() is None
        route.side_effect = httpx.ConnectTimeout("timed out")
        assert caller_public_ip() is None
    monkeypatch.setenv("BROKER_PUBLIC_IP", "my-laptop")
    with pytest.raises(BadInput, match="BROKER_PUBLIC_IP"):
        caller_public_ip()
