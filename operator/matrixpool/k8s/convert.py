"""Conversions from raw API objects (dicts as kopf delivers them) to the pure records of
:mod:`matrixpool.placement.inventory`. Called by the handlers' indexes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from matrixpool.api import labels as names
from matrixpool.placement import inventory

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def node_info(
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
) -> inventory.NodeInfo:
    """A Node as the inventory sees it: Ready and schedulable, its extended resources (cards),
    and the card indices a device plugin or a person marked unhealthy."""
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    unhealthy, _ = inventory.parse_card_list(annotations.get(names.UNHEALTHY_CARDS))
    return inventory.NodeInfo(
        name=inventory.NodeName(name),
        labels=dict(labels),
        ready=ready and not spec.get("unschedulable", False),
        cards=extended_resources(status.get("allocatable") or {}),
        unhealthy=unhealthy,
    )


def extended_resources(resources: Mapping[str, Any]) -> dict[str, int]:
    """The ``domain/name`` resources of a resource list, as whole numbers."""
    counts: dict[str, int] = {}
    for key, value in resources.items():
        if "/" in key:
            try:
                counts[key] = int(str(value))
            except ValueError:
                continue
    return counts


def pod_cards(spec: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, int] | None:
    """Extended resources a bound, live pod holds on its node, or None if it holds none."""
    if not spec.get("nodeName") or status.get("phase") in TERMINAL_PHASES:
        return None
    held: dict[str, int] = {}
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        requested = resources.get("requests") or resources.get("limits") or {}
        for key, count in extended_resources(requested).items():
            held[key] = held.get(key, 0) + count
    return held or None
