"""A serving load as data: when requests arrive, how long their prompts and outputs are, and
which of them share a common prefix.

Called by the load generator (:mod:`matrixpool.serving.loadgen`), the serving benchmark and
the tests, which send or simulate the requests it returns. Pure and deterministic: the same
pattern, lengths, window and seed give the same requests, and arrival times never depend on
any response (open loop). Standard library only.

The model, each parameter with its source or marked as an assumption:

- **Daily curve** (:class:`DailyPattern`): rate = ``peak_rps x (trough + (1 - trough) x bump)``
  where ``bump`` is the highest of a few Gaussian bumps over the time of day. That production
  LLM services see a diurnal load, low at night and high in working hours, is reported for
  Azure's LLM inference services in the one-week Azure LLM inference trace 2024 (DynamoLLM,
  Stojkovic et al., arXiv 2408.00741) and for Azure OpenAI GPT services in BurstGPT (Wang et
  al., arXiv 2401.17644). The shape used here is an assumption, not a fit: trough 15% of the
  peak, peaks at 11:00 (full height) and 15:30 (90%), each about two hours wide, a dip between.
- **Bursts** (:class:`Bursts`): BurstGPT reports bursts on top of the periodic pattern. Here
  they start as a Poisson process (default 2 per hour) and each adds Poisson arrivals at
  ``size x peak_rps`` (default 0.5) for ``duration_s`` (default 60 s): all three are
  assumptions.
- **Lengths** (:class:`LengthModel`): lognormal, rounded and clipped to bounds. Medians from
  the Azure LLM inference trace 2023 "conversation" as reported by Splitwise (Patel et al.,
  arXiv 2311.18677, ISCA 2024): prompt 1020 tokens, output 129 tokens. The spreads (sigma 1.0
  for prompts, 0.9 for outputs: a p90 of about 3.6x and 3.2x the median) and the bounds
  (prompts 8192, outputs 2048) are assumptions.
- **Shared prefixes**: a share of requests (``shared_prefix_share``, default 0) starts with one
  of ``prefix_count`` common prefixes (default 8) of ``prefix_tokens`` tokens (default 512, a
  system prompt's size; assumption), chosen uniformly; the same prefix is the same token ids.
  Such a prompt is the prefix and then ``max(L - prefix_tokens, 1)`` fresh tokens, where ``L``
  is the drawn prompt length.
- Token ids are uniform in ``0..65535``; the server only counts them and hashes prefixes.

Arrivals are a non-homogeneous Poisson process drawn by thinning (Lewis and Shedler 1979):
candidates at the pattern's ceiling rate, each kept with probability ``rate(t) / ceiling``.
Arrivals, bursts, lengths, prefix choices and token ids are drawn from separate random
streams, so changing the lengths leaves the arrival times alone, adding bursts only adds
arrivals, and a prefix share leaves the drawn lengths alone.

Errors: ``ValueError`` for a parameter out of range (raised when the object is built).
"""

from __future__ import annotations

import math
import operator
import random
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

DAY_S = 86_400.0
TOKEN_ID_BYTES = 2  # token ids are uniform 16-bit values, 0..65535
_TOKEN_IDS = tuple(range(1 << (8 * TOKEN_ID_BYTES)))  # shared int objects: 8 bytes a token


@dataclass(frozen=True)
class Request:
    """One request of a workload."""

    id: int  # 0, 1, ... in arrival order within one generated window
    arrival_s: float  # seconds after the window's start (``start_s`` of :func:`generate`)
    prompt: tuple[int, ...]  # token ids; a shared prefix is the same ids in every request
    output_tokens: int  # tokens to generate (sent as max_tokens)
    prefix_id: int | None  # which common prefix the prompt starts with; None: none


@dataclass(frozen=True)
class Bursts:
    """Extra arrivals in short bursts on top of a curve (all three values: assumptions)."""

    per_hour: float = 2.0  # mean bursts started per hour, a Poisson process
    duration_s: float = 60.0  # length of one burst
    size: float = 0.5  # extra arrival rate in a burst, as a multiple of the curve's ceiling

    def __post_init__(self) -> None:
        if self.per_hour < 0 or self.duration_s <= 0 or self.size < 0:
            raise ValueError("bursts: need per_hour >= 0, duration_s > 0, size >= 0")


@dataclass(frozen=True)
class Peak:
    """A Gaussian bump of the daily curve."""

    hour: float  # time of day of its top, 0..24
    width_h: float  # standard deviation, hours
    height: float  # its top as a share of the way from the trough to the peak rate, 0..1

    def __post_init__(self) -> None:
        if not (0 <= self.hour < 24 and self.width_h > 0 and 0 <= self.height <= 1):
            raise ValueError("peak: need 0 <= hour < 24, width_h > 0, 0 <= height <= 1")

    def at(self, hour: float) -> float:
        distance = abs(hour - self.hour) % 24
        distance = min(distance, 24 - distance)  # the day wraps: 23:00 is 2 h from 01:00
        return self.height * math.exp(-0.5 * (distance / self.width_h) ** 2)


WORKDAY_PEAKS = (Peak(11.0, 2.0, 1.0), Peak(15.5, 2.5, 0.9))  # assumption, see the docstring


class Pattern(Protocol):
    """An arrival-rate curve over time (seconds from midnight), with optional bursts."""

    @property
    def bursts(self) -> Bursts | None: ...

    def rate(self, t_s: float) -> float:
        """Requests per second at ``t_s``, bursts not counted."""
        ...

    def ceiling(self) -> float:
        """An upper bound of :meth:`rate` at any time (the thinning rate)."""
        ...


@dataclass(frozen=True)
class DailyPattern:
    """A day's load: low at night, peaks in working hours, scaled by a peak rate."""

    peak_rps: float  # requests per second at the top of the highest bump of height 1
    trough: float = 0.15  # the night rate as a share of peak_rps (assumption)
    peaks: tuple[Peak, ...] = WORKDAY_PEAKS
    bursts: Bursts | None = Bursts()

    def __post_init__(self) -> None:
        if self.peak_rps < 0 or not 0 <= self.trough <= 1:
            raise ValueError("daily pattern: need peak_rps >= 0 and 0 <= trough <= 1")

    def rate(self, t_s: float) -> float:
        hour = (t_s % DAY_S) / 3600
        bump = max((peak.at(hour) for peak in self.peaks), default=0.0)
        return self.peak_rps * (self.trough + (1 - self.trough) * bump)

    def ceiling(self) -> float:
        return self.peak_rps


@dataclass(frozen=True)
class StepPattern:
    """A rate that steps through levels, each held ``step_seconds``; the last one stays."""

    levels: tuple[float, ...]  # requests per second of each step, in order
    step_seconds: float  # how long each level lasts
    bursts: Bursts | None = None

    def __post_init__(self) -> None:
        if not self.levels or min(self.levels) < 0 or self.step_seconds <= 0:
            raise ValueError("step pattern: need levels >= 0 (at least one), step_seconds > 0")

    def rate(self, t_s: float) -> float:
        step = min(max(int(t_s // self.step_seconds), 0), len(self.levels) - 1)
        return self.levels[step]

    def ceiling(self) -> float:
        return max(self.levels)


def step_pattern(levels: Sequence[float], step_seconds: float) -> StepPattern:
    """A stepped load for scaling tests: ``levels[i]`` rps from ``i x step_seconds`` on."""
    return StepPattern(tuple(float(level) for level in levels), step_seconds)


@dataclass(frozen=True)
class Lognormal:
    """A length distribution: ``round(exp(N(ln median, sigma)))`` clipped to ``low..high``."""

    median: float  # tokens
    sigma: float  # standard deviation of the log
    low: int  # smallest length
    high: int  # largest length

    def __post_init__(self) -> None:
        if not (1 <= self.low <= self.median <= self.high and self.sigma >= 0):
            raise ValueError("lognormal: need 1 <= low <= median <= high and sigma >= 0")

    def draw(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(value, self.low), self.high)


CONVERSATION_PROMPT = Lognormal(1020, 1.0, 1, 8192)  # Splitwise's median; spread assumed
CONVERSATION_OUTPUT = Lognormal(129, 0.9, 1, 2048)  # Splitwise's median; spread assumed


@dataclass(frozen=True)
class LengthModel:
    """Prompt and output lengths, and the share of prompts that start with a common prefix."""

    prompt: Lognormal = CONVERSATION_PROMPT
    output: Lognormal = CONVERSATION_OUTPUT
    shared_prefix_share: float = 0.0  # fraction of requests starting with a common prefix
    prefix_count: int = 8  # K common prefixes, chosen uniformly (assumption)
    prefix_tokens: int = 512  # tokens of each common prefix (assumption)

    def __post_init__(self) -> None:
        if not 0 <= self.shared_prefix_share <= 1:
            raise ValueError("lengths: need 0 <= shared_prefix_share <= 1")
        if self.prefix_count < 1 or self.prefix_tokens < 1:
            raise ValueError("lengths: need prefix_count >= 1 and prefix_tokens >= 1")


def generate(
    pattern: Pattern, lengths: LengthModel, seconds: float, seed: int, start_s: float = 0
) -> list[Request]:
    """The requests of the window ``[start_s, start_s + seconds)`` of the pattern's day, in
    arrival order (:func:`requests` as a list)."""
    return list(requests(pattern, lengths, seconds, seed, start_s))


def requests(
    pattern: Pattern, lengths: LengthModel, seconds: float, seed: int, start_s: float = 0
) -> Iterator[Request]:
    """Like :func:`generate`, but builds each request's prompt only when it is asked for, so a
    long window needs memory for its arrival times only."""
    times = arrival_times(pattern, seconds, seed, start_s)
    draws = random.Random(f"{seed}/lengths")
    choices = random.Random(f"{seed}/prefix-choice")
    tokens = random.Random(f"{seed}/tokens")
    prefixes = [
        _tokens(random.Random(f"{seed}/prefix/{k}"), lengths.prefix_tokens)
        for k in range(lengths.prefix_count)
    ]
    for index, arrival in enumerate(times):
        prompt_len, output_len = lengths.prompt.draw(draws), lengths.output.draw(draws)
        prefix_id = None
        if choices.random() < lengths.shared_prefix_share:
            prefix_id = choices.randrange(lengths.prefix_count)
        head = () if prefix_id is None else prefixes[prefix_id]
        fresh = _tokens(tokens, max(prompt_len - len(head), 1 if head else 0))
        yield Request(index, arrival, head + fresh, output_len, prefix_id)


def arrival_times(pattern: Pattern, seconds: float, seed: int, start_s: float = 0) -> list[float]:
    """Sorted arrival times, seconds after ``start_s``: the curve's arrivals and the bursts'."""
    if seconds < 0:
        raise ValueError("seconds must be >= 0")
    curve = _thinned(pattern, seconds, start_s, random.Random(f"{seed}/arrivals"))
    extra = _burst_arrivals(pattern, seconds, random.Random(f"{seed}/bursts"))
    return sorted(curve + extra)


def expected_arrivals(pattern: Pattern, seconds: float, start_s: float = 0) -> float:
    """The mean number of arrivals in the window: the integral of the curve (midpoint rule, at
    most one second a slice) plus the bursts' mean ``starts/s x seconds x duration x rate``."""
    slices = max(1, math.ceil(seconds))
    width = seconds / slices
    curve = sum(pattern.rate(start_s + (i + 0.5) * width) for i in range(slices)) * width
    bursts = pattern.bursts
    if bursts is None:
        return curve
    extra_rps = bursts.size * pattern.ceiling()
    return curve + bursts.per_hour / 3600 * seconds * bursts.duration_s * extra_rps


def _thinned(pattern: Pattern, seconds: float, start_s: float, rng: random.Random) -> list[float]:
    """Arrivals of the curve alone: candidates at the ceiling rate, each kept with probability
    ``rate / ceiling``."""
    ceiling = pattern.ceiling()
    times: list[float] = []
    t = 0.0
    while ceiling > 0:
        t += rng.expovariate(ceiling)
        if t >= seconds:
            break
        if rng.random() * ceiling < pattern.rate(start_s + t):
            times.append(t)
    return times


def _burst_arrivals(pattern: Pattern, seconds: float, rng: random.Random) -> list[float]:
    """Arrivals of the bursts: bursts start in ``[-duration, seconds)`` so one already under
    way at the window's start counts, each a Poisson stream clipped to the window."""
    bursts = pattern.bursts
    extra_rps = 0.0 if bursts is None else bursts.size * pattern.ceiling()
    if bursts is None or bursts.per_hour == 0 or extra_rps == 0:
        return []
    times: list[float] = []
    start = -bursts.duration_s
    while (start := start + rng.expovariate(bursts.per_hour / 3600)) < seconds:
        t = start
        while (t := t + rng.expovariate(extra_rps)) < min(start + bursts.duration_s, seconds):
            if t >= 0:
                times.append(t)
    return times


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    """``count`` uniform 16-bit token ids (little-endian, so the same on every platform), each
    one of the shared :data:`_TOKEN_IDS` so that a prompt holds no int objects of its own."""
    drawn = struct.unpack(f"<{count}H", rng.randbytes(TOKEN_ID_BYTES * count))
    if count < 2:  # itemgetter of one index returns the item, not a tuple
        return tuple(_TOKEN_IDS[i] for i in drawn)
    shared: tuple[int, ...] = operator.itemgetter(*drawn)(_TOKEN_IDS)
    return shared
