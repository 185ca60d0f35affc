"""The supernode's KV-cache pool in front of a real engine: an HTTP proxy beside one llama.cpp
server (a sidecar in its pod) that restores a prompt's prefix from the pool into one of the
engine's slots before the engine sees the prompt, and stores what the engine computed for the
other replicas of the service::

    python -m matrixpool.serving.kvproxy --engine http://127.0.0.1:8080 --listen 0.0.0.0:8000 \\
        --slots 4 --slot-dir /slots --kv-service UID --kv-token-file /var/run/kv/token \\
        --kv-daemons 10.0.0.7:7040,10.0.0.8:7040

The engine runs with ``--parallel`` equal to ``--slots`` and ``--slot-save-path`` the folder
that is ``--slot-dir`` here (an emptyDir both containers mount). Endpoints:

- ``POST /v1/completions`` and ``POST /completion``: passed to the engine as they are, pinned
  to a slot the proxy chose (``id_slot``) with the engine's prompt cache on (``cache_prompt``);
  the answer (Server-Sent Events or one body) comes back unchanged. A request waits while every
  slot is busy.
- ``GET /health``: the engine's.
- ``GET /metrics``: the engine's, then the proxy's own ``matrixpool_kvproxy_*`` series.

Per request with a prompt of token ids (what the pool holds: :mod:`matrixpool.serving.kvslots`):

1. take a free slot, the one already holding the longest prefix of the prompt;
2. look the prompt's whole-block prefixes longer than that up in the pool (bisecting for the
   longest held: ``kvslots.search``); on a hit, write the slot file into the slot folder and
   restore it into the slot (``POST /slots/{id}?action=restore``): the engine then computes
   only the rest;
3. relay the request to the engine, pinned to the slot;
4. once the engine has answered, and before the answer's end (``data: [DONE]``) goes out:
   when the pool lacked some of the prompt's whole blocks, save the slot (``?action=save``);
   give the slot back (a client's next request finds it free); then put the file and its
   references into the node's own daemon from a background thread (at most
   :data:`STORES_PENDING` stores waiting; a put the pool refuses — no quota, a quota too
   small — is counted and harmless).

A text prompt (anything but a list of token ids) is relayed pinned to a slot, without the pool:
the proxy does not tokenize. The pool is a cache: a daemon that does not answer, a refusal or a
file the engine will not load costs the prompt's computation, never the request
(``kvclient.KvClient`` skips a silent daemon for a while; only its blocks are lost).

Errors: the engine's answers are relayed with their status; an engine that cannot be reached
is a 502, a body that is not a JSON object a 400.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from matrixpool.serving import kvargs, kvslots

log = logging.getLogger(__name__)

STORES_PENDING = 2  # stores in the pool waiting or running, at most (more are skipped)
ENGINE_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
ACTION_TIMEOUT = aiohttp.ClientTimeout(total=60)  # a slot save or restore
STOP_SECONDS = 10.0  # how long stores still running may take at shutdown
PASSED_HEADERS = ("Content-Type", "Cache-Control")  # of the engine's answer
END = b"data: [DONE]"  # the last event of a streamed answer
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
Done = Callable[[bool], Awaitable[None]]  # run before the answer's end goes out


class Found(Protocol):
    @property
    def tokens(self) -> int: ...

    @property
    def data(self) -> bytes: ...


class Pool(Protocol):
    """What the proxy needs of the pool (``kvclient.KvClient`` is one)."""

    def fetch(self, block_hash: str) -> Found | None: ...

    def put(self, block_hash: str, tokens: int, data: bytes) -> bool: ...

    def down(self) -> list[str]: ...


@dataclass(frozen=True)
class Hit:
    """A slot file the pool holds for a prompt."""

    blocks: int  # whole blocks of the prompt whose hash found it
    reused: int  # tokens of the prompt it gives the engine
    data: bytes  # the slot file


class Metrics:
    """The proxy's own series, in a registry private to it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"matrixpool_kvproxy_{name}", doc, registry=self.registry)

        self.requests = counter("requests", "Requests relayed to the engine.")
        self.hits = counter("hits", "Requests whose prompt prefix was restored from the KV pool.")
        self.misses = counter(
            "misses", "Requests of which neither the slot nor the pool held a whole block."
        )
        self.local = counter(
            "local_hits", "Requests whose slot held a whole block or more, the pool no more."
        )
        self.restored_bytes = counter("restored_bytes", "Bytes of slot files restored.")
        self.restored_tokens = counter("restored_tokens", "Prompt tokens restored slot files gave.")
        self.restore_failures = counter("restore_failures", "Slot files the engine did not load.")
        self.stored = counter("stored", "Slot files stored in the KV pool.")
        self.stored_bytes = counter("stored_bytes", "Bytes of slot files stored in the KV pool.")
        self.refused = counter("store_refused", "Slot files the pool did not take.")
        self.skipped = counter("store_skipped", "Slot files not stored: too many stores waiting.")
        self.lookup_seconds = Histogram(
            "matrixpool_kvproxy_lookup_seconds",
            "Time to find and fetch a prompt's slot file in the pool, hit or miss.",
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.restore_seconds = Histogram(
            "matrixpool_kvproxy_restore_seconds",
            "Time to write a slot file and have the engine restore it.",
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.waiting = Gauge(
            "matrixpool_kvproxy_waiting_requests",
            "Requests waiting for a free slot.",
            registry=self.registry,
        )
        self.down = Gauge(
            "matrixpool_kvproxy_pool_daemons_down",
            "Daemons of the pool skipped now, having failed to answer.",
            registry=self.registry,
        )


class Proxy:
    """One engine's slots, the pool and the proxy's counters."""

    def __init__(self, engine: str, slot_dir: Path, slots: int, pool: Pool | None) -> None:
        self.engine = engine.rstrip("/")
        self.slot_dir = slot_dir
        self.slots = kvslots.Slots.of(slots)
        self.pool = pool
        self.metrics = Metrics()
        self._free = asyncio.Condition()  # a slot was given back
        self._storing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-store")
        self._stores: set[asyncio.Future[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy is not running"
        return self._session

    async def running(self, app: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: the engine's session, then the stores left at the end."""
        # A new connection per call: llama.cpp closes kept-alive ones when it likes.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        yield
        if self._stores:
            await asyncio.wait(self._stores, timeout=STOP_SECONDS)
        await self._session.close()
        self._storing.shutdown(wait=False, cancel_futures=True)

    async def serve(
        self, request: web.Request, body: dict[str, Any], prompt: Sequence[int] | None
    ) -> web.StreamResponse:
        """Steps 1-4 of the module's docstring for one request."""
        self.metrics.requests.inc()
        slot = await self._take(prompt or ())  # 1.
        entries: list[kvslots.Entry] = []
        saved: bytes | None = None
        given_back = False

        async def done(complete: bool) -> None:
            """Before the answer's end goes out: save the slot when the pool lacked some of it
            and give the slot back, so that the client's next request finds it free."""
            nonlocal saved, given_back
            if complete and entries:
                saved = await self._save(slot)  # 4.
            await self._give_back(slot, prompt if complete and prompt else ())
            given_back = True

        try:
            if prompt:
                entries = await self._prepare(slot, prompt)  # 2.
            pinned = {**body, "id_slot": slot.index, "cache_prompt": True}
            response = await self._relay(request, pinned, done)  # 3.
        finally:
            if not given_back:
                await self._give_back(slot, ())
        if saved is not None:
            self._keep(entries, saved)
        return response

    async def _take(self, prompt: Sequence[int]) -> kvslots.Slot:
        async with self._free:
            slot = self.slots.take(prompt)
            if slot is not None:
                return slot
            self.metrics.waiting.inc()
            try:
                while (slot := self.slots.take(prompt)) is None:
                    await self._free.wait()
            finally:
                self.metrics.waiting.dec()
            return slot

    async def _give_back(self, slot: kvslots.Slot, holds: Sequence[int]) -> None:
        async with self._free:
            self.slots.give_back(slot, holds)
            self._free.notify()

    async def _prepare(self, slot: kvslots.Slot, prompt: Sequence[int]) -> list[kvslots.Entry]:
        """Restore the longest prefix the pool holds beyond what the slot has; what to store
        once the engine has computed the rest."""
        hashes = kvslots.hashes(prompt)
        if not hashes or self.pool is None:
            return []
        held = kvslots.common_prefix(slot.tokens, prompt)
        looked = held // kvslots.BLOCK_TOKENS < len(hashes)  # the slot lacks some blocks
        with self.metrics.lookup_seconds.time():
            hit = await asyncio.to_thread(self._find, hashes, held, prompt) if looked else None
        if hit is None:
            counted = self.metrics.local if held >= kvslots.BLOCK_TOKENS else self.metrics.misses
            counted.inc()
            return kvslots.to_store(hashes, 0) if looked else []
        with self.metrics.restore_seconds.time():
            restored = await self._restore(slot, hit)
        if restored:
            self.metrics.hits.inc()
            self.metrics.restored_bytes.inc(len(hit.data))
            self.metrics.restored_tokens.inc(hit.reused)
        return kvslots.to_store(hashes, hit.blocks)

    def _find(self, hashes: Sequence[str], held: int, prompt: Sequence[int]) -> Hit | None:
        """The slot file of the longest prefix the pool holds beyond the ``held`` tokens the
        slot has (blocking: run in a thread)."""
        stale: set[str] = set()  # slot files named by references but gone

        def probe(blocks: int) -> tuple[Hit, int] | None:
            data = self._fetch(hashes[blocks - 1], stale)
            reused = 0 if data is None else kvslots.reuses(data, prompt, blocks)
            if data is None or not reused:
                return None
            return Hit(blocks, reused, data), reused // kvslots.BLOCK_TOKENS

        return kvslots.search(held // kvslots.BLOCK_TOKENS, len(hashes), probe)

    def _fetch(self, block_hash: str, stale: set[str]) -> bytes | None:
        """The slot file under ``block_hash``, directly or through a reference."""
        assert self.pool is not None
        found = self.pool.fetch(block_hash)
        target = None if found is None else kvslots.referenced(found.data)
        if target is not None:
            found = None if target in stale else self.pool.fetch(target)
            if found is None:
                stale.add(target)
        return None if found is None else found.data

    async def _restore(self, slot: kvslots.Slot, hit: Hit) -> bool:
        """Load the slot file into the engine's slot; False (counted) when it would not."""
        path = self._file(slot)
        try:
            await asyncio.to_thread(path.write_bytes, hit.data)
            await self._slot_action(slot, "restore", path.name)
        except (OSError, aiohttp.ClientError, TimeoutError) as err:
            log.warning("slot %d: restore failed: %r", slot.index, err)
            self.metrics.restore_failures.inc()
            slot.tokens = ()  # whatever the engine kept, the proxy no longer knows
            return False
        finally:
            path.unlink(missing_ok=True)
        slot.tokens = kvslots.tokens_of(hit.data) or ()
        return True

    async def _save(self, slot: kvslots.Slot) -> bytes | None:
        """The slot's file, as the engine writes it; None when it could not."""
        path = self._file(slot)
        try:
            await self._slot_action(slot, "save", path.name)
            return await asyncio.to_thread(path.read_bytes)
        except (OSError, aiohttp.ClientError, TimeoutError) as err:
            log.warning("slot %d: save failed: %r", slot.index, err)
            return None
        finally:
            path.unlink(missing_ok=True)

    def _file(self, slot: kvslots.Slot) -> Path:
        return self.slot_dir / f"kvproxy-slot{slot.index}.bin"

    async def _slot_action(self, slot: kvslots.Slot, action: str, filename: str) -> None:
        url = f"{self.engine}/slots/{slot.index}?action={action}"
        post = self.session.post(url, json={"filename": filename}, timeout=ACTION_TIMEOUT)
        async with post as answer:
            text = await answer.text()
            if answer.status != 200:
                raise aiohttp.ClientResponseError(
                    answer.request_info, (), status=answer.status, message=text[:200]
                )

    async def _relay(
        self, request: web.Request, body: dict[str, Any], done: Done
    ) -> web.StreamResponse:
        """The engine's answer, passed on as it comes but for its end (``data: [DONE]``, or a
        whole body not streamed), held back until ``done`` has run; ``done`` is told whether
        the engine sent the whole answer with status 200."""
        url = f"{self.engine}{request.path}"
        response, complete, last, failure = web.StreamResponse(), False, b"", ""
        streamed = body.get("stream") is True
        try:
            async with self.session.post(url, json=body, timeout=ENGINE_TIMEOUT) as upstream:
                response.set_status(upstream.status)
                for name in PASSED_HEADERS:
                    if name in upstream.headers:
                        response.headers[name] = upstream.headers[name]
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    last += chunk
                    if streamed and END not in last:
                        await response.write(last)
                        last = b""
                complete = upstream.status == 200
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as err:
            failure = repr(err)
            log.info("relay to %s ended early: %s", url, failure)
        await done(complete)
        if not response.prepared:
            return _error(502, f"the engine at {self.engine} did not answer: {failure}")
        with contextlib.suppress(aiohttp.ClientError, ConnectionError):  # the client left
            await response.write(last)
            await response.write_eof()
        return response

    def _keep(self, entries: list[kvslots.Entry], data: bytes) -> None:
        """Store the slot file and its references in the background."""
        if len(self._stores) >= STORES_PENDING:
            self.metrics.skipped.inc()
            return
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(loop.run_in_executor(self._storing, self._put, entries, data))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)

    def _put(self, entries: Sequence[kvslots.Entry], data: bytes) -> None:
        """Put the slot file, then its references (blocking: run in the store thread)."""
        assert self.pool is not None
        for entry in entries:
            value = data if entry.target is None else kvslots.reference(entry.target)
            if self.pool.put(entry.block_hash, entry.tokens, value):
                if entry.target is None:
                    self.metrics.stored.inc()
                    self.metrics.stored_bytes.inc(len(data))
            elif entry.target is None:
                self.metrics.refused.inc()
                return  # no file: references would name nothing


PROXY = web.AppKey("proxy", Proxy)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message}}, status=status)


def token_ids(prompt: object) -> list[int] | None:
    """The prompt as token ids, when it is a list of them; None for text or anything else."""
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


async def completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "the body is not a JSON object")
    return await request.app[PROXY].serve(request, body, token_ids(body.get("prompt")))


async def health(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    try:
        async with proxy.session.get(f"{proxy.engine}/health", timeout=ACTION_TIMEOUT) as answer:
            text = await answer.text()
            return web.Response(status=answer.status, text=text, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError) as err:
        return _error(502, f"the engine at {proxy.engine} did not answer: {err!r}")


async def metrics(request: web.Request) -> web.Response:
    """The engine's series (none when it does not answer), then the proxy's."""
    proxy = request.app[PROXY]
    engine = ""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with proxy.session.get(f"{proxy.engine}/metrics", timeout=ACTION_TIMEOUT) as answer:
            if answer.status == 200:
                engine = await answer.text()
    if engine and not engine.endswith("\n"):
        engine += "\n"
    proxy.metrics.down.set(0 if proxy.pool is None else len(proxy.pool.down()))
    body = engine.encode() + generate_latest(proxy.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(proxy: Proxy) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[PROXY] = proxy
    app.cleanup_ctx.append(proxy.running)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/completion", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


# --- command line ----------------------------------------------------------------------------


def parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m matrixpool.serving.kvproxy", description=__doc__.split("::")[0]
    )
    parser.add_argument(
        "--engine", default="http://127.0.0.1:8080", help="the llama.cpp server's base URL"
    )
    parser.add_argument(
        "--listen",
        default=f"{environ.get('MATRIXPOOL_POD_IP') or '0.0.0.0'}:8000",
        help="host:port to serve on (default: $MATRIXPOOL_POD_IP, else all, port 8000)",
    )
    parser.add_argument("--slots", type=int, default=4, help="the engine's --parallel")
    parser.add_argument(
        "--slot-dir", type=Path, required=True, help="the engine's --slot-save-path"
    )
    kvargs.add(parser, environ)
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = parser(os.environ if environ is None else environ).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--listen {args.listen}: need host:port")
    asyncio.run(_serve(args, host, int(port)))
    return 0


async def _serve(args: argparse.Namespace, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    proxy = Proxy(args.engine, args.slot_dir, args.slots, kvargs.client(args))
    runner = web.AppRunner(create_app(proxy), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("proxying %s on %s, %d slots", args.engine, runner.addresses, args.slots)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
