"""The per-cycle capacity view of every supernode: which cards are free, kept incrementally.

Pure. The scheduler cycle builds one :class:`Snapshot` from the static topologies and the
holdings read from the API (:meth:`Snapshot.build`), asks the engine to place gangs on it and
commits each placement, so the next gang of the same cycle sees it. Like Kueue's TAS snapshot it
keeps the static tree (:class:`Layout`, shared by copies) apart from the capacity that changes.

The engine's own modules (``engine``, ``choose``, ``preemption``, ``firstfit``) read the index
attributes directly, for speed; everything else uses the methods. Indexes, all kept up to date
on every change so no gang scans the whole cluster:

- ``free[i]``: free usable cards of node ``i`` as a bitmask (0 for nodes never placed on:
  spares, NotReady nodes, nodes without usable cards);
- per rack (finest topology domain) and per supernode: free cards, the set of *empty* nodes
  (every usable card free) and of *partially used* nodes (some usable cards held, some free),
  and per rack the pods of each spread group it holds;
- per supernode a version, bumped on every change, that keys a capacity cache;
- ``used[i]``: what the pods held on node ``i`` request of the resources its room tracks.

What a pod asks of a node besides cards (:class:`~matrixpool.placement.nodefit.Needs`) is
filtered once per distinct value and cycle (:meth:`Layout.fit`); :meth:`Snapshot.restrict`
then takes away, inside a tentative change, the free cards of every node such a pod cannot go
to, and :meth:`Snapshot.placed` those of a node whose room one more pod would overrun — so
the engine's searches see only nodes the gang may use, at no cost for gangs that ask nothing
of nodes without taints.

Changes made inside :meth:`Snapshot.tentative` are journalled and undone when it ends: the
engine places a gang there and the gang either fits whole or leaves no trace (Volcano's
statement). Errors: :class:`StaleSnapshotError` (a ``ValueError``) when a commit names cards that
are not free or a node that cannot be placed on — a broken invariant, not "does not fit".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from matrixpool.placement import cards, inventory, nodefit, servable
from matrixpool.placement.inventory import NodeName
from matrixpool.placement.model import (
    Assignment,
    CardId,
    GangKey,
    Holding,
    NodeSlot,
    Placement,
    PodKey,
    SuperNodeTopology,
)

# (node index or -1, card mask, priority, spread group, requests besides cards)
Held = tuple[int, int, int, str | None, nodefit.Resources]
_Change = tuple[int, int, str | None, int]  # (node, free before, spread group, +1/-1 pods)
_HeldChange = tuple[GangKey, PodKey, Held | None]  # (gang, pod, what it held before)
_UsedChange = tuple[int, dict[str, int] | None]  # (node, its used resources before)
CORDONED = "cordoned"  # why a node is out, in reasons


class StaleSnapshotError(ValueError):
    """A commit does not match the snapshot (cards already taken, node not placeable)."""


@dataclass(frozen=True)
class Stats:
    """Card counts over the placeable nodes (spares and NotReady nodes excluded)."""

    usable: int  # healthy cards of Ready, non-spare nodes
    free: int  # of those, not held
    stranded: int  # free cards on partially used nodes
    partial_nodes: int  # nodes with some usable cards held and some free

    @property
    def held(self) -> int:
        return self.usable - self.free

    @property
    def utilization(self) -> float:
        """Held cards over usable cards."""
        return self.held / self.usable if self.usable else 0.0

    @property
    def fragmentation(self) -> float:
        """Stranded free cards over free cards: 0 when every free card is on an empty node."""
        return self.stranded / self.free if self.free else 0.0


@dataclass(frozen=True)
class Fit:
    """Which nodes a pod of one :class:`~matrixpool.placement.nodefit.Needs` may go to, as far
    as the static facts of the cycle tell (:meth:`Layout.fit`)."""

    why: dict[int, str] = field(default_factory=dict)  # node → why it is out (cordon, taint...)
    short: dict[int, list[str]] = field(default_factory=dict)  # node → resources its room lacks
    blocked: tuple[int, ...] = ()  # placeable nodes in ``why`` or ``short``


class Layout:
    """The static tree flattened into arrays indexed by node, rack and supernode number.

    Supernodes are in name order, nodes in each by (domains, name); ties between equally good
    choices go to the lowest index, so placements are deterministic.
    """

    def __init__(
        self, topologies: Sequence[SuperNodeTopology], spares: Mapping[str, tuple[NodeName, ...]]
    ) -> None:
        self.topologies = tuple(sorted(topologies, key=lambda t: t.name))
        self.sn_names = [t.name for t in self.topologies]  # supernode → name
        self.sn_index = {n: s for s, n in enumerate(self.sn_names)}  # name → supernode
        self.spares = {t.name: spares.get(t.name, ()) for t in self.topologies}
        self.names: list[NodeName] = []  # node → name
        self.index: dict[NodeName, int] = {}  # name → node
        self.node_sn: list[int] = []  # node → supernode
        self.node_rack: list[int] = []  # node → rack, -1 when never placed on
        self.usable: list[int] = []  # node → mask of healthy cards (0 when NotReady)
        self.fitters: list[cards.Fitter] = []  # node → its card-group fitter
        self.rack_nodes: list[tuple[int, ...]] = []  # rack → its placeable nodes
        self.rack_sn: list[int] = []  # rack → supernode
        self.rack_uniform: list[tuple[cards.Fitter, int] | None] = []  # (fitter, usable) shared
        self.sn_racks: list[tuple[int, ...]] = []  # supernode → its racks
        self.sn_nodes: list[range] = []  # supernode → its nodes
        self.slots: list[NodeSlot] = []  # node → its slot (labels, taints, cordon)
        self.room: list[dict[str, int] | None] = []  # node → resources left; None: not tracked
        self._fits: dict[nodefit.Needs, Fit] = {}
        for s, topology in enumerate(self.topologies):
            self._add_supernode(s, topology)
        self.summaries = servable.summaries(self.topologies)  # name → static summary
        self.any_summary = servable.merged(self.summaries.values())

    def _add_supernode(self, s: int, topology: SuperNodeTopology) -> None:
        spare = set(self.spares[topology.name])
        racks: dict[tuple[str, ...], list[int]] = {}
        start = len(self.names)
        for slot in sorted(topology.nodes, key=lambda n: (n.domains, n.name)):
            i = len(self.names)
            self.slots.append(slot)
            self.room.append(None if slot.room is None else dict(slot.room))
            full = (1 << slot.cards) - 1
            usable = full if slot.usable is None else cards.mask_of(slot.usable) & full
            self.names.append(slot.name)
            self.index[slot.name] = i
            self.node_sn.append(s)
            self.usable.append(usable)
            self.fitters.append(cards.fitter(cards.shape_of(slot.cards, slot.card_groups)))
            placeable = bool(usable) and slot.name not in spare
            self.node_rack.append(-1)
            if placeable:
                racks.setdefault(slot.domains, []).append(i)
        self.sn_nodes.append(range(start, len(self.names)))
        first = len(self.rack_nodes)
        for nodes in racks.values():
            for i in nodes:
                self.node_rack[i] = len(self.rack_nodes)
            self.rack_nodes.append(tuple(nodes))
            self.rack_sn.append(s)
            self.rack_uniform.append(self._uniform(nodes))
        self.sn_racks.append(tuple(range(first, len(self.rack_nodes))))

    def fit(self, needs: nodefit.Needs) -> Fit:
        """The static filters applied to every node, once per distinct ``needs`` (memoised)."""
        known = self._fits.get(needs)
        if known is None:
            known = self._fits[needs] = self._filter(needs)
        return known

    def _filter(self, needs: nodefit.Needs) -> Fit:
        why: dict[int, str] = {}
        short: dict[int, list[str]] = {}
        plain = needs == nodefit.NO_NEEDS
        for i, slot in enumerate(self.slots):
            reason = CORDONED if slot.cordoned else None
            if reason is None and (not plain or slot.taints):
                reason = needs.mismatch(slot.name, dict(slot.labels), slot.taints)
            room = self.room[i]
            if reason is not None:
                why[i] = reason
            elif needs.requests and room is not None:
                lacking = nodefit.short(needs.requests, room, {})
                if lacking:
                    short[i] = lacking
        placeable = sorted(i for i in (*why, *short) if self.node_rack[i] >= 0)
        return Fit(why, short, tuple(placeable))

    def _uniform(self, nodes: list[int]) -> tuple[cards.Fitter, int] | None:
        kinds = {(id(self.fitters[i]), self.usable[i]) for i in nodes}
        return (self.fitters[nodes[0]], self.usable[nodes[0]]) if len(kinds) == 1 else None


class Snapshot:
    """Free cards of every node, with the indexes the engine searches (see the module doc)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        racks, supernodes = len(layout.rack_nodes), len(layout.sn_names)
        placeable = zip(layout.usable, layout.node_rack, strict=True)
        self.free = [u if r >= 0 else 0 for u, r in placeable]
        self.rack_free = [sum(self.free[i].bit_count() for i in n) for n in layout.rack_nodes]
        self.rack_empty = [set(n) for n in layout.rack_nodes]  # every usable card free
        self.rack_partial: list[set[int]] = [set() for _ in range(racks)]
        self.rack_spread: list[dict[str, int]] = [{} for _ in range(racks)]  # group → pods
        self.sn_free = [sum(self.rack_free[r] for r in rs) for rs in layout.sn_racks]
        self.sn_partial: list[set[int]] = [set() for _ in range(supernodes)]
        self.sn_version = [0] * supernodes
        self.held: dict[GangKey, dict[PodKey, Held]] = {}
        self.leaving: dict[GangKey, set[PodKey]] = {}  # pods going away, their cards held
        self.used: dict[int, dict[str, int]] = {}  # node → requests held (never mutated: replaced)
        self._capacities: dict[tuple[int, int, int], tuple[int, int]] = {}
        self._rooms: dict[tuple[int, int], tuple[int, dict[int, int]]] = {}
        self._largest: dict[int, int] = {}  # pod size → largest_rack (the layout's, static)
        self._journal: list[_Change | _HeldChange | _UsedChange] = []
        self._depth = 0

    # ---- building and copying -------------------------------------------------------------

    @classmethod
    def build(
        cls, topologies: Sequence[SuperNodeTopology], holdings: Iterable[Holding]
    ) -> Snapshot:
        """1. spares by inventory's rule, 2. the static layout, 3. the holdings taken."""
        held = list(holdings)
        layout = Layout(topologies, _spares(topologies, held))
        snapshot = cls(layout)
        for h in held:
            node = layout.index.get(h.node, -1)
            held_as = (node, cards.mask_of(h.cards), h.priority, h.spread_group, h.requests)
            snapshot._hold(h.gang, h.pod, held_as)
            if h.leaving:
                snapshot.leaving.setdefault(h.gang, set()).add(h.pod)
        return snapshot

    def copy(self) -> Snapshot:
        """An independent snapshot with the same state (the layout is shared)."""
        other = Snapshot.__new__(Snapshot)
        other.layout = self.layout
        other.free = list(self.free)
        other.rack_free = list(self.rack_free)
        other.rack_empty = [set(s) for s in self.rack_empty]
        other.rack_partial = [set(s) for s in self.rack_partial]
        other.rack_spread = [dict(d) for d in self.rack_spread]
        other.sn_free = list(self.sn_free)
        other.sn_partial = [set(s) for s in self.sn_partial]
        other.sn_version = list(self.sn_version)
        other.held = {g: dict(p) for g, p in self.held.items()}
        other.leaving = {g: set(p) for g, p in self.leaving.items()}
        other.used = dict(self.used)
        other._capacities = dict(self._capacities)
        other._rooms = dict(self._rooms)
        other._largest = self._largest
        other._journal = []
        other._depth = 0
        return other

    # ---- questions ------------------------------------------------------------------------

    def spare_nodes(self, supernode: str) -> tuple[NodeName, ...]:
        """The whole nodes of ``supernode`` held back for recovery in this cycle."""
        return self.layout.spares.get(supernode, ())

    def free_cards(self, node: NodeName) -> frozenset[CardId]:
        """Cards of ``node`` that a normal placement may take (none on spares)."""
        i = self.layout.index.get(node)
        return frozenset(cards.cards_of(self.free[i])) if i is not None else frozenset()

    def supernode_free(self, supernode: str) -> int:
        """Free cards of ``supernode`` outside its spares."""
        s = self.layout.sn_index.get(supernode)
        return self.sn_free[s] if s is not None else 0

    def holdings(self) -> Iterator[Holding]:
        """Every holding, as :meth:`build` would take it back."""
        names = self.layout.names
        for gang, pods in sorted(self.held.items()):
            for pod, (i, mask, priority, spread, requests) in sorted(pods.items()):
                node = names[i] if i >= 0 else NodeName("")
                taken = frozenset(cards.cards_of(mask))
                leaving = pod in self.leaving.get(gang, ())
                yield Holding(pod, gang, node, taken, priority, spread, requests, leaving)

    def held_cards(self, gang: GangKey) -> int:
        return sum(held[1].bit_count() for held in self.held.get(gang, {}).values())

    def stats(self) -> Stats:
        """Utilization and fragmentation of the whole snapshot (scans every node)."""
        usable = free = stranded = 0
        for r, nodes in enumerate(self.layout.rack_nodes):
            usable += sum(self.layout.usable[i].bit_count() for i in nodes)
            free += self.rack_free[r]
            stranded += sum(self.free[i].bit_count() for i in self.rack_partial[r])
        partial = sum(len(p) for p in self.rack_partial)
        return Stats(usable=usable, free=free, stranded=stranded, partial_nodes=partial)

    def rack_capacity(self, r: int, size: int) -> int:
        """Pods of ``size`` cards that rack ``r`` still holds."""
        free, fitters = self.free, self.layout.fitters
        total = sum(fitters[i].capacity(free[i], size) for i in self.rack_partial[r])
        uniform = self.layout.rack_uniform[r]
        if uniform is not None:
            fitter, usable = uniform
            return total + len(self.rack_empty[r]) * fitter.capacity(usable, size)
        usables = self.layout.usable
        return total + sum(fitters[i].capacity(usables[i], size) for i in self.rack_empty[r])

    def rack_rooms(self, s: int, size: int) -> dict[int, int]:
        """Pods of ``size`` cards each rack of supernode ``s`` still holds (do not mutate)."""
        key = (s, size)
        version = self.sn_version[s]
        cached = self._rooms.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        rooms = {r: self.rack_capacity(r, size) for r in self.layout.sn_racks[s]}
        self._rooms[key] = (version, rooms)
        return rooms

    def largest_rack(self, size: int) -> int:
        """Pods of ``size`` cards the roomiest rack of the layout holds when empty (a floor on
        the racks a gang needs anywhere)."""
        found = self._largest.get(size)
        if found is None:
            layout = self.layout
            found = max(
                (
                    sum(layout.fitters[i].capacity(layout.usable[i], size) for i in nodes)
                    for nodes in layout.rack_nodes
                ),
                default=0,
            )
            self._largest[size] = found
        return found

    def capacity(self, s: int, size: int, group: int = 1) -> int:
        """Pods of ``size`` cards supernode ``s`` still holds, ``group`` of them per rack."""
        key = (s, size, group)
        version = self.sn_version[s]
        cached = self._capacities.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        pods = sum(self.rack_capacity(r, size) // group * group for r in self.layout.sn_racks[s])
        self._capacities[key] = (version, pods)
        return pods

    # ---- commit and release ---------------------------------------------------------------

    def commit(self, placement: Placement) -> None:
        """Record the placement's cards as held, so later gangs of the cycle see them.

        Pods that already hold exactly these cards (kept by :func:`engine.place`) stay as
        they are, even on a node that has since become unplaceable.
        """
        for a in placement.assignments:
            mask = cards.mask_of(a.cards)
            held = self.held.get(placement.gang, {}).get(a.pod)
            if held is not None and held[:2] == (self.layout.index.get(a.node, -1), mask):
                continue
            i = self._placeable(a)
            if held is not None:
                self._unhold(placement.gang, a.pod)
            if self.free[i] & mask != mask:
                raise StaleSnapshotError(f"cards {list(a.cards)} of node {a.node} are not free")
            held = (i, mask, placement.priority, placement.spread_group, placement.requests)
            self._hold(placement.gang, a.pod, held)

    def hold_free(self, placement: Placement) -> None:
        """Hold for ``placement``'s gang those of its cards that are free now. A gang waiting
        for the cards its preemption frees keeps what is already free from the lower
        priorities placed after it in the same cycle (kube-scheduler's nominated node):
        otherwise they take the cards freed first, the gang still does not fit once the rest
        is free, and preempts them in turn, round after round."""
        for a in placement.assignments:
            i = self.layout.index.get(a.node, -1)
            if i < 0 or a.pod in self.held.get(placement.gang, {}):
                continue
            mask = cards.mask_of(a.cards) & self.free[i]
            if mask:
                held = (i, mask, placement.priority, placement.spread_group, placement.requests)
                self._hold(placement.gang, a.pod, held)

    def release(self, gang: GangKey) -> None:
        """Give back every card ``gang`` holds (an eviction, simulated or real)."""
        self.release_pods(gang, list(self.held.get(gang, {})))

    def release_pods(self, gang: GangKey, pods: Iterable[PodKey]) -> None:
        """Give back the cards of some pods of ``gang`` (a shrink drops its highest ranks)."""
        for pod in pods:
            if pod in self.held.get(gang, {}):
                self._unhold(gang, pod)

    def kept(self, gang: GangKey) -> dict[PodKey, Assignment]:
        """Assignments of the pods of ``gang`` that already hold cards."""
        layout = self.layout
        return {
            pod: Assignment(
                pod, layout.names[i], cards.cards_of(mask), layout.sn_names[layout.node_sn[i]]
            )
            for pod, (i, mask, *_) in self.held.get(gang, {}).items()
            if i >= 0
        }

    def _placeable(self, a: Assignment) -> int:
        i = self.layout.index.get(a.node)
        if i is None or self.layout.node_rack[i] < 0:
            raise StaleSnapshotError(f"node {a.node} is not a placeable node of this snapshot")
        return i

    def _hold(self, gang: GangKey, pod: PodKey, held: Held) -> None:
        pods = self.held.setdefault(gang, {})
        if pod in pods:
            self._unhold(gang, pod)
        pods[pod] = held
        if self._depth:
            self._journal.append((gang, pod, None))
        i, mask, _, spread, requests = held
        if i >= 0:
            self.take(i, mask, spread)
            self._use(i, requests, 1)

    def _unhold(self, gang: GangKey, pod: PodKey) -> None:
        pods = self.held[gang]
        held = pods.pop(pod)
        if not pods:
            del self.held[gang]
        if self._depth:
            self._journal.append((gang, pod, held))
        i, mask, _, spread, requests = held
        if i >= 0:
            self.give(i, mask, spread)
            self._use(i, requests, -1)

    # ---- the hot path: one pod's cards taken or given back --------------------------------

    def take(self, i: int, mask: int, spread: str | None) -> None:
        """Node ``i`` loses the cards of ``mask`` to one pod (of ``spread``'s group)."""
        before = self.free[i]
        self._set(i, before, before & ~mask, spread, 1)

    def give(self, i: int, mask: int, spread: str | None) -> None:
        """Node ``i`` gets back the cards of ``mask`` from one pod."""
        before = self.free[i]
        self._set(i, before, before | (mask & self.layout.usable[i]), spread, -1)

    def _set(self, i: int, before: int, after: int, spread: str | None, pods: int) -> None:
        r = self.layout.node_rack[i]
        if r < 0:
            return
        if self._depth:
            self._journal.append((i, before, spread, pods))
        self.free[i] = after
        s = self.layout.rack_sn[r]
        delta = after.bit_count() - before.bit_count()
        self.rack_free[r] += delta
        self.sn_free[s] += delta
        self.sn_version[s] += 1
        usable = self.layout.usable[i]
        old = 0 if not before else 2 if before == usable else 1
        new = 0 if not after else 2 if after == usable else 1
        if old != new:
            self._reclassify(i, r, s, old, new)
        if spread is not None:
            counts = self.rack_spread[r]
            counts[spread] = counts.get(spread, 0) + pods

    def _reclassify(self, i: int, r: int, s: int, old: int, new: int) -> None:
        """Move node ``i`` between full (0), partially used (1) and empty (2)."""
        if old == 2:
            self.rack_empty[r].discard(i)
        elif old == 1:
            self.rack_partial[r].discard(i)
            self.sn_partial[s].discard(i)
        if new == 2:
            self.rack_empty[r].add(i)
        elif new == 1:
            self.rack_partial[r].add(i)
            self.sn_partial[s].add(i)

    # ---- what pods ask of nodes besides cards --------------------------------------------

    def restrict(self, needs: nodefit.Needs) -> None:
        """Inside :meth:`tentative`: take away the free cards of every node a pod of ``needs``
        cannot go to (filtered out, or without room for one more such pod)."""
        assert self._depth, "restrict only inside a tentative change"
        free = self.free
        for i in self.layout.fit(needs).blocked:
            if free[i]:
                self.take(i, free[i], None)
        if needs.requests:
            for i in list(self.used):
                if free[i] and self.lacking(i, needs.requests):
                    self.take(i, free[i], None)

    def placed(self, i: int, needs: nodefit.Needs) -> None:
        """A pod of ``needs`` went to node ``i``: count its requests, and take away the node's
        other free cards when no further such pod would fit."""
        if not needs.requests:
            return
        self._use(i, needs.requests, 1)
        if self.free[i] and self.lacking(i, needs.requests):
            self.take(i, self.free[i], None)

    def lacking(self, i: int, requests: nodefit.Resources) -> list[str]:
        """The resources of which node ``i`` has less left than ``requests``."""
        room = self.layout.room[i]
        if room is None or not requests:
            return []
        return nodefit.short(requests, room, self.used.get(i, {}))

    def _use(self, i: int, requests: nodefit.Resources, sign: int) -> None:
        room = self.layout.room[i]
        if room is None or not requests:
            return
        tracked = [(r, a) for r, a in requests if r in room]
        if not tracked:
            return
        before = self.used.get(i)
        after = dict(before or {})
        for r, a in tracked:
            after[r] = after.get(r, 0) + sign * a
        if self._depth:
            self._journal.append((i, before))
        self.used[i] = after

    # ---- tentative changes ----------------------------------------------------------------

    @contextmanager
    def tentative(self) -> Iterator[None]:
        """Everything changed inside is undone on exit (commit a placement afterwards)."""
        mark = self.mark()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self.undo(mark)

    def mark(self) -> int:
        return len(self._journal)

    def undo(self, mark: int) -> None:
        """Undo the journalled changes made since ``mark``, newest first."""
        depth, self._depth = self._depth, 0
        journal = self._journal
        while len(journal) > mark:
            change = journal.pop()
            if len(change) == 2:
                node, used = change
                if used is None:
                    self.used.pop(node, None)
                else:
                    self.used[node] = used
            elif len(change) == 4:
                i, before, spread, pods = change
                self._set(i, self.free[i], before, spread, -pods)
            else:
                gang, pod, held = change
                self._restore_held(gang, pod, held)
        self._depth = depth

    def _restore_held(self, gang: GangKey, pod: PodKey, held: Held | None) -> None:
        pods = self.held.setdefault(gang, {})
        if held is None:
            pods.pop(pod, None)
        else:
            pods[pod] = held
        if not pods:
            del self.held[gang]


def _spares(
    topologies: Sequence[SuperNodeTopology], holdings: Sequence[Holding]
) -> dict[str, tuple[NodeName, ...]]:
    """Spare nodes per supernode, chosen by :func:`inventory.choose_spares` itself so that
    SuperNode status and the engine agree (ready, fully healthy, idle, last in name order)."""
    allocated: dict[NodeName, int] = {}
    for h in holdings:
        allocated[h.node] = allocated.get(h.node, 0) + len(h.cards)
    spares: dict[str, tuple[NodeName, ...]] = {}
    for t in topologies:
        infos = sorted((_node_info(t, slot) for slot in t.nodes), key=lambda n: n.name)
        spares[t.name] = inventory.choose_spares(infos, t.card_resource, allocated, t.spares)
    return spares


def _node_info(topology: SuperNodeTopology, slot: NodeSlot) -> inventory.NodeInfo:
    usable = set(range(slot.cards)) if slot.usable is None else set(slot.usable)
    unhealthy = frozenset(c for c in range(slot.cards) if c not in usable)
    return inventory.NodeInfo(
        slot.name, {}, bool(usable), {topology.card_resource: slot.cards}, unhealthy
    )
