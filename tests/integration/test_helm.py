"""The Helm chart on the real control plane: the operator Deployment it installs becomes
Available on a kwok node, and ``helm uninstall`` leaves the CRDs and the custom resources alone,
also when the CRDs were installed by the chart itself (``helm.sh/resource-policy: keep``).

The session's CRDs were applied by the conftest with ``kubectl apply --server-side``; every other
test depends on them. So a release here never deletes them: the CRD test checks the keep policy
before it installs, and teardown only makes helm forget a release (see :func:`forget`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import yaml

from tests.integration import framework

pytestmark = pytest.mark.integration

CHART = framework.REPO / "charts" / "matrixpool"
CRDS = (
    "supernodes.matrixpool.dev",
    "trainingjobs.matrixpool.dev",
    "inferenceservices.matrixpool.dev",
)
# What helm needs on an existing object before a release may take it over.
OWNER_LABEL = "app.kubernetes.io/managed-by"
OWNER_ANNOTATIONS = ("meta.helm.sh/release-name", "meta.helm.sh/release-namespace")
# The operator is never pulled: kwok runs its pod without an image.
IMAGE = ("image.repository=matrixpool", "image.tag=integration-test")
# The session's cluster has the pod-annotations policy already, allowing the operator the other
# tests run (the admin user); a release's own policy would deny that user cluster-wide. The
# checkpoint daemons (on by default) are off: the session's sim already runs a daemon on each of
# its nodes, on the port the chart's would take; tests/e2e installs the chart with them.
SETS = (*IMAGE, "podAnnotationsPolicy.enabled=false", "checkpointDaemon.enabled=false")


def get_json(cluster: framework.TestCluster, *args: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", *args, "-o", "json").stdout))


def exists(cluster: framework.TestCluster, *args: str) -> bool:
    return cluster.kubectl("get", *args, "-o", "name", check=False).returncode == 0


def set_args(*sets: str) -> list[str]:
    return [arg for value in (*SETS, *sets) for arg in ("--set", value)]


def forget(cluster: framework.TestCluster, release: str, namespace: str) -> None:
    """Make helm forget ``release`` without deleting anything it installed, then delete its
    cluster-scoped RBAC by name. Never deletes a CRD, whatever the release's manifest says."""
    cluster.kubectl(
        "delete", "secret", "-n", namespace, "-l", f"owner=helm,name={release}", check=False
    )
    fullname = f"{release}-matrixpool"
    cluster.kubectl(
        "delete", "clusterrolebinding,clusterrole", fullname, "--ignore-not-found", check=False
    )


@contextmanager
def release(
    cluster: framework.TestCluster, name: str, namespace: str, *sets: str, wait: bool
) -> Iterator[str]:
    """``helm install`` of the chart; on the way out the release is forgotten if still there."""
    waiting = ["--wait", "--timeout", "120s"] if wait else []
    try:
        cluster.helm("install", name, str(CHART), "-n", namespace, *set_args(*sets), *waiting)
        yield f"{name}-matrixpool"
    finally:
        forget(cluster, name, namespace)


def deployment_available(cluster: framework.TestCluster, namespace: str, name: str) -> bool:
    status = get_json(cluster, "deployment", name, "-n", namespace).get("status", {})
    return any(
        c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions", [])
    )


def operator_pod(cluster: framework.TestCluster, namespace: str, release: str) -> dict[str, Any]:
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
    pods = get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return dict(pods[0])


@pytest.fixture
def supernode(cluster: framework.TestCluster) -> Iterator[str]:
    """A SuperNode that selects no node (so no other test's supernode overlaps it)."""
    name = framework.unique("helm-sn")
    body = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "SuperNode",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": name}},
            "cardResource": "huawei.com/Ascend910",
            "cardsPerNode": 8,
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    yield name
    cluster.kubectl("delete", "supernode", name, "--ignore-not-found", "--wait=false", check=False)


def test_chart_installs_an_operator_that_kube_scheduler_places_on_a_kwok_node(
    cluster: framework.TestCluster, namespace: str, supernode: str
) -> None:
    name = framework.unique("mp")
    with release(cluster, name, namespace, "crds.install=false", wait=True) as deployment:
        framework.eventually(
            lambda: deployment_available(cluster, namespace, deployment),
            timeout=120,
            what=f"Deployment {deployment} Available",
        )
        pod = operator_pod(cluster, namespace, name)
        node_name = pod["spec"].get("nodeName")
        assert node_name, "the operator pod was never bound"
        assert pod["spec"]["schedulerName"] == "default-scheduler"
        scheduled = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert scheduled.get("PodScheduled") == "True"
        node = get_json(cluster, "node", node_name)
        assert node["metadata"]["annotations"].get("kwok.x-k8s.io/node") == "fake"
        for kind in ("clusterrole", "clusterrolebinding"):
            assert exists(cluster, kind, deployment)

        cluster.helm("uninstall", name, "-n", namespace, "--wait", "--timeout", "120s")

        for crd in CRDS:
            assert exists(cluster, "crd", crd), f"{crd} was deleted by helm uninstall"
        assert exists(cluster, "supernode", supernode), "helm uninstall deleted a SuperNode"
        assert not exists(cluster, "clusterrole", deployment)
        assert not exists(cluster, "deployment", deployment, "-n", namespace)


@contextmanager
def crds_owned_by(cluster: framework.TestCluster, name: str, namespace: str) -> Iterator[None]:
    """Give the session's CRDs the ownership metadata helm needs to adopt them into release
    ``name``; take it off again afterwards so they look as the conftest left them."""
    cluster.kubectl("label", "--overwrite", "crd", *CRDS, f"{OWNER_LABEL}=Helm")
    cluster.kubectl(
        "annotate",
        "--overwrite",
        "crd",
        *CRDS,
        f"{OWNER_ANNOTATIONS[0]}={name}",
        f"{OWNER_ANNOTATIONS[1]}={namespace}",
    )
    try:
        yield
    finally:
        cluster.kubectl("label", "crd", *CRDS, f"{OWNER_LABEL}-", check=False)
        cluster.kubectl(
            "annotate", "crd", *CRDS, *(f"{key}-" for key in OWNER_ANNOTATIONS), check=False
        )


def rendered_crds(cluster: framework.TestCluster, *sets: str) -> list[dict[str, Any]]:
    """The CRDs of ``helm template``, rendered for the cluster's Kubernetes version (helm built
    from source without version ldflags assumes v1.20, below the chart's kubeVersion)."""
    server = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    rendered = cluster.helm(
        "template",
        "keep-check",
        str(CHART),
        "--kube-version",
        server["gitVersion"],
        *set_args(*sets),
    ).stdout
    return [
        doc
        for doc in yaml.safe_load_all(rendered)
        if doc and doc["kind"] == "CustomResourceDefinition"
    ]


def test_helm_uninstall_keeps_the_crds_the_chart_installed(
    cluster: framework.TestCluster, namespace: str, supernode: str
) -> None:
    # 1. Nothing is installed unless every CRD of the chart is marked keep: an uninstall that
    #    deleted them would delete every custom resource of the session.
    crds = rendered_crds(cluster, "crds.install=true")
    assert sorted(c["metadata"]["name"] for c in crds) == sorted(CRDS)
    for crd in crds:
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    # 2. Install the chart with its CRDs; it adopts the ones the conftest applied.
    name = framework.unique("mp")
    with (
        crds_owned_by(cluster, name, namespace),
        release(cluster, name, namespace, "crds.install=true", wait=False),
    ):
        manifest = cluster.helm("get", "manifest", name, "-n", namespace).stdout
        released = [d for d in yaml.safe_load_all(manifest) if d]
        owned = {d["metadata"]["name"] for d in released if d["kind"] == "CustomResourceDefinition"}
        assert owned == set(CRDS)
        for crd in CRDS:
            annotations = get_json(cluster, "crd", crd)["metadata"]["annotations"]
            assert annotations["meta.helm.sh/release-name"] == name

        # 3. Uninstall: helm skips the kept CRDs, so they and the SuperNode stay.
        cluster.helm("uninstall", name, "-n", namespace, "--wait", "--timeout", "120s")
        for crd in CRDS:
            assert exists(cluster, "crd", crd), f"{crd} was deleted by helm uninstall"
        assert exists(cluster, "supernode", supernode), "helm uninstall deleted a SuperNode"
