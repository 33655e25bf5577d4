"""Money safety of the core against the file-backed fake cloud: two installations on one account, ambiguous creates,
teardown that finishes (transient 5xx, 409 while a dependency lives, dependency order) and quota scope."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.cli.app import app
from tests.support.plans import rank_options
from broker.money.ledger import Ledger
from broker.core.model import Requirements, TopologyKind, utcnow
from broker.core.records import Run
from broker.core.provider import NoValidPlan, ProviderError
from broker.core.records import NodeRequest
from broker.money.provision import provision
from broker.money.reconcile import reconcile
from broker.providers.fake import FakeProvider
from broker.money.teardown import teardown_order, teardown_run
from broker.money.watchdog import Watchdog

FAST = dict(poll_s=0.02, retry_wait_s=0.01, terminate_timeout_s=5)


@pytest.fixture
def cloud(tmp_path, fake_cloud):
    """Two BROKER_HOMEs (A, B) on one fake cloud; BROKER_HOME points at A."""
    state = tmp_path / "fake.json"
    fake_cloud(tmp_path / "A", state)
    return tmp_path


def make_run(ledger: Ledger, tmp: Path, run_id: str = "run-1", hours: float = 1.0) -> Run:
    now = utcnow()
    run = Run(id=run_id, name="t", provider="fake", topology="simulated", status="provisioning", created_at=now,
              deadline=now + timedelta(hours=hours), run_dir=str(tmp / "runs" / run_id), budget_usd=100)
    Path(run.run_dir).mkdir(parents=True)
    return ledger.create_run(run)


def options(p: FakeProvider, topology: str = "simulated", nodes: int = 2):
    req = Requirements(nodes=nodes, gpus_per_node=1, cpu_ok=True, topology=topology, budget_usd=100, hours=1)
    return [o for o in rank_options(p, req) if o.topology.value == topology]


def live(p: FakeProvider) -> list[str]:
    return [i for i, x in p.instances().items() if x["state"] != "terminated"]


# ------------------------------------------------------------------------------------------------ installations
def test_two_homes_on_one_account_never_touch_each_others_live_run(cloud, monkeypatch):
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    b = Ledger(cloud / "B" / "ledger.sqlite")
    assert a.installation_id != b.installation_id
    provision(options(p)[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    (mine_a,) = live(p)
    assert p.instances()[mine_a]["tags"]["broker-install"] == a.installation_id
    # an older broker's resource: no installation tag at all -> also foreign to B
    legacy = p.create_instance(NodeRequest(run_id="old", node_index=0, name="broker-old-n0", ssh_public_key="k",
                                           offer=options(p)[0].offers[0], client_token="legacy"))
    # B's watchdog with no orphan grace: sees A's instance, logs it once as another installation's, leaves it
    w = Watchdog(b, providers={"fake": p}, orphan_grace_s=0, orphan_scan_s=0, home=cloud / "B")
    for _ in range(3):
        acts = w.run_once()
        assert not [x for x in acts if x.kind in ("terminate", "orphan-found")]
    assert sorted(live(p)) == sorted([mine_a, legacy])
    assert b.resources() == []  # nothing recorded in B's ledger
    assert sum(e["action"] == "foreign" for e in b.events()) == 2  # once each, not every pass
    # B's reconcile --terminate --yes (no age grace at all): A's run is left alone, listed as other installation
    monkeypatch.setenv("BROKER_HOME", str(cloud / "B"))
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--terminate", "--yes", "--min-age", "0"])
    assert r.exit_code == 0, r.output
    assert "other installation" in r.output and mine_a in r.output and "no orphans" in r.output
    assert sorted(live(p)) == sorted([mine_a, legacy])
    out = json.loads(CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--json"]).output)
    assert {t["provider_id"] for t in out["foreign"]} == {mine_a, legacy} and out["orphans"] == []
    # --include-foreign touches only what is older than the longest deadline + grace (169 h)
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--terminate", "--yes", "--include-foreign"])
    assert r.exit_code == 0, r.output
    assert sorted(live(p)) == sorted([mine_a, legacy])
    with p._state() as st:  # the legacy instance is 170 h old
        st["instances"][legacy]["created_at"] -= 170 * 3600
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--terminate", "--yes", "--include-foreign"])
    assert r.exit_code == 0, r.output
    assert live(p) == [mine_a]
    # A's own reconcile knows its instance
    monkeypatch.setenv("BROKER_HOME", str(cloud / "A"))
    out = json.loads(CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--json", "--min-age", "0"]).output)
    assert out["known"] == 1 and out["orphans"] == [] and out["foreign"] == []


def test_own_orphans_wait_for_the_age_grace_in_reconcile(cloud):
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    stray = p.create_instance(NodeRequest(run_id="lost", node_index=0, name="broker-lost-n0", ssh_public_key="k",
                                          offer=options(p)[0].offers[0], client_token="s",
                                          installation_id=a.installation_id))
    rep = reconcile(a, {"fake": p}, terminate=True, poll_s=0.01)
    assert [t.provider_id for t in rep.young] == [stray] and live(p) == [stray]
    with p._state() as st:
        st["instances"][stray]["created_at"] -= 601
    rep = reconcile(a, {"fake": p}, terminate=True, poll_s=0.01)
    assert len(rep.terminated) == 1 and live(p) == []


# ------------------------------------------------------------------------------------------------ ambiguous creates
def test_502_after_create_is_adopted_not_created_again(cloud, monkeypatch):
    """Vast-like: no idempotency, the create answers 502 after creating.  The list finds it: one instance."""
    monkeypatch.setenv("BROKER_FAKE_FAIL", "create502,no-idempotency")
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    cluster = provision(options(p), make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    assert len(p.instances()) == 1 and cluster.nodes
    (row,) = a.resources("run-1")
    assert row.provider_id == live(p)[0] and row.state == "running"
    assert "adopted" in [e["action"] for e in a.events("run-1")]


def test_unverifiable_create_is_unknown_and_stops_creating_on_that_provider(cloud, monkeypatch):
    """502 after create + a list the adapter cannot read: the row is `unknown` (live, worst case counted), no
    second create on that provider (4 offers = 4 instances before), status / reconcile / watchdog say possibly
    billing, and a later readable list terminates it."""
    monkeypatch.setenv("BROKER_FAKE_FAIL", "create502,no-idempotency,list")
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    opts = options(p)
    assert len(opts) >= 2
    with pytest.raises(ProviderError) as ei:
        provision(opts, make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    assert not isinstance(ei.value, NoValidPlan)
    assert len(p.instances()) == 1, "at most one instance per intent row, and no second create on fake"
    (row,) = a.resources("run-1")
    assert row.state == "unknown" and row.live and row.provider_id is None
    assert "could not be read" in row.error
    # status counts it at its worst case and says so
    r = CliRunner().invoke(app, ["status", "--json", "--no-refresh"])
    data = json.loads(r.output)
    (lr,) = data["live_resources"]
    assert lr["state"] == "unknown" and lr["cost"]["worst_case_usd"] >= 0.99 * row.usd_per_hour
    assert data["totals"]["possibly_billing"] == 1
    r = CliRunner().invoke(app, ["status", "--no-refresh"])
    assert "possibly billing" in r.output
    # reconcile cannot list: an error (exit 4), never "no orphans"
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake"])
    assert r.exit_code == 4 and "possibly billing" in r.output and "could not be listed" in r.output
    # the watchdog reports it every pass (the CLI too)
    r = CliRunner().invoke(app, ["watchdog", "--once"])
    assert r.exit_code == 0 and "possibly billing" in r.output, r.output
    from tests.support.clock import FakeClock

    clock = FakeClock()
    w = Watchdog(a, providers={"fake": p}, home=cloud / "A", clock=clock)
    assert "possibly-billing" in [x.kind for x in w.run_once()]
    assert len(p.instances()) == 1 and a.resource(row.id).state == "unknown"
    # the list answers again: the watchdog's next try finds the instance and terminates it
    monkeypatch.setenv("BROKER_FAKE_FAIL", "")
    clock.advance(60)
    w.run_once()
    assert live(p) == [] and a.resource(row.id).state == "terminated"
    assert a.resource(row.id).provider_id == list(p.instances())[0]


def test_unknown_row_proven_absent_by_a_later_list(cloud, monkeypatch):
    """A create that answered 503 *without* creating and a list that failed: unknown until a list proves it
    absent; then terminated as never created (and $0 spent)."""
    monkeypatch.setenv("BROKER_FAKE_FAIL", "transient,list")
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    with pytest.raises(ProviderError):
        provision(options(p)[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    (row,) = a.resources("run-1")
    assert row.state == "unknown" and p.instances() == {}
    monkeypatch.setenv("BROKER_FAKE_FAIL", "")
    r = CliRunner().invoke(app, ["down", "run-1"])
    assert r.exit_code == 0, r.output
    row = a.resource(row.id)
    assert row.state == "terminated" and row.attrs.get("never_created")


def test_unknown_row_is_not_proven_absent_before_the_settle_time(cloud, monkeypatch):
    monkeypatch.setenv("BROKER_FAKE_FAIL", "transient,list")
    p = FakeProvider()
    p.create_settle_s = 3600.0  # a provider whose list lags an hour behind its creates
    a = Ledger(cloud / "A" / "ledger.sqlite")
    with pytest.raises(ProviderError):
        provision(options(p)[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    monkeypatch.setenv("BROKER_FAKE_FAIL", "")
    left = teardown_run(a, "run-1", "test", providers={"fake": p}, poll_s=0.01)
    assert [r.state for r in left] == ["unknown"]
    assert "cannot prove it absent" in left[0].error


def test_create_proven_absent_is_retried_on_the_same_row(cloud, monkeypatch):
    monkeypatch.setenv("BROKER_FAKE_FAIL", "transient:2,no-idempotency")
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    provision(options(p)[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    assert len(p.instances()) == 1 and len(a.resources("run-1")) == 1


# ------------------------------------------------------------------------------------------------ teardown
def test_down_retries_a_500_on_delete(cloud, monkeypatch):
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    provision(options(p)[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    monkeypatch.setenv("BROKER_FAKE_FAIL", "terminate500:1")
    r = CliRunner().invoke(app, ["down", "run-1"])
    assert r.exit_code == 0, r.output
    assert live(p) == [] and "HTTP 500" in r.output  # said, retried, done in one `broker down`


def test_watchdog_retries_a_500_on_delete(cloud, monkeypatch):
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    run = make_run(a, cloud)
    provision(options(p)[:1], run, Requirements(), a, providers={"fake": p}, **FAST)
    a.update_run(run.id, deadline=utcnow() - timedelta(seconds=1))
    for r in a.resources(run.id):
        a.update_resource(r.id, deadline=utcnow() - timedelta(seconds=1))
    monkeypatch.setenv("BROKER_FAKE_FAIL", "terminate500:1")
    w = Watchdog(a, providers={"fake": p}, home=cloud / "A", interval_s=0.1)
    acts = [x for x in w.run_once() if x.kind == "terminate"]
    assert acts and all(x.ok for x in acts) and live(p) == []


def test_teardown_order_follows_dependencies():
    from broker.core.records import Resource

    t0 = utcnow()
    kinds = ["vcn", "subnet", "internet_gateway", "security_list", "route_table", "instance", "instance",
             "security_group", "placement_group"]
    rows = [Resource(id=f"r{i}", run_id="x", provider="p", kind=k, name=k, created_at=t0 + timedelta(seconds=i))
            for i, k in enumerate(kinds)]
    order = [r.kind for r in teardown_order(rows)]
    assert order[:3] == ["instance", "instance", "subnet"]
    assert set(order[3:6]) == {"internet_gateway", "security_list", "route_table"}
    assert order[6:] == ["security_group", "placement_group", "vcn"]


def test_reconcile_deletes_network_orphans_in_dependency_order(cloud, monkeypatch):
    """Lost ledger of a multi-node run: reconcile --terminate must go instance -> subnet -> VCN (never the VCN
    first: 409 retried for minutes, exit 4, and the next reconcile said "no orphans" with the VCN live)."""
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    opts = options(p, "multi-node")
    provision(opts[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    a._db.execute("DELETE FROM resources")  # the ledger lost every row
    rep = reconcile(a, {"fake": p}, terminate=True, poll_s=0.01, min_age_s=0, retry_s=1)
    assert rep.failed == [] and len(rep.terminated) == 4
    assert live(p) == [] and all(n["state"] == "terminated" for n in p.networks().values())
    with p._state() as st:
        assert st.get("conflicts", []) == []  # no delete was tried before its dependents were gone


def test_network_delete_waits_for_a_live_instance_and_stays_loud(cloud, monkeypatch):
    """An instance that cannot be terminated: its subnet and VCN are not tried (no 409 storm), everything stays
    live in the ledger; the next `broker down` finishes."""
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    provision(options(p, "multi-node")[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    monkeypatch.setenv("BROKER_FAKE_FAIL", "terminate")
    r = CliRunner().invoke(app, ["down", "run-1"])
    assert r.exit_code == 4
    assert len(a.resources("run-1", live_only=True)) == 4
    with p._state() as st:
        assert st.get("conflicts", []) == []
    monkeypatch.setenv("BROKER_FAKE_FAIL", "")
    assert CliRunner().invoke(app, ["down", "run-1"]).exit_code == 0
    assert a.resources("run-1", live_only=True) == []


def test_409_on_a_network_delete_is_retried_until_the_dependency_is_gone(cloud):
    """OCI answers 409 Conflict on a subnet delete while an instance in it is still shutting down: retried with
    backoff (bounded), not given up at once."""
    import threading

    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    provision(options(p, "multi-node")[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    subnet = next(r for r in a.resources("run-1") if r.kind == "subnet")
    insts = [r.provider_id for r in a.resources("run-1") if r.kind == "instance"]

    def finish_later():
        time.sleep(1.0)
        for i in insts:
            p.destroy(i)

    threading.Thread(target=finish_later).start()
    from broker.money.teardown import terminate_resource

    assert terminate_resource(a, subnet, "test", provider=p, retry_s=20, poll_s=0.01)
    with p._state() as st:
        assert st.get("conflicts")  # it did get 409s first


# ------------------------------------------------------------------------------------------------ quota scope
def _opt(provider: str, it: str, region: str, zone: str | None, *, nodes: int = 2, gpus: int = 1, vcpus: float = 4):
    from broker.core.model import Offer, PlanOption

    o = Offer(provider=provider, offer_id=it, instance_type=it, region=region, zone=zone, gpu_name="G",
              gpu_count=gpus, gpu_mem_gib=24, vcpus=vcpus, ram_gib=16, usd_per_hour=1.0, private_network=True,
              price_source="test", price_time=utcnow())
    return PlanOption(provider=provider, topology=TopologyKind.multi_node, offers=[o] * nodes, nodes=nodes,
                      gpus_per_node=gpus, usd_per_hour=nodes * 1.0, worst_case_usd=nodes * 1.0, hours=1)


class QuotaStub(FakeProvider):
    """A fake cloud named like a real one whose creates hit a quota where ``blocked(offer)`` says so."""

    def __init__(self, name, blocked, error_kw, quotas=()):
        super().__init__(name=name)
        self.blocked, self.error_kw, self._quotas, self.tried = blocked, error_kw, list(quotas), []

    def create_instance(self, req):
        from broker.core.provider import QuotaError

        self.tried.append((req.offer.instance_type, req.offer.region, req.offer.zone))
        if self.blocked(req.offer):
            raise QuotaError(self.name, "create_instance", "LimitExceeded (test)", hint="adapter hint --value 1",
                             **self.error_kw(req.offer))
        return super().create_instance(req)

    def quotas(self, req, offers):
        return self._quotas


def test_oci_quota_in_one_ad_skips_only_that_ad_and_suggests_what_is_missing(cloud):
    """`400 LimitExceeded` in AD-1 skipped every AD of the region although AD-2 had quota."""
    p = QuotaStub("oci", lambda o: o.zone in ("AD-1", "AD-2"),
                  lambda o: {"scope": o.zone, "limit_name": "gpu-a10-count", "limit": 2, "used": 2})
    a = Ledger(cloud / "A" / "ledger.sqlite")
    opts = [_opt("oci", "VM.GPU.A10.1", "us-ashburn-1", "AD-1"), _opt("oci", "VM.GPU.A10.2", "us-ashburn-1", "AD-1"),
            _opt("oci", "VM.GPU.A10.1", "us-ashburn-1", "AD-2"), _opt("oci", "VM.GPU.A10.1", "us-ashburn-1", "AD-3")]
    steps: list[str] = []
    cluster = provision(opts, make_run(a, cloud), Requirements(), a, providers={"oci": p}, progress=steps.append,
                        **FAST)
    assert cluster.provider == "oci"
    zones = [z for _, _, z in p.tried]
    assert zones[0] == "AD-1" and "AD-2" in zones and zones[-1] == "AD-3"
    assert ("VM.GPU.A10.2", "us-ashburn-1", "AD-1") not in p.tried  # same limit, same AD: skipped
    # when nothing fits, the request names the AD and the value the job needs: limit 2 + (2 needed - 0 free) = 4
    p2 = QuotaStub("oci", lambda o: True, lambda o: {"scope": o.zone, "limit_name": "gpu-a10-count", "limit": 2,
                                                     "used": 2})
    with pytest.raises(NoValidPlan) as ei:
        provision(opts[:1], make_run(a, cloud, "run-2"), Requirements(), a, providers={"oci": p2}, **FAST)
    hint = ei.value.hint
    assert "--limit gpu-a10-count --value 4 --scope AD-1" in hint and "--value 1" not in hint
    assert "needs 2 GPUs" in hint and "0 available" in hint


def test_aws_g_family_quota_does_not_drop_p_family_options(cloud):
    """A G-family VcpuLimitExceeded must not drop the P-family options of the region (nor other regions)."""
    from broker.core.model import Quota

    g_quota = Quota(provider="aws", name="L-DB2E81BA", region="us-east-1", limit=4, used=4, unit="vcpus")
    p = QuotaStub("aws", lambda o: o.instance_type.startswith("g") and o.region == "us-east-1",
                  lambda o: {}, quotas=[g_quota])
    a = Ledger(cloud / "A" / "ledger.sqlite")
    opts = [_opt("aws", "g5.xlarge", "us-east-1", "us-east-1a"), _opt("aws", "g6.xlarge", "us-east-1", "us-east-1b"),
            _opt("aws", "p3.2xlarge", "us-east-1", "us-east-1a", vcpus=8)]
    steps: list[str] = []
    cluster = provision(opts, make_run(a, cloud), Requirements(), a, providers={"aws": p}, progress=steps.append,
                        **FAST)
    assert [t for t, _, _ in p.tried] == ["g5.xlarge", "p3.2xlarge", "p3.2xlarge"]  # g6 (same bucket) skipped
    assert cluster.nodes and any("skip" in s and "g6.xlarge" in s for s in steps)
    # the advice when nothing else fits: 2x g5.xlarge need 8 vCPUs; limit 4, used 4 -> 12 (read through quotas())
    with pytest.raises(NoValidPlan) as ei:
        provision(opts[:1], make_run(a, cloud, "run-2"), Requirements(), a, providers={"aws": p}, **FAST)
    assert "--limit L-DB2E81BA --value 12 --region us-east-1" in ei.value.hint
    assert "needs 8 vCPUs" in ei.value.hint


def test_suggest_limit_is_need_minus_available():
    from broker.plan.quota import suggest_limit

    assert suggest_limit(2, 2, 2) == 4  # it suggested 1 for this
    assert suggest_limit(4, 1, 2) == 4  # fits already
    assert suggest_limit(4, 3, 2) == 5
    assert suggest_limit(2, 3, 2) == 4  # over-used: the 2 needed on top of the limit


def test_unknown_multi_node_create_keeps_its_network_until_down(cloud, monkeypatch):
    """Node 1's create is ambiguous and unverifiable: node 0 is terminated, the subnet / VCN are not deleted under
    the possibly live node (no 409 storm); a later `broker down` deletes all in order."""
    monkeypatch.setenv("BROKER_FAKE_FAIL", "create502@n1,no-idempotency,list")  # node 1's create answers 502
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    with pytest.raises(ProviderError):
        provision(options(p, "multi-node")[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p},
                  **FAST)
    states = {r.kind + str(r.attrs.get("node_index", "")): r.state for r in a.resources("run-1")}
    assert states["instance0"] == "terminated" and states["instance1"] == "unknown"
    assert states["vcn"] != "terminated" and states["subnet"] != "terminated"
    with p._state() as st:
        assert st.get("conflicts", []) == []
    monkeypatch.setenv("BROKER_FAKE_FAIL", "")
    assert CliRunner().invoke(app, ["down", "run-1"]).exit_code == 0
    assert live(p) == [] and all(n["state"] == "terminated" for n in p.networks().values())


def test_reconcile_resolves_an_unknown_create_once_the_list_answers(cloud, monkeypatch):
    monkeypatch.setenv("BROKER_FAKE_FAIL", "create502,no-idempotency,list")
    p = FakeProvider()
    a = Ledger(cloud / "A" / "ledger.sqlite")
    with pytest.raises(ProviderError):
        provision(options(p)[:1], make_run(a, cloud), Requirements(), a, providers={"fake": p}, **FAST)
    (row,) = a.resources("run-1")
    assert row.state == "unknown" and len(live(p)) == 1
    monkeypatch.setenv("BROKER_FAKE_FAIL", "")
    out = json.loads(CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--json"]).output)
    assert [u["resource_id"] for u in out["unknown"]] == [row.id] and out["orphans"] == []
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake", "--terminate", "--yes"])
    assert r.exit_code == 0, r.output
    assert live(p) == [] and a.resource(row.id).state == "terminated"
