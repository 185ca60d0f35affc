"""The kubelet device plugin (matrixpool.deviceplugin), over real gRPC on unix sockets.

A fake kubelet serves the Registration service on ``kubelet.sock`` in a temporary folder; the
plugin runs in a thread against it and a fake :class:`kube.Cluster` (pods as the API returns
them); the tests then call the plugin's socket as the kubelet does: ListAndWatch,
GetPreferredAllocation, Allocate. Pairing and the health file are also tested alone.
"""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import kubernetes
import pytest
import structlog

from matrixpool.api import labels
from matrixpool.deviceplugin import (
    __main__,
    api_pb2,
    api_pb2_grpc,
    health,
    kube,
    pairing,
    plugin,
    service,
)
from matrixpool.k8s import client as k8s_client

RESOURCE = "huawei.com/Ascend910"
CARDS = 8
DEADLINE = 5.0  # seconds any one wait of a test may take before it fails
ENVS = ("MATRIXPOOL_CARDS", "ASCEND_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


# --- builders and fakes --------------------------------------------------------------------


class PodBuilder:
    """A pod bound to the node, as the API returns it: ``pod("a").cards("0,1").created(2)``."""

    def __init__(self, name: str) -> None:
        self.manifest: dict[str, Any] = {
            "metadata": {
                "name": name,
                "namespace": "ml",
                "uid": f"uid-{name}",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "annotations": {},
            },
            "spec": {"nodeName": "node-0", "containers": [{"name": "main"}]},
            "status": {"phase": "Pending"},
        }

    def cards(self, value: str) -> PodBuilder:
        """Placed by the operator on ``value``, asking as many cards."""
        self.manifest["metadata"]["annotations"][labels.CARDS] = value
        return self.asks(len(labels.parse_cards(value)))

    def asks(self, count: int) -> PodBuilder:
        limits = {RESOURCE: str(count)}
        self.manifest["spec"]["containers"][0]["resources"] = {"limits": limits, "requests": limits}
        return self

    def created(self, second: int) -> PodBuilder:
        self.manifest["metadata"]["creationTimestamp"] = f"2026-01-01T00:00:{second:02d}Z"
        return self

    def phase(self, phase: str) -> PodBuilder:
        self.manifest["status"]["phase"] = phase
        return self

    def allocated(self, value: str) -> PodBuilder:
        self.manifest["metadata"]["annotations"][pairing.ALLOCATED] = value
        return self

    def build(self) -> pairing.Pod:
        return pairing.pod_from_manifest(self.manifest, RESOURCE)


def pod(name: str) -> PodBuilder:
    return PodBuilder(name)


class FakeCluster:
    """The node's pods by UID and its unhealthy-cards annotation; a mark patches the pod's
    annotations as the API server would."""

    def __init__(self, *pods: PodBuilder) -> None:
        self.manifests = {p.manifest["metadata"]["uid"]: p.manifest for p in pods}
        self.unhealthy: frozenset[int] = frozenset()
        self.marks: list[tuple[str, str]] = []  # (pod name, cards) per mark_allocated
        self.list_fails = False  # pods() raises, as an unreachable API server
        self.mark_fails = False  # mark_allocated() raises

    def pods(self) -> list[pairing.Pod]:
        if self.list_fails:
            raise ConnectionError("API server unreachable")
        return [pairing.pod_from_manifest(m, RESOURCE) for m in self.manifests.values()]

    def mark_allocated(self, pod: pairing.Pod, cards: frozenset[int]) -> None:
        if self.mark_fails:
            raise ConnectionError("API server unreachable")
        value = labels.format_cards(cards)
        self.manifests[pod.uid]["metadata"]["annotations"][pairing.ALLOCATED] = value
        self.marks.append((pod.name, value))

    def unhealthy_cards(self) -> frozenset[int]:
        return self.unhealthy


class FakeKubelet:
    """The kubelet's Registration service on ``socket``, keeping every RegisterRequest."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.requests: queue.Queue[api_pb2.RegisterRequest] = queue.Queue()
        self._executor = futures.ThreadPoolExecutor(2, thread_name_prefix="fake-kubelet")
        self._server = grpc.server(self._executor)
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self._server)
        assert self._server.add_insecure_port(f"unix://{socket}")
        self._server.start()

    def Register(  # noqa: N802 -- the proto's name
        self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> api_pb2.Empty:
        self.requests.put(request)
        return api_pb2.Empty()

    def registered(self) -> api_pb2.RegisterRequest:
        return self.requests.get(timeout=DEADLINE)

    def stop(self) -> None:
        self._server.stop(0).wait()
        self._executor.shutdown(wait=True)


@dataclass
class Node:
    """A running plugin, its fake kubelet and cluster, and a kubelet-side client."""

    config: service.Config
    cluster: FakeCluster
    kubelet: FakeKubelet
    registration: api_pb2.RegisterRequest  # the first one: the kubelet calls the plugin after it
    logs: list[dict[str, Any]]  # what the plugin logged (structlog's capture)

    @property
    def health_file(self) -> Path:
        assert self.config.health_file is not None
        return self.config.health_file

    def client(self) -> tuple[grpc.Channel, Any]:
        # Reconnect fast: a test may call while the plugin serves again on a fresh socket.
        backoff = [
            ("grpc.initial_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 100),
        ]
        channel = grpc.insecure_channel(f"unix://{self.config.socket}", options=backoff)
        return channel, api_pb2_grpc.DevicePluginStub(channel)

    def prefer(self, available: str, size: int, must: str = "") -> str:
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available.split(","),
                    must_include_deviceIDs=must.split(",") if must else [],
                    allocation_size=size,
                )
            ]
        )
        channel, stub = self.client()
        with channel:
            [answer] = stub.GetPreferredAllocation(request, timeout=DEADLINE).container_responses
        return ",".join(answer.deviceIDs)

    def allocate(self, ids: str) -> dict[str, str]:
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids.split(","))]
        )
        channel, stub = self.client()
        with channel:
            [answer] = stub.Allocate(request, timeout=DEADLINE).container_responses
        return dict(answer.envs)

    def admit(self, available: str, size: int) -> dict[str, str]:
        """What the kubelet does for a container: ask the preferred cards, allocate them."""
        return self.allocate(self.prefer(available, size))


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short folder: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="mpdp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(folder: Path) -> Iterator[Node]:
    config = service.Config(
        resource=RESOURCE,
        cards=CARDS,
        folder=folder,
        kubelet_socket=folder / "kubelet.sock",
        health_file=folder / "unhealthy-cards",
        poll_seconds=0.05,
    )
    cluster = FakeCluster()
    kubelet = FakeKubelet(config.kubelet_socket)
    running = plugin.Plugin(config, cluster)
    stop = threading.Event()
    thread = threading.Thread(target=running.run, args=(stop,), name="test-deviceplugin")
    with structlog.testing.capture_logs() as logs:
        thread.start()
        try:
            yield Node(config, cluster, kubelet, kubelet.registered(), logs)
        finally:
            stop.set()
            thread.join(DEADLINE)
            kubelet.stop()
    assert not thread.is_alive()
    assert not config.socket.exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("deviceplugin")]


def logged(node: Node, level: str) -> list[str]:
    return [entry["event"] for entry in node.logs if entry["log_level"] == level]


def unhealthy(response: api_pb2.ListAndWatchResponse) -> str:
    return ",".join(d.ID for d in response.devices if d.health == "Unhealthy")


# --- registration -------------------------------------------------------------------------------


def test_the_plugin_registers_with_the_kubelet_as_v1beta1_with_preferred_allocation(
    node: Node,
) -> None:
    request = node.registration
    assert request.version == "v1beta1"
    assert request.resource_name == RESOURCE
    assert request.endpoint == node.config.socket.name
    assert (node.config.folder / request.endpoint).is_socket()
    assert request.options.get_preferred_allocation_available
    assert not request.options.pre_start_required
    channel, stub = node.client()
    with channel:
        options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=DEADLINE)
    assert options.get_preferred_allocation_available


def test_the_plugin_registers_again_when_the_kubelet_restarts(node: Node) -> None:
    # A restarting kubelet removes every socket of the folder and serves a new kubelet.sock.
    node.kubelet.stop()
    node.config.kubelet_socket.unlink(missing_ok=True)
    node.config.socket.unlink()
    node.kubelet = FakeKubelet(node.config.kubelet_socket)
    request = node.kubelet.registered()
    assert (request.resource_name, request.endpoint) == (RESOURCE, node.config.socket.name)
    # The plugin may have served again before the "kubelet" removed its socket: then it serves
    # and registers once more, and the call waits for that socket.
    channel, stub = node.client()
    with channel:
        stream = stub.ListAndWatch(api_pb2.Empty(), timeout=DEADLINE, wait_for_ready=True)
        assert len(next(stream).devices) == CARDS
        stream.cancel()


def test_a_new_kubelet_socket_alone_means_a_restart_too(node: Node) -> None:
    node.kubelet.stop()
    node.config.kubelet_socket.unlink(missing_ok=True)
    node.kubelet = FakeKubelet(node.config.kubelet_socket)  # the plugin's socket left in place
    assert node.kubelet.registered().resource_name == RESOURCE


# --- devices and health ---------------------------------------------------------------------


def test_list_and_watch_sends_every_card_then_each_health_change(node: Node) -> None:
    channel, stub = node.client()
    with channel:
        stream = stub.ListAndWatch(api_pb2.Empty(), timeout=DEADLINE)
        first = next(stream)
        assert [d.ID for d in first.devices] == [str(c) for c in range(CARDS)]
        assert {d.health for d in first.devices} == {"Healthy"}

        node.health_file.write_text("3,5\n")
        assert unhealthy(next(stream)) == "3,5"
        node.cluster.unhealthy = frozenset({1})  # the node's matrixpool.dev/unhealthy-cards
        assert unhealthy(next(stream)) == "1,3,5"
        node.health_file.unlink()
        assert unhealthy(next(stream)) == "1"
        stream.cancel()


def test_an_unparsable_health_file_keeps_its_last_value(tmp_path: Path) -> None:
    path = tmp_path / "unhealthy-cards"
    cards = health.HealthFile(path)
    assert cards.cards() == frozenset()
    path.write_text("2, 6")
    assert cards.cards() == {2, 6}
    path.write_text("2,")  # a writer caught halfway still parses
    assert cards.cards() == {2}
    path.write_text("two")
    assert cards.cards() == {2}
    path.write_text("")
    assert cards.cards() == frozenset()


# --- pairing over gRPC ------------------------------------------------------------------------


def test_two_4_card_pods_on_an_8_card_node_each_get_their_annotated_cards(node: Node) -> None:
    node.cluster.manifests = FakeCluster(
        pod("rank-0").cards("4,5,6,7").created(1), pod("rank-1").cards("0,1,2,3").created(2)
    ).manifests

    assert node.prefer("0,1,2,3,4,5,6,7", 4) == "4,5,6,7"  # not the kubelet's lowest four
    assert node.allocate("4,5,6,7") == dict.fromkeys(ENVS, "4,5,6,7")
    assert node.admit("0,1,2,3", 4) == dict.fromkeys(ENVS, "0,1,2,3")
    assert node.cluster.marks == [("rank-0", "4,5,6,7"), ("rank-1", "0,1,2,3")]


def test_the_oldest_waiting_pod_is_paired_first(node: Node) -> None:
    node.cluster.manifests = FakeCluster(
        pod("late").cards("0,1").created(9), pod("early").cards("6,7").created(3)
    ).manifests
    assert node.admit("0,1,2,3,4,5,6,7", 2)["MATRIXPOOL_CARDS"] == "6,7"
    assert node.cluster.marks == [("early", "6,7")]


def test_allocate_gives_the_annotated_cards_when_the_kubelet_asks_for_others(node: Node) -> None:
    node.cluster.manifests = FakeCluster(pod("rank-0").cards("2,3")).manifests
    assert node.allocate("0,1") == dict.fromkeys(ENVS, "2,3")
    assert node.cluster.marks == [("rank-0", "2,3")]
    assert logged(node, "warning") == ["allocated the pod's cards, not the kubelet's devices"]


def test_allocate_gives_the_kubelets_devices_when_the_annotated_cards_are_in_use(
    node: Node,
) -> None:
    node.cluster.manifests = FakeCluster(
        pod("running").cards("2,3").phase("Running").allocated("2,3"),
        pod("rank-0").cards("2,3").created(5),
    ).manifests
    assert node.allocate("0,1") == dict.fromkeys(ENVS, "0,1")
    assert node.cluster.marks == [("rank-0", "0,1")]  # marked: never paired again
    assert logged(node, "warning") == [
        "the pod's cards are in use: allocated the kubelet's devices"
    ]


def test_a_pod_matrixpool_did_not_place_gets_the_kubelets_devices(node: Node) -> None:
    node.cluster.manifests = FakeCluster(pod("web").asks(2)).manifests
    assert node.prefer("1,4,5,6", 2) == "1,4"
    assert node.prefer("1,4,5,6", 2, must="6") == "6,1"
    assert node.allocate("5,6") == dict.fromkeys(ENVS, "5,6")
    assert node.cluster.marks == []
    assert "no pod of matrixpool waits for it: allocated the kubelet's devices" in logged(
        node, "info"
    )


def test_an_unreachable_api_server_leaves_the_choice_to_the_kubelet(node: Node) -> None:
    node.cluster.manifests = FakeCluster(pod("rank-0").cards("2,3")).manifests
    node.cluster.list_fails = True
    assert node.prefer("0,1,2,3", 2) == "0,1"
    assert node.allocate("0,1") == dict.fromkeys(ENVS, "0,1")
    assert logged(node, "error") == ["cannot list the node's pods"] * 2


def test_an_allocation_whose_mark_failed_is_remembered(node: Node) -> None:
    node.cluster.manifests = FakeCluster(
        pod("rank-0").cards("0,1").created(1), pod("rank-1").cards("2,3").created(2)
    ).manifests
    node.cluster.mark_fails = True
    assert node.admit("0,1,2,3", 2)["MATRIXPOOL_CARDS"] == "0,1"
    # rank-0 still looks unallocated in the API: the plugin's memory keeps it from pairing twice.
    assert node.admit("2,3", 2)["MATRIXPOOL_CARDS"] == "2,3"
    assert logged(node, "error") == ["cannot mark the pod allocated"] * 2


def test_a_device_id_that_is_not_a_card_is_an_invalid_argument(node: Node) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        node.allocate("0,gpu-1")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# --- pairing alone ----------------------------------------------------------------------------


def test_a_pod_manifest_is_read_for_the_plugins_resource() -> None:
    read = pod("rank-0").cards("0,1,2,3").allocated("0,1,2,3").phase("Running").build()
    assert read == pairing.Pod(
        uid="uid-rank-0",
        namespace="ml",
        name="rank-0",
        created="2026-01-01T00:00:00Z",
        phase="Running",
        requested=4,
        cards=frozenset({0, 1, 2, 3}),
        allocated=frozenset({0, 1, 2, 3}),
    )
    other = pairing.pod_from_manifest(pod("x").cards("0").manifest, "nvidia.com/gpu")
    assert other.requested == 0


@pytest.mark.parametrize(
    ("builder", "waits"),
    [
        pytest.param(pod("p").cards("0,1"), True, id="a pending pod placed on 2 cards"),
        pytest.param(pod("p").cards("0,1").phase(""), True, id="a pod with no phase yet"),
        pytest.param(pod("p").cards("0,1").allocated("0,1"), False, id="an allocated pod"),
        pytest.param(pod("p").cards("0,1").phase("Running"), False, id="a running pod"),
        pytest.param(pod("p").cards("0,1").asks(3), False, id="a pod asking another count"),
        pytest.param(pod("p").asks(2), False, id="a pod matrixpool did not place"),
        pytest.param(pod("p").cards("0,1,2"), False, id="a pod of another size"),
    ],
)
def test_which_pods_wait_for_2_cards(builder: PodBuilder, waits: bool) -> None:
    assert bool(pairing.waiting([builder.build()], 2, {})) is waits


def test_held_cards_are_what_live_pods_were_given() -> None:
    pods = [
        pod("a").cards("0,1").allocated("0,1").phase("Running").build(),
        pod("b").cards("2,3").allocated("2,3").phase("Succeeded").build(),  # done: freed
        pod("c").cards("4").phase("Running").build(),  # started before the plugin
        pod("d").cards("5").build(),  # still waiting: not held
        pod("e").cards("6").build(),  # allocated by this process, mark not shown yet
    ]
    assert pairing.held(pods, {"uid-e": frozenset({7})}) == {0, 1, 4, 7}


def test_the_preferred_pod_must_include_what_the_kubelet_requires() -> None:
    pods = [pod("a").cards("0,1").created(1).build(), pod("b").cards("2,3").created(2).build()]
    everything = frozenset(range(CARDS))
    assert pairing.preferred(pods, 2, everything, frozenset(), {}) == pods[0]
    assert pairing.preferred(pods, 2, everything, frozenset({3}), {}) == pods[1]
    assert pairing.preferred(pods, 2, frozenset({1, 2, 3}), frozenset(), {}) == pods[1]
    assert pairing.preferred(pods, 2, frozenset({1, 2}), frozenset(), {}) is None


# --- the Kubernetes side ----------------------------------------------------------------------


class Raw:
    """A response read with _preload_content=False."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()


class FakeCore:
    """CoreV1Api: one node's pods and the Node itself; records calls."""

    def __init__(self, pods: list[PodBuilder], node_annotations: dict[str, str]) -> None:
        self.items = [p.manifest for p in pods]
        self.node = {"metadata": {"name": "node-0", "annotations": node_annotations}}
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> Raw:
        self.calls.append(("list_pod_for_all_namespaces", (), kwargs))
        return Raw({"items": self.items})

    def patch_namespaced_pod(self, *args: Any) -> None:
        self.calls.append(("patch_namespaced_pod", args, {}))

    def list_node(self, **kwargs: Any) -> Raw:
        self.calls.append(("list_node", (), kwargs))
        return Raw({"metadata": {"resourceVersion": "7"}, "items": [self.node]})


def api(core: FakeCore) -> k8s_client.Api:
    return k8s_client.Api(client=None, core=core, custom=None, extensions=None, coordination=None)


def test_the_cluster_lists_the_nodes_pods_and_marks_one_by_uid() -> None:
    core = FakeCore([pod("rank-0").cards("0,1")], {})
    cluster = kube.KubeCluster(api(core), "node-0", RESOURCE)
    [found] = cluster.pods()
    assert (found.name, found.cards, found.requested) == ("rank-0", {0, 1}, 2)
    cluster.mark_allocated(found, frozenset({1, 0}))
    assert core.calls == [
        (
            "list_pod_for_all_namespaces",
            (),
            {"field_selector": "spec.nodeName=node-0", "_preload_content": False},
        ),
        (
            "patch_namespaced_pod",
            (
                "rank-0",
                "ml",
                {"metadata": {"uid": "uid-rank-0", "annotations": {pairing.ALLOCATED: "0,1"}}},
            ),
            {},
        ),
    ]


def test_the_cluster_follows_the_nodes_unhealthy_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    core = FakeCore([], {labels.UNHEALTHY_CARDS: "3"})
    cluster = kube.KubeCluster(api(core), "node-0", RESOURCE)
    stop = threading.Event()
    seen: list[frozenset[int]] = []

    class Watch:
        def stream(self, call: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
            assert call == core.list_node
            assert kwargs["field_selector"] == "metadata.name=node-0"
            assert kwargs["resource_version"] == "7"
            seen.append(cluster.unhealthy_cards())  # from the list
            changed = {"metadata": {"annotations": {labels.UNHEALTHY_CARDS: "3,5"}}}
            yield {"type": "MODIFIED", "raw_object": changed}
            seen.append(cluster.unhealthy_cards())
            yield {"type": "MODIFIED", "raw_object": {"metadata": {"annotations": {}}}}
            seen.append(cluster.unhealthy_cards())
            stop.set()

        def stop(self) -> None:
            pass

    monkeypatch.setattr(kubernetes.watch, "Watch", Watch)
    cluster.start(stop).join(DEADLINE)
    assert seen == [{3}, {3, 5}, frozenset()]


def test_the_entry_point_refuses_a_node_without_name_or_cards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert __main__.main([]) == 2
    assert __main__.main(["--node", "node-0", "--cards", "0"]) == 2
