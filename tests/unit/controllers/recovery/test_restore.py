"""What a recovering job's new pods are told: the plan's hand-off
(:class:`matrixpool.state.decisions.RecoveryPlan`) read by the scheduling cycle's ``pin``, and
the ``matrixpool.dev/restore`` annotation (:mod:`matrixpool_recovery.restore`)."""

from __future__ import annotations

import pytest

from matrixpool.controllers.scheduling import gangpods
from matrixpool.state import decisions as decided
from matrixpool_recovery import restore as restore_codec


def test_a_recovering_jobs_new_pod_is_reserved_on_its_target_and_told_what_to_restore() -> None:
    plan = decided.RecoveryPlan.read(
        {
            "level": "SpareSwap",
            "cause": "NodeNotReady on n1",
            "detectedAt": "2026-12-03T12:00:00Z",
            "targets": {"1": "spare-0"},
            "cards": {"1": "0,1,2,3"},
            "restore": {"0": '{"step":8}', "1": '{"from":["a:7040"],"step":8}'},
        }
    )
    moved = gangpods.pin({"metadata": {"labels": {"matrixpool.dev/rank": "1"}}}, plan)
    assert moved["metadata"]["annotations"] == {
        "matrixpool.dev/restore": '{"from":["a:7040"],"step":8}',
        "matrixpool.dev/node": "spare-0",
        "matrixpool.dev/cards": "0,1,2,3",
    }
    stayed = gangpods.pin({"metadata": {"labels": {"matrixpool.dev/rank": "0"}}}, plan)
    assert stayed["metadata"]["annotations"] == {"matrixpool.dev/restore": '{"step":8}'}
    untouched = gangpods.pin({"metadata": {"labels": {"matrixpool.dev/rank": "0"}}}, None)
    assert "annotations" not in untouched["metadata"]


@pytest.mark.parametrize(
    ("value", "step", "sources", "recovery_id"),
    [
        ("latest", None, (), ""),
        ("12", 12, (), ""),
        ('{"step": 8, "from": ["a:1", "b:2"], "recovery": "r1"}', 8, ("a:1", "b:2"), "r1"),
        ('{"from": []}', None, (), ""),
    ],
)
def test_the_restore_annotation_reads_back(
    value: str, step: int | None, sources: tuple[str, ...], recovery_id: str
) -> None:
    assert restore_codec.parse_restore(value) == restore_codec.Restore(step, sources, recovery_id)


def test_the_restore_annotation_round_trips_and_rejects_nonsense() -> None:
    written = restore_codec.restore_value(8, ["b:2", "a:1", "a:1"], "r3")
    assert written == '{"from":["a:1","b:2"],"recovery":"r3","step":8}'
    assert restore_codec.parse_restore(written) == restore_codec.Restore(8, ("a:1", "b:2"), "r3")
    assert restore_codec.parse_restore("") is None
    for bad in ("{", "[1]", '{"step": -1}', '{"from": "a:1"}'):
        with pytest.raises(ValueError, match=r"JSON|step|from"):
            restore_codec.parse_restore(bad)
