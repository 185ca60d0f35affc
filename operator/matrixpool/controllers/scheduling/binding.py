"""The scheduling cycle's writes of reservations and Bindings: phase 4, reserved gangs bound
and partial reservations undone (:func:`finish_half_bound`); phase 6, each placed gang reserved
then bound, a new gang's pods created reserved (:func:`bind`), and the new gangs that wait
created unreserved (:func:`create_unplaced`). Binding is two-phase (:mod:`matrixpool.k8s.pods`);
what is written is assumed held (:mod:`matrixpool.state.assumed`) until the watch shows it. A
refusal for RBAC becomes the gang's reason (:data:`FORBIDDEN`). Called by :mod:`.cycle`."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from matrixpool import clock, metrics
from matrixpool.api import labels
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import convert, pods
from matrixpool.placement import gangs, model
from matrixpool.state.workloads import Workload

log = structlog.get_logger(__name__)

FORBIDDEN = "Forbidden"  # the code of a gang whose reservation or Binding RBAC refused
POD_SECURITY = "PodSecurity"  # the code of a gang whose pods its namespace's level refused
POD_SECURITY_REFUSAL = "violates PodSecurity"  # in the API server's message then
RATE_SAMPLE_PODS = 16  # a binding cycle of fewer pods does not set Memory.bind_rate


async def finish_half_bound(
    cycle: cyclestate.CycleState, wanted: Mapping[str, list[gangs.Gang]]
) -> list[cyclestate.Pending]:
    """Gangs still to place; binds fully reserved gangs, clears partial reservations."""
    pending: list[cyclestate.Pending] = []
    finish: list[convert.PodFacts] = []
    owners: dict[str, tuple[Workload, model.GangKey]] = {}  # pod key -> its gang
    undo: list[convert.PodFacts] = []
    for workload in cycle.world.workloads:
        facts = {p.name: p for p in cycle.world.pods.get(workload.key, [])}
        for gang in wanted.get(workload.key, []):
            pods_now = [facts.get(p.name) for p in gang.pods]
            if any(p is None or p.deleting for p in pods_now):
                continue  # wait until every pod exists (and old ones are gone)
            present = [p for p in pods_now if p is not None]
            state = gang_state(present)
            if state == "reserved":
                finish += [p for p in present if not p.node]
                owners.update({p.key: (workload, gang.request.gang) for p in present})
            elif state == "partial":
                undo += [p for p in present if p.reserved_node]
            elif state in ("unplaced", "holed"):
                pending.append(cyclestate.Pending(workload, gang, present))
    if undo:
        log.info("clearing partial reservations", pods=len(undo))
        await cycle.act.unreserve([(p.namespace, p.name) for p in undo])
        for p in undo:
            cycle.assumed.released(p)
    if finish:
        log.info("finishing reserved gangs", pods=len(finish))
        outcomes = await cycle.act.bind([(*p.ref, p.reserved_node or "") for p in finish])
        refused: set[model.GangKey] = set()
        for p, outcome in zip(finish, outcomes, strict=True):
            workload, key = owners[p.key]
            if not note_bound(cycle, p, p.reserved_node or "", p.cards, outcome):
                refused.add(key)
                note_refusal(cycle, workload, key, "bind", outcome)
        for _, key in owners.values():
            reason = cycle.memory.reasons.get(key)
            if (
                key not in refused
                and reason is not None
                and reason.code in (FORBIDDEN, POD_SECURITY)
            ):
                cycle.memory.reasons.pop(key, None)
    return pending


def gang_state(present: Sequence[convert.PodFacts]) -> str:
    """bound | reserved (all chosen, binding unfinished) | partial (a reservation interrupted)
    | holed (some pods bound, others new) | unplaced."""
    if all(p.node for p in present):
        return "bound"
    if all(p.node or (p.reserved_node and p.cards) for p in present):
        return "reserved"
    if any(p.reserved_node and not p.node for p in present):
        return "partial"
    if any(p.node for p in present):
        return "holed"
    return "unplaced"


async def bind(
    cycle: cyclestate.CycleState, bindings: Sequence[cyclestate.Binding]
) -> list[cyclestate.Binding]:
    """Each gang at once, on its own: reserve every pod (a new gang's pods are created
    reserved), then bind them if every reservation took; the bindings that went through.
    A gang does not wait for the others' reservations before its Bindings go out. What
    was written is assumed held (state.assumed)."""
    if not bindings:
        return []
    started = clock.SYSTEM.monotonic()
    pods_bound = await asyncio.gather(*(bind_gang(cycle, b) for b in bindings))
    failed = {b.placement.gang for b, n in zip(bindings, pods_bound, strict=True) if n is None}
    reservations = [b.placement.assignments for b in bindings]
    done = [b for b in bindings if b.placement.gang not in failed]
    elapsed = clock.SYSTEM.monotonic() - started
    metrics.BIND_SECONDS.observe(elapsed)
    written = sum(n for n in pods_bound if n is not None)
    metrics.BOUND_PODS.inc(written)
    if written >= RATE_SAMPLE_PODS and elapsed > 0:  # a few pods show latency, not pace
        cycle.memory.bind_rate = written / elapsed
    for b in done:
        nodes = {a.node for a in b.placement.assignments}
        where = sorted({cycle.supernode_of.get(n, "?") for n in nodes})
        cycle.event(
            b.pending.workload,
            "Normal",
            "Scheduled",
            f"gang {b.placement.gang}: {len(b.placement.assignments)} pods bound on "
            f"{len(nodes)} nodes of {', '.join(where)} in {elapsed:.2f} s",
        )
    log.info(
        "bound gangs",
        gangs=len(done),
        failed=len(failed),
        pods=sum(len(r) for r in reservations),
        seconds=round(elapsed, 3),
    )
    return done


async def bind_gang(cycle: cyclestate.CycleState, b: cyclestate.Binding) -> int | None:
    """Reserve, then bind, one gang's pods; how many were bound, or None if the gang
    failed (a reservation or a Binding refused: the next cycle finishes or undoes it)."""
    key = b.placement.gang
    if b.pending.new is not None:
        [(_, made)] = await create_reserved(cycle, [b])
        if made is None:
            return None
        reservations = made
    else:
        reservations = unbound(b)
        for pod, node, cards in reservations:
            cycle.assumed.reserved(pod, node, cards)
        outcomes = await cycle.act.reserve(
            [(p.namespace, p.name, n, labels.format_cards(c)) for p, n, c in reservations]
        )
        refused = False
        for (pod, _, _), outcome in zip(reservations, outcomes, strict=True):
            if outcome is not None:
                cycle.assumed.released(pod)
                refused = True
                log.warning("could not reserve", pod=pod.key, error=str(outcome))
                note_refusal(cycle, b.pending.workload, key, "reserve", outcome)
        if refused:
            return None
    bound = await cycle.act.bind([(*p.ref, n) for p, n, _ in reservations])
    ok = True
    for (pod, node, cards), outcome in zip(reservations, bound, strict=True):
        if not note_bound(cycle, pod, node, cards, outcome):
            ok = False
            note_refusal(cycle, b.pending.workload, key, "bind", outcome)
    return len(reservations) if ok else None


async def create_reserved(
    cycle: cyclestate.CycleState, bindings: Sequence[cyclestate.Binding]
) -> list[tuple[cyclestate.Binding, list[tuple[convert.PodFacts, str, frozenset[int]]] | None]]:
    """Create the pods of new gangs with their reservation; per gang (pod, node, cards) of
    each, or None if one could not be created (its created pods are then a partial
    reservation: the next cycle clears it and places the gang again)."""
    manifests: list[dict[str, Any]] = []
    owners: list[tuple[cyclestate.Binding, str, frozenset[int]]] = []
    rest: list[dict[str, Any]] = []  # pods the placement gives no card: created unreserved
    for b in bindings:
        assert b.pending.new is not None
        chosen = {a.pod.split("/", 1)[1]: a for a in b.placement.assignments}
        for name, manifest in b.pending.new.items():
            a = chosen.get(name)
            if a is None:
                rest.append(manifest)
                continue
            body = copy.deepcopy(manifest)
            notes = body["metadata"].setdefault("annotations", {})
            notes[convert.NODE_ANNOTATION] = a.node
            notes[labels.CARDS] = labels.format_cards(frozenset(a.cards))
            manifests.append(body)
            owners.append((b, a.node, frozenset(a.cards)))
    answers = await cycle.act.create_reserved(manifests) if manifests else []
    made: dict[model.GangKey, list[tuple[convert.PodFacts, str, frozenset[int]]] | None] = {
        b.placement.gang: [] for b in bindings
    }
    for (b, node, cards), (facts, outcome) in zip(owners, answers, strict=True):
        key = b.placement.gang
        if facts is None:
            log.warning("could not create a reserved pod", gang=key, error=str(outcome))
            note_refusal(cycle, b.pending.workload, key, "create", outcome)
            made[key] = None
            continue
        cycle.assumed.made(facts)
        cycle.world.pods.setdefault(f"{facts.namespace}/{facts.owner}", []).append(facts)
        gang_made = made[key]
        if gang_made is not None:
            gang_made.append((facts, node, cards))
    if rest:
        await cycle.act.create_pods(rest)
    return [(b, made[b.placement.gang]) for b in bindings]


async def create_unplaced(cycle: cyclestate.CycleState, tried: set[model.GangKey]) -> None:
    """New gangs that could not be placed this cycle get their pods now, unreserved: the
    pods show the gang waiting (kubectl get pods), and the next cycles place them. Each pod
    created is in the operator's view at once (:meth:`Assumed.made`): a next cycle whose pod
    index lags does not make the gang again (for a job whose size moved meanwhile, with
    another world)."""
    manifests = [
        m for p in cycle.new if p.gang.request.gang not in tried for m in (p.new or {}).values()
    ]
    if not manifests:
        return
    try:
        outcomes = await cycle.act.create_reserved(manifests)
    except Exception as error:  # e.g. a namespace being deleted: next cycle again
        log.warning("could not create pods", pods=len(manifests), error=str(error))
        return
    for facts, outcome in outcomes:
        if facts is not None:
            cycle.assumed.made(facts)
        elif not isinstance(outcome, pods.AlreadyExistsError):  # there already: the index lags
            log.warning("could not create a pod", error=str(outcome))


def unbound(
    binding: cyclestate.Binding,
) -> list[tuple[convert.PodFacts, str, frozenset[int]]]:
    """(pod, node, cards) of every pod of the gang that the placement gives cards."""
    facts = {p.key: p for p in binding.pending.pods}
    return [
        (facts[a.pod], a.node, frozenset(a.cards))
        for a in binding.placement.assignments
        if a.pod in facts and not facts[a.pod].node
    ]


def note_refusal(
    cycle: cyclestate.CycleState,
    workload: Workload,
    key: model.GangKey,
    step: str,
    outcome: pods.Outcome,
) -> None:
    """A reservation or Binding the API server refused for RBAC (403): the gang's
    Scheduled condition and a Warning Event say so, with the API server's words (the
    operator's ServiceAccount lacks a rule of the chart's ClusterRole), and an error is
    logged. Other failures are retried quietly by the next cycle."""
    message = k8s_client.forbidden(outcome) if outcome is not None else None
    if message is None:
        return
    if POD_SECURITY_REFUSAL in message:  # the namespace's level, not our RBAC: the template
        reason = model.Reason(
            POD_SECURITY,
            f"the namespace's Pod Security admission refused to {step} its pods: {message} "
            "(the template asks for what the namespace's level forbids)",
        )
    else:
        reason = model.Reason(
            FORBIDDEN,
            f"the API server refused to {step} its pods: {message} (the operator's "
            "ServiceAccount lacks a rule of the chart's ClusterRole)",
        )
    if cycle.memory.reasons.get(key) != reason:
        said = "forbidden by RBAC" if reason.code == FORBIDDEN else "refused by Pod Security"
        log.error(said, gang=key, step=step, message=message)
        cycle.event(workload, "Warning", reason.code, f"gang {key}: {reason.message}")
    cycle.memory.reasons[key] = reason


def note_bound(
    cycle: cyclestate.CycleState,
    pod: convert.PodFacts,
    node: str,
    cards: frozenset[int],
    outcome: pods.Outcome,
) -> bool:
    """Remember a Binding that went through; a failed one leaves the reservation (the next
    cycle finishes it), one bound elsewhere leaves it to the index, and one answered 404 or
    :class:`pods.ReplacedError` (another pod of its name now) forgets the pod: it is gone,
    with whatever the operator assumed of it (a pod it created and that was deleted before
    the index showed it would otherwise be seen, half reserved, for
    ``assumed.CREATED_SECONDS``, and its gang cleared and not placed again meanwhile)."""
    if outcome is None:
        cycle.assumed.bound(pod, node, cards)
        return True
    if isinstance(outcome, pods.BoundElsewhereError):
        cycle.assumed.released(pod)
    elif isinstance(outcome, pods.ReplacedError) or k8s_client.is_status(outcome, 404):
        cycle.assumed.gone(pod)
    log.warning("could not bind", pod=pod.key, node=node, error=str(outcome))
    return False
