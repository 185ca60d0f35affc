"""The ``matrixpool.dev/restore`` pod annotation: what a rank restores, and the incarnation it
runs as from then on. The operator writes it (a recovery's plan, a resume after a preemption
or a time-sharing window); the trainers read it (:mod:`matrixpool_recovery.client` users, the
dev cluster's trainers), which is why it ships here, in the package of the training images.

``{"step": 120, "of": 7, "incarnation": 9, "from": ["10.0.0.7:7040"], "recovery": "r3"}`` —
the step (or absent for "the newest committed"), the incarnation that wrote it, the new
incarnation the rank runs as from now on (:func:`new_incarnation`), the daemons that hold
copies (beyond the rank's own node daemon), and the id of the recovery or resume that asked (a
new id makes the trainers reload, even at the same step). After a regroup (the gang's size
changed) it also says ``"world": 40``, the number of ranks that wrote the step: a rank of the
new world reads shard :func:`shard_for` of it (its own when it has one), and a trainer whose
state is sharded (DCP) reshards from the whole step. ``{"fresh": true, "incarnation": 9,
"recovery": "r1"}`` tells a rank of a job that had no checkpoint yet to start again from step 0
as the new incarnation, reading nothing. The plain forms ``latest`` and ``<step>`` are read too.

A pod sees its annotations in the downward-API file ``MATRIXPOOL_ANNOTATIONS_FILE``
(``key="value"`` lines, replaced whole by the kubelet): :func:`read_annotations` reads it, and
:data:`ANNOTATION` is this annotation's key in it (``matrixpool.api.labels.RESTORE``; the
training images' package does not import the operator's).

Errors: :func:`parse_restore` raises ValueError for a value it cannot read (:func:`restore_id`
reads such a value as naming no recovery); :func:`restore_value` raises ValueError for a fresh
start that names a step.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ANNOTATION = "matrixpool.dev/restore"  # the pod annotation this module reads and writes


@dataclass(frozen=True)
class Restore:
    """What a rank restores: ``step`` None means the newest step committed for every rank."""

    step: int | None
    sources: tuple[str, ...] = ()  # daemon endpoints holding copies, beyond the rank's own
    recovery: str = ""  # id of the recovery or resume that asked
    incarnation: int | None = None  # the incarnation the rank runs as after restoring
    of: int | None = None  # the incarnation that wrote ``step``
    fresh: bool = False  # no checkpoint yet: start from step 0, read nothing
    world: int | None = None  # ranks that wrote ``step`` when not the reader's world (a regroup)


def shard_for(rank: int, world: int | None) -> int:
    """The shard of a step written by ``world`` ranks that ``rank`` restores: its own when that
    world had it, else ``rank % world`` (data-parallel ranks hold equal replicas, so any rank's
    shard is the state a new rank needs)."""
    if not world or rank < world:
        return rank
    return rank % world


def new_incarnation(incarnations: Iterable[int], now: datetime.datetime) -> int:
    """A number for the next run of a job, above every incarnation its shards carry
    (``incarnations``): the decision's time in milliseconds, so that it grows across operator
    restarts too."""
    newest = max(incarnations, default=0)
    return max(int(now.timestamp() * 1000), newest + 1)


def restore_value(
    step: int | None,
    sources: Iterable[str] = (),
    recovery_id: str = "",
    *,
    incarnation: int | None = None,
    of: int | None = None,
    fresh: bool = False,
    world: int | None = None,
) -> str:
    """The annotation value for a rank to restore ``step`` (written by incarnation ``of``)
        from ``sources`` and run on as ``incarnation``; ``fresh``: to start from step 0 instead
        (``step`` must be None: the job has no checkpoint yet); ``world``: the ranks that wrote
    ``step``, when a regroup changed the gang's size since."""
    if fresh and step is not None:
        raise ValueError(f"a fresh start restores no step (got {step})")
    body: dict[str, object] = {"from": sorted(set(sources))}
    if fresh:
        body["fresh"] = True
    if step is not None:
        body["step"] = step
    if recovery_id:
        body["recovery"] = recovery_id
    if incarnation is not None:
        body["incarnation"] = incarnation
    if of is not None and step is not None:
        body["of"] = of
    if world is not None and step is not None:
        body["world"] = world
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def parse_restore(value: str | None) -> Restore | None:
    """The annotation read back; also accepts the plain forms ``latest`` and ``<step>``."""
    if not value:
        return None
    text = value.strip()
    if text == "latest":
        return Restore(None)
    if text.isdigit():
        return Restore(int(text))
    try:
        body = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{value!r} is not JSON, 'latest' or a step") from err
    if not isinstance(body, dict):
        raise ValueError(f"{value!r} is not a JSON object")
    step = body.get("step")
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ValueError(f"restore step {step!r} must be a whole number >= 0")
    sources = body.get("from") or []
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise ValueError("restore 'from' must be a list of host:port strings")
    numbers = {k: body.get(k) for k in ("incarnation", "of", "world")}
    for key, number in numbers.items():
        if number is not None and (not isinstance(number, int) or number < 0):
            raise ValueError(f"restore {key!r} {number!r} must be a whole number >= 0")
    if numbers["world"] == 0:
        raise ValueError("restore 'world' must be at least 1")
    fresh = body.get("fresh", False)
    if not isinstance(fresh, bool) or (fresh and step is not None):
        raise ValueError(
            f"restore 'fresh' {fresh!r} must be a boolean, and true only without a step"
        )
    return Restore(
        step,
        tuple(sources),
        str(body.get("recovery") or ""),
        numbers["incarnation"],
        numbers["of"],
        fresh,
        numbers["world"],
    )


def restore_id(value: str | None) -> str:
    """The id of the recovery or resume a restore annotation names ("" when none, or when the
    value cannot be read)."""
    try:
        parsed = parse_restore(value)
    except ValueError:
        return ""
    return parsed.recovery if parsed else ""


def read_annotations(path: str | Path | None) -> dict[str, str]:
    """A downward-API annotations file (``key="value"`` lines, the values JSON strings); {}
    when there is none or it cannot be read (the kubelet may be replacing it)."""
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            try:
                found[key] = str(json.loads(value))
            except ValueError:
                continue
    return found
