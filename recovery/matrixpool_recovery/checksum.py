"""Checksums of shards, computed while bytes are copied and verified when they are read.

A checksum is a string ``ALGORITHM:HEX``. The default is XXH3-64 (the ``xxhash`` package): it
runs near memory speed (about 27 GB/s on the 2-core CI machine, against 4 GB/s for zlib's
CRC-32), so hashing costs little next to the copy it follows. ``crc32`` is the fallback where
xxhash cannot be imported; a reader verifies whichever algorithm the writer recorded.

Called by the trainer client (hash while staging, verify while restoring) and by the daemon
(verify what a peer sends).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Protocol

from matrixpool_recovery import errors

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer as Buffer

try:
    import xxhash

    HAVE_XXHASH = True
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    HAVE_XXHASH = False

XXH3 = "xxh3_64"
CRC32 = "crc32"
DEFAULT = XXH3 if HAVE_XXHASH else CRC32


class Hasher(Protocol):
    """A running checksum over bytes fed in order."""

    def update(self, data: Buffer) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Buffer) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


class Running:
    """A checksum being computed; ``value`` gives ``ALGORITHM:HEX``."""

    def __init__(self, algorithm: str = DEFAULT) -> None:
        self.algorithm = algorithm  # name written before the colon
        self._hasher = _new(algorithm)

    def update(self, data: Buffer) -> None:
        self._hasher.update(data)

    @property
    def value(self) -> str:
        return f"{self.algorithm}:{self._hasher.hexdigest()}"


def _new(algorithm: str) -> Hasher:
    if algorithm == XXH3 and HAVE_XXHASH:
        hasher: Hasher = xxhash.xxh3_64()
        return hasher
    if algorithm == CRC32:
        return _Crc32()
    raise errors.IntegrityError(f"checksum algorithm {algorithm!r} is not available here")


def of(data: Buffer, algorithm: str = DEFAULT) -> str:
    """Checksum of one buffer."""
    running = Running(algorithm)
    running.update(data)
    return running.value


def algorithm_of(checksum: str) -> str:
    """The algorithm named by a checksum string."""
    name, sep, digest = checksum.partition(":")
    if not sep or not digest:
        raise errors.IntegrityError(f"malformed checksum {checksum!r}")
    return name


def verify(expected: str, running: Running, what: str) -> None:
    """Raise IntegrityError when a computed checksum is not the recorded one."""
    if running.value != expected:
        raise errors.IntegrityError(f"{what}: checksum {running.value} != recorded {expected}")
