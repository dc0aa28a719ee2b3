"""Paged decode attention over BF16 pages: GQA/MHA and MLA (absorbed form).

Kernels in ``paged_decode_split``; the pure-torch references are below each launcher.
Inputs map onto SGLang's ``decode_attention_fwd`` without copies: ``q`` is its ``[batch,
heads, dim]`` query, the caches are its KV buffers (flat or paged), and
``PageTable.from_sglang(kv_indptr, kv_indices, seq_lens, page_size)`` wraps its indices.
"""

from __future__ import annotations

import torch

from .paged_decode_split import DecodeConfig, paged_decode
from .paged_kv import PageTable, token_rows

MLA_ROPE_DIM = 64


def _check_bf16(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")


def paged_decode_bf16(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: PageTable,
    sm_scale: float,
    *,
    max_seq_len: int | None = None,
    total_tokens: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """GQA/MHA decode: ``q`` ``[batch, heads, d]`` over BF16 K/V pages -> ``[batch, heads, dv]``.

    ``max_seq_len`` (the longest request) sizes the split; without it it is read from the
    table, a host sync (pass it under CUDA graphs). ``total_tokens`` (the sum of the lengths, as
    a scheduler knows it) gives every split the same number of tokens, so with mixed lengths
    the long requests get more splits; without it each request is split in equal parts.
    The same two arguments apply to the MLA and FP8 forms.
    """
    _check_bf16(q=q, k_cache=k_cache, v_cache=v_cache)
    k_rows, v_rows = token_rows(k_cache), token_rows(v_cache)
    if k_rows.shape[:2] != v_rows.shape[:2] or q.shape[-1] != k_rows.shape[-1]:
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k rows {tuple(k_rows.shape)}, "
            f"v rows {tuple(v_rows.shape)}"
        )
    return paged_decode(
        q,
        k_rows,
        v_rows,
        None,
        table,
        sm_scale,
        rope_dim=0,
        max_seq_len=max_seq_len,
        total_tokens=total_tokens,
        out=out,
        config=config,
    )


def paged_decode_mla_bf16(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table: PageTable,
    sm_scale: float,
    *,
    max_seq_len: int | None = None,
    total_tokens: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """MLA decode, absorbed form: ``q`` ``[batch, heads, 512 + 64]`` over one BF16 latent cache
    of ``[.., 1, 512 + 64]`` rows -> ``[batch, heads, 512]`` (V = the latent part)."""
    _check_bf16(q=q, kv_cache=kv_cache)
    rows = _mla_rows(q, kv_cache)
    return paged_decode(
        q,
        rows,
        rows,
        None,
        table,
        sm_scale,
        rope_dim=MLA_ROPE_DIM,
        max_seq_len=max_seq_len,
        total_tokens=total_tokens,
        out=out,
        config=config,
    )


def _mla_rows(q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    rows = token_rows(kv_cache)
    if rows.shape[1] != 1 or rows.shape[2] != q.shape[-1] or q.shape[-1] <= MLA_ROPE_DIM:
        raise ValueError(
            f"MLA needs one KV head of latent + {MLA_ROPE_DIM} rope dims matching q, got "
            f"q {tuple(q.shape)} and cache rows {tuple(rows.shape)}"
        )
    return rows


def decode_attention_ref(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    table: PageTable,
    sm_scale: float,
) -> torch.Tensor:
    """Float64 attention of each request's query over its tokens' rows (any float dtype);
    ``[batch, heads, dv]`` in float32. An empty request gives zeros."""
    batch, heads, _ = q.shape
    kv_heads = k_rows.shape[1]
    out = torch.zeros(batch, heads, v_rows.shape[-1], dtype=torch.float64, device=q.device)
    for b in range(batch):
        slots = table.token_slots(b)
        if slots.numel() == 0:
            continue
        k = k_rows[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [n, H, d]
        v = v_rows[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out.float()


def paged_decode_bf16_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: PageTable,
    sm_scale: float,
) -> torch.Tensor:
    """Pure-torch ``paged_decode_bf16`` (float32 result)."""
    return decode_attention_ref(q, token_rows(k_cache), token_rows(v_cache), table, sm_scale)


def paged_decode_mla_bf16_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, table: PageTable, sm_scale: float
) -> torch.Tensor:
    """Pure-torch ``paged_decode_mla_bf16`` (float32 result)."""
    rows = token_rows(kv_cache)
    latent = rows.shape[-1] - MLA_ROPE_DIM
    return decode_attention_ref(q, rows, rows[..., :latent], table, sm_scale)
