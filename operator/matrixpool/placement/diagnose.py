"""Why the nodes of a scope do not take a pod of a gang, node by node — kube-scheduler's
FailedScheduling message ("0/48 nodes are available: 40 Insufficient cpu, ...") for gangs.

Pure. :func:`matrixpool.placement.engine.place` asks :func:`tally` when a gang did not fit and
something besides cards may have kept nodes out: a filter of
:mod:`matrixpool.placement.nodefit`, a cordon, or a lack of room. Each node counts once, for
the first thing that keeps it out, in kube-scheduler's order: cordoned, nodeSelector, node
affinity, taints (all static, :meth:`Layout.fit`), then not ready or held back as a spare, then
each resource it lacks (a node lacking two counts for both, as kube-scheduler counts them),
then too few free cards. :meth:`Tally.code` names the reason: the constraint that kept out
the most nodes (the earlier filter on a tie), unless nodes without free cards are more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from matrixpool.placement import nodefit
from matrixpool.placement.snapshot import CORDONED, Snapshot

INSUFFICIENT_RESOURCES = "InsufficientResources"  # nodes lack cpu, memory or another resource
UNTOLERATED_TAINT = "UntoleratedTaint"  # nodes carry a taint the pods do not tolerate
NODE_SELECTOR_MISMATCH = "NodeSelectorMismatch"  # nodes lack the template's nodeSelector labels
NODE_AFFINITY_MISMATCH = "NodeAffinityMismatch"  # nodes match no required node affinity term
NODES_CORDONED = "NodesCordoned"  # nodes are cordoned (spec.unschedulable)

_FIRST = (  # kube-scheduler's filter order: ties go to the earlier filter
    NODES_CORDONED,
    NODE_SELECTOR_MISMATCH,
    NODE_AFFINITY_MISMATCH,
    UNTOLERATED_TAINT,
    INSUFFICIENT_RESOURCES,
)
NOT_READY = "not ready or without usable cards"
SPARE = "held back as spare"
FEW_CARDS = "without enough free cards"
_INSUFFICIENT = "with insufficient "


@dataclass(frozen=True)
class Tally:
    """Nodes of a scope by what keeps them from taking one pod of the gang."""

    total: int  # nodes in the scope
    fitting: int  # nodes that take one pod now
    counts: Counter[str]  # why (a phrase) → nodes

    def code(self) -> str | None:
        """The code of the most frequent constraint, or None when there is none or nodes
        without enough free cards are more (the cards reason then stands)."""
        codes = Counter[str]()
        for why, count in self.counts.items():
            code = _code(why)
            if code is not None:
                codes[code] = max(codes[code], count)
        if not codes:
            return None
        count, _, code = max((n, -_FIRST.index(c), c) for c, n in codes.items())
        return None if self.counts.get(FEW_CARDS, 0) > count else code

    def constrained(self) -> bool:
        return any(_code(w) is not None for w in self.counts)

    def summary(self) -> str:
        """``3/48 nodes can take a pod: 40 node(s) with insufficient cpu, ...``."""
        parts = ", ".join(f"{n} node(s) {w}" for w, n in sorted(self.counts.items(), key=_order))
        return f"{self.fitting}/{self.total} nodes can take a pod: {parts}"


def tally(snap: Snapshot, needs: nodefit.Needs, size: int, supernodes: Iterable[int]) -> Tally:
    """Why each node of ``supernodes`` does or does not take a pod of ``size`` cards now."""
    layout = snap.layout
    fit = layout.fit(needs)
    counts: Counter[str] = Counter()
    total = fitting = 0
    for s in supernodes:
        spares = set(layout.spares.get(layout.sn_names[s], ()))
        for i in layout.sn_nodes[s]:
            total += 1
            if i in fit.why:
                counts[fit.why[i]] += 1
            elif layout.node_rack[i] < 0:
                counts[SPARE if layout.names[i] in spares else NOT_READY] += 1
            elif lacking := fit.short.get(i) or snap.lacking(i, needs.requests):
                counts.update(_INSUFFICIENT + r for r in lacking)
            elif not layout.fitters[i].take(snap.free[i], size):
                counts[FEW_CARDS] += 1
            else:
                fitting += 1
    return Tally(total, fitting, counts)


def _code(why: str) -> str | None:
    if why == CORDONED:
        return NODES_CORDONED
    if why == nodefit.SELECTOR_MISMATCH:
        return NODE_SELECTOR_MISMATCH
    if why == nodefit.AFFINITY_MISMATCH:
        return NODE_AFFINITY_MISMATCH
    if why.startswith("had untolerated taint"):
        return UNTOLERATED_TAINT
    if why.startswith(_INSUFFICIENT):
        return INSUFFICIENT_RESOURCES
    return None


def _order(item: tuple[str, int]) -> tuple[int, str]:
    """Most nodes first, then by phrase."""
    why, count = item
    return -count, why
