"""Every TrainingJob gets its checkpoint credential: when one appears (or the operator starts
and finds it), the operator writes the job's token into a Secret its pods mount
(:mod:`matrixpool.k8s.secrets`). Without the cluster secret (no checkpoint daemons installed)
there is nothing to write. Called by kopf.
"""

from __future__ import annotations

from typing import Any

import kopf
import structlog

from matrixpool import api, checkpoints
from matrixpool.api import trainingjob
from matrixpool.k8s import secrets

log = structlog.get_logger(__name__)


@kopf.on.resume(api.GROUP, api.VERSION, trainingjob.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, trainingjob.PLURAL)
async def job_credential(
    uid: str, name: str, namespace: str | None, body: kopf.Body, **_: Any
) -> None:
    token = checkpoints.job_token_for(uid)
    if token is None or not namespace:
        return
    owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "name": name, "uid": uid}
    if await secrets.ensure(namespace, uid, token, owner):
        log.info("wrote the job's checkpoint credential", job=f"{namespace}/{name}", uid=uid)
