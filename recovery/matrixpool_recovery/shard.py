"""The byte format of one shard: the state of one rank at one step.

A shard is a header and a payload::

    0      8 bytes   magic  b"MPCKPT01"
    8      4 bytes   header length, little-endian
    12     header    JSON: format, job, rank, step, entries (name, kind, dtype, shape, offset,
                     nbytes), payload size
    ...    zeros     up to the next 4 KiB boundary (the payload start)
    ...    payload   entries in order, each at a 64-byte aligned offset, zeros between

The checksum of a shard covers every byte of it, header included. The trainer client builds the
layout when it captures a state (``plan``), and reads it back when it restores (``parse``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from matrixpool_recovery import errors

MAGIC = b"MPCKPT01"
PREFIX = len(MAGIC) + 4  # magic and the header length
ENTRY_ALIGN = 64  # each entry starts on a cache line, so NumPy views of it are aligned
PAYLOAD_ALIGN = 4096  # the payload starts on a page
FORMAT = 1
MAX_HEADER = 64 << 20  # a header larger than this is a corrupt one

KINDS = ("bytes", "numpy", "torch")


def align(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclass(frozen=True)
class Entry:
    """One value of the state mapping, as laid out in the payload."""

    name: str  # key in the state mapping
    kind: str  # "bytes", "numpy" or "torch": what restore gives back
    dtype: str  # NumPy dtype.str or torch dtype name; "" for bytes
    shape: tuple[int, ...]  # array shape; () for bytes
    offset: int  # from the payload start
    nbytes: int  # bytes of the value

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        try:
            entry = cls(
                name=str(data["name"]),
                kind=str(data["kind"]),
                dtype=str(data["dtype"]),
                shape=tuple(int(n) for n in data["shape"]),
                offset=int(data["offset"]),
                nbytes=int(data["nbytes"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise errors.IntegrityError(f"malformed shard entry {data!r}") from err
        if entry.kind not in KINDS or entry.offset < 0 or entry.nbytes < 0:
            raise errors.IntegrityError(f"malformed shard entry {data!r}")
        return entry


@dataclass(frozen=True)
class Layout:
    """Where everything of one shard goes."""

    head: bytes  # magic, length, header JSON and zeros up to the payload start
    entries: tuple[Entry, ...]  # in payload order
    job: str  # whose shard
    rank: int
    step: int

    @property
    def payload_start(self) -> int:
        return len(self.head)

    @property
    def size(self) -> int:
        """Bytes of the whole shard."""
        if not self.entries:
            return self.payload_start
        last = self.entries[-1]
        return self.payload_start + last.offset + last.nbytes


def plan(
    job: str, rank: int, step: int, values: Sequence[tuple[str, str, str, tuple[int, ...], int]]
) -> Layout:
    """Layout of a shard holding values given as (name, kind, dtype, shape, nbytes)."""
    entries: list[Entry] = []
    offset = 0
    for name, kind, dtype, shape, nbytes in values:
        offset = align(offset, ENTRY_ALIGN)
        entries.append(Entry(name, kind, dtype, shape, offset, nbytes))
        offset += nbytes
    header = {
        "format": FORMAT,
        "job": job,
        "rank": rank,
        "step": step,
        "entries": [e.to_json() for e in entries],
        "payload": offset,
    }
    return Layout(_head(json.dumps(header).encode()), tuple(entries), job, rank, step)


def _head(header: bytes) -> bytes:
    start = align(PREFIX + len(header), PAYLOAD_ALIGN)
    prefix = MAGIC + struct.pack("<I", len(header)) + header
    return prefix + bytes(start - len(prefix))


def header_length(prefix: bytes) -> int:
    """Length of the header JSON, read from the first PREFIX bytes of a shard."""
    if len(prefix) != PREFIX or prefix[: len(MAGIC)] != MAGIC:
        raise errors.IntegrityError("not a matrixpool shard (bad magic)")
    (length,) = struct.unpack("<I", prefix[len(MAGIC) :])
    if length > MAX_HEADER:
        raise errors.IntegrityError(f"shard header of {length} bytes is corrupt")
    return int(length)


def parse(prefix: bytes, header: bytes) -> Layout:
    """The layout of a shard from its first PREFIX bytes and its header JSON."""
    header_length(prefix)
    try:
        data = json.loads(header)
        entries = tuple(Entry.from_json(e) for e in data["entries"])
        layout = Layout(
            _head(header), entries, str(data["job"]), int(data["rank"]), int(data["step"])
        )
    except (ValueError, KeyError, TypeError) as err:
        raise errors.IntegrityError(f"corrupt shard header: {err}") from err
    if data.get("format") != FORMAT:
        raise errors.IntegrityError(f"shard format {data.get('format')!r} is not {FORMAT}")
    return layout
