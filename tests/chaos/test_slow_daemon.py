"""One slow checkpoint daemon does not stall the operator (issue 12, "daemon I/O off the
loop"): the operator reaches one node's daemon through a proxy that answers every request
:data:`DELAY` seconds late. The calls that ask it time out (a pass waits at most a few seconds
for recovery's heartbeats and polls), so other jobs are still bound, and the training job on
that node still recovers (its daemon counts as unreachable)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

from tests.chaos.test_recovery import JOB, node_of, start_job, status, wait_training
from tests.integration import chart, framework, manifests

DELAY = 5.0  # seconds the slow daemon takes before it answers anything


class SlowProxy:
    """A TCP proxy that waits DELAY seconds on every connection before passing it on. It
    listens on the daemon's own address (another port): the operator believes a daemon Lease
    only at its node's InternalIP."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.server = socket.create_server((host, 0))
        self.address = f"{host}:{self.server.getsockname()[1]}"
        self.stopped = threading.Event()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        self.server.settimeout(0.5)
        while not self.stopped.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self.serve, args=(client,), daemon=True).start()

    def serve(self, client: socket.socket) -> None:
        time.sleep(DELAY)
        try:
            with client, socket.create_connection(self.upstream, timeout=30) as upstream:
                pipes = [
                    threading.Thread(target=pipe, args=(a, b), daemon=True)
                    for a, b in ((client, upstream), (upstream, client))
                ]
                for thread in pipes:
                    thread.start()
                for thread in pipes:
                    thread.join(timeout=60)
        except OSError:
            return  # the operator gave up waiting: that is the point

    def close(self) -> None:
        self.stopped.set()
        self.server.close()


def pipe(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
        target.shutdown(socket.SHUT_WR)
    except OSError:
        return


def test_a_daemon_answering_after_5_s_stalls_neither_scheduling_nor_the_recovery(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path, replicas=4, supernode="sn-0")
    wait_training(cluster, namespace, past=4)
    slow_node = node_of(cluster, namespace)[0]
    real = framework.daemon_endpoints(cluster, chart.SYSTEM)[slow_node]
    proxy = SlowProxy(real)
    try:
        framework.set_daemon_endpoint(cluster, slow_node, proxy.address, chart.SYSTEM)
        started = time.monotonic()
        for index in range(3):  # other jobs, one after the other, on the other supernode
            name = f"other-{index}"
            job = manifests.training_job(name).replicas(2).cards(8).on("sn-1")
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())
            asked = time.monotonic()
            framework.eventually(
                lambda name=name: bound(cluster, namespace, name) == 2,
                timeout=60,
                what=f"{name} bound while a daemon is slow",
            )
            print(f"{name} bound in {time.monotonic() - asked:.2f} s")

        def recovered() -> dict[str, Any] | None:
            current = status(cluster, namespace)
            done = current.get("recoveries") and current.get("phase") == "Running"
            return current if done and not current.get("recovering") else None

        final = framework.eventually(recovered, timeout=120, what=f"{JOB} recovered")
        entry = final["recoveries"][-1]
        print(f"recovery {entry} after {time.monotonic() - started:.1f} s")
        assert slow_node in entry["cause"], entry
    finally:
        proxy.close()
        framework.set_daemon_endpoint(cluster, slow_node, real, chart.SYSTEM)


def bound(cluster: framework.TestCluster, namespace: str, name: str) -> int:
    items = cluster.api.core.list_namespaced_pod(
        namespace, label_selector=f"matrixpool.dev/job={name}"
    ).items
    return sum(1 for p in items if p.spec.node_name)
