"""MLA decode for 64 query heads a program on Hopper's warpgroup MMA, in Gluon, with the two
consumer warpgroups on alternate tiles (ping-pong) and a producer warpgroup for the loads.

Stage 1 of the split decode, the same math and arguments as ``mla_decode_heads.py`` (heads as
the MMA's M, 64-token tiles, BF16 or FP8 pages with per-token scales). That kernel runs each
tile's scores, softmax and output product in series on both warpgroups, so the tensor cores
wait through every softmax, and each warpgroup reads all of the query for half the tile's
tokens. Here:

- warpgroup ``W`` (0 or 1) computes the scores of every other tile (``t % 2 == W``, at N = 64:
  the query is read once a tile), its softmax, and publishes the running maximum (and FP8's
  largest V scale) and the probabilities, which it writes over the tile's rope columns (dead
  once its scores are done: shared memory stays at the query and two tiles);
- each warpgroup owns 256 of the 512 output columns and runs both tiles' output products on
  them: its own tile's from registers, the other's from shared memory, rescaled by the other's
  published maximum. While one warpgroup is in its softmax, the other's products run;
- the producer warpgroup fills the two tile buffers (BF16 by ``cp.async``; FP8 loaded into
  registers a quarter at a time, widened to fp16 and stored), the buffer of tile ``t`` to be
  refilled once both warpgroups' output products of tile ``t`` are done.

mbarriers: ``full[b]`` (producer -> both), ``empty[b]`` (both -> producer, count 2),
``stats[b]`` (tile owner -> the other), ``done`` (the row sums' exchange at the end). The
softmax's maximum is a chain across the warpgroups (tile ``t``'s needs tile ``t - 1``'s), so
each warpgroup takes the other's tile before its own softmax. Needs sm_90 and a compiled run.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .mla_decode_heads import _copy_tile
from .mla_decode_wgmma import (
    _as_words,
    _load_words,
    _max_pair,
    _split_range,
    _tile_entry,
    _tile_slots,
    _widen,
)

BLOCK_H = gl.constexpr(64)  # heads a program: one warpgroup MMA's M
BLOCK_N = gl.constexpr(64)  # tokens a tile
HALF = gl.constexpr(256)  # output columns a warpgroup
# registers a thread: warpgroup 1; the producer (BF16: it only issues cp.async; FP8: it holds a
# tile's quarters of words in flight)
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
PRODUCER_REGS_FP8 = gl.constexpr(64)


@gluon.jit
def _producer(
    KV, indices, row, start, end, stride_kv_slot, k_lat_all, k_rope_all, full, empty,
    PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr, FP8: gl.constexpr,
    D: gl.constexpr, D_ROPE: gl.constexpr,
):  # fmt: skip
    """Fills buffer ``t % 2`` with tile ``t`` once both warpgroups are done with tile
    ``t - 2``, then marks it full."""
    tiles = gl.cdiv(end - start, BLOCK_N)
    if FP8:
        WQ: gl.constexpr = D // 16  # a quarter of the latent, in words of four e4m3 values
        words_l: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows_l: gl.constexpr = gl.SliceLayout(1, words_l)
        KV32 = KV.to(gl.pointer_type(gl.int32), bitcast=True)
        stride_w = stride_kv_slot // 4
        k_lat_w_all = _as_words(k_lat_all, [2, BLOCK_N, D // 2])
        k_rope_w_all = _as_words(k_rope_all, [2, BLOCK_N, D_ROPE // 2])
        entry = _tile_entry(indices, row, start, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE,
                            BLOCK_N)  # fmt: skip
        slot, mask = _tile_slots(entry, start, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
        rows = KV32 + slot[:, None] * stride_w
        mask = mask[:, None]
        q0 = _load_words(rows, mask, 0, WQ, words_l)
        q1 = _load_words(rows, mask, WQ, WQ, words_l)
        for t in range(tiles):
            buf = t % 2
            n0 = start + t * BLOCK_N
            q2 = _load_words(rows, mask, 2 * WQ, WQ, words_l)
            # the next tile's entries, in flight through this one's stores
            entry = _tile_entry(indices, row, n0 + BLOCK_N, end, rows_l, PAGE_SIZE,
                                ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
            mbarrier.wait(empty.index(buf), (t // 2 & 1) ^ 1)  # tile t - 2 done by both
            lat = k_lat_w_all.index(buf)
            lat.slice(0, WQ * 2, dim=1).store(_widen(q0))
            q3 = _load_words(rows, mask, 3 * WQ, WQ, words_l)
            lat.slice(WQ * 2, WQ * 2, dim=1).store(_widen(q1))
            rope = _load_words(rows, mask, D // 4, D_ROPE // 4, words_l)
            lat.slice(WQ * 4, WQ * 2, dim=1).store(_widen(q2))
            # the next tile's first half, in flight through this one's last stores
            slot, mask = _tile_slots(entry, n0 + BLOCK_N, end, rows_l, PAGE_SIZE,
                                     ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
            next_rows = KV32 + slot[:, None] * stride_w
            mask = mask[:, None]
            q0 = _load_words(next_rows, mask, 0, WQ, words_l)
            lat.slice(WQ * 6, WQ * 2, dim=1).store(_widen(q3))
            q1 = _load_words(next_rows, mask, WQ, WQ, words_l)
            k_rope_w_all.index(buf).store(_widen(rope))
            rows = next_rows
            fence_async_shared()
            mbarrier.arrive(full.index(buf), count=1)
    else:
        for t in range(tiles):
            buf = t % 2
            mbarrier.wait(empty.index(buf), (t // 2 & 1) ^ 1)
            _copy_tile(KV, k_lat_all.index(buf), k_rope_all.index(buf), indices, row,
                       start + t * BLOCK_N, end, stride_kv_slot, PAGE_SIZE, ENTRIES_PER_PAGE, D,
                       D_ROPE, 4)  # fmt: skip
            async_copy.wait_group(0)
            fence_async_shared()
            mbarrier.arrive(full.index(buf), count=1)


@gluon.jit
def _scores(q_lat_s, q_rope_s, k_lat_s, k_rope_s, mma_s: gl.constexpr):
    s = warpgroup_mma(q_lat_s, k_lat_s.permute((1, 0)),
                      gl.zeros([BLOCK_H, BLOCK_N], gl.float32, mma_s), use_acc=False,
                      is_async=True)  # fmt: skip
    return warpgroup_mma(q_rope_s, k_rope_s.permute((1, 0)), s, is_async=True)


@gluon.jit
def _tile_scales(
    KV_SCALE, indices, row, n0, end, stride_s_slot, layout: gl.constexpr,
    PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr,
):  # fmt: skip
    """The tile's per-token FP8 scales (0 past ``end``) and which tokens are ``< end``."""
    entry = _tile_entry(indices, row, n0, end, layout, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    slot, mask = _tile_slots(entry, n0, end, layout, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    return gl.load(KV_SCALE + slot * stride_s_slot, mask=mask, other=0.0), mask


@gluon.jit
def _take_other(
    acc, m, l, unit, t, stats, stats_m, stats_v, k_lat_all, k_rope_all, W: gl.constexpr,
    FP8: gl.constexpr, head_s: gl.constexpr, head_o: gl.constexpr,
):  # fmt: skip
    """The other warpgroup's tile ``t`` (buffer ``1 - W``): rescale to its published maximum
    and issue its output product on this warpgroup's columns (p from shared memory)."""
    mbarrier.wait(stats.index(1 - W), t // 2 & 1)
    m_t = stats_m.index(1 - W).load(head_s)
    alpha = gl.exp2(m - m_t)
    l = l * alpha
    if FP8:
        v_t = stats_v.index(1 - W).load(head_s)
        alpha = alpha * (unit / v_t)
        unit = v_t
    v_s = k_lat_all.index(1 - W).slice(W * HALF, HALF, dim=1)
    acc = warpgroup_mma(k_rope_all.index(1 - W), v_s,
                        acc * gl.convert_layout(alpha, head_o)[:, None], is_async=True)
    return acc, m_t, l, unit


@gluon.jit
def _own_softmax(
    s, m, l, unit, scale, mask, sm_scale_log2e, buf, stats, stats_m, stats_v, k_rope_all,
    FP8: gl.constexpr, dt: gl.constexpr,
):  # fmt: skip
    """This warpgroup's tile (buffer ``buf``): the online softmax, then the running maximum
    (FP8: and the tile's largest V scale) and p published for the other warpgroup, p over
    the tile's rope columns. Returns p, the accumulator's factor and the new state."""
    if FP8:
        s = s * (scale * sm_scale_log2e)[None, :]
    else:
        s = s * sm_scale_log2e
    s = gl.where(mask[None, :], s, float("-inf"))
    if FP8:
        s_top, v_top = gl.reduce((s, gl.broadcast(scale[None, :], s)[0]), 1, _max_pair)
    else:
        s_top = gl.max(s, axis=1)
    m_new = gl.maximum(m, s_top)
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(s - m_new[:, None])
    l = l * alpha + gl.sum(p, axis=1)
    stats_m.index(buf).store(m_new)
    if FP8:
        # V scales go into p relative to the tile's largest; acc is re-based on it
        v_top = gl.maximum(v_top, 1e-30)
        p = p * scale[None, :] / v_top[:, None]
        alpha = alpha * (unit / v_top)
        unit = v_top
        stats_v.index(buf).store(v_top)
    p = p.to(dt)
    k_rope_all.index(buf).store(p)
    fence_async_shared()
    mbarrier.arrive(stats.index(buf), count=1)
    return p, alpha, m_new, l, unit


@gluon.jit
def _consumer(
    KV_SCALE, indices, row, start, end, stride_s_slot, sm_scale_log2e, q_lat_s, q_rope_s,
    k_lat_all, k_rope_all, stats_m, stats_v, l_x, full, empty, stats, done, part_out, part_lse,
    b, split, hb, num_heads, stride_pb, stride_ph, stride_ps, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, FP8: gl.constexpr, D: gl.constexpr, W: gl.constexpr,
):  # fmt: skip
    """Warpgroup ``W``: the scores and softmax of tiles ``W, W + 2, ...``, the output products
    of every tile on columns ``W * 256 ..``; then its half of the split's partial output (and
    warpgroup 0 the log-sum-exp)."""
    dt: gl.constexpr = gl.float16 if FP8 else gl.bfloat16
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    head_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    tok_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    head_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    tiles = gl.cdiv(end - start, BLOCK_N)

    m = gl.full([BLOCK_H], float("-inf"), gl.float32, head_s)
    l = gl.zeros([BLOCK_H], gl.float32, head_s)  # this warpgroup's tiles' sums
    unit = gl.full([BLOCK_H], 1.0, gl.float32, head_s)  # FP8: acc over the last V scale
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, mma_o)
    v_own = k_lat_all.index(W).slice(W * HALF, HALF, dim=1)
    scale = gl.zeros([BLOCK_N], gl.float32, tok_s)
    first = W
    if W == 0:
        # tile 0: no tile of the other's before it
        if tiles > 0:
            mbarrier.wait(full.index(0), 0)
            s = _scores(q_lat_s, q_rope_s, k_lat_all.index(0), k_rope_all.index(0), mma_s)
            mask = start + gl.arange(0, BLOCK_N, layout=tok_s) < end
            if FP8:
                scale, mask = _tile_scales(KV_SCALE, indices, row, start, end, stride_s_slot,
                                           tok_s, PAGE_SIZE, ENTRIES_PER_PAGE)  # fmt: skip
            s = warpgroup_mma_wait(0, deps=(s,))
            p, alpha, m, l, unit = _own_softmax(s, m, l, unit, scale, mask, sm_scale_log2e, 0,
                                                stats, stats_m, stats_v, k_rope_all, FP8, dt)
            acc = warpgroup_mma(gl.convert_layout(p, p_op), v_own,
                                acc * gl.convert_layout(alpha, head_o)[:, None], is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(0), count=1)
        first = 2
    for t in range(first, tiles, 2):
        n0 = start + t * BLOCK_N
        # first the other's tile t - 1 on this warpgroup's columns: its buffer is refilled
        # (with tile t + 1) as soon as both warpgroups are done with it, while tile t is in
        # flight; waiting for tile t first held that load back behind this one
        acc, m, l, unit = _take_other(acc, m, l, unit, t - 1, stats, stats_m, stats_v,
                                      k_lat_all, k_rope_all, W, FP8, head_s, head_o)
        mask = n0 + gl.arange(0, BLOCK_N, layout=tok_s) < end
        if FP8:
            scale, mask = _tile_scales(KV_SCALE, indices, row, n0, end, stride_s_slot, tok_s,
                                       PAGE_SIZE, ENTRIES_PER_PAGE)  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(1 - W), count=1)
        mbarrier.wait(full.index(W), t // 2 & 1)
        s = _scores(q_lat_s, q_rope_s, k_lat_all.index(W), k_rope_all.index(W), mma_s)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, alpha, m, l, unit = _own_softmax(s, m, l, unit, scale, mask, sm_scale_log2e, W,
                                            stats, stats_m, stats_v, k_rope_all, FP8, dt)
        acc = warpgroup_mma(gl.convert_layout(p, p_op), v_own,
                            acc * gl.convert_layout(alpha, head_o)[:, None], is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(W), count=1)
    if (tiles % 2 == W) & (tiles > 0):
        # the last tile is the other's
        acc, m, l, unit = _take_other(acc, m, l, unit, tiles - 1, stats, stats_m, stats_v,
                                      k_lat_all, k_rope_all, W, FP8, head_s, head_o)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(1 - W), count=1)

    # the row sums: this warpgroup's tiles plus the other's (both at the same final maximum)
    l_x.index(W).store(l)
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    l = l + l_x.index(1 - W).load(head_s)
    empty_split = l == 0.0  # a split past the request's end
    scale_o = gl.convert_layout(unit / gl.where(empty_split, 1.0, l), head_o)
    ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=head_o)
    dims = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, mma_o))
    part = part_out + b * stride_pb + split * stride_ps + ho[:, None] * stride_ph
    gl.store(part + dims[None, :], acc * scale_o[:, None],
             mask=(ho < num_heads)[:, None] & (tiles > 0))  # fmt: skip
    if W == 0:
        lse = gl.where(empty_split, float("-inf"), m + gl.log2(gl.where(empty_split, 1.0, l)))
        hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=head_s)
        gl.store(part_lse + (b * stride_pb + hl * stride_ph) // D + split, lse,
                 mask=hl < num_heads)  # fmt: skip


@gluon.jit
def mla_pingpong_kernel(
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
    FP8: gl.constexpr,
    D: gl.constexpr,
    D_ROPE: gl.constexpr,
):
    """Stage 1 over 64 heads a program: 4 warps (warpgroup 0) plus two worker warpgroups
    (warpgroup 1, the producer); ``FP8``: e4m3 pages with per-token scales."""
    gl.static_assert(gl.num_warps() == 4, "the default partition is warpgroup 0")
    gl.static_assert(D == 2 * HALF, "each warpgroup owns half of the latent's 512 dims")
    gl.static_assert(D_ROPE == BLOCK_N, "p is stored over the tile's rope columns")
    dt: gl.constexpr = gl.float16 if FP8 else gl.bfloat16
    pid = gl.program_id(0)
    split = gl.program_id(1)
    hb = pid % head_blocks
    b = pid // head_blocks
    row, start, end = _split_range(seq_lens, indptr, b, split, num_splits, fixed_split_len,
                                   LENS_ARE_ENDS, BLOCK_N, BALANCED)  # fmt: skip

    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dt)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dt)
    q_lat_s = gl.allocate_shared_memory(dt, [BLOCK_H, D], lat_sl)
    q_rope_s = gl.allocate_shared_memory(dt, [BLOCK_H, D_ROPE], rope_sl)
    # the query a quarter of the latent at a time (all of it would be 256 registers a thread)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    q_rows = Q + b * stride_qb + hq[:, None] * stride_qh
    q_mask = (hq < num_heads)[:, None]
    for c in gl.static_range(4):
        cols = c * (D // 4) + gl.arange(0, D // 4, layout=gl.SliceLayout(0, q_l))
        q_part = gl.load(q_rows + cols[None, :], mask=q_mask, other=0.0)
        q_lat_s.slice(c * (D // 4), D // 4, dim=1).store(q_part.to(dt))
    q_rope = gl.load(q_rows + D + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, q_l))[None, :],
                     mask=q_mask, other=0.0)  # fmt: skip
    q_rope_s.store(q_rope.to(dt))

    k_lat_all = gl.allocate_shared_memory(dt, [2, BLOCK_N, D], lat_sl)
    k_rope_all = gl.allocate_shared_memory(dt, [2, BLOCK_N, D_ROPE], rope_sl)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    stats_m = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_sl)
    stats_v = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_sl)
    l_x = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_sl)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    full = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    stats = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both warpgroups' output products
        mbarrier.init(stats.index(i), count=1)
    mbarrier.init(done, count=2)
    fence_async_shared()  # the query's stores, before the products read it

    # warpgroup 0 runs in the kernel's own 4 warps and gets the registers the workers leave
    # (504 a thread across the three warpgroups). The producer is the last worker: a second
    # worker with warpgroup MMAs built its shared-memory descriptors in ordinary registers
    # (Triton 3.6, ptxas), 100+ spills at any register count
    gl.warp_specialize(
        [
            (_consumer, (KV_SCALE, indices, row, start, end, stride_s_slot, sm_scale_log2e,
                         q_lat_s, q_rope_s, k_lat_all, k_rope_all, stats_m, stats_v, l_x, full,
                         empty, stats, done, part_out, part_lse, b, split, hb, num_heads,
                         stride_pb, stride_ph, stride_ps, PAGE_SIZE, ENTRIES_PER_PAGE, FP8, D,
                         0)),
            (_consumer, (KV_SCALE, indices, row, start, end, stride_s_slot, sm_scale_log2e,
                         q_lat_s, q_rope_s, k_lat_all, k_rope_all, stats_m, stats_v, l_x, full,
                         empty, stats, done, part_out, part_lse, b, split, hb, num_heads,
                         stride_pb, stride_ph, stride_ps, PAGE_SIZE, ENTRIES_PER_PAGE, FP8, D,
                         1)),
            (_producer, (KV, indices, row, start, end, stride_kv_slot, k_lat_all, k_rope_all,
                         full, empty, PAGE_SIZE, ENTRIES_PER_PAGE, FP8, D, D_ROPE)),
        ],
        [4, 4],
        [CONSUMER_REGS, PRODUCER_REGS_FP8 if FP8 else PRODUCER_REGS],
    )  # fmt: skip
