"""MLA decode over FP8 (e4m3) pages for 64 query heads a program, both products in e4m3 on
Hopper's warpgroup MMA, in Gluon: the heads-as-M kernel (``mla_decode_heads.py``) without the
widening.

Stage 1 of the split decode (``paged_decode_split``'s merge is stage 2). One program per
(request, block of 64 heads, split), 8 warps in two warpgroups, 64 tokens a tile. Where the
widening kernel loads each tile into registers, converts it to fp16 and stores it, here the raw
tile goes to shared memory by ``cp.async`` (36 KB, half the widened size, so three tiles are in
flight), and:

- the scores ``q @ K^T`` ([64 heads, 64 tokens], K = 512 + 64, each warpgroup 32 of the
  tokens) run in e4m3 with q in two parts, its value and its rounding residual (per-head unit:
  its largest entry at 448), two MMAs into one accumulator, so the sum is the product's;
- the output is computed transposed, ``O^T = V^T (p_hi + p_lo)^T`` ([512 dims, 64 heads], 128
  fp32 accumulators a thread): FP8 MMA operands must be K-major and this product's K is the
  tokens, so p (in shared memory as [heads, tokens]) is the B operand as it is, and V^T is the
  A operand in registers, read from the raw tile 8 bytes (dims) of a token at a time and
  permuted within each thread into 4 tokens of one dim a register. The accumulator's rows stand
  for the dims in the order that makes that a permute within registers (``_row_dims``); the
  store puts each row at its dim.

The scales go where the widening kernel puts them: the per-token KV scale to the fp32 scores
and to the probabilities (relative to the tile's largest, lifted by 2^8 so small weights stay
normal in e4m3), q's per-head unit to the scores. Needs sm_90 and a compiled run (Gluon has no
interpreter); the launcher runs the Triton kernel under the interpreter and off Hopper.
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

from .mla_decode_e4m3 import _copy_columns
from .mla_decode_wgmma import _load_q, _max_pair, _split_range, _tile_entry, _tile_slots

# Triton 3.9 renamed thread_barrier (3.6, the GPU image's) to barrier
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
BLOCK_H = gl.constexpr(64)  # heads a program: one warpgroup MMA's M
BLOCK_N = gl.constexpr(64)  # tokens a tile
NUM_BUF = gl.constexpr(3)  # raw tiles in shared memory, 36 KB each


@gluon.jit
def _copy_tile(
    KV, indices, row, n0, end, stride_kv_slot, k_lat, k_rope, PAGE_SIZE: gl.constexpr,
    ENTRIES_PER_PAGE: gl.constexpr, D: gl.constexpr, D_ROPE: gl.constexpr,
):  # fmt: skip
    """Tokens ``n0 .. n0 + BLOCK_N``'s raw rows into ``k_lat`` / ``k_rope`` (zeros past
    ``end``), 16 bytes a thread and copy, one commit group."""
    lat_l: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [8, 1], [1, 0])  # a row a warp
    rope_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
    _copy_columns(KV, indices, row, n0, end, stride_kv_slot, k_lat, 0, D, PAGE_SIZE,
                  ENTRIES_PER_PAGE, BLOCK_N, lat_l)  # fmt: skip
    _copy_columns(KV, indices, row, n0, end, stride_kv_slot, k_rope, D, D_ROPE, PAGE_SIZE,
                  ENTRIES_PER_PAGE, BLOCK_N, rope_l)  # fmt: skip
    async_copy.commit_group()


@gluon.jit
def _v_half(lat, half: gl.constexpr, a_l: gl.constexpr, D: gl.constexpr):
    """Half of a raw tile's tokens (32), its latent part as the output product's A operand in
    registers: ``V^T`` ([D, 32]) with its rows in the accumulator's order (``_row_dims``).

    Each thread reads 8 consecutive bytes (dims) of 8 tokens; the A layout wants 4 consecutive
    tokens of a row in each register and 8 rows a thread (8 apart, then 128 apart). Row
    ``128 b + 16 w + 8 j + q`` stands for dim ``64 w + 8 q + 2 b + j``, so the 8 rows of a
    thread are its 8 bytes, and turning dims-in-a-register into tokens-in-a-register is a byte
    permute within each thread."""
    gl.static_assert(D == 512, "the row order assumes 512 dims over 8 warps")
    load_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [0, 1], [0, 2], [0, 16]],
        lane_bases=[[0, 4], [0, 8], [8, 0], [16, 0], [32, 0]],
        warp_bases=[[64, 0], [128, 0], [256, 0]],
        block_bases=[],
        shape=[D, 32],
    )
    v = lat.slice(32 * half, 32, dim=0).permute((1, 0)).load(load_l)  # [dims, tokens]
    v = gl.permute(gl.reshape(v, [8, 8, 4, 2, 32]), (2, 0, 3, 1, 4))
    return gl.convert_layout(gl.reshape(v, [D, 32]), a_l)


@gluon.jit
def _row_dims(layout: gl.constexpr, D: gl.constexpr):
    """The dim each accumulator row holds (``_v_half``'s order)."""
    r = gl.arange(0, D, layout=layout)
    return 64 * (r // 16 % 8) + 8 * (r % 8) + 2 * (r // 128) + r // 8 % 2


@gluon.jit
def mla_heads_e4m3_kernel(
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
):
    """Stage 1 over 64 heads a program, 8 warps, e4m3 pages with per-token scales."""
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    e4m3: gl.constexpr = gl.float8e4nv
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 32]
    )
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_H, 32]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
    head_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    tok_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    head_o: gl.constexpr = gl.SliceLayout(0, acc_l)

    pid = gl.program_id(0)
    split = gl.program_id(1)
    hb = pid % head_blocks
    b = pid // head_blocks
    row, start, end = _split_range(seq_lens, indptr, b, split, num_splits, fixed_split_len,
                                   LENS_ARE_ENDS, BLOCK_N, BALANCED)  # fmt: skip

    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], e4m3)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], e4m3)
    k_lat_all = gl.allocate_shared_memory(e4m3, [NUM_BUF, BLOCK_N, D], lat_sl)
    k_rope_all = gl.allocate_shared_memory(e4m3, [NUM_BUF, BLOCK_N, D_ROPE], rope_sl)
    # the first tiles' copies go out before the query's loads, so their latencies overlap
    tiles = gl.cdiv(end - start, BLOCK_N)
    for t in gl.static_range(NUM_BUF - 1):
        _copy_tile(KV, indices, row, start + t * BLOCK_N, end, stride_kv_slot,
                   k_lat_all.index(t), k_rope_all.index(t), PAGE_SIZE, ENTRIES_PER_PAGE, D,
                   D_ROPE)  # fmt: skip

    # q per head in e4m3 (its largest entry at 448) as two parts: the value and its residual
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    qr_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    q_lat, q_rope = _load_q(Q, b, hb, num_heads, stride_qb, stride_qh, D, D_ROPE, BLOCK_H, q_l,
                            qr_l)  # fmt: skip
    q_lat, q_rope = q_lat.to(gl.float32), q_rope.to(gl.float32)
    q_top = gl.maximum(gl.max(gl.abs(q_lat), axis=1),
                       gl.convert_layout(gl.max(gl.abs(q_rope), axis=1), gl.SliceLayout(1, q_l)))
    q_unit = gl.maximum(q_top, 1e-30) / 448.0
    q_lat = q_lat / q_unit[:, None]
    q_rope = q_rope / gl.convert_layout(q_unit, gl.SliceLayout(1, qr_l))[:, None]
    q_unit = gl.convert_layout(q_unit, head_s)
    qq_lat = gl.allocate_shared_memory(
        e4m3, [2 * BLOCK_H, D], gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D], e4m3)
    )
    qq_rope = gl.allocate_shared_memory(
        e4m3, [2 * BLOCK_H, D_ROPE],
        gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_ROPE], e4m3),
    )  # fmt: skip
    hi = q_lat.to(e4m3)
    qq_lat.slice(0, BLOCK_H, dim=0).store(hi)
    qq_lat.slice(BLOCK_H, BLOCK_H, dim=0).store((q_lat - hi.to(gl.float32)).to(e4m3))
    hi = q_rope.to(e4m3)
    qq_rope.slice(0, BLOCK_H, dim=0).store(hi)
    qq_rope.slice(BLOCK_H, BLOCK_H, dim=0).store((q_rope - hi.to(gl.float32)).to(e4m3))
    # p's two parts, [heads, tokens]: the output product's B operand, K-major as stored
    p_s = gl.allocate_shared_memory(e4m3, [2 * BLOCK_H, BLOCK_N], gl.NVMMASharedLayout(64, 8))

    m = gl.full([BLOCK_H], float("-inf"), gl.float32, head_s)
    l_rows = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, mma_s)  # the softmax's sums, unsummed
    acc = gl.zeros([D, BLOCK_H], gl.float32, acc_l)  # O^T, over the last tile's largest V scale
    acc_unit = gl.full([BLOCK_H], 1.0, gl.float32, head_s)
    n0 = start
    for i in range(tiles):
        buf = i % NUM_BUF
        async_copy.wait_group(NUM_BUF - 2)  # this thread's copies of tile i
        fence_async_shared()
        # every thread's part of tile i is in, and both warpgroups' products of tile i - 1
        # are done (so its buffer and p may be written)
        _barrier()
        _copy_tile(KV, indices, row, n0 + (NUM_BUF - 1) * BLOCK_N, end, stride_kv_slot,
                   k_lat_all.index((i + NUM_BUF - 1) % NUM_BUF),
                   k_rope_all.index((i + NUM_BUF - 1) % NUM_BUF), PAGE_SIZE, ENTRIES_PER_PAGE,
                   D, D_ROPE)  # fmt: skip
        k_lat = k_lat_all.index(buf)
        k_rope_t = k_rope_all.index(buf).permute((1, 0))
        k_lat_t = k_lat.permute((1, 0))
        s = warpgroup_mma(qq_lat.slice(0, BLOCK_H, dim=0), k_lat_t,
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, mma_s), use_acc=False,
                          is_async=True)  # fmt: skip
        s = warpgroup_mma(qq_lat.slice(BLOCK_H, BLOCK_H, dim=0), k_lat_t, s, is_async=True)
        s = warpgroup_mma(qq_rope.slice(0, BLOCK_H, dim=0), k_rope_t, s, is_async=True)
        s = warpgroup_mma(qq_rope.slice(BLOCK_H, BLOCK_H, dim=0), k_rope_t, s, is_async=True)
        entry = _tile_entry(indices, row, n0, end, tok_s, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
        slot, mask = _tile_slots(entry, n0, end, tok_s, PAGE_SIZE, ENTRIES_PER_PAGE, BLOCK_N)
        scale = gl.load(KV_SCALE + slot * stride_s_slot, mask=mask, other=0.0)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = s * q_unit[:, None] * (scale * sm_scale_log2e)[None, :]
        s = gl.where(mask[None, :], s, float("-inf"))
        # one pass across both warpgroups for both maxima (the heads' scores and the tile's
        # V scales)
        s_top, v_top = gl.reduce((s, gl.broadcast(scale[None, :], s)[0]), 1, _max_pair)
        m_new = gl.maximum(m, s_top)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_rows = l_rows * alpha[:, None] + p
        # p relative to the tile's largest V scale, lifted by 2^8 (small weights stay normal)
        v_top = gl.maximum(v_top, 1e-30) / 256.0
        p = p * scale[None, :] / v_top[:, None]
        alpha = alpha * (acc_unit / v_top)
        acc_unit = v_top
        p_hi = p.to(e4m3)
        p_s.slice(0, BLOCK_H, dim=0).store(p_hi)
        p_s.slice(BLOCK_H, BLOCK_H, dim=0).store((p - p_hi.to(gl.float32)).to(e4m3))
        fence_async_shared()
        _barrier()  # p from both warpgroups
        acc = acc * gl.convert_layout(alpha, head_o)[None, :]
        for half in gl.static_range(2):
            v = _v_half(k_lat, half, a_l, D)
            for part in gl.static_range(2):
                p_t = p_s.slice(part * BLOCK_H, BLOCK_H, dim=0).slice(32 * half, 32, dim=1)
                acc = warpgroup_mma(v, p_t.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
        m = m_new
        n0 += BLOCK_N
    async_copy.wait_group(0)  # the copies issued past the last tile (all masked)

    l = gl.sum(l_rows, axis=1)
    empty = l == 0.0  # a split past the request's end
    lse = gl.where(empty, float("-inf"), m + gl.log2(gl.where(empty, 1.0, l)))
    scale_o = gl.convert_layout(acc_unit / gl.where(empty, 1.0, l), head_o)
    # stored from the MMA's layout, each row at its dim; a split past the request's end stores
    # only its log-sum-exp, which the merge reads first
    ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=head_o)
    dims = _row_dims(gl.SliceLayout(1, acc_l), D)
    part = part_out + b * stride_pb + split * stride_ps + ho[None, :] * stride_ph
    gl.store(part + dims[:, None], acc * scale_o[None, :],
             mask=(ho < num_heads)[None, :] & (tiles > 0))  # fmt: skip
    hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=head_s)
    gl.store(part_lse + (b * stride_pb + hl * stride_ph) // D + split, lse, mask=hl < num_heads)
