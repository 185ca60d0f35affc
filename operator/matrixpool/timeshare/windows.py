"""Which time-sharing window of a SuperNode is in force at an instant, and when the next starts.

Called by the SuperNode handlers (status ``window`` and ``nextTransition``) and by the
time-sharing transitions, with instants from :mod:`matrixpool.clock`. Pure.

Rules (window times are local wall-clock times in ``spec.timeSharing.timezone``):
1. Every local day, each window starts once: at the first instant a wall clock in the zone
   shows its start time. The window in force is the one that started last; when two start at
   the same instant, the later start time of day wins.
2. So outside daylight-saving changes the window in force is the one holding the minute of the
   day the wall clock shows (``TimeWindow.contains``), windows past midnight included.
3. Spring forward: a start time the clock skips begins at the jump; a window lying wholly in
   the skipped hour does not occur that day (its neighbour runs on).
4. Fall back: a start time shown twice counts at its first showing, and the window in force when
   the clock goes back stays in force through the repeated hour. Boundaries never repeat, so a
   boundary is never followed by a second checkpoint-and-evict an hour later.
5. A boundary is an instant where the window in force changes; with a single all-day window
   there is none.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from typing import NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from matrixpool.api import supernode

UTC = dt.UTC
# Local days looked back for the window in force and ahead for the next boundary: a window
# lasts under a day, but one skipped by a spring-forward gap lets its neighbour run for almost
# two.
_DAYS_BACK, _DAYS_AHEAD = 2, 3


class UnknownTimezoneError(ValueError):
    """spec.timeSharing.timezone names no zone of the tz database."""


class InvalidWindowsError(ValueError):
    """The windows do not cover the day exactly once (the CRD's rules forbid this)."""


class Boundary(NamedTuple):
    """An instant where a different window comes into force."""

    at: dt.datetime  # aware, UTC
    window: supernode.TimeWindow  # the window in force from `at`


def zone_of(time_sharing: supernode.TimeSharing) -> ZoneInfo:
    """The SuperNode's time zone; UnknownTimezoneError if the tz database lacks it."""
    try:
        return ZoneInfo(time_sharing.timezone)
    except (ZoneInfoNotFoundError, ValueError) as error:
        raise UnknownTimezoneError(
            f"spec.timeSharing.timezone {time_sharing.timezone!r} is not a known IANA zone"
        ) from error


def window_of_minute(time_sharing: supernode.TimeSharing, minute: int) -> supernode.TimeWindow:
    """The window holding a local minute of the day (0..1439)."""
    for window in time_sharing.windows:
        if window.contains(minute):
            return window
    raise InvalidWindowsError(f"no spec.timeSharing.windows entry holds local minute {minute}")


def check_cover(time_sharing: supernode.TimeSharing) -> None:
    """InvalidWindowsError unless the windows cover the day exactly once.

    The CRD's two rules, which together prove the cover (see ``supernode.TimeSharing``): the
    durations add up to a day, and every window ends where exactly one window starts.
    """
    windows = time_sharing.windows
    if sum(w.duration_minutes for w in windows) != supernode.MINUTES_PER_DAY:
        raise InvalidWindowsError("spec.timeSharing.windows durations do not add up to 24h")
    for window in windows:
        if sum(other.start_minute == window.end_minute for other in windows) != 1:
            raise InvalidWindowsError(
                f"spec.timeSharing.windows {window.name!r} does not end where exactly one"
                " window starts"
            )


def local_minute(time_sharing: supernode.TimeSharing, instant: dt.datetime) -> int:
    """The minute of the day a wall clock in the SuperNode's zone shows at ``instant``."""
    local = utc(instant).astimezone(zone_of(time_sharing))
    return local.hour * 60 + local.minute


def window_at(time_sharing: supernode.TimeSharing, instant: dt.datetime) -> supernode.TimeWindow:
    """The window in force at an aware instant (rule 1)."""
    at = utc(instant)
    in_force = [start for start in _timeline(time_sharing, at, -_DAYS_BACK, 0) if start.at <= at]
    return in_force[-1].window


def next_boundary(time_sharing: supernode.TimeSharing, instant: dt.datetime) -> Boundary | None:
    """The first boundary strictly after ``instant``; None when one window holds the whole day."""
    at = utc(instant)
    current = window_at(time_sharing, at).name
    for start in _timeline(time_sharing, at, 0, _DAYS_AHEAD):
        if start.at > at and start.window.name != current:
            return start
    return None


def boundaries(
    time_sharing: supernode.TimeSharing, start: dt.datetime, end: dt.datetime
) -> list[Boundary]:
    """Every boundary in ``(start, end]``, in order."""
    return list(_walk(time_sharing, utc(start), utc(end)))


def utc(instant: dt.datetime) -> dt.datetime:
    """An aware instant in UTC; ValueError for a naive one."""
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError(f"instant {instant.isoformat()} must be timezone-aware")
    return instant.astimezone(UTC)


def _walk(
    time_sharing: supernode.TimeSharing, start: dt.datetime, end: dt.datetime
) -> Iterator[Boundary]:
    boundary = next_boundary(time_sharing, start)
    while boundary is not None and boundary.at <= end:
        yield boundary
        boundary = next_boundary(time_sharing, boundary.at)


def _timeline(
    time_sharing: supernode.TimeSharing, instant: dt.datetime, first: int, last: int
) -> list[Boundary]:
    """The window starts of local days ``first..last`` around the instant's day, in order.

    At an instant shared by several starts only the one in force remains (rule 1); consecutive
    starts of the same window are not merged.
    """
    check_cover(time_sharing)
    zone = zone_of(time_sharing)
    today = instant.astimezone(zone).date()
    days = [today + dt.timedelta(days=offset) for offset in range(first, last + 1)]
    starts = sorted(
        (_start_instant(zone, day, window.start_minute), day, window.start_minute, index)
        for day in days
        for index, window in enumerate(time_sharing.windows)
    )
    return _last_per_instant([(at, time_sharing.windows[i]) for at, _, _, i in starts])


def _last_per_instant(starts: Sequence[tuple[dt.datetime, supernode.TimeWindow]]) -> list[Boundary]:
    return [
        Boundary(at, window)
        for position, (at, window) in enumerate(starts)
        if position + 1 == len(starts) or starts[position + 1][0] != at
    ]


def _start_instant(zone: ZoneInfo, day: dt.date, minute: int) -> dt.datetime:
    """The first instant a wall clock in ``zone`` shows ``day`` at ``minute`` or later."""
    wall = dt.datetime.combine(day, dt.time(minute // 60, minute % 60))
    readings = sorted({wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1)})
    shown = [at for at in readings if at.astimezone(zone).replace(tzinfo=None) == wall]
    if shown:
        return shown[0]  # the first showing of a repeated time
    return _offset_change(zone, readings[0], readings[-1])  # skipped: the jump over it


def _offset_change(zone: ZoneInfo, before: dt.datetime, after: dt.datetime) -> dt.datetime:
    """The whole second in ``(before, after]`` from which ``after``'s UTC offset holds.

    ``before`` and ``after`` are whole seconds apart with one offset change between them; the
    tz database states changes in whole seconds.
    """
    offset = after.astimezone(zone).utcoffset()
    low, high = 0, int((after - before).total_seconds())
    while high - low > 1:
        middle = (low + high) // 2
        if (before + dt.timedelta(seconds=middle)).astimezone(zone).utcoffset() == offset:
            high = middle
        else:
            low = middle
    return before + dt.timedelta(seconds=high)
