"""Which EC2 Service Quotas code counts an instance type's vCPUs (on-demand and spot, per family): the one table for
the adapter's quota reads, its quota errors and :func:`broker.plan.quota.limit_for` (through
:meth:`broker.providers.aws.AWSProvider.quota_limit`).  Stdlib only.
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


AWS_QUOTA_CODES: dict[str, AwsQuotaCode] = {q.code: q for q in (
    AwsQuotaCode("L-DB2E81BA", "Running On-Demand G and VT instances", "G", "on-demand"),
    AwsQuotaCode("L-417A185B", "Running On-Demand P instances", "P", "on-demand"),
    AwsQuotaCode("L-3819A6DF", "All G and VT Spot Instance Requests", "G", "spot"),
    AwsQuotaCode("L-7212CCBC", "All P Spot Instance Requests", "P", "spot"),
    AwsQuotaCode("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", "standard",
                 "on-demand"),
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
    """The EC2 quota that counts ``instance_type``'s vCPUs (on-demand unless ``spot``); None for non-GPU types."""
    fam = aws_family(instance_type)
    if fam is None:
        return None
    market = "spot" if spot else "on-demand"
    return next(q for q in AWS_QUOTA_CODES.values() if q.family == fam and q.market == market)
