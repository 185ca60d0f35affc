"""The transition of a supernode from the split in place to a new target, cycle by cycle:
release before grow, training kept until its checkpoint is answered or the grace is over,
inference shrunk at once, and the timeline of a transition."""

from __future__ import annotations

import datetime as dt

import pytest

from matrixpool.timeshare import split, transition

K = split.WorkloadKey
CHAT, ELASTIC, NIGHTLY = K("ns/chat"), K("ns/elastic"), K("ns/nightly")
T0 = dt.datetime(2026, 11, 30, 14, 0, tzinfo=dt.UTC)


def target(chat: dict[str, int] | None = None, elastic: int = 8, nightly: int = 0) -> split.Split:
    return split.Split(
        window="w",
        inference={CHAT: chat if chat is not None else {"prefill": 8, "decode": 8}},
        training={ELASTIC: elastic, NIGHTLY: nightly},
        inference_cards=0,
        training_cards=0,
    )


def now(
    chat: dict[str, int],
    elastic: int,
    nightly: int,
    running_above: frozenset[split.WorkloadKey] = frozenset(),
    terminating: bool = False,
) -> transition.Current:
    return transition.Current(
        {CHAT: chat}, {ELASTIC: elastic, NIGHTLY: nightly}, running_above, terminating
    )


DAY = {"prefill": 8, "decode": 8}
NIGHT = {"prefill": 2, "decode": 1}


@pytest.mark.parametrize(
    ("case", "goal", "current", "released", "chat", "elastic", "nightly", "waiting", "releasing"),
    [
        (
            "night → day, training still checkpointing: inference held, training kept",
            target(DAY, elastic=8, nightly=0),
            now(NIGHT, 32, 8, frozenset({ELASTIC, NIGHTLY})),
            set(),
            NIGHT,
            32,
            8,
            {ELASTIC, NIGHTLY},
            True,
        ),
        (
            "one job answered: it goes to its target, the other still waits",
            target(DAY, elastic=8, nightly=0),
            now(NIGHT, 32, 8, frozenset({ELASTIC, NIGHTLY})),
            {NIGHTLY},
            NIGHT,
            32,
            0,
            {ELASTIC},
            True,
        ),
        (
            "both released: training at target, inference still held (pods above target)",
            target(DAY, elastic=8, nightly=0),
            now(NIGHT, 32, 8, frozenset({ELASTIC, NIGHTLY})),
            {ELASTIC, NIGHTLY},
            NIGHT,
            8,
            0,
            set(),
            True,
        ),
        (
            "evicted pods terminating: nobody grows",
            target(DAY, elastic=8, nightly=0),
            now(NIGHT, 8, 0, terminating=True),
            set(),
            NIGHT,
            8,
            0,
            set(),
            True,
        ),
        (
            "all released and gone: inference grows to the day's split",
            target(DAY, elastic=8, nightly=0),
            now(NIGHT, 8, 0),
            set(),
            DAY,
            8,
            0,
            set(),
            False,
        ),
        (
            "day → night: inference shrinks at once, training waits for the cards",
            target(NIGHT, elastic=32, nightly=8),
            now(DAY, 8, 0),
            set(),
            NIGHT,
            8,
            0,
            set(),
            True,
        ),
        (
            "inference pods gone: training grows and the suspended job resumes",
            target(NIGHT, elastic=32, nightly=8),
            now(NIGHT, 8, 0),
            set(),
            NIGHT,
            32,
            8,
            set(),
            False,
        ),
        (
            "pods above target but none running (pending gang): no checkpoint needed",
            target(DAY, elastic=8, nightly=0),
            now(DAY, 8, 8),
            set(),
            DAY,
            8,
            0,
            set(),
            True,
        ),
    ],
)
def test_stage(
    case: str,
    goal: split.Split,
    current: transition.Current,
    released: set[split.WorkloadKey],
    chat: dict[str, int],
    elastic: int,
    nightly: int,
    waiting: set[split.WorkloadKey],
    releasing: bool,
) -> None:
    allowed = transition.stage(goal, current, released)
    assert allowed.inference[CHAT] == chat, case
    assert allowed.training == {ELASTIC: elastic, NIGHTLY: nightly}, case
    assert allowed.checkpointing == waiting, case
    assert allowed.releasing is releasing, case


def test_allowances_never_exceed_both_current_and_target_while_releasing() -> None:
    """Rule 1 as a property over small tables: while releasing nobody holds more than before
    nor more than the target, except a job waiting for its checkpoint (kept as it is)."""
    for have in range(0, 5):
        for want in range(0, 5):
            for running in (False, True):
                current = now(
                    {"prefill": have, "decode": have},
                    have,
                    have,
                    frozenset({ELASTIC}) if running else frozenset(),
                    terminating=True,
                )
                goal = target({"prefill": want, "decode": want}, elastic=want, nightly=want)
                allowed = transition.stage(goal, current, set())
                assert all(v <= min(have, want) for v in allowed.inference[CHAT].values())
                assert allowed.training[NIGHTLY] <= min(have, want)
                limit = have if running and have > want else min(have, want)
                assert allowed.training[ELASTIC] == limit


@pytest.mark.parametrize(
    ("baseline", "committed", "waited", "grace", "answered", "released"),
    [
        (10, 10, 1, 30, False, False),  # nothing newer yet
        (10, 11, 1, 30, True, True),  # answered
        (10, 9, 1, 30, False, False),  # an older complete step (a rank lost memory) is no answer
        (None, 3, 1, 30, True, True),  # first checkpoint ever
        (None, None, 1, 30, False, False),  # nothing at all
        (10, None, 30, 30, False, True),  # deadline reached: let go without an answer
        (10, 10, 0, 0, False, True),  # no grace at all
    ],
)
def test_answer_and_deadline(
    baseline: int | None,
    committed: int | None,
    waited: float,
    grace: float,
    answered: bool,
    released: bool,
) -> None:
    at = T0 + dt.timedelta(seconds=waited)
    assert transition.answered(baseline, committed) is answered
    assert transition.released(baseline, committed, T0, grace, at) is released


@pytest.mark.parametrize(
    ("committed", "reached", "lost"),
    [(100, 107, 7), (100, 100, 0), (None, 5, 5), (100, None, None), (100, 90, 0)],
)
def test_lost_steps(committed: int | None, reached: int | None, lost: int | None) -> None:
    assert transition.lost_steps(committed, reached) == lost


def test_in_place_needs_targets_bound_and_nothing_terminating() -> None:
    goal = target(DAY, elastic=8, nightly=0)
    assert transition.in_place(goal, now(DAY, 8, 0), {})
    assert not transition.in_place(goal, now(DAY, 8, 0, terminating=True), {})
    assert not transition.in_place(goal, now(NIGHT, 8, 0), {})
    assert not transition.in_place(goal, now(DAY, 9, 0), {})
    assert not transition.in_place(goal, now(DAY, 8, 0), {CHAT: False})


def test_signature_tells_targets_apart() -> None:
    assert transition.signature(target(DAY)) == transition.signature(target(dict(DAY)))
    assert transition.signature(target(DAY)) != transition.signature(target(NIGHT))
    assert transition.signature(target(DAY, elastic=8)) != transition.signature(
        target(DAY, elastic=9)
    )


def test_timeline_splits_the_duration_into_checkpoint_eviction_and_placement() -> None:
    waiting = transition.Allowances({}, {}, frozenset({ELASTIC}), True)
    releasing = transition.Allowances({}, {}, frozenset(), True)
    growing = transition.Allowances({}, {}, frozenset(), False)
    line = transition.Timeline(window="day", started=100.0)
    line = line.observe(100.2, waiting, settled=False, asked=True)
    line = line.observe(102.0, waiting, settled=False, asked=True)
    line = line.observe(103.0, releasing, settled=False)  # answered at 103
    line = line.observe(103.5, releasing, settled=False)
    line = line.observe(104.0, growing, settled=False)  # evicted pods gone at 104
    line = line.observe(105.5, growing, settled=True)
    assert (line.seconds, line.checkpoint_seconds, line.eviction_seconds) == (5.5, 3.0, 1.0)
    assert line.placement_seconds == 1.5
    assert line.observe(200.0, growing, settled=True) == line  # settled once


def test_timeline_without_checkpoint_counts_no_checkpoint_time() -> None:
    releasing = transition.Allowances({}, {}, frozenset(), True)
    growing = transition.Allowances({}, {}, frozenset(), False)
    line = transition.Timeline(window="night", started=0.0)
    line = line.observe(0.5, releasing, settled=False)
    line = line.observe(1.0, growing, settled=False)
    line = line.observe(2.0, growing, settled=True)
    assert (line.checkpoint_seconds, line.eviction_seconds, line.placement_seconds) == (
        0.0,
        1.0,
        1.0,
    )
    assert line.seconds == 2.0
