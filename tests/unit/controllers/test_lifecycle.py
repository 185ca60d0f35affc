"""The end of a TrainingJob's life and its restart from step 0 (issue 13, "Lifecycle"), with no
API server: read models built by hand (tests/unit/worlds.py), the loop's controllers run on them
with a recording executor (tests/unit/recorder.py).

* every rank's pod Succeeded → the job Succeeded (never back), pods kept, no card held, not
  recovered, not time-shared; ``spec.ttlSecondsAfterFinished`` later the pods go;
* a fault on a job with no checkpoint yet restarts it from step 0, recorded as such.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Any

import pytest

from matrixpool import clock
from matrixpool.api import crdgen, labels, trainingjob
from matrixpool.controllers import cleanup, lifecycle, timeshare
from matrixpool.controllers.recovery import carry_out, detect
from matrixpool.controllers.recovery import controller as recovery
from matrixpool.controllers.recovery import memory as recovery_memory
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.k8s import daemonclient
from matrixpool.state import assumed as assuming
from matrixpool.state import world
from matrixpool_recovery import restore as restore_codec
from tests.unit.recorder import Recorder
from tests.unit.worlds import fixed_world, held, index, job, pod, running

LONG_AGO = "2026-01-01T00:00:00Z"


def finished(name: str, ranks: int, first_node: int = 0) -> list[Any]:
    """The pods of a job whose every rank exited 0."""
    return [dataclasses.replace(p, phase="Succeeded") for p in running(name, ranks, first_node)]


def cycle(seen: world.World, executor: Recorder) -> None:
    asyncio.run(scheduler.Cycle(seen, cyclestate.Memory(), assuming.Assumed(), executor).run())


def recover(seen: world.World, executor: Recorder) -> None:
    asyncio.run(recovery.run(seen, recovery_memory.State(), executor))


def done_status(**extra: Any) -> dict[str, Any]:
    return {"phase": "Succeeded", "completionTime": LONG_AGO, **extra}


# ---- Succeeded ---------------------------------------------------------------------------------


def test_a_job_whose_every_rank_exited_0_succeeds_once_with_an_event() -> None:
    executor = Recorder()
    a = job("a", 2)
    seen = fixed_world(index(*finished("a", 2)), [a])
    lifecycle.observe(seen, executor)
    assert world.succeeded(seen, a)
    assert executor.reasons("a") == ["Succeeded"]
    lifecycle.observe(seen, executor)
    assert executor.reasons("a") == ["Succeeded"], "one Event, not one per pass"


def test_the_status_of_a_finished_job_says_succeeded_and_holds_no_card() -> None:
    executor = Recorder()
    a = job("a", 2)
    seen = fixed_world(index(*finished("a", 2)), [a])
    lifecycle.observe(seen, executor)
    cycle(seen, executor)
    (status,) = [s for s in executor.statuses if s["name"] == "a"]
    assert status["phase"] == "Succeeded"
    assert status["completionTime"].endswith("Z")
    assert status["replicas"] == {"desired": 2, "bound": 0, "running": 0}
    assert status["placement"].get("cards", 0) == 0
    complete = next(c for c in status["conditions"] if c["type"] == "Complete")
    assert (complete["status"], complete["reason"]) == ("True", "AllRanksSucceeded")
    assert (executor.created, executor.deleted) == ([], []), "its pods stay as they are"
    trainingjob.parse_status(status)  # the API schema accepts it


def test_a_finished_jobs_cards_go_to_the_next_gang_and_its_pods_stay() -> None:
    executor = Recorder()
    a = job("a", 4, status=done_status())
    b = job("b", 4)
    waiting = [pod(f"b-{r}", f"b{r}") for r in range(4)]
    seen = fixed_world(index(*finished("a", 4), *waiting), [a, b])
    assert world.holdings(seen) == [], "a finished job holds nothing"
    cycle(seen, executor)
    assert set(executor.bound_to) == {f"ns/b-{r}" for r in range(4)}, "b takes every card"
    assert not [n for n in executor.deleted + executor.created if "a-" in str(n)]


def test_it_never_goes_back_even_when_its_pods_are_gone() -> None:
    executor = Recorder()
    a = job("a", 2, status=done_status())
    seen = fixed_world({}, [a])
    cycle(seen, executor)
    assert executor.created == [], "a finished job is not started again"
    assert executor.status_of("a", "phase") == ["Succeeded"]
    assert executor.status_of("a", "completionTime") == [LONG_AGO]


def test_a_rank_that_finished_first_is_no_fault_and_the_job_runs_on() -> None:
    executor = Recorder()
    a = job("a", 2, checkpoint=True)
    pods = running("a", 2)
    pods[0] = dataclasses.replace(pods[0], phase="Succeeded")
    seen = fixed_world(index(*pods), [a])
    lifecycle.observe(seen, executor)
    recover(seen, executor)
    cycle(seen, executor)
    assert not world.succeeded(seen, a)
    assert executor.status_of("a", "recovering") == []
    assert executor.status_of("a", "phase") == ["Running"]
    assert len(world.holdings(seen)) == 2, "its cards stay held until every rank finished"


def test_ranks_that_finished_restart_too_when_another_fails() -> None:
    pods = running("a", 3)
    pods[0] = dataclasses.replace(pods[0], phase="Succeeded")
    pods[2] = dataclasses.replace(pods[2], phase="Failed")
    faults = detect.detect(3, pods, {n.name: n for n in fixed_world({}, []).nodes}, ())
    assert {r for f in faults for r in f.ranks} == {0, 2}


def test_recovery_and_time_sharing_leave_a_finished_job_alone() -> None:
    executor = Recorder()
    a = job("a", 2, status=done_status())
    pods = finished("a", 2)
    pods[1] = dataclasses.replace(pods[1], phase="Failed")  # whatever its pods show later
    every_card = {
        "timezone": "UTC",
        "windows": [{"name": "busy", "start": "00:00", "end": "00:00", "inferenceCards": 32}],
        "checkpointGraceSeconds": 30,
    }
    seen = fixed_world(index(*pods), [a], time_sharing=every_card)
    recover(seen, executor)
    shares = asyncio.run(timeshare.share(seen, timeshare.Memory(), executor))
    assert (executor.statuses, executor.annotated, executor.asked) == ([], [], [])
    assert "ns/a" not in shares.training
    assert "ns/a" not in shares.phases


@pytest.mark.parametrize(
    ("ttl", "gone"),
    [
        pytest.param(None, False, id="without a ttl the pods stay"),
        pytest.param(60, True, id="once the ttl passed the pods are deleted"),
        pytest.param(10**7, False, id="before the ttl passed the pods stay"),
    ],
)
def test_the_pods_of_a_finished_job_go_after_its_ttl(ttl: int | None, gone: bool) -> None:
    executor = Recorder()
    fields = {} if ttl is None else {"ttlSecondsAfterFinished": ttl}
    completed = clock.SYSTEM.now() - datetime.timedelta(days=30)
    stamp = completed.isoformat().replace("+00:00", "Z")
    a = job("a", 2, status=done_status(completionTime=stamp), **fields)
    cycle(fixed_world(index(*finished("a", 2)), [a]), executor)
    assert sorted(executor.deleted) == (["ns/a-0", "ns/a-1"] if gone else [])
    assert ("PodsDeleted" in executor.reasons("a")) == gone
    assert executor.status_of("a", "phase") == ["Succeeded"], "the job itself stays"


@pytest.mark.parametrize(
    ("ttl", "released"),
    [
        pytest.param(None, False, id="without a ttl tiers 1 and 2 stay"),
        pytest.param(60, True, id="once the ttl passed they go with the pods"),
        pytest.param(10**7, False, id="before the ttl passed they stay"),
    ],
)
def test_the_tier_1_and_2_steps_of_a_finished_job_go_after_its_ttl(
    ttl: int | None, released: bool
) -> None:
    """Issue 31, finding 8: the step a finished job kept on tier 1 is protected from eviction;
    past its ttl the sweep drops its tiers 1 and 2 as an orphan's (two sweeps in a row)."""
    executor = Recorder()
    fields = {} if ttl is None else {"ttlSecondsAfterFinished": ttl}
    completed = clock.SYSTEM.now() - datetime.timedelta(days=30)
    stamp = completed.isoformat().replace("+00:00", "Z")
    a = job("a", 2, status=done_status(completionTime=stamp), **fields)
    seen = fixed_world(index(*finished("a", 2)), [a])
    endpoints = sorted(n.endpoint for n in seen.nodes if n.endpoint)
    executor.held = {a.uid: set(endpoints)}
    sweeper = cleanup.Sweeper()
    now = clock.SYSTEM.now()

    async def sweeps() -> None:
        for _ in range(2):
            sweeper.last = float("-inf")
            cleanup.sweep(
                sweeper,
                seen.nodes,
                seen.workloads,
                executor,
                lambda w: lifecycle.past_ttl(seen, w, now),
            )
            assert sweeper.task is not None
            await sweeper.task

    asyncio.run(sweeps())
    deleted = [job for job, _ in executor.checkpoints_deleted]
    assert deleted == ([a.uid] if released else [])


def test_the_ttl_is_bounded_and_described_in_the_schema() -> None:
    crd = crdgen.crd(trainingjob.RESOURCE)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = crd["properties"]["spec"]["properties"]["ttlSecondsAfterFinished"]
    assert field["minimum"] == 0
    assert field["maximum"] == trainingjob.MAX_TTL_SECONDS
    assert "TrainingJob itself stays" in " ".join(field["description"].split())


# ---- no checkpoint yet: restart from step 0 -----------------------------------------------------


def test_a_failed_pod_of_a_job_with_no_checkpoint_restarts_in_place_from_step_0() -> None:
    executor = Recorder()  # the daemons hold nothing of the job
    a = job("a", 2)
    pods = running("a", 2)
    pods[1] = dataclasses.replace(pods[1], phase="Failed")
    seen = fixed_world(index(*pods), [a])
    recover(seen, executor)
    (plan,) = executor.status_of("a", "recovering")
    assert plan["level"] == "InPlace"
    assert plan["fromScratch"] is True
    assert "restoredStep" not in plan
    assert "lostSteps" not in plan
    assert executor.deleted_at_once == ["ns/a-1"]
    assert executor.pins == [], "no step to pin"
    (told,) = {restore_codec.parse_restore(v) for v in plan["restore"].values()}
    assert told is not None
    assert (told.fresh, told.step, told.recovery) == (True, None, plan["id"])
    assert told.incarnation is not None, "the restart is a new incarnation"
    ((reloaded, annotations),) = executor.annotated
    assert reloaded == "ns/a-0", "the rank still running starts over too"
    assert restore_codec.parse_restore(annotations[labels.RESTORE]) == told
    (_, _, _, message) = next(e for e in executor.events if e[2] == "Recovering")
    assert carry_out.FRESH in message


def test_the_new_pod_of_a_restart_from_step_0_is_told_to_start_fresh() -> None:
    executor = Recorder()
    a = job("a", 2)
    pods = running("a", 2)
    pods[1] = dataclasses.replace(pods[1], phase="Failed")
    seen = fixed_world(index(*pods), [a])
    recover(seen, executor)
    (plan,) = executor.status_of("a", "recovering")
    pods_now = index(pods[0])  # the failed pod is gone; the cycle creates rank 1 again
    cycle(dataclasses.replace(seen, pods=pods_now), executor)  # the plan is a decision
    (new,) = [m for m in executor.created if m["metadata"]["name"] == "a-1"]
    told = restore_codec.parse_restore(new["metadata"]["annotations"][labels.RESTORE])
    assert told is not None
    assert (told.fresh, told.recovery) == (True, plan["id"])
    assert new["metadata"]["annotations"][labels.CARDS] == "0,1,2,3,4,5,6,7"


def test_a_restart_from_step_0_is_recorded_as_such() -> None:
    executor = Recorder()
    fresh = restore_codec.restore_value(None, (), "r1-abc", incarnation=9, fresh=True)
    plan = {
        "id": "r1-abc",
        "level": "InPlace",
        "cause": "PodFailed on n1",
        "fromScratch": True,
        "detectedAt": "2026-11-30T10:00:00Z",
        "targets": {"1": "n1"},
        "restore": {"0-1": fresh},
    }
    a = job("a", 2, status={"recovering": plan})
    recover(fixed_world(index(*running("a", 2, restore=fresh)), [a]), executor)
    (written,) = [s for s in executor.statuses if "recoveries" in s]
    (entry,) = written["recoveries"]
    assert entry["fromScratch"] is True
    assert "restoredStep" not in entry
    trainingjob.parse_status(written)
    (_, _, _, message) = next(e for e in executor.events if e[2] == "Recovered")
    assert carry_out.FRESH in message


def test_a_job_whose_committed_step_is_lost_everywhere_still_fails() -> None:
    executor = Recorder()
    a = job("a", 2, checkpoint=True, status={"checkpoints": {"memory": 6}})
    pods = running("a", 2)
    pods[1] = dataclasses.replace(pods[1], phase="Failed")
    seen = fixed_world(index(*pods), [a])
    recover(seen, executor)
    assert executor.status_of("a", "recovering") == []
    assert seen.decisions.failed["uid-a"][0] == "RecoveryImpossible"


def test_a_job_with_shards_but_no_common_step_still_fails() -> None:
    executor = Recorder()
    a = job("a", 2, checkpoint=True)
    executor.inventories["uid-a"] = daemonclient.Inventory((held("uid-a", 2, 0, "n0"),))
    pods = running("a", 2)
    pods[1] = dataclasses.replace(pods[1], phase="Failed")
    seen = fixed_world(index(*pods), [a])
    recover(seen, executor)
    assert seen.decisions.failed["uid-a"][0] == "RecoveryImpossible"


# ---- the restore annotation's fresh start --------------------------------------------------------


def test_a_fresh_start_round_trips_through_the_annotation() -> None:
    value = restore_codec.restore_value(None, (), "r2", incarnation=9, fresh=True)
    assert restore_codec.parse_restore(value) == restore_codec.Restore(
        None, (), "r2", 9, None, True
    )
    assert restore_codec.parse_restore('{"step":3,"from":[]}').fresh is False  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad", ['{"fresh":true,"step":3,"from":[]}', '{"fresh":"yes","from":[]}'], ids=str
)
def test_a_fresh_start_with_a_step_or_not_a_boolean_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="fresh"):
        restore_codec.parse_restore(bad)
    with pytest.raises(ValueError, match="fresh"):
        restore_codec.restore_value(3, fresh=True)
