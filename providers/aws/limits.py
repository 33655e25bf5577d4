"""Which EC2 Service Quotas code counts an instance type's vCPUs (on-demand and spot, per family): the one table for
the adapter's quota reads, its quota errors and :func:`broker.plan.quota.limit_for` (through
:meth:`broker.providers.aws.AWSProvider.quota_limit`).  Stdlib only.

Codes and names as Service Quotas lists them (docs/reference/cloud-apis.md C1): P spot is split by generation,
``L-7212CCBC`` "All P4, P3 and P2 Spot Instance Requests" and ``L-C4BD4855`` "All P5 Spot Instance Requests"; a P
generation neither names (p6...) has no code here, so a quota error on it says so instead of naming a quota that
would not help.  ``usage_class`` is the CloudWatch ``AWS/Usage`` ``Class`` dimension of the same quota (the
quota's own ``UsageMetric``, when Service Quotas returns one, wins over it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class AwsQuotaCode:
    """One EC2 Service Quotas code (values in vCPUs)."""

    code: str
    name: str
    family: Literal["G", "P", "standard"]
    market: Literal["on-demand", "spot"]
    #: CloudWatch ``AWS/Usage`` ``ResourceCount`` dimension ``Class`` (``G/OnDemand``, ``Standard/OnDemand``...)
    usage_class: str = ""
    #: instance-type prefixes this code counts when the family is split by generation (empty: the whole family)
    prefixes: tuple[str, ...] = ()


AWS_QUOTA_CODES: dict[str, AwsQuotaCode] = {q.code: q for q in (
    AwsQuotaCode("L-DB2E81BA", "Running On-Demand G and VT instances", "G", "on-demand", "G/OnDemand"),
    AwsQuotaCode("L-417A185B", "Running On-Demand P instances", "P", "on-demand", "P/OnDemand"),
    AwsQuotaCode("L-3819A6DF", "All G and VT Spot Instance Requests", "G", "spot", "G/Spot"),
    AwsQuotaCode("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests", "P", "spot", "P/Spot",
                 ("p2", "p3", "p3dn", "p4d", "p4de")),
    AwsQuotaCode("L-C4BD4855", "All P5 Spot Instance Requests", "P", "spot", "P/Spot", ("p5", "p5e", "p5en")),
    AwsQuotaCode("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", "standard",
                 "on-demand", "Standard/OnDemand"),
)}

#: instance-type prefix (the part before the dot) -> quota family.
_AWS_FAMILY_PREFIX = {"g4dn": "G", "g4ad": "G", "g5": "G", "g5g": "G", "g6": "G", "g6e": "G", "gr6": "G",
                      "vt1": "G", "p2": "P", "p3": "P", "p3dn": "P", "p4d": "P", "p4de": "P", "p5": "P",
                      "p5e": "P", "p5en": "P"}


def aws_family(instance_type: str) -> str | None:
    """``"G"`` (G and VT), ``"P"`` or None (not a GPU family) from the instance-type prefix."""
    prefix = instance_type.split(".", 1)[0].lower()
    if prefix in _AWS_FAMILY_PREFIX:
        return _AWS_FAMILY_PREFIX[prefix]
    m = re.match(r"^(g|vt|p)\d", prefix)
    if m:
        return "P" if m.group(1) == "p" else "G"
    return None


def aws_quota_code(instance_type: str, *, spot: bool = False) -> AwsQuotaCode | None:
    """The EC2 quota that counts ``instance_type``'s vCPUs (on-demand unless ``spot``); None for non-GPU types and
    for a P generation whose spot code this table does not know."""
    fam = aws_family(instance_type)
    if fam is None:
        return None
    market = "spot" if spot else "on-demand"
    prefix = instance_type.split(".", 1)[0].lower()
    for q in AWS_QUOTA_CODES.values():
        if q.family == fam and q.market == market and (not q.prefixes or prefix in q.prefixes):
            return q
    return None
