"""The per-job checkpoint credential: a Secret ``matrixpool-ckpt-<job UID>`` in the job's
namespace holding its job token (key ``token``), owned by the TrainingJob so that it goes with
it. The job's pods mount it (:func:`matrixpool.k8s.pods.manifest`); a daemon accepts that
token for that job's checkpoints only (``matrixpool_recovery.credentials``).

Called by :mod:`matrixpool.handlers.credentials` when a TrainingJob appears.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping
from typing import Any

from matrixpool.api import labels
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import pods


def body(namespace: str, job_uid: str, token: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": labels.credential_secret(job_uid),
            "namespace": namespace,
            "labels": {"matrixpool.dev/component": "checkpoint-credential"},
            "ownerReferences": [pods.owner_reference(owner)],
        },
        "data": {labels.CREDENTIAL_KEY: base64.b64encode(token.encode()).decode()},
    }


async def ensure(namespace: str, job_uid: str, token: str, owner: Mapping[str, Any]) -> bool:
    """Create the job's Secret unless it exists; True when this call created it. An existing
    Secret is left as it is (its token is derived, so it is the same)."""
    api = k8s_client.default_api()

    @pods.retry
    def call() -> bool:
        try:
            api.core.create_namespaced_secret(namespace, body(namespace, job_uid, token, owner))
        except Exception as error:
            if k8s_client.is_status(error, 409):
                return False
            raise
        return True

    return await asyncio.to_thread(call)
