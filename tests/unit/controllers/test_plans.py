"""The controllers' plans with no API server and no daemon (issue 12, "plan, then act"): each
test builds a read model by hand (tests/unit/worlds.py), runs the scheduling cycle, the
recovery pass or time-sharing on it with a recording executor (tests/unit/recorder.py), and
checks the actions it took — the pods created, reserved, bound, annotated and deleted, the
status written, the Events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import kubernetes
import pytest

from matrixpool.api import inferenceservice, labels
from matrixpool.controllers import daemons, timeshare
from matrixpool.controllers.recovery import controller as recovery
from matrixpool.controllers.recovery import detect
from matrixpool.controllers.recovery import memory as recovery_memory
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate, placement, preemption
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import daemonclient, pods
from matrixpool.state import assumed as assuming
from matrixpool.state import decisions as decided
from matrixpool.state import world
from matrixpool.state.workloads import Workload
from matrixpool_recovery import restore as restore_codec
from tests.unit.recorder import Recorder
from tests.unit.worlds import endpoint, fixed_world, held, index, job, pod, running, spare_swap_plan

# ---- the scheduling cycle --------------------------------------------------------------------
# (the cases of one run, world in → end state out: tests/unit/controllers/scheduling/test_cycle.py)


def cycle(seen: world.World, executor: Recorder, memory: cyclestate.Memory | None = None) -> None:
    asyncio.run(
        scheduler.Cycle(seen, memory or cyclestate.Memory(), assuming.Assumed(), executor).run()
    )


def test_pods_created_reserved_hold_their_cards_while_the_index_does_not_show_them() -> None:
    executor = Recorder()
    assumed = assuming.Assumed()
    memory = cyclestate.Memory()
    first, second = job("first", 2), job("second", 2)
    asyncio.run(
        scheduler.Cycle(fixed_world(assumed.view({}), [first]), memory, assumed, executor).run()
    )
    assert len(assumed.created) == 2
    # the watch has shown nothing yet: the first job's pods are in the view all the same
    seen = fixed_world(assumed.view({}), [first, second])
    assert {p.name for p in seen.pods["ns/first"]} == {"first-0", "first-1"}
    asyncio.run(scheduler.Cycle(seen, memory, assumed, executor).run())
    held = [(node, cards) for _, _, node, cards in executor.reserved]
    assert len(held) == len(set(held)) == 4, f"a card reserved twice: {held}"
    assert len([m for m in executor.created if m["metadata"]["name"].startswith("first")]) == 2


def test_a_new_gang_whose_pod_name_is_taken_is_not_bound() -> None:
    class Taken(Recorder):
        async def create_reserved(self, manifests: Any) -> Any:
            answers = await super().create_reserved(manifests)
            return [
                (None, pods.AlreadyExistsError("a-1")) if f and f.name == "a-1" else (f, o)
                for f, o in answers
            ]

    executor = Taken()
    cycle(fixed_world({}, [job("a", 2)]), executor)
    assert executor.bound_to == {}, "a gang with a pod of unknown state waits for the index"


def test_a_cycle_binds_at_most_its_pods_and_leaves_the_other_gangs_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PODS_PER_CYCLE: the gangs past it are neither placed nor given waiting pods nor a
    reason; the memory says more is left, and the next cycle places them, in order."""
    monkeypatch.setattr(placement, "PODS_PER_CYCLE", 3)
    jobs = [job("a", 2), job("b", 2), job("c", 2), job("d", 1)]
    memory, executor = cyclestate.Memory(), Recorder()
    cycle(fixed_world({}, jobs, nodes=8), executor, memory)
    assert sorted(executor.bound_to) == ["ns/a-0", "ns/a-1", "ns/b-0", "ns/b-1"], "b still goes"
    assert sorted(m["metadata"]["name"] for m in executor.created) == ["a-0", "a-1", "b-0", "b-1"]
    assert memory.deferred
    assert not executor.reasons("c")
    assert not executor.reasons("d")
    later = Recorder()
    bound = index(*running("a", 2), *running("b", 2, first_node=2))
    cycle(fixed_world(bound, jobs, nodes=8), later, memory)
    assert sorted(later.bound_to) == ["ns/c-0", "ns/c-1", "ns/d-0"]
    assert not memory.deferred


class Slow(Recorder):
    """An API server that takes ``seconds`` for each gang's Bindings (all gangs at once)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def bind(self, bindings: Any) -> list[Any]:
        await asyncio.sleep(self.seconds)
        return await super().bind(bindings)


def test_a_slow_api_server_makes_the_next_cycle_bind_fewer_pods() -> None:
    """Memory.bind_rate: the pods a binding cycle of at least RATE_SAMPLE_PODS wrote per
    second; the next cycle binds what that pace writes in BIND_TARGET_SECONDS."""
    jobs = [job(f"j{i:02d}", 1) for i in range(60)]
    memory = cyclestate.Memory()
    assert placement.pod_budget(memory) == placement.PODS_PER_CYCLE
    first = Slow(0.5)  # 48 one-pod gangs in parallel, 0.5 s: ~96 pods a second
    began = time.monotonic()
    cycle(fixed_world({}, jobs[:48], nodes=64), first, memory)
    whole = time.monotonic() - began  # the binding took part of it: the pace is at least this
    assert len(first.bound_to) == 48
    assert memory.bind_rate is not None
    assert 48 / whole <= memory.bind_rate <= 48 / 0.5  # at most as fast as the sleep allows
    memory.bind_rate = 40.0  # as a slower server would have set it
    assert placement.pod_budget(memory) == 40
    later = Recorder()
    cycle(fixed_world({}, jobs[:48], nodes=64), later, memory)
    assert len(later.bound_to) == 40
    assert memory.deferred
    memory.bind_rate = 3.0  # never fewer than MIN_PODS_PER_CYCLE
    assert placement.pod_budget(memory) == placement.MIN_PODS_PER_CYCLE
    memory.bind_rate = 10_000.0  # never more than PODS_PER_CYCLE
    assert placement.pod_budget(memory) == placement.PODS_PER_CYCLE


def test_a_binding_cycle_of_a_few_pods_leaves_the_pace_as_it_was() -> None:
    memory = cyclestate.Memory(bind_rate=50.0)
    cycle(fixed_world({}, [job("a", 2)], nodes=8), Slow(1.0), memory)
    assert memory.bind_rate == 50.0  # 2 pods in 1 s say how long a call takes, not the pace


class Refusing(Recorder):
    """An API server whose RBAC refuses every Binding (the rule was taken out)."""

    async def bind(self, bindings: Any) -> list[Any]:
        refusal = kubernetes.client.ApiException(status=403, reason="Forbidden")
        refusal.body = (
            '{"message": "pods is forbidden: User \\"system:serviceaccount:matrixpool-system:'
            'matrixpool\\" cannot create resource \\"pods/binding\\""}'
        )
        return [refusal] * len(bindings)


def test_a_binding_refused_by_rbac_says_so_in_the_condition_and_an_event() -> None:
    executor = Refusing()
    a = job("a", 2)
    cycle(fixed_world(index(*(pod(f"a-{r}", f"u{r}") for r in range(2))), [a]), executor)
    (conditions,) = executor.status_of("a", "conditions")[-1:]
    scheduled = next(c for c in conditions if c["type"] == "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Forbidden"), scheduled
    assert "ClusterRole" in scheduled["message"], scheduled
    assert 'cannot create resource "pods/binding"' in scheduled["message"], scheduled
    assert "Forbidden" in executor.reasons("a")


def test_a_create_refused_because_the_namespace_goes_is_no_rbac_refusal() -> None:
    """A namespace being deleted answers 403 too, with the NamespaceTerminating cause: no
    ClusterRole is missing, so no Forbidden condition and no hint at one."""
    going = kubernetes.client.ApiException(status=403, reason="Forbidden")
    going.body = json.dumps(
        {
            "message": 'pods "a-0" is forbidden: unable to create new content in namespace ns '
            "because it is being terminated",
            "details": {
                "causes": [
                    {"type": "NamespaceTerminating", "message": "namespace ns is being terminated"}
                ]
            },
        }
    )
    assert k8s_client.forbidden(going) is None
    rbac = kubernetes.client.ApiException(status=403, reason="Forbidden")
    rbac.body = '{"message": "pods is forbidden: cannot create resource"}'
    assert k8s_client.forbidden(rbac) == "pods is forbidden: cannot create resource"
    assert k8s_client.forbidden(kubernetes.client.ApiException(status=409)) is None


def test_a_jobs_own_grace_overrides_its_supernodes() -> None:
    running_pod = fixed_world(index(*running("saver", 1)), [])
    own = job("saver", 1, checkpoint=True)
    own.model.spec.checkpoint.grace_seconds = 5  # type: ignore[union-attr]
    busy = cyclestate.CycleState(running_pod, cyclestate.Memory())
    assert preemption.checkpoint_grace(busy, own) == 5.0


# ---- recovery --------------------------------------------------------------------------------


def recover(seen: world.World, executor: Recorder, state: recovery_memory.State) -> None:
    asyncio.run(recovery.run(seen, state, executor))


def test_a_failed_pod_is_recovered_in_place_from_the_newest_step_every_rank_holds() -> None:
    executor = Recorder()
    a = job("a", 2, checkpoint=True)
    executor.inventories["uid-a"] = daemonclient.Inventory(
        (
            *(held("uid-a", s, r, f"n{r}") for s in (4, 6) for r in (0, 1)),
            held("uid-a", 8, 0, "n0"),  # rank 1 never committed step 8
        )
    )
    pods = running("a", 2)
    pods[1] = dataclasses.replace(pods[1], phase="Failed")
    seen = fixed_world(index(*pods), [a])
    recover(seen, executor, recovery_memory.State())
    (plan,) = executor.status_of("a", "recovering")
    assert (plan["level"], plan["restoredStep"]) == ("InPlace", 6), plan
    assert plan["targets"] == {"1": "n1"}
    assert seen.decisions.recovering["uid-a"].wire() == plan, "the plan is in the read model too"
    assert executor.deleted_at_once == ["ns/a-1"], "a failed pod goes without grace"
    ((reloaded, annotations),) = executor.annotated
    told = restore_codec.parse_restore(annotations[labels.RESTORE])
    assert reloaded == "ns/a-0"
    assert told is not None
    assert (told.step, told.recovery) == (6, plan["id"])
    pinned = ("uid-a", ("10.0.0.0:7040", "10.0.0.1:7040"), 6)
    assert executor.pins == [pinned], "the step is pinned on both holders first"
    assert "Recovering" in executor.reasons("a")


def test_a_lost_node_swaps_in_a_spare_and_its_rank_restores_from_a_peer_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(detect, "SETTLE_SECONDS", 0.0)
    executor = Recorder()
    a = job("a", 2, checkpoint=True)
    executor.inventories["uid-a"] = daemonclient.Inventory(
        (held("uid-a", 6, 0, "n0"), held("uid-a", 6, 1, "n0"))  # n0 keeps rank 1's peer copy
    )
    seen = fixed_world(index(*running("a", 2)), [a], spares=1, down=frozenset({"n1"}))
    recover(seen, executor, recovery_memory.State())
    (plan,) = executor.status_of("a", "recovering")
    assert (plan["level"], plan["restoredStep"]) == ("SpareSwap", 6), plan
    (spare,) = plan["targets"].values()
    assert spare not in ("n0", "n1"), plan
    assert executor.deleted_at_once == ["ns/a-1"], "the rank on the lost node goes at once"
    assert "n1" not in {n for _, asked in executor.asked for n in asked}, "a lost node is not asked"


def test_a_rank_on_a_node_whose_kubelet_went_silent_is_deleted_without_grace() -> None:
    """The node's Lease is stale but its Node still says Ready (the controller-manager marks it
    later): a graceful delete would wait for a kubelet that is gone, and with it the new pod.
    Found on a real node whose kubelet was stopped (tests/realnodes)."""
    executor = Recorder()
    value = restore_codec.restore_value(6, [], "r1-abc", incarnation=9, of=1)
    plan = spare_swap_plan(value)
    a = job("a", 2, checkpoint=True, status={"recovering": plan})
    pods = running("a", 2)
    pods[1] = dataclasses.replace(pods[1], deleting=True)  # deleted with grace, never finished
    seen = fixed_world(index(*pods), [a], spares=1)
    seen = dataclasses.replace(seen, stale=frozenset({"n1"}))
    recover(seen, executor, recovery_memory.State())
    assert executor.deleted_at_once == ["ns/a-1"]


def test_a_job_out_of_recoveries_fails_with_the_reason() -> None:
    executor = Recorder()
    a = job("a", 2, checkpoint=True, recovery={"maxRecoveries": 1}, status={"recoveryCount": 1})
    executor.inventories["uid-a"] = daemonclient.Inventory(
        tuple(held("uid-a", 6, r, f"n{r}") for r in (0, 1))
    )
    pods = running("a", 2)
    pods[0] = dataclasses.replace(pods[0], phase="Failed")
    seen = fixed_world(index(*pods), [a])
    recover(seen, executor, recovery_memory.State())
    assert seen.decisions.failed["uid-a"][0] == "MaxRecoveriesReached"
    assert "MaxRecoveriesReached" in executor.reasons("a")
    assert executor.status_of("a", "recovering") == []
    assert executor.deleted_at_once == []


def test_a_recovery_is_recorded_once_every_rank_runs_the_restored_step() -> None:
    executor = Recorder()
    value = restore_codec.restore_value(6, [], "r1-abc", incarnation=9, of=1)
    plan = {
        "id": "r1-abc",
        "level": "InPlace",
        "cause": "PodFailed on n1",
        "restoredStep": 6,
        "lostSteps": 1,
        "detectedAt": "2026-11-30T10:00:00Z",
        "targets": {"1": "n1"},
        "restore": {"0-1": value},
        "pinned": ["10.0.0.0:7040"],
    }
    a = job("a", 2, checkpoint=True, status={"recovering": plan})
    seen = fixed_world(index(*running("a", 2, restore=value)), [a])
    recover(seen, executor, recovery_memory.State())
    (written,) = [s for s in executor.statuses if "recoveries" in s]
    assert written["recovering"] is None
    assert written["recoveryCount"] == 1
    (entry,) = written["recoveries"]
    assert (entry["id"], entry["restoredStep"]) == ("r1-abc", 6)
    assert "targets" not in entry
    assert entry["recoveredAt"]
    assert ("uid-a", ("10.0.0.0:7040",), None) in executor.pins, "the pin is let go"
    assert "Recovered" in executor.reasons("a")


# ---- time-sharing ----------------------------------------------------------------------------

ALL_DAY: dict[
    str, Any
] = {  # one window, all day: inference may take the whole SuperNode (4 nodes, 32 cards)
    "timezone": "UTC",
    "windows": [{"name": "busy", "start": "00:00", "end": "00:00", "inferenceCards": 32}],
    "checkpointGraceSeconds": 30,
}


def service(name: str, replicas: int) -> Workload:
    body = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {
            "superNode": "sn-a",
            "roles": [
                {"name": "serve", "replicas": replicas, "podsPerReplica": 1, "cardsPerPod": 8}
            ],
        },
    }
    model = inferenceservice.parse(body)
    return Workload("InferenceService", "ns", name, f"uid-{name}", "", 1, model, None, {})


def test_a_window_that_gives_inference_every_card_asks_training_to_checkpoint_then_suspends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(timeshare, "CHECK_SECONDS", 0.0)
    executor, memory = Recorder(), timeshare.Memory()
    a = job("a", 2, checkpoint=True)
    chat = service("chat", 4)
    executor.inventories["uid-a"] = daemonclient.Inventory(
        tuple(held("uid-a", 4, r, f"n{r}") for r in (0, 1))
    )
    seen = fixed_world(index(*running("a", 2)), [a, chat], time_sharing=ALL_DAY)

    async def passes(count: int) -> decided.Shares:
        shares = decided.Shares()
        for _ in range(count):
            shares = await timeshare.share(seen, memory, executor)
            await asyncio.sleep(0.01)  # the daemons are asked in the background
        return shares

    shares = asyncio.run(passes(2))
    asked = {pod: values[labels.CHECKPOINT_REQUEST] for pod, values in executor.annotated}
    assert set(asked) == {"ns/a-0", "ns/a-1"}
    assert len(set(asked.values())) == 1
    request = executor.status_of("a", "timeSharing")[0]["checkpointRequest"]
    assert request["baselineStep"] == 4
    assert request["replicas"] == 0
    assert shares.phases["ns/a"] == "Checkpointing"
    assert shares.training["ns/a"] == 2, "its pods stay until it answers"
    assert "CheckpointRequested" in executor.reasons("a")

    executor.inventories["uid-a"] = daemonclient.Inventory(  # the answer: step 6 on both ranks
        tuple(held("uid-a", s, r, f"n{r}") for s in (4, 6) for r in (0, 1))
    )
    shares = asyncio.run(passes(2))
    assert shares.training["ns/a"] == 0
    assert shares.phases["ns/a"] == "Suspended"
    (suspension,) = executor.status_of("a", "timeSharing")[-1]["suspensions"]
    assert (suspension["step"], suspension["answered"], suspension["worldSize"]) == (6, True, 2)
    assert "Suspended" in executor.reasons("a")


def suspended(request: str, *, world: int, step: int) -> dict[str, Any]:
    """The status of a job the window "busy" suspended at 09:00 with ``world`` ranks, having
    answered its checkpoint request at ``step``."""
    record = {
        "requestId": request,
        "window": "busy",
        "suspendedAt": "2026-11-30T09:00:00Z",
        "worldSize": world,
        "step": step,
        "answered": True,
    }
    return {"timeSharing": {"suspensions": [record]}}


def test_a_suspended_job_that_gets_cards_back_is_told_to_restore_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    executor, memory = Recorder(), timeshare.Memory()
    a = job("a", 2, checkpoint=True, status=suspended("ts-1", world=2, step=6))
    executor.inventories["uid-a"] = daemonclient.Inventory(
        tuple(held("uid-a", 6, r, f"n{r}") for r in (0, 1))
    )
    quiet = {**ALL_DAY, "windows": [{**ALL_DAY["windows"][0], "inferenceCards": 0}]}
    pending = index(pod("a-0", "new0"), pod("a-1", "new1"))
    seen = fixed_world(pending, [a], time_sharing=quiet)
    asyncio.run(timeshare.share(seen, memory, executor))
    told = {pod: restore_codec.parse_restore(v[labels.RESTORE]) for pod, v in executor.annotated}
    assert set(told) == {"ns/a-0", "ns/a-1"}
    assert all(t is not None and t.step == 6 and t.recovery == "resume-ts-1" for t in told.values())

    bound = index(*running("a", 2))
    asyncio.run(timeshare.share(fixed_world(bound, [a], time_sharing=quiet), memory, executor))
    (closed,) = executor.status_of("a", "timeSharing")[-1]["suspensions"]
    assert closed["restoredStep"] == 6
    assert closed["resumedAt"]
    assert "Resumed" in executor.reasons("a")


def test_a_job_suspended_at_another_size_is_told_the_world_that_wrote_its_step() -> None:
    # Suspended while it ran 2 of its 4 ranks (a window's allowance); the window that gives the
    # cards back allows all 4: ranks 2 and 3 read the shards of ranks 0 and 1 (world 2).
    executor, memory = Recorder(), timeshare.Memory()
    a = job("a", 4, checkpoint=True, status=suspended("ts-2", world=2, step=6))
    executor.inventories["uid-a"] = daemonclient.Inventory(
        tuple(held("uid-a", 6, r, f"n{r}") for r in (0, 1))
    )
    quiet = {**ALL_DAY, "windows": [{**ALL_DAY["windows"][0], "inferenceCards": 0}]}
    pending = index(*(pod(f"a-{r}", f"new{r}") for r in range(4)))
    asyncio.run(timeshare.share(fixed_world(pending, [a], time_sharing=quiet), memory, executor))
    told = {pod: restore_codec.parse_restore(v[labels.RESTORE]) for pod, v in executor.annotated}
    assert set(told) == {f"ns/a-{r}" for r in range(4)}
    assert {(t.step, t.world) for t in told.values() if t is not None} == {(6, 2)}
    assert [restore_codec.shard_for(r, 2) for r in range(4)] == [0, 1, 0, 1]


# ---- tier-1 peers (controllers.daemons) ------------------------------------------------------


def test_every_daemon_is_told_peers_in_another_rack_as_many_as_its_jobs_copy_to() -> None:
    executor, memory = Recorder(), daemons.Memory()
    seen = fixed_world({}, [])  # n0, n1 in rack-0; n2, n3 in rack-1
    rack = {endpoint(f"n{i}"): i // 2 for i in range(4)}

    async def told() -> dict[str, list[str]]:
        daemons.run(seen, {}, memory, executor, {})
        await asyncio.sleep(0.01)  # told in the background
        return executor.peers

    first = asyncio.run(told())
    assert set(first) == set(rack), "every daemon"
    assert all(len(p) == 1 and rack[p[0]] != rack[d] for d, p in first.items()), first

    copied = job("a", 2, checkpoint=True)
    copied.model.spec.checkpoint.memory.peer_replicas = 2  # type: ignore[union-attr]
    seen = fixed_world({}, [copied])
    second = asyncio.run(told())
    assert all(len(p) == 2 for p in second.values()), second
    assert all(rack[p[0]] != rack[d] for d, p in second.items()), second


def test_a_daemon_that_started_again_or_did_not_answer_is_told_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    executor, memory = Recorder(), daemons.Memory()
    executor.healthy[endpoint("n3")] = False  # refuses the list
    seen = fixed_world({}, [])

    async def once(started: dict[str, float]) -> None:
        daemons.run(seen, {}, memory, executor, started)
        await asyncio.sleep(0.01)

    asyncio.run(once({}))
    assert endpoint("n3") not in executor.peers
    executor.peers.clear()
    executor.healthy[endpoint("n3")] = True
    asyncio.run(once({}))
    assert executor.peers == {}, "a daemon that refused is not asked again at once"
    monkeypatch.setattr(memory.peers, "retry_seconds", 0.0)
    asyncio.run(once({"n1": 5.0}))  # n1's daemon restarted (its Lease's acquireTime moved)
    assert set(executor.peers) == {endpoint("n1"), endpoint("n3")}, "only those two again"
    executor.peers.clear()
    asyncio.run(once({"n1": 5.0}))
    assert executor.peers == {}, "nothing changed: nobody is told"
