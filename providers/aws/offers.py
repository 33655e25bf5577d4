"""AWS read side: instance types priced from the snapshot, expanded per offering zone, vCPU quotas with usage,
"offered" capacity facts and live list prices from the Pricing API.

Facts (docs/reference/cloud-apis.md section C): quotas are EC2 Service Quotas counted in **vCPUs** (``L-DB2E81BA``
running on-demand G and VT, ``L-417A185B`` running on-demand P; spot codes only when spot is asked for); usage from
the quota's CloudWatch ``UsageMetric`` (``AWS/Usage`` ``ResourceCount``; maximum over the last 15 minutes; 0 with a
note when unreadable);
``describe_instance_type_offerings`` says where a type is offered, which is not capacity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from broker.core.model import Capacity, Offer, Quota, Requirements, utcnow
from broker.core.provider import BadInput, ProviderError
from broker.providers.aws.api import PROVIDER, error_code, expect_list, expect_str, map_error, unreadable

if TYPE_CHECKING:
    from broker.providers.aws.api import AWSApi

import logging  # noqa: E402

_log = logging.getLogger(__name__)

#: Region of the Pricing API endpoint.
PRICING_REGION = "us-east-1"

#: Region code -> the Pricing API's ``location`` attribute.
REGION_LOCATIONS = {
    "us-east-1": "US East (N. Virginia)", "us-east-2": "US East (Ohio)", "us-west-1": "US West (N. California)",
    "us-west-2": "US West (Oregon)", "ca-central-1": "Canada (Central)", "eu-west-1": "EU (Ireland)",
    "eu-west-2": "EU (London)", "eu-west-3": "EU (Paris)", "eu-central-1": "EU (Frankfurt)",
    "eu-north-1": "EU (Stockholm)", "ap-northeast-1": "Asia Pacific (Tokyo)", "ap-northeast-2": "Asia Pacific (Seoul)",
    "ap-southeast-1": "Asia Pacific (Singapore)", "ap-southeast-2": "Asia Pacific (Sydney)",
    "ap-south-1": "Asia Pacific (Mumbai)", "sa-east-1": "South America (Sao Paulo)",
}


@dataclass
class OfferCache:
    """What the read side learnt, reused by :func:`capacity` after :func:`offers`."""

    offered: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (region, type) -> zones offering it
    zones: dict[str, set[str]] = field(default_factory=dict)  # region -> every zone seen in offerings
    hw: dict[str, dict[str, Any]] = field(default_factory=dict)  # instance type -> describe_instance_types facts


def list_price(instance_type: str | None) -> float | None:
    """On-demand $/hour of ``instance_type`` in the price snapshot in effect; None when it is not there."""
    from broker.plan.catalog import snapshot_price

    return snapshot_price(PROVIDER, instance_type)


def snapshot(req: Requirements) -> list[Offer]:
    """Offers of the price snapshot in effect (:func:`broker.plan.catalog.snapshot_offers`), filtered by ``req``."""
    from broker.plan.catalog import snapshot_offers

    return list(snapshot_offers(PROVIDER, req))


def offers(api: "AWSApi", base: list[Offer], cache: OfferCache) -> list[Offer]:
    """``base`` (snapshot offers) expanded to one offer per offering AZ of the configured region, with the GPU
    facts of ``describe_instance_types`` in attrs."""
    region = api.region
    zones = offered_zones(api, [o.instance_type for o in base], cache, region)
    refine_types(api, base, region, cache)
    out: list[Offer] = []
    for o in base:
        for z in sorted(zones.get(o.instance_type, ())):
            attrs = dict(o.attrs)
            attrs.update(cache.hw.get(o.instance_type, {}))
            if region != (o.region or region):
                attrs["price_region"] = o.region
            out.append(replace(o, region=region, zone=z, offer_id=o.instance_type, attrs=attrs,
                               private_network=True))
    return with_spot_prices(api, out, region)


#: ``describe_spot_price_history`` product of broker's nodes (Linux in a VPC)
SPOT_PRODUCTS = ("Linux/UNIX", "Linux/UNIX (Amazon VPC)")


def spot_prices(api: "AWSApi", instance_types: list[str], region: str) -> dict[tuple[str, str], tuple[float, str]]:
    """(instance type, zone) -> (current spot $/hour, its timestamp as text) from ``describe_spot_price_history``
    (the latest row per type and zone, Linux products only).  Raises ProviderError for an unreadable answer."""
    call = "describe_spot_price_history"
    if not instance_types:
        return {}
    ec2 = api.client("ec2", region)
    now = utcnow()
    out: dict[tuple[str, str], tuple[float, Any]] = {}
    token: str | None = None
    for _ in range(20):  # pages of up to 1000 rows: a handful of types x zones fit in one
        kw: dict[str, Any] = {"InstanceTypes": sorted(set(instance_types)), "ProductDescriptions": list(SPOT_PRODUCTS),
                              "StartTime": now, "MaxResults": 1000}
        if token:
            kw["NextToken"] = token
        resp = api.call(ec2, call, {"region": region}, **kw)
        for row in expect_list(call, resp, "SpotPriceHistory"):
            if row.get("ProductDescription") not in SPOT_PRODUCTS:
                continue
            try:
                key = (expect_str(call, row, "InstanceType"), expect_str(call, row, "AvailabilityZone"))
                price = float(expect_str(call, row, "SpotPrice"))
            except ValueError:
                raise unreadable(call, f"SpotPrice {row.get('SpotPrice')!r} is not a number") from None
            ts = row.get("Timestamp")
            if key not in out or (ts is not None and str(ts) > str(out[key][1])):
                out[key] = (price, ts)
        token = resp.get("NextToken") if isinstance(resp, dict) else None
        if not token:
            break
    return {k: (p, str(ts)) for k, (p, ts) in out.items()}


def with_spot_prices(api: "AWSApi", offers_: list[Offer], region: str) -> list[Offer]:
    """``offers_`` with the current spot price of their type and zone as their interruptible price (attrs
    ``interruptible_usd_per_hour`` / ``interruptible_price_source``, :mod:`broker.plan.interruptible`).  A spot
    price history broker may not read (AccessDenied, an emulator without it) leaves the snapshot's spot price
    where it has one, and says so in ``interruptible_price_source``; an unreadable answer raises ProviderError."""
    try:
        prices = spot_prices(api, [o.instance_type for o in offers_], region)
    except ProviderError as e:
        if "unreadable answer" in e.message:  # fail closed on a shape broker does not know
            raise
        _log.info("aws: spot price history not read (%s); snapshot spot prices stay", e)
        return offers_
    out = []
    for o in offers_:
        hit = prices.get((o.instance_type, o.zone or ""))
        if hit is None:
            out.append(o)
            continue
        price, ts = hit
        out.append(replace(o, attrs={**o.attrs, "interruptible_usd_per_hour": price,
                                     "interruptible_price_source": f"live EC2 spot price {o.zone} {ts}"}))
    return out


def offered_zones(api: "AWSApi", instance_types: list[str], cache: OfferCache,
                  region: str | None = None) -> dict[str, set[str]]:
    """Instance type -> AZs of ``region`` offering it (``describe_instance_type_offerings``, all pages)."""
    region = region or api.region
    ec2 = api.client("ec2", region)
    call = "describe_instance_type_offerings"
    out: dict[str, set[str]] = {t: set() for t in instance_types}
    types = sorted(set(instance_types))
    token: str | None = None
    while True:
        params: dict[str, Any] = {"LocationType": "availability-zone",
                                  "Filters": [{"Name": "instance-type", "Values": types}]}
        if token:
            params["NextToken"] = token
        resp = api.call(ec2, call, {"region": region}, **params)
        for item in expect_list(call, resp, "InstanceTypeOfferings"):
            t, loc = expect_str(call, item, "InstanceType"), expect_str(call, item, "Location")
            out.setdefault(t, set()).add(loc)
            cache.zones.setdefault(region, set()).add(loc)
        token = resp.get("NextToken")
        if not token:
            break
    for t, zs in out.items():
        cache.offered[(region, t)] = set(zs)
    return out


def refine_types(api: "AWSApi", offers_: list[Offer], region: str, cache: OfferCache) -> None:
    """GPU memory (MiB as the API reports it) from ``describe_instance_types``, kept in offer attrs; best
    effort (an error leaves the snapshot's figures)."""
    cache.hw = {}
    types = sorted({o.instance_type for o in offers_})
    try:
        resp = api.call(api.client("ec2", region), "describe_instance_types", {"region": region},
                        InstanceTypes=types)
        items = expect_list("describe_instance_types", resp, "InstanceTypes")
    except ProviderError:
        return
    for it in items:
        gi = it.get("GpuInfo") or {}
        gpus = gi.get("Gpus") or [{}]
        cache.hw[it.get("InstanceType", "?")] = {
            "api_vcpus": (it.get("VCpuInfo") or {}).get("DefaultVCpus"),
            "api_gpu_mem_mib": (gpus[0].get("MemoryInfo") or {}).get("SizeInMiB"),
            "api_gpu": f"{gpus[0].get('Manufacturer', '')} {gpus[0].get('Name', '')}".strip(),
        }


def capacity(api: "AWSApi", offers_: list[Offer], cache: OfferCache) -> list[Capacity]:
    """Per (type, AZ): ``NOT_OFFERED`` where the AZ does not offer the type, else ``UNKNOWN`` (EC2 exposes no
    capacity figure: offered is not capacity)."""
    out: list[Capacity] = []
    by_region: dict[str, set[str]] = {}
    for o in offers_:
        by_region.setdefault(o.region or api.region, set()).add(o.instance_type)
    for region, types in by_region.items():
        missing = [t for t in types if (region, t) not in cache.offered]
        if missing:
            offered_zones(api, missing, cache, region)
        all_zones = cache.zones.get(region, set())
        for t in sorted(types):
            offered = cache.offered.get((region, t), set())
            for z in sorted(all_zones | {o.zone for o in offers_ if o.instance_type == t and o.zone}):
                out.append(Capacity(provider=PROVIDER, region=region, zone=z, instance_type=t,
                                    status="UNKNOWN" if z in offered else "NOT_OFFERED",
                                    source="describe_instance_type_offerings"))
    return out


def _on_demand_usd(item: dict[str, Any]) -> list[float]:
    """USD per unit of every OnDemand price dimension in one Pricing API product (PriceList entry)."""
    out = []
    for term in ((item.get("terms") or {}).get("OnDemand") or {}).values():
        for dim in (term.get("priceDimensions") or {}).values():
            usd = (dim.get("pricePerUnit") or {}).get("USD")
            if usd is not None and str(dim.get("unit", "Hrs")).lower().startswith("hr"):
                try:
                    out.append(float(usd))
                except ValueError:
                    continue
    return out


def live_prices(api: "AWSApi", instance_types: list[str], region: str | None = None) -> dict[str, float]:
    """On-demand Linux list price ($/hour) per instance type from the AWS Pricing API (``pricing`` client in
    us-east-1, ``get_products`` with instanceType, location, operatingSystem=Linux, tenancy=Shared,
    preInstalledSw=NA, capacitystatus=Used).  Types without a price are left out.  Raises AuthError,
    TransientError, ProviderError."""
    region = region or api.region
    location = REGION_LOCATIONS.get(region)
    if location is None:
        raise BadInput(f"no Pricing API location name known for region {region!r}",
                       hint=f"known regions: {', '.join(REGION_LOCATIONS)}")
    pricing = api.client("pricing", PRICING_REGION)
    call = "get_products"
    out: dict[str, float] = {}
    for t in instance_types:
        filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in (
            ("instanceType", t), ("location", location), ("operatingSystem", "Linux"), ("tenancy", "Shared"),
            ("preInstalledSw", "NA"), ("capacitystatus", "Used"))]
        token: str | None = None
        prices: list[float] = []
        while True:
            params: dict[str, Any] = {"ServiceCode": "AmazonEC2", "Filters": filters, "FormatVersion": "aws_v1",
                                      "MaxResults": 100}
            if token:
                params["NextToken"] = token
            resp = api.call(pricing, call, {"region": region}, **params)
            raw_list = resp.get("PriceList") if isinstance(resp, dict) else None
            if not isinstance(raw_list, list):
                raise unreadable(call, "no 'PriceList' list")
            for raw in raw_list:
                try:
                    item = json.loads(raw) if isinstance(raw, str) else raw
                except ValueError:
                    raise unreadable(call, "a PriceList entry is not JSON") from None
                if not isinstance(item, dict):
                    raise unreadable(call, f"a PriceList entry is a {type(item).__name__}")
                prices += _on_demand_usd(item)
            token = resp.get("NextToken")
            if not token:
                break
        positive = [p for p in prices if p > 0]
        if positive:
            out[t] = min(positive)
    return out


def quotas(api: "AWSApi", req: Requirements, offers_: list[Offer]) -> list[Quota]:
    """The vCPU quotas covering ``offers_`` (on-demand; spot codes when ``req``/offers ask for spot), read with
    ``get_service_quota`` (falling back to ``get_aws_default_service_quota`` on NoSuchResourceException)."""
    from broker.providers.aws.limits import AWS_QUOTA_CODES, aws_quota_code

    spot = bool(getattr(req, "spot", False)) or any(o.attrs.get("market") == "spot" for o in offers_)
    # interruptible options are judged by the spot vCPU limits (separate from on-demand, often 0 on new accounts)
    also_spot = not spot and getattr(req, "interruptible", "false") != "false"
    groups: dict[tuple[str, str, bool], list[str]] = {}
    for o in offers_:
        for market in ((spot, True) if also_spot else (spot,)):
            q = aws_quota_code(o.instance_type, spot=market)
            if q is None:
                continue
            lst = groups.setdefault((o.region or api.region, q.code, market and also_spot), [])
            if o.instance_type not in lst:
                lst.append(o.instance_type)
    out: list[Quota] = []
    for (region, code, interruptible), types in groups.items():
        value, name, source, metric = quota_read(api, code, region)
        used, note = usage(api, code, region, metric)
        desc = name or AWS_QUOTA_CODES[code].name
        if note:
            desc += f" ({note})"
        out.append(Quota(provider=PROVIDER, name=code, description=desc, region=region, scope=region,
                         limit=value, used=used, unit="vcpus", instance_types=types, source=source,
                         interruptible=interruptible))
    return out


def _quota_number(call: str, resp: Any) -> tuple[float, str]:
    q = resp.get("Quota") if isinstance(resp, dict) else None
    if not isinstance(q, dict) or isinstance(q.get("Value"), bool) or not isinstance(q.get("Value"), (int, float)):
        raise unreadable(call, "no Quota.Value number")
    return float(q["Value"]), str(q.get("QuotaName") or "")


def _usage_metric(resp: Any) -> dict[str, Any] | None:
    """The quota's own ``UsageMetric`` (``MetricNamespace``, ``MetricName``, ``MetricDimensions``) when Service
    Quotas returned a complete one, else None."""
    q = resp.get("Quota") if isinstance(resp, dict) else None
    m = q.get("UsageMetric") if isinstance(q, dict) else None
    if not isinstance(m, dict):
        return None
    dims = m.get("MetricDimensions")
    if not (isinstance(m.get("MetricNamespace"), str) and isinstance(m.get("MetricName"), str)
            and isinstance(dims, dict) and dims and all(isinstance(v, str) for v in dims.values())):
        return None
    return m


def quota_read(api: "AWSApi", code: str, region: str) -> tuple[float, str, str, dict[str, Any] | None]:
    """(value, name, source, usage metric) of an EC2 quota in ``region``: the applied value, else AWS's default;
    the usage metric is the quota's ``UsageMetric`` when Service Quotas gives one."""
    sq = api.client("service-quotas", region)
    try:
        resp = sq.get_service_quota(ServiceCode="ec2", QuotaCode=code)
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] != "NoSuchResourceException":
            raise map_error(e, "get_service_quota", region=region) from e
    else:
        return (*_quota_number("get_service_quota", resp), "service-quotas get_service_quota", _usage_metric(resp))
    resp = api.call(sq, "get_aws_default_service_quota", {"region": region}, ServiceCode="ec2", QuotaCode=code)
    return (*_quota_number("get_aws_default_service_quota", resp), "service-quotas default (no applied value)",
            _usage_metric(resp))


def quota_value(api: "AWSApi", code: str, region: str) -> tuple[float, str, str]:
    """(value, name, source) of an EC2 quota in ``region``: the applied value, else AWS's default."""
    return quota_read(api, code, region)[:3]


def usage(api: "AWSApi", code: str, region: str, metric: dict[str, Any] | None = None) -> tuple[float, str]:
    """vCPUs in use for a quota: CloudWatch ``ResourceCount`` (max over 15 min) of the quota's ``metric``
    (Service Quotas' ``UsageMetric``), else ``AWS/Usage`` with the table's ``Class`` (``G/OnDemand``,
    ``Standard/OnDemand``, ``P/Spot`` ...).  On any error returns (0, note)."""
    from broker.providers.aws.limits import AWS_QUOTA_CODES

    if metric is not None:
        namespace, name = metric["MetricNamespace"], metric["MetricName"]
        dims = [{"Name": k, "Value": v} for k, v in metric["MetricDimensions"].items()]
    else:
        namespace, name = "AWS/Usage", "ResourceCount"
        dims = [{"Name": "Service", "Value": "EC2"}, {"Name": "Type", "Value": "Resource"},
                {"Name": "Resource", "Value": "vCPU"}, {"Name": "Class", "Value": AWS_QUOTA_CODES[code].usage_class}]
    now = utcnow()
    try:
        cw = api.client("cloudwatch", region)
        resp = cw.get_metric_statistics(
            Namespace=namespace, MetricName=name, Dimensions=dims,
            StartTime=now - timedelta(minutes=15), EndTime=now, Period=300, Statistics=["Maximum"])
    except Exception as e:  # noqa: BLE001 - usage is best effort
        return 0.0, f"usage unknown ({error_code(e)[0]}), assumed 0"
    points = resp.get("Datapoints") if isinstance(resp, dict) else None
    if not isinstance(points, list):
        return 0.0, "usage unknown (unreadable answer), assumed 0"
    if not points:
        return 0.0, ""  # no datapoints: nothing of that class ran in the last 15 minutes
    latest = max(points, key=lambda p: p.get("Timestamp") or now)
    return float(latest.get("Maximum", 0.0)), ""
