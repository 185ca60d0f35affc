"""The one injectable clock. No other module reads the wall clock.

The operator, the time-sharing policy, the demo and the tests take a :class:`Clock`; production
code gets :data:`SYSTEM`. A scaled clock for running a day in a minute comes with time-sharing.
"""

from __future__ import annotations

import datetime
import time
from typing import Protocol


class Clock(Protocol):
    """Where time comes from."""

    def now(self) -> datetime.datetime:
        """The current instant, timezone-aware (UTC)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a monotonic scale, for durations and deadlines."""
        ...


class SystemClock:
    """The machine's clock."""

    def now(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.UTC)

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM: Clock = SystemClock()
