"""What a TrainingJob's pod is told (issue 13, item 1): everything a trainer needs comes from
the pod the operator writes — identity, rank, world size, run, checkpoint spec, the node
daemon's address, the credential, the pod's annotations and the daemon's tier-1 folder."""

from __future__ import annotations

import json
from typing import Any

import pytest

from matrixpool.api import labels, trainingjob
from matrixpool.controllers.scheduling import gangpods
from matrixpool.k8s import pods
from matrixpool.placement import gangs, model
from matrixpool.state.workloads import Workload
from tests.unit import worlds

OWNER = {
    "apiVersion": "matrixpool.dev/v1alpha1",
    "kind": "TrainingJob",
    "name": "llm",
    "uid": "u-1",
}
CONTRACT = pods.TrainingContract(
    job_uid="u-1",
    world_size=4,
    incarnation=1700000000000,
    checkpoint='{"memory": {"everySteps": 2}}',
    daemon_port=7041,
    memory_path="/dev/shm/mp",
)


def plan(rank: int = 2) -> gangs.PodPlan:
    return gangs.PodPlan(
        "ns", f"llm-{rank}", model.GangKey("ns/llm"), "llm", "TrainingJob", "trainer", rank, rank, 8
    )


def training_pod(template: dict[str, Any] | None = None) -> dict[str, Any]:
    template = template or {"spec": {"containers": [{"name": "t", "image": "trainer:1"}]}}
    return pods.manifest(plan(), template, OWNER, "huawei.com/Ascend910", CONTRACT)


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]
    }


def test_the_pod_says_who_and_where_the_rank_is() -> None:
    pod = training_pod()
    env = env_of(pod)
    assert env["MATRIXPOOL_JOB"] == "u-1"
    assert env["MATRIXPOOL_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.labels['matrixpool.dev/rank']"}
    }
    assert pod["metadata"]["labels"][labels.RANK] == "2"
    assert env["MATRIXPOOL_WORLD_SIZE"] == "4"
    assert env["MATRIXPOOL_INCARNATION"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['matrixpool.dev/incarnation']"}
    }
    assert pod["metadata"]["annotations"][labels.INCARNATION] == "1700000000000"
    assert json.loads(env["MATRIXPOOL_CHECKPOINT"]) == {"memory": {"everySteps": 2}}


def test_the_daemon_is_reached_on_the_nodes_address_through_the_downward_api() -> None:
    names = [e["name"] for e in training_pod()["spec"]["containers"][0]["env"]]
    env = env_of(training_pod())
    assert env["MATRIXPOOL_NODE_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert env["MATRIXPOOL_CKPT_DAEMON"] == "$(MATRIXPOOL_NODE_IP):7041"
    # $(VAR) expands only to variables defined before it, as the kubelet does
    assert names.index("MATRIXPOOL_NODE_IP") < names.index("MATRIXPOOL_CKPT_DAEMON")


def test_the_pod_mounts_its_credential_its_annotations_and_the_daemons_socket_alone() -> None:
    pod = training_pod()
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    credential = volumes[mounts[labels.CREDENTIAL_MOUNT]["name"]]
    assert credential["secret"]["secretName"] == "matrixpool-ckpt-u-1"
    info = volumes[mounts[labels.POD_INFO_MOUNT]["name"]]["downwardAPI"]["items"]
    assert {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}} in info
    assert env_of(pod)["MATRIXPOOL_ANNOTATIONS_FILE"] == f"{labels.POD_INFO_MOUNT}/annotations"
    socket = volumes[mounts["/dev/shm/mp/socket"]["name"]]
    assert socket["hostPath"] == {"path": "/dev/shm/mp/socket", "type": "DirectoryOrCreate"}
    assert mounts["/dev/shm/mp/socket"]["readOnly"]  # buffers come as files over the socket
    assert env_of(pod)["MATRIXPOOL_CKPT_SOCKET"] == "/dev/shm/mp/socket/daemon.sock"
    host_paths = [v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v]
    assert host_paths == ["/dev/shm/mp/socket"]  # not the daemon's memory folder, no tier 3
    assert mounts[labels.CREDENTIAL_MOUNT]["readOnly"]
    assert mounts[labels.POD_INFO_MOUNT]["readOnly"]


def test_the_users_env_and_volumes_stay_and_ours_replace_theirs() -> None:
    template = {
        "spec": {
            "restartPolicy": "OnFailure",
            "volumes": [{"name": "data", "emptyDir": {}}],
            "containers": [
                {
                    "name": "t",
                    "env": [
                        {"name": "LR", "value": "0.1"},
                        {"name": "MATRIXPOOL_RANK", "value": "9"},
                    ],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
        }
    }
    pod = training_pod(template)
    env = env_of(pod)
    assert env["LR"] == "0.1"
    assert isinstance(env["MATRIXPOOL_RANK"], dict)  # the label, not the template's 9
    assert [e["name"] for e in pod["spec"]["containers"][0]["env"]].count("MATRIXPOOL_RANK") == 1
    assert "data" in {v["name"] for v in pod["spec"]["volumes"]}
    assert pod["spec"]["restartPolicy"] == "Never"  # a failed rank is the operator's to recover


def test_a_training_pod_without_its_contract_is_refused() -> None:
    with pytest.raises(ValueError, match="training contract"):
        pods.manifest(plan(), {}, OWNER, "huawei.com/Ascend910")


def gang_of(job: Workload) -> gangs.Gang:
    assert isinstance(job.model, trainingjob.TrainingJob)
    replicas = job.model.spec.replicas
    return gangs.training_gang(
        "ns", job.name, job.model.spec, 48, replicas, card_resource=worlds.CARDS
    )


def test_a_new_rank_joins_the_run_its_gang_is_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MATRIXPOOL_CKPT_DAEMON_PORT", "7099")
    job = worlds.job("llm", 3)
    restored = '{"step": 4, "of": 5, "incarnation": 9, "from": [], "recovery": "r"}'
    existing = {
        "llm-0": worlds.pod("llm-0", "a", incarnation=7),
        "llm-1": worlds.pod("llm-1", "b", restore=restored),
    }
    contracts = gangpods.training_contracts(job, [gang_of(job)], existing)
    assert set(contracts) == {"llm-0", "llm-1", "llm-2"}
    assert {c.incarnation for c in contracts.values()} == {9}  # the newest the gang names
    assert {c.world_size for c in contracts.values()} == {3}
    assert {c.daemon_port for c in contracts.values()} == {7099}
    assert {c.job_uid for c in contracts.values()} == {"uid-llm"}


def test_a_gang_with_no_live_pod_starts_a_new_run() -> None:
    job = worlds.job("llm", 2)
    gone = {"llm-0": worlds.pod("llm-0", "a", incarnation=7, deleting=True)}
    contracts = gangpods.training_contracts(job, [gang_of(job)], gone)
    [incarnation] = {c.incarnation for c in contracts.values()}
    assert incarnation > 1_600_000_000_000  # milliseconds of now, newer than the old run's 7
    assert json.loads(contracts["llm-0"].checkpoint) == {}  # the job asked for no checkpoint
    saving = worlds.job("llm", 2, checkpoint=True)
    [told] = {
        c.checkpoint for c in gangpods.training_contracts(saving, [gang_of(saving)], {}).values()
    }
    assert json.loads(told) == {"memory": {"everySteps": 2, "peerReplicas": 1}}


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_a_namespace_that_refuses_host_paths_gets_the_pod_without_the_socket(level: str) -> None:
    template = {
        "spec": {
            "volumes": [{"name": "data", "hostPath": {"path": "/data"}}],
            "containers": [
                {"name": "t", "image": "trainer:1", "env": [{"name": "A", "value": "1"}]}
            ],
        }
    }
    pod = training_pod(template)

    admitted = pods.for_pod_security(pod, level)

    volumes = {v["name"] for v in admitted["spec"]["volumes"]}
    assert pods.SOCKET_VOLUME not in volumes
    assert "data" in volumes  # the user's own hostPath stays, for the admission to refuse
    [container] = admitted["spec"]["containers"]
    assert pods.SOCKET_VOLUME not in {m["name"] for m in container["volumeMounts"]}
    assert "MATRIXPOOL_CKPT_SOCKET" not in env_of(admitted)
    assert env_of(admitted)["MATRIXPOOL_CKPT_DAEMON"] == env_of(pod)["MATRIXPOOL_CKPT_DAEMON"]
    assert pods.for_pod_security(pod, "privileged") == pod
    assert pods.for_pod_security(pod, "") == pod
    assert pods.SOCKET_VOLUME in {v["name"] for v in pod["spec"]["volumes"]}  # not changed


def test_an_inference_pod_is_told_its_role_and_its_own_address() -> None:
    serving = gangs.PodPlan(
        "ns", "chat-decode-0-0", model.GangKey("ns/chat/decode/0"), "chat", "InferenceService",
        "decode", 0, 0, 8,
    )  # fmt: skip
    template = {
        "spec": {
            "containers": [
                {
                    "name": "s",
                    "image": "matrixpool:1",
                    "env": [{"name": "MATRIXPOOL_ROLE", "value": "x"}],
                }
            ]
        }
    }
    owner = {**OWNER, "kind": "InferenceService", "name": "chat"}
    env = env_of(pods.manifest(serving, template, owner, "huawei.com/Ascend910"))
    assert env["MATRIXPOOL_ROLE"] == "decode"
    assert env["MATRIXPOOL_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "MATRIXPOOL_JOB" not in env


def test_a_template_cannot_forge_the_operators_labels_annotations_or_restart_policy() -> None:
    """Issue 31, findings 3 and 5: the CRDs refuse these keys; a template that got them through
    (an object stored before the rule) still never puts them on a pod, and a restarted
    container never goes on in its old run."""
    template = {
        "metadata": {
            "labels": {labels.JOB_UID: "theirs", labels.RANK: "0", "team": "a"},
            "annotations": {
                labels.CARDS: "0,1,2,3,4,5,6,7",
                labels.RESTORE: '{"step": 1}',
                "deviceplugin.matrixpool.dev/allocated-cards": "0",
                "example.com/matrixpool.dev": "kept",
            },
        },
        "spec": {"restartPolicy": "OnFailure", "containers": [{"name": "t", "image": "x"}]},
    }
    pod = training_pod(template)
    meta = pod["metadata"]
    assert meta["labels"][labels.JOB_UID] == "u-1"
    assert meta["labels"][labels.RANK] == "2"
    assert meta["labels"]["team"] == "a"
    assert meta["annotations"] == {
        labels.INCARNATION: str(CONTRACT.incarnation),
        "example.com/matrixpool.dev": "kept",
    }
    assert pod["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize(
    ("key", "ours"),
    [
        ("matrixpool.dev/cards", True),
        ("deviceplugin.matrixpool.dev/allocated-cards", True),
        ("matrixpool.dev", False),
        ("example.com/matrixpool.dev", False),
        ("notmatrixpool.dev/x", False),
        ("team", False),
    ],
)
def test_the_operators_keys_are_those_under_its_domain(key: str, ours: bool) -> None:
    assert pods.is_ours(key) is ours
