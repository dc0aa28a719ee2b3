"""Wire the page-tag tracker into SGLang 0.5.23 at install time, by wrapping instance methods.

- ``PagedTokenToKVPoolAllocator``: ``alloc``/``alloc_extend``/``alloc_decode`` (including the
  decode-side pre-allocation for disaggregation, which calls them) bump the tags of the pages
  they hand out; every free path ends in ``_release_page_ids``, which bumps the freed pages;
  ``clear`` frees everything.
- ``ReqToTokenPool.write`` records the (page, tag) pairs a request is handed, and so does
  SGLang's batched extend writer ``write_cache_indices`` (which writes the rows directly).
- The scheduler's ``update_running_batch`` first checks the decode batch on the host side of
  the step (never inside CUDA-graph capture), agrees on the flags across the attention-TP
  ranks, aborts the mismatching requests with a clear error to their clients, and filters
  them out of the batch before SGLang prepares and runs the decode forward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import torch

from .metrics import IntegrityMetrics
from .reporter import MismatchReporter
from .tracker import PageTagTracker, TrackerShape, agree_across_ranks

log = logging.getLogger(__name__)


def tracker_shape(allocator: Any, req_to_token_pool: Any) -> TrackerShape:
    """The tracker's sizes from SGLang's paged allocator and request-to-token pool."""
    page_size = int(allocator.page_size)
    rows, max_context_len = req_to_token_pool.req_to_token.shape
    return TrackerShape(
        num_pages=int(allocator.size) // page_size,
        page_size=page_size,
        req_slots=int(rows),
        max_pages_per_req=-(-int(max_context_len) // page_size),
    )


def _wrap(obj: Any, name: str, after: Callable[..., None]) -> None:
    """Replace ``obj.name`` by a call to the original followed by ``after(result, *args)``."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        after(result, *args, **kwargs)
        return result

    setattr(obj, name, wrapped)


def install_allocator_hooks(allocator: Any, tracker: PageTagTracker) -> None:
    """Every page handed out or given back by this allocator moves its tag.

    Paged allocators end every free path in ``_release_page_ids``; the page-size-1
    ``TokenToKVPoolAllocator`` frees in ``free`` itself (inside a free group only at its end).
    """

    def allocated(out: torch.Tensor | None, *args: Any, **kwargs: Any) -> None:
        if out is not None:  # None: the pool was short and nothing was handed out
            tracker.on_alloc(out)

    def released(_: None, *page_ids: torch.Tensor) -> None:
        for pages in page_ids:
            tracker.on_free(pages)

    def freed(_: None, free_index: torch.Tensor) -> None:
        if allocator.free_group is None:  # else held back until free_group_end frees it
            tracker.on_free(free_index)

    for name in ("alloc", "alloc_extend", "alloc_decode"):
        _wrap(allocator, name, allocated)
    if hasattr(allocator, "_release_page_ids"):
        _wrap(allocator, "_release_page_ids", released)
    else:
        _wrap(allocator, "free", freed)
    _wrap(allocator, "clear", lambda *_: tracker.on_clear())


def record_write(tracker: PageTagTracker, indices: Any, values: torch.Tensor) -> None:
    """Record what ``ReqToTokenPool.write(indices, values)`` wrote.

    SGLang writes a row segment ``(row, slice)`` or one slot per row ``(rows, positions)``.
    """
    if not (isinstance(indices, tuple) and len(indices) == 2):
        raise TypeError(f"page-table write with unsupported indices {indices!r}")
    rows, cols = indices
    slots = torch.as_tensor(values).reshape(-1)
    if isinstance(cols, slice):
        start = 0 if cols.start is None else int(cols.start)
        positions = torch.arange(start, start + slots.numel(), device=slots.device)
    else:
        positions = torch.as_tensor(cols, device=slots.device).reshape(-1)
    rows_t = torch.as_tensor(rows, device=slots.device).reshape(-1).expand(positions.numel())
    tracker.record(rows_t, positions, slots)


def install_page_table_hooks(req_to_token_pool: Any, tracker: PageTagTracker) -> None:
    """Every page a request is handed through ``ReqToTokenPool.write`` is recorded."""
    _wrap(
        req_to_token_pool,
        "write",
        lambda _, indices, values: record_write(tracker, indices, values),
    )


def record_extend(
    tracker: PageTagTracker,
    req_pool_indices_cpu: torch.Tensor,
    prefix_lens_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    prefix_tensors: list[torch.Tensor],
    out_cache_loc: torch.Tensor,
) -> None:
    """Record an extend batch as ``write_cache_indices`` lays it out: per request the prefix
    slots (from the prefix cache) at ``[0, prefix_len)``, then its share of ``out_cache_loc``
    at ``[prefix_len, seq_len)``."""
    device = out_cache_loc.device
    rows, positions, slots = [], [], []
    offset = 0
    for i in range(req_pool_indices_cpu.numel()):
        prefix_len, seq_len = int(prefix_lens_cpu[i]), int(seq_lens_cpu[i])
        extend_len = seq_len - prefix_len
        slots += [
            prefix_tensors[i][:prefix_len].to(device),
            out_cache_loc[offset : offset + extend_len],
        ]
        offset += extend_len
        positions.append(torch.arange(seq_len, device=device))
        rows.append(torch.full((seq_len,), int(req_pool_indices_cpu[i]), device=device))
    if rows:
        tracker.record(torch.cat(rows), torch.cat(positions), torch.cat(slots))


def install_extend_writer_hook(tracker: PageTagTracker) -> None:
    """Record extend batches written by SGLang's batched writer (process-wide)."""
    from sglang.srt.mem_cache import allocation

    def recorded(_: None, out_cache_loc: torch.Tensor, *args: Any) -> None:
        # SGLang 0.5.23's positional order after out_cache_loc: req_pool_indices (device, cpu),
        # prefix_lens (device, cpu), seq_lens (device, cpu), extend_lens (device, cpu),
        # prefix_tensors, req_to_token_pool.
        rows_cpu, prefix_lens_cpu, seq_lens_cpu, prefix_tensors = args[1], args[3], args[5], args[8]
        record_extend(
            tracker, rows_cpu, prefix_lens_cpu, seq_lens_cpu, prefix_tensors, out_cache_loc
        )

    _wrap(allocation, "write_cache_indices", recorded)


def check_batch(
    tracker: PageTagTracker,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    group: Any,
) -> list[int]:
    """Bad-page count per request of a decode batch, agreed across the ranks of ``group``."""
    if req_pool_indices.numel() == 0:
        return []
    return agree_across_ranks(tracker.verify(page_table, req_pool_indices, seq_lens), group)


def mismatch_message(rid: str, bad_pages: int) -> str:
    return (
        f"KV-cache integrity check failed for request {rid}: {bad_pages} of its KV pages were "
        "freed, re-allocated or remapped while it was running, so its output would be computed "
        "from another request's cache. The request was aborted; retrying it is safe."
    )


def install_decode_check(
    scheduler: Any,
    tracker: PageTagTracker,
    metrics: IntegrityMetrics,
    reporter: MismatchReporter | None,
) -> None:
    """Check each decode batch before SGLang prepares it; abort and drop only the bad requests."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import _make_abort_req
    from sglang.srt.mem_cache.common import release_kv_cache

    original = scheduler.update_running_batch

    @functools.wraps(original)
    def checked(batch: Any) -> Any:
        if batch.reqs:
            counts = check_batch(
                tracker,
                batch.req_to_token_pool.req_to_token,
                batch.req_pool_indices,
                batch.seq_lens,
                scheduler.attn_tp_cpu_group,
            )
            bad = [(req, n) for req, n in zip(batch.reqs, counts, strict=True) if n]
            metrics.checked(len(counts))
            if bad:
                for req, n in bad:
                    msg = mismatch_message(req.rid, n)
                    log.error(msg)
                    req.to_finish = FINISH_ABORT(msg, HTTPStatus.INTERNAL_SERVER_ERROR)
                    # Its KV is suspect: give the row back without inserting it into the cache.
                    release_kv_cache(req, scheduler.tree_cache, checkpoint=False)
                    finished = req.to_finish.to_json()
                    scheduler.send_abort_output(_make_abort_req(req, finished_reason=finished), req)
                batch.filter_batch(keep_indices=[i for i, n in enumerate(counts) if not n])
                metrics.mismatched(requests=len(bad), pages=sum(n for _, n in bad))
                if reporter is not None:
                    reporter.mismatch(requests=len(bad), pages=sum(n for _, n in bad))
        return original(batch)

    scheduler.update_running_batch = checked


def install(
    scheduler: Any, metrics: IntegrityMetrics, reporter: MismatchReporter | None
) -> PageTagTracker:
    """Build a tracker for this scheduler's KV pool and hook it in everywhere (integrity on)."""
    allocator = scheduler.token_to_kv_pool_allocator
    pool = scheduler.req_to_token_pool
    tracker = PageTagTracker(tracker_shape(allocator, pool), device=pool.req_to_token.device)
    install_allocator_hooks(allocator, tracker)
    install_page_table_hooks(pool, tracker)
    install_extend_writer_hook(tracker)
    install_decode_check(scheduler, tracker, metrics, reporter)
    metrics.pages_tracked(tracker.shape.num_pages)
    return tracker
