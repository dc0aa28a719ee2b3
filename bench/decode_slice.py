"""Decode-slice benchmark: one H200 runs one GPU's share of a Kimi K2-like and a GLM 5-like
decode step at TP 8 / EP 8, with our kernels, our paged KV pool and our integrity check.

What runs (synthetic random weights at the real per-GPU shapes, ``decode_slice_plan.py``):
- per layer: RMSNorms (the residual add in the norm's launch and one launch for SiLU-and-mul,
  as SGLang's sgl-kernel ops do, through the Triton stand-ins of ``sglang_glue``); the MLA
  projections (fused q_a + kv_a, q_b, o_proj; GLM's DSA indexer
  projections) as dense linears; the absorbed-MLA query and output bmm's (BF16); the rotary
  embedding of the query's and the new key's rope parts (one launch, ``sglang_glue``); the new
  token's latent stored into the paged cache (BF16 copy, or our FP8 quantize-on-write); our
  paged MLA decode attention (``paged_decode_mla_bf16`` / ``_fp8``); the router as SGLang runs it on
  Hopper (fp32 logits from its tiny GEMM, JIT-built by ``sglang_jit_build.py``, up to 16 rows,
  cuBLAS above; its Triton top-k kernel, taken from its source file); the shared expert; the
  routed experts of the one GPU that finishes the layer last (routing drawn at random,
  ``critical_share``): INT4 through our ``fused_moe`` (or SGLang's Marlin MoE with
  ``--int4-experts marlin``), FP8 through SGLang's own Triton fused-MoE kernel with block-scaled
  w8a8, taken from its source file.
- dense linears: FP8 through ``torch._scaled_mm`` (per-token activation scales from SGLang's
  Triton quantizer, per-row weight scales), or as SGLang runs block-FP8 checkpoints on Hopper
  (DeepGEMM, ``deepgemm.py``: the default where ``deep_gemm`` imports, as in SGLang); INT4
  through our ``w4a16_matmul`` (or Marlin's ``gptq_marlin_gemm`` with ``--int4-linears
  marlin``, the same weights repacked); the embedding, router and lm_head stay BF16 in both.
- once per step: the vocab-parallel embedding, the model's dense layers, final norm, lm_head and
  argmax, and with integrity on, the tagged allocator's per-step work (``PageTagTracker``
  ``on_alloc`` / ``record`` / ``verify``, the batched ``page_tag_check`` kernel).
- not modelled: the all-reduce / all-to-all between the 8 GPUs, the DSA
  indexer's scoring and sparse selection (attention here is dense MLA over every token).

Timing: two CUDA graphs per point, the once-per-step part (with and without integrity) and
``--slice-layers`` distinct MoE layers (weights of several GB: they stream from HBM); replays
are interleaved and paired; a full step is ``rest + layers x moe_layers / slice_layers``.

    python bench/decode_slice.py [--models kimi-k2,glm-5] [--concurrency 1,8,16,32,64,128]
        [--slice-layers 8] [--replays 30] [--sglang-src DIR] [--out DIR] [--tag _x]
        [--attention ours|flashmla] [--int4-linears ours|marlin] [--int4-experts ours|marlin]
        [--sglang-jit-dir DIR] [--fp8-linears auto|scaled-mm|deepgemm]
    python bench/decode_slice.py --plot bench/results/decode_slice.json --img-dir docs/img
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from accuracy import rel_l2
from decode_slice_plan import (
    CONCURRENCY,
    CONFIGS,
    CONTEXT_MIX,
    KV_DTYPES,
    MODELS,
    PAGE_SIZE,
    QUANTIZED_MODULES,
    WEIGHT_DTYPES,
    SliceShape,
    config_label,
    context_lengths,
    critical_share,
    draw_routing,
    expert_shares,
    integrity_cost,
    kv_comparison,
    median,
    model_shape,
    most_admitted,
    pages_for,
    percentile,
    pool_plan,
    step_samples,
    throughput_table,
    timed_levels,
    weights_comparison,
)
from deepgemm import DeepGemm, dequantize_blocks, dequantize_groups
from marlin import Marlin
from sglang_glue import (
    add_rms_norm,
    add_rms_norm_ref,
    rope_cache,
    rope_inplace,
    rope_inplace_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from sglang_jit_build import TINY_GEMM_MAX_M
from sglang_source import find_sglang_source, load_triton_functions
from tessera.kernels import w4a16_gemm
from tessera.kernels.fp8_kv_quant import write_kv_fp8, write_kv_fp8_ref
from tessera.kernels.paged_decode_bf16 import (
    MLA_ROPE_DIM,
    paged_decode_mla_bf16,
    paged_decode_mla_bf16_ref,
)
from tessera.kernels.paged_decode_fp8 import paged_decode_mla_fp8, paged_decode_mla_fp8_ref
from tessera.kernels.paged_kv import FP8_DTYPE, PageTable
from tessera.kernels.w4a16_format import PACK, W4A16Weight
from tessera.kernels.w4a16_gemm import capture_graph, w4a16_matmul, w4a16_matmul_reference
from tessera.kernels.w4a16_moe import align_to_experts, fused_moe, fused_moe_reference
from tessera.runtime.integrity.tracker import PageTagTracker, TrackerShape
from tuned_picks import load_tuned_picks, tuned_picks

FP8_MAX = 448.0
FP8_BLOCK = 128  # SGLang's block-scaled FP8 weights: one scale per 128 x 128
FP8_RMS = 0.5  # about the RMS of the random e4m3 bytes below
INT4_RMS = 4.6  # RMS of a uniform 4-bit code minus the symmetric zero point 8
NORM_EPS = 1e-6

# ---------------------------------------------------------------------------- SGLang kernels

# Its default for block-scaled FP8 when no tuned file matches (none does for 48 or 32 local
# experts of width 2048 on the H200), and two small-M tiles from its tuned H200 FP8 files.
SGLANG_FP8_CONFIGS = (
    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
     "num_warps": 4, "num_stages": 3},
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
     "num_warps": 4, "num_stages": 4},
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
     "num_warps": 4, "num_stages": 3},
)  # fmt: skip


@dataclass
class SglangKernels:
    fused_moe: Any  # fused_moe_kernel
    group_quant: Any  # _per_token_group_quant_8bit
    router: Any  # _router_triton_kernel (moe_fused_gate)
    config: dict[str, int] = field(default_factory=lambda: dict(SGLANG_FP8_CONFIGS[0]))


def load_sglang_kernels(src_dir: Path | None = None) -> SglangKernels:
    moe = load_triton_functions(find_sglang_source("fused_moe_triton_kernels.py", src_dir),
                                {"write_zeros_to_output", "fused_moe_kernel"})  # fmt: skip
    quant = load_triton_functions(find_sglang_source("fp8_kernel.py", src_dir),
                                  {"_per_token_group_quant_8bit"})  # fmt: skip
    gate = load_triton_functions(find_sglang_source("moe_fused_gate.py", src_dir),
                                 {"_router_triton_kernel"})  # fmt: skip
    return SglangKernels(moe["fused_moe_kernel"], quant["_per_token_group_quant_8bit"],
                         gate["_router_triton_kernel"])  # fmt: skip


def select_experts(k: SglangKernels, logits: torch.Tensor, bias: torch.Tensor,
                   top_k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """SGLang's router for Kimi K2's and GLM 5's routing (sigmoid scores, a correction bias
    that ranks but does not weigh, no expert groups, the top-k weights renormalized): its Triton
    kernel with the arguments ``moe_fused_gate`` passes, one launch. -> (fp32 weights, int32
    ids), each ``[rows, top_k]``."""
    rows, n = logits.shape
    weights = torch.empty((rows, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, top_k), dtype=torch.int32, device=logits.device)
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(4, 256 // block_n))
    pdl = _sm90(logits.device)
    k.router[(triton.cdiv(rows, block_m),)](
        logits, bias, None, None, None, weights, ids, ids, rows, 1.0, 0.0,
        N=n, K=top_k, K_ROUTED=top_k, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(top_k), N_GROUP=1, TOPK_GROUP=1, EXPERTS_PER_GROUP=n,
        BLOCK_G=1, SCORING_FUNC=0, SQRTSOFTPLUS_LOG1P=False, HAS_SOFTCAP=False,
        RENORMALIZE=True, APPLY_SCALE=False, HAS_BIAS=True, HAS_TOKEN_BIAS=False,
        BIAS_ALT_TOKEN_ID=None, HAS_PADDING=False, HAS_PACKED=False, RENORMALIZE_EPSILON=0.0,
        USE_PDL=pdl, stride_bias=bias.stride(0), stride_bias_alt=0, stride_input_ids=0,
        stride_sm=logits.stride(0), stride_sn=logits.stride(1), stride_wm=weights.stride(0),
        stride_wk=weights.stride(1), stride_im=ids.stride(0), stride_ik=ids.stride(1),
        stride_pm=0, stride_pk=0, num_warps=1 if block_n <= 512 else 4,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return weights, ids


def select_experts_ref(logits: torch.Tensor, bias: torch.Tensor,
                       top_k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    scores = torch.sigmoid(logits.float())
    ids = torch.topk(scores + bias, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def load_tiny_gemms(folder: Path | None) -> dict[tuple[int, int], Any]:
    """SGLang's ``tiny_gemm_bf16`` for the router shapes ``[N, K]`` that
    ``bench/sglang_jit_build.py --router N:K`` built into ``folder``."""
    if folder is None:
        return {}
    import tvm_ffi

    gemms = {}
    for path in sorted(folder.glob("tiny_gemm_*x*.so")):
        n, k = map(int, path.stem.removeprefix("tiny_gemm_").split("x"))
        gemms[(n, k)] = tvm_ffi.load_module(str(path)).run
    return gemms


def group_quant_fp8(k: SglangKernels, x: torch.Tensor, group: int):
    """SGLang's per-token-group FP8 quantization: e4m3 values and one fp32 scale per group."""
    x = x.contiguous()
    rows, cols = x.shape
    xq = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty((rows, cols // group), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(group)
    k.group_quant[(rows * (cols // group),)](
        x, xq, xs, group, group, 1e-10, bit8_min=-FP8_MAX, bit8_max=FP8_MAX, BLOCK=block,
        num_warps=min(max(block // 256, 1), 8), num_stages=1,
    )  # fmt: skip
    return xq, xs


def group_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    xf = x.float().view(rows, cols // group, group)
    scale = xf.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, cols), scale


def _sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def sglang_fp8_gemm(k: SglangKernels, a, a_scale, b, b_scale, pair_ids, block_expert, post_padded,
                    num_pairs, rows_top_k, routing=None):  # fmt: skip
    """One GEMM of SGLang's fused MoE (``invoke_fused_moe_kernel``'s block-FP8 launch)."""
    cfg = k.config
    out = torch.empty((num_pairs, b.shape[1]), dtype=torch.bfloat16, device=a.device)
    grid = (triton.cdiv(pair_ids.numel(), cfg["BLOCK_SIZE_M"])
            * triton.cdiv(b.shape[1], cfg["BLOCK_SIZE_N"]),)  # fmt: skip
    swap_ab = _sm90(a.device) and cfg["BLOCK_SIZE_M"] < 64 and cfg["BLOCK_SIZE_N"] >= 64
    k.fused_moe[grid](
        a, None, b, None, None, out, a_scale, b_scale,
        routing if routing is not None else a_scale, pair_ids, block_expert, post_padded, None,
        b.shape[1], b.shape[2], pair_ids.numel(), num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), 0, 0,
        out.stride(0), out.stride(1), a_scale.stride(0), a_scale.stride(1),
        b_scale.stride(0), b_scale.stride(2), b_scale.stride(1), FP8_BLOCK, FP8_BLOCK,
        MUL_ROUTED_WEIGHT=routing is not None, top_k=rows_top_k, compute_type=tl.bfloat16,
        use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
        even_Ks=b.shape[2] % cfg["BLOCK_SIZE_K"] == 0, c_sorted=False, swap_ab=swap_ab,
        FUSE_ADD_TO_OUTPUT=False, MASK_OUTPUT=False, FUSE_SUM_ALL_REDUCE=False, ROUTER_TOPK=1,
        **cfg,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------- weights


@dataclass
class Linear:
    """``y = x @ W.T``: BF16 ``[N, K]``, FP8 ``[N, K]``, or INT4. FP8 carries two scale sets:
    fp32 row scales ``[1, N]`` (``torch._scaled_mm``) and 128 x 128 block scales
    ``[ceil(N / 128), K / 128]`` (the checkpoints' own, which DeepGEMM takes)."""

    kind: str
    weight: Any
    scale: torch.Tensor | None = None
    block_scale: torch.Tensor | None = None
    marlin: tuple | None = None  # INT4 with --int4-linears marlin: the weight in Marlin's layout

    @property
    def nbytes(self) -> int:
        if isinstance(self.weight, W4A16Weight):
            return self.weight.qweight.nbytes + self.weight.scales.nbytes
        return self.weight.nbytes + (self.scale.nbytes if self.scale is not None else 0)


@dataclass
class Experts:
    """Local routed experts: FP8 ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` with 128 x 128 block
    scales (SGLang's layout), or INT4 ``W4A16Weight`` ``[E, K/8, N]`` (ours)."""

    kind: str
    w13: Any
    w2: Any
    s13: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    marlin: tuple | None = None  # INT4 with --int4-experts marlin: (w13, w2) in Marlin's layout

    @property
    def count(self) -> int:
        return (self.w13.qweight if self.kind == "int4" else self.w13).shape[0]

    @property
    def nbytes(self) -> int:
        if self.kind == "int4":
            return sum(w.qweight.nbytes + w.scales.nbytes for w in (self.w13, self.w2))
        return sum(t.nbytes for t in (self.w13, self.w2, self.s13, self.s2))


@dataclass
class Attention:
    norm: torch.Tensor
    qkv_a: Linear  # fused q_a_proj + kv_a_proj_with_mqa (replicated)
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    q_b: Linear
    w_kc: torch.Tensor  # [heads, qk_nope, kv_lora]: q_nope -> latent (absorbed kv_b)
    w_vc: torch.Tensor  # [heads, kv_lora, v_head]: latent -> v (absorbed kv_b)
    o: Linear
    indexer: list[Linear]  # DSA indexer projections (GLM-5): wq_b, wk, weights_proj


@dataclass
class MLP:
    norm: torch.Tensor
    up: Linear  # gate and up, stacked
    down: Linear


@dataclass
class MoE:
    norm: torch.Tensor
    router: Linear
    router_bias: torch.Tensor  # fp32 [experts]: the correction bias, for ranking only
    shared: MLP  # the shared expert (norm unused: the MoE's own)
    experts: Experts


@dataclass
class Common:
    """What both weight precisions share (BF16 in every scheme)."""

    embedding: torch.Tensor  # [vocab_shard, H]
    final_norm: torch.Tensor
    lm_head: Linear
    rope: torch.Tensor  # fp32 [positions, rope dims]: cosines, then sines (sglang_glue)


@dataclass
class Weights:
    dense: list[tuple[Attention, MLP]]
    moe: list[tuple[Attention, MoE]]

    def moe_layer_bytes(self) -> int:
        attn, moe = self.moe[0]
        return _nbytes(attn) + _nbytes(moe)


def add_marlin_copies(obj: Any, marlin: Marlin, linears: bool, experts: bool) -> None:
    """Give the INT4 linears and/or expert sets under ``obj`` their copy in Marlin's layout."""
    if isinstance(obj, Linear):
        if obj.kind == "int4" and linears:
            obj.marlin = marlin.from_ours(obj.weight)
    elif isinstance(obj, Experts):
        if obj.kind == "int4" and experts:
            obj.marlin = (marlin.from_ours(obj.w13), marlin.from_ours(obj.w2))
    elif isinstance(obj, list | tuple):
        for x in obj:
            add_marlin_copies(x, marlin, linears, experts)
    elif not isinstance(obj, torch.Tensor):
        for x in vars(obj).values():
            add_marlin_copies(x, marlin, linears, experts)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, Linear | Experts):
        return obj.nbytes
    if isinstance(obj, list):
        return sum(_nbytes(x) for x in obj)
    return sum(_nbytes(v) for v in vars(obj).values())


class Gen:
    """Seeded random tensors on one device."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.bfloat16)
        return x.mul_(scale)

    def norm_weight(self, dim: int) -> torch.Tensor:
        return 1.0 + self.randn(dim, scale=0.05)

    def fp8(self, *shape: int) -> torch.Tensor:
        """Random finite e4m3 values (bit 6 cleared: exponent <= 7, |x| <= 1.875, never NaN)."""
        raw = torch.randint(0, 256, shape, generator=self.gen, device=self.device,
                            dtype=torch.uint8)  # fmt: skip
        return raw.bitwise_and_(0xBF).view(FP8_DTYPE)

    def scales(self, *shape: int, scale: float) -> torch.Tensor:
        u = torch.rand(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return u.mul_(0.5).add_(0.75).mul_(scale)

    def int4(self, *lead: int, n: int, k: int, group: int) -> W4A16Weight:
        q = torch.randint(-(2**31), 2**31 - 1, (*lead, k // PACK, n), generator=self.gen,
                          device=self.device, dtype=torch.int32)  # fmt: skip
        s = self.scales(*lead, k // group, n, scale=1 / (INT4_RMS * math.sqrt(k)))
        return W4A16Weight(q, s.to(torch.bfloat16), None, group)

    def linear(self, n: int, k: int, kind: str, group: int) -> Linear:
        if kind == "bf16":
            return Linear("bf16", self.randn(n, k, scale=1 / math.sqrt(k)))
        if kind == "fp8":
            scale = 1 / (FP8_RMS * math.sqrt(k))
            blocks = self.scales(-(-n // FP8_BLOCK), k // FP8_BLOCK, scale=scale)
            return Linear("fp8", self.fp8(n, k), self.scales(1, n, scale=scale), blocks)
        return Linear("int4", self.int4(n=n, k=k, group=group))

    def experts(self, e: int, hidden: int, width: int, kind: str, group: int) -> Experts:
        if kind == "int4":
            return Experts("int4", self.int4(e, n=2 * width, k=hidden, group=group),
                           self.int4(e, n=hidden, k=width, group=group))  # fmt: skip
        b = FP8_BLOCK
        return Experts(
            "fp8", self.fp8(e, 2 * width, hidden), self.fp8(e, hidden, width),
            self.scales(e, 2 * width // b, hidden // b, scale=1 / (FP8_RMS * math.sqrt(hidden))),
            self.scales(e, hidden // b, width // b, scale=1 / (FP8_RMS * math.sqrt(width))),
        )  # fmt: skip


def build_common(shape: SliceShape, gen: Gen) -> Common:
    h = shape.hidden
    positions = 2 * max(CONTEXT_MIX)  # past every request's new token
    return Common(gen.randn(shape.vocab_shard, h), gen.norm_weight(h),
                  gen.linear(shape.vocab_shard, h, "bf16", 0),
                  rope_cache(positions, shape.rope, gen.device))  # fmt: skip


def build_attention(s: SliceShape, kind: str, group: int, gen: Gen) -> Attention:
    h, heads = s.hidden, s.heads
    indexer = []
    if s.index_heads:
        indexer = [gen.linear(s.index_heads * s.index_dim, s.q_lora, kind, group),
                   gen.linear(s.index_dim, h, kind, group),
                   gen.linear(s.index_heads, h, "bf16", group)]  # fmt: skip
    return Attention(
        norm=gen.norm_weight(h),
        qkv_a=gen.linear(s.q_lora + s.latent_dim, h, kind, group),
        q_norm=gen.norm_weight(s.q_lora),
        kv_norm=gen.norm_weight(s.kv_lora),
        q_b=gen.linear(heads * (s.qk_nope + s.rope), s.q_lora, kind, group),
        w_kc=gen.randn(heads, s.qk_nope, s.kv_lora, scale=1 / math.sqrt(s.qk_nope)),
        w_vc=gen.randn(heads, s.kv_lora, s.v_head, scale=1 / math.sqrt(s.kv_lora)),
        o=gen.linear(h, heads * s.v_head, kind, group),
        indexer=indexer,
    )


def build_mlp(hidden: int, width: int, kind: str, group: int, gen: Gen) -> MLP:
    return MLP(gen.norm_weight(hidden), gen.linear(2 * width, hidden, kind, group),
               gen.linear(hidden, width, kind, group))  # fmt: skip


def build_weights(s: SliceShape, kind: str, group: int, moe_layers: int, gen: Gen) -> Weights:
    """``s.dense_layers`` dense layers and ``moe_layers`` distinct MoE layers in ``kind``."""
    dense = [(build_attention(s, kind, group, gen), build_mlp(s.hidden, s.dense_width, kind,
                                                              group, gen))
             for _ in range(s.dense_layers)]  # fmt: skip
    moe = []
    for _ in range(moe_layers):
        layer = MoE(
            norm=gen.norm_weight(s.hidden),
            router=gen.linear(s.experts, s.hidden, "bf16", group),
            router_bias=gen.randn(s.experts, scale=0.01).float(),
            shared=build_mlp(s.hidden, s.shared_width, kind, group, gen),
            experts=gen.experts(s.local_experts, s.hidden, s.expert_width, kind, group),
        )
        moe.append((build_attention(s, kind, group, gen), layer))
    return Weights(dense, moe)


# ---------------------------------------------------------------------------- KV pool, batch


@dataclass
class KVCache:
    """One layer's latent cache in our paged layout: ``[(pages + 1) x page_size, 1, 576]``
    token rows (page 0 is padding), BF16 or FP8 with one per-tensor scale."""

    rows: torch.Tensor
    scale: torch.Tensor | None  # 0-dim fp32 (FP8) or None (BF16)


def new_cache(pages: int, dim: int, kv_dtype: str, gen: Gen) -> KVCache:
    slots = (pages + 1) * PAGE_SIZE
    if kv_dtype == "bf16":
        return KVCache(gen.randn(slots, 1, dim), None)
    scale = torch.tensor(1.0, dtype=torch.float32, device=gen.device)
    return KVCache(gen.fp8(slots, 1, dim), scale)


@dataclass
class LayerRouting:
    """The critical GPU's (token, local expert) pairs of one layer, each pair a row (top 1)."""

    tokens: torch.Tensor  # int64 [P]
    ids: torch.Tensor  # int32 [P, 1]
    weights: torch.Tensor  # fp32 [P, 1]
    distinct_experts: int
    mean_distinct_experts: float  # over the 8 GPUs


def layer_routings(s: SliceShape, batch: int, layers: int, seed: int,
                   device: torch.device) -> list[LayerRouting]:  # fmt: skip
    rng = random.Random(seed)
    out = []
    for _ in range(layers):
        ids, weights = draw_routing(rng, batch, s.experts, s.top_k)
        shares = expert_shares(ids, weights, s.experts, s.experts // s.local_experts)
        c = critical_share(shares)
        out.append(LayerRouting(
            torch.tensor(c.tokens, dtype=torch.int64, device=device),
            torch.tensor(c.local_experts, dtype=torch.int32, device=device).view(-1, 1),
            torch.tensor(c.weights, dtype=torch.float32, device=device).view(-1, 1),
            c.distinct_experts, sum(x.distinct_experts for x in shares) / len(shares),
        ))  # fmt: skip
    return out


class RoutingDraws(dict):
    """Each concurrency's routing draws, made on first use with a seed of the level alone, so a
    level gets the same draws whichever configurations time it."""

    def __init__(self, shape: SliceShape, layers: int, device: torch.device) -> None:
        super().__init__()
        self.shape, self.layers, self.device = shape, layers, device

    def __missing__(self, c: int) -> list[LayerRouting]:
        self[c] = layer_routings(self.shape, c, self.layers, seed=1000 + c, device=self.device)
        return self[c]


class IntegrityCheck:
    """The tagged allocator's state for a batch, and its per-step work: the new token's slot
    through ``on_alloc`` and ``record`` (as SGLang's decode allocation and page-table write do),
    then the batched check of every page of every request (``verify``)."""

    def __init__(self, pages: list[list[int]], lengths: list[int], pool_pages: int,
                 device: torch.device) -> None:  # fmt: skip
        batch, max_pages = len(pages), max(len(p) for p in pages)
        shape = TrackerShape(pool_pages, PAGE_SIZE, batch, max_pages)
        self.tracker = PageTagTracker(shape, device)
        page_lists = [torch.tensor(p, dtype=torch.int64) for p in pages]
        table = torch.zeros(batch, max_pages * PAGE_SIZE, dtype=torch.int32)
        for b, (p, n) in enumerate(zip(page_lists, lengths, strict=True)):
            t = torch.arange(n)
            table[b, :n] = (p[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE).to(torch.int32)
        self.table = table.to(device)  # SGLang's req_to_token: token slots per request row
        # Every page handed out (tag bumped) and recorded at its position, as at admission.
        start_slots = (torch.cat(page_lists) * PAGE_SIZE).to(device)
        self.tracker.on_alloc(start_slots)
        rows = torch.cat([torch.full((len(p),), b) for b, p in enumerate(page_lists)])
        positions = torch.cat([torch.arange(len(p)) * PAGE_SIZE for p in page_lists])
        self.tracker.record(rows.to(device), positions.to(device), start_slots)
        self.rows = torch.arange(batch, device=device)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.positions = self.seq_lens.long() - 1
        self.new_slots = self.table[self.rows, self.positions].long()

    def step(self) -> torch.Tensor:
        self.tracker.on_alloc(self.new_slots)
        self.tracker.record(self.rows, self.positions, self.new_slots)
        return self.tracker.verify(self.table, self.rows, self.seq_lens)


@dataclass
class Batch:
    lengths: list[int]
    table: PageTable
    token_ids: torch.Tensor  # int64 [B]
    integrity: IntegrityCheck
    block_table: torch.Tensor  # int32 [B, pages]: each request's pages (FlashMLA's table)
    positions: torch.Tensor  # int64 [B]: each new token's position (its rotary angle)
    flashmla_meta: dict = field(default_factory=dict)  # KV dtype -> FlashMLA's split schedule

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def total_len(self) -> int:
        return sum(self.lengths)

    @property
    def new_slots(self) -> torch.Tensor:
        """int64 [B]: where each request's new token goes."""
        return self.integrity.new_slots


def build_batch(lengths: list[int], pool_pages: int, vocab_shard: int, seed: int,
                device: torch.device) -> Batch:  # fmt: skip
    """Pages for each request's full context from the pool's free list (shuffled, as after
    churn); each request decodes its last token. Token ids are drawn from this GPU's vocabulary
    shard, so its lookup returns the row the (unmodelled) all-reduce would: no zero rows."""
    need = [pages_for(n) for n in lengths]
    if sum(need) > pool_pages:
        raise ValueError(f"{sum(need)} pages needed, the pool has {pool_pages}")
    gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(pool_pages, generator=gen) + 1).tolist()  # page 0 is padding
    pages, at = [], 0
    for k in need:
        pages.append(free[at : at + k])
        at += k
    check = IntegrityCheck(pages, lengths, pool_pages, device)
    # Attention reads the very req_to_token rows the integrity check guards (token-slot form).
    width = check.table.shape[1]
    table = PageTable.from_sglang(
        torch.arange(len(lengths) + 1, device=device, dtype=torch.int64) * width,
        check.table.flatten(),
        check.seq_lens,
        PAGE_SIZE,
    )
    token_ids = torch.randint(0, vocab_shard, (len(lengths),), generator=gen).to(device)
    block_table = (check.table[:, ::PAGE_SIZE] // PAGE_SIZE).contiguous()  # page 0: padding
    positions = torch.tensor(lengths, device=device) - 1
    return Batch(lengths, table, token_ids, check, block_table, positions)


# ---------------------------------------------------------------------------- ops


class KernelOps:
    """The kernels a serving GPU runs."""

    def __init__(self, sglang: SglangKernels | None, flashmla: Any = None,
                 marlin: Marlin | None = None, deepgemm: Any = None,
                 tiny_gemms: dict[tuple[int, int], Any] | None = None) -> None:  # fmt: skip
        self.sglang = sglang
        self.tiny_gemms = tiny_gemms or {}  # SGLang's router GEMM by [N, K], where built
        self.flashmla = flashmla  # the flash_mla module: attention by FlashMLA instead of ours
        self.marlin = marlin  # INT4 weights with a Marlin copy run SGLang's Marlin kernels
        self.deepgemm = deepgemm  # FP8 linears by DeepGEMM with block scales (deepgemm.py)
        self.constants: dict[tuple, torch.Tensor] = {}

    def linear(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        if lin.kind == "bf16":
            return x @ lin.weight.T
        if lin.kind == "int4" and lin.marlin is not None:
            out = torch.empty(x.shape[0], lin.weight.n, dtype=torch.bfloat16, device=x.device)
            return self.marlin.gemm(x.contiguous(), *lin.marlin, out)
        if lin.kind == "int4":
            return w4a16_matmul(x.contiguous(), lin.weight)
        if self.deepgemm is not None:
            return self.deepgemm.linear(x, lin.weight, lin.block_scale)
        assert self.sglang is not None, "FP8 linears quantize activations with SGLang's kernel"
        xq, xs = group_quant_fp8(self.sglang, x, x.shape[1])
        return torch._scaled_mm(xq, lin.weight.T, scale_a=xs, scale_b=lin.scale,
                                out_dtype=torch.bfloat16)  # fmt: skip

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cache: torch.Tensor) -> None:  # fmt: skip
        rope_inplace(positions, q, k, cache)

    def router_logits(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        """fp32 logits, as SGLang's MoE gate computes them on Hopper: its tiny GEMM up to 16
        rows, else cuBLAS bf16 x bf16 -> fp32 (torch's where the tiny GEMM was not built)."""
        tiny = self.tiny_gemms.get(tuple(lin.weight.shape))
        if tiny is not None and x.shape[0] <= TINY_GEMM_MAX_M:
            out = torch.empty(x.shape[0], lin.weight.shape[0], dtype=torch.float32,
                              device=x.device)  # fmt: skip
            tiny(x, lin.weight, out)
            return out
        if x.is_cuda:
            return torch.mm(x, lin.weight.T, out_dtype=torch.float32)
        return x.float() @ lin.weight.float().T

    def select_experts(self, logits: torch.Tensor, bias: torch.Tensor, top_k: int):
        assert self.sglang is not None, "the router is SGLang's kernel"
        return select_experts(self.sglang, logits, bias, top_k)

    def constant(self, value: int, device: torch.device) -> torch.Tensor:
        """An int32 ``[1]`` tensor of ``value``, made once (outside any graph capture: the
        warm-up calls make it)."""
        key = (value, device)
        if key not in self.constants:
            self.constants[key] = torch.full((1,), value, dtype=torch.int32, device=device)
        return self.constants[key]

    def norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """(x + delta, its RMSNorm): SGLang's fused_add_rmsnorm (rmsnorm without delta)."""
        return add_rms_norm(x, delta, weight, NORM_EPS)

    def silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(h)

    def moe(self, x: torch.Tensor, e: Experts, r: LayerRouting) -> torch.Tensor:
        if e.kind == "int4" and e.marlin is not None:
            return self.marlin.fused_moe(x, *e.marlin, r.weights, r.ids, e.w13.group_size)
        if e.kind == "int4":
            return fused_moe(x, e.w13, e.w2, r.weights, r.ids)
        return self.sglang_moe(x, e, r)

    def sglang_moe(self, x: torch.Tensor, e: Experts, r: LayerRouting) -> torch.Tensor:
        """SGLang's Triton fused MoE over block-FP8 experts: quantize, up GEMM, SiLU-and-mul,
        quantize, down GEMM with the routing weight (one pair per row, so no top-k sum)."""
        k = self.sglang
        assert k is not None
        pairs = r.ids.numel()
        block_m = k.config["BLOCK_SIZE_M"]
        pair_ids, block_expert = align_to_experts(r.ids, e.count, block_m)
        # every block, as one launch of SGLang's moe_align_block_size gives it with the rest; the
        # kernel skips blocks of expert -1
        post_padded = self.constant(pair_ids.numel(), x.device)
        routing = r.weights.reshape(-1)
        a, a_s = group_quant_fp8(k, x, FP8_BLOCK)
        h = sglang_fp8_gemm(k, a, a_s, e.w13, e.s13, pair_ids, block_expert, post_padded,
                            pairs, 1)  # fmt: skip
        a, a_s = group_quant_fp8(k, silu_and_mul(h), FP8_BLOCK)
        return sglang_fp8_gemm(k, a, a_s, e.w2, e.s2, pair_ids, block_expert, post_padded,
                               pairs, 1, routing)  # fmt: skip

    def write_kv(self, cache: KVCache, new: torch.Tensor, slots: torch.Tensor) -> None:
        if cache.scale is None:
            cache.rows.index_copy_(0, slots, new)
        else:
            self.write_fp8(new, cache.rows, cache.scale, slots)

    write_fp8 = staticmethod(write_kv_fp8)

    def attend(self, q: torch.Tensor, cache: KVCache, batch: Batch, sm_scale: float):
        if self.flashmla is not None:
            return self.flashmla_attend(q, cache, batch, sm_scale)
        if cache.scale is None:
            return paged_decode_mla_bf16(q, cache.rows, batch.table, sm_scale,
                                         max_seq_len=batch.max_len,
                                         total_tokens=batch.total_len)  # fmt: skip
        return paged_decode_mla_fp8(q, cache.rows, cache.scale, batch.table, sm_scale,
                                    max_seq_len=batch.max_len,
                                    total_tokens=batch.total_len)  # fmt: skip

    def flashmla_attend(self, q: torch.Tensor, cache: KVCache, batch: Batch, sm_scale: float):
        """SGLang's flashmla backend's call (the legacy SM90 dense kernels): the same 64-token
        pages, the FP8 cache with its per-tensor scale, q cast to e4m3 each step as SGLang
        does. The split schedule is made once per batch (before the graphs are captured)."""
        fm, fp8 = self.flashmla, cache.scale is not None
        heads, latent = q.shape[1], cache.rows.shape[-1] - MLA_ROPE_DIM
        lens = batch.integrity.seq_lens
        meta = batch.flashmla_meta.get(fp8)
        if meta is None:
            meta = fm.get_mla_metadata()[0]  # BF16: filled by the first call
            if fp8:
                meta.tile_scheduler_metadata, meta.num_splits = fm.get_mla_decoding_metadata(
                    lens, heads, 1, heads, is_fp8_kvcache=True, use_legacy=True)  # fmt: skip
            batch.flashmla_meta[fp8] = meta
        pages = cache.rows.view(-1, PAGE_SIZE, 1, cache.rows.shape[-1])
        if not fp8:
            return fm.flash_mla_with_kvcache(q.unsqueeze(1), pages, batch.block_table, lens,
                                             latent, meta, softmax_scale=sm_scale,
                                             use_legacy=True)[0].squeeze(1)  # fmt: skip
        descale = cache.scale.reshape(1)
        return fm.flash_mla_with_kvcache(q.unsqueeze(1).to(FP8_DTYPE), pages,
                                         batch.block_table, lens, latent, meta,
                                         softmax_scale=sm_scale, is_fp8_kvcache=True,
                                         use_legacy=True, descale_q=torch.ones_like(descale),
                                         descale_k=descale)[0].squeeze(1)  # fmt: skip

    def integrity(self, batch: Batch) -> torch.Tensor:
        return batch.integrity.step()


class ReferenceOps(KernelOps):
    """Pure torch, in fp32, rounding to BF16 where the kernels store BF16."""

    def norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        return add_rms_norm_ref(x, delta, weight, NORM_EPS)

    def silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(h)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cache: torch.Tensor) -> None:  # fmt: skip
        rope_inplace_ref(positions, q, k, cache)

    def router_logits(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return x.float() @ lin.weight.float().T

    def select_experts(self, logits: torch.Tensor, bias: torch.Tensor, top_k: int):
        return select_experts_ref(logits, bias, top_k)

    def linear(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        if lin.kind == "bf16":
            return (x.float() @ lin.weight.float().T).to(torch.bfloat16)
        if lin.kind == "int4":
            return w4a16_matmul_reference(x, lin.weight).to(torch.bfloat16)
        if self.deepgemm is not None:
            w = dequantize_blocks(lin.weight, lin.block_scale)
            return (dequantize_groups(*group_quant_ref(x, FP8_BLOCK)) @ w.T).to(torch.bfloat16)
        xq, xs = group_quant_ref(x, x.shape[1])
        w = lin.weight.float() * lin.scale.view(-1, 1)
        return (dequantize_groups(xq, xs) @ w.T).to(torch.bfloat16)

    def moe(self, x: torch.Tensor, e: Experts, r: LayerRouting) -> torch.Tensor:
        used = r.ids.unique()
        local = torch.searchsorted(used, r.ids)  # the reference dequantizes the used experts
        if e.kind == "int4":

            def pick(w: W4A16Weight) -> W4A16Weight:
                return W4A16Weight(w.qweight[used], w.scales[used], None, w.group_size)

            out = fused_moe_reference(x, pick(e.w13), pick(e.w2), r.weights, local)
            return out.to(torch.bfloat16)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for j, expert in enumerate(used.tolist()):
            rows = (local[:, 0] == j).nonzero().squeeze(1)
            w13 = dequantize_blocks(e.w13[expert], e.s13[expert])
            w2 = dequantize_blocks(e.w2[expert], e.s2[expert])
            h = (dequantize_groups(*group_quant_ref(x[rows], FP8_BLOCK)) @ w13.T).to(torch.bfloat16)
            gate, up = h.chunk(2, dim=-1)
            act = dequantize_groups(*group_quant_ref(F.silu(gate) * up, FP8_BLOCK))
            out[rows] = (r.weights[rows] * (act @ w2.T)).to(torch.bfloat16).float()
        return out.to(torch.bfloat16)

    write_fp8 = staticmethod(write_kv_fp8_ref)

    def attend(self, q: torch.Tensor, cache: KVCache, batch: Batch, sm_scale: float):
        if cache.scale is None:
            out = paged_decode_mla_bf16_ref(q, cache.rows, batch.table, sm_scale)
        else:
            out = paged_decode_mla_fp8_ref(q, cache.rows, cache.scale, batch.table, sm_scale)
        return out.to(torch.bfloat16)


# ---------------------------------------------------------------------------- the step


class SliceStep:
    """One GPU's decode step over ``batch``; ``ops`` picks the kernels or the reference.

    With a ``side`` stream the step overlaps what SGLang 0.5.23's CUDA-graph decode overlaps in
    DeepSeek-style models (``deepseek_v2.py``, ``forward_mla.py``: on CUDA its ``alt_stream``,
    used in capture mode): the kv_a norm beside the q_a norm; in DSA models (GLM 5) the q_b
    projection beside the indexer; the shared expert beside the router and the routed experts
    (Kimi K2 and GLM 5 do not fuse it into the experts). Each piece is forked where SGLang
    forks it and joined before its output is used; the side stream's tensors are freed only
    after a later fork, so no allocation is reused while the other stream reads it."""

    def __init__(self, shape: SliceShape, common: Common, weights: Weights,
                 dense_caches: list[KVCache], moe_caches: list[KVCache], batch: Batch,
                 routing: list[LayerRouting], ops: KernelOps,
                 side: torch.cuda.Stream | None = None) -> None:  # fmt: skip
        self.s, self.common, self.w = shape, common, weights
        self.dense_caches, self.moe_caches = dense_caches, moe_caches
        self.batch, self.routing, self.ops, self.side = batch, routing, ops, side

    def fork(self) -> None:
        """The side stream waits for what the current one has issued so far."""
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())

    def beside(self) -> contextlib.AbstractContextManager:
        """Issue on the side stream (on the current one without a side stream)."""
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def join(self) -> None:
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)

    def attention(self, a: Attention, cache: KVCache, x: torch.Tensor,
                  delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The residual stream ``x`` plus the previous block's output ``delta`` (added in the
        norm, as SGLang does) -> (that residual, this attention block's output)."""
        s, ops, n = self.s, self.ops, x.shape[0]
        x, h = ops.norm(x, delta, a.norm)
        qkv = ops.linear(h, a.qkv_a)
        self.fork()
        q_c = ops.norm(qkv[:, : s.q_lora], None, a.q_norm)[1]
        with self.beside():
            kv_c = ops.norm(qkv[:, s.q_lora : s.q_lora + s.kv_lora], None, a.kv_norm)[1]
        self.join()
        if a.indexer:  # DSA: the indexer's GEMMs (only), with q_b beside them
            self.fork()
            for lin, src in zip(a.indexer, (q_c, h, h), strict=True):
                ops.linear(src, lin)
            with self.beside():
                q = ops.linear(q_c, a.q_b)
            self.join()
        else:
            q = ops.linear(q_c, a.q_b)
        q = q.view(n, s.heads, s.qk_nope + s.rope)
        # as SGLang's absorbed MLA before FlashMLA: the bmm, the rope in place, one cat for the
        # query and one for the new latent
        q_nope = torch.bmm(q[..., : s.qk_nope].transpose(0, 1), a.w_kc).transpose(0, 1)
        k_pe = qkv[:, s.q_lora + s.kv_lora :]
        ops.rope(self.batch.positions, q[..., s.qk_nope :], k_pe, self.common.rope)
        q_mla = torch.cat([q_nope, q[..., s.qk_nope :]], dim=-1)
        new = torch.cat([kv_c, k_pe], dim=-1).unsqueeze(1)
        ops.write_kv(cache, new, self.batch.new_slots)
        o = ops.attend(q_mla, cache, self.batch, s.sm_scale)  # [B, heads, kv_lora]
        v = torch.empty(n, s.heads * s.v_head, dtype=torch.bfloat16, device=x.device)
        # SGLang's output bmm writes the heads side by side in place (no copy after it)
        torch.bmm(o.transpose(0, 1), a.w_vc, out=v.view(n, s.heads, s.v_head).transpose(0, 1))
        return x, ops.linear(v, a.o)

    def mlp(self, m: MLP, h: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self.ops.silu_mul(self.ops.linear(h, m.up)), m.down)

    def dense_layer(self, i: int, x: torch.Tensor,
                    delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(residual, pending output) in and out, as SGLang's decoder layers pass them."""
        attn, mlp = self.w.dense[i]
        x, o = self.attention(attn, self.dense_caches[i], x, delta)
        x, h = self.ops.norm(x, o, mlp.norm)
        return x, self.mlp(mlp, h)

    def moe_layer(self, i: int, x: torch.Tensor,
                  delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        attn, moe = self.w.moe[i]
        r = self.routing[i]
        x, o = self.attention(attn, self.moe_caches[i], x, delta)
        x, h = self.ops.norm(x, o, moe.norm)
        self.fork()
        logits = self.ops.router_logits(h, moe.router)
        # its selection; the drawn routing replaces it
        self.ops.select_experts(logits, moe.router_bias, self.s.top_k)
        routed = self.ops.moe(h.index_select(0, r.tokens), moe.experts, r)
        with self.beside():
            shared = self.mlp(moe.shared, h)
        self.join()
        return x, shared.index_add_(0, r.tokens, routed)

    def embed(self) -> torch.Tensor:
        """Vocab-parallel lookup on shard 0: ids outside the shard give zero rows, which the
        (unmodelled) all-reduce over the shards fills in."""
        ids = self.batch.token_ids
        inside = (ids < self.s.vocab_shard).unsqueeze(1)
        rows = F.embedding(ids.clamp(max=self.s.vocab_shard - 1), self.common.embedding)
        return rows * inside

    def head(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        h = self.ops.norm(x, delta, self.common.final_norm)[1]
        logits = self.ops.linear(h, self.common.lm_head)
        return logits, logits.argmax(dim=-1)

    def front(self, integrity: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, Any]]:
        """The integrity check (bad pages per request; empty when off), the embedding and the
        dense layers: (bad, (residual, pending output))."""
        bad = self.ops.integrity(self.batch) if integrity else torch.zeros(0)
        x, delta = self.embed(), None
        for i in range(len(self.w.dense)):
            x, delta = self.dense_layer(i, x, delta)
        return bad, (x, delta)

    def rest(self, integrity: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step: the front, final norm and head (the MoE layers are timed apart)."""
        return self.head(*self.front(integrity)[1])

    def layers(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for i in range(len(self.w.moe)):
            x, delta = self.moe_layer(i, x, delta)
        return x, delta

    def step(self, integrity: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slice's whole step in order (tests): (bad pages per request, logits, next ids)."""
        bad, (x, delta) = self.front(integrity)
        logits, ids = self.head(*self.layers(x, delta))
        return bad, logits, ids


# ---------------------------------------------------------------------------- timing


def capture(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn`` after warm-up calls (compilation and tuning stay outside)."""
    graph = capture_graph(fn, warmup)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_seconds(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def pick_sglang_config(k: SglangKernels, x: torch.Tensor, e: Experts,
                       r: LayerRouting) -> dict[str, Any]:  # fmt: skip
    """SGLang's FP8 MoE gets the best of its default and two tuned small-M tiles."""
    from timing import graph_time_us

    ops, times = KernelOps(k), {}
    for i, cfg in enumerate(SGLANG_FP8_CONFIGS):
        k.config = dict(cfg)
        times[i] = graph_time_us(lambda _i: ops.sglang_moe(x, e, r), 1)
    best = min(times, key=times.__getitem__)
    k.config = dict(SGLANG_FP8_CONFIGS[best])
    return {"config": k.config, "candidates_us": [round(times[i], 1) for i in sorted(times)]}


def component_ms(step: SliceStep, replays: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per-layer time of three parts of the MoE layer, each alone in a graph over the slice's
    layers (fresh random inputs of the real shapes), the graphs' replays interleaved: the routed
    experts, every dense linear (the router GEMM among them), and the attention kernel with its
    KV store. The layer time minus these is the rest (norms, the absorbed-MLA bmm's, copies,
    the router's top-k, gather/scatter, SiLU). Second, what is timed beside them: where the
    layer's INT4 experts run Marlin's MoE, our fused MoE on the same inputs
    (``routed_experts_ours``), so that both expert kernels meet in one run."""
    s, ops, batch, n = step.s, step.ops, step.batch, len(step.batch.lengths)
    gen = Gen(step.batch.new_slots.device, seed=99)
    layers = list(zip(step.w.moe, step.moe_caches, step.routing, strict=True))
    linear_inputs = []
    for attn, moe in step.w.moe:
        lins = [attn.qkv_a, attn.q_b, attn.o, *attn.indexer, moe.shared.up, moe.shared.down]
        linear_inputs += [(ops.linear, gen.randn(n, _in_features(lin)), lin) for lin in lins]
        linear_inputs.append((ops.router_logits, gen.randn(n, s.hidden), moe.router))
    expert_inputs = [(gen.randn(r.tokens.numel(), s.hidden), moe.experts, r)
                     for (_, moe), _, r in layers]  # fmt: skip
    q = gen.randn(n, s.heads, s.latent_dim)
    new = gen.randn(n, 1, s.latent_dim)

    def attention() -> None:
        for _, cache, _ in layers:
            ops.write_kv(cache, new, batch.new_slots)
            ops.attend(q, cache, batch, s.sm_scale)

    parts = {
        "routed_experts": lambda: [ops.moe(x, e, r) for x, e, r in expert_inputs],
        "dense_linears": lambda: [linear(x, lin) for linear, x, lin in linear_inputs],
        "attention_kernel": attention,
    }
    beside = {}
    if any(e.kind == "int4" and e.marlin is not None for _, e, _ in expert_inputs):
        beside["routed_experts_ours"] = lambda: [fused_moe(x, e.w13, e.w2, r.weights, r.ids)
                                                 for x, e, r in expert_inputs]  # fmt: skip
    graphs = {name: capture(fn, warmup=1) for name, fn in {**parts, **beside}.items()}
    for graph in graphs.values():
        replay_seconds(graph)
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(replays):
        for name, graph in graphs.items():
            samples[name].append(replay_seconds(graph))
    del graphs
    ms = {name: median(v) * 1e3 / len(layers) for name, v in samples.items()}
    return {name: ms[name] for name in parts}, {name: ms[name] for name in beside}


def _in_features(lin: Linear) -> int:
    return lin.weight.k if isinstance(lin.weight, W4A16Weight) else lin.weight.shape[1]


def bench_model(name: str, args: argparse.Namespace, sglang: SglangKernels, device: torch.device,
                save: Callable[[list[dict], dict], None]) -> tuple[list[dict], dict]:  # fmt: skip
    shape, choice = model_shape(name), MODELS[name]
    t0 = time.time()
    gen = Gen(device, seed=11)
    common = build_common(shape, gen)
    weights = {w: build_weights(shape, w, choice.int4_group, args.slice_layers, gen)
               for w in WEIGHT_DTYPES}  # fmt: skip
    if args.marlin is not None:
        add_marlin_copies(weights["int4"], args.marlin, args.int4_linears == "marlin",
                          args.int4_experts == "marlin")  # fmt: skip
    torch.cuda.synchronize()
    info: dict[str, Any] = {
        "shape": vars(shape), "int4_group": choice.int4_group,
        "slice_moe_layer_bytes": {w: weights[w].moe_layer_bytes() for w in WEIGHT_DTYPES},
        "weights_built_s": round(time.time() - t0, 1), "pools": {}, "checks": {},
        "sglang_fp8_moe": {},
    }  # fmt: skip
    print(f"[{name}] weights built in {info['weights_built_s']} s", flush=True)
    routing = RoutingDraws(shape, args.slice_layers, device)
    side = torch.cuda.Stream(device) if args.streams != "one" else None
    rows = []
    for w, kv in CONFIGS:
        plan = pool_plan(name, w, kv)
        info["pools"][f"{w}/{kv}"] = vars(plan) | {"pages": plan.pages}
        if f"{w}/{kv}" not in args.configs:
            continue
        levels = timed_levels(args.concurrency, plan.pages, args.exact_max_cap)
        for c in args.concurrency:
            if c not in levels:
                rows.append(_row(name, w, kv, c, plan, admitted=False))
        if not levels:
            continue
        gen_kv = Gen(device, seed=23)
        dense_caches = [new_cache(plan.pages, shape.latent_dim, kv, gen_kv)
                        for _ in range(shape.dense_layers)]  # fmt: skip
        moe_caches = [new_cache(plan.pages, shape.latent_dim, kv, gen_kv)
                      for _ in range(args.slice_layers)]  # fmt: skip
        for c in levels:
            t1 = time.time()
            batch = build_batch(context_lengths(c), plan.pages, shape.vocab_shard, c, device)
            ops = KernelOps(sglang, args.flashmla, args.marlin, args.deepgemm, args.tiny_gemms)
            step = SliceStep(shape, common, weights[w], dense_caches, moe_caches, batch,
                             routing[c], ops, side)  # fmt: skip
            x_in = Gen(device, seed=c).randn(c, shape.hidden)
            d_in = Gen(device, seed=c + 1).randn(c, shape.hidden)  # the last dense layer's output
            if w == "fp8":
                key = str(c)
                if key not in info["sglang_fp8_moe"]:
                    r0, moe0 = routing[c][0], weights[w].moe[0][1]
                    h0 = x_in.index_select(0, r0.tokens)
                    info["sglang_fp8_moe"][key] = pick_sglang_config(sglang, h0, moe0.experts, r0)
                sglang.config = dict(info["sglang_fp8_moe"][key]["config"])
            if c == min(levels, key=lambda v: abs(v - 8)) and f"{w}/{kv}" not in info["checks"]:
                info["checks"][f"{w}/{kv}"] = check_layer(step, x_in, d_in, c)
            # at every level what a layer launches and each launch's GPU time, to hold against
            # the graph's layer time (its gaps) and the components timed alone
            lk = info.setdefault("layer_kernels", {})[f"{w}/{kv}@{c}"] = layer_kernels(
                step, x_in, d_in)  # fmt: skip
            print(f"[{name}] {config_label(w, kv):18s} c={c:4d} one MoE layer: "
                  f"{lk['launches']} launches, {lk['gpu_us']} us of GPU time", flush=True)
            g_layers = capture(lambda step=step, x_in=x_in, d_in=d_in: step.layers(x_in, d_in))
            g_serial = None
            if args.streams == "both":  # the same layers on one stream, timed beside them
                step.side = None
                g_serial = capture(lambda step=step, x_in=x_in, d_in=d_in: step.layers(x_in, d_in))
                step.side = side
            g_off = capture(lambda step=step: step.rest(False))
            g_on = capture(lambda step=step: step.rest(True))
            samples = time_points(g_off, g_on, g_layers, args.replays, g_serial)
            del g_layers, g_serial, g_off, g_on
            bad = int(batch.integrity.step().sum().item())
            if bad:  # nothing here rewrites a page, so a flagged one is a defect of the check
                raise SystemExit(f"{name} {w}/{kv} at {c}: the integrity check flagged {bad} pages")
            parts, beside = component_ms(step, max(5, args.replays // 3))
            row = _row(name, w, kv, c, plan, admitted=True)
            row.update(summarize(samples, c, args.slice_layers, shape.moe_layers))
            parts["rest_of_layer"] = row["moe_layer_ms"] - sum(parts.values())
            expert_bytes = weights[w].moe[0][1].experts.nbytes / shape.local_experts
            distinct = sum(r.distinct_experts for r in routing[c]) / len(routing[c])
            row["components_ms_per_moe_layer"] = parts
            if beside:  # timed with the components, not part of the layer
                row["beside_components_ms_per_moe_layer"] = beside
            row["routed_expert_bytes_per_layer"] = distinct * expert_bytes
            row["routed_experts_TBps"] = distinct * expert_bytes / parts["routed_experts"] / 1e9
            row.update({
                "integrity_bad_pages": bad,
                "critical_gpu_distinct_experts": [r.distinct_experts for r in routing[c]],
                "mean_gpu_distinct_experts": round(
                    sum(r.mean_distinct_experts for r in routing[c]) / len(routing[c]), 2),
                "critical_gpu_pairs": [int(r.tokens.numel()) for r in routing[c]],
                "seconds": round(time.time() - t1, 1),
            })  # fmt: skip
            rows.append(row)
            save(rows, info)
            print(f"[{name}] {config_label(w, kv):18s} c={c:4d} step {row['step_ms']:8.3f} ms "
                  f"({row['tok_s']:8.0f} tok/s)  integrity +{row['integrity_step_pct']:.2f}% "
                  f"p95 {row['p95_ms']:.3f}/{row['p95_ms_integrity']:.3f} ms  "
                  f"bad pages {bad}  [{row['seconds']} s]", flush=True)  # fmt: skip
            if beside:
                print(f"[{name}] {'':18s} c={c:4d} experts a layer: Marlin's MoE "
                      f"{parts['routed_experts'] * 1e3:.1f} us, ours beside it "
                      f"{beside['routed_experts_ours'] * 1e3:.1f} us", flush=True)  # fmt: skip
            del step, batch
        del dense_caches, moe_caches
        torch.cuda.empty_cache()
    info["seconds"] = round(time.time() - t0, 1)
    info["int4_tuned_picks"] = tuned_picks()  # --tuned-from repeats them
    return rows, info


def layer_kernels(step: SliceStep, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Any]:
    """The GPU work of one MoE layer, in launch order, from torch's profiler (run eagerly after
    warm-up): how many kernels, memsets and copies a layer launches and each one's GPU time
    (the graphs replay the same launches; their gaps are not in these times)."""
    from torch.profiler import ProfilerActivity, profile

    step.moe_layer(0, x, delta)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.moe_layer(0, x, delta)
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu.sort(key=lambda e: e.time_range.start)
    launches = [[e.name[:90], round(e.device_time, 2)] for e in gpu]
    return {"launches": len(launches), "gpu_us": round(sum(t for _, t in launches), 1),
            "in_order": launches}  # fmt: skip


def check_layer(step: SliceStep, x: torch.Tensor, delta: torch.Tensor, c: int) -> dict[str, Any]:
    """One MoE layer by the kernels and by the reference, same inputs (on the GPU): the
    layer's output (what it adds to the residual stream), and the router's logits and
    selection (which the drawn routing replaces in the layer; the selection is compared on
    the reference's logits, so that near ties are the same on both sides)."""
    out = step.moe_layer(0, x, delta)[1]
    kernels_ops = step.ops
    ref_ops = ReferenceOps(kernels_ops.sglang, deepgemm=kernels_ops.deepgemm)
    step.ops = ref_ops
    ref = step.moe_layer(0, x, delta)[1]
    step.ops = kernels_ops
    moe = step.w.moe[0][1]
    logits = ref_ops.router_logits(x, moe.router)
    weights, ids = kernels_ops.select_experts(logits, moe.router_bias, step.s.top_k)
    ref_weights, ref_ids = ref_ops.select_experts(logits, moe.router_bias, step.s.top_k)
    return {"concurrency": c, "moe_layer_rel_l2": rel_l2(out, ref),
            "router_logits_rel_l2": rel_l2(kernels_ops.router_logits(x, moe.router), logits),
            "router_ids_equal": bool(torch.equal(ids, ref_ids)),
            "router_weights_max_abs_diff": float((weights - ref_weights).abs().max())}  # fmt: skip


def time_points(g_off, g_on, g_layers, replays: int, g_serial=None) -> dict[str, list[float]]:
    """Interleaved replays: the two once-per-step graphs (alternating first), the layers, and
    with ``g_serial`` the same layers on one stream."""
    layers = [("layers", g_layers)]
    if g_serial is not None:
        layers.append(("layers_one_stream", g_serial))
    for g in (g_off, g_on, *(g for _, g in layers)):
        replay_seconds(g)
    out: dict[str, list[float]] = {"rest_off": [], "rest_on": [], **{k: [] for k, _ in layers}}
    for i in range(replays):
        pair = (("rest_off", g_off), ("rest_on", g_on))
        for key, g in pair if i % 2 == 0 else pair[::-1]:
            out[key].append(replay_seconds(g))
        for key, g in layers if i % 2 == 0 else layers[::-1]:
            out[key].append(replay_seconds(g))
    return out


def summarize(t: dict[str, list[float]], c: int, slice_layers: int, moe_layers: int) -> dict:
    off = step_samples(t["rest_off"], t["layers"], slice_layers, moe_layers)
    on = step_samples(t["rest_on"], t["layers"], slice_layers, moe_layers)
    step_off, step_on = median(off), median(on)
    ms = 1e3
    return {
        "rest_ms": median(t["rest_off"]) * ms, "rest_ms_integrity": median(t["rest_on"]) * ms,
        "slice_layers_ms": median(t["layers"]) * ms,
        "moe_layer_ms": median(t["layers"]) * ms / slice_layers,
        "step_ms": step_off * ms, "step_ms_integrity": step_on * ms,
        "p95_ms": percentile(off, 95) * ms, "p95_ms_integrity": percentile(on, 95) * ms,
        "tok_s": c / step_off, "tok_s_integrity": c / step_on,
        "integrity_step_pct": (step_on / step_off - 1) * 100,
        "replays": len(off),
    } | (_one_stream(t, slice_layers, moe_layers) if "layers_one_stream" in t else {})  # fmt: skip


def _one_stream(t: dict[str, list[float]], slice_layers: int, moe_layers: int) -> dict:
    """With ``--streams both``: the layers on one stream, and the step they give."""
    serial = step_samples(t["rest_off"], t["layers_one_stream"], slice_layers, moe_layers)
    return {"moe_layer_ms_one_stream": median(t["layers_one_stream"]) * 1e3 / slice_layers,
            "step_ms_one_stream": median(serial) * 1e3}  # fmt: skip


def _row(model: str, w: str, kv: str, c: int, plan, admitted: bool) -> dict[str, Any]:
    lengths = context_lengths(c)
    return {
        "model": model, "weights": w, "kv": kv, "concurrency": c, "admitted": admitted,
        "status": "ok" if admitted else "out of memory",
        "pool_tokens": plan.tokens, "pool_pages": plan.pages,
        "pages_needed": sum(pages_for(n) for n in lengths), "context_tokens": sum(lengths),
    }  # fmt: skip


# ---------------------------------------------------------------------------- report


def pool_admits(doc: dict, model: str, weights: str) -> dict[str, int]:
    """The most requests of the mix each KV pool of ``model`` with ``weights`` admits."""
    pools = doc["models"][model]["pools"]
    return {kv: most_admitted(pools[f"{weights}/{kv}"]["pages"]) for kv in KV_DTYPES}


def comparisons(doc: dict) -> dict:
    """The run's comparisons per model (stored in the results as "summary")."""
    rows = doc["rows"]
    return {
        m: {
            "kv": {w: kv_comparison(rows, m, w, pool_admits(doc, m, w)) for w in WEIGHT_DTYPES},
            "int4_vs_fp8": {kv: weights_comparison(rows, m, kv) for kv in KV_DTYPES},
            "integrity": integrity_cost([r for r in rows if r["model"] == m]),
        }
        for m in doc["models"]
    }


def summary_lines(doc: dict, levels: list[int]) -> list[str]:
    rows, lines = doc["rows"], []
    for m in doc["models"]:
        lines.append(f"\n{m}: decode tok/s per replica (8 GPUs), integrity off")
        lines += throughput_table(rows, m, levels)
        lines.append(f"{m}: per-request step time (ms), integrity off")
        lines += throughput_table(rows, m, levels, "step_ms", "{:.2f}")
        lines.append(f"{m}: integrity on vs off, median step (%) / p95 step (ms, on)")
        marked = [
            {**r, "cell": f"{r['integrity_step_pct']:+.2f}% / {r['p95_ms_integrity']:.2f}"}
            if r["admitted"] else r
            for r in rows
        ]  # fmt: skip
        lines += throughput_table(marked, m, levels, "cell", "{}")
        for w in WEIGHT_DTYPES:
            k = kv_comparison(rows, m, w, pool_admits(doc, m, w))
            if k:
                per_request = k["per_request_slowdown"].items()
                slow = ", ".join(f"{c}: {v * 100:+.1f}%" for c, v in per_request)
                peaks = (
                    f"{k['peak_fp8']['tok_s']:,.0f} @{k['peak_fp8']['concurrency']} vs "
                    f"{k['peak_bf16']['tok_s']:,.0f} @{k['peak_bf16']['concurrency']}"
                )
                verdict = "" if k["peak_established"] else " (a limit was not timed: not a peak)"
                lines.append(
                    f"  {w} weights, FP8 vs BF16 KV: admits {k['most_admitted_fp8']} vs "
                    f"{k['most_admitted_bf16']} ({k['admitted_ratio']:.2f}x), best timed tok/s "
                    f"{peaks} ({k['peak_gain'] * 100:+.1f}%){verdict}; per-request step time {slow}"
                )  # fmt: skip
        for kv in KV_DTYPES:
            gains = weights_comparison(rows, m, kv)
            if gains:
                text = ", ".join(f"{c}: {g * 100:+.1f}%" for c, g in gains.items())
                lines.append(f"  INT4 vs FP8 weights, {kv} KV: {text}")
        cost = integrity_cost([r for r in rows if r["model"] == m])
        if cost:
            lines.append(
                f"  integrity on: throughput -{cost['max_throughput_loss'] * 100:.2f}% worst "
                f"(median -{cost['median_throughput_loss'] * 100:.2f}%), p95 step "
                f"{cost['max_p95_increase'] * 100:+.2f}% worst"
            )  # fmt: skip
    return lines


def meta(argv: list[str], args: argparse.Namespace, sglang_src: Path) -> dict[str, Any]:
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
        except OSError:
            return ""

    try:
        sglang_version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        sglang_version = args.sglang_version
    return {
        "device": torch.cuda.get_device_name(),
        "driver": run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__,
        "sglang_kernels": f"sglang {sglang_version}: {sglang_src.name}, fp8_kernel.py",
        "commit": args.commit or run("git", "rev-parse", "HEAD"),
        "attention": "FlashMLA (sgl-flash-mla 1.0.0, legacy SM90 dense)"
        if args.attention == "flashmla" else "ours (paged_decode_mla_bf16 / _fp8)",
        "int4_linears": "Marlin (SGLang 0.5.23's gptq_marlin_gemm)"
        if args.int4_linears == "marlin"
        else "ours (w4a16_matmul" + (", no Gluon tiles)" if args.no_wgmma else ")"),
        "int4_experts": "Marlin (SGLang 0.5.23's moe_wna16_marlin_gemm; alignment, SiLU-and-mul "
                        "and top-k sum by our Triton launches)"
        if args.int4_experts == "marlin" else "ours (fused_moe)",
        "fp8_linears": f"DeepGEMM {args.deepgemm.dg.__version__} (fp8_gemm_nt, 128 x 128 weight "
                       "blocks; activations by SGLang's Triton group-128 quantizer, column-major "
                       "scales)"
        if args.deepgemm else "torch._scaled_mm (row scales; activations by "
                                               "SGLang's Triton per-token quantizer)",
        "router": "SGLang's Triton router (moe_fused_gate); logits by its tiny GEMM (JIT-built) up "
                  f"to {TINY_GEMM_MAX_M} rows for {sorted(args.tiny_gemms)} ([N, K]), else "
                  "cuBLAS bf16 -> fp32",
        "streams": {
            "two": "two, as SGLang's CUDA-graph decode: the kv_a norm, GLM's q_b projection and "
                   "the shared expert on a second stream",
            "one": "one (every launch in order on one stream)",
            "both": "two, as SGLang's CUDA-graph decode, and the same layers on one stream timed "
                    "beside them (moe_layer_ms_one_stream, step_ms_one_stream)",
        }[args.streams],
        "int4_tuned_from": _portable(str(args.tuned_from)) if args.tuned_from else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/decode_slice.py", *map(_portable, argv[1:])]),
        "layout": "decode replica of 8 H200: attention TP 8 (8 of 64 heads per GPU, the MLA "
                  "latent cache of every request on every GPU), MoE EP 8 (1/8 of the routed "
                  "experts per GPU, shared expert and dense MLP split 8 ways)",
        "scaling": "step = rest + layers x moe_layers / slice_layers, where rest is one replay "
                   "of the once-per-step graph (integrity check when on, embedding, the dense "
                   "layers, final norm, lm_head, argmax) and layers one replay of slice_layers "
                   "distinct MoE layers (attention + MoE); samples pair the i-th replays; "
                   "tok/s = concurrency / median step (per replica of 8 GPUs)",
        "not_modelled": "all-reduce/all-to-all between GPUs, rotary embedding, DSA indexer "
                        "scoring and sparse selection (GLM: dense MLA over all tokens)",
        "routing": "uniform random top-k per token; per layer the slice computes the pairs of "
                   "the GPU with the most distinct experts (the one the layer waits for)",
        "context_mix": list(CONTEXT_MIX), "page_size": PAGE_SIZE,
        "quantized_modules": list(QUANTIZED_MODULES),
        "slice_layers": args.slice_layers, "replays": args.replays,
        "sglang_fp8_configs": list(SGLANG_FP8_CONFIGS),
    }  # fmt: skip


def _portable(arg: str) -> str:
    """A command-line argument without this machine's paths: repository paths relative, any
    other absolute path as OUT."""
    path = Path(arg)
    if not path.is_absolute():
        return arg
    try:
        return str(path.relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return "OUT"


def plot(results: Path, img_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(results.read_text())
    rows, models = doc["rows"], list(doc["models"])
    img_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for m in models:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for w, kv in CONFIGS:
            mine = [r for r in rows if (r["model"], r["weights"], r["kv"]) == (m, w, kv)]
            pts = sorted((r["concurrency"], r["tok_s"]) for r in mine if r["admitted"])
            oom = [r["concurrency"] for r in mine if not r["admitted"]]
            if pts:
                line = ax.plot(*zip(*pts, strict=True), marker="o", label=config_label(w, kv))[0]
                for c in oom:
                    ax.annotate("OOM", (c, pts[-1][1]), color=line.get_color(), fontsize=7,
                                ha="center")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("decode tok/s per replica (8 GPUs)")
        ax.set_title(f"{m} decode slice on one H200 (scaled to the full model)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = img_dir / f"decode-slice-{m}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for m in models:
        for w, kv in CONFIGS:
            mine = [r for r in rows if (r["model"], r["weights"], r["kv"]) == (m, w, kv)]
            pts = sorted((r["concurrency"], r["integrity_step_pct"]) for r in mine if r["admitted"])
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".", label=f"{m} {config_label(w, kv)}")
    ax.axhline(0.5, color="red", linestyle="--", linewidth=1, label="target 0.5%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("median step time, on vs off (%)")
    ax.set_title("integrity check cost per decode step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    path = img_dir / "decode-slice-integrity.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [*written, path]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--slice-layers", type=int, default=8, help="distinct MoE layers timed")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--exact-max-cap", type=int, default=256,
                    help="also time each configuration at its exact most admitted concurrency "
                         "when off the grid and at most this (0: grid only)")  # fmt: skip
    ap.add_argument("--sglang-src", type=Path, help="folder with SGLang's kernel source files")
    ap.add_argument("--sglang-version", default="0.5.23")
    ap.add_argument("--commit", default="", help="recorded when git is not available")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--attention",
        choices=("ours", "flashmla"),
        default="ours",
        help="decode attention: our paged kernels or FlashMLA (sgl-flash-mla)",
    )
    ap.add_argument("--int4-linears", choices=("ours", "marlin"), default="ours",
                    help="INT4 dense linears: our GEMM or SGLang's Marlin")
    ap.add_argument("--no-wgmma", action="store_true",
                    help="our INT4 GEMM without its Gluon warpgroup-MMA tiles (the tuner picks "
                         "among the Triton ones), to time what that kernel gives the step")
    ap.add_argument("--int4-experts", choices=("ours", "marlin"), default="ours",
                    help="INT4 routed experts: our fused MoE or SGLang's Marlin MoE")
    ap.add_argument("--fp8-linears", choices=("auto", "scaled-mm", "deepgemm"), default="auto",
                    help="FP8 dense linears: torch._scaled_mm with row scales, or DeepGEMM with "
                         "block scales as SGLang runs them on Hopper (deepgemm.py); auto: "
                         "DeepGEMM where it imports, as SGLang chooses")  # fmt: skip
    ap.add_argument("--sglang-jit-dir", type=Path,
                    help="folder of SGLang's JIT kernels built by bench/sglang_jit_build.py: "
                         "Marlin's (for --int4-* marlin) and the router GEMM's")  # fmt: skip
    ap.add_argument("--configs", default=",".join(f"{w}/{kv}" for w, kv in CONFIGS),
                    help="the weights/KV configurations to time, e.g. fp8/fp8_e4m3,int4/fp8_e4m3 "
                         "(INT4 vs FP8 weights alone)")  # fmt: skip
    ap.add_argument("--streams", choices=("two", "one", "both"), default="two",
                    help="two: the kv_a norm, GLM's q_b projection and the shared expert on a "
                         "second stream, as SGLang's CUDA-graph decode runs them; one: every "
                         "launch on one stream (the runs before this option); both: two, and "
                         "the layers on one stream timed beside them")  # fmt: skip
    ap.add_argument("--tuned-from", type=Path,
                    help="an earlier results JSON whose INT4 tuned picks this run repeats "
                         "(A/Bs across machine starts then compare the change, not tuner noise)")
    ap.add_argument("--plot", type=Path, help="draw the PNGs from a results JSON and exit")
    ap.add_argument("--summarize", type=Path, help="recompute a results JSON's comparisons")
    ap.add_argument("--img-dir", type=Path, default=Path("docs/img"))
    args = ap.parse_args()
    args.configs = args.configs.split(",")
    unknown = set(args.configs) - {f"{w}/{kv}" for w, kv in CONFIGS}
    if unknown:
        raise SystemExit(f"unknown --configs {sorted(unknown)}: each is fp8|int4/bf16|fp8_e4m3")
    if args.summarize:
        doc = json.loads(args.summarize.read_text())
        doc["summary"] = comparisons(doc)
        args.summarize.write_text(json.dumps(doc, indent=1))
        levels = sorted({r["concurrency"] for r in doc["rows"]})
        print("\n".join(summary_lines(doc, levels)))
        return
    if args.plot:
        for path in plot(args.plot, args.img_dir):
            print(f"wrote {path}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    models = args.models.split(",")
    sglang_src = find_sglang_source("fused_moe_triton_kernels.py", args.sglang_src)
    sglang = load_sglang_kernels(args.sglang_src)
    args.flashmla = importlib.import_module("flash_mla") if args.attention == "flashmla" else None
    # SGLang's own choice: DeepGEMM whenever it imports
    if args.fp8_linears == "auto":
        has_deepgemm = importlib.util.find_spec("deep_gemm") is not None
        args.fp8_linears = "deepgemm" if has_deepgemm else "scaled-mm"
    args.deepgemm = DeepGemm(args.sglang_src) if args.fp8_linears == "deepgemm" else None
    args.marlin = None
    if args.no_wgmma:
        w4a16_gemm._wgmma_tiles = lambda x, w: []  # what the tuner is offered
    if "marlin" in (args.int4_linears, args.int4_experts):
        if args.sglang_jit_dir is None:
            raise SystemExit("Marlin needs --sglang-jit-dir (bench/sglang_jit_build.py's --out)")
        args.marlin = Marlin(args.sglang_jit_dir)
    args.tiny_gemms = load_tiny_gemms(args.sglang_jit_dir)
    if args.tuned_from:
        earlier = json.loads(args.tuned_from.read_text())["models"].values()
        loaded = load_tuned_picks([p for m in earlier for p in m.get("int4_tuned_picks", [])])
        print(f"repeating {loaded} INT4 tuned picks of {args.tuned_from}", flush=True)
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_slice{args.tag}.json"
    doc: dict[str, Any] = {**meta(sys.argv, args, sglang_src), "models": {}, "rows": []}
    t0 = time.time()
    done: list[dict] = []

    def save(rows: list[dict], info: dict) -> None:  # after every point: a cut-off run keeps them
        doc["rows"] = done + rows
        doc["models"][m] = info
        doc["seconds"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(doc, indent=1))

    for m in models:
        rows, info = bench_model(m, args, sglang, device, save)
        save(rows, info)
        done += rows
        torch.cuda.empty_cache()
    doc["summary"] = comparisons(doc)
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {path} in {doc['seconds']} s")
    print("\n".join(summary_lines(doc, args.concurrency)))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
