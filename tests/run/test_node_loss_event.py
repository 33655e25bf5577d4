"""A node the provider lost is an event the main thread reads at known points (the supervisor's wait loop, between
steps, the SSH wait), never an exception raised into whatever it was doing (a ledger write, a staging copy)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest

from broker.core.model import utcnow
from broker.core.records import Run
from broker.money.ledger import Ledger


def test_a_lost_node_ends_the_job_in_the_supervisor_loop_not_inside_a_ledger_write_or_a_copy(tmp_path, fake_cloud):
    from broker.providers.fake import FakeProvider
    from broker.run.guard import NodeLost, watch_nodes
    from broker.run.runrecord import Context, Hooks
    from broker.run.supervisor import LocalNode, Supervisor

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    (tmp_path / "fake.json").write_text(json.dumps({"networks": {}, "instances": {"fake-i-lost": {
        "id": "fake-i-lost", "state": "running", "created_at": time.time(), "usd_per_hour": 1.0, "tags": {}}}}))
    p = FakeProvider()
    ledger = Ledger()
    run = ledger.create_run(Run(id="20261206-000000-10571a", name="x", provider="fake", status="running",
                                created_at=utcnow()))
    rid = ledger.record_intent(run.id, "fake", "instance", "n0", attrs={"node_index": 0}).id
    ledger.mark_created(rid, "fake-i-lost", state="running")
    said: list[str] = []
    big = tmp_path / "stage.bin"
    big.write_bytes(os.urandom(1 << 20))
    ctx = Context(ledger=ledger, hooks=Hooks(say=said.append))
    with watch_nodes(ledger, run, {"fake": p}, ctx, interval_s=0.05):
        p.destroy("fake-i-lost")
        end = time.monotonic() + 20
        writes = 0
        while time.monotonic() < end and ledger.resource(rid).error is None:  # the watch has seen it
            ledger.event(run.id, "cli", "work", f"write {writes}")
            writes += 1
        assert ledger.resource(rid).error is not None, "the watch did not see the lost node"
        # the main thread goes on with its writes and copies for several watch intervals: nothing lands in them
        for i in range(20):
            ledger.event(run.id, "cli", "work", f"after {i}")
            shutil.copyfile(big, tmp_path / f"copy{i % 2}.bin")
            time.sleep(0.02)
        node = LocalNode(0, [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), tmp_path)
        t0 = time.monotonic()
        with pytest.raises(NodeLost, match="became terminated at the provider"):
            Supervisor({0: tmp_path / "node0.log"}, echo=None).run([node])
        assert time.monotonic() - t0 < 10
        assert node.poll() is not None  # the supervisor stopped the node on its way out
    assert any("became terminated" in s for s in said)
    (row,) = ledger.resources(run.id)
    assert row.attrs.get("provider_state") == "terminated"


def test_a_step_that_fails_while_a_node_is_lost_ends_with_node_lost(tmp_path, fake_cloud):
    """An SSH wait or a copy that fails because the node went away says why: the lost node (a preemption the
    attempts loop can rent again for), not the SSH error."""
    from broker.core.provider import ProviderError
    from broker.providers.fake import FakeProvider
    from broker.run.guard import NodeLost, watch_nodes
    from broker.run.runrecord import Context, Hooks

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    (tmp_path / "fake.json").write_text(json.dumps({"networks": {}, "instances": {"fake-i-x": {
        "id": "fake-i-x", "state": "running", "created_at": time.time(), "usd_per_hour": 1.0, "tags": {}}}}))
    p = FakeProvider()
    ledger = Ledger()
    run = ledger.create_run(Run(id="20261206-000000-10572b", name="x", provider="fake", status="running",
                                created_at=utcnow()))
    rid = ledger.record_intent(run.id, "fake", "instance", "n0").id
    ledger.mark_created(rid, "fake-i-x", state="running")
    with pytest.raises(NodeLost) as e:
        with watch_nodes(ledger, run, {"fake": p}, Context(ledger=ledger, hooks=Hooks()), interval_s=0.05):
            p.destroy("fake-i-x")
            end = time.monotonic() + 20
            while time.monotonic() < end and ledger.resource(rid).error is None:
                time.sleep(0.02)
            raise ProviderError("ssh", "upload to node 0", "Connection reset by peer")
    assert isinstance(e.value.__cause__, ProviderError)
