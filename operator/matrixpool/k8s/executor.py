"""The one executor: every action the controllers take on the cluster and every question they
ask the checkpoint daemons goes through an :class:`Executor`.

The controllers in :mod:`matrixpool.controllers` decide from the World
(:mod:`matrixpool.state.world`) and hand what they decided to the executor they were given:
create, reserve, bind, annotate and delete pods, patch a status, apply a ConfigMap, record an
Event, write a workload's credential Secret or a job's headless Service, ask the daemons for
an inventory, a heartbeat or a pin, tell them their peers and quotas, or delete a job's
checkpoints. The main loop gives them :class:`Live`, which calls the API server
(:mod:`matrixpool.k8s.pods`, :mod:`matrixpool.k8s.status`, :mod:`matrixpool.k8s.configmaps`,
:mod:`matrixpool.k8s.services`, ``kopf.event``) and the
daemons (:mod:`matrixpool.k8s.daemonclient`). Unit tests give them a recorder instead and assert
the actions a world leads to, with no API server and no daemon
(``tests/unit/controllers/test_plans.py``).

:meth:`Executor.reserve` and :meth:`Executor.bind` answer one outcome per pod (``None``: done;
else the error), so the caller knows exactly what was written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, cast

import kopf

from matrixpool.k8s import configmaps, convert, daemonclient, pods, secrets, services
from matrixpool.k8s import scrape as metrics_scrape
from matrixpool.k8s import status as k8s_status

PodKey = tuple[str, str]  # namespace, name


class Executor(Protocol):
    """Carries out the controllers' actions."""

    async def create_pods(self, manifests: Sequence[Mapping[str, Any]]) -> None:
        """Create these pods (one already there is no error)."""
        ...

    async def delete_pods(
        self, refs: Sequence[convert.PodRef], grace_seconds: int | None = None
    ) -> None:
        """Delete these pods, each by its UID (one already gone, or made again under its
        name, is no error: the new one is not touched)."""
        ...

    async def create_reserved(
        self, manifests: Sequence[Mapping[str, Any]]
    ) -> list[tuple[convert.PodFacts | None, pods.Outcome]]:
        """Create these pods, reserved in their manifests (or unreserved: a new gang that
        waits); per pod the pod as created (its UID) or the error — one that exists already is
        an error (pods.AlreadyExistsError)."""
        ...

    async def reserve(
        self, reservations: Sequence[tuple[str, str, str, str]]
    ) -> list[pods.Outcome]:
        """Reserve (namespace, pod, node, cards) before binding; one outcome per pod."""
        ...

    async def unreserve(self, keys: Sequence[PodKey]) -> None:
        """Clear a partial reservation."""
        ...

    async def bind(self, bindings: Sequence[pods.PodBinding]) -> list[pods.Outcome]:
        """Bind (namespace, pod, UID, node), the UID as precondition; one outcome per pod."""
        ...

    async def annotate(self, keys: Sequence[PodKey], annotations: Mapping[str, str | None]) -> None:
        """Set (or, with None, remove) annotations on these pods."""
        ...

    async def patch_status(
        self, plural: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        """Merge-patch the status of a namespaced matrixpool object."""
        ...

    async def patch_cluster_status(self, plural: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch the status of a cluster-scoped matrixpool object."""
        ...

    async def apply_configmap(
        self, namespace: str, name: str, data: Mapping[str, str], owner: Mapping[str, Any]
    ) -> None:
        """Make a ConfigMap hold exactly ``data``, owned by ``owner``."""
        ...

    def event(self, ref: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        """Record an Event on the object ``ref`` (apiVersion, kind, metadata name/uid)."""
        ...

    async def scrape(self, urls: Sequence[str], timeout: float) -> dict[str, str | None]:
        """The Prometheus text each URL answered within ``timeout``, or None."""
        ...

    async def inventory(
        self, job: str, endpoints: Mapping[str, str], persistent_uri: str | None = None
    ) -> daemonclient.Inventory:
        """What the daemons (node -> host:port) and the tier-3 store hold of ``job``."""
        ...

    async def probe(self, endpoints: Mapping[str, str]) -> dict[str, bool]:
        """Node -> whether its daemon answers its health check."""
        ...

    async def pin(self, job: str, endpoints: Iterable[str], step: int | None) -> list[str]:
        """Ask daemons to keep ``step`` of ``job`` (None: let go); the endpoints that did."""
        ...

    async def set_peers(self, endpoint: str, peers: list[str]) -> bool:
        """Tell a daemon its tier-1 peers; whether it took them."""
        ...

    async def set_kv_quotas(self, endpoint: str, quotas: Mapping[str, int]) -> bool:
        """Make a daemon's KV-cache quotas exactly ``quotas`` (service UID → bytes)."""
        ...

    async def jobs_held(self, endpoints: Iterable[str]) -> dict[str, set[str]]:
        """Job UID → the endpoints of the daemons holding any of its checkpoints."""
        ...

    async def delete_checkpoints(self, job: str, endpoints: Iterable[str]) -> list[str]:
        """Delete ``job``'s checkpoints from the daemons; the endpoints that did."""
        ...

    async def delete_persistent(self, job: str, uri: str) -> bool:
        """Delete ``job``'s tier-3 checkpoints under ``uri``; whether any went."""
        ...

    async def write_credential(
        self, namespace: str, uid: str, token: str, owner: Mapping[str, Any], component: str
    ) -> bool:
        """Create the Secret holding a workload's token (:mod:`matrixpool.k8s.secrets`);
        whether it was created (False: it was there)."""
        ...

    async def write_service(
        self, namespace: str, name: str, uid: str, owner: Mapping[str, Any]
    ) -> services.Outcome:
        """Create a TrainingJob's headless Service (:mod:`matrixpool.k8s.services`)."""
        ...


class Live:
    """The executor of a running operator: the API server and the daemons."""

    async def create_pods(self, manifests: Sequence[Mapping[str, Any]]) -> None:
        await pods.create(manifests)

    async def delete_pods(
        self, refs: Sequence[convert.PodRef], grace_seconds: int | None = None
    ) -> None:
        await pods.delete(refs, grace_seconds=grace_seconds)

    async def create_reserved(
        self, manifests: Sequence[Mapping[str, Any]]
    ) -> list[tuple[convert.PodFacts | None, pods.Outcome]]:
        return [
            (None, outcome) if body is None else (facts_of(body), None)
            for body, outcome in await pods.create_reserved(manifests)
        ]

    async def reserve(
        self, reservations: Sequence[tuple[str, str, str, str]]
    ) -> list[pods.Outcome]:
        return await pods.reserve(reservations)

    async def unreserve(self, keys: Sequence[PodKey]) -> None:
        await pods.unreserve(keys)

    async def bind(self, bindings: Sequence[pods.PodBinding]) -> list[pods.Outcome]:
        return await pods.bind(bindings)

    async def annotate(self, keys: Sequence[PodKey], annotations: Mapping[str, str | None]) -> None:
        await pods.annotate(keys, annotations)

    async def patch_status(
        self, plural: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        await k8s_status.patch_status(plural, namespace, name, status)

    async def patch_cluster_status(self, plural: str, name: str, status: Mapping[str, Any]) -> None:
        await k8s_status.patch_cluster_status(plural, name, status)

    async def apply_configmap(
        self, namespace: str, name: str, data: Mapping[str, str], owner: Mapping[str, Any]
    ) -> None:
        await configmaps.apply(namespace, name, data, owner)

    def event(self, ref: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        kopf.event(cast(kopf.Body, dict(ref)), type=kind, reason=reason, message=message[:1024])

    async def scrape(self, urls: Sequence[str], timeout: float) -> dict[str, str | None]:
        return await metrics_scrape.scrape(urls, timeout)

    async def inventory(
        self, job: str, endpoints: Mapping[str, str], persistent_uri: str | None = None
    ) -> daemonclient.Inventory:
        return await daemonclient.inventory(job, endpoints, persistent_uri)

    async def probe(self, endpoints: Mapping[str, str]) -> dict[str, bool]:
        return await daemonclient.probe(endpoints)

    async def pin(self, job: str, endpoints: Iterable[str], step: int | None) -> list[str]:
        return await daemonclient.pin(job, endpoints, step)

    async def set_peers(self, endpoint: str, peers: list[str]) -> bool:
        return await daemonclient.set_peers(endpoint, peers)

    async def set_kv_quotas(self, endpoint: str, quotas: Mapping[str, int]) -> bool:
        return await daemonclient.set_kv_quotas(endpoint, quotas)

    async def jobs_held(self, endpoints: Iterable[str]) -> dict[str, set[str]]:
        return await daemonclient.jobs_held(endpoints)

    async def delete_checkpoints(self, job: str, endpoints: Iterable[str]) -> list[str]:
        return await daemonclient.delete(job, endpoints)

    async def delete_persistent(self, job: str, uri: str) -> bool:
        return await asyncio.to_thread(daemonclient.delete_persistent, job, uri)

    async def write_credential(
        self, namespace: str, uid: str, token: str, owner: Mapping[str, Any], component: str
    ) -> bool:
        return await secrets.ensure(namespace, uid, token, owner, component)

    async def write_service(
        self, namespace: str, name: str, uid: str, owner: Mapping[str, Any]
    ) -> services.Outcome:
        return await services.ensure(namespace, name, uid, owner)


def facts_of(pod: Mapping[str, Any]) -> convert.PodFacts | None:
    """A pod as the API server answered it (raw JSON), as the index would show it."""
    meta = pod.get("metadata") or {}
    return convert.pod_facts(
        meta.get("name", ""),
        meta.get("namespace", ""),
        meta.get("labels") or {},
        meta.get("annotations") or {},
        pod.get("spec") or {},
        pod.get("status") or {},
        meta,
    )
