"""The Vast.ai REST client: key lookup, one ``httpx.Client``, bounded retries (tenacity) and the one place where
HTTP and transport failures become broker errors (:meth:`VastClient.request` through :func:`_mapped`).

Endpoints, fields and units: the reference notes docs/reference/cloud-apis.md, section A.  Authentication: ``Authorization: Bearer <key>``; the key is never printed, logged or put
into an exception (server texts are scrubbed of it).  Base URL: ``VAST_API_URL`` (default ``https://console.vast.ai``).

Retries follow the SDK's ``VastClient``: HTTP 429/502/503/504 and transport errors are retried a bounded number of
times, honouring ``Retry-After`` up to 60 s; a 429 whose JSON says ``"error": "search_quota_exceeded"`` (daily
quota, resets at UTC midnight) is not retried.  Vast documents its limits as a minimum interval per endpoint and
sends no ``Retry-After``: a 429 of a search then waits :data:`SEARCH_INTERVAL_S`, of a create
:data:`CREATE_PENALTY_S` (``rate_interval_s``), doubling; the error that ends the retries carries the wait it
advises as ``retry_after_s`` (the one name the core reads).  A caller that must not resend a request (the rent) narrows
``retry_on`` and reads :attr:`broker.core.provider.ProviderError.status` / ``request_sent`` on the error it gets.

Error tree (most specific first): 401/403 -> AuthError; 402 or a credit text -> ProviderError
``insufficient_credit``; 429 ``search_quota_exceeded`` -> ProviderError; 429 -> TransientError "rate-limited";
5xx -> TransientError; other 4xx -> ProviderError; network -> TransientError; an answer that is not JSON
(or not the expected shape, :func:`expect`) -> ProviderError naming the call.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from broker.core.provider import AuthError, ProviderError, TransientError

if TYPE_CHECKING:  # pragma: no cover
    import httpx

PROVIDER = "vast"
_log = logging.getLogger(__name__)
DEFAULT_API_URL = "https://console.vast.ai"
#: HTTP statuses retried (as vastai's VastClient does).
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: Statuses a destroy is retried on: any 5xx, 429 and 409 (the instance is busy changing state).
DELETE_RETRY_STATUSES = frozenset({409, 429, 500, 501, 502, 503, 504, 507, 520, 521, 522, 523, 524})
#: Longest ``Retry-After`` honoured (seconds); a longer one is not waited for (the SDK's bound).
MAX_RETRY_AFTER_S = 60.0
#: Seconds between offer searches that Vast's rate limit allows (about 10 a minute, per endpoint and identity):
#: the first wait after a search's 429 when the answer names none (Vast sends no ``Retry-After``).
SEARCH_INTERVAL_S = 6.0
#: Seconds a create (``PUT /asks/{id}/``) adds to the caller's rate-limit window: the first wait after a create's
#: 429 when the answer names none.
CREATE_PENALTY_S = 12.0

KEY_HINT = ("set VAST_API_KEY (environment or .env) or save the key from https://cloud.vast.ai/manage-keys/ "
            "to ~/.config/vastai/vast_api_key (`vastai set api-key ...`)")
CREDIT_HINT = "add credit at https://cloud.vast.ai/billing/ (Vast.ai is prepaid), then retry"
OFFLINE_HINT = "`broker plan --offline` plans from the shipped price snapshot without calling Vast.ai"
#: Words in a refusal that mean "that offer / instance does not exist (any more)".
GONE_WORDS = ("no_such_ask", "not available", "no longer available", "unavailable", "rented", "not found",
              "does not exist", "already", "no_such_instance")


# --------------------------------------------------------------------------------------------------- API key, URL
def _xdg_key_path() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "vastai" / "vast_api_key"


#: key files already reported by :func:`_key_file_overridden` in this process
_OVERRIDE_NOTICED: set[str] = set()


def _key_file_overridden(key: str) -> None:
    """One line on stderr when ``./.env``'s VAST_API_KEY replaces a different key in the vastai key file: a cloned
    folder then bills (and sees) another account than the user's own.  Never the keys themselves."""
    import sys

    for path in (_xdg_key_path(), Path.home() / ".vast_api_key"):
        try:
            file_key = path.read_text().strip() if path.is_file() else ""
        except OSError:
            continue
        if file_key:
            if file_key != key and str(path) not in _OVERRIDE_NOTICED:
                _OVERRIDE_NOTICED.add(str(path))
                sys.stderr.write(f"broker: VAST_API_KEY in {Path('.env').resolve()} overrides the key in {path} "
                                 "(another account's key: remove it from .env to use your own)\n")
            return


def find_api_key(explicit: str | None = None) -> tuple[str | None, str]:
    """The Vast.ai API key and where it came from (a description, never the key).

    Order (as the vastai 1.9.1 SDK's ``_resolve_api_key``): ``explicit`` → ``VAST_API_KEY`` (environment, then
    ``.env`` via settings) → ``$XDG_CONFIG_HOME/vastai/vast_api_key`` (``~/.config/vastai/vast_api_key``) →
    ``~/.vast_api_key``.  Returns ``(None, "...")`` when none is found.
    """
    if explicit:
        return explicit.strip(), "the api_key argument"
    env = os.environ.get("VAST_API_KEY", "").strip()
    if env:
        return env, "VAST_API_KEY"
    try:
        from broker.core.config import settings

        s = settings().vast_api_key
        if s is not None and s.get_secret_value().strip():
            key = s.get_secret_value().strip()
            _key_file_overridden(key)
            return key, "VAST_API_KEY (.env)"
    except Exception:  # a broken .env must not break key lookup from files
        pass
    for path in (_xdg_key_path(), Path.home() / ".vast_api_key"):
        try:
            if path.is_file():
                key = path.read_text().strip()
                if key:
                    return key, str(path)
        except OSError:
            continue
    return None, "no key found (VAST_API_KEY, ~/.config/vastai/vast_api_key, ~/.vast_api_key)"


def api_url(explicit: str | None = None) -> str:
    """Base URL: ``explicit`` → ``VAST_API_URL`` (the real environment only: :func:`broker.core.config.env_only`) →
    ``https://console.vast.ai``.  Raises BadInput for a plain-http ``VAST_API_URL`` to another machine."""
    from broker.core.config import check_endpoint, settings

    url = explicit or os.environ.get("VAST_API_URL", "").strip()  # read now: tests and embedders change it
    if url and not explicit:
        check_endpoint("VAST_API_URL", url)
    url = url or settings().vast_api_url or ""
    return (url.strip() or DEFAULT_API_URL).rstrip("/")


# --------------------------------------------------------------------------------------------------- answers
def body_message(r: "httpx.Response") -> str:
    """The server's words in an answer (``error`` / ``msg`` / ``detail`` / ``message``), else its text, short."""
    try:
        data = r.json()
    except ValueError:
        return (r.text or "").strip()[:300]
    if isinstance(data, dict):
        parts = [str(data[k]) for k in ("error", "msg", "detail", "message") if data.get(k)]
        return "; ".join(dict.fromkeys(parts)) or json.dumps(data)[:300]
    return json.dumps(data)[:300]


def search_quota_exceeded(r: "httpx.Response") -> bool:
    if r.status_code != 429:
        return False
    try:
        data = r.json()
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("error") == "search_quota_exceeded"


def retry_after(r: "httpx.Response") -> float | None:
    try:
        return max(0.0, float(r.headers["Retry-After"]))
    except (KeyError, TypeError, ValueError):
        return None


def says_gone(r: "httpx.Response") -> bool:
    """Whether a refusal's text says the offer / instance does not exist (any more)."""
    msg = body_message(r).lower()
    return any(w in msg for w in GONE_WORDS)


def expect(data: Any, call: str, shape: str, ok: bool) -> None:
    """Fail closed: raise ProviderError naming ``call`` when an answer does not have the documented ``shape``.

    An answer the adapter cannot read must never be taken for "nothing there" (a list answered
    ``{"results": [...]}`` was once read as "no instances" while four were billing).
    """
    if not ok:
        seen = json.dumps(data)[:200] if not isinstance(data, str) else data[:200]
        raise ProviderError(PROVIDER, call, f"unrecognised answer (expected {shape}; got {seen})",
                            hint="Vast.ai's API answered in a shape broker does not know; nothing was assumed. "
                                 "Retry later; if it persists, check the Vast.ai console and `broker status`",
                            code="unrecognised_answer")


class _Retry(Exception):
    """A retryable HTTP answer (internal to the client)."""

    def __init__(self, response: "httpx.Response", delay: float | None):
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.delay = delay


class _Status(Exception):
    """A final non-2xx answer the caller did not accept (internal; mapped by :func:`_mapped`)."""

    def __init__(self, response: "httpx.Response", tries: int = 1):
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.tries = tries


# --------------------------------------------------------------------------------------------------- client
class VastClient:
    """One authenticated ``httpx.Client`` for the Vast.ai REST API.

    ``api_key``/``api_url`` as :func:`find_api_key` / :func:`api_url`; ``max_attempts`` per request (retries on
    429/502/503/504); ``backoff_s`` first wait when no ``Retry-After`` (doubles, capped at 10 s); ``sleep``
    injectable for tests; ``timeout_s`` per request.  No I/O happens in the constructor.
    """

    def __init__(self, api_key: str | None = None, api_url_: str | None = None, *, max_attempts: int = 4,
                 backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep, timeout_s: float = 60.0):
        self._explicit_key = api_key
        self._explicit_url = api_url_
        self.max_attempts = max(1, int(max_attempts))
        self.backoff_s = backoff_s
        self.sleep = sleep
        self.timeout_s = timeout_s
        self._client: "httpx.Client | None" = None
        self._key: str | None = None

    @property
    def url(self) -> str:
        return api_url(self._explicit_url)

    def key(self) -> str | None:
        return find_api_key(self._explicit_key)[0]

    def key_source(self) -> tuple[str | None, str]:
        return find_api_key(self._explicit_key)

    def scrub(self, text: str) -> str:
        out = text
        for key in {self._key, self.key()}:
            if key and len(key) >= 6:
                out = out.replace(key, "***")
        return out

    def _http(self, call: str) -> "httpx.Client":
        key = self.key()
        if not key:
            raise AuthError(PROVIDER, call, "no Vast.ai API key found", hint=KEY_HINT)
        if self._client is None or key != self._key:
            import httpx

            if self._client is not None:
                self._client.close()
            self._key = key
            self._client = httpx.Client(base_url=self.url, timeout=self.timeout_s,
                                        headers={"Authorization": f"Bearer {key}", "Accept": "application/json",
                                                 "User-Agent": "broker (vast adapter)"})
        return self._client

    def close(self) -> None:
        """Close the HTTP connection pool."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def _wait(self, state: Any, rate_interval_s: float | None = None) -> float:
        """Seconds before the next try: the answer's ``Retry-After``; after a 429 without one, the endpoint's
        documented interval ``rate_interval_s`` doubling (at most twice it); else ``backoff_s`` doubling, at most
        10 s."""
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Retry) and exc.delay is not None:
            return exc.delay
        n = state.attempt_number - 1
        if rate_interval_s and isinstance(exc, _Retry) and exc.response.status_code == 429:
            return min(2.0 * rate_interval_s, rate_interval_s * (2 ** n))
        return min(10.0, self.backoff_s * (2 ** n))

    @contextmanager
    def _mapped(self, call: str, rate_interval_s: float | None = None) -> Iterator[None]:
        """The one place where httpx failures and unaccepted HTTP answers become broker errors (cause chained,
        key scrubbed).  See the module docstring for the tree."""
        import httpx

        try:
            yield
        except _Status as exc:
            raise self.error_for(exc.response, call, tries=exc.tries, rate_interval_s=rate_interval_s) from None
        except httpx.TransportError as exc:
            err = TransientError(PROVIDER, call, f"cannot reach Vast.ai at {self.url}: "
                                 f"{type(exc).__name__}: {self.scrub(str(exc))}",
                                 hint="check the network or VAST_API_URL, then retry")
            # a failed connect never sent the request; anything later may have reached the server
            sent = not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
            err.request_sent = sent  # type: ignore[attr-defined]
            raise err from None

    def error_for(self, r: "httpx.Response", call: str, *, tries: int = 1,
                  rate_interval_s: float | None = None) -> ProviderError:
        """The broker error for a non-2xx answer ``r`` of ``call`` (never includes the key).  A 429 carries
        ``retry_after_s``: the answer's ``Retry-After``, else ``rate_interval_s`` (the endpoint's documented
        interval), else None."""
        msg = self.scrub(body_message(r))
        status = r.status_code
        low = msg.lower()
        after = f" after {tries} tries" if tries > 1 else ""
        if status in (401, 403):
            return AuthError(PROVIDER, call, f"Vast.ai rejected the API key (HTTP {status}: {msg})", hint=KEY_HINT,
                             status=status)
        if status == 402 or "insufficient" in low or "credit" in low or "balance" in low:
            return ProviderError(PROVIDER, call, f"Vast.ai says the account cannot pay (HTTP {status}: {msg})",
                                 hint=CREDIT_HINT, code="insufficient_credit", status=status)
        if search_quota_exceeded(r):
            return ProviderError(PROVIDER, call, f"Vast.ai's daily search quota is used up (HTTP 429: {msg})",
                                 hint=f"it resets at 00:00 UTC; until then {OFFLINE_HINT}",
                                 code="search_quota_exceeded", status=status)
        if status == 429:
            wait = retry_after(r)
            when = f"retry in {wait:.0f} s (Retry-After)" if wait is not None else (
                f"retry in {rate_interval_s:.0f} s" if rate_interval_s else "retry in a minute")
            err = TransientError(PROVIDER, call, f"the Vast.ai API is rate-limited (HTTP 429: {msg}){after}",
                                 hint=f"{when}; {OFFLINE_HINT}", code="rate_limited", status=status)
            err.retry_after_s = wait if wait is not None else rate_interval_s  # type: ignore[attr-defined]
            return err
        if status >= 500:
            return TransientError(PROVIDER, call, f"Vast.ai answered HTTP {status} ({msg}){after}",
                                  hint="Vast.ai is throttling or unavailable; retry in a minute", status=status)
        return ProviderError(PROVIDER, call, f"Vast.ai answered HTTP {status} ({msg})",
                             hint="check the request (offer id, image, disk) and retry", status=status)

    def request(self, method: str, path: str, call: str, *, json_body: Any = None,
                params: dict[str, Any] | None = None, retry_on: frozenset[int] = RETRY_STATUSES,
                retry_transport: bool = True, accept: frozenset[int] | set[int] = frozenset(),
                attempts: int | None = None, max_s: float | None = None,
                rate_interval_s: float | None = None) -> "httpx.Response":
        """One API call: retried on ``retry_on`` statuses and transport errors (``attempts`` tries in all,
        default ``max_attempts``; at most ``max_s`` seconds when given), then mapped.  ``retry_transport``
        False: a lost connection is not retried (the caller decides whether the request may have been applied).
        ``rate_interval_s``: the endpoint's documented rate-limit interval (seconds; :data:`SEARCH_INTERVAL_S`,
        :data:`CREATE_PENALTY_S`), the wait after a 429 that names none.

        Returns the response when it is 2xx or its status is in ``accept``; raises the mapped broker error
        otherwise (AuthError without a key).
        """
        import httpx
        from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, stop_after_delay

        client = self._http(call)
        tries = attempts if attempts is not None else self.max_attempts
        stop = stop_after_attempt(max(1, tries))
        if max_s is not None:
            stop = stop | stop_after_delay(max_s)
        retryable: tuple[type[BaseException], ...] = (_Retry, httpx.TransportError) if retry_transport else (_Retry,)
        n = 0

        def once() -> httpx.Response:
            nonlocal n
            n += 1
            r = client.request(method, path, json=json_body, params=params)
            if r.status_code in retry_on and not search_quota_exceeded(r):
                delay = retry_after(r)
                if delay is None or delay <= MAX_RETRY_AFTER_S:
                    raise _Retry(r, delay)
            return r

        # the request's method, path and parameters, never its headers (the key is the Authorization header)
        _log.debug("vast %s: %s %s params=%s body=%s", call, method, path, self.scrub(json.dumps(params or {},
                   default=str)), "yes" if json_body is not None else "no")
        t0 = time.monotonic()
        try:
            with self._mapped(call, rate_interval_s):
                try:
                    for attempt in Retrying(stop=stop, wait=lambda st: self._wait(st, rate_interval_s),
                                            retry=retry_if_exception_type(retryable),
                                            sleep=self.sleep, reraise=True):
                        with attempt:
                            r = once()
                except _Retry as exc:
                    raise _Status(exc.response, n) from None
                if not (r.is_success or r.status_code in accept):
                    raise _Status(r, n)
        except ProviderError as e:
            _log.info("vast %s: failed after %d tr%s, %.2f s: %s", call, n, "y" if n == 1 else "ies",
                      time.monotonic() - t0, e.message)
            raise
        _log.info("vast %s: HTTP %d (%d tr%s, %.2f s)", call, r.status_code, n, "y" if n == 1 else "ies",
                  time.monotonic() - t0)
        return r

    def json(self, r: "httpx.Response", call: str) -> Any:
        """The answer's JSON; ProviderError naming ``call`` when it is not JSON (fail closed)."""
        try:
            return r.json()
        except ValueError:
            expect(self.scrub((r.text or "")[:200]), call, "JSON", False)
