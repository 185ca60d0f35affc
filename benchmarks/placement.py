"""The placement engine against a first-fit baseline, in one process.

    .venv/bin/python benchmarks/placement.py --json

Prints one JSON object; docs/benchmarks.md records the figures with this command.

- EP320: one gang of 40 pods × 8 cards (an expert-parallel decode replica, ``spread_group``
  set, ``Required`` on a named supernode) placed on a 384-card supernode (48 nodes × 8 cards in
  two card groups of 4, racks of 4 nodes, 1 spare node), empty and fragmented (small pods on 7
  nodes, so exactly 40 empty nodes remain). ``place`` is timed ``--repeat`` times on each;
  ``ep320_p50_ms``/``ep320_p99_ms`` are the worse of the two.
- Stream: ``--jobs`` jobs (seeded) arrive one after another onto 432 supernodes of the same
  kind (165,888 cards); each is placed and committed when it fits. Half are inference replicas
  (1-4 pods of 1, 2, 4 or 8 cards, spread over racks, one of 40 roles), half training gangs of
  1-4,096 cards (8 cards per pod from 8 cards up; half up to 64 cards, half from 64 to 4,096,
  log-uniform; ``Preferred`` above one supernode, ``groupSize`` 4 for half of those of 64 cards
  or more). A placed job departs (its cards are released) after an exponentially distributed
  number of later arrivals, mean ``--life`` (0: nobody departs), so the pool churns and fills
  up to about 95%. The same stream, with the same departures, goes through
  :class:`matrixpool.placement.firstfit.FirstFit`. ``fragmentation`` is stranded free cards
  (free cards on partially used nodes) over free cards, at the end of the stream;
  ``utilization`` is held cards over usable cards outside spares; ``*_mean`` figures average
  samples taken every 50 jobs. ``stream_seconds`` covers placing, committing and releasing,
  and is the median of ``--rounds`` rounds (the machine may be shared).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from matrixpool.placement import engine, firstfit, model
from matrixpool.placement.inventory import NodeName
from matrixpool.placement.snapshot import Stats

CARD = "huawei.com/Ascend910"
RACKS, PER_RACK, CARDS, SPARES = 12, 4, 8, 1
GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
SUPERNODES = 432


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--jobs", type=int, default=1000, help="jobs in the stream")
    parser.add_argument("--seed", type=int, default=7, help="seed of the job mix")
    parser.add_argument("--life", type=float, default=1000, help="mean arrivals a job stays")
    parser.add_argument("--repeat", type=int, default=200, help="EP320 placements timed")
    parser.add_argument("--rounds", type=int, default=3, help="stream rounds (median time)")
    args = parser.parse_args()
    figures = {**ep320(args.repeat), **streams(args.jobs, args.seed, args.life, args.rounds)}
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)  # a shared machine skews times
    print(json.dumps(figures, indent=None if args.json else 2))
    return 0


# ---- topology and jobs --------------------------------------------------------------------


def supernode(
    name: str,
    *,
    groups: tuple[tuple[int, ...], ...] = GROUPS,
    spares: int = SPARES,
) -> model.SuperNodeTopology:
    """12 racks of 4 nodes of 8 cards; card groups and spare nodes as asked (the peers'
    cluster of ``benchmarks/peers.py`` has neither)."""
    slots = tuple(
        model.NodeSlot(
            name=NodeName(f"{name}-node-{k:02d}"),
            supernode=name,
            domains=(f"rack-{k // PER_RACK:02d}",),
            cards=CARDS,
            card_groups=tuple(tuple(model.CardId(c) for c in g) for g in groups),
        )
        for k in range(RACKS * PER_RACK)
    )
    return model.SuperNodeTopology(name, CARD, slots, spares)


def request(key: str, pods: int, cards: int, priority: int, **options: Any) -> model.GangRequest:
    return model.GangRequest(
        gang=model.GangKey(key),
        pods=tuple(model.PodRequest(model.PodKey(f"{key}-{r}"), cards) for r in range(pods)),
        priority=priority,
        **options,
    )


Job = tuple[model.GangRequest, int]  # (request, index of the arrival before which it departs)


def job_stream(count: int, seed: int, life: float) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for k in range(count):
        request = inference(rng, k) if rng.random() < 0.5 else training(rng, k)
        stay = max(1, round(rng.expovariate(1 / life if life > 0 else 1)))  # drawn either way
        jobs.append((request, k + stay if life > 0 else count))
    return jobs


def inference(rng: random.Random, k: int) -> model.GangRequest:
    cards = rng.choice((1, 2, 4, 8))
    pods = rng.choice((1, 1, 1, 2, 4)) if cards == 8 else 1
    role = f"ns/svc-{rng.randrange(40)}/decode"
    return request(f"{role}/{k}", pods, cards, 1000, spread_group=role)


def training(rng: random.Random, k: int) -> model.GangRequest:
    low, high = (64, 4096) if rng.random() < 0.5 else (1, 64)
    total = round(math.exp(rng.uniform(math.log(low), math.log(high))))
    cards = 8 if total >= 8 else max(c for c in (1, 2, 4) if c <= total)
    pods = math.ceil(total / cards)
    big = pods * cards > (RACKS * PER_RACK - SPARES) * CARDS
    options: dict[str, Any] = {"min_pods": max(1, pods // 2)}
    if big:
        options["affinity"] = model.Affinity.PREFERRED
    if pods * cards >= 64 and rng.random() < 0.5:
        options["group_size"] = 4
    return request(f"ns/train-{k}", pods, cards, 100, **options)


# ---- EP320 --------------------------------------------------------------------------------


def ep320(repeat: int) -> dict[str, float]:
    topology = supernode("sn-a")
    gang = request("ns/ds/decode/0", 40, 8, 1000, supernode="sn-a", spread_group="ns/ds/decode")
    empty = engine.Snapshot.build([topology], [])
    fragmented = engine.Snapshot.build([topology], fragmenting_holdings())
    figures: dict[str, float] = {}
    for label, snapshot in (("empty", empty), ("fragmented", fragmented)):
        samples = timed(functools.partial(engine.place, snapshot, gang), repeat)
        figures[f"ep320_{label}_p50_ms"] = percentile(samples, 50)
        figures[f"ep320_{label}_p99_ms"] = percentile(samples, 99)
    figures["ep320_p50_ms"] = max(figures["ep320_empty_p50_ms"], figures["ep320_fragmented_p50_ms"])
    figures["ep320_p99_ms"] = max(figures["ep320_empty_p99_ms"], figures["ep320_fragmented_p99_ms"])
    return {k: round(v, 3) for k, v in figures.items()}


def fragmenting_holdings() -> list[model.Holding]:
    """Small pods on 7 nodes of 7 racks: 40 empty nodes remain besides the spare."""
    return [
        model.Holding(
            pod=model.PodKey(f"ns/small-{k}-0"),
            gang=model.GangKey(f"ns/small-{k}"),
            node=NodeName(f"sn-a-node-{5 * k:02d}"),
            cards=frozenset(model.CardId(c) for c in range(1 + k % 4)),
            priority=100,
        )
        for k in range(7)
    ]


def timed(action: Callable[[], object], repeat: int) -> list[float]:
    action()  # warm the memos
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        verdict = action()
        samples.append((time.perf_counter() - start) * 1000)
        assert isinstance(verdict, model.Placement), verdict
    return samples


def percentile(samples: Sequence[float], p: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[p - 1]


# ---- streams ------------------------------------------------------------------------------


def streams(jobs: int, seed: int, life: float, rounds: int) -> dict[str, float | int]:
    """Both engines over the same stream, ``rounds`` times; times are the median round."""
    topologies = [supernode(f"sn-{k:03d}") for k in range(SUPERNODES)]
    stream = job_stream(jobs, seed, life)
    builds, mine, theirs = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        ours = engine.Snapshot.build(topologies, [])
        builds.append(time.perf_counter() - start)
        baseline = firstfit.FirstFit(engine.Snapshot.build(topologies, []))
        mine.append(run(stream, functools.partial(engine.place, ours), ours))
        theirs.append(run(stream, baseline.place, baseline))
    figures: dict[str, float | int] = {
        "stream_jobs": jobs,
        "stream_cards_demanded": sum(p.cards for g, _ in stream for p in g.pods),
        "stream_build_seconds": round(statistics.median(builds), 3),
    }
    for prefix, results in (("", mine), ("firstfit_", theirs)):
        figures |= median_round(results).figures(prefix)
    return figures | ratios(figures)


def median_round(results: list[Result]) -> Result:
    """The round of median time (the placements themselves are the same every round)."""
    assert len({(r.placed, r.final) for r in results}) == 1
    return sorted(results, key=lambda r: r.seconds)[len(results) // 2]


@dataclass
class Result:
    """What one engine did with the stream."""

    seconds: float = 0.0
    placed: int = 0
    final: Stats | None = None
    samples: list[Stats] = field(default_factory=list)

    def figures(self, prefix: str) -> dict[str, float | int]:
        assert self.final is not None
        samples = self.samples or [self.final]
        return {
            f"{prefix}stream_seconds": round(self.seconds, 3),
            f"{prefix}placed": self.placed,
            f"{prefix}fragmentation": round(self.final.fragmentation, 4),
            f"{prefix}utilization": round(self.final.utilization, 4),
            f"{prefix}partial_nodes": self.final.partial_nodes,
            f"{prefix}fragmentation_mean": round(
                statistics.fmean(s.fragmentation for s in samples), 4
            ),
            f"{prefix}utilization_mean": round(statistics.fmean(s.utilization for s in samples), 4),
        }


def ratios(figures: dict[str, float | int]) -> dict[str, float | int]:
    """Engine over first fit, for time, fragmentation and utilization."""
    result: dict[str, float | int] = {}
    for name in ("stream_seconds", "fragmentation", "utilization", "fragmentation_mean"):
        theirs = figures[f"firstfit_{name}"]
        result[f"{name}_ratio"] = round(figures[name] / theirs, 3) if theirs else 0.0
    return result


def run(
    stream: Sequence[Job],
    place: Callable[[model.GangRequest], model.Placement | model.Unplaceable],
    target: engine.Snapshot | firstfit.FirstFit,
) -> Result:
    """Place the stream; statistics sampled every 50 jobs are not timed."""
    snapshot = target if isinstance(target, engine.Snapshot) else target.snapshot
    result = Result()
    departures: dict[int, list[model.GangKey]] = {}
    for k, (gang, departs) in enumerate(stream):
        start = time.perf_counter()
        for key in departures.pop(k, ()):
            target.release(key)
        verdict = place(gang)
        if isinstance(verdict, model.Placement):
            target.commit(verdict)
            result.placed += 1
            departures.setdefault(departs, []).append(gang.gang)
        result.seconds += time.perf_counter() - start
        if k % 50 == 49:
            result.samples.append(snapshot.stats())
    result.final = snapshot.stats()
    return result


if __name__ == "__main__":
    sys.exit(main())
