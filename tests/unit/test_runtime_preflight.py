"""Preflight decisions from typed hardware and checkpoint facts: each failure class gives its
own clear message and exit code; a capable H200 with a matching checkpoint passes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tessera.runtime.config import (
    ENGINE_VERSION,
    KernelsConfig,
    KVCacheConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    WeightsConfig,
)
from tessera.runtime.preflight import (
    INDEX_FILE,
    CheckpointPrecision,
    Failure,
    GpuFacts,
    checkpoint_precision,
    read_checkpoint,
    run_preflight,
)
from tessera.runtime.quantize.qconfig import quantization_config as int4_compressed_tensors

GiB = 1 << 30
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}
INT4_CT = int4_compressed_tensors(ignore=["lm_head"], group_size=128)


def h200(i: int, free_gib: float = 139.0) -> GpuFacts:
    return GpuFacts(index=i, name="NVIDIA H200", capability=(9, 0),
                    total_bytes=int(139.8 * GiB), free_bytes=int(free_gib * GiB))


def a100(i: int) -> GpuFacts:
    return GpuFacts(index=i, name="NVIDIA A100-SXM4-80GB", capability=(8, 0),
                    total_bytes=80 * GiB, free_bytes=79 * GiB)


def l40s(i: int) -> GpuFacts:
    return GpuFacts(index=i, name="NVIDIA L40S", capability=(8, 9),
                    total_bytes=45 * GiB, free_bytes=44 * GiB)


def write_checkpoint(root: Path, quantization: dict | None, shards: int = 2,
                     drop: int = 0) -> Path:
    """A Hugging Face folder: config.json, an index and `shards - drop` shard files."""
    root.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168}
    if quantization is not None:
        config["quantization_config"] = quantization
    (root / "config.json").write_text(json.dumps(config))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    (root / INDEX_FILE).write_text(json.dumps(
        {"weight_map": {f"layer.{i}.weight": n for i, n in enumerate(names)}}))
    for name in names[drop:]:
        (root / name).write_bytes(b"\0" * 8)
    return root


def config_for(path: Path, weights=("int4", "compressed-tensors"), kv="fp8_e4m3", tp=8,
               planned_gib: tuple[float, float] | None = (60.0, 50.0),
               kernels: KernelsConfig | None = None) -> RuntimeConfig:
    memory = MemoryConfig() if planned_gib is None else MemoryConfig(
        planned_weights_bytes_per_gpu=int(planned_gib[0] * GiB),
        planned_kv_pool_bytes_per_gpu=int(planned_gib[1] * GiB))
    return RuntimeConfig(
        deployment="kimi-k2", namespace="llm", phase="decode",
        model=ModelConfig(name="kimi", path=str(path)),
        weights=WeightsConfig(dtype=weights[0], format=weights[1]),
        kv_cache=KVCacheConfig(dtype=kv), parallel=ParallelConfig(tensor=tp, expert=tp),
        memory=memory, kernels=kernels or KernelsConfig())


def preflight(config: RuntimeConfig, gpus, engine: str | None = ENGINE_VERSION):
    return run_preflight(config, gpus, read_checkpoint(config.model.path), engine)


@pytest.fixture
def int4_ckpt(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "kimi-int4", INT4_CT)


def test_h200_with_matching_checkpoint_passes(int4_ckpt):
    result = preflight(config_for(int4_ckpt), [h200(i) for i in range(8)])
    assert result.passed and result.exit_code == 0
    assert result.summary == (
        "preflight passed: decode, weights int4 (compressed-tensors), KV fp8_e4m3; "
        "8 x NVIDIA H200, compute capability 9.0, free 139.0-139.0 of 139.8 GiB per GPU, "
        "plan needs 110.0 GiB; checkpoint matches; KV transfer: mooncake over TCP (no RDMA "
        "configured)")


def test_tessera_kernels_pass_on_hopper(int4_ckpt):
    kernels = KernelsConfig(decode_attention="tessera", w4a16="tessera")
    assert preflight(config_for(int4_ckpt, kernels=kernels), [h200(i) for i in range(8)]).passed


@pytest.mark.parametrize(
    ("gpus", "config_args", "failure", "message"),
    [
        ([], {}, Failure.NO_GPU, "no CUDA GPU is visible; this decode pod needs 8"),
        ([h200(i) for i in range(4)], {}, Failure.TOO_FEW_GPUS,
         "4 GPU.s. visible but tensor parallel 8 over 1 node.s. needs 8 per pod"),
        ([a100(0)], {"tp": 1, "planned_gib": None}, Failure.COMPUTE_CAPABILITY,
         r"GPU 0 \(NVIDIA A100-SXM4-80GB\) has compute capability 8.0 but an FP8 KV cache "
         r"needs 8.9 or newer"),
        ([a100(0)], {"tp": 1, "kv": "bf16", "planned_gib": None,
                     "kernels": KernelsConfig(w4a16="tessera")}, Failure.COMPUTE_CAPABILITY,
         "tessera's Hopper w4a16 kernels needs 9.0"),
        ([l40s(0)], {"tp": 1, "planned_gib": None,
                     "kernels": KernelsConfig(decode_attention="tessera")},
         Failure.COMPUTE_CAPABILITY, "capability 8.9 but tessera's Hopper decode_attention"),
        ([l40s(0)], {"tp": 1, "planned_gib": None,
                     "kernels": KernelsConfig(decode_attention="flashmla")},
         Failure.COMPUTE_CAPABILITY, "capability 8.9 but SGLang's FlashMLA decode attention "
         "needs 9.0"),
        ([h200(i, free_gib=139.0 if i != 5 else 100.0) for i in range(8)], {}, Failure.GPU_MEMORY,
         r"GPU 5 has 100.0 GiB free but the capacity plan needs 110.0 GiB per GPU "
         r"\(weights 60.0 \+ KV pool 50.0\)"),
    ],
    ids=["no-gpu", "too-few", "fp8-kv-on-8.0", "hopper-kernels-on-8.0", "hopper-kernels-on-8.9",
         "flashmla-on-8.9", "memory"],
)
def test_gpu_failures(int4_ckpt, gpus, config_args, failure, message):
    result = preflight(config_for(int4_ckpt, **config_args), gpus)
    assert result.problem is not None and result.problem.failure == failure
    assert result.exit_code == int(failure)
    assert result.summary.startswith("preflight failed: ")
    assert re.search(message, result.summary), result.summary


def test_fp8_kv_runs_on_ada(int4_ckpt):
    assert preflight(config_for(int4_ckpt, tp=1, planned_gib=None), [l40s(0)]).passed


def test_int4_requested_on_an_fp8_checkpoint(tmp_path):
    ckpt = write_checkpoint(tmp_path / "kimi-fp8", FP8_BLOCK)
    result = preflight(config_for(ckpt), [h200(i) for i in range(8)])
    assert result.exit_code == Failure.CHECKPOINT_MISMATCH
    assert ("weights.dtype int4 (format compressed-tensors) was requested but the checkpoint at "
            f"{ckpt} holds fp8 weights (format safetensors)") in result.summary


def test_bf16_requested_on_an_int4_checkpoint(int4_ckpt):
    result = preflight(config_for(int4_ckpt, weights=("bf16", "safetensors"), kv="bf16"),
                       [h200(i) for i in range(8)])
    assert result.exit_code == Failure.CHECKPOINT_MISMATCH
    assert "holds int4 weights (format compressed-tensors)" in result.summary


def test_group_size_mismatch(tmp_path):
    ckpt = write_checkpoint(tmp_path / "g32", int4_compressed_tensors(["lm_head"], 32))
    config = config_for(ckpt).model_copy(
        update={"weights": WeightsConfig(dtype="int4", format="compressed-tensors",
                                         group_size=128)})
    result = preflight(config, [h200(i) for i in range(8)])
    assert result.exit_code == Failure.CHECKPOINT_MISMATCH
    assert "group_size 128 was requested but the checkpoint" in result.summary


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "absent", "is not a directory: mount the checkpoint there"),
        (lambda root: (root / "empty").mkdir() or root / "empty", "config.json is missing"),
        (lambda root: _without_weights(root), "has no \\*.safetensors weight files"),
        (lambda root: write_checkpoint(root / "partial", INT4_CT, shards=4, drop=1),
         "1 shard.s. listed in model.safetensors.index.json are missing .* "
         "e.g. model-00001-of-00004.safetensors"),
    ],
    ids=["no-dir", "no-config", "no-weights", "missing-shard"],
)
def test_missing_files(tmp_path, make, message):
    path = make(tmp_path)
    result = preflight(config_for(path), [h200(i) for i in range(8)])
    assert result.exit_code == Failure.MODEL_FILES
    assert re.search(message, result.summary), result.summary


def _without_weights(root: Path) -> Path:
    (root / "noweights").mkdir()
    (root / "noweights" / "config.json").write_text("{}")
    return root / "noweights"


@pytest.mark.parametrize("engine", ["0.5.22", None])
def test_wrong_or_missing_engine(int4_ckpt, engine):
    result = preflight(config_for(int4_ckpt), [h200(i) for i in range(8)], engine=engine)
    assert result.exit_code == Failure.ENGINE_VERSION
    assert f"this runtime emits flags for SGLang {ENGINE_VERSION}" in result.summary


def test_exit_codes_are_distinct_and_not_crash_codes():
    codes = [int(f) for f in Failure]
    assert len(set(codes)) == len(codes) and 0 not in codes and 1 not in codes


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [
        (None, CheckpointPrecision("bf16", "safetensors")),
        (FP8_BLOCK, CheckpointPrecision("fp8", "safetensors")),
        (INT4_CT, CheckpointPrecision("int4", "compressed-tensors", 128)),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
            "num_bits": 8, "type": "float", "strategy": "channel"}}}},
         CheckpointPrecision("fp8", "compressed-tensors")),
        ({"quant_method": "awq", "bits": 4, "group_size": 128},
         CheckpointPrecision("int4", "awq", 128)),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64},
         CheckpointPrecision("int4", "awq", 64)),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32},
         CheckpointPrecision("int4", "gptq", 32)),
        ({"quant_method": "gptq", "bits": 8, "group_size": 32},
         CheckpointPrecision("unknown", "gptq", 32)),
        ({"quant_method": "mxfp4"}, CheckpointPrecision("unknown", "mxfp4")),
    ],
    ids=["none", "fp8-block", "int4-ct", "fp8-ct", "awq", "awq-old-keys", "gptq", "gptq-8bit",
         "mxfp4"],
)
def test_checkpoint_precision(quantization, expected):
    assert checkpoint_precision(quantization) == expected
