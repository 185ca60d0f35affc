"""Every TrainingJob gets its checkpoint credential, and every InferenceService with
``spec.kvCache`` its KV-cache credential: when one appears (or the operator starts and finds
it), the operator writes its token into a Secret its pods mount
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

from matrixpool import api
from matrixpool.api import inferenceservice, trainingjob
from matrixpool.k8s import daemonclient, executor, secrets

log = structlog.get_logger(__name__)

WRITTEN = "matrixpool.credential"  # the per-object kopf memo's key: the Secret is there


def _unwritten(type: str | None, memo: kopf.Memo, **_: Any) -> bool:
    return type != "DELETED" and not memo.get(WRITTEN)


@kopf.on.event(api.GROUP, api.VERSION, trainingjob.PLURAL, when=_unwritten)
async def job_credential(
    uid: str, name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    await _write(daemonclient.job_token_for(uid), secrets.JOB, uid, name, namespace, body, memo)


def _unwritten_kv(type: str | None, memo: kopf.Memo, spec: kopf.Spec, **_: Any) -> bool:
    return _unwritten(type, memo) and bool(spec.get("kvCache"))


@kopf.on.event(api.GROUP, api.VERSION, inferenceservice.PLURAL, when=_unwritten_kv)
async def service_credential(
    uid: str, name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    token = daemonclient.service_token_for(uid)
    await _write(token, secrets.SERVICE, uid, name, namespace, body, memo)


async def _write(
    token: str | None,
    component: str,
    uid: str,
    name: str,
    namespace: str | None,
    body: kopf.Body,
    memo: kopf.Memo,
) -> None:
    if token is None or not namespace:
        memo[WRITTEN] = True  # no cluster secret: nothing to write (as before)
        return
    owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "name": name, "uid": uid}
    what = f"{body['kind']} {namespace}/{name}"
    try:
        created = await executor.Live().write_credential(namespace, uid, token, owner, component)
    except Exception as error:  # its next event tries again
        log.warning("could not write a credential", of=what, uid=uid, error=str(error))
        return
    memo[WRITTEN] = True
    if created:
        log.info("wrote a credential", of=what, uid=uid, secret=component)
