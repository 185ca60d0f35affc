"""Identity by UID and incarnations on the operator side (issue 11, defects 1 and 2): the
restore annotation's incarnation fields, new incarnation numbers, the orphan sweep's rule,
and forgetting a workload whose name now belongs to another object."""

from __future__ import annotations

import asyncio
import datetime

import pytest

from matrixpool.controllers import cleanup, loop
from matrixpool.k8s import daemonclient
from matrixpool.state.workloads import Workload
from matrixpool_recovery import manifest
from matrixpool_recovery import restore as restore_codec
from tests.unit.recorder import Recorder

NOW = datetime.datetime(2026, 11, 30, 12, 0, tzinfo=datetime.UTC)


def held(step: int, incarnation: int, rank: int = 0) -> manifest.Holding:
    return manifest.Holding("uid-1", rank, step, "memory", 8, "crc32:0", "n1", "n1", incarnation)


def test_the_restore_annotation_names_the_new_run_and_the_run_that_wrote_the_step() -> None:
    value = restore_codec.restore_value(40, ["b:1"], "r2", incarnation=9, of=7)
    parsed = restore_codec.parse_restore(value)
    assert parsed == restore_codec.Restore(40, ("b:1",), "r2", incarnation=9, of=7)


def test_a_restore_annotation_without_incarnations_still_reads() -> None:
    assert restore_codec.parse_restore('{"step":3,"from":[]}') == restore_codec.Restore(3)


@pytest.mark.parametrize(
    "bad", ['{"incarnation":-1}', '{"of":"7","step":1}', '{"incarnation":1.5}']
)
def test_a_bad_incarnation_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="whole number"):
        restore_codec.parse_restore(bad)


def test_a_new_incarnation_is_above_every_one_the_shards_carry() -> None:
    past = daemonclient.Inventory((held(1, 10**15),))
    assert past.new_incarnation(NOW) == 10**15 + 1
    assert daemonclient.Inventory().new_incarnation(NOW) == int(NOW.timestamp() * 1000)


def test_the_inventory_names_the_run_that_wrote_a_step_on_the_newest_timeline() -> None:
    found = daemonclient.Inventory((held(5, 1), held(3, 2), held(3, 1, rank=1)))
    assert found.incarnation_of(3) == 2
    assert found.incarnation_of(5) is None  # past run 2's start: abandoned
    assert found.incarnation_of(9) is None


def test_an_unknown_job_is_deleted_only_the_second_time_it_is_seen() -> None:
    delete, remember = cleanup.orphans({"a", "b", "c"}, {"a"}, set())
    assert (delete, remember) == (set(), {"b", "c"})
    delete, remember = cleanup.orphans({"a", "b", "d"}, {"a"}, remember)
    assert (delete, remember) == ({"b"}, {"d"})


def workload(uid: str) -> Workload:
    return Workload("TrainingJob", "ns", "llm", uid, "", 1, None, None, {})


def test_a_job_created_again_under_its_name_starts_clean() -> None:
    state = loop.Controllers()
    first = workload("uid-1")
    state.decisions.failed[first.uid] = ("MaxRecoveriesReached", "too many")
    state.decisions.replicas[first.uid] = 3
    state.recoveries.deferred[first.uid] = 1.0
    state.sharing.status[first.uid] = {"checkpointRequest": None}
    state.cycle.statuses[first.uid] = {"phase": "Failed"}
    state.forget_replaced([first])
    assert state.decisions.failed[first.uid][0] == "MaxRecoveriesReached"  # same object: kept
    state.forget_replaced([first])
    assert first.uid in state.decisions.failed
    state.forget_replaced([workload("uid-2")])
    assert first.uid not in state.decisions.failed
    assert first.uid not in state.decisions.replicas
    assert first.uid not in state.recoveries.deferred
    assert first.uid not in state.sharing.status
    assert first.uid not in state.cycle.statuses


def test_the_controllers_and_the_state_keep_no_module_level_mutable_state() -> None:
    """Everything the controllers remember lives in the loop's Controllers (issue 12): no
    module of controllers/ or state/ holds an instance of their classes or a mutable
    container (but the anchor's label selector, a constant kopf reads)."""
    import importlib
    import pkgutil

    import matrixpool.controllers
    import matrixpool.state

    modules = [
        importlib.import_module(info.name)
        for package in (matrixpool.controllers, matrixpool.state)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    ]
    assert len(modules) >= 15
    for module in modules:
        found = [
            name
            for name, value in vars(module).items()
            if not name.startswith("__")
            and name != "LABEL"
            and (
                isinstance(value, dict | list | set)
                or type(value).__module__.startswith(("matrixpool.controllers", "matrixpool.state"))
            )
        ]
        assert not found, f"{module.__name__} keeps module-level state: {found}"


def test_the_sweep_deletes_through_the_executor_a_job_held_twice_that_no_trainingjob_has() -> None:
    """The checkpoint sweep acts only through the executor it is given: the first sweep
    remembers an unknown job, the second deletes it from the daemons holding it."""
    act = Recorder(held={"gone-uid": {"127.0.0.1:7040"}, "live-uid": {"127.0.0.1:7040"}})
    sweeper = cleanup.Sweeper()

    async def sweep() -> None:
        await cleanup.sweep_once(sweeper, ["127.0.0.1:7040"], {"live-uid"}, act)

    asyncio.run(sweep())
    assert act.checkpoints_deleted == [], "one look is not enough"
    assert sweeper.orphans == {"gone-uid"}
    asyncio.run(sweep())
    assert act.checkpoints_deleted == [("gone-uid", ("127.0.0.1:7040",))]
    assert act.held == {"live-uid": {"127.0.0.1:7040"}}
