"""The one place matrixpool_recovery reads the wall clock.

Manifests and the daemon's inventory carry a wall-clock time so people can read when a step was
stored; durations everywhere else use ``time.monotonic`` or ``time.perf_counter``.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utc_now_iso() -> str:
    """The current UTC time as an ISO-8601 string with a trailing Z."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
