"""The operator's kopf settings: no essence is built while no change handler exists."""

from __future__ import annotations

from typing import Any

import kopf

from matrixpool import runner


def test_the_operators_handlers_need_no_essence() -> None:
    """Every handler matrixpool registers is an index, an event or a daemon handler, so kopf
    never diffs an essence and need not deep-copy each event's body to build one."""
    from matrixpool.controllers import credentials, loop  # noqa: F401 -- registers every handler

    storage = runner.diffbase(kopf.get_default_registry())
    assert isinstance(storage, runner.NoEssence)
    body = kopf.Body({"metadata": {"name": "p", "labels": {"a": "b"}}, "spec": {"x": [1]}})
    assert storage.build(body=body) == {}
    assert storage.fetch(body=body) is None


def test_a_change_handler_brings_kopfs_own_storage_back() -> None:
    registry = kopf.OperatorRegistry()

    @kopf.on.update("", "v1", "pods", registry=registry)
    def changed(**_: Any) -> None:
        return None

    storage = runner.diffbase(registry)
    assert isinstance(storage, kopf.AnnotationsDiffBaseStorage)
    body = kopf.Body({"metadata": {"name": "p"}, "spec": {"x": [1]}})
    assert storage.build(body=body) == {"spec": {"x": [1]}}
