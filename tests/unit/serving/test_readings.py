"""The autoscaler's readings: the simulated server's own /metrics text parses into the
numbers it counted, and two readings per instance give the service's load factors — rates
over the time between them, the gauges now, and the p90 of the requests in between."""

from __future__ import annotations

import pytest

from matrixpool.serving import engine, readings, server


def timing(ttft: float, tpot: float, prompt: int = 100, tokens: int = 11) -> engine.Timing:
    first = 10.0 + ttft
    times = tuple(first + tpot * k for k in range(tokens))
    return engine.Timing(10.0, 10.0, times, prompt, 0)


def metrics_text(
    *timings: engine.Timing, waiting: int = 0, kv: float = 0.0, busy: float = 0.0
) -> str:
    metrics = server.Metrics("m")
    for t in timings:
        metrics.observe(t)
    metrics.set_gauges(engine.Gauges(running=1, waiting=waiting, kv_usage=kv, busy_seconds=0), busy)
    return metrics.text().decode()


def test_a_reading_holds_what_the_server_counted() -> None:
    text = metrics_text(timing(0.3, 0.02), timing(0.7, 0.04, prompt=300), waiting=3, kv=0.5, busy=2)
    reading = readings.parse(text, at=5.0)
    assert (reading.running, reading.waiting, reading.kv_usage) == (1, 3, 0.5)
    assert reading.prompt_tokens == 400
    assert reading.generated_tokens == 22
    assert reading.requests == 2
    assert reading.busy_seconds == 2
    assert reading.ttft.buckets[-1] == (float("inf"), 2)
    assert dict(reading.ttft.buckets)[0.5] == 1


def test_a_missing_series_reads_zero_and_is_named_missing() -> None:
    reading = readings.parse("", at=0.0)
    every = {*readings.GAUGES, *readings.COUNTERS, "ttft", "itl"}
    assert reading == readings.Reading(at=0.0, missing=frozenset(every))


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        pytest.param(((0.1, 0), (0.5, 10), (float("inf"), 10)), 0.9, 0.46, id="inside a bucket"),
        pytest.param(((0.1, 5), (0.5, 10), (float("inf"), 10)), 0.5, 0.1, id="at a bound"),
        pytest.param(((0.1, 0), (0.5, 0), (float("inf"), 4)), 0.9, 0.5,
                     id="in +Inf: the highest finite bound"),
        pytest.param(((0.1, 0), (float("inf"), 0)), 0.9, None, id="no observation"),
    ],
)  # fmt: skip
def test_quantiles_interpolate_as_prometheus_does(
    buckets: tuple[tuple[float, float], ...], q: float, expected: float | None
) -> None:
    found = readings.Histogram(buckets).quantile(q)
    assert found == (pytest.approx(expected) if expected is not None else None)


def test_the_histogram_since_a_reading_holds_only_the_newer_observations() -> None:
    before = readings.parse(metrics_text(timing(0.3, 0.02)), at=0.0)
    after = readings.parse(metrics_text(timing(0.3, 0.02), timing(3.0, 0.02)), at=10.0)
    grown = after.ttft.since(before.ttft)
    assert grown.buckets[-1][1] == 1
    assert grown.quantile(0.9) > 2.5  # only the 3 s request is left


def test_rates_come_from_counter_growth_between_readings() -> None:
    before = readings.parse(metrics_text(timing(0.3, 0.02)), at=0.0)
    after = readings.parse(metrics_text(*[timing(0.3, 0.02)] * 21, busy=5.0), at=10.0)
    prefill = readings.Instance(before, after, cards=8, decodes=False)
    decode = readings.Instance(before, after, cards=16, decodes=True)
    found = readings.factors([prefill, decode])
    assert found.arrival_rate == pytest.approx(2.0)  # 20 more requests in 10 s, prefill only
    assert found.input_tokens_per_s == pytest.approx(200.0)
    assert found.output_tokens_per_s == pytest.approx(22.0)  # 220 tokens, decode only
    assert found.card_utilisation == pytest.approx(0.5)  # 5 busy seconds of 10, every card


def test_the_gauges_count_from_one_reading_and_the_rates_need_two() -> None:
    now = readings.parse(metrics_text(timing(0.3, 0.02), waiting=4, kv=0.6), at=3.0)
    found = readings.factors(
        [readings.Instance(None, now, 8, decodes=False), readings.Instance(None, now, 16, True)]
    )
    assert found.arrival_rate == 0
    assert found.kv_usage == pytest.approx(0.6)
    assert found.ttft_p90_s is None


def test_a_restarted_instance_counts_from_zero() -> None:
    before = readings.parse(metrics_text(*[timing(0.3, 0.02)] * 50), at=0.0)
    after = readings.parse(metrics_text(*[timing(0.3, 0.02)] * 5), at=5.0)
    found = readings.factors([readings.Instance(before, after, 8, decodes=False)])
    assert found.arrival_rate == pytest.approx(1.0)


def test_a_single_role_service_counts_arrivals_and_outputs_on_the_same_instances() -> None:
    before = readings.parse(metrics_text(), at=0.0)
    after = readings.parse(metrics_text(*[timing(0.3, 0.02)] * 10, waiting=2), at=10.0)
    found = readings.factors([readings.Instance(before, after, 8, decodes=True)])
    assert found.arrival_rate == pytest.approx(1.2)  # 10 finished and 2 more waiting, in 10 s
    assert found.input_tokens_per_s == pytest.approx(120.0)  # at the 100-token mean prompt
    assert found.output_tokens_per_s == pytest.approx(11.0)
    assert found.queue_depth == pytest.approx(200.0)  # 2 waiting x the 100-token mean prompt
    assert found.tpot_p90_s is not None
    assert found.tpot_p90_s <= 0.025


def test_throughput_per_replica_and_the_prefill_rate_of_busy_time() -> None:
    before = readings.parse(metrics_text(timing(0.3, 0.02)), at=0.0)
    after = readings.parse(metrics_text(*[timing(0.3, 0.02)] * 21, busy=5.0), at=10.0)
    prefill = readings.Instance(before, after, cards=8, decodes=False)
    decode = readings.Instance(before, after, cards=16, decodes=True)
    found = readings.throughput([prefill, prefill, decode])
    assert found.prefill_tokens_per_s == pytest.approx(200.0)  # per replica: 2,000 in 10 s
    assert found.decode_tokens_per_s == pytest.approx(22.0)
    assert found.prefill_busy_tokens_per_s == pytest.approx(400.0)  # 2,000 per 5 busy seconds


def test_busy_time_that_counts_decode_too_measures_no_prefill_rate() -> None:
    """Our server's busy time on an instance serving both phases holds its decode steps;
    llama.cpp's prompt_seconds_total is prefill's alone, whatever the instance does."""
    before = readings.parse(metrics_text(timing(0.3, 0.02)), at=0.0)
    after = readings.parse(metrics_text(*[timing(0.3, 0.02)] * 21, busy=5.0), at=10.0)
    both = readings.Instance(before, after, cards=8, decodes=True)
    assert readings.throughput([both]).prefill_busy_tokens_per_s is None
    llama = "llamacpp:prompt_tokens_total {}\nllamacpp:prompt_seconds_total {}\n"
    then = readings.parse(llama.format(0, 0), at=0.0, engine=readings.Engine.LLAMA_CPP)
    now = readings.parse(llama.format(3000, 2), at=10.0, engine=readings.Engine.LLAMA_CPP)
    alone = readings.Instance(then, now, cards=1, decodes=True)
    assert readings.throughput([alone]).prefill_busy_tokens_per_s == pytest.approx(1500.0)


def test_without_a_finished_request_counter_waiting_requests_count_at_an_assumed_prompt() -> None:
    llama = "llamacpp:prompt_tokens_total {}\nllamacpp:requests_deferred {}\n"
    then = readings.parse(llama.format(0, 0), at=0.0, engine=readings.Engine.LLAMA_CPP)
    now = readings.parse(llama.format(3000, 2), at=10.0, engine=readings.Engine.LLAMA_CPP)
    found = readings.factors([readings.Instance(then, now, cards=1, decodes=True)])
    assert found.queue_depth == 2 * readings.ASSUMED_PROMPT_TOKENS
    assert found.input_tokens_per_s == pytest.approx(300 + 0.2 * readings.ASSUMED_PROMPT_TOKENS)


def test_a_burst_taken_into_free_slots_counts_as_arriving_before_it_is_prefilled() -> None:
    """llama.cpp takes a burst into its free slots at once (running, not deferred) and prefills
    it slowly under a CPU limit: the requests that came in count in the first reading after."""
    llama = (
        "llamacpp:prompt_tokens_total {}\nllamacpp:requests_processing {}\n"
        "llamacpp:requests_deferred {}\n"
    )
    then = readings.parse(llama.format(600, 1, 0), at=0.0, engine=readings.Engine.LLAMA_CPP)
    now = readings.parse(llama.format(900, 7, 0), at=3.0, engine=readings.Engine.LLAMA_CPP)
    found = readings.factors([readings.Instance(then, now, cards=1, decodes=True)])
    assert found.arrival_rate == pytest.approx(2.0)  # 6 more in the instance in 3 s
    assert found.input_tokens_per_s == pytest.approx(100 + 2.0 * readings.ASSUMED_PROMPT_TOKENS)
    settled = readings.parse(llama.format(1500, 7, 0), at=6.0, engine=readings.Engine.LLAMA_CPP)
    steady = readings.factors([readings.Instance(now, settled, cards=1, decodes=True)])
    assert steady.input_tokens_per_s == pytest.approx(200.0)  # no growth: the counter alone
