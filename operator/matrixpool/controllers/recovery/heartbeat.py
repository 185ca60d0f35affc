"""Whether the nodes and their checkpoint daemons are alive: the daemons' heartbeat, probed
every :data:`PROBE_SECONDS` under training ranks and every :data:`IDLE_PROBE_SECONDS` elsewhere
(:func:`probe`, called by :func:`.controller.run`; a daemon silent for
:data:`~.memory.UNREACHABLE_AFTER` counts as lost), and the kubelets' Leases read on the
operator's own clock (:class:`LeaseClock`, :func:`stale_leases`; the main loop keeps one for the
kubelets' Leases and one for the daemons' own).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from matrixpool import clock
from matrixpool.api import trainingjob
from matrixpool.controllers.recovery import memory
from matrixpool.k8s import executor
from matrixpool.state import world as read_model

PROBE_SECONDS = 0.5  # heartbeat period of the daemons under training ranks
IDLE_PROBE_SECONDS = 5.0  # heartbeat period of every other daemon (spares, idle nodes)


@dataclass
class LeaseClock:
    """When each node's Lease was last seen renewed, on the operator's own monotonic clock.

    As kube-controller-manager's node lifecycle controller does, a Lease's age is measured from
    when the *observed* renewTime last changed, not by comparing the kubelet's renewTime with
    the operator's wall clock: a kubelet whose clock is off is not down, and an operator that
    just started gives every node the full grace. Owned by the main loop."""

    seen: dict[str, tuple[float, float]] = field(default_factory=dict)  # node → (renewTime,
    # the monotonic instant it was first seen with that value)

    def observe(self, leases: Mapping[str, tuple[float, float]], now: float) -> frozenset[str]:
        """The stale nodes (:func:`stale_leases`) once ``leases`` (node → (renewTime,
        duration)) are observed at monotonic ``now``."""
        for node, (renewed, _) in leases.items():
            known = self.seen.get(node)
            if known is None or known[0] != renewed:
                self.seen[node] = (renewed, now)
        for node in set(self.seen) - set(leases):
            del self.seen[node]  # the node and its Lease went
        return stale_leases({n: (self.seen[n][1], d) for n, (_, d) in leases.items()}, now)


def stale_leases(leases: Mapping[str, tuple[float, float]], now: float) -> frozenset[str]:
    """Nodes (→ (when the Lease was last renewed, its duration), on the clock of ``now``)
    whose kubelet has not renewed its Lease for three quarters of the lease's duration (three
    missed renewals at the kubelet's quarter-duration pace): counted as down before the node
    controller's grace (the whole duration, 40 s by default) marks them
    NotReady, and before its pod eviction.

    When a quarter of all Leases or more are overdue at once, the API server (or the
    operator's view of it) is what failed, not the nodes: none counts."""
    stale = frozenset(
        n for n, (renewed, duration) in leases.items() if now - renewed > duration * 0.75
    )
    return stale if len(stale) * 4 < len(leases) else frozenset()


def probe(world: read_model.World, state: memory.State, act: executor.Executor) -> None:
    """Probe the daemons under training ranks every PROBE_SECONDS, the others (spares and
    idle nodes, where a gang may land) every IDLE_PROBE_SECONDS, in a task of its own
    (:mod:`matrixpool.controllers.background`; :func:`.controller.run` waits for it, bounded)."""
    now = clock.SYSTEM.monotonic()
    if now - state.probed_at < PROBE_SECONDS or state.tasks.busy("probe"):
        return
    state.probed_at = now
    everyone = now - state.idle_probed_at >= IDLE_PROBE_SECONDS
    if everyone:
        state.idle_probed_at = now
    busy = {
        p.node
        for w in world.workloads
        if w.kind == trainingjob.KIND
        for p in world.pods.get(w.key, [])
        if p.node
    }
    endpoints: dict[str, str] = {
        n.name: n.endpoint
        for n in world.nodes
        if n.endpoint and (everyone or n.name in busy or n.name in state.silent_since)
    }
    published = {n.name for n in world.nodes if n.endpoint}
    state.tasks.start("probe", heartbeat(endpoints, published, now, state, act))


async def heartbeat(
    endpoints: Mapping[str, str],
    published: Collection[str],
    now: float,
    state: memory.State,
    act: executor.Executor,
) -> None:
    """One probe of ``endpoints``; a daemon that does not answer is silent since ``now``."""
    answers = await act.probe(endpoints)
    for node, healthy in answers.items():
        if healthy:
            state.silent_since.pop(node, None)
        else:
            state.silent_since.setdefault(node, now)
    for node in list(state.silent_since):
        if node not in published:  # the node or its daemon's endpoint is gone
            del state.silent_since[node]
