"""Pods of matrixpool gangs: their manifests, and the API calls that create, reserve, bind,
annotate and delete them — concurrently, with retries on conflicts and transient errors.

Called by the scheduler cycle (``matrixpool.controllers.scheduling``). Binding is two-phase so that
an operator killed at any moment never gives a card twice: first every pod of the gang is
*reserved* (annotations ``matrixpool.dev/node`` and ``matrixpool.dev/cards``), then each is
bound through the Binding API. A restarted operator treats reserved cards as held and either
finishes binding a fully reserved gang or clears a partial reservation.

:func:`reserve` and :func:`bind` answer one outcome per pod (``None``: done; else the error),
so the caller remembers exactly what was written (``matrixpool.state.assumed.Assumed``). A
Binding answered 409 is done only if the pod is bound to that very node; bound elsewhere is
:class:`BoundElsewhereError`.

Errors::

    Exception
     └── BoundElsewhereError   a Binding answered 409 and the pod is on another node
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import json
import os
import posixpath
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
import tenacity

from matrixpool.api import labels
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import convert
from matrixpool.placement import gangs
from matrixpool_recovery import fdpass

NODE_ANNOTATION = convert.NODE_ANNOTATION
CONCURRENCY = 32  # API calls in flight at once for one batch
# Test knob: seconds between single bindings (default 0: all at once). Chaos tests slow binding
# down with it so that they can kill the operator while a gang is half bound.
PACE_VARIABLE = "MATRIXPOOL_BIND_PACE_SECONDS"
T = TypeVar("T")
TRAINING_JOB = "TrainingJob"  # the kind whose pods get the training contract
DAEMON_PORT_VARIABLE = "MATRIXPOOL_CKPT_DAEMON_PORT"  # the chart's checkpointDaemon.port
log = structlog.get_logger(__name__)
SOCKET_VOLUME = "matrixpool-checkpoint-socket"  # the only hostPath a trainer pod gets
ENFORCE = "pod-security.kubernetes.io/enforce"  # a namespace's Pod Security level label
NO_HOST_PATH = frozenset({"baseline", "restricted"})  # levels that refuse every hostPath
LEVEL_SECONDS = 30.0  # how long a namespace's level is taken as read
_levels: dict[str, tuple[str, float]] = {}  # namespace -> (level, monotonic time read)
_levels_lock = threading.Lock()
MEMORY_PATH_VARIABLE = "MATRIXPOOL_CKPT_MEMORY_PATH"  # the chart's checkpointDaemon.memoryPath
PERSISTENT_PATH_VARIABLE = "MATRIXPOOL_CKPT_PERSISTENT_PATH"  # its persistentPath (tier 3)
CLUSTER_DOMAIN_VARIABLE = "MATRIXPOOL_CLUSTER_DOMAIN"  # the chart's clusterDomain
Outcome = BaseException | None  # per pod: None when the call did what it was asked
OURS_DOMAIN = "matrixpool.dev"  # labels and annotations under it are the operator's


PodBinding = tuple[str, str, str, str]  # namespace, name, UID (as in convert.PodRef), node


class BoundElsewhereError(Exception):
    """The pod was bound, but not to the node asked for (an earlier decision, or a stale one)."""


class ReplacedError(Exception):
    """The pod asked for is gone and another of the same name (another UID) stands in its
    place; the call was not made to the new one."""


def _transient(error: BaseException) -> bool:
    return k8s_client.is_status(error, 409, 429, 500, 502, 503, 504) or isinstance(
        error, ConnectionError | TimeoutError
    )


retry = tenacity.retry(
    retry=tenacity.retry_if_exception(_transient),
    wait=tenacity.wait_exponential_jitter(multiplier=0.05, max=3),
    stop=tenacity.stop_after_attempt(8),
    reraise=True,
)

# The same, except for a conflict: a pod created twice is an answer, not a hiccup.
retry_but_conflicts = tenacity.retry(
    retry=tenacity.retry_if_exception(
        lambda error: _transient(error) and not k8s_client.is_status(error, 409)
    ),
    wait=tenacity.wait_exponential_jitter(multiplier=0.05, max=3),
    stop=tenacity.stop_after_attempt(8),
    reraise=True,
)


@dataclass(frozen=True)
class TrainingContract:
    """What a TrainingJob's pod is told beyond its cards (docs/concepts.md, "What your training
    container gets"): everything a trainer needs comes from the pod, so that one that works
    under ``matrixpool sim`` works the same on a real kubelet."""

    job_uid: str  # the name its checkpoints go under (MATRIXPOOL_JOB)
    world_size: int  # ranks in the gang when the pod is created
    incarnation: int  # the run a rank that restores nothing starts as
    checkpoint: str = "{}"  # the job's spec.checkpoint as JSON ("{}": it saves none)
    daemon_port: int = labels.DAEMON_PORT  # the node daemons' port (on the node's address)
    memory_path: str = labels.MEMORY_PATH  # the daemons' tier-1 folder on every node: the pod
    # mounts only its socket's folder (``matrixpool_recovery.fdpass``), read-only
    credential: bool = False  # the operator writes the job's token Secret (it holds the
    # cluster secret): the pod then waits for it, as a kubelet waits for a Secret it must mount
    rendezvous: Rendezvous | None = None  # torchrun's environment and the pod's DNS name


@dataclass(frozen=True)
class Rendezvous:
    """How a rank's pod finds rank 0, as a real cluster gives it (docs/pytorch.md): the pod is
    ``<job>-<rank>`` in the job's headless Service ``<job>`` (:mod:`matrixpool.k8s.services`),
    so rank 0 is ``<job>-0.<job>.<namespace>.svc.<domain>`` wherever it runs, and the pod gets
    torchrun's environment under the names Kubeflow's trainer uses."""

    job: str  # the TrainingJob's name: its Service, the pods' subdomain
    namespace: str
    rank: int  # the pod's rank (NODE_RANK)
    replicas: int  # pods of the gang when the pod is created (PET_NNODES)
    port: int  # spec.rendezvous.port (MASTER_PORT)
    procs_per_replica: int  # spec.rendezvous.procsPerReplica (PET_NPROC_PER_NODE)
    domain: str = labels.CLUSTER_DOMAIN
    rank_table: bool = False  # Ascend cards: mount the job's HCCL rank table (its ConfigMap)
    job_uid: str = ""  # names the rank table's ConfigMap

    @property
    def hostname(self) -> str:
        return f"{self.job}-{self.rank}"

    @property
    def master(self) -> str:
        """Rank 0's name: the same after any recovery, whichever node rank 0 lands on."""
        return f"{self.job}-0.{self.job}.{self.namespace}.svc.{self.domain}"

    def env(self) -> dict[str, str]:
        """torchrun's variables: the pod's first process is global rank ``rank * procs``."""
        procs = self.procs_per_replica
        return {
            "MASTER_ADDR": self.master,
            "MASTER_PORT": str(self.port),
            "WORLD_SIZE": str(self.replicas * procs),
            "RANK": str(self.rank * procs),
            "NODE_RANK": str(self.rank),
            "LOCAL_RANK": "0",
            "PET_NNODES": str(self.replicas),
            "PET_NODE_RANK": str(self.rank),
            "PET_MASTER_ADDR": self.master,
            "PET_MASTER_PORT": str(self.port),
            "PET_NPROC_PER_NODE": str(procs),
        }


@dataclass(frozen=True)
class ServingContract:
    """What the pod of an InferenceService with an admitted ``spec.kvCache`` is told beyond
    its role: where the supernode's KV-cache pool is and the token that opens its own blocks
    (docs/concepts.md, "The KV-cache pool")."""

    service_uid: str  # the owner of its KV blocks at the daemons (MATRIXPOOL_KV_SERVICE)
    daemons: tuple[str, ...]  # the other member nodes' daemons (host:port), as of pod creation
    daemon_port: int = labels.DAEMON_PORT  # its own node's daemon: $(MATRIXPOOL_NODE_IP):port
    credential: bool = False  # the operator writes the service's token Secret


@dataclass(frozen=True)
class ExpertsContract:
    """What a pod of an expert-parallel role is told (docs/concepts.md, "Experts follow their
    load"): its instance's expert map as a file the kubelet keeps current (the service's
    ConfigMap, mounted read-only: a new map reaches the running pod, no restart) and the
    role's count of distinct experts."""

    config_map: str  # the service's expert maps (labels.expert_map_config_map)
    key: str  # its instance's map in it, a file of the mount (labels.expert_map_key)
    experts: int  # spec.roles[].expertParallel.experts (MATRIXPOOL_EXPERTS)


def cluster_domain() -> str:
    """The cluster's DNS domain, as the chart tells the operator (kubelet's clusterDomain)."""
    return os.environ.get(CLUSTER_DOMAIN_VARIABLE) or labels.CLUSTER_DOMAIN


def daemon_settings() -> tuple[int, str, str]:
    """The node daemons' port, tier-1 folder and tier-3 root, as the chart tells the
    operator."""
    port = int(os.environ.get(DAEMON_PORT_VARIABLE) or labels.DAEMON_PORT)
    memory = os.environ.get(MEMORY_PATH_VARIABLE) or labels.MEMORY_PATH
    return port, memory, os.environ.get(PERSISTENT_PATH_VARIABLE) or labels.PERSISTENT_PATH


def manifest(
    plan: gangs.PodPlan,
    template: Mapping[str, Any],
    owner: Mapping[str, Any],
    card_resource: str,
    training: TrainingContract | None = None,
    serving: ServingContract | None = None,
    experts: ExpertsContract | None = None,
) -> dict[str, Any]:
    """The Pod of ``plan``: the user's template plus cards, env, labels and the owner; a
    TrainingJob's pod also gets ``training`` (required for that kind), an InferenceService's
    the KV-cache pool's ``serving`` contract when its KV cache is admitted and, in an
    expert-parallel role, its expert map (``experts``)."""
    pod: dict[str, Any] = copy.deepcopy(dict(template or {}))
    meta = pod.setdefault("metadata", {})
    meta.pop("name", None)
    meta.pop("namespace", None)
    meta.update(name=plan.name, namespace=plan.namespace)
    for keys in ("labels", "annotations"):  # ours are the operator's to write, never a template's
        if isinstance(meta.get(keys), Mapping):
            meta[keys] = {k: v for k, v in meta[keys].items() if not is_ours(k)}
    meta.setdefault("labels", {}).update(
        {
            labels.JOB: plan.owner,
            labels.KIND: plan.kind,
            labels.ROLE: plan.role,
            labels.REPLICA: str(plan.replica),
            labels.RANK: str(plan.rank),
        }
    )
    meta["ownerReferences"] = [owner_reference(owner)]
    spec = pod.setdefault("spec", {})
    spec["schedulerName"] = labels.SCHEDULER_NAME
    spec.pop("nodeName", None)
    containers = spec.setdefault("containers", [])
    if not containers:
        containers.append({"name": plan.role, "image": "matrixpool/workload:placeholder"})
    _give_cards(containers[0], plan.cards, card_resource)
    if plan.kind == TRAINING_JOB:
        if training is None:
            raise ValueError(f"pod {plan.name}: a TrainingJob's pod needs its training contract")
        # A failed rank is the operator's to recover, as a new pod and a new run: a container
        # the kubelet restarted (Always, OnFailure) would go on in its old run's incarnation.
        spec["restartPolicy"] = "Never"
        meta["labels"][labels.JOB_UID] = training.job_uid
        meta.setdefault("annotations", {})[labels.INCARNATION] = str(training.incarnation)
        _give_training_contract(spec, containers[0], training)
        if training.rendezvous is not None:
            _give_rendezvous(spec, containers, training.rendezvous)
    else:
        _give_serving_contract(spec, containers[0], plan.role, serving)
        if experts is not None:
            _give_expert_map(spec, containers[0], experts)
    return {"apiVersion": "v1", "kind": "Pod", **pod}


def is_ours(key: str) -> bool:
    """Whether a label or annotation key is under the operator's own prefixes
    (``matrixpool.dev/``, ``<anything>.matrixpool.dev/``; the CRDs refuse them in templates)."""
    prefix, slash, _ = key.rpartition("/")
    return bool(slash) and (prefix == OURS_DOMAIN or prefix.endswith("." + OURS_DOMAIN))


def _give_serving_contract(
    spec: dict[str, Any], container: dict[str, Any], role: str, serving: ServingContract | None
) -> None:
    """An inference pod's role and its own address (downward API), where a server binds and
    the autoscaler reads ``/metrics``; with ``serving``, the KV-cache pool: the service's UID,
    its token (its Secret, ``matrixpool.k8s.secrets``, mounted read-only) and the daemons, its
    own node's first. Entries of the template with these names are replaced."""
    env: dict[str, dict[str, Any]] = {
        labels.ENV_ROLE: {"value": role},
        labels.ENV_POD_IP: {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    }
    if serving is not None:
        own = f"$({labels.ENV_NODE_IP}):{serving.daemon_port}"
        env.update(
            {
                labels.ENV_NODE_IP: {"valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                labels.ENV_KV_SERVICE: {"value": serving.service_uid},
                labels.ENV_KV_TOKEN_FILE: {"value": f"{labels.KV_MOUNT}/{labels.CREDENTIAL_KEY}"},
                labels.ENV_KV_DAEMONS: {"value": ",".join([own, *serving.daemons])},
            }
        )
        volume = "matrixpool-kv-credential"
        secret: dict[str, Any] = {
            "secretName": labels.kv_secret(serving.service_uid),
            "optional": not serving.credential,
        }
        volumes = [v for v in spec.get("volumes", []) if v.get("name") != volume]
        spec["volumes"] = [*volumes, {"name": volume, "secret": secret}]
        mounts = [m for m in container.get("volumeMounts", []) if m.get("name") != volume]
        mount = {"name": volume, "mountPath": labels.KV_MOUNT, "readOnly": True}
        container["volumeMounts"] = [*mounts, mount]
    kept = [e for e in container.get("env", []) if e.get("name") not in env]
    container["env"] = kept + [{"name": n, **e} for n, e in env.items()]


def _give_expert_map(
    spec: dict[str, Any], container: dict[str, Any], experts: ExpertsContract
) -> None:
    """The service's expert-map ConfigMap mounted read-only at ``labels.EXPERTS_MOUNT``
    (optional: it is written once the instance is bound, and the kubelet adds its files then),
    the instance's file and the count of experts in env. Entries of the template with these
    names are replaced."""
    volume = "matrixpool-expert-map"
    config_map = {"name": experts.config_map, "optional": True}
    volumes = [v for v in spec.get("volumes", []) if v.get("name") != volume]
    spec["volumes"] = [*volumes, {"name": volume, "configMap": config_map}]
    mounts = [m for m in container.get("volumeMounts", []) if m.get("name") != volume]
    mount = {"name": volume, "mountPath": labels.EXPERTS_MOUNT, "readOnly": True}
    container["volumeMounts"] = [*mounts, mount]
    env = {
        labels.ENV_EXPERT_MAP_FILE: f"{labels.EXPERTS_MOUNT}/{experts.key}",
        labels.ENV_EXPERTS: str(experts.experts),
    }
    kept = [e for e in container.get("env", []) if e.get("name") not in env]
    container["env"] = kept + [{"name": n, "value": v} for n, v in env.items()]


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """The controller ownerReference to ``owner`` (apiVersion, kind, name, uid): deleting the
    owner garbage-collects what carries it."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["name"],
        "uid": owner["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _give_training_contract(
    spec: dict[str, Any], container: dict[str, Any], training: TrainingContract
) -> None:
    """Identity, rank, world size, run, checkpoint spec, the node daemon's address, the job's
    credential (its Secret, ``matrixpool.k8s.secrets``; optional when the operator writes
    none, so that a cluster without checkpoint daemons still runs the pod), the pod's
    annotations as a downward-API file kept current (restore, checkpoint request) and,
    read-only, the folder of the node daemon's socket, the pod's only way to the files of its
    own job's tier-1 buffers (no folder of the daemon's, no tier-3 folder: tier 3 is read
    through the daemon). Entries of the template with these names are replaced; the user's
    other env and volumes stay."""
    credential = "matrixpool-checkpoint-credential"
    info = "matrixpool-pod-info"
    socket = SOCKET_VOLUME
    secret = {
        "secretName": labels.credential_secret(training.job_uid),
        "optional": not training.credential,
    }
    pod_info = {
        "items": [
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
        ]
    }
    socket_folder = posixpath.join(training.memory_path, fdpass.SOCKET_DIR)
    ours: dict[str, dict[str, Any]] = {
        credential: {"secret": secret},
        info: {"downwardAPI": pod_info},
        socket: {"hostPath": {"path": socket_folder, "type": "DirectoryOrCreate"}},
    }
    volumes = [v for v in spec.get("volumes", []) if v.get("name") not in ours]
    spec["volumes"] = [*volumes, *({"name": n, **v} for n, v in ours.items())]
    mounts: dict[str, dict[str, Any]] = {
        credential: {"mountPath": labels.CREDENTIAL_MOUNT, "readOnly": True},
        info: {"mountPath": labels.POD_INFO_MOUNT, "readOnly": True},
        socket: {"mountPath": socket_folder, "readOnly": True},
    }
    kept = [m for m in container.get("volumeMounts", []) if m.get("name") not in mounts]
    container["volumeMounts"] = [*kept, *({"name": n, **m} for n, m in mounts.items())]

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: dict[str, dict[str, Any]] = {
        labels.ENV_JOB: {"value": training.job_uid},
        labels.ENV_RANK: field(f"metadata.labels['{labels.RANK}']"),
        labels.ENV_WORLD_SIZE: {"value": str(training.world_size)},
        labels.ENV_INCARNATION: field(f"metadata.annotations['{labels.INCARNATION}']"),
        labels.ENV_NODE_IP: field("status.hostIP"),
        labels.ENV_DAEMON: {"value": f"$({labels.ENV_NODE_IP}):{training.daemon_port}"},
        labels.ENV_SOCKET: {"value": posixpath.join(socket_folder, fdpass.SOCKET_NAME)},
        labels.ENV_TOKEN_FILE: {"value": f"{labels.CREDENTIAL_MOUNT}/{labels.CREDENTIAL_KEY}"},
        labels.ENV_ANNOTATIONS_FILE: {"value": f"{labels.POD_INFO_MOUNT}/annotations"},
        labels.ENV_CHECKPOINT: {"value": training.checkpoint},
    }
    kept_env = [e for e in container.get("env", []) if e.get("name") not in env]
    container["env"] = kept_env + [{"name": n, **e} for n, e in env.items()]


def _give_rendezvous(
    spec: dict[str, Any], containers: list[dict[str, Any]], rendezvous: Rendezvous
) -> None:
    """The pod's DNS name (``hostname``/``subdomain``, so the job's headless Service gives it
    a record), torchrun's environment in every container (a variable the template sets itself
    stays as the template sets it), and for Ascend cards the job's HCCL rank table as a file,
    ``RANK_TABLE_FILE`` (MindCluster's ``hccl.json``: :mod:`matrixpool.controllers.ranktable`
    writes it once the gang is placed)."""
    spec["hostname"] = rendezvous.hostname
    spec["subdomain"] = rendezvous.job
    env = rendezvous.env()
    volume = "matrixpool-rank-table"
    if rendezvous.rank_table:
        env[labels.ENV_RANK_TABLE_FILE] = f"{labels.RANK_TABLE_MOUNT}/{labels.RANK_TABLE_KEY}"
        config_map = {
            "name": labels.rank_table_config_map(rendezvous.job_uid),
            "optional": True,  # written once every rank is placed; the kubelet then adds it
        }
        volumes = [v for v in spec.get("volumes", []) if v.get("name") != volume]
        spec["volumes"] = [*volumes, {"name": volume, "configMap": config_map}]
    for container in containers:
        given = {e.get("name") for e in container.get("env", [])}
        container["env"] = [
            *container.get("env", []),
            *({"name": n, "value": v} for n, v in env.items() if n not in given),
        ]
        if rendezvous.rank_table:
            mounts = [m for m in container.get("volumeMounts", []) if m.get("name") != volume]
            mount = {"name": volume, "mountPath": labels.RANK_TABLE_MOUNT, "readOnly": True}
            container["volumeMounts"] = [*mounts, mount]


def _give_cards(container: dict[str, Any], cards: int, card_resource: str) -> None:
    resources = container.setdefault("resources", {})
    for section in ("requests", "limits"):
        resources.setdefault(section, {})[card_resource] = str(cards)
    from_annotation = {"fieldRef": {"fieldPath": f"metadata.annotations['{labels.CARDS}']"}}
    names = [labels.ENV_CARDS]
    if card_resource.startswith("huawei.com/"):
        names.append(labels.ENV_ASCEND_VISIBLE_DEVICES)
    if card_resource.startswith("nvidia.com/"):
        names.append(labels.ENV_NVIDIA_VISIBLE_DEVICES)
    env = [e for e in container.get("env", []) if e.get("name") not in names]
    container["env"] = env + [{"name": n, "valueFrom": from_annotation} for n in names]


@functools.cache
def _threads() -> ThreadPoolExecutor:
    """CONCURRENCY threads for the API calls of a batch. asyncio.to_thread's executor has
    min(32, cores + 4) threads (6 on two cores), which made "32 in flight" six: a call waits
    on the API server, not on a core."""
    return ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="api-call")


async def in_thread(call: Callable[[], T]) -> T:
    """Run one blocking API ``call`` on the API-call threads."""
    context = contextvars.copy_context()  # as asyncio.to_thread does
    return await asyncio.get_running_loop().run_in_executor(_threads(), context.run, call)


async def gather_limited(calls: Iterable[Callable[[], T]]) -> list[T]:
    """Run blocking API ``calls`` in threads, at most CONCURRENCY at once, in order."""
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(call: Callable[[], T]) -> T:
        async with semaphore:
            return await in_thread(call)

    tasks: list[Awaitable[T]] = [one(c) for c in calls]
    return list(await asyncio.gather(*tasks))


async def gather_outcomes(calls: Iterable[Callable[[], object]]) -> list[Outcome]:
    """Run ``calls`` as :func:`gather_limited` does; each one's error, or None, in order."""

    def outcome(call: Callable[[], object]) -> Callable[[], Outcome]:
        def run() -> Outcome:
            try:
                call()
            except Exception as error:  # the caller decides what a failure means
                return error
            return None

        return run

    return await gather_limited(outcome(c) for c in calls)


def for_pod_security(pod: Mapping[str, Any], level: str) -> dict[str, Any]:
    """The pod as a namespace of Pod Security ``level`` admits it: under ``baseline`` and
    ``restricted`` without the daemon's socket folder (a hostPath), so that its trainer saves
    and restores over HTTP instead (``matrixpool_recovery.client``); unchanged otherwise. What
    the user's template asks for is left as it is, for the admission to judge."""
    if level not in NO_HOST_PATH:
        return dict(pod)
    admitted: dict[str, Any] = copy.deepcopy(dict(pod))
    spec = admitted.get("spec", {})
    spec["volumes"] = [v for v in spec.get("volumes", []) if v.get("name") != SOCKET_VOLUME]
    for container in spec.get("containers", []):
        mounts = container.get("volumeMounts", [])
        container["volumeMounts"] = [m for m in mounts if m.get("name") != SOCKET_VOLUME]
        env = container.get("env", [])
        container["env"] = [e for e in env if e.get("name") != labels.ENV_SOCKET]
    return admitted


def pod_security_level(api: k8s_client.Api, namespace: str) -> str:
    """The namespace's enforced Pod Security level (its label; "" when unset or unreadable),
    read at most every ``LEVEL_SECONDS``."""
    now = time.monotonic()
    with _levels_lock:
        cached = _levels.get(namespace)
    if cached is not None and now - cached[1] < LEVEL_SECONDS:
        return cached[0]
    try:
        found = api.core.read_namespace(namespace)
        level = str((found.metadata.labels or {}).get(ENFORCE, ""))
    except Exception as error:  # a namespace we may not read: create as asked
        log.debug("pod security level unknown", namespace=namespace, error=str(error))
        level = ""
    with _levels_lock:
        _levels[namespace] = (level, now)
    return level


def admitted(api: k8s_client.Api, body: Mapping[str, Any]) -> dict[str, Any]:
    return for_pod_security(body, pod_security_level(api, body["metadata"]["namespace"]))


async def create(pods: Sequence[Mapping[str, Any]]) -> None:
    """Create ``pods``; ones that already exist are fine."""
    api = k8s_client.default_api()

    def call(body: Mapping[str, Any]) -> Callable[[], None]:
        @retry
        def create_one() -> None:
            try:
                _done(
                    api.core.create_namespaced_pod(
                        body["metadata"]["namespace"], admitted(api, body), _preload_content=False
                    )
                )
            except Exception as error:
                if not k8s_client.is_status(error, 409):
                    raise

        return create_one

    await gather_limited(call(p) for p in pods)


class AlreadyExistsError(Exception):
    """A pod created already reserved was there before: its reservation is not this call's."""


async def create_reserved(pods: Sequence[Mapping[str, Any]]) -> list[tuple[Any, Outcome]]:
    """Create ``pods``, whose manifests carry their reservation (a gang placed before its pods
    existed); per pod the created object (raw JSON, decoded) and None, or None and the error.
    A pod that exists already is :class:`AlreadyExistsError`: its state is not what was placed."""
    api = k8s_client.default_api()

    def call(body: Mapping[str, Any]) -> Callable[[], tuple[Any, Outcome]]:
        @retry_but_conflicts
        def create_one() -> Any:
            response = api.core.create_namespaced_pod(
                body["metadata"]["namespace"], admitted(api, body), _preload_content=False
            )
            try:
                return json.loads(response.read())
            finally:
                response.release_conn()

        def run() -> tuple[Any, Outcome]:
            try:
                return create_one(), None
            except Exception as error:
                if k8s_client.is_status(error, 409):
                    name = body["metadata"]["name"]
                    return None, AlreadyExistsError(f"pod {name} exists already")
                return None, error

        return run

    return await gather_limited(call(p) for p in pods)


async def reserve(reservations: Sequence[tuple[str, str, str, str]]) -> list[Outcome]:
    """Annotate each ``(namespace, pod, node, cards)`` with its node and cards."""
    api = k8s_client.default_api()

    def call(namespace: str, name: str, node: str, cards: str) -> Callable[[], object]:
        body = {"metadata": {"annotations": {NODE_ANNOTATION: node, labels.CARDS: cards}}}
        return retry(
            lambda: _done(
                api.core.patch_namespaced_pod(name, namespace, body, _preload_content=False)
            )
        )

    return await gather_outcomes(call(*r) for r in reservations)


async def unreserve(pods: Sequence[tuple[str, str]]) -> None:
    """Clear the reservation of unbound ``(namespace, pod)`` pods."""
    api = k8s_client.default_api()
    body = {"metadata": {"annotations": {NODE_ANNOTATION: None, labels.CARDS: None}}}

    def call(namespace: str, name: str) -> Callable[[], None]:
        return retry(
            lambda: _ignore_missing(
                lambda: _done(
                    api.core.patch_namespaced_pod(name, namespace, body, _preload_content=False)
                )
            )
        )

    await gather_limited(call(*p) for p in pods)


async def bind(bindings: Sequence[PodBinding]) -> list[Outcome]:
    """Bind each ``(namespace, pod, UID, node)`` through the Binding API. The UID is the
    Binding's precondition, as kube-scheduler's: a pod deleted and made again under its name
    since it was decided on is not bound (:class:`ReplacedError`)."""
    api = k8s_client.default_api()

    def call(namespace: str, name: str, uid: str, node: str) -> Callable[[], None]:
        meta = {"name": name, "uid": uid} if uid else {"name": name}
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }

        @retry
        def bind_one() -> None:
            try:
                # The client cannot decode the Status that binding returns: take it raw.
                _done(
                    api.core.create_namespaced_pod_binding(
                        name, namespace, body, _preload_content=False
                    )
                )
            except Exception as error:
                if not k8s_client.is_status(error, 409):
                    raise
                _check_bound(api, namespace, name, uid, node)

        return bind_one

    pace = float(os.environ.get(PACE_VARIABLE) or 0)
    if pace <= 0:
        return await gather_outcomes(call(*b) for b in bindings)
    outcomes: list[Outcome] = []
    for binding in bindings:  # one at a time, for chaos tests that kill the operator midway
        outcomes += await gather_outcomes([call(*binding)])
        await asyncio.sleep(pace)
    return outcomes


def _check_bound(api: k8s_client.Api, namespace: str, name: str, uid: str, node: str) -> None:
    """After a 409: done if the pod is bound to ``node`` (bound before a crash, or by this
    very call retried); anything else is an error, never a success."""
    pod = api.core.read_namespaced_pod(name, namespace)
    if uid and pod.metadata.uid != uid:
        raise ReplacedError(f"pod {namespace}/{name} is another pod now (UID {pod.metadata.uid})")
    where = getattr(pod.spec, "node_name", None)
    if where != node:
        raise BoundElsewhereError(f"pod {namespace}/{name} is bound to {where!r}, not {node!r}")


async def annotate(pods: Sequence[tuple[str, str]], annotations: Mapping[str, str | None]) -> None:
    """Merge ``annotations`` into each ``(namespace, pod)``."""
    api = k8s_client.default_api()
    body = {"metadata": {"annotations": dict(annotations)}}

    def call(namespace: str, name: str) -> Callable[[], None]:
        return retry(
            lambda: _ignore_missing(
                lambda: _done(
                    api.core.patch_namespaced_pod(name, namespace, body, _preload_content=False)
                )
            )
        )

    await gather_limited(call(*p) for p in pods)


async def delete(pods: Sequence[convert.PodRef], grace_seconds: int | None = None) -> None:
    """Delete each ``(namespace, pod, UID)``, the UID as the delete's precondition: a pod
    already gone is fine, and so is one made again under its name since it was decided on
    (the API server answers 409): the pod meant is gone, and the new one is not touched."""
    api = k8s_client.default_api()

    def call(namespace: str, name: str, uid: str) -> Callable[[], None]:
        # All in the body: with a body, the API server reads no DeleteOptions from the query
        # (a gracePeriodSeconds=0 there would be dropped, and a dead node's pod wait forever).
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds

        @retry_but_conflicts
        def delete_one() -> None:
            _done(
                api.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False)
            )

        def run() -> None:
            try:
                _ignore_missing(delete_one)
            except Exception as error:
                if not (uid and k8s_client.is_status(error, 409)):
                    raise
                log.info("pod made again since; not deleted", pod=f"{namespace}/{name}", uid=uid)

        return run

    await gather_limited(call(*p) for p in pods)


def _done(response: Any) -> None:
    """Finish a call made with ``_preload_content=False`` (an error status has raised already):
    its body is read and its connection goes back to the pool, undecoded — decoding a Pod into
    the client's models costs more CPU than the call itself."""
    response.read()
    response.release_conn()


def _ignore_missing(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as error:
        if not k8s_client.is_status(error, 404):
            raise
