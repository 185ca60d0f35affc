"""The checkpoint daemon's Prometheus metrics: bytes and seconds per tier and operation.

Updated by :mod:`matrixpool_recovery.daemon` once per shard (a counter add and a histogram
observation; never per chunk) and served by the daemon's own HTTP server on ``GET /metrics``,
the one path besides ``/v1/healthz`` that needs no token: labels carry tiers and operations,
never job names. Read by Prometheus and by the chart's Grafana dashboard.

Names follow Prometheus conventions: a ``matrixpool_ckpt_`` prefix, base units, ``_total`` on
counters (prometheus-client appends it), ``_bytes`` and ``_seconds`` units. Label values:

* ``tier``: ``memory`` (tier 1), ``peers`` (tier-1 copies pushed to other daemons), ``local``
  (tier 2), ``persistent`` (tier 3).
* ``operation``: ``save`` (a shard stored on this node's tier: written by a trainer here or
  uploaded, peers' copies included), ``replicate`` (pushed to peers; bytes count each copy),
  ``restore`` (a trainer on this node handed a tier-1 buffer to read in place), ``serve``
  (shard bytes sent over HTTP to a remote trainer or a peer).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

SAVE = "save"  # a shard stored on one of this node's tiers
REPLICATE = "replicate"  # tier-1 copies pushed to peer daemons
RESTORE = "restore"  # a trainer on this node reads a tier-1 buffer in place
SERVE = "serve"  # shard bytes sent over HTTP
OPERATIONS = (SAVE, REPLICATE, RESTORE, SERVE)
# Seconds from a millisecond (a tier-1 commit) to minutes (a large tier-3 write).
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LABELS = ("tier", "operation")

BYTES = Counter("matrixpool_ckpt_bytes", "Checkpoint bytes moved, by tier and operation.", LABELS)
SECONDS = Histogram(
    "matrixpool_ckpt_duration_seconds",
    "Seconds one shard took, by tier and operation.",
    LABELS,
    buckets=BUCKETS,
)
FAILURES = Counter(
    "matrixpool_ckpt_failures", "Shard operations that failed, by tier and operation.", LABELS
)
MEMORY_USED = Gauge("matrixpool_ckpt_memory_used_bytes", "Bytes of tier-1 buffers in use.")
MEMORY_LIMIT = Gauge("matrixpool_ckpt_memory_limit_bytes", "Bytes tier-1 buffers may take.")


def observe(tier: str, operation: str, size: int, seconds: float) -> None:
    """One shard of ``size`` bytes went through ``tier`` in ``seconds``."""
    BYTES.labels(tier, operation).inc(size)
    SECONDS.labels(tier, operation).observe(seconds)


def failed(tier: str, operation: str) -> None:
    FAILURES.labels(tier, operation).inc()


def watch_memory(used: Callable[[], float], limit: int) -> None:
    """Tier-1 usage is read at scrape time, so saves pay nothing for it."""
    MEMORY_USED.set_function(used)
    MEMORY_LIMIT.set(limit)


def exposition() -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` answer."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
