"""Expert-parallel load balancing: which experts get the redundant slots of an expert-parallel
instance and on which card each copy goes, from the tokens each expert took (its load).

Pure (no kopf, no Kubernetes client). Called by the experts controller
(:mod:`matrixpool.controllers.experts`), which measures the load and writes the plan's
:attr:`Plan.layout` into ``status.experts``, and by the scheduling cycle's expert map
(:func:`matrixpool.placement.gangs.expert_map`), which lays the layout over the bound cards.

A *layout* says, per slot, which expert it holds: slot ``s`` is the ``s``-th card of the
instance in rank order (pod by pod, each pod's cards in order; one expert per card, as the
contract has it), so ``cards_per_pod`` consecutive slots are one pod. A token routed to an
expert is split evenly between its copies, so a card's load is its expert's load over that
expert's copies, and a layout's *imbalance* is the max over the mean load per card (1.0: even).

The plan follows DeepSeek's EPLB (``deepseek-ai/EPLB``, ``replicate_experts`` and
``balanced_packing``):

1. replicate: every expert has one copy; each redundant slot goes, one at a time, to the expert
   with the highest load per copy (this minimizes the hottest card's load);
2. place: the copies, heaviest first, each to the pod with the least load that still has a
   free card — one that holds no copy of that expert yet when there is one — so the pods'
   loads are even too.

A service re-plans only when the map in force is :data:`REPLAN_RATIO` times worse than the plan
(:func:`worth_replanning`): a load that wobbles does not make the map flap.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

REPLAN_RATIO = 1.15  # re-plan when the map in force is this much more imbalanced than the plan


@dataclass(frozen=True)
class Plan:
    """A layout and what it does to a given load."""

    layout: tuple[int, ...]  # slot → expert it holds
    card_loads: tuple[float, ...]  # slot → its share of the load (its expert's over its copies)
    imbalance: float  # max/mean load per card
    pod_imbalance: float  # max/mean load per pod (cards_per_pod consecutive slots)


def default_layout(experts: int, slots: int) -> tuple[int, ...]:
    """The layout before any load is known: experts in slot order, then the redundant slots
    as copies of experts 0, 1, 2... (what :func:`matrixpool.placement.gangs.expert_map` wrote
    before load balancing)."""
    return tuple(i if i < experts else (i - experts) % experts for i in range(slots))


def valid(layout: Sequence[int] | None, experts: int, slots: int) -> bool:
    """Whether ``layout`` fits an instance of ``slots`` cards holding ``experts`` experts:
    one expert per slot, every expert at least once."""
    return layout is not None and len(layout) == slots and set(layout) == set(range(experts))


def evaluate(load: Sequence[float], layout: Sequence[int], cards_per_pod: int) -> Plan:
    """What ``layout`` does to ``load`` (expert → tokens)."""
    copies = Counter(layout)
    cards = tuple(load[e] / copies[e] for e in layout)
    pods = [sum(cards[i : i + cards_per_pod]) for i in range(0, len(cards), cards_per_pod)]
    return Plan(tuple(layout), cards, imbalance(cards), imbalance(pods))


def imbalance(loads: Sequence[float]) -> float:
    """Max over mean; 1.0 for no load at all (nothing is uneven)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


def plan(load: Sequence[float], slots: int, cards_per_pod: int) -> Plan:
    """The balanced plan for ``load`` (expert → tokens) on ``slots`` cards."""
    copies = replicate(load, slots)
    return evaluate(load, place(load, copies, cards_per_pod), cards_per_pod)


def replicate(load: Sequence[float], slots: int) -> list[int]:
    """Phase 1: copies per expert, the redundant slots given one by one to the expert with
    the highest load per copy (ties: the lower expert id)."""
    experts = len(load)
    if slots < experts:
        raise ValueError(f"{slots} slots cannot hold {experts} experts")
    copies = [1] * experts
    heap = [(-float(tokens), e) for e, tokens in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(slots - experts):
        _, expert = heapq.heappop(heap)
        copies[expert] += 1
        heapq.heappush(heap, (-load[expert] / copies[expert], expert))
    return copies


def place(load: Sequence[float], copies: Sequence[int], cards_per_pod: int) -> tuple[int, ...]:
    """Phase 2: the layout: copies heaviest first, each to the least-loaded pod with a free
    card, preferring a pod without that expert yet."""
    slots = sum(copies)
    if slots % cards_per_pod:
        raise ValueError(f"{slots} slots are not whole pods of {cards_per_pod} cards")
    pods: list[list[int]] = [[] for _ in range(slots // cards_per_pod)]
    open_pods = [(0.0, p) for p in range(len(pods))]  # (load, pod) of pods with a free card
    pieces = sorted(
        ((load[e] / n, e) for e, n in enumerate(copies) for _ in range(n)),
        key=lambda piece: (-piece[0], piece[1]),
    )
    for weight, expert in pieces:
        passed = []  # lighter pods that hold the expert already, lightest first
        while open_pods and expert in pods[open_pods[0][1]]:
            passed.append(heapq.heappop(open_pods))
        pod_load, chosen = heapq.heappop(open_pods) if open_pods else passed.pop(0)
        pods[chosen].append(expert)
        if len(pods[chosen]) < cards_per_pod:
            heapq.heappush(open_pods, (pod_load + weight, chosen))
        for entry in passed:
            heapq.heappush(open_pods, entry)
    return tuple(e for pod in pods for e in pod)


def worth_replanning(current: Plan, planned: Plan, ratio: float = REPLAN_RATIO) -> bool:
    """Whether the map in force is enough worse than the plan to be replaced (hysteresis)."""
    return current.imbalance > ratio * planned.imbalance


def hottest(load: Sequence[float], count: int) -> list[int]:
    """The ``count`` experts with the most load, hottest first (ties: the lower id)."""
    ranked = sorted(range(len(load)), key=lambda e: (-load[e], e))
    return [e for e in ranked[:count] if load[e] > 0]
