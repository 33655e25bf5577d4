"""Cost rules: pure functions, no I/O.

Units: money in US dollars (``usd``), rates in USD per hour, durations in hours or whole seconds, disks in GiB,
storage prices in USD per GiB per month.  The planner and the CLI price every option with these functions only,
so the numbers they print and the budget checks they make agree exactly.

Billing model (sources; prices themselves live in the snapshots, see :mod:`broker.plan.catalog`):

* **Per-second billing with a minimum billed time** (``Offer.min_billed_seconds``): the billed time of one unit is
  ``max(ceil(seconds), min_billed_seconds)``.  Vast.ai bills per second with no stated minimum (docs/reference/cloud-apis.md A9);
  AWS EC2 Linux on-demand bills per second with a 60 s minimum (AWS EC2 pricing page); OCI compute bills per
  second with a one-minute minimum (Oracle "Compute pricing" FAQ).  The AWS and OCI minimums are vendor statements
  not re-checked here.
* **Storage** is billed for the same time as the unit (Vast bills storage from creation until destroy, A9):
  ``storage_usd_per_gib_month * disk_gib / 730`` USD per hour (730 hours per month, the convention of the AWS and
  OCI price lists).  Vast's ``storage_cost`` is $/GB/month; broker applies it per GiB (1.07x more conservative).
* **Setup allowance**: machines bill while they boot and pull the image, before the job starts, and while they are
  torn down.  The hard deadline therefore covers ``hours`` of job time *plus* a per-provider allowance (each
  adapter's ``setup_allowance_s`` capability, :func:`setup_allowance_seconds`).  These are broker's assumptions,
  not vendor figures: Vast.ai 10 min (docker image pull on the host), OCI 15 min (GPU VMs and bare-metal shapes
  boot slowly), AWS 10 min, local 0.
* **Worst case** = every unit billed for the whole hard deadline (job hours + allowance), storage included:
  ``sum(count * (usd_per_hour + storage_usd_per_hour) * billed_seconds / 3600)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.core.model import Offer

#: Hours in a billing month (AWS / OCI list-price convention).
HOURS_PER_MONTH = 730.0

#: Allowance for providers that are not registered (the ``Provider.setup_allowance_s`` default), in seconds.
DEFAULT_SETUP_ALLOWANCE_SECONDS = 600

#: Tolerance when turning a float duration into whole billed seconds (absorbs float noise such as 3599.9999999).
_SECONDS_EPS = 1e-6
#: Ceiling of any billed time, in seconds (2**62: ~1.5e11 years).  Durations and budgets beyond it (an infinite
#: deadline, a budget of 1e308 USD) are clamped here instead of overflowing ``int(math.ceil(...))``.
MAX_SECONDS = 1 << 62


def setup_allowance_seconds(provider: str) -> int:
    """Setup + teardown allowance in seconds for ``provider``: its adapter's ``setup_allowance_s`` capability
    (read from the registry, no adapter import), :data:`DEFAULT_SETUP_ALLOWANCE_SECONDS` for an unknown name."""
    from broker.providers import REGISTRY, capability

    if provider not in REGISTRY:
        return DEFAULT_SETUP_ALLOWANCE_SECONDS
    return int(capability(provider, "setup_allowance_s"))


def storage_usd_per_hour(storage_usd_per_gib_month: float, disk_gib: float) -> float:
    """USD per hour for ``disk_gib`` GiB at ``storage_usd_per_gib_month`` $/GiB/month (730 h per month)."""
    return storage_usd_per_gib_month * disk_gib / HOURS_PER_MONTH


def unit_rate_usd_per_hour(usd_per_hour: float, storage_usd_per_gib_month: float, disk_gib: float) -> float:
    """USD per hour of one unit (instance / Vast host) including its disk."""
    return usd_per_hour + storage_usd_per_hour(storage_usd_per_gib_month, disk_gib)


def billed_seconds(seconds: float, min_billed_seconds: float = 0.0) -> int:
    """Whole seconds billed for running ``seconds``: per-second billing rounded up, at least the minimum."""
    if not seconds <= MAX_SECONDS:  # inf (an unbounded deadline) or beyond: clamp, never OverflowError
        seconds = MAX_SECONDS
    s = math.ceil(seconds - _SECONDS_EPS) if seconds > 0 else 0
    return min(max(int(s), int(math.ceil(min(min_billed_seconds, MAX_SECONDS)))), MAX_SECONDS)


def deadline_seconds(hours: float, allowance_seconds: float) -> float:
    """Seconds from creation to the hard deadline: job ``hours`` plus the setup allowance."""
    return hours * 3600.0 + allowance_seconds


def cost_usd(count: int, rate_usd_per_hour: float, seconds_billed: int) -> float:
    """Cost of ``count`` identical units at ``rate_usd_per_hour`` each for ``seconds_billed`` whole seconds.

    The one formula every caller uses (same float operations in the same order, so budget checks agree)."""
    return count * rate_usd_per_hour * seconds_billed / 3600.0


def _groups(offers: "Offer | Sequence[Offer]", disk_gib: float) -> list[tuple[float, int, int]]:
    """Group units as (rate $/h incl. storage, min billed s, count), sorted for a deterministic sum."""
    seq = [offers] if not isinstance(offers, (list, tuple)) else list(offers)
    counts: dict[tuple[float, int], int] = {}
    for o in seq:
        k = (unit_rate_usd_per_hour(o.usd_per_hour, o.storage_usd_per_gib_month, disk_gib),
             int(math.ceil(o.min_billed_seconds)))
        counts[k] = counts.get(k, 0) + 1
    return sorted((r, m, c) for (r, m), c in counts.items())


def _allowance(offers: "Offer | Sequence[Offer]", allowance_seconds: float | None) -> float:
    if allowance_seconds is not None:
        return allowance_seconds
    seq = [offers] if not isinstance(offers, (list, tuple)) else list(offers)
    return max((setup_allowance_seconds(o.provider) for o in seq), default=0)


def _cost_at(groups: Iterable[tuple[float, int, int]], seconds: float) -> float:
    return sum(cost_usd(c, r, billed_seconds(seconds, m)) for r, m, c in groups)


def worst_case_usd(offers: "Offer | Sequence[Offer]", hours: float, disk_gib: float = 0.0,
                   allowance_seconds: float | None = None) -> float:
    """Worst-case USD if every unit in ``offers`` bills until the hard deadline.

    ``offers``: one Offer (a simulated host) or the N offers of a multi-node option (repeat an offer to rent it
    N times).  ``hours``: job time until the hard deadline.  ``disk_gib``: disk per unit.  ``allowance_seconds``:
    setup allowance (default: the largest :func:`setup_allowance_seconds` among the offers' providers).
    """
    groups = _groups(offers, disk_gib)
    return _cost_at(groups, deadline_seconds(hours, _allowance(offers, allowance_seconds)))


def max_billed_seconds(budget_usd: float, count: int, rate_usd_per_hour: float, min_billed_seconds: float = 0.0) -> int:
    """The largest whole number of billed seconds S with ``cost_usd(count, rate, max(S, min)) <= budget_usd``.

    Returns -1 when even the minimum billed time does not fit; a very large number (2**62) for a free unit.
    Closed form plus an exact fix-up with :func:`cost_usd`, so the result never exceeds the budget by float noise.
    """
    if count <= 0 or rate_usd_per_hour <= 0:
        return 1 << 62
    m = int(math.ceil(min(min_billed_seconds, MAX_SECONDS)))
    if cost_usd(count, rate_usd_per_hour, m) > budget_usd:
        return -1
    s_float = budget_usd * 3600.0 / (count * rate_usd_per_hour)
    if not s_float < MAX_SECONDS:  # an infinite / astronomically large budget: clamp, never OverflowError
        return MAX_SECONDS
    if s_float >= 2.0**52:  # beyond float's whole-second resolution the +-1 fix-up below would never end
        return int(s_float)
    s = int(math.floor(s_float))
    while s > m and cost_usd(count, rate_usd_per_hour, s) > budget_usd:
        s -= 1
    while cost_usd(count, rate_usd_per_hour, s + 1) <= budget_usd:
        s += 1
    return max(s, m)


def max_hours_within(budget_usd: float, offers: "Offer | Sequence[Offer]", disk_gib: float = 0.0,
                     allowance_seconds: float | None = None) -> float:
    """The longest job time in hours whose :func:`worst_case_usd` fits ``budget_usd``.

    Whole seconds (per-second billing).  ``math.inf`` for free offers; ``0.0`` when the budget does not even cover
    the setup allowance and minimum billed time (callers treat < 1 minute as "does not fit").
    """
    groups = _groups(offers, disk_gib)
    allowance = _allowance(offers, allowance_seconds)
    if all(r <= 0 for r, _, _ in groups):
        return math.inf
    if len(groups) == 1:
        r, m, c = groups[0]
        s = max_billed_seconds(budget_usd, c, r, m)
    else:  # mixed units: binary search the monotone cost over whole seconds
        if _cost_at(groups, 0) > budget_usd:
            return 0.0
        lo, hi = 0, 1
        while _cost_at(groups, hi) <= budget_usd:
            if hi >= MAX_SECONDS:  # the budget outlasts any deadline
                return max(0.0, (MAX_SECONDS - allowance) / 3600.0)
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _cost_at(groups, mid) <= budget_usd:
                lo = mid
            else:
                hi = mid
        s = lo
    if s < 0:
        return 0.0
    return max(0.0, (s - allowance) / 3600.0)


#: Offer.attrs keys of an offer's bandwidth prices, USD per GB into / out of a rented unit
TRANSFER_IN_ATTR, TRANSFER_OUT_ATTR = "transfer_in_usd_per_gb", "transfer_out_usd_per_gb"


def transfer_usd(attrs: dict, in_gb: float, out_gb: float) -> float:
    """USD one rented unit pays for moving ``in_gb`` GB to it and ``out_gb`` GB from it at the offer's per-GB
    rates (``attrs`` :data:`TRANSFER_IN_ATTR` / :data:`TRANSFER_OUT_ATTR`; 0 where the offer names none)."""
    usd = 0.0
    for key, gb in ((TRANSFER_IN_ATTR, in_gb), (TRANSFER_OUT_ATTR, out_gb)):
        rate = attrs.get(key)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0 and gb > 0:
            usd += float(rate) * float(gb)
    return usd
