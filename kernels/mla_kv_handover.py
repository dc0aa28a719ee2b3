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
import os
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from functools import cache, lru_cache

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
DSA_TILE = 128
LAYOUT_KINDS = ("bf16", "fp8_e4m3", "fp8_e4m3_dsa")
_INTERPRETER_LOCK = threading.Lock()


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
def _row(table, layer, row, ROW_BYTES: tl.constexpr, OFFSET: tl.constexpr, TYPE: tl.constexpr):
    """Typed pointer to byte OFFSET of token row ``row`` in layer ``layer``'s buffer, whose
    address is ``table[layer]``."""
    base = tl.load(table + layer) + row * ROW_BYTES + OFFSET
    return base.to(tl.pointer_type(TYPE))


@triton.jit
def _table_cast_rows_kernel(
    src_table,
    dst_table,
    cast,
    src_rows,
    dst_rows,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    SRC_TYPE: tl.constexpr,
    DST_TYPE: tl.constexpr,
    SRC_BYTES: tl.constexpr,
    DST_BYTES: tl.constexpr,
    SRC_BITS_MASK: tl.constexpr,
):
    """dst[l][dst_rows[i], j] = cast[src[l][src_rows[i], j] & mask] for j < N: one row of one
    layer, BLOCK values."""
    i = tl.program_id(0)
    layer = tl.program_id(1)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = j < N
    s = tl.load(src_rows + i).to(tl.int64)
    d = tl.load(dst_rows + i).to(tl.int64)
    src = _row(src_table, layer, s, SRC_BYTES, 0, SRC_TYPE)
    dst = _row(dst_table, layer, d, DST_BYTES, 0, DST_TYPE)
    bits = tl.load(src + j, mask=mask, other=0).to(tl.int32) & SRC_BITS_MASK
    tl.store(dst + j, tl.load(cast + bits, mask=mask), mask=mask)


@triton.jit
def _dsa_quantize_rows_kernel(
    src_table,
    dst_table,
    src_rows,
    dst_rows,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    SRC_BYTES: tl.constexpr,
    DST_BYTES: tl.constexpr,
    E4M3: tl.constexpr,
):
    """One token of one layer: per tile s = amax/448, q = e4m3(clamp(x * (1/s))); rope copied."""
    i = tl.program_id(0)
    layer = tl.program_id(1)
    s = tl.load(src_rows + i).to(tl.int64)
    d = tl.load(dst_rows + i).to(tl.int64)
    src = _row(src_table, layer, s, SRC_BYTES, 0, tl.bfloat16)
    tiles = tl.arange(0, NOPE // TILE)
    offs = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    x = tl.load(src + offs).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=1) / E4M3
    inv = 1.0 / scale
    q = tl.clamp(x * inv[:, None], -E4M3, E4M3).to(tl.float8e4nv)
    tl.store(_row(dst_table, layer, d, DST_BYTES, 0, tl.float8e4nv) + offs, q)
    tl.store(_row(dst_table, layer, d, DST_BYTES, NOPE, tl.float32) + tiles, scale)
    if ROPE > 0:
        r = tl.arange(0, ROPE_BLOCK)
        rope = tl.load(src + NOPE + r, mask=r < ROPE)
        dst_rope = _row(dst_table, layer, d, DST_BYTES, NOPE + 4 * (NOPE // TILE), tl.bfloat16)
        tl.store(dst_rope + r, rope, mask=r < ROPE)


@triton.jit
def _dsa_dequantize_rows_kernel(
    src_table,
    dst_table,
    src_rows,
    dst_rows,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    SRC_BYTES: tl.constexpr,
    DST_BYTES: tl.constexpr,
):
    """One token of one layer: x = bf16(float(q) * s) per tile; rope copied."""
    i = tl.program_id(0)
    layer = tl.program_id(1)
    s = tl.load(src_rows + i).to(tl.int64)
    d = tl.load(dst_rows + i).to(tl.int64)
    tiles = tl.arange(0, NOPE // TILE)
    offs = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    q = tl.load(_row(src_table, layer, s, SRC_BYTES, 0, tl.float8e4nv) + offs).to(tl.float32)
    scale = tl.load(_row(src_table, layer, s, SRC_BYTES, NOPE, tl.float32) + tiles)
    dst = _row(dst_table, layer, d, DST_BYTES, 0, tl.bfloat16)
    tl.store(dst + offs, (q * scale[:, None]).to(tl.bfloat16))
    if ROPE > 0:
        r = tl.arange(0, ROPE_BLOCK)
        src_rope = _row(src_table, layer, s, SRC_BYTES, NOPE + 4 * (NOPE // TILE), tl.bfloat16)
        rope = tl.load(src_rope + r, mask=r < ROPE)
        tl.store(dst + NOPE + r, rope, mask=r < ROPE)


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


Layers = torch.Tensor | Sequence[torch.Tensor]


def _layers(x: Layers) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _check(
    src: list[torch.Tensor],
    src_layout: MLAKVLayout,
    dst: list[torch.Tensor],
    dst_layout: MLAKVLayout,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    if not convertible(src_layout, dst_layout):
        raise ValueError(f"no conversion from {src_layout} to {dst_layout}")
    if len(src) != len(dst) or not src:
        raise ValueError(f"src and dst must list the same layers, got {len(src)} and {len(dst)}")
    for name, layers, layout in (("src", src, src_layout), ("dst", dst, dst_layout)):
        for rows in layers:
            if (rows.dtype != torch.uint8 or rows.dim() != 2
                    or rows.shape[1] != layout.token_bytes):
                raise ValueError(
                    f"{name} must be uint8 token rows [n, {layout.token_bytes}] for {layout}, "
                    f"got {rows.dtype} {tuple(rows.shape)}"
                )
            if not rows.is_contiguous():
                raise ValueError(f"{name} rows must be contiguous")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError(
            f"src_rows and dst_rows must be 1-D and equally long, got {tuple(src_rows.shape)} "
            f"and {tuple(dst_rows.shape)}"
        )


def _address_table(layers: list[torch.Tensor]) -> torch.Tensor:
    return _addresses_on(tuple(t.data_ptr() for t in layers), layers[0].device)


@lru_cache(maxsize=64)
def _addresses_on(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The layers' addresses as a device tensor; a transfer worker converts from the same pool
    layers into the same staging regions every time, so this is built once per buffer."""
    return torch.tensor(addresses, dtype=torch.int64).to(device)


def convert_rows(
    src: Layers,
    src_layout: MLAKVLayout,
    dst: Layers,
    dst_layout: MLAKVLayout,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """Write token row ``src_rows[i]`` of each layer of ``src`` (in ``src_layout``) into row
    ``dst_rows[i]`` of the same layer of ``dst`` (in ``dst_layout``), every layer in one launch.
    A layer is a contiguous uint8 ``[rows, token_bytes]`` view of a pool layer or of a staging
    region; ``src`` and ``dst`` are one such view or a list, one per layer. Launches on the
    current stream of their device."""
    src, dst = _layers(src), _layers(dst)
    _check(src, src_layout, dst, dst_layout, src_rows, dst_rows)
    if src_rows.numel() == 0:
        return
    # Triton's CPU interpreter keeps one launch's grid in global state, so transfer workers on
    # several threads take turns there; compiled launches need no lock.
    with _INTERPRETER_LOCK if os.environ.get("TRITON_INTERPRET") == "1" else nullcontext():
        _launch(src, src_layout, dst, dst_layout, src_rows, dst_rows)


def _launch(
    src: list[torch.Tensor],
    src_layout: MLAKVLayout,
    dst: list[torch.Tensor],
    dst_layout: MLAKVLayout,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    n, layers = src_rows.numel(), len(src)
    if src_layout == dst_layout:
        for s, d in zip(src, dst, strict=True):
            d[dst_rows] = s[src_rows]
        return
    src_table, dst_table = _address_table(src), _address_table(dst)
    kinds = (src_layout.kind, dst_layout.kind)
    values = src_layout.nope + src_layout.rope
    dims = {
        "NOPE": src_layout.nope,
        "ROPE": src_layout.rope,
        "ROPE_BLOCK": triton.next_power_of_2(max(src_layout.rope, 1)),
        "TILE": DSA_TILE,
        "SRC_BYTES": src_layout.token_bytes,
        "DST_BYTES": dst_layout.token_bytes,
    }
    if kinds in (("bf16", "fp8_e4m3"), ("fp8_e4m3", "bf16")):
        to_fp8 = kinds[0] == "bf16"
        cast = _cast_table("bf16->fp8" if to_fp8 else "fp8->bf16", src[0].device)
        block = 1024
        _table_cast_rows_kernel[(n, layers, triton.cdiv(values, block))](
            src_table,
            dst_table,
            cast,
            src_rows,
            dst_rows,
            N=values,
            BLOCK=block,
            SRC_TYPE=tl.int16 if to_fp8 else tl.uint8,
            DST_TYPE=tl.uint8 if to_fp8 else tl.int16,
            SRC_BYTES=src_layout.token_bytes,
            DST_BYTES=dst_layout.token_bytes,
            SRC_BITS_MASK=0xFFFF if to_fp8 else 0xFF,
        )
    elif kinds == ("bf16", "fp8_e4m3_dsa"):
        _dsa_quantize_rows_kernel[(n, layers)](
            src_table, dst_table, src_rows, dst_rows, E4M3=E4M3_MAX, **dims
        )
    else:  # ("fp8_e4m3_dsa", "bf16")
        _dsa_dequantize_rows_kernel[(n, layers)](
            src_table, dst_table, src_rows, dst_rows, **dims
        )


def convert_rows_ref(
    src: Layers,
    src_layout: MLAKVLayout,
    dst: Layers,
    dst_layout: MLAKVLayout,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """Pure-torch ``convert_rows``."""
    src, dst = _layers(src), _layers(dst)
    _check(src, src_layout, dst, dst_layout, src_rows, dst_rows)
    for s, d in zip(src, dst, strict=True):
        d[dst_rows.long()] = _convert_ref(s[src_rows.long()], src_layout, dst_layout)


def _convert_ref(rows: torch.Tensor, src_layout: MLAKVLayout,
                 dst_layout: MLAKVLayout) -> torch.Tensor:
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
    return out


def page_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The token rows of pages ``pages`` (page ``p`` holds rows ``p*page_size ...``)."""
    offsets = torch.arange(page_size, device=pages.device)
    return (pages.long()[:, None] * page_size + offsets).flatten()
