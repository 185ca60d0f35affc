"""Checkpoint tiers, the node checkpoint daemon, the trainer client and the recovery policy.

Imports neither kopf nor a Kubernetes client: it ships inside training images. The data plane
of DESIGN.md's recovery contract:

* ``client.Checkpointer`` — the trainer side: save, restore, latest (one per rank).
* ``torch`` — the same tiers as ``torch.distributed.checkpoint`` storage (``StorageWriter``,
  ``StorageReader``, ``latest``); the one module that imports torch.
* ``daemon`` — the node checkpoint daemon (``matrixpool-ckpt-daemon``), with ``memory`` (tier 1)
  and ``files`` (tiers 2 and 3) as its stores.
* ``staging``, ``shard``, ``checksum``, ``manifest`` — bytes, format, integrity, commit rule.
* ``spec`` — which tiers a step reaches; ``names`` — names that cannot escape a directory.
* ``kvpool`` — the KV-cache pool a daemon lends to inference services (quotas, LRU);
  ``kvclient`` — an inference server's puts and lookups over the supernode's daemons.

The client needs NumPy (``Checkpointer`` is imported on first use); the daemon does not.

Errors (``errors``)::

    CheckpointError
    ├── InvalidNameError          job, rank or step that is malformed or escapes a directory
    ├── DaemonError               the daemon answered with an error status
    │   ├── AuthError             401 no token, 403 wrong token or out of its scope
    │   ├── MemoryFullError       507 tier-1 memory full of steps that may not be evicted
    │   └── NotFoundError         404 no such shard or buffer
    ├── DaemonUnreachableError    refused, reset or timed out: a lost node
    ├── IntegrityError            checksum, size or format mismatch: corrupt or partial copy
    ├── NoCheckpointError         no step committed for every rank, or no valid copy left
    ├── PolicyInputError          (policy) a fault or job view that contradicts itself
    └── TierWriteError            a save failed on some tiers while the others carry on

What may be written here: what runs in a training image or on a node (the trainer client,
the daemon, the tiers, the recovery policy, the restore annotation's codec). It never imports
the operator (``matrixpool``: an import-linter contract).
"""

from typing import TYPE_CHECKING, Any

from matrixpool_recovery.errors import (
    AuthError,
    CheckpointError,
    DaemonError,
    DaemonUnreachableError,
    IntegrityError,
    InvalidNameError,
    MemoryFullError,
    NoCheckpointError,
    NotFoundError,
    TierWriteError,
)
from matrixpool_recovery.spec import CheckpointSpec

if TYPE_CHECKING:
    from matrixpool_recovery.client import Checkpointer, Restored, SaveHandle

_CLIENT = ("Checkpointer", "Restored", "SaveHandle")


def __getattr__(name: str) -> Any:
    """The client is imported on first use: it needs NumPy, the daemon does not."""
    if name in _CLIENT:
        from matrixpool_recovery import client

        return getattr(client, name)
    raise AttributeError(f"module 'matrixpool_recovery' has no attribute {name!r}")


__all__ = [
    "AuthError",
    "CheckpointError",
    "CheckpointSpec",
    "Checkpointer",
    "DaemonError",
    "DaemonUnreachableError",
    "IntegrityError",
    "InvalidNameError",
    "MemoryFullError",
    "NoCheckpointError",
    "NotFoundError",
    "Restored",
    "SaveHandle",
    "TierWriteError",
]
