"""The shape of the simulated machine: supernodes × nodes × cards, grouped in racks.

Pure: turns a :class:`Shape` into the Node objects (dicts) that ``cluster up`` creates. Names and
labels follow DESIGN.md: nodes of supernode i carry ``matrixpool.dev/supernode=sn-<i>`` and
``matrixpool.dev/rack=sn-<i>-rack-<j>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matrixpool.api import labels

KWOK_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class Shape:
    """How many supernodes, nodes and cards to simulate."""

    supernodes: int = 1
    nodes_per_supernode: int = 48
    cards_per_node: int = 8
    nodes_per_rack: int = 4
    card_resource: str = "huawei.com/Ascend910"

    def __post_init__(self) -> None:
        for name in ("supernodes", "nodes_per_supernode", "cards_per_node", "nodes_per_rack"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")

    @property
    def node_count(self) -> int:
        return self.supernodes * self.nodes_per_supernode


def node_name(supernode: int, index: int) -> str:
    return f"sn-{supernode}-node-{index:02d}"


def nodes(shape: Shape) -> list[dict[str, Any]]:
    """The Node objects of ``shape``, in name order."""
    return [
        node(shape, sn, i)
        for sn in range(shape.supernodes)
        for i in range(shape.nodes_per_supernode)
    ]


def node(shape: Shape, supernode: int, index: int) -> dict[str, Any]:
    name = node_name(supernode, index)
    resources = {
        "cpu": "192",
        "memory": "1536Gi",
        "pods": "110",
        shape.card_resource: str(shape.cards_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                labels.SUPERNODE: f"sn-{supernode}",
                labels.RACK: f"sn-{supernode}-rack-{index // shape.nodes_per_rack}",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
        "status": {
            "capacity": resources,
            "allocatable": dict(resources),
            "addresses": [
                {"type": "InternalIP", "address": node_address(shape, supernode, index)},
                {"type": "Hostname", "address": name},
            ],
        },
    }


def node_address(shape: Shape, supernode: int, index: int) -> str:
    """A loopback address of the node's own (127.1.0.1 on): where ``matrixpool sim`` runs its
    checkpoint daemon, and the ``hostIP`` of its pods (kwok takes it from the node)."""
    number = supernode * shape.nodes_per_supernode + index
    return f"127.{1 + number // 62500}.{number // 250 % 250}.{number % 250 + 1}"
