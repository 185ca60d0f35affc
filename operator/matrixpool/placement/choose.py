"""Where the pods of a gang go inside one supernode: which rack, which node, which cards.

Pure. :func:`matrixpool.placement.engine.place` calls :func:`place_pods` on a snapshot inside
``Snapshot.tentative()``; it places pods in rank order, taking their cards as it goes so later
pods see earlier ones, and returns how many it placed (a prefix made of whole rank groups). The
engine discards whatever a failed attempt did.

**Fragmentation**, precisely: the *stranded* cards of a snapshot are the free cards on partially
used nodes (placeable nodes with at least one usable card held and at least one free). Taking
``c`` cards from a partially used node changes the stranded count by ``-c``; breaking an empty
node of ``u`` usable cards changes it by ``u - c``. Every choice here minimises, in order:

1. that change (partially used nodes are filled before an empty node is broken, and a pod as
   big as a node takes an empty node; of empty nodes, the smallest that holds the pod);
2. the free cards left on the node (best fit);
3. the empty nodes of the rack (a rack that is already broken is used before a whole one);
4. the index (deterministic answers).

**Locality** comes before fragmentation for a gang of more than one pod: it goes into the
fewest racks that can hold it (:func:`fewest_racks`, from each rack's capacity for the gang's
pod size, as Kueue's TAS BestFit: the roomiest racks until the rest fits one more, and that
last one the rack with the least room that holds the rest), and its ranks fill those racks one
after another in rank order, so consecutive ranks are neighbours on the fabric and a ring
crosses a rack boundary as few times as the racks allow. Inside each rack the order above
chooses the nodes; a pod that the chosen racks turn out not to hold (pods of mixed sizes, card
groups) falls back to the whole supernode. Among rack sets of the same count the fragmentation
rules decide: racks with less room first (a broken rack before a whole one), so whole racks
stay whole for the next big gang.

Inside a node, :class:`matrixpool.placement.cards.Fitter` keeps a request no bigger than a card
group inside one group. Inference replicas (``spread_group``) spread: a replica of one pod
picks the rack holding the fewest pods of its role, then applies the order above; a replica of
several pods goes into the fewest of the racks holding the fewest pods of its role that hold it
(its pods together, its replicas apart). ``group_size`` ranks share one rack:
the rack that still holds them with the least room to spare. Nodes a pod of the gang may not
go to (``Snapshot.restrict``) show no free cards here.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from matrixpool.placement import cards
from matrixpool.placement.model import Assignment, GangRequest, PodRequest
from matrixpool.placement.snapshot import Snapshot

Hit = tuple[int, int]  # (node, card mask)


def place_pods(
    snap: Snapshot, s: int, pods: Sequence[PodRequest], gang: GangRequest, out: list[Assignment]
) -> int:
    """Place ``pods`` in supernode ``s``, appending to ``out``; returns how many were placed."""
    if gang.group_size and gang.group_size > 1:
        return _by_rank_groups(snap, s, pods, gang, out)
    spread = gang.spread_group
    if len(pods) > 1:
        return _by_fewest_racks(snap, s, pods, gang, out)
    for placed, pod in enumerate(pods):
        hit = _spread_choice(snap, s, pod.cards, spread) if spread else _choice(snap, s, pod.cards)
        if hit is None:
            return placed
        _put(snap, hit, pod, gang, out)
    return len(pods)


def fewest_domains(rooms: dict[int, int], pods: int) -> list[int] | None:
    """The fewest domains (racks, supernodes) whose ``rooms`` (pods each still holds) hold
    ``pods``: the roomiest first (of equal room the lower index) until the rest fits one more,
    then of those that hold the rest the one with the least room (best fit), last. None when all
    of them together are short."""
    order: list[int] = []
    pool = sorted(((room, d) for d, room in rooms.items() if room > 0), key=lambda x: (-x[0], x[1]))
    while pods > 0:
        holding = [(room, d) for room, d in pool if room >= pods]
        if holding:
            return [*order, min(holding)[1]]
        if not pool:
            return None
        room, d = pool.pop(0)
        order.append(d)
        pods -= room
    return order


def fewest_racks(rooms: dict[int, int], pods: int) -> list[int] | None:
    """:func:`fewest_domains` over racks, in the order to fill them: the best fit first, so a
    broken rack is used up before a whole one is broken."""
    found = fewest_domains(rooms, pods)
    return found[-1:] + found[:-1] if found else found


def racks_needed(snap: Snapshot, s: int, pods: Sequence[PodRequest]) -> int:
    """How many racks of supernode ``s`` the pods need at the fewest (a large number when the
    racks together are short): the supernodes' order of preference for a gang."""
    rooms = snap.rack_rooms(s, max(p.cards for p in pods))
    found = fewest_racks(rooms, len(pods))
    return len(found) if found is not None else len(rooms) + 1


def _by_fewest_racks(
    snap: Snapshot, s: int, pods: Sequence[PodRequest], gang: GangRequest, out: list[Assignment]
) -> int:
    """Ranks fill the fewest racks one after another; a pod they do not hold goes anywhere in
    the supernode (rules 1-4, or the spread rule for a replica). A replica of an inference role
    (``spread_group``) takes the fewest of the racks holding the fewest pods of its role that
    hold it whole, so its replicas spread across racks while its own pods stay together."""
    rooms = snap.rack_rooms(s, max(p.cards for p in pods))
    spread = gang.spread_group
    racks: list[int] = []
    if spread:
        counts = {r: snap.rack_spread[r].get(spread, 0) for r in rooms}
        for level in sorted(set(counts.values())):
            allowed = {r: room for r, room in rooms.items() if counts[r] <= level}
            racks = fewest_racks(allowed, len(pods)) or []
            if racks:
                break
    else:
        racks = fewest_racks(rooms, len(pods)) or []
    at = 0
    for placed, pod in enumerate(pods):
        hit: Hit | None = None
        while at < len(racks) and hit is None:
            r = racks[at]
            hit = _best_partial(snap, snap.rack_partial[r], pod.cards) or _best_empty(
                snap, (r,), pod.cards
            )
            if hit is None:
                at += 1
        if hit is None:
            hit = (
                _spread_choice(snap, s, pod.cards, spread)
                if spread
                else _choice(snap, s, pod.cards)
            )
        if hit is None:
            return placed
        _put(snap, hit, pod, gang, out)
    return len(pods)


def _choice(snap: Snapshot, s: int, size: int) -> Hit | None:
    """The best node of the whole supernode (rules 1-4 of the module doc)."""
    return _best_partial(snap, snap.sn_partial[s], size) or _best_empty(
        snap, snap.layout.sn_racks[s], size
    )


def _spread_choice(snap: Snapshot, s: int, size: int, spread: str) -> Hit | None:
    """The rack with the fewest pods of ``spread`` that holds the pod, then rules 1-4."""
    best: Hit | None = None
    best_key: tuple[int, int, int, int, int] | None = None
    for r in snap.layout.sn_racks[s]:
        if snap.rack_free[r] < size:
            continue
        count = snap.rack_spread[r].get(spread, 0)
        if best_key is not None and count > best_key[0]:
            continue
        hit, key = _in_rack(snap, r, size)
        if hit is not None and (best_key is None or (count, *key) < best_key):
            best, best_key = hit, (count, *key)
    return best


def _in_rack(snap: Snapshot, r: int, size: int) -> tuple[Hit | None, tuple[int, int, int, int]]:
    """The best node of rack ``r`` and its sort key (change, free left, empty nodes, rack)."""
    hit = _best_partial(snap, snap.rack_partial[r], size)
    if hit is not None:
        return hit, (-size, snap.free[hit[0]].bit_count(), 0, r)
    hit = _best_empty(snap, (r,), size)
    if hit is not None:
        grown = snap.layout.usable[hit[0]].bit_count() - size
        return hit, (grown, 0, len(snap.rack_empty[r]), r)
    return None, (0, 0, 0, r)


def _best_partial(snap: Snapshot, nodes: Collection[int], size: int) -> Hit | None:
    """Best fit among partially used ``nodes``: the fewest free cards that hold the pod."""
    if not nodes:
        return None
    free, fitters = snap.free, snap.layout.fitters
    best: Hit | None = None
    best_key = (0, 0)
    for i in nodes:
        mask = fitters[i].take(free[i], size)
        if mask:
            key = (free[i].bit_count(), i)
            if best is None or key < best_key:
                best, best_key = (i, mask), key
    return best


def _best_empty(snap: Snapshot, racks: Sequence[int], size: int) -> Hit | None:
    """An empty node: the smallest that holds the pod, in the rack with the fewest empty nodes."""
    best: Hit | None = None
    best_key = (0, 0, 0)
    for r in racks:
        empty = snap.rack_empty[r]
        if not empty:
            continue
        hit = _empty_in_rack(snap, r, empty, size)
        if hit is not None:
            key = (snap.layout.usable[hit[0]].bit_count(), len(empty), r)
            if best is None or key < best_key:
                best, best_key = hit, key
    return best


def _empty_in_rack(snap: Snapshot, r: int, empty: set[int], size: int) -> Hit | None:
    uniform = snap.layout.rack_uniform[r]
    if uniform is not None:
        mask = uniform[0].take(uniform[1], size)
        return (min(empty), mask) if mask else None
    usable, fitters = snap.layout.usable, snap.layout.fitters
    fits = [(usable[i].bit_count(), i) for i in empty if fitters[i].take(usable[i], size)]
    if not fits:
        return None
    i = min(fits)[1]
    return i, fitters[i].take(usable[i], size)


def _by_rank_groups(
    snap: Snapshot, s: int, pods: Sequence[PodRequest], gang: GangRequest, out: list[Assignment]
) -> int:
    """Consecutive ``group_size`` ranks share one rack; a group that fails is undone whole."""
    group = gang.group_size or 1
    for start in range(0, len(pods), group):
        chunk = pods[start : start + group]
        r = _rack_for(snap, s, chunk, gang.spread_group)
        if r is None or not _fill_rack(snap, r, chunk, gang, out):
            return start
    return len(pods)


def _rack_for(
    snap: Snapshot, s: int, chunk: Sequence[PodRequest], spread: str | None
) -> int | None:
    """The rack with the fewest pods of ``spread``, then the least room left after the chunk."""
    size = max(p.cards for p in chunk)
    need = len(chunk)
    best: int | None = None
    best_key = (0, 0, 0)
    for r in snap.layout.sn_racks[s]:
        if snap.rack_free[r] < size * need:
            continue
        room = snap.rack_capacity(r, size)
        if room < need:
            continue
        count = snap.rack_spread[r].get(spread, 0) if spread else 0
        key = (count, room - need, r)
        if best is None or key < best_key:
            best, best_key = r, key
    return best


def _fill_rack(
    snap: Snapshot,
    r: int,
    chunk: Sequence[PodRequest],
    gang: GangRequest,
    out: list[Assignment],
) -> bool:
    mark, length = snap.mark(), len(out)
    for pod in chunk:
        hit = _best_partial(snap, snap.rack_partial[r], pod.cards) or _best_empty(
            snap, (r,), pod.cards
        )
        if hit is None:
            snap.undo(mark)
            del out[length:]
            return False
        _put(snap, hit, pod, gang, out)
    return True


def _put(
    snap: Snapshot, hit: Hit, pod: PodRequest, gang: GangRequest, out: list[Assignment]
) -> None:
    i, mask = hit
    snap.take(i, mask, gang.spread_group)
    snap.placed(i, gang.needs)
    layout = snap.layout
    out.append(
        Assignment(
            pod.pod, layout.names[i], cards.cards_of(mask), layout.sn_names[layout.node_sn[i]]
        )
    )
