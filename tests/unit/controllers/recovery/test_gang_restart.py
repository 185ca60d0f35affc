"""``spec.recovery.restart: Gang`` (issue 30): a plain torchrun script's ranks exit when a peer
dies, so a recovery replaces every rank's pod — the hit ranks' on their targets (a SpareSwap's
spare), the others on their own node and cards — each told the same step to restore. With
the default ``Ranks`` only the hit ranks' pods go and the others reload in place."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime

import pytest

from matrixpool.controllers import timeshare
from matrixpool.controllers.recovery import carry_out, decide
from matrixpool.controllers.recovery import memory as recovery_memory
from matrixpool.k8s import daemonclient
from matrixpool.state.workloads import Workload
from matrixpool_recovery import policy
from matrixpool_recovery import restore as restore_codec
from tests.unit import worlds
from tests.unit.recorder import Recorder

T0 = datetime.datetime(2026, 12, 3, tzinfo=datetime.UTC)


def spare_swap(job: Workload) -> tuple[policy.Plan, policy.JobView]:
    """Rank 0's node n0 is lost; rank 0 moves to the spare n3; step 8 from peer copies."""
    view = policy.JobView(
        key=job.key,
        world_size=3,
        node_of={r: policy.NodeName(f"n{r}") for r in range(3)},
        cards_of=dict.fromkeys(range(3), worlds.EIGHT),
        rack_of={},
        supernode_of={},
    )
    plan = policy.Plan(
        level=policy.Level.SPARE_SWAP,
        cause="NodeDown on n0",
        ranks=frozenset({0}),
        targets={0: policy.NodeName("n3")},
        sources={r: policy.Copy(r, 8, policy.Tier.MEMORY, policy.NodeName("n1")) for r in range(3)},
        restored_step=8,
        lost_steps=0,
        reason="a spare is free",
    )
    return plan, view


@pytest.mark.parametrize(("restart", "replaced"), [("Ranks", ["0"]), ("Gang", ["0", "1", "2"])])
def test_the_plan_targets_the_hit_ranks_or_every_rank(restart: str, replaced: list[str]) -> None:
    job = worlds.job("ddp", 3, recovery={"restart": restart})
    plan, view = spare_swap(job)
    record = decide.plan_record(job, plan, view, daemonclient.Inventory(), T0)
    assert sorted(record.targets) == replaced
    assert record.targets["0"] == "n3"  # the hit rank goes to the spare either way
    for rank in replaced[1:]:
        assert record.targets[rank] == f"n{rank}"  # the others stay where they are
        assert record.target(int(rank)) == (f"n{rank}", "0,1,2,3,4,5,6,7")
    assert record.status.ranks == [0]  # what was hit, as status.recoveries lists it
    assert all(record.restore_for(r) for r in range(3))


def test_a_gang_restart_deletes_every_ranks_pod_and_annotates_none() -> None:
    job = worlds.job("ddp", 3, recovery={"restart": "Gang"})
    plan, view = spare_swap(job)
    record = decide.plan_record(job, plan, view, daemonclient.Inventory(), T0)
    pods = worlds.running("ddp", 3)
    world = worlds.fixed_world(worlds.index(*pods), [job], nodes=4, down=frozenset({"n0"}))
    nodes = {n.name: n for n in world.nodes}
    act = Recorder()
    state = recovery_memory.State()
    asyncio.run(carry_out.carry_out(job, record, pods, nodes, frozenset({"n0"}), world, state, act))
    assert sorted(act.deleted + act.deleted_at_once) == ["ns/ddp-0", "ns/ddp-1", "ns/ddp-2"]
    assert act.annotated == []  # no rank is left running to reload in place


def test_every_rank_is_told_the_daemons_holding_any_ranks_copy() -> None:
    """DCP reads rank 0's Metadata on every rank and a replicated tensor from whichever rank
    kept it: each restore names every holder but the rank's own node."""
    job = worlds.job("ddp", 3, recovery={"restart": "Gang"})
    plan, view = spare_swap(job)
    holders = {0: "n1", 1: "n1", 2: "n0"}  # rank 0's peer copy on n1; rank 2's copy on n0
    sources = {
        r: policy.Copy(r, 8, policy.Tier.MEMORY, policy.NodeName(n)) for r, n in holders.items()
    }
    plan = dataclasses.replace(plan, sources=sources)
    endpoints = {f"n{i}": f"10.0.0.{i}:7040" for i in range(4)}
    shared = decide.shared_holders(plan, endpoints)
    assert shared == [("n1", "10.0.0.1:7040"), ("n0", "10.0.0.0:7040")]
    named = {
        (rank, home): decide.restore_sources(plan, rank, home, endpoints, shared)
        for rank, home in ((0, "n3"), (1, "n1"), (2, "n2"))
    }
    assert named[0, "n3"] == ["10.0.0.1:7040", "10.0.0.0:7040"]
    assert named[1, "n1"] == ["10.0.0.0:7040"]
    assert named[2, "n2"] == ["10.0.0.0:7040", "10.0.0.1:7040"]
    assert decide.restore_sources(plan, 2, None, {}, []) == []  # no endpoint known: none named
    inventory = daemonclient.Inventory(endpoints=endpoints)
    record = decide.plan_record(job, plan, view, inventory, T0)
    told = {r: restore_codec.parse_restore(record.restore_for(r) or "") for r in range(3)}
    assert told[0] is not None
    assert sorted(told[0].sources) == ["10.0.0.0:7040", "10.0.0.1:7040"]
    assert told[1] is not None
    assert told[1].sources == ("10.0.0.0:7040",)


def test_a_restore_names_rank_0s_holder_alone_once_the_holders_are_many() -> None:
    """At scale every annotation would list every holder: then only rank 0's (the Metadata)
    is named beside a rank's own."""
    ranks = decide.HOLDERS_NAMED + 8
    sources = {
        r: policy.Copy(r, 8, policy.Tier.MEMORY, policy.NodeName(f"n{r}")) for r in range(ranks)
    }
    plan = policy.Plan(
        level=policy.Level.IN_PLACE,
        cause="PodFailed",
        ranks=frozenset({5}),
        targets={},
        sources=sources,
        restored_step=8,
        lost_steps=0,
        reason="",
    )
    endpoints = {f"n{r}": f"e{r}" for r in range(ranks)}
    shared = decide.shared_holders(plan, endpoints)
    assert shared == [("n0", "e0")]
    assert decide.restore_sources(plan, 5, None, endpoints, shared) == ["e5", "e0"]
    assert decide.restore_sources(plan, 0, "n1", endpoints, shared) == ["e0"]


QUIET_ALL_DAY = {  # a time-shared SuperNode whose one window gives training every card
    "timezone": "UTC",
    "windows": [{"name": "quiet", "start": "00:00", "end": "00:00", "inferenceCards": 0}],
    "checkpointGraceSeconds": 30,
}


def test_a_gang_restart_on_a_time_shared_supernode_keeps_its_size_until_its_new_pods_run() -> None:
    """A gang restart deletes every pod; while they terminate, time-sharing saw a job of 0
    live replicas (allowance 0, "Suspended") and the recovery, needing 0 ranks, was recorded
    done at once: the new pods came without their restore annotation and trained from step 0
    (the sim's e2e run of examples/pytorch-ddp.yaml)."""
    job = worlds.job("ddp", 3, recovery={"restart": "Gang"})
    plan, view = spare_swap(job)
    plan = dataclasses.replace(plan, targets={}, level=policy.Level.IN_PLACE)
    record = decide.plan_record(job, plan, view, daemonclient.Inventory(), T0)
    terminating = worlds.running("ddp", 3, deleting=True)
    world = worlds.fixed_world(worlds.index(*terminating), [job], time_sharing=QUIET_ALL_DAY)
    world.decisions.plan_recovery(job.uid, record)
    act = Recorder()
    shares = asyncio.run(timeshare.share(world, timeshare.Memory(), act))
    assert shares.training[job.key] == 3, "its pods are replaced, not released"
    assert job.key not in shares.phases
    world.shares.training.update(shares.training)
    nodes = {n.name: n for n in world.nodes}
    state = recovery_memory.State()
    for facts in (terminating, []):  # the old pods going, then gone: the new ones to come
        asyncio.run(carry_out.carry_out(job, record, facts, nodes, frozenset(), world, state, act))
        assert not act.status_of("ddp", "recoveries"), "recorded before any rank ran again"
    world.shares.training[job.key] = 0  # even an allowance of 0 does not end it
    asyncio.run(carry_out.carry_out(job, record, [], nodes, frozenset(), world, state, act))
    assert not act.status_of("ddp", "recoveries")

    mine = {"restore": record.restore_for(0) or ""}
    again = worlds.running("ddp", 3, **mine)
    world.shares.training[job.key] = 3
    asyncio.run(carry_out.carry_out(job, record, again, nodes, frozenset(), world, state, act))
    [entries] = act.status_of("ddp", "recoveries")
    assert [e["level"] for e in entries] == ["InPlace"]
