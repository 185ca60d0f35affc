"""logs.configure: the levels of the libraries' loggers that would drown ours."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from matrixpool import logs

NAMES = ("", "kopf", "aiohttp.access")


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """configure() sets process-wide logging: put back what the test run had."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers = root.handlers[:]
    levels = {name: logging.getLogger(name).level for name in NAMES}
    yield
    structlog.configure(**config)
    root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_served_requests_such_as_liveness_probes_are_not_logged_at_info() -> None:
    logs.configure("json", "info")
    access = logging.getLogger("aiohttp.access")
    assert not access.isEnabledFor(logging.INFO)
    assert access.isEnabledFor(logging.WARNING)
    assert logging.getLogger("kopf").isEnabledFor(logging.INFO)


def test_at_debug_they_are() -> None:
    logs.configure("json", "debug")
    assert logging.getLogger("aiohttp.access").isEnabledFor(logging.INFO)
    assert not logging.getLogger("kopf").isEnabledFor(logging.DEBUG)  # kopf stays at info
