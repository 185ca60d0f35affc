"""The KV-cache pool on real daemon processes (issue 16, item 4): quotas across services, one
service's blocks closed to every other token, a lost daemon costing only cache.

Daemons started with ``--kv-pool-bytes`` on loopback (``conftest.Cluster``); the operator's
token sets the quotas, each service talks with its own token through ``kvclient.KvClient``. The
serving engine's prefix cache is the client behind a three-line adapter (written here: the
recovery package may not import matrixpool).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from matrixpool.serving import engine, latency
from matrixpool_recovery import credentials, kvclient, wire
from tests.checkpoint.conftest import OPERATOR, SECRET, Cluster, job_token

A = "0b6f3d7e-5a1c-4c1e-9d7a-2f4b8c9e1a01"  # an InferenceService's UID
B = "7c2e9f10-3b4d-4e5f-8a6b-1c2d3e4f5a02"  # another one's
POOL = "100K"  # --kv-pool-bytes of each daemon: 100,000 bytes
HASHES = engine.block_hashes(list(range(16 * 8)))  # 8 chained prefix hashes
H1, H2, H3, H4 = HASHES[:4]
Answer = tuple[int, bytes, dict[str, str]]  # status, body, headers


def service_token(service: str) -> str:
    """The token a server of `service` is given: that service's KV blocks only."""
    return credentials.service_token(SECRET, service)


def call(
    cluster: Cluster,
    node: str,
    method: str,
    path: str,
    token: str | None,
    body: bytes | None = None,
    **headers: str,
) -> Answer:
    host, port = wire.Endpoint(cluster.address(node), "").host_port
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read(), dict(answer.getheaders())
    finally:
        conn.close()


def put_block(
    cluster: Cluster, node: str, service: str, block_hash: str, data: bytes, token: str
) -> Answer:
    path = f"/v1/kv/{service}/blocks/{block_hash}"
    return call(cluster, node, "PUT", path, token, data, **{kvclient.TOKENS: "16"})


def get_block(cluster: Cluster, node: str, service: str, block_hash: str, token: str) -> Answer:
    return call(cluster, node, "GET", f"/v1/kv/{service}/blocks/{block_hash}", token)


def set_quota(cluster: Cluster, node: str, service: str, nbytes: int) -> dict[str, Any]:
    endpoint = wire.Endpoint(cluster.address(node), OPERATOR)
    answer: dict[str, Any] = wire.request(
        endpoint, "PUT", f"/v1/kv/{service}/quota", {"bytes": nbytes}
    )
    return answer


def usage(cluster: Cluster, node: str) -> dict[str, dict[str, int]]:
    endpoint = wire.Endpoint(cluster.address(node), OPERATOR)
    services: dict[str, dict[str, int]] = wire.request(endpoint, "GET", "/v1/kv/usage")["services"]
    return services


def error_of(answer: Answer) -> str:
    return str(json.loads(answer[1])["error"])


def client(cluster: Cluster, service: str, *nodes: str, **options: Any) -> kvclient.KvClient:
    """A server of `service` on the first node; the others are the supernode's other nodes."""
    addresses = [cluster.address(n) for n in nodes]
    return kvclient.KvClient(service, service_token(service), addresses, **options)


def pooled(cluster: Cluster, *nodes: str) -> Cluster:
    """Start daemons with a KV pool; A and B get 60 kB and 40 kB of each."""
    for node in nodes:
        cluster.start(node, (), "--kv-pool-bytes", POOL)
        set_quota(cluster, node, A, 60_000)
        set_quota(cluster, node, B, 40_000)
    return cluster


@pytest.fixture
def one(cluster: Cluster) -> Cluster:
    return pooled(cluster, "a")


@pytest.fixture
def two(cluster: Cluster) -> Iterator[Cluster]:
    pooled(cluster, "a", "b")
    yield cluster
    for node in cluster.nodes.values():  # a test may have stopped one
        if node.process.poll() is None:
            os.kill(node.process.pid, signal.SIGCONT)


# --- quotas -----------------------------------------------------------------------------------


def test_quotas_are_enforced_across_two_services(one: Cluster) -> None:
    a, b = client(one, A, "a"), client(one, B, "a")
    assert b.put(H1, 16, b"b" * 30_000)  # the oldest block on the node is B's
    for block_hash in (H1, H2, H3):
        assert a.put(block_hash, 16, b"a" * 25_000)  # the third is above A's 60 kB

    assert usage(one, "a") == {
        A: {"usedBytes": 50_000, "quotaBytes": 60_000, "shareBytes": 60_000, "blocks": 2},
        B: {"usedBytes": 30_000, "quotaBytes": 40_000, "shareBytes": 40_000, "blocks": 1},
    }
    assert a.lookup(H1) is None  # A's own oldest block went
    assert b.lookup(H1) == (16, False)  # B's, older still, stayed
    too_large = put_block(one, "a", B, H2, b"b" * 40_001, service_token(B))
    assert too_large[0] == 413
    assert f"service {B} has a quota of 40000 bytes" in error_of(too_large)


def test_a_service_sees_its_own_usage_and_the_operator_sets_quotas(one: Cluster) -> None:
    assert client(one, A, "a").put(H1, 16, b"a" * 1_000)
    status, body, _ = call(one, "a", "GET", f"/v1/kv/{A}/usage", service_token(A))
    assert status == 200
    assert json.loads(body)["usedBytes"] == 1_000

    answer = set_quota(one, "a", A, 500)  # below what A holds: its oldest blocks go
    assert (answer["usedBytes"], answer["evicted"]) == (0, 1)


def test_a_service_without_a_quota_stores_nothing(one: Cluster) -> None:
    other = "9a8b7c6d-0000-4000-8000-000000000003"
    refused = put_block(one, "a", other, H1, b"x" * 10, service_token(other))
    assert refused[0] == 413
    assert "no quota on this pool" in error_of(refused)


# --- trust ------------------------------------------------------------------------------------

FORBIDDEN = [
    pytest.param("GET", f"/v1/kv/{B}/blocks/{H1}", service_token(A), id="A reading B's block"),
    pytest.param("PUT", f"/v1/kv/{B}/blocks/{H1}", service_token(A), id="A overwriting B's block"),
    pytest.param("GET", f"/v1/kv/{B}/usage", service_token(A), id="A reading B's usage"),
    pytest.param("PUT", f"/v1/kv/{A}/quota", service_token(A), id="A raising its own quota"),
    pytest.param("DELETE", f"/v1/kv/{B}", service_token(A), id="A deleting B"),
    pytest.param("GET", "/v1/kv/usage", service_token(A), id="A reading every service's usage"),
    pytest.param("GET", f"/v1/kv/{B}/blocks/{H1}", job_token(B), id="a job token of B's UID"),
    pytest.param("PUT", f"/v1/kv/{B}/blocks/{H1}", job_token(B), id="a job token writing"),
    pytest.param("GET", f"/v1/kv/{B}/usage", job_token(B), id="a job token reading usage"),
    pytest.param("POST", f"/v1/kv/{B}/run", service_token(A), id="A fetching a run of B's"),
    pytest.param("PUT", f"/v1/kv/{B}/run", service_token(A), id="A storing a run as B"),
    pytest.param(
        "GET", f"/v1/inventory?job={A}", service_token(A), id="A reading a job of A's UID"
    ),
    pytest.param(
        "GET", wire.shard_path(A, 0, 1, "status"), service_token(A), id="A on a job's save"
    ),
]


@pytest.mark.parametrize(("method", "path", "token"), FORBIDDEN)
def test_a_token_opens_only_its_own_services_blocks(
    one: Cluster, method: str, path: str, token: str
) -> None:
    assert client(one, B, "a").put(H1, 16, b"b's KV")
    body = b"not B's KV" if method == "PUT" else None
    headers = {kvclient.TOKENS: "16"} if method == "PUT" else {}

    status, answer, _ = call(one, "a", method, path, token, body, **headers)

    assert status == 403, answer
    assert "operator token" in json.loads(answer)["error"]
    assert get_block(one, "a", B, H1, service_token(B))[1] == b"b's KV"
    assert usage(one, "a")[B]["blocks"] == 1


def test_the_same_hash_is_a_different_block_for_each_service(one: Cluster) -> None:
    a, b = client(one, A, "a"), client(one, B, "a")
    assert b.put(H1, 16, b"B's KV of this prefix")
    assert a.lookup(H1) is None  # B holds it; A does not see it
    assert a.put(H1, 16, b"A's KV")
    found_a, found_b = a.fetch(H1), b.fetch(H1)
    assert found_a is not None
    assert found_b is not None
    assert (found_a.data, found_b.data) == (b"A's KV", b"B's KV of this prefix")


def test_a_request_without_a_token_is_told_which_one_it_needs(one: Cluster) -> None:
    status, body, _ = call(one, "a", "GET", f"/v1/kv/{A}/blocks/{H1}", None)
    assert status == 401
    assert f"the service token of {A} or the operator token" in json.loads(body)["error"]


# --- the supernode ----------------------------------------------------------------------------


def test_a_block_put_on_one_node_is_found_remotely_from_another(two: Cluster) -> None:
    on_a, on_b = client(two, A, "a", "b"), client(two, A, "b", "a")
    assert on_a.put(H1, 32, b"k" * 2_000)

    assert on_b.lookup(H1) == (32, True)
    assert on_a.lookup(H1) == (32, False)
    assert on_b.lookup(H2) is None
    assert (on_b.stats.remote_hits, on_b.stats.misses, on_b.stats.bytes_fetched) == (1, 1, 2_000)
    assert usage(two, "b")[A]["blocks"] == 0  # a lookup copies nothing


def test_a_run_of_blocks_is_stored_and_fetched_in_one_request_each(two: Cluster) -> None:
    on_a, on_b = client(two, A, "a", "b"), client(two, A, "b", "a")
    blocks = [(h, 16 * (i + 1)) for i, h in enumerate(HASHES[:3])]
    assert on_a.put_run(blocks, b"k" * 2_000) == 3
    assert on_b.put(H4, 64, b"4" * 2_000)  # the run goes on on b

    run = on_b.fetch_run(HASHES)
    assert (run.blocks, run.tokens, run.remote, run.nbytes) == (4, 64, True, 8_000)
    assert on_b.stats.misses == 1  # HASHES[4] held nowhere
    assert on_a.fetch_run(HASHES[:2]) == kvclient.Run(2, 32, False, 4_000)
    assert on_a.fetch_run(HASHES[5:]) == kvclient.Run(0, 0, False, 0)


def test_a_run_beyond_the_quota_keeps_its_newest_blocks_and_one_too_large_none(
    one: Cluster,
) -> None:
    on_a = client(one, A, "a")
    blocks = [(h, 16 * (i + 1)) for i, h in enumerate(HASHES)]
    assert on_a.put_run(blocks, b"k" * 25_000) == 8  # 60 kB: each evicts the oldest
    assert on_a.fetch_run(HASHES).blocks == 0  # the first went for the later ones
    assert usage(one, "a")[A]["blocks"] == 2
    assert on_a.put_run(blocks[:1], b"k" * 70_000) == 0  # refused (413): it never fits


def test_look_ups_ask_only_the_daemons_that_hold_blocks_of_the_service(two: Cluster) -> None:
    on_a, on_b = client(two, A, "a", "b"), client(two, A, "b", "a")
    assert on_b.refresh_holders() == set()  # a holds none of A's blocks yet
    assert on_a.put(H1, 16, b"on a")
    assert on_b.fetch_run(HASHES).blocks == 0  # a is not asked
    assert on_b.refresh_holders() == {two.address("a")}
    assert on_b.fetch_run(HASHES) == kvclient.Run(1, 16, True, 4)


def test_a_killed_daemon_loses_only_its_cache(two: Cluster) -> None:
    on_a, on_b = client(two, A, "a", "b"), client(two, A, "b", "a")
    assert on_a.put(H1, 16, b"on a")
    assert on_b.put(H2, 32, b"on b")
    two.kill("a")

    assert on_b.lookup(H1) is None  # a miss: the caller recomputes
    assert on_b.down() == [two.address("a")]  # and is not asked again for a while
    assert on_b.lookup(H2) == (32, False)
    assert on_b.put(H3, 16, b"still pooled")
    assert on_a.lookup(H2) == (32, True)  # a server whose own daemon died reads b's blocks
    assert not on_a.put(H4, 16, b"nowhere to go")


def test_a_daemon_that_hangs_costs_one_timeout_then_is_skipped_for_a_while(two: Cluster) -> None:
    now = [0.0]
    on_a = client(two, A, "a", "b", timeout=0.5, retry_after=60, clock=lambda: now[0])
    assert client(two, A, "b").put(H1, 16, b"on b")
    assert on_a.put(H2, 32, b"on a")
    os.kill(two.nodes["a"].process.pid, signal.SIGSTOP)  # accepts connections, answers nothing

    assert on_a.lookup(H1) == (16, True)  # a timed out; b answered
    assert on_a.down() == [two.address("a")]
    assert on_a.lookup(H1) == (16, True)
    assert on_a.stats.failures == 1  # a was not asked again
    os.kill(two.nodes["a"].process.pid, signal.SIGCONT)
    assert on_a.lookup(H2) is None  # still skipped: its blocks are out of reach meanwhile
    now[0] = 61.0
    assert on_a.lookup(H2) == (32, False)  # asked again once retry_after has passed
    assert on_a.down() == []


def test_the_engine_serves_every_request_by_recomputing_once_the_pool_is_gone(
    two: Cluster,
) -> None:
    model = latency.LatencyModel()
    pool = client(two, A, "a", "b")
    prompt = list(range(16 * 8 + 5))  # eight whole blocks and a tail
    hashes = engine.block_hashes(prompt)
    for index, block_hash in enumerate(hashes[:4]):  # the pool holds the first 64 tokens
        tokens = 16 * (index + 1)
        assert pool.put(block_hash, tokens, bytes(64))

    with_pool = serve(prefix_cache(pool), hashes, len(prompt), model)
    two.kill("a")
    two.kill("b")
    without = serve(prefix_cache(pool), hashes, len(prompt), model)

    assert with_pool.cached_tokens == 64
    assert without.cached_tokens == 0  # every lookup missed: all prompt tokens computed
    assert without.first_token_s > with_pool.first_token_s


def prefix_cache(pool: kvclient.KvClient) -> engine.PrefixCache:
    """The engine's prefix-cache hook over the pool."""

    def look_up(block_hash: str) -> engine.Hit | None:
        found = pool.lookup(block_hash)
        return None if found is None else engine.Hit(*found)

    return look_up


def serve(
    cache: engine.PrefixCache, hashes: tuple[str, ...], prompt: int, model: latency.LatencyModel
) -> engine.Timing:
    """One request through an engine with `cache`; its timing, once all its tokens are out."""
    instance = engine.Engine(model=model, prefix_cache=cache)
    assert instance.submit(engine.Request("r", prompt, 4, hashes), now=0.0) is None
    events = instance.advance(60.0)
    [done] = [e for e in events if isinstance(e, engine.Finished)]
    assert sum(isinstance(e, engine.Token) for e in events) == 4
    return done.timing


# --- no pool, bounds, metrics -----------------------------------------------------------------


def test_a_daemon_without_a_pool_says_so_and_is_a_miss(cluster: Cluster) -> None:
    cluster.start("a")
    refused = get_block(cluster, "a", A, H1, service_token(A))
    assert refused[0] == 503
    assert "--kv-pool-bytes 0" in error_of(refused)
    assert put_block(cluster, "a", A, H1, b"x", service_token(A))[0] == 503
    assert client(cluster, A, "a").lookup(H1) is None


def test_a_stalled_block_upload_is_dropped_and_stores_nothing(cluster: Cluster) -> None:
    cluster.start("a", (), "--kv-pool-bytes", POOL, "--read-timeout", "0.5")
    set_quota(cluster, "a", A, 60_000)
    host, port = wire.Endpoint(cluster.address("a"), "").host_port
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.putrequest("PUT", f"/v1/kv/{A}/blocks/{H1}")
        conn.putheader("Authorization", f"Bearer {service_token(A)}")
        conn.putheader("Content-Length", "1000")
        conn.putheader(kvclient.TOKENS, "16")
        conn.endheaders(b"x" * 10)  # then nothing
        answer = conn.getresponse()
        answer.read()
    finally:
        conn.close()
    assert answer.status >= 400
    assert usage(cluster, "a")[A]["blocks"] == 0


def scrape(cluster: Cluster, node: str) -> dict[tuple[str, str], float]:
    """(series, service or result label) -> value of the pool's series."""
    status, body, _ = call(cluster, node, "GET", "/metrics", None)
    assert status == 200
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        if not family.name.startswith("matrixpool_kvpool_"):
            continue
        for sample in family.samples:
            label = sample.labels.get("service", "") + "/" + sample.labels.get("result", "")
            found[(sample.name, label)] = found.get((sample.name, label), 0) + sample.value
    return found


def test_the_pool_reports_bytes_per_service_hits_misses_and_evictions(one: Cluster) -> None:
    a = client(one, A, "a")
    for block_hash in (H1, H2, H3):
        assert a.put(block_hash, 16, b"a" * 25_000)  # the third evicts the first
    assert a.lookup(H3) == (16, False)
    assert a.lookup(H1) is None

    found = scrape(one, "a")
    a_label, b_label = (credentials.metrics_label(SECRET, s) for s in (A, B))
    assert found[("matrixpool_kvpool_capacity_bytes", "/")] == 100_000
    assert found[("matrixpool_kvpool_used_bytes", f"{a_label}/")] == 50_000
    assert found[("matrixpool_kvpool_quota_bytes", f"{b_label}/")] == 40_000
    assert found[("matrixpool_kvpool_lookups_total", f"{a_label}/hit")] == 1
    assert found[("matrixpool_kvpool_lookups_total", f"{a_label}/miss")] == 1
    assert found[("matrixpool_kvpool_evictions_total", f"{a_label}/")] == 1
    # /metrics needs no token: it names no service's UID (issue 31, finding 8)
    _, body, _ = call(one, "a", "GET", "/metrics", None)
    assert A not in body.decode()
    assert B not in body.decode()


class Trickling(BaseHTTPRequestHandler):
    """A daemon that answers one byte of its headers every 0.5 s: each read is quick, the whole
    never ends."""

    def do_GET(self) -> None:
        answer = b"HTTP/1.0 200 OK\r\n" + b"X-Slow: " + b"." * 100
        with contextlib.suppress(OSError):  # until the client hangs up
            for byte in answer:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.5)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_daemon_that_trickles_is_cut_off_at_the_whole_requests_deadline() -> None:
    """Issue 31, finding 8: each byte within the per-read timeout, the lookup still ends by its
    deadline as a miss (the engine recomputes) and the daemon is skipped."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickling)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        pool = kvclient.KvClient(A, service_token(A), [address], timeout=2.0, deadline=1.5)
        started = time.monotonic()
        assert pool.lookup(H1) is None
        took = time.monotonic() - started
        assert took < 4, took  # the deadline, not 100 reads of 0.5 s
        assert pool.down() == [address]
    finally:
        server.shutdown()
        server.server_close()
