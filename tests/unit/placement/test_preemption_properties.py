"""Preemption over random clusters and queues of preemptors (a seeded loop, issue 34).

Each case is a random cluster (supernodes, racks, node sizes, card groups) filled with random
running gangs (priorities, elastic floors, rank groups, affinities, lost work per card), then a
queue of preemptors taken in turn, each plan carried out before the next. For every plan:
never a hard-tier violation (a rank group in one rack, ``Required`` in one supernode), never a
partial gang evicted (an evicted gang loses every pod, a shrunk one keeps at least its floor of
lowest ranks), never a victim of equal or higher priority, every victim gives up cards on a
node the preemptor takes (none outside its domain), the placement fits once the victims are
gone, and the work lost is at most that of the smallest-set rule
(:data:`~matrixpool.placement.preemption.SMALLEST_SET`) on the same state.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from matrixpool.placement import engine, model, preemption
from tests.builders import gang, supernode

CLUSTERS = 1000
GROUPS = {4: ((0, 1), (2, 3)), 8: ((0, 1, 2, 3), (4, 5, 6, 7))}
LOST = (0.0, 30.0, 300.0, 3000.0)  # lost work per card, seconds (plus a random part)

Victims = dict[model.GangKey, model.GangRequest]


def test_preemption_keeps_the_tiers_and_loses_no_more_than_the_smallest_set() -> None:
    seen: Counter[str] = Counter()
    for seed in range(CLUSTERS):
        rng = random.Random(seed)
        tops = cluster(rng)
        snapshot, victims = filled(rng, tops)
        for k in range(rng.randint(1, 3)):
            request = preemptor(rng, f"ns/new{k}", [t.name for t in tops])
            seen[check_one(snapshot, victims, request)] += 1
    assert sum(seen.values()) >= CLUSTERS
    # the random worlds do exercise the rule: many preemptions, some with evictions
    assert seen["evicted"] >= 200, seen
    assert seen["shrunk"] >= 50, seen


def cluster(rng: random.Random) -> list[model.SuperNodeTopology]:
    result = []
    for k in range(rng.randint(1, 3)):
        size = rng.choice([4, 8])
        builder = supernode(f"sn-{k}").racks(rng.randint(1, 3), nodes=rng.randint(1, 4))
        builder = builder.cards(size).spares(rng.choice([0, 0, 0, 1]))
        if rng.random() < 0.3:
            builder = builder.groups(*GROUPS[size])
        result.append(builder.build())
    return result


def filled(
    rng: random.Random, tops: list[model.SuperNodeTopology]
) -> tuple[engine.Snapshot, Victims]:
    """Running gangs of random shapes, each placed where the engine puts it."""
    snapshot = engine.Snapshot.build(tops, [])
    victims: Victims = {}
    names = [t.name for t in tops]
    for k in range(rng.randint(2, 14)):
        pods = rng.randint(1, 4)
        builder = gang(f"ns/run{k}").priority(rng.randint(0, 4)).pods(pods, rng.choice([1, 2, 4]))
        builder = builder.loses(rng.choice(LOST) + rng.randint(0, 100))
        if rng.random() < 0.3:
            builder = builder.on(rng.choice(names))
        if rng.random() < 0.3:
            builder = builder.preferred()
        if rng.random() < 0.2:
            builder = builder.group_size(rng.choice([2, pods]))
        if pods > 1 and rng.random() < 0.4:
            builder = builder.elastic(rng.randint(1, pods - 1))
        if rng.random() < 0.05:
            builder = builder.not_preemptible()
        request = builder.build()
        verdict = engine.place(snapshot, request)
        if isinstance(verdict, model.Placement):
            snapshot.commit(verdict)
            victims[request.gang] = request
    return snapshot, victims


def preemptor(rng: random.Random, key: str, names: list[str]) -> model.GangRequest:
    pods = rng.randint(1, 4)
    builder = gang(key).priority(rng.randint(1, 6)).pods(pods, rng.choice([2, 4, 8]))
    builder = builder.loses(rng.choice(LOST))
    if rng.random() < 0.5:
        builder = builder.group_size(pods if rng.random() < 0.7 else 2)
    if rng.random() < 0.3:
        builder = builder.on(rng.choice(names))
    if rng.random() < 0.2:
        builder = builder.preferred()
    return builder.build()


def check_one(snapshot: engine.Snapshot, victims: Victims, request: model.GangRequest) -> str:
    """One preemptor: the plan checked against the rules and the reference, then carried out."""
    before = list(snapshot.holdings())
    verdict = engine.preempt(snapshot, request, victims)
    reference = engine.preempt(snapshot, request, victims, rule=preemption.SMALLEST_SET)
    assert list(snapshot.holdings()) == before  # preempt leaves the snapshot alone
    if isinstance(verdict, model.Unplaceable):
        assert isinstance(reference, model.Unplaceable), "the reference found room, we did not"
        return "unplaceable"
    if isinstance(reference, model.Preemption):
        assert lost_work(snapshot, victims, verdict) <= lost_work(snapshot, victims, reference)
    check_victims(snapshot, victims, request, verdict)
    carry_out(snapshot, victims, verdict)
    check_tiers(snapshot, request, verdict.placement)
    snapshot.commit(verdict.placement)  # fits: raises when a card is not free
    victims[request.gang] = request
    if verdict.evict:
        return "evicted"
    return "shrunk" if verdict.shrink else "placed"


def given_up(
    snapshot: engine.Snapshot, victims: Victims, plan: model.Preemption
) -> dict[model.GangKey, int]:
    """Cards each victim of ``plan`` gives up."""
    cards = {k: snapshot.held_cards(k) for k in plan.evict}
    for key, keep in plan.shrink.items():
        held = snapshot.held.get(key, {})
        gone = [p.pod for p in victims[key].pods[keep:]]
        cards[key] = sum(held[p][1].bit_count() for p in gone if p in held)
    return cards


def lost_work(snapshot: engine.Snapshot, victims: Victims, plan: model.Preemption) -> float:
    cards = given_up(snapshot, victims, plan)
    return sum(n * victims[k].lost_work_per_card_s for k, n in cards.items())


def check_victims(
    snapshot: engine.Snapshot,
    victims: Victims,
    request: model.GangRequest,
    plan: model.Preemption,
) -> None:
    """Strictly lower and preemptible; shrinks within the floor; each gives up cards on a node
    the preemptor takes."""
    assert set(plan.shrink).isdisjoint(plan.evict)
    taken = {a.node for a in plan.placement.assignments}
    names = snapshot.layout.names
    for key in [*plan.shrink, *plan.evict]:
        victim = victims[key]
        assert victim.priority < request.priority
        assert victim.preemptible
        held = snapshot.held[key]
        gone = [p.pod for p in victim.pods[plan.shrink[key] :]] if key in plan.shrink else held
        freed = {names[held[p][0]] for p in gone if p in held}
        assert freed & taken, f"{key} gives up cards outside where {request.gang} goes"
    for key, keep in plan.shrink.items():
        assert (victims[key].min_pods or 0) <= keep < len(victims[key].pods)


def carry_out(snapshot: engine.Snapshot, victims: Victims, plan: model.Preemption) -> None:
    """Evict and shrink as planned, and check that no gang is left partial."""
    for key in plan.evict:
        snapshot.release(key)
        assert not snapshot.held.get(key), f"{key} evicted, yet some pods hold cards"
        del victims[key]
    for key, keep in plan.shrink.items():
        victim = victims[key]
        held_before = {p.pod for p in victim.pods if p.pod in snapshot.held.get(key, {})}
        snapshot.release_pods(key, [p.pod for p in victim.pods[keep:]])
        still = set(snapshot.held.get(key, {}))
        assert still == held_before & {p.pod for p in victim.pods[:keep]}
        floor = min(victim.min_pods or 0, keep)
        victims[key] = dataclasses.replace(victim, pods=victim.pods[:keep], min_pods=floor)


def check_tiers(
    snapshot: engine.Snapshot, request: model.GangRequest, placement: model.Placement
) -> None:
    """Every pod placed; Required in one supernode (the named one); each rank group in one
    rack."""
    assert [a.pod for a in placement.assignments] == [p.pod for p in request.pods]
    if request.affinity is model.Affinity.REQUIRED:
        assert len(placement.supernodes) == 1
        assert request.supernode in (None, *placement.supernodes)
    layout = snapshot.layout
    group = request.group_size or 1
    racks = [layout.node_rack[layout.index[a.node]] for a in placement.assignments]
    for start in range(0, len(racks), group):
        assert len(set(racks[start : start + group])) == 1, f"{request.gang}: a group spans racks"
