"""``python -m matrixpool.deviceplugin``: the kubelet device plugin of one node, as the chart's
device plugin DaemonSet runs it (container ``device-plugin``, when ``devicePlugin.enabled``).
Runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from matrixpool import logs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m matrixpool.deviceplugin", description=__doc__)
    parser.add_argument(
        "--node",
        default=os.environ.get("NODE_NAME"),
        help="this node's name (default: $NODE_NAME, the downward API's spec.nodeName)",
    )
    parser.add_argument(
        "--resource",
        default="huawei.com/Ascend910",
        help="extended resource the cards are advertised as: the SuperNodes' cardResource",
    )
    parser.add_argument(
        "--cards", type=int, default=8, help="cards per node: devices 0..N-1 (cardsPerNode)"
    )
    parser.add_argument(
        "--folder",
        type=Path,
        default=Path("/var/lib/kubelet/device-plugins"),
        help="the kubelet's device-plugins folder: the plugin's socket goes there",
    )
    parser.add_argument(
        "--kubelet-socket",
        type=Path,
        default=None,
        help="the kubelet's Registration socket (default: FOLDER/kubelet.sock)",
    )
    parser.add_argument(
        "--health-file",
        type=Path,
        default=None,
        help='unhealthy cards written by a node agent, as the node annotation ("3,5")',
    )
    parser.add_argument(
        "--poll-seconds", type=float, default=1.0, help="how often health and the kubelet are read"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.node:
        print("--node (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    if not 1 <= args.cards <= 64:
        print("--cards must be between 1 and 64 (a SuperNode's cardsPerNode)", file=sys.stderr)
        return 2
    logs.configure()

    from matrixpool.deviceplugin import kube, plugin, service
    from matrixpool.k8s import client

    config = service.Config(
        resource=args.resource,
        cards=args.cards,
        folder=args.folder,
        kubelet_socket=args.kubelet_socket or args.folder / "kubelet.sock",
        health_file=args.health_file,
        poll_seconds=args.poll_seconds,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    cluster = kube.KubeCluster(client.from_kubeconfig(None), args.node, args.resource)
    cluster.start(stop)
    plugin.Plugin(config, cluster).run(stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
