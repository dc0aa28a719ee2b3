"""Fused MoE over INT4 (W4A16) experts, in Triton, with a bf16-expert twin for comparison.

``y[t] = sum_j topk_weight[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
``e = topk_ids[t, j]``. The (token, expert) pairs are sorted by expert into blocks of ``BLOCK_M``
rows (:func:`align_to_experts`); each program multiplies one block by one N tile of its expert's
weight, so each expert weight tile is read once per block however many tokens chose it. At decode
sizes (a few tokens, top-8) almost every block holds one pair and the time is the bytes of the
experts touched, which is why INT4 pays.

Weights are K-major (``[E, K, N]`` as in :mod:`tessera.kernels.w4a16_format`): ``w13`` maps hidden
``H`` to ``2 I`` (gate columns first, then up), ``w2`` maps ``I`` to ``H``. The same kernel runs
bf16 experts (plain ``[E, K, N]`` tensors) with only the weight decode changed, for benchmarks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .w4a16_format import W4A16Weight, dequantize
from .w4a16_gemm import (
    _add_counted,
    _dependent_launch,
    _dependent_launches,
    _gemv_sum,
    _split_counts,
    _take_sums,
    _w4a16_accumulate,
    _x_planes,
    counted_workspace,
    interpreted,
    tune_cached,
)

__all__ = [
    "MoeConfig",
    "align_to_experts",
    "align_to_experts_reference",
    "fused_moe",
    "fused_moe_reference",
    "moe_gemm",
]


@triton.jit
def _bf16_accumulate(
    acc, x_rows, m_mask, w_ptr, offs_n, n_mask, K, stride_wk, step_begin, step_end,
    BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    """The bf16 twin of ``_w4a16_accumulate``: same K steps, same activation tile split into the
    same eight strided planes, same dots (and the same ``SWAP`` orientation)."""
    R: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, R)
    for step in range(step_begin, step_end):
        k_rows = step * BLOCK_K + offs_r * 8
        xs = _x_planes(x_rows, m_mask, step, K, BLOCK_K, False, SWAP)
        for i in tl.static_range(8):
            k_mask = (k_rows + i) < K
            if SWAP:
                w = tl.load(
                    w_ptr + (k_rows + i)[None, :] * stride_wk + offs_n[:, None],
                    mask=k_mask[None, :] & n_mask[:, None], other=0.0,
                )  # fmt: skip
                acc = tl.dot(w, xs[i], acc)
            else:
                w = tl.load(
                    w_ptr + (k_rows + i)[:, None] * stride_wk + offs_n[None, :],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0,
                )  # fmt: skip
                acc = tl.dot(xs[i], w, acc)
    return acc


@triton.jit
def _silu_mul_values(gate, up):
    """bf16 ``silu(gate) * up`` of fp32 sums, each rounded to bf16 first as a stored ``h`` would
    be."""
    gate = gate.to(tl.bfloat16).to(tl.float32)
    up = up.to(tl.bfloat16).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16)


@triton.jit
def _gate_up(acc, SWAP: tl.constexpr):
    """The gate and up halves of an accumulator whose first half of columns (rows with
    ``SWAP``) is gate and second half up."""
    if SWAP:  # [2 H, BM] -> [H, BM, 2]
        halves = tl.permute(tl.reshape(acc, (2, acc.shape[0] // 2, acc.shape[1])), (1, 2, 0))
    else:  # [BM, 2 H] -> [BM, H, 2]
        halves = tl.permute(tl.reshape(acc, (acc.shape[0], 2, acc.shape[1] // 2)), (0, 2, 1))
    return tl.split(halves)


@triton.jit
def _gate_up_columns(tile, out_n, BLOCK_N: tl.constexpr):
    """A column tile's ``BLOCK_N / 2`` gate columns, then the matching up columns (``out_n``
    further), and which of them exist."""
    OUT_BN: tl.constexpr = BLOCK_N // 2
    lanes = tl.arange(0, BLOCK_N)
    col = tile * OUT_BN + lanes % OUT_BN
    return col + (lanes // OUT_BN) * out_n, col < out_n


@triton.jit
def _grid(rows, cols, row_stride, m_mask, o_mask, SWAP: tl.constexpr):
    """Offsets and mask of an output tile (``[cols, rows]`` with ``SWAP``)."""
    if SWAP:
        idx, mask = rows[None, :] * row_stride + cols[:, None], m_mask[None, :] & o_mask[:, None]
    else:
        idx, mask = rows[:, None] * row_stride + cols[None, :], m_mask[:, None] & o_mask[None, :]
    return idx, mask


@triton.jit
def _epilogue(
    acc, out_ptr, ws_ptr, cnt_ptr, pairs, m_mask, offs_o, o_mask, out_n, routing_ptr, parts,
    sum_rows,
    MUL_ROUTING: tl.constexpr, SILU_MUL: tl.constexpr, COUNTED: tl.constexpr,
    SWAP: tl.constexpr, FENCE: tl.constexpr,
):  # fmt: skip
    """Store a tile of fp32 sums for ``pairs`` as bf16: ``silu(gate) * up`` with ``SILU_MUL``,
    times the routing weight with ``MUL_ROUTING``.

    ``COUNTED``: the tile is one of ``parts`` parts of its sums (K splits, and with ``sum_rows``
    > 1 the pairs summed into one output row: a token's top-k experts), met in the fp32 sums
    ``ws`` (``[rows, 2 out_n]`` with ``SILU_MUL``) and the int32 counts ``cnt`` (``[rows,
    out_n]``) by :func:`_add_counted`; the program that adds an element's last
    part stores it, at row ``pair // sum_rows``. Gate and up are added, then counted once, by
    the thread that holds both."""
    if MUL_ROUTING:
        gain = tl.load(routing_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)
        acc = acc * (gain[None, :] if SWAP else gain[:, None])
    rows = pairs.to(tl.int64) // sum_rows
    idx, mask = _grid(rows, offs_o, out_n, m_mask, o_mask, SWAP)
    if SILU_MUL:
        gate, up = _gate_up(acc, SWAP)
        if COUNTED:
            sums = ws_ptr + _grid(rows, offs_o, 2 * out_n, m_mask, o_mask, SWAP)[0]
            tl.atomic_add(sums + out_n, up, mask=mask, sem="relaxed")
            mask = _add_counted(sums, cnt_ptr + idx, gate, mask, parts, FENCE)
            gate = _take_sums(sums, mask)
            up = _take_sums(sums + out_n, mask)
        res = _silu_mul_values(gate, up)
    else:
        res = acc
        if COUNTED:
            mask = _add_counted(ws_ptr + idx, cnt_ptr + idx, acc, mask, parts, FENCE)
            res = _take_sums(ws_ptr + idx, mask)
    tl.store(out_ptr + idx, res.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "split_k", "sum_rows"])
def _moe_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, pair_ids_ptr, block_expert_ptr,
    routing_ptr, N, K, num_pairs, rows_per_x, split_k, sum_rows,
    stride_xm, stride_we, stride_wk, stride_se, stride_sk,
    INT4: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, MUL_ROUTING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FAST: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    SWAP: tl.constexpr = False, SILU_MUL: tl.constexpr = False, COUNTED: tl.constexpr = False,
    FENCE: tl.constexpr = True, PDL: tl.constexpr = 0, PAIR_BLOCKS: tl.constexpr = False,
):  # fmt: skip
    """x[pair // rows_per_x] @ W_e for one expert block x N tile, over one of ``split_k`` parts
    of K, stored by :func:`_epilogue` (``COUNTED``: the parts meet there). A block holds
    ``BLOCK_M`` pairs of ``pair_ids``, or with ``PAIR_BLOCKS`` one (block ``b`` is pair ``b``:
    :func:`expert_blocks`), its other rows padding.

    With ``SILU_MUL`` the weight's ``N`` columns are gate then up (``N / 2`` each): a program's
    ``BLOCK_N`` columns are ``BLOCK_N / 2`` gate columns and the same up columns, and the
    output is ``silu(gate) * up``, ``[pairs, N / 2]``: no ``[pairs, N]`` intermediate is stored.
    """
    _dependent_launch(PDL)
    pid = tl.program_id(0)
    OUT_BN: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N
    out_n = N // 2 if SILU_MUL else N
    num_n = tl.cdiv(out_n, OUT_BN)
    block = pid // num_n
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # a block past the last used one
        return
    if PAIR_BLOCKS:
        pairs = block + tl.arange(0, BLOCK_M) * num_pairs  # rows past the first: padding
    else:
        pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    offs_o = (pid % num_n) * OUT_BN + tl.arange(0, OUT_BN)
    o_mask = offs_o < out_n
    if SILU_MUL:
        offs_n, n_mask = _gate_up_columns(pid % num_n, out_n, BLOCK_N)
    else:
        offs_n, n_mask = offs_o, o_mask
    x_rows = x_ptr + (pairs // rows_per_x).to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, split_k)
    step_begin = tl.program_id(1) * per_split
    step_end = tl.minimum(steps, step_begin + per_split)
    if INT4:
        acc = _w4a16_accumulate(
            acc, x_rows, m_mask, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
            z_ptr + expert * stride_se, offs_n, n_mask, K, stride_wk, stride_sk, step_begin,
            step_end, GROUP, HAS_ZEROS, BLOCK_K, FAST, EVEN_K, EVEN_N, SWAP,
        )  # fmt: skip
    else:
        acc = _bf16_accumulate(
            acc, x_rows, m_mask, w_ptr + expert * stride_we, offs_n, n_mask, K, stride_wk,
            step_begin, step_end, BLOCK_K, SWAP,
        )  # fmt: skip
    _epilogue(
        acc, out_ptr, ws_ptr, cnt_ptr, pairs, m_mask, offs_o, o_mask, out_n, routing_ptr,
        split_k * sum_rows, sum_rows, MUL_ROUTING, SILU_MUL, COUNTED, SWAP, FENCE,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "split_k", "sum_rows"])
def _moe_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, pair_ids_ptr, block_expert_ptr,
    routing_ptr, N, K, num_pairs, num_blocks, rows_per_x, split_k, sum_rows,
    stride_xm, stride_we, stride_wk, stride_se, stride_sk,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, MUL_ROUTING: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, FAST: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SILU_MUL: tl.constexpr,
    FENCE: tl.constexpr = True, PDL: tl.constexpr = 0,
):  # fmt: skip
    """x[pair // rows_per_x] @ W_e for one pair (expert blocks of one row), one column tile and
    one of ``split_k`` K parts, on CUDA cores: the dense GEMV's K loop (:func:`_gemv_sum`) on
    the pair's expert, with no tensor-core tile padded to 8 rows for one. The parts meet in
    :func:`_epilogue`. The pairs of a column tile are neighbouring programs in expert order, so
    pairs that share an expert read its tile from L2."""
    _dependent_launch(PDL)
    pid = tl.program_id(0)
    block = pid % num_blocks
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # a block past the last used one
        return
    pairs = tl.load(pair_ids_ptr + block + tl.arange(0, 1))
    OUT_BN: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N
    out_n = N // 2 if SILU_MUL else N
    offs_o = (pid // num_blocks) * OUT_BN + tl.arange(0, OUT_BN)
    o_mask = offs_o < out_n
    if SILU_MUL:
        offs_n, n_mask = _gate_up_columns(pid // num_blocks, out_n, BLOCK_N)
    else:
        offs_n, n_mask = offs_o, o_mask
    x_row = x_ptr + (tl.sum(pairs) // rows_per_x).to(tl.int64) * stride_xm
    res = _gemv_sum(
        x_row, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
        z_ptr + expert * stride_se, offs_n, n_mask, K, split_k, stride_wk, stride_sk, GROUP,
        HAS_ZEROS, BLOCK_N, BLOCK_R, FAST, EVEN_K, EVEN_N,
    )  # fmt: skip
    _epilogue(
        res[None, :], out_ptr, ws_ptr, cnt_ptr, pairs, pairs < num_pairs, offs_o, o_mask, out_n,
        routing_ptr, split_k * sum_rows, sum_rows, MUL_ROUTING, SILU_MUL, True, False, FENCE,
    )  # fmt: skip


@triton.jit
def _fill_share(ptr, n, value, FILL: tl.constexpr):
    """This program's share of ``ptr[:n] = value`` (int32)."""
    share = tl.cdiv(n, tl.num_programs(0))
    lo = tl.program_id(0) * share
    hi = tl.minimum(lo + share, n)
    for start in range(lo, hi, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(ptr + offs, tl.full((FILL,), value, tl.int32), mask=offs < hi)


@triton.jit(do_not_specialize=["num_pairs", "slots", "num_blocks"])
def _align_kernel(
    ids_ptr, pair_ids_ptr, block_expert_ptr, counts_ptr, ranks_ptr, num_pairs, slots, num_blocks,
    BLOCK_M: tl.constexpr, P: tl.constexpr, E: tl.constexpr, FILL: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):  # fmt: skip
    """:func:`align_to_experts`, one chunk of ``P`` pairs a program: a histogram of the chunk's
    experts and a sort of its (expert, pair) keys give each pair its rank among its expert's
    pairs in the chunk. With ``ONE_CHUNK`` (every pair in this program) it places them too:
    block counts, their prefix sums and one scatter. Otherwise it writes the chunk's histogram
    (``counts [chunks, E]``) and the ranks (``ranks [pairs]``) for :func:`_align_scatter_kernel`.
    Each program also fills its share of the padding (``P`` and ``E >= experts`` are powers of
    two)."""
    chunk = tl.program_id(0)
    _fill_share(pair_ids_ptr, slots, num_pairs, FILL)
    _fill_share(block_expert_ptr, num_blocks, -1, FILL)
    local = tl.arange(0, P)
    p = chunk * P + local
    valid = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    counts = tl.histogram(ids, E, mask=valid)
    keys = tl.sort(tl.where(valid, ids * P + local, E * P + local))  # by expert, then pair
    expert = tl.minimum(keys // P, E - 1)
    real = keys < E * P  # sorted: the chunk's real pairs come first
    rank = local - tl.gather(tl.cumsum(counts, 0) - counts, expert, 0)
    if ONE_CHUNK:
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        dest = tl.gather((tl.cumsum(blocks, 0) - blocks) * BLOCK_M, expert, 0) + rank
        tl.debug_barrier()  # the fills above land before the scatter below
        tl.store(pair_ids_ptr + dest, keys % P, mask=real)
        tl.store(block_expert_ptr + dest // BLOCK_M, expert, mask=real & (dest % BLOCK_M == 0))
    else:
        tl.store(counts_ptr + chunk * E + tl.arange(0, E), counts)
        tl.store(ranks_ptr + chunk * P + keys % P, rank, mask=real)


@triton.jit(do_not_specialize=["num_pairs", "chunks"])
def _align_scatter_kernel(
    ids_ptr, counts_ptr, ranks_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, chunks,
    BLOCK_M: tl.constexpr, P: tl.constexpr, E: tl.constexpr,
):  # fmt: skip
    """The chunks' pairs into their expert blocks (after :func:`_align_kernel`): each expert's
    first padded row from the histograms' totals, plus its pairs in the chunks before this one,
    plus the pair's rank in its chunk."""
    chunk = tl.program_id(0)
    e = tl.arange(0, E)
    total = tl.zeros((E,), tl.int32)
    before = tl.zeros((E,), tl.int32)
    for c in range(chunks):
        n = tl.load(counts_ptr + c * E + e)
        total += n
        before += tl.where(c < chunk, n, 0)
    blocks = (total + BLOCK_M - 1) // BLOCK_M
    first = (tl.cumsum(blocks, 0) - blocks) * BLOCK_M + before
    p = chunk * P + tl.arange(0, P)
    valid = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    dest = tl.gather(first, ids, 0) + tl.load(ranks_ptr + p, mask=valid, other=0)
    tl.store(pair_ids_ptr + dest, p, mask=valid)
    tl.store(block_expert_ptr + dest // BLOCK_M, ids, mask=valid & (dest % BLOCK_M == 0))


@triton.jit
def _topk_sum_kernel(src_ptr, out_ptr, H, TOP_K: tl.constexpr, TK: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    """out[t] = sum_j src[t * TOP_K + j] in fp32, stored as bf16 (``TK``: ``TOP_K`` rounded up
    to a power of two)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, TK)
    mask = (j < TOP_K)[:, None] & (offs < H)[None, :]
    rows = (t * TOP_K + j).to(tl.int64) * H
    v = tl.load(src_ptr + rows[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + offs, tl.sum(v, 0).to(tl.bfloat16), mask=offs < H)


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    fast_decode: bool = True  # packed-bf16x2 PTX decode on the GPU (False: plain Triton)
    swap: bool = False  # weights as the dot's first operand (8-row expert blocks possible)
    split_k: int = 1  # K parts, met inside the launch (:func:`_add_counted`)
    # "triton": tensor-core expert blocks; "gemv": one pair a program on CUDA cores (block_m 1,
    # block_k / 8 word rows a step, its fp32 sums met like K parts)
    path: str = "triton"
    # programmatic dependent launch, as GemmConfig.pdl (1: launched while the kernel before
    # ends, waiting for its results before reading anything)
    pdl: int = 1
    # tensor-core tiles: one pair a block, the pairs in order (as the gemv path's blocks), so
    # no alignment launch; a block's other block_m - 1 rows are padding
    pair_blocks: bool = False

    @property
    def rows_per_block(self) -> int:
        """Pairs an expert block holds at most (:func:`expert_blocks`)."""
        return 1 if self.path == "gemv" or self.pair_blocks else self.block_m


# The alignment sorts in one program up to ALIGN_ONE_PROGRAM pairs, beyond in chunks of
# ALIGN_CHUNK (H100, bench/results/moe_align_h100.json: one program sorting 1,024 pairs
# took 11.5 us, chunks of 256 and the scatter 6.7)
ALIGN_ONE_PROGRAM = 512
ALIGN_CHUNK = 256


def _triton_runs(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t`` here (on its GPU, or in the interpreter)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def align_to_experts(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    one_program: int = ALIGN_ONE_PROGRAM,
    chunk: int = ALIGN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert into blocks of ``block_m`` rows.

    Returns ``pair_ids`` (``[blocks * block_m]``; pair ``p = token * top_k + slot``, padding rows
    hold ``num_pairs``; each expert's pairs in pair order) and ``block_expert`` (``[blocks]``;
    ``-1`` past the last used block). Sizes depend only on the shapes, never on the routing, so
    no host sync is needed and the call can be captured in a CUDA graph. One Triton launch up to
    ``one_program`` pairs (decode), two beyond: chunks of ``chunk`` pairs (powers of two) sorted
    in parallel, then placed.
    """
    flat = topk_ids.reshape(-1)
    if not _triton_runs(flat):
        return align_to_experts_reference(topk_ids, num_experts, block_m)
    num_pairs = flat.numel()
    blocks = num_pairs // block_m + min(num_experts, num_pairs)  # bound on used blocks
    pair_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    one_chunk = num_pairs <= one_program
    if one_chunk:
        chunk = triton.next_power_of_2(max(num_pairs, 16))
    chunks = triton.cdiv(num_pairs, chunk)
    experts_p2 = triton.next_power_of_2(max(num_experts, 16))
    counts = ranks = pair_ids  # unused pointers in one chunk: no allocation on the decode path
    if not one_chunk:
        counts = torch.empty(chunks * experts_p2, dtype=torch.int32, device=flat.device)
        ranks = torch.empty(num_pairs, dtype=torch.int32, device=flat.device)
    _align_kernel[(chunks,)](
        flat, pair_ids, block_expert, counts, ranks, num_pairs, blocks * block_m, blocks,
        BLOCK_M=block_m, P=chunk, E=experts_p2, FILL=1024, ONE_CHUNK=one_chunk, num_warps=4,
    )  # fmt: skip
    if not one_chunk:
        _align_scatter_kernel[(chunks,)](
            flat, counts, ranks, pair_ids, block_expert, num_pairs, chunks,
            BLOCK_M=block_m, P=chunk, E=experts_p2, num_warps=4,
        )  # fmt: skip
    return pair_ids, block_expert


def align_to_experts_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align_to_experts` in torch ops (twenty to thirty launches): the tests' reference."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    blocks = num_pairs // block_m + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync with the host
    expert_blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(expert_blocks, 0)
    start = (block_end - expert_blocks) * block_m  # first padded row of each expert
    first = torch.cumsum(counts, 0) - counts  # first sorted pair of each expert
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    dest = (
        start[sorted_experts] + torch.arange(num_pairs, device=flat.device) - first[sorted_experts]
    )
    pair_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    pair_ids[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(
        block_end, torch.arange(blocks, device=flat.device), right=True
    )
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_ids, block_expert


_IDENTITY_PAIRS: dict[tuple[torch.device, int], torch.Tensor] = {}


def expert_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pair_ids, block_expert)`` for blocks of ``block_m`` rows: :func:`align_to_experts`,
    except for blocks of one row, which need no sort: each pair is its own block, in pair
    order, and its expert is its routing's (``topk_ids`` itself, read in place). One launch
    less for the gemv path: the pair ids (an ``arange``) are made once per (device, pair count)
    outside CUDA graph capture, where the tuner's first run makes them; made during a capture
    they stay the graph's own (its memory), one launch in it."""
    if block_m != 1:
        return align_to_experts(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    key = (flat.device, flat.numel())
    pairs = _IDENTITY_PAIRS.get(key)
    if pairs is None:
        pairs = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
        if not (flat.is_cuda and torch.cuda.is_current_stream_capturing()):
            _IDENTITY_PAIRS[key] = pairs
    return pairs, flat


def _weight_args(w: W4A16Weight | torch.Tensor) -> tuple:
    """(weight, scales, zeros, strides, INT4, GROUP, HAS_ZEROS, N, K) for the kernel."""
    if isinstance(w, W4A16Weight):
        z = w.zeros if w.zeros is not None else w.scales  # unused pointer when symmetric
        strides = (w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1))
        return (w.qweight, w.scales, z, strides, True, w.group_size, w.zeros is not None, w.n, w.k)
    if w.dtype != torch.bfloat16 or w.dim() != 3 or w.stride(2) != 1:
        raise ValueError(f"bf16 experts must be a contiguous [E, K, N] tensor, got {w.dtype}")
    strides = (w.stride(0), w.stride(1), 0, 0)
    return (w, w, w, strides, False, 128, False, w.shape[2], w.shape[1])


def moe_gemm(
    x: torch.Tensor,
    w: W4A16Weight | torch.Tensor,
    pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    rows_per_x: int,
    config: MoeConfig,
    routing: torch.Tensor | None = None,
    silu_mul: bool = False,
    sum_rows: int = 1,
) -> torch.Tensor:
    """``out[p] = x[p // rows_per_x] @ W_{expert(p)}`` for every pair ``p``, times
    ``routing[p]`` when given, and each ``sum_rows`` consecutive pairs summed in fp32 (a token's
    top-k experts) -> bf16 ``[num_pairs / sum_rows, N]``. With ``silu_mul`` the weight's
    columns are gate then up and the result is ``silu(gate) * up``, ``[num_pairs, N / 2]``.

    K splits and the CUDA-core path meet in the device's self-resetting fp32 sums and int32
    counts (:func:`workspace_size`, :func:`counted_workspace`); unsplit tensor-core tiles store
    each pair's row, summed over ``sum_rows`` by one more launch."""
    weight, scales, zeros, (swe, swk, sse, ssk), int4, group, has_zeros, n, k = _weight_args(w)
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 [rows, {k}] with unit last stride, got {tuple(x.shape)}")
    if silu_mul and (n % 2 or sum_rows != 1):
        raise ValueError(f"SiLU-and-mul needs an even column count and no row sum, got {n}")
    gemv = config.path == "gemv"
    if gemv and (not int4 or config.block_m != 1):
        raise ValueError(f"the gemv path takes INT4 experts and block_m 1, got {config}")
    counted = _counted(config)
    out_n, out_bn = (n // 2, config.block_n // 2) if silu_mul else (n, config.block_n)
    summed = sum_rows if counted else 1  # rows the kernel sums into one
    out = torch.empty((num_pairs // summed, out_n), dtype=torch.bfloat16, device=x.device)
    if counted:
        size = workspace_size(num_pairs, n, silu_mul, sum_rows)
        sums, counts = counted_workspace(x.device, *size)
    else:
        sums, counts = out, out
    grid = (block_expert.numel() * triton.cdiv(out_n, out_bn), config.split_k)
    args = (
        x, weight, scales, zeros, out, sums, counts, pair_ids, block_expert,
        routing if routing is not None else x,
    )  # fmt: skip
    common = {
        "GROUP": group, "HAS_ZEROS": has_zeros, "MUL_ROUTING": routing is not None,
        "BLOCK_N": config.block_n, "FAST": config.fast_decode and not interpreted(),
        "EVEN_K": k % config.block_k == 0, "EVEN_N": out_n % out_bn == 0, "SILU_MUL": silu_mul,
        "FENCE": not interpreted(), "num_warps": config.num_warps,
    }  # fmt: skip
    if config.pdl and not interpreted() and _dependent_launches(x.device.index or 0):
        common |= {"PDL": config.pdl, "launch_pdl": True}
    if gemv:
        _moe_gemv_kernel[grid](
            *args, n, k, num_pairs, block_expert.numel(), rows_per_x, config.split_k, summed,
            x.stride(0), swe, swk, sse, ssk,
            BLOCK_R=config.block_k // 8, num_stages=1, **common,
        )  # fmt: skip
    else:
        _moe_gemm_kernel[grid](
            *args, n, k, num_pairs, rows_per_x, config.split_k, summed,
            x.stride(0), swe, swk, sse, ssk,
            INT4=int4, BLOCK_M=config.block_m, BLOCK_K=config.block_k, SWAP=config.swap,
            COUNTED=counted, PAIR_BLOCKS=config.pair_blocks, num_stages=config.num_stages,
            **common,
        )  # fmt: skip
    if sum_rows > summed:
        return _topk_sum(out, num_pairs // sum_rows, sum_rows)
    return out


def workspace_size(num_pairs: int, n: int, silu_mul: bool, sum_rows: int) -> tuple[int, int]:
    """(fp32 sums, int32 counts) a counted :func:`moe_gemm` needs: one count per output
    element, and gate and up sums with ``silu_mul``."""
    rows = num_pairs // sum_rows
    out_n = n // 2 if silu_mul else n
    return rows * n, rows * out_n


def _topk_sum(out: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """``out [tokens * top_k, H]`` (bf16, or the fp32 sums of a split-K down GEMM) summed over
    each token's ``top_k`` rows in fp32 -> bf16."""
    h = out.shape[1]
    if not _triton_runs(out):
        return out.view(tokens, top_k, h).sum(1, dtype=torch.float32).to(torch.bfloat16)
    res = torch.empty((tokens, h), dtype=torch.bfloat16, device=out.device)
    block = 1024
    _topk_sum_kernel[(tokens, triton.cdiv(h, block))](
        out, res, h, TOP_K=top_k, TK=triton.next_power_of_2(top_k), BLOCK=block, num_warps=4
    )
    return res


def _candidates(
    num_pairs: int, num_experts: int, n: int | None = None, int4: bool = True
) -> list[MoeConfig]:
    """Blocks of 64 rows beyond 48 pairs an expert; at decode sizes (about one pair per expert
    block) 16-row blocks, and 8-row blocks with the weights as the dot's first operand
    (``m16n8k16``: half the tensor-core work of a 16-row block). In between all are timed, with
    32-row blocks too: with 4-5 pairs per expert (GLM 5's slice at 128 requests) 64-row blocks
    alone ran the experts 10.8x slower than at 64 requests. At 16 pairs an expert the 32-row
    tiles ran bf16 experts 1.07-1.09x faster than 16-row ones, and INT4 experts 0.77-0.81x
    (H100, bench/results/w4a16_moe_v16_rows32_glm_ep8_512_h100.json). The 128- and
    256-column tiles also come with three pipeline stages, which
    fit more programs an SM (the 8 x 256 tile: four, 16 warps, where four stages' shared memory
    fits two); at 2, 4 and 8 rows an expert the fastest tile had three stages in two runs
    (H100, bench/results/w4a16_moe_stages_h100.json).

    At decode sizes the 8-row blocks also come with K split in 2 to 8: a few pairs give a few
    blocks, and an expert-parallel GPU at one request touches 2-3 experts, so without the split
    a GEMM has one program per expert and N tile, too few to fill 132 SMs (the decode slice's
    experts at 1 request: 1.17 TB/s without the split, 1.46 with it).

    With about one pair an expert the 8-row tiles also come with blocks of one pair in pair
    order (``pair_blocks``): no alignment launch, and pairs that share an expert read it once
    each (from L2 after the first). INT4 experts there also get the CUDA-core path (``gemv``,
    one pair a program) with the dense GEMV's two tiles and split counts for the ``n`` output
    columns."""
    large = [MoeConfig(64, bn, 128, 8, 3) for bn in (64, 128)]
    if num_pairs > 48 * num_experts:
        return large
    mid = [MoeConfig(32, 128, 128, 4, s) for s in (4, 3)] + [
        MoeConfig(32, bn, 128, 8, 3) for bn in (128, 256)]  # fmt: skip
    small = [MoeConfig(16, bn, 128, 4, s) for bn in (128, 256) for s in (4, 3)]
    if num_pairs > 4 * num_experts:
        return small + mid + large
    swapped = [MoeConfig(8, bn, 128, 4, 4, swap=True) for bn in (64, 128, 256)]
    fewer_stages = [replace(c, num_stages=3) for c in swapped[1:]]
    split = [MoeConfig(8, bn, 128, 4, 4, swap=True, split_k=s) for bn, s in
             ((64, 4), (128, 2), (128, 4), (128, 8), (256, 4))]  # fmt: skip
    one_pair, gemv = [], []
    if num_pairs <= 2 * num_experts:
        one_pair = [replace(c, pair_blocks=True) for c in swapped + split]
    if int4 and n is not None and num_pairs <= 2 * num_experts:
        for bn, bk in ((128, 128), (256, 64)):
            gemv += [MoeConfig(1, bn, bk, 4, 1, split_k=s, path="gemv")
                     for s in _split_counts(num_pairs * triton.cdiv(n, bn))]  # fmt: skip
    return small + swapped + fewer_stages + split + one_pair + gemv


def _counted(config: MoeConfig) -> bool:
    return config.split_k > 1 or config.path == "gemv"


def _num_experts(w: W4A16Weight | torch.Tensor) -> int:
    return (w.qweight if isinstance(w, W4A16Weight) else w).shape[0]


def _num_columns(w: W4A16Weight | torch.Tensor) -> int:
    """An expert weight's output columns ``N`` (INT4, or bf16 ``[E, K, N]``)."""
    return w.n if isinstance(w, W4A16Weight) else w.shape[2]


def fused_moe(
    x: torch.Tensor,
    w13: W4A16Weight | torch.Tensor,
    w2: W4A16Weight | torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[MoeConfig, MoeConfig] | None = None,
) -> torch.Tensor:
    """SwiGLU MoE over ``x [T, H]`` bf16 -> ``[T, H]`` bf16 (INT4 or bf16 experts).

    Without ``configs`` the tiles of both GEMMs are tuned once per (token count, shapes) on the
    GPU; run each batch size once before capturing CUDA graphs.
    """
    num_experts = _num_experts(w13)
    tokens, top_k = topk_ids.shape
    if topk_weights.shape != topk_ids.shape or x.shape[0] != tokens:
        raise ValueError(
            f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must agree on the token count and top-k"
        )
    if _num_experts(w2) != num_experts:
        raise ValueError("w13 and w2 must hold the same number of experts")
    num_pairs = tokens * top_k
    routing = topk_weights.reshape(-1)  # read as fp32 by the kernel

    def run(cfgs: tuple[MoeConfig, MoeConfig]) -> torch.Tensor:
        # launches: align (none for blocks of one pair), up GEMM with SiLU-and-mul, down GEMM x
        # routing with the top-k sum (unsplit tensor-core tiles: the sum is one more launch)
        up_cfg, down_cfg = cfgs
        pair_ids, block_expert = expert_blocks(topk_ids, num_experts, up_cfg.rows_per_block)
        act = moe_gemm(x, w13, pair_ids, block_expert, num_pairs, top_k, up_cfg, silu_mul=True)
        if down_cfg.rows_per_block != up_cfg.rows_per_block:
            pair_ids, block_expert = expert_blocks(topk_ids, num_experts,
                                                   down_cfg.rows_per_block)  # fmt: skip
        return moe_gemm(act, w2, pair_ids, block_expert, num_pairs, 1, down_cfg, routing,
                        sum_rows=top_k)  # fmt: skip

    if configs is None:
        if interpreted():
            configs = (MoeConfig(block_n=32), MoeConfig(block_n=32))
        else:
            configs = _tune(x, w13, w2, num_pairs, num_experts, run)
    return run(configs)


def _tune(x, w13, w2, num_pairs, num_experts, run) -> tuple[MoeConfig, MoeConfig]:
    """Both GEMMs' tiles for this shape (:func:`_tune_stages`), each stage timed on the GPU
    once and kept under its own key."""
    kind = "int4" if isinstance(w13, W4A16Weight) else "bf16"
    shape = (x.shape[0], num_experts, tuple(x.shape[1:]), kind, torch.cuda.get_device_name())
    return _tune_stages(
        lambda stage, cfg_pairs: tune_cached((stage, *shape), lambda: cfg_pairs, run),
        *_tune_candidates(w13, w2, num_pairs, num_experts),
    )


def _tune_candidates(w13, w2, num_pairs: int, num_experts: int) -> tuple[list, list, MoeConfig]:
    """The up GEMM's and the down GEMM's candidates, and the down tile the up GEMM is first
    timed with (:func:`_tune_stages`)."""
    int4 = isinstance(w13, W4A16Weight)
    tiles = _candidates(num_pairs, num_experts)
    return (
        _candidates(num_pairs, num_experts, _num_columns(w13), int4),
        _candidates(num_pairs, num_experts, _num_columns(w2), int4),
        tiles[len(tiles) // 2],
    )


def _tune_stages(fastest, up_cands, down_cands, mid) -> tuple[MoeConfig, MoeConfig]:
    """The (up, down) tiles by coordinate descent, ``fastest(stage, cfg_pairs)`` picking one
    of the (up, down) pairs at each stage: the up GEMM with a mid-size down tile ``mid``, the
    down GEMM with that up tile, then the up GEMM again with that down tile. The alignment
    launch is saved only when both GEMMs take blocks of one pair (``rows_per_block == 1``), so
    the up GEMM is chosen last, knowing the down GEMM's block kind."""
    up = fastest("moe_up", [(c, mid) for c in up_cands])[0]
    down = fastest("moe_down", [(up, c) for c in down_cands])[1]
    return fastest("moe_up_given_down", [(c, down) for c in up_cands])


def fused_moe_reference(
    x: torch.Tensor,
    w13: W4A16Weight | torch.Tensor,
    w2: W4A16Weight | torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fp32 pure-torch MoE on the dequantized experts, rounding to bf16 where the kernel stores
    bf16 (the up output, the activation, each pair's down output); returns fp32 ``[T, H]``."""

    def dense(w: W4A16Weight | torch.Tensor) -> torch.Tensor:  # [E, K, N] fp32
        if isinstance(w, W4A16Weight):
            return dequantize(w, torch.float32).transpose(-1, -2)
        return w.float()

    a, b = dense(w13), dense(w2)
    xf = x.float()
    out = torch.zeros(x.shape[0], b.shape[-1], dtype=torch.float32, device=x.device)
    for slot in range(topk_ids.shape[1]):
        for e in topk_ids[:, slot].unique().tolist():
            rows = (topk_ids[:, slot] == e).nonzero().squeeze(1)
            gate, up = (xf[rows] @ a[e]).to(torch.bfloat16).float().chunk(2, dim=-1)
            act = (F.silu(gate) * up).to(torch.bfloat16).float()
            down = (topk_weights[rows, slot, None].float() * (act @ b[e])).to(torch.bfloat16)
            out[rows] += down.float()
    return out
