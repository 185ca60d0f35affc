"""Incarnations (issue 11, defect 1): a restore never mixes two runs' bytes.

Real daemon processes on loopback, real Checkpointers in the test process. Each test is the
review's reproduction: run 1 saves, crashes with a partial step, run 2 restores and saves the
same step number again in another order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.checkpoint.conftest import Cluster, spec_json, to_spec

JOB = "6f1c0a52-1d3e-4d55-9a8e-2b7f0c1e9d01"  # a TrainingJob UID


def state(run: int, rank: int, step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(64, run * 1000 + rank * 100 + step, dtype=np.int64)}


def value(restored_state: dict[str, object]) -> int:
    array = restored_state["w"]
    assert isinstance(array, np.ndarray)
    return int(array[0])


def test_a_newer_run_never_completes_an_older_runs_partial_step(cluster: Cluster) -> None:
    """Run 1: steps 1-2 on both ranks, step 3 on rank 0 only, crash. Run 2 restores step 2,
    rank 1 saves step 3 first: step 3 is not committed until rank 0 of run 2 saves it, and a
    restore of step 3 returns run 2's bytes on both ranks."""
    cluster.start("a")
    spec = to_spec(spec_json(memory=1, peers=0))
    run1 = [cluster.client("a", JOB, r, 2, spec=spec, incarnation=1) for r in (0, 1)]
    for step in (1, 2):
        for rank, client in enumerate(run1):
            client.save(step, state(1, rank, step)).wait()
    run1[0].save(3, state(1, 0, 3)).wait()
    for client in run1:
        client.close()

    run2 = [cluster.client("a", JOB, r, 2, spec=spec, incarnation=2) for r in (0, 1)]
    for rank, client in enumerate(run2):
        restored = client.restore()
        assert (restored.step, value(restored.state)) == (2, 1000 + rank * 100 + 2)
    run2[1].save(3, state(2, 1, 3)).wait()
    assert run2[0].latest() == 2, "run 1's rank 0 and run 2's rank 1 made a step 3"
    run2[0].save(3, state(2, 0, 3)).wait()
    assert run2[0].latest() == 3
    for rank, client in enumerate(run2):
        restored = client.restore()
        assert (restored.step, restored.incarnation) == (3, 2)
        assert value(restored.state) == 2000 + rank * 100 + 3
        client.close()


def test_a_newer_run_abandons_the_older_runs_later_steps(cluster: Cluster) -> None:
    """Run 1 committed step 3, but run 2 restored step 1 (the operator chose it): run 1's
    steps 2-3 lie on an abandoned branch, so once run 2 saved step 2 a restore returns run
    2's step 2, never run 1's newer step 3."""
    cluster.start("a")
    spec = to_spec(spec_json(memory=1, peers=0))
    run1 = [cluster.client("a", JOB, r, 2, spec=spec, incarnation=1) for r in (0, 1)]
    for step in (1, 2, 3):
        for rank, client in enumerate(run1):
            client.save(step, state(1, rank, step)).wait()
    run2 = [cluster.client("a", JOB, r, 2, spec=spec, incarnation=2) for r in (0, 1)]
    for client in run2:
        assert client.restore(1, incarnation=1).step == 1
    run2[0].save(2, state(2, 0, 2)).wait()
    assert run2[0].latest() == 1, "run 1's step 3 is on the branch run 2 abandoned"
    run2[1].save(2, state(2, 1, 2)).wait()
    for rank, client in enumerate(run2):
        restored = client.restore()
        assert (restored.step, value(restored.state)) == (2, 2000 + rank * 100 + 2)
    for client in run1 + run2:
        client.close()


def test_tier_three_never_mixes_runs(cluster: Cluster, tmp_path: Path) -> None:
    """The same on the persistent tier alone (no daemon holds a copy any more)."""
    cluster.start("a")
    uri = f"file://{tmp_path}/persistent"
    spec = to_spec(spec_json(persistent=1, uri=uri))
    run1 = [cluster.client("a", JOB, r, 2, spec=spec, incarnation=1) for r in (0, 1)]
    for step in (1, 2):
        for rank, client in enumerate(run1):
            client.save(step, state(1, rank, step)).wait()
    run1[0].save(3, state(1, 0, 3)).wait()
    cluster.kill("a")
    cluster.start("b")
    run2 = [cluster.client("b", JOB, r, 2, spec=spec, incarnation=2) for r in (0, 1)]
    assert [c.restore().step for c in run2] == [2, 2]
    run2[1].save(3, state(2, 1, 3)).wait()
    assert run2[0].latest() == 2
    run2[0].save(3, state(2, 0, 3)).wait()
    for rank, client in enumerate(run2):
        restored = client.restore()
        assert (restored.step, value(restored.state)) == (3, 2000 + rank * 100 + 3)
    for client in run1 + run2:
        client.close()


def test_a_replaced_run_cannot_overwrite_the_newer_runs_shard(cluster: Cluster) -> None:
    """A rank of run 1 still saving after run 2 saved the same step is refused (409)."""
    cluster.start("a")
    spec = to_spec(spec_json(memory=1, peers=0))
    newer = cluster.client("a", JOB, 0, 1, spec=spec, incarnation=2)
    newer.save(5, state(2, 0, 5)).wait()
    older = cluster.client("a", JOB, 0, 1, spec=spec, incarnation=1)
    handle = older.save(5, state(1, 0, 5))
    handle.done.wait(30)
    assert "incarnation 1 is older" in handle.failures.get("memory", ""), handle.outcomes
    restored = newer.restore()
    assert (restored.step, value(restored.state)) == (5, 2005)
    newer.close()
    older.close()
