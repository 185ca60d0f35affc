"""Seconds a recovery or a resume costs, by level and by the tier each rank restores from.

Called by :mod:`.run` after :func:`matrixpool_recovery.policy.decide` has chosen the level
and every rank's source. The figures are in the YAML file's ``costs``, each with its source;
this module is the arithmetic, stated as a model:

1. Time to training again = detection + settle (node losses only) + start + restore + set-up
   + compile (MindCluster's recovery-time model, ANCHORS.md, without the lost work: that is
   the progress lost since the restored step, counted by the run).
2. Start: InPlace and SpareSwap restart only the hit ranks' pods, in parallel, on nodes known
   in advance: ``pod_start_seconds``. Reschedule places and starts the whole gang:
   ``gang_start_seconds`` plus its pods at ``bind_pods_per_second``.
3. Restore: every rank reads its state in parallel, so the time is the slowest rank's bytes
   over its source's bandwidth (``bandwidth_gbps`` per tier; memory on another node, a peer
   copy or another node's disk move at the peer bandwidth at most); persistent reads are also
   capped by the store's aggregate bandwidth: all ranks' bytes over it. Restore time grows
   with the state per rank, not with the number of ranks, except through that cap.
4. Set-up of the communicator grows with the logarithm of its ranks (one per card):
   ``setup_seconds_per_doubling`` × log2(cards). Compile is a constant per restart.
5. A policy whose persistent saves block training (``blocking_saves``: a synchronous save
   from the trainer, as ``torch.save`` or a synchronous distributed checkpoint does) stops for
   each save's write time, at the same bandwidths as a read from that tier (rule 3); a job
   then keeps ``interval / (interval + write)`` of its training time. matrixpool's saves do not
   block: tier 1 captures the state and copies it beside the next steps (a measured 0.3 ms
   stall, "Checkpoint data plane"), and the daemon writes the lower tiers from tier 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from matrixpool.simulate import model
from matrixpool_recovery import policy

NODE_LOSSES = frozenset({"node", "rack"})  # components whose faults wait the settle window


@dataclass(frozen=True)
class Breakdown:
    """One recovery's seconds, by part (rule 1)."""

    detect: float
    settle: float
    start: float
    restore: float
    setup: float
    compile: float

    @property
    def total(self) -> float:
        return self.detect + self.settle + self.start + self.restore + self.setup + self.compile


NOTHING = Breakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def recovery(
    costs: model.Costs,
    level: policy.Level,
    components: Iterable[str],
    pods: int,
    cards: int,
    restore_seconds: float,
) -> Breakdown:
    """Rule 1 for a fault of ``components`` handled at ``level`` on a gang of ``pods`` pods
    and ``cards`` cards (one process, one communicator rank, per card)."""
    seen = tuple(components)
    return Breakdown(
        detect=max(costs.detect_seconds[c] for c in seen),
        settle=costs.settle_seconds if NODE_LOSSES & set(seen) else 0.0,
        start=start(costs, level, pods),
        restore=restore_seconds,
        setup=setup(costs, cards),
        compile=costs.compile_seconds,
    )


def resume(costs: model.Costs, pods: int, cards: int, restore_seconds: float) -> Breakdown:
    """A gang placed again after time-sharing suspended it, or started for the first time."""
    return Breakdown(
        0.0,
        0.0,
        start(costs, policy.Level.RESCHEDULE, pods),
        restore_seconds,
        setup(costs, cards),
        costs.compile_seconds,
    )


def start(costs: model.Costs, level: policy.Level, pods: int) -> float:
    """Rule 2."""
    if level == policy.Level.RESCHEDULE:
        return costs.gang_start_seconds + pods / costs.bind_pods_per_second
    return costs.pod_start_seconds


def setup(costs: model.Costs, cards: int) -> float:
    """Rule 4, one communicator rank per card."""
    return costs.setup_seconds_per_doubling * math.log2(max(1, cards))


def restore(
    costs: model.Costs,
    sources: Mapping[int, policy.Copy],
    home: Mapping[int, str | None],
    gb_per_rank: float,
) -> float:
    """Rule 3: ``sources`` is the plan's copy per rank, ``home`` the node each rank restores
    on (None: not known when the copy was chosen, as for Reschedule)."""
    slowest, persistent = 0.0, 0
    bandwidth = costs.bandwidth_gbps
    for rank, copy in sources.items():
        tier = source_tier(copy, home.get(rank))
        slowest = max(slowest, gb_per_rank / bandwidth[tier])
        persistent += tier == "persistent"
    return max(slowest, persistent * gb_per_rank / costs.persistent_aggregate_gbps)


def source_tier(copy: policy.Copy, home: str | None) -> str:
    """The bandwidth a copy is read at: its tier's on its own node, else at most a peer's."""
    if copy.tier == policy.Tier.PERSISTENT:
        return "persistent"
    if copy.node is not None and copy.node == home:
        return "local" if copy.tier == policy.Tier.LOCAL else "memory"
    return "local" if copy.tier == policy.Tier.LOCAL else "peers"


def restore_from(costs: model.Costs, tier: str, ranks: int, gb_per_rank: float) -> float:
    """Rule 3 when every rank reads the same tier (a resume after time-sharing)."""
    seconds = gb_per_rank / costs.bandwidth_gbps[tier]
    if tier == "persistent":
        seconds = max(seconds, ranks * gb_per_rank / costs.persistent_aggregate_gbps)
    return seconds


def save(costs: model.Costs, tier: str, ranks: int, gb_per_rank: float) -> float:
    """Rule 5: seconds to write one checkpoint of ``ranks`` ranks to ``tier``."""
    return restore_from(costs, tier, ranks, gb_per_rank)


def useful_fraction(interval_seconds: float, save_seconds: float) -> float:
    """Rule 5: the share of training time kept when every ``interval_seconds`` of training
    stops for ``save_seconds``."""
    return interval_seconds / (interval_seconds + save_seconds)
