"""The placement engine: where a whole gang goes, or why it cannot go anywhere now.

Pure (no kopf, no Kubernetes client). The scheduler cycle (``matrixpool.controllers``) builds a
:class:`Snapshot` of the cycle, then for each pending gang, highest priority first:
:func:`check_servable` (specs that can never be served), :func:`place` and, on success,
``snapshot.commit(placement)``; when a gang does not fit, :func:`preempt` says which lower
priority gangs to shrink or evict. The benchmark compares :func:`place` with
:func:`first_fit`.

Rules of DESIGN.md's scheduling contract, and where they live:

- all-or-nothing: :func:`place` works inside ``Snapshot.tentative()`` and always discards what it
  did; the caller commits the returned placement (Volcano's statement);
- ``Required`` keeps a gang in one supernode, the named one or the best fitting (fewest free
  cards among those that hold it); ``Preferred`` uses one supernode when one holds it, else the
  fewest supernodes (:func:`_fewest_supernodes`);
- whole nodes first, card groups, spread of inference replicas across racks, ``group_size``
  ranks in one rack, lowest fragmentation on ties: :mod:`matrixpool.placement.choose`;
- spares, unhealthy cards, NotReady and cordoned nodes are never in the snapshot's free cards;
- what a pod asks of a node besides cards (resources, taints, nodeSelector, required node
  affinity: :mod:`matrixpool.placement.nodefit`): ``Snapshot.restrict`` hides the nodes a pod
  of the gang may not go to, and a gang that does not fit says which of these kept nodes out
  (:mod:`matrixpool.placement.diagnose`);
- preemption of strictly lower priorities, the least lost work inside the domain the gang goes
  to: :mod:`matrixpool.placement.preemption`;
- a training gang that would need fewer racks once the cards of pods going away are free
  (``Holding.leaving``) waits for them (:data:`LEAVING`); :func:`preempt` then evicts nobody
  and names where it will go, so the scheduler holds the free part of it meanwhile;
- how many racks a placement uses beyond the fewest that could hold it (:func:`racks`),
  for the scheduler's locality wait (``spec.placement.localityWaitSeconds``).

Pods of a gang that already hold cards (a gang half-bound when the operator died) keep them;
only the rest is placed, in the same supernode when the gang is ``Required``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence

from matrixpool.placement import choose, diagnose, firstfit, nodefit, preemption, servable
from matrixpool.placement.model import (
    Affinity,
    Assignment,
    GangKey,
    GangRequest,
    Placement,
    PodKey,
    PodRequest,
    Preemption,
    Reason,
    SuperNodeTopology,
    Unplaceable,
)
from matrixpool.placement.snapshot import Snapshot, StaleSnapshotError, Stats

__all__ = [
    "FRAGMENTED",
    "INSUFFICIENT_CARDS",
    "NO_VICTIMS",
    "Snapshot",
    "StaleSnapshotError",
    "Stats",
    "check_servable",
    "first_fit",
    "place",
    "preempt",
    "racks",
]

INSUFFICIENT_CARDS = "InsufficientCards"  # fewer free cards than the gang needs
FRAGMENTED = "Fragmented"  # enough free cards, but not in the shape the gang needs
NO_VICTIMS = "NoVictims"  # even preempting every lower priority would not make room
LEAVING = "WaitingForLeavingPods"  # fewer racks once the cards of pods going away are free


def check_servable(
    topologies: Sequence[SuperNodeTopology],
    gang: GangRequest,
    summaries: Mapping[str, servable.Summary] | None = None,
) -> Unplaceable | None:
    """A permanent :class:`Unplaceable` when ``gang`` can never be served, else None.
    ``summaries``: :func:`servable.summaries` of ``topologies``, when the caller checks many
    gangs against the same topologies (computing them walks every node).

    Codes: UnknownSuperNode, InvalidCards, NodeTooSmall, CardGroupMismatch, and for a
    ``Required`` gang naming its supernode TooManyCards and GroupTooLarge.
    """
    if summaries is None:
        summaries = servable.summaries(topologies)
    if gang.supernode is not None:
        return servable.check(summaries.get(gang.supernode), gang)
    return servable.check(servable.merged(summaries.values()), gang)


def place(snapshot: Snapshot, gang: GangRequest, patient: bool = True) -> Placement | Unplaceable:
    """Where the whole gang goes on ``snapshot`` (unchanged on return), or why it cannot.

    ``patient``: a training gang that would cross more racks now than once the cards of the
    pods going away (``Snapshot.leaving``) are free waits for them (reason ``LEAVING``): a
    deleted gang's pods go one by one, and a gang placed while they go takes the first freed
    nodes of many racks instead of the whole racks a second later."""
    # 1. specs that can never be served
    never = _never(snapshot, gang)
    if never is not None:
        return never
    # 2. pods that already hold cards keep them; 3. the rest placed tentatively
    kept, pending, placed = _tentative(snapshot, gang)
    # 4. what was done is discarded; the answer says what to commit
    if placed is None:
        return Unplaceable(gang.gang, (_why(snapshot, gang, pending),))
    if patient and _sooner_fewer(snapshot, gang, pending, kept, placed) is not None:
        return Unplaceable(gang.gang, (_leaving(gang),))
    return _placement(gang, kept, placed)


def preempt(
    snapshot: Snapshot,
    gang: GangRequest,
    victims: Mapping[GangKey, GangRequest],
    rule: preemption.Rule = preemption.LEAST_LOST_WORK,
) -> Preemption | Unplaceable:
    """Room for ``gang`` made by shrinking, then evicting, gangs of strictly lower priority.

    ``victims`` holds the requests of the gangs that hold cards (their priority, elasticity,
    rank order and lost work per card). ``rule`` picks the plan (:mod:`.preemption`; the
    least lost work by default). The answer is verified on a copy of ``snapshot``, which
    stays unchanged.
    """
    # 1. a spec that can never be served is not helped by evictions
    never = _never(snapshot, gang)
    if never is not None:
        return never
    sim = snapshot.copy()
    verdict = place(sim, gang)
    if isinstance(verdict, Placement):
        return Preemption(verdict)
    # 2. a gang that waits for pods going away evicts nobody: it holds what it will take
    if verdict.reasons[0].code == LEAVING:
        later = _after_leaving(sim, gang)
        if later is not None:
            return Preemption(later)
    # 3. the cheapest plan by the rule, over every scope (supernodes, racks)
    best = preemption.best(sim, gang, victims, _fits, rule)
    if best is None:
        return Unplaceable(gang.gang, (_why(snapshot, gang, gang.pods), _no_victims(gang)))
    return Preemption(best.placement, dict(best.shrink), best.evict)


def first_fit(snapshot: Snapshot, gang: GangRequest) -> Placement | Unplaceable:
    """The baseline: each pod on the first node in name order with enough free cards."""
    return firstfit.place(snapshot, gang)


# ---- placement ------------------------------------------------------------------------------


def _never(snapshot: Snapshot, gang: GangRequest) -> Unplaceable | None:
    layout = snapshot.layout
    if gang.supernode is not None:
        return servable.check(layout.summaries.get(gang.supernode), gang)
    return servable.check(layout.any_summary, gang)


def _tentative(
    snap: Snapshot, gang: GangRequest
) -> tuple[dict[PodKey, Assignment], tuple[PodRequest, ...], list[Assignment] | None]:
    """The pods of ``gang`` that hold cards (kept), the others, and where those others would go
    now: in one supernode if one holds the gang, else spanning (``Preferred``). ``snap`` is
    left as it was."""
    kept = snap.kept(gang.gang)
    pending = tuple(p for p in gang.pods if p.pod not in kept)
    with snap.tentative():
        snap.restrict(gang.needs)
        placed = _place_tentatively(snap, gang, pending, kept)
    return kept, pending, placed


def _place_tentatively(
    snap: Snapshot,
    gang: GangRequest,
    pending: Sequence[PodRequest],
    kept: Mapping[PodKey, Assignment],
) -> list[Assignment] | None:
    if not pending:
        return []
    for s in _one_supernode_candidates(snap, gang, pending, kept):
        mark = snap.mark()
        out: list[Assignment] = []
        if choose.place_pods(snap, s, pending, gang, out) == len(pending):
            return out
        snap.undo(mark)
    if gang.affinity is Affinity.PREFERRED:
        return _span(snap, gang, pending)
    return None


def _sooner_fewer(
    snap: Snapshot,
    gang: GangRequest,
    pending: Sequence[PodRequest],
    kept: Mapping[PodKey, Assignment],
    placed: Sequence[Assignment],
) -> list[Assignment] | None:
    """Where a training gang (several pods, no rank groups, none bound yet) would go once the
    pods going away are gone, when that needs fewer racks than ``placed``; else None."""
    if not snap.leaving or gang.spread_group or kept or len(pending) < 2:
        return None
    if (gang.group_size or 1) > 1:
        return None
    now = _racks(snap, placed)
    if now <= _fewest_racks(snap, len(pending), max(p.cards for p in pending)):
        return None  # already the fewest any rack could allow
    with snap.tentative():
        for leaving_gang, pods in snap.leaving.items():
            if leaving_gang != gang.gang:
                snap.release_pods(leaving_gang, pods)
        snap.restrict(gang.needs)
        later = _place_tentatively(snap, gang, pending, kept)
    return later if later is not None and _racks(snap, later) < now else None


def _after_leaving(snap: Snapshot, gang: GangRequest) -> Placement | None:
    """The placement :func:`_sooner_fewer` waits for, as a whole gang's placement."""
    kept, pending, placed = _tentative(snap, gang)
    if placed is None:
        return None
    later = _sooner_fewer(snap, gang, pending, kept, placed)
    return _placement(gang, kept, later) if later is not None else None


def racks(snapshot: Snapshot, placement: Placement) -> tuple[int, int]:
    """The racks ``placement`` uses, and the fewest that could hold its pods on an empty layout
    (ceil(pods / the pods the roomiest rack holds)): a locality wait waits for them to match."""
    placed = placement.assignments
    if not placed:
        return 0, 0
    size = max(len(a.cards) for a in placed)
    return _racks(snapshot, placed), _fewest_racks(snapshot, len(placed), size)


def waits_for_fewer_racks(
    snapshot: Snapshot,
    placement: Placement,
    wait: float,
    spread_since: MutableMapping[GangKey, float],
    now: float,
) -> tuple[int, int] | None:
    """Rule: a gang whose ``placement`` would use more racks than the fewest that could hold it
    (:func:`racks`) waits for them, up to ``wait`` seconds from the first time (``now``, kept
    in ``spread_since``) it could have been placed that way; then it takes what is free. A
    gang whose pods already hold cards (a recovery's holes) never waits. Returns the racks it
    would use and the fewest while it waits, ``None`` when it is to be placed now."""
    if wait <= 0 or snapshot.kept(placement.gang):
        return None
    used, fewest = racks(snapshot, placement)
    if used <= fewest:
        return None
    since = spread_since.setdefault(placement.gang, now)
    return (used, fewest) if now - since < wait else None


def _fewest_racks(snap: Snapshot, pods: int, size: int) -> int:
    largest = snap.largest_rack(size)
    return -(-pods // largest) if largest else 1


def _racks(snap: Snapshot, placed: Sequence[Assignment]) -> int:
    layout = snap.layout
    return len({layout.node_rack[layout.index[a.node]] for a in placed})


def _leaving(gang: GangRequest) -> Reason:
    return Reason(
        LEAVING,
        f"waits for the cards of pods going away: {len(gang.pods)} pods then need fewer racks",
    )


def _one_supernode_candidates(
    snap: Snapshot,
    gang: GangRequest,
    pending: Sequence[PodRequest],
    kept: Mapping[PodKey, Assignment],
) -> Iterator[int]:
    """Supernodes to try: the fewest racks the gang needs there (a training gang of several
    pods, :func:`choose.racks_needed`), then best fit: the fewest free cards among those that
    hold it."""
    layout = snap.layout
    named = layout.sn_index.get(gang.supernode) if gang.supernode else None
    if gang.affinity is Affinity.REQUIRED and kept:
        yield layout.sn_index[next(iter(kept.values())).supernode]
        return
    if named is not None:
        yield named
        if gang.affinity is Affinity.REQUIRED:
            return
    need, size = sum(p.cards for p in pending), max(p.cards for p in pending)
    group = gang.group_size or 1
    grouped = len(pending) // group * group  # pods in whole rank groups
    free = snap.sn_free
    fitting = [s for s in range(len(free)) if free[s] >= need and s != named]
    fitting = [
        s
        for s in fitting
        if snap.capacity(s, size) >= len(pending) and snap.capacity(s, size, group) >= grouped
    ]
    fitting.sort(key=lambda s: (free[s], s))
    if gang.spread_group or len(pending) < 2 or group > 1:
        yield from fitting
        return
    # the best fit that needs no more racks than the fewest possible anywhere comes first: no
    # other can beat it, and the rest need not be counted (a cluster of hundreds of supernodes)
    largest = snap.largest_rack(size)
    floor = -(-len(pending) // largest) if largest else 1
    racks: dict[int, int] = {}
    for s in fitting:
        racks[s] = choose.racks_needed(snap, s, pending)
        if racks[s] <= floor:
            yield s
            fitting.remove(s)
            break
    fitting.sort(key=lambda s: (racks.get(s) or choose.racks_needed(snap, s, pending), free[s], s))
    yield from fitting


def _span(
    snap: Snapshot, gang: GangRequest, pending: Sequence[PodRequest]
) -> list[Assignment] | None:
    """A ``Preferred`` gang over the fewest supernodes, filled one after another."""
    size, group = max(p.cards for p in pending), gang.group_size or 1
    named = snap.layout.sn_index.get(gang.supernode) if gang.supernode else None
    rooms = {s: snap.capacity(s, size, group) for s in range(len(snap.sn_free))}
    order = _fewest_supernodes(rooms, len(pending), named)
    out: list[Assignment] = []
    done = 0
    for s in order or ():
        done += choose.place_pods(snap, s, pending[done:], gang, out)
        if done == len(pending):
            return out
    return None


def _fewest_supernodes(rooms: dict[int, int], pods: int, first: int | None) -> list[int] | None:
    """The named supernode first, then :func:`choose.fewest_domains` for the rest (the roomiest
    until one holds the rest, that one the best fit). None when all of them together are short."""
    if first is None:
        return choose.fewest_domains(rooms, pods)
    rest = pods - rooms.pop(first, 0)
    found = choose.fewest_domains(rooms, rest) if rest > 0 else []
    return [first, *found] if found is not None else None


def _placement(
    gang: GangRequest, kept: Mapping[PodKey, Assignment], placed: Sequence[Assignment]
) -> Placement:
    by_pod = {**kept, **{a.pod: a for a in placed}}
    return Placement(
        gang.gang,
        tuple(by_pod[p.pod] for p in gang.pods),
        priority=gang.priority,
        spread_group=gang.spread_group,
        requests=gang.needs.requests,
    )


def _why(snap: Snapshot, gang: GangRequest, pending: Sequence[PodRequest]) -> Reason:
    """A constraint that kept nodes out, when one did (``diagnose``); else the cards reason."""
    cards = _cards_why(snap, gang, pending)
    fit = snap.layout.fit(gang.needs)
    if not (fit.why or fit.short or gang.needs.requests):
        return cards
    layout = snap.layout
    named = layout.sn_index.get(gang.supernode) if gang.supernode else None
    scope = range(len(layout.sn_names)) if named is None else (named,)
    size = max((p.cards for p in pending), default=1)
    tally = diagnose.tally(snap, gang.needs, size, scope)
    if not tally.constrained():
        return cards
    code = tally.code()
    if code is None:
        return Reason(cards.code, f"{cards.message}; {tally.summary()}")
    asks = nodefit.describe(gang.needs.requests)
    where = f"supernode {gang.supernode}" if named is not None else "all supernodes"
    return Reason(
        code,
        f"no room for {_shape(gang, pending)}"
        + (f" ({asks} each)" if asks else "")
        + f" in {where}: {tally.summary()}",
    )


def _cards_why(snap: Snapshot, gang: GangRequest, pending: Sequence[PodRequest]) -> Reason:
    """InsufficientCards when the candidates lack free cards, else Fragmented."""
    need = sum(p.cards for p in pending)
    shape = _shape(gang, pending)
    layout = snap.layout
    if gang.supernode is not None and gang.affinity is Affinity.REQUIRED:
        free, where = snap.supernode_free(gang.supernode), f"supernode {gang.supernode}"
    elif gang.affinity is Affinity.REQUIRED:
        free = max(snap.sn_free, default=0)
        where = "any one supernode"
    else:
        free, where = sum(snap.sn_free), f"all {len(layout.sn_names)} supernodes"
    if free < need:
        return Reason(
            INSUFFICIENT_CARDS,
            f"needs {need} cards ({shape}); {where} has at most {free} free outside spares",
        )
    return Reason(
        FRAGMENTED,
        f"{free} cards are free in {where}, but not as {shape} on whole card groups"
        + (f" with {gang.group_size} ranks per rack" if gang.group_size else ""),
    )


def _shape(gang: GangRequest, pending: Sequence[PodRequest]) -> str:
    sizes = sorted({p.cards for p in pending})
    return f"{len(pending)} pods × {'/'.join(map(str, sizes))} cards, {gang.cards_field}"


# ---- preemption -----------------------------------------------------------------------------


def _fits(snap: Snapshot, gang: GangRequest) -> Placement | None:
    return _as_placement(place(snap, gang, patient=False))


def _as_placement(verdict: Placement | Unplaceable) -> Placement | None:
    return verdict if isinstance(verdict, Placement) else None


def _no_victims(gang: GangRequest) -> Reason:
    return Reason(
        NO_VICTIMS,
        f"no set of preemptible gangs below priority {gang.priority} would make room",
    )
