"""Stand-ins for the small fused ops SGLang's decode step runs between its GEMMs.

On CUDA, SGLang's ``RMSNorm`` calls sgl-kernel's ``rmsnorm`` and, with a residual,
``fused_add_rmsnorm`` (residual += x, then the norm of the sum: one launch), its MLPs call
``silu_and_mul`` (one launch), and its rotary embedding (DeepSeek's, interleaved pairs) calls
``apply_rope_with_cos_sin_cache_inplace`` on the query's and the key's rope parts (one launch,
in place). sgl-kernel's compiled ops do not load on the H200 machine's torch
(they use torch's C++ ABI), so the benchmarks run these Triton kernels in their place: the same
launches, the same bytes read and written, the same bf16 roundings. torch's own RMSNorm
(``F.rms_norm``) takes one program for a row, so at one token a 7,168-wide norm took 9-12 us on
the H200 (``bench/results/decode_slice_selfreset_ours_marlin.json``, ``layer_kernels``), several
times a dedicated kernel's.

Each function has a torch reference of the same maths (``*_ref``) for the benchmarks' checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tessera.kernels import w4a16_moe

__all__ = [
    "add_rms_norm",
    "add_rms_norm_ref",
    "rope_cache",
    "rope_inplace",
    "rope_inplace_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, res_ptr, out_ptr, n, stride_x, stride_d, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: ``res = x + delta`` stored in bf16 (``HAS_DELTA``), then
    ``out = res / rms(res) * w`` in fp32, stored in bf16."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + d).to(tl.bfloat16)
        tl.store(res_ptr + row * n + offs, s, mask=mask)
        x = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (x * inv * w).to(tl.bfloat16), mask=mask)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta) * weight)`` in one launch (sgl-kernel's
    ``fused_add_rmsnorm``); without ``delta``, ``(x, rms_norm(x) * weight)`` (its ``rmsnorm``).
    Rows of ``x`` and ``delta`` may be strided (a column slice); the results are contiguous."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=torch.bfloat16, device=x.device)
    res = torch.empty_like(out) if delta is not None else x
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x, delta if delta is not None else x, weight, res, out, n, x.stride(0),
        (delta if delta is not None else x).stride(0), eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(4, block // 512)),
    )  # fmt: skip
    return res, out


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    res = x if delta is None else (x.float() + delta.float()).to(torch.bfloat16)
    out = F.rms_norm(res.float(), (res.shape[-1],), weight.float(), eps)
    return res, out.to(torch.bfloat16)


@triton.jit
def _silu_mul_rows_kernel(src_ptr, out_ptr, half, stride_src, BLOCK: tl.constexpr):
    """out[p, :half] = silu(src[p, :half]) * src[p, half:]."""
    p = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < half
    gate = tl.load(src_ptr + p * stride_src + offs, mask=mask, other=0.0)
    up = tl.load(src_ptr + p * stride_src + half + offs, mask=mask, other=0.0)
    tl.store(out_ptr + p * half + offs, w4a16_moe._silu_mul_values(gate, up), mask=mask)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :half]) * h[:, half:]`` in bf16, one launch (sgl-kernel's ``silu_and_mul``)."""
    rows, half = h.shape[0], h.shape[1] // 2
    out = torch.empty((rows, half), dtype=torch.bfloat16, device=h.device)
    _silu_mul_rows_kernel[(rows, triton.cdiv(half, 1024))](
        h, out, half, h.stride(0), BLOCK=1024, num_warps=4
    )
    return out


def silu_and_mul_ref(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def rope_cache(positions: int, dim: int, device: torch.device, base: float = 10000.0):
    """fp32 ``[positions, dim]``: each position's cosines, then its sines, of ``dim / 2``
    frequencies (plain RoPE: the models' YaRN scaling changes the values, not the launch)."""
    inv_freq = base ** -(torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    angles = torch.arange(positions, dtype=torch.float32, device=device)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, heads, stride_qt, stride_qh, stride_kt,
                 HALF: tl.constexpr, HEADS: tl.constexpr):  # fmt: skip
    """One token: its query heads' and its key's rope parts, pairs ``(x[2i], x[2i+1])``
    rotated by the position's angle ``i``, in place."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cache_ptr + pos * 2 * HALF + i)[None, :]
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + i)[None, :]
    h = tl.arange(0, HEADS)[:, None]
    rows = tl.where(h < heads, q_ptr + t * stride_qt + h * stride_qh, k_ptr + t * stride_kt)
    mask = (h <= heads) & (i[None, :] < HALF)  # the heads, then the key as one more row
    even = tl.load(rows + 2 * i[None, :], mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(rows + 2 * i[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(rows + 2 * i[None, :], (even * cos - odd * sin).to(tl.bfloat16), mask=mask)
    tl.store(rows + 2 * i[None, :] + 1, (odd * cos + even * sin).to(tl.bfloat16), mask=mask)


def rope_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cache: torch.Tensor) -> None:  # fmt: skip
    """Rotate ``q [T, heads, dim]`` and ``k [T, dim]`` (bf16; views with unit last stride, as
    the query's and the latent's rope columns are) in place, one launch."""
    tokens, heads, dim = q.shape
    _rope_kernel[(tokens,)](
        q, k, positions, cache, heads, q.stride(0), q.stride(1), k.stride(0),
        HALF=dim // 2, HEADS=triton.next_power_of_2(heads + 1), num_warps=1,
    )  # fmt: skip


def rope_inplace_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cache: torch.Tensor) -> None:  # fmt: skip
    half = q.shape[-1] // 2
    cos, sin = cache[positions, :half], cache[positions, half:]
    for x, c, s in ((q, cos[:, None], sin[:, None]), (k, cos, sin)):
        even, odd = x[..., 0::2].float(), x[..., 1::2].float()
        x[..., 0::2] = (even * c - odd * s).bfloat16()
        x[..., 1::2] = (odd * c + even * s).bfloat16()
