"""Runs the operator: configures logging and kopf, registers the handlers, starts the loop.

Called by ``matrixpool run``. Standalone by default; ``peering`` joins a kopf peering group so
that several replicas can run with one active.
"""

from __future__ import annotations

import importlib
import logging
import os
import random
from collections.abc import Sequence
from typing import Any

import kopf

from matrixpool import logs, metrics


def run(
    *,
    peering: str | None = None,
    namespaces: Sequence[str] = (),
    liveness: str | None = None,
    metrics_port: int = 0,
) -> None:
    logs.configure()
    register()
    metrics.serve(metrics_port)

    kopf.on.startup()(_configure)
    kopf.run(
        standalone=peering is None,
        peering_name=peering,
        priority=_peering_priority() if peering else None,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness,
    )


# The modules whose import registers the operator's kopf handlers, in the order kopf is to call
# one resource's event handlers (it calls them one after another, in the order they were
# registered): a new TrainingJob's Secret first (its pods mount it), then the loop's wake (the
# job gets placed), then its headless Service (rank 0's name, which no pod resolves before it
# runs). Awaited before the wake, the Service's write held every new job's placement back by
# one API round trip.
HANDLER_MODULES = ("credentials", "wake", "jobservice", "loop")


def register() -> None:
    """Register every handler, in :data:`HANDLER_MODULES`' order."""
    for module in HANDLER_MODULES:
        importlib.import_module(f"matrixpool.controllers.{module}")


def _peering_priority() -> int:
    """kopf pauses every peer of equal priority, so replicas must differ: take
    MATRIXPOOL_PEERING_PRIORITY if set, else a random one; the highest runs, the rest wait."""
    value = os.environ.get("MATRIXPOOL_PEERING_PRIORITY")
    return int(value) if value else random.randint(1, 1 << 30)


def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Explicit kopf.event() calls carry our reasons; plain info logs are not posted as Events.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.persistence.finalizer = "matrixpool.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="matrixpool.dev")
    settings.persistence.diffbase_storage = diffbase(kopf.get_default_registry())


class NoEssence(kopf.DiffBaseStorage):
    """kopf builds every watched object's "essence" (a deep copy of its whole body, status
    included) at every event, to diff it for change handlers (``kopf.on.create``/``update``/
    ``resume``/``delete``/``field``). matrixpool registers none: its controllers read indexes
    and watch events only, so the essence was never compared. Building it was a seventh of the
    operator's CPU while it bound pods (py-spy, 4 supernodes, bursts of 192 pods: every pod,
    Node and Lease event). An empty essence, never stored."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def diffbase(registry: kopf.OperatorRegistry) -> kopf.DiffBaseStorage:
    """:class:`NoEssence` while no change handler is registered (checked, so that adding one
    brings kopf's own storage back), else kopf's annotation storage."""
    changing = getattr(registry, "_changing", None)
    if changing is not None and not changing.get_all_handlers():
        return NoEssence()
    return kopf.AnnotationsDiffBaseStorage(
        prefix="matrixpool.dev", key="last-handled-configuration"
    )
