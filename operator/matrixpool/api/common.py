"""Pieces shared by every matrixpool kind: the wire base model, conditions, label selectors,
the object envelope, field patterns, and the CRD metadata that ``crdgen`` renders.

Imported by the kind modules (``supernode``, ``trainingjob``, ``inferenceservice``), by
``crdgen``, and by the handlers for ``set_condition`` / ``to_wire``. Cross-field validation
lives in the CRD as CEL (``rule(...)`` attached through ``json_schema_extra``); the models
carry the same bounds as the schema because the schema is derived from them.
"""

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from matrixpool import api

# --- patterns (RE2 and Rust-regex compatible: the API server and pydantic both run them) ----
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_PREFIX = r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)"
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
# A label or annotation key: optional DNS-subdomain prefix and a name.
QUALIFIED_NAME = rf"^{_PREFIX}?{_NAME}$"
# An extended resource name: the domain prefix is mandatory (huawei.com/Ascend910).
EXTENDED_RESOURCE = rf"^{_PREFIX}{_NAME}$"
# A condition reason: CamelCase-ish, as metav1.Condition requires.
REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# A whole number of bytes as a Kubernetes quantity: 64Gi, 500M, 1048576 (no fractions, no m).
BYTES = r"^[0-9]{1,15}(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"

DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]
DnsSubdomain = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=QUALIFIED_NAME)]
LabelValue = Annotated[str, Field(max_length=63)]
Count = Annotated[int, Field(ge=0)]  # a count that is never negative
# Bytes as a quantity string (see BYTES); parse_bytes gives the integer.
ByteQuantity = Annotated[str, Field(min_length=1, max_length=17, pattern=BYTES)]

_BYTE_SUFFIXES: dict[str, int] = {
    "": 1,
    **{s: 1024 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi"))},
    **{s: 1000 ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P"))},
}


def parse_bytes(quantity: str) -> int:
    """``"64Gi"`` → 68719476736; the forms :data:`BYTES` allows (ValueError otherwise)."""
    found = re.fullmatch(r"([0-9]+)([A-Za-z]*)", quantity)
    if found is None or found[2] not in _BYTE_SUFFIXES:
        raise ValueError(f"not a byte quantity: {quantity!r}")
    return int(found[1]) * _BYTE_SUFFIXES[found[2]]


class ApiModel(BaseModel):
    """Base of every wire model: camelCase on the wire, snake_case in Python.

    Unknown fields are ignored so an older operator can read objects written by a newer API.
    Field docstrings become the CRD descriptions shown by ``kubectl explain``.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
        extra="ignore",
    )


# --- schema extras -------------------------------------------------------------------------
def rule(expr: str, message: str, field_path: str | None = None) -> JsonDict:
    """One CEL rule (``x-kubernetes-validations`` entry); the message must name the field."""
    out: JsonDict = {"rule": expr, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


def validations(*rules: JsonDict) -> JsonDict:
    """``json_schema_extra`` carrying CEL rules, for a model's config or a field."""
    return {"x-kubernetes-validations": list(rules)}


def list_set(**extra: Any) -> JsonDict:
    """``json_schema_extra`` of a list of unique scalars (the API server rejects duplicates)."""
    return {"x-kubernetes-list-type": "set", **extra}


def list_map(*keys: str, **extra: Any) -> JsonDict:
    """``json_schema_extra`` of a list of objects unique by ``keys``."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys), **extra}


# The CRD default of a nested object whose own fields all have defaults: `{}` lets the API
# server fill them in (Kubernetes defaults a nested field only when its parent exists).
DEFAULT_EMPTY_OBJECT: JsonDict = {"default": {}}
# An opaque object kept as-is by the API server (pod templates).
PRESERVE_UNKNOWN: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}

OURS = "matrixpool.dev/"  # the prefix of the operator's own labels and annotations
MAX_TEMPLATE_KEYS = 256  # labels, and annotations, of a pod template


def _keys_not_ours(field: str) -> JsonDict:
    """The schema of a template's labels or annotations: strings, and none under the operator's
    own prefixes (``matrixpool.dev/``, ``<anything>.matrixpool.dev/``), which it writes itself
    and reads back: a template must not forge them."""
    owned = f"k.startsWith('{OURS}') || k.contains('.{OURS}')"
    return {
        "type": "object",
        "maxProperties": MAX_TEMPLATE_KEYS,
        "additionalProperties": {"type": "string"},
        "x-kubernetes-validations": [
            {
                "rule": f"!self.exists(k, {owned})",
                "message": f"{field}: keys under {OURS} are the operator's, not a template's",
                "messageExpression": (
                    f"'{field}: ' + self.filter(k, {owned})[0]"
                    " + ' is a key the operator writes: a template must not set it'"
                ),
            }
        ],
    }


def pod_template(field: str, restart_policies: tuple[str, ...] = ()) -> JsonDict:
    """``json_schema_extra`` of a PodTemplateSpec field named ``field`` (``spec.template``): kept
    as written, but its metadata's labels and annotations checked (:func:`_keys_not_ours`) and,
    with ``restart_policies``, its ``spec.restartPolicy`` one of them."""
    properties: JsonDict = {
        "metadata": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {
                "labels": _keys_not_ours(f"{field}.metadata.labels"),
                "annotations": _keys_not_ours(f"{field}.metadata.annotations"),
            },
        }
    }
    if restart_policies:
        properties["spec"] = {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {"restartPolicy": {"type": "string", "enum": list(restart_policies)}},
        }
    return {"x-kubernetes-preserve-unknown-fields": True, "properties": properties}


# --- label selectors -------------------------------------------------------------------------
class SelectorOperator(StrEnum):
    """Operators of a label selector requirement."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(ApiModel):
    """One matchExpressions entry of a Kubernetes label selector."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            rule(
                "(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
                "matchExpressions[].values must be non-empty for In and NotIn, "
                "and empty for Exists and DoesNotExist",
                ".values",
            )
        )
    )

    key: LabelKey
    """Label key the requirement applies to."""
    operator: SelectorOperator
    """How the key relates to the values."""
    values: list[LabelValue] = Field(default_factory=list, max_length=64)
    """Values for In and NotIn; empty for Exists and DoesNotExist."""

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        match self.operator:
            case SelectorOperator.IN:
                return has and labels[self.key] in self.values
            case SelectorOperator.NOT_IN:
                return not has or labels[self.key] not in self.values
            case SelectorOperator.EXISTS:
                return has
            case SelectorOperator.DOES_NOT_EXIST:
                return not has


class LabelSelector(ApiModel):
    """A Kubernetes label selector: every matchLabels pair and every expression must hold."""

    match_labels: dict[str, LabelValue] = Field(default_factory=dict, max_length=64)
    """Labels a matching object carries, key → value."""
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)
    """Further requirements, all of which must hold."""

    def matches(self, labels: Mapping[str, str]) -> bool:
        pairs = all(labels.get(k) == v for k, v in self.match_labels.items())
        return pairs and all(e.matches(labels) for e in self.match_expressions)

    def is_empty(self) -> bool:
        """An empty selector matches everything."""
        return not self.match_labels and not self.match_expressions


# --- conditions ---------------------------------------------------------------------------------
READY = "Ready"  # condition type shown in the Ready printer column of SuperNode and inference


class ConditionStatus(StrEnum):
    """Status of a condition, as Kubernetes spells it."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """A Kubernetes condition (metav1.Condition): one aspect of the object's state."""

    type: str = Field(max_length=316, pattern=QUALIFIED_NAME)
    """Condition type in CamelCase, e.g. Ready."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(min_length=1, max_length=1024, pattern=REASON)
    """Machine-readable CamelCase reason of the last transition."""
    message: str = Field(default="", max_length=32768)
    """Human-readable details."""
    last_transition_time: datetime
    """When the status last changed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation the condition was computed from."""


def conditions_field() -> Any:
    """The ``conditions`` field of every status: a list keyed by type."""
    return Field(default_factory=list, max_length=32, json_schema_extra=list_map("type"))


def find_condition(conditions: Iterable[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def set_condition(conditions: Sequence[Condition], new: Condition) -> list[Condition]:
    """Replace or add ``new`` by type; keeps the old transition time if status is unchanged."""
    old = find_condition(conditions, new.type)
    if old is not None and old.status == new.status:
        new = new.model_copy(update={"last_transition_time": old.last_transition_time})
    return [c for c in conditions if c.type != new.type] + [new]


# --- status pieces shared by the workload kinds ----------------------------------------------
class PlacementStatus(ApiModel):
    """Where a gang is bound; the per-pod cards are on the pods (annotation cards)."""

    super_node: str | None = None
    """The supernode holding the gang (the first one if it spans several)."""
    super_nodes: list[str] = Field(default_factory=list)
    """Every supernode holding a pod of the gang; more than one only with Preferred."""
    nodes: list[str] = Field(default_factory=list)
    """Nodes holding at least one pod of the gang, sorted."""
    cards: Count = 0
    """Cards bound to the gang in total."""


# --- the object envelope ------------------------------------------------------------------------
class ObjectMeta(ApiModel):
    """The parts of metadata the operator reads."""

    name: str = ""
    """Object name."""
    namespace: str | None = None
    """Namespace; None for cluster-scoped kinds."""
    uid: str | None = None
    """UID set by the API server."""
    generation: int | None = None
    """Spec generation, compared with status.observedGeneration."""
    resource_version: str | None = None
    """Resource version for optimistic concurrency."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations."""


def plain(value: Any) -> Any:
    """Deep-copy Mappings into dicts and sequences into lists (kopf hands out views)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def to_wire(model: BaseModel) -> dict[str, Any]:
    """The camelCase JSON form of a model, without unset optional fields (for patches)."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def replacing(model: BaseModel) -> dict[str, Any]:
    """:func:`to_wire`, with each optional field that is None now written as null: a JSON merge
    patch of this body replaces the object whole, where :func:`to_wire`'s would keep a field
    that an earlier patch set and this model leaves out (e.g. a stale ``limitedBy``)."""
    wire = to_wire(model)
    for name, field in type(model).model_fields.items():
        if getattr(model, name) is None:
            wire[field.alias or name] = None
    return wire


# --- CRD metadata rendered by crdgen ------------------------------------------------------------
@dataclass(frozen=True)
class PrinterColumn:
    """One additionalPrinterColumns entry of a CRD."""

    name: str  # column header
    type: str  # string | integer | number | boolean | date
    json_path: str  # JSONPath into the object, e.g. .status.phase
    description: str  # shown by `kubectl explain`-like tools
    priority: int = 0  # 0: always shown; 1: only with -o wide


@dataclass(frozen=True)
class Resource:
    """Everything crdgen needs to render one CRD of a kind."""

    kind: str  # e.g. SuperNode
    plural: str  # e.g. supernodes
    short_names: tuple[str, ...]  # e.g. ("sn",)
    namespaced: bool  # False: cluster-scoped
    spec: type[ApiModel]  # the spec model
    status: type[ApiModel]  # the status model
    printer_columns: tuple[PrinterColumn, ...]  # `kubectl get` columns, Age added last
    description: str  # top-level description of the kind
    selectable_fields: tuple[str, ...] = ()  # JSONPaths usable in field selectors
    name_rules: tuple[JsonDict, ...] = ()  # CEL rules on metadata.name (the object's root)

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{api.GROUP}"
