"""The experts of the simulated inference server: which expert the gate sends each token to,
how the expert map in force spreads that over the instance's cards, and the counter the
operator reads back.

Called by :mod:`matrixpool.serving.server` (it counts the tokens of every finished request
into :data:`EXPERT_TOKENS` and :data:`SLOT_TOKENS`), by :mod:`matrixpool.serving.__main__`
(flags) and by the operator's experts controller (:mod:`matrixpool.controllers.experts`), which
reads the counter with :func:`tokens_per_expert`. Pure but for :class:`MapFile`, which reads
one file.

- The gate (:class:`Router`) is a skewed, deterministic stand-in for a MoE router: expert
  ``e`` gets the share :func:`zipf_shares` gives it (a Zipf law of exponent ``skew`` over the
  experts in an order drawn from ``seed``; skew 0 is even) of ``top_k`` routed tokens per
  token, counted in whole tokens (the fractions carry over to the next request).
- The map (:class:`MapFile`) is the instance's file of the service's expert-map ConfigMap, as
  the operator mounts it (``MATRIXPOOL_EXPERT_MAP_FILE``): a JSON list of ``{"expert": slot,
  "copyOf": expert, "pod", "card"}``. It is read again when it changes (the kubelet rewrites
  the file; the pod is not restarted), at most every :data:`RELOAD_SECONDS`.
- A card's load (:data:`SLOT_TOKENS`, by slot) is its expert's tokens split evenly between
  that expert's copies in the map, so it follows the map.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

EXPERT_TOKENS = "matrixpool_serving_expert_tokens_total"  # by label expert: the operator's input
SLOT_TOKENS = "matrixpool_serving_expert_slot_tokens_total"  # by label slot: a card's load
RELOAD_SECONDS = 1.0  # the map file is looked at again at most this often
DEFAULT_TOP_K = 8  # routed experts per token (DeepSeek-V3's 8 of 256)


def zipf_shares(experts: int, skew: float, seed: int = 0) -> tuple[float, ...]:
    """Expert → its share of the routed tokens: the ``r``-th hottest gets a share in
    proportion to ``1 / r**skew``; which expert is ``r``-th comes from ``seed``."""
    weights = [1.0 / (rank + 1) ** skew for rank in range(experts)]
    order = list(range(experts))
    random.Random(seed).shuffle(order)
    total = sum(weights)
    shares = [0.0] * experts
    for rank, expert in enumerate(order):
        shares[expert] = weights[rank] / total
    return tuple(shares)


def _whole(carry: list[float], index: int, amount: float) -> int:
    """``amount`` plus what ``index`` carried, as whole tokens; the fraction is carried on."""
    total = carry[index] + amount
    whole = int(total + 1e-9)  # 3 × 2/3 is 2 tokens, not 1.999…
    carry[index] = total - whole
    return whole


class Router:
    """The gate: tokens to routed tokens per expert, deterministically."""

    def __init__(self, shares: Sequence[float], top_k: int) -> None:
        self.shares = tuple(shares)
        self.top_k = top_k
        self._carry = [0.0] * len(self.shares)

    def route(self, tokens: int) -> list[int]:
        """Expert → tokens routed to it out of ``tokens`` more tokens."""
        return [
            _whole(self._carry, e, tokens * self.top_k * share)
            for e, share in enumerate(self.shares)
        ]


def read_layout(text: str, experts: int) -> tuple[int, ...] | None:
    """Slot → expert of an expert map's file; None when it is not one for ``experts``."""
    try:
        entries = json.loads(text)
        pairs = sorted((int(e["expert"]), int(e["copyOf"])) for e in entries)
    except (ValueError, TypeError, KeyError):
        return None
    layout = tuple(expert for _, expert in pairs)
    slots_in_order = [slot for slot, _ in pairs] == list(range(len(pairs)))
    return layout if slots_in_order and set(layout) == set(range(experts)) else None


class MapFile:
    """The instance's expert map as the kubelet keeps it current: the last good layout."""

    def __init__(self, path: Path | None, experts: int) -> None:
        self.path, self.experts = path, experts
        self.layout: tuple[int, ...] | None = None
        self._text: str | None = None
        self._next_look = float("-inf")

    def poll(self, now: float) -> bool:
        """Read the file again if due; whether the layout changed."""
        if self.path is None or now < self._next_look:
            return False
        self._next_look = now + RELOAD_SECONDS
        try:
            text = self.path.read_text()
        except OSError:  # not written yet (an optional ConfigMap): keep what there is
            return False
        if text == self._text:
            return False
        self._text = text
        layout = read_layout(text, self.experts)
        if layout is None or layout == self.layout:
            return False
        self.layout = layout
        return True


class Experts:
    """One instance's experts: the gate, the map in force and the split over its cards."""

    def __init__(self, router: Router, map_file: MapFile) -> None:
        self.router, self.map_file = router, map_file
        self._slots: dict[int, list[int]] = {}  # expert → its slots in the map
        self._carry: list[float] = []

    @property
    def count(self) -> int:
        return len(self.router.shares)

    def poll(self, now: float) -> bool:
        """Follow the map file; whether a new layout is in force."""
        if not self.map_file.poll(now):
            return False
        layout = self.map_file.layout or ()
        self._slots = {}
        for slot, expert in enumerate(layout):
            self._slots.setdefault(expert, []).append(slot)
        self._carry = [0.0] * len(layout)
        return True

    def route(self, tokens: int) -> tuple[list[int], Counter[int]]:
        """Routed tokens per expert, and per slot of the map (none before a map is read)."""
        per_expert = self.router.route(tokens)
        per_slot: Counter[int] = Counter()
        for expert, routed in enumerate(per_expert):
            slots = self._slots.get(expert, ())
            for slot in slots:
                per_slot[slot] += _whole(self._carry, slot, routed / len(slots))
        return per_expert, per_slot


def tokens_per_expert(text: str) -> dict[int, float]:
    """Expert → the value of :data:`EXPERT_TOKENS` in a ``/metrics`` text, summed over its
    other labels; empty when the text has none (or is no Prometheus text)."""
    found: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                expert = sample.labels.get("expert")
                if sample.name == EXPERT_TOKENS and expert is not None and expert.isdigit():
                    found[int(expert)] = found.get(int(expert), 0.0) + sample.value
    except ValueError:
        return {}
    return found
