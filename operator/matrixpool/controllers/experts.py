"""The experts controller: the expert map of each expert-parallel role follows the load its
experts take (docs/concepts.md, "Experts follow their load"), written as ``status.experts``.

Each pass of the main loop (:mod:`matrixpool.controllers.loop`), for every InferenceService
with a role that has ``expertParallel``:

1. every :data:`PERIOD_SECONDS`, read the ``/metrics`` of the ready pods of those roles
   (``podIP:spec.autoscaling.metricsPort``, else :data:`SERVE_PORT`) in a task of its own
   (:mod:`matrixpool.controllers.background`): a slow pod delays its own service, never the loop;
2. once a reading is back: each role's load, the growth of every expert's token counter
   (:data:`matrixpool.serving.experts.EXPERT_TOKENS`) since the reading before, summed over
   the role's pods (all its instances share one layout; a counter that went down counts from
   0); then what the layout in force does to it and what a balanced plan
   (:func:`matrixpool.placement.eplb.plan`) would, and whether that is worth a re-plan
   (:func:`judge`: enough tokens, and :func:`matrixpool.placement.eplb.worth_replanning`);
3. write ``status.experts`` (the period's tokens, imbalance and hottest experts; at a re-plan
   the new layout with the imbalance before and after) and an Event ``ExpertsRebalanced``.
   The scheduling cycle then writes the expert-map ConfigMap in that layout
   (:func:`matrixpool.controllers.scheduling.status.write_expert_map`); the kubelet refreshes
   the mounted file and the engines follow it, with no pod restarted.

What is in force is what this controller last wrote, else ``status.experts`` (an operator that
restarts carries on from it), else the first layout
(:func:`matrixpool.placement.eplb.default_layout`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import structlog

from matrixpool import clock
from matrixpool.api import common, inferenceservice
from matrixpool.controllers import background
from matrixpool.k8s import executor
from matrixpool.placement import eplb
from matrixpool.serving import experts as expert_metrics
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload

log = structlog.get_logger(__name__)

PERIOD_SECONDS = 60.0  # the load of one period drives a re-plan
# Test knob: another period, in seconds (the integration test's load is short).
PERIOD_VARIABLE = "MATRIXPOOL_EXPERTS_PERIOD_SECONDS"
SCRAPE_TIMEOUT_SECONDS = 2.0  # a pod's /metrics that takes longer counts for nothing
SERVE_PORT = 8000  # where the pods serve /metrics without spec.autoscaling (the server's default)
MIN_TOKENS_PER_SLOT = 16  # a period with fewer routed tokens per card is too little to re-plan on
HOTTEST = 8  # experts listed in status.experts[].hottest


@dataclass(frozen=True)
class Counted:
    """One pod's expert counters at a reading."""

    role: str
    tokens: Mapping[int, float]  # expert → its counter


@dataclass(frozen=True)
class Judgement:
    """What one role's load of a period says: the map in force, the plan, and whether to
    re-plan."""

    role: str
    load: tuple[float, ...]  # expert → tokens routed to it over the period
    current: eplb.Plan  # the layout in force, under that load
    planned: eplb.Plan  # the balanced plan for that load
    replan: bool


@dataclass
class Service:
    """What the controller keeps of one service between passes (by UID)."""

    last: dict[str, Counted] = field(default_factory=dict)  # pod UID → its last reading
    fresh: dict[str, Counted] | None = None  # the reading just back, not used yet
    next_at: float = 0.0  # monotonic time of the next reading
    written: dict[str, inferenceservice.ExpertsStatus] = field(default_factory=dict)  # by role


@dataclass
class Memory:
    """Per service UID; owned by the main loop. Losing it costs one period."""

    services: dict[str, Service] = field(default_factory=dict)
    tasks: background.Tasks = field(default_factory=background.Tasks)

    def forget(self, uid: str, key: str) -> None:
        """Drop what is remembered of the service ``uid`` (kept by UID only, not by ``key``)."""
        self.services.pop(uid, None)
        self.tasks.cancel(f"experts-{uid}")


async def run(world: read_model.World, memory: Memory, act: executor.Executor) -> None:
    now = clock.SYSTEM.monotonic()
    for workload in world.workloads:
        roles = expert_roles(workload)
        if not roles:
            continue
        state = memory.services.setdefault(workload.uid, Service())
        if state.fresh is not None:
            await decide(workload, roles, state, act)
        key = f"experts-{workload.uid}"
        if now >= state.next_at and not memory.tasks.busy(key):
            state.next_at = now + period()
            urls = {
                p.uid: (p.role, f"http://{p.ip}:{metrics_port(workload)}/metrics")
                for p in world.pods.get(workload.key, [])
                if p.role in roles and p.ready and p.ip and not p.deleting
            }
            memory.tasks.start(key, read(urls, state, act))


def expert_roles(workload: Workload) -> dict[str, inferenceservice.Role]:
    """The expert-parallel roles of an InferenceService, by name (with one expert per card,
    as the CRD insists)."""
    if not isinstance(workload.model, inferenceservice.InferenceService):
        return {}
    return {
        r.name: r
        for r in workload.model.spec.roles
        if r.expert_parallel is not None
        and r.expert_parallel.experts + r.expert_parallel.redundant_experts == r.cards_per_replica
    }


def metrics_port(workload: Workload) -> int:
    assert isinstance(workload.model, inferenceservice.InferenceService)
    scaling = workload.model.spec.autoscaling
    return scaling.metrics_port if scaling is not None else SERVE_PORT


def period() -> float:
    return float(os.environ.get(PERIOD_VARIABLE) or PERIOD_SECONDS)


async def read(urls: Mapping[str, tuple[str, str]], state: Service, act: executor.Executor) -> None:
    """Step 1: the pods' expert counters; a pod that did not answer is left out."""
    texts = await act.scrape([url for _, url in urls.values()], SCRAPE_TIMEOUT_SECONDS)
    state.fresh = {
        uid: Counted(role, expert_metrics.tokens_per_expert(text))
        for uid, (role, url) in urls.items()
        if (text := texts.get(url)) is not None
    }


async def decide(
    workload: Workload,
    roles: Mapping[str, inferenceservice.Role],
    state: Service,
    act: executor.Executor,
) -> None:
    """Steps 2 and 3, with the reading just back."""
    assert state.fresh is not None
    fresh, state.fresh = state.fresh, None
    before, state.last = state.last, fresh
    shown = workload.experts()
    judged = [
        judge(role, grown(before, fresh, role), in_force(state, shown, role))
        for role in roles.values()
    ]
    judged = [j for j in judged if sum(j.load) > 0]
    if not judged:
        return  # no rates yet, or no token in the period: nothing to say
    moment = clock.SYSTEM.now()
    written = {
        j.role: status_of(j, state.written.get(j.role) or shown.get(j.role), moment) for j in judged
    }
    entries = {**shown, **state.written, **written}
    await act.patch_status(
        inferenceservice.PLURAL,
        workload.namespace,
        workload.name,
        {"experts": [common.to_wire(entries[name]) for name in roles if name in entries]},
    )
    state.written.update(written)
    replanned = [j for j in judged if j.replan]
    if replanned:
        act.event(workload.ref, "Normal", "ExpertsRebalanced", said(replanned))
        log.info("experts rebalanced", service=workload.key, message=said(replanned))


def grown(
    before: Mapping[str, Counted], fresh: Mapping[str, Counted], role: inferenceservice.Role
) -> list[float]:
    """Expert → tokens routed to it since the reading before, summed over the role's pods
    read both times (a counter that went down, its pod restarted, counts from 0)."""
    assert role.expert_parallel is not None
    load = [0.0] * role.expert_parallel.experts
    for uid, now in fresh.items():
        then = before.get(uid)
        if now.role != role.name or then is None:
            continue
        for expert, value in now.tokens.items():
            if expert < len(load):
                old = then.tokens.get(expert, 0.0)
                load[expert] += value - old if value >= old else value
    return load


def in_force(
    state: Service,
    shown: Mapping[str, inferenceservice.ExpertsStatus],
    role: inferenceservice.Role,
) -> tuple[int, ...]:
    """The layout of the map in force: what this controller wrote last, else what the status
    shows, else the first layout."""
    assert role.expert_parallel is not None
    experts, slots = role.expert_parallel.experts, role.cards_per_replica
    for entry in (state.written.get(role.name), shown.get(role.name)):
        if entry is not None and eplb.valid(entry.layout, experts, slots):
            return tuple(entry.layout)
    return eplb.default_layout(experts, slots)


def judge(role: inferenceservice.Role, load: Sequence[float], layout: Sequence[int]) -> Judgement:
    """The map in force and the balanced plan under ``load``; re-plan when the period counted
    at least :data:`MIN_TOKENS_PER_SLOT` per card and the map in force is
    :data:`matrixpool.placement.eplb.REPLAN_RATIO` times worse than the plan."""
    current = eplb.evaluate(load, layout, role.cards_per_pod)
    planned = eplb.plan(load, len(layout), role.cards_per_pod)
    enough = sum(load) >= MIN_TOKENS_PER_SLOT * len(layout)
    replan = enough and eplb.worth_replanning(current, planned)
    return Judgement(role.name, tuple(load), current, planned, replan)


def status_of(
    judged: Judgement,
    before: inferenceservice.ExpertsStatus | None,
    moment: datetime,
) -> inferenceservice.ExpertsStatus:
    """``status.experts[]`` of a role after a period: its measurement, and either the new
    plan or the last re-plan (``before``) kept."""
    chosen = judged.planned if judged.replan else judged.current
    total = sum(judged.load)
    copies = {e: chosen.layout.count(e) for e in eplb.hottest(judged.load, HOTTEST)}
    entry = inferenceservice.ExpertsStatus(
        role=judged.role,
        tokens=round(total),
        imbalance=_ratio(judged.current.imbalance),
        measured_time=moment,
        hottest=[
            inferenceservice.HotExpert(
                expert=e, share_percent=round(100 * judged.load[e] / total, 2), copies=n
            )
            for e, n in copies.items()
        ],
        layout=list(chosen.layout),
    )
    if judged.replan:
        return entry.model_copy(
            update={
                "imbalance_before": _ratio(judged.current.imbalance),
                "imbalance_after": _ratio(judged.planned.imbalance),
                "rebalanced_time": moment,
            }
        )
    if before is None:
        return entry
    kept = ("imbalance_before", "imbalance_after", "rebalanced_time")
    return entry.model_copy(update={k: getattr(before, k) for k in kept})


def said(replanned: Sequence[Judgement]) -> str:
    """The Event's message: per role, max/mean per card before and after, the hottest."""
    return "; ".join(
        f"{j.role}: max/mean load per card {j.current.imbalance:.2f} -> "
        f"{j.planned.imbalance:.2f}, hottest experts "
        + ", ".join(str(e) for e in eplb.hottest(j.load, 3))
        for j in replanned
    )


def _ratio(value: float) -> float:
    """An imbalance as the status shows it: 3 decimals, never below 1 (rounding)."""
    return max(1.0, round(value, 3))
