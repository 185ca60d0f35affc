"""What the recovery controller remembers between passes, by job UID (:class:`State`, owned by
the main loop's ``Controllers``, safe to lose), and the delay of a job whose recovery step keeps
failing (:func:`backoff_delay`). Bookkeeping only: every module of
:mod:`matrixpool.controllers.recovery` reads and writes it; it acts on nothing.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass, field

from matrixpool.controllers import background

UNREACHABLE_AFTER = 2.0  # seconds a daemon must stay silent (about 4 probes) to count as lost
BACKOFF_FIRST = 1.0  # seconds before a failed recovery step of a job is tried again ...
BACKOFF_MAX = 300.0  # ... doubling with each failure in a row, up to this


@dataclass
class State:
    """What the recovery controller remembers between loops, by job UID (safe to lose). Owned
    by the main loop."""

    silent_since: dict[str, float] = field(default_factory=dict)  # node → first failed probe
    probed_at: float = float("-inf")
    idle_probed_at: float = float("-inf")
    polled_at: dict[str, float] = field(default_factory=dict)  # job → last checkpoints poll
    checkpoints: dict[str, dict[str, int | None]] = field(default_factory=dict)  # job → written
    recorded: set[str] = field(default_factory=set)  # recovery ids appended to status
    # job → when its first fault showed (monotonic, for the settle window; wall, detectedAt)
    first_seen: dict[str, tuple[float, datetime.datetime]] = field(default_factory=dict)
    deferred: dict[str, float] = field(default_factory=dict)  # job → when it may be tried again
    # job UID → (failed steps in a row, monotonic time before which it is not tried again)
    backoff: dict[str, tuple[int, float]] = field(default_factory=dict)
    tasks: background.Tasks = field(default_factory=background.Tasks)  # probe, polls by job

    def unreachable(self, now: float) -> frozenset[str]:
        return frozenset(n for n, t in self.silent_since.items() if now - t >= UNREACHABLE_AFTER)

    def silent(self, nodes: Iterable[str], now: float) -> None:
        """Daemons that did not answer an inventory request: unreachable at once."""
        for node in nodes:
            self.silent_since[node] = min(self.silent_since.get(node, now), now - UNREACHABLE_AFTER)

    def failed(self, uid: str, now: float) -> float:
        """One more failed step of job ``uid``: the seconds it now waits."""
        failures = self.backoff.get(uid, (0, now))[0] + 1
        delay = backoff_delay(failures)
        self.backoff[uid] = (failures, now + delay)
        return delay

    def backing_off(self, uid: str, now: float) -> bool:
        return self.backoff.get(uid, (0, float("-inf")))[1] > now

    def forget(self, uid: str, key: str) -> None:
        """Drop what is remembered of the job ``uid`` (it went, or its name was reused; kept
        by UID only, not by ``key``)."""
        for remembered in (
            self.polled_at,
            self.checkpoints,
            self.first_seen,
            self.deferred,
            self.backoff,
        ):
            remembered.pop(uid, None)
        self.tasks.cancel(uid)


def backoff_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` failed steps in a row: BACKOFF_FIRST, doubling with
    each failure, at most BACKOFF_MAX."""
    return float(min(BACKOFF_FIRST * 2 ** min(failures - 1, 32), BACKOFF_MAX))
