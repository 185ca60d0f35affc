"""The engine's prefix cache over the supernode's KV-cache pool (matrixpool.serving.prefixpool)
and the server using it, with a pool in a dict standing in for the daemons (the daemons
themselves: tests/checkpoint/test_kv_pool.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import test_utils, web

from matrixpool.serving import __main__ as entry
from matrixpool.serving import engine, prefixpool, server
from tests.unit.serving.test_server import FAST, HeldClock, body, samples

BLOCK = engine.BLOCK_TOKENS


@dataclass(frozen=True)
class Run:
    blocks: int
    remote: bool


@dataclass
class DictPool:
    """Blocks by hash; ``remote`` hashes are another node's; ``gone`` makes every call miss;
    a look-up (a store) waits for ``lookups`` (``stores``) to be set, when given."""

    blocks: dict[str, int] = field(default_factory=dict)  # hash → tokens
    remote: set[str] = field(default_factory=set)
    fetched: list[str] = field(default_factory=list)  # blocks looked at, in order
    stored: list[tuple[str, int, int]] = field(default_factory=list)  # hash, tokens, bytes
    gone: bool = False
    lookups: threading.Event | None = None
    stores: threading.Event | None = None
    refreshed: int = 0

    def fetch_run(self, hashes: Sequence[str]) -> Run:
        if self.lookups is not None:
            self.lookups.wait(10)
        blocks, remote = 0, False
        for block_hash in hashes:
            self.fetched.append(block_hash)
            if self.gone or block_hash not in self.blocks:
                break
            blocks, remote = blocks + 1, remote or block_hash in self.remote
        return Run(blocks, remote)

    def put_run(self, blocks: Sequence[tuple[str, int]], data: bytes) -> int:
        if self.stores is not None:
            self.stores.wait(10)
        if self.gone:
            return 0
        for block_hash, tokens in blocks:
            self.blocks[block_hash] = tokens
            self.stored.append((block_hash, tokens, len(data)))
        return len(blocks)

    def refresh_holders(self) -> set[str]:
        self.refreshed += 1
        return set()


def test_the_longest_run_of_blocks_from_the_start_is_the_hit() -> None:
    hashes = engine.block_hashes(list(range(5 * BLOCK + 3)))
    pool = DictPool({hashes[0]: BLOCK, hashes[1]: 2 * BLOCK, hashes[3]: 4 * BLOCK})
    prefixes = prefixpool.PooledPrefixes(pool, block_bytes=64)
    looked = prefixes.look_up(hashes)
    assert (looked.blocks, looked.tokens, looked.remote) == (2, 2 * BLOCK, False)
    assert pool.fetched == list(hashes[:3])  # stops at the first block missing
    assert prefixes(hashes[1]) == engine.Hit(2 * BLOCK, False)
    assert prefixes(hashes[0]) is None  # the engine finds the hit under the last block


def test_a_block_from_another_node_makes_the_hit_remote() -> None:
    hashes = engine.block_hashes(list(range(2 * BLOCK)))
    pool = DictPool({hashes[0]: BLOCK, hashes[1]: 2 * BLOCK}, remote={hashes[1]})
    prefixes = prefixpool.PooledPrefixes(pool, block_bytes=64)
    assert prefixes.look_up(hashes).remote
    assert prefixes(hashes[1]) == engine.Hit(2 * BLOCK, True)


def test_keep_stores_only_the_blocks_after_those_found_each_with_its_prefix_length() -> None:
    hashes = engine.block_hashes(list(range(3 * BLOCK)))
    pool = DictPool()
    prefixes = prefixpool.PooledPrefixes(pool, block_bytes=64)
    assert prefixes.keep(hashes, skip=1) == 2
    assert pool.stored == [(hashes[1], 2 * BLOCK, 64), (hashes[2], 3 * BLOCK, 64)]


def test_a_pool_that_is_gone_is_a_miss_and_stores_nothing() -> None:
    hashes = engine.block_hashes(list(range(2 * BLOCK)))
    pool = DictPool({hashes[0]: BLOCK}, gone=True)
    prefixes = prefixpool.PooledPrefixes(pool, block_bytes=64)
    assert prefixes.look_up(hashes).blocks == 0
    assert prefixes.keep(hashes, 0) == 0


def test_the_server_serves_a_repeated_prompt_from_the_pool_faster() -> None:
    pool = DictPool()
    prefixes = prefixpool.PooledPrefixes(pool, block_bytes=64)
    prompt = list(range(64 * BLOCK))  # 1,024 tokens: 64 blocks
    app = server.create_app(engine.Engine(model=FAST), model_name="m", prefixes=prefixes)

    async def scenario(client: Any) -> None:
        first = await (await client.post("/v1/completions", json=body(prompt, 1))).json()
        for _ in range(100):  # the blocks are stored in the background
            if len(pool.blocks) == 64:
                break
            await asyncio.sleep(0.01)
        assert len(pool.blocks) == 64
        second = await (await client.post("/v1/completions", json=body(prompt, 1))).json()
        assert first["usage"] == second["usage"]
        found = samples(await (await client.get("/metrics")).text())
        assert found["vllm:prefix_cache_queries_total"] == 2 * 64 * BLOCK
        assert found["vllm:prefix_cache_hits_total"] == 64 * BLOCK
        assert found["matrixpool_serving_kv_pool_blocks_stored_total"] == 64

    async def main() -> None:
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            await scenario(client)

    asyncio.run(main())
    assert app[server.STATE].engine.prefix_cache is prefixes
    assert pool.refreshed >= 1  # which daemons hold blocks is read as the server starts


def pooled_app(pool: DictPool, clock: Any = None, **options: Any) -> web.Application:
    prefixes = prefixpool.PooledPrefixes(pool, block_bytes=64)
    timing = {} if clock is None else {"clock": clock}
    return server.create_app(
        engine.Engine(model=FAST), model_name="m", prefixes=prefixes, **timing, **options
    )


def serve(app: web.Application, scenario: Any) -> None:
    async def main() -> None:
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            await scenario(client)

    asyncio.run(main())


def test_a_request_waiting_on_its_look_up_counts_as_waiting_and_its_ttft_runs_from_receipt() -> (
    None
):
    clock, release = HeldClock(), threading.Event()
    prompt = list(range(4 * BLOCK))

    async def scenario(client: Any) -> None:
        answer = asyncio.create_task(client.post("/v1/completions", json=body(prompt, 1)))
        found: dict[str, float] = {}
        for _ in range(500):  # until the request waits on its look-up
            found = samples(await (await client.get("/metrics")).text())
            if found["vllm:num_requests_waiting"] == 1:
                break
            await asyncio.sleep(0.01)
        assert (found["vllm:num_requests_waiting"], found["vllm:num_requests_running"]) == (1, 0)
        clock.now = 5.0  # the look-up took 5 s
        release.set()
        while not client.app[server.STATE].engine.gauges().running:
            await asyncio.sleep(0.01)
        clock.now = 6.0
        client.app[server.STATE].wake()
        assert (await answer).status == 200
        found = samples(await (await client.get("/metrics")).text())
        assert found["vllm:num_requests_waiting"] == 0
        assert found["vllm:time_to_first_token_seconds_sum"] == pytest.approx(5.0, abs=0.01)
        assert found["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(5.0, abs=0.01)

    serve(pooled_app(DictPool(lookups=release), clock, lookup_budget_s=60), scenario)


def test_a_look_up_past_its_budget_is_computed_without_the_pool() -> None:
    release = threading.Event()
    prompt = list(range(4 * BLOCK))
    pool = DictPool(dict.fromkeys(engine.block_hashes(prompt), BLOCK), lookups=release)

    async def scenario(client: Any) -> None:
        answered = await client.post("/v1/completions", json=body(prompt, 1))
        assert answered.status == 200
        found = samples(await (await client.get("/metrics")).text())
        assert found["vllm:prefix_cache_hits_total"] == 0
        assert found["vllm:num_requests_waiting"] == 0
        release.set()

    try:
        serve(pooled_app(pool, lookup_budget_s=0.05), scenario)
    finally:
        release.set()


def test_stores_that_hang_delay_no_request_and_are_dropped_once_the_queue_is_full() -> None:
    stuck = threading.Event()
    pool = DictPool(stores=stuck)
    requests = server.STORE_QUEUE + 4  # one in the store thread, a full queue, 3 dropped

    async def scenario(client: Any) -> None:
        for index in range(requests):
            prompt = [index, *range(2 * BLOCK)]  # each a prefix the pool lacks
            answered = await client.post("/v1/completions", json=body(prompt, 2))
            assert answered.status == 200
        found = samples(await (await client.get("/metrics")).text())
        assert found["vllm:request_success_total"] == requests
        assert found["matrixpool_serving_kv_pool_stores_dropped_total"] >= 3
        stuck.set()

    try:
        serve(pooled_app(pool), scenario)
    finally:
        stuck.set()


def test_the_pool_comes_from_the_pods_environment(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0k3n\n")
    environ = {
        "MATRIXPOOL_KV_SERVICE": "0b6f3d7e-5a1c-4c1e-9d7a-2f4b8c9e1a01",
        "MATRIXPOOL_KV_TOKEN_FILE": str(token),
        "MATRIXPOOL_KV_DAEMONS": "127.1.0.2:7040,127.1.0.1:7040,127.1.0.2:7040",
        "MATRIXPOOL_KV_BLOCK_BYTES": "4096",
    }
    prefixes = entry.prefixes(entry.parser(environ).parse_args([]))
    assert prefixes is not None
    assert len(prefixes.block) == 4096
    client: Any = prefixes.pool
    assert [e.address for e in client.endpoints] == ["127.1.0.2:7040", "127.1.0.1:7040"]
    assert entry.prefixes(entry.parser({}).parse_args([])) is None


def test_half_a_pool_setting_is_an_error() -> None:
    args = entry.parser({"MATRIXPOOL_KV_SERVICE": "s"}).parse_args([])
    with pytest.raises(SystemExit, match="--kv-token-file"):
        entry.prefixes(args)


def test_an_engine_without_a_pool_looks_nothing_up() -> None:
    app = server.create_app(engine.Engine(model=FAST), model_name="m")
    assert app[server.STATE].prefixes is None
    assert isinstance(app, web.Application)
