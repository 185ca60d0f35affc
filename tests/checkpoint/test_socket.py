"""A trainer's way into tier 1 without the daemon's folders (issue 31, finding 2), on loopback.

Real daemon processes. A trainer on the node gets the files of its own job's buffers and shards
over the daemon's Unix socket (``fdpass``), by its job's token; another job's token opens none of
them, whatever buffer id or shard it names; nothing of a job lies in the socket's folder, the only
one a trainer pod mounts. Tier 3 is read through the node's daemon, for the job's own folder only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from matrixpool_recovery import CheckpointSpec, errors, fdpass, wire
from tests.checkpoint.conftest import OPERATOR, Cluster, job_token
from tests.checkpoint.trainer import state_for

MINE, THEIRS = "ml.mine", "ml.theirs"
STEP = 10


def sock(cluster: Cluster) -> Path:
    return fdpass.socket_path(cluster.root / "a" / "memory")


def ask(cluster: Cluster, token: str, job: str, **request: Any) -> tuple[dict[str, Any], int]:
    answer, fd = fdpass.ask(sock(cluster), {"token": token, "job": job, **request})
    assert fd is not None, answer
    return answer, fd


@pytest.fixture
def theirs(cluster: Cluster) -> Cluster:
    """Daemon a holding step 10 of THEIRS in memory, and a buffer reserved for THEIRS' step 11."""
    cluster.start("a")
    spec = CheckpointSpec(memory_every=1, peer_replicas=0)
    with cluster.client("a", THEIRS, 0, 1, spec=spec, peers=[]) as client:
        client.save(STEP, state_for(0, STEP)).wait()
    return cluster


def reserve(cluster: Cluster, job: str, step: int) -> str:
    endpoint = wire.Endpoint(cluster.address("a"), job_token(job))
    path = wire.shard_path(job, 0, step, "reserve")
    return str(wire.request(endpoint, "POST", path, {"size": 4096})["buffer"])


def test_a_trainer_is_handed_its_own_buffer_and_shard_and_writes_through_the_mapping(
    theirs: Cluster,
) -> None:
    buffer = reserve(theirs, THEIRS, STEP + 1)

    answer, fd = ask(theirs, job_token(THEIRS), THEIRS, open="buffer", buffer=buffer)
    try:
        assert answer == {"size": 4096}
        os.pwrite(fd, b"written by the trainer", 0)
    finally:
        os.close(fd)
    record, fd = ask(theirs, job_token(THEIRS), THEIRS, open="shard", rank=0, step=STEP)
    try:
        assert os.fstat(fd).st_size == record["size"] > 0
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.pwrite(fd, b"x", 0)  # a held shard is handed over read-only
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("job", "what", "status"),
    [
        pytest.param(THEIRS, {"open": "shard", "rank": 0, "step": STEP}, 403, id="their shard"),
        pytest.param(THEIRS, {"open": "buffer"}, 403, id="their buffer"),
        pytest.param(THEIRS, {"open": "probe"}, 403, id="a probe as them"),
        pytest.param(MINE, {"open": "buffer"}, 404, id="their buffer named as its own job's"),
        pytest.param(MINE, {"open": "shard", "rank": 0, "step": STEP}, 404, id="no such shard"),
        pytest.param("../ml.theirs", {"open": "probe"}, 400, id="a job name that climbs"),
    ],
)
def test_another_jobs_token_is_handed_nothing_of_theirs(
    theirs: Cluster, job: str, what: dict[str, Any], status: int
) -> None:
    buffer = reserve(theirs, THEIRS, STEP + 1)
    request = {"token": job_token(MINE), "job": job, **what}
    if what["open"] == "buffer":
        request["buffer"] = buffer

    with pytest.raises(errors.CheckpointError) as refused:
        fdpass.ask(sock(theirs), request)

    assert getattr(refused.value, "status", 0) == status, refused.value
    _, fd = ask(theirs, job_token(THEIRS), THEIRS, open="buffer", buffer=buffer)
    os.close(fd)  # theirs is still theirs


def test_the_sockets_folder_holds_no_job_and_refuses_writes_from_others(theirs: Cluster) -> None:
    folder = sock(theirs).parent

    assert [p.name for p in folder.iterdir()] == [fdpass.SOCKET_NAME]
    assert folder.stat().st_mode & 0o777 == 0o755
    assert sock(theirs).stat().st_mode & 0o777 == 0o666  # the token decides, not the mode


def test_a_trainer_that_cannot_reach_the_socket_uploads_and_reads_over_http(
    theirs: Cluster, tmp_path: Path
) -> None:
    spec = CheckpointSpec(memory_every=1, peer_replicas=0)
    nowhere = str(tmp_path / "not-mounted" / "daemon.sock")
    with theirs.client("a", MINE, 0, 1, spec=spec, peers=[], socket_path=nowhere) as client:
        client.save(STEP, state_for(0, STEP)).wait()
        assert not client._is_colocated()
        restored = client.restore()

    assert restored.step == STEP
    np.testing.assert_array_equal(restored.state["weights"], state_for(0, STEP)["weights"])


def test_tier_three_is_read_through_the_daemon_for_the_jobs_own_folder(cluster: Cluster) -> None:
    cluster.start("a")
    uri = cluster.persistent.as_uri()
    spec = CheckpointSpec(memory_every=1, peer_replicas=0, persistent_every=1, persistent_uri=uri)
    with cluster.client("a", MINE, 0, 1, spec=spec, peers=[]) as client:
        client.save(STEP, state_for(0, STEP)).wait()
    wire.request(wire.Endpoint(cluster.address("a"), OPERATOR), "DELETE", f"/v1/jobs/{MINE}")
    mine = wire.Endpoint(cluster.address("a"), job_token(MINE))
    theirs = wire.Endpoint(cluster.address("a"), job_token(THEIRS))

    listed = wire.request(mine, "GET", f"/v1/inventory?job={MINE}&uri={uri}")["shards"]
    other = wire.request(theirs, "GET", f"/v1/inventory?job={THEIRS}&uri={uri}")["shards"]
    with cluster.client("a", MINE, 0, 1, spec=spec, peers=[], shared_memory=False) as client:
        restored = client.restore()

    assert [(s["tier"], s["step"]) for s in listed] == [("persistent", STEP)]
    assert other == []  # the same root, another job's folder: its own, empty
    assert restored.step == STEP
    assert restored.source == "persistent"
    np.testing.assert_array_equal(restored.state["weights"], state_for(0, STEP)["weights"])
