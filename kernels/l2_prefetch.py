"""Ask L2 for a fixed set of tensors' bytes, in one launch, ahead of the kernels that read them.

At one decode token a layer's dense INT4 GEMMs are bound by latency, not bytes: each reads 0.9
to 7.6 MB and starts with DRAM's first round trip, while the layer's norms, attention and glue
kernels leave DRAM mostly idle. Launched on a side stream beside those kernels, this fills L2
with the weights the next GEMMs read, so they start on L2 hits. Each program issues bulk
prefetches (``cp.async.bulk.prefetch.L2``, sm_90): one instruction a chunk, nothing returns to
a register and nothing waits for them, so the launch ends as soon as they are issued.

The addresses come from a table made once per set (captured by a CUDA graph with the launch).
Prefetching is a hint: a set that does not fit L2, or is evicted before use, only costs the
bytes read twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

CHUNK = 32 * 1024  # bytes a request
REQUESTS = 128  # requests a program

# L2 fetches ``$2`` bytes at ``$1`` (16-byte aligned, a multiple of 16) where ``$3`` is set
_PREFETCH_L2 = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }"
)


@triton.jit
def _l2_prefetch_kernel(table_ptr, CHUNK: tl.constexpr, REQUESTS: tl.constexpr):
    """Program (t, c): chunks ``c * REQUESTS`` on of table row t (address, bytes)."""
    t, c = tl.program_id(0), tl.program_id(1)
    address = tl.load(table_ptr + 2 * t)
    nbytes = tl.load(table_ptr + 2 * t + 1)
    start = (c * REQUESTS + tl.arange(0, REQUESTS)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK)
    tl.inline_asm_elementwise(
        _PREFETCH_L2, "=r,l,r,r",
        [address + start, tl.maximum(size, 0).to(tl.int32), (size > 0).to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


class L2Prefetch:
    """``prefetch()`` asks L2 for every byte of ``tensors`` (contiguous CUDA tensors, each
    rounded down to whole 16-byte units) in one launch on the current stream."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        rows = []
        for t in tensors:
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError(f"L2 prefetch needs contiguous, 16-byte aligned tensors; got "
                                 f"{tuple(t.shape)} {t.dtype} at {t.data_ptr():#x}")  # fmt: skip
            nbytes = t.numel() * t.element_size() // 16 * 16
            if nbytes:
                rows.append((t.data_ptr(), nbytes))
        self.tensors = list(tensors)  # the table holds their addresses
        self.nbytes = sum(n for _, n in rows)
        device = tensors[0].device if tensors else torch.device("cpu")
        self.table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)
        longest = max((n for _, n in rows), default=0)
        self.grid = (len(rows), triton.cdiv(longest, CHUNK * REQUESTS))

    def prefetch(self) -> None:
        if self.nbytes:
            _l2_prefetch_kernel[self.grid](self.table, CHUNK=CHUNK, REQUESTS=REQUESTS,
                                           num_warps=4)  # fmt: skip
