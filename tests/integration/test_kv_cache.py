"""The supernode's KV-cache pool on the real control plane (issue 16, item 4): sn-0 lends 64Mi
of each of its 48 nodes (``matrixpool sim``'s daemons hold that much each); an
InferenceService's ``spec.kvCache`` is admitted against the pool like cards, one that does not
fit waits with the reason, the operator tells every daemon the admitted service's quota and
gives its pods their token and the daemons' addresses, and the simulated server in the pod
serves a repeated prompt's prefix from the pool — fetched from the daemons over HTTP.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool.serving import engine
from matrixpool_recovery import wire
from tests.integration import framework, manifests

pytestmark = pytest.mark.integration

PER_NODE = "64Mi"  # the sim's --kv-pool-bytes default
NODES = 48
BLOCK_BYTES = "65536"  # each KV block's stand-in bytes (the latency model counts the real size)


def service(name: str, kv: str) -> dict[str, Any]:
    server = {
        "name": "server",
        "image": "matrixpool:test",
        "command": ["python", "-m", "matrixpool.serving", "--linger-seconds", "0"],
        "env": [{"name": "MATRIXPOOL_KV_BLOCK_BYTES", "value": BLOCK_BYTES}],
    }
    role = {"name": "serve", "replicas": 1, "cardsPerPod": 1, "template": {"spec": {
        "terminationGracePeriodSeconds": 5, "containers": [server]}}}  # fmt: skip
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {"superNode": "sn-0", "kvCache": {"bytes": kv}, "roles": [role]},
    }


@pytest.fixture
def sim(cluster: framework.TestCluster, tmp_path: Path) -> Iterator[framework.Sim]:
    sn = manifests.supernode("sn-0").spares(0)
    sn.body["spec"]["memoryPool"] = {"perNode": PER_NODE}
    with framework.sim_on(cluster, tmp_path / "sim", sn.yaml()) as process:
        yield process


@pytest.fixture
def operator(
    cluster: framework.TestCluster, sim: framework.Sim, tmp_path: Path
) -> Iterator[framework.Operator]:
    with framework.operator_beside(cluster, sim, tmp_path / "operator.log", {}) as process:
        yield process


def status_of(cluster: framework.TestCluster, namespace: str, name: str) -> dict[str, Any]:
    body = json.loads(cluster.kubectl("get", "infer", name, "-n", namespace, "-o", "json").stdout)
    return dict(body.get("status") or {})


def ready(cluster: framework.TestCluster, namespace: str, name: str) -> dict[str, Any]:
    conditions = status_of(cluster, namespace, name).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), {})


def uid_of(cluster: framework.TestCluster, namespace: str, name: str) -> str:
    found = cluster.kubectl("get", "infer", name, "-n", namespace, "-o", "jsonpath={.metadata.uid}")
    return found.stdout.strip()


def serving_ip(cluster: framework.TestCluster, namespace: str, name: str) -> str | None:
    for pod in framework.gang_pods(cluster, namespace):
        if pod["metadata"]["labels"].get("matrixpool.dev/job") != name:
            continue
        if pod.get("status", {}).get("phase") == "Running" and pod["status"].get("podIP"):
            return str(pod["status"]["podIP"])
    return None


def answers(ip: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{ip}:8000/healthz", timeout=0.5):
            return True
    except OSError:
        return False


def first_token_seconds(ip: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first chunk."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True})
    request = urllib.request.Request(
        f"http://{ip}:8000/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=30) as response:
        first = response.readline()
        took = time.monotonic() - started
        assert first.startswith(b"data: "), first
        response.read()
    return took


def kv_usage(sim: framework.Sim, endpoint: str) -> dict[str, dict[str, int]]:
    answer = wire.request(wire.Endpoint(endpoint, sim.operator_token()), "GET", "/v1/kv/usage")
    return dict(answer["services"])


def metric(ip: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_service_is_admitted_to_the_pool_and_serves_a_repeated_prefix_from_it(
    cluster: framework.TestCluster,
    sim: framework.Sim,
    operator: framework.Operator,
    namespace: str,
) -> None:
    # 2Gi of the pool's 3Gi (48 × 64Mi): admitted; then another 2Gi does not fit and waits.
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(service("chat", "2Gi")))
    framework.eventually(
        lambda: status_of(cluster, namespace, "chat").get("kvCache", {}).get("admitted"),
        timeout=60, what="chat's KV cache admitted",
    )  # fmt: skip
    kv = status_of(cluster, namespace, "chat")["kvCache"]
    quota = (2 << 30) // NODES
    assert kv == {"admitted": True, "reserved": "2Gi", "quotaPerNode": str(quota), "nodes": NODES}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(service("late", "2Gi")))
    framework.eventually(
        lambda: ready(cluster, namespace, "late").get("reason") == "KVCachePoolFull",
        timeout=60, what="late waiting for room in the pool",
    )  # fmt: skip
    assert "1Gi free" in ready(cluster, namespace, "late")["message"]
    wide = cluster.kubectl("get", "infer", "-n", namespace, "-o", "wide").stdout
    print(wide)
    header, *rows = wide.splitlines()
    kv_at = header.index(" KV ") + 1
    assert [row[kv_at:].split(" ", 1)[0] for row in rows] == ["2Gi", ""], wide
    assert rows[1].split()[1:4] == ["False", "serve", "0/1"], wide  # late: none of its 1 ready
    events = cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    reasons = {(e["involvedObject"]["name"], e["reason"]) for e in json.loads(events)["items"]}
    assert ("late", "KVCachePoolFull") in reasons
    assert ("chat", "KVCacheReserved") in reasons
    late_pods = [p for p in framework.gang_pods(cluster, namespace)
                 if p["metadata"]["labels"]["matrixpool.dev/job"] == "late"]  # fmt: skip
    assert late_pods == []

    # Every daemon of sn-0 holds chat's quota, by its UID.
    chat = uid_of(cluster, namespace, "chat")
    endpoints = framework.daemon_endpoints(cluster)
    assert len(endpoints) == NODES
    framework.eventually(
        lambda: all(
            kv_usage(sim, e).get(chat, {}).get("quotaBytes") == quota for e in endpoints.values()
        ),
        timeout=60, what="every daemon told chat's quota",
    )  # fmt: skip

    # The server in chat's pod: a repeated prompt's prefix comes from the pool.
    ip = framework.eventually(
        lambda: (found := serving_ip(cluster, namespace, "chat")) and answers(found) and found,
        timeout=90, what="chat's server answering",
    )  # fmt: skip
    assert isinstance(ip, str)
    prompt = list(range(4000))  # 0.6 s of prefill on one card; 249 whole blocks
    blocks = len(engine.block_hashes(prompt))
    ttft = "vllm:time_to_first_token_seconds_sum"  # the engine's own account of each request
    cold = first_token_seconds(ip, prompt)
    cold_engine = metric(ip, ttft)
    framework.eventually(
        lambda: metric(ip, "matrixpool_serving_kv_pool_blocks_stored_total") == blocks,
        timeout=30, what="the prompt's blocks stored in the pool",
    )  # fmt: skip
    warm = first_token_seconds(ip, prompt)
    warm_engine = metric(ip, ttft) - cold_engine
    assert metric(ip, "vllm:prefix_cache_hits_total") == blocks * engine.BLOCK_TOKENS
    print(
        f"first token: {cold:.3f} s cold, {warm:.3f} s from the pool (wall clock); "
        f"{cold_engine:.3f} s and {warm_engine:.3f} s in the engine's account"
    )
    # The prefix was fetched, not computed again. Asserted on the engine's account: the wall
    # clock adds the pool lookup's HTTP round trips, which a loaded 2-core machine stretches
    # (0.53 s once in CI against 0.22 s alone); benchmarks/serving.py measures the speed.
    assert warm_engine < 0.5 * cold_engine, (warm_engine, cold_engine)
    held = [kv_usage(sim, e).get(chat, {}) for e in endpoints.values()]
    assert sum(h.get("blocks", 0) for h in held) == blocks  # on the pod's own node's daemon

    # chat goes: the daemons forget it, and late gets its place.
    cluster.kubectl("delete", "infer", "chat", "-n", namespace, "--wait=false")
    framework.eventually(
        lambda: status_of(cluster, namespace, "late").get("kvCache", {}).get("admitted"),
        timeout=60, what="late admitted once chat went",
    )  # fmt: skip
    late = uid_of(cluster, namespace, "late")
    framework.eventually(
        lambda: all(set(kv_usage(sim, e)) == {late} for e in endpoints.values()),
        timeout=60, what="the daemons forgot chat and hold late's quota",
    )  # fmt: skip
