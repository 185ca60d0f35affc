"""The device plugin's view of the Kubernetes API, behind the small :class:`Cluster` interface so
that tests pass a fake: the pods bound to this node, the mark on a pod whose cards were
allocated, and the node's ``matrixpool.dev/unhealthy-cards`` annotation.

:class:`KubeCluster` is the real one, used by ``python -m matrixpool.deviceplugin``: a fresh
pod list (field selector ``spec.nodeName``) for every pairing, since the kubelet has just seen
the pod it admits; the node's annotation kept current by a watch of that one Node.
RBAC: pods list and patch, nodes list and watch (the chart's device plugin ClusterRole); the
chart's devicePluginPolicy admits the patch only on a pod of this node, changing nothing but
:data:`pairing.ALLOCATED`.

Errors: the API's (``kubernetes.client.ApiException``, urllib3's), raised by :meth:`pods` and
:meth:`mark_allocated` for the caller to log; the node watch logs and retries its own.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import kubernetes
import structlog

from matrixpool.api import labels
from matrixpool.deviceplugin import pairing
from matrixpool.k8s import client as k8s_client

log = structlog.get_logger(__name__)

WATCH_SECONDS = 300  # one watch request of the Node before it is renewed
RETRY_SECONDS = 5.0  # pause after a failed list or watch of the Node


class Cluster(Protocol):
    """What the plugin asks of the API."""

    def pods(self) -> list[pairing.Pod]:
        """The pods bound to this node (every phase)."""
        ...

    def mark_allocated(self, pod: pairing.Pod, cards: frozenset[int]) -> None:
        """Record on ``pod`` (annotation :data:`pairing.ALLOCATED`) the cards it was given."""
        ...

    def unhealthy_cards(self) -> frozenset[int]:
        """The node's ``matrixpool.dev/unhealthy-cards``, as last seen."""
        ...


class KubeCluster:
    """:class:`Cluster` on the API server, for node ``node`` and extended resource
    ``resource``. :meth:`start` starts the watch of the Node (a daemon thread)."""

    def __init__(self, api: k8s_client.Api, node: str, resource: str) -> None:
        self._api = api
        self._node = node
        self._resource = resource
        self._unhealthy: frozenset[int] = frozenset()
        self._annotation: str | None = None  # the last value read (parsed only on change)

    def pods(self) -> list[pairing.Pod]:
        response = self._api.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self._node}", _preload_content=False
        )
        items = json.loads(response.data).get("items") or []
        return [pairing.pod_from_manifest(item, self._resource) for item in items]

    def mark_allocated(self, pod: pairing.Pod, cards: frozenset[int]) -> None:
        # The UID makes the patch fail (UIDs are immutable) on a pod re-created under the name.
        metadata = {"uid": pod.uid, "annotations": {pairing.ALLOCATED: labels.format_cards(cards)}}
        self._api.core.patch_namespaced_pod(pod.name, pod.namespace, {"metadata": metadata})

    def unhealthy_cards(self) -> frozenset[int]:
        return self._unhealthy

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(
            target=self._watch_node, args=(stop,), name="deviceplugin-node", daemon=True
        )
        thread.start()
        return thread

    def _watch_node(self, stop: threading.Event) -> None:
        selector = f"metadata.name={self._node}"
        while not stop.is_set():
            try:
                listing = self._api.core.list_node(field_selector=selector, _preload_content=False)
                body = json.loads(listing.data)
                for node in body.get("items") or []:
                    self._saw(node)
                watching: Any = kubernetes.watch  # untyped
                watch = watching.Watch()
                for event in watch.stream(
                    self._api.core.list_node,
                    field_selector=selector,
                    resource_version=body["metadata"]["resourceVersion"],
                    timeout_seconds=WATCH_SECONDS,
                ):
                    if stop.is_set() or event["type"] == "ERROR":  # ERROR: relist (410 Gone)
                        watch.stop()
                        break
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._saw(event["raw_object"])
            except Exception as error:  # the API is down or refuses: keep the last value
                log.warning("node watch failed", node=self._node, error=str(error))
                stop.wait(RETRY_SECONDS)

    def _saw(self, node: Mapping[str, Any]) -> None:
        annotations = (node.get("metadata") or {}).get("annotations") or {}
        value = annotations.get(labels.UNHEALTHY_CARDS)
        if value == self._annotation:
            return
        try:
            self._unhealthy = labels.parse_cards(value)
        except ValueError:
            log.warning("unreadable node annotation kept at its last value", value=value)
        self._annotation = value
