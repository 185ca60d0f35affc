"""A clock the unit tests move by hand (``matrixpool.clock.SYSTEM`` replaced)."""

from __future__ import annotations

from typing import Any

from matrixpool import clock


class Ticking:
    """The system clock with a monotonic time the test moves."""

    def __init__(self) -> None:
        self.at = 1000.0

    def now(self) -> Any:
        return clock.SystemClock().now()

    def monotonic(self) -> float:
        return self.at
