"""Convert MLA KV token rows between SGLang's page layouts, for the prefill -> decode handover.

A prefill pool and a decode pool of the same MLA model may store the same latent K in different
layouts. Each token row is ``nope`` latent values followed by ``rope`` values:

- ``bf16``: ``nope + rope`` bfloat16 values (2 bytes each).
- ``fp8_e4m3``: ``nope + rope`` e4m3 values, ``e4m3(x)`` with scale 1 (what SGLang's
  ``MLATokenToKVPool`` writes: a plain torch cast, which saturates at +-448; the scale is
  applied only when attention reads the cache).
- ``fp8_e4m3_dsa`` (FlashMLA's packed FP8 for DSA models, 656 bytes at 512 + 64):
  ``nope`` e4m3 values, one fp32 scale per 128 of them, then ``rope`` bfloat16 values.
  Per 128-value tile ``t``: ``s = amax(|t|) / 448``, ``q = e4m3(clamp(t * (1 / s), -448, 448))``
  (SGLang's ``quantize_k_cache_separate``). Reading back: ``bf16(q * s)``.

Conversions produce the bytes SGLang itself would have written into the destination pool:

- bf16 -> fp8_e4m3 gathers each value's e4m3 byte from a 65536-entry table that torch's own cast
  fills on the same device, so the bytes match SGLang's cast on every device by construction.
- fp8_e4m3 -> bf16 is exact (every e4m3 value is a bfloat16 value); a 256-entry table again.
- bf16 -> fp8_e4m3_dsa and back use the same float32 operations, in the same order, as
  SGLang's Triton quantize and dequantize kernels.
- Equal layouts are a byte copy.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
DSA_TILE = 128
LAYOUT_KINDS = ("bf16", "fp8_e4m3", "fp8_e4m3_dsa")


@dataclasses.dataclass(frozen=True)
class MLAKVLayout:
    """How one token of one layer's MLA KV is stored: ``kind`` over ``nope`` + ``rope`` values."""

    kind: str
    nope: int = 512
    rope: int = 64

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"unknown MLA KV layout {self.kind!r}; known: {LAYOUT_KINDS}")
        if self.kind == "fp8_e4m3_dsa" and self.nope % DSA_TILE:
            raise ValueError(f"the DSA FP8 layout needs nope % {DSA_TILE} == 0, got {self.nope}")

    @property
    def token_bytes(self) -> int:
        values = self.nope + self.rope
        if self.kind == "bf16":
            return 2 * values
        if self.kind == "fp8_e4m3":
            return values
        return self.nope + 4 * (self.nope // DSA_TILE) + 2 * self.rope

    def __str__(self) -> str:
        return f"{self.kind}[{self.nope}+{self.rope}] ({self.token_bytes} B/token)"


def convertible(src: MLAKVLayout, dst: MLAKVLayout) -> bool:
    """Whether ``convert_rows`` turns ``src`` rows into ``dst`` rows (same model dimensions)."""
    if (src.nope, src.rope) != (dst.nope, dst.rope):
        return False
    return src == dst or {src.kind, dst.kind} in ({"bf16", "fp8_e4m3"}, {"bf16", "fp8_e4m3_dsa"})


@cache
def _cast_table(kind: str, device: torch.device) -> torch.Tensor:
    """Every source bit pattern's destination bits, filled by torch's own cast on ``device``."""
    if kind == "bf16->fp8":
        bits = torch.arange(2**16, dtype=torch.int32, device=device).to(torch.int16)  # wraps
        return bits.view(torch.bfloat16).to(torch.float8_e4m3fn).view(torch.uint8)
    bits = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    return bits.view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.int16)


@triton.jit
def _table_cast_rows_kernel(
    src,
    dst,
    table,
    src_rows,
    dst_rows,
    stride_src,
    stride_dst,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    SRC_BITS_MASK: tl.constexpr,
):
    """dst[dst_rows[i], j] = table[src[src_rows[i], j] & mask] for j < N: one row, BLOCK values."""
    i = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < N
    s = tl.load(src_rows + i).to(tl.int64)
    d = tl.load(dst_rows + i).to(tl.int64)
    bits = tl.load(src + s * stride_src + j, mask=mask, other=0).to(tl.int32) & SRC_BITS_MASK
    tl.store(dst + d * stride_dst + j, tl.load(table + bits, mask=mask), mask=mask)


@triton.jit
def _dsa_quantize_rows_kernel(
    src,
    dst_q,
    dst_scale,
    dst_rope,
    src_rows,
    dst_rows,
    stride_src,
    stride_q,
    stride_scale,
    stride_rope,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    E4M3: tl.constexpr,
):
    """One token: per tile s = amax/448, q = e4m3(clamp(x * (1/s))); rope copied as bf16."""
    i = tl.program_id(0)
    s = tl.load(src_rows + i).to(tl.int64)
    d = tl.load(dst_rows + i).to(tl.int64)
    tiles = tl.arange(0, NOPE // TILE)
    offs = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    x = tl.load(src + s * stride_src + offs).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=1) / E4M3
    inv = 1.0 / scale
    q = tl.clamp(x * inv[:, None], -E4M3, E4M3).to(dst_q.dtype.element_ty)
    tl.store(dst_q + d * stride_q + offs, q)
    tl.store(dst_scale + d * stride_scale + tiles, scale)
    if ROPE > 0:
        r = tl.arange(0, ROPE_BLOCK)
        rope = tl.load(src + s * stride_src + NOPE + r, mask=r < ROPE)
        tl.store(dst_rope + d * stride_rope + r, rope, mask=r < ROPE)


@triton.jit
def _dsa_dequantize_rows_kernel(
    src_q,
    src_scale,
    src_rope,
    dst,
    src_rows,
    dst_rows,
    stride_q,
    stride_scale,
    stride_rope,
    stride_dst,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    """One token: x = bf16(float(q) * s) per tile; rope copied."""
    i = tl.program_id(0)
    s = tl.load(src_rows + i).to(tl.int64)
    d = tl.load(dst_rows + i).to(tl.int64)
    tiles = tl.arange(0, NOPE // TILE)
    offs = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    q = tl.load(src_q + s * stride_q + offs).to(tl.float32)
    scale = tl.load(src_scale + s * stride_scale + tiles)
    tl.store(dst + d * stride_dst + offs, (q * scale[:, None]).to(dst.dtype.element_ty))
    if ROPE > 0:
        r = tl.arange(0, ROPE_BLOCK)
        rope = tl.load(src_rope + s * stride_rope + r, mask=r < ROPE)
        tl.store(dst + d * stride_dst + NOPE + r, rope, mask=r < ROPE)


def _dsa_views(
    rows: torch.Tensor, layout: MLAKVLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The e4m3 values, fp32 scales and bf16 rope of packed DSA rows (views, no copy)."""
    scales_at = layout.nope
    rope_at = layout.nope + 4 * (layout.nope // DSA_TILE)
    q = rows[:, :scales_at].view(torch.float8_e4m3fn)
    scale = rows[:, scales_at:rope_at].view(torch.float32)
    rope = rows[:, rope_at:].view(torch.bfloat16)
    return q, scale, rope


def _check(
    src: torch.Tensor,
    src_layout: MLAKVLayout,
    dst: torch.Tensor,
    dst_layout: MLAKVLayout,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    if not convertible(src_layout, dst_layout):
        raise ValueError(f"no conversion from {src_layout} to {dst_layout}")
    for name, rows, layout in (("src", src, src_layout), ("dst", dst, dst_layout)):
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != layout.token_bytes:
            raise ValueError(
                f"{name} must be uint8 token rows [n, {layout.token_bytes}] for {layout}, got "
                f"{rows.dtype} {tuple(rows.shape)}"
            )
        if rows.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous along the row")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError(
            f"src_rows and dst_rows must be 1-D and equally long, got {tuple(src_rows.shape)} "
            f"and {tuple(dst_rows.shape)}"
        )


def convert_rows(
    src: torch.Tensor,
    src_layout: MLAKVLayout,
    dst: torch.Tensor,
    dst_layout: MLAKVLayout,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """Write token row ``src_rows[i]`` of ``src`` (in ``src_layout``) into row ``dst_rows[i]``
    of ``dst`` (in ``dst_layout``). Both are uint8 ``[rows, token_bytes]`` views of a pool
    layer or a staging buffer; launches on the current stream of their device."""
    _check(src, src_layout, dst, dst_layout, src_rows, dst_rows)
    n = src_rows.numel()
    if n == 0:
        return
    values = src_layout.nope + src_layout.rope
    kinds = (src_layout.kind, dst_layout.kind)
    if src_layout == dst_layout:
        dst[dst_rows] = src[src_rows]
    elif kinds in (("bf16", "fp8_e4m3"), ("fp8_e4m3", "bf16")):
        to_fp8 = kinds[0] == "bf16"
        table = _cast_table("bf16->fp8" if to_fp8 else "fp8->bf16", src.device)
        s = src.view(torch.int16) if to_fp8 else src
        d = dst if to_fp8 else dst.view(torch.int16)
        block = 1024
        _table_cast_rows_kernel[(n, triton.cdiv(values, block))](
            s,
            d,
            table,
            src_rows,
            dst_rows,
            s.stride(0),
            d.stride(0),
            N=values,
            BLOCK=block,
            SRC_BITS_MASK=0xFFFF if to_fp8 else 0xFF,
        )
    elif kinds == ("bf16", "fp8_e4m3_dsa"):
        s = src.view(torch.bfloat16)
        q, scale, rope = _dsa_views(dst, dst_layout)
        _dsa_quantize_rows_kernel[(n,)](
            s,
            q,
            scale,
            rope,
            src_rows,
            dst_rows,
            s.stride(0),
            q.stride(0),
            scale.stride(0),
            rope.stride(0),
            NOPE=src_layout.nope,
            ROPE=src_layout.rope,
            ROPE_BLOCK=triton.next_power_of_2(max(src_layout.rope, 1)),
            TILE=DSA_TILE,
            E4M3=E4M3_MAX,
        )
    else:  # ("fp8_e4m3_dsa", "bf16")
        q, scale, rope = _dsa_views(src, src_layout)
        d = dst.view(torch.bfloat16)
        _dsa_dequantize_rows_kernel[(n,)](
            q,
            scale,
            rope,
            d,
            src_rows,
            dst_rows,
            q.stride(0),
            scale.stride(0),
            rope.stride(0),
            d.stride(0),
            NOPE=src_layout.nope,
            ROPE=src_layout.rope,
            ROPE_BLOCK=triton.next_power_of_2(max(src_layout.rope, 1)),
            TILE=DSA_TILE,
        )


def convert_rows_ref(
    src: torch.Tensor,
    src_layout: MLAKVLayout,
    dst: torch.Tensor,
    dst_layout: MLAKVLayout,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """Pure-torch ``convert_rows``."""
    _check(src, src_layout, dst, dst_layout, src_rows, dst_rows)
    rows = src[src_rows.long()]
    nope = src_layout.nope
    kinds = (src_layout.kind, dst_layout.kind)
    if src_layout == dst_layout:
        out = rows
    elif kinds == ("bf16", "fp8_e4m3"):
        out = rows.view(torch.bfloat16).to(torch.float8_e4m3fn).view(torch.uint8)
    elif kinds == ("fp8_e4m3", "bf16"):
        out = rows.view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.uint8)
    elif kinds == ("bf16", "fp8_e4m3_dsa"):
        x = rows.view(torch.bfloat16)
        tiles = x[:, :nope].float().unflatten(1, (-1, DSA_TILE))
        scale = tiles.abs().amax(dim=2) / E4M3_MAX
        q = (tiles * (1.0 / scale)[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
        out = torch.cat(
            [
                q.to(torch.float8_e4m3fn).flatten(1).view(torch.uint8),
                scale.view(torch.uint8),
                x[:, nope:].contiguous().view(torch.uint8),
            ],
            dim=1,
        )
    else:
        q, scale, rope = _dsa_views(rows, src_layout)
        tiles = q.float().unflatten(1, (-1, DSA_TILE)) * scale[:, :, None]
        out = torch.cat([tiles.flatten(1).to(torch.bfloat16), rope], dim=1).view(torch.uint8)
    dst[dst_rows.long()] = out


def page_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The token rows of pages ``pages`` (page ``p`` holds rows ``p*page_size ...``)."""
    offsets = torch.arange(page_size, device=pages.device)
    return (pages.long()[:, None] * page_size + offsets).flatten()
