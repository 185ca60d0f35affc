"""Night → day → night on sn-real (issue 32, item 3): the example PyTorch trainer (gloo, DCP on
matrixpool_recovery.torch) as a night-only job of 2 ranks, and an InferenceService of two 8-card
pods that a day window's cap lets run, both on the real nodes, under the operator's own clock
(the system's: no scaled clock).

The windows are real: the test writes ``spec.timeSharing`` so that the instant it runs falls an
hour inside the window it wants (a platform team editing its schedule does the same), so the
boundaries come when the test is ready for them rather than on a scaled clock's time. At night
the job trains and the service holds nothing (its cap is 0, ``minReplicas: 0``). At day the job
is asked to checkpoint, answers, and is evicted; the service's pods run in real containers and
answer the kubelet's readiness probe over HTTP. At night again the service goes and the job's two
ranks resume from the step it answered with, every rank restoring the same step; it runs to its
end with the parameters, bitwise, of a run without the day (a suspension and resume at the same
size change nothing of the computation)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration import framework
from tests.realnodes.conftest import (
    IMAGE,
    REAL_SUPERNODE,
    SPARE,
    EndedPods,
    Watched,
    ends_as,
    supernode,
)
from tests.realnodes.test_pytorch_on_real_nodes import job, reference
from tests.realnodes.test_regroup_on_real_nodes import restored_and_stepping

JOB, SERVICE = "torch-nightly", "chat"
STEPS = 90  # a step every 0.5 s: a night before the day and one after it
RANKS = 2
DAY_CARDS = 16  # the service's two pods, 8 cards each


def nightly() -> dict[str, Any]:
    """The example trainer's job, 2 ranks, at night only, a step every 0.5 s."""
    body = job(JOB, ranks=RANKS, steps=STEPS, step_seconds=0.5)
    body["spec"]["windows"] = ["night"]
    return body


def service() -> dict[str, Any]:
    """Two 8-card pods of one role, each an HTTP server the kubelet probes; none at night."""
    container = {
        "name": "serve",
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": ["python", "-m", "http.server", "8080", "--directory", "/tmp"],
        "ports": [{"containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 2},
    }
    role = {
        "name": "serve",
        "replicas": 2,
        "minReplicas": 0,
        "cardsPerPod": 8,
        "template": {"spec": {"terminationGracePeriodSeconds": 1, "containers": [container]}},
    }
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": SERVICE},
        "spec": {"superNode": REAL_SUPERNODE, "roles": [role]},
    }


def windows_now_in(name: str, now: dt.datetime) -> dict[str, Any]:
    """``spec.timeSharing`` whose window ``name`` started an hour before ``now`` (UTC) and ends
    two hours after it; the other window covers the rest of the day."""
    start = (now - dt.timedelta(hours=1)).strftime("%H:%M")
    end = (now + dt.timedelta(hours=2)).strftime("%H:%M")
    other = "day" if name == "night" else "night"
    cards = {"day": DAY_CARDS, "night": 0}
    return {
        "timezone": "UTC",
        "checkpointGraceSeconds": 30,
        "windows": [
            {"name": name, "start": start, "end": end, "inferenceCards": cards[name]},
            {"name": other, "start": end, "end": start, "inferenceCards": cards[other]},
        ],
    }


def switch_to(cluster: framework.TestCluster, window: str) -> None:
    sharing = windows_now_in(window, dt.datetime.now(dt.UTC))
    patch = json.dumps({"spec": {"timeSharing": sharing}})
    cluster.kubectl("patch", "supernode", REAL_SUPERNODE, "--type=merge", "-p", patch)


def in_place(cluster: framework.TestCluster, window: str, after: str = "") -> dict[str, Any] | None:
    """sn-real's transition into ``window`` (one that started after ``after``), once settled."""
    body = cluster.api.custom.get_cluster_custom_object(
        "matrixpool.dev", "v1alpha1", "supernodes", REAL_SUPERNODE
    )
    move = (body.get("status") or {}).get("transition") or {}
    later = not after or move.get("startedAt", "") > after
    return move if move.get("window") == window and move.get("settledAt") and later else None


def serving(cluster: framework.TestCluster, namespace: str) -> list[dict[str, Any]]:
    """The service's pods that run on a real node and pass their readiness probe."""
    out = cluster.kubectl(
        "get", "pods", "-n", namespace, "-l", f"matrixpool.dev/job={SERVICE}", "-o", "json"
    )
    return [
        p
        for p in json.loads(out.stdout)["items"]
        if (p["spec"].get("nodeName") or "").startswith("real-")
        and any(s.get("ready") for s in p["status"].get("containerStatuses") or [])
    ]


def service_pods(cluster: framework.TestCluster, namespace: str) -> list[str]:
    out = cluster.kubectl(
        "get", "pods", "-n", namespace, "-l", f"matrixpool.dev/job={SERVICE}", "-o", "name"
    )
    return out.stdout.split()


def suspension(watched: Watched) -> dict[str, Any] | None:
    records = (watched.status().get("timeSharing") or {}).get("suspensions") or []
    return records[-1] if records else None


@pytest.fixture
def shared(installed: framework.TestCluster) -> Iterator[framework.TestCluster]:
    """sn-real with time-sharing for the test, without it after (the suite shares sn-real)."""
    installed.kubectl("apply", "-f", "-", input=json.dumps(supernode()))
    switch_to(installed, "night")
    try:
        yield installed
    finally:
        installed.kubectl(
            "patch", "supernode", REAL_SUPERNODE, "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/timeSharing"}]', check=False,
        )  # fmt: skip


def test_a_night_job_checkpoints_for_the_day_and_resumes_the_next_night_to_the_same_parameters(
    shared: framework.TestCluster, namespace: str
) -> None:
    cluster = shared
    watched = Watched(cluster, namespace, JOB)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(nightly()))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(service()))
    with EndedPods(cluster, namespace):
        night = framework.eventually(
            lambda: in_place(cluster, "night"), timeout=120, interval=1, what="night in place"
        )
        watched.training(past=6)
        assert len(watched.rank_pods()) == RANKS
        assert service_pods(cluster, namespace) == []  # a cap of 0 cards at night

        # Day: the job is asked to checkpoint, answers, is evicted; the service runs.
        switch_to(cluster, "day")
        day = framework.eventually(
            lambda: in_place(cluster, "day", night["startedAt"]),
            timeout=240,
            interval=1,
            what="day in place",
        )
        print("day:", day)
        suspended = framework.eventually(
            lambda: suspension(watched), timeout=30, what="the suspension recorded"
        )
        print("suspended:", suspended)
        assert (suspended["reason"], suspended["answered"]) == ("OutsideWindows", True)
        assert suspended["worldSize"] == RANKS
        assert watched.rank_pods() == {}
        assert watched.status()["phase"] == "Suspended"
        running = framework.eventually(
            lambda: (found := serving(cluster, namespace)) and len(found) == 2 and found,
            timeout=180,
            interval=1,
            what="both service pods ready in real containers",
        )
        assert len({p["spec"]["nodeName"] for p in running}) == 2  # 8 cards: a node each
        assert (day["inferenceCards"], day["trainingCards"]) == (DAY_CARDS, 0)  # night-only job

        # Night again: the service goes, the job's two ranks resume from the step it answered.
        switch_to(cluster, "night")
        framework.eventually(
            lambda: (suspension(watched) or {}).get("resumedAt"),
            timeout=240,
            interval=1,
            what="resumed",
        )
        resumed = suspension(watched)
        assert resumed is not None
        print("resumed:", resumed)
        assert resumed["restoredStep"] >= suspended["step"], resumed
        ranks = framework.eventually(
            lambda: restored_and_stepping(
                cluster, namespace, f"resume-{resumed['requestId']}", RANKS, job=JOB
            ),
            timeout=180,
            interval=2,
            what="both ranks restore the same step and step on",
        )
        assert {step for step, _ in ranks.values()} == {resumed["restoredStep"]}, ranks
        framework.eventually(
            lambda: service_pods(cluster, namespace) == [],
            timeout=120,
            interval=1,
            what="no service pod at night",
        )

        # To the end, with the parameters of a run that never saw the day.
        made = reference(namespace, SPARE, steps=STEPS, ranks=RANKS, name="nightly-reference")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(made))
        watched.succeeded()
    ends_as(cluster, namespace, watched, "nightly-reference", RANKS, STEPS)
    selector = f"involvedObject.name={REAL_SUPERNODE}"
    out = cluster.kubectl("get", "events", "-A", "--field-selector", selector, "-o", "json")
    events = json.loads(out.stdout)["items"]
    assert {"TransitionStarted", "TransitionDone"} <= {e["reason"] for e in events}
