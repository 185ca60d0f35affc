"""A TrainingJob's networking on the real API server (issue 30, items 1-2): its headless
Service, owned by the job and selecting its pods by UID; every rank's hostname and subdomain
(what cluster DNS serves as ``<job>-<rank>.<job>.<ns>.svc.cluster.local``); torchrun's
environment on every rank; and the HCCL rank table of the Ascend cards the operator chose,
completed once the gang is bound.

Not here: the EndpointSlice and the DNS answer. kwok's pods have loopback IPs (127.200/16, so
that nothing leaves this machine), and the API server refuses loopback addresses in an
EndpointSlice ("may not be in the loopback range"); the names resolve on the real nodes, whose
pods have addresses of their own (tests/realnodes)."""

from __future__ import annotations

import json
from typing import Any

from tests.integration import framework, manifests

JOB = "ddp"


def test_a_job_gets_its_service_its_dns_names_its_env_and_its_rank_table(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    two_supernodes: list[str],
) -> None:
    job = manifests.training_job(JOB).replicas(3).on("sn-0")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())
    uid = json.loads(
        cluster.kubectl("get", "trainingjob", JOB, "-n", namespace, "-o", "json").stdout
    )["metadata"]["uid"]

    def bound() -> list[dict[str, Any]] | None:
        pods = framework.gang_pods(cluster, namespace)
        return pods if len(pods) == 3 and all(p["spec"].get("nodeName") for p in pods) else None

    pods = framework.eventually(bound, timeout=60, what="3 ranks bound")
    service = json.loads(
        cluster.kubectl("get", "service", JOB, "-n", namespace, "-o", "json").stdout
    )
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"matrixpool.dev/job-uid": uid}
    [owner] = service["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("TrainingJob", uid)

    master = f"{JOB}-0.{JOB}.{namespace}.svc.cluster.local"
    by_rank = {int(p["metadata"]["labels"]["matrixpool.dev/rank"]): p for p in pods}
    for rank, pod in by_rank.items():
        assert pod["spec"]["hostname"] == f"{JOB}-{rank}"
        assert pod["spec"]["subdomain"] == JOB
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["MASTER_ADDR"] == master
        assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == (str(rank), "3", "29500")

    def table() -> dict[str, Any] | None:
        found = cluster.kubectl(
            "get", "configmap", f"matrixpool-hccl-{uid}", "-n", namespace, "-o", "json",
            check=False,
        )  # fmt: skip
        if found.returncode != 0:
            return None
        written = json.loads(json.loads(found.stdout)["data"]["hccl.json"])
        return written if written["status"] == "completed" else None

    written = framework.eventually(table, timeout=60, what="a completed rank table")
    servers = [s["server_id"] for s in written["server_list"]]
    assert len(servers) == 3
    for rank, server in enumerate(written["server_list"]):
        node = by_rank[rank]["spec"]["nodeName"]
        address = json.loads(cluster.kubectl("get", "node", node, "-o", "json").stdout)
        internal = [
            a["address"] for a in address["status"]["addresses"] if a["type"] == "InternalIP"
        ]
        assert server["server_id"] == (internal[0] if internal else node)
        cards = by_rank[rank]["metadata"]["annotations"]["matrixpool.dev/cards"].split(",")
        assert [d["device_id"] for d in server["device"]] == sorted(cards, key=int)
        assert [int(d["rank_id"]) for d in server["device"]] == list(range(8 * rank, 8 * rank + 8))
