"""The cards of one node as a bitmask: which cards a pod takes, and how many such pods fit.

Pure. The snapshot (:mod:`matrixpool.placement.snapshot`) keeps each node's free cards as an
``int`` (bit ``k`` set = card ``k`` free) and asks a :class:`Fitter`, one per node shape, which
cards a pod of ``c`` cards should take. The rule it implements is DESIGN.md's card-group rule:

- a request no bigger than a card group stays inside one group, the group with the fewest free
  cards that still holds it (best fit), taking its lowest free card ids;
- a bigger request takes whole groups, all of whose cards are free (and healthy), so it must be
  a multiple of the group size; groups are taken in order.

A node without card groups is one group of all its cards. Answers are memoised per shape, so
the hot loops of the engine do one dict lookup per question.
"""

from __future__ import annotations

from collections.abc import Iterable

from matrixpool.placement.model import CardId

Shape = tuple[int, ...]  # the card-group masks of one node, covering all its cards

_CARDS_OF: dict[int, tuple[CardId, ...]] = {}
_MEMO_LIMIT = 1 << 18  # answers kept per shape before the memo starts over


def mask_of(cards: Iterable[int]) -> int:
    """The bitmask with the bits of ``cards`` set."""
    mask = 0
    for card in cards:
        mask |= 1 << card
    return mask


def cards_of(mask: int) -> tuple[CardId, ...]:
    """The card ids of ``mask``, ascending (memoised: masks repeat a lot)."""
    cards = _CARDS_OF.get(mask)
    if cards is None:
        cards = tuple(CardId(k) for k in range(mask.bit_length()) if mask >> k & 1)
        if len(_CARDS_OF) < 1 << 16:
            _CARDS_OF[mask] = cards
    return cards


def lowest(mask: int, count: int) -> int:
    """The ``count`` lowest set bits of ``mask`` (all of them if it has fewer)."""
    taken = 0
    for _ in range(count):
        bit = mask & -mask
        if not bit:
            break
        taken |= bit
        mask ^= bit
    return taken


def shape_of(cards: int, groups: Iterable[Iterable[int]]) -> Shape:
    """The group masks of a node of ``cards`` cards; card ids outside the node are dropped and
    cards no group names form one more group, so the groups always cover the node."""
    full = (1 << cards) - 1
    masks = [m for m in (mask_of(g) & full for g in groups) if m]
    covered = 0
    for mask in masks:
        covered |= mask
    if full & ~covered:
        masks.append(full & ~covered)
    return tuple(masks)


def fitter(shape: Shape) -> Fitter:
    """The shared :class:`Fitter` of ``shape`` (one per shape, so memos warm up once)."""
    found = _FITTERS.get(shape)
    if found is None:
        found = _FITTERS[shape] = Fitter(shape)
    return found


class Fitter:
    """Answers "which cards does a pod of ``c`` cards take here" for one node shape."""

    __slots__ = ("_caps", "_takes", "groups", "largest")

    def __init__(self, shape: Shape) -> None:
        self.groups = shape  # group masks
        self.largest = max((g.bit_count() for g in shape), default=0)  # biggest group's size
        self._takes: dict[int, int] = {}  # (free << 7 | c) → mask taken, 0 = does not fit
        self._caps: dict[int, int] = {}  # (free << 7 | c) → pods of c cards that fit

    def take(self, free: int, cards: int) -> int:
        """The cards a pod of ``cards`` cards takes from ``free``; 0 when it does not fit."""
        if not 0 < cards < 128:
            return self._choose(free, cards)  # outside the memo key's range
        key = free << 7 | cards
        mask = self._takes.get(key)
        if mask is None:
            if len(self._takes) >= _MEMO_LIMIT:
                self._takes.clear()
            mask = self._takes[key] = self._choose(free, cards)
        return mask

    def capacity(self, free: int, cards: int) -> int:
        """How many pods of ``cards`` cards fit into ``free`` one after another."""
        if not 0 < cards < 128:
            return self._count(free, cards)  # outside the memo key's range
        key = free << 7 | cards
        count = self._caps.get(key)
        if count is None:
            if len(self._caps) >= _MEMO_LIMIT:
                self._caps.clear()
            count = self._caps[key] = self._count(free, cards)
        return count

    def _count(self, free: int, cards: int) -> int:
        count = 0
        while mask := self.take(free, cards):
            free &= ~mask
            count += 1
        return count

    def _choose(self, free: int, cards: int) -> int:
        if cards <= 0:
            return 0
        if cards <= self.largest:
            return self._inside_one_group(free, cards)
        return self._whole_groups(free, cards)

    def _inside_one_group(self, free: int, cards: int) -> int:
        """Best fit: the group with the fewest free cards that still holds the request."""
        best, best_count = 0, 0
        for group in self.groups:
            here = free & group
            count = here.bit_count()
            if count >= cards and (not best or count < best_count):
                best, best_count = here, count
        return lowest(best, cards) if best else 0

    def _whole_groups(self, free: int, cards: int) -> int:
        """Wholly free groups, in order, adding up to exactly ``cards``."""
        taken, count = 0, 0
        for group in self.groups:
            if free & group == group:
                taken |= group
                count += group.bit_count()
                if count >= cards:
                    return taken if count == cards else 0
        return 0


_FITTERS: dict[Shape, Fitter] = {}
