"""MLA decode variants that were measured and not kept as defaults stay correct: the transposed
kernel (tokens as the MMA's M) and e4m3 products with q and p each in two e4m3 parts (one part
misses the FP8 tolerance: bench/results/fp8_kv_flashmla_variants.json).

e4m3 casts need ``gpu_like_interpreter`` on the CPU (the interpreter's own cast drops the carry
into the exponent), so these live in their own module."""

import pytest
from tessera.kernels.paged_decode_split import DecodeConfig
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
