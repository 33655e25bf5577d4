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

Importing this module imports no pydantic (``broker plan`` loads every adapter): the lifecycle records
(:class:`~broker.core.records.NodeRequest`, ``Ingress``, ``InstanceInfo``, ``TaggedResource``, ``QuotaRequest``) live in
:mod:`broker.core.records` (which imports this module, never the other way); adapters import them from there under
``TYPE_CHECKING`` and inside the verbs that build them.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Protocol

from broker.core.model import Capacity, Offer, Quota, Requirements

if TYPE_CHECKING:
    from datetime import datetime
    from pathlib import Path

    from broker.core.recipe import Recipe
    from broker.core.target import RunRequest, Target
    from broker.core.records import Ingress, InstanceInfo, NodeRequest, QuotaRequest, TaggedResource

#: Tag / label key carrying the run id on every created resource (AWS/OCI tag; Vast label prefix).
RUN_TAG = "broker-run"
#: the default provider id form (:meth:`Provider.valid_id`): letters, digits and ``. _ : @ -``, at most 255
#: characters, starting with a letter or digit; ``..`` refused besides (no path, no URL part, no shell word)
_SAFE_ID = r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,254}"

#: Tag / label key carrying the installation id (one per BROKER_HOME ledger, :attr:`broker.money.ledger.Ledger.installation_id`):
#: orphan handling only terminates resources of its own installation.
INSTALL_TAG = "broker-install"


# --------------------------------------------------------------------------------------------------- errors
# The error classes live in broker.core.errors (free of pydantic, cheap to import); re-exported here.
from broker.core.errors import (  # noqa: E402,F401
    AmbiguousCreate,
    AuthError,
    BadInput,
    BrokerError,
    CapacityError,
    NoValidPlan,
    NotSupported,
    OfferGone,
    ProviderError,
    QuotaError,
    TransientError,
)


# --------------------------------------------------------------------------------------------------- values
@dataclass(kw_only=True)
class ProviderCheck:
    """Result of :meth:`Provider.check`: are credentials present and usable.  A dataclass (not a pydantic record):
    ``broker plan`` asks it of the chosen option's provider."""

    provider: str
    configured: bool  # credentials present
    usable: bool | None = None  # a cheap authenticated call succeeded (None = not tried: offline)
    detail: str = ""
    hint: str | None = None


def extra_install_hint(extra: str, packages: str = "") -> str:
    """The command that installs broker's optional ``extra`` (an adapter's SDK), worded for how broker itself was
    installed (:func:`broker.core.install.install_hint`): part of the contract, so adapters reach it here."""
    from broker.core.install import install_hint

    return install_hint(extra, packages)


def not_configured_error(chk: ProviderCheck, consequence: str) -> AuthError:
    """The error (exit 4) for a provider that ``chk`` (its :meth:`Provider.check`, the one ``broker check`` prints)
    found not configured: the real cause (client library missing, credentials missing, project missing: the
    check's ``detail``), ``consequence`` (what cannot happen, e.g. "nothing can be rented") and, as the hint, the
    check's whole fix (install, then credentials).  Returns the AuthError; raises nothing."""
    cause = chk.detail or "no credentials"
    return AuthError(chk.provider, "credentials check", f"{chk.provider} is not configured ({cause}): {consequence}",
                     hint=chk.hint or "see .env.example")


InstanceState = Literal["pending", "running", "stopped", "terminating", "terminated", "failed", "unknown"]

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
#: The capability attributes of :class:`Provider` (flat names, documented on their groups in
#: :mod:`broker.core.capabilities`), in declaration order.
from broker.core.capabilities import CAPABILITIES, DEFAULT, Declaration  # noqa: E402


class Provider(ABC):
    """Base class of every adapter.  Read-side verbs default to "nothing"; lifecycle verbs raise NotSupported.

    Subclasses set ``name`` and override what they support.  Constructors must not do I/O or import SDKs.
    """

    name: ClassVar[str] = "?"
    #: Folder on the nodes for run files (work dirs, logs, probes); None = ``~/broker`` of the SSH user.
    node_workroot: ClassVar[str | None] = None
    #: True when every object the adapter creates carries RUN_TAG and INSTALL_TAG provider-side and
    #: :meth:`tagged_resource` reads them back: ``down``, ``reconcile`` and the watchdog then terminate only what
    #: the provider shows with this installation's and run's tags (a ledger row is data, not a command)
    owner_tags: ClassVar[bool] = False
    #: Where an adapter says what a long wait is doing (a create whose operation has not finished, say): the core
    #: sets it to the run's progress line before it creates; None (the default) = nobody listening
    progress: Callable[[str], None] | None = None

    # ---- ids
    @classmethod
    def valid_id(cls, kind: str, provider_id: str) -> bool:
        """Whether ``provider_id`` has the form of an id this provider gives a ``kind`` resource.  Checked before
        an id from the ledger or from an answer names anything (a URL, a path, a shell word).  Default: letters,
        digits and ``. _ : @ -`` (no ``/``, no ``..``, no spaces); adapters narrow it (Vast: digits)."""
        import re

        return (isinstance(provider_id, str) and re.fullmatch(_SAFE_ID, provider_id) is not None
                and ".." not in provider_id)

    @classmethod
    def id_form(cls, kind: str) -> str:
        """Words for the form :meth:`valid_id` accepts (for error messages)."""
        return "letters, digits and . _ : @ - only"

    # ---- regions
    #: the form of this provider's region names (a full-match regular expression), words for it (error messages)
    #: and one example; adapters narrow the default (lowercase letters, digits and ``-``: never a dot, a slash or
    #: ``@``) to their own form, as data: :meth:`valid_region`, :meth:`region_form` and :meth:`region_example`
    #: read these
    region_pattern: ClassVar[str] = r"[a-z0-9]+(?:-[a-z0-9]+)*"
    region_words: ClassVar[str] = "lowercase letters, digits and -"
    region_sample: ClassVar[str] = "us-east-1"

    @classmethod
    def valid_region(cls, region: str) -> bool:
        """Whether ``region`` has the form of this provider's region names (:attr:`region_pattern`).  A region
        setting may come from a folder's ``.env`` and SDKs build endpoint host names from it, so it is checked
        (:func:`broker.core.config.check_region`)."""
        import re

        return isinstance(region, str) and re.fullmatch(cls.region_pattern, region) is not None

    @classmethod
    def region_form(cls) -> str:
        """Words for the form :meth:`valid_region` accepts (for error messages): :attr:`region_words`."""
        return cls.region_words

    @classmethod
    def region_example(cls) -> str:
        """A region name of the form :meth:`valid_region` accepts (for error messages): :attr:`region_sample`."""
        return cls.region_sample

    @classmethod
    def require_id(cls, kind: str, provider_id: str, call: str) -> str:
        """``provider_id`` when :meth:`valid_id`; else raises ProviderError naming the id, its expected form and
        the fix (a ledger row or an answer is input: a bad id is never sent anywhere)."""
        if not cls.valid_id(kind, provider_id):
            raise ProviderError(cls.name, call, f"{provider_id!r} is not a {cls.name} {kind} id "
                                f"({cls.id_form(kind)}): refused, nothing was sent",
                                hint="the ledger row (or the provider's answer) is damaged or was edited; check "
                                     "`broker status` and the provider's console")
        return provider_id

    # ---- capabilities: what the core asks of a provider instead of testing its name.  Declared once per provider
    # as data (``caps``: a :class:`~broker.core.capabilities.Declaration` from ``providers/declared.py``, which the
    # registry reads too, without importing the adapter); :meth:`__init_subclass__` sets the flat attributes below
    # from it, so an adapter's class body never writes one (tests/providers/test_provider_capabilities.py).
    #: What this provider can do, grouped, and why a feature is absent (the defaults: what a provider without the
    #: feature does).
    caps: ClassVar[Declaration] = DEFAULT
    topologies: ClassVar[tuple[str, ...]]
    rents: ClassVar[bool]
    pretend: ClassVar[bool]
    planned_by_default: ClassVar[bool]
    local_exec: ClassVar[bool]
    stoppable: ClassVar[bool]
    slurm_nodes: ClassVar[bool]
    credentials_hint: ClassVar[str | None]
    credential_files: ClassVar[tuple[str, ...]]
    env_vars: ClassVar[tuple[str, ...]]
    setup_allowance_s: ClassVar[int]
    ssh_ready_timeout_s: ClassVar[float]
    create_settle_s: ClassVar[float]
    node_check_s: ClassVar[float]
    quota: ClassVar[bool]
    quota_unit: ClassVar[str | None]
    quota_scope: ClassVar[str | None]
    node_switch: ClassVar[str | None]
    node_switch_requires: ClassVar[str | None]
    snapshot: ClassVar[str | None]
    native_query: ClassVar[bool]
    live_offer_search: ClassVar[bool]
    live_price_list: ClassVar[str | None]
    live_prices_source: ClassVar[str]
    interruptible: ClassVar[bool]
    interruptible_bid: ClassVar[bool]
    preemptions_per_hour: ClassVar[float]
    ingress_rule_format: ClassVar[str | None]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that sets ``caps`` in its body gets every flat capability from it (a subclass that does not
        keeps its parent's; a test double may still set one attribute over them)."""
        super().__init_subclass__(**kwargs)
        if "caps" in cls.__dict__:
            cls._set_capabilities(cls.__dict__["caps"])

    @classmethod
    def _set_capabilities(cls, caps: Declaration) -> None:
        for attr, value in caps.flat().items():
            setattr(cls, attr, value)

    @classmethod
    def snapshot_rows(cls, reference_dir: "Path") -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The shipped price snapshot (:attr:`snapshot`) built from the reference files in ``reference_dir``
        (``docs/reference/prices``): (rows in :data:`broker.plan.catalog.COLUMNS`, ``{"source", "label", "notes"}``
        its header states: where the figures come from and every assumption).  Run by ``python -m
        broker.plan.catalog build``; raises OSError / KeyError for a missing file or column.  Default: raises
        NotSupported (a provider without a snapshot)."""
        raise NotSupported(cls.name, "snapshot_rows", "this provider ships no price snapshot")

    @classmethod
    def pretend_active(cls) -> bool:
        """For a :attr:`pretend` provider: whether its emulation is in use on this machine (the fake cloud: its
        state file is named by ``BROKER_FAKE_STATE``), so that reconcile scans it without being named.  No I/O
        beyond the environment.  Default: False."""
        return False

    @classmethod
    def query_snapshot(cls, offers: list["Offer"], query: str) -> list["Offer"]:
        """``offers`` from the shipped snapshot narrowed by the provider's own query language (``native_query``
        providers: ``--vast-query``) without asking the provider; raises BadInput for a query it cannot parse or
        a field the snapshot cannot check (a query is honoured or refused, never ignored).  Default: the query is
        refused, since only ``native_query`` providers have one."""
        raise BadInput(f"{cls.name} has no query language of its own: drop the query")

    # ---- the run
    #: the ``broker run`` flags of this provider (flag -> what it gives, in words): they reach :meth:`run_target`
    #: in ``request.options``; any other provider refuses them, naming this one (:meth:`misplaced_option`)
    run_options: ClassVar[dict[str, str]] = {}

    @classmethod
    def run_target(cls, recipe: "Recipe", request: "RunRequest", *,
                   say: "Callable[[str], None] | None" = None) -> "Target | None":
        """The pipeline target (:class:`broker.core.target.Target`: acquire, executor, release) for a run on this
        provider, built from the recipe and the run request (its ``options``: this provider's flags, checked
        here); ``say`` takes one-line notes for the user.  None = the pipeline's default for rented machines (the
        plan over this provider, ledger-first provisioning with failover: ``CloudTarget``).  Raises BadInput for
        an option value or a topology the provider cannot use.  Default: None (a rented cloud)."""
        return None

    @classmethod
    def misplaced_option(cls, recipe: "Recipe", request: "RunRequest", flag: str) -> "BadInput":
        """The error for ``flag`` (one of this provider's :attr:`run_options`) given to a run on another
        provider: says which provider takes it and the command that would.  Default: the flag and
        ``--provider <name>``."""
        return BadInput(f"{flag} works with --provider {cls.name} only ({cls.run_options.get(flag, flag)})",
                        hint=f"add --provider {cls.name}, or drop {flag}")

    @classmethod
    def standing_cluster(cls, run: Any) -> Any:
        """The :class:`~broker.core.records.Cluster` of a run that stood nodes up without a job (``broker netns
        up``), read from the run's folder, for ``broker ssh`` / ``broker exec`` / ``--cluster``; None when the run
        holds none.  Default: None."""
        return None

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

    def why_not(self, req: Requirements) -> str | None:
        """Why this provider's own machine cannot serve ``req`` (the ``local`` provider: too few GPUs, too little
        GPU memory, no GPU without ``cpu_ok``), in plain words; None when it can, or when the provider's offers
        say it all (every rented provider: the default).  No network; never raises for a request it cannot serve."""
        return None

    def live_offers(self, req: Requirements) -> list[Offer]:
        """A live market search for ``req`` (:attr:`live_offer_search` providers, ``broker catalog refresh``): the
        offers listed now, never the snapshot.  Raises AuthError, TransientError, ProviderError; default:
        NotSupported."""
        raise NotSupported(self.name, "live_offers", "this provider has no live market search")

    def live_prices(self, instance_types: list[str]) -> dict[str, float]:
        """List prices in $/hour of ``instance_types`` read from the provider's pricing API with credentials
        (:attr:`live_price_list` ``"api"``; source in words: :attr:`live_prices_source`); a type it does not
        price is absent.  Raises AuthError, TransientError, ProviderError; default: NotSupported."""
        raise NotSupported(self.name, "live_prices", "this provider has no pricing API broker reads")

    @classmethod
    def public_price_offers(cls) -> tuple[list[Offer], str]:
        """(the snapshot's offers repriced from the provider's public price list, that source in words) with no
        credentials (:attr:`live_price_list` ``"public"``).  Raises httpx errors when the list cannot be fetched,
        ValueError when it holds no price broker can use; default: NotSupported."""
        raise NotSupported(cls.name, "public_price_offers", "this provider has no public price list")

    def price_note(self) -> str | None:
        """One line on where prices come from, e.g. "prices: snapshot 2026-11-29; live quote needs VAST_API_KEY"."""
        return None

    # ---- lifecycle
    def bootstrap(self, run_id: str, offers: list[Offer], topology: str, rec: Recorder) -> dict[str, Any]:
        """Create (or reuse) network/security prerequisites for ``offers``; returns ids for NodeRequest.network."""
        return {}

    def open_ingress(self, network: dict[str, Any], rules: list[Ingress], rec: Recorder) -> None:
        """Add ``rules`` to the run's network that :meth:`bootstrap` returned (``network``), inbound only, nothing
        else opened; ``rec.event`` says what was opened.  Idempotent.  Raises NotSupported where the provider's
        network has no such rules, TransientError, ProviderError."""
        raise NotSupported(self.name, "open_ingress", "this provider cannot open extra inbound ports")

    def create_instance(self, req: NodeRequest) -> str:
        """Create one node; returns the provider id.  Raises CapacityError, QuotaError, OfferGone, AuthError..."""
        raise NotSupported(self.name, "create_instance", "this provider cannot create instances")

    def prepare_access(self, provider_id: str, public_key: str) -> None:
        """Authorise ``public_key`` (OpenSSH format) on a running instance through the provider's key API, where it
        has one (Vast.ai ``POST /api/v0/instances/{id}/ssh/``); idempotent.  Default: nothing (the key arrives with
        the boot script / launch request).  Raises TransientError, ProviderError."""

    def boot_wait_command(self, ssh_user: str) -> str | None:
        """A shell line the SSH executor runs on each node once it accepts logins as ``ssh_user``, before
        preflight: it waits for this adapter's boot script (cloud-init, then the boot-done marker in the node's
        workroot) and exits 0 only when the node is booted; a non-zero exit fails the run's reach step naming the
        node.  Default: None (the executor's generic ``cloud-init status --wait``)."""
        return None

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        """Current state and addresses of one instance (``terminated`` when gone)."""
        raise NotSupported(self.name, "describe_instance", "not supported")

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Terminate / delete one resource; idempotent.  Returns True when it is confirmed gone (or never
        existed), False when termination was requested but is still in progress."""
        raise NotSupported(self.name, "terminate", "not supported")

    def preemption(self, resource_id: str) -> str | None:
        """Whether the provider took instance ``resource_id`` (its provider id) back.

        Returns the provider's own reason, in its words (``"outbid: actual_status stopped, intended running"``,
        ``"Server.SpotInstanceTermination: ..."``, ``"preempted: lifecycleState TERMINATED ..."``) when it says the
        instance was preempted / outbid / interrupted / reclaimed; None when it was not, or when the provider cannot
        tell (a crash of the job, a node broker terminated itself, a provider without interruptible capacity).
        Default: None.  Raises ProviderError (TransientError, AuthError) when the call to the provider failed:
        "could not ask" is never None.
        """
        return None

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Resources the provider holds that carry broker's run tag (all runs when ``run_id`` is None)."""
        return []

    def tagged_resource(self, kind: str, provider_id: str, *, region: str | None = None,
                        run_id: str | None = None) -> TaggedResource | None:
        """The provider's own view of one object's broker tags: the TaggedResource (run and installation as the
        provider stores them) when it holds ``provider_id`` of ``kind``, not terminated, with RUN_TAG (= ``run_id``
        when given); None when it holds no such object.  Default: looked up in :meth:`list_tagged`; adapters whose
        list is narrower than their resources (AWS: one region) read the one object.  Raises ProviderError when
        the provider cannot be read (never None for "could not tell")."""
        for t in self.list_tagged(run_id):
            if t.provider_id == provider_id and t.kind == kind:
                return t
        return None

    # ---- stop / start (``stoppable`` providers)
    def stop(self, provider_id: str, *, region: str | None = None) -> None:
        """Ask the provider to stop instance ``provider_id`` keeping its disk (a power-off, not a delete).  Returns
        once the request is accepted; :meth:`describe_instance` reports ``stopped`` when it is done (the caller
        polls it).  Idempotent: stopping a stopped instance is accepted.  Raises NotSupported (not
        :attr:`stoppable`), TransientError (retry), ProviderError (refused: the message says why)."""
        raise NotSupported(self.name, "stop", "this provider cannot stop an instance and keep its disk")

    def start(self, provider_id: str, *, region: str | None = None) -> None:
        """Ask the provider to start stopped instance ``provider_id`` again.  Returns once the request is accepted;
        :meth:`describe_instance` reports ``running`` with the (often new) addresses when it is up.  Raises
        NotSupported, CapacityError (the host / shape has no room now), TransientError, ProviderError."""
        raise NotSupported(self.name, "start", "this provider cannot start a stopped instance")

    def stopped_rate(self, provider_id: str, *, region: str | None = None,
                     attrs: dict[str, Any] | None = None) -> tuple[float, str]:
        """What instance ``provider_id`` bills while stopped: (US dollars per hour, the basis in words, e.g.
        ``"storage_cost $0.10/GB/month x 200 GB (instance row)"``), from the provider's answer where it gives one,
        else from the adapter's documented rate and the disk recorded in ``attrs`` (``disk_gib``).  Raises
        NotSupported, TransientError, ProviderError."""
        raise NotSupported(self.name, "stopped_rate", "this provider cannot stop an instance")

    def deadman_rearm_script(self, deadline: datetime, grace_seconds: float, *,
                             attrs: dict[str, Any] | None = None) -> str | None:
        """Bash that, run over SSH (the run's key, stdin) on a started instance, arms its node-side dead-man switch
        again for ``deadline`` (UTC) + ``grace_seconds`` (``broker start``: a stop ends the first boot's switch)
        with the same code its boot mechanism uses, and prints ``BROKER_DEADMAN_ARMED <fire_at>`` (Unix seconds)
        once the node confirms it (:func:`broker.core.nodescripts.armed_confirmation`); ``attrs``: the instance's
        ledger attributes.  None: the adapter cannot re-arm its switch over SSH (``broker start`` then says that
        only the watchdog guards the deadline)."""
        return None

    # ---- quota requests
    @classmethod
    def quota_limit(cls, instance_type: str, *, spot: bool = False) -> tuple[str, str, str] | None:
        """Which of the provider's limits must allow ``instance_type`` (``spot``: the spot market's): ``(limit name,
        description, service)`` such as ``("L-DB2E81BA", "Running On-Demand G and VT instances", "ec2")``, counted
        in :attr:`quota_unit` per :attr:`quota_scope`; None when no limit covers it (not a GPU type).  From the
        adapter's own table, no network, no SDK (:func:`broker.plan.quota.limit_for` reads it at plan time).
        Default: None (a provider without :attr:`quota`)."""
        return None

    @classmethod
    def quota_counts(cls, instance_type: str, *, spot: bool = False) -> tuple[str, ...]:
        """Every limit of this provider one ``instance_type`` instance counts against (``spot``: the spot
        market's), e.g. a GPU metric and the CPU metric of its machine family: a quota error naming one of them
        blocks exactly the options that count it.  From the adapter's own table, no network.  Default: the
        :meth:`quota_limit` name alone (none when the type has no limit)."""
        found = cls.quota_limit(instance_type, spot=spot)
        return (found[0],) if found else ()

    @classmethod
    def quota_account_limits(cls) -> tuple[tuple[str, str, str], ...]:
        """The provider's limits that count every GPU type at once, account- or project-wide (no region, no AD):
        ``(limit name, description, service)`` each, in :attr:`quota_unit`.  A job needs them beside the
        per-type limit of :meth:`quota_limit`.  From the adapter's own table, no network.  Default: none."""
        return ()

    def request_quota(self, quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
        """File (or with ``draft`` only fill in) an increase of ``quota`` to ``value`` (in ``quota.unit``).

        An already-open request for the same limit is returned (state as the provider reports it), not
        duplicated.  Raises AuthError, ProviderError.
        """
        raise NotSupported(self.name, "request_quota", "this provider has no quota requests")

    def quota_request_status(self, request: QuotaRequest) -> QuotaRequest:
        """The request refreshed from the provider."""
        raise NotSupported(self.name, "quota_request_status", "this provider has no quota requests")


Provider._set_capabilities(DEFAULT)
