"""Every name the operator shares with the cluster, the runtime and the RBAC chart, in one place."""

from __future__ import annotations

from tessera.runtime import config as runtime_config

from tessera import API_GROUP, API_VERSION

KIND = "ModelDeployment"
PLURAL = "modeldeployments"
API_VERSION_FULL = f"{API_GROUP}/{API_VERSION}"

# One field manager for every server-side apply, so ownership of fields is stable across restarts.
FIELD_MANAGER = "tessera-operator"

# The phases a ModelDeployment can name; disaggregated mode uses the first two.
PREFILL, DECODE, SINGLE = "prefill", "decode", "single"
PHASES = (PREFILL, DECODE, SINGLE)
ROUTER = "router"
# The Job that converts a phase's weights to INT4 before that phase rolls out (weights.py).
CONVERTER = "convert"
# The Job that fetches hf/s3/gs weights into a cache claim (weights.cache.pvc), weights.py.
FETCHER = "fetch"
# The engine pods' own identity: a ServiceAccount that may only create events (KV integrity).
ENGINE = "engine"

# Labels on every child and on every pod.
LABEL_DEPLOYMENT = f"{API_GROUP}/deployment"
LABEL_PHASE = f"{API_GROUP}/phase"  # prefill | decode | single | router
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "tessera"

# Pod-template annotation: a hash of everything that shapes one phase's pods, so that a change
# to one phase rolls only that phase.
ANNOTATION_PHASE_HASH = f"{API_GROUP}/phase-hash"
# Child annotation: a hash of the whole desired child, so a changed desire is always re-applied
# even when the observed child still looks like a superset of it.
ANNOTATION_DESIRED_HASH = f"{API_GROUP}/desired-hash"
# The SGLang router reads a prefill pod's bootstrap port from this pod annotation.
ANNOTATION_BOOTSTRAP_PORT = "sglang.ai/bootstrap-port"
# Multus reads a pod's secondary networks (NetworkAttachmentDefinitions) from this annotation.
ANNOTATION_NETWORKS = "k8s.v1.cni.cncf.io/networks"
# The one capability an engine pod adds, and only with RDMA: registering memory with the NIC
# locks pages (outside Pod Security `baseline`, so the namespace needs `privileged`).
CAPABILITY_IPC_LOCK = "IPC_LOCK"
# network.ibDevices: [auto] lets the transfer engine pick the pod's RDMA devices.
IB_DEVICES_AUTO = "auto"

# LeaderWorkerSet (sigs.k8s.io/lws): the child of a phase whose replica spans nodes.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
# LWS labels every pod of a group with its index in the group; the leader is "0".
LWS_LABEL_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_LABEL_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_LABEL_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"  # one value a group, set by LWS
LWS_LEADER_INDEX = "0"
# LWS's pod webhook puts these into every container (first in env, so later entries may
# refer to them as $(NAME)): the leader's DNS name and this pod's index in its group.
LWS_ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_ENV_WORKER_INDEX = "LWS_WORKER_INDEX"

# Env keys the runtime reads (the downward API fills the POD_* ones).
ENV_POD_NAME = runtime_config.ENV_POD_NAME
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_POD_UID = "POD_UID"
ENV_RUNTIME_CONFIG = runtime_config.ENV_CONFIG
ENV_NODE_RANK = runtime_config.ENV_NODE_RANK
ENV_DIST_INIT_ADDR = runtime_config.ENV_DIST_INIT_ADDR
# `tessera-runtime` subcommands of engine and router pods.
RUNTIME_ENGINE = ["tessera-runtime", "serve"]
RUNTIME_ROUTER = ["tessera-runtime", "router"]

CONFIG_MOUNT_DIR = "/etc/tessera"
CONFIG_KEY = "runtime.json"
MODELS_DIR = "/models"

# Ports: the runtime config's defaults (SGLang's own for HTTP and bootstrap).
PORT_HTTP = runtime_config.PortsConfig().http
PORT_BOOTSTRAP = runtime_config.PortsConfig().bootstrap
PORT_METRICS = runtime_config.PortsConfig().metrics
# Where a multi-node replica's leader hosts torch.distributed's rendezvous (--dist-init-addr).
PORT_DIST_INIT = 20000
PORT_ROUTER_METRICS = runtime_config.RouterConfig.model_fields["metrics_port"].default
GPU_RESOURCE = "nvidia.com/gpu"

# The Event the runtime posts when the KV page check aborts requests (issue: KV integrity).
EVENT_REASON_KV_MISMATCH = "KVIntegrityMismatch"

# Condition types, in the order they appear in status.
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
PRECISION_VALID = "PrecisionValid"
CAPACITY_PLANNED = "CapacityPlanned"
KV_INTEGRITY = "KVIntegrity"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED, PRECISION_VALID, CAPACITY_PLANNED, KV_INTEGRITY)
# Only on a deployment whose weights a Job fetches (weights.cache) or converts
# (weights.convertFrom), after the others.
WEIGHTS_READY = "WeightsReady"

# Every API call the operator makes: (apiGroup, resource, verbs). Least-privilege RBAC is
# derived from this table (docs/operator.md; the Helm chart), and nothing else may be called.
RBAC_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (API_GROUP, PLURAL, ("get", "list", "watch")),
    (API_GROUP, f"{PLURAL}/status", ("get", "patch")),
    ("", "configmaps", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "services", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "serviceaccounts", ("get", "list", "watch", "create", "patch", "delete")),
    ("apps", "deployments", ("get", "list", "watch", "create", "patch", "delete")),
    # A phase whose replica spans nodes (children.engine_workload).
    ("leaderworkerset.x-k8s.io", LWS_PLURAL, ("get", "list", "watch", "create", "patch", "delete")),
    # The weight fetch and conversion Jobs (weights.cache, weights.convertFrom).
    ("batch", "jobs", ("get", "list", "watch", "create", "patch", "delete")),
    ("policy", "poddisruptionbudgets", ("get", "list", "watch", "create", "patch", "delete")),
    ("rbac.authorization.k8s.io", "roles", ("get", "list", "watch", "create", "patch", "delete")),
    ("rbac.authorization.k8s.io", "rolebindings",
     ("get", "list", "watch", "create", "patch", "delete")),
    # Read by the operator for KVIntegrity; written for condition-change events.
    ("", "events", ("get", "list", "watch", "create")),
    # Watched for why pods do not run (unschedulable, engine exits: refusals.py), and
    # granted onward to the router's ServiceAccount (worker discovery); a stranded group's
    # leader is deleted so that LWS recreates the group (stranded.py).
    ("", "pods", ("get", "list", "watch", "delete")),
    # kopf: CRD discovery and namespace watching.
    ("apiextensions.k8s.io", "customresourcedefinitions", ("get", "list", "watch")),
    ("", "namespaces", ("get", "list", "watch")),
    # Leader election between replicas (leader.py).
    ("coordination.k8s.io", "leases", ("get", "create", "update")),
)
