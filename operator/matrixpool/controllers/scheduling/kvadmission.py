"""The KV-cache pool admission of InferenceServices with ``spec.kvCache``, decided from scratch
every cycle (:func:`kv_admission`, by :mod:`.cycle`, with
:func:`matrixpool.serving.pool.admit`), observed in the metrics, shown in ``status.kvCache``
(:func:`kv_status`) and in an Event when it changes (:func:`tell_kv`, by :mod:`.status`). A
service that waits gets no pods (:mod:`.gangpods`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matrixpool import metrics
from matrixpool.api import inferenceservice
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.serving import pool as kv_pool
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool.state.world import World


def kv_admission(world: World, memory: cyclestate.Memory) -> dict[str, kv_pool.Decision]:
    """Every InferenceService with spec.kvCache: admitted to its SuperNode's KV-cache pool or
    waiting (:func:`matrixpool.serving.pool.admit`). A service whose status (as this operator
    last wrote it, else as the index shows it) says admitted keeps its place."""
    members = read_model.members(world)
    pools = {
        name: kv_pool.Pool(
            name,
            len(members.get(name, ())),
            sn.spec.memory_pool.per_node_bytes if sn.spec.memory_pool else 0,
        )
        for name, sn in world.supernodes.items()
    }
    claims = []
    for workload in world.workloads:
        service = workload.model
        if not isinstance(service, inferenceservice.InferenceService):
            continue
        spec = service.spec
        if spec.kv_cache is None or spec.super_node is None:
            continue
        status = memory.statuses.get(workload.uid) or workload.status
        held = bool((status.get("kvCache") or {}).get("admitted"))
        claims.append(
            kv_pool.Claim(
                workload.uid,
                spec.super_node,
                spec.kv_cache.size,
                spec.priority,
                workload.created,
                held,
            )
        )
    decisions = kv_pool.admit(pools, claims) if claims else {}
    observe_kv(pools, claims, decisions)
    return decisions


def observe_kv(
    pools: Mapping[str, kv_pool.Pool],
    claims: Sequence[kv_pool.Claim],
    decisions: Mapping[str, kv_pool.Decision],
) -> None:
    """The pools' capacity and reservations, and the services admitted and waiting."""
    for name, found in pools.items():
        if found.per_node_bytes <= 0:
            continue
        mine = [c for c in claims if c.super_node == name]
        admitted = [decisions[c.uid] for c in mine]
        reserved = sum(d.bytes for d in admitted if isinstance(d, kv_pool.Admitted))
        metrics.KV_POOL_BYTES.labels(name, "capacity").set(found.capacity_bytes)
        metrics.KV_POOL_BYTES.labels(name, "reserved").set(reserved)
        held = sum(isinstance(d, kv_pool.Admitted) for d in admitted)
        metrics.KV_SERVICES.labels(name, "admitted").set(held)
        metrics.KV_SERVICES.labels(name, "waiting").set(len(mine) - held)


def kv_status(kv: kv_pool.Decision, world: World) -> dict[str, Any]:
    """status.kvCache of a service with spec.kvCache."""
    if isinstance(kv, kv_pool.Waiting):
        return {"admitted": False}
    return {
        "admitted": True,
        "reserved": kv_pool.quantity(kv.bytes),
        "quotaPerNode": kv_pool.quantity(kv.quota_bytes),
        "nodes": len(read_model.members(world).get(kv.super_node, ())),
    }


def tell_kv(cycle: cyclestate.CycleState, workload: Workload, kv: kv_pool.Decision | None) -> None:
    """An Event when the service's KV-cache admission changes: reserved, or why it waits."""
    if kv is None:
        return
    told = "Reserved" if isinstance(kv, kv_pool.Admitted) else kv.reason.value
    if cycle.memory.kv_reasons.get(workload.uid) == told:
        return
    cycle.memory.kv_reasons[workload.uid] = told
    if isinstance(kv, kv_pool.Admitted):
        message = (
            f"reserved {kv_pool.human(kv.bytes)} in the KV-cache pool of SuperNode"
            f" {kv.super_node!r}: {kv_pool.human(kv.quota_bytes)} on each member node"
        )
        cycle.event(workload, "Normal", "KVCacheReserved", message)
    else:
        cycle.event(workload, "Warning", kv.reason.value, kv.message)
