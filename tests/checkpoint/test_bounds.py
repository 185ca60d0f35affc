"""Bounds of the checkpoint daemon (issue 11, defects 5 and 6), against real daemon processes.

Copies reported ok stay ok (a late upload never changes a committed file, a restore falls back
past a step with no valid copy), and the daemon's resources are bounded: connections, threads,
memory, a full tmpfs or disk, a stalled upload.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from matrixpool_recovery import checksum, errors, manifest, names, wire
from tests import tmpfs
from tests.checkpoint.conftest import OPERATOR, Cluster, job_token, spec_json, to_spec
from tests.checkpoint.trainer import digest, state_for

JOB = "ml.llm"
DEADLINE = 30.0  # seconds a bounded wait may take before the test fails


def endpoint(cluster: Cluster, node: str = "a") -> wire.Endpoint:
    return wire.Endpoint(cluster.address(node), OPERATOR, timeout=10)


def reserve(cluster: Cluster, rank: int, step: int, size: int) -> dict[str, object]:
    path = wire.shard_path(JOB, rank, step, "reserve")
    answer: dict[str, object] = wire.request(endpoint(cluster), "POST", path, {"size": size})
    return answer


def held(cluster: Cluster) -> list[tuple[int, int, str]]:
    shards = wire.request(endpoint(cluster), "GET", "/v1/inventory")["shards"]
    return sorted((s["step"], s["rank"], s["tier"]) for s in shards)


def threads(cluster: Cluster, node: str = "a") -> int:
    status = Path(f"/proc/{cluster.nodes[node].process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:"))[8:])


def healthy_within(cluster: Cluster, deadline: float) -> bool:
    """Whether healthz answers 200 before the deadline (503s are retried)."""
    while time.monotonic() < deadline:
        try:
            if wire.request(endpoint(cluster), "GET", "/v1/healthz")["ok"]:
                return True
        except errors.CheckpointError:
            time.sleep(0.1)
    return False


def test_a_late_upload_does_not_change_a_committed_disk_shard(cluster: Cluster) -> None:
    cluster.start("a")
    spec = to_spec(spec_json(memory=10, peers=0, local=10))
    with cluster.client("a", JOB, 0, 1, spec=spec) as client:
        client.save(10, state_for(0, 10)).wait()
    shard = cluster.nodes["a"].data_dir / "jobs" / JOB / names.step_dir(10) / "rank-0.shard"
    before = shard.read_bytes()

    late = np.random.default_rng(1).integers(0, 255, len(before), dtype=np.uint8).tobytes()
    meta = {
        wire.HEADER + "Checksum": checksum.of(late),
        wire.HEADER + "World-Size": "1",
        wire.HEADER + "Tiers": "local",
    }
    wire.put_shard(endpoint(cluster), wire.shard_path(JOB, 0, 10, "shard"), meta, late, len(late))
    status = wire.shard_path(JOB, 0, 10, "status", wait=DEADLINE)
    outcome = wire.request(endpoint(cluster), "GET", status)["tiers"]["local"]

    assert outcome["state"] == "error", outcome
    assert "refused" in outcome["error"]
    assert shard.read_bytes() == before
    with cluster.client("a", JOB, 0, 1, spec=spec) as client:
        assert digest(client.restore(10).state) == digest(state_for(0, 10))


def test_restore_falls_back_to_the_step_before_when_no_copy_of_the_newest_is_valid(
    cluster: Cluster,
) -> None:
    cluster.start("a")
    spec = to_spec(spec_json(memory=10, peers=0))
    with cluster.client("a", JOB, 0, 1, spec=spec) as client:
        for step in (10, 20):
            client.save(step, state_for(0, step)).wait()
        memory = cluster.nodes["a"].memory_dir
        newest = manifest.load(memory / "jobs" / JOB / names.step_dir(20))
        assert newest is not None
        buffer = memory / "buffers" / newest.shards[0].buffer
        data = bytearray(buffer.read_bytes())
        data[len(data) // 2] ^= 0xFF
        buffer.write_bytes(bytes(data))

        restored = client.restore()

    assert restored.step == 10
    assert digest(restored.state) == digest(state_for(0, 10))
    [skipped] = restored.skipped
    assert "memory:a: " in skipped
    assert "checksum" in skipped


@pytest.fixture
def half_sent() -> Iterator[list[socket.socket]]:
    """Connections the test opens and leaves half-sent; closed at the end."""
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for conn in opened:
            conn.close()


def test_a_flood_of_half_sent_requests_holds_bounded_threads(
    cluster: Cluster, half_sent: list[socket.socket]
) -> None:
    cluster.start("a", (), "--max-requests", "16", "--read-timeout", "3")
    idle = threads(cluster)
    host, port = endpoint(cluster).host_port
    for _ in range(300):
        conn = socket.create_connection((host, port), timeout=10)
        conn.sendall(b"PUT /v1/jobs/x/ranks/0/steps/1/shard HTTP/1.0\r\nContent-Len")
        half_sent.append(conn)

    most = threads(cluster)
    assert healthy_within(cluster, time.monotonic() + DEADLINE)
    assert most <= idle + 16 + 4, (idle, most)  # handlers, and the tier pool's workers


def test_reservations_beyond_the_memory_bound_are_refused_and_evict_nothing(
    cluster: Cluster,
) -> None:
    cluster.start("a", (), "--memory-bytes", "24Mi", "--memory-headroom", "16Mi")
    spec = to_spec(spec_json(memory=10, peers=0))
    with cluster.client("a", JOB, 0, 1, spec=spec) as client:  # maps the buffers it writes
        for step in (10, 20):
            client.save(step, state_for(0, step)).wait()
        before = held(cluster)
        with pytest.raises(errors.MemoryFullError):
            reserve(cluster, 0, 30, 8 << 20)
        assert held(cluster) == before == [(10, 0, "memory"), (20, 0, "memory")]
        info = wire.request(endpoint(cluster), "GET", "/v1/info")
        assert info["usedBytes"] <= info["memoryBytes"]


def test_a_full_tmpfs_is_a_507_at_reserve_time(cluster: Cluster) -> None:
    with tmpfs.mounted(cluster.root / "a" / "memory", "8m"):
        cluster.start("a")  # bound 240 MiB, tmpfs 8 MiB
        with pytest.raises(errors.MemoryFullError, match="no room"):
            reserve(cluster, 0, 1, 16 << 20)
        assert reserve(cluster, 0, 1, 1 << 20)["size"] == 1 << 20
        cluster.stop()


def test_a_full_disk_fails_saves_leaves_no_temporary_file_and_recovers(cluster: Cluster) -> None:
    with tmpfs.mounted(cluster.root / "a" / "disk", "4m") as disk:
        cluster.start("a")
        spec = to_spec(spec_json(memory=1, peers=0, local=1))
        filler = tmpfs.fill(disk)
        with cluster.client("a", JOB, 0, 1, spec=spec) as client:
            with pytest.raises(errors.TierWriteError, match="local"):
                client.save(1, state_for(0, 1)).wait()
            assert [p for p in disk.rglob("*") if p.name.endswith(".tmp")] == []
            filler.unlink()
            client.save(2, state_for(0, 2)).wait()
            assert client.committed()["local"] == 2
        cluster.stop()


def test_a_stalled_upload_loses_its_reservation(cluster: Cluster) -> None:
    cluster.start("a", (), "--read-timeout", "2", "--memory-bytes", "28Mi")  # bound 12 MiB
    size = 10 << 20
    host, port = endpoint(cluster).host_port
    with socket.create_connection((host, port), timeout=DEADLINE) as stalled:
        head = (
            f"PUT {wire.shard_path(JOB, 0, 1, 'shard')} HTTP/1.0\r\n"
            f"Authorization: Bearer {job_token(JOB)}\r\nContent-Length: {size}\r\n"
            f"{wire.HEADER}Checksum: xxh3_64:00\r\n{wire.HEADER}World-Size: 1\r\n\r\n"
        )
        stalled.sendall(head.encode() + bytes(1 << 20))  # then nothing: the upload stalls
        response = http.client.HTTPResponse(stalled)
        response.begin()  # the daemon gives up on it and answers
        assert response.status >= 400

    assert reserve(cluster, 1, 1, size)["size"] == size  # the buffer went back to the pool


# --- hostile clients (issue 31, finding 4) -------------------------------------------------------


def connect(cluster: Cluster, source: str) -> socket.socket:
    """A connection to daemon a from `source` (a loopback address: one client per address)."""
    return socket.create_connection(endpoint(cluster).host_port, DEADLINE, (source, 0))


def cut_off_within(conn: socket.socket, limit: float, trickle: bytes = b"") -> float:
    """Seconds until the daemon ends `conn`, while the client sends one byte of `trickle` every
    0.5 s (well within any read timeout); fails past `limit`."""
    started = time.monotonic()
    conn.settimeout(0.5)
    for byte in (trickle * 1000)[: int(limit * 2) + 2]:
        try:
            if conn.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except OSError:  # reset: cut off as well
            return time.monotonic() - started
        try:
            conn.send(bytes([byte]))
        except OSError:
            return time.monotonic() - started
    pytest.fail(f"the daemon kept a trickling connection past {limit} s")


def test_headers_trickled_a_byte_at_a_time_are_cut_off_at_the_header_deadline(
    cluster: Cluster,
) -> None:
    cluster.start("a", (), "--header-timeout", "2", "--read-timeout", "30")
    with connect(cluster, "127.0.0.2") as conn:
        took = cut_off_within(conn, 15, b"GET /v1/info HTTP/1.0\r\nX-Slow: ")
    assert 1.5 <= took < 10, took  # the header deadline, not the 30 s read timeout
    assert healthy_within(cluster, time.monotonic() + DEADLINE)


def test_a_trickled_upload_loses_its_reservation_at_its_deadline(cluster: Cluster) -> None:
    """An upload of 8 MiB may take 2 s + 8 MiB at 8 MiB/s; sent at 2 bytes a second, it is cut
    off then (not after the 30 s read timeout) and its buffer goes back to the pool."""
    cluster.start(
        "a", (), "--header-timeout", "2", "--min-body-rate", "8Mi", "--memory-bytes", "28Mi"
    )  # bound 12 MiB: one 8 MiB buffer at a time
    size = 8 << 20
    with connect(cluster, "127.0.0.2") as conn:
        conn.sendall(
            f"PUT {wire.shard_path(JOB, 0, 1, 'shard')} HTTP/1.0\r\n"
            f"Authorization: Bearer {job_token(JOB)}\r\nContent-Length: {size}\r\n"
            f"{wire.HEADER}Checksum: xxh3_64:00\r\n{wire.HEADER}World-Size: 1\r\n\r\n".encode()
        )
        took = cut_off_within(conn, 20, b"\0")
    assert took < 10, took
    deadline = time.monotonic() + DEADLINE
    while True:  # the buffer went back to the pool: the same size fits again
        try:
            assert reserve(cluster, 1, 1, size)["size"] == size
            break
        except errors.MemoryFullError:
            assert time.monotonic() < deadline, "the trickled upload kept its buffer"
            time.sleep(0.2)


def test_one_client_holds_at_most_its_share_and_health_checks_pass_with_every_slot_held(
    cluster: Cluster, half_sent: list[socket.socket]
) -> None:
    """8 slots, 4 per address: a client that opens 20 stalled connections holds 4 (and a health
    slot for 2 s), another client is still served; with every slot held, a health check from a
    third address passes (a slot beside the others) and any other request there is a 503."""
    cluster.start("a", (), "--max-requests", "8", "--max-requests-per-client", "4")
    for _ in range(20):
        conn = connect(cluster, "127.0.0.2")
        conn.sendall(b"PUT /v1/jobs/x/ranks/0/steps/1/shard HTTP/1.0\r\nContent-Len")
        half_sent.append(conn)
    time.sleep(0.5)

    def ask(source: str, path: str) -> int:
        with connect(cluster, source) as conn:
            conn.sendall(
                f"GET {path} HTTP/1.0\r\nAuthorization: Bearer {OPERATOR}\r\n\r\n".encode()
            )
            response = http.client.HTTPResponse(conn)
            response.begin()
            response.read()
            return response.status

    assert ask("127.0.0.3", "/v1/info") == 200  # the first client did not take every slot
    for _ in range(4):
        conn = connect(cluster, "127.0.0.4")
        conn.sendall(b"PUT /v1/jobs/x/ranks/0/steps/1/shard HTTP/1.0\r\nContent-Len")
        half_sent.append(conn)
    # every slot held once the daemon has taken the second client's four: a request from a
    # third address is a 503 (not always within a fixed 0.5 s on two busy cores: in one CI run
    # it was still answered). Asked from an address of its own: the health slot such a request
    # takes is given back by the daemon's thread after the answer, and a health check right
    # after it from the same address could find it still taken (CI of 8ec551c)
    deadline = time.monotonic() + DEADLINE
    while (status := ask("127.0.0.6", "/v1/info")) != 503:
        assert status == 200, status
        assert time.monotonic() < deadline, "the second client's connections never held a slot"
        time.sleep(0.1)
    assert ask("127.0.0.5", "/v1/healthz") == 200  # every slot held: the health slot answers
    assert ask("127.0.0.5", "/v1/info") == 503
    time.sleep(2.5)  # the first client's fifth connection held a health slot: 2 s at most
    assert ask("127.0.0.2", "/v1/healthz") == 200
