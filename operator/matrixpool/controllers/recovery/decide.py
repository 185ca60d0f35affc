"""Steps 2 and 3 of a recovery, **decide** and **write the plan first** (:func:`start`, called
by :func:`.controller.step` once a job's faults settled):

2. Ask the daemons of the job's supernodes (and the tier-3 URI) which copies survive
   (:mod:`matrixpool.k8s.daemonclient`), find the free spares, call
   :func:`matrixpool_recovery.policy.decide`; pin the chosen step on the daemons holding it and
   check it is still held, deciding again (up to :data:`DECIDE_ATTEMPTS` times) if it went.
3. Write ``status.recovering`` (level, targets, cards, what each rank restores; a job with no
   checkpoint yet: start fresh from step 0) and the read model's decisions
   (:class:`matrixpool.state.decisions.RecoveryPlan`, :func:`plan_record`), before any pod is
   touched; then start carrying it out (:mod:`.carry_out`). An operator killed from here on is
   followed by one that reads the plan back and finishes it, once.

No level possible: the job fails (:func:`.carry_out.fail`), but for daemons that are only
silent under Ready nodes, deferred :data:`DEFER_SECONDS`.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence

import structlog

from matrixpool import clock, metrics
from matrixpool.api import labels, trainingjob
from matrixpool.controllers.recovery import carry_out, memory
from matrixpool.k8s import daemonclient, executor
from matrixpool.placement import engine, inventory
from matrixpool.state import decisions
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool_recovery import manifest, policy
from matrixpool_recovery import restore as restore_codec

log = structlog.get_logger(__name__)

DECIDE_ATTEMPTS = 3  # decisions whose step vanished before it was pinned are taken again
DEFER_SECONDS = 10.0  # a deferred recovery (silent daemons only) is tried again after this
PAUSE_VARIABLE = "MATRIXPOOL_RECOVERY_PAUSE_SECONDS"  # test knob: stop after writing the plan


async def start(
    workload: Workload,
    faults: list[policy.Fault],
    world: read_model.World,
    lost: frozenset[str],
    detected: datetime.datetime,
    state: memory.State,
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
        recoveries=carry_out.recovery_count(workload.status),
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
        await state.tasks.settle(busy, daemonclient.INVENTORY_TIMEOUT)
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
            carry_out.fail(workload, outcome, world, act)
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
    world.decisions.plan_recovery(workload.uid, recovery)
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
            f"restoring step {outcome.restored_step} "
            f"(lost steps: {carry_out.describe_lost(outcome.lost_steps)})"
            if not outcome.fresh
            else carry_out.FRESH
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
    await carry_out.carry_out(workload, recovery, facts, nodes, lost, world, state, act)


async def still_held(
    job: str, plan: policy.Plan, found: daemonclient.Inventory, act: executor.Executor
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


def newest_saved(workload: Workload, state: memory.State) -> int | None:
    """The newest step committed before the fault, as status.checkpoints last showed it (the
    daemons that survived may show a newer one: the caller takes the newer)."""
    known = state.checkpoints.get(workload.uid) or workload.status.get("checkpoints") or {}
    steps = [v for v in known.values() if isinstance(v, int)]
    return max(steps, default=None)


def restarts_gang(workload: Workload) -> bool:
    """Whether a recovery of ``workload`` replaces every rank's pod (spec.recovery.restart)."""
    model = workload.model
    return (
        isinstance(model, trainingjob.TrainingJob)
        and model.spec.recovery.restart == trainingjob.Restart.GANG
    )


HOLDERS_NAMED = 32  # daemons every restore names beside a rank's own: more, and rank 0's only


def shared_holders(plan: policy.Plan, endpoints: Mapping[str, str]) -> list[tuple[str, str]]:
    """(node, endpoint) of the daemons holding the chosen copies every rank is told about: all
    of them while they are few (a reader may need other ranks' shards: DCP keeps a replicated
    tensor once, in some rank's shard), else the holder of rank 0's (DCP's Metadata, which
    every rank reads), so that an annotation stays small at any scale."""
    held: dict[str, str] = {}
    for rank in sorted(plan.sources):
        node = plan.sources[rank].node
        if node and node not in held and endpoints.get(node):
            held[node] = endpoints[node]
    if len(held) <= HOLDERS_NAMED:
        return list(held.items())
    first = plan.sources.get(0)
    node = first.node if first is not None else None
    return [(node, held[node])] if node and node in held else []


def restore_sources(
    plan: policy.Plan,
    rank: int,
    home: str | None,
    endpoints: Mapping[str, str],
    shared: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """The daemons a rank's restore annotation names: the one holding its own chosen copy,
    then the ``shared`` ones (:func:`shared_holders`), none on ``home`` (the node it restarts
    on, whose daemon it asks anyway)."""
    own = plan.sources[rank].node
    named = [(own, endpoints.get(own, "")) if own else ("", ""), *shared]
    return list(dict.fromkeys(e for n, e in named if e and n != home))


def plan_record(
    workload: Workload,
    plan: policy.Plan,
    view: policy.JobView,
    found: daemonclient.Inventory,
    detected: datetime.datetime,
) -> decisions.RecoveryPlan:
    """status.recovering for ``plan``: everything needed to finish it after a crash."""
    count = carry_out.recovery_count(workload.status) + 1
    recovery_id = f"r{count}-{uuid.uuid4().hex[:6]}"
    incarnation = found.new_incarnation(clock.SYSTEM.now())
    written_by = found.incarnation_of(plan.restored_step)
    if plan.level == policy.Level.RESCHEDULE:
        targets: dict[str, str] = {}
    else:
        targets = {str(r): plan.targets.get(r, view.node_of[r]) for r in sorted(plan.ranks)}
        if restarts_gang(workload):  # every rank's pod replaced, the others where they are
            targets |= {str(r): n for r, n in view.node_of.items() if str(r) not in targets}
            targets = dict(sorted(targets.items(), key=lambda item: int(item[0])))
    by_value: dict[str, list[int]] = {}  # restore annotation -> the ranks that get it
    shared = [] if plan.fresh else shared_holders(plan, found.endpoints)
    for rank in range(view.world_size):
        if plan.fresh:  # no checkpoint yet: every rank starts again from step 0, reads nothing
            value = restore_codec.restore_value(
                None, (), recovery_id, incarnation=incarnation, fresh=True
            )
            by_value.setdefault(value, []).append(rank)
            continue
        if plan.level == policy.Level.RESCHEDULE:
            home = None  # no rank knows its node yet: every source is named
        else:
            home = targets.get(str(rank)) or view.node_of.get(rank)
        value = restore_codec.restore_value(
            plan.restored_step,
            restore_sources(plan, rank, home, found.endpoints, shared),
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
