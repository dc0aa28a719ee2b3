"""Desired child objects of one ModelDeployment, as plain dicts (pure; no API calls).

Per phase (prefill and decode, or single): a ConfigMap with the runtime config, the engine
workload, a headless Service for bootstrap and discovery, a PodDisruptionBudget. Once: the
router (a ServiceAccount allowed to discover pods, its Role and RoleBinding, a Deployment, a
Service, a PodDisruptionBudget). Every child carries the deployment's labels and an owner
reference, so deleting the ModelDeployment garbage-collects all of them.

The engine workload is a Deployment (one pod per replica) while a replica's GPUs fit one node
(tensorParallel <= nodePool.gpu.perNode), else a LeaderWorkerSet: one group of pods per
replica, one pod per node, restarted and rolled as a group; only each group's leader is an
endpoint (docs/operator.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from tessera.operator import constants as c
from tessera.runtime import planner
from tessera.runtime.fetch.source import cache_dir, fetch_argv

Obj = dict[str, Any]


def stable_hash(value: Any) -> str:
    """A short content hash, identical for equal JSON values whatever their key order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def phases_of(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The engine phases a spec asks for: ("single",) or ("prefill", "decode")."""
    return (c.SINGLE,) if c.SINGLE in spec else (c.PREFILL, c.DECODE)


def child_name(name: str, component: str, suffix: str = "") -> str:
    return f"{name}-{component}{'-' + suffix if suffix else ''}"


def selector_labels(name: str, component: str) -> dict[str, str]:
    return {c.LABEL_DEPLOYMENT: name, c.LABEL_PHASE: component}


def router_endpoint(md: Mapping[str, Any]) -> str:
    meta, router = md["metadata"], md["spec"].get("router", {})
    service = child_name(meta["name"], c.ROUTER)
    return f"http://{service}.{meta['namespace']}.svc:{router.get('port', 8000)}/v1"


def _owner_reference(md: Mapping[str, Any]) -> Obj:
    return {
        "apiVersion": c.API_VERSION_FULL,
        "kind": c.KIND,
        "name": md["metadata"]["name"],
        "uid": md["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_metadata(md: Mapping[str, Any], name: str, component: str) -> Obj:
    labels = {**selector_labels(md["metadata"]["name"], component),
              c.LABEL_MANAGED_BY: c.MANAGED_BY}
    return {
        "name": name,
        "namespace": md["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [_owner_reference(md)],
    }


def _runtime_env() -> list[Obj]:
    """The pod's identity from the downward API (the runtime names itself in events) and
    where its config is mounted."""
    fields = ((c.ENV_POD_NAME, "metadata.name"), (c.ENV_POD_NAMESPACE, "metadata.namespace"),
              (c.ENV_POD_UID, "metadata.uid"))
    return [*({"name": env, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}
              for env, path in fields),
            {"name": c.ENV_RUNTIME_CONFIG, "value": f"{c.CONFIG_MOUNT_DIR}/{c.CONFIG_KEY}"}]


def fetch_container(image: str, uri: str, credentials_secret: str | None,
                    mount: Obj) -> Obj:
    """`tessera-runtime fetch URI` into `mount`; the Secret's keys become its environment
    (never the operator's to read). Its one-line outcome is the termination message."""
    return {"name": "fetch", "image": image, "command": fetch_argv(uri, mount["mountPath"]),
            **({"envFrom": [{"secretRef": {"name": credentials_secret}}]}
               if credentials_secret else {}),
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": [mount]}


def _models(phase_spec: Mapping[str, Any], image: str,
            checkpoint_bytes: int) -> tuple[Obj | None, Obj | None, list[Obj]]:
    """The engine pod's models volume, its mount and the init containers that fill it:
    - pvc://claim/dir: the claim, read-only;
    - hf/s3/gs with weights.cache.pvc: the cache claim's folder for that URI, read-only
      (a fetch Job filled it before this phase rolled out, weights.py);
    - hf/s3/gs without a cache: an emptyDir of the checkpoint's size, filled by an init
      container at every pod start;
    - file:// needs nothing (the path is in the image or on the node)."""
    weights = phase_spec["weights"]
    uri = weights["uri"]
    scheme, _, rest = uri.partition("://")
    mount = {"name": "models", "mountPath": c.MODELS_DIR, "readOnly": True}
    if scheme == "file":
        return None, None, []
    if scheme == "pvc":
        return ({"name": "models", "persistentVolumeClaim": {"claimName": rest.split("/")[0],
                                                             "readOnly": True}}, mount, [])
    claim = weights.get("cache", {}).get("pvc")
    if claim:
        return ({"name": "models", "persistentVolumeClaim": {"claimName": claim,
                                                             "readOnly": True}},
                {**mount, "subPath": cache_dir(uri)}, [])
    # Room for the checkpoint plus 5% (file-system overhead, the fetch's own state).
    size = {"sizeLimit": str(checkpoint_bytes + checkpoint_bytes // 20)} if checkpoint_bytes else {}
    fetch = fetch_container(image, uri, weights.get("credentialsSecret"),
                            {"name": "models", "mountPath": c.MODELS_DIR})
    return {"name": "models", "emptyDir": size}, mount, [fetch]


def phase_scheduling(spec: Mapping[str, Any], phase: str) -> Obj:
    """The node selector (pool merged with phase), the pool's tolerations and priority class
    of a phase's pods."""
    pool = spec.get("nodePool", {})
    out: Obj = {}
    selector = {**pool.get("nodeSelector", {}), **spec[phase].get("nodeSelector", {})}
    if selector:
        out["nodeSelector"] = selector
    if pool.get("tolerations"):
        out["tolerations"] = [dict(t) for t in pool["tolerations"]]
    return {**out, **_priority(spec)}


def group_affinity(spec: Mapping[str, Any], name: str, phase: str) -> Obj:
    """Every pod of one LeaderWorkerSet group on nodes sharing one value of the pool's
    `replicaTopologyKey` (a leaf switch, a rack): a replica's collectives then cross no spine.
    LWS labels a group's pods with their group's key; `matchLabelKeys` turns that into "my own
    group", so other groups may share the domain (unlike LWS's exclusive-topology).

    The scheduler places one pod at a time, so two groups' leaders can land in one block that
    holds only one group: both groups' workers then wait there forever (seen on the e2e's two
    blocks of two nodes). Each group's pods therefore prefer blocks holding no other group's
    pods (`mismatchLabelKeys`: any LWS group but mine); where blocks are larger they may
    still share one."""
    key = spec.get("nodePool", {}).get("replicaTopologyKey")
    if not key or nodes_per_replica(spec, phase) == 1:
        return {}
    own = {"labelSelector": {"matchLabels": selector_labels(name, phase)},
           "matchLabelKeys": [c.LWS_LABEL_GROUP_KEY], "topologyKey": key}
    others = {"labelSelector": {"matchExpressions": [{"key": c.LWS_LABEL_GROUP_INDEX,
                                                      "operator": "Exists"}]},
              "mismatchLabelKeys": [c.LWS_LABEL_GROUP_KEY], "topologyKey": key}
    return {"affinity": {
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [own]},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": others}]},
    }}  # fmt: skip


def _priority(spec: Mapping[str, Any]) -> Obj:
    """The pool's priority class, for every pod of the deployment."""
    name = spec.get("nodePool", {}).get("priorityClassName")
    return {"priorityClassName": name} if name else {}


def _http_probe(path: str, period: int, failures: int) -> Obj:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


DEFAULT_GPUS_PER_NODE = 8  # the CRD's default nodePool.gpu.perNode


def gpus_per_node(spec: Mapping[str, Any]) -> int:
    return int(spec.get("nodePool", {}).get("gpu", {}).get("perNode", DEFAULT_GPUS_PER_NODE))


def gpus_per_replica(phase_spec: Mapping[str, Any]) -> int:
    return int(phase_spec.get("tensorParallel", 8))


def gpus_per_pod(phase_spec: Mapping[str, Any], per_node: int) -> int:
    """A replica's GPUs, or one node's when the replica spans nodes (one pod per node)."""
    return min(gpus_per_replica(phase_spec), per_node)


def nodes_per_replica(spec: Mapping[str, Any], phase: str) -> int:
    """How many nodes one replica of `phase` spans (the CRD admits only whole nodes)."""
    return planner.nodes_per_replica(gpus_per_replica(spec[phase]), gpus_per_node(spec))


def workload_kind(spec: Mapping[str, Any], phase: str) -> str:
    """The kind of a phase's engine workload: a LeaderWorkerSet when a replica spans nodes."""
    return c.LWS_KIND if nodes_per_replica(spec, phase) > 1 else "Deployment"


def endpoint_selector(spec: Mapping[str, Any], name: str, phase: str) -> dict[str, str]:
    """The pods of `phase` that serve requests: every pod, or each group's leader (the other
    pods of a group run its remaining ranks and serve nothing)."""
    labels = selector_labels(name, phase)
    if nodes_per_replica(spec, phase) > 1:
        labels[c.LWS_LABEL_WORKER_INDEX] = c.LWS_LEADER_INDEX
    return labels


# An engine pod's host needs a GPU, where the phase's `resources` leaves them unset: its
# scheduler process polls a core without sleeping, and NCCL, the tokenizer and the detokenizer
# want more; the process holds a CUDA context, torch and NCCL buffers.
CPUS_PER_GPU = 4
MEMORY_GIB_PER_GPU = 16
SHM_GIB = 64  # the pod's /dev/shm (NCCL, SGLang's scheduler), a memory-backed emptyDir


# How long a stopping engine may drain, where the phase leaves it unset: SGLang finishes its
# in-flight requests on SIGTERM (checking every 5 s), then gives its schedulers 15 s to exit and
# its other processes 60 s; Kubernetes' default 30 s would cut a long answer mid-way.
DRAIN_SECONDS = 600


def host_requests(phase_spec: Mapping[str, Any], gpus: int) -> Obj:
    """The CPU and memory an engine pod of `gpus` GPUs requests: the phase's `resources`, or
    the per-GPU defaults plus its /dev/shm (which counts as the pod's memory)."""
    asked = phase_spec.get("resources", {})
    return {"cpu": str(asked.get("cpu", CPUS_PER_GPU * gpus)),
            "memory": str(asked.get("memory", f"{MEMORY_GIB_PER_GPU * gpus + SHM_GIB}Gi"))}


def phase_network(phase_spec: Mapping[str, Any]) -> tuple[Obj, Obj, Obj, Obj]:
    """A phase's KV-transfer network as pod parts: (extra resources per pod, container
    security context, pod annotations, pod spec fields). All empty without `network`."""
    network = phase_spec.get("network", {})
    rdma = network.get("rdma")
    resources = {rdma["resource"]: str(rdma.get("count", 1))} if rdma else {}
    security = {"capabilities": {"add": [c.CAPABILITY_IPC_LOCK]}} if rdma else {}
    annotations = ({c.ANNOTATION_NETWORKS: ",".join(network["attachments"])}
                   if network.get("attachments") else {})
    # In the node's namespace the pod must still resolve cluster names (bootstrap, router).
    host = ({"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
            if network.get("hostNetwork") else {})
    return resources, security, annotations, host


def config_map(md: Mapping[str, Any], phase: str, config_text: str) -> Obj:
    name = child_name(md["metadata"]["name"], phase, "config")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": owned_metadata(md, name, phase),
            "data": {c.CONFIG_KEY: config_text}}


def _group_env() -> list[Obj]:
    """A group pod's rank and its leader's rendezvous address, from what LWS injects."""
    return [{"name": c.ENV_NODE_RANK, "value": f"$({c.LWS_ENV_WORKER_INDEX})"},
            {"name": c.ENV_DIST_INIT_ADDR,
             "value": f"$({c.LWS_ENV_LEADER_ADDRESS}):{c.PORT_DIST_INIT}"}]


def engine_pod_template(md: Mapping[str, Any], phase: str, config_text: str,
                        checkpoint_bytes: int = 0) -> Obj:
    """The engine pod of `phase`: the same for a Deployment's pods and for every pod of a
    LeaderWorkerSet group (leader and workers run the same runtime config; only their rank
    differs, and LWS provides it)."""
    spec, name = md["spec"], md["metadata"]["name"]
    phase_spec = spec[phase]
    multi_node = nodes_per_replica(spec, phase) > 1
    gpus = gpus_per_pod(phase_spec, gpus_per_node(spec))
    models_volume, models_mount, init_containers = _models(phase_spec, spec["engine"]["image"],
                                                           checkpoint_bytes)
    host = host_requests(phase_spec, gpus)
    # The fetch asks for the engine's CPU and memory: the pod's request is the larger of an init
    # container's and the engine's, so this costs the node nothing, and a download sharing the
    # node with busy pods gets its share of CPU instead of the least.
    init_containers = [{**init, "resources": {"requests": dict(host)}}
                       for init in init_containers]
    labels = selector_labels(name, phase)
    # The runtime config is mounted, not part of the template: its hash in the template is what
    # rolls this phase's pods (and only this phase's) when its config changes.
    annotations = {c.ANNOTATION_PHASE_HASH: stable_hash(config_text)}
    rdma_resources, security, network_annotations, host_network = phase_network(phase_spec)
    annotations.update(network_annotations)
    resources = {c.GPU_RESOURCE: str(gpus), **rdma_resources}
    # Weights fetched into an emptyDir fill the node's local disk: its size is requested, so the
    # scheduler places the pod only where they fit (a node short of disk would fail the fetch
    # part-way, or evict the pod under disk pressure).
    disk = (models_volume or {}).get("emptyDir", {}).get("sizeLimit")
    local_disk = {"ephemeral-storage": disk} if disk else {}
    ports = [{"name": "http", "containerPort": c.PORT_HTTP, "protocol": "TCP"},
             {"name": "metrics", "containerPort": c.PORT_METRICS, "protocol": "TCP"}]
    if phase == c.PREFILL:
        annotations[c.ANNOTATION_BOOTSTRAP_PORT] = str(c.PORT_BOOTSTRAP)
        ports.append({"name": "bootstrap", "containerPort": c.PORT_BOOTSTRAP, "protocol": "TCP"})
    if multi_node:
        ports.append({"name": "dist-init", "containerPort": c.PORT_DIST_INIT, "protocol": "TCP"})
    container = {
        "name": "engine",
        "image": spec["engine"]["image"],
        "command": list(c.RUNTIME_ENGINE),
        "env": _runtime_env() + (_group_env() if multi_node else []),
        "ports": ports,
        # Extended resources (GPUs, RDMA devices) need requests equal to limits; CPU, memory
        # and local disk are requested only (a limit would throttle or kill the engine).
        "resources": {"requests": {**host, **resources, **local_disk},
                      "limits": dict(resources)},
        **({"securityContext": security} if security else {}),
        # SGLang: /health answers once the server is up; loading a 1T-parameter checkpoint can
        # take half an hour, which the startup probe allows before liveness applies.
        "startupProbe": _http_probe("/health", 10, 180),
        "readinessProbe": _http_probe("/health", 10, 3),
        "livenessProbe": _http_probe("/health", 30, 5),
        "volumeMounts": [{"name": "config", "mountPath": c.CONFIG_MOUNT_DIR, "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"},
                         *([models_mount] if models_mount else [])],
    }
    pod_spec = {
        **phase_scheduling(spec, phase),
        **group_affinity(spec, name, phase),
        **host_network,
        "terminationGracePeriodSeconds": int(phase_spec.get("terminationGracePeriodSeconds",
                                                            DRAIN_SECONDS)),
        "serviceAccountName": child_name(name, c.ENGINE),
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container],
        "volumes": [
            {"name": "config",
             "configMap": {"name": child_name(name, phase, "config")}},
            # NCCL and SGLang's scheduler exchange tensors through shared memory.
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_GIB}Gi"}},
            *([models_volume] if models_volume else []),
        ],
    }
    return {"metadata": {"labels": {**labels, c.LABEL_MANAGED_BY: c.MANAGED_BY},
                         "annotations": annotations},
            "spec": pod_spec}


def engine_deployment(md: Mapping[str, Any], phase: str, config_text: str,
                      checkpoint_bytes: int = 0) -> Obj:
    name = md["metadata"]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owned_metadata(md, child_name(name, phase), phase),
        "spec": {
            "replicas": int(md["spec"][phase].get("replicas", 1)),
            "selector": {"matchLabels": selector_labels(name, phase)},
            # Never two copies of a replica's GPUs at once: roll by replacing, one at a time.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": engine_pod_template(md, phase, config_text, checkpoint_bytes),
        },
    }


def engine_group_set(md: Mapping[str, Any], phase: str, config_text: str,
                     checkpoint_bytes: int = 0) -> Obj:
    """A LeaderWorkerSet: one group of `nodes_per_replica` pods per replica."""
    spec, name = md["spec"], md["metadata"]["name"]
    return {
        "apiVersion": c.LWS_API_VERSION,
        "kind": c.LWS_KIND,
        "metadata": owned_metadata(md, child_name(name, phase), phase),
        "spec": {
            "replicas": int(spec[phase].get("replicas", 1)),
            # Workers start with their leader; SGLang's ranks wait for each other anyway.
            "startupPolicy": "LeaderCreated",
            # As for a Deployment: one group down at a time, never a surplus group's GPUs.
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxUnavailable": 1, "maxSurge": 0}},
            "leaderWorkerTemplate": {
                "size": nodes_per_replica(spec, phase),
                # One rank lost stalls the whole replica's collectives: restart them together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": engine_pod_template(md, phase, config_text,
                                                      checkpoint_bytes),
            },
        },
    }


def engine_workload(md: Mapping[str, Any], phase: str, config_text: str,
                    checkpoint_bytes: int = 0) -> Obj:
    """`checkpoint_bytes` sizes the volume a pod fetches its weights into (0: unbounded)."""
    if workload_kind(md["spec"], phase) == c.LWS_KIND:
        return engine_group_set(md, phase, config_text, checkpoint_bytes)
    return engine_deployment(md, phase, config_text, checkpoint_bytes)


def engine_service(md: Mapping[str, Any], phase: str) -> Obj:
    """Headless: the router and the decode pods need each pod's own address (bootstrap)."""
    name = md["metadata"]["name"]
    ports = [{"name": "http", "port": c.PORT_HTTP, "targetPort": "http", "protocol": "TCP"}]
    if phase == c.PREFILL:
        ports.append({"name": "bootstrap", "port": c.PORT_BOOTSTRAP, "targetPort": "bootstrap",
                      "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_metadata(md, child_name(name, phase), phase),
        "spec": {"clusterIP": "None", "selector": endpoint_selector(md["spec"], name, phase),
                 "ports": ports},
    }


def disruption_budget(md: Mapping[str, Any], component: str) -> Obj:
    name = md["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owned_metadata(md, child_name(name, component), component),
        "spec": {"maxUnavailable": 1,
                 "selector": {"matchLabels": selector_labels(name, component)}},
    }


# The router's requests (estimated, not measured): one core and a little memory for its prefix
# tree, so it is not the first pod evicted from a node short of memory (it is every request's
# way in).
ROUTER_REQUESTS = {"cpu": "1", "memory": "2Gi"}


def router_deployment(md: Mapping[str, Any], config_text: str) -> Obj:
    spec, name = md["spec"], md["metadata"]["name"]
    router = spec.get("router", {})
    port = int(router.get("port", 8000))
    labels = selector_labels(name, c.ROUTER)
    container = {
        "name": "router",
        "image": spec["engine"]["image"],
        "command": list(c.RUNTIME_ROUTER),
        "env": _runtime_env(),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": c.PORT_ROUTER_METRICS, "protocol": "TCP"}],
        "resources": {"requests": dict(ROUTER_REQUESTS)},  # no GPU, and no limits
        "readinessProbe": _http_probe("/health", 5, 3),
        "livenessProbe": _http_probe("/health", 15, 4),
        "volumeMounts": [{"name": "config", "mountPath": c.CONFIG_MOUNT_DIR, "readOnly": True}],
    }
    pod_spec: Obj = {
        **_priority(spec),
        "serviceAccountName": child_name(name, c.ROUTER),
        "containers": [container],
        "volumes": [{"name": "config",
                     "configMap": {"name": child_name(name, c.ROUTER, "config")}}],
    }
    # The router needs no GPU; it tolerates the pool's taints so it may run beside the engines.
    if spec.get("nodePool", {}).get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in spec["nodePool"]["tolerations"]]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owned_metadata(md, child_name(name, c.ROUTER), c.ROUTER),
        "spec": {
            "replicas": int(router.get("replicas", 1)),
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": {**labels, c.LABEL_MANAGED_BY: c.MANAGED_BY},
                             "annotations": {c.ANNOTATION_PHASE_HASH: stable_hash(config_text)}},
                "spec": pod_spec,
            },
        },
    }


def router_children(md: Mapping[str, Any], config_text: str) -> list[Obj]:
    """The router: its config, a ServiceAccount that may discover the engine pods by label,
    the Deployment, its Service (the endpoint) and a PodDisruptionBudget."""
    spec, name, namespace = md["spec"], md["metadata"]["name"], md["metadata"]["namespace"]
    rname = child_name(name, c.ROUTER)
    meta = owned_metadata(md, rname, c.ROUTER)
    return [
        config_map(md, c.ROUTER, config_text),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": owned_metadata(md, rname, c.ROUTER),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": owned_metadata(md, rname, c.ROUTER),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rname},
         "subjects": [{"kind": "ServiceAccount", "name": rname, "namespace": namespace}]},
        router_deployment(md, config_text),
        {"apiVersion": "v1", "kind": "Service", "metadata": owned_metadata(md, rname, c.ROUTER),
         "spec": {"selector": selector_labels(name, c.ROUTER),
                  "ports": [{"name": "http", "port": int(spec.get("router", {}).get("port", 8000)),
                             "targetPort": "http", "protocol": "TCP"}]}},
        disruption_budget(md, c.ROUTER),
    ]


def engine_identity(md: Mapping[str, Any]) -> list[Obj]:
    """The engine pods' ServiceAccount: it may create events in its own namespace and nothing
    else (the KV-integrity reporter names its pod in a `KVIntegrityMismatch` event)."""
    name, namespace = md["metadata"]["name"], md["metadata"]["namespace"]
    ename = child_name(name, c.ENGINE)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": owned_metadata(md, ename, c.ENGINE)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": owned_metadata(md, ename, c.ENGINE),
         "rules": [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": owned_metadata(md, ename, c.ENGINE),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ename},
         "subjects": [{"kind": "ServiceAccount", "name": ename, "namespace": namespace}]},
    ]


def desired_children(md: Mapping[str, Any], configs: Mapping[str, str],
                     extra: Sequence[Obj] = (),
                     checkpoint_bytes: Mapping[str, int] | None = None) -> list[Obj]:
    """Every child of `md`, given the rendered config text of each phase and the router,
    `extra` children built elsewhere (the weight fetch and conversion Jobs, weights.py) and
    the planner's checkpoint size per phase.

    Each child carries a hash of itself, so the reconciler can tell a changed desire from an
    unchanged one without a write (see apply.needs_apply).
    """
    children: list[Obj] = engine_identity(md)
    for phase in phases_of(md["spec"]):
        children += [config_map(md, phase, configs[phase]),
                     engine_workload(md, phase, configs[phase],
                                     (checkpoint_bytes or {}).get(phase, 0)),
                     engine_service(md, phase),
                     disruption_budget(md, phase)]
    children += router_children(md, configs[c.ROUTER])
    children += extra
    for child in children:
        child["metadata"]["annotations"] = {c.ANNOTATION_DESIRED_HASH: stable_hash(child)}
    return children
