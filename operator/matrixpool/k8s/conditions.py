"""Kubernetes-style status conditions (``type``, ``status``, ``reason``, ``message``,
``lastTransitionTime``, ``observedGeneration``), merged the way the API conventions ask:
``lastTransitionTime`` moves only when ``status`` changes. Pure; used by every handler.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any


def set_condition(
    conditions: Iterable[Mapping[str, Any]] | None,
    *,
    type: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """``conditions`` with the one of ``type`` set; the others kept in order."""
    wanted = "True" if status else "False"
    result: list[dict[str, Any]] = []
    found = False
    for old in conditions or ():
        if old.get("type") != type:
            result.append(dict(old))
            continue
        found = True
        changed = old.get("status") != wanted
        result.append(
            _condition(
                type,
                wanted,
                reason,
                message,
                generation,
                _stamp(now) if changed else old.get("lastTransitionTime"),
            )
        )
    if not found:
        result.append(_condition(type, wanted, reason, message, generation, _stamp(now)))
    return result


def find(conditions: Iterable[Mapping[str, Any]] | None, type: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type), None)


def _condition(
    type: str, status: str, reason: str, message: str, generation: int | None, when: str | None
) -> dict[str, Any]:
    condition: dict[str, Any] = {
        "type": type,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": when,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def _stamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
