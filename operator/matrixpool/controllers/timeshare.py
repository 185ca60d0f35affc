"""Time-sharing transitions: every scheduling cycle, per SuperNode with ``spec.timeSharing``, the
window in force (scaled clock), its target split, and the allowances the scheduler obeys.

Called by the main loop (:mod:`matrixpool.controllers.loop`) before the scheduling cycle:
:func:`share` returns the :class:`~matrixpool.state.decisions.Shares` (InferenceService role
replicas, TrainingJob replicas, 0 = suspended) that the loop puts in the read model, where the
scheduler (``Cycle.gangs_of``) and recovery (``world.replicas_now``) read them instead of the
specs. Reconciling pods to those gangs is the scheduler's job; this module only decides and
keeps the handshake with training. The pure rules are in :mod:`matrixpool.timeshare.transition`.

Which workloads a SuperNode shares (rule): a workload whose ``spec.superNode`` names a SuperNode
belongs to it; one without belongs to the SuperNode its pods are bound to (the first by name if
they span several), and an unplaced one to the first SuperNode (by name) that has time-sharing.
A workload that belongs to a SuperNode without time-sharing is left alone.

Transition handshake (crash-safe: the state is in the TrainingJob's ``status.timeSharing`` and
the pods' annotations; this process only caches it):
1. A job that must give up running pods (shrink or suspend) gets a checkpoint request: every one
   of its pods is annotated ``matrixpool.dev/checkpoint-request: <id>`` (a data-parallel
   checkpoint is only consistent when every rank saves the same step), and
   ``status.timeSharing.checkpointRequest`` records the id, the real time of the request and the
   newest step committed for every rank then (the baseline).
2. Every cycle the daemons of the job's nodes are asked (at most every :data:`CHECK_SECONDS`,
   in a task of its own that leaves the answer for the next cycle) whether a newer step is
   committed for every rank; once it is, or ``checkpointGraceSeconds``
   (real seconds, :data:`clock.SYSTEM`) have passed, the allowance drops and the scheduler deletes
   the pods above it. A suspension is recorded in ``status.timeSharing.suspensions`` with the
   step to resume from, whether the job answered in time and, when it did not, the steps lost.
3. Nobody grows until nothing is above its target and no pod of the SuperNode terminates, so
   inference scales up only onto cards the evicted pods have left (the placement engine counts
   terminating pods' cards as held, too: no card is ever held by two pods).
4. A suspended job that gets cards again has its new pods annotated, before they are bound,
   ``matrixpool.dev/restore`` = the newest step committed for every rank (the inventory over the
   SuperNode's daemons and the persistent URI; else the recorded step) with the daemons that
   hold it; once every pod is bound the suspension is closed with the restored step.

Each transition (a new target split) is timed from its window boundary to the new split in
place, the time split into checkpoint, eviction and placement; SuperNode ``status.transition``,
an Event at the start and at the end, and Prometheus metrics report it.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import structlog

from matrixpool import clock, metrics
from matrixpool.api import common, inferenceservice, labels, supernode, trainingjob
from matrixpool.controllers import background
from matrixpool.k8s import convert, daemonclient, executor
from matrixpool.placement import gangs, inventory
from matrixpool.state import decisions as decided
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool.state.world import World
from matrixpool.timeshare import split, transition, windows
from matrixpool_recovery import restore as restore_codec

log = structlog.get_logger(__name__)

CHECK_SECONDS = 0.5  # at most one inventory query per job this often while it is asked
SUSPENSIONS_KEPT = 20  # status.timeSharing.suspensions keeps the latest ones
BACKDATE_SECONDS = 5.0  # a boundary seen later than this (operator down) is not backdated


@dataclass
class Memory:
    """What this process caches between cycles, jobs by UID (all of it can be lost safely).
    Owned by the main loop."""

    status: dict[str, dict[str, Any]] = field(default_factory=dict)  # job → status.timeSharing
    checked: dict[str, tuple[float, int | None]] = field(default_factory=dict)  # job → last ask
    restores: dict[str, tuple[str, str, int | None]] = field(default_factory=dict)  # job →
    # (request id, restore annotation, step) of the open suspension
    timelines: dict[str, transition.Timeline] = field(default_factory=dict)  # supernode →
    targets: dict[str, tuple[object, ...]] = field(default_factory=dict)  # supernode → signature
    transitions: dict[str, dict[str, Any]] = field(default_factory=dict)  # supernode → status
    annotated: set[tuple[str, str]] = field(default_factory=set)  # (pod, restore) written
    tasks: background.Tasks = field(default_factory=background.Tasks)  # answers asked, by job

    def forget(self, uid: str, key: str) -> None:
        """Drop what is remembered of the workload ``uid`` (named ``key``): it went, or its
        name now belongs to another object."""
        for remembered in (self.status, self.checked, self.restores):
            remembered.pop(uid, None)
        self.tasks.cancel(uid)
        self.annotated = {(pod, value) for pod, value in self.annotated if not _of(pod, key)}

    def transition_status(self, name: str) -> dict[str, Any] | None:
        """SuperNode status.transition (wire form) as this process follows it, or None."""
        return self.transitions.get(name, {}).get("status")


async def share(world: World, memory: Memory, act: executor.Executor) -> decided.Shares:
    """The allowances of this cycle; carries out the handshakes on the way (through
    ``act``)."""
    shares = decided.Shares()
    shared = sorted(n for n, sn in world.supernodes.items() if sn.spec.time_sharing is not None)
    if not shared:
        return shares
    topologies = read_model.topologies(world)
    supernode_of = {str(n.name): t.name for t in topologies for n in t.nodes}
    sizes = {t.name: max((n.cards for n in t.nodes), default=0) for t in topologies}
    owners = attach(world.workloads, world.pods, supernode_of, shared)
    for name in shared:
        members = [  # a finished job holds nothing and wants nothing
            w
            for w in world.workloads
            if owners.get(w.key) == name and w.model and not read_model.succeeded(world, w)
        ]
        try:
            await Sharing(world, name, members, sizes.get(name, 0), memory, act).run(shares)
        except windows.UnknownTimezoneError as error:
            log.warning("time-sharing skipped", supernode=name, error=str(error))
    return shares


def attach(
    workloads: Sequence[Workload],
    pods_of: Mapping[str, Sequence[convert.PodFacts]],
    supernode_of: Mapping[str, str],
    shared: Sequence[str],
) -> dict[str, str]:
    """Workload key → the time-shared SuperNode it belongs to (the module's rule)."""
    owners: dict[str, str] = {}
    for workload in workloads:
        if workload.model is None:
            continue
        named: str | None = workload.model.spec.super_node
        if not named:
            held = sorted(
                {
                    supernode_of[node]
                    for p in pods_of.get(workload.key, [])
                    if (node := p.node or p.reserved_node) and node in supernode_of
                }
            )
            named = held[0] if held else (shared[0] if shared else None)
        if named is not None and named in shared:
            owners[workload.key] = named
    return owners


class Sharing:
    """One time-shared SuperNode in one cycle."""

    def __init__(
        self,
        world: World,
        name: str,
        members: list[Workload],
        node_size: int,
        memory: Memory,
        act: executor.Executor,
    ) -> None:
        self.world = world
        self.act = act
        self.memory = memory
        self.name = name
        self.sn = world.supernodes[name]
        self.sharing = cast(supernode.TimeSharing, self.sn.spec.time_sharing)
        self.members = members
        self.node_size = node_size
        self.nodes = inventory.members(
            inventory.Selector.from_spec(common.to_wire(self.sn.spec.node_selector)), world.nodes
        )
        self.now = clock.operator().now()
        self.real = clock.SYSTEM.now()
        self.window = windows.window_at(self.sharing, self.now)

    # ---- the cycle -----------------------------------------------------------------------------

    async def run(self, shares: decided.Shares) -> None:
        target = split.target_split(self.pool_cards(), self.window, *self.demands())
        jobs = {w.key: w for w in self.members if w.kind == trainingjob.KIND}
        released: set[str] = set()
        for key in sorted(self.running_above(target)):
            if await self.handshake(jobs[key], target):
                released.add(key)
        current = self.current(target)
        allowed = transition.stage(target, current, {split.WorkloadKey(k) for k in released})
        for key in released:
            await self.evicted(jobs[key], target, allowed.training[split.WorkloadKey(key)])
        for key, job in jobs.items():
            await self.settle_request(job, current)
            if await self.resume(job, allowed.training[split.WorkloadKey(key)]):
                shares.resuming.add(key)
        shares.inference.update({k: dict(r) for k, r in allowed.inference.items()})
        shares.training.update({str(k): v for k, v in allowed.training.items()})
        for key in jobs:
            if key in allowed.checkpointing:
                shares.phases[key] = trainingjob.Phase.CHECKPOINTING
            elif allowed.training[split.WorkloadKey(key)] == 0:
                shares.phases[key] = trainingjob.Phase.SUSPENDED
        self.follow(target, current, allowed)

    # ---- what the policy needs ------------------------------------------------------------

    def pool_cards(self) -> int:
        """Cards placement may use: allocatable (healthy, ready, not spare) minus what pods
        matrixpool did not place hold there."""
        held: dict[str, int] = {}
        resource = self.sn.spec.card_resource
        for facts in self.world.pods.values():
            for p in facts:
                if p.holds_cards:
                    node = p.node or p.reserved_node or ""
                    held[node] = held.get(node, 0) + len(p.cards)
        foreign = {n.name: self.world.foreign.get(n.name, {}).get(resource, 0) for n in self.nodes}
        allocated = {inventory.NodeName(n): held.get(n, 0) + foreign.get(n, 0) for n in foreign}
        summary = inventory.summarize(self.nodes, resource, allocated, self.sn.spec.spares.nodes)
        spares = set(summary.spare_nodes)
        taken = sum(count for n, count in foreign.items() if n not in spares)
        return max(0, summary.cards_allocatable - taken)

    def demands(self) -> tuple[list[split.InferenceDemand], list[split.TrainingDemand]]:
        services, jobs = [], []
        for w in self.members:
            if isinstance(w.model, inferenceservice.InferenceService):
                services.append(split.demand_of_service(w.namespace, w.name, w.served_spec()))
            elif isinstance(w.model, trainingjob.TrainingJob):
                jobs.append(split.demand_of_job(w.namespace, w.name, w.model.spec))
        return services, jobs

    def live(self, key: str) -> list[convert.PodFacts]:
        return [p for p in self.world.pods.get(key, []) if not p.deleting]

    def per_replica(self, job: Workload) -> int:
        assert isinstance(job.model, trainingjob.TrainingJob)
        return gangs.pods_per_replica(job.model.spec.cards_per_replica, self.node_size or None)[0]

    def running_above(self, target: split.Split) -> set[str]:
        """Jobs with bound (or reserved) pods above their target."""
        found = set()
        for w in self.members:
            if w.kind != trainingjob.KIND:
                continue
            floor = target.training.get(split.WorkloadKey(w.key), 0) * self.per_replica(w)
            if any(p.rank >= floor and (p.node or p.reserved_node) for p in self.live(w.key)):
                found.add(w.key)
        return found

    def current(self, target: split.Split) -> transition.Current:
        inference: dict[split.WorkloadKey, dict[str, int]] = {}
        training: dict[split.WorkloadKey, int] = {}
        for w in self.members:
            key = split.WorkloadKey(w.key)
            live = self.live(w.key)
            if w.kind == trainingjob.KIND:
                training[key] = math.ceil(read_model.pods_held(self.world, w) / self.per_replica(w))
            else:
                roles: dict[str, set[int]] = {}
                for p in live:
                    roles.setdefault(p.role, set()).add(p.replica)
                inference[key] = {role: len(replicas) for role, replicas in roles.items()}
        mine = {n.name for n in self.nodes}
        keys = {w.key for w in self.members}
        terminating = any(
            p.deleting and (owner in keys or (p.node or "") in mine)
            for owner, facts in self.world.pods.items()
            for p in facts
        )
        return transition.Current(
            inference,
            training,
            frozenset(map(split.WorkloadKey, self.running_above(target))),
            terminating,
        )

    # ---- the handshake -----------------------------------------------------------------------

    def status_of(self, job: Workload) -> dict[str, Any]:
        """status.timeSharing as this process last wrote it, else as the index shows it."""
        if job.uid not in self.memory.status:
            self.memory.status[job.uid] = dict(job.status.get("timeSharing") or {})
        return self.memory.status[job.uid]

    async def write(self, job: Workload, value: dict[str, Any]) -> None:
        self.memory.status[job.uid] = value
        wire = {**value, "checkpointRequest": value.get("checkpointRequest")}
        await self.act.patch_status(
            trainingjob.PLURAL, job.namespace, job.name, {"timeSharing": wire}
        )

    def endpoints(self, nodes: set[str] | None = None) -> dict[str, str]:
        return {
            n.name: n.endpoint
            for n in self.nodes
            if n.endpoint and (nodes is None or n.name in nodes)
        }

    async def committed(
        self, job: Workload, world_size: int, nodes: set[str] | None = None, *, whole: bool = False
    ) -> tuple[int | None, daemonclient.Inventory]:
        """Newest step committed for every rank on any tier, and the inventory it came from.

        ``whole``: every daemon of the SuperNode and the persistent URI (for a resume); else
        the daemons of ``nodes``."""
        assert isinstance(job.model, trainingjob.TrainingJob)
        persistent = job.model.spec.checkpoint.persistent
        found = await self.act.inventory(
            job.uid,
            self.endpoints(None if whole else nodes),
            persistent.uri if whole and persistent else None,
        )
        return (found.newest_complete(world_size) if world_size else None), found

    async def handshake(self, job: Workload, target: split.Split) -> bool:
        """Rule 1-2 of the module: ask, then watch; True once the job may give up its pods."""
        assert isinstance(job.model, trainingjob.TrainingJob)
        live = self.live(job.key)
        nodes = {n for p in live if (n := p.node or p.reserved_node)}
        state = self.status_of(job)
        request = state.get("checkpointRequest")
        keep = target.training.get(split.WorkloadKey(job.key), 0)
        if not request:
            baseline, _ = await self.committed(job, len(live), nodes)
            request = common.to_wire(
                trainingjob.CheckpointRequest(
                    id=f"ts-{uuid.uuid4().hex[:10]}",
                    requested_at=self.real,
                    baseline_step=baseline,
                    replicas=keep,
                    window=self.window.name,
                )
            )
            await self.act.annotate(
                [(p.namespace, p.name) for p in live], {labels.CHECKPOINT_REQUEST: request["id"]}
            )
            await self.write(job, {**state, "checkpointRequest": request})
            self.memory.checked.pop(job.uid, None)
            metrics.TIMESHARE_CHECKPOINTS.labels("asked").inc()
            self.act.event(
                job.ref,
                "Normal",
                "CheckpointRequested",
                f"window {self.window.name}: checkpoint asked before going from "
                f"{len(live)} pods to {keep * self.per_replica(job)} (request {request['id']}, "
                f"grace {self.sharing.checkpoint_grace_seconds} s)",
            )
            log.info("checkpoint requested", job=job.key, request=request["id"], keep=keep)
            return False
        asked = trainingjob.CheckpointRequest.model_validate(request)
        last, step = self.memory.checked.get(job.uid, (-math.inf, None))
        monotonic = clock.SYSTEM.monotonic()
        if monotonic - last >= CHECK_SECONDS:
            self.memory.tasks.start(job.uid, self.check(job, len(live), nodes, monotonic, step))
        return transition.released(
            asked.baseline_step,
            step,
            asked.requested_at,
            self.sharing.checkpoint_grace_seconds,
            self.real,
        )

    async def check(
        self, job: Workload, world_size: int, nodes: set[str], at: float, known: int | None
    ) -> None:
        """Ask the daemons whether the job answered (in a task of its own: the answer is
        read by the next cycle, :mod:`matrixpool.controllers.background`)."""
        self.memory.checked[job.uid] = (at, known)  # asked: not again before CHECK_SECONDS
        step, _ = await self.committed(job, world_size, nodes)
        self.memory.checked[job.uid] = (at, step)

    async def evicted(self, job: Workload, target: split.Split, allowance: int) -> None:
        """The job gives up its pods this cycle: record a suspension (once per request)."""
        state = self.status_of(job)
        request = state.get("checkpointRequest")
        if not request or request.get("evictedAt"):
            return
        asked = trainingjob.CheckpointRequest.model_validate(request)
        live = self.live(job.key)
        step, found = await self.committed(job, len(live), whole=True)
        answered = transition.answered(asked.baseline_step, step)
        waited = max(0.0, (self.real - asked.requested_at).total_seconds())
        metrics.TIMESHARE_CHECKPOINTS.labels("answered" if answered else "expired").inc()
        suspensions = list(state.get("suspensions") or [])
        if allowance == 0:
            reached = max((h.step for h in found.holdings), default=None)
            reason = target.reasons.get(split.WorkloadKey(job.key))
            record = trainingjob.Suspension(
                request_id=asked.id,
                window=self.window.name,
                reason=reason.value if reason else "",
                suspended_at=self.real,
                world_size=len(live),
                step=step,
                answered=answered,
                checkpoint_seconds=round(waited, 3),
                lost_steps=None if answered else transition.lost_steps(step, reached),
            )
            suspensions = [*suspensions, common.to_wire(record)][-SUSPENSIONS_KEPT:]
        await self.write(
            job,
            {
                **state,
                "checkpointRequest": common.to_wire(
                    asked.model_copy(update={"evicted_at": self.real})
                ),
                "suspensions": suspensions,
            },
        )
        verb = "suspended" if allowance == 0 else f"shrunk to {allowance} replicas"
        how = "answered" if answered else "did not answer"
        self.act.event(
            job.ref,
            "Normal" if answered else "Warning",
            "Suspended" if allowance == 0 else "Shrunk",
            f"window {self.window.name}: {verb}; the checkpoint request {how} in {waited:.1f} s "
            f"(step {step})",
        )
        log.info("evicting", job=job.key, allowance=allowance, answered=answered, step=step)

    async def settle_request(self, job: Workload, current: transition.Current) -> None:
        """Forget a request once no pod runs above what the job keeps (or the window moved
        back before the pods went)."""
        state = self.status_of(job)
        request = state.get("checkpointRequest")
        if request and split.WorkloadKey(job.key) not in current.running_above:
            await self.write(job, {**state, "checkpointRequest": None})

    # ---- the resume ----------------------------------------------------------------------------

    async def resume(self, job: Workload, allowance: int) -> bool:
        """Rule 4: tell the new pods of a suspended job what to restore; close the suspension
        once every pod is bound. Whether the job is resuming (its suspension still open)."""
        state = self.status_of(job)
        suspensions = list(state.get("suspensions") or [])
        if allowance == 0 or not suspensions or suspensions[-1].get("resumedAt"):
            return False
        record = trainingjob.Suspension.model_validate(suspensions[-1])
        live = self.live(job.key)
        if not live:
            return True
        cached = self.memory.restores.get(job.uid)
        per = self.per_replica(job)
        if cached is None or cached[0] != record.request_id:
            step, found = await self.committed(job, record.world_size, whole=True)
            if step is None:  # none on the daemons: the suspension's step, else tier 3's
                step = record.step if record.step is not None else _tier_step(job)
            sources = found.holders(step) if step is not None else []
            moved = record.world_size not in (0, allowance * per)  # resumes at another size
            value = restore_codec.restore_value(
                step,
                sources,
                f"resume-{record.request_id}",
                incarnation=found.new_incarnation(clock.SYSTEM.now()),
                of=found.incarnation_of(step),
                world=record.world_size if moved else None,  # rank r reads shard r % world
            )
            cached = (record.request_id, value, step)
            self.memory.restores[job.uid] = cached
        _, value, step = cached
        if step is None:
            value = ""  # nothing was ever committed: a fresh start
        unbound = [p for p in live if not p.node and (p.key, value) not in self.memory.annotated]
        if value and unbound:
            await self.act.annotate(
                [(p.namespace, p.name) for p in unbound], {labels.RESTORE: value}
            )
            self.memory.annotated.update((p.key, value) for p in unbound)
        if len(live) == allowance * per and all(p.node for p in live):
            done = record.model_copy(update={"resumed_at": self.real, "restored_step": step})
            suspensions[-1] = common.to_wire(done)
            await self.write(job, {**state, "suspensions": suspensions})
            self.memory.restores.pop(job.uid, None)
            self.memory.annotated = {a for a in self.memory.annotated if a[1] != value}
            self.act.event(
                job.ref,
                "Normal",
                "Resumed",
                f"window {self.window.name}: resumed on {len(live)} pods from step {step} "
                f"(suspended at step {record.step})",
            )
            log.info("resumed", job=job.key, step=step, suspended_step=record.step)
            return False
        return True

    # ---- the transition's timeline -------------------------------------------------------

    def cards(self, current: transition.Current) -> tuple[int, int]:
        inference = training = 0
        for w in self.members:
            held = sum(len(p.cards) for p in self.live(w.key) if p.node)
            if w.kind == trainingjob.KIND:
                training += held
            else:
                inference += held
        return inference, training

    def follow(
        self, target: split.Split, current: transition.Current, allowed: transition.Allowances
    ) -> None:
        monotonic = clock.SYSTEM.monotonic()
        signature = transition.signature(target)
        timeline = self.memory.timelines.get(self.name)
        if self.memory.targets.get(self.name) != signature or timeline is None:
            lag = self.boundary_lag(timeline)
            timeline = transition.Timeline(
                window=target.window,
                started=monotonic - lag,
                from_cards=self.cards(current),
                to_cards=(target.inference_cards, target.training_cards),
            )
            self.memory.targets[self.name] = signature
            self.memory.transitions[self.name] = {
                "startedAt": self.real - dt.timedelta(seconds=lag)
            }
            self.announce(timeline, "TransitionStarted")
        bound = {
            split.WorkloadKey(w.key): all(p.node for p in self.live(w.key)) for w in self.members
        }
        settled = transition.in_place(target, current, bound)
        was = timeline.settled
        timeline = timeline.observe(monotonic, allowed, settled, asked=bool(allowed.checkpointing))
        self.memory.timelines[self.name] = timeline
        started = self.memory.transitions[self.name]["startedAt"]
        record = supernode.Transition(
            window=timeline.window,
            started_at=started,
            settled_at=None
            if timeline.seconds is None
            else started + dt.timedelta(seconds=timeline.seconds),
            inference_cards=timeline.to_cards[0],
            training_cards=timeline.to_cards[1],
            seconds=_round(timeline.seconds),
            checkpoint_seconds=_round(timeline.checkpoint_seconds),
            eviction_seconds=_round(timeline.eviction_seconds),
            placement_seconds=_round(timeline.placement_seconds),
        )
        self.memory.transitions[self.name] = {
            "startedAt": started,
            "status": common.to_wire(record),
        }
        if was is None and timeline.settled is not None:
            self.announce(timeline, "TransitionDone")
            metrics.TIMESHARE_TRANSITIONS.labels(self.name, str(timeline.window)).inc()
            for phase, seconds in (
                ("total", timeline.seconds),
                ("checkpoint", timeline.checkpoint_seconds),
                ("eviction", timeline.eviction_seconds),
                ("placement", timeline.placement_seconds),
            ):
                if seconds is not None:
                    metrics.TIMESHARE_TRANSITION_SECONDS.labels(self.name, phase).observe(seconds)

    def boundary_lag(self, previous: transition.Timeline | None) -> float:
        """Real seconds since the boundary that started the new window (0 when the window did
        not change, or when it changed long ago: the operator was not running)."""
        if previous is not None and previous.window == self.window.name:
            return 0.0
        passed = windows.boundaries(self.sharing, self.now - dt.timedelta(days=1), self.now)
        if not passed:
            return 0.0
        scaled = (self.now - passed[-1].at).total_seconds()
        lag = clock.real_seconds(clock.operator(), scaled)
        return lag if 0 <= lag <= BACKDATE_SECONDS else 0.0

    def announce(self, timeline: transition.Timeline, reason: str) -> None:
        (inf_from, train_from), (inf_to, train_to) = timeline.from_cards, timeline.to_cards
        message = (
            f"window {timeline.window}: inference {inf_from} → {inf_to} cards, "
            f"training {train_from} → {train_to} cards"
        )
        if timeline.seconds is not None:
            message += (
                f", in place {timeline.seconds:.2f} s after the boundary (checkpoint "
                f"{timeline.checkpoint_seconds or 0:.2f} s, eviction "
                f"{timeline.eviction_seconds or 0:.2f} s, placement "
                f"{timeline.placement_seconds or 0:.2f} s)"
            )
        ref = {
            "apiVersion": self.sn.api_version,
            "kind": self.sn.kind,
            "metadata": {"name": self.name, "uid": self.sn.metadata.uid},
        }
        self.act.event(ref, "Normal", reason, message)
        log.info(reason, supernode=self.name, message=message)


def _of(pod_key: str, workload_key: str) -> bool:
    """Whether a pod ("ns/name") is one of the workload's ("ns/name-..." by construction)."""
    return pod_key.startswith(workload_key + "-")


def _tier_step(job: Workload) -> int | None:
    """The newest step status.checkpoints reports on any tier (the fallback)."""
    steps = [s for s in (job.status.get("checkpoints") or {}).values() if isinstance(s, int)]
    return max(steps, default=None)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
