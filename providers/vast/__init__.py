"""Vast.ai adapter: live offer search, rent / describe / destroy, the run's SSH key, the tagged-instance list and
the node-side dead-man switch.

Layout: :mod:`.client` speaks the REST API (key, httpx, retries, the one error mapping);
:mod:`.offers` and :mod:`.lifecycle` are the contract verbs; :mod:`.boot` is what the instance runs at boot.
:class:`VastProvider` binds them.  Endpoints, fields and units: docs/reference/cloud-apis.md section A (shared reference notes).

Topology: Vast.ai hosts sit behind separate NATs, so only ``simulated`` (one host with N GPUs acting as N nodes)
is offered; the nodes of that host reach each other on ``127.0.0.1`` (``InstanceInfo.private_ip``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, ClassVar

from broker.core.provider import AuthError, Provider, ProviderCheck, ProviderError
from broker.core.prose import usd
from broker.providers.declared import VAST

from broker.providers.vast.boot import NODE_DIR, ONSTART_LIMIT, fit_onstart, onstart_script
from broker.providers.vast.client import (CREDIT_HINT, DEFAULT_API_URL, KEY_HINT, MAX_RETRY_AFTER_S, PROVIDER,
                                          RETRY_STATUSES, VastClient, api_url, find_api_key)
from broker.providers.vast.lifecycle import (DEFAULT_IMAGE, LABEL_MAX, Label, VastLifecycle, instance_info,
                                             make_label, parse_label, read_label)
from broker.providers.vast.offers import (GPU_NAME_VARIANTS, VastOffers, _parse_query_fallback, offer_from_row,
                                          parse_vast_query, vast_gpu_names)

__all__ = ["CREDIT_HINT", "DEFAULT_API_URL", "DEFAULT_IMAGE", "GPU_NAME_VARIANTS", "KEY_HINT", "LABEL_MAX", "Label",
           "MAX_RETRY_AFTER_S", "NODE_DIR", "ONSTART_LIMIT", "PROVIDER", "RETRY_STATUSES", "VastClient",
           "VastProvider", "_parse_query_fallback", "api_url", "find_api_key", "fit_onstart", "instance_info",
           "make_label", "offer_from_row", "onstart_script", "parse_label", "parse_vast_query", "read_label",
           "vast_gpu_names"]


class VastProvider(VastOffers, VastLifecycle, Provider):
    """Vast.ai: live offers (one host = one offer, ``simulated`` topology only) and the instance lifecycle.

    Constructor arguments (all optional; no I/O happens here): ``api_key`` (else the SDK's lookup order),
    ``api_url`` (else ``VAST_API_URL``), ``max_attempts`` per request (retries on 429/502/503/504), ``backoff_s``
    (first wait when no ``Retry-After``; doubles, capped at 10 s), ``sleep`` (injectable for tests),
    ``timeout_s`` per request, search defaults ``min_reliability`` (0-1), ``min_inet_mbps`` (Mbit/s up and down),
    ``min_cuda`` (driver's max CUDA version), ``limit`` (offers per search), ``price_tolerance`` (fraction a
    re-quoted price may rise before create refuses with OfferGone), ``delete_attempts`` / ``delete_timeout_s``
    (how long a destroy is retried on 5xx / 429 / 409), ``node_dir`` (the instance's folder for broker's files,
    default ``/root/.broker``).
    """

    name = PROVIDER
    #: what it can do, and why not (providers/declared.py; the registry reads the same object)
    caps = VAST

    @classmethod
    def snapshot_rows(cls, reference_dir: "Path") -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from broker.providers.vast.snapshot import snapshot_rows

        return snapshot_rows(reference_dir)

    @classmethod
    def query_snapshot(cls, offers: list, query: str) -> list:
        """The snapshot's offers that meet ``query`` (``vastai search offers`` syntax) on the fields the snapshot
        has; BadInput for a malformed query or a field it lacks (e.g. ``reliability``)."""
        from broker.providers.vast.offers import filter_snapshot, parse_vast_query

        return filter_snapshot(offers, parse_vast_query(query), query)

    def __init__(self, api_key: str | None = None, api_url: str | None = None, *, max_attempts: int = 4,
                 backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep, timeout_s: float = 60.0,
                 min_reliability: float = 0.98, min_inet_mbps: float = 100.0, min_cuda: float = 12.1,
                 limit: int = 64, price_tolerance: float = 0.10, delete_attempts: int = 10,
                 delete_timeout_s: float = 180.0, node_dir: str = NODE_DIR):
        self.api = VastClient(api_key, api_url, max_attempts=max_attempts, backoff_s=backoff_s, sleep=sleep,
                              timeout_s=timeout_s)
        self.min_reliability = min_reliability
        self.min_inet_mbps = min_inet_mbps
        self.min_cuda = min_cuda
        self.limit = limit
        self.price_tolerance = price_tolerance
        self.delete_attempts = max(1, int(delete_attempts))
        self.delete_timeout_s = delete_timeout_s
        self.node_dir = node_dir
        self._last_source: str | None = None  # "live" | "snapshot <date>" after offers()
        self._unverified: dict[str, str] = {}
        self._disk_wanted: dict[str, float] = {}

    @property
    def api_url(self) -> str:
        return self.api.url

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.api.close()

    def check(self, online: bool = False) -> ProviderCheck:
        """Whether a key is configured (no network) and, with ``online``, usable (``GET /api/v0/users/current``;
        the detail shows the credit in USD, never the key)."""
        key, source = self.api.key_source()
        if not key:
            return ProviderCheck(provider=PROVIDER, configured=False, usable=None, detail=source, hint=KEY_HINT)
        if not online:
            return ProviderCheck(provider=PROVIDER, configured=True, usable=None, detail=f"key from {source}")
        call = "check (users/current)"
        try:
            data = self.api.json(self.api.request("GET", "/api/v0/users/current", call), call)
        except AuthError as exc:
            return ProviderCheck(provider=PROVIDER, configured=True, usable=False, detail=exc.message, hint=KEY_HINT)
        except ProviderError as exc:
            return ProviderCheck(provider=PROVIDER, configured=True, usable=False, detail=exc.message, hint=exc.hint)
        credit = data.get("credit") if isinstance(data, dict) else None
        detail = f"key from {source}; {self.api_url}"
        if isinstance(credit, (int, float)):
            detail += f"; credit {usd(credit)}"
        hint = CREDIT_HINT if isinstance(credit, (int, float)) and credit <= 0 else None
        return ProviderCheck(provider=PROVIDER, configured=True, usable=True, detail=detail, hint=hint)
