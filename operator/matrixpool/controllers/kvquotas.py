"""KV-cache quotas: the operator tells every node daemon of a SuperNode with a memory pool the
quota of each InferenceService admitted to that pool, and has it forget the services that are
not (deleted, or no longer admitted).

The scheduling cycle decides admission (:func:`matrixpool.serving.pool.admit`, kept in
``scheduler.Memory.kv``); each pass of the main loop (:mod:`matrixpool.controllers.loop`)
:func:`plan` (pure) turns it into the quotas each daemon should hold — every member node that
is Ready and whose daemon announced itself and answers gets ``reserved // members`` bytes per
admitted service, by service UID — and a daemon is told (``GET /v1/kv/usage``, then
``DELETE /v1/kv/S`` and ``PUT /v1/kv/S/quota`` where they differ, operator token) when its
quotas change or the daemon started again (a new daemon holds none), in a task of its own
(:mod:`matrixpool.controllers.background`). A daemon that did not take them (unreachable, or
started without ``--kv-pool-bytes``) is asked again after :data:`RETRY_SECONDS`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from matrixpool import clock
from matrixpool.controllers import background
from matrixpool.k8s import executor
from matrixpool.serving import pool
from matrixpool.state import world as read_model

log = structlog.get_logger(__name__)

Quotas = tuple[tuple[str, int], ...]  # (service UID, bytes), sorted
Told = tuple[str, float, Quotas]  # (daemon endpoint, when it started, its quotas)
RETRY_SECONDS = 10.0  # a daemon that did not take its quotas is asked again after this


@dataclass
class Memory:
    """What each daemon was told (by node), when telling one last failed, and the task telling
    them. Owned by the main loop; losing it costs one round of telling every daemon again."""

    told: dict[str, Told] = field(default_factory=dict)
    failed: dict[str, float] = field(default_factory=dict)  # node → monotonic time of failure
    tasks: background.Tasks = field(default_factory=background.Tasks)


def plan(
    world: read_model.World,
    admitted: Mapping[str, pool.Decision],
    started: Mapping[str, float],
) -> dict[str, Told]:
    """Node → (its daemon, when that daemon started, the quotas it should hold), for every
    daemon of every SuperNode with a memory pool (pure)."""
    silent = world.unreachable | world.stale
    by_supernode = read_model.members(world)
    wanted: dict[str, Told] = {}
    for name, sn in sorted(world.supernodes.items()):
        if sn.spec.memory_pool is None:
            continue
        quotas = tuple(
            sorted(
                (uid, d.quota_bytes)
                for uid, d in admitted.items()
                if isinstance(d, pool.Admitted) and d.super_node == name
            )
        )
        for node in by_supernode.get(name, ()):
            if node.endpoint and node.ready and node.name not in silent:
                wanted[str(node.name)] = (node.endpoint, started.get(node.name, 0.0), quotas)
    return wanted


def run(
    world: read_model.World,
    admitted: Mapping[str, pool.Decision],
    memory: Memory,
    act: executor.Executor,
    started: Mapping[str, float],
) -> None:
    """Tell the daemons whose quotas changed (or that started again), in the background."""
    now = clock.SYSTEM.monotonic()
    wanted = plan(world, admitted, started)
    changed = {
        n: t
        for n, t in wanted.items()
        if memory.told.get(n) != t and now - memory.failed.get(n, float("-inf")) >= RETRY_SECONDS
    }
    for node in set(memory.told) - set(wanted):
        del memory.told[node]  # gone, down or silent: told again when it is back
    if changed and not memory.tasks.busy("kvquotas"):
        memory.tasks.start("kvquotas", tell(changed, memory, act))


async def tell(changed: Mapping[str, Told], memory: Memory, act: executor.Executor) -> None:
    nodes = sorted(changed)
    took = await asyncio.gather(
        *(act.set_kv_quotas(changed[n][0], dict(changed[n][2])) for n in nodes)
    )
    refused = []
    for node, ok in zip(nodes, took, strict=True):
        if ok:
            memory.told[node] = changed[node]
            memory.failed.pop(node, None)
        else:
            memory.failed[node] = clock.SYSTEM.monotonic()
            refused.append(node)
    if refused:
        log.warning(
            "daemons did not take their KV-cache quotas (unreachable, or no --kv-pool-bytes);"
            " asking again",
            nodes=refused[:8],
            count=len(refused),
            retry_seconds=RETRY_SECONDS,
        )
    if len(refused) < len(nodes):
        log.info("told daemons their KV-cache quotas", daemons=len(nodes) - len(refused))
