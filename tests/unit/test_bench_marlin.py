"""The Marlin peer's host-side layout steps (bench/marlin.py): scale order and block size.
Marlin itself runs only on the GPU; the benchmarks check its output against the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from marlin import marlin_block, marlin_scales  # noqa: E402


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
