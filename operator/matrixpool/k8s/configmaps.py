"""ConfigMaps the operator owns (the expert map of an InferenceService): create or replace."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import pods


async def apply(
    namespace: str, name: str, data: Mapping[str, str], owner: Mapping[str, Any]
) -> None:
    """Make ConfigMap ``namespace/name`` hold exactly ``data``, owned by ``owner``."""
    api = k8s_client.default_api()
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "ownerReferences": [pods.owner_reference(owner)],
        },
        "data": dict(data),
    }

    @pods.retry
    def call() -> None:
        try:
            api.core.replace_namespaced_config_map(name, namespace, body)
        except Exception as error:
            if not k8s_client.is_status(error, 404):
                raise
            api.core.create_namespaced_config_map(namespace, body)

    await asyncio.to_thread(call)
