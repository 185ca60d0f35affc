"""Errors of the checkpoint data plane, raised by the trainer client and the node daemon.

The tree is drawn in the package docstring (``matrixpool_recovery``). Every error a caller can
act on is a ``CheckpointError``; I/O errors of the standard library are chained as ``__cause__``.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every error of matrixpool_recovery."""


class InvalidNameError(CheckpointError, ValueError):
    """A job name, rank or step that could escape the data directory or is malformed."""


class DaemonError(CheckpointError):
    """A checkpoint daemon answered a request with an error status."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status the daemon answered with (0: none)

    def __reduce__(self) -> tuple[type[DaemonError], tuple[str, int]]:
        return (type(self), (str(self), self.status))


class AuthError(DaemonError):
    """The daemon refused the token (401 missing, 403 wrong or out of its scope)."""


class MemoryFullError(DaemonError):
    """Tier-1 memory of the daemon is full of steps it may not evict (507)."""


class NotFoundError(DaemonError):
    """The daemon holds no such shard (404)."""


class DaemonUnreachableError(CheckpointError):
    """No answer from a daemon: connection refused, reset or timed out (a lost node)."""


class IntegrityError(CheckpointError):
    """A shard whose bytes do not match its checksum, size or format (corrupt or partial)."""


class NoCheckpointError(CheckpointError):
    """No step is committed for every rank, or no source holds a valid copy of a shard."""


class TierWriteError(CheckpointError):
    """A save reached some tiers but not others; the others carry on.

    ``failures`` maps a tier name (``memory``, ``peers``, ``local``, ``persistent``) to the
    daemon's reason.
    """

    def __init__(self, step: int, failures: dict[str, str]) -> None:
        reasons = "; ".join(f"{tier}: {why}" for tier, why in sorted(failures.items()))
        super().__init__(f"checkpoint step {step} failed on {sorted(failures)}: {reasons}")
        self.step = step  # the step whose save failed somewhere
        self.failures = failures  # tier name -> reason given by the daemon

    def __reduce__(self) -> tuple[type[TierWriteError], tuple[int, dict[str, str]]]:
        """Pickled by its fields (DCP gathers a rank's exception to every rank)."""
        return (TierWriteError, (self.step, self.failures))
