"""The cloud side of the hybrid topology: ``hybrid`` on rented VMs end to end through the REAL ``oci`` SDK against
:mod:`tests.support.oci_emulator`, with node 0 = this machine (the root namespace) and node 1 = a VM that is a network
namespace host with real sshd (:func:`broker.providers.netns.up`) whose login user is the image's (``ubuntu``,
passwordless sudo, root login refused), as on the real images.

What a cloud does at boot is done by the test the way cloud-init would: when the emulator turns the instance
RUNNING, its ``user_data`` (the adapter's boot script, which embeds the run's WireGuard config for node 1 or the
``tailscale up`` lines) is decoded and executed as root inside the VM: its network namespace and the mount
namespace of its sshd (its own ``/run``, where ``wireguard-go`` puts its socket).  The VM's "image" gets a private
``/etc/wireguard`` and ``/usr/local/sbin`` (bind mounts inside that mount namespace only) holding a ``systemctl``
that says there is no systemd (so the script falls back to ``wg-quick up``) and, for ``--mesh tailscale``, the
stand-in ``tailscale``.  Every address is from 198.18.0.0/15 (the netns /24 and a free /24 for the tunnel).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

oci = pytest.importorskip("oci")

from broker.money.ledger import Ledger  # noqa: E402
from broker.core.model import utcnow  # noqa: E402
from broker.run.cloudtarget import CloudHybridTarget
from broker.run.runrecord import Hooks
from broker.run.pipeline import run_pipeline  # noqa: E402
from broker.plan.planner import plan  # noqa: E402
from broker.providers import netns  # noqa: E402
from broker.core.recipe import load_recipe  # noqa: E402
from broker.run.wireguard import missing_tools  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.support.oci_emulator import OCIEmulator  # noqa: E402
from tests.e2e.test_oci_e2e import AD, COMP, REGION, TENANCY  # noqa: E402

_why = (("needs root (network namespaces, WireGuard)" if os.geteuid() != 0 else None)
        or netns.missing_requirements() or missing_tools()
        or (None if shutil.which("nsenter") and shutil.which("wg-quick") else "needs nsenter and wg-quick")
        or (None if Path("/etc/wireguard").is_dir() else "needs /etc/wireguard as a mount point for the VM's"))
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(_why is not None, reason=f"hybrid cloud: {_why}")]

NO_SYSTEMD = "#!/bin/sh\necho 'System has not been booted with systemd as init system (PID 1).' >&2\nexit 1\n"


#: the image's login user (passwordless sudo; root cannot log in), as on OCI's Ubuntu images
LOGIN = "ubuntu"
#: INPUT of OCI's Ubuntu images (/etc/iptables/rules.v4): what is not SSH, ICMP or NTP is rejected, whatever the
#: security list allows
OCI_IMAGE_INPUT = [["-m", "state", "--state", "RELATED,ESTABLISHED", "-j", "ACCEPT"], ["-p", "icmp", "-j", "ACCEPT"],
                   ["-i", "lo", "-j", "ACCEPT"], ["-p", "udp", "--sport", "123", "-j", "ACCEPT"],
                   ["-p", "tcp", "-m", "state", "--state", "NEW", "-m", "tcp", "--dport", "22", "-j", "ACCEPT"],
                   ["-j", "REJECT", "--reject-with", "icmp-host-prohibited"]]


@pytest.fixture
def vm(netns_hosts):
    """The rented VM of rank 1: one netns host with sshd (tests/conftest.py netns_hosts) whose login user is the
    image's own."""
    return netns_hosts(1, login_user=LOGIN)


def vm_home(vm: Any) -> Path:
    """The VM's /home/<login user>, seen from this machine."""
    return vm.root / "node0" / "home" / LOGIN


def tailscale_standin(path: Path, *, address: str, state: Path | None) -> None:
    """A stand-in ``tailscale`` command.  With ``state`` (the VM's): ``up --authkey=K --hostname=H`` records
    sha256(K) and H in ``state`` (never K) and joins; ``ip -4`` / ``status --json`` answer only once joined.
    Without (this machine's): already on the tailnet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    joined = f'[ -s {state} ]' if state else "true"
    record = ("printf '{\"authkey_sha256\": \"%s\", \"hostname\": \"%s\"}' \"$h\" \"$host\" > " + str(state)
              if state else "exit 1")
    path.write_text(f"""#!/bin/bash
case "$1" in
  up)
    key=""; host=""
    for a in "$@"; do case "$a" in --authkey=*) key="${{a#--authkey=}}";; --hostname=*) host="${{a#--hostname=}}";; esac; done
    [ -n "$key" ] || {{ echo "no --authkey" >&2; exit 1; }}
    h=$(printf %s "$key" | sha256sum | cut -d' ' -f1)
    {record}
    ;;
  ip) {joined} && echo {address} || {{ echo "not logged in" >&2; exit 1; }} ;;
  status) {joined} && echo '{{"BackendState": "Running"}}' || echo '{{"BackendState": "NeedsLogin"}}' ;;
  *) echo "stand-in tailscale: $*" >&2; exit 2 ;;
esac
""")
    path.chmod(0o755)


class Cloud:
    """The emulator, the real OCI adapter pointed at it and the VM's "cloud-init"."""

    def __init__(self, vm: Any, tmp_path: Path, key_pem: str, *, vm_tailscale: bool = False,
                 image_firewall: bool = False):
        from broker.providers.oci import OCIProvider

        self.vm, self.tmp = vm, tmp_path
        # the security list is enforced in front of the VM, except with the stand-in tailnet: that is the netns
        # bridge itself, where a real tailnet would carry the traffic inside its own (NAT-traversing) UDP
        self.enforce_security_list = not vm_tailscale
        # the image's own host firewall (OCI_IMAGE_INPUT), restored after the boot script ran (its inserts are gone;
        # the WireGuard port stays open, as the adapter's boot saved it): only the job's TCP inside the tunnel is
        # refused
        self.image_firewall = image_firewall
        self.boots: list[tuple[int, str]] = []
        self.user_data: list[str] = []
        # the VM "image": its own /etc/wireguard and /usr/local/sbin (no systemd; tailscale where asked)
        self.image = tmp_path / "vm-image"
        (self.image / "etc-wireguard").mkdir(parents=True)
        (self.image / "sbin").mkdir()
        (self.image / "sbin" / "systemctl").write_text(NO_SYSTEMD)
        (self.image / "sbin" / "systemctl").chmod(0o755)
        # the stand-in's state in the VM's image (its /usr/local/sbin), where the login user reads it too
        self.ts_state = self.image / "sbin" / "tailscale.json"
        if vm_tailscale:
            tailscale_standin(self.image / "sbin" / "tailscale", address=vm.ip(0),
                              state=Path("/usr/local/sbin/tailscale.json"))
        pid = vm.sshd_pids[0]
        for src, dst in ((self.image / "etc-wireguard", "/etc/wireguard"), (self.image / "sbin", "/usr/local/sbin")):
            subprocess.run(["nsenter", "-t", str(pid), "-m", "mount", "--bind", str(src), dst], check=True)
        self.lines: list[str] = []
        self.node0_key: str | None = None
        self.cloud(key_pem)

    def cloud(self, key_pem: str) -> None:
        from broker.providers.oci import OCIProvider

        self.emu = OCIEmulator(compartment=COMP, ads=(AD,), region=REGION, addresses=self.addresses,
                               on_running=self.on_running, login_user=LOGIN)
        cfg = {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": TENANCY, "key_content": key_pem,
               "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff", "region": REGION}
        self.provider = OCIProvider(config=cfg, service_endpoint=self.emu.url, compartment_id=COMP,
                                    availability_domains=[AD], retry_strategy=oci.retry.NoneRetryStrategy(),
                                    circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy(),
                                    conflict_wait_s=20.0)

    def addresses(self, node: int) -> tuple[str, str]:
        assert node == 1, f"only rank 1 is rented in a 2-node hybrid run, not {node}"
        return self.vm.ip(0), self.vm.ip(0)

    def security_list_firewall(self, inst: dict[str, Any]) -> list[list[str]]:
        """The cloud's network firewall in front of the VM, from the security lists of its subnet as the emulator
        holds them (stateful ingress rules; what they do not allow never reaches the VM): ``iptables -t mangle``
        rules on the VM's eth0, before its own host firewall.  Tunnel traffic (wg0) is inside the outer UDP."""
        sub = self.emu.objs["subnets"][inst["subnetId"]]
        rules = [["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]]
        for sl in sub.get("securityListIds") or []:
            for r in self.emu.objs["securityLists"][sl].get("ingressSecurityRules") or []:
                src = ["-s", r["source"]]
                if r["protocol"] == "all":
                    rules.append([*src, "-j", "ACCEPT"])
                    continue
                proto, opts = {"6": ("tcp", "tcpOptions"), "17": ("udp", "udpOptions")}[r["protocol"]]
                rng = (r.get(opts) or {}).get("destinationPortRange")
                ports = ["--dport", f"{rng['min']}:{rng['max']}"] if rng else []
                rules.append([*src, "-p", proto, *ports, "-j", "ACCEPT"])
        return [["-A", "PREROUTING", "-i", "eth0", *r] for r in rules] + [["-A", "PREROUTING", "-i", "eth0", "-j",
                                                                            "DROP"]]

    def on_running(self, inst: dict[str, Any]) -> None:
        """cloud-init: the run's SSH key, then the user data run as root inside the VM (before RUNNING shows)."""
        for rule in self.security_list_firewall(inst) if self.enforce_security_list else []:
            subprocess.run(["ip", "netns", "exec", self.vm.ns(0), "iptables", "-t", "mangle", *rule], check=True)
        with open(self.vm.root / "ssh" / "authorized_keys", "a") as f:
            f.write(inst["metadata"]["ssh_authorized_keys"].strip() + "\n")
        self.boot(base64.b64decode(inst["metadata"]["user_data"]).decode())

    def boot(self, ud: str) -> None:
        """The boot script run as root inside the VM, then (``image_firewall``) the image's rules restored."""
        self.user_data.append(ud)
        script = self.tmp / f"user-data-{len(self.user_data)}.sh"
        script.write_text(ud)
        path = f"{Path(os.sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        p = subprocess.run(["nsenter", "-t", str(self.vm.sshd_pids[0]), "-m", "-n", "-u", "--", "env", "-i",
                            f"PATH={path}", "HOME=/root", "bash", str(script)], capture_output=True, text=True,
                           timeout=120)
        self.boots.append((p.returncode, p.stdout + p.stderr))
        if self.image_firewall:
            ipt = ["ip", "netns", "exec", self.vm.ns(0), "iptables"]
            subprocess.run([*ipt, "-F", "INPUT"], check=True)
            port = next(ln.split("=")[1].strip() for ln in ud.splitlines() if ln.startswith("ListenPort"))
            for rule in OCI_IMAGE_INPUT[:-1] + [["-p", "udp", "--dport", port, "-j", "ACCEPT"], OCI_IMAGE_INPUT[-1]]:
                subprocess.run([*ipt, "-A", "INPUT", *rule], check=True)

    def say(self, line: str) -> None:
        self.lines.append(line)
        if line.startswith("WireGuard up on this machine"):  # node 0's key, to prove it is never stored
            for p in Path(os.environ["BROKER_HOME"]).glob("runs/*/wg/node0.conf"):
                self.node0_key = next(ln.split("=", 1)[1].strip() for ln in p.read_text().splitlines()
                                      if ln.startswith("PrivateKey"))

    def run(self, recipe_path: Path, **kw: Any):
        recipe = load_recipe(recipe_path)
        req = recipe.requirements()
        options = [o for o in plan(req, self.provider.offers(req), now=utcnow()).options
                   if o.valid and o.topology.value == "hybrid"]
        assert options, f"no hybrid {self.provider.name} option"
        assert len(options[0].offers) == 1  # node 0 is this machine: one VM rented
        ledger = Ledger()
        target = CloudHybridTarget(recipe, options[:1], providers={self.provider.name: self.provider}, poll_s=0.2,
                                   **kw)
        out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks(echo=self.lines.append, say=self.say))
        return out, ledger


#: the GCE VM's login user: the ``ssh-keys`` metadata user, whom the guest agent gives passwordless sudo
GCP_LOGIN = "broker"


class GCPCloud(Cloud):
    """The same VM behind the GCP emulator and the real gcp adapter: the guest agent adds the ``ssh-keys`` user's
    key; the ``startup-script``'s onstart part (the WireGuard lines) runs as root (its dead-man switch and idle stop
    are left out: they would run on this machine's file system)."""

    def cloud(self, key_pem: str) -> None:
        from google.auth.credentials import AnonymousCredentials

        from broker.providers.gcp import GCPProvider
        from tests.support.gcp_emulator import GCPEmulator

        self.enforce_security_list = False
        self.emu = GCPEmulator(project="broker-hybrid", addresses=self.addresses, on_running=self.on_running)
        self.emu.__enter__()  # its address is known once it serves
        self.provider = GCPProvider(project="broker-hybrid", credentials=AnonymousCredentials(),
                                    compute_endpoint=self.emu.url, ssh_user=GCP_LOGIN, poll_s=0.05)

    def on_running(self, inst: dict[str, Any]) -> None:
        md = {i["key"]: i["value"] for i in inst["metadata"]["items"]}
        user, _, key = md["ssh-keys"].partition(":")
        assert user == GCP_LOGIN, user
        with open(self.vm.root / "ssh" / "authorized_keys", "a") as f:
            f.write(key.strip() + "\n")
        script = md["startup-script"]
        self.boot("#!/bin/bash\n" + script.split("# broker: onstart\n", 1)[1].split("# broker: boot finished", 1)[0])


@pytest.fixture
def cloud_factory(vm, tmp_path, key_pem):
    made: list[Cloud] = []

    def make(**kw: Any) -> Cloud:
        c = Cloud(vm, tmp_path, key_pem, **kw)
        c.emu.__enter__()
        made.append(c)
        return c

    yield make
    for c in made:
        c.emu.__exit__()


def ddp_recipe(tmp_path: Path) -> Path:
    """recipes/ddp_2node.yaml as shipped, with topology hybrid and 3 epochs (CPU, userspace WireGuard)."""
    work = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__"))
    text = (work / "ddp_2node.yaml").read_text()
    text = text.replace('args: ["--epochs", "12", "--min-accuracy", "0.85"]', 'args: ["--epochs", "3"]')
    text = text.replace("topology: any", "topology: hybrid").replace('  - "heldout_accuracy=0\\\\.(8[5-9]|9\\\\d)"\n', "")
    assert "topology: hybrid" in text and '"--epochs", "3"' in text, text
    r = work / "hybrid.yaml"
    r.write_text(text)
    return r


def wg_procs(iface: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "wireguard-go"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if iface in ln.split()]


def link_exists(iface: str) -> bool:
    return subprocess.run(["ip", "link", "show", iface], capture_output=True).returncode == 0


def no_secret_under_home(*secrets: str) -> None:
    home = Path(os.environ["BROKER_HOME"])
    for f in home.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            for s in secrets:
                assert s.encode() not in data, f"a secret is stored in {f}"


# ------------------------------------------------------------------------------------------------ wireguard
def test_wireguard_hybrid_on_oci_rank0_here_rank1_in_the_vm(cloud_factory, tmp_path, monkeypatch):
    """On a VM whose login user is the image's (sudo, no root login) and whose image rejects in INPUT what is not
    SSH: broker opens the tunnel's interface in that host firewall (sudo) and the job runs over the tunnel."""
    import ipaddress

    c = cloud_factory(image_firewall=True)
    monkeypatch.setenv("BROKER_PUBLIC_IP", c.vm.gateway)  # what the VM sees as this machine's address
    out, ledger = c.run(ddp_recipe(tmp_path))
    res = out.result
    print("\n".join(c.lines))  # the run as a user sees it (pytest -s)
    assert res is not None and res.ok, (res and res.reason, c.boots, c.lines[-40:])
    assert [(r.node, r.rank, r.world_size) for r in res.ranks] == [(0, 0, 2), (1, 1, 2)]
    cl = out.cluster
    assert cl.nodes[0].local and not cl.nodes[1].local and cl.topology.value == "hybrid"
    tunnel = ipaddress.ip_network(cl.master_addr + "/24", strict=False)
    assert tunnel.subnet_of(ipaddress.ip_network("198.18.0.0/15")) and cl.master_addr.endswith(".1")
    assert cl.nodes[1].private_ip == str(tunnel.network_address + 2)
    iface = cl.nodes[0].env["GLOO_SOCKET_IFNAME"]
    assert iface.startswith("bkwg") and cl.nodes[1].env["GLOO_SOCKET_IFNAME"] == "wg0"
    assert all(n.env["NCCL_IB_DISABLE"] == "1" for n in cl.nodes)
    # the VM booted the WireGuard config it was given (wg-quick, since the image has no systemd)
    assert len(c.user_data) == 1 and [b[0] for b in c.boots] == [0], c.boots
    # the image's REJECT is still last in INPUT, and the tunnel interface is accepted before it (broker, via sudo)
    rules = subprocess.run(["ip", "netns", "exec", c.vm.ns(0), "iptables", "-S", "INPUT"], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert rules[1] == "-A INPUT -i wg0 -j ACCEPT" and "REJECT" in rules[-1], rules
    assert "[hybrid] node 1: wg0 accepted in its host firewall (sudo -n as ubuntu)" in c.lines, c.lines
    ud = c.user_data[0]
    assert "[Interface]" in ud and "ListenPort = 51820" in ud and f"Address = {cl.nodes[1].private_ip}/24" in ud
    assert "MTU = 1420" in ud and "wg-quick up wg0" in ud
    # preflight ran the tunnel checks first, and every node's job ran on the tunnel
    pre = json.loads((Path(out.run.run_dir) / "preflight.json").read_text())
    rows = [(r["check"], r["nodes"], r["result"]) for r in pre["checks"]]
    assert ("tunnel", "0<->1", "PASS") in rows and ("tunnel mtu", "0", "PASS") in rows
    assert ("tunnel mtu", "1", "PASS") in rows
    assert any(f"WireGuard up on this machine (wireguard-go, MTU 1420): {iface}" in ln for ln in c.lines), c.lines
    node0_env = (Path(out.run.run_dir) / "here" / out.run.id / "node0" / "env.sh").read_text()
    node1_env = (vm_home(c.vm) / "broker" / out.run.id / "node1" / "env.sh").read_text()
    assert f"GLOO_SOCKET_IFNAME={iface}" in node0_env and "GLOO_SOCKET_IFNAME=wg0" in node1_env
    assert (Path(out.run.run_dir) / "artifacts" / "node0" / "checkpoint.pt").exists()  # collected from here
    # the security list got exactly the WireGuard port, UDP, from this machine's address
    assert len(c.emu.updates) == 1
    rules = c.emu.updates[0][1]["ingressSecurityRules"]
    new = [r for r in rules if r["protocol"] not in ("all", "6")]
    assert new == [{"protocol": "17", "source": f"{c.vm.gateway}/32", "sourceType": "CIDR_BLOCK",
                    "isStateless": False, "description": "broker hybrid: WireGuard from this machine",
                    "udpOptions": {"destinationPortRange": {"min": 51820, "max": 51820}}}], new
    assert len(rules) == 3  # the bootstrap's VCN and SSH rules, kept
    # everything is gone: interface, wireguard-go, keys, instances, ledger rows
    assert not link_exists(iface) and wg_procs(iface) == []
    assert not (Path(out.run.run_dir) / "wg").exists()
    assert [i["lifecycleState"] for i in c.emu.objs["instances"].values()] == ["TERMINATED"]
    assert ledger.resources(out.run.id, live_only=True) == [] and out.left == []
    kinds = sorted(r.kind for r in ledger.resources(out.run.id))
    assert kinds == ["instance", "internet_gateway", "local_node", "security_list", "subnet", "vcn"], kinds
    assert out.run.status == "succeeded"
    # no private key in the ledger, logs or run folder (node 0's was read while it existed; node 1's is in the
    # user data only)
    vm_key = next(ln.split("=", 1)[1].strip() for ln in ud.splitlines() if ln.startswith("PrivateKey"))
    assert c.node0_key and vm_key
    no_secret_under_home(c.node0_key, vm_key)


def test_wireguard_hybrid_on_gcp_whose_login_is_the_ssh_keys_user(netns_hosts, tmp_path, key_pem, monkeypatch):
    """The same run on a Compute Engine VM (the real gcp adapter, the GCP emulator): the boot lines come in the
    startup-script, the login user is the ssh-keys one with sudo, and everything rented is deleted."""
    pytest.importorskip("google.cloud.compute_v1")
    c = GCPCloud(netns_hosts(1, login_user=GCP_LOGIN), tmp_path, key_pem)
    monkeypatch.setenv("BROKER_PUBLIC_IP", c.vm.gateway)
    try:  # the emulator serves since GCPCloud.cloud
        out, ledger = c.run(ddp_recipe(tmp_path))
        res = out.result
        assert res is not None and res.ok, (res and res.reason, c.boots, c.lines[-40:])
        assert [(r.node, r.rank, r.world_size) for r in res.ranks] == [(0, 0, 2), (1, 1, 2)]
        assert [b[0] for b in c.boots] == [0] and "wg-quick up wg0" in c.user_data[0], c.boots
        pre = json.loads((Path(out.run.run_dir) / "preflight.json").read_text())
        rows = [(r["check"], r["nodes"], r["result"]) for r in pre["checks"]]
        assert ("tunnel", "0<->1", "PASS") in rows and ("tunnel mtu", "1", "PASS") in rows, rows
        assert (vm_home(c.vm).parent / GCP_LOGIN / "broker" / out.run.id / "node1" / "env.sh").exists()
        rules = [pth for m, pth, st in c.emu.journal if m == "POST" and pth.endswith("/firewalls")]
        assert len(rules) >= 1
        live = {k: c.emu.live(k) for k in ("instances", "disks", "networks", "subnetworks", "firewalls")}
        assert live == {k: [] for k in live}, live
        assert ledger.resources(out.run.id, live_only=True) == [] and out.left == []
        assert out.run.status == "succeeded"
    finally:
        c.emu.__exit__()


# ------------------------------------------------------------------------------------------------ tailscale
def test_tailscale_mesh_vm_runs_tailscale_up_with_the_authkey(cloud_factory, tmp_path, monkeypatch):
    c = cloud_factory(vm_tailscale=True)
    here = tmp_path / "here-bin"
    # this machine: already on the "tailnet" (stood in by the netns bridge: its address is on <cid>br)
    tailscale_standin(here / "tailscale", address=c.vm.gateway, state=None)
    monkeypatch.setenv("PATH", f"{here}:{os.environ['PATH']}")
    authkey = "tskey-auth-kTEST" + os.urandom(8).hex()
    monkeypatch.setenv("TS_AUTHKEY", authkey)
    recipe = ddp_recipe(tmp_path)
    out, ledger = c.run(recipe, mesh="tailscale")
    res = out.result
    assert res is not None and res.ok, (res and res.reason, c.boots, c.lines[-40:])
    assert [(r.node, r.rank) for r in res.ranks] == [(0, 0), (1, 1)]
    # the VM's boot ran the stand-in's `tailscale up` with the key (it kept only its hash) and the run's hostname
    got = json.loads(c.ts_state.read_text())
    assert got["authkey_sha256"] == hashlib.sha256(authkey.encode()).hexdigest()
    assert got["hostname"] == f"broker-{out.run.id}-node1"
    cl = out.cluster
    assert cl.master_addr == c.vm.gateway and cl.nodes[0].env["GLOO_SOCKET_IFNAME"] == f"{c.vm.cid}br"
    assert cl.nodes[1].private_ip == c.vm.ip(0) and cl.nodes[1].env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert c.emu.updates == []  # no port opened: the tailnet needs none
    assert not (Path(out.run.run_dir) / "wg").exists() and not any(ln.startswith("WireGuard up") for ln in c.lines)
    assert [i["lifecycleState"] for i in c.emu.objs["instances"].values()] == ["TERMINATED"]
    assert ledger.resources(out.run.id, live_only=True) == []
    no_secret_under_home(authkey)


# ------------------------------------------------------------------------------------------------ SIGKILL
def _run_in_child(c: Cloud, recipe: Path) -> None:  # pragma: no cover - runs in the forked child
    c.run(recipe)
    os._exit(0)


def _job_procs(run_id: str) -> list[int]:
    """Processes whose environment carries the run's id and node rank 0: node 0's torchrun and workers (the VM's
    rank 1 shares this /proc: it is a namespace here, ended with the VM by the fixture)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                env = (p / "environ").read_bytes().split(b"\0")
                if f"BROKER_RUN_ID={run_id}".encode() in env and b"BROKER_NODE_RANK=0" in env:
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def test_sigkill_of_broker_run_then_broker_down_cleans_this_machine(cloud_factory, tmp_path, monkeypatch, key_pem):
    """`broker run` killed with SIGKILL mid-job leaves the tunnel, wireguard-go, the keys and node 0's job on this
    machine; `broker down RUN` (a new process, from the ledger alone) removes all of it and the VM."""
    import multiprocessing
    import signal

    from tests.conftest import broker_cmd
    from tests.e2e.test_oci_e2e import oci_config_file

    c = cloud_factory()
    monkeypatch.setenv("BROKER_PUBLIC_IP", c.vm.gateway)
    work = tmp_path / "sleepy"
    work.mkdir()
    (work / "job.py").write_text("import time\nprint('SLEEPING', flush=True)\ntime.sleep(600)\n")
    r = tmp_path / "sleepy.yaml"
    r.write_text(f"name: sleepy\nscript: {work / 'job.py'}\nworkdir: {work}\nnodes: 2\ngpus_per_node: 1\n"
                 "cpu_ok: true\ntopology: hybrid\nmax_hours: 0.1\nbudget_usd: 20\n")
    home = Path(os.environ["BROKER_HOME"])
    child = multiprocessing.get_context("fork").Process(target=_run_in_child, args=(c, r))
    child.start()
    try:
        end = time.monotonic() + 240
        while not any("SLEEPING" in f.read_text() for f in home.glob("runs/*/node0.log")):
            assert child.is_alive() and time.monotonic() < end, ("the run did not reach its job", c.boots)
            time.sleep(0.3)
        run_dir = next(home.glob("runs/*/node0.log")).parent
        run_id = run_dir.name
        conf = (run_dir / "wg" / "node0.conf").read_text()
        node0_key = next(ln.split("=", 1)[1].strip() for ln in conf.splitlines() if ln.startswith("PrivateKey"))
        cl = json.loads((run_dir / "cluster.json").read_text())
        name = cl["nodes"][0]["env"]["GLOO_SOCKET_IFNAME"]
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        # what the dead CLI left on this machine
        assert link_exists(name) and wg_procs(name) and (run_dir / "wg" / "node0.conf").exists()
        assert _job_procs(run_id), "node 0's job outlives the CLI"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONWARNINGS="ignore", OCI_CONFIG_FILE=str(oci_config_file(tmp_path, key_pem)),
                   OCI_SERVICE_ENDPOINT=c.emu.url, OCI_COMPARTMENT_ID=COMP)
        d = subprocess.run(broker_cmd("down", run_id), env=env, capture_output=True, text=True, timeout=180)
        assert d.returncode == 0, d.stdout[-3000:] + d.stderr[-3000:]
        end = time.monotonic() + 10
        while (link_exists(name) or wg_procs(name) or _job_procs(run_id)) and time.monotonic() < end:
            time.sleep(0.2)
        left = {p: (Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200]) for p in _job_procs(run_id)}
        assert not link_exists(name) and wg_procs(name) == [] and left == {}, (left, d.stdout[-2000:])
        assert not (run_dir / "wg").exists()
        assert [i["lifecycleState"] for i in c.emu.objs["instances"].values()] == ["TERMINATED"]
        assert Ledger().resources(run_id, live_only=True) == []
        no_secret_under_home(node0_key)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        for pid in _job_procs(run_id) if "run_id" in locals() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if "name" in locals() and link_exists(name):
            subprocess.run(["ip", "link", "del", name])
        for ln in wg_procs(locals().get("name", "-")):
            os.kill(int(ln.split()[0]), signal.SIGKILL)


def test_without_the_udp_rule_preflight_names_the_port_and_everything_is_torn_down(cloud_factory, tmp_path,
                                                                                   monkeypatch):
    """The security list is enforced in front of the VM: an adapter that did not open the WireGuard port leaves
    the tunnel without a handshake; preflight says so (UDP 51820) and nothing is launched or left behind."""
    c = cloud_factory()
    monkeypatch.setenv("BROKER_PUBLIC_IP", c.vm.gateway)
    opened: list[Any] = []
    monkeypatch.setattr(type(c.provider), "open_ingress", lambda self, net, rules, rec: opened.append(rules))
    t0 = time.monotonic()
    out, ledger = c.run(ddp_recipe(tmp_path))
    assert opened and [(r.protocol, r.port) for r in opened[0]] == [("udp", 51820)]
    res = out.result
    assert res is not None and not res.ok and res.exit_codes == {}, res  # nothing was started
    assert "preflight failed" in res.reason and "UDP port 51820 is blocked" in res.reason, res.reason
    assert [b[0] for b in c.boots] == [0]  # the VM's WireGuard itself came up
    assert time.monotonic() - t0 < 120
    iface = out.cluster.nodes[0].env["GLOO_SOCKET_IFNAME"]
    assert not link_exists(iface) and wg_procs(iface) == [] and not (Path(out.run.run_dir) / "wg").exists()
    assert [i["lifecycleState"] for i in c.emu.objs["instances"].values()] == ["TERMINATED"]
    assert ledger.resources(out.run.id, live_only=True) == [] and out.left == []
