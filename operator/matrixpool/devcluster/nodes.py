"""Creates the simulated nodes of a :class:`~matrixpool.devcluster.topology.Shape` and waits
until kwok reports them Ready. Called by ``cluster up``; safe to repeat (existing nodes stay).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from matrixpool import clock
from matrixpool.devcluster import topology
from matrixpool.k8s import client as k8s_client

READY_TIMEOUT = 180.0


def ensure(kubeconfig: Path, shape: topology.Shape, progress: Callable[[str], None]) -> None:
    """Create the missing nodes of ``shape``, then wait until all of them are Ready."""
    api = k8s_client.from_kubeconfig(kubeconfig)
    wanted = topology.nodes(shape)
    existing = {n.metadata.name for n in api.core.list_node().items}
    missing = [n for n in wanted if n["metadata"]["name"] not in existing]

    def create(body: dict[str, Any]) -> None:
        try:
            api.core.create_node(body)
        except Exception as error:
            if not k8s_client.is_status(error, 409):
                raise

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(create, missing))
    progress(f"    {len(missing)} nodes created, {len(wanted) - len(missing)} already there")
    names = {n["metadata"]["name"] for n in wanted}
    deadline = clock.SYSTEM.monotonic() + READY_TIMEOUT
    while True:
        ready = {n.metadata.name for n in api.core.list_node().items if _is_ready(n)}
        if names <= ready:
            return
        if clock.SYSTEM.monotonic() > deadline:
            raise TimeoutError(
                f"{len(names - ready)} of {len(names)} nodes not Ready after "
                f"{READY_TIMEOUT:.0f} s (is kwok running? see its log)"
            )
        time.sleep(0.5)


def wait_ready(kubeconfig: Path, names: set[str], timeout: float, hint: str) -> None:
    """Wait until every node of ``names`` exists and is Ready."""
    api = k8s_client.from_kubeconfig(kubeconfig)
    deadline = clock.SYSTEM.monotonic() + timeout
    while True:
        ready = {n.metadata.name for n in api.core.list_node().items if _is_ready(n)}
        if names <= ready:
            return
        if clock.SYSTEM.monotonic() > deadline:
            waiting = ", ".join(sorted(names - ready))
            raise TimeoutError(f"nodes not Ready after {timeout:.0f} s: {waiting} ({hint})")
        time.sleep(0.5)


def _is_ready(node: Any) -> bool:
    for condition in (node.status.conditions or []) if node.status else []:
        if condition.type == "Ready":
            return bool(condition.status == "True")
    return False
