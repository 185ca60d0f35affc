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

The KV-cache pool (``kvpool``, a daemon started with ``--kv-pool-bytes``) has families of its
own, prefixed ``matrixpool_kvpool_``: ``used_bytes`` and ``quota_bytes`` per service and
``capacity_bytes`` (gauges read at scrape time), ``lookups`` by ``result`` (``hit``, ``miss``),
``bytes`` by ``operation`` (``put``: stored, ``get``: served), ``evictions`` (by the service
that held the block) and ``refusals`` by ``reason`` (``TooLarge``, ``Full``). Their ``service``
label is a keyed digest of the InferenceService's UID (``credentials.metrics_label``: 16 hex
characters, the same on every daemon; neither its name nor its UID, since ``/metrics`` needs no
token); a service's series go when the operator deletes it from the pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from matrixpool_recovery import kvpool

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


KV_LOOKUPS = Counter(
    "matrixpool_kvpool_lookups", "KV block lookups, by service and result.", ("service", "result")
)
KV_BYTES = Counter(
    "matrixpool_kvpool_bytes",
    "KV block bytes stored and served, by service.",
    ("service", "operation"),
)
KV_EVICTIONS = Counter(
    "matrixpool_kvpool_evictions", "KV blocks evicted, by the service that held them.", ("service",)
)
KV_REFUSALS = Counter(
    "matrixpool_kvpool_refusals",
    "KV block puts refused, by service and reason.",
    ("service", "reason"),
)
HIT, MISS = "hit", "miss"  # results of a KV lookup
PUT, GET = "put", "get"  # operations on KV bytes
KvUsage = Callable[[], Mapping[str, tuple[int, int]]]  # service -> (used bytes, quota bytes)


class _KvPoolUsage(Collector):
    """The pool's bytes per service, read at scrape time, so puts pay nothing for them."""

    def __init__(self) -> None:
        self.read: KvUsage | None = None  # None: this process has no pool
        self.capacity = 0  # bytes of the pool

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        if self.read is None:
            return iter(())
        capacity, used, quota = self._families()
        capacity.add_metric([], self.capacity)
        for service, (used_bytes, quota_bytes) in sorted(self.read().items()):
            used.add_metric([service], used_bytes)
            quota.add_metric([service], quota_bytes)
        return iter((capacity, used, quota))

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily("matrixpool_kvpool_capacity_bytes", "Bytes the KV pool may hold."),
            GaugeMetricFamily(
                "matrixpool_kvpool_used_bytes",
                "Bytes of KV blocks held, by service.",
                labels=["service"],
            ),
            GaugeMetricFamily(
                "matrixpool_kvpool_quota_bytes", "KV pool quota, by service.", labels=["service"]
            ),
        )


_KV_USAGE = _KvPoolUsage()
REGISTRY.register(_KV_USAGE)


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


def watch_kv_pool(usage: KvUsage, capacity: int) -> None:
    """The KV pool's usage per service is read at scrape time through `usage`."""
    _KV_USAGE.read = usage
    _KV_USAGE.capacity = capacity


def kv_looked_up(service: str, size: int | None) -> None:
    """A lookup of one of `service`'s blocks: a hit of `size` bytes served, or a miss (None)."""
    KV_LOOKUPS.labels(service, MISS if size is None else HIT).inc()
    if size is not None:
        KV_BYTES.labels(service, GET).inc(size)


def kv_stored(service: str, size: int) -> None:
    KV_BYTES.labels(service, PUT).inc(size)


def kv_evicted(owners: Sequence[str]) -> None:
    """Blocks evicted, one owner each."""
    for owner in owners:
        KV_EVICTIONS.labels(owner).inc()


def kv_refused(service: str, reason: str) -> None:
    KV_REFUSALS.labels(service, reason).inc()


def kv_forget(service: str) -> None:
    """Drop a deleted service's series."""
    for counter, values in (
        (KV_LOOKUPS, [(service, HIT), (service, MISS)]),
        (KV_BYTES, [(service, PUT), (service, GET)]),
        (KV_EVICTIONS, [(service,)]),
        (KV_REFUSALS, [(service, str(reason)) for reason in kvpool.Refusal]),
    ):
        for labels in values:
            with contextlib.suppress(KeyError):
                counter.remove(*labels)
