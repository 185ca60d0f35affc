"""Gang scheduling on the real control plane (issue 3): a DeepSeek-style service with EP320,
a Preferred job spanning two supernodes, preemption with elastic shrink first, and an operator
SIGKILLed in the middle of binding a gang."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from tests.integration import framework, manifests

CARDS = "matrixpool.dev/cards"


def assert_no_card_twice(cluster: framework.TestCluster) -> int:
    """Every (node, card) held by at most one pod; returns the number of cards held."""
    held: Counter[tuple[str, int]] = Counter()
    for pod in framework.gang_pods(cluster):
        annotations = pod["metadata"].get("annotations") or {}
        node = pod["spec"].get("nodeName") or annotations.get("matrixpool.dev/node")
        if pod["spec"].get("nodeName") and annotations.get("matrixpool.dev/node"):
            assert pod["spec"]["nodeName"] == annotations["matrixpool.dev/node"]
        for card in filter(None, (annotations.get(CARDS) or "").split(",")):
            held[(node, int(card))] += 1
    twice = [k for k, n in held.items() if n > 1]
    assert not twice, f"cards allocated twice: {twice[:5]}"
    return len(held)


def get(
    cluster: framework.TestCluster, kind: str, name: str, namespace: str | None = None
) -> dict[str, Any]:
    scope = ["-n", namespace] if namespace else []
    return dict(json.loads(cluster.kubectl("get", kind, name, *scope, "-o", "json").stdout))


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    conditions = (body.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def wait_job(
    cluster: framework.TestCluster, namespace: str, name: str, *, bound: int, timeout: float = 60
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        body = get(cluster, "trainingjob", name, namespace)
        replicas = (body.get("status") or {}).get("replicas") or {}
        return body if replicas.get("bound") == bound == replicas.get("desired") else None

    return framework.eventually(probe, timeout=timeout, what=f"{name} with {bound} pods bound")


def test_deepseek_prefill_and_ep320_decode_fill_one_supernode_leaving_the_spare_idle(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    two_supernodes: list[str],
) -> None:
    service = (
        manifests.inference_service("deepseek", "sn-0")
        .role("prefill", replicas=4, pods=1, cards=8)
        .role("decode", replicas=1, pods=40, cards=8, experts=(288, 32))
    )
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=service.yaml())

    def all_bound() -> list[dict[str, Any]] | None:
        pods = framework.gang_pods(cluster, namespace)
        return pods if len(pods) == 44 and all(p["spec"].get("nodeName") for p in pods) else None

    pods = framework.eventually(all_bound, timeout=90, what="44 pods bound")
    assert assert_no_card_twice(cluster) == 352
    for pod in pods:
        assert pod["spec"]["schedulerName"] == "matrixpool"
        env = {e["name"] for e in pod["spec"]["containers"][0].get("env", [])}
        assert {"MATRIXPOOL_CARDS", "ASCEND_VISIBLE_DEVICES"} <= env
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert all(n.startswith("sn-0-") for n in nodes)

    status = framework.eventually(
        lambda: (
            (get(cluster, "inferenceservice", "deepseek", namespace).get("status") or {})
            if condition(get(cluster, "inferenceservice", "deepseek", namespace), "Ready").get(
                "status"
            )
            == "True"
            else None
        ),
        timeout=60,
        what="service Ready",
    )
    assert status["expertMap"] == "deepseek-expert-map"
    experts = json.loads(
        get(cluster, "configmap", "deepseek-expert-map", namespace)["data"]["decode-0.json"]
    )
    assert [e["expert"] for e in experts] == list(range(320))
    slots = {(e["pod"], e["card"]) for e in experts}
    decode = {
        p["metadata"]["name"]: p
        for p in pods
        if p["metadata"]["labels"]["matrixpool.dev/role"] == "decode"
    }
    expected = {
        (name, int(c))
        for name, p in decode.items()
        for c in p["metadata"]["annotations"][CARDS].split(",")
    }
    assert slots == expected  # every decode card exactly once

    spare = (get(cluster, "supernode", "sn-0").get("status") or {}).get("spareNodes")
    assert spare
    assert not set(spare) & nodes


def test_preferred_job_spans_two_supernodes_on_whole_nodes_and_required_job_waits_for_spares(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    two_supernodes: list[str],
) -> None:
    assert len(two_supernodes) == 2, "this test needs MATRIXPOOL_TEST_SUPERNODES >= 2"
    big = manifests.training_job("big").replicas(50).cards(8).on(None, "Preferred")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=big.yaml())
    body = wait_job(cluster, namespace, "big", bound=50, timeout=90)
    assert body["status"]["placement"]["superNodes"] == ["sn-0", "sn-1"]
    pods = framework.gang_pods(cluster, namespace)
    per_node = Counter(p["spec"]["nodeName"] for p in pods)
    assert set(per_node.values()) == {1}  # whole nodes: one 8-card pod per node
    assert assert_no_card_twice(cluster) == 400

    # sn-1 now has 48 - 1 spare - 3 used = 44 free nodes; 45 would need its spare.
    needy = manifests.training_job("needy").replicas(45).cards(8).on("sn-1", "Required")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=needy.yaml())

    def waiting() -> dict[str, Any] | None:
        body = get(cluster, "trainingjob", "needy", namespace)
        scheduled = condition(body, "Scheduled")
        return (
            body
            if scheduled.get("status") == "False"
            and scheduled.get("reason") not in (None, "Waiting")
            else None
        )

    body = framework.eventually(waiting, timeout=30, what="needy waits with a reason")
    assert body["status"]["phase"] == "Pending"
    assert body["status"]["replicas"]["bound"] == 0
    events = cluster.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.name=needy,type=Warning",
        "-o",
        "json",
    ).stdout
    assert json.loads(events)["items"], "a Warning Event explains why needy waits"
    spare = (get(cluster, "supernode", "sn-1").get("status") or {}).get("spareNodes") or []
    assert spare
    assert not {p["spec"].get("nodeName") for p in framework.gang_pods(cluster)} & set(spare)


def test_inference_preempts_training_and_the_elastic_job_shrinks_first(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    two_supernodes: list[str],
) -> None:
    elastic = (
        manifests.training_job("elastic").replicas(40, minimum=20).cards(8).on("sn-0").priority(100)
    )
    rigid = manifests.training_job("rigid").replicas(7).cards(8).on("sn-0").priority(50)
    for job in (elastic, rigid):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())
    wait_job(cluster, namespace, "elastic", bound=40)
    wait_job(cluster, namespace, "rigid", bound=7)

    service = manifests.inference_service("chat", "sn-0").role("serve", replicas=1, pods=20)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=service.yaml())

    def served() -> bool:
        pods = [
            p
            for p in framework.gang_pods(cluster, namespace)
            if p["metadata"]["labels"]["matrixpool.dev/job"] == "chat"
        ]
        return len(pods) == 20 and all(p["spec"].get("nodeName") for p in pods)

    framework.eventually(served, timeout=90, what="inference bound after preemption")
    shrunk = wait_job(cluster, namespace, "elastic", bound=20)
    assert shrunk["status"]["replicas"]["desired"] == 20
    rigid_now = get(cluster, "trainingjob", "rigid", namespace)
    assert rigid_now["status"]["replicas"]["bound"] == 7  # the elastic shrink was enough
    assert condition(rigid_now, "Preempted").get("status") != "True"
    assert_no_card_twice(cluster)
    reasons = json.loads(
        cluster.kubectl(
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            "involvedObject.name=elastic",
            "-o",
            "json",
        ).stdout
    )["items"]
    assert "Shrunk" in {e["reason"] for e in reasons}

    # When inference leaves, the elastic job grows back to its full size.
    cluster.kubectl("delete", "inferenceservice", "chat", "-n", namespace)
    grown = wait_job(cluster, namespace, "elastic", bound=40, timeout=90)
    assert grown["status"]["replicas"]["desired"] == 40
    assert_no_card_twice(cluster)


def test_operator_killed_in_the_middle_of_binding_a_gang_finishes_it_without_double_booking(
    cluster: framework.TestCluster,
    namespace: str,
    two_supernodes: list[str],
    tmp_path: Any,
) -> None:
    operator = framework.Operator(
        cluster, tmp_path / "operator.log", env={"MATRIXPOOL_BIND_PACE_SECONDS": "0.1"}
    ).start()
    try:
        job = manifests.training_job("gang").replicas(40).cards(8).on("sn-0")
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())

        def midway() -> int | None:
            bound = sum(
                1 for p in framework.gang_pods(cluster, namespace) if p["spec"].get("nodeName")
            )
            assert_no_card_twice(cluster)
            return bound if 3 <= bound < 40 else None

        bound_at_kill = framework.eventually(
            midway, timeout=60, interval=0.05, what="gang half bound"
        )
        operator.kill()
        assert_no_card_twice(cluster)
        still = sum(1 for p in framework.gang_pods(cluster, namespace) if p["spec"].get("nodeName"))
        assert bound_at_kill <= still < 40, "the kill came before the gang completed"
        operator.env = {}
        operator.start()
        wait_job(cluster, namespace, "gang", bound=40, timeout=60)
        assert assert_no_card_twice(cluster) == 320
    finally:
        operator.kill()
        print(operator.log()[-20000:])


@pytest.mark.parametrize(
    ("job", "reason"),
    [
        pytest.param(
            manifests.training_job("lost").replicas(2).on("sn-9"),
            "UnknownSuperNode",
            id="a job naming an unknown supernode waits with UnknownSuperNode",
        ),
        pytest.param(
            manifests.training_job("odd").replicas(2).cards(12).on("sn-0"),
            "NodeTooSmall",
            id="12 cards per replica on 8-card nodes can never be served",
        ),
    ],
)
def test_a_spec_that_can_never_be_served_stays_pending_with_a_reason_and_an_event(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    two_supernodes: list[str],
    job: manifests.TrainingJobManifest,
    reason: str,
) -> None:
    name = job.body["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())

    def flagged() -> dict[str, Any] | None:
        body = get(cluster, "trainingjob", name, namespace)
        return body if condition(body, "Scheduled").get("reason") == reason else None

    body = framework.eventually(flagged, timeout=30, what=f"{name} flagged {reason}")
    assert body["status"]["phase"] == "Pending"
    assert condition(body, "Scheduled")["status"] == "False"
    assert "spec." in condition(body, "Scheduled")["message"]
    framework.eventually(
        lambda: json.loads(
            cluster.kubectl(
                "get",
                "events",
                "-n",
                namespace,
                "--field-selector",
                f"involvedObject.name={name},reason={reason}",
                "-o",
                "json",
            ).stdout
        )["items"],
        timeout=15,
        what=f"{reason} Event",
    )
    assert operator.process is not None
    assert operator.process.poll() is None  # the operator did not crash


def test_deleting_a_job_removes_its_pods_and_frees_its_cards(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    two_supernodes: list[str],
) -> None:
    job = manifests.training_job("short").replicas(4).cards(8).on("sn-0")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())
    wait_job(cluster, namespace, "short", bound=4)
    cluster.kubectl("delete", "trainingjob", "short", "-n", namespace)
    framework.eventually(
        lambda: not framework.gang_pods(cluster, namespace),
        timeout=60,
        what="the job's pods garbage-collected",
    )
    framework.eventually(
        lambda: (
            (get(cluster, "supernode", "sn-0").get("status") or {})
            .get("cards", {})
            .get("allocated")
            == 0
        ),
        timeout=20,
        what="sn-0 cards freed",
    )
