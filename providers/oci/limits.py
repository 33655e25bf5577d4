"""Which OCI ``compute`` service limit (AD-scoped, counted in GPUs) a GPU shape consumes, and how many GPUs a shape
has: the one table for the adapter's quota reads, its quota errors and :func:`broker.plan.quota.limit_for` (through
:meth:`broker.providers.oci.OCIProvider.quota_limit`).  Oracle compute service-limit docs,
docs/reference/cloud-apis.md B2 (``gpu-h100-count`` is unconfirmed).
"""

from __future__ import annotations

import re

_OCI_LIMIT_PATTERNS: list[tuple[str, str]] = [
    (r"^(VM|BM)\.GPU\.A10\.", "gpu-a10-count"),
    (r"^(VM|BM)\.GPU2\.", "gpu2-count"),
    (r"^(VM|BM)\.GPU3\.", "gpu3-count"),
    (r"^BM\.GPU4\.", "gpu4-count"),
    (r"^BM\.GPU\.A100-v2\.", "gpu-a100-v2-count"),
    (r"^BM\.GPU\.H100\.", "gpu-h100-count"),  # name seen in third-party code only (docs/reference/cloud-apis.md B2)
    (r"^BM\.GPU\.H200\.", "gpu-h200-count"),
    (r"^BM\.GPU\.B200\.", "gpu-b200-count"),
    (r"^BM\.GPU\.MI300X\.", "gpu-mi300x-count"),
]


def oci_limit_name(shape: str) -> str | None:
    """The AD-scoped ``compute`` limit (counted in GPUs) that covers ``shape``; None for non-GPU shapes."""
    for pat, name in _OCI_LIMIT_PATTERNS:
        if re.match(pat, shape, re.IGNORECASE):
            return name
    return None


def limit_for_shape(shape: str) -> str | None:
    """The ``compute`` service limit (AD-scoped, counted in GPUs) that a GPU shape consumes; None when unknown."""
    return oci_limit_name(shape)


def shape_gpus(shape: str) -> int:
    """GPUs in a shape (from the price snapshot in effect, else the trailing ``.N`` of the name, else 1)."""
    from broker.plan.catalog import snapshot_offer

    o = snapshot_offer("oci", shape)
    if o is not None:
        return o.gpu_count
    m = re.search(r"\.(\d+)$", shape)
    return int(m.group(1)) if m else 1
