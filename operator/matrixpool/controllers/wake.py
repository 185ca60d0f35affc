"""What wakes the main loop before its next tick: a workload created, deleted or given a new
spec, and a gang's pod gone (its cards are free for a gang that waits).

Without it a new job waits up to :data:`matrixpool.controllers.loop.CYCLE_SECONDS` for the next
pass. The loop still ticks on its own (node health, leases, time-sharing windows and retries
need no event); a wake only brings the next pass forward, and wakes that come during a pass
make one more pass, never one each. Our own writes wake nothing: a status patch keeps the
generation, a created or bound pod is no deletion.

kopf updates its indexes before it calls these handlers for the same event, so the pass a wake
starts already sees what woke it. The :class:`Wake` lives in kopf's operator memo (one per
operator; per-object memos are shallow copies of it), set up at startup.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from matrixpool import api
from matrixpool.api import inferenceservice, labels, trainingjob

MEMO_KEY = "wake"


class Wake:
    """The loop's alarm, and the generation of every workload it has seen (by UID)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.generations: dict[str, int | None] = {}

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

    QUIET = ("Handler 'workload_changed' succeeded.", "Handler 'pod_gone' succeeded.")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.QUIET


@kopf.on.startup()
def install(memo: kopf.Memo, **_: Any) -> None:
    memo[MEMO_KEY] = Wake()
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, _Quiet) for f in objects.filters):
        objects.addFilter(_Quiet())


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
