"""Quantize-on-write: store new K/V tokens into the paged FP8 (e4m3) cache, with their scales.

For each stored row ``x`` (one token, one KV head) and its scale ``s``:
``cache = e4m3(clamp(x / s, -448, 448))``, rounded to nearest even.

- Per (token, head) scales (``scale`` is ``[num_slots, kv_heads]``): ``s = amax(|x|) / 448``
  over the finite elements of the row, computed here and stored beside the row (``s = 1`` for
  an all-zero row). What the runtime uses: an outlier token or head only coarsens itself.
- Per-tensor scale (``scale`` is 0-dim): ``s`` is given (calibrated, or SGLang's default 1.0).

Non-finite input: +-Inf saturates to +-448 (times the scale); NaN stays NaN (e4m3 has a NaN),
so a broken activation shows up downstream instead of being stored as a plausible value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_kv import E4M3_MAX, FP8_DTYPE, scale_rows, token_rows


@triton.jit
def _quantize_rows_kernel(
    src,
    src_index,
    dst,
    dst_index,
    scale,
    num_heads,
    stride_src_row,
    stride_src_head,
    stride_dst_row,
    stride_dst_head,
    stride_scale_row,
    stride_scale_head,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GATHER_SRC: tl.constexpr,
    PER_TOKEN_HEAD: tl.constexpr,
):
    """One token, BLOCK_H heads: dst[dst_index[i], h] = e4m3(clamp(src[row, h] / s[h]))."""
    i = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask_h = h < num_heads
    mask = mask_h[:, None] & (d < DIM)[None, :]
    if GATHER_SRC:
        src_row = tl.load(src_index + i).to(tl.int64)
    else:
        src_row = i.to(tl.int64)
    dst_row = tl.load(dst_index + i).to(tl.int64)

    x = tl.load(
        src + src_row * stride_src_row + h[:, None] * stride_src_head + d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    scale_ptr = scale + dst_row * stride_scale_row + h * stride_scale_head
    if PER_TOKEN_HEAD:
        ax = tl.abs(x)
        amax = tl.max(tl.where(ax <= 3.4e38, ax, 0.0), axis=1)  # NaN and Inf excluded
        s = tl.where(amax > 0.0, tl.fdiv(amax, 448.0, ieee_rounding=True), 1.0)
        tl.store(scale_ptr, s, mask=mask_h)
    else:
        s = tl.load(scale_ptr, mask=mask_h, other=1.0)
    # div_rn: IEEE division. fdiv(ieee_rounding=True) on the GPU image's Triton moved one e4m3
    # byte of 4M across a rounding tie (seen on the H200).
    y = tl.math.div_rn(x, s[:, None])
    tl.store(
        dst + dst_row * stride_dst_row + h[:, None] * stride_dst_head + d[None, :],
        _e4m3_bits(y),
        mask=mask,
    )


@triton.jit
def _e4m3_bits(y):
    """The e4m3 byte of float32 ``y``: saturated to +-448, rounded to nearest even, NaN kept.

    Done with integer arithmetic rather than a cast so that every backend (the GPU and the
    Triton interpreter, whose cast rounds differently) stores the same bytes.
    """
    sign = ((y.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.uint32, bitcast=True)
    # Normal range (a >= 2^-6): round the 23-bit mantissa to 3 bits, then rebias 127 -> 7.
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    normal = rounded - ((127 - 7) << 3)
    # Subnormal range: a + 2^14 has an ulp of 2^-9, the e4m3 subnormal step, so the float
    # addition itself rounds to nearest even; its low mantissa bits are the code (0..8).
    subnormal = (a + 16384.0).to(tl.uint32, bitcast=True) & 0x7FFFFF
    code = tl.where(a < 0.015625, subnormal, normal).to(tl.uint8)
    return tl.where(y != y, 0x7F, code) | sign


def quantize_rows(
    src: torch.Tensor,
    src_index: torch.Tensor | None,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Quantize ``src[src_index[i]]`` (or ``src[i]``) into ``dst[dst_index[i]]``.

    ``src``: ``[rows, heads, dim]`` in a float dtype; ``dst``: an FP8 cache (paged or flat);
    ``scale``: 0-dim (per tensor, read) or per (token, head) of ``dst`` (written).
    """
    dst_rows = token_rows(dst)
    if dst_rows.dtype != FP8_DTYPE:
        raise ValueError(f"the destination cache must be {FP8_DTYPE}, got {dst_rows.dtype}")
    if src.dim() != 3 or src.shape[1:] != dst_rows.shape[1:] or src.stride(-1) != 1:
        raise ValueError(
            f"source rows must be [rows, {dst_rows.shape[1]}, {dst_rows.shape[2]}] with a "
            f"contiguous last dim to match the cache, got shape {tuple(src.shape)}"
        )
    if not src.dtype.is_floating_point or src.dtype == FP8_DTYPE:
        raise ValueError(f"source rows must be bf16/fp16/fp32, got {src.dtype}")
    index = src_index if src_index is not None else dst_index
    if dst_index.dim() != 1 or index.numel() != dst_index.numel():
        raise ValueError(
            f"dst_index must be 1-D and as long as the rows stored ({index.numel()}), "
            f"got shape {tuple(dst_index.shape)}"
        )
    if src_index is None and dst_index.numel() != src.shape[0]:
        raise ValueError(f"{src.shape[0]} new rows but {dst_index.numel()} slots")
    rows = dst_index.numel()
    if rows == 0:
        return
    heads, dim = dst_rows.shape[1:]
    scales = scale_rows(scale, dst_rows)
    block_d = triton.next_power_of_2(dim)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
    _quantize_rows_kernel[(rows, triton.cdiv(heads, block_h))](
        src,
        src_index if src_index is not None else dst_index,
        dst_rows.view(torch.uint8),
        dst_index,
        scales,
        heads,
        src.stride(0),
        src.stride(1),
        dst_rows.stride(0),
        dst_rows.stride(1),
        scales.stride(0),
        scales.stride(1),
        DIM=dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        GATHER_SRC=src_index is not None,
        PER_TOKEN_HEAD=scale.dim() != 0,
        num_warps=4,
    )


def write_kv_fp8(
    new: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store ``new`` (``[tokens, kv_heads, dim]``) at cache ``slots``, quantized to e4m3."""
    quantize_rows(new, None, cache, slots, scale)


def quantize_ref(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for one batch of rows ``[rows, heads, dim]``: (e4m3 rows, scales used).

    ``scale`` None: per (token, head) scales are computed; else the given per-tensor scale.
    """
    x = x.float()
    if scale is None:
        ax = x.abs()
        amax = torch.where(ax.isfinite(), ax, 0.0).amax(dim=-1)
        s = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    else:
        s = scale.float().expand(x.shape[:2])
    y = (x / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)  # clamp keeps NaN
    return y.to(FP8_DTYPE), s


def write_kv_fp8_ref(
    new: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor
) -> None:
    """Pure-torch ``write_kv_fp8``."""
    rows = token_rows(cache)
    per_token_head = scale.dim() != 0
    q, s = quantize_ref(new, None if per_token_head else scale)
    rows[slots.long()] = q
    if per_token_head:
        scale_rows(scale, rows)[slots.long()] = s
