"""The kubelets' Leases kept by a list-and-watch of their own (matrixpool.k8s.nodeleases):
a narrow test of its handling of the API's answers, with a fake coordination API."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from matrixpool.k8s import nodeleases


def lease(name: str, renewed: str | None, version: str, duration: int = 40) -> dict[str, Any]:
    spec: dict[str, Any] = {"leaseDurationSeconds": duration}
    if renewed:
        spec["renewTime"] = renewed
    return {"metadata": {"name": name, "resourceVersion": version}, "spec": spec}


class Answer:
    """What the client returns with _preload_content=False."""

    def __init__(self, data: bytes = b"", chunks: list[bytes] | None = None) -> None:
        self.data = data
        self.chunks = chunks or []
        self.released = False

    def stream(self, amt: Any = None, decode_content: bool = False) -> Any:
        yield from self.chunks

    def release_conn(self) -> None:
        self.released = True


class Coordination:
    """A listing, then scripted watches (each a list of events); the calls it saw."""

    def __init__(self, listing: list[dict[str, Any]], watches: list[list[dict[str, Any]]]):
        self.listing = listing
        self.watches = watches
        self.calls: list[dict[str, Any]] = []
        self.done = threading.Event()

    def list_namespaced_lease(self, namespace: str, **kwargs: Any) -> Answer:
        self.calls.append({"namespace": namespace, **kwargs})
        if not kwargs.get("watch"):
            body = {"metadata": {"resourceVersion": "10"}, "items": self.listing}
            return Answer(json.dumps(body).encode())
        if not self.watches:
            self.done.set()
            time.sleep(0.05)
            raise RuntimeError("connection refused")  # the API server went away
        lines = b"".join(json.dumps(e).encode() + b"\n" for e in self.watches.pop(0))
        return Answer(chunks=[lines[:7], lines[7:]])  # a line split across chunks


class Api:
    def __init__(self, coordination: Coordination) -> None:
        self.coordination = coordination


def test_it_lists_then_watches_on_from_the_listing_and_lists_again_after_410() -> None:
    api = Coordination(
        [lease("n1", "2026-12-05T11:00:00.000000Z", "5"), lease("n2", None, "6")],
        [
            [
                {"type": "MODIFIED", "object": lease("n1", "2026-12-05T11:00:10Z", "11")},
                {"type": "ADDED", "object": lease("n3", "2026-12-05T11:00:05Z", "12", 20)},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}},
            ],
            [
                {"type": "DELETED", "object": lease("n3", "2026-12-05T11:00:05Z", "16")},
                {"type": "ERROR", "object": {"code": 410, "message": "too old"}},
            ],
        ],
    )
    leases = nodeleases.NodeLeases(Api(api), namespace="kube-node-lease")  # type: ignore[arg-type]
    seen: list[dict[str, tuple[float, float]]] = []
    original = leases._apply

    def apply(kind: str | None, name: str, spec: Any) -> None:
        original(kind, name, spec)
        seen.append(leases.snapshot())

    leases._apply = apply  # type: ignore[method-assign]
    leases.start()
    assert leases.listed.wait(5)
    assert api.done.wait(5)
    leases.stop()
    t0 = 1796468400.0  # 2026-12-05T11:00:00Z
    assert seen[0] == {"n1": (t0 + 10, 40.0)}  # n2 was never renewed: not there
    assert seen[1] == {"n1": (t0 + 10, 40.0), "n3": (t0 + 5, 20.0)}
    assert seen[2] == {"n1": (t0 + 10, 40.0)}  # n3's Lease went
    watches = [c for c in api.calls if c.get("watch")]
    assert [c["resource_version"] for c in watches[:2]] == ["10", "15"]  # on from the bookmark
    lists = [c for c in api.calls if not c.get("watch")]
    assert len(lists) == 2  # the 410 made it list again, then the last watch failed
    assert all(c["namespace"] == "kube-node-lease" for c in api.calls)
