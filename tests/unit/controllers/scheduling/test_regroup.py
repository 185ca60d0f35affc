"""A gang regrouped at a new size (issue 32, item 1), from the cycle's side: ranks made for
another world are all replaced, the new pods restore the newest step every rank of the old
world committed (saying that world), ``status.resizes`` records it from start to end, and the
recovery sees no fault in a gang that disagrees on its world. No API server
(tests/unit/recorder.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from matrixpool.controllers.recovery import detect
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate, gangpods, regroup
from matrixpool.k8s import daemonclient
from matrixpool.placement import inventory
from matrixpool.state import assumed as assuming
from matrixpool.state import world
from matrixpool_recovery import restore as restore_codec
from tests.unit.recorder import Recorder
from tests.unit.worlds import fixed_world, held, index, job, pod, running


def cycle(seen: world.World, memory: cyclestate.Memory, executor: Recorder) -> None:
    asyncio.run(scheduler.Cycle(seen, memory, assuming.Assumed(), executor).run())


def elastic(desired: int, replicas: int = 4, **status: Any) -> Any:
    """Job ``e`` of ``replicas`` ranks (at least 2) that a preemption shrank to ``desired``."""
    return job(
        "e",
        replicas,
        checkpoint=True,
        minReplicas=2,
        status={"replicas": {"desired": desired}, **status},
    )


def opened(id_: str) -> dict[str, Any]:
    """status.resizes' record of a regroup 4 → 2 under way since 10:00."""
    return {
        "id": id_,
        "fromReplicas": 4,
        "toReplicas": 2,
        "reason": "Preemption",
        "startedAt": "2026-11-30T10:00:00Z",
    }


def resizes(executor: Recorder) -> list[dict[str, Any]]:
    written = executor.status_of("e", "resizes")
    return list(written[-1]) if written else []


def test_disagreeing_names_the_old_world_only_when_it_differs() -> None:
    four = running("e", 4, world=4)
    assert world.disagreeing(four, 4) is None
    assert world.disagreeing(four, 2) == 4
    assert world.disagreeing(four[:2], 4) is None  # ranks missing: a recovery's business
    assert world.disagreeing(running("e", 2, world=2), 4) == 2  # a grow: made for 2
    mixed = [*running("e", 2, world=2), *running("e", 2, world=4)]
    assert world.disagreeing(mixed, 4) == 2  # the smaller world: its steps cover every rank
    assert world.disagreeing(running("e", 4), 2) is None  # pods that do not say their world


def test_a_shrunk_gang_is_replaced_whole_and_the_regroup_recorded() -> None:
    seen = fixed_world(index(*running("e", 4, world=4)), [elastic(2)])
    executor, memory = Recorder(), cyclestate.Memory()

    cycle(seen, memory, executor)

    assert sorted(executor.deleted) == [f"ns/e-{r}" for r in range(4)]  # the ranks that stay too
    assert executor.created == []  # the new ones wait until the old are gone
    (record,) = resizes(executor)
    assert (record["fromReplicas"], record["toReplicas"]) == (4, 2)
    assert record["reason"] == "Preemption"
    assert record["startedAt"]
    assert not record.get("finishedAt")
    assert executor.reasons("e")[0] == "Regrouping"  # (then Grown: no preemptor holds the cards)
    message = next(m for name, _, r, m in executor.events if r == "Regrouping")
    assert "shrinks from 4 to 2 ranks" in message


def test_the_new_gang_restores_the_old_worlds_newest_complete_step_and_closes_the_record() -> None:
    e = elastic(2, resizes=[opened("abc")])
    seen = fixed_world(index(), [e])
    executor, memory = Recorder(), cyclestate.Memory()
    # Step 6 is held for all 4 old ranks; step 8 for ranks 0 and 1 only: complete for a world of
    # 2, but not for the world that wrote it.
    executor.inventories["uid-e"] = daemonclient.Inventory(
        tuple(
            [held("uid-e", 6, r, f"n{r}") for r in range(4)]
            + [held("uid-e", 8, r, f"n{r}") for r in range(2)]
        )
    )
    asked = scheduler.Cycle(seen, memory, assuming.Assumed(), executor).state
    asyncio.run(gangpods.find_resume(asked, e, "resize-abc", 4, fresh=True))

    cycle(seen, memory, executor)

    made = executor.created
    assert sorted(m["metadata"]["name"] for m in made) == ["e-0", "e-1"]
    told = {m["metadata"]["annotations"]["matrixpool.dev/restore"] for m in made}
    assert len(told) == 1
    restore = restore_codec.parse_restore(told.pop())
    assert restore is not None
    assert (restore.step, restore.world, restore.recovery) == (6, 4, "resize-abc")
    env = {v["name"]: v.get("value") for v in made[0]["spec"]["containers"][0]["env"]}
    assert env["MATRIXPOOL_WORLD_SIZE"] == "2"

    # Bound and running, with what they were told: the record is closed.
    value = made[0]["metadata"]["annotations"]["matrixpool.dev/restore"]
    bound = fixed_world(index(*running("e", 2, world=2, restore=value)), [e])
    cycle(bound, memory, executor)
    (record,) = resizes(executor)
    assert record["restoredStep"] == 6
    assert record["finishedAt"]
    assert record["seconds"] >= 0
    assert executor.deleted == []  # the new world is the job's size: nothing is replaced


def test_a_grown_gang_says_the_smaller_world_that_wrote_the_step() -> None:
    e = job("e", 4, checkpoint=True, minReplicas=2)  # spec.replicas again: grown back
    seen = fixed_world(index(*running("e", 2, world=2)), [e])
    executor, memory = Recorder(), cyclestate.Memory()
    cycle(seen, memory, executor)
    (record,) = resizes(executor)
    assert (record["fromReplicas"], record["toReplicas"], record["reason"]) == (2, 4, "Replicas")

    executor.inventories["uid-e"] = daemonclient.Inventory(
        tuple(held("uid-e", 10, r, f"n{r}") for r in range(2))
    )
    gone = fixed_world(index(), [dataclasses.replace(e, status={"resizes": [record]})])
    state = scheduler.Cycle(gone, memory, assuming.Assumed(), executor).state
    tag = f"resize-{record['id']}"
    asyncio.run(gangpods.find_resume(state, gone.workloads[0], tag, 2, fresh=True))
    cycle(gone, memory, executor)
    values = {m["metadata"]["annotations"]["matrixpool.dev/restore"] for m in executor.created}
    (value,) = values
    restore = restore_codec.parse_restore(value)
    assert restore is not None
    assert (restore.step, restore.world) == (10, 2)
    assert len(executor.created) == 4
    assert [restore_codec.shard_for(r, restore.world) for r in range(4)] == [0, 1, 0, 1]


def test_a_regroup_with_nothing_committed_starts_afresh_as_a_new_run() -> None:
    e = elastic(2, resizes=[opened("xyz")])
    seen = fixed_world(index(), [e])
    memory, executor = cyclestate.Memory(), Recorder()
    asked = scheduler.Cycle(seen, memory, assuming.Assumed(), executor).state
    asyncio.run(gangpods.find_resume(asked, e, "resize-xyz", 4, fresh=True))
    cycle(seen, memory, executor)
    restore = restore_codec.parse_restore(
        executor.created[0]["metadata"]["annotations"]["matrixpool.dev/restore"]
    )
    assert restore is not None
    assert (restore.fresh, restore.recovery) == (True, "resize-xyz")
    assert restore.incarnation is not None


def test_a_size_that_moves_again_once_the_new_gang_runs_opens_a_regroup_of_its_own() -> None:
    # The 4 -> 2 regroup "abc" made its two ranks (they run, told to restore step 6); before
    # the record closed, the job's size moved to 3: those two ranks trained on, so the next
    # regroup must ask what they committed, not reuse step 6.
    told = restore_codec.restore_value(6, ["n0"], "resize-abc", incarnation=7, of=7, world=4)
    e = elastic(3, resizes=[opened("abc")])
    seen = fixed_world(index(*running("e", 2, world=2, restore=told)), [e])
    executor, memory = Recorder(), cyclestate.Memory()
    memory.resumes["uid-e"] = ("resize-abc", told)  # what the first regroup asked

    cycle(seen, memory, executor)

    assert sorted(executor.deleted) == ["ns/e-0", "ns/e-1"]
    first, second = resizes(executor)
    assert (first["id"], first["toReplicas"]) == ("abc", 2)
    assert first["finishedAt"]
    assert "restoredStep" not in first
    assert (second["fromReplicas"], second["toReplicas"]) == (2, 3)
    assert second["id"] != "abc"
    assert not second.get("finishedAt")
    gone = fixed_world(index(), [dataclasses.replace(e, status={"resizes": [first, second]})])
    cycle(gone, memory, executor)
    assert executor.created == []  # step 6 is not reused: the daemons are asked anew
    executor.inventories["uid-e"] = daemonclient.Inventory(
        tuple(held("uid-e", 9, r, f"n{r}") for r in range(2))
    )
    state = scheduler.Cycle(gone, memory, assuming.Assumed(), executor).state
    asyncio.run(gangpods.find_resume(state, e, f"resize-{second['id']}", 2, fresh=True))
    cycle(gone, memory, executor)
    assert len(executor.created) == 4  # (grown back to 4 meanwhile: no preemptor holds cards)
    values = {m["metadata"]["annotations"]["matrixpool.dev/restore"] for m in executor.created}
    (value,) = values
    restore = restore_codec.parse_restore(value)
    assert restore is not None
    assert (restore.step, restore.world) == (9, 2)  # what the two ranks committed since


def test_a_pod_made_from_a_lagging_index_during_a_regroup_goes_instead_of_holding_it_back() -> None:
    # Regroup "abc" (4 -> 2) deleted the old ranks; meanwhile a cycle whose pod index lagged
    # (it did not show the gang's pods) made e-1 for the new size, told nothing. It says the
    # world the job runs at, so nothing disagrees: without more, the regroup's pods wait for
    # it to go forever (found by tests/integration/test_stress.py).
    e = elastic(2, resizes=[opened("abc")])
    stray = pod("e-1", "e-uid-stray", world=2)
    seen = fixed_world(index(stray), [e])
    executor, memory = Recorder(), cyclestate.Memory()
    memory.resumes["uid-e"] = ("resize-abc", restore_codec.restore_value(6, ["n0"], "resize-abc"))

    cycle(seen, memory, executor)

    assert executor.deleted == ["ns/e-1"]
    assert executor.created == []  # the regroup's pods come once it is gone
    cycle(fixed_world(index(), [e]), memory, executor)
    assert sorted(m["metadata"]["name"] for m in executor.created) == ["e-0", "e-1"]
    told = {m["metadata"]["annotations"]["matrixpool.dev/restore"] for m in executor.created}
    assert {restore_codec.restore_id(v) for v in told} == {"resize-abc"}


def test_recovery_sees_no_fault_in_a_gang_made_for_another_world() -> None:
    nodes = {
        f"n{i}": inventory.NodeInfo(
            name=inventory.NodeName(f"n{i}"), labels={}, ready=i != 1, cards={}, down=i == 1
        )
        for i in range(4)
    }
    old = running("e", 4, world=4)
    assert detect.detect(4, old, nodes, ()) != []  # n1 down under the old world: a fault
    assert detect.detect(2, old, nodes, ()) == []  # but the job runs at 2 now: a regroup


@pytest.mark.parametrize(
    ("value", "world"),
    [
        (restore_codec.restore_value(6, [], "resize-a", incarnation=9, of=1, world=4), 4),
        (restore_codec.restore_value(6, [], "r1", incarnation=9, of=1), None),
    ],
)
def test_the_restore_annotation_carries_the_old_world(value: str, world: int | None) -> None:
    restore = restore_codec.parse_restore(value)
    assert restore is not None
    assert restore.world == world


def test_an_unreadable_world_is_refused() -> None:
    with pytest.raises(ValueError, match="world"):
        restore_codec.parse_restore('{"step": 3, "world": 0}')
    with pytest.raises(ValueError, match="world"):
        restore_codec.parse_restore('{"step": 3, "world": "four"}')
    assert restore_codec.shard_for(5, 4) == 1
    assert restore_codec.shard_for(3, 4) == 3
    assert restore_codec.shard_for(3, None) == 3


def test_a_preemptor_waits_for_a_gang_its_regroup_is_replacing_instead_of_evicting_it() -> None:
    """Seen on real nodes: the cycle that regrouped a shrunk job deleted its pods (the index
    not showing it yet), and the preemptor, not fitting until they are gone, preempted the job
    again — evicting it whole. The pods a cycle deleted are going: no second preemption."""
    shrunk = elastic(2, replicas=3)
    urgent = job("urgent", 2, priority=1000)
    seen = fixed_world(index(*running("e", 3, world=3)), [shrunk, urgent])
    executor, memory = Recorder(), cyclestate.Memory()

    cycle(seen, memory, executor)

    assert sorted(executor.deleted) == [f"ns/e-{r}" for r in range(3)]  # the regroup
    asked = [a for a in executor.annotated if "matrixpool.dev/checkpoint-request" in a[1]]
    assert asked == []  # nobody is asked to checkpoint: the job's pods already go
    assert "Preempted" not in executor.reasons("e")
    assert not executor.status_of("e", "preemptions")


def suspended_at(at: str, request: str = "ts-1") -> dict[str, Any]:
    """status.timeSharing.suspensions' record of a window's suspension at ``at``, resumed."""
    return {
        "requestId": request,
        "reason": "OutsideWindows",
        "suspendedAt": at,
        "worldSize": 2,
        "step": 12,
        "answered": True,
        "resumedAt": "2026-11-30T10:05:00Z",
        "restoredStep": 12,
    }


def test_a_regroup_a_suspension_overtook_is_closed_and_spares_the_resumed_gang() -> None:
    # Regroup "abc" (4 -> 2) opened at 10:00; before its new ranks ran, a window suspended the
    # job (10:01) and a later one resumed it: its two ranks run, told the suspension's step
    # (resume-ts-1). They are no strays of the regroup, and nobody gets its older restore.
    told = restore_codec.restore_value(12, ["n0"], "resume-ts-1", incarnation=8, of=8)
    sharing = {"suspensions": [suspended_at("2026-11-30T10:01:00Z")]}
    e = elastic(2, resizes=[opened("abc")], timeSharing=sharing)
    seen = fixed_world(index(*running("e", 2, world=2, restore=told)), [e])
    executor, memory = Recorder(), cyclestate.Memory()
    memory.resumes["uid-e"] = ("resize-abc", restore_codec.restore_value(6, ["n0"], "resize-abc"))

    cycle(seen, memory, executor)

    assert executor.deleted == []
    assert executor.created == []
    [record] = resizes(executor)
    assert (record["id"], record["supersededBy"]) == ("abc", "ts-1")
    assert record["finishedAt"]
    assert "restoredStep" not in record


@pytest.mark.parametrize(
    ("suspensions", "preemptions", "by"),
    [
        ([], [], None),
        ([suspended_at("2026-11-30T09:59:00Z")], [], None),  # before the regroup: its past
        ([suspended_at("2026-11-30T10:01:00Z")], [], "ts-1"),
        ([], [{"requestId": "p-1", "evictedAt": "2026-11-30T10:02:00Z"}], "p-1"),
        # A shrink by a preemption keeps ranks: it is what regroups, not a stop.
        ([], [{"requestId": "p-2", "evictedAt": "2026-11-30T10:02:00Z", "replicasKept": 2}], None),
        ([suspended_at("2026-11-30T10:01:00")], [], "ts-1"),  # no zone: UTC
    ],
)
def test_a_regroup_is_superseded_only_by_a_stop_after_it_began(
    suspensions: list[dict[str, Any]], preemptions: list[dict[str, Any]], by: str | None
) -> None:
    status = {"timeSharing": {"suspensions": suspensions}}
    assert regroup.superseded(opened("abc"), status, preemptions) == by


def test_a_job_evicted_at_one_size_resumes_from_what_that_world_committed() -> None:
    # Evicted whole while it ran 2 ranks (the record says so); spec.replicas went to 3 while
    # it waited. Its 2 ranks committed step 8; no 3-rank world ever committed a step: the
    # resume restores 8, told the world that wrote it (rank 2 reads shard 0), not told no step.
    evicted = {
        "by": "ns/high",
        "priority": 500,
        "requestId": "abc",
        "evictedAt": "2026-11-30T10:00:00Z",
        "checkpoint": "Answered",
        "step": 8,
        "worldSize": 2,
    }
    low = job("low", 3, checkpoint=True, status={"preemptions": [evicted]})
    executor, memory = Recorder(), cyclestate.Memory()
    state = scheduler.Cycle(fixed_world(index(), [low]), memory, assuming.Assumed(), executor).state
    resuming = gangpods.resume_of(state, low)
    assert resuming == ("preempt-abc", 2, False)
    executor.inventories["uid-low"] = daemonclient.Inventory(
        tuple(held("uid-low", 8, r, f"n{r}") for r in range(2))
    )
    asyncio.run(gangpods.find_resume(state, low, "preempt-abc", resuming[1]))
    told = restore_codec.parse_restore(memory.resumes["uid-low"][1])
    assert told is not None
    assert (told.step, told.world, told.recovery) == (8, 2, "preempt-abc")


def test_a_regroup_deletes_each_old_rank_by_its_uid() -> None:
    """The delete carries the UID the cycle saw: a rank made again under its name since (the
    new world's pod) is another pod, and the API server refuses to delete it for the old."""
    seen = fixed_world(index(*running("e", 4, world=4)), [elastic(2)])
    executor = Recorder()

    cycle(seen, cyclestate.Memory(), executor)

    assert executor.deleted_uids == {f"ns/e-{r}": f"e-uid-{r}" for r in range(4)}
