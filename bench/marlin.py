"""SGLang 0.5.23's Marlin kernels as a benchmark peer: dense ``gptq_marlin_gemm``, MoE
``moe_wna16_marlin_gemm`` and the weight repack ``gptq_marlin_repack``, built ahead of time by
bench/sglang_jit_build.py and called with the arguments SGLang's wrappers pass (those wrappers
need SGLang's runtime, which the GPU machine's torch cannot load).

Weights come from this project's INT4 format: its ``qweight`` ``[K / 8, N]`` is GPTQ's packed
layout (unsigned codes, bias 8), which Marlin's repack takes as it is, so the peer multiplies the
very weights our kernels do and its output is checked against the same reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
from sglang_glue import silu_and_mul
from tessera.kernels.w4a16_format import W4A16Weight
from tessera.kernels.w4a16_moe import _topk_sum, align_to_experts

# SGLang's id of Marlin's weight type uint4b8 (4-bit codes, bias 8: GPTQ's symmetric INT4): its
# ScalarType fields packed low to high, exponent (8 bits) 0, mantissa (8) 4, signed (1) 0,
# bias (32) 8, finite-only (1) 0, NaN representation (8) 1 (IEEE).
MARLIN_UINT4B8 = (4 << 8) | (8 << 17) | (1 << 50)

# Marlin reads group scales 64 columns at a time, each 8 x 8 block of them transposed.
SCALE_ORDER = torch.arange(64).view(8, 8).t().flatten()


def marlin_scales(scales: torch.Tensor) -> torch.Tensor:
    """Group scales ``[..., K / group, N]`` in Marlin's column order (group < K)."""
    return scales.reshape(-1, 64)[:, SCALE_ORDER.to(scales.device)].reshape(scales.shape)


def marlin_block(tokens: int, top_k: int, experts: int) -> int:
    """SGLang's block size for the Marlin MoE: the first of 8, 16, 32, 48, 64 that the
    average rows per expert fill less than 90%."""
    for block in (8, 16, 32, 48, 64):
        if tokens * top_k / experts / block < 0.9:
            return block
    return 64


class Marlin:
    """The loaded kernels; a weight is ``(codes, scales)`` in Marlin's layout (``from_ours``)."""

    def __init__(self, folder: Path):
        import tvm_ffi

        def load(unit: str, name: str):  # a unit may be built alone (--only)
            path = folder / f"marlin_{unit}.so"
            return getattr(tvm_ffi.load_module(str(path)), name) if path.exists() else None

        self.dense = load("dense", "gptq_marlin_gemm")
        self.moe = load("moe", "moe_wna16_marlin_gemm")
        self.repack = load("repack", "gptq_marlin_repack")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.workspaces: dict[int, torch.Tensor] = {}  # a lock array per stream (workspace())
        self.none_bf16 = torch.empty(0, dtype=torch.bfloat16, device="cuda")
        self.none_i32 = torch.empty(0, dtype=torch.int32, device="cuda")
        self.none_f32 = torch.empty(0, dtype=torch.float32, device="cuda")
        self.counts: dict[tuple, torch.Tensor] = {}  # the padded row count a size (align)

    def workspace(self) -> torch.Tensor:
        """Marlin's lock array, zero before and after each launch. SGLang gives every layer its
        own; the decode slice runs layers' kernels on two streams at once (SGLang's second
        stream), so here there is one per stream, made before any graph is captured on it."""
        stream = torch.cuda.current_stream().cuda_stream
        if stream not in self.workspaces:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"no Marlin workspace for stream {stream:#x}, which is capturing a CUDA "
                    "graph: run once on it before capturing"
                )
            self.workspaces[stream] = torch.zeros(self.sms * 4, dtype=torch.int32, device="cuda")
        return self.workspaces[stream]

    def from_ours(self, w: W4A16Weight) -> tuple[torch.Tensor, torch.Tensor]:
        """Our symmetric INT4 weight (dense ``[K / 8, N]`` or experts ``[E, K / 8, N]``) in
        Marlin's layout: codes ``[..., K / 16, 2 N]`` int32, scales permuted."""
        if not w.symmetric:
            raise ValueError("the Marlin peer takes symmetric weights (uint4b8)")
        if self.repack is None:
            raise RuntimeError("marlin_repack.so was not built (bench/sglang_jit_build.py)")
        q = w.qweight.reshape(-1, *w.qweight.shape[-2:])
        k, n = w.k, w.n
        codes = torch.empty(q.shape[0], k // 16, 2 * n, dtype=torch.int32, device=q.device)
        for e in range(q.shape[0]):
            self.repack(q[e].contiguous(), self.none_i32, codes[e], k, n, 4)
        return codes.reshape(*w.qweight.shape[:-2], k // 16, 2 * n), marlin_scales(w.scales)

    def gemm(self, x, codes, scales, out):
        """SGLang's ``apply_gptq_marlin_linear``: fp32 reduce, atomic adds only for n < 2048
        and k >= 2048."""
        m, k = x.shape
        n = scales.shape[-1]
        atomic = n < 2048 and k >= 2048
        c_tmp = self.none_f32
        if not atomic:
            c_tmp = torch.empty(self.sms * min(triton.cdiv(m, 16) * 16, 64) * 256,
                                dtype=torch.float32, device="cuda")  # fmt: skip
        self.dense(x, codes, scales, self.none_bf16, self.none_i32, self.none_i32,
                   self.none_i32, out, c_tmp, self.none_bf16, self.workspace(), MARLIN_UINT4B8,
                   True, atomic, True, False)  # fmt: skip
        return out

    def align(self, ids: torch.Tensor, experts: int, block: int):
        """The routing as Marlin reads it: our alignment (sorted pair ids padded per expert to
        whole blocks, padding rows = the pair count, as SGLang's ``moe_align_block_size``),
        each block's expert (-1 past the used blocks: Marlin skips them), and the padded row
        count, here the whole allocation. That size depends only on the shapes, so the count is
        made once a size (at the warm-up before a graph is captured), not filled at every call:
        SGLang's one alignment launch writes it with the rest."""
        pair_ids, block_expert = align_to_experts(ids, experts, block)
        key = (pair_ids.numel(), ids.device)
        if key not in self.counts:
            self.counts[key] = torch.full((1,), key[0], dtype=torch.int32, device=ids.device)
        return pair_ids, block_expert, self.counts[key]

    def moe_gemm(self, x, out, codes, scales, routing, block, top_k, mul_weights, group):
        sorted_ids, block_experts, count, weights = routing
        m, k = x.shape
        n = scales.shape[-1]
        self.moe(x, out, codes, self.none_bf16, scales, self.none_bf16, self.none_bf16,
                 self.none_i32, self.none_i32, self.workspace(), sorted_ids, block_experts, count,
                 weights, self.none_bf16, self.none_f32, block, top_k, mul_weights, False,
                 MARLIN_UINT4B8, m, n, k, False, False, True, False, k // group, group, True,
                 True, False)  # fmt: skip
        return out

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, group):
        """SGLang's ``fused_marlin_moe``: alignment, up GEMM, SiLU-and-mul, down GEMM with the
        routing weights, sum over the top k. The alignment is our kernel (one launch, as
        SGLang's) and the two small steps Triton stand-ins, one launch each (``sglang_glue``)."""
        tokens, hidden = x.shape
        top_k = topk_ids.shape[1]
        experts = w13[0].shape[0]
        inter = w2[1].shape[-2] * group
        block = marlin_block(tokens, top_k, experts)
        routing = (*self.align(topk_ids, experts, block), topk_weights.float().reshape(-1))
        h13 = torch.empty(tokens * top_k, 2 * inter, dtype=torch.bfloat16, device=x.device)
        self.moe_gemm(x, h13, *w13, routing, block, top_k, False, group)
        act = silu_and_mul(h13)
        down = torch.empty(tokens * top_k, hidden, dtype=torch.bfloat16, device=x.device)
        self.moe_gemm(act, down, *w2, routing, block, 1, True, group)
        return _topk_sum(down, tokens, top_k)


