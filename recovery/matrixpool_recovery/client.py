"""The trainer client: ``Checkpointer`` saves a rank's state through the node daemon and
restores it from the fastest valid copy. Called by training code, one per rank::

    ckpt = Checkpointer("ns.llm", rank, world_size, "10.0.0.7:7040", token, spec=spec)
    restored = ckpt.restore() if ckpt.latest() is not None else None
    for step in ...:
        forward_backward()
        ckpt.wait_staged()                 # the previous save has copied what it needs
        optimizer_step()
        ckpt.save(step, state)             # returns at once; copies and writes in the background
    ckpt.wait()                            # raises TierWriteError if a tier failed

Saving (phases numbered as they run):
1. ``save`` captures the state (``staging.Stager``): NumPy arrays turn read-only until
   copied (no copy at save), CPU tensors are copied into reused host buffers at once, and
   device tensors (CUDA, NPU, any device with streams) start copying on a side stream into
   reused pinned host buffers.
2. A background thread reserves a buffer in the daemon's memory directory, gets that one
   buffer's file over the daemon's Unix socket (``fdpass``: a trainer on the node sees no folder
   of the daemon; uploads over HTTP where the socket cannot be reached), maps it and copies the
   state into it while hashing,
   gives the arrays back (``wait_staged`` returns), and commits: the shard is tier 1 at once.
3. The daemon pushes copies to peers and writes tiers 2 and 3 as the step is due
   (``spec.CheckpointSpec``); the thread follows the daemon's status and records failures,
   which ``wait`` raises as ``TierWriteError`` while the other tiers carry on.

A daemon that does not answer (its pod replaced by a rollout or an upgrade: tier 1 stays in the
node's memory, a new daemon serves it within seconds) is waited for, up to ``daemon_wait``
seconds (:data:`DAEMON_WAIT`), before a save counts as failed; a daemon that goes away after
committing a step leaves that step in tier 1, its later tiers reported failed.

Restoring: the step is the newest committed for every rank across the sources the client can
reach (the node's daemon, the peers, the persistent URI); this rank's shard is read from the
fastest of them, local memory, peer memory, local disk, peer disk, then the persistent URI,
verifying the checksum and falling to the next source on a corrupt, partial or missing copy.
``Checkpointer.copies`` is that look at the sources, for a reader of any rank's shard (the DCP
reader of ``matrixpool_recovery.torch`` reads the shards other ranks saved).

``Checkpointer.from_env`` reads what the operator puts in the pod: MATRIXPOOL_JOB,
MATRIXPOOL_RANK, MATRIXPOOL_WORLD_SIZE, MATRIXPOOL_CKPT_DAEMON (host:port),
MATRIXPOOL_CKPT_SOCKET (the daemon's socket as the pod mounts it; default: where the daemon
says it is),
MATRIXPOOL_CKPT_TOKEN or MATRIXPOOL_CKPT_TOKEN_FILE (the job's token: it opens this job's
checkpoints on every daemon, nothing else), MATRIXPOOL_CKPT_PEERS (comma-separated) and
MATRIXPOOL_CHECKPOINT (the job's spec.checkpoint as JSON).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import mmap
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import numpy as np

from matrixpool_recovery import errors, fdpass, files, manifest, names, staging, wire
from matrixpool_recovery.spec import LOCAL, MEMORY, PERSISTENT, TIERS, CheckpointSpec

log = logging.getLogger(__name__)
FOLLOW_WAIT = 30.0  # seconds per status request while following a save
SOURCE_ORDER = ("memory", "peer", "local", "peer-local", "persistent")  # fastest first
MAPS_KEPT = 3  # daemon buffers kept mapped: one being written, two kept steps it cycles through
DAEMON_WAIT = 120.0  # seconds a save waits for a node daemon that does not answer
COMMITTED_REFRESH = 2.0  # seconds between two computations of the committed step
READ_ERRORS = (errors.CheckpointError, OSError, http.client.HTTPException, ValueError)
T = TypeVar("T")


@dataclass
class SaveHandle:
    """One save in flight: when it was staged, and what each tier answered."""

    step: int
    tiers: tuple[str, ...]  # asked for: memory, local, persistent
    started: float = field(default_factory=time.perf_counter)  # when save() was called
    staged: threading.Event = field(default_factory=threading.Event)  # arrays given back
    done: threading.Event = field(default_factory=threading.Event)  # every tier answered
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)  # tier -> daemon's answer
    times: dict[str, float] = field(default_factory=dict)  # "staged", "memory", "done" -> clock

    def mark(self, what: str) -> None:
        self.times[what] = time.perf_counter()

    def wait_staged(self, timeout: float | None = None) -> None:
        if not self.staged.wait(timeout):
            raise TimeoutError(f"step {self.step} not staged within {timeout}s")

    @property
    def failures(self) -> dict[str, str]:
        return {
            tier: str(outcome.get("error", outcome.get("state")))
            for tier, outcome in self.outcomes.items()
            if outcome.get("state") != "ok"
        }

    def wait(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Block until every tier answered; raise TierWriteError if one failed."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"step {self.step} not written within {timeout}s")
        if self.failures:
            raise errors.TierWriteError(self.step, self.failures)
        return self.outcomes


@dataclass(frozen=True)
class Restored:
    """What restore found."""

    step: int  # the step restored
    state: dict[str, Any]  # names to bytes, NumPy arrays or tensors
    source: str  # where the shard came from, e.g. "peer:node-c" or "persistent"
    skipped: tuple[str, ...] = ()  # faster sources that failed, with the reason
    incarnation: int = 0  # the run that wrote it
    rank: int = 0  # the rank whose shard was read (its own, unless `restore(rank=)` said)


@dataclass(frozen=True)
class _Source:
    kind: str  # one of SOURCE_ORDER
    holding: manifest.Holding  # what the source says it holds
    endpoint: wire.Endpoint | None  # the daemon holding it; None for tier 3
    rank_of_peer: int = 0  # position in the peer list, to prefer earlier peers

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.holding.node}" if self.holding.node else self.kind


@dataclass
class _Save:
    handle: SaveHandle
    captured: staging.Captured


class Checkpointer:
    """Saves and restores one rank's state (see the module docstring)."""

    def __init__(
        self,
        job: str,
        rank: int,
        world_size: int,
        daemon: str,
        token: str,
        *,
        spec: CheckpointSpec | None = None,
        peers: Sequence[str] | None = None,
        background_staging: bool = True,
        shared_memory: bool | None = None,
        timeout: float = 600.0,
        incarnation: int = 0,
        socket_path: str | None = None,
        daemon_wait: float = DAEMON_WAIT,
    ) -> None:
        self.job = names.job(job)  # validated: it becomes a directory name
        self.rank = names.rank(rank)
        if not 0 <= self.rank < world_size:
            raise errors.InvalidNameError(f"rank {rank} outside a world of {world_size}")
        self.world_size = world_size
        self.spec = spec or CheckpointSpec()  # cadence of the tiers
        self.daemon = wire.Endpoint(daemon, token)  # this node's daemon
        self._peers = None if peers is None else [wire.Endpoint(p, token) for p in peers]
        self.background_staging = background_staging  # False: save() returns once staged
        self.timeout = timeout  # seconds a save may take to reach every tier
        self.daemon_wait = daemon_wait  # seconds a save waits for a daemon that does not answer
        self.incarnation = names.number(incarnation, "incarnation", names.MAX_STEP)  # this run
        self.base = -1  # the step this run restored from; -1: it started from nothing
        self._stager = staging.Stager()
        self._queue: queue.Queue[_Save | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._handles: list[SaveHandle] = []
        self._committed: manifest.Point | None = None  # newest tier-1 step committed, known
        self._refresh_at = 0.0  # monotonic time of the next look at every peer's inventory
        self._colocated = shared_memory  # may this process open the daemon's buffers? None: probe
        self._socket = Path(socket_path) if socket_path else None  # None: as the daemon says
        self._maps: OrderedDict[str, tuple[mmap.mmap, int]] = OrderedDict()  # buffer -> map
        self._unreachable: list[str] = []  # daemons that did not answer the last look-up
        self._upload: np.ndarray[Any, np.dtype[np.uint8]] | None = None  # reused, remote case

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Checkpointer:
        env = os.environ if environ is None else environ
        token = (
            env.get("MATRIXPOOL_CKPT_TOKEN")
            or Path(env["MATRIXPOOL_CKPT_TOKEN_FILE"]).read_text().strip()
        )
        peers = [p for p in env.get("MATRIXPOOL_CKPT_PEERS", "").split(",") if p]
        spec_json = env.get("MATRIXPOOL_CHECKPOINT")
        return cls(
            env["MATRIXPOOL_JOB"],
            int(env["MATRIXPOOL_RANK"]),
            int(env["MATRIXPOOL_WORLD_SIZE"]),
            env["MATRIXPOOL_CKPT_DAEMON"],
            token,
            spec=CheckpointSpec.from_json(spec_json) if spec_json else None,
            peers=peers or None,
            incarnation=int(env.get("MATRIXPOOL_INCARNATION") or 0),
            socket_path=env.get("MATRIXPOOL_CKPT_SOCKET") or None,
        )

    def start_incarnation(self, incarnation: int) -> None:
        """This rank now runs as a new incarnation (a recovery or resume said so): its next
        saves carry it, and restore() records the step it started from. Saves already in
        flight keep the incarnation they were made with."""
        self.incarnation = names.number(incarnation, "incarnation", names.MAX_STEP)
        self.base = -1
        self._committed = None

    # --- saving ---

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        tiers: Sequence[str] | None = None,
        borrow: bool = False,
    ) -> SaveHandle:
        """Capture the state and return; copying and writing go on in the background.

        `tiers` overrides the cadence (e.g. every tier for a checkpoint the operator asked
        for). Until ``wait_staged`` returns, NumPy arrays of the state are read-only; tensors
        may change as soon as ``save`` returns (their bytes were copied or are being copied on
        a stream ordered before the trainer's next kernels). `borrow`: CPU tensors are not
        copied either; the caller leaves them unchanged until the handle is staged (a state
        that is already a staged copy, as a DCP writer's is).
        """
        names.step(step)
        chosen = tuple(tiers) if tiers is not None else self.spec.due(step)
        if not set(chosen) <= set(TIERS):
            raise ValueError(f"tiers {chosen} not among {TIERS}")
        handle = SaveHandle(step, chosen)
        if not chosen:
            handle.staged.set()
            handle.done.set()
            return handle
        self.wait_staged()
        self._handles = [h for h in self._handles if not h.done.is_set() or h.failures]
        self._handles.append(handle)
        captured = self._stager.capture(self.job, self.rank, step, state, borrow=borrow)
        self._queue.put(_Save(handle, captured))
        self._ensure_thread()
        if not self.background_staging:
            handle.wait_staged()
        return handle

    def wait_staged(self) -> None:
        """Block until every save has copied the state it captured (arrays writable again)."""
        for handle in self._handles:
            handle.staged.wait()

    def wait(self) -> None:
        """Block until every save reached every tier; raise TierWriteError for the failures."""
        handles, self._handles = self._handles, []
        failed: dict[str, str] = {}
        steps: list[int] = []
        for handle in handles:
            handle.done.wait()
            if handle.failures:
                steps.append(handle.step)
                failed.update(
                    {t: f"step {handle.step}: {why}" for t, why in handle.failures.items()}
                )
        if failed:
            raise errors.TierWriteError(steps[-1], failed)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"ckpt-{self.job}-{self.rank}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        for item in iter(self._queue.get, None):  # until close() queues None
            self._process(item)

    def _process(self, item: _Save) -> None:
        handle = item.handle
        try:
            tiers = self._hand_over_waiting(item)
            self._follow(handle, tiers)
        except Exception as err:  # every failure reaches the trainer through wait()
            log.warning("checkpoint step %d failed: %r", handle.step, err)
            for tier in handle.tiers:
                handle.outcomes.setdefault(tier, {"state": "error", "error": str(err)})
        finally:
            item.captured.release()
            handle.staged.set()
            handle.mark("done")
            handle.done.set()

    def _options(self, handle: SaveHandle) -> dict[str, Any]:
        committed = self._committed_before(handle.step)
        return {
            "worldSize": self.world_size,
            "tiers": ",".join(handle.tiers),
            "peerReplicas": self.spec.peer_replicas,
            "persistentUri": self.spec.persistent_uri,
            "incarnation": self.incarnation,
            "base": self.base,
            "committed": None if committed is None else committed.step,
            "committedIncarnation": None if committed is None else committed.incarnation,
        }

    def _committed_before(self, step: int) -> manifest.Point | None:
        """The committed step to report with a save of `step`: daemons refuse a newer one
        (after a restore of an older step, newer steps of the old run are still held)."""
        committed = self._committed
        return committed if committed is not None and committed.step <= step else None

    def _hand_over_waiting(self, item: _Save) -> list[str]:
        """:meth:`_hand_over`, again while the daemon does not answer, for up to
        ``daemon_wait`` seconds: a new daemon pod (a rollout) answers within them."""
        deadline = time.monotonic() + min(self.daemon_wait, self.timeout)
        delay = 0.25
        while True:
            try:
                return self._hand_over(item)
            except errors.DaemonUnreachableError as err:
                if time.monotonic() + delay > deadline:
                    raise
                if delay == 0.25:
                    log.warning(
                        "step %d: the node's daemon does not answer (%s); waiting up to %.0f s",
                        item.handle.step, err, self.daemon_wait,
                    )  # fmt: skip
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    def _hand_over(self, item: _Save) -> list[str]:
        """Phase 2: stage into the daemon's memory (or upload) and commit; the daemon's tiers."""
        handle, layout = item.handle, item.captured.layout
        path = wire.shard_path(self.job, self.rank, handle.step, "reserve")
        if self._is_colocated():
            options = self._options(handle)
            reserve = {k: options[k] for k in ("committed", "committedIncarnation")}
            buffer = wire.request(self.daemon, "POST", path, {"size": layout.size, **reserve})
            digest = self._stage_into_buffer(item, buffer)
            body = {
                **self._options(handle),
                "buffer": buffer["buffer"],
                "size": layout.size,
                "checksum": digest,
            }
            answer = wire.request(
                self.daemon,
                "POST",
                wire.shard_path(self.job, self.rank, handle.step, "commit"),
                body,
            )
        else:
            answer = self._upload_shard(item)
        handle.mark(MEMORY)
        return [str(t) for t in answer["tiers"]]

    def _stage_into_buffer(self, item: _Save, buffer: Mapping[str, Any]) -> str:
        size = item.captured.layout.size
        for stale in set(self._maps) - set(buffer["live"]):  # the daemon deleted these files
            self._maps.pop(stale)[0].close()
        mapping = self._mapping(str(buffer["buffer"]), size)
        dest = np.frombuffer(mapping, dtype=np.uint8, count=size)
        try:
            digest = staging.write_shard(item.captured, dest)
        finally:
            del dest
        self._staged(item)
        return digest

    def _staged(self, item: _Save) -> None:
        item.captured.release()
        item.handle.mark("staged")
        item.handle.staged.set()

    def _upload_shard(self, item: _Save) -> Any:
        size = item.captured.layout.size
        if self._upload is None or self._upload.nbytes != size:
            self._upload = np.empty(size, dtype=np.uint8)
        digest = staging.write_shard(item.captured, self._upload)
        self._staged(item)
        options = self._options(item.handle)
        meta = {wire.HEADER + "Checksum": digest}
        for key, value in options.items():
            if value is not None:
                meta[wire.HEADER + _header_name(key)] = str(value)
        path = wire.shard_path(self.job, self.rank, item.handle.step, "shard")
        return wire.put_shard(self.daemon, path, meta, self._upload.data, size)

    def _follow(self, handle: SaveHandle, tiers: list[str]) -> None:
        """Phase 3: poll the daemon's status until every tier answered or time ran out."""
        path = wire.shard_path(self.job, self.rank, handle.step, "status", wait=FOLLOW_WAIT)
        deadline = time.monotonic() + self.timeout
        answered: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                answered = wire.request(self.daemon, "GET", path, timeout=FOLLOW_WAIT + 30)
            except errors.DaemonUnreachableError as err:
                # Gone after the commit (a rollout): the step is in tier 1, whose files stay
                # on the node; what it had not written yet is not written.
                log.warning("step %d: the daemon went after committing it: %s", handle.step, err)
                gone = {"state": "error", "error": f"the daemon went before writing it: {err}"}
                answered = {t: {"state": "ok"} if t == MEMORY else gone for t in tiers}
                break
            answered = answered["tiers"]
            if all(o.get("state") != "pending" for o in answered.values()):
                break
        for tier in tiers:
            outcome = answered.get(tier, {"state": "pending"})
            if outcome.get("state") == "pending":
                outcome = {"state": "error", "error": f"not written within {self.timeout}s"}
            handle.outcomes[tier] = outcome
        now = time.monotonic()
        if handle.outcomes.get(MEMORY, {}).get("state") == "ok" and now >= self._refresh_at:
            # Asking every peer after every save costs ranks x peers requests per step; the
            # daemons keep more than this one step anyway (see memory.MemoryTier._prune).
            self._refresh_at = now + COMMITTED_REFRESH
            self._committed = self._newest_memory_step()

    def _newest_memory_step(self) -> manifest.Point | None:
        found = [s.holding for s in self._sources(persistent=False) if s.holding.tier == MEMORY]
        return manifest.choose(found, self.world_size, MEMORY)

    # --- the daemon's memory, mapped ---

    def _is_colocated(self) -> bool:
        """May this process be handed the daemon's buffers (same node, its socket mounted)?

        The daemon's answer over the socket carries the nonce its HTTP info gives: the socket
        and the address lead to the same daemon.
        """
        if self._colocated is None:
            info = wire.request(self.daemon, "GET", f"/v1/info?job={self.job}")
            if self._socket is None:
                self._socket = Path(str(info.get("socket", "")))
            try:
                answer, _ = self._ask({"open": "probe"})
                self._colocated = answer.get("nonce") == info["probe"]["nonce"]
            except (errors.CheckpointError, OSError) as err:
                log.info("uploading over HTTP: the daemon's socket %s: %s", self._socket, err)
                self._colocated = False
        return self._colocated

    def _ask(self, request: dict[str, Any]) -> fdpass.Answer:
        """One request on the daemon's socket, as this job."""
        if self._socket is None:
            info = wire.request(self.daemon, "GET", f"/v1/info?job={self.job}")
            self._socket = Path(str(info.get("socket", "")))
        return fdpass.ask(self._socket, {"token": self.daemon.token, "job": self.job, **request})

    def _mapping(self, buffer_id: str, size: int) -> mmap.mmap:
        """The buffer mapped into this process; kept, since the daemon hands it back."""
        cached = self._maps.pop(buffer_id, None)
        if cached is not None and cached[1] == size:
            self._maps[buffer_id] = cached
            return cached[0]
        if cached is not None:
            cached[0].close()
        _, fd = self._ask({"open": "buffer", "buffer": buffer_id})
        if fd is None:
            raise errors.DaemonError(f"the daemon handed over no file for buffer {buffer_id}")
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        self._maps[buffer_id] = (mapping, size)
        while len(self._maps) > MAPS_KEPT:
            _, (old, _) = self._maps.popitem(last=False)
            old.close()
        return mapping

    # --- restoring ---

    def copies(self, also: Sequence[str] = ()) -> Copies:
        """Every copy of this job held now by the node's daemon, the daemons `also` names (a
        restore annotation's ``from``), the peers and the persistent URI."""
        sources = self._sources(also=also)
        return Copies(self, tuple(sources), tuple(self._unreachable))

    def latest(self) -> int | None:
        """The newest step committed for every rank on any tier that can be reached."""
        return self.copies().newest()

    def committed(self) -> dict[str, int | None]:
        """Per tier, the newest step committed for every rank."""
        return manifest.committed([s.holding for s in self._sources()], self.world_size, TIERS)

    def restore(
        self,
        step: int | None = None,
        *,
        incarnation: int | None = None,
        into: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> Restored:
        """The state of this rank at `step` (default: the newest committed for every rank).

        The shards restored are all of one incarnation: `incarnation` names it (a recovery
        that chose the step says which run wrote it); else the newest run that holds the step
        on the newest timeline. Without `step`, when every copy of this rank's shard of the
        newest committed step is corrupt, the step committed before it is restored instead.
        `into` maps names to arrays or tensors to fill in place (a model's own tensors).
        `rank` reads another rank's shard instead (after a regroup, a rank the old world did not
        have reads ``restore.shard_for(rank, world)``; its saves stay its own).
        """
        shard = self.rank if rank is None else names.rank(rank)
        self._drain()
        copies = self.copies()
        candidates = copies.candidates(step, incarnation)
        if not candidates:
            lost = "; ".join(copies.unreachable) or "none"
            asked = "no step is committed for every rank" if step is None else f"no step {step}"
            raise errors.NoCheckpointError(f"{self.job}: {asked} (unreachable daemons: {lost})")
        failures: list[str] = []
        for point in candidates:
            found = copies.first_valid(shard, point, _state_of(into), failures)
            if found is not None:
                state, source = found
                self.base = point.step
                return Restored(
                    point.step, state, source, tuple(failures), point.incarnation, shard
                )
        raise errors.NoCheckpointError(
            f"{self.job}: no valid copy of rank {shard} at step "
            f"{', '.join(str(p.step) for p in candidates)} ({'; '.join(failures) or 'none held'})"
        )

    def _drain(self) -> None:
        for handle in self._handles:
            handle.done.wait()

    def _peer_endpoints(self) -> list[wire.Endpoint]:
        if self._peers is None:
            try:
                info = wire.request(self.daemon, "GET", f"/v1/info?job={self.job}")
                self._peers = [wire.Endpoint(p, self.daemon.token) for p in info["peers"]]
            except errors.DaemonUnreachableError:
                return []
        return self._peers

    def _sources(self, persistent: bool = True, also: Sequence[str] = ()) -> list[_Source]:
        """Every copy the reachable daemons (and the persistent URI) hold of this job."""
        found: list[_Source] = []
        self._unreachable = []
        others = [wire.Endpoint(a, self.daemon.token) for a in also] + self._peer_endpoints()
        daemons = [self.daemon]
        for endpoint in others:
            if endpoint.address not in {d.address for d in daemons}:
                daemons.append(endpoint)
        uri = self.spec.persistent_uri if persistent else None
        for order, endpoint in enumerate(daemons):
            for holding in self._inventory(endpoint, None if order else uri):
                if holding.tier == PERSISTENT:  # the node's daemon reads tier 3 for its trainers
                    if uri and not order:
                        found.append(_Source("persistent", holding, endpoint, order))
                    continue
                if holding.tier not in (MEMORY, LOCAL):
                    continue
                kind = "memory" if holding.tier == MEMORY else "local"
                if order:
                    kind = "peer" if holding.tier == MEMORY else "peer-local"
                found.append(_Source(kind, holding, endpoint, order))
        if uri and not any(s.kind == "persistent" for s in found):  # here, if this process can
            store = files.Persistent(uri, keep=1)
            for built in store.manifests(self.job):
                found += [_Source("persistent", h, None) for h in manifest.holdings(built)]
        return found

    def _inventory(self, endpoint: wire.Endpoint, uri: str | None = None) -> list[manifest.Holding]:
        query = urlencode({"job": self.job, **({"uri": uri} if uri else {})})
        try:
            answer = wire.request(endpoint, "GET", f"/v1/inventory?{query}")
        except errors.DaemonUnreachableError as err:
            log.info("skipping unreachable daemon: %s", err)
            self._unreachable.append(endpoint.address)
            return []
        return [manifest.Holding.from_json(s) for s in answer["shards"]]

    @contextlib.contextmanager
    def _open(self, source: _Source) -> Iterator[Stream]:
        """The bytes of the shard a source holds (any rank's), from its file when this process
        can open it (tier 3, or the node daemon's memory), else downloaded from its daemon."""
        holding = source.holding
        if source.endpoint is None:
            _, path = files.Persistent(str(self.spec.persistent_uri), keep=1).locate(
                self.job, holding.rank, holding.step
            )
            with _opened(path, holding) as stream:
                yield stream
            return
        if source.kind == "memory" and self._is_colocated():
            asked = {"open": "shard", "rank": holding.rank, "step": holding.step}
            _, fd = self._ask(asked)
            if fd is None:
                raise errors.DaemonError(f"the daemon handed over no file for {asked}")
            with _opened(fd, holding) as stream:
                yield stream
            return
        tier = {"memory": MEMORY, "peer": MEMORY, "persistent": PERSISTENT}.get(source.kind, LOCAL)
        uri = self.spec.persistent_uri if tier == PERSISTENT else None
        where = wire.shard_path(self.job, holding.rank, holding.step, "shard", tier=tier, uri=uri)
        download = wire.get_shard(source.endpoint, where)
        try:
            yield Stream(download.read_into, download.size, holding.checksum)
        finally:
            download.close()

    def close(self) -> None:
        """Finish the saves in flight, stop the thread, unmap the daemon's buffers."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for mapping, _ in self._maps.values():
            mapping.close()
        self._maps.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Stream:
    """A shard being read from one source."""

    read_into: staging.ReadInto  # fills a buffer, returns the bytes read (0 at the end)
    size: int  # bytes the source holds
    checksum: str  # what the manifest recorded: every byte read must match it


@dataclass(frozen=True)
class Copies:
    """The copies of one job that a rank's sources held at one look, and reads of any rank's
    shard from the fastest valid copy: ``Checkpointer.restore`` reads its own rank's, a reader
    of resharded state (``matrixpool_recovery.torch``) other ranks' too."""

    checkpointer: Checkpointer  # whose daemon, peers, token and tier-3 URI
    sources: tuple[_Source, ...]  # every copy found, of every rank
    unreachable: tuple[str, ...]  # daemons that did not answer

    def newest(self) -> int | None:
        """The newest step committed for every rank, on any tier."""
        found = [s.holding for s in self.sources]
        return manifest.newest_complete(found, self.checkpointer.world_size)

    def candidates(self, step: int | None, incarnation: int | None) -> list[manifest.Point]:
        """Steps to try, newest first: every committed one, or the one asked for (written by
        `incarnation`, else by the newest run holding it on the newest timeline)."""
        found = [s.holding for s in self.sources]
        if step is None:
            return manifest.complete_points(found, self.checkpointer.world_size)
        if incarnation is not None:
            return [manifest.Point(incarnation, step)]
        runs = {h.incarnation for h in manifest.timeline(found) if h.step == step}
        return [manifest.Point(max(runs), step)] if runs else []

    def first_valid(
        self, rank: int, point: manifest.Point, use: Callable[[Stream], T], failures: list[str]
    ) -> tuple[T, str] | None:
        """What `use` makes of the first copy of `rank`'s shard at `point` it reads without an
        error, fastest source first, and the source's name; None when none is left (the
        reasons appended to `failures`)."""
        held = [
            s
            for s in self.sources
            if s.holding.rank == rank
            and manifest.Point(s.holding.incarnation, s.holding.step) == point
        ]
        held.sort(key=lambda s: (SOURCE_ORDER.index(s.kind), s.rank_of_peer))
        if not held:
            failures.append(f"step {point.step}: no source holds rank {rank}")
        for source in held:
            try:
                with self.checkpointer._open(source) as stream:
                    return use(stream), source.name
            except READ_ERRORS as err:
                log.warning("reading from %s failed, trying the next source: %s", source.name, err)
                failures.append(f"step {point.step} {source.name}: {err}")
        return None

    def read(self, rank: int, point: manifest.Point, use: Callable[[Stream], T]) -> tuple[T, str]:
        """As ``first_valid``; NoCheckpointError naming the step and the rank when no copy of
        its shard can be read."""
        failures: list[str] = []
        found = self.first_valid(rank, point, use, failures)
        if found is None:
            raise errors.NoCheckpointError(
                f"{self.checkpointer.job}: no valid copy of rank {rank} at step {point.step} "
                f"of incarnation {point.incarnation} ({'; '.join(failures)})"
            )
        return found

    def state(
        self, rank: int, point: manifest.Point, into: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, Any], str]:
        """The state `rank`'s shard at `point` holds, read whole and verified (``read``)."""
        return self.read(rank, point, _state_of(into))


def _state_of(into: Mapping[str, Any] | None) -> Callable[[Stream], dict[str, Any]]:
    """Reads a whole shard, verified, into a state (filling `into`'s arrays and tensors)."""

    def read(stream: Stream) -> dict[str, Any]:
        return staging.read_shard(stream.read_into, stream.size, stream.checksum, into)[1]

    return read


@contextlib.contextmanager
def _opened(path: Path | int, holding: manifest.Holding) -> Iterator[Stream]:
    """A shard's file (a path, or a file the daemon handed over: closed here) as a stream."""
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        if size != holding.size:
            raise errors.IntegrityError(
                f"{holding.job}/{holding.rank}/{holding.step} is {size} bytes, its manifest "
                f"says {holding.size}"
            )
        yield Stream(file.readinto, size, holding.checksum)


def _header_name(key: str) -> str:
    """worldSize -> World-Size: the daemon reads upload options from these headers."""
    return re.sub(r"([A-Z])", r"-\1", key).title()
