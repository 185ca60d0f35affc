"""The one injectable clock. No other module reads the wall clock.

The operator, the time-sharing policy, the demo and the tests take a :class:`Clock`; production
code gets :data:`SYSTEM`. :class:`ScaledClock` starts the time of day at a chosen instant and
runs it N times faster, so tests and the demo can run a day in a minute: ``matrixpool run
--clock-start ISO --clock-speed N`` sets ``MATRIXPOOL_CLOCK_START`` / ``MATRIXPOOL_CLOCK_SPEED``
and the operator builds its clock with :func:`from_env`. Only window arithmetic reads the scaled
``now()``; ``monotonic()`` stays real seconds, so grace periods and timeouts do not speed up.

Errors::

    ValueError
     └── ClockSettingError   a clock start or speed that cannot be used (names the setting)
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Mapping
from typing import Protocol

START_ENV = "MATRIXPOOL_CLOCK_START"  # ISO 8601 instant the scaled clock starts at; naive: UTC
SPEED_ENV = "MATRIXPOOL_CLOCK_SPEED"  # how many times faster than real time it runs


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


class ClockSettingError(ValueError):
    """A clock start or speed that cannot be used; the message names the setting."""


class ScaledClock:
    """Wall time that starts at ``start`` and runs ``speed`` times faster than ``base``.

    ``now()`` is ``start + (real seconds since creation) x speed``; ``monotonic()`` is the base
    clock's, in real seconds.
    """

    def __init__(self, start: datetime.datetime, speed: float, base: Clock = SYSTEM) -> None:
        if start.tzinfo is None or start.utcoffset() is None:
            raise ClockSettingError(f"clock start {start.isoformat()} must be timezone-aware")
        self._start = start.astimezone(datetime.UTC)
        self._speed = _checked_speed(speed, "clock speed")
        self._base = base
        self._origin = base.monotonic()  # real seconds at `start`

    @property
    def start(self) -> datetime.datetime:
        return self._start

    @property
    def speed(self) -> float:
        return self._speed

    def now(self) -> datetime.datetime:
        elapsed = self.scaled_seconds(self._base.monotonic() - self._origin)
        return self._start + datetime.timedelta(seconds=elapsed)

    def monotonic(self) -> float:
        """Real seconds: deadlines and grace periods do not speed up."""
        return self._base.monotonic()

    def scaled_seconds(self, real: float) -> float:
        """Clock seconds that pass in ``real`` real seconds."""
        return real * self._speed

    def real_seconds(self, scaled: float) -> float:
        """Real seconds it takes the clock to advance ``scaled`` seconds."""
        return scaled / self._speed

    def __repr__(self) -> str:
        return f"ScaledClock(start={self._start.isoformat()}, speed={self._speed:g})"


def real_seconds(clock: Clock, scaled: float) -> float:
    """Real seconds it takes ``clock`` to advance ``scaled`` seconds (the same, unscaled)."""
    return clock.real_seconds(scaled) if isinstance(clock, ScaledClock) else scaled


def seconds_until(clock: Clock, instant: datetime.datetime) -> float:
    """Real seconds until ``clock`` shows ``instant`` (0 if it has passed): how long to wait
    for a window boundary."""
    return max(0.0, real_seconds(clock, (instant - clock.now()).total_seconds()))


def from_settings(start: str | None, speed: float | None, base: Clock = SYSTEM) -> Clock:
    """``base`` when neither is set; else a ScaledClock from ``start`` (ISO 8601, naive: UTC;
    default: base's now) at ``speed`` (default 1)."""
    began = None if start is None else parse_start(start, "clock start")
    rate = None if speed is None else _checked_speed(speed, "clock speed")
    return _scaled(began, rate, base)


def from_env(environ: Mapping[str, str] | None = None, base: Clock = SYSTEM) -> Clock:
    """The clock ``MATRIXPOOL_CLOCK_START`` / ``MATRIXPOOL_CLOCK_SPEED`` ask for, as
    :func:`from_settings` builds it (an empty variable is unset); errors name the variable."""
    env = os.environ if environ is None else environ
    start, speed = env.get(START_ENV) or None, env.get(SPEED_ENV) or None
    began = None if start is None else parse_start(start, START_ENV)
    rate = None if speed is None else parse_speed(speed, SPEED_ENV)
    return _scaled(began, rate, base)


def _scaled(start: datetime.datetime | None, speed: float | None, base: Clock) -> Clock:
    if start is None and speed is None:
        return base
    began = base.now() if start is None else start
    return ScaledClock(began, 1.0 if speed is None else speed, base)


def parse_start(text: str, setting: str) -> datetime.datetime:
    """An ISO 8601 instant, in UTC; a value without an offset is read as UTC."""
    try:
        instant = datetime.datetime.fromisoformat(text.strip())
    except ValueError as error:
        raise ClockSettingError(f"{setting}={text!r} is not an ISO 8601 instant") from error
    if instant.tzinfo is None:
        instant = instant.replace(tzinfo=datetime.UTC)
    return instant.astimezone(datetime.UTC)


def parse_speed(text: str, setting: str) -> float:
    """A speed factor: a finite number above 0."""
    try:
        value = float(text)
    except ValueError as error:
        raise ClockSettingError(f"{setting}={text!r} is not a number") from error
    return _checked_speed(value, setting)


def _checked_speed(speed: float, setting: str) -> float:
    if not (math.isfinite(speed) and speed > 0):
        raise ClockSettingError(f"{setting}={speed!r} must be a finite number above 0")
    return float(speed)


_OPERATOR: Clock | None = None


def operator() -> Clock:
    """The clock of this operator process: from MATRIXPOOL_CLOCK_START/SPEED on first use
    (``matrixpool run --clock-start/--clock-speed`` set them), else the system clock."""
    global _OPERATOR
    if _OPERATOR is None:
        _OPERATOR = from_env()
    return _OPERATOR
