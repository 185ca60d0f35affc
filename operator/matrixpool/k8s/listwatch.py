"""A list-and-watch of one kind of object on a daemon thread of its own, off kopf's event loop:
for the watches whose events are too many, or too urgent, to wait behind the scheduling pass
(the kubelets' Leases, :mod:`matrixpool.k8s.nodeleases`; the Nodes' faults,
:mod:`matrixpool.k8s.nodefaults`).

The thread lists first (:attr:`ListWatch.listed` is set then; the operator's startup waits for
it, as kopf fills its indexes before any daemon starts), then watches from the listing's
resourceVersion, watches again when a watch times out, follows bookmarks, and lists again after
410 Gone or any error (after :data:`RETRY_SECONDS`). An event is one JSON line parsed on the
thread. It is a daemon thread: the process exits without waiting for it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import structlog

log = structlog.get_logger(__name__)

WATCH_SECONDS = 300  # one watch request's timeoutSeconds; the next one goes on from there
RETRY_SECONDS = 2.0  # after an error, before listing again


class ListWatch:
    """The thread; a subclass says which call lists (:meth:`_call`) and what a listing and an
    event change (:meth:`_listed`, :meth:`_event`)."""

    name = "list-watch"  # the thread's name, and the logs'

    def __init__(self) -> None:
        self.listed = threading.Event()  # set once the first listing is in
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ListWatch:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more lists or watches (the one open ends at its timeout or next event)."""
        self._stop.set()

    # ---- what a subclass says ------------------------------------------------------------------

    def _call(self, **kwargs: Any) -> Any:
        """The client's list call, with ``kwargs`` (watch, resource_version, ...)."""
        raise NotImplementedError

    def _listed(self, items: list[Mapping[str, Any]]) -> None:
        """A whole listing: what was known before is replaced."""
        raise NotImplementedError

    def _event(self, kind: str, item: Mapping[str, Any]) -> None:
        """One ADDED, MODIFIED or DELETED event."""
        raise NotImplementedError

    # ---- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version: str | None = self._list()
                while not self._stop.is_set() and version is not None:
                    version = self._watch(version)
            except Exception as error:  # the API server restarted, a timeout, a 403: list again
                log.warning("watch failed; listing again", watch=self.name, error=str(error))
                self._stop.wait(RETRY_SECONDS)

    def _list(self) -> str:
        answer = self._call(_preload_content=False, _request_timeout=60)
        body = json.loads(answer.data)
        self._listed(body.get("items") or [])
        self.listed.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str | None:
        """One watch request from ``version``; the version to go on from, or None when the
        server says it is gone (410: list again)."""
        answer = self._call(
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
                version = str((item.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._event(kind, item)
        finally:
            answer.release_conn()
        return version


def _events(answer: Any) -> Iterator[dict[str, Any]]:
    """The watch's events, one JSON object a line, as the chunks of ``answer`` bring them."""
    buffer = b""
    for chunk in answer.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
