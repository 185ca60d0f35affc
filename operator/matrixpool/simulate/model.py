"""The simulator's configuration: cluster shape, job mix, inference demand, failure model,
costs and the policies compared, read from one YAML file (:func:`load`, :func:`parse`).

Called by ``matrixpool simulate``, ``benchmarks/goodput.py`` and the tests. Every error names
the field it is about (``jobs[2].cards: expected a number >= 1, got 0``) as a
:class:`ConfigError`. Units are in the field names: ``_seconds``, ``_hours``, ``_gbps`` (GB/s,
10^9 bytes per second), ``_gb`` (10^9 bytes).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pydantic
import yaml

from matrixpool.api import supernode
from matrixpool.timeshare import windows as windows_
from matrixpool_recovery import policy

COMPONENTS = ("card", "node", "rack", "network", "software")  # fault sources, see failures
TIERS = ("memory", "peers", "local", "persistent")  # restore sources, see costs


class ConfigError(ValueError):
    """A field of the simulator's YAML file is missing, unknown or out of range."""


@dataclass(frozen=True)
class Cluster:
    """The pool: ``supernodes`` supernodes of ``nodes_per_supernode`` nodes in racks."""

    supernodes: int
    nodes_per_supernode: int
    cards_per_node: int
    nodes_per_rack: int
    spares_per_supernode: int  # whole nodes held back for SpareSwap (policies with spares)

    @property
    def cards(self) -> int:
        return self.supernodes * self.nodes_per_supernode * self.cards_per_node


@dataclass(frozen=True)
class Checkpoint:
    """A job's checkpoint spec in steps (TrainingJob spec.checkpoint); 0 = tier off."""

    memory_every_steps: int
    local_every_steps: int
    persistent_every_steps: int


@dataclass(frozen=True)
class JobClass:
    """``count`` training jobs drawn alike; ranges are [low, high], drawn log-uniform (cards)
    or uniform (hours, start)."""

    name: str
    count: int
    cards: tuple[int, int]  # whole nodes above one node; 1, 2, 4 or 8 cards below
    hours: tuple[float, float] | None  # useful work to do; None: runs to the horizon
    start_hours: tuple[float, float]  # arrival time
    priority: int
    step_seconds: float  # one training step
    state_gb_per_card: float  # checkpoint state of one card (weights, optimizer, ...)
    checkpoint: Checkpoint
    windows: frozenset[str] | None = None  # time windows it may run in; None: any
    headline: bool = False  # the job whose goodput is "goodput" in the report


@dataclass(frozen=True)
class Inference:
    """Daily inference demand: a window's cap (cards per supernode) in replicas of
    ``replica_cards`` whole-node cards, placed like an EP320 decode instance."""

    time_sharing: supernode.TimeSharing | None  # None: no inference, no time-sharing
    replica_cards: int
    priority: int


@dataclass(frozen=True)
class Component:
    """One fault source: ``count`` faults per ``reference`` card-hours; the unit it hits
    stays out of service ``repair_hours`` (0: a transient fault, nothing to repair)."""

    count: float
    repair_hours: float


@dataclass(frozen=True)
class ScriptedFault:
    """A fault at a fixed time (tests, the 10,000-card probe), besides the random ones."""

    at_hours: float
    component: str
    node: int | None = None  # node index; None: the first node of the headline job
    rank: int = 0  # with node None: the headline job's rank whose node is hit


@dataclass(frozen=True)
class Failures:
    components: Mapping[str, Component]
    reference_cards: int  # the cluster the counts were observed on
    reference_hours: float  # over this many hours
    scripted: tuple[ScriptedFault, ...] = ()

    def per_card_hour(self, component: str) -> float:
        c = self.components.get(component)
        return 0.0 if c is None else c.count / (self.reference_cards * self.reference_hours)


@dataclass(frozen=True)
class Costs:
    """Seconds and bandwidths of the recovery model (:mod:`.costs`); sources in the YAML."""

    detect_seconds: Mapping[str, float]  # per component
    settle_seconds: float  # node losses wait this long so that a rack is one recovery
    pod_start_seconds: float  # one pod restarted on a known node, until its trainer runs
    gang_start_seconds: float  # placing and starting a whole gang, fixed part
    bind_pods_per_second: float  # ... plus its pods at this rate
    setup_seconds_per_doubling: float  # communicator set-up: this per doubling of ranks
    compile_seconds: float  # graph compile / warm-up after any restart
    bandwidth_gbps: Mapping[str, float]  # per rank, per tier of TIERS
    persistent_aggregate_gbps: float  # the persistent store's total read bandwidth


@dataclass(frozen=True)
class Policy:
    """What ``decide`` is shown and how time-sharing evicts, for one compared policy."""

    name: str
    levels: tuple[policy.Level, ...]  # spec.recovery.levels
    spares: bool  # free spare nodes are shown to decide
    peers: bool  # tier-1 peer copies exist
    fast_tiers: bool  # memory and local tiers exist (False: persistent only)
    tidal: str  # "checkpoint": checkpoint, evict, resume; "kill": evict without checkpoint
    persistent_every_steps: int | None = None  # overrides the jobs' persistent interval
    detect_seconds: Mapping[str, float] = field(default_factory=dict)  # overrides, per component
    blocking_saves: bool = False  # persistent saves stop training while they write

    def costs(self, base: Costs) -> Costs:
        """``base`` with this policy's detection overrides."""
        if not self.detect_seconds:
            return base
        return replace(base, detect_seconds={**base.detect_seconds, **self.detect_seconds})


BUILTIN_POLICIES = {
    "matrixpool": Policy("matrixpool", policy.ALL_LEVELS, True, True, True, "checkpoint"),
    "job_restart": Policy("job_restart", (policy.Level.RESCHEDULE,), False, False, False, "kill"),
    "no_spares": Policy("no_spares", policy.ALL_LEVELS, False, True, True, "checkpoint"),
    "no_peer_copies": Policy("no_peer_copies", policy.ALL_LEVELS, True, False, True, "checkpoint"),
    "tidal_restart": Policy("tidal_restart", policy.ALL_LEVELS, True, True, True, "kill"),
}


@dataclass(frozen=True)
class Config:
    horizon_days: float
    seed: int
    start: dt.datetime  # simulated time zero, aware
    cluster: Cluster
    jobs: tuple[JobClass, ...]
    inference: Inference
    failures: Failures
    costs: Costs
    policies: tuple[Policy, ...]
    sample_hours: float = 6.0  # goodput-over-time sampling period
    probe_cards: int = 0  # > 0: also time one recovery per level of a job this size

    @property
    def horizon_seconds(self) -> float:
        return self.horizon_days * 86400.0

    def with_seed(self, seed: int) -> Config:
        return replace(self, seed=seed)


# ---- loading ---------------------------------------------------------------------------------


def load(path: str | Path) -> Config:
    """The configuration in the YAML file at ``path``."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not YAML: {error}") from error
    return parse(data)


def parse(data: Any) -> Config:
    """The configuration from a parsed YAML document."""
    top = _Fields(data, "")
    config = Config(
        horizon_days=top.number("horizon_days", minimum=0.001),
        seed=int(top.number("seed", default=1)),
        start=_start(top.get("start", "2026-01-05T00:00:00+00:00")),
        cluster=_cluster(top.section("cluster")),
        jobs=tuple(_job(f, f.path) for f in top.items("jobs")),
        inference=_inference(top.section("inference", default={})),
        failures=_failures(top.section("failures")),
        costs=_costs(top.section("costs")),
        policies=_policies(top.get("policies", list(BUILTIN_POLICIES)), top),
        sample_hours=top.number("sample_hours", default=6.0, minimum=0.01),
        probe_cards=int(top.number("probe_cards", default=0)),
    )
    top.done()
    if not config.jobs:
        raise ConfigError("jobs: at least one job class is needed")
    if sum(1 for j in config.jobs if j.headline) > 1:
        raise ConfigError("jobs: at most one job class may be the headline")
    return config


class _Fields:
    """One mapping of the document; remembers the keys read, so unknown keys are reported."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path or 'the file'}: expected a mapping, got {data!r}")
        self.data, self.path, self.read = data, path, set[str]()

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, default: Any = ...) -> Any:
        self.read.add(key)
        if key in self.data:
            return self.data[key]
        if default is ...:
            raise ConfigError(f"{self.name(key)}: missing")
        return default

    def number(self, key: str, default: Any = ..., minimum: float = 0.0) -> float:
        return _number(self.get(key, default), self.name(key), minimum)

    def pair(self, key: str, default: Any = ..., minimum: float = 0.0) -> tuple[float, float]:
        value, name = self.get(key, default), self.name(key)
        low, high = (value, value) if not isinstance(value, list) else [*value, None][:2]
        if isinstance(value, list) and len(value) != 2:
            raise ConfigError(f"{name}: expected a number or [low, high], got {value!r}")
        low, high = _number(low, name, minimum), _number(high, name, minimum)
        if high < low:
            raise ConfigError(f"{name}: high {high} is below low {low}")
        return low, high

    def section(self, key: str, default: Any = ...) -> _Fields:
        return _Fields(self.get(key, default), self.name(key))

    def items(self, key: str) -> list[_Fields]:
        value = self.get(key)
        if not isinstance(value, list):
            raise ConfigError(f"{self.name(key)}: expected a list, got {value!r}")
        return [_Fields(v, f"{self.name(key)}[{k}]") for k, v in enumerate(value)]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.read)
        if unknown:
            raise ConfigError(f"{self.name(unknown[0])}: unknown field")


def _number(value: Any, name: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ConfigError(f"{name}: expected a number >= {minimum:g}, got {value!r}")
    return float(value)


def _start(value: Any) -> dt.datetime:
    try:
        instant = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(value)
        return windows_.utc(instant)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"start: expected an aware ISO 8601 instant, got {value!r}") from error


def _cluster(f: _Fields) -> Cluster:
    cluster = Cluster(
        supernodes=int(f.number("supernodes", minimum=1)),
        nodes_per_supernode=int(f.number("nodes_per_supernode", minimum=1)),
        cards_per_node=int(f.number("cards_per_node", minimum=1)),
        nodes_per_rack=int(f.number("nodes_per_rack", minimum=1)),
        spares_per_supernode=int(f.number("spares_per_supernode", default=0)),
    )
    f.done()
    if cluster.spares_per_supernode >= cluster.nodes_per_supernode:
        raise ConfigError(f"{f.name('spares_per_supernode')}: must be below nodes_per_supernode")
    return cluster


def _job(f: _Fields, path: str) -> JobClass:
    hours = f.get("hours", None)
    windows = f.get("windows", None)
    if windows is not None and not (
        isinstance(windows, list) and all(isinstance(w, str) for w in windows)
    ):
        raise ConfigError(f"{f.name('windows')}: expected a list of window names")
    low, high = f.pair("cards", minimum=1)
    job = JobClass(
        name=str(f.get("name")),
        count=int(f.number("count", default=1, minimum=1)),
        cards=(int(low), int(high)),
        hours=None if hours is None else f.pair("hours", minimum=0.001),
        start_hours=f.pair("start_hours", default=0),
        priority=int(f.number("priority", default=100)),
        step_seconds=f.number("step_seconds", minimum=0.001),
        state_gb_per_card=f.number("state_gb_per_card"),
        checkpoint=_checkpoint(f.section("checkpoint")),
        windows=None if windows is None else frozenset(windows),
        headline=bool(f.get("headline", False)),
    )
    f.done()
    return job


def _checkpoint(f: _Fields) -> Checkpoint:
    checkpoint = Checkpoint(
        memory_every_steps=int(f.number("memory_every_steps", default=0)),
        local_every_steps=int(f.number("local_every_steps", default=0)),
        persistent_every_steps=int(f.number("persistent_every_steps", minimum=1)),
    )
    f.done()
    return checkpoint


def _inference(f: _Fields) -> Inference:
    windows, zone = f.get("windows", None), f.get("timezone", "UTC")
    time_sharing = None
    if windows is not None:
        try:
            time_sharing = supernode.TimeSharing.model_validate(
                {"timezone": zone, "windows": windows}
            )
            windows_.check_cover(time_sharing)
        except (pydantic.ValidationError, ValueError) as error:
            raise ConfigError(f"{f.name('windows')}: {_first_error(error)}") from error
    inference = Inference(
        time_sharing=time_sharing,
        replica_cards=int(f.number("replica_cards", default=320, minimum=1)),
        priority=int(f.number("priority", default=1000)),
    )
    f.done()
    return inference


def _first_error(error: Exception) -> str:
    if isinstance(error, pydantic.ValidationError):
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}"
    return str(error)


def _failures(f: _Fields) -> Failures:
    parts = f.section("components")
    components = {}
    for name in COMPONENTS:
        if name in parts.data:
            c = parts.section(name)
            components[name] = Component(c.number("count"), c.number("repair_hours", default=0))
            c.done()
    parts.done()
    reference = f.section("reference")
    failures = Failures(
        components=components,
        reference_cards=int(reference.number("cards", minimum=1)),
        reference_hours=reference.number("hours", minimum=0.001),
        scripted=tuple(_scripted(s) for s in f.items("scripted")) if "scripted" in f.data else (),
    )
    reference.done()
    f.done()
    return failures


def _scripted(f: _Fields) -> ScriptedFault:
    component = f.get("component")
    if component not in COMPONENTS:
        raise ConfigError(f"{f.name('component')}: expected one of {', '.join(COMPONENTS)}")
    node = f.get("node", None)
    fault = ScriptedFault(
        at_hours=f.number("at_hours"),
        component=component,
        node=None if node is None else int(f.number("node")),
        rank=int(f.number("rank", default=0)),
    )
    f.done()
    return fault


def _costs(f: _Fields) -> Costs:
    detect, bandwidth = f.section("detect_seconds"), f.section("bandwidth_gbps")
    costs = Costs(
        detect_seconds={c: detect.number(c) for c in COMPONENTS},
        settle_seconds=f.number("settle_seconds"),
        pod_start_seconds=f.number("pod_start_seconds"),
        gang_start_seconds=f.number("gang_start_seconds"),
        bind_pods_per_second=f.number("bind_pods_per_second", minimum=0.001),
        setup_seconds_per_doubling=f.number("setup_seconds_per_doubling", default=0),
        compile_seconds=f.number("compile_seconds", default=0),
        bandwidth_gbps={t: bandwidth.number(t, minimum=1e-6) for t in TIERS},
        persistent_aggregate_gbps=f.number("persistent_aggregate_gbps", minimum=1e-6),
    )
    detect.done()
    bandwidth.done()
    f.done()
    return costs


def _policies(value: Any, top: _Fields) -> tuple[Policy, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"policies: expected a list of names of {', '.join(BUILTIN_POLICIES)}")
    overrides = top.section("policy_overrides", default={})
    chosen = []
    for k, name in enumerate(value):
        if name not in BUILTIN_POLICIES:
            raise ConfigError(f"policies[{k}]: unknown policy {name!r}")
        chosen.append(_override(BUILTIN_POLICIES[name], overrides))
    for name in overrides.data:
        overrides.read.add(name)
        if name not in BUILTIN_POLICIES:
            raise ConfigError(f"{overrides.name(name)}: unknown policy")
    return tuple(chosen)


def _override(base: Policy, overrides: _Fields) -> Policy:
    if base.name not in overrides.data:
        return base
    f = overrides.section(base.name)
    levels: Sequence[str] = f.get("levels", [level.value for level in base.levels])
    try:
        parsed = tuple(policy.Level(level) for level in levels)
    except ValueError as error:
        raise ConfigError(f"{f.name('levels')}: {error}") from error
    every = f.get("persistent_every_steps", None)
    detect = f.section("detect_seconds", default={})
    for component in detect.data:
        if component not in COMPONENTS:
            raise ConfigError(f"{detect.name(component)}: expected one of {', '.join(COMPONENTS)}")
    blocking = f.get("blocking_saves", base.blocking_saves)
    if not isinstance(blocking, bool):
        raise ConfigError(f"{f.name('blocking_saves')}: expected true or false")
    result = replace(
        base,
        levels=parsed,
        persistent_every_steps=None if every is None else int(f.number("persistent_every_steps")),
        detect_seconds={c: detect.number(c) for c in detect.data},
        blocking_saves=blocking,
    )
    detect.done()
    f.done()
    return result


def as_dict(config: Config) -> dict[str, Any]:
    """A few figures of the configuration, for the report."""
    return {
        "cards": config.cluster.cards,
        "supernodes": config.cluster.supernodes,
        "horizon_days": config.horizon_days,
        "seed": config.seed,
        "jobs": sum(j.count for j in config.jobs),
    }
