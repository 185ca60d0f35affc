"""benchmarks/peers.py's CPU accounting of the burst (the rest runs on a cluster:
tests/integration/test_peers.py)."""

from __future__ import annotations

import os

from benchmarks import peers


def test_processes_are_named_by_program_and_python_by_module_or_script() -> None:
    assert peers.program(["/usr/local/bin/kube-apiserver", "--secure-port=6443"]) == (
        "kube-apiserver"
    )
    assert peers.program(["/v/bin/python3", "-m", "matrixpool.cli", "run"]) == (
        "matrixpool operator"
    )
    assert peers.program(["/v/bin/python", "benchmarks/peers.py", "--json"]) == "peers.py"
    assert peers.program(["/usr/bin/python3.11"]) == "python3.11"


def test_cpu_seconds_of_this_process_grow_with_its_work() -> None:
    before = peers.processes()[os.getpid()][1]
    deadline = os.times().user + 0.3
    while os.times().user < deadline:  # 0.3 s of CPU in this process
        sum(range(10_000))
    argv, after = peers.processes()[os.getpid()]
    assert after - before >= 0.2
    assert peers.cpu_seconds()[peers.program(argv)] >= after


def test_locality_counts_extra_racks_and_ring_hops_of_training_gangs_by_rank() -> None:
    """Racks of 4 nodes: an 8-node gang on 3 racks is one extra rack; its ranks in rack order
    a,a,b,b,a,a,c,c cross 4 times around the ring where 2 racks allow 2. A gang in its fewest
    racks in rank order counts nothing extra; inference groups count for neither."""
    shape = peers.topology.Shape(supernodes=1)
    racks = {f"n{k}": "sn-0-rack-" + "aabbaacc"[k] for k in range(8)}
    racks |= {f"m{k}": f"sn-0-rack-{'dd' if k < 4 else 'ee'}" for k in range(8)}
    peers.NODE_RACKS.update(racks)
    spread = peers.GangRun(peers.Gang("spread", 0.0, 8, 8, 1.0), bound=1.0)
    spread.nodes, spread.ranks = {f"n{k}" for k in range(8)}, {k: f"n{k}" for k in range(8)}
    tidy = peers.GangRun(peers.Gang("tidy", 0.0, 8, 8, 1.0), bound=1.0)
    tidy.nodes, tidy.ranks = {f"m{k}" for k in range(8)}, {k: f"m{k}" for k in range(8)}
    serving = peers.GangRun(peers.Gang("infer", 0.0, 2, 4, 1.0, serving=True), bound=1.0)
    serving.nodes = {"n0", "n2"}
    found = peers.summarize({"a": spread, "b": tidy, "c": serving}, [], shape, 1.0)
    assert (found["extra_racks"], found["ring_hops"], found["ring_hops_min"]) == (1, 4 + 2, 2 + 2)
    assert found["spread_gangs"] == 2  # the spread training gang and the inference group
    assert found["gangs_without_ranks"] == 0


def test_the_dump_says_where_each_gang_went_against_its_fewest_racks() -> None:
    """``--dump``: per gang its racks (sorted) beside the fewest, its node per rank and its
    times after the trace's start; a gang never bound has no racks and no bound time."""
    shape = peers.topology.Shape(supernodes=1)
    peers.NODE_RACKS.update({f"p{k}": f"sn-0-rack-{k // 2}" for k in range(3)})
    run = peers.GangRun(peers.Gang("g1", 0.0, 3, 8, 1.0), created=10.0, bound=12.5)
    run.nodes, run.ranks = {"p0", "p1", "p2"}, {0: "p0", 1: "p2", 2: "p1"}
    run.removed = 13.5
    waiting = peers.GangRun(peers.Gang("g2", 0.0, 2, 8, 1.0), created=11.0)
    found = peers.placements({"g1": run, "g2": waiting}, shape, 10.0, {"g1": [14.0, 13.6]})
    assert found[0] == {
        "gang": "g1",
        "pods": 3,
        "cards": 8,
        "serving": False,
        "nodes_needed": 3,
        "fewest_racks": 1,
        "racks": ["sn-0-rack-0", "sn-0-rack-1"],
        "ranks": ["p0", "p2", "p1"],
        "created_s": 0.0,
        "bound_s": 2.5,
        "removed_s": 3.5,
        "gone_s": [3.6, 4.0],
    }
    assert (found[1]["gang"], found[1]["racks"], found[1]["bound_s"]) == ("g2", [], None)
