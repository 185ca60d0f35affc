"""The locality wait (``spec.placement.localityWaitSeconds``) on the peers' trace, in simulated
time: the placement engine places the trace of ``benchmarks/peers.py`` (seed 7: 200 gangs over
120 s on 4 supernodes × 12 racks × 4 nodes × 8 cards) with no API server, once per wait, and
each figure is compared with the run without a wait (the same trace, the same departures).

    .venv/bin/python benchmarks/locality_wait.py --json
    .venv/bin/python benchmarks/locality_wait.py --waits 0,3,4,5,6,7,8,10,15 --seeds 30

What the model is: a gang arrives at its trace time; every arrival, departure and wait's end
places the waiting gangs in arrival order (as the scheduling cycle does, every one that fits:
no gang holds cards for another); a training gang larger than a rack whose placement uses more
racks than the fewest that could hold it waits, up to the wait from the first moment it could
have been placed that way (``engine.waits_for_fewer_racks``, the controller's rule); a placed gang
leaves ``duration`` seconds later, its cards free at once. What it leaves out: the API server's
latency, pods that go one by one (``WaitingForLeavingPods``), the binding's pace. Figures:
``extra_racks`` (training gangs: racks used minus the fewest, as ``peers.py`` counts them),
``idle_card_hours`` (free cards while a gang waits), ``gangs_waited`` and the mean wait.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
from typing import Any

from matrixpool.placement import engine, model

try:  # run as a script: benchmarks/ is on sys.path
    from peers import Gang, make_trace
    from placement import CARDS, PER_RACK, RACKS, supernode
except ImportError:  # imported as benchmarks.locality_wait
    from benchmarks.peers import Gang, make_trace
    from benchmarks.placement import CARDS, PER_RACK, RACKS, supernode

SUPERNODES = 4  # the peers' cluster: 4 of benchmarks/placement.py's supernodes, no card groups
ARRIVE, LEAVE, WAKE = 0, 1, 2


def request(gang: Gang) -> model.GangRequest:
    """As ``peers.py`` writes the gang for matrixpool: ``Required``, ``groupSize`` when it fits
    a rack, an inference group's pods spread."""
    nodes = math.ceil(gang.pods * gang.cards / CARDS)
    options: dict[str, Any] = {}
    if gang.serving:
        options["spread_group"] = f"{gang.name}/serve"
    elif nodes <= PER_RACK and gang.pods > 1:
        options["group_size"] = gang.pods
    pods = tuple(
        model.PodRequest(model.PodKey(f"{gang.name}-{r}"), gang.cards) for r in range(gang.pods)
    )
    return model.GangRequest(gang=model.GangKey(gang.name), pods=pods, priority=100, **options)


def run(trace: list[Gang], wait: float) -> dict[str, float]:
    topologies = [supernode(f"sn-{i}", groups=(), spares=0) for i in range(SUPERNODES)]
    snapshot = engine.Snapshot.build(topologies, [])
    gangs = {g.name: g for g in trace}
    events = [(g.arrival, ARRIVE, g.name) for g in trace]
    heapq.heapify(events)
    waiting: list[str] = []
    spread_since: dict[model.GangKey, float] = {}
    waited: list[float] = []
    extra = 0
    total = SUPERNODES * RACKS * PER_RACK * CARDS
    used, idle, last = 0, 0.0, 0.0
    while events:
        now, kind, name = heapq.heappop(events)
        if waiting:
            idle += (total - used) * (now - last) / 3600
        last = now
        if kind == ARRIVE:
            waiting.append(name)
        elif kind == LEAVE:
            snapshot.release(model.GangKey(name))
            used -= gangs[name].pods * gangs[name].cards
        for name in list(waiting):
            gang = gangs[name]
            verdict = engine.place(snapshot, request(gang))
            if not isinstance(verdict, model.Placement):
                continue
            limit = 0.0 if gang.serving else wait
            if engine.waits_for_fewer_racks(snapshot, verdict, limit, spread_since, now):
                # a microsecond past the end: at the end itself, now - since may fall short of
                # the wait by a rounding error, and the wake would come back at the same time
                end = spread_since[verdict.gang] + wait + 1e-6
                heapq.heappush(events, (end, WAKE, name))
                continue
            racks, fewest = engine.racks(snapshot, verdict)
            snapshot.commit(verdict)
            used += gang.pods * gang.cards
            waiting.remove(name)
            waited.append(now - gang.arrival)
            if not gang.serving:
                extra += racks - fewest
            heapq.heappush(events, (now + gang.duration, LEAVE, name))
    return {
        "wait_seconds": wait,
        "extra_racks": extra,
        "idle_card_hours": round(idle, 3),
        "gangs_waited": sum(1 for w in waited if w > 0),
        "mean_wait_seconds": round(statistics.mean(waited), 3),
        "placed": len(waited),
    }


def sweep(seeds: int, waits: list[float]) -> list[dict[str, float]]:
    """Each wait over the traces of seeds 1..``seeds`` (the same generator, other gangs): the
    mean and median of its extra racks, and of its idle card-hours against no wait on the same
    trace. One trace's figures jump between neighbouring waits (a gang placed a second later
    changes every placement after it); the choice of a wait is the seeds' mean's."""
    extra: dict[float, list[int]] = {w: [] for w in waits}
    idle: dict[float, list[float]] = {w: [] for w in waits}
    for seed in range(1, seeds + 1):
        trace = make_trace(seed, 200, 120.0)
        base = run(trace, 0.0)["idle_card_hours"]
        for w in waits:
            found = run(trace, w)
            extra[w].append(int(found["extra_racks"]))
            idle[w].append(found["idle_card_hours"] / base)
    return [
        {
            "wait_seconds": w,
            "extra_racks_mean": round(statistics.mean(extra[w]), 2),
            "extra_racks_median": statistics.median(extra[w]),
            "idle_vs_no_wait_mean": round(statistics.mean(idle[w]), 3),
            "idle_vs_no_wait_median": round(statistics.median(idle[w]), 3),
        }
        for w in waits
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--waits", default="0,2,5,10,30", help="comma-separated seconds")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--seeds", type=int, default=0, help="also each wait over the traces of seeds 1..N"
    )
    args = parser.parse_args()
    waits = [float(w) for w in args.waits.split(",")]
    trace = make_trace(args.seed, 200, 120.0)
    runs = [run(trace, w) for w in waits]
    base = next((r for r in runs if r["wait_seconds"] == 0), runs[0])
    for r in runs:
        r["idle_vs_no_wait"] = round(r["idle_card_hours"] / base["idle_card_hours"], 3)
    report: dict[str, Any] = {
        "trace": {"gangs": 200, "seconds": 120.0, "seed": args.seed},
        "runs": runs,
    }
    if args.seeds:
        report["seeds"] = {"count": args.seeds, "waits": sweep(args.seeds, waits)}
    if not args.json:
        for r in runs:
            print(r, file=sys.stderr)
        for r in report.get("seeds", {}).get("waits", []):
            print(r, file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
