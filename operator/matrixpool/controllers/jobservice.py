"""Every TrainingJob gets its headless Service (:mod:`matrixpool.k8s.services`) when it appears
or the operator starts and finds it: rank r of job ``j`` is then
``j-r.j.<namespace>.svc.<domain>`` in cluster DNS, the name its pods' ``MASTER_ADDR`` gives for
rank 0. Called by kopf.

A watch handler with the job's kopf memo remembering that the Service is there, as
:mod:`matrixpool.controllers.credentials` does for the job's Secret (and for the same reason).
A Service of the job's name that is not the job's own is left alone: the job's Events say so
(reason ``ServiceNameTaken``) and its ranks cannot find rank 0 by name until it is gone; the job
tries again on its next event.
"""

from __future__ import annotations

from typing import Any

import kopf
import structlog

from matrixpool import api
from matrixpool.api import trainingjob
from matrixpool.k8s import executor, services

log = structlog.get_logger(__name__)

WRITTEN = "matrixpool.service"  # the per-object kopf memo's key: the Service is there
NAME_TAKEN = "ServiceNameTaken"  # the Event's reason when another object has the name


def _unwritten(type: str | None, memo: kopf.Memo, **_: Any) -> bool:
    return type != "DELETED" and not memo.get(WRITTEN)


@kopf.on.event(api.GROUP, api.VERSION, trainingjob.PLURAL, when=_unwritten)
async def job_service(
    uid: str, name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    await ensure(executor.Live(), uid, name, namespace, body, memo)


async def ensure(
    act: executor.Executor,
    uid: str,
    name: str,
    namespace: str | None,
    body: kopf.Body | dict[str, Any],
    memo: kopf.Memo | dict[str, Any],
) -> None:
    if not namespace:
        return
    owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "name": name, "uid": uid}
    try:
        outcome = await act.write_service(namespace, name, uid, owner)
    except Exception as error:  # its next event tries again
        log.warning("could not write a job's Service", job=f"{namespace}/{name}", error=str(error))
        return
    if outcome is services.Outcome.FOREIGN:
        ref = {**owner, "metadata": {"name": name, "namespace": namespace, "uid": uid}}
        act.event(
            ref,
            "Warning",
            NAME_TAKEN,
            f"Service {namespace}/{name} exists and is not this job's: its ranks cannot find "
            f"rank 0 as {name}-0.{name} until it is deleted",
        )
        return
    memo[WRITTEN] = True
    if outcome is services.Outcome.CREATED:
        log.info("wrote a job's Service", job=f"{namespace}/{name}", uid=uid)
