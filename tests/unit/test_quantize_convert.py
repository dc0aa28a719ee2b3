"""The converter end to end on tiny synthetic DeepSeek V3 / Kimi K2 / GLM 5 checkpoints."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tessera.kernels import w4a16_format
from tessera.runtime.quantize.checkpoint import INDEX
from tessera.runtime.quantize.convert import convert, size_report, verify
from tessera.runtime.quantize.options import Options
from tessera.runtime.quantize.synthetic import TINY_CONFIGS, tensor_specs, write_checkpoint
from tessera.runtime.quantize.tensors import classify

ARCHS = sorted(TINY_CONFIGS)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: torch's thread pool only costs here, badly so on a busy 2-core runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(src: Path, dst: Path, options: Options | None = None) -> dict[str, Any]:
    return convert(src, dst, options or Options(), progress_stream=io.StringIO())


@pytest.fixture(scope="module", params=ARCHS)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[str, Path, Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp(request.param)
    src = write_checkpoint(root / "src", TINY_CONFIGS[request.param], max_shard_bytes=2 << 20)
    return request.param, src, root / "out", run(src, root / "out")


def load(directory: Path, name: str) -> torch.Tensor:
    index = json.loads((directory / INDEX).read_text())["weight_map"]
    with safe_open(directory / index[name], framework="pt") as f:
        return f.get_tensor(name)


def fp8_reference(directory: Path, name: str) -> torch.Tensor:
    """The FP8 weight times its 128x128 block scales, written out with kron."""
    weight, scale = load(directory, name), load(directory, name + "_scale_inv")
    rows, cols = weight.shape
    return weight.float() * torch.kron(scale, torch.ones(128, 128))[:rows, :cols]


def test_every_source_tensor_lands_in_the_index_under_its_output_names(converted) -> None:
    arch, src, out, _ = converted
    expected = set()
    for spec in tensor_specs(TINY_CONFIGS[arch], "fp8"):
        if spec.name.endswith("_scale_inv"):
            continue
        if classify(spec.name).name == "routed_experts":
            module = spec.name.removesuffix(".weight")
            expected |= {f"{module}.weight_packed", f"{module}.weight_scale",
                         f"{module}.weight_shape"}
        else:
            expected.add(spec.name)
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"]) == expected
    stored: dict[str, str] = {}
    for file in set(index["weight_map"].values()):
        with safe_open(out / file, framework="pt") as f:
            stored |= {name: file for name in f.keys()}
    assert stored == index["weight_map"]
    sizes = converted[3]["sizes"].values()
    assert index["metadata"]["total_size"] == sum(s["after"] for s in sizes)


def test_quantized_experts_round_trip_within_half_a_quantization_step(converted) -> None:
    arch, src, out, _ = converted
    config = TINY_CONFIGS[arch]
    layer = config["first_k_dense_replace"]
    errors, norms = 0.0, 0.0
    for e in range(config["n_routed_experts"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            module = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
            reference = fp8_reference(src, module + ".weight")
            packed = w4a16_format.repack_from_compressed_tensors(
                load(out, module + ".weight_packed"), load(out, module + ".weight_scale"),
                load(out, module + ".weight_shape"))
            assert packed.group_size == 128 and packed.symmetric
            restored = w4a16_format.dequantize(packed)
            step = packed.scales.float().transpose(0, 1).repeat_interleave(128, dim=1)
            # rounding moves a value at most half a step; a group's largest value sits at
            # 7.5 steps and is clamped to code +7, half a step away, plus up to 7.5 times
            # the bf16 rounding of the stored scale (2^-8 relative)
            assert ((restored - reference).abs() <= step * (0.5 + 7.5 * 2**-8)).all(), module
            errors += float((restored - reference).pow(2).sum())
            norms += float(reference.pow(2).sum())
    # round-to-nearest INT4 on Gaussian weights: about 0.11 (uniform error over steps of
    # absmax/7.5 with absmax near 2.8 sigma in a group of 128)
    assert (errors / norms) ** 0.5 < 0.13


def test_unquantized_fp8_weights_become_their_bf16_values(converted) -> None:
    arch, src, out, _ = converted
    for name in ("model.layers.0.self_attn.q_a_proj.weight",
                 "model.layers.0.self_attn.kv_b_proj.weight",
                 f"model.layers.{TINY_CONFIGS[arch]['first_k_dense_replace']}"
                 ".mlp.shared_experts.down_proj.weight"):
        written = load(out, name)
        assert written.dtype == torch.bfloat16
        assert torch.equal(written, fp8_reference(src, name).bfloat16()), name


def test_bf16_and_fp32_tensors_are_copied_bit_for_bit(converted) -> None:
    arch, src, out, _ = converted
    moe = TINY_CONFIGS[arch]["first_k_dense_replace"]
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 f"model.layers.{moe}.mlp.gate.weight",
                 f"model.layers.{moe}.mlp.gate.e_score_correction_bias"):
        a, b = load(src, name), load(out, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_config_carries_w4a16_group_128_and_everything_else(converted) -> None:
    arch, src, out, _ = converted
    config = json.loads((out / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 128, True)
    assert r"re:.*\.self_attn\..*" in qc["ignore"]
    assert not any("experts(" in entry for entry in qc["ignore"])
    source = json.loads((src / "config.json").read_text())
    source.pop("quantization_config")
    assert config == source | {"torch_dtype": "bfloat16"}
    assert (out / "tokenizer_config.json").read_bytes() == (
        src / "tokenizer_config.json").read_bytes()


def test_config_parses_with_compressed_tensors(converted) -> None:
    quantization = pytest.importorskip("compressed_tensors.quantization")
    qc = json.loads((converted[2] / "config.json").read_text())["quantization_config"]
    parsed = quantization.QuantizationConfig.model_validate(qc)
    weights = parsed.config_groups["group_0"].weights
    assert (weights.num_bits, weights.group_size, weights.strategy) == (4, 128, "group")


def test_sglang_ignores_exactly_the_layers_left_in_bf16(converted) -> None:
    utils = pytest.importorskip("sglang.srt.layers.quantization.compressed_tensors.utils")
    arch, _, out, _ = converted
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    moe = TINY_CONFIGS[arch]["first_k_dense_replace"]
    # layer names as SGLang's DeepSeek V2/V3 model builds them (fused where it fuses)
    left_in_bf16 = ["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa",
                    "model.layers.0.self_attn.kv_b_proj", "model.layers.0.self_attn.o_proj",
                    "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                    f"model.layers.{moe}.mlp.shared_experts.gate_up_proj", "lm_head"]
    for layer in left_in_bf16:
        assert utils.should_ignore_layer(layer, ignore=ignore), layer
    # SGLang asks about a FusedMoE layer through its expert 0 projections
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.{moe}.mlp.experts.0.{proj}"
        assert not utils.should_ignore_layer(name, ignore=ignore), name


def test_sglang_config_parser_accepts_the_config(converted) -> None:
    ct = pytest.importorskip(
        "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors")
    qc = json.loads((converted[2] / "config.json").read_text())["quantization_config"]
    parsed = ct.CompressedTensorsConfig.from_config(qc)
    weights = parsed.target_scheme_map["Linear"]["weights"]
    assert (weights.num_bits, weights.group_size) == (4, 128)
    assert parsed.ignore == qc["ignore"]


def test_manifest_checksums_verify_and_catch_a_flipped_byte(converted) -> None:
    _, _, out, manifest = converted
    assert manifest["complete"] and verify(out) == []
    victim = out / sorted(manifest["shards"])[0]
    original = victim.read_bytes()
    try:
        data = bytearray(original)
        data[-1] ^= 0x01
        victim.write_bytes(bytes(data))
        assert verify(out) == [f"{victim.name}: sha256 differs from the manifest "
                               "(corrupt or changed)"]
    finally:
        victim.write_bytes(original)


def test_size_report_lists_each_class_and_the_total(converted) -> None:
    report = size_report(converted[3])
    for cls in ("routed_experts", "attention", "embedding", "total"):
        assert cls in report
    experts = converted[3]["sizes"]["routed_experts"]
    # FP8 (1 byte + 4/16384 scale) -> INT4 (0.5 byte + 2/128 scale) per weight
    assert experts["after"] / experts["before"] == pytest.approx((0.5 + 2 / 128), rel=1e-3)


def test_size_ratio_matches_the_planners_prediction(converted) -> None:
    arch, _, _, manifest = converted
    planner = pytest.importorskip("tessera.runtime.planner.weights")
    architecture = pytest.importorskip("tessera.runtime.planner.architecture")
    config = TINY_CONFIGS[arch]
    model = architecture.resolve_architecture(
        None, {k: v for k, v in config.items() if k in architecture.FIELDS})
    predicted = (planner.checkpoint_bytes(model, planner.WeightScheme.of("int4"))
                 / planner.checkpoint_bytes(model, planner.WeightScheme.of("fp8")))
    before = sum(s["before"] for s in manifest["sizes"].values())
    after = sum(s["after"] for s in manifest["sizes"].values())
    assert after / before == pytest.approx(predicted, rel=0.01)


def test_output_passes_the_runtimes_int4_preflight(converted) -> None:
    from tessera.runtime.config import ModelConfig, RuntimeConfig, WeightsConfig
    from tessera.runtime.preflight import check_checkpoint, read_checkpoint

    arch, src, out, _ = converted
    decode = RuntimeConfig(
        deployment=arch, namespace="llm", phase="decode",
        model=ModelConfig(name=arch, path=str(out)),
        weights=WeightsConfig(dtype="int4", format="compressed-tensors", group_size=128))
    assert check_checkpoint(decode, read_checkpoint(str(out))) is None
    # and the FP8 source is told apart, so the check can fail
    problem = check_checkpoint(decode, read_checkpoint(str(src)))
    assert problem is not None and "holds fp8 weights" in problem.message


@pytest.mark.gpu
def test_cuda_arithmetic_writes_the_same_bytes_as_the_cpu(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", TINY_CONFIGS["glm-5"], max_shard_bytes=2 << 20)
    on_cpu = run(src, tmp_path / "cpu")
    on_gpu = convert(src, tmp_path / "gpu", Options(), device="cuda",
                     progress_stream=io.StringIO())
    assert on_gpu["shards"] == on_cpu["shards"]
