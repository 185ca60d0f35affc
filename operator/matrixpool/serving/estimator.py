"""From load factors to the prefill and decode replicas an InferenceService needs.

Called by the inference autoscaler (:mod:`matrixpool.controllers.autoscaler`) once a period
with the factors it read from the instances' metrics; its result goes to
``status.recommendation``, reasons and all (served in mode Auto, shown only in mode Advisory),
and by ``benchmarks/serving.py`` in simulated time. Pure: no clock, no I/O, nothing
from matrixpool outside this package; per-replica capacity arrives as plain numbers
(:class:`Capacity`: the autoscaler's are stated, learned from the readings or the first guess,
:mod:`matrixpool.serving.capacity`).

A service has a prefill role and a decode role (disaggregated), or only one of them, which
then serves both phases (aggregated: its replicas split their time between the two).

``estimate`` works in phases, each a named policy below:

1. Load → replicas needed, unrounded, per role (:class:`Need`):
   - prefill (:func:`prefill_tokens_need`): the prompt tokens arriving per second (arrivals:
     processed plus the growth of the requests in the engines,
     :mod:`matrixpool.serving.readings`) plus the backlog waiting (``queue_depth``) cleared
     within the TTFT target, over one replica's
     prefill tokens/s at the target utilisation; and, where a replica's request rate is
     bounded, the arrival rate over it (:func:`prefill_requests_need`);
   - decode (:func:`decode_tokens_need`): the output tokens per second over one replica's
     decode tokens/s at the TPOT target and the target utilisation; and the KV cache
     (:func:`kv_need`): the running sequences' KV must fit at the target usage, so the
     decode replicas running now times usage over target;
   - one role only (:func:`aggregated_need`): the sum of both phases' needs.
   The largest need of a role wins, and its reason says so.
2. Rounding up (:func:`replicas_for`), then the observed signals, which only ever add:
   a TTFT (prefill) or TPOT (decode) p90 above its target asks for the replicas running now
   plus a bounded step (:func:`latency_floor`); the prefill cards' utilisation above the
   target asks for the prefill replicas running now times utilisation over target, the HPA
   rule (:func:`utilisation_floor`). Not for decode: a decode step keeps its cards busy
   whatever its batch, so busy time tells nothing of the capacity left there (tokens/s and KV
   usage do).
3. The person's spec: each role within ``minReplicas..maxReplicas`` (:func:`within_bounds`).
4. The ratio range: the least replicas at or above phase 3's whose decode/prefill ratio is in
   ``[lo, hi]`` (:func:`keep_ratio`); it only raises, never lowers below what load needs. If
   that would pass a ``maxReplicas``, the range cannot be kept: the short side is raised as
   far as its maximum allows (still monotone), with a reason.
5. Cards (:func:`fit_cards`): at most ``min(cap_cards, free_cards + cards held now)``. Over
   that, both roles are cut in proportion to what phase 4 wanted, each kept at or above its
   floor and the ratio kept where it fits; if the floors alone do not fit, the floors are
   returned with the reason (the split of ``timeshare`` then decides; "does not fit" is data).
   The cut is by whole levels of the wanted replicas, then single replicas fill what a level
   leaves, the role furthest below its share first.

Properties (tests/unit/serving/test_estimator.py): more load never yields fewer replicas
(phases 1-4 are monotone in every factor); under a card limit, the role whose need grew never
gets fewer (the other may: the cut is shared in proportion, and neither the other role nor the
total cards are monotone there); every role stays within its bounds; the cards never exceed the
limit unless the floors alone do; the ratio range is kept whenever replicas at or above the
need within the bounds and the limit keep it, and a cut keeps it if what it cut kept it.

:class:`Stabilizer` then smooths recommendations over time the way the Kubernetes
HorizontalPodAutoscaler does (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale,
"Algorithm details" and "Stabilization window": a 10% tolerance, the controller manager's
--horizontal-pod-autoscaler-tolerance; a scale-down stabilisation window of 300 s by default,
--horizontal-pod-autoscaler-downscale-stabilization; no scale-up window): up at once, down
only to the highest recommendation of the last ``scale_down_window_s``, and hold within the
tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

# A need within this of a whole number of replicas counts as that number (float noise).
_EPSILON = 1e-9


@dataclass(frozen=True)
class Factors:
    """The load as the instances' metrics show it, all instances of the service together."""

    arrival_rate: float = 0.0  # requests arriving per second
    input_tokens_per_s: float = 0.0  # prompt tokens arriving per second (not only finishing)
    output_tokens_per_s: float = 0.0  # output tokens generated per second
    queue_depth: float = 0.0  # prompt tokens waiting for prefill (see waiting_tokens)
    kv_usage: float = 0.0  # KV cache usage of the decode replicas now, 0..1 (mean)
    card_utilisation: float = 0.0  # busy fraction of the prefill instances' cards now, 0..1
    ttft_p90_s: float | None = None  # observed time to first token, p90; None: not measured
    tpot_p90_s: float | None = None  # observed time per output token, p90; None: not measured


@dataclass(frozen=True)
class Targets:
    """The SLO and the operating point the replicas are sized for."""

    ttft_s: float  # time to first token
    tpot_s: float  # time per output token (Capacity.decode_tokens_per_s is measured at it)
    utilisation: float = 0.8  # share of a replica's rate the load may use: headroom for bursts
    kv_usage: float = 0.8  # share of the decode replicas' KV cache the running sequences may use

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("targets: ttft_s and tpot_s must be > 0")
        if not (0 < self.utilisation <= 1 and 0 < self.kv_usage <= 1):
            raise ValueError("targets: utilisation and kv_usage must be in (0, 1]")


@dataclass(frozen=True)
class Capacity:
    """What one replica of each role sustains (from ``serving.latency`` for its cards)."""

    prefill_tokens_per_s: float  # prompt tokens one prefill replica processes per second
    decode_tokens_per_s: float  # output tokens one decode replica yields per s at the TPOT target
    prefill_requests_per_s: float | None = None  # requests it starts per second; None: unbounded

    def __post_init__(self) -> None:
        rates = (self.prefill_tokens_per_s, self.decode_tokens_per_s)
        if min(rates) <= 0 or (self.prefill_requests_per_s or 1) <= 0:
            raise ValueError("capacity: rates must be > 0")


@dataclass(frozen=True)
class RoleBounds:
    """One role as the person's spec bounds it."""

    min_replicas: int  # floor, kept always
    max_replicas: int  # ceiling, never exceeded
    cards_per_replica: int  # cards of one instance (podsPerReplica x cardsPerPod)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.cards_per_replica < 1:
            raise ValueError("role bounds: need 0 <= minReplicas <= maxReplicas, cards >= 1")

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(replicas, self.max_replicas))


@dataclass(frozen=True)
class RatioRange:
    """The decode/prefill ratio a service keeps when it has both roles: ``lo <= d/p <= hi``."""

    lo: Fraction  # at least this many decode replicas per prefill replica
    hi: Fraction  # at most this many

    def __post_init__(self) -> None:
        if not 0 < self.lo <= self.hi:
            raise ValueError("ratio range: need 0 < lo <= hi")

    @staticmethod
    def of(lo: float | Fraction, hi: float | Fraction) -> RatioRange:
        """From decimals: ``RatioRange.of(0.5, 2)``; compared exactly, as written."""
        return RatioRange(Fraction(str(lo)), Fraction(str(hi)))

    def admits(self, prefill: int, decode: int) -> bool:
        """Whether the replicas keep the range; nothing running keeps it too."""
        if prefill == 0:
            return decode == 0
        return self.lo <= Fraction(decode, prefill) <= self.hi


@dataclass(frozen=True)
class Bounds:
    """The service's roles (one may be absent) and how they scale together."""

    prefill: RoleBounds | None  # None: no prefill role (the decode role serves both phases)
    decode: RoleBounds | None  # None: no decode role (the prefill role serves both phases)
    ratio: RatioRange | None = None  # kept only when both roles exist

    def __post_init__(self) -> None:
        if self.prefill is None and self.decode is None:
            raise ValueError("bounds: a service has at least one role")

    @property
    def floors(self) -> Replicas:
        return Replicas(_min(self.prefill), _min(self.decode))

    def clamp(self, replicas: Replicas) -> Replicas:
        return Replicas(
            _clamp(self.prefill, replicas.prefill), _clamp(self.decode, replicas.decode)
        )

    def cards(self, replicas: Replicas) -> int:
        return _cards(self.prefill, replicas.prefill) + _cards(self.decode, replicas.decode)

    def keeps_ratio(self, replicas: Replicas) -> bool:
        """Whether the replicas keep the ratio range; true without a range or both roles."""
        if self.ratio is None or self.prefill is None or self.decode is None:
            return True
        return self.ratio.admits(replicas.prefill, replicas.decode)


@dataclass(frozen=True)
class Replicas:
    """Replicas per role; an absent role has 0."""

    prefill: int = 0
    decode: int = 0

    def join(self, other: Replicas) -> Replicas:
        """The larger of each role."""
        return Replicas(max(self.prefill, other.prefill), max(self.decode, other.decode))

    def meet(self, other: Replicas) -> Replicas:
        """The smaller of each role."""
        return Replicas(min(self.prefill, other.prefill), min(self.decode, other.decode))


@dataclass(frozen=True)
class Need:
    """Replicas a load needs, unrounded: 2.4 means two full replicas and 40% of a third."""

    replicas: float  # at the target utilisation
    reason: str  # a short sentence naming the factor and its figure


@dataclass(frozen=True)
class Limits:
    """What any replica count for the service must satisfy now."""

    bounds: Bounds  # per role minReplicas..maxReplicas, cards per replica, ratio range
    cards: int | None  # most cards the service may hold now; None: no limit
    cards_label: str = ""  # what sets ``cards``: "window cap" or "free cards"

    def fits(self, replicas: Replicas) -> bool:
        return self.cards is None or self.bounds.cards(replicas) <= self.cards


@dataclass(frozen=True)
class Recommendation:
    """The replicas the load needs now, within the limits, and why."""

    prefill: int  # prefill replicas (0 without a prefill role)
    decode: int  # decode replicas (0 without a decode role)
    need: Replicas  # what phases 1-2 asked for, before the spec, the ratio and the cards
    load: tuple[float, float]  # phase 1's unrounded needs (prefill, decode): the tolerance's base
    limits: Limits  # the limits it was fitted to (the Stabilizer keeps them too)
    reasons: tuple[str, ...]  # one short sentence per factor that drove a number
    limited_by: tuple[str, ...] = ()  # "maxReplicas", "window cap", "free cards": what held it down

    @property
    def replicas(self) -> Replicas:
        return Replicas(self.prefill, self.decode)

    @property
    def cards(self) -> int:
        return self.limits.bounds.cards(self.replicas)


# --- phase 1: load -> replicas needed -----------------------------------------------------------
def prefill_tokens_need(factors: Factors, targets: Targets, capacity: Capacity) -> Need:
    """Prompt tokens per second plus the backlog cleared within the TTFT target, over one
    replica's prefill rate at the target utilisation."""
    backlog_rate = factors.queue_depth / targets.ttft_s
    rate = factors.input_tokens_per_s + backlog_rate
    replicas = rate / (capacity.prefill_tokens_per_s * targets.utilisation)
    backlog = f" (with {_n(factors.queue_depth)} waiting)" if factors.queue_depth > 0 else ""
    return Need(
        replicas,
        f"{_n(factors.input_tokens_per_s)} input tokens/s{backlog} needs {_r(replicas)} "
        f"at {_pct(targets.utilisation)} target utilisation",
    )


def prefill_requests_need(factors: Factors, targets: Targets, capacity: Capacity) -> Need | None:
    """The arrival rate over the requests one prefill replica starts per second, at the target
    utilisation; None where the capacity does not bound requests."""
    if capacity.prefill_requests_per_s is None:
        return None
    replicas = factors.arrival_rate / (capacity.prefill_requests_per_s * targets.utilisation)
    return Need(
        replicas,
        f"{_n(factors.arrival_rate)} requests/s needs {_r(replicas)} "
        f"at {_pct(targets.utilisation)} target utilisation",
    )


def decode_tokens_need(factors: Factors, targets: Targets, capacity: Capacity) -> Need:
    """Output tokens per second over one replica's decode rate at the TPOT target, at the target
    utilisation."""
    replicas = factors.output_tokens_per_s / (capacity.decode_tokens_per_s * targets.utilisation)
    return Need(
        replicas,
        f"{_n(factors.output_tokens_per_s)} output tokens/s needs {_r(replicas)} "
        f"at {_pct(targets.utilisation)} target utilisation",
    )


def kv_need(factors: Factors, targets: Targets, decode_now: int) -> Need:
    """The running sequences' KV cache must fit at the target usage: the decode replicas running
    now times usage over target (usage above the target scales up in proportion)."""
    replicas = decode_now * factors.kv_usage / targets.kv_usage
    return Need(
        replicas,
        f"KV cache {_pct(factors.kv_usage)} used on {decode_now} replicas needs {_r(replicas)} "
        f"at {_pct(targets.kv_usage)} target usage",
    )


def aggregated_need(prefill: Need, decode: Need) -> Need:
    """One role serving both phases: its replicas split their time, so the needs add up."""
    replicas = prefill.replicas + decode.replicas
    return Need(replicas, f"prefill and decode together need {_r(replicas)}")


def largest(*needs: Need | None) -> Need:
    """The largest of the needs (the first on a tie): the factor that drives the role."""
    present = [need for need in needs if need is not None]
    return max(present, key=lambda need: need.replicas)


# --- phase 2: whole replicas, then the observed signals ------------------------------------------
def replicas_for(need: float) -> int:
    """The whole replicas for an unrounded need: rounded up (a float's noise ignored)."""
    return max(0, math.ceil(need - _EPSILON))


def latency_floor(observed: float | None, target: float, now: int, max_step: int) -> int:
    """An observed p90 above its target asks for the replicas running now plus a step in
    proportion to the miss: ``ceil(now * (observed / target - 1))``, at least 1 and at most
    ``max_step``; a p90 at or under its target asks for nothing (0)."""
    if observed is None or observed <= target:
        return 0
    step = replicas_for(now * (observed / target - 1))
    return now + max(1, min(step, max_step))


def utilisation_floor(utilisation: float, target: float, now: int) -> int:
    """Cards busier than the target utilisation ask for ``ceil(now * busy / target)`` replicas,
    the HPA rule: the measurement outranks a capacity model that underestimates the load.
    At or under the target it asks for nothing (0)."""
    if utilisation <= target:
        return 0
    return replicas_for(now * utilisation / target)


# --- phases 3 to 5: the spec, the ratio, the cards ----------------------------------------------
def within_bounds(wanted: Replicas, bounds: Bounds) -> Replicas:
    """Each role within its ``minReplicas..maxReplicas``; an absent role 0."""
    return bounds.clamp(wanted)


def keep_ratio(replicas: Replicas, bounds: Bounds) -> Replicas:
    """The least replicas at or above ``replicas`` (each role) whose decode/prefill ratio is in
    the range, raising the side that is short: ``p >= ceil(d / hi)`` and ``d >= ceil(p * lo)``,
    repeated until both hold, neither raised past its ``maxReplicas``. Where the maxima forbid
    the range, the result is as near to it as they allow (:meth:`Bounds.keeps_ratio` tells).
    Without a range or without both roles, ``replicas`` as they are.

    Each raise is monotone, so this is the least fixed point above ``replicas``: the cheapest
    replicas in range at or above them, and more wanted never yields less."""
    ratio, prefill, decode = bounds.ratio, bounds.prefill, bounds.decode
    if ratio is None or prefill is None or decode is None:
        return replicas
    p, d = replicas.prefill, replicas.decode
    while True:
        raised_p = min(prefill.max_replicas, max(p, math.ceil(d / ratio.hi)))
        raised_d = min(decode.max_replicas, max(d, math.ceil(raised_p * ratio.lo)))
        if (raised_p, raised_d) == (p, d):
            return Replicas(p, d)
        p, d = raised_p, raised_d


def card_limit(cap_cards: int | None, free_cards: int | None, held: int) -> tuple[int | None, str]:
    """The most cards the service may hold: the window's cap, and what it holds plus what is
    free; the smaller one names the limit."""
    reachable = None if free_cards is None else free_cards + held
    if cap_cards is None and reachable is None:
        return None, ""
    if reachable is None or (cap_cards is not None and cap_cards <= reachable):
        return cap_cards, "window cap"
    return reachable, "free cards"


def fit_cards(wanted: Replicas, limits: Limits) -> Replicas | None:
    """Over the card limit, cut both roles in proportion to ``wanted`` to the highest level that
    fits: at level ``k`` of ``K = max(wanted)`` a role has ``max(floor, wanted * k // K)``,
    raised to keep the ratio range if ``wanted`` keeps it and the floors allow; then the cards
    a whole level leaves are filled a replica at a time (:func:`_top_up`). None if the floors
    do not fit."""
    if limits.fits(wanted):
        return wanted
    bounds = limits.bounds

    def in_range(replicas: Replicas) -> Replicas | None:
        kept = keep_ratio(replicas, bounds)
        return kept if bounds.keeps_ratio(kept) else None

    with_ratio = _ladder(wanted, limits, in_range) if bounds.keeps_ratio(wanted) else None
    if with_ratio is not None:
        return with_ratio
    return _ladder(wanted, limits, lambda r: r)


def _ladder(
    wanted: Replicas, limits: Limits, adjust: Callable[[Replicas], Replicas | None]
) -> Replicas | None:
    """The highest level of the proportional cut (``fit_cards``) that fits; None if none does."""
    top = max(wanted.prefill, wanted.decode, 1)

    def level(k: int) -> Replicas | None:
        cut = Replicas(wanted.prefill * k // top, wanted.decode * k // top)
        return adjust(cut.join(limits.bounds.floors))

    def fits(k: int) -> bool:
        replicas = level(k)
        return replicas is not None and limits.fits(replicas)

    if not fits(0):
        return None
    low, high = 0, top
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    found = level(low)
    assert found is not None  # fits(low)
    return _top_up(found, wanted, limits, adjust)


def _top_up(
    got: Replicas, wanted: Replicas, limits: Limits, adjust: Callable[[Replicas], Replicas | None]
) -> Replicas:
    """The cards a whole level leaves, filled one replica at a time: the role furthest below
    its share of ``wanted`` first, never above ``wanted``, while they fit."""
    while True:
        short = []
        if got.prefill < wanted.prefill:
            short.append((got.prefill / wanted.prefill, Replicas(got.prefill + 1, got.decode)))
        if got.decode < wanted.decode:
            short.append((got.decode / wanted.decode, Replicas(got.prefill, got.decode + 1)))
        steps = [adjust(more) for _, more in sorted(short, key=lambda pair: pair[0])]
        fitting = [r for r in steps if r is not None and r.meet(wanted) == r and limits.fits(r)]
        if not fitting:
            return got
        got = fitting[0]


# --- the estimate ---------------------------------------------------------------------------------
def estimate(
    factors: Factors,
    targets: Targets,
    bounds: Bounds,
    capacity: Capacity,
    current: Replicas,
    *,
    cap_cards: int | None = None,
    free_cards: int | None = None,
    max_step: int = 4,
) -> Recommendation:
    """The replicas ``factors`` need (module docstring, phases 1 to 5).

    ``current``: the replicas running now (the base of the KV, latency and utilisation rules);
    ``cap_cards``: the cards the time window lets this service hold; ``free_cards``: cards no
    one holds; ``max_step``: the most replicas one latency miss adds (the HPA's default
    scale-up policy adds at most 4 pods per period)."""
    # 1. load -> unrounded needs, per role
    prefill_need, decode_need = _load_needs(factors, targets, bounds, capacity, current)
    reasons = [
        _role_reason(bounds, "prefill", prefill_need),
        _role_reason(bounds, "decode", decode_need),
    ]
    # 2. whole replicas, then the observed signals (add only)
    need, observed = _observed(
        factors, targets, bounds, current, prefill_need, decode_need, max_step
    )
    reasons += observed
    # 3. the spec
    wanted, limited_by, spec = _spec(need, bounds)
    reasons += spec
    # 4. the ratio range
    wanted, ratio = _ratio(wanted, bounds)
    reasons += ratio
    # 5. the cards
    limit, label = card_limit(cap_cards, free_cards, bounds.cards(current))
    limits = Limits(bounds, limit, label)
    fitted, cards = _cards_phase(wanted, limits)
    return Recommendation(
        prefill=fitted.prefill,
        decode=fitted.decode,
        need=need,
        load=(prefill_need.replicas, decode_need.replicas),
        limits=limits,
        reasons=tuple(r for r in (*reasons, *cards) if r),
        limited_by=tuple(dict.fromkeys((*limited_by, *([label] if cards else [])))),
    )


def _load_needs(
    factors: Factors, targets: Targets, bounds: Bounds, capacity: Capacity, current: Replicas
) -> tuple[Need, Need]:
    """Phase 1: the needs of the prefill and decode roles; an absent role needs 0, its load
    folded into the other role (aggregated)."""
    prefill = largest(
        prefill_tokens_need(factors, targets, capacity),
        prefill_requests_need(factors, targets, capacity),
    )
    decode_now = current.decode if bounds.decode is not None else current.prefill
    decode = largest(
        decode_tokens_need(factors, targets, capacity), kv_need(factors, targets, decode_now)
    )
    nothing = Need(0.0, "")
    if bounds.prefill is None:
        return nothing, aggregated_need(prefill, decode)
    if bounds.decode is None:
        return aggregated_need(prefill, decode), nothing
    return prefill, decode


def _observed(
    factors: Factors,
    targets: Targets,
    bounds: Bounds,
    current: Replicas,
    prefill: Need,
    decode: Need,
    max_step: int,
) -> tuple[Replicas, list[str]]:
    """Phase 2: rounded needs raised by the latency and utilisation floors of present roles."""
    ttft = (factors.ttft_p90_s, targets.ttft_s, "TTFT")
    tpot = (factors.tpot_p90_s, targets.tpot_s, "TPOT")
    counts, reasons = [], []
    for name, role, need, now, latencies in (
        (
            "prefill",
            bounds.prefill,
            prefill,
            current.prefill,
            [ttft] if bounds.decode else [ttft, tpot],
        ),
        (
            "decode",
            bounds.decode,
            decode,
            current.decode,
            [tpot] if bounds.prefill else [ttft, tpot],
        ),
    ):
        count = replicas_for(need.replicas) if role is not None else 0
        if role is not None:
            count, why = _raise_observed(factors, targets, name, count, now, latencies, max_step)
            reasons += why
        counts.append(count)
    return Replicas(*counts), reasons


def _raise_observed(
    factors: Factors,
    targets: Targets,
    name: str,
    count: int,
    now: int,
    latencies: list[tuple[float | None, float, str]],
    max_step: int,
) -> tuple[int, list[str]]:
    """One role's count raised by its latency floors and the utilisation floor."""
    reasons = []
    for observed, target, label in latencies:
        floor = latency_floor(observed, target, now, max_step)
        if floor > count:
            count = floor
            reasons.append(
                f"{name}: {label} p90 {_s(observed)} over the {_s(target)} target adds "
                f"{floor - now} to {now}: {floor}"
            )
    if name != "prefill":  # a decode step is busy at any batch: busy time is no measure there
        return count, reasons
    floor = utilisation_floor(factors.card_utilisation, targets.utilisation, now)
    if floor > count:
        count = floor
        reasons.append(
            f"{name}: cards {_pct(factors.card_utilisation)} busy on {now} replicas need {floor} "
            f"at {_pct(targets.utilisation)} target utilisation"
        )
    return count, reasons


def _spec(need: Replicas, bounds: Bounds) -> tuple[Replicas, list[str], list[str]]:
    """Phase 3: within the spec; "maxReplicas" limits it where a role needed more."""
    wanted = within_bounds(need, bounds)
    limited, reasons = [], []
    for name, role, asked, got in (
        ("prefill", bounds.prefill, need.prefill, wanted.prefill),
        ("decode", bounds.decode, need.decode, wanted.decode),
    ):
        if role is not None and got < asked:
            limited.append("maxReplicas")
            reasons.append(f"{name}: held at maxReplicas {got} (load needs {asked})")
        elif role is not None and got > asked:
            reasons.append(f"{name}: raised to minReplicas {got}")
    return wanted, limited, reasons


def _ratio(wanted: Replicas, bounds: Bounds) -> tuple[Replicas, list[str]]:
    """Phase 4: the least replicas in the ratio range, or as near as maxReplicas allow."""
    kept = keep_ratio(wanted, bounds)
    ratio = bounds.ratio
    if ratio is None or (kept == wanted and bounds.keeps_ratio(kept)):
        return wanted, []
    span = f"decode/prefill ratio {_q(ratio.lo)}..{_q(ratio.hi)}"
    raised = f"prefill {wanted.prefill} -> {kept.prefill}, decode {wanted.decode} -> {kept.decode}"
    if not bounds.keeps_ratio(kept):
        return kept, [f"{span} cannot be kept within maxReplicas: {raised}"]
    return kept, [f"{span} raises {raised}"]


def _cards_phase(wanted: Replicas, limits: Limits) -> tuple[Replicas, list[str]]:
    """Phase 5: the cut to the card limit, and its reason."""
    fitted = fit_cards(wanted, limits)
    wanted_cards = limits.bounds.cards(wanted)
    if fitted == wanted:
        return wanted, []
    if fitted is None:
        floors = limits.bounds.floors
        return floors, [
            f"the floors need {limits.bounds.cards(floors)} cards, the {limits.cards_label} "
            f"allows {limits.cards}: they do not fit"
        ]
    return fitted, [
        f"capped by the {limits.cards_label}: {limits.cards} cards "
        f"({wanted_cards} wanted): prefill {fitted.prefill}, decode {fitted.decode}"
    ]


def _role_reason(bounds: Bounds, name: str, need: Need) -> str:
    present = bounds.prefill if name == "prefill" else bounds.decode
    return f"{name}: {need.reason}" if present is not None and need.reason else ""


# --- stabilisation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """What to run: the stabilised replicas and why they differ from the recommendation."""

    prefill: int  # prefill replicas to run
    decode: int  # decode replicas to run
    reasons: tuple[str, ...]  # per role: held, scaled up at once, or scale-down waiting
    limited_by: tuple[str, ...] = ()  # a card limit that cut what the history held

    @property
    def replicas(self) -> Replicas:
        return Replicas(self.prefill, self.decode)


@dataclass(frozen=True)
class Stabilizer:
    """Recommendations smoothed over time, HPA-like (module docstring). Immutable: ``step``
    returns the next stabilizer with the decision.

    Per role, in order:
    1. Hold (:func:`holds`) while the current replicas serve the load within the tolerance:
       the load is at most ``current * (1 + tolerance)`` and the current replicas are no more
       than the load with that headroom needs, ``ceil(load * (1 + tolerance))``. Otherwise
       desire what the load asks for within the spec (phases 1 to 3). A latency or
       utilisation floor (phase 2) is never held back by the tolerance.
    2. Up at once to what is desired; down only to the highest desired in the last
       ``scale_down_window_s`` (:func:`stabilise`).
    3. The ratio range, for both roles together, by raising the short side
       (:func:`keep_ratio`); then the limits, at once: every role within its bounds and, where
       the cards do not fit the limit, no role above the recommendation.
    """

    tolerance: float = 0.1  # HPA default (--horizontal-pod-autoscaler-tolerance)
    scale_down_window_s: float = 300.0  # HPA default (kube-controller-manager flag, see above)
    history: tuple[tuple[float, Replicas], ...] = ()  # (time, desired) within the window

    def step(
        self, now: float, current: Replicas, recommendation: Recommendation
    ) -> tuple[Stabilizer, Decision]:
        bounds = recommendation.limits.bounds
        desired, reasons = _desired(self.tolerance, current, recommendation)
        history = (
            *(e for e in self.history if now - e[0] < self.scale_down_window_s),
            (now, desired),
        )
        ceiling = Replicas(0, 0)
        for _, seen in history:
            ceiling = ceiling.join(seen)
        stable = bounds.clamp(stabilise(current, desired, ceiling))
        reasons += _waiting(current, desired, stable, self.scale_down_window_s)
        stable = keep_ratio(stable, bounds)
        limited: tuple[str, ...] = ()
        if not recommendation.limits.fits(stable):
            stable = bounds.clamp(stable.meet(recommendation.replicas))
            reasons.append(f"the {recommendation.limits.cards_label} applies at once")
            limited = (recommendation.limits.cards_label,)
        decision = Decision(stable.prefill, stable.decode, tuple(reasons), limited)
        return replace(self, history=history), decision


def holds(load: float, current: int, tolerance: float) -> bool:
    """HPA's tolerance, for whole replicas: ``current`` serves ``load`` (unrounded replicas) if
    the load exceeds it by at most the tolerance and it exceeds what the load with the
    tolerance's headroom needs by nothing, so noise within the tolerance changes nothing."""
    return load <= current * (1 + tolerance) + _EPSILON and current <= replicas_for(
        load * (1 + tolerance)
    )


def stabilise(current: Replicas, desired: Replicas, ceiling: Replicas) -> Replicas:
    """Per role: up at once to ``desired``; down no lower than ``ceiling``, the highest desired
    in the window (HPA's scale-up and scale-down stabilisation, scale-up window 0)."""

    def one(now: int, want: int, top: int) -> int:
        return want if want > now else min(now, top)

    return Replicas(
        one(current.prefill, desired.prefill, ceiling.prefill),
        one(current.decode, desired.decode, ceiling.decode),
    )


def _desired(
    tolerance: float, current: Replicas, recommendation: Recommendation
) -> tuple[Replicas, list[str]]:
    """Per role: the current replicas if they hold (within the tolerance and the bounds),
    otherwise what the load asks for within the spec (the ratio and the cards come after)."""
    bounds = recommendation.limits.bounds
    wanted = bounds.clamp(recommendation.need)
    need, load = recommendation.need, recommendation.load
    counts, reasons = [], []
    for name, role, now, asked, observed, want in (
        ("prefill", bounds.prefill, current.prefill, load[0], need.prefill, wanted.prefill),
        ("decode", bounds.decode, current.decode, load[1], need.decode, wanted.decode),
    ):
        in_spec = role is not None and role.clamp(now) == now
        missed = observed > replicas_for(asked)  # a latency or utilisation floor raised it
        if in_spec and want != now and not missed and holds(asked, now, tolerance):
            counts.append(now)
            reasons.append(f"{name}: holds {now}: load {_r(asked)} is within {_pct(tolerance)}")
        else:
            counts.append(want)
    return Replicas(*counts), reasons


def _waiting(current: Replicas, desired: Replicas, stable: Replicas, window_s: float) -> list[str]:
    reasons = []
    for name, now, want, got in (
        ("prefill", current.prefill, desired.prefill, stable.prefill),
        ("decode", current.decode, desired.decode, stable.decode),
    ):
        if want < now and got > want:
            reasons.append(
                f"{name}: scale-down to {want} waits: {got} was wanted in the last {window_s:g} s"
            )
    return reasons


# --- conversions and formatting -----------------------------------------------------------------
def waiting_tokens(
    waiting_requests: float, input_tokens_per_s: float, arrival_rate: float
) -> float:
    """``queue_depth`` from the waiting requests an engine reports (vLLM's
    num_requests_waiting): times the mean prompt, input tokens/s over requests/s."""
    if arrival_rate <= 0:
        return 0.0
    return waiting_requests * input_tokens_per_s / arrival_rate


def _min(role: RoleBounds | None) -> int:
    return 0 if role is None else role.min_replicas


def _clamp(role: RoleBounds | None, replicas: int) -> int:
    return 0 if role is None else role.clamp(replicas)


def _cards(role: RoleBounds | None, replicas: int) -> int:
    return 0 if role is None else replicas * role.cards_per_replica


def _n(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:,.2g}"


def _r(replicas: float) -> str:
    whole = replicas_for(replicas)
    return f"{whole} replica{'' if whole == 1 else 's'} ({replicas:.2f})"


def _pct(share: float) -> str:
    return f"{share:.0%}"


def _s(seconds: float | None) -> str:
    return (
        "-"
        if seconds is None
        else f"{seconds * 1000:.0f} ms"
        if seconds < 1
        else f"{seconds:.2f} s"
    )


def _q(value: Fraction) -> str:
    return f"{float(value):g}"
