"""Two nodes lost at once on real nodes (issue 32, item 2): the example trainer
(matrixpool.devcluster.torch_trainer, DCP on matrixpool_recovery.torch) as 2 ranks on sn-real
with two spare nodes. Both ranks' nodes lose their power together — their daemons, tier-1
memory and every peer copy with them: one recovery moves both ranks to the two spares
(SpareSwap, never an eviction while spares suffice), restoring the newest step tier 3 holds
for both. The job Succeeds with every rank's parameters bitwise those of a fault-free run."""

from __future__ import annotations

import json

from tests.integration import framework
from tests.realnodes.conftest import SPARE, EndedPods, Watched, ends_as, running, supernode
from tests.realnodes.test_pytorch_on_real_nodes import RANKS, STEPS, job, reference

JOB = "torch-pair"


def test_two_nodes_powered_off_at_once_swap_both_ranks_to_the_two_spares(
    installed: framework.TestCluster, namespace: str
) -> None:
    cluster = installed
    assert running(cluster, "operator")[0]["spec"]["nodeName"] == SPARE
    two_spares = supernode()
    two_spares["spec"]["spares"] = {"nodes": 2}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(two_spares))
    body = job(JOB)
    watched = Watched(cluster, namespace, JOB)
    try:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
        with EndedPods(cluster, namespace):
            # Both ranks' nodes hold every tier-1 copy (each the other's peer): what survives
            # them is tier 3, on the shared file system.
            framework.eventually(
                lambda: (watched.status().get("checkpoints") or {}).get("persistent"),
                timeout=120,
                interval=0.5,
                what="a step on tier 3",
            )
            lost = sorted(p["spec"]["nodeName"] for p in watched.rank_pods().values())
            assert len(lost) == RANKS, lost
            assert SPARE not in lost, lost
            cluster.matrixpool("cluster", "fault", "power-off", *lost)
            try:
                entry = watched.recovered(1)
                print("recovery:", entry)
                assert entry["level"] == "SpareSwap", entry
                assert not entry.get("fromScratch"), entry  # tier 3 held a step for both
                assert sorted(entry["moves"]) == lost, entry  # both, in one recovery
                assert len(set(entry["moves"].values())) == RANKS, entry
                assert all(node in entry["cause"] for node in lost), entry
                assert not watched.status().get("preemptions")  # nobody was evicted
                moved = {p["spec"]["nodeName"] for p in watched.rank_pods().values()}
                assert moved == set(entry["moves"].values()), moved
                # Made once the nodes are off: a container starting on another node while a
                # power-off ran was seen killed with them ("cannot start a container that has
                # stopped"), a fault of the dev cluster's power-off, not of the product.
                ref = reference(namespace, SPARE)
                cluster.kubectl("apply", "-f", "-", input=json.dumps(ref))
                watched.succeeded()
            finally:
                cluster.matrixpool("cluster", "fault", "power-on", *lost, check=False)
        assert len(watched.status().get("recoveries") or []) == 1
        ends_as(cluster, namespace, watched, "torch-reference", RANKS, STEPS)
    finally:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(supernode()))  # one spare again
