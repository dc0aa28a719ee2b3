"""Fused MoE over INT4 (W4A16) experts, in Triton, with a bf16-expert twin for comparison.

``y[t] = sum_j topk_weight[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
``e = topk_ids[t, j]``. The (token, expert) pairs are sorted by expert into blocks of ``BLOCK_M``
rows (:func:`align_to_experts`); each program multiplies one block by one N tile of its expert's
weight, so each expert weight tile is read once per block however many tokens chose it. At decode
sizes (a few tokens, top-8) almost every block holds one pair and the time is the bytes of the
experts touched, which is why INT4 pays.

Weights are K-major (``[E, K, N]`` as in :mod:`tessera.kernels.w4a16_format`): ``w13`` maps hidden
``H`` to ``2 I`` (gate columns first, then up), ``w2`` maps ``I`` to ``H``. The same kernel runs
bf16 experts (plain ``[E, K, N]`` tensors) with only the weight decode changed, for benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .w4a16_format import W4A16Weight, dequantize
from .w4a16_gemm import _planes, _w4a16_accumulate, interpreted, tune_cached

__all__ = ["MoeConfig", "align_to_experts", "fused_moe", "fused_moe_reference", "moe_gemm"]


@triton.jit
def _bf16_accumulate(
    acc, x_rows, m_mask, w_ptr, offs_n, n_mask, K, stride_wk, step_begin, step_end,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The bf16 twin of ``_w4a16_accumulate``: same K steps, same activation tile split into the
    same eight strided planes, same dots."""
    R: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, R)
    for step in range(step_begin, step_end):
        k_rows = step * BLOCK_K + offs_r * 8
        x_ptrs = x_rows[:, :, None] + k_rows[None, :, None] + tl.arange(0, 8)[None, None, :]
        x_mask = m_mask[:, None, None] & (k_rows < K)[None, :, None]
        xs = _planes(tl.load(x_ptrs, mask=x_mask, other=0.0))
        for i in tl.static_range(8):
            k_mask = (k_rows + i) < K
            w = tl.load(
                w_ptr + (k_rows + i)[:, None] * stride_wk + offs_n[None, :],
                mask=k_mask[:, None] & n_mask[None, :], other=0.0,
            )  # fmt: skip
            acc = tl.dot(xs[i], w, acc)
    return acc


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, routing_ptr,
    N, K, num_pairs, rows_per_x,
    stride_xm, stride_we, stride_wk, stride_se, stride_sk, stride_om,
    INT4: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, MUL_ROUTING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FAST: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """out[pair] = x[pair // rows_per_x] @ W_e (x routing weight) for one expert block x N tile."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    block = pid // num_n
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # a block past the last used one
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    x_rows = x_ptr + (pairs // rows_per_x).to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    if INT4:
        acc = _w4a16_accumulate(
            acc, x_rows, m_mask, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
            z_ptr + expert * stride_se, offs_n, n_mask, K, stride_wk, stride_sk, 0, steps,
            GROUP, HAS_ZEROS, BLOCK_K, FAST, EVEN_K, EVEN_N,
        )  # fmt: skip
    else:
        acc = _bf16_accumulate(
            acc, x_rows, m_mask, w_ptr + expert * stride_we, offs_n, n_mask, K, stride_wk,
            0, steps, BLOCK_K,
        )  # fmt: skip
    if MUL_ROUTING:
        acc *= tl.load(routing_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    fast_decode: bool = True  # packed-bf16x2 PTX decode on the GPU (False: plain Triton)


def align_to_experts(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert into blocks of ``block_m`` rows.

    Returns ``pair_ids`` (``[blocks * block_m]``; pair ``p = token * top_k + slot``, padding rows
    hold ``num_pairs``) and ``block_expert`` (``[blocks]``; ``-1`` past the last used block).
    Sizes depend only on the shapes, never on the routing, so no host sync is needed and the call
    can be captured in a CUDA graph.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    blocks = num_pairs // block_m + min(num_experts, num_pairs)  # bound on used blocks
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync with the host
    expert_blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(expert_blocks, 0)
    start = (block_end - expert_blocks) * block_m  # first padded row of each expert
    first = torch.cumsum(counts, 0) - counts  # first sorted pair of each expert
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    dest = (
        start[sorted_experts] + torch.arange(num_pairs, device=flat.device) - first[sorted_experts]
    )
    pair_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    pair_ids[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(
        block_end, torch.arange(blocks, device=flat.device), right=True
    )
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_ids, block_expert


def _weight_args(w: W4A16Weight | torch.Tensor) -> tuple:
    """(weight, scales, zeros, strides, INT4, GROUP, HAS_ZEROS, N, K) for the kernel."""
    if isinstance(w, W4A16Weight):
        z = w.zeros if w.zeros is not None else w.scales  # unused pointer when symmetric
        strides = (w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1))
        return (w.qweight, w.scales, z, strides, True, w.group_size, w.zeros is not None, w.n, w.k)
    if w.dtype != torch.bfloat16 or w.dim() != 3 or w.stride(2) != 1:
        raise ValueError(f"bf16 experts must be a contiguous [E, K, N] tensor, got {w.dtype}")
    strides = (w.stride(0), w.stride(1), 0, 0)
    return (w, w, w, strides, False, 128, False, w.shape[2], w.shape[1])


def moe_gemm(
    x: torch.Tensor,
    w: W4A16Weight | torch.Tensor,
    pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    rows_per_x: int,
    config: MoeConfig,
    routing: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[p] = x[p // rows_per_x] @ W_{expert(p)}`` for every pair ``p`` -> ``[num_pairs, N]``
    bf16, times ``routing[p]`` when given."""
    weight, scales, zeros, (swe, swk, sse, ssk), int4, group, has_zeros, n, k = _weight_args(w)
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 [rows, {k}] with unit last stride, got {tuple(x.shape)}")
    out = torch.empty((num_pairs, n), dtype=torch.bfloat16, device=x.device)
    grid = (block_expert.numel() * triton.cdiv(n, config.block_n),)
    _moe_gemm_kernel[grid](
        x, weight, scales, zeros, out, pair_ids, block_expert,
        routing if routing is not None else x,
        n, k, num_pairs, rows_per_x,
        x.stride(0), swe, swk, sse, ssk, out.stride(0),
        INT4=int4, GROUP=group, HAS_ZEROS=has_zeros, MUL_ROUTING=routing is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        FAST=config.fast_decode and not interpreted(),
        EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def _candidates(num_pairs: int, num_experts: int) -> list[MoeConfig]:
    """Blocks of 16 rows at decode sizes (about one pair per expert), of 64 beyond."""
    if num_pairs > 4 * num_experts:
        return [MoeConfig(64, bn, 128, 8, 3) for bn in (64, 128)]
    return [MoeConfig(16, bn, 128, 4, 4) for bn in (64, 128, 256)]


def _num_experts(w: W4A16Weight | torch.Tensor) -> int:
    return (w.qweight if isinstance(w, W4A16Weight) else w).shape[0]


def fused_moe(
    x: torch.Tensor,
    w13: W4A16Weight | torch.Tensor,
    w2: W4A16Weight | torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[MoeConfig, MoeConfig] | None = None,
) -> torch.Tensor:
    """SwiGLU MoE over ``x [T, H]`` bf16 -> ``[T, H]`` bf16 (INT4 or bf16 experts).

    Without ``configs`` the tiles of both GEMMs are tuned once per (token count, shapes) on the
    GPU; run each batch size once before capturing CUDA graphs.
    """
    num_experts = _num_experts(w13)
    tokens, top_k = topk_ids.shape
    if topk_weights.shape != topk_ids.shape or x.shape[0] != tokens:
        raise ValueError(
            f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must agree on the token count and top-k"
        )
    if _num_experts(w2) != num_experts:
        raise ValueError("w13 and w2 must hold the same number of experts")
    num_pairs = tokens * top_k
    routing = topk_weights.reshape(-1).float()

    def run(cfgs: tuple[MoeConfig, MoeConfig]) -> torch.Tensor:
        up_cfg, down_cfg = cfgs
        pair_ids, block_expert = align_to_experts(topk_ids, num_experts, up_cfg.block_m)
        h = moe_gemm(x, w13, pair_ids, block_expert, num_pairs, top_k, up_cfg)
        gate, up = h.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
        if down_cfg.block_m != up_cfg.block_m:
            pair_ids, block_expert = align_to_experts(topk_ids, num_experts, down_cfg.block_m)
        out = moe_gemm(act, w2, pair_ids, block_expert, num_pairs, 1, down_cfg, routing)
        return out.view(tokens, top_k, -1).sum(1, dtype=torch.float32).to(torch.bfloat16)

    if configs is None:
        if interpreted():
            configs = (MoeConfig(block_n=32), MoeConfig(block_n=32))
        else:
            configs = _tune(x, w13, w2, num_pairs, num_experts, run)
    return run(configs)


def _tune(x, w13, w2, num_pairs, num_experts, run) -> tuple[MoeConfig, MoeConfig]:
    """Tune the up GEMM with a mid-size down tile, then the down GEMM with the chosen up tile."""
    kind = "int4" if isinstance(w13, W4A16Weight) else "bf16"
    shape = (x.shape[0], num_experts, tuple(x.shape[1:]), kind, torch.cuda.get_device_name())
    cands = _candidates(num_pairs, num_experts)
    mid = cands[len(cands) // 2]
    up = tune_cached(("moe_up", *shape), [(c, mid) for c in cands], run)[0]
    return tune_cached(("moe_down", *shape), [(up, c) for c in cands], run)


def fused_moe_reference(
    x: torch.Tensor,
    w13: W4A16Weight | torch.Tensor,
    w2: W4A16Weight | torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fp32 pure-torch MoE on the dequantized experts, rounding to bf16 where the kernel stores
    bf16 (the up output, the activation, each pair's down output); returns fp32 ``[T, H]``."""

    def dense(w: W4A16Weight | torch.Tensor) -> torch.Tensor:  # [E, K, N] fp32
        if isinstance(w, W4A16Weight):
            return dequantize(w, torch.float32).transpose(-1, -2)
        return w.float()

    a, b = dense(w13), dense(w2)
    xf = x.float()
    out = torch.zeros(x.shape[0], b.shape[-1], dtype=torch.float32, device=x.device)
    for slot in range(topk_ids.shape[1]):
        for e in topk_ids[:, slot].unique().tolist():
            rows = (topk_ids[:, slot] == e).nonzero().squeeze(1)
            gate, up = (xf[rows] @ a[e]).to(torch.bfloat16).float().chunk(2, dim=-1)
            act = (F.silu(gate) * up).to(torch.bfloat16).float()
            down = (topk_weights[rows, slot, None].float() * (act @ b[e])).to(torch.bfloat16)
            out[rows] += down.float()
    return out
