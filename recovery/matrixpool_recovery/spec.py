"""Which tiers a save reaches, from the TrainingJob's ``spec.checkpoint`` (DESIGN.md).

The trainer client asks ``CheckpointSpec.due(step)``; the operator hands the job's checkpoint
spec to the trainer pods as JSON in ``MATRIXPOOL_CHECKPOINT`` (``from_json``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MEMORY = "memory"  # tier 1: node memory held by the daemon
PEERS = "peers"  # tier 1 copies on peer daemons (a result, not a tier a save asks for)
LOCAL = "local"  # tier 2: node-local disk
PERSISTENT = "persistent"  # tier 3: the job's URI
TIERS = (MEMORY, LOCAL, PERSISTENT)  # fastest first


@dataclass(frozen=True)
class CheckpointSpec:
    """Cadence of each tier; None: the tier is not used."""

    memory_every: int | None = 1  # tier 1 every this many steps
    peer_replicas: int = 1  # copies of each tier-1 shard on other nodes' daemons
    local_every: int | None = None  # tier 2 every this many steps
    persistent_every: int | None = None  # tier 3 every this many steps
    persistent_uri: str | None = None  # where tier 3 goes, e.g. file:///mnt/ckpt/llm

    def due(self, step: int) -> tuple[str, ...]:
        """The tiers a save of this step reaches."""
        cadence = {
            MEMORY: self.memory_every,
            LOCAL: self.local_every,
            PERSISTENT: self.persistent_every if self.persistent_uri else None,
        }
        return tuple(t for t in TIERS if (every := cadence[t]) is not None and step % every == 0)

    def configured(self) -> tuple[str, ...]:
        """Every tier this job uses: what a save the operator asked for reaches at once."""
        cadence = {
            MEMORY: self.memory_every,
            LOCAL: self.local_every,
            PERSISTENT: self.persistent_every if self.persistent_uri else None,
        }
        return tuple(t for t in TIERS if cadence[t] is not None)

    @classmethod
    def from_job(cls, checkpoint: Mapping[str, Any]) -> CheckpointSpec:
        """From the TrainingJob's spec.checkpoint as the API returns it (camelCase)."""
        memory = checkpoint.get("memory") or {}
        local = checkpoint.get("local") or {}
        persistent = checkpoint.get("persistent") or {}
        return cls(
            memory_every=memory.get("everySteps"),
            peer_replicas=int(memory.get("peerReplicas", 1)) if memory else 0,
            local_every=local.get("everySteps"),
            persistent_every=persistent.get("everySteps"),
            persistent_uri=persistent.get("uri"),
        )

    @classmethod
    def from_json(cls, text: str) -> CheckpointSpec:
        return cls.from_job(json.loads(text))
