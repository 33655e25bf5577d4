"""A preempted interruptible run on the REAL OCI adapter (the real ``oci`` SDK against tests/support/oci_emulator.py),
driven through broker's restart loop (:func:`broker.run.attempts.run_attempts`), whose instances are netns hosts with
a real sshd (the harness of tests/e2e/test_oci_e2e.py).

OCI reclaims the first preemptible instance mid-run once a checkpoint generation has been copied back: the emulator
turns it TERMINATING -> TERMINATED with no reason on the instance (as OCI does) and its host dies (every process in
its namespace).  broker must read that as a preemption (OCI's word through ``preemption()``, not a crash), record
it, tear down what is left of the attempt (the other instance, the subnet, security list, gateway and VCN, in the
adapter's order), rent again, restore the checkpoint, and the shipped recipes/ddp_train.py resumes and exits 0.
Then: preempted twice in a row with OCI also reclaiming instances while broker terminates them (teardown meets 409
IncorrectState); and a terminate by the watchdog (another adapter object, as another process has) which is the
deadline, never a preemption, and never rents again."""

from __future__ import annotations

import re
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

oci = pytest.importorskip("oci")

from broker.core.model import utcnow  # noqa: E402
from broker.core.recipe import load_recipe  # noqa: E402
from broker.money.ledger import Ledger  # noqa: E402
from broker.run.attempts import attempt_costs  # noqa: E402
from broker.run.checkpoint import latest_generation  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.e2e.test_oci_e2e import AD, COMP, E2E  # noqa: E402
from tests.support.netns_faults import kill_host, rehost  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]

NETWORK = ("subnets", "securityLists", "internetGateways", "vcns")


class PreemptE2E(E2E):
    """:class:`E2E` whose every launch gets a fresh netns host (a reclaimed VM does not come back) and whose
    instances' hosts die when OCI (or anyone) terminates them."""

    def __init__(self, hosts: Any, tmp_path: Path, key_pem: str):
        self.used = 0
        super().__init__(hosts, tmp_path, key_pem)
        self.emu.on_terminating = self.host_dies
        self.killed: list[int] = []

    def addresses(self, node: int) -> tuple[str, str]:
        i, self.used = self.used, self.used + 1
        assert i < self.hosts.n, f"launch {i + 1} but the test made {self.hosts.n} hosts"
        return self.hosts.ip(i), self.hosts.ip(i)

    def host_dies(self, inst: dict[str, Any]) -> None:
        ip = self.emu.private_ip(inst["id"])
        i = next(k for k in range(self.hosts.n) if self.hosts.ip(k) == ip)
        kill_host(self.hosts.ns(i))
        self.killed.append(i)


class RecycledAddresses(PreemptE2E):
    """OCI reuses freed private addresses: the instances of a later attempt get the earlier ones' addresses, each
    a new machine there (its host made again with a new SSH host key)."""

    def addresses(self, node: int) -> tuple[str, str]:
        i, self.used = self.used % self.hosts.n, self.used + 1
        if self.used > self.hosts.n:
            self.new_keys.append(rehost(self.hosts, i))
        return self.hosts.ip(i), self.hosts.ip(i)

    def host_dies(self, inst: dict[str, Any]) -> None:
        ip = self.emu.private_ip(inst["id"])
        # only the machine that holds the address now takes its host down with it
        holders = [i for i in list(self.emu.objs["instances"]) if self.emu.private_ip(i) == ip]
        if holders and holders[-1] == inst["id"]:
            super().host_dies(inst)


def _recipe(tmp_path: Path, epochs: int = 60):
    # 60 epochs: the first attempt is reclaimed at its first checkpoint copy (a few epochs in, on a loaded host too);
    # every epoch more is only the resumed attempt training longer
    work = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    (work / "r.yaml").write_text(
        f"name: oci-preempt\nscript: ddp_train.py\nargs: [--epochs, '{epochs}', --resume-dir, ck]\nnodes: 2\n"
        "cpu_ok: true\ntopology: multi-node\nbudget_usd: 20\nmax_hours: 0.25\n"
        "interruptible: true\ncheckpoint_dir: ck\ncheckpoint_every_s: 1\n"
        "env: {DDP_TIMEOUT_S: '60', PYTHONWARNINGS: ignore}\nexpect: ['DDP_OK']\n")
    return load_recipe(work / "r.yaml")


@pytest.fixture
def make(netns_hosts, tmp_path, key_pem, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    made: list[PreemptE2E] = []

    def mk(n_hosts: int) -> PreemptE2E:
        e = PreemptE2E(netns_hosts(n_hosts), tmp_path, key_pem)
        e.emu.__enter__()
        made.append(e)
        return e

    yield mk
    for e in made:
        e.close()


def _when_checkpointed(e: PreemptE2E, then: Any, times: int = 1, timeout_s: float = 240.0) -> threading.Thread:
    """A thread that, ``times`` times, waits until the job of the attempt now running has started (its node 0 log
    says where it resumed from) and a checkpoint generation has been copied back since, then calls ``then(e)``."""
    def go() -> None:
        deadline = time.monotonic() + timeout_s
        started: dict[tuple[str, ...], float] = {}  # the attempt's instances -> when its job was seen running
        for _ in range(times):
            while time.monotonic() < deadline:
                time.sleep(0.05)
                live = tuple(e.emu.preemptible())
                runs = Ledger().list_runs()
                if len(live) != 2 or not runs or not runs[0].run_dir:
                    continue
                log = Path(runs[0].run_dir, "node0.log")
                if live not in started:
                    if log.exists() and re.search(r"resumed_from_epoch=|start_epoch=0", log.read_text(errors="replace")):
                        started[live] = time.time()
                    continue
                gen = latest_generation(Path(runs[0].run_dir))
                if gen is not None and gen.stat().st_mtime > started[live]:
                    then(e)
                    break

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _reclaim_first(e: PreemptE2E) -> None:
    e.emu.preempt(e.emu.preemptible()[0])


def _resumed_from(log: Path) -> int:
    """The epoch rank 0 resumed from; 0 for a first attempt, which says it starts from scratch."""
    text = log.read_text()
    m = re.search(r"resumed_from_epoch=(\d+)", text)
    if m is None:
        assert "start_epoch=0 (no checkpoint to resume from yet)" in text, text[-1500:]
        return 0
    return int(m[1])


def _nothing_left(e: PreemptE2E, out: Any, ledger: Ledger) -> None:
    assert out.left == [], out.left
    assert ledger.resources(out.run.id, live_only=True) == []
    live = {c: [o["id"] for o in e.emu.live(c)] for c in ("instances", *NETWORK)}
    assert live == {c: [] for c in live}, live


def test_oci_reclaims_an_instance_mid_run_broker_rents_again_and_ddp_resumes(make, tmp_path):
    e = make(4)
    t = _when_checkpointed(e, _reclaim_first)
    out, ledger = e.run(_recipe(tmp_path), monitor_s=0.5, ready_timeout_s=60)
    t.join(timeout=5)
    first = e.emu.preempted()
    assert len(first) == 1, e.said[-20:]
    run_dir = Path(out.run.run_dir)
    assert out.exit_code == 0, (out.result.reason, e.said[-20:], (run_dir / "node0.log").read_text()[-1500:])
    assert _resumed_from(run_dir / "attempt1" / "node0.log") == 0
    assert _resumed_from(run_dir / "node0.log") > 0  # attempt 2 started from the copied checkpoint
    rows = ledger.attempts(out.run.id)
    assert [a["cause"] for a in rows] == ["preempted", "succeeded"], rows
    assert "OCI reclaimed preemptible instance" in rows[0]["detail"] and first[0] in rows[0]["detail"]
    assert any("renting again: attempt 2" in s and "resumes from checkpoint gen-" in s for _, s in e.said)
    # each attempt rented its own network and two preemptible instances, all in the ledger and each costed
    res = {r.id: r for r in ledger.resources(out.run.id)}
    kinds = [sorted(res[i].kind for i in a["resource_ids"]) for a in rows]
    assert kinds == [["instance", "instance", "internet_gateway", "security_list", "subnet", "vcn"]] * 2, kinds
    inst = [[res[i].provider_id for i in a["resource_ids"] if res[i].kind == "instance"] for a in rows]
    assert first[0] in inst[0] and not set(inst[0]) & set(inst[1])
    launched = [i for i in e.emu.objs["instances"].values() if i.get("preemptibleInstanceConfig")]
    assert len(launched) == 4 and len(e.emu.objs["instances"]) == 4
    costs = attempt_costs(ledger, out.run.id)
    assert all(a["usd"] > 0 for a in costs), costs
    assert sum(a["usd"] for a in costs) == pytest.approx(out.cost_usd, rel=0.05)
    # teardown terminates every instance once (idempotent): the reclaimed one answers 409 IncorrectState (OCI
    # already ended it) and is confirmed gone all the same
    deletes = {p.split("/")[-1]: st for m, p, st in e.emu.journal if m == "DELETE" and "/instances/" in p}
    assert deletes == {**{i: 204 for a in inst for i in a}, first[0]: 409}, deletes
    _nothing_left(e, out, ledger)
    assert out.run.status == "succeeded"


def test_a_reclaimed_instance_rented_again_on_its_old_address_with_a_new_host_key_resumes(netns_hosts, tmp_path,
                                                                                           key_pem, monkeypatch):
    """The instances rented again get the reclaimed ones' private addresses with new host keys: new machines,
    reached at once (pinned by resource id), and the job resumes from its checkpoint."""
    from broker.core.sshkeys import host_key_name, pinned_keys

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    e = RecycledAddresses(netns_hosts(2), tmp_path, key_pem)
    e.new_keys = []
    e.emu.__enter__()
    try:
        t = _when_checkpointed(e, _reclaim_first)
        out, ledger = e.run(_recipe(tmp_path), monitor_s=0.5, ready_timeout_s=60)
        t.join(timeout=5)
        run_dir = Path(out.run.run_dir)
        assert out.exit_code == 0, (out.result.reason, e.said[-20:], (run_dir / "node0.log").read_text()[-1500:])
        assert _resumed_from(run_dir / "node0.log") > 0
        assert [a["cause"] for a in ledger.attempts(out.run.id)] == ["preempted", "succeeded"]
        assert len(e.new_keys) == 2  # both addresses held by new machines with new host keys
        kh = run_dir / "ssh" / "known_hosts"
        rows = [r for r in ledger.resources(out.run.id) if r.kind == "instance"]
        pins = {r.id: pinned_keys(kh, host_key_name(r.attrs.get("private_ip") or "", 22, r.id)) for r in rows}
        assert sorted(k for v in pins.values() for k in v if k in e.new_keys) == sorted(e.new_keys), pins
        assert not any("not trusted" in s or "host key" in s for _, s in e.said)
        _nothing_left(e, out, ledger)
    finally:
        e.close()


def test_preempted_twice_in_a_row_and_reclaimed_during_teardown_still_resumes(make, tmp_path):
    e = make(6)
    # every time broker terminates the surviving instance of a preempted attempt, OCI reclaims it first
    e.emu.reclaim_on_terminate = 2
    t = _when_checkpointed(e, _reclaim_first, times=2)
    out, ledger = e.run(_recipe(tmp_path, epochs=80), monitor_s=0.5, ready_timeout_s=60)
    t.join(timeout=5)
    run_dir = Path(out.run.run_dir)
    assert out.exit_code == 0, (out.result.reason, e.said[-20:], (run_dir / "node0.log").read_text()[-1500:])
    rows = ledger.attempts(out.run.id)
    assert [a["cause"] for a in rows] == ["preempted", "preempted", "succeeded"], rows
    # four reclaims: two mid-run, two while broker's terminate was on its way (409 IncorrectState answered)
    assert len(e.emu.preempted()) == 4 and e.emu.reclaim_on_terminate == 0
    deletes: dict[str, int] = {}  # each instance's first terminate answer
    for m, p, st in e.emu.journal:
        if m == "DELETE" and "/instances/" in p:
            deletes.setdefault(p.split("/")[-1], st)
    assert {i for i, st in deletes.items() if st == 409} == set(e.emu.preempted()), deletes
    assert len(deletes) == 6 and list(deletes.values()).count(204) == 2, deletes  # attempt 3's two
    second, final = _resumed_from(run_dir / "attempt2" / "node0.log"), _resumed_from(run_dir / "node0.log")
    assert _resumed_from(run_dir / "attempt1" / "node0.log") == 0 and 0 < second < final
    assert len(e.emu.objs["instances"]) == 6 and sorted(e.killed) == list(range(6))
    assert all(a["usd"] > 0 for a in attempt_costs(ledger, out.run.id))
    _nothing_left(e, out, ledger)


def test_a_watchdog_terminate_of_a_preemptible_instance_is_the_deadline_not_a_preemption(make, tmp_path, key_pem):
    """The watchdog (its own adapter object, as in its own process) finds the deadline passed and terminates the
    run's preemptible instances mid-run: OCI's Instance says TERMINATED with no reason, as after a reclaim, but the
    ledger says broker's watchdog ended them: the run ends at the deadline, with one attempt and nothing rented
    again."""
    from broker.money.watchdog import Watchdog
    from broker.providers.oci import OCIProvider
    from broker.run.guard import NodeLost
    from tests.support.clock import FakeClock

    e = make(4)
    theirs = OCIProvider(config=e.cfg, service_endpoint=e.emu.url, compartment_id=COMP, availability_domains=[AD],
                         retry_strategy=oci.retry.NoneRetryStrategy(),
                         circuit_breaker_strategy=oci.circuit_breaker.NoCircuitBreakerStrategy(), conflict_wait_s=20.0)
    passes: list[Any] = []

    def watchdog_at_deadline(e: PreemptE2E) -> None:
        wd = Watchdog(Ledger(), providers={"oci": theirs}, clock=FakeClock(utcnow() + timedelta(hours=1)),
                      confirm_timeout_s=20.0)
        passes.append(wd.run_once())

    t = _when_checkpointed(e, watchdog_at_deadline)
    out = None
    try:
        out, ledger = e.run(_recipe(tmp_path), monitor_s=0.5, ready_timeout_s=60)
    except NodeLost as err:  # the node watch saw an instance TERMINATED before its SSH connection dropped
        assert "watchdog" in err.message and "not a preemption" in err.message, err.message
        ledger = Ledger()
    t.join(timeout=30)
    assert passes, e.said[-20:]
    ended = [a for a in passes[0] if a.kind == "terminate" and a.ok]
    assert all("deadline passed" in a.reason for a in ended), passes
    assert len([a for a in ended if ".instance." in a.provider_id]) == 2, passes
    assert e.emu.preempted() == []  # OCI reclaimed nothing
    (run,) = ledger.list_runs()
    rows = ledger.attempts(run.id)
    assert [a["cause"] for a in rows] == ["deadline"], rows
    assert "terminated by broker's watchdog" in rows[0]["detail"] and "not a preemption" in rows[0]["detail"]
    assert not any("preempted" in s or "renting again" in s for _, s in e.said), e.said
    assert len(e.emu.objs["instances"]) == 2  # nothing rented again
    assert run.status == "deadline" and run.message.startswith("watchdog: deadline passed"), run.message
    assert out is None or (out.exit_code == 1 and out.left == [])
    # the watchdog ends the run; what it has not reached yet the run's own teardown releases ("cli"), which one
    # gets an instance is a race between two broker processes: never the provider's (a preemption's) end
    by = {r.terminated_by for r in ledger.resources(run.id) if r.kind == "instance"}
    assert "watchdog" in by and by <= {"watchdog", "cli"}, by
    assert ledger.resources(run.id, live_only=True) == []
    live = {c: [o["id"] for o in e.emu.live(c)] for c in ("instances", *NETWORK)}
    assert live == {c: [] for c in live}, live
