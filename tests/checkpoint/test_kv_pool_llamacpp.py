"""The KV-cache pool holds a real engine's KV cache (issue 33, item 4): llama.cpp's server
behind ``python -m matrixpool.serving.kvproxy``, as in its pod, over daemons on loopback.

Each replica is a ``llama-server`` (``matrixpool.devcluster.engine``'s tiny random model, two
slots, ``--slot-save-path``) and its proxy, given the service's token file and the daemons,
its own node's first. What the engine computed and what it reused are the engine's own figures
(``timings.prompt_n`` and ``timings.cache_n`` of the stream's last chunk), so nothing here
depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from matrixpool.devcluster import engine
from matrixpool.serving import kvslots
from matrixpool_recovery import credentials, wire
from tests.checkpoint.conftest import OPERATOR, ROOT, SECRET, Cluster

A = "0b6f3d7e-5a1c-4c1e-9d7a-2f4b8c9e1a01"  # an InferenceService's UID, with a quota
NO_QUOTA = "9a8b7c6d-0000-4000-8000-000000000003"  # a service given no quota
QUOTA = 64 << 20  # bytes of A on each daemon: a few slot files of the tiny model
BLOCK = kvslots.BLOCK_TOKENS
START_DEADLINE = 60.0  # seconds an engine and its proxy may take to answer /health
DEADLINE = 30.0  # seconds a store may take to show in the proxy's counters

pytestmark = pytest.mark.timeout(300)


def tokens(seed: int, count: int) -> list[int]:
    """``count`` prompt token ids of the model's byte vocabulary, the same for one seed."""
    return [engine.FIRST_BYTE + (seed * 7919 + i * 104729) % engine.BYTES for i in range(count)]


PREFIX = tokens(1, 6 * BLOCK)  # a system prompt of six whole blocks
ASK = [tokens(seed, 40) for seed in (2, 3, 4, 5)]  # questions after it, each its own


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    return engine.write_model(folder / "m.gguf", width=512, layers=4, feed_forward=1536)


@pytest.fixture(scope="module")
def llama_server() -> Path:
    return engine.server()


@dataclass
class Replica:
    """One engine and the proxy in front of it."""

    url: str  # the proxy's
    processes: list[subprocess.Popen[bytes]]

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


@dataclass
class Replicas:
    """Starts replicas of a service, each on a node whose daemon is asked first."""

    root: Path
    model: Path
    binary: Path
    cluster: Cluster
    started: list[Replica]

    def start(self, name: str, service: str, nodes: list[str]) -> Replica:
        folder = self.root / name
        slots = folder / "slots"
        slots.mkdir(parents=True)
        token = folder / "token"
        token.write_text(credentials.service_token(SECRET, service))
        engine_port, proxy_port = _free_port(), _free_port()
        argv = engine.command(str(self.model), host="127.0.0.1", port=engine_port, slots=2)
        argv = [str(self.binary), *argv[1:], "--slot-save-path", str(slots)]
        proxy = [sys.executable, "-m", "matrixpool.serving.kvproxy"]
        proxy += ["--engine", f"http://127.0.0.1:{engine_port}"]
        proxy += ["--listen", f"127.0.0.1:{proxy_port}", "--slots", "2", "--slot-dir", str(slots)]
        proxy += ["--kv-service", service, "--kv-token-file", str(token)]
        proxy += ["--kv-daemons", ",".join(self.cluster.address(n) for n in nodes)]
        with open(folder / "engine.log", "wb") as log, open(folder / "proxy.log", "wb") as plog:
            started = [subprocess.Popen(argv, stdout=log, stderr=log)]
            started.append(subprocess.Popen(proxy, stdout=plog, stderr=plog, cwd=ROOT))
        replica = Replica(f"http://127.0.0.1:{proxy_port}", started)
        self.started.append(replica)
        _wait_healthy(replica, folder)
        return replica


@pytest.fixture
def replicas(
    cluster: Cluster, model: Path, llama_server: Path, tmp_path: Path
) -> Iterator[Replicas]:
    for node in ("a", "b"):
        cluster.start(node, (), "--kv-pool-bytes", "128Mi")
        _set_quota(cluster, node, A, QUOTA)
    made = Replicas(tmp_path / "replicas", model, llama_server, cluster, [])
    try:
        yield made
    finally:
        for replica in made.started:
            replica.stop()


def _set_quota(cluster: Cluster, node: str, service: str, nbytes: int) -> None:
    endpoint = wire.Endpoint(cluster.address(node), OPERATOR)
    wire.request(endpoint, "PUT", f"/v1/kv/{service}/quota", {"bytes": nbytes})


def _usage(cluster: Cluster, node: str) -> dict[str, dict[str, int]]:
    endpoint = wire.Endpoint(cluster.address(node), OPERATOR)
    services: dict[str, dict[str, int]] = wire.request(endpoint, "GET", "/v1/kv/usage")["services"]
    return services


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_healthy(replica: Replica, folder: Path) -> None:
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{replica.url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if any(p.poll() is not None for p in replica.processes):
            break
        time.sleep(0.2)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(folder.glob("*.log")))
    raise AssertionError(f"replica {folder.name} did not come up:\n{logs}")


# --- talking to a replica ---------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    chunks: int  # data: chunks before [DONE], the closing one included
    computed: int  # prompt tokens the engine computed (timings.prompt_n)
    reused: int  # prompt tokens it took from its cache (timings.cache_n)


def complete(url: str, prompt: list[int], max_tokens: int = 4) -> Answer:
    """One streamed completion through the proxy; the engine's figures from its last chunk."""
    return asyncio.run(_complete(url, prompt, max_tokens))


async def _complete(url: str, prompt: list[int], max_tokens: int) -> Answer:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    chunks: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            if line[5:].strip() == b"[DONE]":
                timings = chunks[-1]["timings"]
                return Answer(len(chunks), timings["prompt_n"], timings["cache_n"])
            chunks.append(json.loads(line[5:]))
    raise AssertionError("the stream ended before [DONE]")


def counters(url: str) -> dict[str, float]:
    """The proxy's matrixpool_kvproxy_* samples by name, and whether the engine's came too."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("matrixpool_kvproxy_"):
                found[sample.name.removeprefix("matrixpool_kvproxy_")] = sample.value
            elif sample.name.startswith("llamacpp:"):
                found["engine_series"] = found.get("engine_series", 0) + 1
    return found


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE} s: {what}"
        time.sleep(0.1)


# --- the tests --------------------------------------------------------------------------------


def test_a_prefix_computed_on_one_replica_is_restored_from_the_pool_on_another(
    replicas: Replicas,
) -> None:
    on_a = replicas.start("on-a", A, ["a", "b"])
    on_b = replicas.start("on-b", A, ["b", "a"])
    first = complete(on_a.url, PREFIX + ASK[0])
    assert (first.computed, first.reused) == (len(PREFIX) + 40, 0)
    assert first.chunks == 4 + 1  # one per token, then llama.cpp's closing chunk
    eventually(lambda: counters(on_a.url)["stored_total"] == 1, "replica a stored its slot")
    assert _usage(replicas.cluster, "a")[A]["blocks"] == 6  # the file and 5 references

    second = complete(on_b.url, PREFIX + ASK[1])

    assert (second.computed, second.reused) == (40, len(PREFIX))  # only the question computed
    seen = counters(on_b.url)
    assert (seen["hits_total"], seen["misses_total"]) == (1, 0)
    assert seen["restored_tokens_total"] == len(PREFIX)
    assert seen["restored_bytes_total"] > 0
    assert seen["engine_series"] > 0  # the engine's own series, beside the proxy's


def test_a_replica_reuses_its_own_slot_without_asking_the_pool(replicas: Replicas) -> None:
    on_a = replicas.start("on-a", A, ["a", "b"])
    complete(on_a.url, PREFIX + ASK[0])
    again = complete(on_a.url, PREFIX + ASK[1])
    assert again.reused >= len(PREFIX)
    seen = counters(on_a.url)
    assert (seen["hits_total"], seen["local_hits_total"]) == (0, 1)


def test_a_killed_daemon_costs_only_its_blocks(replicas: Replicas) -> None:
    on_a = replicas.start("on-a", A, ["a", "b"])
    on_b = replicas.start("on-b", A, ["b", "a"])
    other = tokens(9, 5 * BLOCK)  # another prefix, stored on b's daemon
    complete(on_a.url, PREFIX + ASK[0])  # stored on a
    complete(on_b.url, other + ASK[0])  # stored on b
    eventually(lambda: counters(on_a.url)["stored_total"] == 1, "a stored")
    eventually(lambda: counters(on_b.url)["stored_total"] == 1, "b stored")
    replicas.cluster.kill("a")

    lost = complete(on_b.url, PREFIX + ASK[1])  # a's blocks are gone: computed, still served
    kept = complete(on_a.url, other + ASK[1])  # b's blocks still serve, even a's own replica

    assert (lost.computed, lost.reused) == (len(PREFIX) + 40, 0)
    assert (kept.computed, kept.reused) == (40, len(other))
    assert counters(on_b.url)["misses_total"] == 2  # its first prompt, then the one on a
    assert counters(on_a.url)["hits_total"] == 1
    assert counters(on_a.url)["pool_daemons_down"] == 1  # its own node's, skipped for a while


def test_a_service_without_a_quota_stores_nothing_but_is_served(replicas: Replicas) -> None:
    unpooled = replicas.start("no-quota", NO_QUOTA, ["a", "b"])
    answer = complete(unpooled.url, PREFIX + ASK[0])
    assert answer.computed == len(PREFIX) + 40
    eventually(lambda: counters(unpooled.url)["store_refused_total"] == 1, "the put refused")
    assert counters(unpooled.url)["stored_total"] == 0
    assert NO_QUOTA not in _usage(replicas.cluster, "a")


def test_requests_beyond_the_slots_wait_for_one_and_are_all_served(replicas: Replicas) -> None:
    on_a = replicas.start("on-a", A, ["a", "b"])

    async def three() -> list[Answer]:
        prompts = [PREFIX + ask for ask in ASK[:3]]
        return list(await asyncio.gather(*(_complete(on_a.url, p, 4) for p in prompts)))

    answers = asyncio.run(three())  # two slots, three requests at once
    assert [a.chunks for a in answers] == [5, 5, 5]
    assert sum(a.computed + a.reused for a in answers) == 3 * (len(PREFIX) + 40)
    assert counters(on_a.url)["requests_total"] == 3
