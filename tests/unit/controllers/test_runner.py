"""The operator's kopf settings: no essence is built while no change handler exists."""

from __future__ import annotations

import subprocess
import sys
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


def test_a_new_job_wakes_the_loop_before_its_service_is_written() -> None:
    """kopf calls one resource's event handlers one after the other, in the order they were
    registered. A TrainingJob's Secret comes first (its pods mount it), then the wake, then the
    Service: a Service written before the wake held every new job's placement back by one API
    round trip. Registration happens at a module's first import, so a fresh interpreter."""
    script = (
        "import kopf\n"
        "from matrixpool import runner\n"
        "runner.register()\n"
        "for h in kopf.get_default_registry()._watching.get_all_handlers():\n"
        "    if h.selector is not None and h.selector.any_name == 'trainingjobs':\n"
        "        print(h.fn.__module__.rsplit('.', 1)[-1], h.fn.__name__)\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    order = [line for line in found if line]
    assert order.index("credentials job_credential") < order.index("wake workload_changed")
    assert order.index("wake workload_changed") < order.index("jobservice job_service")
