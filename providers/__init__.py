"""Provider adapters, one module per provider, imported lazily by name.

``get_provider("vast")`` imports ``broker.providers.vast`` only when asked, so the CLI starts fast and a missing SDK
(``oci``, ``boto3``) only matters for the provider that needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from broker.provider import BadInput

if TYPE_CHECKING:
    from broker.provider import Provider

#: name -> "module:Class"
REGISTRY: dict[str, str] = {
    "local": "broker.providers.local:LocalProvider",
    "vast": "broker.providers.vast:VastProvider",
    "oci": "broker.providers.oci:OCIProvider",
    "aws": "broker.providers.aws:AWSProvider",
    "netns": "broker.providers.netns:NetnsProvider",
    "slurm": "broker.providers.slurm:SlurmProvider",
    "fake": "broker.providers.fake:FakeProvider",
}

#: Providers that rent machines (planned over by default).
CLOUD = ("vast", "oci", "aws")


def names() -> list[str]:
    return list(REGISTRY)


def provider_class(name: str) -> type["Provider"]:
    """The adapter class for ``name``; raises BadInput for an unknown name."""
    try:
        target = REGISTRY[name]
    except KeyError:
        raise BadInput(f"unknown provider {name!r}", hint=f"choose one of: {', '.join(REGISTRY)}") from None
    mod_name, cls_name = target.split(":")
    mod = importlib.import_module(mod_name)
    return getattr(mod, cls_name)


def get_provider(name: str, **kwargs: Any) -> "Provider":
    """An adapter instance (constructors do no I/O)."""
    return provider_class(name)(**kwargs)
