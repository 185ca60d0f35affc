"""The pydantic models of the API: they parse every example, fill in the documented defaults,
speak camelCase on the wire, enforce the field bounds, and their small helpers (windows,
selectors, conditions, card lists) behave as DESIGN.md says."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from matrixpool import api
from matrixpool.api import common, inferenceservice, labels, supernode, trainingjob

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
PARSERS: dict[str, Any] = {
    supernode.KIND: supernode.parse,
    trainingjob.KIND: trainingjob.parse,
    inferenceservice.KIND: inferenceservice.parse,
}
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def example(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLES / name).read_text()))


# --- examples ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_parses_into_its_model(path: Path) -> None:
    ours = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] in PARSERS]
    assert len(ours) == 1, "one matrixpool object per example (beside a script's ConfigMap)"
    [body] = ours
    assert body["apiVersion"] == api.API_VERSION
    parsed = PARSERS[body["kind"]](body)
    assert parsed.metadata.name == body["metadata"]["name"]
    assert common.to_wire(parsed.spec).keys() >= body["spec"].keys()


def test_there_is_an_example_of_every_kind() -> None:
    kinds = {d["kind"] for p in EXAMPLES.glob("*.yaml") for d in yaml.safe_load_all(p.read_text())}
    assert kinds >= set(PARSERS)


def test_the_deepseek_decode_role_is_ep320() -> None:
    spec = inferenceservice.parse(example("inferenceservice-deepseek.yaml")).spec
    decode = spec.role("decode")
    assert decode is not None
    assert decode.expert_parallel is not None
    assert decode.cards_per_replica == 320
    assert decode.expert_parallel.experts + decode.expert_parallel.redundant_experts == 320
    assert spec.ratio == {"prefill": 4, "decode": 1}


def test_the_cloudmatrix_windows_switch_at_eight_and_twenty_two() -> None:
    sharing = supernode.parse(example("supernode-cloudmatrix384.yaml")).spec.time_sharing
    assert sharing is not None
    assert sharing.window_at(8 * 60).name == "day"
    assert sharing.window_at(21 * 60 + 59).name == "day"
    assert sharing.window_at(22 * 60).name == "night"
    assert sharing.window_at(3 * 60).name == "night"


# --- defaults ------------------------------------------------------------------------------------
def minimal_job(**spec: Any) -> trainingjob.TrainingJobSpec:
    return trainingjob.parse_spec({"replicas": 8, "cardsPerReplica": 8, **spec})


def minimal_service(**role: Any) -> inferenceservice.InferenceServiceSpec:
    return inferenceservice.parse_spec(
        {"roles": [{"name": "decode", "replicas": 2, "cardsPerPod": 8, **role}]}
    )


def minimal_supernode(**spec: Any) -> supernode.SuperNodeSpec:
    selector = {"matchLabels": {labels.SUPERNODE: "sn-0"}}
    base = {"nodeSelector": selector, "cardResource": "huawei.com/Ascend910", "cardsPerNode": 8}
    return supernode.parse_spec({**base, **spec})


def test_training_minreplicas_defaults_to_replicas() -> None:
    assert minimal_job().min_replicas == 8
    assert minimal_job(minReplicas=2).min_replicas == 2


def test_training_defaults() -> None:
    spec = minimal_job()
    assert spec.priority == trainingjob.DEFAULT_PRIORITY == 100
    assert spec.placement.super_node_affinity is trainingjob.SuperNodeAffinity.REQUIRED
    assert spec.placement.group_size is None
    assert spec.recovery.max_recoveries == 10
    assert spec.recovery.levels == [
        trainingjob.RecoveryLevel.IN_PLACE,
        trainingjob.RecoveryLevel.SPARE_SWAP,
        trainingjob.RecoveryLevel.RESCHEDULE,
    ]
    assert spec.windows == []
    assert spec.template == {}
    assert spec.super_node is None
    assert spec.checkpoint == trainingjob.Checkpoint()
    assert spec.cards == 64


def test_inference_defaults_above_training() -> None:
    spec = minimal_service()
    assert spec.priority == inferenceservice.DEFAULT_PRIORITY == 1000
    assert spec.priority > trainingjob.DEFAULT_PRIORITY
    [role] = spec.roles
    assert (role.min_replicas, role.pods_per_replica, role.expert_parallel) == (2, 1, None)
    assert spec.ratio == {}


def test_expert_parallel_redundant_experts_default_to_zero() -> None:
    role = minimal_service(expertParallel={"experts": 8}).roles[0]
    assert role.expert_parallel == inferenceservice.ExpertParallel(experts=8, redundant_experts=0)


def test_supernode_defaults() -> None:
    spec = minimal_supernode()
    assert spec.spares.nodes == 0
    assert spec.card_groups == []
    assert spec.topology_keys == []
    assert spec.time_sharing is None
    window = {"name": "all", "start": "00:00", "end": "00:00", "inferenceCards": 8}
    sharing = minimal_supernode(timeSharing={"timezone": "UTC", "windows": [window]}).time_sharing
    assert sharing is not None
    assert sharing.checkpoint_grace_seconds == 120


@pytest.mark.parametrize(
    "parse_status",
    [supernode.parse_status, trainingjob.parse_status, inferenceservice.parse_status],
    ids=["SuperNode", "TrainingJob", "InferenceService"],
)
def test_a_missing_status_parses_to_an_empty_status(parse_status: Any) -> None:
    status = parse_status(None)
    assert status.conditions == []
    assert status.observed_generation is None


def test_a_fresh_training_job_is_pending() -> None:
    job = trainingjob.parse(example("trainingjob-llm.yaml"))
    assert job.status.phase is trainingjob.Phase.PENDING
    assert job.status.replicas == trainingjob.ReplicaCounts(desired=0, bound=0, running=0)


# --- the wire format -----------------------------------------------------------------------------
def test_fields_are_camel_case_on_the_wire_and_snake_case_in_python() -> None:
    spec = trainingjob.TrainingJobSpec(replicas=4, cards_per_replica=8)
    wire = common.to_wire(spec)
    assert wire["cardsPerReplica"] == 8
    assert wire["minReplicas"] == 4
    assert wire["placement"] == {"superNodeAffinity": "Required", "localityWaitSeconds": 0}
    assert "superNode" not in wire  # unset optionals are left out of patches
    assert trainingjob.parse_spec(wire) == spec


def test_status_round_trips_with_rfc3339_times() -> None:
    record = trainingjob.RecoveryRecord(
        level=trainingjob.RecoveryLevel.SPARE_SWAP,
        cause="NodeNotReady",
        restored_step=1200,
        lost_steps=7,
        detected_at=T0,
        recovered_at=T0 + datetime.timedelta(seconds=42),
    )
    status = trainingjob.TrainingJobStatus(phase=trainingjob.Phase.RUNNING, recoveries=[record])
    wire = common.to_wire(status)
    assert wire["recoveries"][0]["detectedAt"] == "2026-01-01T00:00:00Z"
    assert wire["recoveries"][0]["restoredStep"] == 1200
    assert trainingjob.parse_status(wire) == status
    assert record.duration == datetime.timedelta(seconds=42)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    spec = trainingjob.parse_spec({"replicas": 1, "cardsPerReplica": 1, "fromTheFuture": True})
    assert spec.replicas == 1


def test_the_role_summary_reads_ready_over_wanted() -> None:
    roles = [
        inferenceservice.RoleStatus(name="prefill", replicas=4, ready=3),
        inferenceservice.RoleStatus(name="decode", replicas=1, ready=1),
    ]
    assert inferenceservice.summarize_roles(roles) == "prefill 3/4, decode 1/1"


# --- bounds enforced by the models (the CRD carries the same, derived from them) -----------------
# fmt: off
BOUNDS: list[tuple[str, Any]] = [
    ("cardsPerNode above 64 is rejected", lambda: minimal_supernode(cardsPerNode=65)),
    ("cardsPerNode of zero is rejected", lambda: minimal_supernode(cardsPerNode=0)),
    ("a cardResource without a domain is rejected", lambda: minimal_supernode(cardResource="gpu")),
    ("negative spares are rejected", lambda: minimal_supernode(spares={"nodes": -1})),
    ("a window at 24:00 is rejected", lambda: supernode.TimeWindow(
        name="w", start="24:00", end="08:00", inference_cards=0)),
    ("a window at minute 60 is rejected", lambda: supernode.TimeWindow(
        name="w", start="08:60", end="09:00", inference_cards=0)),
    ("zero replicas are rejected", lambda: minimal_job(replicas=0)),
    ("zero cardsPerReplica are rejected", lambda: minimal_job(cardsPerReplica=0)),
    ("an unknown superNodeAffinity is rejected",
     lambda: minimal_job(placement={"superNodeAffinity": "Sometimes"})),
    ("an unknown recovery level is rejected", lambda: minimal_job(recovery={"levels": ["Pray"]})),
    ("a persistent uri without a scheme is rejected",
     lambda: minimal_job(checkpoint={"persistent": {"everySteps": 1, "uri": "/mnt"}})),
    ("more than eight roles are rejected", lambda: inferenceservice.parse_spec(
        {"roles": [{"name": f"r{i}", "replicas": 1, "cardsPerPod": 1} for i in range(9)]})),
    ("a ratio weight of zero is rejected", lambda: inferenceservice.parse_spec(
        {"roles": [{"name": "a", "replicas": 1, "cardsPerPod": 1}], "ratio": {"a": 0}})),
    ("zero experts are rejected", lambda: minimal_service(expertParallel={"experts": 0})),
    ("a condition status outside True/False/Unknown is rejected", lambda: common.Condition(
        type="Ready", status="Yes", reason="R", last_transition_time=T0)),
    ("a TPOT target of zero is rejected", lambda: inferenceservice.SloTargets(
        ttft_milliseconds=2000, tpot_milliseconds=0)),
    ("an unknown autoscaling mode is rejected", lambda: inferenceservice.Autoscaling.model_validate(
        {"mode": "Maybe", "targets": {"ttftMilliseconds": 1, "tpotMilliseconds": 1}})),
    ("a fractional KV cache size is rejected",
     lambda: inferenceservice.KvCache(bytes="0.5Gi")),
    ("a memory pool in millibytes is rejected",
     lambda: supernode.MemoryPool(per_node="100m")),
]
# fmt: on


@pytest.mark.parametrize("build", [pytest.param(b, id=i) for i, b in BOUNDS])
def test_out_of_bounds_values_are_rejected_by_the_model(build: Any) -> None:
    with pytest.raises(pydantic.ValidationError):
        build()


# --- time windows --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("start", "end", "minutes", "inside", "outside"),
    [
        pytest.param("08:00", "22:00", 14 * 60, "21:59", "22:00", id="a day window"),
        pytest.param("22:00", "08:00", 10 * 60, "00:30", "08:00", id="a window wrapping midnight"),
        pytest.param("06:00", "06:00", 24 * 60, "05:59", None, id="start equal to end is all day"),
    ],
)
def test_window_duration_and_membership(
    start: str, end: str, minutes: int, inside: str, outside: str | None
) -> None:
    window = supernode.TimeWindow(name="w", start=start, end=end, inference_cards=0)
    assert window.duration_minutes == minutes
    assert window.contains(supernode._to_minute(inside))
    assert window.contains(window.start_minute)
    if outside is not None:
        assert not window.contains(supernode._to_minute(outside))


# --- label selectors -----------------------------------------------------------------------------
NODE = {labels.SUPERNODE: "sn-0", labels.RACK: "r1"}


# fmt: off
SELECTORS: list[tuple[str, dict[str, Any], bool]] = [
    ("an equal label matches", {"matchLabels": {labels.SUPERNODE: "sn-0"}}, True),
    ("another value misses", {"matchLabels": {labels.SUPERNODE: "sn-1"}}, False),
    ("In matches", {"matchExpressions": [
        {"key": labels.RACK, "operator": "In", "values": ["r0", "r1"]}]}, True),
    ("NotIn misses", {"matchExpressions": [
        {"key": labels.RACK, "operator": "NotIn", "values": ["r1"]}]}, False),
    ("DoesNotExist matches a missing key", {"matchExpressions": [
        {"key": "gpu", "operator": "DoesNotExist"}]}, True),
    ("every requirement must hold", {"matchLabels": {labels.SUPERNODE: "sn-0"},
     "matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, False),
]
# fmt: on


@pytest.mark.parametrize(
    ("selector", "matches"), [pytest.param(s, m, id=i) for i, s, m in SELECTORS]
)
def test_label_selector_matches_like_kubernetes(selector: dict[str, Any], matches: bool) -> None:
    assert common.LabelSelector.model_validate(selector).matches(NODE) is matches


# --- conditions ----------------------------------------------------------------------------------
def ready(status: str, at: datetime.datetime, reason: str = "Pooled") -> common.Condition:
    return common.Condition(
        type=common.READY,
        status=common.ConditionStatus(status),
        reason=reason,
        last_transition_time=at,
    )


def test_set_condition_keeps_the_transition_time_when_status_is_unchanged() -> None:
    later = T0 + datetime.timedelta(minutes=5)
    [c] = common.set_condition([ready("True", T0)], ready("True", later, reason="Still"))
    assert (c.last_transition_time, c.reason) == (T0, "Still")


def test_set_condition_moves_the_transition_time_on_a_flip_and_keeps_others() -> None:
    later = T0 + datetime.timedelta(minutes=5)
    other = common.Condition(type="Other", status="True", reason="R", last_transition_time=T0)
    out = common.set_condition([other, ready("True", T0)], ready("False", later))
    assert common.find_condition(out, "Other") == other
    assert common.find_condition(out, common.READY) == ready("False", later)


# --- labels --------------------------------------------------------------------------------------
def test_card_lists_round_trip_sorted() -> None:
    assert labels.format_cards([3, 0, 1, 3]) == "0,1,3"
    assert labels.parse_cards("0, 1,3") == {0, 1, 3}
    assert labels.parse_cards(None) == frozenset() == labels.parse_cards("")


def test_a_negative_card_index_is_rejected() -> None:
    with pytest.raises(ValueError, match="negative"):
        labels.parse_cards("1,-2")


def test_label_names_are_those_of_the_design() -> None:
    assert labels.CARDS == "matrixpool.dev/cards"
    assert labels.UNHEALTHY_CARDS == "matrixpool.dev/unhealthy-cards"
    assert labels.CHECKPOINT_REQUEST == "matrixpool.dev/checkpoint-request"
    assert (labels.SUPERNODE, labels.RACK) == ("matrixpool.dev/supernode", "matrixpool.dev/rack")
    assert (labels.JOB, labels.ROLE, labels.RANK) == (
        "matrixpool.dev/job",
        "matrixpool.dev/role",
        "matrixpool.dev/rank",
    )


# --- layering ------------------------------------------------------------------------------------
def test_the_api_package_imports_neither_kopf_nor_kubernetes() -> None:
    code = (
        "import sys, matrixpool.api.crdgen, matrixpool.api.labels\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- byte quantities and autoscaling defaults --------------------------------------------------
@pytest.mark.parametrize(
    ("quantity", "size"),
    [
        pytest.param("1048576", 1 << 20, id="plain bytes"),
        pytest.param("64Gi", 64 << 30, id="a binary suffix"),
        pytest.param("500M", 500_000_000, id="a decimal suffix"),
        pytest.param("1k", 1000, id="a lowercase k"),
    ],
)
def test_byte_quantities_parse_as_kubernetes_reads_them(quantity: str, size: int) -> None:
    assert common.parse_bytes(quantity) == size
    assert inferenceservice.KvCache(bytes=quantity).size == size


@pytest.mark.parametrize("quantity", ["1.5Gi", "Gi", "100m", "-1", "1Mi1", "1 Gi"])
def test_anything_else_is_not_a_byte_quantity(quantity: str) -> None:
    with pytest.raises(ValueError, match="not a byte quantity"):
        common.parse_bytes(quantity)


def test_autoscaling_defaults_to_auto_with_hpa_like_windows() -> None:
    spec = inferenceservice.parse_spec(
        {
            "roles": [{"name": "prefill", "replicas": 4, "cardsPerPod": 8}],
            "autoscaling": {"targets": {"ttftMilliseconds": 2000, "tpotMilliseconds": 50}},
            "kvCache": {"bytes": "512Gi"},
        }
    )
    assert spec.autoscaling is not None
    assert spec.autoscaling.mode == inferenceservice.AutoscalingMode.AUTO
    assert spec.autoscaling.targets.attainment_percent == 95
    assert spec.autoscaling.scale_down_stabilization_seconds == 300
    assert spec.autoscaling.tolerance_percent == 10
    assert spec.autoscaling.metrics_port == 8000
    assert spec.kv_cache is not None
    assert spec.kv_cache.size == 512 << 30


def autoscaled_service(mode: str = "Auto", **autoscaling: Any) -> Any:
    """prefill 1..8 (floor 2) and decode 1..2, autoscaled to TTFT 2 s / TPOT 50 ms."""
    return inferenceservice.parse_spec(
        {
            "roles": [
                {"name": "prefill", "replicas": 8, "minReplicas": 2, "cardsPerPod": 8},
                {"name": "decode", "replicas": 2, "minReplicas": 1, "cardsPerPod": 8},
            ],
            "autoscaling": {
                "mode": mode,
                "targets": {"ttftMilliseconds": 2000, "tpotMilliseconds": 50},
                **autoscaling,
            },
        }
    )


def advised(**replicas: int) -> Any:
    roles = [{"name": name, "replicas": n} for name, n in replicas.items()]
    return inferenceservice.parse_status(
        {"recommendation": {"mode": "Auto", "roles": roles, "time": T0.isoformat()}}
    )


@pytest.mark.parametrize(
    ("advice", "expected"),
    [
        pytest.param({"prefill": 5, "decode": 2}, {"prefill": (5, 2), "decode": (2, 1)},
                     id="the recommendation within range is served"),
        pytest.param({"prefill": 20}, {"prefill": (8, 2), "decode": (2, 1)},
                     id="above the role's replicas it stops at them"),
        pytest.param({"prefill": 1, "decode": 0}, {"prefill": (2, 2), "decode": (1, 1)},
                     id="below the role's minReplicas it stops at them"),
    ],
)  # fmt: skip
def test_auto_mode_serves_the_recommendation_inside_the_persons_range(
    advice: dict[str, int], expected: dict[str, tuple[int, int]]
) -> None:
    served = inferenceservice.scaled(autoscaled_service(), advised(**advice))
    assert {r.name: (r.replicas, r.min_replicas) for r in served.roles} == expected


def test_a_narrower_autoscaling_range_lowers_the_floor_and_the_ceiling() -> None:
    spec = autoscaled_service(roles=[{"name": "prefill", "minReplicas": 0, "maxReplicas": 4}])
    low = inferenceservice.scaled(spec, advised(prefill=0))
    high = inferenceservice.scaled(spec, advised(prefill=6))
    assert (low.roles[0].replicas, low.roles[0].min_replicas) == (0, 0)
    assert high.roles[0].replicas == 4


@pytest.mark.parametrize(
    ("spec", "status"),
    [
        pytest.param(autoscaled_service("Advisory"), advised(prefill=5), id="advisory mode"),
        pytest.param(autoscaled_service(), inferenceservice.parse_status({}),
                     id="no recommendation yet"),
    ],
)  # fmt: skip
def test_the_spec_is_served_as_written_without_an_applied_recommendation(
    spec: Any, status: Any
) -> None:
    assert inferenceservice.scaled(spec, status) == spec


def test_replacing_writes_null_for_a_field_left_out_so_a_merge_patch_drops_a_stale_one() -> None:
    before = {"limitedBy": "maxReplicas", "summary": "prefill 1, decode 1"}
    now = inferenceservice.Recommendation(
        mode=inferenceservice.AutoscalingMode.AUTO,
        summary="prefill 1, decode 1",
        time=datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC),
    )
    wire = common.replacing(now)
    assert wire["limitedBy"] is None
    assert wire["summary"] == "prefill 1, decode 1"
    merged = {k: v for k, v in {**before, **wire}.items() if v is not None}  # RFC 7386
    assert "limitedBy" not in merged
    assert "limitedBy" not in common.to_wire(now)  # what kept the stale one before
