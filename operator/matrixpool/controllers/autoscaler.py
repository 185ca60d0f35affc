"""The inference autoscaler: InferenceServices with ``spec.autoscaling`` get the prefill and
decode replicas their load needs, inside the ranges a person set, written as
``status.recommendation`` with its reasons.

Each pass of the main loop (:mod:`matrixpool.controllers.loop`), for every such service:

1. every :data:`PERIOD_SECONDS` (the HPA's sync period), read the ``/metrics`` of its ready
   pods (``podIP:spec.autoscaling.metricsPort``) in a task of its own
   (:mod:`matrixpool.controllers.background`): a slow pod delays its own service's reading, never
   the loop;
2. once a reading is back: the load factors from it and the one before
   (:mod:`matrixpool.serving.readings`: arrivals, i.e. what was processed plus what the
   requests in the engines, waiting and running, grew by, so a burst counts in the first
   reading after it starts), the capacity per replica of each phase (:func:`learn`: as
   ``spec.autoscaling.capacity`` states it, else
   learned from the period's readings, :mod:`matrixpool.serving.capacity`), then the replicas
   they need (:func:`matrixpool.serving.estimator.estimate`) — each role within its
   autoscaling range (:func:`matrixpool.api.inferenceservice.autoscaling_range`), the ratio
   range kept, and no more cards than the window of its SuperNode lets inference hold —
   smoothed by the HPA-like
   :class:`~matrixpool.serving.estimator.Stabilizer` (``tolerancePercent``,
   ``scaleDownStabilizationSeconds``);
3. write ``status.recommendation`` when the replicas change (an Event ``Recommended`` in
   Advisory mode, ``Scaled`` in Auto mode) or a capacity figure does (its ``capacity``: per
   phase the tokens/s per replica sized with and its source, Stated, Learned with its periods,
   or FirstGuess; no Event). In Auto mode the scheduler and the time-sharing
   split then serve those replicas (:meth:`matrixpool.state.workloads.Workload.served_spec`);
   in Advisory mode nothing else changes.

The roles it sizes are those named ``prefill`` and ``decode``; a service with one role has
that role serve both phases. Other roles keep their replicas. A pod that does not answer
counts for nothing this period; a service none of whose pods answers twice in a row (no rates:
also right after the operator starts) keeps its replicas.
What is learned (the capacity figures) is kept in :class:`Service` by UID, lost with the
operator's memory: it then starts again from the stated figures or the first guess, the
CloudMatrix-Infer figures of :mod:`matrixpool.serving.latency` for the role's cards.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import pydantic
import structlog

from matrixpool import clock, metrics
from matrixpool.api import common, inferenceservice
from matrixpool.controllers import background
from matrixpool.k8s import convert, executor
from matrixpool.serving import capacity, estimator, readings
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool.timeshare import windows

log = structlog.get_logger(__name__)

PERIOD_SECONDS = 15.0  # between readings (the HPA's --horizontal-pod-autoscaler-sync-period)
# Test knob: another period, in seconds (the integration tests' stepped loads are short).
PERIOD_VARIABLE = "MATRIXPOOL_AUTOSCALER_PERIOD_SECONDS"
SCRAPE_TIMEOUT_SECONDS = 2.0  # a pod's /metrics that takes longer counts for nothing
PREFILL, DECODE = "prefill", "decode"


Figures = capacity.Figures  # (Shape.capacity shadows the module inside the class)
Written = tuple[str, int, int, tuple[tuple[str, str, float], ...]]
# (mode, prefill, decode, per phase (phase, source, tokens/s to 2 significant figures))


@dataclass
class Service:
    """What the autoscaler keeps of one service between passes (by UID)."""

    stabilizer: estimator.Stabilizer  # its recent recommendations
    last: dict[str, readings.Reading] = field(default_factory=dict)  # pod UID → last read
    fresh: dict[str, readings.Reading] | None = None  # the reading just back, not used yet
    next_at: float = 0.0  # monotonic time of the next reading
    written: Written | None = None  # what it last wrote
    series: list[tuple[str, ...]] = field(default_factory=list)  # its metric series' labels
    figures: capacity.Figures | None = None  # per-replica capacity learned so far (None: none)


@dataclass
class Memory:
    """Per service UID; owned by the main loop. Losing it costs one period's rates."""

    services: dict[str, Service] = field(default_factory=dict)
    tasks: background.Tasks = field(default_factory=background.Tasks)

    def forget(self, uid: str, key: str) -> None:
        """Drop what is remembered of the service ``uid`` (kept by UID only, not by ``key``)."""
        gone = self.services.pop(uid, None)
        self.tasks.cancel(uid)
        for labels in gone.series if gone is not None else ():
            metrics.AUTOSCALER_REPLICAS.remove(*labels)


async def run(world: read_model.World, memory: Memory, act: executor.Executor) -> None:
    now = clock.SYSTEM.monotonic()
    for workload in world.workloads:
        spec = _autoscaled(workload)
        if spec is None or spec.autoscaling is None:
            continue
        assert spec.autoscaling is not None
        state = memory.services.get(workload.uid)
        if state is None:
            state = memory.services[workload.uid] = Service(_stabilizer(spec.autoscaling))
        pods = [p for p in world.pods.get(workload.key, []) if p.ready and p.ip and not p.deleting]
        if state.fresh is not None:
            await decide(world, workload, spec, pods, state, act)
        if now >= state.next_at and not memory.tasks.busy(workload.uid):
            state.next_at = now + period()
            urls = {p.uid: f"http://{p.ip}:{spec.autoscaling.metrics_port}/metrics" for p in pods}
            engine = readings.Engine(spec.autoscaling.engine.value)
            memory.tasks.start(workload.uid, read(urls, engine, state, act))


def period() -> float:
    return float(os.environ.get(PERIOD_VARIABLE) or PERIOD_SECONDS)


async def read(
    urls: Mapping[str, str], engine: readings.Engine, state: Service, act: executor.Executor
) -> None:
    """Step 1: the pods' /metrics, parsed in ``engine``'s names; a pod that did not answer is
    left out."""
    texts = await act.scrape(list(urls.values()), SCRAPE_TIMEOUT_SECONDS)
    at = clock.SYSTEM.monotonic()
    state.fresh = {
        uid: readings.parse(text, at, engine)
        for uid, url in urls.items()
        if (text := texts.get(url)) is not None
    }


async def decide(
    world: read_model.World,
    workload: Workload,
    spec: inferenceservice.InferenceServiceSpec,
    pods: list[convert.PodFacts],
    state: Service,
    act: executor.Executor,
) -> None:
    """Steps 2 and 3, with the reading just back."""
    assert spec.autoscaling is not None
    assert state.fresh is not None
    fresh, state.fresh = state.fresh, None
    before, state.last = state.last, fresh
    if not set(fresh) & set(before):  # no rates yet (first reading, or every pod is new)
        return
    shape = Shape.of(spec)
    instances = [
        readings.Instance(before.get(p.uid), fresh[p.uid], role.cards_per_replica, key == DECODE)
        for p in pods
        if p.uid in fresh and (found := shape.role_of(p.role)) is not None
        for key, role in (found,)
    ]
    factors = readings.factors(instances)
    state.figures = learn(shape, state.figures, factors, readings.throughput(instances))
    used = shape.used(state.figures)
    current = shape.current(workload, spec.autoscaling.mode)
    if not state.stabilizer.history:  # after a start: no scale-down before a whole window
        seeded = ((clock.SYSTEM.monotonic(), current),)
        state.stabilizer = dataclasses.replace(state.stabilizer, history=seeded)
    advice = estimator.estimate(
        factors, shape.targets, shape.bounds, sizing(used), current, cap_cards=cap(world, spec)
    )
    state.stabilizer, decision = state.stabilizer.step(clock.SYSTEM.monotonic(), current, advice)
    log.debug(
        "autoscaler factors",
        service=workload.key,
        factors=dataclasses.asdict(factors),
        current=dataclasses.asdict(current),
        advice=dataclasses.asdict(advice.replicas),
        decision=dataclasses.asdict(decision.replicas),
    )
    mode = spec.autoscaling.mode
    shown = shape.phase_capacity(used)
    wanted: Written = (str(mode), decision.prefill, decision.decode, _key(shown))
    last = state.written or shape.shown(workload)
    if wanted == last:
        return
    said = [
        f"{c.phase} capacity {c.tokens_per_second:,} tokens/s per replica: {c.said}" for c in shown
    ]
    reasons = [*advice.reasons, *decision.reasons, *said, read_as(fresh.values())][:16]
    roles = shape.role_replicas(decision.prefill, decision.decode)
    status = inferenceservice.Recommendation(
        mode=mode,
        roles=roles,
        summary=", ".join(f"{r.name} {r.replicas}" for r in roles),
        reasons=[r[:256] for r in reasons],
        limited_by=", ".join(dict.fromkeys((*advice.limited_by, *decision.limited_by)))[:63]
        or None,
        capacity=shown,
        time=clock.SYSTEM.now(),
    )
    await act.patch_status(
        inferenceservice.PLURAL,
        workload.namespace,
        workload.name,
        {"recommendation": common.replacing(status)},
    )
    moved = last is None or last[:3] != wanted[:3]
    state.written = wanted
    after = estimator.Replicas(decision.prefill, decision.decode)
    observe(workload, state, str(mode), roles, current, after)
    if moved:  # a capacity figure that changed alone is written without an Event
        kind = "Scaled" if mode == inferenceservice.AutoscalingMode.AUTO else "Recommended"
        act.event(workload.ref, "Normal", kind, f"{status.summary}: {'; '.join(reasons[:3])}")
    log.info(
        "autoscaler",
        service=workload.key,
        mode=str(mode),
        replicas=status.summary,
        limited_by=status.limited_by,
        cap_cards=advice.limits.cards,
        reasons=status.reasons[:4],
    )


def learn(
    shape: Shape,
    figures: capacity.Figures | None,
    factors: estimator.Factors,
    measured: readings.Throughput,
) -> capacity.Figures:
    """The service's capacity figures after this period (:func:`matrixpool.serving.capacity.learn`
    for each phase), from the first guess for its cards when it has none yet."""
    known = figures or shape.first_guess()
    prefill = capacity.Period(
        measured.prefill_tokens_per_s,
        measured.prefill_busy_tokens_per_s,
        factors.ttft_p90_s,
        shape.targets.ttft_s,
    )
    decode = capacity.Period(
        measured.decode_tokens_per_s,
        measured.decode_busy_tokens_per_s,
        factors.tpot_p90_s,
        shape.targets.tpot_s,
    )
    share = shape.targets.utilisation
    return capacity.Figures(
        capacity.learn(known.prefill, prefill, share), capacity.learn(known.decode, decode, share)
    )


def sizing(figures: capacity.Figures) -> estimator.Capacity:
    return estimator.Capacity(figures.prefill.tokens_per_s, figures.decode.tokens_per_s)


def _key(shown: Iterable[inferenceservice.PhaseCapacity]) -> tuple[tuple[str, str, float], ...]:
    """The figures as the written status is compared: to 2 significant figures."""
    return tuple((c.phase, str(c.source), float(f"{c.tokens_per_second:.2g}")) for c in shown)


def read_as(fresh: Iterable[readings.Reading]) -> str:
    """Which engine's names the readings were read in, and what those engines do not export
    (it reads 0: docs/concepts.md, the autoscaler's engines)."""
    fresh = list(fresh)
    engines = sorted({r.engine.value for r in fresh})
    missing = sorted(set().union(*(r.missing for r in fresh)) - {"decode_seconds", "batch"})
    said = f"read as {'/'.join(engines)}"
    return said + (f"; not exported: {', '.join(missing)}" if missing else "")


def observe(
    workload: Workload,
    state: Service,
    mode: str,
    roles: list[inferenceservice.RoleRecommendation],
    before: estimator.Replicas,
    after: estimator.Replicas,
) -> None:
    """The recommendation's metric series (one per role) and which way it moved."""
    for labels in state.series:
        metrics.AUTOSCALER_REPLICAS.remove(*labels)
    state.series = [(workload.namespace, workload.name, r.name, mode) for r in roles]
    for labels, role in zip(state.series, roles, strict=True):
        metrics.AUTOSCALER_REPLICAS.labels(*labels).set(role.replicas)
    pairs = ((before.prefill, after.prefill), (before.decode, after.decode))
    moves = {(new > old) - (new < old) for old, new in pairs} - {0}
    if moves:
        direction = "mixed" if len(moves) > 1 else ("up" if moves == {1} else "down")
        metrics.AUTOSCALER_CHANGES.labels(mode, direction).inc()


@dataclass(frozen=True)
class Shape:
    """The service as the estimator sees it: which roles, their bounds, their capacity."""

    roles: dict[str, inferenceservice.Role]  # prefill and/or decode, by name
    bounds: estimator.Bounds
    targets: estimator.Targets
    stated: inferenceservice.ReplicaCapacity | None = None  # spec.autoscaling.capacity

    @staticmethod
    def of(spec: inferenceservice.InferenceServiceSpec) -> Shape:
        assert spec.autoscaling is not None
        sized = {r.name: r for r in spec.roles if r.name in (PREFILL, DECODE)}
        if not sized and len(spec.roles) == 1:
            sized = {DECODE: spec.roles[0]}  # one role serves both phases
        bounds = {n: _role_bounds(spec, r) for n, r in sized.items()}
        targets = estimator.Targets(
            ttft_s=spec.autoscaling.targets.ttft_milliseconds / 1000,
            tpot_s=spec.autoscaling.targets.tpot_milliseconds / 1000,
        )
        ratio = _ratio(spec.autoscaling.ratio_range)
        both = PREFILL in bounds and DECODE in bounds
        shaped = estimator.Bounds(bounds.get(PREFILL), bounds.get(DECODE), ratio if both else None)
        return Shape(sized, shaped, targets, spec.autoscaling.capacity)

    @property
    def capacity(self) -> estimator.Capacity:
        """The capacity before any reading: as stated, else the first guess."""
        return sizing(self.used(self.first_guess()))

    def first_guess(self) -> Figures:
        """The CloudMatrix-Infer figures for the cards of the roles serving each phase."""
        return capacity.first_guess(
            self.serving(PREFILL).cards_per_replica, self.serving(DECODE).cards_per_replica
        )

    def serving(self, phase: str) -> inferenceservice.Role:
        """The role whose replicas serve ``phase`` (the only role, where there is one)."""
        return self.roles.get(phase) or next(iter(self.roles.values()))

    def used(self, learned: Figures) -> Figures:
        """The figures sized with: those a person stated, else those learned (or guessed)."""
        given = self.stated or inferenceservice.ReplicaCapacity()
        return Figures(
            capacity.stated(given.prefill_tokens_per_second, learned.prefill),
            capacity.stated(given.decode_tokens_per_second, learned.decode),
        )

    def phase_capacity(self, used: Figures) -> list[inferenceservice.PhaseCapacity]:
        """The figures as status.recommendation.capacity shows them."""
        return [
            inferenceservice.PhaseCapacity(
                phase=phase,
                role=self.serving(phase).name,
                tokens_per_second=round(figure.tokens_per_s),
                source=inferenceservice.CapacitySource(figure.source.value),
                periods=figure.periods,
                said=figure.said,
            )
            for phase, figure in ((PREFILL, used.prefill), (DECODE, used.decode))
        ]

    def role_of(self, name: str) -> tuple[str, inferenceservice.Role] | None:
        """(prefill or decode, the role) of the role named ``name``; None for another role."""
        return next(((k, r) for k, r in self.roles.items() if r.name == name), None)

    def current(
        self, workload: Workload, mode: inferenceservice.AutoscalingMode
    ) -> estimator.Replicas:
        """The replicas the service is at: in Auto mode those last recommended (pods may still
        be starting), else the status's per-role count, else the spec's."""
        advice = workload.status.get("recommendation") or {}
        source = (
            advice if mode == inferenceservice.AutoscalingMode.AUTO and advice else workload.status
        )
        counted = {r.get("name"): r.get("replicas") for r in source.get("roles") or []}
        got = {
            key: int(counted.get(role.name) or role.replicas) for key, role in self.roles.items()
        }
        return estimator.Replicas(got.get(PREFILL, 0), got.get(DECODE, 0))

    def shown(self, workload: Workload) -> Written | None:
        """What the recommendation the status shows says (as :data:`Written`), if any."""
        advice = workload.status.get("recommendation") or {}
        counted = {r.get("name"): r.get("replicas") for r in advice.get("roles") or []}
        got = {key: counted.get(role.name) for key, role in self.roles.items()}
        if not advice or None in got.values():
            return None
        try:
            shown = [inferenceservice.PhaseCapacity.model_validate(c) for c in advice["capacity"]]
        except (KeyError, TypeError, pydantic.ValidationError):
            shown = []  # written before capacity was shown: written again
        mode = str(advice.get("mode"))
        return (mode, int(got.get(PREFILL) or 0), int(got.get(DECODE) or 0), _key(shown))

    def role_replicas(self, prefill: int, decode: int) -> list[inferenceservice.RoleRecommendation]:
        by_key = {PREFILL: prefill, DECODE: decode}
        return [
            inferenceservice.RoleRecommendation(name=role.name, replicas=by_key[key])
            for key, role in self.roles.items()
        ]


def cap(world: read_model.World, spec: inferenceservice.InferenceServiceSpec) -> int | None:
    """The cards the window of the service's SuperNode lets inference hold now; None when it
    names none or that one is not time-shared (the split still arbitrates between services)."""
    found = world.supernodes.get(spec.super_node or "")
    sharing = found.spec.time_sharing if found is not None else None
    if sharing is None:
        return None
    try:
        return windows.window_at(sharing, clock.operator().now()).inference_cards
    except windows.UnknownTimezoneError:
        return None


def _autoscaled(workload: Workload) -> inferenceservice.InferenceServiceSpec | None:
    if not isinstance(workload.model, inferenceservice.InferenceService):
        return None
    return workload.model.spec if workload.model.spec.autoscaling is not None else None


def _stabilizer(autoscaling: inferenceservice.Autoscaling) -> estimator.Stabilizer:
    return estimator.Stabilizer(
        tolerance=autoscaling.tolerance_percent / 100,
        scale_down_window_s=float(autoscaling.scale_down_stabilization_seconds),
    )


def _role_bounds(
    spec: inferenceservice.InferenceServiceSpec, role: inferenceservice.Role
) -> estimator.RoleBounds:
    low, high = inferenceservice.autoscaling_range(spec, role)
    return estimator.RoleBounds(low, high, role.cards_per_replica)


def _ratio(given: inferenceservice.RatioRange | None) -> estimator.RatioRange | None:
    """Decode per prefill, whichever way round the spec states it."""
    if given is None or {given.role, given.per} != {PREFILL, DECODE}:
        return None
    low, high = Fraction(given.min_percent, 100), Fraction(given.max_percent, 100)
    if given.role == PREFILL:  # prefill per decode: invert the range
        low, high = 1 / high, 1 / low
    return estimator.RatioRange(low, high)
