"""The work a victim would lose, as the scheduling cycle hands it to the engine (issue 34), and
``status.checkpoints.committedAt``, the time it counts from, as the checkpoint poll writes it."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Any

import pytest

from matrixpool import clock
from matrixpool.api import trainingjob
from matrixpool.controllers.recovery import checkpoints, memory
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate, preemption
from matrixpool.k8s import daemonclient
from matrixpool.placement import gangs
from matrixpool.state import assumed as assuming
from tests.unit import worlds
from tests.unit.recorder import Recorder

NOW = datetime.datetime(2026, 12, 5, 8, 0, tzinfo=datetime.UTC)


def at(seconds_ago: float) -> str:
    return (NOW - datetime.timedelta(seconds=seconds_ago)).isoformat().replace("+00:00", "Z")


def bound(seconds_ago: float) -> dict[str, Any]:
    return {
        "type": "Scheduled",
        "status": "True",
        "reason": "GangBound",
        "message": "bound",
        "lastTransitionTime": at(seconds_ago),
    }


@pytest.mark.parametrize(
    ("status", "lost"),
    [
        pytest.param(
            {"conditions": [bound(3600)], "checkpoints": {"memory": 40, "committedAt": at(90)}},
            90.0,
            id="since the newest committed checkpoint",
        ),
        pytest.param(
            {"conditions": [bound(600)]},
            600.0,
            id="no checkpoint: since the gang was bound",
        ),
        pytest.param(
            {"conditions": [bound(600)], "checkpoints": {"memory": 4, "committedAt": at(7200)}},
            600.0,
            id="a checkpoint older than the run: since the gang was bound",
        ),
        pytest.param(
            {
                "conditions": [bound(3600)],
                "checkpoints": {"memory": 4, "committedAt": at(1800)},
                "recoveries": [{"recoveredAt": at(120)}],
            },
            120.0,
            id="since the last recovery restarted it",
        ),
        pytest.param(
            {"conditions": [{**bound(30), "status": "False"}]},
            0.0,
            id="not bound, never created: nothing at stake",
        ),
    ],
)
def test_a_training_job_loses_the_seconds_since_its_newest_safe_point(
    status: dict[str, Any], lost: float
) -> None:
    assert preemption.lost_work_per_card(worlds.job("j", 2, status=status), NOW) == lost


def test_a_job_the_status_says_nothing_of_counts_from_its_creation() -> None:
    job = worlds.job("j", 2)
    created = dataclasses.replace(job, created=at(45))
    assert preemption.lost_work_per_card(created, NOW) == 45.0


def test_an_inference_replica_loses_a_fixed_warm_up_per_card() -> None:
    job = worlds.job("j", 2)
    service = dataclasses.replace(job, kind="InferenceService")
    assert preemption.lost_work_per_card(service, NOW) == preemption.INFERENCE_LOST_SECONDS


class Fixed:
    def now(self) -> datetime.datetime:
        return NOW

    def monotonic(self) -> float:
        return 0.0


@pytest.mark.parametrize(
    ("known", "found", "committed_at"),
    [
        pytest.param({"memory": 4}, 6, at(0), id="a newer step: seen now"),
        pytest.param(
            {"memory": 6, "committedAt": at(300)}, 6, None, id="the same step: nothing to write"
        ),
        pytest.param(
            {"memory": 6, "committedAt": at(300)}, 2, at(300), id="a roll-back keeps the time"
        ),
    ],
)
def test_the_checkpoint_poll_records_when_the_newest_step_was_first_seen(
    monkeypatch: pytest.MonkeyPatch, known: dict[str, Any], found: int, committed_at: str | None
) -> None:
    monkeypatch.setattr(clock, "SYSTEM", Fixed())
    job = worlds.job("j", 2, checkpoint=True, status={"checkpoints": known})
    act = Recorder()
    act.inventories[job.uid] = daemonclient.Inventory(
        tuple(worlds.held(job.uid, found, rank, f"n{rank}") for rank in range(2))
    )
    endpoints = {"n0": worlds.endpoint("n0"), "n1": worlds.endpoint("n1")}
    asyncio.run(checkpoints._poll(job, endpoints, None, 2, memory.State(), act))
    if committed_at is None:
        assert act.statuses == []
    else:
        written = act.statuses[-1]["checkpoints"]
        assert (written["memory"], written["committedAt"]) == (found, committed_at)


def test_a_cycle_evicts_the_victim_whose_checkpoint_is_fresher() -> None:
    """Equal priority and size: the job that committed a minute ago loses less than the one
    that committed an hour ago, so it gives way (the smallest-set rule, breaking the tie by
    name, took "aged")."""
    real = clock.SYSTEM.now()

    def status(committed_minutes_ago: int) -> dict[str, Any]:
        committed = real - datetime.timedelta(minutes=committed_minutes_ago)
        scheduled = {**bound(0), "lastTransitionTime": "2026-01-01T00:00:00Z"}
        return {
            "conditions": [scheduled],
            "checkpoints": {"memory": 8, "committedAt": committed.isoformat()},
        }

    seen = worlds.fixed_world(
        worlds.index(
            *worlds.running("aged", 2),
            *worlds.running("recent", 2, first_node=2),
            *(worlds.pod(f"high-{r}", f"high-u{r}") for r in range(2)),
        ),
        [
            worlds.job("aged", 2, priority=10, status=status(60)),
            worlds.job("recent", 2, priority=10, status=status(1)),
            worlds.job("high", 2, priority=500),
        ],
    )
    act = Recorder()
    asyncio.run(scheduler.Cycle(seen, cyclestate.Memory(), assuming.Assumed(), act).run())
    assert sorted(act.deleted) == ["ns/recent-0", "ns/recent-1"]


def test_a_gang_already_giving_way_loses_nothing_more() -> None:
    """Its pods going, a plan made again takes it again rather than a new victim."""
    jobs = [
        worlds.job(name, 2, priority=10, status={"conditions": [bound(600)]}) for name in ("a", "b")
    ]
    seen = worlds.fixed_world(
        worlds.index(*worlds.running("a", 2, deleting=True), *worlds.running("b", 2, first_node=2)),
        jobs,
    )
    state = cyclestate.CycleState(seen, cyclestate.Memory())
    for workload in jobs:
        assert isinstance(workload.model, trainingjob.TrainingJob)
        gang = gangs.training_gang("ns", workload.name, workload.model.spec, 8)
        state.by_gang[gang.request.gang] = (workload, gang)
    lost = {k: v.lost_work_per_card_s for k, v in preemption.victims(state).items()}
    assert lost["ns/a"] == 0.0
    assert lost["ns/b"] >= 600.0


def test_a_victim_gives_up_its_pods_as_they_are_now_each_deleted_by_its_uid() -> None:
    """Between the checkpoint request and the eviction, rank 1 was made again under its name
    (a recovery) and rank 2 went: the delete names the new rank 1's UID, so a delete meant
    for a pod can never take a later one of the same name, and nothing is asked of rank 2."""
    ranks = worlds.running("v", 3)
    remade = dataclasses.replace(ranks[1], uid="v-uid-1-again")
    seen = worlds.fixed_world(
        worlds.index(ranks[0], remade), [worlds.job("v", 3, priority=10, checkpoint=True)]
    )
    act = Recorder()
    state = cyclestate.CycleState(seen, cyclestate.Memory(), act=act)
    record = trainingjob.Preemption(
        by="ns/high",
        priority=500,
        request_id="r1",
        evicted_at=clock.SYSTEM.now(),
        checkpoint=trainingjob.PreemptionCheckpoint.GRACE_EXPIRED,
    )
    (victim,) = seen.workloads
    doomed = [("ns", "v-0"), ("ns", "v-1"), ("ns", "v-2")]

    asyncio.run(preemption.give_up(state, victim, doomed, record, ""))

    assert act.deleted_uids == {"ns/v-0": "v-uid-0", "ns/v-1": "v-uid-1-again"}
    assert state.assumed.deleted == {"v-uid-0", "v-uid-1-again"}
