"""The peers' setup without a cluster: Kueue's Configuration, its webhooks rewritten to a
loopback URL, its queue objects, and the control plane's peer flags (devcluster.kueue,
devcluster.cluster)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from matrixpool.api import labels
from matrixpool.devcluster import cluster, kueue, topology

UPSTREAM = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: mutating-webhook-configuration
webhooks:
- name: mjob.kb.io
  admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate-batch-v1-job}
  failurePolicy: Fail
  rules: [{apiGroups: [batch], apiVersions: [v1], operations: [CREATE], resources: [jobs]}]
  sideEffects: None
- name: mpod.kb.io
  admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}
  failurePolicy: Fail
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
  sideEffects: None
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: validating-webhook-configuration
webhooks:
- name: vclusterqueue.kb.io
  admissionReviewVersions: [v1]
  clientConfig:
    service:
      name: webhook-service
      namespace: system
      path: /validate-kueue-x-k8s-io-v1beta2-clusterqueue
  failurePolicy: Fail
  rules: []
  sideEffects: None
"""


def rewritten() -> list[dict[str, Any]]:
    return kueue.webhooks(yaml.safe_load_all(UPSTREAM), 9443, b"CA PEM")


def test_webhooks_point_at_loopback_with_the_cluster_ca_and_keep_only_the_job_path() -> None:
    mutating, validating = rewritten()
    assert [h["name"] for h in mutating["webhooks"]] == ["mjob.kb.io"]  # the pod hook is dropped
    hook = mutating["webhooks"][0]
    assert hook["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate-batch-v1-job",
        "caBundle": base64.b64encode(b"CA PEM").decode(),
    }
    assert hook["failurePolicy"] == "Fail"
    assert mutating["metadata"]["name"] == "kueue-mutating-webhook-configuration"
    assert validating["webhooks"][0]["clientConfig"]["url"].endswith(
        "/validate-kueue-x-k8s-io-v1beta2-clusterqueue"
    )


def test_job_webhooks_see_only_jobs_that_name_a_queue() -> None:
    mutating, validating = rewritten()
    selector = mutating["webhooks"][0]["objectSelector"]["matchExpressions"]
    assert selector == [{"key": kueue.QUEUE_LABEL, "operator": "Exists"}]
    assert "objectSelector" not in validating["webhooks"][0]  # queues are Kueue's own objects


def test_configuration_serves_on_loopback_without_leader_election_or_internal_certificates() -> (
    None
):
    config = kueue.configuration(9443, 8081, Path("/x/certs"))
    assert config["webhook"] == {"host": "127.0.0.1", "port": 9443, "certDir": "/x/certs"}
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:8081"
    assert config["leaderElection"]["leaderElect"] is False
    assert config["internalCertManagement"]["enable"] is False
    assert config["featureGates"]["TopologyAwareScheduling"] is True
    assert config["integrations"]["frameworks"] == ["batch/job"]


def test_queue_objects_hold_every_card_under_a_supernode_rack_hostname_topology() -> None:
    shape = topology.Shape(supernodes=4)
    objects = {o["kind"]: o for o in kueue.queue_objects(shape)}
    levels = [level["nodeLabel"] for level in objects["Topology"]["spec"]["levels"]]
    assert levels == [labels.SUPERNODE, labels.RACK, "kubernetes.io/hostname"]
    assert objects["ResourceFlavor"]["spec"]["topologyName"] == kueue.TOPOLOGY
    # the flavor's node label is one every kwok node carries
    node = topology.nodes(shape)[0]
    for key, value in objects["ResourceFlavor"]["spec"]["nodeLabels"].items():
        assert node["metadata"]["labels"][key] == value
    group = objects["ClusterQueue"]["spec"]["resourceGroups"][0]
    quota = group["flavors"][0]["resources"][0]
    assert quota == {"name": shape.card_resource, "nominalQuota": str(4 * 48 * 8)}
    assert objects["ClusterQueue"]["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"


def test_peer_flags_only_on_a_cluster_started_with_peers(tmp_path: Path) -> None:
    local = cluster.Cluster(tmp_path)
    local._write_state({"peers": False})
    assert local._peer_flags(runtime_config=True) == []
    assert "profiles" not in local._scheduler_config("kubeconfig")
    local._write_state({"peers": True, "card_resource": "huawei.com/Ascend910"})
    assert local._peer_flags(runtime_config=True) == [
        f"--feature-gates={cluster.PEER_GATES}",
        f"--runtime-config={cluster.PEER_RUNTIME_CONFIG}",
    ]
    assert local._peer_flags() == [f"--feature-gates={cluster.PEER_GATES}"]
    profile = local._scheduler_config("kubeconfig")["profiles"][0]
    args = profile["pluginConfig"][0]["args"]["scoringStrategy"]
    assert args == {
        "type": "MostAllocated",
        "resources": [{"name": "huawei.com/Ascend910", "weight": 1}],
    }
