"""MLA decode for 64 query heads a program (attention data parallelism) on Hopper's warpgroup
MMA, in Gluon: the heads are the MMA's M, so every KV tile is read once for 64 heads.

Stage 1 of the split decode (``paged_decode_split``'s merge is stage 2), the same math as the
Triton kernels, for BF16 pages and for FP8 (e4m3, per-token scales) pages. One program per
(request, block of 64 heads, split) (``mla_heads_kernel``), or on the stream schedule one per
(run of the batch's tiles, block of 64 heads) (``mla_heads_stream_kernel``, ``mla_stream``);
8 warps in two warpgroups, 64 tokens a tile:

- the scores ``q @ K^T`` ([64 heads, 64 tokens], K = 512 + 64): each warpgroup computes 32 of
  the tile's tokens, reading the query (in shared memory for the whole split) and the tile;
- the online softmax: the heads' maxima cross both warpgroups (one reduction a tile), the sums
  stay per thread until the end;
- the output ``p @ V`` ([64 heads, 512]): p goes through shared memory, since each warpgroup
  needs all 64 tokens' probabilities for its 256 of the latent's 512 dims (V is the tile's
  first 512 columns, read through the MMA's descriptor with no copy), 128 fp32 accumulators a
  thread.

Tiles are double-buffered: the next tile's bytes are in flight through this tile's products.
BF16 tiles go straight to shared memory (``cp.async``); FP8 tiles are loaded into registers a
tile ahead as 32-bit words, widened to fp16 (one ``cvt`` per two values) and stored once, their
per-token scales beside them. The scales go to the fp32 scores and to the probabilities
(relative to the tile's largest, with the accumulator re-based on it), never to the tile.
Shared memory: the query and two tiles (72 KB each), their scales and p: one program an SM.
Needs sm_90 and a compiled run (Gluon has no interpreter); the launcher runs the Triton kernel
under the interpreter and off Hopper.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .mla_decode_wgmma import (
    _as_words,
    _max_pair,
    _split_range,
    _tile_entry,
    _tile_slots,
    _widen,
)
from .mla_stream import stream_ends, stream_piece, stream_run

# Gluon's API moves between releases: Triton 3.9 renamed async_copy_global_to_shared and
# thread_barrier (3.6, the GPU image's) to async_load and barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
BLOCK_H = gl.constexpr(64)  # heads a program: one warpgroup MMA's M
BLOCK_N = gl.constexpr(64)  # tokens a tile


@gluon.jit
def _copy_tile(
    KV, buf_lat, buf_rope, indices, row, n0, end, stride_kv_slot, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, D: gl.constexpr, D_ROPE: gl.constexpr,
):  # fmt: skip
    """BF16: the tile's rows straight into shared memory (``cp.async``, one group), 0 past
    ``end``; 16 bytes a thread and copy, a warp's 8 lanes a 128-byte row piece."""
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, tile_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, tile_l)
    entry = _tile_entry(indices, row, n0, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    slot, mask = _tile_slots(entry, n0, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    rows = KV + slot[:, None] * stride_kv_slot
    mask = mask[:, None]
    _async_load(buf_lat, rows + gl.arange(0, D, layout=cols_l)[None, :], mask=mask)
    _async_load(buf_rope, rows + D + gl.arange(0, D_ROPE, layout=cols_l)[None, :], mask=mask)
    async_copy.commit_group()


@gluon.jit
def _load_fp8_tile(
    KV32, KV_SCALE, indices, row, n0, end, stride_kv_word, stride_s_slot,
    PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr, D: gl.constexpr,
    D_ROPE: gl.constexpr,
):  # fmt: skip
    """FP8: the tile's e4m3 bytes as 32-bit words (four values each), 0 past ``end``: the
    latent's two halves ``[BLOCK_N, D / 8]`` (widened one at a time) and the rope
    ``[BLOCK_N, D_ROPE / 4]``, and its tokens' scales (stored beside the tile, so the tile loop
    waits on no global load for them: loaded there, from the page table, they cost 1.07-1.24x
    the time). 16 bytes a thread and load, 8 rows a warp (conflict-free 16-byte shared stores
    once widened). In quarters, as the 16-heads kernel's producer loads them (``_load_tile``),
    this loop compiled to two more barriers a tile (Triton 3.6, sm_90)."""
    words_l: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [8, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, words_l)
    entry = _tile_entry(indices, row, n0, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    slot, in_tile = _tile_slots(entry, n0, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    rows = KV32 + slot[:, None] * stride_kv_word
    mask = in_tile[:, None]
    cols = gl.arange(0, D // 8, layout=gl.SliceLayout(0, words_l))[None, :]
    lat0 = gl.load(rows + cols, mask=mask, other=0)
    lat1 = gl.load(rows + D // 8 + cols, mask=mask, other=0)
    rope = gl.load(
        rows + D // 4 + gl.arange(0, D_ROPE // 4, layout=gl.SliceLayout(0, words_l))[None, :],
        mask=mask, other=0,
    )  # fmt: skip
    scale = gl.load(KV_SCALE + slot * stride_s_slot, mask=in_tile, other=0.0)
    return lat0, lat1, rope, scale


@gluon.jit
def _store_fp8_tile(words, buf_lat_w, buf_rope_w, buf_scales, D: gl.constexpr):
    """FP8: the tile's words (``_load_fp8_tile``) widened to fp16 into a buffer's word view,
    and its tokens' scales beside it."""
    lat0, lat1, rope, scale = words
    buf_lat_w.slice(0, D // 4, dim=1).store(_widen(lat0))
    buf_lat_w.slice(D // 4, D // 4, dim=1).store(_widen(lat1))
    buf_rope_w.store(_widen(rope))
    buf_scales.store(scale)


# the layouts of the scores ([64 heads, 64 tokens], each warpgroup 32 tokens) and of the
# output ([64 heads, 512], each warpgroup 256 dims)
MMA_S = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                               instr_shape=[16, 32, 16]))  # fmt: skip
MMA_O = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                               instr_shape=[16, 256, 16]))  # fmt: skip
WARPS = gl.constexpr(8)


@gluon.jit
def _buffers(FP8: gl.constexpr, D: gl.constexpr, D_ROPE: gl.constexpr):
    """The program's shared memory: the query's two parts, two tile buffers and p."""
    dt: gl.constexpr = gl.float16 if FP8 else gl.bfloat16
    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dt)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dt)
    k_lat_all = gl.allocate_shared_memory(dt, [2, BLOCK_N, D], lat_sl)
    k_rope_all = gl.allocate_shared_memory(dt, [2, BLOCK_N, D_ROPE], rope_sl)
    p_s = gl.allocate_shared_memory(
        dt, [BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dt)
    )
    q_lat_s = gl.allocate_shared_memory(dt, [BLOCK_H, D], lat_sl)
    q_rope_s = gl.allocate_shared_memory(dt, [BLOCK_H, D_ROPE], rope_sl)
    # FP8: each tile's per-token scales, written with the tile (BF16: one unused pair)
    scales_all = gl.allocate_shared_memory(
        gl.float32, [2, BLOCK_N if FP8 else 1], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    return q_lat_s, q_rope_s, k_lat_all, k_rope_all, p_s, scales_all


@gluon.jit
def _attend(
    Q, KV, KV_SCALE, indices, row, b, hb, start, end, sm_scale_log2e, num_heads, stride_qb,
    stride_qh, stride_kv_slot, stride_s_slot, q_lat_s, q_rope_s, k_lat_all, k_rope_all, p_s,
    scales_all, PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr, FP8: gl.constexpr,
    D: gl.constexpr, D_ROPE: gl.constexpr,
):  # fmt: skip
    """Request ``b``'s tokens ``[start, end)`` (its table row at ``row``) for head block ``hb``:
    its query into shared memory, then every tile. Returns the output over ``acc_unit`` (in
    ``MMA_O``), ``acc_unit``, the heads' running maxima and their softmax sums. The caller makes
    sure no product of an earlier call still reads the buffers."""
    dt: gl.constexpr = gl.float16 if FP8 else gl.bfloat16
    head_s: gl.constexpr = gl.SliceLayout(1, MMA_S)
    tok_s: gl.constexpr = gl.SliceLayout(0, MMA_S)
    head_o: gl.constexpr = gl.SliceLayout(1, MMA_O)
    # the first tile's loads go out before the query's, so their latencies overlap
    tiles = gl.cdiv(end - start, BLOCK_N)
    if FP8:
        KV32 = KV.to(gl.pointer_type(gl.int32), bitcast=True)
        k_lat_w_all = _as_words(k_lat_all, [2, BLOCK_N, D // 2], 128)
        k_rope_w_all = _as_words(k_rope_all, [2, BLOCK_N, D_ROPE // 2], 128)
        words = _load_fp8_tile(KV32, KV_SCALE, indices, row, start, end, stride_kv_slot // 4,
                               stride_s_slot, PAGE_SIZE, ENTRIES_PER_PAGE, D, D_ROPE)  # fmt: skip
    else:
        _copy_tile(KV, k_lat_all.index(0), k_rope_all.index(0), indices, row, start, end,
                   stride_kv_slot, PAGE_SIZE, ENTRIES_PER_PAGE, D, D_ROPE)  # fmt: skip

    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    q_rows = Q + b * stride_qb + hq[:, None] * stride_qh
    q_mask = (hq < num_heads)[:, None]
    q_lat = gl.load(q_rows + gl.arange(0, D, layout=gl.SliceLayout(0, q_l))[None, :],
                    mask=q_mask, other=0.0)  # fmt: skip
    q_rope = gl.load(q_rows + D + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, q_l))[None, :],
                     mask=q_mask, other=0.0)  # fmt: skip
    q_lat_s.store(q_lat.to(dt))
    q_rope_s.store(q_rope.to(dt))
    if FP8:
        _store_fp8_tile(words, k_lat_w_all.index(0), k_rope_w_all.index(0), scales_all.index(0),
                        D)  # fmt: skip
        words = _load_fp8_tile(KV32, KV_SCALE, indices, row, start + BLOCK_N, end,
                               stride_kv_slot // 4, stride_s_slot, PAGE_SIZE, ENTRIES_PER_PAGE, D,
                               D_ROPE)  # fmt: skip

    m = gl.full([BLOCK_H], float("-inf"), gl.float32, head_s)
    l_rows = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA_S)  # the softmax's sums, unsummed
    acc = gl.zeros([BLOCK_H, D], gl.float32, MMA_O)
    # FP8: acc is the output over the last tile's largest V scale
    acc_unit = gl.full([BLOCK_H], 1.0, gl.float32, head_s)
    n0 = start
    for i in range(tiles):
        buf = i % 2
        if not FP8:
            async_copy.wait_group(0)  # this thread's copies of tile i
        fence_async_shared()
        # every thread's part of tile i is in, and both warpgroups' products of tile i - 1
        # are done (so its buffer and p may be written)
        _barrier()
        if not FP8:
            _copy_tile(KV, k_lat_all.index(1 - buf), k_rope_all.index(1 - buf), indices, row,
                       n0 + BLOCK_N, end, stride_kv_slot, PAGE_SIZE, ENTRIES_PER_PAGE, D,
                       D_ROPE)  # fmt: skip
        k_lat_s = k_lat_all.index(buf)
        s = warpgroup_mma(q_lat_s, k_lat_s.permute((1, 0)),
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA_S), use_acc=False,
                          is_async=True)  # fmt: skip
        s = warpgroup_mma(q_rope_s, k_rope_all.index(buf).permute((1, 0)), s, is_async=True)
        offs = n0 + gl.arange(0, BLOCK_N, layout=tok_s)
        mask = offs < end
        if FP8:  # stored with the tile, a tile ago
            scale = scales_all.index(buf).load(tok_s)
        s = warpgroup_mma_wait(0, deps=(s,))
        if FP8:
            s = s * (scale * sm_scale_log2e)[None, :]
        else:
            s = s * sm_scale_log2e
        s = gl.where(mask[None, :], s, float("-inf"))
        if FP8:
            # one pass across both warpgroups for both maxima (the heads' scores and the
            # tile's V scales)
            s_top, v_top = gl.reduce((s, gl.broadcast(scale[None, :], s)[0]), 1, _max_pair)
        else:
            s_top = gl.max(s, axis=1)
        m_new = gl.maximum(m, s_top)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_rows = l_rows * alpha[:, None] + p
        if FP8:
            # V scales go into p relative to the tile's largest; acc is re-based on it
            v_top = gl.maximum(v_top, 1e-30)
            p = p * scale[None, :] / v_top[:, None]
            alpha = alpha * (acc_unit / v_top)
            acc_unit = v_top
        p_s.store(p.to(dt))
        fence_async_shared()
        _barrier()  # p from both warpgroups
        acc = warpgroup_mma(p_s, k_lat_s, acc * gl.convert_layout(alpha, head_o)[:, None],
                            is_async=True)  # fmt: skip
        if FP8:
            # tile i + 1 into the other buffer (free since this tile's first barrier) through
            # this tile's output product, then tile i + 2's words in flight
            _store_fp8_tile(words, k_lat_w_all.index(1 - buf), k_rope_w_all.index(1 - buf),
                            scales_all.index(1 - buf), D)  # fmt: skip
            words = _load_fp8_tile(KV32, KV_SCALE, indices, row, n0 + 2 * BLOCK_N, end,
                                   stride_kv_slot // 4, stride_s_slot, PAGE_SIZE, ENTRIES_PER_PAGE,
                                   D, D_ROPE)  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=(acc,))
        m = m_new
        n0 += BLOCK_N
    if not FP8:
        async_copy.wait_group(0)  # the copy issued past the last tile (all masked)
    return acc, acc_unit, m, gl.sum(l_rows, axis=1)


@gluon.jit
def _out_rows(hb, D: gl.constexpr):
    """The program's heads and the output's dims, in ``MMA_O``'s row and column layouts."""
    ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, MMA_O))
    return ho, gl.arange(0, D, layout=gl.SliceLayout(0, MMA_O))


@gluon.jit
def _store_partial(
    acc, acc_unit, m, l, part_out, part_lse, p, slot, hb, num_heads, stride_pb, stride_ph,
    stride_ps, D: gl.constexpr,
):  # fmt: skip
    """A partial output (``_attend``'s) and its log-sum-exp at ``[p, heads, slot]``. Stored
    from the MMA's layout (a 128 KB layout change would need the buffers' shared memory); a
    part past the request's end (no tokens) stores only its log-sum-exp, which the merge reads
    first (its 128 KB of zeros were as many bytes as a split's tokens in the mixes)."""
    empty = l == 0.0
    lse = gl.where(empty, float("-inf"), m + gl.log2(gl.where(empty, 1.0, l)))
    scale_o = gl.convert_layout(acc_unit / gl.where(empty, 1.0, l), gl.SliceLayout(1, MMA_O))
    ho, dims = _out_rows(hb, D)
    part = part_out + p * stride_pb + slot * stride_ps + ho[:, None] * stride_ph
    written = (ho < num_heads) & ~gl.convert_layout(empty, gl.SliceLayout(1, MMA_O))
    gl.store(part + dims[None, :], acc * scale_o[:, None], mask=written[:, None])
    hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, MMA_S))
    gl.store(part_lse + (p * stride_pb + hl * stride_ph) // D + slot, lse, mask=hl < num_heads)


@gluon.jit
def mla_heads_kernel(
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
    """Stage 1 over 64 heads a program, one program per (request, head block, split), 8 warps;
    ``FP8``: e4m3 pages with per-token scales."""
    gl.static_assert(gl.num_warps() == WARPS, "two warpgroups")
    gl.static_assert(D == 512, "the output's two halves are 256 dims, one MMA's N")
    pid = gl.program_id(0)
    split = gl.program_id(1)
    hb = pid % head_blocks
    b = pid // head_blocks
    row, start, end = _split_range(seq_lens, indptr, b, split, num_splits, fixed_split_len,
                                   LENS_ARE_ENDS, BLOCK_N, BALANCED)  # fmt: skip
    q_lat_s, q_rope_s, k_lat_all, k_rope_all, p_s, scales_all = _buffers(FP8, D, D_ROPE)
    acc, acc_unit, m, l = _attend(Q, KV, KV_SCALE, indices, row, b, hb, start, end,
                                  sm_scale_log2e, num_heads, stride_qb, stride_qh,
                                  stride_kv_slot, stride_s_slot, q_lat_s, q_rope_s, k_lat_all,
                                  k_rope_all, p_s, scales_all, PAGE_SIZE, ENTRIES_PER_PAGE,
                                  FP8, D, D_ROPE)  # fmt: skip
    _store_partial(acc, acc_unit, m, l, part_out, part_lse, b, split, hb, num_heads, stride_pb,
                   stride_ph, stride_ps, D)  # fmt: skip


@gluon.jit
def mla_heads_stream_kernel(
    Q,
    KV,
    KV_SCALE,
    seq_lens,
    indptr,
    indices,
    out,
    part_out,
    part_lse,
    sm_scale_log2e,
    batch,
    num_heads,
    stride_qb,
    stride_qh,
    stride_kv_slot,
    stride_s_slot,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr,
    LENS_ARE_ENDS: gl.constexpr,
    BATCH_P2: gl.constexpr,
    FP8: gl.constexpr,
    D: gl.constexpr,
    D_ROPE: gl.constexpr,
):
    """``mla_heads_kernel`` on the stream schedule (``mla_stream``): program ``(p, hb)`` runs
    head block ``hb`` over run ``p`` of the batch's tiles, piece after piece; a whole request's
    output goes to ``out``, a cut piece's to ``part_out[p, heads, slot]``
    (``[programs, num_heads, 2, D]``) and ``part_lse``."""
    gl.static_assert(gl.num_warps() == WARPS, "two warpgroups")
    gl.static_assert(D == 512, "the output's two halves are 256 dims, one MMA's N")
    program = gl.program_id(0)
    hb = gl.program_id(1)
    ends_s, total = stream_ends(seq_lens, indptr, batch, LENS_ARE_ENDS, BLOCK_N, BATCH_P2, WARPS)
    lo, hi = stream_run(total, gl.num_programs(0), program)
    q_lat_s, q_rope_s, k_lat_all, k_rope_all, p_s, scales_all = _buffers(FP8, D, D_ROPE)
    t = lo
    while t < hi:
        b, row, start, end, first, last = stream_piece(
            ends_s, t, hi, seq_lens, indptr, LENS_ARE_ENDS, BLOCK_N, BATCH_P2, WARPS
        )
        _barrier()  # both warpgroups' products of the last piece are done with the buffers
        acc, acc_unit, m, l = _attend(Q, KV, KV_SCALE, indices, row, b, hb, start, end,
                                      sm_scale_log2e, num_heads, stride_qb, stride_qh,
                                      stride_kv_slot, stride_s_slot, q_lat_s, q_rope_s,
                                      k_lat_all, k_rope_all, p_s, scales_all, PAGE_SIZE,
                                      ENTRIES_PER_PAGE, FP8, D, D_ROPE)  # fmt: skip
        if (first >= lo) & (last <= hi):
            ho, dims = _out_rows(hb, D)
            o = acc * gl.convert_layout(acc_unit / l, gl.SliceLayout(1, MMA_O))[:, None]
            dst = out + b * stride_ob + ho[:, None] * stride_oh + dims[None, :]
            gl.store(dst, o.to(out.dtype.element_ty), mask=(ho < num_heads)[:, None])
        else:
            _store_partial(acc, acc_unit, m, l, part_out, part_lse, program,
                           (first >= lo).to(gl.int32), hb, num_heads, stride_pb, stride_ph,
                           stride_ps, D)  # fmt: skip
        t = gl.minimum(last, hi)
