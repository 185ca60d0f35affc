"""The operator's main loop: one kopf daemon that runs the scheduling cycle and the SuperNode
status report, every :data:`CYCLE_SECONDS` and at once when a workload is created, changed or
deleted or a gang's pod goes (:mod:`matrixpool.controllers.wake`).

The daemon hangs off an *anchor* ConfigMap (``matrixpool-scheduler``, label
``matrixpool.dev/component=scheduler``) that the operator creates in its own namespace at
startup. kopf puts its finalizer on the object a daemon runs for; anchoring the loop to an object
of our own keeps that finalizer off users' SuperNodes, so they can always be deleted, operator or
not. kopf starts the daemon only once every index has its initial listing, and pauses it on
replicas that lose a peering election, so exactly one loop schedules at a time.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import kopf
import structlog

from matrixpool import clock
from matrixpool.api import labels
from matrixpool.controllers import (
    autoscaler,
    cleanup,
    daemons,
    experts,
    lifecycle,
    ranktable,
    supernode,
    timeshare,
    wake,
)
from matrixpool.controllers.recovery import controller as recovery
from matrixpool.controllers.recovery import heartbeat
from matrixpool.controllers.recovery import memory as recovery_memory
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.k8s import anchor, daemonleases, executor, nodeleases
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s.convert import PodFacts
from matrixpool.placement import inventory
from matrixpool.state import assumed as assuming
from matrixpool.state import decisions as decided
from matrixpool.state import (
    indexes,  # noqa: F401 -- registers the kopf indexes main_loop reads
    workloads,
    world,
)
from matrixpool.state.workloads import Workload

CYCLE_SECONDS = 0.25
YIELD_SECONDS = 0.001  # between a pass's steps, for the watches' handlers (a timer, not sleep(0):
# a watch event takes several hops of the event loop to reach its handler)
YIELD_AFTER_SECONDS = 0.005  # a pass yields between steps once this long has gone since the last
# yield (a yield costs a millisecond, at 4 supernodes more than a step takes; at 64 a step takes
# seconds and every step yields)
ERROR_BACKOFF_SECONDS = 2.0
# The most a status report owed by a binding cycle waits while newer binding cycles write: a
# report beside a binding cycle slows its pods' creates (one event loop, one API server), so
# while gangs keep coming the report waits for a pass that binds nothing, but no longer.
REPORT_DEFERRED_SECONDS = 1.0
LABEL = {anchor.COMPONENT_LABEL: anchor.COMPONENT}
NODE_LEASES_KEY = "node_leases"  # in kopf's memo: the kubelets' Leases (k8s.nodeleases)
LEASES_LISTED_SECONDS = 60.0  # the most startup waits for their first listing
# Test knob: seconds by which the loop's view of the pod index lags the API (default 0).
LAG_VARIABLE = "MATRIXPOOL_WATCH_LAG_SECONDS"
log = structlog.get_logger(__name__)


def namespace() -> str:
    """The operator's namespace: MATRIXPOOL_NAMESPACE (the chart sets it), else default."""
    return k8s_client.operator_namespace()


@kopf.on.startup()
async def create_anchor(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.watching.label_selectors["", "configmaps"] = (
        f"{anchor.COMPONENT_LABEL}={anchor.COMPONENT}"
    )
    await anchor.ensure(namespace())


@kopf.on.startup()
async def watch_node_leases(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    """The kubelets' Leases, watched on a thread of their own (:mod:`matrixpool.k8s.nodeleases`);
    kopf then watches only the checkpoint daemons' Leases (by label, at the API server). The
    loop starts once they are listed, as it does once kopf's indexes are."""
    settings.watching.label_selectors["coordination.k8s.io", "leases"] = (
        f"{labels.CKPT_DAEMON}=true"
    )
    leases = memo[NODE_LEASES_KEY] = nodeleases.NodeLeases().start()
    if not await asyncio.to_thread(leases.listed.wait, LEASES_LISTED_SECONDS):
        log.warning(
            "the kubelets' Leases are not listed yet; going on", waited=LEASES_LISTED_SECONDS
        )


@kopf.on.cleanup()
async def stop_node_leases(memo: kopf.Memo, **_: Any) -> None:
    leases = memo.get(NODE_LEASES_KEY)
    if isinstance(leases, nodeleases.NodeLeases):
        leases.stop()


@kopf.on.cleanup()
async def release_anchor(settings: kopf.OperatorSettings, **_: Any) -> None:
    """A standalone operator that stops cleanly leaves nothing behind that blocks a namespace
    deletion; peers leave the anchor to the one still running."""
    if settings.peering.standalone:
        await anchor.remove(namespace())


def is_anchor(name: str, **kwargs: Any) -> bool:
    """Only the anchor in the operator's namespace runs the loop (the chart grants patching
    ConfigMaps there alone): one labelled alike elsewhere, which anyone may create in their
    own namespace, must not start a second scheduling loop."""
    return name == anchor.NAME and kwargs.get("namespace") == namespace()


@kopf.daemon(  # type: ignore[arg-type]
    "", "v1", "configmaps", labels=LABEL, when=is_anchor, cancellation_timeout=5
)
async def main_loop(
    stopped: kopf.DaemonStopped,
    node_facts: kopf.Index[str, inventory.NodeInfo],
    foreign_pods: kopf.Index[str, dict[str, int]],
    supernode_models: kopf.Index[str, Any],
    gang_pods: kopf.Index[str, PodFacts],
    training_jobs: kopf.Index[str, workloads.Workload],
    inference_services: kopf.Index[str, workloads.Workload],
    daemon_leases: kopf.Index[str, daemonleases.Announced],
    memo: kopf.Memo | None = None,
    **_: Any,
) -> None:
    log.info("main loop started", namespace=namespace())
    alarm = wake.of(memo) or wake.Wake()  # rung by workload and pod events (controllers.wake)
    kubelets = memo.get(NODE_LEASES_KEY) if memo is not None else None  # their Leases
    state = Controllers()
    lagged = Lagged(float(os.environ.get(LAG_VARIABLE) or 0))

    copies = Copies()

    def take() -> Copied:
        """Copy what the indexes hold (the costly part of a read: 1,536 nodes and Leases, 512
        workloads take ~10 ms at 32 supernodes)."""
        now = clock.SYSTEM.monotonic()
        announced = _first(daemon_leases)
        silent = state.heartbeats.observe(
            {n: (a.renewed, a.duration) for n, a in announced.items()}, now
        )
        return Copied(
            taken=now,
            pods=lagged.read({key: list(store) for key, store in gang_pods.items()}),
            announced=announced,
            silent=silent,
            supernodes=_first(supernode_models),
            nodes=with_endpoints(_all(node_facts), announced, state.refused),
            foreign=supernode.Facts.sum_held(foreign_pods),
            workloads=[*_all(training_jobs), *_all(inference_services)],
            stale=overdue(state, kubelets.snapshot() if kubelets else {}, now),
        )

    def read() -> world.World:
        copied = copies.get(take)
        state.started = {n: a.started for n, a in copied.announced.items()}
        silent, restarting = daemons_down(
            state.recoveries.unreachable(clock.SYSTEM.monotonic()) | copied.silent,
            copied.announced,
            copied.stale,
            clock.SYSTEM.now().timestamp(),
        )
        return world.World(
            supernodes=copied.supernodes,
            nodes=copied.nodes,
            foreign=copied.foreign,
            pods=state.assumed.view(copied.pods),
            workloads=copied.workloads,
            unreachable=silent,
            restarting=restarting,
            stale=copied.stale,
            decisions=state.decisions,
            shares=state.shares,
            derived=state.derived,
            noticed=dict(alarm.noticed),
        )

    while not stopped:
        copies.clear()  # every pass reads the indexes afresh
        try:
            await one_pass(state, read, alarm)
        except Exception:  # one bad cycle must not stop scheduling; the next one retries
            log.exception("cycle failed; retrying")
            await stopped.wait(ERROR_BACKOFF_SECONDS)
        if state.cycle.preempted:  # the indexes lag its deletions and patches: a whole tick,
            await stopped.wait(CYCLE_SECONDS)  # whatever wakes meanwhile (as before the wake)
            continue
        binding = state.cycle.binding
        if binding is not None and not binding.done():
            # The cycle's bindings are being written: recovery keeps its tick meanwhile, and
            # wakes wait (no cycle could place before it is through). Once through, the status
            # of what it bound and the next cycle come at once.
            await asyncio.wait([binding], timeout=CYCLE_SECONDS)
            if not binding.done():
                continue
            alarm.ring()
        if state.cycle.deferred:  # gangs left for the next cycle (placement.PODS_PER_CYCLE)
            alarm.ring()
        await alarm.sleep(CYCLE_SECONDS)  # or less: a new job need not wait for the tick
    await scheduler.settle(state.cycle)  # stopping: let the last bindings be written


async def one_pass(
    state: Controllers, read: Callable[[], world.World], alarm: wake.Wake | None = None
) -> None:
    """1 read the world, forget what went, note the jobs that finished; 2 recovery;
    3 the inference autoscaler's recommendations and the expert maps' load balancing
    (:mod:`.experts`); 4 time-sharing's allowances; 5 the
    scheduling cycle; 6 the SuperNodes' status; 7 the Ascend jobs' rank tables, the daemons'
    tier-1 peers and KV-cache quotas. While the scheduling cycle's bindings are written (its
    binding cycle, a task of its own), a pass is 1 and 2 only: 3-5 read what the bindings
    write. The first pass after the binding cycle is through does 6 and 7 of the pass that
    started it after its own scheduling cycle (a gang that came meanwhile does not wait for
    the report: at 4 supernodes on two cores the owed report took a median 29 ms). When that
    cycle starts a binding cycle again, the report waits for a pass that binds nothing, at
    most :data:`REPORT_DEFERRED_SECONDS`, and is then written beside the binding cycle (in the
    peers' trace a report beside a binding cycle almost doubled its pods' creates: median
    41.8 ms against 22.7 ms). 6 and 7 may then read a world whose newest gangs are reserved
    but not yet bound: the rank tables say ``completed`` only once every rank is bound.

    A pass is CPU on the event loop (seconds at 64 supernodes): between its steps it lets the
    watches' handlers run, and when one of them stamped a node fault (``alarm.urgent``) the
    pass stops there and the loop starts the next, which begins with recovery. What it left
    undone comes in that next pass (the status report is owed: ``unreported``)."""
    if alarm is not None:
        alarm.calm()
    paced = Paced(alarm)
    now = read()
    state.forget_replaced(now.workloads)
    moment = clock.SYSTEM.now()
    cleanup.sweep(
        state.sweeper,
        now.nodes,
        now.workloads,
        state.act,
        lambda w: lifecycle.past_ttl(now, w, moment),
    )
    act = state.act
    lifecycle.observe(now, act)
    await recovery.run(now, state.recoveries, act)
    if state.binding():  # the rest reads what the binding cycle writes: next pass
        return
    owed = state.unreported  # the pass that started the binding cycle did not report
    if await paced.fault_came():
        return
    await autoscaler.run(now, state.autoscaling, act)
    if await paced.fault_came():
        return
    await experts.run(now, state.expert_loads, act)
    if await paced.fault_came():
        return
    state.shares = await timeshare.share(read(), state.sharing, act)
    if await paced.fault_came():
        return
    await scheduler.run_cycle(read, state.cycle, state.assumed, act, background=True)
    if not owed:  # owed from now until report() below is through
        state.owed_since = clock.SYSTEM.monotonic()
    if state.binding() and not owed:  # the pass after its binding cycle reports
        return
    if state.binding() and not state.report_overdue():  # it writes alone; the report waits
        return
    if await paced.fault_came():
        return
    writing = state.binding()  # a binding cycle under way: its status stays owed
    await report(state, read)
    state.owed_since = clock.SYSTEM.monotonic() if writing else None


@dataclass
class Paced:
    """A pass's yields to the watches' handlers between its steps."""

    alarm: wake.Wake | None
    yielded: float = field(default_factory=time.perf_counter)  # the pass began after a wait

    async def fault_came(self) -> bool:
        """Let the watches' handlers run (a pass holds the event loop between its API calls)
        when :data:`YIELD_AFTER_SECONDS` went since they last could, then whether one of them
        saw a node fault since the pass began."""
        if time.perf_counter() - self.yielded >= YIELD_AFTER_SECONDS:
            await asyncio.sleep(YIELD_SECONDS)
            self.yielded = time.perf_counter()
        return self.alarm is not None and self.alarm.urgent


async def report(state: Controllers, read: Callable[[], world.World]) -> None:
    """6 and 7 of a pass: the SuperNodes' status, the Ascend jobs' rank tables, the daemons'
    tier-1 peers and KV quotas."""
    act = state.act
    await supernode.report(read(), state.reported, act, state.sharing.transition_status)
    await ranktable.run(read(), state.tables, act)
    daemons.run(read(), state.cycle.kv, state.told, act, state.started)


class Forgets(Protocol):
    """A memory kept by workload UID (and name, for what is keyed by gang)."""

    def forget(self, uid: str, key: str) -> None: ...


@dataclass
class Controllers:
    """Everything the controllers remember between passes. One instance per running loop,
    owned by it (``controllers/`` keeps no module-level state); workloads are known by UID, and
    what is known of one is dropped when it goes or its name passes to a new object."""

    decisions: decided.Decisions = field(default_factory=decided.Decisions)
    assumed: assuming.Assumed = field(default_factory=assuming.Assumed)
    shares: decided.Shares = field(default_factory=decided.Shares)  # time-sharing's, last pass
    cycle: cyclestate.Memory = field(default_factory=cyclestate.Memory)
    recoveries: recovery_memory.State = field(default_factory=recovery_memory.State)
    sharing: timeshare.Memory = field(default_factory=timeshare.Memory)
    leases: heartbeat.LeaseClock = field(default_factory=heartbeat.LeaseClock)  # kubelets'
    heartbeats: heartbeat.LeaseClock = field(default_factory=heartbeat.LeaseClock)  # ckpt daemons'
    started: dict[str, float] = field(default_factory=dict)  # node → when its daemon started
    told: daemons.Memory = field(default_factory=daemons.Memory)  # tier-1 peers, KV quotas
    sweeper: cleanup.Sweeper = field(default_factory=cleanup.Sweeper)
    reported: dict[str, dict[str, Any]] = field(default_factory=dict)  # SuperNode → status
    identities: dict[str, str] = field(default_factory=dict)  # workload key → its UID
    act: executor.Executor = field(default_factory=executor.Live)  # the controllers' actions
    derived: world.Derived = field(default_factory=world.Derived)  # members, topologies
    autoscaling: autoscaler.Memory = field(default_factory=autoscaler.Memory)  # per service
    expert_loads: experts.Memory = field(default_factory=experts.Memory)  # per service
    tables: ranktable.Memory = field(default_factory=ranktable.Memory)  # HCCL rank tables
    # monotonic: when the status report became owed (a binding cycle started and the status
    # is not written since); None: nothing owed
    owed_since: float | None = None
    refused: set[tuple[str, str]] = field(default_factory=set)  # (node, endpoint) Leases said
    overdue: frozenset[str] = frozenset()  # nodes whose kubelet Lease was overdue, last read

    def forget(self, uid: str, key: str) -> None:
        """Drop the workload ``uid`` (named ``key``) from every memory kept by workload."""
        for memory in self.by_workload():
            memory.forget(uid, key)

    def by_workload(self) -> tuple[Forgets, ...]:
        """Every memory that keeps something per workload: each forgets one that went."""
        return (
            self.decisions,
            self.cycle,
            self.recoveries,
            self.sharing,
            self.autoscaling,
            self.expert_loads,
            self.tables,
        )

    def binding(self) -> bool:
        """Whether the last scheduling cycle's binding cycle is still writing."""
        task = self.cycle.binding
        return task is not None and not task.done()

    @property
    def unreported(self) -> bool:
        """Whether a status report is owed."""
        return self.owed_since is not None

    def report_overdue(self) -> bool:
        """Whether the owed status report has waited :data:`REPORT_DEFERRED_SECONDS`."""
        since = self.owed_since
        return since is not None and clock.SYSTEM.monotonic() - since >= REPORT_DEFERRED_SECONDS

    def forget_replaced(self, current: Sequence[workloads.Workload]) -> None:
        """Drop what the controllers remember of workloads that went, or whose name now
        belongs to an object with another UID (deleted and created again: a new job starts
        clean)."""
        now = {w.key: w.uid for w in current}
        for key, uid in self.identities.items():
            if now.get(key) != uid:
                log.info("forgetting a workload that went or was replaced", key=key, uid=uid)
                self.forget(uid, key)
        self.identities = now


@dataclass(frozen=True)
class Copied:
    """What one read copied out of the indexes, at ``taken``."""

    taken: float
    pods: dict[str, Any]
    announced: dict[str, daemonleases.Announced]
    silent: frozenset[str]
    supernodes: dict[str, Any]
    nodes: list[inventory.NodeInfo]
    foreign: dict[str, dict[str, int]]
    workloads: list[Workload]
    stale: frozenset[str]


class Copies:
    """The indexes' copies a pass reads again and again (six reads a pass: each controller
    reads what the ones before it did). Copied once a pass, and again when older than a tick
    (a pass that waited on seconds of API calls); what the operator wrote meanwhile is in the
    assumed holdings and decisions, which every read applies afresh, and what others changed
    is read by the next pass, as a watch that lags by that much would show it."""

    def __init__(self) -> None:
        self.copied: Copied | None = None

    def clear(self) -> None:
        self.copied = None

    def get(self, take: Callable[[], Copied]) -> Copied:
        copied = self.copied
        if copied is None or clock.SYSTEM.monotonic() - copied.taken > CYCLE_SECONDS:
            copied = self.copied = take()
        return copied


class Lagged:
    """Test knob (:data:`LAG_VARIABLE`): the pod index as it was ``lag`` seconds ago, to show
    that a watch lagging the loop never makes the operator give a card twice."""

    def __init__(self, lag: float) -> None:
        self.lag = lag
        self.history: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()

    def read(self, pods: dict[str, Any]) -> dict[str, Any]:
        if self.lag <= 0:
            return pods
        now = clock.SYSTEM.monotonic()
        self.history.append((now, pods))
        while len(self.history) > 1 and self.history[1][0] <= now - self.lag:
            self.history.popleft()
        return self.history[0][1]


def overdue(
    state: Controllers, leases: dict[str, tuple[float, float]], now: float
) -> frozenset[str]:
    """The nodes whose kubelet Lease is overdue (:meth:`heartbeat.LeaseClock.observe`), each
    said once when it becomes so: how long its renewTime has not changed on the operator's
    clock, and how old the newest renewal of any node is (a large one: the watch is behind, not
    the kubelet)."""
    stale = state.leases.observe(leases, now)
    if stale - state.overdue:
        newest = max((renewed for renewed, _ in leases.values()), default=0.0)
        wall = clock.SYSTEM.now().timestamp()
        for node in sorted(stale - state.overdue):
            renewed, seen = state.leases.seen[node]
            log.warning(
                "kubelet Lease overdue: the node counts as down",
                node=node,
                unchanged_s=round(now - seen, 1),
                renewed_s_ago=round(wall - renewed, 1),
                newest_renewal_s_ago=round(wall - newest, 1),
            )
    state.overdue = stale
    return stale


def daemons_down(
    silent: frozenset[str],
    announced: Mapping[str, daemonleases.Announced],
    stale: frozenset[str],
    now: float,
) -> tuple[frozenset[str], frozenset[str]]:
    """(unreachable, restarting): the nodes whose daemon does not answer (``silent``: probes
    failed or its Lease overdue), less those whose daemon was stopped on purpose
    (:func:`.daemonleases.restarting`, ``now`` in epoch seconds) under a kubelet that still
    renews its Lease (not in ``stale``): those restart, a rollout's daemons among them."""
    restarting = daemonleases.restarting(announced, now) - stale
    return silent - restarting, restarting


def with_endpoints(
    nodes: list[inventory.NodeInfo],
    announced: dict[str, daemonleases.Announced],
    refused: set[tuple[str, str]] | None = None,
) -> list[inventory.NodeInfo]:
    """The Nodes with their checkpoint daemon's endpoint, as its Lease announces it (none
    without a Lease, nor with one that points away from the node's InternalIP: said once per
    node and endpoint, remembered in ``refused``)."""
    out = []
    said = set() if refused is None else refused
    for node in nodes:
        lease = announced.get(node.name)
        if lease is not None and daemonleases.on_node(lease.endpoint, node.address):
            node = dataclasses.replace(node, endpoint=lease.endpoint)
        elif lease is not None and (node.name, lease.endpoint) not in said:
            said.add((node.name, lease.endpoint))
            log.warning(
                "a daemon Lease points away from its node: ignored",
                node=node.name,
                endpoint=lease.endpoint,
                internal_ip=node.address,
            )
        out.append(node)
    return out


def _all(index: kopf.Index[str, Any]) -> list[Any]:
    return [value for store in index.values() for value in store]


def _first(index: kopf.Index[str, Any]) -> dict[str, Any]:
    return {key: next(iter(store)) for key, store in index.items() if store}
