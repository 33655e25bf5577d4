"""Value types shared by the planner, the adapters, provisioning and the ledger.

Units are in the field names: ``usd_per_hour`` (US dollars per hour), ``gib`` (GiB, 2**30 bytes), ``seconds``.
Every price carries where it came from (``price_source``) and when (``price_time``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    """Base of broker's value types: schemas are built on first use (``defer_build``), so a command pays only for
    the models it touches (``bench/cli_startup.py``)."""

    model_config = ConfigDict(defer_build=True)


def utcnow() -> datetime:
    """Timezone-aware now in UTC."""
    return datetime.now(timezone.utc)


class TopologyKind(str, Enum):
    """How N nodes are laid out (docs/design.md "Topologies")."""

    simulated = "simulated"  # one host with N GPUs acts as N single-GPU nodes, master_addr 127.0.0.1
    multi_node = "multi-node"  # N hosts in one private network (same VCN subnet / VPC security group)
    local = "local"  # simulated on this machine, free
    hybrid = "hybrid"  # node 0 = this machine, nodes 1.. = VMs, over a per-run WireGuard tunnel (broker.hybrid)


class Offer(_Model):
    """One rentable unit: a Vast.ai offer (one host), an OCI shape or an AWS instance type in one place.

    ``gpu_mem_gib`` is per GPU.  ``usd_per_hour`` is for the whole unit (all its GPUs), excluding storage that is
    priced separately through ``storage_usd_per_gib_month``.  ``private_network`` is True where several units
    can be joined in one private network (OCI, AWS; never Vast.ai hosts, which sit behind separate NATs).
    """

    model_config = ConfigDict(frozen=True)

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
    attrs: dict[str, Any] = Field(default_factory=dict)

    @property
    def key(self) -> str:
        """Stable identity: provider/region/zone/offer id."""
        return f"{self.provider}/{self.region or '-'}/{self.zone or '-'}/{self.offer_id}"


class Quota(_Model):
    """A service limit as read from the provider.

    ``unit`` is what ``limit``/``used`` count: ``"gpus"`` (OCI ``gpu-*-count``) or ``"vcpus"`` (AWS
    ``L-DB2E81BA``...).  ``scope`` is the availability domain for AD-scoped OCI limits, else the region.
    ``instance_types`` lists the shapes / instance types the limit covers.
    """

    provider: str
    name: str  # OCI limit name (gpu-a10-count) or AWS quota code (L-DB2E81BA)
    description: str = ""
    region: str | None = None
    scope: str | None = None
    limit: float
    used: float = 0.0
    unit: Literal["gpus", "vcpus", "instances"]
    instance_types: list[str] = Field(default_factory=list)
    source: str = ""

    @property
    def available(self) -> float:
        return max(0.0, self.limit - self.used)


class Capacity(_Model):
    """Host capacity for one instance type in one zone (OCI capacity report; AWS offerings; Vast rentable)."""

    provider: str
    region: str | None = None
    zone: str | None = None
    instance_type: str
    status: Literal["AVAILABLE", "OUT_OF_HOST_CAPACITY", "NOT_OFFERED", "UNKNOWN"]
    available_count: int | None = None
    source: str = ""


#: Cards sold as "24 GB" report 24564 MiB (23.99 GiB): GPU memory within this fraction below the minimum counts as
#: enough (an RTX 4090 serves a 24 GiB job; an A10G's 22.35 GiB does not).
GPU_MEM_TOLERANCE = 0.02


class Requirements(_Model):
    """What a job needs, independent of any provider.

    ``gpu_names`` empty = any model.  ``hours`` is the hard deadline used for the worst-case cost; None means
    "as long as the budget affords".
    """

    nodes: int = 2
    gpus_per_node: int = 1
    gpu_names: list[str] = Field(default_factory=list)
    min_gpu_mem_gib: float = 16.0
    hours: float | None = 1.0
    budget_usd: float | None = 5.0
    topology: Literal["simulated", "multi-node", "local", "hybrid", "any"] = "any"
    cpu_ok: bool = False
    disk_gib: float = 40.0
    providers: list[str] = Field(default_factory=list)  # empty = all

    @property
    def gpu_mem_floor_gib(self) -> float:
        """The least memory per GPU (GiB) that satisfies ``min_gpu_mem_gib`` (see :data:`GPU_MEM_TOLERANCE`)."""
        return self.min_gpu_mem_gib * (1 - GPU_MEM_TOLERANCE)


class PlanOption(_Model):
    """One way to run the job: a topology on one provider, with its cost and, when rejected, why.

    ``offers`` holds one offer for ``simulated`` (one host) and N (possibly equal) offers for ``multi-node``.
    ``worst_case_usd`` = cost if the job runs to the hard deadline (setup allowance and storage included).
    ``max_hours_within_budget`` = the longest run the budget affords at this price.
    """

    provider: str
    topology: TopologyKind
    offers: list[Offer] = Field(default_factory=list)
    nodes: int
    gpus_per_node: int
    usd_per_hour: float
    worst_case_usd: float
    hours: float
    max_hours_within_budget: float | None = None
    price_source: str = ""
    rejected: list[str] = Field(default_factory=list)  # reasons; empty = valid
    next_step: str | None = None  # e.g. a ready `broker quota request ...` command

    @property
    def valid(self) -> bool:
        return not self.rejected

    @property
    def summary(self) -> str:
        if not self.offers:
            return f"{self.topology.value} on {self.provider}"
        o = self.offers[0]
        what = f"{o.instance_type}" if self.topology is not TopologyKind.multi_node else f"{len(self.offers)}x {o.instance_type}"
        if self.topology is TopologyKind.hybrid:
            what = f"this machine + {len(self.offers)}x {o.instance_type}"
        where = "/".join(x for x in (o.region, o.zone) if x)
        return f"{what} ({where})" if where else what


class Plan(_Model):
    """The planner's answer: valid options ranked by cost (``options[0]`` is chosen) and the rejected ones."""

    requirements: Requirements
    options: list[PlanOption] = Field(default_factory=list)
    rejected: list[PlanOption] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)  # e.g. "prices: snapshot 2026-11-29; live quote needs VAST_API_KEY"
    created_at: datetime = Field(default_factory=utcnow)
    rejected_counts: dict[str, int] = Field(default_factory=dict)  # every rejected candidate, by first reason kind
    valid_count: int | None = None  # valid candidates found; ``options`` holds the best of them

    @property
    def chosen(self) -> PlanOption | None:
        return self.options[0] if self.options else None


#: ``unknown``: a create answered ambiguously (5xx, timeout) and no list could prove whether it exists: counted as
#: possibly billing (worst case) until a later list finds it (then it is terminated) or proves it absent.
ResourceState = Literal["intent", "creating", "running", "terminating", "terminated", "failed", "orphan", "unknown"]


class Resource(_Model):
    """A ledger row: one thing that can cost money (instance, volume) or that must be cleaned (VCN, SG...).

    Written with state ``intent`` *before* the provider call that creates it; ``provider_id`` is filled right
    after.  ``usd_per_hour`` is what it bills while alive (0 for free network objects).
    """

    id: str
    run_id: str
    provider: str
    kind: str  # instance | vcn | subnet | internet_gateway | security_list | security_group | placement_group | ...
    name: str
    provider_id: str | None = None
    region: str | None = None
    zone: str | None = None
    state: ResourceState = "intent"
    usd_per_hour: float = 0.0
    created_at: datetime = Field(default_factory=utcnow)
    running_since: datetime | None = None
    terminated_at: datetime | None = None
    deadline: datetime | None = None
    terminated_by: str | None = None
    error: str | None = None
    attrs: dict[str, Any] = Field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.state not in ("terminated",)


RunStatus = Literal["planned", "provisioning", "running", "succeeded", "failed", "interrupted", "deadline",
                    "tearing_down", "torn_down"]


class Run(_Model):
    """A ledger row for one ``broker run``: recipe, plan, status, times, per-node exit codes, log paths."""

    id: str
    name: str
    recipe_path: str | None = None
    recipe: dict[str, Any] = Field(default_factory=dict)
    plan: dict[str, Any] | None = None
    provider: str = "local"
    topology: str = "local"
    status: RunStatus = "planned"
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    deadline: datetime | None = None
    budget_usd: float | None = None
    exit_codes: dict[str, int | None] = Field(default_factory=dict)
    run_dir: str | None = None
    log_paths: dict[str, str] = Field(default_factory=dict)
    message: str | None = None
    pid: int | None = None  # the CLI process driving the run


class ClusterNode(_Model):
    """One node of a provisioned cluster, as the runner reaches it.

    ``host``/``port``/``user``: the SSH endpoint (public IP, Vast proxy, or a netns address).  ``private_ip``: the
    address the other nodes use (node 0's is ``master_addr``; ``127.0.0.1`` for simulated nodes on one host).
    ``gpu_indices``: the CUDA_VISIBLE_DEVICES value for this node (None = all of the host's GPUs / not set).
    ``local``: the node is THIS machine (a hybrid run's node 0): the SSH executor runs its commands as local
    processes (:class:`broker.localconn.LocalConnection`) instead of over SSH; ``workroot`` / ``python`` then
    replace the cluster's for this node (None = the cluster's).
    """

    node_rank: int
    host: str
    port: int = 22
    user: str = "root"
    private_ip: str
    gpu_indices: list[str] | None = None
    resource_id: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    local: bool = False
    workroot: str | None = None
    python: str | None = None


class Cluster(_Model):
    """What provisioning hands to the runner: the nodes, the SSH material and how to run Python there.

    ``local_exec`` is True for providers whose "nodes" are processes on this machine (``local``, the ``fake``
    test provider): the runner then starts them as local subprocesses instead of over SSH.
    """

    run_id: str
    provider: str
    topology: TopologyKind
    nodes: list[ClusterNode]
    ssh_key_path: str | None = None
    known_hosts_path: str | None = None
    python: str = "python3"
    workroot: str = "/root/broker"
    local_exec: bool = False

    @property
    def master_addr(self) -> str:
        return self.nodes[0].private_ip
