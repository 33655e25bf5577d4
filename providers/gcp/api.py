"""GCP API client: credentials the gcloud way, the official clients (REST transport), operation polling, and the
one mapping of Google API failures to broker's errors.

Facts: ``docs/reference/gcp-fixtures.md`` (from Google's Compute, Cloud Quotas and Billing docs).  The SDKs
(``google-cloud-compute``, ``google-cloud-quotas``, ``google-cloud-billing``, ``google-auth``) are imported inside
functions only.

Credentials, in ``google.auth.default()``'s order, found without a network call:

1. the file named by ``GOOGLE_APPLICATION_CREDENTIALS``;
2. the gcloud ADC file ``$CLOUDSDK_CONFIG/application_default_credentials.json`` (else
   ``~/.config/gcloud/application_default_credentials.json``), written by ``gcloud auth application-default login``.

The project comes from ``GOOGLE_CLOUD_PROJECT`` (or the legacy ``GCLOUD_PROJECT``), else the file's ``project_id`` /
``quota_project_id``.  The metadata server (credentials of a GCE VM) is not probed: that would be a network call.
Secrets are never printed: messages name the file and its ``type``, never its contents.

Endpoints: ``GCP_COMPUTE_ENDPOINT`` / ``GCP_QUOTAS_ENDPOINT`` / ``GCP_BILLING_ENDPOINT`` (or the constructor's) point
the clients elsewhere (the test emulator); compute operations are then polled through clients built with the same
endpoint (the SDK's own ``ExtendedOperation`` would poll compute.googleapis.com).
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from broker.core.provider import (AmbiguousCreate, AuthError, CapacityError, ProviderError, QuotaError,
                                  TransientError)

PROVIDER = "gcp"
CREDENTIALS_HINT = ("run `gcloud auth application-default login` (or set GOOGLE_APPLICATION_CREDENTIALS to a "
                    "service-account key file) and set GOOGLE_CLOUD_PROJECT")


def install_hint() -> str:
    """The whole fix when the Google clients are missing: install the ``gcp`` extra (worded for how broker was
    installed: :func:`broker.core.provider.extra_install_hint`), then the credential and project steps."""
    from broker.core.provider import extra_install_hint as extra_hint

    return (extra_hint("gcp", "google-cloud-compute, google-cloud-quotas, google-auth")
            + "; then " + CREDENTIALS_HINT)
SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]

#: operation / error codes meaning "no capacity in this zone" (stockout): try the next zone, then the next option
CAPACITY_CODES = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                  "UNSUPPORTED_OPERATION", "RESOURCE_POOL_EXHAUSTED", "STOCKOUT"}
#: codes to retry after a short wait (resource busy, per-resource rate)
RETRY_CODES = {"RESOURCE_NOT_READY", "RESOURCE_OPERATION_RATE_EXCEEDED", "rateLimitExceeded",
               "resourceInUseByAnotherResource", "RESOURCE_IN_USE_BY_ANOTHER_RESOURCE"}
#: "Quota 'NVIDIA_T4_GPUS' exceeded.  Limit: 0.0 in region us-central1." / "... Limit: 0.0 globally."
QUOTA_RE = r"Quota '([A-Z0-9_]+)' exceeded\.\s+Limit:\s*([0-9.]+)\s+(?:in region ([a-z0-9-]+)|globally)"


def adc_path() -> Path:
    """Where ``gcloud auth application-default login`` writes the ADC file."""
    base = os.environ.get("CLOUDSDK_CONFIG")
    return (Path(base) if base else Path.home() / ".config" / "gcloud") / "application_default_credentials.json"


def find_credentials() -> tuple[Path | None, str]:
    """(credentials file, words naming where it came from); (None, why) when there is none.  No network."""
    env = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if env:
        p = Path(env).expanduser()
        if p.is_file():
            return p, f"GOOGLE_APPLICATION_CREDENTIALS ({p})"
        return None, f"GOOGLE_APPLICATION_CREDENTIALS names {p}, which does not exist"
    p = adc_path()
    if p.is_file():
        return p, f"application default credentials ({p})"
    return None, f"no GOOGLE_APPLICATION_CREDENTIALS and no ADC file at {p}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AuthError(PROVIDER, "read credentials", f"{path} is not a readable JSON credentials file "
                        f"({type(e).__name__})", hint=CREDENTIALS_HINT) from None
    if not isinstance(data, dict):
        raise AuthError(PROVIDER, "read credentials", f"{path} holds no JSON object", hint=CREDENTIALS_HINT)
    return data


def _endpoint(var: str, given: str | None) -> str | None:
    """An endpoint override (the constructor's, else the environment's ``var``): https, or plain http to this
    machine only (:func:`broker.core.config.check_endpoint`; raises BadInput otherwise)."""
    from broker.core.config import check_endpoint

    url = given or os.environ.get(var) or None
    return check_endpoint(var, url) if url else None


class GCPApi:
    """Credentials, clients and the error mapping for one project.

    Args: ``project`` (default ``GOOGLE_CLOUD_PROJECT`` / the credentials file); ``credentials`` (a google-auth
    credentials object: tests pass ``AnonymousCredentials()``); ``compute_endpoint`` / ``quotas_endpoint`` /
    ``billing_endpoint`` (base URLs, ``http://`` allowed); ``sleep`` for operation polls.  No I/O here."""

    def __init__(self, *, project: str | None = None, credentials: Any = None, compute_endpoint: str | None = None,
                 quotas_endpoint: str | None = None, billing_endpoint: str | None = None,
                 op_timeout_s: float = 600.0, poll_s: float = 1.0, sleep: Callable[[float], None] = time.sleep):
        self._project = project
        self._credentials = credentials
        self.compute_endpoint = _endpoint("GCP_COMPUTE_ENDPOINT", compute_endpoint)
        self.quotas_endpoint = _endpoint("GCP_QUOTAS_ENDPOINT", quotas_endpoint)
        self.billing_endpoint = _endpoint("GCP_BILLING_ENDPOINT", billing_endpoint)
        self.op_timeout_s, self.poll_s, self.sleep = op_timeout_s, poll_s, sleep
        #: seconds between the progress lines of a long operation wait
        self.progress_every_s = 30.0
        self._clients: dict[str, Any] = {}
        self.source = "credentials given to the adapter" if credentials is not None else None

    # ------------------------------------------------------------------------------------ credentials
    def credentials_file(self) -> tuple[Path | None, str]:
        return find_credentials()

    @property
    def project(self) -> str | None:
        """The project id: the constructor's, ``GOOGLE_CLOUD_PROJECT`` / ``GCLOUD_PROJECT``, else the credentials
        file's ``project_id`` / ``quota_project_id``; None when none is known."""
        if self._project:
            return self._project
        env = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT")
        if env:
            return env
        path, _ = find_credentials()
        if path is not None:
            try:
                data = _read_json(path)
            except AuthError:
                return None
            return data.get("project_id") or data.get("quota_project_id") or None
        return None

    def project_source(self) -> str:
        if self._project:
            return "given to the adapter"
        if os.environ.get("GOOGLE_CLOUD_PROJECT"):
            return "GOOGLE_CLOUD_PROJECT"
        if os.environ.get("GCLOUD_PROJECT"):
            return "GCLOUD_PROJECT"
        return "the credentials file"

    def configured(self) -> bool:
        """Credentials (given, or a file found) and a project: no network call."""
        if not self.project:
            return False
        return self._credentials is not None or find_credentials()[0] is not None

    def require_project(self, call: str) -> str:
        p = self.project
        if not p:
            raise AuthError(PROVIDER, call, "no GCP project: GOOGLE_CLOUD_PROJECT is not set and the credentials "
                            "file names none", hint="export GOOGLE_CLOUD_PROJECT=<your project id>")
        return p

    def credentials(self) -> Any:
        """The google-auth credentials: the constructor's, else loaded from the file :func:`find_credentials`
        found (``google.auth.load_credentials_from_file``, scope cloud-platform).  Raises AuthError."""
        if self._credentials is not None:
            return self._credentials
        if any((ep or "").startswith("http://") for ep in (self.compute_endpoint, self.quotas_endpoint,
                                                          self.billing_endpoint)):
            # a plain-http endpoint (a local emulator) never gets a real token: nothing secret leaves in clear
            from google.auth.credentials import AnonymousCredentials

            self._credentials = AnonymousCredentials()
            self.source = "anonymous (plain-http endpoint)"
            return self._credentials
        path, where = find_credentials()
        if path is None:
            raise AuthError(PROVIDER, "load credentials", where, hint=CREDENTIALS_HINT)
        try:
            import google.auth
            from google.auth import exceptions as gexc
        except ImportError:
            raise AuthError(PROVIDER, "import google.auth", "google-auth is not installed", hint=install_hint()) \
                from None
        kind = _read_json(path).get("type", "?")
        try:
            # the credential-type-specific loaders (google-auth warns that the generic one may load a file of
            # an unexpected type); other types (external_account ...) through the generic loader
            if kind == "service_account":
                from google.oauth2 import service_account

                creds = service_account.Credentials.from_service_account_file(str(path), scopes=SCOPES)
            elif kind == "authorized_user":
                from google.oauth2 import credentials as user_credentials

                creds = user_credentials.Credentials.from_authorized_user_file(str(path), scopes=SCOPES)
            else:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    creds, _ = google.auth.load_credentials_from_file(str(path), scopes=SCOPES)
        except (gexc.DefaultCredentialsError, ValueError, KeyError) as e:
            text = str(e)
            if kind == "service_account" and ("PEM" in text or "private key" in text.lower()
                                              or "deserialize" in text.lower()):
                # cryptography could not parse the key: the file is found and set, the key in it is what is wrong
                # (the key itself is never printed)
                raise AuthError(PROVIDER, "load credentials", f"{where}: the private_key in {path} is not a valid "
                                "PEM private key (truncated, edited or not this file's key)",
                                hint=f"create a new key for the service account (console: IAM & Admin > Service "
                                     f"accounts > Keys > Add key > JSON, or `gcloud iam service-accounts keys "
                                     f"create key.json --iam-account=<service account email>`) and point "
                                     f"GOOGLE_APPLICATION_CREDENTIALS at the new file") from None
            # the first sentence of google-auth's reason (a sentence, not cut inside a URL)
            reason = text.split(". ")[0].split(" See http")[0].rstrip(".") or type(e).__name__
            raise AuthError(PROVIDER, "load credentials", f"{where}: a {kind!r} credentials file google-auth "
                            f"cannot use ({reason})", hint=CREDENTIALS_HINT) from None
        self._credentials = creds
        self.source = where
        return creds

    # ------------------------------------------------------------------------------------ clients
    def client(self, name: str) -> Any:
        """One official client (REST transport), cached: compute ``instances``, ``zone_operations``,
        ``region_operations``, ``global_operations``, ``regions``, ``projects``, ``networks``, ``subnetworks``,
        ``firewalls``, ``disks``, ``images``; ``quotas`` (Cloud Quotas); ``billing`` (Cloud Catalog)."""
        if name in self._clients:
            return self._clients[name]
        try:
            if name == "quotas":
                from google.cloud import cloudquotas_v1 as mod
                cls, ep = mod.CloudQuotasClient, self.quotas_endpoint
            elif name == "billing":
                from google.cloud import billing_v1 as mod
                cls, ep = mod.CloudCatalogClient, self.billing_endpoint
            else:
                from google.cloud import compute_v1 as mod
                cls = getattr(mod, "".join(p.capitalize() for p in name.split("_")) + "Client")
                ep = self.compute_endpoint
        except ImportError:
            raise AuthError(PROVIDER, f"import the {name} client", "the Google Cloud client libraries are not "
                            "installed", hint=install_hint()) from None
        kw: dict[str, Any] = {"credentials": self.credentials(), "transport": "rest"}
        if ep:
            kw["client_options"] = {"api_endpoint": ep}
        c = cls(**kw)
        self._clients[name] = c
        return c

    def get_json(self, call: str, path: str) -> dict[str, Any]:
        """``GET <compute endpoint>/compute/v1/<path>`` (``projects/P/regions/R``) with google-auth's
        ``AuthorizedSession``: the answer's JSON object, the fields named as the REST reference names them
        (``quotas[].metric`` / ``limit`` / ``usage``).  For the read-only calls ``broker plan`` makes: the
        ``google-cloud-compute`` client costs seconds to import (its ~1000 message types), google-auth a tenth of
        that.  Raises what :meth:`call` raises (AuthError, TransientError, ProviderError ...) and ProviderError for
        an answer that is not a JSON object."""
        try:
            from google.auth.transport.requests import AuthorizedSession
        except ImportError:
            raise AuthError(PROVIDER, f"import google.auth ({call})", "google-auth is not installed",
                            hint=install_hint()) from None
        base = (self.compute_endpoint or "https://compute.googleapis.com").rstrip("/")
        session = self._clients.get("_session")
        if session is None:
            session = self._clients["_session"] = AuthorizedSession(self.credentials())
        with self.errors(call):
            r = session.get(f"{base}/compute/v1/{path}", timeout=60)
            if r.status_code >= 400:
                raise HttpError.from_response(r)
        try:
            data = r.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise ProviderError(PROVIDER, call, f"the answer to GET {path} is not a JSON object",
                                hint="retry; if it persists the endpoint is not the Compute API")
        return data

    # ------------------------------------------------------------------------------------ calls and errors
    @contextmanager
    def errors(self, call: str, *, create: bool = False, region: str | None = None) -> Iterator[None]:
        """Map Google API failures raised inside to broker errors (see :func:`translate`)."""
        try:
            yield
        except ProviderError:
            raise
        except Exception as e:  # noqa: BLE001 - every SDK / transport failure gets one translation
            if not _is_api_failure(e):
                raise  # a bug before anything was sent (TypeError ...): not a provider answer
            raise translate(e, call, create=create, region=region) from e

    def call(self, call: str, fn: Callable[..., Any], *args: Any, _create: bool = False,
             _region: str | None = None, **kw: Any) -> Any:
        """``fn(*args, **kw)`` with the error mapping (``_create``: a create call, whose 5xx is ambiguous;
        ``_region``: the region a quota error names when the message does not)."""
        with self.errors(call, create=_create, region=_region):
            return fn(*args, **kw)

    def wait(self, op: Any, call: str, *, zone: str | None = None, region: str | None = None,
             create: bool = False, deadline: Any = None, say: Callable[[str], None] | None = None) -> Any:
        """Poll a compute Operation (zonal / regional / global by ``zone`` / ``region``) until DONE through a client
        on this API's endpoint; an operation that ends with ``error.errors`` raises the mapped error (the SDK's
        ``result()`` reports success when ``httpErrorStatusCode`` is missing).  Returns the DONE operation.

        Bounded by ``op_timeout_s`` and by ``deadline`` (the run's hard deadline, an aware datetime) whichever
        comes first; every ``progress_every_s`` seconds ``say`` gets a line naming the operation, its status and
        the time left.  Past the bound: AmbiguousCreate for a create (it may still finish: the core checks by
        tag), else TransientError."""
        from datetime import datetime, timezone

        project = self.require_project(call)
        start = time.monotonic()
        end = start + self.op_timeout_s
        why = f"after {self.op_timeout_s:.0f} s"
        if deadline is not None:
            left = (deadline - datetime.now(timezone.utc)).total_seconds()
            if start + left < end:
                end, why = start + max(0.0, left), "at the run's deadline"
        said = start
        while True:
            if _op_done(op):
                break
            now = time.monotonic()
            if now >= end:
                err = TransientError if not create else AmbiguousCreate
                raise err(PROVIDER, call, f"operation {op.name} still {_op_status(op)} {why} "
                          f"({now - start:.0f} s waited)",
                          hint="it may still finish: `broker status` shows the resource, `broker down` removes it")
            if say is not None and now - said >= self.progress_every_s:
                said = now
                where = f" in {zone or region}" if zone or region else ""
                limit = "the run's deadline" if why.startswith("at ") else "the operation timeout"
                say(f"gcp {call}{where}: operation {op.name} {_op_status(op)} for {now - start:.0f} s; "
                    f"waiting at most {end - now:.0f} s more ({limit})")
            self.sleep(min(self.poll_s, max(0.0, end - now)))
            if zone:
                c = self.client("zone_operations")
                op = self.call(call, c.get, project=project, zone=zone, operation=op.name, _create=create)
            elif region:
                c = self.client("region_operations")
                op = self.call(call, c.get, project=project, region=region, operation=op.name, _create=create)
            else:
                c = self.client("global_operations")
                op = self.call(call, c.get, project=project, operation=op.name, _create=create)
        errs = list(op.error.errors) if op.error and op.error.errors else []
        if errs:
            raise op_error(call, errs, int(op.http_error_status_code or 0) or None, zone=zone, region=region)
        return op


class HttpError(Exception):
    """A Google API error answer read without the client libraries (:meth:`GCPApi.get_json`), with the attributes
    :func:`translate` reads on google.api_core's errors: ``code`` (the HTTP status), ``message`` and ``errors``
    (the body's ``error.errors``: dicts with ``reason``)."""

    def __init__(self, code: int, message: str, errors: list[Any]):
        super().__init__(f"{code} {message}")
        self.code, self.message, self.errors = code, message, errors

    @classmethod
    def from_response(cls, r: Any) -> "HttpError":
        """From a ``requests`` response: ``{"error": {"code", "message", "errors": [...]}}`` when the body is
        that, else the status line."""
        try:
            body = r.json()
        except ValueError:
            body = None
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return cls(r.status_code, str(r.reason or "error"), [])
        errors = err.get("errors")
        return cls(r.status_code, str(err.get("message") or r.reason or "error"),
                   [x for x in errors if isinstance(x, dict)] if isinstance(errors, list) else [])


def _is_api_failure(e: BaseException) -> bool:
    """An answer (or the lack of one) from Google: api_core / google-auth / requests / socket errors."""
    mod = type(e).__module__ or ""
    return (mod.startswith(("google.api_core", "google.auth", "requests", "urllib3", "http.client"))
            or isinstance(e, (HttpError, OSError, TimeoutError, ConnectionError)))


def _op_status(op: Any) -> str:
    st = op.status
    name = getattr(st, "name", None)
    if name:
        return str(name)
    return {2104194: "DONE", 35394935: "PENDING", 121282975: "RUNNING"}.get(st, str(st)) \
        if isinstance(st, int) else str(st)


def _op_done(op: Any) -> bool:
    st = op.status
    return st == 2104194 or getattr(st, "name", str(st)) == "DONE" or str(st).endswith("DONE")


def op_error(call: str, errs: list[Any], status: int | None, *, zone: str | None = None,
             region: str | None = None) -> ProviderError:
    """The broker error for an operation that ended with ``errs`` (``Errors`` protos: ``code``, ``message``)."""
    code = errs[0].code
    msg = "; ".join(f"{e.code}: {e.message}" for e in errs)
    where = zone or region
    if any(e.code in CAPACITY_CODES for e in errs):
        return CapacityError(PROVIDER, call, f"no capacity in {where or 'the zone'} ({msg})",
                             hint="broker tries the next zone, then the next option; spare quota does not "
                                  "guarantee capacity", code=code)
    if any(e.code == "QUOTA_EXCEEDED" for e in errs):
        return quota_error(call, msg, code="QUOTA_EXCEEDED", status=status, region=region or _zone_region(zone))
    if any(e.code in RETRY_CODES for e in errs):
        return TransientError(PROVIDER, call, msg, code=code, status=status)
    if status == 404:
        return ProviderError(PROVIDER, call, msg, code=code, status=404)
    return ProviderError(PROVIDER, call, msg, code=code, status=status if status and status < 500 else None)


def _zone_region(zone: str | None) -> str | None:
    return zone.rsplit("-", 1)[0] if zone and zone.count("-") >= 2 else None


def quota_error(call: str, message: str, *, code: str | None, status: int | None,
                region: str | None) -> QuotaError:
    """A QuotaError naming the metric and region from Google's ``Quota 'X' exceeded.  Limit: L in region R.``."""
    m = re.search(QUOTA_RE, message)
    metric = m.group(1) if m else None
    limit = float(m.group(2)) if m else None
    where = (m.group(3) if m and m.group(3) else ("all regions (project-wide)" if m else region)) or "?"
    scope_region = m.group(3) if m and m.group(3) else (None if m else region)
    words = (f"quota {metric} exceeded in {where} (limit {limit:g})" if m else f"quota exceeded: {message}")
    hint = (f"`broker quota request --provider gcp --limit {metric} --value <new limit>"
            + (f" --region {scope_region}" if scope_region else "") + "`" if metric else
            "raise the quota named in the message (console: IAM & Admin > Quotas)")
    if metric == "GPUS_ALL_REGIONS":
        hint += "; GPUS_ALL_REGIONS is project-wide: no other region helps"
    return QuotaError(PROVIDER, call, words, hint=hint, code=code or "QUOTA_EXCEEDED", status=status,
                      scope=None, limit_name=metric, limit=limit)


#: "The resource 'projects/P/zones/Z/acceleratorTypes/A' was not found" (an accelerator the zone does not offer;
#: seen as 400 badRequest and from gcloud's instances create) and "Machine type with name 'T' does not exist in
#: zone 'Z'" (a G2 / A2 type the zone lacks): the zone cannot serve this type, as a stockout cannot
_NOT_IN_ZONE = (re.compile(r"zones/([a-z0-9-]+)/(acceleratorTypes|machineTypes)/([a-z0-9-]+)' was not found"),
                re.compile(r"(Machine type) with name '([a-z0-9-]+)' does not exist in zone '([a-z0-9-]+)'"))


def not_in_zone(message: str) -> tuple[str, str, str] | None:
    """(zone, "accelerator" | "machine type", name) when ``message`` says the zone does not offer that
    accelerator or machine type; None otherwise."""
    m = _NOT_IN_ZONE[0].search(message or "")
    if m:
        return m.group(1), "accelerator" if m.group(2) == "acceleratorTypes" else "machine type", m.group(3)
    m = _NOT_IN_ZONE[1].search(message or "")
    if m:
        return m.group(3), "machine type", m.group(2)
    return None


def translate(e: BaseException, call: str, *, create: bool = False, region: str | None = None) -> ProviderError:
    """One mapping of google.api_core / requests / google.auth failures to broker errors.

    403 ``quotaExceeded`` (or "Quota 'X' exceeded") -> QuotaError (metric, region); 403 ``rateLimitExceeded`` and
    429 -> TransientError status 429 (refused: nothing made); 401 / other 403 -> AuthError; 400
    ``resourceInUseByAnotherResource`` -> TransientError (a dependant is still going away); 404 / 409 / other 4xx ->
    ProviderError with that status; 5xx, timeouts and connection failures -> TransientError, or AmbiguousCreate
    when ``create`` (the insert may have happened)."""
    status = getattr(e, "code", None)
    status = status if isinstance(status, int) else None
    errors = getattr(e, "errors", None) or []
    reasons = []
    for x in errors:
        if isinstance(x, dict):
            reasons.append(x.get("reason") or x.get("code"))
        else:
            reasons.append(getattr(x, "code", None))
    reasons = [r for r in reasons if r]
    reason = reasons[0] if reasons else getattr(e, "reason", None)
    msg = getattr(e, "message", None) or str(e)
    msg = re.sub(r"^(GET|POST|DELETE|PATCH|PUT) \S+: ", "", str(msg))
    name = type(e).__name__
    if status is None:
        try:
            from google.auth import exceptions as gexc
            if isinstance(e, gexc.GoogleAuthError):
                return AuthError(PROVIDER, call, f"credentials refused or unusable ({name})", hint=CREDENTIALS_HINT)
        except ImportError:  # pragma: no cover
            pass
        err = AmbiguousCreate if create else TransientError
        return err(PROVIDER, call, f"{name}: {msg}"[:500], hint="network or API unavailable; retried")
    if status == 403 and ("quotaExceeded" in reasons or "QUOTA_EXCEEDED" in reasons or re.search(QUOTA_RE, msg)):
        return quota_error(call, msg, code=reason or "quotaExceeded", status=403, region=region)
    if status == 429 or (status == 403 and ("rateLimitExceeded" in reasons or "RATE_LIMIT_EXCEEDED" in msg)):
        te = TransientError(PROVIDER, call, f"rate limited ({status}): {msg}"[:500], code=reason, status=429)
        return te
    if status in (401, 403):
        return AuthError(PROVIDER, call, f"{status} {reason or name}: {msg}"[:500],
                         hint="check the project, that the Compute Engine / Cloud Quotas APIs are enabled and "
                              "that your account has the roles (compute.instanceAdmin, compute.networkAdmin)",
                         code=reason, status=status)
    if any(r in CAPACITY_CODES for r in reasons):
        return CapacityError(PROVIDER, call, msg, code=reason, status=None)
    absent = not_in_zone(msg) if create and status in (400, 404) else None
    if absent is not None:
        return CapacityError(PROVIDER, call, f"{absent[1]} {absent[2]} is not offered in zone {absent[0]} "
                             f"({status} {reason or name}: {msg[:300]})",
                             hint="broker tries the next zone that offers it, then the next option; "
                                  "`gcloud compute accelerator-types list` shows where it is offered",
                             code=reason or "notFound", status=None)
    if any(r in RETRY_CODES for r in reasons):
        return TransientError(PROVIDER, call, msg[:500], code=reason, status=status)
    if status >= 500 or status == 408:
        err = AmbiguousCreate if create else TransientError
        return err(PROVIDER, call, f"{status} {name}: {msg}"[:500], code=reason, status=status)
    return ProviderError(PROVIDER, call, f"{status} {reason or name}: {msg}"[:500], code=reason, status=status)
