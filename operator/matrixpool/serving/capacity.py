"""Per-replica capacity of an autoscaled service, per phase (prefill: prompt tokens/s; decode:
output tokens/s at the TPOT target): stated by a person, learned from the roles' own readings,
or, until the readings tell, a first guess.

Called by the inference autoscaler (:mod:`matrixpool.controllers.autoscaler`) once a period,
with what the period's readings show of each phase (:class:`Period`, from
:func:`matrixpool.serving.readings.throughput`); it keeps the :class:`Figure` of each phase in
its memory of the service (by UID), sizes with it (:class:`~matrixpool.serving.estimator.Capacity`)
and shows it in ``status.recommendation.capacity``. Pure: no clock, no I/O.

A figure's source, per phase, in this order (:func:`learn`):

1. **Stated** (``spec.autoscaling.capacity``): used as it is; readings change nothing.
2. **Learned from busy time**, where the engine exports the phase's own busy time (llama.cpp's
   ``prompt_seconds_total``, our simulated server's busy seconds on a prefill-only instance):
   the prompt tokens per busy second are the rate itself, averaged over the last
   :data:`WINDOW` periods (:func:`from_busy_time`). Decode learns this way only where the
   engine says how long its slots generated and how many sequences a step carried (llama.cpp's
   ``tokens_predicted_seconds_total`` over ``n_busy_slots_per_decode``,
   :func:`matrixpool.serving.readings.decode_busy_rate`): the output tokens per second of
   decoding at the batch it ran, which errs low. A decode step is otherwise busy at any batch,
   so other engines' busy time says nothing of decode's capacity.
3. **Learned from latency**, otherwise (:func:`from_latency`), conservatively: a period
   whose p90 (TTFT for prefill, TPOT for decode) met the target while each replica sustained
   more than the figure raises the figure to that rate; one that met it at no less than the
   target utilisation of the figure confirms it; one that missed it at a lower rate, but at
   least :data:`LOWER_SHARE` of the figure (the replicas were loaded: the miss is theirs),
   lowers the figure to that rate. Anything else (light load, no latency measured) tells
   nothing. The figure therefore only rises from periods within the SLO; with sizing at the
   target utilisation a replica seldom runs above it, so without busy time a first guess that
   is too low mostly stays (the service is then over-provisioned, never under).
4. **First guess**: the CloudMatrix-Infer figures for the role's cards
   (:func:`first_guess`, :mod:`matrixpool.serving.latency`), until 2 or 3 applies.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from matrixpool.serving import latency

WINDOW = 4  # busy-time periods a learned figure averages over (a moving mean, then EWMA)
LOWER_SHARE = 0.5  # a miss lowers the figure only at a rate of at least this share of it
MEAN_CONTEXT_TOKENS = 2048  # a decoding sequence's context, for the first guess's decode rate
FIRST_GUESS_SAID = "first guess (CloudMatrix-Infer figures)"


class Source(enum.StrEnum):
    """Where a figure comes from (``status.recommendation.capacity[].source``)."""

    STATED = "Stated"
    LEARNED = "Learned"
    FIRST_GUESS = "FirstGuess"


class Measure(enum.StrEnum):
    """What a learned figure was learned from."""

    NONE = ""
    BUSY_TIME = "busy time"
    LATENCY = "latency within the SLO"


@dataclass(frozen=True)
class Figure:
    """Tokens per second one replica of a phase sustains, and where that comes from."""

    tokens_per_s: float  # per replica
    source: Source
    periods: int = 0  # periods it was learned from (Learned)
    measure: Measure = Measure.NONE  # what it was learned from (Learned)

    def __post_init__(self) -> None:
        if not self.tokens_per_s > 0:
            raise ValueError(f"a capacity figure must be > 0, got {self.tokens_per_s}")

    @property
    def said(self) -> str:
        """The source in words: "stated", "learned from busy time over 4 periods", "first
        guess (CloudMatrix-Infer figures)"."""
        if self.source is Source.STATED:
            return "stated"
        if self.source is Source.FIRST_GUESS:
            return FIRST_GUESS_SAID
        plural = "" if self.periods == 1 else "s"
        return f"learned from {self.measure} over {self.periods} period{plural}"


@dataclass(frozen=True)
class Period:
    """What one period's readings show of one phase, per replica of the role serving it."""

    tokens_per_s: float  # tokens/s one replica processed (prompt or output), on average
    busy_tokens_per_s: float | None  # tokens per second of the phase's busy time; None: unmeasured
    latency_s: float | None  # the phase's observed p90 (TTFT or TPOT); None: not measured
    target_s: float  # its target


@dataclass(frozen=True)
class Figures:
    """The figures of both phases of one service."""

    prefill: Figure
    decode: Figure


def first_guess(prefill_cards: int, decode_cards: int) -> Figures:
    """The CloudMatrix-Infer figures (DeepSeek-R1 on Ascend 910C) for replicas of these cards:
    prefill at the published rate per card; decode at the published operating batch with a
    context of :data:`MEAN_CONTEXT_TOKENS` per sequence."""
    model = latency.DEFAULT
    batch = model.operating_batch(decode_cards)
    decode = model.decode_tokens_per_s(batch, batch * MEAN_CONTEXT_TOKENS, decode_cards)
    return Figures(
        Figure(model.prefill_tokens_per_s_per_card * prefill_cards, Source.FIRST_GUESS),
        Figure(decode, Source.FIRST_GUESS),
    )


def stated(tokens_per_s: float | None, otherwise: Figure) -> Figure:
    """A person's figure where given, else ``otherwise``."""
    return otherwise if tokens_per_s is None else Figure(float(tokens_per_s), Source.STATED)


def learn(figure: Figure, period: Period, utilisation: float) -> Figure:
    """The figure after one more period (module docstring, rules 1 to 3)."""
    if figure.source is Source.STATED:
        return figure
    if period.busy_tokens_per_s is not None and period.busy_tokens_per_s > 0:
        return from_busy_time(figure, period.busy_tokens_per_s)
    if figure.measure is Measure.BUSY_TIME:  # busy time not read this period: keep what it said
        return figure
    return from_latency(figure, period, utilisation)


def from_busy_time(figure: Figure, measured: float) -> Figure:
    """Tokens per busy second are the rate: the mean of the last :data:`WINDOW` periods (each
    new period weighs ``1 / min(n, WINDOW)``); a figure not learned so replaced at once."""
    if figure.measure is not Measure.BUSY_TIME:
        return Figure(measured, Source.LEARNED, 1, Measure.BUSY_TIME)
    periods = figure.periods + 1
    mean = figure.tokens_per_s + (measured - figure.tokens_per_s) / min(periods, WINDOW)
    return replace(figure, tokens_per_s=mean, periods=periods)


def from_latency(figure: Figure, period: Period, utilisation: float) -> Figure:
    """Raise to a rate sustained within the SLO, confirm at the target utilisation, lower to a
    rate the SLO was missed at (at least :data:`LOWER_SHARE` of the figure); else unchanged."""
    rate, now = period.tokens_per_s, figure.tokens_per_s
    if period.latency_s is None or rate <= 0:
        return figure
    met = period.latency_s <= period.target_s
    if met and rate > now:
        return _learned(figure, rate)
    if met and rate >= utilisation * now:
        return _learned(figure, now)
    if not met and LOWER_SHARE * now <= rate < now:
        return _learned(figure, rate)
    return figure


def _learned(figure: Figure, tokens_per_s: float) -> Figure:
    periods = figure.periods + 1 if figure.source is Source.LEARNED else 1
    return Figure(tokens_per_s, Source.LEARNED, periods, Measure.LATENCY)
