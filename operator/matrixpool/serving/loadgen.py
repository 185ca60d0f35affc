"""Sends a workload's requests to inference servers, open-loop, and records what each one saw.

Called by the serving benchmark and the integration tests with requests from
:mod:`matrixpool.serving.workload`, and by hand::

    python -m matrixpool.serving.loadgen --url http://127.0.0.1:8000 --seconds 600 --rate 2 --json
    python -m matrixpool.serving.loadgen --url http://127.0.0.1:8000 --decode-url http://127.0.0.1:8001

Each request is sent at its arrival time (``arrival_s / time_scale`` seconds after the run's
start, so a day can run in minutes) whether or not earlier ones have been answered: the
dispatcher never waits for a response, and the HTTP connection pool is unbounded so that no
request queues in the client. Requests go to ``POST {url}/v1/completions`` with
``stream: true``; the server answers one Server-Sent Event ``data:`` chunk per output token
and then ``data: [DONE]`` (a chunk of no text that only gives the finish reason, llama.cpp's
last, is no token). Per request it records when it was due and sent, when the first token
came, the gaps between tokens (TPOT = (last - first) / (n - 1)), and how it ended:

- ``ok``: the stream ended with ``[DONE]``;
- ``http_error``: any status but 200, or a 503 still answered after ``max_retries`` re-sends;
- ``connection_error``: no answer, or the connection dropped or the stream ended early.

A 503 (a draining instance answers it with Retry-After) is re-sent to another URL, and that
URL is avoided by later requests for Retry-After seconds; the request is recorded as
``retried``, not failed, once it succeeds. With every URL answering 503, it waits Retry-After
(at most ``retry_wait_cap_s``) and tries them again. Nothing else is retried: a dropped
request may have been executed, and the load generator counts it as failed.

**Disaggregated** (``Options.decode_urls`` set, as vLLM's disaggregated-prefill proxy does it):
each request goes first to a prefill server (``urls``) with ``max_tokens: 1``, whose one token
is the user's first token (TTFT), then, unchanged, to a decode server, which receives the
prompt's KV and streams ``max_tokens`` tokens. The decode server's first chunk is the KV
arriving (the token the prefill server already gave), so it is skipped: the user's tokens are
the prefill's one, then the decode's second to last, ``max_tokens`` in all. Each leg retries a
503 within its own set; a failure of either leg fails the request (``Record.failed_leg``).

**Live URL sets** (``run(urls=...)``, for servers that an autoscaler creates and deletes): the
sets are re-read every ``refresh_s``. An unlisted URL gets no new attempt; attempts in flight
to it go on. With no URL listed, a request waits for one, at most ``url_wait_s``, then fails
as a connection error. A connection that cannot be made to a URL that is no longer listed
(the pod went between the refresh and the send) is retried on another URL, like a 503: the
request was never sent. To a listed URL it stays a connection error.

Errors: none of its own; HTTP and connection failures are data (:class:`Status`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import itertools
import json
import math
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp

from matrixpool import clock
from matrixpool.serving import workload

Clock = Callable[[], float]  # monotonic seconds
Sleep = Callable[[float], Awaitable[None]]
DEFAULT_RETRY_AFTER_S = 1.0  # a 503 without a usable Retry-After header


class Status(enum.StrEnum):
    """How a request ended."""

    OK = "ok"
    HTTP_ERROR = "http_error"
    CONNECTION_ERROR = "connection_error"


class Leg(enum.StrEnum):
    """A disaggregated request's two requests."""

    PREFILL = "prefill"  # to a prefill server: the first token
    DECODE = "decode"  # to a decode server: the KV, then the other tokens


class Policy(enum.StrEnum):
    """Which URL takes the next request."""

    ROUND_ROBIN = "round-robin"
    LEAST_OUTSTANDING = "least-outstanding"  # the one with the fewest requests in flight


@dataclass(frozen=True)
class Options:
    """Where and how to send."""

    urls: tuple[str, ...]  # base URLs of the servers (the prefill ones when decode_urls are set)
    decode_urls: tuple[str, ...] = ()  # the decode servers: disaggregated; empty: co-located
    model: str = "matrixpool-sim"  # the request's "model"
    time_scale: float = 1.0  # workload seconds per real second
    policy: Policy = Policy.ROUND_ROBIN
    max_retries: int = 4  # re-sends after a 503 or to a vanished URL, per request and leg
    retry_wait_cap_s: float = 5.0  # longest wait for a Retry-After when every URL answered 503
    read_timeout_s: float = 60.0  # longest silence of a server before a connection error
    url_wait_s: float = 30.0  # live sets: longest a request waits for a URL to be listed
    # An engine with a small vocabulary: prompt ids are sent as first + id % count (the same
    # prefix stays the same ids); None: as drawn.
    vocab: tuple[int, int] | None = None
    extra: tuple[tuple[str, object], ...] = ()  # more fields of the body (e.g. ignore_eos)

    def __post_init__(self) -> None:
        if not self.urls or len(set(self.urls)) != len(self.urls):
            raise ValueError("options: need at least one URL, each once")
        if len(set(self.decode_urls)) != len(self.decode_urls):
            raise ValueError("options: need each decode URL once")
        if self.time_scale <= 0 or self.max_retries < 0 or self.url_wait_s < 0:
            raise ValueError("options: need time_scale > 0, max_retries >= 0, url_wait_s >= 0")

    @property
    def disaggregated(self) -> bool:
        return bool(self.decode_urls)


@dataclass(frozen=True)
class Record:
    """What one request saw; times in real seconds since the run's start."""

    request_id: int  # workload.Request.id
    url: str  # the base URL that gave the last answer; "": none was ever listed
    due_at: float  # when the schedule wanted it sent: arrival_s / time_scale
    sent_at: float  # when it was first sent
    first_token_at: float | None  # when the first token came; None: no token
    token_gaps: tuple[float, ...]  # seconds between consecutive tokens (n - 1 of them)
    status: Status
    http_status: int | None = None  # the last answer's status; None: no answer
    retried: int = 0  # re-sends after a 503 or to a vanished URL, both legs together
    error: str = ""  # what went wrong, for a failed request
    prefill_url: str = ""  # disaggregated: the prefill leg's URL (url is the decode leg's)
    failed_leg: Leg | None = None  # disaggregated: the leg that failed; None: ok, or co-located

    @property
    def tokens(self) -> int:
        return 0 if self.first_token_at is None else len(self.token_gaps) + 1

    @property
    def ttft(self) -> float | None:
        """Time to first token, from the first send (so it includes any 503 round trips)."""
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1); None below 2."""
        return sum(self.token_gaps) / len(self.token_gaps) if self.token_gaps else None


@dataclass(frozen=True)
class Summary:
    """A run in figures (what ``--json`` prints)."""

    sent: int  # requests
    ok: int
    failed: int  # http_error + connection_error
    http_errors: int
    connection_errors: int
    prefill_failures: int  # disaggregated: failed in the prefill leg
    decode_failures: int  # disaggregated: failed in the decode leg
    retried: int  # requests re-sent after a 503 (or a vanished URL) at least once (ok or not)
    ttft_p50_s: float | None  # over ok requests; None: none
    ttft_p99_s: float | None
    tpot_p50_s: float | None  # over ok requests of 2 tokens or more
    tpot_p99_s: float | None
    send_lag_max_s: float  # the latest a request left after it was due: the client kept up?
    attainment: float | None  # share meeting both targets (see attainment()); None: no targets


# --- figures ---------------------------------------------------------------------------------
def meets(record: Record, ttft_s: float, tpot_s: float) -> bool:
    """An ok request whose TTFT is at most ``ttft_s`` and TPOT at most ``tpot_s``; a request of
    one token has no TPOT and meets that target."""
    ttft, tpot = record.ttft, record.tpot
    if record.status is not Status.OK or ttft is None or ttft > ttft_s:
        return False
    return tpot is None or tpot <= tpot_s


def attainment(records: Sequence[Record], ttft_s: float, tpot_s: float) -> float:
    """The share of all requests that ended ok and met both targets: a failed request counts
    as a miss, so failing requests never raises it. No requests: 1.0 (none missed)."""
    if not records:
        return 1.0
    return sum(meets(record, ttft_s, tpot_s) for record in records) / len(records)


def percentile(values: Sequence[float], share: float) -> float | None:
    """Nearest-rank percentile (``share`` in 0..1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def summarize(
    records: Sequence[Record], ttft_s: float | None = None, tpot_s: float | None = None
) -> Summary:
    """The run's counts and latency percentiles; attainment only when both targets are given."""
    ok = [r for r in records if r.status is Status.OK]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    http = sum(r.status is Status.HTTP_ERROR for r in records)
    targets = None if ttft_s is None or tpot_s is None else (ttft_s, tpot_s)
    return Summary(
        sent=len(records),
        ok=len(ok),
        failed=len(records) - len(ok),
        http_errors=http,
        connection_errors=len(records) - len(ok) - http,
        prefill_failures=sum(r.failed_leg is Leg.PREFILL for r in records),
        decode_failures=sum(r.failed_leg is Leg.DECODE for r in records),
        retried=sum(r.retried > 0 for r in records),
        ttft_p50_s=percentile(ttfts, 0.50),
        ttft_p99_s=percentile(ttfts, 0.99),
        tpot_p50_s=percentile(tpots, 0.50),
        tpot_p99_s=percentile(tpots, 0.99),
        send_lag_max_s=max((r.sent_at - r.due_at for r in records), default=0.0),
        attainment=None if targets is None else attainment(records, *targets),
    )


# --- sending ---------------------------------------------------------------------------------
UrlSets = tuple[tuple[str, ...], tuple[str, ...]]  # (urls, decode_urls), as in Options
UrlSource = Callable[[], UrlSets]  # the servers listed now (e.g. an InferenceService's pods)


class Router:
    """Chooses a URL per attempt among the listed ones: by the policy, avoiding URLs that
    answered 503 until their Retry-After has passed (or when no other is left)."""

    def __init__(self, urls: Iterable[str], policy: Policy, now: Clock) -> None:
        self._urls: tuple[str, ...] = ()
        self._policy = policy
        self._now = now
        self._next = 0  # round-robin position
        self.outstanding: dict[str, int] = {}  # requests in flight per URL
        self._draining_until: dict[str, float] = {}
        self.update(urls)

    @property
    def urls(self) -> tuple[str, ...]:
        """The listed URLs: the ones new attempts go to."""
        return self._urls

    def update(self, urls: Iterable[str]) -> None:
        """List ``urls`` instead: an unlisted URL gets no new attempt (those in flight go on)
        and what was known of it is forgotten once nothing is in flight to it."""
        self._urls = tuple(dict.fromkeys(urls))
        for url in self._urls:
            self.outstanding.setdefault(url, 0)
        for url in [url for url, n in self.outstanding.items() if n == 0]:
            if url not in self._urls:
                del self.outstanding[url]
        self._draining_until = {
            url: until for url, until in self._draining_until.items() if url in self._urls
        }

    def choose(self, excluded: set[str]) -> str | None:
        """The URL for the next attempt, never one in ``excluded``; None if all are (or none
        is listed)."""
        allowed = [url for url in self._urls if url not in excluded]
        now = self._now()
        candidates = [
            url for url in allowed if self._draining_until.get(url, -math.inf) <= now
        ] or allowed
        if not candidates:
            return None
        if self._policy is Policy.LEAST_OUTSTANDING:
            return min(candidates, key=self.outstanding.__getitem__)
        for step in range(len(self._urls)):
            index = (self._next + step) % len(self._urls)
            if self._urls[index] in candidates:
                self._next = index + 1
                return self._urls[index]
        raise AssertionError("unreachable: candidates are among the URLs")

    def draining(self, url: str, seconds: float) -> None:
        self._draining_until[url] = self._now() + seconds

    def started(self, url: str) -> None:
        self.outstanding[url] = self.outstanding.get(url, 0) + 1

    def ended(self, url: str) -> None:
        self.outstanding[url] -= 1
        if self.outstanding[url] == 0 and url not in self._urls:
            del self.outstanding[url]


@dataclass(frozen=True)
class _Streamed:
    """An answer that ended, well or not."""

    url: str
    token_times: tuple[float, ...]  # when each token chunk came
    status: Status
    http_status: int | None
    error: str = ""


@dataclass(frozen=True)
class _Draining:
    """A 503: try elsewhere."""

    url: str
    retry_after_s: float

    def failed(self) -> _Streamed:
        return _Streamed(self.url, (), Status.HTTP_ERROR, 503, "503 after every retry")


@dataclass(frozen=True)
class _Gone:
    """No connection to a URL that is no longer listed: the request was never sent; try
    elsewhere."""

    url: str
    error: str

    def failed(self) -> _Streamed:
        return _Streamed(self.url, (), Status.CONNECTION_ERROR, None, self.error)


@dataclass(frozen=True)
class _Run:
    """What every request of a run shares."""

    session: aiohttp.ClientSession
    options: Options
    first: Router  # the URLs a request goes to first: all of it, or its prefill
    decode: Router | None  # disaggregated: the decode servers
    now: Clock
    sleep: Sleep
    start: float  # the run's start on the clock
    refresh_s: float  # how often the URL sets are re-read; a request without a URL polls as often


async def run(
    requests: Iterable[workload.Request],
    options: Options,
    *,
    now: Clock = clock.SYSTEM.monotonic,
    sleep: Sleep = asyncio.sleep,
    urls: UrlSource | None = None,
    refresh_s: float = 1.0,
    session: aiohttp.ClientSession | None = None,
) -> list[Record]:
    """Sends every request at its time and returns their records, in the requests' order.

    ``requests`` may be lazy (``workload.requests``): each is built just before it is due.
    ``urls``, if given, lists the servers instead of ``options``: read at the start and every
    ``refresh_s`` seconds; its decode set is unused unless ``options.decode_urls`` is set (that
    fixes the mode). An exception it raises stops the refreshing and is raised once the
    requests have ended. ``session`` (the caller's, left open) should have an unbounded
    connection pool (``aiohttp.TCPConnector(limit=0)``); by default the run opens its own.
    """
    if not refresh_s > 0:
        raise ValueError(f"run: need refresh_s > 0, got {refresh_s}")
    async with contextlib.AsyncExitStack() as stack:
        if session is None:
            connector = aiohttp.TCPConnector(limit=0)  # no client-side queue: open loop
            session = await stack.enter_async_context(aiohttp.ClientSession(connector=connector))
        decode = Router(options.decode_urls, options.policy, now) if options.disaggregated else None
        first = Router(options.urls, options.policy, now)
        shared = _Run(session, options, first, decode, now, sleep, now(), refresh_s)
        if urls is not None:
            _list(shared, urls())
            stack.push_async_callback(_stop, asyncio.create_task(_refresh(shared, urls)))
        tasks = []
        for request in requests:
            due = request.arrival_s / options.time_scale
            if (wait := shared.start + due - now()) > 0:
                await sleep(wait)
            tasks.append(asyncio.create_task(_send(shared, request, due)))
        return list(await asyncio.gather(*tasks))


async def _refresh(shared: _Run, urls: UrlSource) -> None:
    while True:
        await shared.sleep(shared.refresh_s)
        _list(shared, urls())


def _list(shared: _Run, urls: UrlSets) -> None:
    shared.first.update(urls[0])
    if shared.decode is not None:
        shared.decode.update(urls[1])


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _send(shared: _Run, request: workload.Request, due: float) -> Record:
    """One request to its end: 1. co-located: the request, recorded; disaggregated: 2. the
    prefill leg for one token (recorded if it failed), 3. the decode leg, 4. the prefill's
    token and the decode's after its first, recorded."""
    sent_at = shared.now() - shared.start
    if shared.decode is None:
        answer, retried = await _leg(shared, shared.first, request, request.output_tokens)  # 1.
        return _record(shared, request, due, sent_at, answer, retried)
    prefill, prefill_retried = await _leg(shared, shared.first, request, 1)  # 2.
    if prefill.status is not Status.OK:
        return _record(
            shared, request, due, sent_at, prefill, prefill_retried, prefill.url, Leg.PREFILL
        )
    decode, decode_retried = await _leg(shared, shared.decode, request, request.output_tokens)
    times = prefill.token_times[:1] + decode.token_times[1:]  # 4.
    joined = dataclasses.replace(decode, token_times=times)
    failed = None if decode.status is Status.OK else Leg.DECODE
    retried = prefill_retried + decode_retried
    return _record(shared, request, due, sent_at, joined, retried, prefill.url, failed)


def _record(
    shared: _Run,
    request: workload.Request,
    due: float,
    sent_at: float,
    answer: _Streamed,
    retried: int,
    prefill_url: str = "",
    failed_leg: Leg | None = None,
) -> Record:
    times = [t - shared.start for t in answer.token_times]
    gaps = tuple(later - earlier for earlier, later in itertools.pairwise(times))
    first = times[0] if times else None
    return Record(
        request_id=request.id,
        url=answer.url,
        due_at=due,
        sent_at=sent_at,
        first_token_at=first,
        token_gaps=gaps,
        status=answer.status,
        http_status=answer.http_status,
        retried=retried,
        error=answer.error,
        prefill_url=prefill_url,
        failed_leg=failed_leg,
    )


async def _leg(
    shared: _Run, router: Router, request: workload.Request, max_tokens: int
) -> tuple[_Streamed, int]:
    """One request to one of ``router``'s URLs, to its end, and its re-sends: 1. choose a
    listed URL (none listed: wait for one), 2. stream, 3. on a 503, avoid that URL, on a
    vanished URL forget it, and go to 1 (after Retry-After when every listed URL answered 503)."""
    excluded: set[str] = set()
    retried = 0
    while True:
        excluded &= set(router.urls)  # those unlisted since are never chosen anyway
        if router.urls and excluded == set(router.urls):
            excluded.clear()  # every URL answered 503 and we waited: try them all again
        if (url := router.choose(excluded)) is None:  # 1.
            if (none := await _wait_for_url(shared, router)) is not None:
                return none, retried
            continue
        answer = await _attempt(shared, router, url, request, max_tokens)  # 2.
        if isinstance(answer, _Streamed):
            return answer, retried
        if retried == shared.options.max_retries:
            return answer.failed(), retried
        retried += 1  # 3.
        excluded.add(url)
        if isinstance(answer, _Draining):
            router.draining(url, answer.retry_after_s)
            if excluded >= set(router.urls):
                await shared.sleep(min(answer.retry_after_s, shared.options.retry_wait_cap_s))


async def _wait_for_url(shared: _Run, router: Router) -> _Streamed | None:
    """Wait until ``router`` lists a URL (None), or ``url_wait_s`` for the failure to record."""
    deadline = shared.now() + shared.options.url_wait_s
    while not router.urls:
        if (left := deadline - shared.now()) <= 0:
            error = f"no URL listed for {shared.options.url_wait_s} s"
            return _Streamed("", (), Status.CONNECTION_ERROR, None, error)
        await shared.sleep(min(shared.refresh_s, left))
    return None


async def _attempt(
    shared: _Run, router: Router, url: str, request: workload.Request, max_tokens: int
) -> _Streamed | _Draining | _Gone:
    vocab = shared.options.vocab
    prompt = [vocab[0] + t % vocab[1] for t in request.prompt] if vocab else list(request.prompt)
    body = {
        "model": shared.options.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        **dict(shared.options.extra),
    }
    timeout = aiohttp.ClientTimeout(total=None, sock_read=shared.options.read_timeout_s)
    router.started(url)
    try:
        post = shared.session.post(f"{url}/v1/completions", json=body, timeout=timeout)
        async with post as response:
            if response.status == 503:
                return _Draining(url, _retry_after(response.headers.get("Retry-After")))
            if response.status != 200:
                text = (await response.text())[:200]
                return _Streamed(url, (), Status.HTTP_ERROR, response.status, text)
            return await _read_stream(shared, url, response)
    except aiohttp.ClientConnectorError as error:  # no connection: the request was not sent
        if url not in router.urls:
            return _Gone(url, repr(error))
        return _Streamed(url, (), Status.CONNECTION_ERROR, None, repr(error))
    except (aiohttp.ClientError, TimeoutError) as error:
        return _Streamed(url, (), Status.CONNECTION_ERROR, None, repr(error))
    finally:
        router.ended(url)


async def _read_stream(shared: _Run, url: str, response: aiohttp.ClientResponse) -> _Streamed:
    """Token times from the ``data:`` lines until ``[DONE]``; a stream that ends before it, or
    breaks, is a connection error that keeps the tokens seen."""
    times: list[float] = []
    try:
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, other SSE fields
            if line[5:].strip() == b"[DONE]":
                return _Streamed(url, tuple(times), Status.OK, 200)
            if _closing(line):
                continue
            times.append(shared.now())
    except (aiohttp.ClientError, TimeoutError) as error:
        return _Streamed(url, tuple(times), Status.CONNECTION_ERROR, 200, repr(error))
    return _Streamed(url, tuple(times), Status.CONNECTION_ERROR, 200, "stream ended before [DONE]")


def _closing(line: bytes) -> bool:
    """A chunk of no text that only gives the finish reason (llama.cpp's last one): no token."""
    empty = b'"text":""' in line or b'"text": ""' in line
    return empty and b'"finish_reason":null' not in line and b'"finish_reason": null' not in line


def _retry_after(header: str | None) -> float:
    """Retry-After in seconds; an HTTP-date or nonsense counts as the default."""
    try:
        return max(0.0, float(header)) if header is not None else DEFAULT_RETRY_AFTER_S
    except ValueError:
        return DEFAULT_RETRY_AFTER_S


# --- command line ----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    pattern = _pattern(args)
    lengths = workload.LengthModel(
        prompt=dataclasses.replace(workload.CONVERSATION_PROMPT, median=args.prompt_median),
        output=dataclasses.replace(workload.CONVERSATION_OUTPUT, median=args.output_median),
        shared_prefix_share=args.shared_prefix_share,
        prefix_count=args.prefix_count,
        prefix_tokens=args.prefix_tokens,
    )
    requests = workload.requests(pattern, lengths, args.seconds, args.seed, args.start_hour * 3600)
    urls = tuple(dict.fromkeys(url.rstrip("/") for url in args.url))
    decode_urls = tuple(dict.fromkeys(url.rstrip("/") for url in args.decode_url))
    options = Options(
        urls,
        decode_urls,
        model=args.model,
        time_scale=args.time_scale,
        policy=Policy(args.policy),
    )
    records = asyncio.run(run(requests, options))
    summary = summarize(records, args.ttft, args.tpot)
    for name, value in dataclasses.asdict(summary).items():
        print(f"{name:>18}: {value}")
    if args.json:
        print(json.dumps(dataclasses.asdict(summary)))
    return 0


def _pattern(args: argparse.Namespace) -> workload.Pattern:
    if args.pattern == "steps":
        return workload.step_pattern(args.levels, args.step_seconds)
    if args.pattern == "constant":
        return workload.step_pattern([args.rate], max(args.seconds, 1.0))
    bursts = None if args.no_bursts else workload.Bursts()
    return workload.DailyPattern(args.rate, bursts=bursts)


def _levels(text: str) -> list[float]:
    return [float(level) for level in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m matrixpool.serving.loadgen",
        description="Send a generated serving load to completions servers, open-loop.",
    )
    parser.add_argument("--url", action="append", required=True, help="base URL; repeatable")
    parser.add_argument(
        "--decode-url",
        action="append",
        default=[],
        help="a decode server's base URL; repeatable; given: --url are the prefill servers",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="workload seconds to send")
    parser.add_argument("--pattern", choices=["day", "constant", "steps"], default="day")
    parser.add_argument("--rate", type=float, default=1.0, help="day: peak rps; constant: rps")
    parser.add_argument("--levels", type=_levels, default=[1.0], help="steps: rps, e.g. 1,2,4")
    parser.add_argument("--step-seconds", type=float, default=60.0, help="steps: each level's")
    parser.add_argument("--no-bursts", action="store_true", help="day: the curve alone")
    parser.add_argument("--start-hour", type=float, default=0.0, help="time of day to start at")
    parser.add_argument("--time-scale", type=float, default=1.0, help="workload s per real s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-median", type=float, default=1020.0, help="tokens")
    parser.add_argument("--output-median", type=float, default=129.0, help="tokens")
    parser.add_argument("--shared-prefix-share", type=float, default=0.0)
    parser.add_argument("--prefix-count", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--model", default="matrixpool-sim")
    parser.add_argument("--policy", choices=[p.value for p in Policy], default="round-robin")
    parser.add_argument("--ttft", type=float, help="TTFT target, seconds (for attainment)")
    parser.add_argument("--tpot", type=float, help="TPOT target, seconds (for attainment)")
    parser.add_argument("--json", action="store_true", help="last line: the summary as JSON")
    return parser


if __name__ == "__main__":
    sys.exit(main())
