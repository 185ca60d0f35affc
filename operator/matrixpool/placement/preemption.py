"""Which lower-priority gangs give way to a gang that does not fit: the cheapest plan.

Pure. :func:`matrixpool.placement.engine.preempt` calls :func:`cheapest` once per scope with a
copy of the cycle's snapshot, the candidate victims (already filtered: strictly lower priority,
preemptible, holding cards in the scope) and a ``fits`` callback (the engine's ``place``). Every
trial releases cards inside ``Snapshot.tentative()``, so the copy is unchanged afterwards.

The rule (DESIGN.md: the smallest set of lower-priority gangs; elastic jobs shrink before anyone
is evicted), in phases:

1. shrink elastic victims to their floor (``min_pods``, dropping their highest ranks), lowest
   priority first, until the gang fits;
2. if that is not enough, evict victims, lowest priority first and, at equal priority, the one
   holding the most cards first (fewer victims), until the gang fits;
3. prune: give back every eviction, then every shrink, that the fit does not need, trying the
   highest priority first — so the victim set is minimal (no victim can be spared);
4. let each shrunk gang keep as many ranks as the fit allows (binary search);
5. verify the final plan once more and keep the placement it gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from matrixpool.placement.model import GangKey, GangRequest, Placement
from matrixpool.placement.snapshot import Snapshot

Fits = Callable[[Snapshot, GangRequest], Placement | None]


@dataclass(frozen=True)
class Plan:
    """Shrink these, evict those, and the gang is placed so."""

    shrink: Mapping[GangKey, int]  # gang → pods it keeps (its lowest ranks)
    evict: tuple[GangKey, ...]  # whole gangs evicted
    placement: Placement  # where the gang goes once they gave way
    taken: int  # cards taken from victims

    def cost(self) -> tuple[int, int, int, tuple[str, ...]]:
        """Fewest evictions, then fewest shrinks, then fewest cards taken (then by name)."""
        return len(self.evict), len(self.shrink), self.taken, self.placement.supernodes


def cheapest(
    sim: Snapshot, gang: GangRequest, victims: Sequence[GangRequest], fits: Fits
) -> Plan | None:
    """The cheapest plan that lets ``gang`` fit, or None (see the module doc for the phases)."""
    search = _Search(sim, gang, victims, fits)
    order = sorted(victims, key=lambda v: (v.priority, -sim.held_cards(v.gang), v.gang))
    # 1. shrink, 2. evict
    if not search.grow_shrinks(order) and not search.grow_evictions(order):
        return None
    # 3. prune
    search.prune_evictions()
    search.prune_shrinks()
    # 4. keep the most ranks
    search.widen_shrinks()
    # 5. verify
    return search.plan()


class _Search:
    """The plan under construction and the trials that test it."""

    def __init__(
        self, sim: Snapshot, gang: GangRequest, victims: Sequence[GangRequest], fits: Fits
    ) -> None:
        self.sim, self.gang, self.fits = sim, gang, fits
        self.victims = {v.gang: v for v in victims}
        self.shrink: dict[GangKey, int] = {}
        self.evict: list[GangKey] = []

    def grow_shrinks(self, order: Sequence[GangRequest]) -> bool:
        for v in order:
            floor = self.floor(v)
            if floor is not None:
                self.shrink[v.gang] = floor
                if self.trial():
                    return True
        return False

    def grow_evictions(self, order: Sequence[GangRequest]) -> bool:
        for v in order:
            self.evict.append(v.gang)
            self.shrink.pop(v.gang, None)
            if self.trial():
                return True
        return False

    def prune_evictions(self) -> None:
        for key in reversed(list(self.evict)):
            self.evict.remove(key)
            floor = self.floor(self.victims[key])
            if floor is not None:
                self.shrink[key] = floor
            if not self.trial():
                self.shrink.pop(key, None)
                self.evict.append(key)

    def prune_shrinks(self) -> None:
        for key in reversed(list(self.shrink)):
            keep = self.shrink.pop(key)
            if not self.trial():
                self.shrink[key] = keep

    def widen_shrinks(self) -> None:
        for key in list(self.shrink):
            low, high = self.shrink[key], self.held_pods(self.victims[key]) - 1
            while low < high:
                middle = (low + high + 1) // 2
                self.shrink[key] = middle
                if self.trial():
                    low = middle
                else:
                    high = middle - 1
            self.shrink[key] = low

    def plan(self) -> Plan | None:
        placement = self.trial()
        if placement is None:
            return None
        return Plan(dict(self.shrink), tuple(sorted(self.evict)), placement, self.taken())

    def floor(self, v: GangRequest) -> int | None:
        """Pods an elastic victim keeps at least, when shrinking it frees anything."""
        if v.min_pods is None or v.gang in self.evict:
            return None
        floor = max(v.min_pods, 0)
        return floor if self.held_pods(v) > floor else None

    def held_pods(self, v: GangRequest) -> int:
        """The rank just past the highest rank of ``v`` that holds cards."""
        held = self.sim.held.get(v.gang, {})
        return max((k + 1 for k, p in enumerate(v.pods) if p.pod in held), default=0)

    def trial(self) -> Placement | None:
        with self.sim.tentative():
            self.apply()
            return self.fits(self.sim, self.gang)

    def taken(self) -> int:
        before = sum(self.sim.held_cards(k) for k in self.victims)
        with self.sim.tentative():
            self.apply()
            return before - sum(self.sim.held_cards(k) for k in self.victims)

    def apply(self) -> None:
        for key in self.evict:
            self.sim.release(key)
        for key, keep in self.shrink.items():
            self.sim.release_pods(key, [p.pod for p in self.victims[key].pods[keep:]])
