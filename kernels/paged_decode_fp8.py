"""Paged decode attention over FP8 (e4m3) pages: GQA/MHA and MLA (absorbed form).

The FP8 sibling of ``paged_decode_bf16``: same layout, page table and SGLang mapping, plus the
scales written by ``fp8_kv_quant`` (0-dim per tensor, e.g. SGLang's ``k_scale``/``v_scale``
as tensors, or per (token, head)). Kernels in ``paged_decode_split``; references below.
"""

from __future__ import annotations

import torch

from .paged_decode_bf16 import MLA_ROPE_DIM, _mla_rows, decode_attention_ref
from .paged_decode_split import DecodeConfig, paged_decode
from .paged_kv import FP8_DTYPE, PageTable, dequantize_rows, scale_rows, token_rows


def _check_fp8(q: torch.Tensor, **caches: torch.Tensor) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
    for name, t in caches.items():
        if t.dtype != FP8_DTYPE:
            raise ValueError(f"{name} must be {FP8_DTYPE}, got {t.dtype}")


def paged_decode_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    table: PageTable,
    sm_scale: float,
    *,
    max_seq_len: int | None = None,
    total_tokens: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """GQA/MHA decode over FP8 K/V pages -> ``[batch, heads, dv]`` in ``q``'s dtype.

    ``q`` is widened to fp16 inside (|q| must stay below 65504, true of attention queries).
    """
    _check_fp8(q, k_cache=k_cache, v_cache=v_cache)
    k_rows, v_rows = token_rows(k_cache), token_rows(v_cache)
    if k_rows.shape[:2] != v_rows.shape[:2] or q.shape[-1] != k_rows.shape[-1]:
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k rows {tuple(k_rows.shape)}, "
            f"v rows {tuple(v_rows.shape)}"
        )
    scales = (scale_rows(k_scale, k_rows), scale_rows(v_scale, v_rows))
    return paged_decode(
        q,
        k_rows,
        v_rows,
        scales,
        table,
        sm_scale,
        rope_dim=0,
        max_seq_len=max_seq_len,
        total_tokens=total_tokens,
        out=out,
        config=config,
    )


def paged_decode_mla_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    table: PageTable,
    sm_scale: float,
    *,
    max_seq_len: int | None = None,
    total_tokens: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """MLA decode over one FP8 latent cache (one scale per token row) -> ``[batch, heads, 512]``."""
    _check_fp8(q, kv_cache=kv_cache)
    rows = _mla_rows(q, kv_cache)
    scale = scale_rows(kv_scale, rows)
    return paged_decode(
        q,
        rows,
        rows,
        (scale, scale),
        table,
        sm_scale,
        rope_dim=MLA_ROPE_DIM,
        max_seq_len=max_seq_len,
        total_tokens=total_tokens,
        out=out,
        config=config,
    )


def paged_decode_fp8_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    table: PageTable,
    sm_scale: float,
) -> torch.Tensor:
    """Pure-torch ``paged_decode_fp8``: attention over the dequantized cache (float32 result)."""
    k = dequantize_rows(token_rows(k_cache), k_scale)
    v = dequantize_rows(token_rows(v_cache), v_scale)
    return decode_attention_ref(q, k, v, table, sm_scale)


def paged_decode_mla_fp8_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    table: PageTable,
    sm_scale: float,
) -> torch.Tensor:
    """Pure-torch ``paged_decode_mla_fp8`` (float32 result)."""
    rows = dequantize_rows(token_rows(kv_cache), kv_scale)
    latent = rows.shape[-1] - MLA_ROPE_DIM
    return decode_attention_ref(q, rows, rows[..., :latent], table, sm_scale)
