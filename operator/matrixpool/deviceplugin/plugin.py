"""The device plugin's life beside a kubelet: serve the DevicePlugin service on a unix socket in
the kubelet's device-plugins folder, register it with the kubelet, and do both again whenever
the kubelet restarts.

A restarting kubelet removes every socket in that folder and creates a new ``kubelet.sock``;
it then knows no plugin. As NVIDIA's plugin does, the plugin watches for that: a
``kubelet.sock`` that is another file (inode and change time: a file system may hand a freed
inode number to the new socket), or its own socket gone, and it stops its server, serves on a
fresh socket and registers again. Polled every ``Config.poll_seconds``.

Run by ``python -m matrixpool.deviceplugin`` (and the unit tests, against a fake kubelet).
"""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc
import structlog

from matrixpool.deviceplugin import api_pb2, api_pb2_grpc, health, kube, service

log = structlog.get_logger(__name__)

VERSION = "v1beta1"  # the API version the plugin speaks (v1beta1.Version)
REGISTER_SECONDS = 5.0  # deadline of one Register call
WORKERS = 8  # gRPC server threads: one ListAndWatch stream plus the kubelet's calls
STOP_GRACE = 1.0  # seconds calls in flight get when the server stops

FileId = tuple[int, int, int]  # device, inode and change time of a file: which file it is


class Plugin:
    """Serves ``config.resource`` with ``cluster`` until :meth:`run`'s event is set."""

    def __init__(self, config: service.Config, cluster: kube.Cluster) -> None:
        self.config = config
        self.cluster = cluster
        self.health_file = health.HealthFile(config.health_file)
        self._remembered: dict[str, frozenset[int]] = {}  # allocations, across servers
        self._lock = threading.Lock()

    def run(self, stop: threading.Event) -> None:
        """1. serve on a fresh socket; 2. register with the kubelet (retrying until it
        answers); 3. watch for a kubelet restart; then again, until ``stop`` is set."""
        while not stop.is_set():
            server, servicer, executor = self._serve()
            try:
                kubelet = self._register(stop)
                if kubelet is not None:
                    self._watch(kubelet, stop)
            finally:
                servicer.close()
                server.stop(STOP_GRACE).wait()
                executor.shutdown(wait=True)
        self.config.socket.unlink(missing_ok=True)  # leave no stale socket in the folder
        log.info("device plugin stopped", resource=self.config.resource)

    def _serve(self) -> tuple[grpc.Server, service.Service, futures.ThreadPoolExecutor]:
        socket = self.config.socket
        socket.unlink(missing_ok=True)  # a previous run's socket would refuse the bind
        servicer = service.Service(
            self.config, self.cluster, self.health_file, self._remembered, self._lock
        )
        executor = futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="deviceplugin")
        server = grpc.server(executor)
        api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)
        if not server.add_insecure_port(f"unix://{socket}"):
            raise OSError(f"cannot serve on {socket}")
        server.start()
        log.info("serving", socket=str(socket), resource=self.config.resource)
        return server, servicer, executor

    def _register(self, stop: threading.Event) -> FileId | None:
        """Register until the kubelet accepts; which kubelet socket file it accepted on, None
        if ``stop`` came first."""
        while not stop.is_set():
            kubelet = _file_id(self.config.kubelet_socket)
            if kubelet is not None:
                try:
                    self._register_once()
                except grpc.RpcError as error:
                    log.warning("kubelet refused registration", error=str(error))
                else:
                    log.info(
                        "registered with the kubelet",
                        resource=self.config.resource,
                        endpoint=self.config.socket.name,
                    )
                    return kubelet
            stop.wait(self.config.poll_seconds)
        return None

    def _register_once(self) -> None:
        request = api_pb2.RegisterRequest(
            version=VERSION,
            endpoint=self.config.socket.name,  # relative to the kubelet's folder
            resource_name=self.config.resource,
            options=service.options(),
        )
        with grpc.insecure_channel(f"unix://{self.config.kubelet_socket}") as channel:
            api_pb2_grpc.RegistrationStub(channel).Register(
                request, timeout=REGISTER_SECONDS, wait_for_ready=True
            )

    def _watch(self, kubelet: FileId, stop: threading.Event) -> None:
        """Return when the kubelet has restarted (another socket) or removed the plugin's."""
        while not stop.wait(self.config.poll_seconds):
            if _file_id(self.config.kubelet_socket) != kubelet:
                log.info("the kubelet restarted: registering again")
                return
            if not self.config.socket.exists():
                log.info("the plugin's socket was removed: serving and registering again")
                return


def _file_id(path: Path) -> FileId | None:
    try:
        found = path.stat()
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino, found.st_ctime_ns)
