"""Every TrainingJob gets its checkpoint credential: when one appears (or the operator starts
and finds it), the operator writes the job's token into a Secret its pods mount
(:mod:`matrixpool.k8s.secrets`). Without the cluster secret (no checkpoint daemons installed)
there is nothing to write. Called by kopf.

A watch handler, not ``on.create``/``on.resume``: those make kopf keep a copy of every job's
spec in an annotation (one more write per job) and diff each event against it, a tenth of the
operator's time at 512 jobs, for a handler that only needs to run once per job. The job's
kopf memo remembers that its Secret is there; until then every event of the job tries again
(a job's status changes as its pods are placed and start), as kopf would retry.
"""

from __future__ import annotations

from typing import Any

import kopf
import structlog

from matrixpool import api, checkpoints
from matrixpool.api import trainingjob
from matrixpool.k8s import secrets

log = structlog.get_logger(__name__)

WRITTEN = "matrixpool.credential"  # the per-object kopf memo's key: the Secret is there


def _unwritten(type: str | None, memo: kopf.Memo, **_: Any) -> bool:
    return type != "DELETED" and not memo.get(WRITTEN)


@kopf.on.event(api.GROUP, api.VERSION, trainingjob.PLURAL, when=_unwritten)
async def job_credential(
    uid: str, name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    token = checkpoints.job_token_for(uid)
    if token is None or not namespace:
        memo[WRITTEN] = True  # no cluster secret: nothing to write for this job (as before)
        return
    owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "name": name, "uid": uid}
    try:
        created = await secrets.ensure(namespace, uid, token, owner)
    except Exception as error:  # the job's next event tries again
        log.warning(
            "could not write the job's checkpoint credential",
            job=f"{namespace}/{name}",
            uid=uid,
            error=str(error),
        )
        return
    memo[WRITTEN] = True
    if created:
        log.info("wrote the job's checkpoint credential", job=f"{namespace}/{name}", uid=uid)
