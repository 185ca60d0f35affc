"""A trainer's way into its own tier-1 buffers: open files handed over the daemon's Unix socket.

A trainer on the node reaches no folder of the daemon: its pod mounts only the folder of the
daemon's socket (``<memory-dir>/socket/daemon.sock``), and the daemon hands it, over that
socket, the open file of one buffer its job reserved (to write a shard into) or of one shard
its job holds (to read it back). The token of the request decides, as for the HTTP routes:
a job's token opens that job's buffers only. What the trainer then maps is the same tmpfs
file the daemon holds, so tier 1 still costs one copy; but no other job's shard, staging
buffer or manifest is ever reachable through the file system.

One request per connection, a JSON line (at most ``REQUEST_MAX`` bytes, read within
``TIMEOUT`` seconds); one JSON line back, with the file as ancillary data (``SCM_RIGHTS``) when
one is handed over::

    {"token": T, "job": J, "open": "probe"}                        {"nonce": N}
    {"token": T, "job": J, "open": "buffer", "buffer": ID}         {"size": S} + file (rw)
    {"token": T, "job": J, "open": "shard", "rank": R, "step": S}  the shard's record + file (ro)
    an error                                                       {"error": M, "status": C}

Socket paths are bounded (108 bytes): a longer one is reached through ``/proc/self/fd`` of
its folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from matrixpool_recovery import errors

log = logging.getLogger(__name__)
REQUEST_MAX = 4096  # bytes of one request line
ANSWER_MAX = 65536  # bytes of one answer line
TIMEOUT = 5.0  # seconds a request, or an answer, may take
CONNECTIONS = 16  # requests served at once; more are closed at once
SOCKET_DIR = "socket"  # under the daemon's memory folder: the only part trainers mount
SOCKET_NAME = "daemon.sock"
Answer = tuple[dict[str, Any], int | None]  # the JSON answer and the file handed over, if any


def socket_path(memory_dir: Path) -> Path:
    return memory_dir / SOCKET_DIR / SOCKET_NAME


@contextlib.contextmanager
def _reachable(path: Path) -> Iterator[str]:
    """A name for `path` that fits a Unix socket address (its folder through /proc when long)."""
    if len(os.fsencode(str(path))) < 100:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def ask(path: Path, request: dict[str, Any], timeout: float = TIMEOUT) -> Answer:
    """Send one request to the daemon's socket; its answer and the file it handed over (the
    caller closes it). Raises DaemonUnreachableError when nothing listens there, and the
    daemon's error (``errors.DaemonError`` with its status) when it refuses."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            with _reachable(path) as address:
                sock.connect(address)
        except OSError as err:
            raise errors.DaemonUnreachableError(f"daemon socket {path}: {err}") from err
        sock.sendall(json.dumps(request).encode() + b"\n")
        data, fds, _, _ = socket.recv_fds(sock, ANSWER_MAX, 1)
    fd = fds[0] if fds else None
    try:
        answer = json.loads(data)
    except ValueError as err:
        if fd is not None:
            os.close(fd)
        raise errors.DaemonError(f"daemon socket {path}: answer {data[:80]!r}", 502) from err
    if "error" in answer:
        if fd is not None:
            os.close(fd)
        raise errors.DaemonError(str(answer["error"]), int(answer.get("status", 500)))
    return answer, fd


class FdServer:
    """Serves the daemon's socket: each request goes to `handle`, whose answer (and file) goes
    back; a CheckpointError becomes ``{"error", "status"}``."""

    def __init__(self, path: Path, handle: Callable[[dict[str, Any]], Answer]) -> None:
        self.path = path
        self.handle = handle
        self._slots = threading.BoundedSemaphore(CONNECTIONS)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o755)  # trainers may look in, never write
        path.unlink(missing_ok=True)  # a previous run's socket
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _reachable(path) as address:
            self.sock.bind(address)
        path.chmod(0o666)  # any process of the node may ask; the token decides
        self.sock.listen(64)
        self.sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ckpt-fds", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            if not self._slots.acquire(blocking=False):
                conn.close()  # busy: the client falls back to HTTP
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        fd: int | None = None
        try:
            with conn:
                conn.settimeout(TIMEOUT)
                try:
                    answer, fd = self.handle(_read_request(conn))
                except errors.CheckpointError as err:
                    answer = {"error": str(err), "status": getattr(err, "status", 400)}
                except (ValueError, KeyError, TypeError) as err:
                    answer = {"error": f"bad request: {err}", "status": 400}
                line = json.dumps(answer).encode() + b"\n"
                socket.send_fds(conn, [line], [fd] if fd is not None else [])
        except OSError as err:
            log.debug("socket request dropped: %r", err)
        finally:
            if fd is not None:
                os.close(fd)
            self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=2)
        with contextlib.suppress(OSError):
            self.path.unlink()


def _read_request(conn: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(REQUEST_MAX + 1 - len(data))
        if not chunk:
            break
        data += chunk
        if len(data) > REQUEST_MAX:
            raise ValueError(f"a request of more than {REQUEST_MAX} bytes")
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    return request
