"""``python -m matrixpool.serving``: the simulated inference server of one instance, as the
matrixpool image runs it in an InferenceService's pods. Serves until SIGTERM or SIGINT, then
drains: takes no new requests (503 with Retry-After), finishes the accepted ones and exits
when idle or after --drain-seconds.

Settings come from the flags, else from the pod's environment, as the operator sets it:
MATRIXPOOL_SERVE_PORT, MATRIXPOOL_POD_IP (the pod's address, to bind; else every address),
MATRIXPOOL_ROLE (prefill or decode; any other role name serves both phases) and
MATRIXPOOL_CARDS (the cards bound to the pod, a comma list: the instance has as many cards as
it names). With an admitted spec.kvCache the operator also sets MATRIXPOOL_KV_SERVICE (the
service's UID), MATRIXPOOL_KV_TOKEN_FILE (its token, from its Secret) and MATRIXPOOL_KV_DAEMONS
(the supernode's daemons, the pod's own node's first): the prefix cache is then the supernode's
KV-cache pool (``matrixpool.serving.prefixpool``). In an expert-parallel role it also sets
MATRIXPOOL_EXPERTS (the role's distinct experts) and MATRIXPOOL_EXPERT_MAP_FILE (the instance's
expert map, kept current by the kubelet): the tokens are then counted per expert and per card of
that map (``matrixpool.serving.experts``; ``--expert-skew`` makes a few experts hot).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from matrixpool.api import labels
from matrixpool.serving import engine, experts, kvargs, latency, prefixpool, server

log = logging.getLogger("matrixpool.serving")


def _cards(listed: str | None) -> int:
    """The count of a comma list of cards ("0,1,2,3": 4); 1 when none is given."""
    names = [name for name in (listed or "").split(",") if name.strip()]
    return len(names) or 1


def parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m matrixpool.serving", description=__doc__)
    parser.add_argument(
        "--port",
        type=int,
        default=environ.get("MATRIXPOOL_SERVE_PORT", "8000"),
        help="port to serve on (default: $MATRIXPOOL_SERVE_PORT, else 8000)",
    )
    parser.add_argument(
        "--host",
        default=environ.get("MATRIXPOOL_POD_IP") or "0.0.0.0",
        help="address to bind (default: $MATRIXPOOL_POD_IP, else all)",
    )
    named = environ.get("MATRIXPOOL_ROLE", "both")
    parser.add_argument(
        "--role",
        type=engine.Role,
        choices=list(engine.Role),
        default=named if named in set(engine.Role) else engine.Role.BOTH,
        help="what the instance does (default: $MATRIXPOOL_ROLE if prefill or decode, else both)",
    )
    parser.add_argument(
        "--cards",
        type=int,
        default=_cards(environ.get("MATRIXPOOL_CARDS")),
        help="cards of the instance (default: as many as $MATRIXPOOL_CARDS lists, else 1)",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="after SIGTERM, how long accepted requests may take to finish (default: 30)",
    )
    parser.add_argument(
        "--linger-seconds",
        type=float,
        default=5.0,
        help="after SIGTERM, keep answering 503 at least this long, so that clients still "
        "listing this pod go elsewhere rather than find it closed (default: 5)",
    )
    parser.add_argument(
        "--model-name", default="matrixpool-sim", help="the model_name label of the metrics"
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="run the latency model this many times faster (demos that compress a day)",
    )
    parser.add_argument(
        "--max-batch", type=int, default=None, help="decode batch (default: 96 per card)"
    )
    moe = parser.add_argument_group("experts (an expert-parallel role's pods)")
    moe.add_argument(
        "--experts",
        type=int,
        default=int(environ.get(labels.ENV_EXPERTS) or 0),
        help="distinct experts, counted per expert on /metrics (default: $MATRIXPOOL_EXPERTS, "
        "else 0: no expert counters)",
    )
    moe.add_argument(
        "--expert-map",
        type=Path,
        default=environ.get(labels.ENV_EXPERT_MAP_FILE) or None,
        help="the instance's expert map, followed as it changes (default:"
        " $MATRIXPOOL_EXPERT_MAP_FILE)",
    )
    moe.add_argument(
        "--expert-skew",
        type=float,
        default=0.0,
        help="the gate's Zipf exponent: the r-th hottest expert gets tokens in proportion to "
        "1/r**skew (default: 0, even)",
    )
    moe.add_argument(
        "--expert-seed", type=int, default=0, help="which experts are hot (default: 0)"
    )
    moe.add_argument(
        "--experts-per-token",
        type=int,
        default=experts.DEFAULT_TOP_K,
        help=f"routed experts per token (default: {experts.DEFAULT_TOP_K}, at most --experts)",
    )
    pool = kvargs.add(parser, environ)
    pool.add_argument(
        "--kv-block-bytes",
        type=int,
        default=int(environ.get("MATRIXPOOL_KV_BLOCK_BYTES") or BLOCK_BYTES),
        help="bytes stored per KV block, standing in for its KV (default:"
        f" $MATRIXPOOL_KV_BLOCK_BYTES, else the model's {BLOCK_BYTES})",
    )
    return parser


BLOCK_BYTES = latency.KV_BYTES_PER_TOKEN * engine.BLOCK_TOKENS  # one block of the model's KV


def prefixes(args: argparse.Namespace) -> prefixpool.PooledPrefixes | None:
    """The KV-cache pool as the engine's prefix cache, when the pod was given one."""
    client = kvargs.client(args)
    if client is None:
        return None
    return prefixpool.PooledPrefixes(client, args.kv_block_bytes)


def routed(args: argparse.Namespace) -> experts.Experts | None:
    """The instance's experts, when it has any."""
    if args.experts <= 0:
        return None
    shares = experts.zipf_shares(args.experts, args.expert_skew, args.expert_seed)
    router = experts.Router(shares, min(args.experts_per_token, args.experts))
    log.info("%d experts, skew %.2f, map %s", args.experts, args.expert_skew, args.expert_map)
    return experts.Experts(router, experts.MapFile(args.expert_map, args.experts))


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = parser(os.environ if environ is None else environ).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    instance = engine.Engine(
        model=latency.DEFAULT.scaled(args.speed),
        cards=args.cards,
        role=args.role,
        max_batch=args.max_batch,
    )
    return 0 if asyncio.run(_serve(instance, args)) else 1


async def _serve(instance: engine.Engine, args: argparse.Namespace) -> bool:
    """Serve until SIGTERM or SIGINT, then drain; True when every accepted request finished."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    app = server.create_app(
        instance, model_name=args.model_name, prefixes=prefixes(args), routed=routed(args)
    )
    runner = await server.start(app, args.host, args.port)
    log.info("serving on %s", runner.addresses)
    await stop.wait()
    log.info("draining, for at most %.0f s", args.drain_seconds)
    drained = await server.drain_and_stop(runner, args.drain_seconds, args.linger_seconds)
    log.info("stopped: %s", "every request finished" if drained else "the drain timed out")
    return drained


if __name__ == "__main__":
    raise SystemExit(main())
