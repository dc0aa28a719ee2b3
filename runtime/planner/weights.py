"""Weight bytes per precision scheme: per GPU (after TP/EP sharding) and on disk.

The model is a list of weight matrices, each tagged with the module it belongs to and how
SGLang shards it. A scheme quantizes an explicit set of modules; the rest stay BF16. Norms,
the MoE router and the biases stay in their training precision and are never quantized.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from tessera.runtime.planner.architecture import Architecture
from tessera.runtime.planner.errors import PlanError

BF16_BYTES = 2
# FP8 block quantization as in DeepSeek V3's checkpoint and SGLang's fp8 block path: one FP32
# scale (`weight_scale_inv`) per 128 x 128 block of the weight.
FP8_BLOCK = 128
FP8_SCALE_BYTES = 4
# INT4 W4A16 (compressed-tensors pack-quantized / GPTQ / AWQ layouts): two 4-bit values per
# byte, one BF16 scale per group of `group_size` input elements per output row, and for an
# asymmetric scheme one 4-bit zero point per group, packed like the weights.
INT4_SCALE_BYTES = 2
INT4_GROUP_SIZES = (32, 128)

WEIGHT_DTYPES = ("bf16", "fp8", "int4")


class Module(StrEnum):
    """Groups of weights a scheme quantizes or keeps."""

    EMBEDDING = "embedding"
    LM_HEAD = "lmHead"
    ATTENTION = "attention"
    DENSE_MLP = "denseMLP"
    SHARED_EXPERTS = "sharedExperts"
    ROUTED_EXPERTS = "routedExperts"
    # Never quantized: RMSNorm weights, the MoE router (gate) matrix, and the MTP layer's
    # eh_proj (SGLang builds it as a plain nn.Linear; DeepSeek V3's FP8 release stores it BF16).
    NORM = "norm"
    ROUTER = "router"
    MTP_PROJECTION = "mtpProjection"


QUANTIZABLE = frozenset(Module) - {Module.NORM, Module.ROUTER, Module.MTP_PROJECTION}

# What each dtype quantizes unless the spec says otherwise. FP8: every linear layer, as in
# DeepSeek V3's released FP8 checkpoint (embeddings and lm_head stay BF16). INT4: only the
# routed experts, as in Kimi K2's INT4 release (attention, shared experts and lm_head stay
# BF16): experts are over 95% of the bytes and the least sensitive to quantization.
DEFAULT_QUANTIZED: dict[str, frozenset[Module]] = {
    "bf16": frozenset(),
    "fp8": frozenset({Module.ATTENTION, Module.DENSE_MLP, Module.SHARED_EXPERTS,
                      Module.ROUTED_EXPERTS}),
    "int4": frozenset({Module.ROUTED_EXPERTS}),
}


class Shard(StrEnum):
    """How SGLang splits a matrix over the GPUs of one replica."""

    REPLICATED = "replicated"  # every GPU holds it all
    ATTENTION_TP = "attentionTP"  # split over the attention-TP group (TP / attention DP)
    TP = "tp"  # split over all TP ranks (experts: EP x MoE-TP = TP)
    # The input embedding: split over all TP ranks, but whole on every GPU once attention
    # data parallel is on (SGLang: VocabParallelEmbedding(enable_tp=not dp_attention)).
    VOCAB = "vocab"


@dataclass(frozen=True)
class Tensor:
    module: Module
    rows: int  # output features (N)
    cols: int  # input features (K)
    count: int  # how many such matrices in the model
    shard: Shard
    # GQA K/V projections: at most this many shards (heads are replicated past it).
    max_shards: int | None = None


@dataclass(frozen=True)
class WeightScheme:
    dtype: str  # bf16 | fp8 | int4
    group_size: int = 128  # int4 only
    symmetric: bool = True  # int4 only; asymmetric stores zero points
    quantized: frozenset[Module] = field(default_factory=frozenset)

    @classmethod
    def of(cls, dtype: str, group_size: int = 128, symmetric: bool = True,
           quantized: Iterable[Module] | None = None) -> WeightScheme:
        """The scheme for `dtype`, quantizing its default modules unless told otherwise."""
        if dtype not in WEIGHT_DTYPES:
            raise PlanError(f"weights.dtype {dtype!r} is not one of {list(WEIGHT_DTYPES)}")
        if dtype == "int4" and group_size not in INT4_GROUP_SIZES:
            raise PlanError(f"weights.groupSize {group_size!r} is not supported for int4; "
                            f"use one of {list(INT4_GROUP_SIZES)}")
        chosen = DEFAULT_QUANTIZED[dtype] if quantized is None else frozenset(quantized)
        if dtype == "bf16" and chosen:
            raise PlanError("weights.quantize lists modules but weights.dtype is bf16; "
                            "drop the list or pick fp8 or int4")
        return cls(dtype, group_size, symmetric, chosen)

    def dtype_of(self, module: Module) -> str:
        return self.dtype if module in self.quantized else "bf16"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def matrix_bytes(rows: int, cols: int, dtype: str, group_size: int = 128,
                 symmetric: bool = True) -> int:
    """Bytes of one rows x cols weight matrix stored as `dtype`, scales included."""
    if dtype == "bf16":
        return rows * cols * BF16_BYTES
    if dtype == "fp8":
        blocks = _ceil_div(rows, FP8_BLOCK) * _ceil_div(cols, FP8_BLOCK)
        return rows * cols + blocks * FP8_SCALE_BYTES
    if dtype == "int4":
        groups = rows * _ceil_div(cols, group_size)
        zeros = 0 if symmetric else _ceil_div(groups, 2)
        return rows * _ceil_div(cols, 2) + groups * INT4_SCALE_BYTES + zeros
    raise PlanError(f"unknown weight dtype {dtype!r}")


def model_tensors(arch: Architecture, with_mtp: bool = False) -> list[Tensor]:
    """Every weight matrix of `arch` (vectors are 1-row matrices)."""
    h, layers = arch.hidden_size, arch.num_hidden_layers
    out = [Tensor(Module.EMBEDDING, arch.vocab_size, h, 1, Shard.VOCAB),
           Tensor(Module.NORM, 1, h, 1, Shard.REPLICATED)]  # final norm
    if not arch.tie_word_embeddings:
        out.append(Tensor(Module.LM_HEAD, arch.vocab_size, h, 1, Shard.TP))
    out += _decoder_layers(arch, layers, arch.dense_layers)
    if with_mtp and arch.num_nextn_predict_layers:
        n = arch.num_nextn_predict_layers
        # DeepSeek V3 MTP module (its README_WEIGHTS.md): a full MoE decoder layer, eh_proj
        # (h x 2h), enorm / hnorm / shared-head norm, and copies of the embedding and output
        # head that the checkpoint stores again (671B main + 14B MTP = 685B on disk).
        out += _decoder_layers(arch, n, 0)
        out += [Tensor(Module.MTP_PROJECTION, h, 2 * h, n, Shard.REPLICATED),
                Tensor(Module.NORM, 1, h, 3 * n, Shard.REPLICATED),
                Tensor(Module.EMBEDDING, arch.vocab_size, h, n, Shard.VOCAB),
                Tensor(Module.LM_HEAD, arch.vocab_size, h, n, Shard.TP)]
    return out


def _decoder_layers(arch: Architecture, layers: int, dense: int) -> list[Tensor]:
    h, moe = arch.hidden_size, layers - dense
    out = [Tensor(Module.NORM, 1, h, 2 * layers, Shard.REPLICATED)]  # input + post-attn norms
    out += [Tensor(m, r, c, n * layers, s, cap) for m, r, c, n, s, cap in _attention(arch)]
    if dense:
        i = arch.intermediate_size
        out += [Tensor(Module.DENSE_MLP, 2 * i, h, dense, Shard.TP),  # gate_up_proj
                Tensor(Module.DENSE_MLP, h, i, dense, Shard.TP)]  # down_proj
    if moe:
        e, s = arch.moe_intermediate_size, arch.n_shared_experts * arch.moe_intermediate_size
        out.append(Tensor(Module.ROUTER, arch.n_routed_experts, h, moe, Shard.REPLICATED))
        if s:
            out += [Tensor(Module.SHARED_EXPERTS, 2 * s, h, moe, Shard.TP),
                    Tensor(Module.SHARED_EXPERTS, h, s, moe, Shard.TP)]
        n = arch.n_routed_experts * moe
        out += [Tensor(Module.ROUTED_EXPERTS, 2 * e, h, n, Shard.TP),
                Tensor(Module.ROUTED_EXPERTS, h, e, n, Shard.TP)]
    return out


def _attention(arch: Architecture) -> list[tuple[Module, int, int, int, Shard, int | None]]:
    """One layer's attention matrices as (module, rows, cols, count, shard, max_shards)."""
    a, h, heads = Module.ATTENTION, arch.hidden_size, arch.num_attention_heads
    if not arch.is_mla:
        d, kv = arch.gqa_head_dim, arch.kv_heads
        return [(a, heads * d, h, 1, Shard.ATTENTION_TP, None),  # q_proj
                (a, kv * d, h, 2, Shard.ATTENTION_TP, kv),  # k_proj, v_proj
                (a, h, heads * d, 1, Shard.ATTENTION_TP, None)]  # o_proj
    assert arch.kv_lora_rank is not None
    qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    latent = arch.kv_lora_rank
    out: list[tuple[Module, int, int, int, Shard, int | None]] = []
    if arch.q_lora_rank:
        q = arch.q_lora_rank
        # SGLang fuses q_a_proj and kv_a_proj_with_mqa into one replicated matrix.
        out += [(a, q, h, 1, Shard.REPLICATED, None),  # q_a_proj
                (Module.NORM, 1, q, 1, Shard.REPLICATED, None),  # q_a_layernorm
                (a, heads * qk, q, 1, Shard.ATTENTION_TP, None)]  # q_b_proj
    else:
        out.append((a, heads * qk, h, 1, Shard.ATTENTION_TP, None))  # q_proj
    out += [(a, latent + arch.qk_rope_head_dim, h, 1, Shard.REPLICATED, None),  # kv_a_proj
            (Module.NORM, 1, latent, 1, Shard.REPLICATED, None),  # kv_a_layernorm
            (a, heads * (arch.qk_nope_head_dim + arch.v_head_dim), latent, 1,
             Shard.ATTENTION_TP, None),  # kv_b_proj
            (a, h, heads * arch.v_head_dim, 1, Shard.ATTENTION_TP, None)]  # o_proj
    if arch.has_indexer:
        # DSA indexer (DeepSeek V3.2 / GLM-5), replicated on every rank: wq_b from the
        # query latent, wk and the per-head weights_proj from the hidden state, k_norm.
        ih, idim = arch.index_n_heads, arch.index_head_dim
        q_in = arch.q_lora_rank or h
        out += [(a, ih * idim, q_in, 1, Shard.REPLICATED, None),
                (a, idim, h, 1, Shard.REPLICATED, None),
                (Module.ROUTER, ih, h, 1, Shard.REPLICATED, None),  # weights_proj: BF16
                (Module.NORM, 2, idim, 1, Shard.REPLICATED, None)]  # k_norm weight + bias
    return out


def shards(tensor: Tensor, tp: int, attention_dp: int) -> int:
    """How many ways `tensor` is split over one replica's GPUs."""
    n = {Shard.REPLICATED: 1, Shard.ATTENTION_TP: tp // attention_dp, Shard.TP: tp,
         Shard.VOCAB: tp if attention_dp == 1 else 1}[tensor.shard]
    return min(n, tensor.max_shards) if tensor.max_shards else n


def weight_bytes_per_gpu(arch: Architecture, scheme: WeightScheme, tp: int,
                         attention_dp: int = 1) -> int:
    """Weight bytes on each GPU of a replica of `tp` GPUs (the largest shard, rounded up)."""
    total = 0
    for t in model_tensors(arch):
        per_matrix = matrix_bytes(t.rows, t.cols, scheme.dtype_of(t.module), scheme.group_size,
                                  scheme.symmetric)
        total += _ceil_div(per_matrix * t.count, shards(t, tp, attention_dp))
    return total


def checkpoint_bytes(arch: Architecture, scheme: WeightScheme) -> int:
    """Bytes of the weights on disk in `scheme` (safetensors payload; headers excluded),
    multi-token-prediction layers included."""
    return sum(
        matrix_bytes(t.rows, t.cols, scheme.dtype_of(t.module), scheme.group_size,
                     scheme.symmetric) * t.count
        for t in model_tensors(arch, with_mtp=True)
    )
