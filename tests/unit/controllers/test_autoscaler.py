"""The inference autoscaler's controller (controllers.autoscaler) with a recording executor: it
reads the ready pods' /metrics in the background, turns two readings into a recommendation
inside the person's ranges, writes status.recommendation with an Event (Scaled in Auto mode,
Recommended in Advisory mode), and writes nothing without rates or without answers."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from prometheus_client import REGISTRY

from matrixpool.api import inferenceservice
from matrixpool.controllers import autoscaler
from matrixpool.serving import engine, readings, server
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


def service(mode: str = "Auto", status: dict[str, Any] | None = None) -> Workload:
    """chat: prefill 1..8 instances of 8 cards, decode 1..4 of 16, SLO 1 s / 50 ms."""
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


def metrics_text(requests: int, prompt: int, tokens: int) -> str:
    """An instance that finished ``requests`` requests of ``prompt`` prompt tokens and
    ``tokens`` output tokens each, fast."""
    metrics = server.Metrics("chat")
    times = tuple(0.1 + 0.02 * k for k in range(tokens))
    for _ in range(requests):
        metrics.observe(engine.Timing(0.0, 0.0, times, prompt, 0))
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
# 8 cards at 80%) and 150 output tokens each (30k tokens/s).
HEAVY = {PREFILL_URL: metrics_text(3000, 2000, 1), DECODE_URL: metrics_text(3000, 0, 150)}


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
    assert act.statuses == []  # the operator (re)started: 6 and 3 are held for 300 s


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
