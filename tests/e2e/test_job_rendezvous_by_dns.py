"""A TrainingJob's ranks meet by name under ``helm install`` and ``matrixpool sim`` (issue 30,
items 1 and 3): the chart's operator gives the job its headless Service and each rank its
hostname and torchrun's environment; the sim's process kubelet runs each rank with the
resolv.conf and /etc/hosts a kubelet writes; the cluster's CoreDNS answers ``MASTER_ADDR``
(``<job>-0.<job>.<ns>.svc.cluster.local``). Rank 0 listens on the address its own hostname
resolves to, as gloo's TCPStore does; every other rank resolves MASTER_ADDR, connects, and is
answered with the world size. Nothing in the pods knows it runs under a simulator."""

from __future__ import annotations

import json
from typing import Any

from matrixpool.devcluster import trainer
from tests.e2e.test_chart import apply_supernodes, placed, status
from tests.integration import framework
from tests.integration.chart import Installed

JOB = "meet"
RANKS = 3
# A user's rendezvous, reduced: rank 0 serves MASTER_PORT on its own address until every
# other rank has reported; the others resolve MASTER_ADDR (bounded retries, as TCPStore
# retries) and connect. Each prints what it resolved.
SCRIPT = """
import os, socket, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if rank == 0:
    own = socket.gethostbyname(socket.gethostname())
    print("rank 0 serves on", own, socket.gethostname(), flush=True)
    server = socket.create_server((own, port))
    server.settimeout(90)
    for _ in range(world - 1):
        peer, _ = server.accept()
        print("rank 0 met rank", peer.recv(16).decode(), flush=True)
        peer.sendall(str(world).encode())
        peer.close()
    sys.exit(0)
for _ in range(300):
    try:
        address = socket.gethostbyname(master)
        with socket.create_connection((address, port), timeout=2) as link:
            link.sendall(str(rank).encode())
            answer = link.recv(16).decode()
        break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit("rank %d never met rank 0 at %s" % (rank, master))
print("rank", rank, "resolved", master, "to", address, "world", answer, flush=True)
"""


def job() -> dict[str, Any]:
    container = trainer.container(0.2)  # the sim's image; its command replaced by the script
    container.update(name="main", command=["python", "-c", SCRIPT])
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": JOB},
        "spec": {
            "superNode": "sn-0",
            "replicas": RANKS,
            "cardsPerReplica": 8,
            "template": {"spec": {"containers": [container]}},
        },
    }


def output(installed: Installed, namespace: str, pod: str) -> str:
    """What the pod's process printed (the sim keeps it per node, namespace and pod)."""
    logs = sorted((installed.sim.folder / "trainers").glob(f"*.{namespace}.{pod}.log"))
    return "".join(log.read_text(errors="replace") for log in logs)


def test_ranks_find_rank_0_by_its_dns_name(installed: Installed, namespace: str) -> None:
    cluster = installed.cluster
    apply_supernodes(cluster)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(job()))
    done = framework.eventually(
        lambda: (s := status(cluster, namespace, JOB)).get("phase") == "Succeeded" and s,
        timeout=180,
        what=f"{JOB} Succeeded",
    )
    assert done["phase"] == "Succeeded"
    pods = placed(cluster, namespace, JOB)
    assert sorted(pods) == list(range(RANKS))
    rank0 = pods[0]
    master = f"{JOB}-0.{JOB}.{namespace}.svc.cluster.local"
    said = {rank: output(installed, namespace, pod.metadata.name) for rank, pod in pods.items()}
    assert f"rank 0 serves on {rank0.status.pod_ip} {JOB}-0" in said[0]
    for rank in range(1, RANKS):
        line = f"rank {rank} resolved {master} to {rank0.status.pod_ip} world {RANKS}"
        assert line in said[rank], said[rank]
        assert f"rank 0 met rank {rank}" in said[0]
