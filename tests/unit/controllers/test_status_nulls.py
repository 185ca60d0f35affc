"""Status fields that went away are written as null, so the API server's merge patch drops them
(common.replacing): a SuperNode whose time sharing was removed, a gang with no pod bound."""

from __future__ import annotations

from typing import Any

from matrixpool.api import supernode
from matrixpool.controllers import supernode as supernode_controller
from matrixpool.controllers.scheduling import status


def test_a_supernode_without_time_sharing_writes_its_old_window_as_gone() -> None:
    body: dict[str, Any] = {
        "metadata": {"name": "sn-0", "generation": 2},
        "spec": {
            "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": "sn-0"}},
            "cardResource": "huawei.com/Ascend910",
            "cardsPerNode": 8,
        },
        "status": {"window": "night", "nextTransition": "2026-12-06T07:00:00Z"},
    }
    sn = supernode.SuperNode.model_validate(body)
    facts = supernode_controller.Facts(nodes=[], held={}, selectors={}, members={"sn-0": []})
    wire = supernode_controller.desired_status("sn-0", sn, facts)
    assert "window" in wire
    assert wire["window"] is None
    assert "nextTransition" in wire
    assert wire["nextTransition"] is None
    merged = {k: v for k, v in {**body["status"], **wire}.items() if v is not None}  # RFC 7386
    assert "window" not in merged
    assert "nextTransition" not in merged


def test_a_gang_with_no_pod_bound_writes_its_supernode_as_gone() -> None:
    placed = status._placement_summary([("n1", frozenset({0, 1}))], {"n1": "sn-0"})
    assert placed["superNode"] == "sn-0"
    assert placed["cards"] == 2
    gone = status._placement_summary([], {})
    assert "superNode" in gone
    assert gone["superNode"] is None
    assert gone["nodes"] == []
    assert gone["cards"] == 0
