"""llama.cpp's slot files in the supernode's KV-cache pool: what the pool holds for a prompt,
how a later prompt finds it, and which of the engine's slots a request takes. Pure: no I/O.
Called by :mod:`matrixpool.serving.kvproxy`, the proxy in front of one ``llama-server``.

A prompt of token ids has one content hash per whole block of :data:`BLOCK_TOKENS` tokens
(``engine.block_hashes``, chained: hash ``k`` names the prompt up to the end of block ``k``).
llama.cpp saves a slot as one file (``POST /slots/{id}?action=save``): the tokens the slot
holds, then their KV, layer by layer. The file cannot be cut into blocks without reading
llama.cpp's private layout, so the pool holds two kinds of entry under a service's hashes:

- a **slot file**, under the hash of the prompt's last whole block: the engine's file as it
  wrote it (the prompt, and the tokens it generated, with their KV);
- a **reference**, under the hash of each earlier block: a few bytes naming the slot file's
  hash, so that a prompt sharing only the first blocks (the same system prompt, another
  question) finds the file too.

A look-up bisects the prompt's blocks for the longest prefix the pool holds (:func:`search`:
with an entry under every block of a stored prompt, a few probes find it). What it finds is
checked against the prompt: the file's own tokens (:func:`tokens_of`) must agree
with the prompt over the whole block the hash named, and only their common prefix counts, which
is exactly what llama.cpp reuses after a restore. A stale reference, a hash that named other
tokens or bytes that are not a slot file are a miss, never wrong KV.

Slots (:class:`Slots`): one request per slot at a time; a request takes the free slot that
already holds the longest prefix of its prompt (llama.cpp's own choice by similarity), the least
recently used among equals.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from matrixpool.serving import engine

BLOCK_TOKENS = 64  # tokens per pool block: a slot file is looked up at this granularity
MAGIC = 0x67677371  # "ggsq": llama.cpp's LLAMA_STATE_SEQ_MAGIC
VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the vendored llama.cpp
PACKED = -1  # LLAMA_TOKEN_NULL: the server's packed token state follows (else a plain list)
REFERENCE = b"matrixpool-kv-reference:"  # a reference entry: this, then the file's hash
T = TypeVar("T")
_HASH = re.compile(rb"[0-9a-f]{16,128}")  # a block hash, as the daemons accept it


def hashes(prompt: Sequence[int]) -> tuple[str, ...]:
    """The hashes of the prompt's whole blocks, shortest prefix first."""
    return engine.block_hashes(prompt, BLOCK_TOKENS)


def reference(target: str) -> bytes:
    """The entry that points at the slot file stored under ``target``."""
    return REFERENCE + target.encode()


def referenced(data: bytes) -> str | None:
    """The hash a reference entry points at; None for anything else (a slot file)."""
    target = data[len(REFERENCE) :] if data.startswith(REFERENCE) else b""
    return target.decode() if _HASH.fullmatch(target) else None


def tokens_of(data: bytes) -> tuple[int, ...] | None:
    """The tokens a slot file holds, from its header; None when it is not one.

    The header: magic, version and a count (u32 each), then that many i32: either the plain
    token list (older servers) or the server's packed state, ``PACKED``, its version and the
    token list as a u32 count and the tokens."""
    if len(data) < 12:
        return None
    magic, version, count = struct.unpack_from("<III", data)
    if magic != MAGIC or version != VERSION or len(data) < 12 + 4 * count:
        return None
    packed = struct.unpack_from(f"<{count}i", data, 12)
    if not packed or packed[0] != PACKED:
        return packed
    if count < 3 or not 0 <= packed[2] <= count - 3:
        return None
    return packed[3 : 3 + packed[2]]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens at the start of both."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def search(floor: int, blocks: int, probe: Callable[[int], tuple[T, int] | None]) -> T | None:
    """The longest find of ``probe`` over prefixes of ``floor + 1 .. blocks`` whole blocks,
    by bisection. ``probe(k)`` looks up the hash of the prompt's first ``k`` blocks and gives
    what it found with the whole blocks that covers (``k`` or more), or None.

    A stored prompt leaves an entry under every one of its blocks' hashes (:func:`to_store`),
    so a prefix is found for every ``k`` up to the longest stored: about ``log2(blocks -
    floor)`` probes find it, and a find covering more than ``k`` blocks moves the search past
    them at once. (An evicted entry can hide a shorter prefix: a miss, as with any cache.)"""
    best, low, high = None, floor + 1, blocks
    while low <= high:
        k = (low + high + 1) // 2
        found = probe(k)
        if found is None:
            high = k - 1
        else:
            best, low = found[0], max(k, found[1]) + 1
    return best


def reuses(data: bytes, prompt: Sequence[int], blocks: int) -> int:
    """Tokens of the prompt a slot file gives (0: none), found under the hash of its first
    ``blocks`` blocks: their common prefix, when it covers those blocks."""
    tokens = tokens_of(data)
    if tokens is None:
        return 0
    common = common_prefix(tokens, prompt)
    return common if common >= blocks * BLOCK_TOKENS else 0


@dataclass(frozen=True)
class Entry:
    """One put into the pool after a request."""

    block_hash: str  # the hash it goes under
    tokens: int  # tokens of the prefix that hash names
    target: str | None  # a reference to this slot file's hash; None: the slot file itself


def to_store(prompt_hashes: Sequence[str], found: int) -> list[Entry]:
    """What to put once the engine has computed a prompt whose first ``found`` blocks came from
    the pool: the slot file under the last block's hash, then references under the hashes of
    the blocks between (none when the pool had every block). The file goes first, so a
    reference never names a file that was not stored."""
    blocks = len(prompt_hashes)
    if found >= blocks:
        return []
    last = prompt_hashes[-1]
    file = Entry(last, blocks * BLOCK_TOKENS, None)
    refs = [Entry(prompt_hashes[k], (k + 1) * BLOCK_TOKENS, last) for k in range(found, blocks - 1)]
    return [file, *refs]


@dataclass
class Slot:
    """What the proxy knows of one engine slot."""

    index: int  # the engine's id_slot
    tokens: tuple[int, ...] = ()  # a prefix of what the slot holds (its last prompt)
    busy: bool = False  # a request holds it
    used: int = 0  # when it was last taken (a counter)


@dataclass
class Slots:
    """The engine's slots, one request each at a time."""

    slots: list[Slot]
    _taken: int = field(default=0)  # how many times a slot was taken: the recency clock

    @classmethod
    def of(cls, count: int) -> Slots:
        if count < 1:
            raise ValueError(f"slots {count}: at least 1")
        return cls([Slot(index) for index in range(count)])

    def take(self, prompt: Sequence[int]) -> Slot | None:
        """The free slot holding the longest prefix of ``prompt`` (least recently used among
        equals), now busy; None when every slot is."""
        free = [slot for slot in self.slots if not slot.busy]
        if not free:
            return None
        chosen = max(free, key=lambda slot: (common_prefix(slot.tokens, prompt), -slot.used))
        self._taken += 1
        chosen.busy, chosen.used = True, self._taken
        return chosen

    def give_back(self, slot: Slot, holds: Sequence[int]) -> None:
        """The request on ``slot`` ended; the slot now holds ``holds`` (at least)."""
        slot.tokens, slot.busy = tuple(holds), False
