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
import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from matrixpool_recovery import errors

log = logging.getLogger(__name__)
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
    deadline: float | None = None  # seconds for a whole request, however the daemon trickles

    @property
    def host_port(self) -> tuple[str, int]:
        bare = self.address.removeprefix("http://").rstrip("/")
        host, sep, port = bare.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"daemon address {self.address!r} is not host:port")
        return host.strip("[]"), int(port)

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        host, port = self.host_port
        if self.deadline is not None:
            return _Bounded(host, port, timeout=timeout or self.timeout, deadline=self.deadline)
        return http.client.HTTPConnection(host, port, timeout=timeout or self.timeout)

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", **(extra or {})}


class Watchdog:
    """Cuts connections off at their deadlines: shut down, so that whoever is blocked reading
    or writing one gets an error at once (a daemon's handler: its slot and any buffer it
    reserved go back; a client: the request fails as unreachable). One thread for every
    connection of its owner, started at the first."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[float, socket.socket]] = {}  # watch -> deadline, connection
        self._next = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, connection: socket.socket, deadline: float) -> int:
        with self._cond:
            self._next += 1
            self._due[self._next] = (deadline, connection)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def extend(self, watch: int, deadline: float) -> None:
        with self._cond:
            if watch in self._due:
                self._due[watch] = (max(deadline, self._due[watch][0]), self._due[watch][1])

    def shorten(self, watch: int, deadline: float) -> None:
        with self._cond:
            if watch in self._due:
                self._due[watch] = (min(deadline, self._due[watch][0]), self._due[watch][1])
                self._cond.notify()

    def disarm(self, watch: int) -> None:
        with self._cond:
            self._due.pop(watch, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                late = [w for w, (deadline, _) in self._due.items() if deadline <= now]
                cut = [self._due.pop(w)[1] for w in late]
                if not cut:
                    soonest = min((d for d, _ in self._due.values()), default=now + 60)
                    self._cond.wait(max(0.01, soonest - now))
                    continue
            for connection in cut:
                log.warning("a connection passed its deadline: cut off")
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)


CLIENT_DEADLINES = Watchdog()  # the deadlines of this process's requests (Endpoint.deadline)


class _Bounded(http.client.HTTPConnection):
    """A connection cut off ``deadline`` seconds after it was opened (``CLIENT_DEADLINES``)."""

    def __init__(self, host: str, port: int, *, timeout: float, deadline: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.deadline = deadline
        self.watch: int | None = None

    def connect(self) -> None:
        super().connect()
        assert self.sock is not None
        self.watch = CLIENT_DEADLINES.arm(self.sock, time.monotonic() + self.deadline)

    def close(self) -> None:
        if self.watch is not None:
            CLIENT_DEADLINES.disarm(self.watch)
            self.watch = None
        super().close()


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
