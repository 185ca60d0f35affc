"""controllers.credentials: a job's Secret is written once per job, and tried again on the job's
next event when writing failed."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from matrixpool.controllers import credentials

BODY = kopf.Body({"apiVersion": "matrixpool.dev/v1alpha1", "kind": "TrainingJob"})


def call(memo: kopf.Memo) -> None:
    asyncio.run(
        credentials.job_credential(uid="u1", name="a", namespace="ns", body=BODY, memo=memo)
    )


def test_written_once_and_tried_again_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, str]] = []
    failing = [True]

    async def ensure(namespace: str, uid: str, token: str, owner: Any, component: str) -> bool:
        assert component == credentials.secrets.JOB
        asked.append((namespace, uid))
        if failing[0]:
            raise RuntimeError("the API server is away")
        return True

    monkeypatch.setattr(credentials.daemonclient, "job_token_for", lambda uid: f"token-{uid}")
    monkeypatch.setattr(credentials.secrets, "ensure", ensure)
    memo = kopf.Memo()
    assert credentials._unwritten(type=None, memo=memo), "the first listing writes too"
    call(memo)
    assert asked == [("ns", "u1")]
    assert credentials._unwritten(type="MODIFIED", memo=memo), "failed: the next event again"
    failing[0] = False
    call(memo)
    assert len(asked) == 2
    assert not credentials._unwritten(type="MODIFIED", memo=memo)
    assert not credentials._unwritten(type="DELETED", memo=kopf.Memo())


def test_without_the_cluster_secret_there_is_nothing_to_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(credentials.daemonclient, "job_token_for", lambda uid: None)
    memo = kopf.Memo()
    call(memo)
    assert not credentials._unwritten(type="MODIFIED", memo=memo)


def test_a_service_with_a_kv_cache_gets_its_service_token_and_one_without_gets_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    written: list[tuple[str, str, str]] = []

    async def ensure(namespace: str, uid: str, token: str, owner: Any, component: str) -> bool:
        written.append((uid, token, component))
        return True

    monkeypatch.setattr(credentials.daemonclient, "service_token_for", lambda uid: f"svc-{uid}")
    monkeypatch.setattr(credentials.secrets, "ensure", ensure)
    memo = kopf.Memo()
    assert not credentials._unwritten_kv(type=None, memo=memo, spec=kopf.Spec({}))
    assert credentials._unwritten_kv(
        type=None, memo=memo, spec=kopf.Spec({"spec": {"kvCache": {"bytes": "1Gi"}}})
    )
    body = kopf.Body({"apiVersion": "matrixpool.dev/v1alpha1", "kind": "InferenceService"})
    asyncio.run(
        credentials.service_credential(uid="s1", name="chat", namespace="ns", body=body, memo=memo)
    )
    assert written == [("s1", "svc-s1", credentials.secrets.SERVICE)]
    assert not credentials._unwritten(type="MODIFIED", memo=memo)
