"""Names shared by the CRD, the renderer, the status logic and the chart.

Kept in one place so that a label key or a child-name suffix cannot drift between
what the operator writes and what it later looks for.
"""

from __future__ import annotations

GROUP = "persia.com"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PersiaJob"
LIST_KIND = "PersiaJobList"
PLURAL = "persiajobs"
SINGULAR = "persiajob"
SHORT_NAMES = ["pj"]
CATEGORIES = ["all", "persia"]
CRD_NAME = f"{PLURAL}.{GROUP}"

# Labels and annotations the operator stamps on what it renders.
LABEL_JOB = "persia.com/job-name"
LABEL_ROLE = "persia.com/role"
# Which whole-job attempt a workload and its pods belong to (see status.attempt).
LABEL_ATTEMPT = "persia.com/attempt"
MANAGED_BY = "persia-operator"
# spec.managedBy values that mean "this operator" (None too).
MANAGED_BY_VALUE = "persia.com/operator"

# Operator bookkeeping on the PersiaJob itself (kopf's progress and diff-base).
ANNOTATION_PREFIX = "persia.com"
FINALIZER = "persia.com/finalizer"
FIELD_MANAGER = "persia-operator"

# Role ids: the value of LABEL_ROLE and the stem of every child name. The stems keep
# PERSIA's pod names: <job>-embedding-ps-0, <job>-nn-worker-0, ...
ROLE_PS = "embedding-ps"
ROLE_EMBEDDING_WORKER = "embedding-worker"
ROLE_NN_WORKER = "nn-worker"
ROLE_DATALOADER = "dataloader"
ROLE_NATS = "nats"
TRAINING_ROLES = (ROLE_PS, ROLE_EMBEDDING_WORKER, ROLE_NN_WORKER, ROLE_DATALOADER)

# spec field of each training role (also the key in status.replicaStatuses).
ROLE_FIELDS = {
    ROLE_PS: "embeddingParameterServer",
    ROLE_EMBEDDING_WORKER: "embeddingWorker",
    ROLE_NN_WORKER: "nnWorker",
    ROLE_DATALOADER: "dataloader",
}
# `persia-launcher` sub-command of each role (PERSIA's names).
LAUNCHER_COMMANDS = {
    ROLE_PS: "embedding-parameter-server",
    ROLE_EMBEDDING_WORKER: "embedding-worker",
    ROLE_NN_WORKER: "nn-worker",
    ROLE_DATALOADER: "data-loader",
}
SERVICE_PORTS = {ROLE_PS: 8888, ROLE_EMBEDDING_WORKER: 8887}
METRICS_PORT = 9090

# the chart's appVersion, as the operator image's: `:latest` made the kubelet pull on every start
# (an image built here or loaded into the nodes was never used) and named PERSIA's own images
DEFAULT_CPU_IMAGE = "persiaml/persia-cpu-runtime:0.1.0"
DEFAULT_CUDA_IMAGE = "persiaml/persia-cuda-runtime:0.1.0"
DEFAULT_NATS_IMAGE = "nats:2.10-alpine"
NATS_CLIENT_PORT = 4222
NATS_CLUSTER_PORT = 6222
NATS_MONITOR_PORT = 8222
# nats-server refuses max_payload above max_pending (64 MiB) at start-up.
NATS_MAX_PAYLOAD_LIMIT = 64 * 1024 * 1024

CONFIG_MOUNT_PATH = "/etc/persia"
GLOBAL_CONFIG_FILE = "global_config.yml"
EMBEDDING_CONFIG_FILE = "embedding_config.yml"

GPU_RESOURCE = "nvidia.com/gpu"

MAX_REPLICAS = 1024
MAX_NATS_REPLICAS = 9
MAX_NPROC_PER_NODE = 64

# A StatefulSet name must leave room for "-<10-char revision hash>" in a 63-char label
# value (kubernetes/kubernetes#64023), so the longest child workload name is 52 chars.
MAX_WORKLOAD_NAME = 52
LONGEST_WORKLOAD_SUFFIX = f"-{ROLE_EMBEDDING_WORKER}"
MAX_JOB_NAME = MAX_WORKLOAD_NAME - len(LONGEST_WORKLOAD_SUFFIX)
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Job names that end so would name a child as another job's child of the same kind: job "x-nats"'s
# ConfigMap "x-nats-config" is job "x"'s NATS ConfigMap, "x-serving"'s "x-serving-config" its
# serving one (test_operator_spec derives the list from every child name).
CLASHING_NAME_ENDINGS = ("-nats", "-serving")

# Condition types, in the order they are listed in status.conditions.
COND_CREATED = "Created"
COND_NATS_READY = "NatsReady"
COND_READY = "Ready"
COND_RESTARTING = "Restarting"
COND_SUSPENDED = "Suspended"
COND_SPEC_ACCEPTED = "SpecAccepted"
COND_SUCCEEDED = "Succeeded"
COND_FAILED = "Failed"
CONDITION_TYPES = (
    COND_CREATED,
    COND_NATS_READY,
    COND_READY,
    COND_RESTARTING,
    COND_SUSPENDED,
    COND_SPEC_ACCEPTED,
    COND_SUCCEEDED,
    COND_FAILED,
)
TERMINAL_CONDITIONS = (COND_SUCCEEDED, COND_FAILED)
