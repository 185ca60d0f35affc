"""The injectable clock: a scaled clock runs the time of day N times faster from a chosen
start while monotonic time stays real, and the operator's clock comes from
MATRIXPOOL_CLOCK_START / MATRIXPOOL_CLOCK_SPEED. A fake base clock stands in for time."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrixpool import clock

UTC = dt.UTC
START = dt.datetime(2026, 3, 29, 6, 0, tzinfo=UTC)
REAL_NOW = dt.datetime(2030, 1, 1, tzinfo=UTC)


class FakeClock:
    """Real time that moves only when a test says so."""

    def __init__(self) -> None:
        self.seconds = 1000.0

    def now(self) -> dt.datetime:
        return REAL_NOW + dt.timedelta(seconds=self.seconds - 1000.0)

    def monotonic(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


@pytest.fixture
def real() -> FakeClock:
    return FakeClock()


def test_a_scaled_clock_runs_n_times_faster_from_its_start(real: FakeClock) -> None:
    scaled = clock.ScaledClock(START, 1440, real)
    assert scaled.now() == START
    real.advance(60)
    assert scaled.now() == START + dt.timedelta(days=1)
    assert scaled.now().tzinfo == UTC


def test_monotonic_time_stays_real(real: FakeClock) -> None:
    scaled = clock.ScaledClock(START, 1440, real)
    before = scaled.monotonic()
    real.advance(2.5)
    assert scaled.monotonic() - before == 2.5
    assert scaled.monotonic() == real.monotonic()


def test_a_start_in_another_offset_is_kept_as_the_same_instant_in_utc(real: FakeClock) -> None:
    shanghai = dt.timezone(dt.timedelta(hours=8))
    scaled = clock.ScaledClock(dt.datetime(2026, 3, 29, 14, 0, tzinfo=shanghai), 2, real)
    assert scaled.start == START
    assert scaled.now().tzinfo == UTC


@given(st.floats(0.01, 100_000), st.lists(st.floats(0, 3600), max_size=5), st.floats(-1e6, 1e6))
def test_elapsed_clock_time_is_real_time_times_speed(
    speed: float, steps: list[float], span: float
) -> None:
    real = FakeClock()
    scaled = clock.ScaledClock(START, speed, real)
    for step in steps:
        real.advance(step)
    elapsed = (scaled.now() - START).total_seconds()
    assert elapsed == pytest.approx(sum(steps) * speed, abs=1e-5, rel=1e-9)
    assert scaled.real_seconds(scaled.scaled_seconds(span)) == pytest.approx(span, abs=1e-6)


def test_seconds_until_an_instant_are_real_seconds(real: FakeClock) -> None:
    scaled = clock.ScaledClock(START, 60, real)
    assert clock.seconds_until(scaled, START + dt.timedelta(hours=1)) == 60
    assert clock.seconds_until(scaled, START - dt.timedelta(hours=1)) == 0
    assert clock.seconds_until(real, REAL_NOW + dt.timedelta(hours=1)) == 3600
    assert clock.real_seconds(clock.SYSTEM, 5.0) == 5.0


@pytest.mark.parametrize(
    ("start", "speed", "message"),
    [
        pytest.param(dt.datetime(2026, 1, 1), 1.0, "timezone-aware", id="a naive start"),
        pytest.param(START, 0.0, "clock speed", id="a speed of zero"),
        pytest.param(START, -2.0, "clock speed", id="a negative speed"),
        pytest.param(START, float("inf"), "clock speed", id="an infinite speed"),
        pytest.param(START, float("nan"), "clock speed", id="a speed that is not a number"),
    ],
)
def test_a_scaled_clock_refuses(start: dt.datetime, speed: float, message: str) -> None:
    with pytest.raises(clock.ClockSettingError, match=message):
        clock.ScaledClock(start, speed, FakeClock())


# --- from the environment and settings -------------------------------------------------------
def scaled(made: clock.Clock) -> clock.ScaledClock:
    assert isinstance(made, clock.ScaledClock)
    return made


def test_without_settings_the_base_clock_is_used(real: FakeClock) -> None:
    assert clock.from_env({}, real) is real
    assert clock.from_env({clock.START_ENV: "", clock.SPEED_ENV: ""}, real) is real
    assert clock.from_env({}) is clock.SYSTEM
    assert clock.from_settings(None, None, real) is real


@pytest.mark.parametrize(
    ("env", "start", "speed"),
    [
        pytest.param(
            {clock.START_ENV: "2026-03-29T06:00:00Z", clock.SPEED_ENV: "1440"},
            START,
            1440.0,
            id="a UTC start and a speed",
        ),
        pytest.param({clock.START_ENV: "2026-03-29T06:00"}, START, 1.0, id="a naive start is UTC"),
        pytest.param(
            {clock.START_ENV: "2026-03-29T14:00:00+08:00"},
            START,
            1.0,
            id="a start with an offset is the same instant in UTC",
        ),
        pytest.param({clock.SPEED_ENV: "60"}, REAL_NOW, 60.0, id="a speed alone starts now"),
        pytest.param({clock.SPEED_ENV: " 0.5 "}, REAL_NOW, 0.5, id="a slower clock"),
    ],
)
def test_the_clock_from_the_environment(
    env: dict[str, str], start: dt.datetime, speed: float, real: FakeClock
) -> None:
    made = scaled(clock.from_env(env, real))
    assert (made.start, made.speed) == (start, speed)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        pytest.param({clock.START_ENV: "yesterday"}, clock.START_ENV, id="a start that is no date"),
        pytest.param({clock.SPEED_ENV: "fast"}, clock.SPEED_ENV, id="a speed that is no number"),
        pytest.param({clock.SPEED_ENV: "0"}, clock.SPEED_ENV, id="a speed of zero"),
        pytest.param({clock.SPEED_ENV: "-3"}, clock.SPEED_ENV, id="a negative speed"),
        pytest.param({clock.SPEED_ENV: "inf"}, clock.SPEED_ENV, id="an infinite speed"),
        pytest.param({clock.SPEED_ENV: "nan"}, clock.SPEED_ENV, id="not a number"),
    ],
)
def test_a_bad_environment_names_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(clock.ClockSettingError, match=named):
        clock.from_env(env, FakeClock())


def test_the_clock_from_settings(real: FakeClock) -> None:
    made = scaled(clock.from_settings("2026-03-29T06:00:00Z", 720, real))
    assert (made.start, made.speed) == (START, 720.0)
    assert scaled(clock.from_settings(None, 10, real)).start == REAL_NOW
    assert scaled(clock.from_settings("2026-03-29T06:00", None, real)).speed == 1.0
    with pytest.raises(clock.ClockSettingError, match="clock start"):
        clock.from_settings("noon", None, real)
    with pytest.raises(clock.ClockSettingError, match="clock speed"):
        clock.from_settings(None, 0, real)


def test_the_system_clock_is_aware_utc() -> None:
    assert clock.SYSTEM.now().tzinfo == UTC
