"""The stream schedule of the Gluon MLA decode kernels: every request's tiles back to back in one
stream, and each of a fixed number of persistent programs takes an equal run of it, crossing
requests where its run does.

With one program per SM and mixed lengths, one program per (request, split) leaves the GPU
waiting on the requests that got the most splits last; a run of the stream per program makes
every program's work equal to a tile. A request whose tiles all fall in one program's run is
finished there (its output written); a request cut by a run's edge leaves one partial output a
cut piece, in one of two slots of the program that ran it: slot 0 for a piece that began in an
earlier program's run, slot 1 for the piece that begins the request. The merge
(``paged_decode_split._stream_merge_kernel``) finds the same pieces from the lengths alone.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.jit import constexpr_function


@constexpr_function
def _batch_layout(WARPS):
    """The batch's lengths, one thread each, over the ``WARPS`` warps that read them (4 in both
    partitions of the warp-specialized kernels, 8 in the heads-as-M one)."""
    return gl.BlockedLayout([1], [32], [WARPS], [0])


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def stream_ends(
    seq_lens, indptr, batch, LENS_ARE_ENDS: gl.constexpr, BLOCK_N: gl.constexpr,
    BATCH_P2: gl.constexpr, WARPS: gl.constexpr,
):  # fmt: skip
    """Each request's end in the stream, in tiles, in shared memory, and the stream's length.
    Called before the kernel splits into partitions, which then read the ends."""
    idx = gl.arange(0, BATCH_P2, layout=_batch_layout(WARPS))
    valid = idx < batch
    lens = gl.load(seq_lens + idx, mask=valid, other=0).to(gl.int32)
    if LENS_ARE_ENDS:
        lens -= gl.load(indptr + idx, mask=valid, other=0).to(gl.int32)
    tiles = (lens + BLOCK_N - 1) // BLOCK_N
    ends = gl.associative_scan(tiles, 0, _add)
    ends_s = gl.allocate_shared_memory(
        gl.int32, [BATCH_P2], gl.SwizzledSharedLayout(1, 1, 1, [0]), ends
    )
    return ends_s, gl.sum(tiles, axis=0)


@gluon.jit
def stream_run(total, programs, program):
    """``program``'s run ``[lo, hi)`` of a stream of ``total`` tiles."""
    per_program = gl.cdiv(total, programs)
    lo = gl.minimum(program * per_program, total)
    return lo, gl.minimum(lo + per_program, total)


@gluon.jit
def stream_piece(
    ends_s, t, hi, seq_lens, indptr, LENS_ARE_ENDS: gl.constexpr, BLOCK_N: gl.constexpr,
    BATCH_P2: gl.constexpr, WARPS: gl.constexpr,
):  # fmt: skip
    """The piece of a run that starts at stream tile ``t`` and ends at ``hi`` or its request's
    end: (request, its first table entry, the piece's token range ``[start, end)``, the
    request's first and end tiles in the stream)."""
    ends = ends_s.load(_batch_layout(WARPS))
    idx = gl.arange(0, BATCH_P2, layout=_batch_layout(WARPS))
    b = gl.sum((ends <= t).to(gl.int32), axis=0)  # requests ending by t (the empty ones too)
    last = gl.sum(gl.where(idx == b, ends, 0), axis=0)
    first = gl.sum(gl.where(idx == b - 1, ends, 0), axis=0)
    row = gl.load(indptr + b).to(gl.int64)
    seq_len = gl.load(seq_lens + b).to(gl.int64)
    if LENS_ARE_ENDS:
        seq_len -= row
    start = (t - first) * BLOCK_N
    end = gl.minimum((gl.minimum(last, hi) - first) * BLOCK_N, seq_len.to(gl.int32))
    return b, row, start, end, first, last


@gluon.jit
def store_output(
    acc, acc_unit, l, out, b, hb, num_heads, stride_ob, stride_oh, dims,
    BLOCK_H: gl.constexpr, out_l: gl.constexpr,
):  # fmt: skip
    """A whole request's output (``acc`` is o^T over ``acc_unit`` in ``out_l``; row r holds
    dim ``dims[r]``), in ``out``'s dtype."""
    o = acc * (acc_unit / l)[None, :]
    ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, out_l))
    dst = out + b * stride_ob + ho[None, :] * stride_oh + dims[:, None]
    gl.store(dst, o.to(out.dtype.element_ty), mask=(ho < num_heads)[None, :])
