"""The inference server's side of the KV-cache pool: puts its KV blocks into its node's daemon
and looks prefixes up on every daemon of the supernode. Called by a serving engine's prefix
cache (one client per engine; an adapter turns ``lookup``'s answer into the engine's ``Hit``)::

    pool = KvClient(service_uid, token, ["10.0.0.7:7040", "10.0.0.8:7040", ...])
    pool.put(block_hash, tokens, kv_bytes)        # to the local daemon; False if not stored
    pool.lookup(block_hash)                       # (tokens, remote) or None: recompute
    pool.fetch_run(hashes)                        # a prompt's leading run of blocks, batched
    pool.put_run([(hash, tokens), ...], kv_bytes)  # blocks of one size, one request

The daemons are given the local one first: a lookup asks it, then the others in order (a block
found there is ``remote``); a put goes to the local one only. ``fetch_run`` asks each daemon for
the longest run it holds from where the run so far ends, in one request, and only the daemons
known to hold some of the service's blocks (``refresh_holders``, from their usage; all until
then): on a supernode of many nodes a prompt the pool lacks costs a request or two, not one per
daemon. The pool is a cache: every failure
(a daemon refused, reset, timed out or gone, a refusal, a miss) is answered None or False, and
the caller recomputes the prefix. A request takes ``deadline`` seconds at most in all, however
slowly a daemon sends (each socket operation ``timeout``). A daemon that did not answer is
skipped for ``retry_after`` seconds, so a lost node costs one timeout, not one per lookup. The
token is the service's (``credentials.service_token``): it opens that service's blocks on every
daemon, nothing else.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

from matrixpool_recovery import errors, kvpool, names, wire

log = logging.getLogger(__name__)
TIMEOUT = 2.0  # seconds to connect and for each socket operation
DEADLINE = 5.0  # seconds for a whole request (a daemon that trickles is cut off there)
RETRY_AFTER = 5.0  # seconds a daemon that did not answer is skipped
TOKENS = wire.HEADER + "Tokens"  # header: the tokens of the prefix a block holds
BLOCKS = wire.HEADER + "Blocks"  # header: a run's blocks (a count, or a comma list of hashes)
MAX_RUN = 1024  # blocks per run request (the daemon's MAX_KV_RUN)


@dataclass(frozen=True)
class Found:
    """A block found in the pool."""

    tokens: int  # tokens of the prefix the block holds
    data: bytes  # the KV bytes
    remote: bool  # held by another node's daemon than the local one
    address: str  # the daemon that held it


@dataclass(frozen=True)
class Run:
    """The leading run of a prompt's blocks found in the pool."""

    blocks: int  # blocks found, from the first
    tokens: int  # tokens of the prefix the last of them holds (0: none)
    remote: bool  # any of them held by another node's daemon than the local one
    nbytes: int  # the KV bytes fetched


@dataclass
class Stats:
    """What the client saw, for benchmarks and logs."""

    local_hits: int = 0
    remote_hits: int = 0
    misses: int = 0  # lookups that found the block nowhere
    bytes_fetched: int = 0
    puts: int = 0  # blocks stored
    failures: int = 0  # requests that failed: unreachable daemon, refusal, error status
    down: dict[str, float] = field(default_factory=dict)  # address -> skipped until (clock)


class KvClient:
    """One service's view of the pool over the supernode's daemons, the local one first."""

    def __init__(
        self,
        service: str,
        token: str,
        daemons: Sequence[str],
        timeout: float = TIMEOUT,
        retry_after: float = RETRY_AFTER,
        deadline: float = DEADLINE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not daemons:
            raise ValueError("a KV client needs at least its node's daemon")
        self.service = names.job(service)  # the InferenceService's UID
        self.endpoints = [
            wire.Endpoint(a, token, timeout, deadline) for a in daemons
        ]  # local first
        self.retry_after = retry_after
        self.clock = clock
        self.stats = Stats()
        self.holders: set[str] | None = None  # other daemons holding blocks; None: unknown

    def put(self, block_hash: str, tokens: int, data: bytes) -> bool:
        """Store a block on the local daemon; False when it was not stored (no harm done)."""
        local = self.endpoints[0]
        if self._skipped(local):
            return False
        meta = {TOKENS: str(tokens)}
        try:
            wire.put_shard(local, self._path(block_hash), meta, memoryview(data), len(data))
        except errors.CheckpointError as err:
            self._failed(local, err)
            return False
        self.stats.puts += 1
        return True

    def fetch(self, block_hash: str) -> Found | None:
        """The block from the first daemon that holds it, local first; None: recompute."""
        path = self._path(block_hash)
        for index, endpoint in enumerate(self.endpoints):
            if self._skipped(endpoint):
                continue
            try:
                found = self._get(endpoint, path, remote=index > 0)
            except errors.NotFoundError:
                continue
            except errors.CheckpointError as err:
                self._failed(endpoint, err)
                continue
            if found.remote:
                self.stats.remote_hits += 1
            else:
                self.stats.local_hits += 1
            self.stats.bytes_fetched += len(found.data)
            return found
        self.stats.misses += 1
        return None

    def lookup(self, block_hash: str) -> tuple[int, bool] | None:
        """(tokens, remote) of the block, fetched; None when no daemon that answers holds it."""
        found = self.fetch(block_hash)
        return None if found is None else (found.tokens, found.remote)

    def put_run(self, blocks: Sequence[tuple[str, int]], data: bytes) -> int:
        """Store blocks of (hash, tokens), each holding ``data``, on the local daemon in
        requests of up to MAX_RUN blocks; how many it took (it stops at the first refused)."""
        local, stored = self.endpoints[0], 0
        for start in range(0, len(blocks), MAX_RUN):
            part = blocks[start : start + MAX_RUN]
            if self._skipped(local) or not part:
                break
            meta = {BLOCKS: ",".join(h for h, _ in part), TOKENS: ",".join(str(t) for _, t in part)}
            body = memoryview(data * len(part))
            try:
                answer = wire.put_shard(local, self._run_path(), meta, body, len(body))
            except errors.CheckpointError as err:
                self._failed(local, err)
                break
            taken = int(answer.get("stored", 0)) if isinstance(answer, dict) else 0
            stored += taken
            if taken < len(part):
                break
        self.stats.puts += stored
        return stored

    def fetch_run(self, hashes: Sequence[str]) -> Run:
        """The longest run of ``hashes`` from the first that the daemons hold, fetched: the
        local daemon, then each other holder, is asked for its run from where the run ends."""
        asked = [
            (index, endpoint)
            for index, endpoint in enumerate(self.endpoints)
            if index == 0 or self.holders is None or endpoint.address in self.holders
        ]
        found = Run(0, 0, False, 0)
        while found.blocks < len(hashes):
            more = self._next_run(asked, hashes[found.blocks : found.blocks + MAX_RUN])
            if more is None:
                self.stats.misses += 1
                break
            found = Run(
                found.blocks + more.blocks,
                more.tokens,
                found.remote or more.remote,
                found.nbytes + more.nbytes,
            )
        return found

    def refresh_holders(self) -> set[str]:
        """Learn which other daemons hold blocks of the service (their usage), for
        ``fetch_run`` to ask only those."""
        path = f"/v1/kv/{quote(self.service, safe='')}/usage"
        holders: set[str] = set()
        for endpoint in self.endpoints[1:]:
            if self._skipped(endpoint):
                continue
            try:
                usage = wire.request(endpoint, "GET", path)
            except errors.CheckpointError as err:
                self._failed(endpoint, err)
                continue
            if isinstance(usage, dict) and int(usage.get("blocks", 0)) > 0:
                holders.add(endpoint.address)
        self.holders = holders
        return holders

    def down(self) -> list[str]:
        """Daemons skipped now, having failed to answer."""
        now = self.clock()
        return [a for a, until in self.stats.down.items() if until > now]

    def _path(self, block_hash: str) -> str:
        return f"/v1/kv/{quote(self.service, safe='')}/blocks/{kvpool.block_hash(block_hash)}"

    def _run_path(self) -> str:
        return f"/v1/kv/{quote(self.service, safe='')}/run"

    def _next_run(
        self, asked: Sequence[tuple[int, wire.Endpoint]], hashes: Sequence[str]
    ) -> Run | None:
        """The first non-empty run of ``hashes`` among the daemons ``asked``; None: none."""
        for index, endpoint in asked:
            if self._skipped(endpoint):
                continue
            try:
                run = self._get_run(endpoint, hashes, remote=index > 0)
            except errors.CheckpointError as err:
                self._failed(endpoint, err)
                continue
            if run.blocks:
                if run.remote:
                    self.stats.remote_hits += run.blocks
                else:
                    self.stats.local_hits += run.blocks
                self.stats.bytes_fetched += run.nbytes
                return run
        return None

    def _get_run(self, endpoint: wire.Endpoint, hashes: Sequence[str], remote: bool) -> Run:
        payload = json.dumps({"blocks": list(hashes)}).encode()
        headers = endpoint.headers({"Content-Type": "application/json"})
        try:
            conn = endpoint.connect()
            try:
                conn.request("POST", self._run_path(), body=payload, headers=headers)
                response = conn.getresponse()
                data = response.read()
                blocks = int(response.getheader(BLOCKS, "0"))
                tokens = int(response.getheader(TOKENS, "0"))
            finally:
                conn.close()
        except (OSError, http.client.HTTPException, ValueError) as err:
            raise errors.DaemonUnreachableError(f"{endpoint.address}: {err!r}") from err
        wire.check(endpoint, response, data)
        if blocks < 0 or blocks > len(hashes) or (blocks > 0) != (tokens > 0 and bool(data)):
            raise errors.IntegrityError(f"{endpoint.address}: a malformed KV run")
        return Run(blocks, tokens, remote and blocks > 0, len(data))

    def _get(self, endpoint: wire.Endpoint, path: str, remote: bool) -> Found:
        download = wire.get_shard(endpoint, path)
        try:
            tokens = int(download.response.getheader(TOKENS, "0"))
            data = download.response.read()
        except (OSError, http.client.HTTPException, ValueError) as err:
            raise errors.DaemonUnreachableError(f"{endpoint.address}: {err!r}") from err
        finally:
            download.close()
        if len(data) != download.size or tokens < 1:
            raise errors.IntegrityError(f"{endpoint.address}: a partial or malformed KV block")
        return Found(tokens, data, remote, endpoint.address)

    def _skipped(self, endpoint: wire.Endpoint) -> bool:
        until = self.stats.down.get(endpoint.address)
        return until is not None and until > self.clock()

    def _failed(self, endpoint: wire.Endpoint, err: errors.CheckpointError) -> None:
        """Count the failure; a daemon that did not answer is skipped for a while."""
        self.stats.failures += 1
        if isinstance(err, errors.DaemonUnreachableError | errors.IntegrityError):
            self.stats.down[endpoint.address] = self.clock() + self.retry_after
            log.warning(
                "KV pool: %s skipped for %.0f s: %s", endpoint.address, self.retry_after, err
            )
        else:  # a refusal or an error status: this request only
            log.info("KV pool: %s: %s", endpoint.address, err)
