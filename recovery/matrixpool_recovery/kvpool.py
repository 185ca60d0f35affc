"""The KV-cache pool a node daemon lends to inference services: KV blocks by service and prefix
hash, a byte quota per service, least-recently-used eviction. Pure: no I/O, no clock (recency
is a counter). The daemon (``daemon``) holds one behind a lock and serves it on ``/v1/kv/...``;
``tests/unit/serving/test_kvpool.py`` drives it directly.

A block is keyed by ``(service, prefix hash)``: the service is the InferenceService's UID, the
hash names a token prefix by content (``matrixpool.serving.engine.block_hashes``). Each service
has its own map of blocks, and every lookup happens inside the asking service's map, so a
service never gets another's block, not even for an equal prefix.

``KvPool.put`` — the rule, for a block of ``n`` bytes that service ``s`` (quota ``q_s``, usage
``u_s``) puts into a pool of capacity ``C`` holding ``U`` bytes:

0. A key already held is replaced: its old block counts as gone in what follows.
1. ``n > q_s`` (a service without a quota has ``q_s = 0``) or ``n > C``: refused
   (``TOO_LARGE``); no eviction can make room.
2. Quota: while ``u_s + n > q_s``, evict ``s``'s least recently used block. Only ``s``'s.
3. Capacity: while ``U + n > C``, evict
   a. ``s``'s least recently used block, while ``s`` with the new block is over its share
      (``u_s + n > g_s``): the putter pays for its own excess first; then
   b. the least recently used block among the other services ``t`` whose usage stays at or
      above their share ``g_t`` once it is gone (a service whose oldest block would take it
      below is skipped whole, so each service still loses its blocks oldest first).
   A put never takes another service below its share.
4. Still ``U + n > C``: refused (``FULL``), and nothing is evicted (steps 2 and 3 are a plan,
   carried out only when the block fits).

Shares: ``g_t = q_t`` while the quotas add up to at most ``C`` — then step 3 never evicts, since
every service within its quota keeps the pool within ``C``; when the quotas oversubscribe ``C``,
``g_t = q_t * C // sum(q)``. ``set_quota`` evicts the service's oldest blocks down to the new
quota at once. Together: no service is ever above its quota, the pool never above ``C``.
"""

from __future__ import annotations

import enum
import re
from collections import OrderedDict
from dataclasses import dataclass

from matrixpool_recovery import errors

Key = tuple[str, str]  # (service UID, prefix hash)
MAX_TOKENS = 10**9  # tokens a block's prefix may name
_HASH = re.compile(r"[0-9a-f]{16,128}")  # a prefix hash: lowercase hex


def block_hash(text: str) -> str:
    """The prefix hash unchanged, or InvalidNameError unless it is 16 to 128 lowercase hex."""
    if not _HASH.fullmatch(text):
        raise errors.InvalidNameError(f"invalid block hash {text[:140]!r}: 16-128 lowercase hex")
    return text


@dataclass(frozen=True)
class Block:
    """One KV block: the KV cache of a token prefix."""

    tokens: int  # tokens of the prefix the block's hash names
    data: bytes  # the KV bytes

    def __post_init__(self) -> None:
        if not self.data or not 1 <= self.tokens <= MAX_TOKENS:
            raise ValueError(f"a KV block needs bytes and 1..{MAX_TOKENS} tokens")

    @property
    def size(self) -> int:
        return len(self.data)


class Refusal(enum.StrEnum):
    """Why a put was refused."""

    TOO_LARGE = "TooLarge"  # above the service's quota or the pool's capacity: never fits
    FULL = "Full"  # the rest of the pool is other services' shares


@dataclass(frozen=True)
class Stored:
    evicted: tuple[Key, ...]  # blocks evicted to make room, in the order they went


@dataclass(frozen=True)
class Refused:
    why: Refusal
    reason: str  # for a person: the sizes involved


@dataclass(frozen=True)
class Usage:
    used_bytes: int  # bytes of the service's blocks
    quota_bytes: int  # its quota (0: none)
    share_bytes: int  # what a full pool leaves it (module docstring)
    blocks: int  # blocks it holds


@dataclass
class _Entry:
    block: Block
    used_at: int  # the pool's counter when it was last put or got


class _Cursor:
    """A service's blocks, least recently used first, as a plan takes them (no mutation)."""

    def __init__(self, blocks: OrderedDict[str, _Entry], skip: str | None) -> None:
        self._items = (item for item in blocks.items() if item[0] != skip)  # skip: replaced
        self.head = next(self._items, None)  # the next block to evict; None: no more

    def pop(self) -> tuple[str, _Entry]:
        taken = self.head
        if taken is None:
            raise AssertionError("a plan evicted more blocks than the service holds")
        self.head = next(self._items, None)
        return taken


class KvPool:
    """KV blocks of several services in ``capacity_bytes`` (the rule: module docstring).

    Not thread-safe: the daemon calls it under a lock.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"a KV pool needs a positive capacity, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes  # C
        self.used_bytes = 0  # U: bytes of every service's blocks
        # service -> hash -> entry, least recently used first
        self._blocks: dict[str, OrderedDict[str, _Entry]] = {}
        self._used: dict[str, int] = {}  # service -> bytes of its blocks
        self._quota: dict[str, int] = {}  # service -> quota
        self._clock = 0  # recency: bumped on every put and get

    # --- quotas ---------------------------------------------------------------------------

    def set_quota(self, service: str, quota_bytes: int) -> tuple[Key, ...]:
        """Set ``service``'s quota; its oldest blocks above it are evicted (returned)."""
        if quota_bytes < 0:
            raise ValueError(f"a quota is a number of bytes >= 0, got {quota_bytes}")
        self._quota[service] = quota_bytes
        self._blocks.setdefault(service, OrderedDict())
        self._used.setdefault(service, 0)
        evicted: list[Key] = []
        blocks = self._blocks[service]
        while self._used[service] > quota_bytes:
            evicted.append(self._evict(service, next(iter(blocks))))
        return tuple(evicted)

    def forget(self, service: str) -> int:
        """Drop the service, its quota and its blocks (the service is gone); blocks dropped."""
        blocks = self._blocks.pop(service, OrderedDict())
        self.used_bytes -= self._used.pop(service, 0)
        self._quota.pop(service, None)
        return len(blocks)

    def share(self, service: str) -> int:
        """g_s: the service's quota, scaled down when the quotas oversubscribe the pool."""
        quota = self._quota.get(service, 0)
        total = sum(self._quota.values())
        return quota if total <= self.capacity_bytes else quota * self.capacity_bytes // total

    # --- blocks ---------------------------------------------------------------------------

    def get(self, service: str, block_hash: str) -> Block | None:
        """The service's block of that hash, now its most recently used; None if not held."""
        blocks = self._blocks.get(service)
        entry = None if blocks is None else blocks.get(block_hash)
        if blocks is None or entry is None:
            return None
        self._clock += 1
        entry.used_at = self._clock
        blocks.move_to_end(block_hash)
        return entry.block

    def admits(self, service: str, size: int) -> Refused | None:
        """Step 1 alone: whether a block of ``size`` bytes could ever fit (before reading it)."""
        quota = self._quota.get(service, 0)
        if size > quota:
            held = f"a quota of {quota} bytes" if quota else "no quota on this pool"
            return Refused(
                Refusal.TOO_LARGE, f"a block of {size} bytes: service {service} has {held}"
            )
        if size > self.capacity_bytes:
            reason = f"a block of {size} bytes: the pool holds {self.capacity_bytes} bytes"
            return Refused(Refusal.TOO_LARGE, reason)
        return None

    def put(self, service: str, block_hash: str, block: Block) -> Stored | Refused:
        """Store the block under the rule of the module docstring."""
        refused = self.admits(service, block.size)
        if refused is not None:
            return refused
        plan = self._plan(service, block_hash, block.size)
        if isinstance(plan, Refused):
            return plan
        for key in plan:
            self._evict(*key)
        blocks = self._blocks[service]
        if (old := blocks.pop(block_hash, None)) is not None:
            self._used[service] -= old.block.size
            self.used_bytes -= old.block.size
        self._clock += 1
        blocks[block_hash] = _Entry(block, self._clock)
        self._used[service] += block.size
        self.used_bytes += block.size
        return Stored(plan)

    def _plan(self, service: str, block_hash: str, size: int) -> tuple[Key, ...] | Refused:
        """Steps 0, 2 and 3: the blocks to evict, or why the block cannot fit."""
        # 0. The block replaced counts as gone.
        old = self._blocks[service].get(block_hash)
        freed = 0 if old is None else old.block.size
        used = {t: u - (freed if t == service else 0) for t, u in self._used.items()}
        total = self.used_bytes - freed
        cursors = {
            t: _Cursor(b, block_hash if t == service else None) for t, b in self._blocks.items()
        }
        shares = {t: self.share(t) for t in self._blocks}
        evicted: list[Key] = []

        def evict(owner: str) -> None:
            nonlocal total
            taken, entry = cursors[owner].pop()
            used[owner] -= entry.block.size
            total -= entry.block.size
            evicted.append((owner, taken))

        # 2. The service's own quota (admits: the block alone fits in it).
        while used[service] + size > self._quota[service]:
            evict(service)
        # 3a. A full pool: the putter's own blocks above its share first.
        while total + size > self.capacity_bytes and used[service] + size > shares[service]:
            if cursors[service].head is None:
                break
            evict(service)
        # 3b. Then the oldest block another service can spare and keep its share.
        while total + size > self.capacity_bytes:
            victim = _oldest_spare(service, cursors, used, shares)
            if victim is None:
                return Refused(
                    Refusal.FULL,
                    f"a block of {size} bytes does not fit: the pool holds {total} of "
                    f"{self.capacity_bytes} bytes in other services' shares",
                )
            evict(victim)
        return tuple(evicted)

    def _evict(self, service: str, block_hash: str) -> Key:
        entry = self._blocks[service].pop(block_hash)
        self._used[service] -= entry.block.size
        self.used_bytes -= entry.block.size
        return (service, block_hash)

    # --- reading --------------------------------------------------------------------------

    def usage(self) -> dict[str, Usage]:
        """Per service known to the pool (a quota set, or blocks held)."""
        return {service: self.usage_of(service) for service in self._blocks}

    def usage_of(self, service: str) -> Usage:
        return Usage(
            used_bytes=self._used.get(service, 0),
            quota_bytes=self._quota.get(service, 0),
            share_bytes=self.share(service),
            blocks=len(self._blocks.get(service, ())),
        )

    def recency(self, service: str) -> tuple[str, ...]:
        """The service's block hashes, least recently used first."""
        return tuple(self._blocks.get(service, ()))


def _oldest_spare(
    service: str, cursors: dict[str, _Cursor], used: dict[str, int], shares: dict[str, int]
) -> str | None:
    """Step 3b: the other service whose oldest block is the oldest that can be spared."""
    best: tuple[int, str] | None = None
    for owner, cursor in cursors.items():
        if owner == service or cursor.head is None:
            continue
        entry = cursor.head[1]
        if used[owner] - entry.block.size < shares[owner]:
            continue
        if best is None or entry.used_at < best[0]:
            best = (entry.used_at, owner)
    return None if best is None else best[1]
