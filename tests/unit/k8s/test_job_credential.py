"""The per-job checkpoint credential (issue 11, defect 3): the Secret the operator writes and
what a TrainingJob's pods get from it; InferenceService pods get none."""

from __future__ import annotations

import base64

from matrixpool.api import labels
from matrixpool.k8s import pods, secrets
from matrixpool.placement import gangs, model
from matrixpool_recovery import credentials

OWNER = {
    "apiVersion": "matrixpool.dev/v1alpha1",
    "kind": "TrainingJob",
    "name": "llm",
    "uid": "u-1",
}


def plan(kind: str) -> gangs.PodPlan:
    return gangs.PodPlan("ns", "llm-0", model.GangKey("ns/llm"), "llm", kind, "trainer", 0, 0, 8)


def test_a_training_pod_gets_the_job_uid_and_mounts_the_jobs_token() -> None:
    template = {
        "spec": {"containers": [{"name": "t", "env": [{"name": "MATRIXPOOL_JOB", "value": "x"}]}]}
    }
    contract = pods.TrainingContract(job_uid="u-1", world_size=1, incarnation=1)
    pod = pods.manifest(plan("TrainingJob"), template, OWNER, "huawei.com/Ascend910", contract)
    [volume] = [v for v in pod["spec"]["volumes"] if "secret" in v]
    assert volume["secret"] == {"secretName": "matrixpool-ckpt-u-1", "optional": True}
    container = pod["spec"]["containers"][0]
    assert {"name": volume["name"], "mountPath": labels.CREDENTIAL_MOUNT, "readOnly": True} in (
        container["volumeMounts"]
    )
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MATRIXPOOL_JOB"] == "u-1"  # the UID, whatever the template said
    assert env["MATRIXPOOL_CKPT_TOKEN_FILE"] == f"{labels.CREDENTIAL_MOUNT}/token"
    assert not any(
        "TOKEN" in e["name"] and "value" in e and e["name"] != "MATRIXPOOL_CKPT_TOKEN_FILE"
        for e in container["env"]
    )


def test_an_inference_pod_gets_no_checkpoint_credential() -> None:
    pod = pods.manifest(plan("InferenceService"), {}, OWNER, "nvidia.com/gpu")
    assert "volumes" not in pod["spec"]
    names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert "MATRIXPOOL_CKPT_TOKEN_FILE" not in names


def test_the_secret_holds_the_jobs_token_and_is_owned_by_the_job() -> None:
    token = credentials.job_token("cluster-secret", "u-1")
    body = secrets.body("ns", "u-1", token, OWNER)
    assert body["metadata"]["name"] == "matrixpool-ckpt-u-1"
    assert base64.b64decode(body["data"]["token"]).decode() == token
    [owner] = body["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == ("u-1", True)


def test_a_pod_with_an_admitted_kv_cache_mounts_its_services_token_and_finds_the_pool() -> None:
    contract = pods.ServingContract(
        service_uid="s-1", daemons=("127.1.0.1:7040", "127.1.0.2:7040"), credential=True
    )
    pod = pods.manifest(plan("InferenceService"), {}, OWNER, "nvidia.com/gpu", None, contract)
    [volume] = pod["spec"]["volumes"]
    assert volume["secret"] == {"secretName": "matrixpool-kv-s-1", "optional": False}
    container = pod["spec"]["containers"][0]
    assert {"name": volume["name"], "mountPath": labels.KV_MOUNT, "readOnly": True} in (
        container["volumeMounts"]
    )
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MATRIXPOOL_KV_SERVICE"] == "s-1"
    assert env["MATRIXPOOL_KV_TOKEN_FILE"] == f"{labels.KV_MOUNT}/token"
    assert env["MATRIXPOOL_KV_DAEMONS"] == (
        "$(MATRIXPOOL_NODE_IP):7040,127.1.0.1:7040,127.1.0.2:7040"
    )
    names = [e["name"] for e in container["env"]]
    assert names.index("MATRIXPOOL_NODE_IP") < names.index("MATRIXPOOL_KV_DAEMONS")
    assert "MATRIXPOOL_CKPT_TOKEN_FILE" not in names  # no checkpoint token


def test_the_services_secret_holds_a_token_that_opens_its_kv_blocks_only() -> None:
    token = credentials.service_token("cluster-secret", "s-1")
    body = secrets.body("ns", "s-1", token, OWNER, secrets.SERVICE)
    assert body["metadata"]["name"] == "matrixpool-kv-s-1"
    assert body["metadata"]["labels"] == {"matrixpool.dev/component": "kv-cache-credential"}
    assert base64.b64decode(body["data"]["token"]).decode() == token
    assert token != credentials.job_token("cluster-secret", "s-1")
