"""HTTP to a checkpoint daemon: JSON requests, shard uploads and shard downloads.

Used by the trainer client (to its node's daemon and to peers) and by the daemon (to push
tier-1 copies to peers). One connection per request, plain HTTP on the node network, a bearer
token in ``Authorization: Bearer`` (a job's or the operator's, see ``credentials``). Status
codes become the errors of ``errors``; a refused or timed-out connection becomes
``DaemonUnreachableError`` (a lost node looks like that).
"""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from matrixpool_recovery import errors

HEADER = "X-Matrixpool-"  # prefix of the headers that carry shard metadata
SEND_PIECE = 8 << 20  # bytes per sendall when uploading from memory
_BY_STATUS: dict[int, type[errors.DaemonError]] = {
    401: errors.AuthError,
    403: errors.AuthError,
    404: errors.NotFoundError,
    507: errors.MemoryFullError,
}


@dataclass(frozen=True)
class Endpoint:
    """A daemon's address and the token it wants."""

    address: str  # host:port, or http://host:port
    token: str  # a job's token or the operator's (credentials)
    timeout: float = 60.0  # seconds for connecting and for each socket operation

    @property
    def host_port(self) -> tuple[str, int]:
        bare = self.address.removeprefix("http://").rstrip("/")
        host, sep, port = bare.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"daemon address {self.address!r} is not host:port")
        return host.strip("[]"), int(port)

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        host, port = self.host_port
        return http.client.HTTPConnection(host, port, timeout=timeout or self.timeout)

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", **(extra or {})}


def shard_path(job: str, rank: int, step: int, action: str, **query: Any) -> str:
    path = f"/v1/jobs/{quote(job, safe='')}/ranks/{rank}/steps/{step}/{action}"
    pairs = {k: v for k, v in query.items() if v is not None}
    return f"{path}?{urlencode(pairs)}" if pairs else path


@contextlib.contextmanager
def _talking(endpoint: Endpoint) -> Iterator[None]:
    """Turn socket failures into DaemonUnreachableError."""
    try:
        yield
    except (http.client.HTTPException, OSError) as err:
        if isinstance(err, errors.CheckpointError):
            raise
        raise errors.DaemonUnreachableError(
            f"checkpoint daemon {endpoint.address} unreachable: {err!r}"
        ) from err


def check(endpoint: Endpoint, response: http.client.HTTPResponse, body: bytes) -> None:
    """Raise the error a non-2xx answer stands for."""
    if 200 <= response.status < 300:
        return
    try:
        reason = str(json.loads(body).get("error", body[:200]))
    except ValueError:
        reason = body[:200].decode(errors="replace")
    kind = _BY_STATUS.get(response.status, errors.DaemonError)
    if response.status == 400 and "name" in reason:
        raise errors.InvalidNameError(f"daemon {endpoint.address}: {reason}")
    if kind is errors.AuthError:
        reason = f"refused the token ({response.status}): {reason}"
    raise kind(f"daemon {endpoint.address} {reason}", response.status)


def request(
    endpoint: Endpoint, method: str, path: str, body: Any = None, timeout: float | None = None
) -> Any:
    """A JSON request; returns the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    headers = endpoint.headers({"Content-Type": "application/json"} if data else None)
    with _talking(endpoint):
        conn = endpoint.connect(timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            answer = response.read()
        finally:
            conn.close()
    check(endpoint, response, answer)
    return json.loads(answer) if answer else None


def put_shard(
    endpoint: Endpoint, path: str, meta: Mapping[str, str], source: Path | memoryview, size: int
) -> Any:
    """Upload shard bytes from a file (sendfile, no copy) or from memory."""
    with _talking(endpoint):
        conn = endpoint.connect()
        try:
            conn.putrequest("PUT", path, skip_accept_encoding=True)
            for name, value in endpoint.headers({"Content-Length": str(size), **meta}).items():
                conn.putheader(name, value)
            conn.endheaders()
            # Refused before the body was read (token, memory): the answer says why.
            with contextlib.suppress(OSError):
                _send_body(conn, source, size)
            response = conn.getresponse()
            answer = response.read()
        finally:
            conn.close()
    check(endpoint, response, answer)
    return json.loads(answer) if answer else None


def _send_body(conn: http.client.HTTPConnection, source: Path | memoryview, size: int) -> None:
    sock = conn.sock
    assert sock is not None
    if isinstance(source, Path):
        with open(source, "rb") as file:
            sent = sock.sendfile(file, 0, size)
        if sent != size:
            raise errors.IntegrityError(f"sent {sent} of {size} bytes of {source}")
        return
    for offset in range(0, size, SEND_PIECE):
        sock.sendall(source[offset : offset + SEND_PIECE])


@dataclass
class Download:
    """An open shard download: read_into fills buffers, close ends it."""

    conn: http.client.HTTPConnection
    response: http.client.HTTPResponse
    size: int  # Content-Length
    checksum: str  # the checksum the holder recorded

    def read_into(self, view: memoryview) -> int:
        return self.response.readinto(view)

    def close(self) -> None:
        self.response.close()
        self.conn.close()


def get_shard(endpoint: Endpoint, path: str) -> Download:
    with _talking(endpoint):
        conn = endpoint.connect()
        try:
            conn.request("GET", path, headers=endpoint.headers())
            response = conn.getresponse()
        except BaseException:
            conn.close()
            raise
    if response.status != 200:
        body = response.read()
        conn.close()
        check(endpoint, response, body)
    size = int(response.getheader("Content-Length", "-1"))
    return Download(conn, response, size, response.getheader(HEADER + "Checksum", ""))
