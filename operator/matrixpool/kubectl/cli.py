"""The ``kubectl-matrixpool`` command (``kubectl matrixpool ...``; ``matrixpool status|cards|
jobs|recoveries`` delegate here): reads the API with the kubernetes client, hands the objects to
:mod:`matrixpool.kubectl.report`, prints what :mod:`matrixpool.kubectl.render` draws.

Commands::

    status                      cards per supernode: inference / training / spare / unhealthy / free
    cards SN [--png FILE]       the card map of one supernode, coloured by owner
    jobs [-n NS | -A]           TrainingJobs and InferenceServices
    recoveries JOB -n NS        the recovery timeline of a TrainingJob
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import kubernetes

from matrixpool import api as mp_api
from matrixpool.api import labels
from matrixpool.k8s import client as k8s_client
from matrixpool.kubectl import render, report

PLURALS = {"sn": "supernodes", "tj": "trainingjobs", "infer": "inferenceservices"}
COMMANDS = ("status", "cards", "jobs", "recoveries")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not getattr(args, "handler", None):
        _parser().print_help()
        return 2
    try:
        result: int = args.handler(args)
    except Exception as error:  # a clean message instead of a traceback for users
        if os.environ.get("MATRIXPOOL_DEBUG"):
            raise
        print(f"kubectl-matrixpool: error: {_message(error)}", file=sys.stderr)
        return 1
    return result


def _message(error: Exception) -> str:
    reason = getattr(error, "reason", None)
    status = getattr(error, "status", None)
    return f"{status} {reason}" if status and reason else str(error)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: $KUBECONFIG)")
    parser = argparse.ArgumentParser(
        prog="kubectl-matrixpool",
        description=__doc__,
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(title="commands")
    status = commands.add_parser("status", parents=[common], help="cards by owner per supernode")
    status.set_defaults(handler=_status)
    cards = commands.add_parser("cards", parents=[common], help="card map of a supernode")
    cards.add_argument("supernode")
    cards.add_argument("--png", type=Path, metavar="FILE", help="also write the map as a PNG")
    colors = cards.add_mutually_exclusive_group()
    colors.add_argument("--color", action="store_true", default=None, help="force ANSI colours")
    colors.add_argument("--no-color", dest="color", action="store_false", help="no colours")
    cards.set_defaults(handler=_cards)
    jobs = commands.add_parser("jobs", parents=[common], help="training jobs and services")
    _namespace_options(jobs, all_namespaces=True)
    jobs.set_defaults(handler=_jobs)
    recoveries = commands.add_parser("recoveries", parents=[common], help="recovery timeline")
    recoveries.add_argument("job")
    _namespace_options(recoveries, all_namespaces=False)
    recoveries.set_defaults(handler=_recoveries)
    return parser


def _namespace_options(parser: argparse.ArgumentParser, *, all_namespaces: bool) -> None:
    parser.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig's)")
    if all_namespaces:
        parser.add_argument("-A", "--all-namespaces", action="store_true")


# --- commands -------------------------------------------------------------------------------
def _status(args: argparse.Namespace) -> int:
    with _connected(args) as api:
        nodes, pods = _nodes(api), _gang_pods(api)
        rows = report.status_rows(_custom(api, PLURALS["sn"]), nodes, pods)
    print(render.status_table(rows) if rows else "no supernodes")
    return 0


def _cards(args: argparse.Namespace) -> int:
    with _connected(args) as api:
        body = _supernode(api, args.supernode)
        cards = report.card_map(body, _nodes(api), _gang_pods(api))
    color = sys.stdout.isatty() if args.color is None else args.color
    print(render.card_map_text(cards, color=color))
    if args.png:
        render.write_png(cards, args.png)
        counts = cards.counts()
        print(f"wrote {args.png}: " + ", ".join(f"{o.value} {counts[o]}" for o in report.Owner))
    return 0


def _jobs(args: argparse.Namespace) -> int:
    namespace = None if args.all_namespaces else _namespace(args)
    with _connected(args) as api:
        training = _custom(api, PLURALS["tj"], namespace)
        inference = _custom(api, PLURALS["infer"], namespace)
        rows = report.job_rows(training, inference, _gang_pods(api, namespace))
    print(render.jobs_table(rows) if rows else "no training jobs or inference services")
    return 0


def _recoveries(args: argparse.Namespace) -> int:
    namespace = _namespace(args)
    with _connected(args) as api:
        body = _training_job(api, namespace, args.job)
    print(render.recoveries_text(args.job, report.recovery_rows(body)))
    return 0


# --- reading the API --------------------------------------------------------------------------
@contextlib.contextmanager
def _connected(args: argparse.Namespace) -> Iterator[k8s_client.Api]:
    """Clients for the chosen kubeconfig, closed afterwards."""
    api = k8s_client.from_kubeconfig(args.kubeconfig)
    try:
        yield api
    finally:
        api.client.close()


def _namespace(args: argparse.Namespace) -> str:
    """-n, else the kubeconfig context's namespace, else ``default``."""
    if args.namespace:
        return str(args.namespace)
    config: Any = kubernetes.config  # the loaders are untyped
    try:
        _, context = config.list_kube_config_contexts(
            config_file=str(args.kubeconfig) if args.kubeconfig else None
        )
    except config.ConfigException:
        return "default"
    return str((context or {}).get("context", {}).get("namespace") or "default")


def _nodes(api: k8s_client.Api) -> list[dict[str, Any]]:
    return _items(api.core.list_node(_preload_content=False))


def _gang_pods(api: k8s_client.Api, namespace: str | None = None) -> list[dict[str, Any]]:
    """Pods labelled matrixpool.dev/job."""
    if namespace is None:
        response = api.core.list_pod_for_all_namespaces(
            label_selector=labels.JOB, _preload_content=False
        )
    else:
        response = api.core.list_namespaced_pod(
            namespace, label_selector=labels.JOB, _preload_content=False
        )
    return _items(response)


def _items(response: Any) -> list[dict[str, Any]]:
    """The items of a raw list response, as the API's JSON (camelCase, like kubectl -o json)."""
    try:
        body: dict[str, Any] = json.loads(response.data)
    finally:
        response.release_conn()
    return list(body.get("items") or [])


def _supernode(api: k8s_client.Api, name: str) -> dict[str, Any]:
    body: dict[str, Any] = api.custom.get_cluster_custom_object(
        mp_api.GROUP, mp_api.VERSION, PLURALS["sn"], name
    )
    return body


def _training_job(api: k8s_client.Api, namespace: str, name: str) -> dict[str, Any]:
    body: dict[str, Any] = api.custom.get_namespaced_custom_object(
        mp_api.GROUP, mp_api.VERSION, namespace, PLURALS["tj"], name
    )
    return body


def _custom(api: k8s_client.Api, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
    """Every object of a matrixpool kind, in one namespace or all."""
    group, version = mp_api.GROUP, mp_api.VERSION
    if namespace is None:
        body = api.custom.list_cluster_custom_object(group, version, plural)
    else:
        body = api.custom.list_namespaced_custom_object(group, version, namespace, plural)
    return list(body.get("items") or [])
