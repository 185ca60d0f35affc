"""TrainingJob (namespaced, short name ``tj``): a gang of ranks that trains on one supernode,
checkpoints through three tiers and is recovered at the cheapest level the surviving state
allows.

Read by the training handlers (create and bind the gang, write status), placement (gang shape,
affinity, group size), timeshare (windows, elasticity, priority) and the recovery policy
(checkpoint tiers, allowed levels). ``parse`` takes the object as kopf or the API hands it over.
"""

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field

from matrixpool import api
from matrixpool.api import common

KIND = "TrainingJob"
PLURAL = "trainingjobs"
SHORT_NAMES = ("tj",)

# Inference defaults above training (1000 vs 100), so at equal settings inference preempts.
DEFAULT_PRIORITY = 100
MAX_PRIORITY = 1_000_000_000  # as for PriorityClass values
URI = r"^[a-zA-Z][a-zA-Z0-9+.-]*://.+$"  # scheme://rest; a CEL rule then asks for file:///
# Ranks of one job: the bound of spec.replicas and of every per-rank list and map in status
# (a recovery plan names every rank for Reschedule). No CEL rule reads those lists, so their
# size costs the API server's CEL budget nothing.
MAX_RANKS = 1_000_000
DEFAULT_RENDEZVOUS_PORT = 29500  # torchrun's default --master-port
# A job's name names its headless Service (a DNS-1035 label) and its pods' hostnames
# "<name>-<rank>" (a label of at most 63 characters, ranks up to MAX_RANKS - 1: 6 digits).
MAX_NAME_LENGTH = 63 - len(f"-{MAX_RANKS - 1}")
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
# A recovery record lists at most this many of its ranks (status.recoveries[].rankCount counts
# them all): a Reschedule of a large job would otherwise write every rank into every entry.
RANKS_LISTED = 64
# status.recoveries keeps the newest this many entries (status.recoveryCount counts them all),
# so that a long run never outgrows the API server's object size limit.
KEPT_RECOVERIES = 20
KEPT_PREEMPTIONS = 20
KEPT_RESIZES = 20
MAX_TTL_SECONDS = 31_536_000  # spec.ttlSecondsAfterFinished: at most a year


class SuperNodeAffinity(StrEnum):
    """Whether a gang must stay inside one supernode."""

    REQUIRED = "Required"  # the whole gang on one supernode
    PREFERRED = "Preferred"  # one supernode if possible, else spread over several


class RecoveryLevel(StrEnum):
    """Recovery levels, cheapest first."""

    IN_PLACE = "InPlace"  # restart failed ranks where they are, restore from local memory
    SPARE_SWAP = "SpareSwap"  # move the failed node's ranks to a spare, restore from a peer
    RESCHEDULE = "Reschedule"  # place the whole job again, restore from the newest tier left


class Restart(StrEnum):
    """Which pods a recovery replaces (InPlace and SpareSwap; Reschedule replaces all)."""

    RANKS = "Ranks"  # the hit ranks'; the others reload the restore annotation where they run
    GANG = "Gang"  # every rank's, each on its own node and cards unless hit: a plain torchrun
    # script, whose ranks exit when a peer dies, starts again as one world


class Phase(StrEnum):
    """Lifecycle phase of a TrainingJob."""

    PENDING = "Pending"  # waiting for a placement
    SCHEDULED = "Scheduled"  # gang bound, pods starting
    RUNNING = "Running"  # every rank running
    CHECKPOINTING = "Checkpointing"  # asked to checkpoint before a suspension or preemption
    SUSPENDED = "Suspended"  # evicted by a window or preemption; resumes from a checkpoint
    RECOVERING = "Recovering"  # recovering from a fault
    SUCCEEDED = "Succeeded"  # every rank completed
    FAILED = "Failed"  # out of recoveries or unrecoverable


class Placement(common.ApiModel):
    """Placement constraints of the gang."""

    super_node_affinity: SuperNodeAffinity = SuperNodeAffinity.REQUIRED
    """Required: one supernode; Preferred: may span supernodes when one does not fit."""
    group_size: int | None = Field(default=None, ge=1)
    """Ranks that must share one topology domain (the finest topology key), if set."""
    locality_wait_seconds: int = Field(default=0, ge=0, le=3600)
    """Seconds the gang may wait for the fewest racks that could hold it when the cards free now
    would spread it over more (other gangs may take them meanwhile); then it takes what is free.
    0: no wait."""


class MemoryTier(common.ApiModel):
    """Tier 1: node memory held by the checkpoint daemon, copied to peers in other racks."""

    every_steps: int = Field(ge=1)
    """Checkpoint every this many steps."""
    peer_replicas: int = Field(default=1, ge=0, le=8)
    """Copies on daemons of other nodes, in another rack."""


class LocalTier(common.ApiModel):
    """Tier 2: node-local disk."""

    every_steps: int = Field(ge=1)
    """Checkpoint every this many steps."""


class ReclaimPolicy(StrEnum):
    """What happens to tier 3 when a job is deleted (as a PersistentVolume's policy)."""

    RETAIN = "Retain"
    DELETE = "Delete"


class PersistentTier(common.ApiModel):
    """Tier 3: persistent storage addressed by URI."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "self.uri.startsWith('file:///')",
                "spec.checkpoint.persistent.uri must be a file:/// URI (a folder of a file system"
                " shared by the nodes, under the daemons' persistentPath): the checkpoint daemons"
                " write file:// only, not s3:// or any other scheme",
                ".uri",
            ),
        )
    )

    every_steps: int = Field(ge=1)
    """Checkpoint every this many steps."""
    uri: str = Field(max_length=2048, pattern=URI)
    """Where checkpoints go: file:///<path> on a file system shared by the nodes, inside the
    daemons' persistentPath, e.g. file:///var/lib/matrixpool/persistent/llm (file:// only)."""
    reclaim_policy: ReclaimPolicy = ReclaimPolicy.RETAIN
    """What happens to the job's files under the URI when the job is deleted: Retain (kept
    for a later job or a person) or Delete. Tiers 1 and 2 are always deleted."""


class Checkpoint(common.ApiModel):
    """Checkpoint tiers; an absent tier is not used."""

    memory: MemoryTier | None = None
    """Tier 1: node memory plus peer copies."""
    local: LocalTier | None = None
    """Tier 2: node-local disk."""
    persistent: PersistentTier | None = None
    """Tier 3: persistent storage."""
    grace_seconds: int | None = Field(default=None, ge=0, le=86400)
    """Seconds the job may take to answer a checkpoint request before a preemption or a
    time-sharing window takes its pods; absent: its SuperNode's
    spec.timeSharing.checkpointGraceSeconds (else 60 for a preemption)."""


class Rendezvous(common.ApiModel):
    """How the ranks find each other: the torchrun environment every rank's pod gets
    (``MASTER_ADDR`` is rank 0's DNS name ``<job>-0.<job>.<namespace>.svc.<cluster domain>``)."""

    port: int = Field(default=DEFAULT_RENDEZVOUS_PORT, ge=1, le=65535)
    """Rank 0's rendezvous port (MASTER_PORT, PET_MASTER_PORT); default 29500, torchrun's."""
    procs_per_replica: int = Field(default=1, ge=1, le=64)
    """Processes each pod runs (PET_NPROC_PER_NODE, torchrun's --nproc-per-node); WORLD_SIZE
    is replicas times this."""


class Recovery(common.ApiModel):
    """How faults may be recovered."""

    max_recoveries: int = Field(default=10, ge=0, le=10000)
    """Recoveries allowed before the job fails."""
    levels: list[RecoveryLevel] = Field(
        default=[RecoveryLevel.IN_PLACE, RecoveryLevel.SPARE_SWAP, RecoveryLevel.RESCHEDULE],
        min_length=1,
        max_length=3,
        json_schema_extra=common.list_set(),
    )
    """Recovery levels allowed; the cheapest one the fault allows is used."""
    restart: Restart = Restart.RANKS
    """Ranks: only the hit ranks' pods are replaced, the others are told to reload the step
    (a trainer that follows its restore annotation, docs/pytorch.md); Gang: every rank's pod
    is replaced (the others on their own node and cards), as a plain torchrun job needs."""


class TrainingJobSpec(common.ApiModel):
    """The gang, where it may run, when, and how it checkpoints and recovers."""

    model_config = ConfigDict(
        json_schema_extra=common.validations(
            common.rule(
                "!has(self.minReplicas) || self.minReplicas <= self.replicas",
                "spec.minReplicas must be <= spec.replicas",
                ".minReplicas",
            ),
            common.rule(
                "!has(self.placement) || !has(self.placement.groupSize)"
                " || self.placement.groupSize <= self.replicas",
                "spec.placement.groupSize must be <= spec.replicas",
                ".placement.groupSize",
            ),
        )
    )

    super_node: common.DnsSubdomain | None = None
    """SuperNode to run on; absent: any SuperNode that fits."""
    replicas: int = Field(ge=1, le=MAX_RANKS)
    """Pods (ranks) of the gang."""
    min_replicas: int = Field(
        default_factory=lambda data: data.get("replicas", 1), ge=1, le=MAX_RANKS
    )
    """Elastic floor: the job may shrink (data-parallel) down to this; default replicas."""
    cards_per_replica: int = Field(ge=1, le=64)
    """Cards per pod, all on one node."""
    priority: int = Field(default=DEFAULT_PRIORITY, ge=0, le=MAX_PRIORITY)
    """Higher wins; inference defaults above training."""
    placement: Placement = Field(
        default_factory=Placement, json_schema_extra=common.DEFAULT_EMPTY_OBJECT
    )
    """Placement constraints."""
    windows: list[common.DnsLabel] = Field(
        default_factory=list, max_length=24, json_schema_extra=common.list_set()
    )
    """Time windows of the SuperNode the job may run in; empty: any time."""
    template: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra=common.pod_template("spec.template", ("Never",))
    )
    """PodTemplateSpec of every rank; the operator adds cards, env and annotations. Its
    restartPolicy is Never (the default): a failed rank is the operator's to recover, in a new
    pod and a new run, never a container the kubelet restarts in its old one."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    """Checkpoint tiers."""
    rendezvous: Rendezvous = Field(
        default_factory=Rendezvous, json_schema_extra=common.DEFAULT_EMPTY_OBJECT
    )
    """Rank 0's port and the processes per pod, for torchrun's environment."""
    recovery: Recovery = Field(
        default_factory=Recovery, json_schema_extra=common.DEFAULT_EMPTY_OBJECT
    )
    """Fault recovery."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=MAX_TTL_SECONDS)
    """Seconds after the job Succeeded (status.completionTime) before the operator deletes
    its pods, kept until then for their logs and holding no cards, and its checkpoints on
    tiers 1 and 2 (node memory and disk; tier 3 stays); absent: kept until the job is
    deleted. Unlike a Kubernetes Job's field of that name, the TrainingJob itself stays: its
    status is the record of the run (recoveries, preemptions, checkpoint steps) and deleting
    it would delete its checkpoints (tiers 1-2, and tier 3 under reclaimPolicy Delete). A
    Failed job's pods are deleted when it fails, whatever this says."""

    @property
    def cards(self) -> int:
        """Cards of the whole gang at full size."""
        return self.replicas * self.cards_per_replica


class ReplicaCounts(common.ApiModel):
    """Pods of the gang."""

    desired: common.Count = 0
    """Ranks the job runs with now (below spec.replicas while shrunk)."""
    bound: common.Count = 0
    """Ranks bound to a node."""
    running: common.Count = 0
    """Ranks whose pod is running."""


class CheckpointRequest(common.ApiModel):
    """A checkpoint asked of the job before time-sharing takes running pods from it."""

    id: str = Field(max_length=63)
    """The value of the pods' matrixpool.dev/checkpoint-request annotation."""
    requested_at: datetime
    """When it was asked; the pods go at the latest checkpointGraceSeconds later."""
    baseline_step: int | None = Field(default=None, ge=0)
    """Newest step committed for every rank when it was asked; the answer is a newer one."""
    replicas: int = Field(ge=0)
    """Replicas the job keeps afterwards (0: suspended)."""
    window: str | None = Field(default=None, max_length=63)
    """The time-sharing window that asked."""
    evicted_at: datetime | None = None
    """When the job was let go (answered or out of grace): its pods above ``replicas`` are
    being deleted."""


class Suspension(common.ApiModel):
    """One suspension of the job by time-sharing, and its resume."""

    request_id: str = Field(max_length=63)
    """The checkpoint request that preceded it."""
    window: str | None = Field(default=None, max_length=63)
    """The window that suspended the job."""
    reason: str = Field(default="", max_length=63)
    """OutsideWindows (spec.windows) or InsufficientCards (the window's share is too small)."""
    suspended_at: datetime
    """When the pods were evicted."""
    world_size: int = Field(default=0, ge=0)
    """Pods (ranks) the job had when it was suspended."""
    step: int | None = Field(default=None, ge=0)
    """Newest step committed for every rank at eviction: the step it resumes from."""
    answered: bool = False
    """Whether the job committed a new step within checkpointGraceSeconds."""
    checkpoint_seconds: float = Field(default=0.0, ge=0)
    """Seconds from the checkpoint request to the answer (or the deadline)."""
    lost_steps: int | None = Field(default=None, ge=0)
    """Unanswered: steps some rank stored beyond ``step`` (a lower bound of the work lost)."""
    resumed_at: datetime | None = None
    """When every pod was bound again; absent while suspended."""
    restored_step: int | None = Field(default=None, ge=0)
    """The step the resumed pods were told to restore (annotation matrixpool.dev/restore)."""


class PreemptionCheckpoint(StrEnum):
    """What became of the checkpoint a preempted job was asked for."""

    ANSWERED = "Answered"  # a step newer than the one committed when asked, within the grace
    GRACE_EXPIRED = "GraceExpired"  # no newer step within the grace: evicted anyway
    NOT_ASKED = "NotAsked"  # the job saves no checkpoints (or none ran yet): evicted at once


class Preemption(common.ApiModel):
    """One preemption of the job by a higher-priority gang, and its resume."""

    by: str = Field(max_length=512)
    """The gang that took the cards (namespace/name of a TrainingJob; of an InferenceService
    followed by /role/replica)."""
    priority: int
    """Its priority."""
    request_id: str = Field(max_length=63)
    """The pods' matrixpool.dev/checkpoint-request annotation."""
    requested_at: datetime | None = None
    """When the checkpoint was asked; absent when it was not."""
    evicted_at: datetime
    """When the job gave up its pods."""
    replicas_kept: int | None = Field(default=None, ge=0)
    """Replicas an elastic job kept (shrunk); absent: the whole gang was evicted."""
    world_size: int | None = Field(default=None, ge=1)
    """Ranks the job ran as when preempted (the world that wrote ``step``); absent: not known."""
    checkpoint: PreemptionCheckpoint
    """Whether the job checkpointed before it gave up its pods."""
    step: int | None = Field(default=None, ge=0)
    """Newest step committed for every rank at eviction: the step it resumes from."""
    checkpoint_seconds: float | None = Field(default=None, ge=0)
    """Seconds from the request to the answer (or to the end of the grace)."""
    resumed_at: datetime | None = None
    """When the evicted gang was bound again; absent while it waits."""
    restored_step: int | None = Field(default=None, ge=0)
    """The step its new pods were told to restore (annotation matrixpool.dev/restore)."""


class ResizeReason(StrEnum):
    """Why a job's gang changed size."""

    TIME_SHARING = "TimeSharing"  # its SuperNode's time-sharing window changed its allowance
    PREEMPTION = "Preemption"  # shrunk below spec.replicas for a higher priority
    REPLICAS = "Replicas"  # back to (or now) spec.replicas: grown back, or the spec changed


class Resize(common.ApiModel):
    """One regroup: the gang's size changed, so every rank was replaced by one of the new size
    and all restored the newest step every rank of the old size committed."""

    id: str = Field(max_length=63)
    """Names the regroup in the new pods' restore annotation (``resize-<id>``)."""
    from_replicas: int = Field(ge=0)
    """Ranks before (the world the restored step was written by)."""
    to_replicas: int = Field(ge=0)
    """Ranks after."""
    reason: ResizeReason
    """Why the size changed."""
    started_at: datetime
    """When the operator saw the gang's ranks disagree with its size and replaced them."""
    restored_step: int | None = Field(default=None, ge=0)
    """The step the new ranks were told to restore; absent when nothing was committed (they
    started afresh) or while not known yet."""
    finished_at: datetime | None = None
    """When every rank of the new size was bound; absent while under way."""
    seconds: float | None = Field(default=None, ge=0)
    """From ``startedAt`` to ``finishedAt``."""
    superseded_by: str | None = Field(default=None, max_length=63)
    """The time-sharing suspension or whole-gang eviction (its request id) that stopped the job
    before the new ranks ran: its resume restored the job instead, from the newest step every
    rank committed when it stopped."""


class TimeSharingStatus(common.ApiModel):
    """The job under the time-sharing of its SuperNode."""

    checkpoint_request: CheckpointRequest | None = None
    """The checkpoint request under way, if any."""
    suspensions: list[Suspension] = Field(default_factory=list, max_length=32)
    """The latest suspensions, oldest first."""


class CheckpointSteps(common.ApiModel):
    """Newest step complete for every rank, per tier; absent: none yet."""

    memory: int | None = Field(default=None, ge=0)
    """Newest step in node memory."""
    local: int | None = Field(default=None, ge=0)
    """Newest step on local disk."""
    persistent: int | None = Field(default=None, ge=0)
    """Newest step in persistent storage."""
    committed_at: datetime | None = None
    """When the operator first saw the newest of these steps committed (its poll of the
    daemons: within a few seconds of the commit); absent: none seen yet. Preemption reads it
    as the time after which a victim's work would be lost."""


Rank = Annotated[int, Field(ge=0, le=MAX_RANKS - 1)]  # a rank of a gang, 0..replicas-1


class RecoveryRecord(common.ApiModel):
    """One recovery from a fault."""

    id: str = Field(default="", max_length=63)
    """Recovery id (the value trainers see in the restore annotation)."""
    level: RecoveryLevel
    """Level chosen."""
    cause: str = Field(max_length=1024)
    """The fault, e.g. NodeNotReady, CardsUnhealthy, PodFailed, DaemonUnreachable."""
    restored_step: int | None = Field(default=None, ge=0)
    """Step restored; absent: restarted from scratch (see fromScratch)."""
    from_scratch: bool | None = None
    """True when the job had no checkpoint yet (none ever committed, no shard anywhere):
    every rank restarted from step 0; absent otherwise."""
    lost_steps: int | None = Field(default=None, ge=0)
    """Steps trained since the restored checkpoint, lost by the fault."""
    detected_at: datetime
    """When the fault was detected."""
    recovered_at: datetime | None = None
    """When every rank ran again; absent while recovering."""

    ranks: list[Rank] = Field(default_factory=list, max_length=RANKS_LISTED)
    """Ranks restarted or moved, the lowest RANKS_LISTED of them (every rank for
    Reschedule: see rankCount)."""
    rank_count: int | None = Field(default=None, ge=0, le=MAX_RANKS)
    """How many ranks were restarted or moved; absent on records written before it."""
    moves: dict[str, str] = Field(default_factory=dict, max_length=MAX_RANKS)
    """SpareSwap: failed node -> spare node."""

    @property
    def duration(self) -> timedelta | None:
        return None if self.recovered_at is None else self.recovered_at - self.detected_at


class RecoveryInProgress(RecoveryRecord):
    """The recovery being carried out: written before the first pod is touched, so that an
    operator killed halfway is followed by one that finishes it (once)."""

    targets: dict[str, str] = Field(default_factory=dict, max_length=MAX_RANKS)
    """Rank -> node it restarts on (InPlace: its own; SpareSwap: the spare)."""
    cards: dict[str, str] = Field(default_factory=dict, max_length=MAX_RANKS)
    """Rank -> its cards on the target node, "0,1,2,3"."""
    restore: dict[str, str] = Field(default_factory=dict, max_length=MAX_RANKS)
    """Ranks -> the matrixpool.dev/restore annotation they get; a key is a rank, a set of
    ranks and ranges ("0-4095,4100": see ``format_ranks``) or "*" (every rank). Ranks that
    restore the same value share one key, so a plan stays small however many ranks it has."""
    pinned: list[str] = Field(default_factory=list, max_length=MAX_RANKS)
    """Daemons asked to keep the restored step until every rank reloaded it."""


def format_ranks(ranks: Iterable[int]) -> str:
    """Ranks as ascending ranges: [0, 1, 2, 3, 7] -> "0-3,7"."""
    parts: list[str] = []
    ordered = sorted(set(ranks))
    start = 0
    for index, rank in enumerate(ordered):
        if index + 1 == len(ordered) or ordered[index + 1] != rank + 1:
            first = ordered[start]
            parts.append(str(first) if first == rank else f"{first}-{rank}")
            start = index + 1
    return ",".join(parts)


def in_ranks(rank: int, key: str) -> bool:
    """Whether ``key`` (a rank, "a-b" ranges joined by ",", or "*") names ``rank``."""
    if key == "*":
        return True
    for part in key.split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and int(first) <= rank <= int(last or first):
            return True
    return False


def highest_rank(key: str) -> int:
    """The highest rank ``key`` names (as :func:`format_ranks` writes it); -1 for "*" or none."""
    highest = -1
    for part in key.split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (last or first).isdigit():
            highest = max(highest, int(last or first))
    return highest


def restore_for(restore: Mapping[str, str], rank: int) -> str | None:
    """The restore annotation a recovery plan gives ``rank`` (None: not named)."""
    exact = restore.get(str(rank))
    if exact is not None:
        return exact
    return next((value for key, value in restore.items() if in_ranks(rank, key)), None)


def _newest(entries: Any) -> Any:
    """An object written before status.recoveries was bounded may list more: the newest
    KEPT_RECOVERIES are read."""
    return entries[-KEPT_RECOVERIES:] if isinstance(entries, list) else entries


class TrainingJobStatus(common.ApiModel):
    """Observed state of the job, written by the operator."""

    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation this status was computed from."""
    phase: Phase = Phase.PENDING
    """Lifecycle phase."""
    completion_time: datetime | None = None
    """When every rank's pod had Succeeded (phase Succeeded), as a Kubernetes Job's."""
    replicas: ReplicaCounts = Field(default_factory=ReplicaCounts)
    """Rank counts."""
    time_sharing: TimeSharingStatus = Field(default_factory=TimeSharingStatus)
    """Checkpoint requests and suspensions by the SuperNode's time-sharing windows."""
    placement: common.PlacementStatus = Field(default_factory=common.PlacementStatus)
    """Where the gang is bound."""
    checkpoints: CheckpointSteps = Field(default_factory=CheckpointSteps)
    """Newest complete checkpoint step per tier."""
    recoveries: Annotated[list[RecoveryRecord], BeforeValidator(_newest)] = Field(
        default_factory=list, max_length=KEPT_RECOVERIES
    )
    """The newest recoveries (at most 20), oldest first."""
    recovery_count: common.Count = 0
    """Recoveries in all, listed or not; spec.recovery.maxRecoveries bounds it."""
    recovering: RecoveryInProgress | None = None
    """The recovery under way, if any."""
    preemptions: list[Preemption] = Field(default_factory=list, max_length=KEPT_PREEMPTIONS)
    """The newest preemptions (at most 20), oldest first."""
    resizes: list[Resize] = Field(default_factory=list, max_length=KEPT_RESIZES)
    """The newest regroups of an elastic gang to a new size (at most 20), oldest first."""
    conditions: list[common.Condition] = common.conditions_field()
    """Conditions."""


class TrainingJob(common.ApiModel):
    """A whole TrainingJob object."""

    api_version: str = api.API_VERSION
    """matrixpool.dev/v1alpha1."""
    kind: str = KIND
    """TrainingJob."""
    metadata: common.ObjectMeta = Field(default_factory=common.ObjectMeta)
    """Object metadata."""
    spec: TrainingJobSpec
    """Desired state."""
    status: TrainingJobStatus = Field(default_factory=TrainingJobStatus)
    """Observed state."""


def parse(body: Mapping[str, Any]) -> TrainingJob:
    """The whole object (a kopf body or an API dict) as a model."""
    return TrainingJob.model_validate(common.plain(body))


def parse_spec(spec: Mapping[str, Any]) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(common.plain(spec))


def parse_status(status: Mapping[str, Any] | None) -> TrainingJobStatus:
    return TrainingJobStatus.model_validate(common.plain(status or {}))


RESOURCE = common.Resource(
    kind=KIND,
    plural=PLURAL,
    short_names=SHORT_NAMES,
    namespaced=True,
    spec=TrainingJobSpec,
    status=TrainingJobStatus,
    description="TrainingJob is a gang of ranks training on a supernode, with tiered "
    "checkpoints and cheapest-first fault recovery.",
    printer_columns=(
        common.PrinterColumn("Phase", "string", ".status.phase", "Lifecycle phase"),
        common.PrinterColumn(
            "SuperNode", "string", ".status.placement.superNode", "SuperNode holding the gang"
        ),
        common.PrinterColumn("Desired", "integer", ".status.replicas.desired", "Ranks wanted"),
        common.PrinterColumn("Bound", "integer", ".status.replicas.bound", "Ranks bound"),
        common.PrinterColumn("Running", "integer", ".status.replicas.running", "Ranks running"),
        common.PrinterColumn("Cards/Replica", "integer", ".spec.cardsPerReplica", "Cards per rank"),
        common.PrinterColumn(
            "Priority", "integer", ".spec.priority", "Scheduling priority", priority=1
        ),
        common.PrinterColumn(
            "Checkpoint",
            "integer",
            ".status.checkpoints.persistent",
            "Newest persistent checkpoint step",
            priority=1,
        ),
    ),
    selectable_fields=(".spec.superNode",),
    name_rules=(
        common.rule(
            f"size(self.metadata.name) <= {MAX_NAME_LENGTH}"
            f" && self.metadata.name.matches('{NAME_PATTERN}')",
            f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters"
            " (lower-case letters, digits and '-', starting with a letter): it names the job's"
            " headless Service and its pods' hostnames <name>-<rank>",
            ".metadata.name",
        ),
    ),
)
