"""The load generator against fake completions servers: it records TTFT and TPOT from the
stream, sends open-loop on a compressed schedule, re-sends a 503 to another URL (retried, not
failed), counts HTTP errors and dropped connections as failed; and the figures it reports.
Disaggregated, it sends each request to a prefill server for its first token, then to a decode
server for the rest (also against the real simulated servers). With live URL sets (real time,
a short refresh), new requests follow the listing, a request waits for an empty set to fill,
and a refused connection to a server no longer listed is retried elsewhere."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import abc, web
from aiohttp.test_utils import TestServer

from matrixpool.serving import engine, latency, loadgen, server, workload

OK = loadgen.Status.OK
HTTP_ERROR = loadgen.Status.HTTP_ERROR
CONNECTION_ERROR = loadgen.Status.CONNECTION_ERROR
TOKEN = b'data: {"object": "text_completion", "choices": [{"index": 0, "text": "t"}]}\n\n'


# --- fake servers ----------------------------------------------------------------------------
@dataclass
class Fake:
    """A fake completions server: ``kind`` is how it answers; it keeps every request body."""

    kind: str  # "stream", "drain" (503), "error" (500), "drop" (one token, then hangs up)
    first_token_s: float = 0.0  # wait before the first token
    gap_s: float = 0.0  # wait between tokens
    hold: asyncio.Event | None = None  # if set, answers wait until it is
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if self.hold is not None:
            await self.hold.wait()
        if self.kind == "drain":
            return web.Response(status=503, headers={"Retry-After": "30"}, text="draining")
        if self.kind == "error":
            return web.Response(status=500, text="engine broke")
        return await self.stream(request, self.bodies[-1]["max_tokens"])

    async def stream(self, request: web.Request, tokens: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(self.first_token_s)
        await response.write(b": a comment line, not a token\n\n")
        for index in range(tokens):
            await asyncio.sleep(self.gap_s if index else 0)
            await response.write(TOKEN)
            if self.kind == "drop":
                await asyncio.sleep(0.05)
                assert request.transport is not None
                request.transport.close()
                return response
        await response.write(b"data: [DONE]\n\n")
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        return app


@asynccontextmanager
async def serving(*fakes: Fake) -> AsyncIterator[tuple[str, ...]]:
    """The fakes on local ports, as base URLs."""
    servers = [TestServer(fake.app()) for fake in fakes]
    for one in servers:
        await one.start_server()
    try:
        yield tuple(f"http://{one.host}:{one.port}" for one in servers)
    finally:
        for one in servers:
            await one.close()


@dataclass
class FakeTime:
    """A clock that moves only when the load generator sleeps."""

    t: float = 0.0
    sleeps: list[float] = field(default_factory=list)

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(0)  # what is ready runs first, as in a real sleep
        self.t += seconds


def request(id: int, at: float = 0.0, tokens: int = 3) -> workload.Request:
    return workload.Request(id, at, (id, 7, 7, 7), tokens, None)


def send(
    fakes: Sequence[Fake],
    requests: Sequence[workload.Request],
    time: FakeTime | None = None,
    **options: Any,
) -> list[loadgen.Record]:
    async def go() -> list[loadgen.Record]:
        async with serving(*fakes) as urls:
            sent = loadgen.run(requests, loadgen.Options(urls, **options), **clock(time))
            return await asyncio.wait_for(sent, timeout=30)

    return asyncio.run(go())


def clock(time: FakeTime | None) -> dict[str, Any]:
    return {} if time is None else {"now": time.now, "sleep": time.sleep}


def send_split(
    prefill: Sequence[Fake],
    decode: Sequence[Fake],
    requests: Sequence[workload.Request],
    **options: Any,
) -> tuple[list[loadgen.Record], tuple[str, ...], tuple[str, ...]]:
    """Disaggregated: the records, the prefill URLs and the decode URLs."""

    async def go() -> tuple[list[loadgen.Record], tuple[str, ...], tuple[str, ...]]:
        async with serving(*prefill) as firsts, serving(*decode) as seconds:
            sent = loadgen.run(requests, loadgen.Options(firsts, seconds, **options))
            return await asyncio.wait_for(sent, timeout=30), firsts, seconds

    return asyncio.run(go())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port  # free once closed: nothing listens there


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail after ``seconds``."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


@dataclass
class Listing:
    """A live URL source the test changes; counts how often the load generator read it."""

    urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    reads: int = 0

    def __call__(self) -> loadgen.UrlSets:
        self.reads += 1
        return self.urls, self.decode_urls

    async def relist(self, urls: tuple[str, ...], decode_urls: tuple[str, ...] = ()) -> None:
        """List these, and return once the load generator has read them."""
        self.urls, self.decode_urls = urls, decode_urls
        seen = self.reads
        await until(lambda: self.reads > seen)


REFRESH_S = 0.01


# --- streaming -------------------------------------------------------------------------------
def test_a_streamed_answer_gives_ttft_and_tpot() -> None:
    fake = Fake("stream", first_token_s=0.2, gap_s=0.1)
    [record] = send([fake], [request(5, tokens=4)], model="m1")
    assert fake.bodies == [{"model": "m1", "prompt": [5, 7, 7, 7], "max_tokens": 4, "stream": True}]
    assert (record.request_id, record.status, record.http_status) == (5, OK, 200)
    assert (record.tokens, len(record.token_gaps), record.retried) == (4, 3, 0)
    ttft, tpot = record.ttft, record.tpot
    assert ttft is not None
    assert ttft >= 0.2  # the server waited that long before the first token
    assert tpot is not None
    assert tpot == pytest.approx(sum(record.token_gaps) / 3)  # (last - first) / (n - 1)
    assert tpot > 0.05  # 0.1 s between tokens, less any delay in reading the first one


def test_a_single_token_has_a_ttft_and_no_tpot() -> None:
    [record] = send([Fake("stream")], [request(0, tokens=1)])
    assert (record.status, record.tokens, record.tpot) == (OK, 1, None)
    assert record.ttft is not None


# --- open loop and the time scale ------------------------------------------------------------
def test_the_time_scale_compresses_the_schedule() -> None:
    time = FakeTime()
    arrivals = [0.0, 10.0, 25.0, 40.0]  # workload seconds
    requests = [request(i, at) for i, at in enumerate(arrivals)]
    records = send([Fake("stream")], requests, time, time_scale=10.0)
    assert [r.due_at for r in records] == [0.0, 1.0, 2.5, 4.0]
    assert [r.sent_at for r in records] == [0.0, 1.0, 2.5, 4.0]
    assert sum(time.sleeps) == pytest.approx(4.0)
    assert [r.status for r in records] == [OK] * 4


def test_requests_are_sent_without_waiting_for_answers() -> None:
    async def go() -> list[loadgen.Record]:
        hold = asyncio.Event()
        fake = Fake("stream", hold=hold)
        async with serving(fake) as urls:
            time = FakeTime()
            requests = [request(i, at=float(i)) for i in range(5)]
            sending = asyncio.create_task(
                loadgen.run(requests, loadgen.Options(urls), now=time.now, sleep=time.sleep)
            )
            deadline = asyncio.get_running_loop().time() + 10
            while len(fake.bodies) < 5:  # all five reach the server while none is answered
                assert asyncio.get_running_loop().time() < deadline, "sends waited for answers"
                assert not sending.done()
                await asyncio.sleep(0.01)
            hold.set()
            return await asyncio.wait_for(sending, timeout=30)

    assert [r.status for r in asyncio.run(asyncio.wait_for(go(), timeout=30))] == [OK] * 5


# --- 503: another URL ------------------------------------------------------------------------
def test_a_503_is_sent_to_another_url_and_recorded_as_retried() -> None:
    draining, serving_fake = Fake("drain"), Fake("stream")
    records = send([draining, serving_fake], [request(i, at=i * 0.01) for i in range(4)])
    assert [r.status for r in records] == [OK] * 4
    assert [r.retried for r in records] == [1, 0, 0, 0]
    assert len(draining.bodies) == 1  # then avoided for its Retry-After (30 s)
    assert len(serving_fake.bodies) == 4
    summary = loadgen.summarize(records)
    assert (summary.ok, summary.failed, summary.retried) == (4, 0, 1)


def test_503_from_every_url_waits_retry_after_then_fails_after_the_retries() -> None:
    time = FakeTime()
    fakes = [Fake("drain"), Fake("drain")]
    [record] = send(fakes, [request(0)], time, max_retries=3, retry_wait_cap_s=2.0)
    assert (record.status, record.http_status, record.retried) == (HTTP_ERROR, 503, 3)
    assert [len(f.bodies) for f in fakes] == [2, 2]
    assert time.sleeps == [2.0]  # both answered 503 once: Retry-After 30, capped at 2
    assert loadgen.summarize([record]).failed == 1


# --- failures --------------------------------------------------------------------------------
def test_an_http_error_is_failed() -> None:
    [record] = send([Fake("error")], [request(0)])
    assert (record.status, record.http_status, record.retried) == (HTTP_ERROR, 500, 0)
    assert "engine broke" in record.error
    summary = loadgen.summarize([record])
    assert (summary.failed, summary.http_errors, summary.connection_errors) == (1, 1, 0)


def test_a_dropped_connection_is_failed_and_keeps_the_tokens_seen() -> None:
    [record] = send([Fake("drop")], [request(0, tokens=5)])
    assert (record.status, record.tokens) == (CONNECTION_ERROR, 1)
    summary = loadgen.summarize([record])
    assert (summary.ok, summary.failed, summary.connection_errors) == (0, 1, 1)


def test_a_refused_connection_is_failed() -> None:
    port = free_port()

    async def go() -> list[loadgen.Record]:
        return await loadgen.run([request(0)], loadgen.Options((f"http://127.0.0.1:{port}",)))

    [record] = asyncio.run(go())
    assert (record.status, record.http_status, record.first_token_at) == (
        CONNECTION_ERROR,
        None,
        None,
    )


# --- disaggregated: prefill, then decode -----------------------------------------------------
def test_a_disaggregated_request_has_its_first_token_from_prefill_and_the_rest_from_decode() -> (
    None
):
    prefill = Fake("stream", first_token_s=0.2)
    decode = Fake("stream", first_token_s=0.3, gap_s=0.1)  # 0.3 s: the KV coming over
    [record], [prefill_url], [decode_url] = send_split([prefill], [decode], [request(5, tokens=4)])
    body = {"model": "matrixpool-sim", "prompt": [5, 7, 7, 7], "stream": True}
    assert prefill.bodies == [{**body, "max_tokens": 1}]
    assert decode.bodies == [{**body, "max_tokens": 4}]
    assert (record.status, record.tokens, record.retried) == (OK, 4, 0)
    assert (record.prefill_url, record.url, record.failed_leg) == (prefill_url, decode_url, None)
    ttft, tpot = record.ttft, record.tpot
    assert ttft is not None
    assert ttft >= 0.2  # the prefill's token
    # The decode was sent after it: its first chunk (0.3 s) is skipped, its second 0.1 s later.
    assert record.token_gaps[0] >= 0.4
    assert tpot == pytest.approx(sum(record.token_gaps) / 3)


def test_a_one_token_request_still_goes_to_decode_and_has_one_token() -> None:
    prefill, decode = Fake("stream"), Fake("stream")
    [record], _, _ = send_split([prefill], [decode], [request(0, tokens=1)])
    assert (record.status, record.tokens, record.tpot) == (OK, 1, None)
    assert [b["max_tokens"] for b in prefill.bodies + decode.bodies] == [1, 1]


def test_disaggregated_against_the_simulated_prefill_and_decode_servers() -> None:
    model = latency.DEFAULT.scaled(20.0)

    def app(role: engine.Role) -> web.Application:
        return server.create_app(engine.Engine(model=model, role=role), model_name="m")

    def generated(one: web.Application) -> float | None:
        registry = one[server.STATE].metrics.registry
        return registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "m"})

    async def go() -> list[loadgen.Record]:
        prefill, decode = TestServer(app(engine.Role.PREFILL)), TestServer(app(engine.Role.DECODE))
        for one in (prefill, decode):
            await one.start_server()
        try:
            urls = tuple(f"http://{one.host}:{one.port}" for one in (prefill, decode))
            options = loadgen.Options(urls[:1], urls[1:], model="m")
            requests = [request(i, at=i * 0.01, tokens=6) for i in range(3)]
            records = await asyncio.wait_for(loadgen.run(requests, options), timeout=30)
            assert [r.prefill_url for r in records] == [urls[0]] * 3
            assert [r.url for r in records] == [urls[1]] * 3
            assert (generated(prefill.app), generated(decode.app)) == (3, 18)
            return records
        finally:
            for one in (prefill, decode):
                await one.close()

    records = asyncio.run(go())
    assert [(r.status, r.tokens) for r in records] == [(OK, 6)] * 3
    for record in records:
        assert record.ttft is not None
        assert record.tpot is not None
        assert record.ttft > 0
        assert record.tpot > 0
        assert record.first_token_at is not None
        assert record.sent_at < record.first_token_at


def test_a_503_on_the_decode_leg_is_retried_on_another_decode_url() -> None:
    prefill, draining, decoding = Fake("stream"), Fake("drain"), Fake("stream")
    [record], _, decode_urls = send_split([prefill], [draining, decoding], [request(0)])
    assert (record.status, record.tokens, record.retried) == (OK, 3, 1)
    assert record.url == decode_urls[1]
    assert [len(f.bodies) for f in (prefill, draining, decoding)] == [1, 1, 1]


@pytest.mark.parametrize(
    ("prefill", "decode", "leg", "status", "tokens", "decode_bodies"),
    [
        pytest.param("error", "stream", loadgen.Leg.PREFILL, HTTP_ERROR, 0, 0, id="prefill 500"),
        pytest.param("drain", "stream", loadgen.Leg.PREFILL, HTTP_ERROR, 0, 0, id="prefill 503s"),
        pytest.param("stream", "error", loadgen.Leg.DECODE, HTTP_ERROR, 1, 1, id="decode 500"),
        pytest.param("stream", "drop", loadgen.Leg.DECODE, CONNECTION_ERROR, 1, 1, id="a drop"),
    ],
)
def test_a_failure_of_either_leg_fails_the_request(
    prefill: str,
    decode: str,
    leg: loadgen.Leg,
    status: loadgen.Status,
    tokens: int,
    decode_bodies: int,
) -> None:
    decoding = Fake(decode)
    [record], _, _ = send_split(
        [Fake(prefill)], [decoding], [request(0)], max_retries=1, retry_wait_cap_s=0.0
    )
    assert (record.status, record.failed_leg, record.tokens) == (status, leg, tokens)
    assert len(decoding.bodies) == decode_bodies  # a failed prefill sends no decode
    summary = loadgen.summarize([record])
    assert (summary.failed, summary.prefill_failures, summary.decode_failures) == (
        1,
        leg is loadgen.Leg.PREFILL,
        leg is loadgen.Leg.DECODE,
    )


# --- live URL sets ---------------------------------------------------------------------------
def test_a_changed_listing_takes_new_requests_and_lets_those_in_flight_finish() -> None:
    async def go() -> list[loadgen.Record]:
        hold = asyncio.Event()
        old, new = Fake("stream", hold=hold), Fake("stream")
        async with serving(old, new) as (old_url, new_url):
            listing = Listing((old_url,))
            requests = [request(0, at=0.0), request(1, at=1.0)]
            sending = asyncio.create_task(
                loadgen.run(
                    requests, loadgen.Options((old_url,)), urls=listing, refresh_s=REFRESH_S
                )
            )
            await until(lambda: len(old.bodies) == 1)  # request 0 in flight to old, held
            await listing.relist((new_url,))  # old goes (its pod is deleted: draining)
            await until(lambda: len(new.bodies) == 1)  # request 1, due at 1 s, to new
            hold.set()
            records = await asyncio.wait_for(sending, timeout=30)
            assert [r.url for r in records] == [old_url, new_url]
            assert len(old.bodies) == 1
            return records

    records = asyncio.run(go())
    assert [(r.status, r.retried) for r in records] == [(OK, 0), (OK, 0)]


def test_a_request_waits_for_an_empty_listing_to_fill() -> None:
    async def go() -> loadgen.Record:
        fake = Fake("stream")
        async with serving(fake) as (url,):
            listing = Listing()  # no server yet
            options = loadgen.Options((url,))
            sending = asyncio.create_task(
                loadgen.run([request(0)], options, urls=listing, refresh_s=REFRESH_S)
            )
            await until(lambda: listing.reads >= 5)  # four refreshes, and still none listed
            assert not fake.bodies
            assert not sending.done()
            await listing.relist((url,))
            [record] = await asyncio.wait_for(sending, timeout=30)
            return record

    record = asyncio.run(go())
    assert (record.status, record.tokens, record.retried) == (OK, 3, 0)
    assert record.ttft is not None
    assert record.ttft >= 4 * REFRESH_S  # it waited while none was listed


def test_a_decode_leg_waits_for_a_decode_server_to_be_listed() -> None:
    async def go() -> loadgen.Record:
        prefill, decode = Fake("stream"), Fake("stream")
        async with serving(prefill, decode) as (prefill_url, decode_url):
            listing = Listing((prefill_url,))
            options = loadgen.Options((prefill_url,), (decode_url,))
            sending = asyncio.create_task(
                loadgen.run([request(0)], options, urls=listing, refresh_s=REFRESH_S)
            )
            await until(lambda: len(prefill.bodies) == 1 and listing.reads >= 5)
            assert not decode.bodies
            await listing.relist((prefill_url,), (decode_url,))
            [record] = await asyncio.wait_for(sending, timeout=30)
            return record

    record = asyncio.run(go())
    assert (record.status, record.tokens, record.failed_leg) == (OK, 3, None)


def test_a_request_fails_once_no_url_was_listed_for_url_wait_s() -> None:
    async def go() -> list[loadgen.Record]:
        options = loadgen.Options(("http://127.0.0.1:1",), url_wait_s=0.05)
        sent = loadgen.run([request(0)], options, urls=Listing(), refresh_s=REFRESH_S)
        return await asyncio.wait_for(sent, timeout=30)

    [record] = asyncio.run(go())
    assert (record.status, record.url, record.http_status) == (CONNECTION_ERROR, "", None)
    assert "no URL listed" in record.error
    assert loadgen.summarize([record]).connection_errors == 1


class HeldResolver(abc.AbstractResolver):
    """Resolves every host name to ``port`` on this machine, once the test says ``go``: a
    connection attempt the test holds between choosing the URL and being refused."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.asked = asyncio.Event()
        self.go = asyncio.Event()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[abc.ResolveResult]:
        self.asked.set()
        await self.go.wait()
        flags = socket.AI_NUMERICHOST
        return [{"hostname": host, "host": "127.0.0.1", "port": self.port, "family": family,
                 "proto": 0, "flags": flags}]  # fmt: skip

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("still_listed", "status", "retried"),
    [
        pytest.param(False, OK, 1, id="unlisted meanwhile: retried elsewhere, not failed"),
        pytest.param(True, CONNECTION_ERROR, 0, id="still listed: failed"),
    ],
)
def test_a_refused_connection_to_a_url_no_longer_listed_is_retried(
    still_listed: bool, status: loadgen.Status, retried: int
) -> None:
    async def go() -> loadgen.Record:
        fake, resolver = Fake("stream"), HeldResolver(free_port())
        deleted = "http://deleted-pod:8000"  # resolved by the resolver: refused
        connector = aiohttp.TCPConnector(limit=0, resolver=resolver, use_dns_cache=False)
        async with serving(fake) as (url,), aiohttp.ClientSession(connector=connector) as session:
            listing = Listing((deleted,))
            sending = asyncio.create_task(
                loadgen.run(
                    [request(0)],
                    loadgen.Options((deleted,)),
                    urls=listing,
                    refresh_s=REFRESH_S,
                    session=session,
                )
            )
            await asyncio.wait_for(resolver.asked.wait(), timeout=10)  # connecting to it
            await listing.relist((deleted, url) if still_listed else (url,))
            resolver.go.set()
            [record] = await asyncio.wait_for(sending, timeout=30)
            assert record.url == (deleted if still_listed else url)
            return record

    record = asyncio.run(go())
    assert (record.status, record.retried) == (status, retried)
    assert loadgen.summarize([record]).failed == (status is not OK)


def test_the_router_sends_nothing_new_to_an_unlisted_url_and_forgets_it_when_idle() -> None:
    router = loadgen.Router(["a", "b"], loadgen.Policy.ROUND_ROBIN, FakeTime().now)
    assert router.choose(set()) == "a"
    router.started("a")
    router.draining("b", 5.0)
    router.update(["b", "c"])
    assert router.urls == ("b", "c")
    assert [router.choose(set()) for _ in range(3)] == ["c", "c", "c"]  # b still draining
    assert router.outstanding == {"a": 1, "b": 0, "c": 0}  # a: one still in flight
    router.ended("a")
    assert router.outstanding == {"b": 0, "c": 0}
    router.update([])
    assert router.choose(set()) is None


def test_a_refresh_interval_of_zero_is_refused() -> None:
    async def go() -> None:
        await loadgen.run([], loadgen.Options(("a",)), urls=Listing(), refresh_s=0.0)

    with pytest.raises(ValueError, match="refresh_s"):
        asyncio.run(go())


# --- choosing a URL --------------------------------------------------------------------------
def test_round_robin_takes_turns_and_avoids_a_draining_url_until_its_retry_after() -> None:
    time = FakeTime()
    router = loadgen.Router(["a", "b", "c"], loadgen.Policy.ROUND_ROBIN, time.now)
    assert [router.choose(set()) for _ in range(4)] == ["a", "b", "c", "a"]
    router.draining("c", 10.0)
    assert [router.choose(set()) for _ in range(3)] == ["b", "a", "b"]
    time.t = 10.0
    assert [router.choose(set()) for _ in range(2)] == ["c", "a"]
    assert router.choose({"a", "b"}) == "c"
    assert router.choose({"a", "b", "c"}) is None


def test_least_outstanding_takes_the_url_with_fewest_in_flight() -> None:
    router = loadgen.Router(["a", "b", "c"], loadgen.Policy.LEAST_OUTSTANDING, FakeTime().now)
    router.outstanding.update(a=3, b=1, c=2)
    assert router.choose(set()) == "b"
    assert router.choose({"b"}) == "c"
    router.draining("b", 5.0)
    assert router.choose(set()) == "c"


def test_draining_urls_are_used_when_no_other_is_left() -> None:
    router = loadgen.Router(["a", "b"], loadgen.Policy.ROUND_ROBIN, FakeTime().now)
    router.draining("a", 5.0)
    router.draining("b", 5.0)
    assert router.choose({"b"}) == "a"


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"urls": ()}, id="no URL"),
        pytest.param({"urls": ("a", "a")}, id="a URL twice"),
        pytest.param({"urls": ("a",), "time_scale": 0.0}, id="a time scale of zero"),
        pytest.param({"urls": ("a",), "max_retries": -1}, id="negative retries"),
        pytest.param({"urls": ("a",), "decode_urls": ("b", "b")}, id="a decode URL twice"),
        pytest.param({"urls": ("a",), "url_wait_s": -1.0}, id="a negative wait for a URL"),
    ],
)
def test_options_out_of_range_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="need"):
        loadgen.Options(**options)


# --- figures ---------------------------------------------------------------------------------
def record(
    ttft: float | None = 0.5,
    tpot: float | None = 0.04,
    status: loadgen.Status = OK,
    retried: int = 0,
    sent_at: float = 10.0,
) -> loadgen.Record:
    """An answered request: first token ``ttft`` after sending, then two gaps of ``tpot``."""
    first = None if ttft is None else sent_at + ttft
    gaps = () if tpot is None or ttft is None else (tpot, tpot)
    return loadgen.Record(0, "u", sent_at, sent_at, first, gaps, status, 200, retried)


TTFT, TPOT = 1.0, 0.05


@pytest.mark.parametrize(
    ("records", "share"),
    [
        pytest.param([record(), record(0.9, 0.05)], 1.0, id="all meet both (at the targets)"),
        pytest.param([record(), record(ttft=1.2)], 0.5, id="a slow first token misses"),
        pytest.param([record(), record(tpot=0.06)], 0.5, id="slow tokens miss"),
        pytest.param([record(), record(tpot=None)], 1.0, id="one token has no TPOT to miss"),
        pytest.param([record(), record(status=CONNECTION_ERROR)], 0.5, id="failed is a miss"),
        pytest.param([record(), record(status=HTTP_ERROR, ttft=None)], 0.5, id="an error too"),
        pytest.param([record(retried=2)], 1.0, id="a retried request can meet"),
        pytest.param([record(ttft=1.0, tpot=0.05)], 1.0, id="equal to the target meets"),
        pytest.param([], 1.0, id="no requests: none missed"),
    ],
)
def test_attainment(records: list[loadgen.Record], share: float) -> None:
    assert loadgen.attainment(records, TTFT, TPOT) == pytest.approx(share)


def test_the_summary_counts_and_takes_percentiles_of_ok_requests() -> None:
    records = [record(ttft=t / 10, tpot=t / 100) for t in range(1, 101)]
    records += [record(status=CONNECTION_ERROR, ttft=99.0), record(status=HTTP_ERROR, ttft=None)]
    records += [record(ttft=0.05, retried=1)]
    summary = loadgen.summarize(records, ttft_s=5.0, tpot_s=1.0)
    assert (summary.sent, summary.ok, summary.failed, summary.retried) == (103, 101, 2, 1)
    assert (summary.http_errors, summary.connection_errors) == (1, 1)
    assert summary.ttft_p50_s == pytest.approx(5.0)  # 51st of 0.05, 0.1, ..., 10.0
    assert summary.ttft_p99_s == pytest.approx(9.9)
    assert summary.tpot_p99_s == pytest.approx(0.99)
    assert summary.attainment == pytest.approx(51 / 103)
    assert loadgen.summarize(records).attainment is None


def test_the_summary_of_nothing() -> None:
    summary = loadgen.summarize([])
    assert (summary.sent, summary.ttft_p50_s, summary.tpot_p99_s) == (0, None, None)


@pytest.mark.parametrize(
    ("values", "share", "expected"),
    [
        pytest.param([3.0, 1.0, 2.0], 0.5, 2.0, id="the median of three"),
        pytest.param([1.0, 2.0, 3.0, 4.0], 0.5, 2.0, id="nearest rank, not interpolated"),
        pytest.param([1.0, 2.0], 0.99, 2.0, id="p99 of two is the larger"),
        pytest.param([7.0], 0.0, 7.0, id="p0 is the least"),
        pytest.param([], 0.5, None, id="none of nothing"),
    ],
)
def test_percentile(values: list[float], share: float, expected: float | None) -> None:
    assert loadgen.percentile(values, share) == expected


# --- command line ----------------------------------------------------------------------------
@contextmanager
def fake_in_a_thread(fake: Fake) -> Iterator[str]:
    """The fake on its own event loop and thread, for the command line's asyncio.run."""
    loop = asyncio.new_event_loop()
    server = TestServer(fake.app(), loop=loop)
    loop.run_until_complete(server.start_server())
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        yield f"http://{server.host}:{server.port}/"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(server.close())
        loop.close()


def test_the_command_line_prints_a_json_summary_last(capsys: pytest.CaptureFixture[str]) -> None:
    fake = Fake("stream")
    with fake_in_a_thread(fake) as url:
        load = "--pattern constant --rate 20 --seconds 10 --time-scale 20"
        lengths = "--prompt-median 8 --output-median 3"
        argv = ["--url", url, *f"{load} {lengths} --ttft 5 --tpot 1 --json".split()]
        assert loadgen.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["sent"] == len(fake.bodies) > 100  # about 200 at 20 rps for 10 s
    assert (summary["ok"], summary["failed"], summary["attainment"]) == (summary["sent"], 0, 1.0)


def test_the_command_line_sends_disaggregated_with_decode_urls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    prefill, decode = Fake("stream"), Fake("stream")
    with fake_in_a_thread(prefill) as prefill_url, fake_in_a_thread(decode) as decode_url:
        load = "--pattern constant --rate 20 --seconds 2 --time-scale 20"
        lengths = "--prompt-median 8 --output-median 3"
        argv = ["--url", prefill_url, "--decode-url", decode_url, *f"{load} {lengths}".split()]
        assert loadgen.main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["sent"] == summary["ok"] == len(prefill.bodies) == len(decode.bodies) > 10
    assert {body["max_tokens"] for body in prefill.bodies} == {1}
    assert summary["decode_failures"] == summary["prefill_failures"] == 0


def test_the_module_runs_with_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "matrixpool.serving.loadgen", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--time-scale" in done.stdout
