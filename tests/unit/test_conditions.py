"""Status conditions follow the API conventions: the transition time moves only on change."""

from __future__ import annotations

import datetime

from matrixpool.k8s import conditions

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def test_a_new_condition_gets_the_current_time() -> None:
    [c] = conditions.set_condition(
        None, type="Ready", status=True, reason="R", message="m", generation=3, now=T0
    )
    assert c == {
        "type": "Ready",
        "status": "True",
        "reason": "R",
        "message": "m",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
        "observedGeneration": 3,
    }


def test_same_status_keeps_the_transition_time_but_updates_the_message() -> None:
    first = conditions.set_condition(
        None, type="Ready", status=True, reason="R", message="a", generation=1, now=T0
    )
    [c] = conditions.set_condition(
        first, type="Ready", status=True, reason="R", message="b", generation=2, now=T1
    )
    assert c["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert (c["message"], c["observedGeneration"]) == ("b", 2)


def test_a_flip_moves_the_transition_time_and_keeps_other_conditions() -> None:
    start = [
        {"type": "Other", "status": "True"},
        *conditions.set_condition(
            None, type="Ready", status=True, reason="R", message="", generation=None, now=T0
        ),
    ]
    result = conditions.set_condition(
        start, type="Ready", status=False, reason="Down", message="", generation=None, now=T1
    )
    assert result[0] == {"type": "Other", "status": "True"}
    assert result[1]["lastTransitionTime"] == "2026-01-01T00:05:00Z"
    assert conditions.find(result, "Ready") == result[1]
