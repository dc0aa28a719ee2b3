"""Per-page generation tags for the KV cache, and per-request expectations beside the page table.

The tag of a physical page changes on every allocation (+1) and every free (to the next even
value), so an allocated page has an odd tag and a free page an even one (31-bit counters,
compared for equality only, so wrap-around is harmless). When a request's page-table row gets
a page, the tracker records the (page, tag) pair at that page position. ``verify`` then flags
every request whose row no longer matches what it was handed, whose pages were freed or
re-allocated since, or which was handed a page that was already in use (the check itself:
``tessera.kernels.page_tag_check``).

Everything here is asynchronous tensor work on the pool's device: no host synchronisation
except in ``verify``, whose per-request answer the scheduler needs on the host anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tessera.kernels.page_tag_check import page_tag_check, page_tag_check_ref

TAG_MASK = 0x7FFFFFFF  # 31-bit counters keep int32 tags non-negative; parity survives the wrap


@dataclass(frozen=True)
class TrackerShape:
    """Sizes of the KV pool the tracker shadows (SGLang's names in brackets)."""

    num_pages: int  # allocatable pages; page ids run 1..num_pages, page 0 is padding
    page_size: int  # tokens per page [page_size]
    req_slots: int  # rows of the page table [ReqToTokenPool.size]
    max_pages_per_req: int  # page positions per row [ceil(max_context_len / page_size)]

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "req_slots", "max_pages_per_req"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrackerShape.{name} must be >= 1, got {getattr(self, name)}")


class NoopTracker:
    """What the runtime holds when integrity checking is off: no tensors, no kernels."""

    enabled = False

    def on_alloc(self, token_slots: torch.Tensor) -> None:
        pass

    def on_free(self, pages: torch.Tensor) -> None:
        pass

    def on_clear(self) -> None:
        pass

    def record(
        self, req_slots: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor
    ) -> None:
        pass


class PageTagTracker:
    """Generation tags per page plus the (page, tag) each request expects per page position."""

    enabled = True

    def __init__(self, shape: TrackerShape, device: str | torch.device = "cpu") -> None:
        self.shape = shape
        self.page_size = shape.page_size
        self.device = torch.device(device)
        self.tags = torch.zeros(shape.num_pages + 1, dtype=torch.int32, device=self.device)
        # One extra row takes the writes `record` discards, so it never needs a host sync.
        rows, cols = shape.req_slots + 1, shape.max_pages_per_req
        self.expected_pages = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        self.expected_tags = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        self._scratch_row = shape.req_slots

    # -- allocator events ------------------------------------------------------------------

    def on_alloc(self, token_slots: torch.Tensor) -> None:
        """Token slots just handed out: every slot at offset 0 of a page starts a fresh page.

        (A paged allocator only hands out the first slot of a page together with the page.)
        The tag moves up by one per hand-out, so a page handed out while in use (or twice in
        one call) ends with an even tag, which no valid expectation has: its holders fail.
        """
        slots = token_slots.to(device=self.device, dtype=torch.int64).reshape(-1)
        if slots.numel() == 0:
            return
        pages = slots // self.page_size
        self.tags.index_add_(0, pages, (slots % self.page_size == 0).to(torch.int32))
        self.tags[pages] = self.tags[pages] & TAG_MASK

    def on_free(self, pages: torch.Tensor) -> None:
        """Page ids just returned to the free list: each moves to its next even tag.

        Always even after a free, whatever came before, so a page that was handed out twice
        starts clean once it is back in the free list.
        """
        pages = pages.to(device=self.device, dtype=torch.int64).reshape(-1)
        if pages.numel():
            self.tags[pages] = ((self.tags[pages] + 2) & ~1) & TAG_MASK

    def on_clear(self) -> None:
        """The allocator was reset: every page is free again."""
        self.tags.add_(self.tags & 1).bitwise_and_(TAG_MASK)

    # -- request expectations --------------------------------------------------------------

    def record(
        self, req_slots: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor
    ) -> None:
        """Token ``positions[i]`` of page-table row ``req_slots[i]`` now lives in slot
        ``token_slots[i]``. The first token of each page records (page, current tag); the
        other tokens of a page are already covered and are routed to the scratch row."""
        rows = req_slots.to(device=self.device, dtype=torch.int64).reshape(-1)
        pos = positions.to(device=self.device, dtype=torch.int64).reshape(-1)
        slots = token_slots.to(device=self.device, dtype=torch.int64).reshape(-1)
        if not rows.numel() == pos.numel() == slots.numel():
            raise ValueError(
                f"record needs one row, position and slot per token: got {rows.numel()}, "
                f"{pos.numel()} and {slots.numel()}"
            )
        first = pos % self.page_size == 0
        rows = torch.where(first, rows, self._scratch_row)
        cols = torch.where(first, pos // self.page_size, 0)
        pages = (slots // self.page_size).clamp(0, self.tags.numel() - 1)
        self.expected_pages[rows, cols] = pages.to(torch.int32)
        self.expected_tags[rows, cols] = self.tags[pages]

    # -- the check -------------------------------------------------------------------------

    def verify(
        self, page_table: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """Bad-page count per request of a batch (int32, on the tracker's device).

        ``page_table`` is SGLang's ``req_to_token`` (token slots per row); each request's
        first ``ceil(seq_len / page_size)`` page positions are checked.
        """
        page_counts = (seq_lens.to(self.device) + self.page_size - 1) // self.page_size
        check = page_tag_check if self.device.type == "cuda" else page_tag_check_ref
        return check(
            page_table,
            self.page_size,
            req_slots.to(self.device),
            page_counts,
            self.expected_pages[:-1],
            self.expected_tags[:-1],
            self.tags,
        )


Tracker = NoopTracker | PageTagTracker


def agree_across_ranks(bad_pages: torch.Tensor, group: dist.ProcessGroup | None) -> list[int]:
    """Per-request bad-page counts, maxed over the ranks of ``group`` (a CPU/gloo group, as
    SGLang's attention-TP CPU group is): a mismatch on any rank aborts the request on all of
    them, so every rank keeps the same batch. Every rank must pass the same batch order."""
    counts = bad_pages.to(device="cpu", dtype=torch.int32)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    return counts.tolist()
