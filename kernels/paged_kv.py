"""The one paged KV-cache layout, shared by the BF16 and FP8 kernels.

Cache: a buffer of token rows, ``[num_pages, page_size, kv_heads, dim]`` or its flat view
``[num_slots, kv_heads, dim]`` (``slot = page * page_size + offset``). This is SGLang's KV buffer
as it is, so its buffers need no copy. MLA stores one buffer of ``kv_heads = 1`` rows of
512 latent + 64 rope dims; V is the first 512 dims of the same rows.

FP8 scales live beside the cache, one float32 per (token, head): ``[num_slots, kv_heads]``.
A per-tensor scale is the same tensor expanded from a 0-dim tensor (stride 0), so every kernel
has one code path for both granularities.

Page table: ``PageTable`` below; it reads SGLang's ``kv_indptr``/``kv_indices`` in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn; stores saturate here
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class PageTable:
    """Which pages hold each request's tokens.

    Request ``b`` has ``seq_lens[b]`` tokens; its ``j``-th page is
    ``indices[indptr[b] + j * entries_per_page] // entries_per_page``.

    - ``entries_per_page == 1``: ``indices`` lists page ids (the compact form).
    - ``entries_per_page == page_size``: ``indices`` lists token slots, one per token, as SGLang's
      triton backend builds ``kv_indices``; only each page's first slot is read.

    With ``seq_lens_are_ends`` (token slots only) ``seq_lens[b]`` is request ``b``'s end in
    ``indices``, ``indptr[b + 1]``, and its length ``seq_lens[b] - indptr[b]``: SGLang's table
    as it is, read with no launch to subtract (:meth:`from_sglang_indptr`).
    """

    indptr: torch.Tensor  # [batch + 1], integer
    indices: torch.Tensor  # 1-D, integer
    seq_lens: torch.Tensor  # [batch], integer, tokens (or ends, see above)
    page_size: int
    entries_per_page: int
    seq_lens_are_ends: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.entries_per_page not in (1, self.page_size):
            raise ValueError(
                f"entries_per_page must be 1 (page ids) or page_size={self.page_size} "
                f"(token slots), got {self.entries_per_page}"
            )
        for name in ("indptr", "indices", "seq_lens"):
            t = getattr(self, name)
            if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}"
                )
        if self.seq_lens_are_ends and self.entries_per_page != self.page_size:
            raise ValueError("seq_lens_are_ends needs token slots (entries_per_page == page_size)")
        if self.indptr.numel() < self.seq_lens.numel() + 1:
            raise ValueError(
                f"indptr needs batch + 1 = {self.seq_lens.numel() + 1} entries, "
                f"got {self.indptr.numel()}"
            )

    @property
    def batch_size(self) -> int:
        return self.seq_lens.numel()

    @property
    def max_tokens(self) -> int:
        """The most tokens the table's entries address: a bound on the batch's total length
        known on the host (no device sync), e.g. for SGLang's tables, whose entries are the
        requests' token slots back to back."""
        return self.indices.numel() * self.page_size // self.entries_per_page

    def lengths(self) -> torch.Tensor:
        """Each request's token count (a subtraction when ``seq_lens`` holds ends)."""
        if self.seq_lens_are_ends:
            return self.seq_lens - self.indptr[: self.batch_size]
        return self.seq_lens

    @classmethod
    def from_page_lists(
        cls, pages: list[list[int]], seq_lens: list[int], page_size: int, device: torch.device | str
    ) -> PageTable:
        """The compact form from one list of page ids per request."""
        if len(pages) != len(seq_lens):
            raise ValueError(f"{len(pages)} page lists for {len(seq_lens)} requests")
        for b, (p, n) in enumerate(zip(pages, seq_lens, strict=True)):
            if len(p) * page_size < n:
                raise ValueError(f"request {b}: {n} tokens need more than {len(p)} pages")
        counts = torch.tensor([0] + [len(p) for p in pages])
        return cls(
            indptr=counts.cumsum(0).to(torch.int32).to(device),
            indices=torch.tensor([i for p in pages for i in p], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            page_size=page_size,
            entries_per_page=1,
        )

    @classmethod
    def from_sglang(
        cls,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
    ) -> PageTable:
        """SGLang's token-level ``kv_indptr``/``kv_indices`` and ``seq_lens``, read in place."""
        return cls(kv_indptr, kv_indices, seq_lens, page_size, entries_per_page=page_size)

    @classmethod
    def from_sglang_indptr(
        cls, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, batch: int, page_size: int
    ) -> PageTable:
        """SGLang's token-level table alone: lengths are ``kv_indptr`` differences, which the
        kernels take themselves (``kv_indptr[1:]`` is a view, nothing is launched)."""
        return cls(kv_indptr, kv_indices, kv_indptr[1 : batch + 1], page_size,
                   entries_per_page=page_size, seq_lens_are_ends=True)  # fmt: skip

    def token_slots(self, b: int) -> torch.Tensor:
        """The cache slots of request ``b``'s tokens, in order (for references and tests)."""
        n = int(self.lengths()[b])
        pos = torch.arange(n, device=self.indices.device)
        start = int(self.indptr[b])
        entry = self.indices[start + (pos // self.page_size) * self.entries_per_page].long()
        return (entry // self.entries_per_page) * self.page_size + pos % self.page_size


def token_rows(cache: torch.Tensor) -> torch.Tensor:
    """The flat ``[num_slots, kv_heads, dim]`` view of a paged cache (no copy)."""
    if cache.dim() == 4:
        cache = cache.flatten(0, 1)
    if cache.dim() != 3:
        raise ValueError(
            "a KV cache must be [num_pages, page_size, kv_heads, dim] or "
            f"[num_slots, kv_heads, dim], got shape {tuple(cache.shape)}"
        )
    if cache.stride(-1) != 1:
        raise ValueError("a KV cache's last dim must be contiguous")
    return cache


def scale_rows(scale: torch.Tensor, cache_rows: torch.Tensor) -> torch.Tensor:
    """Scales as ``[num_slots, kv_heads]``: per-tensor (0-dim) becomes a stride-0 view."""
    slots, heads = cache_rows.shape[:2]
    if scale.dtype != torch.float32:
        raise ValueError(f"FP8 scales must be float32, got {scale.dtype}")
    if scale.dim() == 0:
        return scale.expand(slots, heads)
    if scale.numel() != slots * heads or not scale.is_contiguous():
        raise ValueError(
            f"FP8 scales must be 0-dim (per tensor) or a contiguous [num_slots={slots}, "
            f"kv_heads={heads}] (or [num_pages, page_size, kv_heads]) tensor (per token and "
            f"head), got shape {tuple(scale.shape)}"
        )
    return scale.view(slots, heads)


def dequantize_rows(cache_rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 rows times their scales, in float32 (reference side)."""
    return cache_rows.float() * scale_rows(scale, cache_rows).unsqueeze(-1)
