"""The engine's prefix cache over the supernode's KV-cache pool: the node daemons, reached
through ``matrixpool_recovery.kvclient.KvClient`` (its own node's daemon first, then the other
member nodes').

A prompt of token ids has one content hash per whole block of :data:`engine.BLOCK_TOKENS`
tokens, each hash covering the prompt up to the end of its block (``engine.block_hashes``).
Before a request goes to the engine, :meth:`PooledPrefixes.look_up` fetches its blocks from the
pool in order, from the first, and stops at the first that no daemon holds (or that one
cannot answer for: the block is then computed, as without a pool), a run of blocks per request
to a daemon (``KvClient.fetch_run``); the run found is the engine's hit for the request's
longest cached prefix, remote when any block came from another node, and the engine charges
its transfer time by the latency model (``LatencyModel.transfer_seconds``). Once the request
has been prefilled here, :meth:`PooledPrefixes.keep` stores the blocks the pool did not have on
the node's own daemon, in one request, within the service's quota there (the daemon evicts the
service's oldest blocks). :meth:`PooledPrefixes.refresh` learns which other daemons hold any of
the service's blocks, so that a look-up asks those only (the server calls it every few
seconds).

A block's bytes stand in for its KV: ``block_bytes`` each (by default what a block of the
model really holds, ``latency.KV_BYTES_PER_TOKEN × BLOCK_TOKENS``; smaller in tests), so the
bytes moved over the network are real and the time the engine charges follows the model, not
the stand-in's size. A daemon's death costs only its blocks: the client skips it for a while
and the prompt is computed (``tests/checkpoint/test_kv_pool.py``).

Blocking calls (HTTP to the daemons): the server runs them in threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from matrixpool.serving import engine

REMEMBERED = 4096  # hits kept for the engine to read (it reads each once, at admission)


class Run(Protocol):
    @property
    def blocks(self) -> int: ...

    @property
    def remote(self) -> bool: ...


class Pool(Protocol):
    """What :class:`PooledPrefixes` needs of the pool (``kvclient.KvClient`` is one)."""

    def fetch_run(self, hashes: Sequence[str]) -> Run: ...

    def put_run(self, blocks: Sequence[tuple[str, int]], data: bytes) -> int: ...

    def refresh_holders(self) -> set[str]: ...


@dataclass(frozen=True)
class Looked:
    """What one look-up found: the blocks from the prompt's start the pool held."""

    blocks: int  # whole blocks found, from the first
    remote: bool  # any of them from another node's daemon

    @property
    def tokens(self) -> int:
        return self.blocks * engine.BLOCK_TOKENS


class PooledPrefixes:
    """The engine's :data:`engine.PrefixCache` hook over a :class:`Pool`."""

    def __init__(self, pool: Pool, block_bytes: int) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes {block_bytes}: at least 1")
        self.pool = pool
        self.block = bytes(block_bytes)
        self._hits: OrderedDict[str, engine.Hit] = OrderedDict()
        self._lock = threading.Lock()  # look-ups run in threads, the engine reads in the loop

    def __call__(self, prefix_hash: str) -> engine.Hit | None:
        with self._lock:
            return self._hits.get(prefix_hash)

    def look_up(self, hashes: Sequence[str]) -> Looked:
        """Fetch the prompt's blocks from the pool, in order, until one is missing; the
        engine then finds the hit under the last block found."""
        run = self.pool.fetch_run(hashes)
        blocks, remote = min(run.blocks, len(hashes)), run.remote
        if blocks:
            hit = engine.Hit(blocks * engine.BLOCK_TOKENS, remote)
            with self._lock:
                self._hits[hashes[blocks - 1]] = hit
                self._hits.move_to_end(hashes[blocks - 1])
                while len(self._hits) > REMEMBERED:
                    self._hits.popitem(last=False)
        return Looked(blocks, remote)

    def keep(self, hashes: Sequence[str], skip: int) -> int:
        """Store the prompt's blocks after the first ``skip`` (those the pool had) on the
        node's own daemon; how many it took."""
        blocks = [(hashes[i], (i + 1) * engine.BLOCK_TOKENS) for i in range(skip, len(hashes))]
        return self.pool.put_run(blocks, self.block) if blocks else 0

    def refresh(self) -> None:
        """Learn which daemons hold any of the service's blocks (for look-ups to ask)."""
        self.pool.refresh_holders()
