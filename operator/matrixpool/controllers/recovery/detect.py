"""Step 1 of a recovery, **detect**: the faults under a bound gang's ranks (:func:`detect`,
pure) — a rank's Node gone or not Ready (or its kubelet's Lease stale), its daemon unreachable,
``matrixpool.dev/unhealthy-cards`` covering one of its cards, its pod Failed (evicted too; a
container that exits non-zero fails its pod). A gang whose ranks were made for another world
than the job's size has none: the scheduler regroups it (:mod:`..scheduling.regroup`). A pod
that Succeeded is no fault; a finished job
(phase Succeeded, :mod:`matrixpool.controllers.lifecycle`) is not looked at. Node losses wait
:data:`SETTLE_SECONDS` to be decided together (:func:`settled`). Called by
:func:`.controller.step`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence

import structlog

from matrixpool import clock
from matrixpool.controllers.recovery import memory
from matrixpool.k8s import convert
from matrixpool.placement import inventory
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool_recovery import policy

log = structlog.get_logger(__name__)

SETTLE_SECONDS = 1.0  # node losses seen within this long of the first are decided together


def detect(
    world_size: int,
    facts: Sequence[convert.PodFacts],
    nodes: Mapping[str, inventory.NodeInfo],
    unreachable: Iterable[str],
    workload: Workload | None = None,
    stale: Iterable[str] = (),
) -> list[policy.Fault]:
    """The faults under a bound gang's ranks (pure). A gang not wholly bound has none: the
    scheduler is still placing it."""
    live = [p for p in facts if not p.deleting]
    if len({p.rank for p in live if p.node}) < world_size or workload_suspended(workload):
        return []
    if read_model.disagreeing(live, world_size) is not None:
        return []  # made for another world: the scheduler regroups the whole gang
    silent = set(unreachable)
    expired = set(stale)
    found: dict[tuple[policy.FaultKind, str], tuple[set[int], set[int]]] = {}

    def add(
        kind: policy.FaultKind, node: str, ranks: Iterable[int] = (), cards: Iterable[int] = ()
    ) -> None:
        held = found.setdefault((kind, node), (set(), set()))
        held[0].update(ranks)
        held[1].update(cards)

    for pod in live:
        if not pod.node:
            continue
        info = nodes.get(pod.node)
        if info is None:
            add(policy.FaultKind.NODE_DELETED, pod.node)
        elif info.down or pod.node in expired:
            add(policy.FaultKind.NODE_DOWN, pod.node)
        elif pod.node in silent:
            add(policy.FaultKind.DAEMON_UNREACHABLE, pod.node)
        else:
            bad = info.unhealthy & pod.cards
            if bad:
                add(policy.FaultKind.CARDS_UNHEALTHY, pod.node, cards=bad)
            if pod.phase == "Failed":
                add(policy.FaultKind.POD_FAILED, pod.node, ranks=[pod.rank])
    if found:  # ranks that already exited 0 cannot reload the step the gang rolls back to
        for pod in live:
            if pod.node and pod.phase == "Succeeded" and pod.node in nodes:
                add(policy.FaultKind.POD_FAILED, pod.node, ranks=[pod.rank])
    return [
        policy.Fault(kind, policy.NodeName(node), frozenset(cards), frozenset(ranks))
        for (kind, node), (ranks, cards) in sorted(found.items())
    ]


def _stamp_keys(faults: Iterable[policy.Fault]) -> list[tuple[str, str]]:
    """The keys of :attr:`matrixpool.controllers.wake.Wake.noticed` that date these faults."""
    keys: list[tuple[str, str]] = []
    for fault in faults:
        if fault.kind == policy.FaultKind.NODE_DOWN:
            keys.append((fault.node, "down"))
        elif fault.kind == policy.FaultKind.NODE_DELETED:
            keys.append((fault.node, "deleted"))
        elif fault.kind == policy.FaultKind.CARDS_UNHEALTHY:
            keys += [(fault.node, f"card:{card}") for card in sorted(fault.cards)]
    return keys


def workload_suspended(workload: Workload | None) -> bool:
    return workload is not None and workload.status.get("phase") == "Suspended"


def settled(
    workload: Workload,
    faults: list[policy.Fault],
    state: memory.State,
    noticed: Mapping[tuple[str, str], tuple[float, datetime.datetime]] | None = None,
) -> bool:
    """Node losses are decided SETTLE_SECONDS after the first shows, so that a rack losing
    power (its nodes going NotReady a few hundred milliseconds apart) is one recovery, not one
    per node; a lost node's silent daemon joins its NodeDown the same way. A failed pod or a
    bad card on a healthy node is decided at once.

    A fault shows when the Node watch first delivered it (``noticed``, stamped by
    :mod:`matrixpool.controllers.wake`), else now: the job's detection time and the start of its
    settle window."""
    now = clock.SYSTEM.monotonic()
    seen = (now, clock.SYSTEM.now())
    shown = noticed or {}
    stamps = [shown[k] for k in _stamp_keys(faults) if k in shown]
    first, _ = state.first_seen.setdefault(workload.uid, min([seen, *stamps]))
    losses = any(f.kind in policy.NODE_LOSSES for f in faults)
    if losses and now - first < SETTLE_SECONDS:
        return False
    log.info("faults settled", job=workload.key, faults=[f.describe() for f in faults])
    return True
