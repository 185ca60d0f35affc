"""Fault injection on the local cluster, for tests, the demo and users' chaos drills.

``node-down``/``node-up`` flip a node's Ready condition through kwok (the stage in
kwok-stages.yaml reacts to the annotation ``matrixpool.dev/fault``); ``node-delete`` removes the
Node; ``cards`` writes ``matrixpool.dev/unhealthy-cards`` as a device plugin would;
``daemon-down``/``daemon-up`` tell ``matrixpool sim`` to kill a node's checkpoint daemon and
keep it down (annotation ``matrixpool.dev/fault-daemon``), the node itself staying Ready.
"""

from __future__ import annotations

import re
from pathlib import Path

from matrixpool.api import labels
from matrixpool.k8s import client as k8s_client

FAULT_ANNOTATION = "matrixpool.dev/fault"
DAEMON_FAULT_ANNOTATION = "matrixpool.dev/fault-daemon"  # "down": matrixpool sim runs no daemon
CARD_LIST = re.compile(r"^(\d+(,\d+)*)?$")


class FaultError(ValueError):
    """A fault could not be injected (unknown node, bad card list)."""


def node_down(kubeconfig: Path, node: str) -> None:
    _annotate(kubeconfig, node, {FAULT_ANNOTATION: "node-down"})


def node_up(kubeconfig: Path, node: str) -> None:
    _annotate(kubeconfig, node, {FAULT_ANNOTATION: None})


def daemon_down(kubeconfig: Path, node: str) -> None:
    """``matrixpool sim`` kills the node's checkpoint daemon and starts none while this holds."""
    _annotate(kubeconfig, node, {DAEMON_FAULT_ANNOTATION: "down"})


def daemon_up(kubeconfig: Path, node: str) -> None:
    _annotate(kubeconfig, node, {DAEMON_FAULT_ANNOTATION: None})


def node_delete(kubeconfig: Path, node: str) -> None:
    api = k8s_client.from_kubeconfig(kubeconfig)
    try:
        api.core.delete_node(node)
    except Exception as error:
        if k8s_client.is_status(error, 404):
            raise FaultError(f"node {node!r} not found") from error
        raise


def cards(kubeconfig: Path, node: str, card_list: str) -> None:
    """Mark ``card_list`` ("3,5") unhealthy on ``node``; an empty list heals the node."""
    card_list = card_list.replace(" ", "")
    if not CARD_LIST.match(card_list):
        raise FaultError(f"card list {card_list!r} must be comma-separated card indices, e.g. 3,5")
    _annotate(kubeconfig, node, {labels.UNHEALTHY_CARDS: card_list or None})


def _annotate(kubeconfig: Path, node: str, annotations: dict[str, str | None]) -> None:
    api = k8s_client.from_kubeconfig(kubeconfig)
    try:
        api.core.patch_node(node, {"metadata": {"annotations": annotations}})
    except Exception as error:
        if k8s_client.is_status(error, 404):
            raise FaultError(f"node {node!r} not found") from error
        raise
