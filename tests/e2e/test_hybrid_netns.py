"""The emulated hybrid topology (root only): two sites behind two NATs on this machine, a per-run WireGuard tunnel
between them, the job over the tunnel; a blocked UDP port caught by preflight; keys and interfaces gone after
teardown and after a SIGKILL of `broker run` (via `broker down`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.providers import netns
from broker.run.wireguard import missing_tools

ROOT = Path(__file__).resolve().parents[2]

_why = netns.missing_requirements() or missing_tools()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why is not None, reason=f"hybrid netns tests: {_why}")]

#: a gloo job that reports the interface it was told to use and the bytes that crossed it during an all-reduce
JOB = r'''
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
iface = os.environ["GLOO_SOCKET_IFNAME"]
def tx():
    return int(open(f"/sys/class/net/{iface}/statistics/tx_bytes").read())
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
r = dist.get_rank()
before = tx()
x = torch.full((1 << 20,), float(r + 1))  # 4 MiB
dist.all_reduce(x)
assert float(x[0]) == 3.0, x[0]
print(f"IFACE={iface} MASTER_ADDR={os.environ['MASTER_ADDR']} NCCL_IB_DISABLE={os.environ.get('NCCL_IB_DISABLE')} "
      f"TX_DELTA={tx() - before}", flush=True)
dist.destroy_process_group()
print("HYBRID_OK", flush=True)
sys.stdout.flush()
os._exit(0)
'''


def _recipe(tmp_path: Path, name: str = "hy") -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "job.py").write_text(JOB)
    r = tmp_path / f"{name}.yaml"
    r.write_text(f"name: {name}\nscript: {work / 'job.py'}\nworkdir: {work}\nnodes: 2\ngpus_per_node: 1\n"
                 "cpu_ok: true\nmax_hours: 0.1\nenv: {PYTHONWARNINGS: ignore}\nexpect: [HYBRID_OK]\n")
    return r


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, BROKER_HOME=str(tmp_path / "home"), PYTHONWARNINGS="ignore")


def _gone(cid: str, home: Path) -> list[str]:
    """What is left of cluster ``cid``: namespaces, links, sshd, wireguard-go processes, key files."""
    left = netns.leftovers(cid) + [f"sshd {p}" for p in netns.sshd_processes(cid)]
    out = subprocess.run(["pgrep", "-af", f"wireguard-go -f wg{cid[-6:]}"], capture_output=True, text=True).stdout
    left += [f"proc {ln}" for ln in out.splitlines() if "pgrep" not in ln]
    left += [f"keys {p}" for p in home.glob(f"runs/*/netns/{cid}/wg")]
    left += [f"socket {p}" for p in home.glob(f"runs/*/netns/{cid}/node*/run/wireguard/*.sock")]
    return left


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return bool(cond())


def test_only_the_wireguard_port_crosses_the_sites(tmp_path):
    """The layout itself: node 0 cannot open TCP to node 1 (LAN, management or WAN address), the tunnel can."""
    from broker.run.hybrid import tunnel_down, tunnel_up

    cid = netns.new_cid()
    c, s = netns.up_hybrid(2, tmp_path, cid=cid)
    try:
        t = tunnel_up(c, s)
        assert (c.root / "wg").stat().st_mode & 0o777 == 0o700
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in (c.root / "wg").glob("*.conf"))
        # a listener on every address of node 1
        srv = subprocess.Popen(["ip", "netns", "exec", c.ns(1), sys.executable, "-c",
                                "import socket,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,"
                                "socket.SO_REUSEADDR,1);s.bind(('0.0.0.0',7777));s.listen(8)\n"
                                "while True:\n c,_=s.accept();c.close()"])
        try:
            time.sleep(0.5)

            def connect(addr: str) -> bool:
                code = ("import socket\ntry:\n socket.create_connection((%r,7777),timeout=1.5).close();print('OPEN')\n"
                        "except OSError as e:\n print('NO', e)") % addr
                out = subprocess.run(["ip", "netns", "exec", c.ns(0), sys.executable, "-c", code],
                                     capture_output=True, text=True, timeout=20).stdout
                return out.startswith("OPEN")

            assert connect(t.addresses[1]), "TCP over the tunnel must work"
            assert not connect(s.lan_ip(1)), "node 1's LAN address must not be reachable from home"
            assert not connect(c.ip(1)), "the management bridge must not carry node-to-node traffic"
            assert not connect(s.wan_ip("cloud")), "the cloud router's WAN address opens only the UDP port"
            netns.block_direct(s)  # drop every TCP packet between the sites: the tunnel (UDP) still carries TCP
            assert connect(t.addresses[1])
        finally:
            srv.kill()
            srv.wait()
        tunnel_down(c, t)
        assert not (c.root / "wg").exists()
    finally:
        c.down()
    assert _wait(lambda: not _gone(cid, tmp_path), 5), _gone(cid, tmp_path)


def test_emulated_hybrid_run_end_to_end_over_the_tunnel(tmp_path):
    """The whole run (gloo) with every TCP packet between the sites dropped by the routers (direct-blocked): only
    the tunnel's UDP crosses, and the job still succeeds on the tunnel interfaces."""
    env = _env(tmp_path)
    p = subprocess.run([sys.executable, "-m", "broker", "run", str(_recipe(tmp_path)), "--provider", "netns",
                        "--topology", "hybrid", "--inject", "direct-blocked"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "HYBRID_OK" in out
    assert "WireGuard tunnel up" in out
    home = Path(env["BROKER_HOME"])
    run_dir = next(home.glob("runs/*"))
    logs = "".join(f.read_text() for f in run_dir.glob("node*.log"))
    cid = next(home.glob("runs/*/netns/*")).name
    iface0, iface1 = f"wg{cid[-6:]}0", f"wg{cid[-6:]}1"
    # every rank used its tunnel interface, the master address is node 0's tunnel address, and the all-reduce
    # bytes crossed the tunnel
    assert f"IFACE={iface0}" in logs and f"IFACE={iface1}" in logs, logs
    sites = netns.HybridSites.load(run_dir / "netns" / cid)
    assert f"MASTER_ADDR=198.18.{sites.tunnel}.1" in logs and "NCCL_IB_DISABLE=1" in logs
    deltas = [int(x.split("=")[1]) for x in logs.split() if x.startswith("TX_DELTA=")]
    assert len(deltas) == 2 and all(d > 2_000_000 for d in deltas), deltas
    pre = (run_dir / "preflight.txt").read_text()
    assert "tunnel" in pre and "tunnel mtu" in pre and "FAIL" not in pre, pre
    assert _wait(lambda: not _gone(cid, home), 5), _gone(cid, home)


def test_blocked_udp_port_is_caught_by_preflight_in_seconds(tmp_path):
    env = _env(tmp_path)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "broker", "run", str(_recipe(tmp_path)), "--provider", "netns",
                        "--topology", "hybrid", "--inject", "udp-blocked", "--quiet"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    home = Path(env["BROKER_HOME"])
    run_dir = next(home.glob("runs/*"))
    pre = (run_dir / "preflight.txt").read_text()
    assert "no WireGuard handshake" in pre and "UDP port 51820 is blocked" in pre, pre
    assert "no WireGuard handshake" in out
    assert took < 45, took  # venv start, namespaces, sshd, 6 s of handshake wait, teardown
    assert not (run_dir / "node0.log").read_text().strip()  # nothing was launched
    cid = next(home.glob("runs/*/netns/*")).name
    assert _wait(lambda: not _gone(cid, home), 5), _gone(cid, home)


def test_sigkill_of_broker_run_then_broker_down_removes_keys_and_interfaces(tmp_path):
    env = _env(tmp_path)
    home = Path(env["BROKER_HOME"])
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text("import time\nprint('SLEEPING', flush=True)\ntime.sleep(600)\n")
    r = tmp_path / "sleep.yaml"
    r.write_text(f"name: sleepy\nscript: {work / 'job.py'}\nworkdir: {work}\nnodes: 2\ngpus_per_node: 1\n"
                 "cpu_ok: true\nmax_hours: 0.1\n")
    proc = subprocess.Popen([sys.executable, "-m", "broker", "run", str(r), "--provider", "netns", "--topology",
                             "hybrid"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    cid = None
    try:
        assert _wait(lambda: any("SLEEPING" in f.read_text() for f in home.glob("runs/*/node*.log")), 120)
        cid = next(home.glob("runs/*/netns/*")).name
        confs = list(home.glob(f"runs/*/netns/{cid}/wg/*.conf"))
        assert confs, "keys exist while the run is live"
        keys = [ln.split("=", 1)[1].strip() for p in confs for ln in p.read_text().splitlines()
                if ln.startswith("PrivateKey")]
        assert len(keys) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert netns.leftovers(cid), "SIGKILL leaves the cluster behind"
        run_id = next(home.glob("runs/*")).name
        d = subprocess.run([sys.executable, "-m", "broker", "down", run_id], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert d.returncode == 0, d.stdout + d.stderr
        assert _wait(lambda: not _gone(cid, home), 10), _gone(cid, home)
        # the private keys were never written anywhere else under the broker home (ledger, logs, plan, state)
        for f in home.rglob("*"):
            if f.is_file():
                data = f.read_bytes()
                assert not any(k.encode() in data for k in keys), f
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if cid:
            netns.remove_cid(cid)
            netns.forget_hybrid_secrets(cid)


def test_removing_the_cluster_deletes_its_keys_and_sockets(tmp_path):
    """Every removal path (release, `broker down`, `broker netns down`) goes through remove_cid: the keys go too."""
    from broker.core.config import runs_dir
    from broker.run.hybrid import tunnel_up

    cid = netns.new_cid()
    c, s = netns.up_hybrid(2, runs_dir() / "r-keys", cid=cid)
    try:
        tunnel_up(c, s)
        assert len(list((c.root / "wg").glob("node*.conf"))) == 2
        if json.loads((c.root / "tunnel.json").read_text())["how"] == "wireguard-go":
            assert len(list(c.root.glob("node*/run/wireguard/*.sock"))) == 2
    finally:
        removed = netns.remove_cid(cid)
    assert any(r.startswith("keys ") for r in removed), removed
    assert not (c.root / "wg").exists() and not list(c.root.glob("node*/run/wireguard/*.sock"))
    assert _wait(lambda: not _gone(cid, runs_dir().parent), 5)


def test_teardown_leaves_no_wireguard_go_zombie(tmp_path):
    """Seen on the 2x H200 device: `pgrep wireguard-go` still counted 2 after the runs ended (exited wireguard-go
    children never collected).  Both teardown paths (tunnel_down, then remove_cid) reap what this process started."""
    from broker.core.config import runs_dir
    from broker.run.hybrid import tunnel_down, tunnel_up

    def state(pid: int) -> str | None:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return None

    for path in ("tunnel_down", "remove_cid"):
        cid = netns.new_cid()
        c, s = netns.up_hybrid(2, runs_dir() / f"r-zombie-{path}", cid=cid)
        try:
            t = tunnel_up(c, s)
            if t.how != "wireguard-go":
                pytest.skip("kernel WireGuard here: no wireguard-go process to reap")
            from broker.core.procid import ProcessId

            # the pid file holds the process's identity (pid, start time, name), not a bare pid
            pids = [ProcessId.from_text((t.keys / f"node{i}.conf.pid").read_text()).pid for i in range(2)]
            assert all(state(p) in ("S", "R") for p in pids)
            if path == "tunnel_down":
                tunnel_down(c, t)
                assert [state(p) for p in pids] == [None, None]
        finally:
            netns.remove_cid(cid)
        assert [state(p) for p in pids] == [None, None], path
