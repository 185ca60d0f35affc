"""Fault recovery of TrainingJobs: detect, decide, carry out, record. DESIGN.md, "Recovery
contract"; the decision itself is the pure :func:`matrixpool_recovery.policy.decide`.

The main loop (:mod:`matrixpool.controllers.loop`) calls :func:`run` before every scheduling cycle,
so a fault is acted on within one loop period of its showing in the API (about 0.25 s) — the
Node watch sees Ready go False at once, no controller-manager grace is waited for — or within
:data:`UNREACHABLE_AFTER` of a node's checkpoint daemon going silent (its heartbeat, probed every
:data:`PROBE_SECONDS`).

Per TrainingJob whose gang is bound, each loop:
1. **Detect** (:func:`detect`, pure): a rank's Node gone or not Ready, its daemon unreachable,
   ``matrixpool.dev/unhealthy-cards`` covering one of its cards, its pod Failed (evicted too;
   a container that exits non-zero fails its pod). A pod that Succeeded is no fault; a finished
   job (phase Succeeded, :mod:`matrixpool.controllers.lifecycle`) is not looked at.
2. **Decide**: ask the daemons of the job's supernodes (and the tier-3 URI) which copies
   survive (:mod:`matrixpool.k8s.daemons`), find the free spares, call ``policy.decide``.
3. **Write the plan first**: ``status.recovering`` (level, targets, cards, what each rank
   restores; a job with no checkpoint yet: start fresh from step 0) and the read model's
   decisions (``handlers.decisions.Decisions``), before any pod is touched. An operator killed
   from here on is followed by one that reads the plan back and finishes it, once.
4. **Carry out** (idempotent, every loop until done): InPlace and SpareSwap delete the hit
   ranks' pods; the scheduler recreates them already reserved on their target node and cards
   (:func:`matrixpool.controllers.scheduling.pin`) and binds them; the other ranks get the new
   ``matrixpool.dev/restore`` annotation and reload that step where they run. Reschedule deletes
   the whole gang; the scheduler places it again wherever it fits, each new pod told what to
   restore.
5. **Record**: once every rank runs again, ``status.recoveries[]`` gets the entry (level,
   cause, restoredStep, lostSteps, detectedAt, recoveredAt) and keeps the newest
   :data:`~matrixpool.api.trainingjob.KEPT_RECOVERIES`; ``status.recoveryCount`` counts them
   all. An Event and the metrics follow.
``maxRecoveries`` reached (by ``recoveryCount``), or no level possible: the job goes Failed
with the reason. A step that raises is tried again after an exponential backoff per job
(:data:`BACKOFF_FIRST` doubling up to :data:`BACKOFF_MAX`, a ``RecoveryBackoff`` Event each
time), reset by the next step that succeeds.

Also keeps ``status.checkpoints`` (newest step committed for every rank, per tier) fresh,
every :data:`POLL_SECONDS`.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from matrixpool import clock, metrics
from matrixpool.api import labels, trainingjob
from matrixpool.controllers import background
from matrixpool.k8s import convert, daemons, executor
from matrixpool.placement import engine, inventory
from matrixpool.state import decisions
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool_recovery import manifest, policy
from matrixpool_recovery import restore as restore_codec

log = structlog.get_logger(__name__)

PROBE_SECONDS = 0.5  # heartbeat period of the daemons under training ranks
IDLE_PROBE_SECONDS = 5.0  # heartbeat period of every other daemon (spares, idle nodes)
DECIDE_ATTEMPTS = 3  # decisions whose step vanished before it was pinned are taken again
DEFER_SECONDS = 10.0  # a deferred recovery (silent daemons only) is tried again after this
SETTLE_SECONDS = 1.0  # node losses seen within this long of the first are decided together
PAUSE_VARIABLE = "MATRIXPOOL_RECOVERY_PAUSE_SECONDS"  # test knob: stop after writing the plan
UNREACHABLE_AFTER = 2.0  # seconds a daemon must stay silent (about 4 probes) to count as lost
POLL_SECONDS = 2.0  # status.checkpoints refresh period per running job
BACKOFF_FIRST = 1.0  # seconds before a failed recovery step of a job is tried again ...
BACKOFF_MAX = 300.0  # ... doubling with each failure in a row, up to this
WAIT_SECONDS = 3.0  # the longest a pass waits for its probe or a poll (a daemon's timeout)
FRESH = "no checkpoint yet: restarted from step 0"  # Events of a recovery from scratch


@dataclass
class State:
    """What the recovery controller remembers between loops, by job UID (safe to lose). Owned
    by the main loop."""

    silent_since: dict[str, float] = field(default_factory=dict)  # node → first failed probe
    probed_at: float = float("-inf")
    idle_probed_at: float = float("-inf")
    polled_at: dict[str, float] = field(default_factory=dict)  # job → last checkpoints poll
    checkpoints: dict[str, dict[str, int | None]] = field(default_factory=dict)  # job → written
    recorded: set[str] = field(default_factory=set)  # recovery ids appended to status
    # job → when its first fault showed (monotonic, for the settle window; wall, detectedAt)
    first_seen: dict[str, tuple[float, datetime.datetime]] = field(default_factory=dict)
    deferred: dict[str, float] = field(default_factory=dict)  # job → when it may be tried again
    # job UID → (failed steps in a row, monotonic time before which it is not tried again)
    backoff: dict[str, tuple[int, float]] = field(default_factory=dict)
    tasks: background.Tasks = field(default_factory=background.Tasks)  # probe, polls by job

    def unreachable(self, now: float) -> frozenset[str]:
        return frozenset(n for n, t in self.silent_since.items() if now - t >= UNREACHABLE_AFTER)

    def silent(self, nodes: Iterable[str], now: float) -> None:
        """Daemons that did not answer an inventory request: unreachable at once."""
        for node in nodes:
            self.silent_since[node] = min(self.silent_since.get(node, now), now - UNREACHABLE_AFTER)

    def failed(self, uid: str, now: float) -> float:
        """One more failed step of job ``uid``: the seconds it now waits."""
        failures = self.backoff.get(uid, (0, now))[0] + 1
        delay = backoff_delay(failures)
        self.backoff[uid] = (failures, now + delay)
        return delay

    def backing_off(self, uid: str, now: float) -> bool:
        return self.backoff.get(uid, (0, float("-inf")))[1] > now

    def forget(self, uid: str) -> None:
        """Drop what is remembered of the job ``uid`` (it went, or its name was reused)."""
        for remembered in (
            self.polled_at,
            self.checkpoints,
            self.first_seen,
            self.deferred,
            self.backoff,
        ):
            remembered.pop(uid, None)
        self.tasks.cancel(uid)


async def run(world: read_model.World, state: State, act: executor.Executor) -> None:
    """One pass: probe the daemons, then detect, decide, carry out and record per job.

    The probe and the polls run as tasks (never two at once) but the pass waits for them, at
    most :data:`WAIT_SECONDS`: run fully in the background they made the recovery benchmark
    fail to find a common step in 4 of 7 runs (cause not yet found), so a slow daemon still
    costs the loop up to that long per probe here."""
    probe(world, state, act)
    await state.tasks.settle("probe", WAIT_SECONDS)
    nodes: dict[str, inventory.NodeInfo] = {n.name: n for n in world.nodes}
    lost = state.unreachable(clock.SYSTEM.monotonic())
    for workload in world.workloads:
        if not isinstance(workload.model, trainingjob.TrainingJob):
            continue
        if read_model.failed_reason(world, workload) is not None:
            continue
        if read_model.succeeded(world, workload):
            continue  # finished: its pods are kept for their logs, never recovered
        if state.backing_off(workload.uid, clock.SYSTEM.monotonic()):
            continue
        try:
            done = await step(workload, world, nodes, lost, state, act)
        except Exception as error:  # one job's trouble must not stop the others' recoveries
            back_off(workload, error, state, act)
        else:
            if done:
                state.backoff.pop(workload.uid, None)


async def step(
    workload: Workload,
    world: read_model.World,
    nodes: Mapping[str, inventory.NodeInfo],
    lost: frozenset[str],
    state: State,
    act: executor.Executor,
) -> bool:
    """Detect, decide or carry out for one job; False when nothing was tried (a recovery
    deferred, or faults still settling)."""
    facts = world.pods.get(workload.key, [])
    recovery = read_model.recovery_of(world, workload)
    if recovery:
        await carry_out(workload, recovery, facts, nodes, lost, world, state, act)
        return True
    size = read_model.replicas_now(world, workload)
    faults = detect(size, facts, nodes, lost, workload, world.stale)
    if not faults:
        state.first_seen.pop(workload.uid, None)
        poll_checkpoints(workload, facts, nodes, world, state, act)
        await state.tasks.settle(workload.uid, WAIT_SECONDS)
        return True
    if state.deferred.get(workload.uid, 0.0) > clock.SYSTEM.monotonic():
        return False  # a recovery that was impossible, retried later
    if not settled(workload, faults, state):
        return False
    _, detected = state.first_seen.pop(workload.uid)
    await start(workload, faults, world, lost, detected, state, act)
    return True


def backoff_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` failed steps in a row: BACKOFF_FIRST, doubling with
    each failure, at most BACKOFF_MAX."""
    return float(min(BACKOFF_FIRST * 2 ** min(failures - 1, 32), BACKOFF_MAX))


def back_off(workload: Workload, error: Exception, state: State, act: executor.Executor) -> None:
    """A step of ``workload`` failed: wait before trying it again, and say so."""
    delay = state.failed(workload.uid, clock.SYSTEM.monotonic())
    log.exception("recovery step failed; backing off", job=workload.key, delay=delay)
    act.event(
        workload.ref,
        "Warning",
        "RecoveryBackoff",
        f"recovery step failed ({type(error).__name__}: {error}); trying again in {delay:.0f} s",
    )


# ---- node leases ----------------------------------------------------------------------------


@dataclass
class LeaseClock:
    """When each node's Lease was last seen renewed, on the operator's own monotonic clock.

    As kube-controller-manager's node lifecycle controller does, a Lease's age is measured from
    when the *observed* renewTime last changed, not by comparing the kubelet's renewTime with
    the operator's wall clock: a kubelet whose clock is off is not down, and an operator that
    just started gives every node the full grace. Owned by the main loop."""

    seen: dict[str, tuple[float, float]] = field(default_factory=dict)  # node → (renewTime,
    # the monotonic instant it was first seen with that value)

    def observe(self, leases: Mapping[str, tuple[float, float]], now: float) -> frozenset[str]:
        """The stale nodes (:func:`stale_leases`) once ``leases`` (node → (renewTime,
        duration)) are observed at monotonic ``now``."""
        for node, (renewed, _) in leases.items():
            known = self.seen.get(node)
            if known is None or known[0] != renewed:
                self.seen[node] = (renewed, now)
        for node in set(self.seen) - set(leases):
            del self.seen[node]  # the node and its Lease went
        return stale_leases({n: (self.seen[n][1], d) for n, (_, d) in leases.items()}, now)


def stale_leases(leases: Mapping[str, tuple[float, float]], now: float) -> frozenset[str]:
    """Nodes (→ (when the Lease was last renewed, its duration), on the clock of ``now``)
    whose kubelet has not renewed its Lease for three quarters of the lease's duration (three
    missed renewals at the kubelet's quarter-duration pace): counted as down before the node
    controller's grace (the whole duration, 40 s by default) marks them
    NotReady, and before its pod eviction.

    When a quarter of all Leases or more are overdue at once, the API server (or the
    operator's view of it) is what failed, not the nodes: none counts."""
    stale = frozenset(
        n for n, (renewed, duration) in leases.items() if now - renewed > duration * 0.75
    )
    return stale if len(stale) * 4 < len(leases) else frozenset()


# ---- heartbeat -------------------------------------------------------------------------------


def probe(world: read_model.World, state: State, act: executor.Executor) -> None:
    """Probe the daemons under training ranks every PROBE_SECONDS, the others (spares and
    idle nodes, where a gang may land) every IDLE_PROBE_SECONDS, in a task of its own
    (:mod:`matrixpool.controllers.background`; :func:`run` waits for it, bounded)."""
    now = clock.SYSTEM.monotonic()
    if now - state.probed_at < PROBE_SECONDS or state.tasks.busy("probe"):
        return
    state.probed_at = now
    everyone = now - state.idle_probed_at >= IDLE_PROBE_SECONDS
    if everyone:
        state.idle_probed_at = now
    busy = {
        p.node
        for w in world.workloads
        if w.kind == trainingjob.KIND
        for p in world.pods.get(w.key, [])
        if p.node
    }
    endpoints: dict[str, str] = {
        n.name: n.endpoint
        for n in world.nodes
        if n.endpoint and (everyone or n.name in busy or n.name in state.silent_since)
    }
    published = {n.name for n in world.nodes if n.endpoint}
    state.tasks.start("probe", heartbeat(endpoints, published, now, state, act))


async def heartbeat(
    endpoints: Mapping[str, str],
    published: Collection[str],
    now: float,
    state: State,
    act: executor.Executor,
) -> None:
    """One probe of ``endpoints``; a daemon that does not answer is silent since ``now``."""
    answers = await act.probe(endpoints)
    for node, healthy in answers.items():
        if healthy:
            state.silent_since.pop(node, None)
        else:
            state.silent_since.setdefault(node, now)
    for node in list(state.silent_since):
        if node not in published:  # the node or its daemon's endpoint is gone
            del state.silent_since[node]


# ---- 1. detect -------------------------------------------------------------------------------


def detect(
    world_size: int,
    facts: Sequence[convert.PodFacts],
    nodes: Mapping[str, inventory.NodeInfo],
    unreachable: Iterable[str],
    workload: Workload | None = None,
    stale: Iterable[str] = (),
) -> list[policy.Fault]:
    """The faults under a bound gang's ranks (pure). A gang not wholly bound has none: the
    scheduler is still placing it."""
    live = [p for p in facts if not p.deleting]
    if len({p.rank for p in live if p.node}) < world_size or workload_suspended(workload):
        return []
    silent = set(unreachable)
    expired = set(stale)
    found: dict[tuple[policy.FaultKind, str], tuple[set[int], set[int]]] = {}

    def add(
        kind: policy.FaultKind, node: str, ranks: Iterable[int] = (), cards: Iterable[int] = ()
    ) -> None:
        held = found.setdefault((kind, node), (set(), set()))
        held[0].update(ranks)
        held[1].update(cards)

    for pod in live:
        if not pod.node:
            continue
        info = nodes.get(pod.node)
        if info is None:
            add(policy.FaultKind.NODE_DELETED, pod.node)
        elif info.down or pod.node in expired:
            add(policy.FaultKind.NODE_DOWN, pod.node)
        elif pod.node in silent:
            add(policy.FaultKind.DAEMON_UNREACHABLE, pod.node)
        else:
            bad = info.unhealthy & pod.cards
            if bad:
                add(policy.FaultKind.CARDS_UNHEALTHY, pod.node, cards=bad)
            if pod.phase == "Failed":
                add(policy.FaultKind.POD_FAILED, pod.node, ranks=[pod.rank])
    if found:  # ranks that already exited 0 cannot reload the step the gang rolls back to
        for pod in live:
            if pod.node and pod.phase == "Succeeded" and pod.node in nodes:
                add(policy.FaultKind.POD_FAILED, pod.node, ranks=[pod.rank])
    return [
        policy.Fault(kind, policy.NodeName(node), frozenset(cards), frozenset(ranks))
        for (kind, node), (ranks, cards) in sorted(found.items())
    ]


def workload_suspended(workload: Workload | None) -> bool:
    return workload is not None and workload.status.get("phase") == "Suspended"


def settled(workload: Workload, faults: list[policy.Fault], state: State) -> bool:
    """Node losses are decided SETTLE_SECONDS after the first shows, so that a rack losing
    power (its nodes going NotReady a few hundred milliseconds apart) is one recovery, not one
    per node; a lost node's silent daemon joins its NodeDown the same way. A failed pod or a
    bad card on a healthy node is decided at once."""
    now = clock.SYSTEM.monotonic()
    first, _ = state.first_seen.setdefault(workload.uid, (now, clock.SYSTEM.now()))
    losses = any(f.kind in policy.NODE_LOSSES for f in faults)
    if losses and now - first < SETTLE_SECONDS:
        return False
    log.info("faults settled", job=workload.key, faults=[f.describe() for f in faults])
    return True


# ---- 2. decide -------------------------------------------------------------------------------


async def start(
    workload: Workload,
    faults: list[policy.Fault],
    world: read_model.World,
    lost: frozenset[str],
    detected: datetime.datetime,
    state: State,
    act: executor.Executor,
) -> None:
    """Decide, write the plan, start carrying it out; ``detected``: when the fault showed."""
    assert isinstance(workload.model, trainingjob.TrainingJob)
    spec = workload.model.spec
    for fault in faults:
        metrics.FAULTS.labels(fault.kind.value).inc()
    facts = [p for p in world.pods.get(workload.key, []) if not p.deleting and p.node]
    topologies = read_model.topologies(world)
    supernode_of = {str(s.name): t.name for t in topologies for s in t.nodes}
    nodes: dict[str, inventory.NodeInfo] = {n.name: n for n in world.nodes}
    view = policy.JobView(
        key=workload.key,
        world_size=read_model.replicas_now(world, workload),
        node_of={p.rank: policy.NodeName(p.node or "") for p in facts},
        cards_of={p.rank: frozenset(p.cards) for p in facts},
        rack_of={
            policy.NodeName(n): nodes[n].labels.get(labels.RACK, n)
            for n in {p.node or "" for p in facts}
            if n in nodes
        },
        supernode_of={policy.NodeName(n): s for n, s in supernode_of.items()},
        levels=tuple(policy.Level(level.value) for level in spec.recovery.levels),
        recoveries=recovery_count(workload.status),
        max_recoveries=spec.recovery.max_recoveries,
    )
    gone = {str(f.node) for f in faults if f.kind in policy.NODE_LOSSES} | set(lost)
    involved = {supernode_of.get(p.node or "") for p in facts}
    endpoints: dict[str, str] = {
        n.name: n.endpoint
        for n in world.nodes
        if n.endpoint and supernode_of.get(n.name) in involved and n.name not in gone
    }
    persistent = spec.checkpoint.persistent.uri if spec.checkpoint.persistent else None
    job = workload.uid
    for busy in (job, "probe"):  # the decision asks the daemons alone, not beside a poll
        await state.tasks.settle(busy, daemons.INVENTORY_TIMEOUT)
    snapshot = engine.Snapshot.build(topologies, read_model.holdings(world))
    for attempt in range(1, DECIDE_ATTEMPTS + 1):
        found = await act.inventory(job, endpoints, persistent)
        state.silent(found.unreachable, clock.SYSTEM.monotonic())
        spares = policy.Spares(
            nodes={
                t.name: tuple(
                    policy.NodeName(n)
                    for n in snapshot.spare_nodes(t.name)
                    if n not in gone and n not in found.unreachable
                )
                for t in topologies
            },
            rack_of={
                policy.NodeName(n.name): n.labels.get(labels.RACK, n.name) for n in world.nodes
            },
        )
        known = (newest_saved(workload, state), found.newest_complete(view.world_size))
        saved = max((s for s in known if s is not None), default=None)
        copies = list(copies_of(found.timeline(), view))
        outcome = policy.decide(
            faults,
            view,
            copies,
            spares,
            newest_saved_step=saved,
            all_answered=not found.unreachable,
        )
        if isinstance(outcome, policy.Failed):
            if outcome.code != "MaxRecoveriesReached" and all(
                f.kind == policy.FaultKind.DAEMON_UNREACHABLE for f in faults
            ):
                # Silent daemons under Ready nodes with Running ranks: the ranks still train
                # (they cannot checkpoint). Failing the job would lose more than waiting.
                act.event(workload.ref, "Warning", "RecoveryDeferred", f"{outcome.reason}; waiting")
                state.deferred[workload.uid] = clock.SYSTEM.monotonic() + DEFER_SECONDS
                log.warning("recovery deferred", job=workload.key, reason=outcome.reason)
                return
            fail(workload, outcome, world, act)
            return
        # The ranks still running go on saving until they reload: pin the chosen step on
        # the daemons holding it, then check it is still there (it may have gone meanwhile).
        if outcome.restored_step is None:  # no checkpoint yet: nothing to pin or check
            pinned = []
            break
        pinned = await act.pin(job, found.holders(outcome.restored_step), outcome.restored_step)
        if await still_held(job, outcome, found, act):
            break
        log.info(
            "restore step gone before it was pinned; deciding again",
            job=workload.key,
            attempt=attempt,
        )
    assert isinstance(outcome, policy.Plan)  # a Failed outcome returned above
    recovery = plan_record(workload, outcome, view, found, detected).with_pinned(pinned)
    world.decisions.recovering[workload.uid] = recovery
    await act.patch_status(
        trainingjob.PLURAL,
        workload.namespace,
        workload.name,
        {"recovering": recovery.wire()},  # the scheduler's status says Recovering (one writer)
    )
    act.event(
        workload.ref,
        "Warning",
        "Recovering",
        f"{outcome.cause}: {outcome.level} — {outcome.reason}; "
        + (
            f"restoring step {outcome.restored_step} (lost steps: {_lost(outcome.lost_steps)})"
            if not outcome.fresh
            else FRESH
        ),
    )
    log.info(
        "recovering",
        job=workload.key,
        level=outcome.level.value,
        cause=outcome.cause,
        ranks=sorted(outcome.ranks)[: trainingjob.RANKS_LISTED],
        rank_count=len(outcome.ranks),
        targets={str(r): n for r, n in outcome.targets.items()},
        restored_step=outcome.restored_step,
        fresh=outcome.fresh,
        lost_steps=outcome.lost_steps,
        recovery=recovery.id,
    )
    if pause := float(os.environ.get(PAUSE_VARIABLE) or 0):
        await asyncio.sleep(pause)  # chaos tests kill the operator here
    facts = world.pods.get(workload.key, [])
    await carry_out(workload, recovery, facts, nodes, lost, world, state, act)


async def still_held(
    job: str, plan: policy.Plan, found: daemons.Inventory, act: executor.Executor
) -> bool:
    """Every daemon copy the plan restores from is still held (after pinning)."""
    wanted = {(c.rank, c.step, c.node) for c in plan.sources.values() if c.node is not None}
    nodes = {str(node) for _, _, node in wanted}
    endpoints = {n: found.endpoints[n] for n in nodes if n in found.endpoints}
    again = await act.inventory(job, endpoints)
    held = {(h.rank, h.step, h.node) for h in again.holdings}
    return wanted <= held


def copies_of(holdings: Iterable[manifest.Holding], view: policy.JobView) -> Iterable[policy.Copy]:
    """The daemons' and tier 3's holdings as the policy's copies."""
    for h in holdings:
        if h.tier == "persistent":
            yield policy.Copy(h.rank, h.step, policy.Tier.PERSISTENT, None)
        elif h.tier == "local":
            yield policy.Copy(h.rank, h.step, policy.Tier.LOCAL, policy.NodeName(h.node))
        else:
            own = view.node_of.get(h.rank) == h.node
            tier = policy.Tier.MEMORY if own else policy.Tier.PEERS
            yield policy.Copy(h.rank, h.step, tier, policy.NodeName(h.node))


def newest_saved(workload: Workload, state: State) -> int | None:
    """The newest step committed before the fault, as status.checkpoints last showed it (the
    daemons that survived may show a newer one: the caller takes the newer)."""
    known = state.checkpoints.get(workload.uid) or workload.status.get("checkpoints") or {}
    steps = [v for v in known.values() if isinstance(v, int)]
    return max(steps, default=None)


def plan_record(
    workload: Workload,
    plan: policy.Plan,
    view: policy.JobView,
    found: daemons.Inventory,
    detected: datetime.datetime,
) -> decisions.RecoveryPlan:
    """status.recovering for ``plan``: everything needed to finish it after a crash."""
    count = recovery_count(workload.status) + 1
    recovery_id = f"r{count}-{uuid.uuid4().hex[:6]}"
    incarnation = found.new_incarnation(clock.SYSTEM.now())
    written_by = found.incarnation_of(plan.restored_step)
    if plan.level == policy.Level.RESCHEDULE:
        targets: dict[str, str] = {}
    else:
        targets = {str(r): plan.targets.get(r, view.node_of[r]) for r in sorted(plan.ranks)}
    by_value: dict[str, list[int]] = {}  # restore annotation -> the ranks that get it
    for rank in range(view.world_size):
        if plan.fresh:  # no checkpoint yet: every rank starts again from step 0, reads nothing
            value = restore_codec.restore_value(
                None, (), recovery_id, incarnation=incarnation, fresh=True
            )
            by_value.setdefault(value, []).append(rank)
            continue
        source = plan.sources[rank]
        if plan.level == policy.Level.RESCHEDULE:
            home = None  # no rank knows its node yet: every source is named
        else:
            home = targets.get(str(rank)) or view.node_of.get(rank)
        held_by = source.node if source.node and source.node != home else None
        endpoint = found.endpoints.get(held_by or "", "")
        value = restore_codec.restore_value(
            plan.restored_step,
            [endpoint] if endpoint else [],
            recovery_id,
            incarnation=incarnation,
            of=written_by,
        )
        by_value.setdefault(value, []).append(rank)
    restore = {trainingjob.format_ranks(ranks): value for value, ranks in by_value.items()}
    record = trainingjob.RecoveryInProgress(
        id=recovery_id,
        level=trainingjob.RecoveryLevel(plan.level.value),
        cause=plan.cause[:1024],
        restored_step=plan.restored_step,
        from_scratch=True if plan.fresh else None,
        lost_steps=plan.lost_steps,
        detected_at=detected,
        ranks=sorted(plan.ranks)[: trainingjob.RANKS_LISTED],
        rank_count=len(plan.ranks),
        moves={view.node_of[r]: n for r, n in plan.targets.items()},
        targets=targets,
        cards={r: labels.format_cards(view.cards_of[int(r)]) for r in targets},
        restore=restore,
    )
    return decisions.RecoveryPlan(record)


# ---- 4. carry out ----------------------------------------------------------------------------


async def carry_out(
    workload: Workload,
    recovery: decisions.RecoveryPlan,
    facts: Sequence[convert.PodFacts],
    nodes: Mapping[str, inventory.NodeInfo],
    lost: frozenset[str],
    world: read_model.World,
    state: State,
    act: executor.Executor,
) -> None:
    """Move the world one step toward the plan; finish when every rank runs again."""
    recovery_id = recovery.id
    targets = recovery.targets
    reschedule = recovery.reschedule
    doomed_now: list[tuple[str, str]] = []  # dead nodes and failed pods: no grace
    doomed: list[tuple[str, str]] = []
    reload: dict[tuple[str, str], str] = {}
    # A node is dead to us when its daemon is unreachable, its Node is down, or its kubelet's
    # Lease went stale (before the controller-manager marks it NotReady): its kubelet would
    # never finish a graceful delete, and the new pods wait until the old ones are gone.
    dead_nodes = set(lost) | set(world.stale)
    for pod in facts:
        on_dead_node = pod.node in dead_nodes or _down(nodes, pod.node)
        if pod.deleting:
            if on_dead_node:  # deleted with grace before it died: now without
                doomed_now.append((pod.namespace, pod.name))
            continue
        mine = _recovery_id(pod.restore) == recovery_id
        moved = str(pod.rank) in targets
        if (reschedule or moved) and not mine:
            dead = pod.phase in convert.TERMINAL_PHASES or on_dead_node
            (doomed_now if dead else doomed).append((pod.namespace, pod.name))
        elif not mine and (value := recovery.restore_for(pod.rank)) is not None:
            reload[(pod.namespace, pod.name)] = value
    if doomed_now:
        await act.delete_pods(doomed_now, grace_seconds=0)
    if doomed:
        await act.delete_pods(doomed)
    by_value: dict[str, list[tuple[str, str]]] = {}
    for key, value in reload.items():
        by_value.setdefault(value, []).append(key)
    await asyncio.gather(  # one batch per distinct value (InPlace: one for every rank)
        *(act.annotate(keys, {labels.RESTORE: value}) for value, keys in by_value.items())
    )
    if doomed_now or doomed or reload:
        return
    assert isinstance(workload.model, trainingjob.TrainingJob)
    ranks = {p.rank: p for p in facts if not p.deleting}
    done = len(ranks) >= read_model.replicas_now(world, workload) and all(
        p.phase == "Running"
        and _recovery_id(p.restore) == recovery_id
        and (str(p.rank) not in targets or p.node == targets[str(p.rank)])
        for p in ranks.values()
    )
    if done:
        await finish(workload, recovery, world, state, act)


async def finish(
    workload: Workload,
    recovery: decisions.RecoveryPlan,
    world: read_model.World,
    state: State,
    act: executor.Executor,
) -> None:
    recovered = clock.SYSTEM.now()
    await act.pin(workload.uid, recovery.pinned, None)
    record = recovery.record(recovered)
    seen = recovery.id in state.recorded
    await act.patch_status(
        trainingjob.PLURAL,
        workload.namespace,
        workload.name,
        recorded(workload.status, record, seen=seen) | {"recovering": None},
    )
    state.recorded.add(recovery.id)
    world.decisions.recovering[workload.uid] = None
    seconds = (recovered - recovery.detected_at).total_seconds()
    level = recovery.level
    metrics.RECOVERIES.labels(level).inc()
    metrics.RECOVERY_SECONDS.labels(level).observe(seconds)
    done = recovery.status
    what = (
        FRESH
        if done.from_scratch
        else f"step {done.restored_step} restored, lost steps {_lost(done.lost_steps)}"
    )
    act.event(
        workload.ref,
        "Normal",
        "Recovered",
        f"{level} recovery {recovery.id} done in {seconds:.1f} s: {what}",
    )
    log.info("recovered", job=workload.key, level=level, seconds=round(seconds, 2))


def fail(
    workload: Workload, failed: policy.Failed, world: read_model.World, act: executor.Executor
) -> None:
    """No recovery: the job fails with the reason, and gives its cards back. The scheduler
    writes it (phase and condition Failed: it owns both) in this pass's status."""
    world.decisions.failed[workload.uid] = (failed.code, failed.reason)
    metrics.RECOVERY_FAILURES.labels(failed.code).inc()
    act.event(workload.ref, "Warning", failed.code, failed.reason)
    log.warning("job failed", job=workload.key, reason=failed.code, message=failed.reason)


def recorded(
    status: Mapping[str, Any], record: Mapping[str, Any], *, seen: bool = False
) -> dict[str, Any]:
    """status.recoveries with ``record`` appended (unless ``seen`` or listed already), trimmed
    to the newest KEPT_RECOVERIES, and status.recoveryCount counting it."""
    history = [dict(r) for r in status.get("recoveries") or []]
    count = recovery_count(status)
    if not seen and all(r.get("id") != record["id"] for r in history):
        history.append(dict(record))
        count += 1
    return {"recoveries": history[-trainingjob.KEPT_RECOVERIES :], "recoveryCount": count}


def recovery_count(status: Mapping[str, Any]) -> int:
    """Recoveries so far: status.recoveryCount (or, for an object written before it existed,
    the length of status.recoveries)."""
    listed = len(status.get("recoveries") or [])
    return max(int(status.get("recoveryCount") or 0), listed)


# ---- status.checkpoints ----------------------------------------------------------------------


def poll_checkpoints(
    workload: Workload,
    facts: Sequence[convert.PodFacts],
    nodes: Mapping[str, inventory.NodeInfo],
    world: read_model.World,
    state: State,
    act: executor.Executor,
) -> None:
    """status.checkpoints from the daemons of the job's nodes, every POLL_SECONDS, in a task
    of its own (never two at once for a job)."""
    assert isinstance(workload.model, trainingjob.TrainingJob)
    now = clock.SYSTEM.monotonic()
    due = now - state.polled_at.get(workload.uid, float("-inf")) >= POLL_SECONDS
    if not due or state.tasks.busy(workload.uid):
        return
    state.polled_at[workload.uid] = now
    endpoints = {
        p.node: nodes[p.node].endpoint
        for p in facts
        if p.node and p.node in nodes and nodes[p.node].endpoint
    }
    if not endpoints:
        return
    spec = workload.model.spec
    persistent = spec.checkpoint.persistent.uri if spec.checkpoint.persistent else None
    size = read_model.replicas_now(world, workload)
    state.tasks.start(workload.uid, _poll(workload, endpoints, persistent, size, state, act))


async def _poll(
    workload: Workload,
    endpoints: Mapping[str, str],
    persistent: str | None,
    world_size: int,
    state: State,
    act: executor.Executor,
) -> None:
    found = await act.inventory(workload.uid, dict(endpoints), persistent)
    committed = found.committed(world_size)
    known = state.checkpoints.get(workload.uid) or workload.status.get("checkpoints") or {}
    merged = {t: _kept(committed.get(t), known.get(t)) for t in ("memory", "local", "persistent")}
    if merged != {t: known.get(t) for t in merged}:
        state.checkpoints[workload.uid] = merged
        await act.patch_status(
            trainingjob.PLURAL, workload.namespace, workload.name, {"checkpoints": merged}
        )


def _kept(found: int | None, known: Any) -> int | None:
    """A tier the daemons no longer report (one restarted, empty) keeps its last step; a
    recovery's roll-back shows as the step going down, which is what happened."""
    if found is None:
        return known if isinstance(known, int) else None
    return found


# ---- helpers ---------------------------------------------------------------------------------


def _recovery_id(value: str) -> str:
    return restore_codec.restore_id(value)


def _down(nodes: Mapping[str, inventory.NodeInfo], node: str | None) -> bool:
    return node is not None and (node not in nodes or nodes[node].down)


def _lost(steps: Any) -> str:
    return "unknown" if steps is None else str(steps)
