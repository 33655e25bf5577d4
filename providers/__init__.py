"""Provider adapters, one module per provider, imported lazily by name; their capabilities as plain data.

``get_provider("vast")`` imports ``broker.providers.vast`` only when asked, so the CLI starts fast and a missing SDK
(``oci``, ``boto3``) only matters for the provider that needs it.

Every list of providers the core needs (the clouds, the default plan set, who has quotas, who can host a hybrid
run's rented side, who ships a price snapshot) is derived here from the capability attributes of the adapters
(:data:`broker.core.provider.CAPABILITIES`, documented on :class:`broker.core.provider.Provider`), never kept by hand in the
core.  The registry line of each provider repeats, as plain data, the capabilities in which its adapter class differs
from the :class:`~broker.core.provider.Provider` defaults, so these lists cost no adapter import;
``tests/providers/test_provider_capabilities.py`` checks that each line equals its class.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from broker.core.provider import CAPABILITIES, BadInput
from broker.core.provider import Provider as _Base

if TYPE_CHECKING:
    from broker.core.provider import Provider

#: name -> ("module:Class", the capabilities where that class differs from broker.core.provider.Provider's defaults, and
#: always its topologies).
#: Adding a provider: one line here (docs/architecture.md, "Adding a provider").
PROVIDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "local": ("broker.providers.local:LocalProvider",
              dict(topologies=("local",), planned_by_default=True, setup_allowance_s=0, local_exec=True)),
    "vast": ("broker.providers.vast:VastProvider",
             dict(topologies=("simulated",), rents=True, planned_by_default=True,
                  node_switch="self-destroy via the Vast API at {grace}", ssh_ready_timeout_s=180.0,
                  credentials_hint="VAST_API_KEY", native_query=True, live_offer_search=True, snapshot="vast.csv",
                  interruptible=True, interruptible_bid=True, preemptions_per_hour=0.1, stoppable=True)),
    "oci": ("broker.providers.oci:OCIProvider",
            dict(topologies=("simulated", "multi-node", "hybrid"), rents=True, planned_by_default=True, quota=True,
                 quota_unit="gpus", quota_scope="AD",
                 node_switch="self-terminate with an instance principal at {grace}",
                 node_switch_requires="instance_principal", setup_allowance_s=900, ssh_ready_timeout_s=600.0,
                 credentials_hint="an OCI config (OCI_CONFIG_FILE, OCI_COMPARTMENT_ID)", live_price_list="public",
                 credential_files=("OCI_CONFIG_FILE",),
                 snapshot="oci.csv", ingress_rule_format="IngressSecurityRule", interruptible=True,
                 preemptions_per_hour=0.05, stoppable=True, slurm_nodes=True)),
    "aws": ("broker.providers.aws:AWSProvider",
            dict(topologies=("simulated", "multi-node", "hybrid"), rents=True, planned_by_default=True, quota=True,
                 quota_unit="vcpus", quota_scope="region",
                 node_switch="scheduled shutdown at {grace}, InstanceInitiatedShutdownBehavior=terminate",
                 ssh_ready_timeout_s=420.0, credentials_hint="AWS credentials (AWS_PROFILE or AWS_ACCESS_KEY_ID)",
                 credential_files=("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE"),
                 live_price_list="api", snapshot="aws.csv", ingress_rule_format="IpPermissions", interruptible=True,
                 interruptible_bid=True, preemptions_per_hour=0.02, stoppable=True,
                 slurm_nodes=True)),
    "gcp": ("broker.providers.gcp:GCPProvider",
            dict(topologies=("simulated", "multi-node", "hybrid"), rents=True, planned_by_default=True, quota=True,
                 quota_unit="gpus", quota_scope="region",
                 node_switch="self-delete with the VM's service account at {grace} (else power off)",
                 setup_allowance_s=900, ssh_ready_timeout_s=600.0,
                 credentials_hint="Google ADC (gcloud auth application-default login or "
                                  "GOOGLE_APPLICATION_CREDENTIALS) and GOOGLE_CLOUD_PROJECT",
                 credential_files=("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG"),
                 live_price_list="api", snapshot="gcp.csv", interruptible=True, preemptions_per_hour=0.05,
                 slurm_nodes=True)),
    "netns": ("broker.providers.netns:NetnsProvider",
              dict(topologies=("multi-node", "hybrid"), setup_allowance_s=0, slurm_nodes=True)),
    "slurm": ("broker.providers.slurm:SlurmProvider", dict(topologies=("slurm",), setup_allowance_s=0)),
    "fake": ("broker.providers.fake:FakeProvider",
             dict(topologies=("simulated", "multi-node"), rents=True, pretend=True, setup_allowance_s=0,
                  create_settle_s=0.0, node_check_s=2.0, local_exec=True, stoppable=True,
                  interruptible=True, preemptions_per_hour=0.1)),
}

#: name -> "module:Class"
REGISTRY: dict[str, str] = {name: target for name, (target, _) in PROVIDERS.items()}


class Capabilities:
    """The capability attributes of one provider, read from its registry line (the adapter is not imported);
    attributes as documented on :class:`broker.core.provider.Provider`."""

    __slots__ = ("name", "_values")

    def __init__(self, name: str, declared: dict[str, Any]):
        unknown = sorted(set(declared) - set(CAPABILITIES))
        if unknown:
            raise TypeError(f"provider {name!r}: unknown capabilities {unknown} (known: {', '.join(CAPABILITIES)})")
        self.name = name
        self._values = {c: declared.get(c, getattr(_Base, c)) for c in CAPABILITIES}

    def __getattr__(self, attr: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[attr]
        except KeyError:
            raise AttributeError(f"no capability {attr!r}") from None

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"Capabilities({self.name!r}, {self._values!r})"


_CAPS: dict[str, Capabilities] = {name: Capabilities(name, declared) for name, (_, declared) in PROVIDERS.items()}


def capabilities(name: str) -> Capabilities:
    """The capabilities of registered provider ``name``; raises BadInput for an unknown name."""
    try:
        return _CAPS[name]
    except KeyError:
        raise BadInput(f"unknown provider {name!r}", hint=f"choose one of: {', '.join(REGISTRY)}") from None


def capability(name: str, attr: str) -> Any:
    """Capability ``attr`` of ``name``; the :class:`broker.core.provider.Provider` default for a name that is not
    registered (a test double, a row of a ledger written by a newer broker)."""
    caps = _CAPS.get(name)
    return getattr(caps, attr) if caps is not None else getattr(_Base, attr)


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
#: Pretend (emulated) providers.
PRETEND: tuple[str, ...] = names_where(lambda c: c.pretend)
#: Providers whose machines ``broker slurm up`` builds a Slurm cluster on: the emulations first, then the clouds.
SLURM_NODES: tuple[str, ...] = tuple(sorted(names_where(lambda c: c.slurm_nodes), key=lambda n: _CAPS[n].rents))


def names() -> list[str]:
    return list(REGISTRY)


#: the entry point group through which an installed package adds a provider: ``<name> = "<module>:<Class>"`` (a
#: :class:`~broker.core.provider.Provider` subclass).  Read the first time a name is not in :data:`PROVIDERS`, never
#: at start-up; such a provider is reached by name (``broker run --provider <name>``), its capabilities from its class.
PLUGIN_GROUP = "broker.providers"
_plugins: dict[str, str] | None = None


def plugins() -> dict[str, str]:
    """Providers added by installed packages (entry points of :data:`PLUGIN_GROUP`): name -> ``module:Class``.  A
    name already in :data:`PROVIDERS` is not replaced."""
    global _plugins
    if _plugins is None:
        from importlib.metadata import entry_points

        _plugins = {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in PROVIDERS}
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
