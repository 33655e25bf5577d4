"""Value types shared by the planner, the adapters, provisioning and the ledger.

Units are in the field names: ``usd_per_hour`` (US dollars per hour), ``gib`` (GiB, 2**30 bytes), ``seconds``.
Every price carries where it came from (``price_source``) and when (``price_time``).

The planner's types (:class:`Offer`, :class:`Quota`, :class:`Capacity`, :class:`Requirements`,
:class:`PlanOption`, :class:`Plan`) are stdlib dataclasses: ``broker plan`` imports no pydantic
(``bench/cli_startup.py``).  Their values come from code (adapters, the recipe, the CLI), never from a user's
file unchecked; JSON coming back (a ledger plan) goes through ``from_dict``.  The ledger and cluster records
(:class:`Resource`, :class:`Run`, :class:`ClusterNode`, :class:`Cluster`) stay pydantic models in
:mod:`broker.core.records`, which imports this module (never the other way: import them from there).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import TYPE_CHECKING, Any, Iterator, Literal

if TYPE_CHECKING:
    from broker.core.records import Cluster, ClusterNode, Resource, Run  # noqa: F401


def utcnow() -> datetime:
    """Timezone-aware now in UTC."""
    return datetime.now(timezone.utc)


def iso(t: datetime) -> str:
    """``t`` in ISO 8601 as pydantic writes it in JSON: UTC as ``Z`` (``2026-11-29T00:00:00Z``), other offsets as
    ``+HH:MM``, naive times without one."""
    s = t.isoformat()
    return s[:-6] + "Z" if s.endswith("+00:00") else s


def parse_time(v: Any) -> datetime:
    """A datetime from ``v`` (a datetime, or ISO 8601 text, ``Z`` accepted).  Raises ValueError, TypeError."""
    if isinstance(v, datetime):
        return v
    if not isinstance(v, str):
        raise TypeError(f"expected a datetime or ISO 8601 text, got {type(v).__name__}")
    return datetime.fromisoformat(v[:-1] + "+00:00" if v.endswith(("Z", "z")) else v)


def json_default(o: Any) -> Any:
    """``json.dumps`` ``default`` for broker's values: dataclasses as dicts (``dataclasses.asdict``), datetimes as
    :func:`iso`, enums by value.  Raises TypeError for anything else."""
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o, dict_factory=_json_dict)
    if isinstance(o, datetime):
        return iso(o)
    if isinstance(o, Enum):
        return o.value
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _json_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A dataclass's JSON dict; an option's (a ``rejected`` list of reasons beside ``reason_kind``) also carries
    ``rejections``, its reasons as data (:meth:`Rejection.as_dict`), after the texts ``rejected`` keeps."""
    d = dict(pairs)
    rej = d.get("rejected")
    if "reason_kind" in d and isinstance(rej, list):
        d["rejections"] = [r.as_dict() if isinstance(r, Rejection) else _as_rejection(r, d["reason_kind"]).as_dict()
                           for r in rej]
    return d


def to_json(o: Any) -> Any:
    """``o`` (a dataclass value, or lists / dicts of them) as plain JSON data: what ``json.loads`` of its dump
    gives (datetimes as ISO 8601 text, enums by value)."""
    import json

    return json.loads(json.dumps(o, default=json_default))


def _check_choice(cls: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{cls}.{name} must be one of {', '.join(allowed)}; got {value!r}")


def _floats(obj: Any, names: tuple[str, ...]) -> None:
    """Store the int values of ``obj``'s float fields ``names`` as floats (``vcpus=2`` -> ``2.0``), so JSON shows
    ``2.0`` whatever the caller passed (as the pydantic models did)."""
    for n in names:
        v = getattr(obj, n)
        if type(v) is int:
            object.__setattr__(obj, n, float(v))


class TopologyKind(str, Enum):
    """How N nodes are laid out (docs/design.md "Topologies")."""

    simulated = "simulated"  # one host with N GPUs acts as N single-GPU nodes, master_addr 127.0.0.1
    multi_node = "multi-node"  # N hosts in one private network (same VCN subnet / VPC security group)
    local = "local"  # simulated on this machine, free
    hybrid = "hybrid"  # node 0 = this machine, nodes 1.. = VMs, over a per-run WireGuard tunnel (broker.run.hybrid)


class RejectionKind(str, Enum):
    """Why the planner rejects an option, in its check order (the keys of ``Plan.rejected_counts``)."""

    provider = "provider"  # the provider offers nothing here (this machine's limits, a failed live answer, no price)
    gpu_model = "gpu-model"
    gpu_memory = "gpu-memory"
    topology = "topology"
    capacity = "capacity"
    quota = "quota"
    budget = "budget"
    #: a reason read back from JSON written before reasons carried their kind
    other = "other"


class Rejection(str):
    """One reason an option is rejected, as data: its :class:`RejectionKind`, the sentence shown to the user
    (``text``; the value itself, so code and JSON that read reasons as text keep working), the command that would
    lift it (``next_step``, e.g. a ready ``broker quota request ...``) and the job setting that would lift it
    (``lifted_by``: ``"cpu_ok"`` when this machine has no GPU and gloo on CPU would do).

    Readers decide by ``kind`` and ``lifted_by``, never by the words of ``text``: rewording a reason changes no
    hint.  Immutable; raises ValueError for an unknown kind.
    """

    kind: RejectionKind
    next_step: str | None
    lifted_by: str | None

    def __new__(cls, kind: RejectionKind | str, text: str, next_step: str | None = None,
                lifted_by: str | None = None) -> Rejection:
        self = super().__new__(cls, text)
        self.kind = RejectionKind(kind)
        self.next_step = next_step
        self.lifted_by = lifted_by
        return self

    @property
    def text(self) -> str:
        return str.__str__(self)

    def reworded(self, text: str) -> Rejection:
        """The same rejection (kind, next step) shown as ``text``."""
        return Rejection(self.kind, text, self.next_step, self.lifted_by)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"kind", "text", "next_step", "lifted_by"}``."""
        return {"kind": self.kind.value, "text": self.text, "next_step": self.next_step, "lifted_by": self.lifted_by}

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """pydantic reads a rejection as its text (kind ``other``, as from old JSON) and writes it as its text, the
        ``rejected`` field's form; pydantic is imported only when something asks it for a schema."""
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(
            lambda v: v if isinstance(v, Rejection) else cls(RejectionKind.other, v), core_schema.str_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(lambda v: str.__str__(v)))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rejection:
        """From :meth:`as_dict`; an unknown kind reads as ``other``.  Raises KeyError, TypeError (no text)."""
        kind = d.get("kind")
        if kind not in RejectionKind._value2member_map_:
            kind = RejectionKind.other
        return cls(kind, str(d["text"]), d.get("next_step"), d.get("lifted_by"))

    def __reduce__(self) -> tuple:
        return (Rejection, (self.kind.value, self.text, self.next_step, self.lifted_by))

    def __copy__(self) -> Rejection:
        return self

    def __deepcopy__(self, memo: dict) -> Rejection:
        return self

    def __repr__(self) -> str:
        return f"Rejection({self.kind.value!r}, {self.text!r})"


def _as_rejection(r: str, kind: str | None) -> Rejection:
    """``r`` as a :class:`Rejection`: itself, or plain text (written before reasons carried their kind) of
    ``kind`` (the option's count bucket) when known, else ``other``."""
    if isinstance(r, Rejection):
        return r
    return Rejection(kind if kind in RejectionKind._value2member_map_ else RejectionKind.other, r)


@dataclass(frozen=True, kw_only=True, slots=True)
class Offer:
    """One rentable unit: a Vast.ai offer (one host), an OCI shape or an AWS instance type in one place.

    ``gpu_mem_gib`` is per GPU.  ``usd_per_hour`` is for the whole unit (all its GPUs), excluding storage that is
    priced separately through ``storage_usd_per_gib_month``.  ``private_network`` is True where several units
    can be joined in one private network (OCI, AWS; never Vast.ai hosts, which sit behind separate NATs).

    Built by the million (a live market, a catalog): slots (no ``__dict__``), the texts many offers share
    (provider, type, region, zone, GPU name, price source) interned, and an ``__init__`` that sets the slots
    directly instead of the frozen dataclass's ``object.__setattr__`` per field (bench/planner_build.py).
    """

    provider: str
    offer_id: str  # Vast ask id, or the instance type / shape name for OCI and AWS
    instance_type: str  # OCI shape / AWS instance type / Vast "2x RTX 4090" style label
    region: str | None = None
    zone: str | None = None  # availability zone (AWS) / availability domain (OCI)
    gpu_name: str
    gpu_count: int
    gpu_mem_gib: float
    vcpus: float = 0
    ram_gib: float = 0
    usd_per_hour: float
    storage_usd_per_gib_month: float = 0.0
    min_billed_seconds: float = 60.0
    private_network: bool = False
    price_source: str
    price_time: datetime
    attrs: dict[str, Any] = field(default_factory=dict)

    def __init__(self, *, provider: str, offer_id: str, instance_type: str, region: str | None = None,
                 zone: str | None = None, gpu_name: str, gpu_count: int, gpu_mem_gib: float, vcpus: float = 0,
                 ram_gib: float = 0, usd_per_hour: float, storage_usd_per_gib_month: float = 0.0,
                 min_billed_seconds: float = 60.0, private_network: bool = False, price_source: str,
                 price_time: datetime, attrs: dict[str, Any] | None = None) -> None:
        # int values of float fields are stored as floats (vcpus=2 -> 2.0) so JSON shows 2.0 whatever the caller
        # passed, as the pydantic models did
        s, intern = _OFFER_SET, sys.intern  # inline: a helper call per field costs as much as the rest
        s[0](self, intern(provider) if type(provider) is str else provider)
        s[1](self, offer_id)
        s[2](self, intern(instance_type) if type(instance_type) is str else instance_type)
        s[3](self, intern(region) if type(region) is str else region)
        s[4](self, intern(zone) if type(zone) is str else zone)
        s[5](self, intern(gpu_name) if type(gpu_name) is str else gpu_name)
        s[6](self, gpu_count)
        s[7](self, float(gpu_mem_gib) if type(gpu_mem_gib) is int else gpu_mem_gib)
        s[8](self, float(vcpus) if type(vcpus) is int else vcpus)
        s[9](self, float(ram_gib) if type(ram_gib) is int else ram_gib)
        s[10](self, float(usd_per_hour) if type(usd_per_hour) is int else usd_per_hour)
        s[11](self, float(storage_usd_per_gib_month) if type(storage_usd_per_gib_month) is int
              else storage_usd_per_gib_month)
        s[12](self, float(min_billed_seconds) if type(min_billed_seconds) is int else min_billed_seconds)
        s[13](self, private_network)
        s[14](self, intern(price_source) if type(price_source) is str else price_source)
        s[15](self, price_time)
        s[16](self, {} if attrs is None else attrs)

    @property
    def key(self) -> str:
        """Stable identity: provider/region/zone/offer id."""
        return f"{self.provider}/{self.region or '-'}/{self.zone or '-'}/{self.offer_id}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Offer:
        """An offer from its JSON form (:func:`to_json`): ``price_time`` ISO 8601 text.  Unknown keys are ignored.
        Raises ValueError, TypeError (a missing or malformed field)."""
        kw = {k: v for k, v in d.items() if k in _OFFER_FIELDS}
        kw["price_time"] = parse_time(kw.get("price_time"))
        kw["attrs"] = dict(kw.get("attrs") or {})
        return cls(**kw)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while many offers are built (a live market answer, a price
    snapshot, the interruptible twins), then restored to what it was.

    Offers (and their ``attrs`` dicts) form no reference cycles, yet every 700 new objects the collector scans the
    young ones and, as the heap grows, every offer built so far: 55-60 % of building a million offers
    (bench/planner_build.py: 5.2 -> 2.2 s CPU on the 2-core dev machine).  Nothing is freed any later than without
    the pause, because objects without cycles are freed by reference counting."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


#: the slot setters of Offer in field order (what its __init__ sets: member descriptors skip the frozen check)
_OFFER_SET = [getattr(Offer, f.name).__set__ for f in dataclasses.fields(Offer)]
_OFFER_FIELDS = frozenset(f.name for f in dataclasses.fields(Offer))
assert [f.name for f in dataclasses.fields(Offer)] == list(Offer.__init__.__code__.co_varnames[1:18])


QUOTA_UNITS = ("gpus", "vcpus", "instances")


@dataclass(kw_only=True)
class Quota:
    """A service limit as read from the provider.

    ``unit`` is what ``limit``/``used`` count: ``"gpus"`` (OCI ``gpu-*-count``) or ``"vcpus"`` (AWS
    ``L-DB2E81BA``...).  ``scope`` is the availability domain for AD-scoped OCI limits, else the region.
    ``instance_types`` lists the shapes / instance types the limit covers.  Raises ValueError for another unit.
    """

    provider: str
    name: str  # OCI limit name (gpu-a10-count) or AWS quota code (L-DB2E81BA)
    description: str = ""
    region: str | None = None
    scope: str | None = None
    limit: float
    used: float = 0.0
    unit: Literal["gpus", "vcpus", "instances"]
    instance_types: list[str] = field(default_factory=list)
    source: str = ""
    #: the limit counts interruptible capacity only (AWS "All G and VT Spot Instance Requests"): the planner judges
    #: interruptible options by it, and on-demand ones never (a provider without such limits: its others apply)
    interruptible: bool = False

    def __post_init__(self) -> None:
        _check_choice("Quota", "unit", self.unit, QUOTA_UNITS)
        _floats(self, ("limit", "used"))

    @property
    def available(self) -> float:
        return max(0.0, self.limit - self.used)


CAPACITY_STATUSES = ("AVAILABLE", "OUT_OF_HOST_CAPACITY", "NOT_OFFERED", "UNKNOWN")


@dataclass(kw_only=True)
class Capacity:
    """Host capacity for one instance type in one zone (OCI capacity report; AWS offerings; Vast rentable).
    Raises ValueError for a ``status`` not in :data:`CAPACITY_STATUSES`."""

    provider: str
    region: str | None = None
    zone: str | None = None
    instance_type: str
    status: Literal["AVAILABLE", "OUT_OF_HOST_CAPACITY", "NOT_OFFERED", "UNKNOWN"]
    available_count: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        _check_choice("Capacity", "status", self.status, CAPACITY_STATUSES)


#: Cards sold as "24 GB" report 24564 MiB (23.99 GiB): GPU memory within this fraction below the minimum counts as
#: enough (an RTX 4090 serves a 24 GiB job; an A10G's 22.35 GiB does not).
GPU_MEM_TOLERANCE = 0.02

REQUIREMENT_TOPOLOGIES = ("simulated", "multi-node", "local", "hybrid", "any")


@dataclass(kw_only=True)
class Requirements:
    """What a job needs, independent of any provider.

    ``gpu_names`` empty = any model.  ``hours`` is the hard deadline used for the worst-case cost; None means
    "as long as the budget affords".  Raises ValueError for a ``topology`` not in
    :data:`REQUIREMENT_TOPOLOGIES`.
    """

    nodes: int = 2
    gpus_per_node: int = 1
    gpu_names: list[str] = field(default_factory=list)
    min_gpu_mem_gib: float = 16.0
    hours: float | None = 1.0
    budget_usd: float | None = 5.0
    topology: Literal["simulated", "multi-node", "local", "hybrid", "any"] = "any"
    cpu_ok: bool = False
    disk_gib: float = 40.0
    providers: list[str] = field(default_factory=list)  # empty = all
    #: rent interruptible capacity (bid / spot / preemptible): "false", "true" or "auto" (only when the expected
    #: cost with restarts is lower); see :mod:`broker.plan.interruptible`
    interruptible: Literal["false", "true", "auto"] = "false"
    #: restarts after preemptions the budget must cover (attempts = max_restarts + 1)
    max_restarts: int = 3
    #: seconds between checkpoint copies: the work lost to a preemption is half of it on average
    checkpoint_every_s: int = 60
    #: GB each rented unit receives (the staged work folder) and sends back (collected artifacts and checkpoint
    #: copies, an estimate): priced at an offer's per-GB rates (``Offer.attrs`` ``transfer_in_usd_per_gb`` /
    #: ``transfer_out_usd_per_gb``) into the worst case
    transfer_in_gb: float = 0.0
    transfer_out_gb: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.topology, TopologyKind):
            self.topology = self.topology.value
        _check_choice("Requirements", "topology", self.topology, REQUIREMENT_TOPOLOGIES)
        _check_choice("Requirements", "interruptible", self.interruptible, ("false", "true", "auto"))
        _floats(self, ("min_gpu_mem_gib", "hours", "budget_usd", "disk_gib", "transfer_in_gb", "transfer_out_gb"))

    @property
    def gpu_mem_floor_gib(self) -> float:
        """The least memory per GPU (GiB) that satisfies ``min_gpu_mem_gib`` (see :data:`GPU_MEM_TOLERANCE`)."""
        return self.min_gpu_mem_gib * (1 - GPU_MEM_TOLERANCE)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Requirements:
        """Requirements from their JSON form (:func:`to_json`); unknown keys are ignored.  Raises ValueError,
        TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(kw_only=True)
class PlanOption:
    """One way to run the job: a topology on one provider, with its cost and, when rejected, why.

    ``offers`` holds one offer for ``simulated`` (one host) and N (possibly equal) offers for ``multi-node``.
    ``worst_case_usd`` = cost if the job runs to the hard deadline (setup allowance and storage included).
    ``max_hours_within_budget`` = the longest run the budget affords at this price.
    ``topology`` given as text is turned into its :class:`TopologyKind` (ValueError for an unknown one).
    """

    provider: str
    topology: TopologyKind
    offers: list[Offer] = field(default_factory=list)
    nodes: int
    gpus_per_node: int
    usd_per_hour: float
    worst_case_usd: float
    hours: float
    max_hours_within_budget: float | None = None
    price_source: str = ""
    #: why it is rejected (:class:`Rejection`: text with its kind; plain text given is read as kind ``other``, or
    #: ``reason_kind`` when set); empty = valid.  ``--json`` writes the texts here and the data in ``rejections``
    rejected: list[Rejection] = field(default_factory=list)
    next_step: str | None = None  # e.g. a ready `broker quota request ...` command
    #: interruptible capacity (bid / spot / preemptible): ``worst_case_usd`` then covers ``max_restarts + 1``
    #: attempts (one setup allowance each), ``hours`` is the job time (:mod:`broker.plan.interruptible`)
    interruptible: bool = False
    #: restarts after preemptions the worst case covers (0 for on-demand)
    max_restarts: int = 0
    #: expected USD: on-demand = ``worst_case_usd``; interruptible = the restart model's expectation
    expected_usd: float | None = None
    #: preemptions per hour of the whole option assumed by the expectation (None for on-demand)
    preemptions_per_hour: float | None = None
    #: interruptible: the on-demand USD per hour of the same offers (storage included), what its $/h saves on;
    #: None for on-demand
    on_demand_usd_per_hour: float | None = None
    #: a rejected option's reason kind (one of broker.plan.rejections.REASON_KINDS: its count in
    #: ``Plan.rejected_counts``); None for a valid option
    reason_kind: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.topology, TopologyKind):
            self.topology = TopologyKind(self.topology)
        _floats(self, ("usd_per_hour", "worst_case_usd", "hours", "max_hours_within_budget", "expected_usd",
                       "preemptions_per_hour", "on_demand_usd_per_hour"))
        if any(not isinstance(r, Rejection) for r in self.rejected):
            self.rejected = [_as_rejection(r, self.reason_kind) for r in self.rejected]

    @property
    def valid(self) -> bool:
        return not self.rejected

    @property
    def summary(self) -> str:
        if not self.offers:
            return f"{self.topology.value} on {self.provider}"
        o = self.offers[0]
        # "2 x g5.xlarge": two VMs, as the plan table writes them ("2x RTX 4090" is one Vast host's own label)
        what = f"{o.instance_type}" if self.topology is not TopologyKind.multi_node else f"{len(self.offers)} x {o.instance_type}"
        if self.topology is TopologyKind.hybrid:
            what = f"this machine + {len(self.offers)} x {o.instance_type}"
        where = "/".join(x for x in (o.region, o.zone) if x)
        return f"{what} ({where})" if where else what

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanOption:
        """An option from its JSON form (:func:`to_json`, e.g. a run's ledger plan); unknown keys are ignored.
        Raises ValueError, TypeError (a missing or malformed field)."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["offers"] = [o if isinstance(o, Offer) else Offer.from_dict(o) for o in kw.get("offers") or []]
        data = d.get("rejections")
        if isinstance(data, list) and len(data) == len(kw.get("rejected") or []):
            kw["rejected"] = [Rejection.from_dict(r) for r in data]
        else:
            kw["rejected"] = list(kw.get("rejected") or [])
        return cls(**kw)


@dataclass(kw_only=True)
class Plan:
    """The planner's answer: valid options ranked by cost (``options[0]`` is chosen) and the rejected ones."""

    requirements: Requirements
    options: list[PlanOption] = field(default_factory=list)
    rejected: list[PlanOption] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. "prices: snapshot 2026-11-29; live quote needs VAST_API_KEY"
    created_at: datetime = field(default_factory=utcnow)
    rejected_counts: dict[str, int] = field(default_factory=dict)  # every rejected candidate, by first reason kind
    valid_count: int | None = None  # valid candidates found; ``options`` holds the best of them

    @property
    def chosen(self) -> PlanOption | None:
        return self.options[0] if self.options else None


#: ``unknown``: a create answered ambiguously (5xx, timeout) and no list could prove whether it exists: counted as
#: possibly billing (worst case) until a later list finds it (then it is terminated) or proves it absent.
#: ``stopping`` / ``stopped`` / ``starting``: ``broker stop`` / ``broker start`` (ledger-first: ``stopping`` and
#: ``starting`` are written before the provider call, ``stopped`` / ``running`` once it is confirmed); a
#: ``stopped`` row bills ``stopped_usd_per_hour`` (its disk), the others their ``usd_per_hour``.
ResourceState = Literal["intent", "creating", "running", "terminating", "terminated", "failed", "orphan", "unknown",
                        "stopping", "stopped", "starting"]

RunStatus = Literal["planned", "provisioning", "running", "succeeded", "failed", "interrupted", "deadline",
                    "tearing_down", "torn_down"]
