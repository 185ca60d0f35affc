"""The simulated inference server: one :class:`~matrixpool.serving.engine.Engine` behind an
OpenAI-style completions endpoint, in real time, with Prometheus metrics in vLLM's names.

Run by ``python -m matrixpool.serving`` (the matrixpool image's serving entry point, which
the kubelet starts in inference pods); tests build the app with :func:`create_app`. Endpoints:

- ``POST /v1/completions``: ``{"model", "prompt": [token ids] | "text", "max_tokens",
  "stream"}``; a text prompt counts one token per 4 characters. ``stream: true`` answers with
  Server-Sent Events, one ``data:`` chunk per output token at the engine's time for it, then
  ``data: [DONE]``; otherwise one JSON body with ``usage``. While draining: 503 with
  ``Retry-After`` (a request is refused, never taken and dropped).
- ``POST /drain``: take no new requests, finish the accepted ones.
- ``GET /healthz``: 200, or 503 while draining.
- ``GET /metrics``: the Prometheus text format, from a registry private to the app; with
  experts (:mod:`matrixpool.serving.experts`), the tokens routed to each expert and to each
  card of the expert map in force.

With the supernode's KV-cache pool (``prefixes``, :mod:`matrixpool.serving.prefixpool`), a
token-id prompt's cached prefix is looked up in the pool before the engine takes it, in threads
of their own (``LOOKUP_THREADS``), for at most ``lookup_budget_s`` (then the prompt is computed,
as without a pool). A request waiting on its look-up counts in ``num_requests_waiting``, and its
time to first token runs from its receipt, as vLLM's does. The blocks the pool lacked are stored
once the request has been served, best effort: a bounded queue (``STORE_QUEUE``) that one
thread of its own empties, and a store that finds it full is dropped, so that a store never
delays a request. That thread also learns, every ``REFRESH_SECONDS``, which daemons hold the
service's blocks (``PooledPrefixes.refresh``).

A background task (:meth:`Serving.run`) advances the engine to the clock, hands each request's
events to its handler and sleeps until the engine's next event or a new request. On SIGTERM
``__main__`` drains, waits until the engine is idle (bounded) and stops (:func:`drain_and_stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from matrixpool.serving import engine, experts, prefixpool

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # a text prompt's tokens: one per 4 characters (OpenAI's rule of thumb)
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default
LOOKUP_THREADS = 4  # KV-pool look-ups at once
LOOKUP_BUDGET_S = 0.5  # seconds a request waits on its look-up before it is computed anyway
STORE_QUEUE = 8  # KV-pool stores waiting; one more is dropped
REFRESH_SECONDS = 5.0  # how often the pool's daemons holding the service's blocks are re-read
LABELS = ["model_name"]
# Histogram buckets after vLLM's for the same metrics.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Metrics:
    """The server's metrics, in a registry of their own (two apps in one process never share)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)

        self.running = gauge("vllm:num_requests_running", "Requests prefilling or decoding.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests accepted, not admitted yet.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Reserved share of the KV cache, 0..1.")
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",  # current vLLM's name for it
            "Mean time per output token after the first, per request.",
            TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens_total", "Prompt tokens of finished requests."
        )
        self.generation_tokens = counter("vllm:generation_tokens_total", "Tokens generated.")
        self.success = counter("vllm:request_success_total", "Requests finished.")
        self.busy = counter(
            "matrixpool_serving_busy_seconds_total",
            "Seconds the instance spent in prefill or decode iterations (its cards' busy time).",
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (the KV pool)."
        )
        self.pool_stored = counter(
            "matrixpool_serving_kv_pool_blocks_stored_total",
            "KV blocks this instance stored in the supernode's KV-cache pool.",
        )
        self.pool_dropped = counter(
            "matrixpool_serving_kv_pool_stores_dropped_total",
            "Stores of a request's KV blocks dropped: the store queue was full.",
        )
        every = (self.running, self.waiting, self.kv_usage, self.ttft, self.tpot, self.e2e,
                 self.prompt_tokens, self.generation_tokens, self.success, self.busy,
                 self.prefix_queries, self.prefix_hits, self.pool_stored,
                 self.pool_dropped)  # fmt: skip
        for metric in every:
            metric.labels(model_name)  # every series exists from the start, at 0
        self.expert_tokens = Counter(
            experts.EXPERT_TOKENS.removesuffix("_total"),
            "Tokens the gate routed to each expert (a token counts once per expert).",
            [*LABELS, "expert"],
            registry=self.registry,
        )
        self.slot_tokens = Counter(
            experts.SLOT_TOKENS.removesuffix("_total"),
            "Routed tokens each slot (card) of the expert map took: its expert's, split evenly "
            "between that expert's copies.",
            [*LABELS, "slot"],
            registry=self.registry,
        )

    def track_experts(self, count: int) -> None:
        """Have every expert's series exist from the start, at 0."""
        for expert in range(count):
            self.expert_tokens.labels(self.model_name, str(expert))

    def count_experts(self, per_expert: Sequence[int], per_slot: Mapping[int, int]) -> None:
        name = self.model_name
        for expert, routed in enumerate(per_expert):
            if routed:
                self.expert_tokens.labels(name, str(expert)).inc(routed)
        for slot, routed in per_slot.items():
            self.slot_tokens.labels(name, str(slot)).inc(routed)

    def observe(self, timing: engine.Timing, received_s: float | None = None) -> None:
        """A finished request, received at ``received_s`` (its TTFT and E2E run from then;
        default: its arrival at the engine)."""
        name = self.model_name
        if received_s is None:
            received_s = timing.submitted_s
        self.ttft.labels(name).observe(timing.first_token_s - received_s)
        if timing.tpot_s is not None:
            self.tpot.labels(name).observe(timing.tpot_s)
        self.e2e.labels(name).observe(timing.finished_s - received_s)
        self.prompt_tokens.labels(name).inc(timing.prompt_tokens)
        self.generation_tokens.labels(name).inc(len(timing.token_s))
        self.success.labels(name).inc()

    def set_gauges(self, gauges: engine.Gauges, busy_delta: float, looking: int = 0) -> None:
        """The engine's gauges; ``looking`` requests wait on a KV-pool look-up besides."""
        name = self.model_name
        self.running.labels(name).set(gauges.running)
        self.waiting.labels(name).set(gauges.waiting + looking)
        self.kv_usage.labels(name).set(gauges.kv_usage)
        self.busy.labels(name).inc(max(0.0, busy_delta))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Serving:
    """One engine in real time: the clock's reader, the events' postman and the drain."""

    def __init__(
        self,
        instance: engine.Engine,
        model_name: str,
        clock: Callable[[], float],
        prefixes: prefixpool.PooledPrefixes | None = None,
        routed: experts.Experts | None = None,
        lookup_budget_s: float = LOOKUP_BUDGET_S,
    ) -> None:
        self.engine = instance
        self.prefixes = prefixes
        self.experts = routed
        self.lookup_budget_s = lookup_budget_s
        self._looking = 0  # requests waiting on a KV-pool look-up
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kv-lookup")
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="kv-store")  # and refreshes
        self._to_store: asyncio.Queue[tuple[tuple[str, ...], int]] = asyncio.Queue(STORE_QUEUE)
        self._received: dict[str, float] = {}  # request id -> when the server received it
        self.model_name = model_name
        self.clock = clock
        self.metrics = Metrics(model_name)
        self._streams: dict[str, asyncio.Queue[engine.Event]] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._busy_seen = 0.0
        if routed is not None:
            self.metrics.track_experts(routed.count)

    def pump(self) -> None:
        """Advance the engine to now; each event to its request's handler; metrics updated."""
        if self.experts is not None and self.experts.poll(self.clock()):
            log.info("expert map reloaded: %s", self.experts.map_file.path)
        for event in self.engine.advance(self.clock()):
            stream = self._streams.get(event.request_id)
            if stream is not None:
                stream.put_nowait(event)
            if isinstance(event, engine.Finished):
                received = self._received.pop(event.request_id, event.timing.submitted_s)
                self.metrics.observe(event.timing, received)
                self.route(event.timing)
        gauges = self.engine.gauges()
        self.metrics.set_gauges(gauges, gauges.busy_seconds - self._busy_seen, self._looking)
        self._busy_seen = gauges.busy_seconds
        if self.engine.idle:
            self._idle.set()
        else:
            self._idle.clear()

    def route(self, timing: engine.Timing) -> None:
        """Count a finished request's tokens into the experts: the ones this instance computed
        (its prompt unless it only decodes, its output unless it only prefills)."""
        if self.experts is None:
            return
        role = self.engine.role
        prompt = 0 if role is engine.Role.DECODE else timing.prompt_tokens
        output = 0 if role is engine.Role.PREFILL else len(timing.token_s)
        self.metrics.count_experts(*self.experts.route(prompt + output))

    async def run(self) -> None:
        """Pump, then sleep until the engine's next event or a new request; forever."""
        while True:
            self._wake.clear()
            self.pump()
            next_at = self.engine.next_event_time()
            delay = None if next_at is None else max(0.0, next_at - self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    def wake(self) -> None:
        """Have :meth:`run` pump now (a request came, or a test moved its clock)."""
        self._wake.set()

    def submit(
        self,
        prompt_tokens: int,
        output_tokens: int,
        hashes: tuple[str, ...],
        received_s: float | None = None,
    ) -> tuple[str, asyncio.Queue[engine.Event]] | engine.Refused:
        """Give the engine a request now: its id and the queue its events will come to.
        ``received_s``: when the server received it (default now), for its TTFT."""
        request_id = f"cmpl-{next(self._ids)}"
        request = engine.Request(request_id, prompt_tokens, output_tokens, hashes)
        now = self.clock()
        refused = self.engine.submit(request, now)
        if refused is not None:
            return refused
        self._received[request_id] = now if received_s is None else min(received_s, now)
        self._idle.clear()
        queue: asyncio.Queue[engine.Event] = asyncio.Queue()
        self._streams[request_id] = queue
        self.wake()
        return request_id, queue

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def look_up(self, completion: Completion) -> prefixpool.Looked | None:
        """The prompt's cached prefix in the KV pool (None: no pool, nothing to look up, or
        no answer within the budget). The request counts as waiting meanwhile."""
        hashes = completion.prefix_hashes
        if self.prefixes is None or not hashes or self.engine.role is engine.Role.DECODE:
            return None
        name = self.model_name
        self.metrics.prefix_queries.labels(name).inc(len(hashes) * engine.BLOCK_TOKENS)
        loop = asyncio.get_running_loop()
        self._looking += 1
        try:
            asked = loop.run_in_executor(self._lookups, self.prefixes.look_up, hashes)
            looked = await asyncio.wait_for(asked, self.lookup_budget_s)
        except TimeoutError:
            log.info("KV pool: no answer in %.2f s: the prompt is computed", self.lookup_budget_s)
            return None
        finally:
            self._looking -= 1
        self.metrics.prefix_hits.labels(name).inc(looked.tokens)
        return looked

    def keep(self, completion: Completion, looked: prefixpool.Looked | None) -> None:
        """Queue the store of the prompt's blocks the pool lacked; dropped if the queue is
        full (a store never delays a request)."""
        hashes = completion.prefix_hashes
        if self.prefixes is None or looked is None or looked.blocks >= len(hashes):
            return
        try:
            self._to_store.put_nowait((hashes, looked.blocks))
        except asyncio.QueueFull:
            self.metrics.pool_dropped.labels(self.model_name).inc()

    async def store(self) -> None:
        """Store the queued blocks in the pool, one request's at a time; forever."""
        assert self.prefixes is not None
        loop = asyncio.get_running_loop()
        while True:
            hashes, skip = await self._to_store.get()
            try:
                stored = await loop.run_in_executor(self._stores, self.prefixes.keep, hashes, skip)
            except Exception:  # the pool is a cache: a store that failed is a store not made
                log.exception("KV pool: a store failed")
                continue
            self.metrics.pool_stored.labels(self.model_name).inc(stored)

    async def refresh(self, every_s: float = REFRESH_SECONDS) -> None:
        """Learn which daemons hold the service's blocks, now and every ``every_s``."""
        assert self.prefixes is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(self._stores, self.prefixes.refresh)
            except Exception:
                log.exception("KV pool: reading which daemons hold blocks failed")
            await asyncio.sleep(every_s)

    def close(self) -> None:
        """Let the pool's threads go (a look-up or store in flight still ends)."""
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._stores.shutdown(wait=False, cancel_futures=True)

    def drain(self) -> None:
        self.engine.drain()
        self.pump()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the engine to have nothing left; True if it has."""
        self.pump()
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


STATE = web.AppKey("serving", Serving)
RETRY_AFTER = web.AppKey("retry_after_s", int)  # seconds a draining instance's 503 asks to wait


# --- the request body -------------------------------------------------------------------------
@dataclass(frozen=True)
class Completion:
    """A parsed ``/v1/completions`` body."""

    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    prefix_hashes: tuple[str, ...]  # of a token-id prompt; none for text


def parse(body: Any) -> Completion | str:
    """The body as a :class:`Completion`, or what is wrong with it."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    model, prompt = body.get("model"), body.get("prompt")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    stream = body.get("stream", False)
    if not isinstance(model, str):
        return "model must be a string"
    if not _is_int(max_tokens) or max_tokens < 1:
        return "max_tokens must be an integer >= 1"
    if not isinstance(stream, bool):
        return "stream must be true or false"
    if isinstance(prompt, str) and prompt:
        tokens = math.ceil(len(prompt) / CHARS_PER_TOKEN)
        return Completion(model, tokens, max_tokens, stream, ())
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        hashes = engine.block_hashes(prompt)
        return Completion(model, len(prompt), max_tokens, stream, hashes)
    return "prompt must be a non-empty string or a non-empty list of token ids"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


# --- handlers ---------------------------------------------------------------------------------
def _draining(retry_after_s: int) -> web.Response:
    headers = {"Retry-After": str(retry_after_s)}
    return _error(503, "the instance is draining: send the request elsewhere", headers)


async def completions(request: web.Request) -> web.StreamResponse:
    serving = request.app[STATE]
    received = serving.clock()
    retry_after_s = request.app[RETRY_AFTER]
    if serving.engine.draining:
        return _draining(retry_after_s)
    try:
        completion = parse(await request.json())
    except json.JSONDecodeError:
        return _error(400, "the body is not JSON")
    if isinstance(completion, str):
        return _error(400, completion)
    output = 1 if serving.engine.role is engine.Role.PREFILL else completion.max_tokens
    looked = await serving.look_up(completion)
    taken = serving.submit(completion.prompt_tokens, output, completion.prefix_hashes, received)
    if taken is engine.Refused.DRAINING:
        return _draining(retry_after_s)
    if isinstance(taken, engine.Refused):
        return _error(400, "prompt and max_tokens need more KV cache than the instance holds")
    request_id, queue = taken
    try:
        if completion.stream:
            return await _stream(request, completion, request_id, queue, output)
        return await _whole(completion, request_id, queue)
    finally:
        serving.forget(request_id)
        serving.keep(completion, looked)


async def _next_token(queue: asyncio.Queue[engine.Event]) -> engine.Token | None:
    """The request's next token; None once it has finished."""
    event = await queue.get()
    return None if isinstance(event, engine.Finished) else event


def _chunk(
    completion: Completion, request_id: str, text: str, finish: str | None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": request_id, "object": "text_completion", "model": completion.model,
            "choices": [choice]}  # fmt: skip


async def _stream(
    request: web.Request,
    completion: Completion,
    request_id: str,
    queue: asyncio.Queue[engine.Event],
    output: int,
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    while (token := await _next_token(queue)) is not None:
        finish = "length" if token.index == output - 1 else None
        chunk = _chunk(completion, request_id, f" t{token.index}", finish)
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _whole(
    completion: Completion, request_id: str, queue: asyncio.Queue[engine.Event]
) -> web.Response:
    texts = []
    while (token := await _next_token(queue)) is not None:
        texts.append(f" t{token.index}")
    body = _chunk(completion, request_id, "".join(texts), "length")
    body["usage"] = {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": len(texts),
        "total_tokens": completion.prompt_tokens + len(texts),
    }
    return web.json_response(body)


async def drain(request: web.Request) -> web.Response:
    serving = request.app[STATE]
    serving.drain()
    gauges = serving.engine.gauges()
    return web.json_response(
        {"draining": True, "running": gauges.running, "waiting": gauges.waiting}
    )


async def healthz(request: web.Request) -> web.Response:
    if request.app[STATE].engine.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    serving = request.app[STATE]
    serving.pump()
    return web.Response(body=serving.metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})


# --- the app ----------------------------------------------------------------------------------
def create_app(
    instance: engine.Engine,
    *,
    model_name: str = "matrixpool-sim",
    clock: Callable[[], float] = time.monotonic,
    retry_after_s: int = 1,
    prefixes: prefixpool.PooledPrefixes | None = None,
    routed: experts.Experts | None = None,
    lookup_budget_s: float = LOOKUP_BUDGET_S,
) -> web.Application:
    """The server's app around ``instance``; its engine loop runs while the app does. With
    ``prefixes``, the engine's prefix cache is the supernode's KV-cache pool; with ``routed``,
    the tokens of finished requests are counted per expert and per card of the expert map."""
    app = web.Application()
    if prefixes is not None:
        instance.prefix_cache = prefixes
    app[STATE] = Serving(instance, model_name, clock, prefixes, routed, lookup_budget_s)
    app[RETRY_AFTER] = retry_after_s
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/drain", drain)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(_engine_loop)
    return app


async def _engine_loop(app: web.Application) -> AsyncIterator[None]:
    """The engine loop while the app runs; with a KV pool (and prefills to look up), its
    store and refresh loops too."""
    serving = app[STATE]
    tasks = [asyncio.create_task(serving.run(), name="engine loop")]
    tasks[0].add_done_callback(_report_crash)
    if serving.prefixes is not None and serving.engine.role is not engine.Role.DECODE:
        tasks.append(asyncio.create_task(serving.store(), name="KV pool stores"))
        tasks.append(asyncio.create_task(serving.refresh(), name="KV pool holders"))
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    serving.close()


def _report_crash(task: asyncio.Task[None]) -> None:
    """The loop runs until cancelled; anything else leaves requests unanswered: say so."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("the engine loop stopped: requests will not be answered", exc_info=error)


async def start(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` (port 0: any free port; see the runner's addresses)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def drain_and_stop(
    runner: web.AppRunner, drain_seconds: float, linger_seconds: float = 0.0
) -> bool:
    """Drain, wait up to ``drain_seconds`` for the accepted requests to finish, then stop
    serving; True when they all finished. The port stays open (answering 503) for at least
    ``linger_seconds``: clients whose list of servers still names this one are told to go
    elsewhere instead of being refused (a pod's endpoints go some time after its SIGTERM)."""
    serving = runner.app[STATE]
    serving.drain()
    started = asyncio.get_running_loop().time()
    try:
        drained = await serving.wait_idle(drain_seconds)
        left = linger_seconds - (asyncio.get_running_loop().time() - started)
        if left > 0:
            await asyncio.sleep(left)
        return drained
    finally:
        await runner.cleanup()
