"""The headless Service of every TrainingJob: named after the job, ``clusterIP: None``,
``publishNotReadyAddresses: true`` (a rank resolves its peers before they are ready: that is
what rendezvous is for), selecting the job's pods by their UID label, owned by the job so that
it goes with it. With the pods' ``hostname: <job>-<rank>`` and ``subdomain: <job>``
(:func:`matrixpool.k8s.pods.manifest`), cluster DNS answers
``<job>-<rank>.<job>.<namespace>.svc.<domain>`` with the rank's pod IP, whichever node it is on.

Called by :mod:`matrixpool.controllers.jobservice` when a TrainingJob appears.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from matrixpool.api import labels
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import pods

COMPONENT = "rendezvous"  # the Service's matrixpool.dev/component label


class Outcome(StrEnum):
    CREATED = "Created"  # this call created it
    EXISTS = "Exists"  # the job's own Service was there
    FOREIGN = "Foreign"  # a Service of that name is there and is not the job's


def body(namespace: str, name: str, uid: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"matrixpool.dev/component": COMPONENT, labels.JOB: name},
            "ownerReferences": [pods.owner_reference(owner)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {labels.JOB_UID: uid},
        },
    }


async def ensure(namespace: str, name: str, uid: str, owner: Mapping[str, Any]) -> Outcome:
    """Create the job's Service unless it exists. One of that name that another object owns
    (or nobody) is left alone: :attr:`Outcome.FOREIGN`, the caller says so."""
    api = k8s_client.default_api()

    @pods.retry
    def call() -> Outcome:
        try:
            api.core.create_namespaced_service(namespace, body(namespace, name, uid, owner))
        except Exception as error:
            if not k8s_client.is_status(error, 409):
                raise
            there = api.core.read_namespaced_service(name, namespace)
            owners = there.metadata.owner_references or []
            return Outcome.EXISTS if any(o.uid == uid for o in owners) else Outcome.FOREIGN
        return Outcome.CREATED

    return await asyncio.to_thread(call)
