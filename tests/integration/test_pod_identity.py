"""A pod is known by its UID (docs/concepts.md, "Read the world"): the operator deletes and binds
the pod it decided on, never a later pod made under the same name. On the real API server,
with the operator's own calls (:mod:`matrixpool.k8s.pods`): the UID goes as the delete's
precondition and as the Binding's, and the API server refuses either for another pod."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes
import pytest

from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import pods
from tests.integration import framework


def make(api: k8s_client.Api, namespace: str, name: str) -> str:
    """Create an unscheduled pod ``name``; its UID."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedulerName": "nobody",  # left alone by kube-scheduler: only our Binding binds it
            "containers": [{"name": "c", "image": "none"}],
        },
    }
    return str(api.core.create_namespaced_pod(namespace, body).metadata.uid)


def read(api: k8s_client.Api, namespace: str, name: str) -> Any:
    """The pod ``name``, or None once it is gone."""
    try:
        return api.core.read_namespaced_pod(name, namespace)
    except kubernetes.client.ApiException as error:
        if error.status == 404:
            return None
        raise


def remade(api: k8s_client.Api, namespace: str, name: str) -> tuple[str, str]:
    """Pod ``name`` made, deleted and made again: (the old UID, the new one)."""
    old = make(api, namespace, name)
    api.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    framework.eventually(lambda: read(api, namespace, name) is None, what="the first pod gone")
    return old, make(api, namespace, name)


def test_a_delete_and_a_binding_meant_for_a_pod_leave_a_new_pod_of_its_name_alone(
    cluster: framework.TestCluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = cluster.api
    monkeypatch.setattr(k8s_client, "default_api", lambda: api)
    old, new = remade(api, namespace, "r-0")
    assert old != new

    asyncio.run(pods.delete([(namespace, "r-0", old)]))  # no error: the pod meant is gone
    pod = read(api, namespace, "r-0")
    assert pod is not None
    assert pod.metadata.uid == new
    assert pod.metadata.deletion_timestamp is None

    (outcome,) = asyncio.run(pods.bind([(namespace, "r-0", old, "n-elsewhere")]))
    assert isinstance(outcome, pods.ReplacedError), outcome
    assert read(api, namespace, "r-0").spec.node_name is None

    (outcome,) = asyncio.run(pods.bind([(namespace, "r-0", new, "n-here")]))
    assert outcome is None
    assert read(api, namespace, "r-0").spec.node_name == "n-here"
    (outcome,) = asyncio.run(pods.bind([(namespace, "r-0", new, "n-here")]))
    assert outcome is None  # bound already, to the node asked: done, as after a lost answer

    # Bound to a node no kubelet runs: only a delete without grace removes it (a graceful one
    # would wait for that kubelet forever, as a dead node's pods would).
    asyncio.run(pods.delete([(namespace, "r-0", new)], grace_seconds=0))
    assert read(api, namespace, "r-0") is None


def test_a_delete_with_grace_leaves_the_pod_terminating_for_that_grace(
    cluster: framework.TestCluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = cluster.api
    monkeypatch.setattr(k8s_client, "default_api", lambda: api)
    uid = make(api, namespace, "g-0")
    (outcome,) = asyncio.run(pods.bind([(namespace, "g-0", uid, "n-here")]))
    assert outcome is None

    asyncio.run(pods.delete([(namespace, "g-0", uid)], grace_seconds=45))
    pod = read(api, namespace, "g-0")
    assert pod is not None
    assert pod.metadata.deletion_grace_period_seconds == 45
    asyncio.run(pods.delete([(namespace, "g-0", uid)], grace_seconds=0))
    assert read(api, namespace, "g-0") is None
