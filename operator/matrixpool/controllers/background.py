"""Daemon I/O off the loop: the calls to checkpoint daemons that the controllers make often
(heartbeats, ``status.checkpoints`` polls, time-sharing's checkpoint answers) run as tasks of
their own, at most one per key, and leave their answer in the controller's memory, where the
next pass reads it. A daemon that answers slowly delays its own answer, not the loop — except
where a controller chooses to wait for the call, with a bound (:meth:`Tasks.settle`; recovery
does for its heartbeats and polls).

Used by :mod:`matrixpool.controllers.recovery` (its :mod:`~matrixpool.controllers.recovery.memory`)
and :mod:`matrixpool.controllers.timeshare`; the tasks belong to their memory, which the main
loop owns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass
class Tasks:
    """Background calls by key (a job UID, "probe"): never two at once for one key."""

    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def busy(self, key: str) -> bool:
        task = self.running.get(key)
        return task is not None and not task.done()

    def start(self, key: str, call: Coroutine[Any, Any, None]) -> bool:
        """Run ``call`` unless one for ``key`` still runs (then ``call`` is dropped)."""
        if self.busy(key):
            call.close()
            return False
        task = asyncio.create_task(call, name=f"daemon-io-{key}")
        task.add_done_callback(lambda done: _report(key, done))
        self.running[key] = task
        return True

    async def settle(self, key: str, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the call under ``key`` to end, so that a
        decision asks the daemons alone (its answers then come from unloaded daemons)."""
        task = self.running.get(key)
        if task is None or task.done():
            return
        await asyncio.wait({task}, timeout=timeout)

    def cancel(self, key: str) -> None:
        task = self.running.pop(key, None)
        if task is not None:
            task.cancel()


def _report(key: str, task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning(
            "daemon call failed; the next pass asks again", key=key, error=repr(task.exception())
        )
