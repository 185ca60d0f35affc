"""A service's KV cache is admitted to its SuperNode's pool like cards (issue 16, item 4), from
the cycle's side: one that fits gets pods, status.kvCache and a KVCacheReserved Event; one that
does not gets no pods, a Ready condition with the reason and a Warning Event, once; it gets in
when room is made. No API server (tests/unit/recorder.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from prometheus_client import REGISTRY

from matrixpool import metrics
from matrixpool.api import inferenceservice, supernode
from matrixpool.controllers import daemons
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.state import assumed as assuming
from matrixpool.state import world
from matrixpool.state.workloads import Workload
from tests.unit.recorder import Recorder
from tests.unit.worlds import endpoint, fixed_world


def service(name: str, kv: str, created: str, priority: int = 100) -> Workload:
    body = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {
            "superNode": "sn-a",
            "priority": priority,
            "kvCache": {"bytes": kv},
            "roles": [{"name": "serve", "replicas": 1, "podsPerReplica": 1, "cardsPerPod": 8}],
        },
    }
    model = inferenceservice.parse(body)
    return Workload("InferenceService", "ns", name, f"uid-{name}", created, 1, model, None, {})


def pooled(services: list[Workload], per_node: str | None = "16Gi") -> world.World:
    """Four nodes of eight cards; each lends ``per_node`` to the KV pool (None: no pool)."""
    seen = fixed_world({}, services)
    body: dict[str, Any] = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "SuperNode",
        "metadata": {"name": "sn-a", "uid": "uid-sn-a"},
        "spec": {**seen.supernodes["sn-a"].spec.model_dump(by_alias=True, exclude_none=True)},
    }
    if per_node is not None:
        body["spec"]["memoryPool"] = {"perNode": per_node}
    return dataclasses.replace(seen, supernodes={"sn-a": supernode.parse(body)})


def cycle(seen: world.World, memory: cyclestate.Memory, executor: Recorder) -> None:
    asyncio.run(scheduler.Cycle(seen, memory, assuming.Assumed(), executor).run())


def owners(executor: Recorder) -> set[str]:
    return {m["metadata"]["labels"]["matrixpool.dev/job"] for m in executor.created}


def ready(executor: Recorder, name: str) -> dict[str, Any]:
    conditions = executor.status_of(name, "conditions")[-1]
    return next(c for c in conditions if c["type"] == "Ready")


def test_a_service_that_fits_gets_pods_and_one_that_does_not_waits_with_the_reason() -> None:
    big, late = service("big", "48Gi", "t0"), service("late", "32Gi", "t1")
    executor, memory = Recorder(), cyclestate.Memory()
    cycle(pooled([big, late]), memory, executor)

    assert owners(executor) == {"big"}
    [pod] = executor.created
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["MATRIXPOOL_KV_SERVICE"] == "uid-big"
    daemons = env["MATRIXPOOL_KV_DAEMONS"].split(",")
    assert daemons == ["$(MATRIXPOOL_NODE_IP):7040", *sorted(endpoint(f"n{i}") for i in range(4))]
    assert executor.status_of("big", "kvCache")[-1] == {
        "admitted": True,
        "reserved": "48Gi",
        "quotaPerNode": "12Gi",
        "nodes": 4,
    }
    assert executor.status_of("late", "kvCache")[-1] == {"admitted": False}
    condition = ready(executor, "late")
    assert (condition["status"], condition["reason"]) == ("False", "KVCachePoolFull")
    assert "16Gi free" in condition["message"]
    assert ("late", "Warning", "KVCachePoolFull") in [e[:3] for e in executor.events]
    assert ("big", "Normal", "KVCacheReserved") in [e[:3] for e in executor.events]

    def kv_events() -> list[str]:
        return [e[2] for e in executor.events if e[2].startswith("KVCache")]

    told = kv_events()
    cycle(pooled([big, late]), memory, executor)
    assert kv_events() == told, "each admission is told once"


def test_a_held_reservation_survives_a_restart_and_a_newcomer_of_higher_priority() -> None:
    old = dataclasses.replace(service("old", "48Gi", "t0"), status={"kvCache": {"admitted": True}})
    vip = service("vip", "48Gi", "t1", priority=900)
    executor = Recorder()
    cycle(pooled([old, vip]), cyclestate.Memory(), executor)  # a fresh operator's memory
    assert owners(executor) == {"old"}
    assert ready(executor, "vip")["reason"] == "KVCachePoolFull"


def test_the_waiting_service_gets_in_once_the_other_goes() -> None:
    big, late = service("big", "48Gi", "t0"), service("late", "32Gi", "t1")
    executor, memory = Recorder(), cyclestate.Memory()
    cycle(pooled([big, late]), memory, executor)
    cycle(pooled([late]), memory, executor)
    assert "late" in owners(executor)
    assert executor.status_of("late", "kvCache")[-1]["reserved"] == "32Gi"
    assert ("late", "Normal", "KVCacheReserved") in [e[:3] for e in executor.events]


def test_a_supernode_without_a_memory_pool_says_so() -> None:
    executor = Recorder()
    cycle(pooled([service("a", "1Gi", "t0")], per_node=None), cyclestate.Memory(), executor)
    assert owners(executor) == set()
    condition = ready(executor, "a")
    assert condition["reason"] == "NoMemoryPool"
    assert "spec.memoryPool" in condition["message"]


def test_a_service_without_kv_cache_is_untouched_by_the_pool() -> None:
    plain = dataclasses.replace(service("plain", "1Gi", "t0"))
    assert isinstance(plain.model, inferenceservice.InferenceService)
    plain.model.spec.kv_cache = None
    executor = Recorder()
    cycle(pooled([plain], per_node=None), cyclestate.Memory(), executor)
    assert owners(executor) == {"plain"}
    assert executor.status_of("plain", "kvCache") == []


# --- the daemons' quotas (controllers.daemons) ------------------------------------------------


def told(seen: world.World, decisions: dict[str, Any], executor: Recorder, **kw: Any) -> None:
    async def passes() -> None:
        memory = (kw.get("memory") or daemons.Memory()).kv_quotas
        memory.run(daemons.kv_quota_plan(seen, decisions, kw.get("started", {})), executor)
        await asyncio.sleep(0.01)  # the daemons are told in the background
        await memory.tasks.settle(memory.what, 5.0)

    asyncio.run(passes())


def test_each_daemon_of_the_pool_is_told_the_quota_of_every_admitted_service() -> None:
    big, late = service("big", "48Gi", "t0"), service("late", "32Gi", "t1")
    seen = pooled([big, late])
    memory = cyclestate.Memory()
    cycle(seen, memory, Recorder())
    executor = Recorder()
    told(seen, memory.kv, executor)
    assert executor.kv_quotas == {endpoint(f"n{i}"): {"uid-big": 12 << 30} for i in range(4)}


def test_a_supernode_without_a_pool_tells_its_daemons_nothing() -> None:
    seen = pooled([service("a", "1Gi", "t0")], per_node=None)
    memory = cyclestate.Memory()
    cycle(seen, memory, Recorder())
    executor = Recorder()
    told(seen, memory.kv, executor)
    assert executor.kv_quotas == {}


def test_a_daemon_is_told_again_only_when_its_quotas_change_or_it_restarts() -> None:
    seen = pooled([service("big", "48Gi", "t0")])
    memory, quotas = cyclestate.Memory(), daemons.Memory()
    cycle(seen, memory, Recorder())
    first = Recorder()
    told(seen, memory.kv, first, memory=quotas)
    assert len(first.kv_quotas) == 4
    again = Recorder()
    told(seen, memory.kv, again, memory=quotas)
    assert again.kv_quotas == {}
    told(seen, memory.kv, again, memory=quotas, started={"n2": 5.0})
    assert list(again.kv_quotas) == [endpoint("n2")]
    told(seen, {}, again, memory=quotas, started={"n2": 5.0})  # the service went
    assert again.kv_quotas[endpoint("n0")] == {}


def test_the_pool_and_its_services_are_in_the_operators_metrics() -> None:
    big, late = service("big", "48Gi", "t0"), service("late", "32Gi", "t1")
    cycle(pooled([big, late]), cyclestate.Memory(), Recorder())

    def sample(name: str, state: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"supernode": "sn-a", "state": state})

    assert metrics.KV_POOL_BYTES  # registered
    assert sample("matrixpool_kv_pool_bytes", "capacity") == 64 << 30
    assert sample("matrixpool_kv_pool_bytes", "reserved") == 48 << 30
    assert sample("matrixpool_kv_services", "admitted") == 1
    assert sample("matrixpool_kv_services", "waiting") == 1
