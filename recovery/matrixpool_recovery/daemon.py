"""The node checkpoint daemon (console script ``matrixpool-ckpt-daemon``), one per node.

Holds tier-1 shards in memory so they outlive trainer processes and pods, writes tier 2 to the
node's disk and tier 3 under the job's URI, pushes tier-1 copies to the peer daemons it is told
about (the operator picks peers on nodes in another rack), serves shards to restoring
trainers and to peers, and reports its inventory. With ``--kv-pool-bytes`` it also holds the
node's part of the supernode's KV-cache pool: inference services' KV blocks by prefix hash,
within a quota per service (``kvpool``), served to their pods on any node (``kvclient``).
Started by the chart's DaemonSet, by the multi-process tests and by the benchmarks.

Trust (``credentials``): the daemon reads the cluster secret from ``--secret-file`` and accepts
three kinds of bearer token derived from it. A job's token opens that job's routes only (scope
``J`` below); a service's token opens that service's KV routes only (scope ``S``; derived under
another scope name, so a job's token never opens KV routes nor a service's token a job's); the
operator's token opens every route (scope ``operator``). A tier-3 URI must be
``file://`` and resolve inside ``--persistent-root``, which may not overlap the daemon's own
folders; a committed step must be an integer in 0..names.MAX_STEP, no newer than the step saved.

HTTP API (JSON unless noted; every call but healthz and metrics needs
``Authorization: Bearer TOKEN`` of the scope given; 401 without one, 403 out of scope)::

    GET    /v1/healthz                                  liveness, no token
    GET    /metrics                                     Prometheus text (``metrics``), no token
    GET    /v1/info[?job=J]            J or operator    node, memory directory, peers, usage
    GET    /v1/inventory?job=J[&uri=U] J or operator    shards held: job rank step tier size
                                                        checksum (tiers 1 and 2; with U, the
                                                        job's tier-3 URI, tier 3 too)
    GET    /v1/inventory               operator         the same for every job
    POST   /v1/peers                   operator         {"peers": [host:port]}: the peer list
    DELETE /v1/jobs/J                  operator         forget a finished job
    PUT    /v1/jobs/J/pin              operator         {"step": S | null}: keep step S
    and under /v1/jobs/J/ranks/R/steps/S/ (scope J or operator):
    POST   reserve   {"size"}                           a memory buffer to write a shard into
    POST   commit    {"buffer", "checksum", ...}        take a written buffer, start the tiers
    PUT    shard     body: shard bytes                  the same for a peer or a remote trainer
    GET    shard?tier=memory|local|persistent[&uri=U]   the shard bytes (sendfile)
    GET    status?wait=SECONDS                          per tier: pending, ok or error
    and under /v1/kv/ (the KV pool; 503 on each route when --kv-pool-bytes is 0):
    PUT    S/blocks/H                  S or operator    body: block bytes; X-Matrixpool-Tokens:
                                                        the tokens of prefix H; 201, 413 above
                                                        S's quota, 507 no room (``kvpool``)
    GET    S/blocks/H                  S or operator    the block bytes (X-Matrixpool-Tokens);
                                                        404 not held
    POST   S/run                       S or operator    {"blocks": [H...]}: the leading run of
                                                        them held, its bytes one after another
                                                        (X-Matrixpool-Blocks: how many,
                                                        X-Matrixpool-Tokens: the last one's)
    PUT    S/run                       S or operator    body: blocks of one size; headers
                                                        X-Matrixpool-Blocks and -Tokens: comma
                                                        lists; stores them in order until one
                                                        is refused: {"stored": N}
    GET    S/usage                     S or operator    S's used, quota and share bytes, blocks
    PUT    S/quota                     operator         {"bytes": N}: S's quota (its oldest
                                                        blocks above it are evicted)
    DELETE S                           operator         forget S: its blocks and its quota
    GET    usage                       operator         every service's usage, the capacity

Bounds: each connection has a read timeout (``--read-timeout``, 30 s: a request or upload that
sends nothing for that long is dropped, and an upload's buffer goes back to the pool) and
deadlines for the whole: its request line and headers within ``--header-timeout`` (10 s),
then its body and its answer within that again plus their bytes at ``--min-body-rate`` (1 MiB/s):
a client that trickles is cut off there, whatever its pace, and an upload's buffer goes back.
At most ``--max-requests`` (64) connections are served at once, at most
``--max-requests-per-client`` (half of them) from one address; a connection beyond that is
answered 503 at once and closed, without a thread, unless it may be a health check: a few
more (``HEALTH_SLOTS``, one per address) are read within ``HEALTH_TIMEOUT`` (2 s) and answer
``GET /v1/healthz`` alone, so that the kubelet's probe passes while clients hold every slot.
Tier 2 and 3 report ``ok`` only once the written file was
read back and matched the shard's checksum. A KV block is at most ``MAX_KV_BLOCK`` (64 MiB) and
is refused (413) before its body is read when it could never fit the service's quota; the
pool's bytes come out of ``--memory-bytes`` (the container's limit), not on top of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import mmap
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from matrixpool_recovery import (
    checksum,
    credentials,
    errors,
    fdpass,
    files,
    kvpool,
    manifest,
    memory,
    metrics,
    names,
    wire,
)
from matrixpool_recovery.spec import LOCAL, MEMORY, PEERS, PERSISTENT, TIERS

log = logging.getLogger("matrixpool_recovery.daemon")
MAX_JSON = 1 << 20  # bytes of a JSON request body
MAX_PEER_REPLICAS = 64  # tier-1 copies a save may ask for (the CRD allows far fewer)
MAX_SHARD_BYTES = 1 << 50  # a reservation's size, before the memory bound refuses it
RECEIVE_PIECE = 4 << 20  # bytes per read when a shard arrives
MAX_WAIT = 60.0  # seconds a status request may wait
LINGER_SECONDS = 5.0  # seconds to wait for the rest of a refused upload
STATUSES_KEPT = 4096  # save statuses remembered
READ_TIMEOUT = 30.0  # seconds a connection may send nothing before it is dropped
MAX_REQUESTS = 64  # connections served at once; more are answered 503
HEADER_TIMEOUT = 10.0  # seconds a request line and its headers may take in all
MIN_BODY_RATE = 1 << 20  # bytes a second a request or an answer body may not fall below
HEALTH_SLOTS = 4  # connections served beside the others, health checks only, one per client
HEALTH_TIMEOUT = 2.0  # seconds such a connection may take in all
MAX_KV_BLOCK = 64 << 20  # bytes of one KV block upload
MAX_KV_QUOTA = 1 << 50  # bytes a KV quota may name
MAX_KV_RUN = 1024  # blocks one run request may name (16K tokens of a 16-token block)
NO_KV_POOL = "this daemon has no KV pool (started with --kv-pool-bytes 0)"
BUSY_BODY = b'{"error": "too many requests in flight"}'  # the 503 answer's body
BUSY_ANSWER = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(BUSY_BODY), BUSY_BODY)
)
ReadInto = Callable[[memoryview], int]  # fills a buffer from the request body
Scope = tuple[str, str] | None  # (credentials.JOB or SERVICE, its UID); None: the operator only
_STATUS = {
    errors.InvalidNameError: 400,
    errors.NotFoundError: 404,
    errors.MemoryFullError: 507,
    errors.IntegrityError: 422,
}


@dataclass(frozen=True)
class SaveOptions:
    """What a save asks of the daemon, from a commit body or upload headers."""

    world_size: int  # ranks of the job
    tiers: tuple[str, ...]  # of memory, local, persistent
    peer_replicas: int = 0  # tier-1 copies to push to peers
    persistent_uri: str | None = None  # tier 3
    committed: int | None = None  # newest step committed for every rank, as the trainer knows
    origin: str = ""  # node whose trainer wrote the shard
    replica: bool = False  # a peer's copy: keep, do not push further
    incarnation: int = 0  # the run of the job that wrote the shard
    base: int = -1  # the step that run restored from; -1: none
    committed_incarnation: int = 0  # the incarnation `committed` belongs to

    @classmethod
    def parse(cls, get: Callable[[str], Any], origin: str) -> SaveOptions:
        tiers = tuple(t for t in str(get("tiers") or MEMORY).split(",") if t)
        if not tiers or not set(tiers) <= set(TIERS):
            raise ValueError(f"tiers {tiers} not among {TIERS}")
        base = get("base")
        return cls(
            world_size=_world_size(get("worldSize")),
            tiers=tiers,
            peer_replicas=names.number(
                str(get("peerReplicas") or 0), "peerReplicas", MAX_PEER_REPLICAS
            ),
            persistent_uri=get("persistentUri") or None,
            committed=committed_step(get("committed")),
            origin=str(get("origin") or origin),
            replica=str(get("replica") or "") in ("1", "true", "True"),
            incarnation=_incarnation(get("incarnation")),
            base=-1 if base in (None, "", -1, "-1") else names.step(str(base)),
            committed_incarnation=_incarnation(get("committedIncarnation")),
        )

    def record(self, rank: int, size: int, checksum: str, buffer: str) -> manifest.ShardRecord:
        """The shard record of a save with these options."""
        return manifest.ShardRecord(
            rank, size, checksum, self.origin, buffer, self.incarnation, self.base
        )


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number of JSON")


def _finite(text: str) -> float:
    """A JSON number with a fraction or an exponent, refused when it overflows (1e400)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _world_size(value: Any) -> int:
    """A job's world size from a header or a JSON body: 1..MAX_RANK + 1 ranks."""
    size = names.number(str(value), "worldSize", names.MAX_RANK + 1)
    if size < 1:
        raise errors.InvalidNameError("invalid worldSize 0: a job has at least one rank")
    return size


def _incarnation(value: Any) -> int:
    """An incarnation number from a header or a JSON body: a non-negative integer."""
    return 0 if value in (None, "") else names.number(str(value), "incarnation", names.MAX_STEP)


def committed_step(value: Any, saved: int | None = None) -> int | None:
    """A committed step a trainer reports: None, or an integer in 0..MAX_STEP no newer than
    the step `saved` in the same request (a step above it would unprotect the real one)."""
    if value is None or value == "":
        return None
    step = names.number(value, "committed step", names.MAX_STEP)
    if saved is not None and step > saved:
        raise errors.InvalidNameError(f"invalid committed step {step}: above the step {saved}")
    return step


@dataclass
class SaveStatus:
    """Outcome per tier of one save; waiters are woken as tiers finish."""

    results: dict[str, dict[str, Any] | None]  # tier -> None (pending) or its outcome
    cond: threading.Condition = field(default_factory=threading.Condition)

    def set(self, tier: str, outcome: dict[str, Any]) -> None:
        with self.cond:
            self.results[tier] = outcome
            self.cond.notify_all()

    def wait(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while None in self.results.values() and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)
            return {t: r or {"state": "pending"} for t, r in self.results.items()}


class Daemon:
    """State of one node's daemon; the request handler calls it."""

    def __init__(
        self,
        node: str,
        secret: str,
        mem: memory.MemoryTier,
        disk: files.DiskTier,
        peers: Sequence[str],
        keep: int,
        workers: int = 4,
        persistent_root: Path | None = None,
        kv_pool_bytes: int = 0,
    ) -> None:
        self.node = node  # this node's name
        self.secret = secret  # the cluster secret every token is derived from
        self.operator = credentials.operator_token(secret)  # opens every route
        self.persistent_root = persistent_root  # tier-3 URIs resolve inside it; None: no tier 3
        self.memory = mem  # tier 1
        self.disk = disk  # tier 2
        self.peers = list(peers)  # daemons to push tier-1 copies to, in order of preference
        self.keep = keep  # steps kept per job and tier
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ckpt-tier")
        self.nonce = secrets.token_hex(16)  # proves a trainer's socket leads to this daemon
        self._statuses: OrderedDict[tuple[str, int, int], SaveStatus] = OrderedDict()
        self._lock = threading.Lock()
        self.kv = kvpool.KvPool(kv_pool_bytes) if kv_pool_bytes > 0 else None  # None: no pool
        self._kv_lock = threading.Lock()  # the pool is not thread-safe
        if self.kv is not None:
            metrics.watch_kv_pool(self._kv_bytes, kv_pool_bytes)
        metrics.watch_memory(mem.used, mem.limit)

    def authorized(self, header: str | None, scope: Scope) -> None:
        """Accept the operator's token, or the token of the job or service `scope` names
        (None: the operator's only)."""
        needed = "the operator token"
        if scope is not None:
            needed = f"the {scope[0]} token of {scope[1]} or {needed}"
        scheme, _, given = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise errors.AuthError(f"needs Authorization: Bearer TOKEN ({needed})", 401)
        given = given.strip()
        if credentials.matches(given, self.operator):
            return
        if scope is not None and credentials.matches(
            given, credentials.scoped_token(self.secret, *scope)
        ):
            return
        raise errors.AuthError(f"the token does not open this route: it needs {needed}", 403)

    def persistent(self, uri: str | None) -> files.Persistent:
        """The tier-3 store of a save, refused (400) unless it resolves inside the root."""
        if not uri:
            raise errors.InvalidNameError("a persistent save needs a persistent URI")
        if self.persistent_root is None:
            raise errors.InvalidNameError(f"this daemon has no persistent root: {uri!r} refused")
        try:
            store = files.Persistent(uri, self.keep)
        except errors.CheckpointError as err:  # not file://
            raise errors.InvalidNameError(str(err)) from err
        where, root = store.root.resolve(), self.persistent_root.resolve()
        if not where.is_relative_to(root):
            raise errors.InvalidNameError(
                f"persistent URI {uri!r} resolves to {where}, outside the daemon's persistent "
                f"root {root}"
            )
        return store

    def admit(self, step: int, options: SaveOptions) -> None:
        """Refuse (400) a save whose committed step or tier-3 URI the daemon must not take."""
        committed_step(options.committed, step)
        if PERSISTENT in options.tiers:
            self.persistent(options.persistent_uri)

    def info(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "memoryDir": str(self.memory.root),
            "memoryBytes": self.memory.limit,
            "usedBytes": self.memory.used(),
            "peers": self.peers,
            "keep": self.keep,
            "socket": str(fdpass.socket_path(self.memory.root)),
            "probe": {"nonce": self.nonce},
        }

    def hand_out(self, request: dict[str, Any]) -> fdpass.Answer:
        """A request on the daemon's socket (``fdpass``): the job's token opens the job's own
        buffers and shards only."""
        job = names.job(str(request.get("job", "")))
        self.authorized(f"Bearer {request.get('token', '')}", (credentials.JOB, job))
        match request.get("open"):
            case "probe":
                return {"nonce": self.nonce}, None
            case "buffer":
                fd = self.memory.open_buffer(job, str(request.get("buffer", "")))
                return {"size": os.fstat(fd).st_size}, fd
            case "shard":
                rank = names.rank(request.get("rank", ""))
                step = names.step(request.get("step", ""))
                started = time.perf_counter()
                record, fd = self.memory.open_shard(job, rank, step)
                metrics.observe(MEMORY, metrics.RESTORE, record.size, time.perf_counter() - started)
                return record.to_json(), fd
        raise errors.InvalidNameError(f"open {request.get('open')!r}: probe, buffer or shard")

    def inventory(self, job: str | None, uri: str | None = None) -> dict[str, Any]:
        """Shards held in tiers 1 and 2, and with `uri` (a job's own) its tier-3 ones."""
        disk = [m for m in self.disk.manifests(job) if m.tier == LOCAL]
        found = self.memory.manifests(job) + disk
        refused: dict[str, str] = {}
        if uri and job:
            try:
                found += self.persistent(uri).manifests(job)
            except errors.InvalidNameError as err:  # tiers 1 and 2 are still worth having
                refused["persistentError"] = str(err)
        shards = [h.to_json() for m in found for h in manifest.holdings(m)]
        return {"node": self.node, "shards": shards, **refused}

    # --- saves ---

    def stored(
        self,
        job: str,
        rank: int,
        step: int,
        record: manifest.ShardRecord,
        options: SaveOptions,
        started: float | None = None,
    ) -> dict[str, Any]:
        """A written buffer becomes a tier-1 shard (or transit); the other tiers start.

        `started`: when the upload began (perf_counter), for the tier-1 save latency.
        """
        started = time.perf_counter() if started is None else started
        self.memory.protect(job, options.committed, options.committed_incarnation)
        hold = MEMORY in options.tiers
        tasks = self._tasks(job, rank, step, record, options, hold)
        paths = {tier: self.memory.busy(record.buffer) for tier in tasks}  # before it is held
        try:
            self.memory.commit(job, rank, step, record, options.world_size, hold)
        except errors.CheckpointError as err:
            for _ in tasks:
                self.memory.unbusy(record.buffer)
            if isinstance(err, errors.IntegrityError | errors.DaemonError):
                self.memory.abandon(record.buffer)
            raise
        pending: dict[str, dict[str, Any] | None] = dict.fromkeys(tasks)
        if hold:
            pending[MEMORY] = None
        status = SaveStatus(pending)
        with self._lock:
            self._statuses[(job, rank, step)] = status
            while len(self._statuses) > STATUSES_KEPT:
                self._statuses.popitem(last=False)
        if hold:
            status.set(MEMORY, {"state": "ok", "node": self.node})
            metrics.observe(MEMORY, metrics.SAVE, record.size, time.perf_counter() - started)
        self._start(record.buffer, tasks, paths, status, hold)
        return {"node": self.node, "tiers": list(status.results)}

    def _tasks(
        self,
        job: str,
        rank: int,
        step: int,
        record: manifest.ShardRecord,
        options: SaveOptions,
        hold: bool,
    ) -> dict[str, Callable[[Path], dict[str, Any]]]:
        tasks: dict[str, Callable[[Path], dict[str, Any]]] = {}
        if hold and options.peer_replicas > 0 and not options.replica:
            tasks[PEERS] = lambda p: self._replicate(job, rank, step, record, options, p)
        if LOCAL in options.tiers:
            tasks[LOCAL] = lambda p: self._local(job, step, record, options, p)
        if PERSISTENT in options.tiers:
            tasks[PERSISTENT] = lambda p: self._persist(job, step, record, options, p)
        return tasks

    def _start(
        self,
        buffer_id: str,
        tasks: dict[str, Callable[[Path], dict[str, Any]]],
        paths: dict[str, Path],
        status: SaveStatus,
        hold: bool,
    ) -> None:
        """Run the tasks; each already counts as a reader of the buffer (``busy``)."""
        if not tasks and not hold:
            self.memory.release_transit(buffer_id)
        left = [len(tasks)]

        def run(tier: str, task: Callable[[Path], dict[str, Any]]) -> None:
            try:
                status.set(tier, task(paths[tier]))
            except Exception as err:  # every failure is reported to the trainer
                log.warning("%s tier of %s failed: %s", tier, buffer_id, err)
                metrics.failed(tier, metrics.REPLICATE if tier == PEERS else metrics.SAVE)
                status.set(tier, {"state": "error", "error": _describe(tier, err)})
            finally:
                self.memory.unbusy(buffer_id)
                with self._lock:
                    left[0] -= 1
                    done = left[0] == 0
                if done and not hold:
                    self.memory.release_transit(buffer_id)

        for tier, task in tasks.items():
            self.pool.submit(run, tier, task)

    def _local(
        self, job: str, step: int, record: manifest.ShardRecord, options: SaveOptions, path: Path
    ) -> dict[str, Any]:
        """A tier-2 save; ``verifySeconds``: the part spent reading the written file back."""
        started = time.perf_counter()
        verify = self.disk.store(path, record, job, step, options.world_size)
        seconds = time.perf_counter() - started
        metrics.observe(LOCAL, metrics.SAVE, record.size, seconds)
        return {"state": "ok", "seconds": seconds, "verifySeconds": verify}

    def _persist(
        self, job: str, step: int, record: manifest.ShardRecord, options: SaveOptions, path: Path
    ) -> dict[str, Any]:
        store = self.persistent(options.persistent_uri)
        started = time.perf_counter()
        try:
            committed = store.store(path, record, job, step, options.world_size)
        except OSError as err:
            raise errors.CheckpointError(
                f"persistent tier {options.persistent_uri} unwritable: {err}"
            ) from err
        seconds = time.perf_counter() - started
        metrics.observe(PERSISTENT, metrics.SAVE, record.size, seconds)
        return {"state": "ok", "seconds": seconds, "committed": committed}

    def _replicate(
        self,
        job: str,
        rank: int,
        step: int,
        record: manifest.ShardRecord,
        options: SaveOptions,
        path: Path,
    ) -> dict[str, Any]:
        """Push the shard to `peer_replicas` peers, in the order of the peer list."""
        meta = _upload_meta(record, options.world_size, MEMORY, self.node, replica=True)
        if options.committed is not None:  # the peer keeps the committed step too
            meta[wire.HEADER + "Committed"] = str(options.committed)
            meta[wire.HEADER + "Committed-Incarnation"] = str(options.committed_incarnation)
        url = wire.shard_path(job, rank, step, "shard")
        token = credentials.job_token(self.secret, job)  # the peer opens this job's routes only
        reached: list[str] = []
        failures: list[str] = []
        started = time.perf_counter()
        for peer in self.peers:
            if len(reached) == options.peer_replicas:
                break
            try:
                answer = wire.put_shard(wire.Endpoint(peer, token), url, meta, path, record.size)
                reached.append(str(answer.get("node", peer)))
            except errors.CheckpointError as err:
                failures.append(str(err))
        seconds = time.perf_counter() - started
        if len(reached) < options.peer_replicas:
            raise errors.CheckpointError(
                f"copied to {len(reached)} of {options.peer_replicas} peers "
                f"({', '.join(failures) or 'no peers configured'})"
            )
        metrics.observe(PEERS, metrics.REPLICATE, record.size * len(reached), seconds)
        return {
            "state": "ok",
            "nodes": reached,
            "seconds": seconds,
            "bytes": record.size * len(reached),
        }

    def status(self, job: str, rank: int, step: int, wait: float) -> dict[str, Any]:
        with self._lock:
            found = self._statuses.get((job, rank, step))
        if found is None:
            raise errors.NotFoundError(f"no save of {job}/{rank}/{step} on {self.node}", 404)
        return {"node": self.node, "tiers": found.wait(min(wait, MAX_WAIT))}

    # --- the KV pool ---

    def _pool(self) -> kvpool.KvPool:
        if self.kv is None:
            raise errors.DaemonError(NO_KV_POOL, 503)
        return self.kv

    def label(self, service: str) -> str:
        """A service as the metrics name it: never its UID (``credentials.metrics_label``)."""
        return credentials.metrics_label(self.secret, service)

    def kv_admit(self, service: str, size: int) -> None:
        """Refuse (413) a block upload that could never fit, before its body is read."""
        pool = self._pool()
        if size <= 0:
            raise ValueError("a KV block upload needs a Content-Length above 0")
        if size > MAX_KV_BLOCK:
            raise errors.DaemonError(f"a KV block of {size} bytes: at most {MAX_KV_BLOCK}", 413)
        with self._kv_lock:
            refused = pool.admits(service, size)
        if refused is not None:
            metrics.kv_refused(self.label(service), refused.why)
            raise errors.DaemonError(refused.reason, 413)

    def kv_put(self, service: str, block_hash: str, block: kvpool.Block) -> dict[str, Any]:
        pool = self._pool()
        with self._kv_lock:
            result = pool.put(service, block_hash, block)
            usage = pool.usage_of(service)
        if isinstance(result, kvpool.Refused):
            metrics.kv_refused(self.label(service), result.why)
            status = 413 if result.why is kvpool.Refusal.TOO_LARGE else 507
            raise errors.DaemonError(result.reason, status)
        metrics.kv_stored(self.label(service), block.size)
        metrics.kv_evicted([self.label(owner) for owner, _ in result.evicted])
        return {
            "node": self.node,
            "service": service,
            "hash": block_hash,
            "bytes": block.size,
            "evicted": len(result.evicted),
            "usedBytes": usage.used_bytes,
        }

    def kv_get(self, service: str, block_hash: str) -> kvpool.Block:
        pool = self._pool()
        with self._kv_lock:
            block = pool.get(service, block_hash)
        metrics.kv_looked_up(self.label(service), None if block is None else block.size)
        if block is None:
            raise errors.NotFoundError(f"no KV block {block_hash} of {service} on {self.node}", 404)
        return block

    def kv_run(self, service: str, hashes: Sequence[str]) -> list[kvpool.Block]:
        """The leading run of ``hashes`` the service holds here (a look-up per block)."""
        pool = self._pool()
        run: list[kvpool.Block] = []
        with self._kv_lock:
            for block_hash in hashes:
                block = pool.get(service, block_hash)
                if block is None:
                    break
                run.append(block)
        for block in run:
            metrics.kv_looked_up(self.label(service), block.size)
        if len(run) < len(hashes):
            metrics.kv_looked_up(self.label(service), None)
        return run

    def kv_quota(self, service: str, quota: int) -> dict[str, Any]:
        pool = self._pool()
        with self._kv_lock:
            evicted = pool.set_quota(service, quota)
        metrics.kv_evicted([self.label(owner) for owner, _ in evicted])
        return {**self.kv_usage(service), "evicted": len(evicted)}

    def kv_forget(self, service: str) -> dict[str, Any]:
        pool = self._pool()
        with self._kv_lock:
            dropped = pool.forget(service)
        metrics.kv_forget(self.label(service))
        return {"node": self.node, "service": service, "deleted": dropped}

    def kv_usage(self, service: str | None) -> dict[str, Any]:
        """One service's usage, or every service's (None)."""
        pool = self._pool()
        with self._kv_lock:
            found = pool.usage() if service is None else {service: pool.usage_of(service)}
            capacity, used = pool.capacity_bytes, pool.used_bytes
        services = {s: _usage_json(u) for s, u in found.items()}
        if service is not None:
            return {"node": self.node, "service": service, **services[service]}
        return {
            "node": self.node,
            "capacityBytes": capacity,
            "usedBytes": used,
            "services": services,
        }

    def _kv_bytes(self) -> dict[str, tuple[int, int]]:
        """Used and quota bytes per service, for the metrics."""
        with self._kv_lock:
            found = self._pool().usage()
        return {self.label(s): (u.used_bytes, u.quota_bytes) for s, u in found.items()}

    def receive(
        self, job: str, rank: int, step: int, size: int, expected: str, read_into: ReadInto
    ) -> manifest.ShardRecord:
        """Read an uploaded shard into a reserved buffer, verifying its checksum."""
        buffer = self.memory.reserve(job, rank, step, size)
        running = checksum.Running(checksum.algorithm_of(expected))
        path = self.memory.busy(buffer.id)  # written here: never reclaimed meanwhile
        try:
            with open(path, "r+b") as file, _mapped(file, size) as view:
                _receive(read_into, view, running)
            checksum.verify(expected, running, f"upload of {job}/{rank}/{step}")
        except BaseException:
            self.memory.unbusy(buffer.id)
            self.memory.abandon(buffer.id)
            metrics.failed(MEMORY, metrics.SAVE)
            raise
        self.memory.unbusy(buffer.id)
        return manifest.ShardRecord(rank, size, expected, buffer=buffer.id)


@contextlib.contextmanager
def _mapped(file: Any, size: int) -> Iterator[memoryview]:
    # Populating the page table up front is 2-3x faster than one fault per page on receive.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(file.fileno(), size, flags=flags)
    view = memoryview(mapping)
    try:
        yield view
    finally:
        view.release()
        mapping.close()


def _receive(read_into: ReadInto, view: memoryview, running: checksum.Running) -> None:
    offset = 0
    for _ in range(len(view) // 4096 + 64):
        if offset == len(view):
            return
        got = read_into(view[offset : offset + RECEIVE_PIECE])
        if not got:
            break
        running.update(view[offset : offset + got])
        offset += got
    if offset != len(view):
        raise errors.IntegrityError(f"upload ended after {offset} of {len(view)} bytes")


def _upload_meta(
    record: manifest.ShardRecord, world_size: int, tiers: str, origin: str, replica: bool
) -> dict[str, str]:
    return {
        wire.HEADER + "Checksum": record.checksum,
        wire.HEADER + "World-Size": str(world_size),
        wire.HEADER + "Tiers": tiers,
        wire.HEADER + "Origin": origin,
        wire.HEADER + "Replica": "1" if replica else "0",
        wire.HEADER + "Incarnation": str(record.incarnation),
        wire.HEADER + "Base": str(record.base),
    }


def _run_hashes(listed: object) -> list[str]:
    """A run's block hashes: 1..MAX_KV_RUN valid ones, or ValueError."""
    if not isinstance(listed, list) or not 1 <= len(listed) <= MAX_KV_RUN:
        raise ValueError(f"a KV run names 1..{MAX_KV_RUN} block hashes")
    return [kvpool.block_hash(str(h)) for h in listed]


def _usage_json(usage: kvpool.Usage) -> dict[str, int]:
    return {
        "usedBytes": usage.used_bytes,
        "quotaBytes": usage.quota_bytes,
        "shareBytes": usage.share_bytes,
        "blocks": usage.blocks,
    }


def _describe(tier: str, err: Exception) -> str:
    return f"{tier}: {err or repr(err)}" if isinstance(err, OSError) else str(err) or repr(err)


def _scope(method: str, segments: list[str], query: dict[str, str]) -> Scope:
    """The job or service whose token may call this route; None: the operator's token only."""
    match method, segments:
        case "GET", ["v1", "info" | "inventory"]:
            job = query.get("job")
            return None if job is None else (credentials.JOB, job)
        case _, ["v1", "jobs", job, "ranks", *_]:
            return (credentials.JOB, job)
        case _, (["v1", "kv", service, "blocks", _] | ["v1", "kv", service, "run"]):
            return (credentials.SERVICE, service)
        case "GET", ["v1", "kv", service, "usage"]:
            return (credentials.SERVICE, service)
    return None  # peers, pins, deletes, KV quotas, unknown routes


class Handler(BaseHTTPRequestHandler):
    """Routes requests to the Daemon; errors become JSON answers with a status code."""

    server: Server
    protocol_version = "HTTP/1.0"
    body_read = False  # whether the request body was consumed (see _linger)

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.read_timeout)  # every read and write
        deadline = time.monotonic() + self.server.header_timeout  # the request line, headers
        self.watch = self.server.watchdog.arm(self.connection, deadline)

    def parse_request(self) -> bool:
        """The request line and headers read in time: the body has its own deadline."""
        if not super().parse_request():
            return False
        length = self.headers.get("Content-Length", "0") or "0"
        self.allow(int(length) if length.isascii() and length.isdigit() else 0)
        return True

    def allow(self, nbytes: int, waiting: float = 0.0) -> None:
        """Give the connection time for `nbytes` more at the slowest pace it may keep, and for
        `waiting` seconds the daemon itself takes (a status request's wait)."""
        server = self.server
        spare = server.header_timeout + waiting
        server.watchdog.extend(self.watch, time.monotonic() + spare + nbytes / server.min_body_rate)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.watchdog.disarm(self.watch)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _dispatch(self, method: str) -> None:
        self.body_read = False  # an error answer must drain what the client still sends
        parts = urlsplit(self.path)
        segments = [unquote(s) for s in parts.path.split("/")[1:]]
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            if segments not in (["v1", "healthz"], ["metrics"]):
                scope = _scope(method, segments, query)
                self.server.daemon.authorized(self.headers.get("Authorization"), scope)
            self._route(method, segments, query)
        except Exception as err:
            self._fail(err)

    def _route(self, method: str, segments: list[str], query: dict[str, str]) -> None:
        daemon = self.server.daemon
        match method, segments:
            case "GET", ["v1", "healthz"]:
                self._json({"ok": True, "node": daemon.node})
            case "GET", ["metrics"]:
                self._send(*metrics.exposition())
            case "GET", ["v1", "info"]:
                self._json(daemon.info())
            case "GET", ["v1", "inventory"]:
                job = query.get("job")
                uri = query.get("uri")
                self._json(daemon.inventory(names.job(job) if job else None, uri))
            case "POST", ["v1", "peers"]:
                daemon.peers = [str(p) for p in self._body()["peers"]]
                self._json({"peers": daemon.peers})
            case "DELETE", ["v1", "jobs", job]:
                daemon.memory.drop_job(names.job(job))
                daemon.disk.drop_job(job)
                self._json({"deleted": job})
            case "PUT", ["v1", "jobs", job, "pin"]:
                step = self._body().get("step")
                pinned = None if step is None else names.step(str(step))
                daemon.memory.pin(names.job(job), pinned)
                if pinned is None:
                    daemon.disk.pinned.pop(names.job(job), None)
                else:
                    daemon.disk.pinned[names.job(job)] = pinned
                self._json({"job": job, "pinned": pinned})
            case _, ["v1", "jobs", job, "ranks", rank, "steps", step, action]:
                key = (names.job(job), names.rank(rank), names.step(step))
                self._shard(method, action, *key, query)
            case _, ["v1", "kv", *rest]:
                self._kv(method, rest)
            case _:
                raise errors.NotFoundError(f"no route {method} {self.path}", 404)

    def _kv(self, method: str, rest: list[str]) -> None:
        daemon = self.server.daemon
        match method, rest:
            case "PUT", [service, "blocks", block_hash]:
                self._kv_upload(names.job(service), kvpool.block_hash(block_hash))
            case "GET", [service, "blocks", block_hash]:
                self._kv_send(names.job(service), kvpool.block_hash(block_hash))
            case "POST", [service, "run"]:
                self._kv_send_run(names.job(service), _run_hashes(self._body().get("blocks")))
            case "PUT", [service, "run"]:
                self._kv_upload_run(names.job(service))
            case "GET", [service, "usage"]:
                self._json(daemon.kv_usage(names.job(service)))
            case "PUT", [service, "quota"]:
                quota = names.number(self._body()["bytes"], "quota", MAX_KV_QUOTA)
                self._json(daemon.kv_quota(names.job(service), quota))
            case "DELETE", [service]:
                self._json(daemon.kv_forget(names.job(service)))
            case "GET", ["usage"]:
                self._json(daemon.kv_usage(None))
            case _:
                raise errors.NotFoundError(f"no route {method} {self.path}", 404)

    def _kv_upload(self, service: str, block_hash: str) -> None:
        daemon = self.server.daemon
        size = int(self.headers.get("Content-Length", "-1"))
        tokens = names.number(
            self.headers.get(wire.HEADER + "Tokens", ""), "token count", kvpool.MAX_TOKENS
        )
        daemon.kv_admit(service, size)
        self.body_read = True  # from here on, it is read or the connection is broken
        data = self.rfile.read(size)
        if len(data) != size:
            raise errors.IntegrityError(f"KV block upload ended after {len(data)} of {size} bytes")
        self._json(daemon.kv_put(service, block_hash, kvpool.Block(tokens, data)), 201)

    def _kv_send_run(self, service: str, hashes: list[str]) -> None:
        run = self.server.daemon.kv_run(service, hashes)
        size = sum(block.size for block in run)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.send_header(wire.HEADER + "Blocks", str(len(run)))
        self.send_header(wire.HEADER + "Tokens", str(run[-1].tokens if run else 0))
        self.end_headers()
        self.allow(size)
        for block in run:
            self.wfile.write(block.data)

    def _kv_upload_run(self, service: str) -> None:
        daemon = self.server.daemon
        hashes = _run_hashes(self.headers.get(wire.HEADER + "Blocks", "").split(","))
        tokens = [
            names.number(t, "token count", kvpool.MAX_TOKENS)
            for t in self.headers.get(wire.HEADER + "Tokens", "").split(",")
        ]
        size = int(self.headers.get("Content-Length", "-1"))
        if len(tokens) != len(hashes) or size <= 0 or size % len(hashes):
            raise ValueError("a KV run needs a token count per block and blocks of one size")
        if size > MAX_KV_BLOCK:
            raise errors.DaemonError(f"a KV run of {size} bytes: at most {MAX_KV_BLOCK}", 413)
        daemon.kv_admit(service, size // len(hashes))
        self.body_read = True  # from here on, it is read or the connection is broken
        data = self.rfile.read(size)
        if len(data) != size:
            raise errors.IntegrityError(f"KV run upload ended after {len(data)} of {size} bytes")
        each, stored = size // len(hashes), 0
        for index, (block_hash, count) in enumerate(zip(hashes, tokens, strict=True)):
            block = kvpool.Block(count, data[index * each : (index + 1) * each])
            try:
                daemon.kv_put(service, block_hash, block)
            except errors.DaemonError:  # no room: the rest would not fit either
                break
            stored += 1
        self._json({"node": daemon.node, "service": service, "stored": stored}, 201)

    def _kv_send(self, service: str, block_hash: str) -> None:
        block = self.server.daemon.kv_get(service, block_hash)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(block.size))
        self.send_header(wire.HEADER + "Tokens", str(block.tokens))
        self.end_headers()
        self.allow(len(block.data))
        self.wfile.write(block.data)

    def _shard(
        self, method: str, action: str, job: str, rank: int, step: int, query: dict[str, str]
    ) -> None:
        daemon = self.server.daemon
        match method, action:
            case "POST", "reserve":
                body = self._body()
                daemon.memory.protect(
                    job,
                    committed_step(body.get("committed"), step),
                    _incarnation(body.get("committedIncarnation")),
                )
                size = names.number(body.get("size", ""), "size", MAX_SHARD_BYTES)
                buffer = daemon.memory.reserve(job, rank, step, size)
                where = str(daemon.memory.path(buffer.id))
                live = daemon.memory.owned(job, rank)
                self._json({"buffer": buffer.id, "path": where, "size": buffer.size, "live": live})
            case "POST", "commit":
                body = self._body()
                options = SaveOptions.parse(body.get, daemon.node)
                daemon.admit(step, options)
                record = options.record(
                    rank,
                    names.number(body.get("size", ""), "size", MAX_SHARD_BYTES),
                    str(body["checksum"]),
                    str(body["buffer"]),
                )
                self._json(daemon.stored(job, rank, step, record, options))
            case "PUT", "shard":
                self._upload(job, rank, step)
            case "GET", "shard":
                self._send_shard(job, rank, step, query.get("tier", MEMORY), query.get("uri"))
            case "GET", "status":
                wait = min(float(query.get("wait", "0")), MAX_WAIT)
                if not 0 <= wait <= MAX_WAIT:  # NaN
                    raise ValueError(f"wait={query.get('wait')!r}: 0..{MAX_WAIT} seconds")
                self.allow(0, wait)  # a status request may wait that long for its answer
                self._json(daemon.status(job, rank, step, wait))
            case _:
                raise errors.NotFoundError(f"no route {method} {self.path}", 404)

    def _upload(self, job: str, rank: int, step: int) -> None:
        daemon = self.server.daemon
        size = int(self.headers.get("Content-Length", "-1"))
        if size <= 0:
            raise ValueError("an upload needs a Content-Length")
        meta = {k.removeprefix(wire.HEADER).lower(): v for k, v in self.headers.items()}

        def get(key: str) -> Any:
            return meta.get(re.sub(r"([A-Z])", r"-\1", key).lower())

        options = SaveOptions.parse(get, daemon.node)
        daemon.admit(step, options)
        self.body_read = True  # from here on, receive reads it or the connection is broken
        started = time.perf_counter()
        record = daemon.receive(job, rank, step, size, str(get("checksum")), self.rfile.readinto)
        stored = options.record(rank, size, record.checksum, record.buffer)
        self._json(daemon.stored(job, rank, step, stored, options, started))

    def _send_shard(
        self, job: str, rank: int, step: int, tier: str, uri: str | None = None
    ) -> None:
        daemon = self.server.daemon
        if tier == MEMORY:
            record, path = daemon.memory.acquire(job, rank, step)
        elif tier == LOCAL:
            record, path = daemon.disk.locate(job, rank, step)
        elif tier == PERSISTENT:
            record, path = daemon.persistent(uri).locate(job, rank, step)
        else:
            raise ValueError(f"tier {tier!r}: memory, local or persistent")
        started = time.perf_counter()
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.send_header(wire.HEADER + "Checksum", record.checksum)
                self.send_header(wire.HEADER + "Origin", record.origin)
                self.end_headers()
                self.wfile.flush()
                self.allow(size)
                self.connection.sendfile(file, 0, size)
            metrics.observe(tier, metrics.SERVE, size, time.perf_counter() - started)
        except (BrokenPipeError, ConnectionResetError) as err:
            # The reader stopped: it wanted the start of the shard only (the DCP Metadata of
            # matrixpool_recovery.torch), or it is gone. Not the daemon's failure.
            log.debug("GET %s: the reader closed the connection (%r)", self.path, err)
            self.close_connection = True
        except OSError:
            metrics.failed(tier, metrics.SERVE)
            raise
        finally:
            if tier == MEMORY:
                daemon.memory.unbusy(record.buffer)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length", "0"))
        if not 0 < length <= MAX_JSON:
            raise ValueError(f"a JSON body of 1..{MAX_JSON} bytes is needed")
        self.body_read = True
        try:
            body = json.loads(
                self.rfile.read(length), parse_constant=_no_constant, parse_float=_finite
            )
        except RecursionError:
            raise ValueError("the JSON body is nested too deeply") from None
        if not isinstance(body, dict):
            raise ValueError("the JSON body must be an object")
        return body

    def _json(self, data: Any, status: int = 200) -> None:
        self._send(json.dumps(data).encode(), "application/json", status)

    def _send(self, payload: bytes, content_type: str, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _fail(self, err: Exception) -> None:
        status = next((code for kind, code in _STATUS.items() if isinstance(err, kind)), 0)
        if isinstance(err, errors.DaemonError) and err.status:
            status = err.status
        elif not status:
            status = 400 if isinstance(err, ValueError | KeyError | TypeError) else 500
        if status >= 500:
            log.warning("%s %s failed: %r", self.command, self.path, err)
        with contextlib.suppress(OSError):
            self._json({"error": str(err) or repr(err)}, status)
            self._linger()

    def _linger(self) -> None:
        """Drop the body the client is still sending, so that it reads the answer.

        Closing with unread bytes would reset the connection and lose the answer.
        """
        left = int(self.headers.get("Content-Length", "0") or 0)
        if self.body_read or left <= 0:
            return
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_WR)
        self.connection.settimeout(LINGER_SECONDS)
        scratch = memoryview(bytearray(RECEIVE_PIECE))
        for _ in range(left // len(scratch) + 1):
            got = self.rfile.readinto(scratch[: min(left, len(scratch))])
            left -= got
            if not got or left <= 0:
                return


class HealthHandler(Handler):
    """A connection beyond the slots: answers ``GET /v1/healthz``, and 503 to anything else,
    cut off after ``HEALTH_TIMEOUT`` (a probe sends its few bytes at once)."""

    def setup(self) -> None:
        super().setup()
        deadline = time.monotonic() + min(self.server.header_timeout, HEALTH_TIMEOUT)
        self.server.watchdog.shorten(self.watch, deadline)

    def allow(self, nbytes: int, waiting: float = 0.0) -> None:
        """No more time than the header deadline: the answer is a few bytes."""

    def _dispatch(self, method: str) -> None:
        self.body_read = False
        if method == "GET" and urlsplit(self.path).path == "/v1/healthz":
            self._json({"ok": True, "node": self.server.daemon.node})
            return
        self._fail(errors.DaemonError("too many requests in flight", 503))


class Server(ThreadingHTTPServer):
    """The HTTP server of a Daemon: a thread per connection, at most `max_requests` of them
    and `per_client` from one address, and `HEALTH_SLOTS` more for health checks (module
    docstring, Bounds)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        daemon: Daemon,
        read_timeout: float = READ_TIMEOUT,
        max_requests: int = MAX_REQUESTS,
        *,
        per_client: int | None = None,
        header_timeout: float = HEADER_TIMEOUT,
        min_body_rate: float = MIN_BODY_RATE,
        fd_socket: bool = True,
    ) -> None:
        self.daemon = daemon  # what the handlers act on
        self.read_timeout = read_timeout  # seconds a connection may send nothing
        self.header_timeout = header_timeout  # seconds for a request line and headers
        self.min_body_rate = min_body_rate  # bytes a second a body may not fall below
        self.max_requests = max_requests
        self.per_client = per_client or max(1, max_requests // 2)
        self.watchdog = wire.Watchdog()
        self._lock = threading.Lock()
        self._served: dict[str, int] = {}  # client address -> connections it holds
        self._health: set[str] = set()  # client addresses holding a health slot
        super().__init__(address, Handler)
        # A trainer on the node gets its own buffers' files here (``fdpass``); None: HTTP only.
        self.fds = (
            fdpass.FdServer(fdpass.socket_path(daemon.memory.root), daemon.hand_out)
            if fd_socket
            else None
        )

    def server_close(self) -> None:
        super().server_close()
        if self.fds is not None:
            self.fds.close()

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection if a slot is free for it (or a health slot); else 503
        now, from this thread."""
        client = str(client_address[0])
        with self._lock:
            held = sum(self._served.values())
            mine = self._served.get(client, 0)
            if held < self.max_requests and mine < self.per_client:
                self._served[client] = mine + 1
                kind = "slot"
            elif len(self._health) < HEALTH_SLOTS and client not in self._health:
                self._health.add(client)
                kind = "health"
            else:
                kind = ""
        if not kind:
            with contextlib.suppress(OSError):
                request.settimeout(0)
                request.send(BUSY_ANSWER)
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self._serve, args=(request, client_address, kind), daemon=True
        )
        try:
            thread.start()
        except BaseException:
            self._release(client, kind)
            raise

    def _serve(self, request: Any, client_address: Any, kind: str) -> None:
        try:
            handler = Handler if kind == "slot" else HealthHandler
            handler(request, client_address, self)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._release(str(client_address[0]), kind)

    def _release(self, client: str, kind: str) -> None:
        with self._lock:
            if kind == "health":
                self._health.discard(client)
            elif self._served.get(client, 0) > 1:
                self._served[client] -= 1
            else:
                self._served.pop(client, None)

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().server_bind()


# --- command line ---

_UNITS = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
}


MEMORY_HELP = "memory for tier-1 buffers and the daemon itself (the container's memory limit)"
HEADROOM_HELP = "part of --memory-bytes kept for the daemon itself, not for buffers"
SECRET_ENV = "MATRIXPOOL_CKPT_SECRET_FILE"  # names the secret file when --secret-file is not given
SECRET_HELP = f"file holding the cluster secret the tokens derive from (default: ${SECRET_ENV})"
PERSISTENT_ROOT = Path("/var/lib/matrixpool/persistent")  # default --persistent-root
PERSISTENT_HELP = "folder every tier-3 (file://) URI must resolve inside; apart from the others"
READ_TIMEOUT_HELP = "seconds a connection may send nothing before it is dropped"
MAX_REQUESTS_HELP = "connections served at once; more are answered 503"
HEADER_TIMEOUT_HELP = "seconds a request line and its headers may take in all"
MIN_BODY_RATE_HELP = "bytes a second below which a body (request or answer) is cut off"
PER_CLIENT_HELP = "connections served at once from one address (default: half of --max-requests)"
LEASE_HELP = "seconds a trainer's reservation waits for its commit before it is reclaimed"
JOB_BYTES_HELP = (
    "tier-1 bytes one job may hold on this node (its shards, peer copies of its shards and "
    "writes in flight); a save above it evicts the job's own older steps or is refused (507); "
    "default 0: no bound but --memory-bytes"
)
KV_POOL_HELP = (
    "host memory this node lends to the supernode's KV-cache pool: inference services' KV "
    "blocks, served on /v1/kv within a quota per service; taken out of --memory-bytes "
    "(default 0: no pool, the /v1/kv routes answer 503)"
)


def parse_bytes(text: str) -> int:
    """A byte count such as 1073741824, 512Mi or 16Gi (Kubernetes quantity suffixes)."""
    match = re.fullmatch(r"(\d+)(|K|M|G|T|Ki|Mi|Gi|Ti)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count like 16Gi")
    return int(match[1]) * _UNITS[match[2]]


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="matrixpool-ckpt-daemon", description=__doc__.split("\n")[0]
    )
    add = parser.add_argument
    add("--listen", default="127.0.0.1:7040", help="HOST:PORT to serve on (port 0: any)")
    add("--node", default=socket.gethostname(), help="this node's name")
    add("--data-dir", type=Path, default=Path("/var/lib/matrixpool/checkpoints"), help="tier 2")
    add("--memory-dir", type=Path, default=Path("/dev/shm/matrixpool"), help="tier 1 (a tmpfs)")
    add("--memory-bytes", type=parse_bytes, default=parse_bytes("8Gi"), help=MEMORY_HELP)
    add("--memory-headroom", type=parse_bytes, default=parse_bytes("256Mi"), help=HEADROOM_HELP)
    add("--secret-file", type=Path, default=os.environ.get(SECRET_ENV), help=SECRET_HELP)
    add("--persistent-root", type=Path, default=PERSISTENT_ROOT, help=PERSISTENT_HELP)
    add("--keep", type=int, default=2, help="steps kept per job on each tier")
    add("--peer", action="append", default=[], help="HOST:PORT of a peer daemon (repeatable)")
    add("--read-timeout", type=float, default=READ_TIMEOUT, help=READ_TIMEOUT_HELP)
    add("--header-timeout", type=float, default=HEADER_TIMEOUT, help=HEADER_TIMEOUT_HELP)
    add("--min-body-rate", type=parse_bytes, default=MIN_BODY_RATE, help=MIN_BODY_RATE_HELP)
    add("--max-requests-per-client", type=int, default=0, help=PER_CLIENT_HELP)
    add("--max-requests", type=int, default=MAX_REQUESTS, help=MAX_REQUESTS_HELP)
    add("--staging-lease", type=float, default=memory.STAGING_LEASE, help=LEASE_HELP)
    add("--max-job-bytes", type=parse_bytes, default=0, help=JOB_BYTES_HELP)
    add("--kv-pool-bytes", type=parse_bytes, default=0, help=KV_POOL_HELP)
    add("--ready-file", type=Path, help="write HOST:PORT here once serving")
    add("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if not args.secret_file:
        parser.error(f"the cluster secret is needed: --secret-file or {SECRET_ENV}")
    try:
        args.secret = credentials.read_secret(Path(args.secret_file))
    except (OSError, ValueError) as err:
        parser.error(f"--secret-file: {err}")
    if overlap := _overlap(args):
        parser.error(overlap)
    if args.keep < 1 or args.memory_bytes <= args.memory_headroom + args.kv_pool_bytes:
        parser.error(
            "--keep must be >= 1 and --memory-bytes above --memory-headroom plus --kv-pool-bytes"
        )
    if min(args.read_timeout, args.header_timeout, args.min_body_rate, args.staging_lease) <= 0:
        parser.error(
            "--read-timeout, --header-timeout, --min-body-rate and --staging-lease must be positive"
        )
    if args.max_requests < 1 or args.max_requests_per_client < 0:
        parser.error("--max-requests must be positive, --max-requests-per-client not negative")
    return args


def _overlap(args: argparse.Namespace) -> str:
    """Why --persistent-root may not be used ("" when it may): a tier-3 URI inside it must
    never reach the daemon's own memory or data directory, nor hold them."""
    root = Path(args.persistent_root).resolve()
    for flag, own in (("--memory-dir", args.memory_dir), ("--data-dir", args.data_dir)):
        mine = Path(own).resolve()
        if root.is_relative_to(mine) or mine.is_relative_to(root):
            return (
                f"--persistent-root {args.persistent_root} overlaps {flag} {own}: keep them apart"
            )
    return ""


def build(args: argparse.Namespace) -> Server:
    names.job(args.node)
    limit = args.memory_bytes - args.memory_headroom - args.kv_pool_bytes
    mem = memory.MemoryTier(
        args.memory_dir, args.node, limit, args.keep, args.staging_lease, args.max_job_bytes
    )
    disk = files.DiskTier(args.data_dir, args.node, args.keep)
    daemon = Daemon(
        args.node,
        args.secret,
        mem,
        disk,
        args.peer,
        args.keep,
        persistent_root=args.persistent_root,
        kv_pool_bytes=args.kv_pool_bytes,
    )
    host, _, port = args.listen.rpartition(":")
    address = (host.strip("[]"), int(port))
    return Server(
        address,
        daemon,
        args.read_timeout,
        args.max_requests,
        per_client=args.max_requests_per_client or None,
        header_timeout=args.header_timeout,
        min_body_rate=args.min_body_rate,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    server = build(args)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    serving = threading.Thread(target=server.serve_forever, name="ckpt-http")
    serving.start()
    host, port = str(server.server_address[0]), int(server.server_address[1])
    if args.ready_file:
        manifest.write_atomic(args.ready_file, f"{host}:{port}".encode())
    log.info("node %s serving on %s:%s", args.node, host, port)
    stop.wait()
    server.shutdown()
    serving.join()
    server.server_close()
    server.daemon.pool.shutdown(wait=True, cancel_futures=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
