"""No card twice under churn, with the watch slowed (issue 12): hundreds of TrainingJobs of
mixed sizes and priorities are created, scaled, preempted and deleted concurrently for
:data:`CHURN_SECONDS` while the operator's view of the pod index lags the API by
:data:`LAG_SECONDS` (four loop periods; ``MATRIXPOOL_WATCH_LAG_SECONDS``). A sampler lists the
gang pods every 0.2 s: no (node, card) is ever held by two pods. When the churn stops, every
job ends bound or waiting with a reason."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from matrixpool.k8s import client as k8s_client
from tests.integration import framework, manifests

CHURN_SECONDS = 60.0  # hundreds of jobs (at least JOBS: the churn tops up on a slow machine)
LAG_SECONDS = 1.0
JOBS = 200  # at least this many jobs are created
WORKERS = 4  # concurrent clients driving the churn
LIVE = 60  # jobs alive at once, about: more cards asked than the two supernodes have
SAMPLE_SECONDS = 0.2
GROUP, VERSION, PLURAL = "matrixpool.dev", "v1alpha1", "trainingjobs"


@dataclass
class Sampler:
    """Lists the gang pods every SAMPLE_SECONDS and records any card held by two pods."""

    api: k8s_client.Api
    samples: int = 0
    pods_seen: int = 0
    twice: list[tuple[str, int, list[str]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            self.sample()
            self.stop.wait(max(0.0, SAMPLE_SECONDS - (time.monotonic() - started)))

    def sample(self) -> None:
        raw = self.api.core.list_pod_for_all_namespaces(
            label_selector="matrixpool.dev/job", _preload_content=False
        )
        holders: dict[tuple[str, int], list[str]] = {}
        items = json.loads(raw.data)["items"]
        for pod in items:
            annotations = pod["metadata"].get("annotations") or {}
            node = pod["spec"].get("nodeName") or annotations.get("matrixpool.dev/node")
            cards = filter(None, (annotations.get("matrixpool.dev/cards") or "").split(","))
            name = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
            for card in cards:
                holders.setdefault((node, int(card)), []).append(name)
        self.samples += 1
        self.pods_seen = max(self.pods_seen, len(items))
        self.twice += [(n, c, who) for (n, c), who in holders.items() if len(who) > 1]


@dataclass
class Churn:
    """Random creates, scales and deletes from several threads."""

    cluster: framework.TestCluster
    namespace: str
    seed: int
    created: int = 0
    scaled: int = 0
    deleted: int = 0
    live: dict[str, tuple[int, int]] = field(default_factory=dict)  # name → (min, max) replicas
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, index: int, until: float) -> None:
        api = self.cluster.api
        rng = random.Random(self.seed * 100 + index)
        while time.monotonic() < until:
            with self.lock:
                count = len(self.live)
            action: Callable[[k8s_client.Api, random.Random], None]
            if count < LIVE or rng.random() < 0.35:
                action = self.create
            elif rng.random() < 0.5:
                action = self.scale
            else:
                action = self.delete
            try:
                action(api, rng)
            except Exception as error:  # a racing delete: the churn goes on
                if not k8s_client.is_status(error, 404, 409):
                    raise
            time.sleep(rng.uniform(0.05, 0.3))

    def create(self, api: k8s_client.Api, rng: random.Random) -> None:
        with self.lock:
            self.created += 1
            name = f"j{self.created:04d}"
        size = rng.choice(["small", "small", "small", "medium", "medium", "large"])
        replicas, cards = {
            "small": (rng.randint(1, 4), rng.choice([1, 2, 4])),
            "medium": (rng.randint(2, 8), 8),
            "large": (rng.randint(10, 24), 8),
        }[size]
        minimum = max(1, replicas // 2) if rng.random() < 0.4 else None
        job = (
            manifests.training_job(name)
            .replicas(replicas, minimum)
            .cards(cards)
            .on(rng.choice(["sn-0", "sn-1"]))
            .priority(rng.choice([10, 50, 100, 100, 500, 1000]))
        )
        api.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, job.body)
        with self.lock:
            self.live[name] = (minimum or replicas, replicas)

    def scale(self, api: k8s_client.Api, rng: random.Random) -> None:
        with self.lock:
            if not self.live:
                return
            name = rng.choice(sorted(self.live))
            floor, top = self.live[name]
        replicas = rng.randint(floor, top + 2)
        patch = {"spec": {"replicas": replicas, "minReplicas": min(floor, replicas)}}
        api.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, patch
        )
        with self.lock:
            self.scaled += 1
            if name in self.live:
                self.live[name] = (min(floor, replicas), replicas)

    def delete(self, api: k8s_client.Api, rng: random.Random) -> None:
        with self.lock:
            if not self.live:
                return
            name = rng.choice(sorted(self.live))
            del self.live[name]
            self.deleted += 1
        api.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)


def settled(body: dict[str, Any]) -> str | None:
    """Why the job is not settled yet, or None: bound whole, or waiting with a reason."""
    status = body.get("status") or {}
    replicas = status.get("replicas") or {}
    scheduled = next((c for c in status.get("conditions") or [] if c["type"] == "Scheduled"), {})
    if scheduled.get("status") == "True" and replicas.get("bound") == replicas.get("desired"):
        return None
    if scheduled.get("status") == "False" and scheduled.get("reason") not in (None, "Waiting"):
        return None
    others = {c["type"]: c.get("reason") for c in status.get("conditions") or []}
    return (
        f"{body['metadata']['name']}: {status.get('phase')} {replicas} "
        f"{scheduled.get('reason')} {others} resizes={(status.get('resizes') or [])[-1:]} "
        f"preemptions={(status.get('preemptions') or [])[-1:]}"
    )


def test_churn_with_a_lagging_watch_never_gives_a_card_twice(
    cluster: framework.TestCluster,
    namespace: str,
    two_supernodes: list[str],
    tmp_path: Any,
) -> None:
    operator = framework.Operator(
        cluster,
        tmp_path / "operator.log",
        env={"MATRIXPOOL_WATCH_LAG_SECONDS": str(LAG_SECONDS)},
    ).start()
    sampler = Sampler(cluster.api)
    unsettled: list[str] = []
    churn = Churn(cluster, namespace, seed=int(os.environ.get("MATRIXPOOL_STRESS_SEED", "12")))
    watcher = threading.Thread(target=sampler.run, name="sampler", daemon=True)
    watcher.start()
    try:
        until = time.monotonic() + CHURN_SECONDS
        with ThreadPoolExecutor(WORKERS) as pool:
            for done in [pool.submit(churn.worker, i, until) for i in range(WORKERS)]:
                done.result()
        while churn.created < JOBS:  # slow machines: top up to the promised number
            churn.create(cluster.api, random.Random(churn.created))

        def every_job_settled() -> bool:
            jobs = cluster.api.custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL
            )["items"]
            waiting = [why for body in jobs if (why := settled(body))]
            unsettled[:] = [why.split(":")[0] for why in waiting]
            if waiting:
                print(f"{len(waiting)} jobs unsettled, e.g. {waiting[:3]}")
            return not waiting

        framework.eventually(
            every_job_settled, timeout=240, interval=2, what="every job bound or waiting"
        )
    finally:
        sampler.stop.set()
        watcher.join(timeout=30)
        operator.kill()
        log = operator.log()
        print(log[-20000:])
        for name in unsettled[:3]:  # what the operator said of a job that did not settle
            said = [line for line in log.splitlines() if f"/{name}" in line or f"{name}-" in line]
            print(f"--- {name}: {len(said)} lines\n" + "\n".join(said[-60:]))
    reasons = Counter(
        e["reason"]
        for e in json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)[
            "items"
        ]
    )
    print(
        f"created {churn.created}, scaled {churn.scaled}, deleted {churn.deleted}; "
        f"{sampler.samples} samples, up to {sampler.pods_seen} pods; events {dict(reasons)}"
    )
    assert not sampler.twice, f"cards held twice: {sampler.twice[:5]}"
    assert churn.created >= JOBS
    assert sampler.samples >= CHURN_SECONDS / 2, "the sampler kept up (a sample every 0.2-2 s)"
    assert reasons["Preempting"] > 0, "the churn preempted"
    assert "cycle failed" not in log
