"""Label, annotation and environment variable names of the matrixpool contract (DESIGN.md).

Used by the handlers (writing pods, reading nodes), placement (reading card annotations), the
dev cluster (labelling simulated nodes) and the tests. Also the two tiny codecs of the
``"0,1,2,3"`` card-list format shared by ``cards`` and ``unhealthy-cards``.
"""

from collections.abc import Iterable

from matrixpool import api

_P = f"{api.GROUP}/"

# --- node labels -------------------------------------------------------------------------
SUPERNODE = _P + "supernode"  # node label: the supernode a node belongs to (used in selectors)
RACK = _P + "rack"  # node label: the rack of a node (the usual first topology key)

# --- node annotations --------------------------------------------------------------------
UNHEALTHY_CARDS = _P + "unhealthy-cards"  # node annotation: "3,5", cards not to be used

# --- checkpoint daemon Leases (matrixpool.k8s.daemonleases) ----------------------------------
CKPT_ENDPOINT = _P + "ckpt-endpoint"  # Lease annotation: "host:port" of the node's daemon
CKPT_DAEMON = _P + "ckpt-daemon"  # Lease label: "true" on every checkpoint daemon's Lease
# Lease annotation: when the daemon was stopped on purpose (its pod deleted: a rollout, an
# upgrade), RFC 3339; removed by the next daemon's first renewal
CKPT_STOPPING = _P + "ckpt-stopping"

# --- pod labels ----------------------------------------------------------------------------
JOB = _P + "job"  # pod label: name of the TrainingJob or InferenceService owning the pod
KIND = _P + "kind"  # pod label: kind of the owner, "TrainingJob" or "InferenceService"
ROLE = _P + "role"  # pod label: InferenceService role name ("trainer" for training pods)
REPLICA = _P + "replica"  # pod label: replica (instance) index within an inference role
RANK = _P + "rank"  # pod label: rank of the pod within its gang, "0".."n-1"
JOB_UID = _P + "job-uid"  # pod label: the owner's UID (a TrainingJob's Service selects on it)

# --- pod annotations -----------------------------------------------------------------------
CARDS = _P + "cards"  # pod annotation: "0,1,2,3", the cards bound to the pod on its node
CHECKPOINT_REQUEST = _P + "checkpoint-request"  # pod annotation: id of a requested checkpoint
RESTORE = _P + "restore"  # pod annotation: JSON {"step", "from", "recovery"}: what to restore
INCARNATION = _P + "incarnation"  # pod annotation: the run a new rank starts as (ms, an int)

# --- pod scheduling and environment ----------------------------------------------------------
SCHEDULER_NAME = "matrixpool"  # schedulerName of every gang pod; kube-scheduler ignores them
ENV_CARDS = "MATRIXPOOL_CARDS"  # env var with the bound cards, same format as CARDS
ENV_JOB = "MATRIXPOOL_JOB"  # env var: the TrainingJob's UID, the name its checkpoints go under
ENV_TOKEN_FILE = "MATRIXPOOL_CKPT_TOKEN_FILE"  # env var: the file holding the job's token
CREDENTIAL_SECRET_PREFIX = "matrixpool-ckpt-"  # + the job's UID: the Secret with its token
CREDENTIAL_KEY = "token"  # the key in that Secret, the file name in the pod
CREDENTIAL_MOUNT = "/var/run/matrixpool/checkpoint"  # where the job's pods see it
# The rest of what a TrainingJob's container gets (docs/concepts.md, "What your training
# container gets"; matrixpool.k8s.pods.TrainingContract):
ENV_RANK = "MATRIXPOOL_RANK"  # the pod's rank (downward API: its label RANK)
ENV_WORLD_SIZE = "MATRIXPOOL_WORLD_SIZE"  # ranks in the gang when the pod was created
ENV_INCARNATION = "MATRIXPOOL_INCARNATION"  # the run it starts as (its annotation INCARNATION)
ENV_CHECKPOINT = "MATRIXPOOL_CHECKPOINT"  # the job's spec.checkpoint as JSON ("{}": none)
ENV_NODE_IP = "MATRIXPOOL_NODE_IP"  # status.hostIP: where the node's daemon listens
ENV_POD_IP = "MATRIXPOOL_POD_IP"  # status.podIP: where an inference pod serves (and /metrics)
ENV_ROLE = "MATRIXPOOL_ROLE"  # an inference pod's role name, e.g. prefill or decode
ENV_DAEMON = "MATRIXPOOL_CKPT_DAEMON"  # "$(MATRIXPOOL_NODE_IP):<port>": the node's daemon
ENV_SOCKET = "MATRIXPOOL_CKPT_SOCKET"  # the node daemon's Unix socket, as the pod mounts it
ENV_ANNOTATIONS_FILE = "MATRIXPOOL_ANNOTATIONS_FILE"  # the pod's annotations, kept current
POD_INFO_MOUNT = "/var/run/matrixpool/pod"  # downward-API files "annotations" and "labels"
DAEMON_PORT = 7040  # the chart's checkpointDaemon.port (operator env MATRIXPOOL_CKPT_DAEMON_PORT)
MEMORY_PATH = "/dev/shm/matrixpool"  # checkpointDaemon.memoryPath (MATRIXPOOL_CKPT_MEMORY_PATH)
PERSISTENT_PATH = "/var/lib/matrixpool/persistent"  # its persistentPath (…_PERSISTENT_PATH)


KV_SECRET_PREFIX = "matrixpool-kv-"  # + an InferenceService's UID: the Secret with its KV token
KV_MOUNT = "/var/run/matrixpool/kv"  # where a service's pods see that token (file CREDENTIAL_KEY)
ENV_KV_SERVICE = "MATRIXPOOL_KV_SERVICE"  # env var: the service's UID, its blocks' owner
ENV_KV_TOKEN_FILE = "MATRIXPOOL_KV_TOKEN_FILE"  # env var: the file holding the service's token
ENV_KV_DAEMONS = "MATRIXPOOL_KV_DAEMONS"  # env var: the pool's daemons, own node's first


def kv_secret(service_uid: str) -> str:
    """The name of the Secret holding the KV-cache token of an InferenceService."""
    return f"{KV_SECRET_PREFIX}{service_uid}"


def credential_secret(job_uid: str) -> str:
    """The name of the Secret holding a TrainingJob's checkpoint token."""
    return f"{CREDENTIAL_SECRET_PREFIX}{job_uid}"


# --- the expert map of an expert-parallel role (docs/concepts.md, "Experts follow their load") --
EXPERTS_MOUNT = "/etc/matrixpool/experts"  # where an expert-parallel pod sees its service's map
ENV_EXPERT_MAP_FILE = "MATRIXPOOL_EXPERT_MAP_FILE"  # env var: its instance's map in that folder
ENV_EXPERTS = "MATRIXPOOL_EXPERTS"  # env var: the role's distinct experts


def expert_map_config_map(service: str) -> str:
    """The name of the ConfigMap holding an InferenceService's expert maps."""
    return f"{service}-expert-map"


def expert_map_key(role: str, replica: int) -> str:
    """The key (and file name) of one instance's expert map in that ConfigMap."""
    return f"{role}-{replica}.json"


# --- torchrun's environment and the HCCL rank table (docs/pytorch.md) ------------------------
CLUSTER_DOMAIN = "cluster.local"  # DNS domain (operator env MATRIXPOOL_CLUSTER_DOMAIN)
RANK_TABLE_KEY = "hccl.json"  # the rank table's key in its ConfigMap, its file name in the pod
RANK_TABLE_MOUNT = "/user/serverid/devindex/config"  # where MindCluster's pods see hccl.json
ENV_RANK_TABLE_FILE = "RANK_TABLE_FILE"  # env var: that file, as Ascend's training scripts read
RANK_TABLE_PREFIX = "matrixpool-hccl-"  # + a TrainingJob's UID: the ConfigMap of its rank table


def rank_table_config_map(job_uid: str) -> str:
    """The name of the ConfigMap holding a TrainingJob's HCCL rank table."""
    return f"{RANK_TABLE_PREFIX}{job_uid}"


ENV_ASCEND_VISIBLE_DEVICES = "ASCEND_VISIBLE_DEVICES"  # set too for huawei.com/* resources
ENV_NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"  # set too for nvidia.com/* resources


def format_cards(cards: Iterable[int]) -> str:
    """``[3, 0, 1]`` → ``"0,1,3"``: the value of CARDS, UNHEALTHY_CARDS and ENV_CARDS."""
    return ",".join(str(c) for c in sorted(set(cards)))


def parse_cards(value: str | None) -> frozenset[int]:
    """``"0, 1,3"`` → ``{0, 1, 3}``; empty or missing → empty. Raises ValueError on junk."""
    if not value:
        return frozenset()
    cards = frozenset(int(part) for part in value.split(",") if part.strip())
    if any(c < 0 for c in cards):
        raise ValueError(f"negative card index in {value!r}")
    return cards
