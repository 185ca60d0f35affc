"""The event loop: one policy over the whole simulated horizon.

Called by :func:`simulate` (every policy of a configuration, the same fault trace for each)
and by the tests. Events, in time order: job arrivals, faults, repairs, recoveries done, jobs
done, time-window boundaries and samples. At each:

1. Faults: the jobs holding a hit card or node are asked to :func:`policy.decide` with what the
   policy lets them see (its levels, the free spares when it has spares, the copies its tiers
   keep); the plan is carried out on the engine's snapshot (SpareSwap: the moved ranks onto
   the chosen spares; Reschedule: the whole gang placed again by the engine) and the job trains
   again after :mod:`.costs`' seconds, from the restored step (the progress past it is lost).
2. Window boundaries: :func:`split.target_split` says which jobs run and how many inference
   replicas the window allows; suspended jobs checkpoint first ("checkpoint") or lose what
   their persistent tier lacks ("kill"), inference replicas are placed by the engine.
3. Releases (a job done, a repair) let waiting jobs in, highest priority first.

Progress is useful training seconds kept; a step is ``step_seconds`` of it and a tier holds the
newest multiple of its interval (TrainingJob spec.checkpoint ``everySteps``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from matrixpool.api import supernode
from matrixpool.placement import model as placement
from matrixpool.placement.inventory import NodeName
from matrixpool.simulate import cluster, costs, failures, model
from matrixpool.timeshare import split, windows
from matrixpool_recovery import policy

FUTURE, WAITING, RUNNING = "future", "waiting", "running"  # not arrived; queued; training
RECOVERING, SUSPENDED, DONE = "recovering", "suspended", "done"  # placed, not yet training;
# evicted by a window until a later one gives it cards; finished
TIDAL_KILL = "TidalKill"  # a record of progress lost to an eviction without checkpoint
SERVICE = split.WorkloadKey("infer/decode")  # the one InferenceService of a run
FAULT_KINDS = {
    "card": policy.FaultKind.CARDS_UNHEALTHY,
    "node": policy.FaultKind.NODE_DOWN,
    "rack": policy.FaultKind.NODE_DOWN,
    "network": policy.FaultKind.POD_FAILED,
    "software": policy.FaultKind.POD_FAILED,
}


@dataclass
class Job:
    """One training job of the mix, as the run tracks it."""

    key: placement.GangKey
    klass: model.JobClass
    pods: int  # ranks, one pod each
    cards_per_pod: int
    work: float | None  # useful seconds to do; None: train until the horizon
    arrival: float
    every: tuple[int, int, int]  # memory, local, persistent intervals in steps (0: off)
    state: str = FUTURE
    progress: float = 0.0  # useful seconds kept
    since: float = 0.0  # when progress last advanced (RUNNING)
    node_of: dict[int, NodeName] = field(default_factory=dict)  # rank -> node
    cards_of: dict[int, frozenset[int]] = field(default_factory=dict)  # rank -> cards there
    peer_of: dict[int, NodeName] = field(default_factory=dict)  # rank -> node of its peer copy
    epoch: int = 0  # bumps invalidate scheduled RESUME/FINISH events
    fault_at: float | None = None  # first fault of the recovery under way
    level: policy.Level | None = None  # level of the recovery under way
    held_since: float | None = None  # cards held from (RUNNING or RECOVERING)
    first_start: float | None = None
    done_at: float | None = None
    lost_seconds: float = 0.0
    lost_steps: int = 0
    held_card_seconds: float = 0.0
    recoveries: int = 0
    resume_tier: str = "peers"  # where a placed-again job reads: memory held elsewhere
    rate: float = 1.0  # useful seconds per second of training (below 1: saves that block)

    @property
    def cards(self) -> int:
        return self.pods * self.cards_per_pod

    @property
    def gb_per_rank(self) -> float:
        return self.klass.state_gb_per_card * self.cards_per_pod

    def advance(self, now: float) -> None:
        if self.state == RUNNING:
            self.progress += (now - self.since) * self.rate
        self.since = now

    def steps(self) -> tuple[int, int, int]:
        """The newest step each tier holds (0: none yet)."""
        step = int(self.progress / self.klass.step_seconds + 1e-9)
        memory, local, persistent = (step // e * e if e else 0 for e in self.every)
        return memory, local, persistent


@dataclass
class Recovery:
    """One recovery of one job, for the report."""

    job: str
    cards: int
    level: str
    seconds: float  # first fault to training again
    lost_steps: int
    breakdown: costs.Breakdown


@dataclass
class Outcome:
    """What one policy did over the horizon."""

    policy: str
    horizon: float
    jobs: list[Job]
    recoveries: list[Recovery]
    samples: list[tuple[float, float]]  # (hours, headline goodput so far)
    card_seconds: dict[str, float]  # "training", "inference", "useful", "total"
    failed: int  # decide() returned Failed: the job restarted from step 0
    faults: int

    @property
    def headline(self) -> Job | None:
        return next((j for j in self.jobs if j.klass.headline), None)


def simulate(
    config: model.Config, policies: tuple[model.Policy, ...] | None = None
) -> list[Outcome]:
    """Every policy of ``config`` (or ``policies``) over the same fault trace."""
    trace = failures.trace(config)
    return [Run(config, p, trace).run() for p in policies or config.policies]


class Run:
    """One policy's run: the pool, the jobs and the event queue."""

    def __init__(
        self, config: model.Config, chosen: model.Policy, trace: list[failures.FaultEvent]
    ) -> None:
        self.config, self.policy, self.costs = config, chosen, chosen.costs(config.costs)
        self.pool = cluster.Pool(config.cluster, chosen.spares)
        self.jobs = _jobs(config, chosen, self.costs)
        self.by_key = {j.key: j for j in self.jobs}
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.recoveries: list[Recovery] = []
        self.samples: list[tuple[float, float]] = []
        self.card_seconds = dict.fromkeys(("training", "inference", "useful", "total"), 0.0)
        self.replicas: list[placement.Placement] = []  # inference replicas placed
        self.failed = 0
        self.faults = 0
        self.window: str | None = None  # the time window in force
        self._target_replicas = 0  # inference replicas the window's split allows
        self._schedule(trace)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> Outcome:
        horizon = self.config.horizon_seconds
        while self.events and self.events[0][0] <= horizon:
            at, _, kind, payload = heapq.heappop(self.events)
            self._tick(at)
            getattr(self, f"_on_{kind}")(payload)
        self._tick(horizon)
        for job in self.jobs:
            job.advance(horizon)
            self._unhold(job)
        return Outcome(
            self.policy.name,
            horizon,
            self.jobs,
            self.recoveries,
            self.samples,
            self.card_seconds,
            self.failed,
            self.faults,
        )

    def _push(self, at: float, kind: str, payload: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def _schedule(self, trace: list[failures.FaultEvent]) -> None:
        for job in self.jobs:
            self._push(job.arrival, "arrive", job.key)
        for fault in trace:
            self._push(fault.at, "fault", fault)
        for scripted in self.config.failures.scripted:
            self._push(scripted.at_hours * 3600.0, "scripted", scripted)
        sharing = self.config.inference.time_sharing
        if sharing is not None:
            self._push(0.0, "window", None)
            end = self.config.start + _delta(self.config.horizon_seconds)
            for boundary in windows.boundaries(sharing, self.config.start, end):
                self._push((boundary.at - self.config.start).total_seconds(), "window", None)
        step = self.config.sample_hours * 3600.0
        for k in range(1, int(self.config.horizon_seconds // step) + 1):
            self._push(k * step, "sample", None)

    def _tick(self, at: float) -> None:
        """Card-seconds from the last event to ``at`` (utilisation)."""
        dt = at - self.now
        if dt > 0:
            training = sum(j.cards for j in self.jobs if j.state in (RUNNING, RECOVERING))
            useful = sum(j.cards for j in self.jobs if j.state == RUNNING)
            inference = sum(len(r.assignments) for r in self.replicas) * self._replica_pod_cards
            self.card_seconds["training"] += training * dt
            self.card_seconds["useful"] += useful * dt
            self.card_seconds["inference"] += inference * dt
            self.card_seconds["total"] += self.config.cluster.cards * dt
        self.now = at

    # ---- jobs ---------------------------------------------------------------------------------

    def _on_arrive(self, key: placement.GangKey) -> None:
        job = self.by_key[key]
        job.state = WAITING
        self._admit([job])

    def _admit(self, jobs: list[Job]) -> None:
        """Place waiting (or, at a window boundary, suspended) jobs that may run now, highest
        priority first."""
        snapshot, whole = self.pool.snapshot, self.config.cluster.cards_per_node
        free = sum(snapshot.sn_free)
        empty = sum(map(len, snapshot.rack_empty))  # nodes with every card free
        for job in sorted(jobs, key=lambda j: (-j.klass.priority, j.arrival, j.key)):
            if job.state not in (WAITING, SUSPENDED) or job.cards > free:
                continue
            if job.cards_per_pod == whole and job.pods > empty:
                continue  # whole-node pods need empty nodes: no need to ask the engine
            if not split.runs_in(_demand(job), self.window) and self._sharing:
                continue
            if self._start(job):
                free -= job.cards
                empty -= job.pods if job.cards_per_pod == whole else 0

    def _start(self, job: Job) -> bool:
        """Place ``job`` whole; it trains after the resume costs, from its kept progress."""
        placed = self.pool.place(_gang(job))
        if placed is None:
            return False
        self._placed(job, placed)
        restore = 0.0  # a first start reads nothing
        if job.progress:
            tier = job.resume_tier if self.policy.fast_tiers else "persistent"
            restore = costs.restore_from(self.costs, tier, job.pods, job.gb_per_rank)
        breakdown = costs.resume(self.costs, job.pods, job.cards, restore)
        job.first_start = self.now if job.first_start is None else job.first_start
        self._resume_after(job, breakdown.total)
        return True

    def _placed(self, job: Job, placed: placement.Placement) -> None:
        job.node_of = {r: a.node for r, a in enumerate(placed.assignments)}
        job.cards_of = {r: frozenset(a.cards) for r, a in enumerate(placed.assignments)}
        job.peer_of = self._peers(job) if self.policy.peers else {}
        job.state, job.held_since = RECOVERING, self.now

    def _peers(self, job: Job) -> dict[int, NodeName]:
        """Each rank's peer copy: the node of a rank one rack further, in another rack."""
        rack_of, step = self.pool.rack_of, self.config.cluster.nodes_per_rack
        peers = {}
        for r, node in job.node_of.items():
            for k in range(1, job.pods):
                other = job.node_of[(r + step * k) % job.pods]
                if rack_of[other] != rack_of[node]:
                    peers[r] = other
                    break
        return peers

    def _resume_after(self, job: Job, seconds: float) -> None:
        job.epoch += 1
        job.advance(self.now)
        job.state = RECOVERING
        self._push(self.now + seconds, "resume", (job.key, job.epoch))

    def _on_resume(self, payload: tuple[placement.GangKey, int]) -> None:
        job = self.by_key[payload[0]]
        if job.epoch != payload[1] or job.state != RECOVERING:
            return
        if job.fault_at is not None and job.level is not None:
            self.recoveries[-1 - self._pending(job)].seconds = self.now - job.fault_at
        job.fault_at = job.level = None
        job.state, job.since, job.resume_tier = RUNNING, self.now, "peers"
        if job.work is not None:
            finish = self.now + (job.work - job.progress) / job.rate
            self._push(finish, "finish", (job.key, job.epoch))

    def _pending(self, job: Job) -> int:
        """Index from the end of ``job``'s open recovery record."""
        for k, record in enumerate(reversed(self.recoveries)):
            if record.job == job.key:
                return k
        raise AssertionError(f"{job.key}: no recovery record")

    def _on_finish(self, payload: tuple[placement.GangKey, int]) -> None:
        job = self.by_key[payload[0]]
        if job.epoch != payload[1] or job.state != RUNNING:
            return
        job.advance(self.now)
        self._release(job)
        job.state, job.done_at = DONE, self.now
        self._after_release()

    def _release(self, job: Job) -> None:
        pods = [(_pod(job, r), n) for r, n in job.node_of.items()]
        self.pool.release(job.key, pods)
        self._unhold(job)
        job.node_of, job.cards_of, job.peer_of = {}, {}, {}

    def _unhold(self, job: Job) -> None:
        if job.held_since is not None:
            job.held_card_seconds += job.cards * (self.now - job.held_since)
            job.held_since = None

    def _after_release(self) -> None:
        for sn in self.pool.spares:
            if len(self.pool.spares[sn]) < self.pool.spare_target:
                self.pool.refill(sn)
        self._admit([j for j in self.jobs if j.state == WAITING])

    # ---- faults -------------------------------------------------------------------------------

    def _on_scripted(self, fault: model.ScriptedFault) -> None:
        node = fault.node
        if node is None:
            headline = next((j for j in self.jobs if j.klass.headline and j.node_of), None)
            if headline is None:
                return
            node = self.pool.names.index(headline.node_of[fault.rank])
        self._on_fault(failures.scripted(self.config, fault, node))

    def _on_fault(self, fault: failures.FaultEvent) -> None:
        self.faults += 1
        nodes = [self.pool.names[i] for i in fault.nodes]
        hit = {g for n in nodes for g in self.pool.holders[n]}
        for gang in sorted(hit):
            if gang in self.by_key:
                self._recover(self.by_key[gang], fault, nodes)
            elif gang.startswith(SERVICE):
                self._drop_replica(gang)
        if fault.repair_seconds > 0:
            cards = range(self.config.cluster.cards_per_node)
            down = [fault.card] if fault.card is not None else list(cards)
            for node in nodes:
                self.pool.take_down(node, down)
            self._push(self.now + fault.repair_seconds, "repair", tuple(nodes))
        self._place_pending()

    def _recover(self, job: Job, fault: failures.FaultEvent, nodes: list[NodeName]) -> None:
        """Rule 1 of the module: decide, carry the plan out, resume after its cost."""
        faults = self._faults(job, fault, nodes)
        if not faults or job.state not in (RUNNING, RECOVERING):
            return
        job.advance(self.now)
        verdict = policy.decide(
            faults,
            self._view(job),
            self._copies(job),
            self._spares(job),
            newest_saved_step=max(self._kept_steps(job)) or None,
        )
        if isinstance(verdict, policy.Failed):  # the job is submitted again, from step 0
            self.failed += 1
            self._lose(job, 0)
            self._release(job)
            job.state = WAITING
            self._admit([job])
            return
        restored = verdict.restored_step or 0
        lost = self._lose(job, restored)
        home = self._carry_out(job, verdict)
        restore = (
            0.0
            if home is None
            else costs.restore(self.costs, verdict.sources, home, job.gb_per_rank)
        )
        breakdown = costs.recovery(
            self.costs, verdict.level, [fault.component], job.pods, job.cards, restore
        )
        self._record(job, verdict.level, lost, breakdown)
        if home is not None:  # else it waits for room, its recovery open (_place_pending)
            self._resume_after(job, breakdown.total)

    def _faults(
        self, job: Job, fault: failures.FaultEvent, nodes: list[NodeName]
    ) -> list[policy.Fault]:
        kind = FAULT_KINDS[fault.component]
        mine = [n for n in nodes if n in set(job.node_of.values())]
        if kind == policy.FaultKind.CARDS_UNHEALTHY:
            assert fault.card is not None
            hit = [n for n in mine if any(fault.card in job.cards_of[r] for r in _ranks(job, n))]
            return [policy.Fault(kind, policy.NodeName(n), frozenset({fault.card})) for n in hit]
        return [policy.Fault(kind, policy.NodeName(n)) for n in mine]

    def _view(self, job: Job) -> policy.JobView:
        # placement's and recovery's NodeName are two NewTypes of str: the pool's mappings are
        # passed as they are, not copied per fault (hence the ignores)
        return policy.JobView(
            key=job.key,
            world_size=job.pods,
            node_of=job.node_of,  # type: ignore[arg-type]
            cards_of=job.cards_of,
            rack_of=self.pool.rack_of,  # type: ignore[arg-type]
            supernode_of=self.pool.supernode_of,  # type: ignore[arg-type]
            levels=self.policy.levels,
            recoveries=job.recoveries,
            max_recoveries=1 << 30,  # a run of weeks: the budget is not what is studied
        )

    def _kept_steps(self, job: Job) -> tuple[int, int, int]:
        """The newest step of each tier the policy keeps (0: none)."""
        memory, local, persistent = job.steps()
        fast = self.policy.fast_tiers
        return (memory if fast else 0, local if fast else 0, persistent)

    def _copies(self, job: Job) -> Iterator[policy.Copy]:
        memory, local, persistent = self._kept_steps(job)
        fast = self.policy.fast_tiers
        for r, node in job.node_of.items():
            if fast and memory:
                yield policy.Copy(r, memory, policy.Tier.MEMORY, policy.NodeName(node))
                peer = job.peer_of.get(r)
                if peer is not None:
                    yield policy.Copy(r, memory, policy.Tier.PEERS, policy.NodeName(peer))
            if fast and local:
                yield policy.Copy(r, local, policy.Tier.LOCAL, policy.NodeName(node))
            if persistent:
                yield policy.Copy(r, persistent, policy.Tier.PERSISTENT, None)

    def _spares(self, job: Job) -> policy.Spares:
        if not self.policy.spares:
            return policy.Spares()
        sns = {self.pool.supernode_of[n] for n in job.node_of.values()}
        return policy.Spares(
            {sn: tuple(policy.NodeName(n) for n in self.pool.spares[sn]) for sn in sns},
            self.pool.rack_of,  # type: ignore[arg-type]
        )

    def _lose(self, job: Job, restored_step: int) -> float:
        """Progress back to ``restored_step``; returns the seconds lost."""
        kept = restored_step * job.klass.step_seconds
        lost = max(0.0, job.progress - kept)
        job.lost_seconds += lost
        job.lost_steps += int(lost / job.klass.step_seconds + 1e-9)
        job.progress = min(job.progress, kept)
        return lost

    def _carry_out(self, job: Job, plan: policy.Plan) -> dict[int, str | None] | None:
        """The plan on the snapshot; the node each rank restores on (None: Reschedule)."""
        job.recoveries += 1
        if plan.level == policy.Level.IN_PLACE:
            return dict(job.node_of)
        if plan.level == policy.Level.SPARE_SWAP:
            self._swap(job, plan.targets)
            return {r: job.node_of[r] for r in job.node_of}
        self._release(job)
        job.state = WAITING
        if self._start_again(job):
            return dict.fromkeys(job.node_of)
        return None

    def _swap(self, job: Job, targets: dict[int, policy.NodeName] | Any) -> None:
        moved = sorted(targets)
        self.pool.release(job.key, [(_pod(job, r), job.node_of[r]) for r in moved])
        for r in moved:
            spare = NodeName(targets[r])
            sn = self.pool.supernode_of[spare]
            if spare in self.pool.spares[sn]:
                self.pool.take_spare(sn, spare)
            cards = tuple(placement.CardId(c) for c in sorted(job.cards_of[r]))
            assignment = placement.Assignment(_pod(job, r), spare, cards, sn)
            self.pool.commit(placement.Placement(job.key, (assignment,), job.klass.priority))
            job.node_of[r] = spare
        if self.policy.peers:
            job.peer_of = self._peers(job)
        for sn in {self.pool.supernode_of[NodeName(t)] for t in targets.values()}:
            self.pool.refill(sn)

    def _start_again(self, job: Job) -> bool:
        """Reschedule: the whole gang placed by the engine; it waits when it does not fit."""
        placed = self.pool.place(_gang(job))
        if placed is None:
            return False
        self._placed(job, placed)
        return True

    def _record(self, job: Job, level: policy.Level, lost: float, b: costs.Breakdown) -> None:
        steps = int(lost / job.klass.step_seconds + 1e-9)
        if job.fault_at is not None:  # a fault during a recovery: one longer recovery
            record = self.recoveries[-1 - self._pending(job)]
            record.level, record.lost_steps = level.value, record.lost_steps + steps
            record.breakdown = b
        else:
            job.fault_at = self.now
            self.recoveries.append(Recovery(job.key, job.cards, level.value, 0.0, steps, b))
        job.level = level

    def _on_repair(self, nodes: tuple[NodeName, ...]) -> None:
        for node in nodes:
            self.pool.repair(node)
        self._after_release()
        self._place_pending()

    def _place_pending(self) -> None:
        """Jobs whose Reschedule found no room wait as WAITING with an open recovery; they and
        inference replicas lost to the fault are placed again when room appears."""
        self._admit([j for j in self.jobs if j.state == WAITING and j.fault_at is not None])
        self._fill_inference()

    # ---- time-sharing -------------------------------------------------------------------------

    @property
    def _sharing(self) -> bool:
        return self.config.inference.time_sharing is not None

    @property
    def _replica_pod_cards(self) -> int:
        return min(self.config.inference.replica_cards, self.config.cluster.cards_per_node)

    def _on_window(self, _: None) -> None:
        """Rule 2 of the module."""
        sharing = self.config.inference.time_sharing
        assert sharing is not None
        at = self.config.start + _delta(self.now)
        window = windows.window_at(sharing, at)
        self.window = window.name
        target = self._split(window)
        for job in self.jobs:
            if job.state in (RUNNING, RECOVERING) and target.training.get(_wkey(job), 0) == 0:
                self._suspend(job)
        self._target_replicas = target.inference.get(SERVICE, {}).get("decode", 0)
        while len(self.replicas) > self._target_replicas:
            self._drop_replica(self.replicas[-1].gang)
        self._fill_inference()
        runs = [j for j in self.jobs if target.training.get(_wkey(j), 0) > 0]
        self._admit([j for j in runs if j.state in (WAITING, SUSPENDED)])
        self._after_release()

    def _split(self, window: supernode.TimeWindow) -> split.Split:
        c, sharing = self.config.cluster, self.config.inference.time_sharing
        assert sharing is not None
        pool_cards = c.cards - self.pool.spare_target * c.supernodes * c.cards_per_node
        whole = window.model_copy(update={"inference_cards": window.inference_cards * c.supernodes})
        size = self.config.inference.replica_cards
        most = max(w.inference_cards for w in sharing.windows) * c.supernodes
        role = split.RoleDemand("decode", most // size, 0, size)
        service = split.InferenceDemand(SERVICE, self.config.inference.priority, (role,))
        jobs = [_demand(j) for j in self.jobs if j.state not in (FUTURE, DONE)]
        return split.target_split(pool_cards, whole, [service], jobs)

    def _suspend(self, job: Job) -> None:
        """Evicted by the window: checkpoint first, or killed (progress back to tier 3)."""
        job.advance(self.now)
        job.resume_tier = "peers"  # its checkpoint stays in the daemons' memory
        if self.policy.tidal == "kill":
            job.resume_tier = "persistent"
            lost = self._lose(job, job.steps()[2])
            self.recoveries.append(
                Recovery(job.key, job.cards, TIDAL_KILL, 0.0, _steps(job, lost), costs.NOTHING)
            )
        if job.fault_at is not None:  # a recovery cut short by the eviction
            self.recoveries[-1 - self._pending(job)].seconds = self.now - job.fault_at
            job.fault_at = job.level = None
        job.epoch += 1
        self._release(job)
        job.state = SUSPENDED

    def _fill_inference(self) -> None:
        size = self.config.inference.replica_cards
        pod_cards = self._replica_pod_cards
        while len(self.replicas) < self._target_replicas:
            key = placement.GangKey(f"{SERVICE}/{self.seq}")
            self.seq += 1
            pods = tuple(
                placement.PodRequest(placement.PodKey(f"{key}/{k}"), pod_cards)
                for k in range(max(1, size // pod_cards))
            )
            gang = placement.GangRequest(
                key, pods, self.config.inference.priority, spread_group=SERVICE
            )
            placed = self.pool.place(gang)
            if placed is None:
                return
            self.replicas.append(placed)

    def _drop_replica(self, gang: placement.GangKey) -> None:
        for k, replica in enumerate(self.replicas):
            if replica.gang == gang:
                self.pool.release(gang, [(a.pod, a.node) for a in replica.assignments])
                del self.replicas[k]
                return

    # ---- samples ------------------------------------------------------------------------------

    def _on_sample(self, _: None) -> None:
        headline = next((j for j in self.jobs if j.klass.headline), None)
        if headline is None or headline.first_start is None:
            return
        headline.advance(self.now)
        wall = self.now - headline.arrival
        self.samples.append((self.now / 3600.0, headline.progress / wall if wall else 0.0))


# ---- helpers ------------------------------------------------------------------------------------


def _jobs(config: model.Config, chosen: model.Policy, prices: model.Costs) -> list[Job]:
    """The mix: every class's jobs drawn with the run's seed (the same for every policy)."""
    rng = random.Random(f"{config.seed}/jobs")
    cpn = config.cluster.cards_per_node
    jobs = []
    for klass in config.jobs:
        for k in range(klass.count):
            cards = round(math.exp(rng.uniform(math.log(klass.cards[0]), math.log(klass.cards[1]))))
            per_pod = cpn if cards >= cpn else 1 << (cards.bit_length() - 1)
            pods = math.ceil(cards / per_pod)
            hours = None if klass.hours is None else rng.uniform(*klass.hours)
            arrival = rng.uniform(*klass.start_hours) * 3600.0
            c = klass.checkpoint
            persistent = chosen.persistent_every_steps or c.persistent_every_steps
            rate = 1.0
            if chosen.blocking_saves and persistent:
                written = costs.save(prices, "persistent", pods, klass.state_gb_per_card * per_pod)
                rate = costs.useful_fraction(persistent * klass.step_seconds, written)
            jobs.append(
                Job(
                    key=placement.GangKey(f"train/{klass.name}-{k}"),
                    klass=klass,
                    pods=pods,
                    cards_per_pod=per_pod,
                    work=None if hours is None else hours * 3600.0,
                    arrival=arrival,
                    every=(c.memory_every_steps, c.local_every_steps, persistent),
                    rate=rate,
                )
            )
    return jobs


def _steps(job: Job, seconds: float) -> int:
    return int(seconds / job.klass.step_seconds + 1e-9)


def _gang(job: Job) -> placement.GangRequest:
    pods = tuple(placement.PodRequest(_pod(job, r), job.cards_per_pod) for r in range(job.pods))
    return placement.GangRequest(
        job.key, pods, job.klass.priority, affinity=placement.Affinity.PREFERRED
    )


def _pod(job: Job, rank: int) -> placement.PodKey:
    return placement.PodKey(f"{job.key}/{rank}")


def _ranks(job: Job, node: NodeName) -> list[int]:
    return [r for r, n in job.node_of.items() if n == node]


def _wkey(job: Job) -> split.WorkloadKey:
    return split.WorkloadKey(job.key)


def _demand(job: Job) -> split.TrainingDemand:
    return split.TrainingDemand(
        _wkey(job), job.klass.priority, job.pods, job.pods, job.cards_per_pod, job.klass.windows
    )


def _delta(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=seconds)


def probe(config: model.Config, cards: int) -> dict[str, Recovery]:
    """One recovery per level of a job of ``cards`` cards alone on the configured cluster,
    with the configured costs: a software fault (InPlace), a node loss (SpareSwap), and a
    node loss when the job allows only InPlace and Reschedule (Reschedule)."""
    headline = next((j for j in config.jobs if j.headline), config.jobs[0])
    job = dataclasses.replace(
        headline, count=1, cards=(cards, cards), hours=None, start_hours=(0, 0), headline=True
    )
    base = model.BUILTIN_POLICIES["matrixpool"]
    cases = {
        policy.Level.IN_PLACE: ("software", base),
        policy.Level.SPARE_SWAP: ("node", base),
        policy.Level.RESCHEDULE: (
            "node",
            dataclasses.replace(base, levels=(policy.Level.IN_PLACE, policy.Level.RESCHEDULE)),
        ),
    }
    found = {}
    for level, (component, chosen) in cases.items():
        fault = model.ScriptedFault(at_hours=1.0, component=component)
        alone = dataclasses.replace(
            config,
            horizon_days=2.0 / 24,
            jobs=(job,),
            inference=model.Inference(None, 1, 0),
            failures=dataclasses.replace(config.failures, components={}, scripted=(fault,)),
            policies=(chosen,),
        )
        outcome = Run(alone, chosen, []).run()
        done = [r for r in outcome.recoveries if r.job == str(outcome.jobs[0].key)]
        if done:
            found[level.value] = done[0]
    return found
