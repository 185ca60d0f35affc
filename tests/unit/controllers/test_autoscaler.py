"""The inference autoscaler's controller (controllers.autoscaler) with a recording executor: it
reads the ready pods' /metrics in the background, turns two readings into a recommendation
inside the person's ranges, writes status.recommendation with an Event (Scaled in Auto mode,
Recommended in Advisory mode), and writes nothing without rates or without answers."""

from __future__ import annotations

import asyncio
import functools
import itertools
import re
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from prometheus_client import REGISTRY

from matrixpool.api import inferenceservice
from matrixpool.controllers import autoscaler
from matrixpool.serving import engine, latency, readings, server
from matrixpool.state.workloads import Workload
from tests.unit import recorder, worlds
from tests.unit.clocks import Ticking

PREFILL_URL = "http://10.1.0.1:8000/metrics"
DECODE_URL = "http://10.1.0.2:8000/metrics"


def synchronously(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test in a loop of its own (fixtures pass through)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def service(
    mode: str = "Auto",
    status: dict[str, Any] | None = None,
    capacity: dict[str, int] | None = None,
) -> Workload:
    """chat: prefill 1..8 instances of 8 cards, decode 1..4 of 16, SLO 1 s / 50 ms; with
    ``capacity``, spec.autoscaling.capacity as a person states it."""
    body = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ns", "uid": "uid-chat"},
        "spec": {
            "superNode": "sn-a",
            "roles": [
                {"name": "prefill", "replicas": 8, "minReplicas": 1, "cardsPerPod": 8},
                {"name": "decode", "replicas": 4, "minReplicas": 1, "cardsPerPod": 16},
            ],
            "autoscaling": {
                "mode": mode,
                "targets": {"ttftMilliseconds": 1000, "tpotMilliseconds": 50},
                **({"capacity": capacity} if capacity else {}),
            },
        },
    }
    model = inferenceservice.parse(body)
    roles = [{"name": "prefill", "replicas": 2}, {"name": "decode", "replicas": 1}]
    return Workload(
        "InferenceService", "ns", "chat", "uid-chat", "", 1, model, None,
        status if status is not None else {"roles": roles},
    )  # fmt: skip


def instance(role: str, uid: str, ip: str) -> Any:
    return worlds.pod(f"chat-{role}-0", uid, owner="chat", kind="InferenceService", role=role,
                      node="n0", phase="Running", ready=True, ip=ip)  # fmt: skip


def metrics_text(
    requests: int, prompt: int, tokens: int, *, ttft: float = 0.1, busy: float = 0.0
) -> str:
    """An instance that finished ``requests`` requests of ``prompt`` prompt tokens and
    ``tokens`` output tokens each, the first token after ``ttft`` and the next 20 ms apart, and
    was busy ``busy`` seconds."""
    metrics = server.Metrics("chat")
    times = tuple(ttft + 0.02 * k for k in range(tokens))
    for _ in range(requests):
        metrics.observe(engine.Timing(0.0, 0.0, times, prompt, 0))
    metrics.set_gauges(engine.Gauges(0, 0, 0.0, busy), busy)
    return metrics.text().decode()


async def two_readings(
    workload: Workload, act: recorder.Recorder, ticking: Ticking, later: dict[str, str]
) -> autoscaler.Memory:
    """Read once, then ``later`` (URL → text) a period on, and decide."""
    memory = autoscaler.Memory()
    pods = [instance("prefill", "p0", "10.1.0.1"), instance("decode", "d0", "10.1.0.2")]
    world = worlds.fixed_world(worlds.index(*pods), [workload])
    await autoscaler.run(world, memory, act)
    await memory.tasks.settle(workload.uid, 1.0)
    act.metrics = later
    ticking.at += autoscaler.PERIOD_SECONDS
    await autoscaler.run(world, memory, act)  # decides on the first reading, reads again
    await memory.tasks.settle(workload.uid, 1.0)
    await autoscaler.run(world, memory, act)  # decides with two readings: rates
    await asyncio.sleep(0)
    return memory


@pytest.fixture
def act() -> recorder.Recorder:
    quiet = recorder.Recorder()
    quiet.metrics = {PREFILL_URL: metrics_text(0, 0, 1), DECODE_URL: metrics_text(0, 0, 1)}
    return quiet


# Over 15 s: 3,000 requests of 2,000 prompt tokens (400k tokens/s: 9.3 prefill replicas of
# 8 cards at 80% at the first guess) and 150 output tokens each (30k tokens/s); TTFT 1.5 s,
# over the 1 s target: the prefill replica running did not sustain it.
HEAVY = {
    PREFILL_URL: metrics_text(3000, 2000, 1, ttft=1.5),
    DECODE_URL: metrics_text(3000, 0, 150),
}


@synchronously
async def test_a_heavy_prompt_load_asks_for_the_most_prefill_the_range_allows(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    await two_readings(service(), act, ticking, HEAVY)
    [written] = act.status_of("chat", "recommendation")
    roles = {r["name"]: r["replicas"] for r in written["roles"]}
    assert roles["prefill"] == 8  # the role's replicas: the person's ceiling
    assert 1 <= roles["decode"] <= 4
    assert written["mode"] == "Auto"
    assert written["summary"] == f"prefill 8, decode {roles['decode']}"
    assert any("prefill" in reason for reason in written["reasons"])
    assert act.reasons("chat") == ["Scaled"]


@synchronously
async def test_advisory_mode_writes_the_same_numbers_as_a_recommendation_only(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    await two_readings(service("Advisory"), act, ticking, HEAVY)
    [written] = act.status_of("chat", "recommendation")
    assert written["mode"] == "Advisory"
    assert {r["name"]: r["replicas"] for r in written["roles"]}["prefill"] == 8
    assert act.reasons("chat") == ["Recommended"]
    assert act.created == []
    assert act.deleted == []


@synchronously
async def test_one_reading_has_no_rates_and_writes_nothing(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    memory = autoscaler.Memory()
    pods = [instance("prefill", "p0", "10.1.0.1"), instance("decode", "d0", "10.1.0.2")]
    world = worlds.fixed_world(worlds.index(*pods), [service()])
    await autoscaler.run(world, memory, act)
    await memory.tasks.settle("uid-chat", 1.0)
    await autoscaler.run(world, memory, act)
    assert act.scraped == [(PREFILL_URL, DECODE_URL)]  # read once: the period has not passed
    assert act.statuses == []


@synchronously
async def test_pods_that_do_not_answer_leave_the_replicas_alone(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    await two_readings(service(), act, ticking, {})
    assert act.statuses == []
    assert act.events == []


@synchronously
async def test_an_unready_pod_or_one_without_an_address_is_not_read(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    memory = autoscaler.Memory()
    pods = [
        instance("prefill", "p0", "10.1.0.1"),
        worlds.pod("chat-decode-0", "d0", owner="chat", kind="InferenceService", role="decode",
                   ready=False, ip="10.1.0.2"),
        worlds.pod("chat-decode-1", "d1", owner="chat", kind="InferenceService", role="decode",
                   ready=True, ip=""),
    ]  # fmt: skip
    world = worlds.fixed_world(worlds.index(*pods), [service()])
    await autoscaler.run(world, memory, act)
    await memory.tasks.settle("uid-chat", 1.0)
    assert act.scraped == [(PREFILL_URL,)]


@synchronously
async def test_the_same_recommendation_is_written_once(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    workload = service()
    memory = await two_readings(workload, act, ticking, HEAVY)
    written = act.status_of("chat", "recommendation")
    shown = service(status={"roles": workload.status["roles"], "recommendation": written[-1]})
    pods = [instance("prefill", "p0", "10.1.0.1"), instance("decode", "d0", "10.1.0.2")]
    world = worlds.fixed_world(worlds.index(*pods), [shown])
    ticking.at += autoscaler.PERIOD_SECONDS
    await autoscaler.run(world, memory, act)
    await memory.tasks.settle("uid-chat", 1.0)
    await autoscaler.run(world, memory, act)
    assert len(act.status_of("chat", "recommendation")) == 1


def test_a_ratio_range_stated_either_way_is_decode_per_prefill() -> None:
    decode_per_prefill = inferenceservice.RatioRange(
        role="decode", per="prefill", min_percent=25, max_percent=50
    )
    prefill_per_decode = inferenceservice.RatioRange(
        role="prefill", per="decode", min_percent=200, max_percent=400
    )
    one = autoscaler._ratio(decode_per_prefill)
    other = autoscaler._ratio(prefill_per_decode)
    assert one is not None
    assert other is not None
    assert (one.lo, one.hi) == (other.lo, other.hi)


def test_forgetting_a_service_drops_its_readings() -> None:
    memory = autoscaler.Memory()
    memory.services["uid-chat"] = autoscaler.Service(autoscaler._stabilizer(
        inferenceservice.Autoscaling.model_validate(
            {"targets": {"ttftMilliseconds": 1000, "tpotMilliseconds": 50}}
        )
    ))  # fmt: skip
    memory.forget("uid-chat", "ns/chat")
    assert memory.services == {}


@synchronously
async def test_after_a_start_a_light_load_waits_a_whole_window_before_scaling_down(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    served = {
        "mode": "Auto",
        "time": "2026-12-01T00:00:00Z",
        "roles": [{"name": "prefill", "replicas": 6}, {"name": "decode", "replicas": 3}],
    }
    roles = [{"name": "prefill", "replicas": 6}, {"name": "decode", "replicas": 3}]
    light = {PREFILL_URL: metrics_text(1, 100, 1), DECODE_URL: metrics_text(1, 0, 10)}
    await two_readings(service(status={"roles": roles, "recommendation": served}), act, ticking,
                       light)  # fmt: skip
    # the operator (re)started: 6 and 3 are held for 300 s (the status gains the capacity)
    for written in act.status_of("chat", "recommendation"):
        assert written["summary"] == "prefill 6, decode 3"
    assert act.events == []


@synchronously
async def test_the_recommendation_is_a_metric_series_per_role_dropped_when_the_service_goes(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    def replicas(role: str) -> float | None:
        labels = {"namespace": "ns", "service": "chat", "role": role, "mode": "Auto"}
        return REGISTRY.get_sample_value("matrixpool_autoscaler_replicas", labels)

    ups = REGISTRY.get_sample_value(
        "matrixpool_autoscaler_changes_total", {"mode": "Auto", "direction": "up"}
    )
    memory = await two_readings(service(), act, ticking, HEAVY)
    [written] = act.status_of("chat", "recommendation")
    roles = {r["name"]: r["replicas"] for r in written["roles"]}
    assert replicas("prefill") == roles["prefill"] == 8
    assert replicas("decode") == roles["decode"]
    after = REGISTRY.get_sample_value(
        "matrixpool_autoscaler_changes_total", {"mode": "Auto", "direction": "up"}
    )
    assert (after or 0) == (ups or 0) + 1  # prefill 2 → 8, decode 1 → at least 1: up
    memory.forget("uid-chat", "ns/chat")
    assert replicas("prefill") is None


def test_the_recommendation_says_whose_names_it_read_and_what_they_lack() -> None:
    llama = readings.parse("llamacpp:requests_processing 1\n", 0.0)
    ours = readings.parse(server.Metrics("m").text().decode(), 0.0)
    said = autoscaler.read_as([llama, ours])
    assert said.startswith("read as LlamaCpp/vLLM; not exported: ")
    assert "kv_usage" in said  # llama.cpp's server no longer exports it
    assert "decode_seconds" not in said  # asked only when there is no ITL histogram
    assert autoscaler.read_as([ours]) == "read as vLLM"  # our server exports all


def capacity_of(written: dict[str, Any]) -> dict[str, tuple[int, str, str]]:
    return {c["phase"]: (c["tokensPerSecond"], c["source"], c["said"]) for c in written["capacity"]}


@synchronously
async def test_without_readings_to_learn_from_the_capacity_is_the_first_guess_and_says_so(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    await two_readings(service(), act, ticking, HEAVY)
    [written] = act.status_of("chat", "recommendation")
    prefill, _, said = capacity_of(written)["prefill"]
    assert (prefill, said) == (53_504, "first guess (CloudMatrix-Infer figures)")  # 6,688 x 8
    assert "prefill capacity 53,504 tokens/s per replica: first guess" in " ".join(
        written["reasons"]
    )


@synchronously
async def test_a_stated_capacity_is_used_as_stated(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    stated = {"prefillTokensPerSecond": 100_000, "decodeTokensPerSecond": 5_000}
    await two_readings(service(capacity=stated), act, ticking, HEAVY)
    [written] = act.status_of("chat", "recommendation")
    roles = {r["name"]: r["replicas"] for r in written["roles"]}
    assert roles == {"prefill": 5, "decode": 4}  # 400k / (100k x 80%); 30k / (5k x 80%): 7.5
    assert capacity_of(written) == {
        "prefill": (100_000, "Stated", "stated"),
        "decode": (5_000, "Stated", "stated"),
    }


@synchronously
async def test_busy_time_measures_the_prefill_rate(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    """The prefill instance processed 400k prompt tokens/s, busy 12 s of the 15: one replica
    takes 500k tokens per busy second; the first guess (53.5k) is dropped."""
    busy = {
        PREFILL_URL: metrics_text(3000, 2000, 1, ttft=1.5, busy=12.0),
        DECODE_URL: metrics_text(3000, 0, 150),
    }
    await two_readings(service(), act, ticking, busy)
    [written] = act.status_of("chat", "recommendation")
    assert capacity_of(written)["prefill"] == (
        500_000, "Learned", "learned from busy time over 1 period"
    )  # fmt: skip
    assert "prefill: 400,000 input tokens/s needs 1 replica (1.00)" in written["reasons"][0]


@synchronously
async def test_a_rate_sustained_within_the_slo_raises_the_capacity(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    """No busy time: the one prefill replica took 400k tokens/s at a TTFT within the target,
    so one replica sustains at least that."""
    within = {
        PREFILL_URL: metrics_text(3000, 2000, 1, ttft=0.1),
        DECODE_URL: metrics_text(3000, 0, 150),
    }
    await two_readings(service(), act, ticking, within)
    [written] = act.status_of("chat", "recommendation")
    assert capacity_of(written)["prefill"] == (
        400_000, "Learned", "learned from latency within the SLO over 1 period"
    )  # fmt: skip


@synchronously
async def test_a_burst_scales_prefill_at_the_first_reading_after_it_starts(
    act: recorder.Recorder, ticking: Ticking
) -> None:
    """One prefill replica of 8 cards (53.5k prompt tokens/s) at 8 requests/s of 2,000
    tokens, then 8 times that from just after a reading: the next reading's decision asks for
    more prefill. The prefill pod's /metrics come from the simulated engine, period by period."""
    period = autoscaler.PERIOD_SECONDS
    prefill = engine.Engine(model=latency.DEFAULT, cards=8, role=engine.Role.PREFILL, tokens=False)
    metrics = server.Metrics("chat")
    busy_seen, sent = 0.0, itertools.count()

    def serve(rate: float, start: float, end: float) -> str:
        """Requests at ``rate`` from ``start`` to ``end``; the /metrics text at ``end``."""
        nonlocal busy_seen
        for k in range(round(rate * (end - start))):
            request = engine.Request(f"r{next(sent)}", 2000, 1)
            prefill.submit(request, start + k / rate)
            for event in prefill.advance(start + k / rate):
                if isinstance(event, engine.Finished):
                    metrics.observe(event.timing)
        for event in prefill.advance(end):
            if isinstance(event, engine.Finished):
                metrics.observe(event.timing)
        gauges = prefill.gauges()
        metrics.set_gauges(gauges, gauges.busy_seconds - busy_seen)
        busy_seen = gauges.busy_seconds
        return metrics.text().decode()

    workload = service(status={"roles": [{"name": "prefill", "replicas": 1},
                                         {"name": "decode", "replicas": 1}]})  # fmt: skip
    memory = autoscaler.Memory()
    pods = [instance("prefill", "p0", "10.1.0.1"), instance("decode", "d0", "10.1.0.2")]
    world = worlds.fixed_world(worlds.index(*pods), [workload])
    decode = metrics_text(0, 0, 1)
    for step, rate in enumerate((8.0, 8.0, 64.0)):
        act.metrics = {PREFILL_URL: serve(rate, step * period, (step + 1) * period),
                       DECODE_URL: decode}  # fmt: skip
        ticking.at = (step + 1) * period
        await autoscaler.run(world, memory, act)  # decides on the reading before, reads
        await memory.tasks.settle(workload.uid, 1.0)
    before = act.status_of("chat", "recommendation")
    await autoscaler.run(world, memory, act)  # decides on the burst's first reading
    [*_, after] = act.status_of("chat", "recommendation")
    assert [w["summary"] for w in before] == ["prefill 1, decode 1"]  # the base rate: 1 serves
    assert after["summary"] == "prefill 8, decode 1", after["reasons"]
    # arrivals, not completions: 53.5k tokens/s were processed, 128k arrived (64 x 2,000)
    arrived = re.match(r"prefill: ([\d,]+) input tokens/s", after["reasons"][0])
    assert arrived is not None
    assert int(arrived[1].replace(",", "")) == pytest.approx(128_000, rel=0.05)
