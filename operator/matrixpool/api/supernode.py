"""SuperNode (cluster-scoped, short name ``sn``): a pool of the cards of a set of nodes,
scheduled as one machine, optionally time-shared between inference and training by windows.

Read by the supernode handlers (to count nodes and cards and write status), by placement
(topology keys, card groups, spares) and by timeshare (windows). ``parse`` takes the object as
kopf or the API hands it over.
"""

from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from matrixpool import api
from matrixpool.api import common

KIND = "SuperNode"
PLURAL = "supernodes"
SHORT_NAMES = ("sn",)

HHMM = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"  # a local time of day, 00:00..23:59
TIMEZONE = r"^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)*$"  # IANA-like: UTC, Asia/Shanghai
MINUTES_PER_DAY = 24 * 60


def _minutes(cel_hhmm: str) -> str:
    """CEL for the minute of the day of an HH:MM string expression."""
    return f"(int({cel_hhmm}.substring(0, 2)) * 60 + int({cel_hhmm}.substring(3, 5)))"


# Duration of window `w` in minutes, 1..1440: end == start means the whole day.
_DURATION = f"(({_minutes('w.end')} - {_minutes('w.start')} + 1439) % 1440 + 1)"

MAX_CARDS_PER_NODE = 64
# The CEL list [0, 1, ..., 63]: iterating cards keeps the disjointness rule of cardGroups within
# the API server's cost budget (64 cards x 64 groups x 64), where group pairs would not.
_ALL_CARDS = "[" + ", ".join(str(c) for c in range(MAX_CARDS_PER_NODE)) + "]"

Card = Annotated[int, Field(ge=0, le=MAX_CARDS_PER_NODE - 1)]
CardGroup = Annotated[
    list[Card], Field(min_length=1, max_length=64, json_schema_extra=common.list_set())
]
HourMinute = Annotated[str, Field(min_length=5, max_length=5, pattern=HHMM)]


class TimeWindow(common.ApiModel):
    """A daily time window and the cards inference may hold during it; training gets the rest."""

    name: common.DnsLabel
    """Window name, referenced by TrainingJob spec.windows."""
    start: HourMinute
    """Local start time HH:MM (inclusive)."""
    end: HourMinute
    """Local end time HH:MM (exclusive); before start wraps past midnight; equal: all day."""
    inference_cards: common.Count
    """Most cards inference may hold in this supernode during the window."""

    @property
    def start_minute(self) -> int:
        return _to_minute(self.start)

    @property
    def end_minute(self) -> int:
        return _to_minute(self.end)

    @property
    def duration_minutes(self) -> int:
        """1..1440; a window whose end equals its start lasts the whole day."""
        return (self.end_minute - self.start_minute - 1) % MINUTES_PER_DAY + 1

    def contains(self, minute_of_day: int) -> bool:
        return (minute_of_day - self.start_minute) % MINUTES_PER_DAY < self.duration_minutes


def _to_minute(hhmm: str) -> int:
    hours, minutes = hhmm.split(":")
    return int(hours) * 60 + int(minutes)


class TimeSharing(common.ApiModel):
    """Daily windows that cap inference; absent means no time-sharing."""

    timezone: str = Field(min_length=1, max_length=64, pattern=TIMEZONE)
    """IANA time zone of the window times, e.g. Asia/Shanghai."""
    # Exact cover of the day, by two CEL rules: (1) the durations (1..1440 min) add up to 1440;
    # (2) every window ends where exactly one window starts. Following "ends where it starts"
    # from any window reaches a cycle that returns to its starting minute, so it spans a
    # multiple of 1440 min, hence at least 1440; by (1) that cycle is every window, going
    # round the clock once: no gap, no overlap. The first rule skips malformed times, which the
    # HH:MM pattern reports.
    windows: list[TimeWindow] = Field(
        min_length=1,
        max_length=24,
        json_schema_extra={
            **common.list_map("name"),
            **common.validations(
                common.rule(
                    f"!self.all(w, w.start.matches('{HHMM}') && w.end.matches('{HHMM}'))"
                    f" || self.map(w, {_DURATION}).sum() == 1440",
                    "spec.timeSharing.windows must cover the 24 hours exactly once: "
                    "their durations must add up to 24h (no gap, no overlap)",
                ),
                common.rule(
                    "self.all(w, self.exists_one(v, v.start == w.end))",
                    "spec.timeSharing.windows must cover the 24 hours exactly once: "
                    "every window must end where exactly one window starts",
                ),
            ),
        },
    )
    """Windows covering the 24 hours exactly once, unique names; may wrap past midnight."""
    checkpoint_grace_seconds: int = Field(default=120, ge=0, le=86400)
    """How long training gets to checkpoint at a boundary before it is evicted."""

    def window_at(self, minute_of_day: int) -> TimeWindow:
        """The window holding a local minute of the day (the CRD guarantees exactly one)."""
        return next(w for w in self.windows if w.contains(minute_of_day))


class Spares(common.ApiModel):
    """Capacity held back for recovery (SpareSwap); never used for normal placement."""

    nodes: int = Field(default=0, ge=0, le=1024)
    """Whole nodes kept free as spares."""


class MemoryPool(common.ApiModel):
    """The supernode-wide KV-cache pool: host memory lent by each member node, served by the
    node daemons to any pod of a service on any node of the supernode."""

    per_node: common.ByteQuantity
    """Host memory each member node lends to the pool, a quantity such as 256Gi."""

    @property
    def per_node_bytes(self) -> int:
        return common.parse_bytes(self.per_node)


class SuperNodeSpec(common.ApiModel):
    """Which nodes form the supernode, how their cards are counted and how they are shared."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "!has(self.cardGroups) || self.cardGroups.all(g, g.all(c, c < self.cardsPerNode))",
                "spec.cardGroups card indices must be below spec.cardsPerNode",
                ".cardGroups",
            ),
        )
    )

    node_selector: common.LabelSelector = Field(
        json_schema_extra=common.validations(
            common.rule(
                "(has(self.matchLabels) && size(self.matchLabels) > 0)"
                " || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
                "spec.nodeSelector must select by at least one label "
                "(an empty selector would take every node)",
            )
        )
    )
    """Member nodes: those whose labels match."""
    card_resource: str = Field(max_length=253, pattern=common.EXTENDED_RESOURCE)
    """Extended resource counted as cards, e.g. huawei.com/Ascend910 or nvidia.com/gpu."""
    cards_per_node: int = Field(ge=1, le=MAX_CARDS_PER_NODE)
    """Cards on each member node."""
    card_groups: list[CardGroup] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=common.validations(
            common.rule(
                f"{_ALL_CARDS}.all(c, self.filter(g, c in g).size() <= 1)",
                "spec.cardGroups must not hold a card in two groups",
            )
        ),
    )
    """Optional intra-node link groups of card indices; a request that fits a group stays in it."""
    topology_keys: list[common.LabelKey] = Field(
        default_factory=list, max_length=8, json_schema_extra=common.list_set()
    )
    """Node label keys of the topology below the supernode, coarse to fine (e.g. rack)."""
    spares: Spares = Field(default_factory=Spares, json_schema_extra=common.DEFAULT_EMPTY_OBJECT)
    """Spare capacity held back for recovery."""
    time_sharing: TimeSharing | None = None
    """Day/night sharing between inference and training; absent: no time-sharing."""
    memory_pool: MemoryPool | None = None
    """Host memory the member nodes lend to one pool for KV caches; absent: no pool."""


class NodeCounts(common.ApiModel):
    """Member nodes of the supernode."""

    total: common.Count = 0
    """Nodes matching spec.nodeSelector."""
    ready: common.Count = 0
    """Of those, nodes whose Ready condition is True."""


class CardCounts(common.ApiModel):
    """Cards of the supernode; allocatable + unhealthy + spare = total."""

    total: common.Count = 0
    """Cards on all member nodes."""
    allocatable: common.Count = 0
    """Healthy cards on ready, non-spare nodes."""
    allocated: common.Count = 0
    """Cards bound to pods."""
    unhealthy: common.Count = 0
    """Cards marked unhealthy or on nodes that are not ready."""
    spare: common.Count = 0
    """Healthy cards on the spare nodes."""
    inference: common.Count = 0
    """Of the allocated cards, those held by InferenceService pods."""
    training: common.Count = 0
    """Of the allocated cards, those held by TrainingJob pods."""
    free: common.Count = 0
    """Allocatable cards no pod holds."""


class Transition(common.ApiModel):
    """A move of the pool to a new split between inference and training (time-sharing)."""

    window: str | None = Field(default=None, max_length=63)
    """The window the new split is for."""
    started_at: datetime
    """The window boundary (or when capacity or workloads changed the split)."""
    settled_at: datetime | None = None
    """When the new split was in place: every workload at its target, all bound, none
    terminating; absent while under way."""
    inference_cards: common.Count = 0
    """Cards the new split gives inference."""
    training_cards: common.Count = 0
    """Cards the new split gives training."""
    seconds: float | None = Field(default=None, ge=0)
    """Boundary to new split in place, in real seconds."""
    checkpoint_seconds: float | None = Field(default=None, ge=0)
    """Of which: waiting for training to answer its checkpoint requests."""
    eviction_seconds: float | None = Field(default=None, ge=0)
    """Of which: evicted pods deleted and gone."""
    placement_seconds: float | None = Field(default=None, ge=0)
    """Of which: the grown workloads placed and bound."""


class SuperNodeStatus(common.ApiModel):
    """Observed state of the supernode, written by the operator."""

    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation this status was computed from."""
    nodes: NodeCounts = Field(default_factory=NodeCounts)
    """Node counts."""
    cards: CardCounts = Field(default_factory=CardCounts)
    """Card counts."""
    spare_nodes: list[str] = Field(default_factory=list)
    """Names of the nodes currently held as spares, sorted."""
    window: str | None = None
    """Name of the current time-sharing window; absent without time-sharing."""
    next_transition: datetime | None = None
    """When the next window starts."""
    transition: Transition | None = None
    """The latest transition between splits (under way or settled); absent without one."""
    conditions: list[common.Condition] = common.conditions_field()
    """Conditions, among them Ready."""


class SuperNode(common.ApiModel):
    """A whole SuperNode object."""

    api_version: str = api.API_VERSION
    """matrixpool.dev/v1alpha1."""
    kind: str = KIND
    """SuperNode."""
    metadata: common.ObjectMeta = Field(default_factory=common.ObjectMeta)
    """Object metadata."""
    spec: SuperNodeSpec
    """Desired state."""
    status: SuperNodeStatus = Field(default_factory=SuperNodeStatus)
    """Observed state."""


def parse(body: Mapping[str, Any]) -> SuperNode:
    """The whole object (a kopf body or an API dict) as a model."""
    return SuperNode.model_validate(common.plain(body))


def parse_spec(spec: Mapping[str, Any]) -> SuperNodeSpec:
    return SuperNodeSpec.model_validate(common.plain(spec))


def parse_status(status: Mapping[str, Any] | None) -> SuperNodeStatus:
    return SuperNodeStatus.model_validate(common.plain(status or {}))


_READY = '.status.conditions[?(@.type=="Ready")].status'
RESOURCE = common.Resource(
    kind=KIND,
    plural=PLURAL,
    short_names=SHORT_NAMES,
    namespaced=False,
    spec=SuperNodeSpec,
    status=SuperNodeStatus,
    description="SuperNode pools the cards of a set of nodes into one schedulable machine.",
    printer_columns=(
        common.PrinterColumn("Ready", "string", _READY, "Ready condition"),
        common.PrinterColumn("Ready-Nodes", "integer", ".status.nodes.ready", "Ready nodes"),
        common.PrinterColumn("Nodes", "integer", ".status.nodes.total", "Member nodes"),
        common.PrinterColumn("Cards", "integer", ".status.cards.total", "Cards in total"),
        common.PrinterColumn(
            "Allocatable", "integer", ".status.cards.allocatable", "Cards placement may use"
        ),
        common.PrinterColumn("Allocated", "integer", ".status.cards.allocated", "Cards bound"),
        common.PrinterColumn("Unhealthy", "integer", ".status.cards.unhealthy", "Unhealthy cards"),
        common.PrinterColumn("Spare", "integer", ".status.cards.spare", "Cards on spare nodes"),
        common.PrinterColumn("Window", "string", ".status.window", "Current time window"),
        common.PrinterColumn(
            "Next", "string", ".status.nextTransition", "Next window starts", priority=1
        ),
        common.PrinterColumn(
            "Resource", "string", ".spec.cardResource", "Card resource", priority=1
        ),
    ),
)
