"""Every precision combination's argv, parsed back by SGLang 0.5.23's and the router's own
parsers (installed by scripts/sglang-no-deps.txt), yields the intended settings."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError
from tessera.runtime.config import (
    FORMATS_FOR_DTYPE,
    ConfigError,
    DisaggregationConfig,
    Discovery,
    KernelsConfig,
    KVCacheConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    PortsConfig,
    PrefillWorker,
    RouterConfig,
    RuntimeConfig,
    StaticWorkers,
    WeightsConfig,
)
from tessera.runtime.sglang_args import QUANTIZATION, NodePlacement, router_argv, sglang_argv

server_args = pytest.importorskip(
    "sglang.srt.server_args",
    reason="SGLang is not installed: pip install --no-deps -r scripts/sglang-no-deps.txt",
)
router_args = pytest.importorskip(
    "sglang_router.router_args",
    reason="sglang-router is not installed: pip install --no-deps -r scripts/sglang-no-deps.txt",
)

WEIGHTS = [(dtype, fmt) for dtype, formats in FORMATS_FOR_DTYPE.items() for fmt in formats]
# What SGLang should end up with for each (weights dtype, format).
EXPECTED_QUANTIZATION = {
    ("bf16", "safetensors"): None,
    ("fp8", "safetensors"): "fp8",
    ("fp8", "compressed-tensors"): "compressed-tensors",
    ("int4", "compressed-tensors"): "compressed-tensors",
    ("int4", "awq"): "awq_marlin",
    ("int4", "gptq"): "gptq_marlin",
}


def make_config(phase: str, weights: tuple[str, str], kv: str, **overrides) -> RuntimeConfig:
    dtype, fmt = weights
    fields = dict(
        deployment="glm", namespace="llm", phase=phase,
        model=ModelConfig(name="zai/GLM-5", path="/models/glm", context_length=32768),
        weights=WeightsConfig(dtype=dtype, format=fmt, group_size=128 if dtype == "int4" else None),
        kv_cache=KVCacheConfig(dtype=kv, page_size=32),
        parallel=ParallelConfig(tensor=8, expert=4, attention_data=2),
        memory=MemoryConfig(mem_fraction_static=0.83),
        ports=PortsConfig(http=31000, bootstrap=9000),
    )
    fields.update(overrides)
    return RuntimeConfig(**fields)


def parse(argv: list[str]):
    return server_args.prepare_server_args(argv)


def test_every_weights_format_has_a_quantization_flag():
    assert set(QUANTIZATION) == set(WEIGHTS) == set(EXPECTED_QUANTIZATION)


@pytest.mark.parametrize("phase", ["prefill", "decode", "single"])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("weights", WEIGHTS, ids=lambda w: "-".join(w))
def test_argv_parses_to_the_intended_settings(phase, kv, weights):
    parsed = parse(sglang_argv(make_config(phase, weights, kv)))
    assert parsed.model_path == "/models/glm"
    assert parsed.served_model_name == "zai/GLM-5"
    assert (parsed.host, parsed.port) == ("0.0.0.0", 31000)
    assert parsed.context_length == 32768
    assert parsed.dtype == "bfloat16"
    assert parsed.quantization == EXPECTED_QUANTIZATION[weights]
    assert parsed.kv_cache_dtype == kv
    assert parsed.page_size == 32
    assert (parsed.tp_size, parsed.ep_size, parsed.attn_dp_size) == (8, 4, 2)
    assert parsed.mem_fraction_static == pytest.approx(0.83)
    assert parsed.enable_metrics is True
    assert parsed.trust_remote_code is False
    assert parsed.nnodes == 1
    if phase == "single":
        assert parsed.disaggregation_mode == "null"
    else:
        assert parsed.disaggregation_mode == phase
        assert parsed.disaggregation_transfer_backend == "mooncake"
        assert parsed.disaggregation_bootstrap_port == 9000
        assert parsed.disaggregation_ib_device is None
        assert parsed.disaggregation_enable_kv_checksum is False


def test_disaggregation_extras_and_remote_code():
    config = make_config(
        "decode", ("int4", "compressed-tensors"), "fp8_e4m3",
        model=ModelConfig(name="kimi", path="/models/kimi", trust_remote_code=True),
        disaggregation=DisaggregationConfig(transfer_backend="nixl", rdma=True,
                                            ib_devices=("mlx5_0", "mlx5_1"), kv_checksum=True),
        memory=MemoryConfig(),
    )
    parsed = parse(sglang_argv(config))
    assert parsed.trust_remote_code is True
    assert parsed.disaggregation_transfer_backend == "nixl"
    assert parsed.disaggregation_ib_device == "mlx5_0,mlx5_1"
    assert parsed.disaggregation_enable_kv_checksum is True
    assert parsed.mem_fraction_static is None  # SGLang sizes it itself
    # Preflight fell back to TCP (spec.transfer.allowTCP): no RDMA devices on the command line.
    assert parse(sglang_argv(config, transport="tcp")).disaggregation_ib_device is None


@pytest.mark.parametrize("impl, backend", [
    ("sglang", None), ("tessera", "triton"), ("flashmla", "flashmla")])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_decode_attention_selects_sglangs_decode_backend(impl, backend, kv):
    config = make_config("decode", ("int4", "compressed-tensors"), kv,
                         kv_cache=KVCacheConfig(dtype=kv, page_size=64),
                         kernels=KernelsConfig(decode_attention=impl))
    parsed = parse(sglang_argv(config))
    assert parsed.decode_attention_backend == backend
    assert parsed.attention_backend is None  # prefill keeps SGLang's default
    assert (parsed.page_size, parsed.kv_cache_dtype) == (64, kv)


def test_flashmla_needs_64_token_pages():
    with pytest.raises(ValidationError, match="flashmla reads 64-token pages, the KV cache has 32"):
        make_config("decode", ("bf16", "safetensors"), "bf16",
                    kernels=KernelsConfig(decode_attention="flashmla"))


def test_multi_node_placement():
    config = make_config("prefill", ("fp8", "safetensors"), "bf16",
                         parallel=ParallelConfig(tensor=16, expert=16, nnodes=2))
    parsed = parse(sglang_argv(config, NodePlacement(rank=1, dist_init_addr="10.1.2.3:20000")))
    assert (parsed.nnodes, parsed.node_rank, parsed.dist_init_addr) == (2, 1, "10.1.2.3:20000")
    assert parsed.tp_size == 16
    with pytest.raises(ConfigError, match="TESSERA_NODE_RANK"):
        sglang_argv(config)
    with pytest.raises(ConfigError, match="outside 0..1"):
        sglang_argv(config, NodePlacement(rank=2, dist_init_addr="10.1.2.3:20000"))


def test_other_engine_version_is_refused():
    config = make_config("single", ("bf16", "safetensors"), "bf16", engine_version="0.6.0")
    with pytest.raises(ConfigError, match="SGLang 0.5.23"):
        sglang_argv(config)


def parse_router(argv: list[str]):
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser)
    parsed = router_args.RouterArgs.from_cli_args(parser.parse_args(argv))
    parsed._validate_router_args()
    return parsed


def test_router_static_disaggregated():
    config = RouterConfig(
        deployment="kimi", namespace="llm", mode="disaggregated", port=8000, policy="round_robin",
        static=StaticWorkers(
            prefill=(PrefillWorker(url="http://p-0:30000", bootstrap_port=8998),
                     PrefillWorker(url="http://p-1:30000", bootstrap_port=None)),
            decode=("http://d-0:30000", "http://d-1:30000"),
        ),
    )
    parsed = parse_router(router_argv(config))
    assert parsed.pd_disaggregation is True
    assert parsed.prefill_urls == [("http://p-0:30000", 8998), ("http://p-1:30000", None)]
    assert parsed.decode_urls == ["http://d-0:30000", "http://d-1:30000"]
    assert (parsed.host, parsed.port, parsed.policy) == ("0.0.0.0", 8000, "round_robin")
    assert parsed.prometheus_port == 29000
    assert parsed.service_discovery is False


def test_router_discovery_disaggregated():
    config = RouterConfig(
        deployment="kimi", namespace="llm", mode="disaggregated",
        discovery=Discovery(
            namespace="llm", port=30000,
            prefill_selector={"tessera.dev/deployment": "kimi", "tessera.dev/phase": "prefill"},
            decode_selector={"tessera.dev/deployment": "kimi", "tessera.dev/phase": "decode"},
        ),
    )
    parsed = parse_router(router_argv(config))
    assert parsed.pd_disaggregation and parsed.service_discovery
    assert parsed.service_discovery_namespace == "llm"
    assert parsed.service_discovery_port == 30000
    assert parsed.prefill_selector == {"tessera.dev/deployment": "kimi",
                                       "tessera.dev/phase": "prefill"}
    assert parsed.decode_selector == {"tessera.dev/deployment": "kimi",
                                      "tessera.dev/phase": "decode"}


def test_router_single_pool_static_and_discovery():
    static = RouterConfig(deployment="m", namespace="llm", mode="single",
                          static=StaticWorkers(single=("http://s-0:30000", "http://s-1:30000")))
    parsed = parse_router(router_argv(static))
    assert parsed.pd_disaggregation is False
    assert parsed.worker_urls == ["http://s-0:30000", "http://s-1:30000"]

    found = RouterConfig(deployment="m", namespace="llm", mode="single",
                         discovery=Discovery(namespace="llm", single_selector={"app": "m"}))
    parsed = parse_router(router_argv(found))
    assert parsed.service_discovery and not parsed.pd_disaggregation
    assert parsed.selector == {"app": "m"}
