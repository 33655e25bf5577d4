"""The thin OCI API layer: config, SDK clients, retries and the one place SDK errors become broker errors.

Everything that speaks the ``oci`` SDK goes through :class:`OCIApi`: :meth:`OCIApi.errors` (a context manager
after httpx's ``map_httpcore_exceptions``) turns ``oci.exceptions.ServiceError`` and transport errors into the most
specific :mod:`broker.core.provider` error, cause chained; :meth:`OCIApi.call` and :meth:`OCIApi.all_pages` wrap one
call / every page in it.  The verb modules (``offers``, ``network``, ``lifecycle``, ``quota_requests``) never catch
an SDK exception themselves.  The SDK is imported lazily (inside methods): ``broker plan`` without OCI never loads it.
"""

from __future__ import annotations

import logging
import re
import shlex
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from broker.core.provider import (AmbiguousCreate, AuthError, CapacityError, ProviderError, QuotaError,
                             TransientError)

PROVIDER = "oci"
_log = logging.getLogger(__name__)

_EXCEEDED = r"(?is)service limits? (?:were|was) exceeded:\s*(.+?)(?:\.\s|\.$|$)"
CONFIG_HINT = ("run `oci setup config` (writes ~/.oci/config with your user, tenancy, fingerprint, key_file and "
               "region), or point OCI_CONFIG_FILE / OCI_PROFILE at an existing profile")


def install_hint() -> str:
    """The whole fix when the SDK is missing: install the ``oci`` extra (worded for how broker was installed:
    :func:`broker.core.provider.extra_install_hint`), then the profile step."""
    from broker.core.provider import extra_install_hint as extra_hint

    return "install the OCI SDK: " + extra_hint("oci", "oci") + "; then " + CONFIG_HINT


def exceeded_limits(message: str) -> list[str]:
    """Limit names from a 400 ``LimitExceeded`` message ("The following service limits were exceeded: a, b.")."""
    m = re.search(_EXCEEDED, message or "")
    if not m:
        return []
    return [x.strip().strip(".") for x in re.split(r"[,;]", m.group(1)) if x.strip().strip(".")]


def quota_request_command(limit: str, value: int, scope: str | None) -> str:
    """A ready ``broker quota request`` command for an OCI limit (``scope`` = availability domain)."""
    cmd = f"broker quota request --provider oci --limit {limit} --value {value}"
    return cmd + (f" --scope {shlex.quote(scope)}" if scope else "")


def sdk_errors() -> tuple[type[BaseException], ...]:
    """SDK exceptions translated at the edge: service errors and every transport error (vendored requests)."""
    import oci

    return (oci.exceptions.ServiceError, oci.exceptions.BaseRequestException)


def _status(e: Exception) -> tuple[int | None, str, str]:
    return getattr(e, "status", None), str(getattr(e, "code", "") or ""), str(getattr(e, "message", "") or e)


def _never_sent(e: BaseException) -> bool:
    """A transport error raised before the request reached the service (connection refused / connect timeout):
    a create that failed so did not happen.  Anything else (read timeout, reset) may have been processed."""
    import oci

    if isinstance(e, oci.exceptions.ConnectTimeout):
        return True
    text = f"{e!r} {getattr(e, '__cause__', '')!r} {getattr(e, '__context__', '')!r}".lower()
    return any(w in text for w in ("connection refused", "newconnectionerror", "name or service not known",
                                   "failed to establish", "connecttimeout"))


class OCIApi:
    """Config, cached SDK clients and error mapping for one OCI profile.

    Args (all optional; defaults come from :func:`broker.core.config.settings`): ``config`` (a dict instead of the file
    and profile), ``service_endpoint`` (base URL for every client), ``compartment_id``, ``region``,
    ``retry_strategy`` / ``circuit_breaker_strategy`` (passed to every client; tests pass the "none" ones),
    ``sleep`` (waits between polls).  The constructor does no I/O and imports nothing from the SDK.
    """

    def __init__(self, config: dict[str, Any] | None = None, *, service_endpoint: str | None = None,
                 compartment_id: str | None = None, region: str | None = None, retry_strategy: Any = None,
                 circuit_breaker_strategy: Any = None, sleep: Callable[[float], None] = time.sleep):
        from broker.core.config import settings

        s = settings()
        self._config_in = dict(config) if config is not None else None
        self._config: dict[str, Any] | None = None
        self.endpoint = service_endpoint or s.oci_service_endpoint
        self._compartment = compartment_id or s.oci_compartment_id
        self._region = region or s.oci_region
        if region:  # a region from a ledger row or a caller is input too: the SDK builds the host name from it
            from broker.core.config import check_region
            from broker.providers import provider_class

            self._region = check_region(provider_class(PROVIDER), "region", region)
        self._retry = retry_strategy
        self._breaker = circuit_breaker_strategy
        self.sleep = sleep
        self._clients: dict[str, Any] = {}
        self.profile = s.oci_profile
        self.config_file = s.oci_config_file

    # ------------------------------------------------------------------------------------ config & clients
    @property
    def config_source(self) -> str:
        return "config dict" if self._config_in is not None else f"{self.config_file} [{self.profile}]"

    def load_config(self) -> dict[str, Any]:
        """The validated config dict; raises AuthError naming the file/profile and the fix (never key material)."""
        if self._config is not None:
            return self._config
        if self._config_in is None:  # fast path, no SDK import: `broker plan` without OCI stays well under 1 s
            from pathlib import Path

            candidates = [Path(self.config_file).expanduser()]
            if self.config_file in ("~/.oci/config", str(Path("~/.oci/config").expanduser())):
                candidates.append(Path("~/.oraclebmc/config").expanduser())  # the SDK's legacy fallback
            if not any(c.is_file() for c in candidates):
                raise AuthError(PROVIDER, "config.from_file", f"no OCI config file at {self.config_file}",
                                hint=CONFIG_HINT)
        try:
            import oci
        except ImportError:  # configured, but without the `oci` extra: a fix, not a traceback
            raise AuthError(PROVIDER, "import oci", "the oci SDK is not installed", hint=install_hint()) from None

        where = "the config dict" if self._config_in is not None else \
            f"{self.config_file} profile [{self.profile}]"
        try:
            cfg = self._config_in if self._config_in is not None else \
                oci.config.from_file(self.config_file, self.profile)
            oci.config.validate_config(cfg)
        except oci.exceptions.ConfigFileNotFound:
            raise AuthError(PROVIDER, "config.from_file", f"no OCI config file at {self.config_file}",
                            hint=CONFIG_HINT) from None
        except oci.exceptions.ProfileNotFound:
            raise AuthError(PROVIDER, "config.from_file",
                            f"profile [{self.profile}] not found in {self.config_file}", hint=CONFIG_HINT) from None
        except oci.exceptions.InvalidConfig as e:
            keys = sorted(e.args[0]) if e.args and isinstance(e.args[0], dict) else []
            detail = f"invalid or missing keys: {', '.join(keys)}" if keys else "invalid configuration"
            raise AuthError(PROVIDER, "config.validate_config", f"{where}: {detail}", hint=CONFIG_HINT) from None
        except (oci.exceptions.InvalidKeyFilePath, OSError, ValueError) as e:
            raise AuthError(PROVIDER, "config.from_file", f"{where}: {type(e).__name__}", hint=CONFIG_HINT) from None
        self._config = dict(cfg)
        return self._config

    def client(self, kind: str) -> Any:
        """A cached SDK client: ``identity``, ``limits``, ``compute``, ``vnet`` or ``increase``."""
        if kind not in self._clients:
            cfg = dict(self.load_config())  # first: AuthError (no config, no SDK) before any SDK import
            import oci

            cls = {"identity": oci.identity.IdentityClient, "limits": oci.limits.LimitsClient,
                   "compute": oci.core.ComputeClient, "vnet": oci.core.VirtualNetworkClient,
                   "increase": oci.limits_increase.LimitsIncreaseClient}[kind]
            kw: dict[str, Any] = {}
            if self.endpoint:
                kw["service_endpoint"] = self.endpoint.rstrip("/")
            # Reads and creates retry 429/5xx/timeouts a bounded while (the SDK adds an opc-retry-token to creates
            # so a retry cannot double-create); launch_instance overrides this per call with no retry at all.
            kw["retry_strategy"] = self._retry if self._retry is not None else oci.retry.RetryStrategyBuilder(
                max_attempts_check=True, max_attempts=4, total_elapsed_time_check=True,
                total_elapsed_time_seconds=60, retry_max_wait_between_calls_seconds=10,
                retry_base_sleep_time_seconds=1).get_retry_strategy()
            if self._breaker is not None:
                kw["circuit_breaker_strategy"] = self._breaker
            if self._region:
                cfg["region"] = self._region
            try:
                self._clients[kind] = cls(cfg, **kw)
            except (ValueError, OSError, oci.exceptions.ClientError) as e:  # bad/unreadable key, passphrase ...
                what = "the private key is invalid or its passphrase is wrong" if isinstance(
                    e, oci.exceptions.InvalidPrivateKey) else f"cannot build the client ({type(e).__name__})"
                raise AuthError(PROVIDER, f"{cls.__name__}()", what,
                                hint="check key_file / pass_phrase in the profile; " + CONFIG_HINT) from None
        return self._clients[kind]

    @property
    def region(self) -> str | None:
        if self._region:
            return self._region
        try:
            return self.load_config().get("region")
        except AuthError:
            return None

    @property
    def tenancy(self) -> str:
        return self.load_config()["tenancy"]

    @property
    def compartment(self) -> str:
        return self._compartment or self.tenancy

    def configured(self) -> bool:
        try:
            self.load_config()
            return True
        except (AuthError, ImportError):
            return False

    # ------------------------------------------------------------------------------------ error mapping
    def map_error(self, e: BaseException, call: str, *, scope: str | None = None, shape: str | None = None,
                  gpus: int | None = None, create: bool = False) -> ProviderError:
        """Translate an SDK exception into the most specific broker error (once, here).

        ``create``: the call creates a billable object, so a 5xx (other than "Out of host capacity") or a
        transport error after the request was sent is an :class:`AmbiguousCreate` (it may have happened: list
        by tag / retry token before creating again).  ``scope``: the availability domain (or region) the call
        was about; a ``400 LimitExceeded`` becomes a QuotaError whose ``scope`` attribute is it."""
        import oci

        if isinstance(e, oci.exceptions.ServiceError):
            status, code, msg = _status(e)
            where = f" in {scope}" if scope else ""
            if status == 500 and "out of host capacity" in msg.lower():
                return CapacityError(PROVIDER, call, f"out of host capacity for {shape or 'the shape'}{where}",
                                     hint="try the next availability domain, then another region",
                                     code=code, status=status)
            if status == 400 and code == "LimitExceeded":
                return self._quota_error(call, msg, code, status, scope=scope, shape=shape, gpus=gpus)
            if status in (401, 403) or (status == 404 and code == "NotAuthorizedOrNotFound"):
                return AuthError(PROVIDER, call, f"{status} {code}: {msg}",
                                 hint="check the OCI profile (`oci setup config`, OCI_CONFIG_FILE/OCI_PROFILE) and "
                                      "that your group's IAM policies allow this call in the compartment",
                                 code=code, status=status)
            if create and status is not None and status >= 500:
                return AmbiguousCreate(PROVIDER, call, f"{status} {code}: {msg}",
                                       hint="the create may have happened: list by tag / retry token before "
                                            "creating again", code=code, status=status)
            if status == 429 or (status is not None and status >= 500) or status == 409:
                return TransientError(PROVIDER, call, f"{status} {code}: {msg}", hint="retry in a moment",
                                      code=code, status=status)
            return ProviderError(PROVIDER, call, f"{status} {code}: {msg}", code=code, status=status)
        if isinstance(e, oci.exceptions.BaseRequestException):
            hint = "check connectivity to the OCI endpoint (or OCI_SERVICE_ENDPOINT) and retry"
            if create and not _never_sent(e):
                return AmbiguousCreate(PROVIDER, call, f"network error: {type(e).__name__} (the create may have "
                                                       "happened)", hint="list by tag / retry token, then " + hint)
            return TransientError(PROVIDER, call, f"network error: {type(e).__name__}", hint=hint)
        return ProviderError(PROVIDER, call, f"{type(e).__name__}: {e}")

    def _quota_error(self, call: str, msg: str, code: str, status: int | None, *, scope: str | None,
                     shape: str | None, gpus: int | None) -> QuotaError:
        from broker.providers.oci.limits import limit_for_shape, shape_gpus

        names = exceeded_limits(msg) or ([limit_for_shape(shape)] if shape and limit_for_shape(shape) else [])
        lim = names[0] if names else None
        where = f" in {scope}" if scope else ""
        if lim and lim.startswith("gpu") and shape:  # a compute GPU limit: a ready command
            value = self.needed_value(lim, scope, gpus or shape_gpus(shape))
            hint = f"request more: {quota_request_command(lim, value, scope)}"
        else:
            hint = (f"raise {lim or 'the limit'} (Console: Governance & Administration > Limits, Quotas and "
                    "Usage) or delete unused resources that count against it")
        err = QuotaError(PROVIDER, call, f"service limit {', '.join(names) or '?'} exceeded{where}: {msg}",
                         hint=hint, code=code, status=status)
        # What the core skips: OCI GPU limits are per availability domain; other limits (VCNs, subnets) per region.
        err.scope = scope or self.region  # type: ignore[attr-defined]
        err.limit_name = lim  # type: ignore[attr-defined]
        return err

    @contextmanager
    def errors(self, call: str, *, scope: str | None = None, shape: str | None = None, gpus: int | None = None,
               create: bool = False) -> Iterator[None]:
        """``with api.errors("launch_instance", scope=ad, create=True): ...``: SDK errors raised inside become
        broker errors (:meth:`map_error`), cause chained."""
        _log.debug("oci %s: scope=%s shape=%s", call, scope, shape)
        t0 = time.monotonic()
        try:
            yield
        except ProviderError as e:
            _log.info("oci %s: failed (%.2f s): %s", call, time.monotonic() - t0, e.message)
            raise
        except sdk_errors() as e:
            mapped = self.map_error(e, call, scope=scope, shape=shape, gpus=gpus, create=create)
            _log.info("oci %s: failed (%.2f s): %s", call, time.monotonic() - t0, mapped.message)
            raise mapped from e
        except (AttributeError, TypeError, ValueError, KeyError) as e:
            if isinstance(e, ValueError) and "cannot be None" in str(e):  # the SDK's own check: nothing was sent
                raise ProviderError(PROVIDER, call, f"invalid request: {e}") from e
            # the SDK could not deserialize a 2xx answer (e.g. a list where an object is expected)
            if create:
                raise AmbiguousCreate(PROVIDER, call, f"unreadable answer ({type(e).__name__}): the create may "
                                      "have happened", hint="list by tag / retry token before creating again") from e
            raise unreadable(call, f"the SDK could not read it ({type(e).__name__}: {e})") from e
        _log.info("oci %s: ok (%.2f s)", call, time.monotonic() - t0)

    def call(self, call: str, fn: Callable[..., Any], *args: Any, _scope: str | None = None,
             _shape: str | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with errors mapped (``call`` names it in messages)."""
        with self.errors(call, scope=_scope, shape=_shape):
            return fn(*args, **kwargs)

    def all_pages(self, call: str, fn: Callable[..., Any], *args: Any, max_pages: int = 1000,
                  **kwargs: Any) -> list[Any]:
        """Every page of a list call, following ``opc-next-page``, each page sent with the client's own retry
        strategy (``oci.pagination.list_call_get_all_results`` wraps every page in the SDK's default strategy
        instead: 8 attempts over up to 600 s, on top of the client's).  An answer that is not a list of objects
        is a ProviderError (fail closed: never read as "nothing there")."""
        out: list[Any] = []
        page: str | None = None
        for _ in range(max_pages):
            with self.errors(call):
                resp = fn(*args, **({**kwargs, "page": page} if page else kwargs))
            data = resp.data
            if not isinstance(data, list) and isinstance(getattr(data, "items", None), list):
                data = data.items  # a collection object (e.g. limits increase requests)
            out += expect_list(call, data)
            page = resp.next_page
            if not page:
                return out
        raise unreadable(call, f"more than {max_pages} pages (a pagination token that never ends)")

    def needed_value(self, limit: str, scope: str | None, gpus: int) -> int:
        """New limit value that allows ``gpus`` more: used + gpus (best effort; ``gpus`` when the read fails)."""
        if not scope:
            return gpus
        try:
            ra = self.client("limits").get_resource_availability("compute", limit, self.tenancy,
                                                                 availability_domain=scope).data
            return int((ra.used or 0) + gpus)
        except Exception:  # noqa: BLE001 - a hint only; the original error is what matters
            return gpus


# ---------------------------------------------------------------------------------------------- fail closed
def unreadable(call: str, what: str) -> ProviderError:
    """The error for an answer whose shape the adapter does not recognise (never read as "empty")."""
    return ProviderError(PROVIDER, call, f"unreadable answer: {what}",
                         hint="the OCI endpoint answered in a shape broker does not know; nothing was assumed "
                              "absent -- check OCI_SERVICE_ENDPOINT / the SDK version and retry")


def expect_list(call: str, data: Any) -> list[Any]:
    """``data`` as a list of SDK model objects (each with ``attribute_map``), else :func:`unreadable`."""
    if not isinstance(data, list):
        raise unreadable(call, f"expected a list, got {type(data).__name__}")
    for item in data:
        if not hasattr(item, "attribute_map"):
            raise unreadable(call, f"expected objects in the list, got {type(item).__name__}")
    return data


def expect_fields(call: str, obj: Any, *fields: str) -> Any:
    """``obj`` when it is an SDK model whose ``fields`` are non-empty strings, else :func:`unreadable`."""
    if not hasattr(obj, "attribute_map"):
        raise unreadable(call, f"expected an object, got {type(obj).__name__}")
    for f in fields:
        v = getattr(obj, f, None)
        if not isinstance(v, str) or not v:
            raise unreadable(call, f"{type(obj).__name__} without {f!r}")
    return obj


def expect_tags(call: str, obj: Any) -> dict[str, str]:
    """The freeform tags of ``obj`` (``{}`` when absent); a non-dict is :func:`unreadable`."""
    tags = getattr(obj, "freeform_tags", None)
    if tags is None:
        return {}
    if not isinstance(tags, dict):
        raise unreadable(call, f"freeformTags is a {type(tags).__name__}, not an object")
    return tags
