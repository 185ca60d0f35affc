"""How a SuperNode moves from the split in place to a new target split, one cycle at a time.

Called every scheduling cycle by ``matrixpool.controllers.timeshare``, which reads the pods and
the checkpoint daemons and turns the result into per-workload allowances the scheduler obeys.
Pure: counts and instants in, decisions out.

Rules (DESIGN.md, "Time-sharing contract"):
1. Release before grow. While any workload of the supernode holds more than its target, or any
   of its pods is still terminating, nobody grows: each workload keeps ``min(current, target)``
   (:func:`stage`). So a card is never promised to a new pod while an old one still holds it,
   and a growing gang never triggers a preemption of its own.
2. Inference shrinks at once (no state to save). Training that must give up running pods keeps
   them until its checkpoint request is answered or ``checkpointGraceSeconds`` has passed
   (:func:`released`); then its pods above the target are deleted.
3. Answer: a step committed for every rank that is newer than the newest committed step when the
   request was made (:func:`answered`). Deadline: real seconds since the request, never the
   scaled clock (:func:`expired`).
4. A job evicted without an answer resumes from the step committed before the request; the steps
   it trained since are lost. The operator cannot see a trainer's progress, only its shards, so
   the lost steps are the newest step any rank stored minus the committed one: a lower bound
   (:func:`lost_steps`).
5. Once nothing is above target and nothing terminates, every workload gets its target (rule 1
   lifted): inference scales up onto the freed cards, suspended jobs resume.
6. A transition starts when the target changes (a window boundary, or capacity or workloads
   changing) and is in place when every workload runs exactly its target, all pods bound, none
   terminating (:class:`Timeline`). Its duration is split into checkpoint (start → last
   release), eviction (→ nothing terminating) and placement (→ in place).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Set
from dataclasses import dataclass, field, replace

from matrixpool.timeshare.split import Split, WorkloadKey

Roles = Mapping[str, int]  # role -> replicas


@dataclass(frozen=True)
class Current:
    """What one supernode's workloads hold now (pods that exist and are not terminating)."""

    inference: Mapping[WorkloadKey, Roles]  # service -> role -> replicas with live pods
    training: Mapping[WorkloadKey, int]  # job -> replicas with live pods
    running_above: Set[WorkloadKey] = frozenset()  # jobs with bound pods above their target
    terminating: bool = False  # some pod of the supernode is still terminating


@dataclass(frozen=True)
class Allowances:
    """Replicas each workload may have this cycle."""

    inference: Mapping[WorkloadKey, Roles]
    training: Mapping[WorkloadKey, int]
    checkpointing: frozenset[WorkloadKey]  # jobs kept above target until they checkpoint
    releasing: bool  # rule 1 in force: nobody grows


def above(current: int, target: int) -> bool:
    return current > target


def stage(split: Split, current: Current, released: Set[WorkloadKey]) -> Allowances:
    """Rules 1, 2 and 5: the allowances of one cycle.

    ``released``: jobs whose checkpoint request was answered or expired (rule 3).
    """
    over_inference = any(
        above(current.inference.get(key, {}).get(role, 0), target)
        for key, roles in split.inference.items()
        for role, target in roles.items()
    )
    over_training = any(
        above(current.training.get(key, 0), target) for key, target in split.training.items()
    )
    releasing = over_inference or over_training or current.terminating
    inference = {
        key: {
            role: _allow(current.inference.get(key, {}).get(role, 0), target, releasing)
            for role, target in roles.items()
        }
        for key, roles in split.inference.items()
    }
    training: dict[WorkloadKey, int] = {}
    waiting: set[WorkloadKey] = set()
    for key, target in split.training.items():
        now = current.training.get(key, 0)
        if now > target and key in current.running_above and key not in released:
            training[key] = now  # rule 2: keep the pods until the checkpoint is answered
            waiting.add(key)
        else:
            training[key] = _allow(now, target, releasing)
    return Allowances(inference, training, frozenset(waiting), releasing)


def _allow(now: int, target: int, releasing: bool) -> int:
    """Shrink at once; grow only when nothing is being released (rule 1)."""
    return min(now, target) if releasing else target


def answered(baseline: int | None, committed: int | None) -> bool:
    """Rule 3: a step committed for every rank, newer than the one committed when asked."""
    return committed is not None and (baseline is None or committed > baseline)


def expired(requested_at: dt.datetime, grace_seconds: float, now: dt.datetime) -> bool:
    """Rule 3: the grace (real seconds) is over."""
    return (now - requested_at).total_seconds() >= grace_seconds


def released(
    baseline: int | None,
    committed: int | None,
    requested_at: dt.datetime,
    grace_seconds: float,
    now: dt.datetime,
) -> bool:
    """Rule 2: the job may now give up its pods."""
    return answered(baseline, committed) or expired(requested_at, grace_seconds, now)


def lost_steps(committed: int | None, reached: int | None) -> int | None:
    """Rule 4: steps stored by some rank beyond the committed step (a lower bound); None when
    nothing was stored at all."""
    if reached is None:
        return None
    return max(0, reached - (committed or 0))


def in_place(split: Split, current: Current, bound: Mapping[WorkloadKey, bool]) -> bool:
    """Rule 6: every workload runs exactly its target, all its pods bound, nothing terminating.

    ``bound``: per workload, whether every pod it has now is bound to a node.
    """
    if current.terminating:
        return False
    for key, roles in split.inference.items():
        have = current.inference.get(key, {})
        if any(have.get(role, 0) != target for role, target in roles.items()):
            return False
    for key, target in split.training.items():
        if current.training.get(key, 0) != target:
            return False
    return all(bound.get(key, True) for key in [*split.inference, *split.training])


def signature(split: Split) -> tuple[object, ...]:
    """What makes two targets the same transition."""
    return (
        split.window,
        tuple(sorted((k, tuple(sorted(r.items()))) for k, r in split.inference.items())),
        tuple(sorted(split.training.items())),
    )


@dataclass(frozen=True)
class Timeline:
    """One transition's milestones, in real seconds (monotonic); rule 6.

    ``started``: the boundary (or when the change was seen); ``released``: the last job
    released its pods (no one waits for a checkpoint); ``drained``: nothing above target or
    terminating; ``settled``: the new split in place.
    """

    window: str | None
    started: float
    released: float | None = None
    drained: float | None = None
    settled: float | None = None
    checkpointed: bool = False  # some job was asked to checkpoint in this transition
    from_cards: tuple[int, int] = (0, 0)  # (inference, training) cards when it started
    to_cards: tuple[int, int] = (0, 0)  # the target's (inference, training) cards
    answered: Mapping[WorkloadKey, bool] = field(default_factory=dict)  # per job asked

    def observe(
        self, now: float, allowances: Allowances, settled: bool, asked: bool = False
    ) -> Timeline:
        """The timeline after one more cycle at ``now``."""
        if self.settled is not None:
            return self
        step = replace(self, checkpointed=self.checkpointed or asked)
        if step.released is None and not allowances.checkpointing:
            step = replace(step, released=now if step.checkpointed else step.started)
        if step.released is not None and step.drained is None and not allowances.releasing:
            step = replace(step, drained=now)
        if settled:
            step = replace(
                step,
                released=step.released if step.released is not None else step.started,
                drained=step.drained if step.drained is not None else now,
                settled=now,
            )
        return step

    @property
    def seconds(self) -> float | None:
        return None if self.settled is None else max(0.0, self.settled - self.started)

    @property
    def checkpoint_seconds(self) -> float | None:
        """Start → last release: the checkpoint grace actually used (0 with nothing asked)."""
        if self.released is None:
            return None
        return max(0.0, self.released - self.started) if self.checkpointed else 0.0

    @property
    def eviction_seconds(self) -> float | None:
        """Release → nothing terminating: pods deleted and gone."""
        if self.released is None or self.drained is None:
            return None
        return max(0.0, self.drained - self.released)

    @property
    def placement_seconds(self) -> float | None:
        """Drained → in place: the grown workloads placed and bound."""
        if self.drained is None or self.settled is None:
            return None
        return max(0.0, self.settled - self.drained)
