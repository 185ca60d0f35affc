"""The load generator against fake completions servers: it records TTFT and TPOT from the
stream, sends open-loop on a compressed schedule, re-sends a 503 to another URL (retried, not
failed), counts HTTP errors and dropped connections as failed; and the figures it reports."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from matrixpool.serving import loadgen, workload

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
    for server in servers:
        await server.start_server()
    try:
        yield tuple(f"http://{server.host}:{server.port}" for server in servers)
    finally:
        for server in servers:
            await server.close()


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
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free once closed: nothing listens there

    async def go() -> list[loadgen.Record]:
        return await loadgen.run([request(0)], loadgen.Options((f"http://127.0.0.1:{port}",)))

    [record] = asyncio.run(go())
    assert (record.status, record.http_status, record.first_token_at) == (
        CONNECTION_ERROR,
        None,
        None,
    )


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


def test_the_module_runs_with_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "matrixpool.serving.loadgen", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--time-scale" in done.stdout
