"""Time-sharing windows: the window in force at an instant and the next boundary, in IANA
zones with and without daylight saving, windows past midnight, and every valid set of windows
covering each minute of the day exactly once."""

from __future__ import annotations

import datetime as dt
import functools
import itertools
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixpool.api import supernode
from matrixpool.timeshare import windows

UTC = dt.UTC
DAY = supernode.MINUTES_PER_DAY
ZONES = (
    "Asia/Shanghai",  # no daylight saving
    "Europe/Berlin",  # +1 / +2, changes at 01:00 UTC
    "America/New_York",  # -5 / -4, changes at 02:00 local
    "Australia/Lord_Howe",  # a half-hour change
    "Asia/Kathmandu",  # +05:45
    "UTC",
)


def sharing(timezone: str, *spans: tuple[str, str, str]) -> supernode.TimeSharing:
    """Windows as (name, start, end); every window caps inference at 10 cards."""
    return supernode.TimeSharing(
        timezone=timezone,
        windows=[
            supernode.TimeWindow(name=name, start=start, end=end, inference_cards=10)
            for name, start, end in spans
        ],
    )


def at(text: str) -> dt.datetime:
    """A UTC instant from "2026-03-29 01:00"."""
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def hhmm(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


DAY_NIGHT = (("day", "08:00", "22:00"), ("night", "22:00", "08:00"))


# --- every valid SuperNode covers each minute of the day exactly once -----------------------
def coverage(time_sharing: supernode.TimeSharing, minutes: range | list[int]) -> list[int]:
    return [sum(w.contains(m) for w in time_sharing.windows) for m in minutes]


def test_the_crd_rules_hold_exactly_for_the_window_sets_that_cover_the_day_once() -> None:
    """Every multiset of up to 4 windows on a 6-hour grid: the two CEL rules (check_cover)
    accept a set if and only if it covers each minute exactly once."""
    grid = [hhmm(h * 60) for h in (0, 6, 12, 18)]
    spans = list(itertools.product(grid, grid))
    accepted = 0
    for size in range(1, 5):
        for chosen in itertools.combinations_with_replacement(spans, size):
            candidate = sharing("UTC", *((f"w{i}", s, e) for i, (s, e) in enumerate(chosen)))
            block_cover = coverage(candidate, [0, 360, 720, 1080])  # boundaries lie on the grid
            try:
                windows.check_cover(candidate)
            except windows.InvalidWindowsError:
                assert block_cover != [1, 1, 1, 1], chosen
                continue
            accepted += 1
            assert coverage(candidate, range(DAY)) == [1] * DAY, chosen
    # The exact covers on 4 grid points: 4 all-day windows, then one partition per set of 2,
    # 3 or 4 cut points.
    assert accepted == 4 + 6 + 4 + 1


@st.composite
def time_sharings(draw: st.DrawFn, zones: tuple[str, ...] = ZONES) -> supernode.TimeSharing:
    """A valid SuperNode's windows: a random partition of the 1440 minutes into 1..6 windows,
    rotated so that one may wrap past midnight."""
    count = draw(st.integers(1, 6))
    cuts = sorted(draw(st.sets(st.integers(1, DAY - 1), min_size=count - 1, max_size=count - 1)))
    rotation = draw(st.integers(0, DAY - 1))
    starts = [(m + rotation) % DAY for m in [0, *cuts]]
    ends = starts[1:] + starts[:1]
    spans = [(f"w{i}", hhmm(s), hhmm(e)) for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
    return sharing(draw(st.sampled_from(zones)), *spans)


instants = st.datetimes(
    min_value=dt.datetime(2025, 1, 1), max_value=dt.datetime(2027, 12, 31), timezones=st.just(UTC)
)


@functools.cache
def offset_changes(timezone: str) -> tuple[dt.datetime, ...]:
    """The hours of 2026 (UTC) in which the zone's offset changes."""
    zone = ZoneInfo(timezone)
    hours = [dt.datetime(2026, 1, 1, tzinfo=UTC) + dt.timedelta(hours=h) for h in range(366 * 24)]
    return tuple(
        b
        for a, b in itertools.pairwise(hours)
        if a.astimezone(zone).utcoffset() != b.astimezone(zone).utcoffset()
    )


@st.composite
def sharings_and_instants(draw: st.DrawFn) -> tuple[supernode.TimeSharing, dt.datetime]:
    """Valid windows and an instant: anywhere in three years, or within 4 hours of a
    daylight-saving change of the windows' zone."""
    time_sharing = draw(time_sharings())
    changes = offset_changes(time_sharing.timezone)
    if not changes or draw(st.booleans()):
        return time_sharing, draw(instants)
    change = draw(st.sampled_from(changes))
    return time_sharing, change + dt.timedelta(seconds=draw(st.integers(-4 * 3600, 4 * 3600)))


@given(time_sharings())
def test_generated_windows_cover_each_minute_once_and_pass_the_crd_rules(
    time_sharing: supernode.TimeSharing,
) -> None:
    windows.check_cover(time_sharing)
    assert coverage(time_sharing, range(DAY)) == [1] * DAY
    for minute in range(0, DAY, 7):
        assert windows.window_of_minute(time_sharing, minute).contains(minute)


# --- the window in force ---------------------------------------------------------------------
def second_pass_jump(zone: ZoneInfo, instant: dt.datetime) -> dt.datetime | None:
    """When ``instant`` shows a repeated (fall-back) local time for the second time: the
    instant the clock went back; else None."""

    def repeated(moment: dt.datetime) -> bool:
        local = moment.astimezone(zone)
        return local.fold == 1 and local.replace(fold=0).utcoffset() != local.utcoffset()

    if not repeated(instant):
        return None
    moment = instant.replace(second=0, microsecond=0)
    while repeated(moment - dt.timedelta(minutes=1)):
        moment -= dt.timedelta(minutes=1)
    return moment


@settings(max_examples=300)
@given(sharings_and_instants())
def test_the_window_in_force_holds_the_minute_the_wall_clock_shows(
    case: tuple[supernode.TimeSharing, dt.datetime],
) -> None:
    """TimeWindow.contains of the local minute, except in the repeated hour of a fall-back
    day, where the window in force when the clock went back stays in force."""
    time_sharing, instant = case
    zone = ZoneInfo(time_sharing.timezone)
    jump = second_pass_jump(zone, instant)
    shown = instant if jump is None else jump - dt.timedelta(microseconds=1)
    window = windows.window_at(time_sharing, instant)
    assert window.contains(windows.local_minute(time_sharing, shown))


@pytest.mark.parametrize(
    ("timezone", "instant", "expected"),
    [
        pytest.param("Asia/Shanghai", "2026-06-01 00:00", "day", id="08:00 in Shanghai is day"),
        pytest.param(
            "Asia/Shanghai", "2026-06-01 13:59", "day", id="21:59 in Shanghai is still day"
        ),
        pytest.param("Asia/Shanghai", "2026-06-01 14:00", "night", id="22:00 starts the night"),
        pytest.param(
            "Asia/Shanghai", "2026-06-01 16:00", "night", id="midnight is inside a night window"
        ),
        pytest.param(
            "Asia/Shanghai", "2026-06-01 23:59", "night", id="07:59 the next morning is night"
        ),
        pytest.param("Europe/Berlin", "2026-01-15 07:00", "day", id="08:00 CET is 07:00 UTC"),
        pytest.param("Europe/Berlin", "2026-07-15 06:00", "day", id="08:00 CEST is 06:00 UTC"),
        pytest.param("Europe/Berlin", "2026-07-15 05:59", "night", id="07:59 CEST is night"),
        pytest.param("America/New_York", "2026-07-15 12:00", "day", id="08:00 EDT is 12:00 UTC"),
        pytest.param("America/New_York", "2026-12-15 12:59", "night", id="07:59 EST is night"),
    ],
)
def test_window_at(timezone: str, instant: str, expected: str) -> None:
    assert windows.window_at(sharing(timezone, *DAY_NIGHT), at(instant)).name == expected


def test_an_instant_in_another_offset_is_the_same_instant() -> None:
    shanghai = dt.datetime(2026, 6, 1, 8, 0, tzinfo=ZoneInfo("Asia/Shanghai"))
    assert windows.window_at(sharing("Asia/Shanghai", *DAY_NIGHT), shanghai).name == "day"


# --- boundaries ------------------------------------------------------------------------------
def scanned_boundaries(
    time_sharing: supernode.TimeSharing, start: dt.datetime, end: dt.datetime
) -> list[tuple[dt.datetime, str]]:
    """The oracle: window_at minute by minute (every offset here is whole minutes)."""
    found = []
    previous = windows.window_at(time_sharing, start).name
    moment = start + dt.timedelta(minutes=1)
    while moment <= end:
        current = windows.window_at(time_sharing, moment).name
        if current != previous:
            found.append((moment, current))
        previous, moment = current, moment + dt.timedelta(minutes=1)
    return found


def listed(time_sharing: supernode.TimeSharing, start: str, end: str) -> list[tuple[str, str]]:
    return [
        (b.at.strftime("%m-%d %H:%M"), b.window.name)
        for b in windows.boundaries(time_sharing, at(start), at(end))
    ]


GAP_WINDOW = (("a", "02:30", "08:00"), ("b", "08:00", "02:30"))
INSIDE_GAP = (("x", "02:15", "02:45"), ("y", "02:45", "02:15"))
ENDS_IN_FOLD = (("a", "00:00", "02:30"), ("b", "02:30", "00:00"))
NY_FOLD = (("early", "01:30", "06:00"), ("rest", "06:00", "01:30"))


@pytest.mark.parametrize(
    ("timezone", "spans", "start", "end", "expected"),
    [
        pytest.param(
            "Asia/Shanghai",
            DAY_NIGHT,
            "2026-03-28 12:00",
            "2026-03-29 23:00",
            [("03-28 14:00", "night"), ("03-29 00:00", "day"), ("03-29 14:00", "night")],
            id="Shanghai has no daylight saving: 08:00 and 22:00 are 00:00 and 14:00 UTC",
        ),
        pytest.param(
            "Europe/Berlin",
            DAY_NIGHT,
            "2026-03-28 12:00",
            "2026-03-30 00:00",
            [("03-28 21:00", "night"), ("03-29 06:00", "day"), ("03-29 20:00", "night")],
            id="Berlin springs forward on 2026-03-29: the day starts an hour earlier in UTC",
        ),
        pytest.param(
            "Europe/Berlin",
            GAP_WINDOW,
            "2026-03-28 12:00",
            "2026-03-30 12:00",
            [
                ("03-29 01:00", "a"),
                ("03-29 06:00", "b"),
                ("03-30 00:30", "a"),
                ("03-30 06:00", "b"),
            ],
            id="a window starting in the skipped hour begins at the jump",
        ),
        pytest.param(
            "Europe/Berlin",
            INSIDE_GAP,
            "2026-03-28 12:00",
            "2026-03-30 12:00",
            [("03-30 00:15", "x"), ("03-30 00:45", "y")],
            id="a window wholly inside the skipped hour does not occur that day",
        ),
        pytest.param(
            "Europe/Berlin",
            DAY_NIGHT,
            "2026-10-24 12:00",
            "2026-10-26 00:00",
            [("10-24 20:00", "night"), ("10-25 07:00", "day"), ("10-25 21:00", "night")],
            id="Berlin falls back on 2026-10-25: the day starts an hour later in UTC",
        ),
        pytest.param(
            "Europe/Berlin",
            GAP_WINDOW,
            "2026-10-24 12:00",
            "2026-10-26 00:00",
            [("10-25 00:30", "a"), ("10-25 07:00", "b")],
            id="a window starting in the repeated hour starts once, at its first showing",
        ),
        pytest.param(
            "Europe/Berlin",
            ENDS_IN_FOLD,
            "2026-10-24 12:00",
            "2026-10-26 00:00",
            [("10-24 22:00", "a"), ("10-25 00:30", "b"), ("10-25 23:00", "a")],
            id="the window in force when the clock goes back stays through the repeated hour",
        ),
        pytest.param(
            "America/New_York",
            DAY_NIGHT,
            "2026-03-07 14:00",
            "2026-03-09 00:00",
            [("03-08 03:00", "night"), ("03-08 12:00", "day")],
            id="New York springs forward on 2026-03-08",
        ),
        pytest.param(
            "America/New_York",
            NY_FOLD,
            "2026-10-31 12:00",
            "2026-11-02 12:00",
            [
                ("11-01 05:30", "early"),
                ("11-01 11:00", "rest"),
                ("11-02 06:30", "early"),
                ("11-02 11:00", "rest"),
            ],
            id="New York falls back on 2026-11-01: 01:30 EDT starts the window once",
        ),
        pytest.param(
            "Australia/Lord_Howe",
            (("early", "01:45", "06:00"), ("rest", "06:00", "01:45")),
            "2026-04-04 00:00",
            "2026-04-05 12:00",
            [("04-04 14:45", "early"), ("04-04 19:30", "rest")],
            id="Lord Howe falls back half an hour on 2026-04-05",
        ),
    ],
)
def test_boundaries_across_daylight_saving(
    timezone: str,
    spans: tuple[tuple[str, str, str], ...],
    start: str,
    end: str,
    expected: list[tuple[str, str]],
) -> None:
    time_sharing = sharing(timezone, *spans)
    assert listed(time_sharing, start, end) == expected
    scanned = scanned_boundaries(time_sharing, at(start), at(end))
    assert [(m.strftime("%m-%d %H:%M"), name) for m, name in scanned] == expected


def test_a_single_all_day_window_has_no_boundary() -> None:
    all_day = sharing("Europe/Berlin", ("all", "06:00", "06:00"))
    assert windows.next_boundary(all_day, at("2026-03-29 00:00")) is None


def test_the_next_boundary_of_an_instant_on_a_boundary_is_the_one_after() -> None:
    boundary = windows.next_boundary(sharing("Asia/Shanghai", *DAY_NIGHT), at("2026-06-01 00:00"))
    assert boundary is not None
    assert (boundary.at, boundary.window.name) == (at("2026-06-01 14:00"), "night")


@settings(max_examples=300)
@given(sharings_and_instants(), st.floats(0, 1))
def test_the_next_boundary_is_the_first_change_after_the_instant(
    case: tuple[supernode.TimeSharing, dt.datetime], fraction: float
) -> None:
    time_sharing, instant = case
    boundary = windows.next_boundary(time_sharing, instant)
    if len(time_sharing.windows) == 1:
        assert boundary is None
        return
    assert boundary is not None
    assert boundary.at > instant
    assert boundary.at.tzinfo == UTC
    just_before = boundary.at - dt.timedelta(microseconds=1)
    assert windows.window_at(time_sharing, boundary.at) == boundary.window
    assert windows.window_at(time_sharing, just_before) != boundary.window
    between = instant + (boundary.at - instant) * fraction
    if between < boundary.at:
        assert windows.window_at(time_sharing, between) == windows.window_at(time_sharing, instant)


@settings(max_examples=50)
@given(sharings_and_instants())
def test_each_window_starts_at_most_once_per_local_day(
    case: tuple[supernode.TimeSharing, dt.datetime],
) -> None:
    time_sharing, instant = case
    zone = ZoneInfo(time_sharing.timezone)
    found = windows.boundaries(time_sharing, instant, instant + dt.timedelta(days=3))
    starts = [(b.window.name, b.at.astimezone(zone).date()) for b in found]
    assert len(starts) == len(set(starts))
    assert all(a.at < b.at for a, b in itertools.pairwise(found))


# --- errors ----------------------------------------------------------------------------------
def test_an_unknown_timezone_is_reported_with_the_field() -> None:
    with pytest.raises(windows.UnknownTimezoneError, match=r"spec\.timeSharing\.timezone"):
        windows.window_at(sharing("Mars/Olympus_Mons", *DAY_NIGHT), at("2026-06-01 00:00"))


def test_a_naive_instant_is_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        windows.window_at(sharing("UTC", *DAY_NIGHT), dt.datetime(2026, 6, 1))


@pytest.mark.parametrize(
    "spans",
    [
        pytest.param((("day", "08:00", "22:00"),), id="a gap between the end and the start"),
        pytest.param(
            (("a", "08:00", "22:00"), ("b", "20:00", "08:00")), id="two windows overlapping"
        ),
    ],
)
def test_windows_that_do_not_cover_the_day_once_are_refused(
    spans: tuple[tuple[str, str, str], ...],
) -> None:
    with pytest.raises(windows.InvalidWindowsError):
        windows.next_boundary(sharing("UTC", *spans), at("2026-06-01 00:00"))
