"""OCI quota (limit) increase requests: ``LimitsIncreaseClient`` (questionnaire answered, open requests not
duplicated) and the console form for ``--draft``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from broker.core.model import Quota
from broker.core.provider import AuthError, ProviderError
from broker.providers.oci.sdk import PROVIDER

if TYPE_CHECKING:
    from broker.providers.oci.sdk import OCIApi
    from broker.core.records import QuotaRequest

OPEN_STATES = ("ACCEPTED", "IN_PROGRESS")
POLICY_HINT = ("your OCI user's group needs an IAM policy that allows filing limit increase requests in the "
                "tenancy (ask the tenancy administrator); or file it in the Console (Governance & "
                "Administration > Limits, Quotas and Usage > Request a service limit update) with the form "
                "that `broker quota request --provider oci --draft` prints")

def quota_auth(e: ProviderError, call: str) -> ProviderError:
    if isinstance(e, AuthError) or e.status in (401, 403, 404):
        return AuthError(PROVIDER, call, f"not allowed to use the Limits Increase API ({e.status} {e.code})",
                         hint=POLICY_HINT, code=e.code, status=e.status)
    return e

def request_quota(api: "OCIApi", quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
    """File an increase of ``quota`` (an OCI ``compute`` limit, AD scope in ``quota.scope``) to ``value`` GPUs.

    ``draft``: only fill in the console form (state ``DRAFT``).  Otherwise an already-open item request for
    the same limit, region and scope (ACCEPTED / IN_PROGRESS) is returned instead of filing a duplicate; the
    required questions of ``list_limits_increase_questions`` are answered (TEXT: the reason; NUMBER: the value;
    RADIO/CHECKBOX: the first option offered); then ``create_limits_increase_request``.

    Raises AuthError (missing IAM permission, with the fix), ProviderError.
    """
    from broker.core.records import QuotaRequest

    new_value = int(math.ceil(value))
    region = quota.region or api.region
    scope = quota.scope
    form = {"service": "compute", "limit": quota.name, "region": region, "scope (availability domain)": scope,
            "value (new limit, GPUs)": new_value, "reason": reason,
            "console": "Governance & Administration > Limits, Quotas and Usage > Request a service limit update"}
    base = QuotaRequest(provider=PROVIDER, limit_name=quota.name, region=region, scope=scope, value=new_value,
                        unit="gpus", reason=reason, form=form)
    if draft:
        return base.model_copy(update={"state": "DRAFT", "message": "not filed (draft)"})
    import oci

    lm = oci.limits_increase.models
    ic = api.client("increase")
    tenancy = api.tenancy
    try:
        items = api.all_pages("list_limits_increase_item_requests", ic.list_limits_increase_item_requests, tenancy,
                          service="compute")
        for it in items:
            if (it.limit_name == quota.name and it.lifecycle_state in OPEN_STATES
                    and (not region or not it.region or it.region == region)
                    and (not scope or not it.scope or it.scope == scope)):
                return base.model_copy(update={
                    "request_id": it.limits_increase_request_id, "state": it.lifecycle_state,
                    "value": float(it.value if it.value is not None else new_value), "created_at": it.time_created,
                    "message": f"an open request already exists ({it.lifecycle_state}); not filed again"})
        questions = api.all_pages("list_limits_increase_questions", ic.list_limits_increase_questions, tenancy,
                              service_name="compute", limit_name=quota.name)
        answers = []
        for q in questions:
            if not q.is_required:
                continue
            if q.question_type == "NUMBER":
                ans = str(new_value)
            elif q.question_type in ("RADIO", "CHECKBOX") and q.options:
                ans = next(iter(q.options))
            else:
                ans = reason
            answers.append(lm.LimitsIncreaseItemQuestionRequest(id=q.id, question_response=ans))
        details = lm.CreateLimitsIncreaseRequestDetails(
            display_name=f"broker: {quota.name} to {new_value} in {scope or region}", compartment_id=tenancy,
            justification=reason, limits_increase_item_requests=[lm.CreateLimitsIncreaseItemRequestDetails(
                service_name="compute", limit_name=quota.name, region=region, value=new_value, scope=scope,
                questionnaire_response=answers or None)])
        created = api.call("create_limits_increase_request", ic.create_limits_increase_request, details).data
    except ProviderError as e:
        raise quota_auth(e, e.call) from None
    return base.model_copy(update={"request_id": created.id, "state": created.lifecycle_state,
                                   "created_at": created.time_created,
                                   "message": f"filed; {len(answers)} required question(s) answered"})

def quota_request_status(api: "OCIApi", request: QuotaRequest) -> QuotaRequest:
    """The request refreshed with ``get_limits_increase_request`` (state = its lifecycle_state)."""
    if not request.request_id:
        return request
    ic = api.client("increase")
    try:
        r = api.call("get_limits_increase_request", ic.get_limits_increase_request, request.request_id).data
    except ProviderError as e:
        raise quota_auth(e, "get_limits_increase_request") from None
    items = ", ".join(f"{i.limit_name} {i.lifecycle_state}" for i in (r.limits_increase_item_requests or []))
    return request.model_copy(update={"state": r.lifecycle_state,
                                       "message": f"{r.lifecycle_state}" + (f" ({items})" if items else "")})
