"""The recovery controller's decide step (:mod:`matrixpool.controllers.recovery.decide`): how
the daemons' holdings become the policy's copies."""

from __future__ import annotations

from matrixpool.controllers.recovery import decide
from matrixpool_recovery import manifest, policy


def test_holdings_become_copies_by_who_holds_them() -> None:
    view = policy.JobView(
        key="ns/llm",
        world_size=2,
        node_of={0: policy.NodeName("n0"), 1: policy.NodeName("n1")},
        cards_of={0: frozenset(), 1: frozenset()},
        rack_of={},
        supernode_of={},
    )
    held = [
        manifest.Holding("ns.llm", 0, 4, "memory", 1, "c", "n0", "n0"),  # its own node
        manifest.Holding("ns.llm", 1, 4, "memory", 1, "c", "n0", "n1"),  # a peer's copy
        manifest.Holding("ns.llm", 1, 5, "local", 1, "c", "n1", "n1"),
        manifest.Holding("ns.llm", 0, 3, "persistent", 1, "c", "", "n0"),
    ]
    copies = list(decide.copies_of(held, view))
    assert [(c.rank, c.step, c.tier, c.node) for c in copies] == [
        (0, 4, policy.Tier.MEMORY, "n0"),
        (1, 4, policy.Tier.PEERS, "n0"),
        (1, 5, policy.Tier.LOCAL, "n1"),
        (0, 3, policy.Tier.PERSISTENT, None),
    ]
