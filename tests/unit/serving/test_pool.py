"""Admission to a supernode's KV-cache pool (matrixpool.serving.pool): table tests and the
properties that make it safe — never more reserved than the pool, quotas that fit each daemon,
and a reservation held is never taken by a newcomer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from matrixpool.serving import pool
from matrixpool.serving.pool import Admitted, Claim, Pool, Reason, Waiting

GI = 1 << 30
SN = {"sn-0": Pool("sn-0", members=4, per_node_bytes=16 * GI)}  # 64 GiB in all


def claim(uid: str, gib: int, priority: int = 0, created: str = "t0", held: bool = False) -> Claim:
    return Claim(uid, "sn-0", gib * GI, priority, created, held)


def test_a_service_that_fits_is_admitted_with_an_equal_quota_on_each_daemon() -> None:
    assert pool.admit(SN, [claim("a", 40)]) == {"a": Admitted("sn-0", 40 * GI, 10 * GI)}


def test_a_service_beyond_what_is_left_waits_and_is_told_the_figures() -> None:
    decided = pool.admit(SN, [claim("a", 40, created="t0"), claim("b", 30, created="t1")])
    assert isinstance(decided["a"], Admitted)
    waiting = decided["b"]
    assert isinstance(waiting, Waiting)
    assert waiting.reason is Reason.POOL_FULL
    assert waiting.message == (
        "spec.kvCache.bytes 30Gi does not fit the KV-cache pool of SuperNode 'sn-0': 64Gi"
        " (4 nodes × 16Gi), 40Gi reserved by other services, 24Gi free"
    )


def test_higher_priority_goes_first_among_newcomers() -> None:
    decided = pool.admit(SN, [claim("low", 40, 1, "t0"), claim("high", 40, 9, "t1")])
    assert isinstance(decided["high"], Admitted)
    assert isinstance(decided["low"], Waiting)


def test_a_held_reservation_is_never_taken_by_a_higher_priority_newcomer() -> None:
    decided = pool.admit(SN, [claim("old", 40, 0, "t0", held=True), claim("vip", 40, 9, "t1")])
    assert isinstance(decided["old"], Admitted)
    assert isinstance(decided["vip"], Waiting)


def test_a_smaller_service_fills_what_a_larger_one_cannot_use() -> None:
    decided = pool.admit(
        SN,
        [
            claim("a", 40, created="t0"),
            claim("big", 30, created="t1"),
            claim("s", 20, created="t2"),
        ],
    )
    assert isinstance(decided["big"], Waiting)
    assert decided["s"] == Admitted("sn-0", 20 * GI, 5 * GI)


def test_the_reasons_a_pool_cannot_serve_a_claim() -> None:
    pools = {"bare": Pool("bare", 4, 0), "empty": Pool("empty", 0, GI)}
    claims = [
        Claim("x", "nowhere", GI, 0, "t0"),
        Claim("y", "bare", GI, 0, "t0"),
        Claim("z", "empty", GI, 0, "t0"),
    ]
    decided = pool.admit(pools, claims)
    reasons = {uid: d.reason for uid, d in decided.items() if isinstance(d, Waiting)}
    assert reasons == {
        "x": Reason.UNKNOWN_SUPERNODE,
        "y": Reason.NO_MEMORY_POOL,
        "z": Reason.NO_POOL_NODES,
    }
    assert "spec.memoryPool" in decided["y"].message  # type: ignore[union-attr]


def test_bytes_read_as_kubernetes_writes_them() -> None:
    assert [pool.human(n) for n in (100, 1536, 512 << 20, 3 * GI // 2, 5 << 40)] == [
        "100",
        "1.5Ki",
        "512Mi",
        "1.5Gi",
        "5Ti",
    ]


claims_strategy = st.lists(
    st.builds(
        Claim,
        uid=st.uuids().map(str),
        super_node=st.sampled_from(["sn-0", "sn-1"]),
        bytes=st.integers(1, 80 * GI),
        priority=st.integers(0, 3),
        created=st.sampled_from(["t0", "t1", "t2"]),
        held=st.booleans(),
    ),
    max_size=12,
    unique_by=lambda c: c.uid,
)
pools_strategy = st.fixed_dictionaries(
    {
        "sn-0": st.builds(Pool, st.just("sn-0"), st.integers(1, 8), st.integers(0, 32 * GI)),
        "sn-1": st.builds(Pool, st.just("sn-1"), st.integers(1, 8), st.integers(0, 32 * GI)),
    }
)


@given(pools_strategy, claims_strategy)
def test_no_pool_is_oversubscribed_and_each_daemons_quotas_fit_it(
    pools: dict[str, Pool], claims: list[Claim]
) -> None:
    decided = pool.admit(pools, claims)
    assert set(decided) == {c.uid for c in claims}
    for name, p in pools.items():
        admitted = [d for d in decided.values() if isinstance(d, Admitted) and d.super_node == name]
        assert sum(d.bytes for d in admitted) <= p.capacity_bytes
        assert sum(d.quota_bytes for d in admitted) <= p.per_node_bytes


@given(pools_strategy, claims_strategy, claims_strategy)
def test_newcomers_never_displace_a_held_reservation_that_fit_alone(
    pools: dict[str, Pool], held: list[Claim], newcomers: list[Claim]
) -> None:
    held = [Claim(c.uid, c.super_node, c.bytes, c.priority, c.created, True) for c in held]
    fresh = [c for c in newcomers if c.uid not in {h.uid for h in held}]
    fresh = [Claim(c.uid, c.super_node, c.bytes, c.priority, c.created, False) for c in fresh]
    alone = pool.admit(pools, held)
    together = pool.admit(pools, held + fresh)
    for uid, decision in alone.items():
        assert together[uid] == decision


def test_status_quantities_are_exact() -> None:
    assert [pool.quantity(n) for n in (0, 1000, 1536, 64 * GI, 3 << 40, GI + 1)] == [
        "0",
        "1000",
        "1536",
        "64Gi",
        "3Ti",
        str(GI + 1),
    ]
