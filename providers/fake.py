"""``fake``: a pretend cloud whose state lives in a JSON file, for tests and demos of the money paths.

It behaves like a real provider where it matters for crash safety: instances exist outside any broker process
(in the state file), carry the run tag, bill by the hour while not terminated, and can fail the ways real clouds
fail.  Its "instances" are this machine, so a cluster built on it runs its nodes as local processes
(``Cluster.local_exec``).

Environment (read at call time, so a test can steer a ``broker`` subprocess):

* ``BROKER_FAKE_STATE``  path of the state file (default ``<broker home>/fake-cloud.json``)
* ``BROKER_FAKE_FAIL``   comma list of injected failures: ``capacity@<zone>`` (CapacityError in that zone),
  ``quota`` (QuotaError on create), ``gone`` (OfferGone), ``terminate`` (ProviderError on terminate),
  ``transient`` (TransientError on create)
* ``BROKER_FAKE_HANG``   comma list of steps after which the calling process writes ``<state>.hang-<step>`` and
  sleeps (so a test can SIGKILL it at that exact point): ``before-create``, ``after-create``, ``ready``,
  ``before-terminate``, ``after-terminate``
* ``BROKER_FAKE_READY_S`` seconds an instance stays ``pending`` (default 0)
* ``BROKER_FAKE_USD_PER_HOUR`` price of the 1-GPU offer (default 1.0; the 2-GPU host is 1.8x)
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from broker.model import Offer, Requirements, utcnow
from broker.provider import (RUN_TAG, CapacityError, InstanceInfo, NodeRequest, OfferGone, Provider, ProviderCheck,
                             ProviderError, QuotaError, TaggedResource, TransientError)

ZONES = ("fake-zone-1", "fake-zone-2")


def _state_path() -> Path:
    p = os.environ.get("BROKER_FAKE_STATE")
    if p:
        return Path(p)
    from broker.config import broker_home

    return broker_home() / "fake-cloud.json"


def _flags(var: str) -> set[str]:
    return {x.strip() for x in os.environ.get(var, "").split(",") if x.strip()}


def _hang(step: str) -> None:
    if step in _flags("BROKER_FAKE_HANG"):
        Path(f"{_state_path()}.hang-{step}").write_text(str(os.getpid()))
        while True:  # wait to be killed
            time.sleep(1)


class FakeProvider(Provider):
    """A file-backed pretend cloud with private networking (``simulated`` and ``multi-node``)."""

    name = "fake"
    topologies = ("simulated", "multi-node")

    def __init__(self, state_path: Path | None = None):
        self._path = state_path

    @property
    def path(self) -> Path:
        return self._path or _state_path()

    @contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{self.path}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = json.loads(self.path.read_text()) if self.path.exists() and self.path.stat().st_size else {}
            state.setdefault("instances", {})
            yield state
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=2))
            os.replace(tmp, self.path)

    # ---- read side
    def check(self) -> ProviderCheck:
        return ProviderCheck(provider=self.name, configured=True, usable=True, detail=f"state file {self.path}")

    def offers(self, req: Requirements) -> list[Offer]:
        price = float(os.environ.get("BROKER_FAKE_USD_PER_HOUR", "1.0"))
        now = utcnow()
        out = []
        for zone in ZONES:
            for gpus, usd in ((1, price), (2, round(price * 1.8, 4))):
                out.append(Offer(provider="fake", offer_id=f"fake.gpu{gpus}", instance_type=f"fake.gpu{gpus}",
                                 region="fake-region", zone=zone, gpu_name="FakeGPU", gpu_count=gpus,
                                 gpu_mem_gib=24, vcpus=4 * gpus, ram_gib=16 * gpus, usd_per_hour=usd,
                                 private_network=True, price_source="fake price list", price_time=now))
        return out

    # ---- lifecycle
    def create_instance(self, req: NodeRequest) -> str:
        fails = _flags("BROKER_FAKE_FAIL")
        _hang("before-create")
        if f"capacity@{req.offer.zone}" in fails:
            raise CapacityError("fake", "create_instance", f"out of host capacity in {req.offer.zone}",
                                hint="broker fails over to the next zone")
        if "quota" in fails:
            raise QuotaError("fake", "create_instance", "service limit fake-gpu-count exceeded (0 of 1 available)",
                             hint="raise the fake-gpu-count limit")
        if "gone" in fails:
            raise OfferGone("fake", "create_instance", f"offer {req.offer.offer_id} is no longer available")
        if "transient" in fails:
            raise TransientError("fake", "create_instance", "HTTP 503 (fake)")
        with self._state() as st:
            for iid, inst in st["instances"].items():  # idempotent on the client token
                if inst["client_token"] == req.client_token:
                    return iid
            iid = "fake-i-" + uuid.uuid4().hex[:10]
            st["instances"][iid] = {
                "id": iid, "state": "pending", "created_at": time.time(), "zone": req.offer.zone,
                "instance_type": req.offer.instance_type, "usd_per_hour": req.offer.usd_per_hour,
                "tags": {RUN_TAG: req.run_id, **req.tags}, "client_token": req.client_token, "name": req.name,
                "gpu_count": req.offer.gpu_count,
            }
        _hang("after-create")
        return iid

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        with self._state() as st:
            inst = st["instances"].get(provider_id)
            if inst is None:
                return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not found")
            ready_s = float(os.environ.get("BROKER_FAKE_READY_S", "0"))
            if inst["state"] == "pending" and time.time() - inst["created_at"] >= ready_s:
                inst["state"] = "running"
            state = inst["state"]
        if state == "running":
            _hang("ready")
        return InstanceInfo(provider_id=provider_id, state=state, raw_state=state, public_ip="127.0.0.1",
                            private_ip="127.0.0.1", ssh_host="127.0.0.1", usd_per_hour=inst["usd_per_hour"])

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        _hang("before-terminate")
        if "terminate" in _flags("BROKER_FAKE_FAIL"):
            raise ProviderError("fake", "terminate", f"{provider_id}: HTTP 500 (injected)",
                                hint="retry `broker down`; the resource stays listed until it is gone")
        with self._state() as st:
            inst = st["instances"].get(provider_id)
            if inst is not None:
                inst["terminate_calls"] = inst.get("terminate_calls", 0) + 1  # tests count double terminations
            if inst is not None and inst["state"] != "terminated":
                inst["state"] = "terminated"
                inst["terminated_at"] = time.time()
        _hang("after-terminate")
        return True

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        with self._state() as st:
            insts = list(st["instances"].values())
        return [TaggedResource(provider="fake", kind="instance", provider_id=i["id"], run_id=i["tags"].get(RUN_TAG),
                               region="fake-region", state=i["state"], name=i["name"],
                               created_at=datetime.fromtimestamp(i["created_at"], timezone.utc),
                               usd_per_hour=i["usd_per_hour"])
                for i in insts
                if i["state"] != "terminated" and RUN_TAG in i["tags"]
                and (run_id is None or i["tags"].get(RUN_TAG) == run_id)]

    # ---- test helpers
    def instances(self) -> dict[str, dict[str, Any]]:
        """The raw state (tests)."""
        with self._state() as st:
            return dict(st["instances"])
