"""InferenceService (namespaced, short name ``infer``): roles of serving instances (e.g.
prefill and decode) placed on one supernode, each instance a gang of pods, scaled by the
time-sharing windows within each role's ``minReplicas..replicas`` keeping ``ratio``.

Read by the inference handlers (create gangs, publish the expert map, write status), placement
(pods per instance, cards per pod, rack spreading) and timeshare (scaling by window).
``parse`` takes the object as kopf or the API hands it over.
"""

from collections.abc import Iterable, Mapping
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from matrixpool import api
from matrixpool.api import common

KIND = "InferenceService"
PLURAL = "inferenceservices"
SHORT_NAMES = ("infer",)

# Inference defaults above training (trainingjob.DEFAULT_PRIORITY = 100): it wins the day.
DEFAULT_PRIORITY = 1000
MAX_PRIORITY = 1_000_000_000


class ExpertParallel(common.ApiModel):
    """Expert parallelism of a role: one expert per card of an instance."""

    experts: int = Field(ge=1, le=65536)
    """Distinct experts of the model."""
    redundant_experts: int = Field(default=0, ge=0, le=65536)
    """Extra copies of hot experts."""


class Role(common.ApiModel):
    """One role of the service: identical instances, each a gang of pods."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "!has(self.minReplicas) || self.minReplicas <= self.replicas",
                "spec.roles[].minReplicas must be <= spec.roles[].replicas",
                ".minReplicas",
            ),
            common.rule(
                "!has(self.expertParallel) || self.expertParallel.experts"
                " + self.expertParallel.redundantExperts == self.podsPerReplica * self.cardsPerPod",
                "spec.roles[].expertParallel: experts + redundantExperts must equal "
                "podsPerReplica * cardsPerPod (one expert per card)",
                ".expertParallel",
            ),
        )
    )

    name: common.DnsLabel
    """Role name, e.g. prefill or decode; unique within the service."""
    replicas: int = Field(ge=1, le=4096)
    """Instances at full capacity."""
    min_replicas: int = Field(default_factory=lambda data: data.get("replicas", 1), ge=0)
    """Floor when a window shrinks inference capacity; default replicas (never shrink)."""
    pods_per_replica: int = Field(default=1, ge=1, le=4096)
    """Pods of one instance; more than one makes the instance a gang spanning nodes."""
    cards_per_pod: int = Field(ge=1, le=64)
    """Cards per pod, all on one node."""
    expert_parallel: ExpertParallel | None = None
    """Expert parallelism; experts + redundantExperts = podsPerReplica * cardsPerPod."""
    template: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra=common.pod_template("spec.roles[].template")
    )
    """PodTemplateSpec of every pod; the operator adds cards, env and annotations."""

    @property
    def cards_per_replica(self) -> int:
        return self.pods_per_replica * self.cards_per_pod


RatioValue = Annotated[int, Field(ge=1, le=1024)]


class AutoscalingEngine(StrEnum):
    """Whose metric names the pods' /metrics carry (matrixpool.serving.readings.ENGINES)."""

    AUTO = "Auto"  # told from the names found
    VLLM = "vLLM"
    SGLANG = "SGLang"
    LLAMA_CPP = "LlamaCpp"


class AutoscalingMode(StrEnum):
    """What the autoscaler does with its recommendation."""

    AUTO = "Auto"  # apply it: the roles run the recommended replicas
    ADVISORY = "Advisory"  # only write status.recommendation, with its reasons


class SloTargets(common.ApiModel):
    """The service-level objectives the autoscaler sizes the roles for."""

    ttft_milliseconds: int = Field(ge=1, le=600_000)
    """Time to first token each request should meet."""
    tpot_milliseconds: int = Field(ge=1, le=10_000)
    """Time per output token (after the first) each request should meet."""
    attainment_percent: int = Field(default=95, ge=50, le=100)
    """Share of requests that should meet both targets."""


class RoleScaling(common.ApiModel):
    """The autoscaler's range for one role, inside the role's minReplicas..replicas."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "!has(self.minReplicas) || !has(self.maxReplicas)"
                " || self.minReplicas <= self.maxReplicas",
                "spec.autoscaling.roles[].minReplicas must be <= "
                "spec.autoscaling.roles[].maxReplicas",
                ".minReplicas",
            ),
        )
    )

    name: common.DnsLabel
    """The role, by its name in spec.roles."""
    min_replicas: int | None = Field(default=None, ge=0, le=4096)
    """Fewest instances the autoscaler keeps; default the role's minReplicas."""
    max_replicas: int | None = Field(default=None, ge=1, le=4096)
    """Most instances the autoscaler asks for; never above the role's replicas."""


class RatioRange(common.ApiModel):
    """Instances of ``role`` per instance of ``per``, kept within [min, max] percent."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "self.minPercent <= self.maxPercent",
                "spec.autoscaling.ratioRange.minPercent must be <= "
                "spec.autoscaling.ratioRange.maxPercent",
                ".minPercent",
            ),
            common.rule(
                "self.role != self.per",
                "spec.autoscaling.ratioRange.per must name another role than "
                "spec.autoscaling.ratioRange.role",
                ".per",
            ),
        )
    )

    role: common.DnsLabel
    """The counted role, e.g. decode."""
    per: common.DnsLabel
    """The role it is counted against, e.g. prefill."""
    min_percent: int = Field(ge=1, le=100_000)
    """Fewest instances of role per 100 instances of per, e.g. 20."""
    max_percent: int = Field(ge=1, le=100_000)
    """Most instances of role per 100 instances of per, e.g. 50."""


class ReplicaCapacity(common.ApiModel):
    """What one replica sustains, as a person measured it (e.g. a benchmark of the engine on
    these cards); a figure left out is learned from the role's readings."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "has(self.prefillTokensPerSecond) || has(self.decodeTokensPerSecond)",
                "spec.autoscaling.capacity must state prefillTokensPerSecond or "
                "decodeTokensPerSecond (leave capacity out to learn both)",
            ),
        )
    )

    prefill_tokens_per_second: int | None = Field(default=None, ge=1, le=100_000_000)
    """Prompt tokens one replica of the prefill role (or of the only role) processes per
    second; absent: learned from its readings."""
    decode_tokens_per_second: int | None = Field(default=None, ge=1, le=100_000_000)
    """Output tokens one replica of the decode role (or of the only role) yields per second at
    the TPOT target; absent: learned from its readings."""


class Autoscaling(common.ApiModel):
    """Load-driven scaling of the roles to SLO targets (prefill and decode apart)."""

    mode: AutoscalingMode = AutoscalingMode.AUTO
    """Auto applies the recommendation; Advisory only writes status.recommendation."""
    targets: SloTargets
    """TTFT and TPOT targets and the share of requests that should meet them."""
    roles: list[RoleScaling] = Field(
        default_factory=list, max_length=8, json_schema_extra=common.list_map("name")
    )
    """Optional narrower ranges per role; a role not named keeps minReplicas..replicas."""
    ratio_range: RatioRange | None = None
    """Optional: keep one role's instances within a range per another's (instead of ratio)."""
    metrics_port: int = Field(default=8000, ge=1, le=65535)
    """Port of the pods' Prometheus /metrics that the load is read from."""
    engine: AutoscalingEngine = AutoscalingEngine.AUTO
    """The serving engine whose metric names /metrics carries: vLLM, SGLang or LlamaCpp
    (llama.cpp's server); Auto tells it from the names (vLLM's when none is known)."""
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=3600)
    """A role scales down only to the highest recommendation of this many seconds."""
    tolerance_percent: int = Field(default=10, ge=0, le=100)
    """A recommendation this close to the current replicas changes nothing."""
    capacity: ReplicaCapacity | None = None
    """Optional: per replica, the prompt and output tokens/s a person measured; used as
    stated. Absent (or a figure left out): learned from the roles' readings, the
    CloudMatrix-Infer figures being only the first guess (status.recommendation.capacity)."""


class KvCache(common.ApiModel):
    """Memory reserved for the service's KV cache in its supernode's memory pool."""

    bytes: common.ByteQuantity
    """Bytes reserved, a quantity such as 512Gi; admitted like cards."""

    @property
    def size(self) -> int:
        return common.parse_bytes(self.bytes)


class InferenceServiceSpec(common.ApiModel):
    """Roles of the service and how they scale together."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "!has(self.ratio) || self.ratio.all(k, self.roles.exists(r, r.name == k))",
                "spec.ratio keys must name roles of spec.roles",
                ".ratio",
            ),
            common.rule(
                "!has(self.autoscaling) || !has(self.autoscaling.roles)"
                " || self.autoscaling.roles.all(a, self.roles.exists(r, r.name == a.name))",
                "spec.autoscaling.roles[].name must name a role of spec.roles",
                ".autoscaling",
            ),
            common.rule(
                "!has(self.autoscaling) || !has(self.autoscaling.ratioRange)"
                " || (self.roles.exists(r, r.name == self.autoscaling.ratioRange.role)"
                " && self.roles.exists(r, r.name == self.autoscaling.ratioRange.per))",
                "spec.autoscaling.ratioRange.role and .per must name roles of spec.roles",
                ".autoscaling",
            ),
            common.rule(
                "!has(self.autoscaling) || !has(self.autoscaling.ratioRange)"
                " || !has(self.ratio) || size(self.ratio) == 0",
                "spec.autoscaling.ratioRange replaces spec.ratio: set one of them",
                ".autoscaling",
            ),
            common.rule(
                "!has(self.kvCache) || has(self.superNode)",
                "spec.kvCache needs spec.superNode: the KV-cache pool is one SuperNode's",
                ".kvCache",
            ),
        )
    )

    super_node: common.DnsSubdomain | None = None
    """SuperNode to run on; absent: any SuperNode that fits."""
    priority: int = Field(default=DEFAULT_PRIORITY, ge=0, le=MAX_PRIORITY)
    """Higher wins; inference defaults above training."""
    roles: list[Role] = Field(min_length=1, max_length=8, json_schema_extra=common.list_map("name"))
    """1..8 roles with unique names."""
    ratio: dict[str, RatioValue] = Field(default_factory=dict, max_length=8)
    """Optional: role name → weight; those roles are scaled together in this proportion."""
    autoscaling: Autoscaling | None = None
    """Optional: scale the roles to the load within their ranges; absent: replicas as set."""
    kv_cache: KvCache | None = None
    """Optional: KV-cache memory reserved in the supernode's memory pool."""

    def role(self, name: str) -> Role | None:
        return next((r for r in self.roles if r.name == name), None)


class RoleStatus(common.ApiModel):
    """Observed instances of one role."""

    name: common.DnsLabel
    """Role name."""
    replicas: common.Count = 0
    """Instances wanted now (scaled by the window)."""
    ready: common.Count = 0
    """Instances whose pods are all ready."""


class RoleRecommendation(common.ApiModel):
    """The autoscaler's replicas for one role."""

    name: common.DnsLabel
    """Role name."""
    replicas: common.Count
    """Instances the load needs, within the role's range and the window's cap."""


class CapacitySource(StrEnum):
    """Where a per-replica capacity figure comes from."""

    STATED = "Stated"  # spec.autoscaling.capacity
    LEARNED = "Learned"  # from the role's own readings
    FIRST_GUESS = "FirstGuess"  # the CloudMatrix-Infer figures, until readings say better


class PhaseCapacity(common.ApiModel):
    """The per-replica capacity the autoscaler sized one phase with, and where it came from."""

    phase: Literal["prefill", "decode"]
    """prefill (prompt tokens/s) or decode (output tokens/s at the TPOT target)."""
    role: common.DnsLabel
    """The role whose replicas serve that phase."""
    tokens_per_second: common.Count
    """Tokens per second one replica sustains, as used."""
    source: CapacitySource
    """Stated, Learned or FirstGuess."""
    periods: common.Count = 0
    """Readings the figure was learned from (Learned)."""
    said: str | None = Field(default=None, max_length=256)
    """The figure in words, e.g. "learned from busy time over 12 periods"."""


class Recommendation(common.ApiModel):
    """What the autoscaler last recommended, and why."""

    mode: AutoscalingMode
    """Auto: applied; Advisory: written here only."""
    roles: list[RoleRecommendation] = Field(
        default_factory=list, max_length=8, json_schema_extra=common.list_map("name")
    )
    """Replicas per role."""
    reasons: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list, max_length=16
    )
    """The factors that drove it, one sentence each."""
    summary: str | None = Field(default=None, max_length=256)
    """The replicas at a glance, e.g. "prefill 3, decode 1" (kubectl get column Autoscaled)."""
    limited_by: str | None = Field(default=None, max_length=63)
    """What held it below the load's need (e.g. window cap, free cards), if anything."""
    capacity: list[PhaseCapacity] = Field(
        default_factory=list, max_length=2, json_schema_extra=common.list_map("phase")
    )
    """Per phase, the capacity per replica it was sized with and its source."""
    time: datetime
    """When it was computed."""


class KvCacheStatus(common.ApiModel):
    """The service's reservation in its supernode's KV-cache pool (spec.kvCache)."""

    admitted: bool = False
    """Whether the reservation is held; false: the service waits (its Ready condition says
    why) and gets no pods."""
    reserved: common.ByteQuantity | None = None
    """Bytes reserved in the pool, e.g. 64Gi; absent while it waits."""
    quota_per_node: common.ByteQuantity | None = None
    """The service's quota on each member node's daemon: reserved / member nodes."""
    nodes: common.Count = 0
    """Member nodes whose daemons hold the quota."""


MAX_SLOTS = 4096 * 64  # cards of one instance at most: podsPerReplica * cardsPerPod


class HotExpert(common.ApiModel):
    """One of the experts that took the most tokens."""

    expert: common.Count
    """Expert id."""
    share_percent: float = Field(ge=0, le=100)
    """Its share of the tokens counted, in percent."""
    copies: int = Field(ge=1)
    """Cards holding it in the map written."""


class ExpertsStatus(common.ApiModel):
    """The measured load of one expert-parallel role and the expert map balancing it
    (written by the experts controller, matrixpool.controllers.experts)."""

    role: common.DnsLabel
    """Role name."""
    tokens: common.Count = 0
    """Tokens routed to experts over the last period, all its ready pods together."""
    imbalance: float | None = Field(default=None, ge=1)
    """Max/mean load per card over the last period, under the map in force then."""
    measured_time: datetime | None = None
    """When the last period ended."""
    hottest: list[HotExpert] = Field(default_factory=list, max_length=8)
    """The experts that took the most tokens over the last period, hottest first."""
    imbalance_before: float | None = Field(default=None, ge=1)
    """At the last re-plan: max/mean load per card under the map it replaced."""
    imbalance_after: float | None = Field(default=None, ge=1)
    """At the last re-plan: max/mean load per card of the same load under the new map."""
    rebalanced_time: datetime | None = None
    """When the map was last re-planned."""
    layout: list[common.Count] = Field(default_factory=list, max_length=MAX_SLOTS)
    """Slot → expert of the map in force: slot s is the s-th card of an instance in rank
    order; empty: experts in slot order, the redundant slots copies of experts 0, 1, 2..."""


class InferenceServiceStatus(common.ApiModel):
    """Observed state of the service, written by the operator."""

    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation this status was computed from."""
    roles: list[RoleStatus] = Field(
        default_factory=list, max_length=8, json_schema_extra=common.list_map("name")
    )
    """Per-role instance counts."""
    role_summary: str | None = None
    """The roles at a glance, e.g. "prefill 4/4, decode 1/1" (see summarize_roles)."""
    placement: common.PlacementStatus = Field(default_factory=common.PlacementStatus)
    """Where the instances are bound."""
    expert_map: str | None = None
    """Name of the ConfigMap mapping experts to cards."""
    experts: list[ExpertsStatus] = Field(
        default_factory=list, max_length=8, json_schema_extra=common.list_map("role")
    )
    """Per expert-parallel role: the measured expert load and the map balancing it."""
    recommendation: Recommendation | None = None
    """The autoscaler's last recommendation (spec.autoscaling), applied or advisory."""
    kv_cache: KvCacheStatus | None = None
    """The KV-cache reservation (spec.kvCache): admitted or waiting, and its quotas."""
    conditions: list[common.Condition] = common.conditions_field()
    """Conditions, among them Ready."""


def autoscaling_range(spec: InferenceServiceSpec, role: Role) -> tuple[int, int]:
    """The fewest and most instances the autoscaler may give ``role``: its spec.autoscaling
    range, inside the role's minReplicas..replicas as a person last set them."""
    found = [r for r in spec.autoscaling.roles if r.name == role.name] if spec.autoscaling else []
    narrow = found[0] if found else RoleScaling(name=role.name)
    high = min(role.replicas, narrow.max_replicas or role.replicas)
    low = narrow.min_replicas if narrow.min_replicas is not None else role.min_replicas
    return min(low, high), high


def scaled(spec: InferenceServiceSpec, status: InferenceServiceStatus) -> InferenceServiceSpec:
    """The spec as served: with autoscaling in Auto mode, each role's replicas are those of
    status.recommendation kept in its :func:`autoscaling_range` (its floor lowered to them if
    need be); otherwise, and for a role without a recommendation, the spec as written."""
    advice = status.recommendation
    if spec.autoscaling is None or spec.autoscaling.mode != AutoscalingMode.AUTO or not advice:
        return spec
    wanted = {r.name: r.replicas for r in advice.roles}
    roles = []
    for role in spec.roles:
        if role.name in wanted:
            low, high = autoscaling_range(spec, role)
            replicas = max(low, min(high, wanted[role.name]))
            floor = min(role.min_replicas, replicas)
            role = role.model_copy(update={"replicas": replicas, "min_replicas": floor})
        roles.append(role)
    return spec.model_copy(update={"roles": roles})


def summarize_roles(roles: Iterable[RoleStatus]) -> str:
    """``"prefill 4/4, decode 1/1"``: ready/wanted instances per role, for roleSummary."""
    return ", ".join(f"{r.name} {r.ready}/{r.replicas}" for r in roles)


class InferenceService(common.ApiModel):
    """A whole InferenceService object."""

    api_version: str = api.API_VERSION
    """matrixpool.dev/v1alpha1."""
    kind: str = KIND
    """InferenceService."""
    metadata: common.ObjectMeta = Field(default_factory=common.ObjectMeta)
    """Object metadata."""
    spec: InferenceServiceSpec
    """Desired state."""
    status: InferenceServiceStatus = Field(default_factory=InferenceServiceStatus)
    """Observed state."""


def parse(body: Mapping[str, Any]) -> InferenceService:
    """The whole object (a kopf body or an API dict) as a model."""
    return InferenceService.model_validate(common.plain(body))


def parse_spec(spec: Mapping[str, Any]) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(common.plain(spec))


def parse_status(status: Mapping[str, Any] | None) -> InferenceServiceStatus:
    return InferenceServiceStatus.model_validate(common.plain(status or {}))


_READY = '.status.conditions[?(@.type=="Ready")].status'
RESOURCE = common.Resource(
    kind=KIND,
    plural=PLURAL,
    short_names=SHORT_NAMES,
    namespaced=True,
    spec=InferenceServiceSpec,
    status=InferenceServiceStatus,
    description="InferenceService serves a model as roles of instances on a supernode, "
    "scaled by the supernode's time windows.",
    printer_columns=(
        common.PrinterColumn(
            "SuperNode", "string", ".status.placement.superNode", "SuperNode holding it"
        ),
        common.PrinterColumn("Ready", "string", _READY, "Ready condition"),
        common.PrinterColumn("Roles", "string", ".status.roleSummary", "Ready/wanted per role"),
        common.PrinterColumn(
            "Autoscaled",
            "string",
            ".status.recommendation.summary",
            "The autoscaler's replicas per role (Auto: served; Advisory: advice)",
        ),
        common.PrinterColumn(
            "Mode", "string", ".spec.autoscaling.mode", "Autoscaling mode", priority=1
        ),
        common.PrinterColumn(
            "KV",
            "string",
            ".status.kvCache.reserved",
            "KV-cache bytes reserved in the SuperNode's pool",
            priority=1,
        ),
        common.PrinterColumn(
            "Priority", "integer", ".spec.priority", "Scheduling priority", priority=1
        ),
    ),
    selectable_fields=(".spec.superNode",),
)
