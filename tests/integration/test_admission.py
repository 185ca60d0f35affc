"""``matrixpool.dev/*`` pod annotations are the operator's ledger, on the real kube-apiserver:
the chart's ValidatingAdmissionPolicy (installed by the dev cluster, with the admin user the
operator runs as among the writers) denies a user who may create and patch pods in their
namespace any set, change or removal of those annotations — on create, patch and through a
Binding — while their other annotations pass, and the operator's identity writes them freely.

The user is a ServiceAccount with a Role on pods (and bindings) in the test's namespace; its
token comes from the TokenRequest API (``kubectl create token``) and goes into a kubeconfig of
its own, not onto a command line.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from matrixpool.api import labels
from matrixpool.devcluster import certs
from matrixpool.devcluster import cluster as devcluster
from matrixpool.k8s import convert
from tests.integration import framework

pytestmark = pytest.mark.integration

DENIED = "matrixpool.dev/* pod annotations are written by the matrixpool operator only"
REMOVAL_DENIED = "matrixpool.dev/* pod annotations are removed by the matrixpool operator only"
LABEL_DENIED = "matrixpool.dev/* pod labels are written by the matrixpool operator only"
LABEL_REMOVAL_DENIED = "matrixpool.dev/* pod labels are removed by the matrixpool operator only"
Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def pod(name: str, annotations: dict[str, str] | None = None) -> str:
    """A pod nothing schedules (schedulerName matrixpool, no operator runs here)."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "schedulerName": labels.SCHEDULER_NAME,
            "containers": [{"name": "main", "image": "example.invalid/workload:1"}],
        },
    }
    return json.dumps(body)


def tenant_role(namespace: str) -> str:
    """A user who may create and patch pods in ``namespace``, and bind them."""
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "create", "patch", "update"]},
        {"apiGroups": [""], "resources": ["pods/binding", "bindings"], "verbs": ["create"]},
    ]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "pod-writer", "namespace": namespace},
        "rules": rules,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "pod-writer", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-writer"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": namespace}],
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [role, binding]})


@pytest.fixture
def tenant(cluster: framework.TestCluster, namespace: str, tmp_path: Path) -> Kubectl:
    """kubectl as the ServiceAccount ``tenant`` of ``namespace``."""
    cluster.kubectl("create", "serviceaccount", "tenant", "-n", namespace)
    cluster.kubectl("apply", "-f", "-", input=tenant_role(namespace))
    token = cluster.kubectl("create", "token", "tenant", "-n", namespace, "--duration=1h")
    server = cluster.local.status()["server"]
    ca = certs.paths(cluster.local.folder / "pki").ca_cert
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": "tenant", "user": {"token": token.stdout.strip()}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "tenant"}}],
        "current-context": "c",
    }
    kubeconfig = tmp_path / "tenant.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    kubeconfig.chmod(0o600)

    def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = [devcluster.kubectl_path(), f"--kubeconfig={kubeconfig}", "-n", namespace, *args]
        return subprocess.run(argv, input=input, capture_output=True, text=True, check=False)

    return kubectl


def as_operator(cluster: framework.TestCluster, namespace: str) -> Kubectl:
    """kubectl as the admin certificate's user: the identity the dev cluster's operator has."""

    def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl("-n", namespace, *args, input=input, check=False)

    return kubectl


def annotate(
    kubectl: Kubectl, name: str, annotations: dict[str, str | None], *flags: str
) -> subprocess.CompletedProcess[str]:
    patch = json.dumps({"metadata": {"annotations": annotations}})
    return kubectl("patch", "pod", name, "--type=merge", "-p", patch, *flags)


def assert_denied(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode != 0, "admitted"
    assert message in result.stderr, result.stderr


def annotations_of(cluster: framework.TestCluster, namespace: str, name: str) -> dict[str, str]:
    body = json.loads(cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)
    return dict(body["metadata"].get("annotations") or {})


def test_a_tenant_may_not_set_matrixpool_annotations_but_may_set_others(
    cluster: framework.TestCluster, namespace: str, tenant: Kubectl
) -> None:
    created = tenant("apply", "-f", "-", input=pod("p"))
    assert created.returncode == 0, created.stderr
    framework.eventually(  # the policy is in force (a dry run passes admission, stores nothing)
        lambda: annotate(tenant, "p", {labels.CARDS: "0,1"}, "--dry-run=server").returncode,
        timeout=30,
        what="the policy denying the tenant's matrixpool.dev/cards patch",
    )
    denied = annotate(tenant, "p", {labels.CARDS: "0,1"})
    assert_denied(denied, DENIED)
    allowed = annotate(tenant, "p", {"example.com/note": "mine"})
    assert allowed.returncode == 0, allowed.stderr
    found = annotations_of(cluster, namespace, "p")
    assert found["example.com/note"] == "mine"
    assert labels.CARDS not in found


def test_a_tenant_may_not_create_a_pod_carrying_a_restore_or_node_annotation(
    namespace: str, tenant: Kubectl
) -> None:
    for key in (labels.RESTORE, convert.NODE_ANNOTATION):
        result = tenant("apply", "-f", "-", input=pod(f"p-{key.rsplit('/', 1)[1]}", {key: "x"}))
        assert_denied(result, DENIED)


def test_the_operator_identity_writes_them_and_a_tenant_may_not_change_or_remove_them(
    cluster: framework.TestCluster, namespace: str, tenant: Kubectl
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod("q"))
    operator = annotate(as_operator(cluster, namespace), "q", {labels.CARDS: "0,1,2,3"})
    assert operator.returncode == 0, operator.stderr
    assert annotations_of(cluster, namespace, "q")[labels.CARDS] == "0,1,2,3"
    changed = annotate(tenant, "q", {labels.CARDS: "4,5,6,7"})
    assert_denied(changed, DENIED)
    removed = annotate(tenant, "q", {labels.CARDS: None})
    assert_denied(removed, REMOVAL_DENIED)
    kept = annotate(tenant, "q", {"example.com/note": "unrelated"})  # the others stay as they are
    assert kept.returncode == 0, kept.stderr
    assert annotations_of(cluster, namespace, "q")[labels.CARDS] == "0,1,2,3"


def test_a_tenant_binding_may_not_carry_matrixpool_annotations(
    cluster: framework.TestCluster, namespace: str, tenant: Kubectl
) -> None:
    """A Binding's annotations are copied onto its pod: the legacy bindings endpoint and the
    pods/binding subresource are both guarded."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pod("b"))
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "b", "annotations": {labels.CARDS: "0"}},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "sn-0-node-00"},
    }
    legacy = tenant("create", "--validate=false", "-f", "-", input=json.dumps(binding))
    assert_denied(legacy, DENIED)
    path = f"/api/v1/namespaces/{namespace}/pods/b/binding"
    sub = tenant("create", "--raw", path, "-f", "-", input=json.dumps(binding))
    assert_denied(sub, DENIED)
    assert labels.CARDS not in annotations_of(cluster, namespace, "b")


def test_a_tenant_may_not_label_a_pod_as_a_gangs_but_may_set_other_labels(
    cluster: framework.TestCluster, namespace: str, tenant: Kubectl
) -> None:
    """Issue 31, finding 3: the daemons' NetworkPolicy admits pods labelled matrixpool.dev/job;
    only the operator may put that label on a pod, or take it off."""
    body = json.loads(pod("lab"))
    body["metadata"]["labels"] = {labels.JOB: "someone-elses"}
    created = tenant("apply", "-f", "-", input=json.dumps(body))
    assert_denied(created, LABEL_DENIED)
    assert tenant("apply", "-f", "-", input=pod("lab")).returncode == 0
    relabel = json.dumps({"metadata": {"labels": {labels.JOB: "x"}}})
    assert_denied(tenant("patch", "pod", "lab", "--type=merge", "-p", relabel), LABEL_DENIED)
    other = json.dumps({"metadata": {"labels": {"team": "a"}}})
    allowed = tenant("patch", "pod", "lab", "--type=merge", "-p", other)
    assert allowed.returncode == 0, allowed.stderr
    operator = as_operator(cluster, namespace)("patch", "pod", "lab", "--type=merge", "-p", relabel)
    assert operator.returncode == 0, operator.stderr
    removal = json.dumps({"metadata": {"labels": {labels.JOB: None}}})
    assert_denied(
        tenant("patch", "pod", "lab", "--type=merge", "-p", removal), LABEL_REMOVAL_DENIED
    )
