"""The operator's client of the node checkpoint daemons, and its credential to them.

It asks the daemons (``GET /v1/inventory?job=J`` on the endpoint each daemon's Lease
announces) what copies of a job's checkpoints they hold, pins a step, tells them their tier-1
peers and KV-cache quotas, deletes a deleted job's checkpoints, and probes their health; and it
reads the tier-3 manifests at the job's persistent URI when the operator can reach it
(``file://`` mounted in the operator). Called through the executor
(:class:`matrixpool.k8s.executor.Live`) by the recovery controller (which copies survive a
fault), time-sharing (did the job answer a checkpoint request; which step to resume from), the
tier-1 peers and KV quotas (:mod:`matrixpool.controllers.daemons`) and the cleanup sweep.

The operator holds the cluster checkpoint secret (a file: ``MATRIXPOOL_CKPT_SECRET_FILE``, or
``MATRIXPOOL_CKPT_TOKEN_FILE`` naming the same file, its older name) and asks the daemons with
the operator token derived from it (``matrixpool_recovery.credentials``); ``job_token_for``
gives the token a job's pods get, which opens that job's checkpoints only. Without the secret
the operator sees no daemon.

Jobs are known to the daemons by their TrainingJob's UID (``MATRIXPOOL_JOB``), never by
namespace and name: a job deleted and created again under the same name is a new job that
sees none of its predecessor's checkpoints. ``delete`` removes a deleted job's checkpoints.

What a rank restores (the ``matrixpool.dev/restore`` annotation) is the trainers' contract
and lives with them: :mod:`matrixpool_recovery.restore`.

Errors: a daemon that does not answer, or answers an error, is reported as unreachable or
not done (never raised); reading a tier-3 manifest that is not there yields nothing.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from matrixpool_recovery import credentials, errors, files, manifest, restore, wire

T = TypeVar("T")
PROBE_TIMEOUT = 1.0  # seconds for one healthz request
INVENTORY_TIMEOUT = 3.0  # seconds for one inventory request (a busy daemon lists slower)
MAX_PARALLEL = 32  # daemons asked at once
SECRET_FILE_ENV = "MATRIXPOOL_CKPT_SECRET_FILE"  # the cluster secret's file
OLD_SECRET_FILE_ENV = "MATRIXPOOL_CKPT_TOKEN_FILE"  # its earlier name, still read


def secret() -> str | None:
    """The cluster checkpoint secret, from the file the environment names, or None."""
    path = os.environ.get(SECRET_FILE_ENV) or os.environ.get(OLD_SECRET_FILE_ENV)
    if not path or not Path(path).exists():
        return None
    try:
        return credentials.read_secret(Path(path))
    except ValueError:
        return None


def token() -> str | None:
    """The operator token: peer lists, pins, deletes and every job's inventory; or None."""
    found = secret()
    return None if found is None else credentials.operator_token(found)


def service_token_for(service: str) -> str | None:
    """The token for the pods of an InferenceService (its UID): its KV-cache blocks only; or
    None."""
    found = secret()
    return None if found is None else credentials.service_token(found, service)


def job_token_for(job: str) -> str | None:
    """The token for the pods of ``job`` (its TrainingJob's UID): that job's checkpoints only;
    or None."""
    found = secret()
    return None if found is None else credentials.job_token(found, job)


@dataclass(frozen=True)
class Inventory:
    """Every copy of one job that the reachable daemons and the persistent URI hold."""

    holdings: tuple[manifest.Holding, ...] = ()
    endpoints: Mapping[str, str] = field(default_factory=dict)  # node -> endpoint asked
    unreachable: frozenset[str] = frozenset()  # nodes whose daemon did not answer

    def newest_complete(self, world_size: int, tier: str | None = None) -> int | None:
        """The newest step every rank holds in one incarnation (on one tier, or on any)."""
        return manifest.newest_complete(self.holdings, world_size, tier)

    def timeline(self) -> list[manifest.Holding]:
        """The holdings on the newest timeline: one incarnation per step."""
        return manifest.timeline(self.holdings)

    def incarnation_of(self, step: int | None) -> int | None:
        """The incarnation that wrote ``step`` on the newest timeline."""
        runs = {h.incarnation for h in self.timeline() if h.step == step}
        return max(runs) if runs else None

    def committed(self, world_size: int) -> dict[str, int | None]:
        """Per tier (memory, local, persistent): the newest step committed for every rank."""
        return manifest.committed(self.holdings, world_size, ("memory", "local", "persistent"))

    def new_incarnation(self, now: datetime.datetime) -> int:
        """A number for the next run of the job (:func:`restore.new_incarnation`)."""
        return restore.new_incarnation((h.incarnation for h in self.holdings), now)

    def holders(self, step: int) -> list[str]:
        """Endpoints of the daemons holding any shard of ``step``, sorted."""
        nodes = {h.node for h in self.holdings if h.step == step and h.node}
        return sorted(self.endpoints[n] for n in nodes if n in self.endpoints)


async def inventory(
    job: str,
    endpoints: Mapping[str, str],
    persistent_uri: str | None = None,
    bearer: str | None = None,
) -> Inventory:
    """Ask every daemon in ``endpoints`` (node -> host:port) what it holds of ``job``
    (with ``bearer``, by default the operator token)."""
    bearer = bearer if bearer is not None else token()
    limit = asyncio.Semaphore(MAX_PARALLEL)

    async def ask(node: str, address: str) -> tuple[str, list[manifest.Holding] | None]:
        if bearer is None:
            return node, None
        async with limit:
            return node, await asyncio.to_thread(_inventory_of, address, bearer, job)

    answers = await asyncio.gather(*(ask(n, a) for n, a in sorted(endpoints.items())))
    found = [h for _, held in answers if held for h in held]
    unreachable = frozenset(n for n, held in answers if held is None)
    if persistent_uri:
        found += await asyncio.to_thread(_persistent, job, persistent_uri)
    return Inventory(tuple(found), dict(endpoints), unreachable)


def _inventory_of(address: str, bearer: str, job: str) -> list[manifest.Holding] | None:
    endpoint = wire.Endpoint(address, bearer, timeout=INVENTORY_TIMEOUT)
    try:
        answer = wire.request(endpoint, "GET", f"/v1/inventory?job={job}")
    except (errors.CheckpointError, OSError, ValueError):
        return None
    return [manifest.Holding.from_json(s) for s in answer["shards"]]


def _persistent(job: str, uri: str) -> list[manifest.Holding]:
    """Tier-3 copies, when the URI is a file:// path this process can read; else none."""
    try:
        store = files.Persistent(uri, keep=1)
        return [h for m in store.manifests(job) for h in manifest.holdings(m)]
    except (errors.CheckpointError, OSError, ValueError):
        return []


async def _each(addresses: Iterable[str], call: Callable[[str], T]) -> list[tuple[str, T]]:
    """``call`` on every address in a thread, MAX_PARALLEL at once; (address, answer) sorted."""
    limit = asyncio.Semaphore(MAX_PARALLEL)

    async def one(address: str) -> tuple[str, T]:
        async with limit:
            return address, await asyncio.to_thread(call, address)

    return list(await asyncio.gather(*(one(a) for a in sorted(set(addresses)))))


def _ask(
    address: str,
    bearer: str,
    method: str,
    path: str,
    body: Any = None,
    timeout: float = INVENTORY_TIMEOUT,
) -> Any | None:
    """One request to a daemon; None when it fails (unreachable, refused, malformed)."""
    endpoint = wire.Endpoint(address, bearer, timeout=timeout)
    try:
        return wire.request(endpoint, method, path, body) or {}
    except (errors.CheckpointError, OSError, ValueError):
        return None


async def pin(job: str, endpoints: Iterable[str], step: int | None) -> list[str]:
    """Ask each daemon to keep ``step`` of ``job`` (None: let it go); the endpoints that
    did. A recovery pins the step it chose until every rank has reloaded it."""
    bearer = token()
    if bearer is None:
        return []
    path, body = f"/v1/jobs/{job}/pin", {"step": step}
    answers = await _each(endpoints, lambda a: _ask(a, bearer, "PUT", path, body, PROBE_TIMEOUT))
    return [address for address, answer in answers if answer is not None]


async def set_peers(endpoint: str, peers: list[str]) -> bool:
    """Tell the daemon at ``endpoint`` which daemons hold its tier-1 copies, in order of
    preference; whether it took the list."""
    bearer = token()
    if bearer is None:
        return False
    body = {"peers": peers}
    answer = await asyncio.to_thread(
        _ask, endpoint, bearer, "POST", "/v1/peers", body, PROBE_TIMEOUT
    )
    return answer is not None


def _set_kv_quotas(address: str, bearer: str, quotas: Mapping[str, int]) -> bool:
    """Make the KV quotas of the daemon at ``address`` exactly ``quotas`` (service UID →
    bytes): read its usage, forget the services it holds that are not there, set the quotas
    that differ. Whether every step took."""
    usage = _ask(address, bearer, "GET", "/v1/kv/usage", timeout=PROBE_TIMEOUT)
    if usage is None:
        return False  # unreachable, or no KV pool (503)
    held: Mapping[str, Any] = usage.get("services") or {}
    ok = True
    for service in sorted(set(held) - set(quotas)):
        ok &= (
            _ask(address, bearer, "DELETE", f"/v1/kv/{service}", timeout=PROBE_TIMEOUT) is not None
        )
    for service, nbytes in sorted(quotas.items()):
        if (held.get(service) or {}).get("quotaBytes") == nbytes:
            continue
        path, body = f"/v1/kv/{service}/quota", {"bytes": nbytes}
        ok &= _ask(address, bearer, "PUT", path, body, PROBE_TIMEOUT) is not None
    return ok


async def set_kv_quotas(endpoint: str, quotas: Mapping[str, int]) -> bool:
    """Tell the daemon at ``endpoint`` the KV-cache quotas of the services admitted to its
    supernode's pool, and forget the others'; whether it took them all."""
    bearer = token()
    if bearer is None:
        return False
    return await asyncio.to_thread(_set_kv_quotas, endpoint, bearer, dict(quotas))


async def delete(job: str, endpoints: Iterable[str]) -> list[str]:
    """Ask each daemon to drop every checkpoint of ``job`` (tiers 1 and 2); the endpoints
    that did (a daemon that holds nothing of it answers too)."""
    bearer = token()
    if bearer is None:
        return []
    answers = await _each(endpoints, lambda a: _ask(a, bearer, "DELETE", f"/v1/jobs/{job}"))
    return [address for address, answer in answers if answer is not None]


async def jobs_held(endpoints: Iterable[str]) -> dict[str, set[str]]:
    """Job -> endpoints of the daemons that hold any checkpoint of it (the daemons that
    answer; one inventory request each)."""
    bearer = token()
    if bearer is None:
        return {}
    held: dict[str, set[str]] = {}
    for address, answer in await _each(
        endpoints, lambda a: _ask(a, bearer, "GET", "/v1/inventory")
    ):
        for shard in (answer or {}).get("shards", []):
            held.setdefault(manifest.Holding.from_json(shard).job, set()).add(address)
    return held


def delete_persistent(job: str, uri: str) -> bool:
    """Remove the job's folder under its tier-3 URI, when this process can reach it."""
    try:
        store = files.Persistent(uri, keep=1)
        folder = store.root / job
        if folder.exists():
            shutil.rmtree(folder)
    except (errors.CheckpointError, OSError, ValueError):
        return False
    return True


async def probe(endpoints: Mapping[str, str]) -> dict[str, bool]:
    """Node -> whether its daemon answers ``/v1/healthz`` within PROBE_TIMEOUT."""
    limit = asyncio.Semaphore(MAX_PARALLEL)

    async def one(node: str, address: str) -> tuple[str, bool]:
        async with limit:
            return node, await asyncio.to_thread(_healthy, address)

    return dict(await asyncio.gather(*(one(n, a) for n, a in sorted(endpoints.items()))))


def _healthy(address: str) -> bool:
    try:
        wire.request(wire.Endpoint(address, "", timeout=PROBE_TIMEOUT), "GET", "/v1/healthz")
    except (errors.CheckpointError, OSError, ValueError):
        return False
    return True
