"""One inference instance as a deterministic continuous-batching simulator, driven by explicit
time: nothing here sleeps or reads a clock.

Called by :mod:`matrixpool.serving.server` (real time: it advances the engine to the loop's
clock and streams the tokens as their times pass) and by benchmarks (simulated time). The
caller submits requests with their arrival time and advances the engine; the engine returns
the :class:`Token` and :class:`Finished` events that happened up to then, in time order.

The engine runs one iteration at a time (as vLLM's scheduler does); each iteration is planned
when the previous one ends, from the requests that had arrived by then:

1. Admit: waiting requests, first come first served, join while the batch has a slot and the
   KV cache can hold the request whole (prompt and output: no preemption later); the first
   that does not fit stops admission (no overtaking). A prefill admits at most
   ``max_prefill_tokens`` tokens to compute, and always at least one request.
2. Prefill the admitted ones, if any: their uncached prompt tokens at the prefill rate, plus
   the transfer of the prefix blocks the prefix cache holds. Its end emits each request's first
   token. Role ``decode`` computes no prefill: it receives the prompt's KV from a prefill
   instance (a remote transfer) and the first token with it.
3. Otherwise decode: one step emits a token for every running sequence; a sequence with all
   its tokens leaves and frees its KV cache.

Role ``prefill`` stops after step 2: the KV is handed off and the request is finished with its
first token. After :meth:`Engine.drain` no request is accepted; the accepted ones all finish.

Two ways to hold the decode batch, chosen by ``Engine(tokens=...)``; both give the same
:class:`Finished` events (timings included), gauges and times:

- ``tokens=True`` (the server's): a decode step appends its time to every running sequence and
  emits a :class:`Token` for each, O(batch) a step.
- ``tokens=False`` (long simulations): no :class:`Token` events. The batch keeps one list of
  decode-step end times, each sequence the index of the step of its second token, a heap of
  sequences by the index of their last step and the batch's context as a running sum, so a
  step costs O(1) plus O(log n) per sequence that finishes at it; the steps up to the next
  admission run in one tight loop, without an iteration object each. A finished sequence's
  ``token_s`` is its first token and a slice of that list, so :class:`Timing` is the same as
  with tokens. Memory stays bounded: the prefix of the list that no running sequence needs is
  dropped (amortized O(1) a step), so the list holds at most twice the steps since the oldest
  running sequence's second token, or ``TRIM_STEPS``. (A caller that keeps every
  :class:`Finished` keeps every token time; a day-long benchmark summarizes and drops them.)
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from matrixpool.serving import latency

BLOCK_TOKENS = 16  # tokens per prefix-cache block (vLLM's default block size)
TRIM_STEPS = 4_096  # fewest unneeded step times the step batch drops at once


class Role(enum.StrEnum):
    PREFILL = "prefill"  # prefill only; the KV goes to a decode instance
    DECODE = "decode"  # decode only; the KV comes from a prefill instance
    BOTH = "both"  # prefill and decode in one instance


class Refused(enum.StrEnum):
    """Why :meth:`Engine.submit` did not take a request."""

    DRAINING = "Draining"  # the instance takes no new requests
    TOO_LARGE = "TooLarge"  # the request alone needs more KV cache than the instance holds


@dataclass(frozen=True)
class Request:
    id: str  # unique among the engine's requests
    prompt_tokens: int  # tokens of the prompt, >= 1
    output_tokens: int  # tokens to generate, >= 1
    prefix_hashes: tuple[
        str, ...
    ] = ()  # hashes of the prompt's whole-block prefixes, shortest first

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"request {self.id}: need at least one prompt and one output token")


@dataclass(frozen=True)
class Hit:
    """What the prefix cache holds for a prefix hash."""

    tokens: int  # tokens of the prompt whose KV the cache holds
    remote: bool  # held by another node of the supernode (else the instance's own node)


PrefixCache = Callable[[str], Hit | None]  # prefix hash -> what the cache holds of it


@dataclass(frozen=True)
class Timing:
    """What one finished request saw."""

    submitted_s: float  # arrival at the engine
    admitted_s: float  # start of its prefill (or KV load)
    token_s: tuple[float, ...]  # time of every output token, the first included
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose prefill the prefix cache saved

    @property
    def first_token_s(self) -> float:
        return self.token_s[0]

    @property
    def finished_s(self) -> float:
        return self.token_s[-1]

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.submitted_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for a single token."""
        if len(self.token_s) < 2:
            return None
        return (self.token_s[-1] - self.token_s[0]) / (len(self.token_s) - 1)

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.submitted_s


@dataclass(frozen=True)
class Token:
    time: float  # when the token is out
    request_id: str
    index: int  # 0 for the first token


@dataclass(frozen=True)
class Finished:
    time: float  # the last token's time
    request_id: str
    timing: Timing


Event = Token | Finished


@dataclass(frozen=True)
class Gauges:
    running: int  # requests admitted and not finished (prefilling or decoding)
    waiting: int  # requests accepted and not admitted yet
    kv_usage: float  # reserved share of the KV cache, 0..1
    busy_seconds: float  # time spent in iterations since the engine began, up to its clock


@dataclass(eq=False)
class _Sequence:
    """An accepted request, with the tokens it has produced so far."""

    request: Request
    submitted_s: float
    admitted_s: float = 0.0  # start of its prefill
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    fetch_s: float = 0.0  # time to bring their KV blocks in
    # time of each output token so far (step batch: the first only, until it finishes)
    token_s: list[float] = field(default_factory=list)
    second_step: int = 0  # step batch: index of the decode step of its second token

    @property
    def context_tokens(self) -> int:
        return self.request.prompt_tokens + len(self.token_s)

    @property
    def done(self) -> bool:
        return len(self.token_s) >= self.request.output_tokens


@dataclass(frozen=True)
class _Iteration:
    start: float
    end: float
    prefill: tuple[_Sequence, ...]  # the sequences prefilled (or loaded); empty for a decode


class _Batch(Protocol):
    """The running (decoding) sequences, in admission order."""

    def __len__(self) -> int: ...

    @property
    def context_tokens(self) -> int:
        """KV tokens the batch attends over: prompts and tokens out so far, summed."""
        ...

    def join(self, sequences: Sequence[_Sequence]) -> None:
        """Sequences whose first token is out start decoding."""

    def step(self, end: float) -> tuple[list[Event], list[_Sequence]]:
        """A decode step ending at ``end``: its token events and the sequences it finished (in
        admission order, with their whole ``token_s``), which leave the batch."""
        ...


class _TokenBatch:
    """The batch as a list; each step appends to every sequence and emits its token."""

    def __init__(self) -> None:
        self._running: list[_Sequence] = []  # decoding, in admission order

    def __len__(self) -> int:
        return len(self._running)

    @property
    def context_tokens(self) -> int:
        return sum(s.context_tokens for s in self._running)

    def join(self, sequences: Sequence[_Sequence]) -> None:
        self._running.extend(sequences)

    def step(self, end: float) -> tuple[list[Event], list[_Sequence]]:
        tokens: list[Event] = []
        for sequence in self._running:
            sequence.token_s.append(end)
            tokens.append(Token(end, sequence.request.id, len(sequence.token_s) - 1))
        finished = [s for s in self._running if s.done]
        if finished:
            self._running = [s for s in self._running if not s.done]
        return tokens, finished


class _StepBatch:
    """The batch as step times and a heap of last steps; a step is O(1) plus O(log n) per
    sequence it finishes (see the module's docstring)."""

    def __init__(self) -> None:
        self._steps: list[float] = []  # end time of each decode step from ``_base`` on
        self._base = 0  # index of ``_steps[0]`` among all decode steps
        self.size = 0  # sequences decoding
        self.context_tokens = 0  # their prompts and tokens out so far, summed
        self._last: list[tuple[int, int, _Sequence]] = []  # heap: (last step, join order, seq)
        self._order = itertools.count()  # join order: admission order among equal last steps
        self._joined: deque[_Sequence] = deque()  # joined and maybe finished, in join order

    def __len__(self) -> int:
        return self.size

    def join(self, sequences: Sequence[_Sequence]) -> None:
        second = self._base + len(self._steps)
        for sequence in sequences:
            sequence.second_step = second
            last = second + sequence.request.output_tokens - 2
            heapq.heappush(self._last, (last, next(self._order), sequence))
            self._joined.append(sequence)
            self.context_tokens += sequence.request.prompt_tokens + len(sequence.token_s)
        self.size += len(sequences)

    def quiet_steps(self) -> int:
        """How many steps from the next one on finish nobody."""
        return self._last[0][0] - self._base - len(self._steps)

    def step_quietly(self, end: float) -> None:
        """A decode step that finishes nobody (see :meth:`quiet_steps`)."""
        self._steps.append(end)
        self.context_tokens += self.size

    def step(self, end: float) -> tuple[list[Event], list[_Sequence]]:
        self.step_quietly(end)
        index = self._base + len(self._steps) - 1
        finished: list[_Sequence] = []
        while self._last and self._last[0][0] == index:
            finished.append(self._leave(heapq.heappop(self._last)[2]))
        if finished:
            self._trim()
        return [], finished

    def _leave(self, sequence: _Sequence) -> _Sequence:
        """``sequence`` has its last token: give it all its token times, take it out."""
        start = sequence.second_step - self._base
        sequence.token_s.extend(self._steps[start : start + sequence.request.output_tokens - 1])
        self.size -= 1
        self.context_tokens -= sequence.request.prompt_tokens + sequence.request.output_tokens
        return sequence

    def _trim(self) -> None:
        """Drop the step times no running sequence needs, when they are many and at least half
        the list (so each time is moved O(1) times)."""
        while self._joined and self._joined[0].done:
            self._joined.popleft()
        oldest = self._joined[0].second_step if self._joined else self._base + len(self._steps)
        unneeded = oldest - self._base
        if unneeded >= TRIM_STEPS and 2 * unneeded >= len(self._steps):
            del self._steps[:unneeded]
            self._base = oldest


class Engine:
    """One instance: submit requests, advance time, read the events and gauges."""

    def __init__(
        self,
        *,
        model: latency.LatencyModel = latency.DEFAULT,
        cards: int = 1,
        role: Role = Role.BOTH,
        max_batch: int | None = None,
        kv_capacity_tokens: int | None = None,
        max_prefill_tokens: int = 16_384,
        prefix_cache: PrefixCache | None = None,
        tokens: bool = True,
    ) -> None:
        """``tokens``: emit a :class:`Token` per output token (else only :class:`Finished`
        events, and a decode step costs O(1) instead of O(batch))."""
        self.model = model
        self.cards = cards
        self.role = role
        self.max_batch = model.operating_batch(cards) if max_batch is None else max_batch
        self.kv_capacity_tokens = (
            model.kv_capacity_tokens(cards) if kv_capacity_tokens is None else kv_capacity_tokens
        )
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = prefix_cache
        self.tokens = tokens
        if self.max_batch < 1 or self.kv_capacity_tokens < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch, kv_capacity_tokens and max_prefill_tokens must be >= 1")
        self._clock = float("-inf")  # the time the engine has been advanced to
        self._free_at = float("-inf")  # end of the last finished iteration
        self._waiting: deque[_Sequence] = deque()
        self._fast = None if tokens else _StepBatch()  # the batch, in fast mode
        self._batch: _Batch = _TokenBatch() if self._fast is None else self._fast  # decoding
        self._running: list[_Sequence] = []  # decoding, in admission order
        self._current: _Iteration | None = None
        self._kv_reserved = 0
        self._busy_done = 0.0
        self._ids: set[str] = set()
        self._draining = False

    # --- the caller's side --------------------------------------------------------------------
    def submit(self, request: Request, now: float) -> Refused | None:
        """Accept ``request`` arriving at ``now`` (not before the engine's clock); None when
        accepted, else why not (nothing is queued then)."""
        if now < self._clock:
            raise ValueError(f"request {request.id} at {now} is before the engine's {self._clock}")
        if request.id in self._ids:
            raise ValueError(f"request {request.id} was submitted already")
        if self._draining:
            return Refused.DRAINING
        if self._kv_need(request) > self.kv_capacity_tokens:
            return Refused.TOO_LARGE
        self._ids.add(request.id)
        self._waiting.append(_Sequence(request, submitted_s=now))
        return None

    def advance(self, until: float) -> list[Event]:
        """Run the engine to ``until``; the events up to then, in time order."""
        events: list[Event] = []
        while True:
            if self._current is not None:
                if self._current.end > until:
                    break
                events.extend(self._complete(self._current))
            start = self._next_start()
            if start is None or start > until:
                break
            self._current = self._plan(start)
            if self._fast is not None and not self._current.prefill:
                self._current = self._decode_run(self._fast, self._current, until, events)
        self._clock = max(self._clock, until)
        return events

    step = advance  # the real-time loop's name for it: step(now)

    def drain(self) -> None:
        """Take no new requests from now on; the accepted ones still finish."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def idle(self) -> bool:
        """Nothing waiting, running or in flight."""
        return not self._waiting and not self._batch and self._current is None

    def next_event_time(self) -> float | None:
        """When the engine next has something to do (an iteration ends or can start); None
        when it has nothing."""
        if self._current is not None:
            return self._current.end
        return self._next_start()

    def gauges(self) -> Gauges:
        in_prefill = len(self._current.prefill) if self._current is not None else 0
        return Gauges(
            running=len(self._batch) + in_prefill,
            waiting=len(self._waiting),
            kv_usage=self._kv_reserved / self.kv_capacity_tokens,
            busy_seconds=self._busy_done + self._busy_partial(),
        )

    # --- planning -----------------------------------------------------------------------------
    def _next_start(self) -> float | None:
        if self._batch:
            return self._free_at
        if self._waiting:
            return max(self._free_at, self._waiting[0].submitted_s)
        return None

    def _plan(self, start: float) -> _Iteration:
        admitted = self._admit(start)
        if admitted:
            for sequence in admitted:
                sequence.admitted_s = start
            return _Iteration(start, start + self._prefill_seconds(admitted), tuple(admitted))
        context = self._batch.context_tokens
        step = self.model.decode_step_seconds(len(self._batch), context, self.cards)
        return _Iteration(start, start + step, ())

    def _admit(self, start: float) -> list[_Sequence]:
        """Phase 1: the waiting requests that arrived by ``start`` and fit, in order."""
        admitted: list[_Sequence] = []
        computed = 0
        while self._waiting and self._waiting[0].submitted_s <= start:
            sequence = self._waiting[0]
            if not self._fits(sequence, len(admitted)):
                break
            self._look_up(sequence)
            uncached = sequence.request.prompt_tokens - sequence.cached_tokens
            if admitted and computed + uncached > self.max_prefill_tokens:
                break
            computed += uncached
            self._kv_reserved += self._kv_need(sequence.request)
            admitted.append(self._waiting.popleft())
        return admitted

    def _fits(self, sequence: _Sequence, admitted: int) -> bool:
        """Whether ``sequence`` has a batch slot and its KV cache, after ``admitted`` others."""
        slots = self.max_batch - len(self._batch) - admitted
        need = self._kv_need(sequence.request)
        return slots >= 1 and self._kv_reserved + need <= self.kv_capacity_tokens

    def _look_up(self, sequence: _Sequence) -> None:
        """The prompt tokens the prefix cache holds (longest prefix first) and the time to fetch
        them; the last prompt token is always computed (it yields the first output token)."""
        sequence.cached_tokens, sequence.fetch_s = 0, 0.0
        if self.prefix_cache is None or self.role is Role.DECODE:
            return
        request = sequence.request
        for prefix_hash in reversed(request.prefix_hashes):
            hit = self.prefix_cache(prefix_hash)
            if hit is not None:
                sequence.cached_tokens = max(0, min(hit.tokens, request.prompt_tokens - 1))
                nbytes = self.model.kv_bytes(sequence.cached_tokens)
                sequence.fetch_s = self.model.transfer_seconds(nbytes, hit.remote)
                return

    def _prefill_seconds(self, admitted: Sequence[_Sequence]) -> float:
        """Phase 2: compute the uncached tokens and fetch the cached ones (role decode: fetch
        the whole prompt's KV from the prefill instance)."""
        model = self.model
        if self.role is Role.DECODE:
            prompts = sum(s.request.prompt_tokens for s in admitted)
            return model.transfer_seconds(model.kv_bytes(prompts), remote=True)
        computed = sum(s.request.prompt_tokens - s.cached_tokens for s in admitted)
        fetched = sum(s.fetch_s for s in admitted)
        return model.prefill_seconds(computed, self.cards) + fetched

    def _kv_need(self, request: Request) -> int:
        """KV tokens reserved at admission: the prompt, and the output where it decodes here."""
        if self.role is Role.PREFILL:
            return request.prompt_tokens
        return request.prompt_tokens + request.output_tokens

    def _decode_run(
        self, batch: _StepBatch, first: _Iteration, until: float, events: list[Event]
    ) -> _Iteration | None:
        """Fast mode: complete the decode steps from ``first`` on that end by ``until`` and are
        followed by another decode, as :meth:`advance` would but without its per-iteration work
        (finished sequences' events go to ``events``); the step to run next, or None when an
        admission or nothing follows (from ``_free_at``)."""
        start, end = first.start, first.end
        quiet, blocked = batch.quiet_steps(), self._blocked_until()
        seconds, cards = self.model.decode_step_seconds, self.cards
        while end <= until:
            self._busy_done += end - start
            self._free_at = end
            if quiet > 0:
                batch.step_quietly(end)
                quiet -= 1
            else:
                events.extend(self._finish(batch.step(end)[1]))
                if not batch:
                    return None
                quiet, blocked = batch.quiet_steps(), self._blocked_until()
            if end >= blocked:
                return None
            start, end = end, end + seconds(batch.size, batch.context_tokens, cards)
        return _Iteration(start, end, ())

    def _blocked_until(self) -> float:
        """While nobody finishes: the first time a decode can give way to an admission (the
        first waiting request's arrival, or never when it does not fit)."""
        if not self._waiting or not self._fits(self._waiting[0], 0):
            return float("inf")
        return self._waiting[0].submitted_s

    # --- completion ---------------------------------------------------------------------------
    def _complete(self, iteration: _Iteration) -> list[Event]:
        """The iteration's end: its tokens out, finished sequences gone (phase 2 or 3)."""
        self._current = None
        self._free_at = iteration.end
        self._busy_done += iteration.end - iteration.start
        if iteration.prefill:
            events, finished = self._prefilled(iteration.prefill, iteration.end)
        else:
            events, finished = self._batch.step(iteration.end)
        events.extend(self._finish(finished))
        return events

    def _prefilled(
        self, prefill: Sequence[_Sequence], end: float
    ) -> tuple[list[Event], list[_Sequence]]:
        """Phase 2's end: the first tokens (and their events); the sequences that finish with
        them, and the others join the decode batch."""
        events: list[Event] = []
        for sequence in prefill:
            sequence.token_s.append(end)
            if self.tokens:
                events.append(Token(end, sequence.request.id, 0))
        if self.role is Role.PREFILL:
            return events, list(prefill)
        self._batch.join([s for s in prefill if not s.done])
        return events, [s for s in prefill if s.done]

    def _finish(self, finished: Iterable[_Sequence]) -> list[Event]:
        events: list[Event] = []
        for sequence in finished:
            self._kv_reserved -= self._kv_need(sequence.request)
            timing = Timing(
                submitted_s=sequence.submitted_s,
                admitted_s=sequence.admitted_s,
                token_s=tuple(sequence.token_s),
                prompt_tokens=sequence.request.prompt_tokens,
                cached_tokens=sequence.cached_tokens,
            )
            events.append(Finished(sequence.token_s[-1], sequence.request.id, timing))
        return events

    def _busy_partial(self) -> float:
        current = self._current
        if current is None or self._clock <= current.start:
            return 0.0
        return min(self._clock, current.end) - current.start


def block_hashes(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> tuple[str, ...]:
    """Content hashes of the whole-block prefixes of ``tokens``, shortest first: hash ``k``
    names the first ``(k + 1) * block`` tokens (each chained on the one before, as vLLM's
    prefix caching does), so equal prefixes have equal hashes."""
    hashes: list[str] = []
    digest = hashlib.sha256()
    for end in range(block, len(tokens) + 1, block):
        chunk = ",".join(str(t) for t in tokens[end - block : end])
        digest.update(chunk.encode() + b";")
        hashes.append(digest.copy().hexdigest()[:32])
    return tuple(hashes)
