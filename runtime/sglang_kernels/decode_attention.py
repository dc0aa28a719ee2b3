"""SGLang's Triton-backend ``decode_attention_fwd`` routed to tessera's paged decode kernels.

SGLang's contract (``sglang.kernels.ops.attention.decode_attention``, 0.5.23): ``q`` ``[batch,
heads, qk_dim]``; ``k_buffer``/``v_buffer`` the layer's KV buffers ``[num_slots, kv_heads, dim]``
(for MLA, ``v_buffer`` is the first ``kv_lora_rank`` dims of ``k_buffer``'s rows, the same
storage); ``o`` ``[batch, heads, v_dim]`` written in place; ``kv_indptr``/``kv_indices`` a
token-level table (request ``b``'s ``n``-th token lives in slot ``kv_indices[kv_indptr[b] + n]``,
its length is ``kv_indptr[b + 1] - kv_indptr[b]``); ``k_scale``/``v_scale`` per-tensor floats
(FP8 dequantization); ``attn_logits``/``attn_lse``/``num_kv_splits`` SGLang's split scratch.

The translation reads everything in place: the buffers are passed as they are (FP8 pages
included), ``kv_indptr``/``kv_indices`` become a :class:`PageTable` read at the first slot of
each page (SGLang's paged allocator keeps token ``p`` at offset ``p % page_size`` of its page;
with ``page_size`` 1 every slot is read), the lengths are ``kv_indptr``'s differences (taken
by the kernel itself: no launch, no host sync), and ``o`` is the output. The split count is
sized from a bound on the longest request known on the host (:func:`longest_bound`, from the
tables' sizes), so the call can be captured in a CUDA graph.
SGLang's split scratch is not used.

Anything the kernels do not implement goes to SGLang's original function (see :func:`unsupported`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from tessera.kernels.paged_decode_bf16 import MLA_ROPE_DIM, paged_decode_bf16, paged_decode_mla_bf16
from tessera.kernels.paged_decode_fp8 import paged_decode_fp8, paged_decode_mla_fp8
from tessera.kernels.paged_kv import FP8_DTYPE, PageTable

from .contract import DECODE_ATTENTION_FWD
from .fallback import FALLBACKS, Fallbacks
from .plan import DECODE_ATTENTION

ORIGINAL_ATTR = "_tessera_original"


def _pow2_dim(d: int) -> bool:
    return d >= 16 and d & (d - 1) == 0


def is_mla_form(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """True when ``v_buffer`` is the latent prefix of ``k_buffer``'s rows (SGLang's MLA pool)."""
    return (
        v_buffer.data_ptr() == k_buffer.data_ptr()
        and v_buffer.shape[:-1] == k_buffer.shape[:-1]
        and v_buffer.stride() == k_buffer.stride()
        and k_buffer.shape[-1] - v_buffer.shape[-1] == MLA_ROPE_DIM
    )


def unsupported(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    *,
    k_scale: float,
    v_scale: float,
    logit_cap: float,
    sinks: Any,
    xai_temperature_len: int,
    score_mod: Any,
    page_size: int = 1,
) -> str | None:
    """Why tessera's kernel cannot serve this call (None: it can). Looks at shapes, dtypes and
    flags only, never at device data."""
    if torch.version.hip is not None:
        return "ROCm (tessera's kernels target NVIDIA GPUs)"
    if score_mod is not None:
        return "a score_mod"
    if page_size < 1 or page_size & (page_size - 1):
        return f"page size {page_size} (tessera: a power of two)"
    if logit_cap and logit_cap > 0:
        return "logit soft-capping"
    if sinks is not None:
        return "attention sinks"
    if xai_temperature_len and xai_temperature_len > 0:
        return "xAI temperature scaling"
    if o.dtype != q.dtype:
        return f"a {o.dtype} output (SGLang's context-parallel path, which reads attn_lse)"
    if k_buffer.dim() != 3 or v_buffer.dim() != 3:
        return f"{k_buffer.dim()}-D KV buffers (tessera reads [slots, kv_heads, dim])"
    if (
        q.stride(-1) != 1
        or o.stride(-1) != 1
        or k_buffer.stride(-1) != 1
        or v_buffer.stride(-1) != 1
    ):
        return "a non-contiguous last dim"
    heads, kv_heads = q.shape[1], k_buffer.shape[1]
    if heads % kv_heads:
        return f"{heads} query heads over {kv_heads} KV heads"
    kv = k_buffer.dtype
    if kv == torch.bfloat16:
        if q.dtype != torch.bfloat16:
            return f"a {q.dtype} query over a bf16 cache"
        if v_scale != 1.0:
            return "a v_scale other than 1 on a bf16 cache"
    elif kv == FP8_DTYPE:
        if q.dtype not in (torch.bfloat16, torch.float16):
            return f"a {q.dtype} query over an FP8 cache"
        if not v_scale > 0:
            return f"v_scale {v_scale}"
    else:
        return f"{kv} KV (tessera serves bf16 and float8_e4m3fn)"
    if v_buffer.dtype != kv:
        return f"K {kv} with V {v_buffer.dtype}"
    if is_mla_form(k_buffer, v_buffer):
        if kv_heads != 1 or not _pow2_dim(v_buffer.shape[-1]) or q.shape[-1] != k_buffer.shape[-1]:
            return f"MLA head dims q {q.shape[-1]}, kv {k_buffer.shape[-1]}/{v_buffer.shape[-1]}"
        return None
    if q.shape[-1] != k_buffer.shape[-1] or not _pow2_dim(q.shape[-1]):
        return f"qk head dim {q.shape[-1]} (tessera: a power of two >= 16)"
    if not _pow2_dim(v_buffer.shape[-1]):
        return f"v head dim {v_buffer.shape[-1]} (tessera: a power of two >= 16)"
    return None


def longest_bound(indices: int, attn_rows: int, batch: int, capturing: bool) -> int:
    """A bound on the batch's longest request, known on the host, from the sizes of SGLang's
    tables. Eagerly ``kv_indices`` holds the batch's own token slots (``seq_lens_sum`` of them,
    or batch x the context length where that sum is unknown) and ``attn_logits`` a row a
    request, so the slots bound every request's length. For CUDA graphs SGLang's Triton backend
    passes its graph buffers whole, in the capture and the warm-up runs before it: ``kv_indices``
    of (largest captured batch) x (context length) slots and ``attn_logits`` of that many rows
    (``init_cuda_graph_state``, 0.5.23), so their ratio is the context length; the whole buffer
    would count every row of every graph as one request's (the FP8 e4m3 kernel's token cap
    would then plan its most pieces or splits for any batch). The buffers show as more rows
    than requests, or as a capture (the largest batch's graph has as many)."""
    if attn_rows > 0 and (capturing or attn_rows > batch):
        return max(indices // attn_rows, 1)
    return max(indices, 1)


@functools.cache
def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor (a per-tensor FP8 scale); made once per value and device, so CUDA
    graph replays read the same memory."""
    return torch.full((), value, dtype=torch.float32, device=device)


def tessera_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    k_scale: float,
    v_scale: float,
    page_size: int = 1,
    attn_rows: int = 0,
) -> None:
    """Write ``o`` with tessera's kernel for a call that :func:`unsupported` accepted
    (``attn_rows``: the rows of SGLang's ``attn_logits``, for :func:`longest_bound`)."""
    batch = q.shape[0]
    # SGLang's paged allocator keeps a request's token p at offset p % page_size of its page, so
    # with pages the kernel reads one slot per page and streams whole pages (measured on the
    # H200: the per-token form cost MLA FP8 decode +52-57%, GQA FP8 up to +19%).
    table = PageTable.from_sglang_indptr(kv_indptr, kv_indices, batch, page_size)
    bound = longest_bound(kv_indices.numel(), attn_rows, batch,
                          q.is_cuda and torch.cuda.is_current_stream_capturing())  # fmt: skip
    fp8 = k_buffer.dtype == FP8_DTYPE
    if is_mla_form(k_buffer, v_buffer):
        if fp8:
            # One scale for the shared rows: v_scale; K's own factor goes into sm_scale.
            paged_decode_mla_fp8(
                q,
                k_buffer,
                _scalar(float(v_scale), q.device),
                table,
                sm_scale * k_scale / v_scale,
                max_seq_len=bound,
                out=o,
            )
        else:
            paged_decode_mla_bf16(q, k_buffer, table, sm_scale * k_scale, max_seq_len=bound, out=o)
    elif fp8:
        paged_decode_fp8(
            q,
            k_buffer,
            v_buffer,
            _scalar(float(k_scale), q.device),
            _scalar(float(v_scale), q.device),
            table,
            sm_scale,
            max_seq_len=bound,
            out=o,
        )
    else:
        paged_decode_bf16(
            q, k_buffer, v_buffer, table, sm_scale * k_scale, max_seq_len=bound, out=o
        )


def make_routed(
    original: Callable[..., None], fallbacks: Fallbacks = FALLBACKS
) -> Callable[..., None]:
    """A drop-in ``decode_attention_fwd``: tessera's kernel where it applies, else ``original``."""

    @functools.wraps(original)
    def decode_attention_fwd(
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        o: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        attn_logits: torch.Tensor,
        attn_lse: torch.Tensor,
        num_kv_splits: torch.Tensor,
        max_kv_splits: int,
        sm_scale: float,
        k_scale: float,
        v_scale: float,
        logit_cap: float = 0.0,
        sinks: Any = None,
        xai_temperature_len: int = -1,
        has_mla: bool = False,
        use_pdl: bool = False,
        page_size: int = 1,
        score_mod: Any = None,
        aux_tensors: Any = None,
        enable_lean: Any = None,
        lean_Mp: Any = None,
        lean_Lp: Any = None,
        lean_Op: Any = None,
        lean_locks: Any = None,
        uneven_batch: Any = None,
    ) -> None:
        reason = unsupported(
            q,
            k_buffer,
            v_buffer,
            o,
            k_scale=k_scale,
            v_scale=v_scale,
            logit_cap=logit_cap,
            sinks=sinks,
            xai_temperature_len=xai_temperature_len,
            score_mod=score_mod,
            page_size=page_size,
        )
        if reason is None:
            tessera_decode(
                q,
                k_buffer,
                v_buffer,
                o,
                kv_indptr,
                kv_indices,
                sm_scale,
                k_scale,
                v_scale,
                page_size,
                attn_logits.shape[0],
            )
            return
        fallbacks.record(DECODE_ATTENTION, reason)
        original(
            q,
            k_buffer,
            v_buffer,
            o,
            kv_indptr,
            kv_indices,
            attn_logits,
            attn_lse,
            num_kv_splits,
            max_kv_splits,
            sm_scale,
            k_scale,
            v_scale,
            logit_cap=logit_cap,
            sinks=sinks,
            xai_temperature_len=xai_temperature_len,
            has_mla=has_mla,
            use_pdl=use_pdl,
            page_size=page_size,
            score_mod=score_mod,
            aux_tensors=aux_tensors,
            enable_lean=enable_lean,
            lean_Mp=lean_Mp,
            lean_Lp=lean_Lp,
            lean_Op=lean_Op,
            lean_locks=lean_locks,
            uneven_batch=uneven_batch,
        )

    setattr(decode_attention_fwd, ORIGINAL_ATTR, original)
    return decode_attention_fwd


def install() -> Callable[..., None]:
    """Replace the module's ``decode_attention_fwd`` (SGLang's Triton backend imports it from the
    module when it is built, after this runs). Idempotent; returns the routed function."""
    module: Any = importlib.import_module(DECODE_ATTENTION_FWD.module)
    current = module.decode_attention_fwd
    if hasattr(current, ORIGINAL_ATTR):
        return current
    routed = make_routed(current)
    module.decode_attention_fwd = routed
    return routed


def uninstall() -> None:
    module: Any = importlib.import_module(DECODE_ATTENTION_FWD.module)
    original = getattr(module.decode_attention_fwd, ORIGINAL_ATTR, None)
    if original is not None:
        module.decode_attention_fwd = original
