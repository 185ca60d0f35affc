"""What the autoscaler reads from an inference instance's ``/metrics``, and a service's load
factors from two readings of each of its instances.

Called by the operator's autoscaler (:mod:`matrixpool.controllers.autoscaler`), which fetches the
text, by ``matrixpool readings`` (what a person's engine gives), and by the tests. Pure: text in,
numbers out.

Each engine names the same quantities its own way (:data:`ENGINES`, from each engine's own
documentation and source); ``spec.autoscaling.engine`` picks one, or ``Auto`` tells it from the
names the text holds (:func:`detect`):

- vLLM (V1, ``vllm:``): num_requests_running, num_requests_waiting, kv_cache_usage_perc
  (gpu_cache_usage_perc before 0.12), prompt_tokens_total, generation_tokens_total,
  request_success_total, the histograms time_to_first_token_seconds and
  request_time_per_output_token_seconds (one value per request, as the SLO counts), else
  inter_token_latency_seconds (every gap), else time_per_output_token_seconds (until 0.13); no
  busy time (our simulated server adds matrixpool_serving_busy_seconds_total);
- SGLang (``--enable-metrics``, ``sglang:``): num_running_reqs, num_queue_reqs, token_usage,
  prompt_tokens_total, generation_tokens_total, num_requests_total, the histograms
  time_to_first_token_seconds and inter_token_latency_seconds; no busy time;
- llama.cpp's server (``--metrics``, ``llamacpp:``): requests_processing, requests_deferred,
  prompt_tokens_total, tokens_predicted_total, prompt_seconds_total (busy time),
  tokens_predicted_seconds_total; no KV usage (removed in 2025), no finished-request counter
  and no histogram at all.

A quantity an engine does not export reads 0 in the factors and is listed in
:attr:`Reading.missing` (``matrixpool readings`` prints it as null); series are summed over
their labels.

From two readings of every instance the factors are (:func:`factors`):

1. rates: requests, prompt tokens and output tokens per second — the counters' growth over
   the time between the readings, summed over the instances (a counter that went down, the
   instance restarted, counts from 0). Requests and prompt tokens are arrivals, not
   completions: what finished plus what the requests in the instance (waiting and running)
   grew by, times the period's mean prompt for tokens, so a burst counts in full in the first
   reading after it starts, whether a saturated instance queues it or an engine with free
   slots (llama.cpp) takes it in at once and prefills it slowly. While a burst rises this is an
   upper bound (a running request's prompt may be partly processed, counted already); in a
   steady load the growth is zero and the counters alone count;
2. now: the requests waiting (turned into prompt tokens by the period's mean prompt: prompt
   tokens per finished request, or :data:`ASSUMED_PROMPT_TOKENS` for an engine that counts no
   finished requests, llama.cpp), the mean KV usage of the instances that decode, the busy
   share of the prefill instances' cards (a decode step is busy at any batch, so busy time
   measures nothing there);
3. latency: the p90 of TTFT and of the inter-token latency of the requests finished between
   the readings, from the histograms' bucket growth, interpolated within a bucket as
   Prometheus' ``histogram_quantile`` does; an engine without an ITL histogram (llama.cpp)
   gives the mean time per generated token instead, which is no p90 (it runs low).

An instance read once has no rates yet: it counts for the gauges only.

For learning capacity (:mod:`matrixpool.serving.capacity`), :func:`throughput` gives what one
replica of each phase processed, and prompt tokens per second of busy time where that busy
time is prefill's alone: a prefill-only instance of our simulated server, or llama.cpp's
``prompt_seconds_total`` (:attr:`Names.busy_is_prefill`), which sums each slot's prompt time, so
prompts batched together count more than once and the rate reads low (conservative); its
``prompt_tokens_total`` leaves out cached prompt tokens, as its demand does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from matrixpool.serving import estimator

QUANTILE = 0.9
# A request's prompt where the engine counts no finished requests (llama.cpp), so the period's
# mean prompt is unknown: an assumption, for turning waiting requests into waiting tokens.
ASSUMED_PROMPT_TOKENS = 1024.0
MIN_BUSY_SECONDS = 0.2  # less busy time in a period tells too little of a prefill rate


class Engine(StrEnum):
    """Whose metric names an instance exports (``spec.autoscaling.engine``)."""

    AUTO = "Auto"  # told from the names the text holds
    VLLM = "vLLM"
    SGLANG = "SGLang"
    LLAMA_CPP = "LlamaCpp"


@dataclass(frozen=True)
class Names:
    """An engine's names of each quantity, the first found of each tuple read (the current
    name first, then the ones it replaced); counters without ``_total``."""

    prefix: str
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_usage: tuple[str, ...] = ()
    prompt_tokens: tuple[str, ...] = ()
    generated_tokens: tuple[str, ...] = ()
    requests: tuple[str, ...] = ()
    busy_seconds: tuple[str, ...] = ()
    decode_seconds: tuple[str, ...] = ()  # time spent generating: a mean ITL without a histogram
    batch: tuple[str, ...] = ()  # sequences per decode step, on average (decode_seconds / wall)
    busy_is_prefill: bool = False  # busy_seconds counts prefill alone, whatever the role
    ttft: tuple[str, ...] = ()  # histograms
    itl: tuple[str, ...] = ()


ENGINES: dict[Engine, Names] = {
    Engine.VLLM: Names(
        prefix="vllm:",
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prompt_tokens=("vllm:prompt_tokens",),
        generated_tokens=("vllm:generation_tokens",),
        requests=("vllm:request_success",),
        busy_seconds=("matrixpool_serving_busy_seconds",),  # only our simulated server's
        ttft=("vllm:time_to_first_token_seconds",),
        itl=(  # per request (the SLO's TPOT), per token gap, the name removed after 0.13
            "vllm:request_time_per_output_token_seconds",
            "vllm:inter_token_latency_seconds",
            "vllm:time_per_output_token_seconds",
        ),
    ),
    Engine.SGLANG: Names(
        prefix="sglang:",
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        prompt_tokens=("sglang:prompt_tokens",),
        generated_tokens=("sglang:generation_tokens",),
        requests=("sglang:num_requests",),
        ttft=("sglang:time_to_first_token_seconds",),
        itl=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    ),
    Engine.LLAMA_CPP: Names(
        prefix="llamacpp:",
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        prompt_tokens=("llamacpp:prompt_tokens",),
        generated_tokens=("llamacpp:tokens_predicted",),
        busy_seconds=("llamacpp:prompt_seconds",),
        decode_seconds=("llamacpp:tokens_predicted_seconds",),
        batch=("llamacpp:n_busy_slots_per_decode",),
        busy_is_prefill=True,
    ),
}
GAUGES = ("running", "waiting", "kv_usage", "batch")
COUNTERS = ("prompt_tokens", "generated_tokens", "requests", "busy_seconds", "decode_seconds")


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
    decode_seconds: float = 0.0  # counter: time spent generating tokens (llama.cpp)
    batch: float = 0.0  # sequences per decode step since the engine started (llama.cpp)
    ttft: Histogram = Histogram()
    itl: Histogram = Histogram()
    engine: Engine = Engine.VLLM  # whose names were read
    missing: frozenset[str] = frozenset()  # quantities the text does not hold


def detect(text: str) -> Engine:
    """The engine whose names the text holds most of (vLLM's when none: our server's)."""
    counts = {
        engine: sum(line.startswith(names.prefix) for line in text.splitlines())
        for engine, names in ENGINES.items()
    }
    best = max(counts, key=lambda engine: counts[engine])
    return best if counts[best] else Engine.VLLM


def parse(text: str, at: float, engine: Engine = Engine.AUTO) -> Reading:
    """A reading from Prometheus text in ``engine``'s names (:data:`ENGINES`; ``AUTO``:
    :func:`detect`); series summed over their labels (one model each)."""
    chosen = detect(text) if engine == Engine.AUTO else engine
    names = ENGINES[chosen]
    histograms = {*names.ttft, *names.itl}
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and family.name in histograms:
                le = float(sample.labels["le"])
                found = buckets.setdefault(family.name, {})
                found[le] = found.get(le, 0.0) + sample.value
            elif sample.name in (f"{family.name}_total", family.name):
                name = family.name.removesuffix("_total")  # however the TYPE line spelled it
                values[name] = values.get(name, 0.0) + sample.value
    read: dict[str, float] = {}
    missing = set()
    for quantity in (*GAUGES, *COUNTERS):
        present = [n for n in getattr(names, quantity) if n in values]
        if present:
            read[quantity] = values[present[0]]
        else:
            missing.add(quantity)
    ttft, itl = (_first(buckets, getattr(names, h)) for h in ("ttft", "itl"))
    missing |= {h for h, found in (("ttft", ttft), ("itl", itl)) if found is None}
    return Reading(
        at=at,
        **read,
        ttft=ttft or Histogram(),
        itl=itl or Histogram(),
        engine=chosen,
        missing=frozenset(missing),
    )


def _first(buckets: dict[str, dict[float, float]], names: Sequence[str]) -> Histogram | None:
    for name in names:
        if name in buckets:
            return Histogram(tuple(sorted(buckets[name].items())))
    return None


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
    finished = sum(_rate(i, "requests") for i in arriving)
    prompt = sum(_rate(i, "prompt_tokens") for i in arriving)
    mean = mean_prompt(arriving)
    grown = sum(_growth(i) for i in arriving)  # requests/s the requests in the instances grew by
    output = sum(_rate(i, "generated_tokens") for i in rated if i.decodes)
    waiting = sum(i.now.waiting for i in instances if not i.decodes or alone)
    decoders = [i.now.kv_usage for i in instances if i.decodes]
    prefilling = [i for i in rated if not i.decodes]  # a decode step is busy at any batch
    busy = sum(_rate(i, "busy_seconds") * i.cards for i in prefilling)
    cards = sum(i.cards for i in prefilling)
    return estimator.Factors(
        arrival_rate=max(0.0, finished + grown),
        input_tokens_per_s=max(0.0, prompt + grown * mean),
        output_tokens_per_s=output,
        queue_depth=waiting * mean,
        kv_usage=sum(decoders) / len(decoders) if decoders else 0.0,
        card_utilisation=min(1.0, busy / cards) if cards else 0.0,
        ttft_p90_s=_merged(i.now.ttft.since(i.before.ttft if i.before else None) for i in rated),
        tpot_p90_s=itl_of(rated),
    )


def mean_prompt(arriving: Sequence[Instance]) -> float:
    """Prompt tokens per finished request over the period; an engine without a finished-request
    counter (llama.cpp), or a period in which none finished: :data:`ASSUMED_PROMPT_TOKENS`."""
    counted = [i for i in arriving if "requests" not in i.now.missing]
    finished = sum(_rate(i, "requests") for i in counted)
    if finished <= 0:
        return ASSUMED_PROMPT_TOKENS
    return sum(_rate(i, "prompt_tokens") for i in counted) / finished


@dataclass(frozen=True)
class Throughput:
    """What one replica of each phase processed over the period, for learning its capacity
    (:mod:`matrixpool.serving.capacity`)."""

    prefill_tokens_per_s: float  # prompt tokens/s per replica that prefills
    decode_tokens_per_s: float  # output tokens/s per replica that decodes
    prefill_busy_tokens_per_s: float | None  # prompt tokens per prefill busy second; None: no
    # busy time that counts prefill alone, or too little of it
    decode_busy_tokens_per_s: float | None = None  # output tokens per second of decoding; None:
    # the engine exports no decode time with its batch (llama.cpp alone does), or too little


def throughput(instances: Sequence[Instance]) -> Throughput:
    """Per replica: the prompt tokens of the instances that prefill, the output tokens of
    those that decode; and the prompt tokens per second of busy time where the busy time is
    prefill's alone (a prefill-only instance, or an engine that counts prefill apart) and adds
    up to at least :data:`MIN_BUSY_SECONDS`."""
    rated = [i for i in instances if i.before is not None and i.now.at > i.before.at]
    alone = all(i.decodes for i in instances)
    arriving = [i for i in rated if not i.decodes or alone]
    decoding = [i for i in rated if i.decodes]
    timed = [
        i
        for i in arriving
        if "busy_seconds" not in i.now.missing
        and (not i.decodes or ENGINES[i.now.engine].busy_is_prefill)
    ]
    busy = sum(_grown(i, "busy_seconds") for i in timed)
    tokens = sum(_grown(i, "prompt_tokens") for i in timed)
    return Throughput(
        prefill_tokens_per_s=_per(sum(_rate(i, "prompt_tokens") for i in arriving), arriving),
        decode_tokens_per_s=_per(sum(_rate(i, "generated_tokens") for i in decoding), decoding),
        prefill_busy_tokens_per_s=tokens / busy if busy >= MIN_BUSY_SECONDS and tokens else None,
        decode_busy_tokens_per_s=decode_busy_rate(decoding),
    )


def decode_busy_rate(decoding: Sequence[Instance]) -> float | None:
    """Output tokens per second of decoding, where the engine says how long its slots generated
    and how many sequences a decode step carried (llama.cpp: ``tokens_predicted_seconds`` sums
    each slot's generating time, so over the mean batch it is the wall time spent decoding).
    The rate at the batch the replica ran, not the most it could: a fuller batch yields more,
    so the figure errs low (more replicas, never fewer). Prompt steps that shared a batch with
    decode are in both phases' times: low again."""
    timed = [
        i for i in decoding if not {"decode_seconds", "batch"} & i.now.missing and i.now.batch > 0
    ]
    wall = sum(_grown(i, "decode_seconds") / max(1.0, i.now.batch) for i in timed)
    tokens = sum(_grown(i, "generated_tokens") for i in timed)
    return tokens / wall if wall >= MIN_BUSY_SECONDS and tokens else None


def _per(total: float, instances: Sequence[Instance]) -> float:
    return total / len(instances) if instances else 0.0


def _growth(instance: Instance) -> float:
    """Requests/s by which the requests in the instance, waiting and running, grew (negative:
    they fell)."""
    before, now = instance.before, instance.now
    assert before is not None
    return (now.waiting + now.running - before.waiting - before.running) / (now.at - before.at)


def itl_of(rated: Sequence[Instance]) -> float | None:
    """The p90 inter-token latency of the requests finished between the readings; for an
    engine without the histogram (llama.cpp), the mean seconds per generated token."""
    merged = _merged(i.now.itl.since(i.before.itl if i.before else None) for i in rated)
    if merged is not None:
        return merged
    timed = [i for i in rated if "itl" in i.now.missing and "decode_seconds" not in i.now.missing]
    tokens = sum(_rate(i, "generated_tokens") for i in timed)
    return sum(_rate(i, "decode_seconds") for i in timed) / tokens if tokens > 0 else None


def _rate(instance: Instance, counter: str) -> float:
    assert instance.before is not None
    return _grown(instance, counter) / (instance.now.at - instance.before.at)


def _grown(instance: Instance, counter: str) -> float:
    """The counter's growth between the readings (went down: restarted, counts from 0)."""
    assert instance.before is not None
    now, before = float(getattr(instance.now, counter)), float(getattr(instance.before, counter))
    return now - before if now >= before else now


def _merged(histograms: Iterable[Histogram]) -> float | None:
    """The p90 of the observations of all ``histograms`` together (same buckets)."""
    total: dict[float, float] = {}
    for histogram in histograms:
        for le, count in histogram.buckets:
            total[le] = total.get(le, 0.0) + count
    return Histogram(tuple(sorted(total.items()))).quantile(QUANTILE)


def summary(now: Reading, before: Reading | None = None) -> dict[str, Any]:
    """What the autoscaler reads from one instance, as ``matrixpool readings`` prints it: the
    gauges of ``now``; with ``before`` (an earlier reading) the rates and the latency of the
    requests finished in between, else latency over everything the engine counted since it
    started and no rates. None for what the engine does not export."""
    rated = before is not None and now.at > before.at
    instance = Instance(before if rated else None, now, cards=1, decodes=True)

    def rate(counter: str) -> float | None:
        return _rate(instance, counter) if rated and counter not in now.missing else None

    def gauge(name: str) -> float | None:
        return None if name in now.missing else float(getattr(now, name))

    earlier = before if rated else None
    ttft = None if "ttft" in now.missing else now.ttft.since(earlier.ttft if earlier else None)
    itl = None if "itl" in now.missing else now.itl.since(earlier.itl if earlier else None)
    itl_p90 = itl.quantile(QUANTILE) if itl else None
    mean = itl_of([instance]) if rated and itl is None else None
    return {
        "engine": now.engine.value,
        "ttft_p90_s": ttft.quantile(QUANTILE) if ttft else None,
        "itl_p90_s": itl_p90,
        "itl_mean_s": mean,  # an engine without the histogram: the mean, not a p90
        "running": gauge("running"),
        "waiting": gauge("waiting"),
        "kv_usage": gauge("kv_usage"),
        "requests_per_s": rate("requests"),
        "prompt_tokens_per_s": rate("prompt_tokens"),
        "generation_tokens_per_s": rate("generated_tokens"),
        "seconds_between_readings": round(now.at - before.at, 3) if rated and before else None,
        "missing": sorted(now.missing),
    }
