"""The checkpoint daemon's /metrics endpoint (issue 7), scraped from real daemon processes.

Two daemons on loopback (``a`` pushes its tier-1 copies to ``b``); a Checkpointer in the test
process saves one shard to every tier, then restores it in place and over HTTP. Each daemon's
``/metrics`` is read without a token and parsed with prometheus-client's parser.
"""

from __future__ import annotations

import http.client
import re
import time
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from matrixpool_recovery import CheckpointSpec, wire
from tests.checkpoint.conftest import OPERATOR, Cluster

JOB = "ml.metrics"
STEP = 10
SCRAPE_DEADLINE = 10.0  # seconds for a counter the daemon adds after answering
Samples = dict[tuple[str, str, str], float]  # (series, tier, operation) -> value
NAME = re.compile(r"matrixpool_ckpt_[a-z0-9]+(_[a-z0-9]+)*")
EXPECTED = {  # family -> type; a family's name carries its unit
    "matrixpool_ckpt_bytes": "counter",
    "matrixpool_ckpt_duration_seconds": "histogram",
    "matrixpool_ckpt_failures": "counter",
    "matrixpool_ckpt_memory_used_bytes": "gauge",
    "matrixpool_ckpt_memory_limit_bytes": "gauge",
}
QUIET = {"matrixpool_ckpt_failures"}  # no series until something fails
SUFFIXES = {  # the series a family of each type may expose
    "counter": {"_total"},
    "histogram": {"_bucket", "_count", "_sum"},
    "gauge": {""},
}


def scrape(cluster: Cluster, node: str) -> str:
    host, _, port = cluster.address(node).rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", "/metrics")  # no Authorization header
        answer = connection.getresponse()
        body = answer.read().decode()
    finally:
        connection.close()
    assert answer.status == 200, body
    assert answer.getheader("Content-Type", "").startswith("text/plain")
    return body


def samples(text: str) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("tier", ""), sample.labels.get("operation", ""))
            found[key] = sample.value
    return found


def until(cluster: Cluster, node: str, key: tuple[str, str, str], value: float) -> Samples:
    """Scrape until `key` reaches `value` (a serve is counted once its bytes are sent)."""
    deadline = time.monotonic() + SCRAPE_DEADLINE
    while True:
        found = samples(scrape(cluster, node))
        if found.get(key) == value or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def shard_size(cluster: Cluster, node: str) -> int:
    answer = wire.request(wire.Endpoint(cluster.address(node), OPERATOR), "GET", "/v1/inventory")
    sizes = {s["size"] for s in answer["shards"] if s["step"] == STEP}
    assert len(sizes) == 1, answer
    return int(sizes.pop())


def save_everywhere(cluster: Cluster, uri: str) -> None:
    spec = CheckpointSpec(1, peer_replicas=1, local_every=1, persistent_every=1, persistent_uri=uri)
    state = {"w": np.arange(300_000, dtype=np.float32), "step": np.int64(STEP)}
    with cluster.client("a", JOB, 0, 1, spec=spec) as client:
        client.save(STEP, state)
        client.wait()


def restore(cluster: Cluster, shared_memory: bool) -> None:
    with cluster.client("a", JOB, 0, 1, peers=[], shared_memory=shared_memory) as client:
        assert client.restore().step == STEP


def test_each_tier_counts_the_bytes_saved_replicated_restored_and_served(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start("b")
    cluster.start("a", ["b"])
    save_everywhere(cluster, f"file://{tmp_path}/persistent")
    size = float(shard_size(cluster, "a"))

    restore(cluster, shared_memory=True)  # path of the buffer: read in place
    restore(cluster, shared_memory=False)  # bytes over HTTP
    found = until(cluster, "a", ("matrixpool_ckpt_bytes_total", "memory", "serve"), size)

    for tier, operation in [
        ("memory", "save"),
        ("local", "save"),
        ("persistent", "save"),
        ("peers", "replicate"),
        ("memory", "restore"),
        ("memory", "serve"),
    ]:
        assert found[("matrixpool_ckpt_bytes_total", tier, operation)] == size, (tier, operation)
        assert found[("matrixpool_ckpt_duration_seconds_count", tier, operation)] == 1
    assert found[("matrixpool_ckpt_memory_used_bytes", "", "")] >= size
    peer = samples(scrape(cluster, "b"))
    assert peer[("matrixpool_ckpt_bytes_total", "memory", "save")] == size


def test_the_daemon_metrics_follow_prometheus_conventions(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start("b")
    cluster.start("a", ["b"])
    save_everywhere(cluster, f"file://{tmp_path}/persistent")
    families = [
        f
        for f in text_string_to_metric_families(scrape(cluster, "a"))
        if f.name.startswith("matrixpool_ckpt_") and not f.name.endswith("_created")
    ]  # the text format shows a counter's creation time as a gauge of its own

    assert {f.name for f in families} == set(EXPECTED)
    for family in families:
        assert NAME.fullmatch(family.name), family.name
        assert family.type == EXPECTED[family.name], family.name
        assert family.samples or family.name in QUIET, f"{family.name} has no series"
        for sample in family.samples:
            assert sample.name.removeprefix(family.name) in SUFFIXES[family.type], sample.name
            assert set(sample.labels) <= {"tier", "operation", "le"}, sample.labels
