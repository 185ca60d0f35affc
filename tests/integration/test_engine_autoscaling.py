"""The inference autoscaler with a real engine in the pods (issue 33): an InferenceService's pods
run llama.cpp's server (``llama-server``, built by ``tools/engine/build.sh``) on a tiny random
model (:mod:`matrixpool.devcluster.engine`) as processes of ``matrixpool sim``, each on its own
pod address; the operator reads their ``llamacpp:`` metrics, knowing nothing of the engine's
speed (no ``capacity`` stated: it learns it), and a load generator sends a stepped load, then a
burst, to the pods a Service would list. Each instance has a CPU limit (a CFS quota, as a
kubelet sets it): its rate is the limit's, as a card's would be, not what else runs here.

llama.cpp has no disaggregated prefill and decode: one role serves both phases (the aggregated
shape of ``docs/concepts.md``), so "prefill grows, then decode" is one role growing here. The
engine stops at once on SIGTERM; its pods stop the way engines' pods do on Kubernetes, with a
``preStop`` sleep (the process kubelet runs it, as a kubelet does) while the endpoints drop
them, so a scale-down fails no request.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool.devcluster import engine
from matrixpool.serving import loadgen, workload
from tests.integration import framework, manifests

pytestmark = pytest.mark.integration

PERIOD = 3.0  # the autoscaler reads /metrics every 3 s here (15 s by default)
PORT = 8080
TTFT_S, TPOT_S = 2.0, 0.2  # the service's targets
CPU = "300m"  # each instance's CPU limit: its "card", whatever else this machine runs
# Prompts long, outputs short: the engine's work is mostly prefill, whose rate the operator
# learns from llama.cpp's own busy time (~600 prompt tokens/s an instance under this limit).
LENGTHS = workload.LengthModel(
    prompt=workload.Lognormal(300, 0.3, 100, 600),
    output=workload.Lognormal(12, 0.3, 4, 24),
)
# Requests per second: ~0.3 of an instance; the step (4x) needs two, the burst (8x) three.
BASE = 0.5
OPTIONS = {"vocab": (engine.FIRST_BYTE, engine.BYTES), "extra": (("ignore_eos", True),)}


@pytest.fixture(scope="module")
def model() -> Path:
    """The engine built (or found in the cache) and linked into the image's PATH, and the
    tiny model it serves."""
    binary = engine.server()
    engine.install(binary, Path(__import__("sys").executable).parent)
    folder = binary.parent.parent / "models"
    folder.mkdir(exist_ok=True)
    return engine.write_model(folder / "tiny-512x4.gguf", width=512, layers=4, feed_forward=1536)


def service(name: str, model: Path) -> dict[str, Any]:
    """One role of 1..3 llama.cpp instances of one card and CPU, SLO 2 s / 200 ms, read as
    LlamaCpp."""
    container = {
        "name": "engine",
        "image": "matrixpool:test",
        "command": engine.command(str(model), host="$(POD_IP)", port=PORT, slots=4),
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": {"limits": {"cpu": CPU}},
        "lifecycle": {"preStop": {"sleep": {"seconds": 10}}},  # endpoints drop it meanwhile
    }
    pod = {"spec": {"terminationGracePeriodSeconds": 30, "containers": [container]}}
    role = {
        "name": "serve",
        "replicas": 3,  # the most; the autoscaler starts it there
        "minReplicas": 1,
        "cardsPerPod": 1,
        "template": pod,
    }
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "superNode": "sn-0",
            "roles": [role],
            "autoscaling": {
                "mode": "Auto",
                "engine": "LlamaCpp",
                "metricsPort": PORT,
                "targets": {"ttftMilliseconds": 2000, "tpotMilliseconds": 200},
                "scaleDownStabilizationSeconds": 10,
            },
        },
    }


def send(
    endpoints: framework.Endpoints, rates: list[float], seconds: float, seed: int
) -> list[loadgen.Record]:
    """``rates`` requests/s, ``seconds`` each, open loop, to the pods listed as it goes."""
    pattern = workload.step_pattern(rates, seconds)
    requests = workload.generate(pattern, LENGTHS, seconds * len(rates), seed=seed)
    options = loadgen.Options(urls=endpoints.now[0], max_retries=8, **OPTIONS)  # type: ignore[arg-type]
    return asyncio.run(loadgen.run(requests, options, urls=lambda: endpoints.now, refresh_s=0.5))


def advice(cluster: framework.TestCluster, namespace: str, name: str) -> str:
    """status.recommendation, as JSON text (an assertion's message)."""
    body = json.loads(cluster.kubectl("get", "infer", name, "-n", namespace, "-o", "json").stdout)
    return json.dumps((body.get("status") or {}).get("recommendation") or {}, indent=1)


def replicas(cluster: framework.TestCluster, namespace: str, name: str) -> int:
    roles = json.loads(advice(cluster, namespace, name)).get("roles") or [{"replicas": 3}]
    return int(roles[0]["replicas"])


def pods(cluster: framework.TestCluster, namespace: str, name: str) -> int:
    return sum(
        1
        for pod in framework.gang_pods(cluster, namespace)
        if pod["metadata"]["labels"].get("matrixpool.dev/job") == name
        and not pod["metadata"].get("deletionTimestamp")
    )


def attained(records: list[loadgen.Record], after_s: float) -> float:
    settled = [r for r in records if r.sent_at >= after_s]
    return loadgen.attainment(settled, TTFT_S, TPOT_S)


@pytest.fixture
def operator(cluster: framework.TestCluster, tmp_path: Path) -> Iterator[framework.Operator]:
    sn = manifests.supernode("sn-0").spares(0).yaml()
    env = {"MATRIXPOOL_AUTOSCALER_PERIOD_SECONDS": str(PERIOD), "MATRIXPOOL_LOG_LEVEL": "debug"}
    with (
        framework.sim_on(cluster, tmp_path / "sim", sn) as sim,
        framework.operator_beside(cluster, sim, tmp_path / "operator.log", env) as process,
    ):
        yield process


def test_llama_cpp_pods_scale_with_a_stepped_load_and_a_burst_and_no_request_fails(
    cluster: framework.TestCluster, operator: framework.Operator, namespace: str, model: Path
) -> None:
    """(3 instances, the most, at the start) base → 4× the base → base (scale-down drains) → a
    burst of 8× the base: the role grows under the step and meets the SLO once settled, comes
    back down without failing a request, and grows within one period of the burst's start."""
    body = json.dumps(service("chat", model))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=body)
    records: list[loadgen.Record] = []
    with framework.Endpoints(cluster, namespace, "chat", PORT, "/health") as endpoints:
        framework.eventually(lambda: endpoints.now[0], timeout=60, what="the engine answering")
        # the base load, until one instance is enough. That needs a quiet scale-down window
        # (10 s), and at 0.5 requests/s a 3 s reading (1 or 2 requests: lumpy prompt tokens/s)
        # now and then asks for a second instance. In CI of 08fdebc, on a slower machine (679
        # prompt tokens/s learned; 850-930 here), 40 s brought it down to 2, not 1: up to 80 s
        for seed in range(10, 18):
            records += send(endpoints, [BASE], 10, seed=seed)
            if replicas(cluster, namespace, "chat") == 1:
                break
        assert replicas(cluster, namespace, "chat") == 1, advice(cluster, namespace, "chat")
        # the removed instances drain and exit before a scale-up may take their addresses
        framework.eventually(endpoints.stopped, timeout=40, what="the removed ones stopped")
        # 1. the step: the role grows; once settled (its last 30 s, ~60 requests: a slow moment
        # of this shared machine weighs less than in 20 s) the SLO holds
        step = send(endpoints, [4 * BASE], 60, seed=2)
        records += step
        grown = replicas(cluster, namespace, "chat")
        assert grown >= 2, advice(cluster, namespace, "chat")
        assert attained(step, after_s=30) >= 0.95
        # 2. back to the base: down to one instance, the removed ones drain
        records += send(endpoints, [BASE], 25, seed=3)
        framework.eventually(
            lambda: (
                pods(cluster, namespace, "chat") == 1 and replicas(cluster, namespace, "chat") == 1
            ),
            timeout=60,
            what="one instance left, and one advised",
        )
        framework.eventually(endpoints.stopped, timeout=40, what="the removed ones stopped")
        # 3. a burst of 8x: more instances within one period of its start. The decision's own
        # time (status.recommendation.time, written right after the reading it came from)
        # against the burst's start: the first reading after the start decides, or the second
        # when the first came within a second of the start (it saw almost none of the burst).
        started, began = time.monotonic(), datetime.datetime.now(datetime.UTC)
        seen: list[float] = []

        def watch() -> None:
            while time.monotonic() - started < 15 and not seen:
                status = json.loads(advice(cluster, namespace, "chat"))  # one read: one status
                roles = status.get("roles") or [{"replicas": 1}]
                if int(roles[0]["replicas"]) > 1 and status.get("time"):
                    decided = datetime.datetime.fromisoformat(status["time"])
                    seen.append((decided - began).total_seconds())
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        records += send(endpoints, [8 * BASE], 10, seed=4)
        watcher.join()
    assert seen, advice(cluster, namespace, "chat")
    assert 0 < seen[0] <= PERIOD + 1.0, (
        began.isoformat(),
        seen,
        advice(cluster, namespace, "chat"),
    )
    summary = loadgen.summarize(records)
    failures = [(r.url, r.sent_at, r.error) for r in records if r.status != loadgen.Status.OK]
    assert summary.failed == 0, (summary, failures)
    figures = {"burst_began": began.isoformat(), "burst_scaled_after_s": seen[0]}
    print(json.dumps({**figures, "step_attainment": attained(step, 30)}))
