"""A clock the tests set by hand (the watchdog and the accounting take any ``() -> datetime``)."""

from __future__ import annotations

from datetime import datetime, timedelta

from broker.core.model import utcnow


class FakeClock:
    """A settable clock for tests: ``clock()`` returns ``start`` plus what :meth:`advance` added."""

    def __init__(self, start: datetime | None = None):
        self.now = start or utcnow()

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now = self.now + timedelta(seconds=seconds)
        return self.now
