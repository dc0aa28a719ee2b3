"""MLA decode variants that were measured and not kept as defaults stay correct: the transposed
kernel (tokens as the MMA's M) and e4m3 products with q and p each in two e4m3 parts (one part
misses the FP8 tolerance: bench/results/fp8_kv_flashmla_variants.json); and the Gluon FP8
default on Hopper, on the GPU at edge lengths (under the interpreter the Triton kernel runs in
its place, in test_paged_decode.py).

e4m3 casts need ``gpu_like_interpreter`` on the CPU (the interpreter's own cast drops the carry
into the exponent), so these live in their own module."""

from dataclasses import replace

import pytest
import torch
from tessera.kernels.paged_decode_fp8 import paged_decode_mla_fp8, paged_decode_mla_fp8_ref
from tessera.kernels.paged_decode_split import (
    HEADS_STREAM_MAX_BATCH,
    MLA_FP8_E4M3,
    MLA_FP8_E4M3_128,
    MLA_FP8_E4M3_IN_PLACE,
    MLA_FP8_E4M3_Q_IN_CONSUMER,
    MLA_FP8_E4M3_STREAM,
    MLA_FP8_WGMMA,
    MLA_HEADS_M,
    MLA_HEADS_M_STREAM,
    DecodeConfig,
)
from tessera.kernels.paged_kv import PageTable
from test_paged_decode import REL_L2, assert_close, quantized, run_mla

pytestmark = pytest.mark.usefixtures("gpu_like_interpreter")


@pytest.mark.parametrize(
    ("kv_dtype", "config"),
    [
        ("bf16", DecodeConfig(64, 16, 4, 2, True, tokens_as_m=True)),
        ("fp8", DecodeConfig(64, 16, 4, 2, True, tokens_as_m=True)),  # fp16 products
        ("fp8", DecodeConfig(64, 16, 4, 2, True, qk_fp8_parts=2, tokens_as_m=True)),
        (
            "fp8",
            DecodeConfig(64, 16, 4, 2, True, qk_fp8_parts=2, pv_fp8_parts=2, tokens_as_m=True),
        ),  # fmt: skip
        ("fp8", DecodeConfig(32, 16, 4, 2, True, qk_fp8_parts=2, pv_fp8_parts=2)),
        ("bf16", DecodeConfig(64, 64, 8, 2, True, 1, tokens_as_m=True)),  # 64 heads a program
    ],
)
def test_mla_variants_match_reference(kv_dtype, config):
    run_mla(kv_dtype, [3, 70], 16, heads=config.block_h, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("heads", [8, 16, 20])
def test_wgmma_kernel_matches_reference(page_size, balanced, heads):
    """Single tokens, tiles that end one short, exactly and one past a page, many tiles; padded
    heads (8) and two head blocks (20); page tables of page ids and of SGLang's token slots."""
    run_mla("fp8", [1, 63, 64, 65, 700, 3001], page_size, heads, config=MLA_FP8_WGMMA,
            balanced=balanced, sglang_form=page_size == 64)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("heads", [8, 16, 20])
@pytest.mark.parametrize(
    "config",
    [
        MLA_FP8_E4M3, MLA_FP8_E4M3_128, MLA_FP8_E4M3_IN_PLACE, MLA_FP8_E4M3_STREAM,
        MLA_FP8_E4M3_Q_IN_CONSUMER, replace(MLA_FP8_E4M3_128, q_in_consumer=True),
        replace(MLA_FP8_E4M3, max_split_tokens=64), replace(MLA_FP8_E4M3_128, max_split_tokens=128),
    ],
    ids=["regs", "regs_128", "in_place", "stream", "regs_q_in_consumer", "regs_128_q_in_consumer",
         "regs_pieces", "regs_128_pieces"],
)  # fmt: skip
def test_e4m3_kernel_matches_reference(page_size, balanced, heads, config):
    """Both products in e4m3 (q and p in two parts; V^T an MMA operand in registers, on 64-
    or 128-token tiles, or written over the tile by the producer; the first on the stream
    schedule too): the same edge lengths (around 128-token tiles too), head counts and page
    tables as the widening kernel, the same tolerance. With a cap of one tile a split the
    register kernel cuts its splits into pieces (2 to 6 of them, lengths unknown: ``plan_pieces``;
    known, the balanced plan caps them by more splits)."""
    run_mla("fp8", [1, 63, 64, 65, 127, 129, 700, 3001], page_size, heads, config=config,
            balanced=balanced, sglang_form=page_size == 64)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("sglang_form", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
def test_stream_schedule_cuts_requests_anywhere(sglang_form, balanced):
    """The stream schedule: empty requests (zeros) among others; 300 short requests, more than
    programs, so each program finishes several; a long one cut across dozens of programs, with
    cuts inside and at the ends of its tiles."""
    lens = [0, 1, 63, 0, 64, 65, 700, 3001] + [1 + 37 * i % 200 for i in range(300)] + [0]
    run_mla("fp8", lens, 64, 16, config=MLA_FP8_E4M3_STREAM, balanced=balanced,
            sglang_form=sglang_form)  # fmt: skip


@pytest.mark.gpu
def test_wgmma_kernel_refuses_bf16_pages():
    with pytest.raises(ValueError, match="wgmma MLA kernel takes FP8 pages"):
        run_mla("bf16", [70], 64, 16, config=MLA_FP8_WGMMA)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("heads", [64, 80, 128])
@pytest.mark.parametrize("config", [MLA_HEADS_M, MLA_HEADS_M_STREAM], ids=["splits", "stream"])
def test_heads_m_kernel_matches_reference(kv_dtype, page_size, balanced, heads, config):
    """The Gluon 64-heads kernel (heads as the MMA's M), on split plans and on the stream
    schedule: single tokens, tiles that end one short, exactly and one past a page, many tiles;
    one head block, a padded second one (80) and two full ones (128); page ids and SGLang's
    token slots."""
    run_mla(kv_dtype, [1, 63, 64, 65, 700, 3001], page_size, heads, config=config,
            balanced=balanced, sglang_form=page_size == 64)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize(
    ("heads", "config"),
    [(16, MLA_FP8_WGMMA), (16, MLA_FP8_E4M3_IN_PLACE), (16, MLA_FP8_E4M3), (8, MLA_FP8_E4M3_128),
     (16, MLA_FP8_E4M3_Q_IN_CONSUMER)],
    ids=["wgmma", "in_place", "regs", "regs_128", "regs_q_in_consumer"],
)  # fmt: skip
def test_short_splits_merged_at_once_match_reference(balanced, heads, config):
    """Each FP8 Gluon kernel with its splits as short as one tile, merged at once (the request
    of 20k: 33 splits in equal parts at 16 heads, up to 105 on the balanced plans)."""
    assert config.min_split_tiles == 1 and config.merge_at_once
    run_mla("fp8", [1, 65, 700, 20000], 64, heads, config=config, balanced=balanced,
            sglang_form=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", [64, 128])
def test_heads_m_stream_cuts_requests_anywhere(kv_dtype, heads):
    """The heads-as-M kernel on the stream schedule: empty requests among others, 240 short
    ones (more than programs, so each program finishes several) and a long one cut across
    dozens of programs (66 a head block at 128 heads), 249 requests in all (the most it takes:
    HEADS_STREAM_MAX_BATCH)."""
    lens = [0, 1, 63, 0, 64, 65, 700, 3001] + [1 + 37 * i % 200 for i in range(240)] + [0]
    assert len(lens) <= HEADS_STREAM_MAX_BATCH
    run_mla(kv_dtype, lens, 64, heads, config=MLA_HEADS_M_STREAM, sglang_form=True)


@pytest.mark.gpu
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize(
    "config",
    [MLA_FP8_E4M3, MLA_FP8_E4M3_128, MLA_FP8_E4M3_STREAM, MLA_FP8_E4M3_Q_IN_CONSUMER],
    ids=["splits", "128", "stream", "q_in_consumer"],
)
def test_e4m3_kernel_stays_accurate_over_long_splits(balanced, config):
    """The e4m3 kernels sum a split's tiles inside the tensor cores, with fewer bits than fp32,
    so their error grows with a split's length: uncapped, 132 requests of 16k (one split of 256
    tiles each) measured 6.7-9.0e-3 against their own dequantized pages. The requests share
    one cache of 16k tokens (their own queries), so the reference is one request's."""
    batch, length, page = 132, 16384, 64
    pages = torch.randperm(length // page).tolist()
    table = PageTable.from_page_lists([pages] * batch, [length] * batch, page, "cuda")
    q = torch.randn(batch, 16, 576, device="cuda").bfloat16()
    kv8, scales = quantized(torch.randn(length // page, page, 1, 576, device="cuda").bfloat16())
    known = {"max_seq_len": length, "total_tokens": batch * length} if balanced else {}
    sm_scale = 192**-0.5
    out = paged_decode_mla_fp8(q, kv8, scales, table, sm_scale, config=config, **known)
    one = PageTable.from_page_lists([pages] * 4, [length] * 4, page, "cuda")
    ref = paged_decode_mla_fp8_ref(q[:4], kv8, scales, one, sm_scale)
    assert_close(out[:4], ref, REL_L2["fp8"])
