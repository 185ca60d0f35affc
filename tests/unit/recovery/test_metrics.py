"""matrixpool_recovery.metrics and the daemon's /metrics route, in this process.

Counters are process-wide, so each test reads them before and after what it does. The
multi-process scrape of real daemons is tests/checkpoint/test_metrics.py.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from matrixpool_recovery import daemon, files, memory, metrics

LABELS = {"tier": "local", "operation": "save"}


def value(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_a_shard_adds_its_bytes_once_and_one_latency_observation() -> None:
    before = value("matrixpool_ckpt_bytes_total", LABELS)
    count = value("matrixpool_ckpt_duration_seconds_count", LABELS)

    metrics.observe("local", metrics.SAVE, 4096, 0.02)

    assert value("matrixpool_ckpt_bytes_total", LABELS) == before + 4096
    assert value("matrixpool_ckpt_duration_seconds_count", LABELS) == count + 1
    bucket = {**LABELS, "le": "0.05"}
    assert value("matrixpool_ckpt_duration_seconds_bucket", bucket) >= 1


def test_a_failure_is_counted_by_tier_and_operation() -> None:
    labels = {"tier": "peers", "operation": "replicate"}
    before = value("matrixpool_ckpt_failures_total", labels)

    metrics.failed("peers", metrics.REPLICATE)

    assert value("matrixpool_ckpt_failures_total", labels) == before + 1


def test_memory_use_is_read_when_scraped() -> None:
    used = [10.0]
    metrics.watch_memory(lambda: used[0], 1000)
    used[0] = 250.0

    assert value("matrixpool_ckpt_memory_used_bytes") == 250.0
    assert value("matrixpool_ckpt_memory_limit_bytes") == 1000.0


def test_the_exposition_parses_as_prometheus_text() -> None:
    metrics.observe("memory", metrics.SERVE, 1, 0.001)
    body, content_type = metrics.exposition()

    names = {f.name for f in text_string_to_metric_families(body.decode())}

    assert content_type.startswith("text/plain")
    assert {"matrixpool_ckpt_bytes", "matrixpool_ckpt_duration_seconds"} <= names


@pytest.fixture
def served(tmp_path: Path) -> Iterator[daemon.Server]:
    mem = memory.MemoryTier(tmp_path / "memory", "n1", 1 << 20, 2)
    node = daemon.Daemon("n1", "s3cret", mem, files.DiskTier(tmp_path / "disk", "n1", 2), [], 2)
    server = daemon.Server(("127.0.0.1", 0), node)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
        node.pool.shutdown(wait=True)


def get(server: daemon.Server, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    try:
        connection.request("GET", path)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def test_the_daemon_serves_metrics_without_a_token(served: daemon.Server) -> None:
    status, body = get(served, "/metrics")

    assert status == 200
    assert b"matrixpool_ckpt_memory_limit_bytes 1.048576e+06" in body


def test_the_daemon_still_wants_a_token_elsewhere(served: daemon.Server) -> None:
    assert get(served, "/v1/info")[0] == 401
