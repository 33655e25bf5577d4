"""GCP quota increase requests through the Cloud Quotas API (``QuotaPreference``), and the console form when
there are no credentials (or ``--draft``).

A Compute metric maps to a Cloud Quotas ``quotaId``: ``NVIDIA_T4_GPUS`` -> ``NVIDIA-T4-GPUS-per-project-region``
(dimension ``region``), ``GPUS_ALL_REGIONS`` -> ``GPUS-ALL-REGIONS-per-project`` (no dimension).  The rule is a
heuristic seen in public use (docs/reference/gcp-fixtures.md).  Google keeps one ``QuotaPreference`` per quota and
dimensions: an open one (``reconciling``) asking at least as much is returned as it is; any other one for the same
quota and region (decided, or asking less) is changed with ``UpdateQuotaPreference`` (an update mask on the
preferred value, justification and contact email), never created a second time.  Increases need a contact email
(``GCP_QUOTA_CONTACT_EMAIL``).
"""

from __future__ import annotations

import math
import os
import shlex
from typing import TYPE_CHECKING

from broker.core.model import Quota
from broker.core.provider import AuthError, BadInput, ProviderError
from broker.providers.gcp.api import PROVIDER

if TYPE_CHECKING:
    from broker.core.records import QuotaRequest
    from broker.providers.gcp.api import GCPApi

SERVICE = "compute.googleapis.com"
CONSOLE = "https://console.cloud.google.com/iam-admin/quotas"
PERMISSION_HINT = ("enable the Cloud Quotas API (cloudquotas.googleapis.com) and give your account the role "
                   "roles/cloudquotas.admin; or file it in the console with the form that "
                   "`broker quota request --provider gcp --draft` prints")


def quota_id(metric: str) -> str:
    """Cloud Quotas ``quotaId`` of a Compute metric (``NVIDIA_T4_GPUS`` -> ``NVIDIA-T4-GPUS-per-project-region``)."""
    base = metric.replace("_", "-")
    return f"{base}-per-project" if metric.endswith("ALL_REGIONS") else f"{base}-per-project-region"


def state_of(pref: object) -> str:
    """PENDING while reconciling; then APPROVED (granted >= preferred), PARTIALLY_SUCCEEDED (0 < granted <
    preferred) or DENIED."""
    cfg = pref.quota_config  # type: ignore[attr-defined]
    if pref.reconciling:  # type: ignore[attr-defined]
        return "PENDING"
    granted = int(cfg.granted_value or 0) if "granted_value" in cfg else 0  # Int64Value: a plain int
    preferred = cfg.preferred_value
    if granted >= preferred:
        return "APPROVED"
    return "PARTIALLY_SUCCEEDED" if granted > 0 else "DENIED"


def request_quota(api: "GCPApi", quota: Quota, value: float, reason: str, *, draft: bool = False) -> "QuotaRequest":
    """File a QuotaPreference raising ``quota`` (a Compute metric; ``quota.region`` for regional ones) to
    ``value``.  ``draft`` or no credentials: only the console form (state ``DRAFT``) with the link and the exact
    fields.  Raises BadInput (no contact email), AuthError (API off / no permission, with the fix),
    ProviderError."""
    from broker.core.records import QuotaRequest

    new_value = int(math.ceil(value))
    qid = quota_id(quota.name)
    regional = not quota.name.endswith("ALL_REGIONS")
    region = quota.region if regional else None
    project = api.project
    email = os.environ.get("GCP_QUOTA_CONTACT_EMAIL", "")
    dims = {"region": region} if region else {}
    form = {"console": f"{CONSOLE}?project={project or 'PROJECT_ID'}", "service": SERVICE, "quotaId": qid,
            "metric": f"{SERVICE}/{quota.name.lower()}", "dimensions": dims or "(none: project-wide)",
            "preferredValue": new_value, "justification": reason,
            "contactEmail": email or "<your email (GCP_QUOTA_CONTACT_EMAIL)>",
            # pasteable: shell-quoted, and placeholders a shell reads as words (`<project>` was a redirection)
            "gcloud": (f"gcloud beta quotas preferences create --service={SERVICE} --quota-id={qid} "
                       f"--preferred-value={new_value}" + (f" --dimensions=region={region}" if region else "")
                       + f" --project={shlex.quote(project) if project else 'PROJECT_ID'}"
                       f" --justification={shlex.quote(reason)} --email={shlex.quote(email) if email else 'EMAIL'}")}
    base = QuotaRequest(provider=PROVIDER, limit_name=quota.name, region=region, scope=region, value=new_value,
                        unit=quota.unit, reason=reason, form=form)
    if draft or not api.configured():
        why = "not filed (draft)" if draft else "not filed: no GCP credentials; file it in the console"
        return base.model_copy(update={"state": "DRAFT", "message": why})
    if not email:
        raise BadInput("a GCP quota increase needs a contact email (Cloud Quotas contactEmail)",
                       hint="export GCP_QUOTA_CONTACT_EMAIL=you@example.com, or use --draft")
    from google.cloud import cloudquotas_v1 as cq
    from google.protobuf import field_mask_pb2

    qc = api.client("quotas")
    parent = f"projects/{project}/locations/global"

    def existing() -> object | None:
        # every preference (not only the open ones): Google keeps one per quota and dimensions, open or decided
        prefs = api.call("list_quota_preferences",
                         lambda: list(qc.list_quota_preferences(request={"parent": parent})))
        return next((p for p in prefs if p.quota_id == qid and dict(p.dimensions) == dims), None)

    def body(name: str = "") -> object:
        return cq.QuotaPreference(name=name, service=SERVICE, quota_id=qid, dimensions=dims,
                                  quota_config=cq.QuotaConfig(preferred_value=new_value), justification=reason,
                                  contact_email=email)

    try:
        p = existing()
        if p is not None and p.reconciling and int(p.quota_config.preferred_value) >= new_value:
            return base.model_copy(update={
                "request_id": p.name, "state": "PENDING", "value": float(p.quota_config.preferred_value),
                "message": f"an open request already exists ({p.name}); not filed again"})
        if p is None:
            pref_id = f"broker-{qid.lower()}-{region or 'global'}"[:63]
            try:
                saved = api.call("create_quota_preference", qc.create_quota_preference, parent=parent,
                                 quota_preference_id=pref_id, quota_preference=body())
                verb = "filed"
            except ProviderError as e:
                if e.status != 409:
                    raise
                p = existing()  # filed meanwhile (another broker, the console): change that one
                if p is None:
                    raise
        if p is not None:
            # the one preference of this quota and dimensions changes by patch (Cloud Quotas
            # UpdateQuotaPreference with an update mask), never by a second create
            was = int(p.quota_config.preferred_value)
            mask = field_mask_pb2.FieldMask(paths=["quota_config.preferred_value", "justification",
                                                   "contact_email"])
            saved = api.call("update_quota_preference", qc.update_quota_preference,
                             request=cq.UpdateQuotaPreferenceRequest(quota_preference=body(p.name),
                                                                     update_mask=mask))
            verb = f"updated the existing request {p.name} (preferred value {was} -> {new_value})"
    except ProviderError as e:
        if isinstance(e, AuthError) or e.status in (401, 403):
            raise AuthError(PROVIDER, e.call, f"not allowed to use the Cloud Quotas API ({e.status} {e.code})",
                            hint=PERMISSION_HINT, code=e.code, status=e.status) from None
        raise
    trace = saved.quota_config.trace_id
    return base.model_copy(update={"request_id": saved.name, "state": state_of(saved),
                                   "message": verb + (f"; trace id {trace} (quote it to support)" if trace
                                                      else "")})


def quota_request_status(api: "GCPApi", request: "QuotaRequest") -> "QuotaRequest":
    """The request refreshed with ``get_quota_preference`` (state from :func:`state_of`)."""
    if not request.request_id:
        return request
    qc = api.client("quotas")
    try:
        p = api.call("get_quota_preference", qc.get_quota_preference, name=request.request_id)
    except ProviderError as e:
        if isinstance(e, AuthError) or e.status in (401, 403):
            raise AuthError(PROVIDER, e.call, f"not allowed to read Cloud Quotas ({e.status})", hint=PERMISSION_HINT,
                            code=e.code, status=e.status) from None
        raise
    st = state_of(p)
    cfg = p.quota_config
    granted = int(cfg.granted_value or 0) if "granted_value" in cfg else 0  # Int64Value: a plain int
    detail = cfg.state_detail or ""
    return request.model_copy(update={"state": st, "message": f"{st}: granted {granted} of "
                                                             f"{cfg.preferred_value}" + (f" ({detail})" if detail
                                                                                         else "")})
