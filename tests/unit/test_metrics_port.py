"""The operator's /metrics port taken by the operator it replaces (still in its grace period):
served once that one lets go, not never (the demo's operator after `helm upgrade`)."""

from __future__ import annotations

import socket
import time
import urllib.request

from matrixpool import metrics


def test_a_port_in_use_is_served_once_it_is_free() -> None:
    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    metrics.serve(port, retry=0.1, give_up=30)
    time.sleep(0.3)  # tried and refused meanwhile
    held.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
                assert b"matrixpool_" in answer.read()
                return
        except OSError:
            assert time.monotonic() < deadline, "the metrics port was never served"
            time.sleep(0.1)
