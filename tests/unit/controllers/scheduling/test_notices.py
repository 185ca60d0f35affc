"""What used to go unsaid about a running workload (issue 32, item 5), from the cycle's side: a
checkpointing job on nodes with no announced daemon, and a job whose SuperNode was deleted under
it, get a False condition and one Warning Event; the condition turns True once it is mended, and
a job that never had the problem carries no such condition. No API server
(tests/unit/recorder.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from matrixpool.api.inferenceservice import parse
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.state import assumed as assuming
from matrixpool.state import world
from matrixpool.state.workloads import Workload
from tests.unit.recorder import Recorder
from tests.unit.worlds import EIGHT, fixed_world, index, job, pod, running


def cycle(seen: world.World, memory: cyclestate.Memory, executor: Recorder) -> None:
    asyncio.run(scheduler.Cycle(seen, memory, assuming.Assumed(), executor).run())


def condition(executor: Recorder, name: str, type_: str) -> dict[str, Any] | None:
    written = executor.status_of(name, "conditions")
    return next((c for c in written[-1] if c["type"] == type_), None) if written else None


def without_daemons(seen: world.World, *nodes: str) -> world.World:
    quiet = [dataclasses.replace(n, endpoint="") if n.name in nodes else n for n in seen.nodes]
    return dataclasses.replace(seen, nodes=quiet)


def test_a_checkpointing_job_on_nodes_without_a_daemon_says_so_once_then_resolved() -> None:
    saving = job("saving", 2, checkpoint=True)
    announced = fixed_world(index(*running("saving", 2)), [saving])
    executor, memory = Recorder(), cyclestate.Memory()

    cycle(without_daemons(announced, "n1"), memory, executor)
    cycle(without_daemons(announced, "n1"), memory, executor)

    found = condition(executor, "saving", "CheckpointDaemons")
    assert found is not None
    assert found["status"] == "False"
    assert found["reason"] == "NoCheckpointDaemons"
    assert "node(s) n1 of its pods have no announced checkpoint daemon" in found["message"]
    assert executor.reasons("saving").count("NoCheckpointDaemons") == 1  # told once
    assert executor.deleted == []  # nothing is done to the pods

    cycle(announced, memory, executor)
    found = condition(executor, "saving", "CheckpointDaemons")
    assert found is not None
    assert (found["status"], found["reason"]) == ("True", "Resolved")


def test_a_job_without_checkpoints_or_with_daemons_carries_no_such_condition() -> None:
    plain, saving = job("plain", 1), job("saving", 1, checkpoint=True)
    facts = index(*running("plain", 1), *running("saving", 1, first_node=1))
    executor = Recorder()

    cycle(without_daemons(fixed_world(facts, [plain, saving]), "n0"), cyclestate.Memory(), executor)

    assert condition(executor, "plain", "CheckpointDaemons") is None
    assert condition(executor, "saving", "CheckpointDaemons") is None
    assert "NoCheckpointDaemons" not in executor.reasons()


def test_a_job_whose_supernode_is_deleted_keeps_its_pods_and_says_so() -> None:
    training = job("training", 2)
    seen = fixed_world(index(*running("training", 2)), [training])
    executor, memory = Recorder(), cyclestate.Memory()

    cycle(dataclasses.replace(seen, supernodes={}), memory, executor)

    found = condition(executor, "training", "SuperNode")
    assert found is not None
    assert (found["status"], found["reason"]) == ("False", "SuperNodeDeleted")
    assert "spec.superNode sn-a was deleted" in found["message"]
    assert "time-sharing" in found["message"]
    assert executor.reasons("training") == ["SuperNodeDeleted"]
    assert executor.deleted == []

    cycle(seen, memory, executor)
    found = condition(executor, "training", "SuperNode")
    assert found is not None
    assert (found["status"], found["reason"]) == ("True", "Resolved")


def test_an_inference_service_whose_supernode_is_deleted_says_so_too() -> None:
    body = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ns", "uid": "uid-chat"},
        "spec": {
            "superNode": "sn-a",
            "roles": [{"name": "serve", "replicas": 1, "podsPerReplica": 1, "cardsPerPod": 8}],
        },
    }
    chat = Workload("InferenceService", "ns", "chat", "uid-chat", "t0", 1, parse(body), None, {})
    serving = pod(
        "chat-serve-0-0",
        "chat-uid-0",
        owner="chat",
        kind="InferenceService",
        role="serve",
        rank=0,
        node="n0",
        cards=EIGHT,
        phase="Running",
    )
    seen = fixed_world(index(serving), [chat])
    executor = Recorder()

    cycle(dataclasses.replace(seen, supernodes={}), cyclestate.Memory(), executor)

    found = condition(executor, "chat", "SuperNode")
    assert found is not None
    assert (found["status"], found["reason"]) == ("False", "SuperNodeDeleted")
    assert "autoscaler's cap" in found["message"]
    assert executor.reasons("chat") == ["SuperNodeDeleted"]
    assert executor.deleted == []
