"""The ``matrixpool`` command: ``run`` (the operator), ``cluster`` (the local control plane),
``demo`` and ``simulate`` (the goodput simulator), ``export topology`` (the tiers for Kueue or
Volcano). Each subcommand imports what it needs only when it runs, so ``matrixpool cluster``
never loads kopf and ``matrixpool run`` never loads the dev cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matrixpool.devcluster.cluster import Cluster

# The kubectl plugin's commands, also reachable as `matrixpool <command>`.
PLUGIN_COMMANDS = ("status", "cards", "jobs", "recoveries")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PLUGIN_COMMANDS:
        return _plugin(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        result: int = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a clean message instead of a traceback for users
        if os.environ.get("MATRIXPOOL_DEBUG"):
            raise
        print(f"matrixpool: error: {error}", file=sys.stderr)
        return 1
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="matrixpool", description=__doc__)
    commands = parser.add_subparsers(title="commands")

    run = commands.add_parser("run", help="run the operator")
    run.add_argument(
        "--peering", metavar="NAME", help="join kopf peering NAME for HA (default: standalone)"
    )
    run.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="serve only these namespaces (repeatable; default: all)",
    )
    run.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        # A string default: argparse converts it, so a bad value is a usage error naming the
        # flag (a Service called matrixpool-metrics puts MATRIXPOOL_METRICS_PORT=tcp://… into
        # every pod of its namespace that has service links; the chart's pods have none).
        default=os.environ.get("MATRIXPOOL_METRICS_PORT") or "9090",
        help="serve Prometheus metrics on PORT (0: off; default 9090 or MATRIXPOOL_METRICS_PORT)",
    )
    run.add_argument(
        "--clock-start",
        metavar="ISO",
        help="time of day starts at this instant (tests, demos); also MATRIXPOOL_CLOCK_START",
    )
    run.add_argument(
        "--clock-speed",
        metavar="N",
        type=float,
        help="the time of day runs N times faster; also MATRIXPOOL_CLOCK_SPEED",
    )
    run.set_defaults(handler=_run)

    cluster = commands.add_parser("cluster", help="the local control plane").add_subparsers(
        title="cluster commands"
    )
    up = cluster.add_parser("up", help="start etcd, kube-*, kwok and the simulated nodes")
    up.add_argument("--supernodes", type=int, default=1)
    up.add_argument("--nodes-per-supernode", type=int, default=48)
    up.add_argument("--cards-per-node", type=int, default=8)
    up.add_argument("--nodes-per-rack", type=int, default=4)
    up.add_argument("--card-resource", default="huawei.com/Ascend910")
    up.add_argument("--no-crds", action="store_true", help="do not install the CRDs")
    up.add_argument(
        "--real-nodes",
        type=int,
        default=0,
        metavar="N",
        help="also start N real nodes: a kubelet and containerd each, in network namespaces "
        "(root; installs containerd, runc and the CNI plugins from Debian's packages)",
    )
    up.add_argument(
        "--real-supernode",
        default="sn-real",
        help="the matrixpool.dev/supernode label of the real nodes (default sn-real)",
    )
    up.add_argument(
        "--peers",
        action="store_true",
        help="also the peers matrixpool is measured against: kube-scheduler's gang and "
        "topology scheduling (feature gates GenericWorkload, TopologyAwareWorkloadScheduling) "
        "and Kueue with TAS as a process (root; built from its Go module on first use)",
    )
    up.set_defaults(handler=_cluster_up)
    load = cluster.add_parser(
        "load-image", help="import a docker-archive (make image) into every real node"
    )
    load.add_argument("archive", type=Path)
    load.add_argument(
        "--if-any",
        action="store_true",
        help="say so and succeed when no cluster with real nodes runs (make image)",
    )
    load.set_defaults(handler=_cluster_load_image)
    cluster.add_parser("down", help="stop every process, remove the state").set_defaults(
        handler=_cluster_down
    )
    cluster.add_parser("status", help="processes and API readiness").set_defaults(
        handler=_cluster_status
    )
    cluster.add_parser("kubeconfig", help="print the kubeconfig path").set_defaults(
        handler=lambda a: print(_cluster(a).kubeconfig) or 0
    )

    fault = cluster.add_parser("fault", help="inject a fault").add_subparsers(title="faults")
    for name, help_ in (
        ("node-down", "make NODE NotReady"),
        ("node-up", "make NODE Ready"),
        ("node-delete", "delete NODE"),
        ("daemon-down", "kill NODE's checkpoint daemon and keep it down (matrixpool sim)"),
        ("daemon-up", "let matrixpool sim start NODE's checkpoint daemon again"),
        ("kubelet-stop", "kill real NODE's kubelet (its containers go on running)"),
        ("kubelet-start", "start real NODE's kubelet again"),
        ("power-off", "cut real NODE's power: kubelet, containerd, containers, memory, address"),
        ("power-on", "boot real NODE again (empty memory folder); returns once it is Ready"),
    ):
        sub = fault.add_parser(name, help=help_)
        sub.add_argument("node", nargs="+")
        sub.set_defaults(handler=_fault, fault=name)
    cards = fault.add_parser("cards", help='mark cards unhealthy: cards NODE 3,5 ("" heals)')
    cards.add_argument("node")
    cards.add_argument("cards")
    cards.set_defaults(handler=_fault, fault="cards")

    sim = commands.add_parser(
        "sim", help="checkpoint daemons per node; the matrixpool image's pods as processes"
    )
    sim.add_argument(
        "--supernode",
        action="append",
        default=[],
        metavar="SN",
        help="simulate only these supernodes' nodes (repeatable; default: all)",
    )
    sim.add_argument("--folder", type=Path, help="where daemons and pods keep data and logs")
    sim.add_argument(
        "--port",
        type=int,
        default=None,
        help="port of every daemon on its node's address (the operator's "
        "MATRIXPOOL_CKPT_DAEMON_PORT; default 7040)",
    )
    sim.add_argument(
        "--memory-path",
        default=None,
        help="the daemons' tier-1 folder as pods mount it (MATRIXPOOL_CKPT_MEMORY_PATH; "
        "default /dev/shm/matrixpool)",
    )
    sim.add_argument(
        "--daemons",
        choices=("sim", "chart"),
        default="sim",
        help="sim: run a checkpoint daemon per node itself; chart: the chart's DaemonSet "
        "runs them (its pods, like every pod of the matrixpool image)",
    )
    sim.add_argument(
        "--shared-path",
        action="append",
        default=[],
        metavar="PATH",
        help="a host path that is one folder on every node, as a shared file system "
        "mounted on each (e.g. the chart's checkpointDaemon.persistentPath); repeatable",
    )
    sim.add_argument(
        "--image",
        default=None,
        help="pods whose containers all have this image repository run as processes "
        "(default matrixpool)",
    )
    sim.add_argument(
        "--kv-pool-bytes",
        default=None,
        help="each daemon's part of the KV-cache pool, out of its 256Mi (default 64Mi; a"
        " SuperNode's spec.memoryPool.perNode should say the same)",
    )
    sim.add_argument(
        "--persistent-root",
        type=Path,
        help="folder tier-3 URIs must be inside (default: FOLDER/persistent)",
    )
    sim.add_argument(
        "--namespace",
        default=os.environ.get("MATRIXPOOL_NAMESPACE")
        or "default",  # k8s.client.operator_namespace
        help="the operator's namespace, where the daemons' Leases go "
        "(default: $MATRIXPOOL_NAMESPACE, else default)",
    )
    sim.set_defaults(handler=_sim)

    announce = commands.add_parser(
        "announce", help="keep this node's checkpoint daemon Lease renewed while it answers"
    )
    announce.add_argument("--node", required=True, help="the node (spec.nodeName)")
    announce.add_argument("--endpoint", required=True, help="the daemon's host:port")
    announce.add_argument(
        "--namespace",
        default=os.environ.get("MATRIXPOOL_NAMESPACE")
        or "default",  # k8s.client.operator_namespace
        help="where the Lease goes: the operator's namespace",
    )
    announce.add_argument(
        "--lease-seconds", type=int, default=40, help="leaseDurationSeconds; renewed every quarter"
    )
    announce.set_defaults(handler=_announce)

    demo = commands.add_parser("demo", help="local cluster + operator + examples")
    demo.add_argument(
        "--keep", action="store_true", help="after the summary, keep everything up until Ctrl-C"
    )
    demo.add_argument(
        "--fast", action="store_true", help="smaller training jobs, faster clock (CI)"
    )
    demo.add_argument(
        "--summary-json", type=Path, metavar="FILE", help="also write the summary as JSON to FILE"
    )
    demo.set_defaults(handler=_demo)
    simulate = commands.add_parser(
        "simulate",
        help="replay months of training on a simulated pool, one run per recovery policy",
    )
    simulate.add_argument("file", type=Path, help="the run's YAML (examples/simulate/*.yaml)")
    simulate.add_argument("--json", action="store_true", help="print only the JSON object")
    simulate.add_argument(
        "--plot-dir", type=Path, metavar="DIR", help="write goodput.png and recovery-cdf.png"
    )
    simulate.add_argument("--seed", type=int, help="override the file's seed")
    simulate.set_defaults(handler=_simulate)
    reads = commands.add_parser(
        "readings",
        help="what the autoscaler reads from a serving engine's /metrics (URL or file), as JSON",
    )
    reads.add_argument("source", help="http://HOST:PORT/metrics, or a file of /metrics text")
    reads.add_argument(
        "--engine",
        default="Auto",
        choices=["Auto", "vLLM", "SGLang", "LlamaCpp"],
        help="whose metric names (spec.autoscaling.engine; default: told from the names)",
    )
    reads.add_argument(
        "--interval",
        type=float,
        default=5.0,
        metavar="S",
        help="a URL is read twice, S seconds apart: rates and the latency in between (default 5)",
    )
    reads.set_defaults(handler=_readings)
    exports = commands.add_parser(
        "export", help="matrixpool's view of the cluster in other tools' objects"
    ).add_subparsers(title="exports")
    tiers = exports.add_parser(
        "topology",
        help="the SuperNodes' tiers as a Kueue Topology and ResourceFlavors or Volcano "
        "HyperNodes, for kubectl apply -f - (docs/interop.md)",
    )
    tiers.add_argument("--format", required=True, choices=["kueue", "volcano"])
    tiers.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    tiers.add_argument(
        "--prefix",
        default="matrixpool",
        help="start of the Kueue objects' names (default %(default)s)",
    )
    tiers.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: $KUBECONFIG)")
    tiers.set_defaults(handler=_export_topology)
    for name in PLUGIN_COMMANDS:  # delegated before parsing; listed here for --help
        commands.add_parser(name, help=f"same as kubectl matrixpool {name} (see its --help)")
    return parser


def _plugin(argv: list[str]) -> int:
    from matrixpool.kubectl import cli as plugin_cli

    return plugin_cli.main(argv)


def _readings(args: argparse.Namespace) -> int:
    """One reading of a file, two of a URL ``--interval`` apart; the summary as JSON."""
    import urllib.request

    from matrixpool.serving import readings

    engine = readings.Engine(args.engine)

    def read() -> readings.Reading:
        if not args.source.startswith(("http://", "https://")):
            return readings.parse(Path(args.source).read_text(), time.monotonic(), engine)
        with urllib.request.urlopen(args.source, timeout=10) as response:
            return readings.parse(response.read().decode(), time.monotonic(), engine)

    first = read()
    before, now = (None, first)
    if args.source.startswith(("http://", "https://")):
        time.sleep(max(0.0, args.interval))
        before, now = first, read()
    print(json.dumps(readings.summary(now, before), indent=2))
    return 0


def _export_topology(args: argparse.Namespace) -> int:
    """Read the SuperNodes and Nodes, print the peer's objects; warnings on stderr."""
    import yaml

    from matrixpool import api as mp_api
    from matrixpool.api import supernode
    from matrixpool.interop import topology as interop
    from matrixpool.k8s import client as k8s_client

    api = k8s_client.from_kubeconfig(args.kubeconfig)
    try:
        plural = supernode.PLURAL
        supernodes = api.custom.list_cluster_custom_object(mp_api.GROUP, mp_api.VERSION, plural)
        response = api.core.list_node(_preload_content=False)
        nodes = json.loads(response.data)["items"]
    finally:
        api.client.close()
    result = interop.export(args.format, interop.pools(supernodes["items"], nodes), args.prefix)
    for warning in result.warnings:
        print(f"matrixpool: warning: {warning}", file=sys.stderr)
    if not result.objects:
        print("matrixpool: error: no SuperNode to export", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": result.objects}, indent=2))
    else:
        print(yaml.safe_dump_all(result.objects, sort_keys=False), end="")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from matrixpool.simulate import model, report

    config = model.load(args.file)
    if args.seed is not None:
        config = config.with_seed(args.seed)
    figures = report.execute(config, args.plot_dir, progress=not args.json)
    print(json.dumps(figures, indent=None if args.json else 2))
    return 0


def _run(args: argparse.Namespace) -> int:
    from matrixpool import clock, runner

    if args.clock_start:
        os.environ[clock.START_ENV] = args.clock_start
    if args.clock_speed:
        os.environ[clock.SPEED_ENV] = str(args.clock_speed)
    clock.operator()  # fail now, with the setting's name, if a value is bad
    runner.run(
        peering=args.peering,
        namespaces=args.namespace,
        liveness=args.liveness,
        metrics_port=args.metrics_port,
    )
    return 0


def _cluster(_: argparse.Namespace) -> Cluster:
    from matrixpool.devcluster import cluster

    return cluster.Cluster()


def _cluster_down(args: argparse.Namespace) -> int:
    _cluster(args).down()
    return 0


def _cluster_up(args: argparse.Namespace) -> int:
    from matrixpool.devcluster import binaries, cluster, topology

    shape = topology.Shape(
        supernodes=args.supernodes,
        nodes_per_supernode=args.nodes_per_supernode,
        cards_per_node=args.cards_per_node,
        nodes_per_rack=args.nodes_per_rack,
        card_resource=args.card_resource,
    )
    crds = None if args.no_crds else binaries.repo_root() / "crds"
    local = cluster.Cluster()
    local.up(
        shape,
        crds=crds,
        real_nodes=args.real_nodes,
        real_supernode=args.real_supernode,
        peers=args.peers,
    )
    print(f"export KUBECONFIG={local.kubeconfig}")
    return 0


def _cluster_load_image(args: argparse.Namespace) -> int:
    from matrixpool.devcluster import cluster

    local = cluster.Cluster()
    if args.if_any and not (local.running() and local.real_nodes()):
        print(f"no local cluster with real nodes runs: {args.archive} built, not loaded")
        return 0
    local.load_image(args.archive)
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    from matrixpool.devcluster import cluster

    status = cluster.Cluster().status()
    print(json.dumps(status, indent=2))
    return 0 if status["ready"] else 1


def _fault(args: argparse.Namespace) -> int:
    from matrixpool.devcluster import cluster, faults

    kubeconfig = Path(cluster.Cluster().kubeconfig)
    real_faults = {
        "kubelet-stop": cluster.Cluster.stop_kubelet,
        "kubelet-start": cluster.Cluster.start_kubelet,
        "power-off": cluster.Cluster.power_off,
        "power-on": cluster.Cluster.power_on,
    }
    if args.fault in real_faults:
        local = cluster.Cluster()
        for node in args.node:
            if node not in local.real_nodes():
                raise SystemExit(f"{node} is not a real node of this cluster")
            real_faults[args.fault](local, node)
            print(f"{args.fault} {node}")
        return 0
    if args.fault == "cards":
        faults.cards(kubeconfig, args.node, args.cards)
        print(f"cards {args.node} {args.cards!r}")
        return 0
    action = {
        "node-down": faults.node_down,
        "node-up": faults.node_up,
        "node-delete": faults.node_delete,
        "daemon-down": faults.daemon_down,
        "daemon-up": faults.daemon_up,
    }[args.fault]
    for node in args.node:
        action(kubeconfig, node)
        print(f"{args.fault} {node}")
    return 0


def _sim(args: argparse.Namespace) -> int:
    import signal
    import threading

    from matrixpool.devcluster import cluster, sim

    if os.geteuid() != 0:
        print(
            "matrixpool sim runs pods in mount namespaces of their own, as a container runtime "
            "does: run it as root (sudo -E)",
            file=sys.stderr,
        )
        return 2
    folder = args.folder or cluster.default_folder() / "sim"
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    kubeconfig = os.environ.get("KUBECONFIG")
    simulation = sim.Sim(
        Path(kubeconfig) if kubeconfig else cluster.Cluster().kubeconfig,
        folder,
        frozenset(args.supernode),
        **({"port": args.port} if args.port else {}),
        **({"memory_path": args.memory_path} if args.memory_path else {}),
        **({"image": args.image} if args.image else {}),
        daemons_from=args.daemons,
        shared_paths=tuple(args.shared_path),
        **({"persistent_root": args.persistent_root} if args.persistent_root else {}),
        **({"kv_pool_bytes": args.kv_pool_bytes} if args.kv_pool_bytes else {}),
        namespace=args.namespace,
    )
    print(
        f"simulating nodes of {', '.join(args.supernode) or 'every supernode'}; "
        f"data and logs in {folder}",
        file=sys.stderr,
        flush=True,
    )
    simulation.run(stop)
    return 0


def _announce(args: argparse.Namespace) -> int:
    import signal
    import threading

    from matrixpool.k8s import client, daemonleases

    if not 4 <= args.lease_seconds <= 3600:
        print("--lease-seconds must be between 4 and 3600", file=sys.stderr)
        return 2
    stop = threading.Event()  # SIGTERM: the pod is being deleted (a rollout, an upgrade)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    daemonleases.run(
        client.from_kubeconfig(None),
        args.namespace,
        args.node,
        args.endpoint,
        duration=args.lease_seconds,
        stopped=stop.is_set,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from matrixpool.devcluster import demo

    return demo.run(keep=args.keep, fast=args.fast, summary_json=args.summary_json)


if __name__ == "__main__":
    raise SystemExit(main())
