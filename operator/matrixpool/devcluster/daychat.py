"""The demo's day of chat load (``matrixpool demo``, the serving step): an InferenceService
``chat`` whose prefill and decode instances (one card each) run the simulated inference server
under ``matrixpool sim``, with ``spec.autoscaling`` in Auto mode and a reservation in the
SuperNode's KV-cache pool; a day's load curve compressed into a minute and a half (night,
morning, the peak, evening, night) sent to its pods as vLLM's proxy does (prefill, then
decode), half of the prompts starting with one of eight system prompts; and, while it runs, the
replicas the autoscaler recommends and the pods serving, every few seconds.

The pods are found as a Service's endpoints would list them (Running, not terminating,
answering ``/healthz``), by a thread of their own (:class:`Endpoints`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from matrixpool.serving import loadgen, workload

NAME = "chat"
PORT = 8000
TTFT_S, TPOT_S = 2.0, 0.1  # the service's targets
DAY = (1.0, 4.0, 9.0, 4.0, 1.0)  # requests/s: night, morning, the peak, evening, night
STEP_SECONDS = 18.0  # each part of the day: 90 s in all
SETTLE_SECONDS = 9.0  # the first seconds of a part, while the autoscaler catches up
LENGTHS = workload.LengthModel(
    prompt=workload.Lognormal(1000, 0.3, 300, 3000),
    output=workload.Lognormal(40, 0.3, 10, 120),
    shared_prefix_share=0.5,
)
Get = Callable[..., dict[str, Any]]  # kubectl get ... -o json


def service(supernode: str, kv_bytes: str) -> dict[str, Any]:
    """prefill 1..3 and decode 1..3 instances of one card, SLO 2 s / 100 ms, ``kv_bytes`` of
    the SuperNode's KV-cache pool."""
    server = {
        "name": "server",
        "image": "matrixpool:sim",
        "command": ["python", "-m", "matrixpool.serving", "--drain-seconds", "20"],
        "env": [{"name": "MATRIXPOOL_KV_BLOCK_BYTES", "value": "65536"}],
    }
    template = {"spec": {"terminationGracePeriodSeconds": 30, "containers": [server]}}

    def role(name: str) -> dict[str, Any]:
        return {"name": name, "replicas": 3, "minReplicas": 1, "cardsPerPod": 1,
                "template": template}  # fmt: skip

    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "superNode": supernode,
            "roles": [role("prefill"), role("decode")],
            "kvCache": {"bytes": kv_bytes},
            "autoscaling": {
                "mode": "Auto",
                "targets": {"ttftMilliseconds": int(TTFT_S * 1000),
                            "tpotMilliseconds": int(TPOT_S * 1000)},
                "scaleDownStabilizationSeconds": 10,
            },
        },
    }  # fmt: skip


class Endpoints(threading.Thread):
    """The service's serving pods by role, refreshed every half second."""

    def __init__(self, get: Get, namespace: str) -> None:
        super().__init__(daemon=True)
        self.get, self.namespace = get, namespace
        self.now: loadgen.UrlSets = ((), ())
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.5):
            try:
                self.now = self.read()
            except Exception:  # the API busy for a moment: read again
                continue

    def read(self) -> loadgen.UrlSets:
        pods = self.get("pods", "-n", self.namespace, "-l", f"matrixpool.dev/job={NAME}")
        found: dict[str, list[str]] = {"prefill": [], "decode": []}
        for pod in pods["items"]:
            ip = str((pod.get("status") or {}).get("podIP") or "")
            role = pod["metadata"].get("labels", {}).get("matrixpool.dev/role", "")
            live = ip and not pod["metadata"].get("deletionTimestamp") and role in found
            if live and healthy(ip):
                found[role].append(f"http://{ip}:{PORT}")
        return tuple(sorted(found["prefill"])), tuple(sorted(found["decode"]))


def healthy(ip: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{ip}:{PORT}/healthz", timeout=0.5):
            return True
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Sample:
    at_s: float  # seconds into the day
    load_rps: float  # the curve's rate then
    recommended: dict[str, int]  # status.recommendation, by role
    serving: tuple[int, int]  # prefill and decode pods answering


@dataclass
class Day:
    """What the day's run saw."""

    records: list[loadgen.Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> loadgen.Summary:
        return loadgen.summarize(self.records, TTFT_S, TPOT_S)

    def settled_attainment(self) -> float:
        """Share meeting both targets among requests sent after each part's settling time."""
        settled = [r for r in self.records if r.due_at % STEP_SECONDS >= SETTLE_SECONDS]
        return loadgen.attainment(settled, TTFT_S, TPOT_S)


def play(get: Get, namespace: str, seed: int = 7, every_s: float = 3.0) -> Day:
    """Send the day to ``chat``'s pods, sampling the autoscaler every ``every_s``."""
    seconds = STEP_SECONDS * len(DAY)
    pattern = workload.step_pattern(DAY, STEP_SECONDS)
    requests = workload.generate(pattern, LENGTHS, seconds, seed=seed)
    endpoints = Endpoints(get, namespace)
    endpoints.now = endpoints.read()
    endpoints.start()
    day = Day()

    def send() -> None:
        prefill, decode = endpoints.now
        options = loadgen.Options(urls=prefill, decode_urls=decode, max_retries=8)
        day.records = asyncio.run(
            loadgen.run(requests, options, urls=lambda: endpoints.now, refresh_s=0.5)
        )

    sender = threading.Thread(target=send, daemon=True)
    begun = time.monotonic()
    sender.start()
    try:
        while sender.is_alive():
            at = time.monotonic() - begun
            advice = (get("inferenceservice", NAME, "-n", namespace).get("status") or {}).get(
                "recommendation"
            ) or {}
            prefill, decode = endpoints.now
            day.samples.append(
                Sample(
                    round(at, 1),
                    pattern.rate(at) if at < seconds else 0.0,
                    {r["name"]: r["replicas"] for r in advice.get("roles", [])},
                    (len(prefill), len(decode)),
                )
            )
            sender.join(timeout=every_s)
    finally:
        endpoints.halt.set()
    return day
