"""InferenceService (namespaced, short name ``infer``): roles of serving instances (e.g.
prefill and decode) placed on one supernode, each instance a gang of pods, scaled by the
time-sharing windows within each role's ``minReplicas..replicas`` keeping ``ratio``.

Read by the inference handlers (create gangs, publish the expert map, write status), placement
(pods per instance, cards per pod, rack spreading) and timeshare (scaling by window).
``parse`` takes the object as kopf or the API hands it over.
"""

from collections.abc import Iterable, Mapping
from typing import Annotated, Any

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
        default_factory=dict, json_schema_extra=common.PRESERVE_UNKNOWN
    )
    """PodTemplateSpec of every pod; the operator adds cards, env and annotations."""

    @property
    def cards_per_replica(self) -> int:
        return self.pods_per_replica * self.cards_per_pod


RatioValue = Annotated[int, Field(ge=1, le=1024)]


class InferenceServiceSpec(common.ApiModel):
    """Roles of the service and how they scale together."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "!has(self.ratio) || self.ratio.all(k, self.roles.exists(r, r.name == k))",
                "spec.ratio keys must name roles of spec.roles",
                ".ratio",
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
    conditions: list[common.Condition] = common.conditions_field()
    """Conditions, among them Ready."""


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
            "Priority", "integer", ".spec.priority", "Scheduling priority", priority=1
        ),
    ),
    selectable_fields=(".spec.superNode",),
)
