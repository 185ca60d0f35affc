"""The real-node suite: `matrixpool cluster up --real-nodes 4` (kubelets with containerd and
runc, in network and mount namespaces of their own), the image built here by `make image`
(tools/image/build.sh) and loaded into every node, and the chart installed by `helm install`
with charts/matrixpool/ci/real-nodes-values.yaml, the operator pinned to the node SuperNode
sn-real keeps spare (a drill that kills a rank's node leaves the operator up). The operator, its
daemons, the device plugin and the trainers run in real containers. Needs root; under CI a
refusal is a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool.devcluster import cluster as devcluster
from matrixpool.devcluster import realnodes, topology
from tests import ci
from tests.integration import framework
from tests.integration.chart import CHART, RELEASE, REPO, SYSTEM
from tests.integration.conftest import namespace  # noqa: F401 -- a fixture of this suite too

# Two kwok nodes beside four real ones: the real ones form SuperNode sn-real (2 racks of 2).
SHAPE = topology.Shape(supernodes=1, nodes_per_supernode=2, cards_per_node=8, nodes_per_rack=2)
REAL_NODES = 4
REAL_SUPERNODE = "sn-real"
# The spare of sn-real (`spares: {nodes: 1}`): the operator keeps the idle node at the end of the
# name order (placement.inventory.choose_spares). The operator runs there, so that a job of 3
# ranks fills the other three nodes and any of them can lose its power under the job.
SPARE = f"real-{REAL_NODES - 1}"
VALUES = CHART / "ci" / "real-nodes-values.yaml"
IMAGE = "matrixpool:dev"
HELM_SET = "MATRIXPOOL_REALNODES_HELM_SET"  # more `helm install --set` values, comma-separated


def _require_root() -> None:
    try:
        realnodes.require_root()
    except realnodes.RealNodeError as error:
        ci.cannot_run(f"real nodes cannot run: {error}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[framework.TestCluster]:
    """The control plane with 2 kwok nodes and 4 real nodes, no CRDs (the chart has them)."""
    _require_root()
    local = devcluster.Cluster(
        tmp_path_factory.mktemp("cluster"),
        progress=lambda line: print(line, file=sys.stderr),
        tied=True,
    )
    local.up(SHAPE, real_nodes=REAL_NODES, real_supernode=REAL_SUPERNODE)
    try:
        yield framework.TestCluster(local=local, shape=SHAPE)
    finally:
        if not os.environ.get("MATRIXPOOL_KEEP_CLUSTER"):
            local.down()


@pytest.fixture(scope="session")
def image(cluster: framework.TestCluster) -> str:
    """`make image`: the image built from Debian packages and the wheel, loaded into every node."""
    built = subprocess.run(
        [str(REPO / "tools" / "image" / "build.sh"), IMAGE],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    cluster.local.load_image(Path(built.stdout.strip().splitlines()[-1]))
    return IMAGE


@pytest.fixture(scope="session")
def installed(cluster: framework.TestCluster, image: str) -> Iterator[framework.TestCluster]:
    """`helm install matrixpool charts/matrixpool -f charts/matrixpool/ci/real-nodes-values.yaml`
    with the operator on the spare node; returns once the operator and a daemon on every real
    node run. Four nodes start their Python pods at once on this 2-core machine: minutes."""
    cluster.kubectl("create", "namespace", SYSTEM)
    pin = f"nodeSelector.kubernetes\\.io/hostname={SPARE}"
    extra = os.environ.get(HELM_SET)  # e.g. checkpointDaemon.memory=3Gi (benchmarks/recovery.py)
    cluster.helm(
        "install", RELEASE, str(CHART), "-n", SYSTEM, "-f", str(VALUES), "--set-string", pin,
        *(["--set", extra] if extra else []),
    )  # fmt: skip
    try:
        framework.eventually(
            lambda: running(cluster, "operator"), timeout=300, what="the operator pod running"
        )
        framework.eventually(
            lambda: len(running(cluster, "checkpoint-daemon")) == REAL_NODES,
            timeout=300,
            what="a running checkpoint daemon pod on every real node",
        )
    except AssertionError:
        print(cluster.kubectl("describe", "pods", "-n", SYSTEM, check=False).stdout[-12000:])
        for pod in pods(cluster):
            for status in pod["status"].get("initContainerStatuses", []) + pod["status"].get(
                "containerStatuses", []
            ):
                logs = cluster.kubectl(
                    "logs", "-n", SYSTEM, pod["metadata"]["name"], "-c", status["name"],
                    "--tail=30", check=False,
                )  # fmt: skip
                print(f"--- {pod['metadata']['name']}/{status['name']}\n{logs.stdout}")
        raise
    try:
        yield cluster
    finally:
        for pod in pods(cluster):
            for status in pod["status"].get("containerStatuses", []):
                logs = cluster.kubectl(
                    "logs",
                    "-n",
                    SYSTEM,
                    pod["metadata"]["name"],
                    "-c",
                    status["name"],
                    "--tail=60",
                    check=False,
                )
                print(f"--- {pod['metadata']['name']}/{status['name']}\n{logs.stdout}")


def pods(cluster: framework.TestCluster, component: str | None = None) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={RELEASE}"
    if component:
        selector += f",app.kubernetes.io/component={component}"
    out = cluster.kubectl("get", "pods", "-n", SYSTEM, "-l", selector, "-o", "json")
    return list(json.loads(out.stdout)["items"])


def running(cluster: framework.TestCluster, component: str) -> list[dict[str, Any]]:
    """Pods of ``component`` whose every container runs and is ready."""
    found = []
    for pod in pods(cluster, component):
        statuses = pod["status"].get("containerStatuses") or []
        if statuses and all(s.get("ready") and "running" in s.get("state", {}) for s in statuses):
            found.append(pod)
    return found


def supernode() -> dict[str, Any]:
    """sn-real: the real nodes, 8 cards each, racks as topology, one spare node (SPARE)."""
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "SuperNode",
        "metadata": {"name": REAL_SUPERNODE},
        "spec": {
            "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": REAL_SUPERNODE}},
            "cardResource": "huawei.com/Ascend910",
            "cardsPerNode": 8,
            "topologyKeys": ["matrixpool.dev/rack"],
            "spares": {"nodes": 1},
        },
    }


def last_line(cluster: framework.TestCluster, ns: str, pod: str) -> dict[str, Any]:
    """The last JSON line ``pod`` printed (a trainer's: its step, or its final digest)."""
    logs = cluster.kubectl("logs", "-n", ns, pod, check=False).stdout
    lines = [json.loads(x) for x in logs.splitlines() if x.startswith("{")]
    return lines[-1] if lines else {}


def ends_as(
    cluster: framework.TestCluster,
    ns: str,
    watched: Watched,
    reference: str,
    ranks: int,
    steps: int | None = None,
) -> None:
    """Every one of the job's ``ranks`` ranks finished (at step ``steps`` when given) with the
    digest the pod ``reference`` computed in one process: bitwise the same parameters."""
    final = {
        r: last_line(cluster, ns, p["metadata"]["name"]) for r, p in watched.rank_pods().items()
    }
    expected = framework.eventually(
        lambda: last_line(cluster, ns, reference).get("digest"),
        timeout=300,
        what=f"the digest {reference} computes",
    )
    assert sorted(final) == list(range(ranks))
    for rank, line in final.items():
        assert line.get("finished") is True, (rank, line)
        assert steps is None or line["step"] == steps, (rank, line)
        assert line["digest"] == expected, (rank, line, expected)


class EndedPods:
    """Keeps the log of every pod of ``namespace`` whose container ended, read while the test
    runs (a recovery deletes a failed pod, and its log with it): the last lines printed when
    the block fails, the whole in ``logs``. Polls every 2 s for at most ``limit`` seconds."""

    def __init__(self, cluster: framework.TestCluster, ns: str, limit: float = 900) -> None:
        self.cluster, self.namespace, self.limit = cluster, ns, limit
        self.seen: dict[str, str] = {}  # pod UID -> "name on node: exit code + log tail"
        self.logs: dict[str, str] = {}  # pod UID -> its whole log
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EndedPods:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        if exc[0] is not None:
            print("\n\n".join(self.seen.values()))

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit
        while not self.stop.wait(2) and time.monotonic() < deadline:
            out = self.cluster.kubectl(
                "get", "pods", "-n", self.namespace, "-o", "json", check=False
            )
            if out.returncode:
                continue
            for pod in json.loads(out.stdout)["items"]:
                uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
                statuses = pod["status"].get("containerStatuses") or []
                ended = [s["state"]["terminated"] for s in statuses if "terminated" in s["state"]]
                if uid in self.seen or not ended:
                    continue
                logs = self.cluster.kubectl("logs", "-n", self.namespace, name, check=False).stdout
                self.logs[uid] = logs
                tail = "\n".join(logs.splitlines()[-40:])
                where = pod["spec"].get("nodeName")
                restore = (pod["metadata"].get("annotations") or {}).get("matrixpool.dev/restore")
                head = f"--- {name} on {where}, exit {ended[0].get('exitCode')}, restore {restore}"
                self.seen[uid] = f"{head}\n{tail}"


class Watched:
    """A TrainingJob of a test, read as the tests wait on it: its status, its rank pods."""

    def __init__(self, cluster: framework.TestCluster, ns: str, name: str) -> None:
        self.cluster, self.namespace, self.name = cluster, ns, name

    def status(self) -> dict[str, Any]:
        body = self.cluster.api.custom.get_namespaced_custom_object(
            "matrixpool.dev", "v1alpha1", self.namespace, "trainingjobs", self.name
        )
        return dict(body.get("status") or {})

    def training(self, past: int, timeout: float = 300) -> dict[str, Any]:
        """The status once the job runs, recovers nothing, and committed a step after ``past``."""

        def probe() -> dict[str, Any] | None:
            now = self.status()
            step = (now.get("checkpoints") or {}).get("memory")
            running_now = now.get("phase") == "Running" and not now.get("recovering")
            return now if running_now and isinstance(step, int) and step > past else None

        what = f"{self.name} running past step {past}"
        return framework.eventually(probe, timeout=timeout, what=what)

    def succeeded(self, timeout: float = 300) -> None:
        """Once the job's phase is Succeeded (every rank finished)."""
        framework.eventually(
            lambda: self.status().get("phase") == "Succeeded",
            timeout=timeout,
            interval=1,
            what=f"{self.name} Succeeded",
        )

    def recovered(self, count: int, timeout: float = 300) -> dict[str, Any]:
        """Entry ``count`` of status.recoveries, once that recovery has ended."""

        def probe() -> dict[str, Any] | None:
            now = self.status()
            entries = now.get("recoveries") or []
            done = len(entries) >= count and now.get("phase") in ("Running", "Succeeded")
            return entries[count - 1] if done and not now.get("recovering") else None

        return framework.eventually(probe, timeout=timeout, interval=1, what=f"recovery {count}")

    def rank_pods(self) -> dict[int, dict[str, Any]]:
        out = self.cluster.kubectl(
            "get", "pods", "-n", self.namespace, "-l", f"matrixpool.dev/job={self.name}",
            "-o", "json",
        )  # fmt: skip
        return {
            int(p["metadata"]["labels"]["matrixpool.dev/rank"]): p
            for p in json.loads(out.stdout)["items"]
            if not p["metadata"].get("deletionTimestamp")
        }
