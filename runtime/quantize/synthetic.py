"""Tiny checkpoints with the real tensor names, roles and dtypes of the DeepSeek V3 family.

For tests, benchmarks and demos of the converter: every tensor a DeepSeek V3, Kimi K2 or
GLM 5 checkpoint holds (MLA attention, the GLM 5 indexer, dense and MoE MLPs, shared experts,
the router and its bias, the MTP layers), at sizes given by a config.json dict, written as
FP8 block-scaled (like the published FP8 checkpoints) or BF16.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from tessera.runtime.quantize import fp8
from tessera.runtime.quantize.shardio import ShardWriter, TensorSpec

# config.json values of the real models, shrunk: the same layer kinds in the same order.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1024,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
        "kv_lora_rank": 128, "q_lora_rank": 192, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
        "n_shared_experts": 1, "moe_intermediate_size": 128, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
    },
    "kimi-k2": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "hidden_size": 256, "num_hidden_layers": 3, "vocab_size": 1280,
        "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 512,
        "kv_lora_rank": 128, "q_lora_rank": 192, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 12,
        "n_shared_experts": 1, "moe_intermediate_size": 128, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
    },
    "glm-5": {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1024,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 384,
        "kv_lora_rank": 128, "q_lora_rank": 256, "qk_nope_head_dim": 48,
        "qk_rope_head_dim": 16, "v_head_dim": 64, "index_n_heads": 4, "index_head_dim": 32,
        "n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 128,
        "num_experts_per_tok": 2, "first_k_dense_replace": 2, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
    },
}

FP8_SOURCE_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [fp8.BLOCK, fp8.BLOCK],
}


def weight_shapes(config: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_linear) of every tensor, in checkpoint order.

    Linear weights are the ones the FP8 checkpoints store as FP8 with a `weight_scale_inv`;
    the rest (norms, embeddings, router, lm_head, MTP projection) stay BF16 (the router bias
    is float32, marked by a trailing `_bias` name).
    """
    c = config
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk_dim = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]

    def mlp(prefix: str, width: int) -> Iterator[tuple[str, tuple[int, ...], bool]]:
        yield f"{prefix}.gate_proj.weight", (width, h), True
        yield f"{prefix}.up_proj.weight", (width, h), True
        yield f"{prefix}.down_proj.weight", (h, width), True

    def layer(i: int) -> Iterator[tuple[str, tuple[int, ...], bool]]:
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), False
        yield f"{p}.self_attn.q_a_proj.weight", (c["q_lora_rank"], h), True
        yield f"{p}.self_attn.q_a_layernorm.weight", (c["q_lora_rank"],), False
        yield f"{p}.self_attn.q_b_proj.weight", (heads * qk_dim, c["q_lora_rank"]), True
        yield (f"{p}.self_attn.kv_a_proj_with_mqa.weight",
               (c["kv_lora_rank"] + c["qk_rope_head_dim"], h), True)
        yield f"{p}.self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"],), False
        yield (f"{p}.self_attn.kv_b_proj.weight",
               (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]), True)
        yield f"{p}.self_attn.o_proj.weight", (h, heads * c["v_head_dim"]), True
        if c.get("index_n_heads", 0):
            n, d = c["index_n_heads"], c["index_head_dim"]
            yield f"{p}.self_attn.indexer.wq_b.weight", (n * d, c["q_lora_rank"]), True
            yield f"{p}.self_attn.indexer.wk.weight", (d, h), True
            yield f"{p}.self_attn.indexer.k_norm.weight", (d,), False
            yield f"{p}.self_attn.indexer.k_norm.bias", (d,), False
            yield f"{p}.self_attn.indexer.weights_proj.weight", (n, h), False
        yield f"{p}.post_attention_layernorm.weight", (h,), False
        if i < c["first_k_dense_replace"]:
            yield from mlp(f"{p}.mlp", c["intermediate_size"])
            return
        experts = c["n_routed_experts"]
        yield f"{p}.mlp.gate.weight", (experts, h), False
        yield f"{p}.mlp.gate.e_score_correction_bias", (experts,), False
        for e in range(experts):
            yield from mlp(f"{p}.mlp.experts.{e}", c["moe_intermediate_size"])
        shared = c["n_shared_experts"] * c["moe_intermediate_size"]
        yield from mlp(f"{p}.mlp.shared_experts", shared)

    yield "model.embed_tokens.weight", (c["vocab_size"], h), False
    for i in range(c["num_hidden_layers"]):
        yield from layer(i)
    for i in range(c["num_hidden_layers"], c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.embed_tokens.weight", (c["vocab_size"], h), False
        yield f"{p}.enorm.weight", (h,), False
        yield f"{p}.hnorm.weight", (h,), False
        yield f"{p}.eh_proj.weight", (h, 2 * h), False
        yield from layer(i)
        yield f"{p}.shared_head.norm.weight", (h,), False
        yield f"{p}.shared_head.head.weight", (c["vocab_size"], h), False
    yield "model.norm.weight", (h,), False
    yield "lm_head.weight", (c["vocab_size"], h), False


def _kind(name: str, linear: bool, dtype: str) -> str:
    if name.endswith("_bias"):
        return "fp32"
    if name.endswith(("norm.weight", "norm.bias")):
        return "ones"
    return "fp8" if linear and dtype == "fp8" else "bf16"


def tensor_specs(config: Mapping[str, Any], dtype: str) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in order; FP8 weights are followed by their scales."""
    specs = []
    for name, shape, linear in weight_shapes(config):
        kind = _kind(name, linear, dtype)
        specs.append(TensorSpec(name, _DTYPES[kind], shape))
        if kind == "fp8":
            blocks = tuple(-(-n // fp8.BLOCK) for n in shape)
            specs.append(TensorSpec(name + "_scale_inv", torch.float32, blocks))
    return specs


_DTYPES = {"fp32": torch.float32, "ones": torch.bfloat16, "fp8": torch.float8_e4m3fn,
           "bf16": torch.bfloat16}


def _values(config: Mapping[str, Any], dtype: str, seed: int) -> Iterator[torch.Tensor]:
    """The tensors of `tensor_specs`, in the same order, made one at a time."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape, linear in weight_shapes(config):
        kind = _kind(name, linear, dtype)
        if kind == "ones":
            yield torch.ones(shape, dtype=torch.bfloat16)
            continue
        value = torch.randn(shape, generator=gen) * 0.02
        if kind == "fp8":
            yield from fp8.quantize(value)
        else:
            yield value.to(_DTYPES[kind])


def write_checkpoint(
    directory: Path,
    config: Mapping[str, Any],
    dtype: str = "fp8",
    max_shard_bytes: int = 4 << 20,
    seed: int = 0,
) -> Path:
    """Writes config.json, shards and model.safetensors.index.json into `directory`."""
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f"dtype must be 'fp8' or 'bf16', got {dtype!r}")
    directory.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(config, dtype)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        # a weight and its scale stay in one shard, as in the published checkpoints
        if shards[-1] and size + spec.nbytes > max_shard_bytes and not spec.name.endswith(
                "_scale_inv"):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    values = _values(config, dtype, seed)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        with ShardWriter(directory / file, shard) as writer:
            for spec in shard:
                writer.add(spec.name, next(values))
                weight_map[spec.name] = file
            writer.finish()
    total = sum(spec.nbytes for spec in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    full_config = {**config, "torch_dtype": "bfloat16"}
    if dtype == "fp8":
        full_config["quantization_config"] = FP8_SOURCE_CONFIG
    (directory / "config.json").write_text(json.dumps(full_config, indent=2))
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return directory
