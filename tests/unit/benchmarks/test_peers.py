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
