"""MLA decode over FP8 (e4m3) pages on Hopper's warpgroup MMA, warp-specialized, in Gluon.

Stage 1 of the split decode (``paged_decode_split``'s merge is stage 2), the same math as the
Triton kernels: tokens are the MMA's M (64 a tile, one page of 64), the 8-16 query heads its N,
so no head is padded. What Triton's ``tl.dot`` could not be made to do, and Gluon states:

- A producer warpgroup loads each e4m3 tile from global memory straight into registers (as
  32-bit words, 16 bytes a thread and row; the next tile's loads are in flight while this one
  is widened), widens it to fp16 (one ``cvt`` per two values) and stores it once into one of
  two swizzled shared-memory buffers, then marks the buffer full (an mbarrier).
- The consumer warpgroup (the kernel's 4 warps) reads that one tile for both products: the
  scores as ``K @ q^T`` (the tile is the K-major A operand) and the output as ``V^T @ p``
  (the tile's first ``D`` columns, transposed by the MMA's descriptor, which 16-bit operands
  allow), runs the online softmax between them, and marks the buffer empty once the output
  product is done. The Triton kernel staged the e4m3 bytes through shared memory, widened them
  in registers and wrote them back, and (tokens as M) transposed V in registers.

The per-token scales go to the fp32 scores and the probabilities, never to the tile. 186 KB of
shared memory: one program an SM. Needs sm_90 and a compiled run: Gluon has no interpreter,
so the launcher runs the Triton kernel under the interpreter and off Hopper. Runs on the GPU
image's Triton 3.6; compiles with 3.9 too (Gluon's API moves between releases: ``_as_words``
takes the shared-memory view by either name).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .decode_split_range import split_range

_split_range = gluon.jit(split_range.fn)  # the Triton function, compiled as Gluon
# Triton 3.9 renamed shared_memory_descriptor._reinterpret (3.6, the GPU image's) to reinterpret
_NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
# the kernel's ONLY, for measuring each side's time alone: the other side hands buffers over
PRODUCER_ONLY = gl.constexpr(1)
# the split's partial output [D, heads] in registers for coalesced stores: dims fastest
OUT_DIMS_FASTEST = gl.constexpr(gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1]))
CONSUMER_ONLY = gl.constexpr(2)


@gluon.jit
def _reinterpret(buffers, dtype: gl.constexpr, shape: gl.constexpr, swizzle: gl.constexpr):
    """``buffers``' bytes as ``dtype`` values in ``shape``, with a ``swizzle``-byte swizzle."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle, dtype.primitive_bitwidth)
    if _NEW_REINTERPRET:
        view = buffers.reinterpret(dtype, shape, layout)
    else:
        view = buffers._reinterpret(dtype, shape, layout)
    return view


@gluon.jit
def _as_words(buffers, shape: gl.constexpr, swizzle: gl.constexpr):
    """fp16 or e4m3 buffers as 32-bit words of two or four values: the same bytes, the same
    ``swizzle``-byte swizzle."""
    return _reinterpret(buffers, gl.int32, shape, swizzle)


@gluon.jit
def _load_q(
    Q, b, hb, num_heads, stride_qb, stride_qh, D: gl.constexpr, D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr, q_l: gl.constexpr, qr_l: gl.constexpr,
):  # fmt: skip
    """The program's query heads: the latent part in ``q_l``, the rope part in ``qr_l``, 0 in
    heads past ``num_heads``."""
    hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    q_lat = gl.load(
        Q + b * stride_qb + hq[:, None] * stride_qh
        + gl.arange(0, D, layout=gl.SliceLayout(0, q_l))[None, :],
        mask=(hq < num_heads)[:, None], other=0.0,
    )  # fmt: skip
    hr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, qr_l))
    q_rope = gl.load(
        Q + b * stride_qb + hr[:, None] * stride_qh + D
        + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, qr_l))[None, :],
        mask=(hr < num_heads)[:, None], other=0.0,
    )  # fmt: skip
    return q_lat, q_rope


@gluon.jit
def _tile_entry(
    indices, row, n0, end, layout: gl.constexpr, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """The page-table entries of tokens ``n0 .. n0 + BLOCK_N`` (in ``layout``), 0 past ``end``:
    one scalar when a page holds the tile (tiles start at multiples of ``BLOCK_N``). Both sides
    load them a tile before the loads they address, which then wait for no table load."""
    if BLOCK_N <= PAGE_SIZE:
        entry = gl.load(indices + row + (n0 // PAGE_SIZE) * ENTRIES_PER_PAGE, mask=n0 < end,
                        other=0)  # fmt: skip
    else:
        offs = n0 + gl.arange(0, BLOCK_N, layout=layout)
        entry = gl.load(indices + row + (offs // PAGE_SIZE) * ENTRIES_PER_PAGE, mask=offs < end,
                        other=0)  # fmt: skip
    return entry


@gluon.jit
def _tile_slots(
    entry, n0, end, layout: gl.constexpr, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """The cache slots of tokens ``n0 .. n0 + BLOCK_N`` (in ``layout``) from their page-table
    ``entry`` (``_tile_entry``), and which are ``< end``."""
    offs = n0 + gl.arange(0, BLOCK_N, layout=layout)
    page = entry.to(gl.int64) // ENTRIES_PER_PAGE
    return page * PAGE_SIZE + offs % PAGE_SIZE, offs < end


@gluon.jit
def _load_words(rows, mask, first: gl.constexpr, WORDS: gl.constexpr, layout: gl.constexpr):
    """Words ``first .. first + WORDS`` of each row, 0 in rows past the end."""
    return gl.load(rows + first + gl.arange(0, WORDS, layout=gl.SliceLayout(0, layout))[None, :],
                   mask=mask, other=0)  # fmt: skip


@gluon.jit
def _load_tile(
    KV32, entry, n0, end, stride_kv_word, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
    D_ROPE: gl.constexpr, layout: gl.constexpr,
):  # fmt: skip
    """The tile's e4m3 bytes as 32-bit words (four values each, so the registers that carry
    the next tile through this tile's products hold four values apiece), 0 past ``end``: the
    latent dims in four quarters ``[BLOCK_N, D / 16]`` (each widened and stored alone) and the
    rope dims ``[BLOCK_N, D_ROPE / 4]``. ``entry``: the tile's page-table entries."""
    WQ: gl.constexpr = D // 16
    slot, mask = _tile_slots(entry, n0, end, gl.SliceLayout(1, layout), PAGE_SIZE,
                             ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
    rows = KV32 + slot[:, None] * stride_kv_word
    mask = mask[:, None]
    k0 = _load_words(rows, mask, 0, WQ, layout)
    k1 = _load_words(rows, mask, WQ, WQ, layout)
    k2 = _load_words(rows, mask, 2 * WQ, WQ, layout)
    k3 = _load_words(rows, mask, 3 * WQ, WQ, layout)
    kr = _load_words(rows, mask, D // 4, D_ROPE // 4, layout)
    return k0, k1, k2, k3, kr


@gluon.jit
def _widen(words):
    """Words of four e4m3 values -> words of two fp16 values, twice as many: one ``cvt`` per
    two values, on the word's halves (no byte shuffles)."""
    lo, hi = gl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r",
        args=[words],
        dtype=(gl.int32, gl.int32),
        is_pure=True,
        pack=1,
    )
    pairs = gl.join(lo, hi)
    return gl.reshape(pairs, [pairs.shape[0], 2 * pairs.shape[1]])


@gluon.jit
def _producer(
    KV32, indices, row, start, end, stride_kv_word, k_lat_w_all, k_rope_w_all, full, empty,
    PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
    D: gl.constexpr, D_ROPE: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """Loads each e4m3 tile (the next one in flight while this one is widened), widens it into
    the free buffer and marks it full. ``ONLY == CONSUMER_ONLY``: hands the buffers over as they
    are (the consumer's time alone)."""
    if ONLY == CONSUMER_ONLY:
        for i in range(gl.cdiv(end - start, BLOCK_N)):
            mbarrier.wait(empty.index(i % 2), (i // 2 & 1) ^ 1)
            mbarrier.arrive(full.index(i % 2), count=1)
    else:
        WQ2: gl.constexpr = D // 8
        # 16 e4m3 bytes (4 words) a thread, 4 threads a 64-byte piece of a row, 8 rows a warp.
        # A 16-byte shared store serves 8 lanes at a time; here they span two rows, whose
        # swizzles differ, so the 8 hit 8 different bank groups. With one row per 8 lanes (the
        # latent had [4, 8] threads), the two 128-byte column blocks of a quarter row met in the
        # same banks: 7.5 wavefronts a store instead of 4 (ncu).
        words_l: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows_l: gl.constexpr = gl.SliceLayout(1, words_l)
        entry = _tile_entry(indices, row, start, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE,
                            BLOCK_N)  # fmt: skip
        k0, k1, k2, k3, kr = _load_tile(KV32, entry, start, end, stride_kv_word, PAGE_SIZE,
                                        ENTRIES_PER_PAGE, BLOCK_N, D, D_ROPE, words_l)
        entry = _tile_entry(indices, row, start + BLOCK_N, end, rows_l, PAGE_SIZE,
                            ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
        for i in range(gl.cdiv(end - start, BLOCK_N)):
            buf = i % 2
            # tile i + 2's entries, and tile i + 1's words from the entries loaded a tile ago
            n = start + (i + 2) * BLOCK_N
            next_entry = _tile_entry(indices, row, n, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE,
                                     BLOCK_N)  # fmt: skip
            n0, n1, n2, n3, nr = _load_tile(KV32, entry, n - BLOCK_N, end, stride_kv_word,
                                            PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N, D, D_ROPE,
                                            words_l)  # fmt: skip
            mbarrier.wait(empty.index(buf), (i // 2 & 1) ^ 1)  # tile i - 2's products done
            k_lat_w = k_lat_w_all.index(buf)
            k_lat_w.slice(0, WQ2, dim=1).store(_widen(k0))
            k_lat_w.slice(WQ2, WQ2, dim=1).store(_widen(k1))
            k_lat_w.slice(2 * WQ2, WQ2, dim=1).store(_widen(k2))
            k_lat_w.slice(3 * WQ2, WQ2, dim=1).store(_widen(k3))
            k_rope_w_all.index(buf).store(_widen(kr))
            fence_async_shared()
            mbarrier.arrive(full.index(buf), count=1)
            k0, k1, k2, k3, kr = n0, n1, n2, n3, nr
            entry = next_entry


@gluon.jit
def _max_pair(a, b, c, d):
    return gl.maximum(a, c), gl.maximum(b, d)


@gluon.jit
def _softmax_step(s, scale, mask, sm_scale_log2e, m, l_rows, acc_unit, V_LIFT: gl.constexpr):
    """A tile's online softmax over its raw scores ``s`` (tokens as rows, in the MMA layout of
    ``l_rows``), each token's KV ``scale`` folded into its score and into p, which is relative
    to the tile's largest V scale divided by ``V_LIFT``: (p, the factor that re-bases the
    output, the output's new unit, the running max, the row sums)."""
    s = s * (scale * sm_scale_log2e)[:, None]
    s = gl.where(mask[:, None], s, float("-inf"))
    # one pass across the warps for both maxima (the scores' and the V scales'); the row sums
    # stay per thread until the end (three reductions a tile were 1.14x the time)
    s_top, v_top = gl.reduce((s, gl.broadcast(scale[:, None], s)[0]), 0, _max_pair)
    m_new = gl.maximum(m, s_top)
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_rows = l_rows * alpha[None, :] + p
    v_top = gl.maximum(v_top, 1e-30)
    if V_LIFT != 1.0:
        v_top = v_top / V_LIFT
    p = p * scale[:, None] / v_top[None, :]
    alpha = alpha * (acc_unit / v_top)
    return p, alpha, v_top, m_new, l_rows


@gluon.jit
def _consumer(
    KV_SCALE, indices, row, start, end, stride_s_slot, sm_scale_log2e, q_lat_s, q_rope_s,
    k_lat_all, k_rope_all, p_all, full, empty, part_out, part_lse, b, split, hb, num_heads,
    stride_pb, stride_ph, stride_ps, PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr,
    D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """The products and the online softmax of each full buffer, which it frees as soon as the
    tile's output product is done; then the split's partial output and log-sum-exp. ``ONLY ==
    PRODUCER_ONLY``: hands the buffers back untouched (the producer's time alone)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
    )
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    head_l: gl.constexpr = gl.SliceLayout(0, mma)
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, head_l)
    l_rows = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, mma)  # the softmax's sums, rows unsummed
    acc = gl.zeros([D, BLOCK_H], gl.float32, mma)  # o^T
    # acc holds the output divided by the last tile's largest V scale
    acc_unit = gl.full([BLOCK_H], 1.0, gl.float32, head_l)
    n0 = start
    entry = _tile_entry(indices, row, n0, end, tok_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    slot, mask = _tile_slots(entry, n0, end, tok_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    scale = gl.load(KV_SCALE + slot * stride_s_slot, mask=mask, other=0.0)
    entry = _tile_entry(indices, row, n0 + BLOCK_N, end, tok_l, PAGE_SIZE, ENTRIES_PER_PAGE,
                        BLOCK_N)  # fmt: skip
    for i in range(gl.cdiv(end - start, BLOCK_N)):
        buf = i % 2
        mbarrier.wait(full.index(buf), i // 2 & 1)
        if ONLY != PRODUCER_ONLY:
            k_lat_s = k_lat_all.index(buf)
            s = warpgroup_mma(k_lat_s, q_lat_s.permute((1, 0)),
                              gl.zeros([BLOCK_N, BLOCK_H], gl.float32, mma), use_acc=False,
                              is_async=True)  # fmt: skip
            s = warpgroup_mma(k_rope_all.index(buf), q_rope_s.permute((1, 0)), s, is_async=True)
            # the next tile's scales (from its entries, loaded a tile ago) and the entries of
            # the one after, in flight through this tile's softmax
            slot, next_mask = _tile_slots(entry, n0 + BLOCK_N, end, tok_l, PAGE_SIZE,
                                          ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
            next_scale = gl.load(KV_SCALE + slot * stride_s_slot, mask=next_mask, other=0.0)
            entry = _tile_entry(indices, row, n0 + 2 * BLOCK_N, end, tok_l, PAGE_SIZE,
                                ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
            s = warpgroup_mma_wait(0, deps=(s,))
            # V scales go into p relative to the tile's largest; the accumulator is re-based on
            # it
            p, alpha, acc_unit, m_new, l_rows = _softmax_step(s, scale, mask, sm_scale_log2e, m,
                                                              l_rows, acc_unit, 1.0)  # fmt: skip
            p_s = p_all.index(buf)
            p_s.store(p.to(gl.float16))
            fence_async_shared()
            acc = warpgroup_mma(k_lat_s.permute((1, 0)), p_s, acc * alpha[None, :], is_async=True)
            # the buffer goes back at once (with it kept until the next tile's scores were done,
            # the producer waited for it: 1.06x the time)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            m = m_new
            scale, mask = next_scale, next_mask
        mbarrier.arrive(empty.index(buf), count=1)
        n0 += BLOCK_N
    dims = gl.arange(0, D, layout=gl.SliceLayout(1, OUT_DIMS_FASTEST))
    _store_partial(acc, acc_unit, m, gl.sum(l_rows, axis=0), part_out, part_lse, b, split, hb,
                   num_heads, stride_pb, stride_ph, stride_ps, dims, BLOCK_H, mma,
                   OUT_DIMS_FASTEST)  # fmt: skip


@gluon.jit
def _store_partial(
    acc, acc_unit, m, l, part_out, part_lse, b, split, hb, num_heads, stride_pb, stride_ph,
    stride_ps, dims, BLOCK_H: gl.constexpr, mma: gl.constexpr, out_l: gl.constexpr,
):  # fmt: skip
    """The split's output (``acc`` is o^T over ``acc_unit``, stored from ``out_l``; row r
    holds dim ``dims[r]``) and log-sum-exp per head."""
    empty = l == 0.0  # a split past the request's end
    l = gl.where(empty, 1.0, l)
    lse = gl.where(empty, float("-inf"), m + gl.log2(l))
    out = gl.convert_layout(acc * (acc_unit / l)[None, :], out_l)
    ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, out_l))
    part = part_out + b * stride_pb + split * stride_ps + ho[None, :] * stride_ph
    # a split past the request's end stores only its log-sum-exp (the merge reads that first)
    written = (ho < num_heads) & gl.convert_layout(~empty, gl.SliceLayout(0, out_l))
    gl.store(part + dims[:, None], out, mask=written[None, :])
    hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, mma))
    lse_at = (b * stride_pb + hl * stride_ph) // dims.shape[0] + split
    gl.store(part_lse + lse_at, lse, mask=hl < num_heads)


@gluon.jit
def mla_fp8_wgmma_kernel(
    Q,
    KV,
    KV_SCALE,
    seq_lens,
    indptr,
    indices,
    part_out,
    part_lse,
    sm_scale_log2e,
    num_splits,
    fixed_split_len,
    head_blocks,
    num_heads,
    stride_qb,
    stride_qh,
    stride_kv_slot,
    stride_s_slot,
    stride_pb,
    stride_ph,
    stride_ps,
    PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr,
    LENS_ARE_ENDS: gl.constexpr,
    BALANCED: gl.constexpr,
    D: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    ONLY: gl.constexpr = 0,
):
    """Stage 1: the producer warpgroup loads and widens tiles into two buffers, the consumer
    warpgroup (the kernel's 4 warps) runs the products and the softmax. ``ONLY``, for
    measuring: ``PRODUCER_ONLY`` or ``CONSUMER_ONLY`` runs that side's work alone."""
    gl.static_assert(BLOCK_N == 64, "one warpgroup's MMA has M = 64")
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    qr_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    pid = gl.program_id(0)
    split = gl.program_id(1)
    hb = pid % head_blocks
    b = pid // head_blocks

    row, start, end = _split_range(seq_lens, indptr, b, split, num_splits, fixed_split_len,
                                   LENS_ARE_ENDS, BLOCK_N, BALANCED)  # fmt: skip

    q_lat, q_rope = _load_q(Q, b, hb, num_heads, stride_qb, stride_qh, D, D_ROPE, BLOCK_H, q_l,
                            qr_l)  # fmt: skip
    q_lat_s = gl.allocate_shared_memory(
        gl.float16, [BLOCK_H, D], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.float16),
        q_lat.to(gl.float16),
    )  # fmt: skip
    q_rope_s = gl.allocate_shared_memory(
        gl.float16, [BLOCK_H, D_ROPE],
        gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], gl.float16), q_rope.to(gl.float16),
    )  # fmt: skip
    k_lat_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float16)
    k_rope_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], gl.float16)
    k_lat_all = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, D], k_lat_l)
    k_rope_all = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, D_ROPE], k_rope_l)
    p_all = gl.allocate_shared_memory(
        gl.float16, [2, BLOCK_N, BLOCK_H],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.float16),
    )  # fmt: skip
    # the producer writes the fp16 tiles as 32-bit words of two values
    k_lat_w_all = _as_words(k_lat_all, [2, BLOCK_N, D // 2], 128)
    k_rope_w_all = _as_words(k_rope_all, [2, BLOCK_N, D_ROPE // 2], 128)
    # full[i]: the producer filled buffer i; empty[i]: the consumer's output product is done
    # with it (the producer's first wait on each passes: a new mbarrier's previous phase counts
    # as complete)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # q's stores, before the products read it

    KV32 = KV.to(gl.pointer_type(gl.int32), bitcast=True)
    gl.warp_specialize(
        [
            (_consumer, (KV_SCALE, indices, row, start, end, stride_s_slot, sm_scale_log2e,
                         q_lat_s, q_rope_s, k_lat_all, k_rope_all, p_all, full, empty, part_out,
                         part_lse, b, split, hb, num_heads, stride_pb, stride_ph, stride_ps,
                         PAGE_SIZE, ENTRIES_PER_PAGE, D, BLOCK_H, BLOCK_N, ONLY)),
            (_producer, (KV32, indices, row, start, end, stride_kv_slot // 4, k_lat_w_all,
                         k_rope_w_all, full, empty, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N, D,
                         D_ROPE, ONLY)),
        ],
        [4],
        [240],  # the producer's registers a thread: two tiles of words and their widening
    )  # fmt: skip
