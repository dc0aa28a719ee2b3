"""MLA decode variants that were measured and not kept as defaults stay correct: the transposed
kernel (tokens as the MMA's M) and e4m3 products with q and p each in two e4m3 parts (one part
misses the FP8 tolerance: bench/results/fp8_kv_flashmla_variants.json); and the Gluon FP8
default on Hopper, on the GPU at edge lengths (under the interpreter the Triton kernel runs in
its place, in test_paged_decode.py).

e4m3 casts need ``gpu_like_interpreter`` on the CPU (the interpreter's own cast drops the carry
into the exponent), so these live in their own module."""

import pytest
from tessera.kernels.paged_decode_split import (
    MLA_FP8_E4M3,
    MLA_FP8_E4M3_IN_PLACE,
    MLA_FP8_WGMMA,
    MLA_HEADS_M,
    DecodeConfig,
)
from test_paged_decode import run_mla

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
@pytest.mark.parametrize("config", [MLA_FP8_E4M3, MLA_FP8_E4M3_IN_PLACE], ids=["regs", "in_place"])
def test_e4m3_kernel_matches_reference(page_size, balanced, heads, config):
    """Both products in e4m3 (q and p in two parts; V^T an MMA operand in registers, or
    written over the tile by the producer): the same edge lengths, head counts and page tables
    as the widening kernel, the same tolerance."""
    run_mla("fp8", [1, 63, 64, 65, 700, 3001], page_size, heads, config=config,
            balanced=balanced, sglang_form=page_size == 64)  # fmt: skip


@pytest.mark.gpu
def test_wgmma_kernel_refuses_bf16_pages():
    with pytest.raises(ValueError, match="wgmma MLA kernel takes FP8 pages"):
        run_mla("bf16", [70], 64, 16, config=MLA_FP8_WGMMA)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("heads", [64, 80, 128])
def test_heads_m_kernel_matches_reference(kv_dtype, page_size, balanced, heads):
    """The Gluon 64-heads kernel (heads as the MMA's M): single tokens, tiles that end one
    short, exactly and one past a page, many tiles; one head block, a padded second one (80)
    and two full ones (128); page ids and SGLang's token slots."""
    run_mla(kv_dtype, [1, 63, 64, 65, 700, 3001], page_size, heads, config=MLA_HEADS_M,
            balanced=balanced, sglang_form=page_size == 64)  # fmt: skip
