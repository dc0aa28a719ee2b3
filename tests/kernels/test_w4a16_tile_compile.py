"""The Triton INT4 kernels' 16-row tiles at group 128 build for Hopper without a GPU (Triton's
bundled ptxas) with the group's offset as a rank-1 term: a K step's tensor-core instructions
are the eight nibble planes' dots and one narrow dot of ones a plane (for the activation sums),
not a second full dot a plane, and nothing spills. A Triton whose layout choice put the ones
dot's warps on top of each other would double the loop and spill (as 8 columns of ones did);
this catches that on CPU. Every build runs with the installed Triton and with the engine
image's, in a child process outside the interpreter (``bench/w4a16_sass.py``'s report)."""

import pytest
from test_mla_wgmma_compile import offline_build, triton_dir  # noqa: F401 (a fixture)


@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize(("moe", "silu"), [(False, False), (True, False), (True, True)])
def test_16_row_tiles_take_the_group_offset_as_a_rank_1_term(
    block_n, moe, silu, triton_dir  # noqa: F811 (the fixture)
):
    built = offline_build(
        "w4a16_sass", f"tile_report((16, {block_n}, 128, 4, 3), moe={moe}, silu={silu})",
        triton_dir,
    )  # fmt: skip
    mmas_a_plane = block_n // 4 // 8  # 4 warps side by side, 8 columns an MMA
    assert built["loop"].get("HMMA") == 8 * mmas_a_plane + 8, built
    assert "STACK:0" in built["resources"] and not built["loop"].get("STL"), built
