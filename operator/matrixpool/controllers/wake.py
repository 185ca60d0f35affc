"""What wakes the main loop before its next tick: a workload created, deleted or given a new
spec; a gang's pod gone (its cards are free for a gang that waits); a Node whose facts changed
(Ready, cordoned, unhealthy cards, labels, taints, allocatable: what
:func:`matrixpool.k8s.convert.node_info` reads, so a heartbeat alone is no news); a checkpoint
daemon's Lease that appeared, went, or announces another endpoint or start.

Without it a new job waits up to :data:`matrixpool.controllers.loop.CYCLE_SECONDS` for the next
pass, and a node fault for the next tick, so detection would grow with the length of a pass at
scale. The loop still ticks on its own (a Lease that expires, a node that stops heartbeating,
time-sharing windows and retries send no event); a wake only brings the next pass forward, and
wakes that come during a pass make one more pass, never one each. Our own writes wake nothing:
a status patch keeps the generation, a created or bound pod is no deletion.

A Node event that shows a fault (Ready gone False or Unknown, the Node deleted, a card newly in
``matrixpool.dev/unhealthy-cards``) is also stamped with when it arrived (:attr:`Wake.noticed`),
by a Node watch on a thread of its own (:mod:`matrixpool.k8s.nodefaults`) that does not wait for
this event loop:
recovery dates the fault's detection (``status.recoveries[].detectedAt``, and the settle window)
from the stamp, not from the pass that gets to it, which at 64 supernodes comes seconds later. The
stamp also marks the wake *urgent*: the pass under way stops at its next step and the next one
starts with recovery (:func:`matrixpool.controllers.loop.one_pass`).

kopf updates its indexes before it calls these handlers for the same event, so the pass a wake
starts already sees what woke it. The :class:`Wake` lives in kopf's operator memo (one per
operator; per-object memos are shallow copies of it), set up at startup.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Iterable
from typing import Any

import kopf
import structlog

from matrixpool import api, clock
from matrixpool.api import inferenceservice, labels, trainingjob
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import convert, daemonleases, nodefaults
from matrixpool.placement import inventory

MEMO_KEY = "wake"
NODE_FAULTS_KEY = "node_faults"  # in kopf's memo: the Nodes' faults' watch (k8s.nodefaults)
LISTED_SECONDS = 60.0  # the most startup waits for the Nodes' first listing
log = structlog.get_logger(__name__)

# (node, what) → when the Node watch first showed it (monotonic, wall); what: "down", "deleted",
# or "card:<index>" for a card in matrixpool.dev/unhealthy-cards.
Noticed = dict[tuple[str, str], tuple[float, datetime.datetime]]


class Wake:
    """The loop's alarm, and the generation of every workload it has seen (by UID)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.generations: dict[str, int | None] = {}
        self.facts: dict[str, object] = {}  # "node/<name>", "lease/<name>" → what it said last
        self.noticed: Noticed = {}  # faults, by when the Node watch showed them
        self.urgent = False  # a fault came: the pass under way stops at its next step

    def news(self, type: str | None, uid: str, generation: int | None) -> bool:
        """Whether this event of a workload changes what the scheduler wants."""
        if type == "DELETED":
            return True
        return uid not in self.generations or self.generations[uid] != generation

    def saw(self, type: str | None, uid: str, generation: int | None) -> None:
        if type == "DELETED":
            self.generations.pop(uid, None)
        else:
            self.generations[uid] = generation
        self.event.set()

    def changed(self, type: str | None, key: str, facts: object) -> bool:
        """Whether this event of a Node or Lease (``key``) says something new: facts (not None)
        not seen before, facts other than those seen, or a deletion of one seen."""
        if type == "DELETED":
            return key in self.facts
        if key not in self.facts:
            return facts is not None
        return self.facts[key] != facts

    def noted(self, type: str | None, key: str, facts: object) -> None:
        if type == "DELETED":
            self.facts.pop(key, None)
        else:
            self.facts[key] = facts
        self.event.set()

    def node_faults(
        self, name: str, faults: Iterable[str], stamp: nodefaults.Stamp | None = None
    ) -> None:
        """Stamp the faults ``name``'s Node shows now that it did not show before (with
        ``stamp``, when the watch delivered them, else now; urgent: ring at once), and forget
        those it no longer shows."""
        now = set(faults)
        for key in [k for k in self.noticed if k[0] == name and k[1] not in now]:
            del self.noticed[key]
        new = [f for f in now if (name, f) not in self.noticed]
        if new:
            stamp = stamp or (clock.SYSTEM.monotonic(), clock.SYSTEM.now())
            self.noticed.update({(name, f): stamp for f in new})
            self.urgent = True
            self.event.set()

    def calm(self) -> None:
        """A pass begins with recovery: what was urgent is being seen to."""
        self.urgent = False

    def ring(self) -> None:
        self.event.set()

    async def sleep(self, seconds: float) -> bool:
        """Wait up to ``seconds`` or until woken; True when woken. Wakes after this call
        returns are kept for the next."""
        try:
            await asyncio.wait_for(self.event.wait(), seconds)
        except TimeoutError:
            return False
        self.event.clear()
        return True


def of(memo: Any) -> Wake | None:
    found = memo.get(MEMO_KEY) if memo is not None else None
    return found if isinstance(found, Wake) else None


class _Quiet(logging.Filter):
    """kopf logs every handler call it makes; a wake is no news for anyone reading the log."""

    QUIET = tuple(
        f"Handler '{h}' succeeded."
        for h in ("workload_changed", "pod_gone", "node_changed", "daemon_lease_changed")
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.QUIET


@kopf.on.startup()
def install(memo: kopf.Memo, **_: Any) -> None:
    memo[MEMO_KEY] = Wake()
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, _Quiet) for f in objects.filters):
        objects.addFilter(_Quiet())


@kopf.on.startup()
async def watch_node_faults(memo: kopf.Memo, **_: Any) -> None:
    """The Nodes' faults, stamped on a thread of their own (:mod:`matrixpool.k8s.nodefaults`)
    and handed to the alarm on the event loop; startup waits for the first listing, so a fault
    present at the start is dated by it."""
    alarm, loop = of(memo), asyncio.get_running_loop()
    if alarm is None:
        return

    def report(name: str, faults: list[str], stamp: nodefaults.Stamp) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the operator stops
            loop.call_soon_threadsafe(alarm.node_faults, name, faults, stamp)

    watch = memo[NODE_FAULTS_KEY] = nodefaults.NodeFaults(report).start()
    if not await asyncio.to_thread(watch.listed.wait, LISTED_SECONDS):
        log.warning("the Nodes' faults are not listed yet; going on", waited=LISTED_SECONDS)


@kopf.on.cleanup()
async def stop_node_faults(memo: kopf.Memo, **_: Any) -> None:
    watch = memo.get(NODE_FAULTS_KEY)
    if isinstance(watch, nodefaults.NodeFaults):
        watch.stop()


def _workload_news(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> bool:
    wake = of(memo)
    meta = body.get("metadata") or {}
    return wake is not None and wake.news(type, meta.get("uid", ""), meta.get("generation"))


@kopf.on.event(api.GROUP, api.VERSION, trainingjob.PLURAL, when=_workload_news)
@kopf.on.event(api.GROUP, api.VERSION, inferenceservice.PLURAL, when=_workload_news)
async def workload_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    wake = of(memo)
    meta = body.get("metadata") or {}
    if wake is not None:
        wake.saw(type, meta.get("uid", ""), meta.get("generation"))


def _gone(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


@kopf.on.event("", "v1", "pods", labels={labels.JOB: kopf.PRESENT}, when=_gone)
async def pod_gone(memo: kopf.Memo, **_: Any) -> None:
    wake = of(memo)
    if wake is not None:
        wake.ring()


def _node(name: str, body: kopf.Body) -> tuple[str, inventory.NodeInfo]:
    facts = convert.node_info(
        name,
        body.get("metadata", {}).get("labels") or {},
        body.get("metadata", {}).get("annotations") or {},
        body.get("spec") or {},
        body.get("status") or {},
    )
    return f"node/{name}", facts


def _node_news(type: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> bool:
    wake = of(memo)
    return wake is not None and wake.changed(type, *_node(name, body))


@kopf.on.event("", "v1", "nodes", when=_node_news)
async def node_changed(
    type: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """A Node's facts changed: the next pass comes now (its faults are stamped by the watch of
    :func:`watch_node_faults`, which does not wait for this loop)."""
    wake = of(memo)
    if wake is not None:
        wake.noted(type, *_node(name, body))


def _lease(name: str, body: kopf.Body) -> tuple[str, object]:
    meta = body.get("metadata") or {}
    found = daemonleases.parse(name, meta.get("annotations") or {}, body.get("spec") or {})
    said = (found.node, found.endpoint, found.duration, found.started) if found else None
    return f"lease/{name}", said  # a renewal alone is no news


def _lease_news(
    type: str | None, name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> bool:
    wake = of(memo)
    ours = namespace == k8s_client.operator_namespace()
    return ours and wake is not None and wake.changed(type, *_lease(name, body))


@kopf.on.event(
    "coordination.k8s.io", "v1", "leases", labels={labels.CKPT_DAEMON: "true"}, when=_lease_news
)
async def daemon_lease_changed(
    type: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    wake = of(memo)
    if wake is not None:
        wake.noted(type, *_lease(name, body))
