"""The thin AWS API layer: credentials (decided without network), boto3 clients, retries and the one place botocore
errors become broker errors.

:meth:`AWSApi.errors` (a context manager after httpx's ``map_httpcore_exceptions``) maps every botocore exception
raised inside to the most specific :mod:`broker.core.provider` error, cause chained; :meth:`AWSApi.call` wraps one call
in it.  The verb modules never catch a botocore exception themselves.  boto3 is imported lazily, and no client is
created unless credentials are present: creating one resolves credentials and may probe the instance metadata
service (169.254.169.254).
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from broker.core.provider import (AmbiguousCreate, AuthError, CapacityError, ProviderError, QuotaError,
                             TransientError)

PROVIDER = "aws"
_log = logging.getLogger(__name__)
CREDENTIALS_HINT = "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (.env.example)"


def install_hint() -> str:
    """What to do when boto3 is missing: install the ``aws`` extra, worded for how broker was installed
    (:func:`broker.core.provider.extra_install_hint`)."""
    from broker.core.provider import extra_install_hint as extra_hint

    return "install the AWS SDK: " + extra_hint("aws", "boto3")

ClientFactory = Callable[[str, str, Any], Any]  # (service, region, botocore Config | None) -> client

_AUTH_CODES = {"AuthFailure", "UnauthorizedOperation", "ExpiredToken", "ExpiredTokenException",
               "InvalidClientTokenId", "UnrecognizedClientException", "SignatureDoesNotMatch",
               "AccessDenied", "AccessDeniedException", "OptInRequired", "InvalidAccessKeyId"}
_THROTTLE_CODES = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException",
                   "ServiceUnavailable", "Unavailable", "InternalError", "InternalFailure", "ServiceException",
                   "RequestTimeout", "RequestTimeoutException"}
_QUOTA_CODES = {"VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"}
_CAPACITY_CODES = {"InsufficientInstanceCapacity", "InsufficientCapacityOnHost", "InsufficientHostCapacity",
                   "UnfulfillableCapacity", "InsufficientFreeAddressesInSubnet", "SpotMaxPriceTooLow",
                   "InsufficientReservedInstanceCapacity"}

#: Throttling answers: the request was refused, not processed (so a refused create did not happen).
_REFUSED_CODES = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException"}
#: Instance-type family bucket of each EC2 vCPU quota family (what a VcpuLimitExceeded blocks).
BUCKETS = {"G": "G/VT", "P": "P", "standard": "standard"}


# --------------------------------------------------------------------------------------------------- credentials
#: request parameters whose values are never logged (boot scripts can carry keys; names are lower-cased)
_UNLOGGED_PARAMS = ("userdata", "password", "secret", "token", "key", "privatekey", "credential")


def loggable_params(params: dict[str, Any]) -> str:
    """``params`` of an API call for the debug log: values (at any depth) whose names suggest secrets
    (``UserData``, ``*Token``, ``*Key``...) become ``<N chars>``; the rest is shortened to 300 characters."""
    import json

    def safe(name: str, value: Any) -> Any:
        low = name.lower()
        # (a tag's "Key" and a key pair's name are not secrets)
        if any(w in low for w in _UNLOGGED_PARAMS) and low not in ("key", "keyname"):
            return f"<{len(str(value))} chars>"
        if isinstance(value, dict):
            return {k: safe(str(k), v) for k, v in value.items()}
        if isinstance(value, list):
            return [safe(name, v) for v in value]
        return value

    text = json.dumps({k: safe(k, v) for k, v in params.items()}, default=str)
    return text if len(text) <= 300 else text[:300] + "..."


def credentials_present(env: dict[str, str] | None = None, home: Path | None = None) -> tuple[bool, str]:
    """Whether the boto3 chain would find credentials, decided from env vars and ``~/.aws`` files only (no
    network, no metadata service).  Returns (present, where)."""
    env = dict(os.environ if env is None else env)
    home = home or Path.home()
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return True, "AWS_ACCESS_KEY_ID in the environment"
    for var in ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE"):
        if env.get(var):
            return True, var
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    cred_file = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials").expanduser()
    conf_file = Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config").expanduser()
    keys = ("aws_access_key_id", "credential_process", "sso_session", "sso_start_url", "role_arn",
            "web_identity_token_file", "credential_source")
    for path, prefix in ((cred_file, ""), (conf_file, "profile ")):
        if not path.is_file():
            continue
        import configparser  # ~7 ms: only where a config file is read

        cp = configparser.RawConfigParser()
        try:
            cp.read(path)
        except configparser.Error:
            continue
        wanted = [profile] if profile else ["default"]
        for name in wanted:
            for section in (f"{prefix}{name}", name):
                if cp.has_section(section) and any(cp.has_option(section, k) for k in keys):
                    return True, f"profile {name!r} in {path}"
    if profile:
        return False, f"AWS_PROFILE={profile} but no such profile with credentials in {cred_file} or {conf_file}"
    return False, "no AWS_ACCESS_KEY_ID, AWS_PROFILE or ~/.aws credentials"


# --------------------------------------------------------------------------------------------------- errors
def error_code(e: BaseException) -> tuple[str, int | None, str]:
    """(code, HTTP status, message) of a botocore exception (the class name as code for non-ClientErrors)."""
    resp = getattr(e, "response", None) or {}
    err = resp.get("Error", {}) or {}
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(err.get("Code") or type(e).__name__), status, str(err.get("Message") or e)


def quota_scope(region: str | None, instance_type: str | None) -> str | None:
    """What a vCPU limit blocks: ``"<region>:<bucket>"`` (``us-east-1:G/VT``, ``us-east-1:P``); the region alone
    when the type has no known family."""
    from broker.providers.aws.limits import aws_family

    fam = aws_family(instance_type or "")
    if fam is None:
        return region
    return f"{region}:{BUCKETS[fam]}" if region else BUCKETS[fam]


def map_error(e: BaseException, call: str, *, instance_type: str | None = None, vcpus: float | None = None,
              nodes: int = 1, zone: str | None = None, region: str | None = None,
              create: bool = False) -> ProviderError:
    """Translate a botocore exception into a :mod:`broker.core.provider` error (message names call and next step).

    ``create``: the call creates an object, so a 5xx other than a capacity / throttling answer, or a read timeout,
    is an :class:`AmbiguousCreate` (it may have happened: look it up by client token / tag before creating
    again).  A quota error carries ``scope`` (:func:`quota_scope`), ``region`` and ``quota_code`` attributes."""
    try:
        from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError,
                                         NoCredentialsError, NoRegionError, PartialCredentialsError,
                                         ReadTimeoutError)
    except ImportError:  # pragma: no cover - boto3 is a dependency of the aws extra
        return ProviderError(PROVIDER, call, str(e))
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return AuthError(PROVIDER, call, "no usable AWS credentials",
                         hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (see .env.example)")
    if isinstance(e, NoRegionError):
        return ProviderError(PROVIDER, call, "no AWS region configured", hint="set AWS_DEFAULT_REGION")
    if create and isinstance(e, ReadTimeoutError):
        return AmbiguousCreate(PROVIDER, call, f"no answer from the AWS endpoint ({type(e).__name__}): the create "
                                               "may have happened",
                               hint="look it up by client token / tag before creating again")
    if isinstance(e, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return TransientError(PROVIDER, call, f"cannot reach the AWS endpoint ({type(e).__name__})",
                              hint="check the network or AWS_ENDPOINT_URL; retry")
    if not isinstance(e, ClientError):
        if create and type(e).__name__ == "ResponseParserError":
            return AmbiguousCreate(PROVIDER, call, "unreadable answer to a create: it may have happened",
                                   hint="look it up by client token / tag before creating again")
        return ProviderError(PROVIDER, call, f"{type(e).__name__}: {e}")
    code, status, msg = error_code(e)
    where = "/".join(x for x in (region, zone) if x)
    what = f" ({instance_type} in {where})" if instance_type else ""
    if code in _CAPACITY_CODES:
        return CapacityError(PROVIDER, call, f"{code}: {msg}{what}",
                             hint="AWS has no capacity for this type there now: try the next zone or instance type",
                             code=code, status=status)
    if code == "Unsupported":
        return CapacityError(PROVIDER, call, f"NOT_OFFERED: {msg}{what}",
                             hint="this instance type is not offered in that zone: choose another zone",
                             code=code, status=status)
    if code in _QUOTA_CODES:
        return _quota_error(call, code, status, msg, instance_type=instance_type, vcpus=vcpus, nodes=nodes,
                            region=region)
    if code in _AUTH_CODES:
        return AuthError(PROVIDER, call, f"{code}: {msg}",
                         hint="check the AWS credentials and that the IAM user/role may call this API",
                         code=code, status=status)
    if create and code not in _REFUSED_CODES and (
            (status is not None and status >= 500) or code in _THROTTLE_CODES):
        return AmbiguousCreate(PROVIDER, call, f"{code}: {msg} (the create may have happened)",
                               hint="look it up by client token / tag before creating again",
                               code=code, status=status)
    if code in _THROTTLE_CODES or (status is not None and status >= 500) or status == 429:
        return TransientError(PROVIDER, call, f"{code}: {msg}", hint="throttled or AWS-side error: retry with backoff",
                              code=code, status=status)
    return ProviderError(PROVIDER, call, f"{code}: {msg}", code=code, status=status)


def _quota_error(call: str, code: str, status: int | None, msg: str, *, instance_type: str | None,
                 vcpus: float | None, nodes: int, region: str | None) -> QuotaError:
    from broker.providers.aws.limits import AWS_QUOTA_CODES, aws_quota_code

    q = aws_quota_code(instance_type or "", spot=code == "MaxSpotInstanceCountExceeded")
    if q is None:
        err = QuotaError(PROVIDER, call, f"{code}: {msg}", code=code, status=status,
                         hint="raise the EC2 quota that covers this instance type in Service Quotas")
    else:
        need = int(math.ceil((vcpus or 0) * max(1, nodes)))
        per = f"{instance_type} needs {int(vcpus)} vCPUs per instance" if vcpus else f"{instance_type}"
        err = QuotaError(
            PROVIDER, call,
            f"{code}: quota {q.code} ({AWS_QUOTA_CODES[q.code].name}, counted in vCPUs) is too low"
            f"{' in ' + region if region else ''}: {per}, {need} vCPUs for {nodes} node(s)",
            hint=f"broker quota request --provider aws --limit {q.code} --value {need}"
                 + (f" --region {region}" if region else ""),
            code=code, status=status)
    # What the core skips: this region's bucket of this family only (a G limit must not drop P options).
    err.scope = quota_scope(region, instance_type)  # type: ignore[attr-defined]
    err.region = region  # type: ignore[attr-defined]
    err.quota_code = q.code if q is not None else None  # type: ignore[attr-defined]
    return err


# --------------------------------------------------------------------------------------------------- fail closed
def unreadable(call: str, what: str) -> ProviderError:
    """The error for an answer whose shape the adapter does not recognise (never read as "empty")."""
    return ProviderError(PROVIDER, call, f"unreadable answer: {what}",
                         hint="the AWS endpoint answered in a shape broker does not know; nothing was assumed "
                              "absent -- check AWS_ENDPOINT_URL / the botocore version and retry")


def expect_list(call: str, resp: Any, key: str) -> list[dict[str, Any]]:
    """``resp[key]`` as a list of dicts; a missing key or another type is :func:`unreadable`."""
    if not isinstance(resp, dict):
        raise unreadable(call, f"expected an object, got {type(resp).__name__}")
    items = resp.get(key)
    if not isinstance(items, list):
        raise unreadable(call, f"no {key!r} list" if items is None else f"{key!r} is a {type(items).__name__}")
    for it in items:
        if not isinstance(it, dict):
            raise unreadable(call, f"{key!r} holds a {type(it).__name__}, not an object")
    return items


def expect_str(call: str, item: dict[str, Any], key: str) -> str:
    """``item[key]`` as a non-empty string, else :func:`unreadable`."""
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise unreadable(call, f"an item without {key!r}")
    return v


def tags_of(call: str, item: dict[str, Any]) -> dict[str, str]:
    """``item["Tags"]`` as a dict (``{}`` when absent); malformed tags are :func:`unreadable`."""
    raw = item.get("Tags")
    if raw is None:
        return {}
    if not isinstance(raw, list) or not all(isinstance(t, dict) and "Key" in t for t in raw):
        raise unreadable(call, "Tags is not a list of {Key, Value}")
    return {t["Key"]: t.get("Value", "") for t in raw}


def instances_of(call: str, resp: Any) -> list[dict[str, Any]]:
    """Every instance of a ``describe_instances`` answer (``Reservations[].Instances[]``, each with an
    ``InstanceId``); anything else is :func:`unreadable`."""
    out = []
    for r in expect_list(call, resp, "Reservations"):
        for i in expect_list(call, r, "Instances"):
            expect_str(call, i, "InstanceId")
            out.append(i)
    return out


# --------------------------------------------------------------------------------------------------- client
class AWSApi:
    """Cached boto3 clients and error mapping.  ``session`` a ``boto3.session.Session``; ``endpoint_url`` (default
    ``AWS_ENDPOINT_URL``); ``region`` (default ``AWS_DEFAULT_REGION``, else the session's, else us-east-1);
    ``client_factory(service, region, config)`` returning a client (e.g. one wrapped in a Stubber).  No I/O here."""

    def __init__(self, session: Any = None, endpoint_url: str | None = None, region: str | None = None,
                 client_factory: ClientFactory | None = None):
        self.session = session
        self._endpoint_url = endpoint_url
        self._region = region
        if region:  # a region from a ledger row or a caller is input too: boto3 builds the host name from it
            from broker.core.config import check_region
            from broker.providers import provider_class

            self._region = check_region(provider_class(PROVIDER), "region", region)
        self.factory = client_factory
        self._clients: dict[tuple[str, str, bool], Any] = {}

    def boto_session(self) -> Any:
        """The boto3 session: the one given, else one built from the settings (environment or ``.env``: keys,
        session token, profile); boto3's own chain fills in the rest.  Creating it does no network I/O."""
        if self.session is not None:
            return self.session
        import boto3

        from broker.core.config import settings

        s = settings()
        kw: dict[str, Any] = {}
        if s.aws_access_key_id and s.aws_secret_access_key:
            kw["aws_access_key_id"] = s.aws_access_key_id.get_secret_value()
            kw["aws_secret_access_key"] = s.aws_secret_access_key.get_secret_value()
            if s.aws_session_token:
                kw["aws_session_token"] = s.aws_session_token.get_secret_value()
        if s.aws_profile and not kw:
            kw["profile_name"] = s.aws_profile
        self.session = boto3.session.Session(**kw)
        return self.session

    @property
    def region(self) -> str:
        """The region: explicit, else AWS_DEFAULT_REGION (environment or .env), else the profile's (boto3's own
        resolution, ``~/.aws/config``; only when credentials are configured, so planning offline imports no
        boto3), else AWS_REGION, else us-east-1."""
        if self._region:
            return self._region
        from broker.core.config import settings

        s = settings()
        if s.aws_region:
            return s.aws_region
        profile_region = None
        if self.session is not None or (self.factory is None and self.configured()):
            try:
                profile_region = self.boto_session().region_name
            except Exception:  # noqa: BLE001 - boto3 missing or a broken profile: the fallbacks below
                profile_region = None
        return profile_region or s.aws_region_alt or "us-east-1"

    @property
    def endpoint_url(self) -> str | None:
        if self._endpoint_url:
            return self._endpoint_url
        from broker.core.config import settings

        return settings().aws_endpoint_url or None

    def configured(self) -> bool:
        if self.factory is not None or self.session is not None or credentials_present()[0]:
            return True
        from broker.core.config import settings

        s = settings()  # keys or a profile from .env, which boto3 alone would not see
        return bool((s.aws_access_key_id and s.aws_secret_access_key) or s.aws_profile)

    def client(self, service: str, region: str | None = None, *, launch: bool = False) -> Any:
        """A cached boto3 client; ``launch`` = retries off (one attempt) for fast failover and no blind resend of
        a create.  Raises AuthError when no credentials are configured (so no client, no metadata probe)."""
        region = region or self.region
        key = (service, region, launch)
        if key in self._clients:
            return self._clients[key]
        try:
            from botocore.config import Config
        except ImportError:
            raise AuthError(PROVIDER, f"{service} client", "boto3 is not installed", hint=install_hint()) from None

        cfg = Config(retries={"mode": "standard", "total_max_attempts": 1}) if launch else \
            Config(retries={"mode": "standard", "max_attempts": 4})
        if self.factory is not None:
            client = self.factory(service, region, cfg)
        else:
            if not self.configured():
                raise AuthError(PROVIDER, f"{service} client", "no AWS credentials configured",
                                hint=CREDENTIALS_HINT)
            session = self.boto_session()
            kwargs: dict[str, Any] = {"region_name": region, "config": cfg}
            if self.endpoint_url:
                kwargs["endpoint_url"] = self.endpoint_url
            client = session.client(service, **kwargs)
        self._clients[key] = client
        return client

    @contextmanager
    def errors(self, call: str, **ctx: Any) -> Iterator[None]:
        """``with api.errors("run_instances", instance_type=..., create=True): ...``: botocore errors raised
        inside become broker errors (:func:`map_error` with ``ctx``), cause chained."""
        import time

        t0 = time.monotonic()
        try:
            yield
        except ProviderError as e:
            _log.info("aws %s: failed (%.2f s): %s", call, time.monotonic() - t0, e.message)
            raise
        except Exception as e:  # noqa: BLE001 - translated at the edge
            mapped = map_error(e, call, **ctx)
            _log.info("aws %s: failed (%.2f s): %s", call, time.monotonic() - t0, mapped.message)
            raise mapped from e
        _log.info("aws %s: ok (%.2f s)", call, time.monotonic() - t0)

    def call(self, client: Any, op: str, _ctx: dict[str, Any] | None = None, **params: Any) -> Any:
        """``client.<op>(**params)`` with errors mapped (``_ctx``: :func:`map_error` keywords)."""
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("aws %s: params %s", op, loggable_params(params))
        with self.errors(op, **(_ctx or {})):
            return getattr(client, op)(**params)

    def unimplemented(self, e: BaseException) -> bool:
        """An emulator (custom endpoint, e.g. moto) answering an action it does not implement."""
        if not self.endpoint_url:
            return False
        cause = e.__cause__ if isinstance(e, ProviderError) and e.__cause__ is not None else e
        code, status, msg = error_code(cause)
        return (type(cause).__name__ == "ResponseParserError" or code in ("500", "NotImplemented")
                or "not yet implemented" in msg.lower() or "has not been implemented" in msg.lower())
