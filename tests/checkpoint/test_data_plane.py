"""Acceptance tests of the checkpoint data plane (issue 4), on loopback.

One daemon process per simulated node, one trainer process per rank: 8 ranks on 4 nodes in
two racks (a, b in r1; c, d in r2), each node's peers in the other rack. No Kubernetes.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from matrixpool_recovery import errors, manifest, names, wire
from tests.checkpoint.conftest import OPERATOR, Cluster, job_token, spec_json, to_spec, trainers
from tests.checkpoint.trainer import digest, state_for

RACKS = {"r1": ["a", "b"], "r2": ["c", "d"]}
PLACEMENT = {rank: "abcd"[rank // 2] for rank in range(8)}  # two ranks per node
JOB = "ml.llm"


def inventory(cluster: Cluster, node: str) -> list[manifest.Holding]:
    answer = wire.request(wire.Endpoint(cluster.address(node), OPERATOR), "GET", "/v1/inventory")
    return [manifest.Holding.from_json(s) for s in answer["shards"]]


def holders(cluster: Cluster, step: int, tier: str) -> dict[int, set[str]]:
    """rank -> nodes holding its shard of `step` on `tier`."""
    found: dict[int, set[str]] = {}
    for node in cluster.nodes:
        if cluster.nodes[node].process.poll() is None:
            for held in inventory(cluster, node):
                if held.step == step and held.tier == tier:
                    found.setdefault(held.rank, set()).add(node)
    return found


def only_line(lines: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(lines) == 1, lines
    return lines[0]


def test_eight_ranks_save_concurrently_to_every_tier(cluster: Cluster, tmp_path: Path) -> None:
    cluster.ring(RACKS)
    uri = f"file://{tmp_path}/persistent"
    spec = spec_json(memory=10, peers=1, local=20, persistent=20, uri=uri)

    results = trainers(cluster, "save", JOB, PLACEMENT, spec, "--steps", "10,20")

    for lines in results.values():
        assert [line["step"] for line in lines] == [10, 20], lines
        assert all("error" not in line for line in lines), lines
        assert set(lines[1]["outcomes"]) == {"memory", "peers", "local", "persistent"}
    memory = holders(cluster, 20, "memory")
    for rank, node in PLACEMENT.items():
        rack = next(r for r, members in RACKS.items() if node in members)
        copies = memory[rank] - {node}
        assert node in memory[rank], (rank, memory[rank])
        assert len(copies) == 1, (rank, memory[rank])
        assert not copies & set(RACKS[rack]), f"rank {rank}'s copy is in its own rack"
    assert holders(cluster, 20, "local") == {r: {n} for r, n in PLACEMENT.items()}
    shared = manifest.load(tmp_path / "persistent" / JOB / names.step_dir(20))
    assert shared is not None
    assert shared.complete
    assert len(shared.shards) == 8
    with cluster.client("a", JOB, 0, 8, spec=to_spec(spec)) as client:
        assert client.committed() == {"memory": 20, "local": 20, "persistent": 20}
        assert client.latest() == 20


def test_ranks_of_a_lost_node_restore_from_peer_copies(cluster: Cluster) -> None:
    cluster.ring(RACKS)
    spec = spec_json(memory=10, peers=1, local=10)
    trainers(cluster, "save", JOB, PLACEMENT, spec, "--steps", "10,20")

    cluster.kill("b")  # ranks 2 and 3 lose their node, its memory and its disk
    cluster.start("spare", ["c", "d", "a"])
    moved = trainers(cluster, "restore", JOB, {2: "spare", 3: "spare"}, spec, world=8)
    stayed = trainers(cluster, "restore", JOB, {0: "a", 1: "a"}, spec, world=8)

    for rank in (2, 3):
        line = only_line(moved[rank])
        assert line["step"] == 20, line
        assert line["equal"] is True, line
        assert line["source"].startswith("peer:"), line
        assert line["sha256"] == digest(state_for(rank, 20))
    assert only_line(stayed[0])["source"] == "memory:a"


def shard_file(cluster: Cluster, tier: str, node: str, rank: int, step: int) -> Path:
    """Where a node keeps a rank's shard on a tier."""
    if tier == "local":
        return (
            cluster.nodes[node].data_dir
            / "jobs"
            / JOB
            / names.step_dir(step)
            / f"rank-{rank}.shard"
        )
    held = manifest.load(cluster.nodes[node].memory_dir / "jobs" / JOB / names.step_dir(step))
    assert held is not None
    return cluster.nodes[node].memory_dir / "buffers" / held.shards[rank].buffer


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


@pytest.mark.parametrize("damage", [flip_a_byte, truncate], ids=["a flipped byte", "a cut file"])
@pytest.mark.parametrize(
    ("tier", "expected_source"),
    [
        pytest.param("local", "persistent", id="tier 2 falls back to tier 3"),
        pytest.param("memory", "peer:c", id="tier 1 falls back to the peer copy"),
    ],
)
def test_a_corrupt_copy_is_detected_and_the_next_source_used(
    cluster: Cluster, tmp_path: Path, damage: Any, tier: str, expected_source: str
) -> None:
    cluster.ring(RACKS)
    uri = f"file://{tmp_path}/persistent"
    if tier == "local":  # tier 1 never due: the fastest copy is on disk
        spec = spec_json(memory=1000, peers=1, local=10, persistent=10, uri=uri)
    else:
        spec = spec_json(memory=10, peers=1)
    trainers(cluster, "save", JOB, PLACEMENT, spec, "--steps", "10")

    damage(shard_file(cluster, tier, "a", 1, 10))
    restored = only_line(trainers(cluster, "restore", JOB, {1: "a"}, spec, world=8)[1])

    assert restored["source"] == expected_source, restored
    assert restored["step"] == 10
    assert restored["equal"] is True
    [skipped] = restored["skipped"]
    assert skipped.startswith(f"step 10 {tier}:a: ")
    assert "checksum" in skipped or "bytes" in skipped


def test_unwritable_persistent_uri_is_a_clear_error_and_tiers_1_and_2_carry_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.ring({"r1": ["a"], "r2": ["c"]})
    cluster.persistent.mkdir(exist_ok=True)
    blocker = cluster.persistent / "not-a-directory"
    blocker.write_text("a file where the checkpoint folder should be")
    uri = f"file://{blocker}/ckpt"
    spec = spec_json(memory=10, peers=1, local=10, persistent=10, uri=uri)

    results = trainers(cluster, "save", JOB, {0: "a", 1: "c"}, spec, "--steps", "10,20")

    for _rank, lines in results.items():
        assert [line["step"] for line in lines] == [10, 20]
        for line in lines:
            assert "persistent" in line["error"], line
            assert "unwritable" in line["error"], line
            assert str(blocker) in line["error"]
            assert line["outcomes"]["persistent"]["state"] == "error"
            assert {line["outcomes"][t]["state"] for t in ("memory", "peers", "local")} == {"ok"}
    with cluster.client("a", JOB, 0, 2, spec=to_spec(spec)) as client:
        assert client.committed() == {"memory": 20, "local": 20, "persistent": None}


def raw(cluster: Cluster, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
    host, port = wire.Endpoint(cluster.address("a"), "").host_port
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        body = json.dumps({"size": 4096}).encode() if method == "POST" else None
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_a_wrong_token_is_refused(cluster: Cluster) -> None:
    cluster.start("a")
    reserve = wire.shard_path(JOB, 0, 10, "reserve")

    assert raw(cluster, "POST", reserve, {})[0] == 401
    assert raw(cluster, "POST", reserve, {"Authorization": "Bearer guess"})[0] == 403
    with cluster.client("a", JOB, 0, 1, token="guess") as client:
        with pytest.raises(errors.AuthError, match="refused the token"):
            client.latest()
        handle = client.save(10, state_for(0, 10))
        with pytest.raises(errors.TierWriteError, match=r"refused the token \(403\)"):
            handle.wait()
    assert inventory(cluster, "a") == []


@pytest.mark.parametrize(
    "job", ["../evil", "..", "a/../../evil", "/etc", "..%2Fevil", "ok/../.."], ids=repr
)
def test_a_job_name_that_escapes_the_data_directory_is_refused(
    cluster: Cluster, tmp_path: Path, job: str
) -> None:
    cluster.start("a")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    with pytest.raises(errors.InvalidNameError):
        cluster.client("a", job, 0, 1)
    token = {"Authorization": f"Bearer {OPERATOR}"}
    for path in (f"/v1/jobs/{job}/ranks/0/steps/10/reserve", f"/v1/inventory?job={job}"):
        status, body = raw(cluster, "POST" if "reserve" in path else "GET", path, token)
        assert status in (400, 404), (path, status, body)
    status, body = raw(cluster, "POST", wire.shard_path(job, 0, 10, "reserve"), token)
    assert status == 400
    assert "invalid job name" in body

    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert [p for p in after if p not in before and "evil" in str(p)] == []


def test_a_trainer_without_the_daemons_shared_memory_uploads_and_downloads(
    cluster: Cluster,
) -> None:
    cluster.ring({"r1": ["a"], "r2": ["c"]})
    spec = to_spec(spec_json(memory=1, peers=1, local=2))
    with cluster.client("a", JOB, 0, 1, spec=spec, shared_memory=False) as client:
        for step in (1, 2):
            client.save(step, state_for(0, step)).wait()
        restored = client.restore()
        older = client.restore(1)

    assert (restored.step, restored.source) == (2, "memory:a")
    assert digest(restored.state) == digest(state_for(0, 2))
    assert digest(older.state) == digest(state_for(0, 1))
    assert holders(cluster, 2, "memory") == {0: {"a", "c"}}


def test_an_upload_refused_before_its_body_is_read_reports_why(cluster: Cluster) -> None:
    cluster.start("a")
    path = wire.shard_path(JOB, 0, 1, "shard")
    meta = {wire.HEADER + "Checksum": "xxh3_64:00", wire.HEADER + "World-Size": "1"}
    body = memoryview(bytes(64 << 20))
    with pytest.raises(errors.AuthError, match="refused the token"):
        wire.put_shard(wire.Endpoint(cluster.address("a"), "guess"), path, meta, body, len(body))
    with pytest.raises(errors.MemoryFullError, match="full"):
        wire.put_shard(
            wire.Endpoint(cluster.address("a"), job_token(JOB)), path, meta, body, 1 << 30
        )


def test_a_step_pinned_for_a_recovery_outlives_newer_saves(cluster: Cluster) -> None:
    """The operator pins the step a recovery restores (PUT /v1/jobs/J/pin): the ranks still
    running save newer steps before they reload, and the pinned one must stay on every tier."""
    cluster.ring(RACKS)
    spec = spec_json(memory=10, peers=1, local=10)
    trainers(cluster, "save", JOB, PLACEMENT, spec, "--steps", "10")
    for node in "abcd":
        wire.request(
            wire.Endpoint(cluster.address(node), OPERATOR),
            "PUT",
            f"/v1/jobs/{JOB}/pin",
            {"step": 10},
        )
    trainers(cluster, "save", JOB, PLACEMENT, spec, "--steps", "20,30,40,50")
    assert sorted(holders(cluster, 10, "memory")) == list(range(8))
    assert sorted(holders(cluster, 10, "local")) == list(range(8))
    for node in "abcd":  # every rank reloaded: the recovery lets the step go (the memory
        # tier's unit tests show it evicted then)
        answer = wire.request(
            wire.Endpoint(cluster.address(node), OPERATOR),
            "PUT",
            f"/v1/jobs/{JOB}/pin",
            {"step": None},
        )
        assert answer == {"job": JOB, "pinned": None}


@pytest.mark.parametrize("shared_memory", [True, False], ids=["mapped", "uploaded"])
def test_a_save_waits_for_a_daemon_restarted_under_it_and_tier_1_outlives_it(
    cluster: Cluster, shared_memory: bool
) -> None:
    # A rollout (helm upgrade) replaces the node's daemon: the old one stops, a new one serves
    # the same memory folder at the same address a few seconds later.
    node = cluster.start("a")
    port = node.address.rpartition(":")[2]
    spec = to_spec(spec_json(memory=1, peers=0))
    with cluster.client("a", JOB, 0, 1, spec=spec, shared_memory=shared_memory) as client:
        client.save(1, state_for(0, 1)).wait()
        node.process.terminate()
        node.process.wait(timeout=30)
        later = threading.Timer(1.5, cluster.start, ("a", (), "--listen", f"127.0.0.1:{port}"))
        later.start()
        try:
            started = time.monotonic()
            client.save(2, state_for(0, 2)).wait()  # no TierWriteError: it waited
            waited = time.monotonic() - started
        finally:
            later.join()
        restored = client.restore()
        older = client.restore(1)

    assert waited >= 1.0  # the save could not have been written before the new daemon
    assert (restored.step, restored.source) == (2, "memory:a")
    assert digest(restored.state) == digest(state_for(0, 2))
    assert digest(older.state) == digest(state_for(0, 1))  # written by the daemon before


def test_a_save_fails_once_the_daemon_stays_away_longer_than_the_wait(cluster: Cluster) -> None:
    node = cluster.start("a")
    spec = to_spec(spec_json(memory=1, peers=0))
    with cluster.client("a", JOB, 0, 1, spec=spec, daemon_wait=1.0) as client:
        node.process.terminate()
        node.process.wait(timeout=30)
        started = time.monotonic()
        with pytest.raises(errors.TierWriteError, match="unreachable"):
            client.save(1, state_for(0, 1)).wait()
    assert 0.5 <= time.monotonic() - started < 60  # gave up after its wait, not the default 120 s
