"""Serving with a real engine: llama.cpp's server on this machine, the same stepped and bursty
load sized two ways — SLO attainment and card-hours of each (issue 33, item 6).

    .venv/bin/python benchmarks/serving_llamacpp.py --json
    (and, as its ``engines["llama.cpp"]``, through benchmarks/serving.py --json)

The engine: ``llama-server`` (``tools/engine/build.sh``) serving the tiny random Llama model of
``matrixpool.devcluster.engine`` (512 wide, 4 layers), one process per replica on a loopback
port, ``SLOTS`` sequences batched, one CPU thread and a CPU limit of ``CPU_CORES`` each (a CFS
quota, as a kubelet sets a pod's ``limits.cpu``: ``matrixpool.devcluster.cgroups``); one
replica stands for one card, its rate the limit's whatever else runs on the machine.
The load: ``matrixpool.serving.workload``'s step pattern, open loop through
``matrixpool.serving.loadgen`` (streamed, TTFT and TPOT per request): ``BASE`` requests/s,
then 4× for a while, back to the base, then a burst of 8× the base for one ``STEP_S``, then the
base again (``LEVELS``); the same requests (one seed) both ways:

- ``fixed``: the replicas the peak needs all along — the most the autoscaler ran (run first),
  which is what the burst needed at its 80 % target utilisation;
- ``autoscaler``: from one replica, every ``PERIOD_S`` the live replicas' ``/metrics`` are read
  as llama.cpp's (``serving.readings``), and the autoscaler's own decision code
  (``controllers.autoscaler.Shape`` of a one-role InferenceService with ``engine: LlamaCpp``
  and no ``capacity`` stated, ``serving.estimator``, its ``Stabilizer``) gives the replicas:
  the estimator is given no model of the engine, it learns the engine's rate from the engine's
  own counters. A new replica is started (it serves once ``/health`` answers); a removed one
  leaves the list the load generator reads first and gets SIGTERM ``DRAIN_S`` later (what a
  pod's preStop sleep does), so no request is cut.

Figures: ``slo_attainment`` (share of all requests meeting TTFT ``TTFT_S`` and TPOT ``TPOT_S``),
``slo_attainment_settled`` (the same, leaving out the requests due in the first ``SETTLE_S`` of
a level higher than the one before: what a reactive autoscaler cannot serve until it reads
the rise and its new replicas start),
``card_hours`` (replica-seconds / 3600, from each replica's start to its SIGTERM),
``failed``, the replicas over time, and the ratios of the autoscaler to fixed.

Left out: the API server, the scheduler and the pods (the operator runs the same decision code
on the real control plane: tests/integration/test_engine_autoscaling.py); every replica shares
this machine's cores (2 here), so a replica added beyond the cores adds slots, not compute, and
the figures hold for a load the machine can serve; the model is random and tiny, so its
per-token cost is a small real model's on a CPU, not a GPU's; the period is 5 s, not the
operator's default 15 s, so a run takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from matrixpool.api import inferenceservice
from matrixpool.controllers import autoscaler
from matrixpool.devcluster import cgroups, engine
from matrixpool.serving import estimator, loadgen, readings, workload

SLOTS = 4  # sequences a replica batches (--parallel)
CPU_CORES = 0.3  # each replica's CPU limit
TTFT_S, TPOT_S = 2.0, 0.2  # the SLO
GOAL = 0.95
BASE = 0.5  # requests per second: ~0.3 of a replica
STEP_S = 10.0  # one level of the pattern
LEVELS = (1, 1, 1, 4, 4, 4, 4, 1, 1, 1, 8, 1, 1)  # × BASE, STEP_S each: step, back, burst
MAX_REPLICAS = 3
PERIOD_S = 5.0
DRAIN_S = 5.0
SETTLE_S = 2 * PERIOD_S
STABILIZATION_S = 15
LENGTHS = workload.LengthModel(  # mostly prefill, whose rate is learned from busy time
    prompt=workload.Lognormal(300, 0.3, 100, 600), output=workload.Lognormal(12, 0.3, 4, 24)
)
MODEL_SHAPE = {"width": 512, "layers": 4, "feed_forward": 1536}


@dataclass
class Replica:
    url: str
    process: subprocess.Popen[bytes]
    started: float  # monotonic
    stopped: float | None = None  # monotonic: SIGTERM sent


@dataclass
class Fleet:
    """llama-server processes on loopback ports, one per replica."""

    binary: Path
    model: Path
    cgroups: tuple[Path | None, Path | None] = (None, None)  # (v2 parent, v1 cpu parent)
    next_port: int = 18500
    replicas: list[Replica] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds, live replicas)
    t0: float = field(default_factory=time.monotonic)

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.stopped is None]

    def urls(self) -> loadgen.UrlSets:
        return tuple(r.url for r in self.live), ()

    async def start(self, session: aiohttp.ClientSession) -> None:
        """One more replica, listed once it answers /health (at most 30 s)."""
        port, self.next_port = self.next_port, self.next_port + 1
        argv = engine.command(str(self.model), host="127.0.0.1", port=port, slots=SLOTS)
        argv[0] = str(self.binary)
        name = f"replica-{port}"
        group = cgroups.make(self.cgroups[0], name)
        cpu = cgroups.limit_cpu(group, self.cgroups[1], name, CPU_CORES)
        if cpu is None and (group is None or not (group / "cpu.max").exists()):
            raise RuntimeError("no CPU limit can be set here (no cpu cgroup controller)")
        argv = cgroups.enter(group, argv, cpu)
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(1)) as r:
                    if r.status == 200:
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
        else:
            process.kill()
            raise RuntimeError(f"llama-server on {url} did not answer /health in 30 s")
        self.replicas.append(Replica(url, process, time.monotonic()))
        self.mark()

    def drain(self, replica: Replica) -> None:
        """Unlisted now, SIGTERM after DRAIN_S (the preStop sleep)."""
        replica.stopped = time.monotonic() + DRAIN_S
        asyncio.get_running_loop().call_later(DRAIN_S, replica.process.send_signal, signal.SIGTERM)
        self.mark()

    def mark(self) -> None:
        self.timeline.append((round(time.monotonic() - self.t0, 1), len(self.live)))

    def card_hours(self, end: float) -> float:
        held = sum(min(r.stopped or end, end) - r.started for r in self.replicas)
        return held / 3600

    def stop(self) -> None:
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.kill()
            replica.process.wait()
        for parent in self.cgroups:
            cgroups.remove(parent)


def spec() -> inferenceservice.InferenceServiceSpec:
    """The InferenceService the autoscaler sizes: one role of 1..MAX_REPLICAS one-card
    instances, read as llama.cpp, no capacity stated."""
    return inferenceservice.InferenceServiceSpec.model_validate(
        {
            "superNode": "sn-0",
            "roles": [
                {
                    "name": "serve",
                    "replicas": MAX_REPLICAS,
                    "minReplicas": 1,
                    "cardsPerPod": 1,
                    "template": {"spec": {"containers": [{"name": "engine", "image": "x"}]}},
                }
            ],
            "autoscaling": {
                "mode": "Auto",
                "engine": "LlamaCpp",
                "targets": {
                    "ttftMilliseconds": int(TTFT_S * 1000),
                    "tpotMilliseconds": int(TPOT_S * 1000),
                },
                "scaleDownStabilizationSeconds": STABILIZATION_S,
            },
        }
    )


class Autoscaled:
    """The autoscaler's decision code over the fleet, every PERIOD_S."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.spec = spec()
        assert self.spec.autoscaling is not None
        self.shape = autoscaler.Shape.of(self.spec)
        self.stabilizer = estimator.Stabilizer(
            tolerance=self.spec.autoscaling.tolerance_percent / 100,
            scale_down_window_s=float(STABILIZATION_S),
        )
        self.last: dict[str, readings.Reading] = {}
        self.figures: autoscaler.Figures | None = None  # capacity learned so far
        self.reasons: list[str] = []

    async def run(self, session: aiohttp.ClientSession, until: float) -> None:
        while time.monotonic() < until:
            await asyncio.sleep(PERIOD_S)
            await self.step(session)

    async def step(self, session: aiohttp.ClientSession) -> None:
        fresh: dict[str, readings.Reading] = {}
        for replica in self.fleet.live:
            try:
                async with session.get(
                    f"{replica.url}/metrics", timeout=aiohttp.ClientTimeout(2)
                ) as answer:
                    text = await answer.text()
            except (aiohttp.ClientError, TimeoutError):
                continue
            fresh[replica.url] = readings.parse(text, time.monotonic(), readings.Engine.LLAMA_CPP)
        before, self.last = self.last, fresh
        instances = [
            readings.Instance(before.get(url), now, cards=1, decodes=True)
            for url, now in fresh.items()
        ]
        if not set(fresh) & set(before):
            return
        factors = readings.factors(instances)
        measured = readings.throughput(instances)
        self.figures = autoscaler.learn(self.shape, self.figures, factors, measured)
        used = self.shape.used(self.figures)
        current = estimator.Replicas(0, len(self.fleet.live))
        advice = estimator.estimate(
            factors, self.shape.targets, self.shape.bounds, autoscaler.sizing(used), current
        )
        self.stabilizer, decision = self.stabilizer.step(time.monotonic(), current, advice)
        said = [
            f"{c.phase} {c.tokens_per_second:,} tokens/s: {c.said}"
            for c in self.shape.phase_capacity(used)
        ]
        self.reasons = [*advice.reasons, *decision.reasons, *said]
        wanted = decision.decode
        while len(self.fleet.live) < wanted:
            await self.fleet.start(session)
        for replica in self.fleet.live[wanted:]:
            self.fleet.drain(replica)


async def run(
    binary: Path, model: Path, requests: Sequence[workload.Request], fixed: int | None
) -> dict[str, Any]:
    """One way: ``fixed`` replicas all along, or (None) the autoscaler's from one."""
    fleet = Fleet(binary, model, (cgroups.root(), cgroups.cpu_root()))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            for _ in range(fixed or 1):
                await fleet.start(session)
            options = loadgen.Options(
                urls=fleet.urls()[0],
                max_retries=8,
                vocab=(engine.FIRST_BYTE, engine.BYTES),
                extra=(("ignore_eos", True),),
            )
            span = len(LEVELS) * STEP_S
            policy = Autoscaled(fleet) if fixed is None else None
            control = (
                asyncio.create_task(policy.run(session, time.monotonic() + span))
                if policy
                else None
            )
            records = await loadgen.run(requests, options, urls=fleet.urls, refresh_s=0.2)
            end = time.monotonic()
            if control is not None:
                control.cancel()
            await asyncio.sleep(0)
        finally:
            fleet.stop()
    summary = loadgen.summarize(records)
    settled = [r for r in records if not rising(r.due_at)]
    return {
        "slo_attainment": round(loadgen.attainment(records, TTFT_S, TPOT_S), 4),
        "slo_attainment_settled": round(loadgen.attainment(settled, TTFT_S, TPOT_S), 4),
        "card_hours": round(fleet.card_hours(end), 5),
        "requests": summary.sent,
        "failed": summary.failed,
        "replicas_over_time": fleet.timeline,
        "last_reasons": policy.reasons[:6] if policy else [],
    }


def rising(due_s: float) -> bool:
    """Whether a request due ``due_s`` into the load falls in the first SETTLE_S of a level
    higher than the one before it."""
    level = int(due_s // STEP_S)
    if not 0 < level < len(LEVELS) or LEVELS[level] <= LEVELS[level - 1]:
        return False
    return due_s - level * STEP_S < SETTLE_S


def figures(seed: int = 1) -> dict[str, Any]:
    """Both ways on the same requests, and their ratios."""
    binary = engine.server(lambda line: print(line, file=sys.stderr))
    folder = binary.parent.parent / "models"
    folder.mkdir(exist_ok=True)
    model = engine.write_model(folder / "tiny-512x4.gguf", **MODEL_SHAPE)
    pattern = workload.step_pattern([level * BASE for level in LEVELS], STEP_S)
    requests = workload.generate(pattern, LENGTHS, len(LEVELS) * STEP_S, seed=seed)
    scaled = asyncio.run(run(binary, model, requests, fixed=None))
    peak = max(count for _, count in scaled["replicas_over_time"])
    fixed = asyncio.run(run(binary, model, requests, fixed=max(peak, 1)))
    return {
        "engine": f"llama.cpp (llama-server, tiny random Llama 512x4, {CPU_CORES} CPU a replica)",
        "requests": len(requests),
        "fixed": fixed,
        "autoscaler": scaled,
        "card_hours_ratio": round(scaled["card_hours"] / fixed["card_hours"], 3),
        "goal": {"slo_attainment": GOAL, "card_hours_ratio": 0.7},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    found = figures(args.seed)
    print(json.dumps(found, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
