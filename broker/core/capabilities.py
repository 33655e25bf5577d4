"""What a provider can do, declared once per provider as data: grouped capabilities and, where a feature is absent,
the reason a user reads when broker refuses it (after SkyPilot's unsupported-feature map).

One :class:`Declaration` per provider lives in ``providers/declared.py`` (stdlib only, no adapter, no SDK): the
registry (:mod:`broker.providers`) derives every provider list the core needs from it without importing an adapter,
and the adapter class reads the same object (``caps = VAST``, imported from there): :class:`broker.core.provider.Provider`
turns it into the flat class attributes the core reads (``cls.rents``, ``cls.ssh_ready_timeout_s``...), so a
capability is written in one place.  Stdlib only and cheap to import: ``broker --help`` and ``broker plan`` load it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping


class _Frozen:
    """A small frozen value object, as ``@dataclass(frozen=True)`` makes one but without its class-creation cost
    (this module is imported by ``broker --help``; nine dataclasses cost it several milliseconds): the annotated
    class attributes are the fields (in order) and their values the defaults; built by keyword only; equality by
    value; setting an attribute afterwards raises AttributeError."""

    FIELDS: ClassVar[tuple[str, ...]] = ()
    _DEFAULTS: ClassVar[dict[str, Any]] = {}
    _KNOWN: ClassVar[frozenset[str]] = frozenset()
    _REQUIRED: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.FIELDS = tuple(n for n in cls.__dict__.get("__annotations__", {}) if not n.isupper() and n[0] != "_")
        cls._DEFAULTS = {n: getattr(cls, n) for n in cls.FIELDS if hasattr(cls, n)}
        cls._KNOWN = frozenset(cls.FIELDS)
        cls._REQUIRED = cls._KNOWN - cls._DEFAULTS.keys()

    def __init__(self, **values: Any):
        cls = type(self)
        if not (values.keys() <= cls._KNOWN and values.keys() >= cls._REQUIRED):
            raise TypeError(f"{cls.__name__}(): unknown field(s) {sorted(values.keys() - cls._KNOWN)}, missing "
                            f"{sorted(cls._REQUIRED - values.keys())} (fields: {', '.join(cls.FIELDS)})")
        self.__dict__.update(cls._DEFAULTS, **values)  # not through __setattr__, which refuses

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in self.FIELDS)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.FIELDS)})"


class Renting(_Frozen):
    """What kind of machines a provider gives and what broker may do with them."""

    #: It creates machines billed by the hour (ledger-first provisioning, the confirmation prompt, the watchdog's
    #: and reconcile's scans of configured providers).
    rents: bool = False
    #: An emulation (the file-backed ``fake`` cloud): it behaves like a cloud but no money or real machine is
    #: involved; never planned over or scanned unless named, and ``broker cost`` shows its money apart.
    pretend: bool = False
    #: Asked by ``broker plan`` / ``broker check`` / ``broker run`` when no ``--provider`` narrows them.
    planned_by_default: bool = False
    #: Its "instances" are this machine: clusters run their nodes as local processes (``Cluster.local_exec``).
    local_exec: bool = False
    #: It can stop an instance keeping its disk and start it again (``broker stop`` / ``broker start``): the
    #: adapter implements ``stop``, ``start`` and ``stopped_rate``, and ``describe_instance`` reports ``stopped``.
    stoppable: bool = False
    #: Its machines can be the nodes of a Slurm cluster broker builds (``broker slurm up --provider <name>``: root,
    #: systemd-free daemons, one private network between the nodes).
    slurm_nodes: bool = False


class Access(_Frozen):
    """What the user configures for this provider (shown, never read here)."""

    #: What the user sets for live prices, quotas and capacity (``"VAST_API_KEY"``); None = nothing to configure.
    credentials_hint: str | None = None
    #: Environment variables whose value names a file (or folder) of this provider's credentials or credential
    #: config (``GOOGLE_APPLICATION_CREDENTIALS``): what they name is never staged to a node
    #: (:func:`broker.run.staging.stage_plan`).
    credential_files: tuple[str, ...] = ()
    #: The environment variables this provider's adapter reads (its settings: the typed ones are fields of
    #: :class:`broker.core.config.EnvSettings`), listed beside what it can do.
    env_vars: tuple[str, ...] = ()


class Timing(_Frozen):
    """Seconds broker assumes or waits for this provider (broker's assumptions, not vendor figures)."""

    #: Billed seconds before the job starts (boot, image pull) and during teardown, added to every hard deadline
    #: and worst case (:func:`broker.plan.pricing.setup_allowance_seconds`).
    setup_allowance_s: int = 600
    #: Seconds the SSH executor retries connect + auth after the provider reports an instance running.
    ssh_ready_timeout_s: float = 120.0
    #: Seconds after a create call before a list that does not show the object proves it absent (list lag).
    create_settle_s: float = 20.0
    #: Seconds between the describes of a run's instances while its job runs (:func:`broker.run.guard.watch_nodes`:
    #: a node the provider stopped, lost or took back ends the job); each describe is an API call.
    node_check_s: float = 30.0


class Quotas(_Frozen):
    """Service limits broker can read and raise (``broker quota check|request``, plan rejections)."""

    #: It has such limits.
    quota: bool = False
    #: What its GPU limits count: ``"gpus"`` or ``"vcpus"`` (None without :attr:`quota`).
    quota_unit: str | None = None
    #: Where its GPU limits are counted: ``"AD"`` (per availability domain / zone) or ``"region"`` (None without
    #: :attr:`quota`).
    quota_scope: str | None = None


class Deadman(_Frozen):
    """The node-side dead-man switch (a teardown layer that holds when broker and its watchdog are gone)."""

    #: The switch its boot mechanism arms on a node with a deadline, in words, ``{grace}`` standing for when it
    #: fires (shown as "... at deadline + 300 s grace" by ``broker status``:
    #: :func:`broker.money.accounting.node_layer`); None = no node-side teardown layer.
    node_switch: str | None = None
    #: The resource attribute the node switch needs to be armed (``"instance_principal"``: the row's
    #: ``attrs[...]``, else the setting ``<name>_<requirement>``); None = always armed when :attr:`node_switch` is set.
    node_switch_requires: str | None = None


class Prices(_Frozen):
    """Where prices come from: the shipped snapshot and the live sources of ``broker catalog refresh``."""

    #: File name of its shipped price snapshot in ``providers/snapshots/`` (``"vast.csv"``); None = no snapshot.
    snapshot: str | None = None
    #: ``offers()`` takes the provider's native query string (``broker plan --vast-query``).
    native_query: bool = False
    #: The adapter has ``live_offers(req)``: a live market search (``broker catalog refresh``, no snapshot fallback).
    live_offer_search: bool = False
    #: Where ``broker catalog refresh`` reads list prices: ``"api"`` (the adapter's ``live_prices(types)``, with
    #: credentials), ``"public"`` (the class's ``public_price_offers()``, no credentials), None.
    live_price_list: str | None = None
    #: Where ``live_prices()`` reads, in words (the source line of a refreshed snapshot; with ``live_price_list``
    #: ``"api"``).
    live_prices_source: str = "list prices from the provider's Pricing API (live_prices)"


class Preemption(_Frozen):
    """Interruptible capacity (Vast.ai bids, EC2 spot, OCI / GCP preemptible VMs): cheaper, may be taken back."""

    #: It rents such capacity when a NodeRequest asks for it, and its ``preemption()`` tells a preemption from a crash.
    interruptible: bool = False
    #: Its interruptible price is a market price (Vast ``min_bid``, EC2 spot price): broker bids / caps a margin
    #: over it (:data:`broker.plan.interruptible.BID_MARGIN`); False = a fixed price (OCI preemptible: 50 %).
    interruptible_bid: bool = False
    #: Preemptions per unit-hour the expected cost of its interruptible capacity assumes (broker's assumption, see
    #: :mod:`broker.plan.interruptible`; 0.0 where it has none).
    preemptions_per_hour: float = 0.0


class Hybrid(_Frozen):
    """Hosting the rented side of a ``hybrid`` run (its topologies name ``hybrid``)."""

    #: The shape of the ingress rules its network takes for a hybrid run's WireGuard port
    #: (:func:`broker.run.wireguard.security_rules`): ``"IpPermissions"`` (EC2 security groups) or
    #: ``"IngressSecurityRule"`` (OCI security lists); None = no such rules.
    ingress_rule_format: str | None = None


#: the groups of a :class:`Declaration`: attribute name -> class
GROUPS: Mapping[str, type] = MappingProxyType({
    "renting": Renting, "access": Access, "timing": Timing, "quotas": Quotas, "deadman": Deadman, "prices": Prices,
    "preemption": Preemption, "hybrid": Hybrid})

#: Every capability by its flat name (the class attribute the core reads on an adapter), in declaration order:
#: ``topologies`` then each group's fields.  A name belongs to one group only (checked below).
CAPABILITIES: tuple[str, ...] = ("topologies",) + tuple(f for g in GROUPS.values() for f in g.FIELDS)
if len(set(CAPABILITIES)) != len(CAPABILITIES):  # pragma: no cover - a schema edit that names a capability twice
    raise TypeError(f"a capability is named in two groups: {CAPABILITIES}")

#: The features a provider may lack, each with how its declaration says it has it; a missing one's reason (in
#: :attr:`Declaration.unsupported`) is what the refusal shows.
FEATURES: Mapping[str, Callable[["Declaration"], bool]] = MappingProxyType({
    "multi-node": lambda d: "multi-node" in d.topologies,
    "hybrid": lambda d: "hybrid" in d.topologies,
    "stop": lambda d: d.renting.stoppable,
    "slurm-nodes": lambda d: d.renting.slurm_nodes,
    "quota": lambda d: d.quotas.quota,
    "interruptible": lambda d: d.preemption.interruptible,
    "node-switch": lambda d: d.deadman.node_switch is not None,
    "live-prices": lambda d: d.prices.live_offer_search or d.prices.live_price_list is not None,
})
#: the feature's name in a refusal ("stop/start: <reason>")
FEATURE_WORDS: Mapping[str, str] = MappingProxyType({
    "multi-node": "multi-node", "hybrid": "hybrid", "stop": "stop/start", "slurm-nodes": "slurm up",
    "quota": "quota check/request", "interruptible": "interruptible capacity",
    "node-switch": "node-side dead-man switch", "live-prices": "live prices"})


class Declaration(_Frozen):
    """Everything the core knows about one provider without importing its adapter.

    ``name``: the registry name; ``adapter``: ``"module:Class"`` of its :class:`broker.core.provider.Provider`
    subclass; ``topologies``: what the planner may offer (``simulated``, ``multi-node``, ``local``, ``slurm``,
    ``hybrid``: it can host the rented side of a hybrid run); the groups (defaults: what a provider without the
    feature does); ``unsupported``: feature (:data:`FEATURES`) -> why this provider lacks it, in words a user can
    act on.  Raises TypeError at construction for a reason given for an unknown or a supported feature."""

    name: str
    adapter: str
    topologies: tuple[str, ...] = ("simulated",)
    renting: Renting = Renting()
    access: Access = Access()
    timing: Timing = Timing()
    quotas: Quotas = Quotas()
    deadman: Deadman = Deadman()
    prices: Prices = Prices()
    preemption: Preemption = Preemption()
    hybrid: Hybrid = Hybrid()
    unsupported: Mapping[str, str] = MappingProxyType({})

    def __init__(self, **values: Any):
        super().__init__(**values)
        object.__setattr__(self, "unsupported", MappingProxyType(dict(self.unsupported)))
        unknown = sorted(set(self.unsupported) - set(FEATURES))
        if unknown:
            raise TypeError(f"provider {self.name!r}: reasons for unknown features {unknown} "
                            f"(known: {', '.join(FEATURES)})")
        has = sorted(f for f in self.unsupported if FEATURES[f](self))
        if has:
            raise TypeError(f"provider {self.name!r} declares {has} and a reason it lacks them: drop the reason")

    def flat(self) -> dict[str, Any]:
        """``{capability: value}`` for every name of :data:`CAPABILITIES` (the adapter's class attributes)."""
        out: dict[str, Any] = {"topologies": self.topologies}
        for g in GROUPS:
            group = getattr(self, g)
            out.update((f, getattr(group, f)) for f in group.FIELDS)
        return out

    def supports(self, feature: str) -> bool:
        """Whether it has ``feature`` (a name of :data:`FEATURES`; KeyError for another)."""
        return FEATURES[feature](self)

    def why_not(self, feature: str) -> str | None:
        """None when it has ``feature``; else the declared reason, or a plain "<name> has no <feature>" where none
        is declared.  KeyError for a feature not in :data:`FEATURES`."""
        if self.supports(feature):
            return None
        return self.unsupported.get(feature) or f"{self.name} has no {FEATURE_WORDS[feature]}"

    def refusal(self, feature: str) -> str | None:
        """:meth:`why_not` as a refusal names it: ``"stop/start: <reason>"``; None when it has ``feature``."""
        why = self.why_not(feature)
        return None if why is None else f"{FEATURE_WORDS[feature]}: {why}"


#: what a provider that declares nothing has (the base :class:`broker.core.provider.Provider`, a test double)
DEFAULT = Declaration(name="?", adapter="")
