"""The fault trace of a run: when each component fails, which nodes it takes, and for how long.

Called once per run by :mod:`.run`; every policy replays the same trace. Seeded: one
``random.Random`` per component, so adding a component leaves the others' faults unchanged.

Rules (the model; the rates come from the YAML file, the Llama 3 breakdown by default):
1. Each component fails as a Poisson process whose rate is its ``count`` per reference
   card-hours times the cluster's cards (a bigger pool fails proportionally more often).
2. A card fault hits one card chosen uniformly; a node, network or software fault one node; a
   rack fault every node of one rack at once (the correlated failure).
3. Card, node and rack faults take what they hit out of service for ``repair_hours``; network
   and software faults are transient (the ranks restart, the node stays).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from matrixpool.simulate import model

TRANSIENT = frozenset({"network", "software"})  # the node stays in service


@dataclass(frozen=True, order=True)
class FaultEvent:
    """One fault of the trace."""

    at: float  # seconds from the start of the run
    component: str  # one of model.COMPONENTS
    nodes: tuple[int, ...]  # global node indexes hit (one, or a rack's)
    card: int | None  # a card fault: the card's index on its node
    repair_seconds: float  # out of service this long; 0 for a transient fault


def trace(config: model.Config) -> list[FaultEvent]:
    """Every random fault of the run, in time order (scripted ones are added by the run)."""
    events: list[FaultEvent] = []
    for component in model.COMPONENTS:
        events.extend(_component(config, component))
    return sorted(events)


def _component(config: model.Config, component: str) -> list[FaultEvent]:
    """Rule 1: exponential gaps at the component's cluster-wide rate."""
    cluster, failures = config.cluster, config.failures
    rate = failures.per_card_hour(component) * cluster.cards / 3600.0  # per second
    if rate <= 0:
        return []
    part = failures.components[component]
    repair = 0.0 if component in TRANSIENT else part.repair_hours * 3600.0
    rng = random.Random(f"{config.seed}/{component}")
    events, at = [], rng.expovariate(rate)
    while at < config.horizon_seconds:
        nodes, card = _hit(cluster, component, rng)
        events.append(FaultEvent(at, component, nodes, card, repair))
        at += rng.expovariate(rate)
    return events


def _hit(
    cluster: model.Cluster, component: str, rng: random.Random
) -> tuple[tuple[int, ...], int | None]:
    """Rule 2: what the fault hits."""
    nodes = cluster.supernodes * cluster.nodes_per_supernode
    if component == "card":
        card = rng.randrange(nodes * cluster.cards_per_node)
        return (card // cluster.cards_per_node,), card % cluster.cards_per_node
    if component == "rack":
        node = rng.randrange(nodes)
        per_sn, per_rack = cluster.nodes_per_supernode, cluster.nodes_per_rack
        first = node // per_sn * per_sn + node % per_sn // per_rack * per_rack
        last = min(first + per_rack, node // per_sn * per_sn + per_sn)
        return tuple(range(first, last)), None
    return (rng.randrange(nodes),), None


def scripted(config: model.Config, fault: model.ScriptedFault, node: int) -> FaultEvent:
    """A scripted fault on global node ``node`` (the run resolves a headline rank's node)."""
    part = config.failures.components.get(fault.component)
    repair = 0.0 if fault.component in TRANSIENT or part is None else part.repair_hours * 3600
    card = 0 if fault.component == "card" else None
    nodes: tuple[int, ...] = (node,)
    if fault.component == "rack":
        per_rack = config.cluster.nodes_per_rack
        first = node - node % config.cluster.nodes_per_supernode % per_rack
        nodes = tuple(range(first, first + per_rack))
    return FaultEvent(fault.at_hours * 3600.0, fault.component, nodes, card, repair)
