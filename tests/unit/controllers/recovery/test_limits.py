"""Large jobs and long runs: one bound (``trainingjob.MAX_RANKS``) for spec.replicas and every
per-rank field of a recovery plan, so a Reschedule of more than 4,096 ranks is written like any
other (the model and the generated CRD schema both take it); status.recoveries keeps the newest
``KEPT_RECOVERIES`` with ``recoveryCount`` counting all (what maxRecoveries compares against);
and a job whose recovery step keeps failing backs off exponentially, by UID."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import pydantic
import pytest

from matrixpool.api import common, crdgen, trainingjob
from matrixpool.controllers.recovery import carry_out, decide
from matrixpool.controllers.recovery import memory as recovery_memory
from matrixpool.k8s import daemonclient
from matrixpool.state.workloads import Workload
from matrixpool_recovery import policy

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
BIG = 4097  # one rank past the old bound of status.recovering.ranks


# --- a tiny checker of the structural OpenAPI subset crdgen emits --------------------------------
def violations(schema: Mapping[str, Any], value: Any, path: str = "") -> Iterator[str]:
    """What the API server's OpenAPI validation would reject in ``value`` (the keywords crdgen
    emits; CEL rules and formats aside)."""
    kind = schema["type"]
    python = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
    if kind in python and not isinstance(value, python[kind]):
        yield f"{path}: not {kind}"
        return
    for key, too_many in (("maxItems", len), ("maxProperties", len), ("maxLength", len)):
        if key in schema and too_many(value) > schema[key]:
            yield f"{path}: {key} {schema[key]} < {too_many(value)}"
    if "minimum" in schema and value < schema["minimum"]:
        yield f"{path}: below {schema['minimum']}"
    if "maximum" in schema and value > schema["maximum"]:
        yield f"{path}: above {schema['maximum']}"
    if "pattern" in schema and not re.search(schema["pattern"], value):
        yield f"{path}: does not match {schema['pattern']}"
    if "enum" in schema and value not in schema["enum"]:
        yield f"{path}: not in {schema['enum']}"
    yield from _children(schema, value, path)


def _children(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[str]:
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield from violations(schema["items"], item, f"{path}[{i}]")
    if not isinstance(value, dict):
        return
    for name in schema.get("required", []):
        if name not in value:
            yield f"{path}.{name}: required"
    for name, item in value.items():
        sub = schema.get("properties", {}).get(name) or schema.get("additionalProperties")
        if sub is None:
            yield f"{path}.{name}: unknown field"
        else:
            yield from violations(sub, item, f"{path}.{name}")


def status_schema() -> dict[str, Any]:
    crd = crdgen.crd(trainingjob.RESOURCE)
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return dict(schema["properties"]["status"])


# --- a 4,097-rank recovery plan ---------------------------------------------------------------
def big_job(namespace: str = "ns", name: str = "big") -> Workload:
    body = {
        "metadata": {"name": name, "namespace": namespace, "uid": "u-big"},
        "spec": {"replicas": BIG, "cardsPerReplica": 1},
    }
    return Workload(
        kind=trainingjob.KIND,
        namespace=namespace,
        name=name,
        uid="u-big",
        created="",
        generation=1,
        model=trainingjob.parse(body),
        error=None,
        status={},
    )


def reschedule_plan(ranks: int, namespace: str = "ns", name: str = "big") -> dict[str, Any]:
    """status.recovering of a Reschedule of every rank, as the recovery handler writes it
    (the integration test writes it into a real object's status)."""
    node_of = {r: policy.NodeName(f"sn-0-node-{r // 8:02d}") for r in range(ranks)}
    view = policy.JobView(
        key=f"{namespace}/{name}",
        world_size=ranks,
        node_of=node_of,
        cards_of={},
        rack_of={},
        supernode_of={},
    )
    plan = policy.Plan(
        level=policy.Level.RESCHEDULE,
        cause="NodeDown on sn-0-node-00",
        ranks=frozenset(range(ranks)),
        targets={},
        sources={r: policy.Copy(r, 100, policy.Tier.PERSISTENT, None) for r in range(ranks)},
        restored_step=100,
        lost_steps=5,
        reason="the whole job is placed again",
    )
    job = big_job(namespace, name)
    return decide.plan_record(job, plan, view, daemonclient.Inventory(), T0).wire()


def test_replicas_and_every_per_rank_bound_are_the_one_constant() -> None:
    schema = status_schema()["properties"]["recovering"]["properties"]
    spec = crdgen.crd(trainingjob.RESOURCE)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert spec["properties"]["spec"]["properties"]["replicas"]["maximum"] == trainingjob.MAX_RANKS
    assert schema["ranks"]["maxItems"] == trainingjob.RANKS_LISTED
    assert schema["rankCount"]["maximum"] == trainingjob.MAX_RANKS
    for field in ("targets", "cards", "restore", "moves"):
        assert schema[field]["maxProperties"] == trainingjob.MAX_RANKS, field


def test_a_4097_rank_recovery_plan_validates_against_the_model_and_the_crd_schema() -> None:
    plan = reschedule_plan(BIG)
    assert plan["rankCount"] == BIG
    assert plan["ranks"] == list(range(trainingjob.RANKS_LISTED))
    parsed = trainingjob.RecoveryInProgress.model_validate(plan)
    assert all(trainingjob.restore_for(parsed.restore, r) for r in range(BIG))
    status = {"phase": "Recovering", "recovering": plan}
    assert list(violations(status_schema(), status, ".status")) == []


def test_a_job_with_a_4097_rank_plan_in_status_still_parses() -> None:
    body = {
        "metadata": {"name": "big", "namespace": "ns"},
        "spec": {"replicas": BIG, "cardsPerReplica": 1},
        "status": {"recovering": reschedule_plan(BIG)},
    }
    job = trainingjob.parse(body)
    assert job.status.recovering is not None
    assert job.status.recovering.rank_count == BIG


def test_the_schema_checker_sees_a_plan_past_the_bound() -> None:
    schema = {**status_schema()}
    recovering = schema["properties"]["recovering"]
    ranks = {**recovering["properties"]["ranks"], "maxItems": 10}
    plan = reschedule_plan(11) | {"ranks": list(range(11))}
    schema["properties"] = {
        **schema["properties"],
        "recovering": {**recovering, "properties": {**recovering["properties"], "ranks": ranks}},
    }
    found = list(violations(schema, {"recovering": plan}, ".status"))
    assert found == [".status.recovering.ranks: maxItems 10 < 11"]


def test_replicas_past_the_bound_and_ranks_outside_it_are_rejected() -> None:
    with pytest.raises(pydantic.ValidationError):
        trainingjob.parse_spec({"replicas": trainingjob.MAX_RANKS + 1, "cardsPerReplica": 1})
    with pytest.raises(pydantic.ValidationError):
        trainingjob.RecoveryRecord(
            level=trainingjob.RecoveryLevel.IN_PLACE,
            cause="PodFailed",
            detected_at=T0,
            ranks=[trainingjob.MAX_RANKS],
        )


# --- status.recoveries: the newest KEPT_RECOVERIES, and a total ----------------------------------
def entry(i: int) -> dict[str, Any]:
    return common.to_wire(
        trainingjob.RecoveryRecord(
            id=f"r{i}", level=trainingjob.RecoveryLevel.IN_PLACE, cause="PodFailed", detected_at=T0
        )
    )


KEPT = trainingjob.KEPT_RECOVERIES


@pytest.mark.parametrize(
    ("listed", "count", "kept_ids", "total"),
    [
        pytest.param(0, None, ["r0"], 1, id="the first recovery starts the count"),
        pytest.param(
            KEPT, KEPT, [f"r{i}" for i in range(1, KEPT + 1)], KEPT + 1,
            id="a full list drops its oldest entry",
        ),
        pytest.param(
            KEPT, 57, [f"r{i}" for i in range(1, KEPT + 1)], 58,
            id="the count goes on past the list",
        ),
        pytest.param(
            30, None, [f"r{i}" for i in range(11, 31)], 31,
            id="an object written before the bound is trimmed and counted",
        ),
    ],
)  # fmt: skip
def test_recorded_keeps_the_newest_entries_and_counts_them_all(
    listed: int, count: int | None, kept_ids: list[str], total: int
) -> None:
    status: dict[str, Any] = {"recoveries": [entry(i) for i in range(listed)]}
    if count is not None:
        status["recoveryCount"] = count
    patch = carry_out.recorded(status, entry(listed))
    assert [r["id"] for r in patch["recoveries"]] == kept_ids
    assert patch["recoveryCount"] == total
    assert list(violations(status_schema(), patch, ".status")) == []


@pytest.mark.parametrize("seen", [True, False], ids=["remembered", "listed"])
def test_a_recovery_recorded_already_is_neither_listed_nor_counted_twice(seen: bool) -> None:
    status = {"recoveries": [entry(0), entry(1)], "recoveryCount": 9}
    record = entry(2) if seen else entry(1)
    patch = carry_out.recorded(status, record, seen=seen)
    assert [r["id"] for r in patch["recoveries"]] == ["r0", "r1"]
    assert patch["recoveryCount"] == 9


def test_max_recoveries_compares_against_the_count_not_the_list() -> None:
    status = {"recoveries": [entry(i) for i in range(KEPT)], "recoveryCount": 100}
    view = policy.JobView(
        key="ns/j",
        world_size=1,
        node_of={0: policy.NodeName("n0")},
        cards_of={0: frozenset({0})},
        rack_of={},
        supernode_of={},
        recoveries=carry_out.recovery_count(status),
        max_recoveries=50,
    )
    fault = policy.Fault(policy.FaultKind.POD_FAILED, policy.NodeName("n0"), ranks=frozenset({0}))
    outcome = policy.decide(fault, view, [], policy.Spares())
    assert isinstance(outcome, policy.Failed)
    assert outcome.code == "MaxRecoveriesReached"


def test_the_model_reads_an_overlong_list_as_its_newest_entries() -> None:
    status = trainingjob.parse_status({"recoveries": [entry(i) for i in range(KEPT + 5)]})
    assert [r.id for r in status.recoveries] == [f"r{i}" for i in range(5, KEPT + 5)]
    assert status_schema()["properties"]["recoveries"]["maxItems"] == KEPT


# --- backoff of a failing recovery step, per job UID ---------------------------------------------
@pytest.mark.parametrize(
    ("failures", "delay"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (9, 256.0), (10, 300.0), (5000, 300.0)],
    ids=lambda v: str(v),
)
def test_the_delay_doubles_from_one_second_up_to_five_minutes(failures: int, delay: float) -> None:
    assert recovery_memory.backoff_delay(failures) == delay


def test_failures_in_a_row_wait_longer_each_time_until_a_success_resets() -> None:
    state = recovery_memory.State()
    assert state.failed("u1", now=100.0) == 1.0
    assert state.backing_off("u1", now=100.5)
    assert not state.backing_off("u1", now=101.0)
    assert state.failed("u1", now=101.0) == 2.0
    assert state.failed("u1", now=103.0) == 4.0
    assert state.backing_off("u1", now=106.9)
    state.backoff.pop("u1")  # what run() does after a step that succeeds
    assert not state.backing_off("u1", now=106.9)
    assert state.failed("u1", now=107.0) == 1.0


def test_backoff_is_per_uid_and_a_recreated_job_starts_afresh() -> None:
    state = recovery_memory.State()
    state.failed("old-uid", now=0.0)
    state.failed("old-uid", now=1.0)
    assert not state.backing_off("new-uid", now=1.5)  # same namespace/name, another object
    state.forget("old-uid", "ns/j")  # the loop drops a job that went (Controllers.forget_replaced)
    assert state.backoff == {}


def test_a_plan_for_a_million_ranks_stays_far_below_the_api_object_size() -> None:
    """Ranks that restore the same value share one key: a Reschedule of MAX_RANKS ranks from
    tier 3 writes one restore entry, not one per rank."""
    plan = reschedule_plan(trainingjob.MAX_RANKS)
    assert len(json.dumps(plan)) < 4096
    assert list(plan["restore"]) == [f"0-{trainingjob.MAX_RANKS - 1}"]
    value = plan["restore"][f"0-{trainingjob.MAX_RANKS - 1}"]
    assert trainingjob.restore_for(plan["restore"], trainingjob.MAX_RANKS - 1) == value


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([], ""), ([3], "3"), ([0, 1, 2, 3, 7], "0-3,7"), ([9, 2, 3, 3], "2-3,9")],
)
def test_ranks_are_written_as_ranges(ranks: list[int], text: str) -> None:
    assert trainingjob.format_ranks(ranks) == text
    assert all(trainingjob.in_ranks(r, text) for r in ranks)
    assert not trainingjob.in_ranks(5, text)
