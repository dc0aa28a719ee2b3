"""The token range of one split of one request, shared by the split decode kernels (the Triton
ones in ``paged_decode_split`` and, wrapped with ``gluon.jit``, the Gluon one in
``mla_decode_wgmma``)."""

import triton
import triton.language as tl


@triton.jit
def split_range(
    seq_lens, indptr, b, split, num_splits, fixed_split_len,
    LENS_ARE_ENDS: tl.constexpr, BLOCK_N: tl.constexpr, BALANCED: tl.constexpr,
):  # fmt: skip
    """Request ``b``'s first table entry and the token range ``[start, end)`` of its ``split``:
    ``fixed_split_len`` tokens (``BALANCED``, the balanced plan) or the request's length in
    ``num_splits`` equal parts of whole tiles; the last split takes the rest, so a short
    ``max_seq_len`` drops no tokens.

    ``BALANCED`` is a compile-time choice: choosing at run time (``fixed_split_len > 0``) made
    ptxas give the FP8 GQA kernel 181 registers instead of 148 for the same loop (2 programs
    per SM instead of 3), 9-20% slower on the H200."""
    row = tl.load(indptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens + b).to(tl.int64)
    if LENS_ARE_ENDS:
        seq_len -= row
    seq_len = seq_len.to(tl.int32)
    if BALANCED:
        split_len = fixed_split_len
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = tl.multiple_of(split * split_len, BLOCK_N)  # both plans give whole tiles
    end = tl.minimum(start + split_len, seq_len)
    if split == num_splits - 1:
        end = seq_len
    return row, start, end
