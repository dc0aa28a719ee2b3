"""INT4 weight x BF16 activation GEMM (``y = x @ W.T``) for decode, in Triton.

Weights are in the packed layout of :mod:`tessera.kernels.w4a16_format` (K-major int32 words,
8 codes each, group-wise scales). Decode is weight-streaming: at M <= 64 the kernel reads every
weight once and the time is bytes / bandwidth, so everything here serves reading fewer bytes fast.

Maths of one K step of ``BLOCK_K = 8 R`` rows, for word row ``r`` and nibble ``i``
(``k = 8 r + i``):

    y[m, n] += sum_i sum_r x[m, 8 r + i] * (code_i[r, n] - zero[n]) * scale[n]

so each nibble plane ``i`` is one ``[BLOCK_M, R] x [R, BLOCK_N]`` tensor-core dot over the strided
activations ``x[:, i::8]``: the packed words are loaded once, coalesced along N, and never
reshaped. Two codes become a packed bf16x2 ``128 + code`` in about two instructions, without an
int->float conversion (``w4a16_layout.plane_ptx``); when a group spans the whole K step the
offset ``-(128 + zero[n])`` is added per weight with one packed fma a pair (tiles of 16 and 32
rows), comes back as a rank-1 term ``xsum[m] * -(128 + zero[n])`` (weights-first tiles), or takes
a second dot (``wgmma`` tiles), and the scale then multiplies the ``[BLOCK_M, BLOCK_N]`` partial
sum instead of every weight. Smaller groups decode each weight to
``(code - zero) * scale`` with two packed bf16x2 FMAs. Instructions per weight in the K loop,
counted offline by ``bench/w4a16_sass.py``, are what limits this kernel at small M.

Split K gives small N enough programs to fill the GPU. At one token the splits meet inside the
launch, in a workspace that every launch leaves zero (:func:`counted_workspace`), so a split call
is one launch; from two tokens they may instead add into a zeroed fp32 output that is cast
afterwards (three launches, fewer atomics: the tuner measures both up to 16). On Hopper, up to
64 tokens, the tuner also times the Gluon warpgroup-MMA kernel of ``w4a16_wgmma.py`` (each
weight decoded once for the whole token tile). For large M the launcher can instead dequantize
to bf16 once and call cuBLAS; which path and tile to use is measured once per (M bucket, N, K,
group, zeros, scale dtype, device) and cached (:func:`w4a16_matmul`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .w4a16_format import PACK, W4A16Weight, dequantize
from .w4a16_layout import plane_ptx
from .w4a16_wgmma import STEP, WG_COLUMNS, w4a16_wgmma_kernel

__all__ = [
    "GemmConfig",
    "capture_graph",
    "counted_workspace",
    "interpreted",
    "tune_cached",
    "w4a16_dequantize",
    "w4a16_matmul",
    "w4a16_matmul_reference",
]


MAGIC = tl.constexpr(8388608.0)  # 2**23: the fp32 whose low mantissa bits are the code


@triton.jit
def _plane(words, i: tl.constexpr, magic_zero):
    """Nibble plane ``i`` of int32 ``words`` as fp32 ``code - zero``; ``magic_zero = 2**23 + zero``.

    ``0x4B000000 | code`` read as fp32 is ``2**23 + code`` exactly, so no int->float conversion.
    """
    return (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - magic_zero


_PLANE_RAW = tl.constexpr(tuple(plane_ptx(i, "raw") for i in range(8)))
_PLANE_SCALED = tl.constexpr(tuple(plane_ptx(i, "scaled") for i in range(8)))
_PLANE_OFFSET = tl.constexpr(tuple(plane_ptx(i, "offset") for i in range(8)))


@triton.jit
def _plane_offset(words, i: tl.constexpr, neg_zero, FAST: tl.constexpr):
    """Nibble plane ``i`` as bf16 ``code - zero`` (exact); ``neg_zero`` is bf16 ``-(128 + zero)``
    shaped like ``words``."""
    if FAST:
        return tl.inline_asm_elementwise(
            _PLANE_OFFSET[i], "=r,r,r,r", [words, neg_zero], dtype=tl.bfloat16, is_pure=True, pack=2
        )
    code = ((words >> (4 * i)) & 0xF).to(tl.float32) + 128.0
    return (code + neg_zero.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _plane_raw(words, i: tl.constexpr, FAST: tl.constexpr):
    """Nibble plane ``i`` of int32 ``words`` as bf16 ``128 + code`` (exact)."""
    if FAST:
        return tl.inline_asm_elementwise(
            _PLANE_RAW[i], "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2
        )
    return (((words >> (4 * i)) & 0xF).to(tl.float32) + 128.0).to(tl.bfloat16)


@triton.jit
def _plane_scaled(words, i: tl.constexpr, neg_zero, scale, FAST: tl.constexpr):
    """Nibble plane ``i`` as bf16 ``(code - zero) * scale``, rounded once; ``neg_zero`` is bf16
    ``-(128 + zero)`` and ``scale`` bf16, both shaped like ``words``."""
    if FAST:
        return tl.inline_asm_elementwise(
            _PLANE_SCALED[i], "=r,r,r,r,r", [words, neg_zero, scale],
            dtype=tl.bfloat16, is_pure=True, pack=2,
        )  # fmt: skip
    code = ((words >> (4 * i)) & 0xF).to(tl.float32) + 128.0
    return ((code + neg_zero.to(tl.float32)) * scale.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _load_groups(
    s_ptr, z_ptr, step, offs_r, offs_n, n_mask, row_end, stride_sk,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SWAP: tl.constexpr = False,
):  # fmt: skip
    """Scales (as stored) and bf16 ``-(128 + zero)`` of K step ``step``: ``[1, BN]`` when one group
    spans the step, else ``[R, BN]`` (one row per word row); transposed with ``SWAP``."""
    R: tl.constexpr = BLOCK_K // 8
    one_group: tl.constexpr = GROUP % BLOCK_K == 0
    rows = step * R + offs_r
    if one_group:
        g_row = tl.full((1,), step * BLOCK_K // GROUP, tl.int32)
        r_mask = tl.full((1,), 1, tl.int1)
    else:
        g_row = rows // (GROUP // 8)
        r_mask = rows < row_end
    if SWAP:
        g_off = g_row[None, :] * stride_sk + offs_n[:, None]
        g_mask = r_mask[None, :] & n_mask[:, None]
    else:
        g_off = g_row[:, None] * stride_sk + offs_n[None, :]
        g_mask = r_mask[:, None] & n_mask[None, :]
    if EVEN_N and (one_group or EVEN_K):
        scale = tl.load(s_ptr + g_off)
    else:
        scale = tl.load(s_ptr + g_off, mask=g_mask, other=0.0)
    if HAS_ZEROS:
        if EVEN_N and (one_group or EVEN_K):
            zero = tl.load(z_ptr + g_off).to(tl.float32)
        else:
            zero = tl.load(z_ptr + g_off, mask=g_mask, other=0).to(tl.float32)
        neg_zero = (-128.0 - zero).to(tl.bfloat16)
    else:
        neg_zero = tl.full(scale.shape, -136.0, tl.bfloat16)
    return scale, neg_zero


@triton.jit
def _planes(x):
    """``x [A, B, 8]`` -> its eight ``[A, B]`` slices ``x[:, :, i]`` (register moves only)."""
    BM: tl.constexpr = x.shape[0]
    R: tl.constexpr = x.shape[1]
    e, o = tl.split(tl.reshape(x, (BM, R, 4, 2)))  # i even, odd
    e0, e1 = tl.split(tl.reshape(e, (BM, R, 2, 2)))  # i = 0, 4 | 2, 6
    o0, o1 = tl.split(tl.reshape(o, (BM, R, 2, 2)))  # i = 1, 5 | 3, 7
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_planes(
    x_rows, m_mask, step, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr
):  # fmt: skip
    """The eight strided activation planes ``x[:, step * BLOCK_K + i :: 8]`` of K step ``step``,
    ``[BM, R]`` each (the dot's first operand), or ``[R, BM]`` with ``SWAP`` (its second), from one
    contiguous tile load that Triton pipelines; ``x_rows`` is ``[BM, 1]`` row pointers."""
    R: tl.constexpr = BLOCK_K // 8
    if SWAP:  # [R, BM, 8]
        x_k = step * BLOCK_K + tl.arange(0, R) * 8
        x_ptrs = x_rows[None, :, :] + x_k[:, None, None] + tl.arange(0, 8)[None, None, :]
        x_mask = m_mask[None, :, None] & (x_k < K)[:, None, None]
        if EVEN_K:
            x_mask = m_mask[None, :, None]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    else:  # [BM, BLOCK_K], split in registers: its copy into shared memory runs along K
        x_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x_mask = m_mask[:, None] & (x_k < K)[None, :]
        if EVEN_K:
            x_mask = m_mask[:, None]
        x = tl.load(x_rows + x_k[None, :], mask=x_mask, other=0.0)
        x = tl.reshape(x, (x.shape[0], R, 8))
    return _planes(x)


@triton.jit
def _w4a16_accumulate(
    acc, x_rows, m_mask, qw_ptr, s_ptr, z_ptr, offs_n, n_mask,
    K, stride_qk, stride_sk, step_begin, step_end,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr,
    FAST: tl.constexpr = True, EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False,
    SWAP: tl.constexpr = False,
):  # fmt: skip
    """acc += x[rows, K steps] @ dequant(W)[K steps, offs_n] over K steps
    ``[step_begin, step_end)``; ``x_rows`` points at each activation row's first element. ``acc``
    is ``[BM, BN]``, or with ``SWAP`` its transpose ``[BN, BM]``: the weights are then the
    tensor-core dot's first operand, whose row count is the output columns, so a token tile may
    be 8 rows (``m16n8k16``) instead of 16, half the tensor-core work at M <= 8.

    Per step of ``BLOCK_K = 8 R`` inputs: one ``[R, BN]`` tile of words, and for each nibble plane
    ``i`` a ``[BM, R] x [R, BN]`` dot with the strided activations ``x[:, i::8]`` (loaded as one
    contiguous tile, which Triton pipelines, and split in registers). With one group per step the
    weights go into the dot as ``code - zero`` (one packed fma a pair from ``128 + code``; tiles
    of 16 and 32 rows), or as ``128 + code`` with the offset as a rank-1 term ``xsum[m] * -(128 +
    zero[n])`` (``SWAP``: ``xsum``, the step's sum of each activation row, from one small dot per
    plane against ones) or as a second dot per plane with ``-(128 + zero)`` (taller tiles, which
    Triton runs on ``wgmma``); the scale then multiplies the ``[BM, BN]`` partial sum. With
    smaller groups each weight is decoded to ``(code - zero) * scale``. ``FAST`` selects the
    packed-bf16x2 PTX decode (GPU); the plain-Triton decode computes the same bf16 values (for
    the CPU interpreter). Triton's software pipelining (``num_stages``) prefetches words and
    activations into shared memory; scales and zeros are loaded one step ahead by hand.
    """
    R: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, R)
    row_end = K // 8
    one_group: tl.constexpr = GROUP % BLOCK_K == 0
    # scales and zeros feed no dot, so Triton's pipelining leaves them alone: load them one step
    # ahead by hand (clamped to a real step: the last step reloads its own, harmlessly)
    last_step = tl.cdiv(K, BLOCK_K) - 1
    scale, neg_zero = _load_groups(
        s_ptr, z_ptr, tl.minimum(step_begin, last_step), offs_r, offs_n, n_mask, row_end, stride_sk,
        GROUP, HAS_ZEROS, BLOCK_K, EVEN_K, EVEN_N, SWAP,
    )  # fmt: skip
    for step in range(step_begin, step_end):
        rows = step * R + offs_r
        if SWAP:  # [BN, R]: the words as the dot's first operand wants them
            w_ptrs = qw_ptr + rows[None, :] * stride_qk + offs_n[:, None]
            w_mask = (rows < row_end)[None, :] & n_mask[:, None]
        else:
            w_ptrs = qw_ptr + rows[:, None] * stride_qk + offs_n[None, :]
            w_mask = (rows < row_end)[:, None] & n_mask[None, :]
        if EVEN_K and EVEN_N:
            words = tl.load(w_ptrs)
        else:
            words = tl.load(w_ptrs, mask=w_mask, other=0)
        # one step ahead for the one [1, BN] row of a step-wide group; smaller groups load
        # [R, BN] in this step (a carried copy would cost a layout change through shared memory)
        next_scale, next_neg_zero = _load_groups(
            s_ptr, z_ptr, tl.minimum(step + 1, last_step) if one_group else step, offs_r,
            offs_n, n_mask, row_end, stride_sk, GROUP, HAS_ZEROS, BLOCK_K, EVEN_K, EVEN_N, SWAP,
        )  # fmt: skip
        if not one_group:
            scale, neg_zero = next_scale, next_neg_zero
        xs = _x_planes(x_rows, m_mask, step, K, BLOCK_K, EVEN_K, SWAP)
        if one_group:
            part = tl.zeros(acc.shape, dtype=tl.float32)
            if SWAP:
                ones = tl.full((16, R), 1.0, tl.bfloat16)
                sums = tl.zeros((16, acc.shape[1]), dtype=tl.float32)
                for i in tl.static_range(8):
                    part = tl.dot(_plane_raw(words, i, FAST), xs[i], part)
                    sums = tl.dot(ones, xs[i], sums)
                xsum = tl.max(sums, axis=0)[None, :]  # every row holds the sum
                acc += (part + neg_zero.to(tl.float32) * xsum) * scale.to(tl.float32)
            elif acc.shape[0] <= 32:
                # the offset per weight, one packed fma a pair: a rank-1 term here needs
                # xsum across the warps (shared memory and three more barriers a step)
                offset = tl.broadcast_to(neg_zero, (R, offs_n.shape[0]))
                for i in tl.static_range(8):
                    part = tl.dot(xs[i], _plane_offset(words, i, offset, FAST), part)
                acc += part * scale.to(tl.float32)
            else:  # wgmma tiles: a second dot a plane with -(128 + zero) costs less
                offset = tl.broadcast_to(neg_zero, (R, offs_n.shape[0]))
                for i in tl.static_range(8):
                    part = tl.dot(xs[i], _plane_raw(words, i, FAST), part)
                    part = tl.dot(xs[i], offset, part)
                acc += part * scale.to(tl.float32)
        else:
            for i in tl.static_range(8):
                if s_ptr.dtype.element_ty == tl.bfloat16:
                    w = _plane_scaled(words, i, neg_zero, scale, FAST)
                else:  # fp16 scales: keep them exact (fp32 maths), no packed bf16 scale
                    w = _plane_scaled(words, i, neg_zero, scale, False)
                if SWAP:
                    acc = tl.dot(w, xs[i], acc)
                else:
                    acc = tl.dot(xs[i], w, acc)
        scale, neg_zero = next_scale, next_neg_zero
    return acc


@triton.jit
def _gpu_fence(x, FENCE: tl.constexpr):
    """``x`` after a ``fence.acq_rel.gpu`` in this thread; the result carries the order to
    whatever is computed from it. Without ``FENCE`` (the interpreter, which runs programs one
    after another and has no PTX) just ``x``."""
    if FENCE:
        x = tl.inline_asm_elementwise(
            "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [x],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    return x


@triton.jit
def _add_counted(sums, counts, part, mask, parts, FENCE: tl.constexpr):
    """The parts of a sum (K splits, a token's top-k rows) meet inside one launch: add this
    program's fp32 ``part`` at ``sums`` and count it at ``counts`` (int32), both from
    :func:`counted_workspace` (zero); returns where this program added an element's last of
    ``parts`` parts. That program resets the element's count here and takes its sum with
    :func:`_take_sums`, which resets the sum: the workspace is zero again after every launch,
    so no launch zeroes it and none casts the result.

    Every element has its own count, and every thread learns from its own increments whether it
    was last: no value is broadcast to the program through shared memory. The barrier puts all
    of the program's adds before any of its counts (the compiler may give the adds and the
    counts different thread layouts), and one GPU fence per thread on each side makes them a
    release and an acquire (acquire-release atomics put a fence before every count: the dense
    GEMM at M = 16 took 1.6x). A count per tile instead (one thread's increment, its result
    broadcast) returned wrong tiles in 975 of 4,700 runs on the H200
    (bench/results/w4a16_splitk_stress_fused.json)."""
    tl.atomic_add(sums, part, mask=mask, sem="relaxed")
    tl.debug_barrier()
    zero = _gpu_fence(tl.program_id(0) * 0, FENCE)  # release: every add of the program first
    arrived = tl.atomic_add(counts + zero, 1, mask=mask, sem="relaxed")
    zero = _gpu_fence(tl.min(arrived) * 0, FENCE)  # acquire: after every count
    last = mask & (arrived + zero == parts - 1)
    tl.atomic_xchg(counts, 0, mask=last, sem="relaxed")  # every part has counted: reset
    return last


@triton.jit
def _take_sums(sums, last):
    """The whole sums where ``last`` (read at L2, where the atomics were performed, and reset
    to zero there), 0 elsewhere. The exchange is on the bits (fp32 zero is all-zero bits; the
    interpreter exchanges integers only)."""
    bits = sums.to(tl.pointer_type(tl.int32), bitcast=True)
    total = tl.atomic_xchg(bits, tl.zeros(sums.shape, tl.int32), mask=last, sem="relaxed")
    return tl.where(last, total.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _dependent_launch(PDL: tl.constexpr):
    """Programmatic dependent launch (``GemmConfig.pdl``): 1 waits, before anything is read or
    written, for the kernel before to finish, so this one is launched while that one ends; 2
    also lets the kernel after launch now."""
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()


# one compile for every M of a tile, and for every split count
@triton.jit(do_not_specialize=["M", "split_k"])
def _w4a16_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, split_k,
    stride_xm, stride_qk, stride_sk, stride_om,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, FAST: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    SWAP: tl.constexpr = False, COUNTED: tl.constexpr = False, FENCE: tl.constexpr = True,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    """out[M, N] (+)= x[M, K] @ dequant(W)[K, N] for one (M, N) tile and one of ``split_k`` K
    splits (``SPLIT``: ``split_k > 1``), stored by :func:`_store_tile`."""
    _dependent_launch(PDL)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    # the token tiles of one column tile are neighbours, so they run together and all but the
    # first read its weights from L2
    num_m = tl.cdiv(M, BLOCK_M)
    offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k)
    step_end = tl.minimum(tl.cdiv(K, BLOCK_K), (pid_k + 1) * per_split)
    acc = _w4a16_accumulate(
        tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32),
        x_ptr + offs_m[:, None] * stride_xm, m_mask, qw_ptr, s_ptr, z_ptr, offs_n, n_mask, K,
        stride_qk, stride_sk, pid_k * per_split, step_end, GROUP, HAS_ZEROS, BLOCK_K, FAST,
        EVEN_K, EVEN_N, SWAP,
    )  # fmt: skip
    if SWAP:  # acc is [BN, BM]: address the output transposed
        idx = offs_m[None, :] * stride_om + offs_n[:, None]
        o_mask = m_mask[None, :] & n_mask[:, None]
    else:
        idx = offs_m[:, None] * stride_om + offs_n[None, :]
        o_mask = m_mask[:, None] & n_mask[None, :]
    _store_tile(out_ptr, ws_ptr, cnt_ptr, idx, acc, o_mask, split_k, SPLIT, COUNTED, FENCE)


@triton.jit
def _store_tile(
    out_ptr, ws_ptr, cnt_ptr, idx, acc, mask, split_k,
    SPLIT: tl.constexpr, COUNTED: tl.constexpr, FENCE: tl.constexpr,
):  # fmt: skip
    """Store one program's fp32 ``acc`` at ``idx``: unsplit, cast to the output; split K and
    ``COUNTED``, met in the workspace (:func:`_add_counted`) and stored as bf16 by the program
    that adds an element's last part (one launch); split K otherwise, added into a zeroed fp32
    output that the caller casts (three launches)."""
    if not SPLIT:
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif COUNTED:
        last = _add_counted(ws_ptr + idx, cnt_ptr + idx, acc, mask, split_k, FENCE)
        res = _take_sums(ws_ptr + idx, last)
        tl.store(out_ptr + idx, res.to(out_ptr.dtype.element_ty), mask=last)
    else:
        tl.atomic_add(out_ptr + idx, acc, mask=mask, sem="relaxed")


# CUDA-core decode for one token (the GEMV path). Nibbles 0 and 4 of a word are
# ``w & 0x000F000F`` and nibbles 1 and 5 ``w & 0x00F000F0``; or-ed into fp16 ``0x6400`` (1024,
# mantissa step 1) they read as 1024 + n and 1024 + 16 n. One fp16x2 fma per pair then gives
# (n - zero) / 64 exactly, and the products with the fp16 activation pairs (x_i, x_i+4) are
# summed in fp16x2 over the word's eight inputs. The 1/64 keeps every product and partial sum
# of any fp16 activation below fp16's 65504 (|n - zero| <= 15, four products a lane), so the
# only range limit is the activations' own rounding to fp16 (|x| < 65504); the scales are
# multiplied by 64.
_GEMV_WORD_ASM = """{
.reg .b32 t, lo, mi, acc, c16, c1024, klo, kmi;
.reg .b16 h0, h1;
.reg .f32 f0, f1;
mov.b32 c16, 0x24002400;
mov.b32 c1024, 0x14001400;
lop3.b32 lo, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 mi, $1, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 lo, lo, c16, $6;
fma.rn.f16x2 mi, mi, c1024, $7;
mul.rn.f16x2 acc, lo, $2;
fma.rn.f16x2 acc, mi, $3, acc;
shr.u32 t, $1, 8;
lop3.b32 lo, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 mi, t, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 lo, lo, c16, $6;
fma.rn.f16x2 mi, mi, c1024, $7;
fma.rn.f16x2 acc, lo, $4, acc;
fma.rn.f16x2 acc, mi, $5, acc;
mov.b32 {h0, h1}, acc;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 $0, f0, f1;
}"""


def _gemv_x_asm() -> str:
    """PTX: four bf16x2 words (x0, x1) (x2, x3) (x4, x5) (x6, x7) -> fp16x2 (x0, x4) (x1, x5)
    (x2, x6) (x3, x7). ``prmt`` pairs the halves, a shift or a mask widens each bf16 to fp32,
    one ``cvt`` rounds both to fp16."""
    body = ""
    for out, (lo, hi, sel) in enumerate(((4, 6, "0x5410"), (4, 6, "0x7632"),
                                         (5, 7, "0x5410"), (5, 7, "0x7632"))):  # fmt: skip
        body += (f"prmt.b32 p, ${lo}, ${hi}, {sel}; shl.b32 a, p, 16; "
                 f"and.b32 b, p, 0xFFFF0000; cvt.rn.f16x2.f32 ${out}, b, a; ")  # fmt: skip
    return "{ .reg .b32 p, a, b; " + body + "}"


_GEMV_X = tl.constexpr(_gemv_x_asm())
_GEMV_WORD = tl.constexpr(_GEMV_WORD_ASM)
_GEMV_KLO_SYMMETRIC = tl.constexpr(-0x33F733F8)  # bits 0xCC08CC08
_GEMV_KMI_SYMMETRIC = tl.constexpr(-0x437F4380)  # bits 0xBC80BC80


@triton.jit
def _gemv_word_sums(words, x_base, x_ok, zero, HAS_ZEROS: tl.constexpr, FAST: tl.constexpr):
    """fp32 ``sum_i (code_i - zero) * x[i]`` of each int32 word (8 inputs of one output);
    ``x_base`` points at each word row's 8 bf16 activations. With ``FAST`` (the fp16x2 PTX
    decode) the sums are in units of 1/64; without, exact fp32 products (the interpreter)."""
    if FAST:
        xw = x_base.to(tl.pointer_type(tl.int32), bitcast=True)
        x01 = tl.load(xw, mask=x_ok, other=0)
        x23 = tl.load(xw + 1, mask=x_ok, other=0)
        x45 = tl.load(xw + 2, mask=x_ok, other=0)
        x67 = tl.load(xw + 3, mask=x_ok, other=0)
        x04, x15, x26, x37 = tl.inline_asm_elementwise(
            _GEMV_X, "=r,=r,=r,=r,r,r,r,r", [x01, x23, x45, x67],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
        if HAS_ZEROS:
            klo = (-16.0 - zero / 64.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
            kmi = (-1.0 - zero / 64.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
            klo = (klo & 0xFFFF) | (klo << 16)
            kmi = (kmi & 0xFFFF) | (kmi << 16)
        else:  # zero point 8: fp16x2 (-16.125, -16.125) and (-1.125, -1.125)
            klo = tl.full((1, 1), _GEMV_KLO_SYMMETRIC, tl.int32)
            kmi = tl.full((1, 1), _GEMV_KMI_SYMMETRIC, tl.int32)
        return tl.inline_asm_elementwise(
            _GEMV_WORD, "=r,r,r,r,r,r,r,r", [words, x04, x15, x26, x37, klo, kmi],
            dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    total = tl.zeros(words.shape, tl.float32)
    for i in tl.static_range(8):
        code = ((words >> (4 * i)) & 0xF).to(tl.float32)
        x_i = tl.load(x_base + i, mask=x_ok, other=0.0).to(tl.float32)
        total += (code - zero) * x_i
    return total


@triton.jit
def _gemv_load_words(
    qw_ptr, step, offs_r, offs_n, n_mask, rows_total, stride_qk,
    BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_R, BLOCK_N]`` words of K step ``step``."""
    rows = step * BLOCK_R + offs_r
    w_ptrs = qw_ptr + rows[:, None] * stride_qk + offs_n[None, :]
    if EVEN_K and EVEN_N:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(rows < rows_total)[:, None] & n_mask[None, :], other=0)


@triton.jit
def _gemv_step(
    acc, words, step, x_row, s_ptr, z_ptr, offs_r, offs_n, n_mask, rows_total, stride_sk,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_R: tl.constexpr,
    FAST: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """``acc`` plus K step ``step``'s words (loaded by the caller) times the activations at
    ``x_row`` and the scales."""
    rows = step * BLOCK_R + offs_r
    r_mask = rows < rows_total
    if EVEN_K:  # no masks: a masked load zeroes its registers first
        r_mask = tl.full((BLOCK_R,), 1, tl.int1)
    mask = r_mask[:, None] & n_mask[None, :]
    # [BLOCK_R, BLOCK_N] like the words (rows of one group repeat, from L1): a [1, BLOCK_N]
    # load gets another layout, and the accumulator then changes layout every step
    g_off = (rows // (GROUP // 8))[:, None] * stride_sk + offs_n[None, :]
    if EVEN_K and EVEN_N:
        scale = tl.load(s_ptr + g_off)
    else:
        scale = tl.load(s_ptr + g_off, mask=mask, other=0.0)
    scale = scale.to(tl.float32) * (64.0 if FAST else 1.0)  # the word sums' unit with FAST
    if HAS_ZEROS:
        zero = tl.load(z_ptr + g_off, mask=mask, other=0).to(tl.float32)
    else:
        zero = tl.full((1, offs_n.shape[0]), 8.0, tl.float32)
    x_base = x_row + rows[:, None] * 8
    return acc + _gemv_word_sums(words, x_base, r_mask[:, None], zero, HAS_ZEROS, FAST) * scale


@triton.jit
def _gemv_sum(
    x_row, qw_ptr, s_ptr, z_ptr, offs_n, n_mask, K, split_k, stride_qk, stride_sk,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, FAST: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_N]``: the activations at ``x_row`` times the dequantized columns
    ``offs_n``, over this program's part (``program_id(1)`` of ``split_k``) of K, on CUDA cores:
    per step a ``[BLOCK_R, BLOCK_N]`` tile of words is decoded in the registers it was loaded
    into (no layout change), each word's eight products summed by :func:`_gemv_word_sums` and
    multiplied by its scale into an fp32 accumulator of the same shape, reduced over its rows
    once at the end.

    Triton pipelines only loads that feed a dot, so the next step's words are loaded into
    registers before this step's are decoded (the last step reloads its own). Loads pipelined
    through shared memory instead (``tl.range(..., num_stages=3)``) measured slower on the
    H200 (27.6 against 26.4 us, bench/results/w4a16_gemm_v5.json)."""
    offs_r = tl.arange(0, BLOCK_R)
    rows_total = K // 8
    steps = tl.cdiv(rows_total, BLOCK_R)
    per_split = tl.cdiv(steps, split_k)
    step_begin = tl.program_id(1) * per_split
    step_end = tl.minimum(steps, step_begin + per_split)
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    words = _gemv_load_words(
        qw_ptr, tl.minimum(step_begin, steps - 1), offs_r, offs_n, n_mask, rows_total,
        stride_qk, BLOCK_R, EVEN_K, EVEN_N,
    )  # fmt: skip
    for step in range(step_begin, step_end):
        next_words = _gemv_load_words(
            qw_ptr, tl.minimum(step + 1, step_end - 1), offs_r, offs_n, n_mask, rows_total,
            stride_qk, BLOCK_R, EVEN_K, EVEN_N,
        )  # fmt: skip
        acc = _gemv_step(
            acc, words, step, x_row, s_ptr, z_ptr, offs_r, offs_n, n_mask, rows_total,
            stride_sk, GROUP, HAS_ZEROS, BLOCK_R, FAST, EVEN_K, EVEN_N,
        )  # fmt: skip
        words = next_words
    return tl.sum(acc, axis=0)


@triton.jit(do_not_specialize=["M", "split_k"])
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, split_k,
    stride_xm, stride_qk, stride_sk, stride_om,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, FAST: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    COUNTED: tl.constexpr = False, FENCE: tl.constexpr = True, PDL: tl.constexpr = 0,
):  # fmt: skip
    """out[m, N tile] (+)= x[m] @ dequant(W) for one token, one ``BLOCK_N`` column tile and one
    of ``split_k`` K parts, without tensor cores (:func:`_gemv_sum`). The tokens of a column
    tile are neighbouring programs, so all but the first read it from L2."""
    _dependent_launch(PDL)
    pid = tl.program_id(0)
    m = pid % M
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    res = _gemv_sum(
        x_ptr + m * stride_xm, qw_ptr, s_ptr, z_ptr, offs_n, n_mask, K, split_k, stride_qk,
        stride_sk, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_R, FAST, EVEN_K, EVEN_N,
    )  # fmt: skip
    _store_tile(out_ptr, ws_ptr, cnt_ptr, m * stride_om + offs_n, res, n_mask, split_k, SPLIT,
                COUNTED, FENCE)  # fmt: skip


@triton.jit
def _w4a16_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_qk, stride_sk, stride_ok,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[K, N] = dequant(W) in bf16, for the large-M dequantize + cuBLAS path."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K // 8)[:, None] & (offs_n < N)[None, :]
    words = tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :], mask=mask, other=0)
    g_off = (rows // (GROUP // 8))[:, None] * stride_sk + offs_n[None, :]
    scale = tl.load(s_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + g_off, mask=mask, other=0).to(tl.float32) + MAGIC
    else:
        zero = MAGIC + 8.0
    for i in tl.static_range(8):
        w = _plane(words, i, zero) * scale
        dst = out_ptr + (rows * 8 + i)[:, None] * stride_ok + offs_n[None, :]
        tl.store(dst, w.to(tl.bfloat16), mask=mask)


@dataclass(frozen=True)
class GemmConfig:
    """One way to run the GEMM: ``path`` is ``"triton"`` (the tensor-core kernel), ``"gemv"``
    (the CUDA-core kernel for one token; ``block_m`` and ``num_stages`` unused), ``"wgmma"``
    (the Gluon kernel of ``w4a16_wgmma.py``, Hopper: ``block_m`` tokens a tile, 64 columns a
    warpgroup, ``num_stages`` slots in its ring of words; ``pdl`` 0 or 1) or
    ``"dequant_cublas"`` (dequantize to bf16, then torch's matmul)."""

    path: str = "triton"
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fast_decode: bool = True  # packed-bf16x2 PTX decode on the GPU (False: plain Triton)
    swap: bool = False  # weights as the dot's first operand: acc [BN, BM], 8-row token tiles
    # K splits meet in the self-resetting workspace, one launch (False: fp32 atomics into a
    # zeroed output, then a cast: three launches)
    counted: bool = True
    # programmatic dependent launch (Hopper on): 0 off; 1 launched while the kernel before ends
    # (waiting for its results before reading); 2 also letting the kernel after launch at once.
    # The decode slice's seven dense linears at one token: 1 took 0.94x the time of 0, 2 1.15x
    # (bench/results/w4a16_pdl.json): 1 by default
    pdl: int = 1


_TUNED: dict[tuple, object] = {}


def _m_bucket(m: int) -> int:
    return min(1 << max(m - 1, 0).bit_length(), 4096)


def _split_counts(tiles: int) -> list[int]:
    """K splits worth timing for ``tiles`` output tiles on a 132-SM H200: the most that keep
    one program per SM (the longest K loops: the MoE's up GEMM, 128 programs of 56 steps,
    streamed faster than this GEMM's four splits of 14), the fewest that give every SM a
    program, and enough for about four programs per SM (up to 32 splits: a counted split costs
    no launch, so a narrow matrix at one token may take one program per SM of short K loops)."""
    one_wave = max((s for s in (1, 2, 4, 8) if tiles * s <= 132), default=1)
    fill = next((s for s in (1, 2, 4, 8) if tiles * s >= 132), 8)
    deep = next((s for s in (2, 4, 8, 16, 32) if tiles * s >= 4 * 132), 32)
    return sorted({one_wave, fill, deep})


def _reductions(m: int) -> tuple[bool, ...]:
    """How K splits may meet at ``m`` rows (``GemmConfig.counted``). Same tiles side by side on
    the H200 (bench/results/w4a16_gemm_selfreset.json): counted in the launch won at M = 1 on
    all seven shapes (by 1.0-1.8 us a call: the zeroing and the cast), the three-launch split
    at M = 64 on all five where the tuner split K (up to 1.3x: an element's count and exchange
    are two more atomics, M x N of them per split); at M = 16 each won somewhere."""
    if m == 1:
        return (True,)
    return (True, False) if m <= 16 else (False,)


def _tile_configs(m: int, n: int, tiles: list[tuple], swap: bool) -> list[GemmConfig]:
    """Each ``(block_m, block_n, warps, stages)`` tile with its split counts and, split, the
    ways its splits may meet."""
    out = []
    for bm, bn, warps, stages in tiles:
        for s in _split_counts(triton.cdiv(n, bn) * triton.cdiv(m, bm)):
            for counted in _reductions(m) if s > 1 else (True,):
                out.append(GemmConfig("triton", bm, bn, 128, s, warps, stages, swap=swap,
                                      counted=counted))  # fmt: skip
    return out


def _candidates(m: int, n: int, k: int) -> list[GemmConfig]:
    """Tiles worth timing for this shape: weight-streaming tiles up to M = 64, larger tiles and
    the dequantize + cuBLAS fall-back beyond.

    Up to M = 64 the weights are the dot's first operand (``swap``): the token tile is then the
    MMA's N (8 rows at M <= 8, half the tensor-core work of the 16-row minimum of the other
    orientation; 16 to 64 rows use Hopper's ``wgmma``), and the zero-point offset is a rank-1
    term instead of a second dot. The previous orientation (16- and 32-row tiles, offset per weight)
    stays as a candidate. Offline SASS counts (``bench/w4a16_sass.py``) are in the docs.
    """
    if m > 64:
        out = [GemmConfig("triton", bm, 128, 128, 1, 8, 3) for bm in (64, 128)]
        out.append(GemmConfig("triton", 128, 128, 128, 1, 8, 3, swap=True))
        return [*out, GemmConfig("dequant_cublas")]
    # 8-row tiles above M = 8 decode each weight once per token tile; the token tiles of a
    # column tile run side by side, so the extra reads come from L2 (measured faster at M = 1
    # than 16-row tiles; 16- and 64-row weights-first tiles use wgmma and measured slower)
    swapped = [(8, 128, 4, 4), (8, 256, 4, 4), (8, 256, 8, 4)] if m <= 16 else [(8, 256, 4, 4)]
    previous = [(16, 256, 4, 4)] if m <= 16 else [(16, 256, 4, 4), (32, 128, 4, 4)]
    if m > 16:
        swapped.append((64, 256, 8, 3))
    out = _tile_configs(m, n, swapped, swap=True) + _tile_configs(m, n, previous, swap=False)
    if m <= 16:  # no K split: narrow column tiles, deep pipelines
        out += [GemmConfig("triton", 8, bn, 128, 1, 4, stages, swap=True)
                for bn in (32, 64, 128) for stages in (4, 8)]  # fmt: skip
    if m == 1:  # the CUDA-core path decodes the words once per token: slower from M = 2 (v5)
        # narrow column tiles: more programs for the slice's small linears (0.9-7.6 MB, bound
        # by each call's latency, not its bytes)
        for bn, bk in ((128, 128), (256, 64), (64, 128), (32, 128)):
            for s in _split_counts(triton.cdiv(n, bn) * m):
                out.append(GemmConfig("gemv", 1, bn, bk, s, 4))
    return out


def _wgmma_tiles(x: torch.Tensor, w: W4A16Weight) -> list[GemmConfig]:
    """The Gluon kernel's tiles where it runs (sm_90, symmetric codes, bf16 scales, K a
    multiple of its step, up to 64 tokens): one token tile of the M bucket's size (from 8); one
    warpgroup with a ring of 4 or 8 slots, or from 16 tokens two sharing the activations; each
    with the split counts of its tile count, launched plainly (splits added into a zeroed
    output) and dependently (splits met in the workspace), side by side for the tuner."""
    m = x.shape[0]
    runs = (
        not interpreted() and m <= 64 and w.zeros is None and w.scales.dtype == torch.bfloat16
        and w.k % STEP.value == 0
        and torch.cuda.get_device_capability(x.device) == (9, 0)
    )  # fmt: skip
    if not runs:
        return []
    bm = max(8, _m_bucket(m))
    out = []
    for warps, stages in ((4, 4), (4, 8), (8, 4)) if bm >= 16 else ((4, 4), (4, 8)):
        bn = WG_COLUMNS.value * warps // 4
        for s in _split_counts(triton.cdiv(w.n, bn)):
            for one_launch in (False, True):
                out.append(GemmConfig("wgmma", bm, bn, STEP.value, s, warps, stages,
                                      counted=one_launch, pdl=int(one_launch)))  # fmt: skip
    return out


def _check(x: torch.Tensor, w: W4A16Weight) -> None:
    if w.qweight.dim() != 2:
        raise ValueError("w4a16_matmul takes one weight [K/8, N]; use w4a16_moe for experts")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x must be bf16 [M, {w.k}], got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1 or w.qweight.stride(1) != 1 or w.scales.stride(1) != 1:
        raise ValueError("x, qweight and scales must be contiguous in their last dim")
    if x.device != w.qweight.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.qweight.device}")


def w4a16_dequantize(w: W4A16Weight) -> torch.Tensor:
    """The weight as bf16 ``[K, N]`` (the transpose of ``W``), computed by a Triton kernel."""
    out = torch.empty((w.k, w.n), dtype=torch.bfloat16, device=w.qweight.device)
    r, bn = 16, 128
    zeros = w.zeros if w.zeros is not None else w.scales
    grid = (triton.cdiv(w.k // PACK, r), triton.cdiv(w.n, bn))
    _w4a16_dequant_kernel[grid](
        w.qweight, w.scales, zeros, out, w.n, w.k,
        w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        GROUP=w.group_size, HAS_ZEROS=w.zeros is not None, R=r, BLOCK_N=bn,
    )  # fmt: skip
    return out


_WORKSPACES: dict[tuple[torch.device, int], list[torch.Tensor]] = {}


def counted_workspace(device: torch.device, sums: int, counts: int) -> tuple[torch.Tensor, ...]:
    """fp32 ``sums`` and int32 ``counts`` for kernels whose parts meet in one launch
    (:func:`_add_counted`): zero, and zero again after each such launch, so one buffer serves
    every call in stream order, with no zeroing launch.

    One buffer per stream: kernels on two streams may run at once and must not meet in one
    buffer. SGLang's CUDA-graph decode does this to DeepSeek-style models: the shared expert on
    a second stream beside the router and the routed experts, and for DSA models (GLM 5) the
    q_b projection beside the indexer.

    A buffer grows (to twice the size) only outside CUDA-graph capture, and none is ever
    freed: a captured graph keeps the addresses it was captured with. So each batch size must
    run once on a stream before a graph is captured on it (:func:`capture_graph` does; SGLang
    warms up on its capture stream and its second stream before capturing)."""
    device = torch.device(device)
    stream = 0
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = torch.cuda.current_stream(device).cuda_stream
    buffers = _WORKSPACES.setdefault((device, stream), [])
    if not buffers or buffers[-1].numel() < sums + counts:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the W4A16 workspace of stream {stream:#x} on {device} must grow to "
                f"{sums + counts} elements while a CUDA graph is being captured: run this batch "
                "size once on the capturing stream before capturing"
            )
        size = max(sums + counts, 2 * buffers[-1].numel() if buffers else 1 << 16)
        buffers.append(torch.zeros(size, dtype=torch.float32, device=device))
    buf = buffers[-1]
    return buf[:sums], buf[sums : sums + counts].view(torch.int32)


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_graph(fn: Callable[[], object], warmups: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn``, warmed up (compiled, tuned, workspaces sized) and captured on one
    side stream of the current device: the workspace is per stream, so a graph must be captured
    on the stream it was warmed up on. Replay it on any stream."""
    device = torch.device("cuda", torch.cuda.current_device())
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    stream = _CAPTURE_STREAMS[device]
    stream.wait_stream(torch.cuda.current_stream(device))  # after what ran before, e.g. replays
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def _run(x: torch.Tensor, w: W4A16Weight, cfg: GemmConfig) -> torch.Tensor:
    m = x.shape[0]
    if cfg.path == "dequant_cublas":
        return x @ w4a16_dequantize(w)
    split = cfg.split_k > 1
    counted = split and cfg.counted
    if split and not counted:  # fp32 atomics into a zeroed output, cast afterwards
        out = torch.zeros((m, w.n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, w.n), dtype=torch.bfloat16, device=x.device)
    sums, counts = out, out  # unused pointers unless counted
    if counted:  # sized for the M bucket: a capture at a larger M of the bucket must not grow it
        sums, counts = counted_workspace(x.device, _m_bucket(m) * w.n, _m_bucket(m) * w.n)
    dependent = cfg.pdl and not interpreted() and _dependent_launches(x.device.index or 0)
    pdl = cfg.pdl if dependent else 0
    if cfg.path == "wgmma":
        grid = (triton.cdiv(w.n, cfg.block_n) * triton.cdiv(m, cfg.block_m), cfg.split_k)
        w4a16_wgmma_kernel[grid](
            x, w.qweight, w.scales, out, sums, counts, m, w.n, w.k, cfg.split_k,
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
            GROUP=w.group_size, BM=cfg.block_m, SPLIT=split, STAGES=cfg.num_stages,
            COUNTED=counted, PDL=pdl == 1, num_warps=cfg.num_warps,
            **({"launch_pdl": True} if pdl == 1 else {}),
        )  # fmt: skip
        return out.to(torch.bfloat16)  # a copy only of zeroed-output fp32 sums
    zeros = w.zeros if w.zeros is not None else w.scales  # unused pointer when symmetric
    args = (
        x, w.qweight, w.scales, zeros, out, sums, counts, m, w.n, w.k, cfg.split_k,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
    )  # fmt: skip
    common = {
        "GROUP": w.group_size, "HAS_ZEROS": w.zeros is not None, "BLOCK_N": cfg.block_n,
        "SPLIT": split, "COUNTED": counted, "FENCE": not interpreted(),
        "FAST": cfg.fast_decode and not interpreted(),
        "EVEN_K": w.k % cfg.block_k == 0, "EVEN_N": w.n % cfg.block_n == 0,
        "num_warps": cfg.num_warps,
    }  # fmt: skip
    if pdl:
        common |= {"PDL": pdl, "launch_pdl": True}
    if cfg.path == "gemv":
        _w4a16_gemv_kernel[(triton.cdiv(w.n, cfg.block_n) * m, cfg.split_k)](
            *args, BLOCK_R=cfg.block_k // PACK, num_stages=1, **common
        )
    else:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(w.n, cfg.block_n)
        _w4a16_gemm_kernel[(tiles, cfg.split_k)](
            *args, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, SWAP=cfg.swap,
            num_stages=cfg.num_stages, **common,
        )  # fmt: skip
    return out.to(torch.bfloat16)  # a copy only of zeroed-output fp32 sums


_FLUSH: dict[torch.device, torch.Tensor] = {}


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer twice the size of the GPU's L2 cache: reading it evicts the weights."""
    if device not in _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
        _FLUSH[device] = torch.zeros(2 * max(l2, 8 << 20) // 4, dtype=torch.int32, device=device)
    return _FLUSH[device]


def _graph_time(fn: Callable[[], object], calls: int = 16, replays: int = 9) -> float:
    """Median time of ``fn`` from CUDA-graph replays, each call after an L2 flush (the same for
    every candidate), so weights stream from HBM as in decode. The flush reads a buffer twice
    the L2's size. Timed side by side with the bench's cycled weight sets on the decode slice's
    seven linears (bench/results/w4a16_gemm_tuner_flush.json): with a memset as the flush the
    tuner's picks were 3.2 us slower in all than the fastest at one token (1.2-1.5 us on two
    linears), with the read 0.5 us (1.0 on a later machine start); at 16 tokens -0.1 and 0.7
    (0.0) us. Reading the activations back
    into the L2 after it changed no pick beyond that spread (w4a16_gemm_tuner_warm.json).
    Eager timing of these short calls would measure Python launch overhead, not the GPU (tile
    choices became noise)."""
    times = replay_times(flushed_graph(fn, calls), replays)
    return sorted(times)[len(times) // 2]


def flushed_graph(fn: Callable[[], object], calls: int = 16) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, each after an L2 flush, replayed once."""
    flush = _l2_flush_buffer(torch.device("cuda", torch.cuda.current_device()))

    def flushed_calls() -> None:
        for _ in range(calls):
            flush.max()
            fn()

    graph = capture_graph(flushed_calls)
    graph.replay()
    return graph


def replay_times(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """Milliseconds of each of ``replays`` replays of ``graph``."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def tune_cached(key: tuple, candidates: Callable[[], list], run: Callable) -> object:
    """The candidate for which ``run(candidate)`` is fastest on the GPU, measured once per key
    (candidates that fail to compile, e.g. out of shared memory, are skipped); ``candidates()``
    lists them, called only when the key is new (not on every decode call). One candidate after
    another: timed in three interleaved rounds instead, the MoE's picks were no faster
    (docs/kernels-int4.md, v17)."""
    if key not in _TUNED:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"no tuned config for {key} while a CUDA graph is being captured: run this "
                "shape once before capturing (or pass a config)"
            )
        times = {}
        candidates = candidates()
        for c in candidates:
            try:
                times[c] = _graph_time(lambda c=c: run(c))
            except (triton.runtime.errors.OutOfResources, triton.CompilationError):
                continue
        if not times:
            raise RuntimeError(f"no candidate config compiled for {key}: {candidates}")
        _TUNED[key] = min(times, key=times.__getitem__)
    return _TUNED[key]


@functools.cache
def _dependent_launches(device_index: int) -> bool:
    """Whether the GPU has grid dependency control (sm_90 on)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def interpreted() -> bool:
    """True when kernels run under the Triton interpreter (CPU), where nothing is tuned."""
    return os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()


def w4a16_matmul(x: torch.Tensor, w: W4A16Weight, config: GemmConfig | None = None) -> torch.Tensor:
    """``x [M, K] bf16 @ W.T -> [M, N] bf16`` for an INT4 weight.

    Without ``config`` the path and tile are tuned on first use of each (M bucket, shape) on the
    GPU; call once per bucket before capturing CUDA graphs. Under the Triton interpreter a small
    fixed tile is used.
    """
    _check(x, w)
    if x.shape[0] == 0:
        return x.new_empty((0, w.n))
    if config is None and interpreted():
        config = GemmConfig(block_n=32)
    if config is None:
        m = x.shape[0]
        key = ("gemm", _m_bucket(m), w.n, w.k, w.group_size, w.zeros is not None,
               w.scales.dtype, torch.cuda.get_device_name(x.device))  # fmt: skip
        config = tune_cached(key, lambda: _candidates(m, w.n, w.k) + _wgmma_tiles(x, w),
                             lambda c: _run(x, w, c))  # fmt: skip
    return _run(x, w, config)


def w4a16_matmul_reference(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """fp32 ``x @ dequant(W).T`` in pure torch (what the kernel must match)."""
    return x.float() @ dequantize(w, torch.float32).transpose(-1, -2)
