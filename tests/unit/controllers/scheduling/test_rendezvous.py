"""What a rank's pod gets so that a user's torchrun job finds its gang (issue 30, items 1-2): the
pod's DNS name in the job's headless Service, torchrun's environment under Kubeflow's names
(the template's own values win), and on Ascend cards the HCCL rank table MindCluster's scripts
read, from the nodes and cards the operator chose."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from matrixpool.api import labels, trainingjob
from matrixpool.controllers import jobservice, ranktable
from matrixpool.controllers.scheduling import gangpods
from matrixpool.k8s import pods, services
from matrixpool.placement import gangs
from matrixpool.state.workloads import Workload
from tests.unit import worlds
from tests.unit.recorder import Recorder


def gang_of(job: Workload) -> gangs.Gang:
    assert isinstance(job.model, trainingjob.TrainingJob)
    spec = job.model.spec
    return gangs.training_gang("ns", job.name, spec, 48, spec.replicas, card_resource=worlds.CARDS)


def pods_of(job: Workload, resource: str = worlds.CARDS) -> dict[int, dict[str, Any]]:
    gang = gang_of(job)
    contracts = gangpods.training_contracts(job, [gang], {}, resource)
    return {
        plan.rank: pods.manifest(
            plan, job.model.spec.template, job.ref, resource, contracts[plan.name]
        )  # type: ignore[union-attr]
        for plan in gang.pods
    }


def env_of(pod: dict[str, Any], container: int = 0) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom"))
        for e in pod["spec"]["containers"][container]["env"]
    }


def test_rank_r_is_job_r_in_the_jobs_subdomain_selected_by_uid() -> None:
    made = pods_of(worlds.job("llm", 3))
    for rank, pod in made.items():
        assert pod["spec"]["hostname"] == f"llm-{rank}"
        assert pod["spec"]["subdomain"] == "llm"
        assert pod["metadata"]["labels"][labels.JOB_UID] == "uid-llm"
    service = services.body("ns", "llm", "uid-llm", worlds.job("llm", 3).ref)
    assert service["spec"] == {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": {labels.JOB_UID: "uid-llm"},
    }
    [owner] = service["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("TrainingJob", "uid-llm", True)


def test_every_rank_gets_torchruns_environment_pointing_at_rank_0s_name() -> None:
    made = pods_of(worlds.job("llm", 3))
    master = "llm-0.llm.ns.svc.cluster.local"
    for rank, pod in made.items():
        env = env_of(pod)
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == master
        assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == "29500"
        assert env["WORLD_SIZE"] == "3"
        assert env["RANK"] == env["NODE_RANK"] == env["PET_NODE_RANK"] == str(rank)
        assert env["LOCAL_RANK"] == "0"
        assert env["PET_NNODES"] == "3"
        assert env["PET_NPROC_PER_NODE"] == "1"


def test_the_rendezvous_port_processes_per_pod_and_domain_come_from_the_spec_and_chart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MATRIXPOOL_CLUSTER_DOMAIN", "corp.example")
    job = worlds.job("llm", 2, rendezvous={"port": 23456, "procsPerReplica": 4})
    env = env_of(pods_of(job)[1])
    assert env["MASTER_ADDR"] == "llm-0.llm.ns.svc.corp.example"
    assert env["MASTER_PORT"] == "23456"
    assert env["PET_NPROC_PER_NODE"] == "4"
    assert env["WORLD_SIZE"] == "8"  # processes in all
    assert env["RANK"] == "4"  # the pod's first process
    assert env["NODE_RANK"] == "1"


def test_a_variable_the_template_sets_stays_as_the_template_sets_it() -> None:
    template = {
        "spec": {
            "containers": [
                {"name": "t", "image": "i", "env": [{"name": "MASTER_PORT", "value": "1234"}]},
                {"name": "sidecar", "image": "s"},
            ]
        }
    }
    made = pods_of(worlds.job("llm", 2, template=template))
    env = env_of(made[0])
    assert env["MASTER_PORT"] == "1234"
    assert [e["name"] for e in made[0]["spec"]["containers"][0]["env"]].count("MASTER_PORT") == 1
    assert env["MASTER_ADDR"] == "llm-0.llm.ns.svc.cluster.local"
    assert env_of(made[0], container=1)["MASTER_PORT"] == "29500"  # every container gets it


def test_ascend_pods_mount_the_rank_table_and_others_do_not() -> None:
    ascend = pods_of(worlds.job("llm", 2))[0]
    env = env_of(ascend)
    assert env["RANK_TABLE_FILE"] == "/user/serverid/devindex/config/hccl.json"
    volume = next(v for v in ascend["spec"]["volumes"] if v["name"] == "matrixpool-rank-table")
    assert volume["configMap"] == {"name": "matrixpool-hccl-uid-llm", "optional": True}
    mounts = {m["mountPath"]: m for m in ascend["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/user/serverid/devindex/config"]["readOnly"] is True
    gpu = pods_of(worlds.job("llm", 2), resource="nvidia.com/gpu")[0]
    assert "RANK_TABLE_FILE" not in env_of(gpu)
    assert all(v["name"] != "matrixpool-rank-table" for v in gpu["spec"]["volumes"])


def test_a_job_name_that_cannot_name_its_service_is_refused_at_the_api() -> None:
    [rule] = trainingjob.RESOURCE.name_rules
    assert "metadata.name" in rule["message"]
    assert trainingjob.MAX_NAME_LENGTH == 56  # "<name>-999999" fits a 63-character label


def world_with(placed: list[Any], nodes: int = 4) -> Any:
    job = worlds.job("llm", 2)
    world = worlds.fixed_world(worlds.index(*placed), [job], nodes=nodes)
    nodes = [dataclasses.replace(n, address=f"192.0.2.{i + 10}") for i, n in enumerate(world.nodes)]
    return dataclasses.replace(world, nodes=nodes), job


def test_the_rank_table_lists_each_ranks_server_and_cards_in_rank_order() -> None:
    placed = [
        worlds.pod("llm-0", "p0", node="n2", cards=frozenset({4, 5, 6, 7, 0, 1, 2, 3})),
        worlds.pod("llm-1", "p1", node="n0", cards=worlds.EIGHT),
    ]
    world, job = world_with(placed)
    found = ranktable.table(world, job)
    assert found is not None
    assert found["status"] == "completed"
    assert found["server_count"] == "2"
    first, second = found["server_list"]
    assert first["server_id"] == "192.0.2.12"  # rank 0's node, n2
    assert second["server_id"] == "192.0.2.10"
    assert [d["device_id"] for d in first["device"]] == [str(c) for c in range(8)]
    assert [d["rank_id"] for d in first["device"]] == [str(r) for r in range(8)]
    assert [d["rank_id"] for d in second["device"]] == [str(r) for r in range(8, 16)]


def test_a_rank_reserved_but_not_yet_bound_leaves_the_table_initializing() -> None:
    """A status report may read the world while a binding cycle writes: a reservation names
    the server, but the Binding may still be refused and the gang placed elsewhere."""
    placed = [
        worlds.pod("llm-0", "p0", node="n2", cards=worlds.EIGHT),
        worlds.pod("llm-1", "p1", reserved_node="n0", cards=worlds.EIGHT),
    ]
    world, job = world_with(placed)
    found = ranktable.table(world, job)
    assert found is not None
    assert found["status"] == "initializing"
    assert found["server_count"] == "2"


def test_the_rank_table_is_initializing_until_every_rank_holds_its_cards() -> None:
    world, job = world_with([worlds.pod("llm-0", "p0", node="n1", cards=worlds.EIGHT)])
    found = ranktable.table(world, job)
    assert found is not None
    assert found["status"] == "initializing"
    world, job = world_with([])
    assert ranktable.table(world, job) is None  # nothing placed: nothing to write


def test_the_rank_table_is_written_once_per_change_and_forgotten_with_the_job() -> None:
    placed = [
        worlds.pod("llm-0", "p0", node="n0", cards=worlds.EIGHT),
        worlds.pod("llm-1", "p1", node="n1", cards=worlds.EIGHT),
    ]
    world, _ = world_with(placed)
    act, memory = Recorder(), ranktable.Memory()
    asyncio.run(ranktable.run(world, memory, act))
    asyncio.run(ranktable.run(world, memory, act))
    written = act.configmaps["ns/matrixpool-hccl-uid-llm"]
    assert json.loads(written["hccl.json"])["status"] == "completed"
    assert act.configmap_writes == 1  # unchanged: not written again
    moved = [placed[0], worlds.pod("llm-1", "p2", node="n3", cards=worlds.EIGHT)]
    world, _ = world_with(moved)
    asyncio.run(ranktable.run(world, memory, act))  # rank 1 moved to n3 (a SpareSwap)
    table = json.loads(act.configmaps["ns/matrixpool-hccl-uid-llm"]["hccl.json"])
    assert [s["server_id"] for s in table["server_list"]] == ["192.0.2.10", "192.0.2.13"]
    memory.forget("uid-llm", "ns/llm")
    assert memory.written == {}


def test_the_service_is_written_once_and_a_foreign_one_is_reported() -> None:
    body = {"apiVersion": "matrixpool.dev/v1alpha1", "kind": "TrainingJob"}
    act, memo = Recorder(), {}
    asyncio.run(jobservice.ensure(act, "uid-llm", "llm", "ns", body, memo))
    assert act.services == [("ns", "llm", "uid-llm")]
    assert memo[jobservice.WRITTEN] is True

    class Taken(Recorder):
        async def write_service(self, *_: Any) -> services.Outcome:
            return services.Outcome.FOREIGN

    taken, memo = Taken(), {}
    asyncio.run(jobservice.ensure(taken, "uid-llm", "llm", "ns", body, memo))
    assert jobservice.WRITTEN not in memo  # tried again on the job's next event
    assert taken.reasons("llm") == ["ServiceNameTaken"]
