"""INT4 weight x BF16 activation GEMM for up to 64 tokens on Hopper's warpgroup MMA, in Gluon:
each weight decoded once for the whole token tile, in the registers the MMA reads it from.

The Triton GEMM (``w4a16_gemm.py``) leaves the decoded weights' layout to the compiler; from 16
tokens its tiles decode each weight once per 8-token tile, or hand ``wgmma`` a register
operand that Triton first moves through shared memory, and at 64 tokens it took twice
Marlin's time. Here the layout is chosen: the weights are the MMA's A operand (``acc^T = W
x^T``, 64 output columns a warpgroup as M, a tile of 8 to 64 tokens as N), and each thread
reads exactly the packed words whose nibbles its A registers hold.

For nibble plane ``i`` of a K step of 128 inputs (16 word rows ``r``, ``k = 8 r + i``), the A
operand is ``[64 columns, 16 rows]``; with ``k_width = 2`` a thread's register holds two
neighbouring rows ``(2 t, 2 t + 1)`` of one column, which is what one ``prmt`` of those two
words gives (``w4a16_layout.plane_ptx``). So one thread's eight words of a step (rows ``2 t``,
``2 t + 1``, ``2 t + 8``, ``2 t + 9`` of two columns) feed all eight planes' MMAs with no
shuffle, and no decoded weight passes through shared memory. The packed words arrive through
a ``cp.async`` ring of ``STAGES`` slots; the activations are the B operand, each step's
``[tokens, 128]`` slice stored plane by plane (``x[:, i::8]``) a step ahead and shared by the
program's one or two warpgroups.

Scales: with a group of 128 or more the planes decode to ``code - zero`` and the scale
multiplies the step's partial sum; with smaller groups each weight decodes to ``(code - zero)
* scale`` (rows ``2 t`` and ``2 t + 1`` share a group) and the MMAs accumulate across steps,
one step's eight running through the next step's copies and staging, and waited for before its
decode writes the registers they read.
Symmetric weights (zero point 8) with bf16 scales; K a multiple of 128. Split K parts meet in
the Triton tiles' self-resetting workspace and the last stores the result (one launch), or add
into a zeroed fp32 output the caller casts (three launches). Launched dependently, the first
words are copied while the kernel before ends. Timed against the Triton tiles and Marlin in
docs/kernels-int4.md (v11 to v14).
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

from .w4a16_layout import plane_ptx

# Gluon's API moves between releases: Triton 3.9 renamed these two (3.6 is the GPU image's)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

WG_COLUMNS = gl.constexpr(64)  # output columns a warpgroup: its MMA's M
STEP = gl.constexpr(128)  # inputs a K step: 16 word rows, eight 16-row planes


_PLANE_OFFSET = gl.constexpr(tuple(plane_ptx(i, "offset") for i in range(8)))
_PLANE_SCALED = gl.constexpr(tuple(plane_ptx(i, "scaled") for i in range(8)))
_NEG_ZERO_SYMMETRIC = gl.constexpr(-136.0)  # -(128 + 8)


@gluon.jit
def _copy_words(qw_ptr, slot, step, n0, N, stride_qk, BLOCK_N: gl.constexpr,
                WARPS: gl.constexpr):  # fmt: skip
    """Start copying the ``[16, BLOCK_N]`` words of K step ``step`` into ring slot ``slot``
    (``cp.async``, 16 bytes a thread and copy; one commit group)."""
    copy_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [WARPS, 1], [1, 0])
    rows = step * (STEP // 8) + gl.arange(0, STEP // 8, layout=gl.SliceLayout(1, copy_l))
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, copy_l))
    _async_load(slot, qw_ptr + rows[:, None] * stride_qk + cols[None, :],
                mask=(cols < N)[None, :])  # fmt: skip
    async_copy.commit_group()


@gluon.jit
def _step_group_scales(s_ptr, step, n0, N, stride_sk, GROUP: gl.constexpr,
                       BLOCK_N: gl.constexpr, a_l: gl.constexpr):  # fmt: skip
    """Groups smaller than a step: each weight's scale, ``[BLOCK_N, 16]`` (column, word row)
    in the A operand's layout."""
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
    rows = step * (STEP // 8) + gl.arange(0, STEP // 8, layout=gl.SliceLayout(0, a_l))
    ptrs = s_ptr + (rows // (GROUP // 8))[None, :] * stride_sk + cols[:, None]
    return gl.load(ptrs, mask=(cols < N)[:, None], other=0.0)


@gluon.jit
def _step_x(x_ptr, step, m0, M, stride_xm, BM: gl.constexpr, x_l: gl.constexpr):
    """The step's activations ``[BM, 16, 8]`` (token, word row, nibble), 0 past ``M``: a
    thread's 8 values are one word row's 16 contiguous bytes."""
    rows_l: gl.constexpr = gl.SliceLayout(2, x_l)
    m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, rows_l))
    r = gl.arange(0, STEP // 8, layout=gl.SliceLayout(0, rows_l))
    i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_l)))
    k = (step * STEP + 8 * r)[None, :, None] + i[None, None, :]
    ptrs = x_ptr + m[:, None, None] * stride_xm + k
    return gl.load(ptrs, mask=(m < M)[:, None, None], other=0.0)


@gluon.jit
def _stage_x(x, xs_all, base, BM: gl.constexpr):
    """Store the step's activations plane by plane, ``xs_all[base + i] = x[:, :, i]`` ([BM,
    16]): register moves split the planes, as ``w4a16_gemm._planes`` does."""
    R: gl.constexpr = STEP // 8
    e, o = gl.split(gl.reshape(x, [BM, R, 4, 2]))  # i even, odd
    e0, e1 = gl.split(gl.reshape(e, [BM, R, 2, 2]))  # i = 0, 4 | 2, 6
    o0, o1 = gl.split(gl.reshape(o, [BM, R, 2, 2]))  # i = 1, 5 | 3, 7
    x0, x4 = gl.split(e0)
    x2, x6 = gl.split(e1)
    x1, x5 = gl.split(o0)
    x3, x7 = gl.split(o1)
    xs_all.index(base + 0).store(x0)
    xs_all.index(base + 1).store(x1)
    xs_all.index(base + 2).store(x2)
    xs_all.index(base + 3).store(x3)
    xs_all.index(base + 4).store(x4)
    xs_all.index(base + 5).store(x5)
    xs_all.index(base + 6).store(x6)
    xs_all.index(base + 7).store(x7)
    fence_async_shared()  # the stores, before the MMAs read them
    _barrier()


@gluon.jit
def _planes_product(words, neg_zero, scale, xs_all, base, acc, USE_ACC: gl.constexpr,
                    ONE_GROUP: gl.constexpr):  # fmt: skip
    """Starts ``acc (+)= sum_i plane_i(words) @ xs_all[base + i]^T`` (eight async MMAs of
    K = 16): planes of ``code - zero``, or with ``ONE_GROUP`` false ``(code - zero) * scale``."""
    for i in gl.static_range(8):
        if ONE_GROUP:
            w = gl.inline_asm_elementwise(
                _PLANE_OFFSET[i], "=r,r,r,r", [words, neg_zero], dtype=gl.bfloat16,
                is_pure=True, pack=2,
            )  # fmt: skip
        else:
            w = gl.inline_asm_elementwise(
                _PLANE_SCALED[i], "=r,r,r,r,r", [words, neg_zero, scale], dtype=gl.bfloat16,
                is_pure=True, pack=2,
            )  # fmt: skip
        acc = warpgroup_mma(w, xs_all.index(base + i).permute((1, 0)), acc,
                            use_acc=USE_ACC or i > 0, is_async=True)  # fmt: skip
    return acc


@gluon.jit
def _fenced_zero(x):
    """0 from the scalar ``x``, through one ``fence.acq_rel.gpu`` a thread: what is computed
    from it is ordered after the fence, the fence after ``x`` (a one-element tensor each
    thread holds, as inline assembly takes no scalars in every Triton release)."""
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    t = gl.full([1], 0, gl.int32, one_l) + x * 0
    t = gl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [t],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
    return gl.max(t, 0)


@gluon.jit
def _wait_for_kernel_before():
    """Programmatic dependent launch: wait here until the kernel before has finished (and its
    writes are visible); a no-op in a plain launch."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _store_counted(out_ptr, ws_ptr, cnt_ptr, idx, acc, mask, split_k):
    """The K splits meet in ``w4a16_gemm.counted_workspace`` (zero before and after the
    launch), as the Triton tiles' ``_add_counted`` and ``_take_sums`` do: add this part, and
    count it; the program that adds an element's last part resets its count, takes the sum
    (resetting it) and stores it as bf16. Each thread learns from its own counts whether it
    was last; a barrier and a fence put the program's adds before its counts, and a fence
    after them puts the counts before the sums are taken."""
    gl.atomic_add(ws_ptr + idx, acc, mask=mask, sem="relaxed")
    _barrier()
    zero = _fenced_zero(gl.program_id(0))  # release: every add of the program first
    arrived = gl.atomic_add(cnt_ptr + idx + zero, idx * 0 + 1, mask=mask, sem="relaxed")
    zero = _fenced_zero(gl.min(gl.min(arrived, 1), 0))  # acquire: after every count
    last = mask & (arrived + zero == split_k - 1)
    gl.atomic_xchg(cnt_ptr + idx, gl.zeros_like(arrived), mask=last, sem="relaxed")
    bits = (ws_ptr + idx).to(gl.pointer_type(gl.int32), bitcast=True)
    total = gl.atomic_xchg(bits, gl.zeros_like(arrived), mask=last, sem="relaxed")
    gl.store(out_ptr + idx, total.to(gl.float32, bitcast=True).to(out_ptr.dtype.element_ty),
             mask=last)  # fmt: skip


@gluon.jit
def w4a16_wgmma_kernel(
    x_ptr, qw_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, split_k,
    stride_xm, stride_qk, stride_sk, stride_om,
    GROUP: gl.constexpr, BM: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr = 4,
    COUNTED: gl.constexpr = False, PDL: gl.constexpr = False,
):  # fmt: skip
    """``out[m, n] (+)= x[m] @ dequant(W)[:, n]`` for one tile of ``BM`` tokens and 64 columns
    a warpgroup (``num_warps`` 4 or 8: the warpgroups share the activations' staging) and one of
    ``split_k`` K parts; ``STAGES`` slots of words in flight. ``out`` is bf16, or with
    ``SPLIT`` and not ``COUNTED`` a zeroed fp32 buffer the parts add into; ``COUNTED`` parts
    meet in the workspace ``ws_ptr`` / ``cnt_ptr`` and the last stores bf16 (one launch). With
    ``PDL`` (a dependent launch) the words' first copies start before the kernel before has
    ended; the activations and the workspace are touched only after it has."""
    ONE_GROUP: gl.constexpr = GROUP % STEP == 0
    # per-weight scales: the MMAs accumulate across steps, and one step's run through the
    # next step's copies, loads and staging, up to its decode (with one group a step, its
    # partial sum must be done before the scale)
    OVERLAP: gl.constexpr = not ONE_GROUP
    # the activations' slots: the MMAs', the next step's, and with OVERLAP the one the other
    # warpgroup's MMAs of the step before may still read
    X_SLOTS: gl.constexpr = 2 + OVERLAP
    # steps whose words are copied ahead of the one computed: with OVERLAP one less, which
    # timed 2-12% faster than a full ring ahead with the earlier overlap (docs/kernels-int4.md,
    # v13; not re-compared on the fixed overlap of v14)
    AHEAD: gl.constexpr = STAGES - 1 - OVERLAP
    WARPS: gl.constexpr = gl.num_warps()
    WG: gl.constexpr = WARPS // 4
    BLOCK_N: gl.constexpr = WG * WG_COLUMNS
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, BM, 16])  # fmt: skip
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    # the activations: BM / 8 WG word rows of one token a thread (contiguous bytes), so each
    # plane's store is BM / 4 WG bytes a thread
    x_l: gl.constexpr = gl.BlockedLayout([1, BM // (8 * WG), 8], [BM // 4, 128 // BM, 1],
                                         [4, WG, 1], [2, 1, 0])  # fmt: skip
    xs_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, STEP // 8], gl.bfloat16)
    col_l: gl.constexpr = gl.SliceLayout(1, acc_l)

    tiles_m = gl.cdiv(M, BM)
    n0 = (gl.program_id(0) // tiles_m) * BLOCK_N
    m0 = (gl.program_id(0) % tiles_m) * BM
    steps = K // STEP
    per_split = gl.cdiv(steps, split_k)
    begin = gl.program_id(1) * per_split
    end = gl.minimum(steps, begin + per_split)

    xs_all = gl.allocate_shared_memory(gl.bfloat16, [X_SLOTS * 8, BM, STEP // 8], xs_l)
    # the words' ring: 16-byte chunks swizzled by row, so the A operand's reads (rows 2 t ..
    # 2 t + 9 of a column) fall in different banks
    w_l: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, STEP // 8, BLOCK_N], w_l)
    cols = n0 + gl.arange(0, BLOCK_N, layout=col_l)
    acc = gl.zeros([BLOCK_N, BM], gl.float32, acc_l)
    zeros = gl.zeros([BLOCK_N, BM], gl.float32, acc_l)
    neg_zero = gl.full([BLOCK_N, STEP // 8], _NEG_ZERO_SYMMETRIC, gl.bfloat16, a_l)
    # steps past the part are clamped to its last (an empty split's to a real step): their
    # copies land unused, and every step commits one group
    first = gl.minimum(begin, steps - 1)
    for p in gl.static_range(AHEAD):
        _copy_words(qw_ptr, w_ring.index(p), gl.minimum(begin + p, end - 1), n0, N, stride_qk,
                    BLOCK_N, WARPS)  # fmt: skip
    if PDL:  # the weights are no kernel's output; the activations are the kernel before's
        _wait_for_kernel_before()
    x = _step_x(x_ptr, first, m0, M, stride_xm, BM, x_l)
    if ONE_GROUP:
        scale = gl.load(s_ptr + (first * STEP // GROUP) * stride_sk + cols, mask=cols < N,
                        other=0.0)  # fmt: skip
    else:
        scale = _step_group_scales(s_ptr, first, n0, N, stride_sk, GROUP, BLOCK_N, a_l)
    for step in range(begin, end):
        it = step - begin
        async_copy.wait_group(AHEAD - 1)  # this thread's copies of this step's words
        base = it % X_SLOTS * 8
        _stage_x(x, xs_all, base, BM)  # its barrier makes every thread's copies visible
        words = w_ring.index(it % STAGES).permute((1, 0)).load(a_l)
        # the slot of step it + AHEAD - STAGES (read before the barrier above) takes the words
        # AHEAD ahead; the next step's scales and activations are in flight through this
        # step's MMAs
        _copy_words(qw_ptr, w_ring.index((it + AHEAD) % STAGES),
                    gl.minimum(step + AHEAD, end - 1), n0, N, stride_qk, BLOCK_N,
                    WARPS)  # fmt: skip
        nxt = gl.minimum(step + 1, end - 1)
        next_x = _step_x(x_ptr, nxt, m0, M, stride_xm, BM, x_l)
        if ONE_GROUP:
            next_scale = gl.load(s_ptr + (nxt * STEP // GROUP) * stride_sk + cols,
                                 mask=cols < N, other=0.0)  # fmt: skip
            part = _planes_product(words, neg_zero, scale, xs_all, base, zeros, False, True)
            part = warpgroup_mma_wait(0, deps=(part,))
            acc += part * scale.to(gl.float32)[:, None]
        else:
            next_scale = _step_group_scales(s_ptr, nxt, n0, N, stride_sk, GROUP, BLOCK_N, a_l)
            # the step before's MMAs read the decoded weights from the registers this decode
            # writes: they finish first (PTX leaves undefined what an MMA in flight reads from
            # a register written after it was issued; waiting only after the issue, as this
            # kernel once did, let the next decode overwrite them: v14)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            acc = _planes_product(words, neg_zero, scale, xs_all, base, acc, True, False)
            acc = warpgroup_mma_wait(8, deps=(acc,))  # none waited for: the loop's value
        x, scale = next_x, next_scale
    acc = warpgroup_mma_wait(0, deps=(acc,))
    async_copy.wait_group(0)  # the copies past the last step

    ms = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    idx = ms[None, :] * stride_om + cols[:, None]
    mask = (cols < N)[:, None] & (ms < M)[None, :]
    if SPLIT and COUNTED:
        _store_counted(out_ptr, ws_ptr, cnt_ptr, idx, acc, mask, split_k)
    elif SPLIT:
        gl.atomic_add(out_ptr + idx, acc, mask=mask, sem="relaxed")
    else:
        gl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)
