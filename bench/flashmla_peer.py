"""FlashMLA's dense MLA decode as SGLang's ``flashmla`` backend calls it: the ``sgl-flash-mla``
1.0.0 wheel's legacy SM90 kernels, BF16 pages, or e4m3 pages with one scale per tensor and the
query cast to e4m3 at scale 1. Shared by the benchmarks that time it beside tessera's kernels
(``fp8_kv_decode.py``, kernel to kernel; ``sglang_adapter.py``, beside SGLang's call routed by
tessera's adapter; ``mla_profile.py``, under the profiler)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from tessera.kernels.paged_kv import FP8_DTYPE


def flashmla_decode(
    flashmla: ModuleType,
    q: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    latent: int,
    sm_scale: float,
    k_descale: torch.Tensor | None = None,
) -> Callable[[], torch.Tensor]:
    """A call of FlashMLA's decode: ``q`` ``[batch, heads, latent + rope]`` bf16 over ``pages``
    ``[num_pages, page_size, 1, latent + rope]`` through ``block_table`` ``[batch, pages]``
    (int32) and ``lens`` (int32), returning ``[batch, heads, latent]``. With ``k_descale`` (the
    per-tensor scale of e4m3 ``pages``) the FP8 kernel, the query cast to e4m3 here, outside
    the timed call (SGLang casts it each step). Its scheduling metadata is filled by the first
    call, so call it once before capturing a CUDA graph."""
    heads = q.shape[1]
    q4 = q.unsqueeze(1)  # [batch, 1 query token, heads, dims]
    meta = flashmla.get_mla_metadata()[0]
    if k_descale is None:

        def bf16() -> torch.Tensor:
            return flashmla.flash_mla_with_kvcache(
                q4, pages, block_table, lens, latent, meta, softmax_scale=sm_scale,
                use_legacy=True)[0].squeeze(1)  # fmt: skip

        return bf16
    q8 = q4.to(FP8_DTYPE)
    meta.tile_scheduler_metadata, meta.num_splits = flashmla.get_mla_decoding_metadata(
        lens, heads, 1, heads, is_fp8_kvcache=True, use_legacy=True
    )
    one = torch.ones(1, device=q.device)
    descale = k_descale.reshape(1).float()

    def fp8() -> torch.Tensor:
        return flashmla.flash_mla_with_kvcache(
            q8, pages, block_table, lens, latent, meta, softmax_scale=sm_scale,
            is_fp8_kvcache=True, use_legacy=True, descale_q=one, descale_k=descale,
        )[0].squeeze(1)  # fmt: skip

    return fp8
