"""Structured logging for every matrixpool process: structlog on top of the standard library,
so kopf's own records come out in the same format. JSON in the cluster
(``MATRIXPOOL_LOG_FORMAT=json``, the chart's default), readable key=value lines in a terminal.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(fmt: str | None = None, level: str | None = None) -> None:
    """Route structlog and stdlib logging to stderr in ``fmt`` (json|console) at ``level``."""
    fmt = (
        fmt
        or os.environ.get("MATRIXPOOL_LOG_FORMAT")
        or ("console" if sys.stderr.isatty() else "json")
    )
    level_name = (level or os.environ.get("MATRIXPOOL_LOG_LEVEL") or "info").upper()
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level_name, logging.INFO))
    # kopf's per-object debug chatter is useful only when asked for.
    logging.getLogger("kopf").setLevel(max(root.level, logging.INFO))
    # aiohttp logs every request it serves at info: kopf's liveness endpoint, probed by the
    # kubelet every few seconds, would be most of the operator's log. Shown at debug.
    logging.getLogger("aiohttp.access").setLevel(
        logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING
    )
