"""The experts controller (controllers.experts) with a recording executor: it reads the expert
counters of an expert-parallel role's ready pods in the background, and from two readings
re-plans the expert map when a skewed load makes the map in force much worse than the plan —
``status.experts`` with the imbalance before and after and an Event ``ExpertsRebalanced`` —
and keeps it otherwise (an even load, too few tokens, a map already balanced: no flapping).
The scheduling cycle lays the written layout over the bound cards."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from matrixpool.api import inferenceservice
from matrixpool.controllers import experts
from matrixpool.controllers.scheduling import gangpods
from matrixpool.k8s import pods as k8s_pods
from matrixpool.placement import eplb, gangs
from matrixpool.serving import experts as expert_metrics
from matrixpool.serving import server
from matrixpool.state.workloads import Workload
from tests.unit import recorder, worlds
from tests.unit.clocks import Ticking

COUNT, SLOTS, CARDS_PER_POD = 12, 16, 4  # one instance of 4 pods × 4 cards
IPS = {"d0": "10.1.0.1", "d1": "10.1.0.2", "d2": "10.1.0.3", "d3": "10.1.0.4"}
URLS = [f"http://{ip}:8000/metrics" for ip in IPS.values()]


def synchronously(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test in a loop of its own (fixtures pass through)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def service(status: dict[str, Any] | None = None) -> Workload:
    """moe: prefill (no experts) and decode, an instance of 4 pods × 4 cards, 12 + 4 experts."""
    decode = {
        "name": "decode",
        "replicas": 1,
        "podsPerReplica": 4,
        "cardsPerPod": 4,
        "expertParallel": {"experts": COUNT, "redundantExperts": SLOTS - COUNT},
    }
    body = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "moe", "namespace": "ns", "uid": "uid-moe"},
        "spec": {"superNode": "sn-a", "roles": [
            {"name": "prefill", "replicas": 1, "cardsPerPod": 1}, decode]},
    }  # fmt: skip
    model = inferenceservice.parse(body)
    return Workload("InferenceService", "ns", "moe", "uid-moe", "", 1, model, None, status or {})


def pods(ready: bool = True) -> dict[str, list[Any]]:
    decode = [
        worlds.pod(f"moe-decode-0-{k}", uid, owner="moe", kind="InferenceService",
                   role="decode", node="n0", phase="Running", ready=ready, ip=ip)
        for k, (uid, ip) in enumerate(IPS.items())
    ]  # fmt: skip
    prefill = worlds.pod("moe-prefill-0-0", "p0", owner="moe", kind="InferenceService",
                         role="prefill", node="n1", phase="Running", ready=True,
                         ip="10.1.0.9")  # fmt: skip
    return worlds.index(*decode, prefill)


def counters(tokens: float, skew: float) -> str:
    """A pod's /metrics after ``tokens`` routed tokens on a gate of this skew (seed 5)."""
    metrics = server.Metrics("moe")
    metrics.track_experts(COUNT)
    shares = expert_metrics.zipf_shares(COUNT, skew, seed=5)
    metrics.count_experts([round(tokens * s) for s in shares], {})
    return metrics.text().decode()


async def period(
    workload: Workload, memory: experts.Memory, act: recorder.Recorder, ticking: Ticking,
    text: str, ready: bool = True,
) -> None:  # fmt: skip
    """The pods answer ``text``; a period passes; the controller reads and decides."""
    act.metrics = dict.fromkeys(URLS, text)
    world = worlds.fixed_world(pods(ready), [workload])
    await experts.run(world, memory, act)  # decides on what came back, reads again
    await memory.tasks.settle(f"experts-{workload.uid}", 1.0)
    await experts.run(world, memory, act)
    ticking.at += experts.PERIOD_SECONDS


async def periods(
    workload: Workload, act: recorder.Recorder, ticking: Ticking, *texts: str
) -> experts.Memory:
    memory = experts.Memory()
    for text in texts:
        await period(workload, memory, act, ticking, text)
    return memory


@synchronously
async def test_a_skewed_load_rebalances_the_map_in_status_with_an_event(ticking: Ticking) -> None:
    act = recorder.Recorder()
    await periods(service(), act, ticking, counters(0, 1.2), counters(100_000, 1.2))
    [written] = act.status_of("moe", "experts")
    [decode] = written
    assert decode["role"] == "decode"
    assert decode["tokens"] == pytest.approx(4 * 100_000, abs=4 * COUNT)
    load = [4 * round(100_000 * s) for s in expert_metrics.zipf_shares(COUNT, 1.2, seed=5)]
    first = eplb.evaluate(load, eplb.default_layout(COUNT, SLOTS), CARDS_PER_POD)
    planned = eplb.plan(load, SLOTS, CARDS_PER_POD)
    assert decode["layout"] == list(planned.layout)
    assert decode["imbalance"] == decode["imbalanceBefore"] == round(first.imbalance, 3)
    assert decode["imbalanceAfter"] == round(planned.imbalance, 3)
    assert decode["imbalanceAfter"] <= 0.7 * decode["imbalanceBefore"]
    assert decode["rebalancedTime"] == decode["measuredTime"]
    hottest = [h["expert"] for h in decode["hottest"]]
    assert hottest == eplb.hottest(load, experts.HOTTEST)
    assert decode["hottest"][0]["copies"] > 1
    assert act.reasons("moe") == ["ExpertsRebalanced"]
    assert "decode: max/mean load per card" in act.events[0][3]


@synchronously
async def test_an_even_load_is_measured_and_the_map_kept(ticking: Ticking) -> None:
    act = recorder.Recorder()
    await periods(service(), act, ticking, counters(0, 0.0), counters(100_000, 0.0))
    [[decode]] = act.status_of("moe", "experts")
    assert decode["imbalance"] == pytest.approx(16 / 12, abs=0.01)  # 8 experts have 1 copy
    assert decode["layout"] == list(eplb.default_layout(COUNT, SLOTS))
    assert "imbalanceBefore" not in decode
    assert act.events == []


@synchronously
async def test_too_few_tokens_in_a_period_do_not_replan(ticking: Ticking) -> None:
    act = recorder.Recorder()
    few = experts.MIN_TOKENS_PER_SLOT * SLOTS // 4 - 20  # the 4 pods together: just short
    await periods(service(), act, ticking, counters(0, 1.2), counters(few, 1.2))
    [[decode]] = act.status_of("moe", "experts")
    assert decode["layout"] == list(eplb.default_layout(COUNT, SLOTS))
    assert act.events == []


@synchronously
async def test_the_same_load_again_keeps_the_new_map_while_the_status_lags(
    ticking: Ticking,
) -> None:
    act = recorder.Recorder()
    workload = service()  # the index never shows what was written: a lagging watch
    await periods(
        workload, act, ticking, counters(0, 1.2), counters(100_000, 1.2), counters(200_000, 1.2)
    )
    first, second = act.status_of("moe", "experts")
    assert second[0]["layout"] == first[0]["layout"]
    assert second[0]["imbalance"] == first[0]["imbalanceAfter"]  # measured under the new map
    assert second[0]["rebalancedTime"] == first[0]["rebalancedTime"]
    assert act.reasons("moe") == ["ExpertsRebalanced"]


@synchronously
async def test_a_restarted_operator_carries_on_from_the_layout_in_status(
    ticking: Ticking,
) -> None:
    act = recorder.Recorder()
    await periods(service(), act, ticking, counters(0, 1.2), counters(100_000, 1.2))
    [written] = act.status_of("moe", "experts")
    again = recorder.Recorder()
    await periods(
        service({"experts": written}), again, ticking, counters(0, 1.2), counters(100_000, 1.2)
    )
    [[decode]] = again.status_of("moe", "experts")
    assert decode["layout"] == written[0]["layout"]
    assert decode["rebalancedTime"] == written[0]["rebalancedTime"]
    assert again.events == []


@synchronously
async def test_only_the_ready_pods_of_expert_parallel_roles_are_read(ticking: Ticking) -> None:
    act = recorder.Recorder()
    memory = experts.Memory()
    await period(service(), memory, act, ticking, counters(0, 1.2))
    assert act.scraped == [tuple(URLS)]  # not the prefill pod
    unready = recorder.Recorder()
    await period(service(), experts.Memory(), unready, ticking, counters(0, 1.2), ready=False)
    assert unready.scraped == [()]


@synchronously
async def test_one_reading_and_pods_that_do_not_answer_write_nothing(ticking: Ticking) -> None:
    act = recorder.Recorder()
    memory = await periods(service(), act, ticking, counters(0, 1.2))
    assert act.statuses == []
    act.metrics = {}
    await period(service(), memory, act, ticking, "")
    assert act.statuses == []
    memory.forget("uid-moe", "ns/moe")
    assert memory.services == {}


def test_the_scheduler_lays_the_status_layout_over_the_bound_cards() -> None:
    role = service().model.spec.roles[1]  # type: ignore[union-attr]
    cards = {f"moe-decode-0-{k}": (4, 5, 6, 7) if k % 2 else (0, 1, 2, 3) for k in range(4)}
    layout = list(eplb.plan(list(range(COUNT)), SLOTS, CARDS_PER_POD).layout)
    mapping = gangs.expert_map(role, cards, list(cards), layout)
    assert [m["copyOf"] for m in mapping] == layout
    assert [(m["pod"], m["card"]) for m in mapping][2:6] == [
        ("moe-decode-0-0", 2),
        ("moe-decode-0-0", 3),
        ("moe-decode-0-1", 4),
        ("moe-decode-0-1", 5),
    ]  # slots in rank order, each pod's cards in order
    wrong = [0] * SLOTS  # does not hold every expert: the first layout
    assert [m["copyOf"] for m in gangs.expert_map(role, cards, list(cards), wrong)] == list(
        eplb.default_layout(COUNT, SLOTS)
    )


def test_an_expert_parallel_pod_mounts_its_map_and_is_told_its_file() -> None:
    workload = service()
    [decode_gang] = [g for g in gangs.inference_gangs("ns", "moe", workload.model.spec)  # type: ignore[union-attr]
                     if g.role == "decode"]  # fmt: skip
    plan = decode_gang.pods[1]
    contract = gangpods.experts_contract(workload, plan)
    template = {"spec": {"containers": [{"name": "s", "image": "matrixpool:1"}]}}
    pod = k8s_pods.manifest(plan, template, workload.ref, "nvidia.com/gpu", experts=contract)
    [volume] = [v for v in pod["spec"]["volumes"] if "configMap" in v]
    assert volume["configMap"] == {"name": "moe-expert-map", "optional": True}
    [container] = pod["spec"]["containers"]
    [mount] = container["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": "/etc/matrixpool/experts",
                     "readOnly": True}  # fmt: skip
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MATRIXPOOL_EXPERT_MAP_FILE"] == "/etc/matrixpool/experts/decode-0.json"
    assert env["MATRIXPOOL_EXPERTS"] == str(COUNT)
    prefill = gangs.inference_gangs("ns", "moe", workload.model.spec)[0].pods[0]  # type: ignore[union-attr]
    assert gangpods.experts_contract(workload, prefill) is None
