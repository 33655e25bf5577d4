"""Real multi-host runs over SSH on the netns provider: namespaces + bridge + one sshd per node (root only).

Every cluster is removed in a finalizer, also when a test fails, and the finalizer asserts that no namespace,
link or sshd of that cluster is left.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from broker.providers import netns

ROOT = Path(__file__).resolve().parents[2]

_why = netns.missing_requirements()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why is not None, reason=f"netns tests: {_why}")]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))


@pytest.fixture
def make_cluster(tmp_path):
    """Factory: make_cluster(n, inject=None) -> NetnsCluster; all removed (and checked gone) at teardown."""
    made: list[netns.NetnsCluster] = []

    def _make(n: int = 2, inject: str | None = None) -> netns.NetnsCluster:
        c = netns.up(n, tmp_path / f"c{len(made)}", inject=inject, use_gpus=False)
        made.append(c)
        return c

    yield _make
    for c in made:
        c.down()
    time.sleep(0.2)
    for c in made:
        assert netns.leftovers(c.cid) == [], f"leftovers of {c.cid}"
        assert netns.sshd_processes(c.cid) == [], f"sshd of {c.cid} still running"


def test_failed_up_removes_everything(tmp_path, monkeypatch):
    fake = tmp_path / "sshd"
    fake.write_text("#!/bin/sh\necho 'sshd: cannot start' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BROKER_SSHD", str(fake))
    cid = netns.new_cid()
    with pytest.raises(netns.ProviderError, match="did not accept"):
        netns.up(2, tmp_path, use_gpus=False, ssh_wait_s=2, cid=cid)
    assert netns.leftovers(cid) == [] and netns.sshd_processes(cid) == []


def small_recipe(tmp_path: Path, **update):
    from broker.core.recipe import load_recipe

    r = load_recipe(ROOT / "recipes" / "ddp_2node.yaml")
    upd = {"args": ["--epochs", "2", "--min-accuracy", "0"], "expect": ["ALLREDUCE_OK", "DDP_OK"]}
    upd.update(update)
    return r.model_copy(update=upd)


SLEEPER = """
import os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
x = torch.ones(1)
dist.all_reduce(x)
print(f"RANK={r} READY sum={x.item():g}", flush=True)
time.sleep(300)
"""


def sleeper_recipe(tmp_path: Path):
    from broker.core.recipe import load_recipe

    d = tmp_path / "job"
    d.mkdir()
    (d / "sleeper.py").write_text(SLEEPER)
    (d / "r.yaml").write_text("name: sleeper\nscript: sleeper.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n")
    return load_recipe(d / "r.yaml")


def test_two_node_gloo_job_over_ssh(make_cluster, tmp_path, monkeypatch):
    from broker.run import remote
    from tests.support.runs import run_remote

    c = make_cluster(2)
    # the first randomly chosen master port is taken on node 0: preflight notices and another one is used
    busy = subprocess.Popen(["ip", "netns", "exec", c.ns(0), sys.executable, "-c",
                             "import socket,time; s=socket.socket(); s.bind(('0.0.0.0', 29555)); s.listen(); "
                             "print('up', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert busy.stdout.readline().strip() == "up"
    picks = iter([29555, 29601, 29602, 29603])
    monkeypatch.setattr(remote.random, "randint", lambda a, b: next(picks))
    lines: list[str] = []
    run_dir = tmp_path / "run"
    try:
        res = run_remote(c.cluster("t1"), small_recipe(tmp_path), run_dir, echo=lines.append)
    finally:
        busy.kill()
        busy.wait()
    # the launch command is recorded beside the logs (launch.txt), never in the node log the user reads
    launch = [ln for ln in (run_dir / "launch.txt").read_text().splitlines() if ln.startswith("node 1: ")]
    assert launch and "--master_port=29601" in launch[0], launch
    assert "--master_port=29601" not in (run_dir / "node1.log").read_text()
    assert res.ok, (res.reason, res.tail)
    assert res.exit_codes == {0: 0, 1: 0}
    assert [(r.node, r.rank, r.world_size, r.backend) for r in res.ranks] == [(0, 0, 2, "gloo"), (1, 1, 2, "gloo")]
    # the rank facts came back from every node (the table's host column is each node's own hostname)
    assert [r.host for r in res.ranks] == ["node0", "node1"]
    assert (run_dir / "node1" / "facts" / "rank1.json").exists()
    for i in (0, 1):
        log = (run_dir / f"node{i}.log").read_text()
        assert "all_reduce_sum=3 expected=3 ALLREDUCE_OK" in log  # (0+1) + (1+1)
        assert f"host=node{i}" in log  # really ran on node i (its own UTS namespace)
    assert any(x.startswith("[node 1] RANK=1") for x in lines)
    assert res.preflight is not None and res.preflight.ok
    assert res.preflight.ifaces == {0: "eth0", 1: "eth0"}
    assert (run_dir / "artifacts" / "node0" / "checkpoint.pt").stat().st_size > 0  # artifact from node 0
    assert not (run_dir / "artifacts" / "node1").exists()  # rank 0 alone writes the checkpoint
    assert (run_dir / "preflight.txt").read_text().count("PASS") >= 5


def _torch_start_s(python: str) -> float:
    """Seconds that ``python -c 'import torch'`` takes on this machine now (what preflight's torch check pays on
    each node; the nodes are namespaces of this machine): the yardstick for how loaded the machine is."""
    t0 = time.monotonic()
    subprocess.run([python, "-c", "import torch, torch.distributed"], check=True, capture_output=True, timeout=300)
    return time.monotonic() - t0


def test_firewall_fails_preflight_within_10s_and_names_it(make_cluster, tmp_path):
    """A host firewall is caught and named by preflight, before the job starts, within seconds: the probe's own
    2 s connect timeout decides (not the job's DDP_TIMEOUT_S or its deadline).  Under 10 s on an idle machine;
    the bound grows with the measured cost of the torch check when the machine is loaded (the speed claim itself
    is bench/'s)."""
    from broker.run.preflight import PROBE_TIMEOUT_S
    from tests.support.runs import run_remote

    c = make_cluster(2, inject="firewall")
    cluster = c.cluster("t2")
    recipe = small_recipe(tmp_path)
    run_dir = tmp_path / "run"
    _torch_start_s(cluster.python)  # a cold first import (files not cached yet) says nothing about the load
    before = _torch_start_s(cluster.python)
    t0 = time.monotonic()
    res = run_remote(cluster, recipe, run_dir, echo=None)
    run_s = time.monotonic() - t0
    after = _torch_start_s(cluster.python)
    assert res.status == "failed"
    assert res.preflight is not None and not res.preflight.ok
    assert "host firewall" in res.reason and "node 0" in res.reason and "FILTERED" in res.reason
    fails = [ch for ch in res.preflight.checks if ch.result == "FAIL"]
    assert [ch.check for ch in fails] == ["tcp 1->0"]  # stateful SSH-only on node 0: 0->1 still works
    # the exact command that opens the private network's CIDR in node 0's host firewall, for the tool that holds
    # the rule on this node (iptables-legacy, or nftables where iptables is nft's front end)
    subnet = c.ip(0).rsplit(".", 1)[0] + ".0/24"
    tool = _firewall_tool(c.ns(0))
    want = {"iptables": f"sudo iptables -I INPUT -s {subnet} -p tcp -j ACCEPT",
            "nftables": f"sudo nft insert rule ip filter INPUT ip saddr {subnet} meta l4proto tcp accept"}[tool]
    assert f"`{want}`" in fails[0].fix, (tool, fails[0].fix)
    assert f"{tool} node 0" in res.reason, (tool, res.reason)
    assert res.exit_codes == {}
    for i in (0, 1):  # the job was never started
        assert "torch.distributed.run" not in (run_dir / f"node{i}.log").read_text()
    # quickly: each dropped port is given up after the probe's own timeout (measured on node 1 around connect())
    waited = [float(x) for x in re.findall(r"FILTERED \(([\d.]+) s\)", fails[0].detail)]
    assert waited and all(PROBE_TIMEOUT_S - 0.1 <= w <= PROBE_TIMEOUT_S + 1.5 for w in waited), fails[0].detail
    # the preflight step (its own clock): the connect timeout plus SSH and Python start-ups; the torch check, the
    # slowest of those, sets the headroom when the machine is loaded
    bound = max(10.0, PROBE_TIMEOUT_S + 3 * max(before, after))
    assert res.preflight.wall_s < bound, (res.preflight.wall_s, before, after)
    # the whole run ended long before the job's own timeouts would have (DDP_TIMEOUT_S, the deadline)
    assert run_s < min(float(recipe.env["DDP_TIMEOUT_S"]), recipe.max_hours * 3600), run_s
    # the printed command really opens the port: run it (as root, without sudo) in node 0, then connect from node 1
    assert not _connects(c, 0, 1), "the injected firewall should drop new TCP from node 1"
    subprocess.run(["ip", "netns", "exec", c.ns(0), *shlex.split(want)[1:]], check=True, timeout=30)
    assert _connects(c, 0, 1), f"`{want}` did not open node 0's firewall"


def _firewall_tool(ns: str) -> str:
    """The tool that holds a namespace's INPUT DROP rule as the node sees it: ``nftables`` when ``nft list
    ruleset`` shows it (Debian's iptables is nft's front end when nftables is installed), else ``iptables``."""
    if shutil.which("nft"):
        out = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"], capture_output=True,
                             text=True, timeout=30).stdout
        if re.search(r"chain INPUT \{[^}]*\bdrop\b", out):
            return "nftables"
    return "iptables"


def _connects(c: netns.NetnsCluster, dst: int, src: int, port: int = 18931) -> bool:
    """Whether a new TCP connection from node ``src`` reaches a listener on node ``dst``'s private address."""
    srv = subprocess.Popen(["ip", "netns", "exec", c.ns(dst), sys.executable, "-c",
                            "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
                            f"socket.SO_REUSEADDR, 1); s.bind(('{c.ip(dst)}', {port})); s.listen(); "
                            "print('up', flush=True); s.settimeout(8); c, _ = s.accept()"],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "up"
        cli = subprocess.run(["ip", "netns", "exec", c.ns(src), sys.executable, "-c",
                              f"import socket; socket.create_connection(('{c.ip(dst)}', {port}), timeout=2)"],
                             capture_output=True, timeout=30)
        return cli.returncode == 0
    finally:
        srv.kill()
        srv.wait()


def test_wrong_interface_is_named(make_cluster, tmp_path):
    from tests.support.runs import run_remote

    c = make_cluster(2, inject="wrong-iface")
    res = run_remote(c.cluster("t3"), small_recipe(tmp_path), tmp_path / "run", echo=None)
    assert res.status == "failed"
    assert "GLOO_SOCKET_IFNAME=lo is forced" in res.reason and "on eth0" in res.reason
    fix = [ch.fix for ch in res.preflight.checks if ch.result == "FAIL"]
    assert "unset GLOO_SOCKET_IFNAME or set GLOO_SOCKET_IFNAME=eth0" in fix


def test_mtu_mismatch_and_accept_new_host_keys(make_cluster, tmp_path):
    from tests.support.runs import run_remote

    c = make_cluster(2, inject="mtu")
    cl = c.cluster("t4").model_copy(update={"known_hosts_path": None})  # like fresh cloud VMs: accept-new
    run_dir = tmp_path / "run"
    res = run_remote(cl, small_recipe(tmp_path), run_dir, echo=None)
    assert res.status == "failed"
    mtu = [ch for ch in res.preflight.checks if ch.check == "mtu"]
    assert mtu and mtu[0].result == "FAIL" and "node 1 eth0=1400" in mtu[0].detail
    from broker.core.sshkeys import host_key_name

    kh = (run_dir / "known_hosts").read_text().splitlines()
    names = [host_key_name(n.host, n.port, n.resource_id) for n in cl.nodes]  # pinned per machine, not address
    assert sorted(x.split()[0] for x in kh) == sorted(names)
    for line in kh:  # the remembered key is the node's real host key
        i = names.index(line.split()[0])
        assert line.split()[2] == (c.root / f"node{i}" / "ssh_host_ed25519_key.pub").read_text().split()[1]


def test_pinned_host_key_mismatch_is_refused(make_cluster, tmp_path):
    from tests.support.runs import run_remote

    c = make_cluster(1)
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    from broker.core.sshkeys import host_key_name

    kh = tmp_path / "kh"
    cl = c.cluster("t5").model_copy(update={"known_hosts_path": str(kh)})
    name = host_key_name(c.ip(0), 22, cl.nodes[0].resource_id)  # the machine's pin (by resource id)
    kh.write_text(f"{name} {' '.join(Path(str(other) + '.pub').read_text().split()[:2])}\n")
    res = run_remote(cl, small_recipe(tmp_path, nodes=1), tmp_path / "run", echo=None)
    assert res.status == "failed" and "presented a host key other than" in res.reason
    assert res.preflight is None  # stopped at connect


def _wait_for(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.2)
    return False


def _group_alive(pidfile: Path) -> list[int]:
    """PIDs still alive in the process group recorded in ``pidfile``."""
    if not pidfile.exists():
        return []
    pgid = int(pidfile.read_text())
    alive = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(st[2]) == pgid and st[0] != "Z":
                alive.append(int(d.name))
    return alive


def _marked_alive(run_id: str) -> list[int]:
    """Live processes whose environment carries BROKER_RUN_ID=run_id (a node's job, orphans included)."""
    want = f"BROKER_RUN_ID={run_id}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if want in (d / "environ").read_bytes().split(b"\0") and \
                        (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _start_sleeper(c, tmp_path, name):
    from tests.support.runs import run_remote

    run_dir = tmp_path / "run"
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(res=run_remote(c.cluster(name), sleeper_recipe(tmp_path),
                                                                    run_dir, echo=None)), daemon=True)
    t.start()
    logs = [run_dir / f"node{i}.log" for i in (0, 1)]
    ready = _wait_for(lambda: all(p.exists() and "READY" in p.read_text() for p in logs), 90)
    assert ready, "the job did not start"
    base = c.root / "work" / name
    return t, box, run_dir, base


def test_node_killed_mid_run_stops_the_other(make_cluster, tmp_path):
    c = make_cluster(2)
    t, box, run_dir, base = _start_sleeper(c, tmp_path, "t6")
    pgid = int((base / "node1" / "torchrun.pid").read_text())
    os.killpg(pgid, signal.SIGKILL)  # node 1's torchrun dies (workers live in their own session)
    t.join(60)
    assert not t.is_alive(), "the run did not end after node 1 died"
    res = box["res"]
    assert res.status == "failed" and res.failed_node == 1
    assert "node 1 exited with code" in res.reason and "stopped the other nodes" in res.reason
    assert _wait_for(lambda: not _group_alive(base / "node0" / "torchrun.pid"), 10), "node 0's job survived"
    # node 1's worker, orphaned when its torchrun was killed, was swept by its environment marker
    assert _wait_for(lambda: not _marked_alive("t6"), 10), _marked_alive("t6")


def test_ssh_connection_lost_fails_loudly_and_remote_job_is_killed(make_cluster, tmp_path):
    c = make_cluster(2)
    t, box, run_dir, base = _start_sleeper(c, tmp_path, "t7")
    out = subprocess.run(["ip", "netns", "pids", c.ns(1)], capture_output=True, text=True).stdout.split()
    sessions = [int(p) for p in out if int(p) not in c.sshd_pids
                and Path(f"/proc/{p}/comm").exists() and Path(f"/proc/{p}/comm").read_text().strip() == "sshd"]
    assert sessions
    for p in sessions:  # drop node 1's ssh connection; the job itself keeps running there
        os.kill(p, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    res = box["res"]
    assert res.status == "failed" and res.failed_node == 1
    assert res.reason.startswith("ssh connection to node 1 lost")
    assert res.exit_codes[1] is None
    assert "ssh connection to node 1 lost" in (run_dir / "node1.log").read_text()
    for i in (0, 1):  # stop() reconnected and killed node 1's orphaned job; node 0 was stopped
        assert _wait_for(lambda: not _group_alive(base / f"node{i}" / "torchrun.pid"), 10), f"node {i} job alive"
    assert _wait_for(lambda: not _marked_alive("t7"), 10), _marked_alive("t7")


def test_cli_run_netns_with_firewall_records_and_tears_down(tmp_path):
    env = dict(os.environ, BROKER_HOME=str(tmp_path / "home"), PYTHONWARNINGS="ignore")
    recipe = tmp_path / "r.yaml"
    recipe.write_text((ROOT / "recipes" / "ddp_2node.yaml").read_text().replace("script: ddp_train.py",
                      f"script: {ROOT / 'recipes' / 'ddp_train.py'}").replace("workdir: .",
                      f"workdir: {ROOT / 'recipes'}"))
    p = subprocess.run([sys.executable, "-m", "broker", "run", str(recipe), "--provider", "netns", "--inject",
                        "firewall", "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "host firewall" in p.stdout
    from broker.money.ledger import Ledger

    led = Ledger()  # the autouse fixture points BROKER_HOME at the same folder
    run = led.list_runs(1)[0]
    assert run.provider == "netns" and run.status == "failed"
    rows = led.resources(run.id)
    assert len(rows) == 2 and all(r.kind == "netns_node" and r.state == "terminated" for r in rows)
    cid = rows[0].provider_id.split(":")[0]
    assert netns.leftovers(cid) == [] and netns.sshd_processes(cid) == []


def test_cli_netns_up_status_down(tmp_path):
    env = dict(os.environ, BROKER_HOME=str(tmp_path / "home"))
    cli = [sys.executable, "-m", "broker", "netns"]
    up = subprocess.run(cli + ["up", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    cid = next((w for w in up.stdout.split() if w.startswith(netns.PREFIX) and len(w) == 9), None)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert cid and len(netns.sshd_processes(cid)) == 2
        cfg = next((tmp_path / "home").glob(f"runs/*/netns/{cid}/ssh/config"))  # the cluster is a run
        r = subprocess.run(["ssh", "-F", str(cfg), "node1", "hostname"], capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == "node1", r.stderr
        st = subprocess.run(cli + ["status"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert cid in st.stdout
        down = subprocess.run(cli + ["down", cid], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0 and f"netns {cid}n0" in down.stdout
    finally:
        if cid:
            netns.remove_cid(cid)
            for p in netns.sshd_processes(cid):
                os.kill(p, signal.SIGKILL)
    assert _wait_for(lambda: not netns.leftovers(cid) and not netns.sshd_processes(cid), 5)


def test_the_work_folder_travels_while_preflight_checks(make_cluster, tmp_path, monkeypatch):
    """Staging does not wait for preflight: the work folder is unpacked on every node while the checks run (here
    preflight checks only once the script is on both nodes; when staging came after it, that never happened)."""
    from broker.run import preflight as pf
    from tests.support.runs import run_remote

    c = make_cluster(2)
    recipe = small_recipe(tmp_path)
    real, seen = pf.run_preflight, {}

    def checks_once_the_folder_is_there(ssh, rcp, port):
        there = [Path(ssh.work(i)) / Path(rcp.script).name for i in range(2)]  # the nodes share this filesystem
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in there) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["there"] = all(p.exists() for p in there)
        return real(ssh, rcp, port)

    monkeypatch.setattr(pf, "run_preflight", checks_once_the_folder_is_there)
    res = run_remote(c.cluster("t-stage"), recipe, tmp_path / "run", echo=None)
    assert seen["there"], "the work folder reached the nodes only after preflight"
    assert res.ok, (res.reason, res.tail)
    assert res.preflight is not None and res.preflight.ok
