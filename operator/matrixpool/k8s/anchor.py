"""The anchor ConfigMap that the operator's main loop runs on (see
:mod:`matrixpool.controllers.loop`): created at startup, removed on a clean standalone shutdown."""

from __future__ import annotations

import asyncio

from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import pods

NAME = "matrixpool-scheduler"
COMPONENT_LABEL = "matrixpool.dev/component"
COMPONENT = "scheduler"


async def ensure(namespace: str) -> None:
    """Create the anchor in ``namespace`` unless it exists."""
    api = k8s_client.default_api()
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NAME, "namespace": namespace, "labels": {COMPONENT_LABEL: COMPONENT}},
        "data": {"purpose": "the matrixpool operator's main loop runs on this object"},
    }

    @pods.retry
    def call() -> None:
        try:
            api.core.create_namespaced_config_map(namespace, body)
        except Exception as error:
            if not k8s_client.is_status(error, 409):
                raise

    await asyncio.to_thread(call)


async def remove(namespace: str) -> None:
    """Drop kopf's finalizer from the anchor and delete it."""
    api = k8s_client.default_api()

    def call() -> None:
        try:
            api.core.patch_namespaced_config_map(
                NAME, namespace, {"metadata": {"finalizers": None}}
            )
            api.core.delete_namespaced_config_map(NAME, namespace)
        except Exception as error:
            if not k8s_client.is_status(error, 404):
                raise

    await asyncio.to_thread(call)
