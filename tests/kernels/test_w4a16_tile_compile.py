"""The Triton INT4 kernels' activations-first tiles of 16 and 32 rows at group 128 build for
Hopper without a GPU (Triton's bundled ptxas) with the group's offset added per weight: a K
step's tensor-core instructions are the eight nibble planes' dots alone, each packed pair of
weights takes one ``HADD2`` or ``HFMA2`` (the fma with ``-(128 + zero)``), the loop holds at
most two CTA barriers (the pipeline's, which the scales' layout change shares; v18's rank-1
offset term, summed across the warps, had added three), and nothing spills. Every build runs
with the installed Triton and with the engine image's, in a child process outside the
interpreter (``bench/w4a16_sass.py``'s report)."""

import pytest
from test_mla_wgmma_compile import offline_build, triton_dir  # noqa: F401 (a fixture)


@pytest.mark.parametrize(("rows", "block_n"), [(16, 128), (16, 256), (32, 128)])
@pytest.mark.parametrize(("moe", "silu"), [(False, False), (True, False), (True, True)])
def test_small_tiles_add_the_group_offset_per_weight(
    rows, block_n, moe, silu, triton_dir  # noqa: F811 (the fixture)
):
    built = offline_build(
        "w4a16_sass", f"tile_report(({rows}, {block_n}, 128, 4, 3), moe={moe}, silu={silu})",
        triton_dir,
    )  # fmt: skip
    n_tiles = block_n // 4 // 8  # 4 warps side by side, 8 columns an MMA
    loop = built["loop"]
    assert loop.get("HMMA") == 8 * n_tiles * rows // 16, built
    # 8 planes x an MMA's two bf16x2 of B; ptxas writes some of the fmas as HFMA2
    assert loop.get("HADD2", 0) + loop.get("HFMA2", 0) == 8 * n_tiles * 2, built
    assert loop.get("BAR", 0) <= 2, built
    assert "STACK:0" in built["resources"] and not loop.get("STL"), built
