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
