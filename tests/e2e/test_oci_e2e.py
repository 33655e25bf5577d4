"""The REAL OCI adapter end to end through the whole pipeline.

``run_pipeline(recipe, CloudTarget(...))`` with the real ``oci`` SDK pointed (``service_endpoint``) at a stateful
local emulator of the Compute / VirtualNetwork / Identity calls (:mod:`tests.support.oci_emulator`): bootstrap of the run's
network, two instances (multi-node), the SSH executor, teardown.  The "instances" are two network-namespace hosts
with real sshd (:func:`broker.providers.netns.up`); the emulator's VNICs give each instance a private IP = the netns
host's address and a public IP that reaches that host's sshd on port 22 (the adapter's SSH port is always 22): the
host's own address, or (case 1) a loopback address 127.x.y.z whose port 22 refuses until sshd "starts".
Credentials are made by the test (a throwaway RSA key); nothing leaves 127.0.0.0/8 and the namespaces.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

oci = pytest.importorskip("oci")

from broker.money.ledger import Ledger  # noqa: E402
from broker.core.model import utcnow  # noqa: E402
from broker.run.cloudtarget import CloudTarget
from broker.run.runrecord import Hooks
from broker.run.pipeline import run_pipeline  # noqa: E402
from broker.plan.planner import plan  # noqa: E402
from broker.core.provider import INSTALL_TAG, RUN_TAG  # noqa: E402
from broker.core.recipe import load_recipe  # noqa: E402
from tests.conftest import REPO, broker_cmd  # noqa: E402
from tests.support.netfwd import LateForwarder  # noqa: E402
from tests.support.oci_emulator import OCIEmulator  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]

TENANCY = "ocid1.tenancy.oc1..aaaaaaaatenancy"
COMP = "ocid1.compartment.oc1..aaaaaaaae2e"
AD = "Uocm:US-ASHBURN-AD-1"
REGION = "us-ashburn-1"


@pytest.fixture
def hosts(netns_hosts):
    """Two netns hosts with sshd: the "instances" (tests/conftest.py netns_hosts)."""
    return netns_hosts(2)


def oci_config_file(tmp_path: Path, key_pem: str) -> Path:
    key = tmp_path / "oci" / "key.pem"
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_text(key_pem)
    key.chmod(0o600)
    cfg = tmp_path / "oci" / "config"
    cfg.write_text(f"[DEFAULT]\nuser=ocid1.user.oc1..aaaaaaaauser\n"
                   f"fingerprint=11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff\nkey_file={key}\n"
                   f"tenancy={TENANCY}\nregion={REGION}\n")
    return cfg


def _recipe(tmp_path: Path):
    work = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    (work / "r.yaml").write_text(
        "name: oci-e2e\nscript: ddp_train.py\nargs: ['--epochs', '2']\nnodes: 2\ncpu_ok: true\n"
        "topology: multi-node\nbudget_usd: 20\nmax_hours: 0.2\nenv: {DDP_TIMEOUT_S: '60'}\n"
        "expect: ['ALLREDUCE_OK', 'DDP_OK']\n")
    return load_recipe(work / "r.yaml")


class E2E:
    """The emulator, the real adapter pointed at it and the two netns hosts behind the instances."""

    def __init__(self, hosts: Any, tmp_path: Path, key_pem: str, *, late_s: float | None = None):
        from broker.providers.oci import OCIProvider

        self.hosts, self.tmp_path = hosts, tmp_path
        self.late: dict[int, LateForwarder] = {}
        if late_s is not None:
            net = random.randint(1, 250)
            self.late = {i: LateForwarder((hosts.ip(i), 22), late_s, addr=f"127.77.{net}.{i + 1}", port=22,
                                         start=False) for i in range(2)}
            for f in self.late.values():  # an sshd on *:22 of this machine would take the port
                try:
                    with socket.socket() as s:
                        s.bind((f.addr, 22))
                except OSError as err:
                    pytest.skip(f"cannot listen on {f.addr}:22 ({err}): the late sshd needs that port")
        self.emu = OCIEmulator(compartment=COMP, ads=(AD,), region=REGION, addresses=self.addresses,
                               on_running=self.on_running, login_user="root")
        self.cfg = {"user": "ocid1.user.oc1..aaaaaaaauser", "tenancy": TENANCY, "key_content": key_pem,
                    "fingerprint": "11:22:33:44:55:66:77:88:99:00:aa:bb:cc:dd:ee:ff", "region": REGION}
        self.provider = OCIProvider(config=self.cfg, service_endpoint=self.emu.url, compartment_id=COMP,
                                    availability_domains=[AD], retry_strategy=oci.retry.NoneRetryStrategy(),
                                    circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy(),
                                    conflict_wait_s=20.0)
        self.provider.node_workroot = str(tmp_path / "node-work")
        self.lines: list[str] = []
        self.said: list[tuple[float, str]] = []  # (seconds since start, progress line): where the time goes
        self.t0 = time.monotonic()

    def addresses(self, node: int) -> tuple[str, str]:
        public = self.late[node].addr if self.late else self.hosts.ip(node)
        return public, self.hosts.ip(node)

    def on_running(self, inst: dict[str, Any]) -> None:
        """What cloud-init does on a real VM: the run's key into authorized_keys, the boot script's last line (the
        boot-done marker the SSH executor waits for: OCIProvider.boot_wait_command); and sshd starts late."""
        keys = self.hosts.root / "ssh" / "authorized_keys"
        with open(keys, "a") as f:
            f.write(inst["metadata"]["ssh_authorized_keys"].strip() + "\n")
        work = Path(self.provider.node_workroot)
        work.mkdir(parents=True, exist_ok=True)
        (work / "boot.done").write_text("")
        node = int(inst["freeformTags"]["broker-node"])
        if node in self.late:
            self.late[node].start()

    def say(self, line: str) -> None:
        self.lines.append(line)
        self.said.append((round(time.monotonic() - self.t0, 1), line))

    def run(self, recipe: Any = None, **target_kw: Any):
        """The pipeline on the best valid plan option for ``recipe`` (default: the two-node DDP recipe);
        ``target_kw`` go to CloudTarget (e.g. ``monitor_s``).  Returns (outcome, ledger)."""
        recipe = recipe or _recipe(self.tmp_path)
        req = recipe.requirements()
        options = [o for o in plan(req, self.provider.offers(req), now=utcnow()).options if o.valid]
        assert options, "no OCI plan option for the recipe"
        ledger = Ledger()
        target = CloudTarget(recipe, options[:1], providers={"oci": self.provider}, poll_s=0.2, **target_kw)
        out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks(echo=self.lines.append, say=self.say))
        return out, ledger

    def close(self) -> None:
        for f in self.late.values():
            f.stop.set()
        self.emu.__exit__()


@pytest.fixture
def e2e_factory(hosts, tmp_path, key_pem):
    made: list[E2E] = []

    def make(**kw: Any) -> E2E:
        e = E2E(hosts, tmp_path, key_pem, **kw)
        e.emu.__enter__()
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def assert_nothing_live(e: E2E, out: Any, ledger: Ledger, *, foreign: set[str] = frozenset()) -> None:
    assert out.left == [], out.left
    assert ledger.resources(out.run.id, live_only=True) == []
    live = {c: [o["id"] for o in e.emu.live(c) if o["id"] not in foreign]
            for c in ("instances", "subnets", "securityLists", "internetGateways", "vcns")}
    assert live == {c: [] for c in live}, live
    assert out.run.status == "succeeded"


def assert_ran(out: Any, e: E2E) -> None:
    assert out.result is not None and out.result.ok, (out.result and out.result.reason, e.lines[-30:])
    assert [(r.node, r.rank, r.world_size) for r in out.result.ranks] == [(0, 0, 2), (1, 1, 2)]
    assert out.cluster.master_addr == e.hosts.ip(0)  # node 0's private IP (the emulator's VNIC answer)
    kinds = sorted(r.kind for r in Ledger().resources(out.run.id))
    assert kinds == ["instance", "instance", "internet_gateway", "security_list", "subnet", "vcn"], kinds


# ------------------------------------------------------------------------------------------------ case 1
def test_sshd_late_after_running_the_run_waits_and_succeeds(e2e_factory):
    # 4 s: the first connects are refused (the retries back off 1, 2, 4 s), and the wait ends after ~4-8 s
    e = e2e_factory(late_s=4.0)
    t0 = time.monotonic()
    out, ledger = e.run()
    assert_ran(out, e)
    assert all(f.accepting_at is not None and f.accepting_at - f.running_at >= 3.5 for f in e.late.values())
    assert any("waiting for SSH" in line for line in e.lines), e.said
    assert any("accepts SSH" in line for line in e.lines)
    assert_nothing_live(e, out, ledger)
    assert time.monotonic() - t0 < 90


# ------------------------------------------------------------------------------------------------ case 3
def test_teardown_retries_5xx_and_409_and_deletes_in_dependency_order(e2e_factory):
    e = e2e_factory()
    # Every delete kind answers a 5xx first.  The subnet's delete is asynchronous (TERMINATING for 3 s), so the
    # security list it uses meets a real 409 Conflict; the VCN answers 409 Conflict ("a subnet still exists") once.
    e.emu.subnet_delete_s = 3.0
    e.emu.fail.update({("DELETE", "instances"): [503], ("DELETE", "subnets"): [500, 502],
                       ("DELETE", "securityLists"): [503], ("DELETE", "internetGateways"): [500],
                       ("DELETE", "vcns"): [503, 409]})
    out, ledger = e.run()
    assert_ran(out, e)
    deletes = [(p.split("/")[2], st) for m, p, st in e.emu.journal if m == "DELETE"]
    assert all(not v for v in e.emu.fail.values()), e.emu.fail  # every injected failure was met
    assert ("securityLists", 409) in deletes and ("vcns", 409) in deletes, deletes
    # no 409 anywhere else: nothing of a later rank was tried while something it depends on was live
    assert {c for c, st in deletes if st == 409} == {"securityLists", "vcns"}, deletes
    ok = [c for c, st in deletes if st == 204]
    order = {"instances": 0, "subnets": 1, "securityLists": 2, "internetGateways": 2, "vcns": 3}
    assert [order[c] for c in ok] == sorted(order[c] for c in ok), ok  # dependency order
    assert sorted(ok) == sorted(["instances", "instances", "subnets", "securityLists", "internetGateways", "vcns"])
    assert_nothing_live(e, out, ledger)


# ------------------------------------------------------------------------------------------------ case 2
def test_foreign_installation_instance_is_left_alone_by_reconcile_and_watchdog(e2e_factory, tmp_path, key_pem):
    e = e2e_factory()
    foreign = e.emu.add_instance(tags={RUN_TAG: "r-theirs", INSTALL_TAG: "inst-someone-else"},
                                age_s=30 * 86400)  # older than any age grace: only its installation protects it
    out, ledger = e.run()
    assert_ran(out, e)
    assert_nothing_live(e, out, ledger, foreign={foreign})

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore", OCI_CONFIG_FILE=str(oci_config_file(tmp_path, key_pem)),
               OCI_SERVICE_ENDPOINT=e.emu.url, OCI_COMPARTMENT_ID=COMP)
    outs = []
    for args in (["reconcile", "--terminate", "--yes"], ["watchdog", "--once"]):
        p = subprocess.run(broker_cmd(*args), env=env, capture_output=True, text=True, timeout=60)
        outs.append(p.stdout + p.stderr)
        assert p.returncode == 0, (args, p.stdout[-2000:], p.stderr[-2000:])
    assert [o["id"] for o in e.emu.live("instances")] == [foreign]
    assert e.emu.objs["instances"][foreign]["lifecycleState"] == "RUNNING"
    assert not [j for j in e.emu.journal if j[0] == "DELETE" and foreign in j[1]]
    assert f"other installation: oci instance {foreign} run r-theirs (installation inst-someone-else): left alone" \
        in outs[0], outs[0]
    assert (f"foreign: other installation: oci instance {foreign} (run r-theirs, installation inst-someone-else) is "
            "not this installation's") in outs[1], outs[1]
