"""The SGLang peers' host-side steps: Marlin's layout (bench/marlin.py: scale order and block
size) and the router GEMM's build (bench/sglang_jit_build.py). The kernels themselves run only
on the GPU; the benchmarks check their output against the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from marlin import marlin_block, marlin_scales  # noqa: E402
from sglang_jit_build import tiny_gemm_unit  # noqa: E402


def test_scales_transpose_each_8x8_block_of_64_columns_within_its_group_row() -> None:
    experts, groups, n = 3, 4, 128
    s = torch.arange(experts * groups * n, dtype=torch.float32).reshape(experts, groups, n)
    out = marlin_scales(s)
    assert out.shape == s.shape
    for e, g, c in [(0, 0, 0), (0, 0, 1), (0, 0, 8), (1, 2, 63), (2, 3, 64 + 9), (2, 1, 127)]:
        block, j = divmod(c, 64)
        src = block * 64 + (j % 8) * 8 + j // 8
        assert out[e, g, c] == s[e, g, src], (e, g, c)
    # a permutation of each group row: nothing moves across groups or experts
    assert torch.equal(out.sort(-1).values, s)


def test_block_size_is_the_first_that_average_rows_fill_under_90_percent() -> None:
    assert marlin_block(1, 8, 384) == 8
    assert marlin_block(768, 8, 384) == 32  # 16 rows per expert: 16 / 16 = 1.0, 16 / 32 = 0.5
    assert marlin_block(96, 1, 48) == 8  # 2 rows: 0.25 of 8
    assert marlin_block(100_000, 8, 8) == 64


def test_router_gemm_unit_splits_columns_as_sglang_does() -> None:
    """SGLang's tiny-N GEMM for the routers: the smallest column split whose blocks fit one wave
    of the H200's 132 SMs (Kimi K2: 384 experts -> 3 columns a block, 128 blocks)."""
    _, export, kimi = tiny_gemm_unit(384, 7168, 132)
    assert export == "run"
    assert kimi == "TinyNGemmKernel<384, 7168, 16, 3, fp32_t, true, bf16_t>::run"
    assert ", 16, 2, fp32_t" in tiny_gemm_unit(256, 6144, 132)[2]  # GLM 5: 128 blocks
    assert ", 16, 1, fp32_t" in tiny_gemm_unit(256, 6144, 256)[2]  # one block a column fits
    with pytest.raises(SystemExit, match="not a shape"):
        tiny_gemm_unit(7168, 384, 132)  # K <= N: the tiny-K variant, not built here
