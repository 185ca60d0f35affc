"""The per-job checkpoint credential: a Secret ``matrixpool-ckpt-<job UID>`` in the job's
namespace holding its job token (key ``token``), owned by the TrainingJob so that it goes with
it. The job's pods mount it (:func:`matrixpool.k8s.pods.manifest`); a daemon accepts that
token for that job's checkpoints only (``matrixpool_recovery.credentials``). The same for an
InferenceService with ``spec.kvCache``: ``matrixpool-kv-<service UID>`` holds its service
token, which opens its own KV-cache blocks only (``SERVICE`` below).

Called by :mod:`matrixpool.controllers.credentials` when a TrainingJob or such a service appears.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping
from typing import Any

from matrixpool.api import labels
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import pods

JOB = "checkpoint-credential"  # the component label of a job's Secret
SERVICE = "kv-cache-credential"  # of a service's


def body(
    namespace: str, uid: str, token: str, owner: Mapping[str, Any], component: str = JOB
) -> dict[str, Any]:
    name = labels.credential_secret(uid) if component == JOB else labels.kv_secret(uid)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"matrixpool.dev/component": component},
            "ownerReferences": [pods.owner_reference(owner)],
        },
        "data": {labels.CREDENTIAL_KEY: base64.b64encode(token.encode()).decode()},
    }


async def ensure(
    namespace: str, uid: str, token: str, owner: Mapping[str, Any], component: str = JOB
) -> bool:
    """Create the job's (or service's) Secret unless it exists; True when this call created
    it. An existing Secret is left as it is (its token is derived, so it is the same)."""
    api = k8s_client.default_api()

    @pods.retry
    def call() -> bool:
        try:
            manifest = body(namespace, uid, token, owner, component)
            api.core.create_namespaced_secret(namespace, manifest)
        except Exception as error:
            if k8s_client.is_status(error, 409):
                return False
            raise
        return True

    return await asyncio.to_thread(call)
