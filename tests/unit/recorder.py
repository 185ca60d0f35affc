"""An executor (:class:`matrixpool.k8s.executor.Executor`) that records what the controllers
decided instead of calling the API server and the daemons, so that their plans are tested with
neither. The daemons' answers are what the test sets in ``inventories`` and ``healthy``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from matrixpool.api import labels
from matrixpool.k8s import convert, daemonclient, executor, pods, services


@dataclass
class Recorder:
    """Every call succeeds, except a Binding of a pod already bound to another node (the API
    server answers it 409, and the pod is elsewhere)."""

    created: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)  # "ns/name"
    deleted_at_once: list[str] = field(default_factory=list)  # grace 0
    deleted_uids: dict[str, str] = field(default_factory=dict)  # "ns/name" → the UID deleted
    reserved: list[tuple[str, str, str, str]] = field(default_factory=list)
    unreserved: list[str] = field(default_factory=list)
    bound_to: dict[str, str] = field(default_factory=dict)  # "ns/name" → node
    annotated: list[tuple[str, dict[str, str | None]]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)  # {"name": …, **patch}
    cluster_statuses: list[dict[str, Any]] = field(default_factory=list)
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)
    configmap_writes: int = 0
    events: list[tuple[str, str, str, str]] = field(default_factory=list)  # name, type, reason, msg
    # the daemons: job UID → what they hold; node → whether its daemon answers
    inventories: dict[str, daemonclient.Inventory] = field(default_factory=dict)
    healthy: dict[str, bool] = field(default_factory=dict)
    asked: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # inventory calls
    pins: list[tuple[str, tuple[str, ...], int | None]] = field(default_factory=list)
    peers: dict[str, list[str]] = field(default_factory=dict)  # daemon endpoint → told peers
    kv_quotas: dict[str, dict[str, int]] = field(default_factory=dict)  # endpoint → told quotas
    metrics: dict[str, str] = field(default_factory=dict)  # URL → the /metrics text it answers
    held: dict[str, set[str]] = field(default_factory=dict)  # job UID → daemons holding it
    checkpoints_deleted: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    credentials: list[tuple[str, str, str]] = field(default_factory=list)  # (ns, uid, component)
    scraped: list[tuple[str, ...]] = field(default_factory=list)  # the URLs of each scrape
    services: list[tuple[str, str, str]] = field(default_factory=list)  # (ns, name, job UID)

    async def create_pods(self, manifests: Sequence[Mapping[str, Any]]) -> None:
        self.created += [dict(m) for m in manifests]

    async def create_reserved(
        self, manifests: Sequence[Mapping[str, Any]]
    ) -> list[tuple[convert.PodFacts | None, pods.Outcome]]:
        """Each pod is created, and its reservation recorded as :meth:`reserve` records one;
        the facts get a UID of their own, as the API server gives one."""
        self.created += [dict(m) for m in manifests]
        answers: list[tuple[convert.PodFacts | None, pods.Outcome]] = []
        for manifest in manifests:
            meta = manifest["metadata"]
            body = {**manifest, "metadata": {**meta, "uid": f"created-{meta['name']}"}}
            notes = meta.get("annotations") or {}
            if pods.NODE_ANNOTATION in notes:  # else created unreserved (a gang that waits)
                self.reserved.append(
                    (
                        meta["namespace"],
                        meta["name"],
                        notes[pods.NODE_ANNOTATION],
                        notes[labels.CARDS],
                    )
                )
            answers.append((executor.facts_of(body), None))
        return answers

    async def delete_pods(
        self, refs: Sequence[convert.PodRef], grace_seconds: int | None = None
    ) -> None:
        names = [f"{ns}/{name}" for ns, name, _ in refs]
        (self.deleted_at_once if grace_seconds == 0 else self.deleted).extend(names)
        self.deleted_uids.update({f"{ns}/{name}": uid for ns, name, uid in refs})

    async def reserve(
        self, reservations: Sequence[tuple[str, str, str, str]]
    ) -> list[pods.Outcome]:
        self.reserved += reservations
        return [None] * len(reservations)

    async def unreserve(self, keys: Sequence[tuple[str, str]]) -> None:
        self.unreserved += [f"{ns}/{name}" for ns, name in keys]

    async def bind(self, bindings: Sequence[pods.PodBinding]) -> list[pods.Outcome]:
        outcomes: list[pods.Outcome] = []
        for namespace, name, _, node in bindings:
            where = self.bound_to.setdefault(f"{namespace}/{name}", node)
            outcomes.append(None if where == node else pods.BoundElsewhereError(name))
        return outcomes

    async def annotate(
        self, keys: Sequence[tuple[str, str]], annotations: Mapping[str, str | None]
    ) -> None:
        self.annotated += [(f"{ns}/{name}", dict(annotations)) for ns, name in keys]

    async def patch_status(
        self, plural: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        self.statuses.append({"name": name, **status})

    async def patch_cluster_status(self, plural: str, name: str, status: Mapping[str, Any]) -> None:
        self.cluster_statuses.append({"name": name, **status})

    async def apply_configmap(
        self, namespace: str, name: str, data: Mapping[str, str], owner: Mapping[str, Any]
    ) -> None:
        self.configmaps[f"{namespace}/{name}"] = dict(data)
        self.configmap_writes += 1

    def event(self, ref: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        self.events.append((str(ref["metadata"]["name"]), kind, reason, message))

    async def inventory(
        self, job: str, endpoints: Mapping[str, str], persistent_uri: str | None = None
    ) -> daemonclient.Inventory:
        """What the asked daemons that answer hold (tier 3 only when its URI is given)."""
        self.asked.append((job, tuple(sorted(endpoints))))
        held = self.inventories.get(job, daemonclient.Inventory(()))
        silent = frozenset(n for n in endpoints if not self.healthy.get(n, True))
        seen = tuple(
            h
            for h in held.holdings
            if (h.tier == "persistent" and persistent_uri)
            or (h.tier != "persistent" and h.node in endpoints and h.node not in silent)
        )
        return daemonclient.Inventory(seen, dict(endpoints), silent)

    async def probe(self, endpoints: Mapping[str, str]) -> dict[str, bool]:
        return {node: self.healthy.get(node, True) for node in endpoints}

    async def pin(self, job: str, endpoints: Iterable[str], step: int | None) -> list[str]:
        listed = tuple(endpoints)
        self.pins.append((job, listed, step))
        return list(listed)

    async def set_peers(self, endpoint: str, peers: list[str]) -> bool:
        if not self.healthy.get(endpoint, True):
            return False
        self.peers[endpoint] = list(peers)
        return True

    async def set_kv_quotas(self, endpoint: str, quotas: Mapping[str, int]) -> bool:
        if not self.healthy.get(endpoint, True):
            return False
        self.kv_quotas[endpoint] = dict(quotas)
        return True

    async def jobs_held(self, endpoints: Iterable[str]) -> dict[str, set[str]]:
        asked = set(endpoints)
        return {job: held & asked for job, held in self.held.items() if held & asked}

    async def delete_checkpoints(self, job: str, endpoints: Iterable[str]) -> list[str]:
        done = tuple(sorted(endpoints))
        self.checkpoints_deleted.append((job, done))
        self.held.pop(job, None)
        return list(done)

    async def delete_persistent(self, job: str, uri: str) -> bool:
        return False

    async def write_credential(
        self, namespace: str, uid: str, token: str, owner: Mapping[str, Any], component: str
    ) -> bool:
        self.credentials.append((namespace, uid, component))
        return True

    async def write_service(
        self, namespace: str, name: str, uid: str, owner: Mapping[str, Any]
    ) -> services.Outcome:
        self.services.append((namespace, name, uid))
        return services.Outcome.CREATED

    async def scrape(self, urls: Sequence[str], timeout: float) -> dict[str, str | None]:
        """What the test set for each URL; a URL it did not set does not answer."""
        self.scraped.append(tuple(urls))
        return {url: self.metrics.get(url) for url in urls}

    # ---- what a test asks of the record ------------------------------------------------------

    def reasons(self, name: str | None = None) -> list[str]:
        return [reason for who, _, reason, _ in self.events if name is None or who == name]

    def status_of(self, name: str, key: str) -> list[Any]:
        """Every value of status field ``key`` patched on object ``name``, oldest first."""
        return [s[key] for s in self.statuses if s["name"] == name and key in s]

    def end_state(self) -> EndState:
        """What the calls left behind, summed up for one ``assert got == want``."""
        reserved = {name: (node, compact(cards)) for _, name, node, cards in self.reserved}
        names = [name for _, name, _, _ in self.reserved]
        again = sorted({name for name in names if names.count(name) > 1})
        for manifest in self.created:  # created reserved (a recovery's pinned pods)
            meta = manifest["metadata"]
            notes = meta.get("annotations") or {}
            if pods.NODE_ANNOTATION in notes:
                reserved[meta["name"]] = (notes[pods.NODE_ANNOTATION], compact(notes[labels.CARDS]))
        statuses: dict[str, dict[str, Any]] = {}
        for patch in self.statuses:  # merge patches: each top-level field, the last one
            statuses.setdefault(patch["name"], {}).update(patch)
        return EndState(
            created=sorted(m["metadata"]["name"] for m in self.created),
            reserved=reserved,
            reserved_again=again,
            bound={key.split("/", 1)[1]: node for key, node in self.bound_to.items()},
            deleted=sorted(key.split("/", 1)[1] for key in self.deleted + self.deleted_at_once),
            annotated={key.split("/", 1)[1]: sorted(values) for key, values in self.annotated},
            statuses={name: summary(status) for name, status in statuses.items()},
            events=sorted((name, kind, reason) for name, kind, reason, _ in self.events),
        )


SET = "(set)"  # in an EndState: a field set to a time or a random id
STATUS_FIELDS = ("phase", "replicas", "conditions", "preemptions", "roleSummary", "kvCache")
VOLATILE = frozenset({"requestId", "requestedAt", "evictedAt", "resumedAt", "checkpointSeconds"})


@dataclass(frozen=True)
class EndState:
    """What a controller's run left behind (:meth:`Recorder.end_state`), pods by name (all in
    one namespace), compared whole in table-driven tests (Kueue's ``wantWorkloads``,
    ``wantAssignments``, ``wantEvents``)."""

    created: list[str] = field(default_factory=list)  # pods created, sorted
    reserved: dict[str, tuple[str, str]] = field(default_factory=dict)  # pod → (node, cards)
    reserved_again: list[str] = field(default_factory=list)  # pods reserved twice: never
    bound: dict[str, str] = field(default_factory=dict)  # pod → the node of its Binding
    deleted: list[str] = field(default_factory=list)  # pods deleted, sorted
    annotated: dict[str, list[str]] = field(default_factory=dict)  # pod → annotation keys set
    # object → the STATUS_FIELDS of its status, every patch merged; conditions as
    # {type: "<status> <reason>"}, times and random ids as SET
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (object, type, reason)


def compact(cards: str) -> str:
    """``"0,1,2,3,6"`` → ``"0-3,6"``."""
    runs: list[list[int]] = []
    for card in sorted(labels.parse_cards(cards)):
        if runs and card == runs[-1][-1] + 1:
            runs[-1].append(card)
        else:
            runs.append([card])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def summary(status: Mapping[str, Any]) -> dict[str, Any]:
    kept = {key: status[key] for key in STATUS_FIELDS if key in status}
    if "conditions" in kept:
        kept["conditions"] = {
            c["type"]: f"{c['status']} {c['reason']}" for c in kept["conditions"] or []
        }
    if "preemptions" in kept:
        kept["preemptions"] = [
            {key: SET if key in VOLATILE and value else value for key, value in record.items()}
            for record in kept["preemptions"]
        ]
    return kept
