"""Pure functions from a runtime config to the command lines of SGLang 0.5.23 and its router.

Flag names are the pinned release's (`sglang.srt.server_args`, `sglang_router.router_args`);
the unit tests feed every argv back through those parsers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from tessera.runtime.config import (
    ENGINE_VERSION,
    ConfigError,
    DisaggregationConfig,
    RouterConfig,
    RuntimeConfig,
    Transport,
)

# (weights dtype, checkpoint format) -> SGLang --quantization; None: unquantized BF16.
# INT4 loads through the Marlin-backed methods, which SGLang uses on Hopper for W4A16.
QUANTIZATION: dict[tuple[str, str], str | None] = {
    ("bf16", "safetensors"): None,
    ("fp8", "safetensors"): "fp8",
    ("fp8", "compressed-tensors"): "compressed-tensors",
    ("int4", "compressed-tensors"): "compressed-tensors",
    ("int4", "awq"): "awq_marlin",
    ("int4", "gptq"): "gptq_marlin",
}

# kernels.decode_attention -> SGLang --decode-attention-backend; None: SGLang's own choice.
DECODE_ATTENTION_BACKEND: dict[str, str | None] = {
    "tessera": "triton",
    "flashmla": "flashmla",
    "sglang": None,
}

SGLANG_SERVER = (sys.executable, "-m", "sglang.launch_server")
SGLANG_ROUTER = (sys.executable, "-m", "sglang_router.launch_router")


@dataclass(frozen=True)
class NodePlacement:
    """Where this pod sits in a replica that spans nodes (rank 0 hosts the rendezvous)."""

    rank: int
    dist_init_addr: str  # host:port of rank 0


def sglang_argv(config: RuntimeConfig, node: NodePlacement | None = None,
                transport: Transport | None = None) -> list[str]:
    """The arguments for `python -m sglang.launch_server` that serve `config`; `transport`
    is the one preflight chose (default: the config's own), RDMA devices only with rdma."""
    if config.engine_version != ENGINE_VERSION:
        raise ConfigError(
            f"engine_version {config.engine_version} is not supported: this runtime emits "
            f"flags for SGLang {ENGINE_VERSION}; use the runtime image built for that version"
        )
    model, weights, kv, par = config.model, config.weights, config.kv_cache, config.parallel
    argv = [
        "--model-path", model.path,
        "--served-model-name", model.name,
        "--host", "0.0.0.0",
        "--port", str(config.ports.http),
        "--context-length", str(model.context_length),
        # Activations are BF16 for every weight dtype (W4A16, FP8 block scales, BF16).
        "--dtype", "bfloat16",
        "--kv-cache-dtype", kv.dtype,
        "--page-size", str(kv.page_size),
        "--tp-size", str(par.tensor),
        "--ep-size", str(par.expert),
        "--attn-dp-size", str(par.attention_data),
        "--enable-metrics",
    ]
    quantization = QUANTIZATION[(weights.dtype, weights.format)]
    if quantization is not None:
        argv += ["--quantization", quantization]
    if model.trust_remote_code:
        argv.append("--trust-remote-code")
    # Decode only: prefill keeps SGLang's default backend. tessera's decode attention replaces
    # the Triton backend's decode kernel; FlashMLA must be named, SGLang's Hopper default is FA3.
    backend = DECODE_ATTENTION_BACKEND[config.kernels.decode_attention]
    if backend is not None:
        argv += ["--decode-attention-backend", backend]
    if config.memory.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(config.memory.mem_fraction_static)]
    if config.phase != "single":
        pd = config.disaggregation
        argv += [
            "--disaggregation-mode", config.phase,
            "--disaggregation-transfer-backend", pd.transfer_backend,
            "--disaggregation-bootstrap-port", str(config.ports.bootstrap),
        ]
        if pd.ib_devices and (transport or pd.declared_transport) == "rdma":
            argv += ["--disaggregation-ib-device", ",".join(pd.ib_devices)]
        if pd.kv_checksum:
            argv.append("--disaggregation-enable-kv-checksum")
    if par.nnodes > 1:
        if node is None:
            raise ConfigError(
                f"parallel.nnodes is {par.nnodes}: this pod needs its node rank and the "
                "rendezvous address (TESSERA_NODE_RANK, TESSERA_DIST_INIT_ADDR)"
            )
        if not 0 <= node.rank < par.nnodes:
            raise ConfigError(f"node rank {node.rank} is outside 0..{par.nnodes - 1}")
        argv += ["--nnodes", str(par.nnodes), "--node-rank", str(node.rank),
                 "--dist-init-addr", node.dist_init_addr]
    return argv


# The transport, said explicitly in the variables each backend reads, so a pod never quietly
# falls back to TCP when RDMA was asked for (nor tries RDMA when it was not). SGLang 0.5.23
# passes MOONCAKE_PROTOCOL to Mooncake's TransferEngine.initialize; MC_FORCE_TCP=1 makes
# Mooncake install its TCP transport and SGLang skip choosing RDMA devices. NIXL's UCX backend
# (SGLang's default SGLANG_DISAGGREGATION_NIXL_BACKEND) takes its transports from UCX_TLS:
# reliable-connected verbs with CUDA memory support for RDMA; TCP staged through host copies.
TRANSFER_ENV: dict[tuple[str, str], dict[str, str]] = {
    ("mooncake", "rdma"): {"MOONCAKE_PROTOCOL": "rdma"},
    ("mooncake", "tcp"): {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"},
    ("nixl", "rdma"): {"UCX_TLS": "rc,cuda_copy,cuda_ipc"},
    ("nixl", "tcp"): {"UCX_TLS": "tcp,cuda_copy"},
}


def transfer_env(pd: DisaggregationConfig, transport: Transport) -> dict[str, str]:
    """The environment SGLang's transfer backend needs for `transport`."""
    return dict(TRANSFER_ENV[(pd.transfer_backend, transport)])


def _selector(labels: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in sorted(labels.items())]


def router_argv(config: RouterConfig) -> list[str]:
    """The arguments for `python -m sglang_router.launch_router` that serve `config`."""
    argv = ["--host", "0.0.0.0", "--port", str(config.port), "--policy", config.policy,
            "--prometheus-port", str(config.metrics_port)]
    if config.mode == "disaggregated":
        argv.append("--pd-disaggregation")
    if config.discovery is not None:
        d = config.discovery
        argv += ["--service-discovery", "--service-discovery-namespace", d.namespace,
                 "--service-discovery-port", str(d.port)]
        if config.mode == "disaggregated":
            argv += ["--prefill-selector", *_selector(d.prefill_selector),
                     "--decode-selector", *_selector(d.decode_selector)]
        else:
            argv += ["--selector", *_selector(d.single_selector)]
        return argv
    assert config.static is not None  # RouterConfig guarantees one of the two
    s = config.static
    if config.mode == "single":
        return [*argv, "--worker-urls", *s.single]
    for worker in s.prefill:
        port = "none" if worker.bootstrap_port is None else str(worker.bootstrap_port)
        argv += ["--prefill", worker.url, port]
    for url in s.decode:
        argv += ["--decode", url]
    return argv
