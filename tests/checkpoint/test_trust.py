"""Scoped credentials and daemon-owned paths (issue 11, defects 3, 4 and 9), on loopback.

Real daemon processes started with the cluster secret. A trainer's token opens its own job's
routes and nothing else; peer lists, pins, deletes and the whole inventory need the operator's
token; a committed step is a sane integer no newer than the step saved; a tier-3 URI must
resolve inside the daemon's --persistent-root; a daemon pushes a job's copy to a peer with that
job's token. The fake peer is an HTTP server in this process that records what it is sent.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from matrixpool_recovery import CheckpointSpec, errors, manifest, names, wire
from tests.checkpoint.conftest import OPERATOR, ROOT, Cluster, job_token
from tests.checkpoint.trainer import state_for

MINE, THEIRS = "ml.mine", "ml.theirs"  # the job whose token the test holds, and another
STEP = 10


def call(
    cluster: Cluster, method: str, path: str, token: str | None, body: Any = None, **headers: str
) -> tuple[int, dict[str, Any]]:
    """One request to daemon a; the status and the decoded JSON answer."""
    host, port = wire.Endpoint(cluster.address("a"), "").host_port
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=data, headers=headers)
        answer = conn.getresponse()
        payload = answer.read()
        is_json = answer.getheader("Content-Type") == "application/json"
        return answer.status, json.loads(payload) if is_json else {"bytes": len(payload)}
    finally:
        conn.close()


def held(cluster: Cluster, job: str) -> set[tuple[int, int, str]]:
    """(rank, step, tier) of every shard of `job` on daemon a, asked with the operator token."""
    answer = wire.request(
        wire.Endpoint(cluster.address("a"), OPERATOR), "GET", f"/v1/inventory?job={job}"
    )
    return {(s["rank"], s["step"], s["tier"]) for s in answer["shards"]}


def save(cluster: Cluster, job: str, *steps: int, **spec: Any) -> None:
    options = CheckpointSpec(memory_every=1, peer_replicas=0, local_every=1, **spec)
    with cluster.client("a", job, 0, 1, spec=options, peers=[]) as client:
        for step in steps:
            client.save(step, state_for(0, step)).wait()


@pytest.fixture
def theirs(cluster: Cluster) -> Cluster:
    """Daemon a holding step 10 of the other job on tiers 1 and 2."""
    cluster.start("a")
    save(cluster, THEIRS, STEP)
    assert held(cluster, THEIRS) == {(0, STEP, "memory"), (0, STEP, "local")}
    return cluster


def shard(job: str, action: str, **query: Any) -> str:
    return wire.shard_path(job, 0, STEP, action, **query)


FORBIDDEN_TO_A_JOB = [
    pytest.param("GET", f"/v1/inventory?job={THEIRS}", None, id="reading their inventory"),
    pytest.param("GET", "/v1/inventory", None, id="reading every job's inventory"),
    pytest.param("GET", f"/v1/info?job={THEIRS}", None, id="reading the info of their job"),
    pytest.param("GET", "/v1/info", None, id="reading the info without naming a job"),
    pytest.param("GET", shard(THEIRS, "shard", tier="memory"), None, id="reading their shard"),
    pytest.param("GET", shard(THEIRS, "shard", tier="local"), None, id="reading their disk"),
    pytest.param("GET", shard(THEIRS, "status"), None, id="reading their save status"),
    pytest.param("POST", shard(THEIRS, "reserve"), {"size": 64}, id="reserving for them"),
    pytest.param(
        "POST",
        shard(THEIRS, "commit"),
        {"buffer": "x", "size": 64, "checksum": "xxh3_64:00", "worldSize": 1},
        id="committing into their job",
    ),
    pytest.param("PUT", f"/v1/jobs/{THEIRS}/pin", {"step": None}, id="unpinning their step"),
    pytest.param("PUT", f"/v1/jobs/{MINE}/pin", {"step": STEP}, id="pinning its own step"),
    pytest.param("DELETE", f"/v1/jobs/{THEIRS}", None, id="deleting their job"),
    pytest.param("DELETE", f"/v1/jobs/{MINE}", None, id="deleting its own job"),
    pytest.param("POST", "/v1/peers", {"peers": ["127.0.0.1:9"]}, id="re-pointing the peers"),
]


@pytest.mark.parametrize(("method", "path", "body"), FORBIDDEN_TO_A_JOB)
def test_a_jobs_token_is_refused_beyond_its_own_job(
    theirs: Cluster, method: str, path: str, body: Any
) -> None:
    status, answer = call(theirs, method, path, job_token(MINE), body)

    assert status == 403, answer
    assert "operator token" in answer["error"], answer
    assert held(theirs, THEIRS) == {(0, STEP, "memory"), (0, STEP, "local")}
    peers = wire.request(wire.Endpoint(theirs.address("a"), OPERATOR), "GET", "/v1/info")
    assert peers["peers"] == []


def test_the_other_jobs_token_cannot_be_used_for_a_save_of_this_one(theirs: Cluster) -> None:
    upload = memoryview(bytes(4096))
    meta = {wire.HEADER + "Checksum": "xxh3_64:00", wire.HEADER + "World-Size": "1"}
    endpoint = wire.Endpoint(theirs.address("a"), job_token(MINE))

    with pytest.raises(errors.AuthError, match=f"the job token of {THEIRS}"):
        wire.put_shard(endpoint, shard(THEIRS, "shard"), meta, upload, len(upload))
    with (
        theirs.client("a", THEIRS, 0, 1, token=job_token(MINE), peers=[]) as client,
        pytest.raises(errors.AuthError, match=r"refused the token \(403\)"),
    ):
        client.latest()
    assert held(theirs, THEIRS) == {(0, STEP, "memory"), (0, STEP, "local")}


def test_a_request_without_a_token_is_told_which_one_it_needs(theirs: Cluster) -> None:
    status, answer = call(theirs, "GET", f"/v1/inventory?job={THEIRS}", None)

    assert status == 401
    assert f"the job token of {THEIRS} or the operator token" in answer["error"]


def test_a_jobs_token_opens_its_own_job_on_every_route_a_trainer_uses(theirs: Cluster) -> None:
    save(theirs, MINE, STEP)
    mine = job_token(MINE)

    assert call(theirs, "GET", f"/v1/inventory?job={MINE}", mine)[0] == 200
    assert call(theirs, "GET", f"/v1/info?job={MINE}", mine)[0] == 200
    for action, query in (("shard", {"tier": "local"}), ("status", {})):
        assert call(theirs, "GET", shard(MINE, action, **query), mine)[0] == 200, action
    with theirs.client("a", MINE, 0, 1, peers=[]) as client:
        assert client.latest() == STEP
        assert client.restore().source == "memory:a"


def test_the_operator_token_pins_deletes_and_sets_peers(theirs: Cluster) -> None:
    pinned = call(theirs, "PUT", f"/v1/jobs/{THEIRS}/pin", OPERATOR, {"step": STEP})
    peers = call(theirs, "POST", "/v1/peers", OPERATOR, {"peers": ["127.0.0.1:9"]})
    listed = call(theirs, "GET", "/v1/inventory", OPERATOR)
    deleted = call(theirs, "DELETE", f"/v1/jobs/{THEIRS}", OPERATOR)

    assert pinned == (200, {"job": THEIRS, "pinned": STEP})
    assert peers == (200, {"peers": ["127.0.0.1:9"]})
    assert listed[0] == 200
    assert {s["job"] for s in listed[1]["shards"]} == {THEIRS}
    assert deleted == (200, {"deleted": THEIRS})
    assert held(theirs, THEIRS) == set()


# --- committed steps ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "committed",
    [
        pytest.param(1e300, id="1e300"),
        pytest.param(-1, id="a negative step"),
        pytest.param(names.MAX_STEP + 1, id="a step past MAX_STEP"),
        pytest.param(STEP + 30, id="a step above the one saved"),
        pytest.param(2.5, id="a fraction"),
    ],
)
def test_an_insane_committed_step_is_refused_and_evicts_nothing(
    cluster: Cluster, committed: Any
) -> None:
    cluster.start("a")
    save(cluster, MINE, 1, 2)  # keep=2: the daemon holds both
    before = held(cluster, MINE)
    mine = job_token(MINE)
    buffer = call(cluster, "POST", shard(MINE, "reserve"), mine, {"size": 4096})[1]["buffer"]
    commit = {"buffer": buffer, "size": 4096, "checksum": "xxh3_64:00", "worldSize": 1}
    meta = {wire.HEADER + "World-Size": "1", wire.HEADER + "Checksum": "xxh3_64:00"}
    meta[wire.HEADER + "Committed"] = str(committed)
    upload = memoryview(bytes(4096))

    answers = [
        call(cluster, "POST", shard(MINE, "reserve"), mine, {"size": 64, "committed": committed}),
        call(cluster, "POST", shard(MINE, "commit"), mine, {**commit, "committed": committed}),
    ]
    endpoint = wire.Endpoint(cluster.address("a"), mine)
    with pytest.raises(errors.DaemonError, match="committed step") as uploaded:
        wire.put_shard(endpoint, shard(MINE, "shard"), meta, upload, len(upload))

    for status, answer in answers:
        assert status == 400, answer
        assert "committed step" in answer["error"], answer
    assert uploaded.value.status == 400
    assert before == {(0, 1, "memory"), (0, 1, "local"), (0, 2, "memory"), (0, 2, "local")}
    assert held(cluster, MINE) == before


def test_a_committed_step_no_newer_than_the_one_saved_is_taken(cluster: Cluster) -> None:
    cluster.start("a")
    save(cluster, MINE, 1)
    mine = job_token(MINE)

    status, answer = call(
        cluster, "POST", shard(MINE, "reserve"), mine, {"size": 64, "committed": 1}
    )

    assert status == 200, answer


# --- the peer push ------------------------------------------------------------------------------


class Recorder(BaseHTTPRequestHandler):
    """A fake peer daemon: takes any upload and remembers its Authorization header."""

    seen: list[str]

    def do_PUT(self) -> None:
        self.seen.append(self.headers.get("Authorization", ""))
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        payload = json.dumps({"node": "fake", "tiers": ["memory"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def fake_peer() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []
    handler = type("Handler", (Recorder,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_a_peer_push_carries_the_jobs_token_never_the_operators(
    cluster: Cluster, fake_peer: tuple[str, list[str]]
) -> None:
    address, seen = fake_peer
    cluster.start("a", (), "--peer", address)
    spec = CheckpointSpec(memory_every=1, peer_replicas=1)

    with cluster.client("a", MINE, 0, 1, spec=spec, peers=[]) as client:
        outcomes = client.save(STEP, state_for(0, STEP)).wait()

    assert outcomes["peers"]["nodes"] == ["fake"]
    assert seen == [f"Bearer {job_token(MINE)}"]
    assert OPERATOR not in seen[0]


# --- where the daemon writes --------------------------------------------------------------------


def targets(cluster: Cluster) -> dict[str, Path]:
    """Folders a persistent URI must not reach: each outside the daemon's persistent root."""
    node = cluster.nodes["a"]
    return {
        "another job's tier 2": node.data_dir / "jobs" / THEIRS,
        "the memory directory": node.memory_dir,
        "/etc": Path("/etc"),
        "a '..' out of the root": cluster.persistent / ".." / "escaped",
    }


def tree(folder: Path) -> list[tuple[str, bytes]]:
    return sorted((str(p), p.read_bytes()) for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "target",
    ["another job's tier 2", "the memory directory", "/etc", "a '..' out of the root"],
)
def test_a_persistent_uri_outside_the_root_is_refused_and_nothing_is_written(
    theirs: Cluster, target: str
) -> None:
    folder = targets(theirs)[target]
    uri = f"file://{folder}"
    their_disk = theirs.nodes["a"].data_dir / "jobs" / THEIRS
    before = tree(their_disk)
    upload = memoryview(bytes(4096))
    meta = {
        wire.HEADER + "Checksum": "xxh3_64:00",
        wire.HEADER + "World-Size": "1",
        wire.HEADER + "Tiers": "memory,persistent",
        wire.HEADER + "Persistent-Uri": uri,
    }
    endpoint = wire.Endpoint(theirs.address("a"), job_token(MINE))

    with pytest.raises(errors.DaemonError, match="outside the daemon's persistent root") as raised:
        wire.put_shard(endpoint, shard(MINE, "shard"), meta, upload, len(upload))
    spec = CheckpointSpec(memory_every=1, peer_replicas=0, persistent_every=1, persistent_uri=uri)
    with (
        theirs.client("a", MINE, 0, 1, spec=spec, peers=[]) as client,
        pytest.raises(errors.TierWriteError, match="outside the daemon's persistent root"),
    ):
        client.save(STEP, state_for(0, STEP)).wait()

    assert raised.value.status == 400
    assert not (folder / MINE).exists()  # where tier 3 would have put this job's steps
    assert tree(their_disk) == before
    assert held(theirs, MINE) == set()
    assert held(theirs, THEIRS) == {(0, STEP, "memory"), (0, STEP, "local")}
    save(theirs, MINE, STEP + 1)  # the daemon's memory directory still works
    assert held(theirs, MINE) == {(0, STEP + 1, "memory"), (0, STEP + 1, "local")}


def test_a_persistent_uri_inside_the_root_is_written_under_the_job(cluster: Cluster) -> None:
    cluster.start("a")
    uri = f"file://{cluster.persistent}/team"

    save(cluster, MINE, STEP, persistent_every=1, persistent_uri=uri)

    found = manifest.load(cluster.persistent / "team" / MINE / names.step_dir(STEP))
    assert found is not None
    assert found.complete


def start_daemon(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    argv = [sys.executable, "-m", "matrixpool_recovery.daemon", "--listen", "127.0.0.1:0"]
    argv += ["--memory-dir", str(tmp_path / "memory"), "--data-dir", str(tmp_path / "disk")]
    argv += ["--secret-file", str(secret), *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("root", "overlaps"),
    [
        pytest.param("memory", "--memory-dir", id="the memory directory"),
        pytest.param("memory/inner", "--memory-dir", id="inside the memory directory"),
        pytest.param("disk/jobs", "--data-dir", id="inside the data directory"),
        pytest.param(".", "--memory-dir", id="a folder holding both"),
    ],
)
def test_a_persistent_root_overlapping_the_daemons_own_folders_is_refused_at_start(
    tmp_path: Path, root: str, overlaps: str
) -> None:
    started = start_daemon(tmp_path, "--persistent-root", str(tmp_path / root))

    assert started.returncode == 2, started.stderr
    assert f"--persistent-root {tmp_path / root} overlaps {overlaps}" in started.stderr


def test_no_token_is_taken_on_the_command_line(tmp_path: Path) -> None:
    started = start_daemon(tmp_path, "--token", "s3cret")

    assert started.returncode == 2
    assert "unrecognized arguments: --token" in started.stderr


# --- what an inventory may hold -----------------------------------------------------------------


def test_a_persistent_holding_in_an_inventory_does_not_break_latest(cluster: Cluster) -> None:
    cluster.start("a")
    save(cluster, MINE, STEP)
    odd = cluster.nodes["a"].data_dir / "jobs" / MINE / names.step_dir(STEP + 5)
    record = manifest.ShardRecord(0, 64, "xxh3_64:00", "a")
    manifest.save(odd, manifest.Manifest(MINE, STEP + 5, "persistent", 1, "a", {0: record}))
    assert (0, STEP + 5, "persistent") not in held(cluster, MINE)  # tier 2 lists tier 2 only

    with cluster.client("a", MINE, 0, 1, peers=[]) as client:
        assert client.latest() == STEP
        assert client.committed()["memory"] == STEP
        assert client.restore().step == STEP


# --- hostile bodies and headers (issue 31, finding 8) -------------------------------------------


def raw(cluster: Cluster, method: str, path: str, body: bytes, **headers: str) -> tuple[int, str]:
    """One request to daemon a with `body` as given; the status and the answer's text."""
    host, port = wire.Endpoint(cluster.address("a"), "").host_port
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read().decode(errors="replace")
    finally:
        conn.close()


COMMIT = {"buffer": "x", "size": 64, "checksum": "xxh3_64:00", "worldSize": 1}
NESTED = b'{"size": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize(
    ("action", "body", "named"),
    [
        pytest.param("reserve", b'{"size": 1.5}', "size", id="a fractional size"),
        pytest.param("reserve", b'{"size": -64}', "size", id="a negative size"),
        pytest.param("reserve", b'{"size": 1e400}', "out of range", id="a number past a float"),
        pytest.param("reserve", b'{"size": NaN}', "NaN", id="NaN"),
        pytest.param("reserve", NESTED, "nested too deeply", id="nesting 100000 deep"),
        pytest.param(
            "commit", json.dumps(COMMIT | {"worldSize": 0}).encode(), "worldSize", id="0 ranks"
        ),
        pytest.param(
            "commit",
            json.dumps(COMMIT | {"peerReplicas": -1}).encode(),
            "peerReplicas",
            id="-1 peer copies",
        ),
        pytest.param(
            "commit", json.dumps(COMMIT | {"size": 2.5}).encode(), "size", id="a fractional size"
        ),
    ],
)
def test_a_malformed_body_is_a_400_naming_the_field_and_changes_nothing(
    theirs: Cluster, action: str, body: bytes, named: str
) -> None:
    token = job_token(THEIRS)
    path = wire.shard_path(THEIRS, 0, STEP + 1, action)
    status, answer = raw(theirs, "POST", path, body, Authorization=f"Bearer {token}")

    assert status == 400, answer
    assert named in json.loads(answer)["error"], answer
    assert held(theirs, THEIRS) == {(0, STEP, "memory"), (0, STEP, "local")}
    assert call(theirs, "GET", "/v1/healthz", None)[0] == 200


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(OPERATOR, id="the operator token without a scheme"),
        pytest.param(f"Basic {OPERATOR}", id="another scheme"),
        pytest.param("Bearer ", id="a scheme without a token"),
    ],
)
def test_an_authorization_header_must_be_a_bearer_token(theirs: Cluster, header: str) -> None:
    status, answer = raw(theirs, "GET", "/v1/inventory", b"", Authorization=header)

    assert status == 401, answer
    assert "Bearer TOKEN" in json.loads(answer)["error"]
    assert raw(theirs, "GET", "/v1/inventory", b"", Authorization=f"bearer {OPERATOR}")[0] == 200
