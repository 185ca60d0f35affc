"""The continuous-batching engine (matrixpool.serving.engine), driven by numbers.

The model of these tests keeps the arithmetic readable: prefill 1,000 tokens/s per card, a
decode step 10 ms + 1 ms per sequence (no context term unless a test adds one), 1,000 bytes of
KV per token, host memory at 1 MB/s local and 0.5 MB/s remote without setup time. A request of
100 prompt tokens alone therefore has its first token 0.1 s after it starts, and then one token
every 11 ms.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixpool.serving import engine, latency
from matrixpool.serving.engine import Finished, Hit, Refused, Role, Token

SIMPLE = latency.LatencyModel(
    prefill_tokens_per_s_per_card=1_000,
    decode_base_s=0.010,
    decode_per_sequence_s=0.001,
    attention_share=0.0,
    reference_context_tokens=100,
    operating_batch_per_card=8,
    kv_bytes_per_token=1_000,
    kv_budget_bytes_per_card=10**9,
    local_bytes_per_s=1e6,
    remote_bytes_per_s=0.5e6,
    local_setup_s=0.0,
    remote_setup_s=0.0,
)


def make(**options: Any) -> engine.Engine:
    """An engine on the simple model; options as Engine's keywords."""
    return engine.Engine(model=SIMPLE, **options)


def request(
    name: str, prompt: int = 100, output: int = 3, hashes: Sequence[str] = ()
) -> engine.Request:
    return engine.Request(name, prompt, output, tuple(hashes))


def tokens_of(events: Sequence[engine.Event], name: str) -> list[float]:
    return [e.time for e in events if isinstance(e, Token) and e.request_id == name]


def timing_of(events: Sequence[engine.Event], name: str) -> engine.Timing:
    [timing] = [e.timing for e in events if isinstance(e, Finished) and e.request_id == name]
    return timing


# --- one request ------------------------------------------------------------------------------
def test_one_request_prefills_then_decodes_one_token_a_step() -> None:
    instance = make()
    assert instance.submit(request("a"), now=0.0) is None
    events = instance.advance(1.0)
    assert tokens_of(events, "a") == pytest.approx([0.1, 0.111, 0.122])
    timing = timing_of(events, "a")
    assert timing.ttft_s == pytest.approx(0.1)
    assert timing.tpot_s == pytest.approx(0.011)
    assert timing.e2e_s == pytest.approx(0.122)
    assert events[-1] == Finished(timing.finished_s, "a", timing)
    assert instance.idle


def test_events_come_out_as_time_passes_them() -> None:
    instance = make()
    instance.submit(request("a"), now=2.0)
    assert instance.advance(2.05) == []
    assert instance.next_event_time() == pytest.approx(2.1)
    [first] = instance.advance(2.1)
    assert isinstance(first, Token)
    assert (first.request_id, first.index) == ("a", 0)
    assert first.time == pytest.approx(2.1)
    assert [e.time for e in instance.step(2.2)] == pytest.approx([2.111, 2.122, 2.122])
    assert instance.next_event_time() is None


def test_a_request_is_taken_at_its_arrival_not_when_the_engine_next_runs() -> None:
    """Submitted at 0 and 0.05 before any advance: the second is not in the first prefill."""
    instance = make()
    instance.submit(request("a"), now=0.0)
    instance.submit(request("b"), now=0.05)
    events = instance.advance(1.0)
    assert tokens_of(events, "a")[0] == pytest.approx(0.1)
    assert tokens_of(events, "b")[0] == pytest.approx(0.2)  # its prefill starts at 0.1


def test_the_context_makes_later_steps_slower() -> None:
    model = dataclasses.replace(SIMPLE, attention_share=0.5)
    instance = engine.Engine(model=model)
    instance.submit(request("a", prompt=100, output=4), now=0.0)
    times = tokens_of(instance.advance(1.0), "a")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # 10 ms + 1 ms x (0.5 + 0.5 x context / 100), with a context of 101, 102, 103 tokens
    assert gaps == pytest.approx([0.011005, 0.01101, 0.011015])


# --- batching and queueing --------------------------------------------------------------------
def test_requests_arriving_together_share_one_prefill_and_then_the_decode_batch() -> None:
    instance = make()
    instance.submit(request("a"), now=0.0)
    instance.submit(request("b"), now=0.0)
    events = instance.advance(1.0)
    assert tokens_of(events, "a") == pytest.approx([0.2, 0.212, 0.224])  # 200 tokens; batch 2
    assert tokens_of(events, "b") == tokens_of(events, "a")


def test_a_new_prefill_pauses_the_running_batch_between_steps() -> None:
    instance = make()
    instance.submit(request("a"), now=0.0)
    instance.advance(0.105)
    instance.submit(request("b"), now=0.105)  # during a's first step, which ends at 0.111
    events = instance.advance(1.0)
    assert tokens_of(events, "a") == pytest.approx([0.111, 0.223])  # b's prefill 0.111..0.211
    assert tokens_of(events, "b") == pytest.approx([0.211, 0.223, 0.234])


def test_a_full_batch_makes_the_next_request_wait() -> None:
    instance = make(max_batch=1)
    instance.submit(request("a", output=2), now=0.0)
    instance.submit(request("b", output=2), now=0.0)
    instance.advance(0.05)
    assert instance.gauges().running == 1
    assert instance.gauges().waiting == 1
    events = instance.advance(1.0)
    assert tokens_of(events, "a") == pytest.approx([0.1, 0.111])
    assert timing_of(events, "b").admitted_s == pytest.approx(0.111)
    assert timing_of(events, "b").ttft_s == pytest.approx(0.211)


def test_the_kv_cache_limits_admission() -> None:
    """Each request reserves 110 tokens (prompt and output); 250 hold two."""
    instance = make(kv_capacity_tokens=250)
    for name in "abc":
        assert instance.submit(request(name, output=10), now=0.0) is None
    instance.advance(0.15)
    gauges = instance.gauges()
    assert (gauges.running, gauges.waiting) == (2, 1)
    assert gauges.kv_usage == pytest.approx(220 / 250)
    events = instance.advance(5.0)
    assert timing_of(events, "c").admitted_s == pytest.approx(timing_of(events, "a").finished_s)
    assert instance.gauges().kv_usage == 0


def test_a_request_larger_than_the_kv_cache_is_refused_not_queued() -> None:
    instance = make(kv_capacity_tokens=250)
    assert instance.submit(request("big", prompt=300), now=0.0) is Refused.TOO_LARGE
    assert instance.idle
    assert instance.advance(1.0) == []


def test_a_prefill_computes_at_most_its_token_budget_but_always_one_request() -> None:
    instance = make(max_prefill_tokens=150)
    instance.submit(request("a"), now=0.0)
    instance.submit(request("b"), now=0.0)
    instance.submit(request("huge", prompt=400, output=1), now=0.0)
    events = instance.advance(5.0)
    assert tokens_of(events, "a")[0] == pytest.approx(0.1)
    assert tokens_of(events, "b")[0] == pytest.approx(0.2)
    assert tokens_of(events, "huge") == pytest.approx([0.6])


# --- drain ------------------------------------------------------------------------------------
def test_a_draining_engine_takes_nothing_new_and_finishes_what_it_took() -> None:
    instance = make(max_batch=1)
    instance.submit(request("running"), now=0.0)
    instance.submit(request("queued"), now=0.0)
    instance.advance(0.05)
    instance.drain()
    assert instance.draining
    assert instance.submit(request("late"), now=0.06) is Refused.DRAINING
    events = instance.advance(0.2)
    assert not instance.idle
    events += instance.advance(10.0)
    assert {e.request_id for e in events if isinstance(e, Finished)} == {"running", "queued"}
    assert "late" not in {e.request_id for e in events}
    assert instance.idle


# --- roles ------------------------------------------------------------------------------------
def test_a_prefill_instance_hands_off_after_the_first_token() -> None:
    instance = make(role=Role.PREFILL, kv_capacity_tokens=100)
    assert instance.submit(request("a", prompt=100, output=50), now=0.0) is None
    events = instance.advance(1.0)
    timing = timing_of(events, "a")
    assert events == [Token(timing.first_token_s, "a", 0), Finished(0.1, "a", timing)]
    assert timing.first_token_s == pytest.approx(0.1)
    assert instance.idle
    assert instance.gauges().kv_usage == 0


def test_the_same_request_needs_room_for_its_output_where_it_decodes() -> None:
    assert make(kv_capacity_tokens=100).submit(request("a", output=50), 0.0) is Refused.TOO_LARGE


def test_a_decode_instance_loads_the_kv_instead_of_prefilling() -> None:
    """100 prompt tokens: 100 kB from the prefill instance at 0.5 MB/s, 0.2 s; the cache is not
    asked."""
    asked: list[str] = []

    def cache(prefix_hash: str) -> Hit | None:
        asked.append(prefix_hash)
        return Hit(tokens=100, remote=False)

    instance = make(role=Role.DECODE, prefix_cache=cache)
    instance.submit(request("a", hashes=["h1"]), now=0.0)
    events = instance.advance(1.0)
    assert tokens_of(events, "a") == pytest.approx([0.2, 0.211, 0.222])
    assert asked == []


# --- the prefix cache hook --------------------------------------------------------------------
class FakeCache:
    """A dict-backed prefix cache that records what it was asked."""

    def __init__(self, held: dict[str, Hit]) -> None:
        self.held = held
        self.asked: list[str] = []

    def __call__(self, prefix_hash: str) -> Hit | None:
        self.asked.append(prefix_hash)
        return self.held.get(prefix_hash)


PROMPT = list(range(64))  # four blocks of 16 tokens
HASHES = engine.block_hashes(PROMPT)


@pytest.mark.parametrize(
    ("held", "cached", "first_token"),
    [
        ({}, 0, 0.064),
        ({HASHES[1]: Hit(32, remote=False)}, 32, 0.032 + 0.032),
        ({HASHES[1]: Hit(32, remote=True)}, 32, 0.032 + 0.064),
        ({HASHES[1]: Hit(32, remote=False), HASHES[3]: Hit(64, remote=False)}, 63, 0.001 + 0.063),
    ],
    ids=[
        "a miss prefills all 64 tokens",
        "a local hit computes 32 tokens and fetches 32 kB at 1 MB/s",
        "a remote hit fetches them at 0.5 MB/s",
        "the longest cached prefix wins and the last token is still computed",
    ],
)
def test_a_cache_hit_skips_prefill_and_adds_the_transfer(
    held: dict[str, Hit], cached: int, first_token: float
) -> None:
    cache = FakeCache(held)
    instance = make(prefix_cache=cache)
    instance.submit(request("a", prompt=64, output=1, hashes=HASHES), now=0.0)
    timing = timing_of(instance.advance(1.0), "a")
    assert timing.cached_tokens == cached
    assert timing.first_token_s == pytest.approx(first_token)
    assert cache.asked[0] == HASHES[3]  # the longest prefix first


def test_the_cache_is_asked_longest_prefix_first_and_stops_at_a_hit() -> None:
    cache = FakeCache({HASHES[2]: Hit(48, remote=False)})
    instance = make(prefix_cache=cache)
    instance.submit(request("a", prompt=64, output=1, hashes=HASHES), now=0.0)
    instance.advance(1.0)
    assert cache.asked == [HASHES[3], HASHES[2]]


def test_block_hashes_name_whole_block_prefixes() -> None:
    other = [*PROMPT[:32], 999, *PROMPT[33:]]
    assert len(HASHES) == 4
    assert engine.block_hashes([*PROMPT, 1, 2, 3]) == HASHES  # a partial block is not hashed
    assert engine.block_hashes(other)[:2] == HASHES[:2]
    assert set(engine.block_hashes(other)[2:]).isdisjoint(HASHES)
    assert engine.block_hashes(PROMPT[:15]) == ()


# --- gauges and errors ------------------------------------------------------------------------
def test_busy_seconds_count_iterations_up_to_the_clock() -> None:
    instance = make()
    instance.submit(request("a", output=1), now=1.0)
    instance.advance(1.05)
    assert instance.gauges().busy_seconds == pytest.approx(0.05)
    instance.advance(3.0)
    assert instance.gauges().busy_seconds == pytest.approx(0.1)


def test_time_going_backwards_and_a_reused_id_are_errors() -> None:
    instance = make()
    instance.submit(request("a"), now=0.0)
    instance.advance(1.0)
    with pytest.raises(ValueError, match="before the engine"):
        instance.submit(request("b"), now=0.5)
    with pytest.raises(ValueError, match="submitted already"):
        instance.submit(request("a"), now=1.0)


# --- properties -------------------------------------------------------------------------------
arrivals = st.lists(
    st.tuples(st.floats(0, 0.5), st.integers(1, 300), st.integers(1, 20)), min_size=1, max_size=25
)


@settings(max_examples=60, deadline=None)
@given(
    arrivals=arrivals,
    batch=st.integers(1, 6),
    kv=st.integers(200, 3_000),
    role=st.sampled_from(Role),
)
def test_every_accepted_request_gets_all_its_tokens_in_order_within_the_limits(
    arrivals: list[tuple[float, int, int]], batch: int, kv: int, role: Role
) -> None:
    instance = make(max_batch=batch, kv_capacity_tokens=kv, role=role)
    accepted: dict[str, int] = {}
    events: list[engine.Event] = []
    for index, (at, prompt, output) in enumerate(sorted(arrivals)):
        events += instance.advance(at)
        if instance.submit(request(f"r{index}", prompt, output), now=at) is None:
            accepted[f"r{index}"] = 1 if role is Role.PREFILL else output
        gauges = instance.gauges()
        assert gauges.kv_usage <= 1
        assert gauges.running <= batch
    events += instance.advance(1_000.0)
    times = [e.time for e in events]
    assert times == sorted(times)
    finished = {e.request_id: e.timing for e in events if isinstance(e, Finished)}
    assert {name: len(t.token_s) for name, t in finished.items()} == accepted
    admitted = sorted(finished, key=lambda name: (finished[name].admitted_s, int(name[1:])))
    assert admitted == sorted(finished, key=lambda name: int(name[1:]))  # first come first served
    assert instance.idle


# --- fast mode (tokens=False) -----------------------------------------------------------------
def test_fast_mode_emits_only_finished_events_with_every_token_time() -> None:
    """Four requests in one prefill: b finishes with its first token, a and c together (in
    admission order), d last."""
    instance = make(tokens=False)
    for name, output in [("a", 3), ("b", 1), ("c", 3), ("d", 4)]:
        instance.submit(request(name, output=output), now=0.0)
    events = instance.advance(1.0)
    assert all(isinstance(e, Finished) for e in events)
    assert [e.request_id for e in events] == ["b", "a", "c", "d"]
    # 400 prompt tokens; then steps of 10 ms + 3 ms (a, c, d), then 10 ms + 1 ms (d)
    assert timing_of(events, "a").token_s == pytest.approx([0.4, 0.413, 0.426])
    assert timing_of(events, "d").token_s == pytest.approx([0.4, 0.413, 0.426, 0.437])


def test_fast_mode_drops_step_times_no_running_sequence_needs() -> None:
    """A long request pins its steps; once it is gone, short ones keep the list short."""
    instance = make(tokens=False, max_batch=1)
    instance.submit(request("long", prompt=1, output=3 * engine.TRIM_STEPS), now=0.0)
    for index in range(3):
        instance.submit(request(f"short{index}", prompt=1, output=2 * engine.TRIM_STEPS), 0.0)
    events = instance.advance(10_000.0)
    assert len(timing_of(events, "long").token_s) == 3 * engine.TRIM_STEPS
    assert len(timing_of(events, "short2").token_s) == 2 * engine.TRIM_STEPS
    batch = instance._batch
    assert isinstance(batch, engine._StepBatch)
    assert len(batch._steps) < 3 * engine.TRIM_STEPS  # not all 9 * TRIM_STEPS - 4 steps


def test_fast_mode_keeps_the_steps_of_a_running_sequence_when_a_later_one_finishes() -> None:
    """b joins while a decodes and finishes first; trimming at every finish spares a's steps."""
    finished = []
    with mock.patch.object(engine, "TRIM_STEPS", 1):
        for tokens in (True, False):
            instance = make(tokens=tokens)
            instance.submit(request("a", output=10), now=0.0)
            instance.advance(0.15)
            instance.submit(request("b", output=2), now=0.15)
            finished.append([e for e in instance.advance(10.0) if isinstance(e, Finished)])
    assert [e.request_id for e in finished[1]] == ["b", "a"]
    assert finished[1] == finished[0]
    assert len(timing_of(finished[1], "a").token_s) == 10


CACHE = {"h1": Hit(10, remote=False), "h2": Hit(60, remote=True)}  # "h0" misses

submits = st.tuples(
    st.sampled_from(["submit", "submit at a step end"]),
    st.floats(0, 0.1),  # time since the previous action
    st.integers(0, 30),  # or which of the next token times (of the engine as it stands)
    st.integers(1, 120),  # prompt tokens
    st.integers(1, 4) | st.integers(1, 30),  # output tokens (often few: finishes coincide)
    st.sampled_from(["h0", "h1", "h2"]),  # prefix hash
)
advances = st.tuples(st.just("advance"), st.floats(0, 0.3))
actions = st.lists(st.one_of(submits, submits, advances), min_size=1, max_size=50)


def act(instance: engine.Engine, action: tuple[Any, ...], now: float, name: str) -> object:
    """Apply one action at ``now``; what the engine answered."""
    if action[0].startswith("submit"):
        _, _, _, prompt, output, prefix_hash = action
        return instance.submit(request(name, prompt, output, [prefix_hash]), now)
    events = instance.advance(now)
    return [e for e in events if isinstance(e, Finished)], instance.gauges()


def next_time(instance: engine.Engine, action: tuple[Any, ...], now: float) -> float:
    """When ``action`` happens: after its delay, or exactly at one of the next token times
    that a copy of ``instance`` (in token mode) runs to, so arrivals meet step ends."""
    if action[0] == "submit at a step end":
        ahead = copy.deepcopy(instance)
        ends = sorted({e.time for e in ahead.advance(now + 1.0) if e.time > now})
        return ends[action[2] % len(ends)] if ends else now
    return now + (action[1] if len(action) > 1 else 0.0)


def observe(instance: engine.Engine) -> tuple[object, ...]:
    return instance.next_event_time(), instance.idle, instance.draining, instance.gauges()


@settings(max_examples=300, deadline=None)
@given(
    actions=actions,
    batch=st.integers(1, 5),
    kv=st.integers(150, 1_500),
    prefill=st.integers(1, 300),
    role=st.sampled_from(Role),
    trim=st.sampled_from([1, 3, engine.TRIM_STEPS]),
    drain_at=st.integers(0, 60),
)
def test_fast_mode_finishes_like_token_mode(
    actions: list[tuple[Any, ...]],
    batch: int,
    kv: int,
    prefill: int,
    role: Role,
    trim: int,
    drain_at: int,
) -> None:
    """Same requests, advances and a drain (before action ``drain_at``, if there is one): the
    same answers, Finished events (timings included), gauges and next event times; with a
    context term in the step time, and with the step list trimmed at any length."""
    model = dataclasses.replace(SIMPLE, attention_share=0.5)
    pair = [
        engine.Engine(
            model=model,
            role=role,
            max_batch=batch,
            kv_capacity_tokens=kv,
            max_prefill_tokens=prefill,
            prefix_cache=CACHE.get,
            tokens=tokens,
        )
        for tokens in (True, False)
    ]
    now = 0.0
    with mock.patch.object(engine, "TRIM_STEPS", trim):
        for index, action in enumerate([*actions, ("advance", 1_000.0)]):
            now = next_time(pair[0], action, now)
            if index == drain_at:
                for instance in pair:
                    instance.drain()
            slow, fast = (act(instance, action, now, f"r{index}") for instance in pair)
            assert fast == slow
            assert observe(pair[1]) == observe(pair[0])
    assert pair[1].idle
