"""The kubelets' Leases (namespace ``kube-node-lease``): node → (renewTime as epoch seconds,
leaseDurationSeconds), kept by a list-and-watch of its own on a thread rather than a kopf index.

Every kubelet renews its Lease a quarter of the way through its duration (every 10 s): 3,072
nodes (64 supernodes) send about 300 events a second. Through kopf each took its per-object
worker, queue, index call and handler matching on the event loop that also runs the scheduling
pass and the Node watch, so a fault's Node event and the cycle waited behind heartbeats, and an
operator that fell behind saw Leases as overdue that were not (a scale run under a profiler
recovered 93 jobs from nodes that were fine). Here an event is one JSON line parsed on a thread
and one dict entry written under a lock; the main loop copies the dict once a pass
(:meth:`NodeLeases.snapshot`) and :class:`matrixpool.controllers.recovery.heartbeat.LeaseClock`
judges it as before.

The thread lists first (the operator's startup waits for that listing, as kopf fills its
indexes before any daemon starts), then watches from the listing's resourceVersion, watches
again when a watch times out, and lists again after 410 Gone or any error (after
:data:`RETRY_SECONDS`). It is a daemon thread: the process exits without waiting for it.
"""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import structlog

from matrixpool.k8s import client as k8s_client

log = structlog.get_logger(__name__)

NAMESPACE = "kube-node-lease"
WATCH_SECONDS = 300  # one watch request's timeoutSeconds; the next one goes on from there
RETRY_SECONDS = 2.0  # after an error, before listing again
DEFAULT_DURATION = 40.0  # leaseDurationSeconds when a Lease does not say


def parse(name: str, spec: Mapping[str, Any]) -> tuple[float, float] | None:
    """(renewTime as epoch seconds, leaseDurationSeconds) of one Lease; None without a
    renewTime (never renewed yet)."""
    renewed = spec.get("renewTime")
    if not renewed:
        return None
    when = datetime.datetime.fromisoformat(str(renewed).replace("Z", "+00:00")).timestamp()
    return when, float(spec.get("leaseDurationSeconds") or DEFAULT_DURATION)


class NodeLeases:
    """The Leases of ``kube-node-lease`` by node, as the last listing and the watch since
    say."""

    def __init__(self, api: k8s_client.Api | None = None, namespace: str = NAMESPACE) -> None:
        self.api = api
        self.namespace = namespace
        self.listed = threading.Event()  # set once the first listing is in
        self._leases: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NodeLeases:
        self._thread = threading.Thread(target=self._run, name="node-leases", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more lists or watches (the one open ends at its timeout or next event)."""
        self._stop.set()

    def snapshot(self) -> dict[str, tuple[float, float]]:
        with self._lock:
            return dict(self._leases)

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version: str | None = self._list()
                while not self._stop.is_set() and version is not None:
                    version = self._watch(version)
            except Exception as error:  # the API server restarted, a timeout, a 403: list again
                log.warning("node Lease watch failed; listing again", error=str(error))
                self._stop.wait(RETRY_SECONDS)

    def _coordination(self) -> Any:
        if self.api is None:
            self.api = k8s_client.default_api()
        return self.api.coordination

    def _list(self) -> str:
        answer = self._coordination().list_namespaced_lease(
            self.namespace, _preload_content=False, _request_timeout=60
        )
        body = json.loads(answer.data)
        leases = {}
        for item in body.get("items") or []:
            name = (item.get("metadata") or {}).get("name", "")
            found = parse(name, item.get("spec") or {})
            if found is not None:
                leases[name] = found
        with self._lock:
            self._leases = leases
        self.listed.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str | None:
        """One watch request from ``version``; the version to go on from, or None when the
        server says it is gone (410: list again)."""
        answer = self._coordination().list_namespaced_lease(
            self.namespace,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
            _request_timeout=WATCH_SECONDS + 30,
        )
        try:
            for event in _events(answer):
                if self._stop.is_set():
                    return None
                kind, item = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if item.get("code") == 410:
                        return None
                    raise RuntimeError(f"watch error: {item.get('message') or item}")
                meta = item.get("metadata") or {}
                version = str(meta.get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                self._apply(kind, meta.get("name", ""), item.get("spec") or {})
        finally:
            answer.release_conn()
        return version

    def _apply(self, kind: str | None, name: str, spec: Mapping[str, Any]) -> None:
        found = None if kind == "DELETED" else parse(name, spec)
        with self._lock:
            if found is None:
                self._leases.pop(name, None)
            else:
                self._leases[name] = found


def _events(answer: Any) -> Iterator[dict[str, Any]]:
    """The watch's events, one JSON object a line, as the chunks of ``answer`` bring them."""
    buffer = b""
    for chunk in answer.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
