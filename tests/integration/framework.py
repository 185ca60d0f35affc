"""The integration-test framework: a real local control plane (etcd, kube-apiserver,
controller-manager, scheduler, kwok) started once per test session, the operator as a real
subprocess, and polling with deadlines. Used by tests/integration and tests/chaos.

A control plane that cannot start fails the session; it is never skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from matrixpool.api import labels
from matrixpool.devcluster import binaries, cluster, topology
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import daemonleases
from matrixpool_recovery import credentials

REPO = binaries.repo_root()
T = TypeVar("T")


def eventually(
    probe: Callable[[], T | None],
    *,
    timeout: float = 30.0,
    interval: float = 0.2,
    what: str = "condition",
) -> T:
    """Call ``probe`` until it returns something truthy; fail with the last value after
    ``timeout`` seconds. Tests wait with this, never with bare sleeps."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f} s; last: {last!r}")
        time.sleep(interval)


@dataclass
class TestCluster:
    """Handle on the session's control plane."""

    local: cluster.Cluster
    shape: topology.Shape

    @property
    def kubeconfig(self) -> Path:
        return self.local.kubeconfig

    @property
    def bin_dir(self) -> Path:
        return self.local.bin_dir

    @property
    def api(self) -> k8s_client.Api:
        return k8s_client.from_kubeconfig(self.kubeconfig)

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self._run("kubectl", [cluster.kubectl_path(), *args], self.env(), input, check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run("helm", [str(self.bin_dir / "helm"), *args], self.env(), None, check)

    def matrixpool(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The ``matrixpool`` CLI against this cluster."""
        env = {**self.env(), "MATRIXPOOL_CLUSTER_DIR": str(self.local.folder)}
        argv = [sys.executable, "-m", "matrixpool.cli", *args]
        return self._run("matrixpool", argv, env, None, check)

    @staticmethod
    def _run(
        name: str, argv: list[str], env: dict[str, str], input: str | None, check: bool
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, env=env, check=False
        )
        if check and result.returncode:
            raise AssertionError(f"{name} {' '.join(argv[1:])} failed:\n{result.stderr}")
        return result


def start_cluster(folder: Path, shape: topology.Shape) -> TestCluster:
    local = cluster.Cluster(folder, progress=lambda line: print(line, file=sys.stderr), tied=True)
    local.up(shape, crds=REPO / "crds")
    return TestCluster(local=local, shape=shape)


@dataclass
class Operator:
    """``matrixpool run`` as a real subprocess, killable at any moment."""

    cluster: TestCluster
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # extra environment, e.g. test knobs
    process: subprocess.Popen[bytes] | None = field(default=None)

    metrics_port: int = field(default_factory=lambda: cluster.free_ports(1)[0])

    def start(self) -> Operator:
        env = {
            **self.cluster.env(),
            "MATRIXPOOL_LOG_FORMAT": "json",
            "MATRIXPOOL_METRICS_PORT": str(self.metrics_port),
            **self.env,
        }
        log = open(self.log_path, "ab")  # noqa: SIM115 -- owned by the child for its life
        self.process = subprocess.Popen(
            [sys.executable, "-m", "matrixpool.cli", "run"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Sim:
    """``matrixpool sim`` as a real subprocess: a daemon per node, a trainer per pod."""

    cluster: TestCluster
    folder: Path
    supernodes: tuple[str, ...] = ()  # empty: every supernode
    persistent_root: Path | None = None  # tier-3 URIs must be inside; None: folder/persistent
    process: subprocess.Popen[bytes] | None = field(default=None)
    port: int = field(default_factory=lambda: cluster.free_ports(1)[0])  # other sims run beside
    daemons: str = "sim"  # "chart": the chart's DaemonSet runs the daemons (as pods of the sim)
    shared_paths: tuple[str, ...] = ()  # host paths that are one folder on every node
    # The image's stand-in: the Python the sim runs from is first on every pod's PATH (its
    # virtualenv's torchrun too, for .venv-torch's).
    python: str = sys.executable

    def start(self) -> Sim:
        argv = [self.python, "-m", "matrixpool.cli", "sim", "--folder", str(self.folder)]
        argv += ["--port", str(self.port), "--daemons", self.daemons]
        for path in self.shared_paths:
            argv += ["--shared-path", path]
        if self.persistent_root is not None:
            argv += ["--persistent-root", str(self.persistent_root)]
        for name in self.supernodes:
            argv += ["--supernode", name]
        log = open(self.folder.with_suffix(".log"), "ab")  # noqa: SIM115 -- the child's
        self.process = subprocess.Popen(
            argv,
            env=self.cluster.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        if self.daemons == "sim":
            eventually(
                lambda: (self.folder / "serving").exists(),
                timeout=180,
                what="every simulated node's checkpoint daemon published",
            )
        return self

    @property
    def token_file(self) -> Path:
        return self.folder / "token"

    def operator_env(self) -> dict[str, str]:
        """What an operator beside this sim is told, as the chart tells it: the daemons'
        cluster secret and port."""
        return {
            "MATRIXPOOL_CKPT_SECRET_FILE": str(self.folder / "secret"),
            "MATRIXPOOL_CKPT_DAEMON_PORT": str(self.port),
        }

    def operator_token(self) -> str:
        """The operator's credential for the sim's daemons (derived from their secret)."""
        return credentials.operator_token(credentials.read_secret(self.token_file))

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)

    def log(self) -> str:
        path = self.folder.with_suffix(".log")
        return path.read_text(errors="replace") if path.exists() else ""

    def trainer_lines(self, namespace: str, pod: str) -> list[dict[str, Any]]:
        """Every JSON line the trainers of ``pod`` printed (on any node), oldest first."""
        lines: list[dict[str, Any]] = []
        for path in sorted((self.folder / "trainers").glob(f"*.{namespace}.{pod}.log")):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    try:
                        lines.append(json.loads(line))
                    except ValueError:
                        continue
        return sorted(lines, key=lambda line: float(line.get("t", 0)))


@contextlib.contextmanager
def sim_on(cluster: TestCluster, folder: Path, supernode: str) -> Iterator[Sim]:
    """The SuperNode ``supernode`` (its YAML) applied and a sim on it; after, the sim stopped
    (its log's tail printed), the SuperNode deleted, and none of its daemons' Leases left to go
    stale and mark its nodes unreachable for the tests after."""
    name = str(yaml_name(supernode))
    cluster.kubectl("apply", "-f", "-", input=supernode)
    process = Sim(cluster, folder, supernodes=(name,)).start()
    try:
        yield process
    finally:
        process.stop()
        print(process.log()[-5000:])
        cluster.kubectl("delete", "sn", name, check=False)
    assert daemon_endpoints(cluster) == {}


def yaml_name(manifest: str) -> str:
    """``metadata.name`` of a one-object YAML manifest."""
    return str(yaml.safe_load(manifest)["metadata"]["name"])


@contextlib.contextmanager
def operator_beside(
    cluster: TestCluster, sim: Sim, log: Path, env: dict[str, str], kind: type[Operator] = Operator
) -> Iterator[Operator]:
    """The operator told what the chart tells it of ``sim``'s daemons, plus ``env``; killed
    after, its log's tail printed."""
    process = kind(cluster, log, env={**sim.operator_env(), **env}).start()
    try:
        yield process
    finally:
        process.kill()
        print(process.log()[-20000:])


class Endpoints:
    """An InferenceService's serving pods as a Service's endpoints would list them, by role
    (the first set: ``roles[0]``'s, or every pod's without roles; the second: ``roles[1]``'s):
    not terminating, answering ``health``; refreshed by a thread of its own every 0.5 s."""

    def __init__(
        self,
        cluster: TestCluster,
        namespace: str,
        name: str,
        port: int,
        health: str,
        roles: tuple[str, str] | None = None,
    ) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.port, self.health, self.roles = port, health, roles
        self.now: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self.seen: set[str] = set()  # every endpoint listed so far
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.follow, daemon=True)

    def __enter__(self) -> Endpoints:
        self.now = self.read()
        self.seen.update(*self.now)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def follow(self) -> None:
        while not self.stop.wait(0.5):
            self.now = self.read()
            self.seen.update(*self.now)

    def stopped(self) -> bool:
        """Whether every endpoint that left the list no longer answers (its pod's processes
        have drained and exited). kwok removes a deleted pod's object at once and may give its
        address to the next pod while the old processes still drain behind it (a kubelet keeps
        the address until they are gone): a scale-up must not come before this. The list is
        read afresh: the thread's may be half a second old and still name a pod just deleted,
        whose processes still answer (CI of 5188e2d: the burst's scale-up came two seconds
        after the scale-down, took the address of a pod in its preStop sleep, and lost 5
        requests when that pod's engine exited)."""
        current = {url for urls in self.read() for url in urls}
        return not any(self.healthy(url) for url in self.seen - current)

    def read(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        pods = self.cluster.api.core.list_namespaced_pod(
            self.namespace, label_selector=f"{labels.JOB}={self.name}"
        ).items
        found: tuple[list[str], list[str]] = ([], [])
        for pod in pods:
            ip = pod.status.pod_ip if pod.status else None
            role = (pod.metadata.labels or {}).get(labels.ROLE, "")
            side = 0 if self.roles is None else self.roles.index(role) if role in self.roles else -1
            url = f"http://{ip}:{self.port}"
            if ip and not pod.metadata.deletion_timestamp and side >= 0 and self.healthy(url):
                found[side].append(url)
        return tuple(sorted(found[0])), tuple(sorted(found[1]))

    def healthy(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(f"{url}{self.health}", timeout=0.5):
                return True
        except (urllib.error.URLError, OSError):
            return False


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def gang_pods(cluster: TestCluster, namespace: str | None = None) -> list[dict[str, Any]]:
    """Pods of matrixpool gangs, in one namespace or all."""
    scope = ["-n", namespace] if namespace else ["-A"]
    out = cluster.kubectl("get", "pods", *scope, "-l", "matrixpool.dev/job", "-o", "json").stdout
    return list(json.loads(out)["items"])


def daemon_endpoints(cluster: TestCluster, namespace: str | None = None) -> dict[str, str]:
    """Node → its checkpoint daemon's host:port, as the daemons' Leases in the operator's
    namespace (``namespace``; default this process's) announce it
    (matrixpool.k8s.daemonleases)."""
    leases = cluster.api.coordination.list_namespaced_lease(
        namespace or k8s_client.operator_namespace(), label_selector=f"{labels.CKPT_DAEMON}=true"
    ).items
    return {
        lease.spec.holder_identity: (lease.metadata.annotations or {}).get(labels.CKPT_ENDPOINT, "")
        for lease in leases
        if lease.spec.holder_identity
    }


def set_daemon_endpoint(
    cluster: TestCluster, node: str, endpoint: str, namespace: str | None = None
) -> None:
    """Point ``node``'s daemon Lease (in the operator's ``namespace``) at ``endpoint``
    (renewals keep it: they move renewTime only)."""
    cluster.api.coordination.patch_namespaced_lease(
        daemonleases.lease_name(node),
        namespace or k8s_client.operator_namespace(),
        {"metadata": {"annotations": {labels.CKPT_ENDPOINT: endpoint}}},
    )
