"""The recovery decision: which level (InPlace, SpareSwap, Reschedule) and, per rank, which
copy to restore from, after a fault. Pure: no I/O, no clock.

The operator calls ``decide`` with what it detected (``Fault``s), a snapshot of the job
(``JobView``), the checkpoint copies the daemons report (``Copy``) and the free spare nodes
(``Spares``); it carries the returned ``Plan`` out or marks the job Failed (``Failed``).
The operator's recovery wiring and the chaos tests are to call it this way (not wired yet).
DESIGN.md, "Recovery contract".

Rules (each a small named function below):

* A node is *lost* when it is NotReady, deleted or its checkpoint daemon is unreachable. An
  unreachable daemon counts as a lost node: restarted ranks could not checkpoint there, and its
  tier-1 memory, the peer copies it held and its disk can no longer be served. Copies held by
  a lost node are gone; tier-3 copies survive any node.
* Ranks *must move* when they run on a lost node or hold an unhealthy card (only those ranks:
  a card fault moves the ranks whose cards it names, not the whole node). A failed pod on a
  healthy node restarts where it is; under SpareSwap it moves too only when InPlace is not
  allowed. Ranks that neither move nor restart reload the restored step where they run.
* InPlace applies when no rank must move; SpareSwap when every node that loses ranks finds its
  own free spare of the same supernode (one spare per node, never shared); Reschedule always.
  The cheapest applicable level that ``spec.recovery.levels`` allows wins; a level with no
  restorable step gives way to the next one.
* The gang resumes from one step: the newest step for which EVERY rank has a valid surviving
  copy usable by the level (the commit rule). Every rank restores that step, from its fastest
  source: memory on its own node > memory on another node (peer copies) > disk on its own node
  > disk on another node > persistent. Reschedule knows no node yet, so it never counts a copy
  as "own node". Invalid (corrupt, partial) copies are skipped.
* No checkpoint yet (no copy of any rank at any step, valid or not, no step ever known
  committed: ``newest_saved_step`` None, and every daemon asked answered, none of the faults
  a silent daemon): the gang restarts from step 0 at the cheapest
  allowed level its damage allows (``Plan.restored_step`` None, ``Plan.fresh``). Nothing that
  was ever committed is lost. Copies that exist without a step common to every rank, or a
  step once committed that no longer survives, are a real loss: ``Failed``, as before (the
  poll of status.checkpoints lags, so shards of a step just committed and lost with a node
  are not told apart from a first checkpoint half written).
* ``maxRecoveries`` reached → ``Failed`` before anything else.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NewType

from matrixpool_recovery import errors, spec

NodeName = NewType("NodeName", str)  # a Kubernetes Node name
Rank = int  # 0..world_size-1


class FaultKind(enum.StrEnum):
    NODE_DOWN = "NodeDown"  # Ready False or Unknown
    NODE_DELETED = "NodeDeleted"  # the Node object is gone
    CARDS_UNHEALTHY = "CardsUnhealthy"  # matrixpool.dev/unhealthy-cards covers bound cards
    POD_FAILED = "PodFailed"  # a rank's pod failed or was evicted, its node is fine
    DAEMON_UNREACHABLE = "DaemonUnreachable"  # the node's checkpoint daemon does not answer


class Level(enum.StrEnum):
    """Recovery levels, cheapest first (the order of the enum is the order of cost)."""

    IN_PLACE = "InPlace"
    SPARE_SWAP = "SpareSwap"
    RESCHEDULE = "Reschedule"


class Tier(enum.StrEnum):
    MEMORY = spec.MEMORY  # tier 1 on the rank's node, held by its daemon
    PEERS = spec.PEERS  # tier 1 copy held by a peer daemon
    LOCAL = spec.LOCAL  # tier 2: disk of the node holding it
    PERSISTENT = spec.PERSISTENT  # tier 3: the job's URI, held by no node


NODE_LOSSES = frozenset({FaultKind.NODE_DOWN, FaultKind.NODE_DELETED, FaultKind.DAEMON_UNREACHABLE})
ALL_LEVELS = tuple(Level)


class PolicyInputError(errors.CheckpointError, ValueError):
    """A fault or job view that contradicts itself (a caller's bug, not a recovery outcome)."""


@dataclass(frozen=True)
class Fault:
    """One detected fault on one node."""

    kind: FaultKind
    node: NodeName  # where it happened
    cards: frozenset[int] = frozenset()  # CardsUnhealthy: the unhealthy card indexes
    ranks: frozenset[Rank] = frozenset()  # ranks known to be hit (PodFailed: the failed ones)

    def describe(self) -> str:
        extra = f" cards {sorted(self.cards)}" if self.cards else ""
        return f"{self.kind} on {self.node}{extra}"


@dataclass(frozen=True)
class JobView:
    """The TrainingJob as the policy needs it, taken from its pods, nodes and spec."""

    key: str  # "<namespace>/<job>"
    world_size: int  # ranks 0..world_size-1
    node_of: Mapping[Rank, NodeName]  # where each rank runs now
    cards_of: Mapping[Rank, frozenset[int]]  # the cards each rank holds on its node
    rack_of: Mapping[NodeName, str]  # node -> rack (topology key value)
    supernode_of: Mapping[NodeName, str]  # node -> SuperNode name
    levels: tuple[Level, ...] = ALL_LEVELS  # spec.recovery.levels: the allowed ones
    recoveries: int = 0  # status.recoveryCount: recoveries so far
    max_recoveries: int = 10  # spec.recovery.maxRecoveries

    def ranks_on(self, node: NodeName) -> frozenset[Rank]:
        return frozenset(r for r, n in self.node_of.items() if n == node)


@dataclass(frozen=True)
class Copy:
    """One stored shard of one rank at one step, as a daemon or the tier-3 manifest says."""

    rank: Rank
    step: int
    tier: Tier
    node: NodeName | None  # holder; None for persistent
    valid: bool = True  # False: checksum, size or format mismatch (corrupt or partial)


@dataclass(frozen=True)
class Spares:
    """Free spare nodes (Ready, daemon reachable, holding no pod), per supernode."""

    nodes: Mapping[str, tuple[NodeName, ...]] = field(default_factory=dict)  # supernode -> nodes
    rack_of: Mapping[NodeName, str] = field(default_factory=dict)  # spare node -> rack


@dataclass(frozen=True)
class Plan:
    """What to do: the level, who restarts or moves where, and what each rank restores."""

    level: Level
    cause: str  # the faults, one line ("NodeDown on n3; ...") for status.recoveries[].cause
    ranks: frozenset[Rank]  # restarted or moved (InPlace, SpareSwap); all of them (Reschedule)
    targets: Mapping[Rank, NodeName]  # SpareSwap: moved rank -> spare node; else empty
    sources: Mapping[Rank, Copy]  # every rank -> the copy it restores; empty when fresh
    restored_step: int | None  # newest step with a usable copy for every rank; None: fresh
    lost_steps: int | None  # newest_saved_step - restored_step; None when unknown
    reason: str  # why this level, a sentence for Events and conditions

    @property
    def fresh(self) -> bool:
        """No checkpoint yet: every rank starts again from step 0, reading nothing."""
        return self.restored_step is None


@dataclass(frozen=True)
class Failed:
    """No recovery: the job goes to phase Failed with this reason."""

    reason: str
    code: str = "RecoveryImpossible"  # CamelCase, for conditions: or MaxRecoveriesReached


@dataclass(frozen=True)
class _Damage:
    """What the faults did: lost nodes, ranks that must leave their node, ranks to restart."""

    lost: frozenset[NodeName]
    moving: frozenset[Rank]  # on a lost node or holding an unhealthy card
    hit: frozenset[Rank]  # every rank to restart or move (moving and failed pods)
    cause: str


def decide(
    fault: Fault | Iterable[Fault],
    job: JobView,
    copies: Iterable[Copy],
    spares: Spares,
    *,
    newest_saved_step: int | None = None,
    all_answered: bool = True,
) -> Plan | Failed:
    """The cheapest allowed recovery that the surviving copies and free spares allow.

    ``fault`` may be several faults detected together (two nodes of a rack at once): they
    are decided as one recovery. ``newest_saved_step`` is the newest step any rank saved
    (status.checkpoints.memory before the fault); it feeds ``Plan.lost_steps``, and None
    with no copy at all means the job has no checkpoint yet (:func:`_never_checkpointed`) —
    but only when ``all_answered``: every daemon asked for ``copies`` answered (a silent one
    may hold the only copies: no copy reported is then no proof that none exists).
    """
    faults = (fault,) if isinstance(fault, Fault) else tuple(fault)
    # 1. Budget: maxRecoveries reached stops here.
    if job.recoveries >= job.max_recoveries:
        return Failed(
            f"spec.recovery.maxRecoveries ({job.max_recoveries}) reached after "
            f"{job.recoveries} recoveries; not recovering from {_cause(faults)}",
            code="MaxRecoveriesReached",
        )
    # 2. Damage: lost nodes, ranks that must move, ranks to restart.
    damage = _damage(faults, job)
    held = tuple(copies)
    fresh = all_answered and not _silent(faults) and _never_checkpointed(held, newest_saved_step)
    # 3. Levels, cheapest first, among the allowed ones; the first that restores wins.
    refusals = []
    for level in ALL_LEVELS:
        if level not in job.levels:
            refusals.append(f"{level} not in spec.recovery.levels")
            continue
        outcome = _try(level, damage, job, held, spares, newest_saved_step, fresh=fresh)
        if isinstance(outcome, Plan):
            return outcome
        refusals.append(f"{level}: {outcome}")
    return Failed(f"no recovery from {damage.cause}: " + "; ".join(refusals))


def _never_checkpointed(copies: Collection[Copy], newest_saved_step: int | None) -> bool:
    """Rule: a job with no checkpoint yet restarts from step 0 — no copy of any rank at any
    step (valid or not) is reported and no step was ever known committed."""
    return not copies and newest_saved_step is None


def _silent(faults: Collection[Fault]) -> bool:
    """A daemon that does not answer may hold copies nobody reported."""
    return any(f.kind == FaultKind.DAEMON_UNREACHABLE for f in faults)


def _cause(faults: Collection[Fault]) -> str:
    return "; ".join(f.describe() for f in faults)


def _damage(faults: tuple[Fault, ...], job: JobView) -> _Damage:
    if not faults:
        raise PolicyInputError(f"{job.key}: decide() needs at least one fault")
    lost = frozenset(f.node for f in faults if f.kind in NODE_LOSSES)
    on_lost = frozenset(r for r, n in job.node_of.items() if n in lost)
    bad_cards = frozenset(r for f in faults for r in _card_ranks(f, job))
    failed = frozenset(r for f in faults if f.kind == FaultKind.POD_FAILED for r in _pods(f, job))
    moving = on_lost | bad_cards
    hit = moving | failed | frozenset(r for f in faults for r in f.ranks)
    if not hit:
        raise PolicyInputError(f"{job.key}: {_cause(faults)} hits no rank of the job")
    unknown = sorted(r for r in hit if r not in job.node_of)
    if unknown:
        raise PolicyInputError(f"{job.key}: ranks {unknown} have no node in the job view")
    return _Damage(lost, moving, hit, _cause(faults))


def _card_ranks(fault: Fault, job: JobView) -> frozenset[Rank]:
    """CardsUnhealthy: the ranks on the node whose cards meet the unhealthy ones."""
    if fault.kind != FaultKind.CARDS_UNHEALTHY:
        return frozenset()
    on_node = job.ranks_on(fault.node)
    return frozenset(r for r in on_node if job.cards_of.get(r, frozenset()) & fault.cards)


def _pods(fault: Fault, job: JobView) -> frozenset[Rank]:
    """PodFailed: the ranks it names, or every rank on the node when it names none."""
    return fault.ranks or job.ranks_on(fault.node)


def _try(
    level: Level,
    damage: _Damage,
    job: JobView,
    copies: tuple[Copy, ...],
    spares: Spares,
    newest_saved_step: int | None,
    *,
    fresh: bool = False,
) -> Plan | str:
    """A plan at this level, or why the level cannot be used."""
    placed = _placement(level, damage, job, spares)
    if isinstance(placed, str):
        return placed
    ranks, targets, reason = placed
    if fresh:
        reason = f"{reason}; no checkpoint yet: every rank restarts from step 0"
        return Plan(level, damage.cause, ranks, targets, {}, None, None, reason)
    restored = _restore(level, damage, job, copies, targets)
    if isinstance(restored, str):
        return restored
    step, sources = restored
    lost_steps = None if newest_saved_step is None else max(0, newest_saved_step - step)
    return Plan(level, damage.cause, ranks, targets, sources, step, lost_steps, reason)


_Placed = tuple[frozenset[Rank], dict[Rank, NodeName], str]


def _placement(level: Level, damage: _Damage, job: JobView, spares: Spares) -> _Placed | str:
    """Which ranks restart or move, and where (SpareSwap), or why the level does not apply."""
    if level == Level.IN_PLACE:
        if damage.moving:
            return f"ranks {sorted(damage.moving)} lost their node or cards"
        return damage.hit, {}, f"ranks {sorted(damage.hit)} restart on their healthy nodes"
    if level == Level.SPARE_SWAP:
        targets = _spare_targets(damage, job, spares)
        if isinstance(targets, str):
            return targets
        moves = ", ".join(f"{n}→{s}" for n, s in sorted(_moves(targets, job).items()))
        return damage.hit, targets, f"ranks {sorted(targets)} move to spares ({moves})"
    everyone = frozenset(range(job.world_size))
    return everyone, {}, f"the whole gang of {job.world_size} ranks is placed again"


def _moves(targets: Mapping[Rank, NodeName], job: JobView) -> dict[NodeName, NodeName]:
    return {job.node_of[r]: spare for r, spare in targets.items()}


def _spare_targets(damage: _Damage, job: JobView, spares: Spares) -> dict[Rank, NodeName] | str:
    """One free spare of the same supernode per node that loses ranks; never one spare twice.

    A spare in the failed node's rack is preferred (the job keeps its rack layout, so tier-1
    peers stay in another rack), then by name.
    """
    by_node: dict[NodeName, set[Rank]] = {}
    for r in _movers(damage, job):
        by_node.setdefault(job.node_of[r], set()).add(r)
    taken: set[NodeName] = set(damage.lost) | set(job.node_of.values())
    targets: dict[Rank, NodeName] = {}
    for node in sorted(by_node):
        spare = _free_spare(node, job, spares, taken)
        if spare is None:
            where = job.supernode_of.get(node, "?")
            return f"{len(by_node)} nodes need a spare; none left for {node} in supernode {where}"
        taken.add(spare)
        targets.update(dict.fromkeys(by_node[node], spare))
    return targets


def _movers(damage: _Damage, job: JobView) -> frozenset[Rank]:
    """The ranks that must move; failed pods move too only when InPlace is not allowed."""
    if damage.moving and Level.IN_PLACE in job.levels:
        return damage.moving
    return damage.hit


def _free_spare(
    node: NodeName, job: JobView, spares: Spares, taken: Collection[NodeName]
) -> NodeName | None:
    supernode = job.supernode_of.get(node)
    if supernode is None:
        return None
    free = [s for s in spares.nodes.get(supernode, ()) if s not in taken]
    rack = job.rack_of.get(node)
    free.sort(key=lambda s: (spares.rack_of.get(s) != rack, s))
    return free[0] if free else None


def _restore(
    level: Level,
    damage: _Damage,
    job: JobView,
    copies: tuple[Copy, ...],
    targets: Mapping[Rank, NodeName],
) -> tuple[int, dict[Rank, Copy]] | str:
    """The newest step every rank can restore at this level, and each rank's fastest copy."""
    ranked: dict[Rank, dict[int, tuple[tuple[int, str, str], Copy]]] = {
        r: {} for r in range(job.world_size)
    }
    for copy in copies:
        if copy.rank not in ranked:
            continue
        home = None if level == Level.RESCHEDULE else targets.get(copy.rank, job.node_of[copy.rank])
        speed = _speed(copy, home, damage.lost)
        if speed is None:
            continue
        key = (speed, copy.tier.value, copy.node or "")
        best = ranked[copy.rank].get(copy.step)
        if best is None or key < best[0]:
            ranked[copy.rank][copy.step] = (key, copy)
    common = set.intersection(*(set(steps) for steps in ranked.values())) if ranked else set()
    if not common:
        bare = sorted(r for r, steps in ranked.items() if not steps)
        detail = f"ranks {bare[:8]} have no valid surviving copy" if bare else "no step in common"
        return f"no step is restorable for every rank ({detail})"
    step = max(common)
    return step, {r: ranked[r][step][1] for r in sorted(ranked)}


def _speed(copy: Copy, home: NodeName | None, lost: Collection[NodeName]) -> int | None:
    """Rank of a source, 0 fastest; None when the copy is corrupt or its holder is lost.

    memory on the rank's node (0) > memory elsewhere (1) > disk on the rank's node (2) > disk
    elsewhere (3) > persistent (4). ``home`` None (Reschedule): no node is the rank's yet.
    """
    if not copy.valid:
        return None
    if copy.tier == Tier.PERSISTENT:
        return 4
    if copy.node is None or copy.node in lost:
        return None
    same = copy.node == home
    if copy.tier in (Tier.MEMORY, Tier.PEERS):
        return 0 if same else 1
    return 2 if same else 3
