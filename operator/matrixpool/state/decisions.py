"""Decisions: what one controller decided that the others must see before the API shows it,
by workload UID, and time-sharing's allowances. The one place where controllers hand each
other work; every hand-off is a type (:class:`RecoveryPlan`, :class:`Preempting`,
:class:`Shares`), never a dict read by string keys.

Owned by the main loop (:mod:`matrixpool.controllers.loop`), one instance for its life, shown
to every controller through the :class:`~matrixpool.state.world.World` it reads. One writer
per field, each write a method of :class:`Decisions`:

==============  =================================  =========================================
field           written by (method)                read by
==============  =================================  =========================================
``recovering``  recovery (``plan_recovery``,       scheduling (pins new pods), recovery,
                ``recovered``)                     status
``failed``      recovery (``fail``: no level left) scheduling (no pods), recovery, status
``succeeded``   lifecycle (``succeed``: every      everyone: the job is finished (pods kept,
                rank exited 0)                     no cards, no recovery, no time-sharing)
``replicas``    scheduling (``resize``: shrink,    every ``replicas_now``
                grow)
``preempting``  scheduling (``preempt``, then      scheduling
                ``preempted``)
==============  =================================  =========================================

An evicted TrainingJob's resume is not a decision here: its open ``status.preemptions``
record (no ``resumedAt``) says it must resume, so an operator restarted in between still
tells the new pods what to restore.

:class:`Shares` (time-sharing's allowances, by workload key) are computed by
:mod:`matrixpool.controllers.timeshare` each pass and read by the scheduling cycle and the
status.

Errors: none; :meth:`RecoveryPlan.read` logs a plan it cannot read and returns None.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pydantic
import structlog

from matrixpool.api import common, trainingjob

log = structlog.get_logger(__name__)
RESCHEDULE = trainingjob.RecoveryLevel("Reschedule")


@dataclass(frozen=True)
class RecoveryPlan:
    """The recovery under way for one TrainingJob: recovery's hand-off to the scheduling cycle.

    It is ``status.recovering`` read into its type, written before the first pod is touched,
    so an operator killed halfway reads the same plan back and finishes it, once. Recovery
    writes it (:mod:`matrixpool.controllers.recovery.decide`); the scheduling cycle creates a
    moved rank's new pod reserved on :meth:`target` and tells every new pod what to restore
    (:meth:`restore_for`); the World pins the targets' cards until those pods exist."""

    status: trainingjob.RecoveryInProgress  # status.recovering, as written

    @classmethod
    def read(cls, wire: Mapping[str, Any] | None) -> RecoveryPlan | None:
        """The plan in ``status.recovering`` (None: no recovery under way)."""
        if not wire:
            return None
        try:
            return cls(trainingjob.RecoveryInProgress.model_validate(wire))
        except pydantic.ValidationError as error:  # the CRD's schema makes this impossible
            log.warning("status.recovering cannot be read; ignored", error=str(error))
            return None

    @property
    def id(self) -> str:
        return self.status.id

    @property
    def level(self) -> str:
        return self.status.level.value

    @property
    def reschedule(self) -> bool:
        """Reschedule: the whole gang goes and is placed again wherever it fits (no targets)."""
        return self.status.level == RESCHEDULE

    @property
    def targets(self) -> Mapping[str, str]:
        """Rank (as text) → the node its new pod is reserved on (InPlace, SpareSwap)."""
        return self.status.targets

    @property
    def pinned(self) -> list[str]:
        """The daemons asked to keep the restored step until every rank reloaded it."""
        return self.status.pinned

    @property
    def detected_at(self) -> datetime.datetime:
        return self.status.detected_at

    def target(self, rank: int) -> tuple[str, str] | None:
        """Where rank ``rank``'s new pod is reserved: (node, cards as "0,1,2,3"), or None."""
        node = self.status.targets.get(str(rank))
        cards = self.status.cards.get(str(rank))
        return (node, cards) if node and cards else None

    def restore_for(self, rank: int) -> str | None:
        """The ``matrixpool.dev/restore`` value rank ``rank`` gets, or None."""
        return trainingjob.restore_for(self.status.restore, rank)

    @property
    def world_size(self) -> int:
        """The ranks (pods) the recovery brings back: every rank its restore values name."""
        return max((trainingjob.highest_rank(key) + 1 for key in self.status.restore), default=0)

    def with_pinned(self, pinned: list[str]) -> RecoveryPlan:
        return RecoveryPlan(self.status.model_copy(update={"pinned": pinned}))

    def wire(self) -> dict[str, Any]:
        """``status.recovering`` as written."""
        return common.to_wire(self.status)

    def record(self, recovered: datetime.datetime) -> dict[str, Any]:
        """The ``status.recoveries`` entry of this recovery, done at ``recovered``."""
        done = trainingjob.RecoveryRecord.model_validate(
            self.status.model_dump(exclude={"targets", "cards", "restore", "pinned"})
        )
        return common.to_wire(done.model_copy(update={"recovered_at": recovered}))


@dataclass
class Decisions:
    """What controllers decided ahead of the API, by workload UID (table in the module)."""

    recovering: dict[str, RecoveryPlan | None] = field(default_factory=dict)  # None: finished
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)  # (reason code, message)
    replicas: dict[str, int] = field(default_factory=dict)  # after a shrink or a grow
    preempting: dict[str, Preempting] = field(default_factory=dict)  # victims asked to save
    # when every rank's pod had Succeeded (status.completionTime until the API shows it)
    succeeded: dict[str, datetime.datetime] = field(default_factory=dict)

    # ---- the writes, one per decision (the module's table says who calls which) ----------

    def plan_recovery(self, uid: str, plan: RecoveryPlan) -> None:
        """Recovery wrote ``plan`` to status.recovering: the scheduling cycle pins by it."""
        self.recovering[uid] = plan

    def recovered(self, uid: str) -> None:
        """Recovery finished (status.recovering cleared, whatever the index still shows)."""
        self.recovering[uid] = None

    def fail(self, uid: str, code: str, message: str) -> None:
        """No recovery is possible: the job fails with ``code`` and gives its cards back."""
        self.failed[uid] = (code, message)

    def resize(self, uid: str, replicas: int) -> None:
        """An elastic job shrank or grew to ``replicas``."""
        self.replicas[uid] = replicas

    def preempt(self, uid: str, preempting: Preempting) -> None:
        """A training victim was asked to checkpoint before it gives up its pods."""
        self.preempting[uid] = preempting

    def preempted(self, uid: str) -> None:
        """The victim gave up its pods (or went): nothing more to wait for."""
        self.preempting.pop(uid, None)

    def succeed(self, uid: str, when: datetime.datetime) -> None:
        """Every rank's pod Succeeded at ``when``: the job is finished for good."""
        self.succeeded[uid] = when

    def forget(self, uid: str, key: str) -> None:
        """Drop what was decided for the workload ``uid`` (kept by UID only, not by ``key``)."""
        for remembered in (
            self.recovering,
            self.failed,
            self.succeeded,
            self.replicas,
            self.preempting,
        ):
            remembered.pop(uid, None)


@dataclass(frozen=True)
class Preempting:
    """A training gang that must give up pods to a higher priority, asked to checkpoint first:
    its pods go when it answers (a step newer than ``baseline`` committed for every rank) or
    when ``grace`` real seconds have passed, whichever comes first."""

    request: str  # the checkpoint request id on its pods
    by: str  # the gang that takes the cards
    priority: int  # that gang's priority
    requested_at: datetime.datetime  # real time of the request
    grace: float  # seconds: the SuperNode's checkpointGraceSeconds, else the default
    baseline: int | None  # newest step committed for every rank when asked
    doomed: tuple[tuple[str, str], ...]  # (namespace, pod) to delete once released
    keep: int | None  # replicas it keeps (a shrink); None: evicted whole


@dataclass
class Shares:
    """Time-sharing's allowances this loop, for the workloads of time-shared SuperNodes only
    (by workload key)."""

    inference: dict[str, dict[str, int]] = field(default_factory=dict)  # key → role → replicas
    training: dict[str, int] = field(default_factory=dict)  # key → replicas; 0 = suspended
    phases: dict[str, trainingjob.Phase] = field(default_factory=dict)  # Checkpointing, Suspended
    # suspended jobs whose pods come back now: time-sharing tells each new pod what to restore
    # before it is bound, so their pods are created first and placed by a later cycle
    resuming: set[str] = field(default_factory=set)

    def governs(self, key: str) -> bool:
        return key in self.inference or key in self.training

    def amend(self, key: str, status: dict[str, Any]) -> dict[str, Any]:
        """A TrainingJob status the scheduler computed, with the time-sharing phase and the
        allowed replicas as ``replicas.desired``."""
        if key not in self.training:
            return status
        replicas = {**status.get("replicas", {}), "desired": self.training[key]}
        amended = {**status, "replicas": replicas}
        if key in self.phases:
            amended["phase"] = self.phases[key].value
        return amended
