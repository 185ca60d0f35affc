"""``matrixpool sim`` on the real control plane (issue 5, item 1): a checkpoint daemon per node
published on the Node, a trainer per Running pod saving with the real Checkpointer, and a node
fault that takes the node's daemon and trainers down with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool_recovery import credentials
from tests.integration import framework, manifests
from tests.integration.test_scheduling import wait_job


@pytest.fixture
def port() -> int:
    """The daemons' port: the sim's and the operator's (others may run beside)."""
    return framework.cluster.free_ports(1)[0]


@pytest.fixture
def sim(cluster: framework.TestCluster, tmp_path: Path, port: int) -> Iterator[Path]:
    """`matrixpool sim` for sn-0's nodes; yields its folder."""
    folder = tmp_path / "sim"
    log = open(tmp_path / "sim.log", "wb")  # noqa: SIM115 -- the child's, closed below
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "matrixpool.cli",
            "sim",
            "--supernode",
            "sn-0",
            "--port",
            str(port),
            "--folder",
            str(folder),
        ],
        env=cluster.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield folder
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        log.close()
        print((tmp_path / "sim.log").read_text(errors="replace")[-5000:])


@pytest.fixture
def operator(
    cluster: framework.TestCluster, sim: Path, tmp_path: Path, port: int
) -> Iterator[framework.Operator]:
    """The operator told the sim's cluster secret: it asks the daemons and tells them their
    tier-1 peers."""
    secret = sim / "secret"
    framework.eventually(secret.exists, timeout=60, what="the sim's cluster secret")
    env = {"MATRIXPOOL_CKPT_SECRET_FILE": str(secret), "MATRIXPOOL_CKPT_DAEMON_PORT": str(port)}
    process = framework.Operator(cluster, tmp_path / "operator.log", env=env).start()
    try:
        yield process
    finally:
        process.kill()
        print(process.log()[-20000:])


def endpoints(cluster: framework.TestCluster) -> dict[str, str]:
    """sn-0's nodes → their daemon's endpoint, from the daemons' Leases ("" without one)."""
    nodes = json.loads(
        cluster.kubectl("get", "nodes", "-l", "matrixpool.dev/supernode=sn-0", "-o", "json").stdout
    )["items"]
    announced = framework.daemon_endpoints(cluster)
    return {n["metadata"]["name"]: announced.get(n["metadata"]["name"], "") for n in nodes}


def info(endpoint: str, token: str) -> dict[str, Any] | None:
    """The daemon's GET /v1/info (node, peers, usage), or None when it does not answer."""
    request = urllib.request.Request(
        f"http://{endpoint}/v1/info", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return dict(json.loads(response.read()))
    except (urllib.error.URLError, OSError):
        return None


def inventory(endpoint: str, token: str) -> list[dict[str, Any]] | None:
    request = urllib.request.Request(
        f"http://{endpoint}/v1/inventory", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            body = json.loads(response.read())
    except (urllib.error.URLError, OSError):
        return None
    return list(body.get("shards", body) if isinstance(body, dict) else body)


def healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/v1/healthz", timeout=1):
            return True
    except (urllib.error.URLError, OSError):
        return False


def test_sim_runs_a_daemon_per_node_and_trainers_that_checkpoint_and_die_with_their_node(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    two_supernodes: list[str],
    sim: Path,
) -> None:
    published = framework.eventually(
        lambda: (e := endpoints(cluster)) and all(e.values()) and e,
        timeout=60,
        what="every sn-0 node publishes its daemon",
    )
    assert len(set(published.values())) == 48
    lease_of = {
        lease.spec.holder_identity: lease
        for lease in cluster.api.coordination.list_namespaced_lease(
            "default", label_selector="matrixpool.dev/ckpt-daemon=true"
        ).items
    }
    first = lease_of["sn-0-node-00"]
    assert first.metadata.name == "matrixpool-daemon-sn-0-node-00"
    assert first.spec.lease_duration_seconds == 40
    framework.eventually(  # renewed every quarter of its duration while the daemon answers
        lambda: (
            cluster.api.coordination.read_namespaced_lease(
                first.metadata.name, "default"
            ).spec.renew_time
            > first.spec.renew_time
        ),
        timeout=20,
        what="the daemon's Lease renewed",
    )
    framework.eventually(
        lambda: all(healthy(e) for e in published.values()),
        timeout=30,
        what="every published daemon answers",
    )

    # The operator tells every daemon its tier-1 peer, in another rack.
    token = _token(sim)
    racks = {
        n["metadata"]["name"]: n["metadata"]["labels"]["matrixpool.dev/rack"]
        for n in json.loads(
            cluster.kubectl(
                "get", "nodes", "-l", "matrixpool.dev/supernode=sn-0", "-o", "json"
            ).stdout
        )["items"]
    }
    node_at = {endpoint: node for node, endpoint in published.items()}
    for node in ("sn-0-node-00", "sn-0-node-17"):
        told = framework.eventually(
            lambda node=node: (info(published[node], token) or {}).get("peers"),
            timeout=30,
            what=f"{node}'s daemon told its peers",
        )
        assert len(told) == 1, told
        assert racks[node_at[told[0]]] != racks[node], (node, told)

    job = manifests.training_job("sim").replicas(4).cards(8).on("sn-0")
    job.body["spec"]["checkpoint"] = {"memory": {"everySteps": 1, "peerReplicas": 1}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())
    wait_job(cluster, namespace, "sim", bound=4)
    pods = framework.gang_pods(cluster, namespace)
    node_of = {
        int(p["metadata"]["labels"]["matrixpool.dev/rank"]): p["spec"]["nodeName"] for p in pods
    }
    uid = cluster.kubectl(
        "get", "trainingjob", "sim", "-n", namespace, "-o", "jsonpath={.metadata.uid}"
    ).stdout.strip()

    def saved(rank: int) -> list[dict[str, Any]] | None:
        shards = inventory(published[node_of[rank]], token) or []
        mine = [s for s in shards if str(s.get("job")) == uid and int(s.get("rank", -1)) == rank]
        return mine if len({int(s["step"]) for s in mine}) >= 1 else None

    for rank in range(4):
        framework.eventually(
            lambda rank=rank: saved(rank),
            timeout=60,
            what=f"rank {rank} checkpoints in its node's daemon",
        )

    # Each trainer runs with exactly what its pod says, as a kubelet would start it: the
    # node daemon from status.hostIP, its rank from its label, its job's token from the
    # Secret the operator wrote (mounted where the pod mounts it), nothing of the sim's own.
    for rank in range(4):
        pod = next(p for p in pods if p["metadata"]["labels"]["matrixpool.dev/rank"] == str(rank))
        pid = int(
            (sim / "trainers" / f"{node_of[rank]}.{namespace}.{pod['metadata']['name']}.pid")
            .read_text()
            .strip()
        )
        environ = dict(
            entry.split("=", 1)
            for entry in Path(f"/proc/{pid}/environ").read_text().split("\0")
            if "=" in entry
        )
        assert environ["MATRIXPOOL_CKPT_DAEMON"] == published[node_of[rank]]
        assert environ["MATRIXPOOL_RANK"] == str(rank)
        assert environ["MATRIXPOOL_WORLD_SIZE"] == "4"
        assert environ["MATRIXPOOL_JOB"] == uid
        assert "KUBECONFIG" not in environ
        assert "MATRIXPOOL_CKPT_TOKEN" not in environ  # only the file the Secret gives
        inside = Path(environ["MATRIXPOOL_CKPT_TOKEN_FILE"]).resolve()  # /var/run is /run
        token_file = Path(f"/proc/{pid}/root") / str(inside).lstrip("/")
        mounts = Path(f"/proc/{pid}/mountinfo").read_text()
        assert "/run/matrixpool/checkpoint " in mounts  # /var/run is /run here
        assert "/run/matrixpool/pod " in mounts
        # The node daemon's socket folder alone (hostPath), never its tier-1 folder.
        assert "/dev/shm/matrixpool/socket " in mounts
        assert "/dev/shm/matrixpool " not in mounts
        assert environ["MATRIXPOOL_CKPT_SOCKET"] == "/dev/shm/matrixpool/socket/daemon.sock"
        assert "/run/secrets/kubernetes.io/serviceaccount " in mounts  # projected token
        assert token_file.read_text().strip()  # the job's token, from its Secret

    victim = node_of[0]
    cluster.matrixpool("cluster", "fault", "node-down", victim)
    try:
        framework.eventually(
            lambda: not healthy(published[victim]),
            timeout=20,
            what=f"{victim}'s daemon gone with the node",
        )
        others = [published[node_of[r]] for r in (1, 2, 3)]
        assert all(healthy(e) for e in others)
    finally:
        cluster.matrixpool("cluster", "fault", "node-up", victim)
    framework.eventually(
        lambda: healthy(published[victim]),
        timeout=30,
        what=f"{victim} gets a fresh daemon when it comes back",
    )


def _token(folder: Path) -> str:
    """The operator token, derived from the cluster secret the sim wrote."""
    return credentials.operator_token(credentials.read_secret(folder / "secret"))
