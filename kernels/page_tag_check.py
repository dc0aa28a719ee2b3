"""Batched page-tag check: does every page a request reads still belong to it?

Every physical KV page carries a generation tag (int32) that changes on each allocation and
each free, so a page in use has an odd tag and a free one an even tag. Each request keeps, per
page position ``j``, the page it was handed and the tag that page had then. For request ``b``
(page-table row ``r = req_slots[b]``) and each ``j < min(page_counts[b], P)``:

    now   = page_table[r, j * page_size] // page_size     (-1 for a negative slot)
    page  = expected_pages[r, j]
    bad   = now != page                                   (stale or rewritten page-table row)
          | page outside [0, len(tags))                   (corrupted expectation)
          | tags[page] != expected_tags[r, j]             (freed, reallocated or corrupted tag)
          | expected_tags[r, j] is even                   (handed out while already in use)

and the result is ``out[b] = number of bad pages``. The page table is SGLang's
``req_to_token`` (token slots, one row per request slot), read in place. Tags are compared for
equality only, so wrap-around of the counter is harmless.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_PAGES = 1024


@triton.jit
def _page_tag_check_kernel(
    page_table,
    req_slots,
    page_counts,
    expected_pages,
    expected_tags,
    tags,
    out,
    num_tags,
    max_pages,
    stride_table_row,
    stride_expected_row,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One request, BLOCK page positions: out[b] += count of bad pages among them."""
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(req_slots + b).to(tl.int64)
    n = tl.minimum(tl.load(page_counts + b).to(tl.int64), max_pages)
    live = j < n

    slot = tl.load(page_table + row * stride_table_row + j * PAGE_SIZE, mask=live, other=0)
    now = tl.where(slot >= 0, slot // PAGE_SIZE, -1).to(tl.int64)
    page = tl.load(expected_pages + row * stride_expected_row + j, mask=live, other=0).to(tl.int64)
    want = tl.load(expected_tags + row * stride_expected_row + j, mask=live, other=1)
    in_range = (page >= 0) & (page < num_tags)
    have = tl.load(tags + page, mask=live & in_range, other=0)

    bad = (now != page) | (~in_range) | (have != want) | ((want & 1) == 0)
    count = tl.sum((bad & live).to(tl.int32), axis=0)
    if count > 0:
        tl.atomic_add(out + b, count)


def _check_args(
    page_table: torch.Tensor,
    page_size: int,
    req_slots: torch.Tensor,
    page_counts: torch.Tensor,
    expected_pages: torch.Tensor,
    expected_tags: torch.Tensor,
    tags: torch.Tensor,
) -> None:
    named = {
        "page_table": page_table,
        "req_slots": req_slots,
        "page_counts": page_counts,
        "expected_pages": expected_pages,
        "expected_tags": expected_tags,
        "tags": tags,
    }
    for name, t in named.items():
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != tags.device:
            raise ValueError(f"{name} is on {t.device} but tags are on {tags.device}")
    if expected_tags.dtype != torch.int32 or tags.dtype != torch.int32:
        raise TypeError("expected_tags and tags must be int32 (tags are 31-bit counters)")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if page_table.dim() != 2 or expected_pages.dim() != 2:
        raise ValueError("page_table and expected_pages must be 2-D [request slot, position]")
    if expected_pages.shape != expected_tags.shape:
        raise ValueError(
            f"expected_pages {tuple(expected_pages.shape)} and expected_tags "
            f"{tuple(expected_tags.shape)} must have the same shape"
        )
    if page_table.shape[0] != expected_pages.shape[0]:
        raise ValueError("page_table and expected_pages must have one row per request slot")
    if (expected_pages.shape[1] - 1) * page_size >= page_table.shape[1]:
        raise ValueError(
            f"{expected_pages.shape[1]} page positions of {page_size} tokens do not fit a "
            f"page table {page_table.shape[1]} tokens wide"
        )
    if req_slots.shape != page_counts.shape or req_slots.dim() != 1:
        raise ValueError("req_slots and page_counts must be 1-D with one entry per request")
    if page_table.stride(1) != 1 or expected_pages.stride(1) != 1 or expected_tags.stride(1) != 1:
        raise ValueError("page_table, expected_pages and expected_tags need contiguous rows")
    if expected_pages.stride(0) != expected_tags.stride(0):
        raise ValueError("expected_pages and expected_tags must share one row stride")


def page_tag_check(
    page_table: torch.Tensor,
    page_size: int,
    req_slots: torch.Tensor,
    page_counts: torch.Tensor,
    expected_pages: torch.Tensor,
    expected_tags: torch.Tensor,
    tags: torch.Tensor,
) -> torch.Tensor:
    """Number of bad pages per request (int32 ``[len(req_slots)]``); see the module docstring."""
    _check_args(page_table, page_size, req_slots, page_counts, expected_pages, expected_tags, tags)
    out = torch.zeros(req_slots.shape[0], dtype=torch.int32, device=tags.device)
    max_pages = expected_pages.shape[1]
    if out.numel() == 0 or max_pages == 0:
        return out
    grid = (out.numel(), triton.cdiv(max_pages, BLOCK_PAGES))
    _page_tag_check_kernel[grid](
        page_table,
        req_slots.contiguous(),
        page_counts.contiguous(),
        expected_pages,
        expected_tags,
        tags.contiguous(),
        out,
        tags.numel(),
        max_pages,
        page_table.stride(0),
        expected_pages.stride(0),
        PAGE_SIZE=page_size,
        BLOCK=BLOCK_PAGES,
    )
    return out


def page_tag_check_ref(
    page_table: torch.Tensor,
    page_size: int,
    req_slots: torch.Tensor,
    page_counts: torch.Tensor,
    expected_pages: torch.Tensor,
    expected_tags: torch.Tensor,
    tags: torch.Tensor,
) -> torch.Tensor:
    """The same count in plain torch (the CPU path, and what the kernel is tested against)."""
    _check_args(page_table, page_size, req_slots, page_counts, expected_pages, expected_tags, tags)
    max_pages = expected_pages.shape[1]
    rows = req_slots.long()
    j = torch.arange(max_pages, device=tags.device)
    live = j[None, :] < page_counts.long().clamp(max=max_pages)[:, None]

    slot = page_table[:, : max_pages * page_size : page_size][rows].long()
    now = torch.where(slot >= 0, slot // page_size, -1)
    page = expected_pages[rows].long()
    want = expected_tags[rows]
    in_range = (page >= 0) & (page < tags.numel())
    have = torch.where(in_range, tags[page.clamp(0, tags.numel() - 1)], 0)

    bad = (now != page) | ~in_range | (have != want) | ((want & 1) == 0)
    return (bad & live).sum(dim=1, dtype=torch.int32)
