"""Vast.ai read side: the query grammar, the offer search, row -> Offer, the snapshot when no key is configured,
capacity and the price note (contract verbs ``offers`` / ``capacity`` / ``price_note``).

Search: ``POST /api/v0/bundles/`` with the query dict as body, answered ``{"offers": [...]}`` (docs/reference/cloud-apis.md A2/A3).
Units: ``gpu_ram``/``cpu_ram`` MB, ``disk_space`` GB, ``inet_*`` Mbit/s, ``duration`` s, ``allocated_storage`` GiB
(it prices the disk into ``dph_total``).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import TYPE_CHECKING, Any

from broker.core.model import Capacity, Offer, Requirements, gc_paused, utcnow
from broker.core.provider import BadInput

from broker.providers.vast.client import PROVIDER, SEARCH_INTERVAL_S, expect

if TYPE_CHECKING:  # pragma: no cover
    from broker.providers.vast.client import VastClient

SEARCH_CALL = "search offers (POST /api/v0/bundles/)"
#: A created instance's ``disk_space`` may read this fraction below the asked size and still count as the asked disk.
DISK_TOLERANCE = 0.01

#: Vast spells GPU models with spaces and variants ("H100 SXM"); a bare family name matches every variant.
GPU_NAME_VARIANTS: dict[str, list[str]] = {
    "H100": ["H100 SXM", "H100 PCIE", "H100 NVL"],
    "A100": ["A100 PCIE", "A100 SXM4", "A100X"],
    "V100": ["Tesla V100"],
    "T4": ["Tesla T4"],
    "P100": ["Tesla P100"],
    "RTX 6000 ADA": ["RTX 6000Ada"],
    "L40S": ["L40S"],
}

#: Offer fields whose query values are strings (every other field's value is sent as a JSON number / bool).
STRING_FIELDS = frozenset({"gpu_name", "geolocation", "cpu_arch", "gpu_arch", "datacenter", "verification",
                           "mobo_name", "cuda_vers", "ubuntu_version", "cluster_id"})
#: Native query-string grammar (vastai.api.query.parse_query): operator spellings → JSON operators.
QUERY_OPS = {">=": "gte", ">": "gt", "gt": "gt", "gte": "gte", "<=": "lte", "<": "lt", "lt": "lt", "lte": "lte",
             "!=": "neq", "==": "eq", "=": "eq", "eq": "eq", "neq": "neq", "noteq": "neq", "not eq": "neq",
             "notin": "notin", "not in": "notin", "nin": "notin", "in": "in"}
QUERY_ALIAS = {"cuda_vers": "cuda_max_good", "display_active": "gpu_display_active", "dlperf_usd": "dlperf_per_dphtotal",
               "dph": "dph_total", "flops_usd": "flops_per_dphtotal"}
#: The CLI grammar's unit conversions: GB → MB for memory fields, days → seconds for ``duration``.
QUERY_MULT = {"cpu_ram": 1000, "gpu_ram": 1000, "gpu_total_ram": 1000, "duration": 24.0 * 60.0 * 60.0}



# --------------------------------------------------------------------------------------------------- query
def _number(value: Any) -> Any:
    """``"2"`` → 2, ``"0.98"`` → 0.98; anything else unchanged (the CLI parser sends numbers as strings)."""
    if isinstance(value, str):
        try:
            f = float(value)
        except ValueError:
            return value
        if math.isfinite(f):
            return int(f) if f.is_integer() and "." not in value and "e" not in value.lower() else f
    return value


def _parse_query_fallback(query: str) -> dict[str, dict[str, Any]]:
    """The vastai CLI query grammar (``field op value`` terms separated by spaces), re-implemented.

    Same regex, operators, aliases, GB→MB / days→s multipliers and ``_``→space rule as
    ``vastai.api.query.parse_query`` 1.9.1; used when the ``vastai`` package (extra ``vast``) is not installed.
    """
    import re

    pattern = (r"([a-zA-Z0-9_]+)( *[=><!]+| +(?:[lg]te?|nin|neq|eq|not ?eq|not ?in|in) )?( *)"
               r"(\[[^\]]+\]|\"[^\"]+\"|[^ ]+)?( *)")
    query = query.strip()
    opts = re.findall(pattern, query)
    if "".join("".join(x) for x in opts) != query:
        raise ValueError("unconsumed text; quote the whole query")
    res: dict[str, dict[str, Any]] = {}
    for field, op, _, value, _ in opts:
        value = value.strip(",[]")
        op_name = QUERY_OPS.get(op.strip())
        field = QUERY_ALIAS.get(field, field)
        if not op_name:
            raise ValueError(f"unknown operator {op.strip()!r} after {field!r}")
        v: Any = value
        if op_name in ("in", "notin"):
            v = [x.strip() for x in value.split(",") if x.strip()]
        if not v:
            raise ValueError(f"blank value for {field!r}")
        if v in ("?", "*", "any"):
            if op_name != "eq":
                raise ValueError("a wildcard only makes sense with =")
            res.pop(field, None)
            continue
        if isinstance(v, list):
            v = [x.replace("_", " ").strip('"') for x in v]
        else:
            v = v.replace("_", " ").strip('"')
        if field in QUERY_MULT:
            v = float(v) * QUERY_MULT[field]
        elif v in ("true", "True"):
            v = True
        elif v in ("false", "False"):
            v = False
        elif v in ("None", "null"):
            v = None
        res.setdefault(field, {})[op_name] = v
    return res


def parse_vast_query(query: str) -> dict[str, dict[str, Any]]:
    """Parse a native Vast.ai query string (``"reliability>0.98 inet_up>=200 gpu_name in [RTX_4090,RTX_3090]"``).

    Uses the ``vastai`` package's own parser when installed (extra ``vast``), else the same grammar re-implemented
    here; either way numeric values are then sent as JSON numbers (the CLI parser leaves them as strings), except
    for string fields (``gpu_name``, ``geolocation`` ...).  ``gpu_ram``/``cpu_ram`` values are GB (×1000 → MB).
    Raises BadInput on a malformed string.
    """
    try:
        try:
            from vastai.api.query import offers_alias, offers_fields, offers_mult, parse_query
        except ImportError:
            parsed = _parse_query_fallback(query)
        else:
            import contextlib
            import io

            with contextlib.redirect_stderr(io.StringIO()):  # "Unrecognized field" warnings
                parsed = parse_query(query, {}, offers_fields, offers_alias, offers_mult)
    except ValueError as exc:
        raise BadInput(f"vast query {query!r}: {exc}",
                       hint="use Vast's syntax: 'field op value' terms, e.g. 'reliability>0.98 inet_up>=200 "
                            "gpu_name in [RTX_4090,RTX_3090]'") from None
    out: dict[str, dict[str, Any]] = {}
    for field, ops in (parsed or {}).items():
        if not isinstance(ops, dict):
            continue
        if field in STRING_FIELDS:
            out[field] = dict(ops)
        else:
            out[field] = {op: ([_number(x) for x in v] if isinstance(v, list) else _number(v)) for op, v in ops.items()}
    return out


#: query field -> how to read it from a snapshot Offer (the snapshot knows no more of a host than these); memory in
#: MB as the query's (GB x 1000) values are
SNAPSHOT_FIELDS: dict[str, Any] = {
    "num_gpus": lambda o: o.gpu_count, "gpu_name": lambda o: o.gpu_name,
    "gpu_ram": lambda o: o.gpu_mem_gib * 1000, "gpu_total_ram": lambda o: o.gpu_mem_gib * o.gpu_count * 1000,
    "dph_total": lambda o: o.usd_per_hour, "geolocation": lambda o: o.region or "",
}


def _holds(value: Any, op: str, want: Any) -> bool:
    if op in ("in", "notin"):
        wanted = [str(w).lower() for w in (want if isinstance(want, list) else [want])]
        inside = str(value).lower() in wanted or any(w in str(value).lower() for w in wanted)
        return inside if op == "in" else not inside
    if isinstance(value, str) or isinstance(want, str):
        a, b = str(value).lower(), str(want).lower()
        return {"eq": a == b, "neq": a != b}.get(op, False)
    return {"gt": value > want, "gte": value >= want, "lt": value < want, "lte": value <= want,
            "eq": value == want, "neq": value != want}.get(op, False)


def filter_snapshot(offers: list[Offer], query: dict[str, dict[str, Any]], text: str) -> list[Offer]:
    """``offers`` (snapshot, no API key) that meet a parsed ``--vast-query`` (:func:`parse_vast_query`).  Raises
    BadInput naming the fields the snapshot cannot answer (``reliability``, ``inet_up`` ...): an offline plan
    never pretends a filter was applied."""
    unknown = [f for f in query if f not in SNAPSHOT_FIELDS]
    if unknown:
        raise BadInput(f"--vast-query {text!r}: {', '.join(unknown)} cannot be checked without a Vast API key (the "
                       f"price snapshot knows only {', '.join(SNAPSHOT_FIELDS)})",
                       hint="set VAST_API_KEY to search live offers, or leave those terms out of --vast-query")
    return [o for o in offers if all(_holds(SNAPSHOT_FIELDS[f](o), op, want)
                                     for f, ops in query.items() for op, want in ops.items())]


def vast_gpu_names(names: list[str]) -> list[str]:
    """Vast.ai spellings for the user's GPU names: ``RTX_4090`` → ``RTX 4090``; ``H100`` → every H100 variant."""
    out: list[str] = []
    for n in names:
        n = " ".join(n.replace("_", " ").split())
        for v in [n, *GPU_NAME_VARIANTS.get(n.upper(), [])]:
            if v not in out:
                out.append(v)
    return out



def disk_short(disk_space: Any, disk_gib: float) -> bool:
    """Whether a host's / instance's ``disk_space`` (GB) is below the asked ``disk_gib`` (unknown = not short)."""
    if not isinstance(disk_space, (int, float)) or isinstance(disk_space, bool) or not disk_gib:
        return False
    return float(disk_space) < float(disk_gib) * (1 - DISK_TOLERANCE)


def offer_rows(data: Any, call: str) -> list[dict[str, Any]]:
    """The rows of a ``/bundles/`` answer, ``{"offers": [{...}, ...]}``; anything else is a ProviderError."""
    rows = data.get("offers") if isinstance(data, dict) else None
    expect(data, call, '{"offers": [...]}', isinstance(rows, list) and all(isinstance(o, dict) for o in rows))
    return rows  # type: ignore[return-value]


def _bid_attrs(row: dict[str, Any], dph_total: float, now: datetime) -> dict[str, Any]:
    """The interruptible price of one ``/bundles/`` row (:mod:`broker.plan.interruptible` attrs): ``min_bid``
    ("current minimum bid price in $/hr for interruptible") plus the row's other charges, ``dph_total - dph_base``
    (storage: a bid does not lower it); {} without a positive ``min_bid``."""
    mb = row.get("min_bid")
    if not isinstance(mb, (int, float)) or isinstance(mb, bool) or not mb > 0:
        return {}
    base = row.get("dph_base")
    extra = max(0.0, dph_total - float(base)) if isinstance(base, (int, float)) and not isinstance(base, bool) else 0.0
    return {"min_bid": float(mb), "interruptible_usd_per_hour": round(float(mb) + extra, 6),
            "interruptible_price_source": f"live Vast.ai min_bid {now.strftime('%Y-%m-%d %H:%M UTC')}"}


def offer_from_row(row: dict[str, Any], now: datetime | None = None,
                   bids: dict[str, dict[str, Any]] | None = None) -> Offer | None:
    """One ``/bundles/`` row → Offer (None when a required field is missing).  ``bids``: the rows of the
    interruptible (``type: "bid"``) search by offer id: the offer's interruptible price comes from its row there
    (none when it is not listed there); without ``bids`` (no interruptible search) the row's own ``min_bid``.

    Units: ``gpu_ram``/``cpu_ram`` MB → GiB (/1024); ``dph_total`` $/h for the whole host *including* storage at
    the searched ``allocated_storage``; ``storage_cost`` $/GB/month; ``inet_*_cost`` $/GB; ``disk_space`` GB.
    """
    now = now or utcnow()
    try:
        n = int(row["num_gpus"])
        gpu = str(row["gpu_name"])
        price = float(row["dph_total"])
        oid = str(row["id"])
    except (KeyError, TypeError, ValueError):
        return None
    attrs_keys = ("machine_id", "host_id", "reliability", "reliability2", "inet_up", "inet_down", "inet_up_cost",
                  "inet_down_cost", "cuda_max_good", "driver_version", "verification", "direct_port_count",
                  "dph_base", "disk_space", "duration", "dlperf", "compute_cap", "public_ipaddr", "static_ip")
    attrs = {k: row[k] for k in attrs_keys if row.get(k) is not None}
    # per-GB bandwidth, seen from the renter: what reaches the node (staging) is the host's download
    # (``inet_down_cost``), what leaves it (artifacts, checkpoint copies) its upload (``inet_up_cost``)
    for key, field_ in (("transfer_in_usd_per_gb", "inet_down_cost"), ("transfer_out_usd_per_gb", "inet_up_cost")):
        v = row.get(field_)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            attrs[key] = float(v)
    if bids is None:
        attrs.update(_bid_attrs(row, price, now))
    elif str(row.get("id")) in bids:
        bid_row = bids[str(row.get("id"))]
        try:
            attrs.update(_bid_attrs(bid_row, float(bid_row["dph_total"]), now))
        except (KeyError, TypeError, ValueError):
            pass  # a bid row without a readable price: no interruptible price for this offer
    return Offer(
        provider=PROVIDER, offer_id=oid, instance_type=f"{n}x {gpu}", region=row.get("geolocation") or None,
        gpu_name=gpu, gpu_count=n, gpu_mem_gib=round(float(row.get("gpu_ram") or 0) / 1024, 2),
        vcpus=float(row.get("cpu_cores_effective") or row.get("cpu_cores") or 0),
        ram_gib=round(float(row.get("cpu_ram") or 0) / 1024, 2), usd_per_hour=price,
        # dph_total already prices the searched disk (allocated_storage = the recipe's disk_gib): storage must not
        # be added again, so the Offer carries none; the host's storage_cost stays visible in attrs
        storage_usd_per_gib_month=0.0, min_billed_seconds=1.0, private_network=False,
        price_source=f"live Vast.ai /api/v0/bundles/ {now.strftime('%Y-%m-%d %H:%M UTC')}", price_time=now,
        attrs={**attrs, "dph_includes_storage": True, "storage_cost": float(row.get("storage_cost") or 0.0)})


class VastOffers:
    """The read-side verbs of :class:`broker.providers.vast.VastProvider` (mixed in; uses ``self.api``, a
    :class:`~broker.providers.vast.client.VastClient`, and the search defaults set by the provider)."""

    api: "VastClient"
    min_reliability: float
    min_inet_mbps: float
    min_cuda: float
    limit: int
    _last_source: str | None

    def search_query(self, req: Requirements, vast_query: str | None = None,
                     offer_type: str = "on-demand") -> dict[str, Any]:
        """The ``POST /api/v0/bundles/`` body for ``req``: one host with ``nodes × gpus_per_node`` GPUs or more
        and at least ``req.disk_gib`` of disk.

        Units: ``gpu_ram`` MB per GPU (GiB × 1024), ``inet_up``/``inet_down`` Mbit/s, ``reliability`` 0-1,
        ``duration`` seconds, ``disk_space`` GB, ``allocated_storage`` GiB (so ``dph_total`` includes the
        recipe's disk).  ``vast_query`` (native syntax) replaces the default filter of each field it names.
        ``offer_type``: ``"on-demand"`` or ``"bid"`` (interruptible offers, as ``vastai search offers --type bid``).
        """
        q: dict[str, Any] = {
            "num_gpus": {"gte": int(req.nodes * req.gpus_per_node)},
            "gpu_ram": {"gte": round(req.gpu_mem_floor_gib * 1024)},
            "reliability": {"gte": self.min_reliability},
            "inet_up": {"gte": self.min_inet_mbps},
            "inet_down": {"gte": self.min_inet_mbps},
            "cuda_max_good": {"gte": self.min_cuda},
            "direct_port_count": {"gte": 1},
            "disk_space": {"gte": float(req.disk_gib)},  # a host offering less cannot give the recipe's disk
            "verified": {"eq": True},
            "rentable": {"eq": True},
            "rented": {"eq": False},
            "external": {"eq": False},
        }
        if req.gpu_names:
            q["gpu_name"] = {"in": vast_gpu_names(req.gpu_names)}
        if req.hours:
            q["duration"] = {"gte": round(req.hours * 3600)}  # the host must stay listed past the deadline
        if vast_query:
            q.update(parse_vast_query(vast_query))
        q["order"] = [["dph_total", "asc"]]
        q["type"] = offer_type
        q["limit"] = int(self.limit)
        q["allocated_storage"] = float(req.disk_gib)
        return q

    def search(self, query: dict[str, Any], call: str = SEARCH_CALL) -> list[dict[str, Any]]:
        """The rows of one ``/bundles/`` search (fail closed on an unknown answer shape)."""
        r = self.api.request("POST", "/api/v0/bundles/", call, json_body=query, rate_interval_s=SEARCH_INTERVAL_S)
        return offer_rows(self.api.json(r, call), call)

    def offers(self, req: Requirements, vast_query: str | None = None) -> list[Offer]:
        """Live offers (``POST /api/v0/bundles/``, cheapest first) when a key is configured, else the shipped
        snapshot (``broker.plan.catalog.snapshot_offers``; [] when that module is absent).

        With a key configured there is no silent fallback: a snapshot offer cannot be rented, so a failed live
        search raises (never a silent fallback to the snapshot's stale offers) and the error says what to do (rate limit: when to retry; ``--offline``
        plans from the snapshot).  ``vast_query``: Vast's native query string, merged over the defaults (see
        :meth:`search_query`).  Raises AuthError (key rejected), TransientError (429 / 5xx after retries,
        network), ProviderError (other refusals, an unreadable answer), BadInput (malformed ``vast_query``).
        """
        if req.topology in ("multi-node", "local"):
            return []  # Vast hosts share no private network; only "simulated" is offered
        if not self.api.key():
            if vast_query:  # parsed (and refused when malformed) before anything else, as a live search would
                return filter_snapshot(self._snapshot(req), parse_vast_query(vast_query), vast_query)
            return self._snapshot(req)
        return self.live_offers(req, vast_query)

    def live_offers(self, req: Requirements, vast_query: str | None = None) -> list[Offer]:
        """Offers from a live search only (no snapshot fallback); hosts whose ``disk_space`` is below
        ``req.disk_gib`` are dropped even when the server ignored the filter.

        Raises AuthError, TransientError (429/5xx after retries, network), ProviderError, BadInput.
        """
        rows = self.search(self.search_query(req, vast_query))
        # interruptible prices come from Vast's own interruptible search (``type: "bid"``), never from the
        # on-demand rows; only asked for when the recipe may rent interruptible capacity (searches are rate-limited)
        bids: dict[str, dict[str, Any]] | None = None
        if getattr(req, "interruptible", "false") != "false":
            bids = {str(r.get("id")): r for r in self.search(self.search_query(req, vast_query, "bid"),
                                                               f"{SEARCH_CALL} type bid")}
        now = utcnow()
        self._last_source = "live"
        with gc_paused():  # a market answer can hold many thousand offers (they form no reference cycles)
            return [o for o in (offer_from_row(row, now, bids) for row in rows
                                if not disk_short(row.get("disk_space"), req.disk_gib))
                    if o is not None]

    def _snapshot(self, req: Requirements) -> list[Offer]:
        try:
            from broker.plan.catalog import snapshot_offers
        except ImportError:
            self._last_source = "snapshot (not installed)"
            return []
        offers = list(snapshot_offers("vast", req))
        if offers:
            self._last_source = f"snapshot {min(o.price_time for o in offers).date().isoformat()}"
        else:
            self._last_source = "snapshot"
        return offers

    def capacity(self, offers: list[Offer]) -> list[Capacity]:
        """A live offer is one rentable host right now (AVAILABLE, count 1); snapshot offers are UNKNOWN."""
        out = []
        for o in offers:
            if o.provider != PROVIDER:
                continue
            live = o.price_source.startswith("live")
            out.append(Capacity(provider=PROVIDER, region=o.region, instance_type=o.instance_type,
                                status="AVAILABLE" if live else "UNKNOWN", available_count=1 if live else None,
                                source=o.price_source))
        return out

    def price_note(self) -> str | None:
        """Where Vast prices come from: ``vast: live offers ...`` with a key, else ``vast: snapshot <date>; live
        quote needs VAST_API_KEY``."""
        if self.api.key():
            return "vast: live offers (Vast.ai /api/v0/bundles/, storage for the recipe's disk included)"
        src = self._last_source if (self._last_source or "").startswith("snapshot ") else None
        if src is None:  # no snapshot offer matched this job: still name the snapshot's date
            try:
                from broker.plan.catalog import snapshot_info

                src = f"snapshot {snapshot_info('vast')[0]}"
            except (ImportError, FileNotFoundError):
                src = "snapshot"
        return f"vast: {src}; live quote needs VAST_API_KEY"
