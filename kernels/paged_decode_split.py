"""Split-KV (flash-decoding) paged decode attention: the core under the BF16 and FP8 siblings.

Use ``paged_decode_bf16`` / ``paged_decode_fp8`` (and their MLA forms); this module holds what
they share: the two Triton kernels, the split plan and the launch.

Stage 1, one program per (request, KV head, block of query heads, split of the context):
for the split's tokens ``n`` (gathered page by page through the page table),
``s[h, n] = (q[h] . k[n]) * k_scale[n] * sm_scale``, then an online softmax over ``n`` and
``o[h] = sum_n p[h, n] * v_scale[n] * v[n] / sum_n p[h, n]``, written with its
``lse[h] = log2 sum_n 2^(s[h, n] log2 e)``.
Stage 2, one program per (request, query head): ``out = sum_s 2^(lse_s - m) o_s / sum_s
2^(lse_s - m)`` with ``m = max_s lse_s``.

FP8 pages are widened to fp16 (one instruction per two values on Hopper) and multiplied with
an fp16 query; the per-token scales are applied to the fp32 scores and to the probabilities,
never to the tile. MLA (absorbed form): one KV head of ``D + D_ROPE`` dims; V is the first ``D``
dims of the same tile, so each token is read once.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .decode_split_range import split_range as _split_range
from .mla_decode_e4m3 import mla_fp8_e4m3_kernel, mla_fp8_e4m3_stream_kernel
from .mla_decode_e4m3_inplace import mla_fp8_e4m3_inplace_kernel
from .mla_decode_heads import mla_heads_kernel, mla_heads_stream_kernel
from .mla_decode_wgmma import mla_fp8_wgmma_kernel
from .paged_kv import PageTable

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # tokens per tile
    block_h: int  # query heads per program (padded to 16 for the tensor cores)
    num_warps: int
    num_stages: int
    latent_quarters: bool = False  # MLA: the latent product as four quarter-width products
    programs_per_sm: int = 4  # what the split plan aims at (whole_waves: what one SM holds)
    whole_waves: bool = False  # plan the split so all programs run in one wave
    max_registers: int | None = None  # a per-thread register cap (more programs per SM)
    # MLA over FP8 pages: the products in native e4m3 instead of on fp16-widened tiles; each
    # operand (q, then p) as 1 or 2 e4m3 parts (hi + the rounding residual); 0 = fp16.
    qk_fp8_parts: int = 0
    pv_fp8_parts: int = 0
    tokens_as_m: bool = False  # MLA: the transposed kernel (tokens the MMA's M, heads its N)
    # MLA over FP8 pages, 16 heads a program: the warp-specialized Gluon kernel on Hopper's
    # warpgroup MMA (mla_decode_wgmma.py); under Triton's interpreter and off Hopper,
    # MLA_FP8_TRITON runs instead
    wgmma: bool = False
    # for measuring the Gluon kernel: 1 runs the producer's work alone, 2 the consumer's (the
    # other side only hands buffers over; the output is meaningless)
    only: int = 0
    # the balanced plan (lengths known) fills this many waves of programs_per_sm where one
    # wave's plan overflows it (plan_balanced_waves): shorter splits, less left for the last
    balanced_waves: int = 1
    # MLA over FP8 pages, 16 heads a program: the Gluon kernel with both products in e4m3
    # (mla_decode_e4m3.py; q and p in two e4m3 parts, V^T an MMA operand in registers, nothing
    # widened); under the interpreter and off Hopper, MLA_FP8_TRITON runs instead
    e4m3: bool = False
    # ... with V^T written over each tile by the producer instead (mla_decode_e4m3_inplace.py)
    e4m3_in_place: bool = False
    # ... with the query's e4m3 parts written by its consumer while the producer starts on the
    # tiles (mla_decode_e4m3.py's Q_IN_CONSUMER), not by the whole program before either starts
    q_in_consumer: bool = False
    # at most this many tokens a split (0: no limit), whatever the plan would give; the e4m3
    # kernel keeps it by cutting its splits into pieces where the lengths are unknown
    # (``plan_pieces``), unless ``split_tokens_capped``: by more splits (``cap_split_tokens``)
    max_split_tokens: int = 0
    split_tokens_capped: bool = False
    # the e4m3 kernel on the stream schedule (mla_stream.py): one program an SM, each taking an
    # equal run of the batch's tiles across requests, instead of a split plan
    stream: bool = False
    # MLA, 64 heads a program, BF16 or FP8 pages: the Gluon kernel with the heads as the MMA's
    # M on Hopper (mla_decode_heads.py); under the interpreter and off Hopper, the Triton
    # 64-heads kernel (MLA_HEADS_TRITON) runs instead
    heads_m: bool = False
    # the split plans' fewest tiles a split and most splits a request: fewer tiles a split give
    # short contexts more programs (a shorter chain of tiles in each), more splits a longer
    # stage 2
    min_split_tiles: int = 4
    max_splits: int = MAX_SPLITS
    # stage 2 as one tile a program (``_merge_at_once_kernel``: every split's partial output of
    # a slice of dims read at once) instead of one split after the other
    merge_at_once: bool = False


# The split plans of the 16-heads Hopper MLA kernels (BF16, and the FP8 Gluon ones): splits as
# short as one tile, up to 256 a request, merged at once. At one request a split's time is a
# fixed part plus its chain of tiles, and the serial merge cost 2.5x FlashMLA's a split
# (docs/kernels-fp8-kv.md), so the four-tile, 64-split plans left most SMs idle at short
# contexts and long chains at long ones. Side by side with the earlier plans and FlashMLA
# (bench/results/fp8_kv_flashmla_short_splits.json, 16 heads): one request of 1k/4k/32k, FP8
# 7.7/10.7/18.8 us against 13.8/16.4/31.6 (FlashMLA 9.4/12.9/23.3), BF16 9.1/10.1/24.3 against
# 13.4/19.2/53.9; 8 heads, one request of 8k: FP8 10.6 against 19.3, BF16 11.4 against 22.8;
# from 8 requests FP8 0.99-1.07x the earlier plans' speed, BF16 0.98-1.11x. 64+ heads keep the
# earlier plan: the at-once merge ran 0.91-0.93x the serial one at 128 heads (16-request mix,
# fp8_kv_flashmla_short_splits_first.json).
SHORT_SPLITS = {"min_split_tiles": 1, "max_splits": 256, "merge_at_once": True}
# MLA over FP8 pages, 16 heads a program, in Triton: what runs where the Gluon kernel cannot
# (Triton's interpreter, GPUs other than Hopper). The latent in quarters, 32 tokens a tile, 186
# registers capped at 168 (3 programs per SM).
MLA_FP8_TRITON = DecodeConfig(32, 16, 4, 2, True, 3, whole_waves=True, max_registers=168)
# Balanced splits in two waves of one program an SM where one wave's plan overflows
# (plan_balanced_waves): over the 1k-8k mixes of 64 and 256 requests 1.04-1.20x one wave
# (bench/results/fp8_kv_flashmla_fused2_quick.json, the "wgmma_pps2" variant).
MLA_FP8_WGMMA = DecodeConfig(64, 16, 4, 1, True, 1, whole_waves=True, wgmma=True,
                             balanced_waves=2, **SHORT_SPLITS)  # fmt: skip
# The e4m3 kernels' output product adds every tile of a split into one accumulator inside the
# tensor cores, whose FP8 MMAs add with fewer bits than fp32 (as DeepSeek-V3's report found on
# Hopper), so their error grows with a split's tiles: against their own dequantized pages
# 2.0-2.8e-3 up to 32 tiles, 2.9-4.4e-3 at 128, 6.7-9.0e-3 at 256, past the FP8 tolerance of
# 5e-3 (bench/results/fp8_kv_flashmla_e4m3_grid.json, fp8_kv_e4m3_split_cap.json; the widening
# kernel flat at 1.7e-3; a variant with two accumulators, each taking every other tile, halved
# it). So no split gets more: 0.95-0.98x the uncapped speed where it splits more.
E4M3_MAX_SPLIT_TOKENS = 8192
# The same plan with both products in e4m3 (mla_decode_e4m3.py); on 128-token tiles
# (MLA_FP8_E4M3_128) the FP8 default from E4M3_MIN_TOKENS.
MLA_FP8_E4M3 = DecodeConfig(64, 16, 4, 1, True, 1, whole_waves=True, e4m3=True,
                            balanced_waves=2, max_split_tokens=E4M3_MAX_SPLIT_TOKENS,
                            **SHORT_SPLITS)  # fmt: skip
# ... with V^T written over each tile by its producer (mla_decode_e4m3_inplace.py): from
# E4M3_IN_PLACE_MIN_TOKENS to E4M3_MIN_TOKENS.
MLA_FP8_E4M3_IN_PLACE = replace(MLA_FP8_E4M3, e4m3_in_place=True)
# ... on 128-token tiles over two consumer warpgroups (each the scores of 64 tokens and half of
# o^T's dims), two slots in the ring: half the tiles, so half the per-tile chain of dependent
# steps (scores, softmax, p's store, the output product) for the same tokens. Its consumer
# alone is 1.2x the 64-token one's; with the producer, 1.02-1.05x (E4M3_MIN_TOKENS)
MLA_FP8_E4M3_128 = replace(MLA_FP8_E4M3, block_n=128, num_warps=8)
# ... on 64-token tiles, the query written by the consumer while the producer starts copying.
# Not a default: 1.02-1.07x the 128-token kernel from 262,144 tokens on the H100
# (bench/results/fp8_kv_flashmla_q_in_consumer_default_h100.json) but 0.97-0.99x it on the H200
# in two runs at 196,608 to 2M tokens (fp8_kv_flashmla_q_in_consumer_default_h200.json,
# _128_h200.json), where the query in the consumer gains the 128-token kernel 0.99-1.02x.
MLA_FP8_E4M3_Q_IN_CONSUMER = replace(MLA_FP8_E4M3, q_in_consumer=True)
# MLA at 64+ heads: 64 heads a program in Gluon (heads as the MMA's M, two warpgroups), and the
# Triton kernel that runs in its place under the interpreter and off Hopper.
MLA_HEADS_M = DecodeConfig(64, 64, 8, 1, True, 1, whole_waves=True, heads_m=True)
MLA_HEADS_TRITON = DecodeConfig(32, 64, 8, 2, True, programs_per_sm=1, whole_waves=True)
# The heads-as-M kernel on the stream schedule: the default from 64 heads where the batch's
# lengths are known to be uneven (``prefers_stream``) or, unknown, where the split plan leaves
# SMs idle (``STREAM_MIN_SM_SHARE``), for up to HEADS_STREAM_MAX_BATCH requests.
MLA_HEADS_M_STREAM = replace(MLA_HEADS_M, stream=True)
# the most requests it takes: their tile ends (4 bytes each) share the 227 KB of an SM's shared
# memory with the query, two tiles, their scales and p (225 KB)
HEADS_STREAM_MAX_BATCH = 256
# ... from this many tokens: the 16-request mix, the smallest measured, where it was 1.01-1.13x
# the split plan in two runs (fp8_kv_flashmla_heads_stream.json, _heads_scales.json)
HEADS_STREAM_MIN_TOKENS = 61440
# From this many tokens the e4m3 kernel with V^T in registers on 128-token tiles is the
# fastest: 1.02-1.05x the 64-token one on every shape of 393k-2M tokens at 8 and 16 heads, and
# more accurate (fewer tiles summed in the tensor cores: 2.4-3.8e-3 against 2.5-4.3e-3;
# bench/results/fp8_kv_flashmla_128_shapes.json); 1.08x the in-place one at 196,608 (48 of
# 4k), a tie at 262,144 (64 of 4k, 32 of 8k: 1.00x) and 1.10x there at 8 heads (128 of 2k);
# at 131,072 the in-place one stays, 1.10-1.12x it (32 of 4k, 64 of 2k;
# fp8_kv_flashmla_128_small_shapes.json). The in-place one from 131,072 tokens, where it is
# 1.09-1.10x the widening kernel (bench/results/fp8_kv_e4m3_versions_overlap.json). Below
# 131,072 the widening kernel stays: an earlier in-place version ran 0.88-0.99x of it at 1k-32k
# tokens (fp8_kv_e4m3_versions.json).
E4M3_MIN_TOKENS = 196608
E4M3_IN_PLACE_MIN_TOKENS = 131072
# the most requests the stream schedule takes (their tile ends in 16 KB of shared memory,
# beside the e4m3 kernel's 200 KB); larger batches take the split plan
STREAM_MAX_BATCH = 4096
# The e4m3 kernel on the stream schedule, one wave: the FP8 default at up to 16 heads where the
# batch's lengths are known to be uneven (``prefers_stream``) or, unknown, where the split plan
# leaves SMs idle (``STREAM_MIN_SM_SHARE``). Against the fastest split kernel
# on the 1k-8k mixes (bench/results/fp8_kv_flashmla_stream_grid.json, every kernel timed on
# every shape): 1.11-1.22x at 64 and 256 requests, 1.01-1.11x at 32, 0.88x (16 heads) and
# 1.02x (8) at 16; on equal lengths from 98,304 tokens 0.77-0.97x. Two waves: 0.75-0.91x of one
# (fp8_kv_flashmla_stream_quick.json).
MLA_FP8_E4M3_STREAM = replace(MLA_FP8_E4M3, stream=True, balanced_waves=1)
# lengths are uneven where their total is at most this share of batch x the longest (the mixes:
# 0.47)
UNEVEN_SHARE = 0.75
# from this many tokens (between the 16-request mix's 61,440 and the 32-request one's 122,880)
STREAM_MIN_TOKENS = 98304


def prefers_stream(
    total_tokens: int | None, batch: int, max_seq_len: int, max_batch: int = STREAM_MAX_BATCH,
    min_tokens: int = STREAM_MIN_TOKENS,
) -> bool:  # fmt: skip
    """Whether the stream schedule is the faster one: the batch fits it (at most ``max_batch``
    requests), and its total is known, at least ``min_tokens``, and well below batch x the
    longest length (uneven lengths)."""
    return (
        total_tokens is not None
        and batch <= max_batch
        and total_tokens >= min_tokens
        and total_tokens <= UNEVEN_SHARE * batch * max_seq_len
    )


# The Gluon kernels' split plan for lengths unknown on the host (SGLang's call) holds one program
# an SM in one wave, so a request count that does not divide the SM count leaves SMs idle for
# the whole kernel (``split_plan_sm_share``). Below this share the stream schedule, which plans
# on the GPU, is the default. Measured on the H100 (bench/results/
# fp8_kv_flashmla_split_share_h100.json, _split_share_check_h100.json), stream over split plan:
# - FP8 at 8-16 heads, 64-240 requests of 2k-16k: 0.65-1.00x at shares 0.51-0.79 (tied at 96
#   and 100 of 4k), 1.00-1.10x at 0.91-0.97;
# - below 64 requests it lost at 4k (1.08x at 48, 1.23x at 34) and won from 16k (0.67-0.95x):
#   a fixed cost of 6-13 us that short contexts do not repay, so fewer requests keep the split
#   plan (SHARE_STREAM_MIN_BATCH);
# - 64 and 128 heads (the heads-as-M kernel), BF16 and FP8, 48 and 67 requests of 4k-8k:
#   0.57-0.93x.
STREAM_MIN_SM_SHARE = 0.8
SHARE_STREAM_MIN_BATCH = 64
# ... and where its token cap keeps it within two waves of programs for the bound it is given
# (``stream_programs``): the measured wins ran one or two (100 x 16k, 180 x 8k: two). A bound
# far above the lengths, the context SGLang's CUDA graphs give, asks for many more waves of
# nearly empty programs (9 for 64 requests of a 128k context), which was never timed.
SHARE_STREAM_MAX_WAVES = 2


def cuts_in_pieces(cfg: DecodeConfig) -> bool:
    """Whether ``cfg``'s kernel keeps its token cap by cutting each split into pieces where the
    lengths are unknown (``plan_pieces``), not by more splits: the e4m3 register kernel."""
    return cfg.e4m3 and not (cfg.e4m3_in_place or cfg.split_tokens_capped)


def split_plan_sm_share(
    cfg: DecodeConfig, batch: int, heads: int, max_seq_len: int, sms: int
) -> float:
    """The share of the GPU's program slots that ``cfg``'s equal-parts split plan (lengths
    unknown on the host) keeps busy: its programs over the whole waves they take. Below 1 where
    the request count does not divide the slots, e.g. 48 requests on 132 SMs."""
    programs = batch * triton.cdiv(heads, cfg.block_h)
    splits, _, _ = equal_parts_plan(cfg, programs, max_seq_len, sms)
    return wave_share(programs * splits, sms * cfg.programs_per_sm)


def wave_share(programs: int, slots: int) -> float:
    """``programs`` over the whole waves of ``slots`` they take."""
    return programs / (triton.cdiv(programs, slots) * slots)


def with_stream(
    cfg: DecodeConfig, total_tokens: int | None, batch: int, max_seq_len: int, heads: int,
    sms: int,
) -> DecodeConfig:  # fmt: skip
    """``cfg``, or the kernel of its head count on the stream schedule (for the 16-heads FP8
    Gluon kernels the e4m3 one, from 64 heads the heads-as-M one) where the batch's lengths are
    known to be uneven (``prefers_stream``) or, unknown, where the split plan would leave SMs
    idle (``STREAM_MIN_SM_SHARE``)."""
    idle = (
        total_tokens is None
        and (cfg.e4m3 or cfg.heads_m)
        and split_plan_sm_share(cfg, batch, heads, max_seq_len, sms) < STREAM_MIN_SM_SHARE
    )
    if cfg.wgmma or cfg.e4m3:
        stream = MLA_FP8_E4M3_STREAM
        if prefers_stream(total_tokens, batch, max_seq_len) or (
            idle and SHARE_STREAM_MIN_BATCH <= batch <= STREAM_MAX_BATCH
            and stream_programs(batch * max_seq_len, batch, stream.block_n,
                                stream.max_split_tokens, 1, sms, stream.balanced_waves)
            <= SHARE_STREAM_MAX_WAVES * sms
        ):
            return stream
    if cfg.heads_m:
        uneven = prefers_stream(total_tokens, batch, max_seq_len, HEADS_STREAM_MAX_BATCH,
                                HEADS_STREAM_MIN_TOKENS)  # fmt: skip
        if uneven or (idle and batch <= HEADS_STREAM_MAX_BATCH):
            return MLA_HEADS_M_STREAM
    return cfg


def pick_config(
    head_dim: int, group: int, mla: bool, fp8: bool = False, tokens: int | None = None
) -> DecodeConfig:
    """Tile sizes for a head shape, from the sweeps in bench/results/fp8_kv_tune.json and
    fp8_kv_variants.json (H200).

    GQA: tiles of 16384 elements (128 tokens at d128) with 4 warps and 2 stages were best for
    BF16 and FP8 alike; at most 64 query heads a program keeps the fp32 accumulator in registers.

    MLA is bound by latency, not bytes: a program's tile time is fixed by its dependent loads
    and MMA chains, so the context is split into exactly as many programs as the GPU holds at
    once (a partial second wave cost up to 1.3x). 16 heads a program: BF16 has the latent in
    quarters, 32 tokens a tile, 128 registers (4 programs per SM); FP8 runs a warp-specialized
    Gluon kernel (one program per SM): from ``E4M3_MIN_TOKENS`` the one with both products in
    e4m3 on 128-token tiles (``MLA_FP8_E4M3_128``), from ``E4M3_IN_PLACE_MIN_TOKENS`` the same
    on 64-token tiles with V^T written by its producer (``MLA_FP8_E4M3_IN_PLACE``), below that
    the one that widens each 64-token tile to fp16 (``MLA_FP8_WGMMA``: with the short splits
    1.65x the Triton kernel at one request of 1k, where it was 0.97x); ``MLA_FP8_TRITON`` off
    Hopper. The 16-heads kernels split as short as one tile (``SHORT_SPLITS``).
    (Where the caller gives a batch total that shows uneven lengths, ``paged_decode`` takes a
    kernel on the stream schedule instead: ``with_stream``, at every head count.)
    64+ heads: 64 heads a program, so each tile is read once instead of by four 16-head
    programs, in the Gluon kernel with the heads as the MMA's M (``MLA_HEADS_M``, one 8-warp
    program per SM), BF16 and FP8: 0.98-2.30x the Triton 64-heads kernel (``MLA_HEADS_TRITON``,
    which runs off Hopper) over the 64/128-head shapes of bench/results/fp8_kv_flashmla.json, a
    tie (0.98-0.99x) only at one request of 1k."""
    if mla:
        if group >= 64:
            return MLA_HEADS_M
        if fp8:
            if tokens is None or tokens >= E4M3_MIN_TOKENS:
                return MLA_FP8_E4M3_128
            if tokens >= E4M3_IN_PLACE_MIN_TOKENS:
                return MLA_FP8_E4M3_IN_PLACE
            return MLA_FP8_WGMMA
        return DecodeConfig(32, 16, 4, 2, True, 4, whole_waves=True, **SHORT_SPLITS)
    block_h = min(64, max(16, triton.next_power_of_2(group)))
    block_n = min(256, 16384 // head_dim)
    return DecodeConfig(block_n=block_n, block_h=block_h, num_warps=4, num_stages=2)


def plan_splits(
    programs: int,
    max_seq_len: int,
    block_n: int,
    num_sms: int,
    programs_per_sm: int = 4,
    whole_waves: bool = False,
    min_tiles: int = 4,
    max_splits: int = MAX_SPLITS,
) -> int:
    """How many splits of the context, at least ``min_tiles`` tiles each so the loads can
    pipeline, at most ``max_splits``.

    By default enough programs to fill the GPU ``programs_per_sm`` times over (rounded up: for
    bandwidth-bound kernels a last partial wave costs little). With ``whole_waves``, as many
    splits as keep every program in one wave of ``programs_per_sm`` per SM (rounded down)."""
    slots = programs_per_sm * num_sms
    programs = max(programs, 1)
    by_occupancy = max(1, slots // programs) if whole_waves else triton.cdiv(slots, programs)
    by_length = triton.cdiv(max(max_seq_len, 1), min_tiles * block_n)
    return max(1, min(by_occupancy, by_length, max_splits))


def plan_balanced_splits(
    total_tokens: int, max_seq_len: int, block_n: int, slots: int, min_tiles: int = 4,
    max_splits: int = MAX_SPLITS,
) -> tuple[int, int]:  # fmt: skip
    """(splits, tokens per split) when the batch's total length is known: every split of every
    request gets the same number of tokens, about ``total_tokens / slots``, so with mixed
    lengths the long requests get more splits instead of longer ones (the kernel's time is its
    longest program). At least ``min_tiles`` tiles a split, at most ``max_splits`` splits a
    request."""
    per_program = triton.cdiv(max(total_tokens, 1), max(slots, 1))
    split_len = max(
        triton.cdiv(per_program, block_n) * block_n,
        min_tiles * block_n,
        triton.cdiv(max_seq_len, max_splits * block_n) * block_n,
    )
    split_len = min(split_len, max(triton.cdiv(max_seq_len, block_n), min_tiles) * block_n)
    return max(1, triton.cdiv(max_seq_len, split_len)), split_len


def cap_split_tokens(
    splits: int, fixed_split_len: int, max_seq_len: int, cap: int, block_n: int,
    max_splits: int = MAX_SPLITS,
) -> tuple[int, int]:  # fmt: skip
    """(splits, fixed_split_len) with no split longer than ``cap`` tokens (0: no cap), as
    far as ``max_splits`` allows: more splits of the same requests (``fixed_split_len`` 0 is the
    equal-parts plan, whose parts are whole tiles)."""
    if not cap:
        return splits, fixed_split_len
    cap = max(cap // block_n, 1) * block_n
    if fixed_split_len:
        fixed_split_len = min(fixed_split_len, max(cap, triton.cdiv(
            max_seq_len, max_splits * block_n) * block_n))  # fmt: skip
        return max(1, triton.cdiv(max_seq_len, fixed_split_len)), fixed_split_len
    return min(max(splits, triton.cdiv(max_seq_len, cap)), max_splits), 0


def plan_pieces(
    max_seq_len: int, splits: int, block_n: int, cap: int, max_slots: int
) -> tuple[int, int]:  # fmt: skip
    """(pieces, tokens a piece) for a kernel that cuts each of a request's ``splits`` equal
    parts into pieces of at most ``cap`` tokens, each with its own partial output (the e4m3
    kernel, ``_consumer``): as many as the longest part (``max_seq_len`` in ``splits`` parts of
    whole tiles) needs, so the cap costs slots for partial outputs instead of programs. At most
    ``max_slots`` slots a request (splits x pieces; past that the last piece takes the rest, the
    cap's accuracy lost, no token). (1, 0) with no cap."""
    if not cap:
        return 1, 0
    piece_len = max(cap // block_n, 1) * block_n
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), splits), block_n) * block_n
    pieces = min(triton.cdiv(split_len, piece_len), max(max_slots // splits, 1))
    return pieces, piece_len


# Where the lengths are unknown, the e4m3 register kernel keeps its token cap by pieces, one
# wave at any bound. Side by side on an H100 with the pieces in the one tile loop
# (bench/results/mla_pieces_in_tile_loop_h100.json, _again_h100.json): 1.00-1.02x the speed of
# the 2-4 splits a request that capping by splits would run where they fill their waves
# (128 x 16k, 132 x 32k, 8 heads 128 x 32k), the one case it used to lose
# (docs/kernels-fp8-kv.md, "The token cap in pieces").
def equal_parts_plan(
    cfg: DecodeConfig, programs: int, max_seq_len: int, sms: int
) -> tuple[int, int, int]:  # fmt: skip
    """(splits a request, pieces a split, tokens a piece) for lengths unknown on the host (each
    request's length in equal parts, ``max_seq_len`` a bound on the longest): the splits that
    fill a wave (``plan_splits``), the token cap kept by pieces (``plan_pieces``) in the e4m3
    register kernel, by more splits (``cap_split_tokens``) in the others."""
    splits = plan_splits(programs, max_seq_len, cfg.block_n, sms, cfg.programs_per_sm,
                         cfg.whole_waves, cfg.min_split_tiles, cfg.max_splits)  # fmt: skip
    capped, _ = cap_split_tokens(splits, 0, max_seq_len, cfg.max_split_tokens, cfg.block_n,
                                 cfg.max_splits)  # fmt: skip
    if capped == splits or not cuts_in_pieces(cfg):
        return capped, 1, 0
    return splits, *plan_pieces(max_seq_len, splits, cfg.block_n, cfg.max_split_tokens,
                                cfg.max_splits)  # fmt: skip


# how far past a wave the one-wave balanced plan's estimate may go before two waves pay
# (plan_balanced_waves): between the mixes measured at 1.09 waves (one wave faster) and 1.21
ONE_WAVE_SLACK = 1.15


def plan_balanced_waves(
    total_tokens: int, max_seq_len: int, block_n: int, wave: int, requests: int, waves: int,
    min_tiles: int = 4, max_splits: int = MAX_SPLITS,
) -> tuple[int, int]:  # fmt: skip
    """``plan_balanced_splits`` for ``waves`` waves of ``wave`` programs, or for one where that
    plan is expected to fit one, or overflow it by less than ``ONE_WAVE_SLACK``: a request's last
    split is half full on average, so about ``total / split + requests / 2`` programs. On the
    1k-8k mix (bench/results/fp8_kv_flashmla.json, 8-16 heads, timed side by side): two waves
    took 0.81-0.95x the time of one at 64 and 256 requests (estimate 1.21-1.94 waves), 1.05-1.09x
    at 32 (1.09 waves, 152 programs of 132); at 16 both plans are one wave."""
    limits = {"min_tiles": min_tiles, "max_splits": max_splits}
    one = plan_balanced_splits(total_tokens, max_seq_len, block_n, wave, **limits)
    estimate = triton.cdiv(max(total_tokens, 1), one[1]) + requests // 2
    if waves == 1 or estimate <= wave * ONE_WAVE_SLACK:
        return one
    return plan_balanced_splits(total_tokens, max_seq_len, block_n, wave * waves, **limits)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    return _num_sms(device.index or 0) if device.type == "cuda" else 8


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def is_hopper(device: torch.device) -> bool:
    """sm_90, where the Gluon kernel's warpgroup MMA runs."""
    return device.type == "cuda" and _is_hopper(device.index or 0)


@triton.jit
def _dot(a, b, INTERPRETED: tl.constexpr):
    """``a @ b`` in fp32; the Triton interpreter gets 16-bit dots wrong, so it widens first."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _widen_fp8(x, INTERPRETED: tl.constexpr):
    """e4m3 -> fp16 in registers, two values per instruction. As inline assembly Triton cannot
    move the conversion after the tile's trip through shared memory, where 8-bit operands that
    need a transpose are read one byte at a time (seen in the PTX: 128 ld.shared.b8 a tile);
    ``is_pure=False`` also keeps it from redoing the conversion in the MMA operand layouts
    (which brought those byte loads back, 255 registers and spills, in the MLA kernel)."""
    if INTERPRETED:
        return x.to(tl.float16)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _split_kernel(
    Q,
    K,
    V,
    K_SCALE,
    V_SCALE,
    seq_lens,
    indptr,
    indices,
    part_out,
    part_lse,
    sm_scale_log2e,
    num_splits,
    fixed_split_len,
    num_kv_heads,
    head_blocks,
    group_size,
    stride_qb,
    stride_qh,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_ks_slot,
    stride_ks_head,
    stride_vs_slot,
    stride_vs_head,
    stride_pb,
    stride_ph,
    stride_ps,
    PAGE_SIZE: tl.constexpr,
    ENTRIES_PER_PAGE: tl.constexpr,
    LENS_ARE_ENDS: tl.constexpr,
    BALANCED: tl.constexpr,
    D: tl.constexpr,
    D_ROPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    V_FROM_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    hb = pid % head_blocks
    kvh = (pid // head_blocks) % num_kv_heads
    b = pid // (head_blocks * num_kv_heads)

    in_group = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < group_size
    heads = kvh * group_size + in_group
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)

    row, start, end = _split_range(
        seq_lens, indptr, b, split, num_splits, fixed_split_len, LENS_ARE_ENDS, BLOCK_N, BALANCED
    )

    compute_dtype = tl.float16 if FP8 else Q.dtype.element_ty
    q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_ptr + offs_d[None, :], mask=mask_h[:, None], other=0.0).to(compute_dtype)
    if D_ROPE > 0:
        offs_r = D + tl.arange(0, D_ROPE)
        q_rope = tl.load(q_ptr + offs_r[None, :], mask=mask_h[:, None], other=0.0)
        q_rope = q_rope.to(compute_dtype)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    k_base = K + kvh * stride_k_head
    v_base = V + kvh * stride_v_head
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        entry = tl.load(
            indices + row + (offs_n // PAGE_SIZE) * ENTRIES_PER_PAGE, mask=mask_n, other=0
        ).to(tl.int64)
        slot = (entry // ENTRIES_PER_PAGE) * PAGE_SIZE + offs_n % PAGE_SIZE

        k = tl.load(
            k_base + slot[:, None] * stride_k_slot + offs_d[None, :],
            mask=mask_n[:, None],
            other=0.0,
        )
        if FP8 and V_FROM_K:
            k = _widen_fp8(k, INTERPRETED)  # it is the V operand too
        else:
            k = k.to(compute_dtype)
        s = _dot(q, tl.trans(k), INTERPRETED)
        if D_ROPE > 0:
            k_rope = tl.load(
                k_base + slot[:, None] * stride_k_slot + offs_r[None, :],
                mask=mask_n[:, None],
                other=0.0,
            ).to(compute_dtype)
            s += _dot(q_rope, tl.trans(k_rope), INTERPRETED)
        if FP8:
            k_scale = tl.load(
                K_SCALE + slot * stride_ks_slot + kvh * stride_ks_head, mask=mask_n, other=0.0
            )
            s *= k_scale[None, :]
        s = tl.where(mask_n[None, :], s * sm_scale_log2e, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if V_FROM_K:
            v = k
        else:
            v = tl.load(
                v_base + slot[:, None] * stride_v_slot + offs_dv[None, :],
                mask=mask_n[:, None],
                other=0.0,
            )
            if FP8:
                v = _widen_fp8(v, INTERPRETED)
            else:
                v = v.to(compute_dtype)
        if FP8:
            if V_FROM_K:
                v_scale = k_scale
            else:
                v_scale = tl.load(
                    V_SCALE + slot * stride_vs_slot + kvh * stride_vs_head, mask=mask_n, other=0.0
                )
            # Scale p by v_scale relative to the tile's largest, so fp16 p keeps its precision.
            v_top = tl.max(v_scale, axis=0)
            pv = (p * (v_scale / v_top)[None, :]).to(compute_dtype)
            acc = acc * alpha[:, None] + _dot(pv, v, INTERPRETED) * v_top
        else:
            acc = acc * alpha[:, None] + _dot(p.to(compute_dtype), v, INTERPRETED)
        m = m_new

    empty = l == 0.0  # a split past the request's end
    l = tl.where(empty, 1.0, l)
    out = acc / l[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log2(l))
    part = part_out + b * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(part[:, None] + offs_dv[None, :], out, mask=mask_h[:, None])
    tl.store(part_lse + (b * stride_pb + heads * stride_ph) // DV + split, lse, mask=mask_h)


@triton.jit
def _row_max(x):
    return tl.max(tl.abs(x.to(tl.float32)), axis=1)


@triton.jit
def _e4m3_parts(y, PARTS: tl.constexpr):
    """fp32 ``y`` as e4m3, and with ``PARTS == 2`` its rounding residual as a second e4m3
    part (else the first part again, unused)."""
    hi = y.to(tl.float8e4nv)
    if PARTS == 2:
        return hi, (y - hi.to(tl.float32)).to(tl.float8e4nv)
    return hi, hi


@triton.jit
def _quarter(rows, col0, DQ: tl.constexpr, mask_n, FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """``DQ`` columns from ``col0`` of the tile's token rows, widened to fp16 when FP8."""
    t = tl.load(rows + col0 + tl.arange(0, DQ)[None, :], mask=mask_n[:, None], other=0.0)
    if FP8:
        t = _widen_fp8(t, INTERPRETED)
    return t


@triton.jit
def _mla_tile_slots(
    indices, row, n0, offs_n, mask_n, PAGE_SIZE: tl.constexpr, ENTRIES_PER_PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The KV slots of the tile of tokens ``offs_n`` (from ``n0``) of the request whose table
    starts at ``row``."""
    if BLOCK_N <= PAGE_SIZE:
        # tiles start at multiples of BLOCK_N, so a tile lies in one page: one entry per
        # tile (a gather per token cost the BF16 kernel 31% with SGLang's token-level table)
        entry = tl.load(indices + row + (n0 // PAGE_SIZE) * ENTRIES_PER_PAGE).to(tl.int64)
    else:
        entry = tl.load(
            indices + row + (offs_n // PAGE_SIZE) * ENTRIES_PER_PAGE, mask=mask_n, other=0
        ).to(tl.int64)
    return (entry // ENTRIES_PER_PAGE) * PAGE_SIZE + offs_n % PAGE_SIZE


@triton.jit
def _mla_q(
    q_rows, mask_h, D: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
    cdt: tl.constexpr, NATIVE_QK: tl.constexpr, QK_PARTS: tl.constexpr,
):  # fmt: skip
    """The query heads' four latent quarters and rope part as the products' operands, their
    second e4m3 parts (the first again where unused) and the per-head unit the scores are in.

    ``NATIVE_QK``: q per head in e4m3 (its largest entry at 448), the scale folded into the
    scores; with two parts the second holds the rounding residual of the first. Otherwise
    ``cdt`` (the widened tiles' type) and a unit of 1."""
    DQ: tl.constexpr = D // 4
    q0 = tl.load(q_rows + tl.arange(0, DQ)[None, :], mask=mask_h[:, None], other=0.0)
    q1 = tl.load(q_rows + DQ + tl.arange(0, DQ)[None, :], mask=mask_h[:, None], other=0.0)
    q2 = tl.load(q_rows + 2 * DQ + tl.arange(0, DQ)[None, :], mask=mask_h[:, None], other=0.0)
    q3 = tl.load(q_rows + 3 * DQ + tl.arange(0, DQ)[None, :], mask=mask_h[:, None], other=0.0)
    qr = tl.load(q_rows + D + tl.arange(0, D_ROPE)[None, :], mask=mask_h[:, None], other=0.0)
    if NATIVE_QK:
        q_top = tl.maximum(tl.maximum(_row_max(q0), _row_max(q1)), _row_max(qr))
        q_top = tl.maximum(q_top, tl.maximum(_row_max(q2), _row_max(q3)))
        q_unit = tl.maximum(q_top, 1e-30) / 448.0
        q0, q0l = _e4m3_parts(q0.to(tl.float32) / q_unit[:, None], QK_PARTS)
        q1, q1l = _e4m3_parts(q1.to(tl.float32) / q_unit[:, None], QK_PARTS)
        q2, q2l = _e4m3_parts(q2.to(tl.float32) / q_unit[:, None], QK_PARTS)
        q3, q3l = _e4m3_parts(q3.to(tl.float32) / q_unit[:, None], QK_PARTS)
        qr, qrl = _e4m3_parts(qr.to(tl.float32) / q_unit[:, None], QK_PARTS)
    else:
        q_unit = tl.full([BLOCK_H], 1.0, tl.float32)
        q0, q1, q2, q3, qr = q0.to(cdt), q1.to(cdt), q2.to(cdt), q3.to(cdt), qr.to(cdt)
        q0l, q1l, q2l, q3l, qrl = q0, q1, q2, q3, qr
    return q0, q1, q2, q3, qr, q0l, q1l, q2l, q3l, qrl, q_unit


@triton.jit
def _mla_kernel(
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
    PAGE_SIZE: tl.constexpr,
    ENTRIES_PER_PAGE: tl.constexpr,
    LENS_ARE_ENDS: tl.constexpr,
    BALANCED: tl.constexpr,
    D: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
    QK_PARTS: tl.constexpr = 0,
    PV_PARTS: tl.constexpr = 0,
):
    """Stage 1 for MLA (one KV head of ``D`` latent + ``D_ROPE`` rope dims, V = the latent
    dims), with the latent dims in four quarters: four loads, four QK products and four PV
    accumulators instead of one 576-wide tile. Same math as ``_split_kernel``."""
    DQ: tl.constexpr = D // 4
    pid = tl.program_id(0)
    split = tl.program_id(1)
    hb = pid % head_blocks
    b = pid // head_blocks
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads

    row, start, end = _split_range(
        seq_lens, indptr, b, split, num_splits, fixed_split_len, LENS_ARE_ENDS, BLOCK_N, BALANCED
    )

    cdt: tl.constexpr = tl.float16 if FP8 else tl.bfloat16
    NATIVE_QK: tl.constexpr = FP8 and QK_PARTS > 0
    NATIVE_PV: tl.constexpr = FP8 and PV_PARTS > 0
    q0, q1, q2, q3, qr, q0l, q1l, q2l, q3l, qrl, q_unit = _mla_q(
        Q + b * stride_qb + heads[:, None] * stride_qh, mask_h, D, D_ROPE, BLOCK_H, cdt,
        NATIVE_QK, QK_PARTS,
    )  # fmt: skip

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, DQ], tl.float32)
    acc1 = tl.zeros([BLOCK_H, DQ], tl.float32)
    acc2 = tl.zeros([BLOCK_H, DQ], tl.float32)
    acc3 = tl.zeros([BLOCK_H, DQ], tl.float32)
    acc_unit = 1.0  # FP8: acc holds the output divided by the last tile's largest V scale
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = _mla_tile_slots(indices, row, n0, offs_n, mask_n, PAGE_SIZE, ENTRIES_PER_PAGE,
                               BLOCK_N)
        rows = KV + slot[:, None] * stride_kv_slot
        if NATIVE_QK:
            # e4m3 tiles straight into the products (no widening on the scores' path)
            k0 = _quarter(rows, 0, DQ, mask_n, False, INTERPRETED)
            k1 = _quarter(rows, DQ, DQ, mask_n, False, INTERPRETED)
            k2 = _quarter(rows, 2 * DQ, DQ, mask_n, False, INTERPRETED)
            k3 = _quarter(rows, 3 * DQ, DQ, mask_n, False, INTERPRETED)
            kr = _quarter(rows, D, D_ROPE, mask_n, False, INTERPRETED)
            s = (_dot(q0, tl.trans(k0), INTERPRETED) + _dot(q1, tl.trans(k1), INTERPRETED)) + (
                _dot(q2, tl.trans(k2), INTERPRETED) + _dot(q3, tl.trans(k3), INTERPRETED)
            )
            s += _dot(qr, tl.trans(kr), INTERPRETED)
            if QK_PARTS == 2:
                s += (
                    _dot(q0l, tl.trans(k0), INTERPRETED) + _dot(q1l, tl.trans(k1), INTERPRETED)
                ) + (_dot(q2l, tl.trans(k2), INTERPRETED) + _dot(q3l, tl.trans(k3), INTERPRETED))
                s += _dot(qrl, tl.trans(kr), INTERPRETED)
        else:
            k0 = _quarter(rows, 0, DQ, mask_n, FP8, INTERPRETED)
            k1 = _quarter(rows, DQ, DQ, mask_n, FP8, INTERPRETED)
            k2 = _quarter(rows, 2 * DQ, DQ, mask_n, FP8, INTERPRETED)
            k3 = _quarter(rows, 3 * DQ, DQ, mask_n, FP8, INTERPRETED)
            kr = _quarter(rows, D, D_ROPE, mask_n, FP8, INTERPRETED)
            # Two sums of two products each: Triton folds "dot + x" into the dot's accumulator,
            # so this grouping leaves two MMA chains of half the depth instead of one.
            s = (_dot(q0, tl.trans(k0), INTERPRETED) + _dot(q1, tl.trans(k1), INTERPRETED)) + (
                _dot(q2, tl.trans(k2), INTERPRETED) + _dot(q3, tl.trans(k3), INTERPRETED)
            )
            s += _dot(qr, tl.trans(kr), INTERPRETED)
        if FP8:
            scale = tl.load(KV_SCALE + slot * stride_s_slot, mask=mask_n, other=0.0)
            s = s * q_unit[:, None] * (scale * sm_scale_log2e)[None, :]
        else:
            s = s * sm_scale_log2e
        s = tl.where(mask_n[None, :], s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if FP8:
            # V scales go into p relative to the tile's largest (fp16 keeps p's precision);
            # the accumulator is re-based on that largest scale instead of multiplied by it.
            # In e4m3, p is also lifted by 2^8 so that small weights stay normal numbers.
            v_top = tl.maximum(tl.max(scale, axis=0), 1e-30)
            if NATIVE_PV:
                v_top = v_top / 256.0
            p = p * (scale / v_top)[None, :]
            alpha = alpha * (acc_unit / v_top)
            acc_unit = v_top
        if NATIVE_PV:
            p8, p8l = _e4m3_parts(p, PV_PARTS)
            if NATIVE_QK:
                v0, v1, v2, v3 = k0, k1, k2, k3
            else:  # the tile was widened for the scores: V is read again as e4m3
                v0 = _quarter(rows, 0, DQ, mask_n, False, INTERPRETED)
                v1 = _quarter(rows, DQ, DQ, mask_n, False, INTERPRETED)
                v2 = _quarter(rows, 2 * DQ, DQ, mask_n, False, INTERPRETED)
                v3 = _quarter(rows, 3 * DQ, DQ, mask_n, False, INTERPRETED)
            acc0 = _dot(p8, v0, INTERPRETED) + acc0 * alpha[:, None]
            acc1 = _dot(p8, v1, INTERPRETED) + acc1 * alpha[:, None]
            acc2 = _dot(p8, v2, INTERPRETED) + acc2 * alpha[:, None]
            acc3 = _dot(p8, v3, INTERPRETED) + acc3 * alpha[:, None]
            if PV_PARTS == 2:
                acc0 += _dot(p8l, v0, INTERPRETED)
                acc1 += _dot(p8l, v1, INTERPRETED)
                acc2 += _dot(p8l, v2, INTERPRETED)
                acc3 += _dot(p8l, v3, INTERPRETED)
        else:
            if NATIVE_QK:  # V widened from the same e4m3 tile, off the scores' path
                k0 = _widen_fp8(k0, INTERPRETED)
                k1 = _widen_fp8(k1, INTERPRETED)
                k2 = _widen_fp8(k2, INTERPRETED)
                k3 = _widen_fp8(k3, INTERPRETED)
            pc = p.to(cdt)
            acc0 = _dot(pc, k0, INTERPRETED) + acc0 * alpha[:, None]
            acc1 = _dot(pc, k1, INTERPRETED) + acc1 * alpha[:, None]
            acc2 = _dot(pc, k2, INTERPRETED) + acc2 * alpha[:, None]
            acc3 = _dot(pc, k3, INTERPRETED) + acc3 * alpha[:, None]
        m = m_new

    empty = l == 0.0  # a split past the request's end
    l = tl.where(empty, 1.0, l)
    lse = tl.where(empty, float("-inf"), m + tl.log2(l))
    norm = (acc_unit / l)[:, None]
    part = part_out + b * stride_pb + heads * stride_ph + split * stride_ps
    cols = tl.arange(0, DQ)[None, :]
    tl.store(part[:, None] + cols, acc0 * norm, mask=mask_h[:, None])
    tl.store(part[:, None] + DQ + cols, acc1 * norm, mask=mask_h[:, None])
    tl.store(part[:, None] + 2 * DQ + cols, acc2 * norm, mask=mask_h[:, None])
    tl.store(part[:, None] + 3 * DQ + cols, acc3 * norm, mask=mask_h[:, None])
    tl.store(part_lse + (b * stride_pb + heads * stride_ph) // D + split, lse, mask=mask_h)


@triton.jit
def _v_operand(k, WIDEN: tl.constexpr, INTERPRETED: tl.constexpr):
    """The tile as PV's operand: e4m3 tiles (kept raw for the e4m3 scores) widened to fp16."""
    if WIDEN:
        v = _widen_fp8(k, INTERPRETED)
    else:
        v = k
    return v


@triton.jit
def _mla_tokens_m_kernel(
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
    PAGE_SIZE: tl.constexpr,
    ENTRIES_PER_PAGE: tl.constexpr,
    LENS_ARE_ENDS: tl.constexpr,
    BALANCED: tl.constexpr,
    D: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
    QK_PARTS: tl.constexpr = 0,
    PV_PARTS: tl.constexpr = 0,
):
    """Stage 1 for MLA with the products transposed: tokens are the MMA's M (64 a tile, what
    Hopper's wgmma needs) and the few query heads its N, so 8 or 16 heads fill no padding and
    FP8 tiles feed an e4m3 product straight from shared memory (the KV tile is the K-major
    operand; q, per head in e4m3, the other). ``s^T[n, h]``, the softmax over ``n`` per
    column, ``o^T[d, h] += v^T[d, n] p^T[n, h]`` with V widened to fp16 (8-bit operands must be
    K-major, and V's K is its token axis). Same math as ``_mla_kernel``."""
    DQ: tl.constexpr = D // 4
    pid = tl.program_id(0)
    split = tl.program_id(1)
    hb = pid % head_blocks
    b = pid // head_blocks
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads

    row, start, end = _split_range(
        seq_lens, indptr, b, split, num_splits, fixed_split_len, LENS_ARE_ENDS, BLOCK_N, BALANCED
    )
    NATIVE_QK: tl.constexpr = FP8 and QK_PARTS > 0
    NATIVE_PV: tl.constexpr = NATIVE_QK and PV_PARTS > 0  # V is then the raw e4m3 tile
    cdt: tl.constexpr = tl.float16 if FP8 else tl.bfloat16
    q0, q1, q2, q3, qr, q0l, q1l, q2l, q3l, qrl, q_unit = _mla_q(
        Q + b * stride_qb + heads[:, None] * stride_qh, mask_h, D, D_ROPE, BLOCK_H, cdt,
        NATIVE_QK, QK_PARTS,
    )  # fmt: skip
    # the heads as the products' N: every query operand transposed
    q0, q1, q2, q3, qr = tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3), tl.trans(qr)
    if QK_PARTS == 2 and NATIVE_QK:
        q0l, q1l, q2l, q3l = tl.trans(q0l), tl.trans(q1l), tl.trans(q2l), tl.trans(q3l)
        qrl = tl.trans(qrl)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([DQ, BLOCK_H], tl.float32)
    acc1 = tl.zeros([DQ, BLOCK_H], tl.float32)
    acc2 = tl.zeros([DQ, BLOCK_H], tl.float32)
    acc3 = tl.zeros([DQ, BLOCK_H], tl.float32)
    acc_unit = 1.0
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = _mla_tile_slots(indices, row, n0, offs_n, mask_n, PAGE_SIZE, ENTRIES_PER_PAGE,
                               BLOCK_N)
        rows = KV + slot[:, None] * stride_kv_slot
        k0 = _quarter(rows, 0, DQ, mask_n, FP8 and not NATIVE_QK, INTERPRETED)
        k1 = _quarter(rows, DQ, DQ, mask_n, FP8 and not NATIVE_QK, INTERPRETED)
        k2 = _quarter(rows, 2 * DQ, DQ, mask_n, FP8 and not NATIVE_QK, INTERPRETED)
        k3 = _quarter(rows, 3 * DQ, DQ, mask_n, FP8 and not NATIVE_QK, INTERPRETED)
        kr = _quarter(rows, D, D_ROPE, mask_n, FP8 and not NATIVE_QK, INTERPRETED)
        s = (_dot(k0, q0, INTERPRETED) + _dot(k1, q1, INTERPRETED)) + (
            _dot(k2, q2, INTERPRETED) + _dot(k3, q3, INTERPRETED)
        )
        s += _dot(kr, qr, INTERPRETED)
        if QK_PARTS == 2 and NATIVE_QK:
            s += (_dot(k0, q0l, INTERPRETED) + _dot(k1, q1l, INTERPRETED)) + (
                _dot(k2, q2l, INTERPRETED) + _dot(k3, q3l, INTERPRETED)
            )
            s += _dot(kr, qrl, INTERPRETED)
        if FP8:
            scale = tl.load(KV_SCALE + slot * stride_s_slot, mask=mask_n, other=0.0)
            s = s * (scale * sm_scale_log2e)[:, None] * q_unit[None, :]
        else:
            s = s * sm_scale_log2e
        s = tl.where(mask_n[:, None], s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[None, :])
        l = l * alpha + tl.sum(p, axis=0)
        if FP8:
            v_top = tl.maximum(tl.max(scale, axis=0), 1e-30)
            if NATIVE_PV:
                v_top = v_top / 256.0  # p lifted by 2^8: small weights stay normal in e4m3
            p = p * (scale / v_top)[:, None]
            alpha = alpha * (acc_unit / v_top)
            acc_unit = v_top
        if NATIVE_PV:
            p8, p8l = _e4m3_parts(p, PV_PARTS)
            acc0 = _dot(tl.trans(k0), p8, INTERPRETED) + acc0 * alpha[None, :]
            acc1 = _dot(tl.trans(k1), p8, INTERPRETED) + acc1 * alpha[None, :]
            acc2 = _dot(tl.trans(k2), p8, INTERPRETED) + acc2 * alpha[None, :]
            acc3 = _dot(tl.trans(k3), p8, INTERPRETED) + acc3 * alpha[None, :]
            if PV_PARTS == 2:
                acc0 += _dot(tl.trans(k0), p8l, INTERPRETED)
                acc1 += _dot(tl.trans(k1), p8l, INTERPRETED)
                acc2 += _dot(tl.trans(k2), p8l, INTERPRETED)
                acc3 += _dot(tl.trans(k3), p8l, INTERPRETED)
        else:
            pc = p.to(cdt)
            # each quarter widened just before its product (the order is kept: the widening is
            # not pure), so one widened quarter is live at a time, not four
            acc0 = _dot(tl.trans(_v_operand(k0, NATIVE_QK, INTERPRETED)), pc, INTERPRETED) + (
                acc0 * alpha[None, :]
            )
            acc1 = _dot(tl.trans(_v_operand(k1, NATIVE_QK, INTERPRETED)), pc, INTERPRETED) + (
                acc1 * alpha[None, :]
            )
            acc2 = _dot(tl.trans(_v_operand(k2, NATIVE_QK, INTERPRETED)), pc, INTERPRETED) + (
                acc2 * alpha[None, :]
            )
            acc3 = _dot(tl.trans(_v_operand(k3, NATIVE_QK, INTERPRETED)), pc, INTERPRETED) + (
                acc3 * alpha[None, :]
            )
        m = m_new

    empty = l == 0.0
    l = tl.where(empty, 1.0, l)
    lse = tl.where(empty, float("-inf"), m + tl.log2(l))
    norm = (acc_unit / l)[None, :]
    part = part_out + b * stride_pb + heads * stride_ph + split * stride_ps
    dims = tl.arange(0, DQ)[:, None]
    tl.store(part[None, :] + dims, acc0 * norm, mask=mask_h[None, :])
    tl.store(part[None, :] + DQ + dims, acc1 * norm, mask=mask_h[None, :])
    tl.store(part[None, :] + 2 * DQ + dims, acc2 * norm, mask=mask_h[None, :])
    tl.store(part[None, :] + 3 * DQ + dims, acc3 * norm, mask=mask_h[None, :])
    tl.store(part_lse + (b * stride_pb + heads * stride_ph) // D + split, lse, mask=mask_h)


@triton.jit
def _merge_kernel(
    part_out,
    part_lse,
    out,
    num_heads,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_ob,
    stride_oh,
    DV: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_dv = tl.arange(0, DV)
    lse_base = part_lse + (b * stride_pb + h * stride_ph) // DV
    lse = tl.load(lse_base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty request: every weight below is 0
    weight = tl.exp2(lse - m)
    total = tl.sum(weight, axis=0)
    acc = tl.zeros([DV], tl.float32)
    base = part_out + b * stride_pb + h * stride_ph
    for s in range(0, num_splits):
        lse_s = tl.load(lse_base + s)
        # a split past the request's end (lse -inf) weighs nothing, and the Gluon kernels
        # leave its output unwritten
        if lse_s > float("-inf"):
            acc += tl.exp2(lse_s - m) * tl.load(base + s * stride_ps + offs_dv)
    result = acc / tl.where(total > 0.0, total, 1.0)  # acc is 0 when total is
    tl.store(out + b * stride_ob + h * stride_oh + offs_dv, result.to(out.dtype.element_ty))


@triton.jit
def _merge_at_once_kernel(
    part_out, part_lse, out, num_splits, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS_P2: tl.constexpr,
):  # fmt: skip
    """``_merge_kernel`` as one tile a program: request ``b``, head ``h``, dims ``c * BLOCK_DV``
    on, every split's partial output of them loaded at once, so the loads do not wait on each
    other split after split. A split whose log-sum-exp is -inf (past its request's end: the
    Gluon kernels leave its output unwritten) is not read."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    offs_s = tl.arange(0, SPLITS_P2)
    lse = tl.load(part_lse + (b * stride_pb + h * stride_ph) // DV + offs_s,
                  mask=offs_s < num_splits, other=float("-inf"))  # fmt: skip
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty request: every weight below is 0
    weight = tl.exp2(lse - m)
    total = tl.sum(weight, axis=0)
    offs_dv = c * BLOCK_DV + tl.arange(0, BLOCK_DV)
    rows = part_out + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
    x = tl.load(rows + offs_dv[None, :], mask=(lse > float("-inf"))[:, None], other=0.0)
    result = tl.sum(weight[:, None] * x, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out + b * stride_ob + h * stride_oh + offs_dv, result.to(out.dtype.element_ty))


@triton.jit
def _stream_merge_kernel(
    part_out, part_lse, out, seq_lens, indptr, batch, programs, stride_pp, stride_ph,
    stride_ps, stride_ob, stride_oh, LENS_ARE_ENDS: tl.constexpr, BLOCK_N: tl.constexpr,
    BATCH_P2: tl.constexpr, DV: tl.constexpr,
):  # fmt: skip
    """Stage 2 of the stream schedule (mla_stream.py): request ``b``'s output for head ``h``
    from the partial outputs of the programs its tiles were cut across (slot 1 in the first,
    slot 0 in the others); nothing for a request one program finished, zeros for an empty one."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    idx = tl.arange(0, BATCH_P2)
    valid = idx < batch
    lens = tl.load(seq_lens + idx, mask=valid, other=0).to(tl.int32)
    if LENS_ARE_ENDS:
        lens -= tl.load(indptr + idx, mask=valid, other=0).to(tl.int32)
    tiles = (lens + BLOCK_N - 1) // BLOCK_N
    per_program = tl.maximum(tl.cdiv(tl.sum(tiles, axis=0), programs), 1)
    first = tl.sum(tl.where(idx < b, tiles, 0), axis=0)
    count = tl.sum(tl.where(idx == b, tiles, 0), axis=0)
    p0 = first // per_program
    p1 = (first + count - 1) // per_program
    offs = tl.arange(0, DV)
    dst = out + b * stride_ob + h * stride_oh + offs
    if count == 0:
        tl.store(dst, tl.zeros([DV], tl.float32).to(out.dtype.element_ty))
    elif p1 > p0:
        m = tl.full([], float("-inf"), tl.float32)
        for p in range(p0, p1 + 1):  # the piece's slot: 1 in p0, where the request begins
            at = p * stride_pp + h * stride_ph + tl.where(p == p0, stride_ps, 0)
            m = tl.maximum(m, tl.load(part_lse + at // DV))
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([DV], tl.float32)
        for p in range(p0, p1 + 1):
            at = p * stride_pp + h * stride_ph + tl.where(p == p0, stride_ps, 0)
            w = tl.exp2(tl.load(part_lse + at // DV) - m)
            total += w
            acc += w * tl.load(part_out + at + offs)
        tl.store(dst, (acc / total).to(out.dtype.element_ty))


def paged_decode(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    table: PageTable,
    sm_scale: float,
    *,
    rope_dim: int,
    max_seq_len: int | None,
    out: torch.Tensor | None,
    config: DecodeConfig | None,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """Launch both stages. Rows are flat ``[num_slots, kv_heads, dim]`` caches (already checked by
    the callers); ``v_rows is k_rows`` selects the MLA form; ``scales`` are FP8's
    ``[num_slots, kv_heads]`` (K, V) scale views, or None for BF16."""
    batch, num_heads, qk_dim = q.shape
    num_kv_heads = k_rows.shape[1]
    v_from_k = v_rows is k_rows
    dim = qk_dim - rope_dim
    dv = dim if v_from_k else v_rows.shape[2]
    if q.stride(-1) != 1:
        raise ValueError("q's last dim must be contiguous")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if table.batch_size != batch:
        raise ValueError(f"q has {batch} requests but the page table {table.batch_size}")
    for name, d in (("qk head dim", dim), ("v head dim", dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {d}")
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = int(table.lengths().max()) if batch else 0  # a host sync
    # the batch's tokens, for the kernel choice: exact when given, else bounded both by the
    # longest request and by what the table addresses (SGLang's adapter passes the table's
    # length as max_seq_len, so batch * max_seq_len alone overcounts by the batch size)
    tokens = total_tokens
    if tokens is None:
        tokens = min(batch * max_seq_len, table.max_tokens)
    cfg = config or pick_config(dim, group, v_from_k, fp8=scales is not None, tokens=tokens)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    sms = num_sms(q.device)
    if config is None:
        cfg = with_stream(cfg, total_tokens, batch, max_seq_len, group, sms)
    if (cfg.wgmma or cfg.e4m3) and (interpreted or not is_hopper(q.device)):
        cfg = MLA_FP8_TRITON
    if cfg.heads_m and (interpreted or not is_hopper(q.device)):
        cfg = MLA_HEADS_TRITON
    head_blocks = triton.cdiv(group, cfg.block_h)
    programs = batch * num_kv_heads * head_blocks
    if cfg.stream and batch > (HEADS_STREAM_MAX_BATCH if cfg.heads_m else STREAM_MAX_BATCH):
        cfg = replace(cfg, stream=False)  # a caller's stream config, past what it takes
    if v_from_k and (cfg.wgmma or cfg.e4m3):  # the Gluon kernels' shapes
        tiles = {(64, 4)}
        if cfg.e4m3 and not (cfg.e4m3_in_place or cfg.stream):
            tiles.add((128, 8))  # the register kernel on two consumer warpgroups
        if (scales is None or (dim, rope_dim, cfg.block_h) != (512, 64, 16)
                or (cfg.block_n, cfg.num_warps) not in tiles):  # fmt: skip
            raise ValueError(
                "the wgmma MLA kernel takes FP8 pages of 512 latent + 64 rope dims with tiles of "
                f"16 heads and (tokens, warps) in {sorted(tiles)}, got "
                f"{'FP8' if scales else 'BF16'} {dim} + {rope_dim} dims, block_n={cfg.block_n}, "
                f"block_h={cfg.block_h}, num_warps={cfg.num_warps}"
            )
    if v_from_k and cfg.heads_m:  # its tile sizes are the kernel's own constants
        if (dim, rope_dim, cfg.block_n, cfg.block_h, cfg.num_warps) != (512, 64, 64, 64, 8):
            raise ValueError(
                "the heads-as-M MLA kernel takes 512 latent + 64 rope dims with 64-token tiles "
                f"of 64 heads and 8 warps, got {dim} + {rope_dim} dims, block_n={cfg.block_n}, "
                f"block_h={cfg.block_h}, num_warps={cfg.num_warps}"
            )

    if out is None:
        out = torch.empty(batch, num_heads, dv, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (batch, num_heads, dv) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{batch}, {num_heads}, {dv}], got {tuple(out.shape)}")
    if batch == 0:
        return out
    if v_from_k and cfg.stream:
        kv_scale = scales[0] if scales is not None else None
        _stream_decode(q, k_rows, kv_scale, table, sm_scale, rope_dim, out, cfg, tokens, sms)
        return out
    if total_tokens is None:
        fixed_split_len = 0  # each request's length in ``splits`` equal parts
        splits, pieces, piece_len = equal_parts_plan(cfg, programs, max_seq_len, sms)
    else:
        pieces, piece_len = 1, 0
        splits, fixed_split_len = plan_balanced_waves(
            total_tokens * num_kv_heads * head_blocks,
            max_seq_len,
            cfg.block_n,
            cfg.programs_per_sm * sms,
            programs,
            cfg.balanced_waves,
            min_tiles=cfg.min_split_tiles,
            max_splits=cfg.max_splits,
        )
        splits, fixed_split_len = cap_split_tokens(
            splits, fixed_split_len, max_seq_len, cfg.max_split_tokens, cfg.block_n,
            cfg.max_splits,
        )  # fmt: skip

    slots = splits * pieces  # the partial outputs a request: piece p of split s in p x splits + s
    part_out = torch.empty(batch, num_heads, slots, dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, slots, dtype=torch.float32, device=q.device)
    k_scale, v_scale = scales if scales is not None else (k_rows, v_rows)  # unused when BF16
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.max_registers and not interpreted:
        launch["maxnreg"] = cfg.max_registers
    shared = {  # the arguments both stage-1 kernels take, by name
        "Q": q, "seq_lens": table.seq_lens, "indptr": table.indptr, "indices": table.indices,
        "part_out": part_out, "part_lse": part_lse, "sm_scale_log2e": sm_scale * LOG2E,
        "num_splits": splits, "fixed_split_len": fixed_split_len, "head_blocks": head_blocks,
        "stride_qb": q.stride(0), "stride_qh": q.stride(1), "stride_pb": part_out.stride(0),
        "stride_ph": part_out.stride(1), "stride_ps": part_out.stride(2),
        "PAGE_SIZE": table.page_size, "ENTRIES_PER_PAGE": table.entries_per_page,
        "LENS_ARE_ENDS": table.seq_lens_are_ends, "BALANCED": fixed_split_len > 0,
        "D": dim, "D_ROPE": rope_dim,
        "BLOCK_H": cfg.block_h, "BLOCK_N": cfg.block_n, "FP8": scales is not None,
        "INTERPRETED": interpreted, **launch,
    }  # fmt: skip
    # what the three MLA stage-1 kernels take besides ``shared`` (one latent KV head)
    mla = {"KV": k_rows, "KV_SCALE": k_scale, "num_heads": num_heads,
           "stride_kv_slot": k_rows.stride(0), "stride_s_slot": k_scale.stride(0)}  # fmt: skip

    def shared_but(*names: str) -> dict:
        return {k: v for k, v in shared.items() if k not in names}

    if v_from_k and (cfg.wgmma or cfg.e4m3):
        if cfg.e4m3:
            if cfg.e4m3_in_place:
                kernel, flags = mla_fp8_e4m3_inplace_kernel, {}
            else:
                kernel, flags = mla_fp8_e4m3_kernel, {"Q_IN_CONSUMER": cfg.q_in_consumer,
                                                      "piece_len": piece_len,
                                                      "pieces": pieces}  # fmt: skip
            kernel[(programs, splits)](
                ONLY=cfg.only, **flags, **mla, **shared_but("FP8", "INTERPRETED", "num_stages")
            )
        else:
            mla_fp8_wgmma_kernel[(programs, splits)](
                ONLY=cfg.only, **mla, **shared_but("FP8", "INTERPRETED", "num_stages")
            )
    elif v_from_k and cfg.heads_m:
        mla_heads_kernel[(programs, splits)](
            **mla, **shared_but("INTERPRETED", "num_stages", "BLOCK_H", "BLOCK_N")
        )
    elif v_from_k and cfg.latent_quarters and dim >= 64:
        kernel = _mla_tokens_m_kernel if cfg.tokens_as_m else _mla_kernel
        kernel[(programs, splits)](
            QK_PARTS=cfg.qk_fp8_parts, PV_PARTS=cfg.pv_fp8_parts, **mla, **shared
        )
    else:
        _split_kernel[(programs, splits)](
            K=k_rows, V=v_rows, K_SCALE=k_scale, V_SCALE=v_scale,
            num_kv_heads=num_kv_heads, group_size=group,
            stride_k_slot=k_rows.stride(0), stride_k_head=k_rows.stride(1),
            stride_v_slot=v_rows.stride(0), stride_v_head=v_rows.stride(1),
            stride_ks_slot=k_scale.stride(0), stride_ks_head=k_scale.stride(1),
            stride_vs_slot=v_scale.stride(0), stride_vs_head=v_scale.stride(1),
            DV=dv, V_FROM_K=v_from_k, **shared,
        )  # fmt: skip
    _merge(part_out, part_lse, out, cfg.merge_at_once)
    return out


def merge_dims_a_program(splits: int, dv: int) -> int:
    """``_merge_at_once_kernel``'s slice of dims: its tile (every split's row of them) at most
    8,192 floats, 64 registers a thread of its 4 warps, and at least 16 dims (64 bytes a row)."""
    return max(16, min(dv, 8192 // triton.next_power_of_2(splits)))


def _merge(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, at_once: bool):
    """Stage 2: ``out[b, h]`` from the splits' partial outputs ``part_out[b, h, s]``."""
    batch, num_heads, splits, dv = part_out.shape
    strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2), out.stride(0),
               out.stride(1))  # fmt: skip
    splits_p2 = triton.next_power_of_2(splits)
    if at_once:
        block_dv = merge_dims_a_program(splits, dv)
        _merge_at_once_kernel[(batch, num_heads, dv // block_dv)](
            part_out, part_lse, out, splits, *strides, DV=dv, BLOCK_DV=block_dv,
            SPLITS_P2=splits_p2, num_warps=4,
        )  # fmt: skip
    else:
        _merge_kernel[(batch, num_heads)](
            part_out, part_lse, out, num_heads, splits, *strides, DV=dv, SPLITS_P2=splits_p2,
            num_warps=4 if dv >= 256 else 2,
        )  # fmt: skip


def stream_programs(tokens_bound: int, batch: int, block_n: int, max_split_tokens: int,
                    head_blocks: int, sms: int, waves: int = 1) -> int:  # fmt: skip
    """Programs a head block for the stream schedule: ``waves`` waves of one program an SM, or
    as many more whole waves as keep every run within ``max_split_tokens`` (its tiles at most
    ``tokens_bound / block_n`` plus one partial tile a request)."""
    if max_split_tokens:
        tiles = triton.cdiv(tokens_bound, block_n) + batch
        per_run = max(max_split_tokens // block_n, 1)
        waves = max(waves, triton.cdiv(triton.cdiv(tiles, per_run) * head_blocks, sms))
    return max(1, waves * sms // head_blocks)


def _stream_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor | None,
    table: PageTable,
    sm_scale: float,
    rope_dim: int,
    out: torch.Tensor,
    cfg: DecodeConfig,
    tokens_bound: int,
    sms: int,
) -> None:
    """The e4m3 MLA kernel (FP8, up to 16 heads) or the heads-as-M one (``cfg.heads_m``; BF16
    where ``kv_scale`` is None) on the stream schedule (mla_stream.py) and its merge, for a batch
    of at most ``tokens_bound`` tokens (``paged_decode`` checked the shapes)."""
    batch, num_heads, qk_dim = q.shape
    dim, dv = qk_dim - rope_dim, out.shape[2]
    head_blocks = triton.cdiv(num_heads, cfg.block_h)
    programs = stream_programs(tokens_bound, batch, cfg.block_n, cfg.max_split_tokens,
                               head_blocks, sms, cfg.balanced_waves)  # fmt: skip
    part_out = torch.empty(programs, num_heads, 2, dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(programs, num_heads, 2, dtype=torch.float32, device=q.device)
    # the batch's lengths, one a thread of the stage-1 kernel (and of the merge)
    batch_p2 = max(32 * cfg.num_warps, triton.next_power_of_2(batch))
    lens = {"seq_lens": table.seq_lens, "indptr": table.indptr, "batch": batch,
            "LENS_ARE_ENDS": table.seq_lens_are_ends, "BATCH_P2": batch_p2}  # fmt: skip
    parts = {"part_out": part_out, "part_lse": part_lse}
    scales = kv if kv_scale is None else kv_scale  # unused when BF16
    stage_one = {
        "Q": q, "KV": kv, "KV_SCALE": scales, "indices": table.indices, "out": out,
        "sm_scale_log2e": sm_scale * LOG2E, "num_heads": num_heads, "stride_qb": q.stride(0),
        "stride_qh": q.stride(1), "stride_kv_slot": kv.stride(0),
        "stride_s_slot": scales.stride(0),
        "stride_ob": out.stride(0), "stride_oh": out.stride(1), "stride_pb": part_out.stride(0),
        "stride_ph": part_out.stride(1), "stride_ps": part_out.stride(2),
        "PAGE_SIZE": table.page_size, "ENTRIES_PER_PAGE": table.entries_per_page, "D": dim,
        "D_ROPE": rope_dim, "num_warps": cfg.num_warps, **lens, **parts,
    }  # fmt: skip
    if cfg.heads_m:  # its tile sizes are the kernel's own constants
        mla_heads_stream_kernel[(programs, head_blocks)](FP8=kv_scale is not None, **stage_one)
    else:
        mla_fp8_e4m3_stream_kernel[(programs, head_blocks)](
            BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, ONLY=cfg.only, **stage_one
        )
    _stream_merge_kernel[(batch, num_heads)](
        out=out, programs=programs, stride_pp=part_out.stride(0), stride_ph=part_out.stride(1),
        stride_ps=part_out.stride(2), stride_ob=out.stride(0), stride_oh=out.stride(1), DV=dv,
        BLOCK_N=cfg.block_n, num_warps=4, **lens, **parts,
    )  # fmt: skip
