"""The target split of a SuperNode's cards between inference and training in one window.

Called by the time-sharing transitions (``matrixpool.controllers``) at every window boundary and
whenever capacity or workloads change; they then shrink, checkpoint, evict and scale toward the
returned :class:`Split`. Pure: it counts cards and does not place them, so placement may still
find a budget that the topology cannot hold.

Rules, in order (each a named policy below):
1. Inference may hold ``min(window.inferenceCards, pool)`` cards (:func:`inference_budget`).
2. Floors first: by priority (:func:`by_priority`), each InferenceService keeps every role at
   ``minReplicas`` if those cards fit in what is left; one whose floors do not fit gets nothing
   and smaller services after it may still fit (:func:`admit_floors`).
3. Growth: in the same order, each service scales up as far as what is left allows
   (:func:`grow`), its roles in ladders: the roles named in ``ratio`` climb together, every
   other role alone (:func:`ladders_of`, rounding in :class:`Ladder`).
4. Training gets the rest: ``pool - cards inference was granted`` (:func:`training_budget`).
5. A job with ``windows`` runs only in those windows (:func:`runs_in`); without time-sharing
   (no window) such a job does not run.
6. Jobs then get floors and growth exactly as services do (rules 2 and 3): elastic jobs are
   shrunk toward ``minReplicas`` before any job is suspended, and a job is suspended only when
   its floor does not fit even with every lower-priority job suspended — lowest priority first.

Priority is compared within each kind only: the window decides between inference and training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

from matrixpool.api import inferenceservice, supernode, trainingjob

WorkloadKey = NewType("WorkloadKey", str)  # "namespace/name" of a service or job
TRAINER = "trainer"  # the one role of a training job's ladder


class Reason(StrEnum):
    """Why a workload got no cards; CamelCase, fit for a condition reason."""

    OUTSIDE_WINDOWS = "OutsideWindows"  # a job whose spec.windows exclude the current window
    INSUFFICIENT_CARDS = "InsufficientCards"  # its floors do not fit in what is left


@dataclass(frozen=True)
class RoleDemand:
    """One role of an InferenceService, in cards."""

    name: str  # role name, unique in the service
    replicas: int  # instances at full size
    min_replicas: int  # floor, kept whenever the service runs
    cards_per_replica: int  # cards of one instance (podsPerReplica x cardsPerPod)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.replicas or self.cards_per_replica < 1:
            raise ValueError(f"role {self.name}: need 0 <= minReplicas <= replicas, cards >= 1")


@dataclass(frozen=True)
class InferenceDemand:
    """What an InferenceService asks of the pool."""

    key: WorkloadKey  # namespace/name
    priority: int  # higher is served first
    roles: tuple[RoleDemand, ...]  # in spec order
    ratio: Mapping[str, int] = field(default_factory=dict)  # role -> weight, scaled together

    def __post_init__(self) -> None:
        names = [r.name for r in self.roles]
        if not names or len(set(names)) != len(names) or min(self.ratio.values(), default=1) < 1:
            raise ValueError(f"service {self.key}: need unique roles and ratio weights >= 1")


@dataclass(frozen=True)
class TrainingDemand:
    """What a TrainingJob asks of the pool."""

    key: WorkloadKey  # namespace/name
    priority: int  # higher is served first
    replicas: int  # ranks at full size
    min_replicas: int  # elastic floor; equal to replicas for a rigid job
    cards_per_replica: int  # cards of one rank
    windows: frozenset[str] | None = None  # windows it may run in; None: any time

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.replicas or self.cards_per_replica < 1:
            raise ValueError(f"job {self.key}: need 0 <= minReplicas <= replicas, cards >= 1")


@dataclass(frozen=True)
class Split:
    """The target: replicas per workload and the cards each kind holds."""

    window: str | None  # name of the window it is for; None without time-sharing
    inference: Mapping[WorkloadKey, Mapping[str, int]]  # service -> role -> replicas
    training: Mapping[WorkloadKey, int]  # job -> replicas; 0 = suspended
    inference_cards: int  # cards the inference replicas hold, <= cap and pool
    training_cards: int  # cards the training replicas hold, <= pool - inference_cards
    reasons: Mapping[WorkloadKey, Reason] = field(default_factory=dict)  # why one got 0


@dataclass(frozen=True)
class Ladder:
    """Roles that scale together, by whole levels.

    At level ``k`` a role has ``clamp(k * unit, minReplicas, replicas)`` replicas. The units are
    the ratio's weights divided by their greatest common divisor (4:2 climbs as 2:1; a role
    outside the ratio climbs alone with unit 1). A level is granted whole or not at all: the
    replicas are rounded down to the last whole level that fits. The clamp keeps the floors
    even where they break the ratio, and stops a role at ``replicas`` while the others climb
    on, so the top level (``max ceil(replicas / unit)``) is every role at full size.
    """

    roles: tuple[RoleDemand, ...]  # the roles on the ladder
    units: tuple[int, ...]  # replicas per level, per role (same order)

    @property
    def top(self) -> int:
        return max(-(-r.replicas // u) for r, u in zip(self.roles, self.units, strict=True))

    def replicas(self, level: int) -> tuple[int, ...]:
        return tuple(
            max(r.min_replicas, min(level * u, r.replicas))
            for r, u in zip(self.roles, self.units, strict=True)
        )

    def cards(self, level: int) -> int:
        counts = self.replicas(level)
        return sum(n * r.cards_per_replica for n, r in zip(counts, self.roles, strict=True))

    def highest_level(self, cards: int) -> int:
        """The highest level whose cards fit in ``cards`` (cards grow with the level); 0 if none."""
        low, high = 0, self.top
        while low < high:
            middle = (low + high + 1) // 2
            if self.cards(middle) <= cards:
                low = middle
            else:
                high = middle - 1
        return low


@dataclass(frozen=True)
class Claim:
    """A workload as the policy sees it: ladders climbed by priority."""

    key: WorkloadKey  # namespace/name
    priority: int  # higher first
    ladders: tuple[Ladder, ...]  # climbed in this order

    @property
    def floor(self) -> int:
        """Cards of every ladder at level 0 (the floors)."""
        return sum(ladder.cards(0) for ladder in self.ladders)


Levels = dict[WorkloadKey, list[int]]  # claim -> level per ladder


# --- policies --------------------------------------------------------------------------------
def inference_budget(pool_cards: int, window: supernode.TimeWindow | None) -> int:
    """Rule 1: the window caps inference, and nothing exceeds the pool; no window: the pool."""
    cap = pool_cards if window is None else window.inference_cards
    return max(0, min(cap, pool_cards))


def training_budget(pool_cards: int, inference_cards: int) -> int:
    """Rule 4: training gets the cards inference was not granted."""
    return max(0, pool_cards - inference_cards)


def runs_in(job: TrainingDemand, window: str | None) -> bool:
    """Rule 5: a job with windows runs only in one of them; a job without runs any time."""
    return job.windows is None or (window is not None and window in job.windows)


def by_priority(claims: Iterable[Claim]) -> list[Claim]:
    """Higher priority first, then by key (namespace/name) for a stable order."""
    return sorted(claims, key=lambda claim: (-claim.priority, claim.key))


def admit_floors(claims: Sequence[Claim], budget: int) -> tuple[list[Claim], int]:
    """Rule 2: in order, a claim is admitted at its floors if they fit in what is left.

    A claim whose floors do not fit is skipped and later (lower-priority) claims may still
    fit: a claim loses its floors only when they do not fit even with every claim after it
    out. Returns the admitted claims, in order, and the cards left.
    """
    admitted = []
    for claim in claims:
        if claim.floor <= budget:
            admitted.append(claim)
            budget -= claim.floor
    return admitted, budget


def grow(claims: Sequence[Claim], left: int) -> tuple[Levels, int]:
    """Rule 3: in order, each admitted claim climbs each ladder as high as what is left allows.

    A higher-priority claim grows fully before a lower one grows at all, so the lower one is
    the first shrunk toward its floors. Returns the level of every ladder and the cards left.
    """
    levels: Levels = {}
    for claim in claims:
        levels[claim.key] = []
        for ladder in claim.ladders:
            level = ladder.highest_level(left + ladder.cards(0))
            left -= ladder.cards(level) - ladder.cards(0)
            levels[claim.key].append(level)
    return levels, left


def ladders_of(service: InferenceDemand) -> tuple[Ladder, ...]:
    """Rule 3's ladders: one for the roles named in ``ratio`` (at the first such role's place),
    one per other role, in spec order. Ratio keys naming no role are ignored."""
    weights = {r.name: service.ratio[r.name] for r in service.roles if r.name in service.ratio}
    together = tuple(r for r in service.roles if r.name in weights)
    divisor = math.gcd(*weights.values()) if weights else 1
    ladders: list[Ladder] = []
    for role in service.roles:
        if role.name not in weights:
            ladders.append(Ladder((role,), (1,)))
        elif role is together[0]:
            ladders.append(Ladder(together, tuple(weights[r.name] // divisor for r in together)))
    return tuple(ladders)


# --- the split -------------------------------------------------------------------------------
def target_split(
    pool_cards: int,
    window: supernode.TimeWindow | None,
    services: Sequence[InferenceDemand],
    jobs: Sequence[TrainingDemand],
) -> Split:
    """The split of ``pool_cards`` (the cards placement may use) in ``window`` (None: no
    time-sharing), following the module's rules."""
    name = None if window is None else window.name
    service_claims = [Claim(s.key, s.priority, ladders_of(s)) for s in services]
    inference, inference_cards, reasons = _settle(
        service_claims, inference_budget(pool_cards, window)
    )
    eligible = [j for j in jobs if runs_in(j, name)]
    job_claims = [Claim(j.key, j.priority, (_trainer_ladder(j),)) for j in eligible]
    training, training_cards, job_reasons = _settle(
        job_claims, training_budget(pool_cards, inference_cards)
    )
    outside = {j.key: Reason.OUTSIDE_WINDOWS for j in jobs if not runs_in(j, name)}
    return Split(
        window=name,
        inference=inference,
        training={j.key: training.get(j.key, {}).get(TRAINER, 0) for j in jobs},
        inference_cards=inference_cards,
        training_cards=training_cards,
        reasons={**reasons, **job_reasons, **outside},
    )


def _settle(
    claims: Sequence[Claim], budget: int
) -> tuple[dict[WorkloadKey, dict[str, int]], int, dict[WorkloadKey, Reason]]:
    """Rules 2 and 3 for one kind: replicas per claim and role, cards used, and reasons."""
    admitted, left = admit_floors(by_priority(claims), budget)
    levels, left = grow(admitted, left)
    replicas = {claim.key: _replicas(claim, levels.get(claim.key)) for claim in claims}
    reasons = {c.key: Reason.INSUFFICIENT_CARDS for c in claims if c.key not in levels}
    return replicas, budget - left, reasons


def _replicas(claim: Claim, levels: list[int] | None) -> dict[str, int]:
    """Role -> replicas at the given ladder levels; every role 0 for a claim not admitted."""
    counts: dict[str, int] = {}
    for index, ladder in enumerate(claim.ladders):
        granted = ladder.replicas(levels[index]) if levels is not None else (0,) * len(ladder.roles)
        counts.update(zip((r.name for r in ladder.roles), granted, strict=True))
    return counts


def _trainer_ladder(job: TrainingDemand) -> Ladder:
    role = RoleDemand(TRAINER, job.replicas, job.min_replicas, job.cards_per_replica)
    return Ladder((role,), (1,))


# --- from the API models ---------------------------------------------------------------------
def demand_of_service(
    namespace: str, name: str, spec: inferenceservice.InferenceServiceSpec
) -> InferenceDemand:
    """An InferenceService's demand; a role's instance holds podsPerReplica x cardsPerPod.

    A floor above replicas (which the CRD rejects) is read as replicas.
    """
    roles = tuple(
        RoleDemand(r.name, r.replicas, min(r.min_replicas, r.replicas), r.cards_per_replica)
        for r in spec.roles
    )
    key = WorkloadKey(f"{namespace}/{name}")
    return InferenceDemand(key, spec.priority, roles, dict(spec.ratio))


def demand_of_job(namespace: str, name: str, spec: trainingjob.TrainingJobSpec) -> TrainingDemand:
    """A TrainingJob's demand; a floor above replicas (which the CRD rejects) is read as replicas.

    A rank bigger than a node becomes whole-node pods at placement
    (``placement.gangs.pods_per_replica``) but still holds cardsPerReplica cards, so the node
    size does not matter here (and timeshare, a sibling layer of placement, does not import it).
    """
    return TrainingDemand(
        key=WorkloadKey(f"{namespace}/{name}"),
        priority=spec.priority,
        replicas=spec.replicas,
        min_replicas=min(spec.min_replicas, spec.replicas),
        cards_per_replica=spec.cards_per_replica,
        windows=frozenset(spec.windows) or None,
    )
