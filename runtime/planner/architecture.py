"""The model architecture the planner needs, read from a Hugging Face config.json subset.

Field names are config.json's own keys, so a user can paste values from a checkpoint's
config.json into `spec.model.architecture.config` and they override the preset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.runtime.planner.errors import PlanError


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer, dense or Mixture-of-Experts, with MLA or GQA attention.

    Attention is MLA when `kv_lora_rank` is set (DeepSeek V3 family), else GQA/MHA.
    A model is MoE when `n_routed_experts` > 0; its first `first_k_dense_replace` layers
    keep a dense MLP of width `intermediate_size`.
    """

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    intermediate_size: int = 0
    # GQA/MHA
    num_key_value_heads: int | None = None  # defaults to num_attention_heads
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    # MLA
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # None: a plain q_proj from the hidden state
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (DSA) indexer; 0 heads: none
    index_n_heads: int = 0
    index_head_dim: int = 0
    # MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    # Misc
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None  # None: unknown, no context warning
    # Multi-token-prediction layers: stored in the checkpoint, loaded only for speculative
    # decoding (which tessera does not configure), so they count on disk, not on the GPU.
    num_nextn_predict_layers: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def gqa_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers) if self.is_moe else (
            self.num_hidden_layers
        )

    @property
    def moe_layers(self) -> int:
        return self.num_hidden_layers - self.dense_layers


FIELDS: dict[str, type] = {
    f.name: (bool if f.name == "tie_word_embeddings" else int)
    for f in dataclasses.fields(Architecture)
}

# Every number below is the value in the model's public config.json.
PRESETS: dict[str, dict[str, Any]] = {
    # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
    # (DeepseekV3ForCausalLM; the same values are in the DeepSeek-V3 technical report, §4.2)
    "deepseek-v3": {
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "vocab_size": 129280,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "tie_word_embeddings": False,
        "max_position_embeddings": 163840,
        "num_nextn_predict_layers": 1,
    },
    # huggingface.co/moonshotai/Kimi-K2-Instruct-0905/blob/main/config.json (kimi_k2, the
    # DeepSeek V3 architecture with 384 experts, 64 heads, 1 dense layer, no MTP layer);
    # Kimi-K2.5/K2.6 carry the same values in text_config.
    "kimi-k2": {
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "vocab_size": 163840,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
        "num_nextn_predict_layers": 0,
    },
    # huggingface.co/zai-org/GLM-5/blob/main/config.json (GlmMoeDsaForCausalLM, glm_moe_dsa):
    # the values of transformers' GlmMoeDsaConfig and of the GLM-5 technical report's
    # architecture table (78 layers = 3 dense + 75 MoE, 1 MTP layer, indexer 32 x 128).
    "glm-5": {
        "hidden_size": 6144,
        "num_hidden_layers": 78,
        "vocab_size": 154880,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "intermediate_size": 12288,
        "kv_lora_rank": 512,
        "q_lora_rank": 2048,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "tie_word_embeddings": False,
        "max_position_embeddings": 202752,
        "num_nextn_predict_layers": 1,
    },
}


def resolve_architecture(preset: str | None, overrides: Mapping[str, Any]) -> Architecture:
    """The preset's config with `overrides` (config.json keys) applied, validated."""
    if preset is not None and preset not in PRESETS:
        raise PlanError(
            f"unknown architecture preset {preset!r}; use one of {sorted(PRESETS)} "
            "or leave preset out and give the config.json fields in architecture.config",
            reason="UnknownArchitecturePreset",
        )
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise PlanError(
            f"unknown architecture config field(s) {unknown}; the planner reads only "
            f"{sorted(FIELDS)}",
            reason="InvalidArchitecture",
        )
    values = {**PRESETS.get(preset or "", {}), **overrides}
    for name, value in values.items():
        _check_type(name, value)
    required = [f.name for f in dataclasses.fields(Architecture)
                if f.default is dataclasses.MISSING and f.name not in values]
    if required:
        raise PlanError(
            f"architecture config is missing {required}: give a preset or these "
            "config.json fields",
            reason="InvalidArchitecture",
        )
    arch = Architecture(**values)
    _check_consistent(arch)
    return arch


def _check_type(name: str, value: Any) -> None:
    if FIELDS[name] is bool:
        if not isinstance(value, bool):
            raise PlanError(f"architecture config {name} must be true or false, got {value!r}",
                            reason="InvalidArchitecture")
        return
    if value is None and name in ("num_key_value_heads", "head_dim", "kv_lora_rank",
                                  "q_lora_rank", "max_position_embeddings"):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(
            f"architecture config {name} must be a non-negative integer, got {value!r}",
            reason="InvalidArchitecture",
        )


def _check_consistent(arch: Architecture) -> None:
    problems = []
    for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        if getattr(arch, name) == 0:
            problems.append(f"{name} must be positive")
    if arch.is_mla and (arch.qk_rope_head_dim == 0 or arch.v_head_dim == 0):
        problems.append("MLA (kv_lora_rank set) needs qk_rope_head_dim and v_head_dim")
    if arch.is_moe and (arch.moe_intermediate_size == 0 or arch.num_experts_per_tok == 0):
        problems.append("MoE (n_routed_experts > 0) needs moe_intermediate_size and "
                        "num_experts_per_tok")
    if arch.dense_layers > 0 and arch.intermediate_size == 0:
        problems.append("dense MLP layers need intermediate_size")
    if arch.has_indexer and arch.index_head_dim == 0:
        problems.append("index_n_heads > 0 needs index_head_dim")
    if not arch.is_mla and arch.num_attention_heads % arch.kv_heads:
        problems.append("num_attention_heads must be a multiple of num_key_value_heads")
    if problems:
        raise PlanError("inconsistent architecture config: " + "; ".join(problems),
                        reason="InvalidArchitecture")
