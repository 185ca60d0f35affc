"""The DevicePlugin gRPC service (v1beta1) the kubelet calls on the plugin's socket: the cards
as devices ``"0".."N-1"`` with their health, and the allocation of exactly the cards the
operator chose for a pod (:mod:`matrixpool.deviceplugin.pairing`).

Served by :class:`matrixpool.deviceplugin.plugin.Plugin`, one :class:`Service` per server
(a kubelet restart means a new socket, a new server and a new Service; the old one is closed
so that its ListAndWatch stream ends).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from matrixpool.api import labels
from matrixpool.deviceplugin import api_pb2, health, kube, pairing

log = structlog.get_logger(__name__)

HEALTHY = "Healthy"  # v1beta1.Healthy
UNHEALTHY = "Unhealthy"  # v1beta1.Unhealthy
# What a container is told about its cards (DESIGN.md, scheduling contract). Both vendors'
# variables are set whatever the resource: each runtime hook reads only its own.
CARD_ENVS = (labels.ENV_CARDS, labels.ENV_ASCEND_VISIBLE_DEVICES, labels.ENV_NVIDIA_VISIBLE_DEVICES)


@dataclass(frozen=True)
class Config:
    """How one plugin is set up (``python -m matrixpool.deviceplugin`` flags)."""

    resource: str  # the extended resource advertised, e.g. huawei.com/Ascend910
    cards: int  # cards per node: devices "0".."cards-1"
    folder: Path = Path("/var/lib/kubelet/device-plugins")  # where the plugin's socket goes
    kubelet_socket: Path = Path("/var/lib/kubelet/device-plugins/kubelet.sock")  # Registration
    health_file: Path | None = None  # unhealthy cards written by a node agent; None: none
    poll_seconds: float = 1.0  # how often health and the kubelet's socket are looked at

    @property
    def socket(self) -> Path:
        """The plugin's own socket: one per resource, in the kubelet's folder."""
        return self.folder / f"matrixpool-{self.resource.replace('/', '_')}.sock"


class Service:
    """The DevicePlugin servicer (methods named as the proto's; gRPC finds them by name)."""

    def __init__(
        self,
        config: Config,
        cluster: kube.Cluster,
        health_file: health.HealthFile,
        remembered: dict[str, frozenset[int]],
        lock: threading.Lock,
    ) -> None:
        self.config = config
        self.cluster = cluster  # the pods of the node and its unhealthy-cards annotation
        self.health_file = health_file  # the node agent's unhealthy cards
        # Pod UID -> cards this process allocated; kept across servers (kubelet restarts) by
        # the Plugin, so a mark whose patch failed still counts. Dropped when the pod goes.
        self.remembered = remembered
        self.lock = lock  # one pairing at a time (the kubelet admits one pod at a time anyway)
        self.closed = threading.Event()  # set when the server stops: streams end

    def close(self) -> None:
        self.closed.set()

    # --- the v1beta1 API --------------------------------------------------------------------

    def GetDevicePluginOptions(  # noqa: N802 -- the proto's name
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return options()

    def ListAndWatch(  # noqa: N802
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        sent: frozenset[int] | None = None
        while context.is_active() and not self.closed.is_set():
            unhealthy = self.unhealthy()
            if unhealthy != sent:
                log.info(
                    "devices",
                    resource=self.config.resource,
                    cards=self.config.cards,
                    unhealthy=labels.format_cards(unhealthy),
                )
                yield api_pb2.ListAndWatchResponse(devices=self.devices(unhealthy))
                sent = unhealthy
            self.closed.wait(self.config.poll_seconds)

    def GetPreferredAllocation(  # noqa: N802
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        responses = []
        for ask in request.container_requests:
            available = _ids(ask.available_deviceIDs, context)
            must = _ids(ask.must_include_deviceIDs, context)
            cards = self._prefer(available, must, ask.allocation_size)
            responses.append(
                api_pb2.ContainerPreferredAllocationResponse(deviceIDs=[str(c) for c in cards])
            )
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(  # noqa: N802
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        responses = []
        for ask in request.container_requests:
            cards = self._allocate(_ids(ask.devices_ids, context))
            value = labels.format_cards(cards)
            responses.append(
                api_pb2.ContainerAllocateResponse(envs=dict.fromkeys(CARD_ENVS, value))
            )
        return api_pb2.AllocateResponse(container_responses=responses)

    def PreStartContainer(  # noqa: N802
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()  # not asked for (pre_start_required false)

    # --- devices and pairing ----------------------------------------------------------------

    def unhealthy(self) -> frozenset[int]:
        """Cards of this node marked unhealthy by its annotation or the health file."""
        marked = self.cluster.unhealthy_cards() | self.health_file.cards()
        return frozenset(c for c in marked if c < self.config.cards)

    def devices(self, unhealthy: frozenset[int]) -> list[api_pb2.Device]:
        return [
            api_pb2.Device(ID=str(card), health=UNHEALTHY if card in unhealthy else HEALTHY)
            for card in range(self.config.cards)
        ]

    def _pods(self) -> list[pairing.Pod] | None:
        """The node's pods, forgetting allocations of pods that are gone; None: API error."""
        try:
            pods = self.cluster.pods()
        except Exception as error:  # pairing falls back on the kubelet's choice
            log.error("cannot list the node's pods", error=str(error))
            return None
        present = {pod.uid for pod in pods}
        for uid in [uid for uid in self.remembered if uid not in present]:
            del self.remembered[uid]
        return pods

    def _prefer(self, available: frozenset[int], must: frozenset[int], size: int) -> list[int]:
        with self.lock:
            pods = self._pods()
            pod = (
                None
                if pods is None
                else pairing.preferred(pods, size, available, must, self.remembered)
            )
        if pod is None or pod.cards is None:
            cards = pairing.kubelet_order(available, must, size)
            log.info("preferred allocation: no pod of matrixpool waits for it", cards=cards)
            return cards
        log.info("preferred allocation", pod=pod.key, uid=pod.uid, cards=sorted(pod.cards))
        return sorted(pod.cards)

    def _allocate(self, ids: frozenset[int]) -> frozenset[int]:
        with self.lock:
            pods = self._pods()
            if pods is None:
                log.warning("allocated the kubelet's devices unpaired", cards=sorted(ids))
                return ids
            held = pairing.held(pods, self.remembered)
            free = frozenset(range(self.config.cards)) - held - self.unhealthy()
            allocation = pairing.allocate(pods, ids, free, self.remembered)
            if allocation.pod is not None:
                self.remembered[allocation.pod.uid] = allocation.cards
        _log_allocation(allocation, ids, held)
        if allocation.pod is not None:
            self._mark(allocation.pod, allocation.cards)
        return allocation.cards

    def _mark(self, pod: pairing.Pod, cards: frozenset[int]) -> None:
        try:
            self.cluster.mark_allocated(pod, cards)
        except Exception as error:  # remembered in memory; a restarted plugin may pair it again
            log.error("cannot mark the pod allocated", pod=pod.key, uid=pod.uid, error=str(error))


def options() -> api_pb2.DevicePluginOptions:
    """What the plugin offers the kubelet: preferred allocations, no PreStartContainer."""
    return api_pb2.DevicePluginOptions(
        pre_start_required=False, get_preferred_allocation_available=True
    )


def _ids(values: Iterable[str], context: grpc.ServicerContext) -> frozenset[int]:
    try:
        return frozenset(int(value) for value in values)
    except ValueError:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a card of this plugin: {values}")
        raise  # abort raises; this keeps the type checker's reading of the flow


def _log_allocation(
    allocation: pairing.Allocation, ids: frozenset[int], held: frozenset[int]
) -> None:
    pod = allocation.pod
    fields = {
        "cards": sorted(allocation.cards),
        "kubelet": sorted(ids),
        "pod": pod.key if pod else None,
        "uid": pod.uid if pod else None,
        "reason": allocation.reason,
    }
    if allocation.reason == "preferred":
        log.info("allocated the pod's cards", **fields)
    elif allocation.reason == "annotation":
        log.warning("allocated the pod's cards, not the kubelet's devices", **fields)
    elif allocation.reason == "taken":
        log.warning("the pod's cards are in use: allocated the kubelet's devices", **fields)
    else:
        log.info("no pod of matrixpool waits for it: allocated the kubelet's devices", **fields)
    if allocation.cards & held:
        log.error("allocated cards already in use", cards=sorted(allocation.cards & held))
