"""Checkpoint daemons announce themselves with a ``coordination.k8s.io`` Lease per node, the
way kubelets announce their nodes in ``kube-node-lease``.

Each node's daemon has a Lease ``matrixpool-daemon-<node>`` in the operator's namespace, labelled
``matrixpool.dev/ckpt-daemon: "true"``, with the node in ``spec.holderIdentity``, its endpoint
(``host:port``) in the annotation ``matrixpool.dev/ckpt-endpoint``, and ``spec.renewTime``
renewed every quarter of ``spec.leaseDurationSeconds`` while the daemon answers its health
check. In the chart the announcer runs beside the daemon (``matrixpool announce``, a container
of the checkpoint DaemonSet with a token for exactly this: get, create and patch Leases in that
namespace); ``matrixpool sim`` announces its daemons with the same :func:`announce`.

The operator indexes these Leases (:func:`parse`): they are where it learns each node's daemon
endpoint, and a Lease not renewed for three quarters of its duration (measured on the
operator's own clock, ``controllers.recovery.heartbeat``) counts as a silent daemon. Nobody
else writes them: a renewal only moves ``renewTime``; the endpoint is written when the Lease is
created and on an announcer's first renewal (a restarted daemon may serve elsewhere). A Lease
whose node is gone is ignored (no owner reference: that would need read access to Nodes).
A Lease counts only under its node's name (:func:`lease_name`), and its endpoint only at the
node's InternalIP (:func:`on_node`): one node's announcer cannot point another node's daemon,
or its own, at a host that would receive the operator's token.

A daemon stopped on purpose (its pod deleted: a DaemonSet rollout, a ``helm upgrade``) says so:
its announcer, sent SIGTERM with it, writes the annotation ``matrixpool.dev/ckpt-stopping``
(:func:`mark_stopping`), and the next daemon's first renewal removes it. The operator counts
such a daemon as restarting, not lost, for :data:`RESTART_GRACE_SECONDS` (:func:`restarting`):
tier 1 lives in the node's shared memory, not in the daemon, and the ranks wait for the new
daemon to save (``matrixpool_recovery.client``). A daemon that crashed or lost its node
writes nothing, and counts as lost as before.

Errors: the API's (``kubernetes.client.ApiException``), except a create that lost a race,
which becomes a renewal.
"""

from __future__ import annotations

import datetime
import hashlib
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from matrixpool import clock
from matrixpool.api import labels
from matrixpool.k8s import client as k8s_client

PREFIX = "matrixpool-daemon-"
LABEL = labels.CKPT_DAEMON  # "true" on every daemon Lease
DURATION_SECONDS = 40  # as a kubelet's node Lease; renewed every quarter of it
# How long a daemon stopped on purpose counts as restarting rather than lost: a new daemon pod
# is scheduled, started and answering within it (~25 s on a loaded kind node)
RESTART_GRACE_SECONDS = 120.0
MAX_NAME = 253


def lease_name(node: str) -> str:
    """The Lease of ``node``'s daemon (a DNS subdomain; long node names are shortened with a
    hash so that two nodes never share one)."""
    name = PREFIX + node
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return f"{name[: MAX_NAME - 11]}-{digest}"


def _micro(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def body(node: str, endpoint: str, duration: int, now: datetime.datetime) -> dict[str, Any]:
    """The whole Lease of ``node``'s daemon serving at ``endpoint``."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": lease_name(node),
            "labels": {LABEL: "true"},
            "annotations": {labels.CKPT_ENDPOINT: endpoint},
        },
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": duration,
            "acquireTime": _micro(now),
            "renewTime": _micro(now),
        },
    }


def announce(
    api: k8s_client.Api,
    namespace: str,
    node: str,
    endpoint: str,
    *,
    duration: int = DURATION_SECONDS,
    now: datetime.datetime | None = None,
    first: bool = False,
) -> None:
    """Create or renew the Lease of ``node``'s daemon. ``first``: the first renewal since the
    daemon (re)started, which also writes the endpoint and ``acquireTime`` (later ones leave
    them as they are)."""
    now = now or clock.SYSTEM.now()
    name = lease_name(node)
    patch: dict[str, Any] = {"spec": {"renewTime": _micro(now), "holderIdentity": node}}
    if first:  # a daemon (re)started: where it serves, and since when (the operator tells a
        # new daemon its peers again when acquireTime moves); no longer stopping
        patch["metadata"] = {
            "annotations": {labels.CKPT_ENDPOINT: endpoint, labels.CKPT_STOPPING: None}
        }
        patch["spec"] |= {"leaseDurationSeconds": duration, "acquireTime": _micro(now)}
    try:
        api.coordination.patch_namespaced_lease(name, namespace, patch)
        return
    except Exception as error:
        if not k8s_client.is_status(error, 404):
            raise
    try:
        api.coordination.create_namespaced_lease(namespace, body(node, endpoint, duration, now))
    except Exception as error:
        if not k8s_client.is_status(error, 409):
            raise
        api.coordination.patch_namespaced_lease(name, namespace, patch)


@dataclass(frozen=True)
class Announced:
    """A daemon as its Lease announces it."""

    node: str
    endpoint: str  # host:port
    renewed: float  # renewTime, epoch seconds
    duration: float  # leaseDurationSeconds
    started: float  # acquireTime, epoch seconds: when the daemon (re)started serving
    stopping: float | None = None  # epoch seconds its daemon was stopped on purpose, if it was


def mark_stopping(
    api: k8s_client.Api, namespace: str, node: str, now: datetime.datetime | None = None
) -> None:
    """Say on ``node``'s Lease that its daemon is being stopped on purpose (its pod deleted)."""
    now = now or clock.SYSTEM.now()
    patch = {
        "metadata": {"annotations": {labels.CKPT_STOPPING: _micro(now)}},
        "spec": {"holderIdentity": node},
    }
    api.coordination.patch_namespaced_lease(lease_name(node), namespace, patch)


def restarting(announced: Mapping[str, Announced], now: float) -> frozenset[str]:
    """Nodes whose daemon was stopped on purpose less than RESTART_GRACE_SECONDS before
    ``now`` (epoch seconds) and has not announced itself since: a restart, not a loss."""
    return frozenset(
        node
        for node, a in announced.items()
        if a.stopping is not None and 0 <= now - a.stopping < RESTART_GRACE_SECONDS
    )


def parse(name: str, annotations: Mapping[str, str], spec: Mapping[str, Any]) -> Announced | None:
    """The daemon the Lease ``name`` announces, or None when it names no node, no endpoint or
    no renewal, or a node whose Lease it is not (one node's announcer writing for another)."""
    node = str(spec.get("holderIdentity") or "")
    endpoint = str(annotations.get(labels.CKPT_ENDPOINT) or "")
    renewed = spec.get("renewTime")
    if not (node and endpoint and renewed) or name != lease_name(node):
        return None
    stopping = annotations.get(labels.CKPT_STOPPING)
    return Announced(
        node,
        endpoint,
        _epoch(renewed),
        float(spec.get("leaseDurationSeconds") or DURATION_SECONDS),
        _epoch(spec.get("acquireTime") or renewed),
        _epoch(stopping) if stopping else None,
    )


def on_node(endpoint: str, address: str) -> bool:
    """Whether ``endpoint`` (host:port) is served at the node's InternalIP ``address``: the
    only endpoint the operator believes a Lease for (and sends its token to). A daemon runs in
    the node's network; a Lease that points elsewhere was not written by it."""
    host = endpoint.rpartition(":")[0].strip("[]")
    return bool(address) and host == address.strip("[]")


def _epoch(value: Any) -> float:
    return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def healthy(endpoint: str, timeout: float = 2.0) -> bool:
    """Whether the daemon at ``endpoint`` answers ``/v1/healthz``."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/v1/healthz", timeout=timeout):
            return True
    except OSError:
        return False


def run(
    api: k8s_client.Api,
    namespace: str,
    node: str,
    endpoint: str,
    *,
    duration: int = DURATION_SECONDS,
    stopped: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
) -> None:
    """Renew the Lease every quarter of ``duration`` while the daemon answers (``matrixpool
    announce``). A daemon that stops answering lets its Lease go stale; an API error is
    logged and retried at the next renewal. Once ``stopped()`` (SIGTERM: the pod is being
    deleted, the daemon with it), mark the Lease stopping (:func:`mark_stopping`)."""
    first = True
    try:
        _renew(api, namespace, node, endpoint, duration, stopped, log, first)
    finally:
        if stopped():
            try:
                mark_stopping(api, namespace, node)
                log(f"announce: {lease_name(node)} marked stopping")
            except Exception as error:  # the Lease goes stale instead: counted as lost
                log(f"announce: could not mark {lease_name(node)} stopping: {error}")


def _renew(
    api: k8s_client.Api,
    namespace: str,
    node: str,
    endpoint: str,
    duration: int,
    stopped: Callable[[], bool],
    log: Callable[[str], None],
    first: bool,
) -> None:
    while not stopped():
        if healthy(endpoint):
            try:
                announce(api, namespace, node, endpoint, duration=duration, first=first)
                first = False
            except Exception as error:  # the API restarting: the next renewal tries again
                log(f"announce: could not renew {lease_name(node)}: {error}")
        else:
            log(f"announce: the daemon at {endpoint} does not answer; not renewing")
            first = True  # when it answers again it is a new daemon (empty, no peers)
        until = time.monotonic() + duration / 4
        while not stopped() and time.monotonic() < until:  # SIGTERM ends the wait
            time.sleep(min(0.2, max(0.0, until - time.monotonic())))
