"""The contract every provider adapter implements, and the errors the core reacts to.

Adapters (``providers/<name>.py``) translate their SDK's or API's failures into these errors once, at the edge;
nothing above them parses provider messages.  Adapters import their SDK lazily (inside methods), never at module
level, so ``broker --help`` and ``broker plan`` stay fast and work without the SDK installed.

Verbs (after SkyPilot's ``sky/provision``):

* read side: :meth:`Provider.check`, :meth:`Provider.offers`, :meth:`Provider.quotas`, :meth:`Provider.capacity`
* lifecycle: :meth:`Provider.bootstrap` (network / security prerequisites), :meth:`Provider.create_instance`,
  :meth:`Provider.describe_instance`, :meth:`Provider.terminate` (idempotent, any resource kind),
  :meth:`Provider.list_tagged` (what the provider holds with broker's run tag: reconcile input).

Ledger-first: the orchestrator records an ``intent`` before calling ``create_instance``; adapters that create
several objects (``bootstrap``) call the :class:`Recorder` they are given *before* each create and right after.
"""

from __future__ import annotations

from abc import ABC
from datetime import datetime
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, Field

from broker.model import Capacity, Offer, Quota, Requirements

#: Tag / label key carrying the run id on every created resource (AWS/OCI tag; Vast label prefix).
RUN_TAG = "broker-run"
#: Tag / label key carrying the installation id (one per BROKER_HOME ledger, :attr:`broker.ledger.Ledger.installation_id`):
#: orphan handling only terminates resources of its own installation.
INSTALL_TAG = "broker-install"


# --------------------------------------------------------------------------------------------------- errors
class BrokerError(Exception):
    """Base of broker's errors; ``exit_code`` follows DESIGN.md (2 bad input, 3 no plan, 4 provider error)."""

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # message + what to do
        return f"{self.message}" + (f"\n  -> {self.hint}" if self.hint else "")


class BadInput(BrokerError):
    """The user's recipe, flags or files are wrong (exit 2)."""

    exit_code = 2


class NoValidPlan(BrokerError):
    """No option fits budget, quota and capacity (exit 3)."""

    exit_code = 3


class ProviderError(BrokerError):
    """A provider call failed (exit 4).  ``provider`` and ``call`` name what failed."""

    exit_code = 4

    def __init__(self, provider: str, call: str, message: str, *, hint: str | None = None,
                 code: str | None = None, status: int | None = None):
        super().__init__(f"{provider}: {call} failed: {message}", hint=hint)
        self.provider = provider
        self.call = call
        self.code = code
        self.status = status


class CapacityError(ProviderError):
    """Out of host capacity / insufficient capacity: fail over to the next zone or offer."""


class QuotaError(ProviderError):
    """A service limit / quota blocks the create: skip this provider or region; suggest a quota request."""


class OfferGone(ProviderError):
    """The Vast.ai offer was rented by someone else (or vanished) between search and create."""


class AuthError(ProviderError):
    """Credentials missing or rejected: the provider is unusable until configured (hint says how)."""


class TransientError(ProviderError):
    """Throttling (429), 5xx or a network blip: retry with backoff."""


class AmbiguousCreate(TransientError):
    """a create that may or may not have happened (5xx / timeout): verify by listing before retrying"""


class NotSupported(ProviderError):
    """The adapter does not implement this verb."""


# --------------------------------------------------------------------------------------------------- values
class ProviderCheck(BaseModel):
    """Result of :meth:`Provider.check`: are credentials present and usable."""

    provider: str
    configured: bool  # credentials present
    usable: bool | None = None  # a cheap authenticated call succeeded (None = not tried: offline)
    detail: str = ""
    hint: str | None = None


class NodeRequest(BaseModel):
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


InstanceState = Literal["pending", "running", "stopped", "terminating", "terminated", "failed", "unknown"]


class InstanceInfo(BaseModel):
    """What :meth:`Provider.describe_instance` returns.  ``state == "terminated"`` also when the provider no
    longer knows the id (gone)."""

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


class TaggedResource(BaseModel):
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


class QuotaRequest(BaseModel):
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


class Recorder(Protocol):
    """Ledger hooks handed to adapters that create several objects (bootstrap)."""

    def intent(self, kind: str, name: str, *, region: str | None = None, zone: str | None = None,
               usd_per_hour: float = 0.0, attrs: dict[str, Any] | None = None) -> str:
        """Record that ``kind``/``name`` is about to be created; returns the ledger resource id."""

    def created(self, resource_id: str, provider_id: str, **attrs: Any) -> None:
        """Record the provider's id right after the create call returned."""

    def failed(self, resource_id: str, error: str) -> None:
        """The create failed and nothing exists."""

    def event(self, message: str) -> None:
        """A progress line (also goes to the ledger's event log)."""

    @property
    def installation_id(self) -> str | None:
        """This installation's id, to tag (INSTALL_TAG) on every object bootstrap creates."""


# --------------------------------------------------------------------------------------------------- contract
class Provider(ABC):
    """Base class of every adapter.  Read-side verbs default to "nothing"; lifecycle verbs raise NotSupported.

    Subclasses set ``name`` and override what they support.  Constructors must not do I/O or import SDKs.
    """

    name: ClassVar[str] = "?"
    #: Topologies this provider can offer.
    topologies: ClassVar[tuple[str, ...]] = ("simulated",)
    #: Folder on the nodes for run files (work dirs, logs, probes); None = ``~/broker`` of the SSH user.
    node_workroot: ClassVar[str | None] = None

    # ---- read side
    def check(self) -> ProviderCheck:
        """Whether credentials are present (no network) and, when ``online`` work is allowed, usable."""
        return ProviderCheck(provider=self.name, configured=False, detail="not implemented")

    def offers(self, req: Requirements) -> list[Offer]:
        """Offers that may serve ``req`` (live when configured, else from the shipped snapshot).

        Raises: AuthError, TransientError, ProviderError.
        """
        return []

    def quotas(self, req: Requirements, offers: list[Offer]) -> list[Quota]:
        """Service limits relevant to ``offers`` (empty when unknown or not applicable)."""
        return []

    def capacity(self, offers: list[Offer]) -> list[Capacity]:
        """Capacity facts for ``offers`` (empty when unknown)."""
        return []

    def price_note(self) -> str | None:
        """One line on where prices come from, e.g. "prices: snapshot 2026-11-29; live quote needs VAST_API_KEY"."""
        return None

    # ---- lifecycle
    def bootstrap(self, run_id: str, offers: list[Offer], topology: str, rec: Recorder) -> dict[str, Any]:
        """Create (or reuse) network/security prerequisites for ``offers``; returns ids for NodeRequest.network."""
        return {}

    def create_instance(self, req: NodeRequest) -> str:
        """Create one node; returns the provider id.  Raises CapacityError, QuotaError, OfferGone, AuthError..."""
        raise NotSupported(self.name, "create_instance", "this provider cannot create instances")

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        """Current state and addresses of one instance (``terminated`` when gone)."""
        raise NotSupported(self.name, "describe_instance", "not supported")

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Terminate / delete one resource; idempotent.  Returns True when it is confirmed gone (or never
        existed), False when termination was requested but is still in progress."""
        raise NotSupported(self.name, "terminate", "not supported")

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Resources the provider holds that carry broker's run tag (all runs when ``run_id`` is None)."""
        return []

    # ---- quota requests
    def request_quota(self, quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
        """File (or with ``draft`` only fill in) an increase of ``quota`` to ``value`` (in ``quota.unit``).

        An already-open request for the same limit is returned (state as the provider reports it), not
        duplicated.  Raises AuthError, ProviderError.
        """
        raise NotSupported(self.name, "request_quota", "this provider has no quota requests")

    def quota_request_status(self, request: QuotaRequest) -> QuotaRequest:
        """The request refreshed from the provider."""
        raise NotSupported(self.name, "quota_request_status", "this provider has no quota requests")
