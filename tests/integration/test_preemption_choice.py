"""Which victims a preemptor takes, on the real control plane (issue 34): a preemptor whose
ranks must share one rack evicts one whole gang inside one rack (not pieces of gangs in two
racks), and at equal priority and size the victim that would lose less work — the one whose
checkpoint is fresher — gives way, the one with the older checkpoint keeps running.

The victims' ``status.checkpoints`` is written with ``kubectl patch --subresource=status``, as
the operator's checkpoint poll writes it (the steps, and ``committedAt``); these kwok nodes run
no checkpoint daemon, so the poll never overwrites it. Each test uses a SuperNode ``sn-pre`` of
two racks of ``sn-0`` (8 nodes × 8 cards, no spare)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from tests.integration import framework, manifests
from tests.integration.conftest import TWO_RACKS

RACKS = TWO_RACKS
RACK = "matrixpool.dev/rack"


def racks_of_nodes(cluster: framework.TestCluster) -> dict[str, str]:
    out = cluster.kubectl("get", "nodes", "-l", RACK, "-o", "json").stdout
    return {n["metadata"]["name"]: n["metadata"]["labels"][RACK] for n in json.loads(out)["items"]}


def job_nodes(cluster: framework.TestCluster, namespace: str, job: str) -> list[str]:
    pods = [
        p
        for p in framework.gang_pods(cluster, namespace)
        if p["metadata"]["labels"]["matrixpool.dev/job"] == job
        and not p["metadata"].get("deletionTimestamp")
    ]
    return sorted(p["spec"].get("nodeName") or "" for p in pods)


def get_job(cluster: framework.TestCluster, namespace: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "trainingjob", name, "-n", namespace, "-o", "json").stdout
    return dict(json.loads(out))


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    conditions = (body.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def run_bound(
    cluster: framework.TestCluster,
    namespace: str,
    job: manifests.TrainingJobManifest,
    replicas: int,
) -> list[str]:
    """Apply ``job`` and wait until its ``replicas`` pods are bound; their nodes."""
    name = job.body["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())

    def bound() -> list[str] | None:
        nodes = job_nodes(cluster, namespace, name)
        return nodes if len(nodes) == replicas and all(nodes) else None

    return framework.eventually(bound, timeout=60, what=f"{name}: {replicas} pods bound")


def preempted(cluster: framework.TestCluster, namespace: str, name: str) -> bool:
    return condition(get_job(cluster, namespace, name), "Preempted").get("status") == "True"


def training(name: str, replicas: int, priority: int) -> manifests.TrainingJobManifest:
    return manifests.training_job(name).replicas(replicas).cards(8).on("sn-pre").priority(priority)


def test_a_one_rack_preemptor_evicts_one_whole_gang_inside_one_rack(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    small_supernode: str,
) -> None:
    racks = racks_of_nodes(cluster)
    # Each rack: a 3-node gang and a 1-node gang; every node full.
    where = {
        name: run_bound(cluster, namespace, training(name, count, 10), count)
        for name, count in (("wide-a", 3), ("wide-b", 3), ("one-a", 1), ("one-b", 1))
    }
    for name in ("wide-a", "wide-b"):
        assert len({racks[n] for n in where[name]}) == 1, f"{name} spans racks: {where}"
    assert {racks[where["one-a"][0]], racks[where["one-b"][0]]} == set(RACKS), where

    # Two ranks that must share one rack: the two 1-node gangs would free two nodes, but in
    # two racks; one 3-node gang frees a rack's worth.
    newcomer = training("pair", 2, 100)
    newcomer.body["spec"]["placement"]["groupSize"] = 2
    pair = run_bound(cluster, namespace, newcomer, 2)
    assert len({racks[n] for n in pair}) == 1, f"the pair spans racks: {pair}"

    gone = [name for name in where if preempted(cluster, namespace, name)]
    assert len(gone) == 1, f"evicted {gone}"
    assert gone[0] in ("wide-a", "wide-b")
    assert {racks[n] for n in where[gone[0]]} == {racks[pair[0]]}  # inside the pair's rack
    assert set(pair) <= set(where[gone[0]])
    for name in where:
        if name != gone[0]:  # the others keep every pod where it was
            assert job_nodes(cluster, namespace, name) == where[name], name


def test_at_equal_priority_and_size_the_victim_that_loses_less_work_gives_way(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    small_supernode: str,
    tmp_path: Path,
) -> None:
    where = {
        name: run_bound(cluster, namespace, training(name, 4, 10), 4) for name in ("aged", "recent")
    }
    assert not set(where["aged"]) & set(where["recent"])

    # "aged" committed its checkpoint when it was bound; "recent" a few seconds later.
    bound_at = framework.eventually(
        lambda: scheduled_at(cluster, namespace, "aged"), timeout=30, what="older Scheduled"
    )
    since = datetime.datetime.fromisoformat(bound_at)
    framework.eventually(
        lambda: now() - since >= datetime.timedelta(seconds=3),
        timeout=10,
        what="3 s of work after the older checkpoint",
    )
    patch_checkpoints(cluster, namespace, "aged", bound_at, tmp_path)
    patch_checkpoints(cluster, namespace, "recent", wire(now()), tmp_path)

    taker = run_bound(cluster, namespace, training("taker", 4, 100), 4)

    assert preempted(cluster, namespace, "recent")
    assert not preempted(cluster, namespace, "aged")
    assert job_nodes(cluster, namespace, "aged") == where["aged"]
    assert sorted(taker) == where["recent"]


def scheduled_at(cluster: framework.TestCluster, namespace: str, name: str) -> str | None:
    """When the gang's Scheduled condition turned True (the operator's clock)."""
    scheduled = condition(get_job(cluster, namespace, name), "Scheduled")
    return scheduled.get("lastTransitionTime") if scheduled.get("status") == "True" else None


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def wire(at: datetime.datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def patch_checkpoints(
    cluster: framework.TestCluster, namespace: str, name: str, committed_at: str, folder: Path
) -> None:
    """status.checkpoints as the checkpoint poll writes it: step 100 on every tier."""
    status = {"checkpoints": {"memory": 100, "local": 100, "committedAt": committed_at}}
    patch = folder / f"{name}-status.json"
    patch.write_text(json.dumps({"status": status}))
    cluster.kubectl(
        "patch", "trainingjob", name, "-n", namespace, "--subresource=status",
        "--type=merge", f"--patch-file={patch}",
    )  # fmt: skip
    framework.eventually(
        lambda: (
            (get_job(cluster, namespace, name).get("status") or {}).get("checkpoints")
            == status["checkpoints"]
        ),
        timeout=10,
        what=f"{name}'s checkpoints written",
    )
