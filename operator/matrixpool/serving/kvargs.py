"""The KV-cache pool as a serving pod is told of it: three arguments, each defaulting to the
environment the operator gives the pod (``MATRIXPOOL_KV_SERVICE``, ``MATRIXPOOL_KV_TOKEN_FILE``,
``MATRIXPOOL_KV_DAEMONS``), and the service's client of the pool from them. Shared by our
simulated server (``python -m matrixpool.serving``) and the llama.cpp sidecar
(``python -m matrixpool.serving.kvproxy``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path

from matrixpool_recovery import kvclient

log = logging.getLogger(__name__)


def add(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> argparse._ArgumentGroup:
    """The pool's arguments, in a group of their own (returned: a server may add to it)."""
    pool = parser.add_argument_group("the supernode's KV-cache pool (all three, or none)")
    pool.add_argument(
        "--kv-service",
        default=environ.get("MATRIXPOOL_KV_SERVICE") or None,
        help="the service whose KV blocks these are (default: $MATRIXPOOL_KV_SERVICE)",
    )
    pool.add_argument(
        "--kv-token-file",
        type=Path,
        default=environ.get("MATRIXPOOL_KV_TOKEN_FILE") or None,
        help="the file holding the service's token (default: $MATRIXPOOL_KV_TOKEN_FILE)",
    )
    pool.add_argument(
        "--kv-daemons",
        default=environ.get("MATRIXPOOL_KV_DAEMONS") or None,
        help="host:port of the pool's daemons, a comma list, the own node's first"
        " (default: $MATRIXPOOL_KV_DAEMONS)",
    )
    return pool


def client(args: argparse.Namespace) -> kvclient.KvClient | None:
    """The service's view of the pool, when the pod was given one (all three arguments);
    exits with a message naming them when only some were given."""
    given = [args.kv_service, args.kv_token_file, args.kv_daemons]
    if not any(given):
        return None
    if not all(given):
        raise SystemExit("the KV pool needs --kv-service, --kv-token-file and --kv-daemons")
    daemons = list(dict.fromkeys(a.strip() for a in args.kv_daemons.split(",") if a.strip()))
    token = args.kv_token_file.read_text().strip()
    log.info("KV pool of %d daemons, %s first", len(daemons), daemons[0])
    return kvclient.KvClient(args.kv_service, token, daemons)
