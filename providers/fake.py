"""``fake``: a pretend cloud whose state lives in a JSON file, for tests and demos of the money paths.

It behaves like a real provider where it matters for crash safety: instances exist outside any broker process
(in the state file), carry the run tag, bill by the hour while not terminated, and can fail the ways real clouds
fail.  Its "instances" are this machine, so a cluster built on it runs its nodes as local processes
(``Cluster.local_exec``).

Environment (read at call time, so a test can steer a ``broker`` subprocess):

* ``BROKER_FAKE_STATE``  path of the state file (default ``<broker home>/fake-cloud.json``)
* ``BROKER_FAKE_FAIL``   comma list of injected failures: ``capacity@<zone>`` (CapacityError in that zone),
  ``quota`` (QuotaError on create), ``gone`` (OfferGone), ``terminate`` (ProviderError on terminate),
  ``transient`` (TransientError on create), ``transient:<n>`` (TransientError on the first n creates only,
  counted in the state file), ``failed@<zone>`` (instances in that zone end in state ``failed`` instead of
  ``running``), ``bootstrap`` (ProviderError from bootstrap after its first network object was created),
  ``create502`` / ``create502:<n>`` (the create *happens*, then the call answers ``502 {"success": false}`` as a
  TransientError: every create, or the first n; ``create502@n<i>``: node i's creates only), ``no-idempotency`` (the client token is ignored, like Vast:
  every create call makes a new instance), ``list`` (``list_tagged`` raises: an answer the adapter cannot read),
  ``terminate500:<n>`` (the first n terminate calls answer HTTP 500 as a TransientError; nothing is deleted)

  A network object (vcn / subnet) deleted while an instance or subnet still uses it answers ``409 Conflict`` as a
  TransientError, the way the OCI adapter maps it.
* ``BROKER_FAKE_HANG``   comma list of steps after which the calling process writes ``<state>.hang-<step>`` and
  sleeps (so a test can SIGKILL it at that exact point): ``before-create``, ``after-create``, ``ready``,
  ``before-terminate``, ``after-terminate``, ``after-vcn`` / ``after-subnet`` (multi-node bootstrap: the object
  exists, its id has not reached the ledger yet)
* ``BROKER_FAKE_READY_S`` seconds an instance stays ``pending`` (default 0)
* ``BROKER_FAKE_USD_PER_HOUR`` price of the 1-GPU offer (default 1.0; the 2-GPU host is 1.8x)
* ``BROKER_FAKE_PREEMPT`` ``<seconds>[:<n>]``: the pretend cloud takes back each of the first ``n`` instances
  (default 1, counted in the state file) ``seconds`` after it started running, as a spot market would: its
  state turns ``terminated`` and :meth:`FakeProvider.preemption` says it was reclaimed, so a run on interruptible
  capacity rents again and resumes from its checkpoint (try checkpoint/resume without a cloud).
  ``checkpoint[+<seconds>][:<n>]``: ``seconds`` (default 0) after broker copied the run's first checkpoint back
  (``<home>/runs/<run>/checkpoints/LATEST``), so a demo shows a resume however slowly the machine starts the job

For ``multi-node`` it bootstraps a private network the way OCI does (a ``vcn`` then a ``subnet``, each recorded
through the Recorder before and after its create), deleted by ``terminate``.  Tests may build several fakes with
different names and failures: ``FakeProvider(name="fake2", fail="quota")`` (``fail`` adds to the env flags).
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
from typing import TYPE_CHECKING, Any, Iterator

from broker.core.model import Offer, Requirements, utcnow
from broker.core.provider import (INSTALL_TAG, RUN_TAG, BadInput, CapacityError, OfferGone, Provider, ProviderCheck,
                                  ProviderError, QuotaError, TransientError)
from broker.providers.declared import FAKE

if TYPE_CHECKING:
    from broker.core.records import InstanceInfo, NodeRequest, TaggedResource

ZONES = ("fake-zone-1", "fake-zone-2")


def _state_path() -> Path:
    p = os.environ.get("BROKER_FAKE_STATE")
    if p:
        return Path(p)
    from broker.core.config import broker_home

    return broker_home() / "fake-cloud.json"


def _flags(var: str) -> set[str]:
    return {x.strip() for x in os.environ.get(var, "").split(",") if x.strip()}


#: ``BROKER_FAKE_PREEMPT=checkpoint...``: the clock starts at the run's first checkpoint copy
AFTER_CHECKPOINT = "checkpoint"


def _preempt_rule() -> tuple[float, int, bool] | None:
    """``BROKER_FAKE_PREEMPT`` as (seconds, how many instances, whether the seconds count from the run's first
    checkpoint copy rather than from running); None when unset.  Raises BadInput (exit 2) naming the variable when
    it is not ``<seconds>[:<n>]`` or ``checkpoint[+<seconds>][:<n>]``."""
    raw = os.environ.get("BROKER_FAKE_PREEMPT", "").strip()
    if not raw:
        return None
    secs, _, n = raw.partition(":")
    after_ckpt = secs.startswith(AFTER_CHECKPOINT)
    if after_ckpt:
        secs = secs[len(AFTER_CHECKPOINT):].removeprefix("+") or "0"
    try:
        rule = (float(secs), int(n) if n else 1)
    except ValueError:
        rule = (-1.0, -1)
    if not 0 <= rule[0] < float("inf") or rule[1] < 0:  # nan and inf too: "never" is leaving the variable unset
        raise BadInput(f"BROKER_FAKE_PREEMPT={raw!r} is not <seconds>[:<n>] or checkpoint[+<seconds>][:<n>]",
                       hint="e.g. BROKER_FAKE_PREEMPT=60 (the first instance, 60 s after it runs), 60:2, or "
                            "checkpoint+5 (5 s after the run's first checkpoint copy)")
    return rule[0], rule[1], after_ckpt


def _first_checkpoint_at(inst: dict[str, Any]) -> float | None:
    """When broker's newest checkpoint copy of the instance's run landed (its ``LATEST`` file's mtime), or None."""
    import re

    from broker.core.config import runs_dir
    from broker.core.runfolder import RUN_ID_RE

    run_id = (inst.get("tags") or {}).get("broker-run", "")
    if not re.fullmatch(RUN_ID_RE, run_id):  # a tag is input: it names a folder only when it is a run id
        return None
    try:
        return (runs_dir() / run_id / "checkpoints" / "LATEST").stat().st_mtime
    except OSError:
        return None


def _reclaim_due(st: dict[str, Any], now: float) -> None:
    """Apply ``BROKER_FAKE_PREEMPT`` to the state: a running instance among the first n whose time has come is
    terminated by the pretend cloud (``reclaimed``)."""
    rule = _preempt_rule()
    if rule is None:
        return
    after, count, after_ckpt = rule
    for inst in st["instances"].values():
        if inst["state"] != "running" or inst.get("ordinal", count) >= count:
            continue
        since = inst.get("running_at")
        if after_ckpt:  # LATEST is replaced at every copy: the first one seen is kept in the state
            since = inst.get("checkpoint_at") or _first_checkpoint_at(inst)
            if since is not None:
                inst["checkpoint_at"] = since
        if since is not None and now - since >= after:
            inst.update(state="terminated", terminated_at=now, reclaimed=True)


def _hang(step: str) -> None:
    if step in _flags("BROKER_FAKE_HANG"):
        Path(f"{_state_path()}.hang-{step}").write_text(str(os.getpid()))
        while True:  # wait to be killed
            time.sleep(1)


class FakeProvider(Provider):
    """A file-backed pretend cloud with private networking (``simulated`` and ``multi-node``)."""

    name = "fake"
    #: what it can do, and why not (providers/declared.py; the registry reads the same object)
    caps = FAKE
    owner_tags = True  # models a cloud: run and installation tags on every object

    @classmethod
    def pretend_active(cls) -> bool:
        """In use when ``BROKER_FAKE_STATE`` names a state file (tests, demos)."""
        return bool(os.environ.get("BROKER_FAKE_STATE"))

    def __init__(self, state_path: Path | None = None, *, name: str | None = None, fail: str | None = None):
        self._path = state_path
        if name:
            self.name = name
        self._fail = {x.strip() for x in (fail or "").split(",") if x.strip()}

    def _fails(self) -> set[str]:
        return _flags("BROKER_FAKE_FAIL") | self._fail

    def _first_n(self, flag: str) -> bool:
        """True while the ``<flag>:<n>`` injection still applies (counted in the state file); ``<flag>`` alone:
        always."""
        fails = self._fails()
        if flag in fails:
            return True
        limited = [f for f in fails if f.startswith(flag + ":")]
        if not limited:
            return False
        with self._state() as st:
            counts = st.setdefault("counts", {})
            counts[flag] = counts.get(flag, 0) + 1
            n = counts[flag]
        return n <= int(limited[0].split(":", 1)[1])

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
            state.setdefault("networks", {})
            yield state
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=2))
            os.replace(tmp, self.path)

    # ---- read side
    def check(self) -> ProviderCheck:
        """Configured whenever it can be imported; a malformed ``BROKER_FAKE_PREEMPT`` is refused here, before
        anything is rented (raises BadInput), not at the first describe of every failover option."""
        _preempt_rule()
        return ProviderCheck(provider=self.name, configured=True, usable=True, detail=f"state file {self.path}")

    def offers(self, req: Requirements) -> list[Offer]:
        price = float(os.environ.get("BROKER_FAKE_USD_PER_HOUR", "1.0"))
        now = utcnow()
        out = []
        for zone in ZONES:
            for gpus, usd in ((1, price), (2, round(price * 1.8, 4))):
                out.append(Offer(provider=self.name, offer_id=f"fake.gpu{gpus}", instance_type=f"fake.gpu{gpus}",
                                 region="fake-region", zone=zone, gpu_name="FakeGPU", gpu_count=gpus,
                                 gpu_mem_gib=24, vcpus=4 * gpus, ram_gib=16 * gpus, usd_per_hour=usd,
                                 private_network=True, price_source="fake price list", price_time=now,
                                 attrs={"interruptible_usd_per_hour": round(usd / 2, 4),
                                        "interruptible_price_source": "fake price list (half)"}))
        return out

    # ---- lifecycle
    def bootstrap(self, run_id: str, offers: list[Offer], topology: str, rec: Any) -> dict[str, Any]:
        """``multi-node``: a fake VCN and subnet tagged with the run, each recorded before and after its create."""
        if topology != "multi-node":
            return {}
        out: dict[str, Any] = {}
        region = offers[0].region if offers else None
        for kind in ("vcn", "subnet"):
            name = f"broker-{run_id}-{kind}"
            rid = rec.intent(kind, name, region=region)
            if kind == "subnet" and "bootstrap" in self._fails():
                rec.failed(rid, "fake: subnet create failed (injected)")
                raise ProviderError(self.name, "bootstrap", "create subnet: HTTP 500 (injected)")
            with self._state() as st:
                nid = f"fake-{kind}-" + uuid.uuid4().hex[:8]
                tags = {RUN_TAG: run_id}
                if getattr(rec, "installation_id", None):
                    tags[INSTALL_TAG] = rec.installation_id
                st["networks"][nid] = {"id": nid, "kind": kind, "name": name, "state": "available",
                                       "created_at": time.time(), "tags": tags,
                                       "parent": out.get("vcn_id")}
            _hang(f"after-{kind}")
            rec.created(rid, nid)
            rec.event(f"{self.name}: {kind} {nid} created")
            out[f"{kind}_id"] = nid
        return out

    def create_instance(self, req: NodeRequest) -> str:
        fails = self._fails()
        _hang("before-create")
        if f"capacity@{req.offer.zone}" in fails:
            raise CapacityError(self.name, "create_instance", f"out of host capacity in {req.offer.zone}",
                                hint="broker fails over to the next zone")
        if "quota" in fails:
            raise QuotaError(self.name, "create_instance", "service limit fake-gpu-count exceeded (0 of 1 available)",
                             hint="raise the fake-gpu-count limit")
        if "gone" in fails:
            raise OfferGone(self.name, "create_instance", f"offer {req.offer.offer_id} is no longer available")
        if "transient" in fails:
            raise TransientError(self.name, "create_instance", "HTTP 503 (fake)")
        limited = [f for f in fails if f.startswith("transient:")]
        if limited:
            with self._state() as st:
                st["transient_count"] = st.get("transient_count", 0) + 1
                n = st["transient_count"]
            if n <= int(limited[0].split(":", 1)[1]):
                raise TransientError(self.name, "create_instance", f"HTTP 503 (fake, {n})")
        if req.network.get("subnet_id"):
            with self._state() as st:
                net = st["networks"].get(req.network["subnet_id"])
            if net is None or net["state"] != "available":
                raise ProviderError(self.name, "create_instance", f"subnet {req.network['subnet_id']} does not exist")
        tags = {RUN_TAG: req.run_id, **({INSTALL_TAG: req.installation_id} if req.installation_id else {}),
                **req.tags}
        with self._state() as st:
            for iid, inst in st["instances"].items():  # idempotent on the client token (unless no-idempotency)
                if inst["client_token"] == req.client_token and "no-idempotency" not in fails:
                    return iid
            iid = "fake-i-" + uuid.uuid4().hex[:10]
            st["instances"][iid] = {
                "id": iid, "ordinal": len(st["instances"]), "state": "pending", "created_at": time.time(),
                "zone": req.offer.zone,
                "instance_type": req.offer.instance_type, "usd_per_hour": req.offer.usd_per_hour,
                "tags": tags, "client_token": req.client_token, "name": req.name,
                "gpu_count": req.offer.gpu_count, "subnet_id": req.network.get("subnet_id"),
                "end_state": "failed" if f"failed@{req.offer.zone}" in fails else "running",
            }
        _hang("after-create")
        if f"create502@n{req.node_index}" in fails or self._first_n("create502"):
            raise TransientError(self.name, "create_instance", 'HTTP 502 {"success": false} (fake: created anyway)',
                                 status=502)
        return iid

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        from broker.core.records import InstanceInfo

        with self._state() as st:
            inst = st["instances"].get(provider_id)
            if inst is None:
                return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not found")
            ready_s = float(os.environ.get("BROKER_FAKE_READY_S", "0"))
            now = time.time()
            if inst["state"] == "pending" and now - inst["created_at"] >= ready_s:
                inst["state"] = inst.get("end_state", "running")
                if inst["state"] == "running":
                    inst["running_at"] = now
            _reclaim_due(st, now)
            state = inst["state"]
        if state == "running":
            _hang("ready")
        return InstanceInfo(provider_id=provider_id, state=state, raw_state=state, public_ip="127.0.0.1",
                            private_ip="127.0.0.1", ssh_host="127.0.0.1", usd_per_hour=inst["usd_per_hour"])

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        _hang("before-terminate")
        if "terminate" in self._fails():
            raise ProviderError(self.name, "terminate", f"{provider_id}: HTTP 500 (injected)",
                                hint="retry `broker down`; the resource stays listed until it is gone")
        if self._first_n("terminate500"):
            raise TransientError(self.name, "terminate", f"{provider_id}: HTTP 500 (injected, transient)", status=500)
        if kind != "instance":
            users: list[str] = []
            with self._state() as st:
                net = st["networks"].get(provider_id)
                if net is not None and net["state"] != "terminated":
                    users = [i["id"] for i in st["instances"].values()
                             if i["state"] != "terminated" and i.get("subnet_id") == provider_id]
                    users += [n["id"] for n in st["networks"].values()
                              if n["state"] != "terminated" and n.get("parent") == provider_id]
                    if users:
                        st.setdefault("conflicts", []).append(provider_id)  # tests count 409s
                    else:
                        net["state"] = "terminated"
                        net["terminated_at"] = time.time()
            if users:
                raise TransientError(self.name, "terminate", f"409 Conflict: {kind} {provider_id} is still in use "
                                     f"by {', '.join(users)}", hint="terminate those first", status=409)
            return True
        with self._state() as st:
            inst = st["instances"].get(provider_id)
            if inst is not None:
                inst["terminate_calls"] = inst.get("terminate_calls", 0) + 1  # tests count double terminations
            if inst is not None and inst["state"] != "terminated":
                inst["state"] = "terminated"
                inst["terminated_at"] = time.time()
        _hang("after-terminate")
        return True

    #: what a stopped fake instance bills for its pretend disk, $/h (``BROKER_FAKE_STOPPED_USD_PER_HOUR``)
    STOPPED_USD_PER_HOUR = 0.02

    def _set_state(self, provider_id: str, frm: tuple[str, ...], to: str, call: str) -> None:
        with self._state() as st:
            inst = st["instances"].get(provider_id)
            if inst is None or inst["state"] == "terminated":
                raise ProviderError(self.name, call, f"instance {provider_id} no longer exists",
                                    hint="`broker down RUN` records it gone")
            if inst["state"] not in frm + (to,):
                raise ProviderError(self.name, call, f"instance {provider_id} is {inst['state']}")
            inst["state"] = to
            inst.setdefault("state_calls", []).append(to)

    def stop(self, provider_id: str, *, region: str | None = None) -> None:
        """The state file's instance becomes ``stopped`` at once."""
        self._set_state(provider_id, ("running",), "stopped", "stop")

    def start(self, provider_id: str, *, region: str | None = None) -> None:
        """The state file's stopped instance becomes ``running`` at once (``pending`` for ``BROKER_FAKE_READY_S``
        seconds first, as at create: a machine that is slow to come back)."""
        if float(os.environ.get("BROKER_FAKE_READY_S", "0")) <= 0:
            self._set_state(provider_id, ("stopped",), "running", "start")
            return
        self._set_state(provider_id, ("stopped",), "pending", "start")
        with self._state() as st:
            st["instances"][provider_id]["created_at"] = time.time()

    def stopped_rate(self, provider_id: str, *, region: str | None = None,
                     attrs: dict[str, Any] | None = None) -> tuple[float, str]:
        """``BROKER_FAKE_STOPPED_USD_PER_HOUR`` (default :attr:`STOPPED_USD_PER_HOUR`) $/h."""
        rate = float(os.environ.get("BROKER_FAKE_STOPPED_USD_PER_HOUR", self.STOPPED_USD_PER_HOUR))
        return rate, "the fake cloud's pretend disk"

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        from broker.core.records import TaggedResource

        if "list" in self._fails():
            raise ProviderError(self.name, "list_tagged", "unreadable answer: 200 {\"results\": [...]} has no "
                                "'instances' key (injected)")
        with self._state() as st:
            insts = list(st["instances"].values())
            nets = list(st["networks"].values())
        out = [TaggedResource(provider=self.name, kind=n["kind"], provider_id=n["id"], run_id=n["tags"].get(RUN_TAG),
                              region="fake-region", state=n["state"], name=n["name"],
                              created_at=datetime.fromtimestamp(n["created_at"], timezone.utc), usd_per_hour=0.0,
                              installation_id=n["tags"].get(INSTALL_TAG))
               for n in nets if n["state"] != "terminated" and (run_id is None or n["tags"].get(RUN_TAG) == run_id)]
        return out + [TaggedResource(provider=self.name, kind="instance", provider_id=i["id"], run_id=i["tags"].get(RUN_TAG),
                               region="fake-region", state=i["state"], name=i["name"],
                               created_at=datetime.fromtimestamp(i["created_at"], timezone.utc),
                               usd_per_hour=i["usd_per_hour"], installation_id=i["tags"].get(INSTALL_TAG))
                for i in insts
                if i["state"] != "terminated" and RUN_TAG in i["tags"]
                and (run_id is None or i["tags"].get(RUN_TAG) == run_id)]

    # ---- test helpers
    def instances(self) -> dict[str, dict[str, Any]]:
        """The raw state (tests)."""
        with self._state() as st:
            return dict(st["instances"])

    def destroy(self, provider_id: str) -> None:
        """Terminate an instance behind broker's back (the node's own dead-man switch, the console) (tests)."""
        with self._state() as st:
            st["instances"][provider_id]["state"] = "terminated"
            st["instances"][provider_id]["terminated_at"] = time.time()
            st["instances"][provider_id]["reclaimed"] = True

    def preemption(self, resource_id: str) -> str | None:
        """The pretend cloud's word: an instance terminated behind broker's back (:meth:`destroy`: the provider
        took it back) was preempted; None for one broker terminated, a running one or an unknown id."""
        with self._state() as st:
            inst = st["instances"].get(resource_id)
        if inst and inst.get("reclaimed"):
            return "terminated by the provider (the fake cloud reclaimed it)"
        return None

    def networks(self) -> dict[str, dict[str, Any]]:
        """The raw network objects (tests)."""
        with self._state() as st:
            return dict(st["networks"])
