"""The workload indexes (state.indexes, state.workloads): a spec parsed once per generation,
the status always the one of the event."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from matrixpool.state import indexes, workloads


def body(generation: int, replicas: int, phase: str) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "matrixpool.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "a", "namespace": "ns", "uid": "u1", "generation": generation},
            "spec": {"replicas": replicas, "cardsPerReplica": 8, "template": {}},
            "status": {"phase": phase},
        }
    )


def indexed(event: kopf.Body, memo: Any) -> workloads.Workload:
    return asyncio.run(indexes.training_jobs(body=event, memo=memo))["ns/a"]


def test_a_status_patch_reuses_the_parsed_spec_a_new_generation_parses_again() -> None:
    memo = kopf.Memo()
    first = indexed(body(1, 2, "Pending"), memo)
    assert first.model is not None
    assert first.status == {"phase": "Pending"}
    patched = indexed(body(1, 2, "Running"), memo)
    assert patched.model is first.model, "same generation: not validated again"
    assert patched.status == {"phase": "Running"}
    scaled = indexed(body(2, 4, "Running"), memo)
    assert scaled.model is not first.model
    assert scaled.model is not None
    assert scaled.model.spec.replicas == 4


def test_a_spec_that_does_not_parse_keeps_its_error_until_the_next_generation() -> None:
    memo = kopf.Memo()
    broken = indexed(body(1, -1, "Pending"), memo)
    assert broken.model is None
    assert broken.error
    assert indexed(body(1, -1, "Pending"), memo).error == broken.error
    assert indexed(body(2, 1, "Pending"), memo).model is not None
