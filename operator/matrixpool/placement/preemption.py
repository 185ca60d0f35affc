"""Which lower-priority gangs give way to a gang that does not fit: the plan that loses the least
work, inside the domain the gang goes to.

Pure. :func:`matrixpool.placement.engine.preempt` calls :func:`best` with a copy of the cycle's
snapshot, the requests of the gangs that hold cards and a ``fits`` callback (the engine's
``place``). Every trial releases cards inside ``Snapshot.tentative()``, so the copy is unchanged
afterwards. Each victim's request carries ``lost_work_per_card_s``: the seconds of work each of
its cards loses when it stops now (since its last committed checkpoint, or since it started;
the controller computes it from its clock, :mod:`matrixpool.controllers.scheduling.preemption`).

The rule (DESIGN.md: strictly lower priorities only; elastic jobs shrink before anyone is
evicted; issue 34: the least lost work wins, hard topology tiers kept), :data:`LEAST_LOST_WORK`:

- **Scopes** (:func:`scopes`): one per supernode that could hold the gang once its candidates
  (strictly lower priority, preemptible, holding cards there) gave way; for a gang whose
  ranks must all share one rack (``group_size`` ≥ its pods) also one per rack of it, with the
  candidates holding cards in that rack — so one whole gang in one rack can be chosen over
  pieces of several racks. A ``Preferred`` gang has one more scope: everything.
- **Searches** (:func:`cheapest`), one per victim order of the rule (:func:`by_priority`,
  :func:`by_lost_work_per_card`, :func:`by_lost_work`), each in phases:

  1. shrink elastic victims to their floor (``min_pods``, dropping their highest ranks) in
     order, until the gang fits;
  2. if that is not enough, evict victims in order until the gang fits;
  3. prune: give back every eviction, then every shrink, that the fit does not need, the
     last taken first — so the victim set is minimal (no victim can be spared);
  4. spare the victims none of whose freed pods is on a node the gang's placement takes: a
     victim outside the domain the gang ends up in (its rack, its supernode) keeps its pods;
  5. let each shrunk gang keep as many ranks as the fit allows (binary search);
  6. verify the final plan once more and keep the placement it gives.

- **Choice**: of all the plans of all scopes and orders, :meth:`Plan.least_lost_work`: a plan
  that only shrinks before one that evicts, then the least lost work (card-seconds: the cards
  each victim gives up × its ``lost_work_per_card_s``), then fewest evictions, shrinks, cards
  taken, then by supernode name.

:data:`SMALLEST_SET` is the rule before issue 34 (one order, lowest priority first; fewest
evictions wins; no rack scopes, no sparing outside the domain): kept as the reference the
property tests compare lost work with. Whatever the rule, an evicted gang loses all its pods,
a shrunk one keeps its lowest ranks (at least ``min_pods``), and the plan is verified by
``fits`` on the snapshot with the victims gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matrixpool.placement.model import Affinity, GangKey, GangRequest, Placement
from matrixpool.placement.snapshot import Snapshot

Fits = Callable[[Snapshot, GangRequest], Placement | None]
Order = Callable[[Snapshot, GangRequest], tuple[Any, ...]]  # sort key: victims taken first first


@dataclass(frozen=True)
class Plan:
    """Shrink these, evict those, and the gang is placed so."""

    shrink: Mapping[GangKey, int]  # gang → pods it keeps (its lowest ranks)
    evict: tuple[GangKey, ...]  # whole gangs evicted
    placement: Placement  # where the gang goes once they gave way
    taken: int  # cards taken from victims
    lost_work: float = 0.0  # card-seconds: cards each victim gives up × its lost work per card

    def fewest_victims(self) -> tuple[int, int, int, tuple[str, ...]]:
        """The smallest set: fewest evictions, then shrinks, then cards taken (then by name)."""
        return len(self.evict), len(self.shrink), self.taken, self.placement.supernodes

    def least_lost_work(self) -> tuple[bool, float, int, int, int, tuple[str, ...]]:
        """Shrinks only before any eviction, then the least lost work, then the smallest set."""
        return bool(self.evict), self.lost_work, *self.fewest_victims()


def by_priority(sim: Snapshot, v: GangRequest) -> tuple[Any, ...]:
    """The smallest set: lowest priority first, then the one holding the most cards."""
    return v.priority, -sim.held_cards(v.gang), v.gang


def by_lost_work_per_card(sim: Snapshot, v: GangRequest) -> tuple[Any, ...]:
    """The freshest checkpoint first (least work lost per card freed), then the most cards."""
    return v.lost_work_per_card_s, -sim.held_cards(v.gang), v.priority, v.gang


def by_lost_work(sim: Snapshot, v: GangRequest) -> tuple[Any, ...]:
    """The least work lost in all first (cards held × lost work per card)."""
    return sim.held_cards(v.gang) * v.lost_work_per_card_s, v.priority, v.gang


@dataclass(frozen=True)
class Rule:
    """A preemption policy: the victim orders searched and how the plans found compare."""

    name: str
    orders: tuple[Order, ...]  # one search per order
    cost: Callable[[Plan], tuple[Any, ...]]  # the cheapest plan wins
    local: bool  # rack scopes for a one-rack gang; victims outside its placement are spared


SMALLEST_SET = Rule("SmallestSet", (by_priority,), Plan.fewest_victims, local=False)
LEAST_LOST_WORK = Rule(
    "LeastLostWork",
    (by_priority, by_lost_work_per_card, by_lost_work),
    Plan.least_lost_work,
    local=True,
)


def best(
    sim: Snapshot,
    gang: GangRequest,
    victims: Mapping[GangKey, GangRequest],
    fits: Fits,
    rule: Rule = LEAST_LOST_WORK,
) -> Plan | None:
    """The cheapest plan by ``rule`` over every scope (see the module doc), or None."""
    plans = [
        plan
        for scoped, candidates in scopes(sim, gang, victims, rule.local)
        if (plan := cheapest(sim, scoped, candidates, fits, rule)) is not None
    ]
    return min(plans, key=rule.cost, default=None)


def cheapest(
    sim: Snapshot,
    gang: GangRequest,
    victims: Sequence[GangRequest],
    fits: Fits,
    rule: Rule = LEAST_LOST_WORK,
) -> Plan | None:
    """The cheapest plan of one scope by ``rule``, one search per distinct order, or None."""
    plans: list[Plan] = []
    searched: set[tuple[GangKey, ...]] = set()
    for order in rule.orders:
        ordered = sorted(victims, key=lambda v: order(sim, v))
        if (keys := tuple(v.gang for v in ordered)) not in searched:
            searched.add(keys)
            plan = _search(_Search(sim, gang, victims, fits), ordered, rule.local)
            plans += [plan] if plan is not None else []
    return min(plans, key=rule.cost, default=None)


def _search(search: _Search, ordered: Sequence[GangRequest], local: bool) -> Plan | None:
    # 1. shrink, 2. evict
    if not search.grow_shrinks(ordered) and not search.grow_evictions(ordered):
        return None
    # 3. prune
    search.prune_evictions()
    search.prune_shrinks()
    # 4. spare the victims outside the placement's domain
    if local:
        search.spare_outside()
    # 5. keep the most ranks
    search.widen_shrinks()
    # 6. verify
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

    def spare_outside(self) -> None:
        """Victims none of whose freed pods is on a node the placement takes keep their pods
        (a heuristic fit may need cards freed elsewhere to find its way: then they stay)."""
        placement = self.trial()
        while placement is not None:
            taken = {a.node for a in placement.assignments}
            outside = [k for k in (*self.evict, *self.shrink) if not self.freed_nodes(k) & taken]
            if not outside:
                return
            evict, shrink = list(self.evict), dict(self.shrink)
            self.evict = [k for k in self.evict if k not in outside]
            self.shrink = {k: keep for k, keep in self.shrink.items() if k not in outside}
            placement = self.trial()
            if placement is None:
                self.evict, self.shrink = evict, shrink

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
        given = self.given_up()
        lost = sum(cards * self.victims[k].lost_work_per_card_s for k, cards in given.items())
        shrink = dict(self.shrink)
        return Plan(shrink, tuple(sorted(self.evict)), placement, sum(given.values()), lost)

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

    def freed_nodes(self, key: GangKey) -> set[str]:
        """Names of the nodes where the plan frees cards of ``key``."""
        held = self.sim.held.get(key, {})
        if key in self.shrink:
            pods = [p.pod for p in self.victims[key].pods[self.shrink[key] :]]
        else:
            pods = list(held)
        names = self.sim.layout.names
        return {names[held[p][0]] for p in pods if p in held and held[p][0] >= 0}

    def trial(self) -> Placement | None:
        with self.sim.tentative():
            self.apply()
            return self.fits(self.sim, self.gang)

    def given_up(self) -> dict[GangKey, int]:
        """Cards each victim of the plan gives up."""
        before = {k: self.sim.held_cards(k) for k in (*self.evict, *self.shrink)}
        with self.sim.tentative():
            self.apply()
            return {k: cards - self.sim.held_cards(k) for k, cards in before.items()}

    def apply(self) -> None:
        for key in self.evict:
            self.sim.release(key)
        for key, keep in self.shrink.items():
            self.sim.release_pods(key, [p.pod for p in self.victims[key].pods[keep:]])


# ---- scopes ---------------------------------------------------------------------------------


def scopes(
    sim: Snapshot, gang: GangRequest, victims: Mapping[GangKey, GangRequest], local: bool
) -> Iterator[tuple[GangRequest, list[GangRequest]]]:
    """(gang as placed in the scope, its candidate victims): strictly lower priority,
    preemptible, holding cards in the scope; with ``local``, one scope per rack more for a
    gang whose ranks all share one rack."""
    layout = sim.layout
    candidates = [
        v
        for key, v in sorted(victims.items())
        if key != gang.gang
        and v.preemptible
        and v.priority < gang.priority
        and _held_below(sim, key, gang.priority)
    ]
    if gang.affinity is Affinity.PREFERRED:
        yield gang, candidates
    need = sum(p.cards for p in gang.pods)
    one_rack = local and gang.group_size is not None and gang.group_size >= len(gang.pods)
    names = [gang.supernode] if gang.supernode else layout.sn_names
    for name in names:
        s = layout.sn_index.get(name)
        if s is None:
            continue
        scoped = dataclasses.replace(gang, supernode=name)
        here = [v for v in candidates if _cards_in(sim, v.gang, s)]
        preferred = gang.affinity is Affinity.PREFERRED
        if not preferred and here and sim.sn_free[s] + _sum_in(sim, here, s) >= need:
            yield scoped, here
        for r in layout.sn_racks[s] if one_rack else ():
            rack = [v for v in here if _cards_in(sim, v.gang, s, r)]
            if rack and sim.rack_free[r] + _sum_in(sim, rack, s, r) >= need:
                yield scoped, rack


def _held_below(snap: Snapshot, gang: GangKey, priority: int) -> bool:
    pods = snap.held.get(gang, {})
    return bool(pods) and all(held[2] < priority for held in pods.values())


def _sum_in(snap: Snapshot, victims: Sequence[GangRequest], s: int, r: int | None = None) -> int:
    return sum(_cards_in(snap, v.gang, s, r) for v in victims)


def _cards_in(snap: Snapshot, gang: GangKey, s: int, r: int | None = None) -> int:
    """Usable cards ``gang`` holds in supernode ``s`` (in its rack ``r``, when given)."""
    layout = snap.layout
    return sum(
        (mask & layout.usable[i]).bit_count()
        for i, mask, *_ in snap.held.get(gang, {}).values()
        if i >= 0
        and layout.node_sn[i] == s
        and layout.node_rack[i] >= 0
        and (r is None or layout.node_rack[i] == r)
    )
