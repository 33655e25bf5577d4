"""Oracle's public price list (no credentials): the OCI snapshot's shapes repriced per GPU-hour for ``broker catalog
refresh`` (:meth:`broker.providers.oci.OCIProvider.public_price_offers`, ``live_price_list`` ``"public"``)."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.core.model import Offer

#: Oracle's public cost-estimator price list (no credentials).  [3rd-party] shape of the answer, as read by several
#: public price collectors: ``{"items": [{"partNumber", "displayName": "Compute - GPU - A10", "metricName",
#: "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "PAY_AS_YOU_GO", "value": 2}]}]}]}``,
#: GPU SKUs priced per GPU-hour.  Not confirmed against Oracle documentation: unmatched shapes keep their price.
OCI_PRICE_LIST_URL = "https://apexapps.oracle.com/pls/apex/cetools/api/v1/products/"
_OCI_GPU_SKU = re.compile(r"^(?:OCI - )?Compute - GPU(?: Standard)? - (?P<model>.+)$")


def _model_key(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


def parse_oci_price_list(data: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """GPU SKU model (normalized: ``a10``, ``h100``...) -> (USD per GPU-hour pay-as-you-go, ``partNumber
    displayName``) from an answer of :data:`OCI_PRICE_LIST_URL`."""
    out: dict[str, tuple[float, str]] = {}
    for item in data.get("items") or []:
        name = str(item.get("displayName") or "")
        m = _OCI_GPU_SKU.match(name.strip())
        if not m:
            continue
        price = None
        for loc in item.get("currencyCodeLocalizations") or []:
            if loc.get("currencyCode") not in (None, "USD"):
                continue
            for pr in loc.get("prices") or []:
                if pr.get("model") == "PAY_AS_YOU_GO" and isinstance(pr.get("value"), (int, float)):
                    price = float(pr["value"])
        if price is not None and price > 0:
            out[_model_key(m.group("model"))] = (price, f"{item.get('partNumber', '?')} {name}")
    return out


def _oci_sku_for(gpu_name: str, skus: dict[str, tuple[float, str]]) -> tuple[float, str] | None:
    """The price-list SKU of a snapshot GPU name (``A10``, ``H100``, ``A100-80GB``); None when unsure."""
    key = _model_key(gpu_name)
    if key in skus:
        return skus[key]
    if key == "h100" and "h100t" in skus:  # the H100 SKU is listed as "H100T" by some readers
        return skus["h100t"]
    if key.startswith("a100"):  # A100 40 GB vs 80 GB: only an SKU naming the memory counts
        mem = key[4:6]
        hits = [v for k, v in skus.items() if k.startswith("a100") and mem and mem in k[4:]]
        return hits[0] if len(hits) == 1 else None
    return None


def oci_live_offers(get: Any = None, *, now: datetime | None = None) -> list["Offer"]:
    """OCI snapshot shapes repriced from Oracle's public price list (per GPU-hour x GPUs per shape).

    ``get``: an ``httpx``-style ``get(url, params=..., timeout=...)`` (default ``httpx.get``).  Shapes whose GPU
    has no unambiguous SKU keep their snapshot price (their ``notes`` say so).  Raises httpx errors when the list
    cannot be fetched and ValueError when it holds no GPU SKU at all.
    """
    import httpx

    from broker.core.provider import ProviderError

    if get is None:
        get = httpx.get
    call = "GET the public price list"
    host = httpx.URL(OCI_PRICE_LIST_URL).host
    try:
        r = get(OCI_PRICE_LIST_URL, params={"currencyCode": "USD"}, timeout=30.0)
        r.raise_for_status()
        data = r.json()
    except httpx.HTTPStatusError as e:
        raise ProviderError("oci", call, f"{host} answered HTTP {e.response.status_code}", status=e.response.status_code,
                            hint="try again later; the shipped snapshot stays in use") from None
    except httpx.TransportError as e:
        # the socket's own words ("[Errno -2] Name or service not known") said nothing about what was reached
        cause = e.__context__ or e.__cause__
        why = (f"the name {host} does not resolve (no DNS or no network)" if "Name or service not known" in str(e)
               or "Name or service not known" in str(cause) else f"{type(e).__name__}: {e}")
        raise ProviderError("oci", call, f"cannot reach {host}: {why}",
                            hint="check the network or proxy (HTTPS_PROXY); the shipped snapshot stays in use") from None
    except ValueError:
        raise ProviderError("oci", call, f"{host} answered something that is not JSON",
                            hint="try again later; the shipped snapshot stays in use") from None
    skus = parse_oci_price_list(data)
    if not skus:
        raise ValueError("Oracle's price list answered without any 'Compute - GPU - ...' SKU")
    when = now or datetime.now(timezone.utc)
    from broker.plan.catalog import snapshot_offers

    base = snapshot_offers("oci")
    out = []
    for o in base:
        hit = _oci_sku_for(o.gpu_name, skus)
        if hit is None:
            out.append(replace(o, attrs={**o.attrs, "notes": f"price carried over from {o.price_source}"}))
            continue
        per_gpu, sku = hit
        out.append(replace(o, usd_per_hour=round(per_gpu * o.gpu_count, 6), price_time=when,
                           price_source="live OCI price list",
                           attrs={**o.attrs, "notes": f"{per_gpu:g} $/GPU-h x {o.gpu_count}: {sku}"}))
    return out
