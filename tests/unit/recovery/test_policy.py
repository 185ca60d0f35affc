"""The recovery decision (matrixpool_recovery.policy): a table row per rule, then properties.

The cluster of the table: supernode sn-a, rack r1 holds n1, n2 and spare s1; rack r2 holds n3,
n4 and spare s2. Tier-1 peers cross racks: n1↔n3, n2↔n4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrixpool_recovery import policy
from matrixpool_recovery.policy import Copy, Fault, FaultKind, JobView, Level, Tier

N = policy.NodeName
RACK = {"n1": "r1", "n2": "r1", "s1": "r1", "n3": "r2", "n4": "r2", "s2": "r2"}
PEER = {"n1": "n3", "n2": "n4", "n3": "n1", "n4": "n2"}
ALL = tuple(Level)


def gang(
    *nodes: str,
    per_node: int = 1,
    levels: tuple[Level, ...] = ALL,
    recoveries: int = 0,
    max_recoveries: int = 10,
) -> JobView:
    """Ranks in node order, ``per_node`` ranks of 8/per_node cards on each node."""
    size = 8 // per_node
    node_of = {i: N(n) for i, n in enumerate(n for n in nodes for _ in range(per_node))}
    cards = {r: frozenset(range((r % per_node) * size, (r % per_node + 1) * size)) for r in node_of}
    return JobView(
        key="ml/llm",
        world_size=len(node_of),
        node_of=node_of,
        cards_of=cards,
        rack_of={N(n): r for n, r in RACK.items()},
        supernode_of={N(n): "sn-a" for n in RACK},
        levels=levels,
        recoveries=recoveries,
        max_recoveries=max_recoveries,
    )


def saved(
    job: JobView,
    memory: Iterable[int] = (),
    local: Iterable[int] = (),
    persistent: Iterable[int] = (),
    corrupt: Iterable[tuple[int, int, Tier]] = (),
) -> list[Copy]:
    """Copies of every rank: memory on its node plus a peer copy, disk on its node, tier 3."""
    bad = set(corrupt)
    out = []
    for rank, node in job.node_of.items():
        tiers = [(s, Tier.MEMORY, node) for s in memory]
        tiers += [(s, Tier.PEERS, N(PEER[node])) for s in memory]
        tiers += [(s, Tier.LOCAL, node) for s in local]
        tiers += [(s, Tier.PERSISTENT, None) for s in persistent]
        out += [Copy(rank, s, t, n, valid=(rank, s, t) not in bad) for s, t, n in tiers]
    return out


def spares(*names: str) -> policy.Spares:
    return policy.Spares({"sn-a": tuple(N(n) for n in names)}, {N(n): RACK[n] for n in names})


def down(node: str) -> Fault:
    return Fault(FaultKind.NODE_DOWN, N(node))


def pod_failed(node: str, *ranks: int) -> Fault:
    return Fault(FaultKind.POD_FAILED, N(node), ranks=frozenset(ranks))


@dataclass
class Case:
    faults: list[Fault]
    job: JobView
    copies: list[Copy]
    spares: policy.Spares = field(default_factory=policy.Spares)
    newest: int | None = None


@dataclass
class Want:
    level: Level
    step: int
    ranks: set[int]
    targets: dict[int, str]
    tiers: dict[int, tuple[Tier, str | None]]  # only the ranks worth naming
    lost: int | None = None


FOUR = gang("n1", "n2", "n3", "n4")
SIX = gang("n1", "n2", "n3", "n4", levels=(Level.SPARE_SWAP, Level.RESCHEDULE))
TWO_PER_NODE = gang("n1", "n3", per_node=2)

TABLE = [
    pytest.param(
        Case([down("n1")], FOUR, saved(FOUR, memory=[10, 20]), spares("s1", "s2"), newest=25),
        Want(Level.SPARE_SWAP, 20, {0}, {0: "s1"}, {0: (Tier.PEERS, "n3")}, lost=5),
        id="node down under a rank with a free spare swaps to the spare and restores from the "
        "peer copy",
    ),
    pytest.param(
        Case([pod_failed("n2", 1)], FOUR, saved(FOUR, memory=[10, 20]), newest=20),
        Want(Level.IN_PLACE, 20, {1}, {}, {1: (Tier.MEMORY, "n2")}, lost=0),
        id="a pod failed on a healthy node restarts in place from the node's memory",
    ),
    pytest.param(
        Case(
            [Fault(FaultKind.DAEMON_UNREACHABLE, N(n)) for n in ("n1", "n2", "n3", "n4")],
            FOUR,
            saved(FOUR, memory=[90, 100], local=[100], persistent=[50]),
            newest=100,
        ),
        Want(
            Level.RESCHEDULE,
            50,
            {0, 1, 2, 3},
            {},
            dict.fromkeys(range(4), (Tier.PERSISTENT, None)),
            lost=50,
        ),
        id="every daemon of a supernode dead reschedules the gang from tier 3",
    ),
    pytest.param(
        Case([down("n1"), down("n2")], FOUR, saved(FOUR, memory=[10]), spares("s1", "s2")),
        Want(
            Level.SPARE_SWAP,
            10,
            {0, 1},
            {0: "s1", 1: "s2"},
            {0: (Tier.PEERS, "n3"), 1: (Tier.PEERS, "n4")},
        ),
        id="two nodes of one rack with two free spares both swap, each to its own spare",
    ),
    pytest.param(
        Case([down("n1"), down("n2")], FOUR, saved(FOUR, memory=[10]), spares("s1")),
        Want(
            Level.RESCHEDULE,
            10,
            {0, 1, 2, 3},
            {},
            {0: (Tier.PEERS, "n3"), 2: (Tier.MEMORY, "n3")},
        ),
        id="two nodes of one rack with one free spare reschedule the whole gang",
    ),
    pytest.param(
        Case(
            [Fault(FaultKind.CARDS_UNHEALTHY, N("n1"), cards=frozenset({5}))],
            TWO_PER_NODE,
            saved(TWO_PER_NODE, memory=[10]),
            spares("s1", "s2"),
        ),
        Want(
            Level.SPARE_SWAP, 10, {1}, {1: "s1"}, {0: (Tier.MEMORY, "n1"), 1: (Tier.MEMORY, "n1")}
        ),
        id="a bad card moves only the rank holding it, which reads its memory copy on the "
        "surviving node",
    ),
    pytest.param(
        Case([pod_failed("n2", 1)], SIX, saved(SIX, memory=[10]), spares("s1")),
        Want(Level.SPARE_SWAP, 10, {1}, {1: "s1"}, {1: (Tier.MEMORY, "n2")}),
        id="InPlace not allowed moves a failed pod to a spare",
    ),
    pytest.param(
        Case(
            [down("n3")],
            gang("n1", "n2", "n3", "n4", levels=(Level.IN_PLACE, Level.RESCHEDULE)),
            saved(FOUR, memory=[10]),
            spares("s1", "s2"),
        ),
        Want(Level.RESCHEDULE, 10, {0, 1, 2, 3}, {}, {2: (Tier.PEERS, "n1")}),
        id="SpareSwap not allowed goes on to Reschedule",
    ),
    pytest.param(
        Case([down("n3")], FOUR, saved(FOUR, memory=[10]), spares("s1", "s2")),
        Want(Level.SPARE_SWAP, 10, {2}, {2: "s2"}, {2: (Tier.PEERS, "n1")}),
        id="a spare in the failed node's rack is preferred",
    ),
    pytest.param(
        Case(
            [down("n1")],
            FOUR,
            saved(FOUR, memory=[10, 20], corrupt=[(0, 20, Tier.PEERS)]),
            spares("s1"),
            newest=20,
        ),
        Want(Level.SPARE_SWAP, 10, {0}, {0: "s1"}, {0: (Tier.PEERS, "n3")}, lost=10),
        id="a corrupt peer copy is skipped and the gang restores the older step",
    ),
    pytest.param(
        Case(
            [pod_failed("n2", 1)],
            FOUR,
            saved(FOUR, memory=[20], local=[20], corrupt=[(1, 20, Tier.MEMORY)]),
        ),
        Want(Level.IN_PLACE, 20, {1}, {}, {1: (Tier.PEERS, "n4"), 0: (Tier.MEMORY, "n1")}),
        id="a corrupt memory copy falls to the next fastest source of the same step",
    ),
    pytest.param(
        Case(
            [pod_failed("n2", 1)],
            FOUR,
            saved(FOUR, local=[20], persistent=[20]),
        ),
        Want(Level.IN_PLACE, 20, {1}, {}, {1: (Tier.LOCAL, "n2")}),
        id="without memory the node's disk beats tier 3",
    ),
    pytest.param(
        Case(
            [Fault(FaultKind.DAEMON_UNREACHABLE, N("n2"))],
            FOUR,
            saved(FOUR, memory=[10], local=[10]),
            spares("s1"),
        ),
        Want(Level.SPARE_SWAP, 10, {1}, {1: "s1"}, {1: (Tier.PEERS, "n4")}),
        id="an unreachable daemon counts as a lost node: its ranks swap to a spare",
    ),
    pytest.param(
        Case(
            [down("n1"), pod_failed("n3", 2)],
            FOUR,
            saved(FOUR, memory=[10]),
            spares("s1", "s2"),
        ),
        Want(Level.SPARE_SWAP, 10, {0, 2}, {0: "s1"}, {2: (Tier.MEMORY, "n3")}),
        id="a failed pod next to a lost node restarts in place while the lost rank swaps",
    ),
    pytest.param(
        Case([down("n1")], FOUR, saved(FOUR, memory=[10]) + saved(FOUR, persistent=[5])),
        Want(Level.RESCHEDULE, 10, {0, 1, 2, 3}, {}, {0: (Tier.PEERS, "n3")}),
        id="no free spare reschedules from the peer copies that survived",
    ),
]


@pytest.mark.parametrize(("case", "want"), TABLE)
def test_decide(case: Case, want: Want) -> None:
    plan = policy.decide(
        case.faults, case.job, case.copies, case.spares, newest_saved_step=case.newest
    )
    assert isinstance(plan, policy.Plan), plan
    assert (plan.level, plan.restored_step, set(plan.ranks)) == (want.level, want.step, want.ranks)
    assert plan.targets == want.targets
    assert set(plan.sources) == set(range(case.job.world_size))
    assert {r: (plan.sources[r].tier, plan.sources[r].node) for r in want.tiers} == want.tiers
    assert plan.lost_steps == want.lost


@pytest.mark.parametrize(
    ("case", "code", "words"),
    [
        pytest.param(
            Case([pod_failed("n1", 0)], gang("n1", "n2", recoveries=3, max_recoveries=3), []),
            "MaxRecoveriesReached",
            "spec.recovery.maxRecoveries (3)",
            id="maxRecoveries reached fails the job naming the field",
        ),
        pytest.param(
            Case(
                [down("n1")],
                gang("n1", "n2", levels=(Level.IN_PLACE,)),
                saved(FOUR, persistent=[10]),
                spares("s1"),
            ),
            "RecoveryImpossible",
            "SpareSwap not in spec.recovery.levels",
            id="a lost node with only InPlace allowed fails",
        ),
        pytest.param(
            Case([down("n1")], FOUR, [c for c in saved(FOUR, memory=[10]) if c.tier != Tier.PEERS]),
            "RecoveryImpossible",
            "ranks [0] have no valid surviving copy",
            id="a lost node without peer copies or tier 3 has nothing to restore",
        ),
    ],
)
def test_decide_fails(case: Case, code: str, words: str) -> None:
    failed = policy.decide(case.faults, case.job, case.copies, case.spares)
    assert isinstance(failed, policy.Failed)
    assert failed.code == code
    assert words in failed.reason


def test_a_fault_on_a_node_without_ranks_is_a_caller_bug() -> None:
    with pytest.raises(policy.PolicyInputError, match="hits no rank"):
        policy.decide(down("s1"), FOUR, saved(FOUR, memory=[10]), spares())


def test_one_fault_alone_is_accepted_and_named_in_the_cause() -> None:
    plan = policy.decide(down("n1"), FOUR, saved(FOUR, memory=[10]), spares("s1"))
    assert isinstance(plan, policy.Plan)
    assert plan.cause == "NodeDown on n1"
    assert "n1→s1" in plan.reason


# --- no checkpoint yet: restart from step 0 --------------------------------------------------


@pytest.mark.parametrize(
    ("case", "level", "ranks", "targets"),
    [
        pytest.param(
            Case([pod_failed("n2", 1)], FOUR, []),
            Level.IN_PLACE,
            {1},
            {},
            id="a failed pod of a job with no checkpoint restarts in place from step 0",
        ),
        pytest.param(
            Case([down("n1")], FOUR, [], spares("s1")),
            Level.SPARE_SWAP,
            {0},
            {0: "s1"},
            id="a lost node of a job with no checkpoint swaps to a spare and starts from step 0",
        ),
        pytest.param(
            Case([down("n1")], FOUR, []),
            Level.RESCHEDULE,
            {0, 1, 2, 3},
            {},
            id="a lost node with no spare reschedules the gang from step 0",
        ),
        pytest.param(
            Case([pod_failed("n2", 1)], gang("n1", "n2", levels=(Level.RESCHEDULE,)), []),
            Level.RESCHEDULE,
            {0, 1},
            {},
            id="the cheapest level spec.recovery.levels allows is the one used",
        ),
    ],
)
def test_a_job_with_no_checkpoint_yet_restarts_from_step_0_at_the_cheapest_level(
    case: Case, level: Level, ranks: set[int], targets: dict[int, str]
) -> None:
    plan = policy.decide(case.faults, case.job, case.copies, case.spares, newest_saved_step=None)
    assert isinstance(plan, policy.Plan), plan
    assert plan.fresh
    assert (plan.level, set(plan.ranks), dict(plan.targets)) == (level, ranks, targets)
    assert (plan.restored_step, plan.sources, plan.lost_steps) == (None, {}, None)
    assert "no checkpoint yet" in plan.reason


@pytest.mark.parametrize(
    ("copies", "newest", "words"),
    [
        pytest.param(
            [Copy(0, 10, Tier.MEMORY, N("n1"))],
            None,
            "ranks [1] have no valid surviving copy",
            id="shards of some ranks without a step common to all are a loss, not a fresh start",
        ),
        pytest.param(
            [Copy(r, 10, Tier.MEMORY, N(n), valid=False) for r, n in ((0, "n1"), (1, "n2"))],
            None,
            "no valid surviving copy",
            id="corrupt copies only are a loss, not a fresh start",
        ),
        pytest.param(
            [],
            20,
            "no valid surviving copy",
            id="a step committed once that no longer survives anywhere is a loss",
        ),
    ],
)
def test_a_job_that_saved_something_does_not_restart_from_step_0(
    copies: list[Copy], newest: int | None, words: str
) -> None:
    job = gang("n1", "n2")
    failed = policy.decide(
        pod_failed("n2", 1), job, copies, policy.Spares(), newest_saved_step=newest
    )
    assert isinstance(failed, policy.Failed), failed
    assert failed.code == "RecoveryImpossible"
    assert words in failed.reason


@pytest.mark.parametrize(
    ("faults", "all_answered"),
    [
        pytest.param(
            [Fault(FaultKind.DAEMON_UNREACHABLE, N("n2"))],
            True,
            id="a silent daemon may hold the only copies",
        ),
        pytest.param([pod_failed("n2", 1)], False, id="a daemon asked did not answer"),
    ],
)
def test_no_copy_reported_is_no_proof_of_no_checkpoint_when_a_daemon_is_silent(
    faults: list[Fault], all_answered: bool
) -> None:
    failed = policy.decide(faults, gang("n1", "n2"), [], policy.Spares(), all_answered=all_answered)
    assert isinstance(failed, policy.Failed), "never a fresh start that could lose a step"
    assert failed.code == "RecoveryImpossible"


def test_a_job_with_no_checkpoint_yet_still_fails_out_of_recoveries() -> None:
    job = gang("n1", "n2", recoveries=2, max_recoveries=2)
    failed = policy.decide(pod_failed("n2", 1), job, [], policy.Spares())
    assert isinstance(failed, policy.Failed)
    assert failed.code == "MaxRecoveriesReached"


def test_a_job_with_no_checkpoint_yet_still_fails_when_no_level_places_it() -> None:
    job = gang("n1", "n2", levels=(Level.IN_PLACE,))
    failed = policy.decide(down("n1"), job, [], spares("s1"))
    assert isinstance(failed, policy.Failed)
    assert "lost their node or cards" in failed.reason


# --- properties -------------------------------------------------------------------------------

NODES = ["n1", "n2", "n3", "n4"]
SPARES = ["s1", "s2"]
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[Fault], JobView, list[Copy], policy.Spares]:
    per_node = draw(st.sampled_from([1, 2]))
    levels = tuple(lv for lv in ALL if draw(st.booleans())) or ALL
    job = gang(*NODES, per_node=per_node, levels=levels)
    holders = [N(n) for n in NODES]
    copy = st.builds(
        Copy,
        rank=st.integers(0, job.world_size - 1),
        step=st.integers(0, 6),
        tier=st.sampled_from(list(Tier)),
        node=st.sampled_from(holders),
        valid=st.booleans(),
    )
    copies = [
        c if c.tier != Tier.PERSISTENT else Copy(c.rank, c.step, c.tier, None, c.valid)
        for c in draw(st.lists(copy, max_size=60))
    ]
    kinds = st.sampled_from(list(FaultKind))
    faults = []
    for node in draw(st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True)):
        kind = draw(kinds)
        cards = frozenset(draw(st.sets(st.integers(0, 7), min_size=1)))
        faults.append(
            Fault(kind, N(node), cards if kind == FaultKind.CARDS_UNHEALTHY else frozenset())
        )
    return faults, job, copies, spares(*draw(st.lists(st.sampled_from(SPARES), unique=True)))


@SETTINGS
@given(situations())
def test_a_plan_restores_one_step_every_rank_really_holds(
    situation: tuple[list[Fault], JobView, list[Copy], policy.Spares],
) -> None:
    faults, job, copies, free = situation
    plan = policy.decide(faults, job, copies, free)
    if isinstance(plan, policy.Failed):
        return
    lost = {f.node for f in faults if f.kind in policy.NODE_LOSSES}
    assert plan.level in job.levels
    if plan.fresh:  # only when nothing at all was ever saved
        assert (copies, plan.sources, plan.lost_steps) == ([], {}, None)
        return
    assert set(plan.sources) == set(range(job.world_size))
    for rank, source in plan.sources.items():
        newest_valid = max(c.step for c in copies if c.rank == rank and c.valid)
        assert plan.restored_step is not None
        assert plan.restored_step <= newest_valid
        assert (source.rank, source.step, source.valid) == (rank, plan.restored_step, True)
        assert source in copies
        assert source.node not in lost


@SETTINGS
@given(situations())
def test_spare_swap_targets_are_distinct_free_spares_of_the_same_supernode(
    situation: tuple[list[Fault], JobView, list[Copy], policy.Spares],
) -> None:
    faults, job, copies, free = situation
    plan = policy.decide(faults, job, copies, free)
    if not isinstance(plan, policy.Plan) or plan.level != Level.SPARE_SWAP:
        assert not isinstance(plan, policy.Plan) or not plan.targets
        return
    assert plan.targets
    spare_of: dict[str, str] = {}
    for rank, target in plan.targets.items():
        assert target in free.nodes[job.supernode_of[job.node_of[rank]]]
        assert spare_of.setdefault(job.node_of[rank], target) == target
    assert len(set(spare_of.values())) == len(spare_of)


@SETTINGS
@given(situations())
def test_several_faults_are_one_plan_that_loses_no_rank_and_prefers_the_cheapest_level(
    situation: tuple[list[Fault], JobView, list[Copy], policy.Spares],
) -> None:
    """Issue 32, item 2: faults on up to three nodes at once are one plan; every rank they hit
    is restarted or moved (none is left behind), no spare takes two nodes' ranks, and a
    cheaper allowed level that would work is always chosen — spares are used before the whole
    gang is placed again (Reschedule only when they run out or cannot restore)."""
    faults, job, copies, free = situation
    plan = policy.decide(faults, job, copies, free)
    if not isinstance(plan, policy.Plan):
        return
    lost = {f.node for f in faults if f.kind in policy.NODE_LOSSES}
    hit = {r for r, n in job.node_of.items() if n in lost}
    assert hit <= plan.ranks  # no rank on a lost node is left where it was
    assert not any(t in lost or t in job.node_of.values() for t in plan.targets.values())
    for cheaper in ALL[: ALL.index(plan.level)]:
        if cheaper not in job.levels:
            continue
        alone = policy.decide(faults, dataclasses.replace(job, levels=(cheaper,)), copies, free)
        assert isinstance(alone, policy.Failed), (plan.level, cheaper, alone)
    if plan.level == Level.RESCHEDULE:
        assert plan.ranks == frozenset(range(job.world_size))
        # nodes whose ranks must leave (lost, or an unhealthy card: the cards of the ranks on a
        # node cover all 8, so every such fault hits one)
        needing = {f.node for f in faults if f.kind in policy.NODE_LOSSES}
        needing |= {f.node for f in faults if f.kind == FaultKind.CARDS_UNHEALTHY}
        # and a failed pod's node: SpareSwap moves its ranks too (restarting them where they
        # were is InPlace, which was not allowed or the plan would not be a Reschedule)
        needing |= {f.node for f in faults if f.kind == FaultKind.POD_FAILED}
        if Level.SPARE_SWAP in job.levels and len(needing) <= len(free.nodes.get("sn-a", ())):
            swap = policy.decide(
                faults, dataclasses.replace(job, levels=(Level.SPARE_SWAP,)), copies, free
            )
            assert isinstance(swap, policy.Failed)
            assert "none left" not in swap.reason, swap.reason  # not for want of spares
