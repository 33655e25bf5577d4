"""Provisioning core against the file-backed fake cloud: ledger-first ordering, failover rules, cleanup."""

from __future__ import annotations

import stat
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from tests.support.plans import rank_options
from broker.money.ledger import Ledger
from broker.core.model import Requirements, TopologyKind, utcnow
from broker.core.records import Resource, Run
from broker.core.provider import AuthError, NoValidPlan, OfferGone, ProviderError
from broker.money.provision import provision
from broker.money.reconcile import reconcile
from broker.money.cost import run_spent_usd, spent_usd
from broker.money.teardown import teardown_run
from broker.providers.fake import FakeProvider


@pytest.fixture
def env(tmp_path, fake_cloud):
    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    return tmp_path


@pytest.fixture
def ledger(env, tmp_ledger):
    return tmp_ledger  # env / "ledger.sqlite"


def make_run(ledger: Ledger, tmp: Path, run_id: str = "run-1") -> Run:
    now = utcnow()
    run = Run(id=run_id, name="t", provider="fake", topology="simulated", status="provisioning", created_at=now,
              deadline=now + timedelta(hours=1), run_dir=str(tmp / "runs" / run_id))
    Path(run.run_dir).mkdir(parents=True)
    return ledger.create_run(run)


def options(p: FakeProvider, topology: str = "simulated", nodes: int = 2):
    req = Requirements(nodes=nodes, gpus_per_node=1, cpu_ok=True, topology=topology, budget_usd=100, hours=1)
    return rank_options(p, req)


def live_fake(p: FakeProvider) -> list[str]:
    return [i for i, x in p.instances().items() if x["state"] != "terminated"]


FAST = dict(poll_s=0.02, retry_wait_s=0.01, terminate_timeout_s=5)


# ------------------------------------------------------------------------------------------------ ledger-first
def test_intent_is_in_the_ledger_before_create_and_id_right_after(env, ledger):
    seen = []

    class Checking(FakeProvider):
        def create_instance(self, req):
            row = ledger.resource(req.client_token)  # the idempotency token is the ledger row id
            assert row is not None, "create_instance called before the intent row was written"
            assert row.state == "intent" and row.provider_id is None
            assert row.usd_per_hour == req.offer.usd_per_hour and row.deadline is not None
            assert row.attrs["offer_key"] == req.offer.key and row.attrs["node_index"] == req.node_index
            assert req.tags["broker-run"] == "run-1"
            seen.append(req.client_token)
            return super().create_instance(req)

    p = Checking()
    run = make_run(ledger, env)
    opts = options(p)
    assert opts[0].topology is TopologyKind.simulated
    cluster = provision(opts, run, Requirements(), ledger, providers={"fake": p}, **FAST)
    assert len(seen) == 1
    row = ledger.resource(seen[0])
    assert row.provider_id in p.instances() and row.state == "running" and row.running_since
    acts = [e["action"] for e in ledger.events("run-1") if e["resource_id"] == seen[0]]
    assert acts.index("intent") < acts.index("created") < acts.index("running")
    # simulated: one host, N nodes on 127.0.0.1 with their own GPUs; fake runs locally
    assert [n.gpu_indices for n in cluster.nodes] == [["0"], ["1"]]
    assert {n.private_ip for n in cluster.nodes} == {"127.0.0.1"} and cluster.local_exec
    key = Path(cluster.ssh_key_path)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.parent == Path(run.run_dir) / "ssh"
    # the private key never reaches the ledger
    assert "PRIVATE KEY" not in Path(ledger.path).read_bytes().decode("latin-1")
    assert teardown_run(ledger, "run-1", "test", providers={"fake": p}, poll_s=0.01) == []
    assert live_fake(p) == []


def test_multi_node_bootstraps_network_ledger_first_and_tears_down_in_order(env, ledger):
    p = FakeProvider()
    run = make_run(ledger, env)
    opts = [o for o in options(p, "multi-node") if o.topology is TopologyKind.multi_node]
    cluster = provision(opts, run, Requirements(), ledger, providers={"fake": p}, **FAST)
    rows = ledger.resources("run-1")
    assert [r.kind for r in rows] == ["vcn", "subnet", "instance", "instance"]
    assert all(r.provider_id for r in rows)
    assert len(cluster.nodes) == 2 and cluster.master_addr == cluster.nodes[0].private_ip
    assert cluster.nodes[0].resource_id != cluster.nodes[1].resource_id
    subnet = rows[1].provider_id
    assert all(i["subnet_id"] == subnet for i in p.instances().values())
    assert teardown_run(ledger, "run-1", "test", providers={"fake": p}, poll_s=0.01) == []
    assert live_fake(p) == [] and all(n["state"] == "terminated" for n in p.networks().values())


def test_half_created_multi_node_attempt_is_cleaned_before_failover(env, ledger):
    from broker.core.provider import CapacityError

    class SecondNodeNoCapacity(FakeProvider):
        def create_instance(self, req):
            if req.node_index == 1:
                raise CapacityError(self.name, "create_instance", f"Out of host capacity in {req.offer.zone}")
            return super().create_instance(req)

    p = SecondNodeNoCapacity()
    run = make_run(ledger, env)
    multi = [o for o in options(p, "multi-node") if o.topology is TopologyKind.multi_node]
    simulated = [o for o in options(p) if o.topology is TopologyKind.simulated][:1]
    cluster = provision(multi[:1] + simulated, run, Requirements(), ledger, providers={"fake": p}, **FAST)
    assert cluster.topology is TopologyKind.simulated
    rows = ledger.resources("run-1")
    assert [(r.kind, r.state) for r in rows] == [("vcn", "terminated"), ("subnet", "terminated"),
                                                 ("instance", "terminated"), ("instance", "terminated"),
                                                 ("instance", "running")]
    assert len(live_fake(p)) == 1 and all(n["state"] == "terminated" for n in p.networks().values())


def test_bootstrap_failure_cleans_its_half_network_then_fails_over(env, ledger):
    bad, good = FakeProvider(name="fakeb", fail="bootstrap"), FakeProvider()
    run = make_run(ledger, env)
    opts = [o for o in options(bad, "multi-node") if o.topology is TopologyKind.multi_node][:1] + options(good)[:1]
    cluster = provision(opts, run, Requirements(), ledger, providers={"fakeb": bad, "fake": good}, **FAST)
    assert cluster.provider == "fake"
    vcn = [r for r in ledger.resources("run-1") if r.kind == "vcn"]
    assert vcn and vcn[0].state == "terminated"
    subnet = [r for r in ledger.resources("run-1") if r.kind == "subnet"][0]
    assert subnet.state == "terminated" and subnet.provider_id is None and "injected" in subnet.error
    assert all(n["state"] == "terminated" for n in bad.networks().values())


# ------------------------------------------------------------------------------------------------ failover
def test_capacity_in_zone_1_fails_over_to_zone_2(env, ledger, monkeypatch):
    monkeypatch.setenv("BROKER_FAKE_FAIL", "capacity@fake-zone-1")
    p = FakeProvider()
    run = make_run(ledger, env)
    steps: list[str] = []
    cluster = provision(options(p), run, Requirements(), ledger, providers={"fake": p}, progress=steps.append,
                        **FAST)
    zones = {x["zone"] for x in p.instances().values()}
    assert zones == {"fake-zone-2"} and cluster.provider == "fake"
    first = ledger.resources("run-1")[0]
    assert first.zone == "fake-zone-1" and first.state == "terminated"  # intent resolved: nothing was created
    assert any("capacity" in s for s in steps)


def test_quota_skips_provider_region_and_names_the_quota(env, ledger):
    q, ok = FakeProvider(name="fakeq", fail="quota"), FakeProvider()
    calls = []

    class Counting(FakeProvider):
        def create_instance(self, req):
            calls.append(req.offer.zone)
            return super().create_instance(req)

    q = Counting(name="fakeq", fail="quota")
    run = make_run(ledger, env)
    opts = options(q) + options(ok)  # every fakeq option ranks first
    cluster = provision(opts, run, Requirements(), ledger, providers={"fakeq": q, "fake": ok}, **FAST)
    assert cluster.provider == "fake"
    assert calls == ["fake-zone-1"], "after a quota error the other fakeq options must be skipped"

    run2 = make_run(ledger, env, "run-2")
    with pytest.raises(NoValidPlan) as ei:
        provision(options(q), run2, Requirements(), ledger, providers={"fakeq": q}, **FAST)
    assert "fake-gpu-count" in str(ei.value) and "quota" in str(ei.value).lower()
    assert "skipped" in ei.value.message


def test_offer_gone_tries_the_next_offer(env, ledger):
    class GoneOnce(FakeProvider):
        n = 0

        def create_instance(self, req):
            GoneOnce.n += 1
            if GoneOnce.n == 1:
                raise OfferGone(self.name, "create_instance", f"offer {req.offer.offer_id} was rented by someone else")
            return super().create_instance(req)

    p = GoneOnce()
    run = make_run(ledger, env)
    opts = options(p)
    provision(opts, run, Requirements(), ledger, providers={"fake": p}, **FAST)
    assert GoneOnce.n == 2 and len(p.instances()) == 1
    assert next(iter(p.instances().values()))["zone"] == opts[1].offers[0].zone
    assert any(e["message"] and "rented by someone else" in e["message"] for e in ledger.events("run-1"))


def test_never_ready_instance_is_terminated_then_next_option(env, ledger, monkeypatch):
    monkeypatch.setenv("BROKER_FAKE_FAIL", "failed@fake-zone-1")
    p = FakeProvider()
    run = make_run(ledger, env)
    cluster = provision(options(p), run, Requirements(), ledger, providers={"fake": p}, **FAST)
    insts = p.instances()
    assert len(insts) == 2
    z1 = [i for i in insts.values() if i["zone"] == "fake-zone-1"][0]
    assert z1["state"] == "terminated"
    assert cluster.nodes[0].resource_id == ledger.find_by_provider_id("fake", live_fake(p)[0]).id


def test_ready_timeout_terminates_everything_and_reports_each_attempt(env, ledger, monkeypatch):
    monkeypatch.setenv("BROKER_FAKE_READY_S", "3600")
    p = FakeProvider()
    run = make_run(ledger, env)
    opts = options(p)[:2]
    with pytest.raises(NoValidPlan) as ei:
        provision(opts, run, Requirements(), ledger, providers={"fake": p}, ready_timeout_s=0.2, **FAST)
    assert len(p.instances()) == 2 and live_fake(p) == []
    assert ei.value.message.count("not running after") == 2
    assert ledger.resources("run-1", live_only=True) == []


def test_failed_cleanup_stops_failover_and_names_the_live_resource(env, ledger, monkeypatch):
    monkeypatch.setenv("BROKER_FAKE_FAIL", "failed@fake-zone-1,terminate")
    p = FakeProvider()
    run = make_run(ledger, env)
    with pytest.raises(ProviderError) as ei:
        provision(options(p), run, Requirements(), ledger, providers={"fake": p}, **FAST)
    live = live_fake(p)
    assert len(live) == 1 and len(p.instances()) == 1, "failover must stop: no second machine"
    assert live[0] in str(ei.value) and "broker down run-1" in str(ei.value)
    row = ledger.find_by_provider_id("fake", live[0])
    assert row.live and "HTTP 500" in row.error
    assert ei.value.exit_code == 4


def test_transient_errors_are_retried_before_failing_over(env, ledger):
    p = FakeProvider(fail="transient:2")
    run = make_run(ledger, env)
    steps: list[str] = []
    cluster = provision(options(p)[:1], run, Requirements(), ledger, providers={"fake": p}, progress=steps.append,
                        **FAST)
    assert len(p.instances()) == 1 and cluster.nodes
    assert sum("retry" in s for s in steps) == 2
    # the retried create reuses the same intent row (client token): one row only
    assert len(ledger.resources("run-1")) == 1

    p2 = FakeProvider(fail="transient")
    run2 = make_run(ledger, env, "run-2")
    with pytest.raises(ProviderError) as ei:  # only provider failures (an outage): exit 4, not "no plan"
        provision(options(p2)[:1], run2, Requirements(), ledger, providers={"fake": p2}, transient_attempts=3,
                  **FAST)
    assert not isinstance(ei.value, NoValidPlan) and "HTTP 503" in str(ei.value)
    assert ledger.resources("run-2", live_only=True) == []


def test_auth_error_skips_the_provider(env, ledger):
    class NoAuth(FakeProvider):
        def create_instance(self, req):
            raise AuthError(self.name, "create_instance", "HTTP 401", hint="set FAKE_KEY")

    bad, good = NoAuth(name="fakea"), FakeProvider()
    run = make_run(ledger, env)
    steps: list[str] = []
    cluster = provision(options(bad) + options(good), run, Requirements(), ledger,
                        providers={"fakea": bad, "fake": good}, progress=steps.append, **FAST)
    assert cluster.provider == "fake"
    assert sum(s.startswith("skip ") for s in steps) == len(options(bad)) - 1
    # an adapter that cannot be loaded is skipped the same way
    ghost = [replace(o, provider="nosuch") for o in options(good)[:1]]
    run2 = make_run(ledger, env, "run-2")
    cluster = provision(ghost + options(good)[:1], run2, Requirements(), ledger, providers={"fake": good}, **FAST)
    assert cluster.provider == "fake"
    assert any("nosuch" in (e["message"] or "") and "unusable" in e["message"] for e in ledger.events("run-2"))


# ------------------------------------------------------------------------------------------------ costs, rows
def test_spent_usd_bills_per_second_from_the_intent():
    t0 = utcnow()
    r = Resource(id="r", run_id="x", provider="fake", kind="instance", name="n", usd_per_hour=3.6, created_at=t0)
    assert spent_usd(r, t0 + timedelta(seconds=10)) == pytest.approx(0.01)
    done = r.model_copy(update={"terminated_at": t0 + timedelta(seconds=20), "state": "terminated",
                                "provider_id": "i-1"})
    assert spent_usd(done, t0 + timedelta(hours=5)) == pytest.approx(0.02)
    # a created resource is charged at least the minimum billed time
    short = done.model_copy(update={"attrs": {"min_billed_seconds": 60}})
    assert spent_usd(short) == pytest.approx(0.06)
    # an intent that never became a resource (ended without a provider id) cost nothing: a run that rented
    # nothing showed $0.07 spent
    never = done.model_copy(update={"provider_id": None, "attrs": {"min_billed_seconds": 60}})
    assert spent_usd(never) == 0.0
    # while it is live (a create in flight, or unknown) it counts
    assert spent_usd(never.model_copy(update={"state": "unknown", "terminated_at": None}),
                     t0 + timedelta(seconds=10)) == pytest.approx(0.01)


def test_storage_is_billed_with_the_instance(env, ledger):
    from broker.core.model import Offer

    p = FakeProvider()
    run = make_run(ledger, env)
    opt = options(p)[0]
    o = opt.offers[0]
    vastish = replace(o, storage_usd_per_gib_month=0.073)  # 40 GiB -> $0.004/h
    opt = replace(opt, offers=[vastish])
    provision([opt], run, Requirements(disk_gib=40), ledger, providers={"fake": p}, **FAST)
    row = ledger.resources("run-1")[0]
    assert row.usd_per_hour == pytest.approx(o.usd_per_hour + 0.004)
    assert row.attrs["storage_usd_per_hour"] == pytest.approx(0.004)


def test_run_spent_usd(env, ledger):
    run = make_run(ledger, env)
    res = ledger.record_intent("run-1", "fake", "instance", "n0", usd_per_hour=1.8, deadline=run.deadline)
    ledger.mark_created(res.id, "fake-i-1")
    later = res.created_at + timedelta(minutes=30)
    assert run_spent_usd(ledger, "run-1", later) == pytest.approx(0.9)


# ------------------------------------------------------------------------------------------------ reconcile
def test_reconcile_finds_orphans_adopts_intents_and_terminates_ledger_visibly(env, ledger):
    p = FakeProvider()
    run = make_run(ledger, env)
    provision(options(p)[:1], run, Requirements(), ledger, providers={"fake": p}, **FAST)
    known = live_fake(p)[0]
    # an instance nobody recorded (e.g. the ledger file was lost) ...
    from broker.core.records import NodeRequest

    o = options(p)[0].offers[0]
    stray = p.create_instance(NodeRequest(run_id="lost-run", node_index=0, name="broker-lost-run-n0", offer=o,
                                          ssh_public_key="x", client_token="t1", tags={"broker-run": "lost-run"},
                                          installation_id=ledger.installation_id))
    # ... and one whose create happened but whose id never reached the ledger (crash after create)
    row = ledger.record_intent("run-1", "fake", "instance", "broker-run-1-n9", usd_per_hour=1.0)
    hidden = p.create_instance(NodeRequest(run_id="run-1", node_index=9, name="broker-run-1-n9", offer=o,
                                           ssh_public_key="x", client_token=row.id, tags={"broker-run": "run-1"}))
    rep = reconcile(ledger, {"fake": p})
    assert rep.orphans == [] and [t.provider_id for t in rep.young] == [stray]  # created moments ago: age grace
    rep = reconcile(ledger, {"fake": p}, min_age_s=0)
    assert [t.provider_id for t in rep.orphans] == [stray]
    assert [t.provider_id for t in rep.adopted] == [hidden] and ledger.resource(row.id).provider_id is None
    assert rep.known == 1 and known in p.instances()

    rep = reconcile(ledger, {"fake": p}, terminate=True, poll_s=0.01, min_age_s=0)
    assert len(rep.terminated) == 1
    assert ledger.resource(row.id).provider_id == hidden and p.instances()[hidden]["state"] != "terminated"
    orphan_row = ledger.find_by_provider_id("fake", stray)
    assert orphan_row.state == "terminated" and orphan_row.run_id == "lost-run"
    acts = [e["action"] for e in ledger.events("lost-run")]
    assert acts[:3] == ["intent", "orphan", "terminating"] and acts[-1] == "terminated"
    assert p.instances()[stray]["state"] == "terminated"


# ------------------------------------------------------------------------------------------------ CLI run
def test_broker_run_fake_exit_codes_and_nothing_left(env, ledger, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from broker.cli.app import app

    (tmp_path / "job.py").write_text("print('JOB_OK')\n")
    (tmp_path / "r.yaml").write_text("name: q\nscript: job.py\nnodes: 2\ncpu_ok: true\n")
    monkeypatch.setenv("BROKER_FAKE_FAIL", "quota")
    r = CliRunner().invoke(app, ["run", str(tmp_path / "r.yaml"), "--provider", "fake", "-q", "--yes"])
    assert isinstance(r.exception, NoValidPlan) and r.exception.exit_code == 3
    assert "fake-gpu-count" in str(r.exception)
    lg = Ledger()
    run = lg.list_runs()[0]
    assert run.status == "failed" and "fake-gpu-count" in run.message
    assert lg.resources(run.id, live_only=True) == []
    # a cloud without credentials: planned from the snapshot, but nothing is rented and the fix is named
    r = CliRunner().invoke(app, ["run", str(tmp_path / "r.yaml"), "--provider", "vast"])
    from broker.core.provider import AuthError

    assert isinstance(r.exception, AuthError) and r.exception.exit_code == 4
    assert "vast: credentials check failed: vast is not configured (" in str(r.exception)
    assert "VAST_API_KEY" in str(r.exception)


def test_progress_printer_shows_elapsed_cost_and_rate(env, ledger):
    import io

    from rich.console import Console

    from broker.cli.lifecycle import ProgressPrinter

    buf = io.StringIO()
    pp = ProgressPrinter(ledger, Console(file=buf, width=200))
    run = make_run(ledger, env)
    pp("before the run row")
    pp.bind(run)
    res = ledger.record_intent("run-1", "fake", "instance", "n0", usd_per_hour=36.0)
    ledger.update_resource(res.id, created_at=res.created_at - timedelta(seconds=100))  # $1.00 spent so far
    pp("step [two]")
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith("$0.00 $0.00/h] before the run row")
    assert "$1.00" in lines[1] and "$36.00/h" in lines[1] and lines[1].endswith("step [two]")


# ------------------------------------------------------------------------------------------------ readiness polls
def test_the_readiness_polls_follow_the_time_waited_and_back_off_to_poll_s(env, ledger, monkeypatch):
    """A container that runs within seconds bills from then, and the job waits for broker to see it: the gaps
    between describes are a fifth of the time already waited, from 0.25 s, so a 2 s boot is seen within 0.5 s
    (a fixed 1 s start with x1.5 gaps saw it 0.5 s late); a slow boot backs off to poll_s so that it does not
    flood the API.  The clock here is virtual: each sleep moves it."""
    import time as time_mod

    from broker.core.records import InstanceInfo
    from broker.money.provision import poll_delay_s

    clock = [1000.0]
    boot_s = 60.0
    polled_at: list[float] = []
    created: list[float] = []

    class SlowBoot(FakeProvider):
        def create_instance(self, req):
            created.append(clock[0])
            return super().create_instance(req)

        def describe_instance(self, provider_id, *, region=None):
            info = super().describe_instance(provider_id, region=region)
            polled_at.append(clock[0] - created[0])
            if clock[0] - created[0] < boot_s:
                return InstanceInfo(provider_id=provider_id, state="pending", raw_state="loading",
                                    usd_per_hour=info.usd_per_hour)
            return info

    def sleep(s):
        clock[0] += s

    monkeypatch.setattr(time_mod, "sleep", sleep)
    monkeypatch.setattr(time_mod, "monotonic", lambda: clock[0])
    p = SlowBoot()
    run = make_run(ledger, env)
    provision(options(p), run, Requirements(), ledger, providers={"fake": p}, poll_s=5.0, retry_wait_s=0.01,
              terminate_timeout_s=5)
    gaps = [round(b - a, 3) for a, b in zip(polled_at, polled_at[1:])]
    assert gaps[:5] == [0.25] * 5, gaps                    # quick at first
    assert max(gaps) == 5.0 and gaps[-1] == 5.0, gaps       # then one describe per poll_s
    assert all(b >= a for a, b in zip(gaps, gaps[1:])), gaps
    # seen running at most a fifth of the wait (capped at poll_s) after it ran
    assert polled_at[-1] - boot_s <= min(5.0, 0.2 * boot_s) + 1e-9, polled_at
    assert len(polled_at) <= 30, len(polled_at)             # about 25 describes in the first minute
    # the schedule itself: a 2 s boot is seen by 2.5 s
    t, seen = 0.0, None
    while seen is None:
        if t >= 2.0:
            seen = t
        t += poll_delay_s(t, 5.0)
    assert seen <= 2.5, seen
    assert poll_delay_s(1000.0, 0.01) == 0.01  # a poll_s below the floor wins (tests, fast emulators)


def test_while_waiting_runs_once_after_the_creates_and_before_the_first_readiness_poll(env, ledger):
    """The caller's preparation (the SSH executor's imports) runs while the machines boot: after every create
    of the attempt, before the first describe, and once for the whole provisioning."""
    calls: list[str] = []

    class Seen(FakeProvider):
        def create_instance(self, req):
            calls.append("create")
            return super().create_instance(req)

        def describe_instance(self, provider_id, *, region=None):
            calls.append("describe")
            return super().describe_instance(provider_id, region=region)

    p = Seen()
    run = make_run(ledger, env)
    provision(options(p, topology="multi-node"), run, Requirements(), ledger, providers={"fake": p},
              while_waiting=lambda: calls.append("hook"), **FAST)
    assert calls.count("hook") == 1, calls
    assert calls.index("hook") == calls.index("describe") - 1 == calls.count("create"), calls


def test_a_running_machine_whose_answer_cannot_be_recorded_is_released_and_the_next_offer_tried(env, ledger):
    """A describe answer with an address that is no address (``198.18.0.1; rm -rf ~``) is never written to the
    ledger or the cluster: that machine is deleted and the run goes on with the next offer."""
    class Odd(FakeProvider):
        first: list[str] = []

        def describe_instance(self, provider_id, *, region=None):
            info = super().describe_instance(provider_id, region=region)
            if not Odd.first:
                Odd.first.append(provider_id)
            if provider_id == Odd.first[0] and info.state == "running":
                return info.model_copy(update={"public_ip": "198.18.0.1; rm -rf ~"})
            return info

    p = Odd()
    run = make_run(ledger, env)
    cluster = provision(options(p), run, Requirements(), ledger, providers={"fake": p}, **FAST)
    bad = Odd.first[0]
    assert p.instances()[bad]["state"] == "terminated"
    rows = ledger.resources("run-1")
    assert all("rm -rf" not in str(r.attrs) for r in rows)
    assert any(r.provider_id == bad and r.state == "terminated" for r in rows)
    assert cluster.nodes and all(n.host == "127.0.0.1" for n in cluster.nodes)
