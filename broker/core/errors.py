"""Broker's error classes: what the core and the CLI react to, and the exit code each one ends with.

Free of pydantic (and of every other third-party import) so that the CLI's error boundary and ``broker --help``
load it for free.  :mod:`broker.core.provider` re-exports every name here; both import paths work.

Exit codes (docs/design.md, README): 0 success, 1 the job failed, 2 bad input, 3 no valid plan, 4 provider error,
130 interrupted (SIGINT), 143 / 129 terminated by SIGTERM / SIGHUP (after teardown), 141 stdout closed early (``broker offers | head -1``: quiet, as git and cat end there).
"""

from __future__ import annotations

from typing import Any, Callable

#: exit code of each outcome (the CLI's error boundary and the README use these)
EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NO_PLAN = 3
EXIT_PROVIDER = 4
EXIT_INTERRUPTED = 130
#: 128 + the signal number, as a shell reports a process ended by it; broker exits so only after its teardown
EXIT_SIGTERM = 143
EXIT_SIGHUP = 129
#: the reader of stdout (or stderr) went away (a pipe into ``head``): 128 + SIGPIPE, what the shell reports for
#: ``git log | head -1`` or ``cat big | head -1``; nothing is printed
EXIT_BROKEN_PIPE = 141


class OutputClosed(SystemExit):
    """stdout's (or stderr's) reader went away while broker wrote to it (``broker offers | head -1``): the command
    ends as if killed by SIGPIPE, quietly, with exit code :data:`EXIT_BROKEN_PIPE`.  A SystemExit, so that no
    ``except Exception`` below the CLI takes it for a failure of the job (``finally`` blocks, teardown among them,
    still run; their output goes to /dev/null)."""

    def __init__(self) -> None:
        super().__init__(EXIT_BROKEN_PIPE)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, systemd) or SIGHUP (the terminal or ssh session closed) as an interrupt: a
    KeyboardInterrupt, so that every path that tears down after Ctrl-C runs for them too; the CLI then exits with
    ``exit_code`` (128 + ``signum``: 143 / 129) and a sentence naming the signal."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        try:
            self.signame = signal.Signals(signum).name
        except ValueError:
            self.signame = f"signal {signum}"

    def __str__(self) -> str:
        return self.signame


class BrokerError(Exception):
    """Base of broker's errors; ``exit_code`` follows docs/design.md (2 bad input, 3 no plan, 4 provider error)."""

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # message + what to do
        return f"{self.message}" + (f"\n  -> {self.hint}" if self.hint else "")


class BadInput(BrokerError):
    """The user's recipe, flags or files are wrong (exit 2)."""

    exit_code = 2


class NoValidPlan(BrokerError):
    """No option fits budget, quota and capacity (exit 3)."""

    exit_code = 3


class ProviderError(BrokerError):
    """A provider call failed (exit 4).  ``provider`` and ``call`` name what failed."""

    exit_code = 4
    #: True when a create may have happened although it failed (see :class:`AmbiguousCreate`).
    ambiguous: bool = False
    #: Seconds the provider asked to wait before the next try (its ``Retry-After``, or the adapter's reading of its
    #: documented rate limit); None when it named none.  Every retry loop of the core waits at least this.
    retry_after_s: float | None = None

    def __init__(self, provider: str, call: str, message: str, *, hint: str | None = None,
                 code: str | None = None, status: int | None = None):
        super().__init__(f"{provider}: {call} failed: {message}", hint=hint)
        self.provider = provider
        self.call = call
        self.code = code
        self.status = status


class CapacityError(ProviderError):
    """Out of host capacity / insufficient capacity: fail over to the next zone or offer."""


class QuotaError(ProviderError):
    """A service limit / quota blocks the create: skip only the limit's scope; suggest a quota request.

    ``scope``: where the limit applies below the region: the availability domain for OCI GPU limits (AD-scoped),
    None for a region-wide limit (AWS Service Quotas; the core then skips the options of that region that the same
    limit covers, e.g. only the G-family bucket ``L-DB2E81BA``, never the P family).  ``limit_name``: the OCI limit
    name / AWS quota code when the adapter knows it (else the core derives it from the instance type,
    :func:`broker.plan.quota.limit_for`).  ``limit`` / ``used``: the limit's value and current use in that scope, in its
    unit (GPUs for OCI, vCPUs for AWS), when the adapter read them: the core then suggests the new limit as
    ``limit + (what the job needs there - what is available there)``.
    """

    def __init__(self, provider: str, call: str, message: str, *, hint: str | None = None,
                 code: str | None = None, status: int | None = None, scope: str | None = None,
                 limit_name: str | None = None, limit: float | None = None, used: float | None = None):
        super().__init__(provider, call, message, hint=hint, code=code, status=status)
        self.scope = scope
        self.limit_name = limit_name
        self.limit = limit
        self.used = used


class OfferGone(ProviderError):
    """The Vast.ai offer was rented by someone else (or vanished) between search and create."""


class AuthError(ProviderError):
    """Credentials missing or rejected: the provider is unusable until configured (hint says how).  Exit 4 on
    every command, also when the plan itself fits (a price snapshot's option that no configured provider can
    rent is a provider that is not configured, not a plan that does not fit)."""


class TransientError(ProviderError):
    """Throttling (429), 5xx or a network blip: retry with backoff."""


class AmbiguousCreate(TransientError):
    """A create whose outcome is unknown: the request may have reached the provider (5xx, timeout, an answer
    without an id) and a list by the intent's tag / label could not settle it.  An instance may exist and bill.
    Never create again for this intent: record it as ``unknown``, stop creating on this provider and keep it in
    ``status`` until a later :meth:`broker.core.provider.Provider.list_tagged` (``TaggedResource.client_token`` = the
    ledger row id) proves it absent or finds it to terminate."""

    ambiguous = True


class NotSupported(ProviderError):
    """The adapter does not implement this verb."""


def retry_after_wait(base: "Callable[[Any], float]", cap_s: float = 120.0) -> "Callable[[Any], float]":
    """A tenacity ``wait``: the failed try's :attr:`ProviderError.retry_after_s` (at most ``cap_s`` seconds) when
    the provider named one, else ``base`` (e.g. ``wait_exponential(...)``)."""

    def wait(state: Any) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        ra = getattr(exc, "retry_after_s", None)
        if isinstance(ra, (int, float)) and not isinstance(ra, bool) and ra >= 0:
            return min(float(ra), cap_s)
        return base(state)

    return wait
