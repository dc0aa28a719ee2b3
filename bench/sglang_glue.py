"""Stand-ins for the small fused ops SGLang's decode step runs between its GEMMs.

On CUDA, SGLang's ``RMSNorm`` calls sgl-kernel's ``rmsnorm`` and, with a residual,
``fused_add_rmsnorm`` (residual += x, then the norm of the sum: one launch), and its MLPs call
``silu_and_mul`` (one launch). sgl-kernel's compiled ops do not load on the H200 machine's torch
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

__all__ = ["add_rms_norm", "add_rms_norm_ref", "silu_and_mul", "silu_and_mul_ref"]


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
