"""BF16 -> FP8 page conversion, for handing a BF16-KV prefill pool's pages to an FP8-KV decode
pool (the PD transfer copies raw page bytes and converts nothing).

Each listed source page is quantized, token row by token row, into the matching destination
page with the same rules as quantize-on-write (``fp8_kv_quant``), in one launch.
"""

from __future__ import annotations

import torch

from .fp8_kv_quant import quantize_ref, quantize_rows
from .paged_kv import scale_rows, token_rows


def _page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    offsets = torch.arange(page_size, device=pages.device)
    return (pages.long()[:, None] * page_size + offsets).flatten()


def _check_pages(
    src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor
) -> int:
    if src.dim() != 4 or dst.dim() != 4 or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            "both caches must be paged [num_pages, page_size, kv_heads, dim] with equal page "
            f"shapes, got {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if src.dtype != torch.bfloat16:
        raise ValueError(f"the source cache must be bfloat16, got {src.dtype}")
    if src_pages.dim() != 1 or src_pages.shape != dst_pages.shape:
        raise ValueError(
            f"src_pages and dst_pages must be 1-D and equally long, got "
            f"{tuple(src_pages.shape)} and {tuple(dst_pages.shape)}"
        )
    return src.shape[1]


def convert_pages_bf16_to_fp8(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    dst_scale: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
) -> None:
    """Quantize BF16 pages ``src_pages`` of ``src_cache`` into FP8 pages ``dst_pages`` of
    ``dst_cache``; ``dst_scale`` per tensor (read) or per (token, head) (written)."""
    page_size = _check_pages(src_cache, dst_cache, src_pages, dst_pages)
    quantize_rows(
        token_rows(src_cache),
        _page_slots(src_pages, page_size),
        dst_cache,
        _page_slots(dst_pages, page_size),
        dst_scale,
    )


def convert_pages_bf16_to_fp8_ref(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    dst_scale: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
) -> None:
    """Pure-torch ``convert_pages_bf16_to_fp8``."""
    page_size = _check_pages(src_cache, dst_cache, src_pages, dst_pages)
    src_slots = _page_slots(src_pages, page_size)
    dst_slots = _page_slots(dst_pages, page_size)
    rows = token_rows(dst_cache)
    per_token_head = dst_scale.dim() != 0
    q, s = quantize_ref(token_rows(src_cache)[src_slots], None if per_token_head else dst_scale)
    rows[dst_slots] = q
    if per_token_head:
        scale_rows(dst_scale, rows)[dst_slots] = s
