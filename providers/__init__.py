"""Provider adapters, one module per provider, imported lazily by name; their capabilities as plain data.

``get_provider("vast")`` imports ``broker.providers.vast`` only when asked, so the CLI starts fast and a missing SDK
(``oci``, ``boto3``) only matters for the provider that needs it.

Every list of providers the core needs (the clouds, the default plan set, who has quotas, who can host a hybrid
run's rented side, who ships a price snapshot) is derived here from each provider's one
:class:`~broker.core.capabilities.Declaration` in ``providers/declared.py`` (grouped capabilities, and why a feature
is absent), never kept by hand in the core.  The adapter class reads the same object (``caps = <NAME>`` from there;
:class:`broker.core.provider.Provider` turns it into its class attributes), so these lists cost no adapter import and
a capability is written once; ``tests/providers/test_provider_capabilities.py`` holds both.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from broker.core.capabilities import CAPABILITIES, FEATURE_WORDS, Declaration  # noqa: F401 - CAPABILITIES re-exported
from broker.core.capabilities import DEFAULT as _UNDECLARED
from broker.core.errors import BadInput  # the contract re-exports it; errors alone is cheap to import
from broker.providers.declared import DECLARED

if TYPE_CHECKING:
    from broker.core.provider import Provider

#: name -> "module:Class" (adding a provider: its declaration in providers/declared.py; docs/architecture.md,
#: "Adding a provider")
REGISTRY: dict[str, str] = {name: d.adapter for name, d in DECLARED.items()}


class Capabilities:
    """The capabilities of one provider, read from its declaration (the adapter is not imported): each flat
    capability as an attribute (documented in :mod:`broker.core.capabilities`), :attr:`declaration` the grouped
    object, :meth:`why_not` / :meth:`refusal` the reason a feature is absent."""

    __slots__ = ("name", "declaration", "_values")

    def __init__(self, declaration: Declaration):
        self.name = declaration.name
        self.declaration = declaration
        self._values = declaration.flat()

    def __getattr__(self, attr: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[attr]
        except KeyError:
            raise AttributeError(f"no capability {attr!r}") from None

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def why_not(self, feature: str) -> str | None:
        """None when the provider has ``feature`` (:data:`broker.core.capabilities.FEATURES`), else why not."""
        return self.declaration.why_not(feature)

    def refusal(self, feature: str) -> str | None:
        """``"<feature>: <why not>"`` for a refusal; None when the provider has ``feature``."""
        return self.declaration.refusal(feature)

    def __repr__(self) -> str:
        return f"Capabilities({self.name!r}, {self._values!r})"


_CAPS: dict[str, Capabilities] = {name: Capabilities(d) for name, d in DECLARED.items()}
_DEFAULT_CAPS = Capabilities(_UNDECLARED)


def capabilities(name: str) -> Capabilities:
    """The capabilities of registered provider ``name``; raises BadInput for an unknown name."""
    try:
        return _CAPS[name]
    except KeyError:
        raise BadInput(f"unknown provider {name!r}", hint=f"choose one of: {', '.join(REGISTRY)}") from None


def capability(name: str, attr: str) -> Any:
    """Capability ``attr`` of ``name``; the :class:`broker.core.provider.Provider` default for a name that is not
    registered (a test double, a row of a ledger written by a newer broker)."""
    return getattr(_CAPS.get(name, _DEFAULT_CAPS), attr)


def why_not(name: str, feature: str) -> str | None:
    """Why provider ``name`` lacks ``feature`` (a name of :data:`broker.core.capabilities.FEATURES`), in words a user
    can act on; None when it has it.  An unregistered name: the defaults' plain "has no ..." reason."""
    caps = _CAPS.get(name)
    if caps is None:
        return None if _UNDECLARED.supports(feature) else f"{name} has no {FEATURE_WORDS[feature]}"
    return caps.why_not(feature)


def unsupported_reason(name: str, feature: str) -> str | None:
    """The reason provider ``name``'s declaration gives for lacking ``feature``, word for word; None when it
    declares none (it has the feature, gives no reason, or ``name`` is not registered)."""
    caps = _CAPS.get(name)
    return caps.declaration.unsupported.get(feature) if caps is not None else None


def names_where(test: Callable[[Capabilities], Any]) -> tuple[str, ...]:
    """Registered providers whose capabilities pass ``test``, in registry order."""
    return tuple(n for n, c in _CAPS.items() if test(c))


# ---- the lists the core needs, derived from the capabilities (in registry order)
#: Providers that rent machines for real money (planned over by default, scanned by the watchdog and reconcile).
CLOUD: tuple[str, ...] = names_where(lambda c: c.rents and not c.pretend)
#: Providers asked when no ``--provider`` narrows a plan.
DEFAULT: tuple[str, ...] = names_where(lambda c: c.planned_by_default)
#: Providers with readable / requestable GPU limits (``broker quota``).
QUOTA: tuple[str, ...] = names_where(lambda c: c.quota)
#: Rented providers that can host the VMs of a hybrid run (full VMs with /dev/net/tun).
HYBRID_CLOUD: tuple[str, ...] = names_where(lambda c: c.rents and not c.pretend and "hybrid" in c.topologies)
#: Providers with a shipped price snapshot.
SNAPSHOT: tuple[str, ...] = names_where(lambda c: c.snapshot is not None)
#: Providers that can stop an instance keeping its disk (``broker stop`` / ``broker start``).
STOPPABLE: tuple[str, ...] = names_where(lambda c: c.stoppable)
#: Environment variables naming credential files or folders, every provider's (never staged to a node).
CREDENTIAL_FILE_VARS: tuple[str, ...] = tuple(dict.fromkeys(v for c in _CAPS.values() for v in c.credential_files))
#: Providers whose one host is this machine, free (the ``local`` topology): shown as "this machine", never
#: reconciled or refreshed at a provider, planned from the machine's own GPUs.
THIS_MACHINE: tuple[str, ...] = names_where(lambda c: "local" in c.topologies)
#: Providers that rent nothing (this machine, its emulations, a scheduler's cluster): their name says where the nodes
#: are, so a narrow table leaves their topology out.
NOT_RENTED: tuple[str, ...] = names_where(lambda c: not c.rents)
#: Pretend (emulated) providers.
PRETEND: tuple[str, ...] = names_where(lambda c: c.pretend)
#: Providers whose machines ``broker slurm up`` builds a Slurm cluster on: the emulations first, then the clouds.
SLURM_NODES: tuple[str, ...] = tuple(sorted(names_where(lambda c: c.slurm_nodes), key=lambda n: _CAPS[n].rents))


def names() -> list[str]:
    return list(REGISTRY)


#: the entry point group through which an installed package adds a provider: ``<name> = "<module>:<Class>"`` (a
#: :class:`~broker.core.provider.Provider` subclass).  Read the first time a name is not in :data:`REGISTRY`, never
#: at start-up; such a provider is reached by name (``broker run --provider <name>``), its capabilities from its class.
PLUGIN_GROUP = "broker.providers"
_plugins: dict[str, str] | None = None


def plugins() -> dict[str, str]:
    """Providers added by installed packages (entry points of :data:`PLUGIN_GROUP`): name -> ``module:Class``.  A
    name already in :data:`REGISTRY` is not replaced."""
    global _plugins
    if _plugins is None:
        from importlib.metadata import entry_points

        _plugins = {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in REGISTRY}
    return _plugins


def known(name: str) -> bool:
    """Whether ``name`` is a provider: a registry line or a plug-in."""
    return name in REGISTRY or name in plugins()


def provider_class(name: str) -> type["Provider"]:
    """The adapter class for ``name`` (a registry line, else a plug-in); raises BadInput for an unknown name."""
    target = REGISTRY.get(name) or plugins().get(name)
    if target is None:
        raise BadInput(f"unknown provider {name!r}", hint=f"choose one of: {', '.join([*REGISTRY, *plugins()])}")
    mod_name, cls_name = target.split(":")
    mod = importlib.import_module(mod_name)
    return getattr(mod, cls_name)


def adapter_module(name: str) -> ModuleType:
    """The module of ``name``'s adapter class, imported now (for the module-level helpers of an adapter that is not
    a rented cloud: the netns emulation's ``INJECTS`` and cluster state, the Slurm adapter's shells).  The core
    reaches an adapter this way, by name, and never imports one (``tests/test_layers.py``); raises BadInput for an
    unknown name."""
    return importlib.import_module(provider_class(name).__module__)


def get_provider(name: str, **kwargs: Any) -> "Provider":
    """An adapter instance (constructors do no I/O)."""
    return provider_class(name)(**kwargs)
