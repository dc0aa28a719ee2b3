"""MLA decode over FP8 (e4m3) pages with both products in e4m3, V^T written by the producer over
each tile in shared memory: the e4m3 kernel for mid-size batches (``paged_decode_split``'s
``E4M3_IN_PLACE_MIN_TOKENS``), where its cheaper consumer wins over ``mla_decode_e4m3.py``'s
(which reads V^T into registers and wins on larger batches).

Stage 1 of the split decode (``paged_decode_split``'s merge is stage 2). Tokens are the MMA's M
(64 a tile, one page of 64), as in ``mla_decode_wgmma.py``, whose producer widened every tile
to fp16 and whose consumer read that tile from shared memory at N = 16 for each product. Here:

- The producer warpgroup copies each raw e4m3 tile into a slot of shared memory (``cp.async``,
  16 bytes a thread and row), up to four tiles ahead. Once the consumer's scores are done with a
  tile, the producer transposes its latent part in place (``V^T``, tokens along each row): FP8
  MMA operands must be K-major, and the output product's K is the tokens. The bytes are
  transposed in registers, 4 tokens by 4 dims at a time with eight byte permutes. In place, a
  slot is one raw tile (36 KB), so five fit where a tile and a separate V^T (68 KB) fit three.
- The consumer warpgroup runs the scores ``K @ [q_hi | q_lo]^T`` and the output
  ``V^T @ [p_hi | p_lo]`` in e4m3, each operand's two parts side by side in one MMA of N = 2 x
  16 (its first part and its rounding residual, so the products are 1.6e-3 accurate where one
  e4m3 part is 3-5e-2): one pass over each tile per product, half the A bytes of the fp16
  tile and a quarter of its MMA instructions per output column. A tile's scores are started
  before the previous tile's output product, which then runs on the tensor cores while the
  tile's softmax runs.

The scales go where the widened kernel puts them: the per-token KV scale to the fp32 scores and
to the probabilities (relative to the tile's largest, lifted by 2^8 so small weights stay
normal in e4m3), q's per-head unit (its largest entry at 448) to the scores.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .mla_decode_e4m3 import (
    NUM_BUF,
    PRODUCER_THREADS,
    _copy_tile,
    _halves_sum,
    _probabilities,
    _q_in_two_parts,
    _slots,
)
from .mla_decode_wgmma import (
    CONSUMER_ONLY,
    PRODUCER_ONLY,
    _as_words,
    _reinterpret,
    _split_range,
    _store_partial,
    _tile_entry,
    _tile_slots,
)


@gluon.jit
def _transpose_4x4(words):
    """Each thread's runs of 4 words (4 consecutive tokens, one word column: 4 dims each) as 4
    words of one dim each (its 4 tokens in order): a 4 x 4 byte transpose, 8 ``prmt``."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 ab0, ab1, cd0, cd1;
        prmt.b32 ab0, $4, $5, 0x5140;
        prmt.b32 ab1, $4, $5, 0x7362;
        prmt.b32 cd0, $6, $7, 0x5140;
        prmt.b32 cd1, $6, $7, 0x7362;
        prmt.b32 $0, ab0, cd0, 0x5410;
        prmt.b32 $1, ab0, cd0, 0x7632;
        prmt.b32 $2, ab1, cd1, 0x5410;
        prmt.b32 $3, ab1, cd1, 0x7632;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r",
        args=[words],
        dtype=gl.int32,
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _transpose_in_place(lat_w, vt_w, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """The raw tile's latent part ``lat_w`` ([BLOCK_N, D / 4] words) as V^T over the same bytes,
    ``vt_w`` ([D, BLOCK_N / 4] words): all of it read before any of it is written."""
    # 16 tokens of one word column a thread, a warp 32 word columns: one row's 128 bytes a
    # warp, conflict-free
    tr_l: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [4, 1], [1, 0])
    t = _transpose_4x4(lat_w.load(tr_l))
    # element [4 g + j, c] holds dim 4 c + j, tokens 4 g .. 4 g + 3
    t = gl.reshape(t, [BLOCK_N // 4, 4, D // 4])
    t = gl.permute(t, (2, 1, 0))
    # (the store waits for every thread's loads: the compiler's barrier between accesses to
    # one buffer, which it cannot tell apart)
    vt_w.store(gl.reshape(t, [D, BLOCK_N // 4]))


@gluon.jit
def _producer(
    KV, indices, row, start, end, stride_kv_slot, k_lat_all, k_rope_all, loaded, scored,
    transposed, empty, PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr, D: gl.constexpr, D_ROPE: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """Copies each raw tile into a free slot ``NUM_BUF - 1`` tiles ahead, and once the
    consumer's scores are done with a tile transposes its latent part in place."""
    tiles = gl.cdiv(end - start, BLOCK_N)
    if ONLY == CONSUMER_ONLY:  # hands the slots over as they are
        for i in range(tiles):
            buf = i % NUM_BUF
            mbarrier.wait(empty.index(buf), (i // NUM_BUF & 1) ^ 1)
            mbarrier.arrive(loaded.index(buf), count=PRODUCER_THREADS)
            mbarrier.wait(scored.index(buf), i // NUM_BUF & 1)
            mbarrier.arrive(transposed.index(buf), count=1)
        return
    lat_w_all = _as_words(k_lat_all, [NUM_BUF, BLOCK_N, D // 4], 128)
    vt_w_all = _as_words(k_lat_all, [NUM_BUF, D, BLOCK_N // 4], 64)
    for first in gl.static_range(NUM_BUF - 1):
        if first < tiles:
            _copy_tile(KV, indices, row, start + first * BLOCK_N, end, stride_kv_slot,
                       k_lat_all.index(first), k_rope_all.index(first), PAGE_SIZE,
                       ENTRIES_PER_PAGE, BLOCK_N, D, D_ROPE)  # fmt: skip
            async_copy.mbarrier_arrive(loaded.index(first), increment_count=False)
    for i in range(tiles):
        buf = i % NUM_BUF
        mbarrier.wait(scored.index(buf), i // NUM_BUF & 1)  # (so it has landed, too)
        _transpose_in_place(lat_w_all.index(buf), vt_w_all.index(buf), BLOCK_N, D)
        fence_async_shared()
        mbarrier.arrive(transposed.index(buf), count=1)
        ahead = i + NUM_BUF - 1
        if ahead < tiles:
            slot = ahead % NUM_BUF
            mbarrier.wait(empty.index(slot), (ahead // NUM_BUF & 1) ^ 1)  # its last tile done
            _copy_tile(KV, indices, row, start + ahead * BLOCK_N, end, stride_kv_slot,
                       k_lat_all.index(slot), k_rope_all.index(slot), PAGE_SIZE,
                       ENTRIES_PER_PAGE, BLOCK_N, D, D_ROPE)  # fmt: skip
            async_copy.mbarrier_arrive(loaded.index(slot), increment_count=False)


@gluon.jit
def _both_halves(v, layout: gl.constexpr):
    """``[v, v]`` in ``layout`` (a slice of the N-wide MMA layout)."""
    H: gl.constexpr = v.shape[0]
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(v, v), (1, 0)), [2 * H]), layout)


@gluon.jit
def _consumer(
    KV_SCALE, indices, row, start, end, stride_s_slot, sm_scale_log2e, q_unit, qq_lat, qq_rope,
    k_lat_all, k_rope_all, p_s, loaded, scored, transposed, empty, part_out, part_lse, b, split,
    hb, num_heads, stride_pb, stride_ph, stride_ps, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, D: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """Each tile's scores (then hands its latent part to the producer to transpose), the
    previous tile's output product (which frees that slot) and this tile's online softmax; then
    the split's partial output and log-sum-exp."""
    wide: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_H, 32]
    )
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
    )
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    head_l: gl.constexpr = gl.SliceLayout(0, mma)
    q_unit = gl.convert_layout(q_unit, head_l)
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, head_l)
    l_rows = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, mma)
    acc = gl.zeros([D, 2 * BLOCK_H], gl.float32, wide)  # o^T over [p_hi | p_lo]
    acc_unit = gl.full([BLOCK_H], 1.0, gl.float32, head_l)
    vt_all = _reinterpret(k_lat_all, gl.float8e4nv, [NUM_BUF, D, BLOCK_N], 64)
    tiles = gl.cdiv(end - start, BLOCK_N)
    if ONLY == PRODUCER_ONLY:  # hands the slots back untouched
        for i in range(tiles):
            buf = i % NUM_BUF
            mbarrier.wait(loaded.index(buf), i // NUM_BUF & 1)
            mbarrier.arrive(scored.index(buf), count=1)
            mbarrier.wait(transposed.index(buf), i // NUM_BUF & 1)
            mbarrier.arrive(empty.index(buf), count=1)
    else:
        n0 = start
        entry = _tile_entry(indices, row, n0, end, tok_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
        slot, mask = _tile_slots(entry, n0, end, tok_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
        scale = gl.load(KV_SCALE + slot * stride_s_slot, mask=mask, other=0.0)
        entry = _tile_entry(indices, row, n0 + BLOCK_N, end, tok_l, PAGE_SIZE,
                            ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
        p_hi_s = p_s.slice(0, BLOCK_H, dim=0).permute((1, 0))
        p_lo_s = p_s.slice(BLOCK_H, BLOCK_H, dim=0).permute((1, 0))
        zeros = gl.zeros([BLOCK_N, 2 * BLOCK_H], gl.float32, wide)
        for i in range(tiles):
            buf = i % NUM_BUF
            prev = (i + NUM_BUF - 1) % NUM_BUF
            mbarrier.wait(loaded.index(buf), i // NUM_BUF & 1)
            fence_async_shared()  # the copies' writes, before the products read them
            scores = warpgroup_mma(k_lat_all.index(buf), qq_lat.permute((1, 0)), zeros,
                                   use_acc=False, is_async=True)  # fmt: skip
            scores = warpgroup_mma(k_rope_all.index(buf), qq_rope.permute((1, 0)), scores,
                                   is_async=True)  # fmt: skip
            if i > 0:  # the previous tile's output product, on the tensor cores during the softmax
                mbarrier.wait(transposed.index(prev), (i - 1) // NUM_BUF & 1)
                pv = warpgroup_mma(vt_all.index(prev), p_s.permute((1, 0)), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=(scores,))
            else:
                pv = warpgroup_mma_init(acc)
                s = warpgroup_mma_wait(0, deps=(scores,))
            mbarrier.arrive(scored.index(buf), count=1)
            slot, next_mask = _tile_slots(entry, n0 + BLOCK_N, end, tok_l, PAGE_SIZE,
                                          ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
            next_scale = gl.load(KV_SCALE + slot * stride_s_slot, mask=next_mask, other=0.0)
            entry = _tile_entry(indices, row, n0 + 2 * BLOCK_N, end, tok_l, PAGE_SIZE,
                                ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
            p, alpha, acc_unit, m_new, l_rows = _probabilities(s, scale, mask, q_unit,
                                                               sm_scale_log2e, m, l_rows,
                                                               acc_unit)  # fmt: skip
            p_hi = p.to(gl.float8e4nv)
            # the previous product done: its slot, p's buffer and the accumulator are free
            acc = warpgroup_mma_wait(0, deps=(pv,))
            mbarrier.arrive(empty.index(prev), count=1, pred=i > 0)
            acc = acc * _both_halves(alpha, gl.SliceLayout(0, wide))[None, :]
            p_hi_s.store(p_hi)
            p_lo_s.store((p - p_hi.to(gl.float32)).to(gl.float8e4nv))
            fence_async_shared()
            m = m_new
            scale, mask = next_scale, next_mask
            n0 += BLOCK_N
        if tiles > 0:  # the last tile's output product
            last = (tiles - 1) % NUM_BUF
            mbarrier.wait(transposed.index(last), (tiles - 1) // NUM_BUF & 1)
            acc = warpgroup_mma(vt_all.index(last), p_s.permute((1, 0)), acc)
    _store_partial(_halves_sum(acc, mma), acc_unit, m, gl.sum(l_rows, axis=0), part_out,
                   part_lse, b, split, hb, num_heads, stride_pb, stride_ph, stride_ps,
                   gl.arange(0, D, layout=gl.SliceLayout(1, mma)), BLOCK_H, mma, mma)  # fmt: skip
    # (stored from the MMA's layout, 8 dims a 32-byte sector: a coalescing conversion would
    # need 16 KB of scratch, which shared memory does not have)


@gluon.jit
def mla_fp8_e4m3_inplace_kernel(
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
    """Stage 1: the producer warpgroup copies raw tiles and writes their V^T, the consumer
    warpgroup (the kernel's 4 warps) runs both e4m3 products and the softmax. ``ONLY``, for
    measuring: ``PRODUCER_ONLY`` or ``CONSUMER_ONLY`` runs that side's work alone."""
    gl.static_assert(BLOCK_N == 64, "one warpgroup's MMA has M = 64")
    pid = gl.program_id(0)
    split = gl.program_id(1)
    hb = pid % head_blocks
    b = pid // head_blocks

    row, start, end = _split_range(seq_lens, indptr, b, split, num_splits, fixed_split_len,
                                   LENS_ARE_ENDS, BLOCK_N, BALANCED)  # fmt: skip
    q_unit, qq_lat, qq_rope = _q_in_two_parts(Q, b, hb, num_heads, stride_qb, stride_qh, D,
                                              D_ROPE, BLOCK_H)  # fmt: skip

    k_lat_all, k_rope_all, p_s = _slots(BLOCK_N, BLOCK_H, D, D_ROPE)
    # a slot's round: loaded (its copies landed, every producer thread's), scored (the consumer's
    # scores done with it), transposed (V^T written over it), empty (the output product done)
    loaded = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    scored = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    transposed = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(loaded.index(i), count=PRODUCER_THREADS)
        mbarrier.init(scored.index(i), count=1)
        mbarrier.init(transposed.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # q's stores, before the products read it

    gl.warp_specialize(
        [
            (_consumer, (KV_SCALE, indices, row, start, end, stride_s_slot, sm_scale_log2e,
                         q_unit, qq_lat, qq_rope, k_lat_all, k_rope_all, p_s, loaded, scored,
                         transposed, empty, part_out, part_lse, b, split, hb, num_heads,
                         stride_pb, stride_ph, stride_ps, PAGE_SIZE, ENTRIES_PER_PAGE, D,
                         BLOCK_H, BLOCK_N, ONLY)),
            (_producer, (KV, indices, row, start, end, stride_kv_slot, k_lat_all, k_rope_all,
                         loaded, scored, transposed, empty, PAGE_SIZE, ENTRIES_PER_PAGE,
                         BLOCK_N, D, D_ROPE, ONLY)),
        ],
        [4],
        [128],  # the producer holds a whole tile's words while transposing it
    )  # fmt: skip
