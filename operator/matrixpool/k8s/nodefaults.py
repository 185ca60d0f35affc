"""The faults the Nodes show, stamped on a thread of their own when the API server delivers
them: Ready gone False or Unknown ("down"), the Node deleted ("deleted"), a card newly in
``matrixpool.dev/unhealthy-cards`` ("card:<index>").

kopf's Node watch delivers the same events to the index the scheduling pass reads, on the event
loop that runs the pass: at 64 supernodes an event waited there ~0.1 s behind the pass's steps
and the other watches' handlers before anyone could see it, and detection grew with the size of
a pass. This watch parses each event on its thread (:class:`matrixpool.k8s.listwatch.ListWatch`)
and hands each change of a node's faults, with the time it arrived, to ``report``: the operator
passes it on to its loop's alarm (:meth:`matrixpool.controllers.wake.Wake.node_faults`), which
dates the fault's detection by that stamp and stops the pass under way. The pass still acts on
what kopf's index shows; a stamp dates only a fault the index shows too.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Mapping
from typing import Any

from matrixpool import clock
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import convert, listwatch
from matrixpool.placement import inventory

Stamp = tuple[float, datetime.datetime]  # (monotonic, wall) when the event arrived
Report = Callable[[str, list[str], Stamp], None]  # node, the faults it shows now, stamp


def shown(deleted: bool, facts: inventory.NodeInfo) -> list[str]:
    """The faults a Node shows, by the names :attr:`Wake.noticed` keys them with."""
    if deleted:
        return ["deleted"]
    down = ["down"] if facts.down else []
    return down + [f"card:{card}" for card in sorted(facts.unhealthy)]


def of_body(deleted: bool, body: Mapping[str, Any]) -> tuple[str, list[str]]:
    """A Node object's name and the faults it shows."""
    meta = body.get("metadata") or {}
    name = str(meta.get("name", ""))
    facts = convert.node_info(
        name,
        meta.get("labels") or {},
        meta.get("annotations") or {},
        body.get("spec") or {},
        body.get("status") or {},
    )
    return name, shown(deleted, facts)


class NodeFaults(listwatch.ListWatch):
    """Each node's faults as the last listing and the watch since show; ``report`` hears of
    every change (called on the thread: it must hand over, not act)."""

    name = "node-faults"

    def __init__(self, report: Report, api: k8s_client.Api | None = None) -> None:
        super().__init__()
        self.api = api
        self.report = report
        self._faults: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, frozenset[str]]:
        with self._lock:
            return dict(self._faults)

    def _call(self, **kwargs: Any) -> Any:
        if self.api is None:
            self.api = k8s_client.default_api()
        return self.api.core.list_node(**kwargs)

    def _listed(self, items: list[Mapping[str, Any]]) -> None:
        stamp = (clock.SYSTEM.monotonic(), clock.SYSTEM.now())
        listed = dict(of_body(False, item) for item in items)
        for name in self.snapshot().keys() - listed.keys():  # deleted while we were not watching
            listed[name] = ["deleted"]
        for name, faults in listed.items():
            self._show(name, faults, stamp)

    def _event(self, kind: str, item: Mapping[str, Any]) -> None:
        stamp = (clock.SYSTEM.monotonic(), clock.SYSTEM.now())
        self._show(*of_body(kind == "DELETED", item), stamp)

    def _show(self, name: str, faults: list[str], stamp: Stamp) -> None:
        now = frozenset(faults)
        with self._lock:
            changed = self._faults.get(name, frozenset()) != now
            self._faults[name] = now
        if changed:
            self.report(name, sorted(now), stamp)
