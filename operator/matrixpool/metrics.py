"""The operator's Prometheus metrics and their HTTP endpoint (``/metrics``).

Updated by the main loop (:mod:`matrixpool.controllers.loop`) and the scheduling cycle; served by
:func:`serve`, which ``matrixpool run`` calls. Names follow Prometheus conventions: a
``matrixpool_`` prefix, base units (seconds), ``_total`` on counters.
"""

from __future__ import annotations

import threading
import time

import structlog
from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = structlog.get_logger(__name__)

SUPERNODE_CARDS = Gauge(
    "matrixpool_supernode_cards", "Cards of a supernode by state.", ["supernode", "state"]
)
SUPERNODE_NODES = Gauge(
    "matrixpool_supernode_nodes",
    "Member nodes of a supernode, all and Ready.",
    ["supernode", "state"],
)
PENDING_GANGS = Gauge("matrixpool_pending_gangs", "Gangs waiting for cards after the last cycle.")
BOUND_PODS = Counter("matrixpool_bound_pods_total", "Pods bound to cards by matrixpool.")
PREEMPTIONS = Counter(
    "matrixpool_preemptions_total",
    "Preemptions carried out, by what they did to the victims.",
    ["action"],
)
BIND_SECONDS = Histogram(
    "matrixpool_gang_bind_seconds",
    "Seconds to reserve and bind the gangs placed in one cycle.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
CYCLE_SECONDS = Histogram(
    "matrixpool_cycle_seconds",
    "Seconds one scheduling cycle took to decide (its binding cycle is timed apart).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)

REGROUPS = Counter(
    "matrixpool_regroups_total",
    "Elastic gangs regrouped at a new size (every rank replaced), by reason.",
    ["reason"],
)
REGROUP_SECONDS = Histogram(
    "matrixpool_regroup_duration_seconds",
    "Seconds from a regroup's start to every rank of the new size bound.",
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
)


RECOVERIES = Counter(
    "matrixpool_recoveries_total",
    "Recoveries from faults carried out, by level (InPlace, SpareSwap, Reschedule).",
    ["level"],
)
RECOVERY_SECONDS = Histogram(
    "matrixpool_recovery_duration_seconds",
    "Seconds from a fault's detection to every rank running again, by level.",
    ["level"],
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
)
RECOVERY_FAILURES = Counter(
    "matrixpool_recovery_failures_total",
    "Faults no recovery could serve (the job failed), by reason.",
    ["reason"],
)
FAULTS = Counter(
    "matrixpool_faults_detected_total",
    "Faults detected under training ranks, by kind.",
    ["kind"],
)

TIMESHARE_TRANSITIONS = Counter(
    "matrixpool_timeshare_transitions_total",
    "Time-sharing transitions carried out (new split in place), by supernode and window.",
    ["supernode", "window"],
)
TIMESHARE_TRANSITION_SECONDS = Histogram(
    "matrixpool_timeshare_transition_seconds",
    "Seconds from a window boundary to the new split in place, by phase (total, checkpoint, "
    "eviction, placement).",
    ["supernode", "phase"],
    buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
)
TIMESHARE_CHECKPOINTS = Counter(
    "matrixpool_timeshare_checkpoint_requests_total",
    "Checkpoint requests before time-sharing evictions, by outcome (asked, answered, expired).",
    ["outcome"],
)


BIND_RETRY_SECONDS = 2.0  # between tries at a port in use
BIND_GIVE_UP_SECONDS = 600.0  # then /metrics stays off, said once more


def serve(
    port: int, retry: float = BIND_RETRY_SECONDS, give_up: float = BIND_GIVE_UP_SECONDS
) -> None:
    """Serve /metrics on ``port`` (0: not at all). A port in use (an operator that is being
    replaced still holds it, until its grace period ends) is logged, not fatal, and tried again
    in the background every ``retry`` seconds for ``give_up`` seconds."""
    if port <= 0:
        return
    try:
        start_http_server(port)
    except OSError as error:
        log.warning("metrics endpoint not started; trying again", port=port, error=str(error))
        threading.Thread(
            target=_retry, args=(port, retry, give_up), name="metrics-bind", daemon=True
        ).start()
        return
    log.info("metrics endpoint started", port=port)


def _retry(port: int, retry: float, give_up: float) -> None:
    deadline = time.monotonic() + give_up
    while time.monotonic() < deadline:
        time.sleep(retry)
        try:
            start_http_server(port)
        except OSError:
            continue
        log.info("metrics endpoint started", port=port)
        return
    log.warning("metrics endpoint not started: the port stayed in use", port=port)


def record_supernode(name: str, status: dict[str, object]) -> None:
    """Mirror a SuperNode status (wire form) into the gauges."""
    for state, value in dict(status.get("cards") or {}).items():  # type: ignore[call-overload]
        SUPERNODE_CARDS.labels(name, state).set(float(value))
    nodes = dict(status.get("nodes") or {})  # type: ignore[call-overload]
    for state in ("total", "ready"):
        SUPERNODE_NODES.labels(name, state).set(float(nodes.get(state, 0)))


CHECKPOINTS_DELETED = Counter(
    "matrixpool_checkpoints_deleted_total",
    "Jobs whose checkpoints were deleted from a daemon, by why: the job was deleted, or an "
    "orphan (no TrainingJob has that UID) found by the periodic sweep.",
    ["why"],
)
PEER_ASSIGNMENTS = Counter(
    "matrixpool_peer_assignments_total",
    "Checkpoint daemons told their tier-1 peers (a changed list, or a daemon that started again).",
)
AUTOSCALER_REPLICAS = Gauge(
    "matrixpool_autoscaler_replicas",
    "The inference autoscaler's last recommendation: replicas by service and role (mode Auto:"
    " served; Advisory: advice only).",
    ["namespace", "service", "role", "mode"],
)
AUTOSCALER_CHANGES = Counter(
    "matrixpool_autoscaler_changes_total",
    "Recommendations that changed a service's replicas, by direction (up, down, mixed).",
    ["mode", "direction"],
)
KV_POOL_BYTES = Gauge(
    "matrixpool_kv_pool_bytes",
    "A SuperNode's KV-cache pool: its capacity (spec.memoryPool.perNode × member nodes) and"
    " the bytes reserved by admitted InferenceServices.",
    ["supernode", "state"],
)
KV_SERVICES = Gauge(
    "matrixpool_kv_services",
    "InferenceServices with spec.kvCache, admitted to their SuperNode's pool or waiting.",
    ["supernode", "state"],
)
