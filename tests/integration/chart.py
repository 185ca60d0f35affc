"""The chart installed by ``helm install`` on a test cluster, with ``matrixpool sim --daemons
chart`` as the process kubelet of its nodes: the operator and the checkpoint daemons are the
chart's pods. Used by the chaos and end-to-end suites (docs/install-kind.md shows the same)."""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrixpool.devcluster import cluster as devcluster
from matrixpool.devcluster import topology
from matrixpool_recovery import credentials
from tests.integration import framework

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "matrixpool"
VALUES = CHART / "ci" / "local-values.yaml"
RELEASE = "matrixpool"  # the release the local cluster's pod-annotations policy was rendered for
SYSTEM = "matrixpool-system"
SHARED = "/var/lib/matrixpool/persistent"  # the chart's persistentPath: shared by every node


@dataclass
class Installed:
    """The chart's release on the cluster, and the sim that runs its pods."""

    cluster: framework.TestCluster
    sim: framework.Sim
    ports: dict[str, int]
    extra_env: dict[str, str]
    operator_node: str | None = None  # nodeSelector of the operator (one no test breaks)
    sets: tuple[str, ...] = ()  # further --set values of the suite (e.g. the device plugin)

    def pods(self, component: str | None = None) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={RELEASE}"
        if component:
            selector += f",app.kubernetes.io/component={component}"
        out = self.cluster.kubectl("get", "pods", "-n", SYSTEM, "-l", selector, "-o", "json")
        return [
            p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")
        ]

    def operator_pod(self) -> dict[str, Any]:
        found = self.pods("operator")
        assert len(found) == 1, [p["metadata"]["name"] for p in found]
        return found[0]

    def operator_uid(self) -> str | None:
        """The UID of the operator's pod, or None while there is not exactly one (a rollout)."""
        found = self.pods("operator")
        return str(found[0]["metadata"]["uid"]) if len(found) == 1 else None

    def container_file(self, pod: dict[str, Any], suffix: str) -> Path:
        meta = pod["metadata"]
        name = f"{pod['spec']['nodeName']}.{meta['namespace']}.{meta['name']}{suffix}"
        return self.sim.folder / "trainers" / name

    def log_of(self, pod: dict[str, Any], container: str | None = None) -> str:
        """What a container the sim runs printed (its log file in the sim's folder)."""
        path = self.container_file(pod, f".{container}.log" if container else ".log")
        return path.read_text(errors="replace") if path.exists() else ""

    def operator_log(self) -> str:
        try:
            return self.log_of(self.operator_pod())
        except AssertionError:
            return ""

    def kill_operator(self) -> None:
        """SIGKILL the operator's process: its kubelet starts it again."""
        pid = int(self.container_file(self.operator_pod(), ".pid").read_text())
        os.kill(pid, signal.SIGKILL)

    def operator_running(self) -> bool:
        return self.operator_uid() is not None and "main loop started" in self.operator_log()

    def cluster_secret(self) -> str:
        """The daemons' cluster secret, from the chart's Secret."""
        secret = self.cluster.api.core.read_namespaced_secret(f"{RELEASE}-checkpoint", SYSTEM)
        return base64.b64decode(secret.data["token"]).decode().strip()

    def operator_token(self) -> str:
        return credentials.operator_token(self.cluster_secret())

    def set_operator_env(self, env: dict[str, str]) -> None:
        """``helm upgrade`` with ``env`` as the operator's extra env: the Deployment replaces
        its pod (Recreate: the old operator is killed first); waits until the new one runs."""
        old = self.operator_uid()
        self.extra_env = dict(env)
        self.cluster.helm("upgrade", RELEASE, str(CHART), "-n", SYSTEM, *self.helm_args())
        framework.eventually(
            lambda: self.operator_uid() not in (None, old) and self.operator_running(),
            timeout=90,
            what="the operator's new pod running",
        )

    def helm_args(self) -> list[str]:
        ports = self.ports
        args = [
            "-f",
            str(VALUES),
            "--set",
            ",".join(
                [
                    f"checkpointDaemon.port={ports['daemon']}",
                    f"metrics.port={ports['metrics']}",
                    f"operator.healthPort={ports['health']}",
                ]
            ),
        ]
        for value in self.sets:
            args += ["--set", value]
        entries = [{"name": k, "value": v} for k, v in sorted(self.extra_env.items())]
        args += ["--set-json", f"operator.extraEnv={json.dumps(entries)}"]
        if self.operator_node:
            selector = {"kubernetes.io/hostname": self.operator_node}
            args += ["--set-json", f"nodeSelector={json.dumps(selector)}"]
        return args


def install(
    cluster: framework.TestCluster,
    folder: Path,
    nodes: int,
    operator_node: str | None = None,
    python: str = sys.executable,
    sets: tuple[str, ...] = (),
) -> Installed:
    """``helm install matrixpool charts/matrixpool -n matrixpool-system -f values-local.yaml``
    (ports picked free: other clusters may run on this machine), then the sim as the nodes'
    kubelet; returns once every one of ``nodes`` announced its daemon and the operator runs.
    ``operator_node``: where the operator runs (a node the tests never take down: an operator
    on a node that goes NotReady stays down until its pod is evicted, 5 minutes later, as on
    a real cluster). ``python``: the Python the sim runs from, and every pod with it.
    ``sets``: further ``--set`` values, kept for every later ``helm upgrade``."""
    daemon, metrics, health = devcluster.free_ports(3)
    sim = framework.Sim(
        cluster, folder, port=daemon, daemons="chart", shared_paths=(SHARED,), python=python
    )
    ports = {"daemon": daemon, "metrics": metrics, "health": health}
    release = Installed(cluster, sim, ports, {}, operator_node, sets)
    cluster.kubectl("create", "namespace", SYSTEM)
    cluster.helm("install", RELEASE, str(CHART), "-n", SYSTEM, *release.helm_args())
    sim.start()
    framework.eventually(
        lambda: len(framework.daemon_endpoints(cluster, SYSTEM)) == nodes,
        timeout=300,
        what="every node's checkpoint daemon announced by the chart's DaemonSet",
    )
    framework.eventually(release.operator_running, timeout=120, what="the chart's operator")
    return release


def own_cluster(folder: Path, shape: topology.Shape) -> Iterator[framework.TestCluster]:
    """A control plane of a suite's own, without CRDs (the chart installs them); down at the
    end unless MATRIXPOOL_KEEP_CLUSTER. Failing to start fails."""
    local = devcluster.Cluster(
        folder, progress=lambda line: print(line, file=sys.stderr), tied=True
    )
    local.up(shape)
    try:
        yield framework.TestCluster(local=local, shape=shape)
    finally:
        if not os.environ.get("MATRIXPOOL_KEEP_CLUSTER"):
            local.down()


def installed_for_session(
    cluster: framework.TestCluster,
    folder: Path,
    operator_node: str | None = None,
    python: str = sys.executable,
    sets: tuple[str, ...] = (),
) -> Iterator[Installed]:
    """:func:`install` for a session fixture; the sim stopped and its log printed after."""
    nodes = cluster.shape.node_count
    release = install(cluster, folder, nodes, operator_node=operator_node, python=python, sets=sets)
    try:
        yield release
    finally:
        release.sim.stop()
        print(release.sim.log()[-5000:])
        print(release.operator_log()[-20000:])
