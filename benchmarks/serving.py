"""Serving: one day of load on one disaggregated InferenceService, sized three ways, in
simulated time — SLO attainment and card-hours of each.

    .venv/bin/python benchmarks/serving.py --json --png docs/img/serving.png

The three ways, on the same requests (one seed):

- ``fixed``: prefill and decode replicas sized for the load's ceiling (the estimator's answer
  at the pattern's peak rate with its bursts), all day;
- ``window``: the same spec under the supernode's time windows, as matrixpool serves it
  without an autoscaler: ``timeshare.split.target_split`` at every window boundary (day: the
  spec; night: what the window's inference cards hold, ``ratio`` kept);
- ``autoscaler``: ``serving.estimator.estimate`` and its ``Stabilizer`` every control period,
  fed from what the instances' metrics would show over the last period, inside the window's
  cap.

What runs: each instance is a ``serving.engine.Engine`` (the engine the simulated inference
server runs) with the latency model of ``serving.latency`` (CloudMatrix-Infer's published
prefill and decode rates per card); prefill instances of ``PREFILL_CARDS`` cards, decode
instances of ``DECODE_CARDS`` cards. A request goes to the ready prefill instance with the fewest
requests outstanding, then (its KV moved over the supernode's network) to the decode instance
with the fewest; it waits in the router while no instance is ready. TTFT is arrival to the
prefill's first token; TPOT is (last token - first token) / (output tokens - 1). A new instance
serves ``START_S`` after it is created (model load); a removed one first drains (takes no new
request, finishes its own), so no request is ever dropped — the JSON counts them
(``failed``).

The day is compressed: one hour of the daily curve (``serving.workload.DailyPattern``, its
bursts and the Azure-conversation lengths) lasts ``--hour-seconds`` (300: the day in two
simulated hours), and so does everything else measured in the day's time — the control period
(the HPA's 15 s), the scale-down stabilisation (300 s), the start time (60 s), the bursts — by
the same factor. Requests keep their real sizes and the engines their real speeds: a request is
as long as it would be, only the day around it is shorter. Card-hours are of the whole day
(simulated card-seconds times the factor).

Left out: the API server and the pods (the operator's autoscaler controller reads the same
factors from real servers' /metrics; this figure is the policy's, not the plumbing's), network
contention between KV transfers, and preemption of training by the window (its own benchmark).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matrixpool.api import supernode
from matrixpool.serving import engine, estimator, latency, workload
from matrixpool.timeshare import split
from matrixpool_recovery import kvpool

MODEL = latency.DEFAULT
PREFILL_CARDS = 8  # one node of an Ascend 910 supernode per prefill instance
DECODE_CARDS = 16  # two nodes per decode instance (a data-parallel decode group, not EP320)
TTFT_S, TPOT_S = 1.0, 0.050  # the SLO: 1 s to the first token, 50 ms per token after it
GOAL = 0.95  # share of requests meeting both
PEAK_RPS = 200.0  # requests per second at the daily curve's top
# In the day's time (divided by the compression factor in the simulation):
START_S = 60.0  # a new instance's model load, before it serves (assumption)
CONTROL_S = 15.0  # the autoscaler's period (the HPA's --horizontal-pod-autoscaler-sync-period)
STABILIZATION_S = 300.0  # scale-down stabilisation (the HPA's default; the CRD's default)
# The supernode's windows (examples/supernode-cloudmatrix384.yaml): inference may hold 352
# cards from 08:00 to 22:00 and 64 at night.
WINDOWS = (
    supernode.TimeWindow(name="day", start="08:00", end="22:00", inference_cards=352),
    supernode.TimeWindow(name="night", start="22:00", end="08:00", inference_cards=64),
)
POOL_CARDS = 376  # the example's 384 cards less its spare node
ROLES = ("prefill", "decode")


# --- the load ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compressed:
    """A daily pattern played ``factor`` times faster: the same curve and bursts, shorter."""

    inner: workload.DailyPattern
    factor: float  # day seconds per simulated second

    @property
    def bursts(self) -> workload.Bursts | None:
        b = self.inner.bursts
        if b is None:
            return None
        return workload.Bursts(b.per_hour * self.factor, b.duration_s / self.factor, b.size)

    def rate(self, t_s: float) -> float:
        return self.inner.rate(t_s * self.factor)

    def ceiling(self) -> float:
        return self.inner.ceiling()


@dataclass(frozen=True)
class Ask:
    """One request of the day: when, and how long its prompt and output are."""

    id: int
    arrival_s: float  # simulated seconds from midnight
    prompt_tokens: int
    output_tokens: int


def day_of_requests(pattern: Compressed, seconds: float, seed: int) -> list[Ask]:
    """The requests of the compressed day; lengths drawn as ``workload.requests`` draws them
    (the token ids themselves are not needed here)."""
    lengths = workload.LengthModel()
    draws = random.Random(f"{seed}/lengths")
    asks = []
    for index, arrival in enumerate(workload.arrival_times(pattern, seconds, seed)):
        prompt, output = lengths.prompt.draw(draws), lengths.output.draw(draws)
        asks.append(Ask(index, arrival, prompt, output))
    return asks


# --- the fleet: instances, router, card-seconds -------------------------------------------------
@dataclass(eq=False)
class Instance:
    role: str  # prefill or decode
    cards: int
    engine: engine.Engine
    created_s: float
    ready_s: float  # serves from then on
    removed_s: float | None = None
    outstanding: int = 0  # requests sent to it and not finished
    busy_mark: float = 0.0  # engine busy seconds at the last control period


@dataclass
class Record:
    """What one request saw."""

    arrival_s: float
    output_tokens: int
    first_token_s: float | None = None
    finished_s: float | None = None

    def meets(self) -> bool:
        if self.first_token_s is None or self.finished_s is None:
            return False
        if self.first_token_s - self.arrival_s > TTFT_S:
            return False
        if self.output_tokens < 2:
            return True
        tpot = (self.finished_s - self.first_token_s) / (self.output_tokens - 1)
        return tpot <= TPOT_S


class Fleet:
    """The service's instances, the router in front of them, and what they cost."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.instances: dict[str, list[Instance]] = {role: [] for role in ROLES}
        self.draining: list[Instance] = []
        self.gone: list[Instance] = []
        self.backlog: deque[Ask] = deque()  # arrived while no prefill instance was ready
        self.records: dict[int, Record] = {}
        self.asks: dict[int, Ask] = {}
        self.period = Period()

    # -- scaling
    def replicas(self) -> estimator.Replicas:
        return estimator.Replicas(len(self.instances["prefill"]), len(self.instances["decode"]))

    def scale(self, wanted: estimator.Replicas, now: float, warm: bool = False) -> None:
        for role, count in zip(ROLES, (wanted.prefill, wanted.decode), strict=True):
            live = self.instances[role]
            while len(live) < count:
                live.append(self.new_instance(role, now, warm))
            if len(live) > count:
                # keep the ready ones with most outstanding; drain those starting, then the idlest
                live.sort(key=lambda i: (i.ready_s > now, -i.outstanding))
                for instance in live[count:]:
                    instance.engine.drain()
                    self.draining.append(instance)
                del live[count:]

    def new_instance(self, role: str, now: float, warm: bool) -> Instance:
        cards = PREFILL_CARDS if role == "prefill" else DECODE_CARDS
        kind = engine.Role.PREFILL if role == "prefill" else engine.Role.DECODE
        unit = engine.Engine(model=MODEL, cards=cards, role=kind, tokens=False)
        ready = now if warm else now + self.start_s
        return Instance(role, cards, unit, created_s=now, ready_s=ready)

    def reap(self, now: float) -> None:
        """Drained instances with nothing left go (their cards stop counting)."""
        for instance in list(self.draining):
            if instance.engine.idle:
                instance.removed_s = now
                self.draining.remove(instance)
                self.gone.append(instance)

    # -- routing
    def ready(self, role: str, now: float) -> list[Instance]:
        return [i for i in self.instances[role] if i.ready_s <= now]

    def arrive(self, ask: Ask) -> None:
        self.asks[ask.id] = ask
        self.records[ask.id] = Record(ask.arrival_s, ask.output_tokens)
        self.period.arrived(ask)
        self.backlog.append(ask)
        self.dispatch(ask.arrival_s)

    def dispatch(self, now: float) -> None:
        """Send the router's backlog to the ready prefill instances, fewest outstanding first."""
        ready = self.ready("prefill", now)
        while self.backlog and ready:
            target = min(ready, key=lambda i: i.outstanding)
            ask = self.backlog.popleft()
            target.outstanding += 1
            request = engine.Request(str(ask.id), ask.prompt_tokens, ask.output_tokens)
            refused = target.engine.submit(request, now)
            assert refused is None, refused  # never draining (not in instances), never too large

    def run_until(self, until: float) -> None:
        """Advance every engine to ``until`` in time order: prefills' first tokens go on to a
        decode instance at the moment they are out."""
        handoffs: list[tuple[float, int]] = []
        for instance in self.live():
            if instance.role != "prefill":
                continue
            for event in instance.engine.advance(until):
                if isinstance(event, engine.Finished):
                    instance.outstanding -= 1
                    handoffs.append((event.time, int(event.request_id)))
        handoffs.sort()
        for at, ask_id in handoffs:
            self.first_token(ask_id, at)
        for instance in self.live():
            if instance.role == "decode":
                self.collect(instance, instance.engine.advance(until))

    def first_token(self, ask_id: int, at: float) -> None:
        record, ask = self.records[ask_id], self.asks[ask_id]
        record.first_token_s = at
        self.period.first_token(record, ask)
        if ask.output_tokens < 2:
            self.finish(ask_id, at)
            return
        decoders = [i for i in self.instances["decode"] if i.ready_s <= at]
        if not decoders:  # none ready yet: the first that will be (never none: floor >= 1)
            decoders = [min(self.instances["decode"], key=lambda i: i.ready_s)]
        for instance in decoders:
            self.collect(instance, instance.engine.advance(at))
        target = min(decoders, key=lambda i: i.outstanding)
        target.outstanding += 1
        request = engine.Request(str(ask_id), ask.prompt_tokens, ask.output_tokens)
        refused = target.engine.submit(request, max(at, target.ready_s))
        assert refused is None, refused

    def collect(self, instance: Instance, events: Iterable[engine.Event]) -> None:
        for event in events:
            if isinstance(event, engine.Finished):
                instance.outstanding -= 1
                self.finish(int(event.request_id), event.time)

    def finish(self, ask_id: int, at: float) -> None:
        record = self.records[ask_id]
        record.finished_s = at
        self.period.finished(record)
        del self.asks[ask_id]

    def live(self) -> list[Instance]:
        return [*self.instances["prefill"], *self.instances["decode"], *self.draining]

    def card_seconds(self, until: float) -> float:
        everyone = [*self.live(), *self.gone]
        return sum(i.cards * ((i.removed_s or until) - i.created_s) for i in everyone)


# --- what the metrics show over one control period ----------------------------------------------
@dataclass
class Period:
    """The counters an autoscaler reads from the instances' /metrics, since the last period."""

    arrivals: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # tokens the requests that reached decode will generate
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)

    def arrived(self, ask: Ask) -> None:
        self.arrivals += 1
        self.prompt_tokens += ask.prompt_tokens

    def first_token(self, record: Record, ask: Ask) -> None:
        assert record.first_token_s is not None
        self.ttfts.append(record.first_token_s - record.arrival_s)
        self.output_tokens += ask.output_tokens

    def finished(self, record: Record) -> None:
        if record.first_token_s is not None and record.output_tokens > 1:
            assert record.finished_s is not None
            tpot = (record.finished_s - record.first_token_s) / (record.output_tokens - 1)
            self.tpots.append(tpot)


def p90(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def factors_of(fleet: Fleet, seconds: float, now: float) -> estimator.Factors:
    """The period's load as the estimator takes it."""
    period = fleet.period
    mean_prompt = period.prompt_tokens / period.arrivals if period.arrivals else 0.0
    queued = len(fleet.backlog) + sum(
        i.engine.gauges().waiting for i in fleet.instances["prefill"]
    )  # requests waiting, as vllm:num_requests_waiting counts them
    waiting = queued * mean_prompt
    decoders = [i for i in fleet.instances["decode"] if i.ready_s <= now]
    kv = [i.engine.gauges().kv_usage for i in decoders]
    busy, cards = 0.0, 0
    for instance in fleet.live():
        if instance.ready_s <= now and instance.role == "prefill":
            spent = instance.engine.gauges().busy_seconds
            busy += (spent - instance.busy_mark) * instance.cards
            cards += instance.cards
            instance.busy_mark = spent
    return estimator.Factors(
        arrival_rate=period.arrivals / seconds,
        input_tokens_per_s=period.prompt_tokens / seconds,
        output_tokens_per_s=period.output_tokens / seconds,
        queue_depth=waiting,
        kv_usage=sum(kv) / len(kv) if kv else 0.0,
        card_utilisation=min(1.0, busy / (cards * seconds)) if cards else 0.0,
        ttft_p90_s=p90(period.ttfts),
        tpot_p90_s=p90(period.tpots),
    )


# --- sizing -------------------------------------------------------------------------------------
def capacity() -> estimator.Capacity:
    """One replica's rates: prefill at the per-card rate; decode at the operating batch with
    the conversation lengths' mean context (prompt + half the output)."""
    batch = MODEL.operating_batch(DECODE_CARDS)
    context = batch * (1700 + 100)
    return estimator.Capacity(
        prefill_tokens_per_s=MODEL.prefill_tokens_per_s_per_card * PREFILL_CARDS,
        decode_tokens_per_s=MODEL.decode_tokens_per_s(batch, context, DECODE_CARDS),
    )


def bounds(top: estimator.Replicas) -> estimator.Bounds:
    return estimator.Bounds(
        prefill=estimator.RoleBounds(1, top.prefill, PREFILL_CARDS),
        decode=estimator.RoleBounds(1, top.decode, DECODE_CARDS),
    )


TARGETS = estimator.Targets(ttft_s=TTFT_S, tpot_s=TPOT_S)


def peak_sizing(pattern: workload.DailyPattern, asks: Sequence[Ask]) -> estimator.Replicas:
    """What the estimator asks for at the pattern's ceiling with its bursts: the fixed size."""
    rate = pattern.ceiling() * (1 + (pattern.bursts.size if pattern.bursts else 0))
    prompt = sum(a.prompt_tokens for a in asks) / len(asks)
    output = sum(a.output_tokens for a in asks) / len(asks)
    loose = estimator.Bounds(
        prefill=estimator.RoleBounds(1, 1000, PREFILL_CARDS),
        decode=estimator.RoleBounds(1, 1000, DECODE_CARDS),
    )
    factors = estimator.Factors(
        arrival_rate=rate, input_tokens_per_s=rate * prompt, output_tokens_per_s=rate * output
    )
    advice = estimator.estimate(factors, TARGETS, loose, capacity(), estimator.Replicas(1, 1))
    return advice.replicas


def window_at(t_s: float, factor: float) -> supernode.TimeWindow:
    minute = int((t_s * factor) % workload.DAY_S // 60)
    return next(w for w in WINDOWS if w.contains(minute))


def window_replicas(top: estimator.Replicas, window: supernode.TimeWindow) -> estimator.Replicas:
    """The time-sharing split's replicas for the service in ``window`` (no training asks)."""
    roles = (
        split.RoleDemand("prefill", top.prefill, 1, PREFILL_CARDS),
        split.RoleDemand("decode", top.decode, 1, DECODE_CARDS),
    )
    ratio = {"prefill": top.prefill, "decode": top.decode}
    demand = split.InferenceDemand(split.WorkloadKey("bench/svc"), 1000, roles, ratio)
    target = split.target_split(POOL_CARDS, window, [demand], [])
    got = target.inference[demand.key]
    return estimator.Replicas(got["prefill"], got["decode"])


# --- the three policies -------------------------------------------------------------------------
Policy = Callable[[Fleet, float, float], None]  # (fleet, now, period seconds): scale the fleet


def fixed(top: estimator.Replicas) -> Policy:
    def policy(fleet: Fleet, now: float, seconds: float) -> None:
        if fleet.replicas() != top:
            fleet.scale(top, now, warm=now == 0)

    return policy


def windowed(top: estimator.Replicas, factor: float) -> Policy:
    def policy(fleet: Fleet, now: float, seconds: float) -> None:
        wanted = window_replicas(top, window_at(now, factor))
        if fleet.replicas() != wanted:
            fleet.scale(wanted, now, warm=now == 0)

    return policy


def autoscaled(top: estimator.Replicas, factor: float) -> Policy:
    state = {"stabilizer": estimator.Stabilizer(scale_down_window_s=STABILIZATION_S / factor)}

    def policy(fleet: Fleet, now: float, seconds: float) -> None:
        current = fleet.replicas()
        if now == 0:
            fleet.scale(estimator.Replicas(1, 1), now, warm=True)
            return
        cap = window_at(now, factor).inference_cards
        factors = factors_of(fleet, seconds, now)
        advice = estimator.estimate(factors, TARGETS, bounds(top), capacity(), current,
                                    cap_cards=cap)  # fmt: skip
        state["stabilizer"], decision = state["stabilizer"].step(now, current, advice)
        wanted = estimator.Replicas(decision.prefill, decision.decode)
        if wanted != current:
            fleet.scale(wanted, now)

    return policy


# --- one run --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    attainment: float
    card_hours: float
    failed: int
    ttft_p50_s: float
    replicas: list[tuple[float, int, int]]  # (hour of day, prefill, decode) at each period


def simulate(policy: Policy, asks: Sequence[Ask], day_s: float, factor: float) -> Outcome:
    fleet = Fleet(START_S / factor)
    period_s = CONTROL_S / factor
    ticks = 0
    trace: list[tuple[float, int, int]] = []

    def control(now: float) -> None:
        fleet.run_until(now)
        policy(fleet, now, period_s)
        fleet.period = Period()
        fleet.reap(now)
        fleet.dispatch(now)
        now_replicas = fleet.replicas()
        trace.append((now * factor / 3600, now_replicas.prefill, now_replicas.decode))

    control(0.0)
    for ask in asks:
        while (ticks + 1) * period_s <= ask.arrival_s:
            ticks += 1
            control(ticks * period_s)
        fleet.run_until(ask.arrival_s)
        fleet.arrive(ask)
    while fleet.asks or fleet.backlog:  # the tail: every accepted request finishes
        ticks += 1
        control(ticks * period_s)
    end = max(day_s, ticks * period_s)
    records = list(fleet.records.values())
    done = [r for r in records if r.finished_s is not None]
    ttfts = sorted(r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None)
    return Outcome(
        attainment=sum(r.meets() for r in records) / len(records),
        card_hours=fleet.card_seconds(end) * factor / 3600,
        failed=len(records) - len(done),
        ttft_p50_s=ttfts[len(ttfts) // 2],
        replicas=trace,
    )


# --- the KV-cache pool: shared prefixes, with and without --------------------------------------
PREFIX_INSTANCES = 4  # prefill instances, one node each (their pools: the supernode's)
PREFIX_RPS = 90.0  # ~75% of the four instances' prefill rate without the pool
PREFIX_SECONDS = 120.0
POOL_BYTES_PER_NODE = 64 << 30  # SuperNode spec.memoryPool.perNode
KV_QUOTA_BYTES = 32 << 30  # the service's spec.kvCache, per node's pool
SERVICE = "bench-service-uid"
# Multi-turn chats and shared system prompts: 70% of the requests start with one of 8 prefixes
# of 1,024 tokens (an assumption, stated in docs/benchmarks.md); prompts a median 1,500 tokens.
SHARED = workload.LengthModel(
    prompt=workload.Lognormal(1500, 0.6, 64, 8192),
    shared_prefix_share=0.7,
    prefix_count=8,
    prefix_tokens=1024,
)


@dataclass
class Pools:
    """One KvPool per node (the pool's own code, as the node daemons hold it), looked up
    local node first; what was found and moved."""

    pools: list[kvpool.KvPool]
    block: bytes  # the bytes of one 16-token block's KV (shared: only its size matters here)
    lookups: int = 0
    hits: int = 0
    bytes_moved: int = 0

    @staticmethod
    def of(nodes: int) -> Pools:
        pools = [kvpool.KvPool(POOL_BYTES_PER_NODE) for _ in range(nodes)]
        for pool in pools:
            pool.set_quota(SERVICE, KV_QUOTA_BYTES)
        return Pools(pools, bytes(MODEL.kv_bytes(engine.BLOCK_TOKENS)))

    def cached(self, node: int, hashes: Sequence[str]) -> engine.Hit | None:
        """The longest run of blocks from the prompt's start that some pool holds (each block
        from wherever it is); remote when any came from another node."""
        self.lookups += 1
        tokens, remote = 0, False
        for index, block_hash in enumerate(hashes):
            where = self.find(node, block_hash)
            if where is None:
                break
            tokens, remote = (index + 1) * engine.BLOCK_TOKENS, remote or where != node
        if not tokens:
            return None
        self.hits += 1
        self.bytes_moved += MODEL.kv_bytes(tokens)
        return engine.Hit(tokens, remote)

    def find(self, node: int, block_hash: str) -> int | None:
        order = [node, *(n for n in range(len(self.pools)) if n != node)]
        return next((n for n in order if self.pools[n].get(SERVICE, block_hash)), None)

    def keep(self, node: int, hashes: Sequence[str]) -> None:
        """A prefill done: its blocks go to its node's pool (the quota evicts the oldest)."""
        for index, block_hash in enumerate(hashes):
            tokens = (index + 1) * engine.BLOCK_TOKENS
            self.pools[node].put(SERVICE, block_hash, kvpool.Block(tokens, self.block))


def prefix_run(asks: Sequence[workload.Request], pooled: bool) -> tuple[float, Pools]:
    """TTFT p50 of the same shared-prefix requests on PREFIX_INSTANCES prefill instances,
    least-outstanding routing (not prefix-aware), with or without the pool."""
    pools = Pools.of(PREFIX_INSTANCES)
    wanted: dict[str, engine.Hit | None] = {}  # request id -> what the pool holds for it
    units = [
        engine.Engine(model=MODEL, cards=PREFILL_CARDS, role=engine.Role.PREFILL, tokens=False,
                      prefix_cache=(lambda h: wanted.get(h)) if pooled else None)
        for _ in range(PREFIX_INSTANCES)
    ]  # fmt: skip
    outstanding = [0] * PREFIX_INSTANCES
    hashes: dict[str, tuple[tuple[str, ...], int]] = {}  # request id -> (its hashes, node)
    ttfts: list[float] = []

    def collect(node: int, until: float) -> None:
        for event in units[node].advance(until):
            if isinstance(event, engine.Finished):
                outstanding[node] -= 1
                ttfts.append(event.timing.ttft_s)
                own, _ = hashes.pop(event.request_id)
                if pooled:
                    pools.keep(node, own)

    for ask in asks:
        for node in range(PREFIX_INSTANCES):
            collect(node, ask.arrival_s)
        node = min(range(PREFIX_INSTANCES), key=lambda n: outstanding[n])
        own = engine.block_hashes(ask.prompt)
        key = str(ask.id)
        hashes[key] = (own, node)
        if pooled and own:
            wanted[own[-1]] = pools.cached(node, own)  # the engine asks longest first
        outstanding[node] += 1
        refused = units[node].submit(
            engine.Request(key, len(ask.prompt), ask.output_tokens, own[-1:] if pooled else ()),
            ask.arrival_s,
        )
        assert refused is None, refused
    for node in range(PREFIX_INSTANCES):
        collect(node, float("inf"))
    ttfts.sort()
    return ttfts[len(ttfts) // 2], pools


def prefix_figures(seed: int) -> dict[str, Any]:
    pattern = workload.step_pattern([PREFIX_RPS], PREFIX_SECONDS)
    asks = workload.generate(pattern, SHARED, PREFIX_SECONDS, seed)
    without, _ = prefix_run(asks, pooled=False)
    with_pool, pools = prefix_run(asks, pooled=True)
    return {
        "ttft_p50_pool_s": round(with_pool, 4),
        "ttft_p50_nopool_s": round(without, 4),
        "ratio": round(with_pool / without, 3),
        "hit_rate": round(pools.hits / pools.lookups, 3),
        "bytes_moved": pools.bytes_moved,
        "requests": len(asks),
        "goal_ratio_at_most": 0.5,
    }


def write_png(path: Path, pattern: Compressed, outcomes: dict[str, Outcome]) -> str | None:
    """The day's load (requests/s) over the cards each policy held, by hour; None when
    written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    figure, cards = plt.subplots(figsize=(10, 4.5))
    for name, outcome in outcomes.items():
        hours = [h for h, _, _ in outcome.replicas]
        held = [p * PREFILL_CARDS + d * DECODE_CARDS for _, p, d in outcome.replicas]
        cards.step(hours, held, where="post", label=f"{name}: cards held")
    cards.set_xlabel("hour of the day")
    cards.set_ylabel("cards held")
    cards.set_xlim(0, 24)
    load = cards.twinx()
    hours = [h / 4 for h in range(24 * 4 + 1)]
    load.plot(hours, [pattern.inner.rate(h * 3600) for h in hours], "k:", label="load")
    load.set_ylabel("requests per second (dotted, bursts left out)")
    load.set_ylim(0, None)
    cards.legend(loc="upper left")
    cards.set_title("one InferenceService through a day: fixed, by window, by the autoscaler")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return None


def real_engine(seed: int, say: Callable[[str], None]) -> dict[str, Any]:
    """The real engine's rows: llama.cpp's server, sized fixed and by the autoscaler
    (``serving_llamacpp``), and its prefix cache against the pool (``serving_prefix_llamacpp``)."""
    try:  # run as a script: benchmarks/ is on sys.path
        import serving_llamacpp
        import serving_prefix_llamacpp
    except ImportError:  # imported as benchmarks.serving
        from benchmarks import serving_llamacpp, serving_prefix_llamacpp

    started = time.perf_counter()
    sized = serving_llamacpp.figures(seed)
    say(f"llama.cpp sized: {sized} in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    prefix = serving_prefix_llamacpp.figures(seed)
    say(f"llama.cpp prefix: {prefix} in {time.perf_counter() - started:.1f} s")
    return {**sized, "prefix": prefix}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument(
        "--hour-seconds",
        type=float,
        default=300.0,
        help="simulated seconds per hour of the daily curve (default 300)",
    )
    parser.add_argument("--peak-rps", type=float, default=PEAK_RPS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--png", type=Path, help="write the day's load and cards held here")
    parser.add_argument(
        "--no-engines",
        action="store_true",
        help="leave out the real engine's rows (llama.cpp, minutes of wall time)",
    )
    args = parser.parse_args()  # fmt: skip
    say = (lambda _: None) if args.json else (lambda line: print(line, file=sys.stderr))
    factor = 3600 / args.hour_seconds
    day = workload.DailyPattern(peak_rps=args.peak_rps)
    pattern = Compressed(day, factor)
    day_s = workload.DAY_S / factor
    asks = day_of_requests(pattern, day_s, args.seed)
    top = peak_sizing(day, asks)
    say(f"{len(asks)} requests; fixed size {top.prefill} prefill, {top.decode} decode")
    results: dict[str, Any] = {}
    outcomes: dict[str, Outcome] = {}
    for name, policy in (
        ("fixed", fixed(top)),
        ("window", windowed(top, factor)),
        ("autoscaler", autoscaled(top, factor)),
    ):
        started = time.perf_counter()
        outcome = outcomes[name] = simulate(policy, asks, day_s, factor)
        results[name] = {
            "slo_attainment": round(outcome.attainment, 4),
            "card_hours": round(outcome.card_hours, 1),
            "failed": outcome.failed,
            "ttft_p50_s": round(outcome.ttft_p50_s, 3),
            "peak_replicas": [max(r[1] for r in outcome.replicas),
                              max(r[2] for r in outcome.replicas)],
        }  # fmt: skip
        say(f"{name}: {results[name]} in {time.perf_counter() - started:.1f} s")
    fixed_hours = results["fixed"]["card_hours"]
    results["autoscaler"]["card_hours_vs_fixed"] = round(
        results["autoscaler"]["card_hours"] / fixed_hours, 3
    )
    results["window"]["card_hours_vs_fixed"] = round(
        results["window"]["card_hours"] / fixed_hours, 3
    )
    started = time.perf_counter()
    results["prefix"] = prefix_figures(args.seed)
    say(f"prefix: {results['prefix']} in {time.perf_counter() - started:.1f} s")
    results["goal"] = {
        "attainment_at_least": GOAL,
        "card_hours_vs_fixed_at_most": 0.7,
        "met": results["autoscaler"]["slo_attainment"] >= GOAL
        and results["autoscaler"]["card_hours_vs_fixed"] <= 0.7,
    }
    results["setting"] = {
        "requests": len(asks),
        "peak_rps": args.peak_rps,
        "hour_seconds": args.hour_seconds,
        "ttft_s": TTFT_S,
        "tpot_s": TPOT_S,
        "prefill_cards": PREFILL_CARDS,
        "decode_cards": DECODE_CARDS,
        "fixed_replicas": [top.prefill, top.decode],
        "seed": args.seed,
    }
    results["simulated"] = (
        "the rows above run our simulated engine, whose speed and the estimator's first-guess "
        "capacity are one latency model: the policy's bound, not an engine's measurement"
    )
    if not args.no_engines:
        results["engines"] = {"llama.cpp": real_engine(args.seed, say)}
    if args.png is not None:
        results["png"] = write_png(args.png, pattern, outcomes) or str(args.png)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
