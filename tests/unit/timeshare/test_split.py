"""The target split of a supernode's cards in a window: inference within the window's cap and
the pool, each service's roles within minReplicas..replicas keeping ratio, by priority; training
gets the rest, elastic jobs shrunk before any job is suspended, lowest priority first, and
window-restricted jobs only in their windows."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixpool.api import inferenceservice, supernode, trainingjob
from matrixpool.timeshare import split

Key = split.WorkloadKey
INSUFFICIENT = split.Reason.INSUFFICIENT_CARDS
OUTSIDE = split.Reason.OUTSIDE_WINDOWS


# --- builders --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Service:
    """``service("chat").priority(2000).role("prefill", 4, floor=1).ratio(prefill=4, decode=1)``"""

    key: str
    rank: int = 1000
    roles: tuple[split.RoleDemand, ...] = ()
    weights: dict[str, int] = field(default_factory=dict)

    def priority(self, value: int) -> Service:
        return Service(self.key, value, self.roles, self.weights)

    def role(
        self, name: str, replicas: int, *, floor: int | None = None, cards: int = 8
    ) -> Service:
        role = split.RoleDemand(name, replicas, replicas if floor is None else floor, cards)
        return Service(self.key, self.rank, (*self.roles, role), self.weights)

    def ratio(self, **weights: int) -> Service:
        return Service(self.key, self.rank, self.roles, weights)

    @property
    def demand(self) -> split.InferenceDemand:
        return split.InferenceDemand(Key(f"ns/{self.key}"), self.rank, self.roles, self.weights)


@dataclass(frozen=True)
class Job:
    """``job("llm").replicas(10, floor=2).cards(8).priority(200).only_in("night")``"""

    key: str
    count: int = 1
    floor: int = 1
    per_replica: int = 8
    rank: int = 100
    windows: frozenset[str] | None = None

    def replicas(self, count: int, *, floor: int | None = None) -> Job:
        floor = count if floor is None else floor
        return Job(self.key, count, floor, self.per_replica, self.rank, self.windows)

    def cards(self, per_replica: int) -> Job:
        return Job(self.key, self.count, self.floor, per_replica, self.rank, self.windows)

    def priority(self, rank: int) -> Job:
        return Job(self.key, self.count, self.floor, self.per_replica, rank, self.windows)

    def only_in(self, *windows: str) -> Job:
        return Job(
            self.key, self.count, self.floor, self.per_replica, self.rank, frozenset(windows)
        )

    @property
    def demand(self) -> split.TrainingDemand:
        key = Key(f"ns/{self.key}")
        return split.TrainingDemand(
            key, self.rank, self.count, self.floor, self.per_replica, self.windows
        )


def service(name: str) -> Service:
    return Service(name)


def job(name: str) -> Job:
    return Job(name)


def window(name: str, cap: int) -> supernode.TimeWindow:
    return supernode.TimeWindow(name=name, start="08:00", end="22:00", inference_cards=cap)


def split_of(
    pool: int,
    in_window: supernode.TimeWindow | None,
    services: Sequence[Service] = (),
    jobs: Sequence[Job] = (),
) -> split.Split:
    return split.target_split(
        pool, in_window, [s.demand for s in services], [j.demand for j in jobs]
    )


# --- the cap and the rest --------------------------------------------------------------------
def test_inference_is_capped_by_the_window_and_training_gets_the_rest() -> None:
    chat = service("chat").role("serve", 40, floor=0)
    llm = job("llm").replicas(16, floor=4).cards(8)
    day = split_of(384, window("day", 320), [chat], [llm])
    assert day.inference == {"ns/chat": {"serve": 40}}
    assert day.training == {"ns/llm": 8}
    assert (day.inference_cards, day.training_cards) == (320, 64)
    night = split_of(384, window("night", 64), [chat], [llm])
    assert night.inference == {"ns/chat": {"serve": 8}}
    assert night.training == {"ns/llm": 16}
    assert (night.window, night.inference_cards, night.training_cards) == ("night", 64, 128)


def test_training_gets_what_inference_leaves_of_the_pool_not_of_the_cap() -> None:
    chat = service("chat").role("serve", 10, floor=0)
    llm = job("llm").replicas(40, floor=1).cards(8)
    result = split_of(384, window("day", 320), [chat], [llm])
    assert (result.inference_cards, result.training_cards) == (80, 304)


def test_inference_never_exceeds_the_pool_even_under_a_larger_cap() -> None:
    result = split_of(100, window("day", 1000), [service("chat").role("serve", 40, floor=0)])
    assert result.inference == {"ns/chat": {"serve": 12}}
    assert result.inference_cards == 96


def test_without_time_sharing_inference_may_take_the_whole_pool() -> None:
    result = split_of(64, None, [service("chat").role("serve", 40, floor=0)])
    assert (result.window, result.inference_cards) == (None, 64)


# --- ratio and floors ------------------------------------------------------------------------
def prefill_decode(
    prefill: int, decode: int, *, floors: tuple[int, int] = (0, 0), decode_cards: int = 32
) -> Service:
    """Prefill instances of 8 cards and decode instances of ``decode_cards``."""
    return (
        service("chat")
        .role("prefill", prefill, floor=floors[0], cards=8)
        .role("decode", decode, floor=floors[1], cards=decode_cards)
    )


@pytest.mark.parametrize(
    ("chat", "cap", "expected"),
    [
        pytest.param(
            prefill_decode(8, 2).ratio(prefill=4, decode=1),
            100,
            {"prefill": 4, "decode": 1},
            id="ratio 4:1 grows in whole units of 4 prefill and 1 decode",
        ),
        pytest.param(
            prefill_decode(8, 2).ratio(prefill=4, decode=1),
            127,
            {"prefill": 4, "decode": 1},
            id="a unit that does not fit whole is not granted: rounding is down",
        ),
        pytest.param(
            prefill_decode(8, 2).ratio(prefill=4, decode=1),
            128,
            {"prefill": 8, "decode": 2},
            id="a cap of exactly two units grants two units",
        ),
        pytest.param(
            prefill_decode(8, 4, decode_cards=8).ratio(prefill=4, decode=2),
            24,
            {"prefill": 2, "decode": 1},
            id="ratio 4:2 climbs as 2:1",
        ),
        pytest.param(
            prefill_decode(8, 2, floors=(3, 1), decode_cards=8).ratio(prefill=4, decode=1),
            35,
            {"prefill": 3, "decode": 1},
            id="floors are kept even where they break the ratio",
        ),
        pytest.param(
            prefill_decode(6, 2, decode_cards=8).ratio(prefill=4, decode=1),
            64,
            {"prefill": 6, "decode": 2},
            id="a role at full size stops while the other climbs on to its full size",
        ),
        pytest.param(
            prefill_decode(6, 2, decode_cards=8).ratio(prefill=4, decode=1),
            63,
            {"prefill": 4, "decode": 1},
            id="below the top level the ratio holds",
        ),
        pytest.param(
            prefill_decode(4, 2, decode_cards=8)
            .ratio(prefill=2, decode=1)
            .role("router", 3, floor=1),
            40,
            {"prefill": 2, "decode": 1, "router": 2},
            id="a role outside the ratio climbs alone after the ratio's roles",
        ),
        pytest.param(
            prefill_decode(4, 2, decode_cards=8).ratio(prefill=2, decode=1, gone=5),
            24,
            {"prefill": 2, "decode": 1},
            id="a ratio key naming no role is ignored",
        ),
        pytest.param(
            prefill_decode(4, 2, decode_cards=8),
            40,
            {"prefill": 4, "decode": 1},
            id="without a ratio each role climbs alone, in spec order",
        ),
    ],
)
def test_roles_scale_keeping_ratio_and_floors(
    chat: Service, cap: int, expected: dict[str, int]
) -> None:
    result = split_of(1000, window("day", cap), [chat])
    assert result.inference == {"ns/chat": expected}


# --- priority between services ---------------------------------------------------------------
def test_a_service_whose_floors_do_not_fit_gets_nothing_and_a_smaller_one_after_it_still_runs() -> (
    None
):
    big = service("big").priority(2000).role("decode", 40, floor=40)
    small = service("small").role("serve", 4, floor=1)
    result = split_of(384, window("night", 64), [big, small])
    assert result.inference == {"ns/big": {"decode": 0}, "ns/small": {"serve": 4}}
    assert result.reasons == {"ns/big": INSUFFICIENT}


def test_every_service_keeps_its_floors_before_any_grows() -> None:
    high = service("high").priority(2000).role("serve", 8, floor=1)
    low = service("low").role("serve", 8, floor=1)
    result = split_of(384, window("day", 32), [low, high])
    assert result.inference == {"ns/high": {"serve": 3}, "ns/low": {"serve": 1}}


def test_services_of_equal_priority_grow_in_name_order() -> None:
    a, b = service("a").role("serve", 8, floor=0), service("b").role("serve", 8, floor=0)
    result = split_of(384, window("day", 40), [b, a])
    assert result.inference == {"ns/a": {"serve": 5}, "ns/b": {"serve": 0}}
    assert result.reasons == {}


# --- training --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("jobs", "pool", "expected", "reasons"),
    [
        pytest.param(
            [job("hi").replicas(10, floor=2).priority(200), job("lo").replicas(4).priority(100)],
            100,
            {"ns/hi": 8, "ns/lo": 4},
            {},
            id="an elastic job shrinks so that a rigid lower-priority job is not suspended",
        ),
        pytest.param(
            [
                job("a").replicas(5).priority(300),
                job("b").replicas(5).priority(200),
                job("c").replicas(5).priority(100),
            ],
            100,
            {"ns/a": 5, "ns/b": 5, "ns/c": 0},
            {"ns/c": INSUFFICIENT},
            id="the lowest-priority job is suspended first",
        ),
        pytest.param(
            [job("big").replicas(15).priority(300), job("small").replicas(5).priority(100)],
            100,
            {"ns/big": 0, "ns/small": 5},
            {"ns/big": INSUFFICIENT},
            id="a job too big for the rest is suspended and smaller ones still run",
        ),
        pytest.param(
            [
                job("hi").replicas(10, floor=2).priority(200),
                job("lo").replicas(10, floor=2).priority(100),
            ],
            100,
            {"ns/hi": 10, "ns/lo": 2},
            {},
            id="the lower-priority elastic job is the one shrunk",
        ),
        pytest.param(
            [job("hi").replicas(10, floor=2).priority(200), job("lo").replicas(4).priority(100)],
            40,
            {"ns/hi": 5, "ns/lo": 0},
            {"ns/lo": INSUFFICIENT},
            id="when shrinking is not enough the lower-priority job is suspended",
        ),
        pytest.param(
            [job("a").replicas(3).cards(16), job("b").replicas(3).cards(16)],
            60,
            {"ns/a": 3, "ns/b": 0},
            {"ns/b": INSUFFICIENT},
            id="jobs of equal priority are served in name order",
        ),
    ],
)
def test_training_gets_the_rest_shrinking_before_suspending(
    jobs: list[Job], pool: int, expected: dict[str, int], reasons: dict[str, split.Reason]
) -> None:
    result = split_of(pool, window("night", 0), [], jobs)
    assert result.training == expected
    assert result.reasons == reasons


def test_a_night_only_job_is_suspended_by_day_and_runs_at_night() -> None:
    nightly = job("nightly").replicas(4).only_in("night")
    day = split_of(384, window("day", 320), [], [nightly])
    assert (day.training, day.reasons) == ({"ns/nightly": 0}, {"ns/nightly": OUTSIDE})
    night = split_of(384, window("night", 64), [], [nightly])
    assert (night.training, night.reasons) == ({"ns/nightly": 4}, {})


def test_without_time_sharing_a_window_restricted_job_does_not_run() -> None:
    result = split_of(384, None, [], [job("nightly").only_in("night"), job("any")])
    assert result.training == {"ns/nightly": 0, "ns/any": 1}
    assert result.reasons == {"ns/nightly": OUTSIDE}


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: split.RoleDemand("r", 2, 3, 8), id="a role floor above replicas"),
        pytest.param(lambda: split.RoleDemand("r", 2, 1, 0), id="a role of zero cards"),
        pytest.param(
            lambda: split.TrainingDemand(Key("ns/j"), 1, 2, 3, 8), id="a job floor above replicas"
        ),
        pytest.param(
            lambda: split.InferenceDemand(Key("ns/s"), 1, ()), id="a service without roles"
        ),
        pytest.param(
            lambda: split.InferenceDemand(Key("ns/s"), 1, (split.RoleDemand("r", 1, 1, 1),) * 2),
            id="a service with a role twice",
        ),
    ],
)
def test_impossible_demands_are_refused(build: object) -> None:
    assert callable(build)
    with pytest.raises(ValueError, match="need"):
        build()


# --- from the API models ---------------------------------------------------------------------
def test_a_service_demand_counts_the_cards_of_every_pod_of_an_instance() -> None:
    spec = inferenceservice.parse_spec(
        {
            "roles": [
                {"name": "prefill", "replicas": 4, "minReplicas": 1, "cardsPerPod": 8},
                {"name": "decode", "replicas": 1, "podsPerReplica": 40, "cardsPerPod": 8},
            ],
            "ratio": {"prefill": 4, "decode": 1},
        }
    )
    demand = split.demand_of_service("ns", "chat", spec)
    assert demand == split.InferenceDemand(
        Key("ns/chat"),
        inferenceservice.DEFAULT_PRIORITY,
        (split.RoleDemand("prefill", 4, 1, 8), split.RoleDemand("decode", 1, 1, 320)),
        {"prefill": 4, "decode": 1},
    )


def test_a_job_demand_keeps_its_windows_and_its_cards_per_rank() -> None:
    spec = trainingjob.parse_spec(
        {"replicas": 4, "minReplicas": 2, "cardsPerReplica": 16, "windows": ["night"]}
    )
    demand = split.demand_of_job("ns", "llm", spec)
    assert demand == split.TrainingDemand(
        Key("ns/llm"), trainingjob.DEFAULT_PRIORITY, 4, 2, 16, frozenset({"night"})
    )
    rigid = split.demand_of_job(
        "ns", "x", trainingjob.parse_spec({"replicas": 3, "cardsPerReplica": 8})
    )
    assert (rigid.min_replicas, rigid.windows) == (3, None)


# --- properties ------------------------------------------------------------------------------
@st.composite
def role_sets(draw: st.DrawFn) -> tuple[tuple[split.RoleDemand, ...], dict[str, int]]:
    roles = []
    for index in range(draw(st.integers(1, 3))):
        replicas = draw(st.integers(1, 8))
        floor = draw(st.integers(0, replicas))
        cards = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
        roles.append(split.RoleDemand(f"r{index}", replicas, floor, cards))
    named = draw(st.lists(st.sampled_from([r.name for r in roles]), unique=True))
    return tuple(roles), {name: draw(st.integers(1, 4)) for name in named}


@st.composite
def service_demands(draw: st.DrawFn) -> list[split.InferenceDemand]:
    count = draw(st.integers(0, 4))
    demands = []
    for index in range(count):
        roles, ratio = draw(role_sets())
        priority = draw(st.sampled_from([100, 1000, 2000]))
        demands.append(split.InferenceDemand(Key(f"ns/s{index}"), priority, roles, ratio))
    return demands


@st.composite
def job_demands(draw: st.DrawFn) -> list[split.TrainingDemand]:
    demands = []
    for index in range(draw(st.integers(0, 5))):
        replicas = draw(st.integers(1, 16))
        windows = draw(st.none() | st.frozensets(st.sampled_from(["day", "night"]), min_size=1))
        demands.append(
            split.TrainingDemand(
                Key(f"ns/j{index}"),
                draw(st.sampled_from([50, 100, 200])),
                replicas,
                draw(st.integers(1, replicas)),
                draw(st.sampled_from([1, 2, 4, 8, 16])),
                windows,
            )
        )
    return demands


windows_or_none = st.none() | st.builds(
    window, st.sampled_from(["day", "night"]), st.integers(0, 512)
)


Demand = TypeVar("Demand", split.InferenceDemand, split.TrainingDemand)


def in_order(demands: Sequence[Demand]) -> list[Demand]:
    return sorted(demands, key=lambda d: (-d.priority, d.key))


def service_floor(demand: split.InferenceDemand) -> int:
    return sum(r.min_replicas * r.cards_per_replica for r in demand.roles)


def ladder_level(ladder: split.Ladder, replicas: Mapping[str, int]) -> int:
    """The highest level at which the ladder shows these replicas."""
    counts = tuple(replicas[r.name] for r in ladder.roles)
    return max(k for k in range(ladder.top + 1) if ladder.replicas(k) == counts)


@settings(max_examples=400)
@given(st.integers(0, 512), windows_or_none, service_demands(), job_demands())
def test_the_split_never_exceeds_the_cap_or_the_pool(
    pool: int,
    in_window: supernode.TimeWindow | None,
    services: list[split.InferenceDemand],
    jobs: list[split.TrainingDemand],
) -> None:
    result = split.target_split(pool, in_window, services, jobs)
    cap = pool if in_window is None else in_window.inference_cards
    held = sum(
        result.inference[s.key][r.name] * r.cards_per_replica for s in services for r in s.roles
    )
    trained = sum(result.training[j.key] * j.cards_per_replica for j in jobs)
    assert held == result.inference_cards <= min(cap, pool)
    assert trained == result.training_cards <= pool - result.inference_cards


@settings(max_examples=400)
@given(st.integers(0, 512), windows_or_none, service_demands())
def test_services_keep_floors_and_ratio_and_grow_by_priority(
    pool: int, in_window: supernode.TimeWindow | None, services: list[split.InferenceDemand]
) -> None:
    result = split.target_split(pool, in_window, services, [])
    budget = split.inference_budget(pool, in_window)
    left = budget - result.inference_cards
    floors_before = 0
    for demand in in_order(services):
        granted = result.inference[demand.key]
        if demand.key in result.reasons:  # floors kept, or nothing: and only if they did not fit
            assert result.reasons[demand.key] is INSUFFICIENT
            assert set(granted.values()) == {0}
            assert service_floor(demand) > budget - floors_before
            continue
        floors_before += service_floor(demand)
        assert all(r.min_replicas <= granted[r.name] <= r.replicas for r in demand.roles)
        assert_ratio_kept(demand, granted)
    assert_growth_by_priority(
        [(s, result.inference[s.key]) for s in in_order(services) if s.key not in result.reasons],
        left,
    )


def assert_ratio_kept(demand: split.InferenceDemand, granted: Mapping[str, int]) -> None:
    """Some whole level k gives every ratio role clamp(k x unit, minReplicas, replicas)."""
    roles = [r for r in demand.roles if r.name in demand.ratio]
    if not roles:
        return
    divisor = math.gcd(*(demand.ratio[r.name] for r in roles))
    units = {r.name: demand.ratio[r.name] // divisor for r in roles}
    assert any(
        all(
            granted[r.name] == max(r.min_replicas, min(k * units[r.name], r.replicas))
            for r in roles
        )
        for k in range(max(r.replicas for r in roles) + 1)
    ), (demand, granted)


def assert_growth_by_priority(
    admitted: list[tuple[split.InferenceDemand, Mapping[str, int]]], left: int
) -> None:
    """A ladder short of its top could not climb one more level with the cards that every
    later ladder grew by plus the cards left: lower priority grows only with what higher
    priority cannot use."""
    ladders = [
        (ladder, granted) for demand, granted in admitted for ladder in split.ladders_of(demand)
    ]
    growth = [
        ladder.cards(ladder_level(ladder, granted)) - ladder.cards(0) for ladder, granted in ladders
    ]
    for index, (ladder, granted) in enumerate(ladders):
        level = ladder_level(ladder, granted)
        if level < ladder.top:
            step = ladder.cards(level + 1) - ladder.cards(level)
            assert step > left + sum(growth[index + 1 :])


@settings(max_examples=400)
@given(st.integers(0, 512), windows_or_none, job_demands())
def test_training_shrinks_elastic_jobs_before_suspending_the_lowest_priority(
    pool: int, in_window: supernode.TimeWindow | None, jobs: list[split.TrainingDemand]
) -> None:
    result = split.target_split(pool, in_window, [], jobs)
    name = None if in_window is None else in_window.name
    budget = pool - result.inference_cards
    eligible = []
    for demand in in_order(jobs):
        if demand.windows is not None and name not in demand.windows:
            assert (result.training[demand.key], result.reasons[demand.key]) == (0, OUTSIDE)
        else:
            eligible.append(demand)
    floors_before = 0
    running = []
    for demand in eligible:
        replicas = result.training[demand.key]
        floor = demand.min_replicas * demand.cards_per_replica
        if demand.key in result.reasons:
            # Suspended only if its floor does not fit even with every higher-priority job at
            # its floor and every lower-priority job suspended.
            assert (replicas, result.reasons[demand.key]) == (0, INSUFFICIENT)
            assert floor > budget - floors_before
        else:
            assert demand.min_replicas <= replicas <= demand.replicas
            floors_before += floor
            running.append((demand, replicas))
    left = budget - result.training_cards
    growth = [(n - d.min_replicas) * d.cards_per_replica for d, n in running]
    for index, (demand, replicas) in enumerate(running):
        if replicas < demand.replicas:  # shrunk: a lower-priority job got none of its cards
            assert demand.cards_per_replica > left + sum(growth[index + 1 :])


@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 1000),
)
def test_the_ratio_holds_exactly_when_floors_and_full_sizes_allow(
    prefill: int, decode: int, units: int, cap: int
) -> None:
    chat = (
        service("chat")
        .role("prefill", prefill * units, floor=0, cards=8)
        .role("decode", decode * units, floor=0, cards=32)
        .ratio(prefill=prefill, decode=decode)
    )
    granted = split_of(10_000, window("day", cap), [chat]).inference[Key("ns/chat")]
    unit = math.gcd(prefill, decode)
    assert granted["prefill"] * decode == granted["decode"] * prefill
    assert granted["prefill"] % (prefill // unit) == 0
