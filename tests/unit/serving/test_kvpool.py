"""The daemon's KV-cache pool (matrixpool_recovery.kvpool), pure: quotas, shares, LRU order.

Sizes are small byte counts so the arithmetic reads at a glance; a block's bytes say whose
block it is (``b"a:h1:..."``), so a block handed to the wrong service would show. The daemon
routes over it are exercised on real daemon processes in tests/checkpoint/test_kv_pool.py; the
last tests here read the daemon's ``--kv-pool-bytes`` flag.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixpool_recovery import daemon, errors, kvpool
from matrixpool_recovery.kvpool import Block, KvPool, Refusal, Refused, Stored

HASHES = [f"{n:032x}" for n in range(1, 9)]  # prefix hashes, as engine.block_hashes writes them
H1, H2, H3, H4 = HASHES[:4]


def block(service: str, block_hash: str, size: int, tokens: int = 16) -> Block:
    """A block whose bytes name its owner and hash, padded to `size`."""
    tag = f"{service}:{block_hash}:".encode()
    return Block(tokens, (tag + b"." * size)[:size])


def pool(capacity: int, **quotas: int) -> KvPool:
    """A pool of `capacity` bytes with a quota per service: pool(100, a=60, b=40)."""
    built = KvPool(capacity)
    for service, quota in quotas.items():
        built.set_quota(service, quota)
    return built


def put(into: KvPool, service: str, block_hash: str, size: int) -> Stored | Refused:
    return into.put(service, block_hash, block(service, block_hash, size))


def stored(result: Stored | Refused) -> tuple[kvpool.Key, ...]:
    assert isinstance(result, Stored), result
    return result.evicted


def used(into: KvPool) -> dict[str, int]:
    return {service: u.used_bytes for service, u in into.usage().items()}


# --- one service ------------------------------------------------------------------------------


def test_a_block_put_is_got_back_with_its_token_count() -> None:
    kv = pool(100, a=50)
    assert stored(kv.put("a", H1, Block(32, b"kv-bytes"))) == ()
    assert kv.get("a", H1) == Block(32, b"kv-bytes")
    assert kv.get("a", H2) is None
    assert kv.usage_of("a") == kvpool.Usage(used_bytes=8, quota_bytes=50, share_bytes=50, blocks=1)


def test_a_put_beyond_the_quota_evicts_the_services_oldest_blocks() -> None:
    kv = pool(100, a=30)
    for block_hash in (H1, H2, H3):
        stored(put(kv, "a", block_hash, 10))
    assert stored(put(kv, "a", H4, 20)) == (("a", H1), ("a", H2))
    assert kv.recency("a") == (H3, H4)
    assert used(kv) == {"a": 30}


def test_a_get_makes_the_block_the_most_recently_used() -> None:
    kv = pool(100, a=30)
    for block_hash in (H1, H2, H3):
        stored(put(kv, "a", block_hash, 10))
    kv.get("a", H1)
    assert stored(put(kv, "a", H4, 10)) == (("a", H2),)
    assert kv.recency("a") == (H3, H1, H4)


def test_putting_a_held_hash_again_replaces_it_without_counting_it_twice() -> None:
    kv = pool(100, a=30)
    stored(put(kv, "a", H1, 10))
    stored(put(kv, "a", H2, 10))
    assert stored(put(kv, "a", H1, 20)) == ()  # 10 (H2) + 20 (new H1): within the quota
    assert used(kv) == {"a": 30}
    assert kv.recency("a") == (H2, H1)


def test_lowering_a_quota_evicts_the_oldest_blocks_down_to_it() -> None:
    kv = pool(100, a=40)
    for block_hash in (H1, H2, H3, H4):
        stored(put(kv, "a", block_hash, 10))
    assert kv.set_quota("a", 15) == (("a", H1), ("a", H2), ("a", H3))
    assert used(kv) == {"a": 10}


def test_forgetting_a_service_frees_its_bytes_and_quota() -> None:
    kv = pool(100, a=40, b=40)
    stored(put(kv, "a", H1, 30))
    assert kv.forget("a") == 1
    assert kv.used_bytes == 0
    assert kv.get("a", H1) is None
    assert isinstance(put(kv, "a", H1, 10), Refused)  # no quota any more


@pytest.mark.parametrize(
    ("quotas", "size", "why"),
    [
        ({"a": 30}, 31, "service a has a quota of 30 bytes"),
        ({}, 1, "service a has no quota on this pool"),
        ({"a": 500}, 101, "the pool holds 100 bytes"),
    ],
    ids=[
        "a block larger than the quota never fits",
        "a service without a quota stores nothing",
        "a block larger than the pool never fits",
    ],
)
def test_a_block_that_can_never_fit_is_refused_as_too_large(
    quotas: dict[str, int], size: int, why: str
) -> None:
    kv = pool(100, **quotas)
    result = put(kv, "a", H1, size)
    assert isinstance(result, Refused)
    assert result.why is Refusal.TOO_LARGE
    assert why in result.reason
    assert kv.used_bytes == 0


@pytest.mark.parametrize("text", ["", "abc", "G" * 32, "../" + "0" * 32, "0" * 129, "A" * 32])
def test_a_block_hash_is_16_to_128_lowercase_hex(text: str) -> None:
    with pytest.raises(errors.InvalidNameError):
        kvpool.block_hash(text)


def test_a_block_hash_of_the_engine_is_accepted() -> None:
    assert kvpool.block_hash(H1) == H1


@pytest.mark.parametrize(("tokens", "data"), [(16, b""), (0, b"x"), (kvpool.MAX_TOKENS + 1, b"x")])
def test_a_block_holds_bytes_and_a_sane_token_count(tokens: int, data: bytes) -> None:
    with pytest.raises(ValueError, match="KV block"):
        Block(tokens, data)


# --- several services -------------------------------------------------------------------------


def test_a_service_never_gets_another_services_block_of_the_same_hash() -> None:
    kv = pool(100, a=50, b=50)
    stored(put(kv, "a", H1, 10))
    assert kv.get("b", H1) is None
    stored(put(kv, "b", H1, 10))
    got_a, got_b = kv.get("a", H1), kv.get("b", H1)
    assert got_a is not None
    assert got_b is not None
    assert got_a.data.startswith(b"a:")
    assert got_b.data.startswith(b"b:")


def test_a_service_at_its_quota_evicts_its_own_blocks_never_anothers() -> None:
    kv = pool(100, a=50, b=50)
    stored(put(kv, "b", H1, 40))  # b's block is the oldest in the pool
    stored(put(kv, "a", H2, 50))
    assert stored(put(kv, "a", H3, 10)) == (("a", H2),)
    assert used(kv) == {"a": 10, "b": 40}


def test_quotas_within_the_pool_never_make_a_put_evict_across_services() -> None:
    kv = pool(100, a=60, b=40)
    stored(put(kv, "a", H1, 60))
    stored(put(kv, "b", H1, 40))  # the pool is full
    assert stored(put(kv, "b", H2, 40)) == (("b", H1),)
    assert stored(put(kv, "a", H2, 60)) == (("a", H1),)


def test_oversubscribed_quotas_scale_down_to_shares_of_the_pool() -> None:
    kv = pool(100, a=100, b=100, c=50)
    assert [kv.share(s) for s in "abc"] == [40, 40, 20]


def test_a_full_pool_takes_from_a_service_over_its_share_oldest_first() -> None:
    kv = pool(100, a=100, b=100)  # shares: 50 each
    for block_hash in (H1, H2, H3, H4):
        stored(put(kv, "a", block_hash, 20))  # a: 80, over its share
    assert stored(put(kv, "b", H1, 20)) == ()  # 100: the pool is full
    assert stored(put(kv, "b", H2, 20)) == (("a", H1),)
    assert used(kv) == {"a": 60, "b": 40}
    assert isinstance(put(kv, "b", H3, 10), Refused)  # a's oldest block would leave it at 40


def test_a_full_pool_takes_the_putters_own_excess_first() -> None:
    kv = pool(100, a=100, b=100)  # shares: 50 each
    stored(put(kv, "b", H1, 40))  # the oldest block in the pool, within b's share
    for block_hash in (H1, H2, H3):
        stored(put(kv, "a", block_hash, 20))  # a: 60, over its share; the pool is full
    assert stored(put(kv, "a", H4, 20)) == (("a", H1),)
    assert used(kv) == {"a": 60, "b": 40}


def test_a_put_that_would_take_another_service_below_its_share_is_refused_and_changes_nothing() -> (
    None
):
    kv = pool(100, a=100, b=100)  # shares: 50 each
    stored(put(kv, "a", H1, 60))  # one block: evicting it would leave a at 0 < 50
    stored(put(kv, "b", H1, 30))
    before = (used(kv), kv.recency("a"), kv.recency("b"))
    result = put(kv, "b", H2, 20)  # b: 50, within its share; the pool would hold 110
    assert isinstance(result, Refused)
    assert result.why is Refusal.FULL
    assert "other services' shares" in result.reason
    assert (used(kv), kv.recency("a"), kv.recency("b")) == before


# --- properties -------------------------------------------------------------------------------

SERVICES = ("a", "b", "c")


@dataclass
class Model:
    """What the pool should hold: the bytes each service last stored, in recency order."""

    held: dict[str, dict[str, bytes]] = field(
        default_factory=lambda: {s: {} for s in SERVICES}
    )  # service -> hash -> data, least recently used first

    def touch(self, service: str, block_hash: str, data: bytes) -> None:
        self.held[service].pop(block_hash, None)
        self.held[service][block_hash] = data


Op = tuple[str, str, str, int]  # (put | get | quota, service, hash, size or quota)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "get", "quota"]),
        st.sampled_from(SERVICES),
        st.sampled_from(HASHES[:6]),
        st.integers(1, 60),
    ),
    max_size=60,
)


def replay(
    capacity: int, quotas: dict[str, int], ops: list[Op], counter: itertools.count[int]
) -> None:
    """Run `ops` on a pool and a model, checking the pool's invariants after each."""
    kv = pool(capacity, **quotas)
    model = Model()
    for op, service, block_hash, number in ops:
        if op == "quota":
            evicted = kv.set_quota(service, number)
            check_lru(model, (), evicted)
        elif op == "get":
            got = kv.get(service, block_hash)
            expected = model.held[service].get(block_hash)
            assert (got and got.data) == expected, "a get returns the service's own bytes"
            if got is not None:
                model.touch(service, block_hash, got.data)
        else:
            put_one(kv, model, service, block_hash, number, next(counter))
        check_invariants(kv, model)


def put_one(kv: KvPool, model: Model, service: str, block_hash: str, size: int, n: int) -> None:
    data = (f"{service}:{block_hash}:{n}:".encode() + b"." * size)[:size]
    before = {t: kv.usage_of(t) for t in SERVICES}
    result = kv.put(service, block_hash, Block(16, data))
    if isinstance(result, Refused):
        assert {t: kv.usage_of(t) for t in SERVICES} == before, "a refusal changes nothing"
        return
    check_lru(model, (service, block_hash), result.evicted)
    model.touch(service, block_hash, data)
    for owner in {owner for owner, _ in result.evicted} - {service}:
        assert kv.usage_of(owner).used_bytes >= kv.share(owner), "taken below its share"


def check_lru(
    model: Model, replaced: kvpool.Key | tuple[()], evicted: tuple[kvpool.Key, ...]
) -> None:
    """Each service lost its least recently used blocks, oldest first."""
    for service in SERVICES:
        lost = [h for owner, h in evicted if owner == service]
        order = [h for h in model.held[service] if (service, h) != replaced]
        assert lost == order[: len(lost)], f"{service} lost {lost}, not its oldest of {order}"
        for block_hash in lost:
            del model.held[service][block_hash]


def check_invariants(kv: KvPool, model: Model) -> None:
    usage = kv.usage()
    assert kv.used_bytes <= kv.capacity_bytes
    assert kv.used_bytes == sum(u.used_bytes for u in usage.values())
    for service, u in usage.items():
        assert u.used_bytes <= u.quota_bytes, f"{service} above its quota"
        assert kv.recency(service) == tuple(model.held[service]), "held blocks or their order"


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(40, 200),
    quotas=st.fixed_dictionaries({s: st.integers(0, 150) for s in SERVICES}),
    ops=OPS,
)
def test_quotas_capacity_isolation_and_lru_hold_under_any_sequence(
    capacity: int, quotas: dict[str, int], ops: list[Op]
) -> None:
    replay(capacity, quotas, ops, itertools.count())


@settings(max_examples=200, deadline=None)
@given(
    quotas=st.fixed_dictionaries({s: st.integers(1, 60) for s in SERVICES}),
    ops=OPS,
)
def test_with_quotas_inside_the_pool_a_block_within_the_quota_is_always_stored(
    quotas: dict[str, int], ops: list[Op]
) -> None:
    kv = pool(sum(quotas.values()), **quotas)
    for op, service, block_hash, size in ops:
        if op != "put" or size > quotas[service]:
            continue
        result = put(kv, service, block_hash, size)
        assert isinstance(result, Stored), result
        assert all(owner == service for owner, _ in result.evicted), "evicted across services"


# --- the daemon's flag ------------------------------------------------------------------------


def daemon_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    folders = ["--memory-dir", str(tmp_path / "memory"), "--data-dir", str(tmp_path / "disk")]
    return daemon.arguments([*folders, "--secret-file", str(secret), *extra])


def test_a_daemon_has_no_kv_pool_unless_given_one(tmp_path: Path) -> None:
    assert daemon_args(tmp_path).kv_pool_bytes == 0
    assert daemon_args(tmp_path, "--kv-pool-bytes", "2Gi").kv_pool_bytes == 2 << 30


def test_the_kv_pool_comes_out_of_the_daemons_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    memory = ["--memory-bytes", "1Gi", "--memory-headroom", "256Mi"]
    daemon_args(tmp_path, *memory, "--kv-pool-bytes", "512Mi")  # 256Mi left for tier 1
    with pytest.raises(SystemExit):
        daemon_args(tmp_path, *memory, "--kv-pool-bytes", "768Mi")
    assert "above --memory-headroom plus --kv-pool-bytes" in capsys.readouterr().err


def test_the_help_tells_of_the_kv_pool(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        daemon.arguments(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-pool-bytes" in text
    assert "served on /v1/kv within a quota per service" in text
