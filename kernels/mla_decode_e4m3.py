"""MLA decode over FP8 (e4m3) pages with both products in e4m3 on Hopper's warpgroup MMA,
warp-specialized, in Gluon: nothing is widened.

Stage 1 of the split decode (``paged_decode_split``'s merge is stage 2). Tokens are the MMA's M
(64 a tile, one page of 64), as in ``mla_decode_wgmma.py``, whose producer widened every tile
to fp16 and whose consumer read that tile from shared memory at N = 16 for each product. Here:

- The producer warpgroup copies each raw e4m3 tile into a slot of shared memory (``cp.async``,
  16 bytes a thread and row), up to five tiles ahead (a slot is one raw tile, 36 KB).
- The consumer warpgroup runs the scores ``K @ [q_hi | q_lo]^T`` in e4m3 (q's two parts side by
  side in one MMA of N = 2 x 16: its first part and its rounding residual, so the product is
  1.6e-3 accurate where one e4m3 part is 3-5e-2) and the output ``V^T @ (p_hi + p_lo)``, the
  two parts of p one MMA each into one accumulator. FP8 MMA operands must be K-major, and the
  output product's K is the tokens, so V^T is the MMA's A operand in registers: each thread
  reads 16 bytes (dims) of a token at a time from the raw tile and permutes bytes within its
  registers into 4 tokens of one dim each (``_v_chunk``); the accumulator's rows stand for the
  dims in the order that makes this possible, and the store puts each row at its dim. A slot
  goes back to the producer once its V^T is in registers (the output product's MMAs read
  only those and p).
- A tile's output product is started before the next tile's scores, so the slot goes back and
  the A registers are free while the scores run; the softmax follows.

With 128-token tiles (``BLOCK_N = 128``, the default for large batches) the consumer is two
warpgroups: each runs the scores of its 64 tokens and the output product of half of o^T's dims
over all 128, so a tile's chain of dependent steps carries twice the tokens. The ring then has
two slots of 72 KB, and the producer loads each tile's first half into registers before its
slot is free (``_produce``).

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
from triton.runtime.jit import constexpr_function

from .mla_decode_wgmma import (
    CONSUMER_ONLY,
    PRODUCER_ONLY,
    _load_q,
    _softmax_step,
    _split_range,
    _store_partial,
    _tile_entry,
    _tile_slots,
)
from .mla_stream import store_output, stream_ends, stream_piece, stream_run

# Triton 3.9 renamed async_copy_global_to_shared (3.6, the GPU image's) to async_load
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# ... and thread_barrier to barrier
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
NUM_BUF = gl.constexpr(5)  # tile slots of 64 tokens, 36 KB each
PRODUCER_THREADS = gl.constexpr(128)


@constexpr_function
def _ring_slots(BLOCK_N):
    """Tile slots in the ring: five of 64 tokens (36 KB each), or two of 128 (72 KB; a third
    would not fit beside q and p)."""
    return NUM_BUF if BLOCK_N == 64 else 2


@constexpr_function
def _consumer_warps(BLOCK_N):
    """The consumer's warps: 16 tokens (MMA rows) a warp, so one warpgroup for 64-token tiles
    and two for 128."""
    return BLOCK_N // 16


@constexpr_function
def _staged(BLOCK_N):
    """Whether the producer loads each tile's first half into registers before its slot is
    free (``_produce``): on 128-token tiles, whose ring has one tile in flight."""
    return BLOCK_N == 128


@constexpr_function
def _producer_registers(BLOCK_N):
    """The producer issues copies; holding half a tile (36 KB) takes 72 registers a thread
    more."""
    return 128 if _staged(BLOCK_N) else 64


@constexpr_function
def _loaded_arrivals(BLOCK_N):
    """Arrivals that mark a slot loaded: each producer thread's copies (PRODUCER_THREADS), and
    where the tile's first half was held in registers one more, once all have stored it."""
    return PRODUCER_THREADS.value + _staged(BLOCK_N)


@gluon.jit
def _copy_columns(
    KV, indices, row, n0, end, stride_kv_slot, dst, first: gl.constexpr, width: gl.constexpr,
    PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    """Starts copying columns ``first .. first + width`` of tokens ``n0 .. n0 + BLOCK_N``'s
    raw rows into ``dst`` (zeros past ``end``)."""
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    entry = _tile_entry(indices, row, n0, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    slot, mask = _tile_slots(entry, n0, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    cols = first + gl.arange(0, width, layout=gl.SliceLayout(0, layout))
    _async_load(dst, KV + slot[:, None] * stride_kv_slot + cols[None, :], mask[:, None])


@gluon.jit
def _copy_tile(
    KV, indices, row, n0, end, stride_kv_slot, k_lat, k_rope, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
    D_ROPE: gl.constexpr,
):  # fmt: skip
    """Starts copying tokens ``n0 .. n0 + BLOCK_N``'s raw rows into ``k_lat`` / ``k_rope``
    (zeros past ``end``), 16 bytes a thread."""
    lat_l: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])  # a row a warp
    rope_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    _copy_columns(KV, indices, row, n0, end, stride_kv_slot, k_lat, 0, D, PAGE_SIZE,
                  ENTRIES_PER_PAGE, BLOCK_N, lat_l)  # fmt: skip
    _copy_columns(KV, indices, row, n0, end, stride_kv_slot, k_rope, D, D_ROPE, PAGE_SIZE,
                  ENTRIES_PER_PAGE, BLOCK_N, rope_l)  # fmt: skip


@gluon.jit
def _load_rows(
    KV, indices, row, n0, end, stride_kv_slot, first: gl.constexpr, width: gl.constexpr,
    PAGE_SIZE: gl.constexpr, ENTRIES_PER_PAGE: gl.constexpr, ROWS: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    """Columns ``first .. first + width`` of tokens ``n0 .. n0 + ROWS``' raw rows, loaded into
    registers (zeros past ``end``)."""
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    entry = _tile_entry(indices, row, n0, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, ROWS)
    slot, mask = _tile_slots(entry, n0, end, rows_l, PAGE_SIZE, ENTRIES_PER_PAGE, ROWS)
    cols = first + gl.arange(0, width, layout=gl.SliceLayout(0, layout))
    return gl.load(KV + slot[:, None] * stride_kv_slot + cols[None, :], mask=mask[:, None],
                   other=0.0)  # fmt: skip


@gluon.jit
def _copy_scales(
    KV_SCALE, indices, row, n0, end, stride_s_slot, dst, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Starts copying tokens ``n0 .. n0 + BLOCK_N``'s KV scales into ``dst`` (0 past ``end``)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    entry = _tile_entry(indices, row, n0, end, layout, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    slot, mask = _tile_slots(entry, n0, end, layout, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
    _async_load(dst, KV_SCALE + slot * stride_s_slot, mask)


@constexpr_function
def _v_load_layout(D, W):
    """``_v_chunk``'s read of ``V^T`` ([D, 32]) by ``W`` warps: each thread 8 tokens' ``D / 8 W``
    consecutive dims (16 bytes with 4 warps, 8 with 8)."""
    db = D // (8 * W)
    return gl.DistributedLinearLayout(
        reg_bases=[[1 << i, 0] for i in range(db.bit_length() - 1)] + [[0, 1], [0, 2], [0, 16]],
        lane_bases=[[0, 4], [0, 8], [db, 0], [2 * db, 0], [4 * db, 0]],
        warp_bases=[[8 * db << i, 0] for i in range(W.bit_length() - 1)],
        block_bases=[],
        shape=[D, 32],
    )


@gluon.jit
def _v_chunk(lat, c: gl.constexpr, a_l: gl.constexpr, D: gl.constexpr, W: gl.constexpr):
    """Tokens ``32 c .. 32 c + 32`` of a raw tile, its latent part as the output product's A
    operand in the registers of ``W`` warps: ``V^T`` ([D, 32]) with its rows in the
    accumulator's order (``_row_dims``). 32 tokens at a time: the bytes as read and as permuted
    are both live while they are permuted.

    Each thread reads ``DB = D / 8 W`` consecutive bytes (dims) of 8 tokens; the A layout wants
    4 consecutive tokens of a row in each register and ``DB`` rows a thread (8 apart, then
    ``16 W`` apart). Rows are free to stand for any dims, so row ``16 W b + 16 w + 8 j + q``
    stands for dim ``(D / W) w + DB q + 2 b + j``: the rows of a thread are its bytes, and
    turning dims-in-a-register into tokens-in-a-register is a byte permute within each
    thread."""
    gl.static_assert(D == 512, "the row order assumes 512 dims")
    DB: gl.constexpr = D // (8 * W)
    v = lat.slice(32 * c, 32, dim=0).permute((1, 0)).load(_v_load_layout(D, W))  # [dims, tok]
    v = gl.permute(gl.reshape(v, [W, 8, DB // 2, 2, 32]), (2, 0, 3, 1, 4))
    return gl.convert_layout(gl.reshape(v, [D, 32]), a_l)


@gluon.jit
def _output_product(
    lat, p_s, acc, a_l: gl.constexpr, D: gl.constexpr, BLOCK_H: gl.constexpr, W: gl.constexpr
):  # fmt: skip
    """Starts ``acc += V^T (p_hi + p_lo)`` for a raw tile (``p_s``: [p_hi; p_lo] in shared
    memory, [2 BLOCK_H, tokens]): MMA groups of 32 tokens and one part of p each, all into
    one accumulator (the parts side by side in one MMA would double its registers)."""
    for c in gl.static_range(p_s.shape[1] // 32):
        acc = _chunk_product(_v_chunk(lat, c, a_l, D, W), c, p_s, acc, BLOCK_H)
    return acc


@gluon.jit
def _chunk_product(v, c: gl.constexpr, p_s, acc, BLOCK_H: gl.constexpr):
    """Starts ``acc += V^T (p_hi + p_lo)`` over tokens ``32 c .. 32 c + 32`` (``v``: their
    ``_v_chunk``), one MMA group a part of p."""
    for part in gl.static_range(2):
        p_t = p_s.slice(part * BLOCK_H, BLOCK_H, dim=0).slice(32 * c, 32, dim=1)
        acc = warpgroup_mma(v, p_t.permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _row_dims(layout: gl.constexpr, D: gl.constexpr, W: gl.constexpr):
    """The dim each accumulator row holds (``_v_chunk``'s order, ``W`` warps)."""
    DB: gl.constexpr = D // (8 * W)
    r = gl.arange(0, D, layout=layout)
    return (D // W) * (r // 16 % W) + DB * (r % 8) + 2 * (r // (16 * W)) + r // 8 % 2


@constexpr_function
def _mma_layout(BLOCK_N, N, K):
    """The MMA layout of ``_consume``'s products and softmax over ``BLOCK_N // 16`` warps: 16
    rows a warp, ``N`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BLOCK_N // 16, 1],
                                     instr_shape=[16, N, K])  # fmt: skip


@gluon.jit
def _produce(
    KV, KV_SCALE, indices, row, start, end, it, stride_kv_slot, stride_s_slot, k_lat_all,
    k_rope_all, scales_all, loaded, empty, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
    D_ROPE: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """Copies each raw tile of tokens ``[start, end)`` and its KV scales into the next free
    slot, the first into the ring's ``it``-th; returns the ring position after them."""
    NUM_BUF: gl.constexpr = _ring_slots(BLOCK_N)
    # 128-token tiles have two slots, one tile in flight: their first half is loaded into
    # registers before the slot is free, so that half a tile more is in flight
    STAGED: gl.constexpr = _staged(BLOCK_N)
    HALF: gl.constexpr = BLOCK_N // 2
    lat_l: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])  # a row a warp
    rope_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(tiles):
        buf = (it + i) % NUM_BUF
        n0 = start + i * BLOCK_N
        if STAGED and ONLY != CONSUMER_ONLY:
            lat = _load_rows(KV, indices, row, n0, end, stride_kv_slot, 0, D, PAGE_SIZE,
                             ENTRIES_PER_PAGE, HALF, lat_l)  # fmt: skip
            rope = _load_rows(KV, indices, row, n0, end, stride_kv_slot, D, D_ROPE, PAGE_SIZE,
                              ENTRIES_PER_PAGE, HALF, rope_l)  # fmt: skip
        mbarrier.wait(empty.index(buf), ((it + i) // NUM_BUF & 1) ^ 1)  # its last tile done
        if ONLY == CONSUMER_ONLY:  # hands the slot over as it is
            mbarrier.arrive(loaded.index(buf), count=_loaded_arrivals(BLOCK_N))
        elif STAGED:
            _copy_tile(KV, indices, row, n0 + HALF, end, stride_kv_slot,
                       k_lat_all.index(buf).slice(HALF, HALF, dim=0),
                       k_rope_all.index(buf).slice(HALF, HALF, dim=0), PAGE_SIZE,
                       ENTRIES_PER_PAGE, HALF, D, D_ROPE)  # fmt: skip
            _copy_scales(KV_SCALE, indices, row, n0, end, stride_s_slot, scales_all.index(buf),
                         PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
            async_copy.mbarrier_arrive(loaded.index(buf), increment_count=False)
            k_lat_all.index(buf).slice(0, HALF, dim=0).store(lat)
            k_rope_all.index(buf).slice(0, HALF, dim=0).store(rope)
            fence_async_shared()  # the stores, before the MMAs read them
            _barrier()  # every producer thread's (the arrival below is one thread's)
            mbarrier.arrive(loaded.index(buf), count=1)
        else:
            _copy_tile(KV, indices, row, n0, end, stride_kv_slot, k_lat_all.index(buf),
                       k_rope_all.index(buf), PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N, D,
                       D_ROPE)  # fmt: skip
            _copy_scales(KV_SCALE, indices, row, n0, end, stride_s_slot, scales_all.index(buf),
                         PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)  # fmt: skip
            async_copy.mbarrier_arrive(loaded.index(buf), increment_count=False)
    return it + tiles


@gluon.jit
def _halves_sum(x, layout: gl.constexpr):
    """``x[:, :N/2] + x[:, N/2:]`` in ``layout`` (the N/2-wide MMA layout: the same threads)."""
    M: gl.constexpr = x.shape[0]
    H: gl.constexpr = x.shape[1] // 2
    a, b = gl.split(gl.permute(gl.reshape(x, [M, 2, H]), (0, 2, 1)))
    return gl.convert_layout(a + b, layout)


@gluon.jit
def _probabilities(s, scale, mask, q_unit, sm_scale_log2e, m, l_rows, acc_unit):
    """A tile's online softmax from its e4m3 scores ``s`` (both parts of q side by side, in
    the MMA layout of ``l_rows``): p relative to the tile's largest V scale, lifted by 2^8 so
    small weights stay normal in e4m3; the factor that re-bases the output; its new unit, the
    running max and row sums."""
    mma: gl.constexpr = l_rows.type.layout
    s = _halves_sum(s, mma) * q_unit[None, :]
    return _softmax_step(s, scale, mask, sm_scale_log2e, m, l_rows, acc_unit, 256.0)


@gluon.jit
def _softmax(
    s, scale, mask, q_unit, sm_scale_log2e, m, l_rows, acc, acc_unit, p_s,
    BLOCK_H: gl.constexpr,
):  # fmt: skip
    """``_probabilities``, then ``acc`` re-based and p into ``p_s`` as two e4m3 parts: (acc,
    its unit, the running max, the row sums)."""
    p, alpha, acc_unit, m, l_rows = _probabilities(s, scale, mask, q_unit, sm_scale_log2e, m,
                                                  l_rows, acc_unit)  # fmt: skip
    p_hi = p.to(gl.float8e4nv)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, acc.type.layout))[None, :]
    p_s.slice(0, BLOCK_H, dim=0).permute((1, 0)).store(p_hi)
    p_s.slice(BLOCK_H, BLOCK_H, dim=0).permute((1, 0)).store(
        (p - p_hi.to(gl.float32)).to(gl.float8e4nv))
    fence_async_shared()
    return acc, acc_unit, m, l_rows


@gluon.jit
def _start_scores(
    k_lat, k_rope, scales, qq_lat, qq_rope, zeros, n0, end, tok_l: gl.constexpr,
    BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Starts a landed tile's scores ``K @ [q_hi | q_lo]^T`` (latent and rope, two MMA
    groups); returns them, which of its tokens are ``< end`` and their KV scales (0 past the
    end: a masked copy leaves the slot's old scales there, and the tile's largest scale, which
    p is relative to, must be a real token's)."""
    fence_async_shared()  # the copies' writes, before the products read them
    scores = warpgroup_mma(k_lat, qq_lat.permute((1, 0)), zeros, use_acc=False, is_async=True)
    scores = warpgroup_mma(k_rope, qq_rope.permute((1, 0)), scores, is_async=True)
    mask = n0 + gl.arange(0, BLOCK_N, layout=tok_l) < end
    return scores, mask, gl.where(mask, scales.load(tok_l), 0.0)


@gluon.jit
def _fresh(D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr):
    """A piece's starting state: o^T, its unit, the running max and the row sums."""
    mma: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_H, 16)
    head_l: gl.constexpr = gl.SliceLayout(0, mma)
    acc = gl.zeros([D, BLOCK_H], gl.float32, _mma_layout(BLOCK_N, BLOCK_H, 32))
    acc_unit = gl.full([BLOCK_H], 1.0, gl.float32, head_l)
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, head_l)
    return acc, acc_unit, m, gl.zeros([BLOCK_N, BLOCK_H], gl.float32, mma)


@gluon.jit
def _opaque_zero(x):
    """0, from an instruction the compiler may neither move nor fold (``x`` only places it)."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _store_piece(acc, acc_unit, m, l_rows, part, piece, BLOCK_H: gl.constexpr,
                 BLOCK_N: gl.constexpr):  # fmt: skip
    """Piece ``piece``'s partial output into slot ``piece x num_splits + split`` of ``part``
    (``(part_out, part_lse, b, split, num_splits, hb, num_heads, stride_pb, stride_ph,
    stride_ps, dims)``). Its offsets are computed here from a value the compiler cannot hoist:
    computed once before the tile loop, they would stay live through it."""
    (part_out, part_lse, b, split, num_splits, hb, num_heads, stride_pb, stride_ph, stride_ps,
     dims) = part  # fmt: skip
    mma: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_H, 16)
    z = _opaque_zero(piece)
    _store_partial(gl.convert_layout(acc, mma), acc_unit, m, gl.sum(l_rows, axis=0), part_out,
                   part_lse, b + z, piece * num_splits + split + z, hb + z, num_heads + z,
                   stride_pb + z, stride_ph + z, stride_ps + z, dims, BLOCK_H, mma,
                   mma)  # fmt: skip


@gluon.jit
def _consume(
    start, end, it, sm_scale_log2e, q_unit, qq_lat, qq_rope, k_lat_all, k_rope_all, scales_all,
    p_s, loaded, empty, pieces, piece_tiles, part, D: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """Tokens ``[start, end)``, their first tile in the ring's ``it``-th slot: each tile's
    scores, the previous tile's output product (which frees that slot) and this tile's online
    softmax, its KV scales read from the slot (the producer copied them with the tile, so no
    global load waits here). Returns o^T over its per-head unit (in the MMA layout, row r
    holding dim ``_row_dims(r)``), the unit, the running max, the softmax's sum and the piece
    they belong to. A tile of 128 tokens takes two warpgroups: each the scores of its 64
    tokens and half of o^T's dims.

    With ``part`` (``_store_piece``'s target), the tokens are cut in ``pieces`` pieces of
    ``piece_tiles`` tiles (the last takes the rest): at each piece's end its partial output is
    stored and a fresh accumulator starts, in this one tile loop. (A loop of pieces around the
    tile loop, as before, kept the tile loop's invariants live across the store: on 128-token
    tiles ptxas serialized the MMAs, on 64-token ones it spilled; docs/kernels-fp8-kv.md.)"""
    NUM_BUF: gl.constexpr = _ring_slots(BLOCK_N)
    W: gl.constexpr = _consumer_warps(BLOCK_N)
    wide: gl.constexpr = _mma_layout(BLOCK_N, 2 * BLOCK_H, 32)
    mma: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_H, 16)
    acc_l: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_H, 32)
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    q_unit = gl.convert_layout(q_unit, gl.SliceLayout(0, mma))
    acc, acc_unit, m, l_rows = _fresh(D, BLOCK_H, BLOCK_N)
    piece = 0
    if part is not None:
        # (with ``pieces`` the constant 1, Triton 3.6 folded the piece's end away and then
        # failed to lower the kernel; an opaque zero keeps the comparison)
        last_piece = pieces - 1 + _opaque_zero(pieces)
    tiles = gl.cdiv(end - start, BLOCK_N)
    if ONLY == PRODUCER_ONLY:  # hands the slots back untouched
        for i in range(tiles):
            buf = (it + i) % NUM_BUF
            mbarrier.wait(loaded.index(buf), (it + i) // NUM_BUF & 1)
            mbarrier.arrive(empty.index(buf), count=1)
    else:
        n0 = start
        zeros = gl.zeros([BLOCK_N, 2 * BLOCK_H], gl.float32, wide)
        for i in range(tiles):
            buf = (it + i) % NUM_BUF
            prev = (it + i + NUM_BUF - 1) % NUM_BUF
            if i > 0:  # the previous tile's output product first: its slot goes back sooner
                pv = _output_product(k_lat_all.index(prev), p_s, acc, a_l, D, BLOCK_H, W)
                # its MMAs read V^T from registers (loaded above) and p: the slot goes back now
                mbarrier.arrive(empty.index(prev), count=1)
            else:
                pv = warpgroup_mma_init(acc)
            if part is not None:
                if (i == (piece + 1) * piece_tiles) & (piece < last_piece):  # a piece ends
                    acc = warpgroup_mma_wait(0, deps=(pv,))
                    _store_piece(acc, acc_unit, m, l_rows, part, piece, BLOCK_H, BLOCK_N)
                    acc, acc_unit, m, l_rows = _fresh(D, BLOCK_H, BLOCK_N)
                    pv = warpgroup_mma_init(acc)
                    piece += 1
            mbarrier.wait(loaded.index(buf), (it + i) // NUM_BUF & 1)
            scores, mask, scale = _start_scores(k_lat_all.index(buf), k_rope_all.index(buf),
                                                scales_all.index(buf), qq_lat, qq_rope, zeros,
                                                n0, end, tok_l, BLOCK_N)  # fmt: skip
            # the output product done (MMA groups retire in order): p's buffer and the A
            # registers are free while the scores run
            acc = warpgroup_mma_wait(2, deps=(pv,))
            s = warpgroup_mma_wait(0, deps=(scores,))
            acc, acc_unit, m, l_rows = _softmax(s, scale, mask, q_unit, sm_scale_log2e, m,
                                                l_rows, acc, acc_unit, p_s, BLOCK_H)
            n0 += BLOCK_N
        if tiles > 0:  # the last tile's output product; its slot goes back (the stream
            # schedule's next piece reuses it)
            last = (it + tiles - 1) % NUM_BUF
            pv = _output_product(k_lat_all.index(last), p_s, acc, a_l, D, BLOCK_H, W)
            mbarrier.arrive(empty.index(last), count=1)
            acc = warpgroup_mma_wait(0, deps=(pv,))
    return gl.convert_layout(acc, mma), acc_unit, m, gl.sum(l_rows, axis=0), piece
    # (o^T goes out from the MMA's layout, 8 dims a 32-byte sector: a coalescing conversion
    # would need 16 KB of scratch, which shared memory does not have)


@gluon.jit
def _consumer(
    start, end, sm_scale_log2e, q_unit, Q, stride_qb, stride_qh, qq_lat, qq_rope, k_lat_all,
    k_rope_all, scales_all, p_s, loaded, empty, part_out, part_lse, b, split, num_splits,
    piece_len, pieces, hb, num_heads, stride_pb, stride_ph, stride_ps, D: gl.constexpr,
    D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    Q_IN_CONSUMER: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """One split: its query where ``Q_IN_CONSUMER`` (else ``q_unit`` and the buffers hold it
    already), then its tiles in ``pieces`` pieces of ``piece_len`` tokens (the last takes the
    rest), each with its own accumulator and its own partial output and log-sum-exp, in slot
    ``piece * num_splits + split``: the tensor cores add an e4m3 product into the accumulator
    with fewer bits than fp32, so the error grows with the tiles one accumulator takes, and a
    piece bounds them without another program (``plan_pieces``). Pieces past the split's end
    store an empty partial (a log-sum-exp of -inf)."""
    if Q_IN_CONSUMER:
        q_unit = _store_q(Q, b, hb, num_heads, stride_qb, stride_qh, qq_lat, qq_rope, D, D_ROPE,
                          BLOCK_H, _consumer_warps(BLOCK_N))  # fmt: skip
        fence_async_shared()  # q's stores, before the products read it
    mma: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_H, 16)
    dims = _row_dims(gl.SliceLayout(1, mma), D, _consumer_warps(BLOCK_N))
    part = (part_out, part_lse, b, split, num_splits, hb, num_heads, stride_pb, stride_ph,
            stride_ps, dims)  # fmt: skip
    acc, acc_unit, m, l, piece = _consume(start, end, 0, sm_scale_log2e, q_unit, qq_lat, qq_rope,
                                          k_lat_all, k_rope_all, scales_all, p_s, loaded, empty,
                                          pieces, piece_len // BLOCK_N, part, D, BLOCK_H,
                                          BLOCK_N, ONLY)  # fmt: skip
    for p in range(piece, pieces):  # the last piece, then those past the split's end
        _store_partial(acc, acc_unit, m, l, part_out, part_lse, b, p * num_splits + split, hb,
                       num_heads, stride_pb, stride_ph, stride_ps, dims, BLOCK_H, mma,
                       mma)  # fmt: skip
        l = gl.zeros_like(l)


@gluon.jit
def _q_buffers(BLOCK_H: gl.constexpr, D: gl.constexpr, D_ROPE: gl.constexpr):
    """Shared memory for the query heads' two e4m3 parts: latent ``[2 BLOCK_H, D]`` and rope
    ``[2 BLOCK_H, D_ROPE]``, the first parts' rows first."""
    qq_lat = gl.allocate_shared_memory(
        gl.float8e4nv, [2 * BLOCK_H, D],
        gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D], gl.float8e4nv),
    )  # fmt: skip
    qq_rope = gl.allocate_shared_memory(
        gl.float8e4nv, [2 * BLOCK_H, D_ROPE],
        gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_ROPE], gl.float8e4nv),
    )  # fmt: skip
    return qq_lat, qq_rope


@gluon.jit
def _store_q(
    Q, b, hb, num_heads, stride_qb, stride_qh, qq_lat, qq_rope, D: gl.constexpr,
    D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, W: gl.constexpr,
):  # fmt: skip
    """Writes request ``b``'s query heads (``W`` warps) into ``_q_buffers`` in e4m3, each head
    over its own unit (its largest entry at 448), as two parts, the value and its residual;
    returns the units."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [W, 1], [1, 0])
    qr_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    q_lat, q_rope = _load_q(Q, b, hb, num_heads, stride_qb, stride_qh, D, D_ROPE, BLOCK_H, q_l,
                            qr_l)  # fmt: skip
    q_lat, q_rope = q_lat.to(gl.float32), q_rope.to(gl.float32)
    q_top = gl.maximum(gl.max(gl.abs(q_lat), axis=1),
                       gl.convert_layout(gl.max(gl.abs(q_rope), axis=1), gl.SliceLayout(1, q_l)))
    q_unit = gl.maximum(q_top, 1e-30) / 448.0
    q_lat = q_lat / q_unit[:, None]
    q_rope = q_rope / gl.convert_layout(q_unit, gl.SliceLayout(1, qr_l))[:, None]
    # each part stored as soon as it exists: computing both and storing them after gave wrong
    # outputs on the H200 (Triton 3.6; not root-caused, the PTX differed only in where the first
    # part's stores sit)
    hi = q_lat.to(gl.float8e4nv)
    qq_lat.slice(0, BLOCK_H, dim=0).store(hi)
    qq_lat.slice(BLOCK_H, BLOCK_H, dim=0).store((q_lat - hi.to(gl.float32)).to(gl.float8e4nv))
    hi = q_rope.to(gl.float8e4nv)
    qq_rope.slice(0, BLOCK_H, dim=0).store(hi)
    qq_rope.slice(BLOCK_H, BLOCK_H, dim=0).store((q_rope - hi.to(gl.float32)).to(gl.float8e4nv))
    return q_unit


@gluon.jit
def _q_in_two_parts(
    Q, b, hb, num_heads, stride_qb, stride_qh, D: gl.constexpr, D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr, W: gl.constexpr = 4,
):  # fmt: skip
    """``_store_q`` into new ``_q_buffers``: (the units, the latent parts, the rope parts)."""
    qq_lat, qq_rope = _q_buffers(BLOCK_H, D, D_ROPE)
    q_unit = _store_q(Q, b, hb, num_heads, stride_qb, stride_qh, qq_lat, qq_rope, D, D_ROPE,
                      BLOCK_H, W)  # fmt: skip
    return q_unit, qq_lat, qq_rope


@gluon.jit
def _slots(BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr, D_ROPE: gl.constexpr):
    """The raw tile slots (latent and rope parts) and p's buffer ``[p_hi; p_lo]``."""
    NUM_BUF: gl.constexpr = _ring_slots(BLOCK_N)
    k_lat_all = gl.allocate_shared_memory(
        gl.float8e4nv, [NUM_BUF, BLOCK_N, D],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float8e4nv),
    )  # fmt: skip
    k_rope_all = gl.allocate_shared_memory(
        gl.float8e4nv, [NUM_BUF, BLOCK_N, D_ROPE],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], gl.float8e4nv),
    )  # fmt: skip
    p_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * BLOCK_H, BLOCK_N],
                                    gl.NVMMASharedLayout(64, 8))  # fmt: skip
    return k_lat_all, k_rope_all, p_s


@gluon.jit
def _ring(BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr, D_ROPE: gl.constexpr):
    """``_slots``, each slot's KV scales and the slots' barriers: loaded (its copies landed,
    every producer thread's), empty (the output product done with it)."""
    NUM_BUF: gl.constexpr = _ring_slots(BLOCK_N)
    k_lat_all, k_rope_all, p_s = _slots(BLOCK_N, BLOCK_H, D, D_ROPE)
    scales_all = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_N],
                                           gl.SwizzledSharedLayout(1, 1, 1, [0]))  # fmt: skip
    loaded = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(loaded.index(i), count=_loaded_arrivals(BLOCK_N))
        mbarrier.init(empty.index(i), count=1)
    return k_lat_all, k_rope_all, scales_all, p_s, loaded, empty


@gluon.jit
def mla_fp8_e4m3_kernel(
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
    piece_len,
    pieces,
    PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr,
    LENS_ARE_ENDS: gl.constexpr,
    BALANCED: gl.constexpr,
    D: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    Q_IN_CONSUMER: gl.constexpr = False,
    ONLY: gl.constexpr = 0,
):
    """Stage 1: the producer warpgroup copies raw tiles, the consumer (the kernel's warps: one
    warpgroup for 64-token tiles, two for 128) reads their V^T and runs both e4m3 products and
    the softmax, a split in ``pieces`` pieces of ``piece_len`` tokens (``_consumer``; partial
    outputs ``[batch, heads, pieces x num_splits, D]``). ``Q_IN_CONSUMER``: the consumer
    writes the query's e4m3 parts while the producer starts on the tiles, instead of the whole
    program writing them before either side starts. ``ONLY``, for measuring:
    ``PRODUCER_ONLY`` or ``CONSUMER_ONLY`` runs that side's work alone."""
    gl.static_assert((BLOCK_N == 64) | (BLOCK_N == 128), "a warpgroup's MMA has M = 64")
    pid = gl.program_id(0)
    split = gl.program_id(1)
    hb = pid % head_blocks
    b = pid // head_blocks

    row, start, end = _split_range(seq_lens, indptr, b, split, num_splits, fixed_split_len,
                                   LENS_ARE_ENDS, BLOCK_N, BALANCED)  # fmt: skip
    if Q_IN_CONSUMER:
        qq_lat, qq_rope = _q_buffers(BLOCK_H, D, D_ROPE)
        q_unit = 0.0  # the consumer's _store_q gives it
    else:
        q_unit, qq_lat, qq_rope = _q_in_two_parts(Q, b, hb, num_heads, stride_qb, stride_qh, D,
                                                  D_ROPE, BLOCK_H, _consumer_warps(BLOCK_N))

    k_lat_all, k_rope_all, scales_all, p_s, loaded, empty = _ring(BLOCK_N, BLOCK_H, D, D_ROPE)
    fence_async_shared()  # the barriers' init and q's stores (unless the consumer writes q)

    gl.warp_specialize(
        [
            (_consumer, (start, end, sm_scale_log2e, q_unit, Q, stride_qb, stride_qh, qq_lat,
                         qq_rope, k_lat_all, k_rope_all, scales_all, p_s, loaded, empty,
                         part_out, part_lse, b, split, num_splits, piece_len, pieces, hb,
                         num_heads, stride_pb, stride_ph, stride_ps, D, D_ROPE, BLOCK_H,
                         BLOCK_N, Q_IN_CONSUMER, ONLY)),
            (_produce, (KV, KV_SCALE, indices, row, start, end, 0, stride_kv_slot,
                        stride_s_slot, k_lat_all, k_rope_all, scales_all, loaded, empty,
                        PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N, D, D_ROPE, ONLY)),
        ],
        [4],
        [_producer_registers(BLOCK_N)],
    )  # fmt: skip


@gluon.jit
def _stream_producer(
    KV, KV_SCALE, seq_lens, indptr, indices, ends_s, lo, hi, stride_kv_slot, stride_s_slot,
    k_lat_all, k_rope_all, scales_all, loaded, empty, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, LENS_ARE_ENDS: gl.constexpr, BLOCK_N: gl.constexpr,
    BATCH_P2: gl.constexpr, D: gl.constexpr, D_ROPE: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """Copies the tiles of the run ``[lo, hi)``, piece after piece, with no gap between them."""
    t = lo
    it = 0
    while t < hi:
        b, row, start, end, first, last = stream_piece(
            ends_s, t, hi, seq_lens, indptr, LENS_ARE_ENDS, BLOCK_N, BATCH_P2, 4
        )
        it = _produce(KV, KV_SCALE, indices, row, start, end, it, stride_kv_slot,
                      stride_s_slot, k_lat_all, k_rope_all, scales_all, loaded, empty,
                      PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N, D, D_ROPE, ONLY)  # fmt: skip
        t = gl.minimum(last, hi)


@gluon.jit
def _stream_consumer(
    Q, seq_lens, indptr, ends_s, lo, hi, sm_scale_log2e, qq_lat, qq_rope, k_lat_all,
    k_rope_all, scales_all, p_s, loaded, empty, out, part_out, part_lse, program, hb,
    num_heads, stride_qb, stride_qh, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
    LENS_ARE_ENDS: gl.constexpr, BATCH_P2: gl.constexpr, D: gl.constexpr,
    D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, ONLY: gl.constexpr,
):  # fmt: skip
    """The run ``[lo, hi)`` piece after piece: each piece's query, its tiles, then its request's
    output where the piece is the whole request, else a partial output in the program's slot
    (``mla_stream``)."""
    mma: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_H, 16)
    dims = _row_dims(gl.SliceLayout(1, mma), D, 4)
    t = lo
    it = 0
    while t < hi:
        b, row, start, end, first, last = stream_piece(
            ends_s, t, hi, seq_lens, indptr, LENS_ARE_ENDS, BLOCK_N, BATCH_P2, 4
        )
        # (the last piece's products, which read q, are done)
        q_unit = _store_q(Q, b, hb, num_heads, stride_qb, stride_qh, qq_lat, qq_rope, D, D_ROPE,
                          BLOCK_H, 4)  # fmt: skip
        fence_async_shared()
        acc, acc_unit, m, l, _ = _consume(start, end, it, sm_scale_log2e, q_unit, qq_lat,
                                          qq_rope, k_lat_all, k_rope_all, scales_all, p_s,
                                          loaded, empty, 1, 0, None, D, BLOCK_H, BLOCK_N,
                                          ONLY)  # fmt: skip
        it += gl.cdiv(end - start, BLOCK_N)
        # the stores' offsets from an opaque zero: computed before the loop, they would be held
        # through it (``_store_piece``; 136 bytes of stack with Triton 3.6 without, 32 with)
        z = _opaque_zero(t)
        if (first >= lo) & (last <= hi):
            store_output(acc, acc_unit, l, out, b + z, hb + z, num_heads + z, stride_ob + z,
                         stride_oh + z, dims, BLOCK_H, mma)  # fmt: skip
        else:
            _store_partial(acc, acc_unit, m, l, part_out, part_lse, program + z,
                           (first >= lo).to(gl.int32) + z, hb + z, num_heads + z, stride_pb + z,
                           stride_ph + z, stride_ps + z, dims, BLOCK_H, mma, mma)  # fmt: skip
        t = gl.minimum(last, hi)


@gluon.jit
def mla_fp8_e4m3_stream_kernel(
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
    D: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    ONLY: gl.constexpr = 0,
):
    """``mla_fp8_e4m3_kernel`` on the stream schedule (``mla_stream``): program ``(p, hb)``
    runs head block ``hb`` over run ``p`` of the batch's tiles; partial outputs go to
    ``part_out[p, heads, slot]`` (``[programs, num_heads, 2, D]``) and ``part_lse``."""
    gl.static_assert(BLOCK_N == 64, "one warpgroup's MMA has M = 64")
    program = gl.program_id(0)
    hb = gl.program_id(1)
    ends_s, total = stream_ends(seq_lens, indptr, batch, LENS_ARE_ENDS, BLOCK_N, BATCH_P2, 4)
    lo, hi = stream_run(total, gl.num_programs(0), program)
    qq_lat, qq_rope = _q_buffers(BLOCK_H, D, D_ROPE)
    k_lat_all, k_rope_all, scales_all, p_s, loaded, empty = _ring(BLOCK_N, BLOCK_H, D, D_ROPE)
    fence_async_shared()

    gl.warp_specialize(
        [
            (_stream_consumer, (Q, seq_lens, indptr, ends_s, lo, hi, sm_scale_log2e, qq_lat,
                                qq_rope, k_lat_all, k_rope_all, scales_all, p_s, loaded, empty,
                                out, part_out, part_lse, program, hb, num_heads, stride_qb,
                                stride_qh, stride_ob, stride_oh, stride_pb, stride_ph,
                                stride_ps, LENS_ARE_ENDS, BATCH_P2, D, D_ROPE, BLOCK_H,
                                BLOCK_N, ONLY)),
            (_stream_producer, (KV, KV_SCALE, seq_lens, indptr, indices, ends_s, lo, hi,
                                stride_kv_slot, stride_s_slot, k_lat_all, k_rope_all,
                                scales_all, loaded, empty, PAGE_SIZE, ENTRIES_PER_PAGE,
                                LENS_ARE_ENDS, BLOCK_N, BATCH_P2, D, D_ROPE, ONLY)),
        ],
        [4],
        [_producer_registers(BLOCK_N)],
    )  # fmt: skip
