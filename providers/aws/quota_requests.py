"""AWS quota increase requests through Service Quotas (values in vCPUs): filed, an open one returned instead of a
duplicate, or drafted as the console form."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from broker.core.model import Quota
from broker.core.provider import AuthError, ProviderError
from broker.providers.aws.api import error_code, map_error, unreadable

if TYPE_CHECKING:
    from broker.providers.aws.api import AWSApi
    from broker.core.records import QuotaRequest

def quota_form(api: "AWSApi", quota: Quota, value: float, reason: str) -> dict[str, Any]:
    from broker.providers.aws.limits import AWS_QUOTA_CODES

    region = quota.region or api.region
    code = quota.name
    return {
        "service": "Amazon Elastic Compute Cloud (Amazon EC2) [ServiceCode ec2]",
        "quota_code": code,
        "quota_name": AWS_QUOTA_CODES[code].name if code in AWS_QUOTA_CODES else quota.description,
        "region": region,
        "current_value": quota.limit if quota.source != "not read" else "unknown (not read)",
        "desired_value": float(value),
        "unit": "vCPUs (not instances, not GPUs)",
        "reason": reason,
        "console": f"https://{region}.console.aws.amazon.com/servicequotas/home/services/ec2/quotas/{code}",
    }

def request_quota(api: "AWSApi", quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
    """``request_service_quota_increase(ServiceCode="ec2", QuotaCode, DesiredValue)`` (value in vCPUs).

    The Service Quotas API has no reason field: ``reason`` is kept in the ledger and the draft form (paste it
    into the support case if AWS opens one).  An open request (ResourceAlreadyExistsException) is looked up
    with ``list_requested_service_quota_change_history_by_quota`` and returned, not duplicated.
    Raises AuthError (AccessDenied: names the IAM permission), ProviderError."""
    from broker.core.records import QuotaRequest

    region = quota.region or api.region
    form = quota_form(api, quota, value, reason)
    base = dict(provider="aws", limit_name=quota.name, region=region, scope=region, value=float(value),
                unit="vcpus", reason=reason, form=form)
    if draft:
        return QuotaRequest(**base, state="DRAFT", message="not filed (draft)")
    sq = api.client("service-quotas", region)
    try:
        resp = sq.request_service_quota_increase(ServiceCode="ec2", QuotaCode=quota.name,
                                                 DesiredValue=float(value))
    except Exception as e:  # noqa: BLE001
        code, status, msg = error_code(e)
        if code == "ResourceAlreadyExistsException":
            open_req = open_request(sq, quota.name)
            if open_req is not None:
                return _to_request(open_req, base, message=(
                    f"an increase request for {quota.name} is already open (desired "
                    f"{open_req.get('DesiredValue')}); not filing a duplicate"))
            return QuotaRequest(**base, state="PENDING", message=f"AWS says a request is already open: {msg}")
        if code in ("AccessDeniedException", "DependencyAccessDeniedException"):
            raise AuthError("aws", "request_service_quota_increase", f"{code}: {msg}", code=code, status=status,
                            hint="the IAM identity needs servicequotas:RequestServiceQuotaIncrease (and, for "
                                 "the AWS-opened support case, support:CreateCase); or use --draft and file "
                                 "it in the console") from None
        if code == "QuotaExceededException":
            raise ProviderError("aws", "request_service_quota_increase", f"{code}: {msg}", code=code,
                                hint="too many open quota requests: wait for the open ones "
                                     "(`broker quota status`)") from None
        if code in ("IllegalArgumentException", "InvalidResourceStateException", "NoSuchResourceException"):
            raise ProviderError("aws", "request_service_quota_increase", f"{code}: {msg}", code=code,
                                hint=f"check --limit {quota.name} (EC2 quota code) and --value (vCPUs, above "
                                     "the current value)") from None
        raise map_error(e, "request_service_quota_increase", region=region) from None
    return _to_request(_requested("request_service_quota_increase", resp), base)

def open_request(sq: Any, code: str) -> dict[str, Any] | None:
    try:
        resp = sq.list_requested_service_quota_change_history_by_quota(ServiceCode="ec2", QuotaCode=code)
    except Exception as e:  # noqa: BLE001
        raise map_error(e, "list_requested_service_quota_change_history_by_quota") from None
    reqs = [r for r in resp.get("RequestedQuotas", []) if r.get("Status") in ("PENDING", "CASE_OPENED")]
    return max(reqs, key=lambda r: str(r.get("Created", ""))) if reqs else None

def quota_request_status(api: "AWSApi", request: QuotaRequest) -> QuotaRequest:
    """``get_requested_service_quota_change(RequestId)``: PENDING / CASE_OPENED / APPROVED / DENIED /
    CASE_CLOSED / NOT_APPROVED / INVALID_REQUEST."""
    if not request.request_id:
        return request
    sq = api.client("service-quotas", request.region)
    try:
        resp = sq.get_requested_service_quota_change(RequestId=request.request_id)
    except Exception as e:  # noqa: BLE001
        raise map_error(e, "get_requested_service_quota_change", region=request.region) from None
    base = request.model_dump(exclude={"request_id", "state", "message", "created_at"})
    return _to_request(_requested("get_requested_service_quota_change", resp), base)


_STATE_WORDS = {
    "PENDING": "filed, waiting for AWS", "CASE_OPENED": "AWS opened a support case (reply there if asked)",
    "APPROVED": "approved: the new limit applies", "DENIED": "denied: open a support case with a longer "
    "justification or ask for less", "NOT_APPROVED": "not approved: see the support case",
    "CASE_CLOSED": "support case closed", "INVALID_REQUEST": "invalid request (value or quota code)",
}


def _to_request(rq: dict[str, Any], base: dict[str, Any], message: str | None = None) -> QuotaRequest:
    from broker.core.records import QuotaRequest

    state = str(rq.get("Status") or "PENDING")
    msg = message or _STATE_WORDS.get(state, state)
    if rq.get("CaseId"):
        msg += f" (support case {rq['CaseId']})"
    fields = dict(base)
    if rq.get("DesiredValue") is not None:
        fields["value"] = float(rq["DesiredValue"])
    created = rq.get("Created")
    return QuotaRequest(**fields, request_id=rq.get("Id"), state=state, message=msg,
                        created_at=created if isinstance(created, datetime) else None)


def _requested(call: str, resp: Any) -> dict[str, Any]:
    rq = resp.get("RequestedQuota") if isinstance(resp, dict) else None
    if not isinstance(rq, dict):
        raise unreadable(call, "no RequestedQuota object")
    return rq
