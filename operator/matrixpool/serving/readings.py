"""What the autoscaler reads from an inference instance's ``/metrics``, and a service's load
factors from two readings of each of its instances.

Called by the operator's autoscaler (:mod:`matrixpool.controllers.autoscaler`), which fetches the
text, and by the tests with the simulated server's own output. Pure: text in, numbers out.

The names are those vLLM exports (and :mod:`matrixpool.serving.server` too): gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``;
counters ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total``; histograms ``vllm:time_to_first_token_seconds`` and
``vllm:time_per_output_token_seconds``; and ``matrixpool_serving_busy_seconds_total`` (the
instance's busy time, for card utilisation). A series an instance does not export reads 0.

From two readings of every instance the factors are (:func:`factors`):

1. rates: requests, prompt tokens and output tokens per second — the counters' growth over
   the time between the readings, summed over the instances (a counter that went down, the
   instance restarted, counts from 0);
2. now: the requests waiting (turned into prompt tokens by the period's mean prompt), the mean
   KV usage of the instances that decode, the busy share of the prefill instances' cards (a
   decode step is busy at any batch, so busy time measures nothing there);
3. latency: the p90 of TTFT and TPOT of the requests finished between the readings, from the
   histograms' bucket growth, interpolated within a bucket as Prometheus'
   ``histogram_quantile`` does.

An instance read once has no rates yet: it counts for the gauges only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from matrixpool.serving import estimator

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"  # gauges
KV = "vllm:kv_cache_usage_perc"  # gauge, 0..1
PROMPT, GENERATED = "vllm:prompt_tokens", "vllm:generation_tokens"  # counters, without _total
REQUESTS, BUSY = "vllm:request_success", "matrixpool_serving_busy_seconds"
TTFT, TPOT = "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds"
QUANTILE = 0.9


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (``+Inf`` last)."""

    buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), ascending le

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after ``earlier`` (all of them if it is None or reset)."""
        before = dict(earlier.buckets) if earlier else {}
        grown = tuple((le, count - before.get(le, 0.0)) for le, count in self.buckets)
        if any(count < 0 for _, count in grown):
            return self
        return Histogram(grown)

    def quantile(self, q: float) -> float | None:
        """``histogram_quantile(q, ...)``: linear within the bucket holding rank ``q * count``;
        the highest finite bound if it falls in ``+Inf``; None without observations."""
        total = self.buckets[-1][1] if self.buckets else 0.0
        if total <= 0:
            return None
        rank, lower, below = q * total, 0.0, 0.0
        for le, count in self.buckets:
            if count >= rank:
                if math.isinf(le):
                    return lower
                inside = count - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, count
        return lower


@dataclass(frozen=True)
class Reading:
    """One instance's metrics at one moment."""

    at: float  # when it was read, monotonic seconds
    running: float = 0.0  # requests in the batch
    waiting: float = 0.0  # requests queued
    kv_usage: float = 0.0  # 0..1
    prompt_tokens: float = 0.0  # counter
    generated_tokens: float = 0.0  # counter
    requests: float = 0.0  # counter of finished requests
    busy_seconds: float = 0.0  # counter
    ttft: Histogram = Histogram()
    tpot: Histogram = Histogram()


def parse(text: str, at: float) -> Reading:
    """A reading from Prometheus text; series summed over their labels (one model each)."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {TTFT: {}, TPOT: {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and family.name in buckets:
                le = float(sample.labels["le"])
                buckets[family.name][le] = buckets[family.name].get(le, 0.0) + sample.value
            elif sample.name in (f"{family.name}_total", family.name):
                values[family.name] = values.get(family.name, 0.0) + sample.value
    return Reading(
        at=at,
        running=values.get(RUNNING, 0.0),
        waiting=values.get(WAITING, 0.0),
        kv_usage=values.get(KV, 0.0),
        prompt_tokens=values.get(PROMPT, 0.0),
        generated_tokens=values.get(GENERATED, 0.0),
        requests=values.get(REQUESTS, 0.0),
        busy_seconds=values.get(BUSY, 0.0),
        ttft=Histogram(tuple(sorted(buckets[TTFT].items()))),
        tpot=Histogram(tuple(sorted(buckets[TPOT].items()))),
    )


@dataclass(frozen=True)
class Instance:
    """Two readings of one instance (``before`` None when read once) and what it is."""

    before: Reading | None
    now: Reading
    cards: int  # cards of the instance
    decodes: bool  # it generates output tokens (role decode, or a single-role service)


def factors(instances: Sequence[Instance]) -> estimator.Factors:
    """The service's load factors (module docstring, steps 1 to 3)."""
    rated = [i for i in instances if i.before is not None and i.now.at > i.before.at]
    alone = all(i.decodes for i in instances)  # one role: its instances prefill too
    arriving = [i for i in rated if not i.decodes or alone]
    arrivals = sum(_rate(i, "requests") for i in arriving)
    prompt = sum(_rate(i, "prompt_tokens") for i in arriving)
    output = sum(_rate(i, "generated_tokens") for i in rated if i.decodes)
    waiting = sum(i.now.waiting for i in instances if not i.decodes or alone)
    decoders = [i.now.kv_usage for i in instances if i.decodes]
    prefilling = [i for i in rated if not i.decodes]  # a decode step is busy at any batch
    busy = sum(_rate(i, "busy_seconds") * i.cards for i in prefilling)
    cards = sum(i.cards for i in prefilling)
    return estimator.Factors(
        arrival_rate=arrivals,
        input_tokens_per_s=prompt,
        output_tokens_per_s=output,
        queue_depth=estimator.waiting_tokens(waiting, prompt, arrivals),
        kv_usage=sum(decoders) / len(decoders) if decoders else 0.0,
        card_utilisation=min(1.0, busy / cards) if cards else 0.0,
        ttft_p90_s=_merged(i.now.ttft.since(i.before.ttft if i.before else None) for i in rated),
        tpot_p90_s=_merged(i.now.tpot.since(i.before.tpot if i.before else None) for i in rated),
    )


def _rate(instance: Instance, counter: str) -> float:
    assert instance.before is not None
    now, before = float(getattr(instance.now, counter)), float(getattr(instance.before, counter))
    grown = now - before if now >= before else now  # went down: restarted, counts from 0
    return grown / (instance.now.at - instance.before.at)


def _merged(histograms: Iterable[Histogram]) -> float | None:
    """The p90 of the observations of all ``histograms`` together (same buckets)."""
    total: dict[float, float] = {}
    for histogram in histograms:
        for le, count in histogram.buckets:
            total[le] = total.get(le, 0.0) + count
    return Histogram(tuple(sorted(total.items()))).quantile(QUANTILE)
