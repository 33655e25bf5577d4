"""Shared helpers for the watchdog tests (no tests here): ledger-first fake provisioning, as broker.money.provision does
it: record_intent -> FakeProvider.create_instance -> mark_created."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from broker.money.ledger import Ledger, new_id
from broker.core.model import Requirements, utcnow
from broker.core.records import Resource, Run
from broker.core.records import NodeRequest
from broker.providers.fake import FakeProvider


class CountingFake(FakeProvider):
    """The fake cloud, counting terminate calls per provider id (in this process)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.terminate_calls: dict[str, int] = {}

    def terminate(self, kind, provider_id, *, region=None, attrs=None):
        self.terminate_calls[provider_id] = self.terminate_calls.get(provider_id, 0) + 1
        return super().terminate(kind, provider_id, region=region, attrs=attrs)


def make_run(ledger: Ledger, *, deadline: datetime | None = None, deadline_s: float | None = 3600.0,
             budget_usd: float | None = 5.0, pid: int | None = None, status: str = "running",
             now: datetime | None = None) -> Run:
    now = now or utcnow()
    if deadline is None and deadline_s is not None:
        deadline = now + timedelta(seconds=deadline_s)
    run = Run(id=new_id("run-"), name="wd-test", provider="fake", topology="multi-node", status=status,
              created_at=now, started_at=now, deadline=deadline, budget_usd=budget_usd, pid=pid)
    return ledger.create_run(run)


def provision(ledger: Ledger, fake: FakeProvider, run: Run, nodes: int = 2, usd_per_hour: float = 1.0,
              attrs: dict | None = None) -> list[Resource]:
    """Create ``nodes`` fake instances ledger-first; returns the ledger rows."""
    offer = [o for o in fake.offers(Requirements()) if o.gpu_count == 1][0]
    offer = replace(offer, usd_per_hour=usd_per_hour)
    out = []
    for i in range(nodes):
        name = f"broker-{run.id}-n{i}"
        res = ledger.record_intent(run.id, "fake", "instance", name, region=offer.region, zone=offer.zone,
                                   usd_per_hour=offer.usd_per_hour, deadline=run.deadline, attrs=attrs)
        pid = fake.create_instance(NodeRequest(run_id=run.id, node_index=i, name=name, offer=offer,
                                               ssh_public_key="ssh-ed25519 AAAAC3test", client_token=res.id,
                                               deadline=run.deadline, installation_id=ledger.installation_id))
        ledger.mark_created(res.id, pid, state="running")
        out.append(ledger.resource(res.id))
    return out
