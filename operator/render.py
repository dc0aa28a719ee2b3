"""ModelDeployment spec + capacity plan -> the runtime's own config types (pure).

tessera.runtime.config is the one contract with the pods; this module only fills it in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.operator import constants as c
from tessera.operator.children import endpoint_selector, nodes_per_replica, phases_of
from tessera.runtime.config import (
    DisaggregationConfig,
    Discovery,
    IntegrityConfig,
    KernelsConfig,
    KVCacheConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    PortsConfig,
    RouterConfig,
    RuntimeConfig,
    WeightsConfig,
)
from tessera.runtime.planner import DeploymentPlan
from tessera.runtime.planner.decode_attention import choose_decode_attention
from tessera.runtime.planner.w4a16 import choose_w4a16


def checkpoint_path(uri: str) -> str:
    """Where the checkpoint is inside the pod: pvc://claim/dir is mounted at /models/dir,
    file:///dir is used in place; hf/s3/gs are at /models, which is either the cache claim's
    folder for the URI (filled once by a fetch Job) or the pod's own volume (filled by its
    fetch init container before the engine starts): children.py."""
    scheme, _, rest = uri.partition("://")
    if scheme == "file":
        return "/" + rest.lstrip("/")
    if scheme == "pvc":
        _, _, sub = rest.partition("/")
        return f"{c.MODELS_DIR}/{sub}".rstrip("/")
    return c.MODELS_DIR


def runtime_config(md: Mapping[str, Any], plan: DeploymentPlan, phase: str) -> RuntimeConfig:
    spec, meta = md["spec"], md["metadata"]
    raw = spec[phase]
    planned = plan.phases[phase]
    weights = raw["weights"]
    integrity = bool(spec.get("integrity", {}).get("enabled", False))
    return RuntimeConfig(
        deployment=meta["name"],
        namespace=meta["namespace"],
        phase=phase,
        engine_version=spec["engine"].get("version", "0.5.23"),
        model=ModelConfig(name=spec["model"]["name"], path=checkpoint_path(weights["uri"]),
                          uri=weights["uri"], context_length=plan.context_length),
        weights=WeightsConfig(dtype=planned.spec.weights.dtype,
                              format=planned.spec.checkpoint_format,
                              group_size=weights.get("groupSize")),
        kv_cache=KVCacheConfig(dtype=planned.spec.kv_dtype,
                               page_size=planned.spec.page_size),
        parallel=ParallelConfig(tensor=planned.spec.tensor_parallel,
                                expert=planned.spec.expert_parallel,
                                attention_data=planned.spec.attention_data_parallel,
                                nnodes=nodes_per_replica(spec, phase)),
        memory=MemoryConfig(mem_fraction_static=planned.mem_fraction_static,
                            planned_weights_bytes_per_gpu=planned.weights_bytes_per_gpu,
                            planned_kv_pool_bytes_per_gpu=planned.kv_pool_bytes_per_gpu),
        ports=PortsConfig(http=c.PORT_HTTP, bootstrap=c.PORT_BOOTSTRAP),
        # The tag check guards the pool that decodes; SGLang's transfer checksum must be on
        # both roles of a disaggregated pair.
        kernels=KernelsConfig(decode_attention=choose_decode_attention(plan.architecture,
                                                                       planned.spec).impl,
                              w4a16=choose_w4a16(planned.spec).impl),
        integrity=IntegrityConfig(enabled=integrity and phase != c.PREFILL),
        disaggregation=disaggregation_config(spec, phase, integrity),
    )


def disaggregation_config(spec: Mapping[str, Any], phase: str,
                          integrity: bool) -> DisaggregationConfig:
    """The phase's end of the KV transfer: the pool-wide backend and TCP switch, the phase's
    own RDMA devices. A single pool transfers nothing."""
    if phase == c.SINGLE:
        return DisaggregationConfig()
    transfer, network = spec.get("transfer", {}), spec[phase].get("network", {})
    devices = network.get("ibDevices", [c.IB_DEVICES_AUTO])
    return DisaggregationConfig(
        transfer_backend=transfer.get("backend", "mooncake"),
        rdma="rdma" in network,
        ib_devices=() if devices == [c.IB_DEVICES_AUTO] else tuple(devices),
        allow_tcp=bool(transfer.get("allowTCP", False)),
        kv_checksum=integrity)


def router_config(md: Mapping[str, Any]) -> RouterConfig:
    spec, meta = md["spec"], md["metadata"]
    router = spec.get("router", {})
    name = meta["name"]
    single = c.SINGLE in spec
    discovery = Discovery(
        namespace=meta["namespace"], port=c.PORT_HTTP,
        **({"single_selector": endpoint_selector(spec, name, c.SINGLE)} if single else
           {"prefill_selector": endpoint_selector(spec, name, c.PREFILL),
            "decode_selector": endpoint_selector(spec, name, c.DECODE)}))
    return RouterConfig(deployment=name, namespace=meta["namespace"],
                        mode="single" if single else "disaggregated",
                        port=int(router.get("port", 8000)),
                        policy=router.get("policy", "cache_aware"), discovery=discovery)


def render_configs(md: Mapping[str, Any], plan: DeploymentPlan) -> dict[str, str]:
    """Config text per engine phase and for the router, keyed like the ConfigMaps."""
    out = {phase: runtime_config(md, plan, phase).to_json() for phase in phases_of(md["spec"])}
    out[c.ROUTER] = router_config(md).to_json()
    return out
