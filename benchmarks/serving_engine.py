"""The serving engine's speed in simulated output tokens per wall second, with Token events
(the server's mode) and without (``Engine(tokens=False)``, for long simulations).

    .venv/bin/python benchmarks/serving_engine.py --json

Prints one JSON object. ``--requests`` requests (seeded) arrive as a Poisson stream at
``--rate`` per second on a one-card engine of the published latency model; prompt and output
lengths are lognormal, like conversations (medians ``--prompt-median`` and ``--output-median``,
log-sd ``--sigma``, clipped to 1..16,384 tokens). The engine is advanced to each arrival, then
to the end. Each mode runs the same stream; ``*_seconds`` is the median of ``--rounds`` rounds
(the machine may be shared) and covers submitting, advancing and reading the events.
``identical`` says whether both modes produced the same Finished events; ``busy_share`` is the
engine's busy time over the simulated time and ``decode_batch_mean`` the decode tokens over the
decode steps (which set how much fast mode saves: it does per step what token mode does per
token).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from matrixpool.serving import engine

MAX_TOKENS = 16_384  # longest prompt or output the stream draws


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds since the stream began
    request: engine.Request


@dataclass(frozen=True)
class Run:
    seconds: float  # wall time of the run
    busy_seconds: float  # the engine's busy time at the end
    finished: list[engine.Finished]  # in the order the engine gave them
    tokens: int  # Token events seen (0 without tokens)


def stream(args: argparse.Namespace) -> list[Arrival]:
    rng = random.Random(args.seed)
    at, arrivals = 0.0, []
    for index in range(args.requests):
        at += rng.expovariate(args.rate)
        prompt = _lognormal(rng, args.prompt_median, args.sigma)
        output = _lognormal(rng, args.output_median, args.sigma)
        arrivals.append(Arrival(at, engine.Request(f"r{index}", prompt, output)))
    return arrivals


def _lognormal(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, min(MAX_TOKENS, round(rng.lognormvariate(math.log(median), sigma))))


def run(arrivals: Sequence[Arrival], tokens: bool) -> Run:
    """The stream through a fresh one-card engine; Token events are counted, not kept."""
    instance = engine.Engine(cards=1, tokens=tokens)
    finished: list[engine.Finished] = []
    seen = 0
    start = time.perf_counter()
    for arrival in arrivals:
        seen += _collect(instance.advance(arrival.at), finished)
        instance.submit(arrival.request, arrival.at)
    seen += _collect(instance.advance(math.inf), finished)
    seconds = time.perf_counter() - start
    return Run(seconds, instance.gauges().busy_seconds, finished, seen)


def _collect(events: Sequence[engine.Event], finished: list[engine.Finished]) -> int:
    """Keep the Finished events; the number of Token events."""
    done = [e for e in events if isinstance(e, engine.Finished)]
    finished.extend(done)
    return len(events) - len(done)


def figures(args: argparse.Namespace) -> dict[str, object]:
    arrivals = stream(args)
    slow = [run(arrivals, tokens=True) for _ in range(args.rounds)]
    fast = [run(arrivals, tokens=False) for _ in range(args.rounds)]
    output = sum(len(f.timing.token_s) for f in slow[0].finished)
    slow_s = statistics.median(r.seconds for r in slow)
    fast_s = statistics.median(r.seconds for r in fast)
    timings = [f.timing for f in slow[0].finished]
    simulated = max(t.finished_s for t in timings)
    return {
        "requests": len(arrivals),
        "finished": len(slow[0].finished),
        "output_tokens": output,
        "token_events": slow[0].tokens,
        "simulated_seconds": round(simulated, 1),
        "busy_share": round(slow[0].busy_seconds / simulated, 3),
        "decode_batch_mean": round(_decode_batch_mean(timings), 1),
        "ttft_p50_s": round(statistics.median(t.ttft_s for t in timings), 4),
        "tokens_mode_seconds": round(slow_s, 3),
        "fast_mode_seconds": round(fast_s, 3),
        "tokens_mode_tokens_per_s": round(output / slow_s),
        "fast_mode_tokens_per_s": round(output / fast_s),
        "speedup": round(slow_s / fast_s, 1),
        "identical": all(r.finished == slow[0].finished for r in fast),
    }


def _decode_batch_mean(timings: Sequence[engine.Timing]) -> float:
    """Decode tokens over decode steps (each step's end is a distinct token time)."""
    firsts = {t.first_token_s for t in timings}
    steps = {s for t in timings for s in t.token_s[1:]} - firsts
    return sum(len(t.token_s) - 1 for t in timings) / max(1, len(steps))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals per second")
    parser.add_argument("--prompt-median", type=float, default=1_000.0)
    parser.add_argument("--output-median", type=float, default=130.0)
    parser.add_argument("--sigma", type=float, default=0.8, help="log-sd of both lengths")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object (the default)")
    args = parser.parse_args(argv)
    json.dump(figures(args), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
