"""The pydantic records of the ledger and of provisioning: :class:`Resource`, :class:`Run` (ledger rows),
:class:`ClusterNode`, :class:`Cluster` (what provisioning hands to the runner), and the adapters' records
(:class:`NodeRequest`, :class:`Ingress`, :class:`InstanceInfo`, :class:`TaggedResource`, :class:`QuotaRequest`).

Kept apart from :mod:`broker.core.model` / :mod:`broker.core.provider` so that ``broker plan`` imports no pydantic.  This
module imports those two, never the other way (``tests/test_layers.py``): import the records from here, inside the
functions that build them where start-up time matters.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_serializer, field_validator, model_validator

from broker.core.model import Offer, ResourceState, RunStatus, TopologyKind, utcnow
from broker.core.provider import InstanceState


class _Model(BaseModel):
    """Base of broker's pydantic records: schemas are built on first use (``defer_build``), so a command pays only
    for the models it touches (``bench/cli_startup.py``)."""

    model_config = ConfigDict(defer_build=True)


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
    #: when ``broker stop`` confirmed it stopped (None while not stopped)
    stopped_at: datetime | None = None
    #: what it bills while ``stopped``, US dollars per hour (its disk; None = never stopped)
    stopped_usd_per_hour: float | None = None
    #: US dollars billed before ``rate_since`` (each rate change folds the money so far in here)
    banked_usd: float = 0.0
    #: when the rate in effect began (None = ``created_at``: the rate never changed)
    rate_since: datetime | None = None

    @field_validator("attrs")
    @classmethod
    def _attrs_are_data(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """A row's attrs never name a program, path, PID, interface or host broker did not write there
        (:mod:`broker.core.rowattrs`): a row that does fails to validate and the ledger skips it as damaged."""
        from pydantic_core import PydanticCustomError

        from broker.core.rowattrs import AttrsRefused, check_attrs

        try:
            return check_attrs(str(info.data.get("kind") or ""), str(info.data.get("run_id") or ""), v,
                               runs=(info.context or {}).get("runs"))
        except AttrsRefused as e:
            raise PydanticCustomError("attrs_refused", "attrs.{field} = {value}: {why}",
                                      {"field": e.field, "value": repr(e.value), "why": e.why}) from None

    @property
    def live(self) -> bool:
        return self.state not in ("terminated",)


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
    #: that process's start time (clock ticks after boot, /proc/PID/stat field 22): with ``pid`` its identity
    #: (:mod:`broker.core.procid`); a pid whose process started at another time is someone else's
    pid_start: int | None = None

    @field_serializer("recipe")
    def _recipe_masked(self, recipe: dict[str, Any]) -> dict[str, Any]:
        """The recipe with its secret-looking ``env`` values masked, whatever wrote the row (a ledger of an older
        broker stored them in clear): the ledger, ``broker status RUN --json`` and the summaries never show one."""
        return mask_recipe(recipe)


def run_where(run: Any) -> str:
    """Where a run ran, for its headline: ``multi-node on aws``; ``local`` (not ``local on local``) where the
    topology is the provider's name.  ``run``: a :class:`Run` (or anything with ``topology`` and ``provider``)."""
    return run.topology if run.topology == run.provider else f"{run.topology} on {run.provider}"


def mask_recipe(recipe: dict[str, Any]) -> dict[str, Any]:
    """A copy of a serialized recipe whose ``env`` values of secret-looking names (:func:`broker.core.private.looks_secret`)
    are masked, ``${NAME}`` references kept; other fields as they are."""
    from broker.core.private import MASK, looks_secret

    env = recipe.get("env") if isinstance(recipe, dict) else None
    if not isinstance(env, dict):
        return recipe
    masked = {k: (MASK if looks_secret(str(k)) and v and "${" not in str(v) else v) for k, v in env.items()}
    return {**recipe, "env": masked}


class ClusterNode(_Model):
    """One node of a provisioned cluster, as the runner reaches it.

    ``host``/``port``/``user``: the SSH endpoint (public IP, Vast proxy, or a netns address).  ``private_ip``: the
    address the other nodes use (node 0's is ``master_addr``; ``127.0.0.1`` for simulated nodes on one host).
    ``gpu_indices``: the CUDA_VISIBLE_DEVICES value for this node (None = all of the host's GPUs / not set).
    ``local``: the node is THIS machine (a hybrid run's node 0): the SSH executor runs its commands as local
    processes (:class:`broker.run.localconn.LocalConnection`) instead of over SSH; ``workroot`` / ``python`` then
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


# ----------------------------------------------------------------------------------- adapters' records
class NodeRequest(_Model):
    """What to create for one node.  ``client_token`` is the ledger resource id (idempotency key)."""

    run_id: str
    node_index: int
    name: str  # broker-<run_id>-n<i>
    offer: Offer
    ssh_public_key: str
    client_token: str
    installation_id: str | None = None  # tagged as INSTALL_TAG beside RUN_TAG on everything created for the node
    disk_gib: float = 40.0
    image: str | None = None
    deadline: datetime | None = None  # hard deadline: arms the node-side dead-man switch
    grace_seconds: float = 300.0
    network: dict[str, Any] = Field(default_factory=dict)  # ids returned by bootstrap (subnet, sg, pg ...)
    tags: dict[str, str] = Field(default_factory=dict)
    onstart: str | None = None  # extra shell run at boot (after the dead-man switch is armed)
    idle_minutes: float | None = None  # recipe idle_minutes: arms the node-side idle stop (job ended + no SSH)


class Ingress(BaseModel):
    """One inbound rule a run needs on its network beyond SSH (e.g. a hybrid run's WireGuard port): ``protocol``
    ``udp`` or ``tcp``, destination ports ``port``..``port_to`` (inclusive), from ``cidr`` (the caller's public
    address as /32 where known, else ``0.0.0.0/0``).  Adapters translate it into their own rule (OCI security list
    rule, AWS ``IpPermissions``) in :meth:`Provider.open_ingress`."""

    protocol: Literal["udp", "tcp"]
    port: int
    port_to: int | None = None
    cidr: str = "0.0.0.0/0"
    description: str = ""

    @property
    def last_port(self) -> int:
        return self.port_to or self.port


def read_rate(raw: Any) -> tuple[float | None, str | None]:
    """A rate (US dollars per hour) as a provider reported it: ``(rate, None)`` for a number or a string that is a
    plain decimal (``"24.7200"``: the provider's number, as some APIs send prices); ``(None, why)`` for what broker
    cannot read as a price (text, a negative number, NaN, infinity, a bool); ``(None, None)`` for nothing reported.
    A rate broker cannot read is unknown, never the planned one (:func:`broker.money.cost.record_unknown_rate`)."""
    import math
    import re

    if raw is None:
        return None, None
    shown = repr(raw)[:40]
    if isinstance(raw, bool):
        return None, f"{shown} is not a number"
    if isinstance(raw, (int, float)):
        v = float(raw)
    elif isinstance(raw, str) and re.fullmatch(r"\d{1,12}(?:\.\d{1,12})?", raw.strip()):
        v = float(raw.strip())
    else:
        return None, f"{shown} is not a number"
    if not math.isfinite(v) or v < 0:
        return None, f"{shown} is not a price"
    return v, None


def _read_reported_rate(data: Any) -> Any:
    """Validator body: ``usd_per_hour`` read with :func:`read_rate`; what cannot be read moves to
    ``rate_unreadable`` (why) and the rate becomes unknown (None)."""
    if isinstance(data, dict) and data.get("usd_per_hour") is not None:
        v, why = read_rate(data["usd_per_hour"])
        data = {**data, "usd_per_hour": v}
        if why:
            data["rate_unreadable"] = data.get("rate_unreadable") or why
    return data


class InstanceInfo(_Model):
    """What :meth:`Provider.describe_instance` returns.  ``state == "terminated"`` also when the provider no
    longer knows the id (gone).  ``usd_per_hour``: the rate the provider reports (None: none reported);
    ``rate_unreadable``: why the rate it reported could not be read (then ``usd_per_hour`` is None: unknown)."""

    provider_id: str
    state: InstanceState
    raw_state: str | None = None
    public_ip: str | None = None
    private_ip: str | None = None
    ssh_host: str | None = None
    ssh_port: int = 22
    ssh_user: str = "root"
    message: str | None = None
    usd_per_hour: float | None = None
    rate_unreadable: str | None = None

    _rate = model_validator(mode="before")(_read_reported_rate)


class TaggedResource(_Model):
    """A provider-side object carrying broker's run tag (input to reconcile)."""

    provider: str
    kind: str
    provider_id: str
    run_id: str | None
    region: str | None = None
    state: str | None = None
    created_at: datetime | None = None
    usd_per_hour: float | None = None
    name: str | None = None
    installation_id: str | None = None  # INSTALL_TAG's value; None when the resource carries none (older broker)
    client_token: str | None = None  # NodeRequest.client_token (ledger row id) when the tag / label carries it
    rate_unreadable: str | None = None  # as :class:`InstanceInfo`'s

    _rate = model_validator(mode="before")(_read_reported_rate)


class QuotaRequest(_Model):
    """A quota / limit increase request, filed or drafted.

    ``state`` is the provider's word: OCI ACCEPTED / IN_PROGRESS / SUCCEEDED / PARTIALLY_SUCCEEDED / CANCELED /
    FAILED; AWS PENDING / CASE_OPENED / APPROVED / DENIED / CASE_CLOSED / NOT_APPROVED / INVALID_REQUEST; ``DRAFT``
    for a request printed but not filed.  ``form`` holds the filled-in console form fields for ``--draft``.
    """

    provider: str
    limit_name: str  # OCI limit name / AWS quota code
    region: str | None = None
    scope: str | None = None  # OCI availability domain for AD-scoped limits
    value: float  # the requested new limit, in ``unit``
    unit: str
    request_id: str | None = None
    state: str = "DRAFT"
    reason: str = ""
    message: str = ""
    form: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None
