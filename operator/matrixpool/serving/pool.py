"""Admission to a supernode's KV-cache pool, the way cards are admitted.

A SuperNode with ``spec.memoryPool.perNode`` lends that much host memory of each member node
to one pool; its capacity is ``perNode × members``. An InferenceService's
``spec.kvCache.bytes`` is reserved out of the pool of its ``spec.superNode``. Each node
daemon holds an equal part of every reservation: the service's quota on each member daemon
is ``bytes // members`` (rounded down, so the quotas on a daemon never add up to more than
``perNode`` while the reservations fit the capacity).

:func:`admit` decides, every scheduling cycle, from scratch (nothing to lose when the
operator restarts): services that held a reservation before keep it, oldest first, while
they fit (they only lose it when the pool shrinks under them); then the others, highest
priority first, then first come, each admitted when it fits in what is left, else left
waiting with a reason — a smaller service behind a larger one that does not fit still gets
in, as a smaller gang fills the cards a larger one cannot use. A service that waits gets no
pods (``matrixpool.controllers.scheduling``).

Pure: no clock, no I/O. Called by the scheduling cycle; the quota controller
(``matrixpool.controllers.kvcache``) tells the daemons the quotas of what was admitted.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class Reason(enum.StrEnum):
    """Why a service's KV cache is not admitted (its Ready condition's reason)."""

    NO_MEMORY_POOL = "NoMemoryPool"  # its SuperNode lends no memory (no spec.memoryPool)
    UNKNOWN_SUPERNODE = "UnknownSuperNode"  # no SuperNode of that name
    NO_POOL_NODES = "NoPoolNodes"  # the SuperNode selects no node yet
    POOL_FULL = "KVCachePoolFull"  # the reservations admitted before leave too little


@dataclass(frozen=True)
class Pool:
    """A SuperNode's KV-cache pool."""

    super_node: str
    members: int  # nodes the SuperNode selects
    per_node_bytes: int  # spec.memoryPool.perNode; 0: the SuperNode has no pool

    @property
    def capacity_bytes(self) -> int:
        return self.members * self.per_node_bytes


@dataclass(frozen=True)
class Claim:
    """One InferenceService's ``spec.kvCache``."""

    uid: str
    super_node: str
    bytes: int
    priority: int
    created: str  # metadata.creationTimestamp (RFC 3339 sorts as time)
    held: bool = False  # admitted before (its status says so): keeps its place


@dataclass(frozen=True)
class Admitted:
    super_node: str
    bytes: int  # reserved
    quota_bytes: int  # on each member node's daemon


@dataclass(frozen=True)
class Waiting:
    reason: Reason
    message: str


Decision = Admitted | Waiting


def admit(pools: Mapping[str, Pool], claims: Iterable[Claim]) -> dict[str, Decision]:
    """Every claim's decision, by UID (see the module's docstring for the order)."""
    reserved: dict[str, int] = {}
    decisions: dict[str, Decision] = {}
    for claim in sorted(claims, key=_order):
        pool = pools.get(claim.super_node)
        refused = _unservable(claim, pool)
        if refused is not None:
            decisions[claim.uid] = refused
            continue
        assert pool is not None
        taken = reserved.get(pool.super_node, 0)
        if taken + claim.bytes > pool.capacity_bytes:
            decisions[claim.uid] = Waiting(Reason.POOL_FULL, _full(claim, pool, taken))
            continue
        reserved[pool.super_node] = taken + claim.bytes
        decisions[claim.uid] = Admitted(pool.super_node, claim.bytes, claim.bytes // pool.members)
    return decisions


def _order(claim: Claim) -> tuple[bool, int, str, str]:
    if claim.held:
        return (False, 0, claim.created, claim.uid)
    return (True, -claim.priority, claim.created, claim.uid)


def _unservable(claim: Claim, pool: Pool | None) -> Waiting | None:
    where = f"SuperNode {claim.super_node!r}"
    if pool is None:
        return Waiting(Reason.UNKNOWN_SUPERNODE, f"spec.kvCache: there is no {where}")
    if pool.per_node_bytes <= 0:
        return Waiting(
            Reason.NO_MEMORY_POOL, f"spec.kvCache: {where} has no spec.memoryPool to reserve from"
        )
    if pool.members == 0:
        return Waiting(Reason.NO_POOL_NODES, f"spec.kvCache: {where} selects no node yet")
    return None


def _full(claim: Claim, pool: Pool, taken: int) -> str:
    return (
        f"spec.kvCache.bytes {human(claim.bytes)} does not fit the KV-cache pool of SuperNode"
        f" {pool.super_node!r}: {human(pool.capacity_bytes)} ({pool.members} nodes ×"
        f" {human(pool.per_node_bytes)}), {human(taken)} reserved by other services,"
        f" {human(pool.capacity_bytes - taken)} free"
    )


def quantity(nbytes: int) -> str:
    """Bytes as an exact Kubernetes quantity in the largest binary unit that divides them:
    64Gi, 1536Mi, 1000 (what status.kvCache writes; the API's byte quantities have no
    decimals)."""
    for shift, unit in ((40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def human(nbytes: int) -> str:
    """Bytes as Kubernetes writes a binary quantity, to one decimal: 1.5Gi, 512Mi, 100."""
    value = float(nbytes)
    for unit in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(value) < 1024 or unit == "Ti":
            return f"{value:.1f}".removesuffix(".0") + unit
        value /= 1024
    raise AssertionError("unreachable")
